//! The CUDA executor (feature `cuda`): `gds_cuda::executor::GpuModel` behind
//! [`BatchExecutor`](crate::exec::BatchExecutor), following the plan's
//! [`GpuPlan`](crate::gpuplan::GpuPlan). Its KV rows and activations live in VRAM, laid out
//! as a [`KvCache`]'s block tables say; logits come back to the host for the sampler. The
//! server drives it over its paged cache ([`open_batch`]); the CLI, bench and perplexity over
//! a cache of one sequence ([`open_one`]).
//!
//! Each block runs the architecture's graph ([`crate::exec::cuda_graph::CudaGraph`]: the same
//! `graph/<arch>.rs` as the CPU, over the CUDA kernels).
//!
//! Tested on the CPU with the same kernels (crates/gds-cuda/tests: forward_emu.rs,
//! executor_emu.rs); run on a GPU as docs/gpu.md records.

use crate::error::{Result, RuntimeError};
use crate::exec::cuda_graph::{gpu_error, PassStaging, StreamerBatch};
use crate::exec::cuda_graph::{rope_tables, CudaGraph};
use crate::exec::OneSequence;
use crate::gpuplan::GpuLoad;
use crate::kv::KvCache;
use crate::plan::Plan;
use gds_cuda::executor::{ExecOptions, GpuModel, LoadPath};

/// Opens the plan's model on the GPU the plan was made for, for passes of up to `batch`
/// tokens, over a KV cache laid out as `kv` says, with up to `outputs` logit rows a pass.
fn open_gpu_model(
    plan: &Plan,
    batch: usize,
    kv: &gds_cuda::plan::KvSpec,
    outputs: usize,
) -> Result<GpuModel> {
    let g = plan.gpu.as_ref().ok_or_else(|| {
        RuntimeError::Internal("the plan has no GPU section (backend is not cuda)".into())
    })?;
    let c = &plan.model;
    let dir = &plan.model_dir;
    let bytes = gds_io::read_manifest(dir)?;
    let m = crate::model_dir::parse_manifest(dir, &bytes)?;
    let layout = gds_cuda::plan::Layout::from_manifest(dir, &m).map_err(gpu_error)?;
    let rope = rope_tables(dir, &m, c, plan.ctx)?;
    let graph = CudaGraph::new(c, &layout, rope.len())?;
    let load = match g.load {
        GpuLoad::Gds => LoadPath::Gds,
        GpuLoad::BounceDirect => LoadPath::Bounce { direct: true },
        GpuLoad::BounceBuffered => LoadPath::Bounce { direct: false },
    };
    let opts = ExecOptions {
        device: 0,
        load,
        vram_budget: g.vram_budget_bytes,
        ctx: plan.ctx,
        rope,
        verify: plan.io_plan.verify,
        max_batch: batch,
        kv: Some(kv.clone()),
        max_outputs: Some(outputs),
        q8_activations: plan.activations == crate::plan::Activations::Q8,
        gemm_min_tokens: plan.gemm_min_tokens,
        gemm: plan.gemm_type,
        graphs: plan.cuda_graphs,
    };
    GpuModel::open(dir, &m, layout, &opts, Box::new(graph)).map_err(gpu_error)
}

/// Opens the plan's model on the GPU for one sequence (the CLI, bench, perplexity, drafts):
/// passes of up to [`gds_cuda::plan::MAX_BATCH`] positions, up to `outputs` of them with
/// logits, over the cache [`crate::gpuplan::plan_gpu`] planned the VRAM for
/// ([`crate::exec::cuda_graph::one_sequence`]).
/// (Its cache holds the plan's `--kv-type`.)
pub fn open_one(plan: &Plan, outputs: usize) -> Result<OneSequence> {
    crate::exec::cuda_graph::one_sequence(
        &plan.model,
        plan.kv_dtype,
        plan.ctx,
        gds_cuda::plan::MAX_BATCH,
        outputs,
        |spec, batch, outputs| open_gpu_model(plan, batch, spec, outputs),
    )
}

/// The GPU's [`BatchExecutor`](crate::exec::BatchExecutor): the server's passes (several
/// sequences at their positions) on the CUDA executor, whose KV rows live in VRAM laid out as
/// the scheduler's [`KvCache`] pages them (its rows dropped on the host: the cache keeps the
/// block tables and pools). Layers that do not fit the VRAM budget stream through the slots
/// once per pass for the whole batch.
pub type GpuBatchExecutor = StreamerBatch<gds_cuda::executor::CudaVram>;

/// Opens the plan's model on the GPU for passes of up to `batch` tokens, `outputs` of them
/// with logits, over the rows of `kv` (laid out in VRAM in its element type; its host rows
/// are dropped).
pub fn open_batch(
    plan: &Plan,
    kv: &mut KvCache,
    batch: usize,
    outputs: usize,
) -> Result<GpuBatchExecutor> {
    let staging = PassStaging::new(kv)?;
    let model = open_gpu_model(plan, batch, staging.spec(), outputs)?;
    kv.drop_rows();
    Ok(StreamerBatch::new(
        model,
        plan.model.clone(),
        staging,
        outputs,
    ))
}
