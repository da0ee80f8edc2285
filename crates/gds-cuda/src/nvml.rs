//! GPU energy from NVML's total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`:
//! millijoules since the driver loaded, Volta and later). `libnvidia-ml.so.1` ships with the
//! driver; it is loaded at run time, so its absence is an error message, never a panic,
//! and this module builds and is tested without the `cuda` feature.

use libloading::{Library, Symbol};
use std::ffi::c_void;

type NvmlReturn = i32;
type Device = *mut c_void;

const NVML_SUCCESS: NvmlReturn = 0;

/// The library names tried, in order.
pub const NVML_LIBS: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

/// One GPU's cumulative energy counter.
pub struct GpuEnergy {
    get_energy: unsafe extern "C" fn(Device, *mut u64) -> NvmlReturn,
    device: Device,
    index: u32,
    // Dropped last: the function pointer and the handle live in it.
    _lib: Library,
}

// SAFETY: an NVML device handle is an opaque token the library accepts from any thread (NVML
// is thread-safe per its documentation); the struct holds no thread-local state.
unsafe impl Send for GpuEnergy {}

impl GpuEnergy {
    /// Opens NVML and the device with NVML index `index` (the CUDA ordinal on a machine whose
    /// devices are not reordered by `CUDA_VISIBLE_DEVICES`), and reads the counter once to
    /// check that the device reports it.
    pub fn open(index: u32) -> Result<GpuEnergy, String> {
        Self::open_from(&NVML_LIBS, index)
    }

    /// Like [`GpuEnergy::open`] with other library names (for tests).
    pub fn open_from(names: &[&str], index: u32) -> Result<GpuEnergy, String> {
        let mut why = Vec::new();
        let lib = names
            .iter()
            .find_map(|n| {
                // SAFETY: loading NVML runs no initialisers beyond the library's own; it is the
                // driver's library, loaded the same way nvidia-smi loads it.
                match unsafe { Library::new(*n) } {
                    Ok(l) => Some(l),
                    Err(e) => {
                        why.push(format!("{n}: {e}"));
                        None
                    }
                }
            })
            .ok_or_else(|| format!("NVML not found ({})", why.join("; ")))?;
        // SAFETY: the symbols are NVML's documented C entry points with these signatures
        // (nvml.h); they are copied out as plain function pointers while `lib` stays loaded in
        // the struct that holds them.
        unsafe {
            let sym = |name: &[u8]| -> Result<Symbol<'_, *const c_void>, String> {
                lib.get(name).map_err(|e| {
                    format!(
                        "NVML lacks {}: {e}",
                        String::from_utf8_lossy(&name[..name.len() - 1])
                    )
                })
            };
            let init: unsafe extern "C" fn() -> NvmlReturn =
                std::mem::transmute(*sym(b"nvmlInit_v2\0")?);
            let by_index: unsafe extern "C" fn(u32, *mut Device) -> NvmlReturn =
                std::mem::transmute(*sym(b"nvmlDeviceGetHandleByIndex_v2\0")?);
            let get_energy: unsafe extern "C" fn(Device, *mut u64) -> NvmlReturn =
                std::mem::transmute(*sym(b"nvmlDeviceGetTotalEnergyConsumption\0")?);
            let rc = init();
            if rc != NVML_SUCCESS {
                return Err(format!("nvmlInit_v2 failed (NVML error {rc})"));
            }
            let mut device: Device = std::ptr::null_mut();
            let rc = by_index(index, &mut device);
            if rc != NVML_SUCCESS {
                return Err(format!(
                    "nvmlDeviceGetHandleByIndex({index}) failed (NVML error {rc})"
                ));
            }
            let mut mj = 0u64;
            let rc = get_energy(device, &mut mj);
            if rc != NVML_SUCCESS {
                return Err(format!(
                    "GPU {index} does not report its total energy (NVML error {rc}; Volta or newer needed)"
                ));
            }
            Ok(GpuEnergy {
                get_energy,
                device,
                index,
                _lib: lib,
            })
        }
    }

    /// The counter now, millijoules, or `None` when the read fails.
    pub fn millijoules(&mut self) -> Option<u64> {
        let mut mj = 0u64;
        // SAFETY: `device` came from nvmlDeviceGetHandleByIndex_v2 of this still-loaded
        // library, and `mj` is a valid out-pointer.
        let rc = unsafe { (self.get_energy)(self.device, &mut mj) };
        (rc == NVML_SUCCESS).then_some(mj)
    }

    /// `nvml:gpuN`, for the metrics' energy source.
    pub fn source(&self) -> String {
        format!("nvml:gpu{}", self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nvml_is_an_error_naming_what_was_tried() {
        let e = GpuEnergy::open_from(&["libnvidia-ml-absent.so.1"], 0)
            .err()
            .expect("no such library");
        assert!(
            e.contains("NVML not found") && e.contains("libnvidia-ml-absent.so.1"),
            "{e}"
        );
    }
}
