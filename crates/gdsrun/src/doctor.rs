//! `gdsrun doctor [MODEL_DIR]`: what this machine offers and what a run would choose —
//! CPU features, cores, memory, the model's filesystem and whether it takes `O_DIRECT`,
//! a short measured read bandwidth (direct and buffered, cold), the GPU side (CUDA driver,
//! cuFile, nvidia-fs), and the plan's backend and I/O decisions with their reasons.

use crate::cli::DoctorArgs;
use crate::out::outln;
use anyhow::Result;
use gds_runtime::gpuplan::{plan_gpu, GpuAsk, GpuOffer, GpuPlan};
use gds_runtime::{Plan, PlanOptions};
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;

/// Bytes read per bandwidth measurement (or the model's size, if smaller).
const MEASURE_BYTES: u64 = 256 << 20;
/// Read size of the measurement: the size of one streamed block of a small model.
const MEASURE_BLOCK: usize = 2 << 20;

#[derive(Serialize)]
struct Cpu {
    model: Option<String>,
    logical_cores: usize,
    physical_cores: usize,
    features: Vec<&'static str>,
    simd_kernels: &'static str,
}

fn cpu() -> Cpu {
    let model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
    });
    let mut features = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! feat {
            ($($f:tt),*) => {$(
                if std::arch::is_x86_feature_detected!($f) {
                    features.push($f);
                }
            )*};
        }
        feat!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vnni",
            "avxvnni"
        );
    }
    let simd = if features.contains(&"avx2") && features.contains(&"fma") {
        "avx2+fma"
    } else {
        "scalar"
    };
    Cpu {
        model,
        logical_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        physical_cores: gds_runtime::plan::physical_cores(),
        features,
        simd_kernels: simd,
    }
}

fn meminfo() -> Value {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = |key: &str| {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|v| v * 1024)
    };
    json!({"total_bytes": kb("MemTotal:"), "available_bytes": kb("MemAvailable:")})
}

fn layer_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("layers"))
        .map(|r| r.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn model_report(a: &DoctorArgs, dir: &std::path::Path) -> Value {
    let files = layer_files(dir);
    let fs = gds_io::filesystem_name(dir);
    let direct =
        files
            .first()
            .map(|f| gds_io::probe_direct(f))
            .unwrap_or(gds_io::DirectSupport::Buffered(
                "no layer files found".into(),
            ));
    let measure =
        |direct: bool| match gds_io::measure_read(&files, direct, MEASURE_BLOCK, MEASURE_BYTES) {
            Ok(r) => json!({"bytes": r.bytes, "secs": r.secs, "bytes_per_sec": r.bandwidth()}),
            Err(e) => json!({"error": e.to_string()}),
        };
    let (direct_ok, direct_why) = match &direct {
        gds_io::DirectSupport::Direct => (true, "O_DIRECT open and aligned read work".to_string()),
        gds_io::DirectSupport::Buffered(why) => (false, why.clone()),
    };
    let bw_direct = if direct_ok {
        measure(true)
    } else {
        json!(null)
    };
    let bw_buffered = measure(false);
    let opts = PlanOptions {
        model_dir: dir.to_path_buf(),
        mem_budget: a.mem_budget,
        io: a.io.clone(),
        backend: a.backend.clone(),
        kv_dtype: a.kv_type.as_deref().and_then(gds_runtime::KvDtype::parse),
        ..Default::default()
    };
    // The VRAM budget goes into the plan only where the plan runs on the GPU.
    let plan = Plan::build(&opts).and_then(|p| match (&p.gpu, a.vram_budget) {
        (Some(_), Some(v)) => Plan::build(&PlanOptions {
            vram_budget: Some(v),
            ..opts.clone()
        }),
        _ => Ok(p),
    });
    let gpu_json = |g: &GpuPlan, preview: bool| {
        json!({
            "preview": preview, "device": g.device, "load": g.load, "load_reason": g.load_reason,
            "vram_budget_bytes": g.vram_budget_bytes,
            "resident_layers": g.resident_layers.len(), "streamed_layers": g.streamed_layers.len(),
            "weights_held_bytes": g.weights_held_bytes(),
            "streamed_bytes_per_token": g.streamed_bytes_per_token,
            "min_budget_bytes": g.min_budget_bytes,
            "all_resident_budget_bytes": g.all_resident_budget_bytes,
            "kv_cache_bytes": g.kv_bytes, "kv_type": g.kv_type,
        })
    };
    let plan = match plan {
        Ok(p) => {
            let gpu = match (&p.gpu, a.vram_budget) {
                (Some(g), _) => gpu_json(g, false),
                // No GPU in this plan: what a device with that much memory would do.
                (None, Some(v)) => {
                    let offer = GpuOffer {
                        device: format!("a {} MiB device (no usable GPU here)", v >> 20),
                        vram_bytes: v,
                        gds: Err("not probed in a preview".into()),
                        cufile_compat: false,
                    };
                    let preview = || {
                        let bytes = gds_io::read_manifest(dir)?;
                        let m = gds_runtime::plan::parse_manifest(dir, &bytes)?;
                        let ask = GpuAsk {
                            ctx: p.ctx,
                            io: a.io.as_deref().unwrap_or("auto"),
                            vram_budget: Some(v),
                            kv: p.kv_dtype,
                        };
                        plan_gpu(dir, &m, &ask, &offer, direct_ok)
                    };
                    match preview() {
                        Ok(g) => gpu_json(&g, true),
                        Err(e) => json!({"error": e.to_string()}),
                    }
                }
                (None, None) => json!(null),
            };
            json!({
                "backend": p.backend, "backend_reason": p.backend_reason,
                "io": p.io, "io_reason": p.io_plan.reason,
                "weight_bytes": p.io_plan.weight_bytes,
                "held_bytes": p.io_plan.held_bytes,
                "resident_layers": p.io_plan.resident_layers.len(),
                "streamed_layers": p.io_plan.streamed_layers.len(),
                "streamed_bytes_per_token": p.io_plan.streamed_bytes_per_token,
                "min_budget_bytes": p.io_plan.min_budget_bytes,
                "kv_cache_bytes": p.kv_bytes,
                "gpu": gpu,
            })
        }
        Err(e) => json!({"error": e.to_string()}),
    };
    json!({
        "dir": dir.display().to_string(),
        "filesystem": fs,
        "o_direct": direct_ok,
        "o_direct_detail": direct_why,
        "read_bandwidth_direct": bw_direct,
        "read_bandwidth_buffered_cold": bw_buffered,
        "plan": plan,
    })
}

fn mbps(v: &Value) -> String {
    match v.get("bytes_per_sec").and_then(Value::as_f64) {
        Some(b) => format!(
            "{:.0} MB/s ({:.0} MB in {:.2} s)",
            b / 1e6,
            v["bytes"].as_f64().unwrap_or(0.0) / 1e6,
            v["secs"].as_f64().unwrap_or(0.0)
        ),
        None => v
            .get("error")
            .and_then(Value::as_str)
            .map_or("not measured".into(), |e| format!("failed: {e}")),
    }
}

/// The GPU half of the plan (or its preview) as text.
fn print_gpu_plan(g: &Value) -> Result<()> {
    if g.is_null() {
        return Ok(());
    }
    if let Some(e) = g.get("error").and_then(Value::as_str) {
        return outln!("VRAM    cannot plan: {e}");
    }
    let mib = |k: &str| g[k].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64;
    outln!(
        "VRAM    {}{}: budget {:.1} MiB, load {} ({})",
        if g["preview"] == true {
            "preview for "
        } else {
            ""
        },
        g["device"].as_str().unwrap_or(""),
        mib("vram_budget_bytes"),
        g["load"].as_str().unwrap_or(""),
        g["load_reason"].as_str().unwrap_or("")
    )?;
    outln!(
        "        weights held {:.1} MiB ({} resident layers, {} streamed: {:.1} MiB/token); runs from {:.1} MiB, everything resident at {:.1} MiB; KV cache {:.1} MiB ({})",
        mib("weights_held_bytes"),
        g["resident_layers"],
        g["streamed_layers"],
        mib("streamed_bytes_per_token"),
        mib("min_budget_bytes"),
        mib("all_resident_budget_bytes"),
        mib("kv_cache_bytes"),
        g["kv_type"].as_str().unwrap_or("")
    )
}

/// Runs the command.
pub fn run(a: DoctorArgs) -> Result<()> {
    let cpu = cpu();
    let gpu = gds_cuda::probe();
    let model = a.model_dir.as_deref().map(|d| model_report(&a, d));
    if a.json {
        let v = json!({"cpu": cpu, "memory": meminfo(), "gpu": gpu, "model": model});
        return outln!("{}", serde_json::to_string_pretty(&v)?);
    }
    outln!("CPU     {}", cpu.model.as_deref().unwrap_or("unknown"))?;
    outln!(
        "        {} physical cores, {} logical; features: {}; kernels: {}",
        cpu.physical_cores,
        cpu.logical_cores,
        cpu.features.join(" "),
        cpu.simd_kernels
    )?;
    let mem = meminfo();
    let gib = |v: &Value| {
        v.as_f64().map_or("?".into(), |b| {
            format!("{:.1} GiB", b / (1u64 << 30) as f64)
        })
    };
    outln!(
        "Memory  {} total, {} available",
        gib(&mem["total_bytes"]),
        gib(&mem["available_bytes"])
    )?;
    outln!("GPU")?;
    for l in gpu.lines() {
        outln!("        {l}")?;
    }
    if let Some(m) = model {
        outln!("Model   {}", m["dir"].as_str().unwrap_or(""))?;
        outln!(
            "        filesystem: {}",
            m["filesystem"].as_str().unwrap_or("unknown")
        )?;
        outln!(
            "        O_DIRECT: {} ({})",
            if m["o_direct"] == true { "yes" } else { "no" },
            m["o_direct_detail"].as_str().unwrap_or("")
        )?;
        outln!(
            "        read, O_DIRECT:        {}",
            mbps(&m["read_bandwidth_direct"])
        )?;
        outln!(
            "        read, buffered (cold): {}",
            mbps(&m["read_bandwidth_buffered_cold"])
        )?;
        let p = &m["plan"];
        if let Some(e) = p.get("error").and_then(Value::as_str) {
            outln!("Plan    cannot run: {e}")?;
        } else {
            outln!(
                "Plan    backend {}: {}",
                p["backend"].as_str().unwrap_or(""),
                p["backend_reason"].as_str().unwrap_or("")
            )?;
            outln!(
                "        io {}: {}",
                p["io"].as_str().unwrap_or(""),
                p["io_reason"].as_str().unwrap_or("")
            )?;
            let mib = |k: &str| p[k].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64;
            outln!(
                "        weights {:.1} MiB, held {:.1} MiB ({} resident layers, {} streamed: {:.1} MiB/token); streaming needs at least {:.1} MiB; KV cache {:.1} MiB",
                mib("weight_bytes"),
                mib("held_bytes"),
                p["resident_layers"],
                p["streamed_layers"],
                mib("streamed_bytes_per_token"),
                mib("min_budget_bytes"),
                mib("kv_cache_bytes")
            )?;
            print_gpu_plan(&p["gpu"])?;
        }
    }
    Ok(())
}
