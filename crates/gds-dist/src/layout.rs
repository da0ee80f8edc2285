//! The OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`), as a directory or a
//! tar, written deterministically (fixed order, mtime 0, uid/gid 0, mode 0644/0755) and read
//! back as an [`Artifact`] for `push`.
//!
//! Output appears atomically: it is written under a temporary name beside the target
//! (`.NAME.tmp-PID-N`) and renamed into place; a failure removes it.

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
    /// Reserves `PARENT/.NAME.tmp-PID-N` (unique per process and thread) for `target`; refuses when `target` exists and
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
        if !parent.is_dir() {
            return Err(DistError::usage(format!(
                "{}: the directory {} does not exist",
                target.display(),
                parent.display()
            )));
        }
        let tmp = parent.join(format!(".{name}.tmp-{}", crate::store::unique_suffix()));
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
            // a name of its own (`.NAME.old-PID-N`), never shared with another process
            let old = self
                .tmp
                .with_extension(format!("old-{}", crate::store::unique_suffix()));
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

/// Copies `len` bytes of `src` from `offset` to the end of `out` in the kernel
/// (`copy_file_range`: no trip through user space), falling back to read/write where the
/// kernel cannot.
fn copy_range(src: &File, offset: u64, len: u64, out: &mut File, what: &Path) -> Result<()> {
    let short = || {
        DistError::invalid(format!(
            "{}: shorter than expected (the file changed while packing)",
            what.display()
        ))
    };
    let mut off_in = offset;
    let mut left = len;
    while left > 0 {
        let step = left.min(1 << 30) as usize;
        match rustix::fs::copy_file_range(src, Some(&mut off_in), &*out, None, step) {
            Ok(0) => return Err(short()),
            Ok(n) => left -= n as u64,
            Err(
                rustix::io::Errno::XDEV
                | rustix::io::Errno::INVAL
                | rustix::io::Errno::NOSYS
                | rustix::io::Errno::OPNOTSUPP,
            ) => {
                let mut f = src.try_clone().map_err(|e| DistError::io(what, e))?;
                f.seek(SeekFrom::Start(off_in))
                    .map_err(|e| DistError::io(what, e))?;
                let n =
                    std::io::copy(&mut f.take(left), out).map_err(|e| DistError::io(what, e))?;
                if n != left {
                    return Err(short());
                }
                left = 0;
            }
            Err(e) => return Err(DistError::io(what, e.into())),
        }
    }
    Ok(())
}

/// Appends one blob's bytes to `out`.
fn append_blob(b: &BlobRef, out: &mut File, what: &Path) -> Result<()> {
    match &b.source {
        BlobSource::Memory(v) => out.write_all(v).map_err(|e| DistError::io(what, e)),
        BlobSource::File { path, offset } => {
            let f = File::open(path).map_err(|e| DistError::io(path, e))?;
            copy_range(&f, *offset, b.size, out, path)
        }
    }
}

/// A ustar header from `tar`, deterministic: mtime 0, uid/gid 0, mode 0644 (0755 for
/// directories).
fn tar_header(name: &str, size: u64, dir: bool, out: &Path) -> Result<tar::Header> {
    let mut h = tar::Header::new_ustar();
    h.set_path(name).map_err(|e| DistError::io(out, e))?;
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
    h.set_cksum();
    Ok(h)
}

/// Writes the artifact as an OCI image-layout tar at `out`, tagged `tag`; returns the bytes
/// written. Headers come from `tar`; each member's data is copied in the kernel.
pub fn write_tar(a: &Artifact, out: &Path, tag: &str, progress: &dyn Fn(u64)) -> Result<u64> {
    const ZEROS: [u8; 1024] = [0; 1024];
    let staged = Staged::new(out, true)?;
    let mut file = File::create(staged.path()).map_err(|e| DistError::io(staged.path(), e))?;
    let io = |e: std::io::Error| DistError::io(out, e);
    let pad = |n: u64| ((512 - n % 512) % 512) as usize;
    let index = index_json(a, tag);
    let small: [(&str, &[u8], bool); 4] = [
        ("oci-layout", OCI_LAYOUT, false),
        ("index.json", &index, false),
        ("blobs/", &[], true),
        ("blobs/sha256/", &[], true),
    ];
    for (name, bytes, dir) in small {
        let h = tar_header(name, bytes.len() as u64, dir, out)?;
        file.write_all(h.as_bytes()).map_err(io)?;
        file.write_all(bytes).map_err(io)?;
        file.write_all(&ZEROS[..pad(bytes.len() as u64)])
            .map_err(io)?;
    }
    for b in unique_blobs(a) {
        let name = format!("blobs/sha256/{}", digest_hex(&b.digest)?);
        let h = tar_header(&name, b.size, false, out)?;
        file.write_all(h.as_bytes()).map_err(io)?;
        append_blob(&b, &mut file, out)?;
        file.write_all(&ZEROS[..pad(b.size)]).map_err(io)?;
        progress(b.size);
    }
    file.write_all(&ZEROS).map_err(io)?;
    file.sync_all().map_err(io)?;
    let n = file.metadata().map_err(io)?.len();
    staged.commit()?;
    Ok(n)
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
        append_blob(&b, &mut f, &p)?;
        total += b.size;
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
