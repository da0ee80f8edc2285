//! IQ4_XS (llama.cpp's non-linear 4-bit type in 256-value super-blocks) against 8-bit
//! activations, a row at a time: each pair of 32-value sub-blocks is one 32-byte vector of
//! nibbles, looked up into `KVALUES_IQ4NL` by two byte shuffles (elements 0..16 of both
//! sub-blocks, then 16..32: the layout of an [`ActQ8`] pair), multiplied with the activations
//! by `maddubs` on the values' magnitudes with the activations signed by the values (|value| ≤
//! 127, so a pair of products never saturates 16 bits), widened by `madd` per 128-bit half
//! (the lanes of a sub-block), and the pair's two scales folded in with one FMA per token. A
//! pair is unpacked once for up to four tokens, each in a register accumulator of its own, so
//! a token's result does not depend on its batch. The sub-block scales `d * (ls - 32)` are f32
//! (an f16 times a 6-bit integer needs up to 17 significant bits), as gguf-py computes them,
//! made once a block. (IQ4_NL, whose scale is a block's f16, runs on the Q8_0 kernels of `q80`
//! instead: rows side by side for decode, in the vector lanes for prompts.)

use super::*;
use zerocopy::FromBytes;

/// Token tile: a pair unpacked once for up to this many tokens, each in its own register
/// accumulator (a tile's width is a constant of its instance, so nothing spills).
const TILE: usize = 4;

/// One pair of sub-blocks (`v`: their 32 nibble bytes, elements 0..16 of both in the low
/// nibbles; `dw`: the first's scale in lanes 0..4, the second's in 4..8) against pair `p` of
/// each of the `N` tokens' activations, into `acc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_step<const N: usize>(
    v: __m256i,
    dw: __m256,
    xs: &[&[ActQ8]],
    p: usize,
    acc: &mut [__m256; N],
) {
    let lut = _mm256_broadcastsi128_si256(ld_i8x16(&KVALUES_IQ4NL));
    let m4 = _mm256_set1_epi8(0x0F);
    let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
    let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4));
    let (alo, ahi) = (_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(hi, hi));
    let ones = _mm256_set1_epi16(1);
    for (j, a) in acc.iter_mut().enumerate() {
        let x = &xs[j][p];
        let plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(ld_i8x32(&x.lo), lo));
        let phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(ld_i8x32(&x.hi), hi));
        let i = _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones));
        *a = _mm256_fmadd_ps(
            _mm256_mul_ps(dw, ld_f32x8(&x.d8)),
            _mm256_cvtepi32_ps(i),
            *a,
        );
    }
}

/// The eight sub-block scales `d * (ls - 32)` of an IQ4_XS block (lane `i`: sub-block `i`),
/// each the f32 product gguf-py computes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_scales(b: &BlockIq4Xs) -> __m256 {
    let l = _mm256_set1_epi32(i32::from_le_bytes(b.scales_l));
    let lo = _mm256_and_si256(
        _mm256_srlv_epi32(l, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(0xF),
    );
    let h = _mm256_set1_epi32(u16::from_le_bytes(b.scales_h) as i32);
    let hi = _mm256_and_si256(
        _mm256_srlv_epi32(h, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3),
    );
    let ls = _mm256_sub_epi32(
        _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi)),
        _mm256_set1_epi32(32),
    );
    _mm256_mul_ps(_mm256_set1_ps(b.d()), _mm256_cvtepi32_ps(ls))
}

/// `N` tokens' dot products with one IQ4_XS row: per block its eight scales once, then its
/// four pairs of sub-blocks (32 nibble bytes each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_xs<const N: usize>(row: &[BlockIq4Xs], xs: &[&[ActQ8]], out: &mut [f32]) {
    let mut acc = [_mm256_setzero_ps(); N];
    for (k, b) in row.iter().enumerate() {
        let sc = xs_scales(b);
        for q in 0..4 {
            let idx = _mm256_setr_epi32(
                2 * q as i32,
                2 * q as i32,
                2 * q as i32,
                2 * q as i32,
                2 * q as i32 + 1,
                2 * q as i32 + 1,
                2 * q as i32 + 1,
                2 * q as i32 + 1,
            );
            let dw = _mm256_permutevar8x32_ps(sc, idx);
            pair_step::<N>(ld_u8x32(&b.qs[32 * q..]), dw, xs, 4 * k + q, &mut acc);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = hsum_ps(a);
    }
}

/// IQ4_XS rows: `out[r * acts.len() + t]` = row `r` of `w` (`rb` bytes a row) · token `t`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_xs(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    each_tile(w, rb, acts, out, |row, xs, o| {
        let row = <[BlockIq4Xs]>::ref_from_bytes(row).expect("whole blocks a row");
        // (the closure has this function's target features: the tiles' calls are safe)
        match xs.len() {
            4 => tile_xs::<4>(row, xs, o),
            3 => tile_xs::<3>(row, xs, o),
            2 => tile_xs::<2>(row, xs, o),
            _ => tile_xs::<1>(row, xs, o),
        }
    })
}

/// Runs `tile(row bytes, up to TILE tokens' activations, their outputs)` over every row of
/// `w` and every tile of tokens.
#[inline(always)]
fn each_tile(
    w: &[u8],
    rb: usize,
    acts: &[&[ActQ8]],
    out: &mut [f32],
    mut tile: impl FnMut(&[u8], &[&[ActQ8]], &mut [f32]),
) {
    let nt = acts.len();
    if nt == 0 || rb == 0 {
        return;
    }
    for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(nt)) {
        for t0 in (0..nt).step_by(TILE) {
            let tn = (nt - t0).min(TILE);
            tile(row, &acts[t0..t0 + tn], &mut o[t0..t0 + tn]);
        }
    }
}
