//! Qwen 3 dense: the llama block with one RMSNorm per query and key head before RoPE
//! (NEOX pairing, from the description).
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm)        q = q_norm(q), k = k_norm(k) per head
//! x += ffn_down(silu(ffn_gate(h)) · ffn_up(h)),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{pre_norm_block, role, Block, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    // the shared attention applies the per-head norms; qwen3 must have them
    role(&w.q_norm, "attn_q_norm")?;
    role(&w.k_norm, "attn_k_norm")?;
    pre_norm_block(o, l, w, Glu::Silu)
}
