use thiserror::Error;

/// Why a manifest or data file breaks the format. Each variant is a rule of SPEC.md.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// The file is shorter than the 128-byte header.
    #[error("manifest is {0} bytes, shorter than the 128-byte header")]
    TooShort(usize),
    /// Magic bytes differ from `GDSLLM\0\x01`.
    #[error("bad magic {0:02x?}: not a GdsLLM manifest")]
    BadMagic([u8; 8]),
    /// Major version this reader does not know.
    #[error("unsupported format version {major}.{minor} (this reader supports 1.x)")]
    UnsupportedVersion {
        /// Major version found.
        major: u16,
        /// Minor version found.
        minor: u16,
    },
    /// `header_size` smaller than the header this version defines.
    #[error("header_size {size} is smaller than the {min} bytes of a version 1.{minor} header")]
    HeaderTooSmall {
        /// Declared header size.
        size: u32,
        /// Smallest header of that minor version.
        min: u32,
        /// Minor version of the file.
        minor: u16,
    },
    /// `header_size` runs past the end of the manifest.
    #[error("header_size {size} runs past the end of the {len}-byte manifest")]
    HeaderPastEnd {
        /// Declared header size.
        size: u32,
        /// Manifest length.
        len: u64,
    },
    /// A file-table entry (1.1) breaks a rule.
    #[error("file {path:?}: {why}")]
    BadFile {
        /// Path (or index if the path is unreadable).
        path: String,
        /// What is wrong.
        why: String,
    },
    /// The manifest's bytes outside the header and the tables are not all zero, or tables
    /// overlap.
    #[error("manifest layout: {0}")]
    Layout(String),
    /// `manifest_size` differs from the actual length, or exceeds the cap.
    #[error("manifest_size field says {declared} bytes but the file has {actual}")]
    SizeMismatch {
        /// Declared length.
        declared: u64,
        /// Actual length.
        actual: u64,
    },
    /// The manifest is larger than [`crate::raw::MAX_MANIFEST_BYTES`].
    #[error("manifest of {0} bytes exceeds the 64 MiB limit")]
    TooLarge(u64),
    /// The stored checksum does not match the bytes.
    #[error("manifest checksum mismatch (file is corrupt or was edited)")]
    ChecksumMismatch,
    /// A table lies outside the manifest, overlaps the header, or has too small a record.
    #[error("{table} table is out of bounds or malformed: {why}")]
    BadSection {
        /// Which table.
        table: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A string reference is outside the string table or not UTF-8.
    #[error("{what}: string reference out of bounds or not UTF-8")]
    BadString {
        /// Which record holds the reference.
        what: String,
    },
    /// A key/value entry is malformed.
    #[error("key/value entry {index}: {why}")]
    BadKv {
        /// Entry index.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// A layer entry breaks a rule.
    #[error("layer {name:?}: {why}")]
    BadLayer {
        /// Layer name (or index if the name is unreadable).
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A tensor entry breaks a rule.
    #[error("tensor {name:?}: {why}")]
    BadTensor {
        /// Tensor name (or index if the name is unreadable).
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A required key is absent or has the wrong type.
    #[error("metadata key {key:?}: {why}")]
    MissingKey {
        /// The key.
        key: String,
        /// Absent, or of which type.
        why: String,
    },
}
