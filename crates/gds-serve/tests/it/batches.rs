//! OpenAI's Files and Batch APIs on the server (`/v1/files`, `/v1/batches`).

use crate::common::{http, python, start};

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
