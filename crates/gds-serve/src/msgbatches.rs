//! Anthropic's Message Batches API: `POST /v1/messages/batches` (`requests`, each a
//! `custom_id` and the `params` of a Messages request) runs them in the background as the
//! OpenAI Batch API's batches run ([`crate::batches::drive`]: through `/v1/messages`, the
//! engine shared with the clients); `GET /v1/messages/batches/{id}` follows it
//! (`processing_status` `in_progress`, `canceling`, `ended`; `request_counts`), `GET
//! .../results` streams its results as JSONL once it has ended (`succeeded` with the message,
//! `errored` with the error as `/v1/messages` answers it, `canceled`), `POST .../cancel`
//! stops it, `DELETE` drops an ended one, `GET /v1/messages/batches` lists them newest first
//! (`before_id`, `after_id`, `limit`). The requests and the results are kept in memory under
//! `--file-storage` with the Files API's files (a batch that does not fit is a 413); the
//! last [`crate::batches::MAX_BATCHES`] batches, gone when the server stops.

use crate::api::ApiError;
use crate::batches::drive;
use crate::files;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Most requests in one batch (Anthropic's limit).
const MAX_REQUESTS: usize = 100_000;

fn now() -> String {
    chrono::DateTime::<chrono::Utc>::from(std::time::SystemTime::now())
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

#[derive(Default, Clone, serde::Serialize)]
struct Counts {
    processing: u64,
    succeeded: u64,
    errored: u64,
    canceled: u64,
    expired: u64,
}

struct BatchState {
    id: String,
    processing_status: &'static str,
    counts: Counts,
    created_at: String,
    expires_at: String,
    ended_at: Option<String>,
    cancel_initiated_at: Option<String>,
    /// The result lines so far (JSONL).
    results: Vec<u8>,
    /// Once the batch has ended, its results, shared by every read (a large batch's are not
    /// copied for each client that reads them).
    ended_results: Bytes,
    /// Bytes of `results` counted in the file storage.
    reserved: usize,
}

pub(crate) struct MsgJob {
    state: Mutex<BatchState>,
    stop: watch::Sender<bool>,
}

impl MsgJob {
    fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The batch's object; `base` the URL its results are read from, up to the id
    /// ([`results_base`]).
    fn object(&self, base: &str) -> Value {
        let s = self.lock();
        let ended = s.processing_status == "ended";
        json!({
            "id": s.id,
            "type": "message_batch",
            "processing_status": s.processing_status,
            "request_counts": s.counts,
            "ended_at": s.ended_at,
            "created_at": s.created_at,
            "expires_at": s.expires_at,
            "archived_at": null,
            "cancel_initiated_at": s.cancel_initiated_at,
            "results_url": ended.then(|| format!("{base}/{}/results", s.id)),
        })
    }
}

/// Anthropic's message batches.
pub(crate) type MsgBatchStore = crate::batches::Jobs<MsgJob>;

fn lock(st: &ServerState) -> std::sync::MutexGuard<'_, MsgBatchStore> {
    st.msg_batches.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a batch's results are read from, but its id and `/results`: this request's scheme
/// (`X-Forwarded-Proto` where a proxy set it), host and path prefix (`/v1` or another the
/// server answers under), so the client that asked can follow it.
fn results_base(headers: &HeaderMap, uri: &Uri) -> String {
    let text = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    let host = text("x-forwarded-host")
        .or_else(|| text(header::HOST.as_str()))
        .unwrap_or("localhost");
    let scheme = text("x-forwarded-proto").unwrap_or("http");
    let path = uri.path();
    let prefix = path
        .find("/messages/batches")
        .map_or("/v1", |at| &path[..at]);
    format!("{scheme}://{host}{prefix}/messages/batches")
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Create {
    requests: Vec<Item>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Item {
    custom_id: String,
    params: Box<RawValue>,
}

/// Checks a batch's requests as Anthropic does before it runs any: 1 to 100000 of them, each
/// `custom_id` 1 to 64 of `[a-zA-Z0-9_-]` and unique, `params` an object, not streamed.
fn check(items: &[Item]) -> Result<(), ApiError> {
    if items.is_empty() || items.len() > MAX_REQUESTS {
        return Err(
            ApiError::bad(format!("a batch holds 1 to {MAX_REQUESTS} requests")).param("requests"),
        );
    }
    let mut seen = HashSet::new();
    for (i, it) in items.iter().enumerate() {
        let id_ok = (1..=64).contains(&it.custom_id.len())
            && it
                .custom_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !id_ok {
            return Err(ApiError::bad(format!(
                "requests.{i}.custom_id: 1 to 64 letters, digits, `_` or `-`, not {:?}",
                it.custom_id
            )));
        }
        if !seen.insert(it.custom_id.as_str()) {
            return Err(ApiError::bad(format!(
                "requests.{i}.custom_id: {:?} is used by an earlier request; each must be unique",
                it.custom_id
            )));
        }
        let params: Value = serde_json::from_str(it.params.get())
            .map_err(|e| ApiError::bad(format!("requests.{i}.params: {e}")))?;
        let Some(o) = params.as_object() else {
            return Err(ApiError::bad(format!(
                "requests.{i}.params: an object is expected"
            )));
        };
        if o.get("stream") == Some(&Value::Bool(true)) {
            return Err(ApiError::bad(format!(
                "requests.{i}.params.stream: a batch's requests cannot be streamed"
            )));
        }
    }
    Ok(())
}

/// `POST /v1/messages/batches`.
pub async fn create(
    State(st): State<Arc<ServerState>>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    let c: Create = match crate::api::parse(&body) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = check(&c.requests) {
        return e.into_response();
    }
    // the requests are kept until they have run: they count in the file storage
    let held = body.len();
    if !files::lock(&st).reserve(held) {
        return ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("a batch of {held} bytes does not fit in this server's file storage now (--file-storage)"),
        )
        .into_response();
    }
    let created = chrono::DateTime::<chrono::Utc>::from(std::time::SystemTime::now());
    let job = Arc::new(MsgJob {
        state: Mutex::new(BatchState {
            id: format!(
                "msgbatch_{:016x}{:08x}",
                crate::error::random_seed(),
                crate::error::random_seed() as u32
            ),
            processing_status: "in_progress",
            counts: Counts {
                processing: c.requests.len() as u64,
                ..Counts::default()
            },
            created_at: created.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            expires_at: (created + chrono::Duration::hours(24))
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ended_at: None,
            cancel_initiated_at: None,
            results: Vec::new(),
            ended_results: Bytes::new(),
            reserved: 0,
        }),
        stop: watch::channel(false).0,
    });
    let id = job.lock().id.clone();
    let kept = lock(&st).insert(id, job.clone(), |j| j.lock().processing_status == "ended");
    match kept {
        Ok(Some(old)) => files::lock(&st).release(old.lock().reserved),
        Ok(None) => {}
        Err(e) => {
            files::lock(&st).release(held);
            return e.into_response();
        }
    }
    let object = job.object(&results_base(&headers, &uri));
    tokio::spawn(run(st, job, c.requests, held));
    Json(object).into_response()
}

/// Runs a batch's requests through `/v1/messages`, then ends it: the requests not answered
/// (a cancel) are `canceled`.
async fn run(st: Arc<ServerState>, job: Arc<MsgJob>, items: Vec<Item>, held: usize) {
    let mut stop = job.stop.subscribe();
    let ids: Vec<String> = items.iter().map(|i| i.custom_id.clone()).collect();
    let answered = Arc::new(Mutex::new(vec![false; items.len()]));
    let requests = items.into_iter().enumerate().map(|(n, it)| {
        let body = it.params.get().as_bytes().to_vec();
        (it.custom_id, n as u64, "/v1/messages".to_string(), body)
    });
    let recorder = {
        let (st, job, answered) = (st.clone(), job.clone(), answered.clone());
        move |id: &str, n: u64, status: u16, reply: Box<RawValue>| {
            let ok = (200..300).contains(&status);
            let result = if ok {
                json!({"type": "succeeded", "message": reply})
            } else {
                json!({"type": "errored", "error": reply})
            };
            let line = json!({"custom_id": id, "result": result});
            let mut line = serde_json::to_vec(&line).unwrap_or_default();
            line.push(b'\n');
            let fits = files::lock(&st).reserve(line.len());
            let mut s = job.lock();
            if !fits {
                // (the rest end errored, below)
                job.stop.send_replace(true);
                return;
            }
            s.results.extend_from_slice(&line);
            s.reserved += line.len();
            s.counts.processing -= 1;
            if ok {
                s.counts.succeeded += 1;
            } else {
                s.counts.errored += 1;
            }
            if let Some(a) = answered
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(n as usize)
            {
                *a = true;
            }
        }
    };
    drive(&st, &mut stop, requests, recorder).await;
    files::lock(&st).release(held);
    let answered = answered.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut s = job.lock();
    let cancelled = s.cancel_initiated_at.is_some();
    for (id, _) in ids.iter().zip(&answered).filter(|(_, a)| !**a) {
        // (a cancel's; else the storage filled up)
        let result = if cancelled {
            json!({"type": "canceled"})
        } else {
            let e = json!({"type": "error", "error": {"type": "api_error", "message": "not run: the batch's results outgrew the server's file storage (--file-storage)"}});
            json!({"type": "errored", "error": e})
        };
        let mut line =
            serde_json::to_vec(&json!({"custom_id": id, "result": result})).unwrap_or_default();
        line.push(b'\n');
        s.results.extend_from_slice(&line);
        s.counts.processing = s.counts.processing.saturating_sub(1);
        if cancelled {
            s.counts.canceled += 1;
        } else {
            s.counts.errored += 1;
        }
    }
    s.ended_results = Bytes::from(std::mem::take(&mut s.results));
    s.processing_status = "ended";
    s.ended_at = Some(now());
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no message batch {id:?}"))
}

fn job(st: &ServerState, id: &str) -> Result<Arc<MsgJob>, ApiError> {
    lock(st).get(id).ok_or_else(|| not_found(id))
}

/// `GET /v1/messages/batches/{id}`.
pub async fn retrieve(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    match job(&st, &id) {
        Ok(j) => Json(j.object(&results_base(&headers, &uri))).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/messages/batches/{id}/cancel`: `canceling`, then `ended` with the requests not
/// answered `canceled`.
pub async fn cancel(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let j = match job(&st, &id) {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    {
        let mut s = j.lock();
        if s.processing_status == "in_progress" {
            s.processing_status = "canceling";
            s.cancel_initiated_at = Some(now());
            j.stop.send_replace(true);
        }
    }
    Json(j.object(&results_base(&headers, &uri))).into_response()
}

/// `DELETE /v1/messages/batches/{id}`: an ended batch and its results.
pub async fn delete(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    let j = match job(&st, &id) {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    let status = j.lock().processing_status;
    if status != "ended" {
        return ApiError::bad(format!(
            "message batch {id:?} is {status}: cancel it and wait until it has ended to delete it"
        ))
        .into_response();
    }
    lock(&st).remove(&id);
    files::lock(&st).release(j.lock().reserved);
    Json(json!({"id": id, "type": "message_batch_deleted"})).into_response()
}

/// `GET /v1/messages/batches/{id}/results`: JSONL, one line per request, in the order they
/// finished.
pub async fn results(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    let j = match job(&st, &id) {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    let s = j.lock();
    if s.processing_status != "ended" {
        return ApiError::bad(format!(
            "message batch {id:?} is {}: its results are ready once it has ended",
            s.processing_status
        ))
        .into_response();
    }
    (
        [(header::CONTENT_TYPE, "application/x-jsonl")],
        s.ended_results.clone(),
    )
        .into_response()
}

/// `GET /v1/messages/batches`: newest first; `after_id` (the page after it), `before_id`
/// (the page before it), `limit` 1 to 1000 (20).
pub async fn list(
    State(st): State<Arc<ServerState>>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let jobs = lock(&st).newest_first();
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => 20,
        Some(Ok(n)) if (1..=1000).contains(&n) => n,
        Some(_) => return ApiError::bad("limit: a number from 1 to 1000").into_response(),
    };
    let at = |key: &str| -> Result<Option<usize>, ApiError> {
        match q.get(key) {
            None => Ok(None),
            Some(id) => jobs
                .iter()
                .position(|(k, _)| k == id)
                .map(Some)
                .ok_or_else(|| ApiError::bad(format!("{key}: no message batch {id:?}"))),
        }
    };
    let (from, to, has_more) = match (at("after_id"), at("before_id")) {
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
        (Ok(Some(a)), _) => {
            let from = a + 1;
            let to = (from + limit).min(jobs.len());
            (from, to, to < jobs.len())
        }
        (Ok(None), Ok(Some(b))) => (b.saturating_sub(limit), b, b > limit),
        (Ok(None), Ok(None)) => (0, limit.min(jobs.len()), jobs.len() > limit),
    };
    let base = results_base(&headers, &uri);
    let data: Vec<Value> = jobs[from..to]
        .iter()
        .map(|(_, j)| j.object(&base))
        .collect();
    Json(json!({
        "data": data,
        "has_more": has_more,
        "first_id": jobs[from..to].first().map(|(id, _)| id),
        "last_id": jobs[from..to].last().map(|(id, _)| id),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(v: Value) -> Vec<Item> {
        serde_json::from_value::<Create>(json!({ "requests": v }))
            .unwrap()
            .requests
    }

    #[test]
    fn requests_are_checked_before_any_runs() {
        let ok = json!({"custom_id": "a-1_B", "params": {"max_tokens": 4, "messages": []}});
        assert!(check(&items(json!([ok]))).is_ok());
        for (v, words) in [
            (json!([]), "1 to 100000"),
            (json!([ok, ok]), "requests.1.custom_id"),
            (
                json!([{"custom_id": "", "params": {}}]),
                "requests.0.custom_id",
            ),
            (
                json!([{"custom_id": "a b", "params": {}}]),
                "requests.0.custom_id",
            ),
            (
                json!([{"custom_id": "x".repeat(65), "params": {}}]),
                "requests.0.custom_id",
            ),
            (
                json!([{"custom_id": "a", "params": [1]}]),
                "requests.0.params",
            ),
            (
                json!([{"custom_id": "a", "params": {"stream": true}}]),
                "params.stream",
            ),
        ] {
            let e = check(&items(v)).unwrap_err();
            assert!(e.text().contains(words), "{}", e.text());
        }
    }

    #[test]
    fn results_follow_the_request_host_and_prefix() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "10.0.0.5:8080".parse().unwrap());
        let uri: Uri = "/engines/v1/messages/batches/msgbatch_1".parse().unwrap();
        assert_eq!(
            results_base(&h, &uri),
            "http://10.0.0.5:8080/engines/v1/messages/batches"
        );
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        let uri: Uri = "/v1/messages/batches".parse().unwrap();
        assert_eq!(
            results_base(&h, &uri),
            "https://10.0.0.5:8080/v1/messages/batches"
        );
    }
}
