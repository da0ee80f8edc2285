//! Q8_0 rows eight (or sixteen) at a time, one row per 32-bit vector lane.
//!
//! Every path ends a block the same way, per row: the block's exact integer dot product `I`
//! (32 products of signed bytes), then `acc = fma(dw * dx, I, acc)`, rows in the lanes of one
//! accumulator per token. So a row's result is the same bits whichever path and whichever
//! instruction set computed it (the integer sums are exact everywhere):
//!
//! - fewer tokens than [`Q80_LANES_MIN`] (decode, small batches): eight rows in their stored
//!   layout side by side; each row's products come out as eight partial lanes (four per block
//!   of a pair) and a tree of `hadd`s turns the eight rows' partials into one vector of totals
//!   per block ([`totals8`]);
//! - more (prompt batches): a chunk of rows is repacked once (each 32-bit lane holds four
//!   consecutive quants of one row, so a broadcast of four activation bytes multiplies every
//!   row of the vector at once, with no horizontal sums) and every tile of up to four tokens
//!   runs against it.
//!
//! The products of two signed bytes: with VNNI (`vpdpbusd`, unsigned x signed into i32 with no
//! intermediate saturation) the weights are stored offset by 128 (`w ^ 0x80`) and the block's
//! `128 * sum(x)` is taken back (the activations carry `-sum(x)`); plain AVX2's `maddubs` would
//! saturate on such products, so there `|w|` meets `x` with `w`'s sign (`psignb`), one `madd`
//! per product pair widening to i32 before two could overflow.

use super::q40::{act4, act_block};
use super::q4k::{
    bcast4, by_tile, chunked, group8, join_ps, lanes16, lanes8, put_rows, transpose16, transpose8,
};
use super::*;

/// Prompt batches of at least this many tokens repack the rows (plain AVX2, AVX-VNNI,
/// AVX-512); fewer run the rows in their stored layout. The same results either way.
pub(super) const Q80_LANES_MIN: (usize, usize, usize) = (18, 10, 10);

/// The eight rows' f16 scales of block `i` as f32 (0 for a block past the rows' end).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales8(rows: &[&[BlockQ8_0]; 8], i: usize) -> __m256 {
    let db = |r: usize| rows[r].get(i).map_or(0, |b| i16::from_le_bytes(b.d));
    _mm256_cvtph_ps(_mm_setr_epi16(
        db(0),
        db(1),
        db(2),
        db(3),
        db(4),
        db(5),
        db(6),
        db(7),
    ))
}

/// Eight rows' partial sums of a block pair (`v[r]`: four lanes of block `2p`, then four of
/// block `2p + 1`) to the pair's totals, row `r` in lane `r`: `(block 2p, block 2p + 1)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn totals8(v: &[__m256i; 8]) -> (__m256i, __m256i) {
    let q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    // q0 = [r0..r3 of block 2p | r0..r3 of 2p + 1], q1 the same for rows 4..8
    (
        _mm256_permute2x128_si256::<0x20>(q0, q1),
        _mm256_permute2x128_si256::<0x31>(q0, q1),
    )
}

/// One block's step of every path: `acc + (dw * dx) * I` for the rows in the lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn step8(acc: __m256, dw: __m256, dx: f32, i: __m256i) -> __m256 {
    _mm256_fmadd_ps(
        _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
        _mm256_cvtepi32_ps(i),
        acc,
    )
}

/// [`step8`] on sixteen rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn step16(acc: __m512, dw: __m512, dx: f32, i: __m512i) -> __m512 {
    _mm512_fmadd_ps(
        _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
        _mm512_cvtepi32_ps(i),
        acc,
    )
}

/// A row's block pair as the products want it: both blocks' elements 0..16 (`lo`) and 16..32
/// (`hi`), offset (`w ^ 0x80`) for VNNI, absolute values with the signed bytes in `slo`/`shi`
/// for `maddubs`.
#[derive(Clone, Copy)]
struct Pair {
    lo: __m256i,
    hi: __m256i,
    slo: __m256i,
    shi: __m256i,
}

/// Block pair `p` of a row (a zero block past its end).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair<const OFFSET: bool>(row: &[BlockQ8_0], p: usize) -> Pair {
    let zero = [0i8; QK];
    let b0 = &row[2 * p].qs;
    let b1 = row.get(2 * p + 1).map_or(&zero, |b| &b.qs);
    let lo = _mm256_set_m128i(ld_i8x16(&b1[..16]), ld_i8x16(&b0[..16]));
    let hi = _mm256_set_m128i(ld_i8x16(&b1[16..]), ld_i8x16(&b0[16..]));
    if OFFSET {
        let m = _mm256_set1_epi8(i8::MIN);
        Pair {
            lo: _mm256_xor_si256(lo, m),
            hi: _mm256_xor_si256(hi, m),
            slo: lo,
            shi: hi,
        }
    } else {
        Pair {
            lo: _mm256_abs_epi8(lo),
            hi: _mm256_abs_epi8(hi),
            slo: lo,
            shi: hi,
        }
    }
}

/// `128 * sum(x)` of both blocks of an activation pair, to take back from offset products:
/// `-128 * nsum` in the lanes of each block (lanes 0..4: block `2p`, 4..8: `2p + 1`), spread
/// so that [`totals8`] adds one copy per block (lane 0 of each half, zeros elsewhere).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn offset_back(x: &ActQ8) -> __m256i {
    _mm256_slli_epi32::<7>(ld_i32x8(&x.nsum))
}

/// Generates the decode path for one instruction set: `$dot(acc, u, x)` adds the products of
/// a 256-bit vector of weight bytes `u` (offset or absolute, as `$offset` says) and activation
/// bytes `x` (signed by `s` where not offset) into i32 lanes.
macro_rules! q80_stored {
    ($feat:literal, $offset:literal, $dot:ident) => {
        /// Products of `u` (as [`pair`] stored them; `s` the signed bytes) and `x`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn prod(acc: __m256i, u: __m256i, s: __m256i, x: __m256i) -> __m256i {
            if $offset {
                $dot(acc, u, x)
            } else {
                $dot(acc, u, _mm256_sign_epi8(x, s))
            }
        }

        /// Eight rows in their stored layout against `N` tokens: each token's results,
        /// row `r` in lane `r`. `pf` (the next rows) is prefetched a few lines a pair.
        #[inline]
        #[target_feature(enable = $feat)]
        fn rows8<const N: usize>(
            rows: &[&[BlockQ8_0]; 8],
            a: &[&[ActQ8]; N],
            pf: &[u8],
        ) -> [__m256; N] {
            let nb = rows[0].len();
            let np = nb.div_ceil(2);
            assert!(rows.iter().all(|r| r.len() == nb) && a.iter().all(|x| x.len() >= np));
            let mut acc = [_mm256_setzero_ps(); N];
            for p in 0..np {
                prefetch_l2(pf, p, np);
                let mut w = [pair::<$offset>(rows[0], p); 8];
                for r in 1..8 {
                    w[r] = pair::<$offset>(rows[r], p);
                }
                let (d0, d1) = (scales8(rows, 2 * p), scales8(rows, 2 * p + 1));
                for t in 0..N {
                    let x = &a[t][p];
                    let (xl, xh) = (ld_i8x32(&x.lo), ld_i8x32(&x.hi));
                    let init = if $offset {
                        offset_back(x)
                    } else {
                        _mm256_setzero_si256()
                    };
                    let mut v = [init; 8];
                    for r in 0..8 {
                        v[r] = prod(prod(v[r], w[r].lo, w[r].slo, xl), w[r].hi, w[r].shi, xh);
                    }
                    let (i0, i1) = totals8(&v);
                    acc[t] = step8(acc[t], d0, x.d8[0], i0);
                    if 2 * p + 1 < nb {
                        acc[t] = step8(acc[t], d1, x.d8[4], i1);
                    }
                }
            }
            acc
        }

        /// Every row against the tile of tokens from `t0`, rows in their stored layout.
        #[inline]
        #[target_feature(enable = $feat)]
        fn tile_rows<const N: usize>(
            w: &[u8],
            rb: usize,
            a: [&[ActQ8]; N],
            out: &mut [f32],
            nt: usize,
            t0: usize,
        ) {
            let nrows = w.len() / rb;
            for r in (0..nrows).step_by(8) {
                let pf = ahead(w, r * rb, 8 * rb);
                let acc = rows8(&group8(w, rb, r, nrows), &a, pf);
                put_rows(acc.map(|v| lanes8(v)), r, nrows, out, nt, t0);
            }
        }

        /// Rows in their stored layout against every token, tile by tile.
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn rows_stored(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let nt = acts.len();
            let mut t0 = 0;
            while t0 < nt {
                by_tile!(&acts[t0..], |xs| tile_rows(w, rb, xs, out, nt, t0));
                t0 += (nt - t0).min(4);
            }
        }
    };
}

/// Generates the prompt path with eight rows a vector for one instruction set (in the module
/// of its [`q80_stored`], whose `prod` it shares).
macro_rules! q80_lanes8 {
    ($feat:literal, $offset:literal) => {
        /// Eight rows of one block, repacked: quants of elements `4g..4g + 4` of row `r`
        /// in bytes `4r..4r + 4` of `q[g]` (offset or absolute), their signed bytes in
        /// `s[g]` where the products need them, each row's scale in `d`.
        #[derive(Clone, Copy)]
        pub(in crate::avx2) struct Packed8 {
            q: [__m256i; 8],
            s: [__m256i; if $offset { 0 } else { 8 }],
            d: __m256,
        }

        impl Packed8 {
            #[inline]
            #[target_feature(enable = $feat)]
            fn zero() -> Packed8 {
                Packed8 {
                    q: [_mm256_setzero_si256(); 8],
                    s: [_mm256_setzero_si256(); if $offset { 0 } else { 8 }],
                    d: _mm256_setzero_ps(),
                }
            }
        }

        /// Repacks block `i` of eight rows into `p`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn repack8(rows: &[&[BlockQ8_0]; 8], i: usize, p: &mut Packed8) {
            let mut v = [_mm256_setzero_si256(); 8];
            for r in 0..8 {
                v[r] = ld_i8x32(&rows[r][i].qs);
            }
            let t = transpose8(v);
            for g in 0..8 {
                if $offset {
                    p.q[g] = _mm256_xor_si256(t[g], _mm256_set1_epi8(i8::MIN));
                } else {
                    p.q[g] = _mm256_abs_epi8(t[g]);
                    if let Some(s) = p.s.get_mut(g) {
                        *s = t[g];
                    }
                }
            }
            p.d = scales8(rows, i);
        }

        /// Block `i` (`u`) of eight repacked rows against one token's activations,
        /// added to `acc`. Two integer sums (even and odd groups of four elements)
        /// shorten the dependency chain; integers, so the same total.
        #[inline]
        #[target_feature(enable = $feat)]
        fn term8(u: &Packed8, x: &[ActQ8], i: usize, acc: __m256) -> __m256 {
            let (x, h) = act_block(x, i);
            let mut s = [_mm256_setzero_si256(); 2];
            if $offset {
                s[0] = _mm256_set1_epi32(x.nsum[4 * h] << 7);
            }
            for g in 0..8 {
                let sg = u.s.get(g).copied().unwrap_or(u.q[g]);
                s[g % 2] = prod(s[g % 2], u.q[g], sg, bcast4(act4(x, h, g)));
            }
            step8(acc, u.d, x.d8[4 * h], _mm256_add_epi32(s[0], s[1]))
        }

        /// Eight repacked rows (block `i` in `p[i]`) against `N` tokens.
        #[inline]
        #[target_feature(enable = $feat)]
        fn gemm8<const N: usize>(p: &[Packed8], xs: [&[ActQ8]; N]) -> [__m256; N] {
            let mut acc = [_mm256_setzero_ps(); N];
            for (i, u) in p.iter().enumerate() {
                for t in 0..N {
                    acc[t] = term8(u, xs[t], i, acc[t]);
                }
            }
            acc
        }

        /// Q8_0 prompt batches: groups of eight rows repacked a chunk at a time.
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn gemm_rows8(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
            let (nt, nrows, nb) = (
                acts.len(),
                w.len() / rb,
                rb / std::mem::size_of::<BlockQ8_0>(),
            );
            chunked(
                w,
                rb,
                (nb, 8, nt),
                Packed8::zero(),
                |r, i, p| repack8(&group8(w, rb, r, nrows), i, p),
                |p: &[Packed8], r, t0| {
                    by_tile!(&acts[t0..], |xs| put_rows(
                        gemm8(p, xs).map(|v| lanes8(v)),
                        r,
                        nrows,
                        out,
                        nt,
                        t0
                    ))
                },
            );
        }
    };
}

/// `maddubs` of absolute weights and signed activations, widened to i32 (`madd`) before two
/// pair sums (up to 2 * 128 * 127 each) could overflow i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_abs(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)),
    )
}

/// `vpdpbusd` (AVX-VNNI).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dot_avx_vnni(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, u, x)
}

/// `vpdpbusd` in its EVEX encoding on 256-bit vectors (AVX512-VNNI).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn dot_evex_vnni(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, x)
}

/// Plain AVX2.
pub(super) mod plain {
    use super::*;
    q80_stored!("avx2,fma,f16c", false, dot_abs);
    q80_lanes8!("avx2,fma,f16c", false);
}

/// AVX-VNNI.
pub(super) mod vnni {
    use super::*;
    q80_stored!("avx2,fma,f16c,avxvnni", true, dot_avx_vnni);
    q80_lanes8!("avx2,fma,f16c,avxvnni", true);
}

/// AVX-512: the decode path on 256-bit vectors with EVEX `vpdpbusd` (and 32 registers);
/// prompt batches run sixteen rows a vector ([`gemm_rows16`]).
pub(super) mod evex {
    use super::*;
    q80_stored!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        true,
        dot_evex_vnni
    );
}

/// Sixteen rows of one block for AVX-512: offset quants, rows 8..16 in lanes 8..16.
#[derive(Clone, Copy)]
pub(super) struct Packed16 {
    q: [__m512i; 8],
    d: __m512,
}

/// Repacks block `i` of sixteen rows (`lo`: rows 0..8, `hi`: 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16(lo: &[&[BlockQ8_0]; 8], hi: &[&[BlockQ8_0]; 8], i: usize, p: &mut Packed16) {
    let m = _mm512_set1_epi8(i8::MIN);
    let half = |rows: &[&[BlockQ8_0]; 8]| {
        let mut v = [_mm256_setzero_si256(); 8];
        for r in 0..8 {
            v[r] = ld_i8x32(&rows[r][i].qs);
        }
        v
    };
    for (pq, q) in p.q.iter_mut().zip(transpose16(half(lo), half(hi))) {
        *pq = _mm512_xor_si512(q, m);
    }
    p.d = join_ps(scales8(lo, i), scales8(hi, i));
}

/// Block `i` of sixteen repacked rows against one token, added to `acc`: [`q80_lanes8`]'
/// `term8` on 512-bit vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn term16(u: &Packed16, x: &[ActQ8], i: usize, acc: __m512) -> __m512 {
    let (x, h) = act_block(x, i);
    let b4 = |q: &[i8]| {
        assert!(q.len() >= 4);
        // SAFETY: at least 4 readable bytes (checked above), read unaligned.
        _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(q.as_ptr().cast::<i32>()) })
    };
    let mut s = [
        _mm512_set1_epi32(x.nsum[4 * h] << 7),
        _mm512_setzero_si512(),
    ];
    for g in 0..8 {
        s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], u.q[g], b4(act4(x, h, g)));
    }
    step16(acc, u.d, x.d8[4 * h], _mm512_add_epi32(s[0], s[1]))
}

/// Sixteen repacked rows (block `i` in `p[i]`) against `N` tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemm16<const N: usize>(p: &[Packed16], xs: [&[ActQ8]; N]) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    for (i, u) in p.iter().enumerate() {
        for t in 0..N {
            acc[t] = term16(u, xs[t], i, acc[t]);
        }
    }
    acc
}

/// Q8_0 prompt batches on AVX-512: groups of sixteen rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_rows16(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let (nt, nrows, nb) = (
        acts.len(),
        w.len() / rb,
        rb / std::mem::size_of::<BlockQ8_0>(),
    );
    chunked(
        w,
        rb,
        (nb, 16, nt),
        Packed16 {
            q: [_mm512_setzero_si512(); 8],
            d: _mm512_setzero_ps(),
        },
        |r, i, p| repack16(&group8(w, rb, r, nrows), &group8(w, rb, r + 8, nrows), i, p),
        |p: &[Packed16], r, t0| {
            by_tile!(&acts[t0..], |xs| put_rows(
                gemm16(p, xs).map(|v| lanes16(v)),
                r,
                nrows,
                out,
                nt,
                t0
            ))
        },
    );
}
