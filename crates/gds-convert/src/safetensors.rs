//! Reads safetensors checkpoints — one `.safetensors` file, a sharded checkpoint through its
//! `model.safetensors.index.json`, or a Hugging Face model directory — into a [`Source`].
//!
//! What [`read_safetensors`] accepts:
//!
//! * a directory: `model.safetensors.index.json` if present (sharded), else
//!   `model.safetensors`, else every `*.safetensors` file in it (in name order, as shards);
//! * a `*.index.json` file: the shards it lists, which must sit beside it;
//! * a `.safetensors` file.
//!
//! The model directory (the input itself, or the directory holding the input file) may hold
//! `config.json` and the tokenizer files `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json`, which are copied verbatim into [`TokenizerFiles`] (one
//! exception: see "EOS lists" below).
//!
//! **Llama family** (`config.json`'s `architectures[0]` or `model_type` listed in
//! `formats/llama.json`): tensor names are mapped to canonical (GGUF) names, the ignored
//! tensors (`rotary_emb.inv_freq`) are dropped, Q and K projections (weights and biases) get
//! [`Transform::PermuteRope`] because Hugging Face stores them in "rotate half" order,
//! hyperparameters are read from `config.json` into the canonical `model.*` keys, every
//! required tensor must be present, and the result is runnable. Embeddings are tied when
//! `tie_word_embeddings` is true or `lm_head.weight` is absent; a `lm_head.weight` next to
//! `tie_word_embeddings: true` is dropped with a warning (Hugging Face ignores it too).
//!
//! **Other architectures**: original tensor names, `runnable = false`, a warning.
//!
//! **No `config.json`**: the head counts (needed both to run the model and to permute Q/K)
//! cannot be inferred from tensor shapes, so the tensors are kept under their original names
//! and the model is not runnable, with a warning saying so.
//!
//! **EOS lists**: `eos_token_id` is config.json's followed by generation_config.json's
//! others (transformers' `generate` stops at generation_config.json's list: Llama 3
//! Instruct's config names `<|end_of_text|>`, its generation config adds `<|eot_id|>`); when
//! that is a list, `tokenizer.eos_token_id` is its first entry
//! and, if the list has more than one entry, `"eos_token_ids": [...]` is added to
//! `tokenizer_config.json` (inserted textually, so the rest of the file stays verbatim;
//! created if the input has none) unless that key is already there.
//!
//! Only F32, F16 and BF16 tensors are accepted; any other dtype is an error naming the file
//! and the tensor, unless the tensor is one that conversion drops anyway.
//!
//! **Tensor order**: embedding tensors (no layer index, name mentions `embd`/`embed`) first,
//! then tensors with a layer index (the first all-digit dotted component) by layer, then
//! everything else; by name within each group.

use crate::limits::{
    read_text, ReadTextError, MAX_CONFIG_BYTES, MAX_INDEX_BYTES, MAX_TOKENIZER_BYTES,
};
use crate::source::{
    meta_u64, Gather, Layout, MappedFile, MetaValue, Metadata, Source, SourceTensor,
    TokenizerFiles, Transform,
};
use gds_format::DType;
use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, SafeTensorError, SafeTensors};
use serde::de::{Deserializer as _, Error as _, IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::error::SafetensorsError;

type Result<T> = std::result::Result<T, SafetensorsError>;

/// Reads a safetensors input (file, `model.safetensors.index.json`, or Hugging Face model
/// directory; see the module docs) into a [`Source`]. Tensor bytes stay in the memory-mapped
/// files; every offset and length has been bounds-checked against its file.
pub fn read_safetensors(input: &Path) -> Result<Source> {
    let located = locate(input)?;
    let mut raw: Vec<RawTensor> = Vec::new();
    let mut warnings = Vec::new();
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    for file in &located.files {
        for t in parse_file(file)? {
            if let Some(first) = seen.insert(t.name.clone(), t.file.path.clone()) {
                return Err(SafetensorsError::DuplicateTensor {
                    tensor: t.name,
                    first,
                    second: t.file.path.clone(),
                });
            }
            raw.push(t);
        }
    }
    if let Some(index) = &located.index {
        check_index(index, &raw, &mut warnings)?;
    }

    let dir = &located.dir;
    let config_path = dir.join("config.json");
    let config = read_json_object(&config_path)?;
    let mut tokenizer = TokenizerFiles {
        tokenizer_json: read_text_opt(&dir.join("tokenizer.json"), MAX_TOKENIZER_BYTES)?,
        tokenizer_config_json: read_text_opt(&dir.join("tokenizer_config.json"), MAX_CONFIG_BYTES)?,
        generation_config_json: read_text_opt(
            &dir.join("generation_config.json"),
            MAX_CONFIG_BYTES,
        )?,
        built: false,
    };
    chat_template_files(dir, &mut tokenizer)?;
    if tokenizer.tokenizer_json.is_none() {
        warnings.push(format!(
            "{} has no tokenizer.json; the converted model will have no tokenizer",
            dir.display()
        ));
    }

    let Some(config) = config else {
        return no_config(input, raw, tokenizer, warnings);
    };
    let cfg = Config {
        path: &config_path,
        map: &config,
    };
    let mut metadata = Metadata::new();
    token_ids(&cfg, dir, &mut tokenizer, &mut metadata)?;

    let hf_arch = config
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .map(str::to_owned);
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let spec = hf_arch
        .as_deref()
        .and_then(gds_format::arch::family_of)
        .or_else(|| model_type.as_deref().and_then(gds_format::arch::family_of));
    let source_arch = hf_arch
        .clone()
        .or_else(|| model_type.clone())
        .unwrap_or_else(|| "unknown".to_owned());
    metadata.insert(
        "general.source_architecture".into(),
        MetaValue::Str(source_arch.clone()),
    );

    let Some(spec) = spec else {
        let arch = model_type
            .or(hf_arch)
            .unwrap_or_else(|| "unknown".to_owned());
        warnings.push(format!(
            "architecture {source_arch} is not supported by gdsrun; tensors are grouped by layer index"
        ));
        metadata.insert("general.architecture".into(), MetaValue::Str(arch.clone()));
        let tensors = keep_original(raw)?;
        return Ok(Source {
            arch,
            runnable: false,
            metadata,
            hparam_origin: BTreeMap::new(),
            tensors,
            tokenizer,
            pending_tokenizer: None,
            warnings,
        });
    };

    let (tie_in_config, longrope) = llama_hparams(&cfg, &raw, &mut metadata, &mut warnings)?;
    family_hparams(&cfg, spec, &mut metadata)?;
    metadata.insert(
        "general.architecture".into(),
        MetaValue::Str(spec.family.clone()),
    );
    let (raw, gathered) = if spec.family == "gpt_oss" {
        gpt_oss_experts(raw, &metadata)?
    } else {
        (raw, Vec::new())
    };
    let mut tensors = map_llama(
        input,
        raw,
        gathered,
        &metadata,
        tie_in_config,
        spec,
        &mut warnings,
    )?;
    if let Some(lr) = &longrope {
        longrope_tensors(&cfg, spec, &metadata, lr, &mut tensors)?;
    }
    let name_or_path = config.get("_name_or_path").and_then(Value::as_str);
    let names = [name_or_path, model_type.as_deref(), hf_arch.as_deref()];
    if spec.family == "qwen3" && is_qwen3_reranker(dir, names) {
        qwen3_reranker(dir, &tokenizer, &mut metadata, &mut tensors)?;
    }
    let hparam_origin = [
        ("model.n_layers", "num_hidden_layers"),
        ("model.n_embd", "hidden_size"),
        ("model.n_heads", "num_attention_heads"),
        ("model.n_kv_heads", "num_key_value_heads"),
        ("model.n_ff", "intermediate_size"),
        ("model.vocab_size", "vocab_size"),
        ("model.head_dim", "head_dim"),
        ("model.context_length", "max_position_embeddings"),
        ("model.rope_theta", "rope_theta"),
        ("model.rms_norm_eps", "rms_norm_eps"),
    ]
    .into_iter()
    .chain(
        spec.hf_keys
            .iter()
            .map(|(c, k)| (c.as_str(), hf_key(&cfg, k))),
    )
    .filter(|(_, k)| cfg.get(k).is_some())
    .map(|(canon, k)| (canon.into(), format!("{k} in {}", config_path.display())))
    .collect();
    Ok(Source {
        arch: spec.family.clone(),
        runnable: true,
        metadata,
        hparam_origin,
        tensors,
        tokenizer,
        pending_tokenizer: None,
        warnings,
    })
}

/// llama.cpp's rerank prompt for Qwen3-Reranker (its converter's `rerank` chat template).
pub const QWEN3_RERANK_TEMPLATE: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

/// Whether a Qwen 3 checkpoint is a Qwen3-Reranker, found as llama.cpp's converter finds
/// one: its model card's title (`# Qwen3-Reranker…` in README.md) or a name (the directory,
/// or `names`: `_name_or_path`, `model_type`, the architecture) containing `qwen3-reranker`.
fn is_qwen3_reranker(dir: &Path, names: [Option<&str>; 3]) -> bool {
    const MARK: &str = "qwen3-reranker";
    let dir_name = std::fs::canonicalize(dir)
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()));
    if names
        .into_iter()
        .chain([dir_name.as_deref()])
        .any(|v| v.is_some_and(|s| s.to_lowercase().contains(MARK)))
    {
        return true;
    }
    // a model card is text of any size: its first megabyte is enough for a title
    let card = read_text_opt(&dir.join("README.md"), 1 << 20).unwrap_or(None);
    card.is_some_and(|c| c.to_lowercase().contains(&format!("# {MARK}")))
}

/// A Qwen3-Reranker's classifier head as llama.cpp's converter makes it: `cls.output.weight`
/// `[2, n_embd]`, the LM head's rows of the tokens "yes" and "no" (in that order; the head
/// is `lm_head`, or the embedding when tied), and its rerank prompt. The LM head stays, so
/// the model still generates.
fn qwen3_reranker(
    dir: &Path,
    tokenizer: &TokenizerFiles,
    metadata: &mut Metadata,
    tensors: &mut Vec<SourceTensor>,
) -> Result<()> {
    let tok_path = dir.join("tokenizer.json");
    let bad = |reason: String| SafetensorsError::Config {
        path: tok_path.clone(),
        reason,
    };
    let text = tokenizer.tokenizer_json.as_deref().ok_or_else(|| {
        bad("a Qwen3-Reranker needs its tokenizer (the ids of \"yes\" and \"no\")".into())
    })?;
    // as transformers' convert_tokens_to_ids: an added token, else the model's vocabulary
    let tok = <tokenizers::Tokenizer as std::str::FromStr>::from_str(text)
        .map_err(|e| bad(format!("does not load: {e}")))?;
    let id = |token: &str| -> Result<u64> {
        tok.token_to_id(token).map(u64::from).ok_or_else(|| {
            bad(format!(
                "a Qwen3-Reranker's vocabulary has no token {token:?}"
            ))
        })
    };
    let (yes, no) = (id("yes")?, id("no")?);
    let head = tensors
        .iter()
        .find(|t| t.name == "output.weight")
        .or_else(|| tensors.iter().find(|t| t.name == "token_embd.weight"))
        .ok_or_else(|| bad("a Qwen3-Reranker without an LM head".into()))?;
    let (rows, d) = match head.shape[..] {
        [rows, d] => (rows, d),
        _ => return Err(bad(format!("its LM head has shape {:?}", head.shape))),
    };
    if yes >= rows || no >= rows {
        return Err(bad(format!(
            "the tokens \"yes\" ({yes}) and \"no\" ({no}) are not rows of its LM head ({rows})"
        )));
    }
    let row = head
        .dtype
        .tensor_bytes(&[1, d])
        .filter(|_| {
            matches!(head.layout, Layout::Plain) && matches!(head.transform, Transform::None)
        })
        .ok_or_else(|| {
            bad(format!(
                "its LM head ({}) cannot be cut into rows",
                head.dtype
            ))
        })?;
    let cls = SourceTensor {
        name: gds_format::arch::CLS_OUTPUT.into(),
        source_name: format!("{} rows {yes} (yes) and {no} (no)", head.source_name),
        dtype: head.dtype,
        shape: vec![2, d],
        file: head.file.clone(),
        offset: head.offset + yes * row,
        nbytes: 2 * row,
        transform: Transform::None,
        layout: Layout::Stacked(vec![(head.file.clone(), head.offset + no * row)]),
    };
    tensors.push(cls);
    sort_tensors(tensors);
    metadata.insert(
        gds_format::RERANK_TEMPLATE_KEY.into(),
        MetaValue::Str(QWEN3_RERANK_TEMPLATE.into()),
    );
    Ok(())
}

/// LongRoPE's factors as the tensors llama.cpp's converter writes
/// (`rope_factors_long.weight`, `rope_factors_short.weight`, `rope_dims / 2` each), for a
/// family whose description has them.
fn longrope_tensors(
    cfg: &Config,
    spec: &FamilySpec,
    md: &Metadata,
    lr: &LongRope,
    tensors: &mut Vec<SourceTensor>,
) -> Result<()> {
    let names = ["rope_factors_long.weight", "rope_factors_short.weight"];
    if !names
        .iter()
        .all(|n| spec.optional_tensors.global.iter().any(|g| g == n))
    {
        return Err(cfg.err(format!(
            "rope scaling type longrope is supported for Phi-3 models only, not {}",
            spec.family
        )));
    }
    let dims = match (md.get("model.rope_dims"), md.get("model.head_dim")) {
        (Some(MetaValue::U64(d)), _) | (None, Some(MetaValue::U64(d))) => *d,
        _ => 0,
    };
    for (name, (key, values)) in names
        .iter()
        .zip([("long_factor", &lr.long), ("short_factor", &lr.short)])
    {
        if values.len() as u64 != dims / 2 {
            return Err(cfg.err(format!(
                "rope {key} has {} values; the {dims} rotated dimensions need {}",
                values.len(),
                dims / 2
            )));
        }
        let t = SourceTensor::f32_vector(
            name,
            format!("rope_parameters.{key}"),
            cfg.path.to_path_buf(),
            values,
        )
        .map_err(|e| cfg.err(format!("cannot hold rope {key}: {e}")))?;
        tensors.push(t);
    }
    sort_tensors(tensors);
    Ok(())
}

/// Reorders the rows of a Hugging Face Q or K projection (weight or bias) from the "rotate
/// half" RoPE layout to ggml's interleaved layout, exactly as llama.cpp's
/// `convert_hf_to_gguf.py` does with
/// `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)`:
/// within each head of `2·h` rows, output row `2i + j` is input row `j·h + i`.
///
/// `bytes` holds `rows` rows of `row_bytes` bytes each (any dtype: only whole rows move).
///
/// # Panics
///
/// If `bytes.len() != rows * row_bytes`, `n_head` is 0, or `rows` is not a multiple of
/// `2 * n_head`. [`read_safetensors`] checks the last two for every tensor it marks with
/// [`Transform::PermuteRope`].
pub fn permute_rope_rows(bytes: &[u8], rows: usize, row_bytes: usize, n_head: usize) -> Vec<u8> {
    assert_eq!(
        Some(bytes.len()),
        rows.checked_mul(row_bytes),
        "rows × row_bytes"
    );
    assert!(
        n_head.checked_mul(2).and_then(|d| rows.checked_rem(d)) == Some(0),
        "rows must be a multiple of 2 × n_head"
    );
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(bytes.len());
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = h * 2 * half + j * half + i;
                out.extend_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

// ------------------------------------------------------------------------------------------
// Locating the files

struct Located {
    /// Where config.json and the tokenizer files may be.
    dir: PathBuf,
    /// Safetensors files, in the order they are read.
    files: Vec<PathBuf>,
    /// The shard index, when there is one.
    index: Option<Index>,
}

struct Index {
    path: PathBuf,
    /// Tensor name → shard path.
    weight_map: BTreeMap<String, PathBuf>,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SafetensorsError + '_ {
    move |source| SafetensorsError::Io {
        path: path.to_owned(),
        source,
    }
}

fn locate(input: &Path) -> Result<Located> {
    let meta = std::fs::metadata(input).map_err(io_err(input))?;
    if meta.is_dir() {
        let index = input.join("model.safetensors.index.json");
        if index.is_file() {
            return located_index(&index, input);
        }
        let single = input.join("model.safetensors");
        if single.is_file() {
            return Ok(Located {
                dir: input.to_owned(),
                files: vec![single],
                index: None,
            });
        }
        let mut files = Vec::new();
        for entry in std::fs::read_dir(input).map_err(io_err(input))? {
            let path = entry.map_err(io_err(input))?.path();
            if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(SafetensorsError::UnsupportedInput {
                path: input.to_owned(),
                reason: "directory holds no .safetensors file".into(),
            });
        }
        return Ok(Located {
            dir: input.to_owned(),
            files,
            index: None,
        });
    }
    let dir = match input.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name.ends_with(".index.json") {
        located_index(input, &dir)
    } else if name.ends_with(".safetensors") {
        Ok(Located {
            dir,
            files: vec![input.to_owned()],
            index: None,
        })
    } else {
        Err(SafetensorsError::UnsupportedInput {
            path: input.to_owned(),
            reason: "expected a .safetensors file, a model.safetensors.index.json or a \
                     directory holding safetensors files"
                .into(),
        })
    }
}

fn located_index(index_path: &Path, dir: &Path) -> Result<Located> {
    let bad = |reason: String| SafetensorsError::Index {
        path: index_path.to_owned(),
        reason,
    };
    let text = match read_text(index_path, MAX_INDEX_BYTES) {
        Ok(Some(t)) => t,
        Ok(None) => {
            return Err(io_err(index_path)(io::Error::from_raw_os_error(
                libc::ENOENT,
            )));
        }
        Err(ReadTextError::Io(e)) => return Err(io_err(index_path)(e)),
        Err(e) => return Err(bad(e.describe(MAX_INDEX_BYTES))),
    };
    let json: Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut weight_map = BTreeMap::new();
    // shard name → first tensor the index places in it (for messages)
    let mut shards: BTreeMap<String, String> = BTreeMap::new();
    for (tensor, shard) in map {
        let shard = shard
            .as_str()
            .ok_or_else(|| bad(format!("tensor {tensor:?}: shard is not a string")))?;
        let plain = Path::new(shard)
            .file_name()
            .is_some_and(|f| f == std::ffi::OsStr::new(shard));
        if !plain || shard == ".." {
            return Err(bad(format!(
                "tensor {tensor:?}: shard {shard:?} is not a plain file name"
            )));
        }
        shards
            .entry(shard.to_owned())
            .or_insert_with(|| tensor.clone());
        weight_map.insert(tensor.clone(), dir.join(shard));
    }
    if shards.is_empty() {
        return Err(bad("\"weight_map\" is empty".into()));
    }
    let mut files = Vec::new();
    for (shard, tensor) in shards {
        let path = dir.join(&shard);
        if !path.is_file() {
            return Err(SafetensorsError::MissingShard {
                index: index_path.to_owned(),
                shard: path,
                tensor,
            });
        }
        files.push(path);
    }
    Ok(Located {
        dir: dir.to_owned(),
        files,
        index: Some(Index {
            path: index_path.to_owned(),
            weight_map,
        }),
    })
}

/// Every tensor the index lists must be in the shard it names; tensors found in shards but
/// not listed are kept, with a warning.
fn check_index(index: &Index, raw: &[RawTensor], warnings: &mut Vec<String>) -> Result<()> {
    let found: BTreeMap<&str, &Path> = raw
        .iter()
        .map(|t| (t.name.as_str(), t.file.path.as_path()))
        .collect();
    for (tensor, shard) in &index.weight_map {
        if found.get(tensor.as_str()) != Some(&shard.as_path()) {
            return Err(SafetensorsError::Tensor {
                path: shard.clone(),
                tensor: tensor.clone(),
                reason: format!("listed in {} but not in this shard", index.path.display()),
            });
        }
    }
    for t in raw {
        if !index.weight_map.contains_key(&t.name) {
            warnings.push(format!(
                "tensor {:?} in {} is not listed in {}; kept",
                t.name,
                t.file.path.display(),
                index.path.display()
            ));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// One safetensors file

/// A tensor as its file describes it, validated against the file's size.
struct RawTensor {
    name: String,
    st_dtype: StDtype,
    shape: Vec<u64>,
    file: Arc<MappedFile>,
    /// Absolute offset of the data in the file.
    offset: u64,
    nbytes: u64,
}

/// safetensors' own limit on the header size.
const MAX_HEADER: u64 = 100_000_000;

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(io_err(path))?;
    let len = file.metadata().map_err(io_err(path))?.len();
    if len < 8 {
        return Err(SafetensorsError::Header {
            path: path.to_owned(),
            reason: format!("file is {len} bytes, too short for the 8-byte header length"),
        });
    }
    // SAFETY: the file is opened read-only and the map is only ever read. As with every
    // memory-mapped reader, a process truncating or rewriting the file while it is mapped
    // could change what we read; that is outside this program's control and documented as
    // a limitation of converting files that are being modified.
    unsafe { Mmap::map(&file) }.map_err(io_err(path))
}

/// Bits per element of a safetensors dtype name, or `None` if the name is unknown.
fn dtype_bits(name: &str) -> Option<u64> {
    Some(match name {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" => 64,
        _ => return None,
    })
}

fn parse_file(path: &Path) -> Result<Vec<RawTensor>> {
    let map = map_file(path)?;
    let header_err = |reason: String| SafetensorsError::Header {
        path: path.to_owned(),
        reason,
    };
    let file_len = map.len() as u64;
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER {
        return Err(header_err(format!(
            "header length {n} exceeds safetensors' limit of {MAX_HEADER} bytes"
        )));
    }
    if n > file_len - 8 {
        return Err(header_err(format!(
            "header length {n} runs past the end of the {file_len}-byte file (truncated?)"
        )));
    }
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let text = std::str::from_utf8(&map[8..data_start as usize])
        .map_err(|e| header_err(format!("header is not UTF-8: {e}")))?;
    // Our own pass first, for messages that name the tensor and to refuse duplicate keys.
    let mut check = HeaderCheck {
        path,
        data_len,
        failure: None,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    if let Err(e) = de.deserialize_map(&mut check).and_then(|()| de.end()) {
        return Err(check
            .failure
            .take()
            .unwrap_or_else(|| header_err(format!("header is not a JSON object: {e}"))));
    }
    // Then the safetensors crate's validation (contiguous offsets covering the data).
    let (_, meta) = SafeTensors::read_metadata(&map[..]).map_err(|e| match e {
        SafeTensorError::InvalidOffset(tensor) => SafetensorsError::Tensor {
            path: path.to_owned(),
            tensor,
            reason: "data offsets overlap another tensor or leave a gap".into(),
        },
        SafeTensorError::MetadataIncompleteBuffer => header_err(format!(
            "tensor data does not exactly fill the {data_len}-byte data section \
             (trailing bytes or a truncated file)"
        )),
        other => header_err(other.to_string()),
    })?;

    let file = Arc::new(MappedFile {
        path: path.to_owned(),
        map,
        anon: false,
    });
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        out.push(RawTensor {
            name,
            st_dtype: info.dtype,
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            file: file.clone(),
            offset: data_start + start as u64,
            nbytes: (end - start) as u64,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Walks the header object entry by entry, so that a duplicate key is seen (a JSON map keeps
/// only the last of two entries of one name, and which tensor the file meant is then a guess)
/// and only one entry at a time is held as a `serde_json::Value`.
struct HeaderCheck<'a> {
    path: &'a Path,
    data_len: u64,
    /// The error to report when deserialization stopped on purpose.
    failure: Option<SafetensorsError>,
}

impl<'de> Visitor<'de> for &mut HeaderCheck<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                self.failure = Some(SafetensorsError::Header {
                    path: self.path.to_owned(),
                    reason: format!("key {key:?} appears twice"),
                });
                return Err(A::Error::custom("duplicate key"));
            }
            if key == "__metadata__" {
                // checked by the safetensors crate (a map of strings)
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let entry: Value = map.next_value()?;
            if let Err(e) = check_entry(self.path, &key, &entry, self.data_len) {
                self.failure = Some(e);
                return Err(A::Error::custom("bad entry"));
            }
        }
        Ok(())
    }
}

fn check_entry(path: &Path, name: &str, entry: &Value, data_len: u64) -> Result<()> {
    let err = |reason: String| SafetensorsError::Tensor {
        path: path.to_owned(),
        tensor: name.to_owned(),
        reason,
    };
    let dtype = entry
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| err("header entry has no \"dtype\" string".into()))?;
    let bits = dtype_bits(dtype).ok_or_else(|| err(format!("unknown dtype {dtype:?}")))?;
    let shape = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| err("header entry has no \"shape\" array".into()))?;
    let mut dims = Vec::with_capacity(shape.len());
    for d in shape {
        dims.push(
            d.as_u64()
                .ok_or_else(|| err(format!("shape entry {d} is not a non-negative integer")))?,
        );
    }
    let elems = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| err("shape overflows".into()))?;
    let offs = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or_else(|| err("header entry has no two-element \"data_offsets\"".into()))?;
    let (Some(start), Some(end)) = (offs[0].as_u64(), offs[1].as_u64()) else {
        return Err(err("data_offsets are not non-negative integers".into()));
    };
    if end < start {
        return Err(err(format!(
            "data_offsets [{start}, {end}) end before they start"
        )));
    }
    if end > data_len {
        return Err(err(format!(
            "data [{start}, {end}) runs past the end of the {data_len}-byte data section \
             (truncated file?)"
        )));
    }
    let need_bits = elems
        .checked_mul(bits)
        .ok_or_else(|| err("size overflows".into()))?;
    if need_bits % 8 != 0 || need_bits / 8 != end - start {
        return Err(err(format!(
            "{dtype} shape {dims:?} needs {need_bits} bits but data_offsets span {} bytes",
            end - start
        )));
    }
    Ok(())
}

fn gds_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

fn source_tensor(t: RawTensor, name: String, transform: Transform) -> Result<SourceTensor> {
    let dtype = gds_dtype(t.st_dtype).ok_or_else(|| SafetensorsError::UnsupportedDtype {
        path: t.file.path.clone(),
        tensor: t.name.clone(),
        dtype: t.st_dtype.to_string(),
    })?;
    // Recomputed from dtype and shape; parse_file already checked it matches the offsets.
    let nbytes = dtype.tensor_bytes(&t.shape);
    if nbytes != Some(t.nbytes) {
        return Err(SafetensorsError::Tensor {
            path: t.file.path.clone(),
            tensor: t.name,
            reason: "size does not match dtype and shape".into(),
        });
    }
    Ok(SourceTensor {
        name,
        source_name: t.name,
        dtype,
        shape: t.shape,
        file: t.file,
        offset: t.offset,
        nbytes: t.nbytes,
        transform,
        layout: Layout::Plain,
    })
}

// ------------------------------------------------------------------------------------------
// Side files

/// A side file's text (at most `cap` bytes), or `None` when it does not exist.
fn read_text_opt(path: &Path, cap: u64) -> Result<Option<String>> {
    read_text(path, cap).map_err(|e| match e {
        ReadTextError::Io(source) => SafetensorsError::Io {
            path: path.to_owned(),
            source,
        },
        e => SafetensorsError::Config {
            path: path.to_owned(),
            reason: e.describe(cap),
        },
    })
}

fn read_json_object(path: &Path) -> Result<Option<Map<String, Value>>> {
    let Some(text) = read_text_opt(path, MAX_CONFIG_BYTES)? else {
        return Ok(None);
    };
    parse_json_object(path, &text).map(Some)
}

fn parse_json_object(path: &Path, text: &str) -> Result<Map<String, Value>> {
    serde_json::from_str(text).map_err(|e| SafetensorsError::Config {
        path: path.to_owned(),
        reason: format!("not a JSON object: {e}"),
    })
}

/// `config.json`, with typed getters whose errors name the file and key.
struct Config<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl Config<'_> {
    fn err(&self, reason: String) -> SafetensorsError {
        SafetensorsError::Config {
            path: self.path.to_owned(),
            reason,
        }
    }

    /// The value, treating JSON `null` as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn u64_opt(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.err(format!("{key} = {v} is not a non-negative integer")))
            })
            .transpose()
    }

    fn u64_req(&self, key: &str) -> Result<u64> {
        self.u64_opt(key)?
            .ok_or_else(|| self.err(format!("{key} is missing")))
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| self.err(format!("{key} = {v} is not a number")))
            })
            .transpose()
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.err(format!("{key} = {v} is not a boolean")))
            })
            .transpose()
    }

    /// A token id that may also be a list of ids (`eos_token_id` often is).
    fn ids_opt(&self, key: &str) -> Result<Option<Vec<u64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || self.err(format!("{key} = {v} is not a token id or a list of them"));
        let ids = match v {
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_u64().ok_or_else(bad))
                .collect::<Result<Vec<_>>>()?,
            other => vec![other.as_u64().ok_or_else(bad)?],
        };
        Ok((!ids.is_empty()).then_some(ids))
    }
}

/// Most templates a directory's `additional_chat_templates/` may hold.
const MAX_CHAT_TEMPLATE_FILES: usize = 64;

/// The chat templates transformers keeps beside `tokenizer_config.json` since 4.5x
/// (`save_pretrained` writes `chat_template.jinja`, and named ones as
/// `additional_chat_templates/NAME.jinja`, and takes them out of the config): put into the
/// output's `tokenizer_config.json`, where gdsrun reads templates. As transformers loads
/// them, the files take priority over the config's entries of the same name; the config's
/// other templates are kept. One template named `default` is the plain string, several the
/// list of `{name, template}`. Each file is capped as the JSON side files are.
fn chat_template_files(dir: &Path, tok: &mut TokenizerFiles) -> Result<()> {
    let mut files: Vec<(String, String)> = Vec::new();
    if let Some(t) = read_text_opt(&dir.join("chat_template.jinja"), MAX_CONFIG_BYTES)? {
        files.push(("default".into(), t));
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let mut names: Vec<_> = std::fs::read_dir(&extra)
            .map_err(|source| SafetensorsError::Io {
                path: extra.clone(),
                source,
            })?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .collect();
        names.sort();
        if names.len() > MAX_CHAT_TEMPLATE_FILES {
            return Err(SafetensorsError::Config {
                path: extra,
                reason: format!(
                    "{} templates, over the limit of {MAX_CHAT_TEMPLATE_FILES}",
                    names.len()
                ),
            });
        }
        for p in names {
            let name = p
                .file_stem()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            if let Some(t) = read_text_opt(&p, MAX_CONFIG_BYTES)? {
                files.retain(|(n, _)| *n != name);
                files.push((name, t));
            }
        }
    }
    if files.is_empty() {
        return Ok(());
    }
    let tc_path = dir.join("tokenizer_config.json");
    let mut config = match tok.tokenizer_config_json.as_deref() {
        Some(t) => parse_json_object(&tc_path, t)?,
        None => Map::new(),
    };
    // the config's own templates, then the files' over them by name
    let mut templates: Vec<(String, Value)> = match config.get("chat_template") {
        Some(Value::String(t)) => vec![("default".into(), Value::String(t.clone()))],
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(|e| {
                Some((
                    e.get("name")?.as_str()?.to_string(),
                    e.get("template")?.clone(),
                ))
            })
            .collect(),
        _ => Vec::new(),
    };
    for (name, t) in files {
        templates.retain(|(n, _)| *n != name);
        templates.push((name, Value::String(t)));
    }
    let value = match templates.as_slice() {
        [(name, t)] if name == "default" => t.clone(),
        _ => Value::Array(
            templates
                .into_iter()
                .map(|(name, template)| serde_json::json!({"name": name, "template": template}))
                .collect(),
        ),
    };
    config.insert("chat_template".into(), value);
    let mut text = serde_json::to_string_pretty(&config).expect("a JSON object serializes");
    text.push('\n');
    tok.tokenizer_config_json = Some(text);
    Ok(())
}

/// BOS/EOS ids from config.json, else generation_config.json, plus `add_bos_token` from
/// tokenizer_config.json. See the module docs for EOS lists.
fn token_ids(cfg: &Config, dir: &Path, tok: &mut TokenizerFiles, md: &mut Metadata) -> Result<()> {
    let gen_path = dir.join("generation_config.json");
    let gen_map = tok
        .generation_config_json
        .as_deref()
        .map(|t| parse_json_object(&gen_path, t))
        .transpose()?;
    let gen = gen_map.as_ref().map(|map| Config {
        path: &gen_path,
        map,
    });
    let pick = |key: &str| -> Result<Option<Vec<u64>>> {
        match cfg.ids_opt(key)? {
            Some(ids) => Ok(Some(ids)),
            None => gen.as_ref().map_or(Ok(None), |g| g.ids_opt(key)),
        }
    };
    if let Some(bos) = pick("bos_token_id")? {
        md.insert("tokenizer.bos_token_id".into(), MetaValue::U64(bos[0]));
    }
    let tc_path = dir.join("tokenizer_config.json");
    let tc = tok
        .tokenizer_config_json
        .as_deref()
        .map(|t| parse_json_object(&tc_path, t))
        .transpose()?;
    if let Some(add_bos) = tc.as_ref().and_then(|m| m.get("add_bos_token")) {
        if let Some(b) = add_bos.as_bool() {
            md.insert("tokenizer.add_bos".into(), MetaValue::Bool(b));
        }
    }
    // config.json's ids, then generation_config.json's others: generation stops at either
    // (generation_config.json's list is an error of the input only where config.json has
    // none, as before it was read)
    let gen_eos = || gen.as_ref().map_or(Ok(None), |g| g.ids_opt("eos_token_id"));
    let eos = match cfg.ids_opt("eos_token_id")? {
        Some(mut c) => {
            for id in gen_eos().ok().flatten().unwrap_or_default() {
                if !c.contains(&id) {
                    c.push(id);
                }
            }
            Some(c)
        }
        None => gen_eos()?,
    };
    if let Some(eos) = eos {
        md.insert("tokenizer.eos_token_id".into(), MetaValue::U64(eos[0]));
        if eos.len() > 1 && !tc.as_ref().is_some_and(|m| m.contains_key("eos_token_ids")) {
            let list = serde_json::to_string(&eos).expect("a list of integers serializes");
            tok.tokenizer_config_json = Some(match (&tok.tokenizer_config_json, &tc) {
                (Some(text), Some(map)) => {
                    let body = text.trim_end();
                    // parse_json_object succeeded, so the text ends with the object's `}`.
                    let head = &body[..body.len() - 1];
                    let sep = if map.is_empty() { "" } else { "," };
                    format!(
                        "{}{sep}\n  \"eos_token_ids\": {list}\n}}\n",
                        head.trim_end()
                    )
                }
                _ => format!("{{\n  \"eos_token_ids\": {list}\n}}\n"),
            });
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Architectures

// The llama family's name map and pattern matcher are shared with the GGUF side.
use crate::names::{llama as llama_spec, match_expert, match_pattern, FamilySpec};

fn fill(pattern: &str, n: Option<u64>) -> String {
    match n {
        Some(n) => pattern.replace("{N}", &n.to_string()),
        None => pattern.to_owned(),
    }
}

/// Sort key documented in the module docs.
fn order_key(name: &str) -> (u8, u64, String) {
    let parts: Vec<&str> = name.split('.').collect();
    let layer = parts[..parts.len().saturating_sub(1)]
        .iter()
        .find(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|p| p.parse::<u64>().ok());
    match layer {
        Some(n) => (1, n, name.to_owned()),
        None if name.contains("embd") || name.contains("embed") => (0, 0, name.to_owned()),
        None => (2, 0, name.to_owned()),
    }
}

fn sort_tensors(tensors: &mut [SourceTensor]) {
    tensors.sort_by_cached_key(|t| order_key(&t.name));
}

fn keep_original(raw: Vec<RawTensor>) -> Result<Vec<SourceTensor>> {
    let mut out = raw
        .into_iter()
        .map(|t| {
            let name = t.name.clone();
            source_tensor(t, name, Transform::None)
        })
        .collect::<Result<Vec<_>>>()?;
    sort_tensors(&mut out);
    Ok(out)
}

fn no_config(
    input: &Path,
    raw: Vec<RawTensor>,
    tokenizer: TokenizerFiles,
    mut warnings: Vec<String>,
) -> Result<Source> {
    let spec = llama_spec();
    let looks_llama = raw.iter().any(|t| {
        spec.tensors
            .keys()
            .any(|p| match_pattern(p, &t.name).is_some())
    });
    warnings.push(if looks_llama {
        format!(
            "{}: no config.json: the tensor names look llama-family, but the attention head \
             counts cannot be inferred from tensor shapes, so tensors keep their original \
             names and gdsrun cannot run the result; convert the Hugging Face model \
             directory (with its config.json) instead",
            input.display()
        )
    } else {
        format!(
            "{}: no config.json: architecture unknown, not supported by gdsrun; tensors are \
             grouped by layer index",
            input.display()
        )
    });
    let mut metadata = Metadata::new();
    metadata.insert(
        "general.architecture".into(),
        MetaValue::Str("unknown".into()),
    );
    Ok(Source {
        arch: "unknown".into(),
        runnable: false,
        metadata,
        hparam_origin: BTreeMap::new(),
        tensors: keep_original(raw)?,
        tokenizer,
        pending_tokenizer: None,
        warnings,
    })
}

/// LongRoPE's per-pair frequency divisors from config.json (Phi-3.5, Phi-4-mini).
struct LongRope {
    long: Vec<f32>,
    short: Vec<f32>,
}

/// Writes the `model.*` hyperparameters of config.json into `md`; returns what the tensor
/// mapping needs besides them: `tie_word_embeddings` as config.json says (absent: false, as
/// in `LlamaConfig`) and the LongRoPE factors (`rope_type` longrope), written as llama.cpp's
/// tensors.
fn llama_hparams(
    cfg: &Config,
    raw: &[RawTensor],
    md: &mut Metadata,
    warnings: &mut Vec<String>,
) -> Result<(bool, Option<LongRope>)> {
    let n_embd = cfg.u64_req("hidden_size")?;
    let n_layers = cfg.u64_req("num_hidden_layers")?;
    let n_heads = cfg.u64_req("num_attention_heads")?;
    let n_kv_heads = cfg.u64_opt("num_key_value_heads")?.unwrap_or(n_heads);
    let n_ff = cfg.u64_req("intermediate_size")?;
    if n_embd == 0 || n_layers == 0 || n_heads == 0 || n_kv_heads == 0 || n_ff == 0 {
        return Err(cfg.err(
            "hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads and \
             intermediate_size must all be positive"
                .into(),
        ));
    }
    if n_heads % n_kv_heads != 0 {
        return Err(cfg.err(format!(
            "num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads \
             ({n_kv_heads})"
        )));
    }
    let head_dim = match cfg.u64_opt("head_dim")? {
        Some(0) => return Err(cfg.err("head_dim must be positive".into())),
        Some(d) => d,
        None if n_embd % n_heads == 0 => n_embd / n_heads,
        None => {
            return Err(cfg.err(format!(
                "no head_dim, and hidden_size ({n_embd}) is not a multiple of \
                 num_attention_heads ({n_heads})"
            )))
        }
    };
    let embed_rows = raw
        .iter()
        .find(|t| t.name == "model.embed_tokens.weight")
        .and_then(|t| t.shape.first().copied());
    let vocab = match (cfg.u64_opt("vocab_size")?, embed_rows) {
        (Some(v), _) => v,
        (None, Some(rows)) => rows,
        (None, None) => return Err(cfg.err("vocab_size is missing".into())),
    };
    let ctx = match cfg.u64_opt("max_position_embeddings")? {
        Some(c) => c,
        None => {
            warnings.push(format!(
                "{}: no max_position_embeddings; using 2048 (the transformers default)",
                cfg.path.display()
            ));
            2048
        }
    };
    let (global_rope, _) = rope_parameters(cfg);
    let rope_theta = match cfg.f64_opt("rope_theta")? {
        Some(t) => t,
        None => match global_rope {
            Some(sub) => sub.f64_opt("rope_theta")?.unwrap_or(10000.0),
            None => 10000.0,
        },
    };
    let eps = cfg.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    let tie_in_config = cfg.bool_opt("tie_word_embeddings")?.unwrap_or(false);
    let has_lm_head = raw.iter().any(|t| t.name == "lm_head.weight");

    let u = |v: u64| MetaValue::U64(v);
    md.insert("model.n_layers".into(), u(n_layers));
    md.insert("model.n_embd".into(), u(n_embd));
    md.insert("model.n_heads".into(), u(n_heads));
    md.insert("model.n_kv_heads".into(), u(n_kv_heads));
    md.insert("model.n_ff".into(), u(n_ff));
    md.insert("model.vocab_size".into(), u(vocab));
    md.insert("model.context_length".into(), u(ctx));
    md.insert("model.head_dim".into(), u(head_dim));
    md.insert("model.rope_theta".into(), MetaValue::F64(rope_theta));
    md.insert("model.rms_norm_eps".into(), MetaValue::F64(eps));
    md.insert(
        "model.tie_embeddings".into(),
        MetaValue::Bool(tie_in_config || !has_lm_head),
    );
    let longrope = rope_scaling(cfg, md)?;
    Ok((tie_in_config, longrope))
}

/// `rope_scaling` (or transformers 5's `rope_parameters`): `default`/null mean none;
/// `linear` and `llama3` become `model.rope_scaling.*`; `longrope` (Phi-3.5, Phi-4-mini)
/// becomes `model.rope_scaling.attn_factor` and `original_context_length` plus the factors,
/// returned for the caller to write as tensors. Any other type is an error: the model could
/// not be run, and its config would not validate.
fn rope_scaling(cfg: &Config, md: &mut Metadata) -> Result<Option<LongRope>> {
    let (map, from_params) = match cfg.get("rope_scaling") {
        Some(v) => (
            v.as_object()
                .ok_or_else(|| cfg.err(format!("rope_scaling = {v} is not an object")))?,
            false,
        ),
        None => match rope_parameters(cfg).0 {
            Some(sub) => (sub.map, true),
            None => return Ok(None),
        },
    };
    let sub = Config {
        path: cfg.path,
        map,
    };
    let kind = ["rope_type", "type"]
        .iter()
        .find_map(|k| map.get(*k).and_then(Value::as_str))
        .or(from_params.then_some("default"))
        .ok_or_else(|| cfg.err("rope_scaling has no rope_type".into()))?;
    let factor = |md: &mut Metadata| -> Result<()> {
        let f = sub
            .f64_opt("factor")?
            .ok_or_else(|| cfg.err(format!("rope_scaling {kind} has no factor")))?;
        md.insert("model.rope_scaling.factor".into(), MetaValue::F64(f));
        Ok(())
    };
    match kind {
        "default" => return Ok(None),
        "linear" => factor(md)?,
        "llama3" => {
            factor(md)?;
            let lo = sub.f64_opt("low_freq_factor")?.unwrap_or(1.0);
            let hi = sub.f64_opt("high_freq_factor")?.unwrap_or(4.0);
            let orig = sub
                .u64_opt("original_max_position_embeddings")?
                .ok_or_else(|| {
                    cfg.err("rope_scaling llama3 has no original_max_position_embeddings".into())
                })?;
            md.insert(
                "model.rope_scaling.low_freq_factor".into(),
                MetaValue::F64(lo),
            );
            md.insert(
                "model.rope_scaling.high_freq_factor".into(),
                MetaValue::F64(hi),
            );
            md.insert(
                "model.rope_scaling.original_context_length".into(),
                MetaValue::U64(orig),
            );
        }
        "longrope" | "su" => return longrope(cfg, &sub, md).map(Some),
        "yarn" => yarn(cfg, &sub, md)?,
        other => {
            return Err(cfg.err(format!(
                "rope scaling type {other:?} is not supported (gdsrun runs default, linear, \
                 llama3, yarn and, for Phi-3, longrope): the model could not be run"
            )))
        }
    }
    md.insert(
        "model.rope_scaling.type".into(),
        MetaValue::Str(kind.to_owned()),
    );
    Ok(None)
}

/// YaRN as transformers computes it (`_compute_yarn_parameters`): `factor` (when null,
/// `max_position_embeddings` over the original), `original_max_position_embeddings`,
/// `beta_fast`/`beta_slow` (0 or absent: 32 and 1) and `truncate` (default true), with the
/// attention factor `1 + 0.1 ln factor`; an `attention_factor` or `mscale` pair that would
/// change it is refused.
fn yarn(cfg: &Config, sub: &Config, md: &mut Metadata) -> Result<()> {
    let orig = sub
        .u64_opt("original_max_position_embeddings")?
        .ok_or_else(|| {
            cfg.err("rope_scaling yarn has no original_max_position_embeddings".into())
        })?;
    let factor = match sub.f64_opt("factor")? {
        Some(f) => f,
        None => cfg.u64_req("max_position_embeddings")? as f64 / orig as f64,
    };
    let mscale = |m: f64| {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    };
    let attention = match (
        sub.f64_opt("attention_factor")?,
        sub.f64_opt("mscale")?.filter(|&m| m != 0.0),
        sub.f64_opt("mscale_all_dim")?.filter(|&m| m != 0.0),
    ) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) => mscale(m) / mscale(all),
        _ => mscale(1.0),
    };
    if (attention - mscale(1.0)).abs() > 1e-9 {
        return Err(cfg.err(format!(
            "rope_scaling yarn's attention factor {attention} (attention_factor, or mscale and \
             mscale_all_dim) is not 1 + 0.1 ln factor = {}: not supported by gdsrun",
            mscale(1.0)
        )));
    }
    md.insert("model.rope_scaling.factor".into(), MetaValue::F64(factor));
    md.insert(
        "model.rope_scaling.original_context_length".into(),
        MetaValue::U64(orig),
    );
    for (key, canon) in [
        ("beta_fast", "model.rope_scaling.yarn_beta_fast"),
        ("beta_slow", "model.rope_scaling.yarn_beta_slow"),
    ] {
        if let Some(v) = sub.f64_opt(key)?.filter(|&v| v != 0.0) {
            md.insert(canon.into(), MetaValue::F64(v));
        }
    }
    if let Some(t) = sub.bool_opt("truncate")? {
        md.insert(
            "model.rope_scaling.yarn_truncate".into(),
            MetaValue::Bool(t),
        );
    }
    Ok(())
}

/// LongRoPE as transformers computes it (`_compute_longrope_parameters`): the attention
/// factor is `attention_factor` when given, else √(1 + ln s / ln orig) with
/// s = max_position_embeddings / orig (1 when s ≤ 1), as llama.cpp's converter writes
/// `rope.scaling.attn_factor`.
fn longrope(cfg: &Config, sub: &Config, md: &mut Metadata) -> Result<LongRope> {
    let list = |k: &str| -> Result<Vec<f32>> {
        let bad = || cfg.err(format!("rope {k} must be a list of positive numbers"));
        let a = sub.get(k).and_then(Value::as_array).ok_or_else(bad)?;
        a.iter()
            .map(|v| match v.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(f as f32),
                _ => Err(bad()),
            })
            .collect()
    };
    let (long, short) = (list("long_factor")?, list("short_factor")?);
    let key = "original_max_position_embeddings";
    let orig = match sub.u64_opt(key)? {
        Some(o) => o,
        None => cfg
            .u64_opt(key)?
            .ok_or_else(|| cfg.err(format!("longrope needs {key}")))?,
    };
    if orig < 2 {
        return Err(cfg.err(format!("{key} {orig} is too small")));
    }
    let max_pos = cfg.u64_opt("max_position_embeddings")?.unwrap_or(orig);
    let attn = match sub.f64_opt("attention_factor")? {
        Some(a) => a,
        None => {
            let s = max_pos as f64 / orig as f64;
            if s <= 1.0 {
                1.0
            } else {
                (1.0 + s.ln() / (orig as f64).ln()).sqrt()
            }
        }
    };
    md.insert(
        "model.rope_scaling.attn_factor".into(),
        MetaValue::F64(attn),
    );
    md.insert(
        "model.rope_scaling.original_context_length".into(),
        MetaValue::U64(orig),
    );
    Ok(LongRope { long, short })
}

/// transformers ≥ 5 writes RoPE settings as `rope_parameters`: one object (`rope_type`,
/// `rope_theta`, scaling fields) or, for models with two kinds of layers, one object per
/// layer type. Returns the settings of the global (full-attention) layers and of the
/// sliding-window layers.
fn rope_parameters<'a>(cfg: &Config<'a>) -> (Option<Config<'a>>, Option<Config<'a>>) {
    let Some(map) = cfg.map.get("rope_parameters").and_then(Value::as_object) else {
        return (None, None);
    };
    let sub = |m: &'a Map<String, Value>| Config {
        path: cfg.path,
        map: m,
    };
    let per_type = |k: &str| map.get(k).and_then(Value::as_object).map(sub);
    match (per_type("full_attention"), per_type("sliding_attention")) {
        (None, None) => (Some(sub(map)), None),
        (g, l) => (g, l),
    }
}

/// The family-specific keys of `spec` (`hf_keys`, else `hf_defaults`). Gemma 3's window
/// `key` of config.json, else `sub_key` of transformers 5's `rope_parameters` (of its
/// sliding-window part when `local`).
fn rope_f64(cfg: &Config, key: &str, local: bool, sub_key: &str) -> Result<Option<f64>> {
    if let Some(v) = cfg.f64_opt(key)? {
        return Ok(Some(v));
    }
    let (global, sliding) = rope_parameters(cfg);
    match if local { sliding } else { global } {
        Some(sub) => sub.f64_opt(sub_key),
        None => Ok(None),
    }
}

/// The `config.json` key of a family's `hf_keys` entry: the first of its `|`-separated
/// names that the file has (transformers 5 writes Qwen 3 MoE's `num_experts` as
/// `num_local_experts`), else the first.
fn hf_key<'k>(cfg: &Config, key: &'k str) -> &'k str {
    let mut names = key.split('|');
    let first = names.next().unwrap_or(key);
    std::iter::once(first)
        .chain(names)
        .find(|k| cfg.get(k).is_some())
        .unwrap_or(first)
}

/// The family's hyperparameters from `config.json` into `md` (its `hf_keys`, then its
/// `hf_defaults` for what the file lacks). The sliding-window pattern comes from
/// `layer_types` when the config lists them (transformers ≥ 4.53), else from
/// `sliding_window_pattern`.
fn family_hparams(cfg: &Config, spec: &FamilySpec, md: &mut Metadata) -> Result<()> {
    if !spec.hf_stacked.is_empty() {
        // every block has experts: a config whose blocks alternate with dense ones
        // (Qwen 3 MoE's decoder_sparse_step, mlp_only_layers) describes another graph
        let sparse_step = cfg.u64_opt("decoder_sparse_step")?;
        let dense_layers = cfg
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        if sparse_step.is_some_and(|s| s != 1) || dense_layers {
            return Err(cfg.err(
                "decoder_sparse_step other than 1 or a non-empty mlp_only_layers: blocks \
                 without experts are not supported (every block of a Qwen 3 MoE release has them)"
                    .into(),
            ));
        }
    }
    if spec.hf_keys.contains_key("model.no_rope_layer_step") {
        no_rope_pattern(cfg)?;
    }
    for (canon, key) in &spec.hf_keys {
        let key = hf_key(cfg, key);
        // Qwen2 configs carry a sliding_window that only applies with use_sliding_window
        if canon == "model.sliding_window" && cfg.bool_opt("use_sliding_window")? == Some(false) {
            continue;
        }
        let v = match canon.as_str() {
            "model.sliding_window_pattern" if cfg.get("layer_types").is_some() => {
                Some(MetaValue::U64(window_pattern(cfg)?))
            }
            "model.rope_theta_local" => rope_f64(cfg, key, true, "rope_theta")?.map(MetaValue::F64),
            // Phi-3: RoPE on the first partial_rotary_factor × head_dim dimensions
            // (transformers ≥ 5 puts the factor into rope_parameters)
            "model.rope_dims" => {
                match (rope_f64(cfg, key, false, key)?, md.get("model.head_dim")) {
                    (Some(f), Some(MetaValue::U64(hd))) => {
                        let dims = (*hd as f64 * f).round();
                        if !(f > 0.0 && f <= 1.0) || dims < 2.0 || dims % 2.0 != 0.0 {
                            return Err(cfg.err(format!(
                                "{key} = {f} does not give an even number of rotated \
                                 dimensions of head_dim {hd}"
                            )));
                        }
                        Some(MetaValue::U64(dims as u64))
                    }
                    _ => None,
                }
            }
            // a key the family declares an unsigned integer (a count, a size) must be one in
            // config.json: a negative or fractional number is the input's error, named here,
            // not the self-check's after writing
            _ if spec.required_metadata.get(canon).map(String::as_str) == Some("u64") => {
                cfg.u64_opt(key)?.map(MetaValue::U64)
            }
            _ => match cfg.get(key) {
                Some(Value::Bool(b)) => Some(MetaValue::Bool(*b)),
                Some(Value::Number(_)) => match cfg.u64_opt(key) {
                    Ok(Some(u)) => Some(MetaValue::U64(u)),
                    _ => cfg.f64_opt(key)?.map(MetaValue::F64),
                },
                Some(v) => return Err(cfg.err(format!("{key} = {v} is not a number"))),
                None => None,
            },
        };
        if let Some(v) = v {
            md.insert(canon.clone(), crate::gguf::as_declared(spec, canon, v));
        }
    }
    for (canon, v) in &spec.hf_defaults {
        if !md.contains_key(canon) {
            if let Some(v) = crate::gguf::json_to_meta(v) {
                md.insert(canon.clone(), crate::gguf::as_declared(spec, canon, v));
            }
        }
    }
    Ok(())
}

/// SmolLM3's NoPE blocks: `no_rope_layers` (1: RoPE, 0: none), when listed, must be the
/// pattern of `no_rope_layer_interval` (default 4) that the format records as one step; a
/// sliding window (`use_sliding_window`: transformers applies it to the NoPE blocks only) is
/// refused.
fn no_rope_pattern(cfg: &Config) -> Result<()> {
    if cfg.bool_opt("use_sliding_window")? == Some(true) {
        return Err(cfg.err(
            "use_sliding_window true: SmolLM3's window on its NoPE layers is not supported \
             (SmolLM3-3B has it off)"
                .into(),
        ));
    }
    let step = cfg.u64_opt("no_rope_layer_interval")?.unwrap_or(4);
    if step == 0 {
        return Err(cfg.err("no_rope_layer_interval 0: expected a period of at least 1".into()));
    }
    if let Some(list) = cfg.get("no_rope_layers").and_then(Value::as_array) {
        let layers = cfg.u64_opt("num_hidden_layers")?.unwrap_or(0);
        if list.len() as u64 != layers {
            return Err(cfg.err(format!(
                "no_rope_layers lists {} layers, num_hidden_layers is {layers}",
                list.len()
            )));
        }
        let want = |i: usize| u64::from(!(i as u64 + 1).is_multiple_of(step));
        let bad = list
            .iter()
            .enumerate()
            .find(|(i, v)| v.as_u64() != Some(want(*i)));
        if let Some((i, v)) = bad {
            return Err(cfg.err(format!(
                "no_rope_layers[{i}] is {v}, not {} as no_rope_layer_interval {step} gives: \
                 only a NoPE block every {step} blocks is supported",
                want(i)
            )));
        }
    }
    Ok(())
}

/// The period `p` of `layer_types`: layer `i` is `full_attention` exactly when
/// `(i + 1) % p == 0` (0: every layer is `sliding_attention`).
fn window_pattern(cfg: &Config) -> Result<u64> {
    let types: Vec<&str> = cfg
        .get("layer_types")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let full = |i: usize| types[i] == "full_attention";
    let p = (0..types.len()).find(|&i| full(i)).map_or(0, |i| i + 1);
    let fits = (0..types.len()).all(|i| {
        let want_full = p != 0 && (i + 1) % p == 0;
        full(i) == want_full && (want_full || types[i] == "sliding_attention")
    });
    if !fits {
        return Err(cfg.err(format!(
            "layer_types {types:?} is not a repeating pattern of sliding_attention layers \
             with every p-th layer full_attention"
        )));
    }
    Ok(p as u64)
}

/// The per-expert tensors `parts` of one block as the stacked `[n_expert, rows, cols]`
/// tensor `name` ([`crate::source::stack_experts`]).
fn stack_experts(
    name: String,
    parts: Vec<(u64, RawTensor)>,
    n_expert: u64,
) -> Result<SourceTensor> {
    let parts = parts
        .into_iter()
        .map(|(e, t)| {
            let name = t.name.clone();
            Ok((e, source_tensor(t, name, Transform::None)?))
        })
        .collect::<Result<Vec<_>>>()?;
    crate::source::stack_experts(name, parts, n_expert, "config.json's expert count").map_err(|e| {
        SafetensorsError::Tensor {
            path: e.path,
            tensor: e.tensor,
            reason: e.reason,
        }
    })
}

/// gpt-oss's experts, which Hugging Face stores fused per block (`mlp.experts.gate_up_proj
/// [E, d, 2 ff]` with gate and up in alternate columns, `down_proj [E, ff, d]`, both as
/// `x @ W`; in the published checkpoints MXFP4 `*_blocks` and `*_scales` with rows already
/// outputs, gate and up rows alternating), as GGUF's `ffn_{gate,up,down}_exps` weights and
/// the gate/up biases: what llama.cpp's `convert_hf_to_gguf.py` writes, MXFP4 kept as MXFP4.
/// Returns the other tensors and these.
fn gpt_oss_experts(
    raw: Vec<RawTensor>,
    md: &Metadata,
) -> Result<(Vec<RawTensor>, Vec<SourceTensor>)> {
    let dim = |k: &str| meta_u64(md, k).unwrap_or(0);
    let (n_expert, d, ff) = (
        dim("model.n_expert"),
        dim("model.n_embd"),
        dim("model.n_ff_exp"),
    );
    const PRE: &str = "model.layers.{N}.mlp.experts.";
    let mut rest = Vec::with_capacity(raw.len());
    // (block, role) -> the stored tensor
    let mut found: BTreeMap<(u64, &'static str), RawTensor> = BTreeMap::new();
    for t in raw {
        let role = [
            "gate_up_proj",
            "gate_up_proj_bias",
            "gate_up_proj_blocks",
            "gate_up_proj_scales",
            "down_proj",
            "down_proj_blocks",
            "down_proj_scales",
        ]
        .into_iter()
        .find_map(|r| match_pattern(&format!("{PRE}{r}"), &t.name).map(|n| (n, r)));
        match role {
            Some((Some(n), r)) => {
                found.insert((n, r), t);
            }
            _ => rest.push(t),
        }
    }
    let bad = |t: &RawTensor, reason: String| SafetensorsError::Tensor {
        path: t.file.path.clone(),
        tensor: t.name.clone(),
        reason,
    };
    let dims = ExpertDims { n_expert, d, ff };
    if let Some(t) = found
        .values()
        .next()
        .filter(|_| n_expert == 0 || d == 0 || ff == 0)
    {
        return Err(bad(
            t,
            format!(
                "config.json's num_local_experts {n_expert}, hidden_size {d} and \
                 intermediate_size {ff} must all be at least 1"
            ),
        ));
    }
    let want = |t: &RawTensor, shape: &[u64], dtypes: &[StDtype]| dims.check(t, shape, dtypes);
    let float = [StDtype::F32, StDtype::F16, StDtype::BF16];
    let blocks: BTreeSet<u64> = found.keys().map(|(n, _)| *n).collect();
    let mut out = Vec::new();
    // each fused matrix as stored (`x @ W`: [E, inputs, outputs], gate and up outputs
    // alternating) or as MXFP4 blocks and scales (rows are outputs); the parts it splits into
    let fused = [
        (
            "gate_up_proj",
            "gate_up_proj_blocks",
            "gate_up_proj_scales",
            d,
            2 * ff,
            &["gate", "up"][..],
        ),
        (
            "down_proj",
            "down_proj_blocks",
            "down_proj_scales",
            ff,
            d,
            &["down"][..],
        ),
    ];
    for n in blocks {
        let mut take = |r| found.remove(&(n, r));
        let name = |role: &str, what: &str| format!("blk.{n}.ffn_{role}_exps.{what}");
        for (base, base_blocks, base_scales, inputs, outputs, roles) in fused {
            let step = roles.len() as u64;
            let parts = roles.iter().zip(0..);
            match (take(base), take(base_blocks), take(base_scales)) {
                (Some(t), None, None) => {
                    want(&t, &[n_expert, inputs, outputs], &float)?;
                    for (role, part) in parts {
                        let w = name(role, "weight");
                        out.push(columns(&t, w, n_expert, inputs, outputs, step, part)?);
                    }
                }
                (None, Some(b), Some(sc)) => {
                    for (role, part) in parts {
                        let w = name(role, "weight");
                        out.push(mxfp4(&b, &sc, w, &dims, outputs, inputs, (step, part))?);
                    }
                }
                // none: the check for required tensors names what is missing
                (None, None, None) => {}
                (t, b, sc) => {
                    let t = t.or(b).or(sc).expect("not all three are None");
                    return Err(bad(
                        &t,
                        format!("{base} needs either the weight or both its _blocks and _scales"),
                    ));
                }
            }
        }
        // gate_up's bias: gate the even entries, up the odd ones (down_proj_bias is mapped
        // by name, formats/gpt_oss.json)
        if let Some(t) = take("gate_up_proj_bias") {
            want(&t, &[n_expert, 2 * ff], &float)?;
            for (role, part) in [("gate", 0), ("up", 1)] {
                out.push(columns(
                    &t,
                    name(role, "bias"),
                    n_expert,
                    1,
                    2 * ff,
                    2,
                    part,
                )?);
            }
        }
    }
    Ok((rest, out))
}

/// [`Gather::Columns`] of the float tensor `t` (`n` matrices of `rows x cols`): the columns
/// `part`, `part + step`, ..., transposed.
fn columns(
    t: &RawTensor,
    name: String,
    n: u64,
    rows: u64,
    cols: u64,
    step: u64,
    part: u64,
) -> Result<SourceTensor> {
    let dtype = gds_dtype(t.st_dtype).expect("checked float");
    let shape = if rows == 1 {
        vec![n, cols / step]
    } else {
        vec![n, cols / step, rows]
    };
    let nbytes = dtype
        .tensor_bytes(&shape)
        .expect("a part of a stored tensor");
    Ok(SourceTensor {
        name,
        source_name: format!(
            "{}{}",
            t.name,
            match (step, part) {
                (1, _) => " (transposed)".to_string(),
                (_, 0) => " (its even columns: gate)".to_string(),
                _ => " (its odd columns: up)".to_string(),
            }
        ),
        dtype,
        shape,
        file: t.file.clone(),
        offset: t.offset,
        nbytes,
        transform: Transform::None,
        layout: Layout::Gathered(Gather::Columns {
            n,
            rows,
            cols,
            elem: dtype.row_bytes(1).expect("a float type"),
            step,
            part,
        }),
    })
}

/// A gpt-oss block's expert dimensions, from config.json.
struct ExpertDims {
    n_expert: u64,
    d: u64,
    ff: u64,
}

impl ExpertDims {
    /// That `t` has `shape` and one of `dtypes`, else an error naming the config's values.
    fn check(&self, t: &RawTensor, shape: &[u64], dtypes: &[StDtype]) -> Result<()> {
        if t.shape == shape && dtypes.contains(&t.st_dtype) {
            return Ok(());
        }
        let names: Vec<String> = dtypes.iter().map(ToString::to_string).collect();
        Err(SafetensorsError::Tensor {
            path: t.file.path.clone(),
            tensor: t.name.clone(),
            reason: format!(
                "shape {:?} {} where config.json (num_local_experts {}, hidden_size {}, \
                 intermediate_size {}) needs {shape:?} {}",
                t.shape,
                t.st_dtype,
                self.n_expert,
                self.d,
                self.ff,
                names.join(" or ")
            ),
        })
    }
}

/// [`Gather::Mxfp4`] of the blocks `b` and scales `sc` of the experts' matrices of `rows x
/// cols`: the rows `part`, `part + step`, ... (`(step, part)`).
fn mxfp4(
    b: &RawTensor,
    sc: &RawTensor,
    name: String,
    dims: &ExpertDims,
    rows: u64,
    cols: u64,
    (step, part): (u64, u64),
) -> Result<SourceTensor> {
    let n = dims.n_expert;
    let groups = cols / 32;
    if !cols.is_multiple_of(32) {
        return Err(SafetensorsError::Tensor {
            path: b.file.path.clone(),
            tensor: b.name.clone(),
            reason: format!("MXFP4 rows of {cols} values are not whole blocks of 32"),
        });
    }
    dims.check(b, &[n, rows, groups, 16], &[StDtype::U8])?;
    dims.check(sc, &[n, rows, groups], &[StDtype::U8])?;
    let shape = vec![n, rows / step, cols];
    let nbytes = DType::MXFP4
        .tensor_bytes(&shape)
        .expect("a part of a stored tensor");
    Ok(SourceTensor {
        name,
        source_name: format!(
            "{} with {}{}",
            b.name,
            sc.name,
            match (step, part) {
                (1, _) => "",
                (_, 0) => " (the even rows: gate)",
                _ => " (the odd rows: up)",
            }
        ),
        dtype: DType::MXFP4,
        shape,
        file: b.file.clone(),
        offset: b.offset,
        nbytes,
        transform: Transform::None,
        layout: Layout::Gathered(Gather::Mxfp4 {
            scales: sc.file.clone(),
            scales_offset: sc.offset,
            n,
            rows,
            groups,
            step,
            part,
        }),
    })
}

fn map_llama(
    input: &Path,
    raw: Vec<RawTensor>,
    gathered: Vec<SourceTensor>,
    md: &Metadata,
    tie_in_config: bool,
    spec: &FamilySpec,
    warnings: &mut Vec<String>,
) -> Result<Vec<SourceTensor>> {
    let dim = |k: &str| meta_u64(md, k).unwrap_or(0);
    let (n_layers, n_heads, n_kv_heads, head_dim, vocab) = (
        dim("model.n_layers"),
        dim("model.n_heads"),
        dim("model.n_kv_heads"),
        dim("model.head_dim"),
        dim("model.vocab_size"),
    );
    let mut out = gathered;
    let mut ignored = BTreeSet::new();
    let mut unmapped = Vec::new();
    // per-expert tensors, by the canonical stacked tensor they go into
    let mut experts: BTreeMap<String, Vec<(u64, RawTensor)>> = BTreeMap::new();
    for t in raw {
        if let Some((canon, n, e)) = spec
            .hf_stacked
            .iter()
            .find_map(|(canon, hf)| match_expert(hf, &t.name).map(|(n, e)| (canon, n, e)))
        {
            experts.entry(fill(canon, n)).or_default().push((e, t));
            continue;
        }
        if spec
            .ignored_tensors
            .iter()
            .any(|p| match_pattern(p, &t.name).is_some())
        {
            ignored.insert(t.name);
            continue;
        }
        if t.name == "lm_head.weight" && tie_in_config {
            warnings.push(format!(
                "{}: lm_head.weight dropped: tie_word_embeddings is true, so the output \
                 projection is the token embedding",
                t.file.path.display()
            ));
            continue;
        }
        let canonical = spec
            .tensors
            .iter()
            .find_map(|(hf, canon)| match_pattern(hf, &t.name).map(|n| fill(canon, n)));
        let Some(canonical) = canonical else {
            unmapped.push(t.name.clone());
            let name = t.name.clone();
            out.push(source_tensor(t, name, Transform::None)?);
            continue;
        };
        let mut transform = Transform::None;
        if let Some(pat) = spec
            .rope_permuted
            .iter()
            .find(|p| match_pattern(p, &canonical).is_some())
        {
            let (n_head, key) = if pat.contains("attn_k") {
                (n_kv_heads, "num_key_value_heads")
            } else {
                (n_heads, "num_attention_heads")
            };
            let want = n_head * head_dim;
            let rows = t.shape.first().copied().unwrap_or(0);
            let shape_ok = match t.shape.len() {
                1 => pat.ends_with(".bias"),
                2 => true,
                _ => false,
            };
            if !shape_ok || rows != want || rows.checked_rem(2 * n_head) != Some(0) {
                return Err(SafetensorsError::Tensor {
                    path: t.file.path.clone(),
                    tensor: t.name.clone(),
                    reason: format!(
                        "shape {:?} does not fit config.json: expected {want} rows \
                         ({key} {n_head} × head_dim {}), an even number per head",
                        t.shape, head_dim
                    ),
                });
            }
            transform = Transform::PermuteRope { n_head };
        }
        if FamilySpec::matches(&spec.hf_norm_offset, &canonical) {
            transform = Transform::NormOffset;
        }
        if canonical == "token_embd.weight" && t.shape.first() != Some(&vocab) {
            return Err(SafetensorsError::Tensor {
                path: t.file.path.clone(),
                tensor: t.name.clone(),
                reason: format!(
                    "shape {:?} does not match config.json's vocab_size {}",
                    t.shape, vocab
                ),
            });
        }
        out.push(source_tensor(t, canonical, transform)?);
    }
    if !ignored.is_empty() {
        warnings.push(format!(
            "ignored {} tensor(s) not needed by gdsrun: {}",
            ignored.len(),
            ignored.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if !unmapped.is_empty() {
        warnings.push(format!(
            "{} tensor(s) have no canonical {} name and keep their original names: {}",
            unmapped.len(),
            spec.family,
            unmapped.join(", ")
        ));
    }
    for (name, parts) in experts {
        out.push(stack_experts(name, parts, dim("model.n_expert"))?);
    }
    crate::source::split_fused(&mut out, spec, |sym| {
        gds_format::arch::shape_symbol(sym, |k| meta_u64(md, k))
    })
    .map_err(|e| SafetensorsError::Tensor {
        path: e.path,
        tensor: e.tensor,
        reason: e.reason,
    })?;
    let present: BTreeSet<&str> = out.iter().map(|t| t.name.as_str()).collect();
    let required = spec
        .required_tensors
        .global
        .iter()
        .map(|p| (p, None))
        .chain((0..n_layers).flat_map(|n| {
            spec.required_tensors
                .block
                .iter()
                .map(move |p| (p, Some(n)))
        }));
    for (pattern, n) in required {
        let canonical = fill(pattern, n);
        if !present.contains(canonical.as_str()) {
            let source_name = spec
                .tensors
                .iter()
                .find(|(_, c)| *c == pattern)
                .map(|(hf, _)| fill(hf, n))
                .unwrap_or_else(|| canonical.clone());
            return Err(SafetensorsError::MissingTensor {
                path: input.to_owned(),
                tensor: canonical,
                source_name,
            });
        }
    }
    sort_tensors(&mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numpy formula, written with explicit indices: out[h, i, j] = in[h, j, i] for a
    /// (n_head, 2, half) → (n_head, half, 2) swap of the row index.
    fn numpy_permute(rows: &[u32], n_head: usize) -> Vec<u32> {
        let half = rows.len() / n_head / 2;
        // reshape(n_head, 2, half) then swapaxes(1, 2) then reshape back
        let mut out = Vec::new();
        for h in 0..n_head {
            for i in 0..half {
                for j in 0..2 {
                    out.push(rows[(h * 2 + j) * half + i]);
                }
            }
        }
        out
    }

    #[test]
    fn permute_matches_convert_hf_to_gguf() {
        // 8 rows, 2 heads of 4 rows, 3 bytes per row; row r is filled with byte r.
        let rows = 8;
        let bytes: Vec<u8> = (0..rows as u8).flat_map(|r| [r; 3]).collect();
        let out = permute_rope_rows(&bytes, rows, 3, 2);
        let order: Vec<u8> = out.chunks(3).map(|c| c[0]).collect();
        // numpy: np.arange(8).reshape(2, 2, 2, 1).swapaxes(1, 2).reshape(8)
        //        == [0, 2, 1, 3, 4, 6, 5, 7]
        assert_eq!(order, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(out.chunks(3).all(|c| c[0] == c[1] && c[1] == c[2]));

        // 24 rows, 3 heads (half = 4): np.arange(24).reshape(3,2,4).swapaxes(1,2).reshape(24)
        let ids: Vec<u32> = (0..24).collect();
        let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = permute_rope_rows(&bytes, 24, 4, 3);
        let got: Vec<u32> = out
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15, 16, 20, 17, 21, 18, 22, 19,
                23
            ]
        );
        assert_eq!(got, numpy_permute(&ids, 3));
    }

    #[test]
    fn permute_one_head_and_bias_rows() {
        // a bias: one 2-byte element per row, one head of 4 rows
        let bytes = [0u8, 0, 1, 1, 2, 2, 3, 3];
        assert_eq!(permute_rope_rows(&bytes, 4, 2, 1), [0, 0, 2, 2, 1, 1, 3, 3]);
        assert!(permute_rope_rows(&[], 0, 16, 4).is_empty());
    }

    #[test]
    #[should_panic(expected = "multiple of 2")]
    fn permute_rejects_odd_heads() {
        permute_rope_rows(&[0; 6], 6, 1, 2);
    }

    #[test]
    fn spec_and_patterns() {
        let spec = llama_spec();
        assert!(spec
            .hf_architectures
            .iter()
            .any(|a| a == "LlamaForCausalLM"));
        assert_eq!(
            match_pattern(
                "model.layers.{N}.mlp.up_proj.weight",
                "model.layers.12.mlp.up_proj.weight"
            ),
            Some(Some(12))
        );
        assert_eq!(
            match_pattern(
                "model.layers.{N}.mlp.up_proj.weight",
                "model.layers.01.mlp.up_proj.weight"
            ),
            None
        );
        assert_eq!(
            match_pattern("model.norm.weight", "model.norm.weight"),
            Some(None)
        );
        assert_eq!(
            fill("blk.{N}.attn_q.weight", Some(3)),
            "blk.3.attn_q.weight"
        );
    }

    #[test]
    fn order_puts_embedding_first_then_layers_then_head() {
        let mut names = vec![
            "output.weight",
            "blk.10.attn_q.weight",
            "blk.2.ffn_up.weight",
            "token_embd.weight",
            "blk.2.attn_k.weight",
            "output_norm.weight",
        ];
        names.sort_by_key(|n| order_key(n));
        assert_eq!(
            names,
            [
                "token_embd.weight",
                "blk.2.attn_k.weight",
                "blk.2.ffn_up.weight",
                "blk.10.attn_q.weight",
                "output.weight",
                "output_norm.weight"
            ]
        );
    }

    #[test]
    fn dtype_bits_cover_safetensors_names() {
        assert_eq!(dtype_bits("BF16"), Some(16));
        assert_eq!(dtype_bits("F4"), Some(4));
        assert_eq!(dtype_bits("I64"), Some(64));
        assert_eq!(dtype_bits("Q4"), None);
    }
}
