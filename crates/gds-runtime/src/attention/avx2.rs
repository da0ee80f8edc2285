//! The AVX2 builds of [`super::kernels`]: the same arithmetic as the scalar definitions
//! there (fused lane sums in order of the dimensions, the fixed reduction tree, values
//! accumulated in order of the keys, the same exponential), several keys and query heads
//! at a time: two query heads share every key load, which is what bounds these loops.

use super::kernels::{lane_sum, Lanes, LANES};
use crate::ops::exp_fast;
use std::arch::x86_64::*;

/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` of each of eight accumulators, as
/// one vector (accumulator `i` in lane `i`): `hadd` pairs lanes (0,1), (2,3) in each half, a
/// second `hadd` adds those pairs, and the halves are added last.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce8(a: &[__m256; 8]) -> __m256 {
    let t01 = _mm256_hadd_ps(a[0], a[1]);
    let t23 = _mm256_hadd_ps(a[2], a[3]);
    let t45 = _mm256_hadd_ps(a[4], a[5]);
    let t67 = _mm256_hadd_ps(a[6], a[7]);
    let u0 = _mm256_hadd_ps(t01, t23);
    let u1 = _mm256_hadd_ps(t45, t67);
    let lo = _mm256_permute2f128_ps(u0, u1, 0x20);
    let hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    _mm256_add_ps(lo, hi)
}

/// Row of key `j0 + i`, or of the last key where the block runs past the end (lanes
/// computed and thrown away, so a block never needs a scalar tail).
#[inline(always)]
fn row(rows: &[usize], j0: usize, i: usize) -> usize {
    rows[(j0 + i).min(rows.len() - 1)]
}

/// Stores the first `n` lanes of `v` at `out` (all eight when `n ≥ 8`).
///
/// # Safety
/// `out` has room for `min(n, 8)` floats; AVX available.
#[target_feature(enable = "avx")]
#[inline]
unsafe fn store_first(out: *mut f32, v: __m256, n: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        if n >= 8 {
            _mm256_storeu_ps(out, v);
        } else {
            let mut t = [0f32; 8];
            _mm256_storeu_ps(t.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(t.as_ptr(), out, n);
        }
    }
}

/// [`super::kernels::scores`]: heads in pairs (four keys × two heads per block of eight
/// accumulators), a last odd head alone (eight keys).
///
/// # Safety
/// AVX2, FMA and F16C are available; `hd` is a multiple of 8 and `q.len()` of `hd`; every
/// `rows[j] + hd` is at most `cache.len()`; `rows` is not empty; `out` holds `rows.len()`
/// floats from `i·stride` for each of the `q.len() / hd` query rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores<T: Lanes>(
    q: &[f32],
    hd: usize,
    cache: &[T],
    rows: &[usize],
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let (n, g) = (rows.len(), q.len() / hd);
    let base = cache.as_ptr();
    let vscale = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 2 <= g {
        let (q0, q1) = (q[i * hd..].as_ptr(), q[(i + 1) * hd..].as_ptr());
        for j0 in (0..n).step_by(4) {
            // SAFETY: every row has hd elements inside `cache` (the caller's contract), so
            // loads at row + c for c < hd stay inside; q0, q1 have hd floats; out rows i and
            // i + 1 have n floats from i·stride and (i + 1)·stride.
            unsafe {
                let k: [*const T; 4] = std::array::from_fn(|l| base.add(row(rows, j0, l)));
                let mut acc = [_mm256_setzero_ps(); 8];
                for c in (0..hd).step_by(LANES) {
                    let (a, b) = (_mm256_loadu_ps(q0.add(c)), _mm256_loadu_ps(q1.add(c)));
                    for l in 0..4 {
                        let kv = T::load8(k[l].add(c));
                        acc[l] = _mm256_fmadd_ps(a, kv, acc[l]);
                        acc[4 + l] = _mm256_fmadd_ps(b, kv, acc[4 + l]);
                    }
                }
                let s = _mm256_mul_ps(reduce8(&acc), vscale);
                let mut t = [0f32; 8];
                _mm256_storeu_ps(t.as_mut_ptr(), s);
                let m = (n - j0).min(4);
                out[i * stride + j0..][..m].copy_from_slice(&t[..m]);
                out[(i + 1) * stride + j0..][..m].copy_from_slice(&t[4..4 + m]);
            }
        }
        i += 2;
    }
    if i < g {
        let qi = q[i * hd..].as_ptr();
        for j0 in (0..n).step_by(8) {
            // SAFETY: as above, for one head.
            unsafe {
                let k: [*const T; 8] = std::array::from_fn(|l| base.add(row(rows, j0, l)));
                let mut acc = [_mm256_setzero_ps(); 8];
                for c in (0..hd).step_by(LANES) {
                    let a = _mm256_loadu_ps(qi.add(c));
                    for l in 0..8 {
                        acc[l] = _mm256_fmadd_ps(a, T::load8(k[l].add(c)), acc[l]);
                    }
                }
                let s = _mm256_mul_ps(reduce8(&acc), vscale);
                store_first(out[i * stride + j0..].as_mut_ptr(), s, n - j0);
            }
        }
    }
}

/// `H` heads × `W` output vectors (`8·W` dimensions from `d0`) over every key.
///
/// # Safety
/// As [`weighted_sum`], `i + H` heads exist, and `d0 + 8·W ≤ hd`.
// one loaded vector serves every head: the vector index runs outside the head index
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weighted_block<T: Lanes, const H: usize, const W: usize>(
    p: &[f32],
    stride: usize,
    base: *const T,
    rows: &[usize],
    hd: usize,
    i: usize,
    d0: usize,
    out: &mut [f32],
) {
    // SAFETY: out rows i..i + H have hd floats, d0 + 8W ≤ hd; p rows i..i + H have
    // rows.len() weights from (i + h)·stride; every row has hd elements inside the cache
    // (the caller's contract).
    unsafe {
        let o: [*mut f32; H] = std::array::from_fn(|h| out.as_mut_ptr().add((i + h) * hd + d0));
        let pr: [*const f32; H] = std::array::from_fn(|h| p.as_ptr().add((i + h) * stride));
        let mut acc: [[__m256; W]; H] =
            std::array::from_fn(|h| std::array::from_fn(|w| _mm256_loadu_ps(o[h].add(8 * w))));
        for (j, &at) in rows.iter().enumerate() {
            let v = base.add(at + d0);
            let pv: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(*pr[h].add(j)));
            for w in 0..W {
                let x = T::load8(v.add(8 * w));
                for h in 0..H {
                    acc[h][w] = _mm256_fmadd_ps(pv[h], x, acc[h][w]);
                }
            }
        }
        for h in 0..H {
            for w in 0..W {
                _mm256_storeu_ps(o[h].add(8 * w), acc[h][w]);
            }
        }
    }
}

/// [`super::kernels::weighted_sum`]: heads in pairs, 32 dimensions at a time (two heads ×
/// four vectors of accumulators), a last odd head 64 at a time.
///
/// # Safety
/// AVX2, FMA and F16C are available; `hd` is a multiple of 8 and `out.len()` of `hd`; every
/// `rows[j] + hd` is at most `cache.len()`; `p` holds `rows.len()` floats from `i·stride`
/// for each of the `out.len() / hd` output rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum<T: Lanes>(
    p: &[f32],
    stride: usize,
    cache: &[T],
    rows: &[usize],
    hd: usize,
    out: &mut [f32],
) {
    let g = out.len() / hd;
    let base = cache.as_ptr();
    let mut i = 0;
    while i + 2 <= g {
        let mut d0 = 0;
        while d0 < hd {
            let w = ((hd - d0) / LANES).min(4);
            // SAFETY: d0 + 8w ≤ hd, heads i, i + 1 exist, and the caller's contract.
            unsafe {
                match w {
                    4 => weighted_block::<T, 2, 4>(p, stride, base, rows, hd, i, d0, out),
                    3 => weighted_block::<T, 2, 3>(p, stride, base, rows, hd, i, d0, out),
                    2 => weighted_block::<T, 2, 2>(p, stride, base, rows, hd, i, d0, out),
                    _ => weighted_block::<T, 2, 1>(p, stride, base, rows, hd, i, d0, out),
                }
            }
            d0 += LANES * w;
        }
        i += 2;
    }
    if i < g {
        let mut d0 = 0;
        while d0 < hd {
            let w = ((hd - d0) / LANES).min(8);
            // SAFETY: as above, for head i.
            unsafe {
                match w {
                    8 => weighted_block::<T, 1, 8>(p, stride, base, rows, hd, i, d0, out),
                    7 => weighted_block::<T, 1, 7>(p, stride, base, rows, hd, i, d0, out),
                    6 => weighted_block::<T, 1, 6>(p, stride, base, rows, hd, i, d0, out),
                    5 => weighted_block::<T, 1, 5>(p, stride, base, rows, hd, i, d0, out),
                    4 => weighted_block::<T, 1, 4>(p, stride, base, rows, hd, i, d0, out),
                    3 => weighted_block::<T, 1, 3>(p, stride, base, rows, hd, i, d0, out),
                    2 => weighted_block::<T, 1, 2>(p, stride, base, rows, hd, i, d0, out),
                    _ => weighted_block::<T, 1, 1>(p, stride, base, rows, hd, i, d0, out),
                }
            }
            d0 += LANES * w;
        }
    }
}

/// [`super::kernels::pack`].
///
/// # Safety
/// AVX2 and F16C are available; `hd` is a multiple of 8; every `rows[j] + hd` is at most
/// `cache.len()`; `dst` holds `rows.len() · hd` floats.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn pack<T: Lanes>(cache: &[T], rows: &[usize], hd: usize, dst: &mut [f32]) {
    let base = cache.as_ptr();
    for (d, &at) in dst.chunks_exact_mut(hd).zip(rows) {
        for c in (0..hd).step_by(LANES) {
            // SAFETY: row `at` has hd elements inside `cache`, c + 8 ≤ hd; `d` holds hd.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr().add(c), T::load8(base.add(at + c))) };
        }
    }
}

/// [`crate::ops::exp_fast`] on eight lanes, operation for operation (no fused
/// multiply-adds: the scalar definition has none).
#[target_feature(enable = "avx2")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    const MAGIC: f32 = 12_582_912.0;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let magic = _mm256_set1_ps(MAGIC);
    let k = _mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        magic,
    );
    let n = _mm256_sub_ps(k, magic);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(crate::ops::EXP_LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(crate::ops::EXP_LN2_LO)),
    );
    let p = crate::ops::EXP_POLY;
    let mut y = _mm256_set1_ps(p[0]);
    for &c in &p[1..] {
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r),
        _mm256_set1_ps(1.0),
    );
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(k), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
}

/// [`super::kernels::exp_sum`].
///
/// # Safety
/// AVX2 is available.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_sum(x: &mut [f32], m: f32) -> f32 {
    let vm = _mm256_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        // SAFETY: `c` holds eight floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), vm));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; LANES];
    // SAFETY: `lanes` holds eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    for (v, l) in chunks.into_remainder().iter_mut().zip(&mut lanes) {
        let e = exp_fast(*v - m);
        *v = e;
        *l += e;
    }
    lane_sum(&lanes)
}

/// [`super::kernels::max`].
///
/// # Safety
/// AVX is available.
#[target_feature(enable = "avx")]
pub unsafe fn max(x: &[f32]) -> f32 {
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        // SAFETY: `c` holds eight floats. max_ps keeps `acc` where the input is NaN.
        acc = _mm256_max_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, acc);
    }
    let mut lanes = [0f32; LANES];
    // SAFETY: `lanes` holds eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes
        .iter()
        .chain(chunks.remainder())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}
