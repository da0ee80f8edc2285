//! Push and pull through an OCI registry, one blob at a time and streamed (a layer is never
//! held whole in memory), with our own `reqwest` client (`oci-client` parses references).
//!
//! * push: each blob the registry already has is skipped (a re-push after a failure resumes,
//!   a second model uploads only what differs), the rest are streamed from their files (one
//!   `POST` to open the upload, one `PUT` of the bytes), hashed as they are read: a file
//!   that is no longer the blob it was packed as fails the push before the registry gets
//!   its whole body. The manifest goes last. Transient failures (connection errors, 429,
//!   5xx) are retried with back-off.
//! * pull: the image manifest is checked ([`crate::package::parse_manifest`]) before
//!   anything is downloaded, then the model manifest (`manifest.gdsm`, fetched first)
//!   against the package's files before anything else is; each blob missing from the store
//!   downloads to a `.partial` file, resumed with an HTTP Range request after an
//!   interruption (fetched once more from the start when the resumed bytes do not match),
//!   and is checked (sha256, then the BLAKE3 the package declares) before it enters the
//!   store; a blob the store holds is hashed again before it is used. The output directory
//!   is assembled from hard links beside its final name, every file checked against its
//!   own layer's BLAKE3 and the directory validated, and renamed into place: it appears
//!   whole or not at all. A refused package's blobs leave the store again.
//!
//! * limits: every body is read with a cap (`oci-client` reads manifests, error bodies and
//!   token answers whole, so no request goes through it) — the manifest at
//!   [`crate::MAX_MANIFEST_BYTES`], the config and blobs at their declared sizes, a token
//!   answer at [`MAX_TOKEN_BODY`], error bodies of push and pull at [`MAX_ERROR_BODY`] of
//!   which an [`excerpt`] is printed — and every request, push or pull, is paced
//!   ([`Limits::min_rate`] over [`Limits::window`]); the whole push or pull has a deadline
//!   ([`Limits::timeout`]).
//!
//! Credentials come from the Docker config (`$DOCKER_CONFIG/config.json` or
//! `~/.docker/config.json`: `auths` and credential helpers); a registry that answers with a
//! bearer-token challenge gets the token request of the distribution spec's token protocol.

use crate::error::{DistError, Result};
use crate::foreign::{parse_foreign, ForeignModel, Role};
use crate::layout::Staged;
use crate::package::{
    hex, parse_manifest, sha256_digest, Artifact, BlobRef, BlobSource, Layer, ParsedManifest,
};
use crate::store::{link_or_copy, Store, Stored};
use crate::*;
use futures_util::StreamExt;
use oci_client::secrets::RegistryAuth;
use oci_client::Reference;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Once a push has sent a whole blob, the registry may take a second per this many bytes
/// of it (beyond four `--min-rate` windows) to answer: it hashes or copies the blob first.
pub const ANSWER_BYTES_PER_SEC: u64 = 8 << 20;
/// Default `--min-rate`: bytes per second a transfer must average over each window.
pub const DEFAULT_MIN_RATE: u64 = 1024;
/// Default `--min-rate-window`.
pub const DEFAULT_RATE_WINDOW: Duration = Duration::from_secs(30);
/// Default `--timeout`: the whole push or pull.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(12 * 3600);
/// The most of a registry's error body that is read (enough for an OCI error envelope);
/// the rest is never downloaded.
pub const MAX_ERROR_BODY: usize = 64 << 10;
/// The most of a token service's answer that is read (a token is a few KiB).
pub const MAX_TOKEN_BODY: usize = 1 << 20;
/// The most of a registry's error text that is printed.
pub const EXCERPT_BYTES: usize = 512;

/// Limits on a registry's transfers, so that a registry that stalls, trickles or answers
/// without end cannot keep a pull or push alive for ever.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Each request must move at least `min_rate × window` bytes in every full `window`
    /// it lasts (waiting for the response included); 0 turns the check off.
    pub min_rate: u64,
    /// The window `min_rate` is averaged over.
    pub window: Duration,
    /// The whole push or pull must finish within this; `None`: no deadline.
    pub timeout: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            min_rate: DEFAULT_MIN_RATE,
            window: DEFAULT_RATE_WINDOW,
            timeout: Some(DEFAULT_TIMEOUT),
        }
    }
}

/// How to reach the registry.
#[derive(Clone, Default)]
pub struct RemoteOptions {
    /// Minimum rate and overall deadline.
    pub limits: Limits,
    /// Speak plain HTTP (a local registry).
    pub plain_http: bool,
    /// Cap the transfer rate (bytes per second).
    pub limit_rate: Option<u64>,
    /// Called with bytes transferred (or found already there).
    pub progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    /// Called once a pull knows how many bytes the model has.
    pub on_total: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    /// Push: repositories of the same registry to mount missing blobs from (a registry
    /// answers "already there" per repository; a cross-repository mount shares the bytes
    /// without uploading them).
    pub mount_from: Vec<String>,
}

/// `gdsconv push --json`.
#[derive(Clone, Debug, Serialize)]
pub struct PushSummary {
    /// Where it went.
    pub reference: String,
    /// The manifest digest (pull `REPO@DIGEST` for exactly this model).
    pub manifest_digest: String,
    /// Distinct blobs (config and layers).
    pub blobs: usize,
    /// Blobs uploaded.
    pub uploaded_blobs: usize,
    /// Blobs the registry already had.
    pub skipped_blobs: usize,
    /// Blobs mounted from another repository of the registry (`--mount-from`).
    pub mounted_blobs: usize,
    /// Bytes uploaded.
    pub uploaded_bytes: u64,
}

/// `gdsconv pull --json`.
#[derive(Clone, Debug, Serialize)]
pub struct PullSummary {
    /// What was pulled.
    pub reference: String,
    /// Its manifest digest.
    pub manifest_digest: String,
    /// Distinct blobs (config and layers).
    pub blobs: usize,
    /// Blobs downloaded now (wholly or the rest of a partial one).
    pub downloaded_blobs: usize,
    /// Blobs the store already held.
    pub reused_blobs: usize,
    /// Bytes downloaded now.
    pub downloaded_bytes: u64,
    /// Bytes of partial downloads that were resumed rather than fetched again.
    pub resumed_bytes: u64,
    /// The model directory.
    pub output: PathBuf,
}

/// A registry repository, ready to talk to.
pub struct Remote {
    /// Every request, push and pull, goes through this client (`oci-client`'s reads whole
    /// bodies into memory, error bodies and token answers included): every body read is
    /// capped and paced.
    http: reqwest::Client,
    reference: Reference,
    auth: RegistryAuth,
    opts: RemoteOptions,
    rt: tokio::runtime::Runtime,
}

fn credentials(registry: &str) -> RegistryAuth {
    let mut keys = vec![registry.to_string()];
    if registry == "docker.io"
        || registry == "index.docker.io"
        || registry == "registry-1.docker.io"
    {
        keys.push("https://index.docker.io/v1/".into());
    }
    for k in keys {
        match docker_credential::get_credential(&k) {
            Ok(docker_credential::DockerCredential::UsernamePassword(u, p)) => {
                return RegistryAuth::Basic(u, p)
            }
            Ok(docker_credential::DockerCredential::IdentityToken(t)) => {
                return RegistryAuth::Bearer(t)
            }
            Err(_) => continue,
        }
    }
    RegistryAuth::Anonymous
}

/// True when `s` looks like an OCI reference rather than a local path: it parses, and its
/// first component names a registry (has a `.` or `:`, or is `localhost`).
pub fn looks_like_reference(s: &str) -> bool {
    let first = s.split('/').next().unwrap_or("");
    s.contains('/')
        && (first.contains('.') || first.contains(':') || first == "localhost")
        && !s.starts_with('.')
        && !s.starts_with('/')
        && s.parse::<Reference>().is_ok()
}

impl Remote {
    /// Parses `reference` and reads the credentials for its registry.
    pub fn new(reference: &str, opts: RemoteOptions) -> Result<Remote> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let parsed: Reference = reference.parse().map_err(|e| {
            DistError::usage(format!(
                "{reference:?} is not an OCI reference (registry/repository:tag or @sha256:…): {e}"
            ))
        })?;
        let auth = credentials(parsed.resolve_registry());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DistError::usage(format!("cannot start the I/O runtime: {e}")))?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .user_agent(concat!("gdsllm/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| DistError::usage(format!("cannot set up the HTTP client: {e}")))?;
        Ok(Remote {
            http,
            reference: parsed,
            auth,
            opts,
            rt,
        })
    }

    /// The reference as parsed.
    pub fn reference(&self) -> String {
        self.reference.whole()
    }

    /// Its tag, if it names one.
    pub fn tag(&self) -> Option<&str> {
        self.reference.tag()
    }

    /// `registry/repository`, without tag or digest.
    pub fn repository(&self) -> String {
        format!(
            "{}/{}",
            self.reference.registry(),
            self.reference.repository()
        )
    }

    /// `fut` under the overall deadline (`--timeout`).
    async fn deadline<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let Some(d) = self.opts.limits.timeout else {
            return fut.await;
        };
        match tokio::time::timeout(d, fut).await {
            Ok(r) => r,
            Err(_) => Err(DistError::registry(format!(
                "registry {}: {what} {}: not finished after the --timeout of {} s (gave up; a pull resumes its partial downloads when run again)",
                self.reference.resolve_registry(),
                self.reference.whole(),
                d.as_secs_f64()
            ))),
        }
    }

    fn pace(&self, what: &str) -> Pace {
        Pace::new(
            &self.opts.limits,
            self.opts.limit_rate,
            format!("registry {}: {what}", self.reference.resolve_registry()),
        )
    }

    /// `registry/v2/repository/…` for this reference.
    fn url(&self, kind: &str, what: &str) -> String {
        let r = &self.reference;
        let scheme = if self.opts.plain_http {
            "http"
        } else {
            "https"
        };
        format!(
            "{scheme}://{}/v2/{}/{kind}/{what}{}",
            r.resolve_registry(),
            r.repository(),
            r.namespace()
                .map(|ns| format!("?ns={ns}"))
                .unwrap_or_default()
        )
    }

    /// How pulls authenticate: a bearer token from the registry's challenge, else the
    /// Basic credentials, else nothing (the registry's 401 then says so). A failed token
    /// request falls back the same way, unless a limit stopped it.
    async fn pull_auth(&self) -> Result<ReqAuth> {
        let mut limited = false;
        match self.token(false, &mut limited).await {
            Ok(Some((t, renew))) => Ok(ReqAuth::new(false, Cred::Bearer(t), renew)),
            Err(e) if limited => Err(e),
            _ => Ok(ReqAuth::new(false, self.basic_or_none(), None)),
        }
    }

    /// How a push authenticates: as a pull does, with a token for pushing; a failed token
    /// request fails the push.
    async fn push_auth(&self) -> Result<ReqAuth> {
        Ok(match self.token(true, &mut false).await? {
            Some((t, renew)) => ReqAuth::new(true, Cred::Bearer(t), renew),
            None => ReqAuth::new(true, self.basic_or_none(), None),
        })
    }

    fn basic_or_none(&self) -> Cred {
        match &self.auth {
            RegistryAuth::Basic(u, p) => Cred::Basic(u.clone(), p.clone()),
            _ => Cred::None,
        }
    }

    /// The credentials `auth` holds now, with a new token if the one it has is about to
    /// expire.
    async fn cred(&self, auth: &ReqAuth) -> Result<Cred> {
        let (cred, renew_at) = auth.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if renew_at.is_none_or(|t| Instant::now() < t) {
            return Ok(cred);
        }
        // boxed: the token's own requests go through `send`, which calls this
        let (t, renew_at) = Box::pin(self.token(auth.push, &mut false))
            .await?
            .ok_or_else(|| {
                DistError::registry(format!(
                    "registry {}: renewing the token: the registry no longer asks for one",
                    self.reference.resolve_registry()
                ))
            })?;
        let cred = Cred::Bearer(t);
        *auth.state.lock().unwrap_or_else(|e| e.into_inner()) = (cred.clone(), renew_at);
        Ok(cred)
    }

    /// The bearer token for pulling (or pushing) this repository, if the registry asks for
    /// one: `GET /v2/` answers with a `WWW-Authenticate: Bearer realm=…,service=…` challenge,
    /// and the realm with `{"token": …}` (or `access_token`), for the Basic credentials if
    /// any. Read through our client, capped like every body: the token answer at
    /// [`MAX_TOKEN_BODY`] bytes, an error at [`MAX_ERROR_BODY`]. With the token, when to
    /// ask for another (10 s before its `expires_in`, 60 s when it says none); `limited` is
    /// set when a limit stopped it (`--min-rate`, the cap).
    async fn token(
        &self,
        push: bool,
        limited: &mut bool,
    ) -> Result<Option<(String, Option<Instant>)>> {
        if let RegistryAuth::Bearer(t) = &self.auth {
            return Ok(Some((t.clone(), None)));
        }
        let asked = Instant::now();
        let registry = self.reference.resolve_registry();
        let what = if push {
            "authenticating for push"
        } else {
            "authenticating"
        };
        let scheme = if self.opts.plain_http {
            "http"
        } else {
            "https"
        };
        let url = format!("{scheme}://{registry}/v2/");
        let mut pace = self.pace(what);
        let fail = |f: Fail, pace: &Pace, limited: &mut bool| {
            *limited = pace.failed;
            match f {
                Fail::Retry(e) | Fail::Stop(e) => e,
            }
        };
        let resp = match self
            .send(
                &ReqAuth::none(),
                self.http.get(&url),
                &url,
                what,
                &mut pace,
                None,
            )
            .await
        {
            Ok(r) => r,
            Err(f) => return Err(fail(f, &pace, limited)),
        };
        let Some(challenge) = resp
            .headers()
            .get(http::header::WWW_AUTHENTICATE)
            .and_then(|h| h.to_str().ok())
            .and_then(bearer_challenge)
        else {
            return Ok(None);
        };
        drop(resp);
        let (realm, service) = challenge;
        let scope = format!(
            "repository:{}:{}",
            self.reference.repository(),
            if push { "pull,push" } else { "pull" }
        );
        let mut query = vec![("scope", scope.as_str())];
        if let Some(s) = &service {
            query.push(("service", s));
        }
        let mut req = self.http.get(&realm).query(&query);
        if let RegistryAuth::Basic(u, p) = &self.auth {
            req = req.basic_auth(u, Some(p));
        }
        // the realm is the registry's choice of host: the credentials go there as they
        // would with any client that speaks the token protocol
        let resp = match self
            .send(&ReqAuth::none(), req, &realm, what, &mut pace, None)
            .await
        {
            Ok(r) => r,
            Err(f) => return Err(fail(f, &pace, limited)),
        };
        if !resp.status().is_success() {
            let f = self.status_error(resp, &realm, what, &mut pace).await;
            return Err(fail(f, &pace, limited));
        }
        let body = match read_capped(resp, MAX_TOKEN_BODY, &mut pace).await {
            Ok((_, true)) => {
                *limited = true;
                return Err(DistError::registry(format!(
                    "registry {registry}: {what}: the token service serves more than {MAX_TOKEN_BODY} bytes; stopped reading ({realm})"
                )));
            }
            Ok((b, false)) => b,
            Err(e) => {
                *limited = pace.failed;
                return Err(e);
            }
        };
        let bad = |why: String| {
            DistError::registry(format!(
                "registry {registry}: {what}: the token service's answer {why} ({realm})"
            ))
        };
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| bad(format!("is not JSON: {e}")))?;
        let lifetime = v
            .get("expires_in")
            .and_then(|e| e.as_u64())
            .unwrap_or(60)
            .clamp(1, 365 * 86400);
        let renew_at = asked + Duration::from_secs(lifetime.saturating_sub(10).max(lifetime / 2));
        match v
            .get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
        {
            Some(t) => Ok(Some((t.to_string(), Some(renew_at)))),
            None => Err(bad("has no token".into())),
        }
    }

    /// True when `url` is on this reference's registry (host and port): only such requests
    /// carry the credentials (an upload `Location` may point elsewhere, e.g. object storage).
    fn on_registry(&self, url: &str) -> bool {
        let scheme = if self.opts.plain_http {
            "http"
        } else {
            "https"
        };
        let registry = format!("{scheme}://{}/", self.reference.resolve_registry());
        match (reqwest::Url::parse(url), reqwest::Url::parse(&registry)) {
            (Ok(u), Ok(r)) => {
                u.scheme() == r.scheme()
                    && u.host_str().is_some()
                    && u.host_str() == r.host_str()
                    && u.port_or_known_default() == r.port_or_known_default()
            }
            _ => false,
        }
    }

    /// Sends `req` (to `url`; authenticated when it is on the registry), paced, counting the
    /// bytes `upload` reports sent of its total (an upload): the response, whatever its
    /// status.
    async fn send(
        &self,
        auth: &ReqAuth,
        req: reqwest::RequestBuilder,
        url: &str,
        what: &str,
        pace: &mut Pace,
        upload: Option<(&std::sync::atomic::AtomicU64, u64)>,
    ) -> std::result::Result<reqwest::Response, Fail> {
        let registry = self.reference.resolve_registry();
        let req = if self.on_registry(url) {
            match self.cred(auth).await.map_err(Fail::Stop)? {
                Cred::Bearer(t) => req.bearer_auth(t),
                Cred::Basic(u, p) => req.basic_auth(u, Some(p)),
                Cred::None => req,
            }
        } else {
            req
        };
        match pace.wait(req.send(), upload).await.map_err(Fail::Stop)? {
            Ok(r) => Ok(r),
            Err(e) => {
                let msg = format!("registry {registry}: {what}: {}", reqwest_detail(&e));
                Err(if e.is_builder() {
                    Fail::Stop(DistError::registry(msg))
                } else {
                    Fail::Retry(DistError::registry(msg))
                })
            }
        }
    }

    /// Sends `GET url` (paced) and checks the status: a 2xx response, or an error whose
    /// message holds at most an excerpt of the body (of which at most [`MAX_ERROR_BODY`]
    /// bytes are read).
    async fn get(
        &self,
        auth: &ReqAuth,
        url: &str,
        accept: Option<&str>,
        range: Option<(u64, u64)>,
        what: &str,
        pace: &mut Pace,
    ) -> std::result::Result<reqwest::Response, Fail> {
        let mut req = self.http.get(url);
        if let Some(a) = accept {
            req = req.header(http::header::ACCEPT, a);
        }
        if let Some((from, to)) = range {
            req = req.header(http::header::RANGE, format!("bytes={from}-{to}"));
        }
        let resp = self.send(auth, req, url, what, pace, None).await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(self.status_error(resp, url, what, pace).await)
    }

    /// The error for a response whose status is not a success: its message holds at most an
    /// excerpt of the body, of which at most [`MAX_ERROR_BODY`] bytes are read (whatever the
    /// registry sends); 429 and 5xx are worth a retry.
    async fn status_error(
        &self,
        resp: reqwest::Response,
        url: &str,
        what: &str,
        pace: &mut Pace,
    ) -> Fail {
        let registry = self.reference.resolve_registry();
        let code = resp.status().as_u16();
        let total = resp.content_length();
        let (body, cut) = match read_capped(resp, MAX_ERROR_BODY, pace).await {
            Ok(v) => v,
            Err(e) => return Fail::Stop(e),
        };
        let detail = if code == 401 {
            "401 Unauthorized: the credentials are missing or wrong (docker login / $DOCKER_CONFIG/config.json)".to_string()
        } else {
            let text = envelope_text(&body).unwrap_or_else(|| excerpt(&body));
            let more = match (cut, total) {
                (false, _) => String::new(),
                (true, Some(t)) => format!(" [the body has {t} bytes; {MAX_ERROR_BODY} read]"),
                (true, None) => format!(
                    " [the body is longer than {MAX_ERROR_BODY} bytes; the rest was not read]"
                ),
            };
            format!("HTTP {code}: {text}{more}")
        };
        let e = DistError::registry(format!("registry {registry}: {what}: {detail} ({url})"));
        if code == 429 || code >= 500 {
            Fail::Retry(e)
        } else {
            Fail::Stop(e)
        }
    }

    /// The registry's answer to an upload request (`POST …/blobs/uploads/`): its `Location`,
    /// made absolute.
    fn location(&self, resp: &reqwest::Response, url: &str, what: &str) -> Result<reqwest::Url> {
        let bad = |why: String| {
            DistError::registry(format!(
                "registry {}: {what}: {why} ({url})",
                self.reference.resolve_registry()
            ))
        };
        let loc = resp
            .headers()
            .get(http::header::LOCATION)
            .ok_or_else(|| bad(format!("HTTP {} without a Location header", resp.status())))?
            .to_str()
            .map_err(|_| bad("a Location header that is not text".into()))?;
        reqwest::Url::parse(url)
            .and_then(|base| base.join(loc))
            .map_err(|e| bad(format!("Location {}: {e}", excerpt(loc.as_bytes()))))
    }

    /// `HEAD` of a blob: whether the repository has it.
    async fn blob_exists(
        &self,
        auth: &ReqAuth,
        digest: &str,
        what: &str,
    ) -> std::result::Result<bool, Fail> {
        let url = self.url("blobs", digest);
        let mut pace = self.pace(what);
        let resp = self
            .send(auth, self.http.head(&url), &url, what, &mut pace, None)
            .await?;
        match resp.status().as_u16() {
            200..=299 => Ok(true),
            404 => Ok(false),
            _ => Err(self.status_error(resp, &url, what, &mut pace).await),
        }
    }

    /// Tries a cross-repository mount of `digest` from `from` (same registry): true when the
    /// registry says it mounted it (201). Any other answer is no mount (the blob is then
    /// uploaded), unless the registry stalled (`--min-rate`), which fails the push.
    async fn mount(&self, auth: &ReqAuth, digest: &str, from: &str) -> Result<bool> {
        let what = format!("mounting blob {digest}");
        let base = self.url("blobs", "uploads/");
        let Ok(url) = reqwest::Url::parse_with_params(&base, &[("mount", digest), ("from", from)])
        else {
            return Ok(false);
        };
        let url = url.to_string();
        let mut pace = self.pace(&what);
        let req = self
            .http
            .post(&url)
            .header(http::header::CONTENT_LENGTH, "0");
        match self.send(auth, req, &url, &what, &mut pace, None).await {
            Ok(resp) if resp.status() == reqwest::StatusCode::CREATED => Ok(true),
            Ok(resp) if resp.status().is_success() => Ok(false),
            Ok(resp) => match self.status_error(resp, &url, &what, &mut pace).await {
                Fail::Stop(e) if pace.failed => Err(e),
                _ => Ok(false),
            },
            Err(Fail::Stop(e)) if pace.failed => Err(e),
            Err(_) => Ok(false),
        }
    }

    /// Uploads one blob, streamed from its file: `POST …/blobs/uploads/` opens the upload
    /// (202 and a `Location`), one `PUT Location?digest=…` sends the bytes (201).
    async fn upload_blob(
        &self,
        auth: &ReqAuth,
        b: &BlobRef,
        sent: &Arc<std::sync::atomic::AtomicU64>,
        what: &str,
    ) -> std::result::Result<(), Fail> {
        let url = self.url("blobs", "uploads/");
        let mut pace = self.pace(what);
        let req = self
            .http
            .post(&url)
            .header(http::header::CONTENT_LENGTH, "0");
        let resp = self.send(auth, req, &url, what, &mut pace, None).await?;
        if !resp.status().is_success() {
            return Err(self.status_error(resp, &url, what, &mut pace).await);
        }
        let mut put = self.location(&resp, &url, what).map_err(Fail::Stop)?;
        drop(resp);
        put.query_pairs_mut().append_pair("digest", &b.digest);
        let put = put.to_string();
        sent.store(0, std::sync::atomic::Ordering::Relaxed);
        let local: LocalFail = Default::default();
        let stream = blob_stream(
            b,
            self.opts.limit_rate,
            self.opts.progress.clone(),
            sent.clone(),
            local.clone(),
        );
        let req = self
            .http
            .put(&put)
            .header(http::header::CONTENT_LENGTH, b.size)
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .body(reqwest::Body::wrap_stream(stream));
        let resp = self
            .send(auth, req, &put, what, &mut pace, Some((&**sent, b.size)))
            .await;
        // the blob's own file failed (unreadable, shorter, changed since it was packed):
        // that, not what the aborted request says, and no retry
        if let Some(e) = local.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(Fail::Stop(e));
        }
        let resp = resp?;
        if !resp.status().is_success() {
            return Err(self.status_error(resp, &put, what, &mut pace).await);
        }
        Ok(())
    }

    /// `PUT` of the image manifest, under the reference's tag (or digest).
    async fn put_manifest(
        &self,
        auth: &ReqAuth,
        manifest: &[u8],
        what: &str,
    ) -> std::result::Result<(), Fail> {
        let r = &self.reference;
        let url = self.url(
            "manifests",
            r.digest().unwrap_or_else(|| r.tag().unwrap_or("latest")),
        );
        let mut pace = self.pace(what);
        let req = self
            .http
            .put(&url)
            .header(http::header::CONTENT_TYPE, MANIFEST_MEDIA_TYPE)
            .body(manifest.to_vec());
        let resp = self.send(auth, req, &url, what, &mut pace, None).await?;
        if !resp.status().is_success() {
            return Err(self.status_error(resp, &url, what, &mut pace).await);
        }
        Ok(())
    }

    /// A small body (the manifest, the config), read whole but never past `cap` bytes.
    async fn get_small(
        &self,
        auth: &ReqAuth,
        url: &str,
        accept: Option<&str>,
        cap: u64,
        what: &str,
    ) -> std::result::Result<Vec<u8>, Fail> {
        let mut pace = self.pace(what);
        let resp = self.get(auth, url, accept, None, what, &mut pace).await?;
        let too_big = || {
            Fail::Stop(DistError::invalid(format!(
                "{}: {what}: the registry serves more than the {cap} bytes allowed here; stopped reading ({url})",
                self.reference.whole()
            )))
        };
        if resp.content_length().is_some_and(|n| n > cap) {
            return Err(too_big());
        }
        match read_capped(resp, cap as usize, &mut pace).await {
            Ok((_, true)) => Err(too_big()),
            Ok((v, false)) => Ok(v),
            Err(e) if e.kind == crate::Kind::Registry && !pace.failed => Err(Fail::Retry(e)),
            Err(e) => Err(Fail::Stop(e)),
        }
    }

    /// Retries `f` on transient failures (connection errors, 429, 5xx) with back-off.
    async fn retrying<T, F, Fut>(&self, mut f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, Fail>>,
    {
        let mut delay = Duration::from_millis(500);
        for attempt in 1.. {
            match f().await {
                Ok(v) => return Ok(v),
                Err(Fail::Retry(e)) if attempt < 4 => {
                    eprintln!("{e} (retrying in {:.1} s)", delay.as_secs_f64());
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(Fail::Retry(e)) | Err(Fail::Stop(e)) => return Err(e),
            }
        }
        unreachable!()
    }

    /// Pushes the artifact: blobs first (those the registry lacks), then the manifest.
    pub fn push(&self, a: &Artifact) -> Result<PushSummary> {
        self.rt
            .block_on(self.deadline("pushing to", self.push_async(a)))
    }

    async fn push_async(&self, a: &Artifact) -> Result<PushSummary> {
        let r = &self.reference;
        let auth = self.push_auth().await?;
        let mut seen = std::collections::HashSet::new();
        let blobs: Vec<&BlobRef> = a
            .blobs()
            .filter(|b| seen.insert(b.digest.clone()))
            .collect();
        let mut s = PushSummary {
            reference: r.whole(),
            manifest_digest: a.manifest_digest.clone(),
            blobs: blobs.len(),
            uploaded_blobs: 0,
            skipped_blobs: 0,
            mounted_blobs: 0,
            uploaded_bytes: 0,
        };
        for b in blobs {
            let what = format!("checking blob {}", b.digest);
            if self
                .retrying(|| self.blob_exists(&auth, &b.digest, &what))
                .await?
            {
                s.skipped_blobs += 1;
                if let Some(p) = &self.opts.progress {
                    p(b.size);
                }
                continue;
            }
            let mut mounted = false;
            for src in &self.opts.mount_from {
                if self.mount(&auth, &b.digest, src).await?
                    && self
                        .blob_exists(&auth, &b.digest, &what)
                        .await
                        .unwrap_or(false)
                {
                    mounted = true;
                    break;
                }
            }
            if mounted {
                s.mounted_blobs += 1;
                if let Some(p) = &self.opts.progress {
                    p(b.size);
                }
                continue;
            }
            let what = format!("uploading blob {} ({} bytes)", b.digest, b.size);
            let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
            self.retrying(|| self.upload_blob(&auth, b, &sent, &what))
                .await?;
            s.uploaded_blobs += 1;
            s.uploaded_bytes += b.size;
        }
        let what = "uploading the manifest";
        self.retrying(|| self.put_manifest(&auth, &a.manifest, what))
            .await?;
        Ok(s)
    }

    /// Fetches and checks the image manifest: (bytes, digest, parsed) — a GdsLLM package
    /// by every rule of [`parse_manifest`], another tool's model by [`parse_foreign`].
    async fn manifest(&self, auth: &ReqAuth) -> Result<(Vec<u8>, String, Parsed)> {
        let r = &self.reference;
        let url = self.url(
            "manifests",
            r.digest().unwrap_or_else(|| r.tag().unwrap_or("latest")),
        );
        let cap = crate::MAX_MANIFEST_BYTES as u64;
        let bytes = self
            .retrying(|| {
                self.get_small(
                    auth,
                    &url,
                    Some(crate::foreign::ACCEPT_MANIFESTS),
                    cap,
                    "fetching the manifest",
                )
            })
            .await?;
        let digest = sha256_digest(&bytes);
        if let Some(want) = r.digest() {
            if want != digest {
                return Err(DistError::invalid(format!(
                    "{}: the registry served a manifest with digest {digest}, not the {want} asked for",
                    r.whole()
                )));
            }
        }
        let what = format!("{} ({digest})", r.whole());
        let ours = serde_json::from_slice::<serde_json::Value>(&bytes)
            .map_or(true, |v| crate::foreign::is_gdsllm_package(&v));
        let parsed = if ours {
            Parsed::Ours(parse_manifest(&bytes, &what)?)
        } else {
            Parsed::Foreign(parse_foreign(&bytes, &what)?)
        };
        Ok((bytes, digest, parsed))
    }

    /// Pulls into `out` (which must not exist unless `force`, and then hold nothing but a
    /// model and not the store), through `store`.
    pub fn pull(&self, store: &Store, out: &Path, force: bool) -> Result<PullSummary> {
        self.rt
            .block_on(self.deadline("pulling", self.pull_async(store, Some(out), force, None)))
    }

    /// Pulls into the store's own directory for this model (`models/<manifest hex>`),
    /// unless it is there already.
    pub fn pull_into_store(&self, store: &Store) -> Result<PullSummary> {
        self.rt
            .block_on(self.deadline("pulling", self.pull_async(store, None, true, None)))
    }

    /// [`Remote::pull_into_store`], recording `reference` as naming the model
    /// ([`Store::set_ref`]) under the pull's own lock of the store, so that no `gc` comes
    /// between the two and no other lock of the store is needed: a refused package's blobs
    /// are then removed at once (see [`Remote::pull`]).
    pub fn pull_into_store_as(&self, store: &Store, reference: &str) -> Result<PullSummary> {
        self.rt.block_on(self.deadline(
            "pulling",
            self.pull_async(store, None, true, Some(reference)),
        ))
    }

    async fn pull_async(
        &self,
        store: &Store,
        out: Option<&Path>,
        force: bool,
        record: Option<&str>,
    ) -> Result<PullSummary> {
        let lock = store.lock(false)?;
        let auth = self.pull_auth().await?;
        let (_, digest, parsed) = self.manifest(&auth).await?;
        let what = format!("{} ({digest})", self.reference.whole());
        let n_blobs = match &parsed {
            Parsed::Ours(p) => p.layers.len() + 1,
            Parsed::Foreign(m) => m.files.len() + 1,
        };
        // into the store: one pull per model, a concurrent one waits and then finds it there
        let _entry = match out {
            Some(_) => None,
            None => Some(store.lock_entry(&digest)?),
        };
        let out = match out {
            Some(o) => o.to_path_buf(),
            None => {
                let o = store.model_dir(&digest);
                if o.is_dir() {
                    if let Some(r) = record {
                        store.set_ref(r, &digest, "oci")?;
                    }
                    return Ok(PullSummary {
                        reference: self.reference.whole(),
                        manifest_digest: digest,
                        blobs: n_blobs,
                        downloaded_blobs: 0,
                        reused_blobs: n_blobs,
                        downloaded_bytes: 0,
                        resumed_bytes: 0,
                        output: o,
                    });
                }
                o
            }
        };
        let mut added = Added::default();
        let r = match &parsed {
            Parsed::Ours(p) => {
                self.pull_steps(store, &auth, p, &digest, &what, &out, force, &mut added)
                    .await
            }
            Parsed::Foreign(m) => {
                let into_store = out == store.model_dir(&digest);
                let r = self
                    .pull_foreign(store, &auth, m, &digest, &what, &out, force, &mut added)
                    .await;
                if r.is_ok() {
                    if into_store {
                        // share identical files with every other model in the store
                        for f in crate::store::walk_files(&out) {
                            store.ingest(&f)?;
                        }
                    }
                    // the other tool's files were only the conversion's input: nothing
                    // links them, so they leave the store now (gc would remove them)
                    remove_added(&lock, &added);
                }
                r
            }
        };
        match r {
            Ok(s) => {
                if let Some(r) = record {
                    store.set_ref(r, &digest, "oci")?;
                }
                Ok(s)
            }
            Err(e) => {
                // a refused package: what it brought into the store goes (a registry or
                // local failure keeps it, for the next pull to resume)
                if e.kind == crate::Kind::Invalid {
                    remove_added(&lock, &added);
                }
                Err(e)
            }
        }
    }

    /// The pull proper, once the manifest is checked: the config, then the model manifest
    /// (`manifest.gdsm`), which must list exactly the files the package ships before
    /// anything else is fetched, then the other blobs; each blob already in the store is
    /// hashed again before it is used. `OUT_DIR` is assembled beside its final name,
    /// checked and renamed into place. What entered the store is in `added`.
    #[allow(clippy::too_many_arguments)]
    async fn pull_steps(
        &self,
        store: &Store,
        auth: &ReqAuth,
        p: &ParsedManifest,
        digest: &str,
        what: &str,
        out: &Path,
        force: bool,
        added: &mut Added,
    ) -> Result<PullSummary> {
        // an existing OUT_DIR: replaced (with --force) only when it holds nothing but a
        // model, and never when it is or holds the store the blobs are linked from
        let staged = Staged::dir(out, force, &[("the store", store.root())], true)?;
        if let Some(t) = &self.opts.on_total {
            let mut seen = std::collections::HashSet::new();
            t(p.layers
                .iter()
                .filter(|l| seen.insert(&l.digest))
                .map(|l| l.size)
                .sum());
        }
        // the config: small, capped, checked against the layers
        let (config, config_fetched) = self
            .fetch_small(auth, store, &p.config_digest, p.config_size, added)
            .await?;
        let cfg: serde_json::Value = serde_json::from_slice(&config).map_err(|e| {
            DistError::invalid(format!(
                "{what}: config blob {} is not JSON: {e}",
                p.config_digest
            ))
        })?;
        let diff_ids: Vec<&str> = cfg
            .pointer("/modelfs/diffIds")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let layer_ids: Vec<&str> = p.layers.iter().map(|l| l.digest.as_str()).collect();
        if diff_ids != layer_ids {
            return Err(DistError::invalid(format!(
                "{what}: the config's modelfs.diffIds do not equal the layer digests (raw layers must)"
            )));
        }
        // each blob once, the model manifest's first
        let manifest_layer = p
            .layers
            .iter()
            .find(|l| l.path == gds_format::MANIFEST_FILE)
            .ok_or_else(|| {
                DistError::invalid(format!(
                    "{what}: no layer holds {}",
                    gds_format::MANIFEST_FILE
                ))
            })?;
        let mut seen = std::collections::HashSet::new();
        let mut unique: Vec<&Layer> = std::iter::once(manifest_layer)
            .chain(p.layers.iter())
            .filter(|l| seen.insert(l.digest.clone()))
            .collect();
        // room for what is missing
        check_room(store, unique.iter().copied(), 0, what, "")?;
        let mut s = PullSummary {
            reference: self.reference.whole(),
            manifest_digest: digest.to_string(),
            blobs: unique.len() + 1,
            downloaded_blobs: 0,
            reused_blobs: 0,
            downloaded_bytes: 0,
            resumed_bytes: 0,
            output: out.to_path_buf(),
        };
        if config_fetched {
            s.downloaded_blobs += 1;
            s.downloaded_bytes += p.config_size;
        } else {
            s.reused_blobs += 1;
        }
        let dir = staged.path();
        // the BLAKE3 of each blob's bytes as hashed in this pull (downloaded, or read
        // again from the store), by digest
        let mut verified: std::collections::HashMap<String, [u8; 32]> = Default::default();
        let mut flusher = Flusher::new(store);
        let rest = unique.split_off(1);
        let b3 = self
            .obtain(
                auth,
                store,
                manifest_layer,
                what,
                &mut s,
                &mut flusher,
                added,
            )
            .await?;
        verified.insert(manifest_layer.digest.clone(), b3);
        flusher.finish(added)?;
        link_or_copy(
            &store.blob_path(&manifest_layer.digest)?,
            &dir.join(&manifest_layer.path),
        )?;
        // before fetching the rest: the files the model manifest lists are the package's
        check_listing(&dir, &p.layers, &verified, what)?;
        for l in rest {
            let b3 = self
                .obtain(auth, store, l, what, &mut s, &mut flusher, added)
                .await?;
            verified.insert(l.digest.clone(), b3);
        }
        // every download is on disk before it enters the store
        flusher.finish(added)?;
        for l in &p.layers {
            if l.path != manifest_layer.path {
                link_or_copy(&store.blob_path(&l.digest)?, &dir.join(&l.path))?;
            }
        }
        check_assembled(&dir, &p.layers, &verified, what)?;
        staged.commit()?;
        // the config stays in the store while the model does (gc)
        let _ = store.keep_config(digest, &p.config_digest);
        Ok(s)
    }

    /// Another tool's model ([`crate::foreign`]): its config checked, the files the
    /// conversion reads fetched into the store (each checked against its digest, resumable
    /// as any blob), assembled under their names in a staging directory beside the store's
    /// partial downloads, and converted into `out` as `gdsconv convert` would (`force` as
    /// its). What entered the store is in `added`.
    #[allow(clippy::too_many_arguments)]
    async fn pull_foreign(
        &self,
        store: &Store,
        auth: &ReqAuth,
        m: &ForeignModel,
        digest: &str,
        what: &str,
        out: &Path,
        force: bool,
        added: &mut Added,
    ) -> Result<PullSummary> {
        let (config, config_fetched) = self
            .fetch_small(auth, store, &m.config_digest, m.config_size, added)
            .await?;
        crate::foreign::check_config(m, &config, what)?;
        if let Some(t) = &self.opts.on_total {
            t(m.total_bytes());
        }
        // room for the missing blobs and the converted model (about as large)
        check_room(
            store,
            m.files.iter().map(|f| &f.layer),
            m.total_bytes(),
            what,
            " (the download and its conversion)",
        )?;
        eprintln!(
            "{what}: {}, converted as it arrives{}",
            m.origin.name(),
            if m.skipped.is_empty() {
                String::new()
            } else {
                format!("; left out: {}", m.skipped.join(", "))
            }
        );
        let mut s = PullSummary {
            reference: self.reference.whole(),
            manifest_digest: digest.to_string(),
            blobs: m.files.len() + 1,
            downloaded_blobs: usize::from(config_fetched),
            reused_blobs: usize::from(!config_fetched),
            downloaded_bytes: if config_fetched { m.config_size } else { 0 },
            resumed_bytes: 0,
            output: out.to_path_buf(),
        };
        let mut flusher = Flusher::new(store);
        let mut seen = std::collections::HashSet::new();
        for f in m.files.iter().filter(|f| seen.insert(&f.layer.digest)) {
            self.obtain(auth, store, &f.layer, what, &mut s, &mut flusher, added)
                .await?;
        }
        flusher.finish(added)?;
        // the files under their names, beside the store's partial downloads (the same file
        // system: hard links), removed whatever the conversion does
        let src = store.partial_path(digest)?.with_extension(format!(
            "{}{}",
            &crate::store::FOREIGN_SRC[1..],
            crate::store::unique_suffix()
        ));
        struct Remove<'a>(&'a Path);
        impl Drop for Remove<'_> {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(self.0);
            }
        }
        let _src_guard = Remove(&src);
        std::fs::create_dir_all(&src).map_err(|e| DistError::io(&src, e))?;
        let mut generation_config = None;
        let mut chat_template_file = None;
        for f in &m.files {
            let blob = store.blob_path(&f.layer.digest)?;
            if f.role == Role::ConfigTar {
                crate::foreign::unpack_config_tar(&blob, &src, what)?;
                continue;
            }
            if f.role == Role::Params {
                generation_config = crate::foreign::params_blob(&blob, what, false)?;
                continue;
            }
            if f.role == Role::ChatTemplate {
                chat_template_file = Some(blob);
                continue;
            }
            let to = src.join(&f.layer.path);
            if let Some(p) = to.parent() {
                std::fs::create_dir_all(p).map_err(|e| DistError::io(p, e))?;
            }
            link_or_copy(&blob, &to)?;
        }
        let input = src.join(m.entry());
        let copts = gds_convert::ConvertOptions {
            force,
            generation_config,
            chat_template_file,
            ..Default::default()
        };
        struct Quiet;
        impl gds_convert::Progress for Quiet {}
        let staging = format!("{}/", src.display());
        gds_convert::convert(&input, out, &copts, &Quiet).map_err(|e| {
            // name the artifact, not the staging directory
            let msg = format!("{what}: {}", e.to_string().replace(&staging, ""));
            match e.kind() {
                gds_convert::ErrorKind::Input | gds_convert::ErrorKind::Internal => {
                    DistError::invalid(msg)
                }
                _ => DistError::usage(msg),
            }
        })?;
        Ok(s)
    }

    /// One distinct blob of the package, into the store and hashed in this pull: from the
    /// store when it holds the blob and its bytes hash to its name (else it is dropped from
    /// the store), else downloaded. Returns the BLAKE3 of its bytes.
    #[allow(clippy::too_many_arguments)]
    async fn obtain(
        &self,
        auth: &ReqAuth,
        store: &Store,
        l: &Layer,
        what: &str,
        s: &mut PullSummary,
        flusher: &mut Flusher<'_>,
        added: &mut Added,
    ) -> Result<[u8; 32]> {
        let reused = |s: &mut PullSummary| {
            s.reused_blobs += 1;
            if let Some(cb) = &self.opts.progress {
                cb(l.size);
            }
        };
        if let Stored::Good(b3) = store.check_blob(&l.digest, l.size)? {
            reused(s);
            return Ok(b3);
        }
        match self.fetch_blob(auth, store, l, what).await? {
            // another pull stored it while this one waited for it
            Got::Present(b3) => {
                reused(s);
                Ok(b3)
            }
            Got::Fetched {
                fetched,
                resumed,
                file,
                blake3,
            } => {
                s.downloaded_blobs += 1;
                s.downloaded_bytes += fetched;
                s.resumed_bytes += resumed;
                let part = store.partial_path(&l.digest)?;
                added.partials.push(part.clone());
                flusher.push(file, part, l.digest.clone(), added)?;
                Ok(blake3)
            }
        }
    }

    /// A small blob (the config), from the store (its bytes checked against its digest) or
    /// the registry, with its size capped: (its bytes, whether it was downloaded).
    async fn fetch_small(
        &self,
        auth: &ReqAuth,
        store: &Store,
        digest: &str,
        size: u64,
        added: &mut Added,
    ) -> Result<(Vec<u8>, bool)> {
        let path = store.blob_path(digest)?;
        if store.has_blob(digest, size) {
            let v = std::fs::read(&path).map_err(|e| DistError::io(&path, e))?;
            if sha256_digest(&v) == digest && v.len() as u64 == size {
                return Ok((v, false));
            }
            // changed in place: dropped from the store, fetched again
            store.check_blob(digest, size)?;
        }
        let url = self.url("blobs", digest);
        let what = format!("fetching config blob {digest} ({size} bytes declared)");
        let v = self
            .retrying(|| self.get_small(auth, &url, None, size, &what))
            .await?;
        if sha256_digest(&v) != digest || v.len() as u64 != size {
            return Err(DistError::invalid(format!(
                "{}: config blob {digest} does not match its digest",
                self.reference.whole()
            )));
        }
        let tmp = store
            .partial_path(digest)?
            .with_extension(format!("tmp-{}", crate::store::unique_suffix()));
        std::fs::write(&tmp, &v).map_err(|e| DistError::io(&tmp, e))?;
        let (blob, new) = store.commit_blob(&tmp, digest)?;
        if new {
            added.blobs.push(blob);
        }
        Ok((v, true))
    }

    /// Downloads one layer blob into the store's partial file, verified (sha256, then the
    /// BLAKE3 its layer declares), resuming a partial download. A resumed download whose
    /// bytes do not match (a bad partial file, or a mirror that served other bytes before
    /// it failed) is fetched once more from the start before the blob is called tampered.
    async fn fetch_blob(
        &self,
        auth: &ReqAuth,
        store: &Store,
        l: &Layer,
        what: &str,
    ) -> Result<Got> {
        let part = store.partial_path(&l.digest)?;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&part)
            .map_err(|e| DistError::io(&part, e))?;
        // another pull of the same blob waits here, then finds it in the store
        rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| DistError::io(&part, e.into()))?;
        if let Stored::Good(b3) = store.check_blob(&l.digest, l.size)? {
            let _ = std::fs::remove_file(&part);
            return Ok(Got::Present(b3));
        }
        let bad = |why: String| {
            DistError::invalid(format!("{what}: blob {} ({}): {why}", l.digest, l.path))
        };
        let mut have = f.metadata().map_err(|e| DistError::io(&part, e))?.len();
        if have > l.size {
            f.set_len(0).map_err(|e| DistError::io(&part, e))?;
            have = 0;
        }
        // hash what is already there
        let mut sha = Sha256::new();
        let mut b3 = blake3::Hasher::new();
        if have > 0 {
            let mut buf = vec![0u8; 4 << 20];
            f.seek(SeekFrom::Start(0))
                .map_err(|e| DistError::io(&part, e))?;
            let mut left = have;
            while left > 0 {
                let k = f
                    .read(&mut buf[..left.min(4 << 20) as usize])
                    .map_err(|e| DistError::io(&part, e))?;
                if k == 0 {
                    break;
                }
                sha.update(&buf[..k]);
                b3.update(&buf[..k]);
                left -= k as u64;
            }
        }
        let mut resumed = have;
        // some of the bytes come from an earlier download (the partial file, a Range request)
        let mut pieced = have > 0;
        // fetched again from the start after a resumed download did not match
        let mut again = false;
        let mut fetched = 0u64;
        let url = self.url("blobs", &l.digest);
        let fetching = format!("fetching blob {} ({} bytes)", l.digest, l.size);
        loop {
            let mut attempts = 0;
            while have < l.size {
                attempts += 1;
                let r = &self.reference;
                let mut pace = self.pace(&fetching);
                let range = (have > 0).then(|| (have, l.size - 1));
                let (mut resp, full) = match self
                    .get(auth, &url, None, range, &fetching, &mut pace)
                    .await
                {
                    Ok(resp) => {
                        let full = resp.status() != http::StatusCode::PARTIAL_CONTENT;
                        (resp, full)
                    }
                    Err(Fail::Retry(e)) if attempts < 4 => {
                        eprintln!("{e} (retrying)");
                        tokio::time::sleep(Duration::from_millis(500 << attempts)).await;
                        continue;
                    }
                    Err(Fail::Retry(e)) | Err(Fail::Stop(e)) => return Err(e),
                };
                if full && have > 0 {
                    // the registry ignored the range: start again
                    f.set_len(0).map_err(|e| DistError::io(&part, e))?;
                    have = 0;
                    resumed = 0;
                    pieced = false;
                    sha = Sha256::new();
                    b3 = blake3::Hasher::new();
                } else if !full {
                    pieced = true;
                }
                f.seek(SeekFrom::Start(have))
                    .map_err(|e| DistError::io(&part, e))?;
                let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut f);
                let limiter = Limiter::new(self.opts.limit_rate);
                let mut failed = None;
                loop {
                    // paced: a registry that stalls or trickles fails here (the partial file
                    // is kept for the next pull to resume)
                    let chunk = match pace.wait(resp.chunk(), None).await {
                        Ok(Ok(Some(c))) => c,
                        Ok(Ok(None)) => break,
                        Ok(Err(e)) => {
                            failed = Some(reqwest_detail(&e));
                            break;
                        }
                        Err(e) => {
                            w.flush().map_err(|e| DistError::io(&part, e))?;
                            return Err(e);
                        }
                    };
                    if have + chunk.len() as u64 > l.size {
                        drop(w);
                        let _ = std::fs::remove_file(&part);
                        return Err(bad(format!(
                            "the registry serves more than the {} bytes the manifest declares",
                            l.size
                        )));
                    }
                    w.write_all(&chunk).map_err(|e| DistError::io(&part, e))?;
                    sha.update(&chunk);
                    b3.update(&chunk);
                    have += chunk.len() as u64;
                    fetched += chunk.len() as u64;
                    if let Some(cb) = &self.opts.progress {
                        cb(chunk.len() as u64);
                    }
                    pace.add(chunk.len() as u64)?;
                    limiter.wait(fetched).await;
                }
                w.flush().map_err(|e| DistError::io(&part, e))?;
                drop(w);
                if let Some(e) = failed {
                    if attempts < 4 {
                        eprintln!(
                            "registry {}: blob {} interrupted after {have} bytes ({e}); resuming",
                            r.resolve_registry(),
                            l.digest
                        );
                        continue;
                    }
                    return Err(DistError::registry(format!(
                        "registry {}: fetching blob {}: {e}",
                        r.resolve_registry(),
                        l.digest
                    )));
                }
                if have < l.size {
                    let _ = std::fs::remove_file(&part);
                    return Err(bad(format!(
                        "the registry served {have} bytes, the manifest declares {}",
                        l.size
                    )));
                }
            }
            let got = format!("sha256:{}", hex(&sha.finalize_reset()));
            let hash = *b3.finalize().as_bytes();
            let why = if got != l.digest {
                format!("the content's digest is {got}: the blob was altered or corrupted")
            } else if l.blake3.is_some_and(|b| b != hash) {
                format!(
                    "the content does not match the BLAKE3 the package declares ({BLAKE3_ANNOTATION})"
                )
            } else {
                // the caller flushes it (beside the next download), then moves it into the
                // store
                return Ok(Got::Fetched {
                    fetched,
                    resumed,
                    file: f,
                    blake3: hash,
                });
            };
            if pieced && !again {
                // the earlier bytes may be a bad mirror's or a damaged partial file's
                eprintln!(
                    "registry {}: blob {} ({}): {why} after resuming a partial download; fetching it again from the start",
                    self.reference.resolve_registry(),
                    l.digest,
                    l.path
                );
                f.set_len(0).map_err(|e| DistError::io(&part, e))?;
                have = 0;
                resumed = 0;
                pieced = false;
                again = true;
                b3 = blake3::Hasher::new();
                continue;
            }
            let _ = std::fs::remove_file(&part);
            return Err(bad(format!("{why}; nothing was kept")));
        }
    }
}

/// A layer blob [`Remote::fetch_blob`] has.
enum Got {
    /// Downloaded and verified, in its partial file (still to be flushed and stored).
    Fetched {
        /// Bytes fetched now.
        fetched: u64,
        /// Bytes of an earlier partial download kept.
        resumed: u64,
        /// The partial file (locked).
        file: std::fs::File,
        /// The BLAKE3 of its bytes.
        blake3: [u8; 32],
    },
    /// Another pull stored it meanwhile; its bytes hashed again here: their BLAKE3.
    Present([u8; 32]),
}

/// What a pull brought into the store: the blobs it stored (that were not there before)
/// and its partial downloads.
/// Refuses a pull (usage error) when the store's file system has less room than the
/// `layers` the store lacks (each blob once) plus `extra` bytes; `why` follows the byte
/// count in the message. A file system that cannot say is not checked.
fn check_room<'l>(
    store: &Store,
    layers: impl Iterator<Item = &'l Layer>,
    extra: u64,
    what: &str,
    why: &str,
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let need: u64 = layers
        .filter(|l| seen.insert(&l.digest) && !store.has_blob(&l.digest, l.size))
        .map(|l| l.size)
        .sum::<u64>()
        + extra;
    if let Ok(st) = rustix::fs::statvfs(store.root()) {
        let free = st.f_bavail.saturating_mul(st.f_frsize);
        if need > free {
            return Err(DistError::usage(format!(
                "{what}: needs {need} bytes in {}{why}, only {free} are free",
                store.root().display()
            )));
        }
    }
    Ok(())
}

/// An image manifest, read: a GdsLLM package or another tool's model.
enum Parsed {
    Ours(ParsedManifest),
    Foreign(ForeignModel),
}

#[derive(Default)]
struct Added {
    blobs: Vec<PathBuf>,
    partials: Vec<PathBuf>,
}

/// After a refused package: removes the blobs the pull stored that nothing links to (its
/// staging directory is gone) and its partial downloads — when no other process is using
/// the store (its lock, held shared by this pull, is taken exclusively without waiting);
/// otherwise they stay until `gdsconv gc`, which is then safe.
fn remove_added(lock: &std::fs::File, added: &Added) {
    if added.blobs.is_empty() && added.partials.is_empty() {
        return;
    }
    if rustix::fs::flock(lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        eprintln!(
            "note: another process is using the store: the {} blobs this pull stored stay until `gdsconv gc`",
            added.blobs.len()
        );
        return;
    }
    for p in &added.partials {
        let _ = std::fs::remove_file(p);
    }
    for p in &added.blobs {
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(p).is_ok_and(|m| m.nlink() <= 1) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Flushes each downloaded blob to disk on a thread while the next one downloads, then
/// moves it into the store: one thread at a time, joined before the next starts (a thread
/// per blob, joined at the end, exhausted the address space of a package with thousands of
/// layers), and none at all when none can be had (the flush is then done in place).
struct Flusher<'a> {
    store: &'a Store,
    /// The flush in progress: its thread, the partial file, the digest.
    pending: Option<(
        std::thread::JoinHandle<std::io::Result<()>>,
        PathBuf,
        String,
    )>,
}

impl<'a> Flusher<'a> {
    fn new(store: &'a Store) -> Flusher<'a> {
        Flusher {
            store,
            pending: None,
        }
    }

    /// Flushes `file` (the partial download `part` of `digest`) and stores it, after the
    /// previous one.
    fn push(
        &mut self,
        file: std::fs::File,
        part: PathBuf,
        digest: String,
        added: &mut Added,
    ) -> Result<()> {
        self.finish(added)?;
        let spawned = std::thread::Builder::new()
            .name("gds-flush".into())
            .stack_size(64 << 10)
            .spawn(move || file.sync_data());
        match spawned {
            Ok(h) => {
                self.pending = Some((h, part, digest));
                Ok(())
            }
            // no thread to be had (a thread or address-space limit): flushed here
            Err(_) => {
                std::fs::File::open(&part)
                    .and_then(|f| f.sync_data())
                    .map_err(|e| DistError::io(&part, e))?;
                self.commit(&part, &digest, added)
            }
        }
    }

    /// Waits for the flush in progress and stores its blob.
    fn finish(&mut self, added: &mut Added) -> Result<()> {
        if let Some((h, part, digest)) = self.pending.take() {
            h.join()
                .map_err(|_| {
                    DistError::usage(format!(
                        "{}: the thread flushing it panicked",
                        part.display()
                    ))
                })?
                .map_err(|e| DistError::io(&part, e))?;
            self.commit(&part, &digest, added)?;
        }
        Ok(())
    }

    fn commit(&self, part: &Path, digest: &str, added: &mut Added) -> Result<()> {
        let (blob, new) = self.store.commit_blob(part, digest)?;
        if new {
            added.blobs.push(blob);
        }
        Ok(())
    }
}

impl Drop for Flusher<'_> {
    fn drop(&mut self) {
        if let Some((h, _, _)) = self.pending.take() {
            let _ = h.join();
        }
    }
}

/// The verdict on one layer: the bytes hashed in this pull for its blob (`verified`, by
/// digest) have the BLAKE3 its own `io.gdsllm.blake3` declares — each layer, also when
/// several share one blob.
fn check_layer(
    l: &Layer,
    verified: &std::collections::HashMap<String, [u8; 32]>,
    what: &str,
) -> Result<()> {
    match verified.get(&l.digest) {
        Some(h) if l.blake3 == Some(*h) => Ok(()),
        Some(_) => Err(DistError::invalid(format!(
            "{what}: blob {} ({}): the content does not match the BLAKE3 this layer declares ({BLAKE3_ANNOTATION}); nothing was kept",
            l.digest, l.path
        ))),
        None => Err(DistError::invalid(format!(
            "{what}: blob {} ({}) was not checked",
            l.digest, l.path
        ))),
    }
}

/// The model manifest (`dir/manifest.gdsm`, the first file fetched) must list exactly the
/// files the package ships, each under the BLAKE3 its layer declares: checked before the
/// rest of the package is fetched, so that a package shipping other files costs one small
/// download.
fn check_listing(
    dir: &Path,
    layers: &[Layer],
    verified: &std::collections::HashMap<String, [u8; 32]>,
    what: &str,
) -> Result<()> {
    for l in layers
        .iter()
        .filter(|l| l.path == gds_format::MANIFEST_FILE)
    {
        check_layer(l, verified, what)?;
    }
    let bytes = gds_io::read_manifest(dir).map_err(|e| {
        let staging = format!("{}/", dir.display());
        DistError::invalid(format!("{what}: {}", e.to_string().replace(&staging, "")))
    })?;
    let m = crate::package::validated(&bytes, |errs| {
        format!(
            "{what}: the package's {} does not validate:\n  {errs}",
            gds_format::MANIFEST_FILE
        )
    })?;
    let by_path: std::collections::HashMap<&str, &Layer> =
        layers.iter().map(|l| (l.path.as_str(), l)).collect();
    let mut expected: Vec<(&str, [u8; 32])> =
        m.layers().map(|l| (l.file, l.content_hash)).collect();
    expected.extend(m.files().map(|f| (f.path, f.content_hash)));
    for (path, hash) in &expected {
        match by_path.get(path) {
            Some(l) if l.blake3 == Some(*hash) => {}
            Some(l) => {
                return Err(DistError::invalid(format!(
                    "{what}: blob {} ({path}) is not the file the model manifest hashes",
                    l.digest
                )))
            }
            None => {
                return Err(DistError::invalid(format!(
                    "{what}: the model manifest names {path}, which the package does not ship"
                )))
            }
        }
    }
    if let Some(extra) = layers.iter().find(|l| {
        l.path != gds_format::MANIFEST_FILE && !expected.iter().any(|(p, _)| *p == l.path)
    }) {
        return Err(DistError::invalid(format!(
            "{what}: blob {} ships {}, which the model manifest does not list (nothing else was fetched)",
            extra.digest, extra.path
        )));
    }
    Ok(())
}

/// The assembled directory must be exactly the model its manifest describes: every file's
/// bytes, as hashed in this pull, have the BLAKE3 its own layer declares (which
/// [`check_listing`] compared with the model manifest's record); and its structure,
/// architecture and chat template (code from the model file, under
/// `gds_format::chat_template`'s bounds) validate (the tokenizer is checked when a runtime
/// first loads it, as for any model), so that a refused model is never committed.
fn check_assembled(
    dir: &Path,
    layers: &[Layer],
    verified: &std::collections::HashMap<String, [u8; 32]>,
    what: &str,
) -> Result<()> {
    for l in layers {
        check_layer(l, verified, what)?;
    }
    let report = gds_convert::validate_dir(dir, gds_convert::Depth::Structure);
    if !report.valid {
        // the files by their paths in the package, not in the staging directory that goes
        let staging = format!("{}/", dir.display());
        let errors: Vec<String> = report
            .errors
            .iter()
            .map(|e| e.replace(&staging, ""))
            .collect();
        return Err(DistError::invalid(format!(
            "{what}: the pulled model does not validate:\n  {}",
            errors.join("\n  ")
        )));
    }
    Ok(())
}

/// What a request to the registry carries.
#[derive(Clone)]
enum Cred {
    None,
    Bearer(String),
    Basic(String, String),
}

/// How the requests of one push or pull authenticate: the credentials, and when a bearer
/// token is to be asked for again (shortly before it expires, as a long transfer outlives
/// a token: Docker Hub's last 5 minutes, the token protocol's default 60 s).
struct ReqAuth {
    push: bool,
    state: std::sync::Mutex<(Cred, Option<Instant>)>,
}

impl ReqAuth {
    fn new(push: bool, cred: Cred, renew_at: Option<Instant>) -> ReqAuth {
        ReqAuth {
            push,
            state: std::sync::Mutex::new((cred, renew_at)),
        }
    }

    /// No credentials (the token protocol's own requests).
    fn none() -> ReqAuth {
        ReqAuth::new(false, Cred::None, None)
    }
}

/// A failed request: worth retrying (connection error, 429, 5xx) or not.
enum Fail {
    Retry(DistError),
    Stop(DistError),
}

/// The `--min-rate` check of one request: every full window it lasts must move at least
/// `min_rate × window` bytes; a registry that stalls (sends nothing) or trickles fails at
/// the end of the first window that falls short.
struct Pace {
    min_rate: u64,
    window: Duration,
    start: Instant,
    bytes: u64,
    what: String,
    /// The check failed (the error is not worth a retry).
    failed: bool,
}

impl Pace {
    fn new(l: &Limits, limit_rate: Option<u64>, what: String) -> Pace {
        // a --limit-rate under the minimum would fail every transfer
        let min_rate = match limit_rate.filter(|&r| r > 0) {
            Some(r) => l.min_rate.min(r / 2),
            None => l.min_rate,
        };
        Pace {
            min_rate: if l.window.is_zero() { 0 } else { min_rate },
            window: l.window,
            start: Instant::now(),
            bytes: 0,
            what,
            failed: false,
        }
    }

    /// The end of a window: enough bytes, or the error.
    fn check(&mut self) -> Result<()> {
        let need = (self.min_rate as f64 * self.window.as_secs_f64()).ceil() as u64;
        if self.bytes < need {
            self.failed = true;
            return Err(DistError::registry(format!(
                "{}: {} bytes in {} s, under the minimum of {} bytes/s (--min-rate, averaged over --min-rate-window {} s): the registry stalls or trickles; gave up",
                self.what,
                self.bytes,
                self.window.as_secs_f64(),
                self.min_rate,
                self.window.as_secs_f64()
            )));
        }
        self.start = Instant::now();
        self.bytes = 0;
        Ok(())
    }

    /// Counts `n` bytes received.
    fn add(&mut self, n: u64) -> Result<()> {
        if self.min_rate == 0 {
            return Ok(());
        }
        self.bytes += n;
        if self.start.elapsed() >= self.window {
            self.check()?;
        }
        Ok(())
    }

    /// Awaits `fut`, checking the rate at the end of every window that passes meanwhile;
    /// `upload` counts the bytes sent inside `fut` of its total (an upload). Once an upload
    /// has sent its whole body, the registry stores the blob (hashes it, moves it) before it
    /// answers: the answer then has an allowance of its own ([`Pace::answer_allowance`]),
    /// not the `--min-rate` window.
    async fn wait<F: std::future::Future>(
        &mut self,
        fut: F,
        upload: Option<(&std::sync::atomic::AtomicU64, u64)>,
    ) -> Result<F::Output> {
        if self.min_rate == 0 {
            return Ok(fut.await);
        }
        let count = || upload.map_or(0, |(c, _)| c.load(std::sync::atomic::Ordering::Relaxed));
        let mut last = count();
        let mut answer_by: Option<(Instant, Duration)> = None;
        let mut fut = std::pin::pin!(fut);
        loop {
            let end = match answer_by {
                Some((t, _)) => t,
                None => self.start + self.window,
            };
            match tokio::time::timeout_at(tokio::time::Instant::from_std(end), &mut fut).await {
                Ok(v) => {
                    self.bytes += count() - last;
                    return Ok(v);
                }
                Err(_) => {
                    if let Some((_, allowed)) = answer_by {
                        self.failed = true;
                        return Err(DistError::registry(format!(
                            "{}: no answer {} s after the whole blob was sent (the allowance for storing it: --min-rate-window × 4, plus a second per {} MiB); gave up",
                            self.what,
                            allowed.as_secs_f64(),
                            ANSWER_BYTES_PER_SEC >> 20
                        )));
                    }
                    let now = count();
                    self.bytes += now - last;
                    last = now;
                    if let Some((_, total)) = upload.filter(|&(_, total)| now >= total) {
                        let allowed = self.answer_allowance(total);
                        answer_by = Some((Instant::now() + allowed, allowed));
                        continue;
                    }
                    self.check()?;
                }
            }
        }
    }

    /// How long a registry may take to answer once it has the whole of a `size`-byte
    /// upload: four `--min-rate` windows, plus a second per [`ANSWER_BYTES_PER_SEC`] bytes
    /// (a registry that hashes or copies the blob before answering).
    fn answer_allowance(&self, size: u64) -> Duration {
        self.window * 4 + Duration::from_secs(size / ANSWER_BYTES_PER_SEC)
    }
}

/// Reads `resp`'s body, but never more than `cap` bytes: (the bytes, whether there was more).
async fn read_capped(
    mut resp: reqwest::Response,
    cap: usize,
    pace: &mut Pace,
) -> Result<(Vec<u8>, bool)> {
    let mut v = Vec::new();
    loop {
        match pace.wait(resp.chunk(), None).await? {
            Ok(Some(c)) => {
                pace.add(c.len() as u64)?;
                let room = cap - v.len();
                if c.len() > room {
                    v.extend_from_slice(&c[..room]);
                    return Ok((v, true));
                }
                v.extend_from_slice(&c);
            }
            Ok(None) => return Ok((v, false)),
            Err(e) => {
                return Err(DistError::registry(format!(
                    "{}: {}",
                    pace.what,
                    reqwest_detail(&e)
                )))
            }
        }
    }
}

/// The realm and service of the first Bearer challenge in a `WWW-Authenticate` header.
fn bearer_challenge(header: &str) -> Option<(String, Option<String>)> {
    http_auth::parser::ChallengeParser::new(header)
        .filter_map(|c| c.ok())
        .filter(|c| c.scheme.eq_ignore_ascii_case("Bearer"))
        .find_map(|c| {
            let get = |k: &str| {
                c.params
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case(k))
                    .map(|(_, v)| v.to_unescaped())
            };
            Some((get("realm")?, get("service")))
        })
}

/// A reqwest error with its causes, as an excerpt.
fn reqwest_detail(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(x) = src {
        s.push_str(&format!(": {x}"));
        src = x.source();
    }
    excerpt(s.as_bytes())
}

/// The errors of an OCI error envelope (`{"errors": [{"code", "message"}]}`), if `body` is one.
fn envelope_text(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let errs = v.get("errors")?.as_array()?;
    let parts: Vec<String> = errs
        .iter()
        .map(|e| {
            format!(
                "{}: {}",
                e.get("code").and_then(|c| c.as_str()).unwrap_or("?"),
                e.get("message").and_then(|c| c.as_str()).unwrap_or("")
            )
        })
        .collect();
    (!parts.is_empty()).then(|| excerpt(parts.join("; ").as_bytes()))
}

/// At most [`EXCERPT_BYTES`] of a registry's text, fit for a terminal: control and
/// bidirectional-override characters and runs of white space become one space, and a
/// longer text says how long it was.
pub fn excerpt(bytes: &[u8]) -> String {
    let head = &bytes[..bytes.len().min(EXCERPT_BYTES)];
    let mut s = String::new();
    let mut space = true;
    for c in String::from_utf8_lossy(head).chars() {
        let odd = c.is_whitespace()
            || c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if odd {
            if !space {
                s.push(' ');
            }
            space = true;
        } else {
            s.push(c);
            space = false;
        }
    }
    let s = s.trim_end().to_string();
    if bytes.len() > EXCERPT_BYTES {
        format!(
            "{s}… [{} bytes; the first {EXCERPT_BYTES} shown]",
            bytes.len()
        )
    } else {
        s
    }
}

/// Paces a transfer to a byte rate.
struct Limiter {
    rate: Option<u64>,
    t0: Instant,
}

impl Limiter {
    fn new(rate: Option<u64>) -> Limiter {
        Limiter {
            rate: rate.filter(|&r| r > 0),
            t0: Instant::now(),
        }
    }
    async fn wait(&self, bytes: u64) {
        if let Some(r) = self.rate {
            let due = Duration::from_secs_f64(bytes as f64 / r as f64);
            let el = self.t0.elapsed();
            if due > el {
                tokio::time::sleep(due - el).await;
            }
        }
    }
}

/// Where [`blob_stream`] puts the local failure that ended it: the blob's file unreadable,
/// shorter than when it was packed, or holding other bytes than the digest it was packed
/// as. It fails the push with its own exit code (2 or 1), not as the registry's.
type LocalFail = Arc<std::sync::Mutex<Option<DistError>>>;

/// A blob as a stream of 1 MiB pieces read from its source, paced by `limit`, hashed as it
/// goes (sha256, and BLAKE3 where the layer declares one): bytes that do not match the
/// blob's digest end the stream with an error instead of its last piece, so that the
/// registry never gets the whole of a body that is not the blob, and `fail` says why.
fn blob_stream(
    b: &BlobRef,
    limit: Option<u64>,
    progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    counter: Arc<std::sync::atomic::AtomicU64>,
    fail: LocalFail,
) -> futures_util::stream::BoxStream<'static, std::io::Result<bytes::Bytes>> {
    let blob = b.clone();
    let size = b.size;
    let hashers = (Sha256::new(), blake3::Hasher::new());
    let state = (
        None::<std::fs::File>,
        0u64,
        Limiter::new(limit),
        hashers,
        false,
    );
    futures_util::stream::unfold(state, move |(mut file, sent, lim, mut hashers, over)| {
        let progress = progress.clone();
        let sent_now = counter.clone();
        let blob = blob.clone();
        let fail = fail.clone();
        async move {
            if sent >= size || over {
                return None;
            }
            let piece = (size - sent).min(1 << 20) as usize;
            let chunk = match &blob.source {
                BlobSource::Memory(v) => Ok(bytes::Bytes::copy_from_slice(
                    &v[sent as usize..sent as usize + piece],
                )),
                BlobSource::File { path, offset } => (|| {
                    if file.is_none() {
                        let mut f = std::fs::File::open(path)?;
                        f.seek(SeekFrom::Start(offset + sent))?;
                        file = Some(f);
                    }
                    let mut buf = vec![0u8; piece];
                    file.as_mut().expect("opened").read_exact(&mut buf)?;
                    Ok(bytes::Bytes::from(buf))
                })()
                .map_err(|e: std::io::Error| {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        DistError::usage(format!(
                            "{}: shorter than when it was packed (blob {} has {size} bytes): the file changed since it was packed",
                            path.display(),
                            blob.digest
                        ))
                    } else {
                        DistError::io(path, e)
                    }
                }),
            };
            let chunk = chunk.and_then(|c| {
                hashers.0.update(&c);
                hashers.1.update(&c);
                if sent + c.len() as u64 >= size {
                    let sha = format!("sha256:{}", hex(&hashers.0.finalize_reset()));
                    let b3 = *hashers.1.finalize().as_bytes();
                    if sha != blob.digest || blob.blake3.is_some_and(|h| h != b3) {
                        return Err(crate::package::mismatch(&blob, &sha, "uploading it"));
                    }
                }
                Ok(c)
            });
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    let msg = e.msg.clone();
                    *fail.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    return Some((
                        Err(std::io::Error::other(msg)),
                        (file, sent, lim, hashers, true),
                    ));
                }
            };
            let n = piece as u64;
            sent_now.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            if let Some(p) = &progress {
                p(n);
            }
            lim.wait(sent + n).await;
            Some((Ok(chunk), (file, sent + n, lim, hashers, false)))
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_challenges_are_parsed_and_others_ignored() {
        assert_eq!(
            bearer_challenge(
                r#"Bearer realm="https://auth.example/token",service="registry.example",scope="x""#
            ),
            Some((
                "https://auth.example/token".to_string(),
                Some("registry.example".to_string())
            ))
        );
        assert_eq!(
            bearer_challenge(r#"Basic realm="x", Bearer realm="https://a/t""#),
            Some(("https://a/t".to_string(), None))
        );
        assert_eq!(bearer_challenge(r#"Basic realm="Registry Realm""#), None);
        assert_eq!(bearer_challenge(r#"Bearer service="no realm""#), None);
        assert_eq!(bearer_challenge("\u{0}garbage=\""), None);
    }

    /// A bearer-token registry on a thread: `GET /v2/` answers 401 with a challenge whose
    /// realm is `GET /token` here, which hands out `t1`, `t2`, … valid for `expires_in`
    /// seconds; any other request answers 200. Returns the port and the log of requests
    /// (`METHOD PATH AUTHORIZATION`).
    fn token_registry(expires_in: u64) -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
        use std::io::{BufRead, BufReader, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (log2, issued) = (log.clone(), Arc::new(std::sync::atomic::AtomicU64::new(0)));
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut w) = conn else { return };
                let (log, issued) = (log2.clone(), issued.clone());
                std::thread::spawn(move || {
                    let mut r = BufReader::new(w.try_clone().unwrap());
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let mut authz = String::from("-");
                        loop {
                            let mut h = String::new();
                            r.read_line(&mut h).unwrap();
                            if h.trim().is_empty() {
                                break;
                            }
                            if let Some((k, v)) = h.split_once(':') {
                                if k.eq_ignore_ascii_case("authorization") {
                                    authz = v.trim().to_string();
                                }
                            }
                        }
                        let mut parts = line.split_whitespace();
                        let (method, path) = (parts.next().unwrap(), parts.next().unwrap());
                        log.lock().unwrap().push(format!("{method} {path} {authz}"));
                        let (status, extra, body) = if path == "/v2/" {
                            let c = format!("WWW-Authenticate: Bearer realm=\"http://127.0.0.1:{port}/token\",service=\"test\"\r\n");
                            ("401 Unauthorized", c, String::new())
                        } else if path.starts_with("/token") {
                            let n = issued.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                            let b = format!("{{\"token\":\"t{n}\",\"expires_in\":{expires_in}}}");
                            ("200 OK", String::new(), b)
                        } else {
                            ("200 OK", String::new(), String::new())
                        };
                        let head = format!(
                            "HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\n\r\n",
                            body.len()
                        );
                        let body = if method == "HEAD" { "" } else { &body };
                        if w.write_all(format!("{head}{body}").as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (port, log)
    }

    #[test]
    fn a_bearer_token_is_asked_for_and_renewed_before_it_expires() {
        let digest = format!("sha256:{}", "0".repeat(64));
        // a token valid for 1 s is renewed before each request (it would expire within the
        // 10 s margin); one valid for 300 s serves both
        for (expires_in, tokens, want) in [
            (1, 3, ["Bearer t2", "Bearer t3"]),
            (300, 1, ["Bearer t1"; 2]),
        ] {
            let (port, log) = token_registry(expires_in);
            let opts = RemoteOptions {
                plain_http: true,
                ..Default::default()
            };
            let r = Remote::new(&format!("127.0.0.1:{port}/models/x:latest"), opts).unwrap();
            r.rt.block_on(async {
                let auth = r.push_auth().await.unwrap();
                for _ in 0..2 {
                    let e = r.blob_exists(&auth, &digest, "checking").await;
                    assert!(matches!(e, Ok(true)));
                }
            });
            let log = log.lock().unwrap().clone();
            let asked: Vec<&String> = log.iter().filter(|l| l.starts_with("GET /token")).collect();
            assert_eq!(asked.len(), tokens, "expires_in {expires_in}: {log:?}");
            let token = asked[0];
            assert!(
                token.contains("scope=repository%3Amodels%2Fx%3Apull%2Cpush")
                    && token.contains("service=test"),
                "{token}"
            );
            let auths: Vec<String> = log
                .iter()
                .filter(|l| l.starts_with("HEAD "))
                .map(|l| {
                    l.split_once(' ')
                        .unwrap()
                        .1
                        .split_once(' ')
                        .unwrap()
                        .1
                        .to_string()
                })
                .collect();
            assert_eq!(auths, want, "expires_in {expires_in}: {log:?}");
        }
    }

    #[test]
    fn the_answer_to_a_whole_upload_has_an_allowance_of_its_own() {
        // the whole body is sent at once; the registry then takes 350 ms (3.5 windows) to
        // store it and answer: within its allowance (4 windows), not failed at the end of
        // the first window that moved no byte
        let sent = std::sync::atomic::AtomicU64::new(0);
        let mut pace = Pace::new(&limits(1000, 100), None, "registry r: up".into());
        rt().block_on(pace.wait(
            async {
                sent.fetch_add(600, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(350)).await;
            },
            Some((&sent, 600)),
        ))
        .unwrap();
        // a registry that never answers still fails, once the allowance is spent
        let sent = std::sync::atomic::AtomicU64::new(0);
        let mut pace = Pace::new(&limits(1000, 100), None, "registry r: up".into());
        let t0 = Instant::now();
        let e = rt()
            .block_on(pace.wait(
                async {
                    sent.fetch_add(600, std::sync::atomic::Ordering::Relaxed);
                    std::future::pending::<()>().await
                },
                Some((&sent, 600)),
            ))
            .unwrap_err();
        assert!(
            e.msg.contains("no answer") && e.msg.contains("registry r: up"),
            "{e}"
        );
        // (failed, not waiting for ever: the allowance is 0.4 s; the bound leaves a loaded
        // test run room)
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        // an upload that stops half-way fails at the end of the window, as before
        let sent = std::sync::atomic::AtomicU64::new(0);
        let mut pace = Pace::new(&limits(1000, 100), None, "registry r: up".into());
        let e = rt()
            .block_on(pace.wait(
                async {
                    sent.fetch_add(300, std::sync::atomic::Ordering::Relaxed);
                    std::future::pending::<()>().await
                },
                Some((&sent, 600)),
            ))
            .unwrap_err();
        assert!(e.msg.contains("--min-rate"), "{e}");
    }

    /// The blob bodies a test registry received: (the digest asked for, the body's sha256).
    type Uploads = Arc<std::sync::Mutex<Vec<(String, String)>>>;

    /// A registry that takes uploads on a thread: `HEAD` of a blob answers 404, `POST
    /// …/blobs/uploads/` 202 with a `Location`, `PUT` reads the body (its `Content-Length`)
    /// and answers 201. Returns the port and the log of whole blob bodies received
    /// (`digest asked for`, `sha256 of the body`).
    fn upload_registry() -> (u16, Uploads) {
        use std::io::{BufRead, BufReader, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut w) = conn else { return };
                let log = log2.clone();
                std::thread::spawn(move || {
                    let mut r = BufReader::new(w.try_clone().unwrap());
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let mut len = 0usize;
                        loop {
                            let mut h = String::new();
                            if r.read_line(&mut h).unwrap_or(0) == 0 {
                                return;
                            }
                            if h.trim().is_empty() {
                                break;
                            }
                            if let Some((k, v)) = h.split_once(':') {
                                if k.eq_ignore_ascii_case("content-length") {
                                    len = v.trim().parse().unwrap_or(0);
                                }
                            }
                        }
                        let mut body = vec![0u8; len];
                        if r.read_exact(&mut body).is_err() {
                            return; // the client gave up on the body
                        }
                        let mut parts = line.split_whitespace();
                        let (method, path) = (parts.next().unwrap(), parts.next().unwrap());
                        let (status, extra) = match method {
                            "HEAD" => ("404 Not Found", String::new()),
                            "POST" => (
                                "202 Accepted",
                                "Location: /v2/models/x/blobs/uploads/u1\r\n".to_string(),
                            ),
                            _ => {
                                if let Some((_, q)) = path.split_once("digest=") {
                                    let asked = q.replace("%3A", ":");
                                    log.lock().unwrap().push((asked, sha256_digest(&body)));
                                }
                                ("201 Created", String::new())
                            }
                        };
                        let head = format!("HTTP/1.1 {status}\r\n{extra}Content-Length: 0\r\n\r\n");
                        if w.write_all(head.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (port, log)
    }

    use crate::layout::tests::one_file_artifact;

    #[test]
    fn a_file_that_changed_since_it_was_packed_fails_the_push_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("blk.0000.bin");
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (port, log) = upload_registry();
        let push = |a: &Artifact| {
            let opts = RemoteOptions {
                plain_http: true,
                ..Default::default()
            };
            Remote::new(&format!("127.0.0.1:{port}/models/x:latest"), opts)
                .unwrap()
                .push(a)
        };
        // as packed: pushed
        std::fs::write(&file, &bytes).unwrap();
        let a = one_file_artifact(&file);
        push(&a).unwrap();
        // changed in place since (the same size): refused, exit 1, the file named; the
        // registry never got the whole of the body (the last piece is held back)
        let mut changed = bytes.clone();
        changed[2_500_000] ^= 0xff;
        std::fs::write(&file, &changed).unwrap();
        log.lock().unwrap().clear();
        let e = push(&a).unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(
            e.msg.contains(&file.display().to_string())
                && e.msg.contains("changed since it was packed"),
            "{e}"
        );
        let got = log.lock().unwrap().clone();
        assert!(
            got.iter().all(|(asked, body)| asked == body),
            "the registry got a body that is not its digest: {got:?}"
        );
        // the same bytes, but not the BLAKE3 its layer declares: refused too
        std::fs::write(&file, &bytes).unwrap();
        let mut a2 = a.clone();
        a2.layers[0].blake3 = Some([0; 32]);
        let e = push(&a2).unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(e.msg.contains("BLAKE3"), "{e}");
        // shorter: a local I/O error (exit 2), not the registry's (3)
        std::fs::write(&file, &bytes[..1_000_000]).unwrap();
        let e = push(&a).unwrap_err();
        assert_eq!(e.kind, Kind::Usage, "{e}");
        assert!(
            e.msg.contains(&file.display().to_string()) && e.msg.contains("shorter"),
            "{e}"
        );
        // an OCI layout's blob that is not its digest: named as such
        let lay = tmp
            .path()
            .join(a.layers[0].digest.strip_prefix("sha256:").unwrap());
        std::fs::write(&lay, &changed).unwrap();
        let mut a3 = a.clone();
        a3.layers[0].source = BlobSource::File {
            path: lay.clone(),
            offset: 0,
        };
        let e = push(&a3).unwrap_err();
        assert_eq!(e.kind, Kind::Invalid, "{e}");
        assert!(
            e.msg.contains(&lay.display().to_string())
                && e.msg
                    .contains("the layout's blob does not match its digest"),
            "{e}"
        );
    }

    #[test]
    fn only_the_registry_gets_the_credentials() {
        let r = Remote::new("reg.example:5000/models/x:latest", RemoteOptions::default()).unwrap();
        assert!(r.on_registry("https://reg.example:5000/v2/models/x/blobs/uploads/1?a=b"));
        assert!(r.on_registry("https://REG.example:5000/v2/"));
        assert!(!r.on_registry("http://reg.example:5000/v2/"));
        assert!(!r.on_registry("https://reg.example/v2/"));
        assert!(!r.on_registry("https://reg.example:5001/v2/"));
        assert!(!r.on_registry("https://storage.example/upload?sig=1"));
        assert!(!r.on_registry("https://reg.example:5000@evil.example/v2/"));
        assert!(!r.on_registry("not a url"));
        let r = Remote::new("reg.example:443/models/x:latest", RemoteOptions::default()).unwrap();
        assert!(r.on_registry("https://reg.example/v2/models/x/blobs/uploads/1"));
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn limits(min_rate: u64, window_ms: u64) -> Limits {
        Limits {
            min_rate,
            window: Duration::from_millis(window_ms),
            timeout: None,
        }
    }

    #[test]
    fn excerpts_are_short_and_printable() {
        let line = b"\x1b[31mNOT FOUND\x1b[0m \x07\x08\r\xe2\x80\xae EEEE\n".repeat(100_000);
        let e = excerpt(&line);
        assert!(e.len() < EXCERPT_BYTES + 64, "{} bytes", e.len());
        assert!(e.contains("NOT FOUND") && e.contains(&format!("{} bytes", line.len())));
        assert!(
            !e.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{e:?}"
        );
        assert_eq!(excerpt(b"  short\r\n text "), "short text");
    }

    #[test]
    fn bodies_are_read_up_to_their_cap_only() {
        let body = vec![b'x'; 4 << 20];
        let resp: reqwest::Response = http::Response::new(body).into();
        let mut pace = Pace::new(&limits(1, 60_000), None, "test".into());
        let (v, cut) = rt()
            .block_on(read_capped(resp, MAX_ERROR_BODY, &mut pace))
            .unwrap();
        assert_eq!((v.len(), cut), (MAX_ERROR_BODY, true));
        let resp: reqwest::Response = http::Response::new(vec![b'y'; 100]).into();
        let (v, cut) = rt().block_on(read_capped(resp, 100, &mut pace)).unwrap();
        assert_eq!((v.len(), cut), (100, false));
    }

    #[test]
    fn a_stall_or_a_trickle_fails_at_the_end_of_a_window() {
        // nothing at all
        let mut pace = Pace::new(&limits(1000, 200), None, "registry r: x".into());
        let e = rt()
            .block_on(pace.wait(std::future::pending::<()>(), None))
            .unwrap_err();
        assert_eq!(e.kind, Kind::Registry);
        assert!(
            e.msg.contains("registry r: x") && e.msg.contains("--min-rate"),
            "{e}"
        );
        // a trickle: a byte every 50 ms is far under 1000 bytes/s
        let mut pace = Pace::new(&limits(1000, 200), None, "registry r: y".into());
        let e = rt().block_on(async {
            loop {
                let tick = tokio::time::sleep(Duration::from_millis(50));
                if let Err(e) = pace.wait(tick, None).await {
                    return e;
                }
                if let Err(e) = pace.add(1) {
                    return e;
                }
            }
        });
        assert!(e.msg.contains("--min-rate"), "{e}");
        // an upload that moves enough passes; --limit-rate lowers the minimum
        let sent = std::sync::atomic::AtomicU64::new(0);
        let mut pace = Pace::new(&limits(1000, 100), None, "u".into());
        rt().block_on(pace.wait(
            async {
                for _ in 0..6 {
                    sent.fetch_add(500, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some((&sent, u64::MAX)),
        ))
        .unwrap();
        assert_eq!(
            Pace::new(&limits(1000, 100), Some(100), "l".into()).min_rate,
            50
        );
    }
}
