//! Layers placed in GPU memory for `Model.load(device="cuda:N")` (feature `cuda`): the
//! bytes of a layer file in one device buffer ([`gds_cuda::device_bytes`]), shared by the
//! tensors made from it and by every DLPack capsule exported from them, so the VRAM lives
//! as long as any of them. Without the feature, [`DeviceLayer`] has no values and every
//! request for a GPU is refused with what is missing.

use gds_io::LayerBytes;
use std::path::Path;

/// A layer file's bytes on a GPU (none exist in a build without CUDA).
#[cfg(feature = "cuda")]
pub(crate) type DeviceLayer = std::sync::Arc<gds_cuda::device_bytes::DeviceBytes>;

/// A layer file's bytes on a GPU: never made in a build without CUDA ([`load`] refuses).
#[cfg(not(feature = "cuda"))]
#[derive(Clone)]
#[allow(dead_code)]
pub(crate) struct DeviceLayer {
    ordinal: usize,
}

/// Holds cuFile's driver open for one model's `io="gds"` loads, from the first of them to
/// the model's end, so each layer's read does not open the driver again (in compatibility
/// mode that open cost ~0.7 s per layer on an H200: 22 s for SmolLM2's 32 layers against
/// 0.6–0.9 s through host memory, 2026-12-04).
#[derive(Default)]
pub(crate) struct GdsSession {
    #[cfg(feature = "cuda")]
    held: std::sync::Mutex<Option<gds_cuda::device_bytes::CufileSession>>,
}

/// Whether this build can place layers on a GPU.
pub(crate) const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

/// How a layer's bytes reach the GPU (`io=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Io {
    /// From the mapped file (page cache), one host→device copy.
    Mmap,
    /// Read with O_DIRECT into host memory, then one host→device copy.
    Direct,
    /// cuFile into the device buffer (GPUDirect Storage).
    Gds,
}

impl Io {
    pub(crate) fn parse(s: &str) -> Result<Io, String> {
        match s {
            "mmap" => Ok(Io::Mmap),
            "direct" => Ok(Io::Direct),
            "gds" => Ok(Io::Gds),
            other => Err(format!(
                "io={other:?}: expected \"mmap\", \"direct\" or \"gds\""
            )),
        }
    }
}

/// `"cpu"` → `None`; `"cuda"` / `"cuda:N"` → `Some(N)`.
pub(crate) fn parse_device(s: &str) -> Result<Option<usize>, String> {
    match s {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Some)
            .ok_or_else(|| format!("device={s:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")),
    }
}

/// The device address of byte `offset` of `d`.
pub(crate) fn ptr(d: &DeviceLayer, offset: u64) -> u64 {
    #[cfg(feature = "cuda")]
    return d.ptr() + offset;
    #[cfg(not(feature = "cuda"))]
    {
        let _ = d;
        offset
    }
}

/// `d`'s CUDA device ordinal.
pub(crate) fn ordinal(d: &DeviceLayer) -> usize {
    #[cfg(feature = "cuda")]
    return d.device();
    #[cfg(not(feature = "cuda"))]
    d.ordinal
}

/// How `d`'s bytes arrived: `"gds"` (cuFile) or `"bounce"` (through host memory).
pub(crate) fn path(d: &DeviceLayer) -> &'static str {
    #[cfg(feature = "cuda")]
    return d.path().name();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = d;
        "none"
    }
}

/// What one layer is loaded from.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct LayerSourceSpec<'a> {
    /// The model directory.
    pub dir: &'a Path,
    /// The layer file, relative to `dir`.
    pub file: &'a str,
    /// Its length.
    pub size: u64,
    /// The whole file in host memory, copied to the device from there (`io="mmap"`: the
    /// mapping, checked when the model was opened; `io="direct"`: an O_DIRECT read); `None`
    /// reads it with cuFile (`io="gds"`).
    pub host: Option<LayerBytes>,
}

/// Places one layer file's bytes on CUDA device `device`.
#[cfg(feature = "cuda")]
pub(crate) fn load(
    device: usize,
    src: &LayerSourceSpec<'_>,
    session: &GdsSession,
) -> Result<DeviceLayer, String> {
    use gds_cuda::device_bytes::{load, CufileSession, Source};
    let source = match &src.host {
        Some(bytes) => Source::Host(bytes),
        None => Source::Gds {
            dir: src.dir,
            file: src.file,
            size: usize::try_from(src.size).map_err(|e| e.to_string())?,
        },
    };
    if matches!(source, Source::Gds { .. }) {
        let mut held = session.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.is_none() {
            // a refusal here is the load's own (it probes and opens the same way) and is
            // reported by it below
            *held = CufileSession::open(device, src.dir).ok();
        }
    }
    load(device, source)
        .map(std::sync::Arc::new)
        .map_err(|e| format!("{}: {e}", src.dir.join(src.file).display()))
}

/// Places one layer file's bytes on CUDA device `device`: refused, this build has no CUDA
/// (`Model.load` refuses with [`no_cuda`] before reading anything; this keeps the call
/// compiling).
#[cfg(not(feature = "cuda"))]
pub(crate) fn load(
    device: usize,
    src: &LayerSourceSpec<'_>,
    _session: &GdsSession,
) -> Result<DeviceLayer, String> {
    Err(format!(
        "{}: device \"cuda:{device}\": this gdsllm package was built without CUDA support",
        src.dir.join(src.file).display()
    ))
}

/// Why a build without CUDA cannot load `file` onto `cuda:{device}`.
pub(crate) fn no_cuda(device: usize, io: Io, file: &Path) -> String {
    format!(
        "{}: device \"cuda:{device}\": this gdsllm package was built without CUDA support \
         (loading onto a GPU, io={:?}, is not available; build it with \
         `pip install . --config-settings=build-args=\"--features cuda\"`; tensors are on the CPU)",
        file.display(),
        format!("{io:?}").to_lowercase()
    )
}
