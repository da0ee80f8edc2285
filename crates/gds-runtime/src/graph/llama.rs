//! llama, mistral, qwen2, smollm: pre-norm blocks, SwiGLU.
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm)          (Q/K/V biases where the model has them)
//! x += ffn_down(silu(ffn_gate(h)) · ffn_up(h)),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{attention, ffn, Block, Buf, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    o.rms_norm(Buf::Xb, Buf::X, &w.attn_norm)?;
    attention(o, l, w)?;
    o.add(Buf::X, Buf::Proj)?;
    o.rms_norm(Buf::Xb, Buf::X, &w.ffn_norm)?;
    ffn(o, w, Glu::Silu)?;
    o.add(Buf::X, Buf::Proj)
}
