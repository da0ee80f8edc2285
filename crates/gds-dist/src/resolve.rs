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
    if let Some(name) = spec.strip_prefix("ollama:") {
        let blob = ollama_blob(name)?;
        let m = std::fs::metadata(&blob).map_err(|e| DistError::io(&blob, e))?;
        return converted(&blob, &m, opts);
    }
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

/// A `.gguf`, or a file that starts with GGUF's magic (Ollama's and Docker Model Runner's
/// blobs have no extension).
fn is_gguf(p: &Path) -> bool {
    if p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    use std::io::Read;
    let mut magic = [0u8; 4];
    // a FIFO in the file's place must not block
    gds_io::open_user_file(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|_| &magic == b"GGUF")
}

/// Where Ollama keeps its models: `$OLLAMA_MODELS`, else `~/.ollama/models`, else the Linux
/// service's `/usr/share/ollama/.ollama/models`.
fn ollama_dirs() -> Vec<PathBuf> {
    if let Some(d) = std::env::var_os("OLLAMA_MODELS").filter(|d| !d.is_empty()) {
        return vec![PathBuf::from(d)];
    }
    let mut v = Vec::new();
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        v.push(Path::new(&h).join(".ollama/models"));
    }
    v.push(PathBuf::from("/usr/share/ollama/.ollama/models"));
    v
}

/// The GGUF blob of a model Ollama has pulled (`ollama:NAME[:TAG]`, Ollama's own names:
/// `[HOST/][NAMESPACE/]MODEL[:TAG]`, by default `registry.ollama.ai`, `library`, `latest`),
/// found through its manifest in Ollama's model directory: run in place of downloading it
/// again. The manifest is read as a pulled one is ([`crate::foreign::parse_foreign`]): a LoRA
/// adapter and the like are refused by name.
fn ollama_blob(name: &str) -> Result<PathBuf> {
    let usage = |why: String| DistError::usage(format!("ollama:{name}: {why}"));
    let (path, tag) = match name.rsplit_once(':') {
        Some((p, t)) if !t.contains('/') => (p, t),
        _ => (name, "latest"),
    };
    let parts: Vec<&str> = path.split('/').collect();
    let (host, ns, model) = match parts.as_slice() {
        [m] => ("registry.ollama.ai", "library", *m),
        [n, m] => ("registry.ollama.ai", *n, *m),
        [h, n, m] => (*h, *n, *m),
        _ => {
            return Err(usage(
                "not an Ollama model name ([HOST/][NAMESPACE/]MODEL[:TAG])".into(),
            ))
        }
    };
    let safe = |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains(['/', '\\', '\0']);
    if ![host, ns, model, tag].iter().all(|c| safe(c)) {
        return Err(usage(
            "not an Ollama model name ([HOST/][NAMESPACE/]MODEL[:TAG])".into(),
        ));
    }
    let dirs = ollama_dirs();
    let Some((dir, manifest)) = dirs.iter().find_map(|d| {
        let m = d
            .join("manifests")
            .join(host)
            .join(ns)
            .join(model)
            .join(tag);
        m.is_file().then(|| (d.clone(), m))
    }) else {
        return Err(usage(format!(
            "Ollama has no such model here (looked for manifests/{host}/{ns}/{model}/{tag} in {}; `ollama pull {name}` fetches it, OLLAMA_MODELS names another directory)",
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        )));
    };
    let bytes = {
        use std::io::Read;
        let cap = crate::MAX_MANIFEST_BYTES as u64;
        let mut v = Vec::new();
        gds_io::open_user_file(&manifest)
            .and_then(|f| f.take(cap + 1).read_to_end(&mut v))
            .map_err(|e| DistError::io(&manifest, e))?;
        if v.len() as u64 > cap {
            return Err(DistError::invalid(format!(
                "{}: over the {cap}-byte limit of a manifest",
                manifest.display()
            )));
        }
        v
    };
    let what = format!("ollama:{name} ({})", manifest.display());
    let m = crate::foreign::parse_foreign(&bytes, &what)?;
    let gguf = m
        .files
        .iter()
        .find(|f| f.role == crate::foreign::Role::Gguf)
        .ok_or_else(|| DistError::invalid(format!("{what}: no GGUF layer")))?;
    let hex = crate::package::digest_hex(&gguf.layer.digest)?;
    let blob = dir.join("blobs").join(format!("sha256-{hex}"));
    if !blob.is_file() {
        return Err(usage(format!(
            "its weights {} are missing (an interrupted pull? `ollama pull {name}` again)",
            blob.display()
        )));
    }
    Ok(blob)
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
