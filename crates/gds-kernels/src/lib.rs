//! GdsLLM CPU kernels. Kernels know blocks and slices, nothing about models or files.
//!
//! API contract (used by gds-convert and gds-runtime):
//! - [`dequantize`]: any supported dtype → f32.
//! - [`quantize`]: f32 → F32/F16/BF16/Q8_0/Q4_0/Q4_1, byte-identical to ggml/gguf-py.
//! - [`matmul`]: `y[t, r] = sum_k W[r, k] * x[t, k]` for a weight in its on-disk dtype.

use gds_format::DType;

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

/// A weight matrix in its on-disk dtype: `rows` rows of `cols` elements, row-major.
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
}

/// Dequantizes `src` (a whole number of blocks of `dtype`) into `dst`
/// (`dst.len()` elements).
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    let _ = (src, dst);
    Err(KernelError::Unsupported { op: "dequantize", dtype })
}

/// Quantizes `src` into `dtype`, returning the bytes.
pub fn quantize(dtype: DType, src: &[f32]) -> Result<Vec<u8>, KernelError> {
    let _ = src;
    Err(KernelError::Unsupported { op: "quantize", dtype })
}

/// `y[t * w.rows + r] = sum_k W[r, k] * x[t * w.cols + k]` for `t in 0..n_tokens`.
pub fn matmul(w: &WeightView<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) -> Result<(), KernelError> {
    let _ = (x, n_tokens, y);
    Err(KernelError::Unsupported { op: "matmul", dtype: w.dtype })
}
