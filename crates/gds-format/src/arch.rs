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

/// The machine-readable description of an architecture family (`formats/llama.json`).
#[derive(Debug, Deserialize)]
pub struct FamilySpec {
    /// Canonical family name.
    pub family: String,
    /// GGUF `general.architecture` values of this family.
    pub gguf_architectures: Vec<String>,
    /// HF `architectures[0]` values of this family.
    pub hf_architectures: Vec<String>,
    /// HF `model_type` values of this family.
    pub hf_model_types: Vec<String>,
    /// HF tensor name → canonical name, `{N}` standing for the block number.
    pub tensors: BTreeMap<String, String>,
    /// Input tensors dropped on conversion.
    pub ignored_tensors: Vec<String>,
    /// Canonical tensors whose rows are permuted from HF's RoPE layout.
    pub rope_permuted: Vec<String>,
    /// Tensors a converted model must have.
    pub required_tensors: RequiredTensors,
    /// Metadata keys a converted model must have, with their types.
    pub required_metadata: BTreeMap<String, String>,
}

/// Required tensors, global and per block.
#[derive(Debug, Deserialize)]
pub struct RequiredTensors {
    /// Outside the blocks.
    pub global: Vec<String>,
    /// In every block, `{N}` standing for the block number.
    pub block: Vec<String>,
}

/// The llama family description, parsed once from the file embedded at build time.
pub fn llama() -> &'static FamilySpec {
    static SPEC: OnceLock<FamilySpec> = OnceLock::new();
    SPEC.get_or_init(|| {
        serde_json::from_str(include_str!("../../../formats/llama.json"))
            .expect("formats/llama.json is valid (checked by a unit test)")
    })
}

/// Architectures (`general.architecture`) whose models the format can check and `gdsrun`
/// can run.
pub const KNOWN_ARCHS: &[&str] = &["llama"];

/// Largest value accepted for a dimension or count hyperparameter (2^24).
pub const MAX_DIM: u64 = 1 << 24;

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
    let mut hparams = None;
    if known {
        match llama_hparams(m, &arch) {
            Ok(h) => {
                let before = errors.len();
                check_llama_tensors(m, &h, &mut errors);
                if errors.len() == before {
                    hparams = Some(h);
                }
            }
            Err(e) => errors.extend(e),
        }
    }
    ModelCheck {
        arch,
        known,
        errors,
        hparams,
    }
}

/// Reads and range-checks the hyperparameters of a llama-family manifest; errors name the
/// key.
pub fn llama_hparams(m: &Manifest<'_>, arch: &str) -> Result<Hparams, Vec<FormatError>> {
    let mut errs = Vec::new();
    for (key, ty) in &llama().required_metadata {
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
        Some(v) => {
            errs.push(key_err(
                "model.rope_scaling.type",
                format!("{v} is not one of none, linear, llama3"),
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
    let add_bos = match m.get("tokenizer.add_bos") {
        None => false,
        Some(Value::Bool(b)) => b,
        Some(v) => {
            errs.push(key_err(
                "tokenizer.add_bos",
                format!("must be a bool, found {v}"),
            ));
            false
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
        rms_norm_eps,
        tie_embeddings: m.get_bool("model.tie_embeddings").unwrap_or(false),
        bos_token_id,
        eos_token_id,
        add_bos,
    })
}

/// The shape every tensor of a llama-family model must have (SPEC.md §6), by canonical
/// name, for block `n` (`None`: the tensors outside the blocks).
pub fn llama_shapes(h: &Hparams, n: Option<u64>) -> Vec<(String, Vec<u64>)> {
    let (d, q, kv, ff, v) = (
        h.n_embd,
        h.n_heads * h.head_dim,
        h.n_kv_heads * h.head_dim,
        h.n_ff,
        h.vocab_size,
    );
    match n {
        None => vec![
            ("token_embd.weight".into(), vec![v, d]),
            ("output_norm.weight".into(), vec![d]),
            ("output.weight".into(), vec![v, d]),
        ],
        Some(n) => {
            let b = |s: &str| format!("blk.{n}.{s}");
            vec![
                (b("attn_norm.weight"), vec![d]),
                (b("attn_q.weight"), vec![q, d]),
                (b("attn_k.weight"), vec![kv, d]),
                (b("attn_v.weight"), vec![kv, d]),
                (b("attn_q.bias"), vec![q]),
                (b("attn_k.bias"), vec![kv]),
                (b("attn_v.bias"), vec![kv]),
                (b("attn_output.weight"), vec![d, q]),
                (b("ffn_norm.weight"), vec![d]),
                (b("ffn_gate.weight"), vec![ff, d]),
                (b("ffn_up.weight"), vec![ff, d]),
                (b("ffn_down.weight"), vec![d, ff]),
            ]
        }
    }
}

fn check_llama_tensors(m: &Manifest<'_>, h: &Hparams, errs: &mut Vec<FormatError>) {
    let spec = llama();
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
        .flat_map(|b| llama_shapes(h, b));
    for (name, shape) in expected {
        let Some(t) = present.get(name.as_str()) else {
            continue;
        };
        if t.dims() != shape.as_slice() {
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

    #[test]
    fn llama_description_parses() {
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
