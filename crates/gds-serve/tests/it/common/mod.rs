//! What the server tests share: starting `gdsrun serve` on the real SmolLM2 and a minimal
//! HTTP/1.1 client. All traffic goes to 127.0.0.1.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tests of a test binary each start a server: one at a time, except the tests driving
/// a Python client (openai, anthropic, ollama, lm-eval), which take no lock: their server
/// waits for the client's start for much of the time, and under the lock that left a core
/// idle (gds-serve's tests kept 1.6 of 2 cores busy, bench/runs/2026-12-05-ci-time.md). At
/// most two tests run at once on a 2-core machine (libtest's threads).
pub static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the one-at-a-time lock.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running server, killed on drop.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `gdsrun serve` on SmolLM2 on a free port of 127.0.0.1 with `extra` flags
/// (`--ctx 1024 --kv-budget 64` unless given) and waits until it is healthy.
pub fn start(extra: &[&str]) -> Server {
    start_model(gds_tests::smollm_converted(), extra)
}

/// Starts `gdsrun serve` on the model directory `model` (see [`start`]).
pub fn start_model(model: &std::path::Path, extra: &[&str]) -> Server {
    // defaults for the flags `extra` does not set
    let defaults: Vec<&str> = [["--ctx", "1024"], ["--kv-budget", "64"]]
        .into_iter()
        .filter(|[flag, _]| !extra.contains(flag))
        .flatten()
        .collect();
    let mut child = Command::new(gds_tests::bin("gdsrun"))
        .arg("serve")
        .arg(model)
        .args(["--port", "0", "--threads", "2"])
        .args(extra)
        .args(defaults)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn gdsrun serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the listening line");
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .filter(|a| a.contains(':'))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let s = Server { child, addr };
    let t0 = Instant::now();
    while http(&s.addr, "GET", "/health", None).0 != 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "server never became healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    s
}

/// A minimal HTTP/1.1 client: (status, body).
pub fn http(addr: &str, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or(b"");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    (status, body)
}

/// Runs `tests/py/SCRIPT ARGS...` from the repository's root and parses what it printed: one
/// JSON value (a failed run, or a missing Python package, panics with its stderr).
pub fn python(script: &str, args: &[&str]) -> serde_json::Value {
    let path = gds_tests::root().join("tests/py").join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .current_dir(gds_tests::root())
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("`openai` is missing"),
        "the Python package `openai` is needed: pip install openai (scripts/test.sh installs it)"
    );
    assert!(out.status.success(), "{script} failed:\n{stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// `GET path`, which must answer 200: its body, parsed.
pub fn get_ok(addr: &str, path: &str) -> serde_json::Value {
    let (code, text) = http(addr, "GET", path, None);
    assert_eq!(code, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

/// The order requests ended in: each one's name, pushed when its answer came.
pub type Finished = std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>;

/// POSTs `body` as JSON to `path` from a thread of its own, `name` pushed into `done` when the
/// answer has come: the thread, giving the status and the answer, parsed.
pub fn post_in_thread(
    addr: &str,
    path: &'static str,
    body: serde_json::Value,
    name: &'static str,
    done: &Finished,
) -> std::thread::JoinHandle<(u16, serde_json::Value)> {
    let (addr, done) = (addr.to_string(), done.clone());
    std::thread::spawn(move || {
        let r = post_json(&addr, path, &body);
        done.lock().unwrap().push(name);
        r
    })
}

/// Waits (up to a minute; `what` names a failure) until `ok` holds for the server's
/// `/metrics` text.
pub fn wait_for_metrics(addr: &str, what: &str, ok: impl Fn(&str) -> bool) {
    let t0 = Instant::now();
    loop {
        let m = http(addr, "GET", "/metrics", None).1;
        if ok(&m) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {m}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The value of a metric in Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

/// POSTs `body` as JSON: the status and the answer, parsed (a panic naming the path where it
/// is not JSON).
pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (code, text) = http(addr, "POST", path, Some(body.to_string().as_bytes()));
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text:?}"));
    (code, v)
}

/// A JSON list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The `data:` events of a streamed answer, as JSON (`[DONE]` left out).
pub fn sse_events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// `base` with the fields of `extra` (an object) set over it.
pub fn with(base: &serde_json::Value, extra: &serde_json::Value) -> serde_json::Value {
    let mut v = base.clone();
    for (k, x) in extra.as_object().expect("an object of fields") {
        v[k] = x.clone();
    }
    v
}
