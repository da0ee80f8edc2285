#![doc = include_str!("../README.md")]

pub mod arch;
pub mod chat_template;
mod dtype;
mod error;
pub mod quiet_panic;
pub mod raw;
pub mod reader;
pub mod render_memory;
pub mod tokenizer_speed;
pub mod validate;
pub mod vocab;
pub mod writer;

pub use dtype::{DType, ALL_DTYPES, IQ_GRID_DTYPES};
pub use error::FormatError;
pub use raw::file_role;
pub use raw::{layer_kind, ALIGNMENT, MANIFEST_FILE, MAX_DIMS, RERANK_TEMPLATE_KEY};
pub use reader::{FileInfo, LayerInfo, Manifest, TensorInfo, Value};
pub use writer::{align_up, layout, LayerLayout, LayerRecord, ManifestBuilder, TensorSpec};

/// Unit tests run under the allocator the binaries install, so the chat template tests
/// exercise its memory bound.
#[cfg(test)]
#[global_allocator]
static ALLOC: render_memory::TemplateAllocator =
    render_memory::TemplateAllocator(std::alloc::System);
