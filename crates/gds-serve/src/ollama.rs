//! Ollama's API (`/api/*`), for the clients written against Ollama (its `ollama` Python and
//! JavaScript libraries, Open WebUI, Continue, LangChain's `ChatOllama`, ...), served by the
//! same engine and chat path as the OpenAI endpoints.
//!
//! - `POST /api/chat` and `POST /api/generate`: rewritten into a chat job (the model's chat
//!   template, tokenizer guards, limits, tool parsing, grammars, reasoning split and
//!   scheduler of `/v1/chat/completions`) or, for `raw` prompts, a plain one. Streamed by
//!   default (`"stream": false` for one object), as newline-delimited JSON
//!   (`application/x-ndjson`); a failure after the start is an `{"error"}` line. `options`
//!   give the sampling (`temperature`, `top_k`, `top_p`, `min_p`, `num_predict`, `stop`,
//!   `seed`, `repeat_penalty`, `repeat_last_n`, `presence_penalty`, `frequency_penalty`);
//!   options that only size or place a model as Ollama loads it (`num_ctx`, `num_gpu`,
//!   `num_thread`, `use_mmap`, ...) are accepted and left to the server's own flags;
//!   `mirostat`, `mirostat_tau`, `mirostat_eta` and `typical_p` are llama.cpp's samplers;
//!   `tfs_z` (which llama.cpp dropped) is refused when switched on. `format`
//!   (`"json"` or a JSON schema) constrains the reply; `think` (`true`, `false`, `"low"`,
//!   `"medium"`, `"high"`) sets the template's thinking and the reply's reasoning comes apart
//!   as `thinking`; `logprobs`/`top_logprobs`; `tools`, with calls answered as
//!   `tool_calls` (arguments as objects) and results sent back as `tool` messages
//!   (`tool_name`); a final assistant message is continued; `/api/generate`'s `system`,
//!   `suffix` (fill in the middle, where the vocabulary has the tokens), `context` (the tokens
//!   an earlier answer returned), `raw`. An empty prompt (or no messages) answers at once
//!   with `done_reason` `load` (`unload` with `keep_alive` 0), as Ollama.
//! - `POST /api/embed` (normalized, `truncate`, `dimensions`) and `POST /api/embeddings`
//!   (the older form, not normalized).
//! - `GET /api/tags`, `GET /api/ps`, `POST /api/show`, `GET /api/version`, `GET|HEAD /`:
//!   the one served model, described as Ollama describes its models (family, parameter size,
//!   quantization, capabilities, `model_info`).
//! - `POST /api/pull` of the served model answers `success`; pulling others, pushing,
//!   creating, copying, deleting models answer 501 (this server serves one model; `gdsconv pull`
//!   fetches models from OCI registries).
//!
//! Any model name is taken (as the OpenAI endpoints take it) and echoed. Errors on `/api/`
//! are Ollama's `{"error": "..."}` ([`ollama_errors`]). gdsrun's extensions of the OpenAI
//! endpoints are taken here too: `grammar`, `regex`, `logit_bias`, `tool_choice`,
//! `parallel_tool_calls`, `chat_template_kwargs`, `reasoning_format`. Not done: images (400),
//! Ollama's Go `template` override (400: the model's own template is used).

use crate::api::{
    chat_job, encode_text, fim_prompt, finish, job, parse, run_to_end, start_gen, ApiError,
    ChatBody, ChatMessage, Common, End, Gen, Job, Kind, Piece, Stop,
};
use crate::error::bad;
use crate::reasoning::Split;
use crate::ServerState;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

/// The Ollama version `GET /api/version` reports: the newest whose request and answer fields
/// this module follows (clients gate features on it, such as thinking levels and logprobs).
pub(crate) const OLLAMA_VERSION: &str = "0.12.6";

/// The served model as Ollama's listings describe a model; made once at startup.
pub(crate) struct ModelCard {
    /// `general.architecture`.
    family: String,
    parameters: u64,
    /// The weights' main type (`Q4_K`, `F16`, ...): the one holding the most bytes.
    quantization: String,
    /// Bytes of weights.
    size: u64,
    /// BLAKE3 of the manifest (which holds every file's hash).
    digest: String,
    /// When the model was converted (the manifest's modification time).
    modified_at: String,
    /// `model_info`: the architecture's hyperparameters under GGUF's key names.
    info: Value,
}

/// `model_info` of `/api/show`: the hyperparameters of architecture `a` under GGUF's key
/// names, as Ollama lists a GGUF's (the experts of a mixture of experts, the window where
/// there is one).
fn model_info(a: &str, c: &gds_runtime::config::Config) -> Value {
    let mut info = json!({
        "general.architecture": a,
        format!("{a}.context_length"): c.context_length,
        format!("{a}.embedding_length"): c.n_embd,
        format!("{a}.block_count"): c.n_layers,
        format!("{a}.feed_forward_length"): c.n_ff,
        format!("{a}.attention.head_count"): c.n_heads,
        format!("{a}.attention.head_count_kv"): c.n_kv_heads,
        format!("{a}.attention.key_length"): c.head_dim,
        format!("{a}.attention.value_length"): c.head_dim,
        format!("{a}.attention.layer_norm_rms_epsilon"): c.rms_norm_eps,
        format!("{a}.rope.dimension_count"): c.rope_dims,
        format!("{a}.rope.freq_base"): c.rope_theta,
        format!("{a}.vocab_size"): c.vocab_size,
    });
    if let Some(m) = &c.moe {
        info[format!("{a}.expert_count")] = json!(m.n_expert);
        info[format!("{a}.expert_used_count")] = json!(m.n_expert_used);
        info[format!("{a}.expert_feed_forward_length")] = json!(m.n_ff_exp);
    }
    if let Some(w) = c.sliding_window {
        info[format!("{a}.attention.sliding_window")] = json!(w);
    }
    info
}

impl ModelCard {
    pub(crate) fn of(plan: &gds_runtime::Plan) -> ModelCard {
        let manifest = plan.model_dir.join("manifest.gdsm");
        let digest = std::fs::read(&manifest)
            .map(|b| blake3::hash(&b).to_hex().to_string())
            .unwrap_or_default();
        let modified_at = std::fs::metadata(&manifest)
            .and_then(|m| m.modified())
            .map(|t| rfc3339(chrono::DateTime::<chrono::Utc>::from(t)))
            .unwrap_or_else(|_| rfc3339(std::time::SystemTime::now().into()));
        let w = &plan.weight_dtypes;
        let parameters = w.values().map(|d| d.elements).sum();
        let quantization = w
            .iter()
            .max_by_key(|(_, d)| d.bytes)
            .map(|(name, _)| name.to_ascii_uppercase())
            .unwrap_or_default();
        let a = &plan.arch;
        let mut info = model_info(a, &plan.model);
        info["general.parameter_count"] = json!(parameters);
        info["general.basename"] = json!(plan.model_name);
        ModelCard {
            family: a.clone(),
            parameters,
            quantization,
            size: w.values().map(|d| d.bytes).sum(),
            digest,
            modified_at,
            info,
        }
    }

    fn details(&self) -> Value {
        json!({
            "parent_model": "",
            "format": "gdsllm",
            "family": self.family,
            "families": [self.family],
            "parameter_size": parameter_size(self.parameters),
            "quantization_level": self.quantization,
        })
    }
}

/// A parameter count as Ollama writes it: `134.52M`, `7.2B`.
fn parameter_size(n: u64) -> String {
    let n = n as f64;
    if n >= 1e12 {
        format!("{:.1}T", n / 1e12)
    } else if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.2}K", n / 1e3)
    } else {
        format!("{n}")
    }
}

fn rfc3339(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

fn now() -> String {
    rfc3339(std::time::SystemTime::now().into())
}

/// The served model's name as Ollama lists names: with a tag (`:latest` when it has none).
fn tagged(name: &str) -> String {
    if name.rsplit('/').next().is_some_and(|n| n.contains(':')) {
        name.to_string()
    } else {
        format!("{name}:latest")
    }
}

/// A request body as a JSON object.
fn object(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    match parse::<Value>(body)? {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad("the request must be a JSON object")),
    }
}

fn given<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

fn string(o: &Map<String, Value>, k: &'static str) -> Result<Option<String>, ApiError> {
    match given(o, k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("{k} must be a string"), k)),
    }
}

fn boolean(o: &Map<String, Value>, k: &'static str) -> Result<Option<bool>, ApiError> {
    match given(o, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(format!("{k} must be true or false"), k)),
    }
}

/// `model`, required (any name is taken: this server serves one model).
fn model(o: &Map<String, Value>) -> Result<String, ApiError> {
    string(o, "model")?
        .or(string(o, "name")?)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("model is required", "model"))
}

/// `keep_alive` 0 (a number or a duration such as `"0s"`): the model is to be unloaded.
fn unloads(o: &Map<String, Value>) -> bool {
    match given(o, "keep_alive") {
        Some(Value::Number(n)) => n.as_f64() == Some(0.0),
        Some(Value::String(s)) => s
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse::<f64>()
            .is_ok_and(|x| x == 0.0),
        _ => false,
    }
}

/// Refuses `images` (this server's models take text only).
fn no_images(o: &Map<String, Value>) -> Result<(), ApiError> {
    match given(o, "images") {
        Some(Value::Array(a)) if !a.is_empty() => Err(bad(
            "images are not supported: this server's model takes text only",
            "images",
        )),
        _ => Ok(()),
    }
}

/// The sampling and output fields: `options`, `format`, `logprobs`, `top_logprobs`; and
/// `repeat_last_n` (set on the job after it is made: -1 is the context).
fn common(o: &Map<String, Value>, model: String) -> Result<(Common, Option<i64>), ApiError> {
    let empty = Map::new();
    let opts = match given(o, "options") {
        None => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("options must be an object", "options")),
    };
    let num = |k: &str| -> Result<Option<f64>, ApiError> {
        match opts.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(bad(format!("option {k:?} must be a number"), "options")),
        }
    };
    // Ollama takes a float where an integer goes, and truncates it
    let int = |k: &str| -> Result<Option<i64>, ApiError> {
        match opts.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_i64().or_else(|| n.as_f64().map(|x| x as i64))),
            Some(_) => Err(bad(format!("option {k:?} must be an integer"), "options")),
        }
    };
    // tail-free sampling: llama.cpp dropped it, so refused when switched on (1.0 is off)
    if num("tfs_z")?.is_some_and(|p| p != 1.0) {
        return Err(bad(
            "option \"tfs_z\" is not supported: llama.cpp removed tail-free sampling (leave it at 1.0; min_p or typical_p do a similar job)",
            "options",
        ));
    }
    let stop = opts
        .get("stop")
        .filter(|v| !v.is_null())
        .map(|v| serde_json::from_value::<Stop>(v.clone()))
        .transpose()
        .map_err(|_| bad("option \"stop\" must be an array of strings", "options"))?;
    let response_format = match given(o, "format") {
        None => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) if s == "json" => Some(json!({"type": "json_object"})),
        Some(s @ Value::Object(_)) => {
            Some(json!({"type": "json_schema", "json_schema": {"name": "format", "schema": s}}))
        }
        Some(f) => {
            return Err(bad(
                format!("invalid format {f}: expected \"json\" or a JSON schema"),
                "format",
            ))
        }
    };
    let top_logprobs = match given(o, "top_logprobs") {
        None => None,
        Some(Value::Number(n)) if n.is_i64() => n.as_i64(),
        Some(_) => return Err(bad("top_logprobs must be an integer", "top_logprobs")),
    };
    // top_logprobs alone asks for the log-probabilities too; with logprobs false it is moot
    let logprobs = match (boolean(o, "logprobs")?, top_logprobs) {
        (None, Some(_)) => Some(true),
        (l, _) => l,
    };
    let c = Common {
        model: Some(model),
        // -1 (Ollama's default: no limit), -2 (up to the context) and 0 (no limit in Ollama's
        // runner): up to the context
        max_tokens: int("num_predict")?.filter(|&n| n > 0),
        temperature: num("temperature")?,
        top_p: num("top_p")?,
        top_k: int("top_k")?,
        min_p: num("min_p")?,
        repeat_penalty: num("repeat_penalty")?,
        frequency_penalty: num("frequency_penalty")?,
        presence_penalty: num("presence_penalty")?,
        stop,
        seed: int("seed")?,
        logprobs: logprobs.map(Value::Bool),
        top_logprobs: top_logprobs.filter(|_| logprobs == Some(true)),
        response_format,
        // gdsrun's extensions, as on the OpenAI endpoints
        grammar: string(o, "grammar")?,
        regex: string(o, "regex")?,
        logit_bias: given(o, "logit_bias").cloned(),
        // Ollama's context shift: on unless the request says `"shift": false`, keeping
        // `num_keep` tokens (Ollama's default 4); a prompt over the context is cut the same
        // way unless `"truncate": false`
        shift: Some(boolean(o, "shift")?.unwrap_or(true)),
        n_keep: Some(int("num_keep")?.unwrap_or(4)),
        truncate: boolean(o, "truncate")?.unwrap_or(true),
        // the samplers Ollama's options share with llama.cpp
        llama: crate::api::LlamaSampling {
            mirostat: int("mirostat")?.map(|m| json!(m)),
            mirostat_tau: num("mirostat_tau")?.map(|v| json!(v)),
            mirostat_eta: num("mirostat_eta")?.map(|v| json!(v)),
            typical_p: num("typical_p")?.map(|v| json!(v)),
            ..Default::default()
        },
        ..Default::default()
    };
    Ok((c, int("repeat_last_n")?))
}

/// `think`: `true`/`false`, or a level (`low`, `medium`, `high`: gpt-oss's reasoning effort).
fn think(o: &Map<String, Value>) -> Result<Option<(bool, Option<String>)>, ApiError> {
    match given(o, "think") {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some((*b, None))),
        Some(Value::String(s)) if matches!(s.as_str(), "low" | "medium" | "high") => {
            Ok(Some((true, Some(s.clone()))))
        }
        Some(v) => Err(bad(
            format!("think {v} must be true, false, \"low\", \"medium\" or \"high\""),
            "think",
        )),
    }
}

/// Ollama's messages as chat messages: an assistant's `tool_calls` (arguments as objects)
/// given ids where they have none, a `tool` message answering the call it names (by
/// `tool_call_id`, else the first unanswered call of its `tool_name`, else the first
/// unanswered one), `thinking` as the earlier reasoning.
fn chat_messages(list: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::with_capacity(list.len());
    let mut unanswered: Vec<(String, String)> = Vec::new();
    let mut n_calls = 0usize;
    for m in list {
        let m = m
            .as_object()
            .ok_or_else(|| bad("each message must be an object", "messages"))?;
        let field = |k: &'static str| {
            string(m, k).map_err(|_| bad(format!("a message's {k} must be a string"), "messages"))
        };
        let role = field("role")?.ok_or_else(|| bad("a message needs a role", "messages"))?;
        if !matches!(role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(bad(
                format!("role {role:?} must be system, user, assistant or tool"),
                "messages",
            ));
        }
        no_images(m).map_err(|e| e.param("messages"))?;
        let mut msg = ChatMessage::text(&role, field("content")?.unwrap_or_default());
        if role == "assistant" {
            msg.reasoning_content = field("thinking")?.filter(|t| !t.is_empty());
            if let Some(calls) = given(m, "tool_calls") {
                let shape = || {
                    bad(
                        "tool_calls must be a list of {\"function\": {\"name\", \"arguments\"}}",
                        "messages",
                    )
                };
                let mut chat = Vec::new();
                for c in calls.as_array().ok_or_else(shape)? {
                    let f = c.get("function").ok_or_else(shape)?;
                    let name = f.get("name").and_then(Value::as_str).ok_or_else(shape)?;
                    let id = match c.get("id").and_then(Value::as_str) {
                        Some(id) if !id.is_empty() => id.to_string(),
                        _ => format!("call_{n_calls}"),
                    };
                    n_calls += 1;
                    unanswered.push((id.clone(), name.to_string()));
                    let args = f.get("arguments").cloned().unwrap_or_else(|| json!({}));
                    chat.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}));
                }
                if !chat.is_empty() {
                    msg.tool_calls = Some(Value::Array(chat));
                }
            }
        }
        if role == "tool" {
            let by_id = field("tool_call_id")?;
            let name = field("tool_name")?;
            let at = by_id
                .as_ref()
                .and_then(|id| unanswered.iter().position(|(i, _)| i == id))
                .or_else(|| {
                    let n = name.as_ref()?;
                    unanswered.iter().position(|(_, f)| f == n)
                })
                .or((!unanswered.is_empty()).then_some(0));
            let id = match at {
                Some(i) => unanswered.remove(i).0,
                None => by_id.or(name).unwrap_or_default(),
            };
            msg.tool_call_id = Some(id);
        }
        out.push(msg);
    }
    Ok(out)
}

/// Which of Ollama's two generation endpoints a request came by.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Generate,
    Chat,
}

/// A request made into a job, and what its answer echoes.
struct Turn {
    job: Job,
    endpoint: Endpoint,
    model: String,
    /// `/api/generate` with the template: the prompt's tokens, returned as `context` with
    /// the reply's.
    context: Option<Vec<u32>>,
    started: Instant,
}

impl Endpoint {
    /// An answer object of `model`: `content` (and `thinking`, `tool_calls`) in the
    /// endpoint's form, not done.
    fn object(
        self,
        model: &str,
        content: &str,
        thinking: Option<&str>,
        calls: Option<Value>,
    ) -> Value {
        let mut v = json!({"model": model, "created_at": now()});
        match self {
            Endpoint::Generate => {
                v["response"] = json!(content);
                if let Some(t) = thinking {
                    v["thinking"] = json!(t);
                }
            }
            Endpoint::Chat => {
                let mut m = json!({"role": "assistant", "content": content});
                if let Some(t) = thinking {
                    m["thinking"] = json!(t);
                }
                if let Some(c) = calls {
                    m["tool_calls"] = c;
                }
                v["message"] = m;
            }
        }
        v["done"] = json!(false);
        v
    }
}

/// The answer to a request with nothing to generate (an empty prompt, no messages): the
/// model is loaded (or, with `keep_alive` 0, would be unloaded), as Ollama answers.
fn load_answer(endpoint: Endpoint, model: &str, unload: bool) -> Response {
    let mut v = endpoint.object(model, "", None, None);
    v["done"] = json!(true);
    v["done_reason"] = json!(if unload { "unload" } else { "load" });
    Json(v).into_response()
}

/// Whether the model's chat template thinks (has thinking tags or harmony's channels).
fn thinks(st: &ServerState) -> bool {
    st.tokenizer
        .chat_template()
        .is_some_and(|t| gds_runtime::reasoning::Reasoning::of_template(t.source(), "").is_some())
}

/// A chat job from chat messages, as `/v1/chat/completions` makes one ([`chat_job`]), with
/// `think` as the template's `enable_thinking` and reasoning effort.
async fn chat_turn(
    st: &Arc<ServerState>,
    o: &Map<String, Value>,
    messages: Vec<ChatMessage>,
    tools: Option<Value>,
    prefill: bool,
    common: Common,
) -> Result<Job, ApiError> {
    let thinking = think(o)?;
    if thinking.as_ref().is_some_and(|(on, _)| *on) && !thinks(st) {
        return Err(bad(
            format!(
                "{:?} does not support thinking (its chat template has no thinking)",
                common.model.as_deref().unwrap_or_default()
            ),
            "think",
        ));
    }
    // `chat_template_kwargs` (an extension), with `think`'s `enable_thinking`
    let mut vars = given(o, "chat_template_kwargs").cloned();
    if let Some((on, _)) = &thinking {
        match vars.get_or_insert_with(|| json!({})) {
            Value::Object(m) => {
                m.insert("enable_thinking".into(), json!(on));
            }
            _ => {
                return Err(bad(
                    "chat_template_kwargs must be an object",
                    "chat_template_kwargs",
                ))
            }
        }
    }
    let chat = ChatBody {
        messages,
        tools,
        // extensions: calls forced (`required`, a named function) as on the OpenAI endpoints
        tool_choice: given(o, "tool_choice").cloned(),
        parallel_tool_calls: boolean(o, "parallel_tool_calls")?,
        continue_final_message: Some(prefill),
        add_generation_prompt: None,
        documents: None,
        chat_template: None,
        chat_template_kwargs: vars,
        reasoning_format: string(o, "reasoning_format")?,
        reasoning_effort: thinking.and_then(|(_, level)| level),
        // Ollama's `truncate` (default true): the oldest messages go where the
        // conversation is over the context
        drop_oldest: common.truncate,
    };
    chat_job(st, chat, common).await
}

/// Sets `repeat_last_n` (-1: the context, 0: off).
fn repeat_last_n(st: &ServerState, j: &mut Job, n: Option<i64>) -> Result<(), ApiError> {
    if let Some(n) = n {
        j.sampler.repeat_last_n = crate::api::repeat_window(st, n).ok_or_else(|| {
            bad(
                format!("option \"repeat_last_n\" {n} must be -1 (the context) or more"),
                "options",
            )
        })?;
    }
    Ok(())
}

/// `POST /api/chat`.
pub async fn chat(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let started = Instant::now();
    let r = async {
        let o = object(&body)?;
        let model = model(&o)?;
        let stream = boolean(&o, "stream")?.unwrap_or(true);
        let list = match given(&o, "messages") {
            None => Vec::new(),
            Some(Value::Array(l)) => l.clone(),
            Some(_) => return Err(bad("messages must be a list", "messages")),
        };
        if list.is_empty() {
            return Ok(load_answer(Endpoint::Chat, &model, unloads(&o)));
        }
        let messages = chat_messages(&list)?;
        // a final assistant message is the reply's start, continued (as Ollama)
        let prefill = messages.last().is_some_and(|m| {
            m.role == "assistant"
                && m.tool_calls.is_none()
                && m.content
                    .as_ref()
                    .and_then(Value::as_str)
                    .is_some_and(|c| !c.is_empty())
        });
        let (common, last_n) = common(&o, model.clone())?;
        let tools = given(&o, "tools").cloned();
        let mut j = chat_turn(&st, &o, messages, tools, prefill, common).await?;
        repeat_last_n(&st, &mut j, last_n)?;
        answer(
            &st,
            Turn {
                job: j,
                endpoint: Endpoint::Chat,
                model,
                context: None,
                started,
            },
            stream,
        )
        .await
    }
    .await;
    finish(&st, r)
}

/// `POST /api/generate`.
pub async fn generate(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let started = Instant::now();
    let r = async {
        let o = object(&body)?;
        let model = model(&o)?;
        let stream = boolean(&o, "stream")?.unwrap_or(true);
        no_images(&o)?;
        if string(&o, "template")?.is_some_and(|t| !t.is_empty()) {
            return Err(bad(
                "template (an Ollama Go template) is not supported: the model's own chat template is used; send raw: true with a prompt formatted as you want it",
                "template",
            ));
        }
        let prompt = string(&o, "prompt")?.unwrap_or_default();
        let suffix = string(&o, "suffix")?.unwrap_or_default();
        let raw = boolean(&o, "raw")?.unwrap_or(false);
        let context = match given(&o, "context") {
            None => Vec::new(),
            Some(Value::Array(l)) => crate::api::token_ids(l, "context")?,
            Some(_) => return Err(bad("context must be a list of token ids", "context")),
        };
        if prompt.is_empty() && suffix.is_empty() && context.is_empty() {
            return Ok(load_answer(Endpoint::Generate, &model, unloads(&o)));
        }
        let (common, last_n) = common(&o, model.clone())?;
        let truncate = common.truncate;
        let (mut j, returned) = if !suffix.is_empty() {
            (fill_in(&st, &o, &prompt, &suffix, &context, common).await?, None)
        } else if raw {
            let mut ids = context.clone();
            ids.extend(encode_text(&st, prompt, context.is_empty(), true, "prompt").await?);
            (job(&st, common, ids, usize::MAX, Kind::Chat)?, None)
        } else {
            let mut messages = Vec::new();
            if let Some(s) = string(&o, "system")?.filter(|s| !s.is_empty()) {
                messages.push(ChatMessage::text("system", s));
            }
            messages.push(ChatMessage::text("user", prompt));
            let mut j = chat_turn(&st, &o, messages, None, false, common).await?;
            if !context.is_empty() {
                // the earlier conversation's tokens, then this turn (its BOS once)
                let bos = st.tokenizer.bos();
                let turn = match j.prompt.split_first() {
                    Some((first, rest)) if Some(*first) == bos => rest,
                    _ => &j.prompt[..],
                };
                let mut ids = context.clone();
                ids.extend_from_slice(turn);
                crate::api::in_vocabulary(&st, &ids, "context")?;
                if let (Some(sh), true) = (j.shift, truncate) {
                    ids = crate::api::truncate_prompt(ids, sh.keep, st.ctx);
                }
                if ids.len() >= st.ctx {
                    return Err(bad(
                        format!(
                            "the context and prompt are {} tokens, which exceeds this server's context of {}",
                            ids.len(),
                            st.ctx
                        ),
                        "context",
                    ));
                }
                if j.shift.is_none() {
                    j.max_tokens = j.max_tokens.min(st.ctx - ids.len());
                }
                j.prompt = ids;
            }
            let p = j.prompt.clone();
            (j, Some(p))
        };
        repeat_last_n(&st, &mut j, last_n)?;
        answer(
            &st,
            Turn {
                job: j,
                endpoint: Endpoint::Generate,
                model,
                context: returned,
                started,
            },
            stream,
        )
        .await
    }
    .await;
    finish(&st, r)
}

/// `suffix`: the prompt laid out for fill-in-the-middle (prefix, suffix, middle tokens), as
/// Ollama's code-model templates lay it out; a model without the tokens is refused.
async fn fill_in(
    st: &Arc<ServerState>,
    o: &Map<String, Value>,
    prompt: &str,
    suffix: &str,
    context: &[u32],
    common: Common,
) -> Result<Job, ApiError> {
    let prefix = encode_text(st, prompt.to_string(), false, false, "prompt").await?;
    let Some(laid_out) = fim_prompt(st, prefix, suffix, context.is_empty()).await? else {
        return Err(bad(
            format!(
                "{:?} does not support insert: its vocabulary has no fill-in-the-middle tokens",
                string(o, "model")?.unwrap_or_default()
            ),
            "suffix",
        ));
    };
    let mut ids = context.to_vec();
    ids.extend(laid_out);
    job(st, common, ids, usize::MAX, Kind::Chat)
}

/// An Ollama tool call from a chat one (`arguments` a JSON string there, an object here).
fn tool_call(index: usize, call: &Value) -> Value {
    let args = call
        .pointer("/function/arguments")
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .unwrap_or_else(|| json!({}));
    json!({
        "id": call.get("id"),
        "function": {"index": index, "name": call.pointer("/function/name"), "arguments": args},
    })
}

/// Ollama's `logprobs` of the tokens not handed out yet: each token's text, log-probability,
/// bytes and top alternatives, the entries of OpenAI chat's `logprobs.content`.
fn logprobs(gen: &mut Gen) -> Value {
    gen.take_logprobs(Kind::Chat)["content"].take()
}

impl Turn {
    /// An answer object: `content` (and `thinking`, `tool_calls`) in the endpoint's form.
    fn object(&self, content: &str, thinking: Option<&str>, calls: Option<Value>) -> Value {
        self.endpoint.object(&self.model, content, thinking, calls)
    }

    /// The last object's fields: why it ended, the counts and durations (nanoseconds), and
    /// `/api/generate`'s `context`.
    fn close(&self, v: &mut Value, end: &End, generated: &[u32]) {
        let ns = |ms: f64| (ms * 1e6) as u64;
        let d = end.done.as_ref();
        v["done"] = json!(true);
        v["done_reason"] = json!(end.finish);
        v["total_duration"] = json!(self.started.elapsed().as_nanos() as u64);
        v["load_duration"] = json!(0);
        v["prompt_eval_count"] = json!(self.job.prompt.len());
        v["prompt_eval_duration"] = json!(d.map_or(0, |d| ns(d.prompt_ms)));
        v["eval_count"] = json!(end.completion_tokens);
        v["eval_duration"] = json!(d.map_or(0, |d| ns(d.decode_ms)));
        if let Some(p) = &self.context {
            let mut c = p.clone();
            c.extend_from_slice(generated);
            v["context"] = json!(c);
        }
    }
}

/// Runs the turn: one object, or the stream of them.
async fn answer(st: &Arc<ServerState>, t: Turn, stream: bool) -> Result<Response, ApiError> {
    if stream {
        let gen = start_gen(st, &t.job).await?;
        return Ok(ndjson(t, gen));
    }
    let (mut gen, thinking, text, end) = run_to_end(st, &t.job).await?;
    let (message, _) = crate::tools::assistant_message(t.job.tools.as_deref(), &text, end.finish);
    let calls = message["tool_calls"].as_array().map(|c| {
        c.iter()
            .enumerate()
            .map(|(i, c)| tool_call(i, c))
            .collect::<Value>()
    });
    let content = message["content"].as_str().unwrap_or_default();
    let mut v = t.object(content, thinking.as_deref(), calls);
    if t.job.logprobs.is_some() {
        v["logprobs"] = logprobs(&mut gen);
    }
    t.close(&mut v, &end, &gen.take_tokens());
    Ok(Json(v).into_response())
}

/// A streamed turn's state: text held back while a tool call may be starting (sent at the
/// end as calls or as text), the reasoning split, every generated token (for `context`).
struct Streaming {
    gen: Gen,
    held: String,
    plain: bool,
    calling: bool,
    split: Option<Split>,
    tokens: Vec<u32>,
    ended: bool,
}

/// The turn's objects as newline-delimited JSON, as they come; a failure is an `{"error"}`
/// line, which ends it. Dropping the body (the client gone) cancels the job.
fn ndjson(t: Turn, gen: Gen) -> Response {
    let t = Arc::new(t);
    let s = Streaming {
        gen,
        held: String::new(),
        plain: false,
        calling: false,
        split: t.job.reasoning.as_ref().map(Split::new),
        tokens: Vec::new(),
        ended: false,
    };
    let lines = stream::unfold(s, move |mut s| {
        let t = t.clone();
        async move {
            if s.ended {
                return None;
            }
            let out = step(&t, &mut s).await;
            Some((stream::iter(out), s))
        }
    })
    .flatten()
    .map(|v: Value| Ok::<_, Infallible>(Bytes::from(format!("{v}\n"))));
    let mut r = Body::from_stream(lines).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

/// The objects of the generator's next piece.
async fn step(t: &Turn, s: &mut Streaming) -> Vec<Value> {
    let tools = t.job.tools.as_deref().filter(|tl| tl.parses());
    let want_lp = t.job.logprobs.is_some();
    let mut out = Vec::new();
    let with_lp = |mut v: Value, s: &mut Streaming| {
        if want_lp {
            v["logprobs"] = logprobs(&mut s.gen);
        }
        v
    };
    match s.gen.next().await {
        Some(Piece::Text(text)) => {
            s.tokens.extend(s.gen.take_tokens());
            let (r, answer) = match &mut s.split {
                Some(sp) => sp.push(&text),
                None => (String::new(), text),
            };
            if !r.is_empty() {
                out.push(with_lp(t.object("", Some(&r), None), s));
            }
            match tools {
                Some(tl) if !answer.is_empty() => {
                    s.held.push_str(&answer);
                    if !s.calling {
                        let (n, starts) = tl.stream_cut(&s.held, &mut s.plain);
                        s.calling = starts;
                        if n > 0 {
                            let shown: String = s.held.drain(..n).collect();
                            out.push(with_lp(t.object(&shown, None, None), s));
                        }
                    }
                }
                None if !answer.is_empty() => out.push(with_lp(t.object(&answer, None, None), s)),
                _ => {}
            }
        }
        Some(Piece::End(end)) => {
            s.ended = true;
            s.tokens.extend(s.gen.take_tokens());
            let mut rest = s.gen.rest().unwrap_or_default();
            if let Some(sp) = &mut s.split {
                let (r, answer) = sp.end(&rest);
                if !r.is_empty() {
                    out.push(with_lp(t.object("", Some(&r), None), s));
                }
                rest = answer;
            }
            if let Some(tl) = tools {
                s.held.push_str(&rest);
                let held = std::mem::take(&mut s.held);
                // what was held back, as it is; a call cut off by the limit is dropped
                let (content, calls) = if s.calling {
                    tl.reply(&held, end.finish)
                } else {
                    (Some(tl.held_text(held, end.finish)), Vec::new())
                };
                let content = content.unwrap_or_default();
                if calls.is_empty() {
                    if !content.is_empty() {
                        out.push(with_lp(t.object(&content, None, None), s));
                    }
                } else {
                    let calls = calls
                        .iter()
                        .enumerate()
                        .map(|(i, c)| tool_call(i, c))
                        .collect();
                    out.push(with_lp(t.object(&content, None, Some(calls)), s));
                }
            } else if !rest.is_empty() {
                out.push(with_lp(t.object(&rest, None, None), s));
            }
            let mut last = with_lp(t.object("", None, None), s);
            if want_lp && last["logprobs"].as_array().is_some_and(Vec::is_empty) {
                last.as_object_mut().map(|o| o.remove("logprobs"));
            }
            t.close(&mut last, &end, &s.tokens);
            out.push(last);
        }
        Some(Piece::Error(e)) => {
            s.ended = true;
            out.push(json!({"error": e.body()["error"]["message"]}));
        }
        None => s.ended = true,
    }
    out
}

/// `POST /api/embed`: `input` (a string or a list) embedded, normalized (Euclidean), the
/// first `dimensions` kept; an input past the context is cut to it unless `truncate` is false.
pub async fn embed(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let o = object(&body)?;
        let model = model(&o)?;
        let started = Instant::now();
        let texts: Vec<String> = match given(&o, "input") {
            None => Vec::new(),
            Some(Value::String(s)) if s.is_empty() => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(l)) => l
                .iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("input must be a string or a list of strings", "input"))?,
            Some(_) => return Err(bad("input must be a string or a list of strings", "input")),
        };
        if texts.len() > crate::embeddings::MAX_INPUTS {
            return Err(bad(
                format!("{} inputs; at most {}", texts.len(), crate::embeddings::MAX_INPUTS),
                "input",
            ));
        }
        let truncate = boolean(&o, "truncate")?.unwrap_or(true);
        let keep = crate::embeddings::dimensions(&st, o.get("dimensions"))?;
        let mut prompts = Vec::with_capacity(texts.len());
        for s in texts {
            if s.is_empty() {
                return Err(bad("an input is an empty string", "input"));
            }
            let mut ids = if truncate {
                // past the context it is cut, so the text is not refused for its length
                let (tok, ctx) = (st.tokenizer.clone(), st.ctx);
                let cut = s[..crate::native::floor_char(&s, ctx.saturating_mul(64))].to_string();
                crate::api::tokenize(move || tok.encode(&cut, true, false), "input").await?
            } else {
                encode_text(&st, s, true, false, "input").await?
            };
            if ids.len() >= st.ctx {
                if !truncate {
                    return Err(bad(
                        format!(
                            "an input of {} tokens exceeds this server's context of {} (truncate: false)",
                            ids.len(),
                            st.ctx
                        ),
                        "input",
                    ));
                }
                ids.truncate(st.ctx - 1);
            }
            prompts.push(ids);
        }
        let tokens: usize = prompts.iter().map(Vec::len).sum();
        let vectors = crate::embeddings::embed_all(&st, prompts, crate::embeddings::one_vector(&st)?, "input").await?;
        let embeddings: Vec<Value> = vectors
            .into_iter()
            .map(|mut v| {
                v.truncate(keep);
                crate::embeddings::normalize(&mut v, 2);
                json!(v)
            })
            .collect();
        Ok(Json(json!({
            "model": model,
            "embeddings": embeddings,
            "total_duration": started.elapsed().as_nanos() as u64,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }))
        .into_response())
    }
    .await;
    finish(&st, r)
}

/// `POST /api/embeddings` (Ollama's older endpoint): `prompt`'s embedding, not normalized;
/// an empty prompt gives an empty one.
pub async fn embeddings(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let o = object(&body)?;
        model(&o)?;
        let prompt = string(&o, "prompt")?.unwrap_or_default();
        if prompt.is_empty() {
            return Ok(Json(json!({"embedding": []})).into_response());
        }
        let ids = encode_text(&st, prompt, true, false, "prompt").await?;
        let v = crate::embeddings::embed_all(
            &st,
            vec![ids],
            crate::embeddings::one_vector(&st)?,
            "input",
        )
        .await?;
        Ok(Json(json!({"embedding": v.into_iter().next().unwrap_or_default()})).into_response())
    }
    .await;
    finish(&st, r)
}

/// The served model's entry in `/api/tags` under `name`.
fn listed(st: &ServerState, name: &str) -> Value {
    let c = &st.card;
    let name = tagged(name);
    json!({
        "name": name,
        "model": name,
        "modified_at": c.modified_at,
        "size": c.size,
        "digest": c.digest,
        "details": c.details(),
    })
}

/// `GET /api/tags`: the served model, under each of its names (`--alias`), as Ollama lists
/// a model copied to other names.
pub async fn tags(State(st): State<Arc<ServerState>>) -> Response {
    let models: Vec<Value> = st.aliases.iter().map(|a| listed(&st, a)).collect();
    Json(json!({ "models": models })).into_response()
}

/// `GET /api/ps`: the served model, loaded for as long as the server runs.
pub async fn ps(State(st): State<Arc<ServerState>>) -> Response {
    let mut m = listed(&st, st.model_name());
    let o = m.as_object_mut().expect("an object");
    o.remove("modified_at");
    o.insert("expires_at".into(), json!("2318-08-16T00:00:00Z"));
    let vram = if st.metrics.backend.get().copied() == Some("cuda") {
        st.card.size
    } else {
        0
    };
    o.insert("size_vram".into(), json!(vram));
    o.insert("context_length".into(), json!(st.ctx));
    Json(json!({"models": [m]})).into_response()
}

/// `POST /api/show`: the served model's details, hyperparameters (`model_info`), chat
/// template, default parameters and capabilities (`completion`; `tools`, `thinking`,
/// `insert`, `embedding` where it has them).
pub async fn show(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let o = object(&body)?;
        model(&o)?;
        let template = st.tokenizer.chat_template();
        let source = template.map(|t| t.source()).unwrap_or_default();
        let mut caps = vec!["completion"];
        if template.is_some_and(|t| t.takes_tools()) {
            caps.push("tools");
        }
        if thinks(&st) {
            caps.push("thinking");
        }
        if matches!(st.tokenizer.fim(), [Some(_), Some(_), Some(_), ..]) {
            caps.push("insert");
        }
        if st.pooling.is_some_and(|p| p != crate::scheduler::Pooling::None) {
            caps.push("embedding");
        }
        let d = &st.default_sampler;
        let mut parameters = format!(
            "temperature {}\ntop_k {}\ntop_p {}\nmin_p {}\nrepeat_penalty {}\nrepeat_last_n {}\nnum_ctx {}",
            d.temp, d.top_k, d.top_p, d.min_p, d.repeat_penalty, d.repeat_last_n, st.ctx
        );
        // the model's recommended most tokens and stop strings (Ollama lists its own so)
        if let Some(n) = st.default_max_tokens {
            parameters.push_str(&format!("\nnum_predict {n}"));
        }
        for stop in &st.default_stop {
            parameters.push_str(&format!("\nstop {}", Value::String(stop.clone())));
        }
        let modelfile = format!(
            "# served by gdsrun {}\nFROM {}\n{}\n",
            env!("CARGO_PKG_VERSION"),
            st.model_dir.display(),
            parameters
                .lines()
                .map(|l| format!("PARAMETER {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        Ok(Json(json!({
            "license": "",
            "modelfile": modelfile,
            "parameters": parameters,
            "template": source,
            "details": st.card.details(),
            "model_info": st.card.info,
            "capabilities": caps,
            "modified_at": st.card.modified_at,
        }))
        .into_response())
    }
    .await;
    finish(&st, r)
}

/// `GET /api/version`.
pub async fn version() -> Response {
    Json(json!({"version": OLLAMA_VERSION})).into_response()
}

/// `GET /` and `HEAD /`: what Ollama answers there (clients probe it).
pub async fn root() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "Ollama is running",
    )
        .into_response()
}

/// `POST /api/pull`: the served model is here (`success`, streamed as one status line by
/// default); any other is refused.
pub async fn pull(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let o = object(&body)?;
        let name = model(&o)?;
        if !st.aliases.iter().any(|a| tagged(a) == tagged(&name)) {
            return Err(not_managed(&st, "pulling another model"));
        }
        let status = json!({"status": "success"});
        if boolean(&o, "stream")?.unwrap_or(true) {
            let mut r = Body::from(format!("{status}\n")).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-ndjson"),
            );
            return Ok(r);
        }
        Ok(Json(status).into_response())
    }
    .await;
    finish(&st, r)
}

fn not_managed(st: &ServerState, what: &str) -> ApiError {
    ApiError::status(
        StatusCode::NOT_IMPLEMENTED,
        "not_supported_error",
        format!(
            "{what} is not supported: this server serves one model ({}); fetch models with `gdsconv pull REF DIR` and serve them with `gdsrun serve`",
            tagged(st.model_name())
        ),
    )
}

/// `/api/push`, `/api/create`, `/api/copy`, `/api/delete`, `/api/blobs/...`: 501.
pub async fn manage(State(st): State<Arc<ServerState>>, req: Request) -> Response {
    let what = format!("{} {}", req.method(), req.uri().path());
    not_managed(&st, &what).into_response()
}

/// Middleware: on `/api/` paths, errors (from a handler or the shared limits: body size, API
/// key, unknown path, method) in Ollama's shape, `{"error": "message"}`.
pub async fn ollama_errors(req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/api/") {
        return next.run(req).await;
    }
    let r = next.run(req).await;
    crate::net::reshape_error(r, |_, message, _| json!({ "error": message })).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_read_as_ollama_writes_them() {
        assert_eq!(parameter_size(134_515_008), "134.52M");
        assert_eq!(parameter_size(7_241_732_096), "7.2B");
        assert_eq!(parameter_size(1_235_814_400), "1.2B");
        assert_eq!(parameter_size(999), "999");
    }

    /// `model_info` lists a mixture of experts' experts and a window under GGUF's names,
    /// with the keys every model has.
    #[test]
    fn model_info_names_the_experts_and_the_window() {
        let mut h = gds_format::arch::Hparams::example_gemma3();
        let dense = model_info("gemma3", &gds_runtime::config::Config::from_hparams(&h));
        assert_eq!(dense["gemma3.attention.sliding_window"], 32, "{dense}");
        assert_eq!(dense["gemma3.block_count"], h.n_layers, "{dense}");
        assert!(dense.get("gemma3.expert_count").is_none());
        h.moe = Some(gds_format::arch::Moe {
            n_expert: 128,
            n_expert_used: 8,
            n_ff_exp: 768,
            norm_weights: true,
        });
        h.sliding_window = None;
        let moe = model_info("qwen3moe", &gds_runtime::config::Config::from_hparams(&h));
        assert_eq!(moe["qwen3moe.expert_count"], 128);
        assert_eq!(moe["qwen3moe.expert_used_count"], 8);
        assert_eq!(moe["qwen3moe.expert_feed_forward_length"], 768);
        assert!(
            moe.get("qwen3moe.attention.sliding_window").is_none(),
            "{moe}"
        );
    }

    #[test]
    fn names_get_a_tag() {
        assert_eq!(tagged("smollm2"), "smollm2:latest");
        assert_eq!(tagged("smollm2:135m"), "smollm2:135m");
        assert_eq!(tagged("host:5000/org/model"), "host:5000/org/model:latest");
    }

    #[test]
    fn keep_alive_zero_unloads() {
        let o = |v: Value| v.as_object().cloned().unwrap();
        assert!(unloads(&o(json!({"keep_alive": 0}))));
        assert!(unloads(&o(json!({"keep_alive": "0s"}))));
        assert!(unloads(&o(json!({"keep_alive": "0"}))));
        assert!(!unloads(&o(json!({"keep_alive": "5m"}))));
        assert!(!unloads(&o(json!({}))));
    }

    #[test]
    fn options_become_the_sampling() {
        let o = json!({"options": {"temperature": 0, "top_k": 5.0, "num_predict": -1, "stop": ["\n"], "num_ctx": 99999, "num_gpu": 1, "seed": 7}, "format": "json", "top_logprobs": 2});
        let (c, last_n) = common(o.as_object().unwrap(), "m".into()).unwrap();
        assert_eq!(c.temperature, Some(0.0));
        assert_eq!(c.top_k, Some(5));
        assert_eq!(c.max_tokens, None);
        assert_eq!(c.seed, Some(7));
        assert!(matches!(c.stop, Some(Stop::Many(ref s)) if s == &["\n"]));
        assert_eq!(c.response_format, Some(json!({"type": "json_object"})));
        assert_eq!(c.logprobs, Some(Value::Bool(true)));
        assert_eq!(c.top_logprobs, Some(2));
        assert_eq!(last_n, None);
        // llama.cpp's samplers that Ollama's options name
        let o = json!({"options": {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "typical_p": 0.7}});
        let (c, _) = common(o.as_object().unwrap(), "m".into()).unwrap();
        assert_eq!(
            (
                c.llama.mirostat,
                c.llama.mirostat_tau,
                c.llama.mirostat_eta,
                c.llama.typical_p
            ),
            (
                Some(json!(2)),
                Some(json!(3.0)),
                Some(json!(0.2)),
                Some(json!(0.7))
            )
        );
        for (opts, named) in [
            (json!({"tfs_z": 0.5}), "tfs_z"),
            (json!({"mirostat": "on"}), "mirostat"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"stop": [1]}), "stop"),
        ] {
            let e = common(json!({"options": opts}).as_object().unwrap(), "m".into())
                .err()
                .unwrap();
            assert!(e.body().to_string().contains(named), "{}", e.body());
        }
        let e = common(json!({"format": "xml"}).as_object().unwrap(), "m".into())
            .err()
            .unwrap();
        assert!(e.body().to_string().contains("format"), "{}", e.body());
    }

    #[test]
    fn tool_results_answer_the_calls_they_name() {
        let m = chat_messages(
            json!([
                {"role": "user", "content": "weather in Paris and time in Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                    {"id": "t9", "function": {"name": "time", "arguments": {"city": "Rome"}}}
                ]},
                {"role": "tool", "tool_name": "time", "content": "12:00"},
                {"role": "tool", "content": "sunny"},
            ])
            .as_array()
            .unwrap(),
        )
        .unwrap();
        let calls = m[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["id"], "call_0");
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(m[2].tool_call_id.as_deref(), Some("t9"));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_0"));
        for bad in [
            json!([{"role": "robot", "content": "x"}]),
            json!([{"role": "user", "content": 3}]),
            json!([{"role": "user", "content": "x", "images": ["aGk="]}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {}}]}]),
        ] {
            assert!(chat_messages(bad.as_array().unwrap()).is_err(), "{bad}");
        }
    }
}
