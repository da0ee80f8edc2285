//! AVX2 + FMA + F16C kernels (x86-64), chosen at run time, with an AVX-VNNI flavour of the
//! Q4_0..Q8_0 kernels. Each public function has a scalar twin in `scalar.rs` / `act.rs` with
//! the same signature minus the [`Avx2`] token.
//!
//! Quantized dot products follow the idea of ggml's AVX2 kernels: unpack weight quants to
//! unsigned bytes, multiply them with the signed 8-bit activation quants
//! (`_mm256_maddubs_epi16` + `_mm256_madd_epi16`, or one `vpdpbusd` with AVX-VNNI), and fold
//! the block scales in with one FMA. The 32-block types work on two blocks per register
//! (see [`ActQ8`]); K-quants on a 256-block with its sub-block scales applied in integers.
//! A weight block is unpacked once and used for up to four tokens, and rows are
//! software-prefetched (into L2) a few KiB ahead. Prompt batches of Q4_0..Q8_0 and Q2_K..Q6_K
//! repack a chunk of rows with one row per 32-bit vector lane (eight rows a 256-bit vector,
//! sixteen a 512-bit one: `q40` for Q4_0, `q4k` for Q4_K and Q5_K, `q6k` for Q6_K (and the
//! layout `q23k` repacks Q2_K and Q3_K into), `q80` for
//! Q8_0, Q5_0, Q4_1, Q5_1, IQ4_NL and IQ4_XS), so four broadcast activation bytes multiply eight or sixteen
//! rows at once and no horizontal sums remain; small batches (decode) run the rows in their
//! stored layout (Q4_0 four rows at a time, the others eight side by side), and each path
//! ends a block with the same per-row arithmetic, so a token's result never depends on its
//! batch or its ISA. Constant weight offsets (Q4_0's -8, Q5_0's -16) start the integer dot
//! products (at `-2^b * sum(q)`) instead of taking a float term of their own. The
//! row-at-a-time Q4_0 kernels (`q32_family`) remain as the baseline that
//! [`rows_q4_0_by_row`] exposes to the benchmark and the tests.

use crate::act::{inv_scale, ActQ8, ActQ8K};
use crate::blocks::*;
use std::arch::x86_64::*;

mod float;
mod iq;
mod q23k;
mod q40;
mod q4k;
mod q6k;
mod q80;

/// Proof that the CPU has AVX2, FMA and F16C (and AVX-VNNI when `vnni()`); only the
/// `detect` functions make one.
#[derive(Clone, Copy, Debug)]
pub struct Avx2 {
    vnni: bool,
    avx512: bool,
}

impl Avx2 {
    /// `Some` when AVX2, FMA and F16C are all available. Kernels use `maddubs`/`madd`.
    pub fn detect() -> Option<Avx2> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Avx2 {
            vnni: false,
            avx512: false,
        })
    }

    /// Like [`Avx2::detect`], also requiring AVX-VNNI: the Q4_1..Q8_0 kernels then use the
    /// 256-bit `vpdpbusd` (VEX encoding) for their u8 x i8 dot products (Q4_0 keeps the
    /// four-row `maddubs` kernel, faster where measured: [`rows_q4_0`]).
    pub fn detect_vnni() -> Option<Avx2> {
        Avx2::detect()
            .filter(|_| is_x86_feature_detected!("avxvnni"))
            .map(|_| Avx2 {
                vnni: true,
                avx512: false,
            })
    }

    /// Like [`Avx2::detect`], also requiring AVX-512 F, VL, BW and VNNI: the Q4_1..Q8_0
    /// kernels then use the EVEX `vpdpbusd` on 256-bit vectors and, with 32 vector
    /// registers, multiply two weight rows per load of the activations.
    pub fn detect_avx512() -> Option<Avx2> {
        Avx2::detect()
            .filter(|_| {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            })
            .map(|_| Avx2 {
                vnni: true,
                avx512: true,
            })
    }

    /// Whether this token enables the AVX-VNNI kernels.
    pub fn vnni(self) -> bool {
        self.vnni
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
fn ld_i8x16(p: &[i8]) -> __m128i {
    assert!(p.len() >= 16);
    // SAFETY: at least 16 readable bytes (checked above); no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_u8x32(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: at least 32 readable bytes (checked above); no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// Four 32-byte vectors of nibble bytes as the eight vectors of their nibbles (bytes 0..16):
/// `[g]` the low nibbles of `v[g]` for `g < 4`, the high ones of `v[g - 4]` after (the
/// interleaved layouts' units: elements `4c..4c + 4` low, `16 + 4c..` high).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles8(v: [__m256i; 4]) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    std::array::from_fn(|g| {
        if g < 4 {
            _mm256_and_si256(v[g], m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(v[g - 4]), m4)
        }
    })
}

/// Sixteen nibble bytes of each of eight rows (`qs(r)`: a block's quants) as the interleaved
/// layout holds them: `[g]` bytes `4g..4g + 4` of row `r` in 32-bit lane `r` (so
/// [`nibbles8`] takes them apart as it does the interleaved layout's). The packed bytes are transposed before the nibbles are
/// split, so the transpose moves four vectors, not eight: rows `k` and `k + 4` share a
/// vector, and a 4 × 4 transpose in each 128-bit half puts the rows in lane order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quad_rows8<'a>(qs: impl Fn(usize) -> &'a [u8; 16]) -> [__m256i; 4] {
    let x: [__m256i; 4] =
        std::array::from_fn(|k| _mm256_set_m128i(ld_u8x16(qs(k + 4)), ld_u8x16(qs(k))));
    // [r0d0 r1d0 r0d1 r1d1 | r4d0 r5d0 r4d1 r5d1], [r0d2 r1d2 r0d3 r1d3 | …], rows 2, 3 likewise
    let t = [
        _mm256_unpacklo_epi32(x[0], x[1]),
        _mm256_unpackhi_epi32(x[0], x[1]),
        _mm256_unpacklo_epi32(x[2], x[3]),
        _mm256_unpackhi_epi32(x[2], x[3]),
    ];
    [
        _mm256_unpacklo_epi64(t[0], t[2]),
        _mm256_unpackhi_epi64(t[0], t[2]),
        _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]),
    ]
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn ld_u8x64(p: &[u8]) -> __m512i {
    assert!(p.len() >= 64);
    // SAFETY: at least 64 readable bytes (checked above); no alignment requirement.
    unsafe { _mm512_loadu_si512(p.as_ptr().cast()) }
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
fn ld_i32x8(p: &[i32; 8]) -> __m256i {
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn st_i16x8(p: &mut [i16; 8], v: __m128i) {
    // SAFETY: `p` is 16 writable bytes; no alignment requirement.
    unsafe { _mm_storeu_si128(p.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn st_f32x4(p: &mut [f32; 4], v: __m128) {
    // SAFETY: `p` is 16 writable bytes; no alignment requirement.
    unsafe { _mm_storeu_ps(p.as_mut_ptr(), v) }
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

// ---------------------------------------------------------------------------------------
// 32-element block types against ActQ8 pairs.
//
// Two weight blocks are handled at once: their 2 x 16 nibble bytes fill one register, whose
// low nibbles (elements 0..16 of both blocks) meet the activation pair's `lo` and high
// nibbles meet `hi`. The i32 lanes 0..4 then belong to the first block and 4..8 to the
// second; the scales `[dw0 * d0, mw0 * s0, dw1 * d1, mw1 * s1]` come from one multiply.

/// Eight f16 values (their bits: `f(0)..f(7)`) as f32 lanes 0..8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x8(f: impl Fn(usize) -> i16) -> __m256 {
    _mm256_cvtph_ps(_mm_setr_epi16(
        f(0),
        f(1),
        f(2),
        f(3),
        f(4),
        f(5),
        f(6),
        f(7),
    ))
}

/// `[a, b]` little-endian f16 pairs of two blocks to `[a0, b0, a1, b1]` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_quad(p0: [u8; 4], p1: [u8; 4]) -> __m128 {
    _mm_cvtph_ps(_mm_set_epi32(
        0,
        0,
        i32::from_le_bytes(p1),
        i32::from_le_bytes(p0),
    ))
}

/// The 16 nibble bytes of two blocks as (low nibbles, high nibbles), block 0 in the low lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibble_pair(q0: &[u8; 16], q1: &[u8; 16]) -> (__m256i, __m256i) {
    let v = _mm256_set_m128i(ld_u8x16(q1), ld_u8x16(q0));
    let m4 = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(v, m4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
    )
}

/// Weight side of a Q4_0 block pair: the unsigned quants for `lo` and `hi`, and the two
/// blocks' scales as `[d0, d0, d1, d1]` (lanes 0 and 2 go under the activation `d8`).
#[derive(Clone, Copy)]
struct Unpacked {
    lo: __m256i,
    hi: __m256i,
    scale: __m128,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q4_0(b0: &BlockQ4_0, b1: &BlockQ4_0) -> Unpacked {
    let (lo, hi) = nibble_pair(&b0.qs, &b1.qs);
    let scale = f16_quad(
        [b0.d[0], b0.d[1], b0.d[0], b0.d[1]],
        [b1.d[0], b1.d[1], b1.d[0], b1.d[1]],
    );
    Unpacked { lo, hi, scale }
}

/// Generates the row-at-a-time Q4_0 kernels for one feature set (the baseline
/// [`rows_q4_0_by_row`] keeps). `$dot(init, [u_lo, u_hi], [a_lo, a_hi])` sums `u * a` over
/// both halves into 8 i32 lanes (4 per block). `$rows_at_once` weight rows share
/// each load of a tile's activations (2 where AVX-512VL gives the 32 vector registers that
/// two rows' accumulators for four tokens need); a row's arithmetic is the same either way.
macro_rules! q32_family {
    ($module:ident, $feat:literal, $dot:ident, $rows_at_once:literal) => {
        mod $module {
            use super::*;

            // (skipped by rustfmt, which indents this pattern further on every run)
            #[rustfmt::skip]
            macro_rules! kernel {
                (
                    $name:ident,
                    $cached:ident,
                    $rows:ident,
                    $blk:ty,
                    $unpack:ident,
                    $bias:literal
                ) => {
                    /// One pair of blocks of `R` rows against `N` tokens, into the running
                    /// sums: the only arithmetic of this type, shared by the kernel that
                    /// unpacks as it goes and the one that reads unpacked rows back.
                    macro_rules! pair {
                        ($acc:ident, $x:expr, $u:expr) => {{
                            let (xs, us): (&[ActQ8; N], &[Unpacked; R]) = ($x, $u);
                            // [x0 x4, x1 x4]: the weight scales under the i32 lanes.
                            // (loops over R, not array::from_fn: its closure is not
                            // always inlined into this target-feature function)
                            let spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
                            let mut d8 = [_mm256_setzero_ps(); R];
                            for r in 0..R {
                                d8[r] = _mm256_permutevar8x32_ps(
                                    _mm256_castps128_ps256(us[r].scale),
                                    spread,
                                );
                            }
                            for t in 0..N {
                                let x = &xs[t];
                                let (xd8, xl0, xh0) =
                                    (ld_f32x8(&x.d8), ld_i8x32(&x.lo), ld_i8x32(&x.hi));
                                // A constant weight offset -2^b, in integers: the dot
                                // products start from -2^b * sum(q) (0 without one).
                                let init = if $bias > 0 {
                                    _mm256_slli_epi32::<$bias>(ld_i32x8(&x.nsum))
                                } else {
                                    _mm256_setzero_si256()
                                };
                                for r in 0..R {
                                    let u = &us[r];
                                    let s = _mm256_mul_ps(d8[r], xd8);
                                    let i = $dot(init, [u.lo, u.hi], [xl0, xh0]);
                                    $acc[r][t] =
                                        _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(i), $acc[r][t]);
                                }
                            }
                        }};
                    }

                    /// The running sums' final reduction.
                    macro_rules! finish {
                        ($acc:ident) => {{
                            let mut out = [[0f32; N]; R];
                            for r in 0..R {
                                for t in 0..N {
                                    out[r][t] = hsum_ps($acc[r][t]);
                                }
                            }
                            out
                        }};
                    }

                    /// Rows `w` against `a[p][t]`: pair `p` of token `t` (tokens interleaved
                    /// per pair, so the loop walks the slices in step with no bounds checks).
                    #[inline]
                    #[target_feature(enable = $feat)]
                    fn $name<const R: usize, const N: usize>(
                        w: [&[$blk]; R],
                        a: &[[ActQ8; N]],
                    ) -> [[f32; N]; R] {
                        let n = w[0].len();
                        let full = n / 2;
                        assert!(a.len() >= n.div_ceil(2) && w.iter().all(|r| r.len() == n));
                        let mut acc = [[_mm256_setzero_ps(); N]; R];
                        for (p, xs) in a.iter().enumerate().take(full) {
                            let mut us = [$unpack(&w[0][2 * p], &w[0][2 * p + 1]); R];
                            for r in 1..R {
                                us[r] = $unpack(&w[r][2 * p], &w[r][2 * p + 1]);
                            }
                            pair!(acc, xs, &us);
                        }
                        if n % 2 == 1 {
                            let zero: $blk = zerocopy::FromZeros::new_zeroed();
                            let mut us = [$unpack(&w[0][n - 1], &zero); R];
                            for r in 1..R {
                                us[r] = $unpack(&w[r][n - 1], &zero);
                            }
                            pair!(acc, &a[full], &us);
                        }
                        finish!(acc)
                    }

                    /// The kernel above on rows unpacked beforehand (`u[p]`: pair `p` of the
                    /// `R` rows, as it unpacks them): the same arithmetic, bit for bit.
                    #[inline]
                    #[target_feature(enable = $feat)]
                    fn $cached<const R: usize, const N: usize>(
                        u: &[[Unpacked; R]],
                        a: &[[ActQ8; N]],
                    ) -> [[f32; N]; R] {
                        assert!(a.len() >= u.len());
                        let mut acc = [[_mm256_setzero_ps(); N]; R];
                        for (us, xs) in u.iter().zip(a) {
                            pair!(acc, xs, us);
                        }
                        finish!(acc)
                    }

                    /// Rows of this type for tiles of up to four tokens: each tile's
                    /// activations are interleaved once, then every row of the task runs,
                    /// `$rows_at_once` at a time. With several full tiles (prompt batches)
                    /// and a type whose unpacking costs more than loading it back, rows are
                    /// unpacked once per chunk of rows that stays in L1 and every tile of
                    /// four tokens runs against the unpacked chunk.
                    #[target_feature(enable = $feat)]
                    pub(super) fn $rows(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
                        const R: usize = $rows_at_once;
                        fn block(row: &[u8]) -> &[$blk] {
                            cast::<$blk>(row).expect("weight rows are whole blocks")
                        }
                        #[inline]
                        #[target_feature(enable = $feat)]
                        fn tile<const N: usize>(
                            w: &[u8],
                            rb: usize,
                            a: [&[ActQ8]; N],
                            out: &mut [f32],
                            nt: usize,
                            t0: usize,
                        ) {
                            let np = a[0].len();
                            let xs: Vec<[ActQ8; N]> =
                                (0..np).map(|p| std::array::from_fn(|t| a[t][p])).collect();
                            let nrows = w.len() / rb;
                            let mut r = 0;
                            while r < nrows {
                                if t0 == 0 {
                                    prefetch_ahead(w, (r + R) * rb + PREFETCH_BYTES, R * rb);
                                }
                                if r + R <= nrows {
                                    let rs: [&[$blk]; R] = std::array::from_fn(|i| {
                                        block(&w[(r + i) * rb..(r + i + 1) * rb])
                                    });
                                    let res = $name::<R, N>(rs, &xs);
                                    for (i, v) in res.iter().enumerate() {
                                        let o = (r + i) * nt + t0;
                                        out[o..o + N].copy_from_slice(v);
                                    }
                                    r += R;
                                } else {
                                    let res = $name::<1, N>([block(&w[r * rb..(r + 1) * rb])], &xs);
                                    out[r * nt + t0..r * nt + t0 + N].copy_from_slice(&res[0]);
                                    r += 1;
                                }
                            }
                        }
                        let nt = acts.len();
                        let mut t0 = 0;
                        if nt >= UNPACKED_MIN_TOKENS {
                            t0 = nt / 4 * 4;
                            cached_tiles(w, rb, &acts[..t0], out, nt);
                        }
                        while t0 < nt {
                            let a = &acts[t0..];
                            match a.len() {
                                1 => tile::<1>(w, rb, [a[0]], out, nt, t0),
                                2 => tile::<2>(w, rb, [a[0], a[1]], out, nt, t0),
                                3 => tile::<3>(w, rb, [a[0], a[1], a[2]], out, nt, t0),
                                _ => tile::<4>(w, rb, [a[0], a[1], a[2], a[3]], out, nt, t0),
                            }
                            t0 += a.len().min(4);
                        }

                        /// The first `acts.len()` (a multiple of 4) tokens of the `nt` in
                        /// `out`, through chunks of unpacked rows.
                        #[inline]
                        #[target_feature(enable = $feat)]
                        fn cached_tiles(
                            w: &[u8],
                            rb: usize,
                            acts: &[&[ActQ8]],
                            out: &mut [f32],
                            nt: usize,
                        ) {
                            let np = acts[0].len();
                            let tiles = acts.len() / 4;
                            let mut xs: Vec<[ActQ8; 4]> = Vec::with_capacity(tiles * np);
                            for k in 0..tiles {
                                for p in 0..np {
                                    xs.push(std::array::from_fn(|t| acts[4 * k + t][p]));
                                }
                            }
                            let nrows = w.len() / rb;
                            let per_group = np * std::mem::size_of::<[Unpacked; R]>();
                            let groups_per_chunk = (UNPACKED_CHUNK_BYTES / per_group).max(1);
                            let zero: $blk = zerocopy::FromZeros::new_zeroed();
                            let mut cache: Vec<[Unpacked; R]> =
                                Vec::with_capacity(groups_per_chunk * np);
                            let groups = nrows / R;
                            let mut g0 = 0;
                            while g0 < groups {
                                let g1 = (g0 + groups_per_chunk).min(groups);
                                cache.clear();
                                for g in g0..g1 {
                                    let rows: [&[$blk]; R] = std::array::from_fn(|i| {
                                        let r = g * R + i;
                                        block(&w[r * rb..(r + 1) * rb])
                                    });
                                    for p in 0..np {
                                        let (b0, b1) = (2 * p, 2 * p + 1);
                                        let mut us = [$unpack(
                                            &rows[0][b0],
                                            rows[0].get(b1).unwrap_or(&zero),
                                        ); R];
                                        for (u, row) in us.iter_mut().zip(rows).skip(1) {
                                            *u = $unpack(&row[b0], row.get(b1).unwrap_or(&zero));
                                        }
                                        cache.push(us);
                                    }
                                }
                                for k in 0..tiles {
                                    let x = &xs[k * np..(k + 1) * np];
                                    for (j, u) in cache.chunks_exact(np).enumerate() {
                                        let res = $cached::<R, 4>(u, x);
                                        for (i, v) in res.iter().enumerate() {
                                            let o = ((g0 + j) * R + i) * nt + 4 * k;
                                            out[o..o + 4].copy_from_slice(v);
                                        }
                                    }
                                }
                                g0 = g1;
                            }
                            // Rows past the last whole group of R: one at a time, as the
                            // uncached tiles end.
                            for r in groups * R..nrows {
                                let row = block(&w[r * rb..(r + 1) * rb]);
                                for k in 0..tiles {
                                    let res = $name::<1, 4>([row], &xs[k * np..(k + 1) * np]);
                                    out[r * nt + 4 * k..r * nt + 4 * k + 4]
                                        .copy_from_slice(&res[0]);
                                }
                            }
                        }
                    }
                };
            }

            kernel!(
                dot_q4_0,
                dot_q4_0_u,
                rows_q4_0,
                BlockQ4_0,
                unpack_q4_0,
                3
            );
        }
    };
}

/// maddubs + madd (Q4_0's 4-bit quants: two halves' pair sums fit i16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_maddubs(init: __m256i, u: [__m256i; 2], a: [__m256i; 2]) -> __m256i {
    let ([ul, uh], [al, ah]) = (u, a);
    let ones = _mm256_set1_epi16(1);
    let (pl, ph) = (_mm256_maddubs_epi16(ul, al), _mm256_maddubs_epi16(uh, ah));
    _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones))
}

/// Two `vpdpbusd` (AVX-VNNI): no intermediate i16, so no overflow case.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dot_vnni(init: __m256i, u: [__m256i; 2], a: [__m256i; 2]) -> __m256i {
    let ([ul, uh], [al, ah]) = (u, a);
    _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(init, ul, al), uh, ah)
}

/// Two `vpdpbusd` in their AVX-512 (EVEX) encoding on 256-bit vectors: the arithmetic of
/// [`dot_vnni`], on CPUs with AVX512-VNNI (with or without AVX-VNNI), and free to use the
/// upper 16 vector registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn dot_vnni512(init: __m256i, u: [__m256i; 2], a: [__m256i; 2]) -> __m256i {
    let ([ul, uh], [al, ah]) = (u, a);
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(init, ul, al), uh, ah)
}

// ---------------------------------------------------------------------------------------
// K-quants against ActQ8K: the parts of a block (scales, quants as unsigned bytes per 32
// elements) that the eight-stored-rows decode paths of `q4k` (Q4_K, Q5_K) and `q6k` use.

/// A Q4_K/Q5_K block's eight scales (`[i16; 8]`) and mins, each min twice under the
/// activations' two 16-element sums of its sub-block: decoded together (word operations, not
/// eight scalar unpackings: those were most of a decode step's instructions).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins_q45_k(scales: &[u8; 12]) -> ([i16; 8], __m256i) {
    let sm = scales_mins_k4(scales);
    let sm = _mm256_cvtepu8_epi16(_mm_setr_epi32(
        sm[0] as i32,
        sm[1] as i32,
        sm[2] as i32,
        sm[3] as i32,
    ));
    let mut sc = [0i16; 8];
    st_i16x8(&mut sc, _mm256_castsi256_si128(sm));
    let mn = _mm256_extracti128_si256::<1>(sm);
    let mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
    (sc, mins)
}

/// Quants 64k..64k+32 (`lo`, sub-block 2k) and 64k+32..64k+64 (`hi`, 2k + 1) of a Q4_K/Q5_K
/// block; for Q5_K (`FIVE`) their fifth bits from `hbits`, which moves on to the next pair.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants_q45_k<const FIVE: bool>(
    qs: &[u8; 128],
    k: usize,
    hbits: &mut __m256i,
) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0F);
    let v = ld_u8x32(&qs[32 * k..]);
    let mut lo = _mm256_and_si256(v, m4);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
    if FIVE {
        let one = _mm256_set1_epi8(1);
        let two = _mm256_set1_epi8(2);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(*hbits, one)));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(*hbits, two)));
        *hbits = _mm256_srli_epi16::<2>(*hbits);
    }
    (lo, hi)
}

/// Sub-blocks 2k (`lo`) and 2k + 1 (`hi`) of a Q4_K/Q5_K block, scaled by `sc[2k]` and
/// `sc[2k + 1]`, against block `i` of `N` tokens: added to the integer sums `isum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_q45_k<const N: usize>(
    (lo, hi): (__m256i, __m256i),
    sc: &[i16; 8],
    k: usize,
    a: &[&[ActQ8K]; N],
    i: usize,
    isum: &mut [__m256i; N],
) {
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

/// Half `h` of a Q6_K block's quants (0..63): the 32 elements from 128h, + 32, + 64, + 96.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants_q6_k(b: &BlockQ6K, h: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let m30 = _mm256_set1_epi8(0x30);
    let ql0 = ld_u8x32(&b.ql[64 * h..]);
    let ql1 = ld_u8x32(&b.ql[64 * h + 32..]);
    let qh = ld_u8x32(&b.qh[32 * h..]);
    [
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
    ]
}

/// The scales of Q6_K sub-blocks 2j (low eight i16 lanes) and 2j + 1 (high eight), from the
/// block's sixteen i8 scales: one byte shuffle and one sign extension.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair_q6_k(scales: __m128i, j: usize) -> __m256i {
    let lo = 0x0101_0101_0101_0101u64 * (2 * j as u64);
    let pick = _mm_set_epi64x((lo + 0x0101_0101_0101_0101) as i64, lo as i64);
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick))
}

/// A Q6_K block's integer sums against block `i` of `N` tokens, started at its -32 offset:
/// -32 * sum_s sc[s] * bsum[s] (`sc16`: the sixteen scales as i16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn offset_q6_k<const N: usize>(sc16: __m256i, a: &[&[ActQ8K]; N], i: usize) -> [__m256i; N] {
    let mut isum = [_mm256_setzero_si256(); N];
    for t in 0..N {
        let off = _mm256_madd_epi16(ld_i16x16(&a[t][i].bsums), sc16);
        isum[t] = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(off));
    }
    isum
}

/// The 32 quants `q` of Q6_K group `j`, scaled by `sv` (its two sub-blocks' scales), against
/// block `i` of `N` tokens: added to `isum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn group_q6_k<const N: usize>(
    q: __m256i,
    sv: __m256i,
    j: usize,
    a: &[&[ActQ8K]; N],
    i: usize,
    isum: &mut [__m256i; N],
) {
    for t in 0..N {
        let p = _mm256_maddubs_epi16(q, ld_i8x32(&a[t][i].qs[32 * j..]));
        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sv));
    }
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

/// How far ahead of the row being multiplied the weights are prefetched (bytes). Decode
/// streams every weight once per token from L3/DRAM; prefetching a few KiB ahead of the
/// hardware streamer sped the single-thread SmolLM2 layer sequence up by about a third. (The
/// plain-AVX2 Q4_0 kernel prefetches at least this far ahead, a few lines per block pair.)
const PREFETCH_BYTES: usize = 4096;

/// Bytes of unpacked weight rows a prompt batch of the row-at-a-time kernels keeps for
/// all their token tiles: most of a 32 KiB L1 data cache, leaving room for a tile's
/// activations.
const UNPACKED_CHUNK_BYTES: usize = 24 << 10;

/// Tokens from which those kernels unpack rows once for all tiles (two whole tiles of four).
const UNPACKED_MIN_TOKENS: usize = 8;

/// Prefetches `len` bytes of `w` from `start` into L1 (nothing past the end of `w`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_ahead(w: &[u8], start: usize, len: usize) {
    if let Some(bytes) = w.get(start..(start + len).min(w.len())) {
        for line in bytes.chunks(64) {
            // (`_mm_prefetch` is an unsafe fn in Rust 1.89, the MSRV, and safe in later
            // releases: the block is needed there and unused here)
            #[allow(unused_unsafe)]
            // SAFETY: a prefetch is a hint that never faults; the pointer is into `w`.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast())
            };
        }
    }
}

/// Prefetches step `i` of `steps` of the region `pf` into L2 (`prefetcht1`): its 64-byte
/// lines spread evenly over the steps of a loop (the first step takes all when there are
/// none). Decode prefetches the next rows while multiplying the current ones this way: a few
/// lines per step instead of a burst of a whole group's lines, which stalled on the CPU's
/// full miss buffers. Into L2, not L1: with `prefetcht0` the L1 fill buffers ran out (half
/// the Q4_K kernel's decode samples sat on a prefetch; 1B decode on the AVX-512 VM: Q4_K_M
/// 24.6 -> 28.0 t/s, Q4_0 25.8 -> 27.0). Prompt batches prefetch their next chunk of rows
/// the same way while the tiles run against the current one (the repacking otherwise
/// waited on DRAM).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_l2(pf: &[u8], i: usize, steps: usize) {
    for l in spread(pf.len().div_ceil(64), i, steps) {
        // an `unsafe fn` on the MSRV (1.89), safe under this function's target features on
        // later toolchains
        #[allow(unused_unsafe)]
        // SAFETY: a prefetch is a hint: it never faults and loads nothing the program sees;
        // the address is inside `pf` anyway.
        unsafe {
            _mm_prefetch::<_MM_HINT_T1>(pf[64 * l..].as_ptr().cast());
        }
    }
}

/// Items of step `i` when `n` items are spread over `steps` steps (all of them in step 0 when
/// there are no steps); every item falls in exactly one step `< steps.max(1)`.
fn spread(n: usize, i: usize, steps: usize) -> std::ops::Range<usize> {
    if steps == 0 {
        return if i == 0 { 0..n } else { 0..0 };
    }
    let per = n.div_ceil(steps);
    (i * per).min(n)..((i + 1) * per).min(n)
}

/// What to prefetch while the `len` bytes of rows from `at` run: as many bytes, from
/// `PREFETCH_BYTES` ahead or, when the rows are longer, from their end (the next rows); empty
/// past the end of `w`.
fn ahead(w: &[u8], at: usize, len: usize) -> &[u8] {
    let s = (at + len.max(PREFETCH_BYTES)).min(w.len());
    &w[s..(s + len).min(w.len())]
}

/// The row-at-a-time driver (the float weights' former kernel, kept as the tests' reference;
/// Q2_K's and Q3_K's until their eight-row and repacked kernels): every row against each
/// tile of up to four tokens, the rows in chunks of about [`ROWS_CHUNK_BYTES`] so that a
/// prompt batch's tiles find them in L2 (walking a whole task's rows per tile read them from
/// L3 at the larger shapes: over 1 MiB of Q3_K for a third of an 8192-row projection).
macro_rules! rows_driver {
    (#[$attr:meta] $name:ident, $dot:ident, $blk:ty, $act:ty) => {
        #[$attr]
        pub(super) fn $name(w: &[u8], rb: usize, acts: &[&[$act]], out: &mut [f32]) {
            let nt = acts.len();
            let per = (ROWS_CHUNK_BYTES / rb.max(1)).max(1);
            for (wc, oc) in w.chunks(per * rb).zip(out.chunks_mut(per * nt)) {
                let mut t0 = 0;
                while t0 < nt {
                    let n = (nt - t0).min(4);
                    let a = &acts[t0..t0 + n];
                    for (row, o) in wc.chunks_exact(rb).zip(oc.chunks_exact_mut(nt)) {
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
        }
    };
}

/// Weight bytes of the rows [`rows_driver`]'s token tiles run over before the next rows.
const ROWS_CHUNK_BYTES: usize = 128 << 10;

q32_family!(plain, "avx2,fma,f16c", dot_maddubs, 1);
q32_family!(vnni, "avx2,fma,f16c,avxvnni", dot_vnni, 1);
q32_family!(
    vnni512,
    "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
    dot_vnni512,
    2
);

/// Q4_0 on AVX2 without VNNI: four weight rows per load of the activations. Each row's
/// 16-bit partial sums are folded with the other three rows' by two rounds of `hadd` and one
/// `madd` into one i32 per block and row, so the block scales of four rows (eight f16, one
/// conversion), the offset term and the float multiply-add are shared by the four rows. The
/// row-at-a-time kernel ([`rows_q4_0_by_row`]) spent most of its decode instructions on
/// assembling each row's f16 scales and on per-row float work. Prompt batches unpack a chunk
/// of rows once (into L2) and run every tile of four tokens against it, through the same
/// arithmetic. On one thread at the 1B model's Q4_0 shapes (`examples/q4_0_bench.rs`): about
/// 1.9x the row-at-a-time kernel's speed for one token, 2.1x for 128.
mod quad {
    use super::*;

    /// Bytes of unpacked rows that every tile of a prompt batch runs against in turn (in L2:
    /// 24 KiB ran the 1B shapes at 128 tokens 6 % slower, 256 KiB no faster).
    const CHUNK_BYTES: usize = 96 << 10;

    #[inline(always)]
    fn dbits(b: &BlockQ4_0) -> i16 {
        i16::from_le_bytes(b.d)
    }

    /// One pair of blocks of four rows, unpacked: the nibbles of elements 0..16 (`lo`) and
    /// 16..32 (`hi`) of both blocks of row `r` as bytes, and the scales as
    /// `[r0b0, r1b0, r2b0, r3b0 | r0b1, r1b1, r2b1, r3b1]`.
    #[derive(Clone, Copy)]
    struct Quad {
        lo: [__m256i; 4],
        hi: [__m256i; 4],
        dw: __m256,
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn unpack4(b0: [&BlockQ4_0; 4], b1: [&BlockQ4_0; 4]) -> Quad {
        let m4 = _mm256_set1_epi8(0x0F);
        let dw = _mm256_cvtph_ps(_mm_setr_epi16(
            dbits(b0[0]),
            dbits(b0[1]),
            dbits(b0[2]),
            dbits(b0[3]),
            dbits(b1[0]),
            dbits(b1[1]),
            dbits(b1[2]),
            dbits(b1[3]),
        ));
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        for r in 0..4 {
            let v = _mm256_set_m128i(ld_u8x16(&b1[r].qs), ld_u8x16(&b0[r].qs));
            lo[r] = _mm256_and_si256(v, m4);
            hi[r] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
        }
        Quad { lo, hi, dw }
    }

    /// Pair `p` (blocks `b0`, `b1`) of the pair `u` of four rows against `N` tokens: adds
    /// `dw * dx * (sum(q * x) - 8 * sum(x))` to `acc[t]`, whose lanes are
    /// `[r0b0, r1b0, r2b0, r3b0 | r0b1, r1b1, r2b1, r3b1]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn apply<const N: usize>(u: &Quad, xs: &[ActQ8; N], acc: &mut [__m256; N]) {
        let ones = _mm256_set1_epi16(1);
        for t in 0..N {
            let x = &xs[t];
            let (xl, xh) = (ld_i8x32(&x.lo), ld_i8x32(&x.hi));
            // u4 * i8 pairs: |p| <= 2 * 15 * 127 per i16 lane, 4 * 15 * 127 after the add;
            // two rounds of pairwise adds (16 * 15 * 127 < 2^15) leave, per 128-bit half,
            // two i16 per row, which one `madd` sums to one i32 per row.
            let mut s = [_mm256_setzero_si256(); 4];
            for (s, (&lo, &hi)) in s.iter_mut().zip(u.lo.iter().zip(&u.hi)) {
                *s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            }
            let i = _mm256_madd_epi16(
                _mm256_hadd_epi16(_mm256_hadd_epi16(s[0], s[1]), _mm256_hadd_epi16(s[2], s[3])),
                ones,
            );
            // The weights' offset -8: -8 * sum(x) of each block (nsum's lane 0 of each half).
            let bias = _mm256_slli_epi32::<3>(_mm256_shuffle_epi32::<0>(ld_i32x8(&x.nsum)));
            let i = _mm256_add_epi32(i, bias);
            let d = _mm256_mul_ps(u.dw, ld_f32x8(&x.d8));
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(i), acc[t]);
        }
    }

    /// The running sums of four rows to `out[r][t]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn finish<const N: usize>(acc: &[__m256; N]) -> [[f32; N]; 4] {
        let mut out = [[0f32; N]; 4];
        for t in 0..N {
            let s = _mm_add_ps(
                _mm256_castps256_ps128(acc[t]),
                _mm256_extractf128_ps::<1>(acc[t]),
            );
            let mut v = [0f32; 4];
            st_f32x4(&mut v, s);
            for r in 0..4 {
                out[r][t] = v[r];
            }
        }
        out
    }

    /// Pair `p` of four rows (a zero block past an odd row's end).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn unpack_pair(w: &[&[BlockQ4_0]; 4], p: usize, zero: &BlockQ4_0) -> Quad {
        let (i, j) = (2 * p, 2 * p + 1);
        let b1 = if j < w[0].len() {
            [&w[0][j], &w[1][j], &w[2][j], &w[3][j]]
        } else {
            [zero; 4]
        };
        unpack4([&w[0][i], &w[1][i], &w[2][i], &w[3][i]], b1)
    }

    /// Four rows against `a[p][t]` (pair `p` of token `t`), unpacking as it goes:
    /// `out[r][t]`. The bytes `pf` (the next four rows) are prefetched a few lines per pair.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot4<const N: usize>(w: [&[BlockQ4_0]; 4], a: &[[ActQ8; N]], pf: &[u8]) -> [[f32; N]; 4] {
        let n = w[0].len();
        let full = n / 2;
        assert!(a.len() >= n.div_ceil(2) && w.iter().all(|r| r.len() == n));
        let mut acc = [_mm256_setzero_ps(); N];
        for (p, xs) in a.iter().enumerate().take(full) {
            prefetch_l2(pf, p, full);
            let (i, j) = (2 * p, 2 * p + 1);
            let u = unpack4(
                [&w[0][i], &w[1][i], &w[2][i], &w[3][i]],
                [&w[0][j], &w[1][j], &w[2][j], &w[3][j]],
            );
            apply(&u, xs, &mut acc);
        }
        if n % 2 == 1 {
            let zero: BlockQ4_0 = zerocopy::FromZeros::new_zeroed();
            apply(&unpack_pair(&w, full, &zero), &a[full], &mut acc);
        }
        finish(&acc)
    }

    /// [`dot4`] on pairs unpacked beforehand: the same arithmetic, bit for bit.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot4_unpacked<const N: usize>(u: &[Quad], a: &[[ActQ8; N]]) -> [[f32; N]; 4] {
        assert!(a.len() >= u.len());
        let mut acc = [_mm256_setzero_ps(); N];
        for (q, xs) in u.iter().zip(a) {
            apply(q, xs, &mut acc);
        }
        finish(&acc)
    }

    fn block(w: &[u8], rb: usize, r: usize) -> &[BlockQ4_0] {
        cast::<BlockQ4_0>(&w[r * rb..(r + 1) * rb]).expect("weight rows are whole blocks")
    }

    /// The four rows from `r` (a last group of fewer repeats its last row, `last`).
    fn rows4(w: &[u8], rb: usize, r: usize, last: usize) -> [&[BlockQ4_0]; 4] {
        [
            block(w, rb, r),
            block(w, rb, (r + 1).min(last)),
            block(w, rb, (r + 2).min(last)),
            block(w, rb, (r + 3).min(last)),
        ]
    }

    /// Writes four rows' results from row `r` (fewer at the end, `r1`).
    fn put<const N: usize>(
        res: &[[f32; N]; 4],
        r: usize,
        r1: usize,
        out: &mut [f32],
        nt: usize,
        t0: usize,
    ) {
        for (i, v) in res.iter().enumerate().take(r1 - r) {
            let o = (r + i) * nt + t0;
            out[o..o + N].copy_from_slice(v);
        }
    }

    /// All rows against one tile of `N` tokens (decode), unpacking as it goes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tile<const N: usize>(w: &[u8], rb: usize, xs: &[[ActQ8; N]], out: &mut [f32]) {
        let nrows = w.len() / rb;
        for r in (0..nrows).step_by(4) {
            let pf = ahead(w, r * rb, 4 * rb);
            let res = dot4::<N>(rows4(w, rb, r, nrows - 1), xs, pf);
            put(&res, r, nrows, out, N, 0);
        }
    }

    /// Unpacked groups `g` of four rows (`cache[g * np..][..np]`) against one tile of `N`
    /// tokens from token `t0`; the groups start at row `r0` and rows end at `r1`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn tile_unpacked<const N: usize>(
        cache: &[Quad],
        np: usize,
        (r0, r1): (usize, usize),
        xs: &[[ActQ8; N]],
        out: &mut [f32],
        nt: usize,
        t0: usize,
    ) {
        for (g, u) in cache.chunks_exact(np).enumerate() {
            let res = dot4_unpacked::<N>(u, xs);
            put(&res, r0 + 4 * g, r1, out, nt, t0);
        }
    }

    /// Tokens `a` interleaved per pair: `[p][t]`.
    fn interleave<const N: usize>(a: &[&[ActQ8]]) -> Vec<[ActQ8; N]> {
        (0..a[0].len())
            .map(|p| std::array::from_fn(|t| a[t][p]))
            .collect()
    }

    /// Q4_0 rows, four at a time, for tiles of up to four tokens. One tile (decode) runs
    /// over the rows unpacking as it goes; several (prompt batches) unpack a chunk of rows
    /// once into a buffer that stays in cache and run every tile against it.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn rows_q4_0(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
        let nt = acts.len();
        let nrows = w.len() / rb;
        if nt == 0 || nrows == 0 {
            return;
        }
        match acts {
            [a] => return tile::<1>(w, rb, &interleave::<1>(&[a]), out),
            [_, _] => return tile::<2>(w, rb, &interleave::<2>(acts), out),
            [_, _, _] => return tile::<3>(w, rb, &interleave::<3>(acts), out),
            [_, _, _, _] => return tile::<4>(w, rb, &interleave::<4>(acts), out),
            _ => {}
        }
        let full = nt / 4;
        let tiles: Vec<Vec<[ActQ8; 4]>> = (0..full)
            .map(|k| interleave::<4>(&acts[4 * k..4 * k + 4]))
            .collect();
        let rest = &acts[4 * full..];
        let x1 = (rest.len() == 1).then(|| interleave::<1>(rest));
        let x2 = (rest.len() == 2).then(|| interleave::<2>(rest));
        let x3 = (rest.len() == 3).then(|| interleave::<3>(rest));
        let t_rest = 4 * full;
        let np = acts[0].len();
        let groups = (CHUNK_BYTES / (np * size_of::<Quad>())).max(1);
        let zero: BlockQ4_0 = zerocopy::FromZeros::new_zeroed();
        let mut cache: Vec<Quad> = Vec::with_capacity(groups * np);
        for r0 in (0..nrows).step_by(4 * groups) {
            let r1 = (r0 + 4 * groups).min(nrows);
            cache.clear();
            for r in (r0..r1).step_by(4) {
                let rows = rows4(w, rb, r, nrows - 1);
                assert!(rows[0].len().div_ceil(2) == np);
                for p in 0..np {
                    cache.push(unpack_pair(&rows, p, &zero));
                }
            }
            for (k, x) in tiles.iter().enumerate() {
                tile_unpacked::<4>(&cache, np, (r0, r1), x, out, nt, 4 * k);
            }
            if let Some(x) = &x1 {
                tile_unpacked::<1>(&cache, np, (r0, r1), x, out, nt, t_rest);
            }
            if let Some(x) = &x2 {
                tile_unpacked::<2>(&cache, np, (r0, r1), x, out, nt, t_rest);
            }
            if let Some(x) = &x3 {
                tile_unpacked::<3>(&cache, np, (r0, r1), x, out, nt, t_rest);
            }
        }
    }
}

/// The K-quant rows compiled for AVX-512 VL/BW/VNNI as well: the same integer sums, with 32
/// vector registers (Gemma 3 270M prompt processing ~900 -> ~1000 t/s with Q4_K's) and
/// `vpdpbusd` in Q4_K's/Q5_K's prompt kernel.
mod kquant512 {
    use super::q23k::{gemm_q2_k16, gemm_q3_k16, Q2K_LANES_MIN, Q3K_LANES_MIN};
    pub(super) use super::q4k::wide::{rows_q4_k, rows_q5_k};
    pub(super) use super::q6k::wide::rows_q6_k;
    use super::*;
    lanes_or_rows!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        rows_q2_k,
        super::q23k::decode_q2_k,
        gemm_q2_k16,
        Q2K_LANES_MIN.1
    );
    lanes_or_rows!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        rows_q3_k,
        super::q23k::decode_q3_k,
        gemm_q3_k16,
        Q3K_LANES_MIN.1
    );
    /// The grid i-quants: `other`'s row-at-a-time decode, prompt batches sixteen rows a
    /// vector.
    macro_rules! iq_rows512 {
        ($($name:ident, $decode:ident, $blk:ty;)*) => {$(
            lanes_or_rows!(
                "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
                $name,
                super::other::$decode,
                super::iq::gemm16::<$blk>,
                super::iq::lanes_min::<$blk>()
            );
        )*};
    }
    iq_rows512! {
        rows_iq2_xxs, decode_iq2_xxs, BlockIq2Xxs;
        rows_iq2_xs, decode_iq2_xs, BlockIq2Xs;
        rows_iq2_s, decode_iq2_s, BlockIq2S;
        rows_iq3_xxs, decode_iq3_xxs, BlockIq3Xxs;
        rows_iq3_s, decode_iq3_s, BlockIq3S;
        rows_iq1_s, decode_iq1_s, BlockIq1S;
        rows_iq1_m, decode_iq1_m, BlockIq1M;
    }
}

/// The rows of a type with two kernels (Q2_K, Q3_K, the grid i-quants): its stored-row kernel
/// (`$decode`) for fewer than `$min` tokens, chunks of rows repacked into vector lanes
/// (`$gemm`) for more; the same bits either way.
macro_rules! lanes_or_rows {
    ($feat:literal, $name:ident, $decode:expr, $gemm:expr, $min:expr) => {
        #[target_feature(enable = $feat)]
        pub(super) fn $name(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
            if acts.len() >= $min && w.len() >= rb {
                $gemm(w, rb, acts, out)
            } else {
                $decode(w, rb, acts, out)
            }
        }
    };
}
use lanes_or_rows;

mod other {
    use super::q23k::{gemm_q2_k8, gemm_q3_k8, Q2K_LANES_MIN, Q3K_LANES_MIN};
    pub(super) use super::q4k::plain::{rows_q4_k, rows_q5_k};
    pub(super) use super::q6k::plain::rows_q6_k;
    use super::*;
    lanes_or_rows!(
        "avx2,fma,f16c",
        rows_q2_k,
        super::q23k::decode_q2_k,
        gemm_q2_k8,
        Q2K_LANES_MIN.0
    );
    lanes_or_rows!(
        "avx2,fma,f16c",
        rows_q3_k,
        super::q23k::decode_q3_k,
        gemm_q3_k8,
        Q3K_LANES_MIN.0
    );
    /// A grid i-quant type's rows: a row at a time through [`rows_driver`] (`$decode`) for
    /// fewer than `iq::lanes_min` tokens, repacked into vector lanes for more; the same bits.
    macro_rules! iq_rows {
        ($($name:ident, $decode:ident, $tiles:ident, $dot:ident, $blk:ty;)*) => {$(
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn $dot<const N: usize>(w: &[$blk], a: [&[ActQ8K]; N]) -> [f32; N] {
                super::iq::dot_iq::<$blk, N>(w, a)
            }
            rows_driver!(
                #[target_feature(enable = "avx2,fma,f16c")]
                $tiles,
                $dot,
                $blk,
                ActQ8K
            );
            /// One token: rows two at a time (`IqBlock::PAIRS`); more: a row at a time against
            /// tiles of four.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) fn $decode(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
                match acts {
                    [a] if <$blk as crate::iquant::IqBlock>::PAIRS => {
                        super::iq::decode_pairs::<$blk>(w, rb, a, out)
                    }
                    _ => $tiles(w, rb, acts, out),
                }
            }
            lanes_or_rows!(
                "avx2,fma,f16c",
                $name,
                $decode,
                super::iq::gemm8::<$blk>,
                super::iq::lanes_min::<$blk>()
            );
        )*};
    }
    iq_rows! {
        rows_iq2_xxs, decode_iq2_xxs, tiles_iq2_xxs, dot_iq2_xxs, BlockIq2Xxs;
        rows_iq2_xs, decode_iq2_xs, tiles_iq2_xs, dot_iq2_xs, BlockIq2Xs;
        rows_iq2_s, decode_iq2_s, tiles_iq2_s, dot_iq2_s, BlockIq2S;
        rows_iq3_xxs, decode_iq3_xxs, tiles_iq3_xxs, dot_iq3_xxs, BlockIq3Xxs;
        rows_iq3_s, decode_iq3_s, tiles_iq3_s, dot_iq3_s, BlockIq3S;
        rows_iq1_s, decode_iq1_s, tiles_iq1_s, dot_iq1_s, BlockIq1S;
        rows_iq1_m, decode_iq1_m, tiles_iq1_m, dot_iq1_m, BlockIq1M;
    }
    rows_driver!(
        #[target_feature(enable = "avx2,fma,f16c")]
        rows_f32,
        dot_f32,
        [u8; 4],
        f32
    );
    rows_driver!(
        #[target_feature(enable = "avx2,fma,f16c")]
        rows_f16,
        dot_f16,
        [u8; 2],
        f32
    );
    rows_driver!(
        #[target_feature(enable = "avx2,fma,f16c")]
        rows_bf16,
        dot_bf16,
        [u8; 2],
        f32
    );
}

macro_rules! public_rows {
    ($name:ident, $act:ty, kquant) => {
        #[doc = concat!("AVX2 twin of `scalar::", stringify!($name), "` (built for AVX-512 too).")]
        pub fn $name(t: Avx2, w: &[u8], rb: usize, acts: &[&[$act]], out: &mut [f32]) {
            if t.avx512 {
                // SAFETY: a token with `avx512` exists only when AVX2, FMA, F16C and
                // AVX-512 F, VL, BW and VNNI were detected.
                unsafe { kquant512::$name(w, rb, acts, out) }
            } else {
                // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
                unsafe { other::$name(w, rb, acts, out) }
            }
        }
    };
    ($name:ident, $act:ty) => {
        #[doc = concat!("AVX2 twin of `scalar::", stringify!($name), "`.")]
        pub fn $name(_: Avx2, w: &[u8], rb: usize, acts: &[&[$act]], out: &mut [f32]) {
            // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
            unsafe { other::$name(w, rb, acts, out) }
        }
    };
}

/// AVX2 twin of `scalar::rows_q4_0`: four rows at a time (`maddubs`), with every token,
/// VNNI ones included. On a 2-core Sapphire Rapids-class VM (AVX-512 VNNI) at the 1B model's
/// Q4_0 shapes the four-row kernel ran prompts 1.3x and decode 1.1x faster than the
/// row-at-a-time `vpdpbusd` kernels (two rows per activation load with AVX-512, one with
/// AVX-VNNI: 0.7x of AVX-512's for prompts); bench/runs/2026-12-02-cpu-avx512-1b.md.
///
/// Larger batches run the rows-in-lanes kernel of `q40` instead, bit for bit the same
/// arithmetic: eight rows a vector with AVX2 (and AVX-VNNI: its `vpdpbusd` chains were
/// slower there below 16 tokens, measured), sixteen with AVX-512 (its integer sums by
/// `vpdpbusd`), both from 5 tokens. Below that the four-row kernel takes the tokens in one
/// pass and is faster. 4096 x 4096 x N tokens, one thread (`RAYON_NUM_THREADS=1
/// examples/decode_bw q4_0 N`, a build with the threshold at 1 against this one, interleaved
/// rounds; AVX2 by `GDS_ISA=avx2` on the AVX-512 VM): AVX-512 4 tokens 1.14-1.17 ms four-row
/// against 1.69-1.81 lanes, 5: 2.36-2.55 against 1.98-2.26, 8: 2.69-2.99 against 2.14-2.33;
/// AVX2 4: 1.19-1.28 against 1.60-1.74, 5: 2.37-2.51 against 2.13-2.37, 8: 2.85-3.01
/// against 2.67-2.87, 16: 4.52-4.94 against 4.31-4.52, 32: 7.56-8.00 against 7.44-7.76.
pub fn rows_q4_0(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let lanes_from = 5;
    if acts.len() >= lanes_from && w.len() >= rb {
        if t.avx512 {
            // SAFETY: a token with `avx512` exists only when AVX2, FMA, F16C and
            // AVX-512 F, VL, BW and VNNI were detected.
            return unsafe { q40::gemm_rows16(w, rb, acts, out) };
        }
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        return unsafe { q40::gemm_rows8(w, rb, acts, out) };
    }
    // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
    unsafe { quad::rows_q4_0(w, rb, acts, out) }
}

/// Generates the entry of an interleaved-rows kernel: `$wide` (sixteen rows a 512-bit
/// vector) when the token has AVX-512, `$vnni` (where given) when it has AVX-VNNI, else
/// `$plain` (the eight-row AVX2 kernels on each half of a group).
macro_rules! x16_rows {
    ($(#[$doc:meta])* $name:ident, $act:ty, $wide:path, $plain:path $(, $vnni:path)?) => {
        $(#[$doc])*
        pub fn $name(t: Avx2, w: &[u8], rb: usize, acts: &[&[$act]], out: &mut [f32]) {
            if t.avx512 {
                // SAFETY: a token with `avx512` exists only when AVX2, FMA, F16C and AVX-512
                // F, VL, BW and VNNI were detected.
                return unsafe { $wide(w, rb, acts, out) };
            }
            $(
                if t.vnni {
                    // SAFETY: a token with `vnni` exists only when AVX-VNNI was detected too.
                    return unsafe { $vnni(w, rb, acts, out) };
                }
            )?
            // SAFETY: every token proves AVX2, FMA and F16C.
            unsafe { $plain(w, rb, acts, out) }
        }
    };
}

x16_rows!(
    /// Q4_0 rows interleaved sixteen at a time (`Layout::Interleaved16`, whole groups)
    /// against `acts`, into `out[r * acts.len() + t]`. Bit for bit [`rows_q4_0`] on the
    /// same rows in file order. The AVX-512 decode kernel reads each group's bytes once, in
    /// order, with no repacking: a block of sixteen rows is four 512-bit loads, eight
    /// `vpdpbusd` against broadcast activation bytes and one scale conversion, where the
    /// four-row kernel spends ~65 256-bit operations on eight block-rows; on AVX2 each
    /// 64-byte unit's halves are eight rows a lane each, the eight-row kernels' form.
    rows_q4_0x16,
    ActQ8,
    q40::rows_x16,
    q40::rows_x16_avx2
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q4_K: bit for bit [`rows_q4_k`] on the same rows in file order.
    rows_q4_kx16,
    ActQ8K,
    q4k::rows_x16::<BlockQ4K>,
    q4k::rows_x16_avx2::<BlockQ4K>
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q5_K: bit for bit [`rows_q5_k`] on the same rows in file order.
    rows_q5_kx16,
    ActQ8K,
    q4k::rows_x16::<BlockQ5K>,
    q4k::rows_x16_avx2::<BlockQ5K>
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q8_0: bit for bit [`rows_q8_0`] on the same rows in file order.
    rows_q8_0x16,
    ActQ8,
    q80::rows_x16::<BlockQ8_0>,
    q80::plain::rows_x16_avx2::<BlockQ8_0>,
    q80::vnni::rows_x16_avx2::<BlockQ8_0>
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q4_1: bit for bit [`rows_q4_1`] on the same rows in file order.
    rows_q4_1x16,
    ActQ8,
    q80::rows_x16::<BlockQ4_1>,
    q80::plain::rows_x16_avx2::<BlockQ4_1>,
    q80::vnni::rows_x16_avx2::<BlockQ4_1>
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q5_0: bit for bit [`rows_q5_0`] on the same rows in file order.
    rows_q5_0x16,
    ActQ8,
    q80::rows_x16::<BlockQ5_0>,
    q80::plain::rows_x16_avx2::<BlockQ5_0>,
    q80::vnni::rows_x16_avx2::<BlockQ5_0>
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q5_1: bit for bit [`rows_q5_1`] on the same rows in file order.
    rows_q5_1x16,
    ActQ8,
    q80::rows_x16::<BlockQ5_1>,
    q80::plain::rows_x16_avx2::<BlockQ5_1>,
    q80::vnni::rows_x16_avx2::<BlockQ5_1>
);
x16_rows!(
    /// [`rows_q4_0x16`] for Q6_K: bit for bit [`rows_q6_k`] on the same rows in file order.
    rows_q6_kx16,
    ActQ8K,
    q6k::rows_x16,
    q6k::rows_x16_avx2
);

x16_rows!(
    /// [`rows_q4_0x16`] for IQ4_NL (laid out as Q4_0, each nibble's value looked up by one
    /// byte shuffle): bit for bit [`rows_iq4_nl`] on the same rows in file order.
    rows_iq4_nlx16,
    ActQ8,
    q80::rows_x16::<BlockIq4Nl>,
    q80::plain::rows_x16_avx2::<BlockIq4Nl>,
    q80::vnni::rows_x16_avx2::<BlockIq4Nl>
);
x16_rows!(
    /// [`rows_q4_0x16`] for IQ4_XS: each 32-element sub-block an IQ4_NL block whose sixteen
    /// (eight) rows' scales `d * (ls - 32)` are made side by side from the interleaved
    /// `d`, `scales_h` and `scales_l`, so decode needs no sums across lanes. Bit for bit
    /// [`rows_iq4_xs`] on the same rows in file order.
    rows_iq4_xsx16,
    ActQ8,
    q80::rows_x16_xs,
    q80::plain::rows_x16_avx2_xs,
    q80::vnni::rows_x16_avx2_xs
);

/// The row-at-a-time Q4_0 kernel of every feature set (AVX-VNNI's or AVX512-VNNI's
/// `vpdpbusd` when the token has it), which [`rows_q4_0`] no longer runs: kept as the
/// baseline the benchmark and the tests measure against.
pub fn rows_q4_0_by_row(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    if t.avx512 {
        // SAFETY: a token with `avx512` exists only when AVX2, FMA, F16C and
        // AVX-512 F, VL, BW and VNNI were detected.
        unsafe { vnni512::rows_q4_0(w, rb, acts, out) }
    } else if t.vnni {
        // SAFETY: a token with `vnni` exists only when AVX2, FMA, F16C and AVX-VNNI
        // were detected.
        unsafe { vnni::rows_q4_0(w, rb, acts, out) }
    } else {
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { plain::rows_q4_0(w, rb, acts, out) }
    }
}

/// AVX2 twin of `scalar::rows_mxfp4` (gpt-oss's experts): rows repacked a chunk at a time,
/// sixteen a vector with AVX-512 (`q40::gemm_rows16_mxfp4`), eight with AVX2 and AVX-VNNI
/// (`q40::gemm_rows8_mxfp4`), the Q4_0 kernels' arithmetic with each nibble's value looked up
/// (plus 16, by one byte shuffle) and the 16 taken off as Q4_0's 8 is: bit for bit
/// [`rows_mxfp4x16`] on the same rows interleaved, on every instruction set. (Models held in
/// memory are interleaved; this runs rows of streamed layers and `GDS_INTERLEAVE=0`. The
/// row-at-a-time kernel it replaced, the one [`rows_q4_0_by_row`] keeps for Q4_0, ran as many
/// blocks a second as the Q8_0 decode kernel on a Zen 4 VM: 21 GB/s from L2 at half Q8_0's
/// bytes a block.)
pub fn rows_mxfp4(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    if t.avx512 {
        // SAFETY: a token with `avx512` exists only when AVX2, FMA, F16C and
        // AVX-512 F, VL, BW and VNNI were detected.
        unsafe { q40::gemm_rows16_mxfp4(w, rb, acts, out) }
    } else {
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { q40::gemm_rows8_mxfp4(w, rb, acts, out) }
    }
}

/// AVX2 twin of `scalar::rows_iq4_nl`: the kernels of [`rows_q8_0`] (eight rows side by side
/// for decode, rows in the vector lanes for prompts, `vpdpbusd` with VNNI) over IQ4_NL's
/// values, each block's nibbles looked up into signed bytes by a byte shuffle. The same bits
/// with every token, batch and instruction set.
pub fn rows_iq4_nl(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows_q32::<BlockIq4Nl>(t, w, rb, acts, out, q80::Q80_LANES_MIN)
}

/// AVX2 twin of `scalar::rows_iq4_xs`: [`rows_iq4_nl`]'s kernels over IQ4_XS's 32-element
/// sub-blocks, each with its f32 scale `d * (ls - 32)` (eight rows side by side for decode,
/// each block's scales made once for its eight rows; rows in the vector lanes for prompts).
/// The same bits with every token, batch and instruction set.
pub fn rows_iq4_xs(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let (nt, nrows) = (acts.len(), w.len() / rb.max(1));
    if nt == 0 || nrows == 0 {
        return;
    }
    let (plain, avx_vnni, avx512) = q80::XS_LANES_MIN;
    // SAFETY: as in `rows_q32`: each call's target features were detected.
    unsafe {
        if t.avx512 {
            if nt >= avx512 {
                q80::gemm_rows16_xs(w, rb, acts, out)
            } else {
                q80::evex::rows_stored_xs(w, rb, acts, out)
            }
        } else if t.vnni {
            if nt >= avx_vnni {
                q80::vnni::gemm_rows8_xs(w, rb, acts, out)
            } else {
                q80::vnni::rows_stored_xs(w, rb, acts, out)
            }
        } else if nt >= plain {
            q80::plain::gemm_rows8_xs(w, rb, acts, out)
        } else {
            q80::plain::rows_stored_xs(w, rb, acts, out)
        }
    }
}

/// MXFP4 rows interleaved sixteen at a time (`Layout::Interleaved16`) against `acts`, into
/// `out[r * acts.len() + t]`. Decode reads each group's bytes once, in order: a block of
/// sixteen rows is four 512-bit loads of nibbles (each 32-byte half eight rows, with AVX2),
/// one byte shuffle each half, and the sixteen scale bytes.
pub fn rows_mxfp4x16(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    if t.avx512 {
        // SAFETY: a token with `avx512` exists only when AVX2, FMA, F16C and AVX-512 F, VL,
        // BW and VNNI were detected.
        unsafe { q40::rows_x16_mxfp4(w, rb, acts, out) }
    } else {
        // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
        unsafe { q40::rows_x16_mxfp4_avx2(w, rb, acts, out) }
    }
}

/// AVX2 twin of `scalar::rows_q8_0`: eight rows side by side for small batches (decode),
/// rows in the vector lanes for prompt batches (eight a vector, sixteen with AVX-512), with
/// `vpdpbusd` where the token has VNNI. The same bits with every token and every batch
/// (see `q80`).
pub fn rows_q8_0(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows_q32::<BlockQ8_0>(t, w, rb, acts, out, q80::Q80_LANES_MIN)
}

/// AVX2 twin of `scalar::rows_q5_0`: the kernels of [`rows_q8_0`] over Q5_0's quants.
pub fn rows_q5_0(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows_q32::<BlockQ5_0>(t, w, rb, acts, out, q80::Q50_LANES_MIN)
}

/// AVX2 twin of `scalar::rows_q4_1`: the kernels of [`rows_q8_0`] over Q4_1's quants, each
/// block's min term after its scaled integer sum.
pub fn rows_q4_1(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows_q32::<BlockQ4_1>(t, w, rb, acts, out, q80::Q41_LANES_MIN)
}

/// AVX2 twin of `scalar::rows_q5_1`: as [`rows_q4_1`] with Q5_1's fifth bits.
pub fn rows_q5_1(t: Avx2, w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows_q32::<BlockQ5_1>(t, w, rb, acts, out, q80::Q41_LANES_MIN)
}

/// The `q80` kernels of block type `B` for the token's instruction set: rows in the vector
/// lanes from `lanes_min` tokens (plain AVX2, AVX-VNNI, AVX-512), stored rows below.
fn rows_q32<B: q80::Q32>(
    t: Avx2,
    w: &[u8],
    rb: usize,
    acts: &[&[ActQ8]],
    out: &mut [f32],
    (plain, avx_vnni, avx512): (usize, usize, usize),
) {
    let (nt, nrows) = (acts.len(), w.len() / rb.max(1));
    if nt == 0 || nrows == 0 {
        return;
    }
    // SAFETY: each call's target features were detected: a token with `avx512` exists only
    // when AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI were; one with `vnni` only when
    // AVX2, FMA, F16C and AVX-VNNI were; any `Avx2` token only when AVX2, FMA and F16C were.
    unsafe {
        if t.avx512 {
            if nt >= avx512 {
                q80::gemm_rows16::<B>(w, rb, acts, out)
            } else {
                q80::evex::rows_stored::<B>(w, rb, acts, out)
            }
        } else if t.vnni {
            if nt >= avx_vnni {
                q80::vnni::gemm_rows8::<B>(w, rb, acts, out)
            } else {
                q80::vnni::rows_stored::<B>(w, rb, acts, out)
            }
        } else if nt >= plain {
            q80::plain::gemm_rows8::<B>(w, rb, acts, out)
        } else {
            q80::plain::rows_stored::<B>(w, rb, acts, out)
        }
    }
}
public_rows!(rows_q4_k, ActQ8K, kquant);
public_rows!(rows_q5_k, ActQ8K, kquant);
public_rows!(rows_q6_k, ActQ8K, kquant);
public_rows!(rows_q2_k, ActQ8K, kquant);
public_rows!(rows_q3_k, ActQ8K, kquant);
public_rows!(rows_iq2_xxs, ActQ8K, kquant);
public_rows!(rows_iq2_xs, ActQ8K, kquant);
public_rows!(rows_iq2_s, ActQ8K, kquant);
public_rows!(rows_iq3_xxs, ActQ8K, kquant);
public_rows!(rows_iq3_s, ActQ8K, kquant);
public_rows!(rows_iq1_s, ActQ8K, kquant);
public_rows!(rows_iq1_m, ActQ8K, kquant);

macro_rules! float_rows_pub {
    ($name:ident, $by_row:ident, $tiles:ident) => {
        #[doc = concat!("AVX2 twin of `scalar::", stringify!($name), "`: tiles of rows and tokens \
            (AVX-512's when the token has it; `float.rs`), bit for bit [`", stringify!($by_row), "`].")]
        pub fn $name(t: Avx2, w: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
            float::$tiles::rows(t, w, rb, acts, out)
        }

        #[doc = concat!("The row-at-a-time kernel that [`", stringify!($name), "`] replaced \
            (one row, four tokens at a time): the reference its tiles equal bit for bit.")]
        pub fn $by_row(_: Avx2, w: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
            // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C were detected.
            unsafe { other::$name(w, rb, acts, out) }
        }
    };
}
float_rows_pub!(rows_f32, rows_f32_by_row, f32s);
float_rows_pub!(rows_f16, rows_f16_by_row, f16s);
float_rows_pub!(rows_bf16, rows_bf16_by_row, bf16s);
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

/// Quantizes one 32-block: (32 quants in element order, d, sum of the quants).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quant_block(xb: &[f32]) -> (__m256i, f32, i32) {
    let (d, id) = inv_scale(absmax(&xb[..QK]));
    let (p, q) = quant32(xb, id);
    let sum = hsum_epi32(_mm256_add_epi32(
        _mm256_add_epi32(q[0], q[1]),
        _mm256_add_epi32(q[2], q[3]),
    ));
    (p, d, sum)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_act_q8_impl(x: &[f32], out: &mut [ActQ8]) {
    assert_eq!(out.len(), crate::act::q8_pairs(x.len()));
    for (xp, o) in x.chunks(2 * QK).zip(out.iter_mut()) {
        let (p0, d0, s0) = quant_block(xp);
        let (p1, d1, s1) = if xp.len() == 2 * QK {
            quant_block(&xp[QK..])
        } else {
            (_mm256_setzero_si256(), 0.0, 0)
        };
        st_i8x32(&mut o.lo, _mm256_permute2x128_si256::<0x20>(p0, p1));
        st_i8x32(&mut o.hi, _mm256_permute2x128_si256::<0x31>(p0, p1));
        o.d8 = [d0, d0, d0, d0, d1, d1, d1, d1];
        o.s4 = [0.0, d0 * s0 as f32, 0.0, d1 * s1 as f32];
        o.nsum = [-s0, 0, 0, 0, -s1, 0, 0, 0];
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_covers_every_line_once() {
        for n in [0, 1, 2, 7, 18, 72, 73, 130] {
            for steps in [0, 1, 2, 3, 16, 32, 100] {
                let mut seen = vec![0u32; n];
                for i in 0..steps.max(1) + 2 {
                    for l in spread(n, i, steps) {
                        seen[l] += 1;
                        assert!(i < steps.max(1), "line {l} of {n} in step {i} of {steps}");
                    }
                }
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "{n} lines over {steps}: {seen:?}"
                );
            }
        }
    }

    #[test]
    fn prefetch_region_stays_in_bounds() {
        let w = vec![0u8; 10_000];
        // Short rows: PREFETCH_BYTES ahead; long rows: the next rows.
        assert_eq!(ahead(&w, 0, 1296).as_ptr(), w[PREFETCH_BYTES..].as_ptr());
        assert_eq!(ahead(&w, 0, 1296).len(), 1296);
        assert_eq!(ahead(&w, 100, 4608).as_ptr(), w[4708..].as_ptr());
        // Near and past the end: clipped, then empty.
        assert_eq!(ahead(&w, 4000, 4608).len(), 10_000 - 8608);
        assert!(ahead(&w, 9_000, 4608).is_empty());
        assert!(ahead(&w, 20_000, 64).is_empty());
        if let Some(_t) = Avx2::detect() {
            // SAFETY: the token proves AVX2, FMA and F16C.
            unsafe {
                for i in 0..40 {
                    prefetch_l2(&w[9_990..], i, 32);
                    prefetch_l2(&[], i, 32);
                    prefetch_l2(&w[..130], i, 0);
                }
            }
        }
    }
}
