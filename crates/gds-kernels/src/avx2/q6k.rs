//! Q6_K rows eight (AVX2) or sixteen (AVX-512) at a time, one row per 32-bit vector lane:
//! the scheme of [`super::q4k`]. Every path ends a block the same way per row: the block's
//! integer sum `I` (sub-block products scaled by their scales, less 32 times the scaled
//! activation sums), then `acc = fma(d * dx, I, acc)`; so a row's result is the same bits
//! whichever path computed it. Fewer than eight tokens: rows in their stored layout, eight
//! side by side, the row-at-a-time integer sums folded by an `hadd` tree ([`rows8`]); more:
//! chunks of rows repacked once ([`Packed8`]) and every tile of tokens against them.
//!
//! The repacked layout and its products serve every K-quant of sixteen 16-element sub-blocks
//! with unsigned quants after an offset: Q6_K (`q + 32`), Q3_K (`q + 4`) and Q2_K (`q`, with
//! a min per sub-block); only the block end differs ([`Sub16`]), and `super::q23k` repacks
//! its two types into the same [`Packed8`].

use super::q4k::{
    bcast4, bcast4x16, by_tile, chunked, group8, join, join_ps, lanes16, lanes8, put8, put_halves,
    put_rows, transpose16, transpose8, x16_chunked, x16_shape, x16_tiles,
};
use super::*;
use crate::interleave::GROUP;

/// How a block of a [`Packed8`] ends, per row: from its integer sum `I` (the repacked
/// quants' products, each sub-block's scaled) and `P`, the sum over sub-blocks of
/// [`Packed8::scp`]'s value times the activation sum, with `dx` the activations' scale:
/// - `Q6` (Q6_K): `acc = fma(d * dx, I - 32 P, acc)`;
/// - `Q3` (Q3_K): `acc + (d * dx) * (I - 4 P)`;
/// - `Q2` (Q2_K, `P` from the mins): `acc + ((d * dx) * I - (dmin * dx) * P)`;
/// - `IQ` (the grid i-quants, `super::iq`: values `v + 64`, 2..=126, scales the odd
///   multipliers): `acc + (d * dx) * (I - 64 P)`, the row kernel's expression (its type's
///   constant factor applied to the row's sum after);
///
/// each the float expression of its type's row-at-a-time kernel, so every path gives a row
/// the same bits.
pub(super) type Sub16 = u8;
pub(super) const Q6: Sub16 = 6;
pub(super) const Q3: Sub16 = 3;
pub(super) const Q2: Sub16 = 2;
pub(super) const IQ: Sub16 = 1;

/// Eight rows of one sixteen-sub-block K-quant block, repacked with row `r` in 32-bit lane `r`.
#[derive(Clone, Copy)]
pub(super) struct Packed8 {
    /// Unsigned quants (Q6_K 0..63, Q3_K 0..7, Q2_K 0..3) of elements `32j + 4g..32j + 4g + 4`
    /// of row `r` in bytes `4r..4r + 4` of `q[j][g]` (sub-block `2j` in groups 0..4, `2j + 1`
    /// in 4..8).
    pub(super) q: [[__m256i; 8]; 8],
    /// The scale of sub-block `s` of row `r` in 16-bit lanes `2r` and `2r + 1`.
    pub(super) sc: [__m256i; 16],
    /// The scales (Q6_K, Q3_K) or mins (Q2_K) of sub-blocks `2k` and `2k + 1` of row `r` in
    /// 16-bit lanes `2r`, `2r + 1`.
    pub(super) scp: [__m256i; 8],
    /// `d` of each row.
    pub(super) d: __m256,
    /// `dmin` of each row (Q2_K; zero for the others).
    pub(super) dmin: __m256,
}

/// `pshufb` masks that put bytes `a` and `b` of each 32-bit lane in the high bytes of its
/// two 16-bit halves (low bytes zero), for an arithmetic shift to sign-extend them.
const fn high_bytes(a: usize, b: usize) -> [u8; 32] {
    let mut m = [0x80u8; 32];
    let mut d = 0;
    while d < 8 {
        m[4 * d + 1] = (4 * (d % 4) + a) as u8;
        m[4 * d + 3] = (4 * (d % 4) + b) as u8;
        d += 1;
    }
    m
}

/// Byte `j` of each lane in both halves: scale `4k + j` of each row, twice ([`Packed8::sc`]).
const SPREAD_SCALE: [[u8; 32]; 4] = [
    high_bytes(0, 0),
    high_bytes(1, 1),
    high_bytes(2, 2),
    high_bytes(3, 3),
];

/// Bytes `2p` and `2p + 1` of each lane: scales `4k + 2p`, `4k + 2p + 1` ([`Packed8::scp`]).
const PAIR_SCALES: [[u8; 32]; 2] = [high_bytes(0, 1), high_bytes(2, 3)];

/// The scales of block `i` of eight rows: `Packed8::sc` and `Packed8::scp`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8(rows: &[&[BlockQ6K]; 8], i: usize) -> ([__m256i; 16], [__m256i; 8]) {
    spread_scales8(&std::array::from_fn(|r| rows[r][i].scales.map(|b| b as u8)))
}

/// Sixteen signed byte scales of each of eight rows (`s[r]`) as `Packed8::sc` and
/// `Packed8::scp`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn spread_scales8(s: &[[u8; 16]; 8]) -> ([__m256i; 16], [__m256i; 8]) {
    // four scales a 32-bit word, row `r` in lane `r` of `words[k]`
    spread_words8(std::array::from_fn(|k| rows_word8(|r| &s[r][..], k)))
}

/// Bytes `4k..4k + 4` of each of eight rows' bytes (`bytes(r)`) as a 32-bit word, row `r` in
/// lane `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_word8<'a>(bytes: impl Fn(usize) -> &'a [u8], k: usize) -> __m256i {
    let w = |r: usize| {
        let b = bytes(r);
        i32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]])
    };
    _mm256_setr_epi32(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7))
}

/// Sixteen signed byte scales of eight rows, four a 32-bit word (`words[k]`: scales
/// `4k..4k + 4`, row `r` in lane `r`), as `Packed8::sc` and `Packed8::scp`: spread into
/// 16-bit lanes with byte shuffles and sign-extended by a shift.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn spread_words8(words: [__m256i; 4]) -> ([__m256i; 16], [__m256i; 8]) {
    let spread =
        |w: __m256i, m: &[u8; 32]| _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(w, ld_u8x32(m)));
    (
        std::array::from_fn(|s| spread(words[s / 4], &SPREAD_SCALE[s % 4])),
        std::array::from_fn(|k| spread(words[k / 2], &PAIR_SCALES[k % 2])),
    )
}

/// Quants of half `h` of block `i` of eight rows: `Packed8::q[4h..4h + 4]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants8(rows: &[&[BlockQ6K]; 8], i: usize, h: usize) -> [[__m256i; 8]; 4] {
    let v: [[__m256i; 4]; 8] = std::array::from_fn(|r| quants_q6_k(&rows[r][i], h));
    std::array::from_fn(|c| transpose8(std::array::from_fn(|r| v[r][c])))
}

impl Packed8 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn zero() -> Packed8 {
        let z = _mm256_setzero_si256();
        Packed8 {
            q: [[z; 8]; 8],
            sc: [z; 16],
            scp: [z; 8],
            d: _mm256_setzero_ps(),
            dmin: _mm256_setzero_ps(),
        }
    }
}

/// Repacks block `i` of eight rows into `p` (in place: the chunk's storage).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8(rows: &[&[BlockQ6K]; 8], i: usize, p: &mut Packed8) {
    for h in 0..2 {
        let q = quants8(rows, i, h);
        p.q[4 * h..4 * h + 4].copy_from_slice(&q);
    }
    (p.sc, p.scp) = scales8(rows, i);
    p.d = d8(rows, i);
}

/// `d` of block `i` of eight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn d8(rows: &[&[BlockQ6K]; 8], i: usize) -> __m256 {
    let b = |r: usize| i16::from_le_bytes(rows[r][i].d);
    f16x8(b)
}

/// Eight repacked rows (block `i` in `p[i]`) against `N` tokens: each token's eight row sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm8<const K: Sub16, const N: usize>(p: &[Packed8], xs: [&[ActQ8K]; N]) -> [__m256; N] {
    gemm8_by::<K, _, N>(p, |u| u, xs)
}

/// [`gemm8`] over the eight-row parts `part(p[i])` of block `i`'s repacked rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm8_by<const K: Sub16, P, const N: usize>(
    p: &[P],
    part: impl Fn(&P) -> &Packed8,
    xs: [&[ActQ8K]; N],
) -> [__m256; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, u) in p.iter().enumerate() {
        let u = part(u);
        let mut isum = [_mm256_setzero_si256(); N];
        for j in 0..8 {
            for h in 0..2 {
                // u6 x i8: 2 * 63 * 127 per 16-bit lane and product pair, two pairs summed
                // (< 2^15) before the scale
                let sc = u.sc[2 * j + h];
                for t in 0..N {
                    let x = &xs[t][i].qs[32 * j + 16 * h..];
                    if K == IQ {
                        // u7 x i8: one `maddubs` pair is < 2^15, two might not be: each
                        // scaled into 32 bits on its own
                        for g in 4 * h..4 * h + 4 {
                            let p = _mm256_maddubs_epi16(u.q[j][g], bcast4(&x[4 * (g % 4)..]));
                            isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
                        }
                        continue;
                    }
                    let mut sum = [_mm256_setzero_si256(); 2];
                    for (k, sum) in sum.iter_mut().enumerate() {
                        let g = 4 * h + 2 * k;
                        *sum = _mm256_add_epi16(
                            _mm256_maddubs_epi16(u.q[j][g], bcast4(&x[8 * k..])),
                            _mm256_maddubs_epi16(u.q[j][g + 1], bcast4(&x[8 * k + 4..])),
                        );
                    }
                    isum[t] = _mm256_add_epi32(
                        isum[t],
                        _mm256_add_epi32(
                            _mm256_madd_epi16(sum[0], sc),
                            _mm256_madd_epi16(sum[1], sc),
                        ),
                    );
                }
            }
        }
        for t in 0..N {
            acc[t] = finish8::<K>(acc[t], isum[t], &u.scp, (u.d, u.dmin), &xs[t][i]);
        }
    }
    acc
}

/// The block end of [`gemm8`] ([`Sub16`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn finish8<const K: Sub16>(
    acc: __m256,
    isum: __m256i,
    scp: &[__m256i; 8],
    (d, dmin): (__m256, __m256),
    x: &ActQ8K,
) -> __m256 {
    let mut off = _mm256_setzero_si256();
    for (k, scp) in scp.iter().enumerate() {
        let pair = bsum_pair(&x.bsums, k);
        off = _mm256_add_epi32(off, _mm256_madd_epi16(*scp, _mm256_set1_epi32(pair)));
    }
    let dx = _mm256_set1_ps(x.d);
    match K {
        Q6 => {
            let it = _mm256_sub_epi32(isum, _mm256_slli_epi32::<5>(off));
            _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(it), acc)
        }
        Q3 => {
            let it = _mm256_sub_epi32(isum, _mm256_slli_epi32::<2>(off));
            _mm256_add_ps(
                acc,
                _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(it)),
            )
        }
        IQ => {
            let it = _mm256_sub_epi32(isum, _mm256_slli_epi32::<6>(off));
            _mm256_add_ps(
                acc,
                _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(it)),
            )
        }
        _ => {
            let i = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum));
            let m = _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(off));
            _mm256_add_ps(acc, _mm256_sub_ps(i, m))
        }
    }
}

/// Activation sums `2k` (low 16 bits) and `2k + 1` as one dword.
#[inline(always)]
fn bsum_pair(bsums: &[i16; 16], k: usize) -> i32 {
    (bsums[2 * k] as u16 as u32 | (bsums[2 * k + 1] as u16 as u32) << 16) as i32
}

/// One row's block `i` against `N` tokens in the row-at-a-time arithmetic: the partial
/// integer sums, eight lanes a token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row_sums<const N: usize>(b: &BlockQ6K, a: &[&[ActQ8K]; N], i: usize) -> [__m256i; N] {
    let scales = ld_i8x16(&b.scales);
    let mut isum = offset_q6_k(_mm256_cvtepi8_epi16(scales), a, i);
    for h in 0..2 {
        for (c, &q) in quants_q6_k(b, h).iter().enumerate() {
            let j = 4 * h + c;
            group_q6_k(q, scale_pair_q6_k(scales, j), j, a, i, &mut isum);
        }
    }
    isum
}

/// Rows `2p`, `2p + 1` of eight, block `i`, pairwise added:
/// `[r(0-1) r(2-3) r'(0-1) r'(2-3) | r(4-5) r(6-7) r'(4-5) r'(6-7)]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_sums<const N: usize>(
    rows: &[&[BlockQ6K]; 8],
    p: usize,
    a: &[&[ActQ8K]; N],
    i: usize,
) -> [__m256i; N] {
    let u0 = row_sums(&rows[2 * p][i], a, i);
    let u1 = row_sums(&rows[2 * p + 1][i], a, i);
    std::array::from_fn(|t| _mm256_hadd_epi32(u0[t], u1[t]))
}

/// Eight rows in their stored layout against `N` tokens: each token's eight results, row
/// `r` in lane `r`. `pf` (the next rows) is prefetched a few lines a block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8<const N: usize>(rows: &[&[BlockQ6K]; 8], a: &[&[ActQ8K]; N], pf: &[u8]) -> [__m256; N] {
    let nb = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == nb) && a.iter().all(|x| x.len() >= nb));
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let (w0, w1) = (pair_sums(rows, 0, a, i), pair_sums(rows, 1, a, i));
        // [r0(0-3) r1(0-3) r2(0-3) r3(0-3) | r0(4-7) ...]
        let lo: [__m256i; N] = std::array::from_fn(|t| _mm256_hadd_epi32(w0[t], w1[t]));
        let (w2, w3) = (pair_sums(rows, 2, a, i), pair_sums(rows, 3, a, i));
        let d = d8(rows, i);
        for t in 0..N {
            let hi = _mm256_hadd_epi32(w2[t], w3[t]);
            let it = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(lo[t], hi),
                _mm256_permute2x128_si256::<0x31>(lo[t], hi),
            );
            let dx = _mm256_set1_ps(a[t][i].d);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(it), acc[t]);
        }
    }
    acc
}

const IDENTITY: [usize; 8] = [0, 1, 2, 3, 4, 5, 6, 7];

/// Every row against one tile of `N` tokens from `t0`, rows in their stored layout.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_rows<const N: usize>(
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
        let acc = rows8(&group8(w, rb, r, nrows), &a, pf);
        put8(&acc, &IDENTITY, r, nrows, out, nt, t0);
    }
}

/// Sixteen rows of one Q6_K block for AVX-512: [`Packed8`]'s layout, rows 8..16 in lanes
/// 8..16 of 512-bit vectors.
#[derive(Clone, Copy)]
pub(super) struct Packed16 {
    pub(super) q: [[__m512i; 8]; 8],
    pub(super) sc: [__m512i; 16],
    pub(super) scp: [__m512i; 8],
    pub(super) d: __m512,
    pub(super) dmin: __m512,
}

impl Packed16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    fn zero() -> Packed16 {
        let z = _mm512_setzero_si512();
        Packed16 {
            q: [[z; 8]; 8],
            sc: [z; 16],
            scp: [z; 8],
            d: _mm512_setzero_ps(),
            dmin: _mm512_setzero_ps(),
        }
    }
}

/// Repacks block `i` of sixteen rows (`lo`: lanes 0..8, `hi`: 8..16) into `p`, each part of
/// the two halves joined as soon as both are made.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16(lo: &[&[BlockQ6K]; 8], hi: &[&[BlockQ6K]; 8], i: usize, p: &mut Packed16) {
    for h in 0..2 {
        let a: [[__m256i; 4]; 8] = std::array::from_fn(|r| quants_q6_k(&lo[r][i], h));
        let b: [[__m256i; 4]; 8] = std::array::from_fn(|r| quants_q6_k(&hi[r][i], h));
        for c in 0..4 {
            p.q[4 * h + c] = transpose16(
                std::array::from_fn(|r| a[r][c]),
                std::array::from_fn(|r| b[r][c]),
            );
        }
    }
    let ((asc, ascp), (bsc, bscp)) = (scales8(lo, i), scales8(hi, i));
    p.sc = std::array::from_fn(|s| join(asc[s], bsc[s]));
    p.scp = std::array::from_fn(|k| join(ascp[k], bscp[k]));
    p.d = join_ps(d8(lo, i), d8(hi, i));
}

/// [`gemm8`]'s integer sums on sixteen rows with VNNI: each sub-block's sixteen products
/// summed by `vpdpbusd` (exact, as `maddubs` pairs summed in 16 bits are), then scaled: Q6_K's
/// (and the grid i-quants') by a 32-bit multiply; Q3_K's by one `madd` (its sum fits 16 bits: 16 x 7 x 128, so the
/// scale in the low half of each 32-bit lane and zero in the high half multiply it exactly).
/// Q2_K's quants carry their scales already (`super::q23k`), so its products go straight
/// into the block's sum. With `maddubs` pairs as [`gemm8`] Q6_K's prompts took 14-17 % longer
/// (`decode_bw q6_k 16|64`, 2048 x 2048 x 4, Zen 4: 493 / 1422 us against 446 / 1217).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemm16<const K: Sub16, const N: usize>(p: &[Packed16], xs: [&[ActQ8K]; N]) -> [__m512; N] {
    let low = _mm512_set1_epi32(0xFFFF);
    let mut acc = [_mm512_setzero_ps(); N];
    for (i, u) in p.iter().enumerate() {
        let mut isum = [_mm512_setzero_si512(); N];
        for j in 0..8 {
            for h in 0..2 {
                let mut s = [_mm512_setzero_si512(); N];
                for g in 4 * h..4 * h + 4 {
                    let w = u.q[j][g];
                    for t in 0..N {
                        let a = bcast4x16(&xs[t][i].qs[32 * j + 4 * g..]);
                        if K == Q2 {
                            isum[t] = _mm512_dpbusd_epi32(isum[t], w, a);
                        } else {
                            s[t] = _mm512_dpbusd_epi32(s[t], w, a);
                        }
                    }
                }
                if K == Q3 {
                    let sc = _mm512_and_si512(u.sc[2 * j + h], low);
                    for t in 0..N {
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_madd_epi16(s[t], sc));
                    }
                } else if K == Q6 || K == IQ {
                    let sc = _mm512_srai_epi32::<16>(u.sc[2 * j + h]);
                    for t in 0..N {
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s[t], sc));
                    }
                }
            }
        }
        for t in 0..N {
            acc[t] = finish16::<K>(acc[t], isum[t], &u.scp, (u.d, u.dmin), &xs[t][i]);
        }
    }
    acc
}

/// Q6_K prompt batches on plain AVX2: groups of eight rows.
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm_rows8(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows8::<BlockQ6K, Q6>(w, rb, acts, out, |rows, i, p| repack8(rows, i, p));
}

/// Q6_K prompt batches on AVX-512: groups of sixteen rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn gemm_rows16(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows16::<BlockQ6K, Q6>(w, rb, acts, out, |lo, hi, i, p| repack16(lo, hi, i, p));
}

/// Prompt batches of a sixteen-sub-block K-quant `B` on plain AVX2: chunks of rows repacked
/// eight a group by `repack(rows, block, into)`, then every tile of tokens against them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn lanes_rows8<B, const K: Sub16>(
    w: &[u8],
    rb: usize,
    acts: &[&[ActQ8K]],
    out: &mut [f32],
    mut repack: impl FnMut(&[&[B]; 8], usize, &mut Packed8),
) where
    B: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned,
{
    let (nt, nrows, nb) = (acts.len(), w.len() / rb, rb / std::mem::size_of::<B>());
    chunked(
        w,
        rb,
        (nb, 8, nt),
        Packed8::zero(),
        |r| group8::<B>(w, rb, r, nrows),
        |rows, i, p| repack(rows, i, p),
        |p: &[Packed8], r, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemm8::<K, _>(p, xs).map(|v| lanes8(v)),
                r,
                nrows,
                out,
                nt,
                t0
            ))
        },
    );
}

/// [`lanes_rows8`] on AVX-512: groups of sixteen rows, `repack(rows 0..8, rows 8..16, block,
/// into)`, products by [`gemm16`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn lanes_rows16<B, const K: Sub16>(
    w: &[u8],
    rb: usize,
    acts: &[&[ActQ8K]],
    out: &mut [f32],
    mut repack: impl FnMut(&[&[B]; 8], &[&[B]; 8], usize, &mut Packed16),
) where
    B: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned,
{
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
        |(lo, hi), i, p| repack(lo, hi, i, p),
        |p: &[Packed16], r, t0| {
            by_tile!(&acts[t0..], |xs| {
                let v = gemm16::<K, _>(p, xs);
                put_rows(v.map(|v| lanes16(v)), r, nrows, out, nt, t0)
            })
        },
    );
}

/// Tokens from which Q6_K rows are repacked (eight-row AVX2, sixteen-row AVX-512 kernels):
/// as [`super::q4k::Q4K_LANES_MIN`], measured the same way (`decode_bw -- q6_k N`): AVX2 9
/// tokens 3.13 ms repacked / 3.50 in tiles, 8: 3.02 / 2.83; AVX-512 9: 3.28 / 3.58, 8: 3.40 /
/// 2.86 (in the 1B runs of [`super::q4k::Q4K_LANES_MIN`] most Q6_K rows are the output head
/// and `ffn_down`).
pub(super) const Q6K_LANES_MIN: (usize, usize) = (9, 9);

/// Generates `rows_q6_k` for the target features `$feat`, prompt batches through `$gemm`.
macro_rules! q6k_rows {
    ($feat:literal, $gemm:ident, $min:expr) => {
        /// Q6_K rows against `acts`, `out[r * nt + t]`: rows in their stored layout for fewer
        /// than [`Q6K_LANES_MIN`] tokens, repacked chunks for more (the same arithmetic).
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn rows_q6_k(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
            let nt = acts.len();
            if nt == 0 || w.len() < rb {
                return;
            }
            if nt >= $min {
                return $gemm(w, rb, acts, out);
            }
            let mut t0 = 0;
            while t0 < nt {
                by_tile!(&acts[t0..], |xs| tile_rows(w, rb, xs, out, nt, t0));
                t0 += (nt - t0).min(4);
            }
        }
    };
}

/// Plain AVX2.
pub(super) mod plain {
    use super::*;
    q6k_rows!("avx2,fma,f16c", gemm_rows8, Q6K_LANES_MIN.0);
}

/// AVX-512 VL/BW/VNNI: sixteen rows a vector for prompt batches, 32 registers.
pub(super) mod wide {
    use super::*;
    q6k_rows!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        gemm_rows16,
        Q6K_LANES_MIN.1
    );
}

/// Bytes of one block of sixteen interleaved Q6_K rows (`crate::interleave`).
const X16_BLOCK: usize = GROUP * std::mem::size_of::<BlockQ6K>();

/// The scales of the interleaved block `b` (its four 512-bit words of scales hold a row per
/// 32-bit lane already): [`scales8`]'s shuffles and sign extension, 512 bits wide (the masks
/// repeat per 128-bit lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn scales_x16(b: &[u8]) -> ([__m512i; 16], [__m512i; 8]) {
    let words: [__m512i; 4] = std::array::from_fn(|k| ld_u8x64(&b[3072 + 64 * k..]));
    let spread = |w: __m512i, m: &[u8; 32]| {
        _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(w, _mm512_broadcast_i64x4(ld_u8x32(m))))
    };
    (
        std::array::from_fn(|s| spread(words[s / 4], &SPREAD_SCALE[s % 4])),
        std::array::from_fn(|k| spread(words[k / 2], &PAIR_SCALES[k % 2])),
    )
}

/// `Packed16::q[4h + c][g]` for `c` in 0..4 (elements `128h + 32c + 4g..+4` of every row):
/// [`quants_q6_k`]'s bit assembly on three 512-bit loads of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn quants_x16(b: &[u8], h: usize, g: usize) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0F);
    let m3 = _mm512_set1_epi8(3);
    let m30 = _mm512_set1_epi8(0x30);
    let ql0 = ld_u8x64(&b[64 * (16 * h + g)..]);
    let ql1 = ld_u8x64(&b[64 * (16 * h + 8 + g)..]);
    let qh = ld_u8x64(&b[2048 + 64 * (8 * h + g)..]);
    let qh2 = _mm512_srli_epi16::<2>(qh);
    [
        _mm512_or_si512(
            _mm512_and_si512(ql0, m4),
            _mm512_slli_epi16::<4>(_mm512_and_si512(qh, m3)),
        ),
        _mm512_or_si512(
            _mm512_and_si512(ql1, m4),
            _mm512_slli_epi16::<4>(_mm512_and_si512(qh2, m3)),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), m4),
            _mm512_and_si512(qh, m30),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), m4),
            _mm512_and_si512(qh2, m30),
        ),
    ]
}

/// `d` of the sixteen rows of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn d_x16(b: &[u8]) -> __m512 {
    _mm512_cvtph_ps(ld_u8x32(&b[3328..3360]))
}

/// Block `i` of a group of sixteen interleaved rows as [`Packed16`] (for prompt batches).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn unpack_x16(group: &[u8], i: usize, p: &mut Packed16) {
    let b = &group[i * X16_BLOCK..(i + 1) * X16_BLOCK];
    for h in 0..2 {
        for g in 0..8 {
            let q = quants_x16(b, h, g);
            for (c, q) in q.into_iter().enumerate() {
                p.q[4 * h + c][g] = q;
            }
        }
    }
    (p.sc, p.scp) = scales_x16(b);
    p.d = d_x16(b);
}

/// The block end of [`gemm16`]: [`finish8`]'s, sixteen lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn finish16<const K: Sub16>(
    acc: __m512,
    isum: __m512i,
    scp: &[__m512i; 8],
    (d, dmin): (__m512, __m512),
    x: &ActQ8K,
) -> __m512 {
    let mut off = _mm512_setzero_si512();
    for (k, scp) in scp.iter().enumerate() {
        let pair = bsum_pair(&x.bsums, k);
        off = _mm512_add_epi32(off, _mm512_madd_epi16(*scp, _mm512_set1_epi32(pair)));
    }
    let dx = _mm512_set1_ps(x.d);
    match K {
        Q6 => {
            let it = _mm512_sub_epi32(isum, _mm512_slli_epi32::<5>(off));
            _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(it), acc)
        }
        Q3 => {
            let it = _mm512_sub_epi32(isum, _mm512_slli_epi32::<2>(off));
            _mm512_add_ps(
                acc,
                _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(it)),
            )
        }
        IQ => {
            let it = _mm512_sub_epi32(isum, _mm512_slli_epi32::<6>(off));
            _mm512_add_ps(
                acc,
                _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(it)),
            )
        }
        _ => {
            let i = _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum));
            let m = _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(off));
            _mm512_add_ps(acc, _mm512_sub_ps(i, m))
        }
    }
}

/// [`gemm16`]'s arithmetic on a group of sixteen interleaved rows read as it goes (decode:
/// nothing repacked), `pf` prefetched a few lines a block: the same pairs of products summed
/// in 16 bits, the same exact integer sums, the same block end.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn gemv_x16<const N: usize>(group: &[u8], nb: usize, xs: [&[ActQ8K]; N], pf: &[u8]) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let b = &group[i * X16_BLOCK..(i + 1) * X16_BLOCK];
        let (sc, scp) = scales_x16(b);
        let mut isum = [_mm512_setzero_si512(); N];
        for h in 0..2 {
            for g0 in (0..8).step_by(2) {
                let (q0, q1) = (quants_x16(b, h, g0), quants_x16(b, h, g0 + 1));
                for c in 0..4 {
                    // sub-block 2j + g0 / 4 of `j`'s 32 elements, its elements 4 * g0..
                    let j = 4 * h + c;
                    let s = sc[2 * j + g0 / 4];
                    for t in 0..N {
                        let x = &xs[t][i].qs[32 * j + 4 * g0..];
                        let sum = _mm512_add_epi16(
                            _mm512_maddubs_epi16(q0[c], bcast4x16(x)),
                            _mm512_maddubs_epi16(q1[c], bcast4x16(&x[4..])),
                        );
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_madd_epi16(sum, s));
                    }
                }
            }
        }
        let d = d_x16(b);
        for t in 0..N {
            acc[t] = finish16::<Q6>(acc[t], isum[t], &scp, (d, d), &xs[t][i]);
        }
    }
    acc
}

/// Q6_K rows interleaved sixteen at a time against any number of tokens (AVX-512): fewer
/// than [`Q6K_LANES_MIN`] tokens in tiles of up to four straight from the interleaved bytes,
/// more through the prompt driver with each chunk's groups unpacked once. Bit for bit the
/// stored-layout kernels' result on the same rows in file order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn rows_x16(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, std::mem::size_of::<BlockQ6K>(), nt, out) else {
        return;
    };
    if nt < Q6K_LANES_MIN.1 {
        x16_tiles(w, rb, nt, |group, r, pf, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemv_x16(group, nb, xs, pf).map(|v| lanes16(v)),
                r,
                nrows,
                out,
                nt,
                t0
            ))
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        Packed16::zero(),
        |group, i, p| unpack_x16(group, i, p),
        |p: &[Packed16], r, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemm16::<Q6, _>(p, xs).map(|v| lanes16(v)),
                r,
                nrows,
                out,
                nt,
                t0
            ))
        },
    );
}

// ---------------------------------------------------------------------------------------
// The interleaved layout on plain AVX2: the 32-byte half `half` of each 64-byte unit is
// rows `8 * half..8 * half + 8`, a row per 32-bit lane (as in `super::q4k`).

/// [`scales8`] of rows `8 * half..` of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_x8(b: &[u8], half: usize) -> ([__m256i; 16], [__m256i; 8]) {
    let words: [__m256i; 4] = std::array::from_fn(|k| ld_u8x32(&b[3072 + 64 * k + 32 * half..]));
    let spread =
        |w: __m256i, m: &[u8; 32]| _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(w, ld_u8x32(m)));
    (
        std::array::from_fn(|s| spread(words[s / 4], &SPREAD_SCALE[s % 4])),
        std::array::from_fn(|k| spread(words[k / 2], &PAIR_SCALES[k % 2])),
    )
}

/// [`quants_x16`] for rows `8 * half..`: `Packed8::q[4h + c][g]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quants_x8(b: &[u8], h: usize, g: usize, half: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let m30 = _mm256_set1_epi8(0x30);
    let at = |unit: usize| ld_u8x32(&b[64 * unit + 32 * half..]);
    let (ql0, ql1, qh) = (at(16 * h + g), at(16 * h + 8 + g), at(32 + 8 * h + g));
    let qh2 = _mm256_srli_epi16::<2>(qh);
    [
        _mm256_or_si256(
            _mm256_and_si256(ql0, m4),
            _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(ql1, m4),
            _mm256_slli_epi16::<4>(_mm256_and_si256(qh2, m3)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
            _mm256_and_si256(qh, m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            _mm256_and_si256(qh2, m30),
        ),
    ]
}

/// `d` of rows `8 * half..` of the interleaved block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn d_x8(b: &[u8], half: usize) -> __m256 {
    ld_f16x8(b[3328 + 16 * half..].as_chunks().0)
}

/// Block `i` of a group of sixteen interleaved rows as two [`Packed8`] (rows 0..8, 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_x8(group: &[u8], i: usize, p: &mut [Packed8; 2]) {
    let b = &group[i * X16_BLOCK..(i + 1) * X16_BLOCK];
    for (half, p) in p.iter_mut().enumerate() {
        for h in 0..2 {
            for g in 0..8 {
                let q = quants_x8(b, h, g, half);
                for (c, q) in q.into_iter().enumerate() {
                    p.q[4 * h + c][g] = q;
                }
            }
        }
        (p.sc, p.scp) = scales_x8(b, half);
        p.d = d_x8(b, half);
    }
}

/// [`gemv_x16`] on plain AVX2: each block read as two halves of eight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemv_x8<const N: usize>(
    group: &[u8],
    nb: usize,
    xs: [&[ActQ8K]; N],
    pf: &[u8],
) -> [[__m256; N]; 2] {
    let mut acc = [[_mm256_setzero_ps(); N]; 2];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let b = &group[i * X16_BLOCK..(i + 1) * X16_BLOCK];
        for (half, acc) in acc.iter_mut().enumerate() {
            let (sc, scp) = scales_x8(b, half);
            let mut isum = [_mm256_setzero_si256(); N];
            for h in 0..2 {
                for g0 in (0..8).step_by(2) {
                    let (q0, q1) = (quants_x8(b, h, g0, half), quants_x8(b, h, g0 + 1, half));
                    for c in 0..4 {
                        let j = 4 * h + c;
                        let s = sc[2 * j + g0 / 4];
                        for t in 0..N {
                            let x = &xs[t][i].qs[32 * j + 4 * g0..];
                            let sum = _mm256_add_epi16(
                                _mm256_maddubs_epi16(q0[c], bcast4(x)),
                                _mm256_maddubs_epi16(q1[c], bcast4(&x[4..])),
                            );
                            isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(sum, s));
                        }
                    }
                }
            }
            let d = d_x8(b, half);
            for t in 0..N {
                acc[t] = finish8::<Q6>(acc[t], isum[t], &scp, (d, d), &xs[t][i]);
            }
        }
    }
    acc
}

/// [`rows_x16`] on plain AVX2 (and AVX-VNNI): each group's halves of eight rows through
/// [`gemv_x8`] (decode) or unpacked into [`Packed8`] for [`gemm8`] (prompts). Bit for bit
/// the stored-layout kernels' result.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_x16_avx2(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, std::mem::size_of::<BlockQ6K>(), nt, out) else {
        return;
    };
    if nt < Q6K_LANES_MIN.0 {
        x16_tiles(w, rb, nt, |group, r, pf, t0| {
            by_tile!(&acts[t0..], |xs| put_halves(
                gemv_x8(group, nb, xs, pf),
                r,
                nrows,
                out,
                (nt, t0)
            ))
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        [Packed8::zero(); 2],
        |group, i, p| unpack_x8(group, i, p),
        |p: &[[Packed8; 2]], r, t0| {
            by_tile!(&acts[t0..], |xs| {
                for half in 0..2 {
                    let v = gemm8_by::<Q6, _, _>(p, |u| &u[half], xs);
                    put_rows(v.map(|v| lanes8(v)), r + 8 * half, nrows, out, nt, t0);
                }
            })
        },
    );
}
