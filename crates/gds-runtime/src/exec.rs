//! The executor: one sequence's forward passes on the backend the plan chose.
//!
//! [`Executor`] is the seam between the run loop (engine, perplexity, bench) and the
//! compute backend. The CPU executor wraps [`Model`] with its run state and KV cache; the
//! CUDA executor (feature `cuda`) wraps `gds_cuda::executor::GpuModel`, whose KV cache and
//! activations live in VRAM. The run loop, sampler and metrics are the same for both.
//!
//! [`BatchExecutor`] is the batched form the server's scheduler drives: tokens of several
//! sequences at their positions, over a paged KV cache whose block tables the scheduler
//! manages in a [`KvCache`] and whose rows the backend holds (host memory on the CPU, VRAM
//! on the GPU: `crate::gpu::GpuBatchExecutor`).

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

    /// Whether the sequence, holding `len` positions, can be cut back to its first `keep`
    /// and continued from there (false when a sliding-window ring has overwritten keys that
    /// position `keep` needs: evaluate again from 0).
    fn can_truncate(&self, len: usize, keep: usize) -> bool {
        let _ = (len, keep);
        true
    }

    /// What checking the layer files' content hashes cost (zero where the backend does not
    /// hash on the host).
    fn verify_stats(&self) -> gds_io::VerifyStats {
        gds_io::VerifyStats::default()
    }

    /// Evaluates `token` at `pos` through the first `blocks` blocks and the output head
    /// only (self-speculation's draft), leaving its logits for
    /// [`last_logits_mut`](Executor::last_logits_mut). The K/V it writes for those blocks
    /// are what a full pass writes there for the same token, and a full pass over the
    /// position overwrites them in any case.
    fn eval_exit(&mut self, token: u32, pos: usize, blocks: usize) -> Result<()> {
        let _ = (token, pos, blocks);
        Err(RuntimeError::Usage(format!(
            "--draft layers:N: the {} backend has no early exit",
            self.backend()
        )))
    }
}

/// Forward passes over batches of several sequences (the server's scheduler): each token
/// of `batch` at its position of its sequence (`seq` = the sequence's slot in `kv`), reading
/// and writing its K/V through `kv`'s block tables, with logits for the batch's output
/// tokens.
pub trait BatchExecutor: Send {
    /// The backend it runs on.
    fn backend(&self) -> crate::backend::Backend;
    /// The model's hyperparameters.
    fn config(&self) -> &Config;
    /// Runs `batch` over `kv`; returns the number of logit rows, one per output token in
    /// batch order ([`BatchExecutor::logits`]).
    fn forward(&mut self, kv: &mut KvCache, batch: &Batch) -> Result<usize>;
    /// Logits of output row `i` of the last pass.
    fn logits(&self, i: usize) -> &[f32];
    /// The same, for the sampler to modify in place.
    fn logits_mut(&mut self, i: usize) -> &mut [f32];
}

/// The CPU's [`BatchExecutor`]: the model and a run state for passes of up to `batch`
/// tokens, `outputs` of them with logits; the KV rows are the cache's.
pub struct CpuBatchExecutor {
    model: Model,
    state: RunState,
}

impl CpuBatchExecutor {
    /// Wraps `model` with buffers for passes of up to `batch` tokens and `outputs` logit
    /// rows, over a context of `ctx`.
    pub fn new(model: Model, batch: usize, outputs: usize, ctx: usize) -> CpuBatchExecutor {
        let state = RunState::new(&model.config, batch, outputs, ctx, model.threads());
        CpuBatchExecutor { model, state }
    }
}

impl BatchExecutor for CpuBatchExecutor {
    fn backend(&self) -> crate::backend::Backend {
        crate::backend::Backend::Cpu
    }
    fn config(&self) -> &Config {
        &self.model.config
    }
    fn forward(&mut self, kv: &mut KvCache, batch: &Batch) -> Result<usize> {
        self.model.forward(&mut self.state, kv, batch)
    }
    fn logits(&self, i: usize) -> &[f32] {
        self.state.logits(i, self.model.config.vocab_size)
    }
    fn logits_mut(&mut self, i: usize) -> &mut [f32] {
        let vocab = self.model.config.vocab_size;
        self.state.logits_mut(i, vocab)
    }
}

/// How many leading tokens of `seq` a sequence can keep in its cache, which holds the K/V
/// of `cached` and has been written up to position `written`: their common prefix, less
/// `seq`'s last token (evaluated again for its logits), and none where a sliding-window
/// ring no longer holds the keys the first new position sees.
pub fn reusable_prefix(ex: &dyn Executor, cached: &[u32], written: usize, seq: &[u32]) -> usize {
    let common = cached
        .iter()
        .zip(seq)
        .take_while(|(a, b)| a == b)
        .count()
        .min(seq.len().saturating_sub(1));
    if ex.can_truncate(written, common) {
        common
    } else {
        0
    }
}

/// Evaluates `tokens` at `pos0..` and leaves the last token's logits for
/// [`Executor::last_logits_mut`].
pub fn eval_last(ex: &mut dyn Executor, tokens: &[u32], pos0: usize) -> Result<()> {
    let end = pos0 + tokens.len();
    ex.eval(tokens, pos0, end.saturating_sub(1)..end, &mut |_, _| {})
}

/// How a backend whose pass returns logits only for its last positions (the GPU executor:
/// up to `max_rows` of them) covers `n` tokens at `pos0..` with logits at every position
/// of `want`: `(start, len, rows)` passes, the last `rows` positions of each getting
/// logits. Positions before the first wanted one go in passes of up to `max_tokens`, the
/// last of which also takes the first wanted positions where they fit; wanted positions go
/// `max_rows` at a time; positions after them in passes without logits.
pub fn logit_passes(
    pos0: usize,
    n: usize,
    want: &Range<usize>,
    max_tokens: usize,
    max_rows: usize,
) -> Vec<(usize, usize, usize)> {
    let (max_tokens, max_rows) = (max_tokens.max(1), max_rows.clamp(1, max_tokens.max(1)));
    let end = pos0 + n;
    let want_end = want.end.clamp(pos0, end);
    let first = want.start.clamp(pos0, want_end);
    let mut passes = Vec::new();
    let mut pos = pos0;
    while pos < end {
        let (len, rows) = if pos < first {
            let gap = first - pos;
            if gap >= max_tokens {
                (max_tokens, 0)
            } else {
                let r = (want_end - first).min(max_rows).min(max_tokens - gap);
                (gap + r, r)
            }
        } else if pos < want_end {
            let r = (want_end - pos).min(max_rows);
            (r, r)
        } else {
            ((end - pos).min(max_tokens), 0)
        };
        passes.push((pos, len, rows));
        pos += len;
    }
    passes
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
        let windows: Vec<Option<usize>> = (0..c.n_layers).map(|l| c.window(l)).collect();
        let kv = KvCache::with_window_ring(
            plan.kv_dtype,
            1,
            model.ctx(),
            c.kv_dim(),
            &windows,
            batch.max(1),
        );
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

    fn can_truncate(&self, len: usize, keep: usize) -> bool {
        self.kv.can_truncate(len, keep)
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
        let last = crate::perplexity::eval_positions(
            &self.model,
            &mut self.state,
            &mut self.kv,
            &mut self.batch,
            tokens,
            pos0,
            want,
            on_logits,
        )?;
        if let Some(l) = last {
            self.last = l;
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

    fn verify_stats(&self) -> gds_io::VerifyStats {
        self.model.verify_stats()
    }

    fn eval_exit(&mut self, token: u32, pos: usize, blocks: usize) -> Result<()> {
        self.batch.clear();
        self.batch.push(token, pos, 0, true);
        self.model
            .forward_exit(&mut self.state, &mut self.kv, &self.batch, blocks)?;
        self.last = 0;
        Ok(())
    }
}

/// Opens the executor of the plan's backend for passes of up to `batch` tokens, of which
/// up to `outputs` may return logits (the CPU executor sizes its buffers by them).
pub fn open(plan: &Plan, batch: usize, outputs: usize) -> Result<Box<dyn Executor>> {
    match plan.backend {
        crate::backend::Backend::Cpu => Ok(Box::new(CpuExecutor::new(
            Model::open(plan)?,
            plan,
            batch,
            outputs,
        ))),
        #[cfg(feature = "cuda")]
        crate::backend::Backend::Cuda => Ok(Box::new(crate::gpu::GpuExecutor::open(plan)?)),
        #[cfg(not(feature = "cuda"))]
        other => Err(RuntimeError::Internal(format!(
            "backend {other} is not available in this build"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::logit_passes;

    #[test]
    fn logit_passes_cover_every_token_once_and_every_wanted_position_at_a_pass_end() {
        for (pos0, n, want, max, rows) in [
            (0, 10, 9..10, 4, 1),
            (0, 10, 3..7, 4, 1),
            (0, 10, 3..7, 4, 16),
            (5, 20, 0..100, 8, 3),
            (0, 600, 512..599, 512, 16),
            (3, 7, 50..60, 2, 2),
            (0, 1, 0..1, 512, 16),
            (10, 11, 10..21, 512, 16),
            (0, 40, 5..5, 8, 4),
        ] {
            let passes = logit_passes(pos0, n, &want, max, rows);
            let mut pos = pos0;
            let mut got = Vec::new();
            for &(start, len, r) in &passes {
                assert_eq!(start, pos, "{passes:?}");
                assert!(
                    len >= 1 && len <= max && r <= len && r <= rows,
                    "{passes:?}"
                );
                got.extend(start + len - r..start + len);
                pos += len;
            }
            assert_eq!(pos, pos0 + n);
            // exactly the wanted positions inside the input get logits, in order
            let wanted: Vec<usize> = want
                .clone()
                .filter(|p| (pos0..pos0 + n).contains(p))
                .collect();
            assert_eq!(got, wanted, "{passes:?}");
        }
        // one logit row per pass: the wanted positions each end a pass
        assert_eq!(
            logit_passes(0, 10, &(9..10), 4, 1),
            vec![(0, 4, 0), (4, 4, 0), (8, 2, 1)]
        );
        // a speculative pass: the sampled token and its guesses, all in one
        assert_eq!(logit_passes(10, 11, &(10..21), 512, 16), vec![(10, 11, 11)]);
        // a prompt chunk: one pass, logits for its last position
        assert_eq!(logit_passes(0, 7, &(6..7), 512, 16), vec![(0, 7, 1)]);
    }
}
