//! The executor: one sequence's forward passes on the backend the plan chose.
//!
//! [`Executor`] is the seam between the run loop (engine, perplexity, bench) and the
//! compute backend. The CPU executor wraps [`Model`] with its run state and KV cache; the
//! CUDA executor (feature `cuda`) wraps `gds_cuda::executor::GpuModel`, whose KV cache and
//! activations live in VRAM. The run loop, sampler and metrics are the same for both.
//!
//! The batched server does not go through this trait: it drives [`Model`] directly with
//! its paged KV cache, and runs on the CPU backend only.

use crate::config::Config;
use crate::error::{Result, RuntimeError};
use crate::kv::KvCache;
use crate::model::{Batch, Model, RunState};
use crate::plan::Plan;
use gds_io::IoStats;
use std::ops::Range;

/// One sequence's forward passes on some backend.
pub trait Executor: Send {
    /// The backend's name (`cpu`, `cuda`).
    fn backend(&self) -> &'static str;

    /// The model's hyperparameters.
    fn config(&self) -> &Config;

    /// Evaluates `tokens` at positions `pos0..` of the sequence (cache entries from `pos0`
    /// on are overwritten) and calls `on_logits(position, logits)` for every position in
    /// `want`, in order. Longer inputs than one pass takes are split by the executor.
    fn eval(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        want: Range<usize>,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()>;

    /// The logits of the last position that [`eval`](Executor::eval) reported, for the
    /// sampler to modify in place.
    fn last_logits_mut(&mut self) -> &mut [f32];

    /// Counters of the bytes read from layer files.
    fn io_stats(&self) -> IoStats;
}

/// Evaluates `tokens` at `pos0..` and leaves the last token's logits for
/// [`Executor::last_logits_mut`].
pub fn eval_last(ex: &mut dyn Executor, tokens: &[u32], pos0: usize) -> Result<()> {
    let end = pos0 + tokens.len();
    ex.eval(tokens, pos0, end.saturating_sub(1)..end, &mut |_, _| {})
}

/// The CPU executor: the model, a run state for `batch` tokens, and a contiguous KV cache.
pub struct CpuExecutor {
    model: Model,
    state: RunState,
    kv: KvCache,
    batch: Batch,
    last: usize,
}

impl CpuExecutor {
    /// Wraps `model` with buffers for passes of up to `batch` tokens, of which up to
    /// `outputs` may return logits, and a KV cache of the plan's type for the model's
    /// context.
    pub fn new(model: Model, plan: &Plan, batch: usize, outputs: usize) -> CpuExecutor {
        let c = &model.config;
        let state = RunState::new(c, batch, outputs, model.ctx(), model.threads());
        let kv = KvCache::new(plan.kv_dtype, c.n_layers, 1, model.ctx(), c.kv_dim());
        CpuExecutor {
            batch: Batch::with_capacity(batch),
            model,
            state,
            kv,
            last: 0,
        }
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl Executor for CpuExecutor {
    fn backend(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &Config {
        &self.model.config
    }

    fn eval(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        want: Range<usize>,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        let step = self.state.max_batch().max(1);
        for (ci, chunk) in tokens.chunks(step).enumerate() {
            let start = pos0 + ci * step;
            self.batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                self.batch
                    .push(t, start + i, 0, want.contains(&(start + i)));
            }
            let n_out = self
                .model
                .forward(&mut self.state, &mut self.kv, &self.batch)?;
            let wanted = (start..start + chunk.len()).filter(|p| want.contains(p));
            for (j, p) in wanted.enumerate() {
                on_logits(p, self.state.logits(j, vocab));
            }
            if n_out > 0 {
                self.last = n_out - 1;
            }
        }
        Ok(())
    }

    fn last_logits_mut(&mut self) -> &mut [f32] {
        let vocab = self.model.config.vocab_size;
        self.state.logits_mut(self.last, vocab)
    }

    fn io_stats(&self) -> IoStats {
        self.model.io_stats()
    }
}

/// Opens the executor of the plan's backend for passes of up to `batch` tokens, of which
/// up to `outputs` may return logits (the CPU executor sizes its buffers by them).
pub fn open(plan: &Plan, batch: usize, outputs: usize) -> Result<Box<dyn Executor>> {
    match plan.backend.as_str() {
        "cpu" => Ok(Box::new(CpuExecutor::new(
            Model::open(plan)?,
            plan,
            batch,
            outputs,
        ))),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Box::new(crate::gpu::GpuExecutor::open(plan)?)),
        other => Err(RuntimeError::Plan(format!(
            "backend {other} is not available in this build"
        ))),
    }
}
