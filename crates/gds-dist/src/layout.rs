//! The OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`), as a directory or a
//! tar, written deterministically (fixed order, mtime 0, uid/gid 0, mode 0644/0755) and read
//! back as an [`Artifact`] for `push`.
//!
//! Output appears atomically: it is written in a locked staging directory beside the target
//! (`.NAME.tmp-PID/`, gdsconv convert's) and renamed into place; a failure removes it, and
//! the next pack, pull or conversion into the same parent removes what a killed one left.

use crate::error::{DistError, Result};
use crate::package::{
    artifact_from_manifest, digest_hex, sha256_digest, Artifact, BlobRef, BlobSource,
};
use crate::*;
use gds_convert::staging::{self, Existing, Staging};
use gds_convert::ConvertError;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Largest `index.json` read.
const MAX_INDEX_BYTES: u64 = 1 << 20;

/// An output (a directory or a file) written in a locked staging directory beside its
/// target and renamed into place — gdsconv convert's staging ([`Staging`]): a process
/// killed however it dies leaves a staging directory whose lock nobody holds, which the
/// next pack, pull or conversion into the same parent removes. Dropped before
/// [`Staged::commit`], it removes what it wrote.
pub struct Staged {
    staging: Staging,
    target: PathBuf,
    /// How an existing target is treated at the commit.
    mode: Mode,
}

/// What [`Staged`] writes and what it may replace.
enum Mode {
    /// A file, replacing a regular file (never a directory).
    File,
    /// A directory, refused when the target exists unless `force`; `force` replaces only a
    /// model directory holding none of `keep` (gdsconv convert --force's rule).
    Dir {
        force: bool,
        keep: Vec<(String, PathBuf)>,
        /// Whether the command has a `--force` to suggest.
        has_force: bool,
    },
}

/// A [`ConvertError`] about the output as a [`DistError`] (2: usage or I/O; 1 otherwise).
pub(crate) fn output_error(e: ConvertError) -> DistError {
    match e.kind() {
        gds_convert::ErrorKind::Usage | gds_convert::ErrorKind::Io => {
            DistError::usage(e.to_string())
        }
        _ => DistError::invalid(e.to_string()),
    }
}

/// The parent directory of `target`, which must exist.
fn existing_parent(target: &Path) -> Result<PathBuf> {
    let parent = staging::parent_of(target);
    if !parent.is_dir() {
        return Err(DistError::usage(format!(
            "{}: the directory {} does not exist",
            target.display(),
            parent.display()
        )));
    }
    Ok(parent)
}

/// Removes the staging directories of killed processes in `parent`, saying so on stderr.
fn remove_stale(parent: &Path) {
    for d in staging::remove_stale(parent) {
        eprintln!(
            "warning: removed {}, left behind by a pack, pull or conversion that was killed",
            d.display()
        );
    }
}

impl Staged {
    /// Stages a directory for `target`: refused when `target` exists, unless `force`, which
    /// replaces it only when it holds nothing but a model and none of `keep` (a description
    /// and a path: "the store", the store's root). `has_force` says whether the refusal
    /// may suggest `--force`. Removes the stale staging directories in the parent first.
    pub fn dir(
        target: &Path,
        force: bool,
        keep: &[(&str, &Path)],
        has_force: bool,
    ) -> Result<Staged> {
        let mode = Mode::Dir {
            force,
            keep: keep
                .iter()
                .map(|(w, p)| (w.to_string(), p.to_path_buf()))
                .collect(),
            has_force,
        };
        Staged::new(target, mode)
    }

    /// Stages a file for `target`, which may be a file (replaced at the commit) but not a
    /// directory. Removes the stale staging directories in the parent first.
    pub fn file(target: &Path) -> Result<Staged> {
        Staged::new(target, Mode::File)
    }

    fn new(target: &Path, mode: Mode) -> Result<Staged> {
        if target.file_name().and_then(|n| n.to_str()).is_none() {
            return Err(DistError::usage(format!(
                "{}: not a file name",
                target.display()
            )));
        }
        let parent = existing_parent(target)?;
        mode.check(target)?;
        remove_stale(&parent);
        let staging = match mode {
            Mode::File => Staging::create_for_file(target, &parent),
            Mode::Dir { .. } => Staging::create(target, &parent),
        }
        .map_err(output_error)?;
        Ok(Staged {
            staging,
            target: target.to_path_buf(),
            mode,
        })
    }

    /// The temporary path to write (in the staging directory): for a directory, it exists
    /// and is empty; for a file, the caller creates it.
    pub fn path(&self) -> PathBuf {
        self.staging.model()
    }

    /// Puts the written output at the target: where a directory is replaced (`force`), by
    /// one atomic exchange (`renameat2(RENAME_EXCHANGE)`), so that the target is at every
    /// instant the old directory or the new one. The target is checked again first, as it
    /// may have changed while the output was written.
    pub fn commit(self) -> Result<()> {
        let replace = self.mode.check(&self.target)?;
        let Staged {
            staging,
            target,
            mode,
        } = self;
        staging
            .commit(&target, replace)
            .map_err(|e| mode.exists_error(e, &target))
    }
}

impl Mode {
    /// Whether `target` is to be replaced; an error when it may not be.
    fn check(&self, target: &Path) -> Result<bool> {
        match self {
            Mode::File => match std::fs::symlink_metadata(target) {
                Ok(m) if m.is_dir() => Err(DistError::usage(format!(
                    "{}: is a directory (pack -o writes a tar file; --layout writes a directory)",
                    target.display()
                ))),
                Ok(_) => match std::fs::metadata(target) {
                    // a device (`-o /dev/null`), FIFO or socket, or a link to one: the
                    // rename would replace it with a regular file
                    Ok(m) if !m.is_file() => Err(DistError::usage(format!(
                        "{}: not a regular file (a device, FIFO or socket, which the tar would replace)",
                        target.display()
                    ))),
                    _ => Ok(true),
                },
                Err(_) => Ok(false),
            },
            Mode::Dir { force, keep, .. } => {
                let keep: Vec<(&str, &Path)> = keep
                    .iter()
                    .map(|(w, p)| (w.as_str(), p.as_path()))
                    .collect();
                match staging::check_output(target, *force, &keep) {
                    Ok(x) => Ok(x == Existing::Model),
                    Err(e) => Err(self.exists_error(e, target)),
                }
            }
        }
    }

    /// `e`, where it says that `target` exists, worded for the command: `--force` is
    /// suggested only where there is one.
    fn exists_error(&self, e: ConvertError, target: &Path) -> DistError {
        let how = match self {
            Mode::Dir {
                has_force: true, ..
            } => "use --force to replace it",
            Mode::Dir { .. } => "pack does not replace a directory: remove it or choose another",
            Mode::File => "it appeared while packing: run pack again to replace it",
        };
        match e {
            ConvertError::OutputExists(_) => {
                DistError::usage(format!("{} already exists ({how})", target.display()))
            }
            e => output_error(e),
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

/// Copies `len` bytes of `src` (the file `src_path`) from `offset` to the end of `out` (the
/// file `out_path`) in the kernel (`copy_file_range`: no trip through user space), falling
/// back to read/write where the kernel cannot. A read error names the source, a write
/// error (a full disk) the output.
fn copy_range(
    src: &File,
    src_path: &Path,
    offset: u64,
    len: u64,
    out: &mut File,
    out_path: &Path,
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let short = || {
        DistError::usage(format!(
            "{}: shorter than when it was hashed (the file changed while packing)",
            src_path.display()
        ))
    };
    let mut off_in = offset;
    let mut left = len;
    while left > 0 {
        let step = left.min(1 << 30) as usize;
        match rustix::fs::copy_file_range(src, Some(&mut off_in), &*out, None, step) {
            Ok(0) => return Err(short()),
            Ok(n) => left -= n as u64,
            // only the output's side fails so
            Err(
                e @ (rustix::io::Errno::NOSPC
                | rustix::io::Errno::DQUOT
                | rustix::io::Errno::FBIG
                | rustix::io::Errno::ROFS),
            ) => return Err(DistError::io(out_path, e.into())),
            Err(rustix::io::Errno::INTR) => {}
            // the kernel cannot (another file system, a special file), or an error that
            // could be either side's (EIO): read and write, which tells them apart
            Err(_) => {
                let mut buf = vec![0u8; left.min(1 << 20) as usize];
                while left > 0 {
                    let k = left.min(buf.len() as u64) as usize;
                    let n = match src.read_at(&mut buf[..k], off_in) {
                        Ok(0) => return Err(short()),
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(DistError::io(src_path, e)),
                    };
                    out.write_all(&buf[..n])
                        .map_err(|e| DistError::io(out_path, e))?;
                    off_in += n as u64;
                    left -= n as u64;
                }
            }
        }
    }
    Ok(())
}

/// Appends one blob's bytes to `out` (the file `out_path`, named by write errors, opened
/// for reading too), then reads the copy back: it must be the blob its digest names (a
/// file that changed since it was hashed is refused, naming it).
fn append_blob(b: &BlobRef, out: &mut File, out_path: &Path) -> Result<()> {
    let start = out
        .stream_position()
        .map_err(|e| DistError::io(out_path, e))?;
    match &b.source {
        BlobSource::Memory(v) => out.write_all(v).map_err(|e| DistError::io(out_path, e))?,
        BlobSource::File { path, offset } => {
            let f = File::open(path).map_err(|e| DistError::io(path, e))?;
            copy_range(&f, path, *offset, b.size, out, out_path)?
        }
    }
    check_copy(b, out, out_path, start)
}

/// The sha256 of the `b.size` bytes of `out` from `start` must be `b.digest`.
fn check_copy(b: &BlobRef, out: &File, out_path: &Path, start: u64) -> Result<()> {
    use sha2::Digest;
    use std::os::unix::fs::FileExt;
    let mut sha = sha2::Sha256::new();
    let mut buf = vec![0u8; (b.size.min(4 << 20) as usize).max(1)];
    let (mut at, end) = (start, start + b.size);
    while at < end {
        let k = (end - at).min(buf.len() as u64) as usize;
        match out.read_at(&mut buf[..k], at) {
            Ok(0) => break,
            Ok(n) => {
                sha.update(&buf[..n]);
                at += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(DistError::io(out_path, e)),
        }
    }
    let got = format!("sha256:{}", crate::package::hex(&sha.finalize()));
    if at != end || got != b.digest {
        return Err(crate::package::mismatch(
            b,
            &got,
            "packing it; nothing was written",
        ));
    }
    Ok(())
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
    let staged = Staged::file(out)?;
    let io = |e: std::io::Error| DistError::io(out, e);
    // read too: each blob's copy is hashed again
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(staged.path())
        .map_err(io)?;
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
    let staged = Staged::dir(out, false, &[], false)?;
    let root = staged.path();
    // errors name the path the file will have, not the hidden staging directory's
    let io = |rel: &str| {
        let shown = out.join(rel);
        move |e: std::io::Error| DistError::io(&shown, e)
    };
    std::fs::create_dir_all(root.join("blobs/sha256")).map_err(io("blobs/sha256"))?;
    let put = |rel: &str, bytes: &[u8]| std::fs::write(root.join(rel), bytes).map_err(io(rel));
    put("oci-layout", OCI_LAYOUT)?;
    put("index.json", &index_json(a, tag))?;
    let mut total = 0;
    for b in unique_blobs(a) {
        let rel = format!("blobs/sha256/{}", digest_hex(&b.digest)?);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(root.join(&rel))
            .map_err(io(&rel))?;
        append_blob(&b, &mut f, &out.join(&rel))?;
        total += b.size;
        f.sync_all().map_err(io(&rel))?;
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
/// located (their digests are checked as they are read for upload).
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    fn file_blob(path: &Path, size: u64) -> BlobRef {
        BlobRef {
            digest: format!("sha256:{}", "0".repeat(64)),
            size,
            media_type: WEIGHT_MEDIA_TYPE.into(),
            path: None,
            blake3: None,
            source: BlobSource::File {
                path: path.to_path_buf(),
                offset: 0,
            },
        }
    }

    #[test]
    fn a_write_error_names_the_output_and_a_read_error_the_input() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("blk.0004.bin");
        std::fs::write(&src, vec![7u8; 100_000]).unwrap();
        // a full disk: /dev/full refuses every write with ENOSPC
        let full = Path::new("/dev/full");
        let mut out = std::fs::OpenOptions::new().write(true).open(full).unwrap();
        let e = append_blob(&file_blob(&src, 100_000), &mut out, full).unwrap_err();
        assert_eq!(e.kind, Kind::Usage, "{e}");
        assert!(e.msg.starts_with("/dev/full: "), "{e}");
        assert!(!e.msg.contains("blk.0004.bin"), "{e}");
        assert_eq!(e.msg.matches("os error 28").count(), 1, "{e}");
        // reading fails (a directory): the input is named
        let out_path = tmp.path().join("x.tar");
        let mut out = File::create(&out_path).unwrap();
        let e = append_blob(&file_blob(tmp.path(), 10), &mut out, &out_path).unwrap_err();
        assert!(
            e.msg.starts_with(&format!("{}: ", tmp.path().display())),
            "{e}"
        );
        assert!(!e.msg.contains("x.tar"), "{e}");
    }

    /// An artifact of one layer, the file `path`, packed as its bytes are now (also the
    /// registry's tests').
    pub(crate) fn one_file_artifact(path: &Path) -> Artifact {
        let bytes = std::fs::read(path).unwrap();
        let config = b"{}".to_vec();
        let layer = BlobRef {
            digest: sha256_digest(&bytes),
            size: bytes.len() as u64,
            media_type: WEIGHT_MEDIA_TYPE.into(),
            path: Some("layers/blk.0000.bin".into()),
            blake3: Some(*blake3::hash(&bytes).as_bytes()),
            source: BlobSource::File {
                path: path.to_path_buf(),
                offset: 0,
            },
        };
        let manifest = b"{\"m\":1}".to_vec();
        Artifact {
            manifest_digest: sha256_digest(&manifest),
            manifest,
            config: BlobRef::config(config),
            layers: vec![layer],
        }
    }

    #[test]
    fn pack_refuses_a_copy_that_is_not_the_digest_it_is_named_by() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let file = src.join("blk.0000.bin");
        let bytes: Vec<u8> = (0..2_000_000u32).map(|i| (i * 13 % 251) as u8).collect();
        std::fs::write(&file, &bytes).unwrap();
        let a = one_file_artifact(&file);
        let (tar, lay) = (tmp.path().join("m.tar"), tmp.path().join("lay"));
        // as hashed: both outputs, every blob named by its digest
        write_tar(&a, &tar, "t", &|_| {}).unwrap();
        write_layout_dir(&a, &lay, "t", &|_| {}).unwrap();
        for b in std::fs::read_dir(lay.join("blobs/sha256")).unwrap() {
            let b = b.unwrap();
            let want = format!("sha256:{}", b.file_name().to_str().unwrap());
            assert_eq!(sha256_digest(&std::fs::read(b.path()).unwrap()), want);
        }
        std::fs::remove_file(&tar).unwrap();
        std::fs::remove_dir_all(&lay).unwrap();
        // changed since it was hashed (the same size): refused (exit 1) naming the file, and
        // nothing written
        let mut changed = bytes.clone();
        changed[1_500_000] ^= 0xff;
        std::fs::write(&file, &changed).unwrap();
        let e = write_tar(&a, &tar, "t", &|_| {}).unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(
            e.msg.contains(&file.display().to_string())
                && e.msg.contains("changed since it was packed"),
            "{e}"
        );
        let e = write_layout_dir(&a, &lay, "t", &|_| {}).unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(e.msg.contains(&file.display().to_string()), "{e}");
        assert_eq!(names(tmp.path()), ["src"]);
        // shorter: a local I/O error (exit 2) naming it, nothing written
        std::fs::write(&file, &bytes[..1000]).unwrap();
        let e = write_tar(&a, &tar, "t", &|_| {}).unwrap_err();
        assert_eq!(e.kind, Kind::Usage, "{e}");
        assert!(e.msg.contains(&file.display().to_string()), "{e}");
        assert_eq!(names(tmp.path()), ["src"]);
    }

    #[test]
    fn a_file_output_is_never_a_device_or_fifo() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        let st = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(st.success());
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        for t in [&fifo, &link] {
            let e = Staged::file(t).err().unwrap();
            assert_eq!(e.kind, Kind::Usage, "{e}");
            assert!(e.msg.contains("not a regular file"), "{e}");
        }
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        assert_eq!(names(tmp.path()), ["fifo", "link"]);
    }

    /// A directory that `pull --force` may replace: only model files.
    fn model_dir(p: &Path, text: &str) {
        std::fs::create_dir_all(p.join("layers")).unwrap();
        std::fs::write(p.join("tokenizer.json"), text).unwrap();
    }

    #[test]
    fn force_replaces_a_model_directory_by_one_exchange() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("m");
        model_dir(&target, "0");
        // a poller that must never find the target missing while it is replaced again and
        // again (two renames, old away then new in, leave a window it falls into)
        let stop = Arc::new(AtomicBool::new(false));
        let missing = Arc::new(AtomicU64::new(0));
        let poller = {
            let (stop, missing, target) = (stop.clone(), missing.clone(), target.clone());
            std::thread::spawn(move || {
                let mut looks = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if std::fs::symlink_metadata(&target).is_err() {
                        missing.fetch_add(1, Ordering::Relaxed);
                    }
                    looks += 1;
                }
                looks
            })
        };
        for i in 1..=300 {
            let s = Staged::dir(&target, true, &[], true).unwrap();
            std::fs::write(s.path().join("tokenizer.json"), i.to_string()).unwrap();
            s.commit().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let looks = poller.join().unwrap();
        assert!(looks > 0);
        assert_eq!(
            missing.load(Ordering::Relaxed),
            0,
            "the target was missing during a replacement ({looks} looks)"
        );
        assert_eq!(
            std::fs::read_to_string(target.join("tokenizer.json")).unwrap(),
            "300"
        );
        // the old directories and the staging directories are gone
        assert_eq!(names(tmp.path()), ["m"]);
    }

    #[test]
    fn force_refuses_a_directory_with_other_files_or_the_store() {
        let tmp = tempfile::tempdir().unwrap();
        // user files: refused, listed, untouched
        let v = tmp.path().join("v");
        std::fs::create_dir_all(v.join("sub")).unwrap();
        std::fs::write(v.join("precious.txt"), "precious").unwrap();
        let e = Staged::dir(&v, true, &[], true).err().unwrap();
        assert_eq!(e.kind, Kind::Usage, "{e}");
        assert!(
            e.msg.contains("precious.txt") && e.msg.contains("sub/"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(v.join("precious.txt")).unwrap(),
            "precious"
        );
        // the store, or a directory holding it
        let home = tmp.path().join("home");
        let store = home.join("store");
        std::fs::create_dir_all(&store).unwrap();
        for d in [&home, &store] {
            let e = Staged::dir(d, true, &[("the store", &store)], true)
                .err()
                .unwrap();
            assert!(
                e.msg.contains("the store") && e.msg.contains("inside it"),
                "{e}"
            );
        }
        // the current directory, the root: no name to replace
        for d in [".", "/", ".."] {
            assert!(Staged::dir(Path::new(d), true, &[], true).is_err(), "{d}");
        }
        // a symbolic link to a model directory is not replaced either
        let m = tmp.path().join("m");
        model_dir(&m, "x");
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&m, &link).unwrap();
        let e = Staged::dir(&link, true, &[], true).err().unwrap();
        assert!(e.msg.contains("symbolic link"), "{e}");
        // nothing was staged
        assert_eq!(names(tmp.path()), ["home", "link", "m", "v"]);
    }

    #[test]
    fn exists_messages_suggest_force_only_where_there_is_one() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("lay");
        std::fs::create_dir(&d).unwrap();
        let e = Staged::dir(&d, false, &[], false).err().unwrap();
        assert!(e.msg.contains("already exists"), "{e}");
        assert!(!e.msg.contains("--force"), "{e}");
        let e = Staged::dir(&d, false, &[], true).err().unwrap();
        assert!(e.msg.contains("use --force"), "{e}");
        // a tar over a directory: refused, the directory kept
        let e = Staged::file(&d).err().unwrap();
        assert!(e.msg.contains("is a directory"), "{e}");
        assert!(d.is_dir());
    }

    #[test]
    fn a_file_output_replaces_a_file_and_leaves_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().join("x.tar");
        std::fs::write(&t, "old").unwrap();
        let s = Staged::file(&t).unwrap();
        std::fs::write(s.path(), "new").unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read_to_string(&t).unwrap(), "new");
        assert_eq!(names(tmp.path()), ["x.tar"]);
        // dropped before the commit: nothing left, the old file kept
        let s = Staged::file(&t).unwrap();
        std::fs::write(s.path(), "half").unwrap();
        drop(s);
        assert_eq!(std::fs::read_to_string(&t).unwrap(), "new");
        assert_eq!(names(tmp.path()), ["x.tar"]);
    }

    #[test]
    fn a_killed_writers_staging_is_removed_and_a_live_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        // a killed pack or pull: its staging directory, lock file unlocked, holding a
        // hard link that keeps a blob alive
        // a running one (its lock held) in the same parent
        let live = Staged::dir(&tmp.path().join("other"), false, &[], true).unwrap();
        let blob = tmp.path().join("blob");
        std::fs::write(&blob, "b").unwrap();
        let dead = tmp.path().join(".x.tar.tmp-4000000000");
        std::fs::create_dir_all(dead.join("model/layers")).unwrap();
        std::fs::write(dead.join(".gdsconv.lock"), "").unwrap();
        std::fs::hard_link(&blob, dead.join("model/layers/blk.0000.bin")).unwrap();
        assert_eq!(std::fs::metadata(&blob).unwrap().nlink(), 2);

        let s = Staged::file(&tmp.path().join("x.tar")).unwrap();
        assert!(
            !dead.exists(),
            "the killed writer's staging directory remains"
        );
        assert_eq!(std::fs::metadata(&blob).unwrap().nlink(), 1);
        assert!(
            live.path().is_dir(),
            "a running writer's staging was removed"
        );
        std::fs::write(s.path(), "t").unwrap();
        s.commit().unwrap();
        live.commit().unwrap();
        assert_eq!(names(tmp.path()), ["blob", "other", "x.tar"]);
    }
}
