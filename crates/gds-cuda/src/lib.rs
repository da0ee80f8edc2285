#![doc = include_str!("../README.md")]

pub mod forward;
pub mod kernels;
pub mod nvml;
pub mod plan;
pub mod probe;
pub mod profile;
pub mod stream;

#[cfg(feature = "cuda")]
pub mod device_bytes;
#[cfg(feature = "cuda")]
pub mod executor;
#[cfg(feature = "cuda")]
pub mod nvrtc;

pub use probe::{probe, DeviceInfo, GpuPath, GpuReport, LibStatus};

/// An on/off environment variable's value (`value`: the variable's, if set): `Some(true)`
/// for `1`, `true`, `on`, `yes`, `Some(false)` for `0`, `false`, `off`, `no` (any case,
/// spaces around ignored), `None` otherwise. Each switch reads its unset or unknown value
/// as its default (`GDS_CUDA_PROFILE`: off, `GDS_CUDA_FUSE`: on).
pub fn env_flag(value: Option<&str>) -> Option<bool> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("1" | "true" | "on" | "yes") => Some(true),
        Some("0" | "false" | "off" | "no") => Some(false),
        _ => None,
    }
}

/// Errors of the GPU backend.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The backend cannot run here (library, device or feature missing).
    #[error("CUDA backend unavailable: {0}")]
    Unavailable(String),
    /// NVRTC rejected a kernel program; the compiler log is included.
    #[error("NVRTC failed to compile {program}: {log}")]
    Compile {
        /// Which program.
        program: String,
        /// NVRTC's log.
        log: String,
    },
    /// A CUDA driver, cuBLAS or cuFile call failed.
    #[error("{0}")]
    Cuda(String),
    /// Reading a layer file failed.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The OS error (in the message, not chained as a source, so it is printed once).
        error: std::io::Error,
    },
    /// Opening the model directory or reading a layer through gds-io failed (the error
    /// names the file).
    #[error(transparent)]
    Layer(gds_io::IoError),
    /// The model cannot run on the GPU as given (unsupported dtype, budget too small, ...).
    #[error("{0}")]
    Model(String),
}

/// cuFile refuses descriptors opened with `O_NOFOLLOW` (cuFileHandleRegister: "fd opened
/// with unsupported flags", seen on an H200 with GDS 1.15), which gds-io's in-directory
/// open sets so that no symlink is followed. The file is opened again through its
/// `/proc/self/fd` link: that names the inode already opened, so no path lookup an
/// attacker could redirect takes place, and the new descriptor has only `O_DIRECT`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn reopen_for_cufile(
    f: &std::fs::File,
    path: &std::path::Path,
) -> Result<std::fs::File, GpuError> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .map_err(|error| {
            GpuError::Layer(gds_io::IoError::File {
                path: path.to_path_buf(),
                error,
            })
        })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::io::AsRawFd;

    #[test]
    fn the_cufile_descriptor_is_the_same_file_without_o_nofollow() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("l.bin"), vec![7u8; 8192]).unwrap();
        let f = gds_io::open_in_dir(dir.path(), "l.bin", 0).unwrap();
        let flags = |f: &std::fs::File| {
            // SAFETY: F_GETFL only reads the open file's status flags.
            unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) }
        };
        assert_ne!(
            flags(&f) & libc::O_NOFOLLOW,
            0,
            "gds-io opens with O_NOFOLLOW"
        );
        let g = super::reopen_for_cufile(&f, &dir.path().join("l.bin")).unwrap();
        assert_eq!(flags(&g) & libc::O_NOFOLLOW, 0);
        assert_ne!(flags(&g) & libc::O_DIRECT, 0);
        assert_eq!(f.metadata().unwrap().ino(), g.metadata().unwrap().ino());
    }
}
