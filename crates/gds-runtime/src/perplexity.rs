//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it: tokenize the whole
//! text (with BOS when the model adds one), cut it into `n_chunk = n_tokens / ctx`
//! non-overlapping chunks of `ctx` tokens, replace each chunk's first token by BOS (when
//! the model adds one), evaluate every chunk from an empty cache, and score only the second
//! half: the logits at positions `ctx/2 .. ctx-2` predicting the next token.
//! PPL = exp(mean negative log-likelihood).

use crate::error::{Result, RuntimeError};
use crate::exec::Executor;
use serde::Serialize;

/// How a token stream is cut into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ChunkPlan {
    /// Tokens per chunk (the context).
    pub ctx: usize,
    /// Number of chunks evaluated.
    pub n_chunks: usize,
    /// First scored position of a chunk (`ctx / 2`).
    pub first: usize,
    /// Tokens scored per chunk (`ctx - first - 1`).
    pub scored_per_chunk: usize,
}

impl ChunkPlan {
    /// The plan for `n_tokens` tokens with context `ctx`; llama.cpp refuses fewer than
    /// `2 * ctx` tokens, and so does this.
    pub fn new(n_tokens: usize, ctx: usize) -> Result<ChunkPlan> {
        if ctx < 4 {
            return Err(RuntimeError::Perplexity(format!(
                "--ctx {ctx} is too small for perplexity (at least 4)"
            )));
        }
        if n_tokens < 2 * ctx {
            return Err(RuntimeError::Perplexity(format!("the text tokenizes to {n_tokens} tokens; perplexity with --ctx {ctx} needs at least {}", 2 * ctx)));
        }
        let first = ctx / 2;
        Ok(ChunkPlan {
            ctx,
            n_chunks: n_tokens / ctx,
            first,
            scored_per_chunk: ctx - first - 1,
        })
    }

    /// The first `max` chunks only (llama-perplexity's `--chunks N`); `None` keeps all.
    pub fn limited(self, max: Option<usize>) -> ChunkPlan {
        ChunkPlan {
            n_chunks: max.map_or(self.n_chunks, |m| m.clamp(1, self.n_chunks)),
            ..self
        }
    }

    /// Total scored tokens.
    pub fn scored(&self) -> usize {
        self.n_chunks * self.scored_per_chunk
    }
}

/// Result of a perplexity run.
#[derive(Clone, Debug, Serialize)]
pub struct PerplexityResult {
    /// Final perplexity.
    pub ppl: f64,
    /// Tokens in the tokenized text.
    pub tokens: usize,
    /// Tokens scored.
    pub scored: usize,
    /// Chunk geometry.
    pub chunks: ChunkPlan,
    /// Running perplexity after each chunk (what llama.cpp prints as `[i]ppl`).
    pub running: Vec<f64>,
    /// Standard error of the perplexity estimate (llama.cpp's `+/-`).
    pub ppl_stderr: f64,
}

/// `log(sum(exp(x)))`, stable.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln()
}

/// Settings of a perplexity run.
#[derive(Clone, Copy, Debug)]
pub struct PerplexityOptions {
    /// Tokens per chunk.
    pub ctx: usize,
    /// Replaces each chunk's first token (llama.cpp does this when the model adds BOS).
    pub bos: Option<u32>,
    /// Evaluates at most this many chunks (llama-perplexity's `--chunks N`).
    pub max_chunks: Option<usize>,
}

/// One scored position, as [`perplexity`] hands it to its observer.
#[derive(Clone, Copy, Debug)]
pub struct Scored<'a> {
    /// Chunk index.
    pub chunk: usize,
    /// Position within the chunk (`first .. ctx - 1`).
    pub pos: usize,
    /// The token this position predicts.
    pub target: u32,
    /// The logits at this position.
    pub logits: &'a [f32],
}

/// Runs llama-perplexity's algorithm over `tokens` (already tokenized, BOS included when
/// the model adds one) on the executor, whose context must hold `opts.ctx` positions.
/// `on_chunk` receives (chunk index, running ppl); `on_position` sees every scored
/// position's logits in order (`--save-logits`, `--kl-divergence`), and its first error
/// ends the run.
pub fn perplexity(
    ex: &mut dyn Executor,
    tokens: &[u32],
    opts: PerplexityOptions,
    on_chunk: &mut dyn FnMut(usize, f64),
    on_position: &mut dyn FnMut(Scored<'_>) -> Result<()>,
) -> Result<PerplexityResult> {
    let PerplexityOptions {
        ctx,
        bos,
        max_chunks,
    } = opts;
    let plan = ChunkPlan::new(tokens.len(), ctx)?.limited(max_chunks);
    let mut failed: Option<RuntimeError> = None;
    let (mut nll, mut nll2, mut count) = (0.0f64, 0.0f64, 0usize);
    let mut running = Vec::with_capacity(plan.n_chunks);
    let mut chunk_tokens = vec![0u32; ctx];
    for i in 0..plan.n_chunks {
        chunk_tokens.copy_from_slice(&tokens[i * ctx..(i + 1) * ctx]);
        if let Some(b) = bos {
            chunk_tokens[0] = b;
        }
        // the original tokens are the targets (the BOS replacement only affects the input)
        let targets = &tokens[i * ctx..(i + 1) * ctx];
        ex.eval(&chunk_tokens, 0, plan.first..ctx - 1, &mut |pos, logits| {
            let target = targets[pos + 1] as usize;
            let v = log_sum_exp(logits) - logits[target] as f64;
            nll += v;
            nll2 += v * v;
            if failed.is_none() {
                let s = Scored {
                    chunk: i,
                    pos,
                    target: target as u32,
                    logits,
                };
                failed = on_position(s).err();
            }
        })?;
        if let Some(e) = failed.take() {
            return Err(e);
        }
        count += plan.scored_per_chunk;
        running.push((nll / count as f64).exp());
        on_chunk(i, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let ppl_stderr = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(PerplexityResult {
        ppl,
        tokens: tokens.len(),
        scored: plan.scored(),
        chunks: plan,
        running,
        ppl_stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_matches_llama_perplexity() {
        // 1000 tokens, ctx 128: 7 chunks; positions 64..126 scored, 63 per chunk
        let p = ChunkPlan::new(1000, 128).unwrap();
        assert_eq!(
            p,
            ChunkPlan {
                ctx: 128,
                n_chunks: 7,
                first: 64,
                scored_per_chunk: 63
            }
        );
        assert_eq!(p.scored(), 441);
        // odd context: first = ctx/2 rounded down
        let p = ChunkPlan::new(22, 11).unwrap();
        assert_eq!((p.n_chunks, p.first, p.scored_per_chunk), (2, 5, 5));
        assert!(ChunkPlan::new(255, 128)
            .unwrap_err()
            .to_string()
            .contains("at least 256"));
        assert!(ChunkPlan::new(256, 128).is_ok());
        // --chunks: at most N, at least one, never more than the text has
        let p = ChunkPlan::new(1000, 128).unwrap();
        assert_eq!(p.limited(Some(3)).n_chunks, 3);
        assert_eq!(p.limited(Some(3)).scored(), 3 * 63);
        assert_eq!(p.limited(Some(0)).n_chunks, 1);
        assert_eq!(p.limited(Some(99)).n_chunks, 7);
        assert_eq!(p.limited(None), p);
    }

    #[test]
    fn log_sum_exp_is_stable() {
        assert!((log_sum_exp(&[0.0, 0.0]) - 2f64.ln()).abs() < 1e-12);
        assert!((log_sum_exp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-9);
    }
}
