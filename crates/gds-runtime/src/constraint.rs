//! Constrained decoding: the output is held to a JSON schema, a Lark grammar or a regular
//! expression, token by token. The grammar engine is [llguidance] (the one llama.cpp and
//! mistral.rs use): a [`GrammarCompiler`] builds a token trie from the model's
//! `tokenizer.json` once, compiles each request's [`Grammar`] into a [`Constraint`], and
//! before every sampled token the constraint computes which tokens keep the output a prefix
//! of a sentence of the grammar; every other token's logit becomes −∞. End-of-generation
//! tokens are allowed exactly where the grammar may end, and a grammar that can only end
//! stops generation by itself ([`Constraint::is_finished`]).
//!
//! [llguidance]: https://github.com/guidance-ai/llguidance

use crate::error::{Result, RuntimeError};
use crate::tokenizer::{guarded, TextTokenizer, MAX_TOKENIZER_BYTES};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// What the output must match.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kind", content = "source", rename_all = "snake_case")]
pub enum Grammar {
    /// A JSON document valid against this JSON schema (`{"type": "object"}`: any object).
    /// Unless the schema says otherwise (llguidance's `x-guidance` options), the JSON is
    /// compact: no whitespace between tokens, which keeps small models from filling the
    /// output with newlines.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    Lark(String),
    /// A regular expression the whole output must match.
    Regex(String),
}

/// The comment [`Grammar::from_text`] puts first in the Lark translation of a GBNF grammar,
/// by which [`Grammar::kind`] names it in messages.
const GBNF_MARK: &str = "// translated from llama.cpp's GBNF";

impl Grammar {
    /// A grammar given as text (llama-server's `grammar` field, `gdsrun --grammar`): GBNF when
    /// a line has `::=` (translated by [`crate::gbnf`]), else llguidance's Lark. The error
    /// says where the GBNF is wrong.
    pub fn from_text(text: &str) -> std::result::Result<Grammar, String> {
        if crate::gbnf::is_gbnf(text) {
            // marked, so that messages say GBNF ([`Grammar::kind`])
            crate::gbnf::gbnf_to_lark(text).map(|l| Grammar::Lark(format!("{GBNF_MARK}\n{l}")))
        } else {
            Ok(Grammar::Lark(text.to_string()))
        }
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonSchema(schema) => {
                let mut schema = schema.clone();
                close_objects(&mut schema);
                if let Some(obj) = schema.as_object_mut() {
                    obj.entry("x-guidance")
                        .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        }
    }

    /// What kind of grammar this is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "JSON schema",
            Grammar::Lark(src) if src.contains(GBNF_MARK) => "GBNF grammar",
            Grammar::Lark(_) => "Lark grammar",
            Grammar::Regex(_) => "regular expression",
        }
    }
}

/// An object schema with `properties` and no `additionalProperties` takes no other keys:
/// `additionalProperties: false` is added there, in every subschema. JSON Schema itself
/// allows other keys, but llama.cpp's converter (and so llama-server's `json_schema`,
/// Ollama's `format`) and OpenAI's structured outputs do not, and clients rely on it: a
/// pydantic model's schema leaves the field out, and a small model held only to "some
/// object with at least these keys" invents keys until it runs out of tokens. A schema
/// that wants other keys says so (`additionalProperties: true` or a schema).
pub fn close_objects(schema: &mut Value) {
    let Value::Object(o) = schema else {
        return;
    };
    if o.get("properties").is_some_and(Value::is_object) && !o.contains_key("additionalProperties")
    {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (k, v) in o.iter_mut() {
        match k.as_str() {
            // keyword -> schema
            "additionalProperties"
            | "items"
            | "contains"
            | "not"
            | "if"
            | "then"
            | "else"
            | "propertyNames"
            | "additionalItems"
            | "unevaluatedItems"
            | "unevaluatedProperties" => match v {
                Value::Array(list) => list.iter_mut().for_each(close_objects),
                v => close_objects(v),
            },
            // keyword -> name -> schema
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(m) = v {
                    m.values_mut().for_each(close_objects);
                }
            }
            // keyword -> [schema]
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                if let Value::Array(list) = v {
                    list.iter_mut().for_each(close_objects);
                }
            }
            _ => {}
        }
    }
}

/// The model's vocabulary as llguidance sees it: each token's bytes, in a trie. Text
/// llguidance needs tokenized (forced continuations) is tokenized greedily on the trie, not
/// by the model's tokenizer: it is never fed to the model as a prompt, and a second copy of a
/// 262k-token tokenizer would cost more memory than the trie itself.
struct Vocab {
    trie: TokTrie,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// The parts of `tokenizer.json` token bytes are made from (the merges, most of the file,
/// are skipped while parsing).
#[derive(serde::Deserialize)]
struct TokenizerParts {
    #[serde(default)]
    decoder: Value,
    #[serde(default)]
    added_tokens: Value,
    model: ModelParts,
}

#[derive(serde::Deserialize)]
struct ModelParts {
    #[serde(default)]
    vocab: Value,
}

/// Compiles grammars against one model's vocabulary. Building it reads and indexes the
/// vocabulary (about 0.2 s for SmolLM2's 49k tokens, 2 to 2.7 s for Gemma 3's 262k on the
/// 2-core development VM), so it is built once per process.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl GrammarCompiler {
    /// For the model in `dir` (its `tokenizer.json`, checked against the manifest), whose
    /// logits have `vocab_size` entries and whose end-of-generation tokens `tokenizer`
    /// knows.
    pub fn load(dir: &Path, tokenizer: &TextTokenizer, vocab_size: usize) -> Result<Self> {
        let bytes = gds_io::read_manifest(dir)?;
        let m = crate::model_dir::parse_manifest(dir, &bytes)?;
        let path = dir.join("tokenizer.json");
        let file = gds_io::read_model_file(dir, &m, "tokenizer.json", MAX_TOKENIZER_BYTES)?
            .ok_or_else(|| RuntimeError::Tokenizer(format!("{} is missing", path.display())))?;
        let parts: TokenizerParts = serde_json::from_slice(&file.bytes)
            .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", path.display())))?;
        drop(file);
        let json = serde_json::json!({
            "decoder": parts.decoder,
            "added_tokens": parts.added_tokens,
            "model": {"vocab": parts.model.vocab},
        });
        let what = format!("{} (token bytes for constrained decoding)", path.display());
        let token_bytes = guarded(&what, || llguidance::token_bytes_from_tokenizer_json(&json))?;
        drop(json);
        let compiler = Self::new(token_bytes, tokenizer, vocab_size);
        crate::tokenizer::release_freed_heap();
        compiler
    }

    /// From each token's bytes (special tokens prefixed with [`TokTrie::SPECIAL_TOKEN_MARKER`],
    /// which grammars cannot produce as text).
    pub fn new(
        mut token_bytes: Vec<Vec<u8>>,
        tokenizer: &TextTokenizer,
        vocab_size: usize,
    ) -> Result<Self> {
        if token_bytes.len() > vocab_size {
            return Err(RuntimeError::Grammar(format!(
                "the tokenizer has {} tokens, more than the model's {vocab_size} logits",
                token_bytes.len()
            )));
        }
        // ids the tokenizer does not define (padding rows of the embedding) can never be
        // produced: a special placeholder each
        token_bytes.resize(vocab_size, Vec::new());
        for (id, b) in token_bytes.iter_mut().enumerate() {
            if b.is_empty() {
                *b = format!("\u{ff}<[{id}]>").into_bytes();
                b[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            }
        }
        let eog = tokenizer.eog_ids();
        let info = TokRxInfo::new(vocab_size as u32, eog.first().copied().unwrap_or(0));
        let mut trie = TokTrie::from(&info, &token_bytes);
        if eog.len() > 1 {
            trie = trie.with_eos_tokens(eog);
        }
        let env: TokEnv = Arc::new(Vocab { trie });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| RuntimeError::Grammar(format!("indexing the vocabulary: {e}")))?;
        factory.quiet();
        Ok(GrammarCompiler { factory })
    }

    /// Compiles `grammar` into a fresh constraint (nothing generated yet). The error says
    /// what in the grammar is wrong.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        check_size(grammar)?;
        let parser = self
            .factory
            .create_parser(grammar.top_level())
            .map_err(|e| {
                RuntimeError::Grammar(format!(
                    "{} does not compile: {}",
                    grammar.kind(),
                    cause(grammar, &e.to_string())
                ))
            })?;
        let mut matcher = Matcher::new(Ok(parser));
        // the first mask too (kept for the first token): llguidance builds lexer states
        // lazily, and a grammar that hits its limits there is the request's fault
        let first = matcher.compute_mask_or_eos().map_err(|e| e.to_string());
        let first = match matcher.get_error() {
            Some(e) => Err(e),
            None => first,
        }
        .map_err(|e| {
            RuntimeError::Grammar(format!(
                "{} does not compile: {}",
                grammar.kind(),
                cause(grammar, &e)
            ))
        })?;
        Ok(Constraint {
            matcher,
            first: Some(Mask(first)),
        })
    }
}

/// The tokens a grammar allows at one position.
pub struct Mask(SimpleVob);

impl Mask {
    /// Sets every logit the mask does not allow to −∞. An error when no token with a finite
    /// logit is left (nothing can be sampled).
    pub fn apply(&self, logits: &mut [f32]) -> Result<()> {
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if self.0.is_allowed(id as TokenId) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if any {
            Ok(())
        } else {
            Err(RuntimeError::Grammar(
                "the grammar allows no token here".into(),
            ))
        }
    }
}

/// Refuses a Lark grammar (a GBNF one translated, too) with more than
/// [`crate::gbnf::MAX_ITEMS`] alternatives and string literals, counted from its text (each
/// `|`, each pair of unescaped `"`): llguidance compiles at most 65 535 symbols and takes
/// seconds on tens of thousands, so such a grammar is refused before it is compiled.
fn check_size(grammar: &Grammar) -> Result<()> {
    let Grammar::Lark(src) = grammar else {
        return Ok(());
    };
    let (mut bars, mut quotes, mut escaped) = (0usize, 0usize, false);
    for b in src.bytes() {
        match b {
            b'|' => bars += 1,
            b'"' if !escaped => quotes += 1,
            _ => {}
        }
        escaped = b == b'\\' && !escaped;
    }
    let items = bars + quotes / 2;
    if items > crate::gbnf::MAX_ITEMS {
        return Err(RuntimeError::Grammar(format!(
            "{} does not compile: it has {items} alternatives and string literals, more than \
             the {} taken (too large to compile)",
            grammar.kind(),
            crate::gbnf::MAX_ITEMS
        )));
    }
    Ok(())
}

/// llguidance's error without the parser state dump it appends (`\n<state>...`) or the
/// backtrace of a panic it caught (`<backtrace>...`): neither is for the client.
fn brief(e: &str) -> &str {
    let e = e.split("\n<state>").next().unwrap_or(e);
    e.split("<backtrace>").next().unwrap_or(e).trim_end()
}

/// Why `grammar` does not compile, from llguidance's error `e`, in the terms of what was
/// given: a regular expression is compiled as the Lark grammar `start: /RX/`, whose position
/// (`at 1(8): `) and source excerpt are the wrapper's, not the user's, so they are left out;
/// llguidance's stop reasons (`NoExtensionBias`: no token is allowed at the first position)
/// are said in words.
fn cause(grammar: &Grammar, e: &str) -> String {
    let e = brief(e);
    if matches!(e, "NoExtension" | "NoExtensionBias") {
        return "it matches no text the model can write (no string satisfies it: e.g. a rule \
                that only refers to itself, or characters no token spells)"
            .into();
    }
    if !matches!(grammar, Grammar::Regex(_)) {
        return e.to_string();
    }
    let e = e.split("\n   1 | start: /").next().unwrap_or(e);
    let e = match e.strip_prefix("at ").and_then(|r| r.split_once("): ")) {
        Some((pos, rest)) if pos.bytes().all(|b| b.is_ascii_digit() || b == b'(') => rest,
        _ => e,
    };
    e.replacen(" (in regex)", "", 1).trim_end().to_string()
}

/// One sequence's grammar state: which tokens may come next.
pub struct Constraint {
    matcher: Matcher,
    /// The mask [`GrammarCompiler::compile`] computed, until the first token needs it.
    first: Option<Mask>,
}

impl Constraint {
    /// Which tokens the grammar allows next (end-of-generation tokens where it may end).
    /// Depends only on the tokens accepted so far, so it can be computed while the forward
    /// pass that produces the logits runs. An error means the grammar allows nothing more
    /// (llguidance's limits were hit): generation must end.
    pub fn compute_mask(&mut self) -> Result<Mask> {
        if let Some(first) = self.first.take() {
            return Ok(first);
        }
        self.matcher
            .compute_mask_or_eos()
            .map(Mask)
            .map_err(|e| RuntimeError::Grammar(brief(&e.to_string()).to_string()))
    }

    /// [`Constraint::compute_mask`] applied to `logits` at once.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        self.compute_mask()?.apply(logits)
    }

    /// Records the token that was sampled (one the mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.first = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| RuntimeError::Grammar(brief(&e.to_string()).to_string()))
    }

    /// Whether the grammar is complete and nothing may follow: generation ends here, as at
    /// an end-of-generation token.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::{cause, check_size, Grammar};

    #[test]
    fn compile_errors_are_said_in_the_terms_of_what_was_given() {
        // llguidance's error for the regex "(" (compiled as `start: /(/`)
        let e = "at 1(8): invalid regex \"(\" (in regex): regex parse error:\n    (\n    ^\nerror: unclosed group\n   1 | start: /(/\n              ^\n";
        let rx = Grammar::Regex("(".into());
        assert_eq!(
            cause(&rx, e),
            "invalid regex \"(\": regex parse error:\n    (\n    ^\nerror: unclosed group"
        );
        // a Lark grammar keeps its position and excerpt: they are the user's
        let lark = Grammar::Lark("start: foo".into());
        let e = "at 1(8): unknown name: \"foo\"\n   1 | start: foo\n              ^";
        assert_eq!(cause(&lark, e), e);
        for reason in ["NoExtensionBias", "NoExtension"] {
            let c = cause(&lark, reason);
            assert!(c.starts_with("it matches no text"), "{c}");
        }
    }

    #[test]
    fn a_lark_grammar_too_large_to_compile_is_refused_before_compiling() {
        let alts: Vec<String> = (0..100_000).map(|i| format!("\"w{i}\"")).collect();
        let e = check_size(&Grammar::Lark(format!("start: {}", alts.join(" | "))))
            .unwrap_err()
            .to_string();
        assert!(e.contains("too large to compile"), "{e}");
        // escaped quotes inside a literal are not literals; small grammars pass
        let alts: Vec<String> = (0..5000).map(|i| format!("\"w\\\"{i}\"")).collect();
        check_size(&Grammar::Lark(format!("start: {}", alts.join(" | ")))).unwrap();
        check_size(&Grammar::Regex("a|".repeat(100_000))).unwrap();
    }
}
