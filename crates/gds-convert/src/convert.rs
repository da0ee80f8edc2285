//! The conversion pipeline: open the input, decide each tensor's output dtype, write one
//! 4 KiB-aligned file per layer into a temporary directory beside the output, write the
//! manifest and tokenizer, check the result, and rename it into place.

use crate::error::{io, ConvertError};
use crate::imatrix::Imatrix;
use crate::limits::{read_text, ReadTextError, MAX_TOKENIZER_BYTES};
use crate::names::{group_of, Group};
use crate::source::{meta_u64, MetaValue, Source, SourceTensor, Transform};
use crate::staging::Existing;
use gds_format::raw::MAX_MANIFEST_BYTES;
use gds_format::{
    file_role, layer_kind, layout, DType, LayerRecord, ManifestBuilder, TensorSpec, MANIFEST_FILE,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

/// What `--quant` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantTarget {
    /// Every tensor as stored.
    Keep,
    /// Float matrices to this dtype; 1-D tensors to F32.
    To(DType),
    /// Float matrices to a mix of K-quants chosen per tensor as llama.cpp does; 1-D tensors
    /// to F32.
    Mix(QuantMix),
    /// llama-quantize's `MXFP4_MOE`: a mixture's stacked expert matrices (more than one
    /// expert) to MXFP4, every other matrix (embedding and head included) to Q8_0; 1-D
    /// tensors to F32. gpt-oss's published precision.
    Mxfp4Moe,
}

/// The names `--quant` accepts, for its error message and help.
pub const QUANT_NAMES: &str =
    "keep, f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q3_k, q4_k, q5_k, q6_k, q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m or mxfp4_moe";

impl FromStr for QuantTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        if lower == "keep" {
            return Ok(QuantTarget::Keep);
        }
        if lower == "mxfp4_moe" {
            return Ok(QuantTarget::Mxfp4Moe);
        }
        if let Some(m) = QuantMix::ALL.iter().find(|m| m.name() == lower) {
            return Ok(QuantTarget::Mix(*m));
        }
        match DType::from_name(&lower) {
            Some(
                d @ (DType::F32
                | DType::F16
                | DType::BF16
                | DType::Q8_0
                | DType::Q4_0
                | DType::Q4_1
                | DType::Q5_0
                | DType::Q5_1
                | DType::Q3K
                | DType::Q4K
                | DType::Q5K
                | DType::Q6K),
            ) => Ok(QuantTarget::To(d)),
            _ => Err(format!("unknown --quant {s:?} (expected {QUANT_NAMES})")),
        }
    }
}

impl std::fmt::Display for QuantTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantTarget::Keep => f.write_str("keep"),
            QuantTarget::To(d) => write!(f, "{d}"),
            QuantTarget::Mix(m) => f.write_str(m.name()),
            QuantTarget::Mxfp4Moe => f.write_str("mxfp4_moe"),
        }
    }
}

/// The types `--quant-override` accepts, for its error message and help.
pub const OVERRIDE_TYPES: &str =
    "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k or mxfp4";

/// One `--quant-override REGEX=TYPE` (llama-quantize's `--tensor-type`): the matrices whose
/// name the regex matches get TYPE instead of what `--quant` chose for them.
///
/// The regex is searched for anywhere in the tensor's name as the manifest has it — llama.cpp's
/// GGUF names (`blk.3.attn_v.weight`, `output.weight`) for every architecture `gdsconv` maps,
/// from GGUF and safetensors inputs alike (the names `--quant`'s mixes and `--imatrix` use),
/// the input's own names for the others. Letters match in either case (llama-quantize
/// lowercases the pattern). Overrides are tried in the order given and the first that
/// matches decides, as in llama-quantize. A type whose blocks do not divide the rows gets
/// llama.cpp's fallback type, as with `--quant`; norms and other 1-D tensors are never
/// quantized, matched or not.
#[derive(Clone, Debug)]
pub struct QuantOverride {
    /// The regex as given.
    pub pattern: String,
    regex: regex::Regex,
    /// The type it asks for.
    pub dtype: DType,
}

impl QuantOverride {
    /// An override of the matrices `pattern` matches to `dtype` (one of [`OVERRIDE_TYPES`]).
    pub fn new(pattern: &str, dtype: DType) -> Result<QuantOverride, String> {
        Self::build(pattern, dtype, &format!("{pattern}={dtype}"))
    }

    /// [`QuantOverride::new`], its errors naming the flag's value as `given`.
    fn build(pattern: &str, dtype: DType, given: &str) -> Result<QuantOverride, String> {
        if !override_type(dtype) {
            return Err(format!(
                "--quant-override {given}: {dtype} is not a type a tensor can be converted to (expected {OVERRIDE_TYPES})"
            ));
        }
        if pattern.is_empty() {
            return Err(format!(
                "--quant-override {given}: the regex before '=' is empty"
            ));
        }
        let regex = regex::RegexBuilder::new(pattern)
            .case_insensitive(true)
            .size_limit(1 << 20)
            .build()
            .map_err(|e| {
                format!("--quant-override {given}: {pattern:?} is not a valid regex: {e}")
            })?;
        Ok(QuantOverride {
            pattern: pattern.to_string(),
            regex,
            dtype,
        })
    }

    /// Whether the override's regex matches (somewhere in) `name`.
    pub fn matches(&self, name: &str) -> bool {
        self.regex.is_match(name)
    }
}

fn override_type(d: DType) -> bool {
    // the float types, Q8_0, MXFP4 and every type with a weighted quantizer (Q4_0..Q5_1,
    // Q2_K..Q6_K)
    matches!(
        d,
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::MXFP4
    ) || gds_kernels::takes_importance(d)
}

impl FromStr for QuantOverride {
    type Err = String;
    /// `REGEX=TYPE`, split at the last `=` (a type has none); TYPE in any case.
    fn from_str(s: &str) -> Result<Self, String> {
        let Some((pattern, ty)) = s.rsplit_once('=') else {
            return Err(format!(
                "--quant-override {s:?}: expected REGEX=TYPE, e.g. attn_v=q8_0"
            ));
        };
        let dtype = DType::from_name(&ty.to_ascii_lowercase())
            .filter(|&d| override_type(d))
            .ok_or_else(|| {
                format!("--quant-override {s}: unknown type {ty:?} (expected {OVERRIDE_TYPES})")
            })?;
        QuantOverride::build(pattern, dtype, s)
    }
}

impl std::fmt::Display for QuantOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.pattern, self.dtype)
    }
}

/// llama.cpp's K-quant mixes (`llama-quantize` file types `Q2_K`, `Q3_K_S`, `Q3_K_M`,
/// `Q3_K_L`, `Q4_K_S`, `Q4_K_M`, `Q5_K_S`, `Q5_K_M`; its `Q6_K` is `--quant q6_k`: every
/// matrix Q6_K), dense models and mixtures of experts alike. In a model llama.cpp takes for
/// a 70B ([`llama_cpp_70b`]), attn_v that a mix gives Q3_K or Q4_K gets Q5_K; in one with 8
/// experts, attn_v and attn_k get Q8_0 and attn_output Q5_K (below the Q5 mixes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// Q2_K; Q3_K for ffn_down and attn_output, attn_v Q3_K (Q4_K when the model has 4 or
    /// more query heads per KV head). `--quant q2_k` is this mix, as `llama-quantize Q2_K`.
    Q2K,
    /// Q3_K.
    Q3KS,
    /// Q3_K; attn_v Q5_K in the first 2 layers and Q4_K after, ffn_down Q5_K in the first
    /// sixteenth and Q4_K after, attn_output Q4_K.
    Q3KM,
    /// Q3_K; attn_v, ffn_down and attn_output Q5_K.
    Q3KL,
    /// Q4_K; Q5_K for attn_v of the first 4 layers and ffn_down of the first eighth.
    Q4KS,
    /// Q4_K; Q6_K for attn_v and ffn_down of the layers `use_more_bits` picks.
    Q4KM,
    /// Q5_K.
    Q5KS,
    /// Q5_K; Q6_K for attn_v and ffn_down of the layers `use_more_bits` picks.
    Q5KM,
}

impl QuantMix {
    /// Every mix.
    pub const ALL: [QuantMix; 8] = [
        QuantMix::Q2K,
        QuantMix::Q3KS,
        QuantMix::Q3KM,
        QuantMix::Q3KL,
        QuantMix::Q4KS,
        QuantMix::Q4KM,
        QuantMix::Q5KS,
        QuantMix::Q5KM,
    ];

    /// The `--quant` name.
    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q2K => "q2_k",
            QuantMix::Q3KS => "q3_k_s",
            QuantMix::Q3KM => "q3_k_m",
            QuantMix::Q3KL => "q3_k_l",
            QuantMix::Q4KS => "q4_k_s",
            QuantMix::Q4KM => "q4_k_m",
            QuantMix::Q5KS => "q5_k_s",
            QuantMix::Q5KM => "q5_k_m",
        }
    }

    /// The dtype of the tensors no rule names.
    pub fn base(self) -> DType {
        match self {
            QuantMix::Q2K => DType::Q2K,
            QuantMix::Q3KS | QuantMix::Q3KM | QuantMix::Q3KL => DType::Q3K,
            QuantMix::Q4KS | QuantMix::Q4KM => DType::Q4K,
            QuantMix::Q5KS | QuantMix::Q5KM => DType::Q5K,
        }
    }
}

/// What a mix needs to know about the whole model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MixContext {
    /// Blocks (layers) of the model.
    pub n_layer: u32,
    /// Attention-V tensors (`attn_v`, `attn_qkv`, `attn_kv_b`): one per layer, normally.
    pub n_attn_v: u32,
    /// No `output.weight`: the token embedding is the output head too.
    pub tied: bool,
    /// Query heads per KV head (llama.cpp's `n_gqa()`: `n_head / n_head_kv`, 0 when not
    /// known); only the q2_k mix looks at it.
    pub n_gqa: u32,
    /// llama.cpp would load the model as `LLM_TYPE_70B` ([`llama_cpp_70b`]): attn_v that a
    /// mix gives Q3_K or Q4_K gets Q5_K.
    pub type_70b: bool,
    /// Experts of a mixture's blocks (`model.n_expert`; 0 for a dense model). llama.cpp has
    /// rules for exactly 8 (Mixtral-8x7B's): attn_v and attn_k Q8_0, attn_output Q5_K under
    /// the mixes below Q5_K.
    pub n_expert: u32,
}

impl MixContext {
    /// The context of a model with these tensor names (canonical, i.e. GGUF's).
    pub fn of<'a>(names: impl IntoIterator<Item = &'a str>) -> MixContext {
        let mut c = MixContext {
            tied: true,
            ..MixContext::default()
        };
        for name in names {
            if let Group::Block(n) = group_of(name) {
                c.n_layer = c.n_layer.max(n.saturating_add(1));
            }
            match category(name) {
                Category::AttnV => c.n_attn_v += 1,
                Category::Output => c.tied = false,
                _ => {}
            }
        }
        c
    }
}

/// llama.cpp's `tensor_category`, as far as the K mixes use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    /// attn_v, attn_qkv, attn_kv_b (`category_is_attn_v`).
    AttnV,
    AttnK,
    AttnOutput,
    FfnDown,
    Other,
}

/// llama.cpp's `n_gqa()` from the manifest metadata: query heads per KV head, 0 when either
/// count is missing or the KV count is 0.
fn n_gqa(meta: &crate::source::Metadata) -> u32 {
    let get = |k: &str| meta_u64(meta, k).unwrap_or(0);
    let (h, kv) = (get("model.n_heads"), get("model.n_kv_heads"));
    h.checked_div(kv)
        .map_or(0, |g| u32::try_from(g).unwrap_or(u32::MAX))
}

/// Whether llama.cpp loads the model described by `meta` (the manifest metadata, with the
/// input's own architecture name in `general.source_architecture`) as `LLM_TYPE_70B`, the
/// only model type its quantization rules look at. Of the architectures gdsconv converts,
/// llama.cpp has that type for two (`load_arch_hparams` in its `src/models/`):
///
/// - llama (`llama.cpp`): 80 layers and `n_head() != n_head_kv()` (with as many query as KV
///   heads it is `LLM_TYPE_65B`), and not 8 experts (`LLM_TYPE_8x7B` …). Hugging Face's
///   `LlamaForCausalLM` and `MistralForCausalLM` are llama to llama.cpp's converter; the
///   GGUF names `mistral` and `smollm`, which llama.cpp does not load, are taken as llama;
/// - qwen2 (`qwen2.cpp`): 80 layers, whatever the heads (Qwen2 72B, Qwen1.5 72B).
///
/// qwen3, gemma2, gemma3 and phi3 have no 70B type at any layer count. The KV heads are the
/// query heads when the input does not state them, as in llama.cpp.
pub fn llama_cpp_70b(meta: &crate::source::Metadata) -> bool {
    let get = |k: &str| meta_u64(meta, k);
    let arch = match meta.get("general.source_architecture") {
        Some(MetaValue::Str(s)) => s.as_str(),
        _ => return false,
    };
    if get("model.n_layers") != Some(80) {
        return false;
    }
    match arch {
        "llama" | "mistral" | "smollm" | "LlamaForCausalLM" | "MistralForCausalLM" => {
            let experts = get(&format!("gguf.{arch}.expert_count")).unwrap_or(0);
            let heads = get("model.n_heads");
            let kv = get("model.n_kv_heads").or(heads);
            experts != 8 && heads.is_some() && heads != kv
        }
        "qwen2" | "Qwen2ForCausalLM" => true,
        _ => false,
    }
}

/// llama.cpp's `tensor_get_category` (GGUF tensor names).
fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" {
        Category::TokenEmbd
    } else if name.contains("attn_qkv.weight")
        || name.contains("attn_kv_b.weight")
        || name.contains("attn_v.weight")
    {
        Category::AttnV
    } else if name.contains("attn_k.weight") {
        Category::AttnK
    } else if name.contains("attn_q.weight") {
        Category::Other
    } else if name.contains("attn_output.weight") {
        Category::AttnOutput
    } else if name.contains("ffn_up") || name.contains("ffn_gate") {
        Category::Other
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
/// between.
fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2
}

/// The dtype `mix` gives the matrix `name` (canonical name) of `cols` columns: llama.cpp's
/// `llama_tensor_get_type_impl` for these file types (its Falcon rules aside: gdsconv does
/// not convert Falcon; its 70B and 8-expert rules by `ctx`). The layer of an attn_v or
/// ffn_down tensor is the number in its name (llama.cpp counts them in file order: the same
/// for a model with one of each per layer; for a mixture's `ffn_down_exps` it parses the
/// name too). Rows that are not whole blocks of the result are left to [`Planner`]'s
/// rule (llama.cpp's fallback types).
pub fn mix_dtype(mix: QuantMix, name: &str, cols: u64, ctx: &MixContext) -> DType {
    mix_dtype_at(mix, name, cols, ctx, 0)
}

/// [`mix_dtype`] for a matrix that llama.cpp counts as `skipped` layers earlier than the
/// number in its name: `llama-quantize` numbers the attn_v and ffn_down tensors its mix
/// decides by counting them (in layer order), and a tensor a `--tensor-type` override
/// decides is not counted (`--quant-override` keeps that rule).
fn mix_dtype_at(mix: QuantMix, name: &str, cols: u64, ctx: &MixContext, skipped: i64) -> DType {
    use QuantMix::*;
    let base = mix.base();
    let cat = category(name);
    if cat == Category::Output || (ctx.tied && cat == Category::TokenEmbd) {
        return if !cols.is_multiple_of(base.block_size() as u64) {
            DType::Q8_0
        } else {
            DType::Q6K
        };
    }
    let layer = match group_of(name) {
        Group::Block(n) => n as i64 - skipped,
        _ => 0,
    };
    let n = ctx.n_layer as i64;
    match cat {
        Category::AttnV => {
            let d = match mix {
                Q2K if ctx.n_gqa >= 4 => DType::Q4K,
                Q2K => DType::Q3K,
                Q3KM if layer < 2 => DType::Q5K,
                Q3KM => DType::Q4K,
                Q3KL => DType::Q5K,
                Q4KM | Q5KM if use_more_bits(layer, ctx.n_attn_v as i64) => DType::Q6K,
                Q4KS if layer < 4 => DType::Q5K,
                _ => base,
            };
            // llama.cpp's 70B rule, after the mix's (Llama 2/3 70B: eight query heads share
            // each KV head, so attn_v is an eighth of attn_q and more bits cost little), then
            // its 8-expert rule ("bumping this to Q8_0 trades just ~128MB")
            if ctx.n_expert == 8 {
                DType::Q8_0
            } else if ctx.type_70b && matches!(d, DType::Q3K | DType::Q4K) {
                DType::Q5K
            } else {
                d
            }
        }
        Category::AttnK if ctx.n_expert == 8 => DType::Q8_0,
        Category::FfnDown => match mix {
            Q2K => DType::Q3K,
            Q3KM if layer < n / 16 => DType::Q5K,
            Q3KM => DType::Q4K,
            Q3KL => DType::Q5K,
            Q4KM | Q5KM if use_more_bits(layer, n) => DType::Q6K,
            Q4KS if layer < n / 8 => DType::Q5K,
            _ => base,
        },
        Category::AttnOutput if ctx.n_expert == 8 => match mix {
            Q2K | Q3KS | Q3KM | Q4KS | Q4KM => DType::Q5K,
            _ => base,
        },
        Category::AttnOutput => match mix {
            Q2K => DType::Q3K,
            Q3KM => DType::Q4K,
            Q3KL => DType::Q5K,
            _ => base,
        },
        _ => base,
    }
}

/// Options of one conversion.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Output dtype policy.
    pub quant: QuantTarget,
    /// Also convert tensors that are already block-quantized (dequantize, then quantize).
    pub requantize: bool,
    /// Replace an existing output directory.
    pub force: bool,
    /// A `tokenizer.json` to use instead of the input's.
    pub tokenizer: Option<PathBuf>,
    /// An importance matrix (llama.cpp's GGUF or legacy `.dat` imatrix) weighing the
    /// quantization of the matrices it has entries for, as `llama-quantize --imatrix`.
    pub imatrix: Option<PathBuf>,
    /// `--quant-override`s, in the order given (the first that matches a matrix decides).
    pub overrides: Vec<QuantOverride>,
    /// A `generation_config.json` (its text) for an input that carries none: another
    /// tool's recommended sampling translated (Ollama's parameters), written into the
    /// output as a checkpoint's own would be.
    pub generation_config: Option<String>,
    /// A Jinja chat template that replaces the input's default one in the output's
    /// `tokenizer_config.json` (its named templates kept), checked as the input's are
    /// (`gdsconv convert --chat-template-file`; Docker Model Runner's template layer).
    pub chat_template_file: Option<PathBuf>,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            quant: QuantTarget::Keep,
            requantize: false,
            force: false,
            tokenizer: None,
            imatrix: None,
            overrides: Vec::new(),
            generation_config: None,
            chat_template_file: None,
        }
    }
}

/// Receives progress in bytes of tensor data written.
pub trait Progress: Sync {
    /// Total bytes about to be written.
    fn start(&self, _total: u64) {}
    /// `bytes` more were written.
    fn advance(&self, _bytes: u64) {}
    /// Done (successfully or not).
    fn finish(&self) {}
}

/// A [`Progress`] that ignores everything.
pub struct NoProgress;
impl Progress for NoProgress {}

/// What a conversion did.
#[derive(Clone, Debug)]
pub struct ConvertSummary {
    /// Architecture family (or the input's own name when unknown).
    pub arch: String,
    /// Whether `gdsrun` can run it.
    pub runnable: bool,
    /// Number of tensors written.
    pub tensors: usize,
    /// Number of layer files.
    pub layers: usize,
    /// Tensor bytes written (without padding).
    pub tensor_bytes: u64,
    /// Bytes of all layer files (with padding).
    pub file_bytes: u64,
    /// Wall time of the whole conversion.
    pub seconds: f64,
    /// Warnings for the user.
    pub warnings: Vec<String>,
}

/// Opens any supported input: a `.gguf` file, a `.safetensors` file, a
/// `model.safetensors.index.json`, or a Hugging Face model directory.
pub fn open_source(input: &Path) -> Result<Source, ConvertError> {
    let meta = std::fs::metadata(input).map_err(io(input))?;
    if meta.is_dir() {
        return Ok(crate::safetensors::read_safetensors(input)?);
    }
    let mut magic = [0u8; 4];
    {
        use std::io::Read;
        // a FIFO, socket or device is refused instead of an open that blocks for ever
        let mut f = gds_io::open_user_file(input).map_err(io(input))?;
        let n = f.read(&mut magic).map_err(io(input))?;
        if n < 4 {
            return Err(ConvertError::BadInput {
                path: input.into(),
                msg: format!("file is {n} bytes: too short to be a model"),
            });
        }
    }
    let ext = input
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    if &magic == b"GGUF" || ext == "gguf" {
        crate::gguf::read_gguf(input)
    } else if ext == "safetensors" || ext == "json" {
        Ok(crate::safetensors::read_safetensors(input)?)
    } else {
        Err(ConvertError::BadInput {
            path: input.into(),
            msg: "unrecognized input: expected a .gguf file, a .safetensors file, a model.safetensors.index.json, or a Hugging Face model directory".into(),
        })
    }
}

/// What happened to a matrix whose rows are not whole blocks of the type it was meant to get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Misfit {
    /// Its rows are whole blocks (or it is not quantized): nothing.
    None,
    /// It got llama.cpp's fallback type instead ([`block_fallback`]).
    FellBack,
    /// No quantized type fits: it stays float.
    KeptFloat,
}

/// llama.cpp's `tensor_type_fallback` (llama-quant.cpp): the 32-value block type a matrix gets
/// instead of a 256-value K type when its rows are not whole 256-blocks (SmolLM2's 576 and
/// Gemma 3 270M's 640 columns), with mixes and single types (`llama-quantize --pure`) alike;
/// `None` when that does not fit either (llama.cpp then writes F16; here it stays float).
fn block_fallback(target: DType, cols: u64) -> Option<DType> {
    let fits = |d: DType| cols.is_multiple_of(d.block_size() as u64);
    if fits(target) {
        return Some(target);
    }
    let to = match target {
        DType::Q2K | DType::Q3K => DType::Q4_0,
        DType::Q4K => DType::Q5_0,
        DType::Q5K => DType::Q5_1,
        DType::Q6K => DType::Q8_0,
        _ => return None,
    };
    fits(to).then_some(to)
}

/// A tensor's output dtype, how it fit, and which `--quant-override` (its index) chose it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Planned {
    dtype: DType,
    misfit: Misfit,
    by: Option<usize>,
}

/// Chooses each tensor's output dtype: `--quant` (a mix in a model described by a
/// [`MixContext`]), then the first `--quant-override` that matches, then llama.cpp's
/// fallback types where the rows are not whole blocks of the result.
pub struct Planner<'a> {
    opts: &'a ConvertOptions,
    ctx: MixContext,
    /// The layers (sorted) of the attn_v and of the ffn_down matrices an override decides,
    /// which llama.cpp's mix does not count (see [`mix_dtype_at`]).
    skipped: [Vec<u32>; 2],
}

impl<'a> Planner<'a> {
    /// The planner of a conversion of `tensors` (all of the model's) under `opts`.
    pub fn new<'t>(
        opts: &'a ConvertOptions,
        ctx: MixContext,
        tensors: impl IntoIterator<Item = &'t SourceTensor>,
    ) -> Planner<'a> {
        let mut skipped = [Vec::new(), Vec::new()];
        if matches!(opts.quant, QuantTarget::Mix(_)) && !opts.overrides.is_empty() {
            for t in tensors {
                if !matrix(t) || !opts.overrides.iter().any(|o| o.matches(&t.name)) {
                    continue;
                }
                let Group::Block(n) = group_of(&t.name) else {
                    continue;
                };
                match category(&t.name) {
                    Category::AttnV => skipped[0].push(n),
                    Category::FfnDown => skipped[1].push(n),
                    _ => {}
                }
            }
            skipped.iter_mut().for_each(|v| v.sort_unstable());
        }
        Planner { opts, ctx, skipped }
    }

    /// The dtype `t` is written as.
    pub fn dtype(&self, t: &SourceTensor) -> DType {
        self.plan(t).dtype
    }

    /// How many attn_v or ffn_down matrices before `name`'s layer an override decided.
    fn skipped_before(&self, name: &str) -> i64 {
        let list = match category(name) {
            Category::AttnV => &self.skipped[0],
            Category::FfnDown => &self.skipped[1],
            _ => return 0,
        };
        match group_of(name) {
            Group::Block(n) => list.partition_point(|&l| l < n) as i64,
            _ => 0,
        }
    }

    fn plan(&self, t: &SourceTensor) -> Planned {
        let (opts, ctx) = (self.opts, &self.ctx);
        let keep = |dtype| Planned {
            dtype,
            misfit: Misfit::None,
            by: None,
        };
        if t.transform == Transform::NormOffset {
            return keep(DType::F32);
        }
        if router(&t.name) {
            return keep(if t.dtype.is_float() {
                DType::F32
            } else {
                t.dtype
            });
        }
        if !matrix(t) && t.dtype.is_float() {
            // norms, biases (a mixture's per-expert biases are 2-D): F32 under every policy,
            // `keep` and overrides included (an F16 checkpoint's norms are F16), as llama.cpp's
            // converter writes them; the CUDA backend reads them as F32
            return keep(DType::F32);
        }
        let cols = *t.shape.last().unwrap_or(&0);
        let by = opts.overrides.iter().position(|o| o.matches(&t.name));
        let target = match (by, opts.quant) {
            (Some(i), _) => opts.overrides[i].dtype,
            (None, QuantTarget::Keep) => return keep(t.dtype),
            (None, QuantTarget::To(d)) => d,
            (None, QuantTarget::Mix(m)) => {
                mix_dtype_at(m, &t.name, cols, ctx, self.skipped_before(&t.name))
            }
            // llama-quantize's rule: `ne[2] > 1`, a stack of more than one expert
            (None, QuantTarget::Mxfp4Moe) => match t.shape.len() >= 3 && t.shape[0] > 1 {
                true => DType::MXFP4,
                false => DType::Q8_0,
            },
        };
        if t.dtype.is_quantized() && !opts.requantize {
            return keep(t.dtype);
        }
        if !t.dtype.is_float() && !t.dtype.is_quantized() {
            return keep(t.dtype); // integer tensors pass through
        }
        let (dtype, misfit) = if !target.is_quantized() {
            (target, Misfit::None)
        } else {
            match block_fallback(target, cols) {
                Some(d) if d == target => (d, Misfit::None),
                Some(d) => (d, Misfit::FellBack),
                None if t.dtype.is_float() => (t.dtype, Misfit::KeptFloat),
                None => (DType::F32, Misfit::KeptFloat),
            }
        };
        Planned { dtype, misfit, by }
    }
}

/// A matrix `--quant` and `--quant-override` may convert: a weight (not a bias: llama-quantize
/// quantizes only names ending in `weight`, and gpt-oss's per-expert biases are 2-D), 2-D or
/// more (experts), not a norm that the reader rewrites, not a mixture of experts' router.
fn matrix(t: &SourceTensor) -> bool {
    t.shape.len() >= 2
        && !t.name.ends_with(".bias")
        && t.transform != Transform::NormOffset
        && !router(&t.name)
}

/// A mixture of experts' router (`blk.N.ffn_gate_inp.weight`): never quantized, whatever the
/// policy or override, as llama-quantize leaves it ("do not quantize expert gating
/// tensors"), and F32 from a float source, as llama.cpp's converter writes it: it is small,
/// and its logits choose the experts.
fn router(name: &str) -> bool {
    name.ends_with("ffn_gate_inp.weight")
}

/// Warnings for the `--quant-override`s that decide no tensor, saying why.
fn override_warnings(
    opts: &ConvertOptions,
    tensors: &[&SourceTensor],
    by: &[Option<usize>],
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, o) in opts.overrides.iter().enumerate() {
        if by.contains(&Some(i)) {
            continue;
        }
        let matched: Vec<&SourceTensor> = tensors
            .iter()
            .copied()
            .filter(|t| o.matches(&t.name))
            .collect();
        let why = if matched.is_empty() {
            "it matches no tensor's name (the names are llama.cpp's, e.g. blk.0.attn_v.weight: `gdsconv inspect --tensors` lists them)".to_string()
        } else if !matched.iter().any(|t| matrix(t)) {
            format!(
                "the {} tensors it matches are norms or other 1-D tensors, which are never quantized",
                matched.len()
            )
        } else if matched
            .iter()
            .filter(|t| matrix(t))
            .all(|t| opts.overrides[..i].iter().any(|e| e.matches(&t.name)))
        {
            "every matrix it matches is decided by an earlier --quant-override (the first that matches wins)".to_string()
        } else {
            "the matrices it matches keep their type (already quantized: --requantize converts them; or integer)".to_string()
        };
        out.push(format!("--quant-override {o} changes no tensor: {why}"));
    }
    out
}

/// The importance weights `t` is quantized to `out` with: the matrix's entry in `imatrix`,
/// when `out` has a weighted quantizer and `t` is converted at all (not passed through).
fn importance<'m>(
    t: &SourceTensor,
    out: DType,
    imatrix: Option<&'m Imatrix>,
) -> Result<Option<&'m [f32]>, ConvertError> {
    let Some(m) = imatrix else { return Ok(None) };
    if out == t.dtype || !gds_kernels::takes_importance(out) || t.shape.len() < 2 {
        return Ok(None);
    }
    let cols = *t.shape.last().unwrap_or(&0);
    let n_mat: u64 = t.shape[..t.shape.len() - 2].iter().product();
    m.weights_for(&t.name, cols, n_mat)
}

/// The bytes of `t` as written: permuted if the input layout asks, converted to `out`
/// (weighted by `weights`, one row of per-column weights per expert, when given).
fn produce<'a>(
    t: &'a SourceTensor,
    out: DType,
    weights: Option<&[f32]>,
) -> Result<Cow<'a, [u8]>, ConvertError> {
    produce_in(t, out, weights, PRODUCE_F32_VALUES)
}

/// [`produce`], dequantizing at most `chunk_values` values (whole rows, at least one) to f32 at
/// a time.
fn produce_in<'a>(
    t: &'a SourceTensor,
    out: DType,
    weights: Option<&[f32]>,
    chunk_values: usize,
) -> Result<Cow<'a, [u8]>, ConvertError> {
    let kerr = |source| ConvertError::Kernel {
        tensor: t.source_name.clone(),
        source,
    };
    let mut bytes: Cow<'a, [u8]> = t.bytes();
    if let Transform::PermuteRope { n_head } = t.transform {
        let rows = t.shape[0] as usize;
        let row_bytes = t.nbytes as usize / rows.max(1);
        if n_head == 0 || !rows.is_multiple_of(2 * n_head as usize) {
            return Err(ConvertError::BadTensor {
                path: t.file.path.clone(),
                tensor: t.source_name.clone(),
                msg: format!("{rows} rows cannot be split into {n_head} RoPE heads of pairs"),
            });
        }
        bytes = Cow::Owned(crate::safetensors::permute_rope_rows(
            &bytes,
            rows,
            row_bytes,
            n_head as usize,
        ));
    }
    if t.transform == Transform::NormOffset {
        let n: usize = t.shape.iter().product::<u64>() as usize;
        let mut f = vec![0f32; n];
        gds_kernels::dequantize(t.dtype, &bytes, &mut f).map_err(kerr)?;
        for v in &mut f {
            *v += 1.0;
        }
        return Ok(Cow::Owned(
            gds_kernels::quantize(DType::F32, &f).map_err(kerr)?,
        ));
    }
    if out == t.dtype {
        return Ok(bytes);
    }
    let cols = *t.shape.last().unwrap_or(&1) as usize;
    let n: usize = t.shape.iter().product::<u64>() as usize;
    let in_row = t.dtype.row_bytes(cols as u64).unwrap_or(0) as usize;
    if in_row == 0 || cols == 0 {
        return Err(kerr(gds_kernels::KernelError::Shape(format!(
            "{} row of {cols}",
            t.dtype
        ))));
    }
    let rows = n / cols;
    // one expert (a 2-D matrix is one) at a time, each with its own row of weights
    let n_mat = weights.map_or(1, |w| (w.len() / cols).max(1));
    let mat_rows = rows / n_mat;
    // A bounded number of rows in f32 at a time (the quantizers work per row, so the bytes are
    // those of the whole matrix at once): a 7B model's 49k x 4096 output head was 805 MB of f32
    // beside its 403 MB of F16 input, most of the conversion's 1.34 GB peak.
    let chunk_rows = (chunk_values / cols).clamp(1, mat_rows.max(1));
    let mut f = vec![0f32; chunk_rows * cols];
    let mut out_bytes = Vec::with_capacity(out.tensor_bytes(&t.shape).unwrap_or(0) as usize);
    let mapped = matches!(bytes, Cow::Borrowed(_));
    for m in 0..n_mat {
        let w = weights.map(|w| &w[m * cols..(m + 1) * cols]);
        let mut r = 0;
        while r < mat_rows {
            let k = chunk_rows.min(mat_rows - r);
            let r0 = m * mat_rows + r;
            let dst = &mut f[..k * cols];
            dst.par_chunks_mut(cols)
                .zip(bytes[r0 * in_row..(r0 + k) * in_row].par_chunks(in_row))
                .try_for_each(|(dst, src)| gds_kernels::dequantize(t.dtype, src, dst))
                .map_err(kerr)?;
            out_bytes.extend(
                match w {
                    None => gds_kernels::quantize(out, dst),
                    Some(w) => gds_kernels::quantize_weighted(out, dst, cols, w),
                }
                .map_err(kerr)?,
            );
            if mapped {
                // these rows' input pages are done with (read again if touched)
                t.file
                    .release(t.offset + (r0 * in_row) as u64, (k * in_row) as u64);
            }
            r += k;
        }
    }
    Ok(Cow::Owned(out_bytes))
}

/// Values [`produce`] dequantizes to f32 at a time (32 MiB).
const PRODUCE_F32_VALUES: usize = 8 << 20;

/// Checks before anything is written that every entry of `m` a quantized matrix uses fits it
/// (an error otherwise), and returns warnings: entries that name no tensor of the model
/// (an imatrix of another model?), or no matrix weighted at all.
fn imatrix_warnings(
    m: &Imatrix,
    plans: &[(Group, Vec<(&SourceTensor, DType)>)],
) -> Result<Vec<String>, ConvertError> {
    let mut weighted = 0usize;
    let mut names = HashSet::new();
    for (t, d) in plans.iter().flat_map(|(_, v)| v.iter()) {
        names.insert(t.name.as_str());
        weighted += importance(t, *d, Some(m))?.is_some() as usize;
    }
    let mut w = Vec::new();
    let unknown: Vec<&str> = m
        .entries
        .keys()
        .map(|k| k.as_str())
        .filter(|k| !names.contains(k))
        .collect();
    if !unknown.is_empty() {
        w.push(format!(
            "{}: {} of its {} entries name no tensor of this model: {}",
            m.path.display(),
            unknown.len(),
            m.entries.len(),
            crate::check::list(unknown.into_iter().map(String::from))
        ));
    }
    if weighted == 0 {
        w.push(format!(
            "{}: no tensor is quantized with the importance matrix (none is converted to a type that uses one: q4_0, q4_1, q5_0, q5_1, q2_k .. q6_k)",
            m.path.display()
        ));
    }
    Ok(w)
}

/// Decides whether the conversion may write `out_dir`: it must not exist, or, with
/// `force`, be a directory holding nothing but a model, and not hold the input (the rule
/// is [`crate::staging::check_output`], shared with `gdsconv pull --force`).
fn check_output(input: &Path, out_dir: &Path, force: bool) -> Result<Existing, ConvertError> {
    crate::staging::check_output(out_dir, force, &[("the input", input)])
}

fn put_meta(b: &mut ManifestBuilder, k: &str, v: &MetaValue) {
    match v {
        MetaValue::U64(x) => b.kv_u64(k, *x),
        MetaValue::I64(x) => b.kv_i64(k, *x),
        MetaValue::F64(x) => b.kv_f64(k, *x),
        MetaValue::Bool(x) => b.kv_bool(k, *x),
        MetaValue::Str(x) => b.kv_str(k, x),
    };
}

/// Writes `n` zero bytes of alignment padding, hashing them with the layer's content.
fn write_padding(
    w: &mut impl Write,
    hasher: &mut blake3::Hasher,
    mut n: u64,
) -> std::io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(4096) as usize;
        w.write_all(&ZEROS[..k])?;
        hasher.update(&ZEROS[..k]);
        n -= k as u64;
    }
    Ok(())
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ConvertError> {
    let mut f = std::fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// A file of the output besides the layers, written and being written back.
struct AuxFile {
    name: &'static str,
    role: u32,
    len: u64,
    hash: [u8; 32],
    path: PathBuf,
    file: std::fs::File,
}

/// Writes the tokenizer files into the staging directory `tmp` (written back without waiting;
/// the caller syncs them) and returns them with the warnings met while making them.
fn write_aux(tmp: &Path, tok: TokenizerOut) -> Result<(Vec<String>, Vec<AuxFile>), ConvertError> {
    let mut out = Vec::new();
    for (name, role, text) in [
        ("tokenizer.json", file_role::TOKENIZER, Some(tok.json)),
        (
            "tokenizer_config.json",
            file_role::TOKENIZER_CONFIG,
            tok.config,
        ),
        (
            "generation_config.json",
            file_role::GENERATION_CONFIG,
            tok.generation,
        ),
    ] {
        let Some(text) = text else { continue };
        let path = tmp.join(name);
        let mut file = std::fs::File::create(&path).map_err(io(&path))?;
        file.write_all(text.as_bytes()).map_err(io(&path))?;
        start_writeback(&file);
        out.push(AuxFile {
            name,
            role,
            len: text.len() as u64,
            hash: *blake3::hash(text.as_bytes()).as_bytes(),
            path,
            file,
        });
    }
    Ok((tok.warnings, out))
}

/// The tokenizer files of the output, and warnings found while making them.
struct TokenizerOut {
    json: String,
    config: Option<String>,
    generation: Option<String>,
    warnings: Vec<String>,
}

/// Makes the output's tokenizer files: the user's `tokenizer.json` (`--tokenizer`) or the
/// input's (a GGUF's exported now, from `pending`), checked to load and to have no token id
/// past `vocab` (the embedding's rows), and its chat templates checked; `why` holds the reader's warnings about the
/// tokenizer, for the error when there is none.
fn tokenizer_files(
    input: &Path,
    user: Option<&Path>,
    template: Option<&Path>,
    given: crate::source::TokenizerFiles,
    pending: Option<crate::source::PendingTokenizer>,
    mut why: Vec<String>,
    vocab: Option<u64>,
) -> Result<TokenizerOut, ConvertError> {
    let (files, warnings) = match pending {
        Some(p) => p.run(),
        None => (given, Vec::new()),
    };
    why.extend(
        warnings
            .iter()
            .filter(|w| w.starts_with("tokenizer"))
            .cloned(),
    );
    let json = match user {
        Some(p) => read_user_text(p, MAX_TOKENIZER_BYTES)?,
        None => files.tokenizer_json.ok_or_else(|| ConvertError::BadInput {
            path: input.into(),
            msg: format!(
                "the input carries no usable tokenizer{}; pass --tokenizer path/to/tokenizer.json",
                if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", why.join("; "))
                }
            ),
        })?,
    };
    // Loaded to check it (a GGUF export is built by the tokenizers library, but its token ids
    // still have to fit the embedding): an id past the model's vocabulary would be looked up
    // past the embedding's rows at run time.
    let tok_path = || -> PathBuf {
        match user {
            Some(p) => p.to_path_buf(),
            None if input.is_dir() => input.join("tokenizer.json"),
            None => input.to_path_buf(),
        }
    };
    match tokenizers::Tokenizer::from_str(&json) {
        Err(e) => {
            return Err(ConvertError::BadInput {
                path: tok_path(),
                msg: format!("tokenizer.json does not load: {e}"),
            })
        }
        Ok(t) => {
            let end = crate::validate::token_ids_end(&t);
            if let Some(v) = vocab.filter(|&v| end > v) {
                return Err(ConvertError::BadInput {
                    path: tok_path(),
                    msg: format!(
                        "the tokenizer has token ids up to {} but the model's vocabulary (the embedding's rows) has {v}: every id must have an embedding row",
                        end - 1
                    ),
                });
            }
            // its regular expressions are code from the input: one that backtracks would make
            // every prompt slow wherever the model runs
            gds_format::tokenizer_speed::check(&t, json.as_bytes()).map_err(|e| {
                ConvertError::BadInput {
                    path: tok_path(),
                    msg: format!("the tokenizer is refused: {e}"),
                }
            })?;
        }
    }
    let mut config = files.tokenizer_config_json;
    if let Some(p) = template {
        config = Some(with_chat_template(config.as_deref(), p)?);
    }
    if let Some(cfg) = &config {
        check_chat_templates(input, cfg)?;
    }
    Ok(TokenizerOut {
        json,
        config,
        generation: files.generation_config_json,
        warnings,
    })
}

/// The hyperparameters the manifest will carry, through the same checks `validate` and
/// `gdsrun` run (`gds_format::arch::hparams`), before anything is written: a value of the
/// wrong type or out of range is the input's error, named with the key it came from
/// (`hidden_size in …/config.json`), not the self-check's after writing.
fn check_hparams(source: &Source, input: &Path) -> Result<(), ConvertError> {
    if !source.runnable {
        return Ok(());
    }
    let mut b = ManifestBuilder::new();
    for (k, v) in &source.metadata {
        put_meta(&mut b, k, v);
    }
    let bytes = b.finish();
    let Ok(m) = gds_format::Manifest::parse(&bytes) else {
        // what the manifest rules refuse is reported by the self-check, naming the rule
        return Ok(());
    };
    let Err(errs) = gds_format::arch::hparams(&m, &source.arch) else {
        return Ok(());
    };
    let msgs: Vec<String> = errs
        .iter()
        .map(|e| match e {
            gds_format::FormatError::MissingKey { key, why } => {
                match source.hparam_origin.get(key) {
                    Some(o) => format!("{key} ({o}): {why}"),
                    None => format!("{key}: {why}"),
                }
            }
            e => e.to_string(),
        })
        .collect();
    Err(ConvertError::BadInput {
        path: input.to_path_buf(),
        msg: format!("bad hyperparameters: {}", msgs.join("; ")),
    })
}

/// The chat templates of the output's `tokenizer_config.json` are code from the model file:
/// each must pass [`gds_format::chat_template::check`] (compiles within its bounds, renders
/// a sample conversation within its fuel and output limits), or the conversion fails naming
/// where the template came from: a directory's `chat_template.jinja` or
/// `additional_chat_templates/NAME.jinja` where there is one, else its
/// `tokenizer_config.json`, or GGUF key `tokenizer.chat_template`. A config that is not JSON
/// is left to the self-check's message.
/// A file the user named (`--tokenizer`, `--chat-template-file`) read whole, at most `cap`
/// bytes of UTF-8: missing or unreadable is an I/O error, too large or not UTF-8 the file's
/// error, each naming it.
fn read_user_text(p: &Path, cap: u64) -> Result<String, ConvertError> {
    match read_text(p, cap) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(io(p)(std::io::Error::from_raw_os_error(libc::ENOENT))),
        Err(ReadTextError::Io(e)) => Err(io(p)(e)),
        Err(e) => Err(ConvertError::BadInput {
            path: p.into(),
            msg: e.describe(cap),
        }),
    }
}

/// `config` (a `tokenizer_config.json`'s text, or none) with the Jinja template in the file
/// `p` as its default chat template: the `chat_template` string replaced, or in a list of
/// named templates the `default` one (added where the list has none). The file is read as
/// the input's side files are, at most [`gds_format::chat_template::MAX_SOURCE_BYTES`], and
/// checked as a model's template is; errors name it.
fn with_chat_template(config: Option<&str>, p: &Path) -> Result<String, ConvertError> {
    let src = read_user_text(p, gds_format::chat_template::MAX_SOURCE_BYTES as u64)?;
    gds_format::chat_template::check(&src).map_err(|e| ConvertError::BadInput {
        path: p.to_path_buf(),
        msg: format!("the chat template is refused: {e}"),
    })?;
    let mut v = match config.map(serde_json::from_str::<serde_json::Value>) {
        Some(Ok(v @ serde_json::Value::Object(_))) => v,
        // the input's own is checked (and named) by its reader; an unreadable one is replaced
        _ => serde_json::json!({}),
    };
    let src = serde_json::Value::String(src);
    match v.get_mut("chat_template") {
        Some(serde_json::Value::Array(list)) => {
            match list
                .iter_mut()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            {
                Some(t) => t["template"] = src,
                None => list.push(serde_json::json!({"name": "default", "template": src})),
            }
        }
        _ => v["chat_template"] = src,
    }
    let mut text = serde_json::to_string_pretty(&v).expect("a JSON value serializes");
    text.push('\n');
    Ok(text)
}

fn check_chat_templates(input: &Path, config: &str) -> Result<(), ConvertError> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(config) else {
        return Ok(());
    };
    let (path, key) = if input.is_dir() {
        (input.join("tokenizer_config.json"), "")
    } else {
        (input.to_path_buf(), "tokenizer.chat_template: ")
    };
    let bad = |path: &Path, msg: String| ConvertError::BadInput {
        path: path.to_path_buf(),
        msg: format!("{key}{msg}"),
    };
    for (name, src) in crate::validate::chat_templates(&v).map_err(|m| bad(&path, m))? {
        let file = match name.as_str() {
            "default" => input.join("chat_template.jinja"),
            n => input
                .join("additional_chat_templates")
                .join(format!("{n}.jinja")),
        };
        let from = if input.is_dir() && file.is_file() {
            file
        } else {
            path.clone()
        };
        gds_format::chat_template::check(&src)
            .map_err(|e| bad(&from, format!("chat template {name:?} is refused: {e}")))?;
    }
    Ok(())
}

/// Bytes written (and hashed) at a time; see [`write_layers`].
const WRITE_PIECE: usize = 8 << 20;

/// Starts writing `f`'s dirty pages to the device without waiting (Linux
/// `sync_file_range(SYNC_FILE_RANGE_WRITE)`), so that the device works while the next files
/// are made and the final `fsync` waits only for the tail. Best effort: elsewhere, or on
/// error, the final `fsync` does all of it.
fn start_writeback(f: &std::fs::File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor belongs to `f`, open for the duration of the call; the call
        // reads and writes no memory of ours.
        let _ = unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = f;
}

/// Writes every layer file of `plans` into the staging directory `tmp` and records it in
/// `builder`; returns the tensor bytes and the file bytes written. Each file is hashed as it
/// is written and the input pages of its tensors are released after it; the files are
/// flushed to disk together at the end (one wait for the device instead of one per layer).
fn write_layers(
    plans: &[(Group, Vec<(&SourceTensor, DType)>)],
    tmp: &Path,
    input: &Path,
    imatrix: Option<&Imatrix>,
    builder: &mut ManifestBuilder,
    progress: &dyn Progress,
) -> Result<(u64, u64), ConvertError> {
    let mut tensor_bytes = 0u64;
    let mut file_bytes = 0u64;
    let mut written = Vec::with_capacity(plans.len());
    for (g, ts) in plans {
        let (name, file, kind, index) = match g {
            Group::Embed => (
                "embed".to_string(),
                "layers/embed.bin".to_string(),
                layer_kind::EMBED,
                0,
            ),
            Group::Block(n) => (
                format!("blk.{n}"),
                format!("layers/blk.{n:04}.bin"),
                layer_kind::BLOCK,
                *n,
            ),
            Group::Head => (
                "head".to_string(),
                "layers/head.bin".to_string(),
                layer_kind::HEAD,
                0,
            ),
        };
        let specs: Vec<TensorSpec> = ts
            .iter()
            .map(|(t, d)| TensorSpec {
                name: t.name.clone(),
                dtype: *d,
                shape: t.shape.clone(),
            })
            .collect();
        let lay = layout(&specs).map_err(|msg| ConvertError::BadInput {
            path: input.into(),
            msg,
        })?;
        let path = tmp.join(&file);
        let f = std::fs::File::create(&path).map_err(io(&path))?;
        // small: norms and padding are gathered, every larger piece goes straight from the
        // source mapping to write(2) (a BufWriter copies what is smaller than its capacity)
        let mut w = std::io::BufWriter::with_capacity(64 << 10, f);
        let mut hasher = blake3::Hasher::new();
        let mut pos = 0u64;
        for ((t, d), &(offset, nbytes)) in ts.iter().zip(&lay.placements) {
            write_padding(&mut w, &mut hasher, offset - pos).map_err(io(&path))?;
            let bytes = produce(t, *d, importance(t, *d, imatrix)?)?;
            if bytes.len() as u64 != nbytes {
                return Err(ConvertError::Internal {
                    input: input.into(),
                    msg: format!(
                        "tensor {:?}: produced {} bytes, expected {nbytes}",
                        t.name,
                        bytes.len()
                    ),
                });
            }
            // in pieces, each piece's whole input pages released once written, so a large
            // tensor (a 262k-token embedding) never stays resident whole
            let mut done = 0usize;
            let mut released = t.offset;
            let mapped = matches!(bytes, Cow::Borrowed(_));
            for piece in bytes.chunks(WRITE_PIECE) {
                if mapped {
                    t.file.populate(t.offset + done as u64, piece.len() as u64);
                }
                hasher.update(piece);
                w.write_all(piece).map_err(io(&path))?;
                // the device starts on each piece as it is written (submitting a whole
                // large file at its end blocked this thread for tens of milliseconds)
                start_writeback(w.get_ref());
                done += piece.len();
                if mapped {
                    let end = (t.offset + done as u64) / 4096 * 4096;
                    if end > released {
                        t.file.release(released, end - released);
                        released = end;
                    }
                }
            }
            pos = offset + nbytes;
            tensor_bytes += nbytes;
            progress.advance(nbytes);
        }
        write_padding(&mut w, &mut hasher, lay.file_size - pos).map_err(io(&path))?;
        let f = w.into_inner().map_err(|e| io(&path)(e.into_error()))?;
        start_writeback(&f);
        for (t, _) in ts {
            t.release();
        }
        written.push((f, path));
        file_bytes += lay.file_size;
        builder.add_layer(&LayerRecord {
            name,
            file,
            kind,
            index,
            tensors: specs,
            layout: lay,
            content_hash: *hasher.finalize().as_bytes(),
        });
    }

    for (f, path) in written {
        f.sync_all().map_err(io(&path))?;
    }
    Ok((tensor_bytes, file_bytes))
}

/// Converts `input` into a GdsLLM directory at `out_dir`. On any error nothing is left at
/// `out_dir` (an existing directory replaced with `force` stays as it was).
///
/// With `force`, an existing `out_dir` is replaced only when it holds nothing but a model
/// (`manifest.gdsm`, the layer files it names, `tokenizer.json`, `tokenizer_config.json`,
/// `generation_config.json`, `layers/`) and does not
/// hold the input; otherwise [`ConvertError::ReplaceRefused`] lists what would be lost.
/// The output is written in a locked staging directory beside `out_dir` (see
/// `staging.rs`); staging directories of killed conversions in the same parent are removed
/// first, each with a warning.
pub fn convert(
    input: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary, ConvertError> {
    let t0 = Instant::now();
    if out_dir.file_name().is_none() {
        return Err(ConvertError::BadOutput {
            path: out_dir.into(),
            msg: "the output path has no directory name".into(),
        });
    }
    check_output(input, out_dir, opts.force)?;
    let parent = crate::staging::parent_of(out_dir);
    // Killed conversions' leftovers go first, whatever becomes of this one.
    let stale = crate::staging::remove_stale(&parent);
    let mut source = open_source(input)?;
    crate::check::check_source(&source, input)?;
    check_hparams(&source, input)?;
    let keep = |w: &String| opts.tokenizer.is_none() || !w.starts_with("tokenizer");
    let mut warnings: Vec<String> = source
        .warnings
        .iter()
        .filter(|w| keep(w))
        .cloned()
        .collect();
    warnings.extend(stale.iter().map(|d| {
        format!(
            "removed {}, left behind by a conversion that was killed",
            d.display()
        )
    }));
    // The tokenizer files are made on a thread of their own while the layers are written
    // (a GGUF's 262k-token vocabulary takes as long to export as its weights to write); a
    // conversion that cannot produce a tokenizer fails at the end, its staging removed.
    let tokenizer_job = {
        let given = std::mem::take(&mut source.tokenizer);
        let pending = source.pending_tokenizer.take();
        let why: Vec<String> = source
            .warnings
            .iter()
            .filter(|w| w.starts_with("tokenizer"))
            .cloned()
            .collect();
        let user = opts.tokenizer.clone();
        let template = opts.chat_template_file.clone();
        let vocab = meta_u64(&source.metadata, "model.vocab_size");
        move || {
            tokenizer_files(
                input,
                user.as_deref(),
                template.as_deref(),
                given,
                pending,
                why,
                vocab,
            )
        }
    };

    // group into layers, deterministic order: by name, a block's routed experts last (one
    // range for the rest, which a reader streaming experts apart reads whole)
    let mut by_group: BTreeMap<Group, Vec<&SourceTensor>> = BTreeMap::new();
    for t in &source.tensors {
        by_group.entry(group_of(&t.name)).or_default().push(t);
    }
    let mut groups: Vec<(Group, Vec<&SourceTensor>)> = by_group.into_iter().collect();
    for (_, ts) in &mut groups {
        ts.sort_by(|a, b| {
            let expert = |t: &SourceTensor| gds_format::arch::is_routed_expert(&t.name);
            (expert(a), &a.name).cmp(&(expert(b), &b.name))
        });
        if let Some(w) = ts.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(ConvertError::BadTensor {
                path: w[0].file.path.clone(),
                tensor: w[0].name.clone(),
                msg: "tensor name appears twice".into(),
            });
        }
    }
    let (mut skipped_quant, mut fell_back) = (0usize, 0usize);
    let mut mix_ctx = MixContext::of(source.tensors.iter().map(|t| t.name.as_str()));
    mix_ctx.n_gqa = n_gqa(&source.metadata);
    mix_ctx.type_70b = llama_cpp_70b(&source.metadata);
    mix_ctx.n_expert = meta_u64(&source.metadata, "model.n_expert")
        .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
    let planner = Planner::new(opts, mix_ctx, &source.tensors);
    let mut decided = Vec::new();
    let plans: Vec<(Group, Vec<(&SourceTensor, DType)>)> = groups
        .iter()
        .map(|(g, ts)| {
            let v = ts
                .iter()
                .map(|t| {
                    let p = planner.plan(t);
                    skipped_quant += (p.misfit == Misfit::KeptFloat) as usize;
                    fell_back += (p.misfit == Misfit::FellBack) as usize;
                    decided.push(p.by);
                    (*t, p.dtype)
                })
                .collect();
            (*g, v)
        })
        .collect();
    let all: Vec<&SourceTensor> = plans
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.0))
        .collect();
    warnings.extend(override_warnings(opts, &all, &decided));
    if fell_back > 0 {
        warnings.push(format!(
            "{fell_back} tensors quantized to llama.cpp's fallback type (q2_k/q3_k -> q4_0, q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0): their rows are not a whole number of 256-value blocks"
        ));
    }
    if skipped_quant > 0 {
        warnings.push(format!(
            "{skipped_quant} tensors kept as float: their rows are not a whole number of 32-value blocks (the smallest of the quantized types)"
        ));
    }
    let total: u64 = plans
        .iter()
        .flat_map(|(_, v)| v.iter())
        .map(|(t, d)| d.tensor_bytes(&t.shape).unwrap_or(0))
        .sum();
    let imatrix = match &opts.imatrix {
        None => None,
        Some(p) => {
            let m = crate::imatrix::read_imatrix(p)?;
            warnings.extend(imatrix_warnings(&m, &plans)?);
            Some(m)
        }
    };

    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let staging = crate::staging::Staging::create(out_dir, &parent)?;
    let tmp = staging.model();
    std::fs::create_dir(tmp.join("layers")).map_err(io(&tmp))?;
    progress.start(total);

    let mut builder = ManifestBuilder::new();
    let mut meta = source.metadata.clone();
    meta.insert(
        "convert.quant".into(),
        MetaValue::Str(opts.quant.to_string()),
    );
    meta.insert(
        "convert.requantize".into(),
        MetaValue::Bool(opts.requantize),
    );
    if !opts.overrides.is_empty() {
        // a JSON array of the REGEX=TYPE strings, in order
        let list: Vec<String> = opts.overrides.iter().map(|o| o.to_string()).collect();
        meta.insert(
            "convert.quant_overrides".into(),
            MetaValue::Str(serde_json::to_string(&list).unwrap_or_default()),
        );
    }
    if let Some(p) = &opts.imatrix {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        meta.insert("convert.imatrix".into(), MetaValue::Str(name));
    }
    let src_name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    meta.insert("convert.source".into(), MetaValue::Str(src_name));
    meta.insert(
        "convert.tool".into(),
        MetaValue::Str(concat!("gdsconv ", env!("CARGO_PKG_VERSION")).into()),
    );
    for (k, v) in &meta {
        put_meta(&mut builder, k, v);
    }

    // the tokenizer thread writes its files too (written back while the layers are made)
    let aux_job = || {
        tokenizer_job().and_then(|mut t| {
            if t.generation.is_none() {
                t.generation.clone_from(&opts.generation_config);
            }
            write_aux(&tmp, t)
        })
    };
    let (written, tok) = std::thread::scope(|sc| {
        let tok = sc.spawn(aux_job);
        let written = write_layers(
            &plans,
            &tmp,
            input,
            imatrix.as_ref(),
            &mut builder,
            progress,
        );
        (written, tok.join())
    });
    let (tensor_bytes, file_bytes) = written?;
    let (tok_warnings, aux) = match tok {
        Ok(t) => t?,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    warnings.extend(tok_warnings.into_iter().filter(|w| keep(w)));
    let n_tensors: usize = plans.iter().map(|(_, v)| v.len()).sum();

    // Every other file of the directory is hashed in the manifest too (format 1.1).
    for a in aux {
        a.file.sync_all().map_err(io(&a.path))?;
        builder.add_file(a.name, a.role, a.len, a.hash);
    }
    let manifest = builder.finish();
    if manifest.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(ConvertError::BadInput {
            path: input.into(),
            msg: format!(
                "its metadata and tensor table take {} bytes in a manifest, more than the {MAX_MANIFEST_BYTES} a manifest may hold",
                manifest.len()
            ),
        });
    }
    write_file(&tmp.join(MANIFEST_FILE), &manifest)?;
    progress.finish();

    // Check what we wrote before anyone can see it. The input was checked before writing,
    // so a failure here is the converter's own bug.
    let report = crate::validate::validate_dir(&tmp, crate::validate::Depth::Structure);
    if !report.errors.is_empty() {
        return Err(ConvertError::Internal {
            input: input.into(),
            msg: format!("the written model is invalid: {}", report.errors.join("; ")),
        });
    }

    // commit: OUT_DIR may have changed while we worked
    let now = check_output(input, out_dir, opts.force)?;
    staging.commit(out_dir, now == Existing::Model)?;
    Ok(ConvertSummary {
        arch: source.arch.clone(),
        runnable: source.runnable,
        tensors: n_tensors,
        layers: plans.len(),
        tensor_bytes,
        file_bytes,
        seconds: t0.elapsed().as_secs_f64(),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::MappedFile;
    use std::sync::Arc;

    /// The matrices of a dense llama with `n` layers (GGUF names).
    fn llama_names(n: u32, tied: bool) -> Vec<String> {
        let mut v = vec!["token_embd.weight".to_string()];
        if !tied {
            v.push("output.weight".into());
        }
        for i in 0..n {
            for t in [
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ] {
                v.push(format!("blk.{i}.{t}.weight"));
            }
        }
        v
    }

    /// The table llama.cpp's rules give, written out by hand per layer count: which layers'
    /// attn_v and ffn_down get more bits under Q4_K_M / Q5_K_M (`use_more_bits`: the first
    /// and last eighth and every third layer between), under Q4_K_S (attn_v of layers
    /// 0..4, ffn_down of the first eighth), under Q3_K_M (attn_v of layers 0..2 and ffn_down
    /// of the first sixteenth Q5_K, the rest of them and attn_output Q4_K), Q3_K_L (all
    /// three Q5_K) and Q2_K (all three Q3_K; attn_v Q4_K from 4 query heads per KV head).
    fn expected(mix: QuantMix, n: u32, name: &str, tied: bool, gqa: u32) -> DType {
        use QuantMix::*;
        let more: &[u32] = match n {
            16 => &[0, 1, 4, 7, 10, 13, 14, 15],
            32 => &[0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31],
            _ => unreachable!(),
        };
        let base = mix.base();
        if name == "output.weight" || (tied && name == "token_embd.weight") {
            return DType::Q6K;
        }
        let Some(rest) = name.strip_prefix("blk.") else {
            return base;
        };
        let (i, t) = rest.split_once('.').unwrap();
        let i: u32 = i.parse().unwrap();
        match (mix, t) {
            (Q4KM | Q5KM, "attn_v.weight" | "ffn_down.weight") if more.contains(&i) => DType::Q6K,
            (Q4KS, "attn_v.weight") if i < 4 => DType::Q5K,
            (Q4KS, "ffn_down.weight") if i < n / 8 => DType::Q5K,
            (Q3KM, "attn_v.weight") if i < 2 => DType::Q5K,
            (Q3KM, "ffn_down.weight") if i < n / 16 => DType::Q5K,
            (Q3KM, "attn_v.weight" | "ffn_down.weight" | "attn_output.weight") => DType::Q4K,
            (Q3KL, "attn_v.weight" | "ffn_down.weight" | "attn_output.weight") => DType::Q5K,
            (Q2K, "attn_v.weight") if gqa >= 4 => DType::Q4K,
            (Q2K, "attn_v.weight" | "ffn_down.weight" | "attn_output.weight") => DType::Q3K,
            _ => base,
        }
    }

    /// llama.cpp's `tensor_type_fallback` table (llama-quant.cpp), and F16/float where even
    /// the 32-value type does not fit.
    #[test]
    fn rows_that_are_not_whole_256_blocks_get_llama_cpps_fallback_type() {
        for (k, to) in [
            (DType::Q2K, DType::Q4_0),
            (DType::Q3K, DType::Q4_0),
            (DType::Q4K, DType::Q5_0),
            (DType::Q5K, DType::Q5_1),
            (DType::Q6K, DType::Q8_0),
        ] {
            assert_eq!(block_fallback(k, 2048), Some(k));
            assert_eq!(block_fallback(k, 576), Some(to), "{k:?}");
            assert_eq!(block_fallback(k, 48), None, "{k:?}");
        }
        assert_eq!(block_fallback(DType::Q8_0, 64), Some(DType::Q8_0));
        assert_eq!(block_fallback(DType::Q4_0, 48), None);
        // through the planner: a 576-column matrix under q4_k_m, and a 48-column one
        let ctx = MixContext::of(["blk.0.attn_q.weight"]);
        let opts = ConvertOptions {
            quant: QuantTarget::Mix(QuantMix::Q4KM),
            ..ConvertOptions::default()
        };
        let t = |cols: u64| planned_tensor("blk.0.attn_q.weight", &[64, cols]);
        let planned = |t: &SourceTensor| {
            let p = Planner::new(&opts, ctx, []).plan(t);
            (p.dtype, p.misfit)
        };
        assert_eq!(planned(&t(576)), (DType::Q5_0, Misfit::FellBack));
        assert_eq!(planned(&t(512)), (DType::Q4K, Misfit::None));
        assert_eq!(planned(&t(48)), (DType::F16, Misfit::KeptFloat));
    }

    #[test]
    fn mixes_choose_per_tensor_as_llama_cpp() {
        for n in [16, 32] {
            for tied in [false, true] {
                let names = llama_names(n, tied);
                let ctx = MixContext::of(names.iter().map(|s| s.as_str()));
                assert_eq!(
                    ctx,
                    MixContext {
                        n_layer: n,
                        n_attn_v: n,
                        tied,
                        n_gqa: 0,
                        type_70b: false,
                        n_expert: 0,
                    }
                );
                for gqa in [1, 4] {
                    let ctx = MixContext { n_gqa: gqa, ..ctx };
                    for mix in QuantMix::ALL {
                        let mut counts = BTreeMap::new();
                        for name in &names {
                            let got = mix_dtype(mix, name, 4096, &ctx);
                            let want = expected(mix, n, name, tied, gqa);
                            assert_eq!(
                                got,
                                want,
                                "{} {n} layers, tied {tied}, gqa {gqa}: {name}",
                                mix.name()
                            );
                            *counts.entry(got.name()).or_insert(0) += 1;
                        }
                        // the hand table itself: Q4_K_M gives 2 * 8 (16 layers) or 2 * 16
                        // (32) tensors Q6_K besides the output head; Q3_K_M 2 + 1 (16) or
                        // 2 + 2 (32) Q5_K; Q2_K 3 per layer Q3_K (2 with 4 heads per KV head)
                        let c = |d: &str| counts.get(d).copied().unwrap_or(0);
                        match mix {
                            QuantMix::Q4KM => assert_eq!(c("q6_k"), 2 * n / 2 + 1, "{counts:?}"),
                            QuantMix::Q3KM => assert_eq!(c("q5_k"), 2 + n / 16, "{counts:?}"),
                            QuantMix::Q2K => {
                                let per = if gqa >= 4 { 2 } else { 3 };
                                assert_eq!(c("q3_k"), per * n, "{counts:?}")
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        // an output head whose rows are not whole 256-blocks gets Q8_0 (llama.cpp's rule)
        let ctx = MixContext::of(["output.weight", "blk.0.attn_v.weight"]);
        assert_eq!(
            mix_dtype(QuantMix::Q4KM, "output.weight", 576, &ctx),
            DType::Q8_0
        );
        // fused QKV (phi3) counts as attn_v
        let ctx = MixContext::of(["blk.0.attn_qkv.weight", "blk.1.attn_qkv.weight"]);
        assert_eq!(ctx.n_attn_v, 2);
        assert_eq!(
            mix_dtype(QuantMix::Q4KM, "blk.1.attn_qkv.weight", 256, &ctx),
            DType::Q6K
        );
    }

    #[test]
    fn query_heads_per_kv_head_from_the_metadata() {
        let meta = |h: Option<u64>, kv: Option<u64>| {
            let mut m = crate::source::Metadata::new();
            if let Some(h) = h {
                m.insert("model.n_heads".into(), MetaValue::U64(h));
            }
            if let Some(kv) = kv {
                m.insert("model.n_kv_heads".into(), MetaValue::U64(kv));
            }
            m
        };
        assert_eq!(n_gqa(&meta(Some(9), Some(3))), 3); // SmolLM2
        assert_eq!(n_gqa(&meta(Some(32), Some(8))), 4);
        assert_eq!(n_gqa(&meta(Some(32), Some(0))), 0);
        assert_eq!(n_gqa(&meta(Some(32), None)), 0);
        assert_eq!(n_gqa(&meta(None, Some(8))), 0);
    }

    /// llama.cpp's `LLM_TYPE_70B` from the hyperparameters, and what it changes: attn_v Q5_K
    /// where the mix gives it Q3_K or Q4_K, nothing else.
    #[test]
    fn a_70b_model_gets_llama_cpps_70b_rule() {
        let meta = |arch: &str, layers: u64, heads: u64, kv: Option<u64>| {
            let mut m = crate::source::Metadata::new();
            m.insert(
                "general.source_architecture".into(),
                MetaValue::Str(arch.into()),
            );
            m.insert("model.n_layers".into(), MetaValue::U64(layers));
            m.insert("model.n_heads".into(), MetaValue::U64(heads));
            if let Some(kv) = kv {
                m.insert("model.n_kv_heads".into(), MetaValue::U64(kv));
            }
            m
        };
        // Llama 2/3 70B: 80 layers, 64 query heads over 8 KV heads
        assert!(llama_cpp_70b(&meta("llama", 80, 64, Some(8))));
        assert!(llama_cpp_70b(&meta("LlamaForCausalLM", 80, 64, Some(8))));
        assert!(llama_cpp_70b(&meta("MistralForCausalLM", 80, 64, Some(8))));
        assert!(llama_cpp_70b(&meta("llama", 80, 16, Some(8)))); // any n_head != n_head_kv
                                                                 // LLaMA 65B: 80 layers, as many KV heads as query heads (stated or not): LLM_TYPE_65B
        assert!(!llama_cpp_70b(&meta("llama", 80, 64, Some(64))));
        assert!(!llama_cpp_70b(&meta("llama", 80, 64, None)));
        assert!(!llama_cpp_70b(&meta("LlamaForCausalLM", 80, 64, Some(64))));
        // other layer counts
        for layers in [16, 32, 60, 79, 81, 126] {
            assert!(
                !llama_cpp_70b(&meta("llama", layers, 64, Some(8))),
                "{layers}"
            );
        }
        // 8 experts are LLM_TYPE_8x7B / 8x22B / unknown in llama.cpp, never 70B
        let mut moe = meta("llama", 80, 64, Some(8));
        moe.insert("gguf.llama.expert_count".into(), MetaValue::U64(8));
        assert!(!llama_cpp_70b(&moe));
        // qwen2: every 80-layer model, whatever its heads (Qwen2 72B; Qwen1.5 72B has 64 KV
        // heads)
        assert!(llama_cpp_70b(&meta("qwen2", 80, 64, Some(8))));
        assert!(llama_cpp_70b(&meta("qwen2", 80, 64, Some(64))));
        assert!(llama_cpp_70b(&meta("Qwen2ForCausalLM", 80, 64, Some(64))));
        assert!(!llama_cpp_70b(&meta("qwen2", 64, 40, Some(8))));
        // no 70B type in llama.cpp for these
        for arch in [
            "qwen3",
            "gemma2",
            "gemma3",
            "phi3",
            "Qwen3ForCausalLM",
            "unknown",
        ] {
            assert!(!llama_cpp_70b(&meta(arch, 80, 64, Some(8))), "{arch}");
        }
        assert!(!llama_cpp_70b(&crate::source::Metadata::new()));

        // the types: 80 layers, 64 heads over 8 KV heads (n_gqa 8) and 16 over 8 (n_gqa 2,
        // where q2_k's attn_v would be Q3_K), against the 65B shape (n_gqa 1)
        let names = llama_names(80, false);
        let base = MixContext::of(names.iter().map(|s| s.as_str()));
        let more = |i: i64| use_more_bits(i, 80);
        for (heads, kv) in [(64, 8), (16, 8)] {
            let m = meta("llama", 80, heads, Some(kv));
            let ctx = MixContext {
                n_gqa: n_gqa(&m),
                type_70b: llama_cpp_70b(&m),
                ..base
            };
            assert!(ctx.type_70b);
            let m65 = meta("llama", 80, 64, Some(64));
            let ctx65 = MixContext {
                n_gqa: n_gqa(&m65),
                type_70b: llama_cpp_70b(&m65),
                ..base
            };
            assert!(!ctx65.type_70b);
            for mix in QuantMix::ALL {
                for name in &names {
                    let got = mix_dtype(mix, name, 8192, &ctx);
                    let got65 = mix_dtype(mix, name, 8192, &ctx65);
                    let Some(i) = name
                        .strip_prefix("blk.")
                        .and_then(|r| r.strip_suffix(".attn_v.weight"))
                    else {
                        // only attn_v changes
                        let plain = mix_dtype(
                            mix,
                            name,
                            8192,
                            &MixContext {
                                type_70b: false,
                                ..ctx
                            },
                        );
                        assert_eq!(got, plain, "{} {name}", mix.name());
                        assert_eq!(
                            got65,
                            mix_dtype(mix, name, 8192, &MixContext { n_gqa: 1, ..base })
                        );
                        continue;
                    };
                    let i: i64 = i.parse().unwrap();
                    use QuantMix::*;
                    let want = match mix {
                        Q4KM | Q5KM if more(i) => DType::Q6K,
                        _ => DType::Q5K,
                    };
                    assert_eq!(got, want, "{} heads {heads}/{kv}: {name}", mix.name());
                    let want65 = match mix {
                        Q2K | Q3KS => DType::Q3K,
                        Q3KM if i < 2 => DType::Q5K,
                        Q3KM => DType::Q4K,
                        Q3KL => DType::Q5K,
                        Q4KS if i < 4 => DType::Q5K,
                        Q4KM | Q5KM if more(i) => DType::Q6K,
                        Q4KS | Q4KM => DType::Q4K,
                        Q5KS | Q5KM => DType::Q5K,
                    };
                    assert_eq!(got65, want65, "65B {}: {name}", mix.name());
                }
            }
        }
        // q4_k_m of a 70B: 2 * 40 + 1 Q6_K (use_more_bits picks 40 of 80 layers), the other
        // 40 attn_v Q5_K; q3_k_m: every attn_v Q5_K, and the first 5 ffn_down
        let ctx = MixContext {
            n_gqa: 8,
            type_70b: true,
            ..base
        };
        let count = |mix, d: DType| {
            names
                .iter()
                .filter(|n| mix_dtype(mix, n, 8192, &ctx) == d)
                .count()
        };
        assert_eq!((0..80).filter(|&i| more(i)).count(), 40);
        assert_eq!(count(QuantMix::Q4KM, DType::Q6K), 2 * 40 + 1);
        assert_eq!(count(QuantMix::Q4KM, DType::Q5K), 40);
        assert_eq!(count(QuantMix::Q3KM, DType::Q5K), 80 + 5);
        assert_eq!(count(QuantMix::Q2K, DType::Q5K), 80);
        // a Q5_K attn_v whose rows are not whole 256-blocks falls back as the mix's would
        let opts = ConvertOptions {
            quant: QuantTarget::Mix(QuantMix::Q3KS),
            ..ConvertOptions::default()
        };
        let t = |cols: u64| planned_tensor("blk.40.attn_v.weight", &[64, cols]);
        let planner = Planner::new(&opts, ctx, []);
        assert_eq!(planner.dtype(&t(8192)), DType::Q5K);
        assert_eq!(planner.dtype(&t(576)), DType::Q5_1);
    }

    /// llama.cpp's 8-expert rules (Mixtral-8x7B): attn_v and attn_k Q8_0 under every mix,
    /// attn_output Q5_K under the mixes below Q5 but q3_k_l, which keeps its base; the
    /// experts follow the dense rules (ffn_down_exps by its layer's `use_more_bits`). Other
    /// expert counts get the dense rules. (`scripts/check-quant-mixes.py --only-moe`
    /// compares whole conversions with llama-quantize: 0 of 18 runs differ.)
    #[test]
    fn eight_experts_get_llama_cpps_8_expert_rules() {
        let ctx = |n_expert| MixContext {
            n_layer: 32,
            n_attn_v: 32,
            n_expert,
            ..MixContext::default()
        };
        for mix in QuantMix::ALL {
            let at = |name: &str, n| mix_dtype(mix, name, 4096, &ctx(n));
            assert_eq!(at("blk.5.attn_v.weight", 8), DType::Q8_0, "{mix:?}");
            assert_eq!(at("blk.5.attn_k.weight", 8), DType::Q8_0, "{mix:?}");
            assert_eq!(at("blk.5.attn_q.weight", 8), mix.base(), "{mix:?}");
            let out = match mix {
                QuantMix::Q3KL | QuantMix::Q5KS | QuantMix::Q5KM => mix.base(),
                _ => DType::Q5K,
            };
            assert_eq!(at("blk.5.attn_output.weight", 8), out, "{mix:?}");
            for (name, n) in [("attn_v", 4), ("attn_k", 4), ("attn_output", 128)] {
                let name = format!("blk.5.{name}.weight");
                assert_eq!(
                    at(&name, n),
                    at(&name, 0),
                    "{mix:?} {name} with {n} experts"
                );
            }
            for l in [0, 5, 31] {
                assert_eq!(
                    at(&format!("blk.{l}.ffn_down_exps.weight"), 8),
                    at(&format!("blk.{l}.ffn_down.weight"), 0),
                    "{mix:?} layer {l}"
                );
            }
        }
    }

    #[test]
    fn quant_names_parse() {
        for (s, want) in [
            ("q5_0", QuantTarget::To(DType::Q5_0)),
            ("Q5_1", QuantTarget::To(DType::Q5_1)),
            ("q2_k", QuantTarget::Mix(QuantMix::Q2K)),
            ("Q3_K_S", QuantTarget::Mix(QuantMix::Q3KS)),
            ("q3_k_m", QuantTarget::Mix(QuantMix::Q3KM)),
            ("q3_k_l", QuantTarget::Mix(QuantMix::Q3KL)),
            ("q3_k", QuantTarget::To(DType::Q3K)),
            ("q4_k", QuantTarget::To(DType::Q4K)),
            ("q5_k", QuantTarget::To(DType::Q5K)),
            ("q6_k", QuantTarget::To(DType::Q6K)),
            ("q4_k_m", QuantTarget::Mix(QuantMix::Q4KM)),
            ("Q4_K_S", QuantTarget::Mix(QuantMix::Q4KS)),
            ("q5_k_m", QuantTarget::Mix(QuantMix::Q5KM)),
            ("q5_k_s", QuantTarget::Mix(QuantMix::Q5KS)),
        ] {
            let got: QuantTarget = s.parse().unwrap();
            assert_eq!(got, want, "{s}");
            assert_eq!(got.to_string(), s.to_ascii_lowercase());
        }
        for bad in ["q8_k", "q8_1", "i32", "q4_k_l", ""] {
            let e = bad.parse::<QuantTarget>().unwrap_err();
            assert!(e.contains("q4_k_m"), "{e}");
        }
    }

    #[test]
    fn a_tensor_quantized_in_row_chunks_is_the_tensor_quantized_whole() {
        // two experts of 5 rows x 512 (F16), to Q4_K with and without per-expert weights
        // and to Q8_0: chunks of one row, of three (not dividing an expert), and whole
        let (rows, cols) = (10usize, 512usize);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i / cols) as f32))
            .collect();
        let f16 = gds_kernels::quantize(DType::F16, &vals).unwrap();
        let t = SourceTensor {
            name: "blk.0.ffn_down_exps.weight".into(),
            source_name: "x".into(),
            dtype: DType::F16,
            shape: vec![2, 5, cols as u64],
            file: Arc::new(MappedFile::from_bytes("t".into(), &f16).unwrap()),
            offset: 0,
            nbytes: f16.len() as u64,
            transform: Transform::None,
            layout: crate::source::Layout::Plain,
        };
        let w: Vec<f32> = (0..2 * cols).map(|i| 0.5 + (i % 13) as f32).collect();
        for (out, weights) in [
            (DType::Q4K, None),
            (DType::Q4K, Some(&w[..])),
            (DType::Q8_0, None),
        ] {
            let whole = produce_in(&t, out, weights, usize::MAX).unwrap();
            for chunk in [1, cols, 3 * cols] {
                let pieces = produce_in(&t, out, weights, chunk).unwrap();
                assert_eq!(
                    pieces,
                    whole,
                    "{out} weights {} chunk {chunk}",
                    weights.is_some()
                );
            }
            if weights.is_none() {
                let direct = gds_kernels::quantize(out, &gds_kernels_f32(&f16)).unwrap();
                assert_eq!(&whole[..], &direct[..], "{out}");
            }
        }
        // the anonymous mapping's bytes survive the releases
        assert_eq!(&t.bytes()[..], &f16[..]);
    }

    fn gds_kernels_f32(f16: &[u8]) -> Vec<f32> {
        let mut f = vec![0f32; f16.len() / 2];
        gds_kernels::dequantize(DType::F16, f16, &mut f).unwrap();
        f
    }

    /// A float matrix (or vector) of `shape`, named `name`, with no data (only planned).
    fn planned_tensor(name: &str, shape: &[u64]) -> SourceTensor {
        SourceTensor {
            name: name.into(),
            source_name: name.into(),
            dtype: DType::F16,
            shape: shape.to_vec(),
            file: Arc::new(MappedFile::from_bytes("t".into(), &[]).unwrap()),
            offset: 0,
            nbytes: 0,
            transform: Transform::None,
            layout: crate::source::Layout::Plain,
        }
    }

    #[test]
    fn quant_overrides_parse_and_refuse_clearly() {
        let o: QuantOverride = r"blk\.[0-3]\.attn_v=Q8_0".parse().unwrap();
        assert_eq!(o.pattern, r"blk\.[0-3]\.attn_v");
        assert_eq!(o.dtype, DType::Q8_0);
        assert_eq!(o.to_string(), r"blk\.[0-3]\.attn_v=q8_0");
        // searched anywhere in the name, letters in either case (llama-quantize lowercases
        // the pattern)
        assert!(o.matches("blk.2.attn_v.weight"));
        assert!(!o.matches("blk.4.attn_v.weight"));
        assert!("ATTN_V=q4_k"
            .parse::<QuantOverride>()
            .unwrap()
            .matches("blk.0.attn_v.weight"));
        // split at the last '=': a regex may hold one
        let o: QuantOverride = "a=b=q4_0".parse().unwrap();
        assert_eq!((o.pattern.as_str(), o.dtype), ("a=b", DType::Q4_0));
        for (ty, d) in [
            ("f32", DType::F32),
            ("f16", DType::F16),
            ("bf16", DType::BF16),
            ("q8_0", DType::Q8_0),
            ("q4_0", DType::Q4_0),
            ("q4_1", DType::Q4_1),
            ("q5_0", DType::Q5_0),
            ("q5_1", DType::Q5_1),
            ("q2_k", DType::Q2K),
            ("q3_k", DType::Q3K),
            ("q4_k", DType::Q4K),
            ("q5_k", DType::Q5K),
            ("Q6_K", DType::Q6K),
        ] {
            assert_eq!(format!("x={ty}").parse::<QuantOverride>().unwrap().dtype, d);
        }
        for (bad, needle) in [
            ("attn_v", "expected REGEX=TYPE"),
            ("attn_v=q7_0", "unknown type \"q7_0\""),
            ("attn_v=q4_k_m", "unknown type \"q4_k_m\""),
            ("attn_v=keep", "unknown type"),
            ("attn_v=q8_k", "unknown type"),
            ("attn_v=i32", "unknown type"),
            ("=q8_0", "regex before '=' is empty"),
            (
                "(attn=Q8_0",
                "--quant-override (attn=Q8_0: \"(attn\" is not a valid regex",
            ),
            ("attn[=q8_0", "not a valid regex"),
        ] {
            let e = bad.parse::<QuantOverride>().unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
            assert!(e.starts_with("--quant-override "), "{bad}: {e}");
        }
        let e = "x=q9_0".parse::<QuantOverride>().unwrap_err();
        assert!(e.contains("x=q9_0") && e.contains(OVERRIDE_TYPES), "{e}");
    }

    /// A mixture of experts' router is F32 under every policy and override (llama.cpp's
    /// converter writes it so, llama-quantize leaves `ffn_gate_inp`); its experts are
    /// quantized as ffn matrices.
    #[test]
    fn the_router_of_a_mixture_of_experts_is_never_quantized() {
        let router = planned_tensor("blk.0.ffn_gate_inp.weight", &[128, 2048]);
        let experts = planned_tensor("blk.0.ffn_up_exps.weight", &[128, 768, 2048]);
        for quant in [
            QuantTarget::To(DType::Q4_0),
            QuantTarget::Mix(QuantMix::Q4KM),
        ] {
            let opts = ConvertOptions {
                quant,
                overrides: vec!["ffn_gate_inp=q8_0".parse().unwrap()],
                ..ConvertOptions::default()
            };
            let names = ["blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight"];
            let p = Planner::new(&opts, MixContext::of(names), [&router, &experts]);
            assert_eq!(p.plan(&router).dtype, DType::F32, "{quant:?}");
            assert!(p.plan(&experts).dtype.is_quantized(), "{quant:?}");
            // the override that names only the router decides nothing: warned
            let w = override_warnings(&opts, &[&router, &experts], &[None, None]);
            assert_eq!(w.len(), 1, "{w:?}");
        }
    }

    /// gpt-oss's per-expert biases are 2-D (`[E, ffe]`) but biases: F32 under every policy and
    /// override, as llama.cpp's converter writes them and llama-quantize leaves them (it
    /// quantizes only `*weight`), beside the expert weights, which are quantized.
    #[test]
    fn expert_biases_stay_f32() {
        let bias = planned_tensor("blk.0.ffn_gate_exps.bias", &[32, 2880]);
        let weight = planned_tensor("blk.0.ffn_gate_exps.weight", &[32, 2880, 2880]);
        for quant in [
            QuantTarget::Keep,
            QuantTarget::To(DType::Q8_0),
            QuantTarget::Mix(QuantMix::Q4KM),
        ] {
            let opts = ConvertOptions {
                quant,
                overrides: vec!["exps=q4_0".parse().unwrap()],
                ..ConvertOptions::default()
            };
            let names = ["blk.0.ffn_gate_exps.bias", "blk.0.ffn_gate_exps.weight"];
            let p = Planner::new(&opts, MixContext::of(names), [&bias, &weight]);
            assert_eq!(p.plan(&bias).dtype, DType::F32, "{quant:?}");
            assert_eq!(p.plan(&weight).dtype, DType::Q4_0, "{quant:?}");
        }
    }

    /// After the mix, the first override that matches decides; types that do not fit the
    /// rows fall back as the mixes' do; 1-D tensors stay F32; and llama.cpp's counting of
    /// the attn_v / ffn_down tensors its mix decides skips the overridden ones.
    #[test]
    fn overrides_decide_after_the_mix_first_match_wins() {
        let names = llama_names(16, false);
        let ctx = MixContext::of(names.iter().map(|s| s.as_str()));
        let ov = |list: &[&str]| -> Vec<QuantOverride> {
            list.iter().map(|s| s.parse().unwrap()).collect()
        };
        let opts = ConvertOptions {
            quant: QuantTarget::Mix(QuantMix::Q4KM),
            overrides: ov(&[
                r"blk\.3\.ffn_down=q8_0",
                "ffn_down=q4_0",
                "attn_q=q6_k",
                "norm=q8_0",
                "output=f16",
            ]),
            ..ConvertOptions::default()
        };
        let tensors: Vec<SourceTensor> = names
            .iter()
            .map(|n| planned_tensor(n, &[512, 512]))
            .chain([planned_tensor("blk.0.attn_norm.weight", &[512])])
            .collect();
        let p = Planner::new(&opts, ctx, &tensors);
        let got = |name: &str, cols: u64| {
            let p = p.plan(&planned_tensor(name, &[512, cols]));
            (p.dtype, p.misfit, p.by)
        };
        // first match wins: blk.3's ffn_down by the first, the others by the second
        assert_eq!(
            got("blk.3.ffn_down.weight", 512),
            (DType::Q8_0, Misfit::None, Some(0))
        );
        assert_eq!(
            got("blk.0.ffn_down.weight", 512),
            (DType::Q4_0, Misfit::None, Some(1))
        );
        assert_eq!(
            got("blk.15.ffn_down.weight", 512),
            (DType::Q4_0, Misfit::None, Some(1))
        );
        // a 256-block type on rows of 576: llama.cpp's fallback (Q6_K -> Q8_0)
        assert_eq!(
            got("blk.0.attn_q.weight", 512),
            (DType::Q6K, Misfit::None, Some(2))
        );
        assert_eq!(
            got("blk.0.attn_q.weight", 576),
            (DType::Q8_0, Misfit::FellBack, Some(2))
        );
        // a 32-block type on rows of 48: stays float
        assert_eq!(
            got("blk.3.ffn_down.weight", 48),
            (DType::F16, Misfit::KeptFloat, Some(0))
        );
        // norms are matched but never quantized
        let norm = p.plan(&planned_tensor("blk.0.attn_norm.weight", &[512]));
        assert_eq!((norm.dtype, norm.by), (DType::F32, None));
        // a float type
        assert_eq!(
            got("output.weight", 512),
            (DType::F16, Misfit::None, Some(4))
        );
        // what no override matches is the mix's: attn_k Q4_K
        assert_eq!(
            got("blk.0.attn_k.weight", 512),
            (DType::Q4K, Misfit::None, None)
        );
        // every ffn_down is overridden, so no count shifts for attn_v: layers 0, 1, 4, 7 ...
        for (layer, want) in [
            (0, DType::Q6K),
            (1, DType::Q6K),
            (2, DType::Q4K),
            (4, DType::Q6K),
        ] {
            assert_eq!(
                got(&format!("blk.{layer}.attn_v.weight"), 512).0,
                want,
                "{layer}"
            );
        }

        // attn_v of layer 0 overridden: llama.cpp counts blk.1's attn_v as its 0th, blk.2's
        // as its 1st, ..., so use_more_bits (layers 0, 1, 4, 7, 10, 13, 14, 15 of 16)
        // picks blk.1, blk.2, blk.5, blk.8, blk.11, blk.14, blk.15 (and would pick blk.16)
        let opts = ConvertOptions {
            overrides: ov(&[r"blk\.0\.attn_v\.=q8_0"]),
            ..opts
        };
        let p = Planner::new(&opts, ctx, &tensors);
        let more: Vec<u32> = (0..16)
            .filter(|i| {
                p.dtype(&planned_tensor(
                    &format!("blk.{i}.attn_v.weight"),
                    &[512, 512],
                )) == DType::Q6K
            })
            .collect();
        assert_eq!(more, [1, 2, 5, 8, 11, 14, 15]);
        // ffn_down is not shifted (no ffn_down is overridden)
        let more: Vec<u32> = (0..16)
            .filter(|i| {
                p.dtype(&planned_tensor(
                    &format!("blk.{i}.ffn_down.weight"),
                    &[512, 512],
                )) == DType::Q6K
            })
            .collect();
        assert_eq!(more, [0, 1, 4, 7, 10, 13, 14, 15]);

        // a single type (llama-quantize --pure): overrides apply the same way; `keep`:
        // only the overridden matrices change
        for quant in [QuantTarget::To(DType::Q5_0), QuantTarget::Keep] {
            let opts = ConvertOptions {
                quant,
                overrides: ov(&["attn_v=q8_0"]),
                ..ConvertOptions::default()
            };
            let p = Planner::new(&opts, ctx, &tensors);
            let q = |n: &str| p.dtype(&planned_tensor(n, &[512, 512]));
            assert_eq!(q("blk.0.attn_v.weight"), DType::Q8_0);
            let other = match quant {
                QuantTarget::To(d) => d,
                _ => DType::F16,
            };
            assert_eq!(q("blk.0.attn_q.weight"), other);
        }
    }

    #[test]
    fn overrides_that_change_nothing_are_warned_about() {
        let t = |n: &str, shape: &[u64]| planned_tensor(n, shape);
        let tensors = [
            t("blk.0.attn_v.weight", &[64, 64]),
            t("blk.0.attn_norm.weight", &[64]),
        ];
        let refs: Vec<&SourceTensor> = tensors.iter().collect();
        let opts = ConvertOptions {
            quant: QuantTarget::To(DType::Q8_0),
            overrides: ["attn_v=q4_0", "v=q5_0", "norm=q8_0", "mlp=q8_0"]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect(),
            ..ConvertOptions::default()
        };
        let p = Planner::new(&opts, MixContext::default(), &tensors);
        let by: Vec<Option<usize>> = tensors.iter().map(|t| p.plan(t).by).collect();
        assert_eq!(by, [Some(0), None]);
        let w = override_warnings(&opts, &refs, &by);
        assert_eq!(w.len(), 3, "{w:?}");
        assert!(
            w[0].starts_with("--quant-override v=q5_0 ") && w[0].contains("earlier"),
            "{w:?}"
        );
        assert!(
            w[1].contains("norm=q8_0") && w[1].contains("never quantized"),
            "{w:?}"
        );
        assert!(
            w[2].contains("mlp=q8_0") && w[2].contains("matches no tensor"),
            "{w:?}"
        );
    }
}
