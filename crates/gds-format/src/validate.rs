//! Every rule SPEC.md says a reader MUST check, over bytes the caller supplies.
//!
//! Validation collects every problem rather than stopping at the first, so `gdsconv validate`
//! can list them all. It never panics, whatever the bytes (see the fuzz target and the
//! corruption tests).

use crate::error::FormatError;
use crate::raw::*;
use crate::reader::Manifest;
use std::collections::{HashMap, HashSet};

/// Checks the manifest alone: header, checksum, tables, and every record's rules. Returns the
/// parsed manifest (when the header and tables could be read at all) and all problems found.
pub fn validate_manifest(bytes: &[u8]) -> (Option<Manifest<'_>>, Vec<FormatError>) {
    let m = match Manifest::parse(bytes) {
        Ok(m) => m,
        Err(e) => return (None, vec![e]),
    };
    let mut errs = Vec::new();
    if !m.verify_checksum() {
        errs.push(FormatError::ChecksumMismatch);
    }
    let mut keys = HashSet::new();
    for i in 0..m.kv_table().len() {
        match m.kv(i) {
            Ok((k, _)) => {
                if !keys.insert(k) {
                    errs.push(FormatError::BadKv {
                        index: i,
                        why: format!("duplicate key {k:?}"),
                    });
                }
            }
            Err(FormatError::BadKv { why, .. }) if why.starts_with("unknown value type") => {} // may ignore
            Err(e) => errs.push(e),
        }
    }

    let n_tensors = m.n_tensors();
    let mut next_tensor = 0usize;
    let mut files = HashSet::new();
    let mut blocks = HashSet::new();
    let mut layer_sizes = Vec::with_capacity(m.n_layers());
    for i in 0..m.n_layers() {
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
        if !is_safe_relative_path(l.file) {
            errs.push(bad(format!(
                "file path {:?} is not a safe relative path",
                l.file
            )));
        }
        if !files.insert(l.file) {
            errs.push(bad(format!("file {:?} is used by another layer", l.file)));
        }
        match l.kind {
            layer_kind::EMBED | layer_kind::HEAD => {}
            layer_kind::BLOCK => {
                if !blocks.insert(l.block) {
                    errs.push(bad(format!("block number {} appears twice", l.block)));
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
        layer_sizes.push(Some((l.tensors.clone(), l.file_size)));
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

    let mut names = HashMap::new();
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
        if names.insert(t.name, i).is_some() {
            errs.push(bad("name appears twice".into()));
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
            Some((range, size)) if range.contains(&i) => {
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
                            "offset {} overlaps the previous tensor (ends at {pend})",
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
    (Some(m), errs)
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

/// A path is safe when it is relative, `/`-separated, and has no empty, `.` or `..` part.
pub fn is_safe_relative_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && !p.contains('\\')
        && !p.contains('\0')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}
