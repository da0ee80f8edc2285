//! The OpenAI-compatible HTTP API: request parsing and validation, the handlers, and the
//! response and server-sent-event formats.

mod beam;
pub(crate) use crate::error::random_seed;
pub use crate::error::ApiError;
use crate::reasoning::{CountedSplit, Reasoning};
use crate::scheduler::{
    Done, Event, Finish, Msg, Prefill, Progress, Request, Shift, Tier, TokenLogprobs, TokenMasks,
};
use crate::tools::Tools;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::BoxFuture;
use futures_util::stream::{self, Stream, StreamExt};
use futures_util::FutureExt;
use gds_runtime::chat::{ChatTemplate, Message};
use gds_runtime::reply::Reply;
use gds_runtime::sampler::Stage;
use gds_runtime::{ChatEnd, Constraint, Grammar, RuntimeError, SamplerConfig};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// `stop`: one string or a list.
#[derive(Clone, Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug)]
pub(crate) struct ChatMessage {
    pub(crate) role: String,
    /// A string or a list of parts (`{"type": "text", "text": ...}`).
    #[serde(default)]
    pub(crate) content: Option<Value>,
    /// An assistant's calls (`[{"id", "type": "function", "function": {"name", "arguments"}}]`).
    #[serde(default)]
    pub(crate) tool_calls: Option<Value>,
    /// A tool result: the call it answers.
    #[serde(default)]
    pub(crate) tool_call_id: Option<String>,
    /// An assistant's earlier reasoning (llama-server's and vLLM's field), for templates
    /// that render it.
    #[serde(default)]
    pub(crate) reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message of plain text from `role`.
    pub(crate) fn text(role: &str, content: String) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: Some(Value::String(content)),
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    /// A tool's result, answering the call `call_id`.
    pub(crate) fn tool_result(call_id: String, content: String) -> ChatMessage {
        ChatMessage {
            tool_call_id: Some(call_id),
            ..ChatMessage::text("tool", content)
        }
    }
}

/// The fields both endpoints share; unknown fields are ignored like OpenAI's SDKs expect.
#[derive(Deserialize, Debug, Default, Clone)]
pub(crate) struct Common {
    #[serde(default)]
    pub(crate) model: Option<String>,
    #[serde(default)]
    pub(crate) max_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) temperature: Option<f64>,
    #[serde(default)]
    pub(crate) top_p: Option<f64>,
    #[serde(default)]
    pub(crate) top_k: Option<i64>,
    #[serde(default)]
    pub(crate) min_p: Option<f64>,
    #[serde(default)]
    pub(crate) repeat_penalty: Option<f64>,
    /// vLLM's `repetition_penalty`: llama.cpp's `repeat_penalty` over the whole context
    /// (vLLM's looks at the prompt and the output).
    #[serde(default)]
    pub(crate) repetition_penalty: Option<f64>,
    /// vLLM's `min_tokens`: end-of-generation tokens (and `stop_token_ids`) are masked until
    /// this many were generated (not with a grammar, which decides where it may end).
    #[serde(default)]
    pub(crate) min_tokens: Option<i64>,
    /// vLLM's `stop_token_ids`: generating one of these ends the reply (`finish_reason:
    /// "stop"`; its text left out, as the end-of-generation token's, unless
    /// `include_stop_str_in_output`).
    #[serde(default)]
    pub(crate) stop_token_ids: Option<Value>,
    /// vLLM's `include_stop_str_in_output`: the stop string (or stop token) that ends the
    /// reply stays in its text.
    #[serde(default)]
    pub(crate) include_stop_str_in_output: Option<bool>,
    /// vLLM's `skip_special_tokens` (default true): `false` keeps every special token's text
    /// in the reply.
    #[serde(default)]
    pub(crate) skip_special_tokens: Option<bool>,
    /// vLLM's `allowed_token_ids`: only these tokens may be generated.
    #[serde(default)]
    pub(crate) allowed_token_ids: Option<Value>,
    /// vLLM's `bad_words`: words the reply may not contain (as tokenized at the start of
    /// the text and after a space, their last token masked where the others were just
    /// generated).
    #[serde(default)]
    pub(crate) bad_words: Option<Value>,
    /// vLLM's `prompt_logprobs`: the prompt tokens' log-probabilities, with this many top
    /// alternatives, listed in vLLM's form (`prompt_logprobs`).
    #[serde(default)]
    pub(crate) prompt_logprobs: Option<Value>,
    /// llama-server's `n_indent` (code editors send the cursor line's): once the reply has
    /// a new line, a line indented by fewer spaces or tabs ends it, cut before its first
    /// character (0 or less: off).
    #[serde(default)]
    pub(crate) n_indent: Option<i64>,
    /// llama-server's `t_max_predict_ms`: once the reply has a new line, a new line after
    /// this many milliseconds of generation ends it (0 or less: off).
    #[serde(default)]
    pub(crate) t_max_predict_ms: Option<i64>,
    /// vLLM's structured outputs: `structured_outputs` (`{"json" | "regex" | "choice" |
    /// "grammar" | "json_object": ...}`) and its older `guided_json`, `guided_regex`,
    /// `guided_choice`, `guided_grammar`.
    #[serde(default)]
    pub(crate) structured_outputs: Option<Value>,
    #[serde(default)]
    pub(crate) guided_json: Option<Value>,
    #[serde(default)]
    pub(crate) guided_regex: Option<Value>,
    #[serde(default)]
    pub(crate) guided_choice: Option<Value>,
    #[serde(default)]
    pub(crate) guided_grammar: Option<Value>,
    /// `logit -= count * frequency_penalty` over the generated tokens (-2..=2).
    #[serde(default)]
    pub(crate) frequency_penalty: Option<f64>,
    /// `logit -= presence_penalty` for every token generated at least once (-2..=2).
    #[serde(default)]
    pub(crate) presence_penalty: Option<f64>,
    /// `{"<token id>": bias}`, bias in -100..=100, added to the logits before sampling.
    #[serde(default)]
    pub(crate) logit_bias: Option<Value>,
    #[serde(default)]
    pub(crate) stop: Option<Stop>,
    #[serde(default)]
    pub(crate) seed: Option<i64>,
    #[serde(default)]
    pub(crate) stream: Option<bool>,
    /// `{"include_usage": true}`: a streamed answer ends with a chunk carrying `usage`;
    /// vLLM's `"continuous_usage_stats": true` with it: every chunk carries its choice's.
    #[serde(default)]
    pub(crate) stream_options: Option<Value>,
    /// vLLM's `return_token_ids`: the prompt's and each choice's token ids beside the text
    /// (`prompt_token_ids`, `token_ids`; streamed, the prompt's in the first chunk and each
    /// chunk's own).
    #[serde(default)]
    pub(crate) return_token_ids: Option<bool>,
    /// vLLM's `return_tokens_as_token_ids`: log-probabilities name tokens `token_id:N`.
    #[serde(default)]
    pub(crate) return_tokens_as_token_ids: Option<bool>,
    /// vLLM's `request_id`: the answer's id is made of it (`chatcmpl-ID`, `cmpl-ID`).
    #[serde(default)]
    pub(crate) request_id: Option<String>,
    /// vLLM's `cache_salt`: cached prompt blocks are shared only among requests with the
    /// same salt (another tenant cannot learn a prompt from how fast its own comes back).
    #[serde(default)]
    pub(crate) cache_salt: Option<String>,
    /// vLLM's `priority`: with `--scheduling-policy priority`, lower values are admitted
    /// first and a full batch preempts a higher one for it; otherwise only 0.
    #[serde(default)]
    pub(crate) priority: Option<i64>,
    /// OpenAI's `service_tier`: `priority` (or `fast`) requests are admitted before the
    /// others, `flex` ones after them (with the Batch APIs'); the answer names the tier.
    #[serde(default)]
    pub(crate) service_tier: Option<String>,
    #[serde(default)]
    pub(crate) n: Option<i64>,
    #[serde(default)]
    pub(crate) ignore_eos: Option<bool>,
    /// Speculative decoding: `"ngram"` (prompt lookup) or `"none"` (a GdsLLM extension).
    #[serde(default)]
    pub(crate) draft: Option<String>,
    /// Most tokens guessed per step (1..=32, default 10).
    #[serde(default)]
    pub(crate) draft_max: Option<i64>,
    /// Chat: OpenAI's predicted outputs, `{"type": "content", "content": text or text
    /// parts}`: a text the reply is expected to mostly repeat, used as speculative guesses.
    #[serde(default)]
    pub(crate) prediction: Option<Value>,
    /// Chat: a bool; completions: how many top alternatives (an integer).
    #[serde(default)]
    pub(crate) logprobs: Option<Value>,
    /// Chat: how many top alternatives per token.
    #[serde(default)]
    pub(crate) top_logprobs: Option<i64>,
    #[serde(default)]
    pub(crate) echo: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`.
    #[serde(default)]
    pub(crate) response_format: Option<Value>,
    /// Extension (as llama-server's): a JSON schema the output must follow.
    #[serde(default)]
    pub(crate) json_schema: Option<Value>,
    /// Extension: a grammar the output must follow, in llama.cpp's GBNF (as llama-server
    /// takes it) or in llguidance's Lark syntax.
    #[serde(default)]
    pub(crate) grammar: Option<String>,
    /// Extension: a regular expression the whole output must match.
    #[serde(default)]
    pub(crate) regex: Option<String>,
    /// Extension (llama-server's): every streamed chunk carries `timings` so far.
    #[serde(default)]
    pub(crate) timings_per_token: Option<bool>,
    /// Extension (llama-server's): a streamed reply first sends chunks saying how far the
    /// prompt has gone in (`prompt_progress`).
    #[serde(default)]
    pub(crate) return_progress: Option<bool>,
    /// Extension (llama-server's): the slot whose last tokens this request's become (for
    /// `POST /slots/{id}?action=save`); -1 or absent: the one it runs in.
    #[serde(default)]
    pub(crate) id_slot: Option<i64>,
    /// Extension (llama-server's): with `--context-shift`, the prompt tokens a shift keeps
    /// (after the BOS; -1: the whole prompt). Default 0.
    #[serde(default)]
    pub(crate) n_keep: Option<i64>,
    /// Extension (llama-server's): with `--context-shift`, the tokens a shift drops after the
    /// kept ones (0: half of them). Default 0.
    #[serde(default)]
    pub(crate) n_discard: Option<i64>,
    /// llama.cpp's samplers (llama-server takes them on every generation endpoint):
    /// locally typical, top-n-sigma, XTC, dynamic temperature, Mirostat, DRY, adaptive-p,
    /// `min_keep`, the chain's order (`samplers`) and the repeat penalty's window.
    #[serde(flatten)]
    pub(crate) llama: LlamaSampling,
    /// vLLM's `truncate_prompt_tokens` and `truncation_side`: the prompt cut to that many
    /// tokens (at most the context less one, room for the reply) instead of refused.
    #[serde(flatten)]
    pub(crate) truncation: crate::truncation::TruncateFields,
    /// Ollama's `shift` (set by its endpoints, not read from OpenAI bodies): whether this
    /// request shifts, whatever `--context-shift` says.
    #[serde(skip)]
    pub(crate) shift: Option<bool>,
    /// Ollama's `truncate` of a prompt (set by its endpoints): where the request shifts, a
    /// prompt over the context is cut as a shift would cut it (its kept start, then its
    /// latest tokens) instead of refused.
    #[serde(skip)]
    pub(crate) truncate: bool,
}

/// llama.cpp's sampler fields ([`Common::llama`]); each left out keeps the server's default.
/// Numbers are read as JSON values (a flattened struct buffers them, and serde_json's
/// arbitrary-precision numbers then reach an `f64` field as a map) and checked in
/// `llama_sampling`, which names the field of one that is not a number.
#[derive(Deserialize, Debug, Default, Clone)]
pub(crate) struct LlamaSampling {
    #[serde(default)]
    pub(crate) typical_p: Option<Value>,
    #[serde(default)]
    pub(crate) top_n_sigma: Option<Value>,
    #[serde(default)]
    pub(crate) xtc_probability: Option<Value>,
    #[serde(default)]
    pub(crate) xtc_threshold: Option<Value>,
    #[serde(default)]
    pub(crate) dynatemp_range: Option<Value>,
    #[serde(default)]
    pub(crate) dynatemp_exponent: Option<Value>,
    #[serde(default)]
    pub(crate) mirostat: Option<Value>,
    #[serde(default)]
    pub(crate) mirostat_tau: Option<Value>,
    #[serde(default)]
    pub(crate) mirostat_eta: Option<Value>,
    #[serde(default)]
    pub(crate) dry_multiplier: Option<Value>,
    #[serde(default)]
    pub(crate) dry_base: Option<Value>,
    #[serde(default)]
    pub(crate) dry_allowed_length: Option<Value>,
    #[serde(default)]
    pub(crate) dry_penalty_last_n: Option<Value>,
    #[serde(default)]
    pub(crate) dry_sequence_breakers: Option<Value>,
    #[serde(default)]
    pub(crate) adaptive_target: Option<Value>,
    #[serde(default)]
    pub(crate) adaptive_decay: Option<Value>,
    #[serde(default)]
    pub(crate) min_keep: Option<Value>,
    /// The chain's order: names (`["top_k", "temperature"]`) or llama.cpp's letters
    /// (`"kt"`); a sampler left out does not run.
    #[serde(default)]
    pub(crate) samplers: Option<Value>,
    /// Tokens the repeat penalty looks back over (-1: the context, 0: off).
    #[serde(default)]
    pub(crate) repeat_last_n: Option<Value>,
}

/// OpenAI fields that change what is answered and that gdsrun does not do: refused with a
/// 400 naming them rather than ignored (an ignored `best_of` would rank nothing).
#[derive(Deserialize, Default)]
struct Unsupported {
    #[serde(default)]
    best_of: Option<Value>,
    // vLLM's extra parameters not done here (refused where they ask for something)
    #[serde(default)]
    functions: Option<Value>,
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    audio: Option<Value>,
    #[serde(default)]
    modalities: Option<Value>,
    #[serde(default)]
    web_search_options: Option<Value>,
    #[serde(default)]
    moderation: Option<Value>,
    // vLLM's: embeddings as the prompt, server-side logits processors, stopping on repeats
    #[serde(default)]
    prompt_embeds: Option<Value>,
    #[serde(default)]
    logits_processors: Option<Value>,
    #[serde(default)]
    repetition_detection: Option<Value>,
    #[serde(default)]
    verbosity: Option<Value>,
}

/// OpenAI's `verbosity` (GPT-5's; the Responses API's `text.verbosity`): the model is not
/// asked to be terser or wordier, so only `medium`, the default, is taken (another is a 400
/// naming `param`).
pub(crate) fn verbosity(v: Option<&Value>, param: &'static str) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(v) if v == "medium" => Ok(()),
        Some(v) => Err(ApiError::bad(format!(
            "verbosity {v} is not supported: only \"medium\" (the model is not told to be terser or wordier)"
        ))
        .param(param)),
    }
}

impl Common {
    /// Chat fields an endpoint's reply has no place for (`n`, `echo`, log-probabilities,
    /// `max_completion_tokens` where the API names its limit otherwise): a value that asks
    /// for something is a 400 naming the field, where ignoring it would answer another
    /// request than the one sent. `api` names the endpoint in the message.
    pub(crate) fn refuse_chat_only(&self, api: &str) -> Result<(), ApiError> {
        let logprobs = self
            .logprobs
            .as_ref()
            .is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)));
        let asked = [
            ("n", self.n.is_some_and(|n| n != 1)),
            ("echo", self.echo == Some(true)),
            ("logprobs", logprobs),
            ("top_logprobs", self.top_logprobs.is_some_and(|k| k != 0)),
            (
                "max_completion_tokens",
                self.max_completion_tokens.is_some(),
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs.as_ref().is_some_and(|v| !v.is_null()),
            ),
        ];
        match asked.iter().find(|(_, set)| *set) {
            Some(&(field, _)) => Err(ApiError::bad(format!(
                "{field} is not a field of {api} (its reply has no place for it); \
                 /v1/chat/completions and /v1/completions take it"
            ))
            .param(field)),
            None => Ok(()),
        }
    }
}

impl Unsupported {
    /// `kind`: the endpoint (`best_of` is a field of completions, read there).
    fn check(body: &Bytes, n: Option<i64>, kind: Kind) -> Result<(), ApiError> {
        let u: Unsupported = parse(body)?;
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        if let Some(b) = u
            .best_of
            .as_ref()
            .filter(|v| !v.is_null() && kind == Kind::Chat)
        {
            if b.as_i64() != Some(n.unwrap_or(1)) {
                return Err(ApiError::bad(format!(
                    "best_of {b} is a field of /v1/completions (chat choices are not ranked); ask for n choices instead"
                ))
                .param("best_of"));
            }
        }
        if set(&u.functions) || set(&u.function_call) {
            let param = if set(&u.functions) {
                "functions"
            } else {
                "function_call"
            };
            return Err(ApiError::bad(
                "functions and function_call (deprecated by OpenAI) are not supported; send tools and tool_choice",
            )
            .param(param));
        }
        if set(&u.audio) {
            return Err(ApiError::bad("audio output is not supported").param("audio"));
        }
        verbosity(u.verbosity.as_ref(), "verbosity")?;
        for (field, v, why) in [
            (
                "web_search_options",
                &u.web_search_options,
                "this server does not search the web",
            ),
            (
                "moderation",
                &u.moderation,
                "this server runs no moderation model (its policy would not be applied)",
            ),
            (
                "prompt_embeds",
                &u.prompt_embeds,
                "prompts are text or token ids here",
            ),
            (
                "logits_processors",
                &u.logits_processors,
                "no logits processors are loaded by name (use logit_bias, allowed_token_ids, bad_words or a grammar)",
            ),
            (
                "repetition_detection",
                &u.repetition_detection,
                "replies are not stopped on repeats (use repetition_penalty or DRY)",
            ),
        ] {
            if set(v) {
                return Err(ApiError::bad(format!("{field} is not supported: {why}")).param(field));
            }
        }
        if let Some(m) = u.modalities.as_ref().filter(|v| !v.is_null()) {
            if m.as_array().is_none_or(|l| l.iter().any(|x| x != "text")) {
                return Err(
                    ApiError::bad(format!("modalities {m}: only [\"text\"]")).param("modalities")
                );
            }
        }
        Ok(())
    }
}

/// Most prompts in one completions request.
pub(crate) const MAX_PROMPTS: usize = 64;

/// Most choices per prompt (`n`).
const MAX_N: usize = 16;

/// Most alternatives per token a request may ask for (OpenAI's limit for chat).
pub(crate) const MAX_TOP_LOGPROBS: i64 = 20;

/// A count of top alternatives (`logprobs`, `top_logprobs`, `prompt_logprobs`): 0 up to
/// [`MAX_TOP_LOGPROBS`], or a 400 naming `param`.
fn alternatives(k: i64, param: &'static str) -> Result<usize, ApiError> {
    if (0..=MAX_TOP_LOGPROBS).contains(&k) {
        Ok(k as usize)
    } else {
        Err(ApiError::bad(format!(
            "{param} {k} must be an integer in 0..={MAX_TOP_LOGPROBS}"
        ))
        .param(param))
    }
}

/// The log-probabilities a request asks for: `None`, or `Some(k)` top alternatives per
/// token. Chat: `logprobs: true` and `top_logprobs: k`; completions: `logprobs: k`.
fn logprobs_request(c: &Common, kind: Kind) -> Result<Option<usize>, ApiError> {
    if c.echo == Some(true) && kind == Kind::Chat {
        return Err(ApiError::bad("echo applies to /v1/completions").param("echo"));
    }
    match kind {
        Kind::Chat => {
            let on = match &c.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(v) => {
                    return Err(
                        ApiError::bad(format!("logprobs {v} must be a boolean")).param("logprobs")
                    )
                }
            };
            match (on, c.top_logprobs) {
                (false, Some(_)) => {
                    Err(ApiError::bad("top_logprobs needs logprobs: true").param("top_logprobs"))
                }
                (false, None) => Ok(None),
                (true, k) => Ok(Some(alternatives(k.unwrap_or(0), "top_logprobs")?)),
            }
        }
        Kind::Completion => match &c.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(k) => Ok(Some(alternatives(k, "logprobs")?)),
                None => {
                    Err(ApiError::bad(format!("logprobs {n} must be an integer")).param("logprobs"))
                }
            },
            Some(v) => {
                Err(ApiError::bad(format!("logprobs {v} must be an integer")).param("logprobs"))
            }
        },
    }
}

/// A constraint in vLLM's form: `kind` `json` (a schema, or its JSON text), `regex`,
/// `choice` (a list of strings: the output is one of them), `grammar` (GBNF, as vLLM's
/// xgrammar takes it, or Lark) or `json_object` (`true`: any JSON object).
fn vllm_grammar(kind: &str, v: &Value, param: &'static str) -> Result<Grammar, ApiError> {
    let bad = |m: String| ApiError::bad(m).param(param);
    match (kind, v) {
        ("json", Value::Object(_) | Value::Bool(_)) => Ok(Grammar::JsonSchema(v.clone())),
        ("json", Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(s @ (Value::Object(_) | Value::Bool(_))) => Ok(Grammar::JsonSchema(s)),
            _ => Err(bad(format!(
                "{param}: the JSON schema text is not a JSON object"
            ))),
        },
        ("regex", Value::String(r)) => Ok(Grammar::Regex(r.clone())),
        ("choice", Value::Array(l))
            if !l.is_empty() && l.len() <= 1024 && l.iter().all(Value::is_string) =>
        {
            let alts: Vec<String> = l
                .iter()
                .filter_map(Value::as_str)
                .map(regex::escape)
                .collect();
            Ok(Grammar::Regex(format!("({})", alts.join("|"))))
        }
        ("grammar", Value::String(g)) => Grammar::from_text(g).map_err(bad),
        ("json_object", Value::Bool(true)) => Ok(Grammar::JsonSchema(json!({"type": "object"}))),
        ("choice", _) => Err(bad(format!(
            "{param}: choice must be a list of 1 to 1024 strings"
        ))),
        ("json" | "regex" | "grammar" | "json_object", _) => Err(bad(format!(
            "{param}: {kind} must be {}",
            match kind {
                "json" => "a JSON schema (an object or its text)",
                "json_object" => "true",
                _ => "a string",
            }
        ))),
        _ => Err(bad(format!(
            "{param}: {kind:?} is not one of json, regex, choice, grammar, json_object"
        ))),
    }
}

/// The grammar a request holds its output to, and the field that gave it (for errors).
fn grammar_request(c: &Common) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let mut found = Vec::new();
    if let Some(rf) = &c.response_format {
        let bad = |m: String| ApiError::bad(m).param("response_format");
        let kind = rf
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("response_format needs a \"type\"".into()))?;
        match kind {
            "text" => {}
            // llama-server's extension: a "schema" beside the type holds the object to it
            "json_object" => {
                let schema = match rf.get("schema") {
                    None | Some(Value::Null) => json!({"type": "object"}),
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                    Some(other) => {
                        return Err(bad(format!(
                            "response_format.schema must be a JSON schema (an object), not {other}"
                        )))
                    }
                };
                found.push((Grammar::JsonSchema(schema), "response_format"))
            }
            "json_schema" => {
                let spec = rf.get("json_schema").ok_or_else(|| {
                    bad("response_format of type json_schema needs a \"json_schema\" object".into())
                })?;
                let schema = match spec.get("schema") {
                    // no schema: any JSON object (as OpenAI answers)
                    None | Some(Value::Null) => json!({"type": "object"}),
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                    Some(other) => {
                        return Err(bad(format!(
                            "json_schema.schema must be a JSON schema (an object), not {other}"
                        )))
                    }
                };
                found.push((Grammar::JsonSchema(schema), "response_format"));
            }
            other => {
                return Err(bad(format!(
                    "response_format type {other:?} is not one of text, json_object, json_schema"
                )))
            }
        }
    }
    if let Some(s) = &c.json_schema {
        found.push((Grammar::JsonSchema(s.clone()), "json_schema"));
    }
    if let Some(g) = &c.grammar {
        // llama-server's `grammar` is GBNF; ours was Lark first: `::=` tells them apart
        let g = Grammar::from_text(g).map_err(|e| ApiError::bad(e).param("grammar"))?;
        found.push((g, "grammar"));
    }
    if let Some(r) = &c.regex {
        found.push((Grammar::Regex(r.clone()), "regex"));
    }
    for (field, v) in [
        ("guided_json", &c.guided_json),
        ("guided_regex", &c.guided_regex),
        ("guided_choice", &c.guided_choice),
        ("guided_grammar", &c.guided_grammar),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
            let kind = field.trim_start_matches("guided_");
            found.push((vllm_grammar(kind, v, field)?, field));
        }
    }
    if let Some(so) = c.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        let param = "structured_outputs";
        let Value::Object(o) = so else {
            return Err(ApiError::bad("structured_outputs must be an object").param(param));
        };
        // (vLLM's options beside the constraint: no effect on what is allowed here)
        let given: Vec<(&String, &Value)> = o
            .iter()
            .filter(|(k, v)| {
                !v.is_null()
                    && !matches!(
                        k.as_str(),
                        "disable_fallback"
                            | "disable_any_whitespace"
                            | "disable_additional_properties"
                            | "whitespace_pattern"
                            | "backend"
                    )
            })
            .collect();
        match given[..] {
            [(k, v)] => found.push((vllm_grammar(k, v, param)?, param)),
            _ => {
                return Err(ApiError::bad(
                    "structured_outputs takes one of json, regex, choice, grammar, json_object",
                )
                .param(param))
            }
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
        return Err(ApiError::bad(format!(
            "give one of response_format (json), json_schema, grammar, regex (or vLLM's structured_outputs, guided_*); this request has {}",
            names.join(", ")
        ))
        .param(found[1].1));
    }
    if c.echo == Some(true) && !found.is_empty() {
        return Err(ApiError::bad("echo scores the prompt; it takes no grammar").param("echo"));
    }
    Ok(found.pop())
}

// The bodies are read in two passes (the endpoint's own fields, then `Common`) rather than
// with `#[serde(flatten)]`: flattening buffers numbers, which breaks when another crate in the
// build turns on serde_json's `arbitrary_precision`.

/// `prompt`: a string, a list of one string, or token ids. `parse_special`: special-token
/// texts in a string prompt become their tokens (default: plain text).
#[derive(Deserialize, Debug)]
struct CompletionBody {
    prompt: Value,
    #[serde(default)]
    parse_special: Option<bool>,
    /// The text after the completion: the prompt is laid out for fill-in-the-middle
    /// ([`fim_prompt`]); a model without the tokens is refused.
    #[serde(default)]
    suffix: Option<Value>,
    /// OpenAI's `best_of`: this many choices made of each prompt, the `n` likeliest (by
    /// log-probability a token) returned.
    #[serde(default)]
    best_of: Option<Value>,
    /// vLLM's `add_special_tokens` (default true): `false` tokenizes a text prompt without
    /// the BOS the model's tokenizer adds.
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

/// A fill-in-the-middle prompt as the model's FIM tokens lay it out (prefix, suffix, middle:
/// llama-server's `/infill` and Ollama's `suffix` lay it out so): the model's BOS where `bos`
/// and it adds one, the prefix token, `prefix`, the suffix token, `suffix`'s tokens, the
/// middle token. `None`: the vocabulary has no such tokens.
pub(crate) async fn fim_prompt(
    st: &ServerState,
    prefix: Vec<u32>,
    suffix: &str,
    bos: bool,
) -> Result<Option<Vec<u32>>, ApiError> {
    let [pre, suf, mid, ..] = st.tokenizer.fim();
    let (Some(pre), Some(suf), Some(mid)) = (pre, suf, mid) else {
        return Ok(None);
    };
    let mut ids = Vec::with_capacity(prefix.len() + 4);
    if bos && st.tokenizer.add_bos() {
        ids.extend(st.tokenizer.bos());
    }
    ids.push(pre);
    ids.extend(prefix);
    ids.push(suf);
    ids.extend(encode_text(st, suffix.to_string(), false, false, "suffix").await?);
    ids.push(mid);
    Ok(Some(ids))
}

#[derive(Deserialize, Debug)]
pub(crate) struct ChatBody {
    pub(crate) messages: Vec<ChatMessage>,
    #[serde(default)]
    pub(crate) tools: Option<Value>,
    #[serde(default)]
    pub(crate) tool_choice: Option<Value>,
    #[serde(default)]
    pub(crate) parallel_tool_calls: Option<bool>,
    /// The final message (an assistant's) is the start of the reply, continued rather than
    /// answered (vLLM's name; Anthropic's prefill).
    #[serde(default)]
    pub(crate) continue_final_message: Option<bool>,
    /// `false`: the conversation rendered as it ends, no assistant turn opened (vLLM's and
    /// llama-server's field; default true).
    #[serde(default)]
    pub(crate) add_generation_prompt: Option<bool>,
    /// More variables for the chat template (vLLM's and llama-server's field: Qwen 3's
    /// `enable_thinking`, ...).
    #[serde(default)]
    pub(crate) chat_template_kwargs: Option<Value>,
    /// vLLM's `documents`: retrieved documents (objects of strings: `title`, `text`, ...)
    /// for templates that lay them out (Command R's, Granite's): the template's `documents`.
    #[serde(default)]
    pub(crate) documents: Option<Value>,
    /// vLLM's per-request `chat_template`: refused (the server's template renders every
    /// request; vLLM too refuses it unless started to trust it).
    #[serde(default)]
    pub(crate) chat_template: Option<Value>,
    /// llama-server's `reasoning_format`: `auto`/`deepseek` (a thinking model's reasoning
    /// apart, as `reasoning_content`) or `none` (the reply whole); default `--reasoning-format`.
    #[serde(default)]
    pub(crate) reasoning_format: Option<String>,
    /// OpenAI's `reasoning_effort` (`none`, `minimal`, `low`, `medium`, `high`, `xhigh`): the
    /// template's `reasoning_effort` variable (gpt-oss's), and `none` switches thinking off.
    #[serde(default)]
    pub(crate) reasoning_effort: Option<String>,
    /// A conversation over the context loses its oldest messages, system messages kept
    /// ([`TextTokenizer::encode_chat_fitting`]), instead of being refused: Ollama's
    /// `truncate`, the Responses API's `truncation: "auto"` (set by those endpoints).
    #[serde(skip)]
    pub(crate) drop_oldest: bool,
}

/// Most `chat_template_kwargs` one request may give.
const MAX_TEMPLATE_VARS: usize = 64;
/// Most `documents` one request may give.
const MAX_DOCUMENTS: usize = 256;

impl ChatBody {
    /// `chat_template_kwargs`, checked: an object of at most [`MAX_TEMPLATE_VARS`] variables,
    /// none of the names the server sets itself.
    pub(crate) fn template_vars(&self) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
        let docs = match &self.documents {
            None | Some(Value::Null) => None,
            Some(Value::Array(d))
                if d.len() <= MAX_DOCUMENTS
                    && d.iter().all(|x| {
                        x.as_object()
                            .is_some_and(|o| o.values().all(Value::is_string))
                    }) =>
            {
                Some(Value::Array(d.clone()))
            }
            Some(_) => {
                return Err(ApiError::bad(format!(
                    "documents must be a list of up to {MAX_DOCUMENTS} objects of strings (title, text, ...)"
                ))
                .param("documents"))
            }
        };
        let bad = |m: String| ApiError::bad(m).param("chat_template_kwargs");
        let map = match &self.chat_template_kwargs {
            None | Some(Value::Null) => {
                return Ok(docs.map(|d| [("documents".to_string(), d)].into_iter().collect()))
            }
            Some(Value::Object(m)) => m,
            Some(v) => return Err(bad(format!("chat_template_kwargs {v} must be an object"))),
        };
        if map.len() > MAX_TEMPLATE_VARS {
            return Err(bad(format!(
                "chat_template_kwargs has {} variables; at most {MAX_TEMPLATE_VARS}",
                map.len()
            )));
        }
        let reserved = [
            "messages",
            "tools",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ];
        if let Some(k) = map.keys().find(|k| reserved.contains(&k.as_str())) {
            return Err(bad(format!(
                "chat_template_kwargs cannot set {k:?}: the server sets it (send it as its own field)"
            )));
        }
        let mut map = map.clone();
        if let Some(d) = docs {
            if map.contains_key("documents") {
                return Err(ApiError::bad(
                    "documents is given twice (as a field and in chat_template_kwargs)",
                )
                .param("documents"));
            }
            map.insert("documents".into(), d);
        }
        Ok(Some(map))
    }
}

/// An assistant message's `tool_calls` as templates expect them: a list, each call's
/// `arguments` an object (OpenAI sends a JSON string; Hugging Face templates apply `tojson`).
fn template_tool_calls(v: &Value) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::bad("tool_calls must be a list of {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
            .param("messages")
    };
    let mut calls = v.as_array().ok_or_else(bad)?.clone();
    for c in &mut calls {
        let f = c.get_mut("function").ok_or_else(bad)?;
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(bad());
        }
        if let Some(Value::String(a)) = f.get("arguments") {
            let parsed = serde_json::from_str::<Value>(a).map_err(|e| {
                ApiError::bad(format!("tool call arguments are not JSON: {e}")).param("messages")
            })?;
            f["arguments"] = parsed;
        }
    }
    Ok(Value::Array(calls))
}

/// A validated generation job.
pub(crate) struct Job {
    pub(crate) prompt: Vec<u32>,
    /// Whether and how the reply goes on past the context (`--context-shift`).
    pub(crate) shift: Option<Shift>,
    pub(crate) sampler: SamplerConfig,
    pub(crate) max_tokens: usize,
    pub(crate) stop: Vec<String>,
    pub(crate) stream: bool,
    /// Streamed: `usage` in its own last chunk (`stream_options.include_usage`).
    pub(crate) include_usage: bool,
    /// Streamed: every chunk carries its choice's usage so far (vLLM's
    /// `stream_options.continuous_usage_stats`, with `include_usage`).
    pub(crate) continuous_usage: bool,
    /// The prompt's and the reply's token ids are answered (vLLM's `return_token_ids`).
    pub(crate) token_ids: bool,
    /// Log-probabilities name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids`).
    pub(crate) ids_as_text: bool,
    /// The answer's id is made of this (vLLM's `request_id`).
    pub(crate) request_id: Option<String>,
    /// Tokens `truncate_prompt_tokens` dropped from the prompt.
    pub(crate) prompt_cut: usize,
    /// The prefix cache's salt (vLLM's `cache_salt`, hashed: [`Request::salt`]).
    pub(crate) salt: Option<u64>,
    /// vLLM's `priority` ([`Request::priority`]).
    pub(crate) priority: i64,
    /// OpenAI's `service_tier` ([`Request::tier`]) and the name the answer gives it (where
    /// the request named one).
    pub(crate) tier: Tier,
    pub(crate) tier_name: Option<&'static str>,
    pub(crate) ignore_eos: bool,
    /// End-of-generation (and `stop_ids`) masked until this many tokens (vLLM's).
    pub(crate) min_tokens: usize,
    /// Tokens that end the reply (vLLM's `stop_token_ids`).
    pub(crate) stop_ids: Vec<u32>,
    /// The stop string or token that ends the reply stays in its text (vLLM's
    /// `include_stop_str_in_output`).
    pub(crate) include_stop: bool,
    /// Every special token's text stays in the reply (vLLM's `skip_special_tokens:
    /// false`).
    pub(crate) show_special: bool,
    /// Tokens it may or may not generate (vLLM's `allowed_token_ids`, `bad_words`).
    pub(crate) masks: TokenMasks,
    /// The prompt scored, each token with this many alternatives, and listed in vLLM's
    /// `prompt_logprobs` (not echoed).
    pub(crate) prompt_logprobs: Option<usize>,
    /// Lines indented less end the reply (llama-server's `n_indent`; 0: off).
    pub(crate) n_indent: usize,
    /// A new line past this much generation time ends the reply (`t_max_predict_ms`).
    pub(crate) t_max_predict: Option<std::time::Duration>,
    /// Speculative decoding's guesses per step (0: off).
    pub(crate) draft_max: usize,
    pub(crate) model: String,
    /// Top alternatives per token when log-probabilities were asked for.
    pub(crate) logprobs: Option<usize>,
    /// The log-probabilities are after the sampling chain (llama-server's
    /// `post_sampling_probs`).
    pub(crate) post_sampling: bool,
    /// Streamed chunks carry `timings` so far (llama-server's `timings_per_token`).
    pub(crate) timings_per_token: bool,
    /// Streamed: chunks say how far the prompt has gone in (llama-server's
    /// `return_progress`).
    pub(crate) progress: bool,
    /// Completions: the prompt is part of the answer (text, and log-probabilities).
    pub(crate) echo: bool,
    /// With echo: how many of the prompt's first tokens the server added (a BOS the model's
    /// tokenizer prepends to a text prompt), left out of the echoed text and log-probabilities
    /// so that the answer starts with the prompt as it was sent.
    pub(crate) echo_from: usize,
    /// The grammar the output follows, and the request field that gave it.
    pub(crate) grammar: Option<(Grammar, &'static str)>,
    /// Chat with tools: how replies are parsed for calls.
    pub(crate) tools: Option<Arc<Tools>>,
    /// Chat with a thinking template: how a reply's reasoning is told from its answer.
    pub(crate) reasoning: Option<Reasoning>,
    /// Special tokens the reply's text keeps (the markers of its tool-call syntax and
    /// thinking; llama-server's preserved tokens); other special tokens are dropped.
    pub(crate) keep: Arc<[u32]>,
    /// Choices asked for this prompt (`n`); [`expand`] makes one job per choice.
    pub(crate) n: usize,
    /// Choices made of this prompt (`best_of`, at least `n`): the `n` likeliest are
    /// answered.
    pub(crate) best_of: usize,
    /// Which of the `n` choices this job is (0 for the first).
    pub(crate) copy: usize,
    /// Shared by the `n` choices of one prompt: the engine prefills the prompt once and the
    /// others start from its cached blocks.
    pub(crate) group: Option<u64>,
    /// Predicted outputs: the prediction's tokens ([`Request::prediction`]).
    pub(crate) prediction: Option<Arc<[u32]>>,
    /// The slot it names (`id_slot`, [`Request::slot`]).
    pub(crate) slot: Option<usize>,
    /// vLLM's beam search (`use_beam_search`): shared by the `n` choices of the prompt,
    /// each the search's beam of its `copy`.
    pub(crate) beam: Option<Arc<beam::BeamSearch>>,
}

/// One job per choice: `n` copies of each job, the `i`-th sampling with seed + `i` (so
/// the choices differ, and the same request gives the same choices).
pub(crate) fn expand(jobs: Vec<Job>) -> Vec<Job> {
    let mut out = Vec::new();
    for j in jobs {
        let copies = j.n.max(j.best_of);
        let group = (copies > 1).then(random_seed);
        for copy in 0..copies {
            let mut sampler = j.sampler.clone();
            sampler.seed = sampler.seed.wrapping_add(copy as u64);
            out.push(Job {
                prompt: j.prompt.clone(),
                sampler,
                stop: j.stop.clone(),
                model: j.model.clone(),
                grammar: j.grammar.clone(),
                tools: j.tools.clone(),
                reasoning: j.reasoning.clone(),
                keep: j.keep.clone(),
                prediction: j.prediction.clone(),
                stop_ids: j.stop_ids.clone(),
                masks: j.masks.clone(),
                request_id: j.request_id.clone(),
                slot: j.slot,
                beam: j.beam.clone(),
                copy,
                group,
                ..j
            });
        }
    }
    out
}

/// A request body, or a 400 naming the field at fault by its path (`messages[2].content`)
/// where the JSON is well formed but a field's type is not.
pub(crate) fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ApiError::bad(
            "invalid JSON body: the body is a list; a request is a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    let v = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || inner.is_syntax() || inner.is_eof() {
            ApiError::bad(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::bad(format!("invalid JSON body: {path}: {inner}")).param_path(path)
        }
    })?;
    // (trailing characters, as `serde_json::from_slice` refuses them)
    de.end()
        .map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))?;
    Ok(v)
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `a == b` in time that depends on their lengths only, not on where they differ (a
/// client timing the answers learns nothing of a key's bytes).
fn same_key(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Checks the API key when the server has one.
pub(crate) fn authorize(st: &ServerState, headers: &HeaderMap) -> Result<(), ApiError> {
    if st.api_keys.is_empty() {
        return Ok(());
    }
    // `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    let sent = [bearer, x_api_key];
    // every key compared in full, in time independent of where a guess differs
    let ok = st.api_keys.iter().fold(false, |ok, key| {
        sent.iter()
            .fold(ok, |ok, s| ok | s.is_some_and(|s| same_key(s, key)))
    });
    if ok {
        Ok(())
    } else {
        Err(ApiError::status(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid or missing API key (send `Authorization: Bearer <key>` or `x-api-key: <key>`)",
        ))
    }
}

/// `logit_bias`: an object mapping token ids (as strings) to numbers in -100..=100.
fn logit_bias_request(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| Err(ApiError::bad(m).param("logit_bias"));
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return bad("logit_bias must be an object of token ids to numbers".into()),
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let Some(id) = k.parse::<u32>().ok().filter(|&id| (id as usize) < vocab) else {
            return bad(format!(
                "logit_bias key {k:?} is not a token id in this vocabulary (0..{vocab})"
            ));
        };
        match b.as_f64() {
            Some(b) if (-100.0..=100.0).contains(&b) => out.push((id, b as f32)),
            _ => {
                return bad(format!(
                    "logit_bias[{k:?}] {b} must be a number in -100..=100"
                ))
            }
        }
    }
    Ok(out)
}

/// A JSON list of token ids (what `prompt` and `input` may be), or a 400 on `param`; the
/// range against the vocabulary is [`in_vocabulary`]'s.
pub(crate) fn token_ids(v: &[Value], param: &'static str) -> Result<Vec<u32>, ApiError> {
    v.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::bad("token ids must be integers in the vocabulary").param(param))
}

/// A 400 on `param` when a token id of `tokens` is outside the vocabulary.
pub(crate) fn in_vocabulary(
    st: &ServerState,
    tokens: &[u32],
    param: &'static str,
) -> Result<(), ApiError> {
    match tokens.iter().find(|&&t| t as usize >= st.vocab) {
        Some(&bad) => Err(ApiError::bad(format!(
            "token id {bad} is outside the vocabulary ({})",
            st.vocab
        ))
        .param(param)),
        None => Ok(()),
    }
}

/// Validates the shared fields and builds the job around `prompt`.
pub(crate) fn job(
    st: &ServerState,
    c: Common,
    prompt: Vec<u32>,
    default_max: usize,
    kind: Kind,
) -> Result<Job, ApiError> {
    let logprobs = logprobs_request(&c, kind)?;
    let grammar = grammar_request(&c)?;
    let echo = c.echo == Some(true);
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty").param("prompt"));
    }
    if c.repeat_penalty.is_some() && c.repetition_penalty.is_some() {
        return Err(ApiError::bad(
            "give one of repeat_penalty (llama.cpp's) and repetition_penalty (vLLM's)",
        )
        .param("repetition_penalty"));
    }
    let min_tokens = match c.min_tokens {
        None => 0,
        Some(n) if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => {
            return Err(ApiError::bad(format!("min_tokens {n} must be >= 0")).param("min_tokens"))
        }
    };
    let stop_ids = match &c.stop_token_ids {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(v)) if v.len() <= 256 => {
            let ids = token_ids(v, "stop_token_ids")?;
            in_vocabulary(st, &ids, "stop_token_ids")?;
            ids
        }
        Some(_) => {
            return Err(
                ApiError::bad("stop_token_ids must be a list of up to 256 token ids")
                    .param("stop_token_ids"),
            )
        }
    };
    let masks = token_masks(st, &c)?;
    let prompt_logprobs = match &c.prompt_logprobs {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(k) => Some(alternatives(k, "prompt_logprobs")?),
            None => {
                return Err(ApiError::bad(format!(
                    "prompt_logprobs {v} must be an integer in 0..={MAX_TOP_LOGPROBS}"
                ))
                .param("prompt_logprobs"))
            }
        },
    };
    if prompt_logprobs.is_some() {
        // (vLLM's refusal, and ours: one prompt scored once, listed once)
        let clash = if c.stream == Some(true) {
            Some("prompt_logprobs are not available when stream is true")
        } else if c.n.is_some_and(|n| n != 1) {
            Some("prompt_logprobs takes n = 1")
        } else if echo {
            Some("give prompt_logprobs or echo (which lists the prompt's log-probabilities with the reply's), not both")
        } else {
            None
        };
        if let Some(m) = clash {
            return Err(ApiError::bad(m).param("prompt_logprobs"));
        }
    }
    let ctx = st.ctx;
    // vLLM's truncate_prompt_tokens: the prompt cut (by default its last tokens kept),
    // leaving the reply a token at least
    let before = prompt.len();
    let prompt = match c.truncation.parse(st)? {
        Some(t) => t.at_most(ctx - 1).cut(prompt),
        None => prompt,
    };
    let prompt_cut = before - prompt.len();
    let shift = shift_request(st, &c, prompt.len())?;
    let prompt = match shift {
        Some(sh) if c.truncate => truncate_prompt(prompt, sh.keep, ctx),
        _ => prompt,
    };
    if prompt.len() >= ctx {
        // OpenAI's answer to a prompt over the context: this code, on the field that holds it
        return Err(ApiError::bad(format!(
            "the prompt is {} tokens, which exceeds the available context size of {ctx} tokens (prompt + completion)",
            prompt.len()
        ))
        .param(if kind == Kind::Chat {
            "messages"
        } else {
            "prompt"
        })
        .code("context_length_exceeded"));
    }
    in_vocabulary(st, &prompt, "prompt")?;
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::bad(format!("n {n} must be in 1..={MAX_N}")).param("n")),
    };
    if n > 1 && echo {
        return Err(ApiError::bad("echo takes n = 1").param("n"));
    }
    let room = ctx - prompt.len();
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        // with echo, 0 scores the prompt and generates nothing (what evaluators send)
        Some(0) if echo => 0,
        Some(n) if n < 1 => {
            let echo_note = match kind {
                Kind::Completion => " (0 only with echo)",
                Kind::Chat => "",
            };
            // (named as sent: max_completion_tokens is read first)
            let field = if c.max_completion_tokens.is_some() {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            return Err(
                ApiError::bad(format!("{field} {n} must be at least 1{echo_note}")).param(field),
            );
        }
        // a request that shifts may ask for more than the context holds
        Some(n) => usize::try_from(n)
            .unwrap_or(usize::MAX)
            .min(if shift.is_some() { usize::MAX } else { room }),
        // the model's recommended most (its max_new_tokens) where the request sets none
        None => default_max
            .min(room)
            .min(st.default_max_tokens.unwrap_or(usize::MAX)),
    };
    let d = &st.default_sampler;
    let temp = c.temperature.map_or(d.temp, |t| t as f32);
    if !(temp.is_finite() && (0.0..=100.0).contains(&temp)) {
        return Err(ApiError::bad("temperature must be a number >= 0").param("temperature"));
    }
    let top_k = match c.top_k {
        Some(k) if k < 0 => return Err(ApiError::bad("top_k must be >= 0").param("top_k")),
        Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        None => d.top_k,
    };
    let logit_bias = logit_bias_request(c.logit_bias.as_ref(), st.vocab)?;
    let sampler = SamplerConfig {
        temp,
        top_k,
        top_p: c.top_p.map_or(d.top_p, |p| p as f32),
        min_p: c.min_p.map_or(d.min_p, |p| p as f32),
        repeat_penalty: c
            .repeat_penalty
            .or(c.repetition_penalty)
            .map_or(d.repeat_penalty, |p| p as f32),
        // vLLM's repetition penalty looks at the whole sequence
        repeat_last_n: if c.repetition_penalty.is_some() {
            st.ctx
        } else {
            d.repeat_last_n
        },
        // a seed the server picks is 32-bit, as llama-server's: reported in
        // `generation_settings` and sent back by clients whose numbers are doubles (a
        // JavaScript UI) exactly
        seed: c.seed.map_or_else(
            || {
                st.default_seed
                    .unwrap_or_else(|| random_seed() & u64::from(u32::MAX))
            },
            |s| s as u64,
        ),
        frequency_penalty: c
            .frequency_penalty
            .map_or(d.frequency_penalty, |p| p as f32),
        presence_penalty: c.presence_penalty.map_or(d.presence_penalty, |p| p as f32),
        logit_bias,
        extra: d.extra.clone(),
    };
    let mut sampler = sampler;
    llama_sampling(st, &c.llama, &mut sampler)?;
    sampler.check().map_err(|e| {
        // the request's name of the setting, not the command line's
        let param = match e.field {
            "temp" => "temperature",
            f => f,
        };
        ApiError::bad(format!("{param} {} must be {}", e.value, e.expected)).param(param)
    })?;
    let stop = match c.stop {
        // the model's recommended stop strings where the request gives none
        None => st.default_stop.clone(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 16 {
        return Err(ApiError::bad("at most 16 stop strings").param("stop"));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop strings must not be empty").param("stop"));
    }
    let draft_max = match (c.draft.as_deref(), c.draft_max) {
        (None | Some("none"), None) => 0,
        (None | Some("none"), Some(_)) => {
            return Err(ApiError::bad("draft_max needs \"draft\": \"ngram\"").param("draft_max"))
        }
        (Some("ngram"), k) => match k.unwrap_or(gds_runtime::plan::DEFAULT_DRAFT_MAX as i64) {
            k @ 1..=32 => k as usize,
            k => {
                return Err(
                    ApiError::bad(format!("draft_max {k} must be between 1 and 32"))
                        .param("draft_max"),
                )
            }
        },
        (Some(other), _) => {
            return Err(
                ApiError::bad(format!("draft {other:?}: expected \"ngram\" or \"none\""))
                    .param("draft"),
            )
        }
    };
    let slot = match c.id_slot {
        None | Some(-1) => None,
        Some(i) if (0..st.max_batch as i64).contains(&i) => Some(i as usize),
        Some(i) => {
            return Err(ApiError::bad(format!(
                "id_slot {i}: this server's slots are 0..={} (-1: any)",
                st.max_batch.saturating_sub(1)
            ))
            .param("id_slot"))
        }
    };
    let stream_option = |name: &str| match &c.stream_options {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(o)) => match o.get(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(
                ApiError::bad(format!("stream_options.{name} {v} must be a boolean"))
                    .param("stream_options"),
            ),
        },
        Some(v) => Err(
            ApiError::bad(format!("stream_options {v} must be an object")).param("stream_options"),
        ),
    };
    let include_usage = stream_option("include_usage")?;
    let continuous_usage = include_usage && stream_option("continuous_usage_stats")?;
    let salt = match &c.cache_salt {
        None => None,
        Some(s) if !s.is_empty() && s.len() <= 1024 => {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            s.hash(&mut h);
            Some(h.finish())
        }
        Some(_) => {
            return Err(
                ApiError::bad("cache_salt must be a string of 1 to 1024 bytes").param("cache_salt"),
            )
        }
    };
    let priority = c.priority.unwrap_or(0);
    if priority != 0 && !st.priority_scheduling {
        // (vLLM's answer where it was not started to schedule by priority)
        return Err(ApiError::bad(
            "priority other than 0 needs the server started with --scheduling-policy priority \
             (else it shares the engine by client, first come first served)",
        )
        .param("priority"));
    }
    let (tier, tier_name) = service_tier(c.service_tier.as_deref())?;
    if let Some(r) = &c.request_id {
        // (it becomes part of the answer's id: printable, bounded)
        if r.is_empty() || r.len() > 256 || r.chars().any(|ch| ch.is_control()) {
            return Err(
                ApiError::bad("request_id must be 1 to 256 bytes of printable text")
                    .param("request_id"),
            );
        }
    }
    Ok(Job {
        prompt,
        sampler,
        max_tokens,
        stop,
        stream: c.stream.unwrap_or(false),
        include_usage,
        continuous_usage,
        token_ids: c.return_token_ids == Some(true),
        ids_as_text: c.return_tokens_as_token_ids == Some(true),
        request_id: c.request_id.clone(),
        prompt_cut,
        salt,
        priority,
        tier,
        tier_name,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        min_tokens,
        stop_ids,
        include_stop: c.include_stop_str_in_output.unwrap_or(false),
        show_special: c.skip_special_tokens == Some(false),
        masks,
        prompt_logprobs,
        n_indent: c
            .n_indent
            .filter(|&n| n > 0)
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        t_max_predict: c
            .t_max_predict_ms
            .filter(|&t| t > 0)
            .map(|t| std::time::Duration::from_millis(t as u64)),
        draft_max,
        model: c.model.unwrap_or_else(|| st.model_name().to_string()),
        logprobs,
        post_sampling: false,
        timings_per_token: c.timings_per_token == Some(true),
        progress: c.stream == Some(true) && c.return_progress == Some(true),
        echo,
        echo_from: 0,
        grammar,
        tools: None,
        reasoning: None,
        keep: Arc::from([]),
        n,
        best_of: n,
        copy: 0,
        group: None,
        shift,
        prediction: None,
        slot,
        beam: None,
    })
}

/// Most `bad_words` a request may send, and most bytes in one.
const MAX_BAD_WORDS: usize = 128;
const MAX_BAD_WORD_BYTES: usize = 1024;

/// vLLM's `allowed_token_ids` (a list of token ids, not empty) and `bad_words` (a list of
/// strings: each tokenized as it is, without its leading spaces, and after one space where
/// that gives as many tokens but another first one, as vLLM tokenizes them).
fn token_masks(st: &ServerState, c: &Common) -> Result<TokenMasks, ApiError> {
    let allowed = match &c.allowed_token_ids {
        None | Some(Value::Null) => None,
        Some(Value::Array(v)) if !v.is_empty() => {
            let mut ids = token_ids(v, "allowed_token_ids")?;
            in_vocabulary(st, &ids, "allowed_token_ids")?;
            ids.sort_unstable();
            ids.dedup();
            Some(Arc::from(ids))
        }
        Some(_) => {
            return Err(
                ApiError::bad("allowed_token_ids must be a list of token ids, not empty")
                    .param("allowed_token_ids"),
            )
        }
    };
    let bad = |m: String| ApiError::bad(m).param("bad_words");
    let words: Vec<&str> = match &c.bad_words {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(v)) if v.len() <= MAX_BAD_WORDS => v
            .iter()
            .map(|w| w.as_str().filter(|w| w.len() <= MAX_BAD_WORD_BYTES))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                bad(format!(
                    "bad_words must be strings of up to {MAX_BAD_WORD_BYTES} bytes"
                ))
            })?,
        Some(_) => {
            return Err(bad(format!(
                "bad_words must be a list of up to {MAX_BAD_WORDS} strings"
            )))
        }
    };
    let mut banned: Vec<Vec<u32>> = Vec::new();
    for w in words {
        let encode = |text: &str| {
            st.tokenizer
                .encode(text, false, false)
                .map_err(|e| bad(format!("bad_words {w:?}: {e}")))
        };
        let plain = encode(w.trim_start())?;
        let Some(&first) = plain.first() else {
            return Err(bad(format!(
                "bad_words {w:?} is no token (entries must tokenize to at least one)"
            )));
        };
        // the word in the middle of a text (after a space): where its tokens differ
        let spaced = encode(&format!(" {}", w.trim_start()))?;
        let other = spaced.len() == plain.len() && spaced.first() != Some(&first);
        banned.push(plain);
        if other {
            banned.push(spaced);
        }
    }
    Ok(TokenMasks {
        allowed,
        banned: banned.into(),
    })
}

/// Whether a request shifts its context ([`Shift`]: its own `shift` (Ollama's endpoints),
/// else `--context-shift`), and how: `n_keep` prompt tokens kept after the BOS (-1: the
/// whole prompt; default `--keep`), `n_discard` dropped at each shift (0: half), as
/// llama-server reads them.
fn shift_request(
    st: &ServerState,
    c: &Common,
    prompt_len: usize,
) -> Result<Option<Shift>, ApiError> {
    if !c.shift.unwrap_or(st.context_shift) {
        return Ok(None);
    }
    let keep = match c.n_keep.unwrap_or(st.keep) {
        -1 => prompt_len,
        k if k >= 0 => usize::try_from(k)
            .unwrap_or(usize::MAX)
            .saturating_add(usize::from(st.tokenizer.add_bos())),
        k => {
            return Err(
                ApiError::bad(format!("n_keep {k} must be -1 (the whole prompt) or more"))
                    .param("n_keep"),
            )
        }
    };
    let discard = match c.n_discard.unwrap_or(0) {
        d if d >= 0 => usize::try_from(d).unwrap_or(usize::MAX),
        d => {
            return Err(
                ApiError::bad(format!("n_discard {d} must be 0 (half) or more")).param("n_discard"),
            )
        }
    };
    Ok(Some(Shift { keep, discard }))
}

/// A prompt over a context of `ctx` cut as Ollama cuts it where it shifts: its first `keep`
/// tokens (at most `ctx - 1`), then its latest ones, half of the context after `keep` left
/// free for the reply (as a first shift would leave it). A prompt that fits is unchanged.
pub(crate) fn truncate_prompt(prompt: Vec<u32>, keep: usize, ctx: usize) -> Vec<u32> {
    if prompt.len() < ctx || ctx < 2 {
        return prompt;
    }
    let keep = keep.min(ctx - 1);
    let limit = ctx - ((ctx - keep) / 2).max(1);
    let tail = limit.saturating_sub(keep);
    let mut out = prompt[..keep].to_vec();
    out.extend_from_slice(&prompt[prompt.len() - tail..]);
    out
}

/// llama.cpp's `repeat_last_n` as the tokens the repeat penalty looks back over: -1 is the
/// context, 0 off; `None` below -1.
pub(crate) fn repeat_window(st: &ServerState, n: i64) -> Option<usize> {
    match n {
        -1 => Some(st.ctx),
        n => usize::try_from(n).ok(),
    }
}

/// Sets `s`'s llama.cpp samplers from a request's fields (llama-server's names and rules:
/// a `dry_base` under 1 is the default, -1 windows are the context), builds DRY's breakers
/// for this vocabulary where DRY is on, and refuses what is out of range naming the field.
fn llama_sampling(
    st: &ServerState,
    l: &LlamaSampling,
    s: &mut SamplerConfig,
) -> Result<(), ApiError> {
    let num = |v: &Option<Value>, name: &'static str| -> Result<Option<f64>, ApiError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                ApiError::bad(format!("{name} must be a number, not {v}")).param(name)
            }),
        }
    };
    let x = &mut s.extra;
    // the fields taken as they are (their ranges are `SamplerConfig::check`'s)
    macro_rules! take {
        ($($field:ident),*) => {$(
            if let Some(v) = num(&l.$field, stringify!($field))? {
                x.$field = v as f32;
            }
        )*};
    }
    take!(
        typical_p,
        top_n_sigma,
        xtc_probability,
        xtc_threshold,
        dynatemp_range,
        dynatemp_exponent,
        mirostat_tau,
        mirostat_eta,
        dry_multiplier,
        adaptive_target,
        adaptive_decay
    );
    if let Some(b) = num(&l.dry_base, "dry_base")? {
        // llama-server's rule: a base under 1 means the default
        x.dry_base = if b >= 1.0 { b as f32 } else { 1.75 };
    }
    // integers, whole and within lo..=hi, or a 400 naming them
    let whole =
        |v: &Option<Value>, name: &'static str, lo: f64, hi: f64, what: &str| match num(v, name)? {
            None => Ok(None),
            Some(v) if v.fract() == 0.0 && (lo..=hi).contains(&v) => Ok(Some(v as i64)),
            Some(v) => Err(ApiError::bad(format!("{name} {v} must be {what}")).param(name)),
        };
    const MAX: f64 = i32::MAX as f64;
    let (count, window) = ("an integer >= 0", "-1 (the context) or an integer >= 0");
    if let Some(m) = whole(&l.mirostat, "mirostat", 0.0, 2.0, "0, 1 or 2")? {
        x.mirostat = m as u8;
    }
    if let Some(n) = whole(&l.dry_allowed_length, "dry_allowed_length", 0.0, MAX, count)? {
        x.dry_allowed_length = n as usize;
    }
    if let Some(n) = whole(
        &l.dry_penalty_last_n,
        "dry_penalty_last_n",
        -1.0,
        MAX,
        window,
    )? {
        x.dry_penalty_last_n = repeat_window(st, n).unwrap_or(0);
    }
    if let Some(n) = whole(&l.min_keep, "min_keep", 0.0, MAX, count)? {
        x.min_keep = n as usize;
    }
    if let Some(n) = whole(&l.repeat_last_n, "repeat_last_n", -1.0, MAX, window)? {
        s.repeat_last_n = repeat_window(st, n).unwrap_or(0);
    }
    match &l.dry_sequence_breakers {
        None | Some(Value::Null) => {}
        Some(Value::Array(a))
            if !a.is_empty() && a.len() <= gds_runtime::sampler::MAX_DRY_BREAKERS =>
        {
            x.dry_sequence_breakers = a
                .iter()
                .map(|b| b.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| {
                    ApiError::bad("dry_sequence_breakers must be a list of strings")
                        .param("dry_sequence_breakers")
                })?;
        }
        Some(_) => {
            return Err(ApiError::bad(format!(
                "dry_sequence_breakers must be a non-empty list of at most {} strings",
                gds_runtime::sampler::MAX_DRY_BREAKERS
            ))
            .param("dry_sequence_breakers"))
        }
    }
    let order = l.samplers.as_ref().map_or(Ok(None), Stage::from_json);
    if let Some(order) = order.map_err(|m| ApiError::bad(m).param("samplers"))? {
        x.order = order;
    }
    if x.dry_on() || x.order.contains(&Stage::Infill) {
        // DRY's breakers and the infill stage's tables: read on first need (off the async
        // threads' work: the first scans every token), then kept
        tokio::task::block_in_place(|| gds_runtime::engine::attach_vocab_tables(s, &st.tokenizer));
    }
    Ok(())
}

/// Compiles `job`'s grammar (off the async threads: a large schema takes a while, and the
/// first one indexes the vocabulary; one compile at a time, see `ServerState::grammar_slot`).
/// A grammar that does not compile is a 400 naming the field and the problem.
pub(crate) async fn constrain(
    st: &Arc<ServerState>,
    job: &Job,
) -> Result<Option<Constraint>, ApiError> {
    let Some((grammar, param)) = job.grammar.clone() else {
        return Ok(None);
    };
    let st2 = st.clone();
    // (held by the compile until it ends, even when this request's client has gone)
    let slot = st.grammar_slot.clone().acquire_owned().await.map_err(|_| {
        ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_unavailable",
            "the server is stopping",
        )
    })?;
    // a call grammar holds the functions' schemas: the one that does not compile is named
    let functions: Vec<(String, Value)> = match (&job.tools, param) {
        (Some(t), "tool_choice") => t.functions().to_vec(),
        _ => Vec::new(),
    };
    let t0 = Instant::now();
    let compiled = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let compiler = st2.grammar_compiler().map_err(|e| {
            (
                format!("this model's vocabulary cannot be used for constrained decoding: {e}"),
                param,
            )
        })?;
        compiler.compile(&grammar).map_err(|e| {
            for (name, schema) in &functions {
                if let Err(f) = compiler.compile(&Grammar::JsonSchema(schema.clone())) {
                    return (format!("invalid schema for function {name}: {f}"), "tools");
                }
            }
            (e.to_string(), param)
        })
    })
    .await
    .map_err(|e| ApiError::server(format!("compiling the grammar failed: {e}")))?;
    st.metrics.record_grammar(t0.elapsed());
    compiled
        .map(Some)
        .map_err(|(e, param)| ApiError::bad(e).param(param))
}

/// Hands `job` to the engine, or refuses it when the queue is full.
/// The receiver of a submitted request's events, and the flag that marks it ended by the
/// front end (see [`Request::ended_by_front`]).
pub(crate) type Submitted = (mpsc::UnboundedReceiver<Event>, Arc<AtomicBool>);

pub(crate) fn submit(
    st: &ServerState,
    job: &Job,
    constraint: Option<Constraint>,
) -> Result<Submitted, ApiError> {
    enqueue(st, |tx, ended| Request {
        ended_by_front: ended,
        prompt: job.prompt.clone(),
        sampler: job.sampler.clone(),
        max_tokens: job.max_tokens,
        ignore_eos: job.ignore_eos,
        min_tokens: job.min_tokens,
        stop_ids: job.stop_ids.clone(),
        masks: job.masks.clone(),
        draft_max: job.draft_max,
        prediction: job.prediction.clone(),
        // (best_of ranks the choices by their tokens' log-probabilities)
        logprobs: job.logprobs.or((job.best_of > job.n).then_some(0)),
        post_sampling: job.post_sampling,
        echo: job.echo || job.prompt_logprobs.is_some(),
        prompt_top: job.prompt_logprobs,
        salt: job.salt,
        priority: job.priority,
        tier: job.tier,
        embed: None,
        constraint,
        shift: job.shift,
        group: job.group,
        progress: job.progress,
        slot: job.slot,
        tx,
        received: Instant::now(),
        client: None,
        background: false,
    })
}

/// Hands the request `make` builds (around its event sender and front-end flag) to the
/// engine, unless the queue is full (429) or the engine has stopped (503).
pub(crate) fn enqueue(
    st: &ServerState,
    make: impl FnOnce(mpsc::UnboundedSender<Event>, Arc<AtomicBool>) -> Request,
) -> Result<Submitted, ApiError> {
    let m = &st.metrics;
    // (a client's request counts the queue without the Batch APIs' requests in it: a batch
    // never makes a client's request find the queue full)
    let background = crate::client::BACKGROUND.try_with(|b| *b).unwrap_or(false);
    let mut queued = m.queue_depth.load(Ordering::Relaxed);
    if !background {
        queued -= m.queue_depth_batch.load(Ordering::Relaxed);
    }
    if queued >= st.queue_limit as i64 {
        m.rejected_busy.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "server_busy",
            format!(
                "the queue is full ({} waiting); retry later",
                st.queue_limit
            ),
        ));
    }
    // a client's share of the engine (from a connection; not the batch mode's)
    let client = match crate::client::CLIENT.try_with(|ip| *ip) {
        Ok(ip) => Some(st.client_jobs.take(ip, st.client_share).ok_or_else(|| {
            m.rejected_busy.fetch_add(1, Ordering::Relaxed);
            m.rejected_client.fetch_add(1, Ordering::Relaxed);
            ApiError::status(
                StatusCode::TOO_MANY_REQUESTS,
                "server_busy",
                format!(
                    "this client address has {} requests in the engine, its share of the queue \
                     (--queue-limit x --max-client-connections / --max-connections, at least \
                     twice --max-batch); retry later",
                    st.client_share
                ),
            )
            .code("client_busy")
        })?),
        Err(_) => None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let ended = Arc::new(AtomicBool::new(false));
    let mut req = make(tx, ended.clone());
    req.client = client;
    req.background = background;
    m.queue_depth_add(1, background);
    if st.engine.send(Msg::from(req)).is_err() {
        m.queue_depth_sub(1, background);
        return Err(ApiError::engine_stopped());
    }
    m.requests.fetch_add(1, Ordering::Relaxed);
    Ok((rx, ended))
}

/// Where the spaces and tabs that start the line at byte `line` of `text` end (llama-server's
/// indentation, `n_indent`).
fn indent_end(text: &[u8], line: usize) -> usize {
    line + text
        .get(line..)
        .unwrap_or_default()
        .iter()
        .take_while(|&&b| b == b' ' || b == b'\t')
        .count()
}

/// What generation hands to the response writers.
pub(crate) enum Piece {
    Text(String),
    End(End),
    Error(ApiError),
}

/// llama-server's `prompt_progress`: `{"total", "cache", "processed", "time_ms"}` (whole ms).
pub(crate) fn progress_json(p: &Progress) -> Value {
    json!({"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms as u64})
}

/// The `timings` of a prompt still going in: the tokens computed so far and the time.
pub(crate) fn progress_timings(p: &Progress) -> Value {
    let so_far = Prefill {
        cached_tokens: p.cache,
        prompt_ms: p.time_ms,
        queue_ms: 0.0,
    };
    timing_fields(p.processed, &so_far, 0.0, 0)
}

/// What [`Gen::next_or_progress`] gives.
pub(crate) enum Next {
    Piece(Piece),
    Progress(Progress),
}

pub(crate) struct End {
    pub(crate) finish: &'static str,
    /// The stop string that ended the text, when one did.
    pub(crate) stop: Option<String>,
    pub(crate) completion_tokens: usize,
    /// Of `completion_tokens`, the thinking's (where a split counted them).
    pub(crate) reasoning_tokens: usize,
    pub(crate) done: Option<Done>,
    /// The reply's log-probability a token, where the engine gave them (`best_of` ranks by
    /// it).
    pub(crate) mean_logprob: Option<f64>,
    /// What a chat answer lists beside its choices, where asked for.
    pub(crate) beside: Option<Box<Beside>>,
}

/// What a chat answer lists beside its choices (vLLM's fields; completions list them in
/// each choice).
#[derive(Default)]
pub(crate) struct Beside {
    /// `prompt_logprobs`.
    pub(crate) prompt_logprobs: Option<Value>,
    /// `return_token_ids`: the prompt's.
    pub(crate) prompt_token_ids: Option<Vec<u32>>,
}

/// Turns the engine's token events into text: UTF-8 held back until whole, stop strings
/// searched across pieces and held back while they may be completing. Dropping it drops the
/// receiver, which cancels the request in the engine.
pub(crate) struct Gen {
    rx: mpsc::UnboundedReceiver<Event>,
    ended_by_front: Arc<AtomicBool>,
    st: Arc<ServerState>,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    /// Text, stop strings and the token count: the per-token policy the CLI follows too.
    reply: Reply,
    ended: bool,
    /// Log-probabilities of the tokens so far, and how many were handed out.
    lps: Vec<(u32, TokenLogprobs)>,
    lps_taken: usize,
    want_logprobs: bool,
    /// With echo (or vLLM's `prompt_logprobs`): the prompt tokens' log-probabilities (from
    /// the second token on), each with its rank.
    prompt_lps: Vec<(TokenLogprobs, usize)>,
    /// With echo: the prompt, listed before the first generated token's entry.
    echo_prompt: Option<Vec<u32>>,
    /// With echo: the first prompt token listed ([`Job::echo_from`]).
    echo_from: usize,
    /// Characters of the tokens handed out (completions' `text_offset`).
    lp_chars: Utf8Count,
    /// The generated tokens that carry text (not the end-of-generation one), and how many
    /// were handed out (llama-server's `tokens`).
    tokens: Vec<u32>,
    tokens_taken: usize,
    /// The end-of-generation token the reply ended with, until handed out.
    eog: Option<u32>,
    /// What the prompt cost, and when the first token came (per-token timings).
    prefill: Option<(Prefill, Instant)>,
    /// Special tokens whose text the reply keeps ([`Job::keep`]).
    keep: Arc<[u32]>,
    /// Every special token's text is kept ([`Job::show_special`]).
    show_special: bool,
    /// Log-probabilities name tokens `token_id:N` ([`Job::ids_as_text`]).
    ids_as_text: bool,
    /// The token that ends the reply (end of generation, a stop id) adds its text
    /// ([`Job::include_stop`]).
    include_stop: bool,
    /// Tokens that end the reply besides end-of-generation ones ([`Job::stop_ids`]).
    stop_ids: Vec<u32>,
    /// llama-server's line limits ([`Job::n_indent`], [`Job::t_max_predict`]), and where
    /// they are: whether the reply has a new line, and where the line after the last one
    /// looked at starts.
    n_indent: usize,
    t_max_predict: Option<std::time::Duration>,
    has_new_line: bool,
    last_nl_pos: usize,
    /// Prompt tokens (a reply the front end ends reports them as the engine would).
    prompt_len: usize,
}

impl Gen {
    /// The generator of `job`'s reply, submitted as `submitted` (`want_logprobs`: the
    /// front end hands log-probabilities out).
    pub(crate) fn new(
        st: Arc<ServerState>,
        (rx, ended_by_front): Submitted,
        job: &Job,
        want_logprobs: bool,
    ) -> Gen {
        Gen {
            keep: job.keep.clone(),
            show_special: job.show_special,
            ids_as_text: job.ids_as_text,
            include_stop: job.include_stop,
            stop_ids: job.stop_ids.clone(),
            n_indent: job.n_indent,
            t_max_predict: job.t_max_predict,
            has_new_line: false,
            last_nl_pos: 0,
            prompt_len: job.prompt.len(),
            rx,
            ended_by_front,
            st,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
            reply: Reply::new(job.stop.clone())
                .keeping_stop(job.include_stop)
                .stops_after(job.min_tokens),
            ended: false,
            lps: Vec::new(),
            lps_taken: 0,
            want_logprobs,
            lp_chars: Utf8Count::default(),
            prompt_lps: Vec::new(),
            echo_prompt: None,
            echo_from: 0,
            tokens: Vec::new(),
            tokens_taken: 0,
            eog: None,
            prefill: None,
        }
    }

    /// llama.cpp-style `timings` so far (`timings_per_token`): the prompt's as the engine
    /// measured it, the tokens since the first as they arrived here.
    pub(crate) fn timings_so_far(&self, prompt_tokens: usize) -> Value {
        let (p, first) = self.prefill.unwrap_or((Prefill::default(), Instant::now()));
        let decode_ms = first.elapsed().as_secs_f64() * 1000.0;
        timing_fields(prompt_tokens, &p, decode_ms, self.reply.generated())
    }

    /// Prompt tokens the prefix cache held, once the engine said (0 before).
    pub(crate) fn cached_tokens(&self) -> usize {
        self.prefill.map_or(0, |(p, _)| p.cached_tokens)
    }

    /// The generated tokens not handed out yet (the end-of-generation token is not one).
    pub(crate) fn take_tokens(&mut self) -> Vec<u32> {
        let from = std::mem::replace(&mut self.tokens_taken, self.tokens.len());
        self.tokens[from..].to_vec()
    }

    /// The generated tokens not handed out yet, the end-of-generation token last once the
    /// reply ended with one (vLLM's `token_ids`).
    pub(crate) fn take_all_tokens(&mut self) -> Vec<u32> {
        let mut t = self.take_tokens();
        t.extend(self.take_eog());
        t
    }

    /// The end-of-generation token the reply ended with, once (llama-server lists it
    /// last in `/completion`'s `tokens`, and streams it in an event of its own).
    pub(crate) fn take_eog(&mut self) -> Option<u32> {
        self.eog.take()
    }

    /// The log-probabilities not handed out yet, as the engine gave them (each token's id
    /// first); empty when none were asked for.
    pub(crate) fn take_raw_logprobs(&mut self) -> Vec<(u32, TokenLogprobs)> {
        let from = std::mem::replace(&mut self.lps_taken, self.lps.len());
        self.lps[from..].to_vec()
    }

    /// Whether log-probabilities were asked for and some are not handed out yet.
    fn has_pending_logprobs(&self, kind: Kind) -> bool {
        self.want_logprobs
            && self.lps[self.lps_taken..]
                .iter()
                .any(|(id, _)| self.listed(kind, *id))
    }

    /// Whether the token `id` is listed in `kind`'s `logprobs`: every token in a completion
    /// (the end-of-generation one too: evaluators score it), every one but the end of
    /// generation in a chat reply (OpenAI's chat lists only what its content holds).
    fn listed(&self, kind: Kind, id: u32) -> bool {
        kind == Kind::Completion || !self.st.tokenizer.is_eog(id)
    }

    /// The `logprobs` field of a choice for the tokens not handed out yet: OpenAI's chat
    /// form (`content`: token, logprob, bytes, top_logprobs) or completions form (`tokens`,
    /// `token_logprobs`, `top_logprobs`, `text_offset`); `null` when none were asked for.
    pub(crate) fn take_logprobs(&mut self, kind: Kind) -> Value {
        if !self.want_logprobs {
            return Value::Null;
        }
        let from = self.lps_taken;
        self.lps_taken = self.lps.len();
        let tok = &self.st.tokenizer;
        // a token's name: its text, or (vLLM's return_tokens_as_token_ids) `token_id:N`
        let ids_as_text = self.ids_as_text;
        let name = |id: u32, b: &[u8]| {
            if ids_as_text {
                format!("token_id:{id}")
            } else {
                token_text(b)
            }
        };
        let text = |id: u32| name(id, &tok.token_bytes(id));
        let lps = &self.lps[from..];
        match kind {
            Kind::Chat => {
                let entry = |id: u32, lp: f32| {
                    let b = tok.token_bytes(id);
                    let t = name(id, &b);
                    let b = if ids_as_text {
                        t.as_bytes().to_vec()
                    } else {
                        b
                    };
                    json!({"token": t, "logprob": lp, "bytes": b})
                };
                let content: Vec<Value> = lps
                    .iter()
                    .filter(|(id, _)| self.listed(kind, *id))
                    .map(|(id, l)| {
                        let mut e = entry(*id, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|&(i, p)| entry(i, p)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
            Kind::Completion => {
                let (mut tokens, mut lp, mut top, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                // the alternatives, and the token itself where they miss it (OpenAI lists
                // up to `logprobs` + 1: the sampled token always among them)
                let alts = |id: u32, l: &TokenLogprobs| -> Value {
                    let mut m: serde_json::Map<String, Value> =
                        l.top.iter().map(|&(i, p)| (text(i), json!(p))).collect();
                    if !l.top.iter().any(|&(i, _)| i == id) {
                        m.entry(text(id)).or_insert(json!(l.logprob));
                    }
                    Value::Object(m)
                };
                // echo: the prompt's tokens first, the first without a log-probability
                let prompt = self.echo_prompt.take().unwrap_or_default();
                let prompt_lps =
                    std::iter::once(None).chain(self.prompt_lps.iter().map(|(l, _)| Some(l)));
                let entries = prompt
                    .iter()
                    .zip(prompt_lps)
                    .skip(self.echo_from)
                    .chain(lps.iter().map(|(id, l)| (id, Some(l))));
                for (id, l) in entries {
                    let b = tok.token_bytes(*id);
                    // (the offset in characters of the text: a token inside a character
                    // points at it, the characters counted as they complete)
                    offsets.push(self.lp_chars.chars);
                    self.lp_chars.push(&b);
                    tokens.push(name(*id, &b));
                    lp.push(l.map_or(Value::Null, |l| json!(l.logprob)));
                    top.push(l.map_or(Value::Null, |l| alts(*id, l)));
                }
                json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": offsets})
            }
        }
    }

    /// The text `id` adds: special tokens other than the kept ones add none (they never
    /// enter the decoded ids, so the rest decodes with special tokens as text).
    fn decode_step(&mut self, id: u32) -> Result<Option<String>, String> {
        if !self.show_special && !self.st.tokenizer.shows(id, &self.keep) {
            return Ok(None);
        }
        tokenizers::step_decode_stream(
            self.st.tokenizer.inner(),
            vec![id],
            false,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| e.to_string())
    }

    fn flush(&mut self) -> String {
        let all = self
            .st
            .tokenizer
            .inner()
            .decode(&self.ids, false)
            .unwrap_or_default();
        all.strip_prefix(self.prefix.as_str())
            .unwrap_or("")
            .to_string()
    }

    /// The next piece, or `None` once the end was reported.
    pub(crate) async fn next(&mut self) -> Option<Piece> {
        loop {
            // (how far the prompt has gone in: for the front ends that asked, below)
            if let Next::Piece(p) = self.next_or_progress().await? {
                return Some(p);
            }
        }
    }

    /// The next piece or, for a request that asked for it (`return_progress`), how far its
    /// prompt has gone in; `None` once the end was reported.
    pub(crate) async fn next_or_progress(&mut self) -> Option<Next> {
        if self.ended {
            return None;
        }
        loop {
            let ev = self.rx.recv().await;
            match ev {
                Some(Event::PromptLogprobs(lp, rank)) => self.prompt_lps.push((lp, rank)),
                Some(Event::Prefilled(p)) => self.prefill = Some((p, Instant::now())),
                Some(Event::Token(id, lp)) => {
                    self.reply.token();
                    if let Some(lp) = lp {
                        self.lps.push((id, lp));
                    }
                    let eog = self.st.tokenizer.is_eog(id);
                    if eog {
                        self.eog = Some(id);
                    } else {
                        self.tokens.push(id);
                    }
                    if (eog || self.stop_ids.contains(&id)) && !self.include_stop {
                        // the token that ends the reply: counted and scored, not text
                        // (whether or not the vocabulary marks it special), as in vLLM
                        // unless include_stop_str_in_output
                        continue;
                    }
                    let piece = match self.decode_step(id) {
                        Ok(p) => p,
                        Err(e) => return Some(Next::Piece(self.fail(e))),
                    };
                    if let Some(p) = piece {
                        if self.reply.push(&p) {
                            // a stop string: end here; closing the receiver ends the request
                            // in the engine, counted as finished
                            self.ended_by_front.store(true, Ordering::Relaxed);
                            self.rx.close();
                            let done = self.done_here();
                            return Some(Next::Piece(self.end("stop", done)));
                        }
                        if self.line_limits(&p) {
                            // llama-server's indentation or time limit: the same, "length"
                            self.ended_by_front.store(true, Ordering::Relaxed);
                            self.rx.close();
                            let done = self.done_here();
                            return Some(Next::Piece(self.end("length", done)));
                        }
                        let hold = self.indent_hold();
                        self.reply.hold_from(hold);
                        if let Some(s) = self.reply.take_shown(false) {
                            return Some(Next::Piece(Piece::Text(s)));
                        }
                    }
                }
                Some(Event::Done(d)) => {
                    let rest = self.flush();
                    let stopped = self.reply.push_final(&rest);
                    let finish = if stopped || d.finish == Finish::Eos {
                        "stop"
                    } else {
                        "length"
                    };
                    return Some(Next::Piece(self.end(finish, Some(d))));
                }
                Some(Event::Error(e)) => return Some(Next::Piece(self.fail(e))),
                Some(Event::Progress(p)) => return Some(Next::Progress(p)),
                // only embedding requests get one
                Some(Event::Embedding(_)) => {}
                Some(Event::RequestFault(e, code)) => {
                    // the request's grammar went past the grammar engine's limits, or its
                    // masks left no token
                    self.ended = true;
                    return Some(Next::Piece(Piece::Error(ApiError::bad(e).code(code))));
                }
                None => {
                    return Some(Next::Piece(
                        self.fail("the engine dropped the request".into()),
                    ))
                }
            }
        }
    }

    /// llama-server's line limits after the piece `p` was added, as its `process_token`
    /// checks them: once the reply has a new line, `n_indent` looks at the line after the
    /// last one it looked at (one a token) and, where it has a character after fewer spaces
    /// or tabs, cuts the text there and ends the reply; a piece with a new line past
    /// `t_max_predict` of generation ends it. True where one ended it.
    fn line_limits(&mut self, p: &str) -> bool {
        let mut end = false;
        if self.has_new_line && self.n_indent > 0 {
            let text = self.reply.text();
            let b = text.as_bytes();
            let mut cut = None;
            if self.last_nl_pos > 0 {
                let pos = indent_end(b, self.last_nl_pos);
                if pos < b.len() && pos - self.last_nl_pos < self.n_indent {
                    cut = Some(pos);
                }
            }
            if let Some(i) = text.get(self.last_nl_pos..).and_then(|t| t.find('\n')) {
                self.last_nl_pos += i + 1;
            }
            if let Some(at) = cut {
                self.reply.cut(at);
                end = true;
            }
        }
        if p.contains('\n') {
            self.has_new_line = true;
            let late = |t: std::time::Duration| self.prefill.is_some_and(|(_, f)| f.elapsed() > t);
            end |= self.t_max_predict.is_some_and(late);
        }
        end
    }

    /// With `n_indent`: where the text a later check may cut starts (held back until then):
    /// the first line from the next one checked whose indentation is not yet known to be
    /// enough, from the end of its leading spaces. Lines are checked one a token, so one
    /// may be checked a token after its first character came; held back, it is cut as
    /// llama-server cuts its text.
    fn indent_hold(&self) -> Option<usize> {
        if self.n_indent == 0 {
            return None;
        }
        let t = self.reply.text().as_bytes();
        let mut line = match self.last_nl_pos {
            0 => t.iter().position(|&b| b == b'\n')? + 1,
            at => at,
        };
        loop {
            let pos = indent_end(t, line);
            if pos >= t.len() || pos - line < self.n_indent {
                return Some(pos.min(t.len()));
            }
            // indented enough: the next line
            line += t.get(line..)?.iter().position(|&b| b == b'\n')? + 1;
        }
    }

    /// The counters of a reply the front end ended (a stop string), as the engine's
    /// [`Event::Done`] would have them: what the prompt cost, and the time since the first
    /// token (none before the prompt was in: the engine sends that first).
    fn done_here(&self) -> Option<Done> {
        let (p, first) = self.prefill?;
        Some(Done {
            finish: Finish::Eos,
            prompt_tokens: self.prompt_len,
            cached_tokens: p.cached_tokens,
            generated: self.reply.generated(),
            prompt_ms: p.prompt_ms,
            decode_ms: first.elapsed().as_secs_f64() * 1000.0,
            queue_ms: p.queue_ms,
            // (the engine's counts are not known here)
            predicted_accepted: 0,
            predicted_rejected: 0,
        })
    }

    fn fail(&mut self, e: String) -> Piece {
        self.ended = true;
        Piece::Error(ApiError::server(e))
    }

    fn end(&mut self, finish: &'static str, done: Option<Done>) -> Piece {
        self.ended = true;
        Piece::End(End {
            finish,
            stop: self.reply.stop_string().map(str::to_string),
            completion_tokens: self.reply.generated(),
            reasoning_tokens: 0,
            done,
            beside: None,
            mean_logprob: (!self.lps.is_empty()).then(|| {
                self.lps
                    .iter()
                    .map(|(_, l)| f64::from(l.logprob))
                    .sum::<f64>()
                    / self.lps.len() as f64
            }),
        })
    }

    /// vLLM's `prompt_logprobs` of `prompt`: `null` for its first token, then for each the
    /// token's and its most likely alternatives' `{logprob, rank, decoded_token}` by id.
    pub(crate) fn vllm_prompt_logprobs(&self, prompt: &[u32]) -> Value {
        let tok = &self.st.tokenizer;
        let entry = |id: u32, logprob: f32, rank: usize| {
            // (a logprob that is not a number is listed as vLLM clamps it)
            let logprob = if logprob.is_finite() {
                logprob
            } else {
                -9999.0
            };
            json!({"logprob": logprob, "rank": rank, "decoded_token": token_text(&tok.token_bytes(id))})
        };
        let scored = prompt
            .iter()
            .skip(1)
            .zip(&self.prompt_lps)
            .map(|(&id, (l, rank))| {
                let mut m = serde_json::Map::new();
                m.insert(id.to_string(), entry(id, l.logprob, *rank));
                for (r, &(alt, p)) in l.top.iter().enumerate() {
                    m.entry(alt.to_string())
                        .or_insert_with(|| entry(alt, p, r + 1));
                }
                Value::Object(m)
            });
        Value::Array(std::iter::once(Value::Null).chain(scored).collect())
    }

    /// Tokens generated so far.
    pub(crate) fn generated(&self) -> usize {
        self.reply.generated()
    }

    /// Whatever text is still held back when the end comes.
    pub(crate) fn rest(&mut self) -> Option<String> {
        self.reply.take_shown(true)
    }
}

/// llama.cpp-style timings of a choice that ended.
pub(crate) fn timings(end: &End, prompt_tokens: usize) -> Value {
    let p = end.done.as_ref().map_or(Prefill::default(), |d| Prefill {
        cached_tokens: d.cached_tokens,
        prompt_ms: d.prompt_ms,
        queue_ms: d.queue_ms,
    });
    let decode_ms = end.done.as_ref().map_or(0.0, |d| d.decode_ms);
    timing_fields(prompt_tokens, &p, decode_ms, end.completion_tokens)
}

/// llama.cpp's `timings`: the prompt (`prompt_tokens`, what `p` says it cost), and `n`
/// generated tokens in `decode_ms` (after the first, which the prompt's pass gives).
fn timing_fields(prompt_tokens: usize, p: &Prefill, decode_ms: f64, n: usize) -> Value {
    let pn = prompt_tokens.saturating_sub(p.cached_tokens);
    let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let tps = |ms: f64, n: usize| {
        if ms > 0.0 {
            n as f64 * 1000.0 / ms
        } else {
            0.0
        }
    };
    let dn = n.saturating_sub(1);
    json!({
        "cache_n": p.cached_tokens,
        "prompt_n": pn,
        "prompt_ms": p.prompt_ms,
        "prompt_per_token_ms": per(p.prompt_ms, pn),
        "prompt_per_second": tps(p.prompt_ms, pn),
        "predicted_n": n,
        "predicted_ms": decode_ms,
        "predicted_per_token_ms": per(decode_ms, dn),
        "predicted_per_second": tps(decode_ms, dn),
        "queue_ms": p.queue_ms,
    })
}

/// OpenAI's `usage`; `predicted` is predicted outputs' (accepted, rejected) guesses.
pub(crate) fn usage(
    prompt_tokens: usize,
    completion: usize,
    cached: usize,
    reasoning: usize,
    predicted: (usize, usize),
) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning,
            "accepted_prediction_tokens": predicted.0,
            "rejected_prediction_tokens": predicted.1,
        },
    })
}

/// The (accepted, rejected) guesses of a choice's prediction.
fn predicted(end: &End) -> (usize, usize) {
    end.done
        .as_ref()
        .map_or((0, 0), |d| (d.predicted_accepted, d.predicted_rejected))
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// Submits `job` and runs it (not streamed) to its end: its generator (for the tokens and
/// log-probabilities), its reasoning (a thinking model's, split off as it streams: the same
/// split as the whole text's, its tokens counted in the end), its text (the answer; the whole
/// text without a split) and how it ended. A grammar's error names the field that gave the
/// grammar.
pub(crate) async fn run_to_end(
    st: &Arc<ServerState>,
    job: &Job,
) -> Result<(Gen, Option<String>, String, End), ApiError> {
    let mut gen = start_gen(st, job).await?;
    let (mut reasoning, mut text) = (String::new(), String::new());
    let mut split = job.reasoning.as_ref().map(CountedSplit::new);
    let mut end = loop {
        match gen.next().await {
            Some(Piece::Text(t)) => match &mut split {
                Some(sp) => {
                    let (r, answer) = sp.push(&t, gen.generated());
                    reasoning.push_str(&r);
                    text.push_str(&answer);
                }
                None => text.push_str(&t),
            },
            Some(Piece::End(e)) => break e,
            Some(Piece::Error(e)) => {
                return Err(match (&job.grammar, e.status) {
                    (Some((_, param)), StatusCode::BAD_REQUEST) => e.param(param),
                    _ => e,
                })
            }
            // only after an end or an error, both handled above
            None => return Err(ApiError::server("generation ended without a result")),
        }
    };
    let rest = gen.rest().unwrap_or_default();
    match &mut split {
        Some(sp) => {
            let (r, answer) = sp.end(&rest, end.completion_tokens);
            reasoning.push_str(&r);
            text.push_str(&answer);
            end.reasoning_tokens = sp.tokens();
        }
        None => text.push_str(&rest),
    }
    let reasoning = (!reasoning.is_empty()).then_some(reasoning);
    Ok((gen, reasoning, text, end))
}

/// A chat choice's `finish_reason`: `tool_calls` where the reply has calls and ended on its
/// own (an end-of-generation token or a stop string), else how it ended (`length` where the
/// limit cut it, calls or not, as llama-server reports).
pub(crate) fn finish_reason(finish: &'static str, calls: bool) -> &'static str {
    if calls && finish != "length" {
        "tool_calls"
    } else {
        finish
    }
}

/// Runs `job` (not streamed) to its end: the choice at `index`, and how it ended.
pub(crate) async fn complete(
    st: &Arc<ServerState>,
    job: &Job,
    kind: Kind,
    index: usize,
) -> Result<(Value, End), ApiError> {
    let (mut gen, reasoning, mut text, mut end) = run_to_end(st, job).await?;
    let logprobs = gen.take_logprobs(kind);
    if let Some(prompt) = job.echo_text(st) {
        text.insert_str(0, &prompt);
    }
    let prompt_logprobs = job
        .prompt_logprobs
        .map(|_| gen.vllm_prompt_logprobs(&job.prompt));
    // vLLM's return_token_ids: the reply's tokens, its end of generation too
    let token_ids = job.token_ids.then(|| gen.take_all_tokens());
    let choice = match kind {
        Kind::Completion => {
            let mut c = json!({"text": text, "index": index, "logprobs": logprobs, "finish_reason": end.finish});
            if let Some(p) = prompt_logprobs {
                c["prompt_logprobs"] = p;
            }
            if let Some(ids) = token_ids {
                c["prompt_token_ids"] = json!(job.prompt);
                c["token_ids"] = json!(ids);
            }
            c
        }
        Kind::Chat => {
            let (mut message, calls) =
                crate::tools::assistant_message(job.tools.as_deref(), &text, end.finish);
            if let Some(r) = reasoning {
                message["reasoning_content"] = json!(r);
            }
            // (vLLM lists a chat prompt's beside the choices)
            let mut c = json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(end.finish, calls)});
            let prompt_token_ids = token_ids.map(|ids| {
                c["token_ids"] = json!(ids);
                job.prompt.clone()
            });
            if prompt_logprobs.is_some() || prompt_token_ids.is_some() {
                end.beside = Some(Box::new(Beside {
                    prompt_logprobs,
                    prompt_token_ids,
                }));
            }
            c
        }
    };
    Ok((choice, end))
}

/// OpenAI's `service_tier`: the tier a request runs in and the name its answer gives it
/// (`auto` and `scale` run as `default`, `fast` as `priority`, as OpenAI names them; none
/// where the request named none); another value is a 400.
pub(crate) fn service_tier(v: Option<&str>) -> Result<(Tier, Option<&'static str>), ApiError> {
    Ok(match v {
        None => (Tier::Default, None),
        Some("auto" | "default" | "scale") => (Tier::Default, Some("default")),
        Some("priority" | "fast") => (Tier::Priority, Some("priority")),
        Some("flex") => (Tier::Flex, Some("flex")),
        Some(t) => {
            return Err(ApiError::bad(format!(
                "service_tier {t:?} is not one of auto, default, flex, scale, priority, fast"
            ))
            .param("service_tier"))
        }
    })
}

/// A non-streamed chat or text completion: its choices kept as JSON text.
#[derive(Serialize)]
struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<&'static str>,
    choices: Vec<Box<RawValue>>,
    usage: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    timings: Option<Value>,
    /// Chat with vLLM's `prompt_logprobs` (completions list them in each choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Value>,
    /// Chat with vLLM's `return_token_ids` (completions list them in each choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<Vec<u32>>,
}

/// The choices of a non-streamed reply, from `runs` in order (at most `window` in flight; the
/// rest wait here, not in the engine's queue: one request of 64 prompts x 16 choices neither
/// fills the queue other clients need nor is refused by it), each kept as JSON text as it
/// ends (a parsed value with log-probabilities takes ~10x its text). When their text passes
/// `--max-reply` bytes the request fails with 400 `reply_too_large` and the choices
/// still running are cancelled: many choices of thousands of tokens with top log-probabilities
/// would otherwise be built whole in memory (tens of GB).
pub(crate) async fn collect_choices<T>(
    st: &ServerState,
    runs: Vec<BoxFuture<'_, Result<(Value, T), ApiError>>>,
    window: usize,
) -> Result<Vec<(Box<RawValue>, T)>, ApiError> {
    let limit = st.limits.max_reply;
    let total = runs.len();
    let mut done = stream::iter(runs).buffered(window.max(1));
    let (mut out, mut bytes) = (Vec::new(), 0usize);
    while let Some(r) = done.next().await {
        let (v, t) = r?;
        let raw =
            serde_json::value::to_raw_value(&v).map_err(|e| ApiError::server(e.to_string()))?;
        bytes += raw.get().len();
        if bytes > limit {
            st.metrics.replies_too_large.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::bad(format!(
                "the reply passed the server's limit of {} for a reply that is not streamed (--max-reply) at choice {} of {total}: stream it (\"stream\": true), or ask for fewer choices, tokens or log-probabilities",
                indicatif::HumanBytes(limit as u64),
                out.len() + 1,
            ))
            .code("reply_too_large"));
        }
        out.push((raw, t));
    }
    Ok(out)
}

/// OpenAI's `best_of` (completions): an integer from `n` (default 1) to 16; more than `n`
/// cannot be streamed nor echo the prompt (`None`: not given).
fn best_of_request(v: Option<&Value>, c: &Common) -> Result<Option<usize>, ApiError> {
    let n = c.n.unwrap_or(1);
    let b = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => match v.as_i64() {
            Some(b) if (n..=MAX_N as i64).contains(&b) => b as usize,
            _ => {
                return Err(ApiError::bad(format!(
                    "best_of {v} must be an integer from n ({n}) to {MAX_N}"
                ))
                .param("best_of"))
            }
        },
    };
    if b as i64 > n {
        if c.stream == Some(true) {
            return Err(ApiError::bad("best_of choices cannot be streamed").param("best_of"));
        }
        if c.echo == Some(true) {
            return Err(ApiError::bad("echo takes best_of 1").param("best_of"));
        }
    }
    Ok(Some(b))
}

/// The `n` likeliest of each prompt's `per_prompt` choices (by log-probability a token,
/// the first made first among equals), numbered again in that order.
fn best_choices(
    results: Vec<(Box<RawValue>, End)>,
    per_prompt: usize,
    n: usize,
) -> Result<Vec<(Box<RawValue>, End)>, ApiError> {
    let mut out = Vec::with_capacity(results.len() / per_prompt * n);
    let mut it = results.into_iter();
    loop {
        let mut group: Vec<_> = it.by_ref().take(per_prompt).collect();
        if group.is_empty() {
            return Ok(out);
        }
        let score = |e: &End| e.mean_logprob.unwrap_or(f64::NEG_INFINITY);
        group.sort_by(|a, b| score(&b.1).total_cmp(&score(&a.1)));
        for (raw, end) in group.into_iter().take(n) {
            let mut v: Value =
                serde_json::from_str(raw.get()).map_err(|e| ApiError::server(e.to_string()))?;
            v["index"] = json!(out.len());
            let raw =
                serde_json::value::to_raw_value(&v).map_err(|e| ApiError::server(e.to_string()))?;
            out.push((raw, end));
        }
    }
}

/// Runs `jobs` (several: the prompts of one completions request and `n` choices of each,
/// admitted together, one choice each in that order, streamed or not) and answers in the
/// format of `kind`.
async fn respond(st: Arc<ServerState>, jobs: Vec<Job>, kind: Kind) -> Result<Response, ApiError> {
    let jobs = expand(jobs);
    let kind_id = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let id = match jobs.first().and_then(|j| j.request_id.as_deref()) {
        Some(r) => format!("{kind_id}-{r}"),
        None => format!("{kind_id}-{:016x}", random_seed()),
    };
    let created = now_secs();
    let tier_name = jobs.first().and_then(|j| j.tier_name);
    if !jobs.first().is_some_and(|j| j.stream) {
        let model = jobs.first().map(|j| j.model.clone()).unwrap_or_default();
        let runs: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(i, j)| complete(&st, j, kind, i).boxed())
            .collect();
        let per_prompt = jobs.first().map_or(1, |j| j.n.max(j.best_of));
        let window = window(&st, per_prompt);
        let mut results = collect_choices(&st, runs, window).await?;
        // a prompt counts once, however many choices it has
        let n_prompt: usize = jobs
            .iter()
            .filter(|j| j.copy == 0)
            .map(|j| j.prompt.len())
            .sum();
        let n_completion: usize = results.iter().map(|(_, e)| e.completion_tokens).sum();
        let n_reasoning: usize = results.iter().map(|(_, e)| e.reasoning_tokens).sum();
        let guessed = results
            .iter()
            .map(|(_, e)| predicted(e))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let cached: usize = jobs
            .iter()
            .zip(&results)
            .filter(|(j, _)| j.copy == 0)
            .map(|(_, (_, e))| e.done.as_ref().map_or(0, |d| d.cached_tokens))
            .sum();
        // best_of: each prompt's n likeliest choices, in that order (every choice made counts
        // in the usage, as OpenAI bills them)
        let n = jobs.first().map_or(1, |j| j.n);
        if per_prompt > n {
            results = best_choices(results, per_prompt, n)?;
        }
        let timings = match &results[..] {
            [(_, end)] => Some(timings(end, n_prompt)),
            _ => None,
        };
        let beside = results
            .first_mut()
            .and_then(|(_, e)| e.beside.take())
            .map_or_else(Beside::default, |b| *b);
        let body = Completion {
            id: &id,
            object: if kind == Kind::Chat {
                "chat.completion"
            } else {
                "text_completion"
            },
            created,
            model: &model,
            system_fingerprint: &st.fingerprint,
            service_tier: tier_name,
            choices: results.into_iter().map(|(c, _)| c).collect(),
            usage: usage(n_prompt, n_completion, cached, n_reasoning, guessed),
            timings,
            prompt_logprobs: beside.prompt_logprobs,
            prompt_token_ids: beside.prompt_token_ids,
        };
        return Ok(Json(body).into_response());
    }
    // streamed: the choices' chunks go out as they come, interleaved, each with its choice's
    // index (as OpenAI streams `n` > 1 and several prompts); the usage chunk (when asked) and
    // `[DONE]` follow the last choice's end
    let model = jobs.first().map(|j| j.model.clone()).unwrap_or_default();
    let object = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    // as OpenAI streams: with `stream_options.include_usage` every chunk has `usage: null`
    // and one more chunk, with no choices, carries the usage before `[DONE]`; without it no
    // chunk has `usage`. Each choice's last chunk carries llama.cpp-style `timings`.
    let include_usage = jobs.first().is_some_and(|j| j.include_usage);
    // (every chunk's fields but its choices, made once)
    let mut head = json!({"id": id, "object": object, "created": created, "model": model,
                          "system_fingerprint": st.fingerprint, "choices": []});
    if let Some(t) = tier_name {
        head["service_tier"] = json!(t);
    }
    let usage_chunk = {
        let head = head.clone();
        move |u: Value| {
            let mut v = head.clone();
            v["usage"] = u;
            SseEvent::default().data(v.to_string())
        }
    };
    let chunk = Arc::new(move |choice: Value, t: Option<Value>| {
        let mut v = head.clone();
        v["choices"] = json!([choice]);
        if include_usage {
            v["usage"] = Value::Null;
        }
        if let (Some(Value::Object(extra)), Some(o)) = (t, v.as_object_mut()) {
            o.extend(extra);
        }
        SseEvent::default().data(v.to_string())
    });
    let totals = Arc::new(std::sync::Mutex::new(StreamTotals::default()));
    let (st2, totals2) = (st.clone(), totals.clone());
    let body = stream_choices(&st, jobs, move |index, job, g| {
        let echo = job.echo_text(&st2);
        let info = ChoiceInfo {
            index,
            kind,
            prompt_tokens: job.prompt.len(),
            first_copy: job.copy == 0,
            echo,
            tools: job
                .tools
                .clone()
                .filter(|t| t.parses() && kind == Kind::Chat),
            reasoning: job.reasoning.clone().filter(|_| kind == Kind::Chat),
            timings_per_token: job.timings_per_token,
            continuous_usage: job.continuous_usage,
            prompt_ids: job.token_ids.then(|| job.prompt.clone()),
            prompt_pending: AtomicBool::new(job.token_ids),
        };
        match g {
            Ok(g) => choice_stream(info, g, chunk.clone(), totals2.clone()).boxed(),
            Err(e) => {
                totals2.lock().unwrap_or_else(|e| e.into_inner()).failed = true;
                refused(e)
            }
        }
    })
    .await?;
    let tail = stream::once(async move {
        let t = *totals.lock().unwrap_or_else(|e| e.into_inner());
        if t.failed {
            return Vec::new();
        }
        let mut out = Vec::new();
        if include_usage {
            out.push(usage_chunk(usage(
                t.prompt,
                t.completion,
                t.cached,
                t.reasoning,
                t.predicted,
            )));
        }
        out.push(SseEvent::default().data("[DONE]"));
        out
    })
    .flat_map(stream::iter);
    Ok(sse(body.chain(tail).map(Ok::<_, Infallible>)))
}

/// The events of one streamed choice, each item with whether it ends the whole stream (an
/// error).
pub(crate) type ChoiceEvents = futures_util::stream::BoxStream<'static, (Vec<SseEvent>, bool)>;

/// The streamed choices of one request, interleaved as they come: the first window of
/// `jobs` submitted before answering (a refusal is the HTTP answer; dropping the ones already
/// submitted cancels them), the others as earlier choices end (a request of many choices keeps
/// at most a window of them in the engine). `events(index, job, submitted)` makes a choice's
/// events (`Err`: refused when its turn came). An error ends the stream after its event, and
/// dropping the other choices cancels them.
pub(crate) async fn stream_choices(
    st: &Arc<ServerState>,
    jobs: Vec<Job>,
    events: impl Fn(usize, Job, Result<Gen, ApiError>) -> ChoiceEvents + Send + Sync + 'static,
) -> Result<impl Stream<Item = SseEvent> + Send, ApiError> {
    let window = window(st, jobs.first().map_or(1, |j| j.n));
    let mut ready = Vec::with_capacity(window);
    for j in jobs.iter().take(window) {
        ready.push(start_gen(st, j).await?);
    }
    let events = Arc::new(events);
    let mut ready = ready.into_iter();
    let choices: Vec<_> = jobs
        .into_iter()
        .enumerate()
        .map(|(index, job)| {
            let (st, events, g) = (st.clone(), events.clone(), ready.next());
            // submitted when the stream first polls it (the first window's already were)
            stream::once(async move {
                let g = match g {
                    Some(g) => Ok(g),
                    None => start_gen(&st, &job).await,
                };
                events(index, job, g)
            })
            .flatten()
            .boxed()
        })
        .collect();
    let all = stream::iter(choices).flatten_unordered(window);
    Ok(stream::unfold((all, false), |(mut all, stop)| async move {
        if stop {
            return None;
        }
        let (events, fatal) = all.next().await?;
        Some((events, (all, fatal)))
    })
    .flat_map(stream::iter))
}

/// The one event of a choice refused when its turn came: its error, which ends the stream.
pub(crate) fn refused(e: ApiError) -> ChoiceEvents {
    stream::iter([(vec![SseEvent::default().data(e.body().to_string())], true)]).boxed()
}

/// How many of one request's jobs (choices, embedding inputs) are in the engine at once:
/// twice the engine's batch (so the next is queued when one ends), whole groups of `n`
/// choices, never more than half the queue or its client's share.
pub(crate) fn window(st: &ServerState, n: usize) -> usize {
    let n = n.max(1);
    let w = (2 * st.max_batch).max(n).div_ceil(n) * n;
    w.min(st.queue_limit.div_ceil(2))
        .min(st.client_share)
        .max(1)
}

/// A token's text in log-probabilities: its text where its bytes are whole characters, else
/// `bytes:` and the bytes as `\xNN` (OpenAI's form for a piece of a character: two pieces
/// are two keys of `top_logprobs`, not two U+FFFD).
pub(crate) fn token_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut s = String::from("bytes:");
            for b in bytes {
                let _ = std::fmt::Write::write_fmt(&mut s, format_args!("\\x{b:02x}"));
            }
            s
        }
    }
}

/// Characters in a run of bytes fed a token at a time: whole ones counted, a character's
/// first bytes held until it completes (a byte that cannot start or continue one counts as
/// the U+FFFD the text shows).
#[derive(Default)]
struct Utf8Count {
    chars: usize,
    pending: Vec<u8>,
}

impl Utf8Count {
    fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    self.chars += s.chars().count();
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    self.chars += std::str::from_utf8(valid).map_or(0, |s| s.chars().count());
                    match e.error_len() {
                        Some(n) => {
                            self.chars += 1;
                            rest = &after[n..];
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
    }
}

impl Job {
    /// With echo: the prompt's text as the answer starts with it (from [`Job::echo_from`]).
    fn echo_text(&self, st: &ServerState) -> Option<String> {
        self.echo.then(|| {
            st.tokenizer
                .inner()
                .decode(&self.prompt[self.echo_from..], false)
                .unwrap_or_default()
        })
    }
}

/// Submits `job` and makes the generator of its text (with echo, the prompt first).
pub(crate) async fn start_gen(st: &Arc<ServerState>, job: &Job) -> Result<Gen, ApiError> {
    let submitted = match &job.beam {
        // (a beam search has no grammar: beam::make refuses one)
        Some(b) => b.start(st, job).await?,
        None => submit(st, job, constrain(st, job).await?)?,
    };
    let mut g = Gen::new(st.clone(), submitted, job, job.logprobs.is_some());
    if job.echo {
        g.echo_prompt = Some(job.prompt.clone());
        g.echo_from = job.echo_from;
    }
    Ok(g)
}

/// What the choices of one streamed response add up to (its usage chunk).
#[derive(Default, Clone, Copy)]
struct StreamTotals {
    /// Prompt tokens (a prompt counts once, however many choices it has).
    prompt: usize,
    completion: usize,
    cached: usize,
    /// Of `completion`, the thinking's.
    reasoning: usize,
    /// Predicted outputs' (accepted, rejected) guesses.
    predicted: (usize, usize),
    /// A choice ended in an error: the stream ends there.
    failed: bool,
}

/// One streamed choice's fixed facts.
struct ChoiceInfo {
    index: usize,
    kind: Kind,
    prompt_tokens: usize,
    /// The first choice of its prompt: its prompt and cached tokens count in the usage.
    first_copy: bool,
    /// With echo: the prompt's text, sent before the first generated text.
    echo: Option<String>,
    /// Chat with tools whose calls are parsed.
    tools: Option<Arc<Tools>>,
    /// Chat with a thinking template: the reasoning goes out as `delta.reasoning_content`.
    reasoning: Option<Reasoning>,
    /// Every chunk carries `timings` so far.
    timings_per_token: bool,
    /// Every chunk carries its choice's usage so far (vLLM's `continuous_usage_stats`).
    continuous_usage: bool,
    /// vLLM's `return_token_ids`: the prompt's ids (the first chunk: chat's beside the
    /// choice, completions' in it, until sent) and each chunk's own.
    prompt_ids: Option<Vec<u32>>,
    prompt_pending: AtomicBool,
}

impl ChoiceInfo {
    /// The choice's usage after `completion` tokens (vLLM's continuous usage).
    fn usage_at(&self, completion: usize) -> Value {
        usage(self.prompt_tokens, completion, 0, 0, (0, 0))
    }
}

/// A chunk of one choice, with more top-level fields (`timings`, `prompt_progress`).
type Chunk = Arc<dyn Fn(Value, Option<Value>) -> SseEvent + Send + Sync>;

/// One choice's chunks (chat: the role first), each item the events of one piece of
/// generation and whether it was an error (which ends the whole stream). Its end adds to
/// `totals`.
fn choice_stream(
    info: ChoiceInfo,
    gen: Gen,
    chunk: Chunk,
    totals: Arc<std::sync::Mutex<StreamTotals>>,
) -> impl Stream<Item = (Vec<SseEvent>, bool)> + Send {
    let (index, kind) = (info.index, info.kind);
    let text_choice = move |text: String, logprobs: Value| match kind {
        Kind::Completion => {
            json!({"text": text, "index": index, "logprobs": logprobs, "finish_reason": null})
        }
        Kind::Chat => {
            json!({"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null})
        }
    };
    let first = (kind == Kind::Chat).then(|| {
        // (vLLM's: the prompt's token ids beside the first chunk's choice, the usage so far)
        let mut extra = serde_json::Map::new();
        if let Some(ids) = &info.prompt_ids {
            info.prompt_pending.store(false, Ordering::Relaxed);
            extra.insert("prompt_token_ids".into(), json!(ids));
        }
        if info.continuous_usage {
            extra.insert("usage".into(), info.usage_at(0));
        }
        let mut role = json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
        if info.prompt_ids.is_some() {
            role["token_ids"] = json!([]);
        }
        (
            vec![chunk(role, (!extra.is_empty()).then_some(Value::Object(extra)))],
            false,
        )
    });
    // with tools, text streams as usual until a call may be starting (see
    // `Tools::stream_cut`); from there the reply is held and sent at the end, as calls (each
    // one delta with its id, name and arguments) or as text
    // with a thinking template, the reasoning goes out first as `reasoning_content` deltas,
    // the answer after it as above
    let info = Arc::new(info);
    let split = info.reasoning.as_ref().map(CountedSplit::new);
    let state = (gen, String::new(), false, false, info.echo.clone(), split);
    let reasoning_choice = move |text: String, logprobs: Value| json!({"index": index, "delta": {"reasoning_content": text}, "logprobs": logprobs, "finish_reason": null});
    let body = stream::unfold(Some(state), move |g| {
        let chunk = chunk.clone();
        let info = info.clone();
        let totals = totals.clone();
        async move {
            let (mut g, mut held, mut plain, mut calling, mut echo, mut split) = g?;
            let tools = info.tools.as_deref();
            // a chunk's top-level extras: timings so far (llama-server's
            // timings_per_token), the choice's usage so far (vLLM's continuous usage)
            let so_far = |g: &Gen| {
                let mut e = serde_json::Map::new();
                if info.timings_per_token {
                    e.insert("timings".into(), g.timings_so_far(info.prompt_tokens));
                }
                if info.continuous_usage {
                    e.insert("usage".into(), info.usage_at(g.generated()));
                }
                (!e.is_empty()).then_some(Value::Object(e))
            };
            // vLLM's return_token_ids: the chunk's own token ids (and, in a completion's
            // first, the prompt's)
            let tag = |mut v: Value, g: &mut Gen| {
                if let Some(ids) = &info.prompt_ids {
                    v["token_ids"] = json!(g.take_all_tokens());
                    if kind == Kind::Completion
                        && info.prompt_pending.swap(false, Ordering::Relaxed)
                    {
                        v["prompt_token_ids"] = json!(ids);
                    }
                }
                v
            };
            let mut out = Vec::new();
            let mut piece = match g.next_or_progress().await {
                Some(Next::Progress(p)) => {
                    // llama-server's: an empty choice (chat: the role) and how far the
                    // prompt has gone in, with the timings so far where asked
                    let mut extra = json!({"prompt_progress": progress_json(&p)});
                    if info.timings_per_token {
                        extra["timings"] = progress_timings(&p);
                    }
                    let choice = match kind {
                        Kind::Completion => {
                            json!({"text": "", "index": index, "logprobs": null, "finish_reason": null})
                        }
                        Kind::Chat => {
                            json!({"index": index, "delta": {"role": "assistant", "content": null}, "logprobs": null, "finish_reason": null})
                        }
                    };
                    out.push(chunk(choice, Some(extra)));
                    return Some(((out, false), Some((g, held, plain, calling, echo, split))));
                }
                Some(Next::Piece(p)) => Some(p),
                None => None,
            };
            if let (Some(Piece::Text(t)), Some(sp)) = (&mut piece, &mut split) {
                let (r, answer) = sp.push(t, g.generated());
                if !r.is_empty() {
                    let lp = g.take_logprobs(kind);
                    let c = tag(reasoning_choice(r, lp), &mut g);
                    out.push(chunk(c, so_far(&g)));
                }
                *t = answer;
            }
            match (piece, tools) {
                (Some(Piece::Text(t)), _) if t.is_empty() && split.is_some() => {
                    Some(((out, false), Some((g, held, plain, calling, echo, split))))
                }
                (Some(Piece::Text(t)), Some(tl)) => {
                    held.push_str(&t);
                    if !calling {
                        let (n, starts) = tl.stream_cut(&held, &mut plain);
                        calling = starts;
                        if n > 0 {
                            let text: String = held.drain(..n).collect();
                            let lp = g.take_logprobs(kind);
                            let c = tag(text_choice(text, lp), &mut g);
                            out.push(chunk(c, so_far(&g)));
                        }
                    }
                    Some(((out, false), Some((g, held, plain, calling, echo, split))))
                }
                (Some(Piece::Text(mut t)), None) => {
                    if let Some(e) = echo.take() {
                        t.insert_str(0, &e);
                    }
                    let lp = g.take_logprobs(kind);
                    let c = tag(text_choice(t, lp), &mut g);
                    out.push(chunk(c, so_far(&g)));
                    Some(((out, false), Some((g, held, plain, calling, echo, split))))
                }
                (Some(Piece::End(e)), _) => {
                    let mut rest = g.rest();
                    if let Some(sp) = &mut split {
                        // what the split held back, and the text the generator held back
                        // split too
                        let (r, answer) =
                            sp.end(&rest.take().unwrap_or_default(), e.completion_tokens);
                        if !r.is_empty() {
                            let c = tag(reasoning_choice(r, g.take_logprobs(kind)), &mut g);
                            out.push(chunk(c, so_far(&g)));
                        }
                        rest = (!answer.is_empty()).then_some(answer);
                    }
                    let mut finish = e.finish;
                    if let Some(tools) = tools {
                        held.push_str(&rest.unwrap_or_default());
                        let pending = g.has_pending_logprobs(kind);
                        let lp = g.take_logprobs(kind);
                        // what was held back, as it is; a call cut off by the limit is
                        // not text (only its logprobs go out)
                        let (content, calls) = if calling {
                            tools.reply(&held, e.finish)
                        } else {
                            (Some(tools.held_text(held, e.finish)), Vec::new())
                        };
                        if calls.is_empty() {
                            let text = content.unwrap_or_default();
                            if !text.is_empty() || pending {
                                let c = tag(text_choice(text, lp), &mut g);
                                out.push(chunk(c, so_far(&g)));
                            }
                        } else {
                            finish = finish_reason(e.finish, true);
                            let deltas: Vec<Value> = calls
                                .into_iter()
                                .enumerate()
                                .map(|(i, mut c)| {
                                    c["index"] = json!(i);
                                    c
                                })
                                .collect();
                            let c = tag(
                                json!({"index": index, "delta": {"content": content, "tool_calls": deltas}, "logprobs": lp, "finish_reason": null}),
                                &mut g,
                            );
                            out.push(chunk(c, so_far(&g)));
                        }
                    } else if rest.is_some() || echo.is_some() || g.has_pending_logprobs(kind) {
                        // held-back text (the echoed prompt when nothing came before), and
                        // the log-probabilities of tokens that added none
                        let mut text = echo.take().unwrap_or_default();
                        text.push_str(&rest.unwrap_or_default());
                        let lp = g.take_logprobs(kind);
                        let c = tag(text_choice(text, lp), &mut g);
                        out.push(chunk(c, so_far(&g)));
                    }
                    let fin = match kind {
                        Kind::Completion => {
                            json!({"text": "", "index": index, "logprobs": null, "finish_reason": finish})
                        }
                        Kind::Chat => {
                            json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})
                        }
                    };
                    // (the last chunk: the end-of-generation token's id, the final usage)
                    let fin = tag(fin, &mut g);
                    let mut extra = json!({"timings": timings(&e, info.prompt_tokens)});
                    if info.continuous_usage {
                        extra["usage"] = info.usage_at(e.completion_tokens);
                    }
                    out.push(chunk(fin, Some(extra)));
                    let mut t = totals.lock().unwrap_or_else(|e| e.into_inner());
                    t.completion += e.completion_tokens;
                    t.reasoning += split.as_ref().map_or(0, |sp| sp.tokens());
                    let (a, r) = predicted(&e);
                    t.predicted = (t.predicted.0 + a, t.predicted.1 + r);
                    if info.first_copy {
                        t.prompt += info.prompt_tokens;
                        t.cached += e.done.as_ref().map_or(0, |d| d.cached_tokens);
                    }
                    Some(((out, false), None))
                }
                (Some(Piece::Error(e)), _) => {
                    totals.lock().unwrap_or_else(|e| e.into_inner()).failed = true;
                    Some((
                        (vec![SseEvent::default().data(e.body().to_string())], true),
                        None,
                    ))
                }
                (None, _) => None,
            }
        }
    });
    stream::iter(first).chain(body)
}

pub(crate) fn sse<S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static>(
    s: S,
) -> Response {
    Sse::new(s).into_response()
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let b: CompletionBody = parse(&body)?;
        let common: Common = parse(&body)?;
        Unsupported::check(&body, common.n, Kind::Completion)?;
        let beam = beam::request(&body)?;
        let best_of = best_of_request(b.best_of.as_ref(), &common)?;
        let one = "prompt must be a string, a list of token ids, or a list of either";
        let special = b.parse_special.unwrap_or(false);
        // fill in the middle: each prompt the prefix, before `suffix`
        let suffix = match &b.suffix {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(ApiError::bad("suffix must be a string").param("suffix")),
        };
        if suffix.is_some() {
            if common.echo == Some(true) {
                return Err(ApiError::bad(
                    "echo cannot be used with suffix (the prompt is laid out for fill-in-the-middle)",
                )
                .param("echo"));
            }
            if st.tokenizer.fim()[..3].iter().any(Option::is_none) {
                return Err(ApiError::bad(format!(
                    "suffix needs a model with fill-in-the-middle tokens (a code model's: Qwen2.5-Coder, StarCoder 2, CodeLlama, ...); {}'s vocabulary has none",
                    st.model_name()
                ))
                .param("suffix"));
            }
        }
        // a text prompt's tokens (a fill-in-the-middle prefix takes no BOS: the layout
        // starts with it)
        let add_bos = b.add_special_tokens.unwrap_or(true);
        let encode = |s: String| {
            let st = &st;
            let fim = suffix.is_some();
            async move {
                if fim || !add_bos {
                    encode_text(st, s, false, special, "prompt").await
                } else {
                    encode(st, s, special).await
                }
            }
        };
        let ids = |v: &[Value]| token_ids(v, "prompt");
        let mut prompts = Vec::new();
        // per prompt: a BOS the tokenizer put before a text prompt (not echoed), and whether
        // it was text
        let mut bos_added = Vec::new();
        let mut texts = Vec::new();
        let bos = st.tokenizer.bos().filter(|_| st.tokenizer.add_bos());
        let added = |text: &str, ids: &[u32]| {
            bos.is_some_and(|b| {
                ids.first() == Some(&b)
                    && !(special
                        && text.starts_with(
                            st.tokenizer
                                .inner()
                                .id_to_token(b)
                                .unwrap_or_default()
                                .as_str(),
                        ))
            })
        };
        match b.prompt {
            Value::String(s) => {
                let p = encode(s.clone()).await?;
                bos_added.push(added(&s, &p));
                prompts.push(p);
                texts.push(true);
            }
            Value::Array(v) if !v.is_empty() && v.iter().all(Value::is_number) => {
                prompts.push(ids(&v)?);
                bos_added.push(false);
                texts.push(false);
            }
            // a batch: strings, or token-id lists (what evaluation harnesses send)
            Value::Array(v) if !v.is_empty() && v.len() <= MAX_PROMPTS => {
                for p in v {
                    match p {
                        Value::String(s) => {
                            let p = encode(s.clone()).await?;
                            bos_added.push(added(&s, &p));
                            prompts.push(p);
                            texts.push(true);
                        }
                        Value::Array(t) => {
                            prompts.push(ids(&t)?);
                            bos_added.push(false);
                            texts.push(false);
                        }
                        _ => return Err(ApiError::bad(one).param("prompt")),
                    }
                }
            }
            Value::Array(v) if v.len() > MAX_PROMPTS => {
                return Err(ApiError::bad(format!(
                    "{} prompts in one request; at most {MAX_PROMPTS}",
                    v.len()
                ))
                .param("prompt"))
            }
            _ => return Err(ApiError::bad(one).param("prompt")),
        }
        if let Some(suffix) = &suffix {
            let mut laid_out = Vec::with_capacity(prompts.len());
            for (p, text) in prompts.into_iter().zip(&texts) {
                // (a text prompt's BOS leads the layout; token ids are taken as given)
                let ids = fim_prompt(&st, p, suffix, *text && add_bos)
                    .await?
                    .expect("checked: the model has fill-in-the-middle tokens");
                laid_out.push(ids);
            }
            prompts = laid_out;
            bos_added.iter_mut().for_each(|b| *b = false);
        }
        let mut jobs = prompts
            .into_iter()
            .map(|p| job(&st, common.clone(), p, 16, Kind::Completion))
            .collect::<Result<Vec<_>, _>>()?;
        for (j, added) in jobs.iter_mut().zip(&bos_added) {
            // (a BOS the tokenizer added is not echoed, unless truncation cut it already)
            j.echo_from = usize::from(*added && j.prompt_cut == 0);
            j.best_of = best_of.unwrap_or(j.n).max(j.n);
            if let Some(penalty) = beam {
                beam::make(&common, j, penalty)?;
            }
        }
        respond(st.clone(), jobs, Kind::Completion).await
    }
    .await;
    finish(&st, r)
}

/// The request's messages as the chat template takes them: contents as text (a string or
/// text parts), `developer` as `system`, assistants' tool calls with their arguments parsed.
pub(crate) fn chat_messages(messages: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    let mut msgs = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::bad(format!("unknown role {:?}", m.role)).param("messages"));
        }
        // only an assistant's message may come without content (its tool calls), as in
        // OpenAI's API and llama-server
        if m.role != "assistant" && m.content.as_ref().is_none_or(Value::is_null) {
            return Err(ApiError::bad(format!(
                "messages[{i}]: a {} message needs content",
                m.role
            ))
            .param("messages"));
        }
        let bad_content = || {
            ApiError::bad("message content must be a string or a list of text parts")
                .param("messages")
        };
        let content = match &m.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for p in parts {
                    let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                    if kind != "text" {
                        return Err(ApiError::bad(format!(
                            "content parts of type {kind:?} are not supported"
                        ))
                        .param("messages"));
                    }
                    // parts joined by a newline, as llama-server and vLLM join them (and
                    // the Messages API's blocks here)
                    if !s.is_empty() {
                        s.push('\n');
                    }
                    s.push_str(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(bad_content)?,
                    );
                }
                s
            }
            Some(_) => return Err(bad_content()),
        };
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let mut msg = Message::new(role, &content);
        if let Some(calls) = m.tool_calls.as_ref().filter(|v| !v.is_null()) {
            msg.tool_calls = Some(template_tool_calls(calls)?);
        }
        msg.tool_call_id = m.tool_call_id.clone();
        if m.role == "assistant" {
            msg.reasoning_content = m.reasoning_content.clone().filter(|r| !r.is_empty());
        }
        msgs.push(msg);
    }
    Ok(msgs)
}

/// Messages in OpenAI's chat form (a JSON list of `{"role", "content", "tool_calls",
/// "tool_call_id"}`; contents as text or text parts) as the chat template takes them, checked
/// as `/v1/chat/completions` checks them: for callers outside HTTP (the Python package).
pub fn openai_messages(messages: &Value) -> Result<Vec<Message>, ApiError> {
    let list: Vec<ChatMessage> = serde_json::from_value(messages.clone()).map_err(|e| {
        ApiError::bad(format!(
            "messages must be a list of {{\"role\", \"content\"}} objects: {e}"
        ))
        .param("messages")
    })?;
    chat_turn_messages(&list)
}

/// A chat turn's messages ([`chat_messages`]), of which there must be at least one.
fn chat_turn_messages(messages: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty").param("messages"));
    }
    chat_messages(messages)
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let b: ChatBody = parse(&body)?;
        let common: Common = parse(&body)?;
        Unsupported::check(&body, common.n, Kind::Chat)?;
        let beam = beam::request(&body)?;
        let beam_fields = beam.map(|_| common.clone());
        let mut j = chat_job(&st, b, common).await?;
        if let (Some(penalty), Some(c)) = (beam, &beam_fields) {
            beam::make(c, &mut j, penalty)?;
        }
        respond(st.clone(), vec![j], Kind::Chat).await
    }
    .await;
    finish(&st, r)
}

/// `POST /v1/chat/completions/input_tokens` (llama-server's): the prompt tokens a chat
/// request would have, `{"object": "response.input_tokens", "input_tokens": N}`.
pub async fn chat_input_tokens(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let b: ChatBody = parse(&body)?;
        let (prompt, ..) = chat_prompt(&st, &b).await?;
        Ok(input_tokens(prompt.len()))
    }
    .await;
    finish(&st, r)
}

/// OpenAI's answer to counting input tokens.
pub(crate) fn input_tokens(n: usize) -> Response {
    Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response()
}

/// The job of a chat request: messages (and tools) rendered by the model's chat template
/// and tokenized, the shared fields checked, a call's grammar when `tool_choice` asks for
/// one. (`/v1/responses` builds its requests into the same form.)
pub(crate) async fn chat_job(
    st: &Arc<ServerState>,
    b: ChatBody,
    common: Common,
) -> Result<Job, ApiError> {
    let (prompt, tools, own) = chat_prompt(st, &b).await?;
    let reasoning = reasoning_of(st, own.as_deref(), b.reasoning_format.as_deref(), &prompt)?;
    let prediction = common.prediction.clone();
    let mut j = job(st, common, prompt, usize::MAX, Kind::Chat)?;
    j.prediction = prediction_tokens(st, prediction).await?;
    with_tools(&mut j, tools)?;
    with_reasoning(st, &mut j, reasoning);
    Ok(j)
}

/// OpenAI's `prediction` (predicted outputs): `{"type": "content", "content": ...}`, the
/// content a string or a list of text parts (joined), as tokens (special-token texts kept as
/// text, as in a message); `None` when absent, null or empty.
pub(crate) async fn prediction_tokens(
    st: &ServerState,
    v: Option<Value>,
) -> Result<Option<Arc<[u32]>>, ApiError> {
    let bad = |m: &str| {
        Err(ApiError::bad(format!(
            "prediction {m}: expected {{\"type\": \"content\", \"content\": a string or text parts}}"
        ))
        .param("prediction"))
    };
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return bad("is not an object"),
    };
    match o.get("type") {
        Some(Value::String(t)) if t == "content" => {}
        Some(t) => return bad(&format!("type {t}")),
        None => return bad("has no type"),
    }
    let text = match o.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => match text_parts(parts) {
            Some(text) => text,
            None => return bad("content: a part that is not {\"type\": \"text\", \"text\": ...}"),
        },
        _ => return bad("content is not a string or a list of text parts"),
    };
    if text.is_empty() {
        return Ok(None);
    }
    let ids = encode_text(st, text, false, false, "prediction").await?;
    Ok((!ids.is_empty()).then(|| ids.into()))
}

/// The texts of parts `[{"type": "text", "text": ...}, ...]` joined with nothing between
/// them, or `None` when a part is not a text part.
pub(crate) fn text_parts(parts: &[Value]) -> Option<String> {
    parts
        .iter()
        .map(
            |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                (Some("text"), Some(Value::String(t))) => Some(t.as_str()),
                _ => None,
            },
        )
        .collect::<Option<Vec<&str>>>()
        .map(|texts| texts.concat())
}

/// Gives a chat job its reasoning split; a reply that starts inside the thinking keeps the
/// grammars the server makes (a call's, `response_format`'s, `json_schema`'s) for after it
/// ([`Reasoning::after_thinking`]; free thinking first, as vLLM and llama-server). A raw
/// `grammar` or `regex` covers the whole reply, as the client wrote it.
///
/// Also the special tokens its reply keeps as text: the markers of its thinking and, when
/// its calls are parsed, of its tool-call syntax (a job's tools are given first).
pub(crate) fn with_reasoning(st: &ServerState, j: &mut Job, reasoning: Option<Reasoning>) {
    if let Some(r) = reasoning.as_ref().filter(|r| r.wraps_grammars()) {
        let ours = |f: &str| matches!(f, "tool_choice" | "response_format" | "json_schema");
        if let Some((g, field)) = j.grammar.take_if(|(_, f)| ours(f)) {
            j.grammar = Some((r.after_thinking(g, field == "tool_choice"), field));
        }
    }
    let mut markers = reasoning
        .as_ref()
        .map(Reasoning::markers)
        .unwrap_or_default();
    if let Some(t) = j.tools.as_deref().filter(|t| t.parses()) {
        markers.extend(t.syntax.markers());
    }
    j.keep = st.tokenizer.special_ids(markers).into();
    j.reasoning = reasoning;
}

/// How a chat reply's reasoning is told from its answer: `None` when the request's
/// `reasoning_format` (else the server's) is `none` or the model's template does not think.
pub(crate) fn reasoning_of(
    st: &ServerState,
    own: Option<&ChatTemplate>,
    format: Option<&str>,
    prompt: &[u32],
) -> Result<Option<Reasoning>, ApiError> {
    let split = crate::reasoning::Format::of_request(format, st.reasoning_format)?
        == crate::reasoning::Format::Split;
    let Some(template) = own.or(st.tokenizer.chat_template()) else {
        return Ok(None);
    };
    // the prompt's end: does it leave the thinking open?
    let r = Reasoning::of_template(template.source(), &st.tokenizer.prompt_tail(prompt));
    Ok(if split {
        r
    } else {
        r.and_then(Reasoning::unsplit)
    })
}

/// Gives a chat job its tools, and the grammar of a call when `tool_choice` asks for one.
pub(crate) fn with_tools(j: &mut Job, tools: Option<Arc<Tools>>) -> Result<(), ApiError> {
    if let Some(t) = &tools {
        if let Some(g) = t.call_grammar_beside(j.grammar.as_ref().map(|(_, other)| *other))? {
            j.grammar = Some((g, "tool_choice"));
        }
    }
    j.tools = tools;
    Ok(())
}

/// A chat request's prompt: its tokens, its tools, and its own template where it gave one
/// (`chat_template`; `None`: the server's).
pub(crate) type ChatPrompt = (Vec<u32>, Option<Arc<Tools>>, Option<Arc<ChatTemplate>>);

/// Request templates kept compiled (each with the text its request gave), the most recent last.
pub(crate) const TEMPLATES_KEPT: usize = 8;

/// vLLM's per-request `chat_template`, taken where the server was started with
/// `--trust-request-chat-template` (as vLLM takes it): a Jinja template, or one of llama.cpp's
/// built-in formats by name (`chatml`, `llama3`, ...), compiled on the blocking pool and held
/// to the bounds a model's template is held to, or found among the last
/// [`TEMPLATES_KEPT`] compiled. `None` without one.
pub(crate) async fn request_template(
    st: &Arc<ServerState>,
    b: &ChatBody,
) -> Result<Option<Arc<ChatTemplate>>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param("chat_template");
    let src = match &b.chat_template {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s,
        Some(_) => {
            return Err(bad(
                "chat_template must be a string: a Jinja template or a built-in format's name"
                    .into(),
            ))
        }
    };
    if !st.trust_request_template {
        return Err(bad(
            "a request's chat_template is not taken unless the server is started with --trust-request-chat-template (as vLLM's); without it every request is rendered with the server's template (--chat-template-file FILE or --chat-template NAME set it)".into(),
        ));
    }
    {
        let mut kept = st.templates.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = kept.iter().position(|(s, _)| s == src) {
            let hit = kept.remove(at);
            let t = hit.1.clone();
            kept.push(hit);
            return Ok(Some(t));
        }
    }
    let (tok, s) = (st.tokenizer.clone(), src.clone());
    // (resolved and checked as --chat-template is, on the blocking pool: the check renders it)
    let t = tokio::task::spawn_blocking(move || {
        let src = gds_runtime::plan::chat_template_source(&s)
            .map_err(|why| format!("chat_template: {why}"))?;
        tok.compile_template(src).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| ApiError::server(format!("compiling the chat template failed: {e}")))?
    .map_err(bad)?;
    let t = Arc::new(t);
    let mut kept = st.templates.lock().unwrap_or_else(|e| e.into_inner());
    if kept.len() == TEMPLATES_KEPT {
        kept.remove(0);
    }
    kept.push((src.clone(), t.clone()));
    Ok(Some(t))
}

/// A chat request's prompt: its messages (and tools) rendered by the model's chat template
/// and tokenized; and its tools, checked.
pub(crate) async fn chat_prompt(
    st: &Arc<ServerState>,
    b: &ChatBody,
) -> Result<ChatPrompt, ApiError> {
    let mut msgs = chat_turn_messages(&b.messages)?;
    let own = request_template(st, b).await?;
    let template = own.as_deref().or(st.tokenizer.chat_template());
    if let Some(t) = template {
        crate::tools::mistral_ids(t.source(), &mut msgs);
    }
    let continue_final = b.continue_final_message == Some(true);
    if continue_final && b.add_generation_prompt == Some(true) {
        return Err(ApiError::bad(
            "continue_final_message and add_generation_prompt exclude each other: the reply either continues the last message or starts a new turn",
        )
        .param("add_generation_prompt"));
    }
    let end = match (continue_final, b.add_generation_prompt) {
        (true, _) => ChatEnd::ContinueFinal,
        (false, Some(false)) => ChatEnd::Closed,
        (false, _) => ChatEnd::Reply,
    };
    if continue_final && msgs.last().is_none_or(|m| m.role != "assistant") {
        return Err(ApiError::bad(
            "continue_final_message needs an assistant message last (the reply's start)",
        )
        .param("messages"));
    }
    let tools = Tools::from_request(
        b.tools.as_ref(),
        b.tool_choice.as_ref(),
        b.parallel_tool_calls,
        template,
    )?
    .map(Arc::new);
    let (vars, thinking_off) = chat_vars(st, b)?;
    let (tok, ctx) = (st.tokenizer.clone(), st.ctx);
    let list = tools.as_ref().map(|t| t.list.clone());
    let drop_oldest = b.drop_oldest;
    let own2 = own.clone();
    let mut prompt = tokenize(
        move || {
            let t = own2.as_deref();
            if drop_oldest {
                tok.encode_chat_fitting(&msgs, list.as_ref(), vars.as_ref(), ctx, end, t)
                    .map(|(t, _)| t)
            } else {
                tok.encode_chat_full(&msgs, list.as_ref(), vars.as_ref(), ctx, end, t)
            }
        },
        "messages",
    )
    .await?;
    if thinking_off && end == ChatEnd::Reply {
        let tail = st.tokenizer.prompt_tail(&prompt);
        if let Some(tag) = unclosed_thinking(st, own.as_deref(), &tail) {
            let ids = st
                .tokenizer
                .encode(tag, false, true)
                .map_err(|e| ApiError::bad(e.to_string()).param("messages"))?;
            prompt.extend(ids);
        }
    }
    Ok((prompt, tools, own))
}

/// A chat request's template variables: its `chat_template_kwargs`, with `enable_thinking`
/// from `--reasoning` where they do not set it; and whether thinking is off.
pub(crate) fn chat_vars(
    st: &ServerState,
    b: &ChatBody,
) -> Result<(Option<serde_json::Map<String, Value>>, bool), ApiError> {
    let mut vars = b.template_vars()?;
    let v = vars.get_or_insert_with(Default::default);
    if let Some(effort) = &b.reasoning_effort {
        if !matches!(
            effort.as_str(),
            "none" | "minimal" | "low" | "medium" | "high" | "xhigh"
        ) {
            return Err(ApiError::bad(format!(
                "reasoning_effort {effort:?} is not one of none, minimal, low, medium, high, xhigh"
            ))
            .param("reasoning_effort"));
        }
        v.entry("reasoning_effort").or_insert(json!(effort));
        if effort == "none" {
            v.entry("enable_thinking").or_insert(json!(false));
        }
    }
    v.entry("enable_thinking").or_insert(json!(st.thinking));
    let off = vars.as_ref().and_then(|v| v.get("enable_thinking")) == Some(&json!(false));
    Ok((vars, off))
}

/// With thinking off: the tag that closes the thinking a prompt (`tail`: its end, special
/// tokens as text) leaves open — DeepSeek-R1's and QwQ's templates open it whatever
/// `enable_thinking` says; llama-server closes it.
pub(crate) fn unclosed_thinking(
    st: &ServerState,
    own: Option<&ChatTemplate>,
    tail: &str,
) -> Option<&'static str> {
    let t = own.or(st.tokenizer.chat_template())?;
    Reasoning::of_template(t.source(), tail)
        .filter(Reasoning::open)
        .map(|r| r.end_tag())
}

pub(crate) async fn encode(
    st: &ServerState,
    text: String,
    special: bool,
) -> Result<Vec<u32>, ApiError> {
    encode_text(st, text, true, special, "prompt").await
}

/// Tokenizes `text` on the blocking pool (BOS when `with_bos` and the model adds one,
/// special-token texts parsed when `special`), refused before tokenizing when it cannot fit
/// the context; errors name `param`.
pub(crate) async fn encode_text(
    st: &ServerState,
    text: String,
    with_bos: bool,
    special: bool,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let (tok, ctx) = (st.tokenizer.clone(), st.ctx);
    tokenize(
        move || {
            tok.check_fits(text.len(), ctx)?;
            tok.encode(&text, with_bos, special)
        },
        param,
    )
    .await
}

/// Runs a tokenization on the blocking pool (not on the few async threads that answer every
/// connection); errors name `param`.
pub(crate) async fn tokenize(
    f: impl FnOnce() -> gds_runtime::Result<Vec<u32>> + Send + 'static,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let r = tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::server(format!("tokenization failed: {e}")))?;
    r.map_err(|e| {
        let too_long = matches!(e, RuntimeError::TextTooLong { .. });
        let message = match e {
            RuntimeError::TextTooLong {
                bytes,
                limit,
                ctx,
                per_token,
            } => format!(
                "the {param} {} {bytes} bytes of text; this server's context of {ctx} tokens holds at most {limit} bytes ({per_token} per token), so {} not tokenized",
                if param == "messages" { "are" } else { "is" },
                if param == "messages" { "they were" } else { "it was" },
            ),
            RuntimeError::Template(e) => format!("chat template: {e}"),
            e => e.to_string(),
        };
        let e = ApiError::bad(message).param(param);
        if too_long {
            e.code("context_length_exceeded")
        } else {
            e
        }
    })
}

pub(crate) fn finish(st: &ServerState, r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            if e.status == StatusCode::BAD_REQUEST {
                st.metrics.rejected_bad.fetch_add(1, Ordering::Relaxed);
            }
            e.into_response()
        }
    }
}

/// `GET /v1/models`: OpenAI's list, or Anthropic's when the request carries
/// `anthropic-version` (what the `anthropic` client sends).
pub async fn models(State(st): State<Arc<ServerState>>, headers: HeaderMap) -> Response {
    if headers.contains_key("anthropic-version") {
        let m = anthropic_model(&st);
        return Json(json!({"data": [m], "has_more": false, "first_id": st.model_name(), "last_id": st.model_name()}))
            .into_response();
    }
    Json(json!({"object": "list", "data": [openai_model(&st)]})).into_response()
}

/// `GET /v1/models/{id}`: the served model's object (Anthropic's with `anthropic-version`),
/// or a 404 naming the id (in Anthropic's error shape with that header:
/// [`crate::anthropic::anthropic_errors`]).
pub async fn model(
    State(st): State<Arc<ServerState>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if !st.aliases.contains(&id) {
        // OpenAI's shape here; Anthropic's, with `anthropic-version`, by the middleware
        // that shapes the Messages API's errors
        let message = format!(
            "the model {id:?} does not exist; this server serves {:?}",
            st.model_name()
        );
        return ApiError::not_found(message)
            .param("model")
            .code("model_not_found")
            .into_response();
    }
    if headers.contains_key("anthropic-version") {
        Json(anthropic_model(&st)).into_response()
    } else {
        Json(openai_model(&st)).into_response()
    }
}

fn openai_model(st: &ServerState) -> Value {
    json!({"id": st.model_name(), "object": "model", "created": st.created, "owned_by": "gdsllm",
           "aliases": st.aliases, "tags": st.tags, "meta": {"n_ctx": st.ctx, "n_vocab": st.vocab}})
}

fn anthropic_model(st: &ServerState) -> Value {
    let created = chrono::DateTime::from_timestamp(st.created as i64, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    json!({"type": "model", "id": st.model_name(), "display_name": st.model_name(), "created_at": created, "max_input_tokens": st.ctx})
}

/// `GET /health`.
pub async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// `GET /metrics`.
pub async fn metrics(State(st): State<Arc<ServerState>>) -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4".to_string(),
            ),
            // llama-server's: when the server started (Unix seconds), so a scraper sees a
            // restart (its counters back at zero) for what it is
            (
                header::HeaderName::from_static("process-start-time-unix"),
                st.created.to_string(),
            ),
        ],
        st.metrics.render(),
    )
        .into_response()
}

/// Anything else: 404 in OpenAI's format.
pub async fn not_found() -> Response {
    ApiError::not_found("no such endpoint").into_response()
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_prompt_over_the_context_keeps_its_start_and_its_latest_tokens() {
        use super::truncate_prompt;
        let p: Vec<u32> = (0..300).collect();
        let t = truncate_prompt(p.clone(), 4, 128);
        // 4 kept, then the latest up to 128 - (128 - 4) / 2 = 66
        assert_eq!(t.len(), 66);
        assert_eq!(&t[..4], &[0, 1, 2, 3]);
        assert_eq!(&t[4..], &p[300 - 62..]);
        // a prompt that fits is left as it is; a kept start over the context is cut to it
        assert_eq!(truncate_prompt(p[..127].to_vec(), 4, 128), &p[..127]);
        let t = truncate_prompt(p.clone(), 1000, 128);
        assert_eq!(t.len(), 127);
        assert_eq!(t, &p[..127]);
    }

    use super::*;

    /// A field of the wrong type is named by its path (`param` and the message); bad JSON
    /// and trailing characters are still refused as such.
    #[test]
    fn a_field_of_the_wrong_type_is_named_by_its_path() {
        let e = |body: &str| parse::<ChatBody>(&Bytes::from(body.to_string())).unwrap_err();
        let err =
            e(r#"{"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}"#);
        assert_eq!(
            err.body()["error"]["param"],
            "parallel_tool_calls",
            "{err:?}"
        );
        assert!(err.text().contains("invalid type"), "{err:?}");
        let err = e(
            r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x", "tool_call_id": 5}]}"#,
        );
        assert_eq!(
            err.body()["error"]["param"],
            "messages[1].tool_call_id",
            "{err:?}"
        );
        for bad in [r#"{"messages": "#, r#"{"messages": []} x"#, "{"] {
            let err = e(bad);
            assert!(err.body()["error"]["param"].is_null(), "{bad}: {err:?}");
            assert!(
                err.text().starts_with("invalid JSON body"),
                "{bad}: {err:?}"
            );
        }
        assert!(parse::<ChatBody>(&Bytes::from_static(br#"{"messages": []}"#)).is_ok());
    }
}
