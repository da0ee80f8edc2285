//! What every input reader produces: a model described with canonical names and row-major
//! shapes, whose tensor bytes stay in the memory-mapped input until the writer asks.

use gds_format::DType;
use memmap2::Mmap;
use std::borrow::Cow;
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
    /// Further equal parts stacked after the first (file, offset), each `nbytes / (1 +
    /// stacked.len())` bytes: a mixture of experts' per-expert tensors of a Hugging Face
    /// checkpoint, written as one `[experts, rows, cols]` tensor. Empty for every other tensor.
    pub stacked: Vec<(Arc<MappedFile>, u64)>,
}

impl SourceTensor {
    /// The tensor's stored bytes, bounds already checked by the reader: in place in the
    /// input's mapping, or, for a stacked tensor, its parts copied one after another.
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        if self.stacked.is_empty() {
            return Cow::Borrowed(
                &self.file.map[self.offset as usize..(self.offset + self.nbytes) as usize],
            );
        }
        let part = self.part_bytes() as usize;
        let mut out = Vec::with_capacity(self.nbytes as usize);
        for (file, offset) in self.parts() {
            out.extend_from_slice(&file.map[offset as usize..offset as usize + part]);
        }
        Cow::Owned(out)
    }

    /// Bytes of one stacked part (the whole tensor when nothing is stacked).
    fn part_bytes(&self) -> u64 {
        self.nbytes / (1 + self.stacked.len() as u64)
    }

    /// Every part's file and offset, the first one included.
    fn parts(&self) -> impl Iterator<Item = (&MappedFile, u64)> {
        std::iter::once((&*self.file, self.offset))
            .chain(self.stacked.iter().map(|(f, o)| (&**f, *o)))
    }

    /// Drops the input pages of every part from memory (see [`MappedFile::release`]).
    pub fn release(&self) {
        let part = self.part_bytes();
        for (file, offset) in self.parts() {
            file.release(offset, part);
        }
    }
}

/// A memory-mapped input file.
#[derive(Debug)]
pub struct MappedFile {
    /// Path, for messages.
    pub path: PathBuf,
    /// The mapping.
    pub map: Mmap,
    /// Whether the bytes live only in this mapping (an anonymous one, [`MappedFile::from_bytes`]):
    /// [`MappedFile::release`] then keeps them, as dropping its pages would zero them.
    pub anon: bool,
}

impl MappedFile {
    /// Tells the kernel we are done with `len` bytes at `offset`, so converted layers do not
    /// accumulate in our resident set (peak memory stays near one layer, not the model).
    pub fn release(&self, offset: u64, len: u64) {
        if self.anon {
            return;
        }
        let Some((start, n)) = self.pages(offset, len) else {
            return;
        };
        // SAFETY: the mapping is a read-only, file-backed map. MADV_DONTNEED only drops our
        // copies of the pages; a later access re-reads them from the unchanged file, so no
        // Rust reference can observe different bytes.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, n)
        };
    }
}

impl MappedFile {
    /// Maps `len` bytes at `offset` in (`MADV_POPULATE_READ`; ignored where the kernel lacks
    /// it) before they are read whole: one call instead of a page fault per few pages, and
    /// a `write(2)` from the mapping then copies without faulting in the middle (a fault
    /// there makes the kernel zero the new page cache pages and retry the copy).
    pub fn populate(&self, offset: u64, len: u64) {
        if let Some((start, n)) = self.pages(offset, len) {
            let _ = self
                .map
                .advise_range(memmap2::Advice::PopulateRead, start, n);
        }
    }

    /// The pages under `len` bytes at `offset` (from the page holding `offset`, up to the
    /// end of the mapping), as (start, length); `None` when empty.
    fn pages(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        let start = (offset / 4096 * 4096) as usize;
        let end = ((offset + len) as usize).min(self.map.len());
        (end > start).then(|| (start, end - start))
    }

    /// Bytes a reader computed (e.g. LongRoPE factors listed in `config.json`), held in an
    /// anonymous mapping so that they are a [`SourceTensor`] like any other; `path` names
    /// where they came from, for messages.
    pub fn from_bytes(path: PathBuf, bytes: &[u8]) -> std::io::Result<MappedFile> {
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1))?;
        map[..bytes.len()].copy_from_slice(bytes);
        Ok(MappedFile {
            path,
            map: map.make_read_only()?,
            anon: true,
        })
    }
}

impl SourceTensor {
    /// A 1-D F32 tensor of `values` that a reader computed, named `name` (`source_name` says
    /// where in the input the values are).
    pub fn f32_vector(
        name: &str,
        source_name: String,
        path: PathBuf,
        values: &[f32],
    ) -> std::io::Result<SourceTensor> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let file = Arc::new(MappedFile::from_bytes(path, &bytes)?);
        Ok(SourceTensor {
            name: name.to_string(),
            source_name,
            dtype: DType::F32,
            shape: vec![values.len() as u64],
            file,
            offset: 0,
            nbytes: bytes.len() as u64,
            transform: Transform::None,
            stacked: Vec::new(),
        })
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

/// Tokenizer work not done yet: building `tokenizer.json` from a GGUF's embedded vocabulary
/// (262k tokens for Gemma 3) takes about as long as writing the weights, so
/// [`crate::convert()`] runs it on a thread beside them. Gives the files and any warnings.
pub struct PendingTokenizer(Box<dyn FnOnce() -> (TokenizerFiles, Vec<String>) + Send>);

impl PendingTokenizer {
    /// Work that `run` will do.
    pub fn new(f: impl FnOnce() -> (TokenizerFiles, Vec<String>) + Send + 'static) -> Self {
        PendingTokenizer(Box::new(f))
    }

    /// Does the work.
    pub fn run(self) -> (TokenizerFiles, Vec<String>) {
        (self.0)()
    }
}

impl std::fmt::Debug for PendingTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingTokenizer")
    }
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
    /// Tokenizer files (empty until `pending_tokenizer` has run, where it is set).
    pub tokenizer: TokenizerFiles,
    /// Tokenizer files still to be built ([`Source::finish_tokenizer`]).
    pub pending_tokenizer: Option<PendingTokenizer>,
    /// Warnings for the user (unknown architecture, ignored tensors, ...).
    pub warnings: Vec<String>,
}

impl Source {
    /// Builds the tokenizer files now, if that was left for later.
    pub fn finish_tokenizer(&mut self) {
        if let Some(p) = self.pending_tokenizer.take() {
            let (files, warnings) = p.run();
            self.tokenizer = files;
            self.warnings.extend(warnings);
        }
    }
}

/// A fused tensor that cannot be split as its family describes.
#[derive(Debug)]
pub struct SplitError {
    /// The input file.
    pub path: PathBuf,
    /// The tensor's name in the input.
    pub tensor: String,
    /// What is wrong.
    pub reason: String,
}

/// Splits the family's fused tensors (`FamilySpec::fused`, e.g. Phi-3's `attn_qkv`) by rows
/// into their parts, each as many rows as `dim` gives for its shape symbol. Rows of every
/// dtype are whole blocks, so each part is a byte range of the same mapped input: nothing is
/// copied. The parts replace the fused tensor at its place in `tensors`.
pub fn split_fused(
    tensors: &mut Vec<SourceTensor>,
    spec: &gds_format::arch::FamilySpec,
    dim: impl Fn(&str) -> Option<u64>,
) -> Result<(), SplitError> {
    if spec.fused.is_empty() {
        return Ok(());
    }
    let mut out = Vec::with_capacity(tensors.len() + tensors.len() / 2);
    for t in tensors.drain(..) {
        let Some((n, parts)) = spec.fused.iter().find_map(|(pattern, parts)| {
            crate::names::match_pattern(pattern, &t.name).map(|n| (n, parts))
        }) else {
            out.push(t);
            continue;
        };
        let err = |reason: String| SplitError {
            path: t.file.path.clone(),
            tensor: t.source_name.clone(),
            reason,
        };
        let rows: Vec<u64> = parts.iter().map(|(_, sym)| dim(sym).unwrap_or(0)).collect();
        let total = rows.iter().try_fold(0u64, |a, &r| a.checked_add(r));
        let [fused_rows, cols] = t.shape[..] else {
            return Err(err(format!(
                "shape {:?} is not a matrix: it cannot be split into {}",
                t.shape,
                parts
                    .iter()
                    .map(|p| p.0.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        if total != Some(fused_rows) || rows.contains(&0) {
            return Err(err(format!(
                "{fused_rows} rows, but the hyperparameters give {} = {} rows",
                parts
                    .iter()
                    .zip(&rows)
                    .map(|((_, sym), r)| format!("{sym} {r}"))
                    .collect::<Vec<_>>()
                    .join(" + "),
                total.map_or("(overflow)".to_string(), |t| t.to_string())
            )));
        }
        let mut offset = t.offset;
        for ((part, _), &r) in parts.iter().zip(&rows) {
            // whole rows of a valid tensor: cannot fail once the total matched
            let nbytes = t
                .dtype
                .tensor_bytes(&[r, cols])
                .ok_or_else(|| err(format!("{r} rows of {cols} {} do not fit", t.dtype)))?;
            let name = match n {
                Some(n) => part.replace("{N}", &n.to_string()),
                None => part.clone(),
            };
            out.push(SourceTensor {
                source_name: format!("{} (its {name} rows)", t.source_name),
                name,
                dtype: t.dtype,
                shape: vec![r, cols],
                file: t.file.clone(),
                offset,
                nbytes,
                transform: t.transform.clone(),
                stacked: Vec::new(),
            });
            offset += nbytes;
        }
    }
    *tensors = out;
    Ok(())
}
