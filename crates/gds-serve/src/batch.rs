//! `gdsrun batch`: offline batch jobs in the OpenAI Batch API's line format, run by the
//! server's own engine and handlers (no socket): the throughput mode.
//!
//! Input: one JSON object per line, `{"custom_id", "method": "POST", "url", "body"}`, `url`
//! one of `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`,
//! `/v1/embeddings`. Output:
//! one line per input line, in the order they finish, `{"id", "custom_id", "line",
//! "response": {"status_code", "request_id", "body"}, "error": null}` — the body exactly what
//! `gdsrun serve` answers for the same request body — or, for a line that is not a valid
//! request (bad JSON, no `custom_id`, a `custom_id` seen before, another method or url,
//! `stream: true`), `"response": null, "error": {"code", "message"}` naming the line.
//! Requests run concurrently (`--concurrency`, default twice `--max-batch`), so the engine's
//! continuous batching keeps its batch full.
//!
//! Resumable: the output is only appended to, one whole line per write; a rerun reads it
//! first, cuts a last line left incomplete by a kill, and skips every `custom_id` (and every
//! invalid line's number) already there, so each appears exactly once.

use crate::net::NetLimits;
use crate::{start, EngineArgs, Frontend, Started};
use anyhow::Context;
use axum::body::Body;
use clap::Args;
use gds_runtime::RuntimeError;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};
use tower::ServiceExt;

/// Largest input line (a request body and its envelope).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The largest result body of one line (`gdsrun serve`'s default `--max-reply`): a request
/// whose reply passes it gets 400 `reply_too_large` in its line.
pub const MAX_REPLY_BYTES: usize = 256 << 20;

/// The endpoints a batch line may name.
pub(crate) const URLS: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
];

/// `gdsrun batch` flags.
#[derive(Args, Debug)]
pub struct BatchArgs {
    /// The model ([`MODEL_HELP`]).
    #[arg(help = crate::MODEL_HELP)]
    pub model_dir: PathBuf,
    /// Requests, one JSON object per line: {"custom_id", "method": "POST", "url", "body"}.
    #[arg(long, short)]
    pub input: PathBuf,
    /// Results, one JSON object per line, appended (a rerun resumes: lines already there
    /// are skipped).
    #[arg(long, short)]
    pub output: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Requests in flight at once, at least 1 (default: twice --max-batch, so the next ones
    /// are queued when a sequence ends).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

/// What the output already holds.
#[derive(Default)]
struct Done {
    ids: HashSet<String>,
    /// Invalid lines already reported, by line number.
    lines: HashSet<u64>,
}

/// How every line of the output begins (the request's own id first; before 2026-12-05 a
/// line for an invalid input line began with its `custom_id`): what a file's lines must
/// start with for a rerun to append to it.
const LINE_STARTS: [&[u8]; 2] = [b"{\"id\":\"batch_req_", b"{\"custom_id\":"];

/// The longest output line a rerun reads back: a reply at its limit plus what wraps it.
const MAX_OUTPUT_LINE: u64 = (MAX_REPLY_BYTES + MAX_LINE_BYTES) as u64;

/// What a rerun reads of a result line: its ids and whether it is an error; the reply's
/// body is skipped, not parsed into values (with log-probabilities those take ~10x its text).
#[derive(Deserialize)]
struct ResultLine<'a> {
    /// Present on every result line (null for an input line without one).
    #[serde(borrow)]
    custom_id: &'a RawValue,
    line: Option<Value>,
    /// Present on every result line (null for an invalid input line).
    #[serde(rename = "response")]
    _response: IgnoredAny,
    error: Option<IgnoredAny>,
}

/// Reads the output written so far, a line at a time; a last line without its newline (a
/// write cut by a kill) is cut off the file. A file that is not this command's output (a
/// line that is not a result, or a start that is not one) is refused before anything in it
/// is changed: `--output` names a results file, never a file to overwrite.
fn resume(path: &Path, file: &mut File) -> Result<Done, RuntimeError> {
    let io = |e| RuntimeError::file(path, e);
    let not_ours = |what: String| {
        RuntimeError::Usage(format!(
            "{}: {what}, so it is not the output of gdsrun batch; it is left as it is \
             (--output appends to a results file of an earlier run, to resume it)",
            path.display()
        ))
    };
    let len = file.seek(SeekFrom::End(0)).map_err(io)?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    let mut r = BufReader::new(&mut *file);
    let mut done = Done::default();
    let (mut buf, mut whole, mut number) = (Vec::new(), 0u64, 0u64);
    let peek = LINE_STARTS.iter().map(|l| l.len()).max().unwrap_or(0) as u64;
    loop {
        buf.clear();
        // a line's first bytes first: a file that is not ours is known without reading on
        let mut n = r
            .by_ref()
            .take(peek)
            .read_until(b'\n', &mut buf)
            .map_err(io)?;
        if n == 0 {
            break;
        }
        number += 1;
        // (the bytes read may be a torn line's first few)
        let ours = |l: &[u8]| l.starts_with(&buf[..buf.len().min(l.len())]);
        if !LINE_STARTS.iter().any(|l| ours(l)) {
            return Err(not_ours(format!(
                "line {number} does not start as a result line"
            )));
        }
        if buf.last() != Some(&b'\n') {
            n += r
                .by_ref()
                .take(MAX_OUTPUT_LINE + 1 - n as u64)
                .read_until(b'\n', &mut buf)
                .map_err(io)?;
        }
        if buf.last() != Some(&b'\n') {
            if n as u64 > MAX_OUTPUT_LINE {
                return Err(not_ours(format!("line {number} is longer than any result")));
            }
            break; // the torn last line: cut below
        }
        let Ok(v) = serde_json::from_slice::<ResultLine>(&buf[..buf.len() - 1]) else {
            return Err(not_ours(format!("line {number} is not a result line")));
        };
        whole += n as u64;
        // an invalid line is known by its number, a request by its custom_id
        if v.error.is_some() {
            if let Some(n) = v.line.as_ref().and_then(Value::as_u64) {
                done.lines.insert(n);
            }
        } else if let Ok(Some(id)) = serde_json::from_str::<Option<String>>(v.custom_id.get()) {
            done.ids.insert(id);
        }
    }
    drop(r);
    if whole < len {
        file.set_len(whole).map_err(io)?;
    }
    file.seek(SeekFrom::End(0)).map_err(io)?;
    Ok(done)
}

/// The next line of `r` (without its newline), at most [`MAX_LINE_BYTES`]: `Ok(None)` at the
/// end, `Ok(Some(Err(len)))` for a longer line (skipped, its length reported).
fn next_line(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<Result<(), usize>>> {
    buf.clear();
    let n = r
        .by_ref()
        .take(MAX_LINE_BYTES as u64 + 1)
        .read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        return Ok(Some(Ok(())));
    }
    if buf.len() <= MAX_LINE_BYTES {
        // the last line, without a newline
        return Ok(Some(Ok(())));
    }
    // too long: skip to the end of it
    let mut len = buf.len();
    loop {
        buf.clear();
        let n = r.by_ref().take(1 << 20).read_until(b'\n', buf)?;
        len += n;
        if n == 0 || buf.last() == Some(&b'\n') {
            break;
        }
    }
    Ok(Some(Err(len)))
}

fn request_id() -> String {
    format!("{:016x}", crate::error::random_seed())
}

/// Why an input line is not a valid request.
#[derive(Debug)]
pub(crate) struct LineError {
    pub(crate) custom_id: Option<String>,
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

impl LineError {
    fn new(custom_id: Option<&str>, code: &'static str, message: String) -> LineError {
        LineError {
            custom_id: custom_id.map(str::to_string),
            code,
            message,
        }
    }
}

/// The output line for input line `line`, which is not a valid request.
fn invalid(line: u64, e: &LineError) -> String {
    // (a struct, not json!: the fields in the order every output line has, the id first)
    #[derive(Serialize)]
    struct Invalid<'a> {
        id: String,
        custom_id: Option<&'a str>,
        line: u64,
        response: Option<()>,
        error: Value,
    }
    let error = json!({"code": e.code, "message": format!("line {line}: {}", e.message)});
    serde_json::to_string(&Invalid {
        id: format!("batch_req_{}", request_id()),
        custom_id: e.custom_id.as_deref(),
        line,
        response: None,
        error,
    })
    .unwrap_or_default()
}

/// A checked request: (custom_id, url, body).
type Checked = (String, String, Vec<u8>);

/// Checks one input line (the batch API's: `url` must be `endpoint` where one is given).
pub(crate) fn check(
    bytes: &[u8],
    seen: &mut HashSet<String>,
    endpoint: Option<&str>,
) -> Result<Checked, LineError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| LineError::new(None, "invalid_json", format!("not JSON: {e}")))?;
    let id = match v.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => {
            return Err(LineError::new(
                None,
                "invalid_request",
                "custom_id must be a non-empty string".into(),
            ))
        }
    };
    if !seen.insert(id.clone()) {
        return Err(LineError::new(
            Some(&id),
            "duplicate_custom_id",
            format!("custom_id {id:?} appears on an earlier line"),
        ));
    }
    let bad = |m: String| LineError::new(Some(&id), "invalid_request", m);
    match v.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        m => return Err(bad(format!("method must be \"POST\", not {m:?}"))),
    }
    let url = match (v.get("url").and_then(Value::as_str), endpoint) {
        (Some(u), Some(e)) if u == e => u.to_string(),
        (u, Some(e)) => return Err(bad(format!("url {u:?} is not the batch's endpoint {e:?}"))),
        (Some(u), None) if URLS.contains(&u) => u.to_string(),
        (u, None) => return Err(bad(format!("url {u:?} is not one of {}", URLS.join(", ")))),
    };
    let body = match v.get("body") {
        Some(b @ Value::Object(o)) => {
            if o.get("stream") == Some(&Value::Bool(true)) {
                return Err(bad(
                    "a batch request cannot be streamed (stream: true)".into()
                ));
            }
            // (a batch line is answered whole: a response run in the background of a
            // job would be written `queued` and lost with the process)
            if url == "/v1/responses" && o.get("background") == Some(&Value::Bool(true)) {
                return Err(bad(
                    "a batch request cannot run in the background (background: true)".into(),
                ));
            }
            serde_json::to_vec(b).map_err(|e| bad(e.to_string()))?
        }
        _ => return Err(bad("body must be a JSON object".into())),
    };
    Ok((id, url, body))
}

/// The tokens a response body counts in its `usage` (chat/completions' `prompt_tokens` and
/// `completion_tokens`, responses' and messages' `input_tokens` and `output_tokens`), read
/// from its text without building the rest.
#[derive(Default, Clone, Copy, Debug, PartialEq)]
pub(crate) struct Tokens {
    pub(crate) input: u64,
    pub(crate) output: u64,
    /// Prompt tokens the prefix cache held.
    pub(crate) cached: u64,
    pub(crate) reasoning: u64,
}

impl Tokens {
    pub(crate) fn of(body: &RawValue) -> Tokens {
        #[derive(Deserialize)]
        struct Body {
            usage: Option<Usage>,
        }
        #[derive(Deserialize)]
        struct Usage {
            prompt_tokens: Option<u64>,
            completion_tokens: Option<u64>,
            input_tokens: Option<u64>,
            output_tokens: Option<u64>,
            prompt_tokens_details: Option<Details>,
            input_tokens_details: Option<Details>,
            completion_tokens_details: Option<Details>,
            output_tokens_details: Option<Details>,
            // (Anthropic's: the prompt tokens the cache held and made, beside `input_tokens`)
            cache_read_input_tokens: Option<u64>,
            cache_creation_input_tokens: Option<u64>,
        }
        #[derive(Deserialize)]
        struct Details {
            cached_tokens: Option<u64>,
            reasoning_tokens: Option<u64>,
        }
        let Some(u) = serde_json::from_str::<Body>(body.get())
            .ok()
            .and_then(|b| b.usage)
        else {
            return Tokens::default();
        };
        let input = u.prompt_tokens_details.or(u.input_tokens_details);
        let output = u.completion_tokens_details.or(u.output_tokens_details);
        let anthropic =
            u.cache_read_input_tokens.unwrap_or(0) + u.cache_creation_input_tokens.unwrap_or(0);
        Tokens {
            input: u.prompt_tokens.or(u.input_tokens).unwrap_or(0) + anthropic,
            output: u.completion_tokens.or(u.output_tokens).unwrap_or(0),
            cached: input
                .and_then(|d| d.cached_tokens)
                .or(u.cache_read_input_tokens)
                .unwrap_or(0),
            reasoning: output.and_then(|d| d.reasoning_tokens).unwrap_or(0),
        }
    }

    pub(crate) fn add(&mut self, o: Tokens) {
        self.input += o.input;
        self.output += o.output;
        self.cached += o.cached;
        self.reasoning += o.reasoning;
    }
}

/// Answers one request body at `url` through `app` (the server's routes): the status and the
/// body (its JSON text; one that is not JSON as a string).
pub(crate) async fn call(app: axum::Router, url: &str, body: Vec<u8>) -> (u16, Box<RawValue>) {
    let req = axum::http::Request::post(url)
        .header("content-type", "application/json")
        .extension(crate::client::Internal)
        .body(Body::from(body));
    let (status, body) = match req {
        Ok(req) => match app.oneshot(req).await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
                    .await
                    .unwrap_or_default();
                let body = serde_json::from_slice::<Box<RawValue>>(&bytes)
                    .ok()
                    .or_else(|| {
                        serde_json::value::to_raw_value(&String::from_utf8_lossy(&bytes)).ok()
                    });
                (status, body)
            }
            Err(e) => match e {},
        },
        Err(e) => (
            400,
            serde_json::value::to_raw_value(
                &json!({"error": {"message": e.to_string(), "type": "invalid_request_error"}}),
            )
            .ok(),
        ),
    };
    (status, body.unwrap_or_else(|| RawValue::NULL.to_owned()))
}

/// The output line of request `custom_id` (input line `line`) answered `status` with `body`.
pub(crate) fn answer_line(custom_id: &str, line: u64, status: u16, body: Box<RawValue>) -> String {
    let answer = Answer {
        id: format!("batch_req_{}", request_id()),
        custom_id,
        line,
        response: AnswerBody {
            status_code: status,
            request_id: request_id(),
            body,
        },
        error: None,
    };
    serde_json::to_string(&answer).unwrap_or_default()
}

/// One request's line of the output (its body kept as the text the server wrote: a reply
/// with log-probabilities takes ~10x as much once parsed).
#[derive(Serialize)]
struct Answer<'a> {
    id: String,
    custom_id: &'a str,
    line: u64,
    response: AnswerBody,
    error: Option<()>,
}

#[derive(Serialize)]
struct AnswerBody {
    status_code: u16,
    request_id: String,
    body: Box<RawValue>,
}

/// What the run did, for the summary line.
#[derive(Default)]
struct Tally {
    ok: u64,
    failed: u64,
    invalid: u64,
    tokens: u64,
}

/// Runs a batch job; an error reading the input or writing the output names the file
/// (exit 2), a model that cannot be loaded is the model's error (exit 1).
pub fn run(args: BatchArgs) -> anyhow::Result<()> {
    let usage = |m: String| -> anyhow::Result<()> { Err(RuntimeError::Usage(m).into()) };
    if args.concurrency == Some(0) {
        return usage("--concurrency must be at least 1".into());
    }
    // the files first: a job that cannot write its results does not load the model
    // (a FIFO without a writer is refused at once instead of blocking the open)
    let input =
        gds_io::open_user_file(&args.input).map_err(|e| RuntimeError::file(&args.input, e))?;
    let mut out = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(&args.output)
        .map_err(|e| RuntimeError::file(&args.output, e))?;
    if !out
        .metadata()
        .map_err(|e| RuntimeError::file(&args.output, e))?
        .is_file()
    {
        return usage(format!("{}: not a regular file", args.output.display()));
    }
    {
        use std::os::unix::fs::MetadataExt;
        let (a, b) = (
            input
                .metadata()
                .map_err(|e| RuntimeError::file(&args.input, e))?,
            out.metadata()
                .map_err(|e| RuntimeError::file(&args.output, e))?,
        );
        if (a.dev(), a.ino()) == (b.dev(), b.ino()) {
            return usage("--output is the input file".into());
        }
    }
    // one run at a time on an output: two would both answer every request
    match out.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return usage(format!(
                "{}: another gdsrun batch is writing it (one run at a time per output)",
                args.output.display()
            ))
        }
        // (a filesystem without locks: run unlocked, as before)
        Err(std::fs::TryLockError::Error(_)) => {}
    }
    let done = resume(&args.output, &mut out)?;
    // the lines to run, counted first for the progress bar
    let mut total = 0u64;
    {
        let mut r = BufReader::new(&input);
        let mut buf = Vec::new();
        while next_line(&mut r, &mut buf)
            .map_err(|e| RuntimeError::file(&args.input, e))?
            .is_some()
        {
            total += 1;
        }
    }
    let max_batch = args.engine.max_batch.max(1);
    let concurrency = args
        .concurrency
        .unwrap_or(2 * max_batch)
        .clamp(1, args.engine.queue_limit.max(1));
    let Started {
        state,
        engine_thread,
        summary,
    } = start(
        &args.model_dir,
        &args.engine,
        Frontend {
            api_keys: Vec::new(),
            metrics_public: false,
            slots: false,
            slot_save_path: None,
            cors_origins: Vec::new(),
            limits: NetLimits {
                max_connections: 1,
                max_client_connections: 1,
                header_timeout: Duration::from_secs(3600),
                body_timeout: Duration::from_secs(3600),
                max_body: MAX_LINE_BYTES,
                max_reply: MAX_REPLY_BYTES,
            },
            file_storage: 0,
            batch_concurrency: None,
        },
        "gdsrun batch",
    )?;
    eprintln!("gdsrun batch: {summary} | {concurrency} requests in flight");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("gds-batch")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let show = !args.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bar = if show {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} lines | {msg} | {elapsed_precise} ETA {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let app = crate::router(state.clone());
    let t0 = Instant::now();
    let output = args.output.clone();
    let input_path = args.input.clone();
    let skipped = done.ids.len() as u64 + done.lines.len() as u64;
    let outer_bar = bar.clone();
    let result: anyhow::Result<Tally> = rt.block_on(async move {
        // one writer: whole lines, appended in one write each
        let (tx, mut rx) = mpsc::unbounded_channel::<(String, Option<(bool, u64)>)>();
        let writer_bar = bar.clone();
        // (the tally so far comes with an error: what was written before it)
        let writer = tokio::task::spawn_blocking(move || -> (Tally, Option<RuntimeError>) {
            let mut tally = Tally::default();
            while let Some((mut line, outcome)) = rx.blocking_recv() {
                line.push('\n');
                if let Err(e) = out.write_all(line.as_bytes()) {
                    return (tally, Some(RuntimeError::file(&output, e)));
                }
                match outcome {
                    Some((true, tokens)) => {
                        tally.ok += 1;
                        tally.tokens += tokens;
                    }
                    Some((false, _)) => tally.failed += 1,
                    None => tally.invalid += 1,
                }
                let secs = t0.elapsed().as_secs_f64().max(1e-3);
                writer_bar.inc(1);
                writer_bar.set_message(format!(
                    "{} ok, {} failed | {:.1} tok/s",
                    tally.ok,
                    tally.failed + tally.invalid,
                    tally.tokens as f64 / secs
                ));
            }
            let synced = out.sync_data().map_err(|e| RuntimeError::file(&output, e));
            (tally, synced.err())
        });
        let slots = Arc::new(Semaphore::new(concurrency));
        let mut reader = BufReader::new(&input);
        reader
            .seek(SeekFrom::Start(0))
            .map_err(|e| RuntimeError::file(&input_path, e))?;
        let (mut buf, mut seen) = (Vec::new(), HashSet::new());
        let mut line = 0u64;
        let mut tasks = tokio::task::JoinSet::new();
        let mut started = 0u64;
        loop {
            if tx.is_closed() {
                break; // the writer failed
            }
            let next =
                next_line(&mut reader, &mut buf).map_err(|e| RuntimeError::file(&input_path, e))?;
            let Some(next) = next else { break };
            line += 1;
            if done.lines.contains(&line) {
                bar.inc(1);
                continue;
            }
            if let Err(len) = next {
                let msg = format!("{len} bytes, more than {MAX_LINE_BYTES}");
                let e = LineError::new(None, "line_too_long", msg);
                let _ = tx.send((invalid(line, &e), None));
                continue;
            }
            if buf.iter().all(u8::is_ascii_whitespace) {
                // (a blank line is no request; it is counted, not answered)
                bar.inc(1);
                continue;
            }
            let (id, url, body) = match check(&buf, &mut seen, None) {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send((invalid(line, &e), None));
                    continue;
                }
            };
            if done.ids.contains(&id) {
                bar.inc(1);
                continue;
            }
            // a writer that failed (a full disk) ends the job: nothing more is started
            let permit = tokio::select! {
                p = slots.clone().acquire_owned() => p?,
                _ = tx.closed() => break,
            };
            while tasks.try_join_next().is_some() {}
            started += 1;
            let (app, tx) = (app.clone(), tx.clone());
            tasks.spawn(async move {
                let _permit = permit;
                let (status, body) = call(app, &url, body).await;
                let ok = (200..300).contains(&status);
                let tokens = Tokens::of(&body).output;
                let _ = tx.send((answer_line(&id, line, status, body), Some((ok, tokens))));
            });
        }
        if tx.is_closed() {
            // the writer failed: the requests in flight are cancelled (their replies have
            // nowhere to go), and its error is the job's
            tasks.abort_all();
        }
        while tasks.join_next().await.is_some() {}
        drop(tx);
        let (tally, failed) = writer.await?;
        if let Some(e) = failed {
            let written = tally.ok + tally.failed + tally.invalid;
            eprintln!(
                "gdsrun batch: stopped writing after {written} lines of {}: {started} requests \
                 started, the rest not run; a rerun resumes",
                total - skipped
            );
            return Err(e.into());
        }
        Ok(tally)
    });
    outer_bar.finish_and_clear();
    drop(rt);
    drop(state);
    let _ = engine_thread.join();
    let tally = result?;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "gdsrun batch: {} ok, {} failed, {} invalid lines, {skipped} already in {} | {} tokens in {secs:.1} s ({:.1} tok/s)",
        tally.ok,
        tally.failed,
        tally.invalid,
        args.output.display(),
        tally.tokens,
        tally.tokens as f64 / secs.max(1e-3),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The output file as `run` opens it.
    fn open_output(p: &Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .open(p)
            .unwrap()
    }

    #[test]
    fn lines_are_checked_and_named() {
        let mut seen = HashSet::new();
        let ok = br#"{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}"#;
        let (id, url, _) = check(ok, &mut seen, None).unwrap();
        assert_eq!((id.as_str(), url.as_str()), ("a", "/v1/completions"));
        for (bytes, code, words) in [
            (&ok[..], "duplicate_custom_id", "earlier line"),
            (b"{nope", "invalid_json", "not JSON"),
            (br#"{"method": "POST"}"#, "invalid_request", "custom_id"),
            (br#"{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}"#, "invalid_request", "POST"),
            (br#"{"custom_id": "c", "method": "POST", "url": "/v1/moderations", "body": {}}"#, "invalid_request", "url"),
            (br#"{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"stream": true}}"#, "invalid_request", "streamed"),
            (br#"{"custom_id": "f", "method": "POST", "url": "/v1/responses", "body": {"input": "x", "background": true}}"#, "invalid_request", "background"),
            (br#"{"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": []}"#, "invalid_request", "object"),
        ] {
            let line: Value = serde_json::from_str(&invalid(7, &check(bytes, &mut seen, None).unwrap_err())).unwrap();
            assert_eq!(line["error"]["code"], code, "{line}");
            let msg = line["error"]["message"].as_str().unwrap();
            assert!(msg.starts_with("line 7: ") && msg.contains(words), "{msg}");
            assert!(line["response"].is_null() && line["line"] == 7, "{line}");
        }
    }

    #[test]
    fn usage_is_read_from_every_api_shape() {
        let of = |v: Value| Tokens::of(&serde_json::value::to_raw_value(&v).unwrap());
        let openai = json!({"usage": {"prompt_tokens": 9, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 3},
            "completion_tokens_details": {"reasoning_tokens": 2}}});
        let want = Tokens {
            input: 9,
            output: 4,
            cached: 3,
            reasoning: 2,
        };
        assert_eq!(of(openai), want);
        let responses = json!({"usage": {"input_tokens": 9, "output_tokens": 4,
            "input_tokens_details": {"cached_tokens": 3},
            "output_tokens_details": {"reasoning_tokens": 2}}});
        assert_eq!(of(responses), want);
        // Anthropic's input_tokens leave out what the cache read
        let anthropic = json!({"usage": {"input_tokens": 6, "output_tokens": 4,
            "cache_read_input_tokens": 3, "cache_creation_input_tokens": 0}});
        assert_eq!(
            of(anthropic),
            Tokens {
                reasoning: 0,
                ..want
            }
        );
        assert_eq!(of(json!({"error": {}})), Tokens::default());
        let mut sum = want;
        sum.add(want);
        assert_eq!(
            sum,
            Tokens {
                input: 18,
                output: 8,
                cached: 6,
                reasoning: 4
            }
        );
    }

    #[test]
    fn resume_cuts_a_torn_line_and_knows_what_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        std::fs::write(
            &p,
            concat!(
                r#"{"id":"batch_req_1","custom_id":"a","line":1,"response":{"status_code":200},"error":null}"#,
                "\n",
                // (an invalid line as runs before 2026-12-05 wrote it: the keys sorted)
                r#"{"custom_id":null,"error":{"code":"invalid_json"},"id":"batch_req_2","line":4,"response":null}"#,
                "\n",
                r#"{"id":"batch_req_3","custom_id":"a","line":5,"response":null,"error":{"code":"duplicate_custom_id"}}"#,
                "\n",
                r#"{"id":"batch_req_4","custom_id":"b","line":2,"resp"#,
            ),
        )
        .unwrap();
        let mut f = open_output(&p);
        let done = resume(&p, &mut f).unwrap();
        assert_eq!(done.ids, HashSet::from(["a".to_string()]));
        assert_eq!(done.lines, HashSet::from([4, 5]));
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.ends_with("\"duplicate_custom_id\"}}\n"), "{text}");
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn resume_leaves_a_file_that_is_not_its_output_alone() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out");
        let ours = r#"{"id":"batch_req_1","custom_id":"a","line":1,"response":{"status_code":200},"error":null}"#;
        let mut binary: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8 + 1).collect();
        binary.retain(|&b| b != b'\n');
        for (bytes, words) in [
            (
                b"notes 1\nnotes 2 without newline".to_vec(),
                "line 1 does not start",
            ),
            (binary, "line 1 does not start"),
            (b"{\"a\":1}\n".to_vec(), "line 1 does not start"),
            (b"\n".to_vec(), "line 1 does not start"),
            (
                format!("{ours}\ngarbage\n").into_bytes(),
                "line 2 does not start",
            ),
            (
                format!("{ours}\nlast words").into_bytes(),
                "line 2 does not start",
            ),
            (
                format!("{ours}\n{{\"id\":\"batch_req_2\",\"custom_id\":\"b\"}}\n").into_bytes(),
                "line 2 is not a result line",
            ),
        ] {
            std::fs::write(&p, &bytes).unwrap();
            let mut f = open_output(&p);
            let Err(RuntimeError::Usage(msg)) = resume(&p, &mut f) else {
                panic!(
                    "appended to {:?}",
                    String::from_utf8_lossy(&bytes[..40.min(bytes.len())])
                );
            };
            assert!(
                msg.contains(words) && msg.contains("not the output of gdsrun batch"),
                "{msg}"
            );
            assert_eq!(std::fs::read(&p).unwrap(), bytes, "changed by the refusal");
        }
        // a torn first line, however short, is the start of a result: cut
        for torn in [&b"{\"id"[..], b"{\"id\":\"batch_req_9f", b"{"] {
            std::fs::write(&p, torn).unwrap();
            let mut f = open_output(&p);
            let done = resume(&p, &mut f).unwrap();
            assert!(done.ids.is_empty() && done.lines.is_empty());
            assert_eq!(std::fs::metadata(&p).unwrap().len(), 0);
        }
    }

    #[test]
    fn long_lines_are_skipped_whole() {
        let mut data = b"short\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 10));
        data.extend(b"\nlast");
        let mut r = BufReader::new(&data[..]);
        let mut buf = Vec::new();
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some(Ok(())));
        assert_eq!(buf, b"short");
        assert_eq!(
            next_line(&mut r, &mut buf).unwrap(),
            Some(Err(MAX_LINE_BYTES + 11))
        );
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some(Ok(())));
        assert_eq!(buf, b"last");
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), None);
    }
}
