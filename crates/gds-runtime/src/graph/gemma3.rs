//! Gemma 3 (text): Gemma 2's sandwich block with per-head Q/K norms before RoPE and no caps.
//! Window layers ((il + 1) % 6 ≠ 0) and their own RoPE base are the backend's per-layer
//! attention parameters (from [`crate::Config`]).
//!
//! ```text
//! x += post_attention_norm(attn(rmsnorm(x) · attn_norm))   q_norm, k_norm per head
//! x += post_ffw_norm(ffn_down(gelu(ffn_gate(h)) · ffn_up(h))),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{role, sandwich_block, Block, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    role(&w.q_norm, "attn_q_norm")?;
    role(&w.k_norm, "attn_k_norm")?;
    sandwich_block(o, l, w, Glu::GeluTanh)
}
