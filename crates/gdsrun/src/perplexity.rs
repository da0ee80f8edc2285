//! `gdsrun perplexity`: llama-perplexity's algorithm over a text file.

use crate::cli::PerplexityArgs;
use crate::out::{err, errln, outln};
use crate::run::common_options;
use anyhow::Result;
use gds_runtime::perplexity::{perplexity, PerplexityOptions};
use gds_runtime::{Plan, PlanOptions, RuntimeError, TextTokenizer};
use std::time::Instant;

/// Runs the command.
pub fn run(a: PerplexityArgs) -> Result<()> {
    let plan = Plan::build(&PlanOptions {
        ctx: Some(a.ctx),
        raw: true,
        ..common_options(&a.common)
    })?;
    let text = std::fs::read_to_string(&a.file).map_err(|e| RuntimeError::file(&a.file, e))?;
    let t0 = Instant::now();
    // Every scored position wants logits: passes of up to 512 tokens, all of them outputs.
    let batch = plan.batch.max(plan.ctx.min(512));
    let mut exec = gds_runtime::exec::open(&plan, batch, batch)?;
    let tok = TextTokenizer::load_for_model(&plan.model_dir, exec.config())?;
    let tokens = tok.encode(&text, true, false)?;
    let opts = PerplexityOptions {
        ctx: plan.ctx,
        bos: tok.bos().filter(|_| tok.add_bos()),
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
    let r = perplexity(&mut *exec, &tokens, opts, &mut |i, ppl| {
        if !json {
            err!("[{}]{ppl:.4},", i + 1);
        }
    })
    .map_err(|e| match e {
        RuntimeError::Perplexity(m) => {
            RuntimeError::Perplexity(format!("{}: {m}", a.file.display()))
        }
        e => e,
    })?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        outln!(
            "{}",
            serde_json::json!({
                "ppl": r.ppl, "ppl_stderr": r.ppl_stderr, "tokens": r.tokens, "scored": r.scored, "chunks": r.chunks.n_chunks,
                "ctx": plan.ctx, "running": r.running, "seconds": secs, "model": plan.model_dir, "file": a.file,
            })
        )?;
    } else {
        errln!();
        outln!("Final estimate: PPL = {:.4} +/- {:.5} ({} chunks of {}, {} tokens scored, {secs:.1} s)", r.ppl, r.ppl_stderr, r.chunks.n_chunks, plan.ctx, r.scored)?;
    }
    Ok(())
}
