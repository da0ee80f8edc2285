//! `gdsllm.open`: a model directory read as gdsrun reads it (the manifest validated by
//! gds-runtime, every layer file mapped and its hash checked by gds-io's mmap backend), its
//! tensors handed out as spans of the mappings.

use crate::cuda::{self, DeviceLayer, Io, LayerSourceSpec};
use crate::dlpack::{self, Export};
use crate::{err, fork_guard, path_arg};
use gds_format::{DType, Value};
use gds_io::{LayerBytes, LayerSource, MmapBackend, Span, Verifier, VerifyMode};
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Resolves MODEL as gdsrun does: a model directory, a `.gguf` file (converted into the
/// store on first use) or a registry reference (pulled into the store on first use).
pub(crate) fn resolve_model(py: Python<'_>, spec: &str, plain_http: bool) -> PyResult<PathBuf> {
    let opts = gds_dist::resolve::ResolveOptions {
        remote: gds_dist::registry::RemoteOptions {
            plain_http,
            ..Default::default()
        },
        quiet: false,
    };
    py.detach(|| gds_dist::resolve::resolve_model(spec, &opts))
        .map_err(err)
}

/// The model directory MODEL stands for, as gdsrun resolves it (a directory as is; a
/// `.gguf` file converted into the store, and a registry reference pulled into it, on first
/// use).
#[pyfunction]
#[pyo3(signature = (model, *, plain_http=false))]
pub fn resolve(py: Python<'_>, model: &Bound<'_, PyAny>, plain_http: bool) -> PyResult<String> {
    fork_guard("resolve")?;
    let model = path_arg(model, "model")?;
    Ok(resolve_model(py, &model, plain_http)?.display().to_string())
}

/// Pulls the registry reference `reference` (REGISTRY/REPOSITORY:TAG or @sha256:DIGEST) and
/// returns the model directory: with no `out_dir`, into the store as gdsrun pulls a reference
/// on first use (but asking the registry again: a tag that moved is followed, blobs the store
/// holds are not fetched again), and the reference then names it for `open`, `Engine` and
/// gdsrun; with `out_dir`, into that directory as `gdsconv pull REFERENCE OUT_DIR` (`force`:
/// replace it). Errors are gdsrun's (or gdsconv's) messages.
#[pyfunction]
#[pyo3(signature = (reference, out_dir=None, *, plain_http=false, force=false,
    limit_rate=None, timeout=None))]
pub fn pull(
    py: Python<'_>,
    reference: &str,
    out_dir: Option<PathBuf>,
    plain_http: bool,
    force: bool,
    limit_rate: Option<u64>,
    timeout: Option<f64>,
) -> PyResult<String> {
    let timeout = match timeout {
        None => None,
        Some(t) => Some(
            std::time::Duration::try_from_secs_f64(t)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    pyo3::exceptions::PyValueError::new_err(format!(
                        "timeout: {t}: a positive number of seconds (at most {})",
                        u64::MAX
                    ))
                })?,
        ),
    };
    fork_guard("pull")?;
    let opts = gds_dist::registry::RemoteOptions {
        plain_http,
        limit_rate,
        limits: gds_dist::registry::Limits {
            timeout: timeout.or(gds_dist::registry::Limits::default().timeout),
            ..Default::default()
        },
        ..Default::default()
    };
    let dir = py
        .detach(|| -> gds_dist::error::Result<PathBuf> {
            if !gds_dist::registry::looks_like_reference(reference) {
                return Err(gds_dist::DistError::usage(format!(
                    "{reference}: not a registry reference (REGISTRY/REPOSITORY:TAG or @sha256:…)"
                )));
            }
            let store = gds_dist::store::Store::open_default()?;
            let remote = gds_dist::registry::Remote::new(reference, opts)?;
            match out_dir {
                Some(out) => Ok(remote.pull(&store, &out, force)?.output),
                // the reference recorded under the pull's own lock of the store (a refused
                // package's blobs are then removed at once, as for `gdsrun REF`)
                None => Ok(remote.pull_into_store_as(&store, reference)?.output),
            }
        })
        .map_err(err)?;
    Ok(dir.display().to_string())
}

/// An owned key/value of the manifest.
enum Kv {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
}

impl<'py> IntoPyObject<'py> for &Kv {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Kv::U64(v) => v.into_pyobject(py)?.into_any(),
            Kv::I64(v) => v.into_pyobject(py)?.into_any(),
            Kv::F64(v) => v.into_pyobject(py)?.into_any(),
            Kv::Bool(v) => v.into_pyobject(py)?.to_owned().into_any(),
            Kv::Str(v) => v.into_pyobject(py)?.into_any(),
        })
    }
}

/// One tensor's record.
#[derive(Clone)]
struct TensorMeta {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    layer: usize,
    offset: u64,
    nbytes: u64,
}

/// One layer's record and its mapped bytes.
struct LayerMeta {
    name: String,
    file: String,
    kind: u32,
    block: u32,
    tensors: std::ops::Range<usize>,
    file_size: u64,
}

struct Inner {
    dir: PathBuf,
    arch: String,
    hparams: serde_json::Value,
    metadata: Vec<(String, Kv)>,
    layers: Vec<LayerMeta>,
    tensors: Vec<TensorMeta>,
    by_name: BTreeMap<String, usize>,
    verified: bool,
    /// Every layer file mapped (and checked); tensors are spans of the mappings.
    backend: MmapBackend,
    /// cuFile's driver, held open from the first `io="gds"` load.
    gds: cuda::GdsSession,
}

/// Opens `dir` (already resolved). Errors read as gdsrun's after `loading DIR: `.
fn open_dir(dir: &Path, verify: bool) -> Result<Inner, String> {
    let loading = |e: &dyn std::fmt::Display| format!("loading {}: {e}", dir.display());
    let bytes = gds_io::read_manifest(dir).map_err(|e| loading(&e))?;
    let m = gds_runtime::model_dir::parse_manifest(dir, &bytes).map_err(|e| loading(&e))?;
    let cfg = gds_runtime::Config::from_manifest(&m)
        .map_err(|e| loading(&gds_runtime::model_dir::with_dir(e, dir)))?;
    let mode = if verify {
        VerifyMode::Hash
    } else {
        VerifyMode::Off
    };
    let backend = MmapBackend::open_with(dir, &m, &Verifier::new(mode))
        .map_err(|e| loading(&gds_runtime::RuntimeError::from(e)))?;
    let layers = m
        .layers()
        .map(|l| LayerMeta {
            name: l.name.to_string(),
            file: l.file.to_string(),
            kind: l.kind,
            block: l.block,
            tensors: l.tensors.clone(),
            file_size: l.file_size,
        })
        .collect();
    let tensors: Vec<TensorMeta> = m
        .tensors()
        .map(|t| TensorMeta {
            name: t.name.to_string(),
            dtype: t.dtype,
            shape: t.dims().to_vec(),
            layer: t.layer,
            offset: t.offset,
            nbytes: t.nbytes,
        })
        .collect();
    let metadata = m
        .kvs()
        .map(|(k, v)| {
            let v = match v {
                Value::U64(x) => Kv::U64(x),
                Value::I64(x) => Kv::I64(x),
                Value::F64(x) => Kv::F64(x),
                Value::Bool(x) => Kv::Bool(x),
                Value::Str(x) => Kv::Str(x.to_string()),
            };
            (k.to_string(), v)
        })
        .collect();
    Ok(Inner {
        dir: dir.to_path_buf(),
        arch: cfg.arch.clone(),
        hparams: serde_json::to_value(&cfg).map_err(|e| loading(&e))?,
        metadata,
        by_name: tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect(),
        layers,
        tensors,
        verified: verify,
        backend,
        gds: Default::default(),
    })
}

/// A JSON value as a Python object (through the `json` module).
pub(crate) fn json_to_py<'py>(
    py: Python<'py>,
    v: &serde_json::Value,
) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?
        .call_method1("loads", (serde_json::to_string(v).map_err(err)?,))
}

/// Opens a model: MODEL is a model directory, a `.gguf` file or a registry reference,
/// resolved as gdsrun resolves it. Every layer file is mapped read-only and, unless
/// `verify=False`, checked against the manifest's BLAKE3 hash (files the per-user cache
/// recorded as checked are not hashed again), as gdsrun does.
#[pyfunction]
#[pyo3(signature = (model, *, verify=true, plain_http=false))]
pub fn open(
    py: Python<'_>,
    model: &Bound<'_, PyAny>,
    verify: bool,
    plain_http: bool,
) -> PyResult<Model> {
    fork_guard("open")?;
    let model = path_arg(model, "model")?;
    let dir = resolve_model(py, &model, plain_http)?;
    let inner = py.detach(|| open_dir(&dir, verify)).map_err(err)?;
    Ok(Model {
        inner: Arc::new(inner),
    })
}

/// A model opened by `gdsllm.open`: its metadata, layers and tensors (each a read-only,
/// zero-copy view of a mapped layer file).
#[pyclass(module = "gdsllm._gdsllm", frozen)]
pub struct Model {
    inner: Arc<Inner>,
}

impl Model {
    fn tensor_at(&self, i: usize) -> PyResult<Tensor> {
        let t = &self.inner.tensors[i];
        let l = &self.inner.layers[t.layer];
        let bytes = self
            .inner
            .backend
            .acquire_span(Span {
                layer: t.layer,
                offset: t.offset,
                len: t.nbytes,
            })
            .map_err(|e| err(format!("tensor {}: {e}", t.name)))?;
        Ok(Tensor {
            meta: t.clone(),
            layer_name: l.name.clone(),
            file: self.inner.dir.join(&l.file).display().to_string(),
            bytes,
            device: None,
        })
    }

    /// The layer index `layer` names (an int index or a layer name).
    fn layer_index(&self, layer: &Bound<'_, PyAny>) -> PyResult<usize> {
        use pyo3::types::{PyBool, PyInt, PyString};
        let n = self.inner.layers.len();
        if layer.is_instance_of::<PyString>() {
            let name: String = layer.extract()?;
            return self
                .inner
                .layers
                .iter()
                .position(|l| l.name == name)
                .ok_or_else(|| PyKeyError::new_err(format!("no layer named {name:?}")));
        }
        // an int (any size, negative too), not a bool (an int to Python, but no index)
        if !layer.is_instance_of::<PyInt>() || layer.is_instance_of::<PyBool>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "layer: an int index (0..{n}) or a layer name (str), not {}",
                layer
                    .get_type()
                    .name()
                    .map(|t| t.to_string())
                    .unwrap_or_else(|_| "this".into())
            )));
        }
        match layer.extract::<usize>() {
            Ok(i) if i < n => Ok(i),
            _ => Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "layer {layer}: out of range, the model has {n} layers (0..={})",
                n.saturating_sub(1)
            ))),
        }
    }

    /// Layer `idx`'s bytes placed on CUDA device `device` by `io`, and its tensors on it.
    fn load_on_gpu(
        &self,
        py: Python<'_>,
        idx: usize,
        device: usize,
        io: Io,
    ) -> PyResult<Vec<Tensor>> {
        let inner = &self.inner;
        let l = &inner.layers[idx];
        if !cuda::BUILT_WITH_CUDA {
            return Err(err(cuda::no_cuda(device, io, &inner.dir.join(&l.file))));
        }
        fork_guard("Model.load")?;
        let loaded = py.detach(|| -> Result<DeviceLayer, String> {
            // the bytes a host copy starts from: the mapping, or a fresh O_DIRECT read
            let host = match io {
                Io::Mmap => Some(
                    inner
                        .backend
                        .acquire_span(Span {
                            layer: idx,
                            offset: 0,
                            len: l.file_size,
                        })
                        .map_err(|e| e.to_string())?,
                ),
                Io::Direct => Some(read_direct(inner, idx)?),
                Io::Gds => None,
            };
            cuda::load(
                device,
                &LayerSourceSpec {
                    dir: &inner.dir,
                    file: &l.file,
                    size: l.file_size,
                    host,
                },
                &inner.gds,
            )
        });
        let d = loaded.map_err(err)?;
        l.tensors
            .clone()
            .map(|i| {
                Ok(Tensor {
                    device: Some(d.clone()),
                    ..self.tensor_at(i)?
                })
            })
            .collect()
    }
}

/// Layer `idx` of `inner` read whole with O_DIRECT (through the page cache, its pages
/// dropped, where the filesystem refuses O_DIRECT), checked as the model was.
fn read_direct(inner: &Inner, idx: usize) -> Result<LayerBytes, String> {
    let bytes = gds_io::read_manifest(&inner.dir).map_err(|e| e.to_string())?;
    let m =
        gds_runtime::model_dir::parse_manifest(&inner.dir, &bytes).map_err(|e| e.to_string())?;
    let mode = if inner.verified {
        VerifyMode::Hash
    } else {
        VerifyMode::Off
    };
    let src = gds_io::DirectBackend::open(
        &inner.dir,
        &m,
        &gds_io::DirectOptions {
            resident: (0..inner.layers.len()).map(|i| i == idx).collect(),
            verifier: Some(Arc::new(Verifier::new(mode))),
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    src.acquire_span(Span {
        layer: idx,
        offset: 0,
        len: inner.layers[idx].file_size,
    })
    .map_err(|e| e.to_string())
}

#[pymethods]
impl Model {
    /// The model directory.
    #[getter]
    fn path(&self) -> String {
        self.inner.dir.display().to_string()
    }

    /// `general.architecture`.
    #[getter]
    fn architecture(&self) -> &str {
        &self.inner.arch
    }

    /// Whether the layer files were checked against the manifest's hashes (False after
    /// `open(..., verify=False)`).
    #[getter]
    fn verified(&self) -> bool {
        self.inner.verified
    }

    /// The hyperparameters the runtime computes with (gds-runtime's `Config`), a dict.
    #[getter]
    fn hyperparameters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_py(py, &self.inner.hparams)
    }

    /// Every key/value of the manifest (GGUF-style keys), a dict.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.inner.metadata {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The weights' types: {dtype name: {"tensors": count, "bytes": bytes}}, as the plan's
    /// `weight_dtypes`.
    #[getter]
    fn quantization<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut sum: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
        for t in &self.inner.tensors {
            let e = sum.entry(t.dtype.name()).or_default();
            e.0 += 1;
            e.1 += t.nbytes;
        }
        let d = PyDict::new(py);
        for (k, (n, b)) in sum {
            let e = PyDict::new(py);
            e.set_item("tensors", n)?;
            e.set_item("bytes", b)?;
            d.set_item(k, e)?;
        }
        Ok(d)
    }

    /// The layers, in file order: dicts with name, file, kind, block, size, tensors (names).
    #[getter]
    fn layers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for l in &self.inner.layers {
            let d = PyDict::new(py);
            d.set_item("name", &l.name)?;
            d.set_item("file", &l.file)?;
            d.set_item("kind", l.kind)?;
            d.set_item("block", l.block)?;
            d.set_item("size", l.file_size)?;
            let names: Vec<&str> = self.inner.tensors[l.tensors.clone()]
                .iter()
                .map(|t| t.name.as_str())
                .collect();
            d.set_item("tensors", names)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// The tensors, in manifest order.
    #[getter]
    fn tensors(&self) -> PyResult<Vec<Tensor>> {
        (0..self.inner.tensors.len())
            .map(|i| self.tensor_at(i))
            .collect()
    }

    /// The tensor named `name`; KeyError when there is none.
    fn tensor(&self, name: &str) -> PyResult<Tensor> {
        match self.inner.by_name.get(name) {
            Some(&i) => self.tensor_at(i),
            None => Err(PyKeyError::new_err(format!(
                "{}: no tensor named {name:?}",
                self.inner.dir.display()
            ))),
        }
    }

    fn __getitem__(&self, name: &str) -> PyResult<Tensor> {
        self.tensor(name)
    }

    fn __contains__(&self, name: &str) -> bool {
        self.inner.by_name.contains_key(name)
    }

    fn __len__(&self) -> usize {
        self.inner.tensors.len()
    }

    fn keys(&self) -> Vec<String> {
        self.inner.tensors.iter().map(|t| t.name.clone()).collect()
    }

    /// The tensors of a layer (an index or a layer name), or of every layer, on `device`:
    /// `"cpu"` (views of the mapped files; `io` must be `"mmap"`) or `"cuda"` / `"cuda:N"`
    /// (each layer file's bytes in one buffer of GPU memory, read by `io`: `"gds"` with
    /// cuFile straight into VRAM, `"direct"` with O_DIRECT through host memory, `"mmap"` from
    /// the mapping; the tensors export CUDA DLPack capsules and keep the buffer alive). A
    /// build without CUDA, or a machine without a usable GPU, raises `GdsError` naming what
    /// is missing.
    #[pyo3(signature = (layer=None, *, device="cpu", io="mmap"))]
    fn load(
        &self,
        py: Python<'_>,
        layer: Option<Bound<'_, PyAny>>,
        device: &str,
        io: &str,
    ) -> PyResult<Vec<Tensor>> {
        let gpu = cuda::parse_device(device).map_err(pyo3::exceptions::PyValueError::new_err)?;
        let io = Io::parse(io).map_err(pyo3::exceptions::PyValueError::new_err)?;
        let layers: Vec<usize> = match &layer {
            Some(l) => vec![self.layer_index(l)?],
            None => (0..self.inner.layers.len()).collect(),
        };
        match gpu {
            None => {
                if io != Io::Mmap {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "device=\"cpu\" hands out views of the mapped files (io=\"mmap\"), \
                         not io={:?}",
                        format!("{io:?}").to_lowercase()
                    )));
                }
                let mut out = Vec::new();
                for idx in layers {
                    for i in self.inner.layers[idx].tensors.clone() {
                        out.push(self.tensor_at(i)?);
                    }
                }
                Ok(out)
            }
            Some(n) => {
                let mut out = Vec::new();
                for idx in layers {
                    out.extend(self.load_on_gpu(py, idx, n, io)?);
                }
                Ok(out)
            }
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<gdsllm.Model {} ({}, {} layers, {} tensors)>",
            self.inner.dir.display(),
            self.inner.arch,
            self.inner.layers.len(),
            self.inner.tensors.len()
        )
    }
}

/// One tensor: its record and a read-only view of its bytes in the mapped layer file (the
/// mapping stays alive as long as the tensor, or any array made from it, does).
#[pyclass(module = "gdsllm._gdsllm", frozen)]
pub struct Tensor {
    meta: TensorMeta,
    layer_name: String,
    file: String,
    bytes: LayerBytes,
    /// The layer's bytes on a GPU, when loaded there (`Model.load(device="cuda:N")`).
    device: Option<DeviceLayer>,
}

#[pymethods]
impl Tensor {
    #[getter]
    fn name(&self) -> &str {
        &self.meta.name
    }

    /// Row-major shape (the last dimension is contiguous).
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.meta.shape.clone()
    }

    /// The element type's name (`f32`, `f16`, `bf16`, `q4_0`, `q4_k`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.meta.dtype.name()
    }

    /// True for block-quantized types.
    #[getter]
    fn quantized(&self) -> bool {
        self.meta.dtype.is_quantized()
    }

    /// Index of the layer (in the manifest's layer table) whose file holds the tensor.
    #[getter]
    fn layer(&self) -> usize {
        self.meta.layer
    }

    #[getter]
    fn layer_name(&self) -> &str {
        &self.layer_name
    }

    /// The layer file's path.
    #[getter]
    fn file(&self) -> &str {
        &self.file
    }

    /// Byte range in the layer file: (offset, end).
    #[getter]
    fn byte_range(&self) -> (u64, u64) {
        (self.meta.offset, self.meta.offset + self.meta.nbytes)
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.meta.nbytes
    }

    /// Address of the first byte: in the mapping, or in GPU memory for a tensor loaded
    /// onto a GPU.
    #[getter]
    fn data_ptr(&self) -> usize {
        match &self.device {
            Some(d) => cuda::ptr(d, self.meta.offset) as usize,
            None => self.bytes.as_ptr() as usize,
        }
    }

    /// `"cpu"`, or `"cuda:N"` for a tensor loaded onto a GPU.
    #[getter]
    fn device(&self) -> String {
        match &self.device {
            Some(d) => format!("cuda:{}", cuda::ordinal(d)),
            None => "cpu".into(),
        }
    }

    /// How the bytes reached the GPU: `"gds"` (cuFile, no host copy) or `"bounce"` (through
    /// host memory); `None` on the CPU.
    #[getter]
    fn load_path(&self) -> Option<&'static str> {
        self.device.as_ref().map(cuda::path)
    }

    /// A read-only NumPy array viewing the mapped bytes (no copy): float and integer types
    /// with their dtype and shape, bfloat16 as uint16 bits, block-quantized types as uint8
    /// rows of raw block bytes (shape[:-1] + [bytes per row]). Host memory only: a tensor
    /// on a GPU raises (`torch.from_dlpack(t)` gives the CUDA tensor).
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(d) = &self.device {
            return Err(err(format!(
                "{} is on cuda:{} (NumPy arrays live in host memory): torch.from_dlpack(t) \
                 gives the CUDA tensor, or load it with device=\"cpu\"",
                self.meta.name,
                cuda::ordinal(d)
            )));
        }
        let (t, shape) = dlpack::layout(self.meta.dtype, &self.meta.shape, true);
        dlpack::to_numpy(py, Export::layer(self.bytes.clone(), t, shape))
    }

    /// The weights as float32 (a new, writable array), dequantized by gds-kernels (equal to
    /// gguf-py's `gguf.quants.dequantize`); `dtype` converts the result (`astype`). Computed
    /// on the host from the mapped file, for a tensor on a GPU too.
    #[pyo3(signature = (dtype=None))]
    fn dequantize<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        fork_guard("Tensor.dequantize")?;
        let n = self.meta.shape.iter().product::<u64>() as usize;
        let dt = self.meta.dtype;
        let bytes = self.bytes.clone();
        let out = py
            .detach(|| {
                let mut v = vec![0f32; n];
                gds_kernels::dequantize(dt, &bytes, &mut v).map(|()| v)
            })
            .map_err(|e| err(format!("{}: {e}", self.meta.name)))?;
        let shape = self.meta.shape.iter().map(|&d| d as i64).collect();
        let a = dlpack::to_numpy(py, Export::floats(out, shape))?;
        match dtype {
            Some(d) => a.call_method1("astype", (d,)),
            None => Ok(a),
        }
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (t, shape) = dlpack::layout(self.meta.dtype, &self.meta.shape, false);
        let export = match &self.device {
            Some(d) => Export::device(d.clone(), self.meta.offset, self.bytes.len(), t, shape),
            None => Export::layer(self.bytes.clone(), t, shape),
        };
        Bound::new(py, export)?.call_method(
            "__dlpack__",
            (),
            Some(&{
                let kw = PyDict::new(py);
                kw.set_item("stream", stream)?;
                kw.set_item("max_version", max_version)?;
                kw.set_item("dl_device", dl_device)?;
                kw.set_item("copy", copy)?;
                kw
            }),
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        match &self.device {
            Some(d) => (2, cuda::ordinal(d) as i32),
            None => (1, 0),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<gdsllm.Tensor {} {} {:?} in {}>",
            self.meta.name,
            self.meta.dtype.name(),
            self.meta.shape,
            self.layer_name
        )
    }
}
