use std::path::PathBuf;

/// Errors from opening a model directory or making a layer resident.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// A file could not be opened, inspected or mapped.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The manifest could not be parsed.
    #[error("{}: {source}", path.display())]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: gds_format::FormatError,
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
}
