//! Flags, parsed by clap into raw arguments; `gds_runtime::Plan` validates them.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Run GdsLLM models on the CPU, or on CUDA GPUs in a build with the `cuda` feature: one-shot
/// prompts, interactive chat, an HTTP server, batch jobs, perplexity and benchmarks.
#[derive(Parser, Debug)]
#[command(name = "gdsrun", version, long_about = None, after_help = "`gdsrun MODEL ...` is short for `gdsrun run MODEL ...`. MODEL is a model directory, a registry reference (REGISTRY/REPO:TAG, pulled into $GDSLLM_HOME/store on first use; Docker Model Runner's and Ollama's models too), a .gguf file (a split one by its first shard) or a Hugging Face checkpoint directory (converted there on first use), or a model another program has fetched: hf:ORG/NAME[:QUANT] (the Hugging Face cache) or ollama:NAME[:TAG] (Ollama's directory).")]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
    /// When MODEL is a registry reference: talk plain HTTP to the registry (a local one).
    #[arg(long, global = true)]
    pub plain_http: bool,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate from a prompt, or chat interactively (the default command; `gdsrun chat
    /// MODEL` is the same, for the interactive chat without `--prompt`).
    #[command(visible_alias = "chat")]
    Run(Box<RunArgs>),
    /// Perplexity of a text file, computed like llama.cpp's llama-perplexity.
    Perplexity(PerplexityArgs),
    /// Importance matrix of a text file for quantization (`gdsconv convert --imatrix`),
    /// computed like llama.cpp's llama-imatrix and written in its GGUF format.
    Imatrix(ImatrixArgs),
    /// Prompt-processing and generation speed, like llama-bench.
    Bench(BenchArgs),
    /// HTTP server compatible with the OpenAI, Anthropic and Ollama APIs and llama-server's own
    /// (completions, chat, responses, messages, embeddings, streaming).
    Serve(gds_serve::ServeArgs),
    /// Offline batch job: requests in the OpenAI Batch API's JSONL format in, results out,
    /// run at full batch by the server's engine; resumable.
    Batch(gds_serve::batch::BatchArgs),
    /// What this machine offers (CPU, memory, disk, GPU) and what a run would choose.
    Doctor(DoctorArgs),
}

/// Settings shared by every subcommand.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// The model ([`MODEL_HELP`]).
    #[arg(help = gds_serve::MODEL_HELP)]
    pub model_dir: PathBuf,
    /// Worker threads (default: physical cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Prompt tokens per forward pass.
    #[arg(long, short = 'b')]
    pub batch: Option<usize>,
    /// KV cache type: f16 (the default, on the CPU and the GPU: half the memory; perplexity
    /// within 0.001 % of f32's with --activations f32, 0.08-0.30 % apart with the default q8
    /// activations, rounding noise either way) or f32 (exact).
    #[arg(long, value_parser = ["f32", "f16"])]
    pub kv_type: Option<String>,
    /// Compute backend: auto, cpu or cuda.
    #[arg(long, value_parser = ["auto", "cpu", "cuda"])]
    pub backend: Option<String>,
    /// How weights are read: auto, mmap (map the whole model), load (read the whole model
    /// into memory backed by huge pages: auto's choice where the model fits and the kernel
    /// has transparent huge pages), direct (O_DIRECT reads, layers streamed within
    /// --mem-budget) or gds (GPUDirect Storage, --backend cuda).
    #[arg(long, value_parser = ["auto", "mmap", "load", "direct", "gds"])]
    pub io: Option<String>,
    /// Most bytes of weights held in memory, streaming buffers included (e.g. 200MB, 1.5GiB).
    #[arg(long, value_parser = parse_size)]
    pub mem_budget: Option<u64>,
    /// Most bytes of VRAM the CUDA backend uses (weights, KV cache, scratch, streaming
    /// slots; default 90 % of the device). Layers that do not fit stream every token.
    #[arg(long, value_parser = parse_size)]
    pub vram_budget: Option<u64>,
    /// Activations of the matrix products: q8 (8-bit integer dot products, fast) or f32
    /// (weights dequantized row by row: a float reference's arithmetic, slower).
    #[arg(long, value_parser = ["q8", "f32"])]
    pub activations: Option<String>,
    /// Trust the layer files: skip checking their BLAKE3 content hashes against the
    /// manifest before first use (the plan and the metrics say so).
    #[arg(long)]
    pub no_verify: bool,
    /// Cap the CPU kernels' instruction set, to compare kernels on one machine: scalar,
    /// avx2, avxvnni or avx512vnni (default: the best this CPU has; `GDS_ISA` is an alias).
    /// A set this CPU lacks falls to the next narrower one; the plan records the result.
    #[arg(long, value_parser = gds_runtime::plan::parse_isa)]
    pub isa: Option<gds_runtime::Isa>,
    /// On the GPU, passes of this many tokens or more go through GEMM on dequantized tiles,
    /// shorter ones through the matvec kernels (default 32 with `--activations q8`, 8 with
    /// f32; `GDS_GEMM_MIN_TOKENS` is an alias).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub gemm_min_tokens: Option<u64>,
    /// On the GPU, replay short passes (decode steps) from CUDA graphs where every layer is
    /// resident (on, the default) or launch every kernel each time (off; `GDS_CUDA_GRAPHS`
    /// is an alias).
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    pub cuda_graphs: Option<String>,
    /// On the GPU, what the GEMMs of long passes round their inputs to: f16 (tensor cores,
    /// the default with `--activations q8`), tf32, or f32 (the default with `--activations
    /// f32`; `GDS_GEMM_TYPE` is an alias).
    #[arg(long, value_name = "f16|tf32|f32", value_parser = gds_runtime::plan::parse_gemm_type)]
    pub gemm_type: Option<gds_runtime::GemmType>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    gds_runtime::ioplan::parse_size(s)
}

/// `gdsrun run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Prompt; without it, chat interactively (one message per line of stdin).
    #[arg(long, short = 'p')]
    pub prompt: Option<String>,
    /// System prompt (chat mode).
    #[arg(long)]
    pub system: Option<String>,
    /// A Jinja chat template that replaces the model's (for a model whose template is missing
    /// or wrong; checked as a model's template is).
    #[arg(long, value_name = "FILE", conflicts_with = "chat_template")]
    pub chat_template_file: Option<PathBuf>,
    /// A built-in chat template by name (chatml, llama2, llama2-sys, llama3, mistral-v7,
    /// phi3, phi4, zephyr, gemma, vicuna, deepseek, command-r: llama.cpp's formats), or a
    /// Jinja template itself, replacing the model's.
    #[arg(long, value_name = "NAME|JINJA")]
    pub chat_template: Option<String>,
    /// Plain completion: do not apply the chat template.
    #[arg(long)]
    pub raw: bool,
    /// With --raw: special-token texts in the prompt (e.g. `<|im_end|>`) become their
    /// tokens. Without it every prompt is plain text; chat messages always are.
    #[arg(long)]
    pub parse_special: bool,
    #[command(flatten)]
    pub sampling: gds_serve::SamplingArgs,
    /// Most tokens per reply (default: until the context is full).
    #[arg(long, short = 'n')]
    pub max_tokens: Option<usize>,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// With --json: each generated token's log-probability and this many most likely
    /// alternatives (0..=20), from the model's logits at temperature 1 before sampling.
    #[arg(long, value_name = "N", requires = "json", value_parser = clap::value_parser!(u8).range(0..=20))]
    pub logprobs: Option<u8>,
    /// Hold every reply to this JSON schema (a file; `{"type": "object"}` for any object):
    /// constrained decoding, so the reply always parses and validates.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["grammar", "regex"])]
    pub json_schema: Option<PathBuf>,
    /// Hold every reply to this grammar (a file in llguidance's Lark syntax, or llama.cpp's GBNF:
    /// told apart by GBNF's `::=`).
    #[arg(long, value_name = "FILE", conflicts_with = "regex")]
    pub grammar: Option<PathBuf>,
    /// Hold every reply to this regular expression (the whole reply matches it).
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
    /// Speculative decoding: `ngram` guesses the next tokens from earlier text (prompt
    /// lookup), `layers:N` from the model's own first N blocks and output head (kept in
    /// memory when layers stream; CPU backend), `model` asks a second model (--draft-model);
    /// the guesses are checked all in one pass over the weights, and the output is the same
    /// as without them.
    #[arg(long, value_name = "DRAFT", value_parser = parse_draft)]
    pub draft: Option<String>,
    /// A smaller (or more quantized) model with the same vocabulary that guesses the next
    /// tokens, held in memory (implies --draft model).
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<PathBuf>,
    /// Most tokens guessed per pass [default: 10].
    #[arg(long, value_name = "K")]
    pub draft_max: Option<usize>,
    /// With every weight in memory, guess only while guessing is measured to pay (on, the
    /// default) or on every pass (off: pass counts then do not depend on the wall clock).
    /// `GDS_DRAFT_GATE=off` is an alias.
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    pub draft_gate: Option<String>,
    /// Stop a reply after this many joules (needs RAPL counters, or NVML's with --backend cuda).
    #[arg(long)]
    pub max_joules: Option<f64>,
    /// Context length (default: min(model's, 4096)).
    #[arg(long, short = 'c')]
    pub ctx: Option<usize>,
    /// Print one JSON object per reply instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Print the run plan as JSON and exit.
    #[arg(long)]
    pub plan: bool,
}

/// `gdsrun perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Text file to score.
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, short = 'c', default_value_t = 512)]
    pub ctx: usize,
    /// Score only the first N chunks (llama-perplexity's --chunks; all of them by default).
    /// A --kl-divergence run must use the --chunks its base used.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub chunks: Option<u64>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Store this (base) model's log-probabilities at every scored position in FILE, for a
    /// later `--kl-divergence FILE` run of a quantized model (llama-perplexity's
    /// --kl-divergence-base). Rows are quantized to 16 bits per vocabulary entry
    /// (2 bytes × vocabulary × scored tokens); the file appears only when complete.
    #[arg(long, value_name = "FILE", conflicts_with = "kl_divergence")]
    pub save_logits: Option<PathBuf>,
    /// Compare this model with the base model's FILE (from --save-logits, same text, --ctx
    /// and tokenizer): mean, median, p99 and max KL(base ‖ this), top-1 agreement, and the
    /// ratio of the perplexities (llama-perplexity's --kl-divergence).
    #[arg(long, value_name = "FILE")]
    pub kl_divergence: Option<PathBuf>,
}

/// `gdsrun imatrix`.
#[derive(Args, Debug)]
pub struct ImatrixArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Calibration text file.
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Output file (GGUF imatrix, as llama-imatrix writes); it appears only when complete.
    #[arg(long, short = 'o', default_value = "imatrix.gguf")]
    pub output: PathBuf,
    /// Tokens per chunk (at least 16; each chunk is one pass, so --batch does not apply).
    #[arg(long, short = 'c', default_value_t = 512)]
    pub ctx: usize,
    /// At most this many chunks, at least 1 (default: every whole chunk of the text).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Also collect the output head's input (llama-imatrix's --process-output): output.weight, or token_embd.weight when the embedding is tied. Off by default, as in llama-imatrix.
    #[arg(long)]
    pub process_output: bool,
    /// Print a JSON summary.
    #[arg(long)]
    pub json: bool,
}

/// `gdsrun bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Prompt tokens of the pp tests, a comma list (0 skips them).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generated tokens of the tg tests, a comma list (0 skips them).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Depths, a comma list: each test runs after this many tokens already in the KV cache
    /// (llama-bench's `-d`; the fill is not timed).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Repetitions of each test (1 to 10000).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Print llama-bench style JSON.
    #[arg(long)]
    pub json: bool,
}

/// `gdsrun doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The model to check (filesystem, O_DIRECT, read bandwidth, plan): a directory, a registry
    /// reference or a .gguf file, as for `run`.
    pub model_dir: Option<PathBuf>,
    /// Plan with this memory budget (e.g. 200MB).
    #[arg(long, value_parser = parse_size)]
    pub mem_budget: Option<u64>,
    /// Plan the GPU side with this VRAM budget (e.g. 2GiB). Without a usable GPU, shows
    /// what `--backend cuda` would keep resident and stream on a device of that size.
    #[arg(long, value_parser = parse_size)]
    pub vram_budget: Option<u64>,
    /// Plan with this I/O mode.
    #[arg(long, value_parser = ["auto", "mmap", "load", "direct", "gds"])]
    pub io: Option<String>,
    /// Plan with this backend.
    #[arg(long, value_parser = ["auto", "cpu", "cuda"])]
    pub backend: Option<String>,
    /// Plan with this KV cache type (f16, the default, or f32).
    #[arg(long, value_parser = ["f32", "f16"])]
    pub kv_type: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `--draft`: none, ngram, model or layers:N (N checked against the model by the plan).
fn parse_draft(s: &str) -> Result<String, String> {
    match s {
        "none" | "ngram" | "model" => Ok(s.to_string()),
        _ if s
            .strip_prefix("layers:")
            .is_some_and(|n| n.parse::<usize>().is_ok()) =>
        {
            Ok(s.to_string())
        }
        _ => Err("expected none, ngram, layers:N (a number of blocks) or model".into()),
    }
}
