//! Q2_K and Q3_K rows against 8-bit activations (`ActQ8K`), a row at a time for up to four
//! tokens, as ggml's `vec_dot_q2_K_q8_K` / `vec_dot_q3_K_q8_K` on AVX2: the quants of each
//! 32-element group unpacked to bytes once per block and multiplied with every token's
//! activation bytes (`maddubs`), each 16-element sub-block's scale applied in integers
//! (`madd`). The sums are the scalar kernels' exact integers, scaled by the same float
//! expression, so the results are theirs bit for bit (and every instruction set's).
//!
//! Until these kernels (2026-12-06) Q2_K and Q3_K ran through f32: each row dequantized,
//! then the float kernel — Llama-3.2-1B's shape in Q3_K_M decoded at 1.3 t/s where
//! llama.cpp decoded at 33.

use super::q4k::transpose8;
use super::q6k::{lanes_rows16, lanes_rows8, spread_scales8, Packed16, Packed8, Q2, Q3};
use super::*;

/// The two bits of each element of group `j` (elements `32 j .. 32 j + 32`) as bytes:
/// `qs[32 (j / 4) + l] >> 2 (j % 4)`, as the scalar kernels and ggml's layout read them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn low2(q: __m256i, g: usize) -> __m256i {
    let shifted = _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * g as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

/// The sixteen 6-bit scales of a Q3_K block as bytes 0..64 (the signed scale plus 32), by
/// ggml's word arithmetic (`kmask1`, `kmask2`); [`q3k_scales`] is the reference.
#[inline(always)]
fn q3k_scales_biased(s: &[u8; 12]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let words = [
        (a0 & k2) | ((tmp & k1) << 4),
        (a1 & k2) | (((tmp >> 2) & k1) << 4),
        ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
        ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// The sixteen i16 scales of a block (one per 16-element sub-block) with each 128-bit half
/// holding the same eight: `[0]` scales 0..8, `[1]` 8..16 (`pshufb` works within halves).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_halves(s: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute2x128_si256::<0x00>(s, s),
        _mm256_permute2x128_si256::<0x11>(s, s),
    ]
}

/// What `madd` needs for group `j` (elements `32 j .. 32 j + 32`): sub-block `2 j`'s scale in
/// the low eight lanes and `2 j + 1`'s in the high eight (the halves `maddubs` gives the
/// group's two sub-blocks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(halves: &[__m256i; 2], j: usize) -> __m256i {
    // the byte pair of scale `2 (j % 4)` eight times in the low half, of the next in the high
    let pair = |i: i16| (2 * i) | ((2 * i + 1) << 8);
    let k = 2 * (j % 4) as i16;
    let m = _mm256_set_m128i(_mm_set1_epi16(pair(k + 1)), _mm_set1_epi16(pair(k)));
    _mm256_shuffle_epi8(halves[j / 4], m)
}

/// Q3_K rows for `N` tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q3_k<const N: usize>(w: &[BlockQ3K], x: [&[ActQ8K]; N]) -> [f32; N] {
    for t in &x {
        assert!(t.len() >= w.len());
    }
    let zero = _mm256_setzero_si256();
    let four = _mm256_set1_epi8(4);
    let mut acc = [0f32; N];
    for (k, b) in w.iter().enumerate() {
        let biased = q3k_scales_biased(&b.scales);
        let sc16 = _mm256_sub_epi16(
            _mm256_cvtepu8_epi16(ld_u8x16(&biased)),
            _mm256_set1_epi16(32),
        );
        let scs = scale_halves(sc16);
        let hm = ld_u8x32(&b.hmask);
        let mut isum = [zero; N];
        for half in 0..2 {
            let q = ld_u8x32(&b.qs[32 * half..]);
            for g in 0..4 {
                let j = 4 * half + g;
                let low = low2(q, g);
                // 4 where the element's high bit is clear (its value is `low - 4`)
                let bit = _mm256_set1_epi8((1u8 << j) as i8);
                let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), zero);
                let minus = _mm256_and_si256(clear, four);
                let sc = scale_pair(&scs, j);
                for t in 0..N {
                    let a = ld_i8x32(&x[t][k].qs[32 * j..]);
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(low, a),
                        _mm256_maddubs_epi16(minus, a),
                    );
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
                }
            }
        }
        for t in 0..N {
            acc[t] += b.d() * x[t][k].d * hsum_epi32(isum[t]) as f32;
        }
    }
    acc
}

/// Q2_K rows for `N` tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2_k<const N: usize>(w: &[BlockQ2K], x: [&[ActQ8K]; N]) -> [f32; N] {
    for t in &x {
        assert!(t.len() >= w.len());
    }
    let zero = _mm256_setzero_si256();
    let mut acc = [0f32; N];
    for (k, b) in w.iter().enumerate() {
        let packed = _mm256_cvtepu8_epi16(ld_u8x16(&b.scales));
        let mins = _mm256_srli_epi16::<4>(packed);
        let scs = scale_halves(_mm256_and_si256(packed, _mm256_set1_epi16(0xF)));
        let mut isum = [zero; N];
        for half in 0..2 {
            let q = ld_u8x32(&b.qs[32 * half..]);
            for g in 0..4 {
                let j = 4 * half + g;
                let low = low2(q, g);
                let sc = scale_pair(&scs, j);
                for t in 0..N {
                    let a = ld_i8x32(&x[t][k].qs[32 * j..]);
                    let p = _mm256_maddubs_epi16(low, a);
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
                }
            }
        }
        for t in 0..N {
            let xk = &x[t][k];
            let msum = hsum_epi32(_mm256_madd_epi16(ld_i16x16(&xk.bsums), mins));
            acc[t] += b.d() * xk.d * hsum_epi32(isum[t]) as f32 - b.dmin() * xk.d * msum as f32;
        }
    }
    acc
}

// ---------------------------------------------------------------------------------------
// Prompt batches: chunks of rows repacked eight (AVX2) or sixteen (AVX-512) at a time, a row
// per 32-bit lane, into `super::q6k`'s layout (both types have sixteen 16-element
// sub-blocks), and every tile of tokens against them. The quants are stored unsigned — Q3_K's
// plus 4, its offset then taken once per block from the activation sums — and each block
// ends in its row kernel's float expression, so a row's result is the same bits on every path.

/// The 32 quants of each group `4 half + g` of a Q3_K block, plus 4 (0..8), as bytes: the
/// two low bits, and 4 where the high bit is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q3_groups(b: &BlockQ3K, half: usize) -> [__m256i; 4] {
    let q = ld_u8x32(&b.qs[32 * half..]);
    let hm = ld_u8x32(&b.hmask);
    let four = _mm256_set1_epi8(4);
    let mut out = [_mm256_setzero_si256(); 4];
    for (g, o) in out.iter_mut().enumerate() {
        let bit = _mm256_set1_epi8((1u8 << (4 * half + g)) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        *o = _mm256_or_si256(low2(q, g), _mm256_and_si256(set, four));
    }
    out
}

/// The 32 quants (0..4) of each group `j = 4 half + g` of a Q2_K block times their
/// sub-block's 4-bit scale (`2j` for the first sixteen, `2j + 1` for the rest), as bytes: a
/// table `[0, s, 2s, 3s]` per 128-bit half looked up by the quant.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2_scaled(b: &BlockQ2K, half: usize) -> [__m256i; 4] {
    let q = ld_u8x32(&b.qs[32 * half..]);
    let table = |s: u8| {
        let s = s & 0xF;
        i32::from_le_bytes([0, s, 2 * s, 3 * s])
    };
    let mut out = [_mm256_setzero_si256(); 4];
    for (g, o) in out.iter_mut().enumerate() {
        let j = 4 * half + g;
        let t = _mm256_setr_m128i(
            _mm_set1_epi32(table(b.scales[2 * j])),
            _mm_set1_epi32(table(b.scales[2 * j + 1])),
        );
        *o = _mm256_shuffle_epi8(t, low2(q, g));
    }
    out
}

/// `Packed8::q` of eight rows from each row's groups (`groups(row, half)`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transposed(groups: impl Fn(usize, usize) -> [__m256i; 4], p: &mut Packed8) {
    for h in 0..2 {
        let v: [[__m256i; 4]; 8] = std::array::from_fn(|r| groups(r, h));
        for (c, q) in p.q[4 * h..4 * h + 4].iter_mut().enumerate() {
            *q = transpose8(std::array::from_fn(|r| v[r][c]));
        }
    }
}

/// Repacks block `i` of eight Q3_K rows into `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8_q3(rows: &[&[BlockQ3K]; 8], i: usize, p: &mut Packed8) {
    transposed(|r, h| q3_groups(&rows[r][i], h), p);
    let s =
        std::array::from_fn(|r| q3k_scales_biased(&rows[r][i].scales).map(|v| v.wrapping_sub(32)));
    (p.sc, p.scp) = spread_scales8(&s);
    p.d = f16x8(|r| i16::from_le_bytes(rows[r][i].d));
}

/// Repacks block `i` of eight Q2_K rows into `p`: each quant times its sub-block's scale
/// (0..46, so `maddubs` pairs and `vpdpbusd` stay exact) with the scales all 1, `scp` the mins.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8_q2(rows: &[&[BlockQ2K]; 8], i: usize, p: &mut Packed8) {
    transposed(|r, h| q2_scaled(&rows[r][i], h), p);
    p.sc = [_mm256_set1_epi16(1); 16];
    p.scp = spread_scales8(&std::array::from_fn(|r| rows[r][i].scales.map(|v| v >> 4))).1;
    p.d = f16x8(|r| i16::from_le_bytes(rows[r][i].d));
    p.dmin = f16x8(|r| i16::from_le_bytes(rows[r][i].dmin));
}

/// Q3_K prompt batches on plain AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn gemm_q3_k8(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows8::<BlockQ3K, Q3>(w, rb, acts, out, |rows, i, p| repack8_q3(rows, i, p));
}

/// Q2_K prompt batches on plain AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn gemm_q2_k8(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows8::<BlockQ2K, Q2>(w, rb, acts, out, |rows, i, p| repack8_q2(rows, i, p));
}

/// Q3_K prompt batches on AVX-512: sixteen rows a vector.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_q3_k16(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    let mut half = [Packed8::zero(); 2];
    lanes_rows16::<BlockQ3K, Q3>(w, rb, acts, out, |lo, hi, i, p| {
        repack8_q3(lo, i, &mut half[0]);
        repack8_q3(hi, i, &mut half[1]);
        Packed16::join(&half[0], &half[1], p);
    });
}

/// Q2_K prompt batches on AVX-512: sixteen rows a vector.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_q2_k16(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    let mut half = [Packed8::zero(); 2];
    lanes_rows16::<BlockQ2K, Q2>(w, rb, acts, out, |lo, hi, i, p| {
        repack8_q2(lo, i, &mut half[0]);
        repack8_q2(hi, i, &mut half[1]);
        Packed16::join(&half[0], &half[1], p);
    });
}

/// Tokens from which Q2_K and Q3_K rows are repacked (AVX2, AVX-512); below, the row kernels.
pub(super) const Q23K_LANES_MIN: (usize, usize) = (5, 5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q3k_scales_by_words_equal_the_reference() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let mut s = [0u8; 12];
            for b in &mut s {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            let want = q3k_scales(&s);
            let got = q3k_scales_biased(&s).map(|v| v as i8 - 32);
            assert_eq!(got, want, "{s:?}");
        }
    }
}
