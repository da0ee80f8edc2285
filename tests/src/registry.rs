//! A throwaway OCI registry for the distribution tests: Debian's build of the CNCF reference
//! registry (`/usr/bin/docker-registry`, package `docker-registry`, distribution 2.8), started
//! on 127.0.0.1 with a free port and its own config (filesystem storage in a temporary
//! directory, deletes enabled, quiet log), and killed when the [`Registry`] is dropped.
//!
//! Debian's default `/etc/docker/registry/config.yml` turns on htpasswd auth and listens on
//! every interface; it is never read here. [`Registry::start_with_auth`] writes its own
//! htpasswd file instead, so the credential path is tested against the registry's real
//! Basic-auth handling.
//!
//! `scripts/test.sh` installs the tools (`apt-get install -y docker-registry skopeo`); without
//! them the harness panics with that instruction rather than skipping.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The registry binary.
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

/// User name of the authenticated registry.
pub const USER: &str = "gdsuser";
/// Password of the authenticated registry.
pub const PASSWORD: &str = "gds-secret-pw";
/// bcrypt (cost 10) of [`PASSWORD`], as `htpasswd -nbB gdsuser gds-secret-pw` writes it
/// (made once with Python's `crypt` module: `crypt.crypt(PASSWORD, crypt.mksalt(
/// crypt.METHOD_BLOWFISH, rounds=1024))`). A constant keeps the tests free of apache2-utils
/// and of a bcrypt package; the registry checks it with Go's bcrypt like any other entry.
const PASSWORD_BCRYPT: &str = "$2b$10$UZlH2s41Gz0Zf4COh/ZHteH3XFBGE6yjKSfHlGsAJrPCGUiAYk..q";

/// Panics, saying how to install them, when docker-registry or skopeo is missing.
pub fn require_tools() {
    let have_registry = Path::new(REGISTRY_BIN).exists();
    let have_skopeo = Command::new("skopeo")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        have_registry && have_skopeo,
        "the distribution tests need Debian's docker-registry ({}) and skopeo \
         (found: docker-registry {have_registry}, skopeo {have_skopeo}): \
         `apt-get install -y docker-registry skopeo` (scripts/test.sh does this)",
        REGISTRY_BIN
    );
}

/// A running registry; killed on drop.
pub struct Registry {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
    auth: bool,
}

impl Registry {
    /// A registry without authentication.
    pub fn start() -> Registry {
        Self::start_inner(false)
    }

    /// A registry that requires HTTP Basic credentials [`USER`] / [`PASSWORD`] (htpasswd).
    pub fn start_with_auth() -> Registry {
        Self::start_inner(true)
    }

    fn start_inner(auth: bool) -> Registry {
        require_tools();
        let dir = tempfile::tempdir().expect("registry temporary directory");
        let storage = dir.path().join("storage");
        std::fs::create_dir_all(&storage).expect("registry storage directory");
        let htpasswd = dir.path().join("htpasswd");
        if auth {
            std::fs::write(&htpasswd, format!("{USER}:{PASSWORD_BCRYPT}\n")).expect("htpasswd");
        }
        // A port taken between our probe and the registry's bind makes the registry exit:
        // try again with another.
        let mut last_log = String::new();
        for _attempt in 0..5 {
            let port = free_port();
            let config = dir.path().join("config.yml");
            let mut yml = format!(
                "version: 0.1\n\
                 log:\n  level: error\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 \x20 maintenance:\n    uploadpurging:\n      enabled: false\n\
                 http:\n  addr: 127.0.0.1:{port}\n  secret: gdsllm-tests-not-secret\n",
                storage.display()
            );
            if auth {
                yml.push_str(&format!(
                    "auth:\n  htpasswd:\n    realm: gdsllm-tests\n    path: {}\n",
                    htpasswd.display()
                ));
            }
            std::fs::write(&config, yml).expect("registry config");
            let log_path = dir.path().join("registry.log");
            let log = std::fs::File::create(&log_path).expect("registry log");
            let mut child = Command::new(REGISTRY_BIN)
                .arg("serve")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log handle"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("start {REGISTRY_BIN}: {e}"));
            match wait_ready(&mut child, port, auth, Duration::from_secs(30)) {
                Ready::Yes => {
                    return Registry {
                        child,
                        port,
                        dir,
                        auth,
                    }
                }
                Ready::Exited => {
                    // Most likely the port was taken in the meantime: another one.
                    last_log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    let _ = child.wait();
                }
                Ready::TimedOut => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    panic!("docker-registry did not answer GET /v2/ on 127.0.0.1:{port}:\n{log}");
                }
            }
        }
        panic!("docker-registry exited at start five times; last log:\n{last_log}");
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether it requires credentials.
    pub fn requires_auth(&self) -> bool {
        self.auth
    }

    /// `127.0.0.1:PORT/REPO:TAG`.
    pub fn reference(&self, repo: &str, tag: &str) -> String {
        format!("{}/{repo}:{tag}", self.host())
    }

    /// Root of the filesystem storage driver (`docker/registry/v2/...` lies under it).
    pub fn storage(&self) -> PathBuf {
        self.dir.path().join("storage")
    }

    /// Where the registry keeps the bytes of blob `sha256:HEX` (or bare `HEX`).
    pub fn blob_data_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.storage()
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Every blob digest (`sha256:HEX`) the registry stores, sorted.
    pub fn blob_digests(&self) -> Vec<String> {
        let root = self.storage().join("docker/registry/v2/blobs/sha256");
        let mut out = Vec::new();
        let Ok(prefixes) = std::fs::read_dir(&root) else {
            return out;
        };
        for p in prefixes.flatten() {
            for b in std::fs::read_dir(p.path()).into_iter().flatten().flatten() {
                if b.path().join("data").exists() {
                    out.push(format!("sha256:{}", b.file_name().to_string_lossy()));
                }
            }
        }
        out.sort();
        out
    }

    /// What the registry logged (errors only).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// Writes a Docker `config.json` with this registry's credentials into `dir` (to be
    /// used as `DOCKER_CONFIG`): `{"auths": {"127.0.0.1:PORT": {"auth": base64(user:pass)}}}`.
    pub fn write_docker_config(&self, dir: &Path, user: &str, password: &str) {
        std::fs::create_dir_all(dir).expect("docker config directory");
        let auth = base64(format!("{user}:{password}").as_bytes());
        let json = serde_json::json!({ "auths": { self.host(): { "auth": auth } } });
        std::fs::write(dir.join("config.json"), json.to_string()).expect("config.json");
    }
}

enum Ready {
    Yes,
    Exited,
    TimedOut,
}

/// Polls `GET /v2/` until the registry answers (200, or 401 with auth).
fn wait_ready(child: &mut Child, port: u16, auth: bool, timeout: Duration) -> Ready {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if let Ok(Some(_)) = child.try_wait() {
            return Ready::Exited;
        }
        let want = if auth { 401 } else { 200 };
        if http_get_status(port, "/v2/") == Some(want) {
            return Ready::Yes;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ready::TimedOut
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Status code of `GET PATH` on 127.0.0.1:PORT, or None when nothing answers.
pub fn http_get_status(port: u16, path: &str) -> Option<u16> {
    http_get_status_as(port, path, None)
}

/// Status code of `GET PATH` on 127.0.0.1:PORT with HTTP Basic credentials (user, password).
pub fn http_get_status_as(port: u16, path: &str, basic: Option<(&str, &str)>) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let auth = basic
        .map(|(u, p)| {
            format!(
                "Authorization: Basic {}\r\n",
                base64(format!("{u}:{p}").as_bytes())
            )
        })
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    let head = std::str::from_utf8(&buf[..n]).ok()?;
    head.strip_prefix("HTTP/1.1 ")
        .or_else(|| head.strip_prefix("HTTP/1.0 "))?
        .get(..3)?
        .parse()
        .ok()
}

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(super::base64(b""), "");
        assert_eq!(super::base64(b"f"), "Zg==");
        assert_eq!(super::base64(b"fo"), "Zm8=");
        assert_eq!(super::base64(b"foo"), "Zm9v");
        assert_eq!(super::base64(b"foobar"), "Zm9vYmFy");
    }
}
