use std::path::PathBuf;
use thiserror::Error;

/// Everything that can stop a conversion, validation or inspection. Each message names the
/// file (and the tensor, where there is one).
#[derive(Debug, Error)]
pub enum ConvertError {
    /// An I/O operation on `path` failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The input is not a valid GGUF, safetensors or HF directory.
    #[error("{path}: {msg}")]
    BadInput {
        /// The input file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A tensor in the input is unusable.
    #[error("{path}: tensor {tensor:?}: {msg}")]
    BadTensor {
        /// The input file.
        path: PathBuf,
        /// The tensor's name in the input.
        tensor: String,
        /// What is wrong.
        msg: String,
    },
    /// The output directory exists and `--force` was not given.
    #[error("{0}: output directory already exists (use --force to replace it)")]
    OutputExists(PathBuf),
    /// A safetensors input could not be read.
    #[error(transparent)]
    Safetensors(#[from] crate::safetensors::SafetensorsError),
    /// A kernel (quantize/dequantize) refused the data.
    #[error("tensor {tensor:?}: {source}")]
    Kernel {
        /// The tensor.
        tensor: String,
        /// Why.
        #[source]
        source: gds_kernels::KernelError,
    },
    /// The written model breaks the format (a bug, caught before the rename).
    #[error("internal error: {0}")]
    Internal(String),
}

/// Shorthand for an I/O error on a path.
pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ConvertError {
    let path = path.into();
    move |source| ConvertError::Io { path, source }
}
