//! The graph on the CUDA backend: [`Ops`] over `gds_cuda::forward`'s kernels, so the GPU
//! executor runs the same architecture files (`graph/<arch>.rs`) as the CPU.
//!
//! [`CudaGraph`] is what the executor (`gds_cuda::stream::Streamer`) calls for each block
//! (`gds_cuda::forward::BlockGraph`): the block's weights are [`TensorMeta`]s of the
//! layout, resolved once at open through [`Block::load`] (so the tensor names and shapes
//! are the graph's, checked once, not looked up per token), and the buffers are the
//! executor's [`Scratch`](gds_cuda::forward::Scratch) addresses. What differs by layer —
//! RoPE table, window, scale, cap — is read from [`Config`] as the CPU backend reads it.
//!
//! Not behind the `cuda` feature: it only issues calls to a [`Device`], so the tests run it
//! on the kernels compiled as C++ (crates/gds-cuda/tests).

use crate::batch::Batch;
use crate::config::Config;
use crate::error::{Result, RuntimeError};
use crate::graph::{self, Arch, Block, Buf, Experts, Glu, Ops, WeightSource};
use crate::kv::{KvCache, Tables, NO_BLOCK};
use crate::model::rope_table_index;
use gds_cuda::forward::{BlockGraph, Device, GluAct, Heads, Pass, RopeArgs, F32};
use gds_cuda::plan::KvSpec;
use gds_cuda::plan::{Layout, TensorMeta};
use gds_cuda::stream::{PassInput, Streamer, Vram};
use gds_cuda::GpuError;
use gds_format::DType;
use std::path::Path;

/// A layer file that cannot be read and a model the GPU kernels cannot run are the model's
/// errors, as on the CPU; the rest are the backend's.
pub fn gpu_error(e: gds_cuda::GpuError) -> RuntimeError {
    use gds_cuda::GpuError as G;
    match e {
        G::Io { path, error } => RuntimeError::Io(gds_io::IoError::File {
            path: path.into(),
            error,
        }),
        G::Layer(e) => RuntimeError::Io(e),
        G::Model(m) => RuntimeError::Model(format!("CUDA backend: {m}")),
        e => RuntimeError::Backend(format!("CUDA backend: {e}")),
    }
}

/// RoPE tables as the GPU reads them: `(cos, sin)`, `[ctx][rope_dims / 2]` each.
pub type RopeTables = Vec<(Vec<f32>, Vec<f32>)>;

/// A model's graph over the CUDA kernels (see the module docs).
pub struct CudaGraph {
    arch: Arch,
    config: Config,
    blocks: Vec<Block<TensorMeta, TensorMeta>>,
    /// Index of each block's RoPE table in the pass's tables.
    rope_of: Vec<usize>,
}

/// Block weights found in the layout's tensor table.
struct LayoutSource<'a>(&'a Layout);

impl WeightSource<TensorMeta, TensorMeta> for LayoutSource<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<TensorMeta> {
        let t = *self
            .0
            .tensors
            .get(name)
            .ok_or_else(|| RuntimeError::Tensor {
                name: name.into(),
                why: "missing from the manifest".into(),
            })?;
        if (t.rows, t.cols) != (rows, cols) {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("shape [{}, {}], expected [{rows}, {cols}]", t.rows, t.cols),
            });
        }
        Ok(t)
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<Option<TensorMeta>> {
        let Some(&t) = self.0.tensors.get(name) else {
            return Ok(None);
        };
        if t.rows * t.cols != n {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("{} elements, expected {n}", t.rows * t.cols),
            });
        }
        if t.dtype != DType::F32 {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("{}: the CUDA kernels read norms and biases as F32", t.dtype),
            });
        }
        Ok(Some(t))
    }

    fn experts(&mut self, name: &str, n: usize, rows: usize, cols: usize) -> Result<TensorMeta> {
        let t = self.matrix(name, n * rows, cols)?;
        if t.nbytes % n != 0 {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("{} bytes do not split into {n} experts", t.nbytes),
            });
        }
        Ok(t)
    }

    fn expert_vectors(&mut self, name: &str, n: usize, len: usize) -> Result<Option<TensorMeta>> {
        self.vector(name, n * len)
    }
}

/// Expert `x` of `n` stacked in `t` (loaded by [`WeightSource::experts`], so its rows and
/// bytes split evenly): its rows as a matrix of their own.
fn expert(t: &TensorMeta, n: usize, x: usize) -> TensorMeta {
    let nbytes = t.nbytes / n;
    TensorMeta {
        offset: t.offset + x * nbytes,
        nbytes,
        rows: t.rows / n,
        ..*t
    }
}

impl CudaGraph {
    /// The graph of the model with hyperparameters `config` laid out as `layout`, whose
    /// pass has `n_tables` RoPE tables (as [`rope_tables`] makes them).
    pub fn new(config: &Config, layout: &Layout, n_tables: usize) -> Result<CudaGraph> {
        let arch = Arch::of(config)?;
        let mut src = LayoutSource(layout);
        let blocks = (0..config.n_layers)
            .map(|l| Block::load(config, l, &mut src))
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaGraph {
            arch,
            config: config.clone(),
            blocks,
            rope_of: (0..config.n_layers)
                .map(|l| rope_table_index(config, l, n_tables))
                .collect(),
        })
    }

    /// The architecture whose graph runs.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Each block's weights, as the graph sees them (tests drive a reference with them).
    pub fn blocks(&self) -> &[Block<TensorMeta, TensorMeta>] {
        &self.blocks
    }

    /// The graph and RoPE tables of the model in `dir` for `ctx` positions, the manifest
    /// read and checked as at every open (for callers that hold no manifest, e.g. tests).
    pub fn open(dir: &Path, ctx: usize) -> Result<(CudaGraph, RopeTables)> {
        let bytes = gds_io::read_manifest(dir)?;
        let m = crate::model_dir::parse_manifest(dir, &bytes)?;
        let config = Config::from_manifest(&m).map_err(|e| crate::model_dir::with_dir(e, dir))?;
        let layout = Layout::from_manifest(dir, &m)
            .map_err(|e| RuntimeError::Model(format!("CUDA backend: {e}")))?;
        let tables = rope_tables(dir, &m, &config, ctx)?;
        Ok((CudaGraph::new(&config, &layout, tables.len())?, tables))
    }
}

/// The model's RoPE tables for `ctx` positions, exactly as the CPU backend builds them
/// (scaling, `rope_freqs` divisors, LongRoPE factors, the window layers' own base).
pub fn rope_tables(
    dir: &Path,
    m: &gds_format::Manifest<'_>,
    config: &Config,
    ctx: usize,
) -> Result<RopeTables> {
    // The factor tensors are small f32 vectors: mapped, read once.
    let source =
        gds_io::MmapBackend::open_with(dir, m, &gds_io::Verifier::new(gds_io::VerifyMode::Off))?;
    let weights = crate::weights::Weights::load(config, m, &source)
        .map_err(|e| crate::model_dir::with_dir(e, dir))?;
    Ok(crate::model::rope_tables(config, &weights, ctx)
        .into_iter()
        .map(|t| t.into_tables())
        .collect())
}

impl BlockGraph for CudaGraph {
    fn block(
        &self,
        pass: &Pass<'_>,
        dev: &mut dyn Device,
        b: usize,
        ntok: usize,
    ) -> std::result::Result<(), GpuError> {
        let w = self
            .blocks
            .get(b)
            .ok_or_else(|| GpuError::Model(format!("block {b} out of range")))?;
        let mut o = CudaOps {
            g: self,
            pass,
            dev,
            ntok,
            failed: None,
            xq_of: None,
            rope: None,
        };
        graph::block(self.arch, &mut o, b, w)
            .and_then(|()| o.settle())
            .map_err(|e| {
                o.failed
                    .take()
                    .unwrap_or_else(|| GpuError::Model(e.to_string()))
            })
    }

    fn embed_scale(&self) -> Option<f32> {
        self.arch.embed_scale(&self.config)
    }

    fn final_softcap(&self) -> Option<f32> {
        self.config.final_softcap
    }
}

/// The device's kernel of the graph's gated activation.
fn glu_act(act: Glu) -> GluAct {
    match act {
        Glu::Silu => GluAct::Swiglu,
        Glu::GeluTanh => GluAct::Geglu,
        Glu::SwigluOai => GluAct::SwigluOai,
    }
}

/// [`Ops`] for one block of one batch on a [`Device`].
///
/// Where the pass allows it ([`Scratch::fuse`](gds_cuda::forward::Scratch::fuse)), some ops
/// are fused with the next one into one launch: a norm into `Xb` (and the gated activation)
/// also quantizes its output for the int8 products that read it next
/// ([`Pass::q8_input`]), and the RoPE waits for the attention that follows it to be one
/// launch with the KV store ([`Device::rope_kv`]). The graph sees the ops it called, in
/// its order: a fused op only ever spares the next op's own work.
struct CudaOps<'a, 'p> {
    g: &'a CudaGraph,
    pass: &'a Pass<'p>,
    dev: &'a mut dyn Device,
    ntok: usize,
    /// The device error that stopped the block (returned as is, not as text).
    failed: Option<GpuError>,
    /// The buffer whose rows `xq` holds quantized (by the launch that wrote them): for the
    /// next op only.
    xq_of: Option<Buf>,
    /// A RoPE of this block not launched yet (the attention after it launches it with the
    /// KV store; any other op first launches it alone).
    rope: Option<usize>,
}

impl CudaOps<'_, '_> {
    /// Address and per-token width of `b`.
    fn buf(&self, b: Buf) -> (u64, usize) {
        let (c, s) = (&self.g.config, &self.pass.s);
        match b {
            Buf::X => (s.x, c.n_embd),
            Buf::Xb => (s.xb, c.n_embd),
            Buf::Proj => (s.proj, c.n_embd),
            Buf::Q => (s.q, c.q_dim()),
            Buf::Att => (s.attn, c.q_dim()),
            Buf::K => (s.k, c.kv_dim()),
            Buf::V => (s.v, c.kv_dim()),
            Buf::Gate => (s.gate, c.n_ff),
            Buf::Up => (s.up, c.n_ff),
        }
    }

    /// A device call's result as the graph's: the error kept for [`BlockGraph::block`].
    fn run(&mut self, r: std::result::Result<(), GpuError>) -> Result<()> {
        r.map_err(|e| {
            let msg = e.to_string();
            self.failed = Some(e);
            RuntimeError::Backend(msg)
        })
    }

    /// `Gate = act(Gate) · Up` over the first `n` floats.
    fn glu_rows(&mut self, act: Glu, n: usize) -> Result<()> {
        let (g, u) = (self.pass.s.gate, self.pass.s.up);
        let r = self.dev.glu(glu_act(act), g, u, n as i32);
        self.run(r)
    }

    /// Launches the RoPE held back for the next op, where that op is not the attention
    /// it would have fused with; and forgets what `xq` holds (what the op may change).
    fn settle(&mut self) -> Result<()> {
        self.xq_of = None;
        match self.rope.take() {
            Some(layer) => self.rope_now(layer),
            None => Ok(()),
        }
    }

    /// Block `layer`'s RoPE table, rotated dimensions' half and pairing.
    fn rope_args(&self, layer: usize) -> Result<RopeArgs> {
        let c = &self.g.config;
        let (cos, sin) = *self
            .pass
            .ropes
            .get(self.g.rope_of[layer])
            .ok_or_else(|| RuntimeError::Internal("RoPE table missing".into()))?;
        Ok(RopeArgs {
            cos,
            sin,
            half: (c.rope_dims / 2) as i32,
            neox: c.rope_style == crate::config::RopeStyle::Neox,
        })
    }

    /// RoPE of `Q` and `K`, one launch each.
    fn rope_now(&mut self, layer: usize) -> Result<()> {
        let c = &self.g.config;
        let (hd, heads) = (c.head_dim as i32, [c.n_heads, c.n_kv_heads]);
        let a = self.rope_args(layer)?;
        let (pos, nt) = (self.pass.pos, self.ntok as i32);
        for (buf, heads) in [Buf::Q, Buf::K].into_iter().zip(heads) {
            let (x, _) = self.buf(buf);
            let r = self
                .dev
                .rope(x, a.cos, a.sin, heads as i32, hd, a.half, a.neox, pos, nt);
            self.run(r)?;
        }
        Ok(())
    }

    /// Where `t` is in VRAM now (an error naming the layer when it is not).
    fn addr(&mut self, t: &TensorMeta) -> Result<u64> {
        match self.pass.addr(t) {
            Ok(a) => Ok(a),
            Err(e) => self.run(Err(e)).map(|()| 0),
        }
    }
}

impl Ops for CudaOps<'_, '_> {
    type Mat = TensorMeta;
    type Vec = TensorMeta;

    fn rms_norm(&mut self, out: Buf, x: Buf, w: &TensorMeta) -> Result<()> {
        self.settle()?;
        let ((xa, n), (oa, _)) = (self.buf(x), self.buf(out));
        let wa = self.addr(w)?;
        let (eps, nt, s) = (self.g.config.rms_norm_eps, self.ntok, self.pass.s);
        // Xb is what the projections read: quantized for them in the same launch
        let r = if s.fuse && out == Buf::Xb && self.pass.q8_input(n, nt) {
            self.xq_of = Some(out);
            self.dev
                .rmsnorm_q8(xa, wa, oa, s.xq, n as i32, nt as i32, eps)
        } else {
            self.dev.rmsnorm(xa, wa, oa, n as i32, nt as i32, eps)
        };
        self.run(r)
    }

    fn head_norm(&mut self, buf: Buf, w: &TensorMeta) -> Result<()> {
        self.settle()?;
        let (a, width) = self.buf(buf);
        let hd = self.g.config.head_dim;
        let wa = self.addr(w)?;
        let rows = (self.ntok * width / hd) as i32;
        let eps = self.g.config.rms_norm_eps;
        let r = self.dev.rmsnorm(a, wa, a, hd as i32, rows, eps);
        self.run(r)
    }

    fn matmul(&mut self, x: Buf, outs: &[(Buf, &TensorMeta)]) -> Result<()> {
        let ready = self.xq_of == Some(x);
        self.settle()?;
        let (xa, _) = self.buf(x);
        // one call for all the outputs: x is quantized once for them (int8 kernels)
        let outs: Vec<(u64, &TensorMeta)> = outs.iter().map(|&(b, w)| (self.buf(b).0, w)).collect();
        let r = self.pass.linears_q8(self.dev, xa, &outs, self.ntok, ready);
        self.run(r)
    }

    fn add_bias(&mut self, buf: Buf, b: &TensorMeta) -> Result<()> {
        self.settle()?;
        let (a, n) = self.buf(buf);
        let ba = self.addr(b)?;
        let r = self.dev.add_rows(a, ba, n as i32, self.ntok as i32);
        self.run(r)
    }

    fn rope(&mut self, layer: usize) -> Result<()> {
        self.settle()?;
        if self.pass.s.fuse {
            // launched by the attention after it, with the KV store
            self.rope = Some(layer);
            return Ok(());
        }
        self.rope_now(layer)
    }

    fn attention(&mut self, layer: usize, sinks: Option<&TensorMeta>) -> Result<()> {
        self.xq_of = None;
        let sinks = match sinks {
            Some(t) => self.addr(t)?,
            None => 0,
        };
        let g = self.g;
        let c = &g.config;
        let s = self.pass.s;
        let (kc, vc) = self.pass.kv[layer];
        let pages = match self.pass.pages(layer) {
            Ok(p) => p,
            Err(e) => return self.run(Err(e)),
        };
        let window = c.window(layer).map_or(0, |w| w as i32);
        let heads = Heads {
            n_heads: c.n_heads as i32,
            n_kv_heads: c.n_kv_heads as i32,
            head_dim: c.head_dim as i32,
            scale: c.attn_scale,
        };
        let cap = c.attn_softcap.unwrap_or(0.0);
        let (nt, ctx) = (self.ntok as i32, self.pass.ctx as i32);
        // the new keys and values go to their tokens' rows first: the queries see them
        let rope = self.rope.take_if(|&mut l| l == layer);
        let r = match rope {
            Some(l) => {
                let a = self.rope_args(l)?;
                self.dev
                    .rope_kv((s.q, s.k, s.v), (kc, vc), a, heads, nt, &pages)
            }
            None => {
                self.settle()?;
                self.dev
                    .kv_store(s.k, s.v, kc, vc, c.kv_dim() as i32, nt, &pages)
            }
        };
        self.run(r)?;
        let r = self.dev.attention(
            s.q, kc, vc, s.att, s.attn, heads, nt, ctx, &pages, window, cap, sinks,
        );
        self.run(r)
    }

    fn glu(&mut self, act: Glu) -> Result<()> {
        self.settle()?;
        let (nt, ff, s) = (self.ntok, self.g.config.n_ff, self.pass.s);
        if !(s.fuse && self.pass.q8_input(ff, nt)) {
            return self.glu_rows(act, nt * ff);
        }
        // the down projection's int8 input in the same launch
        self.xq_of = Some(Buf::Gate);
        let r = self
            .dev
            .glu_q8(glu_act(act), s.gate, s.up, s.xq, (nt * ff) as i32);
        self.run(r)
    }

    fn add(&mut self, y: Buf, x: Buf) -> Result<()> {
        self.settle()?;
        let ((ya, n), (xa, _)) = (self.buf(y), self.buf(x));
        let r = self.dev.add(ya, xa, (self.ntok * n) as i32);
        self.run(r)
    }

    /// The router's logits come to the host, which picks each token's experts
    /// ([`graph::route`], as on the CPU) and sends back, in one copy, each chosen expert's
    /// tokens and weights; each expert then runs on its tokens' rows of `Xb` (gathered
    /// unless it has them all), its output added to `Proj` by weight.
    fn moe(&mut self, e: &Experts<TensorMeta, TensorMeta>, act: Glu) -> Result<()> {
        self.settle()?;
        let (nt, d, ff, n) = (self.ntok, self.g.config.n_embd, e.n_ff, e.n);
        let s = self.pass.s;
        let r = self
            .pass
            .linears(self.dev, s.xb, &[(s.router, &e.router)], nt);
        self.run(r)?;
        if let Some(b) = &e.router_bias {
            let ba = self.addr(b)?;
            let r = self.dev.add_rows(s.router, ba, n as i32, nt as i32);
            self.run(r)?;
        }
        let mut logits = vec![0f32; nt * n];
        let r = self.dev.download(s.router, &mut logits);
        self.run(r)?;
        let by_expert = graph::route(&mut logits, n, e.used, e.gating);
        // per chosen expert: its tokens (i32 rows), then their weights (f32 bits)
        let mut words: Vec<u32> = Vec::with_capacity(2 * nt * e.used);
        let mut chosen = Vec::new();
        for (x, tokens) in by_expert.iter().enumerate().filter(|(_, t)| !t.is_empty()) {
            chosen.push((x, words.len(), tokens.len()));
            words.extend(tokens.iter().map(|&(t, _)| t as u32));
            words.extend(tokens.iter().map(|&(_, w)| w.to_bits()));
        }
        let r = self.dev.upload_words(s.moe_rows, &words);
        self.run(r)?;
        let r = self.dev.zero(s.proj, nt * d * F32 as usize);
        self.run(r)?;
        let biases = match &e.biases {
            Some([g, u, dn]) => Some([self.addr(g)?, self.addr(u)?, self.addr(dn)?]),
            None => None,
        };
        for (x, at, k) in chosen {
            let rows = s.moe_rows + at as u64 * F32;
            // the tokens are listed in order: all of them are Xb as it is
            let input = if k == nt {
                s.xb
            } else {
                let r = self
                    .dev
                    .gather_rows(s.moe_x, s.xb, rows, d as i32, k as i32);
                self.run(r)?;
                s.moe_x
            };
            let (gate, up) = (expert(&e.gate, n, x), expert(&e.up, n, x));
            let r = self
                .pass
                .linears(self.dev, input, &[(s.gate, &gate), (s.up, &up)], k);
            self.run(r)?;
            if let Some([bg, bu, _]) = biases {
                let off = (x * ff) as u64 * F32;
                let r = self.dev.add_rows(s.gate, bg + off, ff as i32, k as i32);
                self.run(r)?;
                let r = self.dev.add_rows(s.up, bu + off, ff as i32, k as i32);
                self.run(r)?;
            }
            self.glu_rows(act, k * ff)?;
            let down = expert(&e.down, n, x);
            let r = self.pass.linears(self.dev, s.gate, &[(s.moe_y, &down)], k);
            self.run(r)?;
            if let Some([_, _, bd]) = biases {
                let r = self
                    .dev
                    .add_rows(s.moe_y, bd + (x * d) as u64 * F32, d as i32, k as i32);
                self.run(r)?;
            }
            let r = self
                .dev
                .scatter_add_rows(s.proj, s.moe_y, rows, d as i32, k as i32);
            self.run(r)?;
        }
        Ok(())
    }
}

/// How the scheduler's batches over a [`KvCache`] become the GPU executor's passes: the
/// VRAM layout of the cache's rows ([`KvSpec`], one table per kind of block table the
/// layers read), and per pass the tokens' positions, their sequences' rows of the pass's
/// block tables (each sequence's tables copied from the cache, padded with [`NO_BLOCK`]),
/// and the output rows.
pub struct PassStaging {
    spec: KvSpec,
    kinds: Vec<Tables>,
    tokens: Vec<u32>,
    pos: Vec<u32>,
    seq: Vec<u32>,
    outputs: Vec<u32>,
    tables: Vec<Vec<u32>>,
    slots: Vec<usize>,
    /// The final-normed hidden state of every token of a pass that asks for some.
    all_hidden: Vec<f32>,
}

/// Why a staged pass failed: the batch (the runtime's error) or the device.
#[derive(Debug)]
pub enum StageError {
    /// The batch does not fit the cache or the buffers.
    Batch(RuntimeError),
    /// The device failed.
    Gpu(GpuError),
}

impl PassStaging {
    /// The staging of passes over `kv`'s rows (laid out in VRAM as [`PassStaging::spec`]
    /// says), for up to `kv.n_seqs()` sequences a pass.
    pub fn new(kv: &KvCache) -> Result<PassStaging> {
        let (spec, kinds) = crate::gpuplan::kv_spec(kv)?;
        Ok(PassStaging {
            spec,
            tables: vec![Vec::new(); kinds.len()],
            kinds,
            tokens: Vec::new(),
            pos: Vec::new(),
            seq: Vec::new(),
            outputs: Vec::new(),
            slots: Vec::new(),
            all_hidden: Vec::new(),
        })
    }

    /// The VRAM layout of the cache's rows.
    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    /// Runs `batch` (token, position, sequence slot of `kv`, output) on `model` and writes
    /// the output tokens' logits, in batch order, to the first rows of `logits`; returns
    /// how many.
    pub fn run<V: Vram>(
        &mut self,
        model: &mut Streamer<V>,
        kv: &KvCache,
        batch: &Batch,
        logits: &mut [f32],
    ) -> std::result::Result<usize, StageError> {
        self.run_with_hidden(model, kv, batch, logits, &mut Vec::new())
    }

    /// [`PassStaging::run`], and the final-normed hidden states of the batch's tokens that
    /// ask for them ([`Batch::push_hidden`]) in `hidden`, in batch order, `n_embd` floats
    /// each (emptied when none do).
    pub fn run_with_hidden<V: Vram>(
        &mut self,
        model: &mut Streamer<V>,
        kv: &KvCache,
        batch: &Batch,
        logits: &mut [f32],
        hidden: &mut Vec<f32>,
    ) -> std::result::Result<usize, StageError> {
        let bad =
            |m: String| StageError::Batch(RuntimeError::Internal(format!("invalid batch: {m}")));
        let vocab = model.layout().shape.vocab;
        self.tokens.clear();
        self.pos.clear();
        self.seq.clear();
        self.outputs.clear();
        self.slots.clear();
        for k in 0..batch.len() {
            let (t, p, s, out) = batch
                .get(k)
                .ok_or_else(|| bad("shorter than its length".into()))?;
            kv.check_slot(s, p).map_err(bad)?;
            let row = match self.slots.iter().position(|&x| x == s) {
                Some(r) => r,
                None => {
                    self.slots.push(s);
                    self.slots.len() - 1
                }
            };
            self.tokens.push(t);
            self.pos.push(p as u32);
            self.seq.push(row as u32);
            if out {
                self.outputs.push(k as u32);
            }
        }
        for ((table, &kind), &m) in self
            .tables
            .iter_mut()
            .zip(&self.kinds)
            .zip(&self.spec.max_blocks)
        {
            table.clear();
            for &s in &self.slots {
                let t = kv.tables_of(kind, s);
                let n = t.len().min(m);
                table.extend_from_slice(&t[..n]);
                table.resize(table.len() + m - n, NO_BLOCK);
            }
        }
        let n = self.outputs.len();
        if n * vocab > logits.len() {
            return Err(bad(format!(
                "{n} outputs, at most {}",
                logits.len() / vocab
            )));
        }
        let tables: Vec<&[u32]> = self.tables.iter().map(Vec::as_slice).collect();
        let input = PassInput {
            tokens: &self.tokens,
            pos: &self.pos,
            seq: &self.seq,
            outputs: &self.outputs,
            tables: &tables,
        };
        hidden.clear();
        // every token's hidden state when some are asked for (none: no final norm)
        let d = model.layout().shape.n_embd;
        let rows = if batch.n_hidden() > 0 { batch.len() } else { 0 };
        self.all_hidden.resize(rows * d, 0.0);
        model
            .forward_batch_hidden(&mut logits[..n * vocab], &mut self.all_hidden, &input)
            .map_err(StageError::Gpu)?;
        for k in (0..batch.len()).filter(|&k| batch.wants_hidden(k)) {
            hidden.extend_from_slice(&self.all_hidden[k * d..(k + 1) * d]);
        }
        Ok(n)
    }
}

/// One sequence on the GPU executor over any device ([`Vram`]): the cache of
/// [`one_sequence_kv`](crate::gpuplan::one_sequence_kv) of `kv_type` elements for `ctx`
/// positions and passes of up to `batch`, whose VRAM layout `open(spec, batch, outputs)` opens the executor with, and up
/// to `outputs` logit rows a pass (at most [`Layout::logit_rows`]). What `gdsrun run`,
/// `bench` and `perplexity --backend cuda` run (`crate::exec::gpu::open_one`, with `CudaVram`).
pub fn one_sequence<V: Vram + Send + 'static>(
    config: &Config,
    kv_type: crate::kv::KvDtype,
    ctx: usize,
    batch: usize,
    outputs: usize,
    open: impl FnOnce(&KvSpec, usize, usize) -> Result<Streamer<V>>,
) -> Result<crate::exec::OneSequence> {
    let batch = Layout::batch(ctx, batch);
    let outputs = outputs.clamp(1, Layout::logit_rows(batch));
    let windows: Vec<Option<usize>> = (0..config.n_layers).map(|l| config.window(l)).collect();
    let kv = crate::gpuplan::one_sequence_kv(kv_type, ctx, config.kv_dim(), &windows, batch);
    let staging = PassStaging::new(&kv)?;
    let model = open(staging.spec(), batch, outputs)?;
    let exec = StreamerBatch::new(model, config.clone(), staging, outputs);
    Ok(crate::exec::OneSequence::new(
        Box::new(exec),
        kv,
        batch,
        outputs,
    ))
}

/// The GPU's [`BatchExecutor`](crate::exec::BatchExecutor) over any device ([`Vram`]: CUDA in
/// `gdsrun`, the emulated kernels in the tests): the executor whose KV rows are laid out as
/// the scheduler's [`KvCache`] pages them ([`PassStaging`]), and the logit rows (and hidden
/// states asked for) of the last pass.
pub struct StreamerBatch<V: Vram> {
    model: Streamer<V>,
    config: Config,
    staging: PassStaging,
    rows: Vec<f32>,
    hidden: Vec<f32>,
}

impl<V: Vram> StreamerBatch<V> {
    /// Wraps `model`, opened with [`PassStaging::spec`] of `staging` as its KV cache and
    /// `outputs` logit rows a pass, for the model with hyperparameters `config`.
    pub fn new(
        model: Streamer<V>,
        config: Config,
        staging: PassStaging,
        outputs: usize,
    ) -> StreamerBatch<V> {
        StreamerBatch {
            rows: vec![0.0; outputs.max(1) * config.vocab_size],
            hidden: Vec::new(),
            model,
            config,
            staging,
        }
    }

    /// The executor.
    pub fn model(&self) -> &Streamer<V> {
        &self.model
    }
}

impl<V: Vram + Send> crate::exec::BatchExecutor for StreamerBatch<V> {
    fn backend(&self) -> crate::backend::Backend {
        crate::backend::Backend::Cuda
    }
    fn config(&self) -> &Config {
        &self.config
    }
    fn forward(&mut self, kv: &mut KvCache, batch: &Batch) -> Result<usize> {
        self.staging
            .run_with_hidden(&mut self.model, kv, batch, &mut self.rows, &mut self.hidden)
            .map_err(|e| match e {
                StageError::Batch(e) => e,
                StageError::Gpu(e) => gpu_error(e),
            })
    }
    fn logits(&self, i: usize) -> &[f32] {
        let vocab = self.config.vocab_size;
        &self.rows[i * vocab..(i + 1) * vocab]
    }
    fn logits_mut(&mut self, i: usize) -> &mut [f32] {
        let vocab = self.config.vocab_size;
        &mut self.rows[i * vocab..(i + 1) * vocab]
    }
    fn io_stats(&self) -> gds_io::IoStats {
        self.model.io_stats()
    }
    fn gives_hidden(&self) -> bool {
        true
    }
    fn hidden(&self, i: usize) -> &[f32] {
        let d = self.config.n_embd;
        &self.hidden[i * d..(i + 1) * d]
    }
}
