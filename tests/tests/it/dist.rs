//! Distribution end to end (issue 11): the real SmolLM2, converted, packed as a CNCF ModelPack
//! OCI artifact, pushed to and pulled from a real registry (Debian's `docker-registry`, the
//! CNCF reference implementation, started per test by `gds_tests::registry`), with skopeo as
//! an independent client in both directions. Every test has its own registry, its own
//! `GDSLLM_HOME` store and an empty `DOCKER_CONFIG`, so tests never share state.
//!
//! Needs docker-registry and skopeo (`apt-get install -y docker-registry skopeo`, which
//! scripts/test.sh does) and python3 with gguf-py for the second model (tests/py/perturb_gguf.py)
//! and the hostile packages (tests/py/hostile_oci.py).

use gds_tests::caches::sha256_hex;
use gds_tests::registry::{Registry, PASSWORD, USER};
use gds_tests::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const PROMPT: &str = "What is the capital of France?";
const MAX_TOKENS: &str = "12";
const WEIGHT_MT: &str = "application/vnd.cncf.model.weight.v1.raw";
const WEIGHT_CONFIG_MT: &str = "application/vnd.cncf.model.weight.config.v1.raw";
const FILEPATH: &str = "org.cncf.model.filepath";

/// A private client environment: `GDSLLM_HOME` and `DOCKER_CONFIG` in a temporary directory.
struct Env {
    tmp: tempfile::TempDir,
    docker_config: PathBuf,
}

impl Env {
    fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        let docker_config = tmp.path().join("docker-config");
        std::fs::create_dir_all(&docker_config).unwrap();
        std::fs::create_dir_all(tmp.path().join("home")).unwrap();
        Env { tmp, docker_config }
    }

    /// A scratch path inside this environment's temporary directory.
    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    fn home(&self) -> PathBuf {
        self.path("home")
    }

    fn store(&self) -> PathBuf {
        self.home().join("store")
    }

    fn command(&self, name: &str, args: &[&str]) -> Command {
        let mut c = Command::new(bin(name));
        c.args(args)
            .env("GDSLLM_HOME", self.home())
            .env("DOCKER_CONFIG", &self.docker_config)
            .stdin(Stdio::null());
        c
    }

    fn run(&self, name: &str, args: &[&str]) -> Output {
        self.command(name, args).output().expect("spawn")
    }

    /// Runs `gdsconv ARGS --json`, asserts success, and parses stdout.
    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.push("--json");
        let o = self.run("gdsconv", &a);
        ok(&o, &format!("gdsconv {}", a.join(" ")));
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!(
                "gdsconv {}: stdout is not JSON ({e}): {}",
                a.join(" "),
                stdout(&o)
            )
        })
    }

    fn push(&self, src: &Path, reference: &str) -> Value {
        self.json(&["push", s(src), reference, "--plain-http"])
    }

    fn pull(&self, reference: &str, out: &Path) -> Value {
        self.json(&["pull", reference, s(out), "--plain-http"])
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what}: exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer {key:?} in {v}"))
}

fn st<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("no string {key:?} in {v}"))
}

fn sha256_file(p: &Path) -> String {
    sha256_hex(&std::fs::read(p).unwrap())
}

/// Regular files under `dir`, by path relative to it ('/'-separated); panics on anything
/// else (a symlink, a device) in a model directory.
fn walk(dir: &Path) -> BTreeMap<String, PathBuf> {
    walk_inner(dir, true)
}

/// Regular files under `dir`, skipping symlinks and other non-files.
fn walk_files(dir: &Path) -> BTreeMap<String, PathBuf> {
    walk_inner(dir, false)
}

fn walk_inner(dir: &Path, strict: bool) -> BTreeMap<String, PathBuf> {
    fn go(base: &Path, d: &Path, strict: bool, out: &mut BTreeMap<String, PathBuf>) {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                go(base, &e.path(), strict, out);
            } else if t.is_file() {
                let rel = e
                    .path()
                    .strip_prefix(base)
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                out.insert(rel, e.path());
            } else {
                assert!(!strict, "{} is not a regular file", e.path().display());
            }
        }
    }
    let mut out = BTreeMap::new();
    go(dir, dir, strict, &mut out);
    out
}

/// Asserts two directory trees hold the same files with the same bytes.
fn assert_same_tree(a: &Path, b: &Path) {
    let (fa, fb) = (walk(a), walk(b));
    assert_eq!(
        fa.keys().collect::<Vec<_>>(),
        fb.keys().collect::<Vec<_>>(),
        "{} and {} hold different files",
        a.display(),
        b.display()
    );
    for (rel, pa) in &fa {
        let (x, y) = (std::fs::read(pa).unwrap(), std::fs::read(&fb[rel]).unwrap());
        assert!(
            x == y,
            "{rel} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

fn total_bytes(dir: &Path) -> u64 {
    walk(dir)
        .values()
        .map(|p| p.metadata().unwrap().len())
        .sum()
}

fn validate(dir: &Path) {
    let o = run("gdsconv", &["validate", s(dir)]);
    ok(&o, &format!("gdsconv validate {}", dir.display()));
}

/// Entries of a directory (names), sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Greedy text of `gdsrun MODEL` (a directory, an OCI reference, or a .gguf).
fn generate(env: &Env, model: &str, extra: &[&str]) -> Output {
    let mut a = vec![
        model,
        "-p",
        PROMPT,
        "--temp",
        "0",
        "--max-tokens",
        MAX_TOKENS,
    ];
    a.extend_from_slice(extra);
    env.run("gdsrun", &a)
}

/// The greedy text on the converted directory, computed once.
fn reference_text() -> &'static str {
    static T: OnceLock<String> = OnceLock::new();
    T.get_or_init(|| {
        let env = Env::new();
        let o = generate(&env, s(smollm_converted()), &[]);
        ok(&o, "gdsrun on the converted directory");
        let t = stdout(&o);
        assert!(!t.trim().is_empty(), "gdsrun printed no text");
        t
    })
}

/// `gdsconv pack DIR --layout OUT` into `env`, returning the layout path.
fn pack_layout(env: &Env, dir: &Path, name: &str, tag: &str) -> PathBuf {
    let out = env.path(name);
    let v = env.json(&["pack", s(dir), "--layout", s(&out), "--tag", tag]);
    assert_eq!(st(&v, "tag"), tag);
    out
}

/// The image manifest of an OCI layout (the one index.json names).
fn layout_manifest(layout: &Path) -> (String, Value) {
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let d = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let m = serde_json::from_slice(&std::fs::read(blob_path(layout, &d)).unwrap()).unwrap();
    (d, m)
}

fn blob_path(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.strip_prefix("sha256:").unwrap())
}

/// Digests of the layers and the config of an image manifest.
fn manifest_blobs(m: &Value) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect();
    out.insert(m["config"]["digest"].as_str().unwrap().to_string());
    out
}

/// Files in the store named by a sha256 digest (64 hex digits), anywhere under `store`.
fn store_blobs(store: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    if !store.exists() {
        return out;
    }
    for p in walk_files(store).into_values() {
        let name = p.file_name().unwrap().to_str().unwrap();
        if name.len() == 64 && name.bytes().all(|c| c.is_ascii_hexdigit()) {
            out.insert(name.to_string(), p);
        }
    }
    out
}

/// Every file of the store named by a digest holds bytes that hash to that name.
fn assert_store_consistent(store: &Path) {
    for (hex, p) in store_blobs(store) {
        assert_eq!(
            sha256_file(&p),
            hex,
            "{} in the store does not hash to its name",
            p.display()
        );
    }
}

/// Spawns a command and SIGKILLs it once `ready()` holds and at least `min` has passed;
/// panics if it finished on its own first (the rate limit did not hold it back).
fn kill_midway(mut c: Command, min: Duration, mut ready: impl FnMut() -> bool, what: &str) {
    let mut child = c
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("{what} ended ({status}) before it could be interrupted: {err}");
        }
        if t0.elapsed() >= min && ready() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what}: nothing transferred within 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

fn dir_bytes(dir: &Path) -> u64 {
    fn go(d: &Path) -> u64 {
        let Ok(rd) = std::fs::read_dir(d) else {
            return 0;
        };
        rd.flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => go(&e.path()),
                Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
                Err(_) => 0,
            })
            .sum()
    }
    go(dir)
}

fn skopeo(args: &[&str]) {
    let o = Command::new("skopeo")
        .arg("--insecure-policy")
        .args(args)
        .output()
        .expect("skopeo");
    ok(&o, &format!("skopeo {}", args.join(" ")));
}

// ------------------------------------------------------------------------------------------

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn the_registry_harness_serves_and_checks_credentials() {
    use gds_tests::registry::http_get_status_as;
    let open = Registry::start();
    assert_eq!(http_get_status_as(open.port(), "/v2/", None), Some(200));
    let closed = Registry::start_with_auth();
    assert!(closed.requires_auth());
    assert_eq!(http_get_status_as(closed.port(), "/v2/", None), Some(401));
    assert_eq!(
        http_get_status_as(closed.port(), "/v2/", Some((USER, "wrong"))),
        Some(401)
    );
    assert_eq!(
        http_get_status_as(closed.port(), "/v2/", Some((USER, PASSWORD))),
        Some(200)
    );
    let port = open.port();
    drop(open);
    assert_eq!(
        http_get_status_as(port, "/v2/", None),
        None,
        "not stopped on drop"
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn round_trip_push_pull_gives_identical_files_and_the_same_text() {
    let reg = Registry::start();
    let env = Env::new();
    let model = smollm_converted();
    let r = reg.reference("smollm2", "latest");

    let pushed = env.push(model, &r);
    let n_files = walk(model).len() as u64;
    let blobs = u(&pushed, "blobs");
    assert!(
        blobs >= n_files,
        "push counted {blobs} blobs for {n_files} files: {pushed}"
    );
    assert_eq!(u(&pushed, "uploaded_blobs"), blobs, "{pushed}");
    assert_eq!(u(&pushed, "skipped_blobs"), 0, "{pushed}");
    assert!(
        u(&pushed, "uploaded_bytes") >= total_bytes(model),
        "{pushed}"
    );
    let digest = st(&pushed, "manifest_digest").to_string();
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{digest}"
    );

    let out = env.path("pulled/smollm2");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let pulled = env.pull(&r, &out);
    assert_eq!(st(&pulled, "manifest_digest"), digest, "{pulled}");
    assert_eq!(u(&pulled, "blobs"), blobs, "{pulled}");
    assert_eq!(u(&pulled, "downloaded_blobs"), blobs, "{pulled}");
    assert_eq!(u(&pulled, "reused_blobs"), 0, "{pulled}");
    assert_eq!(
        Path::new(st(&pulled, "output")).canonicalize().unwrap(),
        out.canonicalize().unwrap()
    );

    assert_same_tree(model, &out);
    validate(&out);
    // Nothing but the model in the parent: the staging directory is gone.
    assert_eq!(entries(out.parent().unwrap()), vec!["smollm2".to_string()]);
    // The files are hard links of the store's blobs.
    let store = store_blobs(&env.store());
    for (rel, p) in walk(&out) {
        let hex = sha256_file(&p);
        let b = store.get(&hex).unwrap_or_else(|| {
            panic!(
                "{rel} (sha256:{hex}) is not in the store {}",
                env.store().display()
            )
        });
        let (m1, m2) = (p.metadata().unwrap(), b.metadata().unwrap());
        assert_eq!(
            (m1.dev(), m1.ino()),
            (m2.dev(), m2.ino()),
            "{rel} is not a hard link of {}",
            b.display()
        );
    }
    assert_store_consistent(&env.store());

    let o = generate(&env, s(&out), &[]);
    ok(&o, "gdsrun on the pulled directory");
    assert_eq!(
        stdout(&o),
        reference_text(),
        "greedy text differs after the round trip"
    );

    // By digest: the same model.
    let by_digest = format!("{}/smollm2@{digest}", reg.host());
    let v = env.pull(&by_digest, &env.path("pulled/by-digest"));
    assert_eq!(st(&v, "manifest_digest"), digest, "{v}");
    assert_same_tree(model, &env.path("pulled/by-digest"));

    // A second pull of the same reference elsewhere downloads nothing.
    let again = env.pull(&r, &env.path("pulled/again"));
    assert_eq!(u(&again, "downloaded_blobs"), 0, "{again}");
    assert_eq!(u(&again, "downloaded_bytes"), 0, "{again}");
    assert_same_tree(model, &env.path("pulled/again"));

    // Pulling over an existing directory is refused without --force.
    let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "pull over an existing directory: {}",
        stderr(&o)
    );
    let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http", "--force"]);
    ok(&o, "pull --force");
    assert_same_tree(model, &out);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn concurrent_pulls_into_one_store_agree() {
    // Several pulls of one model into one empty store at once (two pods on a node, or
    // `gdsrun REF` started twice): each must succeed, and the store must hold every blob once.
    // A few rounds, each with a fresh store, since a race shows only in some interleavings.
    let reg = Registry::start();
    let env = Env::new();
    let model = smollm_converted();
    let r = reg.reference("smollm2", "latest");
    env.push(model, &r);
    for round in 0..5 {
        let home = env.path(&format!("home{round}"));
        std::fs::create_dir_all(env.path(&format!("round{round}"))).unwrap();
        let outs: Vec<PathBuf> = (0..4)
            .map(|i| env.path(&format!("round{round}/out{i}")))
            .collect();
        let children: Vec<_> = outs
            .iter()
            .map(|o| {
                env.command("gdsconv", &["pull", &r, s(o), "--plain-http"])
                    .env("GDSLLM_HOME", &home)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let results: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        for (res, o) in results.iter().zip(&outs) {
            ok(
                res,
                &format!("round {round}: concurrent pull into {}", o.display()),
            );
            assert_same_tree(model, o);
        }
        assert_store_consistent(&home.join("store"));
        let ino = |p: &Path| p.join("manifest.gdsm").metadata().unwrap().ino();
        assert!(
            outs.iter().all(|o| ino(o) == ino(&outs[0])),
            "round {round}: concurrent pulls stored manifest.gdsm more than once"
        );
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn pack_is_deterministic_follows_modelpack_and_layout_equals_tar() {
    let env = Env::new();
    let model = smollm_converted();
    // A copy at another path, written later (other mtimes): must pack to the same bytes.
    let copy = env.path("copy/smollm2.gds");
    copy_dir(model, &copy);

    let (t1, t2, t3) = (env.path("a.tar"), env.path("b.tar"), env.path("c.tar"));
    let v = env.json(&["pack", s(model), "-o", s(&t1)]);
    assert_eq!(st(&v, "tag"), "latest", "{v}");
    assert!(u(&v, "blobs") >= walk(model).len() as u64, "{v}");
    assert!(u(&v, "bytes") >= total_bytes(model), "{v}");
    env.json(&["pack", s(model), "-o", s(&t2)]);
    env.json(&["pack", s(&copy), "-o", s(&t3)]);
    let b1 = std::fs::read(&t1).unwrap();
    assert!(b1 == std::fs::read(&t2).unwrap(), "two packs differ");
    assert!(
        b1 == std::fs::read(&t3).unwrap(),
        "a copy of the model packs differently"
    );

    // The layout directory holds exactly the tar's files.
    let layout = pack_layout(&env, model, "layout", "latest");
    let x = env.path("extracted");
    std::fs::create_dir_all(&x).unwrap();
    let o = Command::new("tar")
        .args(["-xf", s(&t1), "-C", s(&x)])
        .output()
        .unwrap();
    ok(&o, "tar -xf");
    assert_same_tree(&layout, &x);

    // OCI image layout + ModelPack.
    let ol: Value =
        serde_json::from_slice(&std::fs::read(layout.join("oci-layout")).unwrap()).unwrap();
    assert_eq!(ol["imageLayoutVersion"], "1.0.0");
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let d = &index["manifests"][0];
    assert_eq!(
        d["annotations"]["org.opencontainers.image.ref.name"], "latest",
        "{index}"
    );
    let (mdigest, m) = layout_manifest(&layout);
    assert_eq!(st(&v, "manifest_digest"), mdigest);
    assert_eq!(m["schemaVersion"], 2);
    assert_eq!(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(
        m["artifactType"],
        "application/vnd.cncf.model.manifest.v1+json"
    );
    assert_eq!(
        m["config"]["mediaType"],
        "application/vnd.cncf.model.config.v1+json"
    );
    // Every blob is named by its sha256 and has the declared size.
    for (name, p) in walk(&layout.join("blobs/sha256")) {
        assert_eq!(
            sha256_file(&p),
            name,
            "blob {name} does not hash to its name"
        );
    }
    let files = walk(model);
    let mut seen = BTreeSet::new();
    for l in m["layers"].as_array().unwrap() {
        let path = l["annotations"][FILEPATH]
            .as_str()
            .expect("filepath annotation");
        assert!(seen.insert(path.to_string()), "{path} twice");
        let f = files
            .get(path)
            .unwrap_or_else(|| panic!("layer for {path}, not a file of the model"));
        let bytes = std::fs::read(f).unwrap();
        assert_eq!(
            l["digest"],
            format!("sha256:{}", sha256_hex(&bytes)),
            "{path}"
        );
        assert_eq!(l["size"], bytes.len() as u64, "{path}");
        assert_eq!(
            l["annotations"]["io.gdsllm.blake3"],
            blake3::hash(&bytes).to_hex().as_str(),
            "{path}"
        );
        let want = if path.ends_with(".json") || path == "manifest.gdsm" {
            WEIGHT_CONFIG_MT
        } else {
            WEIGHT_MT
        };
        assert_eq!(l["mediaType"], want, "{path}");
    }
    assert_eq!(
        seen,
        files.keys().cloned().collect::<BTreeSet<_>>(),
        "one layer per file"
    );

    // A model directory that does not validate is refused.
    let bad = env.path("bad/smollm2.gds");
    copy_dir(model, &bad);
    let victim = walk(&bad)
        .into_iter()
        .find(|(rel, _)| rel.starts_with("layers/"))
        .expect("a layer file")
        .1;
    let mut b = std::fs::read(&victim).unwrap();
    b[100] ^= 0x40;
    std::fs::write(&victim, b).unwrap();
    let o = env.run("gdsconv", &["pack", s(&bad), "-o", s(&env.path("bad.tar"))]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "pack of a corrupted model: {}",
        stderr(&o)
    );
    assert!(
        !env.path("bad.tar").exists(),
        "pack left a tar of a corrupted model"
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn skopeo_reads_and_writes_our_artifacts() {
    let reg = Registry::start();
    let env = Env::new();
    let model = smollm_converted();

    // skopeo pushes our tar; we pull it.
    let tar = env.path("model.tar");
    env.json(&["pack", s(model), "-o", s(&tar), "--tag", "v1"]);
    skopeo(&[
        "copy",
        "--dest-tls-verify=false",
        &format!("oci-archive:{}:v1", tar.display()),
        &format!("docker://{}", reg.reference("from-skopeo", "v1")),
    ]);
    let out = env.path("from-skopeo");
    env.pull(&reg.reference("from-skopeo", "v1"), &out);
    validate(&out);
    assert_same_tree(model, &out);

    // We push the directory, the tar and a layout directory: one manifest digest.
    let from_dir = env.push(model, &reg.reference("ours", "v1"));
    let from_tar = env.push(&tar, &reg.reference("ours-tar", "v1"));
    let ours = pack_layout(&env, model, "our-layout", "v1");
    let from_layout = env.push(&ours, &reg.reference("ours-layout", "v1"));
    for v in [&from_tar, &from_layout] {
        assert_eq!(v["manifest_digest"], from_dir["manifest_digest"], "{v}");
    }
    let out = env.path("from-tar");
    env.pull(&reg.reference("ours-tar", "v1"), &out);
    assert_same_tree(model, &out);

    // skopeo pulls what we pushed into an OCI layout: the same blobs, byte for byte.
    let sk = env.path("skopeo-layout");
    skopeo(&[
        "copy",
        "--src-tls-verify=false",
        &format!("docker://{}", reg.reference("ours", "v1")),
        &format!("oci:{}:v1", sk.display()),
    ]);
    let (a, b) = (
        walk(&ours.join("blobs/sha256")),
        walk(&sk.join("blobs/sha256")),
    );
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "skopeo's copy holds other blobs than our pack"
    );
    for (name, p) in &a {
        assert!(
            std::fs::read(p).unwrap() == std::fs::read(&b[name]).unwrap(),
            "blob {name} differs"
        );
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn interrupted_pull_and_push_resume() {
    let reg = Registry::start();
    let env = Env::new();
    let model = smollm_converted();
    let total = total_bytes(model);
    let r = reg.reference("smollm2", "latest");
    env.push(model, &r);

    // Pull at 20 MB/s, SIGKILLed once some megabytes are in the store.
    let out = env.path("pull/smollm2");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let store = env.store();
    kill_midway(
        env.command(
            "gdsconv",
            &[
                "pull",
                &r,
                s(&out),
                "--plain-http",
                "--limit-rate",
                "20000000",
            ],
        ),
        Duration::from_millis(1500),
        || dir_bytes(&store) > 8_000_000,
        "rate-limited pull",
    );
    assert!(!out.exists(), "a killed pull left {}", out.display());
    // its locked staging directory remains (a SIGKILL runs no clean-up): the next pull
    // into the same parent removes it, as its lock died with it
    let left = entries(out.parent().unwrap());
    assert!(
        left.len() == 1 && left[0].starts_with(".smollm2.tmp-"),
        "the killed pull left {left:?}"
    );
    let v = env.pull(&r, &out);
    let got = u(&v, "downloaded_bytes");
    assert!(
        got < total,
        "the resumed pull downloaded {got} bytes of {total}: nothing was kept: {v}"
    );
    assert_same_tree(model, &out);
    validate(&out);
    assert_store_consistent(&env.store());
    assert_eq!(
        entries(out.parent().unwrap()),
        vec!["smollm2".to_string()],
        "a staging directory of the killed pull remains beside the output"
    );

    // Push at 20 MB/s to a fresh repository of a fresh registry, SIGKILLed midway.
    let reg2 = Registry::start();
    let r2 = reg2.reference("smollm2", "latest");
    kill_midway(
        env.command(
            "gdsconv",
            &[
                "push",
                s(model),
                &r2,
                "--plain-http",
                "--limit-rate",
                "20000000",
            ],
        ),
        Duration::from_millis(1500),
        || reg2.blob_digests().len() >= 2,
        "rate-limited push",
    );
    let v = env.push(model, &r2);
    assert!(
        u(&v, "skipped_blobs") > 0,
        "the re-run uploaded everything: {v}"
    );
    assert!(
        u(&v, "uploaded_blobs") > 0,
        "the killed push had finished: {v}"
    );
    assert_eq!(
        u(&v, "uploaded_blobs") + u(&v, "skipped_blobs"),
        u(&v, "blobs"),
        "{v}"
    );
    let out2 = env.path("pull2");
    env.pull(&r2, &out2);
    assert_same_tree(model, &out2);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn retag_uploads_nothing_and_models_sharing_layers_share_blobs() {
    let reg = Registry::start();
    let env = Env::new();
    let a = smollm_converted();
    let pa = env.push(a, &reg.reference("smollm2", "v1"));
    let v = env.push(a, &reg.reference("smollm2", "v2"));
    assert_eq!(u(&v, "uploaded_blobs"), 0, "re-tag: {v}");
    assert_eq!(u(&v, "skipped_blobs"), u(&v, "blobs"), "re-tag: {v}");
    assert_eq!(st(&v, "manifest_digest"), st(&pa, "manifest_digest"));

    // Model B: the same GGUF with output_norm.weight scaled.
    let gguf_b = env.path("b.gguf");
    let o = Command::new("python3")
        .arg(root().join("tests/py/perturb_gguf.py"))
        .arg(smollm_gguf())
        .arg(&gguf_b)
        .output()
        .unwrap();
    ok(
        &o,
        "tests/py/perturb_gguf.py (needs pip install gguf==0.19.0 numpy)",
    );
    let b = env.path("b.gds");
    ok(
        &run("gdsconv", &["convert", s(&gguf_b), s(&b)]),
        "convert B",
    );
    std::fs::remove_file(&gguf_b).unwrap();
    let (fa, fb) = (walk(a), walk(&b));
    let differing: Vec<&String> = fa
        .keys()
        .filter(|k| std::fs::read(&fa[*k]).unwrap() != std::fs::read(&fb[*k]).unwrap())
        .collect();
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    assert_eq!(
        differing.len(),
        2,
        "B should differ in one layer file and manifest.gdsm: {differing:?}"
    );
    assert!(
        differing.iter().any(|f| *f == "manifest.gdsm"),
        "{differing:?}"
    );

    let (_, ma) = layout_manifest(&pack_layout(&env, a, "la", "v1"));
    let (_, mb) = layout_manifest(&pack_layout(&env, &b, "lb", "v1"));
    let (ba, bb) = (manifest_blobs(&ma), manifest_blobs(&mb));
    let new: BTreeSet<_> = bb.difference(&ba).cloned().collect();
    assert_eq!(
        new.len(),
        3,
        "B's new blobs should be the changed layer, manifest.gdsm and the config: {new:?}"
    );
    // Another repository, with --mount-from the base model's repository: only B's 3 new
    // blobs are uploaded, the rest are mounted (a registry answers "has this blob" per
    // repository, so without the mount all would be).
    let pc = env.json(&[
        "push",
        s(&b),
        &reg.reference("finetune", "v1"),
        "--plain-http",
        "--mount-from",
        "smollm2",
    ]);
    assert_eq!(u(&pc, "uploaded_blobs"), 3, "--mount-from: {pc}");
    assert_eq!(u(&pc, "mounted_blobs"), u(&pc, "blobs") - 3, "{pc}");
    // Same repository, another tag: a registry answers "has this blob" per repository (a
    // blob of another repository needs a cross-repository mount), so the shared layers are
    // found only here.
    let pb = env.push(&b, &reg.reference("smollm2", "b"));
    assert_eq!(
        u(&pb, "uploaded_blobs"),
        3,
        "B uploads only its 3 new blobs: {pb}"
    );
    assert_eq!(u(&pb, "skipped_blobs"), u(&pb, "blobs") - 3, "{pb}");
    assert_eq!(st(&pc, "manifest_digest"), st(&pb, "manifest_digest"));

    // Both pulled into one store: shared blobs are stored (and linked) once.
    let (oa, ob) = (env.path("pa"), env.path("pb"));
    let va = env.pull(&reg.reference("smollm2", "v1"), &oa);
    let vb = env.pull(&reg.reference("smollm2", "b"), &ob);
    assert_eq!(u(&va, "reused_blobs"), 0, "{va}");
    assert_eq!(u(&vb, "downloaded_blobs"), 3, "{vb}");
    assert_eq!(u(&vb, "reused_blobs"), u(&vb, "blobs") - 3, "{vb}");
    assert_same_tree(a, &oa);
    assert_same_tree(&b, &ob);
    validate(&ob);
    for rel in fa.keys() {
        let (m1, m2) = (
            oa.join(rel).metadata().unwrap(),
            ob.join(rel).metadata().unwrap(),
        );
        if differing.contains(&rel) {
            assert_ne!(m1.ino(), m2.ino(), "{rel} differs but shares an inode");
        } else {
            assert_eq!(
                (m1.dev(), m1.ino()),
                (m2.dev(), m2.ino()),
                "{rel} is stored twice"
            );
        }
    }
    let union: BTreeSet<String> = ba
        .union(&bb)
        .map(|d| d.strip_prefix("sha256:").unwrap().to_string())
        .collect();
    let stored = store_blobs(&env.store());
    for d in &union {
        let p = stored
            .get(d)
            .unwrap_or_else(|| panic!("sha256:{d} not in the store"));
        assert!(p.metadata().unwrap().nlink() >= 1);
    }
    let layer_bytes: u64 = stored
        .iter()
        .filter(|(h, _)| union.contains(*h))
        .map(|(_, p)| p.metadata().unwrap().len())
        .sum();
    let a_bytes = total_bytes(a);
    assert!(
        layer_bytes < a_bytes + a_bytes / 5,
        "the store holds {layer_bytes} bytes of blobs for two models of {a_bytes} bytes that share all but one layer"
    );
    assert_store_consistent(&env.store());
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_tampered_blob_in_the_registry_is_refused() {
    let reg = Registry::start();
    let env = Env::new();
    let model = smollm_converted();
    let r = reg.reference("smollm2", "latest");
    env.push(model, &r);
    let (_, m) = layout_manifest(&pack_layout(&env, model, "layout", "latest"));
    let layer = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["mediaType"] == WEIGHT_MT)
        .unwrap();
    let digest = layer["digest"].as_str().unwrap();
    let hex = digest.strip_prefix("sha256:").unwrap();
    let data = reg.blob_data_path(digest);
    let mut b = std::fs::read(&data).unwrap();
    let at = b.len() / 2;
    b[at] ^= 0x01;
    std::fs::write(&data, b).unwrap();

    let parent = env.path("parent");
    std::fs::create_dir_all(&parent).unwrap();
    let out = parent.join("smollm2");
    let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "pull of a tampered blob: {err}");
    assert!(
        err.contains(hex),
        "the error does not name the blob {digest}: {err}"
    );
    assert!(!out.exists(), "a failed pull left {}", out.display());
    assert_eq!(
        entries(&parent),
        Vec::<String>::new(),
        "a failed pull left files beside OUT_DIR"
    );
    assert_store_consistent(&env.store());
    assert!(
        !store_blobs(&env.store()).contains_key(hex),
        "the tampered blob is in the store under its digest"
    );
    // nor the blobs of the refused package fetched before it
    assert_eq!(
        store_blobs(&env.store()).keys().collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "a refused package's blobs stay in the store"
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn hostile_packages_are_refused() {
    let reg = Registry::start();
    let env = Env::new();
    // the tiny Llama 3: the forgeries are of the package, whatever the blobs' size
    let genuine = pack_layout(&env, tiny_converted(), "genuine", "latest");
    let escape = env.path("escape-target");
    let mut failures = Vec::new();
    for case in [
        "abs-path",
        "dotdot",
        "dup-path",
        "case-dup",
        "tar-layer",
        "symlink",
        "big-manifest",
        "big-config",
        "size-lie",
        "size-over",
        "size-under",
        "blake3-lie",
    ] {
        let layout = env.path(&format!("hostile-{case}"));
        let o = Command::new("python3")
            .arg(root().join("tests/py/hostile_oci.py"))
            .args([
                s(&genuine),
                s(&layout),
                case,
                "--tag",
                case,
                "--target",
                s(&escape),
            ])
            .output()
            .unwrap();
        ok(&o, &format!("tests/py/hostile_oci.py {case}"));
        let info: Value = serde_json::from_slice(&o.stdout).unwrap();
        let r = reg.reference("hostile", case);
        skopeo(&[
            "copy",
            "--dest-tls-verify=false",
            &format!("oci:{}:{case}", layout.display()),
            &format!("docker://{r}"),
        ]);
        std::fs::remove_dir_all(&layout).unwrap();

        let parent = env.path(&format!("pull-{case}"));
        std::fs::create_dir_all(&parent).unwrap();
        let out = parent.join("model");
        let t0 = Instant::now();
        let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http"]);
        let err = stderr(&o);
        let secs = t0.elapsed().as_secs_f64();
        // What the error must name.
        let filepath = info["filepath"].as_str().unwrap();
        let digest = info["digest"].as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let names: Vec<&str> = match case {
            "big-manifest" => vec!["manifest"],
            "big-config" => vec!["config"],
            _ => vec![filepath, hex],
        };
        let mut problems = Vec::new();
        if o.status.code() != Some(1) {
            problems.push(format!("exit {:?}, expected 1", o.status.code()));
        }
        if !names.iter().any(|n| err.contains(n)) {
            problems.push(format!("the error names none of {names:?}"));
        }
        if out.exists() {
            problems.push(format!("{} exists", out.display()));
        }
        if !entries(&parent).is_empty() {
            problems.push(format!("left beside OUT_DIR: {:?}", entries(&parent)));
        }
        if escape.exists() || std::fs::symlink_metadata(&escape).is_ok() {
            problems.push(format!("wrote {}", escape.display()));
            let _ = std::fs::remove_file(&escape);
        }
        if Path::new("/etc/x").exists() {
            problems.push("/etc/x exists".into());
        }
        if case == "dotdot" {
            // gdsrun resolving the reference refuses it the same way.
            let g = generate(&env, &r, &["--plain-http"]);
            if g.status.code() != Some(1) {
                problems.push(format!(
                    "gdsrun REF: exit {:?}, expected 1: {}",
                    g.status.code(),
                    stderr(&g).trim()
                ));
            }
        }
        if secs > 60.0 {
            problems.push(format!("took {secs:.0} s"));
        }
        eprintln!(
            "{case}: exit {:?} in {secs:.1} s: {}",
            o.status.code(),
            err.trim()
        );
        if !problems.is_empty() {
            failures.push(format!(
                "{case}: {}\n    stdout: {}\n    stderr: {}",
                problems.join("; "),
                stdout(&o).trim(),
                err.trim()
            ));
        }
    }
    assert_store_consistent(&env.store());
    assert!(
        failures.is_empty(),
        "hostile packages not refused as they should be:\n{}",
        failures.join("\n")
    );
}

/// Replaces files of the model packed in the OCI layout `layout` as a forger would: each new
/// file becomes a blob, and its layer's digest, size and `io.gdsllm.blake3`, the config's
/// `modelfs.diffIds`, the image manifest and `index.json` follow, so that the package is
/// self-consistent and only a check of the files' contents can refuse it.
fn forge_layout(layout: &Path, files: &[(&str, Vec<u8>)]) {
    let put = |bytes: &[u8]| put_blob(layout, bytes);
    let (_, mut m) = layout_manifest(layout);
    for (rel, bytes) in files {
        let l = m["layers"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|l| l["annotations"][FILEPATH] == *rel)
            .unwrap_or_else(|| panic!("no layer for {rel}"));
        l["digest"] = put(bytes).into();
        l["size"] = bytes.len().into();
        l["annotations"]["io.gdsllm.blake3"] = blake3::hash(bytes).to_hex().as_str().into();
    }
    restamp_layout(layout, m);
}

/// Writes `bytes` as a blob of the OCI layout `layout`: its digest.
fn put_blob(layout: &Path, bytes: &[u8]) -> String {
    let d = format!("sha256:{}", sha256_hex(bytes));
    std::fs::write(blob_path(layout, &d), bytes).unwrap();
    d
}

/// Makes the image manifest `m` (edited) the one `layout` holds, as a forger would: the
/// config's `modelfs.diffIds` follow its layers, and the manifest and `index.json` follow.
fn restamp_layout(layout: &Path, mut m: Value) {
    let put = |bytes: &[u8]| put_blob(layout, bytes);
    let cd = m["config"]["digest"].as_str().unwrap().to_string();
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(blob_path(layout, &cd)).unwrap()).unwrap();
    cfg["modelfs"]["diffIds"] = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].clone())
        .collect();
    let cfg = serde_json::to_vec(&cfg).unwrap();
    m["config"]["digest"] = put(&cfg).into();
    m["config"]["size"] = cfg.len().into();
    let mb = serde_json::to_vec(&m).unwrap();
    let md = put(&mb);
    let ip = layout.join("index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&ip).unwrap()).unwrap();
    index["manifests"][0]["digest"] = md.into();
    index["manifests"][0]["size"] = mb.len().into();
    std::fs::write(&ip, serde_json::to_vec(&index).unwrap()).unwrap();
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_package_whose_chat_template_is_hostile_is_refused() {
    // A chat template is code from the package: one that breaks the parser's bounds (30 000
    // chained `+`) or doubles a string until memory runs out. `pack` refuses such a model,
    // so the package is forged: the genuine one packed, then its tokenizer_config.json and
    // manifest.gdsm swapped for forged ones (re-hashed, re-sealed) and every digest made to
    // follow. A pull must refuse it (exit 1, naming tokenizer_config.json and the template's
    // problem) and keep nothing; `gdsrun REF` must not run it.
    let reg = Registry::start();
    let env = Env::new();
    // the tiny Llama 3 (it has a chat template to replace): the forgery is of the package
    let genuine = pack_layout(&env, tiny_converted(), "genuine", "latest");
    let cfg_path = tiny_converted().join("tokenizer_config.json");
    let cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    let cases = [
        (
            "operators",
            format!("{{{{ 1{} }}}}", " + 1".repeat(30_000)),
            "operators",
        ),
        (
            "doubling",
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}".to_string(),
            "MiB",
        ),
    ];
    for (case, template, problem) in cases {
        let model = env.path(&format!("forged-{case}"));
        copy_dir(tiny_converted(), &model);
        let mut c = cfg.clone();
        c["chat_template"] = template.into();
        forge_file(&model, "tokenizer_config.json", c.to_string().as_bytes());
        // The forgery is only the template: validate refuses the directory for it alone.
        let o = env.run("gdsconv", &["validate", s(&model)]);
        assert_eq!(o.status.code(), Some(1), "validate {case}: {}", stdout(&o));
        let layout = env.path(&format!("layout-{case}"));
        copy_dir(&genuine, &layout);
        forge_layout(
            &layout,
            &[
                (
                    "tokenizer_config.json",
                    std::fs::read(model.join("tokenizer_config.json")).unwrap(),
                ),
                (
                    "manifest.gdsm",
                    std::fs::read(model.join("manifest.gdsm")).unwrap(),
                ),
            ],
        );
        let r = reg.reference("hostile-template", case);
        skopeo(&[
            "copy",
            "--dest-tls-verify=false",
            &format!("oci:{}:latest", layout.display()),
            &format!("docker://{r}"),
        ]);

        let parent = env.path(&format!("pull-{case}"));
        std::fs::create_dir_all(&parent).unwrap();
        let out = parent.join("model");
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
            .arg(bin("gdsconv"))
            .args(["pull", &r, s(&out), "--plain-http"])
            .env("GDSLLM_HOME", env.home())
            .env("DOCKER_CONFIG", &env.docker_config);
        let what = format!("gdsconv pull of a package whose template does {case}");
        let o = output_within(c, Duration::from_secs(300), &what);
        let err = stderr(&o);
        eprintln!("{case}: pull exit {:?}: {}", o.status.code(), err.trim());
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        for w in ["tokenizer_config.json", "chat template", problem] {
            assert!(err.contains(w), "{what}: expected {w:?} in: {err}");
        }
        assert!(
            !err.contains(".tmp-"),
            "{what}: the error names the staging directory, which is gone: {err}"
        );
        assert!(!out.exists(), "{what}: {} exists", out.display());
        assert_eq!(
            entries(&parent),
            Vec::<String>::new(),
            "{what}: files left beside OUT_DIR"
        );
        // Into the store: `gdsrun REF` pulls it there first, and refuses it (exit 1).
        let g = generate(&env, &r, &["--plain-http"]);
        assert_eq!(
            g.status.code(),
            Some(1),
            "gdsrun REF of a package whose template does {case}: {}",
            stderr(&g)
        );
        assert!(
            stderr(&g).contains("tokenizer_config.json"),
            "gdsrun REF ({case}): {}",
            stderr(&g)
        );
        assert!(
            g.stdout.is_empty(),
            "gdsrun REF ({case}) generated: {}",
            stdout(&g)
        );
        let models = env.store().join("models");
        assert_eq!(
            entries(&models),
            Vec::<String>::new(),
            "a refused model is in the store"
        );
        let list = env.json(&["list"]);
        assert!(!list.to_string().contains(&r), "{r} is listed: {list}");
        assert_store_consistent(&env.store());
    }
    // Nothing is left in the store but verified blobs: no staging directory, no partial
    // download (the lock files of the partial/ directory aside).
    let partial = env.store().join("partial");
    let left: Vec<String> = entries(&partial)
        .into_iter()
        .filter(|n| !n.ends_with(".lock"))
        .collect();
    assert_eq!(left, Vec::<String>::new(), "left in {}", partial.display());
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn credentials_come_from_the_docker_config() {
    let reg = Registry::start_with_auth();
    let env = Env::new(); // empty DOCKER_CONFIG
    let model = tiny_converted(); // the credentials are the subject, not the blobs
    let r = reg.reference("private/tiny", "latest");

    let expect_401 = |o: &Output, what: &str| {
        let err = stderr(o);
        assert_eq!(o.status.code(), Some(3), "{what}: {err}");
        assert!(
            err.contains(&reg.host()) && err.contains("401"),
            "{what}: the error does not name {} and 401: {err}",
            reg.host()
        );
    };
    let o = env.run("gdsconv", &["push", s(model), &r, "--plain-http"]);
    expect_401(&o, "push without credentials");

    reg.write_docker_config(&env.docker_config, USER, "wrong-password");
    let o = env.run("gdsconv", &["push", s(model), &r, "--plain-http"]);
    expect_401(&o, "push with a wrong password");

    reg.write_docker_config(&env.docker_config, USER, PASSWORD);
    let v = env.push(model, &r);
    assert_eq!(u(&v, "uploaded_blobs"), u(&v, "blobs"), "{v}");
    let out = env.path("pulled");
    env.pull(&r, &out);
    assert_same_tree(model, &out);

    std::fs::remove_file(env.docker_config.join("config.json")).unwrap();
    let o = env.run(
        "gdsconv",
        &["pull", &r, s(&env.path("no-creds")), "--plain-http"],
    );
    expect_401(&o, "pull without credentials");
    assert!(!env.path("no-creds").exists());
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn registry_errors_exit_3() {
    let env = Env::new();
    // Nothing listens there.
    let port = gds_tests::registry::free_port();
    let r = format!("127.0.0.1:{port}/smollm2:latest");
    let o = env.run(
        "gdsconv",
        &["pull", &r, s(&env.path("out")), "--plain-http"],
    );
    assert_eq!(
        o.status.code(),
        Some(3),
        "pull from nowhere: {}",
        stderr(&o)
    );
    assert!(!env.path("out").exists());
    // gdsrun with a reference: its own code for registry errors, 5 (its 3 means CUDA).
    let o = generate(&env, &r, &["--plain-http"]);
    assert_eq!(
        o.status.code(),
        Some(5),
        "gdsrun REF from nowhere: {}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains(&format!("127.0.0.1:{port}")),
        "{}",
        stderr(&o)
    );
    // A tag the registry does not have.
    let reg = Registry::start();
    let o = env.run(
        "gdsconv",
        &[
            "pull",
            &reg.reference("nothing", "here"),
            s(&env.path("out")),
            "--plain-http",
        ],
    );
    assert_eq!(
        o.status.code(),
        Some(3),
        "pull of a missing tag: {}",
        stderr(&o)
    );
    assert!(!env.path("out").exists());
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gdsrun_pulls_a_reference_on_first_use_and_gc_removes_it() {
    let reg = Registry::start();
    let env = Env::new();
    let model = smollm_converted();
    let r = reg.reference("smollm2", "latest");
    let pushed = env.push(model, &r);

    let o = generate(&env, &r, &["--plain-http"]);
    ok(&o, "gdsrun REF");
    assert_eq!(stdout(&o), reference_text(), "gdsrun REF prints other text");

    let list = env.json(&["list"]);
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("list --json: {list}"));
    let item = items
        .iter()
        .find(|i| i["reference"].as_str().is_some_and(|x| x.contains(&r)))
        .unwrap_or_else(|| panic!("{r} not in gdsconv list: {list}"));
    assert_eq!(item["digest"], pushed["manifest_digest"], "{item}");
    assert!(u(item, "bytes") >= total_bytes(model), "{item}");
    let path = PathBuf::from(st(item, "path"));
    assert_same_tree(model, &path);

    // A second run uses the store, with the registry gone: same text, and the model's files
    // are the same inodes.
    let ino = path.join("manifest.gdsm").metadata().unwrap().ino();
    drop(reg);
    let o = generate(&env, &r, &["--plain-http"]);
    ok(&o, "gdsrun REF, second time");
    assert_eq!(stdout(&o), reference_text());
    assert_eq!(path.join("manifest.gdsm").metadata().unwrap().ino(), ino);

    let before = store_blobs(&env.store()).len();
    assert!(before >= walk(model).len());
    ok(&env.run("gdsconv", &["rm", &r]), "gdsconv rm");
    let list = env.json(&["list"]);
    assert!(
        !list.to_string().contains(&r),
        "{r} still listed after rm: {list}"
    );
    let gc = env.json(&["gc"]);
    assert!(u(&gc, "removed_models") >= 1, "{gc}");
    assert!(u(&gc, "removed_blobs") >= walk(model).len() as u64, "{gc}");
    assert!(u(&gc, "removed_bytes") >= total_bytes(model), "{gc}");
    let left = store_blobs(&env.store());
    assert!(left.is_empty(), "blobs left after rm + gc: {left:?}");
    assert!(
        dir_bytes(&env.store()) < 1 << 20,
        "the store still holds {} bytes",
        dir_bytes(&env.store())
    );
    let gc = env.json(&["gc"]);
    assert_eq!(u(&gc, "removed_blobs"), 0, "second gc: {gc}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gdsrun_converts_a_gguf_on_first_use_only() {
    let env = Env::new();
    let gguf = smollm_gguf();
    let manifests = || -> Vec<(PathBuf, u64, i64, i64)> {
        walk_files(&env.home())
            .into_values()
            .filter(|p| p.file_name().unwrap() == "manifest.gdsm")
            .map(|p| {
                let m = p.metadata().unwrap();
                (p, m.ino(), m.mtime(), m.mtime_nsec())
            })
            .collect()
    };
    let o = generate(&env, s(&gguf), &[]);
    ok(&o, "gdsrun MODEL.gguf");
    assert_eq!(
        stdout(&o),
        reference_text(),
        "gdsrun on the GGUF prints other text"
    );
    let first = manifests();
    assert_eq!(
        first.len(),
        1,
        "expected one converted model under GDSLLM_HOME {}: {first:?}",
        env.home().display()
    );
    validate(first[0].0.parent().unwrap());

    let o = generate(&env, s(&gguf), &[]);
    ok(&o, "gdsrun MODEL.gguf, second time");
    assert_eq!(stdout(&o), reference_text());
    assert_eq!(manifests(), first, "the second run converted again");
}

/// A hostile registry stand-in, `tests/py/hostile_oci.py serve MODE`, on 127.0.0.1; killed
/// on drop.
struct Hostile {
    child: std::process::Child,
    port: u16,
}

impl Hostile {
    fn start(mode: &str, flags: &[&str]) -> Hostile {
        let mut child = Command::new("python3")
            .arg(root().join("tests/py/hostile_oci.py"))
            .args(["serve", mode])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 tests/py/hostile_oci.py serve");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("hostile_oci.py serve {mode}: {e}: {line:?}"));
        Hostile {
            child,
            port: v["port"].as_u64().unwrap() as u16,
        }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "tier 2: needs the Python packages scripts/test.sh installs"]
fn hostile_registries_fail_the_pull_with_a_short_error() {
    // A registry answering with a 3 GiB error body or a 3 GiB manifest, one that trickles,
    // and one that stalls: each pull fails with one short error that names the registry and
    // the limit exceeded, under a 2 GiB address-space cap (reading a body whole aborts), and
    // a regression that waits for ever is killed by output_within and fails the test.
    let env = Env::new();
    type Case<'a> = (&'a str, &'a [&'a str], &'a [&'a str], i32, &'a [&'a str]);
    let cases: &[Case] = &[
        (
            "huge-error",
            &[],
            &[],
            3,
            &["HTTP 404", "NOT FOUND", "longer than 65536 bytes"],
        ),
        ("huge-manifest", &[], &[], 1, &["manifest", "2097152 bytes"]),
        (
            "huge-token",
            &[],
            &[],
            3,
            &["authenticating", "token", "1048576 bytes", "/token"],
        ),
        (
            "trickle",
            &["--interval", "1"],
            &["--min-rate", "100", "--min-rate-window", "2s"],
            3,
            &["--min-rate", "100 bytes/s"],
        ),
        (
            "trickle",
            &["--interval", "0.2"],
            &["--min-rate", "0", "--timeout", "3s"],
            3,
            &["--timeout of 3 s"],
        ),
        (
            "stall",
            &[],
            &["--min-rate-window", "2s"],
            3,
            &["--min-rate", "0 bytes in 2 s"],
        ),
        (
            "stall-body",
            &[],
            &["--min-rate-window", "2s"],
            3,
            &["--min-rate"],
        ),
        (
            "stall",
            &[],
            &["--min-rate", "0", "--timeout", "2"],
            3,
            &["--timeout of 2 s"],
        ),
    ];
    for (i, (mode, server, flags, code, words)) in cases.iter().enumerate() {
        let srv = Hostile::start(mode, server);
        let host = format!("127.0.0.1:{}", srv.port);
        let r = format!("{host}/hostile/model:latest");
        let out = env.path(&format!("out{i}"));
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("ulimit -v 2097152 && exec \"$0\" \"$@\"")
            .arg(bin("gdsconv"))
            .args(["pull", &r, s(&out), "--plain-http"])
            .args(*flags)
            .env("GDSLLM_HOME", env.home())
            .env("DOCKER_CONFIG", &env.docker_config);
        let what = format!("gdsconv pull from a registry that does {mode} {flags:?}");
        let o = output_within(c, Duration::from_secs(120), &what);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(*code), "{what}: {err}");
        assert!(
            err.len() < 2048,
            "{what}: {} bytes on stderr: {}",
            err.len(),
            &err[..err.len().min(4096)]
        );
        assert!(
            err.contains(&host),
            "{what}: the error does not name {host}: {err}"
        );
        for w in *words {
            assert!(err.contains(w), "{what}: expected {w:?} in: {err}");
        }
        assert!(
            !err.chars().any(|c| c.is_control() && c != '\n'),
            "{what}: control characters reach the terminal: {err:?}"
        );
        assert!(!out.exists(), "{what}: {} was created", out.display());
    }
}

/// Runs `c` (a built binary and its arguments) under a 2 GiB address-space limit, through a
/// small Python parent that reports the child's peak resident memory: (output, peak RSS in
/// KiB). Killed after `limit` like [`output_within`].
fn output_and_peak_rss(c: &Command, limit: Duration, what: &str) -> (Output, u64) {
    const WRAP: &str = r#"
import ctypes, resource, subprocess, sys
def limit():
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: dies with this parent
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
r = subprocess.run(sys.argv[1:], preexec_fn=limit)
sys.stderr.write("\npeak-rss-kib=%d\n" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(r.returncode if r.returncode >= 0 else 128 - r.returncode)
"#;
    let mut w = Command::new("python3");
    w.args(["-c", WRAP]).arg(c.get_program()).args(c.get_args());
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => w.env(k, v),
            None => w.env_remove(k),
        };
    }
    let mut o = output_within(w, limit, what);
    let err = stderr(&o);
    let (rest, rss) = err
        .trim_end()
        .rsplit_once("\npeak-rss-kib=")
        .unwrap_or_else(|| panic!("{what}: no peak RSS reported: {err}"));
    let rss = rss.parse().unwrap();
    o.stderr = rest.as_bytes().to_vec();
    (o, rss)
}

#[test]
#[ignore = "tier 2: needs the Python packages scripts/test.sh installs"]
fn hostile_registries_fail_the_push_with_a_short_error() {
    // A registry that answers a push's upload start, blob upload or manifest upload with a
    // 403 whose body is 3 GiB, or whose token service answers with 3 GiB: the push fails at
    // once with one short error naming the registry and the status or limit, having read at
    // most MAX_ERROR_BODY (MAX_TOKEN_BODY) of the body (a body read whole aborts under the
    // 2 GiB address-space cap, and shows in the peak RSS).
    let env = Env::new();
    let model = env.path("tiny");
    ok(
        &env.run(
            "gdsconv",
            &["convert", s(&fixture("tiny-llama.gguf")), s(&model)],
        ),
        "gdsconv convert tiny-llama.gguf",
    );
    let errors: &[&str] = &["HTTP 403", "NOT FOUND", "longer than 65536 bytes"];
    let cases: &[(&str, &[&str], &[&str])] = &[
        ("push-error", &["--at", "start"], errors),
        ("push-error", &["--at", "upload"], errors),
        ("push-error", &["--at", "manifest"], errors),
        (
            "huge-token",
            &[],
            &["authenticating for push", "1048576 bytes", "/token"],
        ),
    ];
    for (mode, flags, words) in cases {
        let srv = Hostile::start(mode, flags);
        let host = format!("127.0.0.1:{}", srv.port);
        let r = format!("{host}/hostile/model:latest");
        let mut c = env.command("gdsconv", &["push", s(&model), &r, "--plain-http"]);
        c.stdin(Stdio::null());
        let at = format!("{mode} {flags:?}");
        let what = format!("gdsconv push to a registry that does {at}");
        let (o, rss_kib) = output_and_peak_rss(&c, Duration::from_secs(120), &what);
        let err = stderr(&o);
        eprintln!(
            "{at}: exit {:?}, peak RSS {} MiB: {}",
            o.status.code(),
            rss_kib >> 10,
            err.trim()
        );
        assert_eq!(o.status.code(), Some(3), "{what}: {err}");
        assert!(
            err.len() < 2048,
            "{what}: {} bytes on stderr: {}",
            err.len(),
            &err[..err.len().min(4096)]
        );
        for w in std::iter::once(&host.as_str()).chain(words.iter()) {
            assert!(err.contains(w), "{what}: expected {w:?} in: {err}");
        }
        assert!(
            !err.chars().any(|c| c.is_control() && c != '\n'),
            "{what}: control characters reach the terminal: {err:?}"
        );
        assert!(
            rss_kib < 200 << 10,
            "{what}: peak RSS {} MiB (the error body was read whole?)",
            rss_kib >> 10
        );
    }
}

/// A staging directory as a killed pack, pull or conversion leaves it beside `out`: the lock
/// file nobody holds any more and a partial output (`model`, with a hard link of `blob` in
/// it when given).
fn dead_staging(out: &Path, blob: Option<&Path>) -> PathBuf {
    let name = out.file_name().unwrap().to_str().unwrap();
    let d = out.with_file_name(format!(".{name}.tmp-4000000000"));
    std::fs::create_dir_all(d.join("model/layers")).unwrap();
    std::fs::write(d.join(".gdsconv.lock"), "").unwrap();
    match blob {
        Some(b) => std::fs::hard_link(b, d.join("model/layers/blk.0000.bin")).unwrap(),
        None => std::fs::write(d.join("model/half.tar"), vec![0u8; 4096]).unwrap(),
    }
    d
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn pull_force_replaces_only_a_model_directory() {
    let reg = Registry::start();
    let env = Env::new();
    let model = tiny_converted();
    let r = reg.reference("tiny", "v1");
    env.push(model, &r);
    let force = |out: &str, cwd: Option<&Path>| {
        let mut c = env.command("gdsconv", &["pull", "--force", "--plain-http", &r, out]);
        if let Some(d) = cwd {
            c.current_dir(d);
        }
        c.output().unwrap()
    };

    // a directory of user files: refused (exit 2), the files listed and kept
    let v = env.path("v");
    std::fs::create_dir_all(v.join("sub")).unwrap();
    std::fs::write(v.join("precious.txt"), "precious").unwrap();
    let o = force(s(&v), None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("precious.txt") && err.contains("sub/") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(v.join("precious.txt")).unwrap(),
        "precious"
    );
    assert_eq!(entries(&v), ["precious.txt", "sub"]);
    // the store, the directory holding it, the current directory: refused, kept
    for d in [env.store(), env.home()] {
        let o = force(s(&d), None);
        assert_eq!(o.status.code(), Some(2), "{}: {}", d.display(), stderr(&o));
        assert!(stderr(&o).contains("the store"), "{}", stderr(&o));
        assert!(env.store().join("blobs/sha256").is_dir());
    }
    let o = force(".", Some(&v));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(entries(&v), ["precious.txt", "sub"]);
    // a pulled model is replaced, and nothing is left beside it
    let out = env.path("pulled/tiny");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    env.pull(&r, &out);
    let o = force(s(&out), None);
    ok(&o, "pull --force over a pulled model");
    assert_same_tree(model, &out);
    assert_eq!(entries(out.parent().unwrap()), ["tiny"]);
    // ... but not once a file of the user's is in it
    std::fs::write(out.join("notes.md"), "mine").unwrap();
    let o = force(s(&out), None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("notes.md"), "{}", stderr(&o));
    assert!(out.join("notes.md").exists());
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn a_killed_pull_or_packs_leftovers_are_removed_by_the_next_one() {
    let reg = Registry::start();
    let env = Env::new();
    let model = tiny_converted();
    let r = reg.reference("tiny", "v1");
    env.push(model, &r);
    let first = env.path("first");
    env.pull(&r, &first);
    // a killed pull's staging directory links a blob of the store, keeping it alive
    let (_, blob) = store_blobs(&env.store()).into_iter().next().unwrap();
    let out = env.path("pulled/tiny");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let dead = dead_staging(&out, Some(&blob));
    let links = blob.metadata().unwrap().nlink();
    let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http"]);
    ok(&o, "pull beside a killed pull's leftovers");
    assert!(
        !dead.exists(),
        "the killed pull's staging directory remains"
    );
    assert!(
        stderr(&o).contains(&format!("removed {}", dead.display())),
        "{}",
        stderr(&o)
    );
    // its link is gone (the new directory adds one of its own)
    assert_eq!(blob.metadata().unwrap().nlink(), links);
    assert_eq!(entries(out.parent().unwrap()), ["tiny"]);

    // pack -o and --layout: the same
    let tar = env.path("out/x.tar");
    std::fs::create_dir_all(tar.parent().unwrap()).unwrap();
    let dead_tar = dead_staging(&tar, None);
    let dead_lay = dead_staging(&env.path("out/lay"), None);
    env.json(&["pack", s(model), "-o", s(&tar)]);
    assert!(!dead_tar.exists() && !dead_lay.exists());
    env.json(&["pack", s(model), "--layout", s(&env.path("out/lay"))]);
    assert_eq!(entries(&env.path("out")), ["lay", "x.tar"]);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn pack_refuses_to_overwrite_a_directory_without_mentioning_force() {
    let env = Env::new();
    let model = tiny_converted();
    let lay = env.path("lay");
    std::fs::create_dir_all(&lay).unwrap();
    std::fs::write(lay.join("mine.txt"), "mine").unwrap();
    let o = env.run("gdsconv", &["pack", s(model), "--layout", s(&lay)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    assert!(
        !stderr(&o).contains("--force"),
        "pack has no --force: {}",
        stderr(&o)
    );
    // -o naming a directory: refused, the directory kept
    let o = env.run("gdsconv", &["pack", s(model), "-o", s(&lay)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("is a directory"), "{}", stderr(&o));
    assert_eq!(entries(&lay), ["mine.txt"]);
    // -o over a file replaces it (a re-pack), nothing left beside it
    let tar = env.path("x.tar");
    std::fs::write(&tar, "old").unwrap();
    env.json(&["pack", s(model), "-o", s(&tar)]);
    assert!(tar.metadata().unwrap().len() > 4096);
    assert_eq!(
        entries(env.tmp.path()),
        ["docker-config", "home", "lay", "x.tar"]
    );
}

/// The tiny model packed as a layout in `env`, its image manifest edited by `edit`
/// ([`restamp_layout`]) and pushed with skopeo to `reg` as `forged:TAG`: the reference.
fn push_forged(
    env: &Env,
    reg: &Registry,
    tag: &str,
    edit: impl FnOnce(&Path, &mut Value),
) -> String {
    let layout = pack_layout(env, tiny_converted(), &format!("forged-{tag}"), tag);
    let (_, mut m) = layout_manifest(&layout);
    edit(&layout, &mut m);
    restamp_layout(&layout, m);
    let r = reg.reference("forged", tag);
    skopeo(&[
        "copy",
        "--dest-tls-verify=false",
        &format!("oci:{}:{tag}", layout.display()),
        &format!("docker://{r}"),
    ]);
    r
}

/// The layer of `m` that ships `path`.
fn layer_of<'a>(m: &'a mut Value, path: &str) -> &'a mut Value {
    m["layers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|l| l["annotations"][FILEPATH] == path)
        .unwrap_or_else(|| panic!("no layer ships {path}"))
}

/// Asserts a refused pull into `parent/model`: exit 1, the error naming each of `names`,
/// nothing in `parent`, and no model, blob or partial download left in the store.
fn assert_refused_cleanly(o: &Output, parent: &Path, names: &[&str], what: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{what}: {err}");
    for n in names {
        assert!(
            err.contains(n),
            "{what}: the error does not name {n}: {err}"
        );
    }
    assert_eq!(
        entries(parent),
        Vec::<String>::new(),
        "{what}: left in {}",
        parent.display()
    );
    let store = parent.parent().unwrap().join("home/store");
    assert_eq!(
        entries(&store.join("models")),
        Vec::<String>::new(),
        "{what}"
    );
    assert_eq!(
        store_blobs(&store).keys().collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "{what}: blobs left in the store"
    );
    // (gdsrun's lock file of the model may stay: gc removes it)
    let partial: Vec<String> = entries(&store.join("partial"))
        .into_iter()
        .filter(|n| !n.ends_with(".lock"))
        .collect();
    assert_eq!(
        partial,
        Vec::<String>::new(),
        "{what}: partial downloads left"
    );
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn layers_sharing_a_blob_are_each_checked() {
    // blk.0001.bin's layer points at blk.0000.bin's blob, and declares its own file's BLAKE3:
    // only the first of two layers with one digest was checked, the second hard-linked
    let reg = Registry::start();
    let env = Env::new();
    let r = push_forged(&env, &reg, "dup", |_, m| {
        let (d, n) = {
            let a = layer_of(m, "layers/blk.0000.bin");
            (a["digest"].clone(), a["size"].clone())
        };
        let b = layer_of(m, "layers/blk.0001.bin");
        b["digest"] = d;
        b["size"] = n;
    });
    let parent = env.path("pull");
    std::fs::create_dir_all(&parent).unwrap();
    let o = env.run(
        "gdsconv",
        &["pull", &r, s(&parent.join("model")), "--plain-http"],
    );
    assert_refused_cleanly(&o, &parent, &["layers/blk.0001.bin"], "pull");
    let g = generate(&env, &r, &["--plain-http"]);
    assert_eq!(g.status.code(), Some(1), "gdsrun REF: {}", stderr(&g));
    assert!(env
        .store()
        .join("refs")
        .read_dir()
        .unwrap()
        .next()
        .is_none());
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn a_store_blob_changed_in_place_is_fetched_again() {
    // a pulled directory's files are hard links of the store's blobs: one edited in place
    // (the same size) must not be linked into the next model
    let reg = Registry::start();
    let env = Env::new();
    let model = tiny_converted();
    let r = reg.reference("tiny", "v1");
    env.push(model, &r);
    let first = env.path("first");
    env.pull(&r, &first);
    let f = first.join("layers/blk.0000.bin");
    let mut perm = f.metadata().unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o644);
    std::fs::set_permissions(&f, perm).unwrap();
    let mut b = std::fs::read(&f).unwrap();
    b[100] ^= 0x5a;
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::OpenOptions::new().write(true).open(&f).unwrap(),
        &b,
        0,
    )
    .unwrap();
    let second = env.path("second");
    let v = env.pull(&r, &second);
    assert_eq!(u(&v, "downloaded_blobs"), 1, "{v}");
    assert_same_tree(model, &second);
    validate(&second);
    assert_store_consistent(&env.store());
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn push_refuses_a_layout_blob_that_is_not_its_digest() {
    let reg = Registry::start();
    let env = Env::new();
    let layout = pack_layout(&env, tiny_converted(), "layout", "v1");
    let (_, m) = layout_manifest(&layout);
    let d = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["mediaType"] == WEIGHT_MT)
        .unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let p = blob_path(&layout, &d);
    let mut b = std::fs::read(&p).unwrap();
    b[10] ^= 1;
    std::fs::write(&p, b).unwrap();
    let r = reg.reference("tiny", "v1");
    let o = env.run("gdsconv", &["push", s(&layout), &r, "--plain-http"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(s(&p)) && err.contains("does not match its digest"),
        "{err}"
    );
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn a_pull_flushes_one_blob_at_a_time() {
    // every download's flush thread was joined only at the end: with 768 MiB thread stacks
    // (RUST_MIN_STACK) under a 2 GiB address-space cap, the third failed to spawn (panic,
    // exit 101), as a package of 4000 layers did with the default stacks
    let reg = Registry::start();
    let env = Env::new();
    let r = reg.reference("tiny", "v1");
    env.push(tiny_converted(), &r);
    let out = env.path("out");
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("ulimit -v 2097152 && exec \"$0\" \"$@\"")
        .arg(bin("gdsconv"))
        .args(["pull", &r, s(&out), "--plain-http"])
        .env("GDSLLM_HOME", env.home())
        .env("DOCKER_CONFIG", &env.docker_config)
        .env("RUST_MIN_STACK", (768u64 << 20).to_string())
        .env("RAYON_NUM_THREADS", "1");
    let o = output_within(c, Duration::from_secs(60), "gdsconv pull under 2 GiB");
    ok(
        &o,
        "gdsconv pull with 768 MiB thread stacks under a 2 GiB address-space cap",
    );
    assert!(
        walk(&out).len() >= 4,
        "too few files to tell: {:?}",
        walk(&out).keys()
    );
    assert_same_tree(tiny_converted(), &out);
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn a_refused_package_leaves_nothing_in_the_store() {
    // a package shipping a file its model manifest does not list: refused once the model
    // manifest is in, before the rest is fetched, and what it brought into the store goes
    let reg = Registry::start();
    let env = Env::new();
    let junk: Vec<u8> = (0..(4u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let r = push_forged(&env, &reg, "junk", |layout, m| {
        let d = put_blob(layout, &junk);
        m["layers"].as_array_mut().unwrap().push(serde_json::json!({
            "mediaType": "application/vnd.cncf.model.doc.v1.raw",
            "digest": d,
            "size": junk.len(),
            "annotations": {
                FILEPATH: "junk.txt",
                "org.opencontainers.image.title": "junk.txt",
                "io.gdsllm.blake3": blake3::hash(&junk).to_hex().as_str(),
            },
        }));
    });
    let parent = env.path("pull");
    std::fs::create_dir_all(&parent).unwrap();
    let o = env.run(
        "gdsconv",
        &["pull", &r, s(&parent.join("model")), "--plain-http"],
    );
    assert_refused_cleanly(&o, &parent, &["junk.txt", "does not list"], "pull");
    // gdsrun REF: the same
    let g = generate(&env, &r, &["--plain-http"]);
    assert_eq!(g.status.code(), Some(1), "gdsrun REF: {}", stderr(&g));
    assert_refused_cleanly(&o, &parent, &["junk.txt"], "after gdsrun REF");
}

#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn a_bad_partial_download_is_fetched_again_from_the_start() {
    // a flaky mirror left half a blob whose first byte is wrong: the next pull, from an
    // honest registry, resumes it, finds the digest wrong, and fetches it again from 0
    // rather than calling the blob tampered (exit 1) for ever
    let reg = Registry::start();
    let env = Env::new();
    let model = tiny_converted();
    let r = reg.reference("tiny", "v1");
    env.push(model, &r);
    let bytes = std::fs::read(model.join("layers/blk.0000.bin")).unwrap();
    let hex = sha256_hex(&bytes);
    let mut half = bytes[..bytes.len() / 2].to_vec();
    half[0] ^= 0xff;
    std::fs::create_dir_all(env.store().join("partial")).unwrap();
    std::fs::write(env.store().join(format!("partial/{hex}.partial")), half).unwrap();
    let out = env.path("out");
    let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http", "--json"]);
    ok(&o, "pull over a bad partial download");
    assert!(stderr(&o).contains("from the start"), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(u(&v, "resumed_bytes"), 0, "{v}");
    assert_same_tree(model, &out);
    assert_store_consistent(&env.store());
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn pack_refuses_an_output_that_is_not_a_regular_file() {
    // -o naming a FIFO (or /dev/null): renamed over, it became a regular file
    let env = Env::new();
    let fifo = env.path("fifo");
    let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(st.success());
    let o = env.run("gdsconv", &["pack", s(tiny_converted()), "-o", s(&fifo)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("not a regular file"), "{}", stderr(&o));
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(entries(env.tmp.path()), ["docker-config", "fifo", "home"]);
}

/// Pushes `files` to `reg` as another tool lays its model out (tests/py/foreign_oci.py
/// KIND): the reference.
fn push_foreign(reg: &Registry, repo: &str, kind: &str, files: &[&Path]) -> String {
    let o = Command::new("python3")
        .arg(root().join("tests/py/foreign_oci.py"))
        .args([&reg.host(), repo, "v1", kind])
        .args(files)
        .output()
        .unwrap();
    ok(&o, &format!("tests/py/foreign_oci.py {kind}"));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["reference"].as_str().unwrap().to_string()
}

/// The files of a converted model that carry its content: every layer file and the
/// tokenizer files, by path (the manifest also records the input's file name).
fn model_content(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    walk_files(dir)
        .into_iter()
        .filter(|(k, _)| k != "manifest.gdsm")
        .map(|(k, p)| (k, std::fs::read(p).unwrap()))
        .collect()
}

/// Models other tools publish (Docker Model Runner's artifacts, GGUF split or whole, with
/// and without file annotations, a Hugging Face directory layer by layer and with its config
/// files in a tar; a modctl ModelPack of a Hugging Face directory; Ollama's Docker v2
/// manifest with its Go template, parameters and license): `gdsconv pull REF OUT` converts
/// each into the model `gdsconv convert` makes of the same files, `gdsrun REF` runs it
/// (the same greedy text) from the store, keeping only the converted model there; what
/// cannot be run (a LoRA adapter, an archived layer, a diffusion model, a truncated GGUF) is
/// refused by name, exit 1, nothing left.
#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn other_tools_models_pull_convert_and_run() {
    let reg = Registry::start();
    let env = Env::new();
    let fx = |p: &str| gds_tests::fixture(p);
    let gguf = fx("tiny-llama.gguf");
    let hf = fx("tiny-llama-hf");
    let shards: Vec<PathBuf> = (1..=4)
        .map(|i| fx(&format!("split/tiny-llama-{i:05}-of-00004.gguf")))
        .collect();
    let license = env.path("LICENSE");
    std::fs::write(&license, "Apache-2.0\n").unwrap();
    let convert = |input: &Path, name: &str| {
        let out = env.path(name);
        ok(
            &env.run("gdsconv", &["convert", s(input), s(&out)]),
            "gdsconv convert",
        );
        out
    };
    let from_gguf = convert(&gguf, "conv-gguf");
    let from_hf = convert(&hf, "conv-hf");
    // Docker Model Runner's chat template layer: the model's template, as
    // `gdsconv convert --chat-template-file` makes it
    let template = env.path("template.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ",
    )
    .unwrap();
    let from_templated = env.path("conv-templated");
    ok(
        &env.run(
            "gdsconv",
            &[
                "convert",
                s(&gguf),
                s(&from_templated),
                "--chat-template-file",
                s(&template),
            ],
        ),
        "gdsconv convert --chat-template-file",
    );
    let text = |model: &str| {
        let o = generate(&env, model, &["--plain-http"]);
        ok(&o, &format!("gdsrun {model}"));
        stdout(&o)
    };
    let gguf_text = text(s(&from_gguf));
    let hf_text = text(s(&from_hf));
    let templated_text = text(s(&from_templated));
    let tc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(from_templated.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        tc["chat_template"].as_str(),
        Some(std::fs::read_to_string(&template).unwrap().as_str())
    );
    assert!(!gguf_text.trim().is_empty() && !hf_text.trim().is_empty());

    let mut shard_args: Vec<&Path> = shards.iter().map(PathBuf::as_path).collect();
    shard_args.push(&license);
    let cases: Vec<(&str, Vec<&Path>, &Path, &str)> = vec![
        ("dmr-gguf", vec![&gguf, &license], &from_gguf, &gguf_text),
        ("dmr-gguf", shard_args.clone(), &from_gguf, &gguf_text),
        ("dmr-gguf-bare", shard_args.clone(), &from_gguf, &gguf_text),
        ("dmr-dir", vec![&hf], &from_hf, &hf_text),
        ("dmr-config-tar", vec![&hf], &from_hf, &hf_text),
        ("modelpack", vec![&hf], &from_hf, &hf_text),
        ("ollama", vec![&gguf], &from_gguf, &gguf_text),
        (
            "dmr-gguf",
            vec![&gguf, &license, &template],
            &from_templated,
            &templated_text,
        ),
    ];
    for (i, (kind, files, want, want_text)) in cases.into_iter().enumerate() {
        let r = push_foreign(&reg, &format!("foreign/{kind}-{i}"), kind, &files);
        let out = env.path(&format!("pulled-{i}"));
        let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http"]);
        ok(&o, &format!("gdsconv pull of {kind} ({i})"));
        validate(&out);
        let mut got = model_content(&out);
        if kind == "ollama" {
            // Ollama's parameters, the model's recommended sampling; num_ctx left out, said
            let g = got
                .remove("generation_config.json")
                .expect("Ollama's parameters");
            let g: serde_json::Value = serde_json::from_slice(&g).unwrap();
            assert_eq!(
                g,
                serde_json::json!({"stop_strings": ["<|im_end|>"], "temperature": 0.7,
                    "max_new_tokens": 64}),
            );
            assert!(
                stderr(&o).contains("left out: num_ctx 8192"),
                "{}",
                stderr(&o)
            );
        }
        assert!(
            got == model_content(want),
            "{kind} ({i}): not the model gdsconv convert makes of its files"
        );
        assert_eq!(text(&r), *want_text, "gdsrun {r} ({kind})");
    }
    // the store keeps the converted models, not the other tools' files
    let blobs = store_blobs(&env.store());
    for f in [&gguf, &shards[1]] {
        let d = format!("sha256:{}", sha256_file(f));
        assert!(
            !blobs.contains_key(&d),
            "{} is still in the store",
            f.display()
        );
    }
    assert_store_consistent(&env.store());

    // a damaged GGUF: the conversion's error, naming the file in the artifact
    let truncated = env.path("truncated.gguf");
    std::fs::write(&truncated, &std::fs::read(&gguf).unwrap()[..5000]).unwrap();
    for (kind, files, names) in [
        ("ollama-adapter", vec![gguf.as_path()], "LoRA adapter"),
        ("modelpack-tar", vec![hf.as_path()], "archived layer"),
        ("dmr-dduf", vec![gguf.as_path()], "diffusion model"),
        (
            "dmr-gguf",
            vec![truncated.as_path()],
            "model.gguf: truncated",
        ),
    ] {
        let r = push_foreign(&reg, &format!("refused/{kind}"), kind, &files);
        let out = env.path(&format!("refused-{kind}"));
        let o = env.run("gdsconv", &["pull", &r, s(&out), "--plain-http"]);
        assert_eq!(o.status.code(), Some(1), "{kind}: {}", stderr(&o));
        assert!(stderr(&o).contains(names), "{kind}: {}", stderr(&o));
        assert!(!out.exists(), "{kind}: {} exists", out.display());
        let g = generate(&env, &r, &["--plain-http"]);
        assert_eq!(g.status.code(), Some(1), "gdsrun {kind}: {}", stderr(&g));
    }
    assert_store_consistent(&env.store());
}

/// `gdsconv push FILE.gguf REF` (and `pack FILE.gguf`) publish the GGUF itself as a ModelPack
/// artifact of the kind other tools read (one raw weight layer per file named by
/// `org.cncf.model.filepath`, `config.format` `gguf`; a split GGUF's every shard): skopeo
/// reads the manifest, `gdsconv pull` and `gdsrun REF` convert it as the file converts, and a
/// second `pack` gives the same bytes.
#[test]
#[ignore = "tier 2: needs docker-registry and skopeo (scripts/test.sh)"]
fn a_gguf_is_published_as_a_modelpack_artifact() {
    let reg = Registry::start();
    let env = Env::new();
    let gguf = gds_tests::fixture("tiny-llama.gguf");
    let first = gds_tests::fixture("split/tiny-llama-00001-of-00004.gguf");
    let conv = env.path("conv");
    ok(
        &env.run("gdsconv", &["convert", s(&gguf), s(&conv)]),
        "gdsconv convert",
    );
    for (i, (file, layers)) in [(&gguf, 1), (&first, 4)].into_iter().enumerate() {
        let r = reg.reference("gguf", &format!("v{i}"));
        env.push(file, &r);
        let o = Command::new("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false"])
            .arg(format!("docker://{r}"))
            .output()
            .unwrap();
        ok(&o, "skopeo inspect");
        let m: Value = serde_json::from_slice(&o.stdout).unwrap();
        let ls = m["layers"].as_array().unwrap();
        assert_eq!(ls.len(), layers, "{m}");
        assert!(ls.iter().all(|l| l["mediaType"] == WEIGHT_MT
            && l["annotations"][FILEPATH]
                .as_str()
                .unwrap()
                .ends_with(".gguf")));
        assert_eq!(
            m["artifactType"],
            "application/vnd.cncf.model.manifest.v1+json"
        );
        let out = env.path(&format!("pulled-{i}"));
        env.pull(&r, &out);
        assert!(model_content(&out) == model_content(&conv), "{r}");
        let g = generate(&env, &r, &["--plain-http"]);
        ok(&g, &format!("gdsrun {r}"));
    }
    let tar = |n: &str| {
        let t = env.path(n);
        ok(
            &env.run("gdsconv", &["pack", s(&first), "-o", s(&t)]),
            "gdsconv pack",
        );
        std::fs::read(t).unwrap()
    };
    assert!(
        tar("a.tar") == tar("b.tar"),
        "pack of a GGUF is deterministic"
    );
}
