//! AVX2 + FMA + F16C kernels (x86-64), chosen at run time. Each function here has a scalar
//! twin in `scalar.rs` / `act.rs` with the same signature minus the [`Avx2`] token.
//!
//! Quantized dot products follow the idea of ggml's AVX2 kernels: unpack the weight quants of
//! a block to 32 unsigned bytes, multiply them with the signed 8-bit activation quants with
//! `_mm256_maddubs_epi16`, widen with `_mm256_madd_epi16`, and fold the block's scales in
//! with one FMA. A weight block is unpacked once and used for up to four tokens, so prefill
//! reads each weight row once per four tokens.

use crate::act::{inv_scale, ActQ8, ActQ8K};
use crate::blocks::*;
use std::arch::x86_64::*;

/// Proof that the CPU has AVX2, FMA and F16C; only [`Avx2::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct Avx2(());

impl Avx2 {
    /// `Some` when AVX2, FMA and F16C are all available.
    pub fn detect() -> Option<Avx2> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Avx2(()))
    }
}

// ---------------------------------------------------------------------------------------
// Loads (the only unsafe code: each checks its length, then reads unaligned).

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_u8x16(p: &[u8; 16]) -> __m128i {
    // SAFETY: `p` is 16 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_u8x32(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: at least 32 readable bytes (checked above); no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_i8x32(p: &[i8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: at least 32 readable bytes (checked above); no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_i16x16(p: &[i16; 16]) -> __m256i {
    // SAFETY: `p` is 32 readable bytes; no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_f32x8(p: &[f32]) -> __m256 {
    assert!(p.len() >= 8);
    // SAFETY: at least 8 readable f32 (checked above); no alignment requirement.
    unsafe { _mm256_loadu_ps(p.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_f32x8_le(p: &[[u8; 4]]) -> __m256 {
    assert!(p.len() >= 8);
    // SAFETY: at least 32 readable bytes (checked above); x86 is little-endian, so these are
    // the f32 values; no alignment requirement.
    unsafe { _mm256_loadu_ps(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_u16x8(p: &[[u8; 2]]) -> __m128i {
    assert!(p.len() >= 8);
    // SAFETY: at least 16 readable bytes (checked above); no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn st_i8x32(p: &mut [i8; 32], v: __m256i) {
    // SAFETY: `p` is 32 writable bytes; no alignment requirement.
    unsafe { _mm256_storeu_si256(p.as_mut_ptr().cast(), v) }
}

// ---------------------------------------------------------------------------------------
// Small helpers.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmax_ps(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Two f16 (little-endian, 4 bytes) widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x2(b: [u8; 4]) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes(b)));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// One f16 widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x1(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}

/// 32 bytes, byte `j` = 0x10 when bit `j` of the little-endian `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: [u8; 4]) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(i32::from_le_bytes(qh)), shuf);
    let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The 32 nibbles of a Q4 block as bytes in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    let q = ld_u8x16(qs);
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// `sum(u[i] * a[i])` over 32 bytes as 8 i32 lanes (u unsigned, a signed, |a| <= 127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8i8(u: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
}

// ---------------------------------------------------------------------------------------
// 32-element block types against ActQ8.

/// Generates `fn $name<const N>(w: &[$blk], a: [&[ActQ8]; N]) -> [f32; N]`.
/// `$unpack(b)` gives (unsigned quants or |q| for signed, weight scale, offset coefficient
/// applied to the activation's `s`); `$signed` selects the sign trick of Q8_0.
macro_rules! q32_dot {
    ($name:ident, $blk:ty, $unpack:ident, $signed:expr) => {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name<const N: usize>(w: &[$blk], a: [&[ActQ8]; N]) -> [f32; N] {
            for x in &a {
                assert!(x.len() >= w.len());
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            let mut accm = [[0f32; 2]; N];
            macro_rules! step {
                ($i:expr, $k:expr) => {{
                    let i = $i;
                    let b = &w[i];
                    let (wq, dw, mw, wsign) = $unpack(b);
                    for t in 0..N {
                        let x = &a[t][i];
                        let xq = ld_i8x32(&x.qs);
                        let xq = if $signed {
                            _mm256_sign_epi8(xq, wsign)
                        } else {
                            xq
                        };
                        let p = _mm256_cvtepi32_ps(dot_u8i8(wq, xq));
                        acc[t][$k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), p, acc[t][$k]);
                        accm[t][$k] += mw * x.s;
                    }
                }};
            }
            let pairs = w.len() / 2;
            for p in 0..pairs {
                step!(2 * p, 0);
                step!(2 * p + 1, 1);
            }
            if w.len() % 2 == 1 {
                step!(w.len() - 1, 0);
            }
            let mut out = [0f32; N];
            for t in 0..N {
                out[t] = hsum_ps(_mm256_add_ps(acc[t][0], acc[t][1])) + (accm[t][0] + accm[t][1]);
            }
            out
        }
    };
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q4_0(b: &BlockQ4_0) -> (__m256i, f32, f32, __m256i) {
    let d = f16x1(b.d);
    (nibbles(&b.qs), d, -8.0 * d, _mm256_setzero_si256())
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q4_1(b: &BlockQ4_1) -> (__m256i, f32, f32, __m256i) {
    let (d, m) = f16x2([b.d[0], b.d[1], b.m[0], b.m[1]]);
    (nibbles(&b.qs), d, m, _mm256_setzero_si256())
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q5_0(b: &BlockQ5_0) -> (__m256i, f32, f32, __m256i) {
    let d = f16x1(b.d);
    let q = _mm256_or_si256(nibbles(&b.qs), fifth_bits(b.qh));
    (q, d, -16.0 * d, _mm256_setzero_si256())
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q5_1(b: &BlockQ5_1) -> (__m256i, f32, f32, __m256i) {
    let (d, m) = f16x2([b.d[0], b.d[1], b.m[0], b.m[1]]);
    let q = _mm256_or_si256(nibbles(&b.qs), fifth_bits(b.qh));
    (q, d, m, _mm256_setzero_si256())
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q8_0(b: &BlockQ8_0) -> (__m256i, f32, f32, __m256i) {
    let q = ld_i8x32(&b.qs);
    (_mm256_sign_epi8(q, q), f16x1(b.d), 0.0, q)
}

q32_dot!(dot_q4_0, BlockQ4_0, unpack_q4_0, false);
q32_dot!(dot_q4_1, BlockQ4_1, unpack_q4_1, false);
q32_dot!(dot_q5_0, BlockQ5_0, unpack_q5_0, false);
q32_dot!(dot_q5_1, BlockQ5_1, unpack_q5_1, false);
q32_dot!(dot_q8_0, BlockQ8_0, unpack_q8_0, true);

// ---------------------------------------------------------------------------------------
// K-quants against ActQ8K.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_k<const N: usize>(w: &[BlockQ4K], a: [&[ActQ8K]; N]) -> [f32; N] {
    dot_q45_k::<N, false>(
        w.iter().map(|b| (b.d, b.dmin, &b.scales, &b.qs, None)),
        w.len(),
        a,
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_k<const N: usize>(w: &[BlockQ5K], a: [&[ActQ8K]; N]) -> [f32; N] {
    dot_q45_k::<N, true>(
        w.iter()
            .map(|b| (b.d, b.dmin, &b.scales, &b.qs, Some(&b.qh))),
        w.len(),
        a,
    )
}

/// Shared body of Q4_K and Q5_K: (d, dmin, packed scales, low nibbles, fifth bits).
#[allow(clippy::type_complexity)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q45_k<'a, const N: usize, const FIVE: bool>(
    w: impl Iterator<
        Item = (
            [u8; 2],
            [u8; 2],
            &'a [u8; 12],
            &'a [u8; 128],
            Option<&'a [u8; 32]>,
        ),
    >,
    nb: usize,
    a: [&[ActQ8K]; N],
) -> [f32; N] {
    for x in &a {
        assert!(x.len() >= nb);
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let two = _mm256_set1_epi8(2);
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, (d, dmin, scales, qs, qh)) in w.enumerate() {
        let (d, dmin) = f16x2([d[0], d[1], dmin[0], dmin[1]]);
        let mut sc = [0i16; 8];
        let mut mn = [0i16; 8];
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, scales);
            sc[j] = s as i16;
            mn[j] = m as i16;
        }
        let mins = _mm256_setr_epi16(
            mn[0], mn[0], mn[1], mn[1], mn[2], mn[2], mn[3], mn[3], mn[4], mn[4], mn[5], mn[5],
            mn[6], mn[6], mn[7], mn[7],
        );
        let mut isum = [_mm256_setzero_si256(); N];
        let mut hbits = match qh {
            Some(h) if FIVE => ld_u8x32(h),
            _ => _mm256_setzero_si256(),
        };
        for k in 0..4 {
            let q = ld_u8x32(&qs[32 * k..]);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if FIVE {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(hbits, one)));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(hbits, two)));
                hbits = _mm256_srli_epi16::<2>(hbits);
            }
            let slo = _mm256_set1_epi16(sc[2 * k]);
            let shi = _mm256_set1_epi16(sc[2 * k + 1]);
            for t in 0..N {
                let x = &a[t][i];
                let plo = _mm256_maddubs_epi16(lo, ld_i8x32(&x.qs[64 * k..]));
                let phi = _mm256_maddubs_epi16(hi, ld_i8x32(&x.qs[64 * k + 32..]));
                let p = _mm256_add_epi32(_mm256_madd_epi16(plo, slo), _mm256_madd_epi16(phi, shi));
                isum[t] = _mm256_add_epi32(isum[t], p);
            }
        }
        for t in 0..N {
            let x = &a[t][i];
            let msum = _mm256_madd_epi16(ld_i16x16(&x.bsums), mins);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
            acc[t] = _mm256_fmadd_ps(
                _mm256_set1_ps(-dmin * x.d),
                _mm256_cvtepi32_ps(msum),
                acc[t],
            );
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum_ps(acc[t]);
    }
    out
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q6_k<const N: usize>(w: &[BlockQ6K], a: [&[ActQ8K]; N]) -> [f32; N] {
    for x in &a {
        assert!(x.len() >= w.len());
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, b) in w.iter().enumerate() {
        let d = f16x1(b.d);
        // The i8 scales, sign-extended to 16 i16 lanes.
        let sc16 = _mm256_cvtepi8_epi16(ld_u8x16(&b.scales.map(|s| s as u8)));
        let mut isum = [_mm256_setzero_si256(); N];
        for t in 0..N {
            // The -32 offset: -32 * sum_s sc[s] * bsum[s].
            let off = _mm256_madd_epi16(ld_i16x16(&a[t][i].bsums), sc16);
            isum[t] = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(off));
        }
        for h in 0..2 {
            let ql0 = ld_u8x32(&b.ql[64 * h..]);
            let ql1 = ld_u8x32(&b.ql[64 * h + 32..]);
            let qh = ld_u8x32(&b.qh[32 * h..]);
            let c = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                    _mm256_and_si256(qh, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                ),
            ];
            for (cq, &q) in c.iter().enumerate() {
                let s = 8 * h + 2 * cq;
                let sv = _mm256_set_m128i(
                    _mm_set1_epi16(b.scales[s + 1] as i16),
                    _mm_set1_epi16(b.scales[s] as i16),
                );
                for t in 0..N {
                    let x = &a[t][i];
                    let p = _mm256_maddubs_epi16(q, ld_i8x32(&x.qs[128 * h + 32 * cq..]));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sv));
                }
            }
        }
        for t in 0..N {
            let x = &a[t][i];
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum_ps(acc[t]);
    }
    out
}

// ---------------------------------------------------------------------------------------
// Float weights against f32 activations.

/// Generates a float-weight dot: `$load(&w[i..])` gives 8 weights as f32.
macro_rules! float_dot {
    ($name:ident, $elem:ty, $load:ident, $scalar:expr) => {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name<const N: usize>(w: &[$elem], x: [&[f32]; N]) -> [f32; N] {
            let n = w.len();
            for v in &x {
                assert!(v.len() >= n);
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            let mut i = 0;
            while i + 16 <= n {
                let w0 = $load(&w[i..]);
                let w1 = $load(&w[i + 8..]);
                for t in 0..N {
                    acc[t][0] = _mm256_fmadd_ps(w0, ld_f32x8(&x[t][i..]), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(w1, ld_f32x8(&x[t][i + 8..]), acc[t][1]);
                }
                i += 16;
            }
            if i + 8 <= n {
                let w0 = $load(&w[i..]);
                for t in 0..N {
                    acc[t][0] = _mm256_fmadd_ps(w0, ld_f32x8(&x[t][i..]), acc[t][0]);
                }
                i += 8;
            }
            let mut out = [0f32; N];
            for t in 0..N {
                out[t] = hsum_ps(_mm256_add_ps(acc[t][0], acc[t][1]));
                for j in i..n {
                    out[t] += ($scalar)(w[j]) * x[t][j];
                }
            }
            out
        }
    };
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_f16x8(w: &[[u8; 2]]) -> __m256 {
    _mm256_cvtph_ps(ld_u16x8(w))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_bf16x8(w: &[[u8; 2]]) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld_u16x8(w))))
}

float_dot!(dot_f32, [u8; 4], ld_f32x8_le, f32::from_le_bytes);
float_dot!(dot_f16, [u8; 2], ld_f16x8, |b| half::f16::from_le_bytes(b)
    .to_f32());
float_dot!(dot_bf16, [u8; 2], ld_bf16x8, |b| half::bf16::from_le_bytes(
    b
)
.to_f32());

// ---------------------------------------------------------------------------------------
// Row drivers: tiles of up to four tokens, every row of the task per tile.

macro_rules! rows_driver {
    ($pubname:ident, $inner:ident, $dot:ident, $blk:ty, $act:ty) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $inner(w: &[u8], rb: usize, acts: &[&[$act]], out: &mut [f32]) {
            let nt = acts.len();
            let mut t0 = 0;
            while t0 < nt {
                let n = (nt - t0).min(4);
                let a = &acts[t0..t0 + n];
                for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(nt)) {
                    let b = cast::<$blk>(row).expect("weight rows are whole blocks");
                    let o = &mut o[t0..t0 + n];
                    match n {
                        1 => o.copy_from_slice(&$dot::<1>(b, [a[0]])),
                        2 => o.copy_from_slice(&$dot::<2>(b, [a[0], a[1]])),
                        3 => o.copy_from_slice(&$dot::<3>(b, [a[0], a[1], a[2]])),
                        _ => o.copy_from_slice(&$dot::<4>(b, [a[0], a[1], a[2], a[3]])),
                    }
                }
                t0 += n;
            }
        }

        #[doc = concat!("AVX2 twin of `scalar::", stringify!($pubname), "`.")]
        pub fn $pubname(_: Avx2, w: &[u8], rb: usize, acts: &[&[$act]], out: &mut [f32]) {
            // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
            unsafe { $inner(w, rb, acts, out) }
        }
    };
}

rows_driver!(rows_q4_0, rows_q4_0_impl, dot_q4_0, BlockQ4_0, ActQ8);
rows_driver!(rows_q4_1, rows_q4_1_impl, dot_q4_1, BlockQ4_1, ActQ8);
rows_driver!(rows_q5_0, rows_q5_0_impl, dot_q5_0, BlockQ5_0, ActQ8);
rows_driver!(rows_q5_1, rows_q5_1_impl, dot_q5_1, BlockQ5_1, ActQ8);
rows_driver!(rows_q8_0, rows_q8_0_impl, dot_q8_0, BlockQ8_0, ActQ8);
rows_driver!(rows_q4_k, rows_q4_k_impl, dot_q4_k, BlockQ4K, ActQ8K);
rows_driver!(rows_q5_k, rows_q5_k_impl, dot_q5_k, BlockQ5K, ActQ8K);
rows_driver!(rows_q6_k, rows_q6_k_impl, dot_q6_k, BlockQ6K, ActQ8K);
rows_driver!(rows_f32, rows_f32_impl, dot_f32, [u8; 4], f32);
rows_driver!(rows_f16, rows_f16_impl, dot_f16, [u8; 2], f32);
rows_driver!(rows_bf16, rows_bf16_impl, dot_bf16, [u8; 2], f32);

// ---------------------------------------------------------------------------------------
// Activation quantization (bit-identical to the scalar reference in `act.rs`).

/// Quantizes 32 floats with inverse scale `id`; returns the 32 quants and the four 8-lane
/// i32 vectors they came from.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quant32(x: &[f32], id: f32) -> (__m256i, [__m256i; 4]) {
    let vid = _mm256_set1_ps(id);
    let mut q = [_mm256_setzero_si256(); 4];
    for (j, qj) in q.iter_mut().enumerate() {
        let v = _mm256_mul_ps(ld_f32x8(&x[8 * j..]), vid);
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        *qj = _mm256_cvtps_epi32(r);
    }
    let p01 = _mm256_packs_epi32(q[0], q[1]);
    let p23 = _mm256_packs_epi32(q[2], q[3]);
    let p = _mm256_packs_epi16(p01, p23);
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    (p, q)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn absmax(x: &[f32]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for c in x.chunks_exact(8) {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, ld_f32x8(c)));
    }
    hmax_ps(m)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_act_q8_impl(x: &[f32], out: &mut [ActQ8]) {
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (d, id) = inv_scale(absmax(xb));
        let (p, q) = quant32(xb, id);
        st_i8x32(&mut o.qs, p);
        let sum = hsum_epi32(_mm256_add_epi32(
            _mm256_add_epi32(q[0], q[1]),
            _mm256_add_epi32(q[2], q[3]),
        ));
        o.d = d;
        o.s = d * sum as f32;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_act_q8k_impl(x: &[f32], out: &mut [ActQ8K]) {
    for (xb, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (d, id) = inv_scale(absmax(xb));
        for j in 0..QK_K / 32 {
            let (p, q) = quant32(&xb[32 * j..], id);
            let dst: &mut [i8; 32] = (&mut o.qs[32 * j..32 * j + 32]).try_into().expect("32");
            st_i8x32(dst, p);
            o.bsums[2 * j] = hsum_epi32(_mm256_add_epi32(q[0], q[1])) as i16;
            o.bsums[2 * j + 1] = hsum_epi32(_mm256_add_epi32(q[2], q[3])) as i16;
        }
        o.d = d;
    }
}

/// AVX2 twin of [`crate::act::quantize_act_q8_scalar`] (bit-identical results).
pub fn quantize_act_q8(_: Avx2, x: &[f32], out: &mut [ActQ8]) {
    // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
    unsafe { quantize_act_q8_impl(x, out) }
}

/// AVX2 twin of [`crate::act::quantize_act_q8k_scalar`] (bit-identical results).
pub fn quantize_act_q8k(_: Avx2, x: &[f32], out: &mut [ActQ8K]) {
    // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
    unsafe { quantize_act_q8k_impl(x, out) }
}
