//! The CUDA kernels' arithmetic, checked on the CPU: kernels/*.cu are compiled as C++ with
//! kernels/emu.h (grid and block loops, one fiber per CUDA thread, real barriers),
//! launched with the executor's grid/block shapes, and compared with `gds-kernels` (weights)
//! and f64 references of the CPU backend's formulas (norm, RoPE, attention, SwiGLU).

use crate::common::{sym, AttnFn, KvStoreFn, MatvecQ8Fn, PairFn, QuantizeQ8Fn, RopeFn, ScaleFn};
use gds_cuda::kernels::{q8_kernel_suffix, Q8A_BYTES, Q8A_VALUES};
use gds_format::DType;

type MatvecFn = unsafe extern "C" fn(*const u8, *const f32, *mut f32, i32, i32, i32);
type DequantFn = unsafe extern "C" fn(*const u8, *mut f32, i32);

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    values(n, seed)
        .iter()
        .map(|v| ((v + 1.0) * 127.9) as u8)
        .collect()
}

/// A `rows × cols` weight of `dtype`: quantized from random values where gds-kernels has a
/// quantizer, otherwise random block bytes with small, finite f16 scales.
fn weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    if let Ok(w) = gds_kernels::quantize(dtype, &values(rows * cols, seed)) {
        return w;
    }
    let nb = rows * cols / dtype.block_size();
    let size = dtype.type_size();
    let mut w = bytes(nb * size, seed);
    let d = half::f16::from_f32(0.01).to_le_bytes();
    let dmin = half::f16::from_f32(0.003).to_le_bytes();
    for b in w.chunks_exact_mut(size) {
        match dtype {
            DType::Q4K | DType::Q5K => {
                b[0..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&dmin);
            }
            DType::Q6K => b[208..210].copy_from_slice(&d),
            // random nibbles (and IQ4_XS's random 6-bit sub-block scales)
            DType::Iq4Nl | DType::Iq4Xs => b[0..2].copy_from_slice(&d),
            other => panic!("no generator for {other}"),
        }
    }
    w
}

fn dequant_ref(dtype: DType, w: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    gds_kernels::dequantize(dtype, w, &mut out).unwrap();
    out
}

const MATVEC_DTYPES: &[(DType, &str)] = &[
    (DType::Q4_0, "q4_0"),
    (DType::Q4_1, "q4_1"),
    (DType::Q5_0, "q5_0"),
    (DType::Q5_1, "q5_1"),
    (DType::Q8_0, "q8_0"),
    (DType::Q4K, "q4_k"),
    (DType::Q5K, "q5_k"),
    (DType::Q6K, "q6_k"),
    (DType::MXFP4, "mxfp4"),
    (DType::Iq4Nl, "iq4_nl"),
    (DType::Iq4Xs, "iq4_xs"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
    (DType::F32, "f32"),
];

#[test]
fn matvec_kernels_match_the_dequantized_product_for_every_gpu_dtype() {
    // 37 rows: not a multiple of the 4 rows per block, so the tail block is exercised.
    // 768 columns: three Q4_K/Q6_K super-blocks, 24 Q4_0 blocks (fewer than the 32 lanes).
    // 11 tokens: a chunk of MATVEC_TOKENS (8) carried at once, and a partial one.
    // 771 columns (float types only): rows that are not whole 8-byte words, element by element.
    let (rows, ntok) = (37usize, 11usize);
    let cases = MATVEC_DTYPES.iter().map(|&d| (d, 768usize)).chain(
        MATVEC_DTYPES
            .iter()
            .filter(|(d, _)| d.block_size() == 1)
            .map(|&d| (d, 771)),
    );
    for (i, ((dtype, name), cols)) in cases.enumerate() {
        assert_eq!(
            gds_cuda::kernels::kernel_suffix(dtype),
            Some(name),
            "kernel name of {dtype}"
        );
        let w = weight(dtype, rows, cols, 100 + i as u64);
        let wf = dequant_ref(dtype, &w, rows * cols);
        let x = values(ntok * cols, 7 + i as u64);
        let mut y = vec![f32::NAN; ntok * rows];
        let f = sym::<MatvecFn>(&format!("run_matvec_{name}"));
        // SAFETY: w, x and y hold rows*cols elements of dtype, ntok*cols and ntok*rows f32.
        unsafe {
            f(
                w.as_ptr(),
                x.as_ptr(),
                y.as_mut_ptr(),
                rows as i32,
                cols as i32,
                ntok as i32,
            )
        };
        for t in 0..ntok {
            for r in 0..rows {
                let (mut exact, mut mag) = (0f64, 0f64);
                for k in 0..cols {
                    let p = wf[r * cols + k] as f64 * x[t * cols + k] as f64;
                    exact += p;
                    mag += p.abs();
                }
                let got = y[t * rows + r] as f64;
                assert!(
                    (got - exact).abs() <= 1e-5 * mag + 1e-6,
                    "{dtype} token {t} row {r}: kernel {got}, reference {exact} (sum |w x| {mag})"
                );
            }
        }
    }
}

/// `x` (rows of a multiple of 32 values) through the `quantize_q8` kernel: the blocks'
/// bytes, in u32 words (the kernels load them as aligned words).
fn quantize_q8(x: &[f32]) -> Vec<u32> {
    let nblocks = x.len() / Q8A_VALUES;
    let mut xq = vec![0u32; nblocks * Q8A_BYTES / 4];
    // SAFETY: x holds nblocks blocks of 32 f32, xq nblocks * Q8A_BYTES bytes.
    unsafe {
        sym::<QuantizeQ8Fn>("run_quantize_q8")(
            x.as_ptr(),
            xq.as_mut_ptr() as *mut u8,
            nblocks as i32,
        )
    };
    xq
}

/// Block `k` of a `quantize_q8` buffer: its quants, d and d * sum(q).
fn q8_block(xq: &[u32], k: usize) -> ([i8; 32], f32, f32) {
    let w = &xq[k * Q8A_BYTES / 4..(k + 1) * Q8A_BYTES / 4];
    let mut q = [0i8; 32];
    for (i, v) in q.iter_mut().enumerate() {
        *v = (w[2 + i / 4] >> (8 * (i % 4))) as u8 as i8;
    }
    (q, f32::from_bits(w[0]), f32::from_bits(w[1]))
}

/// The CPU's 8-bit activations of `x` (rows of `cols`), each block as (quants, d, d * sum),
/// from gds-kernels' reference quantizer (what its int8 products use for 32-value types).
fn cpu_q8(x: &[f32], cols: usize) -> Vec<([i8; 32], f32, f32)> {
    use gds_kernels::act::{q8_pairs, quantize_act_q8_scalar, ActQ8};
    let mut out = Vec::new();
    for row in x.chunks_exact(cols) {
        let mut pairs = vec![ActQ8::default(); q8_pairs(cols)];
        quantize_act_q8_scalar(row, &mut pairs);
        out.extend((0..cols / 32).map(|k| pairs[k / 2].block(k % 2)));
    }
    out
}

/// Rows of `cols` whose 32-value blocks have scales from 1e-3 to 1e2 (values in
/// [-scale, scale)), so each block's quantization step differs.
fn act_rows(ntok: usize, cols: usize, seed: u64) -> Vec<f32> {
    let scales = [1.0f32, 1e-3, 37.0, 0.25, 100.0, 3.0];
    values(ntok * cols, seed)
        .iter()
        .enumerate()
        .map(|(i, v)| v * scales[(i / 32) % scales.len()])
        .collect()
}

#[test]
fn quantize_q8_gives_the_cpu_activation_quants_bit_for_bit() {
    let cols = 320;
    let mut x = act_rows(3, cols, 5);
    // a zero block (d = 0, no division by zero), and ties: amax 127 gives d = 1, so
    // 0.5, 1.5, 2.5, -0.5, -2.5 round to even: 0, 2, 2, 0, -2
    x[64..96].fill(0.0);
    x[96..128].fill(0.0);
    x[96..102].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5, -2.5]);
    let xq = quantize_q8(&x);
    let cpu = cpu_q8(&x, cols);
    assert_eq!(xq.len(), cpu.len() * Q8A_BYTES / 4);
    for (k, want) in cpu.iter().enumerate() {
        let (q, d, s) = q8_block(&xq, k);
        assert_eq!(q, want.0, "block {k}: quants");
        assert_eq!(
            d.to_bits(),
            want.1.to_bits(),
            "block {k}: d {d} vs {}",
            want.1
        );
        assert_eq!(
            s.to_bits(),
            want.2.to_bits(),
            "block {k}: s {s} vs {}",
            want.2
        );
    }
    assert_eq!(q8_block(&xq, 2).1, 0.0);
    assert_eq!(&q8_block(&xq, 3).0[..6], &[127, 0, 2, 2, 0, -2]);
}

/// The int8 kernels and their test shapes: columns that are not a multiple of 256 (nor of
/// the 32 lanes' parts) where the type allows.
const Q8_CASES: &[(DType, &str, &[usize])] = &[
    (DType::Q4_0, "q4_0", &[96, 160, 800]),
    (DType::Q4_1, "q4_1", &[96, 160, 800]),
    (DType::Q5_0, "q5_0", &[96, 160, 800]),
    (DType::Q5_1, "q5_1", &[96, 160, 800]),
    (DType::Q8_0, "q8_0", &[96, 160, 800]),
    (DType::Q4K, "q4_k", &[256, 768]),
    (DType::Q5K, "q5_k", &[256, 768]),
    (DType::Q6K, "q6_k", &[256, 768]),
    (DType::MXFP4, "mxfp4", &[96, 160, 800]),
    (DType::Iq4Nl, "iq4_nl", &[96, 160, 800]),
    (DType::Iq4Xs, "iq4_xs", &[256, 768]),
];

#[test]
fn int8_matvec_kernels_match_the_product_within_the_activation_rounding() {
    check_int8_matvecs(crate::common::lib(), "4x2");
}

/// The int8 kernels at the other block shapes `GDS_CUDA_MMQ8` may compile them for (one
/// row a block, four rows of two warps): the same bounds.
#[test]
fn int8_matvec_kernels_are_right_at_other_block_shapes() {
    for (w, r) in [(8, 1), (2, 4)] {
        let defines = [format!("-DMMQ8_WARPS={w}"), format!("-DMMQ8_ROWS={r}")];
        let lib = crate::common::lib_with(&[&defines[0], &defines[1]]);
        check_int8_matvecs(lib, &format!("{w}x{r}"));
    }
}

/// `matvec_q8_*` of `lib` against the f32 product and the product over the CPU's 8-bit
/// activations, for every int8 type.
fn check_int8_matvecs(lib: &'static libloading::Library, shape: &str) {
    // 37 rows: not a multiple of 2 or 4 rows per block. Tokens 1..7 (the passes shorter than
    // GEMM_MIN_TOKENS) and 11 (a chunk of MATVEC_TOKENS carried at once, and a partial one).
    let rows = 37;
    for (i, &(dtype, name, shapes)) in Q8_CASES.iter().enumerate() {
        assert_eq!(
            q8_kernel_suffix(dtype),
            Some(name),
            "kernel name of {dtype}"
        );
        for &cols in shapes {
            let w = weight(dtype, rows, cols, 300 + i as u64);
            let wf = dequant_ref(dtype, &w, rows * cols);
            for ntok in [1usize, 2, 3, 4, 5, 6, 7, 11] {
                let x = act_rows(ntok, cols, 11 + ntok as u64 + cols as u64);
                let xq = quantize_q8(&x);
                let cpu = cpu_q8(&x, cols);
                let mut y = vec![f32::NAN; ntok * rows];
                let f = crate::common::sym_in::<MatvecQ8Fn>(lib, &format!("run_matvec_q8_{name}"));
                // SAFETY: w holds rows*cols elements of dtype, xq ntok*cols/32 blocks, y
                // ntok*rows f32.
                unsafe {
                    f(
                        w.as_ptr(),
                        xq.as_ptr() as *const u8,
                        y.as_mut_ptr(),
                        rows as i32,
                        cols as i32,
                        ntok as i32,
                    )
                };
                let what = format!("{shape} {dtype} cols {cols} ntok {ntok}");
                check_q8_product(&what, &y, &wf, &x, &cpu, rows, cols, ntok);
            }
        }
    }
}

/// `y` (`ntok` × `rows`, token-major), a product of the weights `wf` (dequantized, `rows` ×
/// `cols`) with the activations `x` through their 8-bit blocks `cpu` (the CPU's, which
/// `quantize_q8` gives bit for bit): within the activation rounding's bound of the f32
/// product, and within f32 summation noise of the product over the 8-bit activations.
#[allow(clippy::too_many_arguments)]
fn check_q8_product(
    what: &str,
    y: &[f32],
    wf: &[f32],
    x: &[f32],
    cpu: &[([i8; 32], f32, f32)],
    rows: usize,
    cols: usize,
    ntok: usize,
) {
    for t in 0..ntok {
        for r in 0..rows {
            let wr = &wf[r * cols..(r + 1) * cols];
            let xt = &x[t * cols..(t + 1) * cols];
            let got = y[t * rows + r] as f64;
            // 1. The f32 product: each x differs from its 8-bit value d q by at most half a
            // step, d / 2 = max |x of its block| / 254, so the product by at most sum over
            // blocks of that times sum |w| of the block (and a hair for d's own rounding),
            // plus f32 summation noise.
            let (mut exact, mut mag, mut bound) = (0f64, 0f64, 0f64);
            for (wb, xb) in wr.chunks(32).zip(xt.chunks(32)) {
                let amax = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                let wabs: f64 = wb.iter().map(|v| v.abs() as f64).sum();
                bound += amax / 254.0 * wabs * (1.0 + 1e-6);
                for (a, v) in wb.iter().zip(xb) {
                    exact += *a as f64 * *v as f64;
                    mag += (*a as f64 * *v as f64).abs();
                }
            }
            assert!(
                (got - exact).abs() <= bound + 1e-5 * mag + 1e-6,
                "{what} token {t} row {r}: kernel {got}, f32 product {exact}, activation \
                 rounding bound {bound}"
            );
            // 2. The CPU's 8-bit activations (same quants: the test above): the same product
            // up to f32 summation noise.
            let (mut near, mut mag2) = (0f64, 0f64);
            for (b, wb) in wr.chunks(32).enumerate() {
                let (q, d, _) = cpu[t * cols / 32 + b];
                for (a, qv) in wb.iter().zip(q) {
                    let p = *a as f64 * (d as f64 * qv as f64);
                    near += p;
                    mag2 += p.abs();
                }
            }
            assert!(
                (got - near).abs() <= 1e-5 * mag2 + 1e-6,
                "{what} token {t} row {r}: kernel {got}, product with the CPU's 8-bit \
                 activations {near}"
            );
        }
    }
}

/// The int8 tensor-core products of long passes (`mmq_*`, the emulated `mma.sync` fragments)
/// for every int8 type: the same bounds as the int8 matvecs, at row counts that leave a
/// block's warps and a warp's 16 rows partly empty (37, 70) and token counts around the
/// block's 64-token tile (33, 64, 65, 130), columns that are not a whole number of staged
/// chunks of 4 blocks (96, 160, 800; 768 for the 256-value types); every output written once
/// (NaN elsewhere would fail).
#[test]
fn int8_tensor_core_products_match_the_product_within_the_activation_rounding() {
    for (i, &(dtype, name, shapes)) in Q8_CASES.iter().enumerate() {
        let f = crate::common::sym::<crate::common::MmqFn>(&format!("run_mmq_{name}"));
        for &cols in shapes {
            for (rows, ntok) in [(37usize, 33usize), (70, 64), (37, 65), (16, 130)] {
                let w = weight(dtype, rows, cols, 900 + i as u64 + cols as u64);
                let wf = dequant_ref(dtype, &w, rows * cols);
                let x = act_rows(ntok, cols, 17 + ntok as u64 + cols as u64);
                let xq = quantize_q8(&x);
                let cpu = cpu_q8(&x, cols);
                let mut y = vec![f32::NAN; ntok * rows];
                // SAFETY: w holds rows*cols elements of dtype, xq ntok*cols/32 blocks, y
                // ntok*rows f32.
                unsafe {
                    f(
                        xq.as_ptr() as *const u8,
                        cols as i32,
                        ntok as i32,
                        w.as_ptr(),
                        y.as_mut_ptr(),
                        rows as i32,
                    )
                };
                let what = format!("mmq {dtype} rows {rows} cols {cols} ntok {ntok}");
                check_q8_product(&what, &y, &wf, &x, &cpu, rows, cols, ntok);
            }
        }
    }
}

#[test]
fn dequant_kernels_reproduce_gds_kernels_dequantize() {
    // the staged stores, and each lane writing its own block (-DDEQ_PER_LANE: the A/B's
    // other side, GDS_CUDA_DEQ_PER_LANE)
    let libs = [
        ("staged", crate::common::lib()),
        ("per lane", crate::common::lib_with(&["-DDEQ_PER_LANE"])),
    ];
    for (how, lib) in libs {
        for (i, &(dtype, name)) in MATVEC_DTYPES.iter().enumerate() {
            // 5 rows of 256: a warp's 32 blocks and a partial one for the 32-value types
            let n = 5 * 256;
            let w = weight(dtype, 5, 256, 300 + i as u64);
            let want = dequant_ref(dtype, &w, n);
            let mut got = vec![f32::NAN; n];
            let nblocks = n / dtype.block_size();
            let f = crate::common::sym_in::<DequantFn>(lib, &format!("run_dequant_{name}"));
            // SAFETY: w holds nblocks blocks, got nblocks * block_size f32.
            unsafe { f(w.as_ptr(), got.as_mut_ptr(), nblocks as i32) };
            for (j, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-6 * e.abs() + 1e-9,
                    "{how}: {dtype} element {j}: kernel {g}, gds-kernels {e}"
                );
            }
        }
    }
}

/// `x` as an f16 GEMM's input holds it: rounded to f16 to nearest (ties to even, as `half`
/// rounds), finite values beyond ±65504 saturated there, inf and NaN kept.
fn f16_sat(x: f32) -> u16 {
    let x = if x.is_finite() {
        x.clamp(-65504.0, 65504.0)
    } else {
        x
    };
    half::f16::from_f32(x).to_bits()
}

fn same_f16(got: u16, want: u16) -> bool {
    let nan = |h: u16| half::f16::from_bits(h).is_nan();
    got == want || (nan(got) && nan(want))
}

/// An f16 GEMM's inputs (`--gemm-type f16`): `dequant16_*` gives every weight type's values
/// (the f32 kernel's) rounded to f16, and `to_f16` the activations, both as `half` rounds
/// them, bit for bit; finite values beyond f16's range (a Q8_0 block with the largest f16
/// scale, f32 and bf16 outliers) saturate at ±65504 instead of becoming inf, and inf and
/// NaN stay. A conversion that truncates, or that overflows to inf, fails.
#[test]
fn f16_tiles_and_activations_are_the_values_rounded_to_f16_and_saturated() {
    type Dequant16Fn = unsafe extern "C" fn(*const u8, *mut u16, i32);
    let specials = [
        1e6f32,
        -7e4,
        65519.0,
        65520.0,
        -65504.0,
        f32::INFINITY,
        f32::NAN,
        3e-8,
    ];
    for (i, &(dtype, name)) in MATVEC_DTYPES.iter().enumerate() {
        let n = 5 * 256;
        let mut w = weight(dtype, 5, 256, 300 + i as u64);
        match dtype {
            // the largest f16 scale: values up to 127 × 65504
            DType::Q8_0 => w[..2].copy_from_slice(&0x7BFFu16.to_le_bytes()),
            DType::F32 => {
                for (j, v) in specials.iter().enumerate() {
                    w[8 * j..8 * j + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
            DType::BF16 => {
                for (j, v) in specials.iter().enumerate() {
                    let b = half::bf16::from_f32(*v).to_le_bytes();
                    w[6 * j..6 * j + 2].copy_from_slice(&b);
                }
            }
            _ => {}
        }
        let nblocks = n / dtype.block_size();
        let mut wide = vec![f32::NAN; n];
        let mut got = vec![0x5555u16; n];
        // SAFETY: w holds nblocks blocks; wide and got nblocks * block_size elements.
        unsafe {
            sym::<DequantFn>(&format!("run_dequant_{name}"))(
                w.as_ptr(),
                wide.as_mut_ptr(),
                nblocks as i32,
            );
            sym::<Dequant16Fn>(&format!("run_dequant16_{name}"))(
                w.as_ptr(),
                got.as_mut_ptr(),
                nblocks as i32,
            );
        }
        for (j, (&g, &x)) in got.iter().zip(&wide).enumerate() {
            assert!(
                same_f16(g, f16_sat(x)),
                "{dtype} element {j}: {x:e} as {g:#06x}, want {:#06x}",
                f16_sat(x)
            );
        }
        if dtype == DType::Q8_0 {
            assert!(
                wide[..32].iter().any(|x| x.abs() > 65504.0),
                "a block beyond f16"
            );
        }
    }
    // activations: every 5th finite f16, the midpoint to the next (a tie) and its
    // neighbours, both signs; then the edges
    let ulp = |x: f32, d: i32| f32::from_bits((x.to_bits() as i32 + d) as u32);
    let mut xs: Vec<f32> = Vec::new();
    for h in (0..0x7BFFu16).step_by(5) {
        let (a, b) = (
            half::f16::from_bits(h).to_f32(),
            half::f16::from_bits(h + 1).to_f32(),
        );
        let mid = ((a as f64 + b as f64) / 2.0) as f32;
        for x in [a, mid, ulp(mid, -1), ulp(mid, 1)] {
            xs.extend([x, -x]);
        }
    }
    xs.extend(specials);
    xs.extend([
        f32::MAX,
        -f32::MAX,
        f32::NEG_INFINITY,
        ulp(65504.0, 1),
        65535.0,
    ]);
    let mut got = vec![0x5555u16; xs.len()];
    // SAFETY: xs and got hold xs.len() elements.
    unsafe {
        sym::<unsafe extern "C" fn(*const f32, *mut u16, i32)>("run_to_f16")(
            xs.as_ptr(),
            got.as_mut_ptr(),
            xs.len() as i32,
        )
    };
    for (&g, &x) in got.iter().zip(&xs) {
        assert!(
            same_f16(g, f16_sat(x)),
            "{x:e} as {g:#06x}, want {:#06x}",
            f16_sat(x)
        );
    }
}

/// MXFP4 blocks with every scale byte (0 and 1 give ggml's subnormal halves) and every
/// nibble: the kernel's values are gds-kernels' (gguf-py's) bit for bit.
#[test]
fn mxfp4_dequantization_is_exact_for_every_scale_and_nibble() {
    let nblocks = 256;
    let mut w = bytes(nblocks * 17, 77);
    for (e, b) in w.chunks_exact_mut(17).enumerate() {
        b[0] = e as u8;
        // every nibble value in the low and high halves
        for j in 0..16 {
            b[1 + j] = (j as u8) | (((j as u8 + e as u8) & 15) << 4);
        }
    }
    let want = dequant_ref(DType::MXFP4, &w, nblocks * 32);
    let mut got = vec![f32::NAN; nblocks * 32];
    let f = sym::<DequantFn>("run_dequant_mxfp4");
    // SAFETY: w holds nblocks blocks, got nblocks * 32 f32.
    unsafe { f(w.as_ptr(), got.as_mut_ptr(), nblocks as i32) };
    for (j, (g, e)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            e.to_bits(),
            "element {j}: kernel {g}, gds-kernels {e}"
        );
    }
}

#[test]
fn f16_decoding_is_exact_for_every_bit_pattern() {
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    let mut got = vec![0f32; 65536];
    let f = sym::<DequantFn>("run_dequant_f16");
    // SAFETY: all holds 65536 f16 values, got 65536 f32.
    unsafe { f(all.as_ptr(), got.as_mut_ptr(), 65536) };
    for (h, g) in got.iter().enumerate() {
        let want = half::f16::from_bits(h as u16).to_f32();
        assert!(
            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
            "f16 {h:#06x}: kernel {g:e}, half {want:e}"
        );
    }
}

#[test]
fn rmsnorm_matches_the_cpu_formula() {
    let (n, ntok, eps) = (576usize, 3usize, 1e-5f32);
    let x = values(n * ntok, 11);
    let w = values(n, 12);
    let mut out = vec![f32::NAN; n * ntok];
    let f =
        sym::<unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, i32, f32)>("run_rmsnorm");
    // SAFETY: x and out hold ntok rows of n, w holds n.
    unsafe {
        f(
            x.as_ptr(),
            w.as_ptr(),
            out.as_mut_ptr(),
            n as i32,
            ntok as i32,
            eps,
        )
    };
    for t in 0..ntok {
        let row = &x[t * n..][..n];
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..n {
            let want = row[i] as f64 * r * w[i] as f64;
            let got = out[t * n + i] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs() + 1e-6,
                "t {t} i {i}: {got} vs {want}"
            );
        }
    }
}

/// The rope kernel against the CPU runtime's `RopeTable` (the reference the CPU backend
/// runs), from the tables that table hands the GPU: adjacent pairs (llama), NEOX halves
/// (Gemma, Qwen) and partial rotary (Phi-3: 24 of 64 dimensions), at each token's position.
#[test]
fn rope_matches_the_cpu_rope_table_in_every_pairing() {
    use gds_runtime::rope::RopeTable;
    use gds_runtime::RopeScaling;
    // two tokens of different sequences: each at its own position, not in order
    let (n_heads, hd, ctx) = (3usize, 64usize, 16usize);
    let pos: [i32; 3] = [5, 13, 2];
    let ntok = pos.len();
    let f = sym::<RopeFn>("run_rope");
    for (rot, neox) in [(64usize, false), (64, true), (24, true), (24, false)] {
        let table = || {
            RopeTable::new(rot, ctx, 10000.0, RopeScaling::None)
                .partial(hd)
                .neox(neox)
        };
        let (cos, sin) = table().into_tables();
        let x0 = values(ntok * n_heads * hd, 21 + rot as u64);
        let mut x = x0.clone();
        // SAFETY: x holds ntok * n_heads * hd f32; the tables cover positions < ctx.
        unsafe {
            f(
                x.as_mut_ptr(),
                cos.as_ptr(),
                sin.as_ptr(),
                n_heads as i32,
                hd as i32,
                (rot / 2) as i32,
                neox as i32,
                pos.as_ptr(),
                ntok as i32,
            )
        };
        let cpu = table();
        for t in 0..ntok {
            let mut want = x0[t * n_heads * hd..][..n_heads * hd].to_vec();
            cpu.apply(&mut want, pos[t] as usize);
            let got = &x[t * n_heads * hd..][..n_heads * hd];
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() < 1e-6,
                    "rot {rot} neox {neox} t {t} at {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// How a test lays a KV cache out: `block` positions per block, tables per sequence, ring
/// length (0: none) — the geometries the executor uses (one block of the whole context;
/// a window block's ring of `rows` rows read as one block with ring 1; paged blocks of a
/// pool shared by sequences, tables in any order; rings of several blocks per sequence).
struct Geo {
    block: usize,
    ring: usize,
    /// Block numbers per sequence (`max_blocks` each; -1 = released, never read).
    tables: Vec<Vec<i32>>,
    /// Blocks of the cache.
    blocks: usize,
}

impl Geo {
    fn row(&self, seq: usize, p: usize) -> usize {
        let e = if self.ring > 0 {
            (p / self.block) % self.ring
        } else {
            p / self.block
        };
        let b = self.tables[seq][e];
        assert!(b >= 0, "seq {seq} position {p}: released block read");
        b as usize * self.block + p % self.block
    }
}

/// A key or value cache of f32 or f16 elements, in f32 words (the alignment the kernels
/// need), NaN everywhere it is not written.
struct Cache {
    f16: bool,
    words: Vec<u32>,
}

impl Cache {
    fn nan(elements: usize, f16: bool) -> Cache {
        let words = match f16 {
            // two f16 NaNs (0x7E00) a word
            true => vec![0x7E00_7E00; elements.div_ceil(2)],
            false => vec![f32::NAN.to_bits(); elements],
        };
        Cache { f16, words }
    }

    /// Element `at` onwards set to `xs`, as the cache holds them (f16: rounded).
    fn write(&mut self, at: usize, xs: &[f32]) {
        for (i, &x) in (at..).zip(xs) {
            match self.f16 {
                true => {
                    let (w, shift) = (i / 2, 16 * (i % 2));
                    let h = half::f16::from_f32(x).to_bits() as u32;
                    self.words[w] = (self.words[w] & !(0xFFFF << shift)) | (h << shift);
                }
                false => self.words[i] = x.to_bits(),
            }
        }
    }

    fn ptr(&self) -> *const u8 {
        self.words.as_ptr().cast()
    }

    fn mut_ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr().cast()
    }
}

/// `x` as a cache of f16 (`f16`) or f32 elements holds it.
fn held(x: f32, f16: bool) -> f32 {
    match f16 {
        true => half::f16::from_f32(x).to_f32(),
        false => x,
    }
}

/// `kv_store_f16` rounds as the CPU's f16 KV cache (`half::f16::from_f32`: to nearest, ties
/// to even) for every f32: each f16's exact value and the ties and near-ties between it
/// and the next (normal and subnormal), overflow to infinity, underflow to zero, NaN and
/// infinity, and a million f32 bit patterns spread over the whole range.
#[test]
fn kv_store_f16_rounds_every_f32_as_the_cpus_f16_cache() {
    let mut xs: Vec<f32> = Vec::new();
    for h in 0..=0x7BFFu16 {
        // every finite positive f16, the midpoint to the next one (a tie) and its neighbours
        let (a, b) = (
            half::f16::from_bits(h).to_f32(),
            half::f16::from_bits(h + 1).to_f32(),
        );
        let mid = ((a as f64 + b as f64) / 2.0) as f32;
        let ulp = |x: f32, d: i32| f32::from_bits((x.to_bits() as i32 + d) as u32);
        for x in [a, mid, ulp(mid, -1), ulp(mid, 1)] {
            xs.extend([x, -x]);
        }
    }
    xs.extend([
        65504.0,
        65519.99,
        65520.0, // the tie at the top rounds to infinity
        1e6,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
        2.98e-8, // just under half the smallest subnormal (2^-25)
        2.9802322e-8,
        2.99e-8,
    ]);
    xs.extend(
        (0..(1u64 << 32))
            .step_by(4093)
            .map(|b| f32::from_bits(b as u32)),
    );
    let n = xs.len();
    let mut kc = Cache::nan(n, true);
    let mut vc = Cache::nan(n, true);
    let neg: Vec<f32> = xs.iter().map(|x| -x).collect();
    let (pos, seq, table) = ([0i32], [0i32], [0i32]);
    // SAFETY: one token of n elements into caches of one block of one row of n f16.
    unsafe {
        sym::<KvStoreFn>("run_kv_store")(
            xs.as_ptr(),
            neg.as_ptr(),
            kc.mut_ptr(),
            vc.mut_ptr(),
            n as i32,
            1,
            pos.as_ptr(),
            seq.as_ptr(),
            table.as_ptr(),
            1,
            1,
            0,
            1,
        )
    };
    let got = |c: &Cache, i: usize| (c.words[i / 2] >> (16 * (i % 2))) as u16;
    for (i, &x) in xs.iter().enumerate() {
        for (c, x) in [(&kc, x), (&vc, -x)] {
            let want = half::f16::from_f32(x).to_bits();
            let g = got(c, i);
            // a NaN stays a NaN (its payload bits are not compared)
            let both_nan = x.is_nan() && half::f16::from_bits(g).is_nan();
            assert!(
                g == want || both_nan,
                "{x:e} ({:#010x}): {g:#06x}, want {want:#06x}",
                x.to_bits()
            );
        }
    }
}

/// Causal softmax attention through block tables, grouped KV heads; with a window only the
/// last `window` positions are read, and scores are capped as `cap·tanh(s/cap)` after the
/// scale (Gemma 2). Two sequences of different lengths share one pass and one pool of
/// blocks; `kv_store` first writes the pass's new keys and values to their rows. Every cache
/// row no query may read is NaN, so a wrong row shows. The caches are f32, then f16
/// (`kv_store_f16` and `attention_f16`: the reference reads the keys and values rounded to
/// f16).
#[test]
fn paged_attention_is_causal_softmax_per_sequence_with_grouped_kv_heads_window_and_cap() {
    let (n_heads, n_kv, hd, n_ctx) = (4usize, 2usize, 16usize, 512usize);
    let kvs = n_kv * hd;
    // (sequence, position) of each token of the pass: 3 of sequence 0, 2 of sequence 1
    let toks: [(usize, usize); 5] = [(0, 300), (1, 37), (0, 301), (0, 302), (1, 38)];
    let ntok = toks.len();
    // each sequence's first position in the pass
    let firsts = [300usize, 37];
    // a permutation of 64 blocks of 16, shared by both sequences' tables
    let perm = |seed: u64, n: usize| -> Vec<i32> {
        let mut v: Vec<i32> = (0..n as i32).collect();
        let r = values(n, seed);
        for i in (1..n).rev() {
            let j = (((r[i] + 1.0) / 2.0) * (i + 1) as f32) as usize % (i + 1);
            v.swap(i, j);
        }
        v
    };
    let pool = perm(7, 64);
    let geos = |window: usize| -> Vec<(&'static str, Geo)> {
        let mut g = vec![(
            "paged",
            Geo {
                block: 16,
                ring: 0,
                tables: vec![pool[..32].to_vec(), pool[32..].to_vec()],
                blocks: 64,
            },
        )];
        if window > 0 {
            // a ring of blocks of 16 per sequence, as the CPU's window rings
            let len = (window + ntok - 1).div_ceil(16) + 1;
            g.push((
                "rings",
                Geo {
                    block: 16,
                    ring: len,
                    tables: vec![pool[..len].to_vec(), pool[32..32 + len].to_vec()],
                    blocks: 64,
                },
            ));
            // the window blocks behind every query's window released (-1): never read
            let mut released = vec![pool[..32].to_vec(), pool[32..].to_vec()];
            for (s, t) in released.iter_mut().enumerate() {
                let oldest_read = (firsts[s] + 1).saturating_sub(window);
                for e in t.iter_mut().take(oldest_read / 16) {
                    *e = -1;
                }
            }
            g.push((
                "paged, released behind the window",
                Geo {
                    block: 16,
                    ring: 0,
                    tables: released,
                    blocks: 64,
                },
            ));
        }
        g
    };
    for (window, cap, with_sinks, f16) in [
        (0usize, 0f32, false, false),
        (7, 0.0, false, false),
        (0, 0.5, false, false),
        (40, 0.7, false, false),
        (20, 0.0, false, false),
        (0, 0.0, true, false),
        (7, 0.0, true, false),
        (0, 0.0, false, true),
        (40, 0.7, false, true),
        (7, 0.0, true, true),
    ] {
        // gpt-oss's sinks: one logit per query head, some above the scores' range
        let sinks: Vec<f32> = match with_sinks {
            true => values(n_heads, 61).iter().map(|v| v * 4.0).collect(),
            false => Vec::new(),
        };
        for (name, geo) in geos(window) {
            // logical keys and values of every position of each sequence
            let k: Vec<Vec<f32>> = (0..2).map(|s| values(n_ctx * kvs, 31 + s)).collect();
            let v: Vec<Vec<f32>> = (0..2).map(|s| values(n_ctx * kvs, 41 + s)).collect();
            // the cache before the pass: positions before each sequence's first token of
            // the pass, latest write winning in a ring; NaN elsewhere
            let mut kc = Cache::nan(geo.blocks * geo.block * kvs, f16);
            let mut vc = Cache::nan(geo.blocks * geo.block * kvs, f16);
            for (s, &first) in firsts.iter().enumerate() {
                let oldest = if window > 0 {
                    (first + 1).saturating_sub(window)
                } else {
                    0
                };
                for p in oldest..first {
                    let r = geo.row(s, p);
                    kc.write(r * kvs, &k[s][p * kvs..][..kvs]);
                    vc.write(r * kvs, &v[s][p * kvs..][..kvs]);
                }
            }
            // the pass's new rows
            let mut kn = Vec::new();
            let mut vn = Vec::new();
            for &(s, p) in &toks {
                kn.extend_from_slice(&k[s][p * kvs..][..kvs]);
                vn.extend_from_slice(&v[s][p * kvs..][..kvs]);
            }
            let max_blocks = geo.tables[0].len();
            let tables: Vec<i32> = geo.tables.concat();
            let pos: Vec<i32> = toks.iter().map(|&(_, p)| p as i32).collect();
            let seq: Vec<i32> = toks.iter().map(|&(s, _)| s as i32).collect();
            let q = values(ntok * n_heads * hd, 33)
                .iter()
                .map(|x| x * 3.0)
                .collect::<Vec<_>>();
            let mut att = vec![0f32; ntok * n_heads * n_ctx];
            let mut out = vec![f32::NAN; ntok * n_heads * hd];
            let scale = 1.0 / (hd as f32).sqrt();
            let store = sym::<KvStoreFn>("run_kv_store");
            let f = sym::<AttnFn>("run_attention");
            // SAFETY: buffer sizes as allocated above for these dimensions; every table
            // entry a token writes or reads is a block of the cache.
            unsafe {
                store(
                    kn.as_ptr(),
                    vn.as_ptr(),
                    kc.mut_ptr(),
                    vc.mut_ptr(),
                    kvs as i32,
                    ntok as i32,
                    pos.as_ptr(),
                    seq.as_ptr(),
                    tables.as_ptr(),
                    max_blocks as i32,
                    geo.block as i32,
                    geo.ring as i32,
                    f16 as i32,
                );
                f(
                    q.as_ptr(),
                    kc.ptr(),
                    vc.ptr(),
                    att.as_mut_ptr(),
                    out.as_mut_ptr(),
                    n_heads as i32,
                    n_kv as i32,
                    hd as i32,
                    ntok as i32,
                    pos.as_ptr(),
                    seq.as_ptr(),
                    tables.as_ptr(),
                    max_blocks as i32,
                    geo.block as i32,
                    geo.ring as i32,
                    n_ctx as i32,
                    scale,
                    window as i32,
                    cap,
                    if with_sinks {
                        sinks.as_ptr()
                    } else {
                        std::ptr::null()
                    },
                    f16 as i32,
                )
            };
            for (t, &(s, pos)) in toks.iter().enumerate() {
                let n_pos = pos + 1;
                let first = if window > 0 {
                    n_pos.saturating_sub(window)
                } else {
                    0
                };
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv);
                    let qh = &q[(t * n_heads + h) * hd..][..hd];
                    let scores: Vec<f64> = (first..n_pos)
                        .map(|p| {
                            let kp = &k[s][p * kvs + kvh * hd..][..hd];
                            let x = qh
                                .iter()
                                .zip(kp)
                                .map(|(a, b)| *a as f64 * held(*b, f16) as f64)
                                .sum::<f64>()
                                * scale as f64;
                            if cap > 0.0 {
                                cap as f64 * (x / cap as f64).tanh()
                            } else {
                                x
                            }
                        })
                        .collect();
                    let sink = sinks.get(h).map(|&v| v as f64);
                    let mx = scores.iter().cloned().chain(sink).fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                    let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |v| (v - mx).exp());
                    for d in 0..hd {
                        let want: f64 = (first..n_pos)
                            .map(|p| {
                                e[p - first] / sum * held(v[s][p * kvs + kvh * hd + d], f16) as f64
                            })
                            .sum();
                        let got = out[(t * n_heads + h) * hd + d] as f64;
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{name}: window {window} cap {cap} sinks {with_sinks} f16 {f16} token {t} (seq {s} pos {pos}) h {h} d {d}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// A single sequence's caches as the executor lays them out: one block of the whole
/// context (ring 0), and a window block's ring of `window + ntok − 1` rows read as one
/// block with a ring of 1 (position p at row p mod rows).
#[test]
fn single_sequence_caches_are_one_block_or_a_one_block_ring() {
    let (n_heads, n_kv, hd, n_ctx, pos0, ntok) = (2usize, 1usize, 8usize, 64usize, 40usize, 3);
    let kvs = n_kv * hd;
    for (window, rows) in [(0usize, n_ctx), (5, 5 + ntok - 1), (10, 16)] {
        let ring = usize::from(rows < n_ctx);
        let k = values(n_ctx * kvs, 3);
        let v = values(n_ctx * kvs, 4);
        let mut kc = Cache::nan(rows * kvs, false);
        let mut vc = Cache::nan(rows * kvs, false);
        let oldest = if window > 0 { pos0 + 1 - window } else { 0 };
        for p in oldest..pos0 {
            kc.write(p % rows * kvs, &k[p * kvs..][..kvs]);
            vc.write(p % rows * kvs, &v[p * kvs..][..kvs]);
        }
        let (kn, vn) = (
            k[pos0 * kvs..(pos0 + ntok) * kvs].to_vec(),
            v[pos0 * kvs..(pos0 + ntok) * kvs].to_vec(),
        );
        let pos: Vec<i32> = (pos0..pos0 + ntok).map(|p| p as i32).collect();
        let seq = vec![0i32; ntok];
        let table = [0i32];
        let q = values(ntok * n_heads * hd, 5);
        let mut att = vec![0f32; ntok * n_heads * n_ctx];
        let mut out = vec![f32::NAN; ntok * n_heads * hd];
        // SAFETY: sizes as allocated above; the one table entry is block 0 of `rows` rows.
        unsafe {
            sym::<KvStoreFn>("run_kv_store")(
                kn.as_ptr(),
                vn.as_ptr(),
                kc.mut_ptr(),
                vc.mut_ptr(),
                kvs as i32,
                ntok as i32,
                pos.as_ptr(),
                seq.as_ptr(),
                table.as_ptr(),
                1,
                rows as i32,
                ring as i32,
                0,
            );
            sym::<AttnFn>("run_attention")(
                q.as_ptr(),
                kc.ptr(),
                vc.ptr(),
                att.as_mut_ptr(),
                out.as_mut_ptr(),
                n_heads as i32,
                n_kv as i32,
                hd as i32,
                ntok as i32,
                pos.as_ptr(),
                seq.as_ptr(),
                table.as_ptr(),
                1,
                rows as i32,
                ring as i32,
                n_ctx as i32,
                0.25,
                window as i32,
                0.0,
                std::ptr::null(),
                0,
            )
        };
        assert!(
            out.iter().all(|x| x.is_finite()),
            "window {window}: {out:?}"
        );
        // the last query of the pass, head 0, against the f64 formula
        let (t, n_pos) = (ntok - 1, pos0 + ntok);
        let first = if window > 0 { n_pos - window } else { 0 };
        let qh = &q[t * n_heads * hd..][..hd];
        let s: Vec<f64> = (first..n_pos)
            .map(|p| {
                qh.iter()
                    .zip(&k[p * kvs..][..hd])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * 0.25
            })
            .collect();
        let mx = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
        let sum: f64 = e.iter().sum();
        for d in 0..hd {
            let want: f64 = (first..n_pos)
                .map(|p| e[p - first] / sum * v[p * kvs + d] as f64)
                .sum();
            let got = out[t * n_heads * hd + d] as f64;
            assert!(
                (got - want).abs() < 1e-5,
                "window {window} d {d}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn swiglu_and_residual_add_are_elementwise() {
    let n = 1000usize; // not a multiple of the block size
    let g0 = values(n, 41).iter().map(|v| v * 6.0).collect::<Vec<_>>();
    let up = values(n, 42);
    let mut g = g0.clone();
    let f = sym::<PairFn>("run_swiglu");
    // SAFETY: both buffers hold n f32.
    unsafe { f(g.as_mut_ptr(), up.as_ptr(), n as i32) };
    for i in 0..n {
        let x = g0[i] as f64;
        let want = x / (1.0 + (-x).exp()) * up[i] as f64;
        assert!(
            (g[i] as f64 - want).abs() < 1e-6,
            "swiglu {i}: {} vs {want}",
            g[i]
        );
    }
    let mut y = g0.clone();
    let f = sym::<PairFn>("run_add_inplace");
    // SAFETY: both buffers hold n f32.
    unsafe { f(y.as_mut_ptr(), up.as_ptr(), n as i32) };
    for i in 0..n {
        assert_eq!(y[i], g0[i] + up[i], "add {i}");
    }
}

/// GeGLU, the bias add over rows, the embedding scale and the logit cap against the CPU
/// runtime's formulas (`gds_runtime::ops`).
#[test]
fn geglu_bias_rows_scale_and_softcap_match_the_cpu_ops() {
    use gds_runtime::ops;
    let n = 1000usize; // not a multiple of the block size
    let g0 = values(n, 51).iter().map(|v| v * 6.0).collect::<Vec<_>>();
    let up = values(n, 52);
    let close = |what: &str, got: &[f32], want: &[f32]| {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{what} {i}: {g} vs {w}"
            );
        }
    };
    let (mut g, mut want) = (g0.clone(), g0.clone());
    // SAFETY: both buffers hold n f32.
    unsafe { sym::<PairFn>("run_geglu")(g.as_mut_ptr(), up.as_ptr(), n as i32) };
    ops::geglu(&mut want, &up);
    close("geglu", &g, &want);

    let (width, rows) = (40usize, 25usize);
    let bias = values(width, 53);
    let (mut y, mut want) = (g0.clone(), g0.clone());
    let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, i32, i32)>("run_add_rows");
    // SAFETY: y holds width * rows f32, bias width.
    unsafe { f(y.as_mut_ptr(), bias.as_ptr(), width as i32, rows as i32) };
    ops::add_bias_rows(&mut want, &bias);
    close("add_rows", &y, &want);

    let (mut x, mut want) = (g0.clone(), g0.clone());
    // SAFETY: x holds n f32.
    unsafe { sym::<ScaleFn>("run_scale_inplace")(x.as_mut_ptr(), 5.5, n as i32) };
    ops::scale(&mut want, 5.5);
    close("scale", &x, &want);

    let (mut x, mut want) = (g0.clone(), g0);
    // SAFETY: x holds n f32.
    unsafe { sym::<ScaleFn>("run_softcap_inplace")(x.as_mut_ptr(), 2.5, n as i32) };
    ops::softcap(&mut want, 2.5);
    close("softcap", &x, &want);
    assert!(x.iter().all(|v| v.abs() <= 2.5));
}

/// gpt-oss's clamped SwiGLU against the CPU runtime's (`gds_runtime::ops::swiglu_oai`), over
/// values on both sides of its clamps.
#[test]
fn clamped_swiglu_matches_the_cpu_op() {
    let n = 1000usize;
    let g0 = values(n, 71).iter().map(|v| v * 12.0).collect::<Vec<_>>();
    let up = values(n, 72).iter().map(|v| v * 12.0).collect::<Vec<_>>();
    let (mut g, mut want) = (g0.clone(), g0);
    // SAFETY: both buffers hold n f32.
    unsafe { sym::<PairFn>("run_swiglu_oai")(g.as_mut_ptr(), up.as_ptr(), n as i32) };
    gds_runtime::ops::swiglu_oai(&mut want, &up);
    for (i, (a, b)) in g.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{i}: {a} vs {b}");
    }
}

/// An expert's output rows added to its tokens' rows by weight (the rows, then the
/// weights' bits, in one i32 array); rows not listed are untouched.
#[test]
fn scatter_add_rows_adds_each_row_by_its_weight() {
    let (n, ntok) = (300usize, 9usize);
    let dst0 = values(ntok * n, 81);
    let rows = [7i32, 0, 4];
    let w = [0.25f32, -1.5, 2.0];
    let src = values(rows.len() * n, 82);
    let idx: Vec<i32> = rows
        .iter()
        .copied()
        .chain(w.iter().map(|v| v.to_bits() as i32))
        .collect();
    let mut dst = dst0.clone();
    let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, *const i32, i32, i32)>(
        "run_scatter_add_rows",
    );
    // SAFETY: dst holds ntok rows of n, src 3 rows, idx 2 * 3 words; every row index < ntok.
    unsafe { f(dst.as_mut_ptr(), src.as_ptr(), idx.as_ptr(), n as i32, 3) };
    for t in 0..ntok {
        let k = rows.iter().position(|&r| r as usize == t);
        for i in 0..n {
            let want = match k {
                Some(k) => dst0[t * n + i] + w[k] * src[k * n + i],
                None => dst0[t * n + i],
            };
            assert_eq!(dst[t * n + i], want, "token {t} element {i}");
        }
    }
}

/// The fused launches compute what the launches they replace compute, bit for bit: the
/// norm into `xq` (`rmsnorm_q8`) and the gated activations (`*_q8`) give the plain kernel's
/// f32 output and `quantize_q8`'s blocks of it, at widths that are not a multiple of the
/// block's 256 threads.
#[test]
fn norm_and_activations_quantizing_their_output_equal_the_two_launches() {
    type NormQ8Fn = unsafe extern "C" fn(*const f32, *const f32, *mut f32, *mut u8, i32, i32, f32);
    type GluQ8Fn = unsafe extern "C" fn(*mut f32, *const f32, *mut u8, i32);
    let norm =
        sym::<unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, i32, f32)>("run_rmsnorm");
    let norm_q8 = sym::<NormQ8Fn>("run_rmsnorm_q8");
    for (n, ntok) in [(64usize, 1usize), (96, 3), (576, 2), (800, 5)] {
        let x = act_rows(ntok, n, n as u64);
        let w = values(n, 7);
        let (mut plain, mut fused) = (vec![f32::NAN; n * ntok], vec![f32::NAN; n * ntok]);
        let mut xq = vec![0u32; ntok * n / 32 * Q8A_BYTES / 4];
        // SAFETY: x, plain, fused hold ntok rows of n; w n; xq ntok * n / 32 blocks.
        unsafe {
            norm(
                x.as_ptr(),
                w.as_ptr(),
                plain.as_mut_ptr(),
                n as i32,
                ntok as i32,
                1e-5,
            );
            norm_q8(
                x.as_ptr(),
                w.as_ptr(),
                fused.as_mut_ptr(),
                xq.as_mut_ptr() as *mut u8,
                n as i32,
                ntok as i32,
                1e-5,
            );
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused), bits(&plain), "rmsnorm_q8 n {n}: the norm");
        assert_eq!(xq, quantize_q8(&plain), "rmsnorm_q8 n {n}: the quants");
    }
    for act in ["swiglu", "geglu", "swiglu_oai"] {
        let plain_f = sym::<PairFn>(&format!("run_{act}"));
        let fused_f = sym::<GluQ8Fn>(&format!("run_{act}_q8"));
        for n in [32usize, 288, 1056] {
            // gate and up spread over ±8 (the clamp of swiglu_oai at 7 is crossed)
            let gate: Vec<f32> = values(n, 3).iter().map(|v| v * 8.0).collect();
            let up: Vec<f32> = values(n, 4).iter().map(|v| v * 8.0).collect();
            let (mut plain, mut fused) = (gate.clone(), gate.clone());
            let mut xq = vec![0u32; n / 32 * Q8A_BYTES / 4];
            // SAFETY: gate, up hold n f32; xq n / 32 blocks.
            unsafe {
                plain_f(plain.as_mut_ptr(), up.as_ptr(), n as i32);
                fused_f(
                    fused.as_mut_ptr(),
                    up.as_ptr(),
                    xq.as_mut_ptr() as *mut u8,
                    n as i32,
                );
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&plain), "{act}_q8 n {n}: the activation");
            assert_eq!(xq, quantize_q8(&plain), "{act}_q8 n {n}: the quants");
        }
    }
}

/// One int8 launch over three matrices (Q, K, V) writes what three launches write, bit for
/// bit, with row counts that leave a block's last rows empty and a matrix of one row, at
/// the default block shape and two others.
#[test]
fn one_int8_launch_over_three_matrices_equals_three_launches() {
    use crate::common::{lib, lib_with, sym_in, MatvecQ8xFn};
    let cols = 160;
    let rows = [7usize, 1, 12];
    let libs = [
        lib(),
        lib_with(&["-DMMQ8_WARPS=8", "-DMMQ8_ROWS=1"]),
        lib_with(&["-DMMQ8_WARPS=2", "-DMMQ8_ROWS=4"]),
    ];
    let cases = Q8_CASES.iter().filter(|c| c.0.block_size() == 32);
    for (lib, &(dtype, name, _)) in libs
        .iter()
        .flat_map(|l| cases.clone().map(move |c| (*l, c)))
    {
        let ws: Vec<Vec<u8>> = rows
            .iter()
            .enumerate()
            .map(|(i, &r)| weight(dtype, r, cols, 40 + i as u64))
            .collect();
        for ntok in [1usize, 3, 9] {
            let xq = quantize_q8(&act_rows(ntok, cols, 77 + ntok as u64));
            let one = sym_in::<MatvecQ8Fn>(lib, &format!("run_matvec_q8_{name}"));
            let three = sym_in::<MatvecQ8xFn>(lib, &format!("run_matvec_q8x_{name}"));
            let mut alone: Vec<Vec<f32>> = rows.iter().map(|r| vec![f32::NAN; ntok * r]).collect();
            let mut together = alone.clone();
            // SAFETY: each w holds rows[i] * cols elements of dtype, xq ntok * cols / 32
            // blocks, each y ntok * rows[i] f32.
            unsafe {
                for (i, y) in alone.iter_mut().enumerate() {
                    let r = rows[i] as i32;
                    one(
                        ws[i].as_ptr(),
                        xq.as_ptr() as *const u8,
                        y.as_mut_ptr(),
                        r,
                        cols as i32,
                        ntok as i32,
                    );
                }
                let [a, b, c] = &mut together[..] else {
                    unreachable!()
                };
                three(
                    xq.as_ptr() as *const u8,
                    cols as i32,
                    ntok as i32,
                    ws[0].as_ptr(),
                    a.as_mut_ptr(),
                    rows[0] as i32,
                    ws[1].as_ptr(),
                    b.as_mut_ptr(),
                    rows[1] as i32,
                    ws[2].as_ptr(),
                    c.as_mut_ptr(),
                    rows[2] as i32,
                );
            }
            for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
                assert!(
                    t.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name} ntok {ntok}: matrix {i} differs"
                );
            }
        }
    }
}

/// `rope_kv` (f32 and f16 caches) leaves the queries and keys rotated as `rope` does and
/// the caches as `kv_store` of the rotated keys writes them, bit for bit: two sequences
/// in a paged pool, partial rotary, both pairings.
#[test]
fn rope_with_the_kv_store_equals_the_three_launches() {
    use crate::common::RopeKvFn;
    let (nq, nkv, hd, ctx) = (4usize, 2usize, 32usize, 16usize);
    let kv_dim = nkv * hd;
    let pos: [i32; 3] = [5, 2, 6];
    let seq: [i32; 3] = [1, 0, 1];
    // two sequences, blocks of 4 positions, tables [3, 0] and [2, 1] into a pool of 4 blocks
    let (block, max_blocks, tables) = (4i32, 2i32, [3i32, 0, 2, 1]);
    let ntok = pos.len();
    for (rot, neox, f16) in [
        (32usize, false, false),
        (32, true, true),
        (16, true, false),
        (16, false, true),
    ] {
        let cos: Vec<f32> = values(ctx * rot / 2, 5);
        let sin: Vec<f32> = values(ctx * rot / 2, 6);
        let q0 = values(ntok * nq * hd, 8);
        let k0 = values(ntok * kv_dim, 9);
        let v = values(ntok * kv_dim, 10);
        let cache_words = 4 * block as usize * kv_dim; // f32 words (f16 uses half)
                                                       // three launches
        let (mut q1, mut k1) = (q0.clone(), k0.clone());
        let (mut kc1, mut vc1) = (vec![u32::MAX; cache_words], vec![u32::MAX; cache_words]);
        // one launch
        let (mut q2, mut k2) = (q0.clone(), k0.clone());
        let (mut kc2, mut vc2) = (kc1.clone(), vc1.clone());
        // SAFETY: q, k, v hold ntok rows of their heads; the caches 4 blocks of 4 rows of
        // kv_dim (f32 words, enough for f16); the tables cover positions < ctx.
        unsafe {
            let rope = sym::<RopeFn>("run_rope");
            for (x, heads) in [(&mut q1, nq), (&mut k1, nkv)] {
                rope(
                    x.as_mut_ptr(),
                    cos.as_ptr(),
                    sin.as_ptr(),
                    heads as i32,
                    hd as i32,
                    (rot / 2) as i32,
                    neox as i32,
                    pos.as_ptr(),
                    ntok as i32,
                );
            }
            sym::<KvStoreFn>("run_kv_store")(
                k1.as_ptr(),
                v.as_ptr(),
                kc1.as_mut_ptr() as *mut u8,
                vc1.as_mut_ptr() as *mut u8,
                kv_dim as i32,
                ntok as i32,
                pos.as_ptr(),
                seq.as_ptr(),
                tables.as_ptr(),
                max_blocks,
                block,
                0,
                f16 as i32,
            );
            sym::<RopeKvFn>("run_rope_kv")(
                q2.as_mut_ptr(),
                k2.as_mut_ptr(),
                v.as_ptr(),
                kc2.as_mut_ptr() as *mut u8,
                vc2.as_mut_ptr() as *mut u8,
                cos.as_ptr(),
                sin.as_ptr(),
                nq as i32,
                nkv as i32,
                hd as i32,
                (rot / 2) as i32,
                neox as i32,
                ntok as i32,
                pos.as_ptr(),
                seq.as_ptr(),
                tables.as_ptr(),
                max_blocks,
                block,
                0,
                f16 as i32,
            );
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let what = format!("rot {rot} neox {neox} f16 {f16}");
        assert_eq!(bits(&q2), bits(&q1), "{what}: queries");
        assert_eq!(bits(&k2), bits(&k1), "{what}: keys");
        assert_ne!(k1, k0, "{what}: the keys were rotated");
        assert_eq!(kc2, kc1, "{what}: key cache");
        assert_eq!(vc2, vc1, "{what}: value cache");
        assert!(kc1.iter().any(|&w| w != u32::MAX), "{what}: stored");
    }
}
