//! The error every endpoint answers, in OpenAI's format, and the request seed (shared by
//! the handlers in `api`, `tools`, `responses` and the connection layer in `net`).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// An error answered in OpenAI's format.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<std::borrow::Cow<'static, str>>,
    code: Option<&'static str>,
}

impl ApiError {
    /// 400 with `invalid_request_error`.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// Names the request field at fault.
    pub(crate) fn param(mut self, p: &'static str) -> ApiError {
        self.param = Some(p.into());
        self
    }

    /// Names the request field at fault by its path (`messages[2].tool_call_id`).
    pub(crate) fn param_path(mut self, p: String) -> ApiError {
        self.param = Some(p.into());
        self
    }

    /// Sets the machine-readable `code`.
    pub(crate) fn code(mut self, c: &'static str) -> ApiError {
        self.code = Some(c);
        self
    }

    /// 500 with `server_error`: the server failed, not the request.
    pub(crate) fn server(message: impl Into<String>) -> ApiError {
        ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 503 `server_unavailable`: the engine thread has stopped.
    pub(crate) fn engine_stopped() -> ApiError {
        ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_unavailable",
            "the engine has stopped",
        )
    }

    /// 404 with `invalid_request_error`: what the request names is not here.
    pub(crate) fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::status(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    /// An error with its own status and type.
    pub(crate) fn status(
        status: StatusCode,
        kind: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }
}

impl ApiError {
    /// The message, with the field at fault when one is named (`"tools: ..."`), for callers
    /// outside HTTP (the Python package).
    pub fn text(&self) -> String {
        match self.param.as_deref() {
            Some(p) if !self.message.contains(p) => format!("{p}: {}", self.message),
            _ => self.message.clone(),
        }
    }

    /// The body: `{"error": {"message", "type", "param", "code"}}`.
    pub(crate) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

/// 400 naming the request field at fault.
pub(crate) fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(message).param(param)
}

/// A seed for a request that names none (and for tool call ids).
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
