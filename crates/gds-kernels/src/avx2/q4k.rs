//! Q4_K and Q5_K rows eight at a time, one row per 32-bit vector lane (Q5_K: Q4_K's layout
//! with a fifth bit per quant, the same arithmetic; [`Kq45`]).
//!
//! Every path ends a block the same way, per row: the block's integer sums `I` (the sub-block
//! products scaled by their 6-bit scales) and `M` (the mins against the activations' sums),
//! then `acc = fma(d * dx, I, acc)` and `acc = fma(-dmin * dx, M, acc)` ([`finish8`]), eight
//! rows in the eight lanes. So a row's result is the same bits whichever path computed it:
//!
//! - one to seven tokens (decode, small batches): rows in their stored layout, eight rows
//!   side by side; each row's integer sums come out of the row-at-a-time arithmetic as eight
//!   partial lanes, and a tree of `hadd`s turns the eight rows' partials into one vector of
//!   totals (I and M of a row travel together through it: [`rows8`]);
//! - eight or more tokens (prompt batches): a chunk of rows is repacked once ([`Packed8`]:
//!   each 32-bit lane holds four consecutive quants of one row, so a broadcast of four
//!   activation bytes multiplies eight rows at once, with no horizontal sums) and every tile
//!   of up to four tokens runs against it ([`gemm8`]). llama.cpp repacks Q4_K the same way for
//!   its CPU GEMM (`ggml_gemm_q4_K_8x8_q8_K`).
//!
//! Compiled twice (plain AVX2, and AVX-512 VL/BW/VNNI for its 32 registers, where prompt
//! batches sum each sub-block with `vpdpbusd`: [`gemm16`]) by [`q4k_rows`].

use super::*;
use crate::interleave::GROUP;

/// The two block types of this module: Q4_K, and Q5_K (Q4_K's layout with a fifth bit per
/// quant in `qh`).
pub(super) trait Kq45:
    zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned
{
    /// Five-bit quants (Q5_K): a sub-block's eight `maddubs` groups no longer fit i16 summed.
    const FIVE: bool;
    fn d(&self) -> [u8; 2];
    fn dmin(&self) -> [u8; 2];
    fn scales(&self) -> &[u8; 12];
    fn qs(&self) -> &[u8; 128];
    /// The fifth bits (none for Q4_K).
    fn qh(&self) -> Option<&[u8; 32]>;
}

/// Implements [`Kq45`] for a block type with the fields `d`, `dmin`, `scales`, `qs` (and
/// `qh` where `$qh` reads it).
macro_rules! kq45 {
    ($blk:ty, $five:literal, |$b:ident| $qh:expr) => {
        impl Kq45 for $blk {
            const FIVE: bool = $five;
            fn d(&self) -> [u8; 2] {
                self.d
            }
            fn dmin(&self) -> [u8; 2] {
                self.dmin
            }
            fn scales(&self) -> &[u8; 12] {
                &self.scales
            }
            fn qs(&self) -> &[u8; 128] {
                &self.qs
            }
            fn qh(&self) -> Option<&[u8; 32]> {
                let $b = self;
                $qh
            }
        }
    };
}
kq45!(BlockQ4K, false, |_b| None);
kq45!(BlockQ5K, true, |b| Some(&b.qh));

/// A block's fifth bits as [`quants_q45_k`] starts from them (zeros for Q4_K).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high_bits<B: Kq45>(b: &B) -> __m256i {
    b.qh().map_or(_mm256_setzero_si256(), |h| ld_u8x32(h))
}

/// Quants `64k..64k + 64` of a block as bytes (`lo`: sub-block `2k`, `hi`: `2k + 1`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants<B: Kq45>(b: &B, k: usize, hbits: &mut __m256i) -> (__m256i, __m256i) {
    if B::FIVE {
        quants_q45_k::<true>(b.qs(), k, hbits)
    } else {
        quants_q45_k::<false>(b.qs(), k, hbits)
    }
}

/// Eight rows of one Q4_K block, repacked with row `r` in 32-bit lane `r`.
#[derive(Clone, Copy)]
pub(super) struct Packed8 {
    /// Quants (0..15) of sub-block `j`, elements `4g..4g + 4` of row `r` in bytes `4r..4r + 4`
    /// of `q[j][g]`.
    q: [[__m256i; 8]; 8],
    /// The 6-bit scale of sub-block `j` of row `r` in 16-bit lanes `2r` and `2r + 1`.
    sc: [__m256i; 8],
    /// The mins of sub-blocks `2k` and `2k + 1` of row `r` in 16-bit lanes `2r`, `2r + 1`.
    mn: [__m256i; 4],
    /// `d` of each row.
    d: __m256,
    /// `-dmin` of each row.
    ndmin: __m256,
}

/// Each of the eight rows' result at the end of a block: `acc + d * dx * I - dmin * dx * M`
/// in two fused steps (`ndmin` = `-dmin`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn finish8(acc: __m256, d: __m256, ndmin: __m256, dx: f32, i: __m256i, m: __m256i) -> __m256 {
    let dx = _mm256_set1_ps(dx);
    let acc = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(i), acc);
    _mm256_fmadd_ps(_mm256_mul_ps(ndmin, dx), _mm256_cvtepi32_ps(m), acc)
}

/// Four activation bytes broadcast to every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bcast4(p: &[i8]) -> __m256i {
    assert!(p.len() >= 4);
    // SAFETY: at least 4 readable bytes (checked above); `read_unaligned` has no alignment
    // requirement.
    _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(p.as_ptr().cast::<i32>()) })
}

/// [`bcast4`] into a 512-bit vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(super) fn bcast4x16(p: &[i8]) -> __m512i {
    assert!(p.len() >= 4);
    // SAFETY: at least 4 readable bytes (checked above), read unaligned.
    _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(p.as_ptr().cast::<i32>()) })
}

/// Transposes eight vectors of eight 32-bit lanes: output `g` holds lane `g` of every input,
/// input `r` in lane `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // t[2p] = [a0 b0 a1 b1 | a4 b4 a5 b5], t[2p + 1] = [a2 b2 a3 b3 | a6 b6 a7 b7] (rows 2p, 2p+1)
    let s: [__m256i; 8] = std::array::from_fn(|i| {
        let half = i / 4; // rows 0..4 or 4..8
        let c = i % 4; // columns c (and c + 4)
        let (x, y) = (t[4 * half + c / 2], t[4 * half + 2 + c / 2]);
        if c % 2 == 0 {
            _mm256_unpacklo_epi64(x, y)
        } else {
            _mm256_unpackhi_epi64(x, y)
        }
    });
    // s[4h + c] = column c of rows 4h..4h+4 | column c + 4 of them
    std::array::from_fn(|g| {
        let (lo, hi) = (s[g % 4], s[4 + g % 4]);
        if g < 4 {
            _mm256_permute2x128_si256::<0x20>(lo, hi)
        } else {
            _mm256_permute2x128_si256::<0x31>(lo, hi)
        }
    })
}

/// [`transpose8`] of `lo` (rows 0..8) and of `hi` (rows 8..16) joined into 512-bit vectors:
/// output `g` holds lane `g` of every input, `lo[r]` in lane `r` and `hi[r]` in lane `8 + r`.
/// Done on the joined rows (32 shuffles where two 256-bit transposes and the joins take 56).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(super) fn transpose16(lo: [__m256i; 8], hi: [__m256i; 8]) -> [__m512i; 8] {
    let r: [__m512i; 8] = std::array::from_fn(|i| join(lo[i], hi[i]));
    // the steps of transpose8 within each 256-bit half (the unpacks work per 128-bit lane)
    let t: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let s: [__m512i; 8] = std::array::from_fn(|i| {
        let (half, c) = (i / 4, i % 4);
        let (x, y) = (t[4 * half + c / 2], t[4 * half + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    // 128-bit lane 0 (g < 4) or 1 of s[g % 4] and s[4 + g % 4], in each 256-bit half
    let first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    std::array::from_fn(|g| {
        let idx = if g < 4 { first } else { second };
        _mm512_permutex2var_epi64(s[g % 4], idx, s[4 + g % 4])
    })
}

/// The raw bytes of the rows after `r1` that the next chunk of `rows` rows repacks.
fn next_chunk(w: &[u8], rb: usize, r1: usize, rows: usize) -> &[u8] {
    let n = w.len() / rb;
    &w[r1.min(n) * rb..(r1 + rows).min(n) * rb]
}

/// `pshufb` masks that spread byte `j` (of 0..4) of each 32-bit lane over both 16-bit
/// halves of the lane, zero-extended: the scale of sub-block `j` (or `j + 4`) of row `r` in
/// 16-bit lanes `2r` and `2r + 1`.
const SPREAD_SCALE: [[u8; 32]; 4] = {
    let mut m = [[0x80u8; 32]; 4];
    let mut j = 0;
    while j < 4 {
        let mut d = 0;
        while d < 8 {
            m[j][4 * d] = (4 * (d % 4) + j) as u8;
            m[j][4 * d + 2] = (4 * (d % 4) + j) as u8;
            d += 1;
        }
        j += 1;
    }
    m
};

/// `pshufb` masks that put bytes `2k` and `2k + 1` (k of 0..2) of each 32-bit lane in its two
/// 16-bit halves, zero-extended: the mins of sub-blocks `2k`, `2k + 1` (or those + 4).
const PAIR_MINS: [[u8; 32]; 2] = {
    let mut m = [[0x80u8; 32]; 2];
    let mut k = 0;
    while k < 2 {
        let mut d = 0;
        while d < 8 {
            m[k][4 * d] = (4 * (d % 4) + 2 * k) as u8;
            m[k][4 * d + 2] = (4 * (d % 4) + 2 * k + 1) as u8;
            d += 1;
        }
        k += 1;
    }
    m
};

/// 32-bit word `k` (of 0..3) of the packed scales of block `i` of eight rows, row `r` in lane
/// `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_words<B: Kq45>(rows: &[&[B]; 8], i: usize, k: usize) -> __m256i {
    let w = |r: usize| {
        let s = rows[r][i].scales();
        i32::from_le_bytes([s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]])
    };
    _mm256_setr_epi32(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7))
}

/// The scales (`Packed8::sc`) and mins (`Packed8::mn`) of block `i` of eight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8<B: Kq45>(rows: &[&[B]; 8], i: usize) -> ([__m256i; 8], [__m256i; 4]) {
    // The 6-bit scales and mins of the eight rows at once, one row a 32-bit lane: the
    // arithmetic of `scales_mins_k4` on vectors (s_lo/s_hi: scales 0-3 / 4-7 as bytes,
    // m_lo/m_hi the mins), then spread into 16-bit lanes with byte shuffles.
    scales_of(
        scale_words(rows, i, 0),
        scale_words(rows, i, 1),
        scale_words(rows, i, 2),
    )
}

/// [`scales8`] from the three 32-bit words of packed scales of eight rows (row `r` in lane
/// `r`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_of(w0: __m256i, w1: __m256i, w2: __m256i) -> ([__m256i; 8], [__m256i; 4]) {
    let low6 = _mm256_set1_epi32(0x3f3f_3f3f);
    let low4 = _mm256_set1_epi32(0x0f0f_0f0f);
    let low2 = _mm256_set1_epi32(0x0303_0303);
    let high2 =
        |w: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(w), low2));
    let s_lo = _mm256_and_si256(w0, low6);
    let s_hi = _mm256_or_si256(_mm256_and_si256(w2, low4), high2(w0));
    let m_lo = _mm256_and_si256(w1, low6);
    let m_hi = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32::<4>(w2), low4),
        high2(w1),
    );
    let sc = std::array::from_fn(|j| {
        let v = if j < 4 { s_lo } else { s_hi };
        _mm256_shuffle_epi8(v, ld_u8x32(&SPREAD_SCALE[j % 4]))
    });
    let mn = std::array::from_fn(|k| {
        let v = if k < 2 { m_lo } else { m_hi };
        _mm256_shuffle_epi8(v, ld_u8x32(&PAIR_MINS[k % 2]))
    });
    (sc, mn)
}

/// `d` and `-dmin` of block `i` of eight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dmins8<B: Kq45>(rows: &[&[B]; 8], i: usize) -> (__m256, __m256) {
    let f16s = |f: &dyn Fn(&B) -> [u8; 2]| {
        let b = |r: usize| i16::from_le_bytes(f(&rows[r][i]));
        f16x8(b)
    };
    (
        f16s(&|b| b.d()),
        _mm256_xor_ps(f16s(&|b| b.dmin()), _mm256_set1_ps(-0.0)),
    )
}

/// Quants `64k..64k + 64` of block `i` of eight rows: `Packed8::q[2k]` and `q[2k + 1]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants8<B: Kq45>(rows: &[&[B]; 8], i: usize, k: usize) -> [[__m256i; 8]; 2] {
    let (lo, hi) = quant_rows8(rows, i, k);
    [transpose8(lo), transpose8(hi)]
}

/// [`quants8`] before the transposes: row `r`'s 32 quants of sub-blocks `2k` and `2k + 1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quant_rows8<B: Kq45>(rows: &[&[B]; 8], i: usize, k: usize) -> ([__m256i; 8], [__m256i; 8]) {
    let (mut lo, mut hi) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
    for r in 0..8 {
        let b = &rows[r][i];
        // the fifth bits of pairs before `k` shifted out
        let mut h = _mm256_srl_epi16(high_bits(b), _mm_cvtsi32_si128(2 * k as i32));
        (lo[r], hi[r]) = quants(b, k, &mut h);
    }
    (lo, hi)
}

impl Packed8 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn zero() -> Packed8 {
        let z = _mm256_setzero_si256();
        Packed8 {
            q: [[z; 8]; 8],
            sc: [z; 8],
            mn: [z; 4],
            d: _mm256_setzero_ps(),
            ndmin: _mm256_setzero_ps(),
        }
    }
}

/// Repacks block `i` of eight rows into `p` (in place: the chunk's storage).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8<B: Kq45>(rows: &[&[B]; 8], i: usize, p: &mut Packed8) {
    for k in 0..4 {
        [p.q[2 * k], p.q[2 * k + 1]] = quants8(rows, i, k);
    }
    (p.sc, p.mn) = scales8(rows, i);
    (p.d, p.ndmin) = dmins8(rows, i);
}

/// The activations' sub-block sums of block `i` as the dwords [`gemm8`] broadcasts: pair `k`
/// holds the sums of sub-blocks `2k` (low 16 bits) and `2k + 1`.
fn min_pairs(x: &ActQ8K) -> [i32; 4] {
    std::array::from_fn(|k| {
        let s = |j: usize| (x.bsums[2 * j] as i32 + x.bsums[2 * j + 1] as i32) as i16 as u16;
        (s(2 * k) as u32 | (s(2 * k + 1) as u32) << 16) as i32
    })
}

/// Eight repacked rows (block `i` in `p[i]`) against `N` tokens: each token's eight row sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm8<B: Kq45, const N: usize>(
    p: &[Packed8],
    xs: [&[ActQ8K]; N],
    pairs: [&[[i32; 4]]; N],
) -> [__m256; N] {
    gemm8_by::<B, _, N>(p, |u| u, xs, pairs)
}

/// [`gemm8`] over the eight-row parts `part(p[i])` of block `i`'s repacked rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm8_by<B: Kq45, P, const N: usize>(
    p: &[P],
    part: impl Fn(&P) -> &Packed8,
    xs: [&[ActQ8K]; N],
    pairs: [&[[i32; 4]]; N],
) -> [__m256; N] {
    // u4 x i8: 2 * 15 * 128 per 16-bit lane and product pair, 16 * 15 * 128 < 2^15 after a
    // sub-block's eight groups; u5 (Q5_K): 8 * 31 * 128 < 2^15 after four
    let span = if B::FIVE { 4 } else { 8 };
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, u) in p.iter().enumerate() {
        let u = part(u);
        let mut isum = [_mm256_setzero_si256(); N];
        for j in 0..8 {
            for g0 in (0..8).step_by(span) {
                let mut s = [_mm256_setzero_si256(); N];
                for g in g0..g0 + span {
                    let w = u.q[j][g];
                    for t in 0..N {
                        let a = bcast4(&xs[t][i].qs[32 * j + 4 * g..]);
                        s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(w, a));
                    }
                }
                for t in 0..N {
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s[t], u.sc[j]));
                }
            }
        }
        for t in 0..N {
            let m = mins8(&u.mn, &pairs[t][i]);
            acc[t] = finish8(acc[t], u.d, u.ndmin, xs[t][i].d, isum[t], m);
        }
    }
    acc
}

/// The mins of a block's eight rows (`mn`, as [`Packed8::mn`]) against a token's sub-block
/// sums (`bp`, [`min_pairs`]): `M` of each row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mins8(mn: &[__m256i; 4], bp: &[i32; 4]) -> __m256i {
    let mins = |k: usize| _mm256_madd_epi16(mn[k], _mm256_set1_epi32(bp[k]));
    _mm256_add_epi32(
        _mm256_add_epi32(mins(0), mins(1)),
        _mm256_add_epi32(mins(2), mins(3)),
    )
}

/// Lanes of [`rows8`]'s results: lane `l` holds row `LANE_ROW[l]`.
const LANE_ROW: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// One row's block `i` against `N` tokens in the row-at-a-time arithmetic: per token, the
/// partial integer sums of the scaled products (eight lanes) and of the mins (eight lanes),
/// pairwise added into one vector: `[I01 I23 M01 M23 | I45 I67 M45 M67]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row_sums<B: Kq45, const N: usize>(b: &B, a: &[&[ActQ8K]; N], i: usize) -> [__m256i; N] {
    let (sc, mins) = scales_mins_q45_k(b.scales());
    let mut hbits = high_bits(b);
    let mut isum = [_mm256_setzero_si256(); N];
    for k in 0..4 {
        let q = quants(b, k, &mut hbits);
        pair_q45_k(q, &sc, k, a, i, &mut isum);
    }
    std::array::from_fn(|t| {
        let m = _mm256_madd_epi16(ld_i16x16(&a[t][i].bsums), mins);
        _mm256_hadd_epi32(isum[t], m)
    })
}

/// Rows `2p`, `2p + 1` of eight, block `i`: `[I(0-3) M(0-3) I'(0-3) M'(0-3) | (4-7)...]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_sums<B: Kq45, const N: usize>(
    rows: &[&[B]; 8],
    p: usize,
    a: &[&[ActQ8K]; N],
    i: usize,
) -> [__m256i; N] {
    let u0 = row_sums(&rows[2 * p][i], a, i);
    let u1 = row_sums(&rows[2 * p + 1][i], a, i);
    std::array::from_fn(|t| _mm256_hadd_epi32(u0[t], u1[t]))
}

/// Four rows' totals from two pairs' sums: `[I0 M0 I1 M1 I2 M2 I3 M3]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quad_totals(w01: __m256i, w23: __m256i) -> __m256i {
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(w01, w23),
        _mm256_permute2x128_si256::<0x31>(w01, w23),
    )
}

/// Eight rows in their stored layout against `N` tokens: each token's eight results, lane
/// `l` holding row [`LANE_ROW`]`[l]`. `pf` (the next rows) is prefetched a few lines a block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8<B: Kq45, const N: usize>(rows: &[&[B]; 8], a: &[&[ActQ8K]; N], pf: &[u8]) -> [__m256; N] {
    let nb = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == nb) && a.iter().all(|x| x.len() >= nb));
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let w0 = pair_sums(rows, 0, a, i);
        let w1 = pair_sums(rows, 1, a, i);
        let x: [__m256i; N] = std::array::from_fn(|t| quad_totals(w0[t], w1[t]));
        let w2 = pair_sums(rows, 2, a, i);
        let w3 = pair_sums(rows, 3, a, i);
        let dbits = |r: usize| i16::from_le_bytes(rows[LANE_ROW[r]][i].d());
        let mbits = |r: usize| i16::from_le_bytes(rows[LANE_ROW[r]][i].dmin());
        let d = f16x8(dbits);
        let ndmin = _mm256_xor_ps(f16x8(mbits), _mm256_set1_ps(-0.0));
        for t in 0..N {
            let (x, y) = (
                _mm256_castsi256_ps(x[t]),
                _mm256_castsi256_ps(quad_totals(w2[t], w3[t])),
            );
            // even lanes I, odd lanes M: [x0 x2 y0 y2 | x4 x6 y4 y6] = rows 0 1 4 5 | 2 3 6 7
            let it = _mm256_castps_si256(_mm256_shuffle_ps::<0b10_00_10_00>(x, y));
            let mt = _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(x, y));
            acc[t] = finish8(acc[t], d, ndmin, a[t][i].d, it, mt);
        }
    }
    acc
}

/// Eight rows from `r` (a last group of fewer repeats its last row).
pub(super) fn group8<B>(w: &[u8], rb: usize, r: usize, nrows: usize) -> [&[B]; 8]
where
    B: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned,
{
    std::array::from_fn(|k| {
        let r = (r + k).min(nrows - 1);
        cast::<B>(&w[r * rb..(r + 1) * rb]).expect("weight rows are whole blocks")
    })
}

/// Writes `N` tokens' results of the eight rows from `r` (lane `l` = row `order[l]`; rows
/// from `nrows` on are padding) to `out[row * nt + t0 + t]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn put8<const N: usize>(
    acc: &[__m256; N],
    order: &[usize; 8],
    r: usize,
    nrows: usize,
    out: &mut [f32],
    nt: usize,
    t0: usize,
) {
    for (t, v) in acc.iter().enumerate() {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` is 8 writable f32; no alignment requirement.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *v) };
        for (l, &k) in order.iter().enumerate() {
            if r + k < nrows {
                out[(r + k) * nt + t0 + t] = lanes[l];
            }
        }
    }
}

/// Every row against one tile of `N` tokens from `t0`, rows in their stored layout.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_rows<B: Kq45, const N: usize>(
    w: &[u8],
    rb: usize,
    a: [&[ActQ8K]; N],
    out: &mut [f32],
    nt: usize,
    t0: usize,
) {
    let nrows = w.len() / rb;
    for r in (0..nrows).step_by(8) {
        let pf = ahead(w, r * rb, 8 * rb);
        let acc = rows8(&group8::<B>(w, rb, r, nrows), &a, pf);
        put8(&acc, &LANE_ROW, r, nrows, out, nt, t0);
    }
}

/// Sixteen rows of one Q4_K block for AVX-512: [`Packed8`]'s layout with rows 0..8 in lanes
/// 0..8 and rows 8..16 in lanes 8..16 of 512-bit vectors, but each scale (`sc[j]`) a 32-bit
/// lane of its own (for [`gemm16`]'s 32-bit multiply).
#[derive(Clone, Copy)]
pub(super) struct Packed16 {
    q: [[__m512i; 8]; 8],
    sc: [__m512i; 8],
    mn: [__m512i; 4],
    d: __m512,
    ndmin: __m512,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(super) fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(super) fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castsi512_ps(join(_mm256_castps_si256(lo), _mm256_castps_si256(hi)))
}

/// Repacks block `i` of sixteen rows.
impl Packed16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    fn zero() -> Packed16 {
        let z = _mm512_setzero_si512();
        Packed16 {
            q: [[z; 8]; 8],
            sc: [z; 8],
            mn: [z; 4],
            d: _mm512_setzero_ps(),
            ndmin: _mm512_setzero_ps(),
        }
    }
}

/// Repacks block `i` of sixteen rows (`lo`: lanes 0..8, `hi`: 8..16) into `p`, each part of
/// the two halves joined as soon as both are made (no eight-row copies in between).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16<B: Kq45>(lo: &[&[B]; 8], hi: &[&[B]; 8], i: usize, p: &mut Packed16) {
    for k in 0..4 {
        let ((alo, ahi), (blo, bhi)) = (quant_rows8(lo, i, k), quant_rows8(hi, i, k));
        p.q[2 * k] = transpose16(alo, blo);
        p.q[2 * k + 1] = transpose16(ahi, bhi);
    }
    let ((asc, amn), (bsc, bmn)) = (scales8(lo, i), scales8(hi, i));
    p.sc = std::array::from_fn(|j| scale32(join(asc[j], bsc[j])));
    p.mn = std::array::from_fn(|k| join(amn[k], bmn[k]));
    let ((ad, an), (bd, bn)) = (dmins8(lo, i), dmins8(hi, i));
    p.d = join_ps(ad, bd);
    p.ndmin = join_ps(an, bn);
}

/// A scale spread over both 16-bit halves of its 32-bit lane (as [`scales8`] makes them for
/// `madd`) as the lane's 32-bit value.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn scale32(sc: __m512i) -> __m512i {
    _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF))
}

/// Sub-block `j`'s products (`s`, two partial sums) scaled and added to `isum`: with VNNI the
/// products go to 32 bits at once (`vpdpbusd`, exact, as `maddubs` pairs summed in 16 bits
/// are), so a 32-bit multiply by the scale where the eight-row kernel's `madd` widens: the
/// same integer sum in about half the instructions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn scaled(isum: __m512i, s: [__m512i; 2], sc: __m512i) -> __m512i {
    _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_add_epi32(s[0], s[1]), sc))
}

/// [`gemm8`] on sixteen rows: the same integer sums per lane ([`scaled`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemm16<B: Kq45, const N: usize>(
    p: &[Packed16],
    xs: [&[ActQ8K]; N],
    pairs: [&[[i32; 4]]; N],
) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    for (i, u) in p.iter().enumerate() {
        let mut isum = [_mm512_setzero_si512(); N];
        for j in 0..8 {
            let mut s = [[_mm512_setzero_si512(); 2]; N];
            for g in 0..8 {
                let w = u.q[j][g];
                for t in 0..N {
                    let a = bcast4x16(&xs[t][i].qs[32 * j + 4 * g..]);
                    s[t][g % 2] = _mm512_dpbusd_epi32(s[t][g % 2], w, a);
                }
            }
            for t in 0..N {
                isum[t] = scaled(isum[t], s[t], u.sc[j]);
            }
        }
        for t in 0..N {
            acc[t] = finish16(
                acc[t],
                isum[t],
                (&u.mn, u.d, u.ndmin),
                xs[t][i].d,
                &pairs[t][i],
            );
        }
    }
    acc
}

/// The block end of [`gemm16`] per row: the mins against the activations' sub-block sums
/// (`bp`), then `acc + d * dx * I - dmin * dx * M` in two fused steps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn finish16(
    acc: __m512,
    isum: __m512i,
    (mn, d, ndmin): (&[__m512i; 4], __m512, __m512),
    dx: f32,
    bp: &[i32; 4],
) -> __m512 {
    let mins = |k: usize| _mm512_madd_epi16(mn[k], _mm512_set1_epi32(bp[k]));
    let m = _mm512_add_epi32(
        _mm512_add_epi32(mins(0), mins(1)),
        _mm512_add_epi32(mins(2), mins(3)),
    );
    let dx = _mm512_set1_ps(dx);
    let a = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc);
    _mm512_fmadd_ps(_mm512_mul_ps(ndmin, dx), _mm512_cvtepi32_ps(m), a)
}

/// Tokens from which Q4_K rows are repacked, with the eight-row (AVX2) and the sixteen-row
/// (AVX-512) kernels; fewer run in tiles of up to four over the stored rows (the repacking
/// costs more than it saves over a few tokens). Where the times cross, after the repacking's
/// scales were vectorized (the AVX-512 VM, 2026-12-02): one thread on 4096 x 4096 rows
/// (`decode_bw -- q4_k N`, native and `GDS_ISA=avx2`): AVX2 5 tokens 1.70 ms repacked / 1.83
/// in tiles, 4: tiles; AVX-512 9: 2.56 / 2.89, 8: 2.31 / 2.32, 7: 2.11 / 2.18, 5: 2.06 / 1.73.
/// The 1B Q4_K_M shape, two threads (`gdsrun bench -p 5,6,8,9,10 -n 0 -r 3`, t/s repacked from
/// the token count / tiles): AVX-512 8: 85-86 / 89-91, 9: 89 / 85-86, 10: 97-98 / 89-91; AVX2
/// 5: 67-68 / 68-69, 6: 76-77 / 74-79, 8: 89-91 / 82-89, 9: 90-96 / 80-84. (Before that
/// change both were 12.) After the sixteen-row repacking's transposes were joined
/// ([`transpose16`], same session), AVX-512 at 4096 x 4096, 2 threads, ms repacked / stored:
/// 5: 0.94-0.95 / 0.89, 6: 0.93-0.95 / 1.00, 7: 0.99-1.01 / 1.08: from 6.
pub(super) const Q4K_LANES_MIN: (usize, usize) = (6, 6);

/// [`Q4K_LANES_MIN`] for Q5_K. Measured as there (one 4096 x 4096 matrix, 2 threads,
/// `decode_bw q5_k N` with the threshold forced to 1 and to 999, ms repacked / stored): AVX2
/// 3 tokens 0.78 / 0.64, 4: 0.86 / 1.10; AVX-512 (after [`transpose16`]) 5: 1.00-1.02 /
/// 1.01, 6: 0.99-1.02 / 1.13-1.14, 8: 1.08-1.12 / 1.30-1.32. The interleaved rows
/// ([`rows_x16`]) cross there too (Zen 4, `decode_bw q5_kx16 N`, two rounds, us unpacked /
/// decode kernel: 4: 935-1106 / 803-1018, 5: 886-1254 / 837-1282, 6: 1232-1335 /
/// 1497-1645, 8: 1220 / 1384).
pub(super) const Q5K_LANES_MIN: (usize, usize) = (4, 6);

/// Bytes of repacked rows every tile of a prompt batch runs against in turn (in L2).
const CHUNK_BYTES: usize = 96 << 10;

/// The prompt-batch driver of the rows-in-lanes kernels (every quantized type; eight or
/// sixteen rows a group): the rows in chunks of whole groups (as many as fit [`CHUNK_BYTES`]
/// repacked), each group's rows found once (`group(first row)`: the slices, checked once, not
/// per block: 12-15 % of a 16-token Q4_0 product) and each of its blocks repacked once
/// (`repack(the group's rows, block, into)`), then for
/// every tile of up to four tokens `run(the group's blocks, its first row, the tile's first
/// token)` on each group, while the next chunk's raw rows are prefetched into L2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn chunked<P: Copy, G>(
    w: &[u8],
    rb: usize,
    (nb, rows_per_group, nt): (usize, usize, usize),
    zero: P,
    group: impl Fn(usize) -> G,
    mut repack: impl FnMut(&G, usize, &mut P),
    mut run: impl FnMut(&[P], usize, usize),
) {
    let nrows = w.len() / rb;
    let groups = (CHUNK_BYTES / (nb * std::mem::size_of::<P>())).max(1);
    // one chunk's storage, repacked into in place chunk after chunk
    let mut cache: Vec<P> = vec![zero; groups.min(nrows.div_ceil(rows_per_group)) * nb];
    for r0 in (0..nrows).step_by(rows_per_group * groups) {
        let r1 = (r0 + rows_per_group * groups).min(nrows);
        let chunk = &mut cache[..(r1 - r0).div_ceil(rows_per_group) * nb];
        for (g, blocks) in chunk.chunks_exact_mut(nb).enumerate() {
            // the group's rows once, not per block
            let rows = group(r0 + rows_per_group * g);
            for (i, p) in blocks.iter_mut().enumerate() {
                repack(&rows, i, p);
            }
        }
        let next = next_chunk(w, rb, r1, r1 - r0);
        let mut t0 = 0;
        while t0 < nt {
            prefetch_l2(next, t0 / 4, nt.div_ceil(4));
            for (g, p) in chunk.chunks_exact(nb).enumerate() {
                run(p, r0 + rows_per_group * g, t0);
            }
            t0 += (nt - t0).min(4);
        }
    }
}

/// The shape of a matrix of sixteen-row interleaved groups ([`GROUP`]) for the `rows_x16` kernels:
/// `(rows, blocks a row)` of `block`-byte blocks, checked to be whole groups with `out`
/// holding `nt` tokens' results; `None`, with `out` zeroed, when nothing is to multiply.
pub(super) fn x16_shape(
    w: &[u8],
    rb: usize,
    block: usize,
    nt: usize,
    out: &mut [f32],
) -> Option<(usize, usize)> {
    let (nrows, nb) = (w.len() / rb, rb / block);
    assert!(nrows.is_multiple_of(GROUP) && out.len() == nrows * nt);
    if nt == 0 || nb == 0 {
        out.fill(0.0);
        return None;
    }
    Some((nrows, nb))
}

/// The decode driver of the interleaved kernels (`crate::interleave`): `run(group, its first
/// row, the bytes to prefetch behind it, t0)` for each group of sixteen rows (`16 * rb`
/// bytes, in order) and each tile of up to four of the `nt` tokens from `t0`.
pub(super) fn x16_tiles(
    w: &[u8],
    rb: usize,
    nt: usize,
    mut run: impl FnMut(&[u8], usize, &[u8], usize),
) {
    let gb = GROUP * rb;
    for (g, group) in w.chunks_exact(gb).enumerate() {
        let pf = ahead(w, g * gb, gb);
        let mut t0 = 0;
        while t0 < nt {
            run(group, GROUP * g, pf, t0);
            t0 += (nt - t0).min(4);
        }
    }
}

/// The prompt driver of the interleaved kernels: [`chunked`] over groups of sixteen rows,
/// each block of a group unpacked once (`unpack(group, block, into)`) from its bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn x16_chunked<P: Copy>(
    w: &[u8],
    rb: usize,
    (nb, nt): (usize, usize),
    zero: P,
    unpack: impl FnMut(&&[u8], usize, &mut P),
    run: impl FnMut(&[P], usize, usize),
) {
    let gb = GROUP * rb;
    chunked(
        w,
        rb,
        (nb, GROUP, nt),
        zero,
        |r| &w[r * rb..r * rb + gb],
        unpack,
        run,
    );
}

/// `$body` with `$xs` bound to an array of the first one to four items of `$a` (a tile of
/// tokens: one monomorphized kernel per tile size).
macro_rules! by_tile {
    ($a:expr, |$xs:ident| $body:expr) => {
        match $a.len() {
            1 => {
                let $xs = [$a[0]];
                $body
            }
            2 => {
                let $xs = [$a[0], $a[1]];
                $body
            }
            3 => {
                let $xs = [$a[0], $a[1], $a[2]];
                $body
            }
            _ => {
                let $xs = [$a[0], $a[1], $a[2], $a[3]];
                $body
            }
        }
    };
}
pub(super) use by_tile;

/// A 256-bit vector's eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn lanes8(v: __m256) -> [f32; 8] {
    let mut l = [0f32; 8];
    // SAFETY: `l` is 8 writable f32; no alignment requirement.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
    l
}

/// A 512-bit vector's sixteen f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) fn lanes16(v: __m512) -> [f32; 16] {
    let mut l = [0f32; 16];
    // SAFETY: `l` is 16 writable f32; no alignment requirement.
    unsafe { _mm512_storeu_ps(l.as_mut_ptr(), v) };
    l
}

/// Writes `N` tokens' results of the `L` rows from `r` (row `r + k` in lane `k`; rows from
/// `nrows` on are padding) to `out[row * nt + t0 + t]`.
pub(super) fn put_rows<const N: usize, const L: usize>(
    lanes: [[f32; L]; N],
    r: usize,
    nrows: usize,
    out: &mut [f32],
    nt: usize,
    t0: usize,
) {
    for (t, v) in lanes.iter().enumerate() {
        for (k, &x) in v.iter().enumerate().take(nrows.saturating_sub(r)) {
            out[(r + k) * nt + t0 + t] = x;
        }
    }
}

/// Writes `N` tokens' results of the two halves of a group of sixteen rows from `r` (eight
/// rows each, row `r + 8h + k` in lane `k` of `acc[h]`) to `out[row * nt + t0 + t]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn put_halves<const N: usize>(
    acc: [[__m256; N]; 2],
    r: usize,
    nrows: usize,
    out: &mut [f32],
    (nt, t0): (usize, usize),
) {
    for (h, acc) in acc.into_iter().enumerate() {
        put_rows(acc.map(|v| lanes8(v)), r + 8 * h, nrows, out, nt, t0);
    }
}

/// Q4_K/Q5_K prompt batches on plain AVX2: groups of eight rows.
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm_rows8<B: Kq45>(
    w: &[u8],
    rb: usize,
    acts: &[&[ActQ8K]],
    pairs: &[Vec<[i32; 4]>],
    out: &mut [f32],
) {
    let (nt, nrows, nb) = (acts.len(), w.len() / rb, rb / std::mem::size_of::<B>());
    chunked(
        w,
        rb,
        (nb, 8, nt),
        Packed8::zero(),
        |r| group8::<B>(w, rb, r, nrows),
        |rows, i, p| repack8(rows, i, p),
        |p: &[Packed8], r, t0| {
            let (a, ps) = (&acts[t0..], &pairs[t0..]);
            by_tile!(a, |xs| {
                let pv = std::array::from_fn(|k| &ps[k][..]);
                put_rows(
                    gemm8::<B, _>(p, xs, pv).map(|v| lanes8(v)),
                    r,
                    nrows,
                    out,
                    nt,
                    t0,
                )
            })
        },
    );
}

/// Q4_K/Q5_K prompt batches on AVX-512 (always with VNNI here): groups of sixteen rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn gemm_rows16<B: Kq45>(
    w: &[u8],
    rb: usize,
    acts: &[&[ActQ8K]],
    pairs: &[Vec<[i32; 4]>],
    out: &mut [f32],
) {
    let (nt, nrows, nb) = (acts.len(), w.len() / rb, rb / std::mem::size_of::<B>());
    chunked(
        w,
        rb,
        (nb, 16, nt),
        Packed16::zero(),
        |r| {
            (
                group8::<B>(w, rb, r, nrows),
                group8::<B>(w, rb, r + 8, nrows),
            )
        },
        |(lo, hi), i, p| repack16(lo, hi, i, p),
        |p: &[Packed16], r, t0| {
            let (a, ps) = (&acts[t0..], &pairs[t0..]);
            by_tile!(a, |xs| {
                let pv = std::array::from_fn(|k| &ps[k][..]);
                put_rows(
                    gemm16::<B, _>(p, xs, pv).map(|v| lanes16(v)),
                    r,
                    nrows,
                    out,
                    nt,
                    t0,
                )
            })
        },
    );
}

/// Generates `$name` (the rows of block type `$blk`) for the target features `$feat`.
macro_rules! q4k_rows {
    ($feat:literal, $name:ident, $blk:ty, $gemm:ident, $min:expr) => {
        /// Rows against `acts`, `out[r * nt + t]`: rows in their stored layout for fewer than
        /// [`Q4K_LANES_MIN`] / [`Q5K_LANES_MIN`] tokens, repacked chunks for more (the same
        /// arithmetic).
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn $name(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
            let nt = acts.len();
            let nrows = w.len() / rb;
            if nt == 0 || nrows == 0 {
                return;
            }
            if nt < $min {
                let mut t0 = 0;
                while t0 < nt {
                    by_tile!(&acts[t0..], |xs| tile_rows::<$blk, _>(
                        w, rb, xs, out, nt, t0
                    ));
                    t0 += (nt - t0).min(4);
                }
                return;
            }
            let nb = rb / std::mem::size_of::<$blk>();
            let pairs: Vec<Vec<[i32; 4]>> = acts
                .iter()
                .map(|x| x[..nb].iter().map(min_pairs).collect())
                .collect();
            $gemm::<$blk>(w, rb, acts, &pairs, out);
        }
    };
}

/// Plain AVX2.
pub(super) mod plain {
    use super::*;
    q4k_rows!(
        "avx2,fma,f16c",
        rows_q4_k,
        BlockQ4K,
        gemm_rows8,
        Q4K_LANES_MIN.0
    );
    q4k_rows!(
        "avx2,fma,f16c",
        rows_q5_k,
        BlockQ5K,
        gemm_rows8,
        Q5K_LANES_MIN.0
    );
}

/// AVX-512 VL/BW (with VNNI, as every AVX-512 this crate runs): the same integer sums with 32
/// vector registers, prompt batches through [`gemm16`].
pub(super) mod wide {
    use super::*;
    q4k_rows!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        rows_q4_k,
        BlockQ4K,
        gemm_rows16,
        Q4K_LANES_MIN.1
    );
    q4k_rows!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        rows_q5_k,
        BlockQ5K,
        gemm_rows16,
        Q5K_LANES_MIN.1
    );
}

/// Bytes of one block of sixteen interleaved Q4_K or Q5_K rows (`crate::interleave`): `d`,
/// `dmin` and the packed scales at the same places in both ([`scales_x16`], [`dmins_x16`]),
/// then Q5_K's fifth bits, then the quant nibbles ([`qs_x16`]).
#[inline(always)]
fn x16_block<B: Kq45>() -> usize {
    GROUP * std::mem::size_of::<B>()
}

/// Where the quant nibbles of an interleaved block start: after Q5_K's fifth bits (eight
/// 64-byte units from 256) or right after the scales (Q4_K).
#[inline(always)]
fn qs_x16<B: Kq45>() -> usize {
    if B::FIVE {
        768
    } else {
        256
    }
}

/// [`scales8`] on sixteen rows from the interleaved block `b`, whose three 512-bit words of
/// packed scales hold a row per 32-bit lane already: the same arithmetic, 512 bits wide
/// (the byte shuffles work per 128-bit lane, so each mask is repeated).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn scales_x16(b: &[u8]) -> ([__m512i; 8], [__m512i; 4]) {
    let word = |k: usize| ld_u8x64(&b[64 + 64 * k..]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let low6 = _mm512_set1_epi32(0x3f3f_3f3f);
    let low4 = _mm512_set1_epi32(0x0f0f_0f0f);
    let low2 = _mm512_set1_epi32(0x0303_0303);
    let high2 =
        |w: __m512i| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w), low2));
    let s_lo = _mm512_and_si512(w0, low6);
    let s_hi = _mm512_or_si512(_mm512_and_si512(w2, low4), high2(w0));
    let m_lo = _mm512_and_si512(w1, low6);
    let m_hi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32::<4>(w2), low4),
        high2(w1),
    );
    let mask = |m: &[u8; 32]| _mm512_broadcast_i64x4(ld_u8x32(m));
    let sc = std::array::from_fn(|j| {
        let v = if j < 4 { s_lo } else { s_hi };
        _mm512_shuffle_epi8(v, mask(&SPREAD_SCALE[j % 4]))
    });
    let mn = std::array::from_fn(|k| {
        let v = if k < 2 { m_lo } else { m_hi };
        _mm512_shuffle_epi8(v, mask(&PAIR_MINS[k % 2]))
    });
    (sc, mn)
}

/// `d` and `-dmin` of the sixteen rows of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn dmins_x16(b: &[u8]) -> (__m512, __m512) {
    (
        _mm512_cvtph_ps(ld_u8x32(&b[..32])),
        // (the sign flipped in integers: `xor_ps` on 512 bits needs AVX-512 DQ)
        _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_cvtph_ps(ld_u8x32(&b[32..64]))),
            _mm512_set1_epi32(i32::MIN),
        )),
    )
}

/// Quants `4c..4c + 4` of every row of sub-blocks `2(c / 8)` (low nibbles) and
/// `2(c / 8) + 1` (high) of the interleaved block `b`, as `Packed16::q[j][c % 8]`. Q5_K's
/// fifth bits of those elements are bits `2(c / 8)` and `2(c / 8) + 1` of the fifth-bit
/// bytes `4(c % 8)..4(c % 8) + 4` of each row (the same unit of sixteen rows for every `c /
/// 8`): tested into a mask, 16 added where set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn quants_x16<B: Kq45>(b: &[u8], c: usize) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi8(0x0F);
    let v = ld_u8x64(&b[qs_x16::<B>() + 64 * c..]);
    let (lo, hi) = (
        _mm512_and_si512(v, m4),
        _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
    );
    if !B::FIVE {
        return (lo, hi);
    }
    let h = ld_u8x64(&b[256 + 64 * (c % 8)..]);
    let bit = |s: usize| _mm512_test_epi8_mask(h, _mm512_set1_epi8(1 << s));
    let sixteen = _mm512_set1_epi8(0x10);
    let k = c / 8;
    (
        _mm512_mask_add_epi8(lo, bit(2 * k), lo, sixteen),
        _mm512_mask_add_epi8(hi, bit(2 * k + 1), hi, sixteen),
    )
}

/// Block `i` of a group of sixteen interleaved rows as [`Packed16`] (for prompt batches).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn unpack_x16<B: Kq45>(group: &[u8], i: usize, p: &mut Packed16) {
    let gb = x16_block::<B>();
    let b = &group[i * gb..(i + 1) * gb];
    for k in 0..4 {
        for g in 0..8 {
            (p.q[2 * k][g], p.q[2 * k + 1][g]) = quants_x16::<B>(b, 8 * k + g);
        }
    }
    let (sc, mn) = scales_x16(b);
    p.sc = sc.map(|s| scale32(s));
    p.mn = mn;
    (p.d, p.ndmin) = dmins_x16(b);
}

/// [`gemm16`]'s integer sums on a group of sixteen interleaved rows read as it goes (decode:
/// nothing repacked, each 512-bit load of quants used at once), `pf` prefetched a few lines
/// a block. The sums are exact, so the order in which they are formed is free; each
/// sub-block's products are summed in 16 bits (Q4_K's eight groups at once, Q5_K's four at a
/// time: `8 * 31 * 128 < 2^15`) and widened by `madd` with the scale. (`vpdpbusd` sums, as in
/// [`gemm16`], were no faster here, and the loop they made cost gdsrun's decode ~15 %.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn gemv_x16<B: Kq45, const N: usize>(
    group: &[u8],
    nb: usize,
    xs: [&[ActQ8K]; N],
    pairs: [&[[i32; 4]]; N],
    pf: &[u8],
) -> [__m512; N] {
    let gb = x16_block::<B>();
    let mut acc = [_mm512_setzero_ps(); N];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let b = &group[i * gb..(i + 1) * gb];
        let (sc, mn) = scales_x16(b);
        let mut isum = [_mm512_setzero_si512(); N];
        for k in 0..4 {
            let (mut lo, mut hi) = ([_mm512_setzero_si512(); N], [_mm512_setzero_si512(); N]);
            for g in 0..8 {
                if B::FIVE && g == 4 {
                    for t in 0..N {
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_madd_epi16(lo[t], sc[2 * k]));
                        isum[t] =
                            _mm512_add_epi32(isum[t], _mm512_madd_epi16(hi[t], sc[2 * k + 1]));
                        (lo[t], hi[t]) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    }
                }
                let (ql, qh) = quants_x16::<B>(b, 8 * k + g);
                for t in 0..N {
                    let x = &xs[t][i].qs;
                    let (al, ah) = (
                        bcast4x16(&x[32 * (2 * k) + 4 * g..]),
                        bcast4x16(&x[32 * (2 * k + 1) + 4 * g..]),
                    );
                    lo[t] = _mm512_add_epi16(lo[t], _mm512_maddubs_epi16(ql, al));
                    hi[t] = _mm512_add_epi16(hi[t], _mm512_maddubs_epi16(qh, ah));
                }
            }
            for t in 0..N {
                isum[t] = _mm512_add_epi32(isum[t], _mm512_madd_epi16(lo[t], sc[2 * k]));
                isum[t] = _mm512_add_epi32(isum[t], _mm512_madd_epi16(hi[t], sc[2 * k + 1]));
            }
        }
        let (d, ndmin) = dmins_x16(b);
        for t in 0..N {
            acc[t] = finish16(acc[t], isum[t], (&mn, d, ndmin), xs[t][i].d, &pairs[t][i]);
        }
    }
    acc
}

/// Q4_K or Q5_K rows interleaved sixteen at a time against any number of tokens (AVX-512):
/// fewer than [`Q4K_LANES_MIN`] / [`Q5K_LANES_MIN`] tokens in tiles of up to four straight
/// from the interleaved bytes, more through the prompt driver with each chunk's groups
/// unpacked once. Bit for bit the stored-layout kernels' result on the same rows in file
/// order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn rows_x16<B: Kq45>(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, std::mem::size_of::<B>(), nt, out) else {
        return;
    };
    let pairs: Vec<Vec<[i32; 4]>> = acts
        .iter()
        .map(|x| x[..nb].iter().map(min_pairs).collect())
        .collect();
    let lanes_from = if B::FIVE {
        Q5K_LANES_MIN.1
    } else {
        Q4K_LANES_MIN.1
    };
    if nt < lanes_from {
        x16_tiles(w, rb, nt, |group, r, pf, t0| {
            let (a, ps) = (&acts[t0..], &pairs[t0..]);
            by_tile!(a, |xs| {
                let pv = std::array::from_fn(|k| &ps[k][..]);
                put_rows(
                    gemv_x16::<B, _>(group, nb, xs, pv, pf).map(|v| lanes16(v)),
                    r,
                    nrows,
                    out,
                    nt,
                    t0,
                )
            })
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        Packed16::zero(),
        |group, i, p| unpack_x16::<B>(group, i, p),
        |p: &[Packed16], r, t0| {
            let (a, ps) = (&acts[t0..], &pairs[t0..]);
            by_tile!(a, |xs| {
                let pv = std::array::from_fn(|k| &ps[k][..]);
                put_rows(
                    gemm16::<B, _>(p, xs, pv).map(|v| lanes16(v)),
                    r,
                    nrows,
                    out,
                    nt,
                    t0,
                )
            })
        },
    );
}

// ---------------------------------------------------------------------------------------
// The interleaved layout on plain AVX2: each 64-byte unit of a sixteen-row block holds the
// rows' 4-byte units side by side, so its 32-byte half `h` is rows `8h..8h + 8`, a row per
// 32-bit lane, as [`Packed8`] holds them: the eight-row arithmetic with nothing transposed.

/// [`scales8`] of rows `8h..8h + 8` of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_x8(b: &[u8], h: usize) -> ([__m256i; 8], [__m256i; 4]) {
    let word = |k: usize| ld_u8x32(&b[64 + 64 * k + 32 * h..]);
    scales_of(word(0), word(1), word(2))
}

/// `d` and `-dmin` of rows `8h..8h + 8` of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dmins_x8(b: &[u8], h: usize) -> (__m256, __m256) {
    let f16s = |at: usize| ld_f16x8(b[at + 16 * h..].as_chunks().0);
    (f16s(0), _mm256_xor_ps(f16s(32), _mm256_set1_ps(-0.0)))
}

/// [`quants_x16`] for rows `8h..8h + 8`: `Packed8::q[j][c % 8]` of sub-blocks `j = 2(c / 8)`
/// (low nibbles) and `2(c / 8) + 1`. Q5_K's fifth bits compared into byte masks, 16 where
/// set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants_x8<B: Kq45>(b: &[u8], c: usize, h: usize) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0F);
    let v = ld_u8x32(&b[qs_x16::<B>() + 64 * c + 32 * h..]);
    let (lo, hi) = (
        _mm256_and_si256(v, m4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
    );
    if !B::FIVE {
        return (lo, hi);
    }
    let bits = ld_u8x32(&b[256 + 64 * (c % 8) + 32 * h..]);
    let sixteen = _mm256_set1_epi8(0x10);
    let fifth = |s: usize| {
        let m = _mm256_set1_epi8((1u8 << s) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, m), m);
        _mm256_and_si256(set, sixteen)
    };
    let k = c / 8;
    (
        _mm256_or_si256(lo, fifth(2 * k)),
        _mm256_or_si256(hi, fifth(2 * k + 1)),
    )
}

/// Block `i` of a group of sixteen interleaved rows as two [`Packed8`] (rows 0..8, 8..16),
/// for prompt batches on plain AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_x8<B: Kq45>(group: &[u8], i: usize, p: &mut [Packed8; 2]) {
    let gb = x16_block::<B>();
    let b = &group[i * gb..(i + 1) * gb];
    for (h, p) in p.iter_mut().enumerate() {
        for k in 0..4 {
            for g in 0..8 {
                (p.q[2 * k][g], p.q[2 * k + 1][g]) = quants_x8::<B>(b, 8 * k + g, h);
            }
        }
        (p.sc, p.mn) = scales_x8(b, h);
        (p.d, p.ndmin) = dmins_x8(b, h);
    }
}

/// [`gemv_x16`] on plain AVX2: each block of the group read as two halves of eight rows,
/// each half's integer sums formed as [`gemm8`] forms them (so each row's result is the same
/// bits), straight from the interleaved bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemv_x8<B: Kq45, const N: usize>(
    group: &[u8],
    nb: usize,
    xs: [&[ActQ8K]; N],
    pairs: [&[[i32; 4]]; N],
    pf: &[u8],
) -> [[__m256; N]; 2] {
    let gb = x16_block::<B>();
    let mut acc = [[_mm256_setzero_ps(); N]; 2];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let b = &group[i * gb..(i + 1) * gb];
        for (h, acc) in acc.iter_mut().enumerate() {
            let (sc, mn) = scales_x8(b, h);
            let mut isum = [_mm256_setzero_si256(); N];
            for k in 0..4 {
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
                for g in 0..8 {
                    if B::FIVE && g == 4 {
                        for t in 0..N {
                            isum[t] =
                                _mm256_add_epi32(isum[t], _mm256_madd_epi16(lo[t], sc[2 * k]));
                            isum[t] =
                                _mm256_add_epi32(isum[t], _mm256_madd_epi16(hi[t], sc[2 * k + 1]));
                            (lo[t], hi[t]) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        }
                    }
                    let (ql, qh) = quants_x8::<B>(b, 8 * k + g, h);
                    for t in 0..N {
                        let x = &xs[t][i].qs;
                        let (al, ah) = (
                            bcast4(&x[32 * (2 * k) + 4 * g..]),
                            bcast4(&x[32 * (2 * k + 1) + 4 * g..]),
                        );
                        lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(ql, al));
                        hi[t] = _mm256_add_epi16(hi[t], _mm256_maddubs_epi16(qh, ah));
                    }
                }
                for t in 0..N {
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(lo[t], sc[2 * k]));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(hi[t], sc[2 * k + 1]));
                }
            }
            let (d, ndmin) = dmins_x8(b, h);
            for t in 0..N {
                let m = mins8(&mn, &pairs[t][i]);
                acc[t] = finish8(acc[t], d, ndmin, xs[t][i].d, isum[t], m);
            }
        }
    }
    acc
}

/// [`rows_x16`] on plain AVX2 (and AVX-VNNI, whose K-quant sums are AVX2's): the same
/// drivers, each group's two halves of eight rows through [`gemv_x8`] (decode) or unpacked
/// into [`Packed8`] for [`gemm8`] (prompts). Bit for bit the stored-layout kernels' result.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_x16_avx2<B: Kq45>(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, std::mem::size_of::<B>(), nt, out) else {
        return;
    };
    let pairs: Vec<Vec<[i32; 4]>> = acts
        .iter()
        .map(|x| x[..nb].iter().map(min_pairs).collect())
        .collect();
    let lanes_from = if B::FIVE {
        Q5K_LANES_MIN.0
    } else {
        Q4K_LANES_MIN.0
    };
    if nt < lanes_from {
        x16_tiles(w, rb, nt, |group, r, pf, t0| {
            let (a, ps) = (&acts[t0..], &pairs[t0..]);
            by_tile!(a, |xs| {
                let pv = std::array::from_fn(|k| &ps[k][..]);
                put_halves(
                    gemv_x8::<B, _>(group, nb, xs, pv, pf),
                    r,
                    nrows,
                    out,
                    (nt, t0),
                );
            })
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        [Packed8::zero(); 2],
        |group, i, p| unpack_x8::<B>(group, i, p),
        |p: &[[Packed8; 2]], r, t0| {
            let (a, ps) = (&acts[t0..], &pairs[t0..]);
            by_tile!(a, |xs| {
                let pv = std::array::from_fn(|k| &ps[k][..]);
                for h in 0..2 {
                    let v = gemm8_by::<B, _, _>(p, |u| &u[h], xs, pv);
                    put_rows(v.map(|v| lanes8(v)), r + 8 * h, nrows, out, nt, t0);
                }
            })
        },
    );
}
