//! The directory a conversion (or `gdsconv pack` / `pull`, through `gds-dist`) writes into,
//! beside OUT_DIR, how it becomes OUT_DIR, and when an existing OUT_DIR may be replaced.
//!
//! `PARENT/.NAME.tmp-PID` (or `.NAME.tmp-PID-K` when that name is taken) holds
//!
//! * `.gdsconv.lock`, locked with `flock` for as long as the writer runs. The kernel
//!   drops the lock when the process dies however it dies (SIGKILL, OOM killer, Ctrl-C), so
//!   a staging directory whose lock can be taken has no owner any more — PID reuse cannot
//!   make a dead owner look alive;
//! * `model`, the output being written: a directory ([`Staging::create`]) or, for a file
//!   output such as `pack -o X.tar`, a file the caller creates ([`Staging::create_for_file`]).
//!
//! The commit renames `model` onto OUT_DIR — when `--force` replaces an existing model,
//! by atomically exchanging the two (Linux `renameat2(RENAME_EXCHANGE)`), so that OUT_DIR
//! is at every instant either the old model or the new one — and then removes the
//! staging directory. Every writer first removes the staging directories in its parent
//! whose lock it can take ([`remove_stale`]): those of killed processes.
//!
//! [`check_output`] is the rule `--force` follows: an existing OUT_DIR is replaced only
//! when it holds nothing but a model, and none of the paths the caller protects (the
//! conversion's input, the store a pull goes through).

use crate::error::{io, ConvertError};
use rustix::fs::{flock, FlockOperation};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The lock file inside a staging directory.
const LOCK_FILE: &str = ".gdsconv.lock";
/// The output inside a staging directory.
const MODEL_DIR: &str = "model";

/// A staging directory this process owns (its lock held) until it is dropped, which
/// removes it.
pub struct Staging {
    dir: PathBuf,
    /// Held for the lifetime of the value: the lock is the proof of ownership.
    _lock: File,
}

/// The directory OUT_DIR lives in.
pub fn parent_of(out_dir: &Path) -> PathBuf {
    match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// True for names this module gives staging directories: `.NAME.tmp-PID` or
/// `.NAME.tmp-PID-K`, NAME non-empty, PID and K decimal.
fn is_staging_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.') else {
        return false;
    };
    let Some((stem, tail)) = rest.rsplit_once(".tmp-") else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    !stem.is_empty()
        && match tail.split_once('-') {
            None => digits(tail),
            Some((pid, k)) => digits(pid) && digits(k),
        }
}

/// Whether `file` is still the file at `path` (same device and inode).
fn is_same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Removes every staging directory in `parent` whose owner is gone, returning the paths
/// removed. Only directories with a staging name are looked at; one without a lock file is
/// removed only when empty (its owner, between creating it and its lock, then retries).
/// Errors are not fatal: a directory that cannot be examined or removed is left alone.
pub fn remove_stale(parent: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(is_staging_name) {
            continue;
        }
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue; // a symlink or a file with our name pattern is not ours
        }
        let dir = entry.path();
        let lock = match File::open(dir.join(LOCK_FILE)) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if std::fs::remove_dir(&dir).is_ok() {
                    removed.push(dir);
                }
                continue;
            }
            Err(_) => continue,
        };
        if flock(&lock, FlockOperation::NonBlockingLockExclusive).is_ok()
            && std::fs::remove_dir_all(&dir).is_ok()
        {
            removed.push(dir);
        }
    }
    removed
}

impl Staging {
    /// Creates and locks a new staging directory for `out_dir` in `parent` (which must
    /// exist), with an empty directory [`Staging::model`] to write the output in.
    pub fn create(out_dir: &Path, parent: &Path) -> Result<Staging, ConvertError> {
        let staging = Staging::create_for_file(out_dir, parent)?;
        std::fs::create_dir(staging.model()).map_err(io(staging.model()))?;
        Ok(staging)
    }

    /// Creates and locks a new staging directory for `out_dir` in `parent` (which must
    /// exist), without [`Staging::model`]: the caller creates it, a file or a directory.
    /// An error creating it names `out_dir`, not the hidden staging name.
    pub fn create_for_file(out_dir: &Path, parent: &Path) -> Result<Staging, ConvertError> {
        let name = out_dir
            .file_name()
            .ok_or_else(|| ConvertError::BadOutput {
                path: out_dir.into(),
                msg: "the output path has no directory name".into(),
            })?
            .to_string_lossy()
            .into_owned();
        let pid = std::process::id();
        let mut k = 0u32;
        // Each retry follows a cleaner removing the directory we just made (it had no lock
        // yet) or another process taking the name; a few are plenty.
        for _ in 0..64 {
            let dir = parent.join(if k == 0 {
                format!(".{name}.tmp-{pid}")
            } else {
                format!(".{name}.tmp-{pid}-{k}")
            });
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    k += 1;
                    continue;
                }
                Err(e) => return Err(io(out_dir)(e)),
            }
            let lock_path = dir.join(LOCK_FILE);
            let lock = match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&lock_path)
            {
                Ok(f) => f,
                // removed by a cleaner, or it put a file there: start again
                Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::AlreadyExists) => {
                    continue
                }
                Err(e) => return Err(io(&lock_path)(e)),
            };
            flock(&lock, FlockOperation::LockExclusive).map_err(|e| io(&lock_path)(e.into()))?;
            // A cleaner may have locked the file between our open and our flock, and
            // removed the directory: then the lock we hold is on a deleted file.
            if !is_same_file(&lock, &lock_path) {
                continue;
            }
            return Ok(Staging { dir, _lock: lock });
        }
        Err(io(parent)(std::io::Error::other(
            "could not create a temporary directory beside the output",
        )))
    }

    /// Where the output is written.
    pub fn model(&self) -> PathBuf {
        self.dir.join(MODEL_DIR)
    }

    /// Moves the written model to `out_dir`, replacing the model there when `replace`, and
    /// removes the staging directory (with the old model, if any). Without `replace`, an
    /// entry that appeared at `out_dir` meanwhile is [`ConvertError::OutputExists`].
    pub fn commit(self, out_dir: &Path, replace: bool) -> Result<(), ConvertError> {
        let model = self.model();
        if replace {
            exchange_or_replace(&model, out_dir, &self.dir)?;
        } else {
            rename_noreplace(&model, out_dir)?;
        }
        if let Ok(d) = File::open(parent_of(out_dir)) {
            let _ = d.sync_all();
        }
        Ok(()) // dropping self removes the staging directory
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A file output (`gdsrun imatrix -o`, `perplexity --save-logits`) written in a staging
/// directory beside it and renamed over it when complete: an error or a kill leaves the
/// output as it was (a kill leaves the staging directory, which the next writer into the
/// same directory removes, its lock free). Errors name the output, not the hidden name.
pub struct StagedFile {
    staging: Staging,
    target: PathBuf,
    removed: Vec<PathBuf>,
}

impl StagedFile {
    /// Checks `target` (a file name, not a directory, in a directory that exists), removes
    /// dead writers' staging directories beside it and creates the file to write; `what`
    /// says what is written, for the errors ("the importance matrix").
    pub fn create(target: &Path, what: &str) -> Result<(StagedFile, File), ConvertError> {
        let bad = |msg: String| ConvertError::BadOutput {
            path: target.to_path_buf(),
            msg,
        };
        if target.file_name().is_none() {
            return Err(bad(format!("not a file name to write {what} to")));
        }
        match std::fs::metadata(target) {
            Ok(m) if m.is_dir() => return Err(bad("it is a directory, not a file name".into())),
            // a device (`-o /dev/null`), FIFO or socket would be replaced by a regular file
            Ok(m) if !m.is_file() => {
                return Err(bad(
                    "not a regular file (a device, FIFO or socket, which the output would replace)"
                        .into(),
                ))
            }
            _ => {}
        }
        let parent = parent_of(target);
        match std::fs::metadata(&parent) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(bad(format!(
                    "cannot write {what} there: {} is not a directory",
                    parent.display()
                )))
            }
            Err(e) => {
                return Err(bad(format!(
                    "cannot write {what} there: {}: {e}",
                    parent.display()
                )))
            }
        }
        let removed = remove_stale(&parent);
        let staging = Staging::create_for_file(target, &parent).map_err(|e| match e {
            ConvertError::Io { error, .. } => bad(format!("cannot write {what} there: {error}")),
            e => e,
        })?;
        let file = File::create(staging.model()).map_err(io(target))?;
        Ok((
            StagedFile {
                staging,
                target: target.to_path_buf(),
                removed,
            },
            file,
        ))
    }

    /// The output's path.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The staging directories of killed writers that [`StagedFile::create`] removed (for
    /// the caller to report).
    pub fn removed(&self) -> &[PathBuf] {
        &self.removed
    }

    /// The directory holding the file being written (for a signal handler to remove).
    pub fn staging_dir(&self) -> &Path {
        &self.staging.dir
    }

    /// Syncs `file` (the one [`StagedFile::create`] returned) and renames it over the
    /// output.
    pub fn commit(self, file: File) -> Result<(), ConvertError> {
        file.sync_all().map_err(io(&self.target))?;
        drop(file);
        std::fs::rename(self.staging.model(), &self.target).map_err(io(&self.target))?;
        if let Ok(d) = File::open(parent_of(&self.target)) {
            let _ = d.sync_all();
        }
        Ok(()) // dropping the staging removes its directory
    }
}

/// Puts `model` at `out_dir`, which must not exist (an entry created there meanwhile is an
/// [`ConvertError::OutputExists`], not replaced).
fn rename_noreplace(model: &Path, out_dir: &Path) -> Result<(), ConvertError> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        match renameat_with(CWD, model, CWD, out_dir, RenameFlags::NOREPLACE) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::EXIST) => {
                return Err(ConvertError::OutputExists(out_dir.into()))
            }
            // file systems without renameat2 flags: the plain rename below
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {}
            Err(e) => return Err(io(out_dir)(e.into())),
        }
    }
    std::fs::rename(model, out_dir).map_err(io(out_dir))
}

/// Swaps `model` and the existing `out_dir` in one step; where the file system cannot,
/// moves `out_dir` into `staging` and `model` into its place (a crash in between leaves
/// no OUT_DIR, and the old model in the staging directory until the next conversion).
fn exchange_or_replace(model: &Path, out_dir: &Path, staging: &Path) -> Result<(), ConvertError> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        match renameat_with(CWD, model, CWD, out_dir, RenameFlags::EXCHANGE) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {}
            Err(e) => return Err(io(out_dir)(e.into())),
        }
    }
    let old = staging.join("old");
    std::fs::rename(out_dir, &old).map_err(io(out_dir))?;
    if let Err(e) = std::fs::rename(model, out_dir) {
        let _ = std::fs::rename(&old, out_dir);
        return Err(io(out_dir)(e));
    }
    Ok(())
}

/// What is at OUT_DIR before the output is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Nothing: the output is created.
    Nothing,
    /// A model directory that `--force` may replace.
    Model,
}

/// Files a model directory may hold besides the files its manifest names.
const MODEL_FILES: [&str; 4] = [
    gds_format::MANIFEST_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

/// Entries of the existing `out_dir` that are not part of its model (relative paths,
/// sorted): anything but [`MODEL_FILES`], `layers/`, and the regular files the manifest
/// names (layer files and its file table). When the manifest cannot be read, no layer file
/// counts as the model's.
fn foreign_entries(out_dir: &Path) -> Result<Vec<String>, ConvertError> {
    let manifest = crate::validate::read_manifest(out_dir).ok();
    let parsed = manifest
        .as_deref()
        .and_then(|b| gds_format::Manifest::parse(b).ok());
    let named: HashSet<&str> = parsed
        .as_ref()
        .map(|m| {
            m.layers()
                .map(|l| l.file)
                .chain(m.files().map(|f| f.path))
                .collect()
        })
        .unwrap_or_default();
    let mut foreign = Vec::new();
    let walk = |dir: &Path, prefix: &str, foreign: &mut Vec<String>| -> Result<(), ConvertError> {
        for e in std::fs::read_dir(dir).map_err(io(dir))? {
            let e = e.map_err(io(dir))?;
            let ty = e.file_type().map_err(io(e.path()))?;
            let rel = format!("{prefix}{}", e.file_name().to_string_lossy());
            let known = if ty.is_dir() {
                prefix.is_empty() && rel == "layers"
            } else {
                ty.is_file()
                    && (named.contains(rel.as_str())
                        || (prefix.is_empty() && MODEL_FILES.contains(&rel.as_str())))
            };
            if !known {
                foreign.push(if ty.is_dir() { format!("{rel}/") } else { rel });
            }
        }
        Ok(())
    };
    walk(out_dir, "", &mut foreign)?;
    let layers = out_dir.join("layers");
    if std::fs::symlink_metadata(&layers).is_ok_and(|m| m.is_dir()) {
        walk(&layers, "layers/", &mut foreign)?;
    }
    foreign.sort();
    Ok(foreign)
}

/// Decides whether an output directory may be written at `out_dir`: it must not exist,
/// or, with `force`, be a directory holding nothing but a model ([`MODEL_FILES`],
/// `layers/` and the files its manifest names) that is not and does not contain any of
/// `keep` (each a description, such as "the input", and a path that must exist).
/// Otherwise [`ConvertError::OutputExists`] (no `force`) or
/// [`ConvertError::ReplaceRefused`], listing what would be lost.
pub fn check_output(
    out_dir: &Path,
    force: bool,
    keep: &[(&str, &Path)],
) -> Result<Existing, ConvertError> {
    let refuse = |reason: String| ConvertError::ReplaceRefused {
        path: out_dir.into(),
        reason,
    };
    let meta = match std::fs::symlink_metadata(out_dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Existing::Nothing),
        Err(e) => return Err(io(out_dir)(e)),
        Ok(_) if !force => return Err(ConvertError::OutputExists(out_dir.into())),
        Ok(m) => m,
    };
    if !meta.is_dir() {
        return Err(refuse(format!(
            "it is {}, not a model directory",
            if meta.is_symlink() {
                "a symbolic link"
            } else {
                "a file"
            }
        )));
    }
    let real_out = std::fs::canonicalize(out_dir).map_err(io(out_dir))?;
    for (what, path) in keep {
        let real = std::fs::canonicalize(path).map_err(io(*path))?;
        if real.starts_with(&real_out) {
            return Err(refuse(format!("{what} {} is inside it", path.display())));
        }
    }
    let foreign = foreign_entries(out_dir)?;
    if !foreign.is_empty() {
        return Err(refuse(format!(
            "it holds files that are not part of a GdsLLM model: {} (move them away, or choose another OUT_DIR)",
            crate::check::list(foreign.into_iter())
        )));
    }
    Ok(Existing::Model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_names() {
        for ok in [".m.gds.tmp-123", ".m.tmp-1-2", ".a.tmp-b.tmp-9"] {
            assert!(is_staging_name(ok), "{ok}");
        }
        for no in [
            "m.tmp-123",
            "..tmp-1",
            ".m.tmp-",
            ".m.tmp-12a",
            ".m.tmp-1-",
            ".m.tmp-1-2-3",
            ".m.old-1",
            ".m.tmp-x",
        ] {
            assert!(!is_staging_name(no), "{no}");
        }
    }

    #[test]
    fn a_staged_file_replaces_its_output_whole_or_not_at_all() {
        let parent = tempfile::tempdir().unwrap();
        let names = || {
            let mut v: Vec<String> = std::fs::read_dir(parent.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let out = parent.path().join("x.bin");
        std::fs::write(&out, b"old").unwrap();
        // abandoned (an error): the old file stays, nothing else is left
        let (s, mut f) = StagedFile::create(&out, "x").unwrap();
        std::io::Write::write_all(&mut f, b"half").unwrap();
        drop((s, f));
        assert_eq!(names(), ["x.bin"]);
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        // a killed writer's staging directory (lock free) goes at the next create
        let dead = parent.path().join(".x.bin.tmp-4000000000");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(LOCK_FILE), b"").unwrap();
        std::fs::write(dead.join(MODEL_DIR), b"half").unwrap();
        let (s, mut f) = StagedFile::create(&out, "x").unwrap();
        assert!(!dead.exists());
        std::io::Write::write_all(&mut f, b"new").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        s.commit(f).unwrap();
        assert_eq!(names(), ["x.bin"]);
        assert_eq!(std::fs::read(&out).unwrap(), b"new");
        // a directory, or a missing parent: usage errors naming the output, once
        let fifo = parent.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
            0,
        )
        .unwrap();
        for (bad, why) in [
            (parent.path().to_path_buf(), "is a directory"),
            (parent.path().join("no/x.bin"), "os error 2"),
            (fifo.clone(), "not a regular file"),
            (PathBuf::from("/dev/null"), "not a regular file"),
        ] {
            let e = StagedFile::create(&bad, "x").err().unwrap();
            assert_eq!(e.kind(), crate::ErrorKind::Usage, "{e}");
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("{}: ", bad.display())), "{msg}");
            assert_eq!(msg.matches(why).count(), 1, "{msg}");
        }
        assert_eq!(names(), ["fifo", "x.bin"]);
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn a_held_lock_protects_a_staging_directory_and_a_released_one_does_not() {
        let parent = tempfile::tempdir().unwrap();
        let out = parent.path().join("m.gds");
        let live = Staging::create(&out, parent.path()).unwrap();
        std::fs::write(live.model().join("x"), b"x").unwrap();
        // a dead converter's directory: its lock file exists but nobody holds it
        let dead = parent.path().join(".other.tmp-4000000000");
        std::fs::create_dir_all(dead.join(MODEL_DIR)).unwrap();
        std::fs::write(dead.join(LOCK_FILE), b"").unwrap();
        // not ours: no lock file and not empty, or not our name
        let foreign = parent.path().join(".x.tmp-1");
        std::fs::create_dir_all(foreign.join("data")).unwrap();
        let user = parent.path().join("notes.tmp-1");
        std::fs::create_dir(&user).unwrap();

        let removed = remove_stale(parent.path());
        assert_eq!(removed, vec![dead.clone()]);
        assert!(!dead.exists());
        assert!(live.model().join("x").exists());
        assert!(foreign.exists() && user.exists());

        live.commit(&out, false).unwrap();
        assert!(out.join("x").exists());
        let mut left: Vec<_> = std::fs::read_dir(parent.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, [".x.tmp-1", "m.gds", "notes.tmp-1"]);
    }

    #[test]
    fn replacing_swaps_the_directories_and_drops_the_old_one() {
        let parent = tempfile::tempdir().unwrap();
        let out = parent.path().join("m.gds");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("old"), b"old").unwrap();
        let s = Staging::create(&out, parent.path()).unwrap();
        std::fs::write(s.model().join("new"), b"new").unwrap();
        s.commit(&out, true).unwrap();
        assert!(out.join("new").exists() && !out.join("old").exists());
        assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 1);
    }
}
