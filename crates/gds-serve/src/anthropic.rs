//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API,
//! served by the chat path (what coding agents speak to local servers).
//!
//! A request is rewritten into the chat form — `system` becomes a system message, text
//! blocks a message's content, an assistant's `tool_use` blocks its tool calls, a user's
//! `tool_result` blocks tool messages, tools (`name`, `description`, `input_schema`) chat's
//! function tools, `tool_choice` (`auto`, `any`, `tool`, `none`) chat's, `stop_sequences`
//! stop strings — and runs as one chat job: the same template, tokenizer guards, limits,
//! tool parsing, grammar and scheduler. A final assistant message is the start of the reply
//! (a prefill): the template's conversation is cut right after its text and the reply
//! continues it. The answer is a `message` whose `content` holds a `text` block and/or
//! `tool_use` blocks and whose `stop_reason` is `end_turn`, `max_tokens`, `stop_sequence`
//! (with the string) or `tool_use`; streamed, Anthropic's event sequence (`message_start`,
//! `content_block_start`, `ping`, `content_block_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`; `error` on a failure after the start).
//!
//! Errors on these paths have Anthropic's shape (`{"type": "error", "error": {"type",
//! "message"}}`), rewritten from the shared error by [`anthropic_errors`], so the limits
//! (body size, API key — `x-api-key` is accepted as well as a bearer token — queue) are the
//! same as every other endpoint's. `output_config.format` (a JSON schema) constrains the
//! reply like chat's `response_format`. The sampling fields the Messages API dropped
//! (`temperature`, `top_p`, `top_k`) are still taken. Image and document blocks, server tools
//! and stored prompts are refused (400 naming the field); `thinking`, `metadata` and
//! `output_config.effort` are accepted and ignored.

use crate::api::{
    chat_prompt, constrain, finish, job, parse, random_seed, sse, submit, ApiError, ChatBody,
    ChatMessage, Common, End, Gen, Job, Kind, Piece, Stop,
};
use crate::error::bad;
use crate::reasoning::Split;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;

/// The Messages API's own fields (the sampling fields it shares with chat —
/// `temperature`, `top_p`, `top_k`, `stream`, `model` — are read as [`Common`]).
#[derive(Deserialize, Debug)]
struct MessagesBody {
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    stop_sequences: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema": {...}}}` (structured output; `effort`
    /// is ignored).
    #[serde(default)]
    output_config: Option<Value>,
    /// `{"type": "enabled" | "adaptive" | "disabled", ...}`: the template's `enable_thinking`.
    #[serde(default)]
    thinking: Option<Value>,
}

/// The text of a `system` value or a `tool_result`'s `content`: a string, or `text` blocks.
fn blocks_text(v: Option<&Value>, param: &'static str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(
                        b.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("a text block needs a \"text\" string", param))?,
                    ),
                    other => {
                        return Err(bad(
                            format!(
                                "blocks of type {:?} are not supported here (text only)",
                                other.unwrap_or("")
                            ),
                            param,
                        ))
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        Some(_) => Err(bad("must be a string or a list of text blocks", param)),
    }
}

/// Appends a text message, joined to the previous one when it is a plain message of the
/// same role (the Messages API combines consecutive turns of one role; many chat templates
/// require roles to alternate).
fn push_text(out: &mut Vec<ChatMessage>, role: &str, text: String) {
    if let Some(prev) = out.last_mut() {
        if prev.role == role && prev.tool_calls.is_none() && prev.tool_call_id.is_none() {
            if let Some(Value::String(s)) = &mut prev.content {
                if !s.is_empty() && !text.is_empty() {
                    s.push_str("\n\n");
                }
                s.push_str(&text);
                return;
            }
        }
    }
    out.push(ChatMessage::text(role, text));
}

/// `system` and `messages` as chat messages, and whether the last one is an assistant's
/// reply to continue (a prefill).
fn chat_messages(
    system: Option<&Value>,
    messages: &Value,
) -> Result<(Vec<ChatMessage>, bool), ApiError> {
    let mut out = Vec::new();
    let system = blocks_text(system, "system")?;
    if !system.is_empty() {
        out.push(ChatMessage::text("system", system));
    }
    let list = messages
        .as_array()
        .filter(|l| !l.is_empty())
        .ok_or_else(|| bad("must be a non-empty list of messages", "messages"))?;
    for m in list {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            Some("system") => {
                return Err(bad(
                    "unexpected role \"system\": the Messages API takes the system prompt as the top-level `system` field",
                    "messages",
                ))
            }
            other => {
                return Err(bad(
                    format!("role {other:?} must be \"user\" or \"assistant\""),
                    "messages",
                ))
            }
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                push_text(&mut out, role, s.clone());
                continue;
            }
            Some(Value::Array(b)) => b,
            _ => {
                return Err(bad(
                    "content must be a string or a list of content blocks",
                    "messages",
                ))
            }
        };
        // the blocks in order: text gathered until a tool block, tool calls of one reply
        // into one assistant message, each tool result its own tool message
        let mut text: Vec<&str> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        let mut thinking: Vec<&str> = Vec::new();
        for b in blocks {
            let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
            let field = |name: &str| {
                b.get(name)
                    .ok_or_else(|| bad(format!("a {kind} block needs \"{name}\""), "messages"))
            };
            match (kind, role) {
                ("text", _) => text.push(
                    field("text")?
                        .as_str()
                        .ok_or_else(|| bad("a text block's text must be a string", "messages"))?,
                ),
                // earlier replies' reasoning: the templates that render it take it as
                // `reasoning_content` (redacted thinking is opaque: left out)
                ("thinking", "assistant") => thinking.push(
                    field("thinking")?
                        .as_str()
                        .ok_or_else(|| bad("a thinking block's thinking must be a string", "messages"))?,
                ),
                ("redacted_thinking", "assistant") => {}
                ("tool_use", "assistant") => {
                    let id = field("id")?.as_str().unwrap_or_default().to_string();
                    let name = field("name")?.clone();
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    if !input.is_object() {
                        return Err(bad("a tool_use block's input must be an object", "messages"));
                    }
                    calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
                }
                ("tool_result", "user") => {
                    if !text.is_empty() {
                        push_text(&mut out, role, text.join("\n"));
                        text.clear();
                    }
                    let id = field("tool_use_id")?
                        .as_str()
                        .ok_or_else(|| bad("tool_use_id must be a string", "messages"))?;
                    let mut result = blocks_text(b.get("content"), "messages")?;
                    if b.get("is_error") == Some(&Value::Bool(true)) {
                        result.insert_str(0, "Error: ");
                    }
                    out.push(ChatMessage::tool_result(id.to_string(), result));
                }
                ("tool_use", _) | ("tool_result", _) | ("thinking" | "redacted_thinking", _) => {
                    return Err(bad(
                        format!("{kind} blocks belong in {} messages", if kind == "tool_result" { "user" } else { "assistant" }),
                        "messages",
                    ))
                }
                _ => {
                    return Err(bad(
                        format!("content blocks of type {kind:?} are not supported (text, tool_use, tool_result)"),
                        "messages",
                    ))
                }
            }
        }
        if calls.is_empty() {
            if !text.is_empty() || !thinking.is_empty() {
                push_text(&mut out, role, text.join("\n"));
            }
        } else {
            out.push(ChatMessage {
                role: role.into(),
                content: Some(Value::String(text.join("\n"))),
                tool_calls: Some(Value::Array(calls)),
                tool_call_id: None,
                reasoning_content: None,
            });
        }
        if !thinking.is_empty() {
            if let Some(m) = out.last_mut() {
                m.reasoning_content = Some(thinking.join("\n"));
            }
        }
    }
    let prefill = match out.last() {
        Some(m) if m.role == "assistant" => {
            let text = m.content.as_ref().and_then(Value::as_str).unwrap_or("");
            if m.tool_calls.is_some() || text.is_empty() {
                return Err(bad(
                    "the last message must be the user's, or an assistant's text for the reply to continue",
                    "messages",
                ));
            }
            if text.ends_with(char::is_whitespace) {
                return Err(bad(
                    "the final assistant content cannot end with trailing whitespace",
                    "messages",
                ));
            }
            true
        }
        Some(_) => false,
        None => return Err(bad("must not be empty", "messages")),
    };
    Ok((out, prefill))
}

/// Tools (`{"name", "description", "input_schema"}`, `type` absent or `"custom"`) in
/// chat's form.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| bad("must be a list of tools", "tools"))?;
    let mut out = Vec::new();
    for t in list {
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(bad(
                    format!(
                    "tools of type {other:?} (server tools) are not supported: custom tools only"
                ),
                    "tools",
                ))
            }
        }
        let mut f = serde_json::Map::new();
        f.insert("name".into(), t.get("name").cloned().unwrap_or(Value::Null));
        if let Some(d) = t.get("description") {
            f.insert("description".into(), d.clone());
        }
        match t.get("input_schema") {
            Some(s @ Value::Object(_)) => {
                f.insert("parameters".into(), s.clone());
            }
            _ => return Err(bad("each tool needs an input_schema object", "tools")),
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice` in chat's form, and whether parallel calls are allowed.
fn chat_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let Some(c) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    let parallel = match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(d)) => Some(!d),
        Some(_) => {
            return Err(bad(
                "disable_parallel_tool_use must be a boolean",
                "tool_choice",
            ))
        }
    };
    let chat = match c.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match c.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => return Err(bad("{\"type\": \"tool\"} needs a \"name\"", "tool_choice")),
        },
        _ => {
            return Err(bad(
                "must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                "tool_choice",
            ))
        }
    };
    Ok((Some(chat), parallel))
}

/// The request as a chat body and the shared fields; `max_tokens` is required by the
/// Messages API (not by token counting).
fn chat_request(body: &Bytes, counting: bool) -> Result<(ChatBody, Common), ApiError> {
    let m: MessagesBody = parse(body)?;
    let mut common: Common = parse(body)?;
    let messages = m
        .messages
        .as_ref()
        .ok_or_else(|| bad("field required", "messages"))?;
    let (messages, prefill) = chat_messages(m.system.as_ref(), messages)?;
    let (tool_choice, parallel) = chat_tool_choice(m.tool_choice.as_ref())?;
    let chat = ChatBody {
        messages,
        tools: m.tools.as_ref().map(chat_tools).transpose()?,
        tool_choice,
        parallel_tool_calls: parallel,
        continue_final_message: Some(prefill),
        add_generation_prompt: None,
        documents: None,
        chat_template: None,
        chat_template_kwargs: match m.thinking.as_ref() {
            None | Some(Value::Null) => None,
            Some(t) => match t.get("type").and_then(Value::as_str) {
                Some("enabled" | "adaptive") => Some(json!({"enable_thinking": true})),
                Some("disabled") => Some(json!({"enable_thinking": false})),
                _ => {
                    return Err(bad(
                        "thinking.type must be enabled, adaptive or disabled",
                        "thinking",
                    ))
                }
            },
        },
        reasoning_format: None,
        reasoning_effort: None,
        drop_oldest: false,
    };
    if !counting && common.max_tokens.is_none() {
        return Err(bad("field required", "max_tokens"));
    }
    // chat's fields the Messages API does not have: refused where its reply has no place
    // for what they ask; the sampling ones (penalties, logit_bias, as top_k, min_p and
    // repeat_penalty) are honoured as on the chat endpoint, as llama-server does
    common.refuse_chat_only("the Messages API (/v1/messages)")?;
    common.stream_options = None;
    common.response_format = match m.output_config.as_ref().and_then(|c| c.get("format")) {
        None | Some(Value::Null) => None,
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => {
            let schema = f.get("schema").filter(|s| s.is_object()).ok_or_else(|| {
                bad(
                    "format.schema must be a JSON schema object",
                    "output_config",
                )
            })?;
            Some(
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
            )
        }
        Some(_) => {
            return Err(bad(
                "format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                "output_config",
            ))
        }
    };
    common.stop = match &m.stop_sequences {
        None | Some(Value::Null) => None,
        Some(Value::Array(v)) => Some(Stop::Many(
            v.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("must be a list of strings", "stop_sequences"))?,
        )),
        Some(_) => return Err(bad("must be a list of strings", "stop_sequences")),
    };
    Ok((chat, common))
}

/// A chat tool call (`{"id", "function": {"name", "arguments"}}`) as a `tool_use` block.
fn tool_use_block(call: &Value) -> Value {
    let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
    let input = call
        .pointer("/function/arguments")
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    json!({
        "type": "tool_use",
        "id": format!("toolu_{}", id.trim_start_matches("call_")),
        "name": call.pointer("/function/name"),
        "input": input,
    })
}

/// `stop_reason` and `stop_sequence`.
fn stop_reason(end: &End, calls: bool) -> (&'static str, Option<String>) {
    if calls && end.finish != "length" {
        ("tool_use", None)
    } else if let Some(s) = &end.stop {
        ("stop_sequence", Some(s.clone()))
    } else if end.finish == "length" {
        ("max_tokens", None)
    } else {
        ("end_turn", None)
    }
}

/// `usage`: input tokens read from the prompt cache are counted apart, as Anthropic does
/// (the prompt is `input_tokens + cache_read_input_tokens`).
fn usage(prompt: usize, end: Option<&End>) -> Value {
    let cached = end
        .and_then(|e| e.done.as_ref())
        .map_or(0, |d| d.cached_tokens);
    usage_of(prompt, cached, end.map_or(0, |e| e.completion_tokens))
}

/// [`usage`] of a prompt of which `cached` tokens came from the cache, and `output` tokens.
fn usage_of(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt - cached.min(prompt),
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    })
}

async fn messages_job(st: &Arc<ServerState>, body: &Bytes) -> Result<Job, ApiError> {
    let (chat, common) = chat_request(body, false)?;
    let (prompt, tools, own) = chat_prompt(st, &chat).await?;
    let reasoning = crate::api::reasoning_of(st, own.as_deref(), None, &prompt)?;
    let mut j = job(st, common, prompt, usize::MAX, Kind::Chat)?;
    crate::api::with_tools(&mut j, tools)?;
    crate::api::with_reasoning(st, &mut j, reasoning);
    Ok(j)
}

/// `POST /v1/messages`.
pub async fn messages(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let job = messages_job(&st, &body).await?;
        let id = format!(
            "msg_{:024x}",
            u128::from(random_seed()) << 32 | u128::from(random_seed() as u32)
        );
        if job.stream {
            return stream_message(st.clone(), job, id).await;
        }
        let (choice, end) = crate::api::complete(&st, &job, Kind::Chat, 0).await?;
        let m = &choice["message"];
        let mut content = Vec::new();
        if let Some(r) = m["reasoning_content"].as_str() {
            content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
        }
        if let Some(text) = m["content"].as_str().filter(|t| !t.is_empty()) {
            content.push(json!({"type": "text", "text": text}));
        }
        let calls = m["tool_calls"].as_array().cloned().unwrap_or_default();
        content.extend(calls.iter().map(tool_use_block));
        let (reason, sequence) = stop_reason(&end, !calls.is_empty());
        Ok(Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": job.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(job.prompt.len(), Some(&end)),
        }))
        .into_response())
    }
    .await;
    finish(&st, r)
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would run it.
pub async fn count_tokens(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let (chat, _) = chat_request(&body, true)?;
        let (prompt, ..) = chat_prompt(&st, &chat).await?;
        Ok(Json(json!({ "input_tokens": prompt.len() })).into_response())
    }
    .await;
    finish(&st, r)
}

fn event(kind: &str, mut data: Value) -> SseEvent {
    data["type"] = json!(kind);
    SseEvent::default().event(kind).data(data.to_string())
}

/// The stream's state: the generator, text held back (with tools: a call may be
/// starting), `stream_cut`'s memory, whether a call started, whether the text block is
/// open, and the next block's index.
struct Streaming {
    /// The `message_start` event's body, until it goes out (with the first piece).
    start: Option<Value>,
    gen: Gen,
    held: String,
    plain: bool,
    calling: bool,
    text_open: bool,
    index: usize,
    /// A thinking template's reply: its reasoning goes out first, as a `thinking` block.
    split: Option<Split>,
    thinking_open: bool,
}

impl Streaming {
    /// Splits `t` ([`Split::push`]): the reasoning goes out as `thinking_delta`s (the block
    /// closed when the answer starts); the answer is returned.
    fn split(&mut self, t: String, out: &mut Vec<SseEvent>) -> String {
        let Some(sp) = &mut self.split else {
            return t;
        };
        let (r, answer) = sp.push(&t);
        self.thinking(r, out);
        if !answer.is_empty() {
            self.close_thinking(out);
        }
        answer
    }

    /// The reply's end: what the split held back.
    fn split_end(&mut self, rest: String, out: &mut Vec<SseEvent>) -> String {
        let Some(sp) = &mut self.split else {
            return rest;
        };
        let (r, answer) = sp.end(&rest);
        self.thinking(r, out);
        self.close_thinking(out);
        answer
    }

    fn thinking(&mut self, t: String, out: &mut Vec<SseEvent>) {
        if t.is_empty() {
            return;
        }
        if !self.thinking_open {
            out.push(event(
                "content_block_start",
                json!({"index": self.index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            ));
            self.thinking_open = true;
        }
        out.push(event(
            "content_block_delta",
            json!({"index": self.index, "delta": {"type": "thinking_delta", "thinking": t}}),
        ));
    }

    fn close_thinking(&mut self, out: &mut Vec<SseEvent>) {
        if self.thinking_open {
            out.push(event(
                "content_block_delta",
                json!({"index": self.index, "delta": {"type": "signature_delta", "signature": ""}}),
            ));
            out.push(event("content_block_stop", json!({ "index": self.index })));
            self.thinking_open = false;
            // a closed block keeps the next from reopening one
            self.split = None;
            self.index += 1;
        }
    }

    fn text(&mut self, t: String, out: &mut Vec<SseEvent>) {
        if t.is_empty() {
            return;
        }
        if !self.text_open {
            out.push(event(
                "content_block_start",
                json!({"index": self.index, "content_block": {"type": "text", "text": ""}}),
            ));
            self.text_open = true;
        }
        out.push(event(
            "content_block_delta",
            json!({"index": self.index, "delta": {"type": "text_delta", "text": t}}),
        ));
    }

    fn close_text(&mut self, out: &mut Vec<SseEvent>) {
        if self.text_open {
            out.push(event("content_block_stop", json!({ "index": self.index })));
            self.text_open = false;
            self.index += 1;
        }
    }
}

/// The streamed form. Text streams as it comes; with tools, until a call may be starting
/// (`Tools::stream_cut`), the rest is held and sent at the end as text or as `tool_use`
/// blocks (each one `input_json_delta` with the whole input).
async fn stream_message(st: Arc<ServerState>, job: Job, id: String) -> Result<Response, ApiError> {
    let constraint = constrain(&st, &job).await?;
    let submitted = submit(&st, &job, constraint)?;
    let gen = Gen::new(st.clone(), submitted, &job, false);
    let tools = job.tools.clone().filter(|t| t.parses());
    let n_prompt = job.prompt.len();
    // message_start goes out with the first piece, once the engine said how much of the
    // prompt the cache held: its usage is the final split of the input, as Anthropic's
    let start = json!({"message": {
        "id": id, "type": "message", "role": "assistant", "model": job.model,
        "content": [], "stop_reason": null, "stop_sequence": null,
    }});
    let state = Streaming {
        start: Some(start),
        gen,
        held: String::new(),
        plain: false,
        calling: false,
        text_open: false,
        index: 0,
        split: job.reasoning.as_ref().map(Split::new),
        thinking_open: false,
    };
    let body = stream::unfold(Some(state), move |s| {
        let tools = tools.clone();
        async move {
            let mut s = s?;
            let mut out = Vec::new();
            let piece = s.gen.next().await;
            if let Some(mut start) = s.start.take() {
                start["message"]["usage"] = usage_of(n_prompt, s.gen.cached_tokens(), 0);
                out.push(event("message_start", start));
                out.push(event("ping", json!({})));
            }
            match piece {
                Some(Piece::Text(t)) => {
                    let t = s.split(t, &mut out);
                    match tools.as_deref() {
                        Some(tl) => {
                            s.held.push_str(&t);
                            if !s.calling {
                                let (n, starts) = tl.stream_cut(&s.held, &mut s.plain);
                                s.calling = starts;
                                let text: String = s.held.drain(..n).collect();
                                s.text(text, &mut out);
                            }
                        }
                        None => s.text(t, &mut out),
                    }
                    Some((out, Some(s)))
                }
                Some(Piece::End(end)) => {
                    let rest = s.gen.rest().unwrap_or_default();
                    let rest = s.split_end(rest, &mut out);
                    let mut calls = Vec::new();
                    match tools.as_deref() {
                        Some(tl) => {
                            s.held.push_str(&rest);
                            let held = std::mem::take(&mut s.held);
                            if s.calling {
                                // a call cut off by the limit is dropped, not shown as text
                                let (content, c) = tl.reply(&held, end.finish);
                                calls = c;
                                s.text(content.unwrap_or_default(), &mut out);
                            } else {
                                s.text(tl.held_text(held, end.finish), &mut out);
                            }
                        }
                        None => s.text(rest, &mut out),
                    }
                    s.close_text(&mut out);
                    for c in &calls {
                        let block = tool_use_block(c);
                        let mut start = block.clone();
                        start["input"] = json!({});
                        out.push(event(
                            "content_block_start",
                            json!({"index": s.index, "content_block": start}),
                        ));
                        out.push(event(
                            "content_block_delta",
                            json!({"index": s.index, "delta": {"type": "input_json_delta", "partial_json": block["input"].to_string()}}),
                        ));
                        out.push(event("content_block_stop", json!({ "index": s.index })));
                        s.index += 1;
                    }
                    let (reason, sequence) = stop_reason(&end, !calls.is_empty());
                    out.push(event(
                        "message_delta",
                        json!({"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(n_prompt, Some(&end))}),
                    ));
                    out.push(event("message_stop", json!({})));
                    Some((out, None))
                }
                Some(Piece::Error(e)) => {
                    let b = e.body();
                    out.push(event(
                        "error",
                        json!({"error": {"type": error_type(e.status), "message": b["error"]["message"]}}),
                    ));
                    Some((out, None))
                }
                None => None,
            }
        }
    })
    .flat_map(stream::iter);
    Ok(sse(body.map(Ok::<_, Infallible>)))
}

/// Anthropic's error type for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s < 500 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Whether `path` is one of the Messages API's.
fn is_messages_path(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    p == "/messages" || p.starts_with("/messages/")
}

/// Whether `path` is one of the Models API's (`/v1/models`, `/v1/models/{id}`).
fn is_models_path(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    p == "/models" || p.starts_with("/models/")
}

/// Middleware: on the Messages API's paths, and on the Models API's when the request
/// carries `anthropic-version` (the `anthropic` client's `models.*`), an error (from a
/// handler or from the shared limits: body size, API key, unknown path, method) in
/// Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, the field at fault
/// named first in the message (`max_tokens: field required`).
pub async fn anthropic_errors(req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let anthropic_models = is_models_path(path) && req.headers().contains_key("anthropic-version");
    if !is_messages_path(path) && !anthropic_models {
        return next.run(req).await;
    }
    let r = next.run(req).await;
    crate::net::reshape_error(r, |status, message, param| {
        let message = match param {
            Some(p) if !message.starts_with(p) => format!("{p}: {message}"),
            _ => message,
        };
        json!({"type": "error", "error": {"type": error_type(status), "message": message}})
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(m: &[ChatMessage]) -> Vec<&str> {
        m.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn blocks_become_chat_messages() {
        let (m, prefill) = chat_messages(
            Some(&json!([{"type": "text", "text": "Be brief."}])),
            &json!([
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "...", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ]},
                {"role": "user", "content": "In Celsius."},
            ]),
        )
        .unwrap();
        assert!(!prefill);
        assert_eq!(roles(&m), ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[2].content, Some(json!("Let me look.")));
        assert_eq!(
            m[2].tool_calls,
            Some(
                json!([{"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}])
            )
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].content, Some(json!("18 C")));
        // consecutive user turns are combined
        assert_eq!(m[4].content, Some(json!("And tomorrow?\n\nIn Celsius.")));
    }

    #[test]
    fn a_final_assistant_text_is_a_prefill() {
        let (m, prefill) = chat_messages(
            None,
            &json!([{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}]),
        )
        .unwrap();
        assert!(prefill);
        assert_eq!(roles(&m), ["user", "assistant"]);
        for (messages, want) in [
            (
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "}]),
                "trailing whitespace",
            ),
            (
                json!([{"role": "system", "content": "a"}]),
                "top-level `system`",
            ),
            (json!([]), "non-empty"),
            (
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                "\"image\"",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]),
                "user messages",
            ),
        ] {
            let e = chat_messages(None, &messages).expect_err("refused");
            let msg = e.body()["error"]["message"].as_str().unwrap().to_string();
            assert!(msg.contains(want), "{messages}: {msg}");
        }
    }

    #[test]
    fn tools_and_choices_in_chat_form() {
        let t = chat_tools(
            &json!([{"name": "f", "description": "d", "input_schema": {"type": "object"}}]),
        )
        .unwrap();
        assert_eq!(
            t,
            json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}])
        );
        assert!(
            chat_tools(&json!([{"type": "web_search_20250305", "name": "web_search"}])).is_err()
        );
        assert!(chat_tools(&json!([{"name": "f"}])).is_err());
        for (choice, want, parallel) in [
            (json!({"type": "auto"}), json!("auto"), None),
            (
                json!({"type": "any", "disable_parallel_tool_use": true}),
                json!("required"),
                Some(false),
            ),
            (
                json!({"type": "tool", "name": "f"}),
                json!({"type": "function", "function": {"name": "f"}}),
                None,
            ),
            (json!({"type": "none"}), json!("none"), None),
        ] {
            assert_eq!(
                chat_tool_choice(Some(&choice)).unwrap(),
                (Some(want), parallel)
            );
        }
        assert!(chat_tool_choice(Some(&json!({"type": "tool"}))).is_err());
        assert!(chat_tool_choice(Some(&json!("auto"))).is_err());
    }

    #[test]
    fn requests_need_max_tokens_but_counting_does_not() {
        let body = Bytes::from(
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"], "n": 3}"#,
        );
        let e = chat_request(&body, false).expect_err("no max_tokens");
        assert_eq!(e.body()["error"]["param"], "max_tokens");
        // chat's `n` has no place in a message: refused by name (it was dropped)
        let e = chat_request(&body, true).expect_err("n 3");
        assert_eq!(e.body()["error"]["param"], "n");
        let body = Bytes::from(
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"]}"#,
        );
        let (_, common) = chat_request(&body, true).unwrap();
        assert!(matches!(common.stop, Some(Stop::Many(ref v)) if v == &["x"]));
    }

    #[test]
    fn stop_reasons() {
        let end = |finish, stop: Option<&str>| End {
            finish,
            stop: stop.map(str::to_string),
            completion_tokens: 3,
            reasoning_tokens: 0,
            done: None,
            mean_logprob: None,
            beside: None,
        };
        assert_eq!(stop_reason(&end("stop", None), false), ("end_turn", None));
        assert_eq!(
            stop_reason(&end("length", None), false),
            ("max_tokens", None)
        );
        assert_eq!(
            stop_reason(&end("stop", Some("\n\n")), false),
            ("stop_sequence", Some("\n\n".to_string()))
        );
        assert_eq!(stop_reason(&end("stop", None), true), ("tool_use", None));
        assert!(is_messages_path("/v1/messages") && is_messages_path("/messages/count_tokens"));
        assert!(!is_messages_path("/v1/chat/completions"));
    }
}
