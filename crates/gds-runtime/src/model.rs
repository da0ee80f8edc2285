//! The CPU model: load (map the layers, locate the weights), the forward pass around the
//! architecture's graph, and the CPU implementation of the graph's [`Ops`].
//!
//! `forward` embeds the batch, runs [`graph::block`] for each block once its bytes are
//! resident (or streamed in), then the final norm and the output head. It works over a batch
//! of tokens so a prompt is processed with one matrix product per weight; each token carries
//! its own position and sequence id, so several independent sequences can share one pass.

use crate::attention::AttnParams;
use crate::batch::Batch;
use crate::config::{Config, RopeStyle};
use crate::error::{Result, RuntimeError};
use crate::experts::ExpertCache;
use crate::graph::{self, Arch, Buf, Experts, Glu, Ops};
use crate::ioplan::IoPlan;
use crate::kv::KvCache;
use crate::ops;
use crate::rope::RopeTable;
use crate::weights::{BlockWeights, TensorRef, Weights};
use gds_format::arch::RopeFreqs;
use gds_io::{
    DirectBackend, DirectOptions, IoStats, LayerBytes, LayerSource, MmapBackend, Span, Verifier,
    VerifyMode, VerifyStats,
};
use std::path::Path;
use std::sync::Arc;

/// Activation buffers for batches of up to `max_batch` tokens, allocated once.
pub struct RunState {
    max_batch: usize,
    max_outputs: usize,
    /// residual stream `[max_batch, n_embd]`
    x: Vec<f32>,
    /// normed input of a sub-layer `[max_batch, n_embd]`
    xb: Vec<f32>,
    /// queries `[max_batch, n_heads * head_dim]`
    pub(crate) q: Vec<f32>,
    /// keys of the batch `[max_batch, kv_dim]`
    pub(crate) k: Vec<f32>,
    /// values of the batch `[max_batch, kv_dim]`
    pub(crate) v: Vec<f32>,
    /// attention output `[max_batch, n_heads * head_dim]`
    pub(crate) att: Vec<f32>,
    /// output of attn_output / ffn_down `[max_batch, n_embd]`
    proj: Vec<f32>,
    /// `[max_batch, n_ff]` (empty for a mixture of experts)
    gate: Vec<f32>,
    /// `[max_batch, n_ff]` (empty for a mixture of experts)
    up: Vec<f32>,
    /// attention scratch per parallel task (`attention::scratch_len`: the scores of a KV
    /// head's query heads and one converted K/V row) `[n_tasks, scratch_len]`
    pub(crate) scores: Vec<f32>,
    /// partial attention outputs of key pieces split across threads (grown on demand)
    pub(crate) part: Vec<f32>,
    pub(crate) n_tasks: usize,
    /// final-normed hidden states of the output tokens `[max_outputs, n_embd]`
    out_x: Vec<f32>,
    /// logits of the output tokens, in batch order `[max_outputs, vocab_size]`
    logits: Vec<f32>,
    n_out: usize,
    /// final-normed hidden states of the tokens that ask for them (embeddings), in batch
    /// order `[n, n_embd]`; grown by the first pass that has such tokens
    hidden: Vec<f32>,
    /// one embedding row read from disk (streaming plans)
    emb_row: Vec<u8>,
    /// logits of one streamed head chunk for several output tokens
    head_tmp: Vec<f32>,
    /// a mixture of experts' buffers (grown by the first pass through one)
    moe: MoeScratch,
}

/// Buffers of [`Ops::moe`] on the CPU: the router's logits of the batch, and one expert's
/// tokens (gathered inputs, gate, up and output rows).
#[derive(Default)]
struct MoeScratch {
    logits: Vec<f32>,
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out: Vec<f32>,
}

impl RunState {
    /// Buffers for `cfg`, batches of up to `max_batch` tokens of which up to `max_outputs`
    /// want logits, a context of `ctx`, and `threads` worker threads.
    pub fn new(
        cfg: &Config,
        max_batch: usize,
        max_outputs: usize,
        ctx: usize,
        threads: usize,
    ) -> RunState {
        let b = max_batch.max(1);
        let n_tasks = (threads * 4).max(1);
        // a mixture of experts has no dense FFN (its experts' rows are in `moe`)
        let dense_ff = if cfg.moe.is_some() { 0 } else { cfg.n_ff };
        RunState {
            max_batch: b,
            max_outputs: max_outputs.max(1),
            x: vec![0.0; b * cfg.n_embd],
            xb: vec![0.0; b * cfg.n_embd],
            q: vec![0.0; b * cfg.q_dim()],
            k: vec![0.0; b * cfg.kv_dim()],
            v: vec![0.0; b * cfg.kv_dim()],
            att: vec![0.0; b * cfg.q_dim()],
            proj: vec![0.0; b * cfg.n_embd],
            gate: vec![0.0; b * dense_ff],
            up: vec![0.0; b * dense_ff],
            scores: vec![0.0; n_tasks * crate::attention::scratch_len(cfg, ctx)],
            part: Vec::new(),
            n_tasks,
            out_x: vec![0.0; max_outputs.max(1) * cfg.n_embd],
            hidden: Vec::new(),
            logits: vec![0.0; max_outputs.max(1) * cfg.vocab_size],
            n_out: 0,
            emb_row: Vec::new(),
            head_tmp: Vec::new(),
            moe: MoeScratch::default(),
        }
    }

    /// Largest batch accepted.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Most output tokens per batch.
    pub fn max_outputs(&self) -> usize {
        self.max_outputs
    }

    /// Logits of the `i`-th output token of the last batch (in batch order).
    pub fn logits(&self, i: usize, vocab: usize) -> &[f32] {
        &self.logits[i * vocab..(i + 1) * vocab]
    }

    /// Mutable logits of the `i`-th output token (samplers edit them in place).
    pub fn logits_mut(&mut self, i: usize, vocab: usize) -> &mut [f32] {
        &mut self.logits[i * vocab..(i + 1) * vocab]
    }

    /// Number of output rows the last batch produced.
    pub fn n_outputs(&self) -> usize {
        self.n_out
    }

    /// The final-normed hidden state of the `i`-th token of the last batch that asked for
    /// one ([`Batch::push_hidden`], in batch order): what embeddings pool.
    pub fn hidden(&self, i: usize, n_embd: usize) -> &[f32] {
        &self.hidden[i * n_embd..(i + 1) * n_embd]
    }
}

/// Sees the input of the block matrix products of a forward pass
/// ([`Model::forward_observed`]; `gdsrun imatrix`'s [`crate::imatrix::ImatrixCollector`]).
pub trait MatmulObserver: Send {
    /// `x` is `n` rows (tokens) of the f32 activation entering the product with block
    /// `layer`'s matrix `role` (`attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_gate`,
    /// `ffn_up`, `ffn_down`).
    fn matmul(&mut self, layer: usize, role: &str, x: &[f32], n: usize);

    /// `x` is `n` rows (the tokens that want logits) of the f32 activation entering the
    /// output head, the final-normed hidden state; `tensor` is the head's name,
    /// `output.weight`, or `token_embd.weight` when the embedding is tied (as llama.cpp
    /// names the product). Ignored unless implemented.
    fn head(&mut self, tensor: &str, x: &[f32], n: usize) {
        let _ = (tensor, x, n);
    }

    /// `x` is `n` rows (the tokens routed to it) of the f32 activation entering expert
    /// `expert` (of `n_experts`) of block `layer`'s stacked matrix `role` (`ffn_gate_exps`,
    /// `ffn_up_exps`, `ffn_down_exps`). Ignored unless implemented.
    fn expert(
        &mut self,
        layer: usize,
        role: &str,
        expert: usize,
        n_experts: usize,
        x: &[f32],
        n: usize,
    ) {
        let _ = (layer, role, expert, n_experts, x, n);
    }
}

/// A loaded model: configuration, the I/O backend with the layers it keeps resident,
/// weight locations, RoPE table, and the thread pool the plan asked for.
pub struct Model {
    /// Hyperparameters.
    pub config: Config,
    /// Weight locations.
    pub weights: Weights,
    /// Handles of the resident layers (`None`: streamed or read on demand).
    resident: Vec<Option<LayerBytes>>,
    source: Box<dyn LayerSource>,
    /// Checks layer files before their bytes are used; kept for its counters.
    verifier: Arc<Verifier>,
    io: IoPlan,
    /// The architecture's graph.
    arch: Arch,
    /// RoPE tables: `[0]` for global layers, `[1]` (when present) for window layers.
    ropes: Vec<RopeTable>,
    pool: rayon::ThreadPool,
    ctx: usize,
    /// AVX2+FMA attention, decided once at load.
    simd: bool,
    /// Keep activations in f32 (weights dequantized row by row) instead of quantizing them
    /// to 8 bits for integer dot products.
    f32_act: bool,
    /// The experts of streamed mixture-of-experts blocks, when they stream apart.
    experts: Option<ExpertCache>,
    /// Bytes of block-quantized matrices interleaved at load for the AVX-512/AVX2 kernels.
    interleaved: u64,
}

impl Model {
    /// Loads the model the way `plan` says (I/O backend, residency, context, threads).
    pub fn open(plan: &crate::plan::Plan) -> Result<Model> {
        let mut m = Model::open_io(
            &plan.model_dir,
            &plan.io_plan,
            (plan.ctx, plan.threads),
            plan.interleave,
        )?;
        m.set_f32_activations(plan.activations == crate::plan::Activations::F32);
        Ok(m)
    }

    /// Keeps activations in f32 for every matrix product (`--activations f32`): the
    /// arithmetic of a float reference, slower than the default 8-bit activations.
    pub fn set_f32_activations(&mut self, on: bool) {
        self.f32_act = on;
    }

    /// Opens the model directory with the `mmap` backend (every layer resident) and
    /// prepares RoPE angles for `ctx` positions and a pool of `threads` threads.
    pub fn load(dir: &Path, ctx: usize, threads: usize) -> Result<Model> {
        let manifest_bytes = gds_io::read_manifest(dir)?;
        let m = crate::model_dir::parse_manifest(dir, &manifest_bytes)?;
        let io = crate::ioplan::plan_io(dir, &m, "mmap", None, || {
            gds_io::DirectSupport::Buffered("not used by mmap".into())
        })?;
        Model::with_io(dir, &io, ctx, threads)
    }

    /// Opens the model directory with the I/O backend and residency of `io` (the weights it
    /// reads into memory interleaved where this ISA's kernels read that layout).
    pub fn with_io(dir: &Path, io: &IoPlan, ctx: usize, threads: usize) -> Result<Model> {
        Model::open_io(dir, io, (ctx, threads), true)
    }

    /// [`Model::with_io`], interleaving the weights read into memory only if `interleave`
    /// (the plan's decision: not with f32 activations, whose kernels read rows in file
    /// order).
    fn open_io(
        dir: &Path,
        io: &IoPlan,
        (ctx, threads): (usize, usize),
        interleave: bool,
    ) -> Result<Model> {
        let manifest_bytes = gds_io::read_manifest(dir)?;
        let m = crate::model_dir::parse_manifest(dir, &manifest_bytes)?;
        let config = Config::from_manifest(&m).map_err(|e| crate::model_dir::with_dir(e, dir))?;
        let verifier = Arc::new(Verifier::new(if io.verify {
            VerifyMode::Hash
        } else {
            VerifyMode::Off
        }));
        let mut source: Box<dyn LayerSource> = match io.mode.as_str() {
            "mmap" => Box::new(MmapBackend::open_with(dir, &m, &verifier)?),
            mode => {
                let opts = DirectOptions {
                    resident: (0..m.n_layers()).map(|l| io.is_resident(l)).collect(),
                    slots: io.slots,
                    slot_size: io.slot_bytes as usize,
                    // `load`: through the page cache, whose pages stay for the next run
                    // (the copy that matters is the private, huge-page one)
                    force_buffered: mode == "buffered" || mode == "load",
                    keep_cached: mode == "load",
                    verifier: Some(verifier.clone()),
                };
                Box::new(DirectBackend::open(dir, &m, &opts)?)
            }
        };
        let mut weights =
            Weights::load(&config, &m, &*source).map_err(|e| crate::model_dir::with_dir(e, dir))?;
        // block-quantized matrices held in memory of our own, interleaved for the SIMD kernels
        // before anything acquires them
        let interleaved = if interleave {
            weights
                .interleave_resident(&mut *source)
                .map_err(|e| crate::model_dir::with_dir(e, dir))?
        } else {
            0
        };
        let mut resident = vec![None; source.n_layers()];
        for &l in &io.resident_layers {
            if let Some(r) = resident.get_mut(l) {
                *r = Some(source.acquire(l)?);
            }
        }
        let arch = Arch::of(&config)?;
        let ropes = rope_tables(&config, &weights, ctx);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("gds-worker-{i}"))
            .build()
            .map_err(|e| RuntimeError::Threads(e.to_string()))?;
        Ok(Model {
            config,
            weights,
            resident,
            source,
            verifier,
            io: io.clone(),
            arch,
            ropes,
            pool,
            ctx,
            simd: ops::simd_available(),
            f32_act: false,
            experts: io
                .experts
                .as_ref()
                .map(|x| ExpertCache::new(x.cache_experts)),
            interleaved,
        })
    }

    /// Bytes of block-quantized weights held in memory with their rows interleaved sixteen at
    /// a time for the AVX-512/AVX2 kernels (0: none, e.g. a mapped model or the scalar kernels).
    pub fn interleaved_bytes(&self) -> u64 {
        self.interleaved
    }

    /// The I/O plan the model was opened with.
    pub fn io_plan(&self) -> &IoPlan {
        &self.io
    }

    /// Warnings from the I/O backend (e.g. `O_DIRECT` unsupported).
    pub fn io_warnings(&self) -> Vec<String> {
        self.source.warnings()
    }

    /// Context length the model was prepared for.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Number of threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The I/O backend's counters, with the expert cache's.
    pub fn io_stats(&self) -> IoStats {
        let mut s = self.source.stats();
        if let Some(c) = &self.experts {
            let x = c.stats();
            (s.cache_hits, s.cache_misses) = (x.hits, x.misses);
        }
        s
    }

    /// What checking the layer files' hashes has cost so far.
    pub fn verify_stats(&self) -> VerifyStats {
        self.verifier.stats()
    }

    /// Name of the I/O backend.
    pub fn io_name(&self) -> &'static str {
        self.source.name()
    }

    /// Total bytes of the layer files.
    pub fn weight_bytes(&self) -> u64 {
        self.io.weight_bytes
    }

    /// Runs `batch` through the model, writing K/V of every token into `kv` and the logits
    /// of the tokens marked as outputs into `state` (read them with [`RunState::logits`]).
    /// Returns the number of output rows.
    pub fn forward(&self, state: &mut RunState, kv: &mut KvCache, batch: &Batch) -> Result<usize> {
        self.check_batch(state, kv, batch)?;
        let all = self.config.n_layers;
        self.pool
            .install(|| self.forward_inner(state, kv, batch, all, None))
    }

    /// [`forward`](Model::forward), showing `obs` the f32 input of every block matrix
    /// product (`gdsrun imatrix`); the plain forward pass has no observer to check.
    pub fn forward_observed(
        &self,
        state: &mut RunState,
        kv: &mut KvCache,
        batch: &Batch,
        obs: &mut dyn MatmulObserver,
    ) -> Result<usize> {
        self.check_batch(state, kv, batch)?;
        let all = self.config.n_layers;
        self.pool
            .install(|| self.forward_inner(state, kv, batch, all, Some(obs)))
    }

    /// [`forward`](Model::forward) through the first `blocks` blocks only, then the final
    /// norm and the output head (an early exit: self-speculation's draft). Writes K/V of
    /// those blocks only; the layers it uses must be resident (the I/O plan keeps them with
    /// `plan_io_keeping`), so it reads nothing and leaves the streaming order alone.
    pub fn forward_exit(
        &self,
        state: &mut RunState,
        kv: &mut KvCache,
        batch: &Batch,
        blocks: usize,
    ) -> Result<usize> {
        self.check_batch(state, kv, batch)?;
        let w = &self.weights;
        let needed = w.blocks.iter().take(blocks).map(|b| b.wq.layer);
        let resident = |l: usize| matches!(self.resident.get(l), Some(Some(_)));
        if blocks == 0 || blocks > self.config.n_layers {
            return Err(RuntimeError::Internal(format!(
                "an early exit after {blocks} of {} blocks",
                self.config.n_layers
            )));
        }
        if let Some(l) = needed.chain([w.output.layer]).find(|&l| !resident(l)) {
            return Err(RuntimeError::Internal(format!(
                "an early exit after {blocks} blocks needs layer {l} resident (the I/O plan streams it)"
            )));
        }
        self.pool
            .install(|| self.forward_inner(state, kv, batch, blocks, None))
    }

    fn check_batch(&self, state: &RunState, kv: &KvCache, batch: &Batch) -> Result<()> {
        let bad = |why: String| Err(RuntimeError::Internal(format!("invalid batch: {why}")));
        if batch.len() > state.max_batch {
            return bad(format!(
                "{} tokens, at most {}",
                batch.len(),
                state.max_batch
            ));
        }
        if batch.n_outputs() > state.max_outputs {
            return bad(format!(
                "{} outputs, at most {}",
                batch.n_outputs(),
                state.max_outputs
            ));
        }
        if !kv.has_rows() {
            return bad("the KV cache's rows are held by another backend".into());
        }
        if kv.n_layers() != self.config.n_layers
            || kv.ctx() > self.ctx
            || state.scores.len()
                < state.n_tasks * crate::attention::scratch_len(&self.config, kv.ctx())
        {
            return bad("KV cache or run state was made for another model or context".into());
        }
        if let Some(slack) = kv.ring_slack() {
            if batch.len() > slack {
                return bad(format!(
                    "a pass of {} positions is longer than the sliding-window ring allows ({slack})",
                    batch.len()
                ));
            }
        }
        for i in 0..batch.len() {
            if batch.tokens[i] as usize >= self.config.vocab_size {
                return bad(format!(
                    "token id {} is outside the vocabulary ({})",
                    batch.tokens[i], self.config.vocab_size
                ));
            }
            if let Err(why) = kv.check_slot(batch.seqs[i], batch.positions[i]) {
                return bad(why);
            }
        }
        Ok(())
    }

    /// Number of spans streamed by a forward pass (blocks, then head chunks if `head`).
    fn n_stream_items(&self, head: bool) -> usize {
        let h = &self.io.head;
        self.io.streamed_layers.len()
            + if head && h.chunk_rows > 0 {
                h.rows.div_ceil(h.chunk_rows)
            } else {
                0
            }
    }

    /// The `i`-th span streamed by a forward pass: the streamed blocks in order, then the
    /// output head's row chunks when the pass has outputs. Indexes past the end continue into
    /// the next pass (assumed to want outputs, as decode steps do).
    fn stream_item(&self, i: usize, head: bool) -> Option<Span> {
        let n = self.n_stream_items(head);
        let i = if i < n {
            i
        } else {
            let next = self.n_stream_items(true);
            if next == 0 {
                return None;
            }
            (i - n) % next
        };
        let blocks = &self.io.streamed_layers;
        if let Some(&layer) = blocks.get(i) {
            return Some(Span {
                layer,
                offset: 0,
                len: self.io.stream_len(layer, self.source.layer_size(layer)),
            });
        }
        let (r0, rows) = self.head_chunk(i - blocks.len());
        let h = &self.io.head;
        Some(Span {
            layer: h.layer,
            offset: h.offset + r0 as u64 * h.row_bytes,
            len: rows as u64 * h.row_bytes,
        })
    }

    /// First row and row count of head chunk `c`.
    fn head_chunk(&self, c: usize) -> (usize, usize) {
        let h = &self.io.head;
        let r0 = c * h.chunk_rows;
        (r0, h.chunk_rows.min(h.rows - r0))
    }

    /// Bytes of layer `layer` for stream position `i` (resident: the kept handle; streamed:
    /// hint the next span to the I/O thread, then wait for this one).
    fn layer_bytes(&self, layer: usize, i: &mut usize, head: bool) -> Result<LayerBytes> {
        if let Some(Some(h)) = self.resident.get(layer) {
            return Ok(h.clone());
        }
        self.stream(i, head)
    }

    fn stream(&self, i: &mut usize, head: bool) -> Result<LayerBytes> {
        let span = self
            .stream_item(*i, head)
            .ok_or_else(|| RuntimeError::Tensor {
                name: format!("stream item {i}"),
                why: "internal: not in the streaming plan".into(),
            })?;
        for d in 1..self.io.slots {
            if let Some(next) = self.stream_item(*i + d, head) {
                self.source.prefetch(next);
            }
        }
        *i += 1;
        Ok(self.source.acquire_span(span)?)
    }

    fn matmul(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &TensorRef,
        bytes: &LayerBytes,
        n: usize,
    ) -> Result<()> {
        self.matmul_many(&[w.view(bytes)?], x, n, &mut [out])
    }

    /// One or more products with the same input, with the plan's activation precision.
    fn matmul_many(
        &self,
        ws: &[gds_kernels::WeightView<'_>],
        x: &[f32],
        n: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<()> {
        if self.f32_act {
            gds_kernels::matmul_many_f32_act(ws, x, n, ys)?;
        } else {
            gds_kernels::matmul_many(ws, x, n, ys)?;
        }
        Ok(())
    }

    /// The pass through blocks `0..blocks` (all of them, or an early exit's resident few).
    fn forward_inner(
        &self,
        s: &mut RunState,
        kv: &mut KvCache,
        batch: &Batch,
        blocks: usize,
        mut obs: Option<&mut dyn MatmulObserver>,
    ) -> Result<usize> {
        let c = &self.config;
        let n = batch.len();
        let d = c.n_embd;
        let eps = c.rms_norm_eps;

        let with_head = batch.n_outputs() > 0;
        // stream position: the first streamed span is hinted now, so its read overlaps the
        // embedding and any resident blocks before it
        let mut si = 0usize;
        if blocks == c.n_layers {
            if let Some(first) = self.stream_item(0, with_head) {
                self.source.prefetch(first);
            }
        }

        // token embeddings, one row dequantized per token
        let emb = &self.weights.token_embd;
        let row = emb.row_bytes();
        match self.resident.get(emb.layer) {
            Some(Some(h)) => {
                let emb_bytes = emb.view(h)?.data;
                for (t, &tok) in batch.tokens.iter().enumerate() {
                    let r = tok as usize * row;
                    gds_kernels::dequantize(
                        emb.dtype,
                        &emb_bytes[r..r + row],
                        &mut s.x[t * d..(t + 1) * d],
                    )?;
                }
            }
            _ => {
                // not resident: read just the rows of this batch's tokens
                s.emb_row.resize(row, 0);
                for (t, &tok) in batch.tokens.iter().enumerate() {
                    let at = (emb.offset + tok as usize * row) as u64;
                    self.source.read_at(emb.layer, at, &mut s.emb_row)?;
                    gds_kernels::dequantize(emb.dtype, &s.emb_row, &mut s.x[t * d..(t + 1) * d])?;
                }
            }
        }

        if let Some(a) = self.arch.embed_scale(c) {
            ops::scale(&mut s.x[..n * d], a);
        }

        for (l, w) in self.weights.blocks.iter().enumerate().take(blocks) {
            let bytes = self.layer_bytes(w.wq.layer, &mut si, with_head)?;
            let mut o = CpuOps {
                m: self,
                s: &mut *s,
                kv: &mut *kv,
                batch,
                bytes: &bytes,
                obs: obs.as_deref_mut().map(|o| (o, l, w)),
            };
            graph::block(self.arch, &mut o, l, w)?;
        }
        // every streaming buffer is free now (a resident head needs none): fill them with
        // the next pass's first spans, read while the head, the sampling and the scheduler
        // run (the pass above kept the reads only one span ahead)
        if blocks == c.n_layers {
            for d in 0..self.io.slots {
                if let Some(next) = self.stream_item(si + d, with_head) {
                    self.source.prefetch(next);
                }
            }
        }

        // hidden states asked for (embeddings): the final norm's output, no head
        let n_hidden = batch.n_hidden();
        if n_hidden > 0 {
            if s.hidden.len() < n_hidden * d {
                s.hidden.resize(n_hidden * d, 0.0);
            }
            let rows = (0..n).filter(|&t| batch.wants_hidden(t));
            for (h, t) in rows.enumerate() {
                ops::rmsnorm(
                    &mut s.hidden[h * d..(h + 1) * d],
                    &s.x[t * d..(t + 1) * d],
                    &self.weights.output_norm,
                    eps,
                );
            }
        }
        // final norm and output head, only for the tokens that want logits
        let mut j = 0;
        for t in 0..n {
            if batch.outputs[t] {
                ops::rmsnorm(
                    &mut s.out_x[j * d..(j + 1) * d],
                    &s.x[t * d..(t + 1) * d],
                    &self.weights.output_norm,
                    eps,
                );
                j += 1;
            }
        }
        if j > 0 {
            let out = &self.weights.output;
            let vocab = c.vocab_size;
            if let Some(o) = obs {
                let emb = &self.weights.token_embd;
                let tied = (out.layer, out.offset) == (emb.layer, emb.offset);
                let name = if tied {
                    "token_embd.weight"
                } else {
                    "output.weight"
                };
                o.head(name, &s.out_x[..j * d], j);
            }
            match self.resident.get(out.layer) {
                Some(Some(h)) => {
                    self.matmul(&mut s.logits[..j * vocab], &s.out_x[..j * d], out, h, j)?;
                }
                _ => {
                    // streamed in row chunks: each chunk's logits land in their columns
                    for c in 0..out.rows.div_ceil(self.io.head.chunk_rows.max(1)) {
                        let (r0, rows) = self.head_chunk(c);
                        let bytes = self.stream(&mut si, true)?;
                        let view = out.rows_view(&bytes, r0, rows)?;
                        if j == 1 {
                            self.matmul_many(
                                &[view],
                                &s.out_x[..d],
                                1,
                                &mut [&mut s.logits[r0..r0 + rows]],
                            )?;
                        } else {
                            s.head_tmp.resize(j * rows, 0.0);
                            self.matmul_many(
                                &[view],
                                &s.out_x[..j * d],
                                j,
                                &mut [&mut s.head_tmp[..j * rows]],
                            )?;
                            for t in 0..j {
                                s.logits[t * vocab + r0..t * vocab + r0 + rows]
                                    .copy_from_slice(&s.head_tmp[t * rows..(t + 1) * rows]);
                            }
                        }
                    }
                }
            }
        }
        if let (Some(cap), true) = (c.final_softcap, j > 0) {
            ops::softcap(&mut s.logits[..j * c.vocab_size], cap);
        }
        s.n_out = j;
        Ok(j)
    }

    /// Attention parameters of block `l`.
    fn attn_params<'s>(&self, l: usize, sinks: Option<&'s [f32]>) -> AttnParams<'s> {
        let c = &self.config;
        AttnParams {
            scale: c.attn_scale,
            window: c.window(l),
            softcap: c.attn_softcap,
            sinks,
        }
    }

    /// RoPE table of block `l`.
    fn rope_of(&self, l: usize) -> &RopeTable {
        &self.ropes[rope_table_index(&self.config, l, self.ropes.len())]
    }
}

/// Which of the [`rope_tables`] (`n_tables` of them) block `l` uses: the window layers'
/// where the model has one, else the global.
pub(crate) fn rope_table_index(c: &Config, l: usize, n_tables: usize) -> usize {
    match c.window(l) {
        Some(_) if n_tables > 1 => 1,
        _ => 0,
    }
}

/// RoPE tables: the global layers' (with `rope_freqs` divisors, or LongRoPE's long or short
/// factors and attention factor, as llama.cpp picks them by the context), then, for models
/// whose window layers have their own base, the window layers' (no long-context scaling,
/// as llama.cpp's `rope_freq_base_train_swa` / `freq_scale_train_swa`).
pub(crate) fn rope_tables(config: &Config, weights: &Weights, ctx: usize) -> Vec<RopeTable> {
    let neox = config.rope_style == RopeStyle::Neox;
    let (rot, theta) = (config.rope_dims, config.rope_theta);
    let longrope =
        weights
            .rope_factors
            .as_ref()
            .map(|(long, short)| match config.rope_original_context {
                Some(orig) if ctx > orig => long,
                _ => short,
            });
    // LongRoPE's attention factor applies with its factors only.
    let attn_factor = config
        .rope_attn_factor
        .filter(|_| longrope.is_some())
        .map(|f| f as f32);
    let freqs = match weights
        .rope_freqs
        .as_deref()
        .or(longrope.map(Vec::as_slice))
    {
        Some(div) => RopeFreqs::Divisors(div),
        None => RopeFreqs::Scaled(config.rope_scaling),
    };
    let global = RopeTable::build(rot, ctx, theta, freqs, attn_factor);
    let mut ropes = vec![global.partial(config.head_dim).neox(neox)];
    if let (Some(_), Some(theta)) = (config.sliding_window, config.rope_theta_local) {
        ropes.push(
            RopeTable::new(rot, ctx, theta, crate::config::RopeScaling::None)
                .partial(config.head_dim)
                .neox(neox),
        );
    }
    ropes
}

/// Elements of the gated activation per parallel task.
const GLU_CHUNK: usize = 8192;

/// The row kernel of the gated activation `act`: `gate = act(gate) · up`.
fn glu_fn(act: Glu) -> fn(&mut [f32], &[f32]) {
    match act {
        Glu::Silu => ops::swiglu,
        Glu::GeluTanh => ops::geglu,
        Glu::SwigluOai => ops::swiglu_oai,
    }
}

/// The CPU backend of the graph's [`Ops`] for one block of one batch: buffers are the rows
/// of [`RunState`], matrices are [`TensorRef`]s into the block's resident `bytes`, vectors
/// are f32 loaded at open.
struct CpuOps<'a, 'o> {
    m: &'a Model,
    s: &'a mut RunState,
    kv: &'a mut KvCache,
    batch: &'a Batch,
    bytes: &'a LayerBytes,
    /// An observer of the products' inputs, with the block's index and weights (to name
    /// the matrices); `None` in the plain forward pass.
    obs: Option<(&'a mut (dyn MatmulObserver + 'o), usize, &'a BlockWeights)>,
}

impl CpuOps<'_, '_> {
    /// Width of one token's row of `b`.
    fn width(&self, b: Buf) -> usize {
        let c = &self.m.config;
        match b {
            Buf::X | Buf::Xb | Buf::Proj => c.n_embd,
            Buf::Q | Buf::Att => c.q_dim(),
            Buf::K | Buf::V => c.kv_dim(),
            Buf::Gate | Buf::Up => c.n_ff,
        }
    }

    fn field(s: &mut RunState, b: Buf) -> &mut Vec<f32> {
        match b {
            Buf::X => &mut s.x,
            Buf::Xb => &mut s.xb,
            Buf::Q => &mut s.q,
            Buf::K => &mut s.k,
            Buf::V => &mut s.v,
            Buf::Att => &mut s.att,
            Buf::Proj => &mut s.proj,
            Buf::Gate => &mut s.gate,
            Buf::Up => &mut s.up,
        }
    }

    /// The batch's rows of `b`, moved out of the run state (put back with [`Self::put`]) so
    /// that several buffers can be borrowed at once; moving a `Vec` copies no data.
    fn take(&mut self, b: Buf) -> Vec<f32> {
        std::mem::take(Self::field(self.s, b))
    }

    fn put(&mut self, b: Buf, v: Vec<f32>) {
        *Self::field(self.s, b) = v;
    }

    fn rows(&self, b: Buf) -> usize {
        self.batch.len() * self.width(b)
    }
}

impl Ops for CpuOps<'_, '_> {
    type Mat = TensorRef;
    type Vec = Vec<f32>;

    fn rms_norm(&mut self, out: Buf, x: Buf, w: &Vec<f32>) -> Result<()> {
        let (len, eps) = (self.rows(x), self.m.config.rms_norm_eps);
        if out == x {
            ops::rmsnorm_rows_inplace(&mut Self::field(self.s, x)[..len], w, eps);
        } else {
            let mut o = self.take(out);
            ops::rmsnorm_rows(&mut o[..len], &Self::field(self.s, x)[..len], w, eps);
            self.put(out, o);
        }
        Ok(())
    }

    fn head_norm(&mut self, buf: Buf, w: &Vec<f32>) -> Result<()> {
        let (len, eps) = (self.rows(buf), self.m.config.rms_norm_eps);
        ops::rmsnorm_rows_inplace(&mut Self::field(self.s, buf)[..len], w, eps);
        Ok(())
    }

    fn matmul(&mut self, x: Buf, outs: &[(Buf, &TensorRef)]) -> Result<()> {
        let n = self.batch.len();
        let views = outs
            .iter()
            .map(|(_, w)| w.view(self.bytes))
            .collect::<Result<Vec<_>>>()?;
        let mut taken: Vec<(Buf, Vec<f32>)> =
            outs.iter().map(|&(b, _)| (b, self.take(b))).collect();
        let lens: Vec<usize> = outs.iter().map(|&(b, _)| self.rows(b)).collect();
        let xlen = self.rows(x);
        let xin = &Self::field(self.s, x)[..xlen];
        if let Some((o, l, block)) = &mut self.obs {
            let roles = block.matrices();
            for (_, w) in outs {
                if let Some((role, _)) = roles.iter().find(|(_, m)| std::ptr::eq(*m, *w)) {
                    o.matmul(*l, role, xin, n);
                }
            }
        }
        let mut ys: Vec<&mut [f32]> = taken
            .iter_mut()
            .zip(&lens)
            .map(|((_, v), &len)| &mut v[..len])
            .collect();
        let r = self.m.matmul_many(&views, xin, n, &mut ys);
        drop(ys);
        for (b, v) in taken {
            self.put(b, v);
        }
        r
    }

    fn add_bias(&mut self, buf: Buf, b: &Vec<f32>) -> Result<()> {
        let len = self.rows(buf);
        ops::add_bias_rows(&mut Self::field(self.s, buf)[..len], b);
        Ok(())
    }

    fn rope(&mut self, layer: usize) -> Result<()> {
        let (qd, kvd) = (self.width(Buf::Q), self.width(Buf::K));
        let rope = self.m.rope_of(layer);
        for (t, &pos) in self.batch.positions.iter().enumerate() {
            rope.apply(&mut self.s.q[t * qd..(t + 1) * qd], pos);
            rope.apply(&mut self.s.k[t * kvd..(t + 1) * kvd], pos);
        }
        Ok(())
    }

    fn attention(&mut self, layer: usize, sinks: Option<&Vec<f32>>) -> Result<()> {
        let p = self.m.attn_params(layer, sinks.map(Vec::as_slice));
        let s = &mut *self.s;
        let mut bufs = crate::attention::Buffers {
            q: &s.q,
            k: &s.k,
            v: &s.v,
            att: &mut s.att,
            scores: &mut s.scores,
            part: &mut s.part,
            n_tasks: s.n_tasks,
        };
        crate::attention::layer(
            &self.m.config,
            self.m.simd,
            &mut bufs,
            self.kv,
            layer,
            self.batch,
            &p,
        );
        Ok(())
    }

    fn glu(&mut self, act: Glu) -> Result<()> {
        use rayon::prelude::*;
        let len = self.rows(Buf::Gate);
        let (g, u) = (&mut self.s.gate[..len], &self.s.up[..len]);
        let f = glu_fn(act);
        // a prompt's rows are spread over the pool (the tanh of GeGLU is not free)
        g.par_chunks_mut(GLU_CHUNK)
            .zip(u.par_chunks(GLU_CHUNK))
            .for_each(|(g, u)| f(g, u));
        Ok(())
    }

    fn add(&mut self, y: Buf, x: Buf) -> Result<()> {
        let len = self.rows(y);
        let xv = self.take(x);
        ops::add_assign(&mut Self::field(self.s, y)[..len], &xv[..len]);
        self.put(x, xv);
        Ok(())
    }

    fn moe(&mut self, e: &Experts<TensorRef, Vec<f32>>, act: Glu) -> Result<()> {
        let n = self.batch.len();
        let d = self.m.config.n_embd;
        let s = &mut *self.s;
        let xb = &s.xb[..n * d];
        if let Some((o, l, _)) = &mut self.obs {
            o.matmul(*l, "ffn_gate_inp", xb, n);
        }
        let sc = &mut s.moe;
        sc.logits.resize(n * e.n, 0.0);
        self.m.matmul_many(
            &[e.router.view(self.bytes)?],
            xb,
            n,
            &mut [&mut sc.logits[..n * e.n]],
        )?;
        if let Some(b) = &e.router_bias {
            ops::add_bias_rows(&mut sc.logits[..n * e.n], b);
        }
        let by_expert = graph::route(&mut sc.logits[..n * e.n], e.n, e.used, e.gating);
        let proj = &mut s.proj[..n * d];
        proj.fill(0.0);
        let glu = glu_fn(act);
        // the chosen experts' bytes: in the block's (resident or read whole), else from the
        // expert cache, as many at a time as it holds
        let chosen: Vec<usize> = (0..e.n).filter(|&x| !by_expert[x].is_empty()).collect();
        let in_block = [&e.gate, &e.up, &e.down].iter().all(|t| {
            self.bytes.covers(&Span {
                layer: t.layer,
                offset: t.offset as u64,
                len: t.nbytes as u64,
            })
        });
        let cache = match &self.m.experts {
            Some(c) if !in_block => Some(c),
            _ => None,
        };
        let round = cache.map_or(chosen.len(), ExpertCache::capacity).max(1);
        for xs in chosen.chunks(round) {
            let fetched = match cache {
                Some(c) => c.get(&*self.m.source, e, xs)?,
                None => Vec::new(),
            };
            for (i, &x) in xs.iter().enumerate() {
                let (gate, up, down) = match fetched.get(i) {
                    Some(f) => (&f.gate, &f.up, &f.down),
                    None => (self.bytes, self.bytes, self.bytes),
                };
                let tokens = &by_expert[x];
                let m = tokens.len();
                let ff = e.n_ff;
                sc.x.resize(m * d, 0.0);
                sc.gate.resize(m * ff, 0.0);
                sc.up.resize(m * ff, 0.0);
                sc.out.resize(m * d, 0.0);
                for (j, &(t, _)) in tokens.iter().enumerate() {
                    sc.x[j * d..(j + 1) * d].copy_from_slice(&xb[t * d..(t + 1) * d]);
                }
                self.m.matmul_many(
                    &[
                        e.gate.rows_view(gate, x * ff, ff)?,
                        e.up.rows_view(up, x * ff, ff)?,
                    ],
                    &sc.x[..m * d],
                    m,
                    &mut [&mut sc.gate[..m * ff], &mut sc.up[..m * ff]],
                )?;
                if let Some([bg, bu, _]) = &e.biases {
                    ops::add_bias_rows(&mut sc.gate[..m * ff], &bg[x * ff..(x + 1) * ff]);
                    ops::add_bias_rows(&mut sc.up[..m * ff], &bu[x * ff..(x + 1) * ff]);
                }
                glu(&mut sc.gate[..m * ff], &sc.up[..m * ff]);
                if let Some((o, l, _)) = &mut self.obs {
                    let xin = &sc.x[..m * d];
                    o.expert(*l, "ffn_gate_exps", x, e.n, xin, m);
                    o.expert(*l, "ffn_up_exps", x, e.n, xin, m);
                    o.expert(*l, "ffn_down_exps", x, e.n, &sc.gate[..m * ff], m);
                }
                self.m.matmul_many(
                    &[e.down.rows_view(down, x * d, d)?],
                    &sc.gate[..m * ff],
                    m,
                    &mut [&mut sc.out[..m * d]],
                )?;
                if let Some([_, _, bd]) = &e.biases {
                    ops::add_bias_rows(&mut sc.out[..m * d], &bd[x * d..(x + 1) * d]);
                }
                for (j, &(t, w)) in tokens.iter().enumerate() {
                    let out = &sc.out[j * d..(j + 1) * d];
                    for (p, &v) in proj[t * d..(t + 1) * d].iter_mut().zip(out) {
                        *p += w * v;
                    }
                }
            }
        }
        Ok(())
    }
}
