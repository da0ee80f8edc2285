//! OpenAI's stored chat completions: `store: true` on `/v1/chat/completions` keeps the
//! completion (with the request's `metadata`) and the request's messages, streamed or not,
//! for `GET /v1/chat/completions` (a page of them, filtered by `model` and `metadata[KEY]`),
//! `GET`, `POST` (new `metadata`) and `DELETE /v1/chat/completions/{id}`, and `GET
//! /v1/chat/completions/{id}/messages` (what the OpenAI client's `chat.completions.retrieve`,
//! `list`, `update`, `delete` and `messages.list` call). Kept in memory, as the Responses
//! API's responses are: the last [`CHAT_ENTRIES`], at most [`CHAT_BYTES`] of JSON text, the
//! oldest dropped first; gone when the server stops.

use crate::api::{parse, ApiError};
use crate::kept::Kept;
use crate::ServerState;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::Arc;

/// Most completions kept.
pub(crate) const CHAT_ENTRIES: usize = 1024;
/// Most bytes of JSON kept (completions and messages together); a completion over it alone
/// is not kept.
pub(crate) const CHAT_BYTES: usize = 64 << 20;

/// A kept completion and the messages it answered, as JSON text.
struct StoredChat {
    completion: Box<str>,
    messages: Box<str>,
}

/// The stored chat completions.
pub(crate) struct ChatStore(Kept<StoredChat>);

impl Default for ChatStore {
    fn default() -> Self {
        ChatStore(Kept::new(CHAT_ENTRIES, CHAT_BYTES))
    }
}

impl ChatStore {
    fn put(&mut self, id: String, completion: &Value, messages: &str) {
        let completion = completion.to_string().into_boxed_str();
        let bytes = completion.len() + messages.len();
        let kept = StoredChat {
            completion,
            messages: messages.into(),
        };
        self.0.insert(id, kept, bytes, |_, _| false);
    }

    fn completion(&self, id: &str) -> Option<Value> {
        serde_json::from_str(&self.0.get(id)?.completion).ok()
    }
}

fn lock(st: &ServerState) -> std::sync::MutexGuard<'_, ChatStore> {
    st.chat_store.lock().unwrap_or_else(|e| e.into_inner())
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no stored chat completion {id:?}")).param("completion_id")
}

/// `POST /v1/chat/completions`: the chat endpoint ([`crate::api::chat`]), its completion kept
/// where the request says `store: true`.
pub async fn chat(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    match request(&st, &body) {
        Ok(keep) => {
            let r = crate::api::chat(State(st), body).await;
            match keep {
                Some(k) => k.answer(r).await,
                None => r,
            }
        }
        Err(e) => crate::api::finish(&st, Err(e)),
    }
}

/// What `store: true` keeps of a request beside its completion.
pub(crate) struct Keep {
    st: Arc<ServerState>,
    messages: String,
    metadata: Value,
}

#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    store: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
}

/// A chat body's `store` (a boolean) and `metadata` (OpenAI's limits, checked whether kept or
/// not): what to keep, where `store` is true.
pub(crate) fn request(st: &Arc<ServerState>, body: &[u8]) -> Result<Option<Keep>, ApiError> {
    let f: Fields = parse(body)?;
    let metadata = crate::items::metadata(f.metadata.as_ref())?;
    match f.store {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) => Ok(Some(Keep {
            st: st.clone(),
            messages: f.messages.unwrap_or(Value::Null).to_string(),
            metadata,
        })),
        Some(v) => Err(ApiError::bad(format!("store {v} must be a boolean")).param("store")),
    }
}

impl Keep {
    /// Keeps the completion `r` answers (a whole one, or the one its chunks add up to once
    /// the stream ends with `[DONE]`) and passes `r` on unchanged; an error is not kept.
    pub(crate) async fn answer(self, r: Response) -> Response {
        if !r.status().is_success() {
            return r;
        }
        let streamed = r
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let (parts, body) = r.into_parts();
        if streamed {
            let mut chunks = Chunks::default();
            let mut keep = Some(self);
            let body = body.into_data_stream().map(move |frame| {
                if let (Ok(bytes), Some(_)) = (&frame, &keep) {
                    if chunks.feed(bytes) {
                        if let (Some(k), Some(c)) = (keep.take(), chunks.completion()) {
                            k.keep(c);
                        }
                    }
                }
                frame
            });
            return Response::from_parts(parts, Body::from_stream(body));
        }
        // (held already: a reply that is not streamed is bounded by --max-reply)
        let bytes = match axum::body::to_bytes(body, usize::MAX).await {
            Ok(b) => b,
            Err(e) => return ApiError::server(e.to_string()).into_response(),
        };
        if let Ok(c) = serde_json::from_slice::<Value>(&bytes) {
            self.keep(c);
        }
        Response::from_parts(parts, Body::from(bytes))
    }

    fn keep(self, mut completion: Value) {
        let Some(id) = completion["id"].as_str().map(str::to_string) else {
            return;
        };
        completion["metadata"] = self.metadata;
        lock(&self.st).put(id, &completion, &self.messages);
    }
}

/// A chat completion's stream, added up as it passes (OpenAI's chunks: each choice's `delta`
/// by `index`, tool calls by their `index`, the usage chunk), until `[DONE]`.
#[derive(Default)]
struct Chunks {
    /// Bytes of an event not ended yet.
    pending: Vec<u8>,
    /// Bytes of events read (past [`CHAT_BYTES`] the completion is not kept).
    read: usize,
    head: Option<Value>,
    choices: std::collections::BTreeMap<u64, Value>,
    usage: Option<Value>,
    done: bool,
}

impl Chunks {
    /// Reads `bytes` of the stream; true once `[DONE]` came.
    fn feed(&mut self, bytes: &Bytes) -> bool {
        self.read += bytes.len();
        if self.read > CHAT_BYTES {
            // too big to keep: stop adding up
            self.pending.clear();
            return false;
        }
        self.pending.extend_from_slice(bytes);
        while let Some(at) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..at + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                match line.strip_prefix("data: ").or(line.strip_prefix("data:")) {
                    Some("[DONE]") => self.done = true,
                    Some(data) => {
                        if let Ok(v) = serde_json::from_str::<Value>(data) {
                            self.chunk(v);
                        }
                    }
                    None => {}
                }
            }
        }
        self.done
    }

    fn chunk(&mut self, v: Value) {
        if v.get("error").is_some() {
            return;
        }
        if self.head.is_none() {
            self.head = Some(json!({
                "id": v["id"], "object": "chat.completion", "created": v["created"],
                "model": v["model"], "system_fingerprint": v["system_fingerprint"],
            }));
        }
        if !v["usage"].is_null() {
            self.usage = Some(v["usage"].clone());
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let index = c["index"].as_u64().unwrap_or(0);
            let choice = self.choices.entry(index).or_insert_with(|| {
                json!({"index": index, "message": {"role": "assistant", "content": null},
                       "logprobs": null, "finish_reason": null})
            });
            let d = &c["delta"];
            let m = &mut choice["message"];
            if let Some(role) = d["role"].as_str() {
                m["role"] = json!(role);
            }
            for field in ["content", "reasoning_content", "refusal"] {
                append(&mut m[field], &d[field]);
            }
            for call in d["tool_calls"].as_array().into_iter().flatten() {
                add_call(m, call);
            }
            if let Some(lp) = c["logprobs"]["content"].as_array() {
                if choice["logprobs"].is_null() {
                    choice["logprobs"] = json!({"content": [], "refusal": null});
                }
                if let Some(all) = choice["logprobs"]["content"].as_array_mut() {
                    all.extend(lp.iter().cloned());
                }
            }
            if !c["finish_reason"].is_null() {
                choice["finish_reason"] = c["finish_reason"].clone();
            }
        }
    }

    /// The completion the chunks add up to.
    fn completion(&mut self) -> Option<Value> {
        let mut c = self.head.take()?;
        c["choices"] = Value::Array(std::mem::take(&mut self.choices).into_values().collect());
        if let Some(u) = self.usage.take() {
            c["usage"] = u;
        }
        Some(c)
    }
}

/// Adds a streamed tool call's piece to the message's calls (by its `index`: the id, type and
/// name where given, the arguments' text appended).
fn add_call(m: &mut Value, call: &Value) {
    let index = call["index"].as_u64().unwrap_or(0) as usize;
    if !m["tool_calls"].is_array() {
        m["tool_calls"] = json!([]);
    }
    let Some(calls) = m["tool_calls"].as_array_mut() else {
        return;
    };
    // (a piece whose index skips ahead is taken as the next call)
    if index >= calls.len() {
        calls
            .push(json!({"id": "", "type": "function", "function": {"name": "", "arguments": ""}}));
    }
    let at = index.min(calls.len() - 1);
    let slot = &mut calls[at];
    if let Some(id) = call["id"].as_str() {
        slot["id"] = json!(id);
    }
    if let Some(t) = call["type"].as_str() {
        slot["type"] = json!(t);
    }
    for field in ["name", "arguments"] {
        append(&mut slot["function"][field], &call["function"][field]);
    }
}

/// A streamed text's piece `piece` (where it is a string) added to the text so far at `to`
/// (`null`: none yet).
fn append(to: &mut Value, piece: &Value) {
    if let Some(t) = piece.as_str() {
        let text = format!("{}{t}", to.as_str().unwrap_or_default());
        *to = Value::String(text);
    }
}

/// `GET /v1/chat/completions`: a page of the stored completions, oldest first (`order`:
/// `asc`, the default, or `desc`; `after` an id; `limit` 1 to 100, 20), those of `model` and
/// with every `metadata[KEY]=VALUE` asked for.
pub async fn list(
    State(st): State<Arc<ServerState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let r = list_page(&st, q);
    crate::api::finish(&st, r)
}

/// The page [`list`] answers.
fn list_page(st: &ServerState, q: HashMap<String, String>) -> Result<Response, ApiError> {
    let wanted: Vec<(&str, &str)> = q
        .iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix("metadata[")?.strip_suffix(']')?;
            Some((key, v.as_str()))
        })
        .collect();
    let model = q.get("model").map(String::as_str);
    let store = lock(st);
    let all: Vec<Value> = store
        .0
        .ids()
        .filter_map(|id| store.completion(id))
        .filter(|c| model.is_none_or(|m| c["model"] == m))
        .filter(|c| wanted.iter().all(|(k, v)| c["metadata"][*k] == *v))
        .collect();
    drop(store);
    let mut q = q;
    q.entry("order".into()).or_insert_with(|| "asc".into());
    let page = crate::items::page(all, &q, "the stored chat completions")?;
    Ok(Json(page).into_response())
}

/// `GET /v1/chat/completions/{id}`.
pub async fn retrieve(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    match lock(&st).completion(&id) {
        Some(c) => Json(c).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `POST /v1/chat/completions/{id}`: new `metadata` (the only field that changes).
pub async fn update(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let r = (|| {
        let metadata = crate::items::metadata_update(&body)?;
        let mut store = lock(&st);
        let done = store.0.update(&id, |s, cost| {
            crate::kept::edit_json(&mut s.completion, cost, |c| c["metadata"] = metadata)
        });
        // (the size changed a little: the others make room)
        store.0.make_room(0, 0, |_, _| false);
        match done.flatten() {
            Some(c) => Ok(Json(c).into_response()),
            None => Err(not_found(&id)),
        }
    })();
    crate::api::finish(&st, r)
}

/// `DELETE /v1/chat/completions/{id}`.
pub async fn delete(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    if lock(&st).0.remove(&id).is_some() {
        Json(json!({"object": "chat.completion.deleted", "id": id, "deleted": true}))
            .into_response()
    } else {
        not_found(&id).into_response()
    }
}

/// `GET /v1/chat/completions/{id}/messages`: a page of the messages the completion answered
/// (oldest first by default), each with an id (`{id}-{n}`), its text as `content` and its
/// parts, where it had parts, as `content_parts`.
pub async fn messages(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let r = (|| {
        let text = {
            let store = lock(&st);
            let s = store.0.get(&id).ok_or_else(|| not_found(&id))?;
            s.messages.to_string()
        };
        let list: Vec<Value> = serde_json::from_str(&text).unwrap_or_default();
        let listed = list
            .into_iter()
            .enumerate()
            .map(|(i, m)| listed_message(&id, i, m))
            .collect();
        let mut q = q.clone();
        q.entry("order".into()).or_insert_with(|| "asc".into());
        let what = format!("chat completion {id:?}'s messages");
        crate::items::page(listed, &q, &what).map(|l| Json(l).into_response())
    })();
    crate::api::finish(&st, r)
}

/// A request message as OpenAI lists a stored one.
fn listed_message(id: &str, i: usize, m: Value) -> Value {
    let mut o = match m {
        Value::Object(o) => o,
        other => {
            let mut o = Map::new();
            o.insert("content".into(), other);
            o
        }
    };
    let parts = match o.get("content") {
        Some(Value::Array(parts)) => Some(Value::Array(parts.clone())),
        _ => None,
    };
    if let Some(Value::Array(p)) = &parts {
        let text: String = p.iter().filter_map(|x| x["text"].as_str()).collect();
        o.insert("content".into(), json!(text));
    }
    o.insert("content_parts".into(), parts.unwrap_or(Value::Null));
    o.insert("id".into(), json!(format!("{id}-{i}")));
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(v: Value) -> Bytes {
        Bytes::from(format!("data: {v}\n\n"))
    }

    #[test]
    fn chunks_add_up_to_the_completion() {
        let mut c = Chunks::default();
        let head = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                          "model": "m", "system_fingerprint": "fp"});
        let with = |choices: Value| {
            let mut v = head.clone();
            v["choices"] = choices;
            event(v)
        };
        // an event split across frames, two choices interleaved, a call in pieces
        let first = with(json!([{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]));
        let (a, b) = first.split_at(10);
        assert!(!c.feed(&Bytes::copy_from_slice(a)));
        assert!(!c.feed(&Bytes::copy_from_slice(b)));
        c.feed(&with(
            json!([{"index": 1, "delta": {"content": "Hi"}, "finish_reason": "length"}]),
        ));
        c.feed(&with(json!([{"index": 0, "delta": {"content": "lo",
            "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "f", "arguments": "{\"a\""}}]}}])));
        c.feed(&with(json!([{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
            "finish_reason": "tool_calls"}])));
        let mut usage = head.clone();
        usage["choices"] = json!([]);
        usage["usage"] = json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7});
        c.feed(&event(usage));
        assert!(c.feed(&Bytes::from_static(b"data: [DONE]\n\n")));
        let done = c.completion().unwrap();
        assert_eq!(done["id"], "chatcmpl-1");
        assert_eq!(done["object"], "chat.completion");
        let m0 = &done["choices"][0]["message"];
        assert_eq!(m0["content"], "Hello");
        assert_eq!(m0["tool_calls"][0]["id"], "call_1");
        assert_eq!(m0["tool_calls"][0]["function"]["arguments"], "{\"a\": 1}");
        assert_eq!(done["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(done["choices"][1]["message"]["content"], "Hi");
        assert_eq!(done["choices"][1]["finish_reason"], "length");
        assert_eq!(done["usage"]["total_tokens"], 7);
    }

    #[test]
    fn messages_are_listed_with_ids_and_their_parts() {
        let m = listed_message(
            "c",
            1,
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        );
        assert_eq!(m["id"], "c-1");
        assert_eq!(m["content"], "ab");
        assert_eq!(m["content_parts"][1]["text"], "b");
        let plain = listed_message("c", 0, json!({"role": "system", "content": "x"}));
        assert_eq!(plain["content_parts"], Value::Null);
    }
}
