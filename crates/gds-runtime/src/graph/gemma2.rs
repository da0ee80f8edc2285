//! Gemma 2: Gemma 3's sandwich block without the per-head Q/K norms; its attention-score
//! and output-logit caps are the backend's per-layer attention parameters and the final
//! step (from [`crate::Config`]), alternate layers attend through the window.
//!
//! ```text
//! x += post_attention_norm(attn(rmsnorm(x) · attn_norm))   scores 50·tanh(s/50)
//! x += post_ffw_norm(ffn_down(gelu(ffn_gate(h)) · ffn_up(h))),  h = rmsnorm(x) · ffn_norm
//! ```

use super::{attention, ffn, role, Block, Buf, Glu, Ops};
use crate::error::Result;

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    o.rms_norm(Buf::Xb, Buf::X, &w.attn_norm)?;
    attention(o, l, w)?;
    o.rms_norm(
        Buf::Proj,
        Buf::Proj,
        role(&w.post_attn_norm, "post_attention_norm")?,
    )?;
    o.add(Buf::X, Buf::Proj)?;
    o.rms_norm(Buf::Xb, Buf::X, &w.ffn_norm)?;
    ffn(o, w, Glu::GeluTanh)?;
    o.rms_norm(
        Buf::Proj,
        Buf::Proj,
        role(&w.post_ffw_norm, "post_ffw_norm")?,
    )?;
    o.add(Buf::X, Buf::Proj)
}
