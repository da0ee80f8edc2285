//! Text in and out: the Hugging Face tokenizer from `tokenizer.json`, the chat template and
//! special tokens from `tokenizer_config.json`, end-of-generation detection, and streaming
//! detokenization that never splits a UTF-8 character.

use crate::chat::{ChatTemplate, Message};
use crate::config::Config;
use crate::error::{Result, RuntimeError};
use std::path::Path;

/// Token texts that end a turn or the text when the vocabulary has them as special tokens
/// (llama.cpp's list, shared with the converter).
pub use gds_format::vocab::END_OF_GENERATION_TEXTS as END_OF_GENERATION;
use gds_format::vocab::FIM_END_OF_GENERATION_TEXTS as FIM_END_OF_GENERATION;
use gds_format::vocab::{FIM_CONFIG_KEY, FIM_SLOTS, FIM_TEXTS};

/// How a rendered chat ends ([`TextTokenizer::encode_chat_full`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatEnd {
    /// The assistant's turn opened (the template's generation prompt): the reply follows.
    Reply,
    /// As the conversation ends, no turn opened (`add_generation_prompt: false`).
    Closed,
    /// The last message (an assistant's) continued: the prompt ends right after its text.
    ContinueFinal,
}

/// How many DRY breaker lists' tables a tokenizer keeps ([`TextTokenizer::dry_breakers`]).
pub const DRY_TABLES_KEPT: usize = 8;

/// Tokenizer, chat template and special tokens of a model directory.
///
/// Text is plain text: special-token texts in it (`<|im_end|>`) are tokenized like any
/// other characters, unless a raw prompt asks for them to be parsed. Only the chat template
/// writes special tokens: message contents stay plain text inside the rendered chat, so a
/// message cannot forge turns or system prompts.
pub struct TextTokenizer {
    /// Parses special-token texts into their tokens.
    inner: tokenizers::Tokenizer,
    /// The same vocabulary with special-token texts read as plain text, made on first need:
    /// a second copy of a 262k-token vocabulary costs over 100 MB, and text without any
    /// special-token text encodes the same either way.
    literal: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// Ids of the special added tokens, sorted.
    special: Vec<u32>,
    /// Fill-in-the-middle tokens ([`Self::fim`]).
    fim: [Option<u32>; 6],
    /// Most bytes of text one token covers (an upper bound), computed on first need
    /// ([`Self::max_token_bytes`]): it decodes every token (0.35 s of CPU for Gemma 3's 262k,
    /// a fifth of a one-token `gdsrun run`), and text of at most one byte a token of its
    /// context fits without it.
    max_token_bytes: std::sync::OnceLock<usize>,
    /// Every token's bytes, read on first need (DRY's sequence breakers are found in them).
    pieces: std::sync::OnceLock<std::sync::Arc<crate::sampler::TokenPieces>>,
    infill: std::sync::OnceLock<std::sync::Arc<crate::sampler::InfillVocab>>,
    /// The last few DRY breaker lists' tables, most recent first.
    dry_tables: std::sync::Mutex<Vec<(Vec<String>, std::sync::Arc<crate::sampler::DryBreakers>)>>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    template: Option<ChatTemplate>,
    bos_text: String,
    /// The end-of-sequence token's text (a template's `eos_token`).
    eos_text: String,
}

/// Gives the heap pages freed after parsing `tokenizer.json` back to the OS. Parsing a large
/// vocabulary (Gemma's 262k tokens and 515k merges) leaves some hundred MB of small freed
/// blocks that glibc keeps mapped, which would count in the process's memory for its whole
/// life; elsewhere this is a no-op.
pub(crate) fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator's heaps to the kernel;
    // it takes no pointers and touches no allocated block.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A BPE model as `tokenizer.json` writes it, read directly (see [`parse_tokenizer`]).
#[derive(serde::Deserialize)]
struct BpeModelJson {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    dropout: Option<f32>,
    #[serde(default)]
    unk_token: Option<String>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    fuse_unk: bool,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    ignore_merges: bool,
    /// (the library's own map type: read straight into it, not into a map rebuilt after)
    vocab: tokenizers::models::bpe::Vocab,
    merges: Vec<MergeJson>,
}

/// A merge: `"a b"` (the older layout) or `["a", "b"]`, as its two tokens; a string without
/// a space is kept whole for the error that names it.
enum MergeJson {
    NotTwo(String),
    Pair(String, String),
}

/// Read by one visitor that takes either form: serde's untagged enums buffer every value as
/// a generic one before trying each variant, which was a sixth of Gemma 3's tokenizer load
/// (its 515k merges; 0.3 of 1.8 s of CPU for `gdsrun run` of one token on a Zen 4 core).
impl<'de> serde::Deserialize<'de> for MergeJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Merge;
        impl<'de> serde::de::Visitor<'de> for Merge {
            type Value = MergeJson;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(r#"a merge: "a b" or ["a", "b"]"#)
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> std::result::Result<MergeJson, E> {
                Ok(match s.split_once(' ') {
                    Some((a, b)) => MergeJson::Pair(a.to_string(), b.to_string()),
                    None => MergeJson::NotTwo(s.to_string()),
                })
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<MergeJson, A::Error> {
                use serde::de::Error;
                let a: String = seq
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(0, &self))?;
                let b: String = seq
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(1, &self))?;
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(A::Error::invalid_length(3, &self));
                }
                Ok(MergeJson::Pair(a, b))
            }
        }
        d.deserialize_any(Merge)
    }
}

/// Parses `tokenizer.json` into the same tokenizer as `tokenizers::Tokenizer::from_bytes`,
/// without its peak memory. The library reads the `model` object through an untagged
/// enum, which buffers the whole vocabulary and merge list twice as generic values before
/// building the model: Gemma 3's 262k tokens and 515k merges (14 MB of JSON) peak at
/// ~350 MB for a model that then holds ~80 MB. A BPE model is read here straight into its
/// vocabulary and merges and built by the library's own builder; the rest of the file goes
/// through the library with a placeholder model, and the added tokens are added after the
/// model, as the library's reader adds them (ids from the model's vocabulary, else after
/// it). Other model types go through the library unchanged.
pub fn parse_tokenizer(bytes: &[u8]) -> std::result::Result<tokenizers::Tokenizer, String> {
    use serde_json::value::RawValue;
    let whole = || tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| e.to_string());
    let Ok(top) = serde_json::from_slice::<std::collections::BTreeMap<String, &RawValue>>(bytes)
    else {
        return whole();
    };
    let Some(model) = top.get("model") else {
        return whole();
    };
    let Ok(bpe) = serde_json::from_str::<BpeModelJson>(model.get()) else {
        return whole();
    };
    if bpe.kind.as_deref().is_some_and(|k| k != "BPE") {
        return whole();
    }
    // the library's own entries (their `id` is only checked against the model, as here)
    let added: Vec<tokenizers::AddedToken> = match top.get("added_tokens") {
        Some(raw) => serde_json::from_str(raw.get()).map_err(|e| format!("added_tokens: {e}"))?,
        None => Vec::new(),
    };
    // the rest of the file, with a placeholder model and no added tokens
    let mut rest = String::with_capacity(bytes.len() / 8);
    rest.push('{');
    for (i, (k, v)) in top.iter().enumerate() {
        if i > 0 {
            rest.push(',');
        }
        rest.push_str(&serde_json::to_string(k).map_err(|e| e.to_string())?);
        rest.push(':');
        rest.push_str(match k.as_str() {
            "model" => r#"{"type":"BPE","vocab":{},"merges":[]}"#,
            "added_tokens" => "[]",
            _ => v.get(),
        });
    }
    rest.push('}');
    drop(top);
    let mut tok = tokenizers::Tokenizer::from_bytes(rest.as_bytes()).map_err(|e| e.to_string())?;
    drop(rest);
    let merges: Vec<(String, String)> = bpe
        .merges
        .into_iter()
        .map(|m| match m {
            MergeJson::Pair(a, b) => Ok((a, b)),
            MergeJson::NotTwo(s) => Err(format!("merge {s:?} is not two tokens")),
        })
        .collect::<std::result::Result<_, _>>()?;
    let mut b = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(bpe.vocab, merges)
        .fuse_unk(bpe.fuse_unk)
        .byte_fallback(bpe.byte_fallback)
        .ignore_merges(bpe.ignore_merges);
    if let Some(d) = bpe.dropout {
        b = b.dropout(d);
    }
    if let Some(u) = bpe.unk_token {
        b = b.unk_token(u);
    }
    if let Some(p) = bpe.continuing_subword_prefix {
        b = b.continuing_subword_prefix(p);
    }
    if let Some(p) = bpe.end_of_word_suffix {
        b = b.end_of_word_suffix(p);
    }
    tok.with_model(b.build().map_err(|e| e.to_string())?);
    tok.add_tokens(&added);
    Ok(tok)
}

/// Calls into the `tokenizers` crate, turning a panic into an error. The crate panics on some
/// malformed `tokenizer.json` files instead of returning an error (a syntax error inside the
/// `"decoder"` object hits an `expect`; huggingface/tokenizers#2151 lists panics at encode
/// and decode time too), and a model's tokenizer is input like any other.
pub(crate) fn guarded<T, E: std::fmt::Display>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T> {
    // (quietly: the panic becomes this error, not also a message and backtrace note)
    match gds_format::quiet_panic::catch(f) {
        Ok(r) => r.map_err(|e| RuntimeError::Tokenizer(format!("{what}: {e}"))),
        // Oniguruma gives up on one match after 10 M backtracking steps (its retry limit)
        Err(msg) if msg.contains("retry-limit") => Err(RuntimeError::Tokenizer(format!(
            "{what}: a regular expression of the tokenizer's pre-tokenizer backtracks without end on this text ({msg}); the tokenizer is hostile or broken"
        ))),
        Err(msg) => Err(RuntimeError::Tokenizer(format!(
            "{what}: the tokenizers library panicked ({msg}); the tokenizer is malformed"
        ))),
    }
}

/// A special-token entry of tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Largest `tokenizer.json` / `tokenizer_config.json` read (bounded before reading; one bound
/// with the converter's).
pub use gds_format::vocab::MAX_TOKENIZER_BYTES;

/// One past the largest token id `t` can produce (its model's vocabulary and its added tokens).
fn ids_end(t: &tokenizers::Tokenizer) -> u64 {
    // A model whose vocabulary of n tokens has an id for each of 0..n ends at n (every
    // BPE and Unigram file seen): checked id by id, which costs a few milliseconds where
    // a copy of the vocabulary as a map costs a tenth of a second at 262k tokens. Else
    // (ids with gaps) the whole vocabulary's largest id.
    use tokenizers::Model as _;
    let model = t.get_model();
    let n = u32::try_from(model.get_vocab_size()).unwrap_or(u32::MAX);
    let model_end = if (0..n).all(|id| model.id_to_token(id).is_some()) {
        u64::from(n)
    } else {
        model
            .get_vocab()
            .values()
            .max()
            .map_or(0, |&id| u64::from(id) + 1)
    };
    let added_end = t
        .get_added_tokens_decoder()
        .keys()
        .max()
        .map_or(0, |&id| u64::from(id) + 1);
    model_end.max(added_end)
}

/// An upper bound on the bytes of text one token of `t` covers: the longest decoded token,
/// plus one for a decoder that drops a leading space. (Decoding the whole vocabulary takes
/// ~70 ms of one core for SmolLM2's 49 152 tokens, hence in parallel.)
fn max_token_bytes(t: &tokenizers::Tokenizer) -> usize {
    use rayon::prelude::*;
    use tokenizers::Model as _;
    // the ids 0..n, n the tokens of the model and the added tokens beyond them (not
    // `get_vocab_size(true)`, which counts a copy of the whole vocabulary made as a map: a
    // tenth of a second at 262k tokens)
    let model = t.get_model();
    let added = t.get_added_tokens_decoder();
    let beyond = added
        .keys()
        .filter(|&&id| model.id_to_token(id).is_none())
        .count();
    let n = u32::try_from(model.get_vocab_size() + beyond).unwrap_or(u32::MAX);
    (0..n)
        .into_par_iter()
        .map(|id| t.decode(&[id], false).map_or(0, |s| s.len()))
        .max()
        .unwrap_or(0)
        + 1
}

/// The byte a byte-level vocabulary's character stands for (GPT-2's `bytes_to_unicode`,
/// reversed: printable Latin-1 bytes are themselves, the other 68 are the characters from
/// U+0100 on, in byte order).
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let c = c as u32;
    if printable(c) {
        return u8::try_from(c).ok();
    }
    let k = c.checked_sub(0x100)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(k as usize)
        .and_then(|b| u8::try_from(b).ok())
}

/// The private-use characters a placeholder marker may be.
const MARKER_RANGES: [std::ops::RangeInclusive<u32>; 3] =
    [0xE000..=0xF8FF, 0xF_0000..=0xF_FFFD, 0x10_0000..=0x10_FFFD];

/// A private-use character that none of `texts` contains (one pass over them).
fn free_marker<'a>(texts: impl Iterator<Item = &'a str>) -> Option<char> {
    let offsets = [0usize, 0x1900, 0x1900 + 0xFFFE];
    let mut used = vec![false; 0x1900 + 2 * 0xFFFE];
    for c in texts.flat_map(str::chars) {
        let c = c as u32;
        for (r, off) in MARKER_RANGES.iter().zip(offsets) {
            if r.contains(&c) {
                used[off + (c - r.start()) as usize] = true;
            }
        }
    }
    MARKER_RANGES
        .iter()
        .zip(offsets)
        .flat_map(|(r, off)| r.clone().enumerate().map(move |(i, c)| (off + i, c)))
        .find(|&(i, _)| !used[i])
        .and_then(|(_, c)| char::from_u32(c))
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` (optional) from `dir`,
    /// each checked against the manifest's length and hash (format 1.1; a file the manifest
    /// does not list is not part of the model). A `tokenizer_config.json` that cannot be
    /// read, is not UTF-8 or not JSON is an error, never a silent switch to raw mode.
    pub fn load(dir: &Path, cfg: &Config) -> Result<TextTokenizer> {
        let bytes = gds_io::read_manifest(dir)?;
        let m = crate::model_dir::parse_manifest(dir, &bytes)?;
        let path = dir.join("tokenizer.json");
        let tok = gds_io::read_model_file(dir, &m, "tokenizer.json", MAX_TOKENIZER_BYTES)?
            .ok_or_else(|| RuntimeError::Tokenizer(format!("{} is missing", path.display())))?;
        let inner = guarded(&path.display().to_string(), || parse_tokenizer(&tok.bytes))?;
        // its regular expressions are code from the model's files, checked for backtracking
        // as `gdsconv convert` checks them (a model converted before that check, or edited)
        gds_format::tokenizer_speed::check(&inner, &tok.bytes).map_err(|e| {
            RuntimeError::Tokenizer(format!("{}: the tokenizer is refused: {e}", path.display()))
        })?;
        drop(tok);
        release_freed_heap();
        let tc = crate::model_dir::tokenizer_config(dir, &m)?.unwrap_or(serde_json::Value::Null);
        let own = match tc.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        // The template is code from the model file: refused here, naming the file, when it
        // breaks the bounds of `gds_format::chat_template` or runs into its render limits on a
        // sample conversation (a model converted before those bounds existed).
        if let Some(src) = &own {
            gds_format::chat_template::check(src).map_err(|e| {
                RuntimeError::Template(format!(
                    "{}: the chat template is refused: {e}",
                    dir.join("tokenizer_config.json").display()
                ))
            })?;
        }
        let template_src = own
            // a model whose files carry no template (Gemma 3 GGUFs) gets its family's
            .or_else(|| gds_format::arch::family(&cfg.arch).and_then(|f| f.chat_template.clone()));
        let mut t = Self::build(
            inner,
            cfg,
            template_src.as_deref(),
            token_text(tc.get("bos_token")),
            token_text(tc.get("eos_token")),
            tc.get("add_bos_token").and_then(|v| v.as_bool()),
        )?;
        // the fill-in-the-middle tokens gdsconv recorded (a GGUF's metadata may name tokens
        // whose texts are not the usual ones); pad, repository and separator end generation
        if let Some(named) = tc.get(FIM_CONFIG_KEY).and_then(|v| v.as_object()) {
            for (slot, name) in FIM_SLOTS.iter().enumerate() {
                let id = named
                    .get(*name)
                    .and_then(|v| v.as_str())
                    .and_then(|text| t.inner.token_to_id(text));
                if let Some(id) = id {
                    t.fim[slot] = Some(id);
                    if slot >= 3 && t.is_special(id) && !t.eog.contains(&id) {
                        t.eog.push(id);
                        t.eog.sort_unstable();
                    }
                }
            }
        }
        Ok(t)
    }

    /// The fill-in-the-middle tokens: prefix, suffix, middle, pad, repository, file
    /// separator (`gds_format::vocab::FIM_SLOTS`), where the vocabulary has them.
    pub fn fim(&self) -> [Option<u32>; 6] {
        self.fim
    }

    /// [`TextTokenizer::load`] for running the model of `cfg`: refused when the tokenizer can
    /// produce a token id past the model's vocabulary (the embedding's rows), which
    /// generation would look up out of range.
    pub fn load_for_model(dir: &Path, cfg: &Config) -> Result<TextTokenizer> {
        let t = Self::load(dir, cfg)?;
        let end = t.ids_end();
        if end > cfg.vocab_size as u64 {
            return Err(RuntimeError::Tokenizer(format!(
                "{}: token ids up to {} but the model's vocabulary (the embedding's rows) has {}; convert the model again (gdsconv refuses such a tokenizer)",
                dir.join("tokenizer.json").display(),
                end - 1,
                cfg.vocab_size
            )));
        }
        Ok(t)
    }

    /// One past the largest token id this tokenizer can produce (vocabulary and added tokens).
    pub fn ids_end(&self) -> u64 {
        ids_end(&self.inner)
    }

    /// Assembles a tokenizer from parts (for tests and for callers with their own files).
    pub fn build(
        inner: tokenizers::Tokenizer,
        cfg: &Config,
        template: Option<&str>,
        bos_text: Option<String>,
        eos_text: Option<String>,
        add_bos: Option<bool>,
    ) -> Result<TextTokenizer> {
        let text_of = |id: Option<u32>| id.and_then(|i| inner.id_to_token(i));
        let bos = cfg
            .bos_token_id
            .or_else(|| bos_text.as_deref().and_then(|t| inner.token_to_id(t)));
        let bos_text = bos_text.or_else(|| text_of(bos)).unwrap_or_default();
        let eos = cfg
            .eos_token_id
            .or_else(|| eos_text.as_deref().and_then(|t| inner.token_to_id(t)));
        let eos_text = eos_text.or_else(|| text_of(eos)).unwrap_or_default();
        let mut eog: Vec<u32> = eos.into_iter().collect();
        for (id, tok) in inner.get_added_tokens_decoder() {
            if tok.special
                && (END_OF_GENERATION.contains(&tok.content.as_str())
                    || FIM_END_OF_GENERATION.contains(&tok.content.as_str())
                    || tok.content == eos_text)
                && !eog.contains(&id)
            {
                eog.push(id);
            }
        }
        eog.sort_unstable();
        // llama.cpp's fill-in-the-middle tokens by text: of a slot's candidates the vocabulary
        // has, the first in byte order
        let fim = FIM_TEXTS.map(|texts| {
            texts
                .iter()
                .filter_map(|t| Some((*t, inner.token_to_id(t)?)))
                .min_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()))
                .map(|(_, id)| id)
        });
        let template = template
            .map(|src| ChatTemplate::new(src, &bos_text, &eos_text))
            .transpose()?;
        let mut special: Vec<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        special.sort_unstable();
        Ok(TextTokenizer {
            fim,
            max_token_bytes: std::sync::OnceLock::new(),
            pieces: std::sync::OnceLock::new(),
            infill: std::sync::OnceLock::new(),
            dry_tables: std::sync::Mutex::new(Vec::new()),
            literal: std::sync::OnceLock::new(),
            special,
            inner,
            bos,
            eos,
            add_bos: add_bos.unwrap_or(cfg.add_bos) && bos.is_some(),
            eog,
            template,
            bos_text,
            eos_text,
        })
    }

    /// Replaces the model's chat template with `src` (`--chat-template-file`: the plan has
    /// read it and checked it against [`gds_format::chat_template`]'s bounds, as a model's).
    pub fn set_chat_template(&mut self, src: &str) -> Result<()> {
        self.template = Some(self.compile_template(src)?);
        Ok(())
    }

    /// Tokenizes `text`. Special-token texts in it become their tokens only when
    /// `parse_special`; otherwise they are plain text. Prepends BOS when `with_bos` and the
    /// model adds one (as llama.cpp does) and the text does not already start with it.
    pub fn encode(&self, text: &str, with_bos: bool, parse_special: bool) -> Result<Vec<u32>> {
        let ids = if parse_special {
            guarded("encode", || self.inner.encode(text, false))?
                .get_ids()
                .to_vec()
        } else {
            self.encode_literal(text)?
        };
        Ok(self.with_bos(ids, with_bos))
    }

    /// Tokenizes `text` with special-token texts read as plain text. Parsing them gives the
    /// same ids as not parsing them unless a special token appears; only then is the literal
    /// tokenizer made (once) and used.
    fn encode_literal(&self, text: &str) -> Result<Vec<u32>> {
        let enc = guarded("encode", || self.inner.encode(text, false))?;
        if !enc
            .get_ids()
            .iter()
            .any(|id| self.special.binary_search(id).is_ok())
        {
            return Ok(enc.get_ids().to_vec());
        }
        let literal = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            // (the library's name: special tokens are "encoded" like text, not split out)
            t.set_encode_special_tokens(true);
            t
        });
        let enc = guarded("encode", || literal.encode(text, false))?;
        Ok(enc.get_ids().to_vec())
    }

    fn with_bos(&self, mut ids: Vec<u32>, with_bos: bool) -> Vec<u32> {
        if let Some(bos) = self.bos.filter(|_| with_bos && self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    }

    /// Most bytes of text one token covers (at least 1): text longer than `ctx` times this
    /// cannot fit in `ctx` tokens. Computed on the first call, by decoding every token; a
    /// decoder that panics on one is an error naming the tokenizers library.
    pub fn max_token_bytes(&self) -> Result<usize> {
        if let Some(&n) = self.max_token_bytes.get() {
            return Ok(n);
        }
        let n = guarded("decode", || {
            Ok::<_, std::convert::Infallible>(max_token_bytes(&self.inner))
        })?;
        Ok(*self.max_token_bytes.get_or_init(|| n))
    }

    /// Errs when `bytes` of text cannot fit in `ctx` tokens, before anything is tokenized.
    pub fn check_fits(&self, bytes: usize, ctx: usize) -> Result<()> {
        // every token covers at least a byte: text of at most `ctx` bytes is not refused, and
        // needs no bound (the prompts of most requests)
        if bytes <= ctx {
            return Ok(());
        }
        let per_token = self.max_token_bytes()?;
        let limit = ctx.saturating_mul(per_token);
        if bytes > limit {
            return Err(RuntimeError::TextTooLong {
                bytes,
                limit,
                ctx,
                per_token,
            });
        }
        Ok(())
    }

    /// Tokenizes a raw prompt for a context of `ctx` tokens: with BOS when the model adds
    /// one, special-token texts parsed only when `parse_special`. Text too long to fit is
    /// refused before tokenizing ([`RuntimeError::TextTooLong`]).
    pub fn encode_prompt(&self, text: &str, parse_special: bool, ctx: usize) -> Result<Vec<u32>> {
        self.check_fits(text.len(), ctx)?;
        self.encode(text, true, parse_special)
    }

    /// Decodes `ids` to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        guarded("decode", || self.inner.decode(ids, true))
    }

    /// True when `id` is a special token (decoding drops it).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.binary_search(&id).is_ok()
    }

    /// A prompt's last tokens as text, special tokens included: how its end leaves the reply
    /// (inside a thinking the template opened, or not).
    pub fn prompt_tail(&self, prompt: &[u32]) -> String {
        let tail = &prompt[prompt.len().saturating_sub(16)..];
        self.inner.decode(tail, false).unwrap_or_default()
    }

    /// True when `id` adds text to a reply that keeps the special tokens `keep` (sorted):
    /// every token but the other special ones ([`TextStream`], the server's decoder).
    pub fn shows(&self, id: u32, keep: &[u32]) -> bool {
        !self.is_special(id) || keep.binary_search(&id).is_ok()
    }

    /// The ids of those of `texts` that are special tokens of the vocabulary: for a reply
    /// whose markers must stay in its text ([`Self::is_special`] tokens are dropped
    /// otherwise).
    pub fn special_ids<'a>(&self, texts: impl IntoIterator<Item = &'a str>) -> Vec<u32> {
        let mut ids: Vec<u32> = texts
            .into_iter()
            .filter_map(|t| self.inner.token_to_id(t))
            .filter(|&id| self.is_special(id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// True when `id` ends generation (EOS or an end-of-turn special token).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The end-of-generation token ids.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The bytes of text token `id` stands for, exactly: where one token is part of a
    /// character (a byte-level vocabulary's pieces of an emoji, a byte-fallback `<0xE6>`),
    /// its own bytes, which decoding it alone would replace by U+FFFD. Added and special
    /// tokens, and vocabularies of other decoders, as decoding them gives them.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        use tokenizers::DecoderWrapper as D;
        let decoded = || {
            self.inner
                .decode(&[id], false)
                .unwrap_or_default()
                .into_bytes()
        };
        let Some(piece) = self.inner.id_to_token(id) else {
            return decoded();
        };
        // (the borrowed map: `Tokenizer::get_added_tokens_decoder` clones it per call, and
        // this runs for every listed token and alternative; special tokens are added ones)
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        if added.contains_key(&id) {
            return decoded();
        }
        let decoders: &[D] = match self.inner.get_decoder() {
            Some(D::Sequence(s)) => s.get_decoders(),
            Some(d) => std::slice::from_ref(d),
            None => &[],
        };
        if decoders.iter().any(|d| matches!(d, D::ByteLevel(_))) {
            // GPT-2's map of bytes to printable characters, reversed (the tokenizers crate
            // keeps its table private)
            return piece
                .chars()
                .map(byte_level_byte)
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(decoded);
        }
        if decoders.iter().any(|d| matches!(d, D::ByteFallback(_))) {
            let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
            if let Some(b) = hex
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                return vec![b];
            }
        }
        decoded()
    }

    /// DRY's sequence breakers as this vocabulary's tokens, as llama.cpp processes them
    /// (every token holding a breaker, or ending with its start and the rest's tokens). The
    /// tokens' bytes are read on the first call (in parallel: 0.4 s at 262k tokens on two
    /// cores), a new list then costs ~30 ms; the tables of the last [`DRY_TABLES_KEPT`]
    /// lists are kept.
    pub fn dry_breakers(&self, breakers: &[String]) -> std::sync::Arc<crate::sampler::DryBreakers> {
        let mut kept = self
            .dry_tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let hit = |kept: &mut Vec<(Vec<String>, _)>| {
            let i = kept.iter().position(|(b, _)| b == breakers)?;
            kept[..=i].rotate_right(1);
            Some(std::sync::Arc::clone(&kept[0].1))
        };
        if let Some(t) = hit(&mut kept) {
            return t;
        }
        drop(kept);
        let pieces = self.token_pieces();
        let t = std::sync::Arc::new(crate::sampler::DryBreakers::build(&pieces, breakers, |s| {
            self.encode(s, false, false).unwrap_or_default()
        }));
        let mut kept = self
            .dry_tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // (another request may have built the same list meanwhile: one entry a list)
        if let Some(t) = hit(&mut kept) {
            return t;
        }
        kept.insert(0, (breakers.to_vec(), t.clone()));
        kept.truncate(DRY_TABLES_KEPT);
        t
    }

    /// Every token's bytes ([`Self::token_bytes`]), read on the first call (in parallel).
    fn token_pieces(&self) -> std::sync::Arc<crate::sampler::TokenPieces> {
        use rayon::prelude::*;
        self.pieces
            .get_or_init(|| {
                let n = u32::try_from(self.ids_end()).unwrap_or(u32::MAX);
                let all: Vec<Vec<u8>> = (0..n)
                    .into_par_iter()
                    .map(|id| self.token_bytes(id))
                    .collect();
                std::sync::Arc::new(crate::sampler::TokenPieces::new(all))
            })
            .clone()
    }

    /// What llama.cpp's infill sampler reads of this vocabulary (its tokens' texts, special
    /// and end-of-generation tokens, and the token it falls back on: the end-of-turn one
    /// llama.cpp finds by its text, else EOS), built on the first call.
    pub fn infill_vocab(&self) -> std::sync::Arc<crate::sampler::InfillVocab> {
        self.infill
            .get_or_init(|| {
                let text = |id: &u32| self.inner.id_to_token(*id).unwrap_or_default();
                let eot = self
                    .eog
                    .iter()
                    .find(|id| gds_format::vocab::END_OF_TURN_TEXTS.contains(&text(id).as_str()));
                let fallback = eot.or(self.eos.as_ref()).or(self.eog.first()).copied();
                std::sync::Arc::new(crate::sampler::InfillVocab::new(
                    self.token_pieces(),
                    self.special.clone(),
                    self.eog.clone(),
                    fallback.unwrap_or(0),
                ))
            })
            .clone()
    }

    /// True when tokenization prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The BOS token id, if any.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS token id, if any (one of [`Self::eog_ids`]).
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// True when the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Compiles a chat template other than the model's (`--chat-template-file`, a request's
    /// own) with this vocabulary's BOS and EOS texts; `src` was checked against a model
    /// template's bounds ([`crate::plan::chat_template_source`]).
    pub fn compile_template(&self, src: &str) -> Result<ChatTemplate> {
        ChatTemplate::new(src, &self.bos_text, &self.eos_text)
    }

    fn template(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().ok_or_else(|| {
            RuntimeError::Template(
                "the model has no chat template in tokenizer_config.json (use --raw)".into(),
            )
        })
    }

    /// Renders `messages` with the chat template (a generation prompt added), or errors when
    /// the model has none.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String> {
        self.template()?.render(messages, true)
    }

    /// Renders `messages` with the chat template (a generation prompt added) and tokenizes
    /// the result for a context of `ctx` tokens. The template's own special tokens are
    /// tokens; message contents are plain text, special-token texts in them included. BOS
    /// is added only when the template did not write it itself. Text too long to fit is
    /// refused before tokenizing ([`RuntimeError::TextTooLong`]).
    ///
    /// How: special-token texts in contents are replaced by placeholders (a private-use
    /// character around an index) before rendering, so every special token left in the
    /// rendered text is the template's. Without any such text this is exactly the
    /// tokenization of the rendered chat. Otherwise the rendered text is split at the
    /// template's special tokens and the pieces between them, placeholders restored, are
    /// tokenized as plain text (as the library itself tokenizes the pieces between special
    /// tokens). Roles are not guarded: callers pass fixed role names.
    pub fn encode_chat(&self, messages: &[Message], ctx: usize) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None, ctx)
    }

    /// [`TextTokenizer::encode_chat`] with function definitions for the template's `tools`
    /// variable. Special-token texts in the tools and in messages' tool calls are plain
    /// text, as in contents.
    pub fn encode_chat_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        ctx: usize,
    ) -> Result<Vec<u32>> {
        self.encode_chat_full(messages, tools, None, ctx, ChatEnd::Reply, None)
    }

    /// [`TextTokenizer::encode_chat_full`] for a conversation that may not fit a context of
    /// `ctx` tokens: where the whole does not (its tokens are `ctx` or more, or its text is
    /// refused as too long), the oldest messages are left out, as few as make the rest fit,
    /// the system (and developer) messages among them kept; what is kept starts at a user
    /// message or is the last message alone (Ollama's `truncate`, the Responses API's
    /// `truncation: "auto"`, `gdsrun run`'s chat). Returns the tokens and where the kept
    /// messages start (0: all kept; [`crate::chat::without_oldest`] gives the conversation
    /// they render); the last message alone too long gives its tokens (the caller refuses
    /// them) or its error. A binary search over where the kept messages start: a few
    /// renderings, however long the conversation.
    pub fn encode_chat_fitting(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        vars: Option<&serde_json::Map<String, serde_json::Value>>,
        ctx: usize,
        end: ChatEnd,
        template: Option<&ChatTemplate>,
    ) -> Result<(Vec<u32>, usize)> {
        let render = |from: usize| {
            let kept = crate::chat::without_oldest(messages, from);
            self.encode_chat_full(&kept, tools, vars, ctx, end, template)
        };
        let fits = |r: &Result<Vec<u32>>| matches!(r, Ok(t) if t.len() < ctx);
        let whole = render(0);
        let too_long = match &whole {
            Ok(t) => t.len() >= ctx,
            Err(e) => matches!(e, RuntimeError::TextTooLong { .. }),
        };
        let Some(last) = messages.len().checked_sub(1).filter(|&l| too_long && l > 0) else {
            return whole.map(|t| (t, 0));
        };
        // where the kept part may start: a user message (a conversation does not start with
        // an orphaned reply or tool result), or the last message
        let starts: Vec<usize> = (1..last)
            .filter(|&i| messages[i].role == "user")
            .chain([last])
            .collect();
        let mut best = render(last);
        if !fits(&best) {
            return best.map(|t| (t, last));
        }
        // the first start that fits: fewer messages, fewer tokens (a start whose rendering
        // fails counts as not fitting)
        let (mut lo, mut hi) = (0, starts.len() - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let r = render(starts[mid]);
            if fits(&r) {
                hi = mid;
                best = r;
            } else {
                lo = mid + 1;
            }
        }
        best.map(|t| (t, starts[hi]))
    }

    /// [`TextTokenizer::encode_chat_with_tools`], the conversation ending as `end` says:
    /// with the assistant's turn opened (the template's generation prompt), closed as it is
    /// (`add_generation_prompt: false`), or with the last message (an assistant's, the start
    /// of the reply: Anthropic's prefill, vLLM's `continue_final_message`) continued rather
    /// than closed: rendered without a generation prompt and cut right after that message's
    /// text, so the template's end-of-turn marker is not in the prompt. `vars`: more template
    /// variables (a request's `chat_template_kwargs`); special-token texts in them are plain
    /// text, as in contents. `template`: another than the model's (a request's own,
    /// [`TextTokenizer::compile_template`]).
    pub fn encode_chat_full(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        vars: Option<&serde_json::Map<String, serde_json::Value>>,
        ctx: usize,
        end: ChatEnd,
        template: Option<&ChatTemplate>,
    ) -> Result<Vec<u32>> {
        let continue_final = end == ChatEnd::ContinueFinal;
        let template = match template {
            Some(t) => t,
            None => self.template()?,
        };
        // the tool calls and tools as text: their length counts, and the marker must not
        // occur in them
        let json_texts: Vec<String> = messages
            .iter()
            .filter_map(|m| m.tool_calls.as_ref().map(|v| v.to_string()))
            .chain(tools.map(|v| v.to_string()))
            .chain(vars.map(|v| serde_json::Value::Object(v.clone()).to_string()))
            .collect();
        self.check_fits(
            messages
                .iter()
                .map(|m| m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len))
                .sum::<usize>()
                + json_texts.iter().map(String::len).sum::<usize>(),
            ctx,
        )?;
        let texts = messages
            .iter()
            .map(|m| m.content.as_str())
            .chain(
                messages
                    .iter()
                    .filter_map(|m| m.reasoning_content.as_deref()),
            )
            .chain(json_texts.iter().map(String::as_str))
            .chain([template.source()]);
        let marker = free_marker(texts).ok_or_else(|| {
            RuntimeError::Template("the messages use every private-use character".into())
        })?;
        let mut hidden = Vec::new();
        let guarded: Vec<Message> = messages
            .iter()
            .map(|m| Message {
                role: m.role.clone(),
                content: self.hide_specials(&m.content, marker, &mut hidden),
                tool_calls: m
                    .tool_calls
                    .as_ref()
                    .map(|v| self.hide_specials_json(v, marker, &mut hidden)),
                tool_call_id: m
                    .tool_call_id
                    .as_ref()
                    .map(|id| self.hide_specials(id, marker, &mut hidden)),
                reasoning_content: m
                    .reasoning_content
                    .as_ref()
                    .map(|r| self.hide_specials(r, marker, &mut hidden)),
            })
            .collect();
        let tools = tools.map(|v| self.hide_specials_json(v, marker, &mut hidden));
        let vars = vars.map(|v| {
            match self.hide_specials_json(
                &serde_json::Value::Object(v.clone()),
                marker,
                &mut hidden,
            ) {
                serde_json::Value::Object(m) => m,
                _ => serde_json::Map::new(),
            }
        });
        let mut rendered = template.render_with(
            &guarded,
            end == ChatEnd::Reply,
            tools.as_ref(),
            vars.as_ref(),
        )?;
        if continue_final {
            let last = guarded.last().map_or("", |m| m.content.as_str());
            rendered.truncate(end_of_final(&rendered, last)?);
        }
        self.check_fits(rendered.len(), ctx)?;
        let with_bos = self.bos_text.is_empty() || !rendered.starts_with(&self.bos_text);
        if hidden.is_empty() {
            return self.encode(&rendered, with_bos, true);
        }
        let mut ids = Vec::new();
        let mut pos = 0;
        for (start, end, tokens) in self.special_matches(&rendered) {
            self.encode_plain(&rendered[pos..start], marker, &hidden, &mut ids)?;
            ids.extend(tokens);
            pos = end;
        }
        self.encode_plain(&rendered[pos..], marker, &hidden, &mut ids)?;
        Ok(self.with_bos(ids, with_bos))
    }

    /// Where special tokens are in `text`, as the tokenizer's added vocabulary finds them:
    /// (start, end, token ids), in order, not overlapping.
    fn special_matches(&self, text: &str) -> Vec<(usize, usize, Vec<u32>)> {
        use tokenizers::{OffsetReferential, OffsetType};
        let split = self
            .inner
            .get_added_vocabulary()
            .extract_and_normalize(self.inner.get_normalizer(), text);
        let mut out: Vec<(usize, usize, Vec<u32>)> = Vec::new();
        for (_, (start, end), tokens) in
            split.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            let Some(tokens) = tokens else { continue };
            let ids: Vec<u32> = tokens.iter().map(|t| t.id).collect();
            let in_order = out.last().is_none_or(|l| l.1 <= start);
            if in_order
                && text.get(start..end).is_some()
                && ids.iter().all(|id| self.special.binary_search(id).is_ok())
            {
                out.push((start, end, ids));
            }
        }
        out
    }

    /// [`TextTokenizer::hide_specials`] on every string (keys included) of a JSON value.
    fn hide_specials_json(
        &self,
        v: &serde_json::Value,
        marker: char,
        hidden: &mut Vec<String>,
    ) -> serde_json::Value {
        use serde_json::Value as J;
        match v {
            J::String(s) => J::String(self.hide_specials(s, marker, hidden)),
            J::Array(a) => J::Array(
                a.iter()
                    .map(|x| self.hide_specials_json(x, marker, hidden))
                    .collect(),
            ),
            J::Object(o) => J::Object(
                o.iter()
                    .map(|(k, x)| {
                        (
                            self.hide_specials(k, marker, hidden),
                            self.hide_specials_json(x, marker, hidden),
                        )
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// The chat template, when the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// `content` with each special-token text replaced by `marker`, its index in `hidden`,
    /// `marker`; the texts are pushed to `hidden`.
    fn hide_specials(&self, content: &str, marker: char, hidden: &mut Vec<String>) -> String {
        let mut out = String::with_capacity(content.len());
        let mut pos = 0;
        for (start, end, _) in self.special_matches(content) {
            out.push_str(&content[pos..start]);
            out.push(marker);
            out.push_str(&hidden.len().to_string());
            out.push(marker);
            hidden.push(content[start..end].to_string());
            pos = end;
        }
        out.push_str(&content[pos..]);
        out
    }

    /// Tokenizes `piece` (no template special tokens in it) as plain text, its placeholders
    /// restored first, appending to `ids`.
    fn encode_plain(
        &self,
        piece: &str,
        marker: char,
        hidden: &[String],
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        let mut text = String::with_capacity(piece.len());
        // the parts alternate: text, index, text, ..., text
        let mut at_text = false;
        for part in piece.split(marker) {
            at_text = !at_text;
            if at_text {
                text.push_str(part);
                continue;
            }
            let original = part.parse::<usize>().ok().and_then(|k| hidden.get(k));
            match original {
                Some(o) => text.push_str(o),
                None => {
                    return Err(RuntimeError::Template(
                        "the chat template altered a message's placeholder".into(),
                    ))
                }
            }
        }
        if !at_text {
            return Err(RuntimeError::Template(
                "the chat template cut a message's placeholder".into(),
            ));
        }
        if !text.is_empty() {
            ids.extend_from_slice(&self.encode_literal(&text)?);
        }
        Ok(())
    }

    /// A fresh streaming decoder (special tokens add no text).
    pub fn stream(&self) -> TextStream<'_> {
        self.stream_keeping(&[])
    }

    /// A fresh streaming decoder whose text keeps the special tokens `keep` (sorted; the
    /// markers of a chat template's thinking, [`Self::special_ids`]); other special tokens
    /// add no text.
    pub fn stream_keeping(&self, keep: &[u32]) -> TextStream<'_> {
        TextStream {
            tok: self,
            keep: keep.to_vec(),
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Turns a stream of token ids into text pieces, holding back bytes until they form whole
/// UTF-8 characters (a character may span several byte-level tokens).
pub struct TextStream<'t> {
    tok: &'t TextTokenizer,
    /// Special tokens whose text is kept (sorted).
    keep: Vec<u32>,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl TextStream<'_> {
    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        // special tokens other than the kept ones never enter the decoded ids, so the rest
        // decodes with special tokens as text
        if !self.tok.shows(id, &self.keep) {
            return Ok(None);
        }
        guarded("decode", || {
            tokenizers::step_decode_stream(
                &self.tok.inner,
                vec![id],
                false,
                &mut self.ids,
                &mut self.prefix,
                &mut self.prefix_index,
            )
        })
    }

    /// Text still held back (an incomplete character at the end), decoded lossily.
    pub fn flush(&mut self) -> Result<String> {
        let all = guarded("decode", || self.tok.inner.decode(&self.ids, false))?;
        self.ids.clear();
        let rest = all
            .strip_prefix(self.prefix.as_str())
            .unwrap_or("")
            .to_string();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(rest)
    }
}

/// Where the final message's text `last` ends in the rendered chat (its last occurrence;
/// trailing whitespace may have been trimmed by the template).
fn end_of_final(rendered: &str, last: &str) -> Result<usize> {
    [last, last.trim_end()]
        .into_iter()
        .filter(|t| !t.is_empty())
        .find_map(|t| rendered.rfind(t).map(|at| at + t.len()))
        .ok_or_else(|| {
            RuntimeError::Template(
                "the reply to continue (the final assistant message) must be non-empty text that the chat template writes as it is".into(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_final_message_is_continued_after_its_text() {
        let r = "<u>The sky is</u><a>The sky is blue </a>";
        // the last occurrence, end-of-turn marker cut
        assert_eq!(
            &r[..end_of_final(r, "The sky is").unwrap()],
            "<u>The sky is</u><a>The sky is"
        );
        // a template that trims: found without the trailing space
        let t = "<a>Yes</a>";
        assert_eq!(&t[..end_of_final(t, "Yes \n").unwrap()], "<a>Yes");
        // empty, or rewritten by the template: refused
        assert!(end_of_final(t, "").is_err());
        assert!(end_of_final(t, "No").is_err());
    }

    fn config() -> Config {
        Config {
            context_length: 64,
            attn_scale: 0.5,
            ..Config::for_tests(2, 1, 4)
        }
    }

    /// Found by the `tokenizer` fuzz target: a syntax error inside `"decoder"` makes
    /// `tokenizers` 0.22 panic (`expect("Helper")`) instead of returning an error.
    #[test]
    fn load_reports_a_malformed_decoder_instead_of_panicking() {
        let dir = tempfile::tempdir().unwrap();
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,
            "decoder":{"type":"ByteLevel", A "add_prefix_space":true},
            "model":{"type":"BPE","vocab":{"a":0},"merges":[]}}"#;
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        // (an architecture gdsrun does not run needs no hyperparameters in the manifest)
        let mut b = gds_format::ManifestBuilder::new();
        b.kv_str("general.architecture", "mamba").add_file(
            "tokenizer.json",
            gds_format::file_role::TOKENIZER,
            json.len() as u64,
            gds_io::verify::hash_bytes(json.as_bytes()),
        );
        std::fs::write(dir.path().join(gds_format::MANIFEST_FILE), b.finish()).unwrap();
        let err = TextTokenizer::load(dir.path(), &config())
            .err()
            .expect("a malformed tokenizer.json is an error");
        let msg = err.to_string();
        assert!(
            msg.contains("tokenizer.json") && msg.contains("malformed"),
            "{msg}"
        );
    }

    /// A BPE `tokenizer.json` of `vocab` and `merges` (JSON), with `added` tokens.
    fn bpe_json(vocab: &str, merges: &str, added: &str) -> String {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":{added},
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{{"type":"BPE","vocab":{vocab},"merges":{merges}}}}}"#
        )
    }

    /// Merges as `"a b"` and as `["a", "b"]` read as the library reads them (the same
    /// tokens for text that needs the merges); a merge of one token is an error naming it,
    /// one of three tokens the library's own error.
    #[test]
    fn merges_read_in_either_layout() {
        let vocab = r#"{"a":0,"b":1,"c":2,"ab":3,"abc":4}"#;
        for merges in [r#"["a b","ab c"]"#, r#"[["a","b"],["ab","c"]]"#] {
            let json = bpe_json(vocab, merges, "[]");
            let lean = parse_tokenizer(json.as_bytes()).unwrap();
            let lib = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
            for text in ["abc", "ab", "cab", "abcabc"] {
                let ids =
                    |t: &tokenizers::Tokenizer| t.encode(text, false).unwrap().get_ids().to_vec();
                assert_eq!(ids(&lean), ids(&lib), "{merges}: {text}");
            }
            assert_eq!(ids_end(&lean), 5);
        }
        let one = bpe_json(vocab, r#"["ab"]"#, "[]");
        let e = parse_tokenizer(one.as_bytes()).unwrap_err();
        assert!(e.contains("is not two tokens"), "{e}");
        let three = bpe_json(vocab, r#"[["a","b","c"]]"#, "[]");
        assert!(parse_tokenizer(three.as_bytes()).is_err());
    }

    /// One past the largest id, as the whole vocabulary's map says: a vocabulary with a gap
    /// ends after its largest id; an added token not in the vocabulary takes the next id
    /// (the library's reader ignores the id the file gives it), in the vocabulary its own.
    #[test]
    fn ids_end_counts_gaps_and_added_tokens() {
        let by_map = |t: &tokenizers::Tokenizer| {
            t.get_vocab(true)
                .values()
                .max()
                .map_or(0, |&id| u64::from(id) + 1)
        };
        let added = |content: &str| {
            format!(
                r#"[{{"id":9,"content":"{content}","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}]"#
            )
        };
        for (vocab, added, end) in [
            (r#"{"a":0,"b":1,"bbbbbbbb":7}"#, "[]".to_string(), 8),
            (r#"{"a":0,"b":1}"#, added("<x>"), 3),
            (r#"{"a":0,"b":1,"<x>":5}"#, added("<x>"), 6),
            (r#"{"a":0,"b":1,"bb":2}"#, added("<x>"), 4),
        ] {
            let t = parse_tokenizer(bpe_json(vocab, "[]", &added).as_bytes()).unwrap();
            assert_eq!(ids_end(&t), end, "{vocab} {added}");
            assert_eq!(by_map(&t), end, "{vocab} {added}");
        }
    }

    /// A model directory with `tokenizer.json` (a vocabulary of `n` tokens, ids 0..n) and,
    /// when given, `tokenizer_config.json`, listed in the manifest as convert writes them.
    fn model_dir(n: usize, config: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let vocab: serde_json::Map<String, serde_json::Value> = (0..n)
            .map(|i| (format!("t{i}"), serde_json::json!(i)))
            .collect();
        let json = serde_json::json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "vocab": vocab, "merges": []}})
        .to_string();
        let mut b = gds_format::ManifestBuilder::new();
        b.kv_str("general.architecture", "mamba");
        for (name, role, bytes) in [
            (
                "tokenizer.json",
                gds_format::file_role::TOKENIZER,
                Some(json.as_str()),
            ),
            (
                "tokenizer_config.json",
                gds_format::file_role::TOKENIZER_CONFIG,
                config,
            ),
        ] {
            if let Some(bytes) = bytes {
                std::fs::write(dir.path().join(name), bytes).unwrap();
                b.add_file(
                    name,
                    role,
                    bytes.len() as u64,
                    gds_io::verify::hash_bytes(bytes.as_bytes()),
                );
            }
        }
        std::fs::write(dir.path().join(gds_format::MANIFEST_FILE), b.finish()).unwrap();
        dir
    }

    /// Regression (issue 33): a tokenizer with ids past the model's vocabulary loaded, and
    /// generating such an id crashed (exit 4). Loading it for the model is an error naming
    /// tokenizer.json.
    #[test]
    fn a_tokenizer_with_ids_past_the_vocabulary_is_refused_for_the_model() {
        let dir = model_dir(20, None);
        let err = TextTokenizer::load_for_model(dir.path(), &config())
            .err()
            .expect("20 ids for a vocabulary of 16");
        let msg = err.to_string();
        assert!(
            msg.contains("tokenizer.json") && msg.contains("up to 19") && msg.contains("16"),
            "{msg}"
        );
        let dir = model_dir(16, None);
        TextTokenizer::load_for_model(dir.path(), &config()).unwrap();
    }

    /// Regression (issue 33): hostile chat templates in a model file (a 20 000-term `+` chain
    /// overflowed the stack, an endless loop ran for ever) are refused at load, naming
    /// tokenizer_config.json.
    #[test]
    fn hostile_chat_templates_are_refused_at_load() {
        for (template, want) in [
            (format!("{{{{ 1{} }}}}", " + 1".repeat(20_000)), "operators"),
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                    .to_string(),
                "instructions",
            ),
        ] {
            let cfg = serde_json::json!({ "chat_template": template }).to_string();
            let dir = model_dir(16, Some(&cfg));
            let msg = TextTokenizer::load(dir.path(), &config())
                .err()
                .expect("refused")
                .to_string();
            assert!(
                msg.contains("tokenizer_config.json") && msg.contains(want),
                "{msg}"
            );
        }
        let cfg = serde_json::json!({ "chat_template": "{{ messages[0].content }}" }).to_string();
        let t = TextTokenizer::load(model_dir(16, Some(&cfg)).path(), &config()).unwrap();
        assert!(t.has_chat_template());
    }
}
