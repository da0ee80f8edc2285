//! `POST /v1/responses`: OpenAI's Responses API, served by the chat path.
//!
//! A request is rewritten into the chat form (`instructions` and `input` items become
//! messages, `function_call` / `function_call_output` items become an assistant's tool calls
//! and tool results, flat function tools become chat tools, `text.format` becomes
//! `response_format`) and runs as one chat job: the same template, tool parsing, grammar
//! and scheduler. The reply is a `response` object whose `output` holds a `message` item
//! and/or `function_call` items; streamed, the Responses event sequence
//! (`response.created` … `response.output_text.delta` … `response.completed`).
//!
//! Responses are kept in memory unless `store` is false ([`ResponseStore`]: the last
//! [`STORE_ENTRIES`] responses within [`STORE_BYTES`], oldest dropped first): a request with
//! `previous_response_id` continues that conversation (its input and output items, not its
//! `instructions`, as OpenAI's), and `GET`/`DELETE /v1/responses/{id}` and
//! `GET /v1/responses/{id}/input_items` read and delete them. Nothing outlives the process.
//!
//! `background: true` keeps the response `queued` at once and runs it in a task of its own
//! ([`Background`]): polled by `GET`, cancelled by `POST /v1/responses/{id}/cancel`, its
//! events kept so that `GET /v1/responses/{id}?stream=true&starting_after=N` follows it again.
//! `include: ["message.output_text.logprobs"]` lists the output text's log-probabilities.

use crate::api::{
    chat_job, complete, constrain, finish, now_secs, parse, progress_json, progress_timings,
    random_seed, sse, submit, ApiError, ChatBody, Common, End, Gen, Job, Kind, Next, Piece,
    MAX_TOP_LOGPROBS,
};
use crate::error::bad;
use crate::items::{json_text, messages, metadata};
use crate::kept::Kept;
use crate::reasoning::CountedSplit;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

/// Most responses kept.
pub(crate) const STORE_ENTRIES: usize = 1024;
/// Most bytes of JSON kept (items and response objects together). They are kept as JSON
/// text, so this is the memory they take: parsed, small items take tens of times their text
/// (a 4 MiB request of `{"type": "reasoning"}` items would hold ~100 MB).
pub(crate) const STORE_BYTES: usize = 64 << 20;

/// A kept response: the conversation's items up to and including its output, and the
/// response object, as JSON text.
struct Stored {
    /// A JSON array (shared: read under the store's lock, parsed after it).
    items: Arc<str>,
    /// Items given as this response's input (the rest came from earlier responses).
    input_from: usize,
    /// Of the items, the response's output (the last ones).
    outputs: usize,
    response: Box<str>,
    /// Run in the background: its events and state ([`Background`]).
    bg: Option<Arc<Background>>,
}

impl Stored {
    /// Whether the response ended with its output (completed, or cut at its limit): what
    /// `previous_response_id` can continue. A background response that is still running,
    /// failed or was cancelled has no output to continue from.
    fn ready(&self) -> bool {
        self.bg.as_ref().is_none_or(|b| b.state().has_output())
    }

    /// Whether it is a background response still running (never dropped for room).
    fn running(&self) -> bool {
        self.bg.as_ref().is_some_and(|b| b.state().running())
    }
}

/// A background response's state, as its `status` says.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BgState {
    Queued,
    InProgress,
    /// Ended with its output: `completed` or `incomplete`.
    Done,
    Failed,
    Cancelled,
}

impl BgState {
    fn running(self) -> bool {
        matches!(self, BgState::Queued | BgState::InProgress)
    }

    fn has_output(self) -> bool {
        self == BgState::Done
    }
}

/// A response run in the background (`background: true`): the task that runs it and every
/// event it made, so that a client can follow it, or follow it again after losing the
/// connection (`GET /v1/responses/{id}?stream=true&starting_after=N`), whether or not it
/// was created streamed. Its events' sequence numbers are their places in `events`.
pub(crate) struct Background {
    log: std::sync::Mutex<BgLog>,
    /// Wakes the clients that follow the events.
    more: tokio::sync::Notify,
    /// Stops the task (cancel, delete): dropping its generator ends the request in the engine.
    abort: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
}

struct BgLog {
    events: Vec<Ev>,
    bytes: usize,
    /// No more events will come.
    ended: bool,
    state: BgState,
}

impl Background {
    fn new() -> Background {
        Background {
            log: std::sync::Mutex::new(BgLog {
                events: Vec::new(),
                bytes: 0,
                ended: false,
                state: BgState::Queued,
            }),
            more: tokio::sync::Notify::new(),
            abort: std::sync::Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BgLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn state(&self) -> BgState {
        self.lock().state
    }

    /// Moves to `to` where the state is one `from` accepts; the state it was in.
    fn transition(&self, from: impl Fn(BgState) -> bool, to: BgState) -> BgState {
        let mut log = self.lock();
        let was = log.state;
        if from(was) {
            log.state = to;
        }
        was
    }

    fn push(&self, ev: Ev) {
        {
            let mut log = self.lock();
            log.bytes += ev.kind.len() + ev.data.len();
            log.events.push(ev);
        }
        self.more.notify_waiters();
    }

    /// No more events: the clients following it see their stream end.
    fn end(&self) {
        self.lock().ended = true;
        self.more.notify_waiters();
    }

    /// Stops the task running it (nothing when it has ended).
    fn stop(&self) {
        if let Some(a) = self.abort.lock().unwrap_or_else(|e| e.into_inner()).take() {
            a.abort();
        }
        self.end();
    }

    /// The events after the first `from`, as they come, until the response ends.
    fn follow(self: Arc<Self>, from: usize) -> impl futures_util::Stream<Item = Ev> + Send {
        stream::unfold((self, from), |(bg, next)| async move {
            loop {
                // registered before the log is read: an event pushed meanwhile wakes it
                let waker = bg.clone();
                let more = waker.more.notified();
                tokio::pin!(more);
                more.as_mut().enable();
                {
                    let log = bg.lock();
                    if next < log.events.len() {
                        let batch = log.events[next..].to_vec();
                        let next = log.events.len();
                        drop(log);
                        return Some((batch, (bg, next)));
                    }
                    if log.ended {
                        return None;
                    }
                }
                more.await;
            }
        })
        .flat_map(stream::iter)
    }
}

/// A kept response's items from their text (which the store wrote from values).
fn parse_items(text: &str) -> Vec<Value> {
    serde_json::from_str(text).unwrap_or_default()
}

/// The responses kept for `previous_response_id` and the retrieval endpoints: the last
/// [`STORE_ENTRIES`], at most [`STORE_BYTES`] of JSON text (a background response's events
/// counted once it ends), the oldest dropped first but never a background response still
/// running (their number is bounded by the engine's queue).
pub(crate) struct ResponseStore(Kept<Stored>);

impl Default for ResponseStore {
    fn default() -> Self {
        ResponseStore(Kept::new(STORE_ENTRIES, STORE_BYTES))
    }
}

/// Kept for room: a background response still running.
fn pinned(_: &str, s: &Stored) -> bool {
    s.running()
}

impl ResponseStore {
    fn get(&self, id: &str) -> Option<&Stored> {
        self.0.get(id)
    }

    /// Keeps `response` (replacing a background response's entry, whose events and task it
    /// keeps; not one that was cancelled meanwhile).
    fn put(&mut self, id: String, items: Vec<Value>, input_from: usize, response: Value) {
        let bg = match self.0.get(&id) {
            Some(old) => {
                if old
                    .bg
                    .as_ref()
                    .is_some_and(|b| b.state() == BgState::Cancelled)
                {
                    return;
                }
                let bg = old.bg.clone();
                // (gone, not left as it was, where the response is too big to keep)
                self.0.remove(&id);
                bg
            }
            None => None,
        };
        if let Some(b) = &bg {
            b.lock().state = BgState::Done;
        }
        self.insert(id, items, input_from, response, bg);
    }

    fn insert(
        &mut self,
        id: String,
        items: Vec<Value>,
        input_from: usize,
        response: Value,
        bg: Option<Arc<Background>>,
    ) {
        let outputs = output_len(&response);
        let (items, response) = (
            Arc::<str>::from(Value::Array(items).to_string()),
            response.to_string().into_boxed_str(),
        );
        let bytes = items.len() + response.len();
        let stored = Stored {
            items,
            input_from,
            outputs,
            response,
            bg,
        };
        self.0.insert(id, stored, bytes, pinned);
    }

    /// A background response's events count in its bytes once it has ended.
    fn count_events(&mut self, id: &str, bytes: usize) {
        if self.0.update(id, |_, now| ((), now + bytes)).is_some() {
            self.0.make_room(0, 0, pinned);
        }
    }

    /// Changes a kept response object in place (a background response's status).
    fn update(&mut self, id: &str, f: impl FnOnce(&mut Value)) {
        self.0
            .update(id, |s, now| crate::kept::edit_json(&mut s.response, now, f));
    }

    fn remove(&mut self, id: &str) -> bool {
        self.0.remove(id).is_some()
    }
}

/// What a stored response keeps of its request: the conversation's items so far (earlier
/// responses' and this input's) and where this input starts.
#[derive(Clone)]
pub(crate) struct Keep {
    st: Arc<ServerState>,
    items: Vec<Value>,
    input_from: usize,
    /// The response is kept (`store`, the default).
    store: bool,
    /// A conversation the input and output are added to.
    conversation: Option<String>,
}

impl Keep {
    /// Keeps the response `r` with its output items after the conversation's, and adds its
    /// input and output to its conversation.
    fn put(self, r: &Value) {
        let Some(id) = r["id"].as_str() else {
            return;
        };
        let mut items = self.items;
        items.extend(r["output"].as_array().into_iter().flatten().cloned());
        if let Some(c) = &self.conversation {
            crate::conversations::add_response_items(&self.st, c, &items[self.input_from..]);
        }
        if self.store {
            let mut store = self.st.responses.lock().unwrap_or_else(|e| e.into_inner());
            store.put(id.to_string(), items, self.input_from, r.clone());
        }
    }

    /// Keeps a background response as it starts (`queued`, no output yet), with its events.
    fn start(&self, r: &Value, bg: Arc<Background>) {
        let Some(id) = r["id"].as_str() else {
            return;
        };
        let mut store = self.st.responses.lock().unwrap_or_else(|e| e.into_inner());
        store.insert(
            id.to_string(),
            self.items.clone(),
            self.input_from,
            r.clone(),
            Some(bg),
        );
    }
}

/// The Responses API's own fields (the sampling fields it shares with chat are read as
/// [`Common`]).
#[derive(Deserialize, Debug)]
struct ResponsesBody {
    input: Value,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "schema", ...}}`.
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    previous_response_id: Option<Value>,
    #[serde(default)]
    store: Option<bool>,
    /// `{"effort": ...}`: chat's `reasoning_effort`.
    #[serde(default)]
    reasoning: Option<Value>,
    /// Up to 16 string pairs, echoed and kept with the response.
    #[serde(default)]
    metadata: Option<Value>,
    /// A kept conversation (OpenAI's Conversations API: its id, or `{"id"}`): its items come
    /// before the input, and the input and output are added to it when the response ends.
    #[serde(default)]
    conversation: Option<Value>,
    /// Run in the background: kept at once as `queued`, run by a task of its own, read with
    /// `GET /v1/responses/{id}` (streamed again with `?stream=true&starting_after=N`),
    /// cancelled with `POST /v1/responses/{id}/cancel`. Needs `store`.
    #[serde(default)]
    background: Option<bool>,
    /// Extra output to include: `message.output_text.logprobs` (with `top_logprobs`
    /// alternatives) is given; the rest is not produced here (encrypted reasoning and the
    /// like) and ignored.
    #[serde(default)]
    include: Option<Value>,
    /// `auto`: input over the context loses its oldest items (instructions and system
    /// messages kept); `disabled` (the default): such input is refused.
    #[serde(default)]
    truncation: Option<String>,
    /// Refused by name ([`refuse_unsupported`]): a moderation model's policy, server-side
    /// compaction, a prompt template kept at OpenAI.
    #[serde(default)]
    moderation: Option<Value>,
    #[serde(default)]
    context_management: Option<Value>,
    #[serde(default)]
    prompt: Option<Value>,
}

/// The request fields that would change the answer in a way this server does not do:
/// refused by name rather than ignored.
fn refuse_unsupported(r: &ResponsesBody) -> Result<(), ApiError> {
    if r.background == Some(true) && r.store == Some(false) {
        return Err(bad(
            "background needs store: true (a background response is kept to be read, followed or cancelled)",
            "background",
        ));
    }
    let set = |v: &Option<Value>| {
        v.as_ref()
            .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
    };
    for (field, v, why) in [
        (
            "moderation",
            &r.moderation,
            "this server runs no moderation model (its policy would not be applied)",
        ),
        (
            "context_management",
            &r.context_management,
            "the context is not compacted here (truncation: auto drops the oldest items instead)",
        ),
        (
            "prompt",
            &r.prompt,
            "prompt templates are kept at OpenAI, not here (send instructions and input)",
        ),
    ] {
        if set(v) {
            return Err(bad(format!("{field} is not supported: {why}"), field));
        }
    }
    Ok(())
}

/// Flat function tools (`{"type": "function", "name", "description", "parameters"}`) in
/// chat's nested form.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| bad("tools must be a list of function tools", "tools"))?;
    let mut out = Vec::new();
    for t in list {
        let kind = t.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "function" {
            return Err(bad(
                format!("tools of type {kind:?} are not supported (function tools only)"),
                "tools",
            ));
        }
        let mut f = serde_json::Map::new();
        for key in ["name", "description", "parameters", "strict"] {
            if let Some(v) = t.get(key) {
                f.insert(key.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice`: the strings as they are, `{"type": "function", "name"}` in chat's form.
fn chat_tool_choice(choice: &Value) -> Value {
    match choice.get("name") {
        Some(name) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            json!({"type": "function", "function": {"name": name}})
        }
        _ => choice.clone(),
    }
}

/// `text.format` as chat's `response_format`.
fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
    crate::api::verbosity(text.get("verbosity"), "text")?;
    let Some(f) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {
                "name": f.get("name"),
                "schema": f.get("schema"),
                "strict": f.get("strict"),
            },
        }))),
        Some("text" | "json_object") => Ok(Some(f.clone())),
        _ => Err(bad(
            "text.format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
            "text",
        )),
    }
}

/// A Responses request ready to run.
struct Prepared {
    /// The request rewritten as a chat job.
    job: Job,
    /// The fields echoed back in the response.
    echoed: Value,
    /// What keeping it takes (`None` with `store: false`).
    keep: Option<Keep>,
    background: bool,
    /// The output text's log-probabilities were asked for (`include`).
    logprobs: bool,
}

async fn responses_job(st: &Arc<ServerState>, body: &Bytes) -> Result<Prepared, ApiError> {
    let r: ResponsesBody = parse(body)?;
    let mut common: Common = parse(body)?;
    refuse_unsupported(&r)?;
    let metadata = metadata(r.metadata.as_ref())?;
    if let Some(n) = r.max_output_tokens.filter(|&n| n < 1) {
        return Err(bad(
            format!("max_output_tokens {n} must be at least 1"),
            "max_output_tokens",
        ));
    }
    // a kept conversation's id (`"conv_..."` or `{"id": "conv_..."}`)
    let conversation = match &r.conversation {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) => Some(c.clone()),
        Some(Value::Object(o)) if o.get("id").is_some_and(Value::is_string) => {
            o["id"].as_str().map(str::to_string)
        }
        Some(_) => {
            return Err(bad(
                "conversation must be a conversation id or {\"id\": ...}",
                "conversation",
            ))
        }
    };
    if conversation.is_some()
        && r.previous_response_id
            .as_ref()
            .is_some_and(|p| !p.is_null())
    {
        return Err(bad(
            "conversation and previous_response_id cannot both be given",
            "conversation",
        ));
    }
    // the conversation: an earlier response's items (or a kept conversation's), then this
    // input's
    let mut items = match &r.previous_response_id {
        None | Some(Value::Null) if conversation.is_some() => {
            let c = conversation.as_deref().unwrap_or_default();
            let kept = st
                .conversations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .items(c);
            kept.ok_or_else(|| {
                bad(
                    format!(
                        "no conversation {c:?} (kept in memory: the last {} used)",
                        crate::conversations::CONV_ENTRIES
                    ),
                    "conversation",
                )
                .code("conversation_not_found")
            })?
        }
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(prev)) => {
            let kept = {
                let store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
                store.get(prev).map(|s| {
                    (
                        s.items.clone(),
                        (!s.ready()).then(|| status_of(&s.response)),
                    )
                })
            };
            match kept {
                Some((text, None)) => parse_items(&text),
                Some((_, Some(status))) => {
                    return Err(bad(
                        format!("response {prev:?} is {status}: only a response that ended with its output continues a conversation"),
                        "previous_response_id",
                    ))
                }
                None => {
                    return Err(bad(
                        format!("no stored response {prev:?} (kept: the last {STORE_ENTRIES}, in memory, unless store was false)"),
                        "previous_response_id",
                    )
                    .code("previous_response_not_found"))
                }
            }
        }
        Some(_) => {
            return Err(bad(
                "previous_response_id must be a response id",
                "previous_response_id",
            ))
        }
    };
    let input_from = items.len();
    match &r.input {
        Value::String(s) => items.push(json!({"type": "message", "role": "user", "content": s})),
        Value::Array(list) => items.extend(list.iter().cloned()),
        _ => return Err(bad("input must be a string or a list of items", "input")),
    }
    // the chat fields the Responses API names differently or does not have
    // (refused where its reply has no place for what they ask — chat's `logprobs` switch,
    // `n`, `echo` —; logit_bias and the penalties, not OpenAI's fields here, are honoured
    // as on the chat endpoint)
    // the output text's log-probabilities: asked for by `include`, with `top_logprobs`
    // alternatives (a field of the request here, not chat's switch)
    let logprobs = r
        .include
        .as_ref()
        .and_then(Value::as_array)
        .is_some_and(|l| l.iter().any(|i| i == "message.output_text.logprobs"));
    let top = common.top_logprobs.take();
    if let Some(k) = top.filter(|k| !(0..=MAX_TOP_LOGPROBS).contains(k)) {
        return Err(bad(
            format!("top_logprobs {k} must be from 0 to {MAX_TOP_LOGPROBS}"),
            "top_logprobs",
        ));
    }
    common.refuse_chat_only("the Responses API (/v1/responses)")?;
    if logprobs {
        common.logprobs = Some(json!(true));
        common.top_logprobs = top;
    }
    common.max_tokens = r.max_output_tokens;
    common.response_format = match &r.text {
        Some(t) => response_format(t)?,
        None => None,
    };
    let truncation = match r.truncation.as_deref() {
        None | Some("disabled") => "disabled",
        Some("auto") => "auto",
        Some(t) => {
            return Err(bad(
                format!("truncation {t:?}: expected \"auto\" or \"disabled\""),
                "truncation",
            ))
        }
    };
    let mut echoed = json!({
        "instructions": r.instructions,
        "max_output_tokens": r.max_output_tokens,
        // what the sampler uses: the request's, else the server's defaults
        "temperature": common.temperature.unwrap_or(f64::from(st.default_sampler.temp)),
        "top_p": common.top_p.unwrap_or(f64::from(st.default_sampler.top_p)),
        "metadata": metadata,
        "tools": r.tools.clone().unwrap_or(json!([])),
        "tool_choice": r.tool_choice.clone().unwrap_or(json!("auto")),
        "parallel_tool_calls": r.parallel_tool_calls.unwrap_or(true),
        "text": r.text.clone().unwrap_or(json!({"format": {"type": "text"}})),
        "store": r.store != Some(false),
        "previous_response_id": r.previous_response_id,
        "truncation": truncation,
        "background": r.background == Some(true),
        "top_logprobs": top.unwrap_or(0),
        "conversation": conversation.as_ref().map(|c| json!({"id": c})),
    });
    let chat = ChatBody {
        messages: messages(r.instructions, &Value::Array(items.clone()))?,
        tools: r.tools.as_ref().map(chat_tools).transpose()?,
        tool_choice: r.tool_choice.as_ref().map(chat_tool_choice),
        parallel_tool_calls: r.parallel_tool_calls,
        continue_final_message: None,
        add_generation_prompt: None,
        documents: None,
        chat_template: None,
        chat_template_kwargs: None,
        reasoning_format: None,
        reasoning_effort: r
            .reasoning
            .as_ref()
            .and_then(|v| v.get("effort"))
            .and_then(Value::as_str)
            .map(str::to_string),
        drop_oldest: truncation == "auto",
    };
    if chat.messages.is_empty() {
        return Err(bad("input must not be empty", "input"));
    }
    let job = chat_job(st, chat, common).await?;
    echoed["service_tier"] = json!(job.tier_name.unwrap_or("default"));
    let store = r.store != Some(false);
    let keep = (store || conversation.is_some()).then(|| Keep {
        st: st.clone(),
        items,
        input_from,
        store,
        conversation,
    });
    Ok(Prepared {
        job,
        echoed,
        keep,
        background: r.background == Some(true),
        logprobs,
    })
}

/// `POST /v1/responses/input_tokens` (OpenAI's): the prompt tokens a Responses request
/// would have (the earlier response's items included), nothing generated or kept.
pub async fn count_input_tokens(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let p = responses_job(&st, &body).await?;
        Ok(crate::api::input_tokens(p.job.prompt.len()))
    }
    .await;
    finish(&st, r)
}

/// A `response` object around `output`.
fn response_object(
    id: &str,
    created: u64,
    (model, input): (&str, usize),
    echoed: &Value,
    status: &str,
    output: Vec<Value>,
    end: Option<&End>,
) -> Value {
    let mut r = json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": null,
        "incomplete_details": null,
        "model": model,
        "output": output,
        "metadata": {},
        "usage": null,
    });
    if let Value::Object(e) = echoed {
        for (k, v) in e {
            r[k] = v.clone();
        }
    }
    if let Some(end) = end {
        if end.finish == "length" {
            r["status"] = json!("incomplete");
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        let cached = end.done.as_ref().map_or(0, |d| d.cached_tokens);
        r["usage"] = json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": end.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            "total_tokens": input + end.completion_tokens,
        });
    }
    r
}

/// A reasoning item: the reply's thinking as one `reasoning_text` part (the open-weight
/// models' form of OpenAI's item; no summary).
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "reasoning",
        "id": id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    })
}

/// A reply's message item's status: `incomplete` where the output limit cut it (the
/// response is `incomplete` too), else `completed`.
fn item_status(end: &End) -> &'static str {
    if end.finish == "length" {
        "incomplete"
    } else {
        "completed"
    }
}

/// A message item; `logprobs`: its text's tokens' (empty unless asked for with `include`).
fn message_item(id: &str, text: &str, status: &str, logprobs: Vec<Value>) -> Value {
    json!({
        "type": "message",
        "id": id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    })
}

/// A chat tool call (`{"id", "function": {"name", "arguments"}}`) as a `function_call` item.
fn call_item(call: &Value) -> Value {
    let call_id = call.get("id").and_then(Value::as_str).unwrap_or_default();
    json!({
        "type": "function_call",
        "id": format!("fc_{}", call_id.trim_start_matches("call_")),
        "call_id": call_id,
        "name": call.pointer("/function/name"),
        "arguments": call.pointer("/function/arguments"),
        "status": "completed",
    })
}

/// `POST /v1/responses`.
pub async fn responses(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let p = responses_job(&st, &body).await?;
        let id = format!("resp_{:016x}", random_seed());
        let msg_id = format!("msg_{:016x}", random_seed());
        let created = now_secs();
        if p.background {
            return background(st.clone(), p, (id, msg_id, created)).await;
        }
        if p.job.stream {
            let events = response_events(st.clone(), p, (id, msg_id, created), false).await?;
            return Ok(sse(events.map(Ev::sse)));
        }
        let Prepared {
            job, echoed, keep, ..
        } = p;
        let (mut choice, end) = complete(&st, &job, Kind::Chat, 0).await?;
        // the output text's log-probabilities (the chat form's; a thinking model's thinking
        // comes first and is not the output text)
        let lps: Vec<Value> = match choice["logprobs"]["content"].take() {
            Value::Array(a) => a.into_iter().skip(end.reasoning_tokens).collect(),
            _ => Vec::new(),
        };
        let m = &choice["message"];
        let mut output = Vec::new();
        if let Some(r) = m["reasoning_content"].as_str() {
            output.push(reasoning_item(&rs_id(&msg_id), r, "completed"));
        }
        let status = item_status(&end);
        let mut lps = Some(lps);
        if let Some(text) = m["content"].as_str().filter(|t| !t.is_empty()) {
            output.push(message_item(
                &msg_id,
                text,
                status,
                lps.take().unwrap_or_default(),
            ));
        }
        for c in m["tool_calls"].as_array().into_iter().flatten() {
            output.push(call_item(c));
        }
        if output.iter().all(|i| i["type"] == "reasoning") {
            output.push(message_item(
                &msg_id,
                "",
                status,
                lps.take().unwrap_or_default(),
            ));
        }
        let r = response_object(
            &id,
            created,
            (&job.model, job.prompt.len()),
            &echoed,
            "completed",
            output,
            Some(&end),
        );
        if let Some(k) = keep {
            k.put(&r);
        }
        Ok(Json(r).into_response())
    }
    .await;
    finish(&st, r)
}

/// One event of a streamed response: its name and its data (JSON text).
#[derive(Clone)]
struct Ev {
    kind: String,
    data: String,
}

impl Ev {
    fn sse(self) -> Result<SseEvent, Infallible> {
        Ok(SseEvent::default().event(self.kind).data(self.data))
    }
}

/// Numbers the events of one streamed response (`sequence_number`) and names them.
struct Events {
    seq: u64,
    /// llama-server's `timings_per_token`: the timings so far, put on each text delta.
    timings: Option<Value>,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> Ev {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        if let Some(t) = self
            .timings
            .as_ref()
            .filter(|_| kind == "response.output_text.delta")
        {
            data["timings"] = t.clone();
        }
        self.seq += 1;
        Ev {
            kind: kind.to_string(),
            data: data.to_string(),
        }
    }
}

/// The id of a response's reasoning item (its message's, `rs_` for `msg_`).
fn rs_id(msg_id: &str) -> String {
    format!("rs_{}", msg_id.trim_start_matches("msg_"))
}

/// Opens the message item (at `index` of the output): `response.output_item.added`,
/// `response.content_part.added`.
fn open_message(ev: &mut Events, msg_id: &str, index: usize, out: &mut Vec<Ev>) {
    out.push(ev.event(
        "response.output_item.added",
        json!({"output_index": index, "item": {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}}),
    ));
    out.push(ev.event(
        "response.content_part.added",
        json!({"item_id": msg_id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
    ));
}

/// A `response.output_text.delta`, opening the message item first when it is not yet.
fn text_delta(
    ev: &mut Events,
    opened: &mut bool,
    (msg_id, index): (&str, usize),
    (delta, logprobs): (&str, Vec<Value>),
    out: &mut Vec<Ev>,
) {
    if !*opened {
        open_message(ev, msg_id, index, out);
        *opened = true;
    }
    out.push(ev.event(
        "response.output_text.delta",
        json!({"item_id": msg_id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": logprobs}),
    ));
}

/// A streamed response's reasoning item (always output 0): opened with its first text,
/// closed when the answer starts or the reply ends.
#[derive(Default)]
struct Thinking {
    text: String,
    open: bool,
    /// Closed: the item is in the output (the message comes after it).
    done: Option<Value>,
}

impl Thinking {
    fn delta(&mut self, ev: &mut Events, id: &str, t: &str, out: &mut Vec<Ev>) {
        if t.is_empty() || self.done.is_some() {
            return;
        }
        if !self.open {
            out.push(ev.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": reasoning_item(id, "", "in_progress")}),
            ));
            out.push(ev.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
            ));
            self.open = true;
        }
        self.text.push_str(t);
        out.push(ev.event(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": t}),
        ));
    }

    fn close(&mut self, ev: &mut Events, id: &str, out: &mut Vec<Ev>) {
        if !self.open || self.done.is_some() {
            return;
        }
        let item = reasoning_item(id, &self.text, "completed");
        out.push(ev.event(
            "response.reasoning_text.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "text": self.text}),
        ));
        out.push(ev.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "part": item["content"][0]}),
        ));
        out.push(ev.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        ));
        self.done = Some(item);
    }

    /// The output index of the items after it.
    fn next_index(&self) -> usize {
        usize::from(self.done.is_some())
    }
}

/// The log-probabilities of a streamed reply's output text: those not yet sent with a
/// delta, and all of them (for the message item at the end).
#[derive(Default)]
struct Lps {
    on: bool,
    pending: Vec<Value>,
    all: Vec<Value>,
}

impl Lps {
    /// The log-probabilities `g` has not handed out yet, as the chat form lists them.
    fn take(&mut self, g: &mut Gen) -> Vec<Value> {
        if !self.on {
            return Vec::new();
        }
        match g.take_logprobs(Kind::Chat)["content"].take() {
            Value::Array(a) => a,
            _ => Vec::new(),
        }
    }

    /// Those pending, to go with the delta being sent.
    fn send(&mut self) -> Vec<Value> {
        let sent = std::mem::take(&mut self.pending);
        self.all.extend(sent.iter().cloned());
        sent
    }
}

/// What a streamed response carries from one step to the next.
struct Streaming {
    g: Gen,
    /// The answer's text so far (the reasoning's is in `think`).
    text: String,
    /// The message item was opened.
    opened: bool,
    ev: Events,
    think: Thinking,
    split: Option<CountedSplit>,
    /// `response.in_progress` was sent (a background response is `queued` until its first
    /// output).
    started: bool,
    lps: Lps,
    /// What keeping the response takes (taken at its end).
    keep: Option<Keep>,
}

/// What every step of a streamed response reads and none changes (shared, not copied a
/// step: the echoed fields can be large).
struct Fixed {
    id: String,
    msg_id: String,
    /// Its reasoning item's id.
    rs: String,
    created: u64,
    /// The model's name and the prompt's tokens.
    who: (String, usize),
    echoed: Value,
    /// The response object while it runs (`in_progress`, no output).
    in_progress: Value,
    tools: Option<Arc<crate::tools::Tools>>,
}

/// The identity of a response: its id, its message item's id, when it was created.
type Ids = (String, String, u64);

/// The events of a response, streamed: text deltas as they come; with tools the reply is
/// held until the end (a call may be starting) and then sent as a message item or as
/// function-call items. `background`: the response starts `queued` (`response.created`,
/// `response.queued`) and is `in_progress` from its first output.
async fn response_events(
    st: Arc<ServerState>,
    p: Prepared,
    (id, msg_id, created): Ids,
    background: bool,
) -> Result<impl futures_util::Stream<Item = Ev> + Send + 'static, ApiError> {
    let Prepared {
        job,
        echoed,
        keep,
        logprobs,
        ..
    } = p;
    let constraint = constrain(&st, &job).await?;
    let submitted = submit(&st, &job, constraint)?;
    let gen = Gen::new(st.clone(), submitted, &job, logprobs);
    let tools = job.tools.clone().filter(|t| t.parses());
    let mut ev = Events {
        seq: 0,
        timings: None,
    };
    let who = (job.model.clone(), job.prompt.len());
    let (timings, progress) = (job.timings_per_token, job.progress);
    let shell = |status: &str| {
        response_object(&id, created, (&who.0, who.1), &echoed, status, vec![], None)
    };
    let first = if background {
        vec![
            ev.event("response.created", json!({ "response": shell("queued") })),
            ev.event("response.queued", json!({ "response": shell("queued") })),
        ]
    } else {
        vec![
            ev.event(
                "response.created",
                json!({ "response": shell("in_progress") }),
            ),
            ev.event(
                "response.in_progress",
                json!({ "response": shell("in_progress") }),
            ),
        ]
    };
    let fixed = Arc::new(Fixed {
        in_progress: shell("in_progress"),
        rs: rs_id(&msg_id),
        id,
        msg_id,
        created,
        who,
        echoed,
        tools,
    });
    let state = Streaming {
        g: gen,
        text: String::new(),
        opened: false,
        ev,
        think: Thinking::default(),
        split: job.reasoning.as_ref().map(CountedSplit::new),
        started: !background,
        lps: Lps {
            on: logprobs,
            ..Lps::default()
        },
        keep,
    };
    let body = stream::unfold(Some(state), move |state| {
        let f = fixed.clone();
        async move {
            let mut s = state?;
            // llama-server's `return_progress`: how far the prompt has gone in, on
            // `response.in_progress` events (`timings` too with `timings_per_token`)
            let next = if progress {
                s.g.next_or_progress().await?
            } else {
                Next::Piece(s.g.next().await?)
            };
            let piece = match next {
                Next::Piece(p) => p,
                Next::Progress(p) => {
                    s.started = true;
                    let mut data = json!({"response": f.in_progress, "prompt_progress": progress_json(&p)});
                    if timings {
                        data["timings"] = progress_timings(&p);
                    }
                    let out = vec![s.ev.event("response.in_progress", data)];
                    return Some((out, Some(s)));
                }
            };
            if timings {
                s.ev.timings = Some(s.g.timings_so_far(f.who.1));
            }
            let mut out = Vec::new();
            if !s.started {
                s.started = true;
                out.push(
                    s.ev
                        .event("response.in_progress", json!({ "response": f.in_progress })),
                );
            }
            let Streaming {
                g,
                text,
                opened,
                ev,
                think,
                split,
                lps,
                keep,
                ..
            } = &mut s;
            match piece {
                Piece::Text(t) => {
                    let lp = lps.take(g);
                    let t = match split {
                        Some(sp) => {
                            let (r, answer) = sp.push(&t, g.generated());
                            think.delta(ev, &f.rs, &r, &mut out);
                            if !answer.is_empty() {
                                think.close(ev, &f.rs, &mut out);
                            }
                            answer
                        }
                        None => t,
                    };
                    // the thinking's tokens are not the output text's
                    if !t.is_empty() || split.is_none() {
                        lps.pending.extend(lp);
                    }
                    text.push_str(&t);
                    if f.tools.is_none() && !t.is_empty() {
                        let at = (f.msg_id.as_str(), think.next_index());
                        text_delta(ev, opened, at, (&t, lps.send()), &mut out);
                    }
                    Some((out, Some(s)))
                }
                Piece::End(mut end) => {
                    let mut rest = g.rest();
                    let lp = lps.take(g);
                    if let Some(sp) = split {
                        let (r, answer) =
                            sp.end(&rest.take().unwrap_or_default(), end.completion_tokens);
                        end.reasoning_tokens = sp.tokens();
                        think.delta(ev, &f.rs, &r, &mut out);
                        think.close(ev, &f.rs, &mut out);
                        rest = (!answer.is_empty()).then_some(answer);
                    }
                    lps.pending.extend(lp);
                    let at = (f.msg_id.as_str(), think.next_index());
                    if let Some(rest) = rest {
                        text.push_str(&rest);
                        if f.tools.is_none() {
                            text_delta(ev, opened, at, (&rest, lps.send()), &mut out);
                        }
                    }
                    let (content, calls) = match f.tools.as_deref() {
                        Some(t) => t.parse_end(text, end.finish),
                        None => (Some(text.clone()), Vec::new()),
                    };
                    let content = content.unwrap_or_default();
                    let mut items: Vec<Value> = think.done.take().into_iter().collect();
                    if !content.is_empty() || calls.is_empty() {
                        if !*opened {
                            // held (tools) or empty: one delta with all of it, if any
                            open_message(ev, &f.msg_id, at.1, &mut out);
                            if !content.is_empty() {
                                text_delta(ev, &mut true, at, (&content, lps.send()), &mut out);
                            }
                        }
                        // (what no delta took: tokens whose text a stop string held back)
                        lps.send();
                        let lp = std::mem::take(&mut lps.all);
                        let item = message_item(&f.msg_id, &content, item_status(&end), lp);
                        out.push(ev.event(
                            "response.output_text.done",
                            json!({"item_id": f.msg_id, "output_index": at.1, "content_index": 0, "text": content, "logprobs": item["content"][0]["logprobs"]}),
                        ));
                        out.push(ev.event(
                            "response.content_part.done",
                            json!({"item_id": f.msg_id, "output_index": at.1, "content_index": 0, "part": item["content"][0]}),
                        ));
                        out.push(ev.event(
                            "response.output_item.done",
                            json!({"output_index": at.1, "item": item}),
                        ));
                        items.push(item);
                    }
                    for c in &calls {
                        let item = call_item(c);
                        let index = items.len();
                        let mut added = item.clone();
                        added["arguments"] = json!("");
                        added["status"] = json!("in_progress");
                        out.push(ev.event(
                            "response.output_item.added",
                            json!({"output_index": index, "item": added}),
                        ));
                        out.push(ev.event(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item["id"], "output_index": index, "delta": item["arguments"]}),
                        ));
                        out.push(ev.event(
                            "response.function_call_arguments.done",
                            json!({"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}),
                        ));
                        out.push(ev.event(
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        ));
                        items.push(item);
                    }
                    let r = response_object(
                        &f.id,
                        f.created,
                        (&f.who.0, f.who.1),
                        &f.echoed,
                        "completed",
                        items,
                        Some(&end),
                    );
                    if let Some(k) = keep.take() {
                        k.put(&r);
                    }
                    let kind = if r["status"] == "incomplete" {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    let mut data = json!({ "response": r });
                    if timings {
                        data["timings"] = g.timings_so_far(f.who.1);
                    }
                    out.push(ev.event(kind, data));
                    Some((out, None))
                }
                Piece::Error(e) => {
                    let body = e.body();
                    out.push(ev.event(
                        "error",
                        json!({"code": body["error"]["code"], "message": body["error"]["message"], "param": body["error"]["param"]}),
                    ));
                    Some((out, None))
                }
            }
        }
    })
    .flat_map(stream::iter);
    Ok(stream::iter(first).chain(body))
}

/// Runs a background response to its end: its events kept for the clients that follow
/// it, its status kept up to date (`in_progress` from its first output; `failed` with the
/// error where it fails; `cancelled` is set by the cancel).
async fn run_background(
    st: Arc<ServerState>,
    bg: Arc<Background>,
    id: String,
    events: impl futures_util::Stream<Item = Ev>,
) {
    let fail = |message: &Value, code: &Value| {
        let mut store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
        if bg.transition(BgState::running, BgState::Failed).running() {
            store.update(&id, |r| {
                r["status"] = json!("failed");
                r["error"] = json!({"code": code, "message": message});
            });
        }
    };
    futures_util::pin_mut!(events);
    while let Some(ev) = events.next().await {
        match ev.kind.as_str() {
            "response.in_progress" => {
                let mut store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
                let queued = |s| s == BgState::Queued;
                if queued(bg.transition(queued, BgState::InProgress)) {
                    store.update(&id, |r| r["status"] = json!("in_progress"));
                }
            }
            "error" => {
                let e: Value = serde_json::from_str(&ev.data).unwrap_or_default();
                let code = match &e["code"] {
                    Value::Null => json!("server_error"),
                    c => c.clone(),
                };
                fail(&e["message"], &code);
            }
            _ => {}
        }
        bg.push(ev);
    }
    // a generator that ended without a reply (the engine stopped)
    fail(
        &json!("the engine ended the response without a reply"),
        &json!("server_error"),
    );
    let bytes = bg.lock().bytes;
    bg.end();
    let mut store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
    store.count_events(&id, bytes);
}

/// A background response: kept `queued` at once and run by a task of its own, which the
/// request's connection does not hold (a client that leaves does not cancel it; `POST
/// /v1/responses/{id}/cancel` does). Streamed, the request follows its events as they come.
async fn background(st: Arc<ServerState>, p: Prepared, ids: Ids) -> Result<Response, ApiError> {
    let Some(keep) = p.keep.clone().filter(|k| k.store) else {
        return Err(bad("background needs store: true", "store"));
    };
    let stream = p.job.stream;
    let shell = response_object(
        &ids.0,
        ids.2,
        (&p.job.model, p.job.prompt.len()),
        &p.echoed,
        "queued",
        vec![],
        None,
    );
    let events = response_events(st.clone(), p, ids.clone(), true).await?;
    let bg = Arc::new(Background::new());
    keep.start(&shell, bg.clone());
    let task = tokio::spawn(run_background(st.clone(), bg.clone(), ids.0, events));
    *bg.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
    if stream {
        Ok(sse(bg.follow(0).map(Ev::sse)))
    } else {
        Ok(Json(shell).into_response())
    }
}

/// A response object's `status` (from its kept text).
fn status_of(response: &str) -> String {
    serde_json::from_str::<Value>(response)
        .ok()
        .and_then(|r| r["status"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// `GET /v1/responses/{id}`: a kept response; a background one as it is now (`queued`,
/// `in_progress`, then `completed`, `incomplete`, `failed` or `cancelled`). With
/// `stream=true`, a background response's events (`starting_after=N`: those after
/// sequence number N), then the ones still to come.
pub async fn get_response(
    State(st): State<Arc<ServerState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> Response {
    let streamed = match q.get("stream").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return ApiError::bad(format!("stream {v:?}: expected true or false"))
                .param("stream")
                .into_response()
        }
    };
    let store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = store.get(&id) else {
        return not_kept(&id).into_response();
    };
    if !streamed {
        return json_text(s.response.to_string());
    }
    let Some(bg) = s.bg.clone() else {
        return ApiError::bad(format!(
            "response {id:?} was not made in the background: only a background response's events are kept to stream again"
        ))
        .param("stream")
        .into_response();
    };
    drop(store);
    let from = match q.get("starting_after").map(|n| n.parse::<usize>()) {
        None => 0,
        Some(Ok(n)) => n.saturating_add(1),
        Some(Err(_)) => {
            return ApiError::bad("starting_after must be a sequence number (0 or more)")
                .param("starting_after")
                .into_response()
        }
    };
    sse(bg.follow(from).map(Ev::sse))
}

/// `POST /v1/responses/{id}/cancel`: stops a background response that is queued or in
/// progress (its request leaves the engine at once) and answers it, `cancelled`; a
/// response already cancelled is answered as it is. Other responses cannot be cancelled.
pub async fn cancel_response(
    State(st): State<Arc<ServerState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let mut store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
    let Some(bg) = store.get(&id).map(|s| s.bg.clone()) else {
        return not_kept(&id).into_response();
    };
    let Some(bg) = bg else {
        return ApiError::bad(format!(
            "response {id:?} was not made in the background: only a background response can be cancelled"
        ))
        .into_response();
    };
    match bg.transition(BgState::running, BgState::Cancelled) {
        BgState::Queued | BgState::InProgress => {
            store.update(&id, |r| r["status"] = json!("cancelled"));
        }
        BgState::Cancelled => {}
        BgState::Done | BgState::Failed => {
            let status = store.get(&id).map(|s| status_of(&s.response));
            return ApiError::bad(format!(
                "response {id:?} has ended ({}): only a queued or in-progress response can be cancelled",
                status.unwrap_or_default()
            ))
            .into_response();
        }
    }
    let text = store.get(&id).map(|s| s.response.to_string());
    drop(store);
    bg.stop();
    json_text(text.unwrap_or_default())
}

/// `GET /v1/responses/{id}/input_items`: the items given as a kept response's input, in
/// order (OpenAI's list shape; `order=desc`, its default, newest first).
pub async fn input_items(
    State(st): State<Arc<ServerState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> Response {
    let store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = store.get(&id) else {
        return not_kept(&id).into_response();
    };
    let (text, input_from, outputs) = (s.items.clone(), s.input_from, s.outputs);
    drop(store);
    let items = parse_items(&text);
    let data: Vec<Value> = items
        .iter()
        .skip(input_from)
        .take(items.len().saturating_sub(input_from + outputs))
        .enumerate()
        .map(|(i, item)| input_item(&id, i, item))
        .collect();
    match crate::items::page(data, &q, &format!("{id:?}")) {
        Ok(list) => Json(list).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Input item `i` of response `id` as OpenAI lists it: an `id` (the item's own, else one
/// made from the response's and the index), a `type`, a `status`; a message's content as
/// parts (`input_text`, an assistant's `output_text`) where it was a string.
fn input_item(id: &str, i: usize, item: &Value) -> Value {
    let stem = id.strip_prefix("resp_").unwrap_or(id);
    crate::items::listed(item, |prefix| format!("{prefix}_{stem}_{i}"))
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete_response(
    State(st): State<Arc<ServerState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let mut store = st.responses.lock().unwrap_or_else(|e| e.into_inner());
    let bg = store.get(&id).and_then(|s| s.bg.clone());
    if store.remove(&id) {
        drop(store);
        // a background response still running stops with it
        if let Some(bg) = bg {
            if bg
                .transition(BgState::running, BgState::Cancelled)
                .running()
            {
                bg.stop();
            }
        }
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_kept(&id).into_response()
    }
}

fn output_len(response: &Value) -> usize {
    response["output"].as_array().map_or(0, Vec::len)
}

fn not_kept(id: &str) -> ApiError {
    ApiError::not_found(format!("no stored response {id:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_drops_the_oldest_past_its_count_or_bytes() {
        let mut s = ResponseStore::default();
        for i in 0..STORE_ENTRIES + 3 {
            s.put(format!("r{i}"), vec![json!({"i": i})], 0, json!({"id": i}));
        }
        assert_eq!(s.0.len(), STORE_ENTRIES);
        assert!(s.get("r0").is_none() && s.get("r2").is_none());
        assert!(s.get("r3").is_some() && s.get(&format!("r{}", STORE_ENTRIES + 2)).is_some());
        // kept as their JSON text, which is what they cost
        let cost = |s: &ResponseStore| -> usize {
            s.0.entries()
                .map(|(_, v, b)| {
                    assert_eq!(b, v.items.len() + v.response.len());
                    b
                })
                .sum()
        };
        assert_eq!(s.0.bytes(), cost(&s));
        let r3 = s.get("r3").unwrap();
        assert_eq!(parse_items(&r3.items), vec![json!({"i": 3})]);
        assert_eq!(&*r3.response, r#"{"id":3}"#);
        // one large entry pushes out as many as its bytes need
        let big = "x".repeat(STORE_BYTES / 2);
        s.put("big".into(), vec![json!(big)], 0, json!({}));
        s.put("big2".into(), vec![json!(big)], 0, json!({}));
        assert!(s.0.bytes() <= STORE_BYTES);
        assert!(s.get("big").is_none() && s.get("big2").is_some());
        // an entry over the whole budget is not kept
        s.put(
            "huge".into(),
            vec![json!("x".repeat(STORE_BYTES))],
            0,
            json!({}),
        );
        assert!(s.get("huge").is_none());
        assert!(s.remove("big2") && !s.remove("big2"));
        assert_eq!(s.0.bytes(), cost(&s));
    }
}
