#![doc = include_str!("../README.md")]

mod check;
pub mod convert;
mod error;
pub mod gguf;
pub mod imatrix;
pub mod inspect;
mod limits;
pub mod names;
pub mod safetensors;
pub mod source;
pub mod staging;
pub mod tokenizer;
pub mod validate;

pub use convert::{
    convert, open_source, ConvertOptions, ConvertSummary, NoProgress, Progress, QuantMix,
    QuantOverride, QuantTarget,
};
pub use error::{ConvertError, ErrorKind};
pub use validate::{validate_dir, Depth, Report};
