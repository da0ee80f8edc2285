//! Float weights (F32, F16, BF16) times f32 activations, several rows and several tokens at
//! a time.
//!
//! Every (row, token) dot product is the same chain of operations on every path, so a
//! token's result never depends on its batch, its place in a tile, or the instruction set
//! (plain AVX2 or AVX-512); it is also what the row-at-a-time kernel computed before these
//! tiles (`dot_*` in `avx2.rs`, kept as the reference the tests compare with bit for bit):
//! two accumulators of eight lanes, `acc0` over the elements `16k..16k + 8` and `acc1` over
//! `16k + 8..16k + 16` (one FMA each per 16 elements), then one more FMA into `acc0` for a
//! last whole eight, `hsum(acc0 + acc1)`, and the remaining elements one by one (a product,
//! then a sum). With AVX-512 one 16-lane register holds both accumulators (`acc0` in the low
//! half), so the same FMAs run half as many instructions.
//!
//! Tiles: `R` rows × `T` tokens of accumulators live in registers for the whole row, so each
//! weight vector loaded (and converted from f16/bf16) serves `T` tokens and each activation
//! vector `R` rows. AVX2 (16 registers): 2 rows × 3 tokens (12 accumulators), the last
//! tokens of a batch 2 × 2 or 4 × 1; AVX-512 (32): 4 × 6 (24), the rest 4 × 5 .. 8 × 1. The
//! row-at-a-time kernel loaded one weight vector per four tokens and an activation vector
//! per product, so prompt batches were bound by loads; and it walked all its rows for each
//! group of four tokens, out of cache at the larger shapes. Here a task's rows go in chunks
//! of about [`CHUNK_BYTES`] (in L2), every token tile running over a chunk before the next
//! chunk is read. A short last tile of rows repeats its last row (computed, not stored).
//!
//! Measured on the AMD EPYC (Zen 4) VM, 2 threads, F16 4096 × 2048 against 64 tokens
//! (`decode_bw f16 64` with `DECODE_BW_SHAPE=4096x2048x4`): AVX-512 ~190 GFLOP/s (near the
//! two cores' FMA peak), plain AVX2 ~140; 3 × 2 and 1 × 4 tiles on AVX2 ran ~88 (3 × 2 uses
//! all 16 registers), and converting a chunk of rows to f32 once for all tiles ran slower
//! (~108) than converting in every tile. The accumulators are plain arrays indexed in loops
//! of constant length, which unroll into registers: with `array::from_fn` closures over them
//! one build (gdsrun's, thin LTO) stored every accumulator to the stack on each step, at
//! half the speed.

use super::*;

/// Weight bytes of the rows that every token tile runs over before the next rows are read
/// (in L2 with the tile's activations).
const CHUNK_BYTES: usize = 128 << 10;

/// The tiles of one instruction set, for one weight element type: `$ld8` loads eight
/// elements as f32 lanes (`$ld16` sixteen, for AVX-512), `$scalar` converts one.
macro_rules! float_rows {
    ($name:ident, $elem:ty, $ld8:ident, $ld16:ident, $scalar:expr) => {
        // (index loops over the tile: see the module's comment)
        #[allow(clippy::needless_range_loop)]
        pub(crate) mod $name {
            use super::*;

            /// The remaining elements `i..n` one by one, after the vector part.
            #[inline(always)]
            fn tail(w: &[$elem], x: &[f32], i: usize, mut s: f32) -> f32 {
                for j in i..w.len() {
                    s += ($scalar)(w[j]) * x[j];
                }
                s
            }

            /// The common length of a tile's rows (each token has at least as many values).
            #[inline(always)]
            fn check<const R: usize, const T: usize>(w: &[&[$elem]; R], x: &[&[f32]; T]) -> usize {
                let n = w[0].len();
                for r in w {
                    assert_eq!(r.len(), n);
                }
                for t in x {
                    assert!(t.len() >= n);
                }
                n
            }

            /// The end of every tile's chains, from element `i` (the first past the whole
            /// sixteens): one more FMA into `acc0` for a last whole eight, `hsum(acc0 +
            /// acc1)`, then the remaining elements one by one.
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn finish<const R: usize, const T: usize>(
                w: [&[$elem]; R],
                x: [&[f32]; T],
                mut i: usize,
                mut acc: [[[__m256; 2]; T]; R],
            ) -> [[f32; T]; R] {
                let n = check(&w, &x);
                if i + 8 <= n {
                    // In bounds: i + 8 <= n, every row has n elements and every token at
                    // least n (checked above).
                    let mut wv = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        // SAFETY: in bounds (above).
                        wv[r] = unsafe { $ld8(w[r].as_ptr().add(i)) };
                    }
                    for t in 0..T {
                        // SAFETY: as above.
                        let xv = unsafe { _mm256_loadu_ps(x[t].as_ptr().add(i)) };
                        for r in 0..R {
                            acc[r][t][0] = _mm256_fmadd_ps(wv[r], xv, acc[r][t][0]);
                        }
                    }
                    i += 8;
                }
                let mut res = [[0f32; T]; R];
                for r in 0..R {
                    for t in 0..T {
                        let [a0, a1] = acc[r][t];
                        res[r][t] = tail(w[r], x[t], i, hsum_ps(_mm256_add_ps(a0, a1)));
                    }
                }
                res
            }

            /// `R` rows × `T` tokens on plain AVX2: two accumulators each.
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn tile8<const R: usize, const T: usize>(
                w: [&[$elem]; R],
                x: [&[f32]; T],
            ) -> [[f32; T]; R] {
                let n = check(&w, &x);
                let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
                let mut i = 0;
                while i + 16 <= n {
                    for h in 0..2 {
                        // In bounds: i + 16 <= n, every row has n elements and every token
                        // at least n (asserted above).
                        let mut wv = [_mm256_setzero_ps(); R];
                        for r in 0..R {
                            // SAFETY: in bounds (above).
                            wv[r] = unsafe { $ld8(w[r].as_ptr().add(i + 8 * h)) };
                        }
                        for t in 0..T {
                            // SAFETY: as above.
                            let xv = unsafe { _mm256_loadu_ps(x[t].as_ptr().add(i + 8 * h)) };
                            for r in 0..R {
                                acc[r][t][h] = _mm256_fmadd_ps(wv[r], xv, acc[r][t][h]);
                            }
                        }
                    }
                    i += 16;
                }
                finish(w, x, i, acc)
            }

            /// `R` rows × `T` tokens with AVX-512: one 16-lane accumulator each, `acc0` in
            /// its low half and `acc1` in its high half.
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
            fn tile16<const R: usize, const T: usize>(
                w: [&[$elem]; R],
                x: [&[f32]; T],
            ) -> [[f32; T]; R] {
                let n = check(&w, &x);
                let mut acc = [[_mm512_setzero_ps(); T]; R];
                let mut i = 0;
                while i + 16 <= n {
                    // In bounds: i + 16 <= n, every row has n elements and every token at
                    // least n (asserted above).
                    let mut wv = [_mm512_setzero_ps(); R];
                    for r in 0..R {
                        // SAFETY: in bounds (above).
                        wv[r] = unsafe { $ld16(w[r].as_ptr().add(i)) };
                    }
                    for t in 0..T {
                        // SAFETY: as above.
                        let xv = unsafe { _mm512_loadu_ps(x[t].as_ptr().add(i)) };
                        for r in 0..R {
                            acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                        }
                    }
                    i += 16;
                }
                let mut halves = [[[_mm256_setzero_ps(); 2]; T]; R];
                for r in 0..R {
                    for t in 0..T {
                        halves[r][t] = [
                            _mm512_castps512_ps256(acc[r][t]),
                            // (the high half; `extractf32x8` would need AVX-512 DQ)
                            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(
                                acc[r][t],
                            ))),
                        ];
                    }
                }
                finish(w, x, i, halves)
            }

            /// Rows `r0..r1` of `rows` against tokens `t0..t1`, in tiles of `R` × `T`,
            /// written to `out[r * nt + t]`.
            #[allow(clippy::too_many_arguments)]
            #[inline(always)]
            fn run<const R: usize, const T: usize>(
                wide: bool,
                rows: &[&[$elem]],
                (r0, r1): (usize, usize),
                acts: &[&[f32]],
                (t0, t1): (usize, usize),
                out: &mut [f32],
                nt: usize,
            ) {
                for tb in (t0..t1).step_by(T) {
                    let x: [&[f32]; T] = std::array::from_fn(|t| acts[(tb + t).min(t1 - 1)]);
                    for rb in (r0..r1).step_by(R) {
                        let w: [&[$elem]; R] = std::array::from_fn(|r| rows[(rb + r).min(r1 - 1)]);
                        let res = if wide {
                            // SAFETY: `wide` only when the token says AVX-512 F, VL, BW and
                            // VNNI were detected (with AVX2, FMA, F16C).
                            unsafe { tile16::<R, T>(w, x) }
                        } else {
                            // SAFETY: an `Avx2` token exists only when AVX2, FMA and F16C
                            // were detected.
                            unsafe { tile8::<R, T>(w, x) }
                        };
                        for (r, row) in res.iter().enumerate().take(r1 - rb) {
                            let o = &mut out[(rb + r) * nt..];
                            for (t, &v) in row.iter().enumerate().take(t1 - tb) {
                                o[tb + t] = v;
                            }
                        }
                    }
                }
            }

            /// The token tiles of rows `c.0..c.1` (one chunk): whole tiles of tokens, then
            /// the rest in one tile shaped for its count.
            fn run_chunk(
                wide: bool,
                rows: &[&[$elem]],
                c: (usize, usize),
                acts: &[&[f32]],
                out: &mut [f32],
                nt: usize,
            ) {
                let main = if wide { 6 } else { 3 };
                let full = nt - nt % main;
                if full > 0 {
                    if wide {
                        run::<4, 6>(true, rows, c, acts, (0, full), out, nt);
                    } else {
                        run::<2, 3>(false, rows, c, acts, (0, full), out, nt);
                    }
                }
                let rest = (full, nt);
                match (wide, nt - full) {
                    (_, 0) => {}
                    (true, 1) => run::<8, 1>(true, rows, c, acts, rest, out, nt),
                    (true, 2) => run::<6, 2>(true, rows, c, acts, rest, out, nt),
                    (true, 3) => run::<5, 3>(true, rows, c, acts, rest, out, nt),
                    (true, _) => run::<4, 5>(true, rows, c, acts, rest, out, nt),
                    (false, 1) => run::<4, 1>(false, rows, c, acts, rest, out, nt),
                    (false, _) => run::<2, 2>(false, rows, c, acts, rest, out, nt),
                }
            }

            /// `out[r * nt + t]` for the rows of `w` (`rb` bytes each) and the tokens of
            /// `acts`.
            pub(crate) fn rows(t: Avx2, w: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
                let nt = acts.len();
                if nt == 0 || rb == 0 {
                    return;
                }
                let rows: Vec<&[$elem]> = w
                    .chunks_exact(rb)
                    .map(|r| cast::<$elem>(r).expect("weight rows are whole elements"))
                    .collect();
                let nrows = rows.len();
                assert!(out.len() >= nrows * nt);
                let wide = t.avx512;
                let chunk = (CHUNK_BYTES / rb).max(8);
                for c0 in (0..nrows).step_by(chunk) {
                    run_chunk(wide, &rows, (c0, (c0 + chunk).min(nrows)), acts, out, nt);
                }
            }
        }
    };
}

/// Eight f32 at `p`.
///
/// # Safety
/// `p` points to 8 readable elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32x8(p: *const [u8; 4]) -> __m256 {
    // SAFETY: 32 readable bytes (the caller's contract); x86 is little-endian; unaligned.
    unsafe { _mm256_loadu_ps(p.cast()) }
}

/// Eight f16 at `p`, as f32.
///
/// # Safety
/// `p` points to 8 readable elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const [u8; 2]) -> __m256 {
    // SAFETY: 16 readable bytes (the caller's contract); unaligned.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// Eight bf16 at `p`, as f32 (the bf16 bits are the f32's upper half).
///
/// # Safety
/// `p` points to 8 readable elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16x8(p: *const [u8; 2]) -> __m256 {
    // SAFETY: 16 readable bytes (the caller's contract); unaligned.
    let v = unsafe { _mm_loadu_si128(p.cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

/// Sixteen f32 at `p`.
///
/// # Safety
/// `p` points to 16 readable elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn f32x16(p: *const [u8; 4]) -> __m512 {
    // SAFETY: 64 readable bytes (the caller's contract); unaligned.
    unsafe { _mm512_loadu_ps(p.cast()) }
}

/// Sixteen f16 at `p`, as f32.
///
/// # Safety
/// `p` points to 16 readable elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn f16x16(p: *const [u8; 2]) -> __m512 {
    // SAFETY: 32 readable bytes (the caller's contract); unaligned.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// Sixteen bf16 at `p`, as f32.
///
/// # Safety
/// `p` points to 16 readable elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn bf16x16(p: *const [u8; 2]) -> __m512 {
    // SAFETY: 32 readable bytes (the caller's contract); unaligned.
    let v = unsafe { _mm256_loadu_si256(p.cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

float_rows!(f32s, [u8; 4], f32x8, f32x16, f32::from_le_bytes);
float_rows!(f16s, [u8; 2], f16x8, f16x16, |b| half::f16::from_le_bytes(
    b
)
.to_f32());
float_rows!(bf16s, [u8; 2], bf16x8, bf16x16, |b| {
    half::bf16::from_le_bytes(b).to_f32()
});
