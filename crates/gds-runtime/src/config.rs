//! Hyperparameters of a model of a known family: the format's one typed, range-checked
//! [`Hparams`], read once from the manifest, in the types the runtime computes with.

use crate::error::{Result, RuntimeError};
use gds_format::arch::Hparams;
use gds_format::Manifest;
use serde::Serialize;

/// Architectures (`general.architecture`) this runtime runs: every family of `formats/`,
/// each with its graph in [`crate::graph`].
pub const SUPPORTED_ARCHS: &[&str] = gds_format::arch::KNOWN_ARCHS;

pub use gds_format::arch::{Moe, RopeScaling, RopeStyle};

/// Model hyperparameters: a view of [`Hparams`] built only by [`Config::from_hparams`]
/// (tests may write one out).
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
    /// Mixture-of-experts feed-forward layers, else dense.
    pub moe: Option<Moe>,
    /// Every `step`-th block applies no RoPE (see
    /// [`gds_format::arch::Hparams::no_rope_step`]).
    pub no_rope_step: Option<usize>,
}

impl Config {
    /// A llama-shaped configuration of `n_heads` query heads sharing `n_kv_heads` KV heads
    /// of `head_dim`, one layer, for the crate's unit tests.
    #[cfg(test)]
    pub(crate) fn for_tests(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Config {
        Config {
            arch: "llama".into(),
            n_layers: 1,
            n_embd: n_heads * head_dim,
            n_heads,
            n_kv_heads,
            n_ff: 16,
            vocab_size: 16,
            context_length: 1024,
            head_dim,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            rope_dims: head_dim,
            rope_attn_factor: None,
            rope_original_context: None,
            rms_norm_eps: 1e-5,
            tie_embeddings: true,
            bos_token_id: None,
            eos_token_id: None,
            add_bos: false,
            rope_style: RopeStyle::Norm,
            sliding_window: None,
            sliding_window_pattern: 0,
            rope_theta_local: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            moe: None,
            no_rope_step: None,
        }
    }

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
        Ok(Config::from_hparams(&h))
    }

    /// The runtime's view of the format's [`Hparams`] (its only source: nothing here reads
    /// a manifest key or checks a range again), in the types the forward pass computes
    /// with.
    pub fn from_hparams(h: &Hparams) -> Config {
        // Every dimension was checked to be at most 2^24: the casts cannot truncate.
        let u = |v: u64| v as usize;
        Config {
            arch: h.arch.clone(),
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
            moe: h.moe,
            no_rope_step: h.no_rope_step.map(u),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime's view carries every fact of the format's hyperparameters as they are
    /// (nothing re-read, re-defaulted or re-checked here).
    #[test]
    fn config_is_a_view_of_the_format_hparams() {
        let h = gds_format::arch::Hparams::example_gemma3();
        let c = Config::from_hparams(&h);
        assert_eq!(c.arch, "gemma3");
        assert_eq!(
            (c.n_layers, c.n_embd, c.n_heads, c.n_kv_heads),
            (7, 64, 4, 2)
        );
        assert_eq!((c.n_ff, c.vocab_size, c.context_length), (128, 100, 512));
        assert_eq!((c.head_dim, c.rope_dims, c.kv_dim()), (16, 12, 32));
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!((c.rope_theta, c.rope_theta_local), (1e6, Some(1e4)));
        assert_eq!(c.rope_style, RopeStyle::Neox);
        assert_eq!(c.rms_norm_eps, 1e-6f32);
        assert_eq!(
            (c.bos_token_id, c.eos_token_id, c.add_bos),
            (Some(2), Some(1), true)
        );
        assert_eq!(c.attn_scale, 1.0 / 16.0, "1/sqrt(query_pre_attn_scalar)");
        assert_eq!((c.attn_softcap, c.final_softcap), (None, Some(30.0)));
        // every third layer global, as the format's rule says
        for l in 0..7 {
            assert_eq!(
                c.window(l).is_some(),
                h.is_window_layer(l as u64),
                "layer {l}"
            );
        }
        assert_eq!(c.window(2), None);
        // without query_pre_attn_scalar the queries are scaled by 1/sqrt(head_dim)
        let h = gds_format::arch::Hparams {
            query_pre_attn_scalar: None,
            ..h
        };
        assert_eq!(Config::from_hparams(&h).attn_scale, 0.25);
    }
}
