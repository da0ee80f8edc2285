//! The executor's logic, independent of CUDA: VRAM laid out as the plan says (resident
//! layers, two streaming slots, KV cache, scratch), resident layers loaded once, and each
//! call's pass over the blocks following [`schedule`]: loads into slots ordered against
//! the blocks computed from them, the next streamed layer read ahead, the model's
//! [`BlockGraph`] run on the device for each block.
//!
//! It is written against [`Vram`]: the CUDA executor (`crate::executor`, feature `cuda`)
//! implements it with device buffers, cuFile or pinned bounce buffers, two streams and
//! events; the tests implement it with host memory and the kernels compiled as C++, and
//! check the event protocol (a slot is refilled only after the block computed from it, a
//! block computes only after its load) while comparing logits with the CPU runtime.

use crate::forward::{BlockGraph, Device, GemmType, Pass, Scratch};
use crate::plan::{next_loads, schedule, KvSpec, Layout, Step, VramPlan};
use crate::GpuError;
use gds_format::arch::{RopeFreqs, RopeScaling};
use std::path::Path;
use std::time::Instant;

/// What a buffer is for (the CUDA side places slots on the copy stream and registers
/// slots and layers with cuFile).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufKind {
    /// A layer kept resident for the whole run.
    Layer,
    /// One of the two streaming slots.
    Slot,
    /// KV cache (f32 or f16), activations, tables (f32).
    Scratch,
}

/// A device as the executor sees it: kernels, memory, layer loads and the ordering
/// between loads and compute.
pub trait Vram {
    /// The kernels ([`crate::forward::Device`]).
    fn kernels(&mut self) -> &mut dyn Device;
    /// A zeroed buffer of `bytes` bytes that lives as long as `self`; its address.
    fn alloc(&mut self, bytes: usize, kind: BufKind) -> Result<u64, GpuError>;
    /// Copies `src` into the buffer at `dst` (blocking).
    fn upload(&mut self, dst: u64, src: &[f32]) -> Result<(), GpuError>;
    /// Copies `src` into the buffer at `dst` (blocking; what the previous pass enqueued has
    /// finished, [`Vram::finish`]).
    fn upload_i32(&mut self, dst: u64, src: &[i32]) -> Result<(), GpuError>;
    /// Every allocation is made: what must finish before the first load does.
    fn ready(&mut self) -> Result<(), GpuError>;
    /// Reads layer `layer` (whole file, `size` bytes) into the buffer at `dst`, through
    /// staging `slot` (0 or 1). `sync`: complete on return. Otherwise enqueued; the compute
    /// side waits for it with [`Vram::wait_loaded`].
    fn load(
        &mut self,
        layer: usize,
        size: usize,
        dst: u64,
        slot: usize,
        sync: bool,
    ) -> Result<(), GpuError>;
    /// Starts reading `layer` ahead, where the device can.
    fn prefetch(&mut self, layer: usize, size: usize);
    /// The compute side waits for slot `slot`'s last load.
    fn wait_loaded(&mut self, slot: usize) -> Result<(), GpuError>;
    /// Marks the block computed from slot `slot` (enqueued after it).
    fn mark_computed(&mut self, slot: usize) -> Result<(), GpuError>;
    /// The host waits until the block last computed from slot `slot` has finished, so the
    /// slot may be refilled, and checks the slot's previous load.
    fn wait_computed(&mut self, slot: usize) -> Result<(), GpuError>;
    /// Waits for all work, then copies `out.len()` floats from `src` to `out` (and, when
    /// given, `extra`'s floats from its address) and checks every pending load.
    fn finish(
        &mut self,
        out: &mut [f32],
        src: u64,
        extra: Option<(&mut [f32], u64)>,
    ) -> Result<(), GpuError>;
    /// Bytes read from layer files and nanoseconds spent reading, where the device keeps
    /// its own count (`None`: the executor's wall-clock count is used).
    fn io_stats(&self) -> Option<gds_io::IoStats>;
    /// Runs the pass captured under `key` ([`Vram::capture_end`]) on the compute side:
    /// `false` where there is none (or the device captures nothing).
    fn replay(&mut self, _key: GraphKey) -> Result<bool, GpuError> {
        Ok(false)
    }
    /// Starts capturing what [`Vram::kernels`] is given instead of running it (CUDA
    /// graphs: one launch replays a pass's hundreds): `false` where the device does not
    /// capture or holds as many captures as it keeps, and nothing changes.
    fn capture_begin(&mut self) -> Result<bool, GpuError> {
        Ok(false)
    }
    /// Ends the capture [`Vram::capture_begin`] began: with `keep`, stores it under `key`
    /// and runs it once (nothing captured has run yet); without, discards it.
    fn capture_end(&mut self, _key: GraphKey, _keep: bool) -> Result<(), GpuError> {
        Ok(())
    }
}

/// What a captured pass ([`Vram::capture_begin`]) is replayed for: its kernels' arguments
/// and grids follow from its token and output counts, everything else it reads (positions,
/// block tables, output rows, activations) lives in device buffers written before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Tokens of the pass.
    pub tokens: usize,
    /// Output rows (logits) of the pass.
    pub outputs: usize,
}

/// Passes replayed from captures, and captures made ([`Streamer::graph_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Passes run by replaying a capture.
    pub replays: u64,
    /// Passes captured (and run once).
    pub captures: u64,
}

/// A pass shape is captured the second time it runs (a shape seen once, a prompt's last
/// odd chunk, costs no capture).
const CAPTURE_AFTER: u32 = 1;

/// What the caller decides (from the plan).
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// VRAM the executor may use, in bytes (weights, KV cache, scratch, slots).
    pub vram_budget: u64,
    /// Context length (KV cache positions).
    pub ctx: usize,
    /// RoPE tables `[ctx][rope_dims / 2]` (cos, sin) from the runtime's `RopeTable`s (the
    /// global layers', then the window layers' where they differ); empty computes one plain
    /// `theta^(-2i/d)` table (no scaling).
    pub rope: Vec<(Vec<f32>, Vec<f32>)>,
    /// Most positions one forward call takes ([`MAX_BATCH`](crate::plan::MAX_BATCH) unless a caller wants
    /// smaller passes); sliding-window blocks keep `window + max_batch − 1` cache rows.
    pub max_batch: usize,
    /// The KV cache: `None` for one sequence ([`Layout::single_sequence_kv`]); a paged
    /// cache shared by several sequences otherwise.
    pub kv: Option<KvSpec>,
    /// Most tokens of one pass that get logits (`None`: [`Layout::logit_rows`] of the
    /// batch).
    pub max_outputs: Option<usize>,
    /// Matrix products of passes shorter than
    /// [`gemm_min_tokens`](Self::gemm_min_tokens) over 8-bit activations (the
    /// int8 kernels, for the weight types that have one) rather than f32.
    pub q8_activations: bool,
    /// Passes of this many tokens or more go through GEMM on dequantized tiles
    /// ([`GEMM_MIN_TOKENS`](crate::forward::GEMM_MIN_TOKENS) by default).
    pub gemm_min_tokens: usize,
    /// What those GEMMs round their inputs to (`--gemm-type`; f16 with 8-bit activations,
    /// f32 without, by default).
    pub gemm: GemmType,
    /// Capture the passes that can be replayed ([`Vram::capture_begin`]: every layer
    /// resident, no mixture of experts (its routing reads logits on the host), fewer tokens
    /// than `gemm_min_tokens`, no hidden states asked) and replay them.
    pub graphs: bool,
    /// Fuse launches where the graph allows ([`Scratch::fuse`](crate::forward::Scratch::fuse)).
    pub fuse: bool,
}

/// The environment variable that turns the fused launches off (`0`, `false`, `off` or
/// `no`; [`StreamOptions::fuse`]): the A/B of what fusing gives, on the same binary.
pub const FUSE_ENV: &str = "GDS_CUDA_FUSE";

/// Whether `value` (the variable's value, if set) leaves the fused launches on.
pub fn fuse_wanted(value: Option<&str>) -> bool {
    crate::env_flag(value) != Some(false)
}

/// Block-table entry of a block released behind a sliding window (never read again).
pub const NO_BLOCK: u32 = u32::MAX;

/// One forward pass: the tokens of one or more sequences, each at its position.
#[derive(Clone, Copy, Debug)]
pub struct PassInput<'a> {
    /// The tokens.
    pub tokens: &'a [u32],
    /// Each token's position in its sequence.
    pub pos: &'a [u32],
    /// Each token's sequence: its row of every table in `tables`.
    pub seq: &'a [u32],
    /// The tokens (indices into `tokens`) whose logits the pass returns, in this order.
    pub outputs: &'a [u32],
    /// Per table of the [`KvSpec`]: `n × max_blocks` block numbers for the `n` sequences
    /// of the pass ([`NO_BLOCK`] where a block was released behind a window).
    pub tables: &'a [&'a [u32]],
}

/// Bytes and time spent moving layers into VRAM.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadStats {
    /// Bytes read from layer files into VRAM.
    pub bytes: u64,
    /// Wall time of those reads (host side, including waits for a free slot), in seconds.
    pub seconds: f64,
}

/// A model laid out on a [`Vram`]: resident layers, streaming slots, KV cache, scratch.
pub struct Streamer<V: Vram> {
    vram: V,
    layout: Layout,
    kv: Vec<(u64, u64)>,
    /// How each block's KV cache is paged.
    kv_spec: KvSpec,
    /// The pass's positions, table rows and output rows (i32): parts of one buffer,
    /// `pos_buf`, uploaded in one copy each pass.
    pos_buf: u64,
    seq_buf: u64,
    out_buf: u64,
    /// The pass's block tables (i32, `kv_spec.max_blocks[t]` per sequence), after those.
    table_bufs: Vec<u64>,
    /// Most tokens of a pass that get logits.
    max_outputs: usize,
    /// Host staging of that buffer: positions at 0, sequence rows at `max_tokens`, output
    /// rows at `2 × max_tokens`, the tables from `2 × max_tokens + max_outputs` on.
    host_i32: Vec<i32>,
    ropes: Vec<(u64, u64)>,
    scratch: Scratch,
    /// What each block computes.
    graph: Box<dyn BlockGraph>,
    /// Address of each layer's bytes during a pass (0 = not in VRAM now).
    base: Vec<u64>,
    /// Addresses of the two streaming slots.
    slot_addr: Vec<u64>,
    /// The per-token order of block computes and slot reads.
    steps: Vec<Step>,
    /// Passes may be captured and replayed ([`StreamOptions::graphs`] and the model
    /// allows it).
    graphs: bool,
    /// How often each pass shape ran without a capture.
    seen: Vec<(GraphKey, u32)>,
    /// Passes replayed from a capture, and captures made.
    pub graph_stats: GraphStats,
    /// For each step, the layer of the next load after it (wrapping to the next token's
    /// first): what to read ahead.
    next_load: Vec<Option<usize>>,
    max_tokens: usize,
    ctx_len: usize,
    /// Bytes and time of every layer read so far (initial loads included).
    pub stats: LoadStats,
    /// Where every layer lives (resident bytes, bytes streamed per token).
    pub plan: VramPlan,
}

fn model_err(msg: impl Into<String>) -> GpuError {
    GpuError::Model(msg.into())
}

impl<V: Vram> Streamer<V> {
    /// Lays the model in `dir` out on `vram` within `opts.vram_budget` and loads the
    /// resident layers; `graph` is what each block runs.
    pub fn with_vram(
        dir: &Path,
        opts: &StreamOptions,
        vram: V,
        graph: Box<dyn BlockGraph>,
    ) -> Result<Streamer<V>, GpuError> {
        let layout = Layout::read(dir)?;
        Streamer::with_layout(layout, opts, vram, graph)
    }

    /// As [`Streamer::with_vram`], for a layout already read.
    pub fn with_layout(
        layout: Layout,
        opts: &StreamOptions,
        mut vram: V,
        graph: Box<dyn BlockGraph>,
    ) -> Result<Streamer<V>, GpuError> {
        if layout.shape.rope_scaling != RopeScaling::None && opts.rope.is_empty() {
            return Err(model_err(format!(
                "RoPE scaling `{}`: pass the runtime's tables in the options' rope",
                layout.shape.rope_scaling.name()
            )));
        }
        let (s, ctx) = (&layout.shape, opts.ctx);
        let max_tokens = Layout::batch(ctx, opts.max_batch);
        let kv_spec = match &opts.kv {
            Some(k) => k.clone(),
            None => layout.single_sequence_kv(ctx, max_tokens),
        };
        kv_spec.check(s.n_layers, ctx)?;
        let max_outputs = opts
            .max_outputs
            .unwrap_or(Layout::logit_rows(max_tokens))
            .clamp(1, max_tokens);
        let overhead = layout.overhead_bytes_with(ctx, max_tokens, max_outputs, &kv_spec);
        let plan = layout.plan_with(overhead, opts.vram_budget as usize)?;
        let (q_dim, kv_dim) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let widest = s.widest();

        let mut slot_addr = Vec::new();
        if plan.slot_bytes > 0 {
            for _ in 0..2 {
                slot_addr.push(vram.alloc(plan.slot_bytes, BufKind::Slot)?);
            }
        }
        let mut f32_buf = |n: usize| vram.alloc(n.max(1) * 4, BufKind::Scratch);
        let mut kv = Vec::new();
        for g in &kv_spec.layers {
            // whole f32 words: an f16 cache of an odd element count rounds up
            let words = (g.blocks * g.block * kv_dim * kv_spec.elem_bytes()).div_ceil(4);
            kv.push((f32_buf(words)?, f32_buf(words)?));
        }
        // the pass's i32 arrays in one buffer, one upload a pass (a copy to the device
        // synchronizes with it: one round trip instead of one per array)
        let table_words: Vec<usize> = kv_spec
            .max_blocks
            .iter()
            .map(|&m| kv_spec.max_seqs * m)
            .collect();
        let i32_words = 2 * max_tokens + max_outputs + table_words.iter().sum::<usize>();
        let pos_buf = f32_buf(i32_words)?;
        let word = |i: usize| pos_buf + (i * 4) as u64;
        let (seq_buf, out_buf) = (word(max_tokens), word(2 * max_tokens));
        let mut table_bufs = Vec::new();
        let mut at = 2 * max_tokens + max_outputs;
        for w in &table_words {
            table_bufs.push(word(at));
            at += w;
        }
        // allocated either way: the VRAM plan counts it (Layout::overhead_bytes_with)
        let xq_buf = f32_buf(Layout::act_bytes(max_tokens, widest).div_ceil(4))?;
        let tile_elements = layout.tile_elements();
        let scratch = Scratch {
            x: f32_buf(max_tokens * s.n_embd)?,
            xb: f32_buf(max_tokens * widest)?,
            proj: f32_buf(max_tokens * s.n_embd)?,
            q: f32_buf(max_tokens * q_dim)?,
            k: f32_buf(max_tokens * kv_dim)?,
            v: f32_buf(max_tokens * kv_dim)?,
            attn: f32_buf(max_tokens * q_dim)?,
            att: f32_buf(max_tokens * s.n_heads * ctx)?,
            gate: f32_buf(max_tokens * s.ff_width())?,
            up: f32_buf(max_tokens * s.ff_width())?,
            logits: f32_buf(max_outputs * s.vocab)?,
            tile: f32_buf(tile_elements)?,
            tile_elements,
            xq: if opts.q8_activations { xq_buf } else { 0 },
            router: f32_buf(s.moe.map_or(0, |m| max_tokens * m.n_expert))?,
            moe_rows: f32_buf(s.moe.map_or(0, |m| 2 * max_tokens * m.n_expert_used))?,
            moe_x: f32_buf(s.moe.map_or(0, |_| max_tokens * s.n_embd))?,
            moe_y: f32_buf(s.moe.map_or(0, |_| max_tokens * s.n_embd))?,
            gemm_min: opts.gemm_min_tokens.max(1),
            gemm: opts.gemm,
            fuse: opts.fuse,
            xh: if opts.gemm == GemmType::F16 {
                xq_buf
            } else {
                0
            },
        };
        let tables = match opts.rope.is_empty() {
            // plain RoPE (scaled models were refused above): the one builder of the format
            true => vec![gds_format::arch::rope_tables(
                s.rope_dims,
                ctx,
                s.rope_theta,
                RopeFreqs::Scaled(RopeScaling::None),
                None,
            )],
            false => opts.rope.clone(),
        };
        let half = s.rope_dims / 2;
        let mut ropes = Vec::new();
        for (cos, sin) in &tables {
            if cos.len() < ctx * half || sin.len() < ctx * half {
                return Err(model_err("RoPE tables shorter than the context"));
            }
            let t = (
                vram.alloc(cos.len() * 4, BufKind::Scratch)?,
                vram.alloc(sin.len() * 4, BufKind::Scratch)?,
            );
            vram.upload(t.0, cos)?;
            vram.upload(t.1, sin)?;
            ropes.push(t);
        }
        let mut base = vec![0u64; layout.layers.len()];
        for (i, l) in layout.layers.iter().enumerate() {
            if plan.resident[i] {
                base[i] = vram.alloc(l.size, BufKind::Layer)?;
            }
        }
        vram.ready()?;
        let mut stats = LoadStats::default();
        for (i, l) in layout.layers.iter().enumerate() {
            if plan.resident[i] {
                let t0 = Instant::now();
                vram.load(i, l.size, base[i], 0, true)?;
                stats.seconds += t0.elapsed().as_secs_f64();
                stats.bytes += l.size as u64;
            }
        }
        let steps = schedule(&layout.blocks, &plan.resident);
        let next_load = next_loads(&steps);
        // a streamed layer's read (cuFile, or a host copy) and a mixture's routing on the
        // host are not kernels a capture can hold
        let graphs = opts.graphs
            && s.moe.is_none()
            && steps
                .iter()
                .all(|st| matches!(st, Step::Compute { slot: None, .. }));
        Ok(Streamer {
            vram,
            kv,
            kv_spec,
            pos_buf,
            seq_buf,
            out_buf,
            table_bufs,
            max_outputs,
            host_i32: vec![0; i32_words],
            ropes,
            scratch,
            graph,
            base,
            slot_addr,
            steps,
            graphs,
            seen: Vec::new(),
            graph_stats: GraphStats::default(),
            next_load,
            max_tokens,
            ctx_len: ctx,
            stats,
            plan,
            layout,
        })
    }

    /// The device.
    pub fn vram(&self) -> &V {
        &self.vram
    }

    /// Most tokens one [`forward`](Streamer::forward) call takes.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The model's layout (shape, layers, tensors).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Bytes read from layer files and the time spent reading: the device's counters
    /// where it keeps them, the executor's own otherwise.
    pub fn io_stats(&self) -> gds_io::IoStats {
        self.vram.io_stats().unwrap_or(gds_io::IoStats {
            bytes_read: self.stats.bytes,
            read_ns: (self.stats.seconds * 1e9) as u64,
            ..Default::default()
        })
    }

    /// Positions whose logits one pass can return.
    pub fn logit_rows(&self) -> usize {
        self.max_outputs
    }

    /// The KV cache's geometry.
    pub fn kv_spec(&self) -> &KvSpec {
        &self.kv_spec
    }

    /// Whether a sequence, holding `len` positions, can be cut back to its first `keep`
    /// and continued: every window block's ring (position p in slot p mod its rows) must
    /// still hold the keys position `keep` sees (the oldest, `keep + 1 − window`, is
    /// overwritten once `len − 1` reaches a ring's length past it).
    pub fn can_truncate(&self, len: usize, keep: usize) -> bool {
        if keep >= len {
            return true;
        }
        self.layout
            .shape
            .windows
            .iter()
            .zip(&self.kv_spec.layers)
            .all(|(&w, g)| {
                w == 0 || g.ring == 0 || len - 1 < (keep + 1).saturating_sub(w) + g.block * g.ring
            })
    }

    /// Runs `tokens` of one sequence at positions `pos0..` (at most
    /// [`max_tokens`](Streamer::max_tokens) at once) and writes the logits of its last
    /// `logits.len() / vocab` positions into `logits`, in order: up to
    /// [`logit_rows`](Streamer::logit_rows), and none (an empty `logits`) skips the output
    /// head. A batch of one through [`forward_batch`](Streamer::forward_batch), on a cache
    /// of one sequence ([`Layout::single_sequence_kv`]).
    pub fn forward(
        &mut self,
        logits: &mut [f32],
        tokens: &[u32],
        pos0: usize,
    ) -> Result<(), GpuError> {
        let (ntok, vocab) = (tokens.len(), self.layout.shape.vocab);
        let rows = logits.len() / vocab;
        if self.kv_spec.max_blocks.iter().any(|&m| m != 1) {
            return Err(model_err(
                "a pass of one sequence on a paged cache: use forward_batch with its block tables",
            ));
        }
        if rows > ntok {
            return Err(model_err(format!(
                "a logits buffer of {} floats ({rows} rows of {vocab}) for a pass of {ntok} tokens",
                logits.len()
            )));
        }
        let pos: Vec<u32> = (pos0..pos0 + ntok).map(|p| p as u32).collect();
        let seq = vec![0u32; ntok];
        let outputs: Vec<u32> = (ntok - rows..ntok).map(|i| i as u32).collect();
        let tables: Vec<&[u32]> = vec![&[0u32][..]; self.kv_spec.max_blocks.len()];
        self.forward_batch(
            logits,
            &PassInput {
                tokens,
                pos: &pos,
                seq: &seq,
                outputs: &outputs,
                tables: &tables,
            },
        )
    }

    /// Checks a pass against the cache's geometry before anything reaches the device:
    /// sizes, positions within the context, outputs within the pass, and every block-table
    /// entry a token writes or reads inside its block's cache.
    fn check_pass(&self, input: &PassInput<'_>, logits: usize) -> Result<usize, GpuError> {
        let ntok = input.tokens.len();
        let (vocab, spec) = (self.layout.shape.vocab, &self.kv_spec);
        if ntok == 0
            || ntok > self.max_tokens
            || input.pos.len() != ntok
            || input.seq.len() != ntok
            || input.tables.len() != spec.max_blocks.len()
        {
            return Err(model_err(format!(
                "a pass of {ntok} tokens ({} positions, {} sequence rows, {} tables): batch limit {}, {} tables",
                input.pos.len(),
                input.seq.len(),
                input.tables.len(),
                self.max_tokens,
                spec.max_blocks.len()
            )));
        }
        let rows = input.outputs.len();
        if logits != rows * vocab || rows > self.max_outputs {
            return Err(model_err(format!(
                "a logits buffer of {logits} floats for {rows} output rows of {vocab} (at most {})",
                self.max_outputs
            )));
        }
        if let Some(&o) = input.outputs.iter().find(|&&o| o as usize >= ntok) {
            return Err(model_err(format!("output row {o} of a pass of {ntok}")));
        }
        let mut n_seqs = None;
        for (t, (table, &m)) in input.tables.iter().zip(&spec.max_blocks).enumerate() {
            let n = table.len() / m;
            if table.len() != n * m || n > spec.max_seqs || n_seqs.is_some_and(|k| k != n) {
                return Err(model_err(format!(
                    "block table {t} of {} entries: want {m} per sequence, at most {} sequences, as many as the other tables",
                    table.len(),
                    spec.max_seqs
                )));
            }
            n_seqs = Some(n);
        }
        let n_seqs = n_seqs.unwrap_or(0);
        // the oldest and newest position of each sequence row in the pass
        let mut span = vec![(u32::MAX, 0u32); n_seqs];
        for (&p, &r) in input.pos.iter().zip(input.seq) {
            if p as usize >= self.ctx_len || r as usize >= n_seqs {
                return Err(model_err(format!(
                    "position {p} of sequence row {r}: context {}, {n_seqs} sequences",
                    self.ctx_len
                )));
            }
            let sp = &mut span[r as usize];
            *sp = (sp.0.min(p), sp.1.max(p));
        }
        // every entry a query of the pass reads (back to its window) or a token writes
        for (b, g) in spec.layers.iter().enumerate() {
            let window = self.layout.shape.windows.get(b).copied().unwrap_or(0);
            let (table, m) = (input.tables[g.table], spec.max_blocks[g.table]);
            for (r, &(lo, hi)) in span.iter().enumerate() {
                if lo > hi {
                    continue;
                }
                let first = match window {
                    0 => 0,
                    w => (lo as usize + 1).saturating_sub(w),
                };
                let (e0, e1) = (first / g.block, hi as usize / g.block);
                let n_entries = match g.ring {
                    0 => e1 - e0 + 1,
                    ring => (e1 - e0 + 1).min(ring),
                };
                for e in e0..e0 + n_entries {
                    let i = if g.ring > 0 { e % g.ring } else { e };
                    let blk = table.get(r * m + i).copied().unwrap_or(NO_BLOCK);
                    if blk as usize >= g.blocks {
                        return Err(model_err(format!(
                            "block {b}: sequence row {r} reads table entry {i} = {blk}, outside its {} KV blocks",
                            g.blocks
                        )));
                    }
                }
            }
        }
        Ok(rows)
    }

    /// Runs one pass over the tokens of `input` (one or more sequences, each token at its
    /// position, reading and writing its sequence's KV blocks through the pass's block
    /// tables) and writes the logits of `input.outputs` into `logits`, in that order
    /// (`outputs.len() × vocab` floats; none skips the output head). Layers not resident
    /// stream through the slots once for the whole pass.
    pub fn forward_batch(
        &mut self,
        logits: &mut [f32],
        input: &PassInput<'_>,
    ) -> Result<(), GpuError> {
        self.forward_batch_hidden(logits, &mut [], input)
    }

    /// [`Streamer::forward_batch`], and with a non-empty `hidden` (`tokens × n_embd`
    /// floats) the final-normed hidden state of every token of the pass in it, in token
    /// order (what embeddings pool).
    pub fn forward_batch_hidden(
        &mut self,
        logits: &mut [f32],
        hidden: &mut [f32],
        input: &PassInput<'_>,
    ) -> Result<(), GpuError> {
        let rows = self.check_pass(input, logits.len())?;
        if !hidden.is_empty() && hidden.len() != input.tokens.len() * self.layout.shape.n_embd {
            return Err(model_err(format!(
                "a hidden-state buffer of {} floats for {} tokens of {}",
                hidden.len(),
                input.tokens.len(),
                self.layout.shape.n_embd
            )));
        }
        let ntok = input.tokens.len();
        // positions, sequence rows, output rows and tables at their places in the one i32
        // buffer (check_pass bounded every length); what the pass does not use is stale
        // and never read
        let base = self.pos_buf;
        let h = &mut self.host_i32;
        let parts = [self.pos_buf, self.seq_buf, self.out_buf]
            .into_iter()
            .zip([input.pos, input.seq, input.outputs])
            .chain(
                self.table_bufs
                    .iter()
                    .copied()
                    .zip(input.tables.iter().copied()),
            );
        let mut end = 0;
        for (dst, src) in parts {
            let at = ((dst - base) / 4) as usize;
            for (d, &v) in h[at..at + src.len()].iter_mut().zip(src) {
                *d = v as i32;
            }
            end = end.max(at + src.len());
        }
        self.vram.upload_i32(base, &h[..end])?;
        {
            let scale = self.graph.embed_scale();
            let (pass, dev, _) = self.parts();
            pass.embed(dev, input.tokens, scale)?;
        }
        let key = GraphKey {
            tokens: ntok,
            outputs: rows,
        };
        if self.graphs && ntok < self.scratch.gemm_min && hidden.is_empty() {
            if self.vram.replay(key)? {
                self.graph_stats.replays += 1;
            } else if self.shape_seen(key) && self.vram.capture_begin()? {
                let ran = self.blocks_and_head(ntok, rows);
                // the capture ends whether or not enqueueing the pass failed
                let ended = self.vram.capture_end(key, ran.is_ok());
                ran?;
                ended?;
                self.graph_stats.captures += 1;
            } else {
                self.blocks_and_head(ntok, rows)?;
            }
        } else {
            self.blocks_and_head(ntok, rows)?;
        }
        // after the head, which used the same scratch rows
        let extra = if hidden.is_empty() {
            None
        } else {
            let (pass, dev, _) = self.parts();
            pass.final_norm(dev, ntok)?;
            Some((hidden, self.scratch.xb))
        };
        self.vram.finish(logits, self.scratch.logits, extra)
    }

    /// Counts a run of `key`'s shape without a capture; whether it has run often enough to
    /// capture it now ([`CAPTURE_AFTER`]).
    fn shape_seen(&mut self, key: GraphKey) -> bool {
        match self.seen.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => {
                *n += 1;
                *n > CAPTURE_AFTER
            }
            None => {
                self.seen.push((key, 1));
                CAPTURE_AFTER == 0
            }
        }
    }

    /// The pass's blocks (streamed ones read through the slots) and, for `rows` outputs,
    /// the output head, on the `ntok` tokens embedded in the scratch.
    fn blocks_and_head(&mut self, ntok: usize, rows: usize) -> Result<(), GpuError> {
        for i in 0..self.steps.len() {
            match self.steps[i] {
                Step::Load { layer, slot } => self.load_slot(layer, slot, self.next_load[i])?,
                Step::Compute { block, slot } => {
                    let li = self.layout.blocks[block];
                    if let Some(slot) = slot {
                        self.vram.wait_loaded(slot)?;
                        self.base[li] = self.slot_addr[slot];
                    }
                    let ran = {
                        let (pass, dev, graph) = self.parts();
                        graph.block(&pass, dev, block, ntok)
                    };
                    if let Some(slot) = slot {
                        self.base[li] = 0;
                        ran?;
                        self.vram.mark_computed(slot)?;
                    } else {
                        ran?;
                    }
                }
            }
        }
        if rows > 0 {
            let cap = self.graph.final_softcap();
            let out = self.out_buf;
            let (pass, dev, _) = self.parts();
            pass.head(dev, ntok, out, rows, cap)?;
        }
        Ok(())
    }

    /// The pass's view of the model, the device's kernels and the graph (disjoint borrows).
    fn parts(&mut self) -> (Pass<'_>, &mut dyn Device, &dyn BlockGraph) {
        (
            Pass {
                layout: &self.layout,
                layer_base: &self.base,
                s: self.scratch,
                kv: &self.kv,
                kv_f16: self.kv_spec.f16,
                geo: &self.kv_spec.layers,
                pos: self.pos_buf,
                seq: self.seq_buf,
                tables: &self.table_bufs,
                max_blocks: &self.kv_spec.max_blocks,
                ropes: &self.ropes,
                ctx: self.ctx_len,
            },
            self.vram.kernels(),
            &*self.graph,
        )
    }

    /// Reads layer `li` into streaming slot `slot`, once the slot's last user has finished,
    /// then starts reading `next` (the layer the following load will want) ahead.
    fn load_slot(&mut self, li: usize, slot: usize, next: Option<usize>) -> Result<(), GpuError> {
        self.vram.wait_computed(slot)?;
        let size = self.layout.layers[li].size;
        let t0 = Instant::now();
        self.vram
            .load(li, size, self.slot_addr[slot], slot, false)?;
        if let Some(n) = next {
            self.vram.prefetch(n, self.layout.layers[n].size);
        }
        self.stats.seconds += t0.elapsed().as_secs_f64();
        self.stats.bytes += size as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::fuse_wanted;

    #[test]
    fn fused_launches_are_on_unless_the_variable_says_off() {
        for on in [None, Some("1"), Some(""), Some("yes"), Some("anything")] {
            assert!(fuse_wanted(on), "{on:?}");
        }
        for off in ["0", "false", " OFF ", "no"] {
            assert!(!fuse_wanted(Some(off)), "{off}");
        }
    }
}
