//! `gdsrun imatrix`: an importance matrix computed as llama.cpp's `llama-imatrix` does
//! (gds_runtime::imatrix), written in its GGUF format for `gdsconv convert --imatrix` and
//! `llama-quantize --imatrix`.

use crate::cli::ImatrixArgs;
use crate::out::{err, errln, outln};
use crate::run::common_options;
use anyhow::Result;
use gds_convert::imatrix::{write_gguf_to, ImatrixMeta, ImatrixSums};
use gds_runtime::imatrix::{compute, n_chunks};
use gds_runtime::{Model, Plan, PlanOptions, RuntimeError, TextTokenizer};
use std::collections::BTreeMap;
use std::time::Instant;

/// Runs the command.
pub fn run(a: ImatrixArgs) -> Result<()> {
    if let Some(b) = a.common.backend.as_deref() {
        if b != "cpu" && b != "auto" {
            return Err(RuntimeError::Usage(format!(
                "imatrix runs on the CPU backend only (--backend {b})"
            ))
            .into());
        }
    }
    // products of fewer tokens are not counted (llama-imatrix's rule): a shorter chunk
    // would run every chunk and count nothing
    let min = gds_runtime::imatrix::MIN_TOKENS;
    if a.ctx < min {
        return Err(RuntimeError::Usage(format!(
            "--ctx {} must be at least {min} (imatrix counts no matrix product of fewer tokens, as llama-imatrix)",
            a.ctx
        ))
        .into());
    }
    if a.chunks == Some(0) {
        return Err(RuntimeError::Usage("--chunks must be at least 1".into()).into());
    }
    // each chunk is one pass of --ctx tokens: a --batch would be ignored
    if let Some(b) = a.common.batch {
        return Err(RuntimeError::Usage(format!(
            "--batch {b}: imatrix evaluates each chunk in one pass of --ctx tokens; leave --batch out"
        ))
        .into());
    }
    let plan = Plan::build(&PlanOptions {
        ctx: Some(a.ctx),
        raw: true,
        backend: Some("cpu".into()),
        // one pass per chunk
        batch: Some(a.ctx),
        ..common_options(&a.common)
    })?;
    crate::run::warn_cuda_only(&a.common, &plan);
    let text =
        gds_runtime::plan::read_user_file(&a.file).map_err(|e| RuntimeError::file(&a.file, e))?;
    // an unwritable -o fails now (exit 2), not after the computation; a kill leaves the
    // output as it was
    let (out, out_file) =
        crate::staged::create(&a.output, "-o", "the importance matrix", &plan.model_dir)?;
    let t0 = Instant::now();
    let model = Model::open(&plan)?;
    let tok = TextTokenizer::load_for_model(&plan.model_dir, &model.config)?;
    let tokens = tok.encode(&text, true, false)?;
    let chunks = n_chunks(tokens.len(), a.ctx, a.chunks).map_err(|e| match e {
        RuntimeError::Perplexity(m) => {
            RuntimeError::Perplexity(format!("{}: {m}", a.file.display()))
        }
        e => e,
    })?;
    let bos = tok.bos().filter(|_| tok.add_bos());
    if !a.json {
        errln!(
            "imatrix: {} tokens, {chunks} chunks of {}, {} threads",
            tokens.len(),
            a.ctx,
            plan.threads
        );
    }
    let json = a.json;
    let col = compute(
        &model,
        &tokens,
        a.ctx,
        chunks,
        bos,
        plan.kv_dtype,
        a.process_output,
        &mut |i| {
            if !json {
                err!("[{}]", i + 1);
            }
        },
    )?;
    let entries: BTreeMap<String, ImatrixSums> = col
        .stats
        .into_iter()
        .map(|(k, v)| {
            let s = ImatrixSums {
                in_sum2: v.sum2.iter().map(|&x| x as f32).collect(),
                counts: v.counts,
            };
            (k, s)
        })
        .collect();
    // llama-imatrix stops on non-finite sums; a file with them would be refused by the reader
    if let Some((name, _)) = entries
        .iter()
        .find(|(_, e)| e.in_sum2.iter().any(|v| !v.is_finite()))
    {
        return Err(RuntimeError::Internal(format!(
            "imatrix: the activations entering {name} are not finite (NaN or overflow); nothing written"
        ))
        .into());
    }
    if entries.is_empty() {
        return Err(RuntimeError::Usage(format!(
            "imatrix: no matrix product counted (--ctx {} under {} tokens per pass?)",
            a.ctx,
            gds_runtime::imatrix::MIN_TOKENS
        ))
        .into());
    }
    let meta = ImatrixMeta {
        datasets: vec![a.file.display().to_string()],
        chunk_count: chunks as u32,
        chunk_size: a.ctx as u32,
    };
    write_gguf_to(out, out_file, &entries, &meta).map_err(|e| crate::staged::error("-o", e))?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let j = serde_json::json!({
            "output": a.output, "entries": entries.len(), "chunks": chunks, "ctx": a.ctx,
            "tokens": tokens.len(), "seconds": secs, "model": plan.model_dir, "file": a.file,
        });
        outln!("{j}")?;
    } else {
        errln!();
        outln!(
            "Wrote {} ({} matrices, {chunks} chunks of {}, {secs:.1} s)",
            a.output.display(),
            entries.len(),
            a.ctx
        )?;
    }
    Ok(())
}
