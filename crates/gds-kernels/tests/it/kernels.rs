//! Matmul kernels: SIMD against scalar twins, and matmul against dequantize + f32 product.

use gds_format::DType;
use gds_kernels::act::{q8_pairs, quantize_act_q8_scalar, quantize_act_q8k_scalar, ActQ8, ActQ8K};
use gds_kernels::{
    dequantize, matmul, matmul_many, matmul_with, quantize, Isa, KernelError, WeightView,
};

/// Deterministic xorshift generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const ALL: [DType; 25] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q2K,
    DType::Q3K,
    DType::Q8_1,
    DType::Q8K,
    DType::MXFP4,
    DType::Iq4Nl,
    DType::Iq4Xs,
    GRID_IQ[0],
    GRID_IQ[1],
    GRID_IQ[2],
    GRID_IQ[3],
    GRID_IQ[4],
    GRID_IQ[5],
    GRID_IQ[6],
];

/// llama.cpp's grid i-quants (256-blocks against Q8_K activations).
const GRID_IQ: [DType; 7] = gds_format::IQ_GRID_DTYPES;

fn f16b(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// A valid `rows x cols` weight of `dtype`: quantized from random floats where we have a
/// quantizer, else random quant bytes with small finite scales.
fn weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    if let Ok(q) = quantize(dtype, &rng.vec(rows * cols, 0.5)) {
        if dtype != DType::Q8K {
            return q;
        }
    }
    let ts = dtype.type_size();
    let mut data = rng.bytes(rows * cols / dtype.block_size() * ts);
    for b in data.chunks_exact_mut(ts) {
        let s1 = f16b(rng.f() * 0.01);
        let s2 = f16b(rng.f() * 0.01);
        match dtype {
            DType::Q2K => {
                b[80..82].copy_from_slice(&s1);
                b[82..84].copy_from_slice(&s2);
            }
            DType::Q3K | DType::Q6K => b[ts - 2..].copy_from_slice(&s1),
            DType::Q4K | DType::Q5K | DType::Q8_1 => {
                b[0..2].copy_from_slice(&s1);
                b[2..4].copy_from_slice(&s2);
            }
            DType::Q8K => b[0..4].copy_from_slice(&(rng.f() * 0.01).to_le_bytes()),
            // scales 2^-9 .. 2^-2 (E8M0 exponent byte 119..126), random nibbles
            DType::MXFP4 => b[0] = 119 + (rng.next() % 8) as u8,
            // random nibbles (and IQ4_XS's random 6-bit sub-block scales)
            DType::Iq4Nl | DType::Iq4Xs => b[0..2].copy_from_slice(&s1),
            // random grid indices, signs and sub-block scales
            DType::Iq2Xxs
            | DType::Iq2Xs
            | DType::Iq2S
            | DType::Iq3Xxs
            | DType::Iq3S
            | DType::Iq1S => b[0..2].copy_from_slice(&s1),
            // IQ1_M's f16 scale is the top nibbles of its four scale words (bytes 48..56)
            DType::Iq1M => {
                let bits = u16::from_le_bytes(s1);
                for i in 0..4 {
                    let hi = 49 + 2 * i;
                    b[hi] = (b[hi] & 0x0F) | ((((bits >> (4 * i)) & 0xF) as u8) << 4);
                }
            }
            _ => unreachable!("{dtype}"),
        }
    }
    data
}

/// Dequantize + plain f32 product, in f64 for a clean reference.
/// Returns (product, allowed error against it, sum of |w * x| per output).
fn reference(w: &WeightView<'_>, x: &[f32], n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut wf = vec![0f32; w.rows * w.cols];
    dequantize(w.dtype, w.data, &mut wf).unwrap();
    let mut y = vec![0f32; n * w.rows];
    let mut mag = vec![0f32; n * w.rows];
    let mut abs = vec![0f32; n * w.rows];
    for t in 0..n {
        let xt = &x[t * w.cols..(t + 1) * w.cols];
        for r in 0..w.rows {
            let wr = &wf[r * w.cols..(r + 1) * w.cols];
            y[t * w.rows + r] = wr
                .iter()
                .zip(xt)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32;
            // Worst-case error of 8-bit activation quantization: |w| * (block amax / 254).
            let bs = if matches!(
                w.dtype,
                DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K
            ) || GRID_IQ.contains(&w.dtype)
            {
                256
            } else {
                32
            };
            let quantized = !matches!(
                w.dtype,
                DType::F32 | DType::F16 | DType::BF16 | DType::Q8_1 | DType::Q8K
            );
            let mut m = 0f32;
            let mut total = 0f32;
            for (wb, xb) in wr.chunks(bs).zip(xt.chunks(bs)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                let sw: f32 = wb.iter().map(|v| v.abs()).sum();
                let sa: f32 = wb.iter().zip(xb).map(|(a, b)| (a * b).abs()).sum();
                total += sa;
                m += 1e-5 * sa
                    + if quantized {
                        sw * amax / 254.0 * 1.001
                    } else {
                        0.0
                    };
            }
            mag[t * w.rows + r] = m + 1e-6;
            abs[t * w.rows + r] = total;
        }
    }
    (y, mag, abs)
}

#[test]
fn matmul_matches_dequantized_f32_product() {
    let mut rng = Rng(0x9E3779B97F4A7C15);
    for dtype in ALL {
        for (rows, cols, n) in [(13, 512, 1), (40, 768, 3), (8, 256, 6), (37, 512, 9)] {
            // Odd block counts for the 32-block types (a half-empty last activation pair).
            let cols = if dtype.block_size() == 256 {
                cols
            } else {
                cols + 32
            };
            let data = weight(&mut rng, dtype, rows, cols);
            let w = WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype,
                data: &data,
                rows,
                cols,
            };
            let x = rng.vec(n * cols, 2.0);
            let (want, tol, _) = reference(&w, &x, n);
            for isa in [Isa::Scalar, Isa::Avx2]
                .into_iter()
                .filter(|i| i.available())
            {
                let mut y = vec![f32::NAN; n * rows];
                matmul_with(isa, &w, &x, n, &mut y).unwrap();
                for (i, ((g, e), t)) in y.iter().zip(&want).zip(&tol).enumerate() {
                    assert!(
                        (g - e).abs() <= *t,
                        "{dtype} {isa:?} {rows}x{cols} n={n} [{i}]: {g} vs {e} (tol {t})"
                    );
                }
            }
        }
    }
}

/// The largest products every kernel's integer sums meet: weights quantized from rows of one
/// magnitude (each 16-element group has one zero, so the types with mins keep a zero min and
/// every other quant at the top of its range; or one element per block of the other sign, for
/// the symmetric types) against activations of one magnitude (8-bit
/// quants at 127, or -128 for the K-quants' activations), each sign of each, in decode tiles
/// and in prompt batches (the rows-in-lanes paths): every ISA equals the scalar kernels, so no
/// 16-bit partial sum overflowed (Q5_K's summed over a whole sub-block would).
#[test]
fn extreme_quants_do_not_overflow_the_integer_sums() {
    let simd: Vec<Isa> = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni]
        .into_iter()
        .filter(|i| i.available())
        .collect();
    let (rows, cols) = (24, 512);
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ] {
        // one magnitude with a zero per 16 (the types with mins), or one element of the
        // opposite sign per 32 (the symmetric types then put the rest at the other end of
        // their range: Q4_0's 15, Q5_0's 31)
        for (ws, flip) in [(1.0f32, false), (-1.0, false), (1.0, true), (-1.0, true)] {
            let wf: Vec<f32> = (0..rows * cols)
                .map(|i| match (flip, i % 32, i % 16) {
                    (true, 0, _) => -ws,
                    (true, _, _) => ws * 0.9375,
                    (false, _, 0) => 0.0,
                    _ => ws,
                })
                .collect();
            let data = quantize(dtype, &wf).unwrap();
            let w = WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype,
                data: &data,
                rows,
                cols,
            };
            for xs in [1.0f32, -1.0] {
                for n in [1, 4, 37] {
                    let x = vec![xs; n * cols];
                    let mut want = vec![0f32; n * rows];
                    matmul_with(Isa::Scalar, &w, &x, n, &mut want).unwrap();
                    for &isa in &simd {
                        let mut y = vec![f32::NAN; n * rows];
                        matmul_with(isa, &w, &x, n, &mut y).unwrap();
                        for (i, (a, b)) in want.iter().zip(&y).enumerate() {
                            assert!(
                                (a - b).abs() <= 1e-5 * a.abs() + 1e-6,
                                "{dtype} w={ws} flip={flip} x={xs} n={n} [{i}]: scalar {a} vs {} {b}",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// MXFP4 at the ends of its range: every nibble the value 12 or -12 (the largest the
/// unsigned-by-signed dot products meet, as 28 and 4 after the +16), against activations of
/// one magnitude, both signs; scale bytes 0 and 1 (subnormal 2^-128, 2^-127), 127 and 200.
/// Every ISA's kernel equals the others bit for bit and the scalar kernel to float rounding
/// (the same integer sums, another summation order), and the scalar kernel the exact product.
#[test]
fn mxfp4_extremes_match_exactly() {
    let (rows, cols) = (8, 96);
    for nib in [0x77u8, 0xFF, 0x7F] {
        for e in [0u8, 1, 127, 200] {
            let mut data = vec![0u8; rows * cols / 32 * 17];
            for b in data.chunks_exact_mut(17) {
                b[0] = e;
                b[1..].fill(nib);
            }
            let w = WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::MXFP4,
                data: &data,
                rows,
                cols,
            };
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; 3 * cols];
                let mut want = vec![0f32; 3 * rows];
                matmul_with(Isa::Scalar, &w, &x, 3, &mut want).unwrap();
                // (lo, hi) nibble values; activations quantize exactly to ±127 · (1/127)
                let kv = |n: u8| {
                    [
                        0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.,
                    ][n as usize]
                };
                let d = gds_kernels::blocks::e8m0_half(e) as f64;
                let exact =
                    (kv(nib & 15) + kv(nib >> 4)) * 16.0 * (cols / 32) as f64 * d * sign as f64;
                for v in &want {
                    assert!(
                        ((*v as f64) - exact).abs() <= 1e-5 * exact.abs(),
                        "nib {nib:#x} e {e}: {v} vs {exact}"
                    );
                }
                let mut first: Option<Vec<f32>> = None;
                for isa in [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
                    if !isa.available() {
                        continue;
                    }
                    let mut y = vec![0f32; 3 * rows];
                    matmul_with(isa, &w, &x, 3, &mut y).unwrap();
                    for (a, b) in y.iter().zip(&want) {
                        assert!(
                            // (f32 subnormals at e = 0: each lane's product rounds apart)
                            (a - b).abs() <= 1e-6 * b.abs() + 1e-37,
                            "nib {nib:#x} e {e} {}: {a} vs {b}",
                            isa.name()
                        );
                    }
                    match &first {
                        None => first = Some(y),
                        Some(v) => assert_eq!(v, &y, "nib {nib:#x} e {e} {}", isa.name()),
                    }
                }
            }
        }
    }
}

#[test]
fn simd_agrees_with_scalar() {
    let simd: Vec<Isa> = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni]
        .into_iter()
        .filter(|i| i.available())
        .collect();
    if simd.is_empty() {
        eprintln!("AVX2 not available; nothing to compare");
        return;
    }
    eprintln!("comparing {:?} with the scalar kernels", simd);
    let mut rng = Rng(7);
    for dtype in ALL {
        // both sides of the repacking thresholds (Q4K_LANES_MIN 6; Q5K_LANES_MIN: AVX2 4,
        // AVX-512 6; Q6K_LANES_MIN 9; Q80_LANES_MIN: AVX2 18, VNNI 10; Q50_LANES_MIN: 5,
        // AVX-512 8; Q41_LANES_MIN: 6, 8, 9), and 13 with a last tile of one token
        for n in [1, 2, 3, 4, 5, 6, 8, 9, 11, 13, 19] {
            let extra = match dtype.block_size() {
                1 => 13,
                32 => 32,
                _ => 0,
            };
            // an odd row count: the two-row tiles end on a single row
            let (rows, cols) = (25, 1024 + extra);
            let data = weight(&mut rng, dtype, rows, cols);
            let w = WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype,
                data: &data,
                rows,
                cols,
            };
            let x = rng.vec(n * cols, 3.0);
            let mut ys = vec![0f32; n * rows];
            matmul_with(Isa::Scalar, &w, &x, n, &mut ys).unwrap();
            let (_, _, abs) = reference(&w, &x, n);
            let mut first: Option<Vec<f32>> = None;
            for &isa in &simd {
                let mut yv = vec![0f32; n * rows];
                matmul_with(isa, &w, &x, n, &mut yv).unwrap();
                for (i, (a, b)) in ys.iter().zip(&yv).enumerate() {
                    // Same integer sums (and bit-identical activation quants), different
                    // float summation order: agree to 1e-5 of the summed term magnitudes.
                    let t = 1e-5 * abs[i] + 1e-6;
                    assert!(
                        (a - b).abs() <= t,
                        "{dtype} n={n} [{i}]: scalar {a} vs {} {b} (tol {t})",
                        isa.name()
                    );
                }
                // every instruction set's kernels, one row or two at a time, `maddubs` or
                // `vpdpbusd` in either encoding: the same arithmetic, bit for bit
                match &first {
                    None => first = Some(yv),
                    Some(v) => assert!(v == &yv, "{dtype} n={n}: {} differs", isa.name()),
                }
            }
        }
    }
}

#[test]
fn multi_token_tiles_equal_single_token_runs() {
    // A token's result must not depend on which tile of four it landed in, nor on whether
    // its tile ran against rows unpacked as they go (fewer than eight tokens, and the last
    // partial tile) or unpacked once for all tiles (9 tokens; an odd row count ends the
    // two-row groups on a single row), nor on where in the 16 x 16 blocks that scatter a
    // task's rows to the token-major output (300 rows: several tasks, none a multiple of
    // 16; 37 tokens).
    let mut rng = Rng(99);
    for (dtype, (rows, n)) in ALL
        .into_iter()
        .flat_map(|d| [(d, (20, 7)), (d, (21, 9))])
        .chain([
            (DType::Q8_0, (300, 37)),
            (DType::Q4_1, (72, 37)),
            (DType::Q5_0, (300, 37)),
            // rows in the vector lanes: groups of 8 and 16 rows, chunks of 144 rows at 512
            // columns, a last group of 12 rows
            (DType::Q4_0, (300, 37)),
            (DType::Q4K, (300, 37)),
            (DType::Q6K, (300, 37)),
            // IQ4_NL on the Q8_0 kernels (looked up), IQ4_XS on them as its sub-blocks
            (DType::Iq4Nl, (300, 37)),
            (DType::Iq4Xs, (300, 37)),
        ])
    {
        let cols = if dtype.block_size() == 256 { 512 } else { 544 };
        let data = weight(&mut rng, dtype, rows, cols);
        let w = WeightView {
            layout: gds_kernels::Layout::Rows,
            dtype,
            data: &data,
            rows,
            cols,
        };
        let x = rng.vec(n * cols, 1.0);
        let mut all = vec![0f32; n * rows];
        matmul(&w, &x, n, &mut all).unwrap();
        for t in 0..n {
            let mut one = vec![0f32; rows];
            matmul(&w, &x[t * cols..(t + 1) * cols], 1, &mut one).unwrap();
            assert_eq!(
                &all[t * rows..(t + 1) * rows],
                &one[..],
                "{dtype} token {t}"
            );
        }
    }
}

#[test]
fn activation_quantizers_are_bit_identical() {
    let mut rng = Rng(5);
    let mut x = rng.vec(256 * 6, 10.0);
    x[..256].fill(0.0); // zero block
    x[256..512]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i as f32 - 128.0) * 0.5); // ties
                                                           // 48 blocks as rows of 13 blocks (odd, so the last pair of a row is half empty) + rest.
    let rows: Vec<&[f32]> = vec![&x[..416], &x[416..832], &x[832..1248], &x[1248..]];
    let quant_rows = |f: &dyn Fn(&[f32], &mut [ActQ8])| -> Vec<ActQ8> {
        rows.iter()
            .flat_map(|r| {
                let mut o = vec![ActQ8::default(); q8_pairs(r.len())];
                f(r, &mut o);
                o
            })
            .collect()
    };
    let s8 = quant_rows(&quantize_act_q8_scalar);
    let mut sk = vec![ActQ8K::default(); x.len() / 256];
    quantize_act_q8k_scalar(&x, &mut sk);
    let mut pairs = s8.iter();
    for r in &rows {
        let row_pairs: Vec<&ActQ8> = pairs.by_ref().take(q8_pairs(r.len())).collect();
        for (i, xs) in r.chunks(32).enumerate() {
            let (q, d, s) = row_pairs[i / 2].block(i % 2);
            for (q, v) in q.iter().zip(xs) {
                assert!((*q as f32 * d - v).abs() <= d * 0.5 + 1e-6);
            }
            assert_eq!(s, d * q.iter().map(|&v| v as i32).sum::<i32>() as f32);
        }
        if (r.len() / 32) % 2 == 1 {
            assert_eq!(row_pairs.last().unwrap().block(1), ([0; 32], 0.0, 0.0));
        }
    }
    for b in &sk {
        for j in 0..16 {
            assert_eq!(
                b.bsums[j] as i32,
                b.qs[16 * j..16 * j + 16]
                    .iter()
                    .map(|&q| q as i32)
                    .sum::<i32>()
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = gds_kernels::avx2::Avx2::detect() {
        let v8 = quant_rows(&|x, o| gds_kernels::avx2::quantize_act_q8(t, x, o));
        assert_eq!(s8, v8);
        let mut vk = vec![ActQ8K::default(); sk.len()];
        gds_kernels::avx2::quantize_act_q8k(t, &x, &mut vk);
        assert_eq!(sk, vk);
    }
}

#[test]
fn matmul_many_equals_separate_matmuls() {
    let mut rng = Rng(11);
    let cols = 512;
    for n in [1, 5] {
        let specs = [
            (DType::Q4_1, 64),
            (DType::Q8_0, 16),
            (DType::Q6K, 24),
            (DType::F16, 8),
        ];
        let datas: Vec<Vec<u8>> = specs
            .iter()
            .map(|&(d, r)| weight(&mut rng, d, r, cols))
            .collect();
        let ws: Vec<WeightView<'_>> = specs
            .iter()
            .zip(&datas)
            .map(|(&(dtype, rows), data)| WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype,
                data,
                rows,
                cols,
            })
            .collect();
        let x = rng.vec(n * cols, 1.0);
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; n * w.rows]).collect();
        let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
        matmul_many(&ws, &x, n, &mut refs).unwrap();
        for (w, got) in ws.iter().zip(&outs) {
            let mut want = vec![0f32; n * w.rows];
            matmul(w, &x, n, &mut want).unwrap();
            assert_eq!(got, &want, "{}", w.dtype);
        }
    }
}

#[test]
fn matmul_rejects_bad_shapes() {
    let data = vec![0u8; 4 * 18];
    let w = WeightView {
        layout: gds_kernels::Layout::Rows,
        dtype: DType::Q4_0,
        data: &data,
        rows: 4,
        cols: 32,
    };
    let mut y = vec![0f32; 4];
    assert!(matches!(
        matmul(&w, &[0f32; 31], 1, &mut y),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        matmul(&w, &[0f32; 32], 1, &mut y[..3]),
        Err(KernelError::Shape(_))
    ));
    let short = WeightView {
        layout: gds_kernels::Layout::Rows,
        data: &data[..70],
        ..w
    };
    assert!(matches!(
        matmul(&short, &[0f32; 32], 1, &mut y),
        Err(KernelError::Shape(_))
    ));
    let i32w = WeightView {
        layout: gds_kernels::Layout::Rows,
        dtype: DType::I32,
        data: &[0u8; 16],
        rows: 1,
        cols: 4,
    };
    assert!(matches!(
        matmul(&i32w, &[0f32; 4], 1, &mut y[..1]),
        Err(KernelError::Unsupported { op: "matmul", .. })
    ));
    // Zero tokens or zero rows are no-ops.
    matmul(&w, &[], 0, &mut []).unwrap();
    let empty = WeightView {
        layout: gds_kernels::Layout::Rows,
        data: &[],
        rows: 0,
        ..w
    };
    matmul(&empty, &[0f32; 64], 2, &mut []).unwrap();
}

#[cfg(target_arch = "x86_64")]
#[test]
fn q4_0_four_row_kernel_matches_scalar_across_chunks_and_tiles() {
    // The AVX2 Q4_0 rows kernel called directly on one long task: four rows at a time with a
    // last group of three (203 rows), an odd block count (33: a half-empty last pair), and
    // prompt batches (5 and 13 tokens) that run their tiles against chunks of ~28 rows, and
    // 33 tokens, which every token runs through the rows-in-lanes kernel (groups of 8 or 16
    // rows, a partial last group, the odd block's zero term). It must agree with the scalar
    // kernel and the row-at-a-time kernel to float summation order, and give each token what
    // it gives that token alone, bit for bit.
    use gds_kernels::avx2::Avx2;
    // every token the CPU allows: the four-row kernel runs with each, against the
    // row-at-a-time kernel of that feature set (vpdpbusd with the VNNI ones)
    let tokens: Vec<Avx2> = [Avx2::detect(), Avx2::detect_vnni(), Avx2::detect_avx512()]
        .into_iter()
        .flatten()
        .collect();
    if tokens.is_empty() {
        eprintln!("AVX2 not available; nothing to compare");
        return;
    }
    for t in tokens {
        four_rows_against_by_row(t);
    }
}

fn four_rows_against_by_row(t: gds_kernels::avx2::Avx2) {
    use gds_kernels::avx2;
    let mut rng = Rng(0x51);
    let (rows, cols) = (203, 33 * 32);
    let data = weight(&mut rng, DType::Q4_0, rows, cols);
    let rb = data.len() / rows;
    let w = WeightView {
        layout: gds_kernels::Layout::Rows,
        dtype: DType::Q4_0,
        data: &data,
        rows,
        cols,
    };
    for n in [1, 2, 3, 4, 5, 13, 33] {
        let x = rng.vec(n * cols, 2.0);
        let per = q8_pairs(cols);
        let mut q = vec![ActQ8::default(); n * per];
        for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
            quantize_act_q8_scalar(xr, qr);
        }
        let acts: Vec<&[ActQ8]> = q.chunks(per).collect();
        let (mut quad, mut by_row, mut scalar) = (
            vec![f32::NAN; rows * n],
            vec![f32::NAN; rows * n],
            vec![f32::NAN; rows * n],
        );
        avx2::rows_q4_0(t, &data, rb, &acts, &mut quad);
        avx2::rows_q4_0_by_row(t, &data, rb, &acts, &mut by_row);
        gds_kernels::scalar::rows_q4_0(&data, rb, &acts, &mut scalar);
        let (_, _, abs) = reference(&w, &x, n);
        for k in 0..n {
            let mut alone = vec![f32::NAN; rows];
            avx2::rows_q4_0(t, &data, rb, &[acts[k]], &mut alone);
            for r in 0..rows {
                let (a, b, c) = (quad[r * n + k], by_row[r * n + k], scalar[r * n + k]);
                let tol = 1e-5 * abs[k * rows + r] + 1e-6;
                assert!(
                    (a - c).abs() <= tol && (a - b).abs() <= tol,
                    "n={n} row {r} token {k}: four-row {a}, by-row {b}, scalar {c} (tol {tol})"
                );
                assert_eq!(alone[r].to_bits(), a.to_bits(), "n={n} row {r} token {k}");
            }
        }
    }
}

/// Q2_K and Q3_K (ggml's vec_dot over 8-bit activations since 2026-12-06; prompt batches
/// repacked a row per vector lane since the same day): the AVX2 and AVX-512 kernels give the
/// scalar kernels' bits (the same exact integer sums, the same float expression), for
/// quantized weights and for random quant bytes (every scale, min and high-bit pattern),
/// activations up to the full 8-bit range, 1 to 17 tokens (the stored-row kernels' tiles of
/// four and their rest, the repacked kernels' from 5 (Q3_K) and 9 (Q2_K) tokens on), 7 rows
/// (a part of a group of eight) and 203 (groups of eight and sixteen, a last part group,
/// several chunks of repacked rows).
#[cfg(target_arch = "x86_64")]
#[test]
fn q2_k_and_q3_k_simd_equal_scalar_bit_for_bit() {
    use gds_kernels::avx2::{self, Avx2};
    let isas: Vec<Avx2> = [Avx2::detect(), Avx2::detect_avx512()]
        .into_iter()
        .flatten()
        .collect();
    if isas.is_empty() {
        eprintln!("AVX2 not available; nothing to compare");
        return;
    }
    type Rows = fn(Avx2, &[u8], usize, &[&[ActQ8K]], &mut [f32]);
    type Scalar = fn(&[u8], usize, &[&[ActQ8K]], &mut [f32]);
    let kernels: [(DType, Rows, Scalar); 2] = [
        (DType::Q2K, avx2::rows_q2_k, gds_kernels::scalar::rows_q2_k),
        (DType::Q3K, avx2::rows_q3_k, gds_kernels::scalar::rows_q3_k),
    ];
    let mut rng = Rng(0x23);
    for (dtype, simd, scalar) in kernels {
        for rows in [7, 203] {
            let cols = 768;
            let quantized = weight(&mut rng, dtype, rows, cols);
            let mut random = rng.bytes(quantized.len());
            for b in random.chunks_exact_mut(dtype.type_size()) {
                // finite super-block scales (the quant bytes stay random)
                let ts = b.len();
                b[ts - 2..].copy_from_slice(&f16b(rng.f() * 0.01));
                if dtype == DType::Q2K {
                    b[ts - 4..ts - 2].copy_from_slice(&f16b(rng.f() * 0.01));
                }
            }
            for data in [quantized, random] {
                let rb = data.len() / rows;
                for n in [1, 2, 3, 4, 5, 8, 9, 13, 17] {
                    let x = rng.vec(n * cols, 3.0);
                    let per = cols / 256;
                    let mut q = vec![ActQ8K::default(); n * per];
                    for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
                        quantize_act_q8k_scalar(xr, qr);
                    }
                    let acts: Vec<&[ActQ8K]> = q.chunks(per).collect();
                    let mut want = vec![f32::NAN; rows * n];
                    scalar(&data, rb, &acts, &mut want);
                    for &t in &isas {
                        let mut got = vec![f32::NAN; rows * n];
                        simd(t, &data, rb, &acts, &mut got);
                        for (i, (u, v)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                u.to_bits(),
                                v.to_bits(),
                                "{dtype} {t:?} rows={rows} n={n} [{i}]: {u} vs {v}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Float weights (F32, F16, BF16) through the tiles of rows and tokens, on one long task as
/// the matmul driver hands it over: every token count up to two whole AVX-512 tiles and past
/// them (each remainder shape of both instruction sets), rows in chunks (9 000 columns of
/// F32: a chunk of eight rows) with short last tiles of rows, columns that end on a last
/// eight and then single elements (16 k + 8 + 5), give the row-at-a-time kernel's bits, on
/// plain AVX2 and AVX-512 alike, and each token what it gives alone.
#[cfg(target_arch = "x86_64")]
#[test]
fn float_tiles_equal_the_row_at_a_time_kernel() {
    use gds_kernels::avx2::{self, Avx2};
    let tokens: Vec<Avx2> = [Avx2::detect(), Avx2::detect_avx512()]
        .into_iter()
        .flatten()
        .collect();
    if tokens.is_empty() {
        eprintln!("AVX2 not available; nothing to compare");
        return;
    }
    type Rows = fn(Avx2, &[u8], usize, &[&[f32]], &mut [f32]);
    let kernels: [(DType, Rows, Rows); 3] = [
        (DType::F32, avx2::rows_f32, avx2::rows_f32_by_row),
        (DType::F16, avx2::rows_f16, avx2::rows_f16_by_row),
        (DType::BF16, avx2::rows_bf16, avx2::rows_bf16_by_row),
    ];
    let mut rng = Rng(0xf1);
    for (dtype, tiles, by_row) in kernels {
        for (rows, cols) in [(23, 16 * 40 + 8 + 5), (19, 9000), (5, 7)] {
            let data = weight(&mut rng, dtype, rows, cols);
            let rb = data.len() / rows;
            for n in [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 17] {
                let x = rng.vec(n * cols, 2.0);
                let acts: Vec<&[f32]> = x.chunks(cols).collect();
                let mut want = vec![f32::NAN; rows * n];
                by_row(tokens[0], &data, rb, &acts, &mut want);
                for &t in &tokens {
                    let mut got = vec![f32::NAN; rows * n];
                    tiles(t, &data, rb, &acts, &mut got);
                    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{dtype} {rows}x{cols} n={n} row {} token {}: {a} vs {b} ({t:?})",
                            i / n,
                            i % n
                        );
                    }
                    let mut alone = vec![f32::NAN; rows];
                    tiles(t, &data, rb, &acts[n - 1..], &mut alone);
                    for r in 0..rows {
                        assert_eq!(alone[r].to_bits(), got[r * n + n - 1].to_bits());
                    }
                }
            }
        }
    }
}

/// Q4_0, Q4_K and Q6_K rows interleaved sixteen at a time give the bits of the same rows in file
/// order, on every instruction set (AVX-512 reads the layout directly; the others put each
/// group back into rows), for decode tiles (1 to 4 tokens; the K-quants' 5 to 8 in two) and
/// prompt batches (the chunked driver: wide rows make chunks of several groups, 96 rows
/// span chunks), with an odd block count (Q4_0's 544 columns: the odd blocks' accumulator
/// ends on a zero term), and through several threads' shares of the rows (multiples of 16).
#[test]
fn interleaved_rows_equal_rows_in_file_order() {
    let mut rng = Rng(0x5EED_0016);
    for (dtype, rows, cols) in [
        (DType::Q4_0, 16, 32),
        (DType::Q4_0, 48, 544),
        (DType::Q4_0, 96, 1024),
        (DType::Q4_0, 320, 4096),
        (DType::Q4K, 16, 256),
        (DType::Q4K, 48, 768),
        (DType::Q4K, 96, 2048),
        (DType::Q4K, 320, 4096),
        (DType::Q8_0, 16, 32),
        (DType::Q8_0, 48, 544),
        (DType::Q8_0, 96, 1024),
        (DType::Q4_1, 16, 32),
        (DType::Q4_1, 48, 544),
        (DType::Q5_0, 16, 32),
        (DType::Q5_0, 48, 544),
        (DType::Q5_0, 96, 1024),
        (DType::Q5_1, 16, 64),
        (DType::Q5_1, 48, 544),
        (DType::Q5K, 16, 256),
        (DType::Q5K, 48, 768),
        (DType::Q5K, 96, 2048),
        (DType::Q5K, 320, 4096),
        (DType::Q6K, 16, 256),
        (DType::Q6K, 48, 768),
        (DType::Q6K, 96, 2048),
        (DType::Q6K, 320, 4096),
        (DType::MXFP4, 16, 32),
        (DType::MXFP4, 48, 544),
        (DType::MXFP4, 96, 1024),
        (DType::MXFP4, 320, 2880),
        (DType::Iq4Nl, 16, 32),
        (DType::Iq4Nl, 48, 544),
        (DType::Iq4Nl, 96, 1024),
        (DType::Iq4Xs, 16, 256),
        (DType::Iq4Xs, 48, 768),
        (DType::Iq4Xs, 96, 2048),
        (DType::Iq4Xs, 320, 4096),
    ] {
        let data = weight(&mut rng, dtype, rows, cols);
        let mut packed = data.clone();
        gds_kernels::interleave(dtype, &mut packed, rows, cols).unwrap();
        let view = |data, layout| WeightView {
            layout,
            dtype,
            data,
            rows,
            cols,
        };
        let (plain, x16) = (
            view(&data, gds_kernels::Layout::Rows),
            view(&packed, gds_kernels::Layout::Interleaved16),
        );
        for n in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13] {
            let x = rng.vec(n * cols, 1.0);
            for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                let (mut want, mut got) = (vec![0f32; n * rows], vec![f32::NAN; n * rows]);
                matmul_with(isa, &plain, &x, n, &mut want).unwrap();
                matmul_with(isa, &x16, &x, n, &mut got).unwrap();
                assert_eq!(got, want, "{dtype} {isa:?} {rows}x{cols} n={n}");
            }
            // f32 activations too (the dequantizing path, groups put back into rows)
            let (mut want, mut got) = (vec![0f32; n * rows], vec![f32::NAN; n * rows]);
            gds_kernels::matmul_many_f32_act(&[plain], &x, n, &mut [&mut want]).unwrap();
            gds_kernels::matmul_many_f32_act(&[x16], &x, n, &mut [&mut got]).unwrap();
            assert_eq!(got, want, "{dtype} f32 activations {rows}x{cols} n={n}");
        }
    }
    // the layout is the 32-element types' (but Q8_1), Q4_K's, Q5_K's and Q6_K's, in whole
    // groups
    let data = weight(&mut rng, DType::Q3K, 16, 256);
    let bad = WeightView {
        layout: gds_kernels::Layout::Interleaved16,
        dtype: DType::Q3K,
        data: &data,
        rows: 16,
        cols: 256,
    };
    let mut y = vec![0f32; 16];
    assert!(matmul(&bad, &[0.5; 256], 1, &mut y).is_err());
    let data = weight(&mut rng, DType::Q4_0, 8, 32);
    let bad = WeightView {
        layout: gds_kernels::Layout::Interleaved16,
        dtype: DType::Q4_0,
        data: &data,
        rows: 8,
        cols: 32,
    };
    assert!(matmul(&bad, &[0.5; 32], 1, &mut y[..8]).is_err());
}

/// The grid i-quants' SIMD kernels give the scalar kernels' bits (the same exact integer sum
/// per block, the same float expression), on every ISA: decode a row at a time (1..=3
/// tokens), prompt batches repacked into vector lanes (4 tokens and more: tiles of four and
/// their remainders; 7 rows, a part group, and 203 rows, several repacked chunks); random
/// blocks (every grid row, sign pattern and scale drawn) and activations of one magnitude
/// (the largest integer sums: 127 against every value).
#[test]
fn grid_iquants_simd_equal_scalar_bit_for_bit() {
    let simd: Vec<Isa> = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni]
        .into_iter()
        .filter(|i| i.available())
        .collect();
    let mut rng = Rng(0x1d2c_3b4a);
    for (dtype, (rows, cols)) in GRID_IQ
        .into_iter()
        .flat_map(|d| [(d, (7, 768)), (d, (203, 512))])
    {
        let data = weight(&mut rng, dtype, rows, cols);
        let w = WeightView {
            layout: gds_kernels::Layout::Rows,
            dtype,
            data: &data,
            rows,
            cols,
        };
        for n in [1, 2, 3, 4, 5, 9, 17] {
            for x in [
                rng.vec(n * cols, 2.0),
                vec![1.0; n * cols],
                vec![-1.0; n * cols],
            ] {
                let mut want = vec![0f32; n * rows];
                matmul_with(Isa::Scalar, &w, &x, n, &mut want).unwrap();
                assert!(want.iter().all(|v| v.is_finite()), "{dtype}");
                for &isa in &simd {
                    let mut y = vec![f32::NAN; n * rows];
                    matmul_with(isa, &w, &x, n, &mut y).unwrap();
                    let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype} n={n} {}: {y:?} vs scalar {want:?}",
                        isa.name()
                    );
                }
            }
        }
    }
}
