//! The connection layer: the accept loop with its connection limit, hyper's HTTP/1.1 with a
//! header read timeout (which is also the keep-alive idle timeout), and the request-body
//! middleware (size limit checked before reading, read timeout).

use crate::api::ApiError;
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
    /// Time to send a complete request head, from connecting or from the end of the
    /// previous response (so also the keep-alive idle timeout).
    pub header_timeout: Duration,
    /// Time to send a request body.
    pub body_timeout: Duration,
    /// Largest request body, bytes.
    pub max_body: usize,
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
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(_) => {
                    // out of file descriptors and the like: wait instead of spinning
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        let (app, metrics, mut stop_rx) = (app.clone(), metrics.clone(), stop_rx.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn =
                builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            let mut conn = std::pin::pin!(conn);
            let mut stopping = false;
            let result = loop {
                tokio::select! {
                    r = conn.as_mut() => break r,
                    _ = stop_rx.wait_for(|s| *s), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            };
            if result.is_err_and(|e| e.is_timeout()) {
                metrics.header_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
        });
    }
    let _ = stop_tx.send(true);
    // each connection gives its slot back when it closes
    let _ = slots.acquire_many(limits.max_connections as u32).await;
}

/// Answers a connection over the limit with 503 and closes it, within a second.
async fn refuse(stream: TcpStream) {
    const BODY: &str = r#"{"error":{"message":"too many open connections; retry later","type":"server_busy","param":null,"code":"too_many_connections"}}"#;
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let (read, write) = stream.into_split();
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
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
        let mut sink = [0u8; 4096];
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
    let limit = st.limits.max_body;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large(&st, declared);
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(st.limits.body_timeout, axum::body::to_bytes(body, limit));
    let bytes = match read.await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                return too_large(&st, None);
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

fn too_large(st: &ServerState, declared: Option<u64>) -> Response {
    st.metrics
        .rejected_too_large
        .fetch_add(1, Ordering::Relaxed);
    let size = declared.map_or_else(|| "the request body".into(), |n| format!("{n} bytes"));
    let e = ApiError::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!(
            "{size} is over this server's limit of {} bytes (--max-body)",
            st.limits.max_body
        ),
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
