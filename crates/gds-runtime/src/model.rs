//! The llama-family model: load (map the layers, locate the weights) and the forward pass.
//!
//! `forward` reads top to bottom like llama2.c's, but over a batch of tokens so a prompt is
//! processed with one matrix product per weight. Each token of a batch carries its own
//! position and sequence id, so several independent sequences can share one pass.

use crate::config::Config;
use crate::error::{Result, RuntimeError};
use crate::ioplan::IoPlan;
use crate::kv::KvCache;
use crate::ops;
use crate::rope::RopeTable;
use crate::weights::{TensorRef, Weights};
use gds_io::{
    DirectBackend, DirectOptions, IoStats, LayerBytes, LayerSource, MmapBackend, Span, Verifier,
    VerifyMode, VerifyStats,
};
use std::path::Path;
use std::sync::Arc;

/// A batch of tokens to run through the model. Reused between calls: clearing keeps the
/// capacity, so the token loop does not allocate.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub(crate) tokens: Vec<u32>,
    pub(crate) positions: Vec<usize>,
    pub(crate) seqs: Vec<usize>,
    pub(crate) outputs: Vec<bool>,
}

impl Batch {
    /// An empty batch with room for `n` tokens.
    pub fn with_capacity(n: usize) -> Batch {
        Batch {
            tokens: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            seqs: Vec::with_capacity(n),
            outputs: Vec::with_capacity(n),
        }
    }

    /// Removes every token.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.seqs.clear();
        self.outputs.clear();
    }

    /// Adds `token` at position `pos` of sequence `seq`; `output` asks for its logits.
    pub fn push(&mut self, token: u32, pos: usize, seq: usize, output: bool) {
        self.tokens.push(token);
        self.positions.push(pos);
        self.seqs.push(seq);
        self.outputs.push(output);
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the batch has no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of tokens whose logits are wanted.
    pub fn n_outputs(&self) -> usize {
        self.outputs.iter().filter(|&&o| o).count()
    }
}

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
    /// `[max_batch, n_ff]`
    gate: Vec<f32>,
    /// `[max_batch, n_ff]`
    up: Vec<f32>,
    /// attention scores, one row of `ctx` per parallel task `[n_tasks, ctx]`
    pub(crate) scores: Vec<f32>,
    pub(crate) n_tasks: usize,
    /// final-normed hidden states of the output tokens `[max_outputs, n_embd]`
    out_x: Vec<f32>,
    /// logits of the output tokens, in batch order `[max_outputs, vocab_size]`
    logits: Vec<f32>,
    n_out: usize,
    /// one embedding row read from disk (streaming plans)
    emb_row: Vec<u8>,
    /// logits of one streamed head chunk for several output tokens
    head_tmp: Vec<f32>,
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
            gate: vec![0.0; b * cfg.n_ff],
            up: vec![0.0; b * cfg.n_ff],
            scores: vec![0.0; n_tasks * ctx],
            n_tasks,
            out_x: vec![0.0; max_outputs.max(1) * cfg.n_embd],
            logits: vec![0.0; max_outputs.max(1) * cfg.vocab_size],
            n_out: 0,
            emb_row: Vec::new(),
            head_tmp: Vec::new(),
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
    rope: RopeTable,
    pool: rayon::ThreadPool,
    ctx: usize,
    /// AVX2+FMA attention, decided once at load.
    simd: bool,
    /// Keep activations in f32 (weights dequantized row by row) instead of quantizing them
    /// to 8 bits for integer dot products.
    f32_act: bool,
}

impl Model {
    /// Loads the model the way `plan` says (I/O backend, residency, context, threads).
    pub fn open(plan: &crate::plan::Plan) -> Result<Model> {
        let mut m = Model::with_io(&plan.model_dir, &plan.io_plan, plan.ctx, plan.threads)?;
        m.set_f32_activations(plan.activations == "f32");
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
        let m = crate::plan::parse_manifest(dir, &manifest_bytes)?;
        let io = crate::ioplan::plan_io(dir, &m, "mmap", None, || {
            gds_io::DirectSupport::Buffered("not used by mmap".into())
        })?;
        Model::with_io(dir, &io, ctx, threads)
    }

    /// Opens the model directory with the I/O backend and residency of `io`.
    pub fn with_io(dir: &Path, io: &IoPlan, ctx: usize, threads: usize) -> Result<Model> {
        let manifest_bytes = gds_io::read_manifest(dir)?;
        let m = crate::plan::parse_manifest(dir, &manifest_bytes)?;
        let config = Config::from_manifest(&m).map_err(|e| crate::plan::with_dir(e, dir))?;
        let verifier = Arc::new(Verifier::new(if io.verify {
            VerifyMode::Hash
        } else {
            VerifyMode::Off
        }));
        let source: Box<dyn LayerSource> = match io.mode.as_str() {
            "mmap" => Box::new(MmapBackend::open_with(dir, &m, &verifier)?),
            mode => {
                let opts = DirectOptions {
                    resident: (0..m.n_layers()).map(|l| io.is_resident(l)).collect(),
                    slots: io.slots,
                    slot_size: io.slot_bytes as usize,
                    force_buffered: mode == "buffered",
                    verifier: Some(verifier.clone()),
                };
                Box::new(DirectBackend::open(dir, &m, &opts)?)
            }
        };
        let mut resident = vec![None; source.n_layers()];
        for &l in &io.resident_layers {
            if let Some(r) = resident.get_mut(l) {
                *r = Some(source.acquire(l)?);
            }
        }
        let weights =
            Weights::load(&config, &m, &*source).map_err(|e| crate::plan::with_dir(e, dir))?;
        let rope = RopeTable::new(config.head_dim, ctx, config.rope_theta, config.rope_scaling);
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
            rope,
            pool,
            ctx,
            simd: ops::simd_available(),
            f32_act: false,
        })
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

    /// The I/O backend's counters.
    pub fn io_stats(&self) -> IoStats {
        self.source.stats()
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
        self.pool.install(|| self.forward_inner(state, kv, batch))
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
        if kv.n_layers() != self.config.n_layers
            || kv.ctx() > self.ctx
            || state.scores.len() < state.n_tasks * kv.ctx()
        {
            return bad("KV cache or run state was made for another model or context".into());
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
                len: self.source.layer_size(layer),
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

    fn forward_inner(&self, s: &mut RunState, kv: &mut KvCache, batch: &Batch) -> Result<usize> {
        let c = &self.config;
        let n = batch.len();
        let (d, qd, kvd, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        let eps = c.rms_norm_eps;

        let with_head = batch.n_outputs() > 0;
        // stream position: the first streamed span is hinted now, so its read overlaps the
        // embedding and any resident blocks before it
        let mut si = 0usize;
        if let Some(first) = self.stream_item(0, with_head) {
            self.source.prefetch(first);
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

        for (l, w) in self.weights.blocks.iter().enumerate() {
            let bytes = self.layer_bytes(w.wq.layer, &mut si, with_head)?;
            // attention
            ops::rmsnorm_rows(&mut s.xb[..n * d], &s.x[..n * d], &w.attn_norm, eps);
            // one call for Q, K and V: the input is quantized once, one parallel region
            let qkv = [w.wq.view(&bytes)?, w.wk.view(&bytes)?, w.wv.view(&bytes)?];
            self.matmul_many(
                &qkv,
                &s.xb[..n * d],
                n,
                &mut [&mut s.q[..n * qd], &mut s.k[..n * kvd], &mut s.v[..n * kvd]],
            )?;
            if let Some(b) = &w.bq {
                ops::add_bias_rows(&mut s.q[..n * qd], b);
            }
            if let Some(b) = &w.bk {
                ops::add_bias_rows(&mut s.k[..n * kvd], b);
            }
            if let Some(b) = &w.bv {
                ops::add_bias_rows(&mut s.v[..n * kvd], b);
            }
            for (t, &pos) in batch.positions.iter().enumerate() {
                self.rope.apply(&mut s.q[t * qd..(t + 1) * qd], pos);
                self.rope.apply(&mut s.k[t * kvd..(t + 1) * kvd], pos);
            }
            crate::attention::layer(c, self.simd, s, kv, l, batch);
            self.matmul(&mut s.proj[..n * d], &s.att[..n * qd], &w.wo, &bytes, n)?;
            ops::add_assign(&mut s.x[..n * d], &s.proj[..n * d]);

            // feed-forward
            ops::rmsnorm_rows(&mut s.xb[..n * d], &s.x[..n * d], &w.ffn_norm, eps);
            let gate_up = [w.w_gate.view(&bytes)?, w.w_up.view(&bytes)?];
            self.matmul_many(
                &gate_up,
                &s.xb[..n * d],
                n,
                &mut [&mut s.gate[..n * ff], &mut s.up[..n * ff]],
            )?;
            ops::swiglu(&mut s.gate[..n * ff], &s.up[..n * ff]);
            self.matmul(
                &mut s.proj[..n * d],
                &s.gate[..n * ff],
                &w.w_down,
                &bytes,
                n,
            )?;
            ops::add_assign(&mut s.x[..n * d], &s.proj[..n * d]);
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
        s.n_out = j;
        Ok(j)
    }
}
