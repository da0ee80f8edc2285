//! `gdsrun serve`: an OpenAI-compatible HTTP server over the GdsLLM runtime.
//!
//! Two halves talk through channels: async HTTP handlers (axum on a small tokio runtime)
//! parse and validate requests, tokenize, and turn token events into text; one engine
//! thread ([`scheduler::Engine`]) owns the model, run state and paged KV cache and advances
//! every admitted request in one batched forward pass per step. A handler that goes away
//! (client disconnect, stop string) drops its receiver, which cancels the request and frees
//! its KV blocks at the next step.

mod api;
pub mod metrics;
pub mod prefix;
pub mod scheduler;

use anyhow::Context;
use clap::Args;
use gds_runtime::{KvCache, KvDtype, Model, Plan, PlanOptions, SamplerConfig, TextTokenizer};
use metrics::ServerMetrics;
use scheduler::{Engine, EngineConfig, Request};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::mpsc;

/// `gdsrun serve` flags.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model directory (made by `gdsconv convert`).
    pub model_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Worker threads of the forward pass (default: physical cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Context length per request (prompt + completion).
    #[arg(short, long)]
    pub ctx: Option<usize>,
    /// Most requests decoding together.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Most tokens per forward pass (prompt chunks and decode tokens together).
    #[arg(long, default_value_t = 256)]
    pub step_tokens: usize,
    /// Most requests waiting for admission; more get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub queue_limit: usize,
    /// KV cache pool size, MiB (fixed-size blocks preallocated at start).
    #[arg(long, default_value_t = 512)]
    pub kv_budget: usize,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub kv_block: usize,
    /// KV cache element type: f32 or f16 (half the memory, a little slower to read).
    #[arg(long, default_value = "f32")]
    pub kv_dtype: String,
    /// How weights are read: auto, mmap or direct (O_DIRECT, layers streamed within
    /// --mem-budget; one pass over the weights serves the whole batch).
    #[arg(long, value_parser = ["auto", "mmap", "direct"])]
    pub io: Option<String>,
    /// Most bytes of weights held in memory, streaming buffers included (e.g. 200MB).
    #[arg(long, value_parser = gds_runtime::ioplan::parse_size)]
    pub mem_budget: Option<u64>,
    /// Require `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name reported by /v1/models (default: the directory's name).
    #[arg(long)]
    pub alias: Option<String>,
}

/// What the handlers share.
pub struct ServerState {
    engine: mpsc::UnboundedSender<Request>,
    tokenizer: Arc<TextTokenizer>,
    metrics: Arc<ServerMetrics>,
    default_sampler: SamplerConfig,
    model_name: String,
    ctx: usize,
    vocab: usize,
    queue_limit: usize,
    api_key: Option<String>,
    created: u64,
}

/// Runs the server until it is stopped (Ctrl-C).
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let bad = |m: String| Err(anyhow::anyhow!(m));
    if args.max_batch == 0 || args.max_batch > 1024 {
        return bad(format!(
            "--max-batch {} must be in 1..=1024",
            args.max_batch
        ));
    }
    if args.kv_block == 0 || args.kv_block > 4096 {
        return bad(format!("--kv-block {} must be in 1..=4096", args.kv_block));
    }
    if args.queue_limit == 0 {
        return bad("--queue-limit must be at least 1".into());
    }
    let kv_dtype = KvDtype::parse(&args.kv_dtype)
        .with_context(|| format!("--kv-dtype {:?}: expected f32 or f16", args.kv_dtype))?;
    let plan = Plan::build(&PlanOptions {
        model_dir: args.model_dir.clone(),
        ctx: args.ctx,
        threads: args.threads,
        batch: Some(args.step_tokens.max(args.max_batch)),
        kv_dtype: Some(kv_dtype),
        io: args.io.clone(),
        mem_budget: args.mem_budget,
        // The server's batched scheduler and paged KV cache run on the CPU backend.
        backend: Some("cpu".into()),
        raw: true,
        ..Default::default()
    })?;
    let model = Model::open(&plan)?;
    let tokenizer = Arc::new(TextTokenizer::load(&plan.model_dir, &model.config)?);
    let c = &model.config;
    let block_bytes = KvCache::paged_bytes(kv_dtype, c.n_layers, c.kv_dim(), args.kv_block, 1);
    let n_blocks = args.kv_budget * (1 << 20) / block_bytes;
    let per_seq = plan.ctx.div_ceil(args.kv_block);
    if n_blocks < per_seq {
        return bad(format!(
            "--kv-budget {} MiB holds {n_blocks} blocks of {} positions; one full context of {} needs {per_seq} (raise --kv-budget or lower --ctx)",
            args.kv_budget, args.kv_block, plan.ctx
        ));
    }
    let kv = KvCache::paged(
        kv_dtype,
        c.n_layers,
        args.max_batch,
        plan.ctx,
        c.kv_dim(),
        args.kv_block,
        n_blocks,
    );
    let metrics = Arc::new(ServerMetrics::default());
    let model_name = args.alias.clone().unwrap_or_else(|| {
        args.model_dir
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let vocab = c.vocab_size;
    let eog = tokenizer.eog_ids().to_vec();
    let cfg = EngineConfig {
        max_batch: args.max_batch,
        step_tokens: plan.batch,
        ctx: plan.ctx,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let engine = Engine::new(model, kv, cfg, plan.threads, eog, metrics.clone());
    let engine_thread = std::thread::Builder::new()
        .name("gds-engine".into())
        .spawn(move || engine.run(rx))
        .context("starting the engine thread")?;
    let state = Arc::new(ServerState {
        engine: tx,
        tokenizer,
        metrics,
        default_sampler: plan.sampler.clone(),
        model_name,
        ctx: plan.ctx,
        vocab,
        queue_limit: args.queue_limit,
        api_key: args.api_key.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("gds-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let summary = format!(
        "model {} | ctx {} | threads {} | max batch {} | KV {} blocks x {} positions ({} MiB, {})",
        state.model_name,
        plan.ctx,
        plan.threads,
        args.max_batch,
        n_blocks,
        args.kv_block,
        (n_blocks * block_bytes) >> 20,
        args.kv_dtype
    );
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        eprintln!("gdsrun serve: {summary}");
        println!("gdsrun serve: listening on http://{addr}");
        let _ = std::io::stdout().flush();
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("serving")
    })?;
    drop(rt);
    let _ = engine_thread.join();
    Ok(())
}

/// The routes.
fn router(state: Arc<ServerState>) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/completions", post(api::completions))
        .route("/v1/chat/completions", post(api::chat))
        .route("/v1/models", get(api::models))
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .fallback(api::not_found)
        .with_state(state)
}
