//! A layer file's bytes placed in VRAM on their own, without the executor: what the Python
//! package's `Model.load(device="cuda:N")` hands out as CUDA tensors (DLPack).
//!
//! Two ways in: bytes the host already holds (a mapped or O_DIRECT-read layer file) copied
//! once host→device, or cuFile reading the file straight into the device buffer (GPUDirect
//! Storage; in its compatibility mode where `nvidia-fs` is not loaded). Every call probes
//! first: cudarc panics when it calls into a library that is not there, so a machine
//! without a driver, device or libcufile gets [`GpuError::Unavailable`] naming what is
//! missing.

use crate::executor::{cuda, CufileUser};
use crate::{probe, GpuError, GpuPath};
use cudarc::cufile::Cufile;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use std::path::Path;
use std::sync::Arc;

/// Where the bytes come from.
pub enum Source<'a> {
    /// Bytes in host memory (a mapped layer file, or one read with O_DIRECT): one
    /// host→device copy.
    Host(&'a [u8]),
    /// The file `file` of the model directory `dir` (`size` bytes), read by cuFile into the
    /// device buffer with no host copy. The caller has checked the file's content hash.
    Gds {
        /// The model directory.
        dir: &'a Path,
        /// The layer file, relative to `dir` (opened without following links).
        file: &'a str,
        /// Its length in bytes.
        size: usize,
    },
}

/// Bytes in device memory: freed when the last owner drops it.
pub struct DeviceBytes {
    buf: CudaSlice<u8>,
    ptr: u64,
    len: usize,
    device: usize,
    path: GpuPath,
    /// For bytes cuFile read: the driver stays open while they live, so that the next layer's
    /// read does not open it again (in compatibility mode each open cost ~0.7 s on an H200,
    /// 2026-12-04).
    _cufile: Option<CufileUser>,
}

impl DeviceBytes {
    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }
    /// How the bytes arrived: [`GpuPath::Gds`] (cuFile) or [`GpuPath::Bounce`] (a host copy).
    pub fn path(&self) -> GpuPath {
        self.path
    }
    /// Copies the bytes back to the host (for checks).
    pub fn to_host(&self) -> Result<Vec<u8>, GpuError> {
        let stream = self.buf.stream().clone();
        let mut v = stream
            .clone_dtoh(&self.buf)
            .map_err(cuda("device-to-host copy"))?;
        v.truncate(self.len);
        Ok(v)
    }
}

/// Holds the process's cuFile driver open while it lives: a caller that reads many layer
/// files with [`Source::Gds`] one after another (the Python package's model) keeps one, so
/// the driver is opened once instead of once per file.
pub struct CufileSession {
    _user: CufileUser,
}

impl CufileSession {
    /// Opens the driver (or counts one more user of it), for reads onto CUDA device `device`
    /// from the directory `dir`. Refused as [`GpuError::Unavailable`], as [`load`] refuses,
    /// where the driver, the device or libcufile is missing.
    pub fn open(device: usize, dir: &Path) -> Result<CufileSession, GpuError> {
        usable(device, true)?;
        Ok(CufileSession {
            _user: cufile_user(dir)?.0,
        })
    }
}

/// One more user of the cuFile driver (opened if it has none), for reading `what`.
fn cufile_user(what: &Path) -> Result<(CufileUser, Arc<Cufile>), GpuError> {
    CufileUser::open().map_err(|e| {
        GpuError::Cuda(format!(
            "cuFileDriverOpen (to read {}): {e:?}",
            what.display()
        ))
    })
}

/// Whether CUDA device `device` can take bytes here (with `gds`: read by cuFile); the
/// refusal names what is missing. Probes first: cudarc panics when it calls into a library
/// that is not there.
fn usable(device: usize, gds: bool) -> Result<(), GpuError> {
    let report = probe();
    if !report.driver.present {
        return Err(GpuError::Unavailable(format!(
            "no CUDA driver: {}",
            report.driver.detail
        )));
    }
    if device >= report.devices.len() {
        return Err(GpuError::Unavailable(format!(
            "cuda:{device}: the driver reports {} device(s)",
            report.devices.len()
        )));
    }
    if gds && !report.cufile.present {
        return Err(GpuError::Unavailable(format!(
            "io=\"gds\" needs libcufile (GPUDirect Storage): {}; io=\"direct\" or \"mmap\" \
             read through host memory",
            report.cufile.detail
        )));
    }
    Ok(())
}

/// Places `src` in a new buffer on CUDA device `device`; returns when the bytes are there.
pub fn load(device: usize, src: Source<'_>) -> Result<DeviceBytes, GpuError> {
    usable(device, matches!(src, Source::Gds { .. }))?;
    let ctx = CudaContext::new(device).map_err(cuda("creating the CUDA context"))?;
    let stream = ctx.default_stream();
    let len = match &src {
        Source::Host(b) => b.len(),
        Source::Gds { size, .. } => *size,
    };
    let mut buf = stream
        .alloc_zeros::<u8>(len.max(1))
        .map_err(cuda("allocating VRAM"))?;
    let mut cufile = None;
    let path = match src {
        Source::Host(b) => {
            stream
                .memcpy_htod(b, &mut buf.slice_mut(..len))
                .map_err(cuda("host-to-device copy"))?;
            GpuPath::Bounce
        }
        Source::Gds { dir, file, size } => {
            let path = dir.join(file);
            let f = gds_io::open_in_dir(dir, file, libc::O_DIRECT).map_err(GpuError::Layer)?;
            let f = crate::reopen_for_cufile(&f, &path)?;
            let (user, driver) = cufile_user(&path)?;
            cufile = Some(user);
            let handle = driver.register(f).map_err(|e| {
                GpuError::Cuda(format!(
                    "cuFileHandleRegister of {}: {e:?} (io=\"direct\" reads without cuFile)",
                    path.display()
                ))
            })?;
            let n = handle
                .sync_read(0, &mut buf.slice_mut(..size))
                .map_err(|e| GpuError::Cuda(format!("cuFileRead of {}: {e:?}", path.display())));
            // cudarc's FileHandle deregisters in its Drop and panics if that fails.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(handle)));
            let n = n?;
            if n != size as isize {
                return Err(GpuError::Cuda(format!(
                    "reading {}: got {n} bytes, expected {size}",
                    path.display()
                )));
            }
            GpuPath::Gds
        }
    };
    stream.synchronize().map_err(cuda("loading into VRAM"))?;
    let ptr = buf.device_ptr(&stream).0;
    Ok(DeviceBytes {
        buf,
        ptr,
        len,
        device,
        path,
        _cufile: cufile,
    })
}
