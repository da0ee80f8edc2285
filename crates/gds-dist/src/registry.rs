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

/// How to reach the registry.
#[derive(Clone, Default)]
pub struct RemoteOptions {
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
        Ok(Remote {
            client: Client::new(config),
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
                format!("authentication failed (401): {m}")
            }
            OciDistributionError::ServerError { code, message, .. } => {
                format!("HTTP {code}: {message}")
            }
            OciDistributionError::RegistryError { envelope, .. } => {
                let codes: Vec<String> = envelope
                    .errors
                    .iter()
                    .map(|x| format!("{:?}: {}", x.code, x.message))
                    .collect();
                codes.join("; ")
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
            other => other.to_string(),
        };
        DistError::registry(format!("registry {registry}: {what}: {detail}"))
    }

    async fn retry<T, F, Fut>(&self, what: &str, mut f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, OciDistributionError>>,
    {
        let mut delay = Duration::from_millis(500);
        for attempt in 1.. {
            match f().await {
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
        self.rt.block_on(self.push_async(a))
    }

    async fn push_async(&self, a: &Artifact) -> Result<PushSummary> {
        let r = &self.reference;
        self.client
            .auth(r, &self.auth, RegistryOperation::Push)
            .await
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
                .retry(&what, || self.client.blob_exists(r, &b.digest))
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
                if self.client.mount_blob(r, src, &b.digest).await.is_ok()
                    && self.client.blob_exists(r, &b.digest).await.unwrap_or(false)
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
            self.retry(&what, || {
                let stream = blob_stream(b, self.opts.limit_rate, self.opts.progress.clone());
                self.client
                    .push_blob_stream(r, stream, &b.digest, Some(b.size))
            })
            .await?;
            s.uploaded_blobs += 1;
            s.uploaded_bytes += b.size;
        }
        let what = "uploading the manifest";
        self.retry(what, || {
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
    async fn manifest(&self) -> Result<(Vec<u8>, String, crate::package::ParsedManifest)> {
        let r = &self.reference;
        let (bytes, _) = self
            .retry("fetching the manifest", || {
                self.client
                    .pull_manifest_raw(r, &self.auth, &[MANIFEST_MEDIA_TYPE])
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
        Ok((bytes.to_vec(), digest, parsed))
    }

    /// Pulls into `out` (which must not exist unless `force`), through `store`.
    pub fn pull(&self, store: &Store, out: &Path, force: bool) -> Result<PullSummary> {
        self.rt.block_on(self.pull_async(store, Some(out), force))
    }

    /// Pulls into the store's own directory for this model (`models/<manifest hex>`),
    /// unless it is there already.
    pub fn pull_into_store(&self, store: &Store) -> Result<PullSummary> {
        self.rt.block_on(self.pull_async(store, None, true))
    }

    async fn pull_async(
        &self,
        store: &Store,
        out: Option<&Path>,
        force: bool,
    ) -> Result<PullSummary> {
        let _lock = store.lock(false)?;
        let (_, digest, p) = self.manifest().await?;
        let what = format!("{} ({digest})", self.reference.whole());
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
            .fetch_small(store, &p.config_digest, p.config_size)
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
            let (got, resumed, file) = self.fetch_blob(store, l, &what).await?;
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
    async fn fetch_small(&self, store: &Store, digest: &str, size: u64) -> Result<Vec<u8>> {
        let path = store.blob_path(digest)?;
        if store.has_blob(digest, size) {
            return std::fs::read(&path).map_err(|e| DistError::io(&path, e));
        }
        let mut stream = self
            .retry(&format!("fetching config blob {digest}"), || {
                self.client.pull_blob_stream(&self.reference, digest)
            })
            .await?;
        let mut v = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                DistError::invalid(format!(
                    "{}: config blob {digest}: {e}",
                    self.reference.whole()
                ))
            })?;
            v.extend_from_slice(&chunk);
            if v.len() as u64 > size {
                return Err(DistError::invalid(format!(
                    "{}: config blob {digest} is longer than the {size} bytes declared",
                    self.reference.whole()
                )));
            }
        }
        if sha256_digest(&v) != digest || v.len() as u64 != size {
            return Err(DistError::invalid(format!(
                "{}: config blob {digest} does not match its digest",
                self.reference.whole()
            )));
        }
        let tmp = store
            .partial_path(digest)?
            .with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, &v).map_err(|e| DistError::io(&tmp, e))?;
        store.commit_blob(&tmp, digest)?;
        Ok(v)
    }

    /// Downloads one layer blob into the store's partial file, verified, resuming a partial
    /// download: (bytes fetched now, bytes resumed, the file to flush; `None` when another
    /// pull already stored the blob).
    async fn fetch_blob(
        &self,
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
        while have < l.size {
            attempts += 1;
            let r = &self.reference;
            let layer = oci_client::client::LayerDescriptor {
                digest: &l.digest,
                urls: &None,
            };
            let res = if have == 0 {
                self.client
                    .pull_blob_stream(r, &layer)
                    .await
                    .map(|s| (s, true))
            } else {
                match self
                    .client
                    .pull_blob_stream_partial(r, &layer, have, Some(l.size - have))
                    .await
                {
                    Ok(oci_client::client::BlobResponse::Partial(s)) => Ok((s, false)),
                    Ok(oci_client::client::BlobResponse::Full(s)) => Ok((s, true)),
                    Err(e) => Err(e),
                }
            };
            let (mut stream, full) = match res {
                Ok(x) => x,
                Err(e) if attempts < 4 && transient(&e) => {
                    tokio::time::sleep(Duration::from_millis(500 << attempts)).await;
                    continue;
                }
                Err(e) => return Err(self.err(&format!("fetching blob {}", l.digest), e)),
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
            while let Some(chunk) = stream.next().await {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => {
                        failed = Some(e);
                        break;
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
        return Err(DistError::invalid(format!(
            "{what}: the pulled model does not validate:\n  {}",
            report.errors.join("\n  ")
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
) -> futures_util::stream::BoxStream<'static, std::result::Result<bytes::Bytes, OciDistributionError>>
{
    let source = b.source.clone();
    let size = b.size;
    let state = (source, None::<std::fs::File>, 0u64, Limiter::new(limit));
    futures_util::stream::unfold(state, move |(source, mut file, sent, lim)| {
        let progress = progress.clone();
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
            if let Some(p) = &progress {
                p(n);
            }
            lim.wait(sent + n).await;
            Some((chunk, (source, file, sent + n, lim)))
        }
    })
    .boxed()
}
