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
    /// The OS refused, or the path is not a regular file (a directory, a FIFO, a device:
    /// cannot be read as a file, so an I/O error, exit 2 in `gdsconv`).
    Io(std::io::Error),
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
            ReadTextError::TooLarge(n) => {
                format!("{n} bytes is more than the {cap} bytes such a file may have")
            }
            ReadTextError::NotUtf8 => "not UTF-8".into(),
        }
    }
}

/// Reads a whole text file of at most `cap` bytes. `Ok(None)` when it does not exist.
///
/// The file is opened with `O_NONBLOCK` and then checked to be a regular file on the open
/// descriptor (no window between a check and the open): a FIFO in place of `config.json`
/// is refused at once instead of blocking the open for ever.
pub(crate) fn read_text(path: &Path, cap: u64) -> Result<Option<String>, ReadTextError> {
    let f = match gds_io::open_user_file(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ReadTextError::Io(e)),
    };
    let meta = f.metadata().map_err(ReadTextError::Io)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_text_refuses_a_fifo_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("config.json");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path, not retained.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // no writer: a blocking open would never return (the read runs on a thread, so
        // that it fails the test instead of hanging it)
        for p in [fifo.clone(), d.path().to_path_buf()] {
            let (tx, rx) = std::sync::mpsc::channel();
            let q = p.clone();
            std::thread::spawn(move || tx.send(read_text(&q, MAX_CONFIG_BYTES)));
            match rx.recv_timeout(std::time::Duration::from_secs(60)) {
                Ok(Err(ReadTextError::Io(e))) => assert_eq!(e.to_string(), "not a regular file"),
                Ok(r) => panic!("{p:?}: {r:?}"),
                Err(_) => panic!("{p:?}: the open blocked"),
            }
        }
        assert!(matches!(read_text(&d.path().join("none"), 9), Ok(None)));
        std::fs::write(d.path().join("a"), "{}").unwrap();
        assert_eq!(read_text(&d.path().join("a"), 9).unwrap().unwrap(), "{}");
    }
}
