//! GGUF input: metadata and tensor offsets come from `gguf-rs`; byte sizes come from our own
//! ggml type table (gguf-rs miscomputes some), and every tensor is bounds-checked against the
//! memory-mapped file before anything reads it.

use crate::error::{io, ConvertError};
use crate::limits::MAX_GGUF_ARRAY_ELEMENTS;
use crate::names::{canonical_family, group_of};
use crate::source::{
    Layout, MappedFile, MetaValue, Metadata, PendingTokenizer, Source, SourceTensor,
    TokenizerFiles, Transform,
};
use gds_format::DType;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// What a prescan read is, for its error message: written only when one is needed (a
/// 262k-token vocabulary is 262k reads).
struct Described<'a>(&'static str, &'a str);

impl std::fmt::Display for Described<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.0, self.1)
    }
}

/// A vocabulary array of the header (`tokenizer.ggml.tokens`, `scores`, `token_type`,
/// `merges`, of the element type llama.cpp reads), found by the prescan: gguf-rs would
/// decode each of its elements into a JSON value (numbers as strings, with serde_json's
/// `arbitrary_precision`, which it enables), so it is hidden from gguf-rs and read in place
/// by the tokenizer export instead.
#[derive(Clone, Copy, Debug)]
struct VocabArray {
    /// Which key: 0 tokens, 1 scores, 2 token_type, 3 merges.
    which: usize,
    /// Byte position of the value's type field (the array's element type and length follow).
    value_at: usize,
    /// Byte position just past the array.
    end: usize,
    count: u64,
}

/// The keys of [`VocabArray`] and the element type llama.cpp reads each as.
const VOCAB_ARRAYS: [(&str, u32); 4] = [
    ("tokenizer.ggml.tokens", 8),
    ("tokenizer.ggml.scores", 6),
    ("tokenizer.ggml.token_type", 5),
    ("tokenizer.ggml.merges", 8),
];

/// Reads the header for gguf-rs (from after the magic) with every [`VocabArray`] replaced by
/// a string value of the same byte length (type, length, spaces): gguf-rs's byte count, and
/// so its data offset, stay those of the file.
struct HidingReader {
    file: Arc<MappedFile>,
    pos: usize,
    hidden: Vec<VocabArray>,
}

impl std::io::Read for HidingReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let pos = self.pos;
        let b: &[u8] = &self.file.map;
        if out.is_empty() || pos >= b.len() {
            return Ok(0);
        }
        let n = if let Some(h) = self
            .hidden
            .iter()
            .find(|h| h.value_at <= pos && pos < h.end)
        {
            let len = h.end - h.value_at;
            let mut head = [0u8; 12];
            head[..4].copy_from_slice(&8u32.to_le_bytes());
            head[4..].copy_from_slice(&(len as u64 - 12).to_le_bytes());
            let n = out.len().min(h.end - pos);
            let at = pos - h.value_at;
            // the type and length where they fall in this read, spaces after them
            let from_head = head.get(at..).unwrap_or_default();
            let k = from_head.len().min(n);
            out[..k].copy_from_slice(&from_head[..k]);
            out[k..n].fill(b' ');
            n
        } else {
            let next = self
                .hidden
                .iter()
                .map(|h| h.value_at)
                .filter(|&at| at > pos)
                .min()
                .unwrap_or(b.len());
            let n = out.len().min(next - pos);
            out[..n].copy_from_slice(&b[pos..pos + n]);
            n
        };
        self.pos += n;
        Ok(n)
    }
}

/// The hidden arrays' contents, borrowed from the file (`b`, which the prescan checked).
fn vocab_arrays<'a>(
    b: &'a [u8],
    hidden: &[VocabArray],
) -> Result<crate::tokenizer::VocabArrays<'a>, String> {
    let mut out = crate::tokenizer::VocabArrays::default();
    for h in hidden {
        let key = VOCAB_ARRAYS[h.which].0;
        let bad = || format!("{key}: the array cannot be read back");
        let data = b.get(h.value_at + 16..h.end).ok_or_else(bad)?;
        let count = usize::try_from(h.count).map_err(|_| bad())?;
        let strings = |mut d: &'a [u8]| -> Result<Vec<&'a str>, String> {
            let mut v = Vec::with_capacity(count);
            for i in 0..count {
                let (len, rest) = d.split_first_chunk::<8>().ok_or_else(bad)?;
                let len = usize::try_from(u64::from_le_bytes(*len)).map_err(|_| bad())?;
                let (s, rest) = rest.split_at_checked(len).ok_or_else(bad)?;
                v.push(
                    std::str::from_utf8(s)
                        .map_err(|e| format!("{key}: element {i} is not UTF-8 ({e})"))?,
                );
                d = rest;
            }
            Ok(v)
        };
        let words = |d: &[u8]| -> Result<Vec<[u8; 4]>, String> {
            let (words, rest) = d.as_chunks::<4>();
            if words.len() != count || !rest.is_empty() {
                return Err(bad());
            }
            Ok(words.to_vec())
        };
        match h.which {
            0 => out.tokens = Some(strings(data)?),
            1 => out.scores = Some(words(data)?.into_iter().map(f32::from_le_bytes).collect()),
            2 => out.token_type = Some(words(data)?.into_iter().map(i32::from_le_bytes).collect()),
            _ => out.merges = Some(strings(data)?),
        }
    }
    Ok(out)
}

/// Walks the GGUF header (key/values and tensor infos) checking every count and length
/// against the file size, the array elements against [`MAX_GGUF_ARRAY_ELEMENTS`], and every
/// key for duplicates, so that `gguf-rs` (which allocates by the lengths it reads, keeps the
/// last of two equal keys, and panics on a few type ids) only ever sees a well-formed header
/// whose decoding takes bounded memory.
/// Returns where the vocabulary arrays lie ([`VocabArray`]).
fn prescan(bytes: &[u8]) -> Result<Vec<VocabArray>, String> {
    struct Cur<'a> {
        b: &'a [u8],
        pos: usize,
        /// Array elements seen so far.
        elements: u64,
    }
    impl Cur<'_> {
        fn take(&mut self, n: u64, what: &dyn std::fmt::Display) -> Result<&[u8], String> {
            let end = (self.pos as u64)
                .checked_add(n)
                .filter(|&e| e <= self.b.len() as u64);
            match end {
                Some(e) => {
                    let s = &self.b[self.pos..e as usize];
                    self.pos = e as usize;
                    Ok(s)
                }
                None => Err(format!(
                    "truncated: {what} at byte {} needs {n} bytes, file has {}",
                    self.pos,
                    self.b.len()
                )),
            }
        }
        fn u32(&mut self, what: &dyn std::fmt::Display) -> Result<u32, String> {
            Ok(u32::from_le_bytes(
                self.take(4, what)?.try_into().unwrap_or_default(),
            ))
        }
        fn u64(&mut self, what: &dyn std::fmt::Display) -> Result<u64, String> {
            Ok(u64::from_le_bytes(
                self.take(8, what)?.try_into().unwrap_or_default(),
            ))
        }
        /// A string's bytes (its u64 length, then that many bytes), not checked for UTF-8.
        fn bytes(&mut self, what: &dyn std::fmt::Display) -> Result<&[u8], String> {
            let n = self.u64(what)?;
            self.take(n, what)
        }
        fn string(&mut self, what: &dyn std::fmt::Display) -> Result<&str, String> {
            let s = self.bytes(what)?;
            std::str::from_utf8(s).map_err(|_| format!("{what} is not UTF-8"))
        }
        /// Skips a value of type `t`; for an array, returns its element type and length.
        fn value(&mut self, t: u32, key: &str, depth: u32) -> Result<Option<(u32, u64)>, String> {
            let scalar = |t: u32| -> Option<u64> {
                Some(match t {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    _ => return None,
                })
            };
            match t {
                8 => {
                    self.string(&Described("value of", key))?;
                }
                9 => {
                    if depth > 2 {
                        return Err(format!("key {key:?}: arrays nested too deep"));
                    }
                    let et = self.u32(&Described("array type of", key))?;
                    let n = self.u64(&Described("array length of", key))?;
                    // first what the file can hold, then what we accept to decode
                    let scalar_size = scalar(et);
                    match scalar_size {
                        Some(sz) => {
                            let total = n.checked_mul(sz).ok_or_else(|| {
                                format!("key {key:?}: array length {n} overflows")
                            })?;
                            self.take(total, &Described("array", key))?;
                        }
                        // each element takes at least 8 bytes (a string length)
                        None if n > (self.b.len() - self.pos) as u64 / 8 => {
                            return Err(format!("key {key:?}: array length {n} exceeds the file"));
                        }
                        None => {}
                    }
                    self.elements = self.elements.saturating_add(n);
                    if self.elements > MAX_GGUF_ARRAY_ELEMENTS {
                        return Err(format!(
                            "key {key:?}: array of {n} elements: the metadata arrays would hold more than the {MAX_GGUF_ARRAY_ELEMENTS} elements GdsLLM accepts"
                        ));
                    }
                    if scalar_size.is_none() {
                        if depth == 0 && et == 8 && VOCAB_ARRAYS.contains(&(key, 8)) {
                            // a vocabulary array: hidden from gguf-rs and read in place by
                            // the tokenizer export, which checks each text's UTF-8 itself
                            // (262k texts for Gemma 3: not twice on the conversion's
                            // serial path)
                            for _ in 0..n {
                                self.bytes(&Described("value of", key))?;
                            }
                        } else {
                            for _ in 0..n {
                                self.value(et, key, depth + 1)?;
                            }
                        }
                    }
                    return Ok(Some((et, n)));
                }
                t => {
                    let sz =
                        scalar(t).ok_or_else(|| format!("key {key:?}: unknown value type {t}"))?;
                    self.take(sz, &Described("value of", key))?;
                }
            }
            Ok(None)
        }
    }
    let mut c = Cur {
        b: bytes,
        pos: 0,
        elements: 0,
    };
    let magic = c.take(4, &"magic")?;
    if magic != GGUF_MAGIC {
        return Err(format!(
            "not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
        ));
    }
    let version = c.u32(&"version")?;
    if version != 2 && version != 3 {
        return Err(format!(
            "unsupported GGUF version {version} (supported: 2, 3)"
        ));
    }
    let n_tensors = c.u64(&"tensor count")?;
    let n_kv = c.u64(&"key/value count")?;
    if n_kv > bytes.len() as u64 / 12 || n_tensors > bytes.len() as u64 / 24 {
        return Err(format!(
            "header counts ({n_kv} key/values, {n_tensors} tensors) exceed the file size"
        ));
    }
    let mut keys = std::collections::HashSet::new();
    let mut vocab = Vec::new();
    for i in 0..n_kv {
        let key = c.string(&format_args!("key #{i}"))?.to_owned();
        if keys.contains(&key) {
            return Err(format!("metadata key {key:?} appears twice"));
        }
        let value_at = c.pos;
        let t = c.u32(&Described("type of", &key))?;
        if let Some((et, count)) = c.value(t, &key, 0)? {
            if let Some(which) = VOCAB_ARRAYS.iter().position(|&(k, e)| k == key && e == et) {
                vocab.push(VocabArray {
                    which,
                    value_at,
                    end: c.pos,
                    count,
                });
            }
        }
        keys.insert(key);
    }
    for i in 0..n_tensors {
        let name = c.string(&format_args!("name of tensor #{i}"))?.to_owned();
        let nd = c.u32(&Described("dimensions of", &name))?;
        if nd == 0 || nd > 4 {
            return Err(format!("tensor {name:?}: {nd} dimensions (1 to 4 allowed)"));
        }
        for _ in 0..nd {
            c.u64(&Described("shape of", &name))?;
        }
        let t = c.u32(&Described("type of", &name))?;
        if DType::from_id(t).is_none() {
            return Err(format!("tensor {name:?}: {}", unsupported_type(t)));
        }
        c.u64(&Described("offset of", &name))?;
    }
    Ok(vocab)
}

/// A JSON scalar as a manifest value (arrays and objects: `None`).
pub(crate) fn json_to_meta(v: &Value) -> Option<MetaValue> {
    match v {
        Value::Bool(b) => Some(MetaValue::Bool(*b)),
        Value::String(s) => Some(MetaValue::Str(s.clone())),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Some(MetaValue::U64(u))
            } else if let Some(i) = n.as_i64() {
                Some(MetaValue::I64(i))
            } else {
                n.as_f64().map(MetaValue::F64)
            }
        }
        _ => None,
    }
}

/// `v` as the type the family description declares for `key` (an integer where an f64 is
/// declared becomes that f64; anything else is kept and left to the checks).
pub(crate) fn as_declared(spec: &crate::names::FamilySpec, key: &str, v: MetaValue) -> MetaValue {
    match (spec.required_metadata.get(key).map(String::as_str), v) {
        (Some("f64"), MetaValue::U64(u)) => MetaValue::F64(u as f64),
        (Some("f64"), MetaValue::I64(i)) => MetaValue::F64(i as f64),
        (_, v) => v,
    }
}

/// An older Mixtral GGUF's per-expert tensors (`blk.N.ffn_gate.E.weight`, `ffn_up`,
/// `ffn_down`; llama.cpp's converter wrote them so before it stacked them, and llama.cpp still
/// reads both) as the stacked `blk.N.ffn_{gate,up,down}_exps.weight` `[experts, rows, cols]`
/// tensors of today's, each part in place in the file. Experts `0..n`, each once, one dtype
/// and shape, or an error naming the tensor.
fn stack_expert_tensors(path: &Path, tensors: &mut Vec<SourceTensor>) -> Result<(), ConvertError> {
    use std::collections::BTreeMap;
    let split = |name: &str| {
        ["ffn_gate", "ffn_up", "ffn_down"].iter().find_map(|role| {
            let (n, e) =
                crate::names::match_expert(&format!("blk.{{N}}.{role}.{{E}}.weight"), name)?;
            Some((format!("blk.{}.{role}_exps.weight", n?), e))
        })
    };
    let mut groups: BTreeMap<String, Vec<(u64, SourceTensor)>> = BTreeMap::new();
    let mut rest = Vec::with_capacity(tensors.len());
    for t in tensors.drain(..) {
        match split(&t.name) {
            Some((stacked, e)) => groups.entry(stacked).or_default().push((e, t)),
            None => rest.push(t),
        }
    }
    for (name, parts) in groups {
        let n = parts.len() as u64;
        let t =
            crate::source::stack_experts(name, parts, n, "its tensors' count").map_err(|e| {
                ConvertError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: e.tensor,
                    msg: e.reason,
                }
            })?;
        rest.push(t);
    }
    *tensors = rest;
    Ok(())
}

fn num_u64(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| *f >= 0.0 && f.fract() == 0.0)
            .map(|f| f as u64)
    })
}

fn num_f64(v: Option<&Value>) -> Option<f64> {
    v?.as_f64()
}

/// Reads a GGUF file into a [`Source`].
pub fn read_gguf(path: &Path) -> Result<Source, ConvertError> {
    let bad = |msg: String| ConvertError::BadInput {
        path: path.to_path_buf(),
        msg,
    };
    let first = open_shard(path)?;
    let shards = shard_paths_of(path, first.model.metadata())?;
    let mut tensors = Vec::with_capacity(first.model.tensors().len());
    shard_tensors(path, &first, &mut tensors)?;
    // the other shards of a split GGUF: their tensors, the metadata is the first's
    for (i, p) in shards.iter().enumerate().skip(1) {
        let shard = open_shard(p)?;
        let no = num_u64(shard.model.metadata().get(SPLIT_NO));
        let count = num_u64(shard.model.metadata().get(SPLIT_COUNT));
        if (no, count) != (Some(i as u64), Some(shards.len() as u64)) {
            return Err(ConvertError::BadInput {
                path: p.clone(),
                msg: format!(
                    "shard {} of {} by its name, but its metadata says split.no {no:?} of split.count {count:?} (shards of different splits mixed?)",
                    i + 1,
                    shards.len()
                ),
            });
        }
        shard_tensors(p, &shard, &mut tensors)?;
    }
    if shards.len() > 1 {
        if let Some(n) = num_u64(first.model.metadata().get(SPLIT_TENSORS)) {
            if n != tensors.len() as u64 {
                return Err(bad(format!(
                    "split.tensors.count is {n}, the {} shards hold {} tensors",
                    shards.len(),
                    tensors.len()
                )));
            }
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(t) = tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
            return Err(ConvertError::BadTensor {
                path: t.file.path.clone(),
                tensor: t.name.clone(),
                msg: "the tensor is in more than one shard".into(),
            });
        }
    }
    let Shard {
        file,
        hidden,
        model,
        ..
    } = first;
    let meta = model.metadata();

    let gguf_arch = meta
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let family = match canonical_family(&gguf_arch) {
        // llama.cpp runs Mixtral as `llama` with experts; here it is a family of its own
        // (the dense llama description requires a dense FFN)
        Some("llama")
            if num_u64(meta.get(&format!("{gguf_arch}.expert_count"))).is_some_and(|n| n > 0) =>
        {
            Some("mixtral")
        }
        f => f,
    };
    let runnable = family.is_some();
    let mut warnings = Vec::new();
    let mut hparam_origin = std::collections::BTreeMap::new();

    if family == Some("mixtral") {
        stack_expert_tensors(path, &mut tensors)?;
    }

    let mut metadata = Metadata::new();
    for (k, v) in meta {
        if k.starts_with("tokenizer.ggml.")
            || k == "tokenizer.chat_template"
            || k.starts_with("split.")
        {
            continue;
        }
        if let Some(mv) = json_to_meta(v) {
            metadata.insert(format!("gguf.{k}"), mv);
        }
    }
    if let Some(name) = meta.get("general.name").and_then(Value::as_str) {
        metadata.insert("general.name".into(), MetaValue::Str(name.into()));
    }
    // a reranker's prompt (llama.cpp's converter writes Qwen3-Reranker's as a named chat
    // template): kept under the format's own key, which the runtime reads
    if let Some(t) = meta
        .get("tokenizer.chat_template.rerank")
        .and_then(Value::as_str)
    {
        metadata.insert(
            gds_format::RERANK_TEMPLATE_KEY.into(),
            MetaValue::Str(t.into()),
        );
    }
    metadata.insert(
        "general.source_architecture".into(),
        MetaValue::Str(gguf_arch.clone()),
    );
    if let Some(fam) = family {
        metadata.insert("general.architecture".into(), MetaValue::Str(fam.into()));
        let a = &gguf_arch;
        let key = |k: &str| meta.get(&format!("{a}.{k}"));
        let need_u64 = |k: &str| {
            num_u64(key(k))
                .ok_or_else(|| bad(format!("metadata key {a}.{k} is missing or not an integer")))
        };
        let n_embd = need_u64("embedding_length")?;
        let n_heads = need_u64("attention.head_count")?;
        if n_heads == 0 || n_embd % n_heads != 0 {
            return Err(bad(format!(
                "{a}.attention.head_count {n_heads} does not divide embedding_length {n_embd}"
            )));
        }
        let n_kv = num_u64(key("attention.head_count_kv")).unwrap_or(n_heads);
        // The embedding's rows, when the file states no size: a vocabulary padded for the
        // matmuls has more rows than tokens, and the rows are what the model computes.
        let vocab = num_u64(key("vocab_size"))
            .or_else(|| {
                tensors
                    .iter()
                    .find(|t| t.name == "token_embd.weight")
                    .map(|t| t.shape[0])
            })
            .or_else(|| {
                // hidden from gguf-rs (see `VocabArray`) or, of another type, decoded by it
                hidden
                    .iter()
                    .find(|h| h.which == 0)
                    .map(|h| h.count)
                    .or_else(|| {
                        meta.get("tokenizer.ggml.tokens")
                            .and_then(Value::as_array)
                            .map(|a| a.len() as u64)
                    })
            })
            .ok_or_else(|| bad("cannot determine the vocabulary size".into()))?;
        for (canon, k) in [
            ("model.n_layers", "block_count"),
            ("model.n_embd", "embedding_length"),
            ("model.n_heads", "attention.head_count"),
            ("model.n_kv_heads", "attention.head_count_kv"),
            ("model.n_ff", "feed_forward_length"),
            ("model.vocab_size", "vocab_size"),
            ("model.head_dim", "attention.key_length"),
        ] {
            if key(k).is_some() {
                hparam_origin.insert(canon.to_string(), format!("{a}.{k}"));
            }
        }
        let head_dim = num_u64(key("attention.key_length")).unwrap_or(n_embd / n_heads);
        metadata.insert(
            "model.n_layers".into(),
            MetaValue::U64(need_u64("block_count")?),
        );
        metadata.insert("model.n_embd".into(), MetaValue::U64(n_embd));
        metadata.insert("model.n_heads".into(), MetaValue::U64(n_heads));
        metadata.insert("model.n_kv_heads".into(), MetaValue::U64(n_kv));
        metadata.insert(
            "model.n_ff".into(),
            MetaValue::U64(need_u64("feed_forward_length")?),
        );
        metadata.insert("model.vocab_size".into(), MetaValue::U64(vocab));
        metadata.insert(
            "model.context_length".into(),
            MetaValue::U64(num_u64(key("context_length")).unwrap_or(2048)),
        );
        metadata.insert("model.head_dim".into(), MetaValue::U64(head_dim));
        metadata.insert(
            "model.rope_theta".into(),
            MetaValue::F64(num_f64(key("rope.freq_base")).unwrap_or(10000.0)),
        );
        metadata.insert(
            "model.rms_norm_eps".into(),
            MetaValue::F64(
                num_f64(key("attention.layer_norm_rms_epsilon")).ok_or_else(|| {
                    bad(format!(
                        "metadata key {a}.attention.layer_norm_rms_epsilon is missing"
                    ))
                })?,
            ),
        );
        // Family-specific keys: from the GGUF where it has them, else the values llama.cpp
        // hard-codes for the architecture (formats/<family>.json).
        let spec = crate::names::family(fam)
            .ok_or_else(|| bad(format!("internal: no description of family {fam}")))?;
        for (canon, suffix) in &spec.gguf_keys {
            // a window of 0 is llama.cpp's "no window" (Phi-3 GGUFs write it)
            if canon == "model.sliding_window" && num_u64(key(suffix)) == Some(0) {
                continue;
            }
            if let Some(v) = key(suffix).and_then(json_to_meta) {
                hparam_origin.insert(canon.clone(), format!("{a}.{suffix}"));
                metadata.insert(canon.clone(), as_declared(spec, canon, v));
            }
        }
        for (canon, v) in &spec.gguf_defaults {
            if !metadata.contains_key(canon) {
                if let Some(v) = json_to_meta(v) {
                    metadata.insert(canon.clone(), as_declared(spec, canon, v));
                }
            }
        }
        let big = match fam {
            "gemma3" => Some(62),
            "gemma2" => Some(46),
            _ => None,
        };
        if let Some(big) = big {
            // llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA2/3): queries are scaled by
            // 1/sqrt(n_embd / n_head) for the 27B models (46 / 62 layers), else
            // 1/sqrt(head_dim); GGUF has no key for it.
            let n_layers = need_u64("block_count")?;
            let scalar = if n_layers == big {
                n_embd / n_heads
            } else {
                head_dim
            };
            metadata.insert(
                "model.query_pre_attn_scalar".into(),
                MetaValue::F64(scalar as f64),
            );
        }
        if a == "qwen2" {
            // llama.cpp writes qwen2 Q/K unpermuted and rotates them NEOX-style; canonical
            // GdsLLM layout is the permuted one (SPEC.md §6), so permute like an HF input.
            for t in &mut tensors {
                let heads = match t.name.rsplit_once('.').map(|(stem, _)| stem) {
                    Some(stem) if stem.ends_with(".attn_q") => n_heads,
                    Some(stem) if stem.ends_with(".attn_k") => n_kv,
                    _ => continue,
                };
                t.transform = Transform::PermuteRope { n_head: heads };
            }
        }
        crate::source::split_fused(&mut tensors, spec, |sym| {
            gds_format::arch::shape_symbol(sym, |key| crate::source::meta_u64(&metadata, key))
        })
        .map_err(|e| ConvertError::BadTensor {
            path: e.path,
            tensor: e.tensor,
            msg: e.reason,
        })?;
        let tied = !tensors.iter().any(|t| t.name == "output.weight");
        metadata.insert("model.tie_embeddings".into(), MetaValue::Bool(tied));
        match key("rope.scaling.type").and_then(Value::as_str) {
            Some("linear") => {
                metadata.insert(
                    "model.rope_scaling.type".into(),
                    MetaValue::Str("linear".into()),
                );
                metadata.insert(
                    "model.rope_scaling.factor".into(),
                    MetaValue::F64(num_f64(key("rope.scaling.factor")).unwrap_or(1.0)),
                );
            }
            Some("yarn") => {
                metadata.insert(
                    "model.rope_scaling.type".into(),
                    MetaValue::Str("yarn".into()),
                );
                for (canon, k) in [
                    ("model.rope_scaling.factor", "rope.scaling.factor"),
                    (
                        "model.rope_scaling.yarn_beta_fast",
                        "rope.scaling.yarn_beta_fast",
                    ),
                    (
                        "model.rope_scaling.yarn_beta_slow",
                        "rope.scaling.yarn_beta_slow",
                    ),
                ] {
                    if let Some(v) = num_f64(key(k)) {
                        metadata.insert(canon.into(), MetaValue::F64(v));
                    }
                }
                if let Some(v) = num_u64(key("rope.scaling.original_context_length")) {
                    metadata.insert(
                        "model.rope_scaling.original_context_length".into(),
                        MetaValue::U64(v),
                    );
                }
                // llama.cpp's other YaRN knobs change the arithmetic: not run rather than
                // run differently
                for (k, default) in [
                    ("rope.scaling.yarn_ext_factor", 1.0),
                    ("rope.scaling.yarn_log_mul", 0.0),
                ] {
                    if let Some(v) = num_f64(key(k)).filter(|&v| v != default) {
                        return Err(bad(format!(
                            "{a}.{k} = {v}: YaRN with it is not supported by gdsrun"
                        )));
                    }
                }
            }
            Some("none") | None => {}
            Some(other) => warnings.push(format!(
                "rope scaling type {other:?} is recorded but not applied by gdsrun"
            )),
        }
    } else {
        metadata.insert(
            "general.architecture".into(),
            MetaValue::Str(gguf_arch.clone()),
        );
        warnings.push(format!(
            "architecture {gguf_arch:?} is not supported by gdsrun; tensors are converted and grouped by layer index, but the model cannot be run"
        ));
    }
    if let Some(v) = num_u64(meta.get("tokenizer.ggml.bos_token_id")) {
        metadata.insert("tokenizer.bos_token_id".into(), MetaValue::U64(v));
    }
    if let Some(v) = num_u64(meta.get("tokenizer.ggml.eos_token_id")) {
        metadata.insert("tokenizer.eos_token_id".into(), MetaValue::U64(v));
    }
    if let Some(v) = meta
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
    {
        metadata.insert("tokenizer.add_bos".into(), MetaValue::Bool(v));
    }

    let has_tokenizer = meta.contains_key("tokenizer.ggml.model");
    if !has_tokenizer {
        warnings.push("the GGUF has no embedded tokenizer (tokenizer.ggml.model)".into());
    }

    tensors.sort_by(|a, b| {
        group_of(&a.name)
            .cmp(&group_of(&b.name))
            .then_with(|| a.name.cmp(&b.name))
    });
    // the export runs later (convert: beside the weights), on the decoded metadata and the
    // vocabulary arrays read in place
    let vocab_file = file.clone();
    let pending_tokenizer = has_tokenizer.then(|| {
        PendingTokenizer::new(move || {
            let export = vocab_arrays(&vocab_file.map, &hidden)
                .map_err(crate::tokenizer::TokenizerError::InvalidVocab)
                .and_then(|a| crate::tokenizer::tokenizer_from_gguf_with(model.metadata(), a));
            match export {
                Ok(export) => (
                    TokenizerFiles {
                        tokenizer_json: Some(export.tokenizer_json),
                        tokenizer_config_json: Some(export.tokenizer_config_json),
                        generation_config_json: None,
                        built: true,
                    },
                    Vec::new(),
                ),
                // Deferred: fatal only if the user does not supply a tokenizer.json instead.
                Err(e) => (
                    TokenizerFiles::default(),
                    vec![format!(
                        "tokenizer: the embedded vocabulary cannot be exported: {e}"
                    )],
                ),
            }
        })
    });
    Ok(Source {
        arch: family.map(str::to_string).unwrap_or(gguf_arch),
        runnable,
        metadata,
        hparam_origin,
        tensors,
        tokenizer: TokenizerFiles::default(),
        pending_tokenizer,
        warnings,
    })
}

/// llama.cpp's split keys (`llama-gguf-split`, `convert_hf_to_gguf.py --split-max-size`).
const SPLIT_NO: &str = "split.no";
const SPLIT_COUNT: &str = "split.count";
const SPLIT_TENSORS: &str = "split.tensors.count";
/// More shards than any model is split into (llama.cpp's names have five digits).
const MAX_SHARDS: u64 = 99_999;

/// One GGUF file mapped and decoded.
struct Shard {
    file: Arc<MappedFile>,
    hidden: Vec<VocabArray>,
    model: gguf_rs::GGUFModel,
}

fn open_shard(path: &Path) -> Result<Shard, ConvertError> {
    let bad = |msg: String| ConvertError::BadInput {
        path: path.to_path_buf(),
        msg,
    };
    let file = std::fs::File::open(path).map_err(io(path))?;
    // SAFETY: the file is opened read-only and the mapping is only read. A concurrent writer
    // truncating the file could fault; that is the documented contract of converting from mmap
    // (same as llama.cpp and safetensors' loaders).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
    let hidden = prescan(&map).map_err(&bad)?;
    let file = Arc::new(MappedFile {
        path: path.to_path_buf(),
        map,
        anon: false,
    });
    let model = {
        // gguf-rs reads field by field from the mapping, after the magic (the prescan checked
        // it, little-endian), the vocabulary arrays hidden (see `VocabArray`); buffered, as
        // its ~100k small reads were once most of the conversion time.
        let reader = HidingReader {
            file: file.clone(),
            pos: 4,
            hidden: hidden.clone(),
        };
        let reader = std::io::BufReader::with_capacity(1 << 20, reader);
        let mut container =
            gguf_rs::GGUFContainer::new(gguf_rs::ByteOrder::LE, Box::new(reader), u64::MAX);
        container.decode().map_err(|e| bad(format!("{e:#}")))?
    };
    Ok(Shard {
        file,
        hidden,
        model,
    })
}

/// llama.cpp's name of one shard of a split GGUF, `PREFIX-00002-of-00003.gguf` (the
/// extension and `-of-` in any case): `(PREFIX, shard number from 1, shard count)`.
pub fn split_name(file_name: &str) -> Option<(&str, u64, u64)> {
    let lower = file_name.to_ascii_lowercase();
    let stem = lower.strip_suffix(".gguf")?;
    // "-NNNNN-of-NNNNN"
    let tail = stem.get(stem.len().checked_sub(15)?..)?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    let (no, count) = (&tail[1..6], &tail[10..15]);
    if !tail.starts_with('-') || &tail[6..10] != "-of-" || !digits(no) || !digits(count) {
        return None;
    }
    // ASCII lowercasing keeps every byte where it was
    let prefix = &file_name[..stem.len() - 15];
    Some((prefix, no.parse().ok()?, count.parse().ok()?))
}

/// llama.cpp's file name of shard `no` (from 1) of `count`: `PREFIX-0000N-of-0000C` and
/// `ext` (`.gguf`).
pub fn shard_file_name(prefix: &str, no: u64, count: u64, ext: &str) -> String {
    format!("{prefix}-{no:05}-of-{count:05}{ext}")
}

/// A GGUF file: a regular file (links followed) whose name ends in `.gguf` or which starts
/// with GGUF's magic (Ollama's and Docker Model Runner's blobs have no extension).
pub fn is_gguf_file(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    if path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    use std::io::Read;
    let mut magic = [0u8; 4];
    // a regular file (checked above), opened as the converter opens one
    gds_io::open_user_file(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|_| &magic == GGUF_MAGIC)
}

/// The files of the GGUF `path` names: itself, or, when it is the first shard of a split
/// model (`split.count` > 1 in its metadata), every shard by llama.cpp's naming
/// (`PREFIX-00001-of-00003.gguf`, …), which must all sit beside it. Naming another shard
/// than the first, or a first shard whose name does not follow the pattern, is an error
/// that says which file to name.
pub fn gguf_shards(path: &Path) -> Result<Vec<std::path::PathBuf>, ConvertError> {
    let shard = open_shard(path)?;
    shard_paths_of(path, shard.model.metadata())
}

fn shard_paths_of(
    path: &Path,
    meta: &std::collections::BTreeMap<String, Value>,
) -> Result<Vec<std::path::PathBuf>, ConvertError> {
    let bad = |msg: String| ConvertError::BadInput {
        path: path.to_path_buf(),
        msg,
    };
    let count = match meta.get(SPLIT_COUNT) {
        None => return Ok(vec![path.to_path_buf()]),
        Some(v) => {
            num_u64(Some(v)).ok_or_else(|| bad(format!("{SPLIT_COUNT} is not an integer: {v}")))?
        }
    };
    let no = num_u64(meta.get(SPLIT_NO)).unwrap_or(0);
    if count <= 1 {
        return Ok(vec![path.to_path_buf()]);
    }
    if count > MAX_SHARDS {
        return Err(bad(format!("{SPLIT_COUNT} {count} is over {MAX_SHARDS}")));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let tail = format!("-{:05}-of-{count:05}.gguf", no + 1);
    let prefix = split_name(name)
        .filter(|&(_, n, c)| (n, c) == (no + 1, count))
        .map(|(p, _, _)| p);
    let Some(prefix) = prefix else {
        return Err(bad(format!(
            "shard {} of a model split in {count} (split.no {no}), but its name does not end in {tail:?}, so the other shards cannot be found (rename the shards as llama.cpp names them)",
            no + 1
        )));
    };
    if no != 0 {
        return Err(bad(format!(
            "shard {} of a model split in {count}: name the first, {}",
            no + 1,
            shard_file_name(prefix, 1, count, ".gguf")
        )));
    }
    let ext = &name[name.len() - 5..];
    let dir = path.parent().unwrap_or(Path::new(""));
    let paths: Vec<_> = (1..=count)
        .map(|i| dir.join(shard_file_name(prefix, i, count, ext)))
        .collect();
    if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
        return Err(bad(format!(
            "shard {} of {count} is missing: {}",
            paths.iter().position(|p| p == missing).unwrap_or(0) + 1,
            missing.display()
        )));
    }
    Ok(paths)
}

/// The tensors of one shard, each checked against its own file.
fn shard_tensors(
    path: &Path,
    shard: &Shard,
    tensors: &mut Vec<SourceTensor>,
) -> Result<(), ConvertError> {
    let model = &shard.model;
    let data_offset = model.data_offset();
    let file_len = shard.file.map.len() as u64;
    for t in model.tensors() {
        let dtype = DType::from_id(t.kind).ok_or_else(|| ConvertError::BadTensor {
            path: path.to_path_buf(),
            tensor: t.name.clone(),
            msg: unsupported_type(t.kind),
        })?;
        let shape: Vec<u64> = t.shape.iter().rev().copied().collect();
        let tbad = |msg: String| ConvertError::BadTensor {
            path: path.to_path_buf(),
            tensor: t.name.clone(),
            msg,
        };
        if shape.contains(&0) {
            return Err(tbad(format!("shape {shape:?} has a zero dimension")));
        }
        let nbytes = dtype.tensor_bytes(&shape).ok_or_else(|| {
            tbad(format!(
                "shape {shape:?} is not a whole number of {dtype} blocks"
            ))
        })?;
        if t.offset % model.alignment() != 0 {
            return Err(tbad(format!(
                "data offset {} is not a multiple of the file's alignment {}",
                t.offset,
                model.alignment()
            )));
        }
        let offset = data_offset
            .checked_add(t.offset)
            .ok_or_else(|| tbad("offset overflows".into()))?;
        match offset.checked_add(nbytes) {
            Some(end) if end <= file_len => {}
            _ => return Err(tbad(format!("data at bytes {offset}..{offset}+{nbytes} is out of bounds (file has {file_len} bytes)"))),
        }
        tensors.push(SourceTensor {
            name: t.name.clone(),
            source_name: t.name.clone(),
            dtype,
            shape,
            file: shard.file.clone(),
            offset,
            nbytes,
            transform: Transform::None,
            layout: Layout::Plain,
        });
    }

    Ok(())
}

/// Why a tensor of ggml type `id` cannot be converted: its name where ggml has one (the
/// ternary types have no kernel here), and what can be.
fn unsupported_type(id: u32) -> String {
    let name = match id {
        34 => "TQ1_0",
        35 => "TQ2_0",
        _ => "",
    };
    let what = match name {
        "" => format!("ggml type id {id}"),
        n => format!("ggml type {n} (id {id})"),
    };
    format!(
        "{what} is not supported by GdsLLM format v1 (it has F32, F16, BF16, Q4_0, Q4_1, \
         Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the i-quants IQ1_S, IQ1_M, IQ2_XXS, \
         IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, and MXFP4; requantize the model to one \
         of them with llama-quantize, or convert its float checkpoint)"
    )
}

#[cfg(test)]
mod tests {
    use super::{prescan, MAX_GGUF_ARRAY_ELEMENTS};

    fn header(version: u32, n_t: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(n_t.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }

    #[test]
    fn prescan_rejects_bad_magic_version_and_lengths() {
        assert!(prescan(b"GGML....").unwrap_err().contains("not a GGUF"));
        assert!(prescan(&header(1, 0, 0))
            .unwrap_err()
            .contains("unsupported GGUF version 1"));
        assert!(prescan(&header(3, 0, 0)).is_ok());
        assert!(prescan(&header(3, 1 << 40, 0))
            .unwrap_err()
            .contains("exceed"));
        // a key whose string length runs past the end
        let mut b = header(3, 0, 1);
        b.extend((1u64 << 50).to_le_bytes());
        assert!(prescan(&b).unwrap_err().contains("truncated"));
        // one tensor "w" of `cols` elements of ggml type `t`
        let one_tensor = |t: u32, cols: u64| {
            let mut b = header(3, 1, 0);
            b.extend(1u64.to_le_bytes());
            b.push(b'w');
            b.extend(1u32.to_le_bytes());
            b.extend(cols.to_le_bytes());
            b.extend(t.to_le_bytes());
            b.extend(0u64.to_le_bytes());
            b
        };
        // a tensor of ggml type 40 (GGML_TYPE_COUNT), on which gguf-rs panics
        assert!(prescan(&one_tensor(40, 32))
            .unwrap_err()
            .contains("type id 40"));
        // a ternary type (no kernels here) is refused by its ggml name, saying what is taken
        let e = prescan(&one_tensor(34, 256)).unwrap_err();
        assert!(e.contains("TQ1_0 (id 34)") && e.contains("IQ2_XXS"), "{e}");
        // the grid i-quants pass
        assert!(prescan(&one_tensor(21, 256)).is_ok());
    }

    fn kv_array(b: &mut Vec<u8>, key: &str, elem_type: u32, len: u64) {
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key.as_bytes());
        b.extend(9u32.to_le_bytes());
        b.extend(elem_type.to_le_bytes());
        b.extend(len.to_le_bytes());
    }

    /// Regression (issue 15): gguf-rs keeps the last of two equal keys; llama.cpp refuses.
    #[test]
    fn prescan_refuses_duplicate_keys() {
        let with_keys = |keys: &[&str]| {
            let mut b = header(3, 0, keys.len() as u64);
            for k in keys {
                b.extend((k.len() as u64).to_le_bytes());
                b.extend(k.as_bytes());
                b.extend(4u32.to_le_bytes()); // u32
                b.extend(7u32.to_le_bytes());
            }
            b
        };
        assert!(prescan(&with_keys(&["k.ey", "k.ex"])).is_ok());
        let e = prescan(&with_keys(&["k.ey", "k.ex", "k.ey"])).unwrap_err();
        assert!(e.contains("\"k.ey\" appears twice"), "{e}");
    }

    /// Regression (issue 15): gguf-rs decodes every array element into a 32-byte JSON
    /// value, so the elements are capped however few bytes each takes on disk; the file
    /// bound is checked first.
    #[test]
    fn prescan_caps_array_elements_after_the_file_bound() {
        let n = MAX_GGUF_ARRAY_ELEMENTS / 2 + 1;
        let mut b = header(3, 0, 2);
        kv_array(&mut b, "a", 0, n);
        b.resize(b.len() + n as usize, 0);
        kv_array(&mut b, "b", 0, n);
        assert!(prescan(&b).unwrap_err().contains("truncated"));
        b.resize(b.len() + n as usize, 0);
        let e = prescan(&b).unwrap_err();
        assert!(
            e.contains("\"b\"") && e.contains("elements GdsLLM accepts"),
            "{e}"
        );
        // strings: at least 8 bytes each, whatever the cap
        let mut b = header(3, 0, 1);
        kv_array(&mut b, "s", 8, 1 << 61);
        assert!(prescan(&b).unwrap_err().contains("exceeds the file"));
    }
}
