//! `gdsrun perplexity`: llama-perplexity's algorithm over a text file, and its
//! `--kl-divergence-base` / `--kl-divergence` comparison of a model with a base model's
//! stored log-probabilities (`--save-logits` / `--kl-divergence`).

use crate::cli::PerplexityArgs;
use crate::out::{err, errln, outln};
use crate::run::common_options;
use anyhow::Result;
use gds_runtime::kld::{KlSummary, LogitsHeader, LogitsReader, LogitsWriter};
use gds_runtime::perplexity::{perplexity, ChunkPlan, PerplexityOptions, Scored};
use gds_runtime::{Plan, PlanOptions, RuntimeError, TextTokenizer};
use std::io::{BufReader, BufWriter};
use std::path::Path;
use std::time::Instant;

/// Runs the command.
pub fn run(a: PerplexityArgs) -> Result<()> {
    let plan = Plan::build(&PlanOptions {
        ctx: Some(a.ctx),
        raw: true,
        ..common_options(&a.common)
    })?;
    crate::run::warn_cuda_only(&a.common, &plan);
    let text =
        gds_runtime::plan::read_user_file(&a.file).map_err(|e| RuntimeError::file(&a.file, e))?;
    let t0 = Instant::now();
    // Every scored position wants logits: passes of up to 512 tokens, all of them outputs.
    let batch = plan.batch.max(plan.ctx.min(512));
    let mut exec = gds_runtime::exec::open(&plan, batch, batch)?;
    let tok = TextTokenizer::load_for_model(&plan.model_dir, exec.config())?;
    let tokens = tok.encode(&text, true, false)?;
    let opts = PerplexityOptions {
        ctx: plan.ctx,
        bos: tok.bos().filter(|_| tok.add_bos()),
        max_chunks: a.chunks.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
    };
    let chunks = ChunkPlan::new(tokens.len(), plan.ctx)
        .map_err(|e| match e {
            RuntimeError::Perplexity(m) => {
                RuntimeError::Perplexity(format!("{}: {m}", a.file.display()))
            }
            e => e,
        })?
        .limited(opts.max_chunks);
    let n_vocab = exec.config().vocab_size;
    // --save-logits: a writer on a temporary file; --kl-divergence: a reader of the base's
    let mut save = match &a.save_logits {
        Some(dest) => {
            let (tmp, f) =
                crate::staged::create(dest, "--save-logits", "the logits", &plan.model_dir)?;
            let header = LogitsHeader {
                n_vocab,
                chunks,
                tokens: tokens.clone(),
            };
            let w = LogitsWriter::new(
                BufWriter::with_capacity(1 << 20, f),
                header,
                &dest.display().to_string(),
            )?;
            Some((tmp, w))
        }
        None => None,
    };
    let mut kl = match &a.kl_divergence {
        Some(path) => {
            let name = path.display().to_string();
            let f =
                gds_runtime::plan::open_user_file(path).map_err(|e| RuntimeError::file(path, e))?;
            let len = f.metadata().map_err(|e| RuntimeError::file(path, e))?.len();
            let r = LogitsReader::new(BufReader::with_capacity(1 << 20, f), len, &name)?;
            r.header().check(n_vocab, &chunks, &tokens, &name)?;
            Some(r)
        }
        None => None,
    };
    if !a.json {
        errln!(
            "perplexity: {} tokens, ctx {}, backend {}, {} threads",
            tokens.len(),
            plan.ctx,
            exec.backend(),
            plan.threads
        );
    }
    let json = a.json;
    let r = perplexity(
        &mut *exec,
        &tokens,
        opts,
        &mut |i, ppl| {
            if !json {
                err!("[{}]{ppl:.4},", i + 1);
            }
        },
        &mut |s: Scored<'_>| {
            if let Some((_, w)) = &mut save {
                w.push(s.logits, s.target)?;
            }
            if let Some(r) = &mut kl {
                r.push(s.logits)?;
            }
            Ok(())
        },
    )?;
    if let Some((tmp, w)) = save {
        let f = w.finish()?.into_inner().map_err(|e| {
            RuntimeError::file(
                a.save_logits.as_deref().unwrap_or(Path::new("")),
                e.into_error(),
            )
        })?;
        tmp.commit(f)
            .map_err(|e| crate::staged::error("--save-logits", e))?;
    }
    let kl: Option<KlSummary> = kl.map(|k| k.finish(r.ppl)).transpose()?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut j = serde_json::json!({
            "ppl": r.ppl, "ppl_stderr": r.ppl_stderr, "tokens": r.tokens, "scored": r.scored, "chunks": r.chunks.n_chunks,
            "ctx": plan.ctx, "running": r.running, "seconds": secs, "model": plan.model_dir, "file": a.file,
        });
        if let Some(p) = &a.save_logits {
            j["saved_logits"] = serde_json::json!(p);
        }
        if let Some(k) = &kl {
            let mut o = serde_json::to_value(k)?;
            o["file"] = serde_json::json!(a.kl_divergence);
            j["kl"] = o;
        }
        outln!("{j}")?;
    } else {
        errln!();
        outln!("Final estimate: PPL = {:.4} +/- {:.5} ({} chunks of {}, {} tokens scored, {secs:.1} s)", r.ppl, r.ppl_stderr, r.chunks.n_chunks, plan.ctx, r.scored)?;
        if let Some(p) = &a.save_logits {
            outln!(
                "Saved the log-probabilities of {} positions to {}",
                r.scored,
                p.display()
            )?;
        }
        if let (Some(k), Some(p)) = (&kl, &a.kl_divergence) {
            outln!(
                "KL divergence from {} ({} positions):",
                p.display(),
                k.positions
            )?;
            outln!(
                "  PPL(base) = {:.4}, PPL/PPL(base) = {:.6}",
                k.base_ppl,
                k.ppl_ratio
            )?;
            outln!(
                "  mean KLD = {:.6} +/- {:.6}, median {:.6}, p99 {:.6}, max {:.6}",
                k.mean,
                k.mean_stderr,
                k.median,
                k.p99,
                k.max
            )?;
            outln!(
                "  same top-1 = {:.3} +/- {:.3} %",
                k.top1_percent,
                k.top1_percent_stderr
            )?;
        }
    }
    Ok(())
}
