//! The inner loops of attention over one piece of keys, for the query heads that share a KV
//! head: scores (`q · k` for every key), the softmax's max and exponentials, and the
//! weighted sum of values. Each has a plain scalar definition here and an AVX2 build in
//! [`super::avx2`] that computes the same numbers bit for bit (tested below), so a machine
//! gives the same result whichever path a pass takes.
//!
//! The arithmetic, fixed so that both builds can follow it exactly:
//! - a score is eight lane sums, lane `l` accumulating `q[d]·k[d]` for `d ≡ l (mod 8)` in
//!   order of `d` with fused multiply-adds, then added as
//!   `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, then multiplied by the scale;
//! - an output element accumulates `p_j·v_j[d]` in order of the keys `j`, fused.
//!
//! - exponentials are [`crate::ops::exp_fast`], summed in eight lanes added in order.
//!
//! Keys are rows of a KV cache layer ([`Keys`]): `rows[j]` is the index of key `j`'s first
//! element in the cache (rows need not be contiguous: paged caches and rings).

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

/// The keys of one piece: `rows[j]` is the index of key `j`'s first element in a cache
/// layer. The end of the furthest row is computed once, so each kernel checks its cache in
/// constant time.
pub struct Keys<'a> {
    rows: &'a [usize],
    hd: usize,
    /// One past the last element any row reaches.
    end: usize,
}

impl<'a> Keys<'a> {
    /// Keys of `hd` elements at `rows`.
    pub fn new(rows: &'a [usize], hd: usize) -> Keys<'a> {
        let end = rows
            .iter()
            .map(|&r| r.saturating_add(hd))
            .max()
            .unwrap_or(0);
        Keys { rows, hd, end }
    }

    /// The rows, once checked to lie inside a cache of `len` elements, `hd` each.
    ///
    /// # Panics
    /// When a row runs past the end of the cache, or the keys are `hd` wide no more.
    fn rows_in(&self, len: usize, hd: usize) -> &'a [usize] {
        assert!(
            self.end <= len,
            "attention row ends at {}, past the cache's {len}",
            self.end
        );
        assert_eq!(hd, self.hd, "keys of another width");
        self.rows
    }
}

/// Scores of a group of query heads (`q`: `g` rows of `hd`) against every key:
/// `out[i·stride + j] = (q_i · key_j) · scale`, `j < n = keys.len() ≤ stride`. `simd` (from
/// [`crate::ops::simd_available`]) picks the AVX2 build where the head width is a multiple of 8.
#[allow(clippy::too_many_arguments)]
pub fn scores<T: Lanes>(
    simd: bool,
    q: &[f32],
    hd: usize,
    cache: &[T],
    keys: &Keys<'_>,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let rows = keys.rows_in(cache.len(), hd);
    let (n, g) = (rows.len(), q.len() / hd);
    if n == 0 || g == 0 {
        return;
    }
    assert!(n <= stride, "{n} scores in rows of {stride}");
    let out = &mut out[..(g - 1) * stride + n];
    #[cfg(target_arch = "x86_64")]
    if simd && hd.is_multiple_of(LANES) {
        // SAFETY: `simd` is only true where simd_available() found AVX2, FMA and F16C; every
        // row's hd elements lie inside `cache` (Keys::new) and hd is a multiple of 8; `out`
        // holds n scores from i·stride for each of the g query rows.
        unsafe { super::avx2::scores(q, hd, cache, rows, scale, out, stride) };
        return;
    }
    let _ = simd;
    for (i, qi) in q.chunks_exact(hd).enumerate() {
        for (o, &at) in out[i * stride..][..n].iter_mut().zip(rows) {
            *o = score(qi, &cache[at..at + hd]) * scale;
        }
    }
}

/// Weighted sums of values for a group of query heads (`p`: `g` rows of `n` weights, row
/// `i` from `p[i·stride]`): `out[i·hd + d] += Σ_j p[i·stride + j] · value_j[d]`, in order of `j`.
pub fn weighted_sum<T: Lanes>(
    simd: bool,
    p: &[f32],
    stride: usize,
    cache: &[T],
    keys: &Keys<'_>,
    hd: usize,
    out: &mut [f32],
) {
    let rows = keys.rows_in(cache.len(), hd);
    let (n, g) = (rows.len(), out.len() / hd);
    if n == 0 || g == 0 {
        return;
    }
    assert!(n <= stride, "{n} weights in rows of {stride}");
    let p = &p[..(g - 1) * stride + n];
    #[cfg(target_arch = "x86_64")]
    if simd && hd.is_multiple_of(LANES) {
        // SAFETY: as in `scores`; `p` holds n weights from i·stride for each output row.
        unsafe { super::avx2::weighted_sum(p, stride, cache, rows, hd, out) };
        return;
    }
    let _ = simd;
    for (i, o) in out.chunks_exact_mut(hd).enumerate() {
        for (&pj, &at) in p[i * stride..][..n].iter().zip(rows) {
            for (o, v) in o.iter_mut().zip(&cache[at..at + hd]) {
                *o = pj.mul_add(v.to_f32(), *o);
            }
        }
    }
}

/// The keys' rows as f32, one after the other: `dst[j·hd..(j + 1)·hd]` is row `j` (f16
/// converted exactly); `simd` picks the AVX2 build (F16C) where `hd` is a multiple of 8.
pub fn pack<T: Lanes>(simd: bool, cache: &[T], keys: &Keys<'_>, hd: usize, dst: &mut [f32]) {
    let rows = keys.rows_in(cache.len(), hd);
    let dst = &mut dst[..rows.len() * hd];
    #[cfg(target_arch = "x86_64")]
    if simd && hd.is_multiple_of(LANES) {
        // SAFETY: `simd` is only true where simd_available() found AVX2 and F16C; every
        // row's hd elements lie inside `cache` (Keys::new); `dst` holds rows.len() · hd.
        unsafe { super::avx2::pack(cache, rows, hd, dst) };
        return;
    }
    let _ = simd;
    for (d, &at) in dst.chunks_exact_mut(hd).zip(rows) {
        for (d, v) in d.iter_mut().zip(&cache[at..at + hd]) {
            *d = v.to_f32();
        }
    }
}

/// `x[i] = e^(x[i] − m)` by [`crate::ops::exp_fast`], returning their sum (eight lane sums,
/// element `i` in lane `i mod 8`, added in lane order); the AVX2 build where `simd` computes
/// the same numbers.
pub fn exp_sum(simd: bool, x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true where simd_available() found AVX2 and FMA.
        return unsafe { super::avx2::exp_sum(x, m) };
    }
    let _ = simd;
    let mut acc = [0.0f32; LANES];
    for (i, v) in x.iter_mut().enumerate() {
        let e = crate::ops::exp_fast(*v - m);
        *v = e;
        acc[i % LANES] += e;
    }
    lane_sum(&acc)
}

/// `((((((a0 + a1) + a2) + a3) + a4) + a5) + a6) + a7`.
#[inline(always)]
pub fn lane_sum(a: &[f32; LANES]) -> f32 {
    a[1..].iter().fold(a[0], |s, &v| s + v)
}

/// The largest value (−∞ for none; NaNs are skipped).
pub fn max(simd: bool, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true where simd_available() found AVX2.
        return unsafe { super::avx2::max(x) };
    }
    let _ = simd;
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
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
pub(crate) mod tests {
    use super::*;
    use crate::ops::simd_available;
    use half::f16;

    /// `n` values in [-1, 1) from `seed`.
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
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
        let r = rows(n, hd, stride);
        let keys = Keys::new(&r, hd);
        // 1..=9 heads: the two-head blocks and a last odd head
        for g in 1usize..=9 {
            let q = values(g * hd, 7 + hd as u64 + g as u64);
            let (mut s0, mut s1) = (vec![0f32; g * n], vec![0f32; g * n]);
            scores(false, &q, hd, cache, &keys, 0.125, &mut s0, n);
            scores(true, &q, hd, cache, &keys, 0.125, &mut s1, n);
            for i in 0..g {
                for (j, &at) in r.iter().enumerate() {
                    let want: f64 = q[i * hd..(i + 1) * hd]
                        .iter()
                        .zip(&cache[at..at + hd])
                        .map(|(a, b)| *a as f64 * b.to_f32() as f64)
                        .sum::<f64>()
                        * 0.125;
                    assert!(
                        (s0[i * n + j] as f64 - want).abs() < 1e-5,
                        "hd {hd} key {j}"
                    );
                }
            }
            let p = values(g * n, 9);
            let (mut o0, mut o1) = (vec![0.5f32; g * hd], vec![0.5f32; g * hd]);
            weighted_sum(false, &p, n, cache, &keys, hd, &mut o0);
            weighted_sum(true, &p, n, cache, &keys, hd, &mut o1);
            for i in 0..g {
                for d in 0..hd {
                    let want: f64 = 0.5
                        + r.iter()
                            .enumerate()
                            .map(|(j, &at)| p[i * n + j] as f64 * cache[at + d].to_f32() as f64)
                            .sum::<f64>();
                    assert!((o0[i * hd + d] as f64 - want).abs() < 1e-4, "hd {hd} d {d}");
                }
            }
            if simd_available() {
                assert_eq!(
                    s0, s1,
                    "scores, g {g} hd {hd} n {n}: the AVX2 build differs"
                );
                assert_eq!(o0, o1, "sums, g {g} hd {hd} n {n}: the AVX2 build differs");
            }
        }
    }

    #[test]
    fn the_avx2_kernels_compute_the_scalar_definition_bit_for_bit() {
        for hd in [8usize, 64, 96, 128, 256] {
            let stride = 3 * hd;
            for n in [1usize, 3, 7, 8, 9, 31, 256] {
                let len = (n + n / 5 * 3 + 1) * stride;
                let c32 = values(len, hd as u64 * 31 + n as u64);
                check_both(&c32, hd, n, stride);
                let c16: Vec<f16> = c32.iter().map(|&x| f16::from_f32(x * 4.0)).collect();
                check_both(&c16, hd, n, stride);
            }
        }
    }

    #[test]
    fn softmax_helpers_agree_across_builds() {
        for n in [0usize, 1, 5, 8, 13, 256] {
            let x0: Vec<f32> = values(n, n as u64 + 3).iter().map(|v| v * 30.0).collect();
            let (mut a, mut b) = (x0.clone(), x0.clone());
            let m = max(false, &x0);
            assert_eq!(m, max(true, &x0));
            let (la, lb) = (exp_sum(false, &mut a, m), exp_sum(true, &mut b, m));
            let want: f64 = x0.iter().map(|&v| ((v - m) as f64).exp()).sum();
            assert!(
                (la as f64 - want).abs() <= 1e-6 * want.max(1.0),
                "{la} vs {want}"
            );
            if simd_available() {
                assert_eq!(la.to_bits(), lb.to_bits(), "n {n}");
                assert_eq!(a, b, "n {n}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "past the cache")]
    fn a_row_past_the_cache_is_refused() {
        let keys = Keys::new(&[0, 50], 16);
        let mut out = [0f32; 2];
        scores(true, &[0.0; 16], 16, &[0f32; 64], &keys, 1.0, &mut out, 2);
    }

    #[test]
    #[should_panic(expected = "past the cache")]
    fn a_value_row_past_the_cache_is_refused() {
        let keys = Keys::new(&[40], 16);
        let mut out = [0f32; 16];
        weighted_sum(true, &[1.0], 1, &[0f32; 48], &keys, 16, &mut out);
    }
}
