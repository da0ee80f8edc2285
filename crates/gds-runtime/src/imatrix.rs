//! Importance matrices as llama.cpp's `llama-imatrix` computes them (tools/imatrix/imatrix.cpp):
//! tokenize the whole text (with BOS when the model adds one), cut it into
//! `min(--chunks, n_tokens / ctx)` non-overlapping chunks of `ctx` tokens (at least `2 * ctx`
//! tokens), replace each chunk's first token by BOS (when the model adds one), evaluate every
//! chunk from position 0 in one pass, and for every block matrix product (attention q/k/v/o,
//! FFN gate/up/down) add, per input column, the square of the f32 activation entering the
//! product over every token, and count the tokens. Products of fewer than 16 tokens are not
//! counted (llama-imatrix's rule; a chunk is one pass of `ctx` tokens, so this only matters
//! for `ctx < 16`). The output head is counted only when asked (llama-imatrix's
//! `--process-output`; not by default): every token of a chunk then wants logits, and the
//! final-normed hidden state entering the head is summed under `output.weight`, or
//! `token_embd.weight` when the embedding is the head (tied), as llama-imatrix names it.
//! A mixture of experts (qwen3moe): the router's input is counted as a plain product
//! (`ffn_gate_inp`), and each stacked expert matrix (`ffn_gate_exps`, `ffn_up_exps`,
//! `ffn_down_exps`) keeps one row of sums and one count per expert, over the tokens routed to
//! that expert, however few (llama-imatrix's `MUL_MAT_ID` rule).
//!
//! The hook is [`MatmulObserver`], which [`Model::forward_observed`] shows every product's
//! input; the plain forward pass has none.

use crate::batch::Batch;
use crate::error::{Result, RuntimeError};
use crate::kv::KvCache;
use crate::model::{MatmulObserver, Model, RunState};
use std::collections::BTreeMap;

/// Products of fewer tokens than this are not counted (llama-imatrix's rule).
pub const MIN_TOKENS: usize = 16;

/// One matrix's statistics: per input column the sum of squared activations, and the number
/// of tokens (activation rows) summed; a mixture of experts' stacked matrix has one of each
/// per expert, expert after expert.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImatrixStat {
    /// Per column, Σ x² (`cols × counts.len()`).
    pub sum2: Vec<f64>,
    /// Tokens summed, per expert (one entry for a dense matrix).
    pub counts: Vec<u64>,
}

/// Accumulates [`ImatrixStat`]s by GGUF tensor name (`blk.3.attn_q.weight`).
#[derive(Clone, Debug, Default)]
pub struct ImatrixCollector {
    /// Statistics by tensor name.
    pub stats: BTreeMap<String, ImatrixStat>,
}

impl ImatrixCollector {
    /// Adds `n` rows of `x` to the statistics of `name`.
    fn add(&mut self, name: String, x: &[f32], n: usize) {
        if n < MIN_TOKENS || !x.len().is_multiple_of(n) {
            return;
        }
        self.add_rows(name, 0, 1, x, n);
    }

    /// Adds `n` rows of `x` to expert `expert` of `n_mat` of the statistics of `name`.
    fn add_rows(&mut self, name: String, expert: usize, n_mat: usize, x: &[f32], n: usize) {
        if n == 0 || !x.len().is_multiple_of(n) || expert >= n_mat {
            return;
        }
        let cols = x.len() / n;
        let e = self.stats.entry(name).or_default();
        if e.sum2.len() != cols * n_mat || e.counts.len() != n_mat {
            // a matrix seen with another width cannot happen in one model: start over
            *e = ImatrixStat {
                sum2: vec![0.0; cols * n_mat],
                counts: vec![0; n_mat],
            };
        }
        let sums = &mut e.sum2[expert * cols..(expert + 1) * cols];
        for row in x.chunks_exact(cols) {
            for (a, &v) in sums.iter_mut().zip(row) {
                *a += (v as f64) * (v as f64);
            }
        }
        e.counts[expert] += n as u64;
    }
}

impl MatmulObserver for ImatrixCollector {
    fn matmul(&mut self, layer: usize, role: &str, x: &[f32], n: usize) {
        self.add(format!("blk.{layer}.{role}.weight"), x, n);
    }

    fn head(&mut self, tensor: &str, x: &[f32], n: usize) {
        self.add(tensor.to_string(), x, n);
    }

    /// An expert's products count every token routed to it, however few (llama-imatrix
    /// collects every `MUL_MAT_ID`, its 16-token floor is for plain products).
    fn expert(
        &mut self,
        layer: usize,
        role: &str,
        expert: usize,
        n_experts: usize,
        x: &[f32],
        n: usize,
    ) {
        self.add_rows(
            format!("blk.{layer}.{role}.weight"),
            expert,
            n_experts,
            x,
            n,
        );
    }
}

/// The chunks llama-imatrix evaluates: `min(max_chunks, n_tokens / ctx)` (all of them when
/// `max_chunks` is `None`); fewer than `2 * ctx` tokens is an error, as there.
pub fn n_chunks(n_tokens: usize, ctx: usize, max_chunks: Option<usize>) -> Result<usize> {
    if ctx == 0 {
        return Err(RuntimeError::Usage(
            "imatrix: --ctx must be at least 1".into(),
        ));
    }
    if n_tokens < 2 * ctx {
        return Err(RuntimeError::Perplexity(format!(
            "the text tokenizes to {n_tokens} tokens; an importance matrix with --ctx {ctx} needs at least {}",
            2 * ctx
        )));
    }
    let all = n_tokens / ctx;
    Ok(max_chunks.map_or(all, |m| m.min(all)))
}

/// Runs `n_chunks` chunks of `ctx` tokens of `tokens` (BOS included when the model adds
/// one) through `model`, each from position 0 in one pass, with `bos` replacing each chunk's
/// first token; `on_chunk` is told after each chunk. The model's context must hold `ctx`.
/// With `process_output` (llama-imatrix's `--process-output`) every token's logits are
/// computed and the output head's input is counted too.
#[allow(clippy::too_many_arguments)]
pub fn compute(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    n_chunks: usize,
    bos: Option<u32>,
    kv_dtype: crate::kv::KvDtype,
    process_output: bool,
    on_chunk: &mut dyn FnMut(usize),
) -> Result<ImatrixCollector> {
    if ctx > model.ctx() || n_chunks * ctx > tokens.len() {
        return Err(RuntimeError::Internal(format!(
            "imatrix: {n_chunks} chunks of {ctx} tokens over {} tokens, model context {}",
            tokens.len(),
            model.ctx()
        )));
    }
    let c = &model.config;
    let windows: Vec<Option<usize>> = (0..c.n_layers).map(|l| c.window(l)).collect();
    let mut kv = KvCache::with_window_ring(kv_dtype, 1, ctx, c.kv_dim(), &windows, ctx);
    let outputs = if process_output { ctx } else { 1 };
    let mut state = RunState::new(c, ctx, outputs, ctx, model.threads());
    let mut batch = Batch::with_capacity(ctx);
    let mut col = ImatrixCollector::default();
    for i in 0..n_chunks {
        batch.clear();
        for (p, &t) in tokens[i * ctx..(i + 1) * ctx].iter().enumerate() {
            let t = match (p, bos) {
                (0, Some(b)) => b,
                _ => t,
            };
            // without process_output no logits are needed: the output head is skipped
            batch.push(t, p, 0, process_output);
        }
        model.forward_observed(&mut state, &mut kv, &batch, &mut col)?;
        on_chunk(i);
    }
    Ok(col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collector_sums_squares_per_column_and_counts_tokens() {
        let mut c = ImatrixCollector::default();
        let x: Vec<f32> = (0..16 * 3).map(|i| (i % 3) as f32 + 1.0).collect();
        c.matmul(2, "attn_q", &x, 16);
        c.matmul(2, "attn_q", &x, 16);
        // under 16 tokens: not counted
        c.matmul(2, "attn_q", &x[..15 * 3], 15);
        let s = &c.stats["blk.2.attn_q.weight"];
        assert_eq!(s.sum2, vec![32.0, 128.0, 288.0]);
        assert_eq!(s.counts, vec![32]);
        assert_eq!(c.stats.len(), 1);
        // the head's input goes under the name it is given
        c.head("output.weight", &x, 16);
        assert_eq!(c.stats["output.weight"].sum2, vec![16.0, 64.0, 144.0]);
        assert_eq!(c.stats["output.weight"].counts, vec![16]);
        // an expert's rows go to its own sums and count, any number of them
        c.expert(1, "ffn_up_exps", 2, 4, &x[..2 * 3], 2);
        c.expert(1, "ffn_up_exps", 0, 4, &x[..3], 1);
        let s = &c.stats["blk.1.ffn_up_exps.weight"];
        assert_eq!(s.counts, vec![1, 0, 2, 0]);
        assert_eq!(&s.sum2[..3], &[1.0, 4.0, 9.0]);
        assert_eq!(&s.sum2[3..6], &[0.0; 3]);
        assert_eq!(&s.sum2[6..9], &[2.0, 8.0, 18.0]);
    }

    #[test]
    fn chunks_as_llama_imatrix() {
        assert_eq!(n_chunks(1000, 128, None).unwrap(), 7);
        assert_eq!(n_chunks(1000, 128, Some(3)).unwrap(), 3);
        assert_eq!(n_chunks(1000, 128, Some(30)).unwrap(), 7);
        let e = n_chunks(255, 128, None).unwrap_err().to_string();
        assert!(e.contains("at least 256"), "{e}");
        assert!(n_chunks(256, 128, None).is_ok());
        assert!(n_chunks(10, 0, None).is_err());
    }
}
