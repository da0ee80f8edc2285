//! llama, mistral, qwen2, smollm: pre-norm blocks, SwiGLU; Q/K/V biases where the model has
//! them (qwen2), the window where it declares one (mistral). Mixtral is this block with a
//! mixture of experts in place of the FFN (a softmax router, the top `n_expert_used`
//! renormalized; `Ffn::Experts`).
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm)
//! x += ffn_down(silu(ffn_gate(h)) · ffn_up(h)),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{pre_norm_block, Block, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    pre_norm_block(o, l, w, Glu::Silu)
}
