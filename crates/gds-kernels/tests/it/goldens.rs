//! Compares `quantize` / `dequantize` with gguf-py outputs stored in fixtures/kernels
//! (regenerate with `python3 scripts/gen_kernel_goldens.py`). Every comparison is exact:
//! bytes for quantize, f32 bit patterns for dequantize.

use gds_format::DType;
use gds_kernels::{dequantize, quantize, quantize_weighted};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/kernels")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn quantize_matches_gguf_py() {
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::MXFP4,
    ] {
        let input = f32s(&fixture(&format!("q_{}.in.f32", dtype.name())));
        let want = fixture(&format!("q_{}.out.bin", dtype.name()));
        let got = quantize(dtype, &input).unwrap();
        assert_eq!(got.len(), want.len(), "{dtype}");
        let ts = dtype.type_size();
        for (i, (g, w)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
            assert_eq!(g, w, "{dtype} block {i} differs from gguf-py");
        }
    }
}

#[test]
fn dequantize_matches_gguf_py_bitwise() {
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q8_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Q8K,
        DType::MXFP4,
        DType::Iq4Nl,
        DType::Iq4Xs,
    ]
    .into_iter()
    .chain(gds_format::IQ_GRID_DTYPES)
    {
        let src = fixture(&format!("dq_{}.in.bin", dtype.name()));
        let want = f32s(&fixture(&format!("dq_{}.out.f32", dtype.name())));
        let mut got = vec![f32::NAN; want.len()];
        dequantize(dtype, &src, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{dtype} element {i}: {g} vs gguf-py {w}"
            );
        }
    }
}

#[test]
fn quantized_goldens_dequantize_consistently() {
    // gguf-py's quantize output, dequantized by us, lands near the input.
    for (dtype, tol) in [
        (DType::Q8_0, 1.0 / 127.0),
        (DType::Q4_0, 1.0 / 7.0),
        (DType::Q4_1, 1.0 / 14.0),
    ] {
        let input = f32s(&fixture(&format!("q_{}.in.f32", dtype.name())));
        let q = fixture(&format!("q_{}.out.bin", dtype.name()));
        let mut back = vec![0f32; input.len()];
        dequantize(dtype, &q, &mut back).unwrap();
        for (blk_in, blk_out) in input.chunks(32).zip(back.chunks(32)) {
            let amax = blk_in.iter().fold(0f32, |a, v| a.max(v.abs()));
            if !(1e-4..=1e4).contains(&amax) {
                continue; // f16 scale underflows or overflows there
            }
            for (a, b) in blk_in.iter().zip(blk_out) {
                assert!(
                    (a - b).abs() <= amax * tol * 1.01,
                    "{dtype}: {a} -> {b} (amax {amax})"
                );
            }
        }
    }
}

#[test]
fn k_quantize_matches_ggml() {
    // goldens from ggml's own quantize_row_q{2..6}_K_ref (scripts/gen_quant_goldens.py)
    let input = f32s(&fixture("qk.in.f32"));
    for dtype in [DType::Q2K, DType::Q3K, DType::Q4K, DType::Q5K, DType::Q6K] {
        let want = fixture(&format!("qk_{}.out.bin", dtype.name()));
        let got = quantize(dtype, &input).unwrap();
        assert_eq!(got.len(), want.len(), "{dtype}");
        let ts = dtype.type_size();
        for (i, (g, w)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
            assert_eq!(g, w, "{dtype} super-block {i} differs from ggml");
        }
    }
}

#[test]
fn weighted_quantize_matches_ggml() {
    // goldens from ggml's quantize_row_*_impl with quant_weights, the importance-matrix path
    // of llama-quantize (scripts/gen_imatrix_goldens.py): the K input as rows of 256
    let input = f32s(&fixture("qk.in.f32"));
    let weights = f32s(&fixture("qw.weights.f32"));
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ] {
        let want = fixture(&format!("qw_{}.out.bin", dtype.name()));
        let got = quantize_weighted(dtype, &input, 256, &weights).unwrap();
        assert_eq!(got.len(), want.len(), "{dtype}");
        let ts = dtype.type_size();
        for (i, (g, w)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
            assert_eq!(
                g,
                w,
                "{dtype} block {i} (row {}) differs from ggml",
                i * dtype.block_size() / 256
            );
        }
        // the weights are used: the unweighted bytes differ
        assert_ne!(got, quantize(dtype, &input).unwrap(), "{dtype}");
    }
    // dtypes without a weighted quantizer ignore the weights, as ggml does
    let q8 = quantize_weighted(DType::Q8_0, &input, 256, &weights).unwrap();
    assert_eq!(q8, quantize(DType::Q8_0, &input).unwrap());
    // wrong shapes are errors, not panics
    assert!(quantize_weighted(DType::Q4K, &input, 256, &weights[..128]).is_err());
    assert!(quantize_weighted(DType::Q4K, &input, 128, &weights[..128]).is_err());
    assert!(quantize_weighted(DType::Q4_0, &input[..100], 32, &weights[..32]).is_err());
    assert!(quantize_weighted(DType::Q4_0, &input, 0, &[]).is_err());
}

#[test]
fn k_quantize_round_trips() {
    // our K-quant bytes, dequantized by us, land near the input: the error of each value is
    // within its sub-block's step (which depends on the sub-block's own range)
    let input = f32s(&fixture("qk.in.f32"));
    for (dtype, sub, steps) in [
        (DType::Q2K, 16, 3.0f32),
        (DType::Q3K, 16, 7.0),
        (DType::Q4K, 32, 15.0),
        (DType::Q5K, 32, 31.0),
        (DType::Q6K, 16, 63.0),
    ] {
        let q = quantize(dtype, &input).unwrap();
        let mut back = vec![f32::NAN; input.len()];
        dequantize(dtype, &q, &mut back).unwrap();
        let mut worst = 0f32;
        for (sb_in, sb_out) in input.chunks(256).zip(back.chunks(256)) {
            let amax = sb_in.iter().fold(0f32, |a, v| a.max(v.abs()));
            if !(1e-2..=1e4).contains(&amax) {
                continue; // f16 super-block scales underflow or overflow there
            }
            for (bi, bo) in sb_in.chunks(sub).zip(sb_out.chunks(sub)) {
                let (lo, hi) = bi
                    .iter()
                    .fold((0f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                // the sub-block's own step, plus the 6-bit (or 4-bit) rounding of its scale
                // against the super-block's largest
                let tol = (hi - lo) / steps * 1.5 + amax / 8.0;
                for (a, b) in bi.iter().zip(bo) {
                    assert!(
                        b.is_finite() && (a - b).abs() <= tol,
                        "{dtype}: {a} -> {b} (tol {tol})"
                    );
                    worst = worst.max((a - b).abs() / amax);
                }
            }
        }
        assert!(worst > 0.0, "{dtype}: nothing compared");
    }
}
