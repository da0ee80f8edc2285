//! Reading a model directory's manifest and side files: the manifest parsed and validated
//! (every rule `gdsconv validate` checks), `tokenizer_config.json` as the manifest lists it,
//! and errors that name the directory. Below every module that opens a model (plan, model,
//! tokenizer, constraint, drafts, executors), so none of them reaches into another for it.

use crate::error::{Result, RuntimeError};
use gds_format::vocab::MAX_TOKENIZER_BYTES;
use gds_format::Manifest;
use std::path::Path;

/// Parses and validates a manifest held in memory, with every structural rule and every
/// rule of its architecture (`gds_format::arch::check_model`, the checks `gdsconv validate`
/// makes): a model `gdsconv validate` rejects is never opened. Errors name the directory.
pub fn parse_manifest<'a>(dir: &Path, bytes: &'a [u8]) -> Result<Manifest<'a>> {
    let (m, mut errs) = gds_format::validate::validate_manifest(bytes);
    if let (Some(m), true) = (&m, errs.is_empty()) {
        errs.extend(gds_format::arch::check_model(m).errors);
    }
    let bad = |why: String| RuntimeError::Manifest {
        dir: dir.display().to_string(),
        why,
    };
    match m {
        Some(m) if errs.is_empty() => Ok(m),
        _ => Err(bad(errs
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; "))),
    }
}

/// Reads `tokenizer_config.json` as the model lists it: checked against the manifest's hash
/// (format 1.1), absent when the manifest does not list it, and an error (never a silent
/// fallback) when it is unreadable, not UTF-8 or not a JSON object.
pub fn tokenizer_config(dir: &Path, m: &Manifest<'_>) -> Result<Option<serde_json::Value>> {
    let name = "tokenizer_config.json";
    let path = dir.join(name);
    let Some(f) = gds_io::read_model_file(dir, m, name, MAX_TOKENIZER_BYTES)? else {
        return Ok(None);
    };
    let bad = |why: String| RuntimeError::Tokenizer(format!("{}: {why}", path.display()));
    let text = std::str::from_utf8(&f.bytes).map_err(|e| bad(format!("not UTF-8: {e}")))?;
    match serde_json::from_str(text) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(Some(v)),
        Ok(_) => Err(bad("not a JSON object".into())),
        Err(e) => Err(bad(format!("not valid JSON: {e}"))),
    }
}

/// Puts `dir` into a manifest error that was made without it.
pub fn with_dir(e: RuntimeError, dir: &Path) -> RuntimeError {
    match e {
        RuntimeError::Manifest { dir: d, why } if d.is_empty() => RuntimeError::Manifest {
            dir: dir.display().to_string(),
            why,
        },
        e => e,
    }
}
