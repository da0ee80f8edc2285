//! Qwen 3 mixture of experts (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen 3's
//! block with the dense FFN replaced by experts.
//!
//! ```text
//! x += attn(rmsnorm(x) · attn_norm)        q = q_norm(q), k = k_norm(k) per head
//! h = rmsnorm(x) · ffn_norm
//! p = softmax(ffn_gate_inp · h); keep the n_expert_used largest, renormalized to sum 1
//! x += Σ_e p_e · ffn_down_exps[e](silu(ffn_gate_exps[e](h)) · ffn_up_exps[e](h))
//! ```

use super::{pre_norm_block, role, Block, Ffn, Glu, Ops};
use crate::error::{Result, RuntimeError};

pub(super) fn block<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    role(&w.q_norm, "attn_q_norm")?;
    role(&w.k_norm, "attn_k_norm")?;
    if !matches!(w.ffn, Ffn::Experts(_)) {
        return Err(RuntimeError::Internal(
            "a qwen3moe block was loaded without its experts".into(),
        ));
    }
    pre_norm_block(o, l, w, Glu::Silu)
}
