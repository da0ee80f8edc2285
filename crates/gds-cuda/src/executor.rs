//! The GPU executor: layer files into VRAM (cuFile, or pinned bounce buffers), weights used
//! in place in their on-disk block formats, and the llama forward pass ([`crate::forward`])
//! launched on two streams.
//!
//! **Never run on a GPU yet** (the development machine has none): it compiles under
//! `--features cuda`; the forward pass it launches runs on the CPU in tests with the same
//! kernels (tests/forward_emu.rs), and the kernels compile through NVRTC (tests/nvrtc.rs), but
//! nothing here has executed on real hardware. See the README.
//!
//! Memory follows [`crate::plan`]: embedding and head resident, blocks resident in order
//! while the budget lasts, the rest streamed through two slots:
//! - a streamed block is read into a slot right after the kernels of the block before it
//!   are enqueued, so the read overlaps that block's compute on the GPU. Events order the
//!   two streams: the compute stream waits for `loaded[slot]`, and a slot is refilled only
//!   after `computed[slot]` (its previous block) has completed.
//! - GDS: `cuFileReadAsync` straight into the slot, enqueued on the copy stream (registered
//!   with `cuFileStreamRegister`); no host copy of any weight.
//! - Bounce: the bytes come through `gds-io`'s [`LayerSource`] (an O_DIRECT
//!   [`DirectBackend`] with its read-ahead thread, or its buffered fallback that drops the
//!   pages after each read), are copied into the slot's pinned host buffer, and go to VRAM
//!   by an asynchronous copy on the copy stream. After each load the next streamed layer is
//!   handed to the backend's read-ahead, so the disk works while the GPU computes.
//!
//! Decode (one token) uses the dequantizing matvec kernels; prefill of at least
//! [`GEMM_MIN_TOKENS`](crate::forward::GEMM_MIN_TOKENS) tokens dequantizes each weight into an f32 tile and calls cuBLAS
//! SGEMM. The executor returns logits; sampling stays with the caller (the CPU backend's
//! sampler).

use crate::forward::{Device, Pass, Scratch};
use crate::kernels::{self, BLOCK_THREADS, MATVEC_ROWS};
use crate::plan::{schedule, Layout, Step, VramPlan, MAX_BATCH};
use crate::{nvrtc, probe, GpuError, GpuPath};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::CudaBlas;
use cudarc::cufile::{Cufile, FileHandle};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use gds_io::{DirectBackend, DirectOptions, LayerSource, Span};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

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

/// The parameters of one `cuFileReadAsync`: cuFile reads them when the read executes on
/// the stream, not when it is enqueued, so they live in a box per slot until the slot's
/// next use (which waits for the block computed from it, hence for the read).
#[derive(Default)]
struct AsyncRead {
    size: usize,
    file_offset: i64,
    buf_offset: i64,
    bytes_read: isize,
    /// The layer being read (for the check after it completed), if any.
    layer: Option<usize>,
}

enum Loader {
    Gds {
        driver: Arc<Cufile>,
        files: Vec<FileHandle>,
        pending: [Box<AsyncRead>; 2],
    },
    Bounce {
        source: Box<dyn LayerSource>,
        /// One pinned host buffer per slot (the largest layer each).
        pinned: [PinnedHostSlice<u8>; 2],
    },
}

/// A model loaded for the GPU: resident layers, streaming slots, KV cache, kernels.
pub struct GpuModel {
    gpu: Gpu,
    layout: Layout,
    layers: Vec<Layer>,
    slots: Vec<CudaSlice<u8>>,
    loaded: [Option<CudaEvent>; 2],
    computed: [Option<CudaEvent>; 2],
    loader: Loader,
    /// Every other device buffer (KV cache, RoPE tables, scratch): kept alive here, used
    /// through the addresses in `kv`, `rope` and `scratch`.
    _buffers: Vec<CudaSlice<f32>>,
    kv: Vec<(u64, u64)>,
    rope: (u64, u64),
    scratch: Scratch,
    /// Device address of each layer's bytes during a pass (0 = not in VRAM now).
    base: Vec<u64>,
    /// Device addresses of the two streaming slots.
    slot_addr: Vec<u64>,
    /// The per-token order of block computes and slot reads (`plan::schedule`).
    steps: Vec<Step>,
    /// For each step, the layer of the next load after it (wrapping to the next token's
    /// first): what to read ahead.
    next_load: Vec<Option<usize>>,
    max_tokens: usize,
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

fn cfg(grid: (u32, u32), block: (u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block.0, block.1, 1),
        shared_mem_bytes: 0,
    }
}

fn cdiv(a: i32, b: u32) -> u32 {
    (a.max(0) as u32).div_ceil(b)
}

/// The device address of a buffer (event tracking is off: ordering is explicit).
fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
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
        // SAFETY: every cross-stream use is ordered explicitly: allocations are followed by a
        // context synchronize before first use, streamed slots by the loaded/computed events,
        // and the model synchronizes before its buffers are freed (Drop).
        unsafe { ctx.disable_event_tracking() };
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

    fn f(&self, name: &str) -> Result<&CudaFunction, GpuError> {
        self.funcs
            .get(name)
            .ok_or_else(|| model_err(format!("no kernel {name}")))
    }
}

/// [`Device`] on the GPU: every call is an asynchronous launch on the compute stream.
struct CudaDevice<'a>(&'a Gpu);

macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr, $($arg:expr),+) => {{
        let f = $gpu.f($name)?;
        let mut b = $gpu.compute.launch_builder(f);
        $( b.arg(&$arg); )+
        // SAFETY: the argument list matches the kernel's signature in kernels/*.cu (the
        // forward module documents each), and every address is a live device buffer sized
        // as forward::Scratch / Pass document.
        unsafe { b.launch($cfg) }.map_err(cuda($name))?;
        Ok(())
    }};
}

impl Device for CudaDevice<'_> {
    fn matvec(
        &mut self,
        suffix: &str,
        w: u64,
        x: u64,
        y: u64,
        rows: i32,
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let c = cfg((cdiv(rows, MATVEC_ROWS), 1), (32, MATVEC_ROWS));
        launch!(
            self.0,
            &format!("matvec_{suffix}"),
            c,
            w,
            x,
            y,
            rows,
            cols,
            ntok
        )
    }
    fn dequant(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(nblocks, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        let name = kernels::kernel_name("dequant", suffix)
            .ok_or_else(|| model_err(format!("no dequant kernel for {suffix}")))?;
        launch!(self.0, name, c, src, dst, nblocks)
    }
    fn rmsnorm(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError> {
        let c = cfg((ntok as u32, 1), (BLOCK_THREADS, 1));
        launch!(self.0, "rmsnorm", c, x, w, out, n, eps)
    }
    fn rope(
        &mut self,
        x: u64,
        cos: u64,
        sin: u64,
        n_heads: i32,
        head_dim: i32,
        pos0: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let c = cfg((ntok as u32, 1), (BLOCK_THREADS, 1));
        launch!(self.0, "rope", c, x, cos, sin, n_heads, head_dim, pos0)
    }
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
    ) -> Result<(), GpuError> {
        let c = cfg((n_heads as u32, ntok as u32), (BLOCK_THREADS, 1));
        launch!(
            self.0,
            "attention",
            c,
            q,
            k,
            v,
            att,
            out,
            n_heads,
            n_kv_heads,
            head_dim,
            pos0,
            n_ctx,
            scale
        )
    }
    fn swiglu(&mut self, gate: u64, up: u64, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self.0, "swiglu", c, gate, up, n)
    }
    fn add(&mut self, y: u64, x: u64, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self.0, "add_inplace", c, y, x, n)
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: both ranges lie in live device buffers (KV cache and scratch).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.0.compute.cu_stream())
        }
        .map_err(cuda("device copy"))
    }
    fn gemm(&mut self, a: u64, b: u64, c: u64, m: i32, n: i32, k: i32) -> Result<bool, GpuError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the handle is bound to the compute stream; a, b and c are device buffers
        // of k×m, k×n and m×n floats (forward::Pass::linear).
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.0.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha,
                a as *const f32,
                k,
                b as *const f32,
                k,
                &beta,
                c as *mut f32,
                m,
            )
        }
        .map_err(cuda("cuBLAS SGEMM"))?;
        Ok(true)
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
    /// Reads layer `i` (whole file) into `dst` through pinned buffer / pending read `slot`.
    /// `sync`: complete before returning (initial loads); otherwise the read is enqueued on
    /// the copy stream and the returned event marks it done.
    fn load(
        &mut self,
        gpu: &Gpu,
        layer: &Layer,
        i: usize,
        dst: &mut CudaSlice<u8>,
        slot: usize,
        sync: bool,
    ) -> Result<Option<CudaEvent>, GpuError> {
        let short = |n: isize| {
            GpuError::Cuda(format!(
                "reading {}: got {n} bytes, expected {}",
                layer.path.display(),
                layer.size
            ))
        };
        match self {
            Loader::Gds { files, pending, .. } if sync => {
                let mut view = dst.slice_mut(..layer.size);
                let n = files[i]
                    .sync_read(0, &mut view)
                    .map_err(cuda("cuFileRead"))?;
                pending[slot].layer = None;
                if n != layer.size as isize {
                    return Err(short(n));
                }
                Ok(None)
            }
            Loader::Gds { files, pending, .. } => {
                let p = &mut *pending[slot];
                *p = AsyncRead {
                    size: layer.size,
                    layer: Some(i),
                    ..AsyncRead::default()
                };
                let (ptr, _) = dst.device_ptr_mut(&gpu.copy);
                // SAFETY: the destination is a live device slot of at least `size` bytes
                // (plan: slots hold the largest streamed layer); the parameters live in
                // `pending[slot]`, a box that is neither moved nor rewritten until this
                // slot's next load, which first waits for the block computed from this read
                // (`computed[slot]`), hence for the read itself.
                unsafe {
                    cudarc::cufile::result::read_async(
                        files[i].cu(),
                        ptr as *mut std::ffi::c_void,
                        &p.size,
                        &p.file_offset,
                        &p.buf_offset,
                        &mut p.bytes_read,
                        gpu.copy.cu_stream() as _,
                    )
                }
                .map_err(cuda("cuFileReadAsync"))?;
                Ok(Some(gpu.copy.record_event(None).map_err(cuda("event"))?))
            }
            Loader::Bounce { source, pinned } => {
                let bytes = source.acquire(i).map_err(|e| GpuError::Io {
                    path: layer.path.display().to_string(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                if bytes.len() != layer.size {
                    return Err(short(bytes.len() as isize));
                }
                let host = pinned[slot].as_mut_slice().map_err(cuda("pinned buffer"))?;
                let buf = &mut host[..layer.size];
                buf.copy_from_slice(&bytes);
                drop(bytes);
                let mut view = dst.slice_mut(..layer.size);
                gpu.copy
                    .memcpy_htod(&*buf, &mut view)
                    .map_err(cuda("host-to-device copy"))?;
                let ev = gpu.copy.record_event(None).map_err(cuda("event"))?;
                if sync {
                    ev.synchronize().map_err(cuda("loading a layer"))?;
                    return Ok(None);
                }
                Ok(Some(ev))
            }
        }
    }

    /// Starts reading layer `i` ahead (bounce: the gds-io backend's read-ahead thread).
    fn prefetch(&self, i: usize, size: usize) {
        if let Loader::Bounce { source, .. } = self {
            source.prefetch(Span {
                layer: i,
                offset: 0,
                len: size as u64,
            });
        }
    }

    /// After the copy stream passed slot `slot`'s read: checks the byte count cuFile
    /// reported (GDS reads are asynchronous; their result arrives with the stream).
    fn check(&mut self, slot: usize, layers: &[Layer]) -> Result<(), GpuError> {
        if let Loader::Gds { pending, .. } = self {
            let p = &mut *pending[slot];
            if let Some(i) = p.layer.take() {
                if p.bytes_read != p.size as isize {
                    return Err(GpuError::Cuda(format!(
                        "cuFileReadAsync of {}: {} bytes read, expected {}",
                        layers[i].path.display(),
                        p.bytes_read,
                        p.size
                    )));
                }
            }
        }
        Ok(())
    }

    /// Bytes and time of the reads, where the loader counts them itself (bounce: the
    /// gds-io backend's counters).
    fn io_stats(&self) -> Option<gds_io::IoStats> {
        match self {
            Loader::Bounce { source, .. } => Some(source.stats()),
            Loader::Gds { .. } => None,
        }
    }
}

impl GpuModel {
    /// Opens `dir` (a GdsLLM model directory) on the GPU: compiles the kernels, plans VRAM
    /// within `opts.vram_budget`, and loads the resident layers.
    pub fn open(dir: &Path, opts: &ExecOptions) -> Result<GpuModel, GpuError> {
        let layout = Layout::read(dir)?;
        if layout.shape.rope_scaling != "none" && opts.rope.is_none() {
            return Err(model_err(format!(
                "RoPE scaling `{}`: pass the runtime's tables in ExecOptions::rope",
                layout.shape.rope_scaling
            )));
        }
        let plan = layout.plan(opts.ctx, opts.vram_budget as usize)?;
        let gpu = Gpu::open(opts.device, opts.load)?;
        let (s, ctx) = (&layout.shape, opts.ctx);
        let (q_dim, kv_dim) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let max_tokens = MAX_BATCH.min(ctx).max(1);
        let widest = s.n_embd.max(s.n_ff).max(q_dim);

        let st = &gpu.compute;
        let mut layers: Vec<Layer> = layout
            .layers
            .iter()
            .map(|m| Layer {
                path: m.path.clone(),
                size: m.size,
                resident: None,
            })
            .collect();
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
                // Flags 0x7: size, file offset and buffer offset are known when each read
                // is enqueued.
                driver
                    .stream_register(&gpu.copy, 0x7)
                    .map_err(cuda("cuFileStreamRegister"))?;
                Loader::Gds {
                    driver,
                    files,
                    pending: Default::default(),
                }
            }
            LoadPath::Bounce { direct } => {
                let io_err = |e: gds_io::IoError| GpuError::Io {
                    path: dir.display().to_string(),
                    source: std::io::Error::other(e.to_string()),
                };
                let bytes = gds_io::read_manifest(dir).map_err(io_err)?;
                let manifest = gds_format::Manifest::parse(&bytes)
                    .map_err(|e| model_err(format!("{}: {e}", dir.display())))?;
                // Nothing resident on the host: every layer passes through two buffers of
                // the largest layer (plus alignment slack), one being read ahead.
                let source = DirectBackend::open(
                    dir,
                    &manifest,
                    &DirectOptions {
                        resident: vec![false; layers.len()],
                        slots: 2,
                        slot_size: gds_io::align_up(max_layer as u64) as usize + 2 * gds_io::ALIGN,
                        force_buffered: !direct,
                    },
                )
                .map_err(io_err)?;
                let mut pinned = Vec::new();
                for _ in 0..2 {
                    // SAFETY: the buffers are read only by copies issued after they are
                    // filled.
                    let p = unsafe { gpu.ctx.alloc_pinned::<u8>(max_layer.max(1)) }
                        .map_err(cuda("allocating pinned host memory"))?;
                    pinned.push(p);
                }
                let pinned: [PinnedHostSlice<u8>; 2] = pinned
                    .try_into()
                    .map_err(|_| model_err("two pinned buffers"))?;
                Loader::Bounce {
                    source: Box::new(source),
                    pinned,
                }
            }
        };
        // Device buffers. Slots live on the copy stream: cuFile's blocking read synchronises
        // only that stream, so it overlaps the compute stream's work.
        let mut slots = Vec::new();
        if plan.slot_bytes > 0 {
            for _ in 0..2 {
                let slot = gpu.copy.alloc_zeros::<u8>(plan.slot_bytes);
                slots.push(slot.map_err(cuda("allocating VRAM"))?);
            }
        }
        let mut buffers = Vec::new();
        let mut f32_buf = |n: usize| -> Result<u64, GpuError> {
            let b = st
                .alloc_zeros::<f32>(n.max(1))
                .map_err(cuda("allocating VRAM"))?;
            let a = addr(&b, st);
            buffers.push(b);
            Ok(a)
        };
        let mut kv = Vec::new();
        for _ in 0..s.n_layers {
            kv.push((f32_buf(ctx * kv_dim)?, f32_buf(ctx * kv_dim)?));
        }
        let scratch = Scratch {
            x: f32_buf(max_tokens * s.n_embd)?,
            xb: f32_buf(max_tokens * widest)?,
            q: f32_buf(max_tokens * q_dim)?,
            k: f32_buf(max_tokens * kv_dim)?,
            v: f32_buf(max_tokens * kv_dim)?,
            attn: f32_buf(max_tokens * q_dim)?,
            att: f32_buf(max_tokens * s.n_heads * ctx)?,
            gate: f32_buf(max_tokens * s.n_ff)?,
            up: f32_buf(max_tokens * s.n_ff)?,
            logits: f32_buf(s.vocab)?,
            tile: f32_buf(layout.max_weight_elements())?,
        };
        let (cos, sin) = match &opts.rope {
            Some(t) => t.clone(),
            None => rope_tables(s.head_dim, ctx, s.rope_theta),
        };
        let half = s.head_dim / 2;
        if cos.len() < ctx * half || sin.len() < ctx * half {
            return Err(model_err("RoPE tables shorter than the context"));
        }
        let cos = st.clone_htod(&cos).map_err(cuda("RoPE table"))?;
        let sin = st.clone_htod(&sin).map_err(cuda("RoPE table"))?;
        let rope = (addr(&cos, st), addr(&sin, st));
        buffers.push(cos);
        buffers.push(sin);

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
        let mut resident = Vec::new();
        for (i, layer) in layers.iter().enumerate() {
            if plan.resident[i] {
                let buf = st
                    .alloc_zeros::<u8>(layer.size)
                    .map_err(cuda("allocating VRAM"))?;
                register(&loader, &buf)?;
                resident.push((i, buf));
            }
        }
        // Every allocation (and its zero fill) done before the first read lands.
        gpu.ctx.synchronize().map_err(cuda("allocations"))?;
        for (i, mut buf) in resident {
            let t0 = Instant::now();
            loader.load(&gpu, &layers[i], i, &mut buf, 0, true)?;
            stats.seconds += t0.elapsed().as_secs_f64();
            stats.bytes += layers[i].size as u64;
            layers[i].resident = Some(buf);
        }
        let base = layers
            .iter()
            .map(|l| l.resident.as_ref().map_or(0, |b| addr(b, st)))
            .collect();
        let slot_addr = slots.iter().map(|s| addr(s, &gpu.copy)).collect();
        let steps = schedule(&layout.blocks, &plan.resident);
        let next_load = crate::plan::next_loads(&steps);
        Ok(GpuModel {
            next_load,
            base,
            slot_addr,
            steps,
            gpu,
            layout,
            layers,
            slots,
            loaded: [None, None],
            computed: [None, None],
            loader,
            _buffers: buffers,
            kv,
            rope,
            scratch,
            max_tokens,
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

    /// Most tokens one [`forward`](GpuModel::forward) call takes.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The model's layout (shape, layers, tensors).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Runs `tokens` at positions `pos0..` (at most 512 at once: longer prompts go in
    /// chunks) and writes the logits of the last one into `logits` (vocab floats). Nothing
    /// is allocated on the host.
    pub fn forward(
        &mut self,
        logits: &mut [f32],
        tokens: &[u32],
        pos0: usize,
    ) -> Result<(), GpuError> {
        let ntok = tokens.len();
        if ntok == 0 || ntok > self.max_tokens || pos0 + ntok > self.ctx_len {
            return Err(model_err(format!(
                "{ntok} tokens at position {pos0}: batch limit {}, context {}",
                self.max_tokens, self.ctx_len
            )));
        }
        if logits.len() != self.layout.shape.vocab {
            return Err(model_err("logits buffer is not vocab-sized"));
        }
        let st = self.gpu.compute.clone();
        self.pass().embed(&mut CudaDevice(&self.gpu), tokens)?;
        for i in 0..self.steps.len() {
            match self.steps[i] {
                Step::Load { layer, slot } => self.load_slot(layer, slot, self.next_load[i])?,
                Step::Compute { block, slot: None } => {
                    self.pass()
                        .block(&mut CudaDevice(&self.gpu), block, ntok, pos0)?
                }
                Step::Compute {
                    block,
                    slot: Some(slot),
                } => {
                    if let Some(ev) = &self.loaded[slot] {
                        st.wait(ev).map_err(cuda("waiting for a layer"))?;
                    }
                    let li = self.layout.blocks[block];
                    self.base[li] = self.slot_addr[slot];
                    let ran = self
                        .pass()
                        .block(&mut CudaDevice(&self.gpu), block, ntok, pos0);
                    self.base[li] = 0;
                    ran?;
                    self.computed[slot] = Some(st.record_event(None).map_err(cuda("event"))?);
                }
            }
        }
        self.pass().head(&mut CudaDevice(&self.gpu), ntok)?;
        // SAFETY: `logits` holds vocab floats, the scratch logits buffer as many; the
        // stream is synchronized before `logits` is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(logits, self.scratch.logits, st.cu_stream())
        }
        .map_err(cuda("copying logits"))?;
        st.synchronize().map_err(cuda("forward"))?;
        self.gpu.copy.synchronize().map_err(cuda("copy stream"))?;
        for slot in 0..2 {
            self.loader.check(slot, &self.layers)?;
        }
        Ok(())
    }

    fn pass(&self) -> Pass<'_> {
        Pass {
            layout: &self.layout,
            layer_base: &self.base,
            s: self.scratch,
            kv: &self.kv,
            rope: self.rope,
            ctx: self.ctx_len,
        }
    }

    /// Reads layer `li` into streaming slot `slot`, once the slot's last user has finished,
    /// then starts reading `next` (the layer the following load will want) ahead.
    fn load_slot(&mut self, li: usize, slot: usize, next: Option<usize>) -> Result<(), GpuError> {
        if let Some(ev) = &self.computed[slot] {
            ev.synchronize().map_err(cuda("waiting for a slot"))?;
        }
        self.loader.check(slot, &self.layers)?;
        let t0 = Instant::now();
        let ev = self.loader.load(
            &self.gpu,
            &self.layers[li],
            li,
            &mut self.slots[slot],
            slot,
            false,
        )?;
        if let Some(n) = next {
            self.loader.prefetch(n, self.layers[n].size);
        }
        self.stats.seconds += t0.elapsed().as_secs_f64();
        self.stats.bytes += self.layers[li].size as u64;
        self.loaded[slot] = ev;
        Ok(())
    }

    /// Bytes read from layer files and the time spent reading: the gds-io backend's
    /// counters on the bounce path, the executor's own on the GDS path.
    pub fn io_stats(&self) -> gds_io::IoStats {
        self.loader.io_stats().unwrap_or(gds_io::IoStats {
            bytes_read: self.stats.bytes,
            read_ns: (self.stats.seconds * 1e9) as u64,
            ..Default::default()
        })
    }
}

impl Drop for GpuModel {
    fn drop(&mut self) {
        // Buffers are freed after this; nothing may still be using them. An error here has
        // nowhere to go.
        let _ = self.gpu.ctx.synchronize();
    }
}
