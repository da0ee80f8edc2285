//! Every rule SPEC.md says a reader MUST check, over bytes the caller supplies.
//!
//! Validation collects every problem rather than stopping at the first, so `gdsconv validate`
//! can list them all. It never panics, whatever the bytes (see the fuzz target and the
//! corruption tests).

use crate::error::FormatError;
use crate::raw::file_role;
use crate::raw::*;
use crate::reader::Manifest;
use std::collections::{HashMap, HashSet};
use zerocopy::FromBytes;

/// Checks the manifest alone: header, checksum, table layout, and every record's rules.
/// Returns the parsed manifest (when the header and tables could be read at all) and all
/// problems found. Every loop is bounded by the tables' record counts, which `parse` has
/// already bounded by the manifest's length (at most 64 MiB): nothing is sized by a value
/// read from a record.
pub fn validate_manifest(bytes: &[u8]) -> (Option<Manifest<'_>>, Vec<FormatError>) {
    let m = match Manifest::parse(bytes) {
        Ok(m) => m,
        Err(e) => return (None, vec![e]),
    };
    let mut errs = Vec::new();
    if !m.verify_checksum() {
        errs.push(FormatError::ChecksumMismatch);
    }
    check_layout(&m, &mut errs);
    let mut keys = HashSet::new();
    for i in 0..m.kv_table().len() {
        if let Some(e) = m.kv_table().get(i) {
            if e.reserved.get() != 0 {
                errs.push(FormatError::BadKv {
                    index: i,
                    why: format!("reserved field is {}, must be 0", e.reserved.get()),
                });
            }
        }
        match m.kv(i) {
            Ok((k, _)) => {
                if k.is_empty() {
                    errs.push(FormatError::BadKv {
                        index: i,
                        why: "empty key".into(),
                    });
                }
                if !keys.insert(k) {
                    errs.push(FormatError::BadKv {
                        index: i,
                        why: format!("duplicate key {k:?}"),
                    });
                }
            }
            Err(FormatError::BadKv { why, .. }) if why.starts_with("unknown value type") => {
                // A later minor may add value types: ignored, but the key still counts for
                // uniqueness.
                if let Some(k) = m.kv_table().get(i).and_then(|e| m.string(&e.key)) {
                    if !keys.insert(k) {
                        errs.push(FormatError::BadKv {
                            index: i,
                            why: format!("duplicate key {k:?}"),
                        });
                    }
                }
            }
            Err(e) => errs.push(e),
        }
    }

    let n_tensors = m.n_tensors();
    let n_layers = m.n_layers();
    let mut next_tensor = 0usize;
    let mut paths = PathSet::default();
    if m.has_file_table() {
        paths.insert(crate::MANIFEST_FILE, "the manifest", &mut errs);
    }
    let mut next_block = 0u64;
    let mut seen_head = false;
    let mut layer_sizes = Vec::with_capacity(n_layers);
    for i in 0..n_layers {
        let l = match m.layer(i) {
            Ok(l) => l,
            Err(e) => {
                errs.push(e);
                layer_sizes.push(None);
                continue;
            }
        };
        let bad = |why: String| FormatError::BadLayer {
            name: l.name.to_string(),
            why,
        };
        if let Err(why) = check_path(l.file) {
            errs.push(bad(format!("file path {:?} {why}", l.file)));
        } else if RESERVED_FILES
            .iter()
            .any(|r| r.eq_ignore_ascii_case(l.file))
        {
            errs.push(bad(format!(
                "file path {:?} is reserved for the model's own files",
                l.file
            )));
        } else {
            paths.insert(l.file, &format!("layer {:?}", l.name), &mut errs);
        }
        if seen_head {
            errs.push(bad("a layer follows the head: the head must be last".into()));
        }
        match l.kind {
            layer_kind::EMBED => {
                if i != 0 {
                    errs.push(bad(
                        "the embedding must be the first layer, and appear once".into(),
                    ));
                }
                if l.name != "embed" {
                    errs.push(bad(format!(
                        "an embedding layer must be named \"embed\", not {:?}",
                        l.name
                    )));
                }
                if l.block != 0 {
                    errs.push(bad(format!(
                        "index {} must be 0 for the embedding",
                        l.block
                    )));
                }
            }
            layer_kind::HEAD => {
                seen_head = true;
                if l.name != "head" {
                    errs.push(bad(format!(
                        "a head layer must be named \"head\", not {:?}",
                        l.name
                    )));
                }
                if l.block != 0 {
                    errs.push(bad(format!("index {} must be 0 for the head", l.block)));
                }
            }
            layer_kind::BLOCK => {
                if u64::from(l.block) != next_block {
                    errs.push(bad(format!(
                        "block number {} where {next_block} was expected: blocks are numbered 0, 1, 2, … in table order",
                        l.block
                    )));
                }
                next_block = u64::from(l.block) + 1;
                let want = format!("blk.{}", l.block);
                if l.name != want {
                    errs.push(bad(format!("block {} must be named {want:?}", l.block)));
                }
            }
            k => errs.push(bad(format!("unknown layer kind {k}"))),
        }
        if l.file_size % ALIGNMENT != 0 {
            errs.push(bad(format!(
                "file_size {} is not a multiple of 4096",
                l.file_size
            )));
        }
        if l.tensors.start != next_tensor {
            errs.push(bad(format!("first_tensor {} should be {next_tensor}: layers must cover the tensor table in order", l.tensors.start)));
        }
        if l.tensors.end > n_tensors {
            errs.push(bad(format!(
                "tensor range {:?} runs past the {n_tensors} tensors",
                l.tensors
            )));
        }
        next_tensor = l.tensors.end;
        layer_sizes.push(Some((l.tensors.clone(), l.file_size, l.kind, l.block)));
    }
    if next_tensor != n_tensors && errs.is_empty() {
        errs.push(FormatError::BadSection {
            table: "tensor",
            why: format!(
                "{} tensors belong to no layer",
                n_tensors.saturating_sub(next_tensor)
            ),
        });
    }

    let mut names = HashSet::new();
    let mut prev_end: Option<(usize, u64)> = None;
    for i in 0..n_tensors {
        let t = match m.tensor(i) {
            Ok(t) => t,
            Err(e) => {
                errs.push(e);
                continue;
            }
        };
        let bad = |why: String| FormatError::BadTensor {
            name: t.name.to_string(),
            why,
        };
        if !names.insert(t.name) {
            errs.push(bad("name appears twice".into()));
        }
        if t.name.is_empty() {
            errs.push(bad("empty name".into()));
        }
        if let Some(e) = m.tensor_table().get(i) {
            if e.reserved.get() != 0 {
                errs.push(bad(format!(
                    "reserved field is {}, must be 0",
                    e.reserved.get()
                )));
            }
        }
        if t.shape[t.n_dims..].iter().any(|&d| d != 0) {
            errs.push(bad("unused shape entries must be 0".into()));
        }
        if t.dims().contains(&0) {
            errs.push(bad(format!("shape {:?} has a zero dimension", t.dims())));
        }
        match t.dtype.tensor_bytes(t.dims()) {
            Some(n) if n == t.nbytes => {}
            Some(n) => errs.push(bad(format!(
                "nbytes {} but {} {:?} takes {n}",
                t.nbytes,
                t.dtype,
                t.dims()
            ))),
            None => errs.push(bad(format!(
                "shape {:?} is not a whole number of {} blocks of {}",
                t.dims(),
                t.dtype,
                t.dtype.block_size()
            ))),
        }
        if t.offset % ALIGNMENT != 0 {
            errs.push(bad(format!("offset {} is not 4096-aligned", t.offset)));
        }
        let owner = layer_sizes.get(t.layer).cloned().flatten();
        match owner {
            Some((range, size, kind, block)) if range.contains(&i) => {
                match (kind, block_number(t.name)) {
                    (layer_kind::BLOCK, Some(n)) if n == u64::from(block) => {}
                    (layer_kind::BLOCK, found) => errs.push(bad(format!(
                        "stored in block {block}, but its name {}",
                        match found {
                            Some(n) => format!("says block {n}"),
                            None => "has no block number".into(),
                        }
                    ))),
                    (_, Some(n)) => errs.push(bad(format!(
                        "its name says block {n}, but it is stored outside the blocks"
                    ))),
                    (_, None) => {}
                }
                match t.offset.checked_add(t.nbytes) {
                    Some(end) if end <= size => {}
                    _ => errs.push(bad(format!(
                        "bytes {}..+{} run past the layer file's {size} bytes",
                        t.offset, t.nbytes
                    ))),
                }
                if let Some((pl, pend)) = prev_end {
                    if pl == t.layer && t.offset < pend {
                        errs.push(bad(format!(
                            "offset {} overlaps the previous tensor (ends at {pend}): offsets must increase",
                            t.offset
                        )));
                    }
                }
                prev_end = Some((t.layer, t.offset.saturating_add(t.nbytes)));
            }
            _ => errs.push(bad(format!(
                "layer field {} does not name the layer that lists this tensor",
                t.layer
            ))),
        }
    }

    if m.has_file_table() {
        let mut tokenizer = false;
        for i in 0..m.n_files() {
            let f = match m.file(i) {
                Ok(f) => f,
                Err(e) => {
                    errs.push(e);
                    continue;
                }
            };
            let bad = |why: String| FormatError::BadFile {
                path: f.path.to_string(),
                why,
            };
            if let Some(e) = m.file_table().get(i) {
                if e.reserved.get() != 0 {
                    errs.push(bad(format!(
                        "reserved field is {}, must be 0",
                        e.reserved.get()
                    )));
                }
            }
            if let Err(why) = check_path(f.path) {
                errs.push(bad(format!("path {why}")));
                continue;
            }
            paths.insert(f.path, "the file table", &mut errs);
            let fixed = [
                (file_role::TOKENIZER, "tokenizer.json"),
                (file_role::TOKENIZER_CONFIG, "tokenizer_config.json"),
                (file_role::GENERATION_CONFIG, "generation_config.json"),
            ];
            for (role, path) in fixed {
                if (f.role == role) != (f.path == path) {
                    errs.push(bad(format!(
                        "role {} and path disagree: {path:?} and only it has role {role}",
                        f.role
                    )));
                }
            }
            tokenizer |= f.role == file_role::TOKENIZER;
        }
        if !tokenizer {
            errs.push(FormatError::BadFile {
                path: "tokenizer.json".into(),
                why: "not listed in the file table (REQUIRED from version 1.1)".into(),
            });
        }
    }
    (Some(m), errs)
}

/// Files of a model directory that a layer may not use as its data file.
pub const RESERVED_FILES: &[&str] = &[
    crate::MANIFEST_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

/// The block number a tensor name carries: its first all-digit dotted component other than
/// the last (`blk.3.attn_q.weight` → 3, `model.layers.12.mlp.up_proj.weight` → 12).
pub fn block_number(name: &str) -> Option<u64> {
    let parts: Vec<&str> = name.split('.').collect();
    parts[..parts.len().saturating_sub(1)]
        .iter()
        .find(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .map(|p| p.parse().unwrap_or(u64::MAX))
}

/// Every path the manifest names, compared as a case-insensitive file system would:
/// no two may be equal, and none may be a directory of another.
/// Also used on pull (`gds-dist`) for the paths a registry artifact names.
#[derive(Default)]
pub struct PathSet {
    seen: HashMap<String, String>,
}

impl PathSet {
    /// Adds `path`, owned by `owner` (named in the error); pushes an error when it collides.
    pub fn insert(&mut self, path: &str, owner: &str, errs: &mut Vec<FormatError>) {
        let key = path.to_ascii_lowercase();
        if let Some(other) = self.seen.get(&key) {
            errs.push(FormatError::Layout(format!(
                "path {path:?} of {owner} is also used by {other} (paths must differ by more than case)"
            )));
            return;
        }
        // A path that is a directory of another path (`layers` and `layers/x.bin`).
        let mut prefix = String::new();
        for c in key.split('/') {
            if !prefix.is_empty() {
                if let Some(other) = self.seen.get(&prefix) {
                    errs.push(FormatError::Layout(format!(
                        "path {path:?} of {owner} lies inside {prefix:?}, the file of {other}"
                    )));
                    return;
                }
                prefix.push('/');
            }
            prefix.push_str(c);
        }
        let dir = format!("{key}/");
        if let Some((_, other)) = self.seen.iter().find(|(k, _)| k.starts_with(&dir)) {
            errs.push(FormatError::Layout(format!(
                "path {path:?} of {owner} is a directory of the file of {other}"
            )));
            return;
        }
        self.seen.insert(key, owner.to_string());
    }
}

/// Sections must not overlap one another, and every byte outside the header and the
/// sections (the padding between them) must be zero, so that a manifest has one meaning.
fn check_layout(m: &Manifest<'_>, errs: &mut Vec<FormatError>) {
    let h = m.header();
    let bytes = m.bytes();
    let mut sections: Vec<(&str, u64, u64)> = vec![
        (
            "key/value",
            h.kv.offset.get(),
            u64::from(h.kv.count.get()) * u64::from(h.kv.entry_size.get()),
        ),
        (
            "layer",
            h.layers.offset.get(),
            u64::from(h.layers.count.get()) * u64::from(h.layers.entry_size.get()),
        ),
        (
            "tensor",
            h.tensors.offset.get(),
            u64::from(h.tensors.count.get()) * u64::from(h.tensors.entry_size.get()),
        ),
        (
            "string",
            h.strings.offset.get(),
            u64::from(h.strings.count.get()),
        ),
    ];
    if m.has_file_table() {
        if let Ok((ext, _)) = HeaderExt::ref_from_prefix(&bytes[size_of::<Header>()..]) {
            let f = &ext.files;
            sections.push((
                "file",
                f.offset.get(),
                u64::from(f.count.get()) * u64::from(f.entry_size.get()),
            ));
        }
    }
    sections.retain(|s| s.2 > 0);
    sections.sort_by_key(|s| s.1);
    let mut pos = u64::from(h.header_size.get());
    let mut prev = "header";
    for (name, off, len) in sections {
        if off < pos {
            errs.push(FormatError::Layout(format!(
                "the {name} table (bytes {off}..{}) overlaps the {prev} (ends at {pos})",
                off + len
            )));
        } else if let Some(at) = nonzero(bytes, pos, off) {
            errs.push(FormatError::Layout(format!(
                "byte {at}, between the {prev} and the {name} table, is not zero"
            )));
        }
        if off + len > pos {
            pos = off + len;
            prev = name;
        }
    }
    if let Some(at) = nonzero(bytes, pos, bytes.len() as u64) {
        errs.push(FormatError::Layout(format!(
            "byte {at}, after the last table, is not zero"
        )));
    }
}

fn nonzero(bytes: &[u8], from: u64, to: u64) -> Option<u64> {
    let (a, b) = (from as usize, (to as usize).min(bytes.len()));
    bytes
        .get(a..b)?
        .iter()
        .position(|&x| x != 0)
        .map(|p| (a + p) as u64)
}

/// Why `p` is not a portable, safe relative path (SPEC.md §1), or `Ok`.
///
/// Components are non-empty, made of ASCII letters, digits, `.`, `_` and `-`, do not start
/// with `.`, and are at most 255 bytes; the whole path is at most 1024 bytes. This rules out
/// absolute paths, `..`, backslashes, drive letters (`C:`), NUL and control characters.
pub fn check_path(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err("is empty".into());
    }
    if p.len() > 1024 {
        return Err("is longer than 1024 bytes".into());
    }
    if p.starts_with('/') {
        return Err("is absolute".into());
    }
    for c in p.split('/') {
        if c.is_empty() {
            return Err("has an empty component".into());
        }
        if c.starts_with('.') {
            return Err(format!("has a component {c:?} starting with '.'"));
        }
        if c.len() > 255 {
            return Err("has a component longer than 255 bytes".into());
        }
        if let Some(b) = c
            .bytes()
            .find(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')))
        {
            return Err(format!(
                "has the character {:?}: only ASCII letters, digits, '.', '_' and '-' are allowed",
                b as char
            ));
        }
    }
    Ok(())
}

/// Checks one layer's data file against its entry: exact length and, when `hash` is set,
/// the BLAKE3 content hash.
pub fn validate_layer_file(
    layer: &crate::reader::LayerInfo<'_>,
    data: &[u8],
    hash: bool,
) -> Vec<FormatError> {
    let mut errs = Vec::new();
    let bad = |why: String| FormatError::BadLayer {
        name: layer.name.to_string(),
        why,
    };
    if data.len() as u64 != layer.file_size {
        errs.push(bad(format!(
            "file {:?} is {} bytes, the manifest says {}",
            layer.file,
            data.len(),
            layer.file_size
        )));
    } else if hash && *blake3::hash(data).as_bytes() != layer.content_hash {
        errs.push(bad(format!(
            "file {:?} content hash does not match the manifest",
            layer.file
        )));
    }
    errs
}

/// A path is safe when [`check_path`] accepts it.
pub fn is_safe_relative_path(p: &str) -> bool {
    check_path(p).is_ok()
}
