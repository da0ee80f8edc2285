//! Shared helpers for the end-to-end tests in `tests/e2e/`: paths of the built binaries, the
//! fixtures, and the real model (fetched into `.cache/` by `scripts/fetch-model.sh`).

pub mod caches;
pub mod registry;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A built workspace binary (`gdsconv`, `gdsrun`), from the same profile as the tests.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/test-xxxx -> target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(p.exists(), "{} not built: run `cargo build --workspace` (cargo test builds it when the test target depends on it)", p.display());
    p
}

/// Runs a binary with arguments and returns its output.
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name)).args(args).output().expect("spawn")
}

/// The real SmolLM2 GGUF; panics with instructions when it has not been fetched.
pub fn smollm_gguf() -> PathBuf {
    let p = root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-model.sh (the test command in README.md does)",
        p.display()
    );
    p
}

/// The real Gemma 3 270M Q4_K_M GGUF (scripts/fetch-gemma.sh).
pub fn gemma_gguf() -> PathBuf {
    let p = root().join(".cache/models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-gemma.sh (the test command in README.md does)",
        p.display()
    );
    p
}

/// Where the real models converted by the tests live: `target/test-models/<key>/`, shared
/// by every test binary of the run and kept across runs while the key holds. The key hashes
/// the sources of the converter (`gds-convert`, `gds-format`) and `Cargo.lock`, so a changed
/// converter converts again; directories of other keys are removed when a new key is first
/// used. (Each test binary used to convert SmolLM2 and Gemma 3 for itself: ~20 and ~8
/// conversions a run.)
fn models_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = root().join("target/test-models");
        let dir = base.join(format!("{:016x}", converter_key()));
        if !dir.exists() {
            std::fs::create_dir_all(&base).expect("create target/test-models");
            let _lock = lock(&base);
            if let Ok(entries) = std::fs::read_dir(&base) {
                for e in entries.flatten() {
                    let p = e.path();
                    if p.is_dir() && p != dir {
                        let _ = std::fs::remove_dir_all(&p);
                    }
                }
            }
            std::fs::create_dir_all(&dir).expect("create the test models directory");
        }
        dir
    })
}

/// FNV-1a over the converter's sources (paths and contents, in path order) and Cargo.lock.
fn converter_key() -> u64 {
    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir)
            .expect("read source directory")
            .flatten()
        {
            let p = e.path();
            if p.is_dir() {
                files(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut all = vec![root().join("Cargo.lock")];
    for c in ["gds-convert", "gds-format"] {
        files(&root().join("crates").join(c).join("src"), &mut all);
    }
    all.sort();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in &all {
        let bytes = std::fs::read(p).expect("read a converter source file");
        for b in p.to_string_lossy().bytes().chain(bytes) {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// An exclusive `flock` on `dir/.lock`, held until the returned file is dropped: test
/// binaries run at the same time (e.g. by nextest) convert one after another.
fn lock(dir: &Path) -> std::fs::File {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))
        .expect("open the test models lock");
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)
        .expect("lock the test models directory");
    f
}

/// `gguf` converted (default options) into `name` under [`models_dir`], once for all test
/// binaries (the converter renames a finished model into place, so an existing directory is
/// complete).
fn convert_once(gguf: &Path, name: &str) -> PathBuf {
    let out = models_dir().join(name);
    let _lock = lock(models_dir());
    if out.join("manifest.gdsm").is_file() {
        return out;
    }
    convert_default(gguf, &out);
    out
}

/// `input` converted into `out` with the default options (as `gdsconv convert INPUT OUT`);
/// a failure panics naming the input.
pub fn convert_default(input: &Path, out: &Path) {
    gds_convert::convert(
        input,
        out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .unwrap_or_else(|e| panic!("convert {}: {e}", input.display()));
}

/// Gemma 3 270M, converted once (see [`models_dir`]).
pub fn gemma_converted() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| convert_once(&gemma_gguf(), "gemma3.gds"))
}

/// Every tensor of a converted model directory: name to (dtype, bytes as stored).
pub fn tensor_bytes(
    dir: &Path,
) -> std::collections::BTreeMap<String, (gds_format::DType, Vec<u8>)> {
    let mbytes = std::fs::read(dir.join(gds_format::MANIFEST_FILE)).unwrap();
    let m = gds_format::Manifest::parse(&mbytes).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for t in m.tensors() {
        let data = std::fs::read(dir.join(m.layer(t.layer).unwrap().file)).unwrap();
        let bytes = data[t.offset as usize..(t.offset + t.nbytes) as usize].to_vec();
        out.insert(t.name.to_string(), (t.dtype, bytes));
    }
    out
}

/// A fixture file or directory under `fixtures/`.
pub fn fixture(rel: &str) -> PathBuf {
    root().join("fixtures").join(rel)
}

/// `fixtures/<input>` converted (default options) into a temporary directory, kept while the
/// guard lives.
pub fn converted_fixture(input: &str) -> (tempfile::TempDir, PathBuf) {
    converted_fixture_with(input, &[])
}

/// [`converted_fixture`] of a checkpoint directory with `files` (name, text) written over its
/// own first (a copy: the fixture stays as it is).
pub fn converted_fixture_with(input: &str, files: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m.gds");
    let src = if files.is_empty() {
        fixture(input)
    } else {
        let src = tmp.path().join("src");
        copy_dir(&fixture(input), &src);
        for (name, text) in files {
            std::fs::write(src.join(name), text).unwrap();
        }
        src
    };
    convert_default(&src, &dir);
    (tmp, dir)
}

/// `fixtures/<gguf>` with one more key/value (`tests/py/gguf_add_key.py`, gguf-py's writer:
/// `ty` is `uint32`, `int32`, `float32`, `bool` or `string`), converted (default options)
/// into a temporary directory. Needs python3 with gguf-py (tier 2).
pub fn converted_gguf_with_key(
    gguf: &str,
    key: &str,
    ty: &str,
    value: &str,
) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let with = tmp.path().join("with-key.gguf");
    let st = std::process::Command::new("python3")
        .arg(root().join("tests/py/gguf_add_key.py"))
        .arg(fixture(gguf))
        .arg(&with)
        .args([key, ty, value])
        .status()
        .expect("python3 runs");
    assert!(st.success(), "gguf_add_key.py {key}");
    let dir = tmp.path().join("m.gds");
    convert_default(&with, &dir);
    (tmp, dir)
}

/// stdout as a string.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as a string.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// SmolLM2, converted once (default options; see [`models_dir`]). Every test that needs the
/// real model shares it: copy it ([`copy_dir`]) before changing anything.
pub fn smollm_converted() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| convert_once(&smollm_gguf(), "smollm2.gds"))
}

/// The tiny Llama 3 of `fixtures/tiny-llama3-hf` (random weights made by transformers, 183 KB,
/// with a tokenizer and a chat template), converted once (see [`models_dir`]): for the
/// distribution tests whose subject is the protocol or the package, not the size of the
/// blobs (those use SmolLM2).
pub fn tiny_converted() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| convert_once(&fixture("tiny-llama3-hf"), "tiny-llama3.gds"))
}

/// Copies a directory tree (a converted model) to `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("create directory");
    for e in std::fs::read_dir(src).expect("read directory") {
        let e = e.expect("directory entry");
        if e.file_type().expect("file type").is_dir() {
            copy_dir(&e.path(), &dst.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), dst.join(e.file_name())).expect("copy file");
        }
    }
}

/// SmolLM2 dequantized by gguf-py into a Hugging Face directory of F16 safetensors (cached in
/// `.cache/smollm2-hf-f16`; `scripts/smollm_to_hf.py` makes it, needing the Python packages
/// gguf, numpy, safetensors and tokenizers that the test command installs).
pub fn smollm_hf_f16() -> PathBuf {
    let dir = root().join(".cache/smollm2-hf-f16");
    let st = Command::new("python3")
        .arg(root().join("scripts/smollm_to_hf.py"))
        .arg(&dir)
        .args(["--dtype", "f16", "--gguf"])
        .arg(smollm_gguf())
        .status()
        .expect("python3");
    assert!(
        st.success(),
        "scripts/smollm_to_hf.py failed (needs: pip install gguf numpy safetensors tokenizers)"
    );
    dir
}

/// What transformers computed for a tiny fixture (`fixtures/tiny-<arch>-hf/<file>`, e.g.
/// `golden.json`; fixtures/make_arch_fixtures.py): the prompt's tokens, the float32 logits at
/// every position, and the greedy token there.
pub struct Golden {
    /// The prompt.
    pub tokens: Vec<u32>,
    /// Logits per position (rounded to 6 significant digits).
    pub logits: Vec<Vec<f64>>,
    /// Greedy token per position.
    pub argmax: Vec<u64>,
}

/// Reads the golden file `file` of the tiny fixture `arch`.
pub fn golden(arch: &str, file: &str) -> Golden {
    let path = fixture(&format!("tiny-{arch}-hf/{file}"));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("golden file")).expect("golden JSON");
    let nums = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|x| x.as_f64().expect("a number"))
            .collect()
    };
    Golden {
        tokens: nums(&v["tokens"]).into_iter().map(|t| t as u32).collect(),
        logits: v["logits"]
            .as_array()
            .expect("logits")
            .iter()
            .map(nums)
            .collect(),
        argmax: nums(&v["argmax"]).into_iter().map(|t| t as u64).collect(),
    }
}

impl Golden {
    /// Compares `rows`, the logits at positions `first..`, with the golden ones: panics
    /// naming `what` and the position where the vocabulary or the greedy token differs;
    /// returns the largest absolute logit difference.
    pub fn max_diff(&self, rows: &[Vec<f32>], first: usize, what: &str) -> f64 {
        let mut worst = 0f64;
        for (i, row) in rows.iter().enumerate() {
            let pos = first + i;
            let want = &self.logits[pos];
            assert_eq!(row.len(), want.len(), "{what}: vocabulary");
            for (a, b) in row.iter().zip(want) {
                worst = worst.max((*a as f64 - b).abs());
            }
            let best = (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                .unwrap_or(0);
            assert_eq!(
                best as u64, self.argmax[pos],
                "{what}: greedy token at position {pos}"
            );
        }
        worst
    }
}

/// Runs `c` and returns its output, failing the test (and killing the child) when it has not
/// finished within `limit`: a regression that blocks fails instead of hanging the suite.
pub fn output_within(mut c: Command, limit: std::time::Duration, what: &str) -> Output {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // drained on threads, so that a child writing much cannot block on a full pipe
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Re-seals a model manifest's checksum after an edit, as a forger would.
pub fn reseal(b: &mut [u8]) {
    use gds_format::raw::CHECKSUM_OFFSET;
    let s = gds_format::reader::checksum(b);
    b[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32].copy_from_slice(&s);
}

/// Rewrites `rel` in the model directory `dir` with `bytes` and records its new length and
/// hash in the manifest's file table, re-sealed, as a forger would: the directory stays
/// self-consistent, so only the checks of the file's content can refuse it.
pub fn forge_file(dir: &Path, rel: &str, bytes: &[u8]) {
    use gds_format::raw::{FileEntry, HeaderExt};
    use gds_format::{Manifest, MANIFEST_FILE};
    use zerocopy::FromBytes;
    std::fs::write(dir.join(rel), bytes).unwrap();
    let p = dir.join(MANIFEST_FILE);
    let mut b = std::fs::read(&p).unwrap();
    let m = Manifest::parse(&b).unwrap();
    let i = m.files().position(|f| f.path == rel).unwrap();
    let ext = HeaderExt::ref_from_prefix(&b[128..]).unwrap().0;
    let at = ext.files.offset.get() as usize + i * size_of::<FileEntry>();
    b[at + 16..at + 24].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    b[at + 24..at + 56].copy_from_slice(blake3::hash(bytes).as_bytes());
    reseal(&mut b);
    std::fs::write(&p, b).unwrap();
}
