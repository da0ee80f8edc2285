//! The two inner loops of attention over one piece of keys, for one query head: scores
//! (`q · k` for every key) and the weighted sum of values. Each has a plain scalar
//! definition here and an AVX2 build in [`super::avx2`] that computes the same numbers bit
//! for bit (tested below), so a machine gives the same result whichever path a pass takes.
//!
//! The arithmetic, fixed so that both builds can follow it exactly:
//! - a score is eight lane sums, lane `l` accumulating `q[d]·k[d]` for `d ≡ l (mod 8)` in
//!   order of `d` with fused multiply-adds, then added as
//!   `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, then multiplied by the scale;
//! - an output element accumulates `p_j·v_j[d]` in order of the keys `j`, fused.
//!
//! Keys are rows of a KV cache layer: `rows[j]` is the index of key `j`'s first element
//! in `cache` (rows need not be contiguous: paged caches and rings).

use crate::kv::KvElem;

/// Score lanes per key: head dimensions must be a multiple of this for the AVX2 build.
pub const LANES: usize = 8;

/// A KV cache element the AVX2 kernels can load eight of as f32 (f16: converted by F16C,
/// exactly).
pub trait Lanes: KvElem {
    /// Eight elements at `p` as f32.
    ///
    /// # Safety
    /// `p` points to eight readable elements, and the CPU has AVX and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Lanes for f32 {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract: eight readable floats, AVX available.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Lanes for half::f16 {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn load8(p: *const half::f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract: eight readable halves (16 bytes), F16C available.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }
}

/// Whether the AVX2 kernels can run: AVX2, FMA and F16C on this CPU.
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[j] = (q · cache[rows[j]..][..hd]) · scale` for every key, `hd = q.len()`.
/// `simd` (from [`simd_available`]) picks the AVX2 build where the head width allows it.
///
/// # Panics
/// When a row runs past the end of `cache`, or `out` is shorter than `rows`.
pub fn scores<T: Lanes>(
    simd: bool,
    q: &[f32],
    cache: &[T],
    rows: &[usize],
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    check(cache.len(), rows, hd);
    let out = &mut out[..rows.len()];
    #[cfg(target_arch = "x86_64")]
    if simd && hd.is_multiple_of(LANES) {
        // SAFETY: `simd` is only true where simd_available() found AVX2, FMA and F16C; every
        // row lies inside `cache` (checked above) and `hd` is a multiple of 8.
        unsafe { super::avx2::scores(q, cache, rows, scale, out) };
        return;
    }
    let _ = simd;
    for (o, &at) in out.iter_mut().zip(rows) {
        *o = score(q, &cache[at..at + hd]) * scale;
    }
}

/// `out[d] += Σ_j p[j] · cache[rows[j] + d]` in order of `j`, `hd = out.len()`.
///
/// # Panics
/// When a row runs past the end of `cache`, or `p` is shorter than `rows`.
pub fn weighted_sum<T: Lanes>(simd: bool, p: &[f32], cache: &[T], rows: &[usize], out: &mut [f32]) {
    let hd = out.len();
    check(cache.len(), rows, hd);
    let p = &p[..rows.len()];
    #[cfg(target_arch = "x86_64")]
    if simd && hd.is_multiple_of(LANES) {
        // SAFETY: as in `scores`.
        unsafe { super::avx2::weighted_sum(p, cache, rows, out) };
        return;
    }
    let _ = simd;
    for (&pj, &at) in p.iter().zip(rows) {
        for (o, v) in out.iter_mut().zip(&cache[at..at + hd]) {
            *o = pj.mul_add(v.to_f32(), *o);
        }
    }
}

/// `x[i] = e^(x[i] − m)` and their sum, by [`crate::ops::exp_sub_sum`] (the AVX2 build of
/// the same loop where `simd`: the same numbers).
pub fn exp_sum(simd: bool, x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        #[target_feature(enable = "avx2")]
        fn vectorized(x: &mut [f32], m: f32) -> f32 {
            crate::ops::exp_sub_sum(x, m)
        }
        // SAFETY: `simd` is only true where simd_available() found AVX2.
        return unsafe { vectorized(x, m) };
    }
    let _ = simd;
    crate::ops::exp_sub_sum(x, m)
}

/// Every row `rows[j]..rows[j] + hd` inside a cache of `len` elements.
fn check(len: usize, rows: &[usize], hd: usize) {
    let end = rows
        .iter()
        .map(|&r| r.saturating_add(hd))
        .max()
        .unwrap_or(0);
    assert!(
        end <= len,
        "attention row ends at {end}, past the cache's {len}"
    );
}

/// One score without the scale: eight fused lane sums added as a fixed tree (module docs).
#[inline]
pub fn score<T: KvElem>(q: &[f32], k: &[T]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (qc, kc) in q.chunks(LANES).zip(k.chunks(LANES)) {
        for ((a, &x), y) in acc.iter_mut().zip(qc).zip(kc) {
            *a = x.mul_add(y.to_f32(), *a);
        }
    }
    tree8(&acc)
}

/// `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`.
#[inline(always)]
pub fn tree8(a: &[f32; LANES]) -> f32 {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Rows scattered through a cache (a gap between blocks, as a paged cache has).
    fn rows(n: usize, hd: usize, stride: usize) -> Vec<usize> {
        (0..n).map(|j| (j + j / 5 * 3) * stride + hd / 2).collect()
    }

    fn check_both<T: Lanes>(cache: &[T], hd: usize, n: usize, stride: usize) {
        let q = values(hd, 7 + hd as u64);
        let r = rows(n, hd, stride);
        let (mut s0, mut s1) = (vec![0f32; n], vec![0f32; n]);
        scores(false, &q, cache, &r, 0.125, &mut s0);
        scores(true, &q, cache, &r, 0.125, &mut s1);
        for (j, &at) in r.iter().enumerate() {
            let want: f64 = q
                .iter()
                .zip(&cache[at..at + hd])
                .map(|(a, b)| *a as f64 * b.to_f32() as f64)
                .sum::<f64>()
                * 0.125;
            assert!((s0[j] as f64 - want).abs() < 1e-5, "hd {hd} key {j}");
        }
        let p = values(n, 9);
        let (mut o0, mut o1) = (vec![0.5f32; hd], vec![0.5f32; hd]);
        weighted_sum(false, &p, cache, &r, &mut o0);
        weighted_sum(true, &p, cache, &r, &mut o1);
        if simd_available() {
            assert_eq!(s0, s1, "scores, hd {hd} n {n}: the AVX2 build differs");
            assert_eq!(
                o0, o1,
                "weighted sum, hd {hd} n {n}: the AVX2 build differs"
            );
        }
    }

    #[test]
    fn the_avx2_kernels_compute_the_scalar_definition_bit_for_bit() {
        for hd in [8usize, 64, 96, 128, 256] {
            let stride = 3 * hd;
            for n in [1usize, 7, 8, 9, 31, 256] {
                let len = (n + n / 5 * 3 + 1) * stride;
                let c32 = values(len, hd as u64 * 31 + n as u64);
                check_both(&c32, hd, n, stride);
                let c16: Vec<f16> = c32.iter().map(|&x| f16::from_f32(x * 4.0)).collect();
                check_both(&c16, hd, n, stride);
            }
        }
    }

    #[test]
    #[should_panic(expected = "past the cache")]
    fn a_row_past_the_cache_is_refused() {
        let cache = vec![0f32; 64];
        let mut out = [0f32; 1];
        scores(true, &[0.0; 16], &cache, &[50], 1.0, &mut out);
    }
}
