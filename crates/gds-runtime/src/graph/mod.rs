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
mod gpt_oss;
mod llama;
mod phi3;
mod qwen3;
mod qwen3moe;
mod smollm3;

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
    /// gpt-oss's clamped SwiGLU: `g · σ(1.702 g) · (u + 1)` with `g = min(gate, 7)`,
    /// `u = clamp(up, −7, 7)` (llama.cpp's `swiglu_oai`).
    SwigluOai,
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
    /// `[n_embd]` (gpt-oss)
    pub bo: Option<V>,
    /// A logit per query head added to each softmax's denominator, with no value
    /// (gpt-oss's attention sinks) `[n_heads]`.
    pub sinks: Option<V>,
    /// norm of the attention output `[n_embd]` (gemma)
    pub post_attn_norm: Option<V>,
    /// `[n_embd]`
    pub ffn_norm: V,
    /// The feed-forward network's matrices.
    pub ffn: Ffn<M, V>,
    /// norm of the FFN output `[n_embd]` (gemma)
    pub post_ffw_norm: Option<V>,
}

/// A block's feed-forward network: one gated FFN, or a mixture of experts.
#[derive(Clone, Debug)]
pub enum Ffn<M, V> {
    /// `down(act(gate(x)) · up(x))`.
    Dense {
        /// `[n_ff, n_embd]`
        gate: M,
        /// `[n_ff, n_embd]`
        up: M,
        /// `[n_embd, n_ff]`
        down: M,
    },
    /// A router picks experts per token; each is a gated FFN (qwen3moe, gpt-oss).
    Experts(Experts<M, V>),
}

/// The mixture-of-experts FFN of a block: the experts' matrices stacked as GGUF stores them
/// (`[n, rows, cols]`), each handle one matrix of `n · rows` rows, expert `e` its rows
/// `e · rows .. (e + 1) · rows`; their biases (gpt-oss) flat, expert `e`'s at
/// `e · rows .. (e + 1) · rows` too.
#[derive(Clone, Debug)]
pub struct Experts<M, V> {
    /// The router `[n, n_embd]`: one logit per expert.
    pub router: M,
    /// The router's bias `[n]` (gpt-oss).
    pub router_bias: Option<V>,
    /// Biases of the gate, up and down matrices: `[n · n_ff]`, `[n · n_ff]`, `[n · n_embd]`
    /// (gpt-oss; all or none).
    pub biases: Option<[V; 3]>,
    /// `[n, n_ff, n_embd]`
    pub gate: M,
    /// `[n, n_ff, n_embd]`
    pub up: M,
    /// `[n, n_embd, n_ff]`
    pub down: M,
    /// Experts.
    pub n: usize,
    /// Experts used per token.
    pub used: usize,
    /// Hidden width of one expert.
    pub n_ff: usize,
    /// How the router's logits become the chosen experts' weights.
    pub gating: Gating,
}

/// How a router's logits become the weights of the experts a token goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, the `used` most probable kept, renormalized to sum 1 when
    /// `norm` (qwen3moe; llama.cpp's `SOFTMAX` gating).
    Softmax {
        /// Renormalize the kept probabilities.
        norm: bool,
    },
    /// The `used` largest logits kept, then softmaxed among themselves (gpt-oss; llama.cpp's
    /// `SOFTMAX_WEIGHT`).
    TopKSoftmax,
}

/// The experts each token of a batch goes to, by `gating`: the `used` most probable kept
/// (the lower index first among equals) and weighted (see [`Gating`]). `logits` is
/// `[n_tokens, n_experts]` and is overwritten. Returns, per expert, its tokens and their
/// weights in token order.
pub fn route(
    logits: &mut [f32],
    n_experts: usize,
    used: usize,
    gating: Gating,
) -> Vec<Vec<(usize, f32)>> {
    let mut by_expert = vec![Vec::new(); n_experts];
    let mut order: Vec<usize> = Vec::with_capacity(n_experts);
    // the kept weights divided by their sum: renormalized probabilities, or the kept
    // logits' softmax among themselves
    let normalize = match gating {
        Gating::Softmax { norm } => norm,
        Gating::TopKSoftmax => true,
    };
    for (t, row) in logits.chunks_exact_mut(n_experts).enumerate() {
        if let Gating::Softmax { .. } = gating {
            crate::ops::softmax(row);
        }
        order.clear();
        order.extend(0..n_experts);
        // descending probability, NaN last, then lower index first: a total order
        order.sort_by(|&a, &b| {
            let key = |i: usize| {
                if row[i].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    row[i]
                }
            };
            key(b).total_cmp(&key(a)).then(a.cmp(&b))
        });
        let top = &order[..used.min(n_experts)];
        if gating == Gating::TopKSoftmax {
            // the kept logits softmaxed among themselves (the first is the largest)
            let m = top.first().map_or(0.0, |&e| row[e]);
            for &e in top {
                row[e] = (row[e] - m).exp();
            }
        }
        let sum: f32 = top.iter().map(|&e| row[e]).sum();
        for &e in top {
            let w = if normalize && sum > 0.0 {
                row[e] / sum
            } else {
                row[e]
            };
            by_expert[e].push((t, w));
        }
    }
    by_expert
}

/// Where a weight role's tensor is found, and its shape. Every backend loads a [`Block`]
/// through [`Block::load`], so the names live here once.
pub trait WeightSource<M, V> {
    /// The matrix `name`, which must be `[rows, cols]`.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<M>;
    /// The vector `name`, which must be `[n]`; `None` when the model has no such tensor.
    fn vector(&mut self, name: &str, n: usize) -> Result<Option<V>>;
    /// The stacked experts' matrix `name`, which must be `[n, rows, cols]`, as one matrix of
    /// `n · rows` rows. Backends without mixture-of-experts layers keep this default.
    fn experts(&mut self, name: &str, n: usize, rows: usize, cols: usize) -> Result<M> {
        let _ = (n, rows, cols);
        Err(RuntimeError::Tensor {
            name: name.into(),
            why: "this backend has no mixture-of-experts layers".into(),
        })
    }
    /// The stacked experts' vector `name` (biases), which must be `[n, len]`, flat; `None`
    /// when the model has no such tensor. Backends without mixture-of-experts layers keep
    /// this default.
    fn expert_vectors(&mut self, name: &str, n: usize, len: usize) -> Result<Option<V>> {
        let _ = (n, len);
        Err(RuntimeError::Tensor {
            name: name.into(),
            why: "this backend has no mixture-of-experts layers".into(),
        })
    }
}

impl<M, V> Block<M, V> {
    /// Loads block `l` of a model with hyperparameters `c` from `src`. Which optional roles
    /// are required is the architecture's (checked by `gds_format::arch` at open, and again
    /// here so that a backend never runs a half-described block).
    pub fn load(c: &Config, l: usize, src: &mut impl WeightSource<M, V>) -> Result<Block<M, V>> {
        let (d, q, kv, ff, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        let n = |s: &str| format!("blk.{l}.{s}");
        let attn_norm = need(src, n("attn_norm.weight"), d)?;
        let arch = Arch::of(c)?;
        // gpt-oss names its FFN norm after the attention it follows
        let ffn_norm = need(
            src,
            n(match arch {
                Arch::GptOss => "post_attention_norm.weight",
                _ => "ffn_norm.weight",
            }),
            d,
        )?;
        let (q_norm, k_norm, post_attn_norm, post_ffw_norm) = match arch {
            Arch::Llama | Arch::Phi3 | Arch::SmolLm3 { .. } | Arch::GptOss => {
                (None, None, None, None)
            }
            Arch::Qwen3 | Arch::Qwen3Moe => (
                Some(need(src, n("attn_q_norm.weight"), hd)?),
                Some(need(src, n("attn_k_norm.weight"), hd)?),
                None,
                None,
            ),
            Arch::Gemma2 => (
                None,
                None,
                Some(need(src, n("post_attention_norm.weight"), d)?),
                Some(need(src, n("post_ffw_norm.weight"), d)?),
            ),
            Arch::Gemma3 => (
                Some(need(src, n("attn_q_norm.weight"), hd)?),
                Some(need(src, n("attn_k_norm.weight"), hd)?),
                Some(need(src, n("post_attention_norm.weight"), d)?),
                Some(need(src, n("post_ffw_norm.weight"), d)?),
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
            bo: src.vector(&n("attn_output.bias"), d)?,
            sinks: src.vector(&n("attn_sinks.weight"), c.n_heads)?,
            post_attn_norm,
            ffn_norm,
            ffn: match c.moe {
                None => Ffn::Dense {
                    gate: src.matrix(&n("ffn_gate.weight"), ff, d)?,
                    up: src.matrix(&n("ffn_up.weight"), ff, d)?,
                    down: src.matrix(&n("ffn_down.weight"), d, ff)?,
                },
                Some(moe) => {
                    // checked at open to be at most MAX_EXPERTS and 2^24
                    let (e, ffe) = (moe.n_expert as usize, moe.n_ff_exp as usize);
                    let (router_bias, biases, gating) = match arch {
                        Arch::GptOss => {
                            let mut bias = |s: &str, len: usize| -> Result<V> {
                                let name = n(s);
                                src.expert_vectors(&name, e, len)?
                                    .ok_or_else(|| missing(name))
                            };
                            let biases = [
                                bias("ffn_gate_exps.bias", ffe)?,
                                bias("ffn_up_exps.bias", ffe)?,
                                bias("ffn_down_exps.bias", d)?,
                            ];
                            (
                                Some(need(src, n("ffn_gate_inp.bias"), e)?),
                                Some(biases),
                                Gating::TopKSoftmax,
                            )
                        }
                        _ => (
                            None,
                            None,
                            Gating::Softmax {
                                norm: moe.norm_weights,
                            },
                        ),
                    };
                    Ffn::Experts(Experts {
                        router: src.matrix(&n("ffn_gate_inp.weight"), e, d)?,
                        router_bias,
                        biases,
                        gate: src.experts(&n("ffn_gate_exps.weight"), e, ffe, d)?,
                        up: src.experts(&n("ffn_up_exps.weight"), e, ffe, d)?,
                        down: src.experts(&n("ffn_down_exps.weight"), e, d, ffe)?,
                        n: e,
                        used: moe.n_expert_used as usize,
                        n_ff: ffe,
                        gating,
                    })
                }
            },
            post_ffw_norm,
        })
    }

    /// The matrices the graph uses only in matrix products, each with the number of
    /// matrices stacked in it: attention's four and a dense FFN's three (1), a mixture's
    /// gate, up and down experts (its expert count: products run over one expert's rows at
    /// a time). Not a mixture's router.
    pub fn product_matrices_mut(&mut self) -> Vec<(&mut M, usize)> {
        let mut m = vec![
            (&mut self.wq, 1),
            (&mut self.wk, 1),
            (&mut self.wv, 1),
            (&mut self.wo, 1),
        ];
        match &mut self.ffn {
            Ffn::Dense { gate, up, down } => m.extend([(gate, 1), (up, 1), (down, 1)]),
            Ffn::Experts(e) => m.extend([(&mut e.gate, e.n), (&mut e.up, e.n), (&mut e.down, e.n)]),
        }
        m
    }

    /// The matrices with their role names (llama.cpp's tensor names without `blk.N.`).
    pub fn matrices(&self) -> Vec<(&'static str, &M)> {
        let mut m = vec![
            ("attn_q", &self.wq),
            ("attn_k", &self.wk),
            ("attn_v", &self.wv),
            ("attn_output", &self.wo),
        ];
        match &self.ffn {
            Ffn::Dense { gate, up, down } => {
                m.extend([("ffn_gate", gate), ("ffn_up", up), ("ffn_down", down)])
            }
            Ffn::Experts(e) => m.extend([
                ("ffn_gate_inp", &e.router),
                ("ffn_gate_exps", &e.gate),
                ("ffn_up_exps", &e.up),
                ("ffn_down_exps", &e.down),
            ]),
        }
        m
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
    /// (causal, with the block's window, scale and cap; `sinks`: one more logit per query
    /// head in each softmax's denominator, with no value).
    fn attention(&mut self, layer: usize, sinks: Option<&Self::Vec>) -> Result<()>;
    /// `Gate = act(Gate) · Up`.
    fn glu(&mut self, act: Glu) -> Result<()>;
    /// `y += x`.
    fn add(&mut self, y: Buf, x: Buf) -> Result<()>;
    /// The mixture-of-experts FFN on `Xb`, result in `Proj`: each token's experts (see
    /// [`route`]) with the gated activation `act`, their outputs summed by weight. Backends
    /// without it keep this default (the plan keeps such models off them).
    fn moe(&mut self, experts: &Experts<Self::Mat, Self::Vec>, act: Glu) -> Result<()> {
        let _ = (experts, act);
        Err(RuntimeError::Internal(
            "this backend has no mixture-of-experts layers".into(),
        ))
    }
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
    /// Qwen 3 mixture of experts (`formats/qwen3moe.json`).
    Qwen3Moe,
    /// gpt-oss: attention sinks, a biased router and clamped-SwiGLU experts
    /// (`formats/gpt_oss.json`).
    GptOss,
    /// SmolLM3: llama blocks, every `no_rope_step`-th without RoPE (`formats/smollm3.json`).
    SmolLm3 {
        /// See [`Config::no_rope_step`].
        no_rope_step: usize,
    },
}

impl Arch {
    /// The graph of a model's `general.architecture`.
    pub fn of(c: &Config) -> Result<Arch> {
        match c.arch.as_str() {
            // Mixtral: llama's block, its FFN the experts `Config::moe` describes
            "llama" | "mixtral" => Ok(Arch::Llama),
            "gemma3" => Ok(Arch::Gemma3),
            "gemma2" => Ok(Arch::Gemma2),
            "qwen3" => Ok(Arch::Qwen3),
            "phi3" => Ok(Arch::Phi3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gpt_oss" => Ok(Arch::GptOss),
            "smollm3" => Ok(Arch::SmolLm3 {
                // required by the description; range-checked (1 ..= 2^24) at open
                no_rope_step: c.no_rope_step.unwrap_or(4).max(1),
            }),
            a => Err(RuntimeError::UnsupportedArch { arch: a.into() }),
        }
    }

    /// Factor applied to the token embeddings (Gemma: √n_embd).
    pub fn embed_scale(self, c: &Config) -> Option<f32> {
        match self {
            Arch::Llama
            | Arch::Qwen3
            | Arch::Phi3
            | Arch::Qwen3Moe
            | Arch::GptOss
            | Arch::SmolLm3 { .. } => None,
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
        Arch::Qwen3Moe => qwen3moe::block(o, l, w),
        Arch::GptOss => gpt_oss::block(o, l, w),
        Arch::SmolLm3 { no_rope_step } => smollm3::block(o, l, w, no_rope_step),
    }
}

/// Self-attention of block `l` on the normed input `Xb`, result in `Proj`: Q/K/V
/// projections (one call, the input quantized once), optional biases, optional per-head
/// Q/K norms, RoPE, attention over the cache, output projection.
pub fn attention<O: Ops>(o: &mut O, l: usize, w: &Block<O::Mat, O::Vec>) -> Result<()> {
    attention_rope(o, l, w, true)
}

/// [`attention`], with RoPE or without it (`rope` false: SmolLM3's NoPE blocks).
pub fn attention_rope<O: Ops>(
    o: &mut O,
    l: usize,
    w: &Block<O::Mat, O::Vec>,
    rope: bool,
) -> Result<()> {
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
    if rope {
        o.rope(l)?;
    }
    o.attention(l, w.sinks.as_ref())?;
    o.matmul(Buf::Att, &[(Buf::Proj, &w.wo)])?;
    match &w.bo {
        Some(b) => o.add_bias(Buf::Proj, b),
        None => Ok(()),
    }
}

/// Gated feed-forward network (or mixture of experts) on the normed input `Xb`, result in
/// `Proj`.
pub fn ffn<O: Ops>(o: &mut O, w: &Block<O::Mat, O::Vec>, act: Glu) -> Result<()> {
    match &w.ffn {
        Ffn::Dense { gate, up, down } => {
            o.matmul(Buf::Xb, &[(Buf::Gate, gate), (Buf::Up, up)])?;
            o.glu(act)?;
            o.matmul(Buf::Gate, &[(Buf::Proj, down)])
        }
        Ffn::Experts(e) => o.moe(e, act),
    }
}

/// A pre-norm block (llama and its descendants): `x += attn(norm(x))`, `x += ffn(norm(x))`.
pub fn pre_norm_block<O: Ops>(
    o: &mut O,
    l: usize,
    w: &Block<O::Mat, O::Vec>,
    act: Glu,
) -> Result<()> {
    pre_norm_block_rope(o, l, w, act, true)
}

/// [`pre_norm_block`], its attention with RoPE or without it.
pub fn pre_norm_block_rope<O: Ops>(
    o: &mut O,
    l: usize,
    w: &Block<O::Mat, O::Vec>,
    act: Glu,
    rope: bool,
) -> Result<()> {
    o.rms_norm(Buf::Xb, Buf::X, &w.attn_norm)?;
    attention_rope(o, l, w, rope)?;
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

/// The vector `name` of `[len]`, which the model must have.
fn need<M, V>(src: &mut impl WeightSource<M, V>, name: String, len: usize) -> Result<V> {
    src.vector(&name, len)?.ok_or_else(|| missing(name))
}

fn missing(name: String) -> RuntimeError {
    RuntimeError::Tensor {
        name,
        why: "missing from the manifest".into(),
    }
}

/// A required optional role (checked at load, so absent only through a loader bug).
fn role<'a, V>(v: &'a Option<V>, what: &str) -> Result<&'a V> {
    v.as_ref()
        .ok_or_else(|| RuntimeError::Internal(format!("block weight {what} was not loaded")))
}

#[cfg(test)]
mod tests {
    use super::{route, Gating};

    /// llama.cpp's order of a MoE block's routing: softmax over all experts, the largest
    /// kept, their probabilities divided by their sum when asked.
    #[test]
    fn route_keeps_the_most_probable_experts() {
        // two tokens, four experts
        let mut logits = vec![0.0, 2.0, 1.0, 2.0, /* token 1 */ 3.0, -1.0, 0.5, 0.0];
        let probs = |row: &[f32]| {
            let e: Vec<f64> = row.iter().map(|&v| (v as f64).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|v| v / s).collect::<Vec<_>>()
        };
        let (p0, p1) = (probs(&logits[..4]), probs(&logits[4..]));
        let r = route(&mut logits.clone(), 4, 2, Gating::Softmax { norm: false });
        // token 0: experts 1 and 3 tie at the top (both kept); token 1: experts 0 and 2
        assert_eq!(r[0].iter().map(|x| x.0).collect::<Vec<_>>(), vec![1]);
        assert_eq!(r[1].iter().map(|x| x.0).collect::<Vec<_>>(), vec![0]);
        assert_eq!(r[2].iter().map(|x| x.0).collect::<Vec<_>>(), vec![1]);
        assert_eq!(r[3].iter().map(|x| x.0).collect::<Vec<_>>(), vec![0]);
        assert!((r[1][0].1 as f64 - p0[1]).abs() < 1e-6);
        assert!((r[2][0].1 as f64 - p1[2]).abs() < 1e-6);
        // renormalized: each token's kept weights sum to 1, in the same ratio
        let r = route(&mut logits, 4, 2, Gating::Softmax { norm: true });
        assert!((r[1][0].1 + r[3][0].1 - 1.0).abs() < 1e-6);
        let (a, c) = (r[0][0].1 as f64, r[2][0].1 as f64);
        assert!((a + c - 1.0).abs() < 1e-6);
        assert!((a / c - p1[0] / p1[2]).abs() < 1e-4);
        // a three-way tie keeps the lower indices; every expert kept when all are used
        let mut tie = vec![1.0, 5.0, 5.0, 5.0];
        let r = route(&mut tie, 4, 2, Gating::Softmax { norm: true });
        assert!(r[0].is_empty() && r[3].is_empty());
        assert_eq!((r[1].len(), r[2].len()), (1, 1));
        let r = route(&mut [0.3, -2.0, 7.0], 3, 3, Gating::Softmax { norm: false });
        assert!(r.iter().all(|e| e.len() == 1));
        // a NaN logit (a broken model) chooses without panicking
        let r = route(
            &mut [f32::NAN, 1.0, 0.0],
            3,
            1,
            Gating::Softmax { norm: true },
        );
        assert_eq!(r.iter().map(Vec::len).sum::<usize>(), 1);
    }
}
