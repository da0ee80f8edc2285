//! The Responses API's items (OpenAI's `input` items, which conversations keep too): read
//! into the chat messages a request runs on, and `metadata`'s limits.

use crate::api::{ApiError, ChatMessage};
use crate::error::bad;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;

/// A kept object's JSON text (a stored response, a conversation's item), answered as it is.
pub(crate) fn json_text(text: String) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        text,
    )
        .into_response()
}

/// OpenAI's list object around `data` (a page of it: `has_more` says whether more follow).
pub(crate) fn list(data: Vec<Value>, has_more: bool) -> Value {
    json!({
        "object": "list",
        "first_id": data.first().map(|d| d["id"].clone()),
        "last_id": data.last().map(|d| d["id"].clone()),
        "has_more": has_more,
        "data": data,
    })
}

/// An item as OpenAI lists it (a response's input items, a conversation's): a `type`
/// (`message` where none), an `id` (its own, else `new_id` of its kind's prefix: `msg`,
/// `fc`, `fco`, `rs`, `item`), a `status`; a message's string content as a part
/// (`input_text`, an assistant's `output_text`).
pub(crate) fn listed(item: &Value, new_id: impl FnOnce(&str) -> String) -> Value {
    let mut it = item.clone();
    let Some(o) = it.as_object_mut() else {
        return it;
    };
    let kind = o
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message")
        .to_string();
    let prefix = match kind.as_str() {
        "message" => "msg",
        "function_call" => "fc",
        "function_call_output" => "fco",
        "reasoning" => "rs",
        _ => "item",
    };
    o.entry("id").or_insert_with(|| json!(new_id(prefix)));
    o.insert("type".into(), json!(kind));
    o.entry("status").or_insert_with(|| json!("completed"));
    if kind == "message" {
        if let Some(Value::String(text)) = o.get("content") {
            let part = if o.get("role").and_then(Value::as_str) == Some("assistant") {
                json!({"type": "output_text", "text": text, "annotations": []})
            } else {
                json!({"type": "input_text", "text": text})
            };
            o.insert("content".into(), json!([part]));
        }
    }
    it
}

/// A page of `items` (oldest first) as OpenAI lists them: `order` (`desc`, the default,
/// newest first, or `asc`), after the item whose id is `after`, `limit` of them (1 to 100,
/// 20); the list object, or a 400 naming the query parameter (`what` names the list).
pub(crate) fn page(
    items: Vec<Value>,
    q: &HashMap<String, String>,
    what: &str,
) -> Result<Value, ApiError> {
    page_of(items, q, what, 20, 100)
}

/// [`page`] with another default and largest `limit` (the files' are 10000).
pub(crate) fn page_of(
    mut items: Vec<Value>,
    q: &HashMap<String, String>,
    what: &str,
    default: usize,
    max: usize,
) -> Result<Value, ApiError> {
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => default,
        Some(Ok(n)) if (1..=max).contains(&n) => n,
        Some(_) => {
            return Err(
                ApiError::bad(format!("limit must be a number from 1 to {max}")).param("limit"),
            )
        }
    };
    match q.get("order").map(String::as_str) {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(o) => {
            return Err(
                ApiError::bad(format!("order {o:?}: expected \"asc\" or \"desc\"")).param("order"),
            )
        }
    }
    let from = match q.get("after") {
        None => 0,
        Some(a) => match items.iter().position(|d| d["id"] == a.as_str()) {
            Some(i) => i + 1,
            None => {
                return Err(ApiError::bad(format!("no item {a:?} in {what}")).param("after"));
            }
        },
    };
    let has_more = items.len() > from + limit;
    Ok(list(
        items.into_iter().skip(from).take(limit).collect(),
        has_more,
    ))
}

/// OpenAI's limits on `metadata`: at most 16 pairs, keys up to 64 characters, string values
/// up to 512.
pub(crate) fn metadata(v: Option<&Value>) -> Result<Value, ApiError> {
    let m = match v {
        None | Some(Value::Null) => return Ok(json!({})),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("metadata must be an object of strings", "metadata")),
    };
    let fits = m.len() <= 16
        && m.iter().all(|(k, v)| {
            k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512)
        });
    if !fits {
        return Err(bad(
            "metadata holds up to 16 pairs, keys up to 64 characters and string values up to 512",
            "metadata",
        ));
    }
    Ok(Value::Object(m.clone()))
}

/// The new `metadata` of an update body (`{"metadata": {...}}`: the conversations' and the
/// stored chat completions'), required and checked.
pub(crate) fn metadata_update(body: &[u8]) -> Result<Value, ApiError> {
    #[derive(serde::Deserialize)]
    struct Update {
        metadata: Option<Value>,
    }
    let b: Update = crate::api::parse(body)?;
    if b.metadata.is_none() {
        return Err(bad("metadata is required", "metadata"));
    }
    metadata(b.metadata.as_ref())
}

/// Checks input items as a request's `input` (a conversation's items are).
pub(crate) fn check_items(list: &[Value]) -> Result<(), ApiError> {
    messages(None, &Value::Array(list.to_vec())).map(drop)
}

/// The text of a message item's `content`: a string, or parts of type `input_text`,
/// `output_text` or `text`.
pub(crate) fn content_text(content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                if !matches!(kind, "input_text" | "output_text" | "text") {
                    return Err(bad(
                        format!("content parts of type {kind:?} are not supported (text only)"),
                        "input",
                    ));
                }
                // (joined by a newline, as the chat endpoint joins its parts)
                if !s.is_empty() {
                    s.push('\n');
                }
                s.push_str(
                    p.get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("a text part needs a \"text\" string", "input"))?,
                );
            }
            Ok(s)
        }
        Some(_) => Err(bad(
            "content must be a string or a list of text parts",
            "input",
        )),
    }
}

/// `instructions` and `input` as chat messages. Consecutive `function_call` items become one
/// assistant message with several calls (parallel calls), as chat templates expect.
pub(crate) fn messages(
    instructions: Option<String>,
    input: &Value,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = instructions {
        out.push(ChatMessage::text("system", i));
    }
    let items = match input {
        Value::String(s) => {
            out.push(ChatMessage::text("user", s.clone()));
            return Ok(out);
        }
        Value::Array(items) => items,
        _ => return Err(bad("input must be a string or a list of items", "input")),
    };
    // a reasoning item: the next assistant message's (or call's) reasoning
    let mut reasoning: Option<String> = None;
    for item in items {
        let kind = item.get("type").and_then(Value::as_str);
        let field = |name: &str| {
            item.get(name)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| {
                    bad(
                        format!("a {} item needs a \"{name}\" string", kind.unwrap_or("")),
                        "input",
                    )
                })
        };
        match kind {
            None | Some("message") => {
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a message item needs a \"role\"", "input"))?;
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(bad(format!("unknown role {role:?}"), "input"));
                }
                let mut m = ChatMessage::text(role, content_text(item.get("content"))?);
                if role == "assistant" {
                    m.reasoning_content = reasoning.take();
                }
                out.push(m);
            }
            Some("reasoning") => {
                // its text parts (`content`, else the `summary`); encrypted content is opaque
                let parts = |name: &str| {
                    item.get(name)
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<Vec<_>>()
                        .join("\n")
                };
                let text = Some(parts("content"))
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(|| parts("summary"));
                if !text.is_empty() {
                    reasoning = Some(text);
                }
            }
            Some("function_call") => {
                let call = json!({
                    "id": field("call_id")?,
                    "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?},
                });
                match out.last_mut() {
                    Some(ChatMessage {
                        role,
                        tool_calls: Some(Value::Array(calls)),
                        ..
                    }) if role == "assistant" => calls.push(call),
                    _ => out.push(ChatMessage {
                        role: "assistant".into(),
                        content: None,
                        tool_calls: Some(json!([call])),
                        tool_call_id: None,
                        reasoning_content: reasoning.take(),
                    }),
                }
            }
            Some("function_call_output") => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    o => content_text(o)?,
                };
                out.push(ChatMessage::tool_result(field("call_id")?, output));
            }
            Some(other) => {
                return Err(bad(
                    format!(
                        "input items of type {other:?} are not supported (message, reasoning, function_call, function_call_output)"
                    ),
                    "input",
                ))
            }
        }
    }
    Ok(out)
}
