//! Push and pull through an OCI registry with `oci-client`, one blob at a time and streamed
//! (a layer is never held whole in memory).
//!
//! * push: each blob the registry already has is skipped (a re-push after a failure resumes,
//!   a second model uploads only what differs), the rest are streamed from their files; the
//!   manifest goes last. Transient failures (connection errors, 429, 5xx) are retried with
//!   back-off.
//! * pull: the image manifest is checked ([`crate::package::parse_manifest`]) before
//!   anything is downloaded; each blob missing from the store downloads to a `.partial`
//!   file, resumed with an HTTP Range request after an interruption, and is checked (sha256,
//!   then the BLAKE3 the package declares) before it enters the store. The output
//!   directory is assembled from hard links beside its final name, checked against the
//!   model manifest, and renamed into place: it appears whole or not at all.
//!
//! * limits: a pull reads bodies through its own `reqwest` client (`oci-client` reads
//!   manifests and error bodies whole), each capped — the manifest at
//!   [`crate::MAX_MANIFEST_BYTES`], the config and blobs at their declared sizes, error
//!   bodies at [`MAX_ERROR_BODY`] of which an [`excerpt`] is printed — and every request,
//!   push or pull, is paced ([`Limits::min_rate`] over [`Limits::window`]); the whole push
//!   or pull has a deadline ([`Limits::timeout`]).
//!
//! Credentials come from the Docker config (`$DOCKER_CONFIG/config.json` or
//! `~/.docker/config.json`: `auths` and credential helpers); registries that answer with a
//! bearer-token challenge are handled by `oci-client`.

use crate::error::{DistError, Result};
use crate::layout::Staged;
use crate::package::{hex, parse_manifest, sha256_digest, Artifact, BlobRef, BlobSource, Layer};
use crate::store::{link_or_copy, Store};
use crate::*;
use futures_util::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default `--min-rate`: bytes per second a transfer must average over each window.
pub const DEFAULT_MIN_RATE: u64 = 1024;
/// Default `--min-rate-window`.
pub const DEFAULT_RATE_WINDOW: Duration = Duration::from_secs(30);
/// Default `--timeout`: the whole push or pull.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(12 * 3600);
/// The most of a registry's error body that is read (enough for an OCI error envelope);
/// the rest is never downloaded.
pub const MAX_ERROR_BODY: usize = 64 << 10;
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
    client: Client,
    /// Pulls go through this client directly (`oci-client` reads whole bodies into memory,
    /// error bodies included): every body read is capped and paced.
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

fn transient(e: &OciDistributionError) -> bool {
    match e {
        OciDistributionError::RequestError(r) => !r.is_builder() && !r.is_decode(),
        OciDistributionError::IoError(_) => true,
        OciDistributionError::ServerError { code, .. } => *code == 429 || *code >= 500,
        _ => false,
    }
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
        let config = ClientConfig {
            protocol: if opts.plain_http {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            use_monolithic_push: true,
            connect_timeout: Some(Duration::from_secs(30)),
            read_timeout: Some(Duration::from_secs(120)),
            ..Default::default()
        };
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
            client: Client::new(config),
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

    fn err(&self, what: &str, e: OciDistributionError) -> DistError {
        let registry = self.reference.resolve_registry();
        let detail = match &e {
            OciDistributionError::UnauthorizedError { .. } => {
                "401 Unauthorized: the credentials are missing or wrong (docker login / $DOCKER_CONFIG/config.json)".to_string()
            }
            OciDistributionError::AuthenticationFailure(m) => {
                format!("authentication failed (401): {}", excerpt(m.as_bytes()))
            }
            OciDistributionError::ServerError { code, message, .. } => {
                format!("HTTP {code}: {}", excerpt(message.as_bytes()))
            }
            OciDistributionError::RegistryError { envelope, .. } => {
                let codes: Vec<String> = envelope
                    .errors
                    .iter()
                    .map(|x| format!("{:?}: {}", x.code, x.message))
                    .collect();
                excerpt(codes.join("; ").as_bytes())
            }
            OciDistributionError::RequestError(r) => {
                let mut s = r.to_string();
                let mut src = std::error::Error::source(r);
                while let Some(x) = src {
                    s.push_str(&format!(": {x}"));
                    src = x.source();
                }
                s
            }
            other => excerpt(other.to_string().as_bytes()),
        };
        DistError::registry(format!("registry {registry}: {what}: {detail}"))
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
    /// Basic credentials, else nothing (the registry's 401 then says so).
    async fn pull_auth(&self) -> Result<PullAuth> {
        let r = &self.reference;
        let mut pace = self.pace("authenticating");
        let token = pace
            .wait(
                self.client.auth(r, &self.auth, RegistryOperation::Pull),
                None,
            )
            .await?;
        Ok(match (token, &self.auth) {
            (Ok(Some(t)), _) => PullAuth::Bearer(t),
            (_, RegistryAuth::Basic(u, p)) => PullAuth::Basic(u.clone(), p.clone()),
            _ => PullAuth::None,
        })
    }

    /// Sends `GET url` (paced) and checks the status: a 2xx response, or an error whose
    /// message holds at most an excerpt of the body (of which at most [`MAX_ERROR_BODY`]
    /// bytes are read).
    async fn get(
        &self,
        auth: &PullAuth,
        url: &str,
        accept: Option<&str>,
        range: Option<(u64, u64)>,
        what: &str,
        pace: &mut Pace,
    ) -> std::result::Result<reqwest::Response, Fail> {
        let registry = self.reference.resolve_registry();
        let mut req = self.http.get(url);
        if let Some(a) = accept {
            req = req.header(http::header::ACCEPT, a);
        }
        if let Some((from, to)) = range {
            req = req.header(http::header::RANGE, format!("bytes={from}-{to}"));
        }
        req = match auth {
            PullAuth::Bearer(t) => req.bearer_auth(t),
            PullAuth::Basic(u, p) => req.basic_auth(u, Some(p)),
            PullAuth::None => req,
        };
        let resp = match pace.wait(req.send(), None).await.map_err(Fail::Stop)? {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("registry {registry}: {what}: {}", reqwest_detail(&e));
                return Err(if e.is_builder() {
                    Fail::Stop(DistError::registry(msg))
                } else {
                    Fail::Retry(DistError::registry(msg))
                });
            }
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let code = status.as_u16();
        let total = resp.content_length();
        let (body, cut) = read_capped(resp, MAX_ERROR_BODY, pace)
            .await
            .map_err(Fail::Stop)?;
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
        Err(if code == 429 || code >= 500 {
            Fail::Retry(e)
        } else {
            Fail::Stop(e)
        })
    }

    /// A small body (the manifest, the config), read whole but never past `cap` bytes.
    async fn get_small(
        &self,
        auth: &PullAuth,
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

    /// Retries an `oci-client` call on transient failures with back-off; each attempt is
    /// paced (`--min-rate`), counting the bytes `sent` reports (an upload) if given.
    async fn retry<T, F, Fut>(
        &self,
        what: &str,
        sent: Option<&std::sync::atomic::AtomicU64>,
        mut f: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, OciDistributionError>>,
    {
        let mut delay = Duration::from_millis(500);
        for attempt in 1.. {
            let mut pace = self.pace(what);
            match pace.wait(f(), sent).await? {
                Ok(v) => return Ok(v),
                Err(e) if attempt < 4 && transient(&e) => {
                    eprintln!(
                        "{} (retrying in {:.1} s)",
                        self.err(what, e),
                        delay.as_secs_f64()
                    );
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(e) => return Err(self.err(what, e)),
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
        self.pace("authenticating for push")
            .wait(
                self.client.auth(r, &self.auth, RegistryOperation::Push),
                None,
            )
            .await?
            .map_err(|e| self.err("authenticating for push", e))?;
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
        let sources: Vec<Reference> = self
            .opts
            .mount_from
            .iter()
            .map(|repo| {
                Reference::with_tag(r.registry().to_string(), repo.clone(), "latest".into())
            })
            .collect();
        for b in blobs {
            let what = format!("checking blob {}", b.digest);
            if self
                .retry(&what, None, || self.client.blob_exists(r, &b.digest))
                .await?
            {
                s.skipped_blobs += 1;
                if let Some(p) = &self.opts.progress {
                    p(b.size);
                }
                continue;
            }
            let mut mounted = false;
            for src in &sources {
                let mut pace = self.pace(&format!("mounting blob {}", b.digest));
                let mount = pace
                    .wait(self.client.mount_blob(r, src, &b.digest), None)
                    .await?;
                if mount.is_ok()
                    && pace
                        .wait(self.client.blob_exists(r, &b.digest), None)
                        .await?
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
            self.retry(&what, Some(&sent), || {
                let stream = blob_stream(
                    b,
                    self.opts.limit_rate,
                    self.opts.progress.clone(),
                    sent.clone(),
                );
                self.client
                    .push_blob_stream(r, stream, &b.digest, Some(b.size))
            })
            .await?;
            s.uploaded_blobs += 1;
            s.uploaded_bytes += b.size;
        }
        let what = "uploading the manifest";
        self.retry(what, None, || {
            self.client.push_manifest_raw(
                r,
                a.manifest.clone(),
                http::HeaderValue::from_static(MANIFEST_MEDIA_TYPE),
            )
        })
        .await?;
        Ok(s)
    }

    /// Fetches and checks the image manifest: (bytes, digest, parsed).
    async fn manifest(
        &self,
        auth: &PullAuth,
    ) -> Result<(Vec<u8>, String, crate::package::ParsedManifest)> {
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
                    Some(MANIFEST_MEDIA_TYPE),
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
        let parsed = parse_manifest(&bytes, &format!("{} ({digest})", r.whole()))?;
        Ok((bytes, digest, parsed))
    }

    /// Pulls into `out` (which must not exist unless `force`), through `store`.
    pub fn pull(&self, store: &Store, out: &Path, force: bool) -> Result<PullSummary> {
        self.rt
            .block_on(self.deadline("pulling", self.pull_async(store, Some(out), force)))
    }

    /// Pulls into the store's own directory for this model (`models/<manifest hex>`),
    /// unless it is there already.
    pub fn pull_into_store(&self, store: &Store) -> Result<PullSummary> {
        self.rt
            .block_on(self.deadline("pulling", self.pull_async(store, None, true)))
    }

    async fn pull_async(
        &self,
        store: &Store,
        out: Option<&Path>,
        force: bool,
    ) -> Result<PullSummary> {
        let _lock = store.lock(false)?;
        let auth = self.pull_auth().await?;
        let (_, digest, p) = self.manifest(&auth).await?;
        let what = format!("{} ({digest})", self.reference.whole());
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
                    return Ok(PullSummary {
                        reference: self.reference.whole(),
                        manifest_digest: digest,
                        blobs: p.layers.len() + 1,
                        downloaded_blobs: 0,
                        reused_blobs: p.layers.len() + 1,
                        downloaded_bytes: 0,
                        resumed_bytes: 0,
                        output: o,
                    });
                }
                o
            }
        };
        let out = out.as_path();
        let staged = Staged::new(out, force)?;
        if let Some(t) = &self.opts.on_total {
            let mut seen = std::collections::HashSet::new();
            t(p.layers
                .iter()
                .filter(|l| seen.insert(&l.digest))
                .map(|l| l.size)
                .sum());
        }
        // the config: small, capped, checked against the layers
        let config_cached = store.has_blob(&p.config_digest, p.config_size);
        let config = self
            .fetch_small(&auth, store, &p.config_digest, p.config_size)
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
        // room for what is missing
        let mut seen = std::collections::HashSet::new();
        let unique: Vec<&Layer> = p
            .layers
            .iter()
            .filter(|l| seen.insert(l.digest.clone()))
            .collect();
        let need: u64 = unique
            .iter()
            .filter(|l| !store.has_blob(&l.digest, l.size))
            .map(|l| l.size)
            .sum();
        if let Ok(st) = rustix::fs::statvfs(store.root()) {
            let free = st.f_bavail.saturating_mul(st.f_frsize);
            if need > free {
                return Err(DistError::usage(format!(
                    "{what}: needs {need} bytes in {}, only {free} are free",
                    store.root().display()
                )));
            }
        }
        let mut s = PullSummary {
            reference: self.reference.whole(),
            manifest_digest: digest.clone(),
            blobs: unique.len() + 1,
            downloaded_blobs: 0,
            reused_blobs: 0,
            downloaded_bytes: 0,
            resumed_bytes: 0,
            output: out.to_path_buf(),
        };
        if config_cached {
            s.reused_blobs += 1;
        } else {
            s.downloaded_blobs += 1;
            s.downloaded_bytes += p.config_size;
        }
        let mut fetched = Vec::new();
        let mut flushes = Vec::new();
        for l in &unique {
            if store.has_blob(&l.digest, l.size) {
                s.reused_blobs += 1;
                if let Some(cb) = &self.opts.progress {
                    cb(l.size);
                }
                continue;
            }
            let (got, resumed, file) = self.fetch_blob(&auth, store, l, &what).await?;
            s.downloaded_blobs += 1;
            s.downloaded_bytes += got;
            s.resumed_bytes += resumed;
            // each blob is flushed to disk on a thread while the next one downloads
            let part = store.partial_path(&l.digest)?;
            flushes.push(std::thread::spawn(move || {
                file.map_or(Ok(()), |f| f.sync_data())
                    .map_err(|e| DistError::io(&part, e))
            }));
            fetched.push(l.digest.clone());
        }
        // every download is on disk before it enters the store
        for h in flushes {
            h.join()
                .map_err(|_| DistError::usage("a flush thread panicked"))??;
        }
        for d in &fetched {
            let part = store.partial_path(d)?;
            if part.exists() {
                store.commit_blob(&part, d)?;
            }
        }
        // assemble beside OUT_DIR, check, rename into place
        let dir = staged.path().to_path_buf();
        std::fs::create_dir(&dir).map_err(|e| DistError::io(&dir, e))?;
        for l in &p.layers {
            link_or_copy(&store.blob_path(&l.digest)?, &dir.join(&l.path))?;
        }
        check_assembled(&dir, &p.layers, &what)?;
        staged.commit()?;
        Ok(s)
    }

    /// A small blob (the config), from the store or the registry, with its size capped.
    async fn fetch_small(
        &self,
        auth: &PullAuth,
        store: &Store,
        digest: &str,
        size: u64,
    ) -> Result<Vec<u8>> {
        let path = store.blob_path(digest)?;
        if store.has_blob(digest, size) {
            return std::fs::read(&path).map_err(|e| DistError::io(&path, e));
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
        store.commit_blob(&tmp, digest)?;
        Ok(v)
    }

    /// Downloads one layer blob into the store's partial file, verified, resuming a partial
    /// download: (bytes fetched now, bytes resumed, the file to flush; `None` when another
    /// pull already stored the blob).
    async fn fetch_blob(
        &self,
        auth: &PullAuth,
        store: &Store,
        l: &Layer,
        what: &str,
    ) -> Result<(u64, u64, Option<std::fs::File>)> {
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
        if store.has_blob(&l.digest, l.size) {
            let _ = std::fs::remove_file(&part);
            return Ok((0, 0, None));
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
        let resumed = have;
        let mut fetched = 0u64;
        let mut attempts = 0;
        let url = self.url("blobs", &l.digest);
        let fetching = format!("fetching blob {} ({} bytes)", l.digest, l.size);
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
                sha = Sha256::new();
                b3 = blake3::Hasher::new();
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
        let got = format!("sha256:{}", hex(&sha.finalize()));
        if got != l.digest {
            let _ = std::fs::remove_file(&part);
            return Err(bad(format!(
                "the content's digest is {got}: the blob was altered or corrupted; nothing was kept"
            )));
        }
        if *b3.finalize().as_bytes() != l.blake3 {
            let _ = std::fs::remove_file(&part);
            return Err(bad(format!(
                "the content does not match the BLAKE3 the package declares ({BLAKE3_ANNOTATION}); nothing was kept"
            )));
        }
        // the caller flushes it (beside the next download), then moves it into the store
        Ok((fetched, resumed, Some(f)))
    }
}

/// The assembled directory must be exactly the model its manifest describes: its structure,
/// architecture and chat template (code from the model file, under
/// `gds_format::chat_template`'s bounds) validate (the tokenizer is checked when a runtime
/// first loads it, as for any model), so that a refused model is never committed; and every
/// file the model manifest hashes is the layer whose BLAKE3 annotation says so.
/// (The blobs' BLAKE3 was checked as they were downloaded, so no file is read again.)
fn check_assembled(dir: &Path, layers: &[Layer], what: &str) -> Result<()> {
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
    let bytes = gds_io::read_manifest(dir).map_err(|e| DistError::invalid(e.to_string()))?;
    let m = gds_format::Manifest::parse(&bytes).map_err(|e| DistError::invalid(e.to_string()))?;
    let by_path: std::collections::HashMap<&str, &Layer> =
        layers.iter().map(|l| (l.path.as_str(), l)).collect();
    let mut expected: Vec<(&str, [u8; 32])> =
        m.layers().map(|l| (l.file, l.content_hash)).collect();
    expected.extend(m.files().map(|f| (f.path, f.content_hash)));
    for (path, hash) in &expected {
        match by_path.get(path) {
            Some(l) if l.blake3 == *hash => {}
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
            "{what}: blob {} ships {}, which the model manifest does not list",
            extra.digest, extra.path
        )));
    }
    Ok(())
}

/// How a pull's own requests authenticate.
enum PullAuth {
    None,
    Bearer(String),
    Basic(String, String),
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
    /// `sent` counts bytes moved inside `fut` (an upload).
    async fn wait<F: std::future::Future>(
        &mut self,
        fut: F,
        sent: Option<&std::sync::atomic::AtomicU64>,
    ) -> Result<F::Output> {
        if self.min_rate == 0 {
            return Ok(fut.await);
        }
        let count = || sent.map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed));
        let mut last = count();
        let mut fut = std::pin::pin!(fut);
        loop {
            let end = tokio::time::Instant::from_std(self.start + self.window);
            match tokio::time::timeout_at(end, &mut fut).await {
                Ok(v) => {
                    self.bytes += count() - last;
                    return Ok(v);
                }
                Err(_) => {
                    let now = count();
                    self.bytes += now - last;
                    last = now;
                    self.check()?;
                }
            }
        }
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

/// A blob as a stream of 1 MiB pieces read from its source, paced by `limit`.
fn blob_stream(
    b: &BlobRef,
    limit: Option<u64>,
    progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    counter: Arc<std::sync::atomic::AtomicU64>,
) -> futures_util::stream::BoxStream<'static, std::result::Result<bytes::Bytes, OciDistributionError>>
{
    let source = b.source.clone();
    let size = b.size;
    let state = (source, None::<std::fs::File>, 0u64, Limiter::new(limit));
    futures_util::stream::unfold(state, move |(source, mut file, sent, lim)| {
        let progress = progress.clone();
        let sent_now = counter.clone();
        async move {
            if sent >= size {
                return None;
            }
            let piece = (size - sent).min(1 << 20) as usize;
            let chunk = match &source {
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
                    OciDistributionError::IoError(std::io::Error::new(
                        e.kind(),
                        format!("{}: {e}", path.display()),
                    ))
                }),
            };
            let n = piece as u64;
            sent_now.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            if let Some(p) = &progress {
                p(n);
            }
            lim.wait(sent + n).await;
            Some((chunk, (source, file, sent + n, lim)))
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

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
            Some(&sent),
        ))
        .unwrap();
        assert_eq!(
            Pace::new(&limits(1000, 100), Some(100), "l".into()).min_rate,
            50
        );
    }
}
