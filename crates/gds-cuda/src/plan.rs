//! What the GPU executor will hold in VRAM, decided before any CUDA call: the model's
//! layout (from the manifest; no weights are read) and the VRAM plan for a budget. Pure
//! Rust, so it builds and is tested without the `cuda` feature.
//!
//! Policy: the embedding and head layers are always resident (every token needs them);
//! then the KV cache and scratch buffers; if the blocks do not all fit, two streaming slots
//! (each the size of the largest block) are reserved and blocks are resident in execution
//! order while the budget lasts. The rest are read into the slots for every token.

use crate::kernels::kernel_suffix;
use crate::GpuError;
use gds_format::arch::{Hparams, RopeScaling, RopeStyle};
use gds_format::{layer_kind, DType, Manifest};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Tokens per forward call the scratch buffers are sized for (prefill chunk).
pub const MAX_BATCH: usize = 512;

/// Most f32 elements of the GEMM prefill's dequantization tile (128 MiB): a larger matrix is
/// dequantized and multiplied a run of rows at a time (`forward::Pass::linears`), so the tile
/// is not the size of the largest weight (a Llama 3 8B head, 128k × 4096, would need 2 GiB).
pub const TILE_MAX_ELEMENTS: usize = 32 << 20;

/// Most positions of one forward call that get logits ([`Layout::logit_rows`]): the sampled
/// token and up to 15 guesses of a speculative pass.
pub const MAX_LOGIT_ROWS: usize = 16;

/// The hyperparameters the executor sizes its buffers and shared kernels by, from the
/// manifest (what differs between architectures is the graph's: `forward::BlockGraph`).
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Feed-forward width.
    pub n_ff: usize,
    /// Vocabulary size (rows of the output head).
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// Leading dimensions of each head that RoPE rotates (`head_dim` unless partial).
    pub rope_dims: usize,
    /// RoPE rotates the halves of a head (NEOX) rather than adjacent pairs.
    pub rope_neox: bool,
    /// The manifest's RoPE scaling: scaled tables must come from the runtime.
    pub rope_scaling: RopeScaling,
    /// Per block: the sliding window (a query at position p sees keys above p − window),
    /// 0 for a block that attends to the whole context.
    pub windows: Vec<usize>,
    /// A mixture of experts' sizes (`None`: dense feed-forward blocks).
    pub moe: Option<MoeShape>,
}

/// The sizes a mixture of experts' buffers are made by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Experts per block.
    pub n_expert: usize,
    /// Experts each token goes to.
    pub n_expert_used: usize,
    /// Hidden width of one expert.
    pub n_ff_exp: usize,
}

impl Shape {
    /// The widest hidden width of a feed-forward network: `n_ff`, or an expert's where wider.
    pub fn ff_width(&self) -> usize {
        self.n_ff.max(self.moe.map_or(0, |m| m.n_ff_exp))
    }

    /// The widest activation row a matrix product reads: `n_embd`, the FFN's hidden width
    /// or the queries'.
    pub fn widest(&self) -> usize {
        self.n_embd
            .max(self.ff_width())
            .max(self.n_heads * self.head_dim)
    }
}

/// A tensor as a byte range of its layer file (and so of the layer's device buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    /// Index of the layer holding it.
    pub layer: usize,
    /// Offset in the layer file.
    pub offset: usize,
    /// Byte length.
    pub nbytes: usize,
    /// On-disk dtype.
    pub dtype: DType,
    /// Rows (product of all but the last dimension).
    pub rows: usize,
    /// Columns (last dimension).
    pub cols: usize,
}

/// One layer file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerMeta {
    /// Absolute path of the data file.
    pub path: PathBuf,
    /// Its length (a multiple of 4096).
    pub size: usize,
}

/// The model as the executor needs it.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Hyperparameters.
    pub shape: Shape,
    /// Every layer file, in manifest order.
    pub layers: Vec<LayerMeta>,
    /// Tensors by canonical name.
    pub tensors: HashMap<String, TensorMeta>,
    /// Layer index of the embedding.
    pub embed: usize,
    /// Layer index of the head.
    pub head: usize,
    /// Layer index of each block, in block order.
    pub blocks: Vec<usize>,
    /// The output projection (`output.weight`, or `token_embd.weight` when tied).
    pub output: TensorMeta,
}

fn model_err(msg: impl Into<String>) -> GpuError {
    GpuError::Model(msg.into())
}

/// The hyperparameters, read through the format's one typed, range-checked reader
/// (`gds_format::arch`).
fn read_shape(m: &Manifest<'_>) -> Result<Shape, GpuError> {
    let arch = m.get_str("general.architecture").unwrap_or("?");
    let h = gds_format::arch::hparams(m, arch).map_err(|errs| {
        model_err(
            errs.iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        )
    })?;
    Shape::from_hparams(&h)
}

impl Shape {
    /// The executor's view of the format's [`Hparams`] (its only source: nothing here reads
    /// a manifest key). Every dimension there is at most 2^24, so the conversions cannot
    /// truncate.
    pub fn from_hparams(h: &Hparams) -> Result<Shape, GpuError> {
        let u = |v: u64| usize::try_from(v).map_err(|_| model_err(format!("{v} is too large")));
        Ok(Shape {
            n_layers: u(h.n_layers)?,
            n_embd: u(h.n_embd)?,
            n_heads: u(h.n_heads)?,
            n_kv_heads: u(h.n_kv_heads)?,
            head_dim: u(h.head_dim)?,
            n_ff: u(h.n_ff)?,
            vocab: u(h.vocab_size)?,
            eps: h.rms_norm_eps as f32,
            rope_theta: h.rope_theta,
            rope_dims: u(h.rope_dims)?,
            rope_neox: h.rope_style == RopeStyle::Neox,
            rope_scaling: h.rope_scaling,
            windows: (0..h.n_layers)
                .map(|il| match h.sliding_window {
                    Some(w) if h.is_window_layer(il) => u(w),
                    _ => Ok(0),
                })
                .collect::<Result<_, _>>()?,
            moe: match &h.moe {
                Some(m) => Some(MoeShape {
                    n_expert: u(m.n_expert)?,
                    n_expert_used: u(m.n_expert_used)?,
                    n_ff_exp: u(m.n_ff_exp)?,
                }),
                None => None,
            },
        })
    }
}

fn size(v: u64, what: &str) -> Result<usize, GpuError> {
    usize::try_from(v).map_err(|_| model_err(format!("{what} {v} does not fit in memory")))
}

impl Layout {
    /// Reads `dir/manifest.gdsm` (metadata only): see [`Layout::from_manifest`].
    pub fn read(dir: &Path) -> Result<Layout, GpuError> {
        let mpath = dir.join("manifest.gdsm");
        let bytes = gds_io::read_manifest(dir).map_err(|e| GpuError::Io {
            path: mpath.display().to_string(),
            error: std::io::Error::other(e.to_string()),
        })?;
        // Every structural and architecture rule, as at every open of the CPU runtime; the
        // architecture check reads the hyperparameters, which then size the layout (read once).
        let (m, mut errs) = gds_format::validate::validate_manifest(&bytes);
        let mut hparams = None;
        if let (Some(m), true) = (&m, errs.is_empty()) {
            let check = gds_format::arch::check_model(m);
            errs.extend(check.errors);
            hparams = check.hparams;
        }
        let m = match m {
            Some(m) if errs.is_empty() => m,
            _ => {
                return Err(model_err(format!(
                    "{}: {}",
                    mpath.display(),
                    errs.iter()
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                )))
            }
        };
        let shape = match hparams {
            Some(h) => Shape::from_hparams(&h)?,
            // an architecture the check does not know: the reader names what is wrong
            None => read_shape(&m)?,
        };
        Layout::with_shape(dir, &m, shape)
    }

    /// The layout of the model in `dir` whose manifest is `m`, checking that every tensor
    /// has a GPU kernel: matrices in Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4/F16/BF16/F32,
    /// norms and biases in F32.
    pub fn from_manifest(dir: &Path, m: &Manifest<'_>) -> Result<Layout, GpuError> {
        Layout::with_shape(dir, m, read_shape(m)?)
    }

    /// [`Layout::from_manifest`] with the hyperparameters already read (`shape`, from `m`).
    fn with_shape(dir: &Path, m: &Manifest<'_>, shape: Shape) -> Result<Layout, GpuError> {
        let n_blocks = m.layers().filter(|l| l.kind == layer_kind::BLOCK).count();
        if n_blocks != shape.n_layers {
            // Compared before anything is sized by model.n_layers.
            return Err(model_err(format!(
                "model.n_layers is {} but the layer table has {n_blocks} blocks",
                shape.n_layers
            )));
        }
        let mut layers = Vec::new();
        let (mut embed, mut head, mut blocks) = (None, None, vec![None; shape.n_layers]);
        for l in m.layers() {
            match l.kind {
                layer_kind::EMBED => embed = Some(l.index),
                layer_kind::HEAD => head = Some(l.index),
                layer_kind::BLOCK => {
                    let b = l.block as usize;
                    *blocks
                        .get_mut(b)
                        .ok_or_else(|| model_err(format!("block {b} out of range")))? =
                        Some(l.index);
                }
                k => return Err(model_err(format!("unknown layer kind {k}"))),
            }
            layers.push(LayerMeta {
                path: dir.join(l.file),
                size: size(l.file_size, "layer file size")?,
            });
        }
        let embed = embed.ok_or_else(|| model_err("no embedding layer"))?;
        let head = head.ok_or_else(|| model_err("no head layer"))?;
        let blocks: Vec<usize> = blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| b.ok_or_else(|| model_err(format!("block {i} missing"))))
            .collect::<Result<_, _>>()?;
        let mut tensors = HashMap::new();
        for t in m.tensors() {
            let cols = size(*t.dims().last().unwrap_or(&1), "tensor width")?;
            let rows = size(t.n_elements(), "tensor elements")? / cols.max(1);
            let meta = TensorMeta {
                layer: t.layer,
                offset: size(t.offset, "tensor offset")?,
                nbytes: size(t.nbytes, "tensor size")?,
                dtype: t.dtype,
                rows,
                cols,
            };
            let is_matrix = t.n_dims >= 2;
            if is_matrix && kernel_suffix(t.dtype).is_none() {
                return Err(model_err(format!(
                    "{}: no GPU kernel for {} weights (supported: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K MXFP4 IQ4_NL IQ4_XS F16 BF16 F32; Q2_K, Q3_K and IQ1_S..IQ3_S run with --backend cpu)",
                    t.name, t.dtype
                )));
            }
            if !is_matrix && t.dtype != DType::F32 {
                return Err(model_err(format!(
                    "{}: expected F32, found {}",
                    t.name, t.dtype
                )));
            }
            tensors.insert(t.name.to_string(), meta);
        }
        let output = *tensors
            .get("output.weight")
            .or_else(|| tensors.get("token_embd.weight"))
            .ok_or_else(|| model_err("no output.weight or token_embd.weight"))?;
        Ok(Layout {
            shape,
            layers,
            tensors,
            embed,
            head,
            blocks,
            output,
        })
    }

    /// Elements of the GEMM prefill's dequantization tile: the largest weight a product
    /// reads ([`Layout::max_weight_elements`]) up to [`TILE_MAX_ELEMENTS`], and at least
    /// one row of the widest (larger weights are multiplied a run of rows at a time).
    pub fn tile_elements(&self) -> usize {
        let widest = self.tensors.values().map(|t| t.cols).max().unwrap_or(0);
        self.max_weight_elements()
            .min(TILE_MAX_ELEMENTS.max(widest))
    }

    /// Elements of the largest weight matrix a product reads: a mixture's stacked experts
    /// count one expert.
    pub fn max_weight_elements(&self) -> usize {
        let experts = self.shape.moe.map_or(1, |m| m.n_expert.max(1));
        self.tensors
            .iter()
            .map(|(name, t)| match gds_format::arch::is_routed_expert(name) {
                true => t.rows * t.cols / experts,
                false => t.rows * t.cols,
            })
            .max()
            .unwrap_or(0)
    }

    /// Positions whose logits one forward call can return for passes of up to `batch`
    /// positions: the last [`MAX_LOGIT_ROWS`] at most (speculative decoding checks the
    /// sampled token and its guesses in one pass, with logits at each).
    pub fn logit_rows(batch: usize) -> usize {
        batch.clamp(1, MAX_LOGIT_ROWS)
    }

    /// Positions one forward call takes for `ctx` positions when the executor allows
    /// `max_batch` (at least 1, at most `ctx`).
    pub fn batch(ctx: usize, max_batch: usize) -> usize {
        max_batch.min(ctx).max(1)
    }

    /// Rows of block `b`'s key (and value) cache for `ctx` positions and passes of up to
    /// `batch` positions: `ctx`, or for a sliding-window block a ring of
    /// `window + batch − 1` rows (position p at row p mod rows) when that is fewer. A pass
    /// writes its new keys before its queries read, and the earliest key its first query
    /// sees is `window − 1` positions before it, so the rows a pass touches never alias.
    pub fn kv_rows(&self, ctx: usize, batch: usize, b: usize) -> usize {
        match self.shape.windows.get(b) {
            Some(&w) if w > 0 => ctx.min(w.saturating_add(batch.max(1) - 1)),
            _ => ctx,
        }
    }

    /// Bytes of the one-sequence KV cache (f32 keys and values of every block) for `ctx`
    /// positions, window blocks keeping their rings ([`Layout::kv_rows`]).
    pub fn kv_bytes(&self, ctx: usize, batch: usize) -> usize {
        self.single_sequence_kv(ctx, batch).bytes(self.kv_dim())
    }

    /// Floats of one key (or value) row: `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.shape.n_kv_heads * self.shape.head_dim
    }

    /// The KV cache of one sequence of `ctx` positions with passes of up to `batch`: each
    /// block's cache is one block of [`Layout::kv_rows`] rows (the whole context, or a
    /// window block's ring, read as a ring of one table entry), found through one table
    /// holding block 0; f32 elements (set [`KvSpec::f16`] for f16).
    pub fn single_sequence_kv(&self, ctx: usize, batch: usize) -> KvSpec {
        let layers = (0..self.shape.n_layers)
            .map(|b| {
                let rows = self.kv_rows(ctx, batch, b);
                KvGeo {
                    block: rows.max(1),
                    blocks: 1,
                    ring: usize::from(rows < ctx),
                    table: 0,
                }
            })
            .collect();
        KvSpec {
            layers,
            max_blocks: vec![1],
            max_seqs: 1,
            f16: false,
        }
    }

    /// Bytes of VRAM besides weights: KV cache (f32, [`Layout::single_sequence_kv`]) and
    /// scratch, for `ctx` positions and passes of up to `batch` positions of one sequence.
    pub fn overhead_bytes(&self, ctx: usize, batch: usize) -> usize {
        let batch = batch.min(ctx).max(1);
        let kv = self.single_sequence_kv(ctx, batch);
        self.overhead_bytes_with(ctx, batch, Self::logit_rows(batch), &kv)
    }

    /// Bytes of VRAM besides weights for passes of up to `batch` positions of which up to
    /// `outputs` get logits, over the KV cache `kv`: the cache (in its element type), scratch,
    /// and the pass's tables.
    pub fn overhead_bytes_with(
        &self,
        ctx: usize,
        batch: usize,
        outputs: usize,
        kv: &KvSpec,
    ) -> usize {
        let s = &self.shape;
        let kv_dim = self.kv_dim();
        let widest = s.widest();
        // x, proj, xb, q, attn; k, v; gate, up; scores; logit rows; the GEMM tile; two RoPE
        // tables (global and window layers), cos and sin; positions, table rows, outputs
        // and the block tables (i32); a mixture's router logits, token rows and weights,
        // expert inputs and outputs; then the quantized activations
        let moe = s.moe.map_or(4, |m| {
            batch * (m.n_expert + 2 * m.n_expert_used + 2 * s.n_embd)
        });
        let scratch = batch * (2 * s.n_embd + widest + 2 * s.n_heads * s.head_dim)
            + batch * 2 * kv_dim
            + batch * 2 * s.ff_width()
            + moe
            + batch * s.n_heads * ctx
            + outputs * s.vocab
            + self.tile_elements()
            + 4 * ctx * (s.rope_dims / 2)
            + 2 * batch
            + outputs
            + kv.max_seqs * kv.max_blocks.iter().sum::<usize>();
        kv.bytes(kv_dim) + scratch * 4 + Self::act_bytes(batch, widest)
    }

    /// Bytes of the buffer that holds `tokens` rows of `width` activations in a matrix
    /// product's low-precision form: quantized to 8 bits ([`Layout::q8_bytes`], the int8
    /// kernels') or converted to f16 (an f16 GEMM's), whichever is larger (a pass uses one).
    pub fn act_bytes(tokens: usize, width: usize) -> usize {
        Self::q8_bytes(tokens, width).max(2 * tokens * width)
    }

    /// Bytes of `tokens` rows of `width` activations quantized to 8 bits (the int8 kernels'
    /// input; `width` a multiple of 32 wherever an int8 kernel reads it).
    pub fn q8_bytes(tokens: usize, width: usize) -> usize {
        tokens * width.div_ceil(crate::kernels::Q8A_VALUES) * crate::kernels::Q8A_BYTES
    }

    /// The VRAM plan for `budget` bytes, `ctx` positions and passes of up to `batch` of
    /// one sequence.
    pub fn plan(&self, ctx: usize, batch: usize, budget: usize) -> Result<VramPlan, GpuError> {
        self.plan_with(self.overhead_bytes(ctx, batch), budget)
    }

    /// The VRAM plan for `budget` bytes with `overhead` bytes of KV cache and scratch
    /// ([`Layout::overhead_bytes_with`]).
    pub fn plan_with(&self, overhead: usize, budget: usize) -> Result<VramPlan, GpuError> {
        let sizes: Vec<usize> = self.layers.iter().map(|l| l.size).collect();
        plan_vram(
            &sizes,
            self.embed,
            self.head,
            &self.blocks,
            overhead,
            budget,
        )
    }
}

/// How one block's KV cache is laid out in VRAM and how a pass's tokens find their rows
/// (kernels/ops.cu `kv_row`): `blocks` blocks of `block` positions for its keys (and as many
/// for its values), position p of a sequence in block `table[p / block]` of the sequence's
/// row of the pass's table `table`, or with `ring > 0` in `table[(p / block) % ring]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeo {
    /// Positions per block.
    pub block: usize,
    /// Blocks of keys (and of values) this block's cache holds.
    pub blocks: usize,
    /// Ring length in table entries (0: the table covers the whole context).
    pub ring: usize,
    /// Which of the pass's block tables the block reads.
    pub table: usize,
}

/// A model's KV cache in VRAM: every block's geometry, the block tables a pass hands
/// over, and how many sequences one pass may hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSpec {
    /// Per transformer block.
    pub layers: Vec<KvGeo>,
    /// Entries per sequence of each table.
    pub max_blocks: Vec<usize>,
    /// Sequences one pass may hold.
    pub max_seqs: usize,
    /// Keys and values are IEEE f16 (rounded to nearest even as they are stored), not f32.
    pub f16: bool,
}

impl KvSpec {
    /// Bytes of one cached element: 2 (f16) or 4 (f32).
    pub fn elem_bytes(&self) -> usize {
        if self.f16 {
            2
        } else {
            4
        }
    }

    /// Bytes of the keys and values of every block, rows of `kv_dim` elements (each of the
    /// two caches of a block rounded up to whole f32 words, as allocated).
    pub fn bytes(&self, kv_dim: usize) -> usize {
        self.layers
            .iter()
            .map(|g| 2 * (g.blocks * g.block * kv_dim * self.elem_bytes()).div_ceil(4) * 4)
            .sum()
    }

    /// Checks that every position below `ctx` of every block has a table entry: a table
    /// without ring covers the context, a ring fits its table, and the tables exist.
    pub fn check(&self, n_layers: usize, ctx: usize) -> Result<(), GpuError> {
        if self.layers.len() != n_layers || self.max_seqs == 0 {
            return Err(model_err(format!(
                "KV cache for {} blocks and {} sequences: the model has {n_layers} blocks",
                self.layers.len(),
                self.max_seqs
            )));
        }
        for (b, g) in self.layers.iter().enumerate() {
            let entries =
                self.max_blocks.get(g.table).copied().ok_or_else(|| {
                    model_err(format!("KV cache of block {b}: no table {}", g.table))
                })?;
            let covered = match g.ring {
                0 => entries.checked_mul(g.block).is_some_and(|n| n >= ctx),
                r => r <= entries,
            };
            if g.block == 0 || g.blocks == 0 || !covered {
                return Err(model_err(format!(
                    "KV cache of block {b}: {g:?} with {entries} table entries does not cover {ctx} positions"
                )));
            }
        }
        Ok(())
    }
}

/// Where every layer lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VramPlan {
    /// Per layer (manifest order): resident in VRAM for the whole run.
    pub resident: Vec<bool>,
    /// Bytes of each of the two streaming slots; 0 when every block is resident.
    pub slot_bytes: usize,
    /// Bytes of resident weights.
    pub resident_bytes: u64,
    /// Bytes read from storage for every token (the streamed blocks).
    pub streamed_bytes_per_token: u64,
    /// The smallest budget that runs at all (everything streamed but embedding and head).
    pub min_budget: usize,
    /// The budget at which every layer is resident.
    pub all_resident_budget: usize,
}

/// Plans VRAM for layers of `sizes` bytes (see the module docs for the policy).
pub fn plan_vram(
    sizes: &[usize],
    embed: usize,
    head: usize,
    blocks: &[usize],
    overhead: usize,
    budget: usize,
) -> Result<VramPlan, GpuError> {
    let fixed = sizes[embed] + sizes[head] + overhead;
    let max_block = blocks.iter().map(|&b| sizes[b]).max().unwrap_or(0);
    let all_blocks: usize = blocks.iter().map(|&b| sizes[b]).sum();
    let all_resident_budget = fixed + all_blocks;
    let min_budget = (fixed + 2 * max_block).min(all_resident_budget);
    if budget < min_budget {
        return Err(model_err(format!(
            "VRAM budget {} MiB is too small: embedding + head + KV cache + scratch + two \
             streaming slots need {} MiB (everything resident: {} MiB)",
            budget >> 20,
            min_budget.div_ceil(1 << 20),
            all_resident_budget.div_ceil(1 << 20)
        )));
    }
    let streaming = budget < all_resident_budget;
    let slot_bytes = if streaming { max_block } else { 0 };
    let mut left = budget - fixed - 2 * slot_bytes;
    let mut resident = vec![false; sizes.len()];
    resident[embed] = true;
    resident[head] = true;
    for &b in blocks {
        if sizes[b] > left {
            break;
        }
        left -= sizes[b];
        resident[b] = true;
    }
    let sum = |want: bool| {
        blocks
            .iter()
            .filter(|&&b| resident[b] == want)
            .map(|&b| sizes[b] as u64)
            .sum::<u64>()
    };
    Ok(VramPlan {
        resident_bytes: sum(true) + (sizes[embed] + sizes[head]) as u64,
        streamed_bytes_per_token: sum(false),
        resident,
        slot_bytes,
        min_budget,
        all_resident_budget,
    })
}

/// One step of a token's pass over the blocks, in the order the executor issues them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read layer `layer` into streaming slot `slot`, once the slot's previous block has
    /// finished computing (host waits on `computed[slot]`); marks `loaded[slot]`.
    Load {
        /// Layer index (manifest order).
        layer: usize,
        /// Slot 0 or 1.
        slot: usize,
    },
    /// Run block `block`: from its resident buffer (`slot` = None), or from `slot` after the
    /// compute stream has waited on `loaded[slot]`; then records `computed[slot]`.
    Compute {
        /// Block number.
        block: usize,
        /// Streaming slot it is read from, if not resident.
        slot: Option<usize>,
    },
}

/// The per-token schedule for `blocks` (layer index per block) given which layers are
/// resident: the first streamed block is read before the pass, and each streamed block's
/// successor is read into the other slot right after it is enqueued, so reads overlap
/// compute and the two slots alternate.
pub fn schedule(blocks: &[usize], resident: &[bool]) -> Vec<Step> {
    let streamed: Vec<usize> = blocks.iter().copied().filter(|&l| !resident[l]).collect();
    let mut steps = Vec::new();
    if let Some(&first) = streamed.first() {
        steps.push(Step::Load {
            layer: first,
            slot: 0,
        });
    }
    let mut next = 0;
    for (block, &layer) in blocks.iter().enumerate() {
        if resident[layer] {
            steps.push(Step::Compute { block, slot: None });
            continue;
        }
        let slot = next % 2;
        next += 1;
        steps.push(Step::Compute {
            block,
            slot: Some(slot),
        });
        if let Some(&nl) = streamed.get(next) {
            steps.push(Step::Load {
                layer: nl,
                slot: 1 - slot,
            });
        }
    }
    steps
}

/// For each step of `steps`, the layer of the first load after it, wrapping around to the
/// start (the next token's pass): the layer to read ahead once that step is issued.
pub fn next_loads(steps: &[Step]) -> Vec<Option<usize>> {
    let loads: Vec<(usize, usize)> = steps
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Step::Load { layer, .. } => Some((i, *layer)),
            Step::Compute { .. } => None,
        })
        .collect();
    (0..steps.len())
        .map(|i| {
            loads
                .iter()
                .find(|&&(j, _)| j > i)
                .or(loads.first())
                .map(|&(_, l)| l)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // embed 100, blocks 10 each (4 of them), head 50; overhead 40.
    const SIZES: [usize; 6] = [100, 10, 10, 10, 10, 50];
    const BLOCKS: [usize; 4] = [1, 2, 3, 4];

    #[test]
    fn a_large_budget_keeps_everything_resident_without_slots() {
        let p = plan_vram(&SIZES, 0, 5, &BLOCKS, 40, 1000).unwrap();
        assert!(p.resident.iter().all(|&r| r));
        assert_eq!(p.slot_bytes, 0);
        assert_eq!(p.streamed_bytes_per_token, 0);
        assert_eq!(p.all_resident_budget, 230);
        assert_eq!(p.resident_bytes, 190);
        // Exactly the all-resident budget needs no slots either.
        let p = plan_vram(&SIZES, 0, 5, &BLOCKS, 40, 230).unwrap();
        assert_eq!(p.slot_bytes, 0);
    }

    /// The executor's shape is a view of the format's hyperparameters: the scaling rule
    /// itself (not a name), the window of every block by the format's rule.
    #[test]
    fn shape_is_a_view_of_the_format_hparams() {
        let h = gds_format::arch::Hparams::example_gemma3();
        let s = Shape::from_hparams(&h).unwrap();
        assert_eq!(
            (s.n_layers, s.n_embd, s.n_heads, s.n_kv_heads),
            (7, 64, 4, 2)
        );
        assert_eq!(
            (s.head_dim, s.n_ff, s.vocab, s.rope_dims),
            (16, 128, 100, 12)
        );
        assert_eq!((s.eps, s.rope_theta, s.rope_neox), (1e-6, 1e6, true));
        assert_eq!(s.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(s.windows, vec![32, 32, 0, 32, 32, 0, 32]);
    }

    /// `Layout::read` sizes the layout from the hyperparameters its architecture check
    /// read (not a second reading): the same layout as `from_manifest`, window blocks too.
    #[test]
    fn a_read_layout_equals_the_layout_of_its_manifest() {
        for input in ["tiny-llama3-hf", "tiny-gemma3-hf"] {
            let (_tmp, dir) = gds_tests::converted_fixture(input);
            let read = Layout::read(&dir).unwrap();
            let bytes = std::fs::read(dir.join("manifest.gdsm")).unwrap();
            let m = Manifest::parse(&bytes).unwrap();
            let want = Layout::from_manifest(&dir, &m).unwrap();
            assert_eq!(read.shape, want.shape, "{input}");
            assert_eq!(read.layers, want.layers, "{input}");
            assert_eq!(read.tensors, want.tensors, "{input}");
            assert_eq!(
                (read.embed, read.head, &read.blocks, read.output),
                (want.embed, want.head, &want.blocks, want.output),
                "{input}"
            );
            if input == "tiny-gemma3-hf" {
                assert!(read.shape.windows.iter().any(|&w| w > 0), "{input}");
            }
        }
    }

    #[test]
    fn gpu_layout_refuses_hostile_hyperparameters_before_allocating() {
        use gds_format::{layout, LayerRecord, ManifestBuilder, TensorSpec};
        let manifest = |n_layers: u64| {
            let mut b = ManifestBuilder::new();
            b.kv_str("general.architecture", "llama");
            for k in [
                "n_embd",
                "n_heads",
                "n_kv_heads",
                "n_ff",
                "vocab_size",
                "context_length",
                "head_dim",
            ] {
                b.kv_u64(&format!("model.{k}"), 2);
            }
            b.kv_u64("model.n_layers", n_layers)
                .kv_f64("model.rope_theta", 1e4)
                .kv_f64("model.rms_norm_eps", 1e-5)
                .kv_bool("model.tie_embeddings", true);
            let t = vec![TensorSpec {
                name: "blk.0.attn_norm.weight".into(),
                dtype: DType::F32,
                shape: vec![2],
            }];
            b.add_layer(&LayerRecord {
                name: "blk.0".into(),
                file: "b.bin".into(),
                kind: layer_kind::BLOCK,
                index: 0,
                layout: layout(&t).unwrap(),
                tensors: t,
                content_hash: [0; 32],
            });
            b.finish()
        };
        // 2^40 blocks: a range error, not an allocation of 2^40 entries.
        let bytes = manifest(1 << 40);
        let e = Layout::from_manifest(Path::new("/x"), &Manifest::parse(&bytes).unwrap())
            .err()
            .unwrap();
        assert!(e.to_string().contains("model.n_layers"), "{e}");
        // A count that is in range but disagrees with the table is refused before sizing.
        let bytes = manifest(5000);
        let e = Layout::from_manifest(Path::new("/x"), &Manifest::parse(&bytes).unwrap())
            .err()
            .unwrap();
        assert!(e.to_string().contains("1 blocks"), "{e}");
    }

    #[test]
    fn a_middle_budget_keeps_leading_blocks_and_streams_the_rest_through_two_slots() {
        // fixed 190 + two slots 20 = 210: 15 bytes left, one block resident.
        let p = plan_vram(&SIZES, 0, 5, &BLOCKS, 40, 225).unwrap();
        assert_eq!(p.resident, vec![true, true, false, false, false, true]);
        assert_eq!(p.slot_bytes, 10);
        assert_eq!(p.streamed_bytes_per_token, 30);
        assert_eq!(p.min_budget, 210);
    }

    /// Replays a schedule and checks it: blocks in order, each computed once from the slot
    /// holding its layer, no slot overwritten before its block was computed, reads overlap
    /// (a block's successor is loaded before the block after it is computed).
    fn replay(blocks: &[usize], resident: &[bool]) -> usize {
        let steps = schedule(blocks, resident);
        let mut slot_holds: [Option<(usize, bool)>; 2] = [None, None]; // (layer, computed)
        let mut computed = Vec::new();
        let mut loads = 0;
        for step in &steps {
            match *step {
                Step::Load { layer, slot } => {
                    assert!(!resident[layer], "resident layer {layer} loaded");
                    if let Some((old, done)) = slot_holds[slot] {
                        assert!(done, "slot {slot} overwritten before layer {old} computed");
                    }
                    slot_holds[slot] = Some((layer, false));
                    loads += 1;
                }
                Step::Compute { block, slot } => {
                    assert_eq!(block, computed.len(), "blocks out of order");
                    let layer = blocks[block];
                    match slot {
                        None => assert!(resident[layer]),
                        Some(s) => {
                            assert_eq!(slot_holds[s], Some((layer, false)), "block {block}");
                            slot_holds[s] = Some((layer, true));
                        }
                    }
                    computed.push(block);
                }
            }
        }
        assert_eq!(computed.len(), blocks.len());
        loads
    }

    #[test]
    fn the_streaming_schedule_alternates_slots_and_never_overwrites_a_slot_in_use() {
        let blocks: Vec<usize> = (1..=6).collect();
        // All resident: no loads. None resident: one load per block. Mixed: the streamed ones.
        assert_eq!(replay(&blocks, &[true; 8]), 0);
        assert_eq!(
            replay(
                &blocks,
                &[true, false, false, false, false, false, false, true]
            ),
            6
        );
        let mixed = [true, true, true, false, false, false, false, true];
        assert_eq!(replay(&blocks, &mixed), 4);
        let steps = schedule(&blocks, &mixed);
        // The first streamed block is read before the pass starts.
        assert_eq!(steps[0], Step::Load { layer: 3, slot: 0 });
        // Block 3 (layer 4, slot 1) is read while block 2 (slot 0) computes.
        let i = steps
            .iter()
            .position(|s| {
                *s == Step::Compute {
                    block: 2,
                    slot: Some(0),
                }
            })
            .unwrap();
        assert_eq!(steps[i + 1], Step::Load { layer: 4, slot: 1 });
        assert_eq!(
            steps.last(),
            Some(&Step::Compute {
                block: 5,
                slot: Some(1)
            })
        );
    }

    #[test]
    fn read_ahead_names_the_next_load_and_wraps_to_the_next_token() {
        let blocks: Vec<usize> = (1..=4).collect();
        let resident = [true, true, false, false, false, true];
        let steps = schedule(&blocks, &resident);
        let next = next_loads(&steps);
        for (i, s) in steps.iter().enumerate() {
            let want = steps[i + 1..]
                .iter()
                .chain(&steps[..=i])
                .find_map(|s| match s {
                    Step::Load { layer, .. } => Some(*layer),
                    Step::Compute { .. } => None,
                });
            assert_eq!(next[i], want, "step {i}: {s:?}");
        }
        // After the last streamed layer's load comes the first of the next token.
        let last_load = steps
            .iter()
            .rposition(|s| matches!(s, Step::Load { .. }))
            .unwrap();
        assert_eq!(next[last_load], Some(2));
        assert!(next_loads(&schedule(&blocks, &[true; 6]))
            .iter()
            .all(Option::is_none));
    }

    #[test]
    fn a_budget_below_the_minimum_is_refused_with_the_numbers() {
        let e = plan_vram(&SIZES, 0, 5, &BLOCKS, 40, 209)
            .unwrap_err()
            .to_string();
        assert!(e.contains("too small"), "{e}");
    }
}
