//! OpenAI's Files API, as far as the Batch API needs it: `POST /v1/files` (a multipart upload:
//! `file`, `purpose`, `expires_after`), `GET /v1/files` (a page, newest first, by `purpose`),
//! `GET` and `DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`. A batch's results are
//! files too (`purpose: batch_output`). Kept in memory under `--file-storage` bytes (uploads
//! and results together): an upload that does not fit is refused (413 `storage_full`), nothing
//! is dropped to make room; a file goes when it is deleted, when its `expires_at` passes, or
//! when the server stops.

use crate::api::{now_secs, ApiError};
use crate::error::random_seed;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

/// The purposes OpenAI's Files API takes on an upload.
const PURPOSES: [&str; 6] = [
    "assistants",
    "batch",
    "fine-tune",
    "vision",
    "user_data",
    "evals",
];

/// The `expires_after.seconds` OpenAI allows: an hour to 30 days.
pub(crate) const EXPIRY_SECONDS: std::ops::RangeInclusive<u64> = 3600..=2_592_000;

/// A file's object, as OpenAI answers it.
#[derive(Serialize, Clone, Debug)]
pub(crate) struct FileObject {
    pub(crate) id: String,
    object: &'static str,
    pub(crate) bytes: usize,
    pub(crate) created_at: u64,
    pub(crate) expires_at: Option<u64>,
    pub(crate) filename: String,
    pub(crate) purpose: String,
    status: &'static str,
    status_details: Option<()>,
}

struct StoredFile {
    object: FileObject,
    content: Bytes,
}

/// The files, by id, in the order they were made, and the bytes they and the results of
/// running batches take.
pub(crate) struct FileStore {
    files: HashMap<String, StoredFile>,
    order: Vec<String>,
    used: usize,
    budget: usize,
}

impl FileStore {
    pub(crate) fn new(budget: usize) -> FileStore {
        FileStore {
            files: HashMap::new(),
            order: Vec::new(),
            used: 0,
            budget,
        }
    }

    /// Drops the files whose `expires_at` has passed.
    fn purge(&mut self, now: u64) {
        let gone: Vec<String> = self
            .order
            .iter()
            .filter(|id| {
                self.files
                    .get(*id)
                    .and_then(|f| f.object.expires_at)
                    .is_some_and(|t| t <= now)
            })
            .cloned()
            .collect();
        for id in gone {
            self.remove(&id);
        }
    }

    fn remove(&mut self, id: &str) -> Option<StoredFile> {
        let f = self.files.remove(id)?;
        self.used -= f.object.bytes;
        self.order.retain(|k| k != id);
        Some(f)
    }

    /// Counts `n` more bytes as used (a batch's results as they come), unless they do not fit.
    pub(crate) fn reserve(&mut self, n: usize) -> bool {
        self.purge(now_secs());
        if self.used + n > self.budget {
            return false;
        }
        self.used += n;
        true
    }

    /// Gives back `n` bytes counted by [`FileStore::reserve`].
    pub(crate) fn release(&mut self, n: usize) {
        self.used -= n.min(self.used);
    }

    /// Keeps `content` as a new file; `reserved`: its bytes are counted already
    /// ([`FileStore::reserve`]), else they must fit.
    pub(crate) fn add(
        &mut self,
        filename: String,
        purpose: &str,
        expires_after: Option<u64>,
        content: Bytes,
        reserved: bool,
    ) -> Result<FileObject, ApiError> {
        if !reserved && !self.reserve(content.len()) {
            return Err(self.full(content.len()));
        }
        let now = now_secs();
        let object = FileObject {
            id: format!("file-{:016x}{:08x}", random_seed(), random_seed() as u32),
            object: "file",
            bytes: content.len(),
            created_at: now,
            expires_at: expires_after.map(|s| now + s),
            filename,
            purpose: purpose.to_string(),
            status: "processed",
            status_details: None,
        };
        self.order.push(object.id.clone());
        self.files.insert(
            object.id.clone(),
            StoredFile {
                object: object.clone(),
                content,
            },
        );
        Ok(object)
    }

    fn full(&self, n: usize) -> ApiError {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "{n} bytes do not fit in this server's file storage: {} of {} bytes are used \
                 (--file-storage); delete files you no longer need",
                self.used, self.budget
            ),
        )
        .code("storage_full")
    }

    /// File `id`'s object and content.
    pub(crate) fn get(&mut self, id: &str) -> Option<(FileObject, Bytes)> {
        self.purge(now_secs());
        self.files
            .get(id)
            .map(|f| (f.object.clone(), f.content.clone()))
    }
}

pub(crate) fn lock(st: &ServerState) -> std::sync::MutexGuard<'_, FileStore> {
    st.files.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no file {id:?}")).param("file_id")
}

/// The largest body of an upload or a message batch: the storage free now and room for the
/// multipart framing (a larger one is refused from its Content-Length before it is read).
pub(crate) fn max_upload(st: &ServerState) -> usize {
    let mut s = lock(st);
    s.purge(now_secs());
    s.budget.saturating_sub(s.used).saturating_add(64 << 10)
}

/// Whether `POST path` sends what the file storage keeps (a Files API upload, an Anthropic
/// message batch), under any of the API prefixes: its body may be as large as the storage.
pub(crate) fn takes_storage(path: &str) -> bool {
    crate::API_PREFIXES.iter().any(|p| {
        path.strip_prefix(p)
            .is_some_and(|rest| rest == "/files" || rest == "/messages/batches")
    })
}

/// `expires_after` of an upload or a batch's `output_expires_after`: `anchor` `created_at`,
/// `seconds` an hour to 30 days.
pub(crate) fn expiry(
    anchor: Option<&str>,
    seconds: Option<&str>,
    param: &'static str,
) -> Result<Option<u64>, ApiError> {
    if anchor.is_none() && seconds.is_none() {
        return Ok(None);
    }
    let bad = || {
        ApiError::bad(format!(
            "{param} takes anchor \"created_at\" and seconds from {} to {}",
            EXPIRY_SECONDS.start(),
            EXPIRY_SECONDS.end()
        ))
        .param(param)
    };
    if anchor != Some("created_at") {
        return Err(bad());
    }
    match seconds.and_then(|s| s.trim().parse::<u64>().ok()) {
        Some(s) if EXPIRY_SECONDS.contains(&s) => Ok(Some(s)),
        _ => Err(bad()),
    }
}

/// `POST /v1/files`.
pub async fn upload(State(st): State<Arc<ServerState>>, mut form: Multipart) -> Response {
    let mut file: Option<(String, Bytes)> = None;
    let (mut purpose, mut anchor, mut seconds) = (None, None, None);
    loop {
        let field = match form.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return ApiError::bad(format!("the multipart body: {e}")).into_response(),
        };
        let name = field.name().unwrap_or_default().to_string();
        let filename = field.file_name().map(str::to_string);
        let data = match field.bytes().await {
            Ok(d) => d,
            Err(e) => {
                return ApiError::bad(format!("the multipart field {name:?}: {e}")).into_response()
            }
        };
        let text = || String::from_utf8_lossy(&data).into_owned();
        match name.as_str() {
            "file" => file = Some((filename.unwrap_or_else(|| "upload".into()), data)),
            "purpose" => purpose = Some(text()),
            "expires_after[anchor]" => anchor = Some(text()),
            "expires_after[seconds]" => seconds = Some(text()),
            // (another field is not OpenAI's; it changes nothing)
            _ => {}
        }
    }
    let Some((filename, content)) = file else {
        return ApiError::bad("the upload has no `file` field")
            .param("file")
            .into_response();
    };
    let purpose = match purpose {
        Some(p) if PURPOSES.contains(&p.as_str()) => p,
        p => {
            return ApiError::bad(format!(
                "purpose {p:?} is not one of {}",
                PURPOSES.join(", ")
            ))
            .param("purpose")
            .into_response()
        }
    };
    let expires = match expiry(anchor.as_deref(), seconds.as_deref(), "expires_after") {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    // (a file's name is the client's: kept to 255 characters, no control characters)
    let filename: String = filename
        .chars()
        .filter(|c| !c.is_control())
        .take(255)
        .collect();
    match lock(&st).add(filename, &purpose, expires, content, false) {
        Ok(o) => Json(o).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/files`: newest first (`order`), `after` an id, `limit` 1 to 10000 (all), by
/// `purpose`.
pub async fn list(
    State(st): State<Arc<ServerState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data: Vec<Value> = {
        let mut s = lock(&st);
        s.purge(now_secs());
        s.order
            .iter()
            .filter_map(|id| s.files.get(id))
            .filter(|f| q.get("purpose").is_none_or(|p| *p == f.object.purpose))
            .map(|f| json!(f.object))
            .collect()
    };
    match crate::items::page_of(data, &q, "the files", 10_000, 10_000) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/files/{id}`.
pub async fn retrieve(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    match lock(&st).get(&id) {
        Some((o, _)) => Json(o).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `DELETE /v1/files/{id}`.
pub async fn delete(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    let mut s = lock(&st);
    s.purge(now_secs());
    match s.remove(&id) {
        Some(_) => Json(json!({"id": id, "object": "file", "deleted": true})).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `GET /v1/files/{id}/content`: the bytes as they were uploaded (or written by a batch).
pub async fn content(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    match lock(&st).get(&id) {
        Some((_, bytes)) => {
            ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response()
        }
        None => not_found(&id).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_keeps_to_its_budget_and_gives_room_back() {
        let mut s = FileStore::new(100);
        let a = s
            .add("a".into(), "batch", None, Bytes::from(vec![1u8; 60]), false)
            .unwrap();
        let e = s
            .add("b".into(), "batch", None, Bytes::from(vec![2u8; 50]), false)
            .unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(e.text().contains("60 of 100 bytes"), "{}", e.text());
        assert!(s.reserve(40) && !s.reserve(1));
        s.release(40);
        assert!(s.remove(&a.id).is_some());
        assert_eq!(s.used, 0);
        // an expired file is gone, its bytes with it
        let b = s
            .add(
                "b".into(),
                "batch",
                Some(0),
                Bytes::from(vec![2u8; 50]),
                false,
            )
            .unwrap();
        assert!(s.get(&b.id).is_none());
        assert_eq!((s.used, s.order.len()), (0, 0));
    }

    #[test]
    fn expiry_takes_created_at_and_an_hour_to_thirty_days() {
        assert_eq!(expiry(None, None, "x").unwrap(), None);
        assert_eq!(
            expiry(Some("created_at"), Some("3600"), "x").unwrap(),
            Some(3600)
        );
        for (a, s) in [
            (Some("created_at"), Some("10")),
            (Some("created_at"), Some("2592001")),
            (Some("last_active_at"), Some("3600")),
            (None, Some("3600")),
            (Some("created_at"), None),
        ] {
            assert!(expiry(a, s, "x").is_err(), "{a:?} {s:?}");
        }
    }
}
