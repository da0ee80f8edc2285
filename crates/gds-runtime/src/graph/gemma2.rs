//! Gemma 2: sandwich norms, GeGLU (tanh GELU), embeddings scaled by √n_embd
//! ([`super::Arch::embed_scale`]); the attention-score and output-logit caps and the window
//! of alternate layers are the backend's per-layer parameters (from [`crate::Config`]).
//!
//! ```text
//! x += post_attention_norm(attn(rmsnorm(x) · attn_norm))   scores c·tanh(s/c)
//! x += post_ffw_norm(ffn_down(gelu(ffn_gate(h)) · ffn_up(h))),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{sandwich_block, Block, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    sandwich_block(o, l, w, Glu::GeluTanh)
}
