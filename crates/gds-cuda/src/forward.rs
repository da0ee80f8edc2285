//! The GPU side of the forward pass, written once against [`Device`]: the CUDA executor
//! implements it with real launches, and the tests implement it with the same kernels
//! compiled as C++ (kernels/emu.h), so the whole pass — tensor offsets, strides, grouped KV
//! heads, RoPE positions, residuals — runs on the CPU in CI.
//!
//! What a block computes is not written here: the model's graph (`gds_runtime::graph`, one
//! file per architecture over the `Ops` trait) is handed to the executor as a
//! [`BlockGraph`], and runs each block over [`Pass`]'s buffers and the [`Device`]'s kernels.
//! This module has what every architecture shares: the embedding lookup, the matrix
//! products ([`Pass::linear`]) and the output head.
//!
//! Buffers are plain addresses (`u64`): device pointers on the GPU, host pointers in
//! emulation. Every address is the start of a buffer the caller owns and sized as the
//! functions below document.

use crate::kernels::{kernel_suffix, q8_kernel_suffix, MMQ8_MATRICES, Q8A_VALUES};
use crate::plan::{KvGeo, Layout, TensorMeta};
use crate::GpuError;

/// Prefill batches at least this long use [`Device::gemm`] on dequantized tiles (where the
/// device has it); shorter ones use the matvec kernels. The default of the plan's
/// `gemm_min_tokens` (`--gemm-min-tokens`, alias `GDS_GEMM_MIN_TOKENS`), which
/// [`Scratch::gemm_min`] carries to the pass: a knob to measure the crossover on hardware
/// (an H100's batched decode at 16 tokens was GEMM-bound, 2026-11-27).
pub const GEMM_MIN_TOKENS: usize = 8;

/// The crossover with 8-bit activations (`--activations q8`, the default): the int8 matvec
/// kernels carry eight tokens per weight load and loop over the pass's tokens, while a GEMM
/// pass first dequantizes every weight into a tile; on an H200 (2026-12-04) the server's
/// decode of 16 sequences through the GEMMs gave less aggregate t/s than 4 through the
/// matvecs (7B: 183 vs 391; the tile writes took most of a 7B pass, ~145 ms of pp512's 165),
/// so passes up to 31 tokens stay on the int8 kernels (unmeasured on hardware yet:
/// `scripts/gpu-real-size.sh` runs the server at 16 clients with the former 8 as well).
pub const GEMM_MIN_TOKENS_Q8: usize = 32;

/// What a GEMM's inputs are rounded to (`--gemm-type`): the weights dequantized into the
/// tile and the activations multiplied with them. The product always accumulates in f32
/// and is written as f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    /// Plain f32 (SGEMM on the CUDA cores): the reference arithmetic, `--activations f32`'s
    /// default.
    F32,
    /// f32 buffers the tensor cores read as TF32 (10-bit mantissas; cuBLAS's TF32 math mode).
    Tf32,
    /// Both operands converted to f16 (saturated to ±65504, `f32_to_f16_sat`) and multiplied
    /// on the tensor cores with f32 accumulation (`cublasGemmEx`, as llama.cpp's cuBLAS path
    /// does): half the tile's bytes and twice TF32's rate; `--activations q8`'s default.
    F16,
}

impl GemmType {
    /// Every type, by its `--gemm-type` name.
    pub const ALL: [(&'static str, GemmType); 3] = [
        ("f16", GemmType::F16),
        ("tf32", GemmType::Tf32),
        ("f32", GemmType::F32),
    ];

    /// The `--gemm-type` name.
    pub fn name(self) -> &'static str {
        match self {
            GemmType::F32 => "f32",
            GemmType::Tf32 => "tf32",
            GemmType::F16 => "f16",
        }
    }

    /// The type a `--gemm-type` name names.
    pub fn parse(name: &str) -> Option<GemmType> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, t)| t)
    }

    /// Bytes of one element of the operands.
    pub fn elem_bytes(self) -> usize {
        match self {
            GemmType::F16 => 2,
            GemmType::F32 | GemmType::Tf32 => 4,
        }
    }
}

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
    /// `quantize_q8`: `nblocks` blocks of 32 f32 at `x` into 8-bit blocks at `xq`
    /// ([`Q8A_BYTES`](crate::kernels::Q8A_BYTES) each).
    fn quantize_q8(&mut self, x: u64, xq: u64, nblocks: i32) -> Result<(), GpuError>;
    /// `matvec_q8_{suffix}`: [`Device::matvec`] over the activations `quantize_q8` wrote
    /// at `xq` (int8 dot products), for each of `outs` (1 to
    /// [`MMQ8_MATRICES`](crate::kernels::MMQ8_MATRICES) matrices of the same type and
    /// `cols`) in one launch.
    fn matvec_q8(
        &mut self,
        suffix: &str,
        xq: u64,
        outs: &[Q8Out],
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError>;
    /// Whether [`Device::mmq`] runs here (the long passes' products of the int8 types go
    /// through it instead of a dequantized tile).
    fn offers_mmq(&self) -> bool {
        false
    }
    /// `mmq_{suffix}`: `out`'s `y = W · x` for the `ntok` tokens whose activations
    /// `quantize_q8` wrote at `xq`, on the tensor cores (int8 products, the int8 matvecs'
    /// arithmetic) instead of a dequantized tile. Only where [`Device::offers_mmq`].
    fn mmq(
        &mut self,
        _suffix: &str,
        _xq: u64,
        _out: Q8Out,
        _cols: i32,
        _ntok: i32,
    ) -> Result<(), GpuError> {
        Err(GpuError::Model(
            "no int8 tensor-core kernels on this device".into(),
        ))
    }
    /// `dequant_{suffix}`: `nblocks` blocks at `src` into f32 at `dst`.
    fn dequant(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError>;
    /// `dequant16_{suffix}`: `nblocks` blocks at `src` into f16 at `dst` (an f16 GEMM's
    /// tile; values beyond ±65504 saturated).
    fn dequant16(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32)
        -> Result<(), GpuError>;
    /// `to_f16`: `n` floats at `x` into f16 at `dst` (an f16 GEMM's activations; values
    /// beyond ±65504 saturated).
    fn to_f16(&mut self, x: u64, dst: u64, n: i32) -> Result<(), GpuError>;
    /// `rmsnorm` of `ntok` rows of `n` (`out` may be `x`).
    fn rmsnorm(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError>;
    /// `rope` in place on `ntok` rows of `n_heads × head_dim`, row t at position `pos[t]`
    /// (`pos`: i32 per token): the first `2·half` dimensions of each head, adjacent pairs or
    /// (`neox`) halves; tables `[pos][half]`.
    fn rope(
        &mut self,
        x: u64,
        cos: u64,
        sin: u64,
        n_heads: i32,
        head_dim: i32,
        half: i32,
        neox: bool,
        pos: u64,
        ntok: i32,
    ) -> Result<(), GpuError>;
    /// `rmsnorm_q8`: [`Device::rmsnorm`], and its output quantized into `xq` as
    /// [`Device::quantize_q8`] would (`n` a multiple of 32): one launch.
    fn rmsnorm_q8(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        xq: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError>;
    /// `rope_kv` (`rope_kv_f16` where the caches are f16): [`Device::rope`] of the
    /// queries `q` (`heads.n_heads` per token) and keys `k` (`heads.n_kv_heads`), then
    /// [`Device::kv_store`] of `k` and `v` into the caches `kc`, `vc`: one launch (`qkv`
    /// = `(q, k, v)`, `caches` = `(kc, vc)`).
    fn rope_kv(
        &mut self,
        qkv: (u64, u64, u64),
        caches: (u64, u64),
        rope: RopeArgs,
        heads: Heads,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError>;
    /// `kv_store`: the `ntok` new rows of `k`, `v` (`kv_dim` floats each) into the paged
    /// caches `kc`, `vc` at each token's row ([`KvPages`]; `kv_store_f16` where the caches
    /// are f16).
    fn kv_store(
        &mut self,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        kv_dim: i32,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError>;
    /// `attention` of `ntok` queries, token t at its position of its sequence
    /// ([`KvPages`]), over the paged caches `kc`, `vc`, which hold every position the
    /// queries see; `att` holds `n_ctx` scores per query head; `window` 0 and `softcap` 0
    /// for none; `sinks` (0 for none) one logit per query head in each softmax's maximum
    /// and denominator, with no value (gpt-oss); `attention_f16` where the caches are f16.
    fn attention(
        &mut self,
        q: u64,
        kc: u64,
        vc: u64,
        att: u64,
        out: u64,
        heads: Heads,
        ntok: i32,
        n_ctx: i32,
        pages: &KvPages,
        window: i32,
        softcap: f32,
        sinks: u64,
    ) -> Result<(), GpuError>;
    /// `gather_rows`: `dst[r] = src[rows[r]]` for `nrows` rows of `n` floats (`rows`: i32
    /// each).
    fn gather_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError>;
    /// The gated activation `act` (kernels/ops.cu: `swiglu`, `swiglu_oai`, `geglu`):
    /// `gate = act(gate, up)` over `n` floats.
    fn glu(&mut self, act: GluAct, gate: u64, up: u64, n: i32) -> Result<(), GpuError>;
    /// [`Device::glu`], and its output quantized into `xq` as [`Device::quantize_q8`]
    /// would (`n` a multiple of 32; the `_q8` kernels): one launch.
    fn glu_q8(&mut self, act: GluAct, gate: u64, up: u64, xq: u64, n: i32) -> Result<(), GpuError>;
    /// `scatter_add_rows`: `dst[rows[r]] += w[r] · src[r]` for `nrows` rows of `n` floats
    /// (`rows`: `nrows` i32 row indices, distinct, then the `nrows` weights' f32 bits).
    fn scatter_add_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError>;
    /// `add_rows`: `y[t, i] += b[i]` for `ntok` rows of `n`.
    fn add_rows(&mut self, y: u64, b: u64, n: i32, ntok: i32) -> Result<(), GpuError>;
    /// `scale_inplace`: `x *= s` over `n` floats.
    fn scale(&mut self, x: u64, s: f32, n: i32) -> Result<(), GpuError>;
    /// `softcap_inplace`: `x = cap·tanh(x / cap)` over `n` floats.
    fn softcap(&mut self, x: u64, cap: f32, n: i32) -> Result<(), GpuError>;
    /// `add_inplace`: `y += x` over `n` floats.
    fn add(&mut self, y: u64, x: u64, n: i32) -> Result<(), GpuError>;
    /// Copies `bytes` bytes (same device).
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError>;
    /// Zeroes `bytes` bytes, in order with the launches.
    fn zero(&mut self, dst: u64, bytes: usize) -> Result<(), GpuError>;
    /// Copies `dst.len()` floats at `src` to the host once every launch before this call
    /// has run (a synchronization: a mixture of experts' router logits).
    fn download(&mut self, src: u64, dst: &mut [f32]) -> Result<(), GpuError>;
    /// Copies `src` to the device at `dst`, after the launches before this call read what
    /// was there and before those after it (a mixture of experts' token rows and weights).
    fn upload_words(&mut self, dst: u64, src: &[u32]) -> Result<(), GpuError>;
    /// Column-major GEMM `C[m×n] = op(A)·B` (`mnk` = `(m, n, k)`) with `op(A) = Aᵀ` (A is
    /// `k×m`, lda = k), B `k×n` (ldb = k), C f32 with leading dimension `ldc` ≥ m (column j
    /// at `c + j·ldc` floats: a run of rows of a wider output). A and B are f16 for
    /// [`GemmType::F16`], f32 otherwise; with [`GemmType::Tf32`] the device may round them to
    /// TF32 (10-bit mantissas) for tensor cores. Accumulation is f32. `false` when the device
    /// has no GEMM (the caller falls back).
    fn gemm(
        &mut self,
        a: u64,
        b: u64,
        c: u64,
        mnk: (i32, i32, i32),
        ldc: i32,
        inputs: GemmType,
    ) -> Result<bool, GpuError>;
}

/// One matrix of a [`Device::matvec_q8`] launch: weights `w` (`rows` × the launch's
/// `cols`), output `y` (`ntok` rows of `rows` floats).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q8Out {
    /// The weights' address.
    pub w: u64,
    /// The output's address.
    pub y: u64,
    /// Rows of the matrix.
    pub rows: i32,
}

/// A RoPE of [`Device::rope`]: the tables `cos`, `sin` (`[pos][half]`), the rotated
/// dimensions' half, adjacent pairs or (`neox`) halves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeArgs {
    /// Cosines, `[pos][half]`.
    pub cos: u64,
    /// Sines, `[pos][half]`.
    pub sin: u64,
    /// Half the rotated dimensions of a head.
    pub half: i32,
    /// Rotate halves `(i, i + half)` instead of adjacent pairs.
    pub neox: bool,
}

impl Q8Out {
    /// `outs` (1 to [`MMQ8_MATRICES`]) as the kernel's three matrices, those not there of 0
    /// rows (no blocks); the message for any other count.
    pub fn three(outs: &[Q8Out]) -> Result<[Q8Out; MMQ8_MATRICES], String> {
        if outs.is_empty() || outs.len() > MMQ8_MATRICES {
            return Err(format!("an int8 launch of {} matrices", outs.len()));
        }
        let none = Q8Out {
            w: 0,
            y: 0,
            rows: 0,
        };
        Ok(std::array::from_fn(|i| {
            outs.get(i).copied().unwrap_or(none)
        }))
    }
}

/// A gated activation of the FFN ([`Device::glu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GluAct {
    /// `silu(gate) · up` (`swiglu`).
    Swiglu,
    /// `gelu_tanh(gate) · up` (`geglu`, Gemma).
    Geglu,
    /// gpt-oss's clamped SwiGLU (`swiglu_oai`).
    SwigluOai,
}

impl GluAct {
    /// The kernel (`swiglu`, ...), or with `q8` its quantizing form (`swiglu_q8`, ...).
    pub fn kernel(self, q8: bool) -> &'static str {
        match (self, q8) {
            (GluAct::Swiglu, false) => "swiglu",
            (GluAct::Swiglu, true) => "swiglu_q8",
            (GluAct::Geglu, false) => "geglu",
            (GluAct::Geglu, true) => "geglu_q8",
            (GluAct::SwigluOai, false) => "swiglu_oai",
            (GluAct::SwigluOai, true) => "swiglu_oai_q8",
        }
    }
}

/// Attention's head geometry: `n_heads` query heads of `head_dim`, grouped over
/// `n_kv_heads` key/value heads, scores scaled by `scale`.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    /// Query heads.
    pub n_heads: i32,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: i32,
    /// Dimensions per head.
    pub head_dim: i32,
    /// Score scale (usually `1/√head_dim`).
    pub scale: f32,
}

/// How the tokens of a pass find their rows of one block's paged KV cache (the kernels'
/// `kv_row`): token t is at position `pos[t]` of the sequence whose block table is row
/// `seq[t]` of `tables` (`max_blocks` i32 entries per sequence); position p is row
/// `p % block` of block `table[p / block]`, or with `ring > 0` of block
/// `table[(p / block) % ring]` (a sliding-window block's ring). Addresses are device
/// buffers of i32.
#[derive(Clone, Copy, Debug)]
pub struct KvPages {
    /// Position of each token.
    pub pos: u64,
    /// Each token's row of `tables`.
    pub seq: u64,
    /// Block tables, `max_blocks` per sequence of the pass.
    pub tables: u64,
    /// Entries per sequence in `tables`.
    pub max_blocks: i32,
    /// Positions per block.
    pub block: i32,
    /// Ring length in table entries (0: no ring).
    pub ring: i32,
    /// The caches hold f16 elements (`kv_store_f16` / `attention_f16`), not f32.
    pub f16: bool,
}

/// Activation and scratch buffers (f32), sized for `max_tokens` tokens and `ctx` positions:
/// `x`, `proj` `max_tokens × n_embd`; `xb` `max_tokens × max(n_embd, n_ff, q_dim)`; `q`,
/// `attn` `max_tokens × q_dim`; `k`, `v` `max_tokens × kv_dim`; `att`
/// `max_tokens × n_heads × ctx`; `gate`, `up` `max_tokens × n_ff`; `logits`
/// `logit_rows × vocab`; `tile`
/// `tile_elements` ([`Layout::tile_elements`](crate::plan::Layout::tile_elements)); `xq`
/// `max_tokens × max(n_embd, n_ff, q_dim) / 32` blocks
/// of [`Q8A_BYTES`](crate::kernels::Q8A_BYTES), `xh` as many f16 values
/// ([`Layout::act_bytes`](crate::plan::Layout::act_bytes) sizes the two). A mixture of experts widens `xb`, `gate`,
/// `up` and `xq` to its experts' width where larger, and has `router`
/// `max_tokens × n_expert`, `moe_rows` `2 × max_tokens × n_expert_used` words, `moe_x`, `moe_y`
/// `max_tokens × n_embd` (dense models: one float each).
#[derive(Clone, Copy, Debug)]
pub struct Scratch {
    /// Residual stream.
    pub x: u64,
    /// A sub-layer's normed input (and the final norm's output).
    pub xb: u64,
    /// A sub-layer's output projection.
    pub proj: u64,
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
    /// FFN gate (then the gated activation).
    pub gate: u64,
    /// FFN up.
    pub up: u64,
    /// Logits of the pass's last positions ([`Layout::logit_rows`] rows of `vocab`).
    pub logits: u64,
    /// Dequantized weight tile for GEMM prefill.
    pub tile: u64,
    /// Its size in f32 elements: at least one row of the widest weight
    /// ([`Layout::tile_elements`](crate::plan::Layout::tile_elements)).
    pub tile_elements: usize,
    /// A matrix product's input quantized to 8 bits, for the int8 kernels; 0 keeps every
    /// product in f32 (`--activations f32`).
    pub xq: u64,
    /// A mixture of experts' router logits.
    pub router: u64,
    /// The tokens one expert takes (i32 rows) and their weights (f32 bits).
    pub moe_rows: u64,
    /// Those tokens' inputs, gathered.
    pub moe_x: u64,
    /// The expert's outputs for them.
    pub moe_y: u64,
    /// Passes of this many tokens or more go through GEMM ([`GEMM_MIN_TOKENS`] by default).
    pub gemm_min: usize,
    /// What those GEMMs round their inputs to (`--gemm-type`).
    pub gemm: GemmType,
    /// Fuse launches where the graph's ops allow it (a norm or activation with the
    /// quantization of its output, RoPE with the KV store, the products of one input in
    /// one int8 launch); `false` launches every op alone (`GDS_CUDA_FUSE=0`, to measure).
    pub fuse: bool,
    /// An f16 GEMM's activations, converted once for all the products of the same input:
    /// `max_tokens × max(n_embd, n_ff, q_dim)` f16 (it may share `xq`'s buffer: a pass
    /// uses one or the other); 0 where [`Scratch::gemm`] is not f16.
    pub xh: u64,
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
    /// Per block: key and value caches, `geo[b].blocks × geo[b].block × kv_dim` elements
    /// each (f32, or f16 where `kv_f16`).
    pub kv: &'a [(u64, u64)],
    /// The caches' elements are f16 ([`KvSpec::f16`](crate::plan::KvSpec::f16)).
    pub kv_f16: bool,
    /// Per block: how its caches are paged ([`KvGeo`]).
    pub geo: &'a [KvGeo],
    /// The pass's tokens: position (i32 each), row of the block tables (i32 each).
    pub pos: u64,
    /// Each token's row of the block tables (i32 each).
    pub seq: u64,
    /// Per table of the model's [`KvGeo`]s: the pass's block tables (i32, `max_blocks[t]`
    /// per sequence).
    pub tables: &'a [u64],
    /// Entries per sequence of each table.
    pub max_blocks: &'a [usize],
    /// RoPE tables `ctx × rope_dims/2` (cos, sin): which one a block uses is the graph's
    /// (e.g. Gemma 3's window layers have their own base).
    pub ropes: &'a [(u64, u64)],
    /// KV cache positions.
    pub ctx: usize,
}

/// Bytes of an f32 activation.
pub const F32: u64 = 4;

/// What the executor runs on the device besides the shared embedding lookup and output
/// head: the model's graph (implemented by `gds_runtime`'s CUDA ops over the architecture's
/// graph file), called once per block and token batch, with the block's weights in VRAM.
pub trait BlockGraph: Send {
    /// Block `b` on the `ntok` tokens held in `pass.s.x`, at the positions of `pass.pos`.
    fn block(
        &self,
        pass: &Pass<'_>,
        dev: &mut dyn Device,
        b: usize,
        ntok: usize,
    ) -> Result<(), GpuError>;
    /// Factor applied to the token embeddings (Gemma: √n_embd).
    fn embed_scale(&self) -> Option<f32>;
    /// Output logit cap `c·tanh(l/c)` (Gemma 2).
    fn final_softcap(&self) -> Option<f32>;
}

impl Pass<'_> {
    /// The tensor `name` of the layout.
    pub fn tensor(&self, name: &str) -> Result<TensorMeta, GpuError> {
        self.layout
            .tensors
            .get(name)
            .copied()
            .ok_or_else(|| GpuError::Model(format!("missing tensor {name}")))
    }

    /// How the pass's tokens find their rows of block `b`'s KV cache.
    pub fn pages(&self, b: usize) -> Result<KvPages, GpuError> {
        let g = self
            .geo
            .get(b)
            .ok_or_else(|| GpuError::Model(format!("block {b} has no KV cache")))?;
        let (&tables, &max_blocks) = self
            .tables
            .get(g.table)
            .zip(self.max_blocks.get(g.table))
            .ok_or_else(|| GpuError::Model(format!("block {b}: no block table {}", g.table)))?;
        Ok(KvPages {
            pos: self.pos,
            seq: self.seq,
            tables,
            max_blocks: max_blocks as i32,
            block: g.block as i32,
            ring: g.ring as i32,
            f16: self.kv_f16,
        })
    }

    /// Where `t`'s bytes are now.
    pub fn addr(&self, t: &TensorMeta) -> Result<u64, GpuError> {
        match self.layer_base.get(t.layer) {
            Some(&b) if b != 0 => Ok(b + t.offset as u64),
            _ => Err(GpuError::Model(format!("layer {} is not in VRAM", t.layer))),
        }
    }

    /// `y = W · x` for `ntok` rows of x ([`Pass::linears`] with one output).
    pub fn linear(
        &self,
        dev: &mut dyn Device,
        t: &TensorMeta,
        x: u64,
        y: u64,
        ntok: usize,
    ) -> Result<(), GpuError> {
        self.linears(dev, x, &[(y, t)], ntok)
    }

    /// `y = W · x` for each `(y, W)` of `outs`, `ntok` rows of the same x: passes of
    /// [`Scratch::gemm_min`] or more through the device's int8 tensor-core products
    /// ([`Device::mmq`], where it offers them for the weight type and the scratch has `xq`),
    /// else through a dequantized tile and the device's GEMM; shorter
    /// ones through the int8 kernels where the weight type has one and the scratch has an
    /// `xq` buffer (x quantized once for all the outputs; neighbouring outputs of the same
    /// type in one launch), the dequantizing f32 matvec kernels otherwise.
    pub fn linears(
        &self,
        dev: &mut dyn Device,
        x: u64,
        outs: &[(u64, &TensorMeta)],
        ntok: usize,
    ) -> Result<(), GpuError> {
        self.linears_q8(dev, x, outs, ntok, false)
    }

    /// Whether a pass of `ntok` tokens multiplies an input of width `n` with int8 kernels
    /// (where the weights' type has them): the scratch has `xq`, the pass is shorter than
    /// the GEMMs' and `n` is whole activation blocks. Where it does, an op that writes
    /// that input may quantize it into `xq` in the same launch ([`Device::rmsnorm_q8`],
    /// [`Device::glu_q8`]) and hand it to [`Pass::linears_q8`].
    pub fn q8_input(&self, n: usize, ntok: usize) -> bool {
        self.s.xq != 0 && ntok < self.s.gemm_min && n.is_multiple_of(Q8A_VALUES)
    }

    /// [`Pass::linears`], where `q8_ready` says that `s.xq` already holds x quantized
    /// (by the launch that wrote x; see [`Pass::q8_input`]).
    pub fn linears_q8(
        &self,
        dev: &mut dyn Device,
        x: u64,
        outs: &[(u64, &TensorMeta)],
        ntok: usize,
        q8_ready: bool,
    ) -> Result<(), GpuError> {
        // x as quantized in s.xq, and as converted to f16 in s.xh, so far
        let mut quantized = q8_ready;
        let mut halved = false;
        // int8 products waiting to go out in one launch: suffix, columns, matrices
        let mut group: (&str, i32, Vec<Q8Out>) = ("", 0, Vec::new());
        let flush = |dev: &mut dyn Device, g: &mut (&str, i32, Vec<Q8Out>)| {
            if g.2.is_empty() {
                return Ok(());
            }
            let r = dev.matvec_q8(g.0, self.s.xq, &g.2, g.1, ntok as i32);
            g.2.clear();
            r
        };
        for &(y, t) in outs {
            let suffix = kernel_suffix(t.dtype)
                .ok_or_else(|| GpuError::Model(format!("no GPU kernel for {} weights", t.dtype)))?;
            let w = self.addr(t)?;
            let (rows, cols) = (t.rows as i32, t.cols as i32);
            if ntok >= self.s.gemm_min {
                flush(dev, &mut group)?;
                let mmq = q8_kernel_suffix(t.dtype).filter(|_| self.s.xq != 0 && dev.offers_mmq());
                if let Some(q8) = mmq {
                    if !quantized {
                        let nblocks = (ntok * t.cols / Q8A_VALUES) as i32;
                        dev.quantize_q8(x, self.s.xq, nblocks)?;
                        quantized = true;
                        // (the f16 activations may share the buffer)
                        halved &= self.s.xh != self.s.xq;
                    }
                    dev.mmq(q8, self.s.xq, Q8Out { w, y, rows }, cols, ntok as i32)?;
                    continue;
                }
                let b = match self.s.gemm {
                    GemmType::F16 => {
                        if self.s.xh == 0 {
                            return Err(GpuError::Model(
                                "an f16 GEMM without an f16 activation buffer".into(),
                            ));
                        }
                        if !halved {
                            dev.to_f16(x, self.s.xh, (ntok * t.cols) as i32)?;
                            halved = true;
                            quantized &= self.s.xh != self.s.xq;
                        }
                        self.s.xh
                    }
                    GemmType::F32 | GemmType::Tf32 => x,
                };
                if self.gemm(dev, suffix, t, w, b, y, ntok)? {
                    continue;
                }
            } else if let Some(q8) = q8_kernel_suffix(t.dtype).filter(|_| self.s.xq != 0) {
                if !quantized {
                    let nblocks = (ntok * t.cols / Q8A_VALUES) as i32;
                    dev.quantize_q8(x, self.s.xq, nblocks)?;
                    quantized = true;
                }
                let most = if self.s.fuse { MMQ8_MATRICES } else { 1 };
                if group.0 != q8 || group.1 != cols || group.2.len() == most {
                    flush(dev, &mut group)?;
                    group.0 = q8;
                    group.1 = cols;
                }
                group.2.push(Q8Out { w, y, rows });
                continue;
            }
            flush(dev, &mut group)?;
            dev.matvec(suffix, w, x, y, rows, cols, ntok as i32)?;
        }
        flush(dev, &mut group)
    }

    /// `y = W · x` through the dequantization tile and the device's GEMM, as many rows of W
    /// at a time as the tile holds (each run's outputs written in place in `y`'s rows);
    /// `false` when the device has no GEMM (nothing was written). `x` is f16 (`s.xh`) for an
    /// f16 GEMM, whose tile then holds twice the elements.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        dev: &mut dyn Device,
        suffix: &str,
        t: &TensorMeta,
        w: u64,
        x: u64,
        y: u64,
        ntok: usize,
    ) -> Result<bool, GpuError> {
        let (rows, cols) = (t.rows, t.cols);
        let row_bytes = (t.nbytes / rows.max(1)) as u64;
        let elements = self.s.tile_elements * 4 / self.s.gemm.elem_bytes();
        let mut per_run = (elements / cols.max(1)).clamp(1, rows.max(1));
        if per_run < rows && per_run >= 64 {
            // runs of whole 64-row tiles: every run's C starts 256-byte aligned
            per_run -= per_run % 64;
        }
        let mut r0 = 0;
        while r0 < rows {
            let n = per_run.min(rows - r0);
            let nblocks = (n * cols / t.dtype.block_size()) as i32;
            let src = w + r0 as u64 * row_bytes;
            match self.s.gemm {
                GemmType::F16 => dev.dequant16(suffix, src, self.s.tile, nblocks)?,
                GemmType::F32 | GemmType::Tf32 => dev.dequant(suffix, src, self.s.tile, nblocks)?,
            }
            let c = y + r0 as u64 * F32;
            let mnk = (n as i32, ntok as i32, cols as i32);
            if !dev.gemm(self.s.tile, x, c, mnk, rows as i32, self.s.gemm)? {
                return Ok(false);
            }
            r0 += n;
        }
        Ok(true)
    }

    /// Embedding rows of `tokens` into `s.x`, multiplied by `scale` where given.
    pub fn embed(
        &self,
        dev: &mut dyn Device,
        tokens: &[u32],
        scale: Option<f32>,
    ) -> Result<(), GpuError> {
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
        if let Some(a) = scale {
            dev.scale(self.s.x, a, (tokens.len() as u64 * n) as i32)?;
        }
        Ok(())
    }

    /// Final norm and output head for the `rows` tokens of the pass listed in `outputs`
    /// (a device buffer of i32 token indices; at most [`Layout::logit_rows`] of the pass),
    /// into `s.logits` (`rows × vocab`, in the order listed), capped by `softcap` where
    /// given. The rows are gathered into `s.proj` first.
    /// The final norm of every token of the pass into the `xb` scratch rows, `n_embd`
    /// floats each (the hidden states embeddings pool).
    pub fn final_norm(&self, dev: &mut dyn Device, ntok: usize) -> Result<(), GpuError> {
        let n = self.layout.shape.n_embd as i32;
        let norm = self.tensor("output_norm.weight")?;
        dev.rmsnorm(
            self.s.x,
            self.addr(&norm)?,
            self.s.xb,
            n,
            ntok as i32,
            self.layout.shape.eps,
        )
    }

    pub fn head(
        &self,
        dev: &mut dyn Device,
        ntok: usize,
        outputs: u64,
        rows: usize,
        softcap: Option<f32>,
    ) -> Result<(), GpuError> {
        if rows == 0 || rows > ntok {
            return Err(GpuError::Model(format!(
                "logits of {rows} positions of a pass of {ntok}"
            )));
        }
        let n = self.layout.shape.n_embd as i32;
        let norm = self.tensor("output_norm.weight")?;
        dev.gather_rows(self.s.proj, self.s.x, outputs, n, rows as i32)?;
        dev.rmsnorm(
            self.s.proj,
            self.addr(&norm)?,
            self.s.xb,
            n,
            rows as i32,
            self.layout.shape.eps,
        )?;
        self.linear(dev, &self.layout.output, self.s.xb, self.s.logits, rows)?;
        match softcap {
            Some(c) => dev.softcap(self.s.logits, c, (rows * self.layout.shape.vocab) as i32),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Q8Out;

    #[test]
    fn an_int8_launch_takes_one_to_three_matrices_padded_with_empty_ones() {
        let o = |r| Q8Out {
            w: 8,
            y: 16,
            rows: r,
        };
        let [a, b, c] = Q8Out::three(&[o(5), o(7)]).unwrap();
        assert_eq!((a.rows, b.rows, c.rows, c.w), (5, 7, 0, 0));
        assert!(Q8Out::three(&[]).unwrap_err().contains("0 matrices"));
        assert!(Q8Out::three(&[o(1); 4]).unwrap_err().contains("4 matrices"));
    }
}
