//! OpenAI's Files and Batch APIs on the server (`/v1/files`, `/v1/batches`).

use crate::common::{get_ok, http, metric, python, serial, start, wait_for_metrics};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Uploads `content` to the Files API (purpose `batch`): the file's id.
fn upload(addr: &str, content: &str) -> String {
    use std::io::{Read, Write};
    let b = "bOuNdArY";
    let form = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n{content}\r\n--{b}--\r\n"
    );
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={b}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        form.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(form.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = c.read_to_string(&mut answer);
    let body = answer.split_once("\r\n\r\n").map_or("", |x| x.1);
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}

/// Uploads `bodies` as `/v1/completions` lines (`custom_id` `r0`, `r1`, ...) and starts a
/// batch of them: its id.
fn start_batch(addr: &str, bodies: &[Value]) -> String {
    let lines: String = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| {
            json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/completions", "body": b})
                .to_string()
                + "\n"
        })
        .collect();
    let file = upload(addr, &lines);
    let create =
        json!({"input_file_id": file, "endpoint": "/v1/completions", "completion_window": "24h"});
    let (status, text) = http(
        addr,
        "POST",
        "/v1/batches",
        Some(create.to_string().as_bytes()),
    );
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["id"].as_str().unwrap().to_string()
}

/// A batch job's requests yield to a client's: with one sequence at a time (`--max-batch
/// 1`), a client's short request sent while a batch's long one runs is answered before that
/// one ends — the batch's is preempted (`gds_preemptions_total`) and recomputed after it —
/// and each of the batch's answers is still the one the same request gets directly.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_batch_yields_to_a_clients_request() {
    let _one = serial();
    let s = start(&["--max-batch", "1", "--ctx", "512"]);
    let bodies: Vec<Value> = (0..2)
        .map(|i| json!({"prompt": format!("Story {i}: once upon a time"), "max_tokens": 160, "ignore_eos": true, "temperature": 0}))
        .collect();
    let id = start_batch(&s.addr, &bodies);
    // the batch's first request in the engine, a few tokens made
    wait_for_metrics(&s.addr, "the batch never ran", |m| {
        metric(m, "gds_requests_running") >= 1.0 && metric(m, "gds_generated_tokens_total") >= 8.0
    });
    let mine = json!({"prompt": "Hi", "max_tokens": 4, "ignore_eos": true});
    let (status, text) = http(
        &s.addr,
        "POST",
        "/v1/completions",
        Some(mine.to_string().as_bytes()),
    );
    assert_eq!(status, 200, "{text}");
    let b = get_ok(&s.addr, &format!("/v1/batches/{id}"));
    assert_eq!(
        b["request_counts"]["completed"], 0,
        "the client waited for the batch: {b}"
    );
    let m = http(&s.addr, "GET", "/metrics", None).1;
    assert!(metric(&m, "gds_preemptions_total") >= 1.0, "{m}");
    // the batch goes on to the same answers
    let t0 = Instant::now();
    let b = loop {
        let b = get_ok(&s.addr, &format!("/v1/batches/{id}"));
        if b["status"] == "completed" {
            break b;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "{b}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (_, out) = http(
        &s.addr,
        "GET",
        &format!(
            "/v1/files/{}/content",
            b["output_file_id"].as_str().unwrap()
        ),
        None,
    );
    let out: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(out.len(), 2, "{out:?}");
    for line in &out {
        let i: usize = line["custom_id"].as_str().unwrap()[1..].parse().unwrap();
        let (_, direct) = http(
            &s.addr,
            "POST",
            "/v1/completions",
            Some(bodies[i].to_string().as_bytes()),
        );
        let direct: Value = serde_json::from_str(&direct).unwrap();
        let got = &line["response"]["body"]["choices"][0]["text"];
        assert_eq!(got, &direct["choices"][0]["text"], "{line}");
        assert_eq!(line["response"]["body"]["usage"]["completion_tokens"], 160);
    }
}

/// The official `openai` client uploads, runs, follows, cancels and lists batches; each
/// result equals the same request sent directly (`tests/py/serve_batch_check.py`, which
/// names every check), through a server with an API key and one with a small file storage.
#[test]
#[ignore = "tier 2: needs the fetched models and the openai package (scripts/test.sh)"]
fn batches_through_the_openai_client() {
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let s = start(&["--api-key", "secret", "--max-batch", "4"]);
    let small = start(&["--file-storage", "4KiB"]);
    let r = python(
        "serve_batch_check.py",
        &[
            &format!("http://{}/v1", s.addr),
            "secret",
            &format!("http://{}/v1", small.addr),
        ],
    );
    eprintln!("{r}");
    assert_eq!(r["chat"], 5, "{r}");
    assert_eq!(r["completions"], 3, "{r}");
    assert_eq!(r["bad_lines"], 3, "{r}");
}

/// An upload that is not a multipart form, or has no file, is a 400 in OpenAI's shape; one
/// whose Content-Length passes the free file storage is a 413 before its body is read (the
/// same for an Anthropic message batch); a batch body with an unknown field or a bad
/// `output_expires_after` names it.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn bad_uploads_and_batch_bodies_are_named() {
    let s = start(&["--file-storage", "1MiB", "--max-body", "64KiB"]);
    for path in ["/v1/files", "/v1/messages/batches"] {
        // (the head alone: the answer comes without the body being sent)
        let mut c = std::net::TcpStream::connect(&s.addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: {}\r\n\r\n",
            2 << 20
        );
        std::io::Write::write_all(&mut c, head.as_bytes()).unwrap();
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(&mut c, &mut answer);
        assert!(answer.starts_with("HTTP/1.1 413"), "{path}: {answer}");
        assert!(answer.contains("--file-storage"), "{path}: {answer}");
    }
    // (an upload may pass --max-body where the storage has room)
    let boundary = "XyZ";
    let content = "x".repeat(200 << 10);
    let form = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n{content}\r\n--{boundary}--\r\n"
    );
    let mut c = std::net::TcpStream::connect(&s.addr).unwrap();
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        form.len()
    );
    std::io::Write::write_all(&mut c, head.as_bytes()).unwrap();
    std::io::Write::write_all(&mut c, form.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut c, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains(&format!("\"bytes\":{}", 200 << 10)),
        "{answer}"
    );
    let (status, body) = http(&s.addr, "POST", "/v1/files", Some(b"{\"file\": 1}"));
    assert_eq!(status, 400, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"]["message"].as_str().is_some(), "{body}");
    for (body, words) in [
        (
            r#"{"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h", "extra": 1}"#,
            "extra",
        ),
        (
            r#"{"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h", "output_expires_after": {"anchor": "created_at", "seconds": 5}}"#,
            "output_expires_after",
        ),
        (
            r#"{"endpoint": "/v1/completions", "completion_window": "24h"}"#,
            "input_file_id",
        ),
        (r#"[]"#, ""),
    ] {
        let (status, text) = http(&s.addr, "POST", "/v1/batches", Some(body.as_bytes()));
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(words), "{body}: {text}");
    }
    for path in [
        "/v1/batches/batch_nope",
        "/v1/files/file-nope",
        "/v1/files/file-nope/content",
    ] {
        let (status, text) = http(&s.addr, "GET", path, None);
        assert_eq!(status, 404, "{path}: {text}");
    }
}

/// Anthropic's Message Batches API through the official `anthropic` client
/// (`tests/py/serve_msgbatch_check.py`, which names every check): results equal to the same
/// requests sent to `/v1/messages`, errored requests with Anthropic's error, cancel, delete,
/// list pages, refusals, through a server with an API key.
#[test]
#[ignore = "tier 2: needs the fetched models and the anthropic package (scripts/test.sh)"]
fn message_batches_through_the_anthropic_client() {
    let s = start(&["--api-key", "secret", "--max-batch", "4"]);
    let r = python(
        "serve_msgbatch_check.py",
        &[&format!("http://{}", s.addr), "secret"],
    );
    eprintln!("{r}");
    assert_eq!(r["succeeded"], 3, "{r}");
    assert_eq!(r["errored"], 1, "{r}");
    assert!(r["canceled"].as_u64().unwrap() > 0, "{r}");
}

/// A batch never makes a client's request find the queue full: one sequence at a time
/// (`--max-batch 1`), a queue of 2, a batch keeping 2 requests in the engine; a client's
/// long request preempts the running one (both batch requests then wait: the queue holds 2),
/// and a second client's request is still taken (the queue's batch requests do not count
/// for it; `gds_queue_depth_batch` shows them).
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_batch_never_fills_the_queue_for_clients() {
    let _one = serial();
    let s = start(&[
        "--max-batch",
        "1",
        "--queue-limit",
        "2",
        "--batch-concurrency",
        "2",
        "--ctx",
        "512",
    ]);
    let bodies: Vec<Value> = (0..4)
        .map(|i| json!({"prompt": format!("Story {i}"), "max_tokens": 200, "ignore_eos": true}))
        .collect();
    start_batch(&s.addr, &bodies);
    wait_for_metrics(&s.addr, "the batch never filled the engine", |m| {
        metric(m, "gds_requests_running") >= 1.0 && metric(m, "gds_queue_depth_batch") >= 1.0
    });
    let addr = s.addr.clone();
    let first = std::thread::spawn(move || {
        let long = json!({"prompt": "Hello", "max_tokens": 64, "ignore_eos": true});
        http(
            &addr,
            "POST",
            "/v1/completions",
            Some(long.to_string().as_bytes()),
        )
    });
    wait_for_metrics(
        &s.addr,
        "the client's request never preempted the batch's",
        |m| metric(m, "gds_queue_depth_batch") >= 2.0 && metric(m, "gds_queue_depth") >= 2.0,
    );
    let (status, text) = http(
        &s.addr,
        "POST",
        "/v1/completions",
        Some(
            json!({"prompt": "Hi", "max_tokens": 2})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(
        status, 200,
        "a client found the queue full of batch requests: {text}"
    );
    let (status, text) = first.join().unwrap();
    assert_eq!(status, 200, "{text}");
}
