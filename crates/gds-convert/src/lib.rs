//! Conversion of GGUF files and safetensors checkpoints into the GdsLLM format, and the
//! directory-level `validate` and `inspect` behind `gdsconv`.
//!
//! Readers ([`gguf`], [`safetensors`]) produce a [`source::Source`]: canonical names, row-major
//! shapes, bytes still in the memory-mapped input. [`convert::convert`] streams it out layer
//! by layer into a temporary directory and renames it into place.

mod check;
pub mod convert;
mod error;
pub mod gguf;
pub mod inspect;
mod limits;
pub mod names;
pub mod safetensors;
pub mod source;
mod staging;
pub mod tokenizer;
pub mod validate;

pub use convert::{
    convert, open_source, ConvertOptions, ConvertSummary, NoProgress, Progress, QuantTarget,
};
pub use error::{ConvertError, ErrorKind};
pub use validate::{validate_dir, Depth, Report};
