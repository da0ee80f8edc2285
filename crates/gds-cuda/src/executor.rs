//! The GPU executor: layer files into VRAM (cuFile, or pinned bounce buffers), weights used
//! in place in their on-disk block formats, and the llama forward pass on two streams.
//!
//! **Never run on a GPU yet** (the development machine has none): it compiles under
//! `--features cuda` and its kernels are tested on the CPU (tests/emu.rs) and through NVRTC
//! (tests/nvrtc.rs), but nothing here has executed on real hardware. See the README.
//!
//! Memory plan, decided once in [`GpuModel::open`]:
//! - the embedding and head layers are always resident (every token needs them);
//! - blocks are resident in execution order while the VRAM budget lasts, after the KV cache,
//!   the scratch buffers and — if any block is left over — two streaming slots, each the size
//!   of the largest block;
//! - a streamed block is read into a slot right after the kernels of the block before it
//!   are enqueued, so the read overlaps that block's compute on the GPU (cuFile:
//!   `cuFileRead` straight into the slot, which lives on the copy stream; bounce: `pread`
//!   into pinned host memory, then an asynchronous copy on the copy stream). Events order
//!   the two streams: the compute stream waits for `loaded[slot]`, and a slot is refilled
//!   only after `computed[slot]` (its previous block) has completed. The reads are issued
//!   from the calling thread; there is no separate I/O thread.
//!
//! Decode (one token) uses the dequantizing matvec kernels; prefill of more than
//! [`GEMM_MIN_TOKENS`] tokens dequantizes each weight into an f32 tile and calls cuBLAS SGEMM.
//! The executor returns logits; sampling stays with the caller (the CPU backend's sampler).

use crate::kernels::{self, kernel_suffix, BLOCK_THREADS, MATVEC_ROWS};
use crate::plan::{Layout, Shape, TensorMeta, VramPlan, MAX_BATCH};
use crate::{nvrtc, probe, GpuError, GpuPath};
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::cufile::{Cufile, FileHandle};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Prefill batches at least this long go through cuBLAS; shorter ones use the matvecs.
pub const GEMM_MIN_TOKENS: usize = 8;

/// How layer bytes reach VRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadPath {
    /// `--io gds`: cuFile reads into device memory, no host copy.
    Gds,
    /// `--io direct|mmap` with `--backend cuda`: read into pinned host memory (with O_DIRECT
    /// when `direct`), then copy host→device asynchronously.
    Bounce {
        /// Open the files with O_DIRECT.
        direct: bool,
    },
}

/// What the caller decides (from the plan).
#[derive(Clone, Debug)]
pub struct ExecOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// I/O path into VRAM.
    pub load: LoadPath,
    /// VRAM the executor may use, in bytes (weights, KV cache, scratch, slots).
    pub vram_budget: u64,
    /// Context length (KV cache positions).
    pub ctx: usize,
    /// RoPE tables `[ctx][head_dim / 2]` (cos, sin) from the runtime's `RopeTable`; `None`
    /// computes plain `theta^(-2i/d)` tables (no scaling).
    pub rope: Option<(Vec<f32>, Vec<f32>)>,
}

/// Bytes and time spent moving layers into VRAM.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadStats {
    /// Bytes read from layer files into VRAM.
    pub bytes: u64,
    /// Wall time of those reads (host side, including waits for a free slot), in seconds.
    pub seconds: f64,
}

struct Layer {
    path: PathBuf,
    size: usize,
    resident: Option<CudaSlice<u8>>,
}

/// The compiled kernels and the streams they run on.
struct Gpu {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
}

/// Activations and scratch, sized for `max_tokens` tokens at once.
struct Scratch {
    max_tokens: usize,
    x: CudaSlice<f32>,
    xb: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    att: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// f32 tile of one dequantized weight, for cuBLAS prefill.
    tile: CudaSlice<f32>,
}

enum Loader {
    Gds {
        driver: Arc<Cufile>,
        files: Vec<FileHandle>,
    },
    Bounce {
        direct: bool,
        pinned: PinnedHostSlice<u8>,
    },
}

/// A model loaded for the GPU: resident layers, streaming slots, KV cache, kernels.
pub struct GpuModel {
    gpu: Gpu,
    shape: Shape,
    layers: Vec<Layer>,
    tensors: HashMap<String, TensorMeta>,
    /// Layer index of the embedding, the blocks in order, and the head.
    embed: usize,
    blocks: Vec<usize>,
    head: usize,
    output: TensorMeta,
    slots: Vec<CudaSlice<u8>>,
    loaded: Vec<Option<CudaEvent>>,
    computed: Vec<Option<CudaEvent>>,
    loader: Loader,
    kv_k: Vec<CudaSlice<f32>>,
    kv_v: Vec<CudaSlice<f32>>,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    s: Scratch,
    ctx_len: usize,
    /// Bytes and time of every layer read so far (initial loads included).
    pub stats: LoadStats,
    /// Where every layer lives (resident bytes, bytes streamed per token).
    pub plan: VramPlan,
}

fn cuda<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> GpuError + '_ {
    move |e| GpuError::Cuda(format!("{what}: {e:?}"))
}

fn model_err(msg: impl Into<String>) -> GpuError {
    GpuError::Model(msg.into())
}

fn cdiv(a: usize, b: u32) -> u32 {
    a.div_ceil(b as usize) as u32
}

impl Gpu {
    fn open(device: usize, load: LoadPath) -> Result<Gpu, GpuError> {
        // Probe first: cudarc panics when it calls into a library that is not there.
        let report = probe();
        if let Some(why) = report.unusable_reason() {
            return Err(GpuError::Unavailable(why.to_string()));
        }
        if load == LoadPath::Gds && report.path != GpuPath::Gds {
            return Err(GpuError::Unavailable(format!(
                "--io gds needs GPUDirect Storage: {}",
                report.reason
            )));
        }
        let ctx = CudaContext::new(device).map_err(cuda("creating the CUDA context"))?;
        let (maj, min) = ctx
            .compute_capability()
            .map_err(cuda("reading the compute capability"))?;
        let ptx = nvrtc::compile_library(&format!("compute_{maj}{min}"))?;
        let module = ctx
            .load_module(ptx)
            .map_err(cuda("loading the PTX module"))?;
        let mut funcs = HashMap::new();
        for name in kernels::KERNEL_NAMES {
            let f = module.load_function(name).map_err(cuda(name))?;
            funcs.insert(*name, f);
        }
        let compute = ctx
            .new_stream()
            .map_err(cuda("creating the compute stream"))?;
        let copy = ctx.new_stream().map_err(cuda("creating the copy stream"))?;
        let blas = CudaBlas::new(compute.clone()).map_err(cuda("creating the cuBLAS handle"))?;
        Ok(Gpu {
            ctx,
            compute,
            copy,
            funcs,
            blas,
        })
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn cfg(grid: (u32, u32), block: (u32, u32)) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid.0.max(1), grid.1.max(1), 1),
            block_dim: (block.0, block.1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `y[t, :] = W · x[t, :]` for `ntok` tokens, with W in its block format.
    fn linear(
        &self,
        w: &CudaView<u8>,
        t: &TensorMeta,
        x: &CudaView<f32>,
        y: &mut CudaViewMut<f32>,
        ntok: usize,
        tile: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let suffix = kernel_suffix(t.dtype)
            .ok_or_else(|| model_err(format!("no GPU kernel for {} weights", t.dtype)))?;
        let (rows, cols, n) = (t.rows as i32, t.cols as i32, ntok as i32);
        if ntok < GEMM_MIN_TOKENS {
            let f = self.f(&format!("matvec_{suffix}"));
            let cfg = Self::cfg((cdiv(t.rows, MATVEC_ROWS), 1), (32, MATVEC_ROWS));
            // SAFETY: the argument list matches `matvec_*(const u8*, const float*, float*,
            // int, int, int)`; w holds rows × cols elements (checked at open), x and y hold
            // ntok × cols and ntok × rows floats (scratch sized for max_tokens ≥ ntok).
            unsafe {
                self.compute
                    .launch_builder(f)
                    .arg(w)
                    .arg(x)
                    .arg(y)
                    .arg(&rows)
                    .arg(&cols)
                    .arg(&n)
                    .launch(cfg)
            }
            .map_err(cuda("matvec launch"))?;
            return Ok(());
        }
        // Prefill: dequantize W into an f32 tile, then y^T = W · x^T with cuBLAS (column-major:
        // C[rows × ntok] = op(A)ᵀ with A = tile as cols × rows, B = x as cols × ntok).
        let nblocks = (t.rows * t.cols / t.dtype.block_size()) as i32;
        let f = self.f(&format!("dequant_{suffix}"));
        let cfg = Self::cfg(
            (cdiv(nblocks as usize, BLOCK_THREADS), 1),
            (BLOCK_THREADS, 1),
        );
        // SAFETY: `dequant_*(const u8*, float*, int nblocks)`; the tile holds the largest
        // weight's rows × cols floats (sized at open).
        unsafe {
            self.compute
                .launch_builder(f)
                .arg(w)
                .arg(&mut *tile)
                .arg(&nblocks)
                .launch(cfg)
        }
        .map_err(cuda("dequant launch"))?;
        let gemm = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: rows,
            n,
            k: cols,
            alpha: 1.0f32,
            lda: cols,
            ldb: cols,
            beta: 0.0f32,
            ldc: rows,
        };
        // SAFETY: dimensions as derived above; all three buffers are at least that large.
        unsafe { self.blas.gemm(gemm, tile, x, y) }.map_err(cuda("cuBLAS SGEMM"))?;
        Ok(())
    }

    /// `out[t] = rmsnorm(x[t]) * w` for `ntok` rows of `n`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        w: &TensorMeta,
        buf: &CudaSlice<u8>,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        ntok: usize,
        n: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let wv = buf.slice(w.offset..w.offset + w.nbytes);
        // SAFETY: an F32 tensor (checked at open) at a 4096-aligned offset: w.cols floats.
        let wf = unsafe { wv.transmute::<f32>(w.cols) }.ok_or_else(|| model_err("norm size"))?;
        let (f, cfg) = self.rowwise("rmsnorm", ntok);
        let n = n as i32;
        // SAFETY: `rmsnorm(const float* x, const float* w, float* out, int n, float eps)`;
        // x and out hold ntok rows of n floats.
        unsafe {
            self.compute
                .launch_builder(f)
                .arg(x)
                .arg(&wf)
                .arg(out)
                .arg(&n)
                .arg(&eps)
                .launch(cfg)
        }
        .map_err(cuda("rmsnorm"))?;
        Ok(())
    }

    fn rowwise(&self, name: &str, ntok: usize) -> (&CudaFunction, LaunchConfig) {
        (
            self.f(name),
            Self::cfg((ntok as u32, 1), (BLOCK_THREADS, 1)),
        )
    }

    fn elementwise(
        &self,
        name: &str,
        y: &mut CudaViewMut<f32>,
        x: &CudaView<f32>,
        n: usize,
    ) -> Result<(), GpuError> {
        let cfg = Self::cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        let n = n as i32;
        // SAFETY: `swiglu`/`add_inplace(float*, const float*, int n)`; both hold n floats.
        unsafe {
            self.compute
                .launch_builder(self.f(name))
                .arg(y)
                .arg(x)
                .arg(&n)
                .launch(cfg)
        }
        .map_err(cuda(name))?;
        Ok(())
    }
}

/// Plain RoPE tables `[ctx][head_dim / 2]`, as the CPU `RopeTable` builds them unscaled.
pub fn rope_tables(head_dim: usize, ctx: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(ctx * half);
    let mut sin = Vec::with_capacity(ctx * half);
    for pos in 0..ctx {
        for i in 0..half {
            let a = pos as f64 * theta.powf(-((2 * i) as f64) / head_dim as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

fn open_layer_file(path: &Path, direct: bool) -> Result<File, GpuError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path).map_err(|source| GpuError::Io {
        path: path.display().to_string(),
        source,
    })
}

impl Loader {
    /// Reads layer `i` (whole file, `size` bytes) into `dst`. GDS: blocking cuFileRead into
    /// device memory. Bounce: pread into pinned memory, async copy on `copy`, and the event
    /// that marks the copy done.
    fn load(
        &mut self,
        gpu: &Gpu,
        layer: &Layer,
        i: usize,
        dst: &mut CudaSlice<u8>,
    ) -> Result<Option<CudaEvent>, GpuError> {
        let io_err = |source| GpuError::Io {
            path: layer.path.display().to_string(),
            source,
        };
        match self {
            Loader::Gds { files, .. } => {
                let mut view = dst.slice_mut(..layer.size);
                let n = files[i]
                    .sync_read(0, &mut view)
                    .map_err(cuda("cuFileRead"))?;
                if n != layer.size as isize {
                    return Err(GpuError::Cuda(format!(
                        "cuFileRead of {} returned {n}, expected {}",
                        layer.path.display(),
                        layer.size
                    )));
                }
                Ok(None)
            }
            Loader::Bounce { direct, pinned } => {
                use std::os::unix::fs::FileExt;
                // The previous copy out of the pinned buffer must be finished before reuse.
                gpu.copy.synchronize().map_err(cuda("copy stream"))?;
                let file = open_layer_file(&layer.path, *direct)?;
                let host = pinned.as_mut_slice().map_err(cuda("pinned buffer"))?;
                let buf = &mut host[..layer.size];
                let mut done = 0;
                while done < buf.len() {
                    match file.read_at(&mut buf[done..], done as u64) {
                        Ok(0) => {
                            return Err(io_err(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "layer file shorter than the manifest says",
                            )))
                        }
                        Ok(n) => done += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err(e)),
                    }
                }
                let mut view = dst.slice_mut(..layer.size);
                gpu.copy
                    .memcpy_htod(&*buf, &mut view)
                    .map_err(cuda("host-to-device copy"))?;
                let ev = gpu.copy.record_event(None).map_err(cuda("event"))?;
                Ok(Some(ev))
            }
        }
    }
}

impl GpuModel {
    /// Opens `dir` (a GdsLLM model directory) on the GPU: compiles the kernels, plans VRAM
    /// within `opts.vram_budget`, and loads the resident layers.
    pub fn open(dir: &Path, opts: &ExecOptions) -> Result<GpuModel, GpuError> {
        let gpu = Gpu::open(opts.device, opts.load)?;
        let layout = Layout::read(dir)?;
        let plan = layout.plan(opts.ctx, opts.vram_budget as usize)?;
        let Layout {
            shape,
            layers: metas,
            tensors,
            embed,
            head,
            blocks,
            output,
        } = layout;
        let s = &shape;
        let ctx = opts.ctx;
        let kv_dim = s.n_kv_heads * s.head_dim;
        let max_tokens = MAX_BATCH.min(ctx).max(1);
        let widest = s.n_embd.max(s.n_ff).max(s.n_heads * s.head_dim);
        let max_weight = tensors.values().map(|t| t.rows * t.cols).max().unwrap_or(0);
        let mut layers: Vec<Layer> = metas
            .into_iter()
            .map(|m| Layer {
                path: m.path,
                size: m.size,
                resident: None,
            })
            .collect();

        // ---- allocations ----
        let st = &gpu.compute;
        let alloc_u8 = |n: usize| st.alloc_zeros::<u8>(n).map_err(cuda("allocating VRAM"));
        let alloc_f32 = |n: usize| {
            st.alloc_zeros::<f32>(n.max(1))
                .map_err(cuda("allocating VRAM"))
        };
        let max_layer = layers.iter().map(|l| l.size).max().unwrap_or(0);
        let mut loader = match opts.load {
            LoadPath::Gds => {
                let driver = Cufile::new().map_err(cuda("cuFileDriverOpen"))?;
                let files = layers
                    .iter()
                    .map(|l| {
                        let f = open_layer_file(&l.path, true)?;
                        driver.register(f).map_err(cuda("cuFileHandleRegister"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Loader::Gds { driver, files }
            }
            LoadPath::Bounce { direct } => Loader::Bounce {
                direct,
                // SAFETY: the buffer is only read by copies issued after it is filled.
                pinned: unsafe { gpu.ctx.alloc_pinned::<u8>(max_layer) }
                    .map_err(cuda("allocating pinned host memory"))?,
            },
        };
        let mut slots = Vec::new();
        if plan.slot_bytes > 0 {
            for _ in 0..2 {
                // On the copy stream: cuFile's blocking read synchronises only that stream.
                let slot = gpu.copy.alloc_zeros::<u8>(plan.slot_bytes);
                slots.push(slot.map_err(cuda("allocating VRAM"))?);
            }
        }
        // cuFile reads fastest into buffers registered once (cuFileBufRegister).
        let register = |loader: &Loader, buf: &CudaSlice<u8>| match loader {
            Loader::Gds { driver, .. } => {
                driver.buf_register(buf).map_err(cuda("cuFileBufRegister"))
            }
            Loader::Bounce { .. } => Ok(()),
        };
        for slot in &slots {
            register(&loader, slot)?;
        }
        let mut stats = LoadStats::default();
        for (i, layer) in layers.iter_mut().enumerate() {
            if !plan.resident[i] {
                continue;
            }
            let mut buf = alloc_u8(layer.size)?;
            register(&loader, &buf)?;
            let t0 = Instant::now();
            if let Some(ev) = loader.load(&gpu, layer, i, &mut buf)? {
                ev.synchronize().map_err(cuda("loading a layer"))?;
            }
            stats.seconds += t0.elapsed().as_secs_f64();
            stats.bytes += layer.size as u64;
            layer.resident = Some(buf);
        }
        let (cos, sin) = match &opts.rope {
            Some(t) => t.clone(),
            None => rope_tables(s.head_dim, ctx, s.rope_theta),
        };
        let rope_cos = st.clone_htod(&cos).map_err(cuda("RoPE table"))?;
        let rope_sin = st.clone_htod(&sin).map_err(cuda("RoPE table"))?;
        let mut kv_k = Vec::new();
        let mut kv_v = Vec::new();
        for _ in 0..s.n_layers {
            kv_k.push(alloc_f32(ctx * kv_dim)?);
            kv_v.push(alloc_f32(ctx * kv_dim)?);
        }
        let scratch = Scratch {
            max_tokens,
            x: alloc_f32(max_tokens * s.n_embd)?,
            xb: alloc_f32(max_tokens * widest)?,
            q: alloc_f32(max_tokens * s.n_heads * s.head_dim)?,
            k: alloc_f32(max_tokens * kv_dim)?,
            v: alloc_f32(max_tokens * kv_dim)?,
            attn: alloc_f32(max_tokens * s.n_heads * s.head_dim)?,
            att: alloc_f32(max_tokens * s.n_heads * ctx)?,
            gate: alloc_f32(max_tokens * s.n_ff)?,
            up: alloc_f32(max_tokens * s.n_ff)?,
            logits: alloc_f32(s.vocab)?,
            tile: alloc_f32(max_weight)?,
        };
        Ok(GpuModel {
            gpu,
            shape,
            layers,
            tensors,
            embed,
            blocks,
            head,
            output,
            loaded: vec![None, None],
            computed: vec![None, None],
            slots,
            loader,
            kv_k,
            kv_v,
            rope_cos,
            rope_sin,
            s: scratch,
            ctx_len: ctx,
            stats,
            plan,
        })
    }

    /// The path this model loads layers by.
    pub fn path(&self) -> GpuPath {
        match self.loader {
            Loader::Gds { .. } => GpuPath::Gds,
            Loader::Bounce { .. } => GpuPath::Bounce,
        }
    }

    /// The model's hyperparameters.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    fn tensor(&self, name: &str) -> Result<TensorMeta, GpuError> {
        self.tensors
            .get(name)
            .copied()
            .ok_or_else(|| model_err(format!("missing tensor {name}")))
    }

    /// Runs `tokens` at positions `pos0..` and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<f32>, GpuError> {
        let ntok = tokens.len();
        if ntok == 0 || ntok > self.s.max_tokens || pos0 + ntok > self.ctx_len {
            return Err(model_err(format!(
                "{ntok} tokens at position {pos0}: batch limit {}, context {}",
                self.s.max_tokens, self.ctx_len
            )));
        }
        self.embed_tokens(tokens)?;
        // Streamed blocks in order, alternating slots; the first is loaded up front.
        let streamed: Vec<usize> = (0..self.blocks.len())
            .filter(|&b| self.layers[self.blocks[b]].resident.is_none())
            .collect();
        if let Some(&first) = streamed.first() {
            self.load_slot(self.blocks[first], 0)?;
        }
        let mut next = 0;
        for b in 0..self.blocks.len() {
            let li = self.blocks[b];
            let slot = if self.layers[li].resident.is_some() {
                None
            } else {
                let slot = next % 2;
                next += 1;
                Some(slot)
            };
            if let Some(slot) = slot {
                if let Some(ev) = &self.loaded[slot] {
                    self.gpu
                        .compute
                        .wait(ev)
                        .map_err(cuda("waiting for a layer"))?;
                }
            }
            self.run_block(b, slot, ntok, pos0)?;
            if let Some(slot) = slot {
                self.computed[slot] =
                    Some(self.gpu.compute.record_event(None).map_err(cuda("event"))?);
                // Prefetch the next streamed block into the other slot while this one computes.
                if let Some(&nb) = streamed.get(next) {
                    self.load_slot(self.blocks[nb], 1 - slot)?;
                }
            }
        }
        self.run_head(ntok)?;
        let mut logits = vec![0f32; self.shape.vocab];
        self.gpu
            .compute
            .memcpy_dtoh(&self.s.logits, &mut logits)
            .map_err(cuda("copying logits"))?;
        self.gpu.compute.synchronize().map_err(cuda("forward"))?;
        Ok(logits)
    }

    /// Reads layer `li` into streaming slot `slot`, once the slot's last user has finished.
    fn load_slot(&mut self, li: usize, slot: usize) -> Result<(), GpuError> {
        if let Some(ev) = &self.computed[slot] {
            ev.synchronize().map_err(cuda("waiting for a slot"))?;
        }
        let t0 = Instant::now();
        let ev = self
            .loader
            .load(&self.gpu, &self.layers[li], li, &mut self.slots[slot])?;
        self.stats.seconds += t0.elapsed().as_secs_f64();
        self.stats.bytes += self.layers[li].size as u64;
        self.loaded[slot] = ev;
        Ok(())
    }

    fn embed_tokens(&mut self, tokens: &[u32]) -> Result<(), GpuError> {
        let t = self.tensor("token_embd.weight")?;
        let suffix = kernel_suffix(t.dtype).expect("checked at open");
        let row_bytes = t.nbytes / t.rows;
        let nblocks = (t.cols / t.dtype.block_size()) as i32;
        let n = self.shape.n_embd;
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            if tok >= t.rows {
                return Err(model_err(format!("token {tok} outside the vocabulary")));
            }
            let buf = self.layers[self.embed].resident.as_ref().expect("resident");
            let row = buf.slice(t.offset + tok * row_bytes..t.offset + (tok + 1) * row_bytes);
            let mut dst = self.s.x.slice_mut(i * n..(i + 1) * n);
            let cfg = Gpu::cfg(
                (cdiv(nblocks as usize, BLOCK_THREADS), 1),
                (BLOCK_THREADS, 1),
            );
            // SAFETY: `dequant_*(const u8*, float*, int)`: one row of blocks into n floats.
            unsafe {
                self.gpu
                    .compute
                    .launch_builder(self.gpu.f(&format!("dequant_{suffix}")))
                    .arg(&row)
                    .arg(&mut dst)
                    .arg(&nblocks)
                    .launch(cfg)
            }
            .map_err(cuda("embedding lookup"))?;
        }
        Ok(())
    }

    fn run_block(
        &mut self,
        b: usize,
        slot: Option<usize>,
        ntok: usize,
        pos0: usize,
    ) -> Result<(), GpuError> {
        let li = self.blocks[b];
        let t = |s: &str| self.tensor(&format!("blk.{b}.{s}"));
        let (attn_norm, wq, wk, wv, wo) = (
            t("attn_norm.weight")?,
            t("attn_q.weight")?,
            t("attn_k.weight")?,
            t("attn_v.weight")?,
            t("attn_output.weight")?,
        );
        let (ffn_norm, wg, wu, wd) = (
            t("ffn_norm.weight")?,
            t("ffn_gate.weight")?,
            t("ffn_up.weight")?,
            t("ffn_down.weight")?,
        );
        let biases = [
            t("attn_q.bias").ok(),
            t("attn_k.bias").ok(),
            t("attn_v.bias").ok(),
        ];
        let sh = self.shape.clone();
        let (n, kv_dim, q_dim) = (
            sh.n_embd,
            sh.n_kv_heads * sh.head_dim,
            sh.n_heads * sh.head_dim,
        );
        let buf = match (&self.layers[li].resident, slot) {
            (Some(b), _) => b,
            (None, Some(i)) => &self.slots[i],
            (None, None) => return Err(model_err("streamed layer without a slot")),
        };
        // Disjoint borrows: the weights (read) and the scratch and KV cache (written).
        let (g, s, kv_k, kv_v) = (&self.gpu, &mut self.s, &mut self.kv_k[b], &mut self.kv_v[b]);
        let (rope_cos, rope_sin, ctx_len) = (&self.rope_cos, &self.rope_sin, self.ctx_len);
        {
            let w = |t: &TensorMeta| buf.slice(t.offset..t.offset + t.nbytes);
            g.rmsnorm(&attn_norm, buf, &s.x, &mut s.xb, ntok, n, sh.eps)?;
            let xb = s.xb.slice(..ntok * n);
            g.linear(
                &w(&wq),
                &wq,
                &xb,
                &mut s.q.slice_mut(..ntok * q_dim),
                ntok,
                &mut s.tile,
            )?;
            g.linear(
                &w(&wk),
                &wk,
                &xb,
                &mut s.k.slice_mut(..ntok * kv_dim),
                ntok,
                &mut s.tile,
            )?;
            g.linear(
                &w(&wv),
                &wv,
                &xb,
                &mut s.v.slice_mut(..ntok * kv_dim),
                ntok,
                &mut s.tile,
            )?;
            for (bias, out, dim) in [
                (&biases[0], &mut s.q, q_dim),
                (&biases[1], &mut s.k, kv_dim),
                (&biases[2], &mut s.v, kv_dim),
            ] {
                if let Some(bt) = bias {
                    let bv = w(bt);
                    // SAFETY: F32 bias of `dim` floats at a 4096-aligned offset.
                    let bf = unsafe { bv.transmute::<f32>(dim) }
                        .ok_or_else(|| model_err("bias size"))?;
                    for i in 0..ntok {
                        g.elementwise(
                            "add_inplace",
                            &mut out.slice_mut(i * dim..(i + 1) * dim),
                            &bf,
                            dim,
                        )?;
                    }
                }
            }
            let (f, cfg) = g.rowwise("rope", ntok);
            let (nh, nkv, hd, p0) = (
                sh.n_heads as i32,
                sh.n_kv_heads as i32,
                sh.head_dim as i32,
                pos0 as i32,
            );
            for (x, heads) in [(&mut s.q, nh), (&mut s.k, nkv)] {
                // SAFETY: `rope(float* x, const float* cos, const float* sin, int n_heads,
                // int head_dim, int pos0)`; tables cover ctx ≥ pos0 + ntok positions.
                unsafe {
                    g.compute
                        .launch_builder(f)
                        .arg(x)
                        .arg(rope_cos)
                        .arg(rope_sin)
                        .arg(&heads)
                        .arg(&hd)
                        .arg(&p0)
                        .launch(cfg)
                }
                .map_err(cuda("rope"))?;
            }
            let range = pos0 * kv_dim..(pos0 + ntok) * kv_dim;
            g.compute
                .memcpy_dtod(
                    &s.k.slice(..ntok * kv_dim),
                    &mut kv_k.slice_mut(range.clone()),
                )
                .map_err(cuda("KV store"))?;
            g.compute
                .memcpy_dtod(&s.v.slice(..ntok * kv_dim), &mut kv_v.slice_mut(range))
                .map_err(cuda("KV store"))?;
            let cfg = Gpu::cfg((sh.n_heads as u32, ntok as u32), (BLOCK_THREADS, 1));
            let (n_ctx, scale) = (ctx_len as i32, 1.0f32 / (sh.head_dim as f32).sqrt());
            // SAFETY: `attention(q, k, v, att, out, n_heads, n_kv_heads, head_dim, pos0,
            // n_ctx, scale)`; the cache holds positions < pos0 + ntok ≤ ctx, att is
            // max_tokens × n_heads × ctx floats.
            unsafe {
                g.compute
                    .launch_builder(g.f("attention"))
                    .arg(&s.q)
                    .arg(&*kv_k)
                    .arg(&*kv_v)
                    .arg(&mut s.att)
                    .arg(&mut s.attn)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&p0)
                    .arg(&n_ctx)
                    .arg(&scale)
                    .launch(cfg)
            }
            .map_err(cuda("attention"))?;
            let attn = s.attn.slice(..ntok * q_dim);
            g.linear(
                &w(&wo),
                &wo,
                &attn,
                &mut s.xb.slice_mut(..ntok * n),
                ntok,
                &mut s.tile,
            )?;
            g.elementwise(
                "add_inplace",
                &mut s.x.slice_mut(..ntok * n),
                &s.xb.slice(..ntok * n),
                ntok * n,
            )?;
            g.rmsnorm(&ffn_norm, buf, &s.x, &mut s.xb, ntok, n, sh.eps)?;
            let xb = s.xb.slice(..ntok * n);
            let ff = sh.n_ff;
            g.linear(
                &w(&wg),
                &wg,
                &xb,
                &mut s.gate.slice_mut(..ntok * ff),
                ntok,
                &mut s.tile,
            )?;
            g.linear(
                &w(&wu),
                &wu,
                &xb,
                &mut s.up.slice_mut(..ntok * ff),
                ntok,
                &mut s.tile,
            )?;
            g.elementwise(
                "swiglu",
                &mut s.gate.slice_mut(..ntok * ff),
                &s.up.slice(..ntok * ff),
                ntok * ff,
            )?;
            let gate = s.gate.slice(..ntok * ff);
            g.linear(
                &w(&wd),
                &wd,
                &gate,
                &mut s.xb.slice_mut(..ntok * n),
                ntok,
                &mut s.tile,
            )?;
            g.elementwise(
                "add_inplace",
                &mut s.x.slice_mut(..ntok * n),
                &s.xb.slice(..ntok * n),
                ntok * n,
            )
        }
    }

    fn run_head(&mut self, ntok: usize) -> Result<(), GpuError> {
        let norm = self.tensor("output_norm.weight")?;
        let (n, vocab, eps) = (self.shape.n_embd, self.shape.vocab, self.shape.eps);
        let head = self.layers[self.head].resident.as_ref().expect("resident");
        let out = self.output;
        let obuf = self.layers[out.layer].resident.as_ref().expect("resident");
        let (g, s) = (&self.gpu, &mut self.s);
        g.rmsnorm(&norm, head, &s.x, &mut s.xb, ntok, n, eps)?;
        // Only the last token's logits are needed.
        let last = s.xb.slice((ntok - 1) * n..ntok * n);
        let w = obuf.slice(out.offset..out.offset + out.nbytes);
        g.linear(
            &w,
            &out,
            &last,
            &mut s.logits.slice_mut(..vocab),
            1,
            &mut s.tile,
        )
    }
}
