//! Phi-3, Phi-3.5, Phi-4-mini: the llama block. What makes Phi different is below the graph:
//! its fused `attn_qkv` / `ffn_up` projections are split into the llama roles by `gdsconv`
//! (`formats/phi3.json`, `fused`), and RoPE rotates only the first `model.rope_dims`
//! dimensions of each head (NEOX pairing), with LongRoPE factors where the model has them
//! (the RoPE tables of `model.rs`).
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm)          RoPE on q[..rope_dims], k[..rope_dims]
//! x += ffn_down(silu(ffn_gate(h)) · ffn_up(h)),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{pre_norm_block, Block, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    pre_norm_block(o, l, w, Glu::Silu)
}
