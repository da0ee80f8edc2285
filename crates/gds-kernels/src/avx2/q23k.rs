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

use super::*;

/// The two bits of each element of group `j` (elements `32 j .. 32 j + 32`) as bytes:
/// `qs[32 (j / 4) + l] >> 2 (j % 4)`, as the scalar kernels and ggml's layout read them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn low2(q: __m256i, g: usize) -> __m256i {
    let shifted = _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * g as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

/// Sixteen i16 lanes: `lo` in the first eight (the group's first sub-block, whose pairs of
/// products `maddubs` puts in the low 128 bits), `hi` in the last eight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
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
        let scales = q3k_scales(&b.scales);
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
                let sc = scale_pair(scales[2 * j] as i16, scales[2 * j + 1] as i16);
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
        let mins: [i16; 16] = std::array::from_fn(|s| (b.scales[s] >> 4) as i16);
        let mins = ld_i16x16(&mins);
        let mut isum = [zero; N];
        for half in 0..2 {
            let q = ld_u8x32(&b.qs[32 * half..]);
            for g in 0..4 {
                let j = 4 * half + g;
                let low = low2(q, g);
                let sc = scale_pair(
                    (b.scales[2 * j] & 0xF) as i16,
                    (b.scales[2 * j + 1] & 0xF) as i16,
                );
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
