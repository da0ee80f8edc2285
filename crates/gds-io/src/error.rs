use std::path::PathBuf;

/// Errors from opening a model directory or making a layer resident.
///
/// A message includes its cause; no variant also returns it from `source()`, so a report
/// that prints the chain (`{:#}`) says it once.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// A file could not be opened, inspected or mapped.
    #[error("{}: {error}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// A file's bytes differ from what the manifest recorded (corrupt or modified).
    #[error("{}: {why}", path.display())]
    Integrity {
        /// The file.
        path: PathBuf,
        /// What differs.
        why: String,
    },
    /// A path inside the model directory is a link, not a regular file, or too large.
    #[error("{}: {why}", path.display())]
    Unsafe {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The manifest could not be parsed.
    #[error("{}: {error}", path.display())]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        error: gds_format::FormatError,
    },
    /// A layer file's length differs from the manifest's record (truncated or replaced).
    #[error("{}: file is {actual} bytes but the manifest says {expected} (truncated or from another conversion?)", path.display())]
    LengthMismatch {
        /// The layer file.
        path: PathBuf,
        /// Length recorded in the manifest.
        expected: u64,
        /// Length on disk.
        actual: u64,
    },
    /// A layer's file path in the manifest is not a plain relative path.
    #[error(
        "layer {layer}: file path {file:?} must be relative and stay inside the model directory"
    )]
    BadPath {
        /// Layer index.
        layer: usize,
        /// The path as written in the manifest.
        file: String,
    },
    /// A layer index past the end of the layer table.
    #[error("layer {layer} does not exist (the model has {n_layers})")]
    NoSuchLayer {
        /// The index asked for.
        layer: usize,
        /// Number of layers.
        n_layers: usize,
    },
    /// A span asked of a layer lies outside its file.
    #[error("{}: bytes {offset}..+{len} lie outside the {size}-byte file", path.display())]
    OutOfRange {
        /// The layer file.
        path: PathBuf,
        /// First byte asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// File size.
        size: u64,
    },
    /// A span larger than the streaming buffers (a planning error).
    #[error("{}: a {len}-byte read does not fit the {buffer}-byte streaming buffers", path.display())]
    SpanTooLarge {
        /// The layer file.
        path: PathBuf,
        /// Bytes asked for.
        len: u64,
        /// Buffer capacity.
        buffer: usize,
    },
    /// Allocation of an I/O buffer failed.
    #[error("could not allocate a {bytes}-byte aligned I/O buffer")]
    OutOfMemory {
        /// Bytes asked for.
        bytes: u64,
    },
    /// Every streaming buffer is held by the caller (a planning error).
    #[error("all {slots} streaming buffers of {slot_size} bytes are in use")]
    PoolExhausted {
        /// Number of buffers.
        slots: usize,
        /// Bytes each.
        slot_size: usize,
    },
}
