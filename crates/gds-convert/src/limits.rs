//! Caps on what the converter takes into memory from its input. Tensor data stays in the
//! memory-mapped files; only headers, metadata and JSON side files are decoded, and every
//! count or length in them is checked against these caps (and against the file size)
//! before anything is allocated from it.

use std::io::Read;
use std::path::Path;

/// `config.json`, `tokenizer_config.json`, `generation_config.json` (real ones are a few
/// KiB; chat templates make the largest tokenizer configs a few hundred KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// `model.safetensors.index.json` (a few MiB for models with tens of thousands of tensors).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// `tokenizer.json`: one bound with the runtime's.
pub use gds_format::vocab::MAX_TOKENIZER_BYTES;
/// Elements of all GGUF metadata arrays together. `gguf-rs` turns each element into a
/// `serde_json::Value` (32 bytes, plus the text of strings), so this bounds the decoded
/// metadata to about 512 MiB however the file is built. The largest real vocabularies
/// (tokens, scores, types and merges of ~260k tokens) need about 1.5 million.
pub const MAX_GGUF_ARRAY_ELEMENTS: u64 = 1 << 24;

/// Why [`read_text`] gave no text.
#[derive(Debug)]
pub(crate) enum ReadTextError {
    /// The OS refused.
    Io(std::io::Error),
    /// Not a regular file (a directory, a FIFO, a device).
    NotAFile,
    /// Larger than the cap (the size found, at least cap + 1).
    TooLarge(u64),
    /// Not UTF-8.
    NotUtf8,
}

impl ReadTextError {
    /// A message for the non-I/O cases.
    pub(crate) fn describe(&self, cap: u64) -> String {
        match self {
            ReadTextError::Io(e) => e.to_string(),
            ReadTextError::NotAFile => "not a regular file".into(),
            ReadTextError::TooLarge(n) => {
                format!("{n} bytes is more than the {cap} bytes such a file may have")
            }
            ReadTextError::NotUtf8 => "not UTF-8".into(),
        }
    }
}

/// Reads a whole text file of at most `cap` bytes. `Ok(None)` when it does not exist.
pub(crate) fn read_text(path: &Path, cap: u64) -> Result<Option<String>, ReadTextError> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ReadTextError::Io(e)),
    };
    let meta = f.metadata().map_err(ReadTextError::Io)?;
    if !meta.is_file() {
        return Err(ReadTextError::NotAFile);
    }
    if meta.len() > cap {
        return Err(ReadTextError::TooLarge(meta.len()));
    }
    // The file may grow while we read it: never take more than the cap.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(ReadTextError::Io)?;
    if bytes.len() as u64 > cap {
        return Err(ReadTextError::TooLarge(bytes.len() as u64));
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| ReadTextError::NotUtf8)
}
