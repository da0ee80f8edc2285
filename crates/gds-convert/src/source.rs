//! What every input reader produces: a model described with canonical names and row-major
//! shapes, whose tensor bytes stay in the memory-mapped input until the writer asks.

use gds_format::DType;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Hyperparameters and other metadata, as typed key/values with the manifest's keys
/// (SPEC.md §5: `general.architecture`, `model.n_layers`, ...). Ordered, so output is
/// deterministic.
pub type Metadata = BTreeMap<String, MetaValue>;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Unsigned integer.
    U64(u64),
    /// Signed integer.
    I64(i64),
    /// Float.
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// String.
    Str(String),
}

/// How the stored bytes must be changed on the way out.
#[derive(Clone, Debug, PartialEq)]
pub enum Transform {
    /// Bytes are written as stored (or requantized, if the user asked).
    None,
    /// Hugging Face llama Q/K projection: rows reordered from the "rotate half" RoPE layout
    /// to ggml's interleaved layout, `n_head` heads (`n_kv_head` for K). Row permutation, so
    /// it works for any dtype.
    PermuteRope {
        /// Heads in this projection.
        n_head: u64,
    },
    /// A Hugging Face Gemma norm weight, used there as `x̂·(1 + w)`: written as `1 + w` in
    /// F32 (the canonical `x̂·w`, as llama.cpp's converter writes it).
    NormOffset,
}

/// A tensor as a reader found it.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    /// Canonical name (`blk.3.attn_q.weight`); original name if the architecture is unknown.
    pub name: String,
    /// The name in the input file, for error messages.
    pub source_name: String,
    /// Stored dtype.
    pub dtype: DType,
    /// Row-major shape (outermost first).
    pub shape: Vec<u64>,
    /// The input file holding the bytes.
    pub file: Arc<MappedFile>,
    /// Byte offset of the data in that file.
    pub offset: u64,
    /// Byte length, computed from dtype and shape (never trusted from the input).
    pub nbytes: u64,
    /// Change to apply when writing.
    pub transform: Transform,
}

impl SourceTensor {
    /// The tensor's stored bytes, bounds already checked by the reader.
    pub fn bytes(&self) -> &[u8] {
        &self.file.map[self.offset as usize..(self.offset + self.nbytes) as usize]
    }
}

/// A memory-mapped input file.
#[derive(Debug)]
pub struct MappedFile {
    /// Path, for messages.
    pub path: PathBuf,
    /// The mapping.
    pub map: Mmap,
}

impl MappedFile {
    /// Tells the kernel we are done with `len` bytes at `offset`, so converted layers do not
    /// accumulate in our resident set (peak memory stays near one layer, not the model).
    pub fn release(&self, offset: u64, len: u64) {
        let start = (offset / 4096 * 4096) as usize;
        let end = ((offset + len) as usize).min(self.map.len());
        if end <= start {
            return;
        }
        // SAFETY: the mapping is a read-only, file-backed map. MADV_DONTNEED only drops our
        // copies of the pages; a later access re-reads them from the unchanged file, so no
        // Rust reference can observe different bytes.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}

/// Tokenizer material that goes into the output directory.
#[derive(Clone, Debug, Default)]
pub struct TokenizerFiles {
    /// Contents of `tokenizer.json` (Hugging Face `tokenizers` format).
    pub tokenizer_json: Option<String>,
    /// Contents of `tokenizer_config.json` (chat template, special tokens).
    pub tokenizer_config_json: Option<String>,
    /// Contents of `generation_config.json`, when the input has one.
    pub generation_config_json: Option<String>,
    /// True when `tokenizer_json` was built by the `tokenizers` library itself (GGUF
    /// export), so the converter need not load it again to check it.
    pub built: bool,
}

/// A whole model as read from its input.
#[derive(Debug)]
pub struct Source {
    /// Canonical architecture family (`llama`) or the input's own name when unknown.
    pub arch: String,
    /// True when `gdsrun` can run this architecture.
    pub runnable: bool,
    /// Metadata for the manifest.
    pub metadata: Metadata,
    /// Where the input states each `model.*` hyperparameter (`model.n_layers` →
    /// `llama.block_count`), for error messages; keys the reader derived are absent.
    pub hparam_origin: BTreeMap<String, String>,
    /// Tensors in a deterministic order.
    pub tensors: Vec<SourceTensor>,
    /// Tokenizer files.
    pub tokenizer: TokenizerFiles,
    /// Warnings for the user (unknown architecture, ignored tensors, ...).
    pub warnings: Vec<String>,
}
