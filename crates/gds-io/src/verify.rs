//! Integrity: files of a model directory opened without leaving it, and content hashes
//! checked before any byte is computed with.
//!
//! - [`open_in_dir`] opens a manifest-relative path one component at a time with
//!   `O_NOFOLLOW`, so a symbolic link anywhere inside the model directory (or a path that
//!   would leave it) is refused instead of followed.
//! - [`Verifier`] checks a layer file's BLAKE3 against the manifest the first time the file
//!   is used, and records each success in a small cache keyed by the file's identity
//!   (device, inode, size, modification and change times) and its expected hash, so later
//!   opens of an unchanged file cost one `fstat`. A file that is rewritten, replaced,
//!   touched or re-linked has a new change time and is hashed again.

use crate::IoError;
use gds_format::Manifest;
use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Opens `rel` (a manifest path, `/`-separated) inside `dir` for reading, with `flags` added
/// to the final `open` (e.g. `O_DIRECT`). Every component is opened relative to the previous
/// one with `O_NOFOLLOW`: a symbolic link inside the model directory is an error, so a model
/// directory can never make a reader open a file outside it. The result must be a regular
/// file. The directory `dir` itself may be reached through links.
///
/// The final component is opened with `O_NONBLOCK` (cleared again once it is known to be a
/// regular file): a FIFO or device in place of a model file is refused at once instead of
/// blocking the open for ever.
pub fn open_in_dir(dir: &Path, rel: &str, flags: i32) -> Result<File, IoError> {
    let path = dir.join(rel);
    let err = |error: std::io::Error| IoError::File {
        path: path.clone(),
        error,
    };
    if let Err(why) = gds_format::validate::check_path(rel) {
        return Err(IoError::Unsafe {
            path: path.clone(),
            why: format!("the manifest path {rel:?} {why}"),
        });
    }
    // O_DIRECTORY | O_NONBLOCK: a FIFO named as the model directory is refused at once
    // ("Not a directory") instead of blocking the open for ever
    let mut cur = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NONBLOCK)
            .open(dir)
            .map_err(|error| IoError::File {
                path: dir.to_path_buf(),
                error,
            })?
    };
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let mode = if last {
            flags | libc::O_NONBLOCK
        } else {
            libc::O_DIRECTORY
        };
        let name = CString::new(*part).map_err(|e| err(std::io::Error::other(e)))?;
        // SAFETY: `cur` is an open directory descriptor for the duration of the call and
        // `name` a NUL-terminated string; openat does not retain either.
        let fd = unsafe {
            libc::openat(
                cur.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW | mode,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            let is_link = e.raw_os_error() == Some(libc::ELOOP)
                || (e.raw_os_error() == Some(libc::ENOTDIR)
                    && std::fs::symlink_metadata(dir.join(parts[..=i].join("/")))
                        .is_ok_and(|m| m.file_type().is_symlink()));
            if is_link {
                return Err(IoError::Unsafe {
                    path: dir.join(parts[..=i].join("/")),
                    why: "is a symbolic link: a model directory must hold its files itself".into(),
                });
            }
            return Err(err(e));
        }
        // SAFETY: `fd` was just returned by openat, is valid and owned by nobody else.
        cur = unsafe { File::from_raw_fd(fd) };
    }
    require_regular(cur, &path)
}

/// Opens a file the user named (a command-line argument, a key file) for reading, links
/// followed: nonblocking, then checked on the descriptor (no window between a check and the
/// open), so that a FIFO without a writer, a socket or a device is an error ("not a regular
/// file", [`std::io::ErrorKind::InvalidInput`]) at once instead of an open or read that
/// blocks for ever. (Reads of a regular file ignore `O_NONBLOCK`.)
pub fn open_user_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if f.metadata()?.is_file() {
        Ok(f)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ))
    }
}

/// Opens `path` (outside a model directory's manifest: a file named on the command line, a
/// probe of the file system) for reading with `flags` added, like [`open_in_dir`]: a final
/// symbolic link is not followed, and a FIFO, socket or device is refused at once instead of
/// blocking the open.
pub fn open_regular(path: &Path, flags: i32) -> Result<File, IoError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | flags)
        .open(path)
        .map_err(|error| {
            if error.raw_os_error() == Some(libc::ELOOP) {
                IoError::Unsafe {
                    path: path.to_path_buf(),
                    why: "is a symbolic link: a model directory must hold its files itself".into(),
                }
            } else {
                IoError::File {
                    path: path.to_path_buf(),
                    error,
                }
            }
        })?;
    require_regular(file, path)
}

/// `file` (opened with `O_NONBLOCK`) if it is a regular file, with `O_NONBLOCK` cleared;
/// an [`IoError::Unsafe`] naming `path` otherwise.
fn require_regular(file: File, path: &Path) -> Result<File, IoError> {
    let err = |error: std::io::Error| IoError::File {
        path: path.to_path_buf(),
        error,
    };
    let meta = file.metadata().map_err(err)?;
    let t = meta.file_type();
    if !t.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_dir() {
            "a directory"
        } else {
            "a special file"
        };
        return Err(IoError::Unsafe {
            path: path.to_path_buf(),
            why: format!("is {what}, not a regular file"),
        });
    }
    // SAFETY: `file` is an open descriptor owned by this function; F_GETFL/F_SETFL only read
    // and set its status flags.
    let fl = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    let rc = if fl < 0 {
        fl
    } else {
        // SAFETY: as above.
        unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) }
    };
    if rc < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// Reads a whole file of the model directory that the manifest names in its file table
/// (`tokenizer.json`, `tokenizer_config.json`, …), checking its length and BLAKE3.
///
/// - Version 1.1 and later: a file the table does not list is not part of the model and
///   reads as absent (`Ok(None)`); a listed file that is missing, of another length or with
///   another hash is an [`IoError::Integrity`].
/// - Version 1.0 manifests hash no such file: it is read unverified (`verified: false`).
pub fn read_model_file(
    dir: &Path,
    m: &Manifest<'_>,
    rel: &str,
    max_bytes: u64,
) -> Result<Option<ModelFile>, IoError> {
    let path = dir.join(rel);
    let entry = if m.has_file_table() {
        match m.find_file(rel) {
            Some(e) => Some(e),
            None => return Ok(None),
        }
    } else {
        None
    };
    let file = match open_in_dir(dir, rel, 0) {
        Ok(f) => f,
        Err(IoError::File { error, .. })
            if entry.is_none() && error.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let len = file
        .metadata()
        .map_err(|error| IoError::File {
            path: path.clone(),
            error,
        })?
        .len();
    let limit = entry.map_or(max_bytes, |e| e.size.min(max_bytes));
    if len > limit {
        return Err(match entry {
            Some(e) if len != e.size => IoError::Integrity {
                path,
                why: format!("is {len} bytes, the manifest says {}", e.size),
            },
            _ => IoError::Unsafe {
                path,
                why: format!("is {len} bytes, more than the {max_bytes}-byte limit"),
            },
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    (&file)
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| IoError::File {
            path: path.clone(),
            error,
        })?;
    if let Some(e) = entry {
        if bytes.len() as u64 != e.size {
            return Err(IoError::Integrity {
                path,
                why: format!("is {} bytes, the manifest says {}", bytes.len(), e.size),
            });
        }
        if *blake3::hash(&bytes).as_bytes() != e.content_hash {
            return Err(IoError::Integrity {
                path,
                why: "content hash does not match the manifest (corrupt or edited)".into(),
            });
        }
    }
    Ok(Some(ModelFile {
        bytes,
        verified: entry.is_some(),
    }))
}

/// A small file of the model directory, read whole.
#[derive(Debug)]
pub struct ModelFile {
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// True when its length and hash were checked against the manifest (1.1 and later).
    pub verified: bool,
}

/// Whether layer files are hashed before use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyMode {
    /// Hash each file on first use unless the cache says this very file was verified.
    Hash,
    /// Trust the files (`--no-verify`).
    Off,
}

/// Counters of what verification cost, for the run's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerifyStats {
    /// Files hashed in this process.
    pub files_hashed: u64,
    /// Bytes hashed.
    pub bytes_hashed: u64,
    /// Nanoseconds spent hashing (reads of files hashed apart from their use included).
    pub hash_ns: u64,
    /// Files found verified in the cache.
    pub files_cached: u64,
}

/// Checks layer files against the manifest's hashes and remembers which were checked.
#[derive(Debug)]
pub struct Verifier {
    mode: VerifyMode,
    cache: Option<PathBuf>,
    files_hashed: AtomicU64,
    bytes_hashed: AtomicU64,
    hash_ns: AtomicU64,
    files_cached: AtomicU64,
}

/// The environment variable `key` as a path, when it is set and not empty (an empty one
/// counts as unset, as in the XDG rules and the programs whose caches GdsLLM reads).
pub fn env_path(key: &str) -> Option<PathBuf> {
    std::env::var_os(key)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The directory GdsLLM keeps per-user state in: `$GDSLLM_HOME`, else
/// `$XDG_CACHE_HOME/gdsllm`, else `$HOME/.cache/gdsllm`.
pub fn gdsllm_home() -> Option<PathBuf> {
    env_path("GDSLLM_HOME")
        .or_else(|| env_path("XDG_CACHE_HOME").map(|p| p.join("gdsllm")))
        .or_else(|| env_path("HOME").map(|p| p.join(".cache").join("gdsllm")))
}

impl Verifier {
    /// A verifier recording successes under [`gdsllm_home`]`/verified` (no cache when no
    /// such directory can be named).
    pub fn new(mode: VerifyMode) -> Verifier {
        Verifier::with_cache(mode, gdsllm_home().map(|h| h.join("verified")))
    }

    /// A verifier with an explicit cache directory (`None`: hash on every open).
    pub fn with_cache(mode: VerifyMode, cache: Option<PathBuf>) -> Verifier {
        Verifier {
            mode,
            cache,
            files_hashed: AtomicU64::new(0),
            bytes_hashed: AtomicU64::new(0),
            hash_ns: AtomicU64::new(0),
            files_cached: AtomicU64::new(0),
        }
    }

    /// The mode.
    pub fn mode(&self) -> VerifyMode {
        self.mode
    }

    /// The cache directory, if any.
    pub fn cache_dir(&self) -> Option<&Path> {
        self.cache.as_deref()
    }

    /// Counters so far.
    pub fn stats(&self) -> VerifyStats {
        VerifyStats {
            files_hashed: self.files_hashed.load(Ordering::Relaxed),
            bytes_hashed: self.bytes_hashed.load(Ordering::Relaxed),
            hash_ns: self.hash_ns.load(Ordering::Relaxed),
            files_cached: self.files_cached.load(Ordering::Relaxed),
        }
    }

    fn entry(&self, file: &File, expected: &[u8; 32]) -> Option<PathBuf> {
        let dir = self.cache.as_ref()?;
        let m = file.metadata().ok()?;
        let mut h = blake3::Hasher::new();
        h.update(b"gdsllm verified v1\0");
        for v in [
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime() as u64,
            m.mtime_nsec() as u64,
            m.ctime() as u64,
            m.ctime_nsec() as u64,
        ] {
            h.update(&v.to_le_bytes());
        }
        h.update(expected);
        Some(dir.join(h.finalize().to_hex().as_str()))
    }

    /// True when no hashing is needed for `file`: verification is off, or the cache records
    /// this file, unchanged, as having hashed to `expected`.
    pub fn is_verified(&self, file: &File, expected: &[u8; 32]) -> bool {
        if self.mode == VerifyMode::Off {
            return true;
        }
        let hit = self.entry(file, expected).is_some_and(|p| p.is_file());
        if hit {
            self.files_cached.fetch_add(1, Ordering::Relaxed);
        }
        hit
    }

    /// Records that `file` hashed to `expected` (best effort: an unwritable cache only means
    /// hashing again next time).
    pub fn record(&self, file: &File, expected: &[u8; 32]) {
        if let Some(p) = self.entry(file, expected) {
            if let Some(dir) = p.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = std::fs::write(&p, b"");
        }
    }

    /// Hashes `bytes` (the whole of `path`) and compares with `expected`.
    pub fn check_bytes(
        &self,
        path: &Path,
        bytes: &[u8],
        expected: &[u8; 32],
    ) -> Result<(), IoError> {
        let t0 = Instant::now();
        let got = hash_bytes(bytes);
        self.count(bytes.len() as u64, t0);
        if got != *expected {
            return Err(mismatch(path));
        }
        Ok(())
    }

    /// Reads `file` (the whole of `path`) through a bounded buffer, hashes it and compares
    /// with `expected`; records the success.
    pub fn check_file(&self, path: &Path, file: &File, expected: &[u8; 32]) -> Result<(), IoError> {
        let t0 = Instant::now();
        let mut h = blake3::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            let n = read_at(file, &mut buf, off).map_err(|error| IoError::File {
                path: path.to_path_buf(),
                error,
            })?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            off += n as u64;
        }
        self.count(off, t0);
        if *h.finalize().as_bytes() != *expected {
            return Err(mismatch(path));
        }
        self.record(file, expected);
        Ok(())
    }

    /// Counts a file of `bytes` hashed since `t0` (for backends hashing as they read).
    pub fn count_hashed(&self, bytes: u64, t0: Instant) {
        self.count(bytes, t0);
    }

    fn count(&self, bytes: u64, t0: Instant) {
        self.files_hashed.fetch_add(1, Ordering::Relaxed);
        self.bytes_hashed.fetch_add(bytes, Ordering::Relaxed);
        self.hash_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

fn read_at(file: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    loop {
        match file.read_at(buf, off) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// BLAKE3 of `bytes`, over several threads for large inputs.
pub fn hash_bytes(bytes: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    if bytes.len() >= 1 << 20 {
        h.update_rayon(bytes);
    } else {
        h.update(bytes);
    }
    *h.finalize().as_bytes()
}

pub(crate) fn mismatch(path: &Path) -> IoError {
    IoError::Integrity {
        path: path.to_path_buf(),
        why: "content hash does not match the manifest: the file is corrupt or was modified (run `gdsconv validate` on the directory)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DirectBackend, DirectOptions, LayerSource, MmapBackend, Span};
    use gds_format::{DType, LayerRecord, ManifestBuilder, TensorSpec};
    use std::sync::Arc;

    const LAYER: usize = 8192;

    /// A model directory of `n` one-tensor layers under `layers/`, with true hashes.
    fn model_dir(n: usize) -> (tempfile::TempDir, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("layers")).unwrap();
        let mut b = ManifestBuilder::new();
        for l in 0..n {
            let file = format!("layers/l{l}.bin");
            let data: Vec<u8> = (0..LAYER).map(|i| ((i * 3 + l) % 253) as u8).collect();
            std::fs::write(dir.path().join(&file), &data).unwrap();
            let spec = TensorSpec {
                name: format!("blk.{l}.t"),
                dtype: DType::F32,
                shape: vec![(LAYER / 4) as u64],
            };
            let layout = gds_format::layout(std::slice::from_ref(&spec)).unwrap();
            b.add_layer(&LayerRecord {
                name: format!("blk.{l}"),
                file,
                kind: gds_format::layer_kind::BLOCK,
                index: l as u32,
                tensors: vec![spec],
                layout,
                content_hash: *blake3::hash(&data).as_bytes(),
            });
        }
        (dir, b.finish())
    }

    fn flip(dir: &Path, rel: &str, at: usize) {
        let p = dir.join(rel);
        let mut d = std::fs::read(&p).unwrap();
        d[at] ^= 1;
        std::fs::write(&p, d).unwrap();
    }

    fn direct(
        dir: &Path,
        m: &[u8],
        v: Arc<Verifier>,
        resident: Vec<bool>,
    ) -> Result<DirectBackend, IoError> {
        DirectBackend::open(
            dir,
            &Manifest::parse(m).unwrap(),
            &DirectOptions {
                resident,
                slots: 2,
                slot_size: LAYER,
                force_buffered: false,
                keep_cached: false,
                verifier: Some(v),
            },
        )
    }

    fn uncached() -> Arc<Verifier> {
        Arc::new(Verifier::with_cache(VerifyMode::Hash, None))
    }

    #[test]
    fn runtime_never_computes_with_a_flipped_byte() {
        let (dir, m) = model_dir(3);
        // Layer 0 resident (read at open), layer 1 streamed whole, layer 2 read in pieces.
        flip(dir.path(), "layers/l0.bin", 100);
        let e = direct(dir.path(), &m, uncached(), vec![true, false, false])
            .err()
            .expect("a resident layer with a flipped byte must fail at open");
        assert!(matches!(e, IoError::Integrity { .. }), "{e}");
        assert!(e.to_string().contains("l0.bin"), "{e}");
        flip(dir.path(), "layers/l0.bin", 100);
        flip(dir.path(), "layers/l1.bin", 5000);
        flip(dir.path(), "layers/l2.bin", 7000);
        let b = direct(dir.path(), &m, uncached(), vec![true, false, false]).unwrap();
        let whole = b.acquire(1).expect_err("streamed layer must fail");
        assert!(
            matches!(whole, IoError::Integrity { .. }) && whole.to_string().contains("l1.bin"),
            "{whole}"
        );
        let mut row = [0u8; 16];
        let piece = b
            .read_at(2, 0, &mut row)
            .expect_err("a piece of a corrupt file must fail");
        assert!(piece.to_string().contains("l2.bin"), "{piece}");
        let span = b
            .acquire_span(Span {
                layer: 2,
                offset: 4096,
                len: 4096,
            })
            .expect_err("a span of a corrupt file must fail");
        assert!(matches!(span, IoError::Integrity { .. }), "{span}");
        // The mmap backend checks at open.
        let e = MmapBackend::open_with(dir.path(), &Manifest::parse(&m).unwrap(), &uncached())
            .err()
            .expect("mmap must refuse");
        assert!(matches!(e, IoError::Integrity { .. }), "{e}");
        // --no-verify trusts the files and says nothing.
        let off = Arc::new(Verifier::with_cache(VerifyMode::Off, None));
        let b = direct(dir.path(), &m, off.clone(), vec![true, false, false]).unwrap();
        assert!(b.acquire(1).is_ok() && b.read_at(2, 0, &mut row).is_ok());
        assert_eq!(off.stats().files_hashed, 0);
    }

    #[test]
    fn intact_files_are_hashed_once_then_cached_by_identity() {
        let (dir, m) = model_dir(3);
        let cache = tempfile::tempdir().unwrap();
        let v = || {
            Arc::new(Verifier::with_cache(
                VerifyMode::Hash,
                Some(cache.path().into()),
            ))
        };
        let first = v();
        let b = direct(dir.path(), &m, first.clone(), vec![true, false, false]).unwrap();
        b.acquire(1).unwrap();
        let mut row = [0u8; 16];
        b.read_at(2, 64, &mut row).unwrap();
        assert_eq!(row[0], 194, "byte 64 of layer 2: (64 * 3 + 2) % 253");
        let s = first.stats();
        assert_eq!(
            (s.files_hashed, s.bytes_hashed, s.files_cached),
            (3, 3 * LAYER as u64, 0)
        );
        drop(b);
        let second = v();
        let b = direct(dir.path(), &m, second.clone(), vec![true, false, false]).unwrap();
        b.acquire(1).unwrap();
        b.read_at(2, 64, &mut row).unwrap();
        let s = second.stats();
        assert_eq!(
            (s.files_hashed, s.files_cached),
            (0, 3),
            "later opens are free"
        );
        drop(b);
        // Rewriting a file (even with the same bytes) changes its identity: hashed again.
        flip(dir.path(), "layers/l1.bin", 9);
        flip(dir.path(), "layers/l1.bin", 9);
        let third = v();
        let b = direct(dir.path(), &m, third.clone(), vec![true, false, false]).unwrap();
        b.acquire(1).unwrap();
        let s = third.stats();
        assert_eq!((s.files_hashed, s.files_cached), (1, 2));
        // A file changed after it was cached is caught: the cache is keyed by identity.
        drop(b);
        flip(dir.path(), "layers/l0.bin", 1);
        assert!(matches!(
            direct(dir.path(), &m, v(), vec![true, false, false]).err(),
            Some(IoError::Integrity { .. })
        ));
    }

    #[test]
    fn symlinks_inside_the_model_directory_are_refused() {
        let (dir, m) = model_dir(1);
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("x.bin");
        std::fs::copy(dir.path().join("layers/l0.bin"), &target).unwrap();
        std::fs::remove_file(dir.path().join("layers/l0.bin")).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("layers/l0.bin")).unwrap();
        let man = Manifest::parse(&m).unwrap();
        let e = MmapBackend::open_with(dir.path(), &man, &uncached())
            .err()
            .expect("link");
        assert!(
            matches!(e, IoError::Unsafe { .. }) && e.to_string().contains("symbolic link"),
            "{e}"
        );
        // A linked directory component is refused too.
        std::fs::remove_dir_all(dir.path().join("layers")).unwrap();
        std::fs::create_dir(outside.path().join("layers")).unwrap();
        std::fs::rename(&target, outside.path().join("layers/l0.bin")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("layers"), dir.path().join("layers"))
            .unwrap();
        let e = open_in_dir(dir.path(), "layers/l0.bin", 0).expect_err("dir link");
        assert!(matches!(e, IoError::Unsafe { .. }), "{e}");
        // Paths the format forbids never reach the file system.
        for bad in ["../x.bin", "/etc/passwd", "C:head.bin", "a//b"] {
            assert!(
                matches!(open_in_dir(dir.path(), bad, 0), Err(IoError::Unsafe { .. })),
                "{bad}"
            );
        }
    }

    /// Runs `f` on a thread and fails the test when it has not returned within a minute:
    /// an open that blocks on a FIFO fails instead of hanging the test binary.
    fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{what}: blocked (a FIFO opened without O_NONBLOCK?)"))
    }

    fn mkfifo(p: &Path) {
        let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
        assert_eq!(rc, 0, "{}", p.display());
    }

    #[test]
    fn fifos_in_place_of_model_files_are_refused_without_blocking() {
        let (tmp, m) = model_dir(2);
        let dir = tmp.path().to_path_buf();
        std::fs::write(dir.join(gds_format::MANIFEST_FILE), &m).unwrap();
        for rel in [
            "layers/l0.bin",
            gds_format::MANIFEST_FILE,
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            let p = dir.join(rel);
            let _ = std::fs::remove_file(&p);
            mkfifo(&p);
            let d = dir.clone();
            let e = within(rel, move || open_in_dir(&d, rel, 0).map(|_| ()))
                .expect_err("a FIFO opened");
            assert!(
                matches!(e, IoError::Unsafe { .. })
                    && e.to_string().contains(rel)
                    && e.to_string().contains("FIFO"),
                "{rel}: {e}"
            );
            let p2 = p.clone();
            let e = within(rel, move || open_regular(&p2, 0).map(|_| ())).expect_err("FIFO");
            assert!(e.to_string().contains("FIFO"), "{e}");
            let pp = p.clone();
            let probe = within(rel, move || crate::probe_direct(&pp));
            assert!(matches!(probe, crate::DirectSupport::Buffered(_)), "{rel}");
        }
        // the manifest reader and the backends go through the same open
        let d = dir.clone();
        let e = within("manifest", move || crate::read_manifest(&d).map(|_| ())).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        let (d, mm) = (dir.clone(), m.clone());
        let e = within("mmap", move || {
            MmapBackend::open_with(&d, &Manifest::parse(&mm).unwrap(), &uncached()).map(|_| ())
        })
        .unwrap_err();
        assert!(e.to_string().contains("layers/l0.bin"), "{e}");
        let (d, mm) = (dir.clone(), m.clone());
        let e = within("direct", move || {
            direct(&d, &mm, uncached(), vec![false, false]).map(|_| ())
        })
        .unwrap_err();
        assert!(e.to_string().contains("layers/l0.bin"), "{e}");
        let mut b = ManifestBuilder::new();
        b.add_file(
            "tokenizer.json",
            gds_format::file_role::TOKENIZER,
            2,
            [0; 32],
        );
        let fm = b.finish();
        let d = dir.clone();
        let e = within("read_model_file", move || {
            read_model_file(
                &d,
                &Manifest::parse(&fm).unwrap(),
                "tokenizer.json",
                1 << 20,
            )
            .map(|_| ())
        })
        .unwrap_err();
        assert!(e.to_string().contains("tokenizer.json"), "{e}");
    }

    #[test]
    fn a_fifo_named_as_the_model_directory_is_refused_without_blocking() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("model");
        mkfifo(&fifo);
        let f = fifo.clone();
        let e = within("dir", move || {
            open_in_dir(&f, gds_format::MANIFEST_FILE, 0).map(|_| ())
        })
        .expect_err("a FIFO opened as a directory");
        assert_eq!(
            e.to_string(),
            format!("{}: Not a directory (os error 20)", fifo.display())
        );
        let f = fifo.clone();
        let e = within("read_manifest", move || {
            crate::read_manifest(&f).map(|_| ())
        })
        .unwrap_err();
        assert!(
            e.to_string().starts_with(&fifo.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn model_files_are_checked_against_the_file_table() {
        let dir = tempfile::tempdir().unwrap();
        let tok = br#"{"x":1}"#;
        std::fs::write(dir.path().join("tokenizer.json"), tok).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), b"{}").unwrap();
        let mut b = ManifestBuilder::new();
        b.add_file(
            "tokenizer.json",
            gds_format::file_role::TOKENIZER,
            tok.len() as u64,
            *blake3::hash(tok).as_bytes(),
        );
        let bytes = b.finish();
        let m = Manifest::parse(&bytes).unwrap();
        let f = read_model_file(dir.path(), &m, "tokenizer.json", 1 << 20)
            .unwrap()
            .unwrap();
        assert!(f.verified && f.bytes == tok);
        // Not listed in a 1.1 manifest: not part of the model, reads as absent.
        assert!(
            read_model_file(dir.path(), &m, "tokenizer_config.json", 1 << 20)
                .unwrap()
                .is_none()
        );
        std::fs::write(dir.path().join("tokenizer.json"), br#"{"x":2}"#).unwrap();
        let e = read_model_file(dir.path(), &m, "tokenizer.json", 1 << 20).unwrap_err();
        assert!(matches!(e, IoError::Integrity { .. }), "{e}");
        std::fs::write(dir.path().join("tokenizer.json"), br#"{"x":22}"#).unwrap();
        let e = read_model_file(dir.path(), &m, "tokenizer.json", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("manifest says 7"), "{e}");
    }
}
