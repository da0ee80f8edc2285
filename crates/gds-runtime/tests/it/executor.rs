//! The executor seam and the GPU half of the plan, on a machine without a GPU.
//!
//! - The CPU executor splits long inputs into passes itself and reports exactly the
//!   positions asked for, with the logits of one whole-prompt pass.
//! - The VRAM plan for `--backend cuda` (load path, residency, streaming slots, refusals)
//!   is made from the manifest alone, so it is checked here on the real SmolLM2 layout.

use gds_runtime::exec::{eval_last, Executor, OneSequence};
use gds_runtime::gpuplan::{plan_gpu, GpuAsk, GpuLoad, GpuOffer, GpuPlan};
use gds_runtime::{KvDtype, Model, Plan, PlanOptions};
use std::path::Path;

fn smollm2() -> &'static Path {
    gds_tests::smollm_converted()
}

fn plan(ctx: usize) -> Plan {
    Plan::build(&PlanOptions {
        model_dir: smollm2().to_path_buf(),
        ctx: Some(ctx),
        threads: Some(2),
        backend: Some("cpu".into()),
        raw: true,
        ..Default::default()
    })
    .unwrap()
}

fn cpu(plan: &Plan, batch: usize, outputs: usize) -> OneSequence {
    OneSequence::cpu(Model::open(plan).unwrap(), plan, batch, outputs)
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_cpu_executor_splits_passes_and_reports_exactly_the_wanted_positions() {
    let p = plan(128);
    let tokens: Vec<u32> = (0..70).map(|i| 100 + 37 * i).collect();
    // One pass of all 70 tokens, every position an output.
    let mut whole = cpu(&p, 70, 70);
    let mut want_all = vec![Vec::new(); 70];
    whole
        .eval(&tokens, 0, 0..70, &mut |pos, l| want_all[pos] = l.to_vec())
        .unwrap();
    // Passes of 16 tokens, only positions 20..45 wanted.
    let mut split = cpu(&p, 16, 16);
    let mut seen = Vec::new();
    split
        .eval(&tokens, 0, 20..45, &mut |pos, l| {
            assert_eq!(l, &want_all[pos][..], "position {pos}");
            seen.push(pos);
        })
        .unwrap();
    assert_eq!(seen, (20..45).collect::<Vec<_>>());
    // The last reported logits are what the sampler gets.
    assert_eq!(split.last_logits_mut(), &want_all[44][..]);
    // Continuing the sequence: position 70 after the first 70, in two calls.
    let mut a = cpu(&p, 16, 1);
    eval_last(&mut a, &tokens, 0).unwrap();
    assert_eq!(a.last_logits_mut(), &want_all[69][..]);
    eval_last(&mut a, &[5], 70).unwrap();
    let mut b = cpu(&p, 71, 1);
    let mut t71 = tokens.clone();
    t71.push(5);
    eval_last(&mut b, &t71, 0).unwrap();
    assert_eq!(a.last_logits_mut(), b.last_logits_mut());
    assert_eq!(a.backend(), "cpu");
}

/// A device offer, and whether the layer files' filesystem supports O_DIRECT.
fn offer(gds: bool, direct: bool) -> (GpuOffer, bool) {
    let o = GpuOffer {
        device: "Test GPU".into(),
        vram_bytes: 8 << 30,
        gds: if gds {
            Ok(())
        } else {
            Err("libcufile not found".into())
        },
        cufile_compat: false,
    };
    (o, direct)
}

fn gpu(io: &str, budget: Option<u64>, (o, direct): &(GpuOffer, bool)) -> Result<GpuPlan, String> {
    let bytes = gds_io::read_manifest(smollm2()).unwrap();
    let m = gds_format::Manifest::parse(&bytes).unwrap();
    let ask = GpuAsk {
        ctx: 512,
        io,
        vram_budget: budget,
        kv: KvDtype::F32,
    };
    plan_gpu(smollm2(), &m, &ask, o, *direct).map_err(|e| e.to_string())
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_vram_plan_keeps_everything_resident_when_it_fits_and_streams_the_tail_when_not() {
    let o = offer(true, true);
    let all = gpu("auto", None, &o).unwrap();
    assert_eq!(all.load, GpuLoad::Gds);
    assert_eq!(all.vram_budget_bytes, (8u64 << 30) * 9 / 10);
    assert!(all.streamed_layers.is_empty());
    assert_eq!(all.slot_bytes, 0);
    assert_eq!(all.streamed_bytes_per_token, 0);
    let n_layers = all.resident_layers.len();
    let file_bytes: u64 = std::fs::read_dir(smollm2().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(all.resident_bytes, file_bytes);

    // Halfway between the minimum and everything resident.
    let mid = (all.min_budget_bytes + all.all_resident_budget_bytes) / 2;
    let half = gpu("auto", Some(mid), &o).unwrap();
    assert!(!half.streamed_layers.is_empty() && half.resident_layers.len() > 2);
    assert_eq!(
        half.resident_layers.len() + half.streamed_layers.len(),
        n_layers
    );
    // Leading blocks stay; the streamed ones are the tail (the head is the last layer).
    let first_streamed = half.streamed_layers[0];
    assert!(half
        .resident_layers
        .iter()
        .all(|&l| l < first_streamed || l == n_layers - 1));
    assert!(half.slot_bytes > 0);
    assert!(
        half.weights_held_bytes() + (all.all_resident_budget_bytes - all.resident_bytes) <= mid
    );
    assert_eq!(
        half.resident_bytes + half.streamed_bytes_per_token,
        all.resident_bytes
    );

    // The minimum: every block streamed.
    let min = gpu("auto", Some(all.min_budget_bytes), &o).unwrap();
    assert_eq!(min.resident_layers.len(), 2, "{:?}", min.resident_layers);
    let e = gpu("auto", Some(all.min_budget_bytes - 1), &o).unwrap_err();
    assert!(
        e.contains("--vram-budget") && e.contains("too small"),
        "{e}"
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_load_path_follows_io_and_what_the_machine_offers() {
    let (gds, bounce, buffered) = (offer(true, true), offer(false, true), offer(false, false));
    assert_eq!(
        gpu("auto", None, &bounce).unwrap().load,
        GpuLoad::BounceDirect
    );
    let b = gpu("auto", None, &buffered).unwrap();
    assert_eq!(b.load, GpuLoad::BounceBuffered);
    assert!(
        b.load_reason.contains("libcufile not found"),
        "{}",
        b.load_reason
    );
    assert_eq!(
        gpu("direct", None, &gds).unwrap().load,
        GpuLoad::BounceDirect
    );
    assert_eq!(
        gpu("mmap", None, &gds).unwrap().load,
        GpuLoad::BounceBuffered
    );
    let e = gpu("gds", None, &bounce).unwrap_err();
    assert!(
        e.contains("--io gds") && e.contains("libcufile not found"),
        "{e}"
    );
    // libcufile without nvidia-fs: `--io gds` runs cuFile's compatibility mode and the plan
    // says the bytes pass through RAM; `auto` still bounces through our own pinned buffers.
    let compat = (
        GpuOffer {
            gds: Err("libcufile present but /proc/driver/nvidia-fs absent".into()),
            cufile_compat: true,
            ..bounce.0.clone()
        },
        true,
    );
    let c = gpu("gds", None, &compat).unwrap();
    assert_eq!(c.load, GpuLoad::Gds);
    assert!(
        c.load_reason.contains("compatibility mode") && c.load_reason.contains("RAM"),
        "{}",
        c.load_reason
    );
    assert_eq!(
        gpu("auto", None, &compat).unwrap().load,
        GpuLoad::BounceDirect
    );
    let e = gpu("direct", None, &buffered).unwrap_err();
    assert!(e.contains("O_DIRECT"), "{e}");
    let e = gpu("auto", Some(9 << 30), &gds).unwrap_err();
    assert!(e.contains("more than Test GPU has"), "{e}");
    let e = gpu("auto", Some(0), &gds).unwrap_err();
    assert!(e.contains("positive"), "{e}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gpu_flags_on_the_cpu_backend_are_refused_with_the_reason() {
    let build = |vram: Option<u64>, io: Option<&str>| {
        Plan::build(&PlanOptions {
            model_dir: smollm2().to_path_buf(),
            backend: Some("cpu".into()),
            vram_budget: vram,
            io: io.map(str::to_string),
            ..Default::default()
        })
        .map(|p| p.gpu.is_none())
        .map_err(|e| e.to_string())
    };
    assert_eq!(build(None, None), Ok(true));
    let e = build(Some(1 << 30), None).unwrap_err();
    assert!(e.contains("--vram-budget applies to --backend cuda"), "{e}");
    let e = build(None, Some("gds")).unwrap_err();
    assert!(e.contains("--io gds") && e.contains("--backend cpu"), "{e}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn auto_takes_a_usable_gpu_and_falls_back_to_the_cpu_with_the_reason() {
    use gds_runtime::backend::BackendChoice;
    let gpu_choice = || BackendChoice {
        name: gds_runtime::backend::Backend::Cuda,
        reason: "auto: usable GPU found (Test GPU)".into(),
        gpu: Some(offer(false, true).0),
    };
    let build = |mem_budget: Option<u64>, vram: Option<u64>| {
        Plan::build_for(
            &PlanOptions {
                model_dir: smollm2().to_path_buf(),
                mem_budget,
                vram_budget: vram,
                ..Default::default()
            },
            gpu_choice(),
        )
        .map_err(|e| e.to_string())
    };
    let p = build(None, None).unwrap();
    assert_eq!(p.backend, gds_runtime::backend::Backend::Cuda);
    assert!(p.gpu.is_some());
    // a CPU-only option: the CPU runs it, and the plan says why the GPU did not
    let p = build(Some(64 << 20), None).unwrap();
    assert_eq!(p.backend, gds_runtime::backend::Backend::Cpu);
    assert!(
        p.backend_reason.contains("Test GPU") && p.backend_reason.contains("--mem-budget"),
        "{}",
        p.backend_reason
    );
    // a GPU-only option the GPU cannot honour: the GPU's reason, not a CPU fallback
    let e = build(None, Some(1)).unwrap_err();
    assert!(
        e.contains("--vram-budget") && e.contains("too small"),
        "{e}"
    );
    // --backend cuda never falls back
    let e = Plan::build_for(
        &PlanOptions {
            model_dir: smollm2().to_path_buf(),
            backend: Some("cuda".into()),
            mem_budget: Some(64 << 20),
            ..Default::default()
        },
        gpu_choice(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("--mem-budget"), "{e}");
    // the KV cache is f16 on the GPU as on the CPU unless --kv-type f32 asks: half the VRAM
    let kv = |kv_dtype: Option<KvDtype>| {
        let p = Plan::build_for(
            &PlanOptions {
                model_dir: smollm2().to_path_buf(),
                backend: Some("cuda".into()),
                kv_dtype,
                ..Default::default()
            },
            gpu_choice(),
        )
        .unwrap();
        let g = p.gpu.unwrap();
        assert_eq!(g.kv_type, p.kv_dtype);
        (p.kv_dtype, g.kv_bytes)
    };
    let (f16, f32) = (kv(None), kv(Some(KvDtype::F32)));
    assert_eq!(f16.0, KvDtype::F16);
    assert_eq!(f32.0, KvDtype::F32);
    assert_eq!(kv(Some(KvDtype::F16)), f16);
    assert_eq!(2 * f16.1, f32.1, "f16 halves the VRAM cache");
    // 8-bit activations run on the GPU (the int8 kernels): no fallback
    let p = Plan::build_for(
        &PlanOptions {
            model_dir: smollm2().to_path_buf(),
            activations: Some("q8".into()),
            ..Default::default()
        },
        gpu_choice(),
    )
    .unwrap();
    assert_eq!(p.backend, gds_runtime::backend::Backend::Cuda);
    assert_eq!(p.activations, gds_runtime::plan::Activations::Q8);
}

/// A model in weight types without GPU kernels (llama.cpp's grid i-quants: the tiny fixture
/// with every kind of matrix in another one): `auto` with a usable GPU plans the CPU and says
/// why, naming the type; `--backend cuda` refuses with the same reason.
#[test]
fn auto_keeps_grid_iquants_on_the_cpu_and_says_why() {
    use gds_runtime::backend::{Backend, BackendChoice};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m.gds");
    gds_convert::convert(
        &gds_tests::fixture("tiny-llama-iq-grid.gguf"),
        &dir,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .unwrap();
    let gpu_choice = || BackendChoice {
        name: Backend::Cuda,
        reason: "auto: usable GPU found (Test GPU)".into(),
        gpu: Some(offer(false, true).0),
    };
    let opts = |backend: Option<&str>| PlanOptions {
        model_dir: dir.clone(),
        backend: backend.map(str::to_string),
        ..Default::default()
    };
    let p = Plan::build_for(&opts(None), gpu_choice()).unwrap();
    assert_eq!(p.backend, Backend::Cpu);
    assert!(
        p.backend_reason.contains("Test GPU") && p.backend_reason.contains("iq"),
        "{}",
        p.backend_reason
    );
    let e = Plan::build_for(&opts(Some("cuda")), gpu_choice()).unwrap_err();
    assert!(e.to_string().contains("iq"), "{e}");
}
