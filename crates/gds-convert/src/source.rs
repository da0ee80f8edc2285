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

/// The unsigned integer `key` of `md` (a `model.*` count the reader wrote: the one record of
/// the hyperparameters during conversion; the manifest's `gds_format::arch::Hparams` is
/// read from it); `None` when absent or of another type.
pub fn meta_u64(md: &Metadata, key: &str) -> Option<u64> {
    match md.get(key) {
        Some(MetaValue::U64(v)) => Some(*v),
        _ => None,
    }
}

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
    /// Where the bytes are: `nbytes` at (file, offset), or made from parts of the input.
    pub layout: Layout,
}

/// Where a tensor's bytes are in the input.
#[derive(Clone, Debug)]
pub enum Layout {
    /// `nbytes` bytes at (file, offset), as written.
    Plain,
    /// Further equal parts stacked after the first (file, offset), each `nbytes / (1 +
    /// parts)` bytes: a mixture of experts' per-expert tensors of a Hugging Face checkpoint,
    /// written as one `[experts, rows, cols]` tensor.
    Stacked(Vec<(Arc<MappedFile>, u64)>),
    /// Gathered from one stored tensor at (file, offset): see [`Gather`].
    Gathered(Gather),
}

/// A tensor gathered from parts of stored ones: gpt-oss's experts, which Hugging Face stores
/// fused and, in the published checkpoints, in MXFP4 blocks of its own layout.
#[derive(Clone, Debug)]
pub enum Gather {
    /// `n` matrices of `rows x cols` elements of `elem` bytes stored at (file, offset): of
    /// each, the columns `part`, `part + step`, ..., transposed, so this tensor is
    /// `[n, cols / step, rows]` (`step` 1: the transpose, as `down_proj [E, ff, d]` becomes
    /// `ffn_down_exps [E, d, ff]`; `step` 2: `gate_up_proj [E, d, 2 ff]`'s gate (even
    /// columns) or up (odd) half, a bias being `rows` 1).
    Columns {
        n: u64,
        rows: u64,
        cols: u64,
        elem: u64,
        step: u64,
        part: u64,
    },
    /// MXFP4 as Hugging Face stores it: blocks `[n, rows, groups, 16]` at (file, offset), two
    /// 4-bit values a byte (low nibble first), and one E8M0 scale byte a group, `[n, rows,
    /// groups]` at `scales`: of each matrix the rows `part`, `part + step`, ... (gate_up's
    /// gate and up rows alternate), as GGUF's MXFP4 blocks (scale byte, then value `j` in
    /// byte `j`'s low nibble and value `j + 16` in its high one).
    Mxfp4 {
        scales: Arc<MappedFile>,
        scales_offset: u64,
        n: u64,
        rows: u64,
        groups: u64,
        step: u64,
        part: u64,
    },
}

/// [`Gather::Columns`] of `E`-byte elements from `src` into `out`: for each `rows x cols`
/// matrix, the columns `part`, `part + step`, ... transposed; `shape` is (rows, cols, step,
/// part). In 32 x 32 tiles, so that both sides stay in cache (a gpt-oss-20b `gate_up_proj`
/// is 32 matrices of 2880 x 5760).
fn columns<const E: usize>(src: &[u8], out: &mut [u8], shape: (usize, usize, usize, usize)) {
    const TILE: usize = 32;
    let (rows, cols, step, part) = shape;
    let taken = cols / step;
    for (m, o) in src
        .chunks_exact(rows * cols * E)
        .zip(out.chunks_exact_mut(taken * rows * E))
    {
        for r0 in (0..rows).step_by(TILE) {
            for c0 in (0..taken).step_by(TILE) {
                for c in c0..(c0 + TILE).min(taken) {
                    let col = c * step + part;
                    for r in r0..(r0 + TILE).min(rows) {
                        let at = (r * cols + col) * E;
                        let to = (c * rows + r) * E;
                        o[to..to + E].copy_from_slice(&m[at..at + E]);
                    }
                }
            }
        }
    }
}

impl Gather {
    /// Bytes of the stored tensor (the blocks, for MXFP4).
    fn source_bytes(&self) -> u64 {
        match *self {
            Gather::Columns {
                n,
                rows,
                cols,
                elem,
                ..
            } => n * rows * cols * elem,
            Gather::Mxfp4 {
                n, rows, groups, ..
            } => n * rows * groups * 16,
        }
    }

    /// The tensor's bytes, gathered from `src` (the stored tensor's bytes).
    fn gather(&self, src: &[u8], scales: &[u8]) -> Vec<u8> {
        match *self {
            Gather::Columns {
                n,
                rows,
                cols,
                elem,
                step,
                part,
            } => {
                let (rows, cols) = (rows as usize, cols as usize);
                let (step, part) = (step as usize, part as usize);
                let mut out = vec![0u8; n as usize * (cols / step) * rows * elem as usize];
                let shape = (rows, cols, step, part);
                match elem {
                    2 => columns::<2>(src, &mut out, shape),
                    4 => columns::<4>(src, &mut out, shape),
                    _ => unreachable!("float elements are 2 or 4 bytes"),
                }
                out
            }
            Gather::Mxfp4 {
                n,
                rows,
                groups,
                step,
                part,
                ..
            } => {
                let (rows, groups) = (rows as usize, groups as usize);
                let taken = rows / step as usize;
                let mut out = Vec::with_capacity(n as usize * taken * groups * 17);
                for e in 0..n as usize {
                    for r in 0..taken {
                        let row = e * rows + r * step as usize + part as usize;
                        for g in 0..groups {
                            let q = &src[(row * groups + g) * 16..][..16];
                            out.push(scales[row * groups + g]);
                            // value k is byte k/2's low (k even) or high (k odd) nibble
                            let v = |k: usize| (q[k / 2] >> (4 * (k % 2))) & 0x0f;
                            out.extend((0..16).map(|j| v(j) | v(j + 16) << 4));
                        }
                    }
                }
                out
            }
        }
    }
}

impl SourceTensor {
    /// The tensor's bytes, bounds already checked by the reader: in place in the input's
    /// mapping, or, for a stacked or gathered tensor, made from its parts.
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        fn region(file: &MappedFile, offset: u64, len: u64) -> &[u8] {
            &file.map[offset as usize..(offset + len) as usize]
        }
        if let Layout::Plain = self.layout {
            return Cow::Borrowed(region(&self.file, self.offset, self.nbytes));
        }
        let parts: Vec<&[u8]> = self
            .parts()
            .into_iter()
            .map(|(file, offset, len)| region(file, offset, len))
            .collect();
        Cow::Owned(match &self.layout {
            // the source, then (MXFP4) its scales
            Layout::Gathered(g) => g.gather(parts[0], parts.get(1).copied().unwrap_or(&[])),
            _ => parts.concat(),
        })
    }

    /// Every stored region the bytes come from: file, offset, length.
    fn parts(&self) -> Vec<(&MappedFile, u64, u64)> {
        match &self.layout {
            Layout::Plain => vec![(&*self.file, self.offset, self.nbytes)],
            Layout::Stacked(rest) => {
                let part = self.nbytes / (1 + rest.len() as u64);
                std::iter::once((&*self.file, self.offset, part))
                    .chain(rest.iter().map(|(f, o)| (&**f, *o, part)))
                    .collect()
            }
            Layout::Gathered(g) => {
                let mut v = vec![(&*self.file, self.offset, g.source_bytes())];
                if let Gather::Mxfp4 {
                    scales,
                    scales_offset,
                    n,
                    rows,
                    groups,
                    ..
                } = g
                {
                    v.push((&**scales, *scales_offset, n * rows * groups));
                }
                v
            }
        }
    }

    /// Drops the input pages of every part from memory (see [`MappedFile::release`]).
    pub fn release(&self) {
        for (file, offset, len) in self.parts() {
            file.release(offset, len);
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
            layout: Layout::Plain,
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

/// Per-expert tensors `parts` (expert number, tensor) as the stacked `[n, rows, cols]` tensor
/// `name`, each part in place in its file (a mixture's experts as a Hugging Face checkpoint,
/// or an older GGUF, stores them): experts `0..n`, each once, all 2-D of one dtype and shape.
/// `count` says where `n` comes from, for the message. Empty `parts` are a caller's error.
pub fn stack_experts(
    name: String,
    mut parts: Vec<(u64, SourceTensor)>,
    n: u64,
    count: &str,
) -> Result<SourceTensor, SplitError> {
    parts.sort_by_key(|(e, _)| *e);
    let bad = |t: &SourceTensor, reason: String| SplitError {
        path: t.file.path.clone(),
        tensor: t.source_name.clone(),
        reason,
    };
    let first = &parts[0].1;
    let numbers: Vec<u64> = parts.iter().map(|(e, _)| *e).collect();
    if !numbers.iter().copied().eq(0..n) {
        return Err(bad(
            first,
            format!("the experts of {name} are {numbers:?}; {count} {n} needs each of 0..{n} once"),
        ));
    }
    if let Some((_, t)) = parts
        .iter()
        .find(|(_, t)| t.shape.len() != 2 || t.shape != first.shape || t.dtype != first.dtype)
    {
        return Err(bad(
            t,
            format!(
                "shape {:?} {} differs from expert 0's {:?} {} (experts are stacked into {name})",
                t.shape, t.dtype, first.shape, first.dtype
            ),
        ));
    }
    let mut it = parts.into_iter().map(|(_, t)| t);
    let mut t = it.next().expect("at least one part");
    let rest: Vec<_> = it.map(|p| (p.file, p.offset)).collect();
    let (rows, cols) = (t.shape[0], t.shape[1]);
    t.source_name = format!("{} (experts 0..{n} stacked)", t.source_name);
    t.name = name;
    t.shape = vec![n, rows, cols];
    t.nbytes = t
        .dtype
        .tensor_bytes(&t.shape)
        .ok_or_else(|| bad(&t, format!("{n} experts of {rows} x {cols} do not fit")))?;
    t.layout = Layout::Stacked(rest);
    Ok(t)
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
                layout: Layout::Plain,
            });
            offset += nbytes;
        }
    }
    *tensors = out;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Columns gathered in tiles equal the definition, element by element: out[m][c][r] =
    /// in[m][r][c·step + part], for shapes that are not multiples of the tile.
    #[test]
    fn columns_are_gathered_and_transposed() {
        for (n, rows, cols, elem, step, part) in [
            (3u64, 45u64, 70u64, 2u64, 2u64, 1u64),
            (2, 33, 64, 4, 2, 0),
            (1, 1, 10, 4, 2, 1),
            (2, 70, 33, 2, 1, 0),
        ] {
            let src: Vec<u8> = (0..n * rows * cols * elem)
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            let g = Gather::Columns {
                n,
                rows,
                cols,
                elem,
                step,
                part,
            };
            let got = g.gather(&src, &[]);
            let (rows, cols, elem) = (rows as usize, cols as usize, elem as usize);
            let taken = cols / step as usize;
            let mut want = Vec::new();
            for m in 0..n as usize {
                for c in 0..taken {
                    for r in 0..rows {
                        let at = ((m * rows + r) * cols + c * step as usize + part as usize) * elem;
                        want.extend_from_slice(&src[at..at + elem]);
                    }
                }
            }
            assert_eq!(got, want, "{n} x {rows} x {cols}, step {step}, part {part}");
        }
    }

    /// The time to gather gpt-oss-20b's gate from one block's bf16 `gate_up_proj` (32 experts
    /// of 2880 x 5760): `cargo test --release -p gds-convert --lib -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn columns_gather_speed() {
        let (n, rows, cols) = (32u64, 2880u64, 5760u64);
        let src = vec![1u8; (n * rows * cols * 2) as usize];
        let g = Gather::Columns {
            n,
            rows,
            cols,
            elem: 2,
            step: 2,
            part: 0,
        };
        let t = std::time::Instant::now();
        let out = g.gather(&src, &[]);
        let s = t.elapsed().as_secs_f64();
        eprintln!(
            "gathered {} MB from {} MB in {s:.2} s ({:.2} GB/s of output)",
            out.len() >> 20,
            src.len() >> 20,
            out.len() as f64 / s / 1e9
        );
    }
}
