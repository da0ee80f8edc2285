//! Choosing the compute backend: `--backend auto|cpu|cuda`.
//!
//! `cuda` is refused at planning time, with the reason, when it cannot run. With the
//! `cuda` feature the GPU is probed through `gds_cuda::probe()` (no panic when libcuda,
//! libnvrtc or libcufile is missing: the reason names what is).
//!
//! `auto` takes a usable GPU: the CUDA executor gave the CPU f32 reference's greedy tokens
//! and perplexity on an NVIDIA H200 (README, "What has run on hardware"). Where the run
//! cannot go to the GPU (see `Plan::build`) it falls back to the CPU and says why.

use crate::error::{Result, RuntimeError};
use crate::gpuplan::GpuOffer;

/// A compute backend. (Serialized, and displayed, as `cpu` / `cuda`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The CPU kernels (`gds-kernels`).
    Cpu,
    /// The CUDA executor (`gds-cuda`; needs the `cuda` feature and a usable GPU).
    Cuda,
}

impl Backend {
    /// `cpu` or `cuda`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The decision: the backend's name and why it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend.
    pub name: Backend,
    /// One line: why this backend (and not another).
    pub reason: String,
    /// For `cuda`: the device the plan is made for.
    pub gpu: Option<GpuOffer>,
}

impl BackendChoice {
    /// The CPU backend, for `reason`.
    pub fn cpu(reason: String) -> BackendChoice {
        BackendChoice {
            name: Backend::Cpu,
            reason,
            gpu: None,
        }
    }
}

/// What the GPU side offers, as far as the choice is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Gpu {
    /// Built without the `cuda` feature.
    #[cfg_attr(feature = "cuda", allow(dead_code))]
    NotBuilt,
    /// Built with it, but the backend cannot run here: why.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Unusable(String),
    /// A usable GPU.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Usable(GpuOffer),
}

#[cfg(not(feature = "cuda"))]
fn gpu() -> Gpu {
    Gpu::NotBuilt
}

#[cfg(feature = "cuda")]
fn gpu() -> Gpu {
    let report = gds_cuda::probe();
    match (report.unusable_reason(), report.devices.first()) {
        (Some(why), _) => Gpu::Unusable(why.to_string()),
        (None, None) => Gpu::Unusable("no CUDA device".into()),
        (None, Some(d)) => Gpu::Usable(GpuOffer {
            device: d.name.clone(),
            vram_bytes: d.vram_bytes,
            gds: match report.path {
                gds_cuda::GpuPath::Gds => Ok(()),
                _ => Err(report.reason.clone()),
            },
            cufile_compat: report.cufile.present && !report.nvidia_fs,
        }),
    }
}

/// Resolves the user's `--backend` value (`None` = `auto`).
pub fn choose(requested: Option<&str>) -> Result<BackendChoice> {
    match requested.unwrap_or("auto") {
        "cpu" => Ok(BackendChoice {
            name: Backend::Cpu,
            reason: "requested with --backend cpu".into(),
            gpu: None,
        }),
        name @ ("auto" | "cuda") => decide(name, gpu()),
        other => Err(RuntimeError::Usage(format!(
            "--backend {other}: expected auto, cpu or cuda"
        ))),
    }
}

/// `auto` or `cuda` against what the GPU side offers.
fn decide(requested: &str, gpu: Gpu) -> Result<BackendChoice> {
    let cpu = |reason: String| Ok(BackendChoice::cpu(reason));
    match (requested, gpu) {
        ("auto", Gpu::NotBuilt) => {
            cpu("auto: this build has no GPU backend (built without the `cuda` feature)".into())
        }
        ("auto", Gpu::Unusable(why)) => cpu(format!("auto: no usable GPU ({why})")),
        ("auto", Gpu::Usable(g)) => Ok(BackendChoice {
            name: Backend::Cuda,
            reason: format!("auto: usable GPU found ({})", g.device),
            gpu: Some(g),
        }),
        (_, Gpu::NotBuilt) => Err(RuntimeError::Backend(
            "--backend cuda: this gdsrun was built without CUDA support \
             (rebuild with `cargo build --release -p gdsrun --features cuda`)"
                .into(),
        )),
        (_, Gpu::Unusable(why)) => Err(RuntimeError::Backend(format!(
            "--backend cuda: the CUDA backend cannot run here: {why}"
        ))),
        (_, Gpu::Usable(g)) => Ok(BackendChoice {
            name: Backend::Cuda,
            reason: format!("requested with --backend cuda: {}", g.device),
            gpu: Some(g),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_and_cpu_pick_the_cpu_and_unknown_names_are_refused() {
        assert_eq!(choose(None).unwrap().name, Backend::Cpu);
        assert_eq!(choose(Some("cpu")).unwrap().name, Backend::Cpu);
        let e = choose(Some("tpu")).unwrap_err().to_string();
        assert!(e.contains("--backend tpu"), "{e}");
    }

    #[test]
    fn cuda_is_refused_with_what_is_missing_and_auto_falls_back_with_the_reason() {
        let e = decide("cuda", Gpu::NotBuilt).unwrap_err().to_string();
        assert!(e.contains("without CUDA support"), "{e}");
        let missing = Gpu::Unusable("CUDA driver: libcuda.so not found".into());
        let e = decide("cuda", missing.clone()).unwrap_err().to_string();
        assert!(e.contains("libcuda.so not found"), "{e}");
        let auto = decide("auto", missing).unwrap();
        assert_eq!(auto.name, Backend::Cpu);
        assert!(
            auto.reason.contains("libcuda.so not found"),
            "{}",
            auto.reason
        );
        let usable = Gpu::Usable(GpuOffer {
            device: "Test GPU".into(),
            vram_bytes: 1 << 30,
            gds: Ok(()),
            cufile_compat: false,
        });
        let cuda = decide("cuda", usable.clone()).unwrap();
        assert_eq!(cuda.name, Backend::Cuda);
        assert_eq!(cuda.gpu.as_ref().map(|g| g.vram_bytes), Some(1 << 30));
        let auto = decide("auto", usable).unwrap();
        assert_eq!(auto.name, Backend::Cuda);
        assert!(auto.reason.contains("Test GPU"), "{}", auto.reason);
        assert_eq!(auto.gpu.as_ref().map(|g| g.vram_bytes), Some(1 << 30));
    }

    #[test]
    fn on_this_machine_cuda_is_either_refused_with_a_reason_or_chosen() {
        // No GPU in CI: `cuda` must fail with a message, never panic; `auto` is the CPU.
        match choose(Some("cuda")) {
            Err(e) => assert!(e.to_string().contains("--backend cuda: "), "{e}"),
            Ok(c) => assert_eq!(c.name, Backend::Cuda),
        }
        assert_eq!(choose(Some("auto")).unwrap().name, Backend::Cpu);
    }
}
