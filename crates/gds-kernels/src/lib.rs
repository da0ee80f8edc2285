#![doc = include_str!("../README.md")]

pub mod act;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod blocks;
mod dequant;
mod interleave;
#[rustfmt::skip]
mod iq_grids;
mod iquant;
mod matmul;
mod quant;
mod quant_k;
mod quant_w;
pub mod scalar;

use blocks::*;
use dequant::{dequant_blocks, Dequant};
use gds_format::DType;
use rayon::prelude::*;

pub use interleave::{
    deinterleave, interleavable, interleave, interleave_pays, Layout, GROUP as INTERLEAVED_ROWS,
};
pub use matmul::{isa_cap, matmul_many_with, set_isa_cap, Isa};

pub use quant::{
    quantize_block_mxfp4, quantize_block_q4_0, quantize_block_q4_1, quantize_block_q5_0,
    quantize_block_q5_1, quantize_block_q8_0, quantize_block_q8_1, quantize_block_q8_k,
};
pub use quant_k::{
    quantize_block_q2_k, quantize_block_q3_k, quantize_block_q4_k, quantize_block_q5_k,
    quantize_block_q6_k,
};

/// Errors from kernels: only ever about unsupported dtypes or mismatched lengths.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// The dtype has no kernel for this operation.
    #[error("{op} is not implemented for {dtype}")]
    Unsupported {
        /// Operation name.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// Lengths do not fit the dtype's block geometry.
    #[error("{0}")]
    Shape(String),
}

/// A weight matrix in its on-disk dtype: `rows` rows of `cols` elements, row-major (or
/// interleaved, [`Layout`]).
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// Element type.
    pub dtype: DType,
    /// The raw bytes, exactly `rows * dtype.row_bytes(cols)`.
    pub data: &'a [u8],
    /// Number of rows (output features).
    pub rows: usize,
    /// Number of columns (input features).
    pub cols: usize,
    /// How the rows are laid out ([`Layout::Rows`]: as in the file).
    pub layout: Layout,
}

impl WeightView<'_> {
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_size() * self.dtype.type_size()
    }

    /// Checks that `data` holds exactly `rows` rows of `cols` elements.
    pub fn validate(&self) -> Result<(), KernelError> {
        if !self.cols.is_multiple_of(self.dtype.block_size()) {
            return Err(KernelError::Shape(format!(
                "{} columns are not a whole number of {} blocks",
                self.cols, self.dtype
            )));
        }
        let want = self.rows.checked_mul(self.row_bytes());
        if want != Some(self.data.len()) {
            return Err(KernelError::Shape(format!(
                "{}x{} {} weight needs {:?} bytes, got {}",
                self.rows,
                self.cols,
                self.dtype,
                want,
                self.data.len()
            )));
        }
        if self.layout == Layout::Interleaved16
            && (!interleavable(self.dtype) || !self.rows.is_multiple_of(interleave::GROUP))
        {
            return Err(KernelError::Shape(format!(
                "a {}x{} {} weight cannot be in an interleaved layout",
                self.rows, self.cols, self.dtype
            )));
        }
        Ok(())
    }
}

/// Elements per rayon task when (de)quantizing large inputs (a multiple of 256).
const PAR_CHUNK: usize = 64 * 1024;

/// Checks that `n` elements of `dtype` take exactly `bytes` bytes.
fn check_len(dtype: DType, n: usize, bytes: usize) -> Result<(), KernelError> {
    match dtype.row_bytes(n as u64) {
        Some(b) if b == bytes as u64 => Ok(()),
        Some(b) => Err(KernelError::Shape(format!(
            "{n} {dtype} elements take {b} bytes, got {bytes}"
        ))),
        None => Err(KernelError::Shape(format!(
            "{n} elements are not a whole number of {dtype} blocks ({})",
            dtype.block_size()
        ))),
    }
}

fn dequant_typed<B>(src: &[u8], dst: &mut [f32])
where
    B: Dequant
        + zerocopy::FromBytes
        + zerocopy::Immutable
        + zerocopy::KnownLayout
        + zerocopy::Unaligned
        + Sync,
{
    // Lengths were checked by the caller, so the cast cannot fail.
    let blocks = cast::<B>(src).expect("whole blocks");
    let per = PAR_CHUNK / B::N;
    if dst.len() <= PAR_CHUNK {
        dequant_blocks(blocks, dst);
    } else {
        blocks
            .par_chunks(per)
            .zip(dst.par_chunks_mut(per * B::N))
            .for_each(|(b, o)| dequant_blocks(b, o));
    }
}

fn par_elementwise(src: &[u8], dst: &mut [f32], width: usize, f: fn(&[u8], &mut [f32])) {
    if dst.len() <= PAR_CHUNK {
        f(src, dst);
    } else {
        src.par_chunks(PAR_CHUNK * width)
            .zip(dst.par_chunks_mut(PAR_CHUNK))
            .for_each(|(s, d)| f(s, d));
    }
}

/// Dequantizes `src` (a whole number of blocks of `dtype`) into `dst`
/// (`dst.len()` elements).
///
/// Results are bit-identical to gguf-py's `gguf.quants.dequantize` for every dtype it
/// supports (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, MXFP4, IQ4_NL, IQ4_XS,
/// IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S); Q8_1 and Q8_K follow ggml
/// (`x = d * q`).
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    check_len(dtype, dst.len(), src.len())?;
    match dtype {
        DType::F32 => par_elementwise(src, dst, 4, dequant::f32_from_bytes),
        DType::F16 => par_elementwise(src, dst, 2, dequant::f16_from_bytes),
        DType::BF16 => par_elementwise(src, dst, 2, dequant::bf16_from_bytes),
        DType::Q4_0 => dequant_typed::<BlockQ4_0>(src, dst),
        DType::Q4_1 => dequant_typed::<BlockQ4_1>(src, dst),
        DType::Q5_0 => dequant_typed::<BlockQ5_0>(src, dst),
        DType::Q5_1 => dequant_typed::<BlockQ5_1>(src, dst),
        DType::Q8_0 => dequant_typed::<BlockQ8_0>(src, dst),
        DType::Q8_1 => dequant_typed::<BlockQ8_1>(src, dst),
        DType::Q2K => dequant_typed::<BlockQ2K>(src, dst),
        DType::Q3K => dequant_typed::<BlockQ3K>(src, dst),
        DType::Q4K => dequant_typed::<BlockQ4K>(src, dst),
        DType::Q5K => dequant_typed::<BlockQ5K>(src, dst),
        DType::Q6K => dequant_typed::<BlockQ6K>(src, dst),
        DType::Q8K => dequant_typed::<BlockQ8K>(src, dst),
        DType::MXFP4 => dequant_typed::<BlockMxfp4>(src, dst),
        DType::Iq4Nl => dequant_typed::<BlockIq4Nl>(src, dst),
        DType::Iq4Xs => dequant_typed::<BlockIq4Xs>(src, dst),
        DType::Iq2Xxs => dequant_typed::<BlockIq2Xxs>(src, dst),
        DType::Iq2Xs => dequant_typed::<BlockIq2Xs>(src, dst),
        DType::Iq2S => dequant_typed::<BlockIq2S>(src, dst),
        DType::Iq3Xxs => dequant_typed::<BlockIq3Xxs>(src, dst),
        DType::Iq3S => dequant_typed::<BlockIq3S>(src, dst),
        DType::Iq1S => dequant_typed::<BlockIq1S>(src, dst),
        DType::Iq1M => dequant_typed::<BlockIq1M>(src, dst),
        _ => {
            return Err(KernelError::Unsupported {
                op: "dequantize",
                dtype,
            })
        }
    }
    Ok(())
}

fn quant_typed<B>(src: &[f32], n: usize, f: fn(&[f32]) -> B) -> Vec<u8>
where
    B: zerocopy::IntoBytes + zerocopy::Immutable,
{
    let size = size_of::<B>();
    let mut out = vec![0u8; src.len() / n * size];
    let run = |s: &[f32], o: &mut [u8]| {
        for (x, b) in s.chunks_exact(n).zip(o.chunks_exact_mut(size)) {
            b.copy_from_slice(f(x).as_bytes());
        }
    };
    if src.len() <= PAR_CHUNK {
        run(src, &mut out);
    } else {
        src.par_chunks(PAR_CHUNK)
            .zip(out.par_chunks_mut(PAR_CHUNK / n * size))
            .for_each(|(s, o)| run(s, o));
    }
    out
}

fn quant_elementwise(src: &[f32], width: usize, f: fn(&[f32], &mut [u8])) -> Vec<u8> {
    let mut out = vec![0u8; src.len() * width];
    if src.len() <= PAR_CHUNK {
        f(src, &mut out);
    } else {
        src.par_chunks(PAR_CHUNK)
            .zip(out.par_chunks_mut(PAR_CHUNK * width))
            .for_each(|(s, o)| f(s, o));
    }
    out
}

/// Quantizes `src` into `dtype`, returning the bytes.
///
/// F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 are byte-identical to gguf-py's
/// `gguf.quants.quantize` (ggml's reference quantizers); Q8_1 and Q8_K follow ggml's
/// `quantize_row_q8_1_ref` / `quantize_row_q8_K_ref`, and Q2_K..Q6_K are byte-identical to
/// ggml's `quantize_row_q{2..6}_K_ref` (no importance matrix). `src.len()` must be a whole
/// number of blocks. Large inputs are quantized in parallel on the current rayon pool.
pub fn quantize(dtype: DType, src: &[f32]) -> Result<Vec<u8>, KernelError> {
    if !src.len().is_multiple_of(dtype.block_size()) {
        return Err(KernelError::Shape(format!(
            "{} elements are not a whole number of {dtype} blocks ({})",
            src.len(),
            dtype.block_size()
        )));
    }
    Ok(match dtype {
        DType::F32 => quant_elementwise(src, 4, quant::f32_to_bytes),
        DType::F16 => quant_elementwise(src, 2, quant::f16_to_bytes),
        DType::BF16 => quant_elementwise(src, 2, quant::bf16_to_bytes),
        DType::Q4_0 => quant_typed(src, QK, quantize_block_q4_0),
        DType::Q4_1 => quant_typed(src, QK, quantize_block_q4_1),
        DType::Q5_0 => quant_typed(src, QK, quantize_block_q5_0),
        DType::Q5_1 => quant_typed(src, QK, quantize_block_q5_1),
        DType::Q8_0 => quant_typed(src, QK, quantize_block_q8_0),
        DType::Q8_1 => quant_typed(src, QK, quantize_block_q8_1),
        DType::MXFP4 => quant_typed(src, QK, quantize_block_mxfp4),
        DType::Q8K => quant_typed(src, QK_K, quantize_block_q8_k),
        DType::Q2K => quant_typed(src, QK_K, quantize_block_q2_k),
        DType::Q3K => quant_typed(src, QK_K, quantize_block_q3_k),
        DType::Q4K => quant_typed(src, QK_K, quantize_block_q4_k),
        DType::Q5K => quant_typed(src, QK_K, quantize_block_q5_k),
        DType::Q6K => quant_typed(src, QK_K, quantize_block_q6_k),
        _ => {
            return Err(KernelError::Unsupported {
                op: "quantize",
                dtype,
            })
        }
    })
}

/// Whether [`quantize_weighted`] uses the weights for `dtype` (ggml has a weighted
/// quantizer for it); for the other dtypes it is [`quantize`].
pub fn takes_importance(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
    )
}

/// Quantizes the rows of `cols` values in `src` into `dtype` weighted by an importance
/// matrix: `weights[c]` is how much column `c`'s error counts (llama.cpp's imatrix value,
/// the mean squared activation that column meets). Byte-identical to ggml's
/// `quantize_row_*_impl` with `quant_weights` (`llama-quantize --imatrix`) for Q4_0, Q4_1,
/// Q5_0, Q5_1 and Q2_K..Q6_K; every other dtype ignores the weights, as ggml does, and is
/// [`quantize`]. Rows are quantized in parallel on the current rayon pool.
pub fn quantize_weighted(
    dtype: DType,
    src: &[f32],
    cols: usize,
    weights: &[f32],
) -> Result<Vec<u8>, KernelError> {
    if !takes_importance(dtype) {
        return quantize(dtype, src);
    }
    let block = dtype.block_size();
    if cols == 0 || !cols.is_multiple_of(block) || !src.len().is_multiple_of(cols) {
        return Err(KernelError::Shape(format!(
            "{} values in rows of {cols} are not whole rows of {dtype} blocks ({block})",
            src.len()
        )));
    }
    if weights.len() != cols {
        return Err(KernelError::Shape(format!(
            "{} importance weights for rows of {cols} values",
            weights.len()
        )));
    }
    Ok(match dtype {
        DType::Q4_0 => quant_rows(src, cols, QK, weights, quant_w::row_q4_0),
        DType::Q4_1 => quant_rows(src, cols, QK, weights, quant_w::row_q4_1),
        DType::Q5_0 => quant_rows(src, cols, QK, weights, quant_w::row_q5_0),
        DType::Q5_1 => quant_rows(src, cols, QK, weights, quant_w::row_q5_1),
        DType::Q2K => quant_rows(src, cols, QK_K, weights, super_blocks(quant_w::block_q2_k)),
        DType::Q3K => quant_rows(src, cols, QK_K, weights, super_blocks(quant_w::block_q3_k)),
        DType::Q4K => quant_rows(src, cols, QK_K, weights, super_blocks(quant_w::block_q4_k)),
        DType::Q5K => quant_rows(src, cols, QK_K, weights, super_blocks(quant_w::block_q5_k)),
        DType::Q6K => quant_rows(src, cols, QK_K, weights, super_blocks(quant_w::block_q6_k)),
        _ => unreachable!("takes_importance lists the dtypes above"),
    })
}

/// A row quantizer made of a super-block one (the K-quants weigh each super-block alone).
fn super_blocks<B>(f: fn(&[f32], &[f32]) -> B) -> impl Fn(&[f32], &[f32], &mut [B]) + Sync {
    move |x, qw, out| {
        for ((xb, wb), o) in x.chunks_exact(QK_K).zip(qw.chunks_exact(QK_K)).zip(out) {
            *o = f(xb, wb);
        }
    }
}

/// Quantizes each row of `cols` values with `f(row, weights, blocks)`, blocks of `n`
/// values, rows in parallel.
fn quant_rows<B, F>(src: &[f32], cols: usize, n: usize, weights: &[f32], f: F) -> Vec<u8>
where
    B: zerocopy::IntoBytes + zerocopy::FromBytes + zerocopy::Immutable + Send + Copy,
    F: Fn(&[f32], &[f32], &mut [B]) + Sync,
{
    let per_row = cols / n;
    let mut blocks = vec![<B as zerocopy::FromZeros>::new_zeroed(); src.len() / n];
    src.par_chunks(cols)
        .zip(blocks.par_chunks_mut(per_row))
        .for_each(|(x, o)| f(x, weights, o));
    zerocopy::IntoBytes::as_bytes(blocks.as_slice()).to_vec()
}

/// `y[t * w.rows + r] = sum_k W[r, k] * x[t * w.cols + k]` for `t in 0..n_tokens`.
///
/// Supported weight dtypes: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
/// MXFP4 (dedicated kernels) and Q2_K, Q3_K, Q8_1, Q8_K (dequantize each row, then f32). Output
/// rows are split across the current rayon pool; with several tokens each weight row is
/// used for up to four tokens at a time.
pub fn matmul(
    w: &WeightView<'_>,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_with(Isa::best(), w, x, n_tokens, y)
}

/// [`matmul`] on a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_with(
    isa: Isa,
    w: &WeightView<'_>,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_many_with(isa, std::slice::from_ref(w), x, n_tokens, &mut [y])
}

/// Several [`matmul`]s with the same input: `ys[i] = ws[i] · x`. All weights must have the
/// same `cols`; dtypes may differ. The input is quantized once per activation format and all
/// output rows share one parallel region, which saves a fork/join per weight in decode.
pub fn matmul_many(
    ws: &[WeightView<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    matmul_many_with(Isa::best(), ws, x, n_tokens, ys)
}

/// [`matmul_many`] keeping the activations in f32 (weights dequantized row by row): the
/// arithmetic of a float reference, for checking against one. Slower than [`matmul_many`].
pub fn matmul_many_f32_act(
    ws: &[WeightView<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    matmul::matmul_many_f32_act(Isa::best(), ws, x, n_tokens, ys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg_values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    #[test]
    fn f32_activations_match_the_float_product_of_the_dequantized_weights() {
        let (rows, cols, n) = (12, 512, 3);
        let x = lcg_values(n * cols, 7);
        for dtype in [DType::Q4_0, DType::Q8_0, DType::Q4_1, DType::F16] {
            let w = quantize(dtype, &lcg_values(rows * cols, 11)).unwrap();
            let mut deq = vec![0f32; rows * cols];
            dequantize(dtype, &w, &mut deq).unwrap();
            let view = WeightView {
                layout: crate::Layout::Rows,
                dtype,
                data: &w,
                rows,
                cols,
            };
            let mut exact = vec![0f32; n * rows];
            let mut q8 = vec![0f32; n * rows];
            matmul_many_f32_act(&[view], &x, n, &mut [&mut exact]).unwrap();
            matmul(&view, &x, n, &mut q8).unwrap();
            let (mut err_exact, mut err_q8) = (0f64, 0f64);
            for t in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols)
                        .map(|k| deq[r * cols + k] as f64 * x[t * cols + k] as f64)
                        .sum();
                    err_exact = err_exact.max((exact[t * rows + r] as f64 - want).abs());
                    err_q8 = err_q8.max((q8[t * rows + r] as f64 - want).abs());
                }
            }
            assert!(err_exact < 1e-3, "{dtype}: f32 path off by {err_exact}");
            if dtype != DType::F16 {
                assert!(err_exact < err_q8, "{dtype}: {err_exact} vs q8 {err_q8}");
            }
        }
    }

    #[test]
    fn parallel_quantize_equals_blockwise() {
        // More than PAR_CHUNK elements, with a ragged last chunk.
        let x = lcg_values(PAR_CHUNK * 2 + 32 * 7, 1);
        for dtype in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q5_1,
            DType::F16,
            DType::BF16,
        ] {
            let all = quantize(dtype, &x).unwrap();
            let bs = dtype.block_size().max(32);
            let mut pieces = Vec::new();
            for c in x.chunks(bs) {
                pieces.extend(quantize(dtype, c).unwrap());
            }
            assert_eq!(all, pieces, "{dtype}");
            let mut back = vec![0f32; x.len()];
            dequantize(dtype, &all, &mut back).unwrap();
            let mut back_pieces = Vec::new();
            for c in all.chunks(dtype.type_size() * bs / dtype.block_size()) {
                let mut o = vec![0f32; bs];
                dequantize(dtype, c, &mut o).unwrap();
                back_pieces.extend(o);
            }
            assert_eq!(back, back_pieces, "{dtype}");
        }
    }

    #[test]
    fn q8_k_round_trips_within_one_step() {
        let x = lcg_values(QK_K * 3, 2);
        let q = quantize(DType::Q8K, &x).unwrap();
        assert_eq!(q.len(), 3 * 292);
        let blocks = cast::<BlockQ8K>(&q).unwrap();
        let mut back = vec![0f32; x.len()];
        dequantize(DType::Q8K, &q, &mut back).unwrap();
        for (b, (xs, ys)) in blocks.iter().zip(x.chunks(QK_K).zip(back.chunks(QK_K))) {
            for (j, (a, c)) in xs.iter().zip(ys).enumerate() {
                assert!((a - c).abs() <= b.d().abs() * 0.5001, "{a} vs {c}");
                let _ = j;
            }
            for i in 0..16 {
                let s: i32 = b.qs[i * 16..i * 16 + 16].iter().map(|&v| v as i32).sum();
                assert_eq!(s, b.bsum(i) as i32);
            }
        }
    }

    #[test]
    fn shape_and_dtype_errors() {
        let mut out = vec![0f32; 32];
        assert!(matches!(
            dequantize(DType::Q4_0, &[0u8; 17], &mut out),
            Err(KernelError::Shape(_))
        ));
        assert!(matches!(
            dequantize(DType::Q4_0, &[0u8; 18], &mut out[..31]),
            Err(KernelError::Shape(_))
        ));
        assert!(matches!(
            dequantize(DType::I32, &[0u8; 128], &mut out),
            Err(KernelError::Unsupported {
                op: "dequantize",
                dtype: DType::I32
            })
        ));
        assert!(matches!(
            quantize(DType::I32, &[0f32; 256]),
            Err(KernelError::Unsupported { .. })
        ));
        assert!(matches!(
            quantize(DType::Q4K, &[0f32; 255]),
            Err(KernelError::Shape(_))
        ));
        // the K-quants quantize (an all-zero super-block is all-zero bytes)
        assert_eq!(quantize(DType::Q4K, &[0f32; 256]), Ok(vec![0u8; 144]));
        assert!(matches!(
            quantize(DType::Q8_0, &out[..20]),
            Err(KernelError::Shape(_))
        ));
    }
}
