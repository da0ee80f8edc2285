//! Export of a GGUF's embedded vocabulary as a Hugging Face `tokenizer.json` (plus an
//! HF-style `tokenizer_config.json`) that tokenizes exactly like llama.cpp.
//!
//! [`tokenizer_from_gguf`] reads the `tokenizer.*` keys of the metadata map that
//! `gguf-rs` decodes (strings as JSON strings, integers as JSON numbers, `bool` as JSON
//! booleans, arrays as JSON arrays; the vocabulary arrays must be read in full, e.g. with
//! `get_gguf_container_array_size(path, u64::MAX)`), rebuilds the tokenizer with the
//! `tokenizers` crate and serializes it. It mirrors `llama-vocab.cpp`:
//!
//! * `tokenizer.ggml.model = "gpt2"`: byte-level BPE over the GGUF merges. The
//!   pre-tokenizer is the list of regexes llama.cpp applies for `tokenizer.ggml.pre`, each
//!   an isolating `Split` applied to the pieces left by the previous one, followed by a
//!   byte-level mapping; `ignore_merges` and the default of `add_bos` follow the pre type.
//! * `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE. llama.cpp merges the pair
//!   of adjacent symbols whose concatenation is the vocabulary entry with the highest
//!   score (leftmost first on ties); this is expressed as BPE merges ranked by descending
//!   score, one per split of each entry into two entries. Spaces become `▁`, a `▁` is
//!   prepended to every text fragment when `add_space_prefix` is set (the default), and
//!   characters outside the vocabulary fall back to `<0xXX>` byte tokens.
//! * Tokens whose (llama.cpp-adjusted) attribute is CONTROL, USER_DEFINED or UNKNOWN are
//!   added tokens matched on the raw text before anything else, as llama.cpp's
//!   `tokenizer_st_partition` does. CONTROL and UNKNOWN ones are `special`, so setting
//!   `encode_special_tokens(true)` on the loaded tokenizer reproduces llama.cpp's
//!   `parse_special = false`; USER_DEFINED ones are always matched, as in llama.cpp.
//! * BOS/EOS are added by a `TemplateProcessing` post-processor when
//!   `tokenizer.ggml.add_bos_token` / `add_eos_token` say so (llama.cpp's defaults apply
//!   when the keys are absent: BOS for "llama" and for the llama3/tekken/chameleon
//!   pre-tokenizers).
//!
//! Known, documented approximations (none is hit by the golden corpus): llama.cpp picks
//! the leftmost of several *different* candidate merges with exactly equal scores, HF the
//! one listed first; llama.cpp matches special tokens longest-first over the whole text,
//! HF leftmost-longest (they differ only for overlapping special tokens); the few
//! pre-tokenizers llama.cpp implements with custom code that is not a plain regex split
//! are rejected with [`TokenizerError::Unsupported`].

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::{SpecialToken, Template, TemplateProcessing};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// The two files exported for a converted model directory.
#[derive(Debug, Clone)]
pub struct TokenizerExport {
    /// `tokenizer.json`, loadable with `tokenizers::Tokenizer::from_str`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` in Hugging Face style (special tokens, `add_*_token`,
    /// `chat_template`, `model_max_length`).
    pub tokenizer_config_json: String,
}

/// Why the embedded vocabulary could not be exported.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required metadata key is absent.
    #[error("GGUF metadata has no `{0}`")]
    MissingKey(String),
    /// A metadata key holds a value of the wrong type.
    #[error("GGUF metadata `{key}` should be {expected}, found {found}")]
    WrongType {
        /// The metadata key.
        key: String,
        /// What llama.cpp expects there.
        expected: &'static str,
        /// A short description of what was found.
        found: String,
    },
    /// The tokenizer model or pre-tokenizer is one this exporter cannot express.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// The vocabulary arrays are inconsistent.
    #[error("invalid vocabulary: {0}")]
    InvalidVocab(String),
    /// A `tokenizer.ggml.merges` entry cannot be used.
    #[error("malformed merge #{index} {merge:?}: {reason}")]
    MalformedMerge {
        /// Position in `tokenizer.ggml.merges`.
        index: usize,
        /// The entry as stored.
        merge: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A special-token id points outside the vocabulary.
    #[error("`{key}` = {id} is outside the vocabulary of {n_tokens} tokens")]
    BadTokenId {
        /// The metadata key.
        key: String,
        /// The id found.
        id: u64,
        /// Vocabulary size.
        n_tokens: usize,
    },
    /// The `tokenizers` crate rejected the assembled tokenizer.
    #[error("building the Hugging Face tokenizer failed: {0}")]
    Build(String),
}

fn build_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Build(e.to_string())
}

// llama.cpp token types (`llama_token_type`) and attributes (`llama_token_attr`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const ATTR_NORMAL: u8 = 0;
const ATTR_UNKNOWN: u8 = 1;
const ATTR_CONTROL: u8 = 2;
const ATTR_USER_DEFINED: u8 = 4;

/// The `▁` SentencePiece uses for spaces.
const SPM_SPACE: &str = "\u{2581}";

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

/// How llama.cpp pre-tokenizes a byte-level BPE vocabulary.
struct BpePreSpec {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(_) => "a string".into(),
        Value::Array(a) => format!("an array of {} items", a.len()),
        Value::Object(_) => "an object".into(),
    }
}

fn wrong(key: &str, expected: &'static str, found: &Value) -> TokenizerError {
    TokenizerError::WrongType {
        key: key.into(),
        expected,
        found: describe(found),
    }
}

fn opt_str<'a>(
    meta: &'a BTreeMap<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, TokenizerError> {
    match meta.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(key, "a string", v)),
    }
}

fn opt_bool(meta: &BTreeMap<String, Value>, key: &str) -> Result<Option<bool>, TokenizerError> {
    match meta.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong(key, "a boolean", v)),
    }
}

fn opt_uint(meta: &BTreeMap<String, Value>, key: &str) -> Result<Option<u64>, TokenizerError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| wrong(key, "an unsigned integer", v)),
    }
}

fn opt_array<'a>(
    meta: &'a BTreeMap<String, Value>,
    key: &str,
) -> Result<Option<&'a [Value]>, TokenizerError> {
    match meta.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(wrong(key, "an array", v)),
    }
}

fn item_err(key: &str, i: usize, expected: &'static str, v: &Value) -> TokenizerError {
    TokenizerError::WrongType {
        key: format!("{key}[{i}]"),
        expected,
        found: describe(v),
    }
}

fn str_array<'a>(key: &str, a: &'a [Value]) -> Result<Vec<&'a str>, TokenizerError> {
    a.iter()
        .enumerate()
        .map(|(i, v)| v.as_str().ok_or_else(|| item_err(key, i, "a string", v)))
        .collect()
}

/// The vocabulary arrays of a GGUF read in place from the file (by `gguf::read_gguf`), to be
/// used instead of the metadata map's keys of the same names (which then hold placeholders):
/// decoding them into JSON values first took most of a 262k-token export. `None`: read that
/// key from the map.
#[derive(Debug, Default)]
pub struct VocabArrays<'a> {
    /// `tokenizer.ggml.tokens`.
    pub tokens: Option<Vec<&'a str>>,
    /// `tokenizer.ggml.scores`.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`.
    pub token_type: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`.
    pub merges: Option<Vec<&'a str>>,
}

/// The token texts, from `pre` or the map (checked: present, not empty, 32-bit ids).
fn token_texts<'a>(
    meta: &'a BTreeMap<String, Value>,
    pre: Option<Vec<&'a str>>,
) -> Result<Vec<&'a str>, TokenizerError> {
    let texts = match pre {
        Some(t) => t,
        None => {
            let raw = opt_array(meta, KEY_TOKENS)?
                .ok_or_else(|| TokenizerError::MissingKey(KEY_TOKENS.into()))?;
            str_array(KEY_TOKENS, raw)?
        }
    };
    if texts.is_empty() {
        return Err(TokenizerError::InvalidVocab(format!(
            "`{KEY_TOKENS}` is empty"
        )));
    }
    if u32::try_from(texts.len()).is_err() {
        return Err(TokenizerError::InvalidVocab(format!(
            "{} tokens do not fit 32-bit ids",
            texts.len()
        )));
    }
    Ok(texts)
}

/// llama.cpp renames empty tokens so that every entry stays addressable: the new names of
/// the empty entries of `texts`, in order.
fn empty_token_names(texts: &[&str]) -> Vec<String> {
    texts
        .iter()
        .enumerate()
        .filter(|(_, t)| t.is_empty())
        .map(|(i, _)| format!("[EMPTY_{i}]"))
        .collect()
}

/// Loaded vocabulary with llama.cpp's token attributes; the texts are borrowed from the
/// metadata (or the file) and from the names of empty tokens.
struct Vocab<'a> {
    tokens: Vec<&'a str>,
    scores: Vec<f64>,
    attrs: Vec<u8>,
    /// Token text to id (a fast fixed-seed hash: the export looks up every split of every
    /// token; nothing depends on this map's order).
    ids: HashMap<&'a str, u32, foldhash::fast::FixedState>,
}

impl<'a> Vocab<'a> {
    fn load(
        meta: &'a BTreeMap<String, Value>,
        texts: &[&'a str],
        empty_names: &'a [String],
        pre: (Option<Vec<f32>>, Option<Vec<i32>>),
    ) -> Result<Self, TokenizerError> {
        let n = texts.len();
        let mut names = empty_names.iter();
        let tokens: Vec<&'a str> = texts
            .iter()
            .map(|&t| match t {
                "" => names.next().map_or("", String::as_str),
                t => t,
            })
            .collect();
        let short_scores = |have: usize| {
            TokenizerError::InvalidVocab(format!(
                "`{KEY_SCORES}` has {have} entries for {n} tokens"
            ))
        };
        let scores = match pre.0 {
            Some(a) if a.len() < n => return Err(short_scores(a.len())),
            // a non-finite score is the lowest, as gguf-rs's null below
            Some(a) => a[..n]
                .iter()
                .map(|&x| {
                    if x.is_finite() {
                        f64::from(x)
                    } else {
                        f64::NEG_INFINITY
                    }
                })
                .collect(),
            None => match opt_array(meta, KEY_SCORES)? {
                None => vec![0.0; n],
                Some(a) if a.len() < n => return Err(short_scores(a.len())),
                Some(a) => a[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::Number(x) => x
                            .as_f64()
                            .ok_or_else(|| item_err(KEY_SCORES, i, "a number", v)),
                        // gguf-rs turns non-finite floats into null; treat as the lowest score.
                        Value::Null => Ok(f64::NEG_INFINITY),
                        _ => Err(item_err(KEY_SCORES, i, "a number", v)),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            },
        };
        let short_types = |have: usize| {
            TokenizerError::InvalidVocab(format!("`{KEY_TYPES}` has {have} entries for {n} tokens"))
        };
        let types: Option<Vec<i64>> = match pre.1 {
            Some(a) if a.len() < n => return Err(short_types(a.len())),
            Some(a) => Some(a[..n].iter().map(|&t| i64::from(t)).collect()),
            None => match opt_array(meta, KEY_TYPES)? {
                None => None,
                Some(a) if a.len() < n => return Err(short_types(a.len())),
                Some(a) => Some(
                    a[..n]
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            v.as_i64()
                                .ok_or_else(|| item_err(KEY_TYPES, i, "an integer", v))
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                ),
            },
        };
        let mut attrs = vec![ATTR_NORMAL; n];
        if let Some(a) = types {
            for (attr, &t) in attrs.iter_mut().zip(&a) {
                *attr = match t {
                    TYPE_UNKNOWN => ATTR_UNKNOWN,
                    TYPE_CONTROL => ATTR_CONTROL,
                    TYPE_USER_DEFINED => ATTR_USER_DEFINED,
                    // normal, unused, byte and undefined tokens are plain vocabulary entries
                    _ => ATTR_NORMAL,
                };
            }
        }
        let mut ids = HashMap::with_capacity_and_hasher(n, foldhash::fast::FixedState::default());
        for (i, &t) in tokens.iter().enumerate() {
            if let Some(prev) = ids.insert(t, i as u32) {
                return Err(TokenizerError::InvalidVocab(format!(
                    "token {t:?} appears twice (ids {prev} and {i})"
                )));
            }
        }
        Ok(Self {
            tokens,
            scores,
            attrs,
            ids,
        })
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }
}

/// Which tokenizer family llama.cpp would use.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `llama`: SentencePiece-style BPE with scores.
    Spm,
    /// `gpt2`: byte-level BPE with merges.
    Bpe,
}

/// Special token ids after llama.cpp's defaults and metadata overrides.
struct SpecialIds {
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    /// fim pre, suf, mid, pad, rep, sep
    fim: [Option<u32>; 6],
}

fn special_id(
    meta: &BTreeMap<String, Value>,
    keys: &[&str],
    default: Option<u32>,
    n_tokens: usize,
) -> Result<Option<u32>, TokenizerError> {
    // llama.cpp silently drops a default that does not fit the vocabulary.
    let mut id = default.filter(|&d| (d as usize) < n_tokens);
    for key in keys {
        if let Some(v) = opt_uint(meta, key)? {
            if v >= n_tokens as u64 {
                return Err(TokenizerError::BadTokenId {
                    key: (*key).into(),
                    id: v,
                    n_tokens,
                });
            }
            id = Some(v as u32);
        }
    }
    Ok(id)
}

impl SpecialIds {
    fn load(meta: &BTreeMap<String, Value>, kind: Kind, n: usize) -> Result<Self, TokenizerError> {
        let (bos, eos, unk) = match kind {
            Kind::Spm => (Some(1), Some(2), Some(0)),
            Kind::Bpe => (Some(11), Some(11), None),
        };
        let k = |s: &str| format!("tokenizer.ggml.{s}");
        let one = |name: &str, default: Option<u32>| special_id(meta, &[&k(name)], default, n);
        Ok(Self {
            bos: one("bos_token_id", bos)?,
            eos: one("eos_token_id", eos)?,
            unk: one("unknown_token_id", unk)?,
            pad: one("padding_token_id", None)?,
            eot: one("eot_token_id", None)?,
            eom: one("eom_token_id", None)?,
            fim: [
                special_id(
                    meta,
                    &[&k("fim_pre_token_id"), &k("prefix_token_id")],
                    None,
                    n,
                )?,
                special_id(
                    meta,
                    &[&k("fim_suf_token_id"), &k("suffix_token_id")],
                    None,
                    n,
                )?,
                special_id(
                    meta,
                    &[&k("fim_mid_token_id"), &k("middle_token_id")],
                    None,
                    n,
                )?,
                one("fim_pad_token_id", None)?,
                one("fim_rep_token_id", None)?,
                one("fim_sep_token_id", None)?,
            ],
        })
    }
}

// Token texts llama.cpp promotes to CONTROL (llama_vocab::impl::load, "auto-detect special
// tokens by text"), shared with the runtime. The EOT/EOM lists are subsets of the EOG list, so
// only the EOG list and the per-slot FIM lists matter for attributes.
use gds_format::vocab::{
    END_OF_GENERATION_TEXTS as EOG_TEXTS, END_OF_TURN_TEXTS as EOT_TEXTS, FIM_CONFIG_KEY,
    FIM_SLOTS, FIM_TEXTS,
};

/// Applies llama.cpp's text-based attribute overrides and returns the adjusted attributes.
fn adjust_attrs(vocab: &Vocab, ids: &mut SpecialIds) -> Vec<u8> {
    let mut attrs = vocab.attrs.clone();
    let id_of = |t: &str| vocab.ids.get(t).copied();
    // llama.cpp walks its std::map token_to_id, i.e. tokens in byte order, and takes the
    // first token whose text is one of the candidates: the candidate present in the
    // vocabulary that comes first in byte order (looked up, not a sort of the vocabulary).
    let first = |texts: &[&str]| {
        texts
            .iter()
            .filter_map(|&t| Some((t, id_of(t)?)))
            .min_by(|x, y| x.0.as_bytes().cmp(y.0.as_bytes()))
            .map(|(_, id)| id)
    };
    if ids.eot.is_none() {
        ids.eot = first(EOT_TEXTS);
    }
    if ids.eom.is_none() {
        ids.eom = id_of("<|eom_id|>");
    }
    for (slot, texts) in FIM_TEXTS.iter().enumerate() {
        if ids.fim[slot].is_none() {
            ids.fim[slot] = first(texts);
            if let Some(id) = ids.fim[slot] {
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
    }
    let mut eog: Vec<u32> = ids.fim[3..].iter().flatten().copied().collect();
    for &t in EOG_TEXTS {
        if let Some(id) = id_of(t) {
            eog.push(id);
            attrs[id as usize] |= ATTR_CONTROL;
        }
    }
    // gpt-oss: these are always rendered, i.e. user-defined.
    for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(id) = id_of(t) {
            attrs[id as usize] = ATTR_USER_DEFINED;
        }
    }
    eog.extend([ids.eos, ids.eot, ids.eom].into_iter().flatten());
    let in_eog = |t: &str| eog.iter().any(|&id| vocab.tokens[id as usize] == t);
    // o200k_harmony / solar-open: "<|end|>" is not end-of-generation there.
    if in_eog("<|end|>")
        && ((in_eog("<|return|>") && (in_eog("<|call|>") || in_eog("<|calls|>")))
            || ((in_eog("<|call|>") || in_eog("<|calls|>")) && in_eog("<|flush|>")))
    {
        if let Some(id) = id_of("<|end|>") {
            attrs[id as usize] = ATTR_USER_DEFINED;
        }
    }
    // gemma4 / plamo: "</s>" is a normal token.
    if in_eog("</s>") && (in_eog("<|tool_response>") || in_eog("<|plamo:eos|>")) {
        if let Some(id) = id_of("</s>") {
            attrs[id as usize] = ATTR_NORMAL;
        }
    }
    attrs
}

/// The added tokens llama.cpp splits out before running the model (its special-token cache).
fn added_tokens(
    meta: &BTreeMap<String, Value>,
    vocab: &Vocab,
    attrs: &[u8],
) -> Result<Vec<AddedToken>, TokenizerError> {
    let lower = |k: &str| -> Result<String, TokenizerError> {
        Ok(opt_str(meta, k)?.unwrap_or("").to_lowercase())
    };
    let name = lower("general.name")?;
    let pre = opt_str(meta, KEY_PRE)?.unwrap_or("");
    let arch = opt_str(meta, "general.architecture")?.unwrap_or("");
    let mask_lstrip = ["jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert"]
        .iter()
        .any(|s| pre.contains(s))
        || ["nomic-bert-moe", "jina-bert-v3"]
            .iter()
            .any(|s| arch.contains(s));
    let phi3 = !mask_lstrip && (name.contains("phi-3") || name.contains("phi3"));
    let modern_bert = !mask_lstrip && !phi3 && name.contains("modern-bert");
    let mut out = Vec::new();
    for (i, &text) in vocab.tokens.iter().enumerate() {
        let attr = attrs[i];
        if attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) == 0 {
            continue;
        }
        let lstrip = (mask_lstrip && text == "<mask>") || (modern_bert && text == "[MASK]");
        let rstrip = phi3 && !["<unk>", "<s>", "<|endoftext|>"].contains(&text);
        let special = attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0;
        out.push(
            AddedToken::from(text, special)
                .normalized(false)
                .lstrip(lstrip)
                .rstrip(rstrip),
        );
    }
    Ok(out)
}

/// SentencePiece merges: every split of every entry into two entries is a merge; llama.cpp
/// prefers the merge whose result has the highest score. As (left, right) ids, by rank:
/// score descending, then the entry's id, then the left part's id. The entries are put in
/// that order first (one sort of the vocabulary, not of the merges), then their splits are
/// looked up in parallel, chunk by chunk, each entry's merges ordered by left id.
fn spm_merges(vocab: &Vocab) -> Vec<(u32, u32)> {
    use rayon::prelude::*;
    // total order of f64 as an unsigned integer (total_cmp's), reversed: descending scores
    let desc = |score: f64| {
        let bits = score.to_bits();
        !(if bits >> 63 == 1 {
            !bits
        } else {
            bits | 1 << 63
        })
    };
    let mut order: Vec<(u64, u32)> = vocab
        .scores
        .iter()
        .enumerate()
        .map(|(id, &s)| (desc(s), id as u32))
        .collect();
    // (key, id) pairs are unique, so an unstable sort gives the same order every time
    order.par_sort_unstable();
    let chunks: Vec<Vec<(u32, u32)>> = order
        .par_chunks(4096)
        .map(|chunk| {
            let mut out = Vec::with_capacity(2 * chunk.len());
            for &(_, id) in chunk {
                let text = vocab.tokens[id as usize];
                let first = out.len();
                for (k, _) in text.char_indices().skip(1) {
                    // the right part is looked up only where the left one is a token
                    let Some(&a) = vocab.ids.get(&text[..k]) else {
                        continue;
                    };
                    if let Some(&b) = vocab.ids.get(&text[k..]) {
                        out.push((a, b));
                    }
                }
                // different splits have different left parts, so left ids are unique here
                out[first..].sort_unstable();
            }
            out
        })
        .collect();
    chunks.concat()
}

/// The GGUF's merges (`"a b"`, split as llama.cpp splits them), each part and the joined
/// result checked to be in the vocabulary. As (left, right) ids, in rank order.
fn bpe_merges(
    meta: &BTreeMap<String, Value>,
    pre: Option<Vec<&str>>,
    vocab: &Vocab,
) -> Result<Vec<(u32, u32)>, TokenizerError> {
    let raw = match pre {
        Some(m) => m,
        None => str_array(
            KEY_MERGES,
            opt_array(meta, KEY_MERGES)?
                .ok_or_else(|| TokenizerError::MissingKey(KEY_MERGES.into()))?,
        )?,
    };
    let mut merges = Vec::with_capacity(raw.len());
    let mut joined = String::new();
    for (index, &s) in raw.iter().enumerate() {
        let bad = |reason: String| TokenizerError::MalformedMerge {
            index,
            merge: s.to_owned(),
            reason,
        };
        // llama.cpp splits at the first space after the first byte.
        // A space byte is always a char boundary.
        let pos = s
            .bytes()
            .skip(1)
            .position(|c| c == b' ')
            .map(|p| p + 1)
            .ok_or_else(|| bad("expected two tokens separated by a space".into()))?;
        let (a, b) = (&s[..pos], &s[pos + 1..]);
        if b.is_empty() {
            return Err(bad("the second token is empty".into()));
        }
        joined.clear();
        joined.push_str(a);
        joined.push_str(b);
        let id = |part: &str| {
            vocab
                .ids
                .get(part)
                .copied()
                .ok_or_else(|| bad(format!("{part:?} is not in the vocabulary")))
        };
        let (ia, ib) = (id(a)?, id(b)?);
        id(&joined)?;
        merges.push((ia, ib));
    }
    Ok(merges)
}

/// The `model` object of `tokenizer.json` for a BPE over `vocab` with `merges` (ids, in rank
/// order), written directly — what the `tokenizers` library writes for the same model
/// (vocabulary by id, merges as pairs; checked against it in tests/it/tokenizer_golden.rs),
/// without building the library's maps first, which took most of a 262k-token export.
fn bpe_model_json(
    out: &mut String,
    vocab: &Vocab,
    merges: &[(u32, u32)],
    unk: Option<u32>,
    byte_fallback: bool,
    ignore_merges: bool,
) {
    use std::fmt::Write;
    let text = |id: u32| vocab.tokens[id as usize];
    out.reserve(16 * vocab.len() + 24 * merges.len() + 256);
    out.push_str(r#"{"type":"BPE","dropout":null,"unk_token":"#);
    match unk {
        Some(u) => json_str(out, text(u)),
        None => out.push_str("null"),
    }
    let _ = write!(
        out,
        r#","continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":{byte_fallback},"ignore_merges":{ignore_merges},"vocab":{{"#
    );
    // by id: `tokens` is indexed by id, and every text has one id (checked at load); where
    // each escaped text lies in `out` is kept, for the merges to copy it from there
    let mut num = itoa::Buffer::new();
    let mut at = Vec::with_capacity(vocab.len());
    for (id, t) in vocab.tokens.iter().enumerate() {
        if id > 0 {
            out.push(',');
        }
        let start = out.len();
        json_str(out, t);
        at.push(start..out.len());
        out.push(':');
        out.push_str(num.format(id));
    }
    out.push_str(r#"},"merges":["#);
    for (k, &(a, b)) in merges.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        out.push('[');
        out.extend_from_within(at[a as usize].clone());
        out.push(',');
        out.extend_from_within(at[b as usize].clone());
        out.push(']');
    }
    out.push_str("]}");
}

/// Appends `s` to `out` as a JSON string, escaped as `serde_json` escapes it (`"`, `\\`,
/// the short forms `\b \f \n \r \t`, other control characters as `\u00XX`; everything
/// else as is), so that the export reads like the library's own serialization. Pieces of
/// `str` only: the output never needs its UTF-8 checked again.
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    let mut plain = 0;
    for (i, b) in s.bytes().enumerate() {
        let esc: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0..=0x1f => "",
            _ => continue,
        };
        // every byte matched above is ASCII, so `i` is a char boundary
        out.push_str(&s[plain..i]);
        if esc.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xF)] as char);
        } else {
            out.push_str(esc);
        }
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
    out.push('"');
}

/// `tokenizer.json`: the library's serialization of `tokenizer` (normalizer, pre-tokenizer,
/// post-processor, decoder; a placeholder model and no added tokens), with `model` and
/// `added_tokens` written here (the added tokens as the library lists them: by id, each
/// with the id its text has in the vocabulary, the first of equal texts kept).
fn tokenizer_json(
    tokenizer: &Tokenizer,
    model: impl FnOnce(&mut String),
    added: &[AddedToken],
    vocab: &Vocab,
) -> Result<String, TokenizerError> {
    let base: serde_json::Map<String, Value> =
        serde_json::from_str(&tokenizer.to_string(false).map_err(build_err)?).map_err(build_err)?;
    let mut seen = std::collections::HashSet::new();
    let mut entries: Vec<(u32, &AddedToken)> = Vec::new();
    for t in added {
        if !t.content.is_empty() && seen.insert(t.content.as_str()) {
            let id = *vocab.ids.get(t.content.as_str()).ok_or_else(|| {
                TokenizerError::InvalidVocab(format!(
                    "added token {:?} is not in the vocabulary",
                    t.content
                ))
            })?;
            entries.push((id, t));
        }
    }
    entries.sort_by_key(|e| e.0);
    let added: Vec<Value> = entries
        .iter()
        .map(|(id, t)| {
            json!({
                "id": id,
                "content": t.content,
                "single_word": t.single_word,
                "lstrip": t.lstrip,
                "rstrip": t.rstrip,
                "normalized": t.normalized,
                "special": t.special,
            })
        })
        .collect();
    let mut out = String::new();
    let mut model = Some(model);
    out.push('{');
    for (k, (key, v)) in base.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        out.push_str(&serde_json::to_string(key).map_err(build_err)?);
        out.push(':');
        match key.as_str() {
            "model" => {
                if let Some(m) = model.take() {
                    m(&mut out)
                }
            }
            "added_tokens" => out.push_str(&serde_json::to_string(&added).map_err(build_err)?),
            _ => out.push_str(&serde_json::to_string(v).map_err(build_err)?),
        }
    }
    out.push('}');
    Ok(out)
}

fn post_processor(
    vocab: &Vocab,
    ids: &SpecialIds,
    add_bos: bool,
    add_eos: bool,
) -> Result<Option<TemplateProcessing>, TokenizerError> {
    let mut specials = Vec::new();
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let need = |what: &str, id: Option<u32>| {
        id.ok_or_else(|| {
            TokenizerError::InvalidVocab(format!(
                "add_{what}_token is set but there is no {what} token"
            ))
        })
    };
    if add_bos {
        let id = need("bos", ids.bos)?;
        specials.push(
            SpecialToken::new(
                "bos".into(),
                vec![id],
                vec![vocab.tokens[id as usize].to_string()],
            )
            .map_err(build_err)?,
        );
        single.push("bos");
        pair.push("bos");
    }
    single.push("$A:0");
    pair.push("$A:0");
    if add_eos {
        let id = need("eos", ids.eos)?;
        specials.push(
            SpecialToken::new(
                "eos".into(),
                vec![id],
                vec![vocab.tokens[id as usize].to_string()],
            )
            .map_err(build_err)?,
        );
        single.push("eos");
        pair.push("eos");
    }
    if specials.is_empty() {
        return Ok(None);
    }
    if add_bos {
        pair.push("bos:1");
    }
    pair.push("$B:1");
    if add_eos {
        pair.push("eos:1");
    }
    let single = Template::try_from(single).map_err(build_err)?;
    let pair = Template::try_from(pair).map_err(build_err)?;
    TemplateProcessing::builder()
        .single(single)
        .pair(pair)
        .special_tokens(specials)
        .build()
        .map(Some)
        .map_err(build_err)
}

/// Builds `tokenizer.json` and `tokenizer_config.json` from the `tokenizer.*` metadata of a
/// GGUF, as decoded by `gguf-rs` (arrays read in full).
///
/// Supports `tokenizer.ggml.model` "llama" (SentencePiece BPE) and "gpt2" (byte-level BPE
/// with the pre-tokenizers llama.cpp knows as plain regex splits); any other model, and the
/// pre-tokenizers llama.cpp implements with custom code, give [`TokenizerError::Unsupported`].
pub fn tokenizer_from_gguf(
    meta: &BTreeMap<String, Value>,
) -> Result<TokenizerExport, TokenizerError> {
    tokenizer_from_gguf_with(meta, VocabArrays::default())
}

/// [`tokenizer_from_gguf`] with the vocabulary arrays that `arrays` holds taken from there
/// instead of from `meta`.
pub fn tokenizer_from_gguf_with(
    meta: &BTreeMap<String, Value>,
    arrays: VocabArrays<'_>,
) -> Result<TokenizerExport, TokenizerError> {
    let model =
        opt_str(meta, KEY_MODEL)?.ok_or_else(|| TokenizerError::MissingKey(KEY_MODEL.into()))?;
    let kind = match model {
        "llama" => Kind::Spm,
        "gpt2" => Kind::Bpe,
        other => {
            return Err(TokenizerError::Unsupported(format!(
            "tokenizer model {other:?} (only \"llama\" and \"gpt2\" vocabularies can be exported)"
        )))
        }
    };
    let pre_spec = match kind {
        Kind::Spm => None,
        Kind::Bpe => {
            let pre = opt_str(meta, KEY_PRE)?.unwrap_or("");
            Some(bpe_pre_spec(pre).ok_or_else(|| {
                if UNSUPPORTED_PRE.contains(&pre) {
                    TokenizerError::Unsupported(format!(
                        "pre-tokenizer {pre:?}: llama.cpp splits it with custom code that has no Hugging Face equivalent"
                    ))
                } else {
                    TokenizerError::Unsupported(format!("pre-tokenizer {pre:?} is unknown to llama.cpp"))
                }
            })?)
        }
    };
    let texts = token_texts(meta, arrays.tokens)?;
    let empty_names = empty_token_names(&texts);
    let vocab = Vocab::load(
        meta,
        &texts,
        &empty_names,
        (arrays.scores, arrays.token_type),
    )?;
    let mut ids = SpecialIds::load(meta, kind, vocab.len())?;
    let attrs = adjust_attrs(&vocab, &mut ids);

    let add_bos = opt_bool(meta, "tokenizer.ggml.add_bos_token")?
        .unwrap_or(kind == Kind::Spm || pre_spec.as_ref().is_some_and(|p| p.add_bos));
    let add_eos = opt_bool(meta, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let add_space_prefix =
        opt_bool(meta, "tokenizer.ggml.add_space_prefix")?.unwrap_or(kind == Kind::Spm);

    let mut tokenizer = match &pre_spec {
        None => {
            let mut t = Tokenizer::new(BPE::default());
            let mut norms: Vec<NormalizerWrapper> = Vec::new();
            if add_space_prefix {
                norms.push(Prepend::new(SPM_SPACE.into()).into());
            }
            norms.push(Replace::new(" ", SPM_SPACE).map_err(build_err)?.into());
            t.with_normalizer(Some(NormalizerSequence::new(norms)));
            let mut decs: Vec<DecoderWrapper> = vec![
                Replace::new(SPM_SPACE, " ").map_err(build_err)?.into(),
                ByteFallback::new().into(),
                Fuse::new().into(),
            ];
            if add_space_prefix {
                decs.push(Strip::new(' ', 1, 0).into());
            }
            t.with_decoder(Some(DecoderSequence::new(decs)));
            t
        }
        Some(spec) => {
            let mut t = Tokenizer::new(BPE::default());
            let mut pres: Vec<PreTokenizerWrapper> = Vec::new();
            for re in spec.regexes {
                pres.push(
                    Split::new(
                        SplitPattern::Regex((*re).to_owned()),
                        SplitDelimiterBehavior::Isolated,
                        false,
                    )
                    .map_err(build_err)?
                    .into(),
                );
            }
            pres.push(ByteLevel::new(false, true, false).into());
            t.with_pre_tokenizer(Some(PreTokenizerSequence::new(pres)));
            t.with_decoder(Some(ByteLevelDecoder::new(false, true, false)));
            t
        }
    };
    if let Some(pp) = post_processor(&vocab, &ids, add_bos, add_eos)? {
        tokenizer.with_post_processor(Some(pp));
    }
    let (merges, unk, byte_fallback, ignore_merges) = match &pre_spec {
        None => (spm_merges(&vocab), ids.unk, true, false),
        Some(spec) => (
            bpe_merges(meta, arrays.merges, &vocab)?,
            None,
            false,
            spec.ignore_merges,
        ),
    };
    let added = added_tokens(meta, &vocab, &attrs)?;
    // the model (most of the file) is written straight into the output
    let model =
        |out: &mut String| bpe_model_json(out, &vocab, &merges, unk, byte_fallback, ignore_merges);
    let tokenizer_json = tokenizer_json(&tokenizer, model, &added, &vocab)?;

    let mut config = serde_json::Map::new();
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    for (name, id) in [
        ("bos_token", ids.bos),
        ("eos_token", ids.eos),
        ("unk_token", ids.unk),
        ("pad_token", ids.pad),
    ] {
        if let Some(id) = id {
            config.insert(name.into(), json!(vocab.tokens[id as usize]));
        }
    }
    // the fill-in-the-middle tokens (from metadata, else found by their text as llama.cpp
    // finds them), for the runtime's `/infill`
    let fim: serde_json::Map<String, Value> = FIM_SLOTS
        .iter()
        .zip(ids.fim)
        .filter_map(|(slot, id)| Some(((*slot).into(), json!(vocab.tokens[id? as usize]))))
        .collect();
    if !fim.is_empty() {
        config.insert(FIM_CONFIG_KEY.into(), Value::Object(fim));
    }
    if let Some(t) = opt_str(meta, "tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(t));
    }
    if let Some(arch) = opt_str(meta, "general.architecture")? {
        if let Some(n) = opt_uint(meta, &format!("{arch}.context_length"))? {
            config.insert("model_max_length".into(), json!(n));
        }
    }
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    let tokenizer_config_json =
        serde_json::to_string_pretty(&Value::Object(config)).map_err(build_err)?;
    Ok(TokenizerExport {
        tokenizer_json,
        tokenizer_config_json,
    })
}

// Generated from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe and the tokenizer_pre table).
const RE_DEFAULT: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "\\p{N}+",
    "[0-9][0-9][0-9]",
];
const RE_MINICPM5: &[&str] = &[
    "\\p{N}{1,3}",
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_LLAMA3: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
];
const RE_DEEPSEEK_CODER: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}",
];
const RE_DEEPSEEK3_LLM: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const RE_SPARK2_5: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
    "\\p{N}",
];
const RE_FALCON: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
];
const RE_MPT: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const RE_STARCODER: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_GPT2: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const RE_JAIS2: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
];
const RE_REFACT: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_COMMAND_R: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_QWEN2: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_QWEN35: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_STABLELM2: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_OLMO: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const RE_DBRX: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_SMAUG: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_PORO: &[&str] = &[" ?[^(\\s|.,!?…。，、।۔،)]+"];
const RE_CHATGLM4: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_VIKING: &[&str] = &[" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"];
const RE_JAIS: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const RE_TEKKEN: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_SMOLLM: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_CODESHELL: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_BLOOM: &[&str] = &[" ?[^(\\s|.,!?…。，、।۔،)]+"];
const RE_GPT3_FINNISH: &[&str] = &[" ?[^(\\s|.,!?…。，、।۔،)]+"];
const RE_EXAONE: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_EXAONE_MOE: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
];
const RE_CHAMELEON: &[&str] = &[
    "<sentinel:[0-9]+>",
    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    "([\\t\\n]|    |  )",
    "\\p{N}",
    "[\\p{P}!-/:-@\\[-`{-~]",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_MINERVA: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const RE_GPT4O: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_GRANITE_EMB_MULTI: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_TRILLION: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const RE_GRANITE_DOCLING: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const RE_BAILINGMOE: &[&str] = &[
    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
];
const RE_SEED_CODER: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_HUNYUAN: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_HUNYUAN_DENSE: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const RE_HY_V4: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const RE_JOYAI_LLM: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const RE_UFAKZEKA: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_GROK_2: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_LAGUNA: &[&str] = &[
    "[^\\n]+|[\\n]+",
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_MINIMAX_M2: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_SOLAR_OPEN: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const RE_MELLUM2: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];

/// Maps a llama.cpp `tokenizer.ggml.pre` name to its pre-tokenizer (llama-vocab.cpp).
fn bpe_pre_spec(pre: &str) -> Option<BpePreSpec> {
    let (regexes, ignore_merges, add_bos) = match pre {
        "" => (RE_DEFAULT, false, false),
        "default" => (RE_DEFAULT, false, false),
        "minicpm5" => (RE_MINICPM5, true, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (RE_LLAMA3, true, true),
        "deepseek-llm" => (RE_DEEPSEEK_LLM, false, false),
        "deepseek-coder" => (RE_DEEPSEEK_CODER, false, false),
        "deepseek-v3" => (RE_DEEPSEEK3_LLM, false, false),
        "spark2_5" => (RE_SPARK2_5, false, false),
        "falcon" => (RE_FALCON, false, false),
        "mpt" => (RE_MPT, false, false),
        "starcoder" => (RE_STARCODER, false, false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" => (RE_GPT2, false, false),
        "jais-2" => (RE_JAIS2, false, false),
        "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => (RE_GPT2, false, false),
        "refact" => (RE_REFACT, false, false),
        "command-r" => (RE_COMMAND_R, false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => (RE_QWEN2, false, false),
        "qwen35" => (RE_QWEN35, false, false),
        "stablelm2" => (RE_STABLELM2, false, false),
        "olmo" => (RE_OLMO, false, false),
        "dbrx" => (RE_DBRX, false, false),
        "smaug-bpe" => (RE_SMAUG, false, false),
        "poro-chat" => (RE_PORO, false, false),
        "chatglm-bpe" => (RE_CHATGLM4, false, false),
        "glm4" | "glm5" => (RE_CHATGLM4, true, false),
        "viking" => (RE_VIKING, false, false),
        "jais" => (RE_JAIS, false, false),
        "tekken" => (RE_TEKKEN, true, true),
        "smollm" => (RE_SMOLLM, false, false),
        "codeshell" => (RE_CODESHELL, false, false),
        "bloom" => (RE_BLOOM, false, false),
        "gpt3-finnish" => (RE_GPT3_FINNISH, false, false),
        "exaone" => (RE_EXAONE, false, false),
        "exaone4" => (RE_GPT2, false, false),
        "exaone-moe" => (RE_EXAONE_MOE, false, false),
        "chameleon" => (RE_CHAMELEON, false, true),
        "minerva-7b" => (RE_MINERVA, false, false),
        "megrez" => (RE_QWEN2, false, false),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" => (RE_GPT4O, false, false),
        "granite-embed-multi-97m" => (RE_GRANITE_EMB_MULTI, true, false),
        "trillion" => (RE_TRILLION, false, false),
        "granite-docling" => (RE_GRANITE_DOCLING, false, false),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => (RE_BAILINGMOE, false, false),
        "seed-coder" => (RE_SEED_CODER, false, false),
        "hunyuan" => (RE_HUNYUAN, false, false),
        "hunyuan-dense" => (RE_HUNYUAN_DENSE, false, false),
        "hy_v4" => (RE_HY_V4, false, false),
        "joyai-llm" => (RE_JOYAI_LLM, false, false),
        "ufakzeka" => (RE_UFAKZEKA, false, false),
        "grok-2" => (RE_GROK_2, false, false),
        "laguna" => (RE_LAGUNA, false, false),
        "minimax-m2" => (RE_MINIMAX_M2, false, false),
        "solar-open" => (RE_SOLAR_OPEN, false, false),
        "mellum2" => (RE_MELLUM2, false, false),
        _ => return None,
    };
    Some(BpePreSpec {
        regexes,
        ignore_merges,
        add_bos,
    })
}

/// Pre-tokenizer names llama.cpp knows whose splitting cannot be expressed as HF regex splits.
const UNSUPPORTED_PRE: &[&str] = &[
    "youtu",
    "gemma4",
    "granite-embed-multi-311m",
    "mmbert",
    "sarvam-moe",
    "whitespace",
    "tiny_aya",
    "cohere2moe",
    "superbpe",
    "kimi-k2",
    "afmoe",
];

/// Every `tokenizer.ggml.pre` accepted by [`bpe_pre_spec`] (used by tests).
#[cfg(test)]
const SUPPORTED_PRE: &[&str] = &[
    "default",
    "minicpm5",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "spark2_5",
    "falcon",
    "mpt",
    "starcoder",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "jais-2",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "refact",
    "command-r",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "qwen35",
    "stablelm2",
    "olmo",
    "dbrx",
    "smaug-bpe",
    "poro-chat",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "viking",
    "jais",
    "tekken",
    "smollm",
    "codeshell",
    "bloom",
    "gpt3-finnish",
    "exaone",
    "exaone4",
    "exaone-moe",
    "chameleon",
    "minerva-7b",
    "megrez",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "granite-embed-multi-97m",
    "trillion",
    "granite-docling",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "hunyuan",
    "hunyuan-dense",
    "hy_v4",
    "joyai-llm",
    "ufakzeka",
    "grok-2",
    "laguna",
    "minimax-m2",
    "solar-open",
    "mellum2",
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn meta(entries: &[(&str, Value)]) -> BTreeMap<String, Value> {
        entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    /// Byte-level BPE: `<|endoftext|>` control, merges a+b, ab+c, Ġ+ab.
    fn tiny_gpt2() -> BTreeMap<String, Value> {
        meta(&[
            (KEY_MODEL, json!("gpt2")),
            (KEY_PRE, json!("gpt-2")),
            (
                KEY_TOKENS,
                json!(["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "abc", "Ġab"]),
            ),
            (KEY_TYPES, json!([3, 1, 1, 1, 1, 1, 1, 1])),
            (KEY_MERGES, json!(["a b", "ab c", "Ġ ab"])),
            ("tokenizer.ggml.bos_token_id", json!(0)),
            ("tokenizer.ggml.eos_token_id", json!(0)),
            ("tokenizer.chat_template", json!("{{ messages }}")),
            ("general.architecture", json!("llama")),
            ("llama.context_length", json!(2048)),
        ])
    }

    /// SentencePiece BPE: "bc" outranks "ab", byte fallback for "c".
    fn tiny_spm() -> BTreeMap<String, Value> {
        meta(&[
            (KEY_MODEL, json!("llama")),
            (
                KEY_TOKENS,
                json!([
                    "<unk>", "<s>", "</s>", "▁", "a", "b", "ab", "bc", "▁a", "<0x64>", "<br>", "c"
                ]),
            ),
            (
                KEY_SCORES,
                json!([0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -5.0, -4.0, -6.0, 0.0, 0.0, -7.0]),
            ),
            (KEY_TYPES, json!([2, 3, 3, 1, 1, 1, 1, 1, 1, 6, 4, 1])),
        ])
    }

    fn load(export: &TokenizerExport) -> Tokenizer {
        Tokenizer::from_str(&export.tokenizer_json).expect("exported tokenizer.json loads")
    }

    fn ids(t: &Tokenizer, text: &str, add_special: bool) -> Vec<u32> {
        t.encode(text, add_special)
            .expect("encode")
            .get_ids()
            .to_vec()
    }

    #[test]
    fn json_str_escapes_like_serde_json() {
        let mut texts: Vec<String> = (0u8..0x80).map(|b| format!("a{}b", b as char)).collect();
        texts.extend(
            [
                "",
                "\"",
                "\\",
                "\u{7f}",
                "▁the",
                "日本語",
                "🦀\n\t",
                "\\\"\u{1}x",
            ]
            .map(String::from),
        );
        for t in &texts {
            let mut ours = String::new();
            json_str(&mut ours, t);
            assert_eq!(ours, serde_json::to_string(t).unwrap(), "{t:?}");
        }
    }

    #[test]
    fn gpt2_merges_special_tokens_and_round_trip() {
        let export = tokenizer_from_gguf(&tiny_gpt2()).unwrap();
        let t = load(&export);
        assert_eq!(ids(&t, "abc ab", true), vec![6, 7]);
        assert_eq!(ids(&t, "ab<|endoftext|>c", true), vec![5, 0, 3]);
        assert_eq!(t.decode(&[6, 7, 0], false).unwrap(), "abc ab<|endoftext|>");
        let mut t2 = t.clone();
        t2.set_encode_special_tokens(true);
        // with parse_special off the control token is plain text, none of whose characters
        // is in this vocabulary (llama.cpp drops such characters the same way)
        assert_eq!(ids(&t2, "<|endoftext|>", true), Vec::<u32>::new());

        let config: Value = serde_json::from_str(&export.tokenizer_config_json).unwrap();
        assert_eq!(config["add_bos_token"], json!(false));
        assert_eq!(config["bos_token"], json!("<|endoftext|>"));
        assert_eq!(config["chat_template"], json!("{{ messages }}"));
        assert_eq!(config["model_max_length"], json!(2048));
        assert!(config.get("unk_token").is_none());
    }

    #[test]
    fn gpt2_add_bos_uses_template() {
        let mut m = tiny_gpt2();
        m.insert("tokenizer.ggml.add_bos_token".into(), json!(true));
        let t = load(&tokenizer_from_gguf(&m).unwrap());
        assert_eq!(ids(&t, "ab", true), vec![0, 5]);
        assert_eq!(ids(&t, "ab", false), vec![5]);
        // llama3 pre-tokenizers add BOS when the key is absent, like llama.cpp
        let mut m = tiny_gpt2();
        m.insert(KEY_PRE.into(), json!("llama-bpe"));
        let t = load(&tokenizer_from_gguf(&m).unwrap());
        assert_eq!(ids(&t, "ab", true), vec![0, 5]);
    }

    #[test]
    fn spm_scores_prefix_bytes_and_specials() {
        let export = tokenizer_from_gguf(&tiny_spm()).unwrap();
        let t = load(&export);
        // "▁abc": the highest-scoring candidate "bc" (-4) beats "ab" (-5), then "▁a" (-6);
        // BOS is added because "llama" vocabularies default to add_bos
        assert_eq!(ids(&t, "abc", true), vec![1, 8, 7]);
        // 'd' is not in the vocabulary: byte fallback
        assert_eq!(ids(&t, "d", false), vec![3, 9]);
        // user-defined token split out; every raw fragment gets the space prefix
        assert_eq!(ids(&t, "a<br>a", false), vec![8, 10, 8]);
        // control tokens are parsed unless encode_special_tokens is set
        assert_eq!(ids(&t, "</s>", false), vec![2]);
        let mut t2 = t.clone();
        t2.set_encode_special_tokens(true);
        assert_ne!(ids(&t2, "</s>", false), vec![2]);
        assert_eq!(t.decode(&ids(&t, "ab c", false), false).unwrap(), "ab c");
        let config: Value = serde_json::from_str(&export.tokenizer_config_json).unwrap();
        assert_eq!(config["add_bos_token"], json!(true));
        assert_eq!(config["unk_token"], json!("<unk>"));
        assert_eq!(config["eos_token"], json!("</s>"));
    }

    /// Fill-in-the-middle tokens the metadata names go into tokenizer_config.json's
    /// `fim_tokens` as texts (the runtime's `/infill` reads them); none named, none written.
    #[test]
    fn fim_tokens_named_by_metadata_are_recorded() {
        let mut m = tiny_spm();
        let none: Value =
            serde_json::from_str(&tokenizer_from_gguf(&m).unwrap().tokenizer_config_json).unwrap();
        assert!(none.get("fim_tokens").is_none(), "{none}");
        m.insert("tokenizer.ggml.fim_pre_token_id".into(), json!(6));
        m.insert("tokenizer.ggml.fim_mid_token_id".into(), json!(7));
        let export = tokenizer_from_gguf(&m).unwrap();
        let config: Value = serde_json::from_str(&export.tokenizer_config_json).unwrap();
        let tokens = m[KEY_TOKENS].as_array().unwrap();
        assert_eq!(
            config["fim_tokens"],
            json!({"prefix": tokens[6], "middle": tokens[7]}),
            "{config}"
        );
    }

    #[test]
    fn spm_without_space_prefix() {
        let mut m = tiny_spm();
        m.insert("tokenizer.ggml.add_space_prefix".into(), json!(false));
        m.insert("tokenizer.ggml.add_bos_token".into(), json!(false));
        let t = load(&tokenizer_from_gguf(&m).unwrap());
        assert_eq!(ids(&t, "ab", true), vec![6]);
        assert_eq!(ids(&t, " a", true), vec![8]);
    }

    fn err(m: &BTreeMap<String, Value>) -> TokenizerError {
        match tokenizer_from_gguf(m) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e,
        }
    }

    #[test]
    fn missing_tokens_array() {
        let mut m = tiny_gpt2();
        m.remove(KEY_TOKENS);
        let e = err(&m);
        assert!(
            matches!(&e, TokenizerError::MissingKey(k) if k == KEY_TOKENS),
            "{e}"
        );
    }

    #[test]
    fn tokens_of_wrong_type() {
        let mut m = tiny_gpt2();
        m.insert(KEY_TOKENS.into(), json!(["a", 3]));
        let e = err(&m);
        assert!(e.to_string().contains("tokenizer.ggml.tokens[1]"), "{e}");
    }

    #[test]
    fn unknown_model_type() {
        for model in ["bert", "t5", "rwkv"] {
            let mut m = tiny_gpt2();
            m.insert(KEY_MODEL.into(), json!(model));
            let e = err(&m);
            assert!(
                matches!(&e, TokenizerError::Unsupported(s) if s.contains(model)),
                "{e}"
            );
        }
    }

    #[test]
    fn unsupported_and_unknown_pre_tokenizers() {
        for pre in ["kimi-k2", "no-such-pre"] {
            let mut m = tiny_gpt2();
            m.insert(KEY_PRE.into(), json!(pre));
            let e = err(&m);
            assert!(
                matches!(&e, TokenizerError::Unsupported(s) if s.contains(pre)),
                "{e}"
            );
        }
    }

    #[test]
    fn malformed_merges() {
        for (merge, index, needle) in [
            ("ab", 1, "separated by a space"),
            ("a x", 1, "\"x\" is not in the vocabulary"),
            ("b a", 1, "\"ba\" is not in the vocabulary"),
        ] {
            let mut m = tiny_gpt2();
            m.insert(KEY_MERGES.into(), json!(["a b", merge]));
            let e = err(&m);
            assert!(
                matches!(&e, TokenizerError::MalformedMerge { index: i, reason, .. } if *i == index && reason.contains(needle)),
                "{e}"
            );
        }
        let mut m = tiny_gpt2();
        m.remove(KEY_MERGES);
        assert!(matches!(err(&m), TokenizerError::MissingKey(k) if k == KEY_MERGES));
    }

    #[test]
    fn bad_special_id_and_short_arrays() {
        let mut m = tiny_gpt2();
        m.insert("tokenizer.ggml.bos_token_id".into(), json!(99));
        assert!(matches!(
            err(&m),
            TokenizerError::BadTokenId {
                id: 99,
                n_tokens: 8,
                ..
            }
        ));
        let mut m = tiny_spm();
        m.insert(KEY_SCORES.into(), json!([0.0]));
        assert!(matches!(err(&m), TokenizerError::InvalidVocab(_)));
        let mut m = tiny_spm();
        m.insert(KEY_TOKENS.into(), json!(["a", "a"]));
        m.insert(KEY_SCORES.into(), json!([0.0, 0.0]));
        m.insert(KEY_TYPES.into(), json!([1, 1]));
        assert!(matches!(err(&m), TokenizerError::InvalidVocab(s) if s.contains("twice")));
    }

    #[test]
    fn every_supported_pre_tokenizer_builds() {
        // Each regex list must compile under Oniguruma.
        let names: Vec<&str> = SUPPORTED_PRE.to_vec();
        for pre in names {
            let mut m = tiny_gpt2();
            m.insert(KEY_PRE.into(), json!(pre));
            let export = tokenizer_from_gguf(&m).unwrap_or_else(|e| panic!("{pre}: {e}"));
            load(&export);
        }
    }
}
