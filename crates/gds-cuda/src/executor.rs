//! The GPU executor: layer files into VRAM (cuFile, or pinned bounce buffers), weights used
//! in place in their on-disk block formats, and the model's graph (a
//! [`BlockGraph`](crate::forward::BlockGraph) over [`crate::forward`]'s kernels) launched on
//! two streams. The executor's logic (layout, residency, the per-token
//! schedule, read-ahead) is [`crate::stream::Streamer`]; this module is its CUDA
//! [`Vram`]: device buffers, loads, streams and events.
//!
//! Run on an NVIDIA H200 on 2026-11-26 (`scripts/gpu-bringup.sh`: the CPU f32 reference's
//! greedy tokens and perplexity at every VRAM budget and load path; see
//! docs/hardware-log.md). The development machine has no GPU: CI compiles this module
//! under `--features cuda`, runs the streamer it plugs into on the CPU over an emulated
//! `Vram` with the same kernels (tests/it/executor_emu.rs), and compiles the kernels through
//! NVRTC (tests/nvrtc.rs); this module's own CUDA calls run only on GPU hardware.
//!
//! Memory follows [`crate::plan`]: embedding and head resident, blocks resident in order
//! while the budget lasts, the rest streamed through two slots:
//! - a streamed block is read into a slot right after the kernels of the block before it
//!   are enqueued, so the read overlaps that block's compute on the GPU. Events order the
//!   two streams: the compute stream waits for `loaded[slot]`, and a slot is refilled only
//!   after `computed[slot]` (its previous block) has completed.
//! - GDS: `cuFileReadAsync` straight into the slot, enqueued on the copy stream (registered
//!   with `cuFileStreamRegister`); no host copy of any weight where nvidia-fs is loaded
//!   (without it libcufile's compatibility mode copies through its own host buffers).
//! - Bounce: the bytes come through `gds-io`'s [`LayerSource`] (an O_DIRECT
//!   [`DirectBackend`] with its read-ahead thread, or, for `--io mmap`, page-cache reads
//!   that leave the pages cached: host RAM is the tier between VRAM and storage) into its
//!   streaming buffers, which are page-locked (`cuMemHostRegister`), and go to VRAM from
//!   there by an asynchronous copy on the copy stream, the buffer held until the copy is
//!   done (where the driver refuses to lock them, they are copied into a pinned buffer per
//!   slot first). After each load the next streamed layer is handed to the backend's
//!   read-ahead, so the disk works while the GPU computes.
//!
//! Decode (one token) uses the dequantizing matvec kernels; prefill of at least
//! [`GEMM_MIN_TOKENS`](crate::forward::GEMM_MIN_TOKENS) tokens dequantizes each weight into an f32 tile and calls cuBLAS
//! SGEMM. The executor returns logits; sampling stays with the caller (the CPU backend's
//! sampler).

use crate::forward::{Device, GemmType, GluAct, Heads, KvPages, Q8Out, RopeArgs};
use crate::kernels::{self, Mmq8Shape, BLOCK_THREADS, MATVEC_ROWS};
use crate::plan::{LayerMeta, Layout};
use crate::profile::KernelProfile;
use crate::stream::{BufKind, GraphKey, StreamOptions, Streamer, Vram};
use crate::{nvrtc, probe, GpuError, GpuPath};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::CudaBlas;
use cudarc::cufile::{Cufile, FileHandle};
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use gds_format::Manifest;
use gds_io::{DirectBackend, DirectOptions, LayerBytes, LayerSource, Span};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use crate::stream::LoadStats;

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
    /// RoPE tables `[ctx][rope_dims / 2]` (cos, sin) from the runtime's `RopeTable`s (the
    /// global layers', then the window layers' where they differ); empty computes one plain
    /// `theta^(-2i/d)` table (no scaling).
    pub rope: Vec<(Vec<f32>, Vec<f32>)>,
    /// Check every layer file's content hash before its bytes reach the device (on the
    /// host, once per file identity; see `gds_io::verify`). `false` with `--no-verify`.
    pub verify: bool,
    /// Most tokens of one pass ([`crate::plan::MAX_BATCH`] by default).
    pub max_batch: usize,
    /// The KV cache: `None` for one sequence; a paged cache shared by several sequences
    /// (the server) otherwise.
    pub kv: Option<crate::plan::KvSpec>,
    /// Most tokens of a pass that get logits (`None`: up to 16).
    pub max_outputs: Option<usize>,
    /// Matrix products of short passes over 8-bit activations (the int8 kernels, where the
    /// weight type has one: `--activations q8`) rather than f32 (`--activations f32`).
    pub q8_activations: bool,
    /// Passes of this many tokens or more go through GEMM on dequantized tiles (the plan's
    /// `gemm_min_tokens`; [`GEMM_MIN_TOKENS`](crate::forward::GEMM_MIN_TOKENS) by default).
    pub gemm_min_tokens: usize,
    /// What those GEMMs round their inputs to ([`StreamOptions::gemm`]; the plan's
    /// `gemm_type`).
    pub gemm: crate::forward::GemmType,
    /// Capture short passes as CUDA graphs and replay them ([`StreamOptions::graphs`]; the
    /// plan's `cuda_graphs`).
    pub graphs: bool,
}

/// CUDA graphs one model keeps (one per pass shape: tokens and output rows; decode of one
/// sequence needs one, a server's decode steps one per batch size).
pub const MAX_GRAPHS: usize = 64;

/// The compiled kernels and the streams they run on.
struct Gpu {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
    /// The cuBLAS math mode last set: TF32 tensor cores or not (`None`: the default, unset).
    tf32: Option<bool>,
    /// Time per kernel when `GDS_CUDA_PROFILE` asks for it ([`crate::profile`]).
    profile: Option<KernelProfile>,
    /// The int8 matvec kernels' block shape (compiled in; the launches follow it).
    mmq8: Mmq8Shape,
    /// The long passes' int8 products go through the tensor-core `mmq_*` kernels
    /// ([`kernels::MMQ_ENV`] asked for them and the GPU has them).
    mmq: bool,
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
        /// This model's hold on the driver, released in `CudaVram`'s drop after the
        /// deregistrations, while the CUDA context is alive.
        user: Option<CufileUser>,
        files: Vec<FileHandle>,
        pending: [Box<AsyncRead>; 2],
    },
    // (fields drop in this order: the lock before `source` frees the buffers it locks)
    Bounce {
        /// The streaming buffers of `source` page-locked: a layer goes to the device
        /// straight from the bytes `acquire` hands out. `None` where the driver refused
        /// to lock them: then through `staging`.
        locked: Option<HostLock>,
        /// Without `locked`: one pinned host buffer per slot (the largest layer each), the
        /// bytes copied in first.
        staging: Vec<PinnedHostSlice<u8>>,
        /// With `locked`: the layer whose copy to the device may still be reading its
        /// streaming buffer, and the event marking the copy done; held until then (the
        /// buffer takes no other read while held).
        in_flight: Option<(LayerBytes, CudaEvent)>,
        source: Box<dyn LayerSource>,
    },
}

/// Host memory page-locked for a context (`cuMemHostRegister`), unlocked on drop.
struct HostLock {
    ctx: Arc<CudaContext>,
    ptrs: Vec<usize>,
}

impl HostLock {
    /// Page-locks each `(address, bytes)` of `regions`, all or none.
    ///
    /// # Safety
    /// Every region is host memory that stays allocated, and is not locked otherwise, until
    /// the returned lock is dropped.
    unsafe fn new(ctx: &Arc<CudaContext>, regions: &[(usize, usize)]) -> Result<HostLock, String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut lock = HostLock {
            ctx: ctx.clone(),
            ptrs: Vec::new(),
        };
        for &(p, n) in regions {
            // SAFETY: the caller's contract: `n` bytes of live host memory at `p`; flags 0.
            unsafe { sys::cuMemHostRegister_v2(p as *mut std::ffi::c_void, n, 0) }
                .result()
                .map_err(|e| format!("{e:?}"))?;
            lock.ptrs.push(p);
        }
        Ok(lock)
    }
}

impl Drop for HostLock {
    fn drop(&mut self) {
        // An error here has nowhere to go; the context lives as long as this lock.
        let _ = self.ctx.bind_to_thread();
        for &p in &self.ptrs {
            // SAFETY: `p` was locked by `HostLock::new` in this context and is still allocated
            // (its owner outlives the lock); no copy reads it any more (the executor
            // synchronizes the context before dropping the loader).
            let _ = unsafe { sys::cuMemHostUnregister(p as *mut std::ffi::c_void) };
        }
    }
}

pub(crate) fn cuda<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> GpuError + '_ {
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
    /// Copies `src` to the device at `dst` on the compute stream, after the launches before
    /// it, and waits for it (so `src` may go away on return).
    ///
    /// # Safety
    /// `dst` and the `size_of_val(src)` bytes after it lie in a live device buffer.
    unsafe fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        dst: u64,
        src: &[T],
    ) -> Result<(), GpuError> {
        // SAFETY: the caller vouches for the destination; the stream is synchronized before
        // `src` can go away.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.compute.cu_stream()) }
            .map_err(cuda("host-to-device copy"))?;
        self.compute.synchronize().map_err(cuda("upload"))
    }

    fn open(device: usize, load: LoadPath) -> Result<Gpu, GpuError> {
        // Probe first: cudarc panics when it calls into a library that is not there.
        let report = probe();
        if let Some(why) = report.unusable_reason() {
            return Err(GpuError::Unavailable(why.to_string()));
        }
        // Without nvidia-fs cuFile still runs, in its compatibility mode (libcufile bounces
        // through host memory itself); the plan says so. Without libcufile it cannot.
        if load == LoadPath::Gds && report.path != GpuPath::Gds && !report.cufile.present {
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
        let mmq8 = Mmq8Shape::from_env_value(std::env::var(kernels::MMQ8_ENV).ok().as_deref())
            .map_err(GpuError::Model)?;
        let extra =
            kernels::variant_defines(std::env::var(kernels::DEQ_PER_LANE_ENV).ok().as_deref());
        let ptx = nvrtc::compile_library(&format!("compute_{maj}{min}"), mmq8, &extra)?;
        let mmq = crate::env_flag(std::env::var(kernels::MMQ_ENV).ok().as_deref()) == Some(true);
        let mmq = mmq && {
            let ok = (maj, min) >= kernels::MMQ_MIN_CAPABILITY;
            if !ok {
                eprintln!(
                    "{}: compute capability {maj}.{min} has no int8 mma.sync (8.0 on): the long \
                     passes use dequantized tiles",
                    kernels::MMQ_ENV
                );
            }
            ok
        };
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
            tf32: None,
            mmq8,
            mmq,
            profile: crate::profile::wanted(std::env::var(crate::profile::ENV).ok().as_deref())
                .then(KernelProfile::default),
        })
    }

    /// With the profile on: waits for the compute stream, then starts the clock of one call.
    fn profile_start(&self) -> Result<Option<Instant>, GpuError> {
        if self.profile.is_none() {
            return Ok(None);
        }
        self.compute.synchronize().map_err(cuda("profile"))?;
        Ok(Some(Instant::now()))
    }

    /// With the profile on: waits for the call started at `t0` and adds its time to `name`.
    fn profile_end(&mut self, name: &str, t0: Option<Instant>) -> Result<(), GpuError> {
        if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
            self.compute.synchronize().map_err(cuda(name))?;
            p.record(name, t0.elapsed());
        }
        Ok(())
    }

    fn f(&self, name: &str) -> Result<&CudaFunction, GpuError> {
        self.funcs
            .get(name)
            .ok_or_else(|| model_err(format!("no kernel {name}")))
    }
}

macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr, $($arg:expr),+) => {{
        let t0 = $gpu.profile_start()?;
        let f = $gpu.f($name)?;
        let mut b = $gpu.compute.launch_builder(f);
        $( b.arg(&$arg); )+
        // SAFETY: the argument list matches the kernel's signature in kernels/*.cu (the
        // forward module documents each), and every address is a live device buffer sized
        // as forward::Scratch / Pass document.
        unsafe { b.launch($cfg) }.map_err(cuda($name))?;
        $gpu.profile_end($name, t0)
    }};
}

impl Gpu {
    /// `{kind}_{suffix}` (`dequant` into f32, `dequant16` into f16) over `nblocks` blocks:
    /// one thread a block.
    fn launch_dequant(
        &mut self,
        kind: &str,
        suffix: &str,
        src: u64,
        dst: u64,
        nblocks: i32,
    ) -> Result<(), GpuError> {
        let c = cfg((cdiv(nblocks, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        let name = kernels::kernel_name(kind, suffix)
            .ok_or_else(|| model_err(format!("no {kind} kernel for {suffix}")))?;
        launch!(self, name, c, src, dst, nblocks)
    }
}

/// [`Device`] on the GPU: every call is an asynchronous launch on the compute stream.
impl Device for Gpu {
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
            self,
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
    fn quantize_q8(&mut self, x: u64, xq: u64, nblocks: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(nblocks, BLOCK_THREADS / 32), 1), (BLOCK_THREADS, 1));
        launch!(self, "quantize_q8", c, x, xq, nblocks)
    }
    fn matvec_q8(
        &mut self,
        suffix: &str,
        xq: u64,
        outs: &[Q8Out],
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let [a, b, c] = Q8Out::three(outs).map_err(model_err)?;
        let Mmq8Shape { warps, rows } = self.mmq8;
        let blocks: u32 = outs.iter().map(|o| cdiv(o.rows, rows)).sum();
        let cf = cfg((blocks, 1), (32, warps));
        let name = kernels::kernel_name("matvec_q8", suffix)
            .ok_or_else(|| model_err(format!("no int8 matvec kernel for {suffix}")))?;
        launch!(
            self, name, cf, xq, cols, ntok, a.w, a.y, a.rows, b.w, b.y, b.rows, c.w, c.y, c.rows
        )
    }
    fn offers_mmq(&self) -> bool {
        self.mmq
    }
    fn mmq(
        &mut self,
        suffix: &str,
        xq: u64,
        out: Q8Out,
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let c = cfg(
            (
                cdiv(out.rows, kernels::MMQ_ROWS),
                cdiv(ntok, kernels::MMQ_TOKENS),
            ),
            (32 * kernels::MMQ_WARPS, 1),
        );
        let name = kernels::kernel_name("mmq", suffix)
            .ok_or_else(|| model_err(format!("no int8 tensor-core kernel for {suffix}")))?;
        launch!(self, name, c, xq, cols, ntok, out.w, out.y, out.rows)
    }
    fn dequant(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError> {
        self.launch_dequant("dequant", suffix, src, dst, nblocks)
    }
    fn dequant16(
        &mut self,
        suffix: &str,
        src: u64,
        dst: u64,
        nblocks: i32,
    ) -> Result<(), GpuError> {
        self.launch_dequant("dequant16", suffix, src, dst, nblocks)
    }
    fn to_f16(&mut self, x: u64, dst: u64, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, "to_f16", c, x, dst, n)
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
        launch!(self, "rmsnorm", c, x, w, out, n, eps)
    }
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
    ) -> Result<(), GpuError> {
        let c = cfg((ntok as u32, 1), (BLOCK_THREADS, 1));
        let neox = neox as i32;
        launch!(self, "rope", c, x, cos, sin, n_heads, head_dim, half, neox, pos)
    }
    fn rmsnorm_q8(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        xq: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError> {
        let c = cfg((ntok as u32, 1), (BLOCK_THREADS, 1));
        launch!(self, "rmsnorm_q8", c, x, w, out, xq, n, eps)
    }
    fn rope_kv(
        &mut self,
        (q, k, v): (u64, u64, u64),
        (kc, vc): (u64, u64),
        rope: RopeArgs,
        heads: Heads,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError> {
        let c = cfg((ntok as u32, 1), (BLOCK_THREADS, 1));
        let (p, neox) = (*pages, rope.neox as i32);
        launch!(
            self,
            if p.f16 { "rope_kv_f16" } else { "rope_kv" },
            c,
            q,
            k,
            v,
            kc,
            vc,
            rope.cos,
            rope.sin,
            heads.n_heads,
            heads.n_kv_heads,
            heads.head_dim,
            rope.half,
            neox,
            p.pos,
            p.seq,
            p.tables,
            p.max_blocks,
            p.block,
            p.ring
        )
    }
    fn kv_store(
        &mut self,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        kv_dim: i32,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError> {
        let c = cfg((ntok as u32, 1), (BLOCK_THREADS, 1));
        let p = *pages;
        launch!(
            self,
            if p.f16 { "kv_store_f16" } else { "kv_store" },
            c,
            k,
            v,
            kc,
            vc,
            kv_dim,
            p.pos,
            p.seq,
            p.tables,
            p.max_blocks,
            p.block,
            p.ring
        )
    }
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
    ) -> Result<(), GpuError> {
        let c = cfg((heads.n_heads as u32, ntok as u32), (BLOCK_THREADS, 1));
        let p = *pages;
        launch!(
            self,
            if p.f16 { "attention_f16" } else { "attention" },
            c,
            q,
            kc,
            vc,
            att,
            out,
            heads.n_heads,
            heads.n_kv_heads,
            heads.head_dim,
            p.pos,
            p.seq,
            p.tables,
            p.max_blocks,
            p.block,
            p.ring,
            n_ctx,
            heads.scale,
            window,
            softcap,
            sinks
        )
    }
    fn gather_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError> {
        let c = cfg((nrows as u32, 1), (BLOCK_THREADS, 1));
        launch!(self, "gather_rows", c, dst, src, rows, n)
    }
    fn glu(&mut self, act: GluAct, gate: u64, up: u64, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, act.kernel(false), c, gate, up, n)
    }
    fn glu_q8(&mut self, act: GluAct, gate: u64, up: u64, xq: u64, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, act.kernel(true), c, gate, up, xq, n)
    }
    fn scatter_add_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError> {
        let c = cfg((nrows as u32, 1), (BLOCK_THREADS, 1));
        launch!(self, "scatter_add_rows", c, dst, src, rows, n, nrows)
    }
    fn add_rows(&mut self, y: u64, b: u64, n: i32, ntok: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n * ntok, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, "add_rows", c, y, b, n, ntok)
    }
    fn scale(&mut self, x: u64, s: f32, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, "scale_inplace", c, x, s, n)
    }
    fn softcap(&mut self, x: u64, cap: f32, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, "softcap_inplace", c, x, cap, n)
    }
    fn add(&mut self, y: u64, x: u64, n: i32) -> Result<(), GpuError> {
        let c = cfg((cdiv(n, BLOCK_THREADS), 1), (BLOCK_THREADS, 1));
        launch!(self, "add_inplace", c, y, x, n)
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: both ranges lie in live device buffers (KV cache and scratch).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.compute.cu_stream())
        }
        .map_err(cuda("device copy"))
    }
    fn zero(&mut self, dst: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: the range lies in a live device buffer (scratch).
        unsafe { cudarc::driver::result::memset_d8_async(dst, 0, bytes, self.compute.cu_stream()) }
            .map_err(cuda("device memset"))
    }
    fn download(&mut self, src: u64, dst: &mut [f32]) -> Result<(), GpuError> {
        // SAFETY: `src` holds `dst.len()` floats of a live scratch buffer; the stream is
        // synchronized before `dst` is read or can go away.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.compute.cu_stream()) }
            .map_err(cuda("device-to-host copy"))?;
        self.compute
            .synchronize()
            .map_err(cuda("device-to-host copy"))
    }
    fn upload_words(&mut self, dst: u64, src: &[u32]) -> Result<(), GpuError> {
        // SAFETY: `dst` has room for `src` (a scratch buffer sized for it, forward::Scratch).
        unsafe { self.upload(dst, src) }
    }
    fn gemm(
        &mut self,
        a: u64,
        b: u64,
        c: u64,
        dims: (i32, i32, i32),
        ldc: i32,
        inputs: GemmType,
    ) -> Result<bool, GpuError> {
        let t0 = self.profile_start()?;
        let done = self.gemm_call(a, b, c, dims, ldc, inputs)?;
        let name = match inputs {
            GemmType::F16 => "cublas_gemm_f16",
            GemmType::Tf32 => "cublas_gemm_tf32",
            GemmType::F32 => "cublas_gemm_f32",
        };
        self.profile_end(name, t0)?;
        Ok(done)
    }
}

impl Gpu {
    /// One cuBLAS GEMM (the body of [`Device::gemm`]).
    fn gemm_call(
        &mut self,
        a: u64,
        b: u64,
        c: u64,
        (m, n, k): (i32, i32, i32),
        ldc: i32,
        inputs: GemmType,
    ) -> Result<bool, GpuError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        if inputs == GemmType::F16 {
            use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
            // SAFETY: the handle is bound to the compute stream; a and b are device buffers of
            // k×m and k×n f16 (the tile dequant16 wrote, the activations to_f16 wrote), c
            // holds n columns of ldc ≥ m floats (forward::Pass::linears); alpha and beta are
            // f32 as CUBLAS_COMPUTE_32F requires.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast(),
                    a as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16F,
                    k,
                    b as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16F,
                    k,
                    (&beta as *const f32).cast(),
                    c as *mut std::ffi::c_void,
                    cudaDataType::CUDA_R_32F,
                    ldc,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(cuda("cuBLAS GemmEx (f16)"))?;
            return Ok(true);
        }
        let tf32 = inputs == GemmType::Tf32;
        if self.tf32 != Some(tf32) {
            let mode = if tf32 {
                // tensor cores for f32 GEMMs (Ampere and later; ignored before)
                cudarc::cublas::sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
            } else {
                cudarc::cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH
            };
            // SAFETY: the handle is alive (owned by self.blas); setting its math mode touches
            // no device memory.
            unsafe { cudarc::cublas::sys::cublasSetMathMode(*self.blas.handle(), mode) }
                .result()
                .map_err(cuda("cuBLAS math mode"))?;
            self.tf32 = Some(tf32);
        }
        // SAFETY: the handle is bound to the compute stream; a and b are device buffers of
        // k×m and k×n floats, c holds n columns of ldc ≥ m floats (forward::Pass::linears).
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
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
                ldc,
            )
        }
        .map_err(cuda("cuBLAS SGEMM"))?;
        Ok(true)
    }
}

/// Opens a layer file inside the model directory (no link followed) with `O_DIRECT`.
fn open_layer_file(dir: &Path, path: &Path) -> Result<File, GpuError> {
    let rel = path.strip_prefix(dir).unwrap_or(path).to_string_lossy();
    gds_io::open_in_dir(dir, &rel, libc::O_DIRECT).map_err(GpuError::Layer)
}

impl Loader {
    /// Opens the layer files of the model in `dir` (manifest `manifest`, layers `layers`
    /// in manifest order) for `load`.
    fn open(
        gpu: &Gpu,
        dir: &Path,
        manifest: &Manifest<'_>,
        layers: &[LayerMeta],
        load: LoadPath,
        verify: bool,
    ) -> Result<Loader, GpuError> {
        let max_layer = layers.iter().map(|l| l.size).max().unwrap_or(0);
        let verifier = Arc::new(gds_io::Verifier::new(if verify {
            gds_io::VerifyMode::Hash
        } else {
            gds_io::VerifyMode::Off
        }));
        match load {
            LoadPath::Gds => {
                // cuFile reads go straight to VRAM: check the files on the host first.
                gds_io::verify_layer_files(dir, manifest, &verifier).map_err(GpuError::Layer)?;
                let (user, driver) = CufileUser::open().map_err(cuda("cuFileDriverOpen"))?;
                let files = layers
                    .iter()
                    .map(|l| {
                        let f = crate::reopen_for_cufile(&open_layer_file(dir, &l.path)?, &l.path)?;
                        driver.register(f).map_err(|e| {
                            GpuError::Cuda(format!(
                                "cuFileHandleRegister of {}: {e:?} (cuFile could not take the \
                                 file; its log says why. On a VM whose disk has no udev data, \
                                 cuFile cannot classify the filesystem: /run/udev/data/\
                                 b<major>:<minor> needs E:ID_FS_USAGE=filesystem. \
                                 --io direct reads without cuFile)",
                                l.path.display()
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                // Flags 0x7: size, file offset and buffer offset are known when each read
                // is enqueued.
                driver
                    .stream_register(&gpu.copy, 0x7)
                    .map_err(cuda("cuFileStreamRegister"))?;
                Ok(Loader::Gds {
                    driver,
                    user: Some(user),
                    files,
                    pending: Default::default(),
                })
            }
            LoadPath::Bounce { direct } => {
                // Nothing resident on the host: every layer passes through two buffers of
                // the largest layer (plus alignment slack), one being read ahead.
                let source = DirectBackend::open(
                    dir,
                    manifest,
                    &DirectOptions {
                        resident: vec![false; layers.len()],
                        slots: 2,
                        slot_size: gds_io::align_up(max_layer as u64) as usize + 2 * gds_io::ALIGN,
                        force_buffered: !direct,
                        // `--io mmap`: the page cache is the RAM tier, streamed layers
                        // come from memory after their first read.
                        keep_cached: !direct,
                        verifier: Some(verifier),
                    },
                )
                .map_err(GpuError::Layer)?;
                // SAFETY: the pool's buffers live as long as `source`, which the loader drops
                // after the lock (field order), and nothing else locks them.
                let locked = unsafe { HostLock::new(&gpu.ctx, source.pool_buffers()) };
                let mut staging = Vec::new();
                if locked.is_err() {
                    for _ in 0..2 {
                        // SAFETY: the buffers are read only by copies issued after they are
                        // filled.
                        let p = unsafe { gpu.ctx.alloc_pinned::<u8>(max_layer.max(1)) }
                            .map_err(cuda("allocating pinned host memory"))?;
                        staging.push(p);
                    }
                }
                Ok(Loader::Bounce {
                    locked: locked.ok(),
                    staging,
                    in_flight: None,
                    source: Box::new(source),
                })
            }
        }
    }

    /// Reads layer `i` (whole file, `size` bytes) into `dst` through pinned buffer / pending
    /// read `slot`. `sync`: complete before returning (initial loads); otherwise the read is
    /// enqueued on the copy stream and the returned event marks it done.
    #[allow(clippy::too_many_arguments)]
    fn load(
        &mut self,
        gpu: &Gpu,
        path: &Path,
        i: usize,
        size: usize,
        dst: &mut CudaSlice<u8>,
        slot: usize,
        sync: bool,
    ) -> Result<Option<CudaEvent>, GpuError> {
        let short = |n: isize| {
            GpuError::Cuda(format!(
                "reading {}: got {n} bytes, expected {size}",
                path.display()
            ))
        };
        match self {
            Loader::Gds { files, pending, .. } if sync => {
                let mut view = dst.slice_mut(..size);
                let n = files[i]
                    .sync_read(0, &mut view)
                    .map_err(cuda("cuFileRead"))?;
                pending[slot].layer = None;
                if n != size as isize {
                    return Err(short(n));
                }
                Ok(None)
            }
            Loader::Gds { files, pending, .. } => {
                let p = &mut *pending[slot];
                *p = AsyncRead {
                    size,
                    layer: Some(i),
                    ..AsyncRead::default()
                };
                let ptr = addr(dst, &gpu.copy);
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
            Loader::Bounce {
                locked: Some(_),
                in_flight,
                source,
                ..
            } => {
                // the previous layer's streaming buffer goes back to the pool (for the next
                // read ahead) once its copy has read it
                if let Some((bytes, ev)) = in_flight.take() {
                    ev.synchronize().map_err(cuda("a host-to-device copy"))?;
                    drop(bytes);
                }
                let bytes = source.acquire(i).map_err(GpuError::Layer)?;
                if bytes.len() != size {
                    return Err(short(bytes.len() as isize));
                }
                let ptr = addr(dst, &gpu.copy);
                // SAFETY: the source is page-locked host memory (a pool buffer, `locked`) that
                // stays allocated and unwritten until the copy is done: its handle is held in
                // `in_flight` until the copy's event completes (or, `sync`, dropped after
                // it); the destination is a live device buffer of at least `size` bytes.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(ptr, &bytes[..], gpu.copy.cu_stream())
                }
                .map_err(cuda("host-to-device copy"))?;
                let done = gpu.copy.record_event(None).map_err(cuda("event"))?;
                if sync {
                    done.synchronize().map_err(cuda("loading a layer"))?;
                    return Ok(None);
                }
                *in_flight = Some((bytes, done));
                Ok(Some(gpu.copy.record_event(None).map_err(cuda("event"))?))
            }
            Loader::Bounce {
                staging, source, ..
            } => {
                let bytes = source.acquire(i).map_err(GpuError::Layer)?;
                if bytes.len() != size {
                    return Err(short(bytes.len() as isize));
                }
                let host = staging[slot]
                    .as_mut_slice()
                    .map_err(cuda("pinned buffer"))?;
                let buf = &mut host[..size];
                buf.copy_from_slice(&bytes);
                drop(bytes);
                let mut view = dst.slice_mut(..size);
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
    fn check(&mut self, slot: usize, paths: &[PathBuf]) -> Result<(), GpuError> {
        if let Loader::Gds { pending, .. } = self {
            let p = &mut *pending[slot];
            if let Some(i) = p.layer.take() {
                if p.bytes_read != p.size as isize {
                    return Err(GpuError::Cuda(format!(
                        "cuFileReadAsync of {}: {} bytes read, expected {}",
                        paths[i].display(),
                        p.bytes_read,
                        p.size
                    )));
                }
            }
        }
        Ok(())
    }
}

/// [`Vram`] on a CUDA device: buffers, loads (cuFile or bounce), the compute and copy
/// streams and the events that order them.
pub struct CudaVram {
    gpu: Gpu,
    loader: Loader,
    paths: Vec<PathBuf>,
    /// Every buffer, by device address (loads look their destination up here).
    bufs: Vec<(u64, CudaSlice<u8>)>,
    /// Indices into `bufs` of the buffers registered with cuFile (`--io gds`).
    registered: Vec<usize>,
    loaded: [Option<CudaEvent>; 2],
    computed: [Option<CudaEvent>; 2],
    /// Captured passes ([`Vram::capture_end`]), replayed on the compute stream.
    graphs: Vec<(GraphKey, OwnedGraph)>,
}

/// A CUDA graph owned by one [`CudaVram`].
struct OwnedGraph(CudaGraph);

// SAFETY: cudarc's `CudaGraph` is not `Send` because it holds raw `CUgraph`/`CUgraphExec`
// handles, which CUDA does not synchronize internally: calls on one graph must not run
// concurrently. Here a graph is reachable only through its `CudaVram` (`&mut self` for every
// launch), so moving the model to another thread (the server's engine thread) moves its
// graphs with it and their calls stay serialized; cudarc binds the context to the calling
// thread before each launch.
unsafe impl Send for OwnedGraph {}

/// The buffer of `bufs` that starts at device address `dst`.
fn find_buf(bufs: &mut [(u64, CudaSlice<u8>)], dst: u64) -> Result<&mut CudaSlice<u8>, GpuError> {
    bufs.iter_mut()
        .find(|(a, _)| *a == dst)
        .map(|(_, b)| b)
        .ok_or_else(|| model_err(format!("no device buffer at {dst:#x}")))
}

impl CudaVram {
    /// Copies `src` into the device buffer that starts at `dst` (blocking).
    fn upload_slice<T: cudarc::driver::DeviceRepr>(
        &mut self,
        dst: u64,
        src: &[T],
    ) -> Result<(), GpuError> {
        let buf = find_buf(&mut self.bufs, dst)?;
        if buf.len() < std::mem::size_of_val(src) {
            return Err(model_err("upload larger than its buffer"));
        }
        // SAFETY: `dst` is the start of a live device buffer at least as large as `src`
        // (checked above).
        unsafe { self.gpu.upload(dst, src) }
    }

    /// The path layers take into VRAM.
    pub fn path(&self) -> GpuPath {
        match self.loader {
            Loader::Gds { .. } => GpuPath::Gds,
            Loader::Bounce { .. } => GpuPath::Bounce,
        }
    }
}

impl Vram for CudaVram {
    fn kernels(&mut self) -> &mut dyn Device {
        &mut self.gpu
    }

    fn alloc(&mut self, bytes: usize, kind: BufKind) -> Result<u64, GpuError> {
        // Slots live on the copy stream, where their reads are enqueued.
        let stream = match kind {
            BufKind::Slot => &self.gpu.copy,
            BufKind::Layer | BufKind::Scratch => &self.gpu.compute,
        };
        let buf = stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(cuda("allocating VRAM"))?;
        // cuFile reads fastest into buffers registered once (cuFileBufRegister).
        if let (Loader::Gds { driver, .. }, BufKind::Slot | BufKind::Layer) = (&self.loader, kind) {
            driver
                .buf_register(&buf)
                .map_err(cuda("cuFileBufRegister"))?;
            self.registered.push(self.bufs.len());
        }
        let a = addr(&buf, stream);
        self.bufs.push((a, buf));
        Ok(a)
    }

    fn upload(&mut self, dst: u64, src: &[f32]) -> Result<(), GpuError> {
        self.upload_slice(dst, src)
    }

    fn upload_i32(&mut self, dst: u64, src: &[i32]) -> Result<(), GpuError> {
        self.upload_slice(dst, src)
    }

    fn ready(&mut self) -> Result<(), GpuError> {
        // Every allocation (and its zero fill) done before the first read lands.
        self.gpu.ctx.synchronize().map_err(cuda("allocations"))
    }

    fn load(
        &mut self,
        layer: usize,
        size: usize,
        dst: u64,
        slot: usize,
        sync: bool,
    ) -> Result<(), GpuError> {
        let path = self
            .paths
            .get(layer)
            .ok_or_else(|| model_err(format!("no layer {layer}")))?;
        let buf = find_buf(&mut self.bufs, dst)?;
        let ev = self
            .loader
            .load(&self.gpu, path, layer, size, buf, slot, sync)?;
        if !sync {
            self.loaded[slot] = ev;
        }
        Ok(())
    }

    fn prefetch(&mut self, layer: usize, size: usize) {
        self.loader.prefetch(layer, size);
    }

    fn wait_loaded(&mut self, slot: usize) -> Result<(), GpuError> {
        if let Some(ev) = &self.loaded[slot] {
            self.gpu
                .compute
                .wait(ev)
                .map_err(cuda("waiting for a layer"))?;
        }
        Ok(())
    }

    fn mark_computed(&mut self, slot: usize) -> Result<(), GpuError> {
        self.computed[slot] = Some(self.gpu.compute.record_event(None).map_err(cuda("event"))?);
        Ok(())
    }

    fn wait_computed(&mut self, slot: usize) -> Result<(), GpuError> {
        if let Some(ev) = &self.computed[slot] {
            ev.synchronize().map_err(cuda("waiting for a slot"))?;
        }
        self.loader.check(slot, &self.paths)
    }

    fn finish(
        &mut self,
        out: &mut [f32],
        src: u64,
        extra: Option<(&mut [f32], u64)>,
    ) -> Result<(), GpuError> {
        let st = &self.gpu.compute;
        for (out, src) in std::iter::once((out, src)).chain(extra) {
            if out.is_empty() {
                continue;
            }
            // SAFETY: the buffer at `src` (the logit rows, or the hidden-state rows of the
            // `xb` scratch) holds at least `out.len()` floats (Streamer::forward_batch_hidden
            // checks both against the pass); the stream is synchronized before `out` is read.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, st.cu_stream()) }
                .map_err(cuda("copying logits"))?;
        }
        st.synchronize().map_err(cuda("forward"))?;
        self.gpu.copy.synchronize().map_err(cuda("copy stream"))?;
        for slot in 0..2 {
            self.loader.check(slot, &self.paths)?;
        }
        Ok(())
    }

    fn io_stats(&self) -> Option<gds_io::IoStats> {
        match &self.loader {
            Loader::Bounce { source, .. } => Some(source.stats()),
            Loader::Gds { .. } => None,
        }
    }

    fn replay(&mut self, key: GraphKey) -> Result<bool, GpuError> {
        match self.graphs.iter().find(|(k, _)| *k == key) {
            Some((_, g)) => {
                g.0.launch().map_err(cuda("launching a CUDA graph"))?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn capture_begin(&mut self) -> Result<bool, GpuError> {
        if self.graphs.len() >= MAX_GRAPHS {
            return Ok(false);
        }
        // Thread-local: only this thread's calls must be capture-safe (the read-ahead
        // threads make no CUDA calls; nothing streams while capturing anyway).
        self.gpu
            .compute
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("beginning a CUDA graph capture"))?;
        Ok(true)
    }

    fn capture_end(&mut self, key: GraphKey, keep: bool) -> Result<(), GpuError> {
        let graph = self
            .gpu
            .compute
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(cuda("ending a CUDA graph capture"))?;
        match graph {
            Some(g) if keep => {
                // nothing captured has run yet
                g.launch().map_err(cuda("launching a CUDA graph"))?;
                self.graphs.push((key, OwnedGraph(g)));
            }
            _ => {}
        }
        Ok(())
    }
}

impl Drop for CudaVram {
    fn drop(&mut self) {
        // Buffers are freed after this; nothing may still be using them. An error here has
        // nowhere to go.
        let _ = self.gpu.ctx.synchronize();
        if let Some(p) = self.gpu.profile.as_ref().filter(|p| !p.is_empty()) {
            eprint!("{}", p.report());
        }
        if let Loader::Gds {
            driver,
            user,
            files,
            ..
        } = &mut self.loader
        {
            // Left to itself, libcufile tears down at process exit, after the CUDA context is
            // gone: on an H200 (compatibility mode) compute-sanitizer reported two failed
            // cuMemFree_v2 and a cuStreamSynchronize on a destroyed context, and one run
            // segfaulted inside libcuda at exit (six later ones did not). Undo every
            // registration and close the driver here, while the context, the copy stream and
            // the buffers are alive.
            for &i in &self.registered {
                let _ = driver.buf_deregister(&self.bufs[i].1);
            }
            let _ = driver.stream_deregister(&self.gpu.copy);
            // cudarc's FileHandle deregisters in its Drop and panics if that fails: a failed
            // deregistration must not turn the model's drop into a panic.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| files.clear()));
            *user = None; // the last user closes the driver
        }
    }
}

/// The process's cuFile driver (process-wide in libcufile): how many [`CufileUser`]s hold it,
/// and the handle they share while any does. The first user opens it, the last one closes it
/// (a later user opens it again).
static CUFILE: Mutex<(usize, Option<Arc<Cufile>>)> = Mutex::new((0, None));

/// One holder of the cuFile driver: a model loading with `--io gds` (its drop closes the
/// driver with the last user while the CUDA context is still alive: left open, libcufile
/// tears down after the context, see `CudaVram`'s drop), a `device_bytes` read, a
/// `CufileSession`.
pub(crate) struct CufileUser;

impl CufileUser {
    /// Counts one more user, opening the driver (`cuFileDriverOpen`) if it has none; returns
    /// the shared handle to register files with.
    pub(crate) fn open() -> Result<(CufileUser, Arc<Cufile>), cudarc::cufile::CufileError> {
        let mut st = CUFILE.lock().unwrap_or_else(|e| e.into_inner());
        let driver = match &st.1 {
            Some(d) => d.clone(),
            None => {
                let d = Cufile::new()?;
                st.1 = Some(d.clone());
                d
            }
        };
        st.0 += 1;
        Ok((CufileUser, driver))
    }
}

impl Drop for CufileUser {
    fn drop(&mut self) {
        let mut st = CUFILE.lock().unwrap_or_else(|e| e.into_inner());
        st.0 -= 1;
        if st.0 == 0 {
            st.1 = None;
            let _ = cudarc::cufile::result::driver_close();
        }
    }
}

/// A model loaded for the GPU.
pub type GpuModel = Streamer<CudaVram>;

impl Streamer<CudaVram> {
    /// Opens `dir` (a GdsLLM model directory, its manifest `manifest` read and checked by
    /// the caller, laid out as `layout`) on the GPU: compiles the kernels, plans VRAM within
    /// `opts.vram_budget`, and loads the resident layers; `graph` is what each block runs.
    pub fn open(
        dir: &Path,
        manifest: &Manifest<'_>,
        layout: Layout,
        opts: &ExecOptions,
        graph: Box<dyn crate::forward::BlockGraph>,
    ) -> Result<GpuModel, GpuError> {
        let gpu = Gpu::open(opts.device, opts.load)?;
        // a profiled run times every launch on its own: nothing is captured in graphs
        let graphs = opts.graphs && gpu.profile.is_none();
        let loader = Loader::open(&gpu, dir, manifest, &layout.layers, opts.load, opts.verify)?;
        let vram = CudaVram {
            gpu,
            loader,
            paths: layout.layers.iter().map(|l| l.path.clone()).collect(),
            bufs: Vec::new(),
            registered: Vec::new(),
            loaded: [None, None],
            computed: [None, None],
            graphs: Vec::new(),
        };
        let stream_opts = StreamOptions {
            vram_budget: opts.vram_budget,
            ctx: opts.ctx,
            rope: opts.rope.clone(),
            max_batch: opts.max_batch,
            kv: opts.kv.clone(),
            max_outputs: opts.max_outputs,
            q8_activations: opts.q8_activations,
            gemm_min_tokens: opts.gemm_min_tokens,
            gemm: opts.gemm,
            graphs,
            fuse: crate::stream::fuse_wanted(
                std::env::var(crate::stream::FUSE_ENV).ok().as_deref(),
            ),
        };
        Streamer::with_layout(layout, &stream_opts, vram, graph)
    }

    /// The path this model loads layers by.
    pub fn path(&self) -> GpuPath {
        self.vram().path()
    }
}
