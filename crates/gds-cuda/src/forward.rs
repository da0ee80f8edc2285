//! The llama forward pass as a sequence of kernel launches, written once against
//! [`Device`]: the CUDA executor implements it with real launches, and the tests implement
//! it with the same kernels compiled as C++ (kernels/emu.h), so the whole pass — tensor
//! offsets, strides, grouped KV heads, RoPE positions, residuals — runs on the CPU in CI.
//!
//! Buffers are plain addresses (`u64`): device pointers on the GPU, host pointers in
//! emulation. Every address is the start of a buffer the caller owns and sized as the
//! functions below document.

use crate::kernels::kernel_suffix;
use crate::plan::{Layout, TensorMeta};
use crate::GpuError;

/// Prefill batches at least this long use [`Device::gemm`] on dequantized tiles (where the
/// device has it); shorter ones use the matvec kernels.
pub const GEMM_MIN_TOKENS: usize = 8;

/// The kernels of `kernels/*.cu` plus a copy and an optional GEMM. Dimensions are `i32`
/// because that is what the kernels take.
#[allow(clippy::too_many_arguments)]
pub trait Device {
    /// `matvec_{suffix}`: `y[t*rows + r] = W[r, :] · x[t*cols ..]` for `ntok` tokens.
    fn matvec(
        &mut self,
        suffix: &str,
        w: u64,
        x: u64,
        y: u64,
        rows: i32,
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError>;
    /// `dequant_{suffix}`: `nblocks` blocks at `src` into f32 at `dst`.
    fn dequant(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError>;
    /// `rmsnorm` of `ntok` rows of `n`.
    fn rmsnorm(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError>;
    /// `rope` in place on `ntok` rows of `n_heads × head_dim`.
    fn rope(
        &mut self,
        x: u64,
        cos: u64,
        sin: u64,
        n_heads: i32,
        head_dim: i32,
        pos0: i32,
        ntok: i32,
    ) -> Result<(), GpuError>;
    /// `attention` of `ntok` queries at `pos0..` over the cache.
    fn attention(
        &mut self,
        q: u64,
        k: u64,
        v: u64,
        att: u64,
        out: u64,
        n_heads: i32,
        n_kv_heads: i32,
        head_dim: i32,
        pos0: i32,
        ntok: i32,
        n_ctx: i32,
        scale: f32,
    ) -> Result<(), GpuError>;
    /// `swiglu`: `gate = silu(gate) * up` over `n` floats.
    fn swiglu(&mut self, gate: u64, up: u64, n: i32) -> Result<(), GpuError>;
    /// `add_inplace`: `y += x` over `n` floats.
    fn add(&mut self, y: u64, x: u64, n: i32) -> Result<(), GpuError>;
    /// Copies `bytes` bytes (same device).
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError>;
    /// Column-major SGEMM `C[m×n] = op(A)·B` with `op(A) = Aᵀ` (A is `k×m`, lda = k), B `k×n`
    /// (ldb = k), C ldc = m. `false` when the device has no GEMM (the caller falls back).
    fn gemm(&mut self, a: u64, b: u64, c: u64, m: i32, n: i32, k: i32) -> Result<bool, GpuError>;
}

/// Activation and scratch buffers (f32), sized for `max_tokens` tokens and `ctx` positions:
/// `x` `max_tokens × n_embd`; `xb` `max_tokens × max(n_embd, n_ff, q_dim)`; `q`, `attn`
/// `max_tokens × q_dim`; `k`, `v` `max_tokens × kv_dim`; `att` `max_tokens × n_heads × ctx`;
/// `gate`, `up` `max_tokens × n_ff`; `logits` `vocab`; `tile` the largest weight's elements.
#[derive(Clone, Copy, Debug)]
pub struct Scratch {
    /// Residual stream.
    pub x: u64,
    /// Normed input / projection output.
    pub xb: u64,
    /// Queries.
    pub q: u64,
    /// New keys.
    pub k: u64,
    /// New values.
    pub v: u64,
    /// Attention output.
    pub attn: u64,
    /// Attention scores.
    pub att: u64,
    /// FFN gate (then SwiGLU output).
    pub gate: u64,
    /// FFN up.
    pub up: u64,
    /// Logits of the last token.
    pub logits: u64,
    /// Dequantized weight tile for GEMM prefill.
    pub tile: u64,
}

/// Per-call context of the pass: the layout, where each layer's bytes are, and the caches.
pub struct Pass<'a> {
    /// The model.
    pub layout: &'a Layout,
    /// Address of each layer's bytes (manifest order) for this call: resident buffer or
    /// the streaming slot it was read into; 0 for a layer not available.
    pub layer_base: &'a [u64],
    /// Scratch buffers.
    pub s: Scratch,
    /// Per block: key and value caches, `ctx × kv_dim` f32 each.
    pub kv: &'a [(u64, u64)],
    /// RoPE tables `ctx × head_dim/2` (cos, sin).
    pub rope: (u64, u64),
    /// KV cache positions.
    pub ctx: usize,
}

const F32: u64 = 4;

impl Pass<'_> {
    fn tensor(&self, name: &str) -> Result<TensorMeta, GpuError> {
        self.layout
            .tensors
            .get(name)
            .copied()
            .ok_or_else(|| GpuError::Model(format!("missing tensor {name}")))
    }

    fn addr(&self, t: &TensorMeta) -> Result<u64, GpuError> {
        match self.layer_base.get(t.layer) {
            Some(&b) if b != 0 => Ok(b + t.offset as u64),
            _ => Err(GpuError::Model(format!("layer {} is not in VRAM", t.layer))),
        }
    }

    /// `y = W · x` for `ntok` rows of x.
    fn linear(
        &self,
        dev: &mut dyn Device,
        t: &TensorMeta,
        x: u64,
        y: u64,
        ntok: usize,
    ) -> Result<(), GpuError> {
        let suffix = kernel_suffix(t.dtype)
            .ok_or_else(|| GpuError::Model(format!("no GPU kernel for {} weights", t.dtype)))?;
        let w = self.addr(t)?;
        let (rows, cols) = (t.rows as i32, t.cols as i32);
        if ntok >= GEMM_MIN_TOKENS {
            let nblocks = (t.rows * t.cols / t.dtype.block_size()) as i32;
            dev.dequant(suffix, w, self.s.tile, nblocks)?;
            if dev.gemm(self.s.tile, x, y, rows, ntok as i32, cols)? {
                return Ok(());
            }
        }
        dev.matvec(suffix, w, x, y, rows, cols, ntok as i32)
    }

    /// Embedding rows of `tokens` into `s.x`.
    pub fn embed(&self, dev: &mut dyn Device, tokens: &[u32]) -> Result<(), GpuError> {
        let t = self.tensor("token_embd.weight")?;
        let suffix = kernel_suffix(t.dtype)
            .ok_or_else(|| GpuError::Model(format!("no GPU kernel for {} embeddings", t.dtype)))?;
        let row_bytes = (t.nbytes / t.rows) as u64;
        let base = self.addr(&t)?;
        let nblocks = (t.cols / t.dtype.block_size()) as i32;
        let n = self.layout.shape.n_embd as u64;
        for (i, &tok) in tokens.iter().enumerate() {
            if tok as usize >= t.rows {
                return Err(GpuError::Model(format!(
                    "token {tok} outside the vocabulary"
                )));
            }
            dev.dequant(
                suffix,
                base + tok as u64 * row_bytes,
                self.s.x + i as u64 * n * F32,
                nblocks,
            )?;
        }
        Ok(())
    }

    /// Transformer block `b` on `ntok` tokens at positions `pos0..`.
    pub fn block(
        &self,
        dev: &mut dyn Device,
        b: usize,
        ntok: usize,
        pos0: usize,
    ) -> Result<(), GpuError> {
        let sh = &self.layout.shape;
        let t = |name: &str| self.tensor(&format!("blk.{b}.{name}"));
        let (n, ff) = (sh.n_embd, sh.n_ff);
        let (q_dim, kv_dim) = (sh.n_heads * sh.head_dim, sh.n_kv_heads * sh.head_dim);
        let s = self.s;
        let nt = ntok as i32;

        dev.rmsnorm(
            s.x,
            self.addr(&t("attn_norm.weight")?)?,
            s.xb,
            n as i32,
            nt,
            sh.eps,
        )?;
        self.linear(dev, &t("attn_q.weight")?, s.xb, s.q, ntok)?;
        self.linear(dev, &t("attn_k.weight")?, s.xb, s.k, ntok)?;
        self.linear(dev, &t("attn_v.weight")?, s.xb, s.v, ntok)?;
        for (bias, out, dim) in [
            ("attn_q.bias", s.q, q_dim),
            ("attn_k.bias", s.k, kv_dim),
            ("attn_v.bias", s.v, kv_dim),
        ] {
            if let Ok(bt) = t(bias) {
                let ba = self.addr(&bt)?;
                for i in 0..ntok as u64 {
                    dev.add(out + i * dim as u64 * F32, ba, dim as i32)?;
                }
            }
        }
        let (hd, p0) = (sh.head_dim as i32, pos0 as i32);
        dev.rope(s.q, self.rope.0, self.rope.1, sh.n_heads as i32, hd, p0, nt)?;
        dev.rope(
            s.k,
            self.rope.0,
            self.rope.1,
            sh.n_kv_heads as i32,
            hd,
            p0,
            nt,
        )?;
        let (kc, vc) = self.kv[b];
        let at = (pos0 * kv_dim) as u64 * F32;
        let bytes = ntok * kv_dim * F32 as usize;
        dev.copy(kc + at, s.k, bytes)?;
        dev.copy(vc + at, s.v, bytes)?;
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        dev.attention(
            s.q,
            kc,
            vc,
            s.att,
            s.attn,
            sh.n_heads as i32,
            sh.n_kv_heads as i32,
            hd,
            p0,
            nt,
            self.ctx as i32,
            scale,
        )?;
        self.linear(dev, &t("attn_output.weight")?, s.attn, s.xb, ntok)?;
        dev.add(s.x, s.xb, (ntok * n) as i32)?;

        dev.rmsnorm(
            s.x,
            self.addr(&t("ffn_norm.weight")?)?,
            s.xb,
            n as i32,
            nt,
            sh.eps,
        )?;
        self.linear(dev, &t("ffn_gate.weight")?, s.xb, s.gate, ntok)?;
        self.linear(dev, &t("ffn_up.weight")?, s.xb, s.up, ntok)?;
        dev.swiglu(s.gate, s.up, (ntok * ff) as i32)?;
        self.linear(dev, &t("ffn_down.weight")?, s.gate, s.xb, ntok)?;
        dev.add(s.x, s.xb, (ntok * n) as i32)
    }

    /// Final norm and output head for the last of `ntok` tokens, into `s.logits`.
    pub fn head(&self, dev: &mut dyn Device, ntok: usize) -> Result<(), GpuError> {
        let n = self.layout.shape.n_embd as u64;
        let norm = self.tensor("output_norm.weight")?;
        let last = self.s.x + (ntok as u64 - 1) * n * F32;
        dev.rmsnorm(
            last,
            self.addr(&norm)?,
            self.s.xb,
            n as i32,
            1,
            self.layout.shape.eps,
        )?;
        self.linear(dev, &self.layout.output, self.s.xb, self.s.logits, 1)
    }
}
