//! `gdsconv inspect`: architecture, hyperparameters, a per-layer table and totals, and the
//! effective bits per weight, of the model and per dtype.

use crate::validate::read_manifest;
use gds_format::{Manifest, Value};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// One layer's line in the table.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSummary {
    /// Layer name.
    pub name: String,
    /// Data file.
    pub file: String,
    /// Number of tensors.
    pub tensors: usize,
    /// Count of tensors per dtype.
    pub dtypes: BTreeMap<String, usize>,
    /// Tensor bytes (without padding).
    pub tensor_bytes: u64,
    /// File length.
    pub file_bytes: u64,
}

/// One tensor, for `--tensors`.
#[derive(Clone, Debug, Serialize)]
pub struct TensorSummary {
    /// Name.
    pub name: String,
    /// Layer name.
    pub layer: String,
    /// Dtype name.
    pub dtype: String,
    /// Row-major shape.
    pub shape: Vec<u64>,
    /// Offset in the layer file.
    pub offset: u64,
    /// Byte length.
    pub nbytes: u64,
}

/// The tensors of one dtype, over the model.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DtypeTotals {
    /// Number of tensors.
    pub tensors: usize,
    /// Their elements (weights).
    pub parameters: u64,
    /// Their bytes (without padding).
    pub bytes: u64,
    /// `bytes * 8 / parameters`: the bits one weight of this dtype takes, block scales
    /// included (q4_0 4.5, q4_k 4.5, q6_k 6.5625, q8_0 8.5, f16 16).
    pub bits_per_weight: f64,
}

/// Everything `inspect` prints.
#[derive(Clone, Debug, Serialize)]
pub struct Inspection {
    /// Format version `major.minor`.
    pub format_version: String,
    /// `general.architecture`.
    pub architecture: String,
    /// All metadata, as JSON values.
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// Per-layer table.
    pub layers: Vec<LayerSummary>,
    /// Every tensor.
    pub tensors: Vec<TensorSummary>,
    /// Totals.
    pub total_tensors: usize,
    /// Sum of tensor bytes.
    pub total_tensor_bytes: u64,
    /// Sum of file lengths.
    pub total_file_bytes: u64,
    /// Parameter count (elements of all tensors).
    pub parameters: u64,
    /// Count of tensors per dtype over the model.
    pub dtypes: BTreeMap<String, usize>,
    /// The effective bits per weight of the whole model, as llama.cpp's "BPW": all tensor
    /// bytes × 8 ÷ all parameters (norms and other F32 tensors included).
    pub bits_per_weight: f64,
    /// Per dtype: tensors, parameters, bytes and bits per weight.
    pub by_dtype: BTreeMap<String, DtypeTotals>,
}

/// `bytes * 8 / weights`, 0 for no weights.
fn bits_per_weight(bytes: u64, weights: u64) -> f64 {
    if weights == 0 {
        0.0
    } else {
        bytes as f64 * 8.0 / weights as f64
    }
}

/// Reads `dir` and summarizes it. Fails with a message naming the file when the manifest
/// cannot be parsed (run `validate` for the full list of problems).
pub fn inspect(dir: &Path) -> Result<Inspection, String> {
    let bytes = read_manifest(dir)?;
    let m = Manifest::parse(&bytes)
        .map_err(|e| format!("{}: {e}", dir.join(gds_format::MANIFEST_FILE).display()))?;
    let (maj, min) = m.version();
    let metadata = m
        .kvs()
        .map(|(k, v)| {
            let j = match v {
                Value::U64(x) => serde_json::json!(x),
                Value::I64(x) => serde_json::json!(x),
                Value::F64(x) => serde_json::json!(x),
                Value::Bool(x) => serde_json::json!(x),
                Value::Str(x) => serde_json::json!(x),
            };
            (k.to_string(), j)
        })
        .collect();
    let mut layers = Vec::new();
    let mut tensors = Vec::new();
    let mut dtypes = BTreeMap::new();
    let mut by_dtype: BTreeMap<String, DtypeTotals> = BTreeMap::new();
    let mut parameters = 0u64;
    for l in m.layers() {
        let mut s = LayerSummary {
            name: l.name.into(),
            file: l.file.into(),
            tensors: 0,
            dtypes: BTreeMap::new(),
            tensor_bytes: 0,
            file_bytes: l.file_size,
        };
        for i in l.tensors.clone() {
            let t = m.tensor(i).map_err(|e| e.to_string())?;
            s.tensors += 1;
            s.tensor_bytes += t.nbytes;
            *s.dtypes.entry(t.dtype.name().to_string()).or_default() += 1;
            *dtypes.entry(t.dtype.name().to_string()).or_default() += 1;
            parameters += t.n_elements();
            let d = by_dtype
                .entry(t.dtype.name().to_string())
                .or_insert(DtypeTotals {
                    tensors: 0,
                    parameters: 0,
                    bytes: 0,
                    bits_per_weight: 0.0,
                });
            d.tensors += 1;
            d.parameters += t.n_elements();
            d.bytes += t.nbytes;
            tensors.push(TensorSummary {
                name: t.name.into(),
                layer: l.name.into(),
                dtype: t.dtype.name().into(),
                shape: t.dims().to_vec(),
                offset: t.offset,
                nbytes: t.nbytes,
            });
        }
        layers.push(s);
    }
    for d in by_dtype.values_mut() {
        d.bits_per_weight = bits_per_weight(d.bytes, d.parameters);
    }
    let total_tensor_bytes: u64 = layers.iter().map(|l| l.tensor_bytes).sum();
    Ok(Inspection {
        format_version: format!("{maj}.{min}"),
        architecture: m.get_str("general.architecture").unwrap_or("?").to_string(),
        metadata,
        total_tensors: tensors.len(),
        total_tensor_bytes,
        bits_per_weight: bits_per_weight(total_tensor_bytes, parameters),
        by_dtype,
        total_file_bytes: layers.iter().map(|l| l.file_bytes).sum(),
        layers,
        tensors,
        parameters,
        dtypes,
    })
}
