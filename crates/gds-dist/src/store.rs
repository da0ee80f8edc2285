//! The local content-addressed store, `$GDSLLM_HOME/store` (default
//! `~/.cache/gdsllm/store`):
//!
//! ```text
//! blobs/sha256/<hex>        each distinct blob once, read-only (0444)
//! partial/<hex>.partial     a download in progress (locked while written; resumed with Range)
//! models/<manifest hex>/    a model: its files hard-linked to blobs/ (no extra space)
//! configs/<hex>.config     a pulled model's config blob, hard-linked (kept while the model is)
//! refs/<escaped reference>  {"reference", "digest", "source"}: what `gdsrun REF` opens
//! ```
//!
//! Two models that share a file share its blob: the bytes are on disk once. `gc` removes
//! the models no reference names, then every blob nothing else links to (link count 1), so
//! a directory pulled elsewhere with hard links keeps its blobs alive.

use crate::error::{DistError, Result};
use crate::package::digest_hex;
use serde::{Deserialize, Serialize};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What [`Store::check_blob`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// No such blob.
    Missing,
    /// The blob, its bytes checked: their BLAKE3.
    Good([u8; 32]),
    /// A file whose bytes are not its name's: removed.
    Dropped,
}

/// The store.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
}

/// What a reference points to.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RefEntry {
    /// As the user wrote it (`registry/repo:tag`, `/abs/model.gguf`).
    pub reference: String,
    /// The model's id: the manifest digest for a pulled model, `gguf:<key>` for a converted one.
    pub digest: String,
    /// `oci` or `gguf`.
    pub source: String,
}

/// One line of `gdsconv list`.
#[derive(Clone, Debug, Serialize)]
pub struct Listed {
    /// The reference.
    pub reference: String,
    /// The model id.
    pub digest: String,
    /// Bytes of its files.
    pub bytes: u64,
    /// Its directory.
    pub path: PathBuf,
}

/// What `gc` removed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GcSummary {
    /// Model views no reference named.
    pub removed_models: u64,
    /// Blobs nothing linked to.
    pub removed_blobs: u64,
    /// Their bytes.
    pub removed_bytes: u64,
}

fn escape(reference: &str) -> String {
    let mut s = String::new();
    for b in reference.bytes() {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_' {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// A name part no other process or thread uses at the same time: `PID-N`.
pub(crate) fn unique_suffix() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// The suffix of the temporary hard links [`Store::ingest`] renames over a model's file.
pub const INGEST_TMP_SUFFIX: &str = ".ingest-tmp";
/// In the name of the directory under `partial/` where a pull assembles another tool's
/// files for their conversion (hard links of their blobs); a killed pull's goes at `gc`.
pub const FOREIGN_SRC: &str = ".src-";

impl Store {
    /// The store under `$GDSLLM_HOME` (or the user's cache directory), created if missing.
    pub fn open_default() -> Result<Store> {
        let home = gds_io::verify::gdsllm_home().ok_or_else(|| {
            DistError::usage("no store directory: set GDSLLM_HOME (or HOME / XDG_CACHE_HOME)")
        })?;
        Store::open(&home.join("store"))
    }

    /// The store at `root`, created if missing.
    pub fn open(root: &Path) -> Result<Store> {
        for d in ["blobs/sha256", "partial", "models", "refs", "configs"] {
            let p = root.join(d);
            fs::create_dir_all(&p).map_err(|e| DistError::io(&p, e))?;
        }
        Ok(Store {
            root: root.to_path_buf(),
        })
    }

    /// Its root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the blob `digest` lives.
    pub fn blob_path(&self, digest: &str) -> Result<PathBuf> {
        Ok(self.root.join("blobs/sha256").join(digest_hex(digest)?))
    }

    /// True when the store holds `digest` with `size` bytes.
    pub fn has_blob(&self, digest: &str, size: u64) -> bool {
        self.blob_path(digest)
            .ok()
            .and_then(|p| fs::symlink_metadata(p).ok())
            .is_some_and(|m| m.is_file() && m.len() == size)
    }

    /// Where a download of `digest` in progress is written.
    pub fn partial_path(&self, digest: &str) -> Result<PathBuf> {
        Ok(self
            .root
            .join("partial")
            .join(format!("{}.partial", digest_hex(digest)?)))
    }

    /// Moves a verified file into the store as `digest` (read-only), replacing what the
    /// store held under that name (whose bytes nobody checked here: the caller hashed
    /// `file`). Returns the blob's path and whether the store had no such blob before.
    pub fn commit_blob(&self, file: &Path, digest: &str) -> Result<(PathBuf, bool)> {
        let dst = self.blob_path(digest)?;
        let _ = fs::set_permissions(file, fs::Permissions::from_mode(0o444));
        let new = fs::symlink_metadata(&dst).is_err();
        match fs::rename(file, &dst) {
            Ok(()) => Ok((dst, new)),
            // another pull of the same blob (the same partial file, verified) moved it in first
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && dst.exists() => Ok((dst, false)),
            Err(e) => Err(DistError::usage(format!(
                "moving {} to {}: {e}",
                file.display(),
                dst.display()
            ))),
        }
    }

    /// Hashes the stored blob `digest` before it is used again (a blob is a hard link that
    /// anything linked to it can change in place; its size says nothing of its bytes): its
    /// BLAKE3 when its bytes are `size` bytes hashing to its name; otherwise it is removed
    /// from the store (the caller fetches it again).
    pub fn check_blob(&self, digest: &str, size: u64) -> Result<Stored> {
        let p = self.blob_path(digest)?;
        let m = match fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Stored::Missing),
            Err(e) => return Err(DistError::io(&p, e)),
        };
        if m.is_file() && m.len() == size {
            let mut f = fs::File::open(&p).map_err(|e| DistError::io(&p, e))?;
            let (sha, b3, n) = crate::package::hash_file(&p, &mut f)?;
            if sha == digest && n == size {
                return Ok(Stored::Good(b3));
            }
        }
        // the file the check read, not one another pull has just put in its place
        let same =
            fs::symlink_metadata(&p).is_ok_and(|now| now.ino() == m.ino() && now.dev() == m.dev());
        if same {
            let _ = fs::remove_file(&p);
        }
        eprintln!(
            "warning: {} does not hold the bytes its name says (changed in place through a hard link?): removed from the store, fetching it again",
            p.display()
        );
        Ok(Stored::Dropped)
    }

    /// Held by every pull and conversion into the store (shared) and by `gc` (exclusive),
    /// so that `gc` never removes a blob between its arrival and its first link.
    pub fn lock(&self, exclusive: bool) -> Result<fs::File> {
        let p = self.root.join(".lock");
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| DistError::io(&p, e))?;
        let op = if exclusive {
            rustix::fs::FlockOperation::LockExclusive
        } else {
            rustix::fs::FlockOperation::LockShared
        };
        rustix::fs::flock(&f, op).map_err(|e| DistError::io(&p, e.into()))?;
        Ok(f)
    }

    /// Takes the exclusive lock of one store entry (a model id): the pull or conversion of
    /// that model happens once, while every other process wanting it waits here and then
    /// finds it done. Callers hold [`Store::lock`] (shared) first, so `gc`, which removes
    /// unlocked lock files under the exclusive store lock, never removes one in use; a lock
    /// file replaced anyway is detected (its inode changed) and locked again.
    pub fn lock_entry(&self, id: &str) -> Result<fs::File> {
        let name = match id.strip_prefix("sha256:") {
            Some(h) => h.to_string(),
            None => escape(id),
        };
        let p = self.root.join("partial").join(format!("{name}.lock"));
        loop {
            let f = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&p)
                .map_err(|e| DistError::io(&p, e))?;
            rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)
                .map_err(|e| DistError::io(&p, e.into()))?;
            let held = f.metadata().map_err(|e| DistError::io(&p, e))?;
            match fs::metadata(&p) {
                Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => return Ok(f),
                _ => continue,
            }
        }
    }

    /// Puts the existing file `path` into the store (hashing it) and replaces it with a
    /// hard link to the stored blob, so that identical files share their bytes.
    ///
    /// Safe against other processes ingesting the same bytes at the same time: the
    /// temporary link has a name of its own (`.NAME.PID-N.ingest-tmp`, removed on failure;
    /// `gc` removes those a killed process left), and a blob that appears between the
    /// check and the link is used instead of ours.
    pub fn ingest(&self, path: &Path) -> Result<String> {
        let mut f = fs::File::open(path).map_err(|e| DistError::io(path, e))?;
        let (digest, _, _) = crate::package::hash_file(path, &mut f)?;
        drop(f);
        let dst = self.blob_path(&digest)?;
        if !dst.exists() {
            match fs::hard_link(path, &dst) {
                Ok(()) => {
                    let _ = fs::set_permissions(&dst, fs::Permissions::from_mode(0o444));
                    return Ok(digest);
                }
                // another process stored the same bytes first: link to its blob below
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(DistError::io(&dst, e)),
            }
        }
        let same = |a: &fs::Metadata, b: &fs::Metadata| a.ino() == b.ino() && a.dev() == b.dev();
        if let (Ok(a), Ok(b)) = (fs::metadata(path), fs::metadata(&dst)) {
            if same(&a, &b) {
                // already the blob (a rename between two links of one file does nothing)
                return Ok(digest);
            }
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.{}{INGEST_TMP_SUFFIX}", unique_suffix()));
        fs::hard_link(&dst, &tmp).map_err(|e| DistError::io(&tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            DistError::io(path, e)
        })?;
        Ok(digest)
    }

    /// Links the config blob of the pulled model `manifest_digest` as
    /// `configs/<manifest hex>.config`, so that `gc` keeps it while the model is in the
    /// store (no file of the model is the config).
    pub fn keep_config(&self, manifest_digest: &str, config_digest: &str) -> Result<()> {
        let dst = self
            .root
            .join("configs")
            .join(format!("{}.config", digest_hex(manifest_digest)?));
        let src = self.blob_path(config_digest)?;
        let tmp = dst.with_extension(format!("tmp-{}", unique_suffix()));
        fs::hard_link(&src, &tmp).map_err(|e| DistError::io(&tmp, e))?;
        fs::rename(&tmp, &dst).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            DistError::io(&dst, e)
        })
    }

    /// The directory of the model `id` (a manifest digest or `gguf:<key>`).
    pub fn model_dir(&self, id: &str) -> PathBuf {
        let name = match id.strip_prefix("sha256:") {
            Some(h) => h.to_string(),
            None => escape(id),
        };
        self.root.join("models").join(name)
    }

    fn ref_path(&self, reference: &str) -> PathBuf {
        self.root.join("refs").join(escape(reference))
    }

    /// What `reference` points to, if the store knows it and its model is present.
    pub fn get_ref(&self, reference: &str) -> Option<RefEntry> {
        let bytes = fs::read(self.ref_path(reference)).ok()?;
        let e: RefEntry = serde_json::from_slice(&bytes).ok()?;
        self.model_dir(&e.digest).is_dir().then_some(e)
    }

    /// Records `reference` → `digest` (atomically).
    pub fn set_ref(&self, reference: &str, digest: &str, source: &str) -> Result<()> {
        let p = self.ref_path(reference);
        let tmp = p.with_extension(format!("tmp-{}", unique_suffix()));
        let e = RefEntry {
            reference: reference.into(),
            digest: digest.into(),
            source: source.into(),
        };
        fs::write(&tmp, serde_json::to_vec(&e).unwrap_or_default())
            .map_err(|e| DistError::io(&tmp, e))?;
        fs::rename(&tmp, &p).map_err(|e| DistError::io(&p, e))
    }

    /// Every reference, sorted.
    pub fn refs(&self) -> Vec<RefEntry> {
        let mut v: Vec<RefEntry> = fs::read_dir(self.root.join("refs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|d| fs::read(d.path()).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect();
        v.sort_by(|a: &RefEntry, b| a.reference.cmp(&b.reference));
        v
    }

    /// `gdsconv list`.
    pub fn list(&self) -> Vec<Listed> {
        self.refs()
            .into_iter()
            .map(|e| {
                let path = self.model_dir(&e.digest);
                Listed {
                    bytes: dir_bytes(&path),
                    reference: e.reference,
                    digest: e.digest,
                    path,
                }
            })
            .collect()
    }

    /// Forgets `reference` (its bytes go at the next `gc`). False when it was unknown.
    pub fn remove_ref(&self, reference: &str) -> Result<bool> {
        let p = self.ref_path(reference);
        match fs::remove_file(&p) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(DistError::io(&p, e)),
        }
    }

    /// Removes the models no reference names, the blobs nothing links to, and abandoned
    /// partial downloads (those no process holds locked).
    pub fn gc(&self) -> Result<GcSummary> {
        let _lock = self.lock(true)?;
        let mut s = GcSummary::default();
        let live: std::collections::HashSet<PathBuf> = self
            .refs()
            .iter()
            .map(|e| self.model_dir(&e.digest))
            .collect();
        for d in fs::read_dir(self.root.join("models"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = d.path();
            if !live.contains(&p) {
                fs::remove_dir_all(&p).map_err(|e| DistError::io(&p, e))?;
                s.removed_models += 1;
            } else {
                // temporary links of an ingest that was killed (none runs now: every
                // ingest holds the store lock that gc holds exclusively)
                for f in walk_files(&p) {
                    if f.to_string_lossy().ends_with(INGEST_TMP_SUFFIX) {
                        fs::remove_file(&f).map_err(|e| DistError::io(&f, e))?;
                    }
                }
            }
        }
        // the configs of the models that remain stay (a link of their own keeps them)
        for d in fs::read_dir(self.root.join("configs"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = d.path();
            let name = d.file_name().to_string_lossy().into_owned();
            let model = name.strip_suffix(".config").unwrap_or("");
            if model.is_empty() || !self.root.join("models").join(model).is_dir() {
                fs::remove_file(&p).map_err(|e| DistError::io(&p, e))?;
            }
        }
        // another tool's files assembled for a conversion that was killed (no pull runs
        // now): their links go before the blobs are counted
        for d in fs::read_dir(self.root.join("partial"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = d.path();
            if d.file_name().to_string_lossy().contains(FOREIGN_SRC) && p.is_dir() {
                fs::remove_dir_all(&p).map_err(|e| DistError::io(&p, e))?;
            }
        }
        for d in fs::read_dir(self.root.join("blobs/sha256"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = d.path();
            if let Ok(m) = fs::symlink_metadata(&p) {
                if m.nlink() <= 1 {
                    fs::remove_file(&p).map_err(|e| DistError::io(&p, e))?;
                    s.removed_blobs += 1;
                    s.removed_bytes += m.len();
                }
            }
        }
        for d in fs::read_dir(self.root.join("partial"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = d.path();
            if let Ok(f) = fs::OpenOptions::new().write(true).open(&p) {
                if rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                    .is_ok()
                {
                    let _ = fs::remove_file(&p);
                }
            }
        }
        Ok(s)
    }
}

/// The regular files under `dir` (not following links), sorted.
pub fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for d in fs::read_dir(dir).into_iter().flatten().flatten() {
        match d.file_type() {
            Ok(t) if t.is_dir() => v.extend(walk_files(&d.path())),
            Ok(t) if t.is_file() => v.push(d.path()),
            _ => {}
        }
    }
    v.sort();
    v
}

/// Bytes of the regular files under `dir` (not following links).
pub fn dir_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    for d in fs::read_dir(dir).into_iter().flatten().flatten() {
        match d.file_type() {
            Ok(t) if t.is_dir() => n += dir_bytes(&d.path()),
            Ok(t) if t.is_file() => n += d.metadata().map(|m| m.len()).unwrap_or(0),
            _ => {}
        }
    }
    n
}

/// Hard-links `src` to `dst` (creating `dst`'s parents), copying when the two are on
/// different file systems.
pub fn link_or_copy(src: &Path, dst: &Path) -> Result<()> {
    if let Some(p) = dst.parent() {
        fs::create_dir_all(p).map_err(|e| DistError::io(p, e))?;
    }
    match fs::hard_link(src, dst) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EXDEV) | Some(libc::EPERM) | Some(libc::EMLINK)
            ) =>
        {
            fs::copy(src, dst).map_err(|e| DistError::io(dst, e))?;
            Ok(())
        }
        Err(e) => Err(DistError::io(dst, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::package::sha256_digest;

    fn put(store: &Store, bytes: &[u8]) -> (String, PathBuf) {
        let d = sha256_digest(bytes);
        let tmp = store.root().join("partial/x.tmp");
        fs::write(&tmp, bytes).unwrap();
        let (p, new) = store.commit_blob(&tmp, &d).unwrap();
        assert!(new);
        (d, p)
    }

    #[test]
    fn a_blob_changed_in_place_is_dropped_not_reused() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let bytes = vec![5u8; 10_000];
        let (d, p) = put(&store, &bytes);
        assert_eq!(
            store.check_blob(&d, 10_000).unwrap(),
            Stored::Good(*blake3::hash(&bytes).as_bytes())
        );
        // a pulled directory's hard link, made writable and edited: same size, other bytes
        let link = tmp.path().join("pulled.bin");
        fs::hard_link(&p, &link).unwrap();
        fs::set_permissions(&link, fs::Permissions::from_mode(0o644)).unwrap();
        let mut b = bytes.clone();
        b[5000] ^= 1;
        fs::write(&link, &b).unwrap();
        assert!(store.has_blob(&d, 10_000), "the size alone says nothing");
        assert_eq!(store.check_blob(&d, 10_000).unwrap(), Stored::Dropped);
        assert!(!p.exists(), "the bad blob is still in the store");
        assert_eq!(store.check_blob(&d, 10_000).unwrap(), Stored::Missing);
        // a verified copy replaces whatever the store holds under the name
        let (d2, p2) = put(&store, b"other");
        fs::set_permissions(&p2, fs::Permissions::from_mode(0o644)).unwrap();
        fs::write(&p2, b"OTHER").unwrap();
        let tmp2 = store.root().join("partial/y.tmp");
        fs::write(&tmp2, b"other").unwrap();
        assert!(!store.commit_blob(&tmp2, &d2).unwrap().1);
        assert_eq!(fs::read(&p2).unwrap(), b"other");
    }

    #[test]
    fn gc_keeps_the_config_of_a_model_in_the_store() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let (config, cp) = put(&store, b"{\"config\":1}");
        let m = format!("sha256:{}", "a".repeat(64));
        fs::create_dir_all(store.model_dir(&m)).unwrap();
        store.keep_config(&m, &config).unwrap();
        store.set_ref("reg.example/m:1", &m, "oci").unwrap();
        store.gc().unwrap();
        assert!(cp.exists(), "gc removed the config of a model in the store");
        // the model gone, its config goes
        store.remove_ref("reg.example/m:1").unwrap();
        let s = store.gc().unwrap();
        assert_eq!((s.removed_models, s.removed_blobs), (1, 1));
        assert!(!cp.exists());
        assert_eq!(
            fs::read_dir(store.root().join("configs")).unwrap().count(),
            0
        );
    }
}
