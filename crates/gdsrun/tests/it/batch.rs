//! `gdsrun batch` (issue 31, item 5): a mixed job of chat and completions requests with
//! invalid lines among them answers every line once, each valid request's body equal to
//! what `gdsrun serve` answers for the same body; a job killed part way and rerun gives each
//! `custom_id` exactly once (a line torn by the kill is cut); unusable paths are usage errors
//! naming the file.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> &'static str {
    gds_tests::smollm_converted()
        .to_str()
        .expect("temporary path is UTF-8")
}

const ENGINE: [&str; 8] = [
    "--ctx",
    "512",
    "--kv-budget",
    "64",
    "--max-batch",
    "8",
    "--threads",
    "2",
];

/// The job: completions and chat requests (greedy, short), and invalid lines at known
/// positions. Returns the JSONL text and, per custom_id, its url and body.
fn job() -> (String, HashMap<String, (String, Value)>) {
    let mut lines = Vec::new();
    let mut valid = HashMap::new();
    for i in 0..24 {
        let id = format!("req-{i}");
        let (url, body) = if i % 2 == 0 {
            (
                "/v1/completions",
                json!({"prompt": format!("The {i} little pigs went"), "max_tokens": 4 + i % 5, "temperature": 0}),
            )
        } else {
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": format!("Name {i} animals.")}], "max_tokens": 5, "temperature": 0}),
            )
        };
        lines
            .push(json!({"custom_id": id, "method": "POST", "url": url, "body": body}).to_string());
        valid.insert(id, (url.to_string(), body));
        match i {
            3 => lines.push("{not json".into()),
            7 => lines.push(
                json!({"custom_id": "req-0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}})
                    .to_string(),
            ),
            11 => lines.push(
                json!({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}).to_string(),
            ),
            15 => lines.push(
                json!({"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}})
                    .to_string(),
            ),
            19 => lines.push(json!({"method": "POST", "url": "/v1/completions", "body": {}}).to_string()),
            _ => {}
        }
    }
    // a request the handler refuses: answered with its 400, like the server's
    lines.push(json!({"custom_id": "too-many", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2, "n": 99}}).to_string());
    valid.insert(
        "too-many".into(),
        (
            "/v1/completions".into(),
            json!({"prompt": "x", "max_tokens": 2, "n": 99}),
        ),
    );
    (lines.join("\n") + "\n", valid)
}

fn batch(input: &std::path::Path, output: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gdsrun"))
        .args(["batch", model(), "--quiet", "-i"])
        .arg(input)
        .arg("-o")
        .arg(output)
        .args(ENGINE)
        .stdin(Stdio::null())
        .output()
        .expect("spawn gdsrun batch")
}

fn results(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Every valid request of the job answered exactly once in `rows`.
fn each_id_once(rows: &[Value], valid: &HashMap<String, (String, Value)>) {
    let mut ids: Vec<&str> = rows
        .iter()
        .filter(|r| !r["response"].is_null())
        .map(|r| r["custom_id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    let mut want: Vec<&str> = valid.keys().map(String::as_str).collect();
    want.sort_unstable();
    assert_eq!(ids, want, "each custom_id exactly once");
}

/// `gdsrun serve` on the same model and flags; (child, address).
fn serve() -> (std::process::Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gdsrun"))
        .args(["serve", model(), "--port", "0"])
        .args(ENGINE)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn gdsrun serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    (child, addr)
}

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).unwrap();
    let status = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap())
}

/// What must agree between the batch's body and the server's: the text and the counts
/// (ids and timings differ per request).
fn essence(v: &Value) -> Value {
    if v.get("error").is_some() {
        return json!({"error": v["error"]["param"], "type": v["error"]["type"]});
    }
    let choices: Vec<Value> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| json!([c["text"], c["message"]["content"], c["finish_reason"]]))
        .collect();
    json!({"choices": choices, "usage": [v["usage"]["prompt_tokens"], v["usage"]["completion_tokens"]]})
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_mixed_job_answers_every_line_once_as_the_server_does() {
    let dir = tempfile::tempdir().unwrap();
    let (text, valid) = job();
    let input = dir.path().join("requests.jsonl");
    std::fs::write(&input, &text).unwrap();
    let output = dir.path().join("results.jsonl");
    let out = batch(&input, &output);
    assert!(out.status.success(), "{}", gds_tests::stderr(&out));
    assert!(
        gds_tests::stderr(&out).contains("24 ok, 1 failed, 5 invalid lines"),
        "{}",
        gds_tests::stderr(&out)
    );
    let rows = results(&output);
    assert_eq!(rows.len(), text.lines().count(), "one result per line");
    // the invalid lines, by line number and code
    let mut invalid: Vec<(u64, String)> = rows
        .iter()
        .filter(|r| r["response"].is_null())
        .map(|r| {
            (
                r["line"].as_u64().unwrap(),
                r["error"]["code"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    invalid.sort();
    let codes: Vec<&str> = invalid.iter().map(|(_, c)| c.as_str()).collect();
    assert_eq!(
        codes,
        [
            "invalid_json",
            "duplicate_custom_id",
            "invalid_request",
            "invalid_request",
            "invalid_request"
        ],
        "{invalid:?}"
    );
    // each valid request once, with the server's answer
    let (mut server, addr) = serve();
    let mut seen = HashMap::new();
    for r in rows.iter().filter(|r| !r["response"].is_null()) {
        let id = r["custom_id"].as_str().unwrap().to_string();
        assert!(seen.insert(id.clone(), ()).is_none(), "{id} twice");
        let (url, body) = &valid[&id];
        let (status, want) = post(&addr, url, body);
        assert_eq!(r["response"]["status_code"], status, "{id}: {r}");
        assert_eq!(essence(&r["response"]["body"]), essence(&want), "{id}");
        assert!(r["id"].as_str().unwrap().starts_with("batch_req_"), "{r}");
    }
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(seen.len(), valid.len());
    // a rerun finds everything done: nothing added
    let again = batch(&input, &output);
    assert!(again.status.success(), "{}", gds_tests::stderr(&again));
    assert_eq!(results(&output).len(), rows.len());
    assert!(
        gds_tests::stderr(&again).contains("0 ok, 0 failed, 0 invalid lines"),
        "{}",
        gds_tests::stderr(&again)
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_killed_job_resumes_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let (text, valid) = job();
    let input = dir.path().join("requests.jsonl");
    std::fs::write(&input, &text).unwrap();
    let output = dir.path().join("results.jsonl");
    // one request at a time, so the kill lands part way
    let mut child = Command::new(env!("CARGO_BIN_EXE_gdsrun"))
        .args(["batch", model(), "--quiet", "--concurrency", "1", "-i"])
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .args(ENGINE)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(&output).map_or(0, |t| t.lines().count()) < 8 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    let _ = child.wait();
    let before = results(&output).len();
    assert!(
        before < text.lines().count(),
        "killed part way ({before} lines)"
    );
    // as if the kill had torn a line in the middle
    std::fs::OpenOptions::new()
        .append(true)
        .open(&output)
        .unwrap()
        .write_all(br#"{"id":"batch_req_x","custom_id":"req-23","li"#)
        .unwrap();
    let out = batch(&input, &output);
    assert!(out.status.success(), "{}", gds_tests::stderr(&out));
    let rows = results(&output);
    assert_eq!(
        rows.len(),
        text.lines().count(),
        "{}",
        gds_tests::stderr(&out)
    );
    each_id_once(&rows, &valid);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn unusable_paths_are_usage_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("requests.jsonl");
    std::fs::write(&input, job().0).unwrap();
    for (i, o, words) in [
        (
            input.clone(),
            dir.path().join("no/such/dir/out.jsonl"),
            "no/such/dir/out.jsonl",
        ),
        (
            dir.path().join("missing.jsonl"),
            dir.path().join("out.jsonl"),
            "missing.jsonl",
        ),
        (input.clone(), input.clone(), "--output is the input file"),
        (input.clone(), dir.path().to_path_buf(), "Is a directory"),
    ] {
        let out = batch(&i, &o);
        assert_eq!(out.status.code(), Some(2), "{}", gds_tests::stderr(&out));
        assert!(
            gds_tests::stderr(&out).contains(words),
            "{}",
            gds_tests::stderr(&out)
        );
    }
}

/// An output that is not a results file of this command is left as it was (a rerun only
/// appends to its own output; before 2026-12-05 it cut anything after a file's last
/// newline), a FIFO is refused, and an output another run holds is refused while it does.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn an_output_that_is_not_its_own_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("requests.jsonl");
    std::fs::write(&input, job().0).unwrap();
    let notes = dir.path().join("notes.txt");
    let text = b"notes 1\nnotes 2 without newline";
    std::fs::write(&notes, text).unwrap();
    let out = batch(&input, &notes);
    assert_eq!(out.status.code(), Some(2), "{}", gds_tests::stderr(&out));
    assert!(
        gds_tests::stderr(&out).contains("not the output of gdsrun batch"),
        "{}",
        gds_tests::stderr(&out)
    );
    assert_eq!(std::fs::read(&notes).unwrap(), text);

    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let out = batch(&input, &fifo);
    assert_eq!(out.status.code(), Some(2), "{}", gds_tests::stderr(&out));
    assert!(
        gds_tests::stderr(&out).contains("not a regular file"),
        "{}",
        gds_tests::stderr(&out)
    );

    // another run's lock (taken here as gdsrun batch takes it)
    let output = dir.path().join("results.jsonl");
    let held = std::fs::File::create(&output).unwrap();
    held.try_lock().unwrap();
    let out = batch(&input, &output);
    assert_eq!(out.status.code(), Some(2), "{}", gds_tests::stderr(&out));
    assert!(
        gds_tests::stderr(&out).contains("another gdsrun batch is writing it"),
        "{}",
        gds_tests::stderr(&out)
    );
    assert_eq!(std::fs::metadata(&output).unwrap().len(), 0);
    drop(held);
}

/// A write that fails (here the file-size limit, `ulimit -f`, as a full disk would) ends
/// the job at once: no request is started after it (before 2026-12-05 every remaining
/// request ran first), the error names the output (exit 2), and a rerun resumes.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_failed_write_ends_the_job_and_a_rerun_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (text, valid) = job();
    let input = dir.path().join("requests.jsonl");
    std::fs::write(&input, &text).unwrap();
    let output = dir.path().join("results.jsonl");
    // (SIGXFSZ ignored, so the write fails with EFBIG instead of killing the process)
    let out = Command::new("sh")
        .arg("-c")
        .arg(r#"trap "" XFSZ; ulimit -f 2; exec "$@""#)
        .arg("sh")
        .arg(env!("CARGO_BIN_EXE_gdsrun"))
        .args(["batch", model(), "--quiet", "--concurrency", "1", "-i"])
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .args(ENGINE)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = gds_tests::stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("results.jsonl") && err.contains("File too large"),
        "{err}"
    );
    let lines = text.lines().count();
    let written: usize = err
        .split("stopped writing after ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of lines written: {err}"));
    assert!(written < 4, "{written} lines written within 1 KiB? {err}");
    assert!(err.contains(&format!("lines of {lines}:")), "{err}");
    // the job stopped there: one request in flight at a time, so the one whose line failed
    // and at most one more (invalid lines are written without a request)
    let started: usize = err
        .split(&format!("lines of {lines}: "))
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of requests started: {err}"));
    assert!(started <= written + 2, "{started} requests started: {err}");
    let out = batch(&input, &output);
    assert!(out.status.success(), "{}", gds_tests::stderr(&out));
    let rows = results(&output);
    assert_eq!(rows.len(), lines);
    each_id_once(&rows, &valid);
}

/// A fuzzed job (tests/py/serve_fuzz.py --batch-input: mutated bodies of every kind the
/// server fuzz sends, the lines' own fields damaged, raw-byte damage, duplicate ids): the job
/// ends with exit 0 and answers every line exactly once, each answer a response of 200 with
/// choices or 400 in OpenAI's error shape, or a line error with a code and a message naming
/// the line. Never a 5xx.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_fuzzed_job_answers_every_line_once_and_never_fails_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    let n = 300;
    let made = Command::new("python3")
        .arg(gds_tests::root().join("tests/py/serve_fuzz.py"))
        .arg("--batch-input")
        .arg(&input)
        .args(["--requests", &n.to_string(), "--seed", "2"])
        .status()
        .expect("python3 runs");
    assert!(made.success());
    let out = batch(&input, &output);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let res = results(&output);
    let mut lines: Vec<u64> = res.iter().map(|r| r["line"].as_u64().unwrap()).collect();
    lines.sort_unstable();
    // a blank line (the fuzzer's damage can cut a line to nothing) is no request: not answered
    let job = std::fs::read(&input).unwrap();
    let requests: Vec<u64> = job
        .split(|&b| b == b'\n')
        .zip(1..=n)
        .filter(|(l, _)| !l.iter().all(u8::is_ascii_whitespace))
        .map(|(_, i)| i)
        .collect();
    assert!(
        requests.len() as u64 > n - 10,
        "{} requests",
        requests.len()
    );
    assert_eq!(lines, requests, "every line answered once");
    let (mut ok, mut refused, mut invalid) = (0, 0, 0);
    for r in &res {
        match (&r["response"], &r["error"]) {
            (Value::Object(resp), Value::Null) => {
                let (code, body) = (resp["status_code"].as_u64().unwrap(), &resp["body"]);
                match code {
                    200 => {
                        // chat and completions: choices; /v1/responses: output items;
                        // /v1/embeddings: data
                        let items = body
                            .get("choices")
                            .or(body.get("output"))
                            .or(body.get("data"));
                        assert!(items.and_then(Value::as_array).is_some(), "{r}");
                        ok += 1;
                    }
                    400 => {
                        assert!(body["error"]["message"].is_string(), "{r}");
                        assert!(body["error"]["type"].is_string(), "{r}");
                        refused += 1;
                    }
                    _ => panic!("status {code}: {r}"),
                }
            }
            (Value::Null, Value::Object(e)) => {
                assert!(e["code"].is_string(), "{r}");
                let line = format!("line {}", r["line"]);
                assert!(e["message"].as_str().unwrap().starts_with(&line), "{r}");
                invalid += 1;
            }
            _ => panic!("neither a response nor an error: {r}"),
        }
    }
    // the fuzz reached every kind of answer
    assert!(
        ok > 30 && refused > 30 && invalid > 30,
        "{ok} {refused} {invalid}"
    );
}
