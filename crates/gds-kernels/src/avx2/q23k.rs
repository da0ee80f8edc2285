//! Q2_K and Q3_K rows against 8-bit activations (`ActQ8K`). Decode (a few tokens): eight
//! rows in their stored layout side by side for up to four tokens, each row as ggml's
//! `vec_dot_q2_K_q8_K` / `vec_dot_q3_K_q8_K` on AVX2 — the quants of each 32-element group
//! unpacked to bytes once per block and multiplied with every token's activation bytes
//! (`maddubs`), each 16-element sub-block's scale applied in integers (`madd`) — and the
//! eight rows' partial sums folded by an `hadd` tree, so the block's float end runs in lanes.
//! Prompt batches ([`Q3K_LANES_MIN`], [`Q2K_LANES_MIN`] tokens and more): chunks of rows
//! repacked a row per 32-bit lane into `super::q6k`'s layout, eight rows a 256-bit vector or
//! sixteen a 512-bit one (`vpdpbusd` there). Either way the sums are the
//! scalar kernels' exact integers, scaled by the same float expression, so the results are
//! theirs bit for bit (and every instruction set's, at every batch size).
//!
//! Until these kernels (2026-12-06) Q2_K and Q3_K ran through f32: each row dequantized,
//! then the float kernel — Llama-3.2-1B's shape in Q3_K_M decoded at 1.3 t/s where
//! llama.cpp decoded at 33. A row at a time against four tokens left prompts at 0.45-0.72x
//! llama.cpp's; the repacked rows (later the same day) run them at 1.5-2.6x.

use super::q4k::{by_tile, group8, join, join_ps, lanes8, put_rows, transpose16, transpose8};
use super::q6k::{lanes_rows16, lanes_rows8, rows_word8, spread_words8, Packed16, Packed8, Q2, Q3};
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

/// One Q3_K row's block against `N` tokens' blocks `x`: the integer sum of the scaled
/// products, in eight partial lanes a token. The quants plus 4 (unsigned for `maddubs`)
/// against the activations, less 4 times each sub-block's scale times its activation sum
/// (ggml subtracts a second product of the high bits instead; the sum is the same integer).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sums_q3<const N: usize>(b: &BlockQ3K, x: &[&ActQ8K; N]) -> [__m256i; N] {
    let biased = q3k_scales_biased(&b.scales);
    let sc16 = _mm256_sub_epi16(
        _mm256_cvtepu8_epi16(ld_u8x16(&biased)),
        _mm256_set1_epi16(32),
    );
    let scs = scale_halves(sc16);
    let hm = ld_u8x32(&b.hmask);
    let zero = _mm256_setzero_si256();
    let mut isum = [zero; N];
    for t in 0..N {
        let off = _mm256_madd_epi16(ld_i16x16(&x[t].bsums), sc16);
        isum[t] = _mm256_sub_epi32(zero, _mm256_slli_epi32::<2>(off));
    }
    for half in 0..2 {
        let q = ld_u8x32(&b.qs[32 * half..]);
        for g in 0..4 {
            let j = 4 * half + g;
            let u = _mm256_or_si256(low2(q, g), high4(hm, j));
            let sc = scale_pair(&scs, j);
            for t in 0..N {
                let a = ld_i8x32(&x[t].qs[32 * j..]);
                let p = _mm256_maddubs_epi16(u, a);
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
            }
        }
    }
    isum
}

/// One Q2_K row's block against `N` tokens' blocks `x`: the integer sums of the scaled
/// products and of the mins times the activation sums, in eight partial lanes a token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sums_q2<const N: usize>(b: &BlockQ2K, x: &[&ActQ8K; N]) -> ([__m256i; N], [__m256i; N]) {
    let packed = _mm256_cvtepu8_epi16(ld_u8x16(&b.scales));
    let mins = _mm256_srli_epi16::<4>(packed);
    let scs = scale_halves(_mm256_and_si256(packed, _mm256_set1_epi16(0xF)));
    let mut isum = [_mm256_setzero_si256(); N];
    for half in 0..2 {
        let q = ld_u8x32(&b.qs[32 * half..]);
        for g in 0..4 {
            let j = 4 * half + g;
            let low = low2(q, g);
            let sc = scale_pair(&scs, j);
            for t in 0..N {
                let a = ld_i8x32(&x[t].qs[32 * j..]);
                let p = _mm256_maddubs_epi16(low, a);
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
            }
        }
    }
    let mut msum = [_mm256_setzero_si256(); N];
    for t in 0..N {
        msum[t] = _mm256_madd_epi16(ld_i16x16(&x[t].bsums), mins);
    }
    (isum, msum)
}

/// Rows `2p`, `2p + 1` of eight partial-lane sums pairwise added:
/// `[r(0-1) r(2-3) r'(0-1) r'(2-3) | r(4-5) r(6-7) r'(4-5) r'(6-7)]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair<const N: usize>(u0: [__m256i; N], u1: [__m256i; N]) -> [__m256i; N] {
    let mut w = u0;
    for t in 0..N {
        w[t] = _mm256_hadd_epi32(u0[t], u1[t]);
    }
    w
}

/// Rows 0..4 ([`pair`]s `w0`, `w1`) and 4..8 (`w2`, `w3`) folded: lane `r` the sum of row
/// `r`'s eight partial lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold(w0: __m256i, w1: __m256i, w2: __m256i, w3: __m256i) -> __m256i {
    // [r0(0-3) r1(0-3) r2(0-3) r3(0-3) | r0(4-7) ...]
    let lo = _mm256_hadd_epi32(w0, w1);
    let hi = _mm256_hadd_epi32(w2, w3);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(lo, hi),
        _mm256_permute2x128_si256::<0x31>(lo, hi),
    )
}

/// Eight Q3_K rows in their stored layout against `N` tokens: each token's eight results, row
/// `r` in lane `r` — the rows' integer sums ([`sums_q3`]) folded by an `hadd` tree, then the
/// scalar kernel's float expression in lanes. `pf` (the rows ahead) is prefetched a few
/// lines a block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8_q3<const N: usize>(rows: &[&[BlockQ3K]; 8], a: &[&[ActQ8K]; N], pf: &[u8]) -> [__m256; N] {
    let nb = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == nb) && a.iter().all(|x| x.len() >= nb));
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let x: [&ActQ8K; N] = std::array::from_fn(|t| &a[t][i]);
        let p = |k: usize| {
            pair(
                sums_q3(&rows[2 * k][i], &x),
                sums_q3(&rows[2 * k + 1][i], &x),
            )
        };
        let (w0, w1) = (p(0), p(1));
        let (w2, w3) = (p(2), p(3));
        let d = f16s8(rows, i, |b| b.d);
        for t in 0..N {
            let it = fold(w0[t], w1[t], w2[t], w3[t]);
            let dx = _mm256_set1_ps(x[t].d);
            let v = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(it));
            acc[t] = _mm256_add_ps(acc[t], v);
        }
    }
    acc
}

/// [`rows8_q3`] for Q2_K: two sums folded, the scaled products and the mins.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8_q2<const N: usize>(rows: &[&[BlockQ2K]; 8], a: &[&[ActQ8K]; N], pf: &[u8]) -> [__m256; N] {
    let nb = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == nb) && a.iter().all(|x| x.len() >= nb));
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        let x: [&ActQ8K; N] = std::array::from_fn(|t| &a[t][i]);
        let p = |k: usize| {
            let ((i0, m0), (i1, m1)) = (
                sums_q2(&rows[2 * k][i], &x),
                sums_q2(&rows[2 * k + 1][i], &x),
            );
            (pair(i0, i1), pair(m0, m1))
        };
        let ((w0, v0), (w1, v1)) = (p(0), p(1));
        let ((w2, v2), (w3, v3)) = (p(2), p(3));
        let (d, dmin) = (f16s8(rows, i, |b| b.d), f16s8(rows, i, |b| b.dmin));
        for t in 0..N {
            let it = fold(w0[t], w1[t], w2[t], w3[t]);
            let mt = fold(v0[t], v1[t], v2[t], v3[t]);
            let dx = _mm256_set1_ps(x[t].d);
            let v = _mm256_sub_ps(
                _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(it)),
                _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mt)),
            );
            acc[t] = _mm256_add_ps(acc[t], v);
        }
    }
    acc
}

/// Generates the decode kernel `$name` (fewer tokens than the repacking pays for): every
/// eight rows in their stored layout through `$rows8` for each tile of up to four tokens.
macro_rules! decode_rows {
    ($name:ident, $rows8:ident, $blk:ty) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $name(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
            let nt = acts.len();
            if nt == 0 || w.len() < rb {
                return;
            }
            let nrows = w.len() / rb;
            let mut t0 = 0;
            while t0 < nt {
                by_tile!(&acts[t0..], |xs| {
                    for r in (0..nrows).step_by(8) {
                        let pf = ahead(w, r * rb, 8 * rb);
                        let acc = $rows8(&group8::<$blk>(w, rb, r, nrows), &xs, pf);
                        put_rows(acc.map(|v| lanes8(v)), r, nrows, out, nt, t0);
                    }
                });
                t0 += (nt - t0).min(4);
            }
        }
    };
}

decode_rows!(decode_q3_k, rows8_q3, BlockQ3K);
decode_rows!(decode_q2_k, rows8_q2, BlockQ2K);

// ---------------------------------------------------------------------------------------
// Prompt batches: chunks of rows repacked eight (AVX2) or sixteen (AVX-512) at a time, a row
// per 32-bit lane, into `super::q6k`'s layout (both types have sixteen 16-element
// sub-blocks), and every tile of tokens against them. The quants are stored unsigned — Q3_K's
// plus 4, its offset then taken once per block from the activation sums; Q2_K's times their
// sub-block's scale — and each block ends in its row kernel's float expression, so a row's
// result is the same bits on every path. The raw bytes are transposed first (a row per lane)
// and the bits taken apart afterwards, one vector serving eight or sixteen rows.

/// 32 bytes of each of eight rows (`piece(r)`), transposed: `[c]` holds bytes `4c..4c + 4`
/// of every row, row `r` in 32-bit lane `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn raw8(piece: impl Fn(usize) -> __m256i) -> [__m256i; 8] {
    transpose8(std::array::from_fn(piece))
}

/// [`raw8`] of rows 0..8 (`lo`) and 8..16 (`hi`), joined: row `r` in lane `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn raw16(lo: impl Fn(usize) -> __m256i, hi: impl Fn(usize) -> __m256i) -> [__m512i; 8] {
    transpose16(std::array::from_fn(lo), std::array::from_fn(hi))
}

/// Bit `j` of each byte of `hm` as 4 (a Q3_K quant's high bit: set means no `-4`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high4(hm: __m256i, j: usize) -> __m256i {
    let v = if j >= 2 {
        _mm256_srl_epi16(hm, _mm_cvtsi32_si128(j as i32 - 2))
    } else {
        _mm256_sll_epi16(hm, _mm_cvtsi32_si128(2 - j as i32))
    };
    _mm256_and_si256(v, _mm256_set1_epi8(4))
}

/// [`low2`] on sixteen rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn low2x16(q: __m512i, g: usize) -> __m512i {
    let shifted = _mm512_srl_epi16(q, _mm_cvtsi32_si128(2 * g as i32));
    _mm512_and_si512(shifted, _mm512_set1_epi8(3))
}

/// [`high4`] on sixteen rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn high4x16(hm: __m512i, j: usize) -> __m512i {
    let v = if j >= 2 {
        _mm512_srl_epi16(hm, _mm_cvtsi32_si128(j as i32 - 2))
    } else {
        _mm512_sll_epi16(hm, _mm_cvtsi32_si128(2 - j as i32))
    };
    _mm512_and_si512(v, _mm512_set1_epi8(4))
}

/// The sixteen scales of block `i` of eight Q3_K rows as `Packed8::sc` and `Packed8::scp`:
/// [`q3k_scales_biased`]'s word arithmetic on eight rows at once (row `r` in lane `r`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8_q3(rows: &[&[BlockQ3K]; 8], i: usize) -> ([__m256i; 16], [__m256i; 8]) {
    let w = |k: usize| rows_word8(|r| &rows[r][i].scales[..], k);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    let (k1, k2) = (
        _mm256_set1_epi32(0x0303_0303),
        _mm256_set1_epi32(0x0f0f_0f0f),
    );
    let hi = |t: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(t, k1));
    let words = [
        _mm256_or_si256(_mm256_and_si256(a0, k2), hi(tmp)),
        _mm256_or_si256(_mm256_and_si256(a1, k2), hi(_mm256_srli_epi32::<2>(tmp))),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32::<4>(a0), k2),
            hi(_mm256_srli_epi32::<4>(tmp)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32::<4>(a1), k2),
            hi(_mm256_srli_epi32::<6>(tmp)),
        ),
    ];
    let bias = _mm256_set1_epi8(32);
    spread_words8(words.map(|v| _mm256_sub_epi8(v, bias)))
}

/// The scales (low nibbles) and mins (high nibbles) of block `i` of eight Q2_K rows as
/// `Packed8::sc` and `Packed8::scp`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8_q2(rows: &[&[BlockQ2K]; 8], i: usize) -> ([__m256i; 16], [__m256i; 8]) {
    let words: [__m256i; 4] = std::array::from_fn(|k| rows_word8(|r| &rows[r][i].scales[..], k));
    let k4 = _mm256_set1_epi32(0x0f0f_0f0f);
    let sc = spread_words8(words.map(|w| _mm256_and_si256(w, k4))).0;
    let mins = spread_words8(words.map(|w| _mm256_and_si256(_mm256_srli_epi32::<4>(w), k4))).1;
    (sc, mins)
}

/// `d` (or `dmin`) of block `i` of eight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16s8<B>(rows: &[&[B]; 8], i: usize, f: impl Fn(&B) -> [u8; 2]) -> __m256 {
    f16x8(|r| i16::from_le_bytes(f(&rows[r][i])))
}

/// Repacks block `i` of eight Q3_K rows into `p`: quants plus 4 (the two low bits, and 4
/// where the high bit is set).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8_q3(rows: &[&[BlockQ3K]; 8], i: usize, p: &mut Packed8) {
    let hm = raw8(|r| ld_u8x32(&rows[r][i].hmask));
    for h in 0..2 {
        let qs = raw8(|r| ld_u8x32(&rows[r][i].qs[32 * h..]));
        for g in 0..4 {
            let j = 4 * h + g;
            for c in 0..8 {
                p.q[j][c] = _mm256_or_si256(low2(qs[c], g), high4(hm[c], j));
            }
        }
    }
    (p.sc, p.scp) = scales8_q3(rows, i);
    p.d = f16s8(rows, i, |b| b.d);
}

/// Repacks block `i` of eight Q2_K rows into `p`: each quant times its sub-block's scale
/// (0..46, so `maddubs` pairs and `vpdpbusd` stay exact; a 16-bit multiply gives both bytes
/// of a lane their products, each under 256) with the scales all 1, `scp` the mins.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8_q2(rows: &[&[BlockQ2K]; 8], i: usize, p: &mut Packed8) {
    let (sc, mins) = scales8_q2(rows, i);
    for h in 0..2 {
        let qs = raw8(|r| ld_u8x32(&rows[r][i].qs[32 * h..]));
        for g in 0..4 {
            let j = 4 * h + g;
            for c in 0..8 {
                p.q[j][c] = _mm256_mullo_epi16(low2(qs[c], g), sc[2 * j + c / 4]);
            }
        }
    }
    p.sc = [_mm256_set1_epi16(1); 16];
    p.scp = mins;
    p.d = f16s8(rows, i, |b| b.d);
    p.dmin = f16s8(rows, i, |b| b.dmin);
}

/// [`repack8_q3`] of sixteen rows (`lo`: lanes 0..8, `hi`: 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16_q3(lo: &[&[BlockQ3K]; 8], hi: &[&[BlockQ3K]; 8], i: usize, p: &mut Packed16) {
    let hm = raw16(|r| ld_u8x32(&lo[r][i].hmask), |r| ld_u8x32(&hi[r][i].hmask));
    for h in 0..2 {
        let qs = raw16(
            |r| ld_u8x32(&lo[r][i].qs[32 * h..]),
            |r| ld_u8x32(&hi[r][i].qs[32 * h..]),
        );
        for g in 0..4 {
            let j = 4 * h + g;
            for c in 0..8 {
                p.q[j][c] = _mm512_or_si512(low2x16(qs[c], g), high4x16(hm[c], j));
            }
        }
    }
    let ((asc, ascp), (bsc, bscp)) = (scales8_q3(lo, i), scales8_q3(hi, i));
    for (s, v) in p.sc.iter_mut().enumerate() {
        *v = join(asc[s], bsc[s]);
    }
    for (k, v) in p.scp.iter_mut().enumerate() {
        *v = join(ascp[k], bscp[k]);
    }
    p.d = join_ps(f16s8(lo, i, |b| b.d), f16s8(hi, i, |b| b.d));
}

/// [`repack8_q2`] of sixteen rows (`lo`: lanes 0..8, `hi`: 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16_q2(lo: &[&[BlockQ2K]; 8], hi: &[&[BlockQ2K]; 8], i: usize, p: &mut Packed16) {
    let ((asc, amin), (bsc, bmin)) = (scales8_q2(lo, i), scales8_q2(hi, i));
    for h in 0..2 {
        let qs = raw16(
            |r| ld_u8x32(&lo[r][i].qs[32 * h..]),
            |r| ld_u8x32(&hi[r][i].qs[32 * h..]),
        );
        for g in 0..4 {
            let j = 4 * h + g;
            let sc = [2 * j, 2 * j + 1].map(|s| join(asc[s], bsc[s]));
            for (c, (q, x)) in p.q[j].iter_mut().zip(qs).enumerate() {
                *q = _mm512_mullo_epi16(low2x16(x, g), sc[c / 4]);
            }
        }
    }
    p.sc = [_mm512_set1_epi16(1); 16];
    for (k, v) in p.scp.iter_mut().enumerate() {
        *v = join(amin[k], bmin[k]);
    }
    p.d = join_ps(f16s8(lo, i, |b| b.d), f16s8(hi, i, |b| b.d));
    p.dmin = join_ps(f16s8(lo, i, |b| b.dmin), f16s8(hi, i, |b| b.dmin));
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
    lanes_rows16::<BlockQ3K, Q3>(w, rb, acts, out, |lo, hi, i, p| repack16_q3(lo, hi, i, p));
}

/// Q2_K prompt batches on AVX-512: sixteen rows a vector.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_q2_k16(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    lanes_rows16::<BlockQ2K, Q2>(w, rb, acts, out, |lo, hi, i, p| repack16_q2(lo, hi, i, p));
}

/// Tokens from which Q3_K rows are repacked (AVX2, AVX-512); below, eight stored rows at a
/// time ([`rows8_q3`]). Where the times cross (2048 x 2048 x 4 matrices, 2 threads, `decode_bw
/// q3_k N` with the threshold at 99 and at 1, best of three, us; AMD EPYC Zen 4 VM, plain
/// AVX2 by `GDS_ISA=avx2`): AVX2 3 tokens 136 stored / 164 repacked, 4: 163 / 184, 5: 241 /
/// 215; AVX-512 3: 132 / 177, 4: 165 / 194, 5: 236 / 222. (Against the row-at-a-time kernel
/// these replaced, the repacked rows paid from 3 tokens.)
pub(super) const Q3K_LANES_MIN: (usize, usize) = (5, 5);

/// [`Q3K_LANES_MIN`] for Q2_K, measured the same way (its stored-row kernel, without high
/// bits, is faster): AVX2 8 tokens 274 stored / 329 repacked, 9: 326 / 302, 12: 406 / 333;
/// AVX-512 8: 266 / 274, 9: 323 / 302, 12: 407 / 351.
pub(super) const Q2K_LANES_MIN: (usize, usize) = (9, 9);

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
