//! `just bench-gpu MODEL_DIR`: layer-load bandwidth into VRAM (cuFile vs pinned bounce
//! buffers) and greedy decode tokens/s at several VRAM budgets, each against its bound
//! (load bandwidth ÷ bytes streamed per token). Needs an NVIDIA GPU; exits 2 without one.
//! Never run on real hardware yet.

use gds_cuda::executor::{ExecOptions, GpuModel, LoadPath};
use gds_cuda::plan::Layout;
use gds_cuda::{probe, GpuPath};
use gds_runtime::cuda_graph::CudaGraph;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: bench_gpu MODEL_DIR [TOKENS] [CTX]");
        return ExitCode::from(2);
    };
    let tokens: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let ctx: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(512);
    let report = probe();
    for l in report.lines() {
        println!("# {l}");
    }
    if let Some(why) = report.unusable_reason() {
        eprintln!("bench-gpu needs a usable CUDA GPU: {why}");
        return ExitCode::from(2);
    }
    match run(&dir, tokens, ctx, &report) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-gpu: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    dir: &std::path::Path,
    tokens: usize,
    ctx: usize,
    report: &gds_cuda::GpuReport,
) -> Result<(), Box<dyn std::error::Error>> {
    let layout = Layout::read(dir)?;
    let plan = layout.plan(ctx, gds_cuda::plan::MAX_BATCH, usize::MAX)?;
    let (min, all) = (plan.min_budget, plan.all_resident_budget);
    let opts = |load, budget: usize| ExecOptions {
        device: 0,
        load,
        vram_budget: budget as u64,
        ctx,
        rope: Vec::new(),
        verify: true,
        max_batch: gds_cuda::plan::MAX_BATCH,
        kv: None,
        max_outputs: None,
        q8_activations: true,
        gemm_min_tokens: gds_cuda::forward::GEMM_MIN_TOKENS,
        gemm: gds_cuda::forward::GemmType::F16,
        graphs: true,
    };
    // The model's graph and RoPE tables (gds-runtime's, as `gdsrun --backend cuda` opens it).
    let open = |opts: ExecOptions| -> Result<GpuModel, Box<dyn std::error::Error>> {
        let (graph, rope) = CudaGraph::open(dir, ctx)?;
        let bytes = gds_io::read_manifest(dir)?;
        let m = gds_format::Manifest::parse(&bytes)?;
        let layout = Layout::from_manifest(dir, &m)?;
        let opts = ExecOptions { rope, ..opts };
        Ok(GpuModel::open(dir, &m, layout, &opts, Box::new(graph))?)
    };

    println!(
        "\n## load bandwidth (every layer resident, {:.1} MiB of weights)",
        plan.resident_bytes as f64 / 1048576.0
    );
    let mut loads = vec![
        (
            "bounce (pinned, O_DIRECT)",
            LoadPath::Bounce { direct: true },
        ),
        (
            "bounce (pinned, page cache)",
            LoadPath::Bounce { direct: false },
        ),
    ];
    // cuFile runs without nvidia-fs too, in its compatibility mode (through host memory):
    // measured all the same, and named for what it is.
    if report.cufile.present {
        let name = if report.path == GpuPath::Gds {
            "gds (cuFile → VRAM)"
        } else {
            "cuFile compat (via host)"
        };
        loads.insert(0, (name, LoadPath::Gds));
    }
    let mut best_bw: f64 = 0.0;
    let mut best_path = LoadPath::Bounce { direct: true };
    for (name, load) in &loads {
        let m = match open(opts(*load, all)) {
            Ok(m) => m,
            Err(e) => {
                println!("{name:30} failed: {e}");
                continue;
            }
        };
        let bw = m.stats.bytes as f64 / m.stats.seconds.max(1e-9);
        println!(
            "{name:30} {:8.2} GB/s  ({} bytes in {:.3} s)",
            bw / 1e9,
            m.stats.bytes,
            m.stats.seconds
        );
        if bw > best_bw {
            best_bw = bw;
            best_path = *load;
        }
    }

    println!("\n## decode ({tokens} tokens, greedy) at VRAM budgets, path {best_path:?}");
    println!(
        "{:>12} {:>14} {:>10} {:>12} {:>8}",
        "budget MiB", "streamed/tok", "t/s", "bound t/s", "ratio"
    );
    for frac in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let budget = min + ((all - min) as f64 * frac) as usize;
        let mut m = open(opts(best_path, budget))?;
        let mut logits = vec![0f32; m.layout().shape.vocab];
        m.forward(&mut logits, &[1], 0)?;
        let t0 = Instant::now();
        let (load0_bytes, load0_s) = (m.stats.bytes, m.stats.seconds);
        let steps = tokens.min(ctx - 1);
        for pos in 1..=steps {
            let tok = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap_or(0);
            m.forward(&mut logits, &[tok], pos)?;
        }
        let tps = steps as f64 / t0.elapsed().as_secs_f64();
        let streamed = m.plan.streamed_bytes_per_token;
        let stream_bw =
            (m.stats.bytes - load0_bytes) as f64 / (m.stats.seconds - load0_s).max(1e-9);
        let bw = if streamed > 0 { stream_bw } else { best_bw };
        let bound = if streamed > 0 {
            bw / streamed as f64
        } else {
            f64::INFINITY
        };
        println!(
            "{:>12} {:>12.1}Mi {:>10.1} {:>12.1} {:>8.2}",
            budget >> 20,
            streamed as f64 / 1048576.0,
            tps,
            bound,
            if bound.is_finite() {
                tps / bound
            } else {
                f64::NAN
            }
        );
    }
    Ok(())
}
