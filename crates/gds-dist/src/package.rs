//! A model directory as a ModelPack artifact, and the rules an artifact must follow.
//!
//! [`package_dir`] refuses a directory that does not validate, hashes every file once
//! (sha256 for OCI, BLAKE3 compared with the manifest's record), and builds the config and
//! image manifest as canonical JSON: no timestamps, files in a fixed order (`manifest.gdsm`,
//! the layer files in manifest order, then the file table in its order), so the same
//! directory always gives the same manifest digest and an unchanged file the same blob in
//! every model that ships it.
//!
//! [`parse_manifest`] is the other direction: every rule an artifact from a registry or an
//! OCI layout must follow before anything is downloaded or written.

use crate::error::{DistError, Result};
use crate::json::canonical;
use crate::*;
use gds_format::validate::{check_path, PathSet};
use gds_format::{file_role, MANIFEST_FILE};
use rayon::prelude::*;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a blob's bytes are.
#[derive(Clone, Debug)]
pub enum BlobSource {
    /// Held in memory (config, image manifest).
    Memory(Arc<Vec<u8>>),
    /// `size` bytes of `path` from `offset` (a model file, a layout blob, a tar member).
    File {
        /// The file.
        path: PathBuf,
        /// Where the blob starts in it.
        offset: u64,
    },
}

/// One blob of an artifact.
#[derive(Clone, Debug)]
pub struct BlobRef {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Length in bytes.
    pub size: u64,
    /// OCI media type.
    pub media_type: String,
    /// `org.cncf.model.filepath` (layers only).
    pub path: Option<String>,
    /// BLAKE3 recorded by the model manifest (layers only).
    pub blake3: Option<[u8; 32]>,
    /// Its bytes.
    pub source: BlobSource,
}

impl BlobRef {
    /// A ModelPack config blob held in memory.
    pub fn config(bytes: Vec<u8>) -> BlobRef {
        BlobRef {
            digest: sha256_digest(&bytes),
            size: bytes.len() as u64,
            media_type: CONFIG_MEDIA_TYPE.into(),
            path: None,
            blake3: None,
            source: BlobSource::Memory(Arc::new(bytes)),
        }
    }
}

/// An artifact: the image manifest, its config and its layers.
#[derive(Clone, Debug)]
pub struct Artifact {
    /// The image manifest, exactly as pushed (its sha256 is the digest).
    pub manifest: Vec<u8>,
    /// `sha256:<hex>` of `manifest`.
    pub manifest_digest: String,
    /// The config blob.
    pub config: BlobRef,
    /// The layers, one per file.
    pub layers: Vec<BlobRef>,
}

impl Artifact {
    /// Config then layers.
    pub fn blobs(&self) -> impl Iterator<Item = &BlobRef> {
        std::iter::once(&self.config).chain(self.layers.iter())
    }

    /// Bytes of every blob.
    pub fn total_bytes(&self) -> u64 {
        self.blobs().map(|b| b.size).sum()
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hex part of a `sha256:<64 lowercase hex>` digest, or an error.
pub fn digest_hex(digest: &str) -> Result<&str> {
    match digest.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => {
            Ok(h)
        }
        _ => Err(DistError::invalid(format!(
            "digest {digest:?} is not sha256:<64 lowercase hex digits>"
        ))),
    }
}

fn parse_blake3(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The error for a blob whose bytes, read again (`doing` it: "uploading it", "packing
/// it"), are not the blob (their sha256 is `sha`, or their BLAKE3 is not the layer's):
/// it names the file and says how it came apart — a model file that changed since it was
/// packed, or an OCI layout whose blob is not what its name says.
pub(crate) fn mismatch(b: &BlobRef, sha: &str, doing: &str) -> DistError {
    let hex = b.digest.strip_prefix("sha256:").unwrap_or(&b.digest);
    let got = if sha == b.digest {
        format!("its BLAKE3 is not the {BLAKE3_ANNOTATION} of its layer")
    } else {
        format!("its sha256 is {sha}")
    };
    DistError::invalid(match &b.source {
        BlobSource::File { path, offset } if *offset == 0 && path.file_name().is_some_and(|n| n == hex) => {
            format!(
                "{}: the layout's blob does not match its digest {} ({got} when {doing})",
                path.display(),
                b.digest
            )
        }
        BlobSource::File { path, offset } if *offset > 0 => format!(
            "{}: the layout's blob blobs/sha256/{hex} (at byte {offset}) does not match its digest ({got} when {doing})",
            path.display()
        ),
        BlobSource::File { path, .. } => format!(
            "{}: changed since it was packed: {got} when {doing}, not that of the blob {} it was packed as",
            path.display(),
            b.digest
        ),
        BlobSource::Memory(_) => format!(
            "blob {} ({}) does not match its digest ({got} when {doing})",
            b.digest, b.media_type
        ),
    })
}

/// A file of the model directory to ship.
struct ShipFile {
    path: String,
    media_type: &'static str,
    size: u64,
    blake3: [u8; 32],
}

/// Reads `path` once, in 4 MiB pieces: (sha256, BLAKE3, length).
pub fn hash_file(path: &Path, file: &mut std::fs::File) -> Result<(String, [u8; 32], u64)> {
    let mut sha = Sha256::new();
    let mut b3 = blake3::Hasher::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut n = 0u64;
    loop {
        let k = file.read(&mut buf).map_err(|e| DistError::io(path, e))?;
        if k == 0 {
            break;
        }
        sha.update(&buf[..k]);
        b3.update(&buf[..k]);
        n += k as u64;
    }
    Ok((
        format!("sha256:{}", hex(&sha.finalize())),
        *b3.finalize().as_bytes(),
        n,
    ))
}

/// "135M", "1.2B": ModelPack's `paramSize`.
fn param_size(n: u64) -> String {
    let f = n as f64;
    if f >= 1e9 {
        format!("{:.1}B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.0}M", f / 1e6)
    } else {
        format!("{:.0}K", f / 1e3)
    }
}

/// The model manifest in `bytes`, validated; otherwise an invalid-package error whose
/// message `say` makes from the validator's errors (one per line, indented).
pub(crate) fn validated(
    bytes: &[u8],
    say: impl FnOnce(String) -> String,
) -> Result<gds_format::reader::Manifest<'_>> {
    let (m, errs) = gds_format::validate::validate_manifest(bytes);
    match m {
        Some(m) if errs.is_empty() => Ok(m),
        _ => {
            let errs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
            Err(DistError::invalid(say(errs.join("\n  "))))
        }
    }
}

/// Packages the model directory `dir`: validates it, hashes every file (calling `progress`
/// with bytes hashed), and builds the artifact. Refuses an invalid directory and any file
/// over [`MAX_BLOB_BYTES`].
pub fn package_dir(dir: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<Artifact> {
    let bytes = gds_io::read_manifest(dir).map_err(|e| DistError::invalid(e.to_string()))?;
    let m = validated(&bytes, |errs| {
        format!(
            "{}: the manifest does not validate, refusing to package it:\n  {errs}",
            dir.join(MANIFEST_FILE).display()
        )
    })?;
    if !m.has_file_table() {
        return Err(DistError::invalid(format!(
            "{}: format 1.0 manifests do not hash the tokenizer; convert the model again to get a 1.1 manifest before packaging it",
            dir.display()
        )));
    }
    let mut files = vec![ShipFile {
        path: MANIFEST_FILE.into(),
        media_type: WEIGHT_CONFIG_MEDIA_TYPE,
        size: bytes.len() as u64,
        blake3: *blake3::hash(&bytes).as_bytes(),
    }];
    for l in m.layers() {
        files.push(ShipFile {
            path: l.file.into(),
            media_type: WEIGHT_MEDIA_TYPE,
            size: l.file_size,
            blake3: l.content_hash,
        });
    }
    for f in m.files() {
        files.push(ShipFile {
            path: f.path.into(),
            media_type: if f.role == file_role::DOC {
                DOC_MEDIA_TYPE
            } else {
                WEIGHT_CONFIG_MEDIA_TYPE
            },
            size: f.size,
            blake3: f.content_hash,
        });
    }
    if let Some(f) = files.iter().find(|f| f.size > MAX_BLOB_BYTES) {
        return Err(DistError::invalid(format!(
            "{}: {} bytes, over the {MAX_BLOB_BYTES}-byte limit registries such as GHCR and Harbor put on one blob (splitting a file is not supported)",
            dir.join(&f.path).display(),
            f.size
        )));
    }
    // one read of every file, in parallel: sha256 for OCI, BLAKE3 against the manifest
    let hash_all = || -> Result<Vec<String>> {
        files
        .par_iter()
        .map(|f| {
            let path = dir.join(&f.path);
            let mut file = gds_io::open_in_dir(dir, &f.path, 0)
                .map_err(|e| DistError::invalid(e.to_string()))?;
            let (sha, b3, n) = hash_file(&path, &mut file)?;
            progress(n);
            if n != f.size {
                return Err(DistError::invalid(format!(
                    "{}: {n} bytes, the manifest says {}",
                    path.display(),
                    f.size
                )));
            }
            if b3 != f.blake3 {
                return Err(DistError::invalid(format!(
                    "{}: content hash does not match the manifest (the file changed after conversion)",
                    path.display()
                )));
            }
            Ok(sha)
        })
        .collect::<Result<_>>()
    };
    // the whole validation (files, architecture, tokenizer, chat template) runs beside the
    // hashing: the tokenizer's parse costs about as much as hashing a small model
    let (report, digests) = rayon::join(
        || gds_convert::validate_dir(dir, gds_convert::Depth::Quick),
        hash_all,
    );
    if !report.valid {
        return Err(DistError::invalid(format!(
            "{} does not validate, refusing to package it:\n  {}",
            dir.display(),
            report.errors.join("\n  ")
        )));
    }
    let digests = digests?;

    let arch = m.get_str("general.architecture").unwrap_or("unknown");
    let name = m
        .get_str("general.name")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| dir.file_name().and_then(|s| s.to_str()))
        .unwrap_or("model");
    let mut params = 0u64;
    let mut by_dtype: std::collections::BTreeMap<&str, u64> = Default::default();
    for t in m.tensors() {
        params = params.saturating_add(t.n_elements());
        *by_dtype.entry(t.dtype.name()).or_default() += t.nbytes;
    }
    let dominant = by_dtype
        .iter()
        .max_by_key(|(_, b)| **b)
        .map(|(d, _)| *d)
        .unwrap_or("f32");
    let quantized = gds_format::DType::from_name(dominant).is_some_and(|d| d.is_quantized());
    let (major, minor) = m.version();
    let mut model_config = json!({
        "architecture": arch,
        "format": format!("gdsllm-{major}.{minor}"),
        "paramSize": param_size(params),
    });
    if quantized {
        model_config["quantization"] = json!(dominant);
    } else {
        model_config["precision"] = json!(dominant);
    }
    let config = canonical(&json!({
        "descriptor": { "name": name, "family": arch },
        "config": model_config,
        "modelfs": { "type": "layers", "diffIds": digests },
    }));
    let config = BlobRef::config(config);
    let layers: Vec<BlobRef> = files
        .iter()
        .zip(digests)
        .map(|(f, digest)| BlobRef {
            digest,
            size: f.size,
            media_type: f.media_type.into(),
            path: Some(f.path.clone()),
            blake3: Some(f.blake3),
            source: BlobSource::File {
                path: dir.join(&f.path),
                offset: 0,
            },
        })
        .collect();
    let manifest = manifest_json(
        &config,
        &layers,
        json!({
            "org.opencontainers.image.title": name,
            "io.gdsllm.format.version": format!("{major}.{minor}"),
        }),
    );
    Ok(Artifact {
        manifest_digest: sha256_digest(&manifest),
        manifest,
        config,
        layers,
    })
}

/// A GGUF file (or, from its first shard, a split GGUF's every shard) as a CNCF ModelPack
/// artifact of other tools' kind, not a GdsLLM package: one raw `weight` layer per file,
/// named by `org.cncf.model.filepath` (its file name), the config's `format` `gguf`. Docker
/// Model Runner, modctl's and gdsrun's pulls ([`crate::foreign`]) read it; nothing is
/// converted. Deterministic (no creation time).
pub fn package_gguf(path: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<Artifact> {
    let shards = gds_convert::gguf::gguf_shards(path)
        .map_err(|e| DistError::invalid(format!("{}: {e}", path.display())))?;
    let mut layers = Vec::with_capacity(shards.len());
    for p in &shards {
        let mut f = gds_io::open_user_file(p).map_err(|e| DistError::io(p, e))?;
        let (digest, _, size) = hash_file(p, &mut f)?;
        progress(size);
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| DistError::usage(format!("{}: not a UTF-8 file name", p.display())))?
            .to_string();
        layers.push(BlobRef {
            digest,
            size,
            media_type: WEIGHT_MEDIA_TYPE.into(),
            path: Some(name),
            blake3: None,
            source: BlobSource::File {
                path: p.clone(),
                offset: 0,
            },
        });
    }
    let file = path.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    let name = match gds_convert::gguf::split_name(file) {
        Some((prefix, _, _)) => prefix.to_string(),
        None => path
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or("model")
            .to_string(),
    };
    let config = canonical(&json!({
        "descriptor": { "name": name },
        "config": { "format": "gguf" },
        "modelfs": { "type": "layers", "diffIds": layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>() },
    }));
    let config = BlobRef::config(config);
    let manifest = manifest_json(
        &config,
        &layers,
        json!({ "org.opencontainers.image.title": name }),
    );
    Ok(Artifact {
        manifest_digest: sha256_digest(&manifest),
        manifest,
        config,
        layers,
    })
}

/// The canonical image manifest of a ModelPack artifact: each layer annotated with its file
/// path (and its BLAKE3 where it has one: a GdsLLM package's layers), the manifest with
/// `annotations`.
fn manifest_json(config: &BlobRef, layers: &[BlobRef], annotations: Value) -> Vec<u8> {
    let layer = |b: &BlobRef| {
        let mut a = json!({
            FILEPATH_ANNOTATION: b.path,
            // what ORAS and CRI-O's artifact volumes name a layer's file by
            TITLE_ANNOTATION: b.path,
        });
        if let Some(h) = b.blake3 {
            a[BLAKE3_ANNOTATION] = json!(hex(&h));
        }
        json!({
            "mediaType": b.media_type,
            "digest": b.digest,
            "size": b.size,
            "annotations": a,
        })
    };
    canonical(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": { "mediaType": config.media_type, "digest": config.digest, "size": config.size },
        "layers": layers.iter().map(layer).collect::<Vec<Value>>(),
        "annotations": annotations,
    }))
}

/// A layer of a parsed image manifest.
#[derive(Clone, Debug)]
pub struct Layer {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Declared size.
    pub size: u64,
    /// Media type (one of ModelPack's raw types).
    pub media_type: String,
    /// Safe relative path.
    pub path: String,
    /// BLAKE3 the package declares (a GdsLLM package always does; another tool's model,
    /// [`crate::foreign`], never).
    pub blake3: Option<[u8; 32]>,
}

/// A parsed, checked image manifest.
#[derive(Clone, Debug)]
pub struct ParsedManifest {
    /// Config digest.
    pub config_digest: String,
    /// Config size.
    pub config_size: u64,
    /// The layers.
    pub layers: Vec<Layer>,
}

/// An image manifest's config digest and declared size (at most [`MAX_CONFIG_BYTES`]) and
/// its layers (at most [`MAX_LAYERS`]): what every manifest a pull reads must have, ours or
/// another tool's ([`crate::foreign`]). `bad` makes the error.
pub(crate) fn config_and_layers<'v>(
    v: &'v Value,
    bad: &dyn Fn(String) -> DistError,
) -> Result<(String, u64, &'v Vec<Value>)> {
    let config = v.get("config").ok_or_else(|| bad("no config".into()))?;
    let config_digest = config
        .get("digest")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("the config has no digest".into()))?
        .to_string();
    digest_hex(&config_digest).map_err(|e| bad(e.msg))?;
    let config_size = config
        .get("size")
        .and_then(Value::as_u64)
        .unwrap_or(u64::MAX);
    if config_size > MAX_CONFIG_BYTES {
        return Err(bad(format!(
            "the config blob {config_digest} declares {config_size} bytes, over the {MAX_CONFIG_BYTES}-byte limit"
        )));
    }
    let layers = v
        .get("layers")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no layers".into()))?;
    if layers.len() > MAX_LAYERS {
        return Err(bad(format!(
            "{} layers, over the limit of {MAX_LAYERS}",
            layers.len()
        )));
    }
    Ok((config_digest, config_size, layers))
}

/// Checks an image manifest from a registry or a layout against every rule a GdsLLM package
/// follows, before anything is downloaded: media types, digests, sizes, counts, and paths
/// (portable, relative, no `..`, unique even ignoring case, no file inside another, regular
/// files only). `what` names the manifest in errors.
pub fn parse_manifest(bytes: &[u8], what: &str) -> Result<ParsedManifest> {
    let bad = |why: String| DistError::invalid(format!("{what}: {why}"));
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "the image manifest is {} bytes, over the {MAX_MANIFEST_BYTES}-byte limit",
            bytes.len()
        )));
    }
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| bad(format!("the image manifest is not JSON: {e}")))?;
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    if s(&v, "mediaType").as_deref() != Some(MANIFEST_MEDIA_TYPE) {
        return Err(bad(format!(
            "mediaType is {:?}, expected {MANIFEST_MEDIA_TYPE}",
            s(&v, "mediaType")
        )));
    }
    let config = v.get("config").ok_or_else(|| bad("no config".into()))?;
    let config_mt = s(config, "mediaType");
    if config_mt.as_deref() != Some(CONFIG_MEDIA_TYPE) {
        return Err(bad(format!(
            "the config's mediaType is {config_mt:?}: not a ModelPack model ({CONFIG_MEDIA_TYPE})"
        )));
    }
    if let Some(at) = s(&v, "artifactType") {
        if at != ARTIFACT_TYPE {
            return Err(bad(format!(
                "artifactType is {at:?}, expected {ARTIFACT_TYPE}"
            )));
        }
    }
    let (config_digest, config_size, layers) = config_and_layers(&v, &bad)?;
    let mut paths = PathSet::default();
    let mut out: Vec<Layer> = Vec::with_capacity(layers.len());
    let mut by_digest: std::collections::HashMap<String, usize> = Default::default();
    for (i, l) in layers.iter().enumerate() {
        let digest = s(l, "digest").ok_or_else(|| bad(format!("layer {i} has no digest")))?;
        digest_hex(&digest).map_err(|e| bad(format!("layer {i}: {}", e.msg)))?;
        let lb = |why: String| bad(format!("layer {i} ({digest}): {why}"));
        let media_type = s(l, "mediaType").unwrap_or_default();
        if ![WEIGHT_MEDIA_TYPE, WEIGHT_CONFIG_MEDIA_TYPE, DOC_MEDIA_TYPE]
            .contains(&media_type.as_str())
        {
            return Err(lb(format!(
                "mediaType {media_type:?} is not one of ModelPack's raw file types (archives are not accepted)"
            )));
        }
        let size = l
            .get("size")
            .and_then(Value::as_u64)
            .ok_or_else(|| lb("no size".into()))?;
        if size > MAX_BLOB_BYTES {
            return Err(lb(format!(
                "declares {size} bytes, over the {MAX_BLOB_BYTES}-byte limit of one blob"
            )));
        }
        let ann = l.get("annotations");
        let a = |k: &str| ann.and_then(|a| a.get(k)).and_then(Value::as_str);
        let path = a(FILEPATH_ANNOTATION)
            .ok_or_else(|| lb(format!("no {FILEPATH_ANNOTATION} annotation")))?;
        check_path(path).map_err(|why| lb(format!("file path {path:?} {why}")))?;
        let mut errs = Vec::new();
        paths.insert(path, &format!("layer {i}"), &mut errs);
        if let Some(e) = errs.first() {
            return Err(lb(e.to_string()));
        }
        // the name ORAS and CRI-O give the file: the same path, or the package is two
        if let Some(title) = a(TITLE_ANNOTATION) {
            if title != path {
                return Err(lb(format!(
                    "{TITLE_ANNOTATION} {title:?} is not its {FILEPATH_ANNOTATION} {path:?} (other tools would write the file there)"
                )));
            }
        }
        if let Some(meta) = a(FILE_METADATA_ANNOTATION) {
            let meta: Value = serde_json::from_str(meta)
                .map_err(|e| lb(format!("{FILE_METADATA_ANNOTATION} is not JSON: {e}")))?;
            let flag = meta.get("typeflag");
            let regular = match flag {
                None => true,
                Some(Value::Number(n)) => n.as_u64() == Some(0) || n.as_u64() == Some(48),
                Some(Value::String(s)) => s.is_empty() || s == "0",
                _ => false,
            };
            if !regular {
                return Err(lb(format!(
                    "{path:?} is not a regular file ({FILE_METADATA_ANNOTATION} typeflag {}): links and devices are refused",
                    flag.map(|f| f.to_string()).unwrap_or_default()
                )));
            }
        }
        let blake3 = a(BLAKE3_ANNOTATION)
            .and_then(parse_blake3)
            .ok_or_else(|| lb(format!("no valid {BLAKE3_ANNOTATION} annotation")))?;
        // layers sharing a blob ship the same bytes: the same size and BLAKE3
        if let Some(o) = by_digest.get(&digest).map(|&j| &out[j]) {
            if o.size != size || o.blake3 != Some(blake3) {
                return Err(lb(format!(
                    "{path:?} shares its blob with {:?} but declares another {}: one of them is not the file its layer says",
                    o.path,
                    if o.size != size {
                        "size".to_string()
                    } else {
                        format!("BLAKE3 ({BLAKE3_ANNOTATION})")
                    }
                )));
            }
        }
        by_digest.entry(digest.clone()).or_insert(out.len());
        out.push(Layer {
            digest,
            size,
            media_type,
            path: path.to_string(),
            blake3: Some(blake3),
        });
    }
    if !out.iter().any(|l| l.path == MANIFEST_FILE) {
        return Err(bad(format!(
            "no layer holds {MANIFEST_FILE}: not a GdsLLM model"
        )));
    }
    Ok(ParsedManifest {
        config_digest,
        config_size,
        layers: out,
    })
}

/// The artifact described by a (checked) image manifest, its blobs found by `locate`.
pub fn artifact_from_manifest(
    manifest: Vec<u8>,
    what: &str,
    locate: &dyn Fn(&str, u64) -> Result<BlobSource>,
) -> Result<Artifact> {
    let p = parse_manifest(&manifest, what)?;
    let config = BlobRef {
        source: locate(&p.config_digest, p.config_size)?,
        digest: p.config_digest,
        size: p.config_size,
        media_type: CONFIG_MEDIA_TYPE.into(),
        path: None,
        blake3: None,
    };
    let layers = p
        .layers
        .into_iter()
        .map(|l| {
            Ok(BlobRef {
                source: locate(&l.digest, l.size)?,
                digest: l.digest,
                size: l.size,
                media_type: l.media_type,
                path: Some(l.path),
                blake3: l.blake3,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Artifact {
        manifest_digest: sha256_digest(&manifest),
        manifest,
        config,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal image manifest: `manifest.gdsm` and the given layers (path, digest byte,
    /// BLAKE3 byte, title).
    fn manifest(layers: &[(&str, u8, u8, Option<&str>)]) -> Vec<u8> {
        let layer = |(path, d, b, title): &(&str, u8, u8, Option<&str>)| {
            let mut ann = json!({
                FILEPATH_ANNOTATION: path,
                BLAKE3_ANNOTATION: hex(&[*b; 32]),
            });
            if let Some(t) = title {
                ann[TITLE_ANNOTATION] = json!(t);
            }
            json!({
                "mediaType": WEIGHT_CONFIG_MEDIA_TYPE,
                "digest": format!("sha256:{}", hex(&[*d; 32])),
                "size": 10,
                "annotations": ann,
            })
        };
        let mut all = vec![(MANIFEST_FILE, 1, 1, Some(MANIFEST_FILE))];
        all.extend_from_slice(layers);
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {
                "mediaType": CONFIG_MEDIA_TYPE,
                "digest": format!("sha256:{}", "0".repeat(64)),
                "size": 2,
            },
            "layers": all.iter().map(layer).collect::<Vec<Value>>(),
        }))
        .unwrap()
    }

    #[test]
    fn layers_sharing_a_blob_must_declare_the_same_blake3() {
        // two files with the same bytes: one blob, one BLAKE3
        let ok = manifest(&[("a.txt", 2, 2, None), ("b.txt", 2, 2, None)]);
        assert_eq!(parse_manifest(&ok, "m").unwrap().layers.len(), 3);
        // b.txt points at a.txt's blob but declares its own file's BLAKE3
        let bad = manifest(&[("a.txt", 2, 2, None), ("b.txt", 2, 3, None)]);
        let e = parse_manifest(&bad, "m").unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(e.msg.contains("b.txt") && e.msg.contains("a.txt"), "{e}");
    }

    #[test]
    fn a_title_must_be_the_file_path() {
        let ok = manifest(&[("docs/a.txt", 2, 2, Some("docs/a.txt"))]);
        parse_manifest(&ok, "m").unwrap();
        // what ORAS or CRI-O would write the file as: not the path GdsLLM checked
        let bad = manifest(&[("docs/a.txt", 2, 2, Some("../../etc/x"))]);
        let e = parse_manifest(&bad, "m").unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(
            e.msg.contains("../../etc/x") && e.msg.contains(TITLE_ANNOTATION),
            "{e}"
        );
    }
}
