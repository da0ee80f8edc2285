//! The GPU half of the plan (`--backend cuda`): how layer bytes reach VRAM and which
//! layers stay there, decided once from the model's layout, the I/O request, the VRAM
//! budget and what the probe found. Pure: it reads the manifest, never the GPU, so it is
//! tested on machines without one.
//!
//! Policy (`gds_cuda::plan`): embedding, head, KV cache and scratch always resident; blocks
//! resident in order while the budget lasts; the rest streamed every token through two
//! slots of the largest block, the next block's read overlapping the current block's
//! compute.

use crate::error::{Result, RuntimeError};
use crate::kv::{KvCache, KvDtype, Tables};
use gds_cuda::plan::{KvGeo, KvSpec, Layout};
use gds_format::Manifest;
use serde::Serialize;
use std::path::Path;

/// Share of the device's memory the default VRAM budget takes (the rest is left to the
/// CUDA context, cuBLAS's workspace and other processes).
pub const DEFAULT_VRAM_SHARE: f64 = 0.9;

/// What the device offers the GPU plan (from `gds_cuda::probe()`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuOffer {
    /// Device name.
    pub device: String,
    /// Device memory, bytes.
    pub vram_bytes: u64,
    /// `Ok`: GPUDirect Storage works here; `Err`: why not.
    pub gds: std::result::Result<(), String>,
    /// libcufile is present but the nvidia-fs module is not: cuFile can still run, in its
    /// compatibility mode (libcufile reads through its own host buffers), when `--io gds`
    /// asks for it explicitly. `auto` never picks that: it is a bounce through RAM too.
    pub cufile_compat: bool,
}

/// How layer bytes reach VRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuLoad {
    /// cuFile straight into VRAM.
    Gds,
    /// O_DIRECT reads into pinned host memory, then async copies.
    BounceDirect,
    /// Page-cache reads into pinned host memory, then async copies.
    BounceBuffered,
}

impl GpuLoad {
    /// The name in plans and metrics: `gds`, `bounce-direct`, `bounce-buffered`.
    pub fn name(self) -> &'static str {
        match self {
            GpuLoad::Gds => "gds",
            GpuLoad::BounceDirect => "bounce-direct",
            GpuLoad::BounceBuffered => "bounce-buffered",
        }
    }
}

/// How layer bytes reach VRAM, and where every layer lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuPlan {
    /// The device.
    pub device: String,
    /// The load path.
    pub load: GpuLoad,
    /// Why that load path.
    pub load_reason: String,
    /// VRAM the executor may use, bytes.
    pub vram_budget_bytes: u64,
    /// Layers (manifest order) resident in VRAM for the whole run.
    pub resident_layers: Vec<usize>,
    /// Layers read from storage for every token.
    pub streamed_layers: Vec<usize>,
    /// Bytes of each of the two streaming slots (0: nothing streamed).
    pub slot_bytes: u64,
    /// Bytes of resident weights.
    pub resident_bytes: u64,
    /// Bytes read from storage per token.
    pub streamed_bytes_per_token: u64,
    /// Smallest budget that runs.
    pub min_budget_bytes: u64,
    /// Budget at which every layer is resident.
    pub all_resident_budget_bytes: u64,
    /// Bytes of the KV cache in VRAM (sliding-window blocks keep a ring).
    pub kv_bytes: u64,
    /// Its element type (`f16` or `f32`, `--kv-type`).
    pub kv_type: KvDtype,
    /// Rows each sliding-window block's ring holds (`None`: no block keeps a ring).
    pub kv_window_ring_positions: Option<usize>,
}

impl GpuPlan {
    /// VRAM held for weights: resident layers plus the streaming slots.
    pub fn weights_held_bytes(&self) -> u64 {
        self.resident_bytes + 2 * self.slot_bytes
    }
}

/// The VRAM layout of `kv`'s rows as the GPU executor holds them, and the kinds of block
/// tables its layers read (one [`KvSpec`] table per kind, in that order).
pub fn kv_spec(kv: &KvCache) -> Result<(KvSpec, Vec<Tables>)> {
    let mut kinds: Vec<Tables> = Vec::new();
    let mut max_blocks = Vec::new();
    let mut layers = Vec::new();
    for l in 0..kv.n_layers() {
        let p = kv
            .paging(l)
            .ok_or_else(|| RuntimeError::Internal(format!("KV cache has no layer {l}")))?;
        let table = match kinds.iter().position(|&k| k == p.tables) {
            Some(t) => t,
            None => {
                kinds.push(p.tables);
                max_blocks.push(match p.ring {
                    0 => kv.ctx().div_ceil(p.block),
                    r => r,
                });
                kinds.len() - 1
            }
        };
        layers.push(KvGeo {
            block: p.block,
            blocks: p.blocks,
            ring: p.ring,
            table,
        });
    }
    let spec = KvSpec {
        layers,
        max_blocks,
        max_seqs: kv.n_seqs(),
        f16: kv.dtype() == KvDtype::F16,
    };
    Ok((spec, kinds))
}

/// The block tables (no rows: they live in VRAM, `dtype` elements) of the GPU's
/// one-sequence cache of `ctx` positions, `windows[l]` the window of layer `l`: the whole
/// context per layer, or a ring for window layers as on the CPU
/// ([`KvCache::with_window_ring`]), for passes of up to `batch` positions.
pub fn one_sequence_kv(
    dtype: KvDtype,
    ctx: usize,
    kv_dim: usize,
    windows: &[Option<usize>],
    batch: usize,
) -> KvCache {
    KvCache::window_ring_tables(dtype, 1, ctx, kv_dim, windows, batch)
}

/// What a run asks of the GPU plan.
#[derive(Clone, Copy, Debug)]
pub struct GpuAsk<'a> {
    /// Context length (KV cache positions).
    pub ctx: usize,
    /// The user's `--io`: `auto`, `gds`, `direct`, `mmap`.
    pub io: &'a str,
    /// The user's `--vram-budget` (`None`: [`DEFAULT_VRAM_SHARE`] of the device).
    pub vram_budget: Option<u64>,
    /// The KV cache's element type (`--kv-type`).
    pub kv: KvDtype,
}

/// Plans the GPU side for the model in `dir` (manifest `m`) as `ask` asks, on the device
/// `offer` describes; `direct`: whether the layer files' filesystem supports `O_DIRECT`.
pub fn plan_gpu(
    dir: &Path,
    m: &Manifest<'_>,
    ask: &GpuAsk<'_>,
    offer: &GpuOffer,
    direct: bool,
) -> Result<GpuPlan> {
    let GpuAsk {
        ctx,
        io,
        vram_budget,
        kv: kv_type,
    } = *ask;
    let err = |s: String| Err(RuntimeError::Usage(s));
    let bounce = |direct: bool, why: String| {
        let load = if direct {
            GpuLoad::BounceDirect
        } else {
            GpuLoad::BounceBuffered
        };
        (load, why)
    };
    let (load, load_reason) = match (io, &offer.gds) {
        ("gds", Ok(())) => (GpuLoad::Gds, "requested with --io gds".to_string()),
        ("gds", Err(_)) if offer.cufile_compat => (
            GpuLoad::Gds,
            "requested with --io gds; nvidia-fs is not loaded, so cuFile runs in compatibility mode: libcufile reads through its own host buffers, the weights do pass through RAM".to_string(),
        ),
        ("gds", Err(why)) => return Err(RuntimeError::Backend(format!("--io gds: GPUDirect Storage is not usable here: {why} (use --io direct for pinned bounce buffers)"))),
        ("auto", Ok(())) => (GpuLoad::Gds, "auto: GPUDirect Storage is usable".into()),
        ("auto", Err(why)) => bounce(
            direct,
            format!(
                "auto: no GPUDirect Storage ({why}); {} into pinned host buffers, then async copies",
                if direct { "O_DIRECT reads" } else { "page-cache reads (the filesystem refuses O_DIRECT)" }
            ),
        ),
        ("direct", _) if !direct => {
            return err("--io direct: the layer files' filesystem does not support O_DIRECT (use --io mmap)".into())
        }
        ("direct", _) => bounce(true, "requested with --io direct: O_DIRECT into pinned host buffers, then async copies".into()),
        ("mmap", _) => bounce(false, "requested with --io mmap: page-cache reads (the pages stay cached: host RAM holds streamed layers after their first read) into pinned host buffers, then async copies".into()),
        ("load", _) => return err("--io load reads the weights into host memory for the CPU backend; with --backend cuda use auto, gds, direct or mmap".into()),
        (other, _) => return err(format!("--io {other}: expected auto, mmap, direct or gds")),
    };
    let budget = match vram_budget {
        Some(0) => return err("--vram-budget must be positive".into()),
        Some(b) if b > offer.vram_bytes => {
            return err(format!(
                "--vram-budget {} MiB is more than {} has ({} MiB)",
                b >> 20,
                offer.device,
                offer.vram_bytes >> 20
            ))
        }
        Some(b) => b,
        None => (offer.vram_bytes as f64 * DEFAULT_VRAM_SHARE) as u64,
    };
    let layout = Layout::from_manifest(dir, m)
        .map_err(|e| RuntimeError::Model(format!("{}: {e}", dir.display())))?;
    // the cache the one-sequence executor opens (crate::exec::gpu::open_one), its VRAM layout as
    // the executor derives it
    let batch = Layout::batch(ctx, gds_cuda::plan::MAX_BATCH);
    let windows: Vec<Option<usize>> = (0..layout.shape.n_layers)
        .map(|b| layout.shape.windows.get(b).copied().filter(|&w| w > 0))
        .collect();
    let kv = one_sequence_kv(kv_type, ctx, layout.kv_dim(), &windows, batch);
    let (spec, _) = kv_spec(&kv)?;
    let overhead = layout.overhead_bytes_with(ctx, batch, Layout::logit_rows(batch), &spec);
    let p = layout
        .plan_with(overhead, budget as usize)
        .map_err(|e| RuntimeError::Usage(format!("--vram-budget: {e}")))?;
    let (resident, streamed): (Vec<usize>, Vec<usize>) =
        (0..p.resident.len()).partition(|&l| p.resident[l]);
    Ok(GpuPlan {
        device: offer.device.clone(),
        load,
        load_reason,
        vram_budget_bytes: budget,
        resident_layers: resident,
        streamed_layers: streamed,
        slot_bytes: p.slot_bytes as u64,
        resident_bytes: p.resident_bytes,
        streamed_bytes_per_token: p.streamed_bytes_per_token,
        min_budget_bytes: p.min_budget as u64,
        all_resident_budget_bytes: p.all_resident_budget as u64,
        kv_bytes: spec.bytes(layout.kv_dim()) as u64,
        kv_type,
        kv_window_ring_positions: kv.ring_positions(),
    })
}
