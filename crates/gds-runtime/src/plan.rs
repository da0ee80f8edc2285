//! The run plan: every decision (backend, I/O mode, threads, context, batch, sampler,
//! limits, mode) made once from the user's settings and the model's manifest, then frozen.
//! It serializes to JSON (`gdsrun --plan`) so a run can be inspected and reproduced.

use crate::config::Config;
use crate::error::{Result, RuntimeError};
use crate::kv::{KvCache, KvDtype};
/// [`crate::model_dir::parse_manifest`], also by this path (the front ends' and tests').
pub use crate::model_dir::parse_manifest;
use crate::model_dir::{tokenizer_config, with_dir};
use crate::sampler::SamplerConfig;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::backend::Backend;

/// The matrix products' activations. (Serialized as `q8` / `f32`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// Quantized to 8 bits per row, integer dot products (fast).
    Q8,
    /// Weights dequantized row by row against f32 activations (a float reference's
    /// arithmetic).
    F32,
}

/// Default upper bound of the context when the user does not choose one.
pub const DEFAULT_MAX_CTX: usize = 4096;
/// How far past its trained context a benchmark may run a model
/// ([`PlanOptions::ctx_past_training`]), as a multiple of that context.
pub const CTX_PAST_TRAINING_MAX: usize = 4;
/// Default number of prompt tokens per forward pass.
pub const DEFAULT_BATCH: usize = 256;

/// What the user asked for; `None` means "choose for me".
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// Model directory.
    pub model_dir: PathBuf,
    /// Context length.
    pub ctx: Option<usize>,
    /// Accept a context longer than the model was trained for, up to
    /// [`CTX_PAST_TRAINING_MAX`] times it (positions past it are out of distribution): for
    /// speed measurements at depth, as llama-bench allows.
    pub ctx_past_training: bool,
    /// Worker threads.
    pub threads: Option<usize>,
    /// Prompt tokens per forward pass.
    pub batch: Option<usize>,
    /// KV cache element type.
    pub kv_dtype: Option<KvDtype>,
    /// Sampling temperature.
    pub temp: Option<f32>,
    /// Top-k.
    pub top_k: Option<usize>,
    /// Top-p.
    pub top_p: Option<f32>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// Repeat penalty.
    pub repeat_penalty: Option<f32>,
    /// Repeat penalty window.
    pub repeat_last_n: Option<usize>,
    /// OpenAI's frequency penalty (over the generated tokens).
    pub frequency_penalty: Option<f32>,
    /// OpenAI's presence penalty (over the generated tokens).
    pub presence_penalty: Option<f32>,
    /// llama.cpp's other samplers (Mirostat, DRY, XTC, typical, top-n-sigma, dynamic
    /// temperature, adaptive-p) and the chain's order; off by default.
    pub extra_sampling: crate::sampler::ExtraSamplers,
    /// Which of `extra_sampling`'s settings the user gave (the model's recommended settings,
    /// [`crate::recommended`], fill the others).
    pub extra_given: crate::recommended::ExtraGiven,
    /// Where the model's recommended sampling settings come from (`--generation-config`).
    pub generation_config: crate::recommended::Source,
    /// Random seed.
    pub seed: Option<u64>,
    /// Most tokens to generate per reply.
    pub max_tokens: Option<usize>,
    /// The user asked for no limit (`gdsrun serve -n -1`): a model's recommended
    /// `max_new_tokens` is not taken either.
    pub unlimited_tokens: bool,
    /// Strings that end generation.
    pub stop: Vec<String>,
    /// Energy budget per reply, joules.
    pub max_joules: Option<f64>,
    /// Raw completion instead of the chat template.
    pub raw: bool,
    /// Raw mode: special-token texts in the prompt (`<|im_end|>`) become their tokens
    /// instead of plain text.
    pub parse_special: bool,
    /// System prompt for chat mode.
    pub system: Option<String>,
    /// `--chat-template-file`: a Jinja chat template that replaces the model's (bounded and
    /// checked as a model's template is).
    pub chat_template_file: Option<PathBuf>,
    /// `--chat-template`: a built-in template's name (`chatml`, `llama3`, ...; see
    /// [`gds_format::chat_template::BUILTIN`]) or a Jinja template itself, replacing the
    /// model's (checked as a model's template is).
    pub chat_template: Option<String>,
    /// Compute backend: `auto`, `cpu` or `cuda` (`None` = `auto`).
    pub backend: Option<String>,
    /// I/O backend: `auto`, `mmap` or `direct` (`None` = `auto`).
    pub io: Option<String>,
    /// Bytes of weights allowed in memory, streaming buffers included (`None`: unbounded).
    pub mem_budget: Option<u64>,
    /// Bytes of VRAM the CUDA backend may use (`None`: 90 % of the device).
    pub vram_budget: Option<u64>,
    /// Activation precision of the matrix products: `q8` (default) or `f32`.
    pub activations: Option<String>,
    /// Trust the layer files instead of checking their content hashes (`--no-verify`).
    pub no_verify: bool,
    /// The grammar every reply follows (`--json-schema`, `--grammar`, `--regex`).
    pub grammar: Option<crate::constraint::Grammar>,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Speculative decoding's draft: `none` (default), `ngram` (prompt lookup), `layers:N`
    /// (the model's first N blocks and its output head) or `model` (a second model,
    /// [`PlanOptions::draft_model`]).
    pub draft: Option<String>,
    /// The draft model's directory (implies `draft: model`).
    pub draft_model: Option<PathBuf>,
    /// Most tokens the draft guesses per pass (default [`DEFAULT_DRAFT_MAX`]).
    pub draft_max: Option<usize>,
    /// With every weight in memory, measure whether guessing pays and guess only while it
    /// does (`crate::draft::Gate`); `Some(false)` (`--draft-gate off`): every pass guesses.
    /// `None`: on, unless the environment says `GDS_DRAFT_GATE=off` (an alias, read when the
    /// plan is made).
    pub draft_gate: Option<bool>,
    /// Cap on the CPU kernels' instruction set (`--isa`; `None`: `GDS_ISA` from the
    /// environment, an alias read when the plan is made, else the best this CPU has).
    pub isa: Option<gds_kernels::Isa>,
    /// On the GPU, passes of this many tokens or more go through GEMM on dequantized tiles
    /// (`--gemm-min-tokens`; `None`: `GDS_GEMM_MIN_TOKENS` from the environment, an alias read
    /// when the plan is made, else [`gds_cuda::forward::GEMM_MIN_TOKENS_Q8`] with 8-bit
    /// activations and [`gds_cuda::forward::GEMM_MIN_TOKENS`] with f32 ones).
    pub gemm_min_tokens: Option<usize>,
    /// On the GPU, capture the passes that can be replayed as CUDA graphs (`--cuda-graphs`;
    /// `None`: `GDS_CUDA_GRAPHS` from the environment, else on).
    pub cuda_graphs: Option<bool>,
    /// On the GPU, what the GEMMs round their inputs to: `f16`, `tf32` or `f32`
    /// (`--gemm-type`; `None`: `GDS_GEMM_TYPE` from the environment, else f16 with 8-bit
    /// activations and f32 with `--activations f32`).
    pub gemm_type: Option<gds_cuda::forward::GemmType>,
}

/// Most bytes of a `--chat-template-file` (model templates are a few KB; the longest known,
/// with tool-calling logic, under 64 KB).
pub const MAX_CHAT_TEMPLATE_BYTES: u64 = 1 << 20;

pub use gds_io::open_user_file;

/// [`open_user_file`], read whole as UTF-8 text.
pub fn read_user_file(p: &Path) -> std::io::Result<String> {
    std::io::read_to_string(open_user_file(p)?)
}

/// Reads a `--chat-template-file`: bounded, UTF-8, and within
/// [`gds_format::chat_template`]'s bounds and render limits; each refusal a usage error naming
/// the file.
fn read_chat_template(p: &Path) -> Result<String> {
    use std::io::Read;
    let refuse =
        |why: String| RuntimeError::Usage(format!("--chat-template-file {}: {why}", p.display()));
    let f = open_user_file(p).map_err(|e| refuse(e.to_string()))?;
    let mut bytes = Vec::new();
    f.take(MAX_CHAT_TEMPLATE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| refuse(e.to_string()))?;
    if bytes.len() as u64 > MAX_CHAT_TEMPLATE_BYTES {
        return Err(refuse(format!("more than {MAX_CHAT_TEMPLATE_BYTES} bytes")));
    }
    let src = String::from_utf8(bytes).map_err(|_| refuse("not UTF-8".into()))?;
    gds_format::chat_template::check(&src)
        .map_err(|e| refuse(format!("the chat template is refused: {e}")))?;
    Ok(src)
}

/// `--chat-template`'s template ([`chat_template_source`]).
fn named_chat_template(t: &str) -> Result<&str> {
    chat_template_source(t).map_err(|why| RuntimeError::Usage(format!("--chat-template: {why}")))
}

/// A chat template given by name or as text (`--chat-template`, a request's `chat_template`):
/// a built-in's source by name, or the text itself where it is Jinja (it holds `{{` or `{%`),
/// at most [`MAX_CHAT_TEMPLATE_BYTES`] and checked as a model's template is; otherwise why
/// not.
pub fn chat_template_source(t: &str) -> std::result::Result<&str, String> {
    if let Some(src) = gds_format::chat_template::builtin(t) {
        return Ok(src);
    }
    if !(t.contains("{{") || t.contains("{%")) {
        let names: Vec<&str> = gds_format::chat_template::BUILTIN
            .iter()
            .map(|(n, _)| *n)
            .collect();
        return Err(format!(
            "not a built-in template ({}) nor a Jinja template (it holds no {{{{ or {{%)",
            names.join(", ")
        ));
    }
    if t.len() > MAX_CHAT_TEMPLATE_BYTES as usize {
        return Err(format!("more than {MAX_CHAT_TEMPLATE_BYTES} bytes"));
    }
    gds_format::chat_template::check(t)
        .map_err(|e| format!("the chat template is refused: {e}"))?;
    Ok(t)
}

/// `GDS_DRAFT_GATE`, the alias of `--draft-gate`: `Some(false)` for `off`, `Some(true)` for
/// `on`, `None` when unset or empty; any other value is a usage error naming it.
pub fn draft_gate_from_env() -> Result<Option<bool>> {
    parse_draft_gate_env(std::env::var("GDS_DRAFT_GATE").ok().as_deref())
}

fn parse_draft_gate_env(v: Option<&str>) -> Result<Option<bool>> {
    parse_on_off_env("GDS_DRAFT_GATE", "--draft-gate", v)
}

/// `GDS_CUDA_GRAPHS`, the alias of `--cuda-graphs`: read as [`draft_gate_from_env`] reads
/// its variable.
pub fn cuda_graphs_from_env() -> Result<Option<bool>> {
    parse_on_off_env(
        "GDS_CUDA_GRAPHS",
        "--cuda-graphs",
        std::env::var("GDS_CUDA_GRAPHS").ok().as_deref(),
    )
}

/// An on/off alias `var` of the flag `flag`: `Some(true)` for `on`, `Some(false)` for
/// `off`, `None` when unset or empty; any other value is a usage error naming both.
fn parse_on_off_env(var: &str, flag: &str, v: Option<&str>) -> Result<Option<bool>> {
    match v {
        None | Some("") => Ok(None),
        Some("on") => Ok(Some(true)),
        Some("off") => Ok(Some(false)),
        Some(v) => Err(RuntimeError::Usage(format!(
            "{var}={v:?} (the alias of {flag}): expected on or off"
        ))),
    }
}

/// `GDS_GEMM_TYPE`, the alias of `--gemm-type`: `None` when unset or empty; a name that is
/// no GEMM type is a usage error naming it.
pub fn gemm_type_from_env() -> Result<Option<gds_cuda::forward::GemmType>> {
    parse_gemm_type_env(std::env::var("GDS_GEMM_TYPE").ok().as_deref())
}

fn parse_gemm_type_env(v: Option<&str>) -> Result<Option<gds_cuda::forward::GemmType>> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(t) => parse_gemm_type(t).map(Some).map_err(|e| {
            RuntimeError::Usage(format!(
                "GDS_GEMM_TYPE={t:?} (the alias of --gemm-type): {e}"
            ))
        }),
    }
}

/// `--gemm-type`'s value parser.
pub fn parse_gemm_type(s: &str) -> std::result::Result<gds_cuda::forward::GemmType, String> {
    gds_cuda::forward::GemmType::parse(s).ok_or_else(|| "expected f16, tf32 or f32".to_string())
}

fn gemm_type_name<S: serde::Serializer>(
    t: &gds_cuda::forward::GemmType,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(t.name())
}

/// `GDS_GEMM_MIN_TOKENS`, the alias of `--gemm-min-tokens`: `None` when unset or empty; a
/// value that is not a positive integer is a usage error naming it.
pub fn gemm_min_tokens_from_env() -> Result<Option<usize>> {
    parse_gemm_min_tokens_env(std::env::var("GDS_GEMM_MIN_TOKENS").ok().as_deref())
}

fn parse_gemm_min_tokens_env(v: Option<&str>) -> Result<Option<usize>> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(t) => match t.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(RuntimeError::Usage(format!(
                "GDS_GEMM_MIN_TOKENS={t:?} (the alias of --gemm-min-tokens): expected a positive integer"
            ))),
        },
    }
}

/// `GDS_ISA`, the alias of `--isa`: the cap it names, `None` when unset or empty; a name
/// that is no instruction set is a usage error naming it.
pub fn isa_from_env() -> Result<Option<gds_kernels::Isa>> {
    parse_isa_env(std::env::var("GDS_ISA").ok().as_deref())
}

fn parse_isa_env(v: Option<&str>) -> Result<Option<gds_kernels::Isa>> {
    match v {
        None | Some("") => Ok(None),
        Some(v) => parse_isa(v)
            .map(Some)
            .map_err(|e| RuntimeError::Usage(format!("GDS_ISA={v:?} (the alias of --isa): {e}"))),
    }
}

/// `--isa`: an instruction set's name as [`gds_kernels::Isa::name`] writes it.
pub fn parse_isa(s: &str) -> std::result::Result<gds_kernels::Isa, String> {
    gds_kernels::Isa::from_name(s)
        .ok_or_else(|| "expected scalar, avx2, avxvnni or avx512vnni".to_string())
}

fn isa_name<S: serde::Serializer>(
    isa: &gds_kernels::Isa,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(isa.name())
}

/// Tokens a draft guesses per pass unless `--draft-max` says otherwise.
pub const DEFAULT_DRAFT_MAX: usize = 10;

/// Which draft guesses. (Serialized as `ngram` / `layers` / `model`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftKind {
    /// Prompt lookup ([`ngram`](crate::draft::ngram)).
    Ngram,
    /// The model's first blocks and its output head: self-speculation
    /// ([`self_draft`](crate::draft::self_draft)).
    Layers,
    /// A second model's greedy guesses ([`ModelDraft`](crate::draft::ModelDraft)).
    Model,
}

impl DraftKind {
    /// The lower-case name (`ngram`, `layers`, `model`), as the plan's JSON writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            DraftKind::Ngram => "ngram",
            DraftKind::Layers => "layers",
            DraftKind::Model => "model",
        }
    }
}

impl std::fmt::Display for DraftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the plan says about speculative decoding.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DraftPlan {
    /// The draft.
    pub kind: DraftKind,
    /// The draft model's directory (`model`).
    pub model_dir: Option<PathBuf>,
    /// The draft model's own plan (`model`), made with the target's options when the
    /// target was planned (the engine opens it as it is).
    #[serde(skip)]
    pub model_plan: Option<Box<Plan>>,
    /// Blocks the self-speculation draft runs (`layers`).
    pub layers: Option<usize>,
    /// Most tokens guessed per pass (the pass evaluates one more).
    pub max_tokens: usize,
    /// With every weight in memory, measure whether guessing pays and guess only while it
    /// does ([`Gate`](crate::draft::Gate)); `false` (`--draft-gate off`): every pass guesses.
    pub gate: bool,
    /// Longest suffix looked up.
    pub ngram_max: usize,
    /// Shortest suffix looked up.
    pub ngram_min: usize,
}

/// Longest n-gram the lookup tries first.
pub const NGRAM_MAX: usize = 4;
/// Shortest n-gram it falls back to.
pub const NGRAM_MIN: usize = 2;

/// Per-dtype totals of the weights.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DtypeSummary {
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes.
    pub bytes: u64,
    /// Elements (the model's parameters of this type).
    pub elements: u64,
}

/// When generation stops, besides end-of-generation tokens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Limits {
    /// Most tokens per reply (`None`: until the context is full).
    pub max_tokens: Option<usize>,
    /// Strings that end a reply (not included in the output).
    pub stop: Vec<String>,
    /// Energy budget per reply, joules (`None`: no budget).
    pub max_joules: Option<f64>,
}

/// How prompts are turned into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Rendered through the model's chat template, turn by turn.
    Chat,
    /// Tokenized as is (plain completion).
    Raw,
}

/// The frozen decisions of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Model directory.
    pub model_dir: PathBuf,
    /// `general.name`, when the manifest has one.
    pub model_name: Option<String>,
    /// Architecture (`general.architecture`).
    pub arch: String,
    /// Compute backend.
    pub backend: crate::backend::Backend,
    /// Why that backend.
    pub backend_reason: String,
    /// Worker threads.
    pub threads: usize,
    /// I/O backend (`mmap`, `direct` or `buffered`).
    pub io: String,
    /// Residency and streaming decisions in host memory (CPU backend).
    pub io_plan: crate::ioplan::IoPlan,
    /// The CUDA backend's load path and VRAM residency (`None` on the CPU backend).
    pub gpu: Option<crate::gpuplan::GpuPlan>,
    /// Activations of the matrix products: `q8` (8-bit, integer dot products) or `f32`.
    pub activations: Activations,
    /// The CPU kernels' instruction set (`scalar`, `avx2`, `avxvnni`, `avx512vnni`): the
    /// best this CPU has at or below `--isa` (or `GDS_ISA`). It is process-wide: making the
    /// plan sets it ([`gds_kernels::set_isa_cap`]).
    #[serde(serialize_with = "isa_name")]
    pub isa: gds_kernels::Isa,
    /// Whether the block-quantized matrices read into memory (`load`, `direct`'s
    /// resident layers; not a mapping, not streamed layers, not the token embedding) are
    /// held with their rows interleaved sixteen at a time, the layout this ISA's kernels
    /// read without repacking (8-bit activations, any x86-64 ISA: sixteen rows a vector on
    /// AVX-512, two halves of eight on AVX2; every block-quantized type, Q8_0 only on plain
    /// AVX2; `GDS_INTERLEAVE=0` turns it off).
    pub interleave: bool,
    /// The GPU's matvec/GEMM crossover: passes of this many tokens or more go through GEMM.
    pub gemm_min_tokens: usize,
    /// The GPU replays short passes (decode steps) from CUDA graphs where every layer is
    /// resident and the model has no experts (`--cuda-graphs`).
    pub cuda_graphs: bool,
    /// What the GPU's GEMMs round their inputs to (`f16`, `tf32`, `f32`; `--gemm-type`).
    #[serde(serialize_with = "gemm_type_name")]
    pub gemm_type: gds_cuda::forward::GemmType,
    /// Weight bytes and tensor counts by dtype.
    pub weight_dtypes: BTreeMap<String, DtypeSummary>,
    /// Context length of this run.
    pub ctx: usize,
    /// Context length the model was trained for.
    pub model_ctx: usize,
    /// Prompt tokens per forward pass.
    pub batch: usize,
    /// KV cache element type.
    pub kv_dtype: KvDtype,
    /// KV cache size, bytes.
    pub kv_bytes: usize,
    /// What the KV cache would take with every layer at the full context: more than
    /// `kv_bytes` where sliding-window layers keep a ring.
    pub kv_full_context_bytes: usize,
    /// Positions each sliding-window layer keeps (CPU: the window, one pass and a block of
    /// slack; CUDA: the window and one pass); `None`: every layer keeps the whole context.
    pub kv_window_ring_positions: Option<usize>,
    /// Sampler settings (the seed is fixed here even when the user gave none).
    pub sampler: SamplerConfig,
    /// What the model's files recommend and what of it was taken ([`crate::recommended`]);
    /// `None`: they recommend nothing (or `--generation-config none`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recommended_sampling: Option<crate::recommended::Report>,
    /// Stop conditions.
    pub limits: Limits,
    /// The grammar every reply follows (constrained decoding), if any.
    pub grammar: Option<crate::constraint::Grammar>,
    /// Log-probabilities reported per generated token: this many alternatives.
    pub logprobs: Option<usize>,
    /// Speculative decoding (`None`: one token per pass).
    pub draft: Option<DraftPlan>,
    /// Chat or raw.
    pub mode: Mode,
    /// Where the chat template comes from: `tokenizer_config.json`, or the family's default
    /// in `formats/<arch>.json` when the model's files carry none; `None`: no template.
    pub chat_template: Option<String>,
    /// The text of `--chat-template-file`, which replaces the model's template (read and
    /// checked when the plan is made).
    #[serde(skip)]
    pub chat_template_override: Option<String>,
    /// Raw mode: special-token texts in the prompt become their tokens (otherwise every
    /// prompt and message is plain text; only the chat template writes special tokens).
    pub parse_special: bool,
    /// System prompt (chat mode).
    pub system: Option<String>,
    /// Model hyperparameters.
    pub model: Config,
}

/// Physical cores this process may run on: distinct (package, core) pairs of the CPUs in
/// its affinity mask, from /sys; falls back to the logical CPU count.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut cores = std::collections::BTreeSet::new();
    let Ok(entries) = std::fs::read_dir("/sys/devices/system/cpu") else {
        return logical;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str().and_then(|n| n.strip_prefix("cpu")) else {
            continue;
        };
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let topo = e.path().join("topology");
        let read = |f: &str| {
            std::fs::read_to_string(topo.join(f))
                .ok()
                .map(|s| s.trim().to_string())
        };
        if let (Some(pkg), Some(core)) = (read("physical_package_id"), read("core_id")) {
            cores.insert((pkg, core));
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

/// Checks that a draft model speaks the target's vocabulary: the same `tokenizer.json`
/// (by the manifests' hashes), or failing that the same token-to-id map.
pub fn check_same_vocabulary(target: &std::path::Path, draft: &std::path::Path) -> Result<()> {
    let hash_of = |dir: &std::path::Path| -> Result<Option<[u8; 32]>> {
        let bytes = gds_io::read_manifest(dir)?;
        let m = parse_manifest(dir, &bytes)?;
        Ok(m.find_file("tokenizer.json").map(|f| f.content_hash))
    };
    if let (Some(a), Some(b)) = (hash_of(target)?, hash_of(draft)?) {
        if a == b {
            return Ok(());
        }
    }
    let vocab = |dir: &std::path::Path| -> Result<std::collections::HashMap<String, u32>> {
        let path = dir.join("tokenizer.json");
        // through the model-file reader: no link, FIFO or device, length and hash checked
        let bytes = gds_io::read_manifest(dir)?;
        let m = parse_manifest(dir, &bytes)?;
        let tok = gds_io::read_model_file(
            dir,
            &m,
            "tokenizer.json",
            crate::tokenizer::MAX_TOKENIZER_BYTES,
        )?
        .ok_or_else(|| RuntimeError::Tokenizer(format!("{} is missing", path.display())))?;
        let t = crate::tokenizer::parse_tokenizer(&tok.bytes)
            .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(t.get_vocab(true))
    };
    let (a, b) = (vocab(target)?, vocab(draft)?);
    if a == b {
        return Ok(());
    }
    let mut diff: Vec<&String> = a
        .iter()
        .filter(|(t, id)| b.get(*t) != Some(id))
        .map(|(t, _)| t)
        .chain(b.keys().filter(|t| !a.contains_key(*t)))
        .collect();
    diff.sort();
    Err(RuntimeError::Usage(format!(
        "--draft-model {}: its vocabulary differs from the model's ({} of {} vs {} tokens differ, e.g. {:?}); a draft must use the same tokenizer",
        draft.display(),
        diff.len(),
        b.len(),
        a.len(),
        diff.first().map(|s| s.as_str()).unwrap_or("")
    )))
}

impl Plan {
    /// The plan of a draft model in `dir` for a target planned with `ctx`, `threads`,
    /// `batch`: the CPU backend, every weight in memory, raw text.
    pub fn draft_model_plan(
        opts: &PlanOptions,
        dir: &Path,
        ctx: usize,
        threads: usize,
        batch: usize,
    ) -> Result<Plan> {
        Plan::build(&PlanOptions {
            model_dir: dir.to_path_buf(),
            ctx: Some(ctx),
            ctx_past_training: opts.ctx_past_training,
            threads: Some(threads),
            batch: Some(batch),
            kv_dtype: opts.kv_dtype,
            backend: Some("cpu".into()),
            io: Some("mmap".into()),
            activations: opts.activations.clone(),
            isa: opts.isa,
            no_verify: opts.no_verify,
            raw: true,
            ..PlanOptions::default()
        })
        .map_err(|e| match e {
            RuntimeError::Usage(m) => RuntimeError::Usage(format!("--draft-model: {m}")),
            other => other,
        })
    }

    /// Reads the model's manifest and turns `opts` into a plan, rejecting invalid values
    /// with a message naming the flag.
    ///
    /// `--backend auto` takes a usable GPU, and falls back to the CPU, saying why, when this
    /// run cannot go there (a weight type without a GPU kernel, a model larger than the
    /// device even streamed).
    pub fn build(opts: &PlanOptions) -> Result<Plan> {
        Self::build_for(opts, crate::backend::choose(opts.backend.as_deref())?)
    }

    /// [`Plan::build`] with `--backend` already resolved to `backend` (by
    /// `backend::choose`, or by a caller that describes a device of its own).
    pub fn build_for(opts: &PlanOptions, backend: crate::backend::BackendChoice) -> Result<Plan> {
        let auto = matches!(opts.backend.as_deref(), None | Some("auto"));
        if !(auto && backend.name == Backend::Cuda) {
            return Self::build_on(opts, backend);
        }
        let device = backend
            .gpu
            .as_ref()
            .map(|g| g.device.clone())
            .unwrap_or_default();
        match Self::build_on(opts, backend) {
            Ok(p) => Ok(p),
            Err(gpu_err) => Self::build_on(
                opts,
                crate::backend::BackendChoice::cpu(format!(
                    "auto: GPU found ({device}) but this run cannot use it: {gpu_err}"
                )),
            )
            // where the CPU cannot run it either, the GPU's reason is the one to show
            .map_err(|_| gpu_err),
        }
    }

    fn build_on(opts: &PlanOptions, backend: crate::backend::BackendChoice) -> Result<Plan> {
        let dir = &opts.model_dir;
        match std::fs::metadata(dir) {
            Err(e) => return Err(RuntimeError::file(dir, e)),
            Ok(m) if !m.is_dir() => {
                return Err(RuntimeError::Usage(format!(
                    "{}: not a model directory (convert one with `gdsconv convert`)",
                    dir.display()
                )))
            }
            Ok(_) => {}
        }
        let bytes = gds_io::read_manifest(dir)?;
        let m = parse_manifest(dir, &bytes)?;
        let model = Config::from_manifest(&m).map_err(|e| with_dir(e, dir))?;
        let mut weight_dtypes: BTreeMap<String, DtypeSummary> = BTreeMap::new();
        let mut matrix_dtypes = std::collections::BTreeSet::new();
        for t in m.tensors() {
            if t.dims().len() >= 2 {
                matrix_dtypes.insert(t.dtype);
            }
            let e = weight_dtypes.entry(t.dtype.name().to_string()).or_default();
            e.tensors += 1;
            e.bytes += t.nbytes;
            e.elements += t.n_elements();
        }
        let plan_err = |s: String| Err(RuntimeError::Usage(s));
        let ctx = match opts.ctx {
            Some(0) => return plan_err("--ctx must be at least 1".into()),
            Some(c) if c > model.context_length && !opts.ctx_past_training => {
                return plan_err(format!(
                    "--ctx {c} exceeds the model's context length {}",
                    model.context_length
                ));
            }
            Some(c) if c / CTX_PAST_TRAINING_MAX > model.context_length => {
                return plan_err(format!(
                    "--ctx {c} exceeds {CTX_PAST_TRAINING_MAX}x the model's context length {}",
                    model.context_length
                ));
            }
            Some(c) => c,
            None => model.context_length.min(DEFAULT_MAX_CTX),
        };
        let threads = match opts.threads {
            Some(0) => return plan_err("--threads must be at least 1".into()),
            Some(t) if t > 1024 => return plan_err(format!("--threads {t} is too many")),
            Some(t) => t,
            None => physical_cores(),
        };
        let batch = match opts.batch {
            Some(0) => return plan_err("--batch must be at least 1".into()),
            Some(b) => b.min(ctx),
            None => DEFAULT_BATCH.min(ctx),
        };
        if opts.max_tokens == Some(0) {
            return plan_err("--max-tokens must be at least 1".into());
        }
        if let Some(j) = opts.max_joules {
            if !(j.is_finite() && j > 0.0) {
                return plan_err(format!("--max-joules {j} must be a positive number"));
            }
        }
        if opts.stop.iter().any(String::is_empty) {
            return plan_err("--stop strings must not be empty".into());
        }
        let d = SamplerConfig::default();
        let mut sampler = SamplerConfig {
            temp: opts.temp.unwrap_or(d.temp),
            top_k: opts.top_k.unwrap_or(d.top_k),
            top_p: opts.top_p.unwrap_or(d.top_p),
            min_p: opts.min_p.unwrap_or(d.min_p),
            repeat_penalty: opts.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: opts.repeat_last_n.unwrap_or(d.repeat_last_n),
            seed: opts.seed.unwrap_or_else(time_seed),
            frequency_penalty: opts.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: opts.presence_penalty.unwrap_or(d.presence_penalty),
            logit_bias: Vec::new(),
            extra: opts.extra_sampling.clone(),
        };
        sampler
            .check()
            .map_err(|e| RuntimeError::Usage(e.to_string()))?;
        // the model's recommendation fills what the user left unset
        let mut max_tokens = opts.max_tokens;
        let mut stop = opts.stop.clone();
        let recommended_sampling =
            crate::recommended::Recommended::read(dir, &m, &opts.generation_config)?.apply(
                crate::recommended::Apply {
                    given: crate::recommended::Given {
                        temp: opts.temp.is_some(),
                        top_k: opts.top_k.is_some(),
                        top_p: opts.top_p.is_some(),
                        min_p: opts.min_p.is_some(),
                        repeat_penalty: opts.repeat_penalty.is_some(),
                        repeat_last_n: opts.repeat_last_n.is_some(),
                        max_tokens: opts.max_tokens.is_some() || opts.unlimited_tokens,
                        stop: !opts.stop.is_empty(),
                        extra: opts.extra_given,
                    },
                    sampler: &mut sampler,
                    max_tokens: &mut max_tokens,
                    stop: &mut stop,
                    ctx,
                },
            );
        let own_template = tokenizer_config(dir, &m)?
            .is_some_and(|v| v.get("chat_template").is_some_and(|t| !t.is_null()));
        let chat_template_override = match (&opts.chat_template_file, &opts.chat_template) {
            (Some(_), Some(_)) => {
                return plan_err("give --chat-template or --chat-template-file, not both".into())
            }
            (Some(p), None) => Some(read_chat_template(p)?),
            (None, Some(t)) => Some(named_chat_template(t)?.to_string()),
            (None, None) => None,
        };
        let chat_template = if let Some(p) = &opts.chat_template_file {
            Some(format!("{} (--chat-template-file)", p.display()))
        } else if let Some(t) = &opts.chat_template {
            Some(if gds_format::chat_template::builtin(t).is_some() {
                format!("{t} (--chat-template)")
            } else {
                "the template given (--chat-template)".to_string()
            })
        } else if own_template {
            Some("tokenizer_config.json".to_string())
        } else {
            gds_format::arch::family(&model.arch)
                .filter(|f| f.chat_template.is_some())
                .map(|f| format!("formats/{}.json (the model's files carry none)", f.family))
        };
        let mode = if opts.raw || chat_template.is_none() {
            Mode::Raw
        } else {
            Mode::Chat
        };
        if opts.parse_special && mode == Mode::Chat {
            return plan_err(
                "--parse-special applies to raw prompts (add --raw); chat messages are always plain text"
                    .into(),
            );
        }
        // f16 halves the cache and what a decode step reads; its perplexity is within 0.001 %
        // of f32's with f32 activations, 0.08-0.30 % apart with q8 ones (docs/running.md);
        // llama.cpp's default too, on the CPU and the GPU
        let kv_dtype = opts.kv_dtype.unwrap_or(KvDtype::F16);
        let activations = match opts.activations.as_deref() {
            Some("q8") => Activations::Q8,
            Some("f32") => Activations::F32,
            Some(other) => return plan_err(format!("--activations {other}: expected q8 or f32")),
            None => Activations::Q8,
        };
        // the kernels' dispatcher is process-wide: the plan sets its cap and records the
        // instruction set it gives on this CPU
        let isa_cap = match opts.isa {
            Some(cap) => Some(cap),
            None => isa_from_env()?,
        };
        gds_kernels::set_isa_cap(isa_cap);
        let isa = gds_kernels::Isa::best_up_to(isa_cap);
        let gemm_min_tokens = match opts.gemm_min_tokens {
            Some(0) => return plan_err("--gemm-min-tokens must be at least 1".into()),
            Some(n) => n,
            None => gemm_min_tokens_from_env()?.unwrap_or(match activations {
                Activations::Q8 => gds_cuda::forward::GEMM_MIN_TOKENS_Q8,
                Activations::F32 => gds_cuda::forward::GEMM_MIN_TOKENS,
            }),
        };
        let cuda_graphs = match opts.cuda_graphs {
            Some(g) => g,
            None => cuda_graphs_from_env()?.unwrap_or(true),
        };
        // f16 tensor cores where the products are 8-bit anyway; the reference arithmetic
        // stays f32 end to end
        let gemm_type = match opts.gemm_type {
            Some(t) => t,
            None => gemm_type_from_env()?.unwrap_or(match activations {
                Activations::Q8 => gds_cuda::forward::GemmType::F16,
                Activations::F32 => gds_cuda::forward::GemmType::F32,
            }),
        };
        let probe = || match m.layer(0) {
            Ok(l) => gds_io::probe_direct(&dir.join(l.file)),
            Err(e) => gds_io::DirectSupport::Buffered(e.to_string()),
        };
        let io_req = opts.io.as_deref().unwrap_or("auto");
        // `--draft layers:N`: self-speculation with the first N blocks and the output head
        let draft_layers = match opts.draft.as_deref().and_then(|d| d.strip_prefix("layers:")) {
            None => None,
            Some(n) => match n.parse::<usize>() {
                Ok(n) if n >= 1 && n < model.n_layers => Some(n),
                _ => {
                    return plan_err(format!(
                        "--draft layers:{n}: expected a number of blocks from 1 to {} (the model has {})",
                        model.n_layers.saturating_sub(1),
                        model.n_layers
                    ))
                }
            },
        };
        if draft_layers.is_some() && backend.gpu.is_some() {
            return plan_err(
                "--draft layers:N runs on the CPU backend (the CUDA executor has no early exit yet); use --draft ngram or --draft-model with --backend cuda".into(),
            );
        }
        let (mut io_plan, gpu) = match backend.gpu.clone() {
            None => {
                if io_req == "gds" {
                    return plan_err(format!(
                        "--io gds: GPUDirect Storage reads layers into GPU memory and needs --backend cuda (this plan's backend is {}: {})",
                        backend.name, backend.reason
                    ));
                }
                if opts.vram_budget.is_some() {
                    return plan_err(format!(
                        "--vram-budget applies to --backend cuda (this plan's backend is {}: {})",
                        backend.name, backend.reason
                    ));
                }
                // with a --draft-model the budget is applied below, once the draft's
                // weights are known
                let budget = opts.mem_budget.filter(|_| opts.draft_model.is_none());
                let mut io = crate::ioplan::plan_io_keeping(
                    dir,
                    &m,
                    io_req,
                    budget,
                    draft_layers.unwrap_or(0),
                    probe,
                )?;
                io.verify = !opts.no_verify;
                (io, None)
            }
            Some(offer) => {
                if opts.mem_budget.is_some() {
                    return plan_err(
                        "--mem-budget bounds host memory for the CPU backend; with --backend cuda use --vram-budget".into(),
                    );
                }
                let direct = matches!(probe(), gds_io::DirectSupport::Direct);
                let ask = crate::gpuplan::GpuAsk {
                    ctx,
                    io: io_req,
                    vram_budget: opts.vram_budget,
                    kv: kv_dtype,
                };
                let g = crate::gpuplan::plan_gpu(dir, &m, &ask, &offer, direct)?;
                // The host keeps no weights: the I/O plan records the file sizes only.
                let mut io = crate::ioplan::plan_io(dir, &m, "mmap", None, probe)?;
                io.verify = !opts.no_verify;
                (io, Some(g))
            }
        };
        let kind = match (opts.draft.as_deref(), &opts.draft_model) {
            (None, Some(_)) => Some(DraftKind::Model),
            (None | Some("none"), None) => None,
            (Some("none"), Some(_)) => {
                return plan_err("--draft none and --draft-model contradict each other".into())
            }
            (Some("ngram"), _) => Some(DraftKind::Ngram),
            (Some("model"), _) => Some(DraftKind::Model),
            (Some(_), None) if draft_layers.is_some() => Some(DraftKind::Layers),
            (Some(_), Some(_)) if draft_layers.is_some() => {
                return plan_err(
                    "--draft-model goes with --draft model (or alone), not layers:N".into(),
                )
            }
            (Some(other), _) => {
                return plan_err(format!(
                    "--draft {other}: expected none, ngram, layers:N or model"
                ))
            }
        };
        let draft = match kind {
            None => {
                if opts.draft_max.is_some() {
                    return plan_err("--draft-max needs --draft ngram or --draft-model".into());
                }
                if opts.draft_gate.is_some() {
                    return plan_err("--draft-gate needs --draft or --draft-model".into());
                }
                None
            }
            Some(kind) => {
                let max = opts.draft_max.unwrap_or(DEFAULT_DRAFT_MAX);
                // a pass holds the sampled token and the guesses; the window ring's slack
                // is one pass, so a rejected guess never overwrites a key still in a window
                // (`max >= batch`, not `max + 1 > batch`: 2^64 - 1 wrapped past the check)
                if max == 0 || max >= batch {
                    return plan_err(format!(
                        "--draft-max {max} must be between 1 and --batch - 1 ({})",
                        batch.saturating_sub(1)
                    ));
                }
                // the CUDA executor returns logits for the last few positions of a pass
                let rows = gds_cuda::plan::MAX_LOGIT_ROWS;
                if gpu.is_some() && max >= rows {
                    return plan_err(format!(
                        "--draft-max {max}: the CUDA executor returns logits for at most {rows} \
                         positions of a pass, so at most {} guesses",
                        rows - 1
                    ));
                }
                if kind == DraftKind::Ngram && opts.draft_model.is_some() {
                    return plan_err(
                        "--draft-model goes with --draft model (or alone), not ngram".into(),
                    );
                }
                let model_plan = match (kind, &opts.draft_model) {
                    (DraftKind::Model, None) => {
                        return plan_err("--draft model needs --draft-model DIR".into())
                    }
                    (DraftKind::Model, Some(d)) => {
                        // the draft must exist, run, and share the vocabulary
                        let sub = Self::draft_model_plan(opts, d, ctx, threads, batch)?;
                        check_same_vocabulary(dir, &sub.model_dir)?;
                        Some(Box::new(sub))
                    }
                    _ => None,
                };
                Some(DraftPlan {
                    kind,
                    model_dir: model_plan.as_ref().map(|p| p.model_dir.clone()),
                    model_plan,
                    layers: draft_layers,
                    max_tokens: max,
                    gate: match opts.draft_gate {
                        Some(g) => g,
                        None => draft_gate_from_env()?.unwrap_or(true),
                    },
                    ngram_max: NGRAM_MAX,
                    ngram_min: NGRAM_MIN,
                })
            }
        };
        // --mem-budget with --draft-model: one budget for both. The draft holds all its
        // weights (mapped); the model gets what is left, or the run is refused naming the
        // smallest budget for both
        if let (Some(b), Some(sub)) = (
            opts.mem_budget,
            draft.as_ref().and_then(|d| d.model_plan.as_deref()),
        ) {
            let held = sub.io_plan.held_bytes;
            let model_min = if matches!(io_req, "mmap" | "load") {
                io_plan.weight_bytes
            } else {
                io_plan.min_budget_bytes
            };
            let smallest = held.saturating_add(model_min);
            let refuse = |why: String| {
                RuntimeError::Usage(format!(
                    "--mem-budget {} with --draft-model {}: the draft holds {} in memory (all its weights), and {why}; the smallest budget for both is {}",
                    crate::ioplan::mib(b),
                    sub.model_dir.display(),
                    crate::ioplan::mib(held),
                    crate::ioplan::mib(smallest)
                ))
            };
            if b < smallest {
                return Err(refuse(format!(
                    "the model needs {} beside it (--io {io_req})",
                    crate::ioplan::mib(model_min)
                )));
            }
            io_plan = crate::ioplan::plan_io(dir, &m, io_req, Some(b - held), probe).map_err(
                |e| match e {
                    RuntimeError::Usage(why) => refuse(why),
                    e => e,
                },
            )?;
            io_plan.verify = !opts.no_verify;
        }
        // Both backends' one-sequence caches keep a ring for window layers
        // (exec::OneSequence::cpu, gpuplan::one_sequence_kv)
        let kv_full_context_bytes =
            KvCache::bytes(kv_dtype, model.n_layers, 1, ctx, model.kv_dim());
        let (kv_bytes, kv_window_ring_positions) = match &gpu {
            None => {
                let windows: Vec<Option<usize>> =
                    (0..model.n_layers).map(|l| model.window(l)).collect();
                let kv = KvCache::window_ring_bytes(kv_dtype, ctx, model.kv_dim(), &windows, batch);
                let ring = KvCache::window_ring_positions(ctx, &windows, batch);
                (kv, ring)
            }
            Some(g) => (g.kv_bytes as usize, g.kv_window_ring_positions),
        };
        Ok(Plan {
            model_dir: dir.clone(),
            model_name: m.get_str("general.name").ok().map(str::to_string),
            arch: model.arch.clone(),
            backend: backend.name,
            backend_reason: backend.reason,
            threads,
            io: match &gpu {
                Some(g) => g.load.name().to_string(),
                None => io_plan.mode.to_string(),
            },
            interleave: gpu.is_none()
                && activations == Activations::Q8
                && io_plan.mode != crate::ioplan::IoMode::Mmap
                && !io_plan.resident_layers.is_empty()
                && matrix_dtypes
                    .iter()
                    .any(|&d| gds_kernels::interleave_pays(d)),
            io_plan,
            gpu,
            activations,
            isa,
            gemm_min_tokens,
            cuda_graphs,
            gemm_type,
            weight_dtypes,
            ctx,
            model_ctx: model.context_length,
            batch,
            kv_dtype,
            kv_bytes,
            kv_full_context_bytes,
            kv_window_ring_positions,
            sampler,
            recommended_sampling,
            limits: Limits {
                max_tokens,
                stop,
                max_joules: opts.max_joules,
            },
            grammar: opts.grammar.clone(),
            logprobs: opts.logprobs,
            draft,
            mode,
            parse_special: opts.parse_special,
            system: opts.system.clone(),
            model,
            chat_template,
            chat_template_override,
        })
    }

    /// Bytes of weights the run holds: in VRAM on the CUDA backend, in host memory on the
    /// CPU (a `--draft-model`'s included, also in host memory).
    pub fn weights_held_bytes(&self) -> u64 {
        let draft = self
            .draft
            .as_ref()
            .and_then(|d| d.model_plan.as_deref())
            .map_or(0, Plan::weights_held_bytes);
        match &self.gpu {
            Some(g) => g.weights_held_bytes(),
            None => self.io_plan.held_bytes.saturating_add(draft),
        }
    }

    /// The plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| format!("{{\"error\": {:?}}}", e.to_string()))
    }
}

fn time_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_template_takes_a_builtin_name_or_jinja() {
        assert!(named_chat_template("chatml")
            .unwrap()
            .contains("<|im_start|>"));
        let inline = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(named_chat_template(inline).unwrap(), inline);
        let e = named_chat_template("chatml2").unwrap_err().to_string();
        assert!(
            e.contains("not a built-in template") && e.contains("llama3"),
            "{e}"
        );
        let e = named_chat_template("{% for %}").unwrap_err().to_string();
        assert!(e.contains("refused"), "{e}");
    }

    #[test]
    fn physical_cores_is_at_least_one() {
        let n = physical_cores();
        assert!(n >= 1 && n <= std::thread::available_parallelism().unwrap().get());
    }

    #[test]
    fn the_draft_gate_alias_reads_on_and_off_and_names_itself_otherwise() {
        assert_eq!(parse_draft_gate_env(None).unwrap(), None);
        assert_eq!(parse_draft_gate_env(Some("")).unwrap(), None);
        assert_eq!(parse_draft_gate_env(Some("on")).unwrap(), Some(true));
        assert_eq!(parse_draft_gate_env(Some("off")).unwrap(), Some(false));
        let e = parse_draft_gate_env(Some("0")).unwrap_err().to_string();
        assert!(
            e.contains("GDS_DRAFT_GATE=\"0\"") && e.contains("--draft-gate"),
            "{e}"
        );
        let e = parse_on_off_env("GDS_CUDA_GRAPHS", "--cuda-graphs", Some("yes"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GDS_CUDA_GRAPHS=\"yes\"") && e.contains("--cuda-graphs"),
            "{e}"
        );
    }

    #[test]
    fn the_isa_alias_reads_the_kernels_names_and_names_itself_otherwise() {
        use gds_kernels::Isa;
        assert_eq!(parse_isa_env(None).unwrap(), None);
        assert_eq!(parse_isa_env(Some("")).unwrap(), None);
        for isa in Isa::ALL {
            assert_eq!(parse_isa_env(Some(isa.name())).unwrap(), Some(isa));
        }
        let e = parse_isa_env(Some("sse2")).unwrap_err().to_string();
        assert!(e.contains("GDS_ISA=\"sse2\"") && e.contains("--isa"), "{e}");
    }

    #[test]
    fn the_gemm_crossover_alias_takes_positive_integers_and_names_itself_otherwise() {
        use gds_cuda::forward::GemmType;
        assert_eq!(parse_gemm_type_env(None).unwrap(), None);
        assert_eq!(parse_gemm_type_env(Some("")).unwrap(), None);
        assert_eq!(
            parse_gemm_type_env(Some("tf32")).unwrap(),
            Some(GemmType::Tf32)
        );
        assert_eq!(
            parse_gemm_type_env(Some(" f16 ")).unwrap(),
            Some(GemmType::F16)
        );
        let e = parse_gemm_type_env(Some("bf16")).unwrap_err().to_string();
        assert!(
            e.contains("GDS_GEMM_TYPE=\"bf16\"")
                && e.contains("--gemm-type")
                && e.contains("f16, tf32 or f32"),
            "{e}"
        );
        assert_eq!(parse_gemm_min_tokens_env(None).unwrap(), None);
        assert_eq!(parse_gemm_min_tokens_env(Some(" ")).unwrap(), None);
        assert_eq!(parse_gemm_min_tokens_env(Some("128")).unwrap(), Some(128));
        for bad in ["0", "-3", "eight", "1e3"] {
            let e = parse_gemm_min_tokens_env(Some(bad))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("GDS_GEMM_MIN_TOKENS") && e.contains("--gemm-min-tokens"),
                "{e}"
            );
        }
    }

    #[test]
    fn draft_kinds_serialize_as_their_names() {
        // the plan's JSON (`gdsrun --plan`: "draft": {"kind": "ngram", ...}) keeps the
        // strings it had before the kind was an enum
        for (k, name) in [
            (DraftKind::Ngram, "ngram"),
            (DraftKind::Layers, "layers"),
            (DraftKind::Model, "model"),
        ] {
            assert_eq!(k.as_str(), name);
            assert_eq!(k.to_string(), name);
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{name}\""));
        }
    }

    #[test]
    fn missing_dir_is_a_clear_error() {
        let e = Plan::build(&PlanOptions {
            model_dir: "/nonexistent/model".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/model"), "{e}");
    }
}
