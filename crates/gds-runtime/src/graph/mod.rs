//! The model graphs: one small file per architecture (`llama.rs`, `gemma3.rs`) wiring a
//! block from shared helpers ([`attention`], [`ffn`]) over a typed ops interface ([`Ops`]).
//!
//! The graph never sees bytes, files or threads: a backend implements [`Ops`] over its own
//! buffers and weight handles (the CPU's in [`crate::model`], the CUDA kernels' in
//! [`crate::exec::cuda_graph`], and an f64 test reference in
//! crates/gds-cuda/tests/it/forward_emu.rs), and the executor calls [`block`] for each block once that block's weights are resident. So an architecture is written once for every backend, the
//! way llama.cpp's `src/models/<arch>.cpp` sit on `llm_graph_context`'s helpers, but with the
//! backend strictly below the graph.
//!
//! Adding an architecture: a description in `formats/<arch>.json` (names, keys, shapes), a
//! graph file here, a [`Arch`] variant, and only the ops it adds.

mod gemma2;
mod gemma3;
mod llama;
mod phi3;
mod qwen3;

use crate::config::Config;
use crate::error::{Result, RuntimeError};

/// The activation buffers a graph names. Widths per token: `X`, `Xb`, `Proj`: n_embd; `Q`,
/// `Att`: n_heads·head_dim; `K`, `V`: n_kv_heads·head_dim; `Gate`, `Up`: n_ff.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The residual stream.
    X,
    /// A sub-layer's normed input.
    Xb,
    /// Queries.
    Q,
    /// Keys of the batch.
    K,
    /// Values of the batch.
    V,
    /// Attention output (heads concatenated).
    Att,
    /// A sub-layer's output projection.
    Proj,
    /// FFN gate (then the gated activation).
    Gate,
    /// FFN up projection.
    Up,
}

/// The gated activation of the feed-forward network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// `silu(gate) * up` (llama, Qwen, Phi, Mistral).
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
}

/// Weights of one block by role, in the backend's handles: `M` a matrix, `V` a vector
/// (norm weight or bias). Optional roles are the ones only some architectures have.
#[derive(Clone, Debug)]
pub struct Block<M, V> {
    /// `[n_embd]`
    pub attn_norm: V,
    /// `[q_dim, n_embd]`
    pub wq: M,
    /// `[kv_dim, n_embd]`
    pub wk: M,
    /// `[kv_dim, n_embd]`
    pub wv: M,
    /// `[q_dim]` (qwen2)
    pub bq: Option<V>,
    /// `[kv_dim]` (qwen2)
    pub bk: Option<V>,
    /// `[kv_dim]` (qwen2)
    pub bv: Option<V>,
    /// per-head query norm `[head_dim]` (gemma3, qwen3)
    pub q_norm: Option<V>,
    /// per-head key norm `[head_dim]` (gemma3, qwen3)
    pub k_norm: Option<V>,
    /// `[n_embd, q_dim]`
    pub wo: M,
    /// norm of the attention output `[n_embd]` (gemma)
    pub post_attn_norm: Option<V>,
    /// `[n_embd]`
    pub ffn_norm: V,
    /// `[n_ff, n_embd]`
    pub w_gate: M,
    /// `[n_ff, n_embd]`
    pub w_up: M,
    /// `[n_embd, n_ff]`
    pub w_down: M,
    /// norm of the FFN output `[n_embd]` (gemma)
    pub post_ffw_norm: Option<V>,
}

/// Where a weight role's tensor is found, and its shape. Every backend loads a [`Block`]
/// through [`Block::load`], so the names live here once.
pub trait WeightSource<M, V> {
    /// The matrix `name`, which must be `[rows, cols]`.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<M>;
    /// The vector `name`, which must be `[n]`; `None` when the model has no such tensor.
    fn vector(&mut self, name: &str, n: usize) -> Result<Option<V>>;
}

impl<M, V> Block<M, V> {
    /// Loads block `l` of a model with hyperparameters `c` from `src`. Which optional roles
    /// are required is the architecture's (checked by `gds_format::arch` at open, and again
    /// here so that a backend never runs a half-described block).
    pub fn load(c: &Config, l: usize, src: &mut impl WeightSource<M, V>) -> Result<Block<M, V>> {
        let (d, q, kv, ff, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        let n = |s: &str| format!("blk.{l}.{s}");
        let mut need = |name: String, len: usize| -> Result<V> {
            src.vector(&name, len)?.ok_or_else(|| RuntimeError::Tensor {
                name,
                why: "missing from the manifest".into(),
            })
        };
        let attn_norm = need(n("attn_norm.weight"), d)?;
        let ffn_norm = need(n("ffn_norm.weight"), d)?;
        let arch = Arch::of(c)?;
        let (q_norm, k_norm, post_attn_norm, post_ffw_norm) = match arch {
            Arch::Llama | Arch::Phi3 => (None, None, None, None),
            Arch::Qwen3 => (
                Some(need(n("attn_q_norm.weight"), hd)?),
                Some(need(n("attn_k_norm.weight"), hd)?),
                None,
                None,
            ),
            Arch::Gemma2 => (
                None,
                None,
                Some(need(n("post_attention_norm.weight"), d)?),
                Some(need(n("post_ffw_norm.weight"), d)?),
            ),
            Arch::Gemma3 => (
                Some(need(n("attn_q_norm.weight"), hd)?),
                Some(need(n("attn_k_norm.weight"), hd)?),
                Some(need(n("post_attention_norm.weight"), d)?),
                Some(need(n("post_ffw_norm.weight"), d)?),
            ),
        };
        Ok(Block {
            attn_norm,
            wq: src.matrix(&n("attn_q.weight"), q, d)?,
            wk: src.matrix(&n("attn_k.weight"), kv, d)?,
            wv: src.matrix(&n("attn_v.weight"), kv, d)?,
            bq: src.vector(&n("attn_q.bias"), q)?,
            bk: src.vector(&n("attn_k.bias"), kv)?,
            bv: src.vector(&n("attn_v.bias"), kv)?,
            q_norm,
            k_norm,
            wo: src.matrix(&n("attn_output.weight"), d, q)?,
            post_attn_norm,
            ffn_norm,
            w_gate: src.matrix(&n("ffn_gate.weight"), ff, d)?,
            w_up: src.matrix(&n("ffn_up.weight"), ff, d)?,
            w_down: src.matrix(&n("ffn_down.weight"), d, ff)?,
            post_ffw_norm,
        })
    }

    /// The matrices with their role names.
    pub fn matrices(&self) -> [(&'static str, &M); 7] {
        [
            ("attn_q", &self.wq),
            ("attn_k", &self.wk),
            ("attn_v", &self.wv),
            ("attn_output", &self.wo),
            ("ffn_gate", &self.w_gate),
            ("ffn_up", &self.w_up),
            ("ffn_down", &self.w_down),
        ]
    }
}

/// The typed operations a graph is written against, over the batch of tokens the backend
/// is running. Every op works on whole rows of the named buffers, one row per token.
pub trait Ops {
    /// A weight matrix handle.
    type Mat;
    /// A weight vector handle.
    type Vec;
    /// `out = rmsnorm(x) · w` per token (`out` may be `x`).
    fn rms_norm(&mut self, out: Buf, x: Buf, w: &Self::Vec) -> Result<()>;
    /// RMSNorm of every head of `buf` (`head_dim` wide) in place, with one `[head_dim]`
    /// weight shared by the heads.
    fn head_norm(&mut self, buf: Buf, w: &Self::Vec) -> Result<()>;
    /// `outs[i] = x · ws[i]ᵀ` per token: several products of one input (quantized once).
    fn matmul(&mut self, x: Buf, outs: &[(Buf, &Self::Mat)]) -> Result<()>;
    /// `buf += b` per token.
    fn add_bias(&mut self, buf: Buf, b: &Self::Vec) -> Result<()>;
    /// RoPE of `Q` and `K` at each token's position, with block `layer`'s frequencies.
    fn rope(&mut self, layer: usize) -> Result<()>;
    /// Stores `K`, `V` in block `layer`'s cache and writes `Att` = attention of `Q` over it
    /// (causal, with the block's window, scale and cap).
    fn attention(&mut self, layer: usize) -> Result<()>;
    /// `Gate = act(Gate) · Up`.
    fn glu(&mut self, act: Glu) -> Result<()>;
    /// `y += x`.
    fn add(&mut self, y: Buf, x: Buf) -> Result<()>;
}

/// The architectures with a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// llama, mistral, qwen2, smollm (`formats/llama.json`).
    Llama,
    /// Gemma 3 text (`formats/gemma3.json`).
    Gemma3,
    /// Gemma 2 (`formats/gemma2.json`).
    Gemma2,
    /// Qwen 3 dense (`formats/qwen3.json`).
    Qwen3,
    /// Phi-3, Phi-3.5, Phi-4-mini (`formats/phi3.json`).
    Phi3,
}

impl Arch {
    /// The graph of a model's `general.architecture`.
    pub fn of(c: &Config) -> Result<Arch> {
        match c.arch.as_str() {
            "llama" => Ok(Arch::Llama),
            "gemma3" => Ok(Arch::Gemma3),
            "gemma2" => Ok(Arch::Gemma2),
            "qwen3" => Ok(Arch::Qwen3),
            "phi3" => Ok(Arch::Phi3),
            a => Err(RuntimeError::UnsupportedArch { arch: a.into() }),
        }
    }

    /// Factor applied to the token embeddings (Gemma: √n_embd).
    pub fn embed_scale(self, c: &Config) -> Option<f32> {
        match self {
            Arch::Llama | Arch::Qwen3 | Arch::Phi3 => None,
            Arch::Gemma3 | Arch::Gemma2 => Some((c.n_embd as f32).sqrt()),
        }
    }
}

/// Runs block `l` over the batch: the architecture's graph.
pub fn block<O: Ops>(arch: Arch, o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    match arch {
        Arch::Llama => llama::block(o, l, w),
        Arch::Gemma3 => gemma3::block(o, l, w),
        Arch::Gemma2 => gemma2::block(o, l, w),
        Arch::Qwen3 => qwen3::block(o, l, w),
        Arch::Phi3 => phi3::block(o, l, w),
    }
}

/// Self-attention of block `l` on the normed input `Xb`, result in `Proj`: Q/K/V
/// projections (one call, the input quantized once), optional biases, optional per-head
/// Q/K norms, RoPE, attention over the cache, output projection.
pub fn attention<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    o.matmul(
        Buf::Xb,
        &[(Buf::Q, &w.wq), (Buf::K, &w.wk), (Buf::V, &w.wv)],
    )?;
    for (buf, b) in [(Buf::Q, &w.bq), (Buf::K, &w.bk), (Buf::V, &w.bv)] {
        if let Some(b) = b {
            o.add_bias(buf, b)?;
        }
    }
    if let Some(n) = &w.q_norm {
        o.head_norm(Buf::Q, n)?;
    }
    if let Some(n) = &w.k_norm {
        o.head_norm(Buf::K, n)?;
    }
    o.rope(l)?;
    o.attention(l)?;
    o.matmul(Buf::Att, &[(Buf::Proj, &w.wo)])
}

/// Gated feed-forward network on the normed input `Xb`, result in `Proj`.
pub fn ffn<O: Ops>(o: &mut O, w: &Block<O::Mat, O::Vec>, act: Glu) -> Result<()> {
    o.matmul(Buf::Xb, &[(Buf::Gate, &w.w_gate), (Buf::Up, &w.w_up)])?;
    o.glu(act)?;
    o.matmul(Buf::Gate, &[(Buf::Proj, &w.w_down)])
}

/// A pre-norm block (llama and its descendants): `x += attn(norm(x))`, `x += ffn(norm(x))`.
pub fn pre_norm_block<O: Ops>(
    o: &mut O,
    l: usize,
    w: &Block<O::Mat, O::Vec>,
    act: Glu,
) -> Result<()> {
    o.rms_norm(Buf::Xb, Buf::X, &w.attn_norm)?;
    attention(o, l, w)?;
    o.add(Buf::X, Buf::Proj)?;
    o.rms_norm(Buf::Xb, Buf::X, &w.ffn_norm)?;
    ffn(o, w, act)?;
    o.add(Buf::X, Buf::Proj)
}

/// A sandwich-norm block (Gemma 2 and 3): each sub-layer's output is normed again before the
/// residual add.
pub fn sandwich_block<O: Ops>(
    o: &mut O,
    l: usize,
    w: &Block<O::Mat, O::Vec>,
    act: Glu,
) -> Result<()> {
    o.rms_norm(Buf::Xb, Buf::X, &w.attn_norm)?;
    attention(o, l, w)?;
    o.rms_norm(
        Buf::Proj,
        Buf::Proj,
        role(&w.post_attn_norm, "post_attention_norm")?,
    )?;
    o.add(Buf::X, Buf::Proj)?;
    o.rms_norm(Buf::Xb, Buf::X, &w.ffn_norm)?;
    ffn(o, w, act)?;
    o.rms_norm(
        Buf::Proj,
        Buf::Proj,
        role(&w.post_ffw_norm, "post_ffw_norm")?,
    )?;
    o.add(Buf::X, Buf::Proj)
}

/// A required optional role (checked at load, so absent only through a loader bug).
fn role<'a, V>(v: &'a Option<V>, what: &str) -> Result<&'a V> {
    v.as_ref()
        .ok_or_else(|| RuntimeError::Internal(format!("block weight {what} was not loaded")))
}
