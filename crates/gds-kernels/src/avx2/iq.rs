//! The grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against 8-bit
//! activations: for one token two rows at a time (`decode_pairs`; IQ2_S and IQ1_M a row at
//! a time, `IqBlock::PAIRS`), for two to four a row at a time against them (`rows_driver`'s
//! tiles), and for prompt batches chunks of rows repacked into Q6_K's rows-in-lanes layout
//! (`super::q6k`, block end `IQ`): each group's values plus 64 (2..=126, unsigned for
//! `maddubs`/`vpdpbusd`; the offset taken back from the activation sums), the sub-block
//! multipliers as its scales. Looking a group up costs more than multiplying it, so a
//! prompt batch that looks every group up once for all its tokens runs several times faster
//! (llama.cpp's "tiled" path unpacks its weights likewise).
//!
//! Each 32-weight group is looked up once per block and tile as two vectors (`iquant.rs`):
//! the magnitudes (four grid rows, `_mm256_set_epi64x`) and the sign carriers (a byte table
//! of the stored sign bits; IQ1's values `8 * grid + shift`: IQ1_S's made by one `sign` and
//! one `add` from its grid rows, IQ1_M's, a shift every eight elements, looked up whole in
//! `IQ1_VALUES`); every token then takes `maddubs(mag, sign(act, sgn))` and a `madd`
//! with the group's two sub-block multipliers. The block's integer sum is the scalar
//! kernel's exactly (no overflow: magnitudes ≤ 62, multipliers ≤ 31), and the float end is
//! its expression, so both give the same bits.

use super::q23k::f16s8;
use super::q4k::{join, join_ps, transpose16, transpose8};
use super::q6k::{lanes_rows16, lanes_rows8, spread_scales8, Packed16, Packed8, IQ};
use super::*;
use crate::iquant::IqBlock;

/// Byte `j` of a 32-bit word broadcast to every lane, to byte `8j..8j + 8` of a vector.
static SIGN_SPREAD: [u8; 32] = {
    let mut m = [0u8; 32];
    let mut j = 0;
    while j < 32 {
        // within each 128-bit half: bytes 0..4 of the half hold the word's bytes
        m[j] = (j / 8) as u8;
        j += 1;
    }
    m
};

/// Group `$g` of block `$b` (type `$B`) as vectors: magnitudes, sign carriers, and the
/// multipliers as 16-bit lanes (elements 0..16's in the low eight, 16..32's in the high
/// eight, as `maddubs` pairs them). A macro, expanded in the target-feature function that
/// uses it: as an `#[inline]` function one type's instance stayed a call in the decode loop
/// (IQ3_S), and `#[inline(always)]` cannot go with `#[target_feature]`.
macro_rules! group_vecs {
    ($B:ty, $b:expr, $g:expr) => {
        group_vecs!($B, $b, $g, false)
    };
    // `shifts_apart`: IQ1_S's values without their shift (`8 * grid`, magnitudes 8 and the
    // grid rows as signs), the caller adding the shifts' part from the activation sums
    ($B:ty, $b:expr, $g:expr, $shifts_apart:expr) => {
        'group: {
            let (b, g): (&$B, usize) = ($b, $g);
            let r = b.raw(g);
            let w =
                |x: [u64; 4]| _mm256_set_epi64x(x[3] as i64, x[2] as i64, x[1] as i64, x[0] as i64);
            let ls = _mm256_set_m128i(
                _mm_set1_epi16(r.ls[1] as i16),
                _mm_set1_epi16(r.ls[0] as i16),
            );
            if <$B as IqBlock>::EIGHTHS {
                // IQ1: `8 * grid + shift` of the grid rows (IQ1_S), or `sgn`, the values (IQ1_M)
                let v = match (b.grid_rows(g), $shifts_apart) {
                    // `8 * grid` as magnitudes 8 and the grid rows as signs (`sign` by a row's
                    // -1, 0, 1 is the product with it)
                    (Some((rows, _)), true) => break 'group (_mm256_set1_epi8(8), w(rows), ls),
                    (Some((rows, neg)), false) => _mm256_add_epi8(
                        _mm256_sign_epi8(_mm256_set1_epi8(8), w(rows)),
                        _mm256_set1_epi8(if neg { -1 } else { 1 }),
                    ),
                    (None, _) => w(r.sgn),
                };
                (_mm256_abs_epi8(v), v, ls)
            } else {
                let mag = match b.grid4(g) {
                    Some(g4) => {
                        let g4 = g4.map(|x| x as i32);
                        _mm256_setr_epi32(g4[0], g4[1], g4[2], g4[3], g4[4], g4[5], g4[6], g4[7])
                    }
                    None => w(r.mag),
                };
                let sgn = match b.sign_bits(g) {
                    // byte j of the word's byte j / 8 to byte j, its bit j % 8 tested: -1 where
                    // set, else 1
                    Some(bits) => {
                        let spread = _mm256_shuffle_epi8(
                            _mm256_set1_epi32(bits as i32),
                            ld_u8x32(&SIGN_SPREAD),
                        );
                        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                        _mm256_or_si256(
                            _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(1),
                        )
                    }
                    None => w(r.sgn),
                };
                (mag, sgn, ls)
            }
        }
    };
}

/// `LS_SPREAD[g]`: multipliers `2g` and `2g + 1` of sixteen bytes (broadcast to both
/// halves) to the low and high eight 16-bit lanes.
static LS_SPREAD: [[u8; 32]; 8] = {
    let mut m = [[0x80u8; 32]; 8];
    let mut g = 0;
    while g < 8 {
        let mut k = 0;
        while k < 8 {
            m[g][2 * k] = (2 * g) as u8;
            m[g][16 + 2 * k] = (2 * g + 1) as u8;
            k += 1;
        }
        g += 1;
    }
    m
};

/// The sixteen multipliers `2s + 1` of a block's eight nibble-scale bytes, in both halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn spread_nibbles(bytes: u64) -> __m256i {
    let v = _mm_cvtsi64_si128(bytes as i64);
    let m = _mm_set1_epi8(0xF);
    // byte 2g: the low nibble of byte g, 2g + 1 its high one
    let s = _mm_unpacklo_epi8(
        _mm_and_si128(v, m),
        _mm_and_si128(_mm_srli_epi16::<4>(v), m),
    );
    let ls = _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1));
    _mm256_broadcastsi128_si256(ls)
}

/// `WORD_SPREAD[g]`: 16-bit lane `(g % 2) * 4 + g / 2` of each half to all eight of it
/// (where [`spread_scale_words`] puts group `g`'s multipliers).
static WORD_SPREAD: [[u8; 32]; 8] = lane_spread([0, 4, 1, 5, 2, 6, 3, 7]);

/// Shuffles that put 16-bit lane `lanes[g]` of each half in all eight of it, for each `g`.
const fn lane_spread(lanes: [usize; 8]) -> [[u8; 32]; 8] {
    let mut m = [[0u8; 32]; 8];
    let mut g = 0;
    while g < 8 {
        let mut k = 0;
        while k < 32 {
            m[g][k] = (2 * lanes[g] + k % 2) as u8;
            k += 1;
        }
        g += 1;
    }
    m
}

/// IQ1_M's sixteen multipliers `2s + 1` from its four scale words, as 16-bit lanes: group
/// `g`'s of elements 0..16 at lane `(g % 2) * 4 + g / 2` of the low half, of 16..32 at the
/// same lane of the high half (llama.cpp's arrangement: one variable shift a 64-bit lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn spread_scale_words(words: u64) -> __m256i {
    let s = _mm256_srlv_epi64(
        _mm256_set1_epi64x(words as i64),
        _mm256_setr_epi64x(0, 6, 3, 9),
    );
    let s = _mm256_and_si256(s, _mm256_set1_epi16(7));
    _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1))
}

/// `QH_SPREAD[g]`: 16-bit lane `g` of each half to all eight of it (IQ1_S's multipliers,
/// one a group, from [`spread_qh_scales`]).
static QH_SPREAD: [[u8; 32]; 8] = lane_spread([0, 1, 2, 3, 4, 5, 6, 7]);

/// IQ1_S's eight multipliers `2s + 1` (`s`: its `qh` words' bits 12..14), group `g`'s at 16-bit
/// lane `g` of both halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn spread_qh_scales(qh: &[u8; 16]) -> __m256i {
    _mm256_broadcastsi128_si256(qh_multipliers(qh).1)
}

/// IQ1_S's `qh` words and their multipliers `2 * ((q >> 12) & 7) + 1`, a 16-bit lane a group.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn qh_multipliers(qh: &[u8; 16]) -> (__m128i, __m128i) {
    // SAFETY: 16 readable bytes; no alignment requirement.
    let q = unsafe { _mm_loadu_si128(qh.as_ptr().cast()) };
    let ls = _mm_or_si128(
        _mm_and_si128(_mm_srli_epi16::<11>(q), _mm_set1_epi16(0xE)),
        _mm_set1_epi16(1),
    );
    (q, ls)
}

/// IQ1_S's shifts as coefficients of the activations' 16-element sums: lanes `2g` and
/// `2g + 1` hold group `g`'s `ls * shift` (its multiplier, negative where the shift is), so
/// `madd(bsums, coefs)` is the shifts' part of a block's integer sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn shift_coefs(qh: &[u8; 16]) -> __m256i {
    // the multipliers, negated where bit 15 is set
    let (q, ls) = qh_multipliers(qh);
    let neg = _mm_srai_epi16::<15>(q);
    let c = _mm_sub_epi16(_mm_xor_si128(ls, neg), neg);
    _mm256_set_m128i(_mm_unpackhi_epi16(c, c), _mm_unpacklo_epi16(c, c))
}

/// [`group_vecs!`] as a function (the repacking and the tests).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn group_vecs<B: IqBlock>(b: &B, g: usize) -> (__m256i, __m256i, __m256i) {
    group_vecs!(B, b, g)
}

/// A block's sixteen multipliers spread once, and the per-group shuffles that put a group's
/// two in place, where the type's layout allows it (IQ2_XS/IQ2_S: 1.15-1.2x faster
/// kernels than making them a group at a time, IQ1_M 1.4x; IQ1_S: its one a group).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_multipliers<B: IqBlock>(b: &B) -> Option<(__m256i, &'static [[u8; 32]; 8])> {
    match (b.nibble_scales(), b.scale_words(), b.qh_words()) {
        (Some(n), _, _) => Some((spread_nibbles(n), &LS_SPREAD)),
        (None, Some(w), _) => Some((spread_scale_words(w), &WORD_SPREAD)),
        (None, None, Some(qh)) => Some((spread_qh_scales(qh), &QH_SPREAD)),
        (None, None, None) => None,
    }
}

/// Group `g`'s multipliers: from the block's ([`block_multipliers`]), or the group's own.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn multipliers(block: Option<(__m256i, &[[u8; 32]; 8])>, own: __m256i, g: usize) -> __m256i {
    match block {
        Some((v, spread)) => _mm256_shuffle_epi8(v, ld_u8x32(&spread[g])),
        None => own,
    }
}

/// A block's groups, as a decode loop's trip count (an opaque one keeps the loop rolled:
/// `IqBlock::ROLLED`).
#[inline(always)]
fn groups<B: IqBlock>() -> usize {
    if B::ROLLED {
        std::hint::black_box(QK_K / QK).min(QK_K / QK)
    } else {
        QK_K / QK
    }
}

/// A block's scale by `vcvtph2ps` (exact, as `IqBlock::d`, without its run-time dispatch on
/// every block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_scale<B: IqBlock>(b: &B) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
        u16::from_le_bytes(b.d_bits()) as i32,
    )))
}

/// One row's dot products with `N` tokens (`N` ≤ 4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq<B: IqBlock, const N: usize>(w: &[B], a: [&[ActQ8K]; N]) -> [f32; N] {
    let mut acc = [0f32; N];
    for (k, b) in w.iter().enumerate() {
        let mut s = [_mm256_setzero_si256(); N];
        let block_ls = block_multipliers(b);
        for g in 0..groups::<B>() {
            let (mag, sgn, ls) = group_vecs!(B, b, g, true);
            let ls = multipliers(block_ls, ls, g);
            for t in 0..N {
                let x = ld_i8x32(&a[t][k].qs[QK * g..]);
                let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, sgn));
                s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(p, ls));
            }
        }
        // IQ1_S: the shifts' part, left out of the groups above
        if let Some(qh) = b.qh_words() {
            let c = shift_coefs(qh);
            for t in 0..N {
                s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(ld_i16x16(&a[t][k].bsums), c));
            }
        }
        let d = f16_scale(b);
        for t in 0..N {
            acc[t] += d * a[t][k].d * hsum_epi32(s[t]) as f32;
        }
    }
    acc.map(|x| B::K * x)
}

/// Two rows' dot products with one token (decode): [`dot_iq`]'s arithmetic for both at once,
/// two independent chains and one horizontal sum for the two rows' blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_iq_pair<B: IqBlock>(w: [&[B]; 2], a: &[ActQ8K], pf: &[u8]) -> [f32; 2] {
    // lanes 0 and 1: the two rows' sums (the scalar kernel's `acc += d * ad * sum`, lane by
    // lane: the same bits)
    let mut acc = _mm_setzero_ps();
    let nb = w[0].len();
    for (k, (b0, b1)) in w[0].iter().zip(w[1]).enumerate() {
        prefetch_l2(pf, k, nb);
        let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        let (l0, l1) = (block_multipliers(b0), block_multipliers(b1));
        for g in 0..groups::<B>() {
            let x = ld_i8x32(&a[k].qs[QK * g..]);
            let (mag, sgn, ls) = group_vecs!(B, b0, g, true);
            let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, sgn));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p, multipliers(l0, ls, g)));
            let (mag, sgn, ls) = group_vecs!(B, b1, g, true);
            let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, sgn));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p, multipliers(l1, ls, g)));
        }
        if let (Some(q0), Some(q1)) = (b0.qh_words(), b1.qh_words()) {
            let bs = ld_i16x16(&a[k].bsums);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(bs, shift_coefs(q0)));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(bs, shift_coefs(q1)));
        }
        // [row 0's sum, row 1's sum, ...]: the same integers in another order
        let h = _mm256_hadd_epi32(s0, s1);
        let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let h = _mm_hadd_epi32(h, h);
        // both rows' f16 scales converted at once (exact, as the scalar conversion)
        let d = |b: &B| u16::from_le_bytes(b.d_bits()) as i32;
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128(d(b0) | d(b1) << 16));
        let dd = _mm_mul_ps(d, _mm_set1_ps(a[k].d));
        acc = _mm_add_ps(acc, _mm_mul_ps(dd, _mm_cvtepi32_ps(h)));
    }
    [_mm_cvtss_f32(acc), _mm_cvtss_f32(_mm_movehdup_ps(acc))].map(|x| B::K * x)
}

/// Decode (one token): rows two at a time through [`dot_iq_pair`], the rows ahead
/// prefetched into L2 as the other kernels' decode does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode_pairs<B: IqBlock>(w: &[u8], rb: usize, a: &[ActQ8K], out: &mut [f32]) {
    fn row<B: IqBlock>(r: &[u8]) -> &[B] {
        cast::<B>(r).expect("weight rows are whole blocks")
    }
    let mut pairs = w.chunks_exact(2 * rb);
    let mut outs = out.chunks_exact_mut(2);
    for (i, (p, o)) in (&mut pairs).zip(&mut outs).enumerate() {
        let (r0, r1) = p.split_at(rb);
        // the rows ahead, a few lines a block (without it a pair's second row, a stream
        // the hardware prefetcher had to find again every pair, missed: 13 % of IQ2_XS's
        // decode samples on Zen 3 sat on its first load)
        let pf = ahead(w, 2 * i * rb, 2 * rb);
        o.copy_from_slice(&dot_iq_pair::<B>([row(r0), row(r1)], a, pf));
    }
    if let (Some(o), r) = (outs.into_remainder().first_mut(), pairs.remainder()) {
        if !r.is_empty() {
            *o = dot_iq::<B, 1>(row(r), [a])[0];
        }
    }
}

/// Group `g` of `b`'s values plus 64, as `maddubs` takes them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn biased<B: IqBlock>(b: &B, g: usize) -> __m256i {
    let (mag, sgn, _) = group_vecs(b, g);
    _mm256_add_epi8(_mm256_sign_epi8(mag, sgn), _mm256_set1_epi8(64))
}

/// The sixteen sub-block multipliers of block `i` of eight rows, and their scales.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8<B: IqBlock>(rows: &[&[B]; 8], i: usize) -> (([__m256i; 16], [__m256i; 8]), __m256) {
    let ls: [[u8; 16]; 8] = std::array::from_fn(|r| {
        std::array::from_fn(|s| (2 * rows[r][i].raw_scales(s / 2)[s % 2] + 1) as u8)
    });
    (spread_scales8(&ls), f16s8(rows, i, |b| b.d_bits()))
}

/// Repacks block `i` of eight rows into `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8<B: IqBlock>(rows: &[&[B]; 8], i: usize, p: &mut Packed8) {
    for j in 0..QK_K / QK {
        p.q[j] = transpose8(std::array::from_fn(|r| biased(&rows[r][i], j)));
    }
    ((p.sc, p.scp), p.d) = scales8(rows, i);
}

/// Repacks block `i` of sixteen rows (`lo`: lanes 0..8, `hi`: 8..16) into `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16<B: IqBlock>(lo: &[&[B]; 8], hi: &[&[B]; 8], i: usize, p: &mut Packed16) {
    for j in 0..QK_K / QK {
        p.q[j] = transpose16(
            std::array::from_fn(|r| biased(&lo[r][i], j)),
            std::array::from_fn(|r| biased(&hi[r][i], j)),
        );
    }
    let (((asc, ascp), ad), ((bsc, bscp), bd)) = (scales8(lo, i), scales8(hi, i));
    p.sc = std::array::from_fn(|s| join(asc[s], bsc[s]));
    p.scp = std::array::from_fn(|k| join(ascp[k], bscp[k]));
    p.d = join_ps(ad, bd);
}

/// `out *= B::K`: the type's constant factor, applied to a row's sum as the row kernel does.
#[inline]
fn times_k<B: IqBlock>(out: &mut [f32]) {
    for v in out {
        *v *= B::K;
    }
}

/// Prompt batches on plain AVX2: eight rows a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn gemm8<B: IqBlock>(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows8::<B, IQ>(w, rb, acts, out, |rows, i, p| repack8(rows, i, p));
    times_k::<B>(out);
}

/// Prompt batches on AVX-512: sixteen rows a vector (`vpdpbusd`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm16<B: IqBlock>(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows16::<B, IQ>(w, rb, acts, out, |lo, hi, i, p| repack16(lo, hi, i, p));
    times_k::<B>(out);
}

/// Tokens from which rows of `B` are repacked; below, a row at a time. Where the times
/// cross (2048 x 2048 x 4 matrices, 2 threads, `decode_bw TYPE N` built with the threshold at
/// 1 and at 99, us; AMD EPYC Zen 4 VM): AVX-512 IQ2_XXS 4 tokens 295 repacked / 261 a row at
/// a time, 5: 317 / 425, 64: 1284 / 4229; IQ3_XXS 4: 528 / 318, 5: 555 / 570, 16: 681 / 1507;
/// IQ1_M (IQ1's values cost more to look up) 2: 356 / 363, 3: 359 / 420; plain AVX2
/// (`GDS_ISA=avx2`) IQ2_XXS 5: 548 / 619, 8: 462 / 781.
#[inline(always)]
pub(super) fn lanes_min<B: IqBlock>() -> usize {
    if B::EIGHTHS {
        3
    } else {
        5
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `group_vecs` and the scalar `IqBlock::raw` agree on every byte of every group.
    #[test]
    fn vectors_equal_the_scalar_groups() {
        let Some(_) = Avx2::detect() else { return };
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut bytes = vec![0u8; 110 * 64];
        for b in bytes.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *b = state as u8;
        }
        fn check<B: IqBlock>(bytes: &[u8]) {
            let n = bytes.len() / size_of::<B>();
            let blocks = cast::<B>(&bytes[..n * size_of::<B>()]).unwrap();
            for b in blocks {
                for g in 0..8 {
                    let want = b.raw(g);
                    // SAFETY: AVX2, FMA and F16C were detected above.
                    let (m, s, l) = unsafe { group_vecs(b, g) };
                    let (mut mb, mut sb, mut lb) = ([0u8; 32], [0u8; 32], [0i16; 16]);
                    // SAFETY: 32-byte buffers, unaligned stores.
                    unsafe {
                        _mm256_storeu_si256(mb.as_mut_ptr().cast(), m);
                        _mm256_storeu_si256(sb.as_mut_ptr().cast(), s);
                        _mm256_storeu_si256(lb.as_mut_ptr().cast(), l);
                    }
                    for j in 0..32 {
                        let v = mb[j] as i32 * (sb[j] as i8).signum() as i32;
                        assert_eq!(v, want.v(j), "group {g} element {j}");
                    }
                    assert!(lb[..8].iter().all(|&x| x as i32 == want.ls[0]));
                    assert!(lb[8..].iter().all(|&x| x as i32 == want.ls[1]));
                }
            }
        }
        check::<BlockIq2Xxs>(&bytes);
        check::<BlockIq2Xs>(&bytes);
        check::<BlockIq2S>(&bytes);
        check::<BlockIq3Xxs>(&bytes);
        check::<BlockIq3S>(&bytes);
        check::<BlockIq1S>(&bytes);
        check::<BlockIq1M>(&bytes);
    }
}
