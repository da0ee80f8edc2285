//! `gdsconv validate`: every rule SPEC.md says a reader MUST check, over a model directory.
//! Structural rules come from `gds_format::validate`; this adds the file system, content
//! hashes, the architecture's required tensors and metadata, and the tokenizer.

use crate::names::llama;
use gds_format::validate::{validate_layer_file, validate_manifest};
use gds_format::{layer_kind, raw::MAX_MANIFEST_BYTES, Manifest, Value, MANIFEST_FILE};
use serde::Serialize;
use std::path::Path;
use std::str::FromStr;

/// How much to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// Everything except content hashes and loading the tokenizer (the converter's
    /// self-check, which has already loaded the tokenizer it writes).
    Structure,
    /// Everything except content hashes.
    Quick,
    /// Everything, hashing every data file.
    Full,
}

/// The outcome: `valid` is true exactly when `errors` is empty.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// True when no error was found.
    pub valid: bool,
    /// Rules broken.
    pub errors: Vec<String>,
    /// Things worth knowing that do not make the directory invalid.
    pub warnings: Vec<String>,
}

/// Reads the manifest of `dir` with the size cap applied before reading.
pub fn read_manifest(dir: &Path) -> Result<Vec<u8>, String> {
    let path = dir.join(MANIFEST_FILE);
    let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(format!(
            "{}: {} bytes exceeds the 64 MiB manifest limit",
            path.display(),
            meta.len()
        ));
    }
    std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Validates the directory `dir`.
pub fn validate_dir(dir: &Path, depth: Depth) -> Report {
    let mut r = Report::default();
    let bytes = match read_manifest(dir) {
        Ok(b) => b,
        Err(e) => {
            r.errors.push(e);
            return r;
        }
    };
    let mpath = dir.join(MANIFEST_FILE);
    let (m, errs) = validate_manifest(&bytes);
    r.errors
        .extend(errs.iter().map(|e| format!("{}: {e}", mpath.display())));
    let Some(m) = m else {
        return r;
    };
    if r.errors.is_empty() {
        check_layer_files(dir, &m, depth, &mut r);
        check_architecture(&m, &mut r);
    }
    if depth != Depth::Structure {
        check_tokenizer(dir, &m, &mut r);
    }
    r.valid = r.errors.is_empty();
    r
}

fn check_layer_files(dir: &Path, m: &Manifest<'_>, depth: Depth, r: &mut Report) {
    for l in m.layers() {
        let path = dir.join(l.file);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                r.errors.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if depth != Depth::Full || len != l.file_size {
            if len != l.file_size {
                r.errors.push(format!(
                    "{}: {} bytes, the manifest says {}",
                    path.display(),
                    len,
                    l.file_size
                ));
            }
            continue;
        }
        if len == 0 {
            continue;
        }
        // SAFETY: read-only mapping of a file we only read; it is dropped before returning.
        match unsafe { memmap2::Mmap::map(&file) } {
            Ok(map) => {
                for e in validate_layer_file(&l, &map, true) {
                    r.errors.push(format!("{}: {e}", path.display()));
                }
            }
            Err(e) => r.errors.push(format!("{}: {e}", path.display())),
        }
    }
}

fn check_architecture(m: &Manifest<'_>, r: &mut Report) {
    let arch = match m.get_str("general.architecture") {
        Ok(a) => a,
        Err(e) => {
            r.errors.push(e.to_string());
            return;
        }
    };
    if arch != "llama" {
        r.warnings.push(format!(
            "architecture {arch:?} is not one gdsrun can run; its required tensors are not checked"
        ));
        return;
    }
    let spec = llama();
    for (key, ty) in &spec.required_metadata {
        let ok = match (ty.as_str(), m.get(key)) {
            ("u64", Some(Value::U64(_)))
            | ("f64", Some(Value::F64(_)))
            | ("bool", Some(Value::Bool(_)))
            | ("string", Some(Value::Str(_))) => true,
            (_, None) => {
                r.errors.push(format!(
                    "metadata key {key:?} required by architecture llama is missing"
                ));
                continue;
            }
            _ => false,
        };
        if !ok {
            r.errors
                .push(format!("metadata key {key:?} must be of type {ty}"));
        }
    }
    let Ok(n_layers) = m.get_u64("model.n_layers") else {
        return;
    };
    let mut required: Vec<String> = spec.required_tensors.global.clone();
    if m.get_bool("model.tie_embeddings") == Ok(false) {
        required.push("output.weight".into());
    }
    for n in 0..n_layers {
        required.extend(
            spec.required_tensors
                .block
                .iter()
                .map(|p| p.replace("{N}", &n.to_string())),
        );
    }
    let present: std::collections::HashMap<&str, gds_format::TensorInfo<'_>> =
        m.tensors().map(|t| (t.name, t)).collect();
    for name in &required {
        if !present.contains_key(name.as_str()) {
            r.errors.push(format!(
                "tensor {name:?} required by architecture llama is missing"
            ));
        }
    }
    let blocks = m.layers().filter(|l| l.kind == layer_kind::BLOCK).count() as u64;
    if blocks != n_layers {
        r.errors.push(format!(
            "model.n_layers is {n_layers} but the layer table has {blocks} blocks"
        ));
    }
    // Shapes the runtime relies on.
    let g = |k: &str| m.get_u64(k).unwrap_or(0);
    let (embd, heads, kv, hd, ff, vocab) = (
        g("model.n_embd"),
        g("model.n_heads"),
        g("model.n_kv_heads"),
        g("model.head_dim"),
        g("model.n_ff"),
        g("model.vocab_size"),
    );
    let mut expect = vec![
        ("token_embd.weight".to_string(), vec![vocab, embd]),
        ("output_norm.weight".to_string(), vec![embd]),
    ];
    for n in 0..n_layers {
        let b = |s: &str| format!("blk.{n}.{s}");
        expect.push((b("attn_q.weight"), vec![heads * hd, embd]));
        expect.push((b("attn_k.weight"), vec![kv * hd, embd]));
        expect.push((b("attn_v.weight"), vec![kv * hd, embd]));
        expect.push((b("attn_output.weight"), vec![embd, heads * hd]));
        expect.push((b("ffn_gate.weight"), vec![ff, embd]));
        expect.push((b("ffn_up.weight"), vec![ff, embd]));
        expect.push((b("ffn_down.weight"), vec![embd, ff]));
        expect.push((b("attn_norm.weight"), vec![embd]));
        expect.push((b("ffn_norm.weight"), vec![embd]));
    }
    for (name, shape) in expect {
        if let Some(t) = present.get(name.as_str()) {
            if t.dims() != shape.as_slice() {
                r.errors.push(format!(
                    "tensor {name:?} has shape {:?}, the hyperparameters require {shape:?}",
                    t.dims()
                ));
            }
        }
    }
}

fn check_tokenizer(dir: &Path, m: &Manifest<'_>, r: &mut Report) {
    let path = dir.join("tokenizer.json");
    match std::fs::read_to_string(&path) {
        Err(e) => r.errors.push(format!("{}: {e}", path.display())),
        Ok(s) => match tokenizers::Tokenizer::from_str(&s) {
            Err(e) => r.errors.push(format!(
                "{}: does not load with the tokenizers library: {e}",
                path.display()
            )),
            Ok(t) => {
                if let Ok(v) = m.get_u64("model.vocab_size") {
                    let n = t.get_vocab_size(true) as u64;
                    if n > v {
                        r.errors.push(format!(
                            "{}: {n} tokens but the model's vocabulary has {v}",
                            path.display()
                        ));
                    }
                }
            }
        },
    }
    let cfg = dir.join("tokenizer_config.json");
    if let Ok(s) = std::fs::read_to_string(&cfg) {
        if serde_json::from_str::<serde_json::Value>(&s).is_err() {
            r.errors.push(format!("{}: not valid JSON", cfg.display()));
        }
    }
}
