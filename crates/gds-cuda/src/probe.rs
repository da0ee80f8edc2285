//! What GPU support this machine has, found without ever panicking: the libraries are
//! looked for first (`is_culib_present`), and only then called.

use serde::Serialize;
use std::fmt;

/// Where `/proc` says the GPUDirect Storage kernel module (`nvidia-fs`) is loaded.
pub const NVIDIA_FS_PROC: &str = "/proc/driver/nvidia-fs";

/// One shared library the backend loads at run time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LibStatus {
    /// Whether it was found (and, for the driver, initialised).
    pub present: bool,
    /// Version, or why it is absent, or "not checked (...)".
    pub detail: String,
}

#[cfg_attr(feature = "cuda", allow(dead_code))]
impl LibStatus {
    fn unchecked() -> LibStatus {
        LibStatus {
            present: false,
            detail: "not checked (built without the `cuda` feature)".into(),
        }
    }
}

/// One CUDA device as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: u32,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Total device memory in bytes.
    pub vram_bytes: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
}

/// Which way layer bytes would reach VRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuPath {
    /// cuFile reads from NVMe straight into device memory (`--io gds`).
    Gds,
    /// Reads into pinned host buffers, then asynchronous host→device copies.
    Bounce,
    /// The CUDA backend cannot run here.
    None,
}

impl GpuPath {
    /// `gds`, `bounce` or `none`.
    pub fn name(self) -> &'static str {
        match self {
            GpuPath::Gds => "gds",
            GpuPath::Bounce => "bounce",
            GpuPath::None => "none",
        }
    }
}

/// Everything `gdsrun doctor` and `--backend auto|cuda` need to know about the GPU side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuReport {
    /// Whether this binary was built with the `cuda` feature.
    pub built_with_cuda: bool,
    /// The CUDA driver library (libcuda.so).
    pub driver: LibStatus,
    /// Devices the driver reports (empty without a driver).
    pub devices: Vec<DeviceInfo>,
    /// NVRTC (libnvrtc.so), which compiles the kernels at run time.
    pub nvrtc: LibStatus,
    /// cuBLAS (libcublas.so), used for prefill GEMMs.
    pub cublas: LibStatus,
    /// cuFile (libcufile.so), the GPUDirect Storage user library.
    pub cufile: LibStatus,
    /// Whether [`NVIDIA_FS_PROC`] exists (the nvidia-fs kernel module is loaded).
    pub nvidia_fs: bool,
    /// The path `--backend cuda` would take.
    pub path: GpuPath,
    /// One line: why that path.
    pub reason: String,
}

impl GpuReport {
    /// `None` when the CUDA backend could run; otherwise what is missing, in one line.
    pub fn unusable_reason(&self) -> Option<&str> {
        (self.path == GpuPath::None).then_some(self.reason.as_str())
    }

    /// The report as `key: value` lines (for `gdsrun doctor`).
    pub fn lines(&self) -> Vec<String> {
        let lib =
            |l: &LibStatus| format!("{} ({})", if l.present { "yes" } else { "no" }, l.detail);
        let mut out = vec![format!(
            "cuda feature: {}",
            if self.built_with_cuda {
                "built in"
            } else {
                "not built (rebuild with `cargo build --release -p gdsrun --features cuda`)"
            }
        )];
        out.push(format!("cuda driver (libcuda): {}", lib(&self.driver)));
        if self.devices.is_empty() {
            out.push("gpu devices: none".into());
        }
        for d in &self.devices {
            out.push(format!(
                "gpu {}: {}, {:.1} GiB VRAM, compute capability {}.{}",
                d.ordinal,
                d.name,
                d.vram_bytes as f64 / (1u64 << 30) as f64,
                d.compute_capability.0,
                d.compute_capability.1
            ));
        }
        out.push(format!("nvrtc (libnvrtc): {}", lib(&self.nvrtc)));
        out.push(format!("cublas (libcublas): {}", lib(&self.cublas)));
        out.push(format!("cufile (libcufile): {}", lib(&self.cufile)));
        out.push(format!(
            "nvidia-fs ({NVIDIA_FS_PROC}): {}",
            if self.nvidia_fs { "loaded" } else { "absent" }
        ));
        out.push(format!("gpu path: {} ({})", self.path.name(), self.reason));
        out
    }
}

impl fmt::Display for GpuReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in self.lines() {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

/// Decides the path from what was found. Kept apart from the probing so it can be tested
/// on any machine.
pub fn decide(
    driver: &LibStatus,
    devices: &[DeviceInfo],
    nvrtc: &LibStatus,
    cublas: &LibStatus,
    cufile: &LibStatus,
    nvidia_fs: bool,
) -> (GpuPath, String) {
    let mut missing = Vec::new();
    if !driver.present {
        missing.push(format!("CUDA driver: {}", driver.detail));
    } else if devices.is_empty() {
        missing.push("no CUDA device".to_string());
    }
    if !nvrtc.present {
        missing.push(format!("NVRTC: {}", nvrtc.detail));
    }
    if !cublas.present {
        missing.push(format!("cuBLAS: {}", cublas.detail));
    }
    if !missing.is_empty() {
        return (GpuPath::None, missing.join("; "));
    }
    match (cufile.present, nvidia_fs) {
        (true, true) => (
            GpuPath::Gds,
            "libcufile and nvidia-fs present: cuFile reads NVMe straight into VRAM".into(),
        ),
        (false, _) => (
            GpuPath::Bounce,
            format!(
                "no GPUDirect Storage (cuFile: {}): pinned bounce buffers",
                cufile.detail
            ),
        ),
        (true, false) => (
            GpuPath::Bounce,
            format!("libcufile present but {NVIDIA_FS_PROC} absent: pinned bounce buffers"),
        ),
    }
}

/// Looks at this machine: libraries, devices, nvidia-fs, and which path would run.
///
/// Never panics and never creates a CUDA context (so it is cheap and leaves no state).
pub fn probe() -> GpuReport {
    let nvidia_fs = std::path::Path::new(NVIDIA_FS_PROC).exists();
    #[cfg(not(feature = "cuda"))]
    {
        let (driver, nvrtc, cublas, cufile) = (
            LibStatus::unchecked(),
            LibStatus::unchecked(),
            LibStatus::unchecked(),
            LibStatus::unchecked(),
        );
        GpuReport {
            built_with_cuda: false,
            driver,
            devices: Vec::new(),
            nvrtc,
            cublas,
            cufile,
            nvidia_fs,
            path: GpuPath::None,
            reason: "built without the `cuda` feature".into(),
        }
    }
    #[cfg(feature = "cuda")]
    {
        let (driver, devices) = cuda_probe::driver_and_devices();
        let nvrtc = cuda_probe::nvrtc();
        let cublas = cuda_probe::cublas();
        let cufile = cuda_probe::cufile();
        let (path, reason) = decide(&driver, &devices, &nvrtc, &cublas, &cufile, nvidia_fs);
        GpuReport {
            built_with_cuda: true,
            driver,
            devices,
            nvrtc,
            cublas,
            cufile,
            nvidia_fs,
            path,
            reason,
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda_probe {
    use super::{DeviceInfo, LibStatus};
    use cudarc::driver::{result, sys};

    fn absent(lib: &str) -> LibStatus {
        LibStatus {
            present: false,
            detail: format!("{lib} not found on the library path (LD_LIBRARY_PATH, ldconfig)"),
        }
    }

    pub(super) fn driver_and_devices() -> (LibStatus, Vec<DeviceInfo>) {
        // SAFETY: only tries to dlopen the library; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return (absent("libcuda.so"), Vec::new());
        }
        if let Err(e) = result::init() {
            return (
                LibStatus {
                    present: false,
                    detail: format!("libcuda.so found but cuInit failed: {e:?}"),
                },
                Vec::new(),
            );
        }
        let mut version = 0;
        // SAFETY: the library is loaded and initialised; `version` outlives the call.
        let v = unsafe { sys::cuDriverGetVersion(&mut version) };
        let detail = if v == sys::CUresult::CUDA_SUCCESS {
            format!("driver API {}.{}", version / 1000, version % 1000 / 10)
        } else {
            "version unknown".into()
        };
        let count = result::device::get_count().unwrap_or(0);
        let devices = (0..count)
            .filter_map(|i| {
                let dev = result::device::get(i).ok()?;
                let name = result::device::get_name(dev).unwrap_or_else(|_| "?".into());
                // SAFETY: `dev` is a valid device handle from cuDeviceGet.
                let vram = unsafe { result::device::total_mem(dev) }.unwrap_or(0);
                let attr = |a| {
                    // SAFETY: as above; the attribute ids are valid enum values.
                    unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
                };
                use sys::CUdevice_attribute::*;
                Some(DeviceInfo {
                    ordinal: i as u32,
                    name,
                    vram_bytes: vram as u64,
                    compute_capability: (
                        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32,
                        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32,
                    ),
                })
            })
            .collect();
        (
            LibStatus {
                present: true,
                detail,
            },
            devices,
        )
    }

    pub(super) fn nvrtc() -> LibStatus {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return absent("libnvrtc.so");
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present; both out-pointers outlive the call.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            LibStatus {
                present: true,
                detail: format!("NVRTC {major}.{minor}"),
            }
        } else {
            LibStatus {
                present: false,
                detail: format!("libnvrtc found but nvrtcVersion failed: {r:?}"),
            }
        }
    }

    pub(super) fn cublas() -> LibStatus {
        // SAFETY: only tries to dlopen the library.
        if unsafe { cudarc::cublas::sys::is_culib_present() } {
            LibStatus {
                present: true,
                detail: "found".into(),
            }
        } else {
            absent("libcublas.so")
        }
    }

    pub(super) fn cufile() -> LibStatus {
        // SAFETY: only tries to dlopen the library.
        if unsafe { cudarc::cufile::sys::is_culib_present() } {
            LibStatus {
                present: true,
                detail: "found".into(),
            }
        } else {
            absent("libcufile.so")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yes() -> LibStatus {
        LibStatus {
            present: true,
            detail: "found".into(),
        }
    }
    fn no(what: &str) -> LibStatus {
        LibStatus {
            present: false,
            detail: format!("{what} not found"),
        }
    }
    fn dev() -> Vec<DeviceInfo> {
        vec![DeviceInfo {
            ordinal: 0,
            name: "Test GPU".into(),
            vram_bytes: 80 << 30,
            compute_capability: (9, 0),
        }]
    }

    #[test]
    fn path_is_gds_only_with_cufile_and_nvidia_fs() {
        let (p, r) = decide(&yes(), &dev(), &yes(), &yes(), &yes(), true);
        assert_eq!(p, GpuPath::Gds, "{r}");
        let (p, r) = decide(&yes(), &dev(), &yes(), &yes(), &yes(), false);
        assert_eq!(p, GpuPath::Bounce);
        assert!(r.contains("nvidia-fs"), "{r}");
        let (p, r) = decide(&yes(), &dev(), &yes(), &yes(), &no("libcufile.so"), true);
        assert_eq!(p, GpuPath::Bounce);
        assert!(r.contains("libcufile.so"), "{r}");
    }

    #[test]
    fn path_is_none_naming_every_missing_piece() {
        let (p, r) = decide(
            &no("libcuda.so"),
            &[],
            &no("libnvrtc.so"),
            &yes(),
            &yes(),
            true,
        );
        assert_eq!(p, GpuPath::None);
        assert!(r.contains("libcuda.so") && r.contains("libnvrtc.so"), "{r}");
        let (p, r) = decide(&yes(), &[], &yes(), &yes(), &yes(), true);
        assert_eq!(p, GpuPath::None);
        assert!(r.contains("no CUDA device"), "{r}");
    }

    #[test]
    fn probe_never_panics_and_reports_consistently() {
        let r = probe();
        assert_eq!(r.built_with_cuda, cfg!(feature = "cuda"));
        assert_eq!(r.unusable_reason().is_some(), r.path == GpuPath::None);
        let text = r.to_string();
        assert!(text.contains("gpu path: "), "{text}");
        assert!(text.contains("cufile (libcufile): "), "{text}");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["path"].is_string(), "{json}");
        if !r.built_with_cuda {
            assert!(
                r.reason.contains("without the `cuda` feature"),
                "{}",
                r.reason
            );
        }
        if r.driver.present {
            assert!(
                r.driver.detail.contains("driver API"),
                "{}",
                r.driver.detail
            );
        }
    }
}
