//! Other programs' model caches, laid out as those programs write them, for the tests of
//! `gdsrun hf:…` / `ollama:…` and `gdsconv convert hf:…` / `ollama:…`.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Lowercase hex of `b`'s sha256 (an OCI digest without its `sha256:`).
pub fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Ollama's model directory (`OLLAMA_MODELS`): `blobs/sha256-HEX` and
/// `manifests/registry.ollama.ai/NAMESPACE/MODEL/TAG` (a Docker v2 manifest: the GGUF as
/// `application/vnd.ollama.image.model`, a template layer, and `extra` layers as JSON).
pub struct Ollama {
    /// The directory.
    pub dir: PathBuf,
}

impl Ollama {
    /// An empty model directory at `dir`.
    pub fn new(dir: &Path) -> Ollama {
        std::fs::create_dir_all(dir.join("blobs")).unwrap();
        Ollama {
            dir: dir.to_path_buf(),
        }
    }

    /// Stores `bytes` as a blob: its path. A blob already there is left as it is (its name
    /// is its content), as Ollama leaves it.
    pub fn blob(&self, bytes: &[u8]) -> PathBuf {
        let p = self
            .dir
            .join("blobs")
            .join(format!("sha256-{}", sha256_hex(bytes)));
        if !p.exists() {
            std::fs::write(&p, bytes).unwrap();
        }
        p
    }

    /// Stores Ollama's parameters `json` (what a Modelfile's `PARAMETER` lines become) as a
    /// blob: its layer descriptor, for [`Ollama::model`]'s `extra`.
    pub fn params(&self, json: &[u8]) -> serde_json::Value {
        self.blob(json);
        serde_json::json!({"mediaType": "application/vnd.ollama.image.params",
            "digest": format!("sha256:{}", sha256_hex(json)), "size": json.len()})
    }

    /// `NAMESPACE/MODEL/TAG`'s manifest: the GGUF `gguf` (stored as a blob), a Go template
    /// layer, and `extra` layer descriptors. Returns the GGUF's blob path.
    pub fn model(&self, name: &str, gguf: &[u8], extra: &[serde_json::Value]) -> PathBuf {
        let cfg = br#"{"model_format":"gguf","model_family":"llama"}"#;
        self.blob(cfg);
        let blob = self.blob(gguf);
        let mut layers = vec![
            serde_json::json!({"mediaType": "application/vnd.ollama.image.model",
                "digest": format!("sha256:{}", sha256_hex(gguf)), "size": gguf.len()}),
            serde_json::json!({"mediaType": "application/vnd.ollama.image.template",
                "digest": format!("sha256:{}", "0".repeat(64)), "size": 5}),
        ];
        layers.extend(extra.iter().cloned());
        let m = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                "digest": format!("sha256:{}", sha256_hex(cfg)), "size": cfg.len()},
            "layers": layers,
        });
        let p = self.dir.join("manifests/registry.ollama.ai").join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, m.to_string()).unwrap();
        blob
    }
}

/// One repository of the Hugging Face cache (`HF_HUB_CACHE`) as `huggingface_hub` writes it:
/// `models--ORG--NAME/blobs/…`, `snapshots/REV/` of links into the blobs, and `refs/main`
/// naming REV when `refs_main`. `files` are (path in the snapshot, source file).
pub fn hf_repo(cache: &Path, id: &str, rev: &str, refs_main: bool, files: &[(String, PathBuf)]) {
    let folder = cache.join(format!("models--{}", id.replace('/', "--")));
    let blobs = folder.join("blobs");
    let snap = folder.join("snapshots").join(rev);
    std::fs::create_dir_all(&blobs).unwrap();
    for (i, (rel, src)) in files.iter().enumerate() {
        let blob = blobs.join(format!("blob{i}"));
        std::fs::copy(src, &blob).unwrap();
        let link = snap.join(rel);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&blob, &link).unwrap();
    }
    if refs_main {
        std::fs::create_dir_all(folder.join("refs")).unwrap();
        std::fs::write(folder.join("refs/main"), rev).unwrap();
    }
}

/// Every file of a directory as (name, path), for [`hf_repo`].
pub fn dir_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), e.path())
        })
        .collect()
}
