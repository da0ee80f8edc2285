//! `gdsconv validate`: every rule SPEC.md says a reader MUST check, over a model directory.
//! Structural rules come from `gds_format::validate`, the architecture's rules from
//! `gds_format::arch` (the same checks `gdsrun` runs at every open, so the two agree on what
//! is a usable model); this adds the file system (files present, of the recorded length, no
//! links, content hashes) and what `gdsrun` will load: the tokenizer and the chat template.

use gds_format::arch::check_model;
use gds_format::chat_template;
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
    if r.errors.is_empty() {
        if depth != Depth::Structure {
            check_tokenizer(dir, &m, &mut r);
        }
        // the chat template is code from the model file: checked at every depth (the
        // converter's self-check and `pull` included)
        check_tokenizer_config(dir, &m, &mut r);
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
                if let Err(e) = gds_format::tokenizer_speed::check(&t, &bytes) {
                    r.errors.push(format!("{}: refused: {e}", path.display()));
                }
                if let Ok(v) = m.get_u64("model.vocab_size") {
                    let n = token_ids_end(&t);
                    if n > v {
                        r.errors.push(format!(
                            "{}: token ids up to {} but the model's vocabulary has {v}",
                            path.display(),
                            n - 1
                        ));
                    }
                }
            }
        },
    }
}

/// One past the largest token id `t` can produce (its vocabulary and added tokens): what
/// the model's vocabulary, the embedding's rows, must cover.
pub fn token_ids_end(t: &tokenizers::Tokenizer) -> u64 {
    t.get_vocab(true)
        .values()
        .max()
        .map_or(0, |&id| u64::from(id) + 1)
}

/// `tokenizer_config.json` (optional): when present, a UTF-8 JSON object whose chat template
/// (a string, or a list of `{name, template}` objects) passes [`chat_template::check`].
fn check_tokenizer_config(dir: &Path, m: &Manifest<'_>, r: &mut Report) {
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
    let templates = match chat_templates(&v) {
        Ok(t) => t,
        Err(e) => {
            r.errors.push(format!("{}: {e}", cfg.display()));
            return;
        }
    };
    for (name, src) in templates {
        if let Err(e) = chat_template::check(&src) {
            r.errors.push(format!(
                "{}: chat template {name:?} is refused: {e}",
                cfg.display()
            ));
        }
    }
}

/// The chat templates of a `tokenizer_config.json`: a string, or a list of
/// `{name, template}` (both strings) with one named `default` (the one `gdsrun` renders);
/// `null` or no key is none. Anything else is an error: `gdsrun` refuses it. (The converter
/// applies the same rule, so that it never writes what `validate` rejects.)
pub fn chat_templates(v: &serde_json::Value) -> Result<Vec<(String, String)>, String> {
    match v.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::String(s)) => Ok(vec![("default".into(), s.clone())]),
        Some(serde_json::Value::Array(a)) => {
            let list = named_templates(a)?;
            if !list.iter().any(|(n, _)| n == "default") {
                return Err(
                    "chat_template lists no template named \"default\" (the one gdsrun renders)"
                        .into(),
                );
            }
            Ok(list)
        }
        Some(other) => Err(format!(
            "chat_template is {}, not a string or a list of {{name, template}}",
            json_kind(other)
        )),
    }
}

fn named_templates(a: &[serde_json::Value]) -> Result<Vec<(String, String)>, String> {
    a.iter()
        .enumerate()
        .map(|(i, t)| {
            match (
                t.get("name").and_then(|n| n.as_str()),
                t.get("template").and_then(|n| n.as_str()),
            ) {
                (Some(n), Some(t)) => Ok((n.to_string(), t.to_string())),
                _ => Err(format!(
                    "chat_template[{i}] is not an object with string \"name\" and \"template\""
                )),
            }
        })
        .collect()
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A model directory (an architecture gdsrun does not run: no layers needed) with a
    /// one-token `tokenizer.json` and `config` as `tokenizer_config.json`, both hashed in the
    /// manifest as convert writes them.
    fn dir_with_config(config: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}"#;
        let mut b = gds_format::ManifestBuilder::new();
        b.kv_str("general.architecture", "mamba");
        for (name, role, bytes) in [
            ("tokenizer.json", file_role::TOKENIZER, tokenizer),
            ("tokenizer_config.json", file_role::TOKENIZER_CONFIG, config),
        ] {
            std::fs::write(dir.path().join(name), bytes).unwrap();
            b.add_file(
                name,
                role,
                bytes.len() as u64,
                *blake3::hash(bytes.as_bytes()).as_bytes(),
            );
        }
        std::fs::write(dir.path().join(MANIFEST_FILE), b.finish()).unwrap();
        dir
    }

    /// Regression (issue 33): hostile templates (a 20 000-term `+` chain overflowed the
    /// stack: validate, pack and pull aborted, exit 134; deep nesting; a render that never
    /// ends) are reported invalid at every depth, `Structure` included: the converter's
    /// self-check and `pull` (which kept such a model) run that one.
    #[test]
    fn hostile_chat_templates_are_invalid_at_every_depth() {
        for (template, want) in [
            (format!("{{{{ 1{} }}}}", " + 1".repeat(20_000)), "operators"),
            (
                format!("{{{{ {}1{} }}}}", "(".repeat(10_000), ")".repeat(10_000)),
                "nested",
            ),
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                    .to_string(),
                "instructions",
            ),
            ("{% if %}".to_string(), "syntax error"),
        ] {
            let cfg = serde_json::json!({ "chat_template": template }).to_string();
            let dir = dir_with_config(&cfg);
            for depth in [Depth::Structure, Depth::Quick, Depth::Full] {
                let r = validate_dir(dir.path(), depth);
                assert!(!r.valid && !r.runnable, "{want}: {depth:?}");
                assert!(
                    r.errors
                        .iter()
                        .any(|e| e.contains("tokenizer_config.json") && e.contains(want)),
                    "{want}: {:?}",
                    r.errors
                );
            }
        }
    }

    /// Regression (issue 33): a `chat_template` that is neither a string nor a list of
    /// `{name, template}` validated as valid and runnable, though gdsrun refuses it.
    #[test]
    fn chat_templates_of_the_wrong_type_are_invalid() {
        for (v, want) in [
            (serde_json::json!(7), "is a number"),
            (serde_json::json!({"default": "x"}), "is an object"),
            (serde_json::json!([{"name": "default"}]), "chat_template[0]"),
            (
                serde_json::json!([{"name": 1, "template": "x"}]),
                "chat_template[0]",
            ),
            (serde_json::json!(["x"]), "chat_template[0]"),
            (serde_json::json!([]), "no template named"),
            (
                serde_json::json!([{"name": "tool_use", "template": "x"}]),
                "no template named",
            ),
        ] {
            let cfg = serde_json::json!({ "chat_template": v }).to_string();
            let r = validate_dir(dir_with_config(&cfg).path(), Depth::Quick);
            assert!(!r.valid, "{v}");
            assert!(
                r.errors
                    .iter()
                    .any(|e| e.contains("tokenizer_config.json") && e.contains(want)),
                "{v}: {:?}",
                r.errors
            );
        }
        for v in [
            serde_json::json!(null),
            serde_json::json!("{{ messages }}"),
            serde_json::json!([{"name": "default", "template": "{{ messages }}"}]),
        ] {
            let cfg = serde_json::json!({ "chat_template": v }).to_string();
            let r = validate_dir(dir_with_config(&cfg).path(), Depth::Quick);
            assert!(r.valid, "{v}: {:?}", r.errors);
        }
    }
}
