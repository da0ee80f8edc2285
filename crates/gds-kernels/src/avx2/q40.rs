//! Q4_0 prompt batches with a row per 32-bit vector lane: a chunk of rows repacked once (four
//! quants of a row per lane, eight rows a 256-bit vector or sixteen a 512-bit one), every tile
//! of tokens against it with the activations broadcast, so no horizontal sums.
//!
//! Bit for bit the arithmetic of the four-row decode kernel (`quad`): per row and block, the
//! integer `sum(q * x) - 8 * sum(x)`, then `acc = fma(d * dx, i, acc)` into an accumulator of
//! the even blocks or of the odd ones, the two added at the end.

use super::q4k::{
    bcast4, bcast4x16, by_tile, chunked, group8, join_ps, lanes16, lanes8, put_halves, put_rows,
    transpose16, x16_chunked, x16_shape, x16_tiles,
};
use super::*;
use crate::interleave::GROUP;

/// Bytes of one block of sixteen interleaved Q4_0 rows.
const GROUP_BLOCK: usize = GROUP * std::mem::size_of::<BlockQ4_0>();

/// Eight rows of one Q4_0 block, row `r` in 32-bit lane `r`.
#[derive(Clone, Copy)]
pub(super) struct Packed8 {
    /// Quants (0..15) of elements `4g..4g + 4` of row `r` in bytes `4r..4r + 4` of `q[g]`.
    q: [__m256i; 8],
    /// Each row's scale.
    d: __m256,
}

/// Repacks block `i` of eight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8(rows: &[&[BlockQ4_0]; 8], i: usize) -> Packed8 {
    Packed8 {
        q: nibbles8(quad_rows8(|r| &rows[r][i].qs)),
        d: scales8(rows, i),
    }
}

/// Block `i` of each of eight rows as 32 quant bytes (before [`transpose16`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibble_rows(rows: &[&[BlockQ4_0]; 8], i: usize) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    std::array::from_fn(|r| {
        let b = ld_u8x16(&rows[r][i].qs);
        // elements 0..16 (low nibbles), then 16..32 (high nibbles)
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(b), b), m4)
    })
}

/// The eight rows' scales of block `i`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8(rows: &[&[BlockQ4_0]; 8], i: usize) -> __m256 {
    let db = |r: usize| i16::from_le_bytes(rows[r][i].d);
    f16x8(db)
}

/// Activations of block `b` of a row stored as [`ActQ8`] pairs: elements `4g..4g + 4`, the
/// scale and `8 * -sum(q)`.
#[inline(always)]
pub(super) fn act_block(a: &[ActQ8], b: usize) -> (&ActQ8, usize) {
    (&a[b / 2], b % 2)
}

/// Elements `4g..4g + 4` of half `h` of the pair `x`.
#[inline(always)]
pub(super) fn act4(x: &ActQ8, h: usize, g: usize) -> &[i8] {
    if g < 4 {
        &x.lo[16 * h + 4 * g..]
    } else {
        &x.hi[16 * h + 4 * (g - 4)..]
    }
}

/// Block `i` (`u`) of eight repacked rows against one token's activations `x`, added to `acc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn term8<const S: i32>(u: &Packed8, x: &[ActQ8], i: usize, acc: __m256) -> __m256 {
    let (x, h) = act_block(x, i);
    let ones = _mm256_set1_epi16(1);
    // u * i8 pairs in 16 bits: Q4_0's 0..15 sum all eight groups there (16 * 15 * 127 <
    // 2^15); MXFP4's 4..28 four at a time (8 * 28 * 127 < 2^15), widened in between
    let groups = |g: std::ops::Range<usize>| {
        let mut s = _mm256_maddubs_epi16(u.q[g.start], bcast4(act4(x, h, g.start)));
        for g in g.start + 1..g.end {
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u.q[g], bcast4(act4(x, h, g))));
        }
        _mm256_madd_epi16(s, ones)
    };
    let sum = if S == 3 {
        groups(0..8)
    } else {
        _mm256_add_epi32(groups(0..4), groups(4..8))
    };
    // the quants' offset, 2^S (Q4_0's 8; MXFP4's 16)
    let bias = _mm256_set1_epi32(x.nsum[4 * h] << S);
    let it = _mm256_add_epi32(sum, bias);
    let d = _mm256_mul_ps(u.d, _mm256_set1_ps(x.d8[4 * h]));
    _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(it), acc)
}

/// Eight repacked rows (block `i` in `p[i]`) against `N` tokens: each token's eight results.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm8<const N: usize, const S: i32>(p: &[Packed8], xs: [&[ActQ8]; N]) -> [__m256; N] {
    let [acc] = gemm8_by::<N, 1, S>(p.len(), |i, _| p[i], xs, &[]);
    acc
}

/// [`gemm8`] on `H` sets of eight rows at once over `nb` blocks, `block(i, h)` giving block
/// `i` of set `h` (repacked beforehand, or unpacked from the interleaved layout as the loop
/// goes), prefetching the bytes `pf` into L2 a few lines a pair of blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm8_by<const N: usize, const H: usize, const S: i32>(
    nb: usize,
    block: impl Fn(usize, usize) -> Packed8,
    xs: [&[ActQ8]; N],
    pf: &[u8],
) -> [[__m256; N]; H] {
    // even blocks, odd blocks
    let mut even = [[_mm256_setzero_ps(); N]; H];
    let mut odd = [[_mm256_setzero_ps(); N]; H];
    for k in 0..nb.div_ceil(2) {
        prefetch_l2(pf, k, nb.div_ceil(2));
        for h in 0..H {
            let u = block(2 * k, h);
            for t in 0..N {
                even[h][t] = term8::<S>(&u, xs[t], 2 * k, even[h][t]);
            }
            if 2 * k + 1 < nb {
                let u = block(2 * k + 1, h);
                for t in 0..N {
                    odd[h][t] = term8::<S>(&u, xs[t], 2 * k + 1, odd[h][t]);
                }
            } else {
                // an odd block count: the decode kernel adds a zero block's term to the odd
                // sums
                for o in odd[h].iter_mut() {
                    *o = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_setzero_ps(), *o);
                }
            }
        }
    }
    std::array::from_fn(|h| std::array::from_fn(|t| _mm256_add_ps(even[h][t], odd[h][t])))
}

/// Sixteen rows of one Q4_0 block for AVX-512: rows 8..16 in lanes 8..16.
#[derive(Clone, Copy)]
pub(super) struct Packed16 {
    q: [__m512i; 8],
    d: __m512,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16(lo: &[&[BlockQ4_0]; 8], hi: &[&[BlockQ4_0]; 8], i: usize) -> Packed16 {
    Packed16 {
        q: transpose16(nibble_rows(lo, i), nibble_rows(hi, i)),
        d: join_ps(scales8(lo, i), scales8(hi, i)),
    }
}

/// [`term8`] on sixteen rows, the integer sum by `vpdpbusd` (AVX-512 here always has VNNI):
/// the same exact sum as `maddubs` pairs added in 16 bits and widened (no step of either
/// saturates), one instruction a group instead of three (two dependency chains).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn term16<const S: i32>(u: &Packed16, x: &[ActQ8], i: usize, acc: __m512) -> __m512 {
    let (x, h) = act_block(x, i);
    // the quants' offset, 2^S (Q4_0's 8; MXFP4's 16)
    let mut s = [
        _mm512_set1_epi32(x.nsum[4 * h] << S),
        _mm512_setzero_si512(),
    ];
    for g in 0..8 {
        s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], u.q[g], bcast4x16(act4(x, h, g)));
    }
    let it = _mm512_add_epi32(s[0], s[1]);
    let d = _mm512_mul_ps(u.d, _mm512_set1_ps(x.d8[4 * h]));
    _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(it), acc)
}

/// [`gemm8`] on sixteen rows: the same arithmetic per lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemm16<const N: usize, const S: i32>(p: &[Packed16], xs: [&[ActQ8]; N]) -> [__m512; N] {
    gemm16_by::<N, S>(p.len(), |i| p[i], xs, &[])
}

/// [`gemm16`] over `nb` blocks that `block(i)` gives (repacked beforehand, or unpacked from
/// the interleaved layout as the loop goes), prefetching the bytes `pf` into L2 a few lines
/// a pair of blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemm16_by<const N: usize, const S: i32>(
    nb: usize,
    block: impl Fn(usize) -> Packed16,
    xs: [&[ActQ8]; N],
    pf: &[u8],
) -> [__m512; N] {
    let mut even = [_mm512_setzero_ps(); N];
    let mut odd = [_mm512_setzero_ps(); N];
    for k in 0..nb.div_ceil(2) {
        prefetch_l2(pf, k, nb.div_ceil(2));
        let u = block(2 * k);
        for t in 0..N {
            even[t] = term16::<S>(&u, xs[t], 2 * k, even[t]);
        }
        if 2 * k + 1 < nb {
            let u = block(2 * k + 1);
            for t in 0..N {
                odd[t] = term16::<S>(&u, xs[t], 2 * k + 1, odd[t]);
            }
        } else {
            for o in odd.iter_mut() {
                *o = _mm512_fmadd_ps(_mm512_setzero_ps(), _mm512_setzero_ps(), *o);
            }
        }
    }
    std::array::from_fn(|t| _mm512_add_ps(even[t], odd[t]))
}

/// Block `i` of a group of sixteen interleaved rows (`crate::interleave`) as [`Packed16`]:
/// four loads, the nibbles split, the scales converted.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn unpack_x16(group: &[u8], i: usize) -> Packed16 {
    let b = &group[i * GROUP_BLOCK..(i + 1) * GROUP_BLOCK];
    let m4 = _mm512_set1_epi8(0x0F);
    let d = _mm512_cvtph_ps(ld_u8x32(&b[..32]));
    let v: [__m512i; 4] = std::array::from_fn(|k| ld_u8x64(&b[32 + 64 * k..]));
    Packed16 {
        q: std::array::from_fn(|g| {
            if g < 4 {
                _mm512_and_si512(v[g], m4)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(v[g - 4]), m4)
            }
        }),
        d,
    }
}

/// Q4_0 rows interleaved sixteen at a time against any number of tokens (AVX-512 with
/// VNNI): up to four tokens (decode) straight from the interleaved bytes, more through the
/// prompt driver with the groups unpacked once a chunk. Bit for bit [`gemm16`]'s result on
/// the same rows in file order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn rows_x16(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    x16_with::<3>((w, rb, acts, out), size_of::<BlockQ4_0>(), |g, i| {
        unpack_x16(g, i)
    })
}

/// The sixteen-row interleaved driver of a type whose block `i` of a group `unpack` gives
/// (bytes of a row's block: `block`), quants offset by 2^S.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn x16_with<const S: i32>(
    (w, rb, acts, out): (&[u8], usize, &[&[ActQ8]], &mut [f32]),
    block: usize,
    unpack: impl Fn(&[u8], usize) -> Packed16 + Copy,
) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, block, nt, out) else {
        return;
    };
    if nt <= 4 {
        x16_tiles(w, rb, nt, |group, r, pf, _| {
            by_tile!(acts, |xs| put_rows(
                gemm16_by::<_, S>(nb, |i| unpack(group, i), xs, pf).map(|v| lanes16(v)),
                r,
                nrows,
                out,
                nt,
                0
            ))
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        Packed16 {
            q: [_mm512_setzero_si512(); 8],
            d: _mm512_setzero_ps(),
        },
        |group, i, p| *p = unpack(group, i),
        |p: &[Packed16], r, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemm16::<_, S>(p, xs).map(|v| lanes16(v)),
                r,
                nrows,
                out,
                nt,
                t0
            ))
        },
    );
}

/// Block `i` of a group of sixteen interleaved rows, rows `8h..8h + 8`, as [`Packed8`]: the
/// 32-byte half `h` of each 64-byte unit is those rows' units, a row per 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_x8(group: &[u8], i: usize, h: usize) -> Packed8 {
    let b = &group[i * GROUP_BLOCK..(i + 1) * GROUP_BLOCK];
    let d = ld_f16x8(b[16 * h..].as_chunks().0);
    let v: [__m256i; 4] = std::array::from_fn(|k| ld_u8x32(&b[32 + 64 * k + 32 * h..]));
    Packed8 { q: nibbles8(v), d }
}

/// [`rows_x16`] on plain AVX2 (and AVX-VNNI, whose Q4_0 kernel is AVX2's): up to four tokens
/// with both halves of each group's blocks unpacked as the loop reads them ([`gemm8_by`]),
/// more through the prompt driver. Bit for bit the four-row decode kernel's result on the
/// same rows in file order.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_x16_avx2(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    x8_with::<3>((w, rb, acts, out), size_of::<BlockQ4_0>(), |g, i, h| {
        unpack_x8(g, i, h)
    })
}

/// [`x16_with`] on AVX2: each half of a group's blocks (`unpack(group, i, h)`) eight rows a
/// vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn x8_with<const S: i32>(
    (w, rb, acts, out): (&[u8], usize, &[&[ActQ8]], &mut [f32]),
    block: usize,
    unpack: impl Fn(&[u8], usize, usize) -> Packed8 + Copy,
) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, block, nt, out) else {
        return;
    };
    let zero = Packed8 {
        q: [_mm256_setzero_si256(); 8],
        d: _mm256_setzero_ps(),
    };
    if nt <= 4 {
        x16_tiles(w, rb, nt, |group, r, pf, _| {
            by_tile!(acts, |xs| put_halves(
                gemm8_by::<_, 2, S>(nb, |i, h| unpack(group, i, h), xs, pf),
                r,
                nrows,
                out,
                (nt, 0)
            ))
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        [zero; 2],
        |group, i, p| *p = [unpack(group, i, 0), unpack(group, i, 1)],
        |p: &[[Packed8; 2]], r, t0| {
            // a half at a time
            for h in 0..2 {
                by_tile!(&acts[t0..], |xs| put_rows(
                    gemm8_by::<_, 1, S>(p.len(), |i, _| p[i][h], xs, &[])[0].map(|v| lanes8(v)),
                    r + 8 * h,
                    nrows,
                    out,
                    nt,
                    t0
                ))
            }
        },
    );
}

/// Q4_0 rows against a prompt batch on plain AVX2: groups of eight rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn gemm_rows8(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows8_with::<BlockQ4_0, 3>((w, rb, acts, out), |rows, i| repack8(rows, i))
}

/// Rows of block type `B` in file order, groups of eight repacked a chunk at a time
/// (`repack`), quants offset by 2^S.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8_with<B, const S: i32>(
    (w, rb, acts, out): (&[u8], usize, &[&[ActQ8]], &mut [f32]),
    repack: impl Fn(&[&[B]; 8], usize) -> Packed8,
) where
    B: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned,
{
    let (nt, nrows, nb) = (acts.len(), w.len() / rb, rb / size_of::<B>());
    if nt == 0 || nrows == 0 {
        return;
    }
    chunked(
        w,
        rb,
        (nb, 8, nt),
        Packed8 {
            q: [_mm256_setzero_si256(); 8],
            d: _mm256_setzero_ps(),
        },
        |r| group8::<B>(w, rb, r, nrows),
        |rows, i, p| *p = repack(rows, i),
        |p: &[Packed8], r, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemm8::<_, S>(p, xs).map(|v| lanes8(v)),
                r,
                nrows,
                out,
                nt,
                t0
            ))
        },
    );
}

/// Q4_0 rows against a prompt batch on AVX-512 (with VNNI): groups of sixteen rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_rows16(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows16_with::<BlockQ4_0, 3>((w, rb, acts, out), |lo, hi, i| repack16(lo, hi, i))
}

/// [`rows8_with`] sixteen rows a group (AVX-512 with VNNI).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn rows16_with<B, const S: i32>(
    (w, rb, acts, out): (&[u8], usize, &[&[ActQ8]], &mut [f32]),
    repack: impl Fn(&[&[B]; 8], &[&[B]; 8], usize) -> Packed16,
) where
    B: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned,
{
    let (nt, nrows, nb) = (acts.len(), w.len() / rb, rb / size_of::<B>());
    if nt == 0 || nrows == 0 {
        return;
    }
    chunked(
        w,
        rb,
        (nb, 16, nt),
        Packed16 {
            q: [_mm512_setzero_si512(); 8],
            d: _mm512_setzero_ps(),
        },
        |r| {
            (
                group8::<B>(w, rb, r, nrows),
                group8::<B>(w, rb, r + 8, nrows),
            )
        },
        |(lo, hi), i, p| *p = repack(lo, hi, i),
        |p: &[Packed16], r, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemm16::<_, S>(p, xs).map(|v| lanes16(v)),
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
// MXFP4 (gpt-oss's experts) on AVX-512: the Q4_0 kernels above with each nibble looked up
// (its E2M1 value doubled, plus 16, by one byte shuffle) and the offset 16 taken off as
// Q4_0's 8 is; the scales `2^(e - 128)`. Rows in file order are repacked sixteen at a time
// (`transpose16`), rows interleaved are read as they are: the same integer sums and block
// ends, so the two layouts give the same bits.

/// The nibble values of MXFP4 plus 16, in every 128-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mxfp4_lut() -> __m256i {
    _mm256_broadcastsi128_si256(_mm_setr_epi8(
        16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4,
    ))
}

/// Sixteen E8M0 scale bytes as `2^(e - 128)`, built from bits as `e8m0_half` builds them
/// (`(e - 1) << 23`; `0x00200000 << e` for the subnormal `e` 0 and 1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn e8m0x16(e: &[u8; 16]) -> __m512 {
    let e = _mm512_cvtepu8_epi32(ld_u8x16(e));
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let small = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let m = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(m, normal, small))
}

/// Block `i` of each of eight MXFP4 rows as 32 value bytes (+16), before
/// [`transpose16`] (MXFP4's [`nibble_rows`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn value_rows_mxfp4(rows: &[&[BlockMxfp4]; 8], i: usize) -> [__m256i; 8] {
    let (m4, lut) = (_mm256_set1_epi8(0x0F), mxfp4_lut());
    std::array::from_fn(|r| {
        let b = ld_u8x16(&rows[r][i].qs);
        let n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(b), b), m4);
        _mm256_shuffle_epi8(lut, n)
    })
}

/// Block `i` of sixteen MXFP4 rows in file order as [`Packed16`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16_mxfp4(lo: &[&[BlockMxfp4]; 8], hi: &[&[BlockMxfp4]; 8], i: usize) -> Packed16 {
    Packed16 {
        q: transpose16(value_rows_mxfp4(lo, i), value_rows_mxfp4(hi, i)),
        d: e8m0x16(&std::array::from_fn(|r| {
            if r < 8 {
                lo[r][i].e
            } else {
                hi[r - 8][i].e
            }
        })),
    }
}

/// Bytes of one block of sixteen interleaved MXFP4 rows: the scale bytes, then the quant
/// bytes `4k..4k + 4` of each row at `16 + 64k + 4r`.
const GROUP_BLOCK_MXFP4: usize = GROUP * std::mem::size_of::<BlockMxfp4>();

/// Block `i` of a group of sixteen interleaved MXFP4 rows as [`Packed16`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn unpack_x16_mxfp4(group: &[u8], i: usize) -> Packed16 {
    let b = &group[i * GROUP_BLOCK_MXFP4..(i + 1) * GROUP_BLOCK_MXFP4];
    let m4 = _mm512_set1_epi8(0x0F);
    let lut = _mm512_broadcast_i32x4(_mm256_castsi256_si128(mxfp4_lut()));
    let v: [__m512i; 4] = std::array::from_fn(|k| ld_u8x64(&b[16 + 64 * k..]));
    Packed16 {
        q: std::array::from_fn(|g| {
            let n = if g < 4 {
                _mm512_and_si512(v[g], m4)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(v[g - 4]), m4)
            };
            _mm512_shuffle_epi8(lut, n)
        }),
        d: e8m0x16(b[..16].try_into().expect("16 scale bytes")),
    }
}

/// MXFP4 rows in file order against any number of tokens (AVX-512 with VNNI): groups of
/// sixteen rows repacked a chunk at a time. Bit for bit [`rows_x16_mxfp4`] on the same rows
/// interleaved.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_rows16_mxfp4(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows16_with::<BlockMxfp4, 4>((w, rb, acts, out), |lo, hi, i| repack16_mxfp4(lo, hi, i))
}

/// MXFP4 rows interleaved sixteen at a time (AVX-512 with VNNI): up to four tokens straight
/// from the interleaved bytes, more through the prompt driver.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn rows_x16_mxfp4(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    x16_with::<4>((w, rb, acts, out), size_of::<BlockMxfp4>(), |g, i| {
        unpack_x16_mxfp4(g, i)
    })
}

/// Eight E8M0 scale bytes as `2^(e - 128)` ([`e8m0x16`] on AVX2).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn e8m0x8(e: &[u8]) -> __m256 {
    assert!(e.len() >= 8);
    // SAFETY: at least 8 readable bytes (checked above); no alignment requirement.
    let e = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(e.as_ptr().cast()) });
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, is_small))
}

/// Block `i` of eight MXFP4 rows in file order as [`Packed8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repack8_mxfp4(rows: &[&[BlockMxfp4]; 8], i: usize) -> Packed8 {
    let e: [u8; 8] = std::array::from_fn(|r| rows[r][i].e);
    let lut = mxfp4_lut();
    Packed8 {
        q: nibbles8(quad_rows8(|r| &rows[r][i].qs)).map(|n| _mm256_shuffle_epi8(lut, n)),
        d: e8m0x8(&e),
    }
}

/// Block `i` of a group of sixteen interleaved MXFP4 rows, rows `8h..8h + 8`, as [`Packed8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_x8_mxfp4(group: &[u8], i: usize, h: usize) -> Packed8 {
    let b = &group[i * GROUP_BLOCK_MXFP4..(i + 1) * GROUP_BLOCK_MXFP4];
    let lut = mxfp4_lut();
    let v: [__m256i; 4] = std::array::from_fn(|k| ld_u8x32(&b[16 + 64 * k + 32 * h..]));
    Packed8 {
        q: nibbles8(v).map(|n| _mm256_shuffle_epi8(lut, n)),
        d: e8m0x8(&b[8 * h..]),
    }
}

/// MXFP4 rows in file order on AVX2 (and AVX-VNNI): groups of eight rows repacked a chunk at
/// a time, the arithmetic of [`gemm_rows16_mxfp4`] (so the same bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn gemm_rows8_mxfp4(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows8_with::<BlockMxfp4, 4>((w, rb, acts, out), |rows, i| repack8_mxfp4(rows, i))
}

/// [`rows_x16_mxfp4`] on AVX2 (and AVX-VNNI): each half of a group's blocks eight rows a
/// vector, the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_x16_mxfp4_avx2(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    x8_with::<4>((w, rb, acts, out), size_of::<BlockMxfp4>(), |g, i, h| {
        unpack_x8_mxfp4(g, i, h)
    })
}
