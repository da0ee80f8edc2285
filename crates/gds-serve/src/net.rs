//! The connection layer: the accept loop with its connection limits (all clients, and each
//! client address), hyper's HTTP/1.1 with a header read timeout (which is also the keep-alive
//! idle timeout), and the request-body middleware (size limit checked before reading, read
//! timeout).
//!
//! A connection over a limit is not served by hyper: a small task reads its request line
//! (briefly), answers `GET /health` with 200 and anything else with 503, and closes it. So
//! health probes are answered even while slow or idle clients hold every slot.

use crate::client::PerClient;
use crate::error::ApiError;
use crate::metrics::ServerMetrics;
use crate::ServerState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// Limits on what clients may hold and send.
#[derive(Clone, Copy, Debug)]
pub struct NetLimits {
    /// Most open connections; more are answered 503 and closed.
    pub max_connections: usize,
    /// Most open connections from one client address; more are answered 503 and closed.
    pub max_client_connections: usize,
    /// Time to send a complete request head, from connecting or from the end of the
    /// previous response (so also the keep-alive idle timeout).
    pub header_timeout: Duration,
    /// Time to send a request body.
    pub body_timeout: Duration,
    /// Largest request body, bytes.
    pub max_body: usize,
    /// Largest non-streamed reply's choices, bytes of JSON text.
    pub max_reply: usize,
}

/// Why a connection is refused.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Refusal {
    /// Every connection slot is taken.
    Full,
    /// The client's address holds its share.
    Client,
}

/// Serves `app` on `listener` until `shutdown` completes, then waits for the open
/// connections to finish their requests.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: NetLimits,
    metrics: Arc<ServerMetrics>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let clients = Arc::new(PerClient::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(_) => {
                    // out of file descriptors and the like: wait instead of spinning
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // an IPv4 client on an IPv6 socket is the same client as on an IPv4 one
        let ip = peer.ip().to_canonical();
        let Some(client) = clients.take(ip, limits.max_client_connections) else {
            metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            metrics
                .connections_refused_client
                .fetch_add(1, Ordering::Relaxed);
            tokio::spawn(refuse(stream, Refusal::Client));
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(client);
            metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(refuse(stream, Refusal::Full));
            continue;
        };
        let _ = stream.set_nodelay(true);
        metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        let (app, metrics, mut stop_rx) = (app.clone(), metrics.clone(), stop_rx.clone());
        // a second handle on the socket, for the lingering close after hyper is done
        let Some((stream, lingering)) = split_for_linger(stream) else {
            drop((slot, client));
            metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
            continue;
        };
        tokio::spawn(crate::client::CLIENT.scope(ip, async move {
            let _slots = (slot, client);
            let result = {
                let mut builder = http1::Builder::new();
                builder
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    // `Content-Type`, as llama-server, vLLM and most servers write them: a
                    // client that looks a header up case-sensitively (a plain dict of
                    // `requests`' headers, as llama.cpp's own tests make) finds it
                    .title_case_headers(true);
                let conn =
                    builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
                let mut conn = std::pin::pin!(conn);
                let mut stopping = false;
                loop {
                    tokio::select! {
                        r = conn.as_mut() => break r,
                        _ = stop_rx.wait_for(|s| *s), if !stopping => {
                            stopping = true;
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            };
            if result.is_err_and(|e| e.is_timeout()) {
                metrics.header_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            linger(lingering).await;
            metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
        }));
    }
    let _ = stop_tx.send(true);
    // each connection gives its slot back when it closes
    let _ = slots.acquire_many(limits.max_connections as u32).await;
}

/// Most time and bytes a lingering close reads and discards.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 64 << 20;

/// The stream for hyper and a second handle on the same socket (a duplicated descriptor)
/// for [`linger`]; `None` when the descriptor cannot be duplicated (out of descriptors: the
/// connection is dropped).
fn split_for_linger(stream: TcpStream) -> Option<(TcpStream, std::net::TcpStream)> {
    let std = stream.into_std().ok()?;
    let dup = std.try_clone().ok()?;
    Some((TcpStream::from_std(std).ok()?, dup))
}

/// A lingering close (as HTTP servers do, RFC 9112 section 9.6): once hyper is done with a
/// connection, the sending side is shut and what the client still sends — the body of a
/// request answered before its body was read, a 413 or a 408 — is read and discarded for a
/// bounded time, so that closing with unread data does not reset the connection (a TCP RST)
/// and destroy the response before the client reads it.
async fn linger(s: std::net::TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Write);
    // (the duplicate shares the original's non-blocking mode, as tokio needs)
    let Ok(s) = TcpStream::from_std(s) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + LINGER_TIME;
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0;
    while total < LINGER_BYTES {
        match tokio::time::timeout_at(deadline, s.readable()).await {
            Ok(Ok(())) => match s.try_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            },
            _ => break,
        }
    }
}

/// Whether a request line asks for the health check.
fn is_health(head: &[u8]) -> bool {
    head.starts_with(b"GET /health ") || head.starts_with(b"GET /health?")
}

/// Answers a connection over a limit and closes it, within about a second: a health check
/// (`GET /health`, seen in the request line read for at most half a second) gets 200, since
/// the server is up; anything else 503 with Retry-After.
async fn refuse(stream: TcpStream, why: Refusal) {
    const HEALTH: &str = r#"{"status":"ok"}"#;
    let busy = match why {
        Refusal::Full => {
            r#"{"error":{"message":"too many open connections; retry later","type":"server_busy","param":null,"code":"too_many_connections"}}"#
        }
        Refusal::Client => {
            r#"{"error":{"message":"too many open connections from this address (--max-client-connections); retry later","type":"server_busy","param":null,"code":"too_many_connections"}}"#
        }
    };
    let (read, write) = stream.into_split();
    let mut head = Vec::new();
    let mut sink = [0u8; 1024];
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while !head.contains(&b'\n') && head.len() < 1024 {
            read.readable().await?;
            match read.try_read(&mut sink) {
                Ok(0) => break,
                Ok(n) => head.extend_from_slice(&sink[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await;
    let response = if is_health(&head) {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{HEALTH}",
            HEALTH.len()
        )
    } else {
        format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{busy}",
            busy.len()
        )
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        let mut out = response.as_bytes();
        while !out.is_empty() {
            write.writable().await?;
            match write.try_write(out) {
                Ok(n) => out = &out[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        // dropping the write half sends FIN; then read what the client sent, so that
        // closing does not reset the connection before it has read the answer
        drop(write);
        loop {
            read.readable().await?;
            match read.try_read(&mut sink) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    })
    .await;
}

/// Middleware: refuses a body over the limit (413) from its Content-Length before reading
/// it, and otherwise reads it whole within the body timeout (408) and the limit (413).
pub async fn read_body(State(st): State<Arc<ServerState>>, req: Request, next: Next) -> Response {
    // (an upload, or a message batch, may be as large as the file storage)
    let upload =
        req.method() == axum::http::Method::POST && crate::files::takes_storage(req.uri().path());
    let limit = if upload {
        st.limits.max_body.max(crate::files::max_upload(&st))
    } else {
        st.limits.max_body
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large(&st, declared, limit, upload);
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(st.limits.body_timeout, axum::body::to_bytes(body, limit));
    let bytes = match read.await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                return too_large(&st, None, limit, upload);
            }
            st.metrics.rejected_bad.fetch_add(1, Ordering::Relaxed);
            return ApiError::bad(format!("reading the request body: {e}")).into_response();
        }
        Err(_) => {
            st.metrics.body_timeouts.fetch_add(1, Ordering::Relaxed);
            let e = ApiError::status(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    st.limits.body_timeout.as_secs_f64()
                ),
            )
            .code("request_timeout");
            return closing(e);
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

fn too_large(st: &ServerState, declared: Option<u64>, limit: usize, upload: bool) -> Response {
    st.metrics
        .rejected_too_large
        .fetch_add(1, Ordering::Relaxed);
    let size = declared.map_or_else(|| "the request body".into(), |n| format!("{n} bytes"));
    let flag = if upload {
        "--file-storage"
    } else {
        "--max-body"
    };
    let e = ApiError::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("{size} is over this server's limit of {limit} bytes ({flag})"),
    )
    .code("request_too_large");
    closing(e)
}

/// The error as a response that closes the connection (its body may be unread).
fn closing(e: ApiError) -> Response {
    let mut r = e.into_response();
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Middleware: the API key (`--api-key`) on every path but `/health`, and `/metrics` with
/// `--metrics-public`. (CORS preflights are answered before this, without a key.)
pub async fn require_key(State(st): State<Arc<ServerState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    // (as llama-server: its health paths; vLLM's `/ping` (SageMaker's health check); `/`,
    // Ollama's "is running" probe, which says no more than they do)
    let probe = matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    let public = path == "/health"
        || path == "/v1/health"
        || path == "/ping"
        || (path == "/" && probe)
        || (st.metrics_public && path == "/metrics");
    let internal = req.extensions().get::<crate::client::Internal>().is_some();
    if !public && !internal {
        if let Err(e) = crate::api::authorize(&st, req.headers()) {
            return e.into_response();
        }
    }
    next.run(req).await
}

/// A response passed on, or, when it failed, its error (OpenAI's shape: `message`, where the
/// body has none the status's reason, and `param`) rewritten by `shape` into another API's
/// JSON error body: the Anthropic and Ollama paths' middleware.
pub(crate) async fn reshape_error(
    r: Response,
    shape: impl FnOnce(StatusCode, String, Option<&str>) -> serde_json::Value,
) -> Response {
    let status = r.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return r;
    }
    let (mut parts, body) = r.into_parts();
    // errors are small; anything else is passed on as a generic message
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let openai: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let e = &openai["error"];
    let message = e["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_string());
    let body = shape(status, message, e["param"].as_str());
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// Middleware: every error answered in OpenAI's JSON shape, including those axum writes
/// itself (405 for a method a path does not take, a rejected extractor's plain text).
pub async fn json_errors(req: Request, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let r = next.run(req).await;
    let status = r.status();
    let is_json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return r;
    }
    let (parts, body) = r.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if status == StatusCode::METHOD_NOT_ALLOWED {
        format!("{path} does not take {method}")
    } else if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string()
    } else {
        text
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let mut out = ApiError::status(status, kind, message).into_response();
    for name in [header::ALLOW, header::CONNECTION, header::RETRY_AFTER] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

/// The methods the API takes (DELETE: `/v1/responses/{id}`, Ollama's `/api/delete`), what
/// `OPTIONS` answers in `Allow` and a preflight in `Access-Control-Allow-Methods`.
const METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// `--cors-origin localhost`: any origin of this machine.
pub const LOCALHOST: &str = "localhost";

/// Whether the `Origin` header `origin` is allowed by the configured `allowed` entry: `*`,
/// the same origin, or for [`LOCALHOST`] an `http` or `https` origin whose host is
/// `localhost`, `127.0.0.1` or `[::1]`, with or without a port (not `localhost.evil.com`,
/// not `notlocalhost`).
pub fn origin_allowed(allowed: &str, origin: &[u8]) -> bool {
    if allowed == "*" || allowed.as_bytes() == origin {
        return true;
    }
    if allowed != LOCALHOST {
        return false;
    }
    let Ok(o) = std::str::from_utf8(origin) else {
        return false;
    };
    let Some(rest) = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"))
    else {
        return false;
    };
    let host = ["localhost", "127.0.0.1", "[::1]"]
        .into_iter()
        .find(|h| rest.starts_with(h));
    let Some(host) = host else {
        return false;
    };
    match &rest[host.len()..] {
        "" => true,
        port => port.strip_prefix(':').is_some_and(|p| {
            !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
        }),
    }
}

/// Middleware: CORS (`--cors-origin`). A preflight (`OPTIONS` with `Origin` and
/// `Access-Control-Request-Method`) from an allowed origin is answered 200 with the origin
/// echoed, the methods, the headers it asked for (else `authorization, content-type, x-api-key, anthropic-version`) and a
/// max age; other responses to an allowed origin carry `Access-Control-Allow-Origin`. With
/// no origin configured no CORS header is sent. `OPTIONS` is answered 200 (as llama-server) with `Allow` either
/// way, and needs no API key.
pub async fn cors(State(st): State<Arc<ServerState>>, req: Request, next: Next) -> Response {
    let on = !st.cors_origins.is_empty();
    let allowed = req
        .headers()
        .get(header::ORIGIN)
        .filter(|o| {
            st.cors_origins
                .iter()
                .any(|a| origin_allowed(a, o.as_bytes()))
        })
        .cloned();
    if req.method() == axum::http::Method::OPTIONS {
        let mut r = StatusCode::OK.into_response();
        let h = r.headers_mut();
        h.insert(header::ALLOW, HeaderValue::from_static(METHODS));
        if on {
            h.insert(
                header::VARY,
                HeaderValue::from_static(
                    "origin, access-control-request-method, access-control-request-headers",
                ),
            );
        }
        let preflight = req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        if let (Some(origin), true) = (allowed, preflight) {
            let asked = req
                .headers()
                .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
                .cloned()
                .unwrap_or_else(|| {
                    HeaderValue::from_static(
                        "authorization, content-type, x-api-key, anthropic-version",
                    )
                });
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            h.insert(
                header::ACCESS_CONTROL_ALLOW_METHODS,
                HeaderValue::from_static(METHODS),
            );
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
            h.insert(
                header::ACCESS_CONTROL_MAX_AGE,
                HeaderValue::from_static("7200"),
            );
        }
        return r;
    }
    let mut r = next.run(req).await;
    if on {
        let h = r.headers_mut();
        h.append(header::VARY, HeaderValue::from_static("origin"));
        if let Some(origin) = allowed {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_localhost_keyword_allows_this_machines_pages_only() {
        // llama.cpp's test_cors_origins_localhost_reflects and _rejects
        for o in [
            "http://localhost",
            "http://localhost:8080",
            "http://127.0.0.1",
            "http://127.0.0.1:3000",
            "http://[::1]",
            "http://[::1]:3000",
            "https://localhost:443",
        ] {
            assert!(origin_allowed(LOCALHOST, o.as_bytes()), "{o}");
        }
        for o in [
            "http://web.mydomain.fr",
            "http://evil.com",
            "http://notlocalhost",
            "http://localhost.evil.com",
            "http://127.0.0.1.evil.com",
            "http://localhost:80x",
            "http://localhost:",
            "http://localhost/",
            "ftp://localhost",
            "http://[::1]@evil.com",
        ] {
            assert!(!origin_allowed(LOCALHOST, o.as_bytes()), "{o}");
        }
        // other entries: exact, or any
        assert!(origin_allowed("http://a.example", b"http://a.example"));
        assert!(!origin_allowed("http://a.example", b"http://a.example:1"));
        assert!(origin_allowed("*", b"http://anything"));
        assert!(!origin_allowed(
            "http://localhost:3000",
            b"http://localhost:3001"
        ));
    }

    #[test]
    fn health_request_lines() {
        assert!(is_health(b"GET /health HTTP/1.1\r\n"));
        assert!(is_health(b"GET /health?x=1 HTTP/1.1\r\n"));
        assert!(!is_health(b"GET /healthz HTTP/1.1\r\n"));
        assert!(!is_health(b"POST /health HTTP/1.1\r\n"));
        assert!(!is_health(b"GET /v1/models HTTP/1.1\r\n"));
        assert!(!is_health(b""));
    }
}
