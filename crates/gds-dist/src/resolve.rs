//! What `gdsrun MODEL` accepts: a model directory, an OCI reference (pulled into the store
//! on first use), a `.gguf` file (converted into the store on first use), or a model another
//! program has fetched: `hf:ORG/NAME[:QUANT]` from the Hugging Face cache, `ollama:NAME[:TAG]`
//! from Ollama's directory (converted on first use; nothing downloaded).

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
        // a Hugging Face checkpoint (no model manifest, a config.json): converted on first
        // use, as a .gguf is
        Ok(m)
            if m.is_dir()
                && !path.join(gds_format::MANIFEST_FILE).exists()
                && path.join("config.json").is_file() =>
        {
            return converted(path, &m, opts)
        }
        Ok(m) if m.is_dir() => return Ok(path.to_path_buf()),
        Ok(m) if m.is_file() && gds_convert::gguf::is_gguf_file(path) => {
            return converted(path, &m, opts)
        }
        Ok(_) => {
            return Err(DistError::usage(format!(
                "{spec}: not a model directory, a .gguf file or a registry reference"
            )))
        }
        Err(_) => {}
    }
    // another program's cache (a path of that name, above, comes first)
    if let Some(p) = other_programs_model(spec) {
        let p = p?;
        let m = std::fs::metadata(&p.path).map_err(|e| DistError::io(&p.path, e))?;
        return converted_with(&p.path, &m, opts, p.params.as_deref());
    }
    if !looks_like_reference(spec) {
        return Err(DistError::usage(format!(
            "{spec}: No such file or directory (MODEL is a model directory, a .gguf file, a registry reference REGISTRY/REPOSITORY:TAG or @sha256:…, hf:ORG/NAME[:QUANT] or ollama:NAME[:TAG])"
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

/// The name a model `spec` resolved into the store goes by (the server's model name where
/// no `--alias` is given), from what the user wrote rather than the store's directory:
/// `hf:ORG/NAME[:QUANT]` → `NAME[:QUANT]`, `ollama:NAME[:TAG]` and a registry reference →
/// the last path component with its tag (`smollm2:135m`), a GGUF → its file stem (a split
/// one's without `-00001-of-0000N`), a directory → its name.
pub fn display_name(spec: &str) -> String {
    let last = |s: &str| {
        s.trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(s)
            .to_string()
    };
    if let Some(n) = spec
        .strip_prefix("hf:")
        .or_else(|| spec.strip_prefix("ollama:"))
    {
        return last(n);
    }
    let path = Path::new(spec);
    if path.exists() {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let stem = if path.is_dir() {
            path.file_name()
                .map_or(stem, |n| n.to_string_lossy().into_owned())
        } else {
            stem
        };
        // NAME-00001-of-00003 -> NAME
        let shard = format!("{stem}.gguf");
        return gds_convert::gguf::split_name(&shard).map_or(stem.clone(), |(p, _, _)| p.into());
    }
    // a registry reference: REPO:TAG's last component (a digest dropped)
    last(spec.split('@').next().unwrap_or(spec))
}

/// A model in another program's cache, as it lies there.
#[derive(Clone, Debug, PartialEq)]
pub struct OtherModel {
    /// The file or directory to convert (what `gdsconv convert` takes as its input).
    pub path: PathBuf,
    /// An Ollama model's parameters layer (its recommended sampling,
    /// [`crate::foreign::ollama_generation_config`]), when it has one.
    pub params: Option<PathBuf>,
}

impl OtherModel {
    /// The `generation_config.json` its conversion writes (an Ollama model's parameters),
    /// said on stderr unless `quiet`.
    pub fn generation_config(&self, what: &str, quiet: bool) -> Result<Option<String>> {
        match &self.params {
            Some(p) => crate::foreign::params_blob(p, what, quiet),
            None => Ok(None),
        }
    }
}

/// The model `hf:ORG/NAME[:QUANT]` (the Hugging Face cache) or `ollama:NAME[:TAG]` (Ollama's
/// directory) names in that program's cache; `None` for any other spec.
pub fn other_programs_model(spec: &str) -> Option<Result<OtherModel>> {
    if let Some(name) = spec.strip_prefix("hf:") {
        return Some(hf_snapshot(name).map(|path| OtherModel { path, params: None }));
    }
    spec.strip_prefix("ollama:").map(ollama_blob)
}

/// The Hugging Face hub's cache, as `huggingface_hub` finds it: `$HF_HUB_CACHE`, else
/// `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
fn hf_cache() -> Option<PathBuf> {
    use gds_io::verify::env_path;
    env_path("HF_HUB_CACHE")
        .or_else(|| env_path("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env_path("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
        .or_else(|| env_path("HOME").map(|h| h.join(".cache/huggingface/hub")))
}

/// What `hf:ORG/NAME[:QUANT]` names in the Hugging Face cache (a model `huggingface-cli
/// download`, transformers or vLLM fetched): the snapshot `refs/main` points to (or the only
/// one), and in it the GGUF whose file name holds QUANT (any case; the first shard of a
/// split one), the only GGUF, or else the directory itself (a safetensors checkpoint).
/// Nothing is downloaded; what is missing or ambiguous is an error saying what there is.
fn hf_snapshot(name: &str) -> Result<PathBuf> {
    let usage = |why: String| DistError::usage(format!("hf:{name}: {why}"));
    let (repo, quant) = match name.rsplit_once(':') {
        Some((r, q)) if !q.contains('/') => (r, Some(q)),
        _ => (name, None),
    };
    let safe = |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains(['\\', '\0']);
    let Some((org, model)) = repo
        .split_once('/')
        .filter(|(o, m)| safe(o) && safe(m) && !m.contains('/'))
    else {
        return Err(usage(
            "not a Hugging Face model id (hf:ORG/NAME[:QUANT])".into(),
        ));
    };
    let cache = hf_cache()
        .ok_or_else(|| usage("no Hugging Face cache (set HF_HUB_CACHE or HOME)".into()))?;
    let folder = cache.join(format!("models--{org}--{model}"));
    let missing = || {
        usage(format!(
            "not in the Hugging Face cache {} (`huggingface-cli download {repo}` fetches it; HF_HUB_CACHE names another cache)",
            cache.display()
        ))
    };
    if !folder.is_dir() {
        return Err(missing());
    }
    let snapshots = folder.join("snapshots");
    let commit = match std::fs::read_to_string(folder.join("refs/main")) {
        Ok(c) if safe(c.trim()) && !c.trim().contains('/') => c.trim().to_string(),
        _ => {
            let all: Vec<String> = std::fs::read_dir(&snapshots)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            match all.as_slice() {
                [one] => one.clone(),
                [] => return Err(missing()),
                _ => {
                    return Err(usage(format!(
                        "no refs/main, and {} snapshots in {}",
                        all.len(),
                        snapshots.display()
                    )))
                }
            }
        }
    };
    let snap = snapshots.join(&commit);
    if !snap.is_dir() {
        return Err(missing());
    }
    let ggufs: Vec<PathBuf> = dir_files(&snap)
        .into_iter()
        .filter(|p| {
            let n = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_ascii_lowercase();
            n.ends_with(".gguf") && !n.starts_with("mmproj")
        })
        .collect();
    let rel = |p: &Path| p.strip_prefix(&snap).unwrap_or(p).display().to_string();
    let chosen: Vec<&PathBuf> = match quant {
        Some(q) => {
            let q = q.to_ascii_lowercase();
            ggufs
                .iter()
                .filter(|p| rel(p).to_ascii_lowercase().contains(&q))
                .collect()
        }
        None => ggufs.iter().collect(),
    };
    // a split GGUF is its first shard
    let firsts: Vec<&PathBuf> = chosen
        .iter()
        .copied()
        .filter(|p| {
            let n = p.file_name().unwrap_or_default().to_string_lossy();
            gds_convert::gguf::split_name(&n).is_none_or(|(_, no, _)| no == 1)
        })
        .collect();
    match (firsts.as_slice(), quant) {
        ([one], _) => Ok((*one).clone()),
        ([], None) if snap.join("config.json").is_file() => Ok(snap),
        ([], _) => Err(usage(format!(
            "{} in {}",
            match quant {
                Some(q) => format!(
                    "no GGUF whose name holds {q:?} (there are: {})",
                    ggufs.iter().map(|p| rel(p)).collect::<Vec<_>>().join(", ")
                ),
                None => "neither a GGUF nor a config.json".into(),
            },
            snap.display()
        ))),
        (many, _) => Err(usage(format!(
            "{} GGUFs in {}: name one as hf:{repo}:QUANT ({})",
            many.len(),
            snap.display(),
            many.iter().map(|p| rel(p)).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Where Ollama keeps its models: `$OLLAMA_MODELS`, else `~/.ollama/models`, else the Linux
/// service's `/usr/share/ollama/.ollama/models`.
fn ollama_dirs() -> Vec<PathBuf> {
    if let Some(d) = gds_io::verify::env_path("OLLAMA_MODELS") {
        return vec![d];
    }
    let mut v = Vec::new();
    if let Some(h) = gds_io::verify::env_path("HOME") {
        v.push(h.join(".ollama/models"));
    }
    v.push(PathBuf::from("/usr/share/ollama/.ollama/models"));
    v
}

/// The GGUF blob of a model Ollama has pulled (`ollama:NAME[:TAG]`, Ollama's own names:
/// `[HOST/][NAMESPACE/]MODEL[:TAG]`, by default `registry.ollama.ai`, `library`, `latest`),
/// found through its manifest in Ollama's model directory: run in place of downloading it
/// again, with its parameters layer when it has one. The manifest is read as a pulled one is
/// ([`crate::foreign::parse_foreign`]): a LoRA adapter and the like are refused by name.
fn ollama_blob(name: &str) -> Result<OtherModel> {
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
    let blob_of = |l: &crate::package::Layer| -> Result<PathBuf> {
        let hex = crate::package::digest_hex(&l.digest)?;
        Ok(dir.join("blobs").join(format!("sha256-{hex}")))
    };
    let blob = blob_of(&gguf.layer)?;
    if !blob.is_file() {
        return Err(usage(format!(
            "its weights {} are missing (an interrupted pull? `ollama pull {name}` again)",
            blob.display()
        )));
    }
    // its parameters, where Ollama has them (a missing blob: none, as Ollama would fail)
    let params = match m
        .files
        .iter()
        .find(|f| f.role == crate::foreign::Role::Params)
    {
        Some(f) => Some(blob_of(&f.layer)?).filter(|p| p.is_file()),
        None => None,
    };
    Ok(OtherModel { path: blob, params })
}

/// A `.gguf` (or a Hugging Face directory, [`hf_snapshot`]) converted once into the store,
/// keyed by the file's identity (path, device, inode, size, modification time) and, for the
/// first shard of a split GGUF, every shard's, for a directory every file's (links
/// followed): converting again happens only when a file changes.
fn converted(path: &Path, meta: &std::fs::Metadata, opts: &ResolveOptions) -> Result<PathBuf> {
    converted_with(path, meta, opts, None)
}

/// [`converted`], with another program's parameters file `params` (an Ollama model's: its
/// recommended sampling, written into the conversion; part of the key, so that new
/// parameters convert again).
fn converted_with(
    path: &Path,
    meta: &std::fs::Metadata,
    opts: &ResolveOptions,
    params: Option<&Path>,
) -> Result<PathBuf> {
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
    let mut others = if meta.is_dir() {
        dir_files(path)
    } else {
        shard_siblings(path)
    };
    others.extend(params.map(Path::to_path_buf));
    for s in &others {
        let m = std::fs::metadata(s).map_err(|e| DistError::io(s, e))?;
        key.push('\n');
        key.push_str(&identity(s, &m));
    }
    let kind = if meta.is_dir() { "hf" } else { "gguf" };
    let id = format!("{kind}:{}", &blake3::hash(key.as_bytes()).to_hex()[..32]);
    // (the same GGUF blob under Ollama tags with other parameters: one reference each, so
    // that running them in turn does not convert each again)
    let reference = match params.and_then(Path::file_name) {
        Some(p) => format!("{}#{}", abs.display(), p.to_string_lossy()),
        None => abs.display().to_string(),
    };
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
    let generation_config = match params {
        Some(p) => crate::foreign::params_blob(p, &path.display().to_string(), opts.quiet)?,
        None => None,
    };
    let copts = gds_convert::ConvertOptions {
        force: true,
        generation_config,
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
    store.set_ref(&reference, &id, kind)?;
    Ok(out)
}

/// The other shards of a split GGUF whose first shard is `path`, by llama.cpp's naming (a
/// first shard must be named so for the conversion to find them; the conversion checks
/// them against the metadata): found from the name alone, so that a run of a converted
/// GGUF does not read the file before it finds the conversion. Only those that exist.
fn shard_siblings(path: &Path) -> Vec<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let Some((prefix, 1, count)) = gds_convert::gguf::split_name(name) else {
        return Vec::new();
    };
    let ext = &name[name.len() - 5..];
    let dir = path.parent().unwrap_or(Path::new(""));
    (2..=count)
        .map(|i| dir.join(gds_convert::gguf::shard_file_name(prefix, i, count, ext)))
        .filter(|p| p.is_file())
        .collect()
}

/// The files under `dir`, links followed, in name order (at most 4096 files in 256
/// directories, which bounds a link that loops: a model directory has a few dozen).
fn dir_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    let mut visited = 0;
    while let Some(d) = stack.pop() {
        visited += 1;
        if visited > 256 {
            break;
        }
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten().take(1024) {
            let p = e.path();
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => stack.push(p),
                Ok(m) if m.is_file() => out.push(p),
                _ => {}
            }
        }
    }
    out.sort();
    out.truncate(4096);
    out
}

#[cfg(test)]
mod tests {
    use super::display_name;

    #[test]
    fn display_names_come_from_what_the_user_wrote() {
        assert_eq!(
            display_name("hf:bartowski/Llama-3.2-1B-GGUF:Q4_K_M"),
            "Llama-3.2-1B-GGUF:Q4_K_M"
        );
        assert_eq!(display_name("hf:org/tiny"), "tiny");
        assert_eq!(display_name("ollama:smollm2:135m"), "smollm2:135m");
        assert_eq!(
            display_name("ollama:registry.ollama.ai/someone/tiny"),
            "tiny"
        );
        assert_eq!(
            display_name("registry.example.com/models/smollm2:latest"),
            "smollm2:latest"
        );
        assert_eq!(
            display_name("localhost:5000/ai/smollm2@sha256:00"),
            "smollm2"
        );
        let d = tempfile::tempdir().unwrap();
        let f = |n: &str| {
            let p = d.path().join(n);
            std::fs::write(&p, b"GGUF").unwrap();
            p.to_str().unwrap().to_string()
        };
        assert_eq!(display_name(&f("Qwen3-8B-Q8_0.gguf")), "Qwen3-8B-Q8_0");
        assert_eq!(display_name(&f("big-00001-of-00003.gguf")), "big");
        let dir = d.path().join("SmolLM2-135M");
        std::fs::create_dir(&dir).unwrap();
        assert_eq!(display_name(dir.to_str().unwrap()), "SmolLM2-135M");
    }
}
