//! `gdsconv validate`: every rule SPEC.md says a reader MUST check, over a model directory.
//! Structural rules come from `gds_format::validate`, the architecture's rules from
//! `gds_format::arch` (the same checks `gdsrun` runs at every open, so the two agree on what
//! is a usable model); this adds the file system (files present, of the recorded length, no
//! links, content hashes) and what `gdsrun` will load: the tokenizer and the chat template.

use gds_format::arch::check_model;
use gds_format::validate::{validate_layer_file, validate_manifest};
use gds_format::{file_role, Manifest, MANIFEST_FILE};
use gds_io::IoError;
use serde::Serialize;
use std::path::Path;
use std::str::FromStr;

/// How much to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// Everything except content hashes and loading the tokenizer (the converter's
    /// self-check, which has already loaded the tokenizer it writes).
    Structure,
    /// Everything except the content hashes of the layer files.
    Quick,
    /// Everything, hashing every file.
    Full,
}

/// Largest `tokenizer.json` / `tokenizer_config.json` read (bounded before reading).
pub const MAX_AUX_BYTES: u64 = 256 << 20;

/// The outcome: `valid` is true exactly when `errors` is empty.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// True when no error was found.
    pub valid: bool,
    /// True when the model is valid and of an architecture `gdsrun` runs: exactly the
    /// models `gdsrun` opens.
    pub runnable: bool,
    /// Format version of the manifest (`1.1`).
    pub version: String,
    /// `general.architecture`.
    pub architecture: String,
    /// Rules broken.
    pub errors: Vec<String>,
    /// Things worth knowing that do not make the directory invalid.
    pub warnings: Vec<String>,
}

/// Reads the manifest of `dir` (no link followed, the size cap applied before reading).
pub fn read_manifest(dir: &Path) -> Result<Vec<u8>, String> {
    gds_io::read_manifest(dir).map_err(|e| e.to_string())
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
    let (major, minor) = m.version();
    r.version = format!("{major}.{minor}");
    let mut known = false;
    if r.errors.is_empty() {
        let check = check_model(&m);
        r.architecture = check.arch.clone();
        known = check.known;
        r.errors.extend(
            check
                .errors
                .iter()
                .map(|e| format!("{}: {e}", mpath.display())),
        );
        if !check.known && !check.arch.is_empty() {
            r.warnings.push(format!(
                "architecture {:?} is not one gdsrun can run; its required tensors and hyperparameters are not checked",
                check.arch
            ));
        }
        check_layer_files(dir, &m, depth, &mut r);
        check_model_files(dir, &m, depth, &mut r);
    }
    if !m.has_file_table() {
        r.warnings.push(format!(
            "{}: format {major}.{minor} hashes only the layer files; tokenizer.json and tokenizer_config.json are not covered (convert again to get a 1.1 manifest)",
            mpath.display()
        ));
    }
    if depth != Depth::Structure && r.errors.is_empty() {
        check_tokenizer(dir, &m, &mut r);
    }
    r.valid = r.errors.is_empty();
    r.runnable = r.valid && known;
    r
}

fn check_layer_files(dir: &Path, m: &Manifest<'_>, depth: Depth, r: &mut Report) {
    for l in m.layers() {
        let path = dir.join(l.file);
        let file = match gds_io::open_in_dir(dir, l.file, 0) {
            Ok(f) => f,
            Err(e) => {
                r.errors.push(e.to_string());
                continue;
            }
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len != l.file_size {
            r.errors.push(format!(
                "{}: {} bytes, the manifest says {}",
                path.display(),
                len,
                l.file_size
            ));
            continue;
        }
        if depth != Depth::Full || len == 0 {
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

/// The file table (1.1): each listed file present, a regular file inside the directory, of
/// the recorded length and, when hashing, of the recorded hash.
fn check_model_files(dir: &Path, m: &Manifest<'_>, depth: Depth, r: &mut Report) {
    for f in m.files() {
        let path = dir.join(f.path);
        if depth == Depth::Full {
            // Reads and hashes the file (bounded by its recorded size).
            match gds_io::read_model_file(dir, m, f.path, u64::MAX) {
                Ok(_) => {}
                Err(e) => r.errors.push(e.to_string()),
            }
            continue;
        }
        match gds_io::open_in_dir(dir, f.path, 0) {
            Err(e) => r.errors.push(e.to_string()),
            Ok(file) => {
                let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                if len != f.size {
                    r.errors.push(format!(
                        "{}: {len} bytes, the manifest says {}",
                        path.display(),
                        f.size
                    ));
                }
            }
        }
    }
}

fn read_aux(dir: &Path, m: &Manifest<'_>, name: &str, r: &mut Report) -> Option<Vec<u8>> {
    match gds_io::read_model_file(dir, m, name, MAX_AUX_BYTES) {
        Ok(f) => f.map(|f| f.bytes),
        Err(e @ IoError::Integrity { .. }) => {
            r.errors.push(e.to_string());
            None
        }
        Err(e) => {
            r.errors.push(e.to_string());
            None
        }
    }
}

/// What `gdsrun` loads besides the weights: `tokenizer.json` (REQUIRED, must load with the
/// tokenizers library and fit the vocabulary) and `tokenizer_config.json` (optional; when
/// present, a UTF-8 JSON object whose chat template compiles).
fn check_tokenizer(dir: &Path, m: &Manifest<'_>, r: &mut Report) {
    let path = dir.join("tokenizer.json");
    match read_aux(dir, m, "tokenizer.json", r) {
        None => {
            if !r.errors.iter().any(|e| e.contains("tokenizer.json")) {
                r.errors.push(format!(
                    "{}: missing (a model directory REQUIRES a tokenizer)",
                    path.display()
                ));
            }
        }
        Some(bytes) => match std::str::from_utf8(&bytes)
            .map_err(|e| e.to_string())
            .and_then(|s| tokenizers::Tokenizer::from_str(s).map_err(|e| e.to_string()))
        {
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
    let Some(bytes) = read_aux(dir, m, "tokenizer_config.json", r) else {
        return;
    };
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(e) => {
            r.errors
                .push(format!("{}: not valid UTF-8 ({e})", cfg.display()));
            return;
        }
    };
    let v: serde_json::Value = match serde_json::from_str(text) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        Ok(_) => {
            r.errors
                .push(format!("{}: not a JSON object", cfg.display()));
            return;
        }
        Err(e) => {
            r.errors
                .push(format!("{}: not valid JSON: {e}", cfg.display()));
            return;
        }
    };
    for (name, src) in chat_templates(&v) {
        if let Err(e) = compile_template(&src) {
            r.errors.push(format!(
                "{}: chat template {name:?} does not compile: {e}",
                cfg.display()
            ));
        }
    }
}

/// The chat templates of a `tokenizer_config.json`: a string, or a list of
/// `{name, template}`.
fn chat_templates(v: &serde_json::Value) -> Vec<(String, String)> {
    match v.get("chat_template") {
        Some(serde_json::Value::String(s)) => vec![("default".into(), s.clone())],
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|t| {
                Some((
                    t.get("name")?.as_str()?.to_string(),
                    t.get("template")?.as_str()?.to_string(),
                ))
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Compiles a chat template with the syntax settings `gdsrun` renders it with (Hugging
/// Face's: `trim_blocks`, `lstrip_blocks`).
fn compile_template(src: &str) -> Result<(), String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // as gdsrun does: minijinja's debug-info renderer can panic (see gds-runtime's chat.rs)
    env.set_debug(false);
    env.add_template_owned("chat", src.to_string())
        .map_err(|e| e.to_string())
}

/// Role name for messages.
pub fn role_name(role: u32) -> &'static str {
    match role {
        file_role::TOKENIZER => "tokenizer",
        file_role::TOKENIZER_CONFIG => "tokenizer config",
        file_role::GENERATION_CONFIG => "generation config",
        file_role::DOC => "documentation",
        _ => "other",
    }
}
