use std::path::PathBuf;
use thiserror::Error;

/// Everything that can stop a conversion, validation or inspection. Each message names the
/// file (and the tensor, where there is one).
///
/// The `Display` text is the whole message, OS error included. An I/O error is not also
/// the [`source`](std::error::Error::source) of [`ConvertError::Io`], so a caller that
/// prints the chain (`anyhow`'s `{:#}`) shows the OS error once too.
#[derive(Debug, Error)]
pub enum ConvertError {
    /// An I/O operation on `path` failed.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error (in the message; not a `source`, so that it is not printed twice).
        error: std::io::Error,
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
    /// The output path cannot be used at all (it has no directory name).
    #[error("{path}: {msg}")]
    BadOutput {
        /// The output path as given.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// `--force` was given but replacing the output directory would destroy something that
    /// is not a GdsLLM model (the input itself, or other files).
    #[error("{path}: refusing to replace it with --force: {reason}")]
    ReplaceRefused {
        /// The output directory.
        path: PathBuf,
        /// Why, listing what would be lost.
        reason: String,
    },
    /// A safetensors input could not be read.
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
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
    #[error("internal error converting {input}: {msg}")]
    Internal {
        /// The input being converted.
        input: PathBuf,
        /// What is wrong with the output.
        msg: String,
    },
}

/// What kind of failure a [`ConvertError`] is; `gdsconv` maps it to its exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The input is not a model we can convert (exit 1).
    Input,
    /// A bug: the converter produced something invalid (exit 1, "failed conversion").
    Internal,
    /// The command line asks for something that cannot or must not be done: the output
    /// exists, `--force` would destroy other files, the output path is unusable (exit 2).
    Usage,
    /// The operating system refused an operation (exit 2).
    Io,
}

impl ConvertError {
    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ConvertError::Io { .. } => ErrorKind::Io,
            ConvertError::Safetensors(e) if e.is_io() => ErrorKind::Io,
            ConvertError::BadInput { .. }
            | ConvertError::BadTensor { .. }
            | ConvertError::Safetensors(_)
            | ConvertError::Kernel { .. } => ErrorKind::Input,
            ConvertError::OutputExists(_)
            | ConvertError::BadOutput { .. }
            | ConvertError::ReplaceRefused { .. } => ErrorKind::Usage,
            ConvertError::Internal { .. } => ErrorKind::Internal,
        }
    }
}

/// Shorthand for an I/O error on a path.
pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ConvertError {
    let path = path.into();
    move |error| ConvertError::Io { path, error }
}

/// Why a safetensors input could not be read. Every message names the file, and the tensor
/// where there is one.
#[derive(Debug, Error)]
pub enum SafetensorsError {
    /// Reading or mapping a file or directory failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The input is neither a safetensors file, an index, nor a directory holding them.
    #[error("{path}: {reason}")]
    UnsupportedInput {
        /// The input path.
        path: PathBuf,
        /// What was expected.
        reason: String,
    },
    /// The safetensors header is unusable (length, UTF-8, JSON, layout).
    #[error("{path}: bad safetensors header: {reason}")]
    Header {
        /// The safetensors file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// One tensor's header entry or data is unusable.
    #[error("{path}: tensor {tensor:?}: {reason}")]
    Tensor {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor that would be converted has a dtype other than F32, F16 or BF16.
    #[error("{path}: tensor {tensor:?} has dtype {dtype}; only F32, F16 and BF16 are supported")]
    UnsupportedDtype {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// The dtype as the header spells it.
        dtype: String,
    },
    /// `model.safetensors.index.json` is malformed.
    #[error("{path}: bad shard index: {reason}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A shard listed in the index does not exist.
    #[error("{index}: shard {shard} (holding tensor {tensor:?}) is missing")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard's path.
        shard: PathBuf,
        /// A tensor the index places in that shard.
        tensor: String,
    },
    /// Two files hold a tensor of the same name.
    #[error("tensor {tensor:?} is in both {first} and {second}")]
    DuplicateTensor {
        /// The tensor's name.
        tensor: String,
        /// The first file holding it.
        first: PathBuf,
        /// The second file holding it.
        second: PathBuf,
    },
    /// `config.json` (or another JSON side file) is malformed or inconsistent with the
    /// tensors.
    #[error("{path}: {reason}")]
    Config {
        /// The JSON file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the architecture requires is absent.
    #[error("{path}: required tensor {tensor:?} (stored as {source_name:?}) is missing")]
    MissingTensor {
        /// The input (file, index or directory).
        path: PathBuf,
        /// Canonical name.
        tensor: String,
        /// The name it would have in the input.
        source_name: String,
    },
}

impl SafetensorsError {
    /// True when the operating system refused an operation (as opposed to the input being
    /// malformed).
    pub fn is_io(&self) -> bool {
        matches!(self, SafetensorsError::Io { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_is_printed_once_even_with_its_chain() {
        let e = io("/x/out.gguf")(std::io::Error::from_raw_os_error(2));
        let msg = e.to_string();
        assert_eq!(msg.matches("os error 2").count(), 1, "{msg}");
        assert!(msg.starts_with("/x/out.gguf: "), "{msg}");
        // what anyhow's `{:#}` prints: the message, then each source in turn
        let mut chain = msg.clone();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            chain.push_str(&format!(": {s}"));
            src = s.source();
        }
        assert_eq!(chain, msg);
        assert_eq!(e.kind(), ErrorKind::Io);
    }
}
