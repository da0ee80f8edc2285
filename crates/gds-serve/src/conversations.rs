//! OpenAI's Conversations API (`/v1/conversations`): a conversation is a list of items kept
//! by the server, which a Responses request names with `conversation` (its items come before
//! the request's input, and the input and the response's output are added to it when the
//! response ends). Kept in memory like responses ([`ConversationStore`]: the
//! [`CONV_ENTRIES`] conversations used last within [`CONV_BYTES`] of JSON); nothing outlives
//! the process.
//!
//! - `POST /v1/conversations` (`items`, up to 20, and `metadata`), `GET`, `POST` (new
//!   `metadata`) and `DELETE /v1/conversations/{id}`;
//! - `POST` (up to 20 `items`) and `GET /v1/conversations/{id}/items` (OpenAI's list:
//!   `limit`, `order`, `after`), `GET` and `DELETE /v1/conversations/{id}/items/{item_id}`.

use crate::api::{now_secs, parse, random_seed, ApiError};
use crate::kept::Kept;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

/// Most conversations kept.
pub(crate) const CONV_ENTRIES: usize = 1024;
/// Most bytes of JSON kept, items of every conversation together (kept as text: what they
/// cost).
pub(crate) const CONV_BYTES: usize = 64 << 20;
/// Most items one call adds (OpenAI's limit).
const ADD_MAX: usize = 20;

struct Conv {
    created_at: u64,
    metadata: Value,
    /// Each item's id and JSON text, oldest first (their bytes are its cost in the store).
    items: Vec<(String, Box<str>)>,
}

impl Conv {
    fn object(&self, id: &str) -> Value {
        json!({"id": id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata})
    }
}

/// What items cost in the store: their ids and JSON texts.
fn cost(items: &[(String, Box<str>)]) -> usize {
    items.iter().map(|(k, t)| k.len() + t.len()).sum()
}

/// Kept items' values from their text (which the store wrote from values).
fn parsed(items: &[(String, Box<str>)]) -> Vec<Value> {
    items
        .iter()
        .map(|(_, t)| serde_json::from_str(t).unwrap_or(Value::Null))
        .collect()
}

/// The conversations kept: at most [`CONV_ENTRIES`] and [`CONV_BYTES`] of items, the one
/// used longest ago dropped first.
pub(crate) struct ConversationStore(Kept<Conv>);

impl Default for ConversationStore {
    fn default() -> Self {
        ConversationStore(Kept::new(CONV_ENTRIES, CONV_BYTES))
    }
}

impl ConversationStore {
    /// Keeps a new conversation (used last), dropping the ones used longest ago past the
    /// count.
    fn insert(&mut self, id: String, conv: Conv) {
        let bytes = cost(&conv.items);
        self.0.insert(id, conv, bytes, |_, _| false);
    }

    fn remove(&mut self, id: &str) -> bool {
        self.0.remove(id).is_some()
    }

    /// Adds items (already checked and given ids) to conversation `id`; false where it is
    /// not kept (any more).
    fn append(&mut self, id: &str, items: Vec<(String, Box<str>)>) -> Result<bool, ApiError> {
        let bytes = cost(&items);
        let Some(now) = self.0.cost(id) else {
            return Ok(false);
        };
        if now + bytes > CONV_BYTES {
            return Err(ApiError::bad(format!(
                "conversation {id:?} would pass {} MiB of items: start another",
                CONV_BYTES >> 20
            ))
            .param("items"));
        }
        self.0.touch(id);
        // (room made at the others' cost)
        self.0.make_room(0, bytes, |k, _| k == id);
        Ok(self
            .0
            .update(id, |c, now| {
                c.items.extend(items);
                ((), now + bytes)
            })
            .is_some())
    }

    /// The items of conversation `id` (`None`: not kept), as the Responses API takes them.
    pub(crate) fn items(&mut self, id: &str) -> Option<Vec<Value>> {
        let items = parsed(&self.0.get(id)?.items);
        self.0.touch(id);
        Some(items)
    }
}

/// Adds the items of a response (its input's and its output's) to conversation `id` when the
/// response ends; a conversation deleted meanwhile takes nothing.
pub(crate) fn add_response_items(st: &ServerState, id: &str, items: &[Value]) {
    let items = items.iter().map(normalize).collect();
    let mut store = st.conversations.lock().unwrap_or_else(|e| e.into_inner());
    // (over its size: the response stands, the conversation stops growing)
    let _ = store.append(id, items);
}

/// An item as the conversation keeps and lists it: a `type` (`message` where none), an `id`
/// (its own, else a new one), a `status`; a message's string content as a part
/// (`input_text`, an assistant's `output_text`).
fn normalize(item: &Value) -> (String, Box<str>) {
    let it = crate::items::listed(item, |prefix| format!("{prefix}_{:016x}", random_seed()));
    let id = it["id"].as_str().unwrap_or_default().to_string();
    (id, it.to_string().into_boxed_str())
}

/// Items of a request body, checked as the Responses API reads them (so that a conversation
/// never holds an item a response would refuse), at most [`ADD_MAX`].
fn checked_items(items: Option<&Value>) -> Result<Vec<(String, Box<str>)>, ApiError> {
    let list = match items {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(ApiError::bad("items must be a list of items").param("items")),
    };
    if list.len() > ADD_MAX {
        return Err(ApiError::bad(format!(
            "items holds {} items: at most {ADD_MAX} a call",
            list.len()
        ))
        .param("items"));
    }
    crate::items::check_items(list).map_err(|e| e.param("items"))?;
    Ok(list.iter().map(normalize).collect())
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no conversation {id:?}"))
}

fn lock(st: &ServerState) -> std::sync::MutexGuard<'_, ConversationStore> {
    st.conversations.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Deserialize)]
struct CreateBody {
    #[serde(default)]
    items: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
}

/// `POST /v1/conversations`.
pub async fn create(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = (|| {
        let b: CreateBody = if body.iter().all(u8::is_ascii_whitespace) {
            CreateBody {
                items: None,
                metadata: None,
            }
        } else {
            parse(&body)?
        };
        let metadata = crate::items::metadata(b.metadata.as_ref())?;
        let items = checked_items(b.items.as_ref())?;
        let id = format!("conv_{:016x}{:016x}", random_seed(), random_seed());
        let conv = Conv {
            created_at: now_secs(),
            metadata,
            items: Vec::new(),
        };
        let object = conv.object(&id);
        let mut store = lock(&st);
        store.insert(id.clone(), conv);
        store.append(&id, items)?;
        Ok(Json(object).into_response())
    })();
    crate::api::finish(&st, r)
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    let store = lock(&st);
    match store.0.get(&id) {
        Some(c) => Json(c.object(&id)).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `POST /v1/conversations/{id}`: new `metadata`.
pub async fn update(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let r = (|| {
        let metadata = crate::items::metadata_update(&body)?;
        let mut store = lock(&st);
        let object = store.0.update(&id, |c, now| {
            c.metadata = metadata;
            (c.object(&id), now)
        });
        Ok(Json(object.ok_or_else(|| not_found(&id))?).into_response())
    })();
    crate::api::finish(&st, r)
}

/// `DELETE /v1/conversations/{id}`.
pub async fn delete(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    if lock(&st).remove(&id) {
        Json(json!({"id": id, "object": "conversation.deleted", "deleted": true})).into_response()
    } else {
        not_found(&id).into_response()
    }
}

#[derive(Deserialize)]
struct ItemsBody {
    items: Option<Value>,
}

/// `POST /v1/conversations/{id}/items`: adds up to 20 items; answers them as listed.
pub async fn add_items(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let r = (|| {
        let b: ItemsBody = parse(&body)?;
        if b.items.is_none() {
            return Err(ApiError::bad("items is required").param("items"));
        }
        let items = checked_items(b.items.as_ref())?;
        let data = parsed(&items);
        if !lock(&st).append(&id, items)? {
            return Err(not_found(&id));
        }
        Ok(Json(crate::items::list(data, false)).into_response())
    })();
    crate::api::finish(&st, r)
}

/// `GET /v1/conversations/{id}/items`: a page of items (`order`: `desc`, the default, newest
/// first; `after` an item id; `limit` 1 to 100, 20).
pub async fn list_items(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let store = lock(&st);
    let Some(c) = store.0.get(&id) else {
        return not_found(&id).into_response();
    };
    let items = parsed(&c.items);
    drop(store);
    match crate::items::page(items, &q, &format!("conversation {id:?}")) {
        Ok(list) => Json(list).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub async fn get_item(
    State(st): State<Arc<ServerState>>,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    let store = lock(&st);
    let Some(c) = store.0.get(&id) else {
        return not_found(&id).into_response();
    };
    match c.items.iter().find(|(k, _)| *k == item) {
        Some((_, t)) => crate::items::json_text(t.to_string()),
        None => item_not_found(&id, &item).into_response(),
    }
}

fn item_not_found(id: &str, item: &str) -> ApiError {
    ApiError::not_found(format!("no item {item:?} in conversation {id:?}"))
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: answers the conversation.
pub async fn delete_item(
    State(st): State<Arc<ServerState>>,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    let mut store = lock(&st);
    let found = store.0.update(&id, |c, now| {
        match c.items.iter().position(|(k, _)| *k == item) {
            Some(at) => {
                let freed = cost(&c.items[at..=at]);
                c.items.remove(at);
                (Some(c.object(&id)), now - freed)
            }
            None => (None, now),
        }
    });
    match found {
        Some(Some(object)) => Json(object).into_response(),
        Some(None) => item_not_found(&id, &item).into_response(),
        None => not_found(&id).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(text: &str) -> (String, Box<str>) {
        normalize(&json!({"role": "user", "content": text}))
    }

    #[test]
    fn items_get_ids_and_parts_and_the_store_keeps_its_bounds() {
        let (id, text) = item("hi");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(id.starts_with("msg_") && v["id"] == id.as_str(), "{v}");
        assert_eq!(v["type"], "message");
        assert_eq!(v["status"], "completed");
        assert_eq!(v["content"], json!([{"type": "input_text", "text": "hi"}]));
        let a = normalize(&json!({"role": "assistant", "content": "yo", "id": "msg_x"}));
        assert_eq!(a.0, "msg_x");
        assert!(a.1.contains("output_text"), "{}", a.1);

        let mut s = ConversationStore::default();
        let conv = |s: &mut ConversationStore, id: &str| {
            let c = Conv {
                created_at: 0,
                metadata: json!({}),
                items: Vec::new(),
            };
            s.insert(id.to_string(), c);
        };
        conv(&mut s, "a");
        conv(&mut s, "b");
        assert!(s.append("a", vec![item("one"), item("two")]).unwrap());
        assert!(!s.append("zz", vec![item("x")]).unwrap());
        let total: usize = s.0.entries().map(|(_, c, _)| cost(&c.items)).sum();
        assert_eq!(s.0.bytes(), total);
        // "a" was used last: past the count, "b" goes first
        for i in 0..CONV_ENTRIES - 1 {
            conv(&mut s, &format!("c{i}"));
        }
        assert_eq!(s.0.len(), CONV_ENTRIES);
        assert!(s.0.get("a").is_some() && s.0.get("b").is_none());
        // ... then "a", the oldest used
        conv(&mut s, "d");
        assert!(s.0.get("a").is_none());
        let total: usize = s.0.entries().map(|(_, c, _)| cost(&c.items)).sum();
        assert_eq!(s.0.bytes(), total);
        assert!(s.remove("d") && !s.remove("d") && s.0.get("d").is_none());
        conv(&mut s, "d");
        // one conversation cannot pass the bytes
        let big = "x".repeat(CONV_BYTES / 2);
        assert!(s.append("d", vec![item(&big)]).unwrap());
        assert!(s.append("d", vec![item(&big)]).is_err());
        assert_eq!(s.items("d").unwrap().len(), 1);
    }
}
