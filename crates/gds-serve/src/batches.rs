//! OpenAI's Batch API on the server: `POST /v1/batches` runs an uploaded file of requests
//! (`gdsrun batch`'s line format, [`crate::batch`]) in the background, `GET
//! /v1/batches/{id}` follows it (`validating`, `in_progress`, `finalizing`, then `completed`,
//! `failed` or, after `POST /v1/batches/{id}/cancel`, `cancelling` and `cancelled`), `GET
//! /v1/batches` lists them newest first. The answers are files ([`crate::files`]): the
//! output file holds the lines answered 2xx, the error file the others, each line as `gdsrun
//! batch` writes it (`id`, `custom_id`, `response{status_code, request_id, body}`), in the
//! order they finished.
//!
//! As OpenAI's, the whole input is checked first (JSON, a unique `custom_id`, `POST`, the
//! batch's endpoint as `url`, an object `body`, not streamed): one bad line fails the batch
//! with every bad line listed in `errors` and nothing run. Each request then goes through the
//! server's own routes, as a client's would (the same answers), but as no client address: the
//! engine shares its batch between the batches together and each client, so a batch never
//! holds a client's requests behind all of its own. At most `--batch-concurrency` batch
//! requests are in the engine at once (all batches together); a request the full queue
//! refuses (429) is tried again, not failed. Kept in memory: the last [`MAX_BATCHES`]; a
//! batch that is still running is never dropped; all gone when the server stops (`gdsrun
//! batch` is the resumable form). `completion_window` is `24h` as OpenAI's, and `expires_at`
//! says so, but a local batch is not expired: it runs to its end.

use crate::api::{now_secs, ApiError};
use crate::batch::{self, Tokens, MAX_LINE_BYTES};
use crate::files;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Most batches kept (the oldest finished one dropped for a new one).
pub(crate) const MAX_BATCHES: usize = 1024;

/// Most bad lines a failed batch lists in `errors`.
const MAX_ERRORS: usize = 1000;

/// How long a request refused by the full queue waits before it is sent again (doubled each
/// time, up to a second).
const RETRY_FIRST: Duration = Duration::from_millis(50);

#[derive(Serialize, Clone, Default)]
struct Counts {
    total: u64,
    completed: u64,
    failed: u64,
}

/// A batch's object, as OpenAI answers it.
#[derive(Serialize, Clone)]
struct BatchObject {
    id: String,
    object: &'static str,
    endpoint: String,
    model: String,
    errors: Option<Value>,
    input_file_id: String,
    completion_window: String,
    status: &'static str,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    created_at: u64,
    in_progress_at: Option<u64>,
    expires_at: Option<u64>,
    finalizing_at: Option<u64>,
    completed_at: Option<u64>,
    failed_at: Option<u64>,
    expired_at: Option<u64>,
    cancelling_at: Option<u64>,
    cancelled_at: Option<u64>,
    request_counts: Counts,
    usage: Value,
    metadata: Value,
}

/// A batch and what it has answered so far.
struct JobState {
    object: BatchObject,
    /// Result lines answered 2xx, and the others.
    output: Vec<u8>,
    errors: Vec<u8>,
    tokens: Tokens,
    /// A result did not fit in the file storage: the batch stopped.
    full: bool,
}

pub(crate) struct Job {
    state: Mutex<JobState>,
    /// Set by a cancel (or a full storage): nothing more is started, the requests running are
    /// dropped.
    stop: watch::Sender<bool>,
}

impl Job {
    fn lock(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn object(&self) -> BatchObject {
        let s = self.lock();
        let mut o = s.object.clone();
        o.usage = usage(&s.tokens);
        o
    }
}

fn finished(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "cancelled" | "expired")
}

/// Batches by id, in the order they were made (OpenAI's and Anthropic's each keep one): at
/// most [`MAX_BATCHES`], the oldest that has ended dropped for a new one.
pub(crate) struct Jobs<J> {
    jobs: HashMap<String, Arc<J>>,
    order: Vec<String>,
}

impl<J> Default for Jobs<J> {
    fn default() -> Self {
        Jobs {
            jobs: HashMap::new(),
            order: Vec::new(),
        }
    }
}

impl<J> Jobs<J> {
    /// Keeps `job` as the newest; where [`MAX_BATCHES`] are kept, the oldest one `ended`
    /// says has ended is dropped (and returned). `Err` (429) where none has: nothing kept.
    pub(crate) fn insert(
        &mut self,
        id: String,
        job: Arc<J>,
        ended: impl Fn(&J) -> bool,
    ) -> Result<Option<Arc<J>>, ApiError> {
        let mut dropped = None;
        if self.jobs.len() >= MAX_BATCHES {
            let jobs = &self.jobs;
            let Some(at) = self
                .order
                .iter()
                .position(|id| jobs.get(id).is_none_or(|j| ended(j)))
            else {
                return Err(ApiError::status(
                    axum::http::StatusCode::TOO_MANY_REQUESTS,
                    "server_busy",
                    format!("{MAX_BATCHES} batches are running; retry when one has ended"),
                ));
            };
            let old = self.order.remove(at);
            dropped = self.jobs.remove(&old);
        }
        self.order.push(id.clone());
        self.jobs.insert(id, job);
        Ok(dropped)
    }

    pub(crate) fn get(&self, id: &str) -> Option<Arc<J>> {
        self.jobs.get(id).cloned()
    }

    pub(crate) fn remove(&mut self, id: &str) -> Option<Arc<J>> {
        self.order.retain(|k| k != id);
        self.jobs.remove(id)
    }

    /// The batches, newest first.
    pub(crate) fn newest_first(&self) -> Vec<(String, Arc<J>)> {
        self.order
            .iter()
            .rev()
            .filter_map(|id| self.jobs.get(id).map(|j| (id.clone(), j.clone())))
            .collect()
    }
}

/// OpenAI's batches.
pub(crate) type BatchStore = Jobs<Job>;

fn lock(st: &ServerState) -> std::sync::MutexGuard<'_, BatchStore> {
    st.batches.lock().unwrap_or_else(|e| e.into_inner())
}

fn usage(t: &Tokens) -> Value {
    json!({
        "input_tokens": t.input,
        "input_tokens_details": {"cached_tokens": t.cached},
        "output_tokens": t.output,
        "output_tokens_details": {"reasoning_tokens": t.reasoning},
        "total_tokens": t.input + t.output,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Create {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    metadata: Option<Value>,
    output_expires_after: Option<Expiry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Expiry {
    anchor: Option<String>,
    seconds: Option<u64>,
}

/// `POST /v1/batches`.
pub async fn create(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    match start(&st, &body) {
        Ok(o) => Json(o).into_response(),
        Err(e) => e.into_response(),
    }
}

fn start(st: &Arc<ServerState>, body: &[u8]) -> Result<BatchObject, ApiError> {
    let c: Create = crate::api::parse(body)?;
    if !batch::URLS.contains(&c.endpoint.as_str()) {
        return Err(ApiError::bad(format!(
            "endpoint {:?} is not one of {}",
            c.endpoint,
            batch::URLS.join(", ")
        ))
        .param("endpoint"));
    }
    if c.completion_window != "24h" {
        return Err(ApiError::bad("completion_window must be \"24h\"").param("completion_window"));
    }
    let metadata = crate::items::metadata(c.metadata.as_ref())?;
    let out_expiry = match &c.output_expires_after {
        None => None,
        Some(e) => files::expiry(
            e.anchor.as_deref(),
            Some(&e.seconds.map_or_else(String::new, |s| s.to_string())),
            "output_expires_after",
        )?,
    };
    let (file, input) = files::lock(st)
        .get(&c.input_file_id)
        .ok_or_else(|| files::not_found(&c.input_file_id).param("input_file_id"))?;
    if file.purpose != "batch" {
        return Err(ApiError::bad(format!(
            "file {:?} was uploaded for {:?}; a batch's input is uploaded with purpose \"batch\"",
            file.id, file.purpose
        ))
        .param("input_file_id"));
    }
    let now = now_secs();
    let object = BatchObject {
        id: format!(
            "batch_{:016x}{:08x}",
            crate::error::random_seed(),
            crate::error::random_seed() as u32
        ),
        object: "batch",
        endpoint: c.endpoint.clone(),
        model: st.model_name().to_string(),
        errors: None,
        input_file_id: file.id,
        completion_window: c.completion_window,
        status: "validating",
        output_file_id: None,
        error_file_id: None,
        created_at: now,
        in_progress_at: None,
        expires_at: Some(now + 24 * 3600),
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        request_counts: Counts::default(),
        usage: usage(&Tokens::default()),
        metadata,
    };
    let job = Arc::new(Job {
        state: Mutex::new(JobState {
            object: object.clone(),
            output: Vec::new(),
            errors: Vec::new(),
            tokens: Tokens::default(),
            full: false,
        }),
        stop: watch::channel(false).0,
    });
    lock(st).insert(object.id.clone(), job.clone(), |j| {
        finished(j.lock().object.status)
    })?;
    tokio::spawn(run(st.clone(), job, input, c.endpoint, out_expiry));
    Ok(object)
}

/// A line to run: its number and where it lies in the input.
type Line = (u64, std::ops::Range<usize>);

/// Checks every line of `input` as a request to `endpoint`: the lines to run, or the bad
/// lines as OpenAI lists them (`code`, `message`, `param`, `line`; at most [`MAX_ERRORS`])
/// with how many there were.
fn validate(input: &[u8], endpoint: &str) -> Result<Vec<Line>, (Vec<Value>, usize)> {
    let (mut lines, mut errors, mut bad) = (Vec::new(), Vec::new(), 0usize);
    let mut seen = HashSet::new();
    let mut start = 0usize;
    for (i, piece) in input.split(|&b| b == b'\n').enumerate() {
        let range = start..start + piece.len();
        start = range.end + 1;
        let n = i as u64 + 1;
        if piece.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let checked = if piece.len() > MAX_LINE_BYTES {
            Err((
                "line_too_long",
                format!("{} bytes, more than {MAX_LINE_BYTES}", piece.len()),
            ))
        } else {
            batch::check(piece, &mut seen, Some(endpoint)).map_err(|e| (e.code, e.message))
        };
        match checked {
            Ok(_) => lines.push((n, range)),
            Err((code, message)) => {
                bad += 1;
                if errors.len() < MAX_ERRORS {
                    errors.push(json!({"code": code, "message": format!("line {n}: {message}"), "param": null, "line": n}));
                }
            }
        }
    }
    if bad > 0 {
        return Err((errors, bad));
    }
    if lines.is_empty() {
        let e = json!({"code": "empty_file", "message": "the input file holds no request", "param": null, "line": null});
        return Err((vec![e], 1));
    }
    Ok(lines)
}

/// Runs a batch: checks its input, sends its requests, writes its result files.
async fn run(
    st: Arc<ServerState>,
    job: Arc<Job>,
    input: Bytes,
    endpoint: String,
    out_expiry: Option<u64>,
) {
    let checked = {
        let (input, endpoint) = (input.clone(), endpoint.clone());
        tokio::task::spawn_blocking(move || validate(&input, &endpoint)).await
    };
    let lines = match checked {
        Ok(Ok(lines)) => lines,
        Ok(Err((errors, _))) => {
            let mut s = job.lock();
            s.object.status = "failed";
            s.object.failed_at = Some(now_secs());
            s.object.errors = Some(json!({"object": "list", "data": errors}));
            return;
        }
        Err(e) => {
            let mut s = job.lock();
            s.object.status = "failed";
            s.object.failed_at = Some(now_secs());
            let e = json!({"code": "server_error", "message": format!("checking the input: {e}"), "param": null, "line": null});
            s.object.errors = Some(json!({"object": "list", "data": [e]}));
            return;
        }
    };
    {
        let mut s = job.lock();
        s.object.request_counts.total = lines.len() as u64;
        if s.object.status == "validating" {
            s.object.status = "in_progress";
            s.object.in_progress_at = Some(now_secs());
        }
    }
    let mut stop = job.stop.subscribe();
    let requests = lines.into_iter().filter_map(|(n, range)| {
        // (checked whole before: a line that passed then passes now)
        let (id, url, body) = batch::check(&input[range], &mut HashSet::new(), None).ok()?;
        Some((id, n, url, body))
    });
    let recorder = {
        let (st, job) = (st.clone(), job.clone());
        move |id: &str, n: u64, status: u16, reply: Box<RawValue>| {
            record(&st, &job, id, n, status, reply)
        }
    };
    drive(&st, &mut stop, requests, recorder).await;
    finish(&st, &job, out_expiry);
}

/// Sends a batch's requests (`custom_id`, its number, the url, the body) through the
/// server's routes, at most `--batch-concurrency` of all batches' at once, each yielding to
/// clients' requests in the engine ([`crate::scheduler::Request::background`]), each answer
/// handed to `record`; a request the full queue refuses (429) is sent again. Ends when every request
/// is answered, or at once when `stop` is set: nothing more is started and the requests
/// running are dropped (the engine then stops them), unrecorded.
pub(crate) async fn drive(
    st: &Arc<ServerState>,
    stop: &mut watch::Receiver<bool>,
    requests: impl Iterator<Item = (String, u64, String, Vec<u8>)> + Send,
    record: impl Fn(&str, u64, u16, Box<RawValue>) + Clone + Send + Sync + 'static,
) {
    let app = crate::router(st.clone());
    let mut tasks = tokio::task::JoinSet::new();
    for (id, n, url, body) in requests {
        let permit = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            p = st.batch_slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        if *stop.borrow() {
            break;
        }
        while tasks.try_join_next().is_some() {}
        let (app, record) = (app.clone(), record.clone());
        tasks.spawn(async move {
            let _permit = permit;
            let mut wait = RETRY_FIRST;
            loop {
                let call = batch::call(app.clone(), &url, body.clone());
                let (status, reply) = crate::client::BACKGROUND.scope(true, call).await;
                if status == 429 {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(1));
                    continue;
                }
                record(&id, n, status, reply);
                break;
            }
        });
    }
    if *stop.borrow() {
        tasks.abort_all();
    }
    while tasks.join_next().await.is_some() {}
}

/// Adds a request's result line to its batch's output (2xx) or error file.
fn record(
    st: &ServerState,
    job: &Job,
    id: &str,
    n: u64,
    status: u16,
    reply: Box<serde_json::value::RawValue>,
) {
    let ok = (200..300).contains(&status);
    let tokens = if ok {
        Tokens::of(&reply)
    } else {
        Tokens::default()
    };
    let mut line = batch::answer_line(id, n, status, reply).into_bytes();
    line.push(b'\n');
    let fits = files::lock(st).reserve(line.len());
    let mut s = job.lock();
    if !fits {
        if !s.full {
            s.full = true;
            job.stop.send_replace(true);
        }
        return;
    }
    if ok {
        s.output.extend_from_slice(&line);
        s.object.request_counts.completed += 1;
        s.tokens.add(tokens);
    } else {
        s.errors.extend_from_slice(&line);
        s.object.request_counts.failed += 1;
    }
}

/// Writes a batch's result files and its end: `completed`, `cancelled`, or `failed` where its
/// results outgrew the file storage.
fn finish(st: &ServerState, job: &Job, out_expiry: Option<u64>) {
    let (id, output, errors) = {
        let mut s = job.lock();
        s.object.status = "finalizing";
        s.object.finalizing_at = Some(now_secs());
        (
            s.object.id.clone(),
            std::mem::take(&mut s.output),
            std::mem::take(&mut s.errors),
        )
    };
    let file = |name: String, content: Vec<u8>| -> Option<String> {
        if content.is_empty() {
            return None;
        }
        // (its bytes were counted as they came: `add` with them reserved cannot fail)
        files::lock(st)
            .add(name, "batch_output", out_expiry, Bytes::from(content), true)
            .ok()
            .map(|f| f.id)
    };
    let output_file = file(format!("batch_{id}_output.jsonl"), output);
    let error_file = file(format!("batch_{id}_error.jsonl"), errors);
    let mut s = job.lock();
    let now = Some(now_secs());
    s.object.output_file_id = output_file;
    s.object.error_file_id = error_file;
    if s.full {
        s.object.status = "failed";
        s.object.failed_at = now;
        let e = json!({"code": "storage_full", "message": "the results outgrew the file storage (--file-storage): the batch stopped; the results that fit are in its files", "param": null, "line": null});
        s.object.errors = Some(json!({"object": "list", "data": [e]}));
    } else if s.object.cancelling_at.is_some() {
        s.object.status = "cancelled";
        s.object.cancelled_at = now;
    } else {
        s.object.status = "completed";
        s.object.completed_at = now;
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no batch {id:?}")).param("batch_id")
}

fn job(st: &ServerState, id: &str) -> Result<Arc<Job>, ApiError> {
    lock(st).get(id).ok_or_else(|| not_found(id))
}

/// `GET /v1/batches/{id}`.
pub async fn retrieve(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    match job(&st, &id) {
        Ok(j) => Json(j.object()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/batches/{id}/cancel`: a batch validating or running stops starting requests
/// and drops those running; what was answered before is in its files once it is `cancelled`.
pub async fn cancel(State(st): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    let j = match job(&st, &id) {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    {
        let mut s = j.lock();
        match s.object.status {
            "validating" | "in_progress" => {
                s.object.status = "cancelling";
                s.object.cancelling_at = Some(now_secs());
                j.stop.send_replace(true);
            }
            "cancelling" | "cancelled" => {}
            other => {
                return ApiError::bad(format!("batch {id:?} is {other}: it cannot be cancelled"))
                    .into_response()
            }
        }
    }
    Json(j.object()).into_response()
}

/// `GET /v1/batches`: newest first, `after` an id, `limit` 1 to 100 (20).
pub async fn list(
    State(st): State<Arc<ServerState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let mut jobs = lock(&st).newest_first();
    // (oldest first, as items::page takes them)
    jobs.reverse();
    let data = jobs.iter().map(|(_, j)| json!(j.object())).collect();
    match crate::items::page(data, &q, "the batches") {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_drops_the_oldest_ended_batch_and_never_a_running_one() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let mut jobs: Jobs<AtomicBool> = Jobs::default();
        let ended = |j: &AtomicBool| j.load(Ordering::Relaxed);
        for i in 0..MAX_BATCHES {
            let j = Arc::new(AtomicBool::new(false));
            assert!(jobs.insert(format!("b{i}"), j, ended).unwrap().is_none());
        }
        let e = jobs
            .insert("new".into(), Arc::new(AtomicBool::new(false)), ended)
            .unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        jobs.get("b7").unwrap().store(true, Ordering::Relaxed);
        jobs.get("b9").unwrap().store(true, Ordering::Relaxed);
        let dropped = jobs
            .insert("new".into(), Arc::new(AtomicBool::new(false)), ended)
            .unwrap();
        assert!(dropped.is_some() && jobs.get("b7").is_none() && jobs.get("b9").is_some());
        let newest = jobs.newest_first();
        assert_eq!(newest.len(), MAX_BATCHES);
        assert_eq!(
            (newest[0].0.as_str(), newest[1].0.as_str()),
            ("new", "b1023")
        );
        assert!(jobs.remove("b9").is_some() && jobs.newest_first().len() == MAX_BATCHES - 1);
    }

    #[test]
    fn a_file_is_checked_whole_and_every_bad_line_named() {
        let ok = |id: &str| {
            format!(
                r#"{{"custom_id": "{id}", "method": "POST", "url": "/v1/completions", "body": {{"prompt": "x"}}}}"#
            )
        };
        let good = format!("{}\n\n{}\r\n", ok("a"), ok("b"));
        let lines = validate(good.as_bytes(), "/v1/completions").unwrap();
        assert_eq!(lines.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(&good.as_bytes()[lines[0].1.clone()], ok("a").as_bytes());
        let (errors, n) = validate(good.as_bytes(), "/v1/chat/completions").unwrap_err();
        assert_eq!(n, 2);
        assert!(
            errors[0]["message"].as_str().unwrap().contains("endpoint"),
            "{errors:?}"
        );
        let bad = format!("{}\n{{nope\n{}\n", ok("a"), ok("a"));
        let (errors, n) = validate(bad.as_bytes(), "/v1/completions").unwrap_err();
        assert_eq!(n, 2);
        assert_eq!(errors[0]["line"], 2);
        assert_eq!(errors[0]["code"], "invalid_json");
        assert_eq!(errors[1]["line"], 3);
        assert_eq!(errors[1]["code"], "duplicate_custom_id");
        let (errors, _) = validate(b"\n \n", "/v1/completions").unwrap_err();
        assert_eq!(errors[0]["code"], "empty_file");
    }
}
