//! The executors: the one forward interface every front end runs through.
//!
//! [`BatchExecutor`] is the forward pass of every backend: tokens of several sequences at
//! their positions, over a KV cache whose block tables a [`KvCache`] manages and whose rows
//! the backend holds (host memory on the CPU: [`CpuBatchExecutor`]; VRAM on the GPU:
//! `crate::exec::gpu::GpuBatchExecutor`). The server's scheduler drives it directly.
//!
//! [`Executor`] is the one-sequence view the run loop (engine, perplexity, bench, drafts)
//! uses: [`OneSequence`], a batch of one sequence through a [`BatchExecutor`] over a cache of
//! one sequence. The run loop, sampler and metrics are the same for every backend.
//!
//! The GPU's executors live here too, below [`open`], which picks the plan's backend:
//! [`cuda_graph`] (the architecture's graph over the CUDA kernels, and the executor over any
//! device's streamer, which the tests run on the kernels compiled as C++) and `gpu` (the
//! CUDA executor proper, feature `cuda`). The crate re-exports both at its root
//! (`gds_runtime::cuda_graph`, `gds_runtime::gpu`).

pub mod cuda_graph;
#[cfg(feature = "cuda")]
pub mod gpu;

use crate::backend::Backend;
use crate::batch::Batch;
use crate::config::Config;
use crate::error::{Result, RuntimeError};
use crate::kv::KvCache;
use crate::model::{Model, RunState};
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
    fn backend(&self) -> Backend;
    /// The model's hyperparameters.
    fn config(&self) -> &Config;
    /// Runs `batch` over `kv`; returns the number of logit rows, one per output token in
    /// batch order ([`BatchExecutor::logits`]).
    fn forward(&mut self, kv: &mut KvCache, batch: &Batch) -> Result<usize>;
    /// Logits of output row `i` of the last pass.
    fn logits(&self, i: usize) -> &[f32];
    /// The same, for the sampler to modify in place.
    fn logits_mut(&mut self, i: usize) -> &mut [f32];
    /// Counters of the bytes read from layer files.
    fn io_stats(&self) -> IoStats;
    /// What checking the layer files' content hashes cost (zero where the backend does not
    /// hash on the host).
    fn verify_stats(&self) -> gds_io::VerifyStats {
        gds_io::VerifyStats::default()
    }
    /// Whether passes give the final-normed hidden states of the tokens that ask for them
    /// ([`Batch::push_hidden`]; embeddings). Where not, such tokens are only prefilled.
    fn gives_hidden(&self) -> bool {
        false
    }
    /// The hidden state of the `i`-th token of the last pass that asked for one (in batch
    /// order), where [`BatchExecutor::gives_hidden`].
    fn hidden(&self, i: usize) -> &[f32] {
        let _ = i;
        &[]
    }
    /// Runs `batch` through the first `blocks` blocks and the output head only (an early
    /// exit: self-speculation's draft); the logits as [`BatchExecutor::forward`] leaves them.
    fn forward_exit(&mut self, kv: &mut KvCache, batch: &Batch, blocks: usize) -> Result<usize> {
        let _ = (kv, batch, blocks);
        Err(RuntimeError::Usage(format!(
            "--draft layers:N: the {} backend has no early exit",
            self.backend()
        )))
    }
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
    fn backend(&self) -> Backend {
        Backend::Cpu
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
    fn io_stats(&self) -> IoStats {
        self.model.io_stats()
    }
    fn verify_stats(&self) -> gds_io::VerifyStats {
        self.model.verify_stats()
    }
    fn forward_exit(&mut self, kv: &mut KvCache, batch: &Batch, blocks: usize) -> Result<usize> {
        self.model.forward_exit(&mut self.state, kv, batch, blocks)
    }
    fn gives_hidden(&self) -> bool {
        true
    }
    fn hidden(&self, i: usize) -> &[f32] {
        self.state.hidden(i, self.model.config.n_embd)
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

/// Where the pass starting at `pos` ends (exclusive) when `end` positions are evaluated,
/// the positions of `want` with logits: at most `max_tokens` positions and `max_rows` of
/// them wanted (at least one position a pass).
pub fn pass_end(
    pos: usize,
    end: usize,
    want: &Range<usize>,
    max_tokens: usize,
    max_rows: usize,
) -> usize {
    let limit = end.min(pos.saturating_add(max_tokens.max(1)));
    // wanted positions in pos..limit: the overlap of want with it
    let (w0, w1) = (want.start.max(pos), want.end.min(limit));
    if w1 > w0 && w1 - w0 > max_rows.max(1) {
        // the pass ends after its max_rows-th wanted position
        w0 + max_rows.max(1)
    } else {
        limit
    }
}

/// One sequence through a [`BatchExecutor`]: the [`Executor`] the CLI, bench, perplexity and
/// drafts use, on every backend. Its cache holds one sequence (slot 0), whole or with
/// window rings ([`KvCache::with_window_ring`]); passes take up to `max_tokens` positions, of
/// which up to `max_rows` get logits.
pub struct OneSequence {
    exec: Box<dyn BatchExecutor>,
    kv: KvCache,
    batch: Batch,
    max_tokens: usize,
    max_rows: usize,
    /// The logits row of the last position reported.
    last: usize,
}

impl OneSequence {
    /// Wraps `exec` over `kv` (one sequence) for passes of up to `max_tokens` positions (no
    /// more than a window ring's slack) and `max_rows` logit rows (no more than the
    /// executor's buffers hold).
    pub fn new(
        exec: Box<dyn BatchExecutor>,
        kv: KvCache,
        max_tokens: usize,
        max_rows: usize,
    ) -> OneSequence {
        let max_tokens = max_tokens.min(kv.ring_slack().unwrap_or(usize::MAX)).max(1);
        OneSequence {
            exec,
            kv,
            batch: Batch::with_capacity(max_tokens),
            max_tokens,
            max_rows: max_rows.clamp(1, max_tokens),
            last: 0,
        }
    }

    /// The CPU's: `model` with buffers for passes of up to `batch` tokens, `outputs` of
    /// them with logits, and a KV cache of the plan's type for the model's context.
    pub fn cpu(model: Model, plan: &Plan, batch: usize, outputs: usize) -> OneSequence {
        let c = &model.config;
        let windows: Vec<Option<usize>> = (0..c.n_layers).map(|l| c.window(l)).collect();
        let kv = KvCache::with_window_ring(
            plan.kv_dtype,
            1,
            model.ctx(),
            c.kv_dim(),
            &windows,
            batch.max(1),
        );
        let ctx = model.ctx();
        let exec = CpuBatchExecutor::new(model, batch, outputs, ctx);
        OneSequence::new(Box::new(exec), kv, batch, outputs)
    }

    /// The KV cache.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }
}

impl Executor for OneSequence {
    fn backend(&self) -> &'static str {
        self.exec.backend().as_str()
    }

    fn can_truncate(&self, len: usize, keep: usize) -> bool {
        self.kv.can_truncate(len, keep)
    }

    fn config(&self) -> &Config {
        self.exec.config()
    }

    fn eval(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        want: Range<usize>,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        let end = pos0 + tokens.len();
        let mut pos = pos0;
        while pos < end {
            let stop = pass_end(pos, end, &want, self.max_tokens, self.max_rows);
            self.batch.clear();
            for p in pos..stop {
                self.batch.push(tokens[p - pos0], p, 0, want.contains(&p));
            }
            let n = self.exec.forward(&mut self.kv, &self.batch)?;
            let wanted = (pos..stop).filter(|p| want.contains(p));
            for (j, p) in wanted.enumerate() {
                on_logits(p, self.exec.logits(j));
            }
            if n > 0 {
                self.last = n - 1;
            }
            pos = stop;
        }
        Ok(())
    }

    fn last_logits_mut(&mut self) -> &mut [f32] {
        self.exec.logits_mut(self.last)
    }

    fn io_stats(&self) -> IoStats {
        self.exec.io_stats()
    }

    fn verify_stats(&self) -> gds_io::VerifyStats {
        self.exec.verify_stats()
    }

    fn eval_exit(&mut self, token: u32, pos: usize, blocks: usize) -> Result<()> {
        self.batch.clear();
        self.batch.push(token, pos, 0, true);
        self.exec.forward_exit(&mut self.kv, &self.batch, blocks)?;
        self.last = 0;
        Ok(())
    }
}

/// Opens the plan's backend for one sequence, for passes of up to `batch` tokens of which
/// up to `outputs` may return logits (the GPU takes its own pass size: see
/// `crate::exec::gpu::open_one`).
pub fn open(plan: &Plan, batch: usize, outputs: usize) -> Result<Box<dyn Executor>> {
    match plan.backend {
        Backend::Cpu => Ok(Box::new(OneSequence::cpu(
            Model::open(plan)?,
            plan,
            batch,
            outputs,
        ))),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Ok(Box::new(crate::exec::gpu::open_one(plan, outputs)?)),
        #[cfg(not(feature = "cuda"))]
        other => Err(RuntimeError::Internal(format!(
            "backend {other} is not available in this build"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::pass_end;

    /// The passes `pass_end` cuts: `(start, len, wanted positions in it)`.
    fn passes(
        pos0: usize,
        n: usize,
        want: std::ops::Range<usize>,
        max: usize,
        rows: usize,
    ) -> Vec<(usize, usize, usize)> {
        let (mut pos, end, mut out) = (pos0, pos0 + n, Vec::new());
        while pos < end {
            let stop = pass_end(pos, end, &want, max, rows);
            assert!(stop > pos && stop <= end, "{pos}..{stop} of ..{end}");
            out.push((
                pos,
                stop - pos,
                (pos..stop).filter(|p| want.contains(p)).count(),
            ));
            pos = stop;
        }
        out
    }

    #[test]
    fn passes_cover_every_token_once_within_the_pass_and_logit_limits() {
        for (pos0, n, want, max, rows) in [
            (0, 10, 9..10, 4, 1),
            (0, 10, 3..7, 4, 1),
            (0, 10, 3..7, 4, 16),
            (5, 20, 0..100, 8, 3),
            (0, 600, 512..599, 512, 16),
            (0, 512, 256..511, 512, 512),
            (3, 7, 50..60, 2, 2),
            (0, 1, 0..1, 512, 16),
            (10, 11, 10..21, 512, 16),
            (0, 40, 5..5, 8, 4),
            (0, 40, 0..40, 8, 0),
        ] {
            let p = passes(pos0, n, want.clone(), max, rows);
            assert!(
                p.iter()
                    .all(|&(_, len, r)| len >= 1 && len <= max && r <= rows.max(1)),
                "{p:?}"
            );
            // a pass is cut short only where its logit rows are used up
            for w in p.windows(2) {
                let (_, len, r) = w[0];
                assert!(len == max || r == rows.max(1), "{p:?}");
            }
        }
        // passes of the whole size, the last one shorter
        assert_eq!(
            passes(0, 10, 9..10, 4, 1),
            vec![(0, 4, 0), (4, 4, 0), (8, 2, 1)]
        );
        // a speculative pass: the sampled token and its guesses, all in one
        assert_eq!(passes(10, 11, 10..21, 512, 16), vec![(10, 11, 11)]);
        // perplexity's chunk: one pass, logits for its second half, the last token in it too
        assert_eq!(passes(0, 512, 256..511, 512, 512), vec![(0, 512, 255)]);
        // wanted positions past the logit rows start the next pass
        assert_eq!(passes(0, 10, 3..7, 8, 2), vec![(0, 5, 2), (5, 5, 2)]);
    }
}
