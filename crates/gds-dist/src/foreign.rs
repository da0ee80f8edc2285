//! Models other tools publish to OCI registries, pulled and converted on arrival:
//!
//! * **Docker Model Runner** (`docker model push`, Docker Hub's `ai/` namespace): an OCI image
//!   manifest whose config is `application/vnd.docker.ai.model.config.v0.1+json` (or `v0.2`),
//!   GGUF layers `application/vnd.docker.ai.gguf.v3` (a split model's shards in order),
//!   safetensors layers `application/vnd.docker.ai.safetensors`, other files
//!   `application/vnd.docker.ai.model.file`, and the config files of older safetensors
//!   packages in one uncompressed tar (`application/vnd.docker.ai.vllm.config.tar`).
//! * **Ollama's registry** (`registry.ollama.ai/library/NAME:TAG`): a Docker v2 manifest whose
//!   one `application/vnd.ollama.image.model` layer is the GGUF; its parameters layer
//!   (`application/vnd.ollama.image.params`) becomes the model's recommended sampling
//!   ([`ollama_generation_config`]); its Go template, system prompt and license layers are
//!   not used (the GGUF carries its own Jinja template).
//! * **CNCF ModelPack** artifacts of other tools (modctl, KitOps, AIKit): one raw layer per
//!   file (`application/vnd.cncf.model.weight.v1.raw`, `…weight.config.v1.raw`, `…doc.v1.raw`),
//!   each named by `org.cncf.model.filepath`: a GGUF (or its shards) or a Hugging Face
//!   directory (config.json, tokenizer files, safetensors).
//!
//! [`parse_foreign`] reads such a manifest before anything is downloaded: which layers are
//! the model's files and under which names, what is left out (licenses, documents, a
//! vision projector), and what cannot be run (LoRA adapters, archives, diffusion models),
//! refused by name. Every layer is a raw file whose sha256 is its digest, so each blob is
//! checked as it downloads; the files are then converted as `gdsconv convert` converts them.

use crate::error::{DistError, Result};
use crate::package::{digest_hex, Layer};
use crate::*;
use gds_format::validate::{check_path, PathSet};
use serde_json::Value;
use std::path::Path;

/// The Docker registry's image manifest (Ollama's manifests are of this type).
pub const DOCKER_MANIFEST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// What a pull asks a registry for: an OCI image manifest, or a Docker v2 one.
pub const ACCEPT_MANIFESTS: &str =
    "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";
const DMR_CONFIG: [&str; 2] = [
    "application/vnd.docker.ai.model.config.v0.1+json",
    "application/vnd.docker.ai.model.config.v0.2+json",
];
const OLLAMA_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// The largest blob of another tool's model: one GGUF file can hold a whole model.
pub const MAX_FOREIGN_BLOB_BYTES: u64 = 1 << 40;
/// The largest Ollama parameters layer taken (Ollama's library's are a few hundred bytes).
pub const MAX_PARAMS_BYTES: u64 = 64 << 10;

/// The tool whose format a manifest is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Docker Model Runner.
    DockerModel,
    /// Ollama's registry.
    Ollama,
    /// A CNCF ModelPack artifact without a GdsLLM model in it.
    ModelPack,
}

impl Origin {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Origin::DockerModel => "a Docker Model Runner model",
            Origin::Ollama => "an Ollama model",
            Origin::ModelPack => "a ModelPack model",
        }
    }
}

/// What a layer of another tool's model is to the conversion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A GGUF file or one shard of a split GGUF.
    Gguf,
    /// Any other file of a Hugging Face directory (safetensors, config.json, tokenizer…).
    File,
    /// An uncompressed tar of a directory's config files (Docker Model Runner's older
    /// safetensors packages), unpacked into the directory.
    ConfigTar,
    /// Ollama's parameters (a JSON object: `temperature`, `stop`, `num_predict`, ...),
    /// translated into the output's `generation_config.json` ([`ollama_generation_config`]).
    Params,
    /// Docker Model Runner's Jinja chat template (`docker model package --chat-template`),
    /// which its runtime uses in place of the model's: the converted model's template.
    ChatTemplate,
}

/// One layer the conversion needs, under the name it takes in the source directory.
#[derive(Clone, Debug)]
pub struct ForeignFile {
    /// The blob, its name (`path`) in the assembled source directory.
    pub layer: Layer,
    /// What it is.
    pub role: Role,
}

/// Another tool's model, as its manifest describes it.
#[derive(Clone, Debug)]
pub struct ForeignModel {
    /// Whose format.
    pub origin: Origin,
    /// The config blob.
    pub config_digest: String,
    /// Its declared size.
    pub config_size: u64,
    /// The layers the conversion reads, in the manifest's order.
    pub files: Vec<ForeignFile>,
    /// What the conversion leaves out, one line each (a license, a projector, a template).
    pub skipped: Vec<String>,
}

impl ForeignModel {
    /// What to convert, relative to the assembled source directory: the (first) GGUF, or
    /// the directory itself (`""`) for a Hugging Face checkpoint.
    pub fn entry(&self) -> &str {
        self.files
            .iter()
            .find(|f| f.role == Role::Gguf)
            .map_or("", |f| f.layer.path.as_str())
    }

    /// Bytes of all the blobs (each once).
    pub fn total_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.files
            .iter()
            .filter(|f| seen.insert(&f.layer.digest))
            .map(|f| f.layer.size)
            .sum()
    }
}

/// True when the image manifest `v` is a GdsLLM package (a layer holds `manifest.gdsm`):
/// such a manifest is checked by [`crate::package::parse_manifest`]'s every rule, never
/// read as another tool's.
pub fn is_gdsllm_package(v: &Value) -> bool {
    v.get("layers").and_then(Value::as_array).is_some_and(|ls| {
        ls.iter().any(|l| {
            l.pointer(&format!(
                "/annotations/{}",
                FILEPATH_ANNOTATION.replace('/', "~1")
            ))
            .and_then(Value::as_str)
                == Some(gds_format::MANIFEST_FILE)
        })
    })
}

/// How a layer's media type is taken.
enum Kind {
    Gguf,
    Safetensors,
    /// A file of the model directory, named by its annotation (or by its extension).
    Weight,
    /// A side file (config, tokenizer) named by its annotation.
    Side,
    ConfigTar,
    Params,
    ChatTemplate,
    /// Left out, with why.
    Skip(&'static str),
    /// Refused, with why.
    Refuse(&'static str),
}

fn kind_of(origin: Origin, mt: &str) -> Kind {
    // ModelPack's types, and their names before the spec's 2025 rename (`vnd.cnai`)
    let cncf = mt
        .strip_prefix("application/vnd.cncf.model.")
        .or_else(|| mt.strip_prefix("application/vnd.cnai.model."));
    if let Some(rest) = cncf {
        return match rest {
            "weight.v1.raw" => Kind::Weight,
            "weight.v1.gguf" => Kind::Gguf,
            "weight.v1.safetensors" => Kind::Safetensors,
            "weight.config.v1.raw" => Kind::Side,
            "doc.v1.raw" => Kind::Skip("a document"),
            "code.v1.raw" => Kind::Skip("code"),
            "dataset.v1.raw" => Kind::Skip("a dataset"),
            r if r.ends_with(".tar") || r.ends_with(".tar+gzip") || r.ends_with(".tar+zstd") => {
                Kind::Refuse("an archived layer (this pull reads raw layers, one file each: modctl build --raw makes them)")
            }
            _ => Kind::Refuse("a layer type this pull does not know"),
        };
    }
    match (origin, mt) {
        (_, "application/vnd.docker.ai.gguf.v3") => Kind::Gguf,
        (_, "application/vnd.docker.ai.safetensors") => Kind::Safetensors,
        (_, "application/vnd.docker.ai.model.file") => Kind::Side,
        (_, "application/vnd.docker.ai.vllm.config.tar") => Kind::ConfigTar,
        (_, "application/vnd.docker.ai.license") => Kind::Skip("a license"),
        (_, "application/vnd.docker.ai.mmproj" | "application/vnd.docker.ai.gguf.v3.mmproj") => {
            Kind::Skip("a multimodal projector, images are not supported")
        }
        (_, "application/vnd.docker.ai.chat.template.jinja") => Kind::ChatTemplate,
        (_, "application/vnd.docker.ai.dduf") => Kind::Refuse("a diffusion model (DDUF)"),
        (_, "application/vnd.docker.ai.dir.tar") => {
            Kind::Refuse("a directory archive (application/vnd.docker.ai.dir.tar)")
        }
        (_, "application/vnd.docker.ai.gguf.v3.lora") => Kind::Refuse("a LoRA adapter"),
        (Origin::Ollama, "application/vnd.ollama.image.model") => Kind::Gguf,
        (
            Origin::Ollama,
            "application/vnd.ollama.image.template" | "application/vnd.ollama.image.prompt",
        ) => Kind::Skip("a Go template, the GGUF's own Jinja template is used"),
        (Origin::Ollama, "application/vnd.ollama.image.system") => Kind::Skip("a system prompt"),
        (Origin::Ollama, "application/vnd.ollama.image.params") => Kind::Params,
        (Origin::Ollama, "application/vnd.ollama.image.messages") => Kind::Skip("example messages"),
        (Origin::Ollama, "application/vnd.ollama.image.license") => Kind::Skip("a license"),
        (Origin::Ollama, "application/vnd.ollama.image.embed") => Kind::Skip("a deprecated layer"),
        (Origin::Ollama, "application/vnd.ollama.image.projector") => {
            Kind::Skip("a multimodal projector, images are not supported")
        }
        (Origin::Ollama, "application/vnd.ollama.image.draft") => Kind::Skip("a draft model"),
        (Origin::Ollama, "application/vnd.ollama.image.adapter") => Kind::Refuse("a LoRA adapter"),
        _ => Kind::Refuse("a layer type this pull does not know"),
    }
}

/// Reads another tool's image manifest (`bytes`, already capped) and says what its model
/// is, or why it cannot be run, before anything is downloaded. `what` names the manifest
/// in errors.
pub fn parse_foreign(bytes: &[u8], what: &str) -> Result<ForeignModel> {
    let bad = |why: String| DistError::invalid(format!("{what}: {why}"));
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| bad(format!("the image manifest is not JSON: {e}")))?;
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    let mt = s(&v, "mediaType");
    if !matches!(
        mt.as_deref(),
        Some(MANIFEST_MEDIA_TYPE | DOCKER_MANIFEST_MEDIA_TYPE)
    ) {
        return Err(bad(format!(
            "mediaType is {mt:?}: not an image manifest ({MANIFEST_MEDIA_TYPE} or {DOCKER_MANIFEST_MEDIA_TYPE}; an index of several platforms is not a model)"
        )));
    }
    let config = v.get("config").ok_or_else(|| bad("no config".into()))?;
    let config_mt = s(config, "mediaType").unwrap_or_default();
    let origin = if DMR_CONFIG.contains(&config_mt.as_str()) {
        Origin::DockerModel
    } else if config_mt == OLLAMA_CONFIG {
        Origin::Ollama
    } else if config_mt == CONFIG_MEDIA_TYPE
        || config_mt == "application/vnd.cnai.model.config.v1+json"
    {
        Origin::ModelPack
    } else {
        return Err(bad(format!(
            "the config's mediaType is {config_mt:?}: not a model this pull knows (a GdsLLM package, a ModelPack, Docker Model Runner or Ollama model)"
        )));
    };
    let (config_digest, config_size, layers) = crate::package::config_and_layers(&v, &bad)?;
    let what_is = origin.name();
    let mut files: Vec<ForeignFile> = Vec::new();
    let mut skipped = Vec::new();
    let mut ggufs = Vec::new();
    let mut unnamed = Vec::new();
    let mut gguf_names: Vec<Option<String>> = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let digest = s(l, "digest").ok_or_else(|| bad(format!("layer {i} has no digest")))?;
        digest_hex(&digest).map_err(|e| bad(format!("layer {i}: {}", e.msg)))?;
        let lb = |why: String| bad(format!("layer {i} ({digest}): {why}"));
        let media_type = s(l, "mediaType").unwrap_or_default();
        let size = l
            .get("size")
            .and_then(Value::as_u64)
            .ok_or_else(|| lb("no size".into()))?;
        if size > MAX_FOREIGN_BLOB_BYTES {
            return Err(lb(format!(
                "declares {size} bytes, over the {MAX_FOREIGN_BLOB_BYTES}-byte limit of one blob"
            )));
        }
        let ann = |k: &str| {
            l.get("annotations")
                .and_then(|a| a.get(k))
                .and_then(Value::as_str)
        };
        let named = ann(FILEPATH_ANNOTATION)
            .or_else(|| ann("org.cnai.model.filepath"))
            .or_else(|| ann(TITLE_ANNOTATION));
        let layer = |path: String| Layer {
            digest: digest.clone(),
            size,
            media_type: media_type.clone(),
            path,
            blake3: None,
        };
        let mut kind = kind_of(origin, &media_type);
        if let Kind::Weight = kind {
            // a ModelPack weight file is what its name says it is
            kind = match named.map(str::to_ascii_lowercase) {
                Some(n) if n.rsplit('/').next().is_some_and(|b| b.starts_with("mmproj")) => {
                    Kind::Skip("a multimodal projector, images are not supported")
                }
                Some(n) if n.ends_with(".gguf") => Kind::Gguf,
                Some(_) => Kind::Side,
                None => return Err(lb(format!("a weight layer without a {FILEPATH_ANNOTATION} annotation: its file is unknown"))),
            };
        }
        match kind {
            Kind::Refuse(why) => {
                return Err(lb(format!(
                    "{media_type:?} is {why}: {what_is} with it cannot be run here"
                )))
            }
            Kind::Skip(why) => {
                skipped.push(format!("{why} ({})", named.unwrap_or(media_type.as_str())))
            }
            Kind::Gguf => {
                // named by its order below
                ggufs.push(files.len());
                gguf_names.push(named.map(str::to_string));
                files.push(ForeignFile {
                    layer: layer(String::new()),
                    role: Role::Gguf,
                });
            }
            Kind::ConfigTar => files.push(ForeignFile {
                layer: layer(format!(".config-{i}.tar")),
                role: Role::ConfigTar,
            }),
            // a few hundred bytes in Ollama's library; a larger one is no parameters file
            Kind::Params if size > MAX_PARAMS_BYTES => skipped.push(format!(
                "sampling parameters of {size} bytes, over the {MAX_PARAMS_BYTES}-byte limit"
            )),
            Kind::Params => files.push(ForeignFile {
                layer: layer(format!(".params-{i}.json")),
                role: Role::Params,
            }),
            Kind::ChatTemplate if size > gds_format::chat_template::MAX_SOURCE_BYTES as u64 => {
                return Err(lb(format!(
                    "a chat template of {size} bytes, over the {}-byte limit of a template",
                    gds_format::chat_template::MAX_SOURCE_BYTES
                )))
            }
            Kind::ChatTemplate => files.push(ForeignFile {
                layer: layer(format!(".template-{i}.jinja")),
                role: Role::ChatTemplate,
            }),
            Kind::Safetensors | Kind::Side | Kind::Weight => {
                let path = match named {
                    Some(n) => n.to_string(),
                    // Docker Model Runner's first packages named no file: the names its
                    // own unpacking gives them (several shards renamed below)
                    None if matches!(kind, Kind::Safetensors) => {
                        unnamed.push(files.len());
                        "model.safetensors".to_string()
                    }
                    None => {
                        return Err(lb(format!(
                            "a file layer without a {FILEPATH_ANNOTATION} annotation: its name is unknown"
                        )))
                    }
                };
                files.push(ForeignFile {
                    layer: layer(path),
                    role: Role::File,
                });
            }
        }
    }
    // GGUF files by their order: one is `model.gguf`, several the shards of one split model
    // (the converter checks each shard's split.no against its place) — where every layer
    // names its file, names of one split's shards (several quantizations of a model in
    // one artifact are not one model)
    let n = ggufs.len();
    if n > 1 {
        let named: Vec<&str> = gguf_names.iter().flatten().map(String::as_str).collect();
        if named.len() == n && !one_split(&named) {
            return Err(bad(format!(
                "{what_is} with {n} GGUF files that are not the shards of one split model ({}): which one is the model is ambiguous",
                named.join(", ")
            )));
        }
    }
    for (k, &j) in ggufs.iter().enumerate() {
        files[j].layer.path = if n == 1 {
            "model.gguf".to_string()
        } else {
            gds_convert::gguf::shard_file_name("model", k as u64 + 1, n as u64, ".gguf")
        };
    }
    // unnamed safetensors shards likewise
    if unnamed.len() > 1 {
        let n = unnamed.len();
        for (k, &j) in unnamed.iter().enumerate() {
            files[j].layer.path = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        }
    }
    let has_safetensors = files
        .iter()
        .any(|f| f.role == Role::File && f.layer.path.ends_with(".safetensors"));
    if n == 0 && !has_safetensors {
        return Err(bad(format!(
            "{what_is} without weights this pull can convert (no GGUF, no safetensors)"
        )));
    }
    if n > 0 && has_safetensors {
        return Err(bad(format!(
            "{what_is} with both GGUF and safetensors weights: which one is the model is ambiguous"
        )));
    }
    if n > 0 {
        // a GGUF is the whole model: the side files are not read (Ollama's parameters are
        // no file of the model)
        let kept =
            |f: &ForeignFile| matches!(f.role, Role::Gguf | Role::Params | Role::ChatTemplate);
        for f in files.iter().filter(|f| !kept(f)) {
            skipped.push(format!("a file beside the GGUF ({})", f.layer.path));
        }
        files.retain(kept);
    }
    let mut paths = PathSet::default();
    for f in &files {
        // (not linked into the directory under a name)
        if matches!(f.role, Role::ConfigTar | Role::Params | Role::ChatTemplate) {
            continue;
        }
        let p = &f.layer.path;
        check_path(p).map_err(|why| {
            bad(format!(
                "layer {} names the file {p:?}, which {why}",
                f.layer.digest
            ))
        })?;
        let mut errs = Vec::new();
        paths.insert(p, &format!("layer {}", f.layer.digest), &mut errs);
        if let Some(e) = errs.first() {
            return Err(bad(e.to_string()));
        }
    }
    Ok(ForeignModel {
        origin,
        config_digest,
        config_size,
        files,
        skipped,
    })
}

/// Ollama's parameters (the JSON object of an `application/vnd.ollama.image.params` layer,
/// what a Modelfile's `PARAMETER` lines become) as a `generation_config.json`: the sampling
/// settings gdsrun takes as the model's recommendation ([`gds_runtime`]'s `recommended`
/// module reads them) — `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`
/// (`repetition_penalty`), `repeat_last_n` (`penalty_last_n`), `mirostat`, `mirostat_tau`,
/// `mirostat_eta`, `num_predict` (`max_new_tokens`, when above 0) and `stop`
/// (`stop_strings`) — and one line per parameter left out (`num_ctx 8192`: the context is
/// `--ctx`'s; the runner's own settings such as `num_gpu`). `None` when nothing is taken;
/// an error only for bytes that are not a JSON object. Values are copied as Ollama wrote
/// them; the runtime checks each as it checks a checkpoint's.
pub fn ollama_generation_config(
    bytes: &[u8],
) -> std::result::Result<(Option<String>, Vec<String>), String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let Value::Object(o) = v else {
        return Err("not a JSON object".into());
    };
    const TAKEN: &[(&str, &str)] = &[
        ("temperature", "temperature"),
        ("top_k", "top_k"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
        ("repeat_penalty", "repetition_penalty"),
        ("repeat_last_n", "penalty_last_n"),
        ("mirostat", "mirostat"),
        ("mirostat_tau", "mirostat_tau"),
        ("mirostat_eta", "mirostat_eta"),
        ("stop", "stop_strings"),
    ];
    let mut out = serde_json::Map::new();
    let mut left = Vec::new();
    for (k, v) in &o {
        if let Some((_, to)) = TAKEN.iter().find(|(from, _)| from == k) {
            out.insert(to.to_string(), v.clone());
        } else if k == "num_predict" {
            // -1 (or -2): no limit
            if v.as_i64().is_some_and(|n| n > 0) {
                out.insert("max_new_tokens".into(), v.clone());
            }
        } else {
            let mut shown = v.to_string();
            if shown.chars().count() > 80 {
                shown = format!("{}…", shown.chars().take(80).collect::<String>());
            }
            left.push(format!("{k} {shown}"));
        }
    }
    let text = (!out.is_empty()).then(|| Value::Object(out).to_string());
    Ok((text, left))
}

/// Ollama's parameters layer stored at `blob` as a `generation_config.json`
/// ([`ollama_generation_config`]), saying on stderr what it takes and what it leaves out;
/// `what` names the model (`quiet`: nothing said). Parameters that are not a JSON object are
/// left out, said so.
pub fn params_blob(blob: &Path, what: &str, quiet: bool) -> Result<Option<String>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    gds_io::open_user_file(blob)
        .and_then(|f| f.take(MAX_PARAMS_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| DistError::io(blob, e))?;
    match ollama_generation_config(&bytes) {
        Ok((g, left)) => {
            if let (Some(g), false) = (&g, quiet) {
                eprintln!("{what}: Ollama's parameters are the model's recommended sampling: {g}");
            }
            if !left.is_empty() && !quiet {
                eprintln!("{what}: Ollama's parameters left out: {}", left.join(", "));
            }
            Ok(g)
        }
        Err(why) => {
            if !quiet {
                eprintln!("{what}: Ollama's parameters left out: {why}");
            }
            Ok(None)
        }
    }
}

/// Whether `names` (each a path) are the shards of one split GGUF, in order:
/// `PREFIX-00001-of-0000N.gguf` … `PREFIX-0000N-of-0000N.gguf`, N the number of names.
fn one_split(names: &[&str]) -> bool {
    let n = names.len() as u64;
    let Some((prefix, _, _)) = gds_convert::gguf::split_name(names[0]) else {
        return false;
    };
    names
        .iter()
        .zip(1..)
        .all(|(name, k)| *name == gds_convert::gguf::shard_file_name(prefix, k, n, ".gguf"))
}

/// Checks another tool's config blob where it says what the model is: Docker Model Runner's
/// `config.format` and Ollama's `model_format` must name a format this pull converts.
pub fn check_config(m: &ForeignModel, config: &[u8], what: &str) -> Result<()> {
    let v: Value = serde_json::from_slice(config).map_err(|e| {
        DistError::invalid(format!(
            "{what}: config blob {} is not JSON: {e}",
            m.config_digest
        ))
    })?;
    let format = match m.origin {
        Origin::DockerModel => v.pointer("/config/format"),
        Origin::Ollama => v.get("model_format"),
        Origin::ModelPack => v.pointer("/config/format"),
    }
    .and_then(Value::as_str)
    .map(str::to_ascii_lowercase);
    match format.as_deref() {
        None | Some("" | "gguf" | "safetensors") => Ok(()),
        Some(f) => Err(DistError::invalid(format!(
            "{what}: {} whose config says its format is {f:?}: only GGUF and safetensors models convert",
            m.origin.name()
        ))),
    }
}

/// Unpacks Docker Model Runner's config tar (`tar_path`) into `dir`: regular files at safe
/// relative paths only, each at most [`MAX_CONFIG_FILE_BYTES`], none over a file already
/// there.
pub fn unpack_config_tar(
    tar_path: &std::path::Path,
    dir: &std::path::Path,
    what: &str,
) -> Result<()> {
    let bad = |why: String| DistError::invalid(format!("{what}: its config archive: {why}"));
    let f = std::fs::File::open(tar_path).map_err(|e| DistError::io(tar_path, e))?;
    let mut a = tar::Archive::new(f);
    let entries = a.entries().map_err(|e| bad(e.to_string()))?;
    for (n, e) in entries.enumerate() {
        if n >= MAX_LAYERS {
            return Err(bad(format!("more than {MAX_LAYERS} entries")));
        }
        let mut e = e.map_err(|e| bad(e.to_string()))?;
        let path = e
            .path()
            .map_err(|e| bad(e.to_string()))?
            .to_string_lossy()
            .into_owned();
        let kind = e.header().entry_type();
        if kind.is_dir() {
            continue;
        }
        if !kind.is_file() {
            return Err(bad(format!("{path:?} is not a regular file")));
        }
        check_path(&path).map_err(|why| bad(format!("{path:?} {why}")))?;
        let size = e.header().size().map_err(|e| bad(e.to_string()))?;
        if size > MAX_CONFIG_FILE_BYTES {
            return Err(bad(format!(
                "{path:?} is {size} bytes, over the {MAX_CONFIG_FILE_BYTES}-byte limit of a config file"
            )));
        }
        let out = dir.join(&path);
        if out.exists() {
            return Err(bad(format!("{path:?} is also a layer of its own")));
        }
        if let Some(p) = out.parent() {
            std::fs::create_dir_all(p).map_err(|e| DistError::io(p, e))?;
        }
        let mut w = std::fs::File::create(&out).map_err(|e| DistError::io(&out, e))?;
        std::io::copy(&mut (&mut e).take(size), &mut w).map_err(|e| DistError::io(&out, e))?;
    }
    Ok(())
}

/// The largest file a config archive may hold (a tokenizer.json of a large vocabulary fits).
pub const MAX_CONFIG_FILE_BYTES: u64 = 256 << 20;

use std::io::Read as _;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const D: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

    fn digest(i: usize) -> String {
        format!("sha256:{i:064x}")
    }

    fn manifest(mt: &str, config_mt: &str, layers: Vec<Value>) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": mt,
            "config": {"mediaType": config_mt, "digest": D, "size": 100},
            "layers": layers,
        }))
        .unwrap()
    }

    fn layer(i: usize, mt: &str, path: Option<&str>) -> Value {
        let mut l = json!({"mediaType": mt, "digest": digest(i), "size": 1000 + i});
        if let Some(p) = path {
            l["annotations"] = json!({ FILEPATH_ANNOTATION: p });
        }
        l
    }

    fn dmr(layers: Vec<Value>) -> Result<ForeignModel> {
        parse_foreign(&manifest(MANIFEST_MEDIA_TYPE, DMR_CONFIG[0], layers), "m")
    }

    fn paths(m: &ForeignModel) -> Vec<&str> {
        m.files.iter().map(|f| f.layer.path.as_str()).collect()
    }

    /// Docker Model Runner's chat template layer is the converted model's template (its
    /// runtime uses it in place of the GGUF's); one over a template's size limit is refused.
    #[test]
    fn a_docker_model_runner_template_layer_is_kept() {
        let gguf = "application/vnd.docker.ai.gguf.v3";
        let jinja = "application/vnd.docker.ai.chat.template.jinja";
        let m = dmr(vec![layer(1, gguf, None), layer(2, jinja, None)]).unwrap();
        assert_eq!(paths(&m), ["model.gguf", ".template-1.jinja"]);
        assert_eq!(
            (m.entry(), m.files[1].role),
            ("model.gguf", Role::ChatTemplate)
        );
        assert!(m.skipped.is_empty(), "{:?}", m.skipped);
        let mut big = layer(2, jinja, None);
        big["size"] = json!(2 << 20);
        let e = dmr(vec![layer(1, gguf, None), big]).unwrap_err().msg;
        assert!(
            e.contains("over the 1048576-byte limit of a template"),
            "{e}"
        );
    }

    #[test]
    fn ggufs_are_named_by_their_order_and_side_files_left_out() {
        let gguf = "application/vnd.docker.ai.gguf.v3";
        let m = dmr(vec![
            layer(1, gguf, Some("whatever-1.gguf")),
            layer(2, "application/vnd.docker.ai.license", None),
            layer(3, gguf, None),
            layer(4, "application/vnd.docker.ai.mmproj", None),
        ])
        .unwrap();
        assert_eq!(m.origin, Origin::DockerModel);
        assert_eq!(
            paths(&m),
            ["model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]
        );
        assert_eq!(m.entry(), "model-00001-of-00002.gguf");
        assert_eq!(m.total_bytes(), 1001 + 1003);
        assert_eq!(m.skipped.len(), 2, "{:?}", m.skipped);
        // several quantizations in one artifact are refused, named shards in order taken
        let e = dmr(vec![
            layer(1, gguf, Some("m-Q4_K_M.gguf")),
            layer(2, gguf, Some("m-Q8_0.gguf")),
        ])
        .expect_err("two quantizations")
        .to_string();
        assert!(
            e.contains("m-Q4_K_M.gguf, m-Q8_0.gguf") && e.contains("ambiguous"),
            "{e}"
        );
        let m = dmr(vec![
            layer(1, gguf, Some("big-00001-of-00002.gguf")),
            layer(2, gguf, Some("big-00002-of-00002.gguf")),
        ])
        .unwrap();
        assert_eq!(m.entry(), "model-00001-of-00002.gguf");
        assert!(dmr(vec![
            layer(1, gguf, Some("big-00002-of-00002.gguf")),
            layer(2, gguf, Some("big-00001-of-00002.gguf")),
        ])
        .is_err());
        let one = dmr(vec![layer(1, gguf, None)]).unwrap();
        assert_eq!(paths(&one), ["model.gguf"]);
        assert!(one.files.iter().all(|f| f.layer.blake3.is_none()));
    }

    #[test]
    fn a_hugging_face_directory_keeps_its_paths() {
        let cfg = "application/vnd.cncf.model.weight.config.v1.raw";
        let w = "application/vnd.cncf.model.weight.v1.raw";
        let m = parse_foreign(
            &manifest(
                MANIFEST_MEDIA_TYPE,
                CONFIG_MEDIA_TYPE,
                vec![
                    layer(1, cfg, Some("config.json")),
                    layer(2, cfg, Some("tokenizer.json")),
                    layer(3, w, Some("model-00001-of-00002.safetensors")),
                    layer(4, w, Some("model-00002-of-00002.safetensors")),
                    layer(
                        5,
                        "application/vnd.cncf.model.doc.v1.raw",
                        Some("README.md"),
                    ),
                    layer(6, w, Some("mmproj-f16.gguf")),
                ],
            ),
            "m",
        )
        .unwrap();
        assert_eq!(m.origin, Origin::ModelPack);
        assert_eq!(
            paths(&m),
            [
                "config.json",
                "tokenizer.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        assert_eq!(m.entry(), "");
        assert_eq!(m.skipped.len(), 2, "{:?}", m.skipped);
        // Docker Model Runner's unannotated safetensors: its own unpacking's names
        let st = "application/vnd.docker.ai.safetensors";
        let m = dmr(vec![
            layer(1, st, None),
            layer(2, st, None),
            layer(3, "application/vnd.docker.ai.vllm.config.tar", None),
        ])
        .unwrap();
        assert_eq!(
            paths(&m),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                ".config-2.tar"
            ]
        );
        assert_eq!(m.files[2].role, Role::ConfigTar);
    }

    #[test]
    fn an_ollama_model_is_its_gguf() {
        let ol = |k: &str| format!("application/vnd.ollama.image.{k}");
        let m = parse_foreign(
            &manifest(
                DOCKER_MANIFEST_MEDIA_TYPE,
                OLLAMA_CONFIG,
                vec![
                    layer(1, &ol("model"), None),
                    layer(2, &ol("template"), None),
                    layer(3, &ol("params"), None),
                    layer(4, &ol("license"), None),
                    layer(5, &ol("system"), None),
                ],
            ),
            "m",
        )
        .unwrap();
        // the parameters are read apart (the model's recommended sampling), not a file
        assert_eq!(
            (m.origin, paths(&m)),
            (Origin::Ollama, vec!["model.gguf", ".params-2.json"])
        );
        assert_eq!((m.entry(), m.files[1].role), ("model.gguf", Role::Params));
        assert_eq!(m.skipped.len(), 3);
    }

    /// Ollama's parameters as a generation_config.json: its sampling settings under
    /// transformers' and llama.cpp's names, `num_predict` only above 0, the rest named.
    #[test]
    fn ollamas_parameters_become_the_recommended_sampling() {
        let (g, left) = ollama_generation_config(
            br#"{"stop": ["<|start_header_id|>", "<|eot_id|>"], "temperature": 0.6,
                 "top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": -1, "num_ctx": 8192,
                 "num_predict": 128, "num_gpu": 99}"#,
        )
        .unwrap();
        let g: Value = serde_json::from_str(&g.unwrap()).unwrap();
        assert_eq!(
            g,
            serde_json::json!({"stop_strings": ["<|start_header_id|>", "<|eot_id|>"],
                "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1,
                "penalty_last_n": -1, "max_new_tokens": 128})
        );
        assert_eq!(left, ["num_ctx 8192", "num_gpu 99"]);
        let (g, left) = ollama_generation_config(br#"{"num_predict": -1}"#).unwrap();
        assert_eq!((g, left.len()), (None, 0));
        assert!(ollama_generation_config(b"[1]").is_err());
        assert!(ollama_generation_config(b"PARAMETER temperature 1").is_err());
    }

    /// Each refusal names what is wrong.
    #[test]
    fn what_cannot_be_run_is_refused_by_name() {
        let gguf = "application/vnd.docker.ai.gguf.v3";
        let st = "application/vnd.docker.ai.safetensors";
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                manifest(INDEX_MEDIA_TYPE, DMR_CONFIG[0], vec![layer(1, gguf, None)]),
                "an index of several platforms",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    "application/vnd.oci.image.config.v1+json",
                    vec![],
                ),
                "not a model this pull knows",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    DMR_CONFIG[1],
                    vec![layer(1, "application/vnd.docker.ai.license", None)],
                ),
                "without weights",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    DMR_CONFIG[1],
                    vec![
                        layer(1, gguf, None),
                        layer(2, st, Some("model.safetensors")),
                    ],
                ),
                "ambiguous",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    DMR_CONFIG[1],
                    vec![layer(1, st, Some("../escape.safetensors"))],
                ),
                "../escape.safetensors",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    DMR_CONFIG[1],
                    vec![layer(1, st, Some("/etc/x.safetensors"))],
                ),
                "/etc/x.safetensors",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    DMR_CONFIG[1],
                    vec![
                        layer(1, st, Some("a.safetensors")),
                        layer(2, st, Some("A.safetensors")),
                    ],
                ),
                "A.safetensors",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    CONFIG_MEDIA_TYPE,
                    vec![layer(
                        1,
                        "application/vnd.cncf.model.weight.v1.tar+zstd",
                        Some("m.safetensors"),
                    )],
                ),
                "archived layer",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    CONFIG_MEDIA_TYPE,
                    vec![layer(1, "application/vnd.cncf.model.weight.v1.raw", None)],
                ),
                "without a org.cncf.model.filepath",
            ),
            (
                manifest(
                    MANIFEST_MEDIA_TYPE,
                    DMR_CONFIG[0],
                    vec![layer(1, "application/vnd.docker.ai.dduf", None)],
                ),
                "diffusion model",
            ),
            (
                manifest(
                    DOCKER_MANIFEST_MEDIA_TYPE,
                    OLLAMA_CONFIG,
                    vec![
                        layer(1, "application/vnd.ollama.image.model", None),
                        layer(2, "application/vnd.ollama.image.adapter", None),
                    ],
                ),
                "LoRA adapter",
            ),
        ];
        for (bytes, want) in cases {
            let e = parse_foreign(&bytes, "ref").expect_err(want).to_string();
            assert!(e.starts_with("ref: ") && e.contains(want), "{want}: {e}");
        }
        let mut big = layer(1, gguf, None);
        big["size"] = json!(MAX_FOREIGN_BLOB_BYTES + 1);
        let e = dmr(vec![big]).expect_err("too big").to_string();
        assert!(e.contains("limit of one blob"), "{e}");
    }

    #[test]
    fn our_packages_are_told_apart_and_formats_checked() {
        let ours = json!({"layers": [{"annotations": {FILEPATH_ANNOTATION: "manifest.gdsm"}}]});
        assert!(is_gdsllm_package(&ours));
        assert!(!is_gdsllm_package(
            &json!({"layers": [{"annotations": {FILEPATH_ANNOTATION: "model.gguf"}}]})
        ));
        assert!(!is_gdsllm_package(&json!({"layers": "x"})));
        let m = dmr(vec![layer(1, "application/vnd.docker.ai.gguf.v3", None)]).unwrap();
        assert!(check_config(&m, br#"{"config":{"format":"gguf"}}"#, "m").is_ok());
        assert!(check_config(&m, br#"{"config":{}}"#, "m").is_ok());
        let e = check_config(&m, br#"{"config":{"format":"diffusers"}}"#, "m").unwrap_err();
        assert!(e.to_string().contains("\"diffusers\""), "{e}");
        assert!(check_config(&m, b"not json", "m").is_err());
    }

    /// Docker Model Runner's config tar: regular files unpacked; a link, a path out of the
    /// directory, a file that is also a layer, a file over the limit refused by name.
    #[test]
    fn config_tars_unpack_only_plain_files() {
        let t = tempfile::tempdir().unwrap();
        let tar_of = |entries: &[(&str, tar::EntryType, &[u8])]| {
            let mut b = tar::Builder::new(Vec::new());
            for (name, kind, data) in entries {
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(*kind);
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                // set_path refuses `..`: the raw name field, as a hostile archive has it
                let field = &mut h.as_old_mut().name;
                field[..name.len()].copy_from_slice(name.as_bytes());
                h.set_cksum();
                b.append(&h, *data).unwrap();
            }
            let p = t
                .path()
                .join(format!("{}.tar", entries.len() + entries[0].0.len()));
            std::fs::write(&p, b.into_inner().unwrap()).unwrap();
            p
        };
        let dir = t.path().join("ok");
        std::fs::create_dir(&dir).unwrap();
        let good = tar_of(&[
            ("config.json", tar::EntryType::Regular, b"{}"),
            ("tokenizer.json", tar::EntryType::Regular, b"{\"x\":1}"),
        ]);
        unpack_config_tar(&good, &dir, "m").unwrap();
        assert_eq!(
            std::fs::read(dir.join("tokenizer.json")).unwrap(),
            b"{\"x\":1}"
        );
        let e = unpack_config_tar(&good, &dir, "m").unwrap_err().to_string();
        assert!(e.contains("also a layer"), "{e}");
        for (entries, want) in [
            (
                vec![("link.json", tar::EntryType::Symlink, &b""[..])],
                "not a regular file",
            ),
            (
                vec![("../up.json", tar::EntryType::Regular, &b"{}"[..])],
                "../up.json",
            ),
            (
                vec![("/abs.json", tar::EntryType::Regular, &b"{}"[..])],
                "/abs.json",
            ),
        ] {
            let d = t.path().join(format!("d{}", want.len()));
            std::fs::create_dir(&d).unwrap();
            let e = unpack_config_tar(&tar_of(&entries), &d, "m")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{want}: {e}");
            assert!(!t.path().join("up.json").exists());
        }
    }
}
