//! Hyperparameters of a model of a known family, read once from the manifest.

use crate::error::{Result, RuntimeError};
use gds_format::Manifest;
use serde::Serialize;

/// Architectures (`general.architecture`) this runtime runs: every family of `formats/`,
/// each with its graph in [`crate::graph`].
pub const SUPPORTED_ARCHS: &[&str] = gds_format::arch::KNOWN_ARCHS;

pub use gds_format::arch::{RopeScaling, RopeStyle};

/// Model hyperparameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    /// `general.architecture`.
    pub arch: String,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Residual stream width.
    pub n_embd: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Feed-forward hidden width.
    pub n_ff: usize,
    /// Vocabulary size (rows of the embedding and of the output head).
    pub vocab_size: usize,
    /// Context length the model was trained for.
    pub context_length: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Leading dimensions of each head that RoPE rotates (`head_dim` unless partial).
    pub rope_dims: usize,
    /// LongRoPE: `cos`/`sin` multiplied by this.
    pub rope_attn_factor: Option<f64>,
    /// LongRoPE: above this context the long factors apply.
    pub rope_original_context: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// True when the output head reuses the token embedding.
    pub tie_embeddings: bool,
    /// Beginning-of-sequence token, if the vocabulary has one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token, if the vocabulary has one.
    pub eos_token_id: Option<u32>,
    /// True when tokenization prepends BOS (as llama.cpp does for this model).
    pub add_bos: bool,
    /// How RoPE pairs the dimensions of a head.
    pub rope_style: RopeStyle,
    /// Sliding-window size of the window layers.
    pub sliding_window: Option<usize>,
    /// Window layer pattern (see [`gds_format::arch::Hparams::sliding_window_pattern`]).
    pub sliding_window_pattern: usize,
    /// RoPE base of the window layers.
    pub rope_theta_local: Option<f64>,
    /// Query scale `1/√query_pre_attn_scalar` (default `1/√head_dim`).
    pub attn_scale: f32,
    /// Attention score cap `c·tanh(s/c)`.
    pub attn_softcap: Option<f32>,
    /// Output logit cap `c·tanh(l/c)`.
    pub final_softcap: Option<f32>,
}

impl Config {
    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads together: one KV cache row.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Sliding window of block `l`, if it attends through one.
    pub fn window(&self, l: usize) -> Option<usize> {
        let w = self.sliding_window?;
        let p = self.sliding_window_pattern;
        (p == 0 || !(l + 1).is_multiple_of(p)).then_some(w)
    }

    /// Reads and checks the hyperparameters (the format's typed [`gds_format::arch::Hparams`],
    /// every value range-checked there). Errors name the missing or bad key.
    pub fn from_manifest(m: &Manifest<'_>) -> Result<Config> {
        let bad = |why: String| RuntimeError::Manifest {
            dir: String::new(),
            why,
        };
        let arch = m
            .get_str("general.architecture")
            .map_err(|e| bad(e.to_string()))?
            .to_string();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(RuntimeError::UnsupportedArch { arch });
        }
        let h = gds_format::arch::hparams(m, &arch).map_err(|errs| {
            bad(errs
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; "))
        })?;
        // Every dimension was checked to be at most 2^24: the casts cannot truncate.
        let u = |v: u64| v as usize;
        let cfg = Config {
            arch,
            n_layers: u(h.n_layers),
            n_embd: u(h.n_embd),
            n_heads: u(h.n_heads),
            n_kv_heads: u(h.n_kv_heads),
            n_ff: u(h.n_ff),
            vocab_size: u(h.vocab_size),
            context_length: u(h.context_length),
            head_dim: u(h.head_dim),
            rope_theta: h.rope_theta,
            rope_scaling: h.rope_scaling,
            rope_dims: u(h.rope_dims),
            rope_attn_factor: h.rope_attn_factor,
            rope_original_context: h.rope_original_context.map(u),
            rms_norm_eps: h.rms_norm_eps as f32,
            tie_embeddings: h.tie_embeddings,
            bos_token_id: h.bos_token_id,
            eos_token_id: h.eos_token_id,
            add_bos: h.add_bos,
            rope_style: h.rope_style,
            sliding_window: h.sliding_window.map(u),
            sliding_window_pattern: u(h.sliding_window_pattern),
            rope_theta_local: h.rope_theta_local,
            attn_scale: (1.0 / h.query_pre_attn_scalar.unwrap_or(h.head_dim as f64).sqrt()) as f32,
            attn_softcap: h.attn_softcap.map(|c| c as f32),
            final_softcap: h.final_softcap.map(|c| c as f32),
        };
        cfg.check().map_err(bad)?;
        Ok(cfg)
    }

    /// Checks the relations the forward pass relies on.
    pub fn check(&self) -> std::result::Result<(), String> {
        let dims = [
            ("model.n_layers", self.n_layers),
            ("model.n_embd", self.n_embd),
            ("model.n_heads", self.n_heads),
            ("model.n_kv_heads", self.n_kv_heads),
            ("model.n_ff", self.n_ff),
            ("model.vocab_size", self.vocab_size),
            ("model.context_length", self.context_length),
            ("model.head_dim", self.head_dim),
        ];
        for (k, v) in dims {
            if v == 0 || v > 1 << 24 {
                return Err(format!("{k} = {v} is out of range"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "model.n_heads {} is not a multiple of model.n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "model.head_dim {} must be even for RoPE",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!(
                "model.rope_theta {} must be positive",
                self.rope_theta
            ));
        }
        if self.rope_dims < 2 || self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2)
        {
            return Err(format!(
                "model.rope_dims {} must be even and in 2..=model.head_dim {}",
                self.rope_dims, self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!(
                "model.rms_norm_eps {} must be non-negative",
                self.rms_norm_eps
            ));
        }
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(format!(
                        "model.rope_scaling.factor {factor} must be positive"
                    ));
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context_length,
            } => {
                if !(factor > 0.0
                    && original_context_length > 0.0
                    && high_freq_factor > low_freq_factor
                    && low_freq_factor > 0.0)
                {
                    return Err("model.rope_scaling: llama3 needs factor > 0, original_context_length > 0 and high_freq_factor > low_freq_factor > 0".into());
                }
            }
        }
        Ok(())
    }
}
