//! What a model of a known architecture must hold (SPEC.md §5 rule 9): the architecture
//! descriptions of `formats/` and one typed [`Hparams`], checked here once and shared by the
//! converter, `gdsconv validate` and the runtime, so that they agree on what is usable.
//!
//! Every check is bounded by the manifest's own tables: the block count is compared with
//! `model.n_layers` before anything is looked up per block, and nothing is allocated from a
//! value read from a key.

use crate::error::FormatError;
use crate::reader::{Manifest, Value};
use crate::{layer_kind, DType, TensorInfo};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

/// The machine-readable description of an architecture family (`formats/<family>.json`).
#[derive(Debug, Deserialize)]
pub struct FamilySpec {
    /// Canonical family name (the manifest's `general.architecture`).
    pub family: String,
    /// GGUF `general.architecture` values of this family.
    pub gguf_architectures: Vec<String>,
    /// HF `architectures[0]` values of this family.
    pub hf_architectures: Vec<String>,
    /// HF `model_type` values of this family.
    pub hf_model_types: Vec<String>,
    /// How RoPE pairs the dimensions of a head.
    #[serde(default)]
    pub rope: RopeStyle,
    /// HF tensor name → canonical name, `{N}` standing for the block number.
    pub tensors: BTreeMap<String, String>,
    /// Input tensors dropped on conversion.
    pub ignored_tensors: Vec<String>,
    /// Canonical tensors whose rows are permuted from HF's RoPE layout.
    pub rope_permuted: Vec<String>,
    /// Canonical norm tensors that a Hugging Face checkpoint stores as `w - 1` (used as
    /// `x̂·(1 + w)`): the converter adds 1 so that every norm is used as `x̂·w`.
    #[serde(default)]
    pub hf_norm_offset: Vec<String>,
    /// Tensors a converted model must have.
    pub required_tensors: RequiredTensors,
    /// Tensors a model of this family may have (`output.weight` is required when the
    /// embeddings are not tied).
    #[serde(default)]
    pub optional_tensors: RequiredTensors,
    /// Expected shape of every tensor, as symbols: `d` = n_embd, `q` = n_heads·head_dim,
    /// `kv` = n_kv_heads·head_dim, `ff` = n_ff, `V` = vocab_size, `hd` = head_dim,
    /// `hd2` = head_dim/2, `rd2` = rope_dims/2.
    #[serde(default)]
    pub shapes: BTreeMap<String, Vec<String>>,
    /// Metadata keys a converted model must have, with their types.
    pub required_metadata: BTreeMap<String, String>,
    /// Family-specific manifest keys read from GGUF keys `<arch>.<suffix>`.
    #[serde(default)]
    pub gguf_keys: BTreeMap<String, String>,
    /// Values of family-specific keys that GGUF does not carry (llama.cpp hard-codes them).
    #[serde(default)]
    pub gguf_defaults: BTreeMap<String, serde_json::Value>,
    /// Family-specific manifest keys read from `config.json` keys.
    #[serde(default)]
    pub hf_keys: BTreeMap<String, String>,
    /// Values used when `config.json` does not have a key (transformers' config defaults).
    #[serde(default)]
    pub hf_defaults: BTreeMap<String, serde_json::Value>,
    /// A chat template for models of this family whose files carry none.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Fused input tensors (canonical name, `{N}` for the block) that the converter splits
    /// by rows into the listed canonical tensors, in order, each as many rows as its shape
    /// symbol (Phi-3's `attn_qkv` → `attn_q`, `attn_k`, `attn_v`). A converted model has
    /// only the parts.
    #[serde(default)]
    pub fused: BTreeMap<String, Vec<(String, String)>>,
    /// Canonical tensors a Hugging Face checkpoint stores as one tensor per expert (the HF
    /// name, `{N}` the block and `{E}` the expert): the converter stacks experts `0..E` in
    /// order into the canonical `[E, …]` tensor, as GGUF stores them.
    #[serde(default)]
    pub hf_stacked: BTreeMap<String, String>,
}

/// Tensors by scope.
#[derive(Debug, Default, Deserialize)]
pub struct RequiredTensors {
    /// Outside the blocks.
    pub global: Vec<String>,
    /// In every block, `{N}` standing for the block number.
    pub block: Vec<String>,
}

/// How RoPE pairs the dimensions of a head (ggml's rope modes).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])` (ggml mode 0; llama's Q/K rows are permuted for it).
    #[default]
    Norm,
    /// Halves `(x[i], x[i + head_dim/2])` (ggml NEOX mode; HF's `rotate_half`).
    Neox,
}

const DESCRIPTIONS: &[&str] = &[
    include_str!("../../../formats/llama.json"),
    include_str!("../../../formats/gemma3.json"),
    include_str!("../../../formats/gemma2.json"),
    include_str!("../../../formats/qwen3.json"),
    include_str!("../../../formats/phi3.json"),
    include_str!("../../../formats/qwen3moe.json"),
    include_str!("../../../formats/smollm3.json"),
    include_str!("../../../formats/gpt_oss.json"),
    include_str!("../../../formats/mixtral.json"),
];

/// Every architecture description of `formats/`, parsed once from the files embedded at
/// build time.
pub fn families() -> &'static [FamilySpec] {
    static SPECS: OnceLock<Vec<FamilySpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        DESCRIPTIONS
            .iter()
            .map(|s| serde_json::from_str(s).expect("formats/*.json are valid (unit-tested)"))
            .collect()
    })
}

/// The description of family `name` (a manifest's `general.architecture`).
pub fn family(name: &str) -> Option<&'static FamilySpec> {
    families().iter().find(|f| f.family == name)
}

/// The family an input's architecture name belongs to: a GGUF `general.architecture`, an
/// HF `architectures[0]` or `model_type`.
pub fn family_of(input_arch: &str) -> Option<&'static FamilySpec> {
    families().iter().find(|f| {
        f.gguf_architectures
            .iter()
            .chain(&f.hf_architectures)
            .chain(&f.hf_model_types)
            .any(|a| a == input_arch)
    })
}

/// The llama family description.
pub fn llama() -> &'static FamilySpec {
    family("llama").expect("formats/llama.json is embedded")
}

impl FamilySpec {
    /// True when `canonical` (a name with its block number, e.g. `blk.3.attn_norm.weight`)
    /// matches one of `patterns`.
    pub fn matches(patterns: &[String], canonical: &str) -> bool {
        patterns.iter().any(|p| match p.split_once("{N}") {
            None => p == canonical,
            Some((pre, post)) => canonical
                .strip_prefix(pre)
                .and_then(|r| r.strip_suffix(post))
                .is_some_and(|mid| !mid.is_empty() && mid.bytes().all(|b| b.is_ascii_digit())),
        })
    }
}

/// Architectures (`general.architecture`) whose models the format can check and `gdsrun`
/// can run.
pub const KNOWN_ARCHS: &[&str] = &[
    "llama", "gemma3", "gemma2", "qwen3", "phi3", "qwen3moe", "smollm3", "gpt_oss", "mixtral",
];

/// Largest value accepted for a dimension or count hyperparameter (2^24).
pub const MAX_DIM: u64 = 1 << 24;

/// A reranker's classifier head, `[labels, n_embd]` (llama.cpp's name; optional in every
/// family; see `tokenizer.rerank_template`).
pub const CLS_OUTPUT: &str = "cls.output.weight";

/// Element types a weight of a known architecture may have: the float and block-quantized
/// types the kernels compute with. Integer and F64 tensors are not weights.
pub const WEIGHT_DTYPES: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q8_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q8K,
    DType::MXFP4,
    DType::Iq4Nl,
    DType::Iq4Xs,
    DType::Iq2Xxs,
    DType::Iq2Xs,
    DType::Iq2S,
    DType::Iq3Xxs,
    DType::Iq3S,
    DType::Iq1S,
    DType::Iq1M,
];

/// How RoPE frequencies are stretched for long contexts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (ggml `freq_scale = 1/factor`).
    Linear {
        /// Stretch factor.
        factor: f64,
    },
    /// Llama 3.1 style: per-frequency divisors, computed as `convert_hf_to_gguf.py` computes
    /// `rope_freqs.weight`.
    Llama3 {
        /// Stretch factor for the low frequencies.
        factor: f64,
        /// Wavelength threshold factor below which frequencies are fully stretched.
        low_freq_factor: f64,
        /// Wavelength threshold factor above which frequencies are kept.
        high_freq_factor: f64,
        /// Context length the base model was trained with.
        original_context_length: f64,
    },
    /// YaRN (gpt-oss, long-context Qwen): each pair's frequency mixed between itself
    /// (extrapolation) and itself divided by `factor` (interpolation) by a ramp over the
    /// pairs between the correction dimensions of `beta_fast` and `beta_slow`, and `cos`/`sin`
    /// scaled by `1 + 0.1 ln factor`; as ggml's `rope_yarn` with `ext_factor` 1 and
    /// llama.cpp's attention factor (the correction range floored/ceiled as
    /// `ggml_rope_yarn_corr_dims` does, unless `truncate` is false: transformers' `truncate`,
    /// false in gpt-oss's own configs).
    Yarn {
        /// Stretch factor.
        factor: f64,
        /// Context length the base model was trained with.
        original_context_length: f64,
        /// Rotations per original context above which a pair is kept (default 32).
        beta_fast: f64,
        /// Rotations per original context below which a pair is fully interpolated (default 1).
        beta_slow: f64,
        /// Whether the correction range is floored/ceiled to whole pairs (default true, as
        /// llama.cpp always does).
        truncate: bool,
    },
}

impl RopeScaling {
    /// The manifest's name of the rule (`model.rope_scaling.type`).
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::None => "none",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// The factor on `cos` and `sin` the rule itself implies: YaRN's `1 + 0.1 ln factor`
    /// (none below a factor of 1), else 1.
    pub fn magnitude(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { factor, .. } if factor > 1.0 => 1.0 + 0.1 * factor.ln(),
            _ => 1.0,
        }
    }
}

/// YaRN's per-pair frequencies for heads rotating `rope_dims` dimensions (see
/// [`RopeScaling::Yarn`]): ggml's `rope_yarn_ramp` over `ggml_rope_yarn_corr_dims`.
pub fn yarn_inv_freq(
    rope_dims: usize,
    theta: f64,
    factor: f64,
    original_ctx: f64,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
) -> Vec<f64> {
    let n = rope_dims as f64;
    // the pair index whose wavelength turns `rot` times in the original context
    let corr = |rot: f64| {
        n * (original_ctx / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (low, high) = (corr(beta_fast), corr(beta_slow));
    let (low, high) = if truncate {
        (low.floor(), high.ceil())
    } else {
        (low, high)
    };
    let (low, high) = (low.max(0.0), high.min(n - 1.0));
    (0..rope_dims / 2)
        .map(|i| {
            let extrap = theta.powf(-((2 * i) as f64) / n);
            let y = (i as f64 - low) / (high - low).max(0.001);
            let mix = 1.0 - y.clamp(0.0, 1.0);
            extrap / factor * (1.0 - mix) + extrap * mix
        })
        .collect()
}

/// Per-pair frequency divisors of Llama 3.1 rope scaling for heads rotating `rope_dims`
/// dimensions, as `convert_hf_to_gguf.py` writes them into `rope_freqs.weight` (and
/// llama.cpp divides the angle by them): pairs whose wavelength is below
/// `original_ctx / high` are kept, above `original_ctx / low` divided by `factor`, and
/// smoothly interpolated between.
pub fn llama3_freq_factors(
    rope_dims: usize,
    theta: f64,
    factor: f64,
    low: f64,
    high: f64,
    original_ctx: f64,
) -> Vec<f64> {
    let low_wavelen = original_ctx / low;
    let high_wavelen = original_ctx / high;
    (0..rope_dims / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / rope_dims as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// Where the per-pair frequencies of a RoPE table come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeFreqs<'a> {
    /// `theta^(-2i/rope_dims)` stretched by a scaling rule of the manifest.
    Scaled(RopeScaling),
    /// `theta^(-2i/rope_dims) / divisors[i]`: the model's own per-pair factors (a GGUF's
    /// `rope_freqs.weight`, LongRoPE's long or short factors), at least `rope_dims / 2` of
    /// them (the weight loader checks their length). The manifest's scaling is not applied.
    Divisors(&'a [f32]),
}

/// The angular frequency of each rotated pair (`rope_dims / 2` of them): position `p`
/// rotates pair `i` by `p · rope_inv_freq(..)[i]`. The one place RoPE frequencies are
/// computed, for the CPU runtime and the CUDA backend alike.
pub fn rope_inv_freq(rope_dims: usize, theta: f64, freqs: RopeFreqs<'_>) -> Vec<f64> {
    let half = rope_dims / 2;
    let base = |i: usize| theta.powf(-((2 * i) as f64) / rope_dims as f64);
    match freqs {
        RopeFreqs::Scaled(RopeScaling::None) => (0..half).map(base).collect(),
        RopeFreqs::Scaled(RopeScaling::Linear { factor }) => {
            (0..half).map(|i| (1.0 / factor) * base(i)).collect()
        }
        RopeFreqs::Scaled(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_context_length,
        }) => llama3_freq_factors(
            rope_dims,
            theta,
            factor,
            low_freq_factor,
            high_freq_factor,
            original_context_length,
        )
        .iter()
        .enumerate()
        .map(|(i, f)| base(i) / f)
        .collect(),
        RopeFreqs::Scaled(RopeScaling::Yarn {
            factor,
            original_context_length,
            beta_fast,
            beta_slow,
            truncate,
        }) => yarn_inv_freq(
            rope_dims,
            theta,
            factor,
            original_context_length,
            beta_fast,
            beta_slow,
            truncate,
        ),
        RopeFreqs::Divisors(d) => (0..half).map(|i| base(i) / d[i] as f64).collect(),
    }
}

/// The RoPE `cos` and `sin` tables, `[ctx][rope_dims / 2]` each (row `p` is position `p`),
/// computed in f64 and stored as f32, both multiplied by `attn_factor` when given
/// (LongRoPE's attention factor, llama.cpp's `attn_factor`) and by the scaling rule's own
/// [`RopeScaling::magnitude`] (YaRN's). What the CPU `RopeTable` holds and what the GPU
/// `rope` kernel reads.
pub fn rope_tables(
    rope_dims: usize,
    ctx: usize,
    theta: f64,
    freqs: RopeFreqs<'_>,
    attn_factor: Option<f32>,
) -> (Vec<f32>, Vec<f32>) {
    let inv_freq = rope_inv_freq(rope_dims, theta, freqs);
    let n = ctx.saturating_mul(inv_freq.len());
    let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for pos in 0..ctx {
        for f in &inv_freq {
            let a = pos as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    let rule = match freqs {
        RopeFreqs::Scaled(s) => s.magnitude(),
        RopeFreqs::Divisors(_) => 1.0,
    };
    if let Some(m) = attn_factor {
        for v in cos.iter_mut().chain(sin.iter_mut()) {
            *v *= m;
        }
    }
    if rule != 1.0 {
        for v in cos.iter_mut().chain(sin.iter_mut()) {
            *v = (*v as f64 * rule) as f32;
        }
    }
    (cos, sin)
}

/// Hyperparameters of a llama-family model, every value range-checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    /// `general.architecture`.
    pub arch: String,
    /// Number of transformer blocks (equal to the block layers of the table).
    pub n_layers: u64,
    /// Residual stream width.
    pub n_embd: u64,
    /// Query heads.
    pub n_heads: u64,
    /// Key/value heads (a divisor of `n_heads`).
    pub n_kv_heads: u64,
    /// Feed-forward hidden width.
    pub n_ff: u64,
    /// Vocabulary size.
    pub vocab_size: u64,
    /// Trained context length.
    pub context_length: u64,
    /// Width of one attention head (even).
    pub head_dim: u64,
    /// RoPE base frequency (finite, > 0).
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Leading dimensions of each head that RoPE rotates (`model.rope_dims`, even, at most
    /// `head_dim`; default `head_dim`). The rest pass unrotated (Phi-3's partial rotary).
    pub rope_dims: u64,
    /// LongRoPE (Phi-3): `cos`/`sin` are multiplied by this (`model.rope_scaling.attn_factor`).
    pub rope_attn_factor: Option<f64>,
    /// Context the RoPE factors were trained for: above it LongRoPE uses its long factors
    /// (`model.rope_scaling.original_context_length`).
    pub rope_original_context: Option<u64>,
    /// RMSNorm epsilon (finite, in (0, 1)).
    pub rms_norm_eps: f64,
    /// True when the output head is the token embedding.
    pub tie_embeddings: bool,
    /// BOS token id (below `vocab_size`).
    pub bos_token_id: Option<u32>,
    /// EOS token id (below `vocab_size`).
    pub eos_token_id: Option<u32>,
    /// Whether a BOS token is prepended.
    pub add_bos: bool,
    /// How RoPE pairs the dimensions of a head (from the family description).
    pub rope_style: RopeStyle,
    /// Sliding-window attention: a query at position p sees keys at positions above
    /// p − window (`model.sliding_window`, 1 … 2^24).
    pub sliding_window: Option<u64>,
    /// With a window: layer `il` attends globally when `(il + 1) % pattern == 0`, else
    /// through the window; 0 puts every layer in the window (`model.sliding_window_pattern`).
    pub sliding_window_pattern: u64,
    /// RoPE base of the window layers (`model.rope_theta_local`; default `rope_theta`).
    pub rope_theta_local: Option<f64>,
    /// Queries are scaled by 1/√this (`model.query_pre_attn_scalar`; default `head_dim`).
    pub query_pre_attn_scalar: Option<f64>,
    /// Attention scores are capped as `c·tanh(s/c)` (`model.attn_logit_softcap`).
    pub attn_softcap: Option<f64>,
    /// Output logits are capped as `c·tanh(l/c)` (`model.final_logit_softcap`).
    pub final_softcap: Option<f64>,
    /// Mixture-of-experts feed-forward layers (`model.n_expert` present), else dense.
    pub moe: Option<Moe>,
    /// Block `il` applies no RoPE when `(il + 1) % step == 0` (SmolLM3's NoPE layers,
    /// `model.no_rope_layer_step`, 1 … 2^24); `None`: every block applies it.
    pub no_rope_step: Option<u64>,
}

/// The mixture-of-experts feed-forward network of every block: a router picks
/// `n_expert_used` of `n_expert` experts per token (softmax over the router's logits, the
/// top ones kept), each a gated FFN of width `n_ff_exp`, their outputs summed weighted by
/// the router's probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Moe {
    /// Experts per block (`model.n_expert`, 1 … 4096).
    pub n_expert: u64,
    /// Experts used per token (`model.n_expert_used`, 1 … `n_expert`).
    pub n_expert_used: u64,
    /// Hidden width of one expert (`model.n_ff_exp`).
    pub n_ff_exp: u64,
    /// The kept probabilities are renormalized to sum 1 (`model.expert_weights_norm`).
    pub norm_weights: bool,
}

/// Most experts a block may have: the router's row per token is read whole, and llama.cpp's
/// largest models have 384.
pub const MAX_EXPERTS: u64 = 4096;

/// A mixture of experts' routed expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`, GGUF's
/// names): `[n_expert, rows, cols]`, of which a token reads only the experts it is routed
/// to. Writers put them after the block's other tensors (SPEC.md §2), so that a reader can
/// stream a block's attention and router as one range and read experts apart.
pub fn is_routed_expert(name: &str) -> bool {
    name.contains("_exps.")
}

impl Hparams {
    /// A small Gemma 3-shaped set with every optional field exercised (scaling, a window
    /// pattern, a local base, softcaps), for the tests of the crates whose views are built
    /// from it.
    #[doc(hidden)]
    pub fn example_gemma3() -> Hparams {
        Hparams {
            arch: "gemma3".into(),
            n_layers: 7,
            n_embd: 64,
            n_heads: 4,
            n_kv_heads: 2,
            n_ff: 128,
            vocab_size: 100,
            context_length: 512,
            head_dim: 16,
            rope_theta: 1e6,
            rope_scaling: RopeScaling::Linear { factor: 8.0 },
            rope_dims: 12,
            rope_attn_factor: None,
            rope_original_context: None,
            rms_norm_eps: 1e-6,
            tie_embeddings: true,
            bos_token_id: Some(2),
            eos_token_id: Some(1),
            add_bos: true,
            rope_style: RopeStyle::Neox,
            sliding_window: Some(32),
            sliding_window_pattern: 3,
            rope_theta_local: Some(1e4),
            query_pre_attn_scalar: Some(256.0),
            attn_softcap: None,
            final_softcap: Some(30.0),
            moe: None,
            no_rope_step: None,
        }
    }
}

impl Hparams {
    /// True when block `il` attends through the sliding window.
    pub fn is_window_layer(&self, il: u64) -> bool {
        self.sliding_window.is_some()
            && (self.sliding_window_pattern == 0
                || !(il + 1).is_multiple_of(self.sliding_window_pattern))
    }

    /// The value of shape symbol `sym` of the family descriptions (`None`: unknown symbol
    /// or overflow).
    pub fn dim(&self, sym: &str) -> Option<u64> {
        shape_symbol(sym, |key| match key {
            "model.n_embd" => Some(self.n_embd),
            "model.n_heads" => Some(self.n_heads),
            "model.n_kv_heads" => Some(self.n_kv_heads),
            "model.n_ff" => Some(self.n_ff),
            "model.vocab_size" => Some(self.vocab_size),
            "model.head_dim" => Some(self.head_dim),
            "model.rope_dims" => Some(self.rope_dims),
            "model.n_expert" => self.moe.map(|m| m.n_expert),
            "model.n_ff_exp" => self.moe.map(|m| m.n_ff_exp),
            _ => None,
        })
    }
}

/// The value of shape symbol `sym` of the family descriptions (`d` = n_embd,
/// `q` = n_heads·head_dim, `kv` = n_kv_heads·head_dim, `ff` = n_ff, `V` = vocab_size,
/// `H` = n_heads, `hd` = head_dim, `hd2` = head_dim/2, `rd2` = rope_dims/2, `E` = n_expert, `ffe` =
/// n_ff_exp) from the `model.*` values that
/// `get` gives by key — the converter's metadata before a manifest exists, or [`Hparams`].
/// `None`: unknown symbol, missing value, or overflow.
pub fn shape_symbol(sym: &str, get: impl Fn(&str) -> Option<u64>) -> Option<u64> {
    let hd = || get("model.head_dim");
    match sym {
        "d" => get("model.n_embd"),
        "q" => get("model.n_heads")?.checked_mul(hd()?),
        "kv" => get("model.n_kv_heads")?.checked_mul(hd()?),
        "ff" => get("model.n_ff"),
        "V" => get("model.vocab_size"),
        "hd" => hd(),
        "hd2" => Some(hd()? / 2),
        "rd2" => Some(get("model.rope_dims").or_else(hd)? / 2),
        "H" => get("model.n_heads"),
        "E" => get("model.n_expert"),
        "ffe" => get("model.n_ff_exp"),
        _ => None,
    }
}

/// The outcome of [`check_model`].
#[derive(Debug)]
pub struct ModelCheck {
    /// `general.architecture` (empty when absent or unreadable).
    pub arch: String,
    /// True when the architecture is one of [`KNOWN_ARCHS`]: its rules were checked and
    /// `gdsrun` can run it.
    pub known: bool,
    /// Rules broken.
    pub errors: Vec<FormatError>,
    /// The hyperparameters, when the architecture is known and they all check.
    pub hparams: Option<Hparams>,
}

fn key_err(key: &str, why: impl Into<String>) -> FormatError {
    FormatError::MissingKey {
        key: key.into(),
        why: why.into(),
    }
}

/// Checks the model-level rules of a manifest that [`crate::validate::validate_manifest`]
/// accepted: the architecture name, token ids, and — for a known architecture — every
/// required key and its range, the block count, every required tensor, its shape and its
/// dtype.
pub fn check_model(m: &Manifest<'_>) -> ModelCheck {
    let mut errors = Vec::new();
    let arch = match m.get_str("general.architecture") {
        Ok(a) => a.to_string(),
        Err(e) => {
            errors.push(e);
            String::new()
        }
    };
    let well_formed = arch.len() <= 64
        && arch
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !arch.is_empty() && !well_formed {
        errors.push(key_err(
            "general.architecture",
            format!("{arch:?} is not a name of at most 64 lowercase letters, digits and '_'"),
        ));
    }
    // Token ids must name a token, whatever the architecture.
    if let Ok(vocab) = m.get_u64("model.vocab_size") {
        for k in ["tokenizer.bos_token_id", "tokenizer.eos_token_id"] {
            if let Ok(id) = m.get_u64(k) {
                if id >= vocab {
                    errors.push(key_err(
                        k,
                        format!("{id} is not below model.vocab_size {vocab}"),
                    ));
                }
            }
        }
    }
    let known = KNOWN_ARCHS.contains(&arch.as_str());
    let mut checked = None;
    if known {
        match hparams(m, &arch) {
            Ok(h) => {
                let before = errors.len();
                check_tensors(m, &h, &mut errors);
                if errors.len() == before {
                    checked = Some(h);
                }
            }
            Err(e) => errors.extend(e),
        }
    }
    ModelCheck {
        arch,
        known,
        errors,
        hparams: checked,
    }
}

/// Reads and range-checks the hyperparameters of a manifest of a known family (`arch`, its
/// `general.architecture`); errors name the key.
pub fn hparams(m: &Manifest<'_>, arch: &str) -> Result<Hparams, Vec<FormatError>> {
    let Some(spec) = family(arch) else {
        return Err(vec![key_err(
            "general.architecture",
            format!(
                "{arch:?} is not an architecture of formats/ ({})",
                KNOWN_ARCHS.join(", ")
            ),
        )]);
    };
    let mut errs = Vec::new();
    for (key, ty) in &spec.required_metadata {
        let ok = matches!(
            (ty.as_str(), m.get(key)),
            ("u64", Some(Value::U64(_)))
                | ("f64", Some(Value::F64(_)))
                | ("bool", Some(Value::Bool(_)))
                | ("string", Some(Value::Str(_)))
        );
        if !ok {
            errs.push(key_err(
                key,
                match m.get(key) {
                    None => format!("required by architecture {arch} and absent"),
                    Some(v) => format!("must be of type {ty}, found {v}"),
                },
            ));
        }
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    let mut dim = |k: &str| -> u64 {
        let v = m.get_u64(k).unwrap_or(0);
        if v == 0 || v > MAX_DIM {
            errs.push(key_err(k, format!("{v} is out of range 1..={MAX_DIM}")));
        }
        v
    };
    let (n_layers, n_embd, n_heads, n_kv_heads, n_ff, vocab_size, context_length, head_dim) = (
        dim("model.n_layers"),
        dim("model.n_embd"),
        dim("model.n_heads"),
        dim("model.n_kv_heads"),
        dim("model.n_ff"),
        dim("model.vocab_size"),
        dim("model.context_length"),
        dim("model.head_dim"),
    );
    let f = |k: &str| m.get_f64(k).unwrap_or(f64::NAN);
    let rope_theta = f("model.rope_theta");
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        errs.push(key_err(
            "model.rope_theta",
            format!("{rope_theta} must be a positive number"),
        ));
    }
    let rms_norm_eps = f("model.rms_norm_eps");
    if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0 && rms_norm_eps < 1.0) {
        errs.push(key_err(
            "model.rms_norm_eps",
            format!("{rms_norm_eps} must be a number in (0, 1)"),
        ));
    }
    if n_kv_heads != 0 && n_heads % n_kv_heads != 0 {
        errs.push(key_err(
            "model.n_kv_heads",
            format!("{n_kv_heads} does not divide model.n_heads {n_heads}"),
        ));
    }
    if head_dim % 2 != 0 {
        errs.push(key_err(
            "model.head_dim",
            format!("{head_dim} must be even for RoPE"),
        ));
    }
    let positive = |k: &str, errs: &mut Vec<FormatError>| -> f64 {
        let v = f(k);
        if !(v.is_finite() && v > 0.0) {
            errs.push(key_err(k, format!("{v} must be a positive number")));
        }
        v
    };
    let opt_bool = |k: &str, default: bool, errs: &mut Vec<FormatError>| -> bool {
        match m.get(k) {
            None => default,
            Some(Value::Bool(b)) => b,
            Some(v) => {
                errs.push(key_err(k, format!("must be a bool, found {v}")));
                default
            }
        }
    };
    let rope_scaling = match m.get("model.rope_scaling.type") {
        None => RopeScaling::None,
        Some(Value::Str("none")) => RopeScaling::None,
        Some(Value::Str("linear")) => RopeScaling::Linear {
            factor: positive("model.rope_scaling.factor", &mut errs),
        },
        Some(Value::Str("llama3")) => {
            let s = RopeScaling::Llama3 {
                factor: positive("model.rope_scaling.factor", &mut errs),
                low_freq_factor: positive("model.rope_scaling.low_freq_factor", &mut errs),
                high_freq_factor: positive("model.rope_scaling.high_freq_factor", &mut errs),
                original_context_length: positive(
                    "model.rope_scaling.original_context_length",
                    &mut errs,
                ),
            };
            if let RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                ..
            } = s
            {
                if high_freq_factor <= low_freq_factor {
                    errs.push(key_err(
                        "model.rope_scaling.high_freq_factor",
                        format!("{high_freq_factor} must exceed low_freq_factor {low_freq_factor}"),
                    ));
                }
            }
            s
        }
        Some(Value::Str("yarn")) => {
            let opt = |k: &str, default: f64, errs: &mut Vec<FormatError>| match m.get(k) {
                None => default,
                Some(_) => positive(k, errs),
            };
            RopeScaling::Yarn {
                factor: positive("model.rope_scaling.factor", &mut errs),
                original_context_length: match m.get("model.rope_scaling.original_context_length") {
                    Some(Value::U64(v)) if (1..=MAX_DIM).contains(&v) => v as f64,
                    _ => positive("model.rope_scaling.original_context_length", &mut errs),
                },
                beta_fast: opt("model.rope_scaling.yarn_beta_fast", 32.0, &mut errs),
                beta_slow: opt("model.rope_scaling.yarn_beta_slow", 1.0, &mut errs),
                truncate: opt_bool("model.rope_scaling.yarn_truncate", true, &mut errs),
            }
        }
        Some(v) => {
            errs.push(key_err(
                "model.rope_scaling.type",
                format!("{v} is not one of none, linear, llama3, yarn"),
            ));
            RopeScaling::None
        }
    };
    let mut token = |k: &str| -> Option<u32> {
        match m.get(k) {
            None => None,
            Some(Value::U64(v)) if v < vocab_size => u32::try_from(v).ok(),
            Some(v) => {
                errs.push(key_err(
                    k,
                    format!("{v} is not a token id below model.vocab_size {vocab_size}"),
                ));
                None
            }
        }
    };
    let (bos_token_id, eos_token_id) = (
        token("tokenizer.bos_token_id"),
        token("tokenizer.eos_token_id"),
    );
    // an optional flag: absent is false, present must be a bool
    let add_bos = opt_bool("tokenizer.add_bos", false, &mut errs);
    // Optional family-specific values: absent is fine, present must be in range.
    let opt_dim = |k: &str, errs: &mut Vec<FormatError>| -> Option<u64> {
        match m.get(k) {
            None => None,
            Some(Value::U64(v)) if (1..=MAX_DIM).contains(&v) => Some(v),
            Some(v) => {
                errs.push(key_err(
                    k,
                    format!("{v} is not an integer in 1..={MAX_DIM}"),
                ));
                None
            }
        }
    };
    let sliding_window = opt_dim("model.sliding_window", &mut errs);
    let no_rope_step = opt_dim("model.no_rope_layer_step", &mut errs);
    let sliding_window_pattern = match m.get("model.sliding_window_pattern") {
        None => 0,
        Some(Value::U64(v)) if v <= MAX_DIM => v,
        Some(v) => {
            errs.push(key_err(
                "model.sliding_window_pattern",
                format!("{v} is not an integer in 0..={MAX_DIM}"),
            ));
            0
        }
    };
    let opt_pos = |k: &str, errs: &mut Vec<FormatError>| -> Option<f64> {
        match m.get(k) {
            None => None,
            Some(Value::F64(v)) if v.is_finite() && v > 0.0 => Some(v),
            Some(v) => {
                errs.push(key_err(k, format!("{v} must be a positive number")));
                None
            }
        }
    };
    let rope_theta_local = opt_pos("model.rope_theta_local", &mut errs);
    let query_pre_attn_scalar = opt_pos("model.query_pre_attn_scalar", &mut errs);
    let attn_softcap = opt_pos("model.attn_logit_softcap", &mut errs);
    let final_softcap = opt_pos("model.final_logit_softcap", &mut errs);
    let rope_dims = match m.get("model.rope_dims") {
        None => head_dim,
        Some(Value::U64(v)) if (2..=head_dim).contains(&v) && v % 2 == 0 => v,
        Some(v) => {
            errs.push(key_err(
                "model.rope_dims",
                format!("{v} is not an even number in 2..=model.head_dim ({head_dim})"),
            ));
            head_dim
        }
    };
    let rope_attn_factor = opt_pos("model.rope_scaling.attn_factor", &mut errs);
    let moe = match m.get("model.n_expert") {
        None => None,
        Some(Value::U64(n)) if (1..=MAX_EXPERTS).contains(&n) => {
            let used = match m.get("model.n_expert_used") {
                Some(Value::U64(k)) if (1..=n).contains(&k) => k,
                v => {
                    errs.push(key_err(
                        "model.n_expert_used",
                        match v {
                            None => "required with model.n_expert and absent".into(),
                            Some(v) => format!("{v} is not an integer in 1..={n} (model.n_expert)"),
                        },
                    ));
                    1
                }
            };
            let n_ff_exp = opt_dim("model.n_ff_exp", &mut errs).unwrap_or_else(|| {
                if m.get("model.n_ff_exp").is_none() {
                    errs.push(key_err(
                        "model.n_ff_exp",
                        "required with model.n_expert and absent",
                    ));
                }
                1
            });
            let norm_weights = opt_bool("model.expert_weights_norm", false, &mut errs);
            Some(Moe {
                n_expert: n,
                n_expert_used: used,
                n_ff_exp,
                norm_weights,
            })
        }
        Some(v) => {
            errs.push(key_err(
                "model.n_expert",
                format!("{v} is not an integer in 1..={MAX_EXPERTS}"),
            ));
            None
        }
    };
    let rope_original_context = match m.get("model.rope_scaling.original_context_length") {
        None => None,
        Some(Value::U64(v)) if (1..=MAX_DIM).contains(&v) => Some(v),
        // llama3 scaling stores it as a float (positive() above checks it)
        Some(Value::F64(v)) if (1.0..=MAX_DIM as f64).contains(&v) => Some(v as u64),
        Some(v) => {
            errs.push(key_err(
                "model.rope_scaling.original_context_length",
                format!("{v} is not a context length in 1..={MAX_DIM}"),
            ));
            None
        }
    };
    if !errs.is_empty() {
        return Err(errs);
    }
    Ok(Hparams {
        arch: arch.to_string(),
        n_layers,
        n_embd,
        n_heads,
        n_kv_heads,
        n_ff,
        vocab_size,
        context_length,
        head_dim,
        rope_theta,
        rope_scaling,
        rope_dims,
        rope_attn_factor,
        rope_original_context,
        rms_norm_eps,
        tie_embeddings: m.get_bool("model.tie_embeddings").unwrap_or(false),
        bos_token_id,
        eos_token_id,
        add_bos,
        rope_style: spec.rope,
        sliding_window,
        sliding_window_pattern,
        rope_theta_local,
        query_pre_attn_scalar,
        attn_softcap,
        final_softcap,
        moe,
        no_rope_step,
    })
}

/// The shape every tensor of a model of family `h.arch` must have (SPEC.md §6, the
/// `shapes` of its description), by canonical name, for block `n` (`None`: the tensors
/// outside the blocks). A dimension that overflows is `None`.
pub fn shapes(h: &Hparams, n: Option<u64>) -> Vec<(String, Vec<Option<u64>>)> {
    let Some(spec) = family(&h.arch) else {
        return Vec::new();
    };
    spec.shapes
        .iter()
        .filter(|(name, _)| name.contains("{N}") == n.is_some())
        .map(|(name, dims)| {
            let name = match n {
                Some(n) => name.replace("{N}", &n.to_string()),
                None => name.clone(),
            };
            (name, dims.iter().map(|d| h.dim(d)).collect())
        })
        .collect()
}

fn check_tensors(m: &Manifest<'_>, h: &Hparams, errs: &mut Vec<FormatError>) {
    let Some(spec) = family(&h.arch) else {
        return;
    };
    let blocks = m.layers().filter(|l| l.kind == layer_kind::BLOCK).count() as u64;
    if blocks != h.n_layers {
        errs.push(key_err(
            "model.n_layers",
            format!("is {} but the layer table has {blocks} blocks", h.n_layers),
        ));
    }
    // Bounded by the table: blocks beyond the table cannot be looked up anyway.
    let n = blocks.min(h.n_layers);
    let present: HashMap<&str, TensorInfo<'_>> = m.tensors().map(|t| (t.name, t)).collect();
    let missing = |name: &str, errs: &mut Vec<FormatError>| {
        if !present.contains_key(name) {
            errs.push(FormatError::BadTensor {
                name: name.into(),
                why: format!("required by architecture {} and missing", h.arch),
            });
        }
    };
    for name in &spec.required_tensors.global {
        missing(name, errs);
    }
    if !h.tie_embeddings {
        missing("output.weight", errs);
    }
    for b in 0..n {
        for p in &spec.required_tensors.block {
            missing(&p.replace("{N}", &b.to_string()), errs);
        }
    }
    let expected = std::iter::once(None)
        .chain((0..n).map(Some))
        .flat_map(|b| shapes(h, b));
    for (name, shape) in expected {
        let Some(t) = present.get(name.as_str()) else {
            continue;
        };
        if !t.dims().iter().copied().map(Some).eq(shape.iter().copied()) {
            errs.push(FormatError::BadTensor {
                name,
                why: format!(
                    "shape {:?}, the hyperparameters require {shape:?}",
                    t.dims()
                ),
            });
        } else if !WEIGHT_DTYPES.contains(&t.dtype) {
            errs.push(FormatError::BadTensor {
                name,
                why: format!(
                    "dtype {} is not a weight type the kernels compute with",
                    t.dtype
                ),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// YaRN's frequencies for gpt-oss-20b's RoPE (64 dims, θ 150000, factor 32, original
    /// context 4096, betas 32/1), every fourth pair, as transformers 5.23 computes them
    /// (`_compute_yarn_parameters` on a `GptOssConfig`, float32): with `truncate` false, as
    /// gpt-oss's config has it, and true, as llama.cpp always does; pairs 12 and 16 lie in
    /// the ramp, where the two differ.
    #[test]
    fn yarn_frequencies_match_transformers_with_and_without_truncation() {
        let want = [
            (
                false,
                [
                    1.0,
                    0.22541800141334534,
                    0.05081327259540558,
                    0.006794959306716919,
                    0.0004564839182421565,
                    1.818833698052913e-05,
                    4.099978468730114e-06,
                    9.242089618055616e-07,
                ],
            ),
            (
                true,
                [
                    1.0,
                    0.22541800141334534,
                    0.05081327259540558,
                    0.007015713956207037,
                    0.0005809474969282746,
                    1.818833698052913e-05,
                    4.099978468730114e-06,
                    9.242089618055616e-07,
                ],
            ),
        ];
        for (truncate, values) in want {
            let got = yarn_inv_freq(64, 150000.0, 32.0, 4096.0, 32.0, 1.0, truncate);
            for (i, w) in values.iter().enumerate() {
                let g = got[i * 4];
                assert!(
                    ((g - w) / w).abs() < 1e-6,
                    "truncate {truncate}: pair {}: {g} against transformers' {w}",
                    i * 4
                );
            }
        }
    }

    /// The shared RoPE builder against the published formulas, written out here
    /// independently: plain RoPE's angle `p · theta^(-2i/d)` (RoFormer), and Meta's
    /// `apply_scaling` of Llama 3.1 (`llama/model.py`), which rescales the inverse frequency
    /// itself: kept above the high-frequency wavelength bound, divided by `factor` below the
    /// low one, `(1 − s)·f/factor + s·f` between, `s = (orig/λ − low)/(high − low)`.
    #[test]
    fn rope_tables_match_the_published_formulas() {
        let check = |freqs: RopeFreqs<'_>, d: usize, theta: f64, want: &dyn Fn(usize) -> f64| {
            let ctx = 9000;
            let (cos, sin) = rope_tables(d, ctx, theta, freqs, None);
            assert_eq!((cos.len(), sin.len()), (ctx * d / 2, ctx * d / 2));
            for pos in [0usize, 1, 7, 300, 8191, 8999] {
                for i in 0..d / 2 {
                    let a = pos as f64 * want(i);
                    let (c, s) = (cos[pos * d / 2 + i] as f64, sin[pos * d / 2 + i] as f64);
                    assert!((c - a.cos()).abs() < 1e-6, "pos {pos} pair {i}: cos {c}");
                    assert!((s - a.sin()).abs() < 1e-6, "pos {pos} pair {i}: sin {s}");
                }
            }
        };
        // plain: theta 10000 and 1e6, 64-wide heads
        for theta in [10000.0, 1e6] {
            let plain = |i: usize| 1.0 / f64::powf(theta, (2 * i) as f64 / 64.0);
            check(RopeFreqs::Scaled(RopeScaling::None), 64, theta, &plain);
        }
        // Llama 3.1 8B: theta 500000, factor 8, low 1, high 4, original context 8192
        let (theta, factor, low, high, orig) = (500000.0f64, 8.0, 1.0, 4.0, 8192.0);
        let mut smoothed = 0;
        let meta = |i: usize| {
            let f = 1.0 / theta.powf((2 * i) as f64 / 128.0);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < orig / high {
                f
            } else if wavelen > orig / low {
                f / factor
            } else {
                let s = (orig / wavelen - low) / (high - low);
                (1.0 - s) * f / factor + s * f
            }
        };
        for i in 0..64 {
            let wavelen = 2.0 * std::f64::consts::PI * theta.powf((2 * i) as f64 / 128.0);
            smoothed += usize::from(wavelen >= orig / high && wavelen <= orig / low);
        }
        assert!(smoothed > 0, "the test covers the smoothed band");
        let llama3 = RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_context_length: orig,
        };
        check(RopeFreqs::Scaled(llama3), 128, theta, &meta);
        // the lowest pair is fully stretched, the highest kept
        let f = rope_inv_freq(128, theta, RopeFreqs::Scaled(llama3));
        assert_eq!(f[0], 1.0);
        assert!((f[63] - theta.powf(-126.0 / 128.0) / 8.0).abs() < 1e-18);
        // linear: positions divided by the factor; divisors: each pair's own
        let lin = |i: usize| 1.0 / f64::powf(10000.0, (2 * i) as f64 / 16.0) / 4.0;
        check(
            RopeFreqs::Scaled(RopeScaling::Linear { factor: 4.0 }),
            16,
            10000.0,
            &lin,
        );
        let div: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 / 2.0).collect();
        let by = |i: usize| 1.0 / f64::powf(10000.0, (2 * i) as f64 / 16.0) / div[i] as f64;
        check(RopeFreqs::Divisors(&div), 16, 10000.0, &by);
        // the attention factor multiplies both tables
        let (c1, s1) = rope_tables(16, 5, 1e4, RopeFreqs::Divisors(&div), None);
        let (c2, s2) = rope_tables(16, 5, 1e4, RopeFreqs::Divisors(&div), Some(1.25));
        for (a, b) in c1.iter().chain(&s1).zip(c2.iter().chain(&s2)) {
            assert_eq!(a * 1.25, *b);
        }
    }

    #[test]
    fn descriptions_parse_and_are_consistent() {
        for f in families() {
            // every required or optional tensor has a shape, and every shape symbol is known
            for name in f
                .required_tensors
                .global
                .iter()
                .chain(&f.required_tensors.block)
                .chain(&f.optional_tensors.global)
                .chain(&f.optional_tensors.block)
            {
                assert!(
                    f.shapes.contains_key(name),
                    "{}: {name} has no shape",
                    f.family
                );
            }
            for dims in f.shapes.values() {
                for d in dims {
                    assert!(
                        ["d", "q", "kv", "ff", "V", "H", "hd", "hd2", "rd2", "E", "ffe"]
                            .contains(&d.as_str()),
                        "{d}"
                    );
                }
            }
            // every HF map target is a tensor with a shape, or a fused one split into such
            for canon in f.tensors.values().chain(f.hf_stacked.keys()) {
                assert!(
                    f.shapes.contains_key(canon) || f.fused.contains_key(canon),
                    "{}: {canon}",
                    f.family
                );
            }
            for parts in f.fused.values() {
                for (part, sym) in parts {
                    assert!(f.shapes.contains_key(part), "{}: {part}", f.family);
                    assert!(["q", "kv", "ff"].contains(&sym.as_str()), "{sym}");
                }
            }
            assert!(KNOWN_ARCHS.contains(&f.family.as_str()));
            // a family has a name of its own, GGUF's or Hugging Face's (mixtral has no GGUF
            // architecture: llama.cpp writes it as llama with experts)
            let first = f.gguf_architectures.first().or(f.hf_architectures.first());
            assert_eq!(family_of(first.expect("a name")).unwrap().family, f.family);
        }
        assert_eq!(family_of("qwen2").unwrap().family, "llama");
        assert_eq!(family_of("gemma3_text").unwrap().family, "gemma3");
        assert_eq!(family("gemma3").unwrap().rope, RopeStyle::Neox);
        assert!(FamilySpec::matches(
            &family("gemma3").unwrap().hf_norm_offset,
            "blk.12.post_ffw_norm.weight"
        ));
        assert!(!FamilySpec::matches(
            &family("gemma3").unwrap().hf_norm_offset,
            "blk.12.ffn_up.weight"
        ));
        let l = llama();
        assert_eq!(l.family, "llama");
        assert!(l.required_metadata.contains_key("model.n_layers"));
        assert!(l
            .required_tensors
            .block
            .iter()
            .all(|p| p.starts_with("blk.{N}.")));
    }
}
