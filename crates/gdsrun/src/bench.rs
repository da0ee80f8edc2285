//! `gdsrun bench`: llama-bench's pp (prompt processing) and tg (text generation) tests, at
//! depths (`-d`: that many tokens already in the KV cache), each flag a comma list.

use crate::cli::BenchArgs;
use crate::out::outln;
use crate::run::common_options;
use anyhow::Result;
use gds_runtime::exec::{eval_last, Executor};
use gds_runtime::sampler::Rng;
use gds_runtime::{Plan, PlanOptions, RuntimeError};
use serde::Serialize;
use std::time::Instant;

/// Most repetitions of a test (`-r`): every one is timed and kept, and more than this is a
/// typo, not a benchmark.
const MAX_REPETITIONS: usize = 10_000;

/// One test's result, with llama-bench's field names.
#[derive(Serialize, Debug)]
struct BenchResult {
    model: String,
    model_filename: String,
    n_threads: usize,
    n_batch: usize,
    type_k: String,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    avg_ns: u64,
    stddev_ns: u64,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ns: Vec<u64>,
    samples_ts: Vec<f64>,
    /// GdsLLM additions: the compute backend, the I/O mode, the weight bytes held in memory,
    /// and what the timed repetitions read from disk.
    backend: String,
    io: String,
    weights_held_bytes: u64,
    bytes_read_per_token: f64,
    read_bandwidth_bytes_per_sec: Option<f64>,
    io_wait_ms: f64,
    /// Share of the experts used that the expert cache held (a mixture of experts whose
    /// experts stream apart; absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    expert_cache_hit_rate: Option<f64>,
}

fn mean_std(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = if x.len() > 1 {
        x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Evaluates `n` random tokens from position `pos0` (pp: one `eval`, split into passes of
/// the plan's batch by the executor; also the untimed fill of a depth).
fn prompt_pass(ex: &mut dyn Executor, rng: &mut Rng, n: usize, pos0: usize) -> Result<()> {
    let vocab = ex.config().vocab_size as u64;
    let tokens: Vec<u32> = (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect();
    eval_last(ex, &tokens, pos0)?;
    Ok(())
}

/// Evaluates `n` random tokens one at a time from position `pos0` (tg).
fn gen_pass(ex: &mut dyn Executor, rng: &mut Rng, n: usize, pos0: usize) -> Result<()> {
    let vocab = ex.config().vocab_size as u64;
    for pos in pos0..pos0 + n {
        eval_last(ex, &[(rng.next_u64() % vocab) as u32], pos)?;
    }
    Ok(())
}

/// A plan error about the context (bench has no `--ctx`: its context is the longest test's
/// depth + prompt + generated tokens) named by the flags that made it.
fn ctx_error(e: RuntimeError, ctx: usize, (p, n, d): (usize, usize, usize)) -> RuntimeError {
    match e {
        RuntimeError::Usage(m) => match m.strip_prefix(&format!("--ctx {ctx} ")) {
            Some(rest) => RuntimeError::Usage(format!(
                "the longest test, -d {d} + -p {p} + -n {n} = {ctx} tokens, {rest}"
            )),
            None => RuntimeError::Usage(m),
        },
        e => e,
    }
}

/// Runs the command.
pub fn run(a: BenchArgs) -> Result<()> {
    if !(1..=MAX_REPETITIONS).contains(&a.repetitions) {
        return Err(RuntimeError::Usage(format!(
            "-r {} must be in 1..={MAX_REPETITIONS}",
            a.repetitions
        ))
        .into());
    }
    // llama-bench's order: each depth, its pp tests, then its tg tests
    let tests: Vec<(usize, usize, usize)> = a
        .n_depth
        .iter()
        .flat_map(|&d| {
            let pp = a
                .n_prompt
                .iter()
                .filter(|&&p| p > 0)
                .map(move |&p| (p, 0, d));
            let tg = a.n_gen.iter().filter(|&&n| n > 0).map(move |&n| (0, n, d));
            pp.chain(tg)
        })
        .collect();
    if tests.is_empty() {
        return Err(RuntimeError::Usage("nothing to run: -p and -n are all 0".into()).into());
    }
    let (ctx, longest) = tests
        .iter()
        .map(|&(p, n, d)| (d.saturating_add(p).saturating_add(n), (p, n, d)))
        .max()
        .unwrap_or((1, (1, 0, 0)));
    // llama-bench runs past the trained context too (a speed test, not a quality one)
    let plan = Plan::build(&PlanOptions {
        ctx: Some(ctx),
        ctx_past_training: true,
        raw: true,
        batch: a.common.batch.or(Some(512)),
        ..common_options(&a.common)
    })
    .map_err(|e| ctx_error(e, ctx, longest))?;
    crate::run::warn_cuda_only(&a.common, &plan);
    let mut exec = gds_runtime::exec::open(&plan, plan.batch, 1)?;
    let ex = &mut *exec;
    let mut rng = Rng::new(1234);
    let name = plan
        .model_name
        .clone()
        .unwrap_or_else(|| plan.model_dir.display().to_string());
    let mut results = Vec::new();
    let mut filled = None;
    for &(n_prompt, n_gen, depth) in &tests {
        if filled != Some(depth) {
            // the cache below the depth: written once, never touched by the tests above it
            if depth > 0 {
                prompt_pass(ex, &mut rng, depth, 0)?;
            }
            filled = Some(depth);
        }
        let pass = |ex: &mut dyn Executor, rng: &mut Rng| {
            if n_prompt > 0 {
                prompt_pass(ex, rng, n_prompt, depth)
            } else {
                gen_pass(ex, rng, n_gen, depth)
            }
        };
        // warm-up: page the weights in, spin the threads up
        pass(ex, &mut rng)?;
        let mut ns = Vec::with_capacity(a.repetitions);
        let io0 = ex.io_stats();
        for _ in 0..a.repetitions {
            let t = Instant::now();
            pass(ex, &mut rng)?;
            ns.push(t.elapsed().as_nanos() as u64);
        }
        let io = ex.io_stats().since(&io0);
        let n = (n_prompt + n_gen) as f64;
        let ts: Vec<f64> = ns.iter().map(|&t| n * 1e9 / t as f64).collect();
        let (avg_ns, std_ns) = mean_std(&ns.iter().map(|&t| t as f64).collect::<Vec<_>>());
        let (avg_ts, stddev_ts) = mean_std(&ts);
        results.push(BenchResult {
            model: name.clone(),
            model_filename: plan.model_dir.display().to_string(),
            n_threads: plan.threads,
            n_batch: plan.batch,
            type_k: format!("{:?}", plan.kv_dtype).to_lowercase(),
            n_prompt,
            n_gen,
            n_depth: depth,
            avg_ns: avg_ns as u64,
            stddev_ns: std_ns as u64,
            avg_ts,
            stddev_ts,
            samples_ns: ns,
            samples_ts: ts,
            backend: ex.backend().to_string(),
            io: plan.io.clone(),
            weights_held_bytes: plan.weights_held_bytes(),
            bytes_read_per_token: io.bytes_read as f64 / (n * a.repetitions as f64),
            read_bandwidth_bytes_per_sec: (io.read_ns > 0)
                .then(|| io.bytes_read as f64 * 1e9 / io.read_ns as f64),
            io_wait_ms: io.wait_ns as f64 / 1e6,
            expert_cache_hit_rate: io.cache_hit_rate(),
        });
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&results)?)?;
    } else {
        let size: u64 = plan.weight_dtypes.values().map(|d| d.bytes).sum();
        outln!("| model | size | backend | threads | test | t/s |")?;
        outln!("| --- | ---: | --- | ---: | ---: | ---: |")?;
        for r in &results {
            let mut test = if r.n_prompt > 0 {
                format!("pp{}", r.n_prompt)
            } else {
                format!("tg{}", r.n_gen)
            };
            if r.n_depth > 0 {
                test += &format!(" @ d{}", r.n_depth);
            }
            outln!(
                "| {} | {:.2} MiB | {} | {} | {test} | {:.2} ± {:.2} |",
                r.model,
                size as f64 / (1 << 20) as f64,
                r.backend,
                r.n_threads,
                r.avg_ts,
                r.stddev_ts
            )?;
        }
    }
    Ok(())
}
