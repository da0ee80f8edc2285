//! Text in and out: the Hugging Face tokenizer from `tokenizer.json`, the chat template and
//! special tokens from `tokenizer_config.json`, end-of-generation detection, and streaming
//! detokenization that never splits a UTF-8 character.

use crate::chat::{ChatTemplate, Message};
use crate::config::Config;
use crate::error::{Result, RuntimeError};
use std::path::Path;

/// Token texts that end a turn or the text when the vocabulary has them as special tokens.
pub const END_OF_GENERATION: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end|>",
    "</s>",
    "<eos>",
];

/// Tokenizer, chat template and special tokens of a model directory.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    template: Option<ChatTemplate>,
    bos_text: String,
}

/// Calls into the `tokenizers` crate, turning a panic into an error. The crate panics on some
/// malformed `tokenizer.json` files instead of returning an error (a syntax error inside the
/// `"decoder"` object hits an `expect`; huggingface/tokenizers#2151 lists panics at encode
/// and decode time too), and a model's tokenizer is input like any other.
fn guarded<T, E: std::fmt::Display>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| RuntimeError::Tokenizer(format!("{what}: {e}"))),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(RuntimeError::Tokenizer(format!(
                "{what}: the tokenizers library panicked ({msg}); the tokenizer is malformed"
            )))
        }
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

/// Largest `tokenizer.json` / `tokenizer_config.json` read (bounded before reading).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

impl TextTokenizer {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` (optional) from `dir`,
    /// each checked against the manifest's length and hash (format 1.1; a file the manifest
    /// does not list is not part of the model). A `tokenizer_config.json` that cannot be
    /// read, is not UTF-8 or not JSON is an error, never a silent switch to raw mode.
    pub fn load(dir: &Path, cfg: &Config) -> Result<TextTokenizer> {
        let bytes = gds_io::read_manifest(dir)?;
        let m = crate::plan::parse_manifest(dir, &bytes)?;
        let path = dir.join("tokenizer.json");
        let tok = gds_io::read_model_file(dir, &m, "tokenizer.json", MAX_TOKENIZER_BYTES)?
            .ok_or_else(|| RuntimeError::Tokenizer(format!("{} is missing", path.display())))?;
        let inner = guarded(&path.display().to_string(), || {
            tokenizers::Tokenizer::from_bytes(&tok.bytes)
        })?;
        let tc = crate::plan::tokenizer_config(dir, &m)?.unwrap_or(serde_json::Value::Null);
        let template_src = match tc.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        Self::build(
            inner,
            cfg,
            template_src.as_deref(),
            token_text(tc.get("bos_token")),
            token_text(tc.get("eos_token")),
            tc.get("add_bos_token").and_then(|v| v.as_bool()),
        )
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
                && (END_OF_GENERATION.contains(&tok.content.as_str()) || tok.content == eos_text)
                && !eog.contains(&id)
            {
                eog.push(id);
            }
        }
        eog.sort_unstable();
        let template = template
            .map(|src| ChatTemplate::new(src, &bos_text, &eos_text))
            .transpose()?;
        Ok(TextTokenizer {
            inner,
            bos,
            add_bos: add_bos.unwrap_or(cfg.add_bos) && bos.is_some(),
            eog,
            template,
            bos_text,
        })
    }

    /// Tokenizes `text`; special-token texts in it become their tokens. Prepends BOS when
    /// `with_bos` and the model adds one (as llama.cpp does) and the text does not already
    /// start with it.
    pub fn encode(&self, text: &str, with_bos: bool) -> Result<Vec<u32>> {
        let enc = guarded("encode", || self.inner.encode(text, false))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let Some(bos) = self.bos.filter(|_| with_bos && self.add_bos) {
            if enc.get_ids().first() != Some(&bos) {
                ids.push(bos);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes `ids` to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        guarded("decode", || self.inner.decode(ids, true))
    }

    /// True when `id` ends generation (EOS or an end-of-turn special token).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The end-of-generation token ids.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// True when tokenization prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The BOS token id, if any.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// True when the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders `messages` with the chat template (a generation prompt added), or errors when
    /// the model has none.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String> {
        match &self.template {
            Some(t) => t.render(messages, true),
            None => Err(RuntimeError::Template(
                "the model has no chat template in tokenizer_config.json (use --raw)".into(),
            )),
        }
    }

    /// Tokenizes a rendered chat prompt: BOS is added only when the template did not write
    /// it itself.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>> {
        let starts_with_bos = !self.bos_text.is_empty() && rendered.starts_with(&self.bos_text);
        self.encode(rendered, !starts_with_bos)
    }

    /// A fresh streaming decoder.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tok: self,
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
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl TextStream<'_> {
    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        guarded("decode", || {
            tokenizers::step_decode_stream(
                &self.tok.inner,
                vec![id],
                true,
                &mut self.ids,
                &mut self.prefix,
                &mut self.prefix_index,
            )
        })
    }

    /// Text still held back (an incomplete character at the end), decoded lossily.
    pub fn flush(&mut self) -> Result<String> {
        let all = guarded("decode", || self.tok.inner.decode(&self.ids, true))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            arch: "llama".into(),
            n_layers: 1,
            n_embd: 8,
            n_heads: 2,
            n_kv_heads: 1,
            n_ff: 16,
            vocab_size: 16,
            context_length: 64,
            head_dim: 4,
            rope_theta: 10000.0,
            rope_scaling: crate::RopeScaling::None,
            rms_norm_eps: 1e-5,
            tie_embeddings: true,
            bos_token_id: None,
            eos_token_id: None,
            add_bos: false,
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
        b.kv_str("general.architecture", "gemma3").add_file(
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
}
