//! The AVX2 builds of [`super::kernels`]: the same arithmetic as the scalar definitions
//! there (fused lane sums in order of the dimensions, the fixed reduction tree, values
//! accumulated in order of the keys), eight keys' scores or eight output vectors at a time.

use super::kernels::{score, Lanes, LANES};
use std::arch::x86_64::*;

/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` of each of eight accumulators, as
/// one vector (key `i` in lane `i`): `hadd` pairs lanes (0,1), (2,3) in each half, a second
/// `hadd` adds those pairs, and the halves are added last.
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

/// [`super::kernels::scores`].
///
/// # Safety
/// AVX2, FMA and F16C are available; `q.len()` is a multiple of 8; every
/// `rows[j] + q.len()` is at most `cache.len()`; `out.len() == rows.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores<T: Lanes>(
    q: &[f32],
    cache: &[T],
    rows: &[usize],
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    let full = rows.len() / 8 * 8;
    let base = cache.as_ptr();
    let vscale = _mm256_set1_ps(scale);
    for j0 in (0..full).step_by(8) {
        // SAFETY: rows[j0 + i] + hd ≤ cache.len() (the caller's contract), so every load
        // of 8 elements at a multiple of 8 below hd stays inside `cache`; `q` has hd floats
        // and `out` at least j0 + 8.
        unsafe {
            let k: [*const T; 8] = std::array::from_fn(|i| base.add(rows[j0 + i]));
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..hd).step_by(LANES) {
                let qv = _mm256_loadu_ps(q.as_ptr().add(c));
                for i in 0..8 {
                    acc[i] = _mm256_fmadd_ps(qv, T::load8(k[i].add(c)), acc[i]);
                }
            }
            let s = _mm256_mul_ps(reduce8(&acc), vscale);
            _mm256_storeu_ps(out.as_mut_ptr().add(j0), s);
        }
    }
    for j in full..rows.len() {
        out[j] = score(q, &cache[rows[j]..rows[j] + hd]) * scale;
    }
}

/// `W` output vectors (`8·W` dimensions from `d0`) over every key.
///
/// # Safety
/// As [`weighted_sum`], and `d0 + 8·W ≤ out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weighted_block<T: Lanes, const W: usize>(
    p: &[f32],
    base: *const T,
    rows: &[usize],
    d0: usize,
    out: &mut [f32],
) {
    // SAFETY: out has d0 + 8W floats; each row has out.len() elements from rows[j] (the
    // caller's contract), so the loads at rows[j] + d0 + 8i stay inside the cache.
    unsafe {
        let o = out.as_mut_ptr().add(d0);
        let mut acc: [__m256; W] = std::array::from_fn(|i| _mm256_loadu_ps(o.add(8 * i)));
        for (&pj, &at) in p.iter().zip(rows) {
            let pv = _mm256_set1_ps(pj);
            let v = base.add(at + d0);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, T::load8(v.add(8 * i)), *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * i), *a);
        }
    }
}

/// [`super::kernels::weighted_sum`].
///
/// # Safety
/// AVX2, FMA and F16C are available; `out.len()` is a multiple of 8; every
/// `rows[j] + out.len()` is at most `cache.len()`; `p.len() == rows.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum<T: Lanes>(p: &[f32], cache: &[T], rows: &[usize], out: &mut [f32]) {
    let base = cache.as_ptr();
    let mut d0 = 0;
    while d0 < out.len() {
        let w = ((out.len() - d0) / LANES).min(8);
        // SAFETY: d0 + 8w ≤ out.len(), and the caller's contract for the rows.
        unsafe {
            match w {
                8 => weighted_block::<T, 8>(p, base, rows, d0, out),
                7 => weighted_block::<T, 7>(p, base, rows, d0, out),
                6 => weighted_block::<T, 6>(p, base, rows, d0, out),
                5 => weighted_block::<T, 5>(p, base, rows, d0, out),
                4 => weighted_block::<T, 4>(p, base, rows, d0, out),
                3 => weighted_block::<T, 3>(p, base, rows, d0, out),
                2 => weighted_block::<T, 2>(p, base, rows, d0, out),
                _ => weighted_block::<T, 1>(p, base, rows, d0, out),
            }
        }
        d0 += LANES * w;
    }
}
