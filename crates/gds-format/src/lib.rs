//! The GdsLLM on-disk format, version 1 (see `SPEC.md` at the repository root).
//!
//! A model directory holds one binary manifest and one flat data file per layer. This crate
//! knows the bytes and nothing else: it parses a manifest held in memory into zero-copy
//! views ([`Manifest`]), checks every rule of the spec ([`validate`]), and builds manifests
//! ([`ManifestBuilder`]). It does no file I/O, so a third party can use it alone. It also
//! holds the one policy for chat templates, code that comes with a model ([`chat_template`]).

pub mod arch;
pub mod chat_template;
mod dtype;
mod error;
pub mod raw;
pub mod reader;
pub mod render_memory;
pub mod validate;
pub mod vocab;
pub mod writer;

pub use dtype::{DType, ALL_DTYPES};
pub use error::FormatError;
pub use raw::file_role;
pub use raw::{layer_kind, ALIGNMENT, MANIFEST_FILE, MAX_DIMS};
pub use reader::{FileInfo, LayerInfo, Manifest, TensorInfo, Value};
pub use writer::{align_up, layout, LayerLayout, LayerRecord, ManifestBuilder, TensorSpec};

/// Unit tests run under the allocator the binaries install, so the chat template tests
/// exercise its memory bound.
#[cfg(test)]
#[global_allocator]
static ALLOC: render_memory::TemplateAllocator =
    render_memory::TemplateAllocator(std::alloc::System);
