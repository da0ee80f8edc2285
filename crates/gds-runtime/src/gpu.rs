//! The CUDA executor (feature `cuda`): `gds_cuda::executor::GpuModel` behind
//! [`Executor`], following the plan's [`GpuPlan`](crate::gpuplan::GpuPlan). Its KV cache
//! and activations live in VRAM; logits come back to the host for the sampler.
//!
//! Each block runs the architecture's graph ([`crate::cuda_graph::CudaGraph`]: the same
//! `graph/<arch>.rs` as the CPU, over the CUDA kernels).
//!
//! **Not yet run on a GPU**: the development machines have none. It compiles in CI under
//! `--features cuda`; the pass it launches is tested on the CPU with the same kernels
//! (crates/gds-cuda/tests: forward_emu.rs, and executor_emu.rs for every architecture).

use crate::config::Config;
use crate::cuda_graph::{gpu_error, PassStaging, StreamerBatch};
use crate::cuda_graph::{rope_tables, CudaGraph};
use crate::error::{Result, RuntimeError};
use crate::exec::{logit_passes, Executor};
use crate::gpuplan::GpuLoad;
use crate::kv::KvCache;
use crate::plan::Plan;
use gds_cuda::executor::{ExecOptions, GpuModel, LoadPath};
use gds_io::IoStats;
use std::ops::Range;

/// [`Executor`] on the GPU.
pub struct GpuExecutor {
    model: GpuModel,
    config: Config,
    /// The last position's logits reported.
    logits: Vec<f32>,
    /// A pass's logit rows.
    rows: Vec<f32>,
}

/// Opens the plan's model on the GPU the plan was made for, for passes of up to `batch`
/// tokens, over a KV cache of one sequence (`kv` `None`) or paged as `kv` says, with up to
/// `outputs` logit rows a pass (`None`: up to 16).
fn open_gpu_model(
    plan: &Plan,
    batch: usize,
    kv: Option<gds_cuda::plan::KvSpec>,
    outputs: Option<usize>,
) -> Result<GpuModel> {
    let g = plan.gpu.as_ref().ok_or_else(|| {
        RuntimeError::Internal("the plan has no GPU section (backend is not cuda)".into())
    })?;
    let c = &plan.model;
    let dir = &plan.model_dir;
    let bytes = gds_io::read_manifest(dir)?;
    let m = crate::plan::parse_manifest(dir, &bytes)?;
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
        kv,
        max_outputs: outputs,
    };
    GpuModel::open(dir, &m, layout, &opts, Box::new(graph)).map_err(gpu_error)
}

impl GpuExecutor {
    /// Opens the plan's model on the GPU the plan was made for.
    pub fn open(plan: &Plan) -> Result<GpuExecutor> {
        let model = open_gpu_model(plan, gds_cuda::plan::MAX_BATCH, None, None)?;
        let c = &plan.model;
        Ok(GpuExecutor {
            logits: vec![0.0; c.vocab_size],
            rows: vec![0.0; model.logit_rows() * c.vocab_size],
            config: c.clone(),
            model,
        })
    }
}

impl Executor for GpuExecutor {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn config(&self) -> &Config {
        &self.config
    }

    /// A GPU pass returns logits for its last positions only (up to its logit rows):
    /// the passes follow [`logit_passes`].
    fn eval(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        want: Range<usize>,
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        let (max_tokens, max_rows) = (self.model.max_tokens(), self.model.logit_rows());
        for (pos, n, rows) in logit_passes(pos0, tokens.len(), &want, max_tokens, max_rows) {
            let chunk = &tokens[pos - pos0..pos - pos0 + n];
            let out = &mut self.rows[..rows * vocab];
            self.model.forward(out, chunk, pos).map_err(gpu_error)?;
            for (i, row) in out.chunks_exact(vocab).enumerate() {
                on_logits(pos + n - rows + i, row);
            }
            if let Some(last) = out.chunks_exact(vocab).last() {
                self.logits.copy_from_slice(last);
            }
        }
        Ok(())
    }

    fn can_truncate(&self, len: usize, keep: usize) -> bool {
        self.model.can_truncate(len, keep)
    }

    fn last_logits_mut(&mut self) -> &mut [f32] {
        &mut self.logits
    }

    fn io_stats(&self) -> IoStats {
        self.model.io_stats()
    }
}

/// The GPU's [`BatchExecutor`](crate::exec::BatchExecutor): the server's passes (several
/// sequences at their positions) on the CUDA executor, whose KV rows live in VRAM laid out as
/// the scheduler's [`KvCache`] pages them (its rows dropped on the host: the cache keeps the
/// block tables and pools). Layers that do not fit the VRAM budget stream through the slots
/// once per pass for the whole batch.
pub type GpuBatchExecutor = StreamerBatch<gds_cuda::executor::CudaVram>;

/// Opens the plan's model on the GPU for passes of up to `batch` tokens, `outputs` of them
/// with logits, over the rows of `kv` (which must be f32; its host rows are dropped).
pub fn open_batch(
    plan: &Plan,
    kv: &mut KvCache,
    batch: usize,
    outputs: usize,
) -> Result<GpuBatchExecutor> {
    if kv.dtype() != crate::kv::KvDtype::F32 {
        return Err(RuntimeError::Usage(
            "--kv-dtype f16: the CUDA backend's KV cache is f32 (use --kv-dtype f32)".into(),
        ));
    }
    let staging = PassStaging::new(kv)?;
    let model = open_gpu_model(plan, batch, Some(staging.spec().clone()), Some(outputs))?;
    kv.drop_rows();
    Ok(StreamerBatch::new(
        model,
        plan.model.clone(),
        staging,
        outputs,
    ))
}
