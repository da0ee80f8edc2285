//! DLPack export (<https://dmlc.github.io/dlpack/latest/>): a capsule that hands a consumer
//! (NumPy, PyTorch) a pointer to bytes this module owns, without copying them. The capsule's
//! context holds what keeps the bytes alive (a mapped layer file, or a buffer of results);
//! the consumer's call of the deleter (or the capsule's destructor when nobody consumed it)
//! releases it. Tensors loaded onto a GPU export device memory the same way (device type
//! CUDA), the capsule holding the layer's device buffer.

use crate::cuda::{self, DeviceLayer};
use gds_format::DType;
use gds_io::LayerBytes;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};
use std::sync::Mutex;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const FLAG_READ_ONLY: u64 = 1;
const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

impl DLDataType {
    const U8: DLDataType = DLDataType::new(1, 8);
    const U16: DLDataType = DLDataType::new(1, 16);
    pub(crate) const F32: DLDataType = DLDataType::new(2, 32);

    const fn new(code: u8, bits: u8) -> DLDataType {
        DLDataType {
            code,
            bits,
            lanes: 1,
        }
    }

    fn bytes(self) -> usize {
        usize::from(self.bits) / 8
    }
}

/// How a tensor of `dtype` and `shape` (row-major) is exported: its element type and shape.
/// Block-quantized types are rows of raw block bytes (`uint8`, the last dimension replaced
/// by the bytes of one row). `numpy`: bfloat16 as `uint16` bits (NumPy has no bfloat16).
pub(crate) fn layout(dtype: DType, shape: &[u64], numpy: bool) -> (DLDataType, Vec<i64>) {
    let mut shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let t = match dtype {
        DType::F32 => DLDataType::F32,
        DType::F16 => DLDataType::new(2, 16),
        DType::F64 => DLDataType::new(2, 64),
        DType::BF16 if numpy => DLDataType::U16,
        DType::BF16 => DLDataType::new(4, 16),
        DType::I8 => DLDataType::new(0, 8),
        DType::I16 => DLDataType::new(0, 16),
        DType::I32 => DLDataType::new(0, 32),
        DType::I64 => DLDataType::new(0, 64),
        _ => {
            if let Some(last) = shape.last_mut() {
                *last = dtype.row_bytes(*last as u64).unwrap_or(0) as i64;
            }
            DLDataType::U8
        }
    };
    (t, shape)
}

/// What keeps exported bytes alive.
pub(crate) enum Keep {
    /// A span of a mapped layer file (read-only).
    Layer(LayerBytes),
    /// Results computed here (dequantized weights), handed over once, writable.
    Floats(Vec<f32>),
    /// `len` bytes from `offset` of a layer in GPU memory (read-only).
    Device(DeviceLayer, u64, usize),
}

impl Keep {
    fn ptr_len(&self) -> (*mut c_void, usize) {
        match self {
            Keep::Layer(b) => (b.as_ptr() as *mut c_void, b.len()),
            Keep::Floats(v) => (v.as_ptr() as *mut c_void, v.len() * 4),
            Keep::Device(d, off, len) => (cuda::ptr(d, *off) as usize as *mut c_void, *len),
        }
    }

    /// DLPack's (device type, device id) of the bytes.
    fn device(&self) -> (i32, i32) {
        match self {
            Keep::Layer(_) | Keep::Floats(_) => (KDL_CPU, 0),
            Keep::Device(d, _, _) => (KDL_CUDA, cuda::ordinal(d) as i32),
        }
    }

    /// Another handle on shared bytes (a layer span, host or device); `None` for results
    /// that are handed over once.
    fn share(&self) -> Option<Keep> {
        match self {
            Keep::Layer(b) => Some(Keep::Layer(b.clone())),
            Keep::Device(d, off, len) => Some(Keep::Device(d.clone(), *off, *len)),
            Keep::Floats(_) => None,
        }
    }
}

/// The context of one exported capsule: the owner of the bytes, shape and strides.
struct Ctx {
    _keep: Keep,
    dims: Vec<i64>,
}

/// SAFETY (for both deleters): `m` was made by [`capsule`] with `Box::into_raw`, and its
/// `manager_ctx` likewise; DLPack calls the deleter exactly once.
unsafe extern "C" fn delete_plain(m: *mut DLManagedTensor) {
    // SAFETY: see above.
    let m = unsafe { Box::from_raw(m) };
    // SAFETY: see above.
    drop(unsafe { Box::from_raw(m.manager_ctx as *mut Ctx) });
}

unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    // SAFETY: see `delete_plain`.
    let m = unsafe { Box::from_raw(m) };
    // SAFETY: see `delete_plain`.
    drop(unsafe { Box::from_raw(m.manager_ctx as *mut Ctx) });
}

/// The capsule's destructor: a capsule still named `dltensor[_versioned]` was never
/// consumed, so its tensor is deleted here; a consumer renames it `used_…` and deletes the
/// tensor itself.
unsafe extern "C" fn destroy_capsule(cap: *mut ffi::PyObject) {
    // SAFETY: Python calls this with the GIL held and a live capsule; IsValid sets no error,
    // and GetPointer of a valid capsule of that name cannot fail. The pointers were made by
    // `capsule` with these names and deleters.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m)
            }
        } else if ffi::PyCapsule_IsValid(cap, NAME_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, NAME_VERSIONED.as_ptr())
                as *mut DLManagedTensorVersioned;
            if let Some(d) = (*m).deleter {
                d(m)
            }
        }
    }
}

/// A DLPack capsule of `keep`'s bytes as a row-major tensor.
fn capsule<'py>(
    py: Python<'py>,
    keep: Keep,
    dtype: DLDataType,
    shape: Vec<i64>,
    versioned: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let (data, len) = keep.ptr_len();
    let n: i64 = shape.iter().product();
    if n as usize * dtype.bytes() != len {
        return Err(PyValueError::new_err(format!(
            "internal: {len} bytes for shape {shape:?}"
        )));
    }
    let read_only = !matches!(keep, Keep::Floats(_));
    let (device_type, device_id) = keep.device();
    let ndim = shape.len();
    let mut strides = vec![1i64; ndim];
    for i in (0..ndim.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let mut dims = shape;
    dims.extend(strides);
    let ctx = Box::new(Ctx { _keep: keep, dims });
    let dims_ptr = ctx.dims.as_ptr() as *mut i64;
    let tensor = DLTensor {
        data,
        device: DLDevice {
            device_type,
            device_id,
        },
        ndim: ndim as i32,
        dtype,
        shape: dims_ptr,
        // SAFETY: `dims` holds 2 * ndim entries.
        strides: unsafe { dims_ptr.add(ndim) },
        byte_offset: 0,
    };
    let manager_ctx = Box::into_raw(ctx) as *mut c_void;
    let (ptr, name, delete): (*mut c_void, &CStr, Box<dyn FnOnce()>) = if versioned {
        let m = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx,
            deleter: Some(delete_versioned),
            flags: if read_only { FLAG_READ_ONLY } else { 0 },
            dl_tensor: tensor,
        }));
        // SAFETY: `m` is the box just made, deleted at most once (here or by the capsule).
        let del = Box::new(move || unsafe { delete_versioned(m) });
        (m as *mut c_void, NAME_VERSIONED, del)
    } else {
        let m = Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx,
            deleter: Some(delete_plain),
        }));
        // SAFETY: as above.
        let del = Box::new(move || unsafe { delete_plain(m) });
        (m as *mut c_void, NAME, del)
    };
    // SAFETY: `name` is a static C string, `ptr` is non-null, and the destructor matches the
    // pointer's type by name; on failure nothing owns `ptr`, so it is deleted here.
    unsafe {
        let cap = ffi::PyCapsule_New(ptr, name.as_ptr(), Some(destroy_capsule));
        Bound::from_owned_ptr_or_err(py, cap).inspect_err(|_| delete())
    }
}

/// Bytes ready to be handed to a DLPack consumer (`numpy.from_dlpack(x)`,
/// `torch.from_dlpack(x)`): what `Tensor.__dlpack__`, `Tensor.numpy()` and
/// `Tensor.dequantize()` export through.
#[pyclass(module = "gdsllm._gdsllm")]
pub struct Export {
    /// Taken by the first `__dlpack__` for owned results (handed over once).
    keep: Mutex<Option<Keep>>,
    /// A layer span (host or device), exported any number of times.
    shared: Option<Keep>,
    dtype: DLDataType,
    shape: Vec<i64>,
}

impl Export {
    /// An export of a read-only layer span.
    pub(crate) fn layer(bytes: LayerBytes, dtype: DLDataType, shape: Vec<i64>) -> Export {
        Export {
            keep: Mutex::new(None),
            shared: Some(Keep::Layer(bytes)),
            dtype,
            shape,
        }
    }

    /// An export of `len` bytes from `offset` of a layer on a GPU (read-only).
    pub(crate) fn device(
        d: DeviceLayer,
        offset: u64,
        len: usize,
        dtype: DLDataType,
        shape: Vec<i64>,
    ) -> Export {
        Export {
            keep: Mutex::new(None),
            shared: Some(Keep::Device(d, offset, len)),
            dtype,
            shape,
        }
    }

    /// Where the bytes are, as DLPack's (device type, device id).
    fn where_(&self) -> (i32, i32) {
        self.shared.as_ref().map_or((KDL_CPU, 0), Keep::device)
    }

    /// A one-time export of computed floats.
    pub(crate) fn floats(v: Vec<f32>, shape: Vec<i64>) -> Export {
        Export {
            keep: Mutex::new(Some(Keep::Floats(v))),
            shared: None,
            dtype: DLDataType::F32,
            shape,
        }
    }
}

/// The DLPack protocol's arguments, checked: whether the consumer takes versioned capsules.
pub(crate) fn check_args(
    on: (i32, i32),
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<bool> {
    if let Some(d) = dl_device {
        if d != on {
            let place = if on.0 == KDL_CUDA {
                format!("on cuda:{} (device {on:?})", on.1)
            } else {
                format!("on the CPU (device {on:?})")
            };
            return Err(PyBufferError::new_err(format!(
                "this gdsllm tensor is {place}, not on device {d:?} (no copies are made)"
            )));
        }
    }
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "gdsllm exports tensors without copying (copy=True is not supported)",
        ));
    }
    Ok(max_version.is_some_and(|(major, _)| major >= 1))
}

#[pymethods]
impl Export {
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Host memory, or device memory whose load completed (synchronized) before the
        // tensor existed: nothing for the consumer's stream to wait for.
        let _ = stream;
        let versioned = check_args(self.where_(), max_version, dl_device, copy)?;
        let keep = match self.shared.as_ref().and_then(Keep::share) {
            Some(k) => k,
            None => self
                .keep
                .lock()
                .map_err(|_| PyBufferError::new_err("poisoned"))?
                .take()
                .ok_or_else(|| PyBufferError::new_err("this result was already exported"))?,
        };
        capsule(py, keep, self.dtype, self.shape.clone(), versioned)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.where_()
    }
}

/// `numpy.from_dlpack(export)`.
pub(crate) fn to_numpy<'py>(py: Python<'py>, e: Export) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    np.call_method1("from_dlpack", (Bound::new(py, e)?,))
}
