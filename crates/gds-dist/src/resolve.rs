//! What `gdsrun MODEL` accepts: a model directory, an OCI reference (pulled into the store
//! on first use), or a `.gguf` file (converted into the store on first use).

use crate::error::{DistError, Result};
use crate::registry::{looks_like_reference, Remote, RemoteOptions};
use crate::store::Store;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// How to resolve.
#[derive(Clone, Default)]
pub struct ResolveOptions {
    /// Registry options (plain HTTP, rate).
    pub remote: RemoteOptions,
    /// Say nothing on stderr.
    pub quiet: bool,
}

/// The model directory `spec` names, pulling or converting it into the store first when
/// needed.
pub fn resolve_model(spec: &str, opts: &ResolveOptions) -> Result<PathBuf> {
    let path = Path::new(spec);
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => return Ok(path.to_path_buf()),
        Ok(m) if m.is_file() && is_gguf(path) => return converted(path, &m, opts),
        Ok(_) => {
            return Err(DistError::usage(format!(
                "{spec}: not a model directory, a .gguf file or a registry reference"
            )))
        }
        Err(_) => {}
    }
    if !looks_like_reference(spec) {
        return Err(DistError::usage(format!(
            "{spec}: No such file or directory (MODEL is a model directory, a .gguf file, or a registry reference REGISTRY/REPOSITORY:TAG or @sha256:…)"
        )));
    }
    let store = Store::open_default()?;
    if let Some(e) = store.get_ref(spec) {
        return Ok(store.model_dir(&e.digest));
    }
    let remote = Remote::new(spec, opts.remote.clone())?;
    if !opts.quiet {
        eprintln!("pulling {spec} into {} ...", store.root().display());
    }
    // the reference is recorded under the pull's own lock of the store
    let s = remote.pull_into_store_as(&store, spec)?;
    if !opts.quiet {
        eprintln!(
            "pulled {spec} ({}): {} blobs fetched, {} bytes",
            s.manifest_digest, s.downloaded_blobs, s.downloaded_bytes
        );
    }
    Ok(s.output)
}

fn is_gguf(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A `.gguf` converted once into the store, keyed by the file's identity (path, device,
/// inode, size, modification time) and, for the first shard of a split GGUF, every shard's:
/// converting again happens only when a file changes.
fn converted(path: &Path, meta: &std::fs::Metadata, opts: &ResolveOptions) -> Result<PathBuf> {
    let abs = std::fs::canonicalize(path).map_err(|e| DistError::io(path, e))?;
    let identity = |p: &Path, m: &std::fs::Metadata| {
        format!(
            "{}\0{}\0{}\0{}\0{}.{}",
            p.display(),
            m.dev(),
            m.ino(),
            m.len(),
            m.mtime(),
            m.mtime_nsec()
        )
    };
    let mut key = identity(&abs, meta);
    // the other shards (a file that cannot be read as a GGUF: the conversion says why)
    let shards = gds_convert::gguf::gguf_shards(path).unwrap_or_default();
    for s in shards.iter().skip(1) {
        let m = std::fs::metadata(s).map_err(|e| DistError::io(s, e))?;
        key.push('\n');
        key.push_str(&identity(s, &m));
    }
    let id = format!("gguf:{}", &blake3::hash(key.as_bytes()).to_hex()[..32]);
    let reference = abs.display().to_string();
    let store = Store::open_default()?;
    if let Some(e) = store.get_ref(&reference) {
        if e.digest == id {
            return Ok(store.model_dir(&id));
        }
    }
    let _lock = store.lock(false)?;
    // one conversion per model: a concurrent first use waits here, then finds it done
    let _entry = store.lock_entry(&id)?;
    if let Some(e) = store.get_ref(&reference) {
        if e.digest == id {
            return Ok(store.model_dir(&id));
        }
    }
    let out = store.model_dir(&id);
    if !opts.quiet {
        eprintln!(
            "converting {} into {} (once) ...",
            path.display(),
            out.display()
        );
    }
    let copts = gds_convert::ConvertOptions {
        force: true,
        ..Default::default()
    };
    struct Quiet;
    impl gds_convert::Progress for Quiet {}
    gds_convert::convert(path, &out, &copts, &Quiet).map_err(|e| {
        let msg = format!("{}: {e}", path.display());
        match e.kind() {
            gds_convert::ErrorKind::Input | gds_convert::ErrorKind::Internal => {
                DistError::invalid(msg)
            }
            _ => DistError::usage(msg),
        }
    })?;
    // share identical files with every other model in the store
    for f in crate::store::walk_files(&out) {
        store.ingest(&f)?;
    }
    store.set_ref(&reference, &id, "gguf")?;
    Ok(out)
}
