//! gpt-oss (gpt-oss-20b, gpt-oss-120b): pre-norm blocks whose attention has biases and a
//! learned sink per head, and a mixture of experts with a biased router and clamped-SwiGLU
//! experts with biases (llama.cpp's `openai-moe.cpp`).
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm) + bo     q, k, v with biases; softmax over the keys
//!                                            and the head's sink (a logit with no value)
//! h = rmsnorm(x) · post_attention_norm
//! l = ffn_gate_inp · h + b; keep the n_expert_used largest, softmaxed among themselves
//! x += Σ_e p_e · (down_e(swiglu_oai(gate_e(h) + bg_e, up_e(h) + bu_e)) + bd_e)
//! ```

use super::{pre_norm_block, role, Block, Ffn, Glu, Ops};
use crate::error::{Result, RuntimeError};

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    role(&w.sinks, "attn_sinks")?;
    role(&w.bo, "attn_output.bias")?;
    match &w.ffn {
        Ffn::Experts(e) if e.router_bias.is_some() && e.biases.is_some() => {}
        _ => {
            return Err(RuntimeError::Internal(
                "a gpt-oss block was loaded without its experts and their biases".into(),
            ))
        }
    }
    pre_norm_block(o, l, w, Glu::SwigluOai)
}
