#![doc = include_str!("../README.md")]

mod anthropic;
mod api;
pub mod batch;
mod batches;
mod embeddings;
mod error;
mod files;
pub use gds_runtime::harmony;
pub mod client;
mod conversations;
mod items;
mod kept;
pub mod kvpool;
pub mod metrics;
mod msgbatches;
mod native;
pub mod net;
mod ollama;
pub mod prefix;
pub mod reasoning;
mod rerank;
mod responses;
pub mod scheduler;
mod score;
mod slots;
mod stored;
mod tokenize;
pub mod tools;
mod truncation;

pub use api::openai_messages;
pub use error::ApiError;

use anyhow::Context;
use clap::Args;
use gds_runtime::backend::Backend;
use gds_runtime::exec::{BatchExecutor, CpuBatchExecutor};
use gds_runtime::{
    GrammarCompiler, KvCache, KvDtype, Model, Plan, PlanOptions, RuntimeError, SamplerConfig,
    TextTokenizer,
};
use metrics::ServerMetrics;
use net::NetLimits;
use scheduler::{Engine, EngineConfig, Msg};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Seconds, as a positive decimal number (`10`, `0.5`).
fn parse_secs(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x <= 86_400.0 => Ok(Duration::from_secs_f64(x)),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 86400]")),
    }
}

/// What MODEL may be, in `gdsrun run`, `serve` and `batch`'s help.
pub const MODEL_HELP: &str = "The model: a directory (made by `gdsconv convert` or `gdsconv pull`), a registry reference (REGISTRY/REPO:TAG or @sha256:…, pulled into the store on first use; Docker Model Runner's and Ollama's models too), a .gguf file (a split one by its first shard) or a Hugging Face checkpoint directory (converted into the store on first use), or hf:ORG/NAME[:QUANT] / ollama:NAME[:TAG] (a model the Hugging Face cache or Ollama's directory holds)";

/// `gdsrun serve` flags.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The model ([`MODEL_HELP`]).
    #[arg(help = MODEL_HELP)]
    pub model_dir: PathBuf,

    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (and /metrics with
    /// --metrics-public).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Read the accepted API keys from FILE, one per line (blank lines and lines starting
    /// with `#` skipped), as llama-server's --api-key-file; with --api-key, both are
    /// accepted. Keeps keys out of the process list.
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve /metrics without the API key (for a Prometheus scraper).
    #[arg(long)]
    pub metrics_public: bool,
    /// `GET /slots` answers 501 (llama-server's `--no-slots`; it is on by default).
    #[arg(long)]
    pub no_slots: bool,
    /// Directory where `POST /slots/{id}?action=save` writes a slot's cached prefix (its
    /// KV blocks) and `action=restore` reads it back, as llama-server's --slot-save-path.
    /// Without it those actions answer 501.
    #[arg(long, value_name = "DIR")]
    pub slot_save_path: Option<PathBuf>,
    /// Allow browser pages from this origin (e.g. `http://localhost:3000`; `*`: any;
    /// `localhost`: any page of this machine, http or https at localhost, 127.0.0.1 or [::1]
    /// on any port, as llama-server's keyword) to call the server (CORS); repeatable.
    /// Default: no CORS headers.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// Most open connections; more are answered 503 (Retry-After: 1) and closed.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Most open connections from one client address (default: a quarter of
    /// --max-connections); more are answered 503 and closed, so one client cannot take every
    /// slot. Behind a reverse proxy every client has the proxy's address: raise it.
    #[arg(long)]
    pub max_client_connections: Option<usize>,
    /// Seconds a client has to send a complete request head, counted from connecting or,
    /// on a kept-alive connection, from the previous response (so also the idle timeout).
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    pub header_timeout: Duration,
    /// Seconds a client has to send a request body (408 after).
    #[arg(long, default_value = "30", value_parser = parse_secs)]
    pub body_timeout: Duration,
    /// Largest request body (e.g. 4MiB); a larger Content-Length gets 413 before the body
    /// is read.
    #[arg(long, default_value = "4MiB", value_parser = gds_runtime::ioplan::parse_size)]
    pub max_body: u64,
    /// Largest non-streamed reply (e.g. 256MiB): one whose choices pass it (many choices
    /// with log-probabilities) is cut off with 400 `reply_too_large` and its other choices
    /// cancelled. Streamed replies go out as they are made and have no such limit.
    #[arg(long, default_value = "256MiB", value_parser = gds_runtime::ioplan::parse_size)]
    pub max_reply: u64,
    /// Memory for the Files API (e.g. 1GiB): uploaded batch inputs and batch results together;
    /// an upload that does not fit is refused (413), nothing is dropped for room. An upload
    /// may be this large whatever --max-body says. 0: no uploads.
    #[arg(long, default_value = "512MiB", value_parser = gds_runtime::ioplan::parse_size)]
    pub file_storage: u64,
    /// Most requests of the Batch API (`/v1/batches`) in the engine at once, all batches
    /// together (default: twice --max-batch, at most --queue-limit). The engine shares its
    /// batch between the batches and each client either way; lower it to leave more of the
    /// queue to clients.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_concurrency: Option<u64>,
}

/// `--scheduling-policy`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulingPolicy {
    Fcfs,
    Priority,
}

/// The engine's flags, shared by `gdsrun serve` and `gdsrun batch`.
#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Worker threads of the forward pass (default: physical cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Most tokens of a reply whose request sets none (llama-server's -n); -1: until the
    /// context is full [default: the model's recommended max_new_tokens, else -1].
    #[arg(
        short = 'n',
        long = "n-predict",
        visible_alias = "max-tokens",
        allow_negative_numbers = true,
        value_name = "N"
    )]
    pub n_predict: Option<i64>,
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
    /// How waiting requests are admitted (vLLM's flag): `fcfs`, first come first served,
    /// shared fairly between client addresses (a request's `priority` must be 0); `priority`,
    /// by each request's `priority` (lower first; the same fair order among equals), a full
    /// batch preempting a running request of a higher value for one of a lower. Either way
    /// the Batch APIs' requests yield to every other.
    #[arg(long, value_enum, default_value = "fcfs")]
    pub scheduling_policy: SchedulingPolicy,
    /// A reply that fills the context before its token limit goes on (llama-server's
    /// `--context-shift`): the tokens after the kept start (a request's `n_keep`, default
    /// none but the BOS) are halved (`n_discard`) and the rest computed again. Off: the reply
    /// ends at the context (`finish_reason: length`). Ollama's endpoints shift unless a
    /// request says `"shift": false`, as Ollama does.
    #[arg(long)]
    pub context_shift: bool,
    /// With --context-shift, the prompt tokens a shift keeps after the BOS where a request
    /// does not say (its `n_keep`; llama-server's `--keep`): -1 the whole prompt.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = clap::value_parser!(i64).range(-1..))]
    pub keep: i64,
    /// KV cache pool size, MiB (fixed-size blocks preallocated at start).
    #[arg(long, default_value_t = 512)]
    pub kv_budget: usize,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub kv_block: usize,
    /// KV cache type: f16 (the default, on the CPU and the GPU: half the memory; perplexity
    /// within 0.001 % of f32's with --activations f32, 0.08-0.30 % apart with the default q8
    /// activations) or f32 (exact); `--kv-type` as `gdsrun run` names it
    /// (`--kv-dtype` is its other name).
    #[arg(long = "kv-type", visible_alias = "kv-dtype", value_name = "KV_TYPE")]
    pub kv_dtype: Option<String>,
    /// Compute backend: cpu, cuda (the GPU: weights, KV cache and activations in VRAM,
    /// layers beyond --vram-budget streamed once per step for the whole batch) or auto (a
    /// usable GPU, else the CPU, saying why).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "auto"])]
    pub backend: String,
    /// Most bytes of VRAM the CUDA backend uses (weights, KV pool, scratch, streaming
    /// slots; default 90 % of the device).
    #[arg(long, value_parser = gds_runtime::ioplan::parse_size)]
    pub vram_budget: Option<u64>,
    /// How weights are read: auto, mmap, load (the whole model read into memory backed by
    /// huge pages: auto's choice where it fits) or direct (O_DIRECT, layers streamed within
    /// --mem-budget; one pass over the weights serves the whole batch); with --backend cuda
    /// also gds (GPUDirect Storage: cuFile into VRAM).
    #[arg(long, value_parser = ["auto", "mmap", "load", "direct", "gds"])]
    pub io: Option<String>,
    /// Most bytes of weights held in memory, streaming buffers included (e.g. 200MB).
    #[arg(long, value_parser = gds_runtime::ioplan::parse_size)]
    pub mem_budget: Option<u64>,
    /// Model name reported by /v1/models (default: the directory's name); several, comma
    /// separated, are the model's aliases, as llama-server's: requests may name any, and
    /// the first in alphabetical order is its id.
    #[arg(long)]
    pub alias: Option<String>,
    /// Tags listed with the model in /v1/models (comma separated; llama-server's `--tags`).
    #[arg(long)]
    pub tags: Option<String>,
    /// Take a chat request's own `chat_template` (vLLM's flag): rendered by the same bounded
    /// template engine as a model's template; without it such a request is refused.
    #[arg(long)]
    pub trust_request_chat_template: bool,
    /// Trust the layer files: skip checking their BLAKE3 content hashes before first use.
    #[arg(long)]
    pub no_verify: bool,
    /// Activations of the matrix products: q8 (8-bit integer dot products, fast) or f32
    /// (weights dequantized row by row: a float reference's arithmetic, for evaluations
    /// compared with one).
    #[arg(long, value_parser = ["q8", "f32"])]
    pub activations: Option<String>,
    /// Cap the CPU kernels' instruction set: scalar, avx2, avxvnni or avx512vnni (default:
    /// the best this CPU has; `GDS_ISA` is an alias). A set this CPU lacks falls to the next
    /// narrower one.
    #[arg(long, value_parser = gds_runtime::plan::parse_isa)]
    pub isa: Option<gds_runtime::Isa>,
    /// On the GPU, passes of this many tokens or more go through GEMM on dequantized tiles,
    /// shorter ones through the matvec kernels (default 32 with `--activations q8`, 8 with f32;
    /// `GDS_GEMM_MIN_TOKENS` is an alias).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub gemm_min_tokens: Option<u64>,
    /// On the GPU, replay decode steps from CUDA graphs where every layer is resident (on,
    /// the default; off launches every kernel each step; `GDS_CUDA_GRAPHS` is an alias).
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    pub cuda_graphs: Option<String>,
    /// On the GPU, what the GEMMs of long passes round their inputs to: f16 (tensor cores,
    /// the default with `--activations q8`), tf32, or f32 (the default with `--activations
    /// f32`; `GDS_GEMM_TYPE` is an alias).
    #[arg(long, value_name = "f16|tf32|f32", value_parser = gds_runtime::plan::parse_gemm_type)]
    pub gemm_type: Option<gds_runtime::GemmType>,
    /// A Jinja chat template that replaces the model's (for a model whose template is missing
    /// or wrong; checked as a model's template is).
    #[arg(long, value_name = "FILE", conflicts_with = "chat_template")]
    pub chat_template_file: Option<std::path::PathBuf>,
    /// A built-in chat template by name (chatml, llama2, llama2-sys, llama3, mistral-v7,
    /// phi3, phi4, zephyr, gemma, vicuna, deepseek, command-r: llama.cpp's formats), or a
    /// Jinja template itself, replacing the model's.
    #[arg(long, value_name = "NAME|JINJA")]
    pub chat_template: Option<String>,
    /// How /v1/embeddings makes one vector of a text's final-normed hidden states: mean
    /// (over every token), last (the last token's: decoder embedding models such as
    /// e5-mistral, gte-Qwen2, Qwen3-Embedding) or cls (the first token's); then normalized.
    /// none: every token's state, not normalized, from /embedding only (llama-server's
    /// per-token embeddings; /v1/embeddings and Ollama's answer 400).
    /// Default: the pooling a GGUF input named (`<arch>.pooling_type`), else mean. `rank`
    /// (llama-server's name) is `--reranking`.
    #[arg(long, value_parser = ["mean", "last", "cls", "none", "rank"])]
    pub pooling: Option<String>,
    /// Require reranking (`/rerank`): refuse to start unless the model is a reranker (a
    /// classifier head, `cls.output.weight`). A reranker answers `/rerank` without it.
    #[arg(long, alias = "rerank")]
    pub reranking: bool,
    /// Chat replies of a thinking model (a template with `<think>` tags: Qwen 3, QwQ,
    /// DeepSeek-R1, GLM 4.5+; `[THINK]`: Magistral): `auto` (= `deepseek`) gives the
    /// reasoning apart as `reasoning_content` (Anthropic: a `thinking` block), `none` the
    /// reply whole as `content`. Requests may set `reasoning_format` themselves.
    #[arg(long, default_value = "auto", value_parser = ["auto", "deepseek", "deepseek-legacy", "none"])]
    pub reasoning_format: String,
    /// Thinking (llama-server's `--reasoning`): the chat template's `enable_thinking` (Qwen 3's
    /// switch) where a request's `chat_template_kwargs` does not set it: true for `on` and
    /// `auto` (as llama-server; templates that read it default to thinking anyway), false for
    /// `off`, which also closes a thinking the template opens whatever the variable
    /// (DeepSeek-R1's, QwQ's), as llama-server does.
    #[arg(long, default_value = "auto", value_parser = ["on", "off", "auto"])]
    pub reasoning: String,
    /// Sampling: `gdsrun run`'s settings, here the defaults of requests that do not set
    /// them (as llama-server's flags are).
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// The sampling flags of `gdsrun run` and `chat` (the settings of every reply) and of
/// `serve` and `batch` (the defaults of requests that do not set them).
#[derive(Args, Debug, Default, Clone)]
pub struct SamplingArgs {
    /// Temperature (0 = greedy) [default: 0.8].
    #[arg(long)]
    pub temp: Option<f32>,
    /// Top-k, 0 disables [default: 40].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Top-p, 1 disables [default: 0.95].
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Min-p, 0 disables [default: 0.05].
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Repeat penalty, 1 disables [default: 1.0].
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// Tokens the repeat penalty looks back over [default: 64].
    #[arg(long)]
    pub repeat_last_n: Option<usize>,
    /// Subtracted from a token's logit per time the reply generated it, -2..=2 [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    /// Subtracted from the logit of every token the reply generated, -2..=2 [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    /// Random seed. run/chat: default from the clock, recorded in the plan; serve/batch: the
    /// seed of requests that name none (so the same request gets the same answer; default a
    /// random seed per request).
    #[arg(long, short = 's')]
    pub seed: Option<u64>,
    /// Locally typical sampling's mass, 1 disables [default: 1.0].
    #[arg(long, visible_alias = "typical-p")]
    pub typical: Option<f32>,
    /// Keep tokens within N standard deviations of the largest logit, <= 0 disables
    /// [default: -1].
    #[arg(long, visible_alias = "top-n-sigma", allow_negative_numbers = true)]
    pub top_nsigma: Option<f32>,
    /// XTC: the chance per token of excluding the top choices, 0 disables [default: 0].
    #[arg(long)]
    pub xtc_probability: Option<f32>,
    /// XTC: tokens at least this likely are top choices, > 0.5 disables [default: 0.1].
    #[arg(long)]
    pub xtc_threshold: Option<f32>,
    /// Dynamic temperature: the temperature moves within temp ± this with the entropy, 0
    /// disables [default: 0].
    #[arg(long)]
    pub dynatemp_range: Option<f32>,
    /// Dynamic temperature's exponent [default: 1.0].
    #[arg(long, visible_alias = "dynatemp-exponent")]
    pub dynatemp_exp: Option<f32>,
    /// Mirostat: 0 off, 1 Mirostat, 2 Mirostat 2.0 (replaces the other samplers, as in
    /// llama.cpp) [default: 0].
    #[arg(long)]
    pub mirostat: Option<u8>,
    /// Mirostat's learning rate, eta [default: 0.1].
    #[arg(long, visible_alias = "mirostat-eta")]
    pub mirostat_lr: Option<f32>,
    /// Mirostat's target entropy, tau [default: 5.0].
    #[arg(long, visible_alias = "mirostat-tau")]
    pub mirostat_ent: Option<f32>,
    /// DRY: multiplier of the penalty on tokens that extend a repeat, 0 disables [default: 0].
    #[arg(long)]
    pub dry_multiplier: Option<f32>,
    /// DRY's base (>= 1) [default: 1.75].
    #[arg(long)]
    pub dry_base: Option<f32>,
    /// DRY: repeats up to this long go unpunished [default: 2].
    #[arg(long)]
    pub dry_allowed_length: Option<usize>,
    /// DRY: how many recent tokens it looks at, 0 disables [default: 64].
    #[arg(long)]
    pub dry_penalty_last_n: Option<usize>,
    /// DRY: a text that ends a repeat (repeatable; replaces the defaults "\n", ":", "\"",
    /// "*"; "none" for none).
    #[arg(long = "dry-sequence-breaker", visible_alias = "dry-sequence-breakers")]
    pub dry_sequence_breaker: Vec<String>,
    /// Adaptive-p's target probability, < 0 disables (runs where --samplers lists
    /// adaptive_p) [default: -1].
    #[arg(long, allow_negative_numbers = true)]
    pub adaptive_target: Option<f32>,
    /// Adaptive-p's decay, 0..=0.99 [default: 0.9].
    #[arg(long)]
    pub adaptive_decay: Option<f32>,
    /// Top-p, min-p, typical and XTC keep at least this many tokens [default: 0].
    #[arg(long)]
    pub min_keep: Option<usize>,
    /// The samplers and their order, names separated by ';' [default:
    /// penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature].
    #[arg(long)]
    pub samplers: Option<gds_runtime::sampler::Order>,
    /// The samplers and their order as llama.cpp's letters [default: edskypmxt].
    #[arg(long, visible_alias = "sampling-seq", conflicts_with = "samplers")]
    pub sampler_seq: Option<gds_runtime::sampler::Order>,
    /// The model's recommended sampling settings (its generation_config.json, else its
    /// GGUF's general.sampling.*) are the defaults of what the flags above leave unset:
    /// `auto`; `none` for gdsrun's own defaults; or another generation_config.json (a file
    /// or the directory holding it) in place of the model's [default: auto].
    #[arg(long, value_name = "auto|none|FILE")]
    pub generation_config: Option<gds_runtime::recommended::Source>,
}

impl SamplingArgs {
    /// `base` with these settings.
    pub fn options(&self, base: PlanOptions) -> PlanOptions {
        PlanOptions {
            temp: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
            extra_sampling: self.extra(),
            extra_given: gds_runtime::recommended::ExtraGiven {
                xtc_probability: self.xtc_probability.is_some(),
                xtc_threshold: self.xtc_threshold.is_some(),
                mirostat: self.mirostat.is_some(),
                mirostat_tau: self.mirostat_ent.is_some(),
                mirostat_eta: self.mirostat_lr.is_some(),
                order: self.samplers.is_some() || self.sampler_seq.is_some(),
            },
            generation_config: self.generation_config.clone().unwrap_or_default(),
            ..base
        }
    }

    /// llama.cpp's other samplers as given (each left out at its default).
    fn extra(&self) -> gds_runtime::sampler::ExtraSamplers {
        let d = gds_runtime::sampler::ExtraSamplers::default();
        gds_runtime::sampler::ExtraSamplers {
            typical_p: self.typical.unwrap_or(d.typical_p),
            top_n_sigma: self.top_nsigma.unwrap_or(d.top_n_sigma),
            xtc_probability: self.xtc_probability.unwrap_or(d.xtc_probability),
            xtc_threshold: self.xtc_threshold.unwrap_or(d.xtc_threshold),
            dynatemp_range: self.dynatemp_range.unwrap_or(d.dynatemp_range),
            dynatemp_exponent: self.dynatemp_exp.unwrap_or(d.dynatemp_exponent),
            mirostat: self.mirostat.unwrap_or(d.mirostat),
            mirostat_tau: self.mirostat_ent.unwrap_or(d.mirostat_tau),
            mirostat_eta: self.mirostat_lr.unwrap_or(d.mirostat_eta),
            dry_multiplier: self.dry_multiplier.unwrap_or(d.dry_multiplier),
            dry_base: self.dry_base.unwrap_or(d.dry_base),
            dry_allowed_length: self.dry_allowed_length.unwrap_or(d.dry_allowed_length),
            dry_penalty_last_n: self.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
            dry_sequence_breakers: match self.dry_sequence_breaker.as_slice() {
                [] => d.dry_sequence_breakers,
                [none] if none == "none" => Vec::new(),
                given => given.to_vec(),
            },
            adaptive_target: self.adaptive_target.unwrap_or(d.adaptive_target),
            adaptive_decay: self.adaptive_decay.unwrap_or(d.adaptive_decay),
            min_keep: self.min_keep.unwrap_or(d.min_keep),
            order: self
                .samplers
                .clone()
                .or_else(|| self.sampler_seq.clone())
                .map_or(d.order, |o| o.0),
            dry_table: None,
            infill_table: None,
        }
    }
}

/// What the handlers share.
pub struct ServerState {
    engine: mpsc::UnboundedSender<Msg>,
    tokenizer: Arc<TextTokenizer>,
    metrics: Arc<ServerMetrics>,
    default_sampler: SamplerConfig,
    /// Most tokens of a reply whose request sets none, as the model recommends
    /// (`max_new_tokens` of its generation_config.json); `None`: until the context is full.
    default_max_tokens: Option<usize>,
    /// Stop strings of a request that gives none, as the model recommends.
    default_stop: Vec<String>,
    /// `--seed`: the seed of requests that name none (else a random one each).
    default_seed: Option<u64>,
    /// `--reasoning-format`: requests' default.
    reasoning_format: reasoning::Format,
    /// `--reasoning`: the default `enable_thinking` (false for off).
    thinking: bool,
    /// `--context-shift`: replies go on past the context (Ollama's endpoints: unless the
    /// request says otherwise).
    context_shift: bool,
    /// `--keep`: the default `n_keep`.
    keep: i64,
    /// Every name of the model (`--alias`, else the directory's name), sorted, not empty:
    /// the first is its id ([`ServerState::model_name`]).
    aliases: Vec<String>,
    /// `--tags`.
    tags: Vec<String>,
    /// `--trust-request-chat-template`.
    trust_request_template: bool,
    /// `--scheduling-policy priority`: requests' `priority` is honoured.
    priority_scheduling: bool,
    /// Request templates compiled lately, each with the text its request gave (a name or
    /// Jinja), the most recent last
    /// ([`api::request_template`]).
    templates: std::sync::Mutex<Vec<(String, Arc<gds_runtime::chat::ChatTemplate>)>>,
    /// `system_fingerprint` of every completion: the engine build and configuration the model
    /// runs with (changes when the model, backend, activations or KV type change).
    fingerprint: String,
    ctx: usize,
    vocab: usize,
    queue_limit: usize,
    /// The accepted API keys; empty: no key needed.
    api_keys: Vec<String>,
    /// /metrics answers without the API key.
    metrics_public: bool,
    /// `GET /slots` answers.
    slots: bool,
    /// Where slots are saved to and restored from (`--slot-save-path`).
    slot_save_path: Option<PathBuf>,
    /// The KV cache's element type and positions per block (a saved slot's).
    kv_dtype: KvDtype,
    kv_block: usize,
    /// Bytes of one KV block's image without and with its window layers' rows (a saved
    /// slot's blocks).
    block_image: [usize; 2],
    /// Origins allowed by CORS (`*`: any); empty: CORS off.
    cors_origins: Vec<String>,
    created: u64,
    limits: NetLimits,
    /// The model directory (for the grammar compiler's vocabulary).
    model_dir: std::path::PathBuf,
    /// Compiles request grammars; built on the first constrained request.
    grammar: std::sync::OnceLock<Result<Arc<GrammarCompiler>, String>>,
    /// One grammar compiles at a time (a large one takes seconds of a core, which the
    /// engine thread needs); the others wait, and a request whose client left while it
    /// waited never compiles.
    grammar_slot: Arc<tokio::sync::Semaphore>,
    /// Requests in the engine per client address.
    client_jobs: Arc<client::PerClient>,
    /// Most requests of one client address in the engine: its share of the queue, as
    /// `--max-client-connections` is its share of the connections (at least twice the
    /// batch, at most the queue and the batch).
    client_share: usize,
    /// How `/v1/embeddings` pools; `None` where the backend gives no hidden states.
    pooling: Option<scheduler::Pooling>,
    /// A reranker's head and prompt (`/rerank`); `None`: the model has none.
    rank: Option<Arc<gds_runtime::rank::RankHead>>,
    /// Width of the hidden states (the embeddings' dimensions).
    n_embd: usize,
    /// Most sequences the engine runs together (`--max-batch`).
    max_batch: usize,
    /// Most tokens per forward pass (`--step-tokens`; llama-server's batch, which `/infill`
    /// fits its context to).
    step_tokens: usize,
    /// Responses kept for `previous_response_id` and retrieval.
    responses: std::sync::Mutex<responses::ResponseStore>,
    /// Conversations kept for the Conversations API and `conversation` in responses.
    conversations: std::sync::Mutex<conversations::ConversationStore>,
    /// Chat completions kept by `store: true` (OpenAI's stored completions).
    chat_store: std::sync::Mutex<stored::ChatStore>,
    /// The Files API's files (uploads and batch results) under their budget
    /// (`--file-storage`).
    files: std::sync::Mutex<files::FileStore>,
    /// The Batch API's batches, and Anthropic's message batches.
    batches: std::sync::Mutex<batches::BatchStore>,
    msg_batches: std::sync::Mutex<msgbatches::MsgBatchStore>,
    /// Batch requests in the engine at once, all batches together (`--batch-concurrency`).
    batch_slots: Arc<tokio::sync::Semaphore>,
    /// The model as Ollama's API describes it (`/api/tags`, `/api/show`).
    card: ollama::ModelCard,
}

impl ServerState {
    /// The model's id: the first of its names in alphabetical order (llama-server's).
    fn model_name(&self) -> &str {
        &self.aliases[0]
    }

    /// The grammar compiler, built on first use (indexing the vocabulary takes from tens of
    /// milliseconds to a second): an error when this model's tokenizer cannot be indexed.
    fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, String> {
        self.grammar
            .get_or_init(|| {
                GrammarCompiler::load(&self.model_dir, &self.tokenizer, self.vocab)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }
}

/// OpenAI's `system_fingerprint`, "the backend configuration that the model runs with": `fp_`
/// and 10 hex digits of a BLAKE3 hash over this build's version, the model's manifest (which
/// holds every layer file's hash), the backend, the activations and the KV cache's type.
fn system_fingerprint(plan: &gds_runtime::Plan, kv: KvDtype) -> String {
    let mut h = blake3::Hasher::new();
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    if let Ok(m) = std::fs::read(plan.model_dir.join("manifest.gdsm")) {
        h.update(&m);
    }
    h.update(format!("|{}|{:?}|{kv:?}", plan.backend.as_str(), plan.activations).as_bytes());
    format!("fp_{}", &h.finalize().to_hex()[..10])
}

/// The API keys of `--api-key` and `--api-key-file`: each non-empty, without whitespace or
/// control characters (an empty `--api-key "$KEY"` with KEY unset let an empty
/// `x-api-key:` header in).
fn api_keys(key: Option<&str>, file: Option<&std::path::Path>) -> anyhow::Result<Vec<String>> {
    let bad = |m: String| anyhow::Error::from(RuntimeError::Usage(m));
    let check = |k: &str, what: &str| -> anyhow::Result<()> {
        if k.is_empty() {
            return Err(bad(format!("{what}: an empty API key")));
        }
        if !k.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(format!(
                "{what}: an API key is printable ASCII without spaces (what an HTTP header carries)"
            )));
        }
        Ok(())
    };
    let mut keys = Vec::new();
    if let Some(k) = key {
        check(k, "--api-key")?;
        keys.push(k.to_string());
    }
    if let Some(path) = file {
        const MAX: u64 = 1 << 20;
        // links followed (Kubernetes mounts secrets through them); a FIFO or device is
        // refused without blocking the open
        let f = gds_io::open_user_file(path)
            .map_err(|e| bad(format!("--api-key-file {}: {e}", path.display())))?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX + 1), &mut text)
            .map_err(|e| RuntimeError::file(path, e))?;
        if text.len() as u64 > MAX {
            return Err(bad(format!(
                "--api-key-file {}: larger than 1 MiB",
                path.display()
            )));
        }
        let before = keys.len();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            check(
                line,
                &format!("--api-key-file {} line {}", path.display(), i + 1),
            )?;
            keys.push(line.to_string());
        }
        if keys.len() == before {
            return Err(bad(format!(
                "--api-key-file {}: no key in it",
                path.display()
            )));
        }
    }
    Ok(keys)
}

/// Physical memory, bytes (`MemTotal` of /proc/meminfo), when known.
fn total_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = s
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    kb.checked_mul(1024)
}

/// What the HTTP front end adds to the handlers' state.
pub(crate) struct Frontend {
    pub(crate) api_keys: Vec<String>,
    pub(crate) metrics_public: bool,
    /// `GET /slots` answers (llama-server's `--slots`).
    pub(crate) slots: bool,
    /// `--slot-save-path`.
    pub(crate) slot_save_path: Option<PathBuf>,
    pub(crate) cors_origins: Vec<String>,
    pub(crate) limits: NetLimits,
    /// `--file-storage` (bytes).
    pub(crate) file_storage: usize,
    /// `--batch-concurrency`.
    pub(crate) batch_concurrency: Option<usize>,
}

/// An engine running on a model, and the state its handlers share.
pub(crate) struct Started {
    pub(crate) state: Arc<ServerState>,
    pub(crate) engine_thread: std::thread::JoinHandle<()>,
    /// One line: the model, context, threads, batch and KV pool.
    pub(crate) summary: String,
}

/// The KV cache sized from `--kv-budget` (`kv_bytes`), the pool's sizes, and the executor
/// on the plan's backend (`start`'s part that needs no tokenizer). Budget errors are usage
/// errors.
fn open_engine_parts(
    e: &EngineArgs,
    plan: &Plan,
    kv_dtype: KvDtype,
    kv_bytes: usize,
    metrics: &ServerMetrics,
) -> anyhow::Result<(KvCache, kvpool::KvPool, Box<dyn BatchExecutor>)> {
    let bad = |m: String| Err(RuntimeError::Usage(m).into());
    let c = &plan.model;
    let pool = kvpool::KvPool::size(&kvpool::KvPoolArgs {
        dtype: kv_dtype,
        windows: (0..c.n_layers).map(|l| c.window(l)).collect(),
        kv_dim: c.kv_dim(),
        block: e.kv_block,
        ctx: plan.ctx,
        max_batch: e.max_batch,
        step: plan.batch,
        budget: kv_bytes,
    });
    let pool = match pool {
        Ok(p) => p,
        Err(err) => return bad(format!("--kv-budget {} MiB {err}", e.kv_budget)),
    };
    // the CUDA backend holds the rows in VRAM and drops the host's
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut kv = match KvCache::try_paged_windowed(
        kv_dtype,
        &pool.windows,
        e.max_batch,
        plan.ctx,
        c.kv_dim(),
        e.kv_block,
        pool.n_blocks,
        pool.n_window_blocks,
    ) {
        Ok(kv) => kv,
        Err(err) => return bad(format!("--kv-budget {} MiB: {err}", e.kv_budget)),
    };
    let _ = metrics.backend.set(plan.backend.as_str());
    let outputs = scheduler::max_outputs(&EngineConfig {
        max_batch: e.max_batch,
        step_tokens: plan.batch,
        ctx: plan.ctx,
    });
    let exec: Box<dyn BatchExecutor> = match plan.backend {
        Backend::Cpu => Box::new(CpuBatchExecutor::new(
            Model::open(plan)?,
            plan.batch,
            outputs,
            plan.ctx,
        )),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Box::new(gds_runtime::gpu::open_batch(
            plan, &mut kv, plan.batch, outputs,
        )?),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => {
            return Err(RuntimeError::Backend(
                "--backend cuda: this gdsrun was built without the `cuda` feature".into(),
            )
            .into())
        }
    };
    Ok((kv, pool, exec))
}

/// Checks the engine's flags, opens the model and starts the engine thread (`who` names the
/// command in messages). Flag errors are usage errors (exit 2).
pub(crate) fn start(
    model_dir: &std::path::Path,
    e: &EngineArgs,
    front: Frontend,
    who: &'static str,
) -> anyhow::Result<Started> {
    let bad = |m: String| Err(RuntimeError::Usage(m).into());
    if e.max_batch == 0 || e.max_batch > 1024 {
        return bad(format!("--max-batch {} must be in 1..=1024", e.max_batch));
    }
    if e.kv_block == 0 || e.kv_block > 4096 {
        return bad(format!("--kv-block {} must be in 1..=4096", e.kv_block));
    }
    if e.queue_limit == 0 {
        return bad("--queue-limit must be at least 1".into());
    }
    let kv_dtype = match e.kv_dtype.as_deref().map(KvDtype::parse) {
        None => None,
        Some(Some(d)) => Some(d),
        Some(None) => {
            return bad(format!(
                "--kv-type {:?}: expected f32 or f16",
                e.kv_dtype.as_deref().unwrap_or_default()
            ))
        }
    };
    // a budget over the machine's memory (or over usize) could only end in an abort
    let memory = total_memory();
    let Some(kv_bytes) = e
        .kv_budget
        .checked_mul(1 << 20)
        .filter(|&b| memory.is_none_or(|m| b as u64 <= m))
    else {
        return bad(format!(
            "--kv-budget {} MiB is more than {}",
            e.kv_budget,
            memory.map_or("this machine can address".into(), |m| format!(
                "this machine's memory ({} MiB)",
                m >> 20
            ))
        ));
    };
    let max_tokens = match e.n_predict {
        None | Some(-1) => None,
        Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(RuntimeError::Usage(format!(
                "--n-predict {n} must be -1 (until the context is full) or at least 1"
            ))
            .into())
        }
    };
    let plan = Plan::build(&e.sampling.options(PlanOptions {
        model_dir: model_dir.to_path_buf(),
        max_tokens,
        unlimited_tokens: e.n_predict == Some(-1),
        ctx: e.ctx,
        threads: e.threads,
        batch: Some(e.step_tokens.max(e.max_batch)),
        kv_dtype,
        io: e.io.clone(),
        mem_budget: e.mem_budget,
        backend: Some(e.backend.clone()),
        vram_budget: e.vram_budget,
        raw: true,
        no_verify: e.no_verify,
        activations: e.activations.clone(),
        isa: e.isa,
        gemm_min_tokens: e.gemm_min_tokens.map(|n| n as usize),
        cuda_graphs: e.cuda_graphs.as_deref().map(|g| g == "on"),
        gemm_type: e.gemm_type,
        chat_template_file: e.chat_template_file.clone(),
        chat_template: e.chat_template.clone(),
        ..Default::default()
    }))?;
    let kv_dtype = plan.kv_dtype;
    let metrics = Arc::new(ServerMetrics::default());
    // The tokenizer loads beside the KV cache's sizing and the model's open; its error
    // (and its template's) is reported first, as when it loaded before them.
    let (tokenizer, opened) = gds_runtime::engine::load_tokenizer_beside(&plan, || {
        open_engine_parts(e, &plan, kv_dtype, kv_bytes, &metrics)
    });
    let mut tokenizer = tokenizer?;
    if let Some(src) = &plan.chat_template_override {
        tokenizer.set_chat_template(src)?;
    }
    let tokenizer = Arc::new(tokenizer);
    let (kv, pool, exec) = opened?;
    let c = &plan.model;
    let mut aliases = name_list(e.alias.as_deref());
    if aliases.is_empty() {
        aliases.push(
            model_dir
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        );
    }
    let tags = name_list(e.tags.as_deref());
    let vocab = c.vocab_size;
    let eog = tokenizer.eog_ids().to_vec();
    let cfg = EngineConfig {
        max_batch: e.max_batch,
        step_tokens: plan.batch,
        ctx: plan.ctx,
    };
    let pooling = match e.pooling.as_deref().filter(|&p| p != "rank") {
        Some(p) => p
            .parse::<scheduler::Pooling>()
            .map_err(RuntimeError::Usage)?,
        None => model_pooling(&plan.model_dir).unwrap_or(scheduler::Pooling::Mean),
    };
    let pooling = exec.gives_hidden().then_some(pooling);
    let rank = gds_runtime::rank::RankHead::load(&plan.model_dir, !e.no_verify)?.map(Arc::new);
    if rank.is_none() && (e.reranking || e.pooling.as_deref() == Some("rank")) {
        return Err(RuntimeError::Usage(format!(
            "{}: --reranking: this model is not a reranker (it has no classifier head, {})",
            plan.model_dir.display(),
            gds_runtime::rank::HEAD_TENSOR
        ))
        .into());
    }
    let n_embd = c.n_embd;
    let (tx, rx) = mpsc::unbounded_channel();
    let block_image = [kv.block_image_len(false), kv.block_image_len(true)];
    let engine = Engine::new(exec, kv, cfg, eog, metrics.clone());
    let engine_thread = std::thread::Builder::new()
        .name("gds-engine".into())
        .spawn(move || engine.run(rx))
        .context("starting the engine thread")?;
    let fingerprint = system_fingerprint(&plan, kv_dtype);
    let state = Arc::new(ServerState {
        engine: tx,
        tokenizer,
        metrics,
        default_sampler: plan.sampler.clone(),
        default_max_tokens: plan.limits.max_tokens,
        default_stop: plan.limits.stop.clone(),
        default_seed: e.sampling.seed,
        reasoning_format: reasoning::Format::parse(&e.reasoning_format)
            .map_err(RuntimeError::Usage)?,
        thinking: e.reasoning != "off",
        context_shift: e.context_shift,
        keep: e.keep,
        aliases,
        tags,
        trust_request_template: e.trust_request_chat_template,
        priority_scheduling: e.scheduling_policy == SchedulingPolicy::Priority,
        templates: Default::default(),
        fingerprint,
        ctx: plan.ctx,
        vocab,
        queue_limit: e.queue_limit,
        api_keys: front.api_keys,
        metrics_public: front.metrics_public,
        slots: front.slots,
        slot_save_path: front.slot_save_path,
        kv_dtype,
        kv_block: e.kv_block,
        block_image,
        cors_origins: front.cors_origins,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        limits: front.limits,
        model_dir: plan.model_dir.clone(),
        grammar: std::sync::OnceLock::new(),
        grammar_slot: Arc::new(tokio::sync::Semaphore::new(1)),
        client_jobs: Default::default(),
        client_share: (e.queue_limit * front.limits.max_client_connections)
            .div_ceil(front.limits.max_connections.max(1))
            .max(2 * e.max_batch)
            .min(e.queue_limit + e.max_batch)
            .max(1),
        pooling,
        rank,
        n_embd,
        step_tokens: plan.batch,
        max_batch: e.max_batch,
        responses: Default::default(),
        conversations: Default::default(),
        chat_store: Default::default(),
        files: std::sync::Mutex::new(files::FileStore::new(front.file_storage)),
        batches: Default::default(),
        msg_batches: Default::default(),
        batch_slots: Arc::new(tokio::sync::Semaphore::new(
            front
                .batch_concurrency
                .unwrap_or(2 * e.max_batch)
                .clamp(1, e.queue_limit.max(1)),
        )),
        card: ollama::ModelCard::of(&plan),
    });
    // index the vocabulary for constrained decoding in the background (Gemma's 262k tokens
    // take a few seconds), so the first request with a grammar seldom waits for it
    {
        let st = state.clone();
        let _ = std::thread::Builder::new()
            .name("gds-grammar".into())
            .spawn(move || {
                if let Err(e) = st.grammar_compiler() {
                    eprintln!("{who}: constrained decoding unavailable: {e}");
                }
            });
    }
    if let Some(r) = &plan.recommended_sampling {
        if !r.applied.is_empty() {
            eprintln!(
                "{who}: the model's recommended sampling: {} (requests' own settings win; --generation-config none for gdsrun's defaults)",
                r.summary()
            );
        }
        for i in &r.ignored {
            eprintln!("{who}: left out of the model's recommended sampling: {i}");
        }
    }
    let summary = format!(
        "model {} | backend {} | ctx {} | threads {} | max batch {} | KV {} ({})",
        state.model_name(),
        plan.backend,
        plan.ctx,
        plan.threads,
        e.max_batch,
        pool.describe(e.kv_block),
        kv_dtype.name()
    );
    Ok(Started {
        state,
        engine_thread,
        summary,
    })
}

/// The pooling a GGUF input named (`<arch>.pooling_type`, kept in the manifest as
/// `gguf.<arch>.pooling_type`: 1 mean, 2 cls, 3 last), if any; embedding models such as
/// Qwen3-Embedding carry one.
fn model_pooling(dir: &std::path::Path) -> Option<scheduler::Pooling> {
    let bytes = std::fs::read(dir.join(gds_format::MANIFEST_FILE)).ok()?;
    let m = gds_runtime::model_dir::parse_manifest(dir, &bytes).ok()?;
    let arch = m.get_str("general.source_architecture").ok()?;
    match m.get_u64(&format!("gguf.{arch}.pooling_type")).ok()? {
        1 => Some(scheduler::Pooling::Mean),
        2 => Some(scheduler::Pooling::Cls),
        3 => Some(scheduler::Pooling::Last),
        _ => None,
    }
}

/// Runs the server until it is stopped (Ctrl-C).
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    // flag errors are usage errors (exit 2)
    let bad = |m: String| Err(RuntimeError::Usage(m).into());
    if args.max_connections == 0 || args.max_connections > 1 << 20 {
        return bad(format!(
            "--max-connections {} must be in 1..={}",
            args.max_connections,
            1 << 20
        ));
    }
    let max_client_connections = args
        .max_client_connections
        .unwrap_or((args.max_connections / 4).max(1));
    if max_client_connections == 0 || max_client_connections > args.max_connections {
        return bad(format!(
            "--max-client-connections {max_client_connections} must be in 1..={} (--max-connections)",
            args.max_connections
        ));
    }
    let mut cors_origins = Vec::new();
    for o in &args.cors_origins {
        let o = o.trim().trim_end_matches('/');
        let host = o
            .strip_prefix("http://")
            .or_else(|| o.strip_prefix("https://"));
        let valid = o == "*"
            || o == net::LOCALHOST
            || host.is_some_and(|h| {
                !h.is_empty() && !h.contains('/') && h.bytes().all(|b| b.is_ascii_graphic())
            });
        if !valid {
            return bad(format!(
                "--cors-origin {o:?}: expected `*`, `localhost` or an origin such as https://example.com"
            ));
        }
        cors_origins.push(o.to_string());
    }
    if let Some(dir) = &args.slot_save_path {
        // (made where missing, as llama-server does)
        std::fs::create_dir_all(dir)
            .map_err(|e| RuntimeError::Usage(format!("--slot-save-path {}: {e}", dir.display())))?;
    }
    let api_keys = api_keys(args.api_key.as_deref(), args.api_key_file.as_deref())?;
    let Ok(max_body) = usize::try_from(args.max_body) else {
        return bad(format!("--max-body {} is too large", args.max_body));
    };
    let max_reply = match usize::try_from(args.max_reply) {
        Ok(0) => return bad("--max-reply must be more than 0".into()),
        Ok(n) => n,
        Err(_) => return bad(format!("--max-reply {} is too large", args.max_reply)),
    };
    let Ok(file_storage) = usize::try_from(args.file_storage) else {
        return bad(format!("--file-storage {} is too large", args.file_storage));
    };
    let limits = NetLimits {
        max_connections: args.max_connections,
        max_client_connections,
        header_timeout: args.header_timeout,
        body_timeout: args.body_timeout,
        max_body,
        max_reply,
    };
    let Started {
        state,
        engine_thread,
        summary,
    } = start(
        &args.model_dir,
        &args.engine,
        Frontend {
            api_keys,
            metrics_public: args.metrics_public,
            slots: !args.no_slots,
            slot_save_path: args.slot_save_path.clone(),
            cors_origins,
            limits,
            file_storage,
            batch_concurrency: args.batch_concurrency.map(|n| n as usize),
        },
        "gdsrun serve",
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("gds-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        eprintln!("gdsrun serve: {summary}");
        println!("gdsrun serve: listening on http://{addr}");
        let _ = std::io::stdout().flush();
        let metrics = state.metrics.clone();
        net::serve(listener, router(state), limits, metrics, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
        anyhow::Ok(())
    })?;
    drop(rt);
    let _ = engine_thread.join();
    Ok(())
}

/// `GET /version` (vLLM's): this server's version.
async fn version() -> axum::response::Response {
    use axum::response::IntoResponse;
    axum::Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// `POST /invocations` (vLLM's, for SageMaker): the body goes to the endpoint its fields name,
/// in vLLM's order: `messages` chat, `prompt` completions, `input` embeddings, `query` with
/// `documents` rerank, `text_1` score; another body is a 400 saying so.
async fn invocations(
    axum::extract::State(st): axum::extract::State<Arc<ServerState>>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::extract::State;
    use axum::response::IntoResponse;
    let v: serde_json::Value = match api::parse(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let has = |k: &str| v.get(k).is_some_and(|x| !x.is_null());
    if has("messages") {
        stored::chat(State(st), body).await
    } else if has("prompt") {
        api::completions(State(st), body).await
    } else if has("input") {
        embeddings::embeddings(State(st), body).await
    } else if has("query") && has("documents") {
        rerank::rerank(State(st), body).await
    } else if has("text_1") {
        score::score(State(st), body).await
    } else {
        api::ApiError::bad(
            "/invocations takes a chat body (messages), a completion (prompt), embeddings (input), a rerank (query and documents) or a score (text_1 and text_2)",
        )
        .into_response()
    }
}

/// The path prefixes the OpenAI and Anthropic endpoints are served under: `/v1`, none (as
/// llama-server and vLLM serve them), and Docker Model Runner's `/engines/v1` and
/// `/engines/llama.cpp/v1`.
pub(crate) const API_PREFIXES: [&str; 4] = ["/v1", "", "/engines/v1", "/engines/llama.cpp/v1"];

/// The routes: the OpenAI endpoints under `/v1`, without it (as llama-server and vLLM serve
/// them) and under Docker Model Runner's `/engines/v1` and `/engines/llama.cpp/v1`, llama-server's and Ollama's own, inside the middleware (outermost
/// first): CORS, Ollama's and Anthropic's error shapes on their paths, OpenAI-shaped errors,
/// the API key, the request body.
fn router(state: Arc<ServerState>) -> axum::Router {
    use axum::middleware::from_fn_with_state;
    use axum::routing::{get, post};
    let mut r = axum::Router::new();
    // (`/engines/v1` and `/engines/llama.cpp/v1`: Docker Model Runner's OpenAI base URLs)
    for prefix in API_PREFIXES {
        r = r
            .route(&format!("{prefix}/completions"), post(api::completions))
            .route(
                &format!("{prefix}/chat/completions"),
                post(stored::chat).get(stored::list),
            )
            .route(
                &format!("{prefix}/chat/completions/{{id}}"),
                get(stored::retrieve)
                    .post(stored::update)
                    .delete(stored::delete),
            )
            .route(
                &format!("{prefix}/chat/completions/{{id}}/messages"),
                get(stored::messages),
            )
            .route(&format!("{prefix}/responses"), post(responses::responses))
            .route(
                &format!("{prefix}/responses/input_tokens"),
                post(responses::count_input_tokens),
            )
            .route(
                &format!("{prefix}/chat/completions/input_tokens"),
                post(api::chat_input_tokens),
            )
            .route(
                &format!("{prefix}/responses/{{id}}"),
                get(responses::get_response).delete(responses::delete_response),
            )
            .route(
                &format!("{prefix}/responses/{{id}}/input_items"),
                get(responses::input_items),
            )
            .route(
                &format!("{prefix}/responses/{{id}}/cancel"),
                post(responses::cancel_response),
            )
            .route(
                &format!("{prefix}/conversations"),
                post(conversations::create),
            )
            .route(
                &format!("{prefix}/conversations/{{id}}"),
                get(conversations::retrieve)
                    .post(conversations::update)
                    .delete(conversations::delete),
            )
            .route(
                &format!("{prefix}/conversations/{{id}}/items"),
                get(conversations::list_items).post(conversations::add_items),
            )
            .route(
                &format!("{prefix}/conversations/{{id}}/items/{{item}}"),
                get(conversations::get_item).delete(conversations::delete_item),
            )
            .route(&format!("{prefix}/messages"), post(anthropic::messages))
            .route(
                &format!("{prefix}/messages/count_tokens"),
                post(anthropic::count_tokens),
            )
            .route(
                &format!("{prefix}/messages/batches"),
                post(msgbatches::create).get(msgbatches::list),
            )
            .route(
                &format!("{prefix}/messages/batches/{{id}}"),
                get(msgbatches::retrieve).delete(msgbatches::delete),
            )
            .route(
                &format!("{prefix}/messages/batches/{{id}}/cancel"),
                post(msgbatches::cancel),
            )
            .route(
                &format!("{prefix}/messages/batches/{{id}}/results"),
                get(msgbatches::results),
            )
            .route(&format!("{prefix}/models"), get(api::models))
            .route(&format!("{prefix}/models/{{*id}}"), get(api::model))
            .route(
                &format!("{prefix}/embeddings"),
                // llama-server's `/embeddings` is its own endpoint; here OpenAI's, but with
                // `--pooling none` (which OpenAI's cannot answer) llama-server's
                if prefix.is_empty() {
                    post(embeddings::embeddings_bare)
                } else {
                    post(embeddings::embeddings)
                },
            )
            .route(
                &format!("{prefix}/files"),
                post(files::upload).get(files::list),
            )
            .route(
                &format!("{prefix}/files/{{id}}"),
                get(files::retrieve).delete(files::delete),
            )
            .route(
                &format!("{prefix}/files/{{id}}/content"),
                get(files::content),
            )
            .route(
                &format!("{prefix}/batches"),
                post(batches::create).get(batches::list),
            )
            .route(&format!("{prefix}/batches/{{id}}"), get(batches::retrieve))
            .route(
                &format!("{prefix}/batches/{{id}}/cancel"),
                post(batches::cancel),
            )
            .route(&format!("{prefix}/score"), post(score::score))
            .route(&format!("{prefix}/rerank"), post(rerank::rerank))
            .route(&format!("{prefix}/reranking"), post(rerank::rerank));
    }
    // llama-server's own endpoints (`/completions` stays OpenAI's, as vLLM serves it)
    r.route("/completion", post(native::completion))
        .route("/embedding", post(embeddings::embedding_native))
        .route("/infill", post(native::infill))
        // Cohere's API version 2 (vLLM serves it too)
        .route("/v2/rerank", post(rerank::rerank))
        .route("/props", get(native::props).post(native::post_props))
        .route("/slots", get(native::slots))
        .route("/slots/{id}", post(slots::action))
        .route("/apply-template", post(native::apply_template))
        .route("/v1/health", get(api::health))
        .route("/tokenize", post(tokenize::tokenize_handler))
        .route("/detokenize", post(tokenize::detokenize_handler))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        // vLLM's (and SageMaker's): the health probe, the version, one endpoint for all
        .route("/ping", get(api::health).post(api::health))
        .route("/version", get(version))
        .route("/invocations", post(invocations))
        // Ollama's API
        .route("/", get(ollama::root).head(ollama::root))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .route("/api/pull", post(ollama::pull))
        .route("/api/push", post(ollama::manage))
        .route("/api/create", post(ollama::manage))
        .route("/api/copy", post(ollama::manage))
        .route("/api/delete", axum::routing::delete(ollama::manage))
        .route(
            "/api/blobs/{digest}",
            post(ollama::manage).head(ollama::manage),
        )
        .fallback(api::not_found)
        // `read_body` enforces --max-body; axum's own 2 MiB default would cut it short
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(from_fn_with_state(state.clone(), net::read_body))
        .layer(from_fn_with_state(state.clone(), net::require_key))
        .layer(axum::middleware::from_fn(net::json_errors))
        .layer(axum::middleware::from_fn(anthropic::anthropic_errors))
        .layer(axum::middleware::from_fn(ollama::ollama_errors))
        .layer(from_fn_with_state(state.clone(), net::cors))
        .with_state(state)
}

/// A comma-separated list of names (`--alias`, `--tags`): trimmed, the empty ones left out,
/// sorted, each once.
fn name_list(v: Option<&str>) -> Vec<String> {
    let mut names: Vec<String> = v
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        engine: EngineArgs,
    }

    #[test]
    fn the_engine_flags_take_an_isa_cap() {
        let c = Cmd::try_parse_from(["serve", "--isa", "avx2"]).unwrap();
        assert_eq!(c.engine.isa, Some(gds_runtime::Isa::Avx2));
        assert_eq!(Cmd::try_parse_from(["serve"]).unwrap().engine.isa, None);
        let e = Cmd::try_parse_from(["serve", "--isa", "sse2"])
            .err()
            .unwrap();
        assert!(e.to_string().contains("expected scalar"), "{e}");
    }
}
