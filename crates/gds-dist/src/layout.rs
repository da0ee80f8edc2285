//! The OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`), as a directory or a
//! tar, written deterministically (fixed order, mtime 0, uid/gid 0, mode 0644/0755) and read
//! back as an [`Artifact`] for `push`.
//!
//! Output appears atomically: it is written under a temporary name beside the target
//! (`.NAME.tmp-PID`) and renamed into place; a failure removes it.

use crate::error::{DistError, Result};
use crate::package::{
    artifact_from_manifest, digest_hex, sha256_digest, Artifact, BlobRef, BlobSource,
};
use crate::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Largest `index.json` read.
const MAX_INDEX_BYTES: u64 = 1 << 20;

/// A path beside `target` that is removed on drop unless [`Staged::commit`] renamed it.
pub struct Staged {
    tmp: PathBuf,
    target: PathBuf,
    done: bool,
}

impl Staged {
    /// Reserves `PARENT/.NAME.tmp-PID` for `target`; refuses when `target` exists and
    /// `replace` is false.
    pub fn new(target: &Path, replace: bool) -> Result<Staged> {
        let name = target
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| DistError::usage(format!("{}: not a file name", target.display())))?;
        if !replace && target.symlink_metadata().is_ok() {
            return Err(DistError::usage(format!(
                "{} already exists (use --force to replace it)",
                target.display()
            )));
        }
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        if tmp.symlink_metadata().is_ok() {
            remove_any(&tmp);
        }
        Ok(Staged {
            tmp,
            target: target.to_path_buf(),
            done: false,
        })
    }

    /// The temporary path to write.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Renames the temporary path onto the target (replacing a previous one).
    pub fn commit(mut self) -> Result<()> {
        if self.target.is_dir() && self.tmp.is_dir() {
            // exchange, then remove the old one: the target is never missing
            let old = self.tmp.with_extension("old");
            std::fs::rename(&self.target, &old).map_err(|e| DistError::io(&self.target, e))?;
            if let Err(e) = std::fs::rename(&self.tmp, &self.target) {
                let _ = std::fs::rename(&old, &self.target);
                return Err(DistError::io(&self.target, e));
            }
            remove_any(&old);
        } else {
            std::fs::rename(&self.tmp, &self.target).map_err(|e| DistError::io(&self.target, e))?;
        }
        self.done = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            remove_any(&self.tmp);
        }
    }
}

fn remove_any(p: &Path) {
    if p.is_dir() {
        let _ = std::fs::remove_dir_all(p);
    } else {
        let _ = std::fs::remove_file(p);
    }
}

/// Copies a blob's bytes to `out`, checking its length.
pub fn copy_blob(b: &BlobRef, out: &mut dyn Write) -> Result<u64> {
    match &b.source {
        BlobSource::Memory(v) => {
            out.write_all(v)
                .map_err(|e| DistError::usage(format!("writing {}: {e}", b.digest)))?;
            Ok(v.len() as u64)
        }
        BlobSource::File { path, offset } => {
            let mut f = File::open(path).map_err(|e| DistError::io(path, e))?;
            f.seek(SeekFrom::Start(*offset))
                .map_err(|e| DistError::io(path, e))?;
            let n = std::io::copy(&mut f.take(b.size), out).map_err(|e| DistError::io(path, e))?;
            if n != b.size {
                return Err(DistError::invalid(format!(
                    "{}: blob {} is {n} bytes, {} expected (the file changed while packing)",
                    path.display(),
                    b.digest,
                    b.size
                )));
            }
            Ok(n)
        }
    }
}

fn index_json(a: &Artifact, tag: &str) -> Vec<u8> {
    json::canonical(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "digest": a.manifest_digest,
            "size": a.manifest.len(),
            "annotations": { REF_NAME_ANNOTATION: tag },
        }],
    }))
}

const OCI_LAYOUT: &[u8] = br#"{"imageLayoutVersion":"1.0.0"}"#;

/// Every blob of the artifact once, in a fixed order: the image manifest, the config, the
/// layers (a file shipped twice with the same bytes is one blob).
fn unique_blobs(a: &Artifact) -> Vec<BlobRef> {
    let manifest = BlobRef {
        digest: a.manifest_digest.clone(),
        size: a.manifest.len() as u64,
        media_type: MANIFEST_MEDIA_TYPE.into(),
        path: None,
        blake3: None,
        source: BlobSource::Memory(std::sync::Arc::new(a.manifest.clone())),
    };
    let mut seen = HashSet::new();
    std::iter::once(manifest)
        .chain(a.blobs().cloned())
        .filter(|b| seen.insert(b.digest.clone()))
        .collect()
}

/// Writes the artifact as an OCI image-layout tar at `out`, tagged `tag`; returns the bytes written.
pub fn write_tar(a: &Artifact, out: &Path, tag: &str, progress: &dyn Fn(u64)) -> Result<u64> {
    let staged = Staged::new(out, true)?;
    let file = File::create(staged.path()).map_err(|e| DistError::io(staged.path(), e))?;
    let mut tar = tar::Builder::new(std::io::BufWriter::with_capacity(1 << 20, file));
    let io = |e: std::io::Error| DistError::io(out, e);
    let header = |size: u64, dir: bool| {
        let mut h = tar::Header::new_ustar();
        h.set_size(size);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mode(if dir { 0o755 } else { 0o644 });
        h.set_entry_type(if dir {
            tar::EntryType::Directory
        } else {
            tar::EntryType::Regular
        });
        h
    };
    tar.append_data(
        &mut header(OCI_LAYOUT.len() as u64, false),
        "oci-layout",
        OCI_LAYOUT,
    )
    .map_err(io)?;
    let index = index_json(a, tag);
    tar.append_data(
        &mut header(index.len() as u64, false),
        "index.json",
        &index[..],
    )
    .map_err(io)?;
    for d in ["blobs/", "blobs/sha256/"] {
        tar.append_data(&mut header(0, true), d, std::io::empty())
            .map_err(io)?;
    }
    for b in unique_blobs(a) {
        let name = format!("blobs/sha256/{}", digest_hex(&b.digest)?);
        let mut h = header(b.size, false);
        h.set_path(&name).map_err(io)?;
        h.set_cksum();
        tar.append(&h, Reader::new(&b)?).map_err(io)?;
        progress(b.size);
    }
    let mut w = tar.into_inner().map_err(io)?;
    w.flush().map_err(io)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    let n = file.metadata().map_err(io)?.len();
    staged.commit()?;
    Ok(n)
}

/// A blob's bytes as a reader, of exactly its size (for tar entries).
struct Reader(Box<dyn Read>);

impl Reader {
    fn new(b: &BlobRef) -> Result<Reader> {
        Ok(Reader(match &b.source {
            BlobSource::Memory(v) => Box::new(std::io::Cursor::new(v.as_ref().clone())),
            BlobSource::File { path, offset } => {
                let mut f = File::open(path).map_err(|e| DistError::io(path, e))?;
                f.seek(SeekFrom::Start(*offset))
                    .map_err(|e| DistError::io(path, e))?;
                let len = f.metadata().map_err(|e| DistError::io(path, e))?.len();
                if len < offset + b.size {
                    return Err(DistError::invalid(format!(
                        "{}: shorter than blob {} (the file changed while packing)",
                        path.display(),
                        b.digest
                    )));
                }
                Box::new(f.take(b.size))
            }
        }))
    }
}

impl Read for Reader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

/// Writes the artifact as an OCI image-layout directory at `out`.
pub fn write_layout_dir(
    a: &Artifact,
    out: &Path,
    tag: &str,
    progress: &dyn Fn(u64),
) -> Result<u64> {
    let staged = Staged::new(out, false)?;
    let root = staged.path().to_path_buf();
    let blobs = root.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(|e| DistError::io(&blobs, e))?;
    let put =
        |name: &Path, bytes: &[u8]| std::fs::write(name, bytes).map_err(|e| DistError::io(name, e));
    put(&root.join("oci-layout"), OCI_LAYOUT)?;
    put(&root.join("index.json"), &index_json(a, tag))?;
    let mut total = 0;
    for b in unique_blobs(a) {
        let p = blobs.join(digest_hex(&b.digest)?);
        let mut f = File::create(&p).map_err(|e| DistError::io(&p, e))?;
        total += copy_blob(&b, &mut f)?;
        f.sync_all().map_err(|e| DistError::io(&p, e))?;
        progress(b.size);
    }
    staged.commit()?;
    Ok(total)
}

/// An OCI layout source: a directory or a tar.
enum Source {
    Dir(PathBuf),
    /// The tar and, for each member, its data offset and size.
    Tar(PathBuf, HashMap<String, (u64, u64)>),
}

impl Source {
    fn open(src: &Path) -> Result<Source> {
        if src.is_dir() {
            return Ok(Source::Dir(src.to_path_buf()));
        }
        let f = File::open(src).map_err(|e| DistError::io(src, e))?;
        let mut members = HashMap::new();
        let mut ar = tar::Archive::new(f);
        let entries = ar
            .entries()
            .map_err(|e| DistError::invalid(format!("{}: not a tar: {e}", src.display())))?;
        for e in entries {
            let e =
                e.map_err(|e| DistError::invalid(format!("{}: bad tar: {e}", src.display())))?;
            if e.header().entry_type() != tar::EntryType::Regular {
                continue;
            }
            let name = e
                .path()
                .map_err(|e| {
                    DistError::invalid(format!("{}: bad tar member name: {e}", src.display()))
                })?
                .to_string_lossy()
                .trim_start_matches("./")
                .to_string();
            members.insert(name, (e.raw_file_position(), e.size()));
        }
        Ok(Source::Tar(src.to_path_buf(), members))
    }

    /// Where the member `name` is, and its length.
    fn locate(&self, name: &str) -> Option<(PathBuf, u64, u64)> {
        match self {
            Source::Dir(d) => {
                let p = d.join(name);
                let len = std::fs::symlink_metadata(&p)
                    .ok()
                    .filter(|m| m.is_file())?
                    .len();
                Some((p, 0, len))
            }
            Source::Tar(t, m) => m.get(name).map(|&(off, len)| (t.clone(), off, len)),
        }
    }

    fn read(&self, name: &str, cap: u64, what: &Path) -> Result<Vec<u8>> {
        let (p, off, len) = self
            .locate(name)
            .ok_or_else(|| DistError::invalid(format!("{}: no {name}", what.display())))?;
        if len > cap {
            return Err(DistError::invalid(format!(
                "{}: {name} is {len} bytes, over the limit of {cap}",
                what.display()
            )));
        }
        let mut f = File::open(&p).map_err(|e| DistError::io(&p, e))?;
        f.seek(SeekFrom::Start(off))
            .map_err(|e| DistError::io(&p, e))?;
        let mut v = Vec::with_capacity(len as usize);
        f.take(len)
            .read_to_end(&mut v)
            .map_err(|e| DistError::io(&p, e))?;
        Ok(v)
    }
}

/// Reads an OCI layout (directory or tar) as an artifact: the manifest tagged `tag`, or the
/// only one when `tag` is `None`. The manifest is checked like a pulled one; blobs are
/// located (their digests are checked when they are read for upload).
pub fn read_layout(src: &Path, tag: Option<&str>) -> Result<Artifact> {
    let s = Source::open(src)?;
    let index: Value = serde_json::from_slice(&s.read("index.json", MAX_INDEX_BYTES, src)?)
        .map_err(|e| {
            DistError::invalid(format!("{}: index.json is not JSON: {e}", src.display()))
        })?;
    let manifests = index
        .get("manifests")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let name = |m: &Value| {
        m.pointer(&format!(
            "/annotations/{}",
            REF_NAME_ANNOTATION.replace('/', "~1")
        ))
        .and_then(Value::as_str)
        .map(str::to_owned)
    };
    let chosen: Vec<&Value> = match tag {
        Some(t) => manifests
            .iter()
            .filter(|m| name(m).as_deref() == Some(t))
            .collect(),
        None => manifests.iter().collect(),
    };
    let m = match chosen.as_slice() {
        [m] => *m,
        [] => {
            return Err(DistError::usage(format!(
                "{}: no manifest{} in index.json",
                src.display(),
                tag.map(|t| format!(" tagged {t:?}")).unwrap_or_default()
            )))
        }
        _ => {
            return Err(DistError::usage(format!(
                "{}: several manifests in index.json; name one with a tag (SRC:TAG is not supported, push REF's tag is used)",
                src.display()
            )))
        }
    };
    let digest = m
        .get("digest")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let hex = digest_hex(&digest)?;
    let manifest = s.read(
        &format!("blobs/sha256/{hex}"),
        MAX_MANIFEST_BYTES as u64,
        src,
    )?;
    if sha256_digest(&manifest) != digest {
        return Err(DistError::invalid(format!(
            "{}: the manifest blob does not match its digest {digest}",
            src.display()
        )));
    }
    let what = format!("{} ({digest})", src.display());
    artifact_from_manifest(manifest, &what, &|d, size| {
        let (path, offset, len) = s
            .locate(&format!("blobs/sha256/{}", digest_hex(d)?))
            .ok_or_else(|| DistError::invalid(format!("{}: blob {d} is missing", src.display())))?;
        if len != size {
            return Err(DistError::invalid(format!(
                "{}: blob {d} is {len} bytes, the manifest says {size}",
                src.display()
            )));
        }
        Ok(BlobSource::File { path, offset })
    })
}
