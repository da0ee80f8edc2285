//! The CUDA kernels' arithmetic, checked on the CPU: kernels/*.cu are compiled as C++ with
//! kernels/emu.h (grid and block loops, one OS thread per CUDA thread, real barriers),
//! launched with the executor's grid/block shapes, and compared with `gds-kernels` (weights)
//! and f64 references of the CPU backend's formulas (norm, RoPE, attention, SwiGLU).

mod common;

use common::{sym, AttnFn};
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
            DType::Q4K => {
                b[0..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&dmin);
            }
            DType::Q6K => b[208..210].copy_from_slice(&d),
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
    (DType::Q8_0, "q8_0"),
    (DType::Q4K, "q4_k"),
    (DType::Q6K, "q6_k"),
    (DType::F16, "f16"),
    (DType::F32, "f32"),
];

#[test]
fn matvec_kernels_match_the_dequantized_product_for_every_gpu_dtype() {
    // 37 rows: not a multiple of the 4 rows per block, so the tail block is exercised.
    // 768 columns: three Q4_K/Q6_K super-blocks, 24 Q4_0 blocks (fewer than the 32 lanes).
    let (rows, cols, ntok) = (37usize, 768usize, 3usize);
    for (i, &(dtype, name)) in MATVEC_DTYPES.iter().enumerate() {
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

#[test]
fn dequant_kernels_reproduce_gds_kernels_dequantize() {
    for (i, &(dtype, name)) in MATVEC_DTYPES.iter().enumerate() {
        let n = 5 * 256;
        let w = weight(dtype, 5, 256, 300 + i as u64);
        let want = dequant_ref(dtype, &w, n);
        let mut got = vec![f32::NAN; n];
        let nblocks = n / dtype.block_size();
        let f = sym::<DequantFn>(&format!("run_dequant_{name}"));
        // SAFETY: w holds nblocks blocks, got nblocks * block_size f32.
        unsafe { f(w.as_ptr(), got.as_mut_ptr(), nblocks as i32) };
        for (j, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-6 * e.abs() + 1e-9,
                "{dtype} element {j}: kernel {g}, gds-kernels {e}"
            );
        }
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

#[test]
fn rope_rotates_adjacent_pairs_by_the_table_at_each_tokens_position() {
    let (n_heads, hd, pos0, ntok, ctx) = (3usize, 64usize, 5usize, 2usize, 16usize);
    let half = hd / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..ctx {
        for i in 0..half {
            let a = pos as f64 * 10000f64.powf(-((2 * i) as f64) / hd as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    let x0 = values(ntok * n_heads * hd, 21);
    let mut x = x0.clone();
    let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, *const f32, i32, i32, i32, i32)>(
        "run_rope",
    );
    // SAFETY: x holds ntok * n_heads * hd f32; the tables cover positions < ctx.
    unsafe {
        f(
            x.as_mut_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            n_heads as i32,
            hd as i32,
            pos0 as i32,
            ntok as i32,
        )
    };
    for t in 0..ntok {
        let pos = pos0 + t;
        for h in 0..n_heads {
            for i in 0..half {
                let at = (t * n_heads + h) * hd + 2 * i;
                let a = pos as f64 * 10000f64.powf(-((2 * i) as f64) / hd as f64);
                let (c, s) = (a.cos(), a.sin());
                let (u, v) = (x0[at] as f64, x0[at + 1] as f64);
                let (e0, e1) = (u * c - v * s, u * s + v * c);
                assert!((x[at] as f64 - e0).abs() < 1e-5, "t {t} h {h} i {i}");
                assert!((x[at + 1] as f64 - e1).abs() < 1e-5, "t {t} h {h} i {i}");
            }
        }
    }
}

#[test]
fn attention_is_causal_softmax_over_the_cache_with_grouped_kv_heads() {
    let (n_heads, n_kv, hd, pos0, ntok, n_ctx) =
        (4usize, 2usize, 16usize, 300usize, 3usize, 512usize);
    let kvs = n_kv * hd;
    // Cache holds positions 0 .. pos0+ntok; positions beyond must never be read (NaN).
    let mut k = values(n_ctx * kvs, 31);
    let mut v = values(n_ctx * kvs, 32);
    for p in pos0 + ntok..n_ctx {
        k[p * kvs..][..kvs].fill(f32::NAN);
        v[p * kvs..][..kvs].fill(f32::NAN);
    }
    let q = values(ntok * n_heads * hd, 33);
    let mut att = vec![0f32; ntok * n_heads * n_ctx];
    let mut out = vec![f32::NAN; ntok * n_heads * hd];
    let scale = 1.0 / (hd as f32).sqrt();
    let f = sym::<AttnFn>("run_attention");
    // SAFETY: buffer sizes as allocated above for these dimensions.
    unsafe {
        f(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            att.as_mut_ptr(),
            out.as_mut_ptr(),
            n_heads as i32,
            n_kv as i32,
            hd as i32,
            pos0 as i32,
            ntok as i32,
            n_ctx as i32,
            scale,
        )
    };
    for t in 0..ntok {
        let n_pos = pos0 + t + 1;
        for h in 0..n_heads {
            let kvh = h / (n_heads / n_kv);
            let qh = &q[(t * n_heads + h) * hd..][..hd];
            let scores: Vec<f64> = (0..n_pos)
                .map(|p| {
                    let kp = &k[p * kvs + kvh * hd..][..hd];
                    qh.iter()
                        .zip(kp)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..hd {
                let want: f64 = (0..n_pos)
                    .map(|p| e[p] / sum * v[p * kvs + kvh * hd + d] as f64)
                    .sum();
                let got = out[(t * n_heads + h) * hd + d] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "t {t} h {h} d {d}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn swiglu_and_residual_add_are_elementwise() {
    let n = 1000usize; // not a multiple of the block size
    let g0 = values(n, 41).iter().map(|v| v * 6.0).collect::<Vec<_>>();
    let up = values(n, 42);
    let mut g = g0.clone();
    let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, i32)>("run_swiglu");
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
    let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, i32)>("run_add_inplace");
    // SAFETY: both buffers hold n f32.
    unsafe { f(y.as_mut_ptr(), up.as_ptr(), n as i32) };
    for i in 0..n {
        assert_eq!(y[i], g0[i] + up[i], "add {i}");
    }
}
