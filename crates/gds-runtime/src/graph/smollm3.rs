//! SmolLM3: the llama block, except that every `no_rope_step`-th block (block `l` with
//! `(l + 1) % step == 0`; 4 in SmolLM3-3B) applies no RoPE: its attention sees positions
//! only through the causal mask (NoPE).
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm)          RoPE on q, k unless (l + 1) % step == 0
//! x += ffn_down(silu(ffn_gate(h)) · ffn_up(h)),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{pre_norm_block_rope, Block, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(
    o: &mut O,
    l: usize,
    w: &Block<O::Mat, O::Vec>,
    no_rope_step: usize,
) -> Result<()> {
    let rope = !(l + 1).is_multiple_of(no_rope_step);
    pre_norm_block_rope(o, l, w, Glu::Silu, rope)
}
