//! Shared helpers for the end-to-end tests in `tests/e2e/`: paths of the built binaries, the
//! fixtures, and the real model (fetched into `.cache/` by `scripts/fetch-model.sh`).

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

/// Gemma 3 270M converted once per test binary.
pub fn gemma_converted() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let out = tmp.path().join("gemma3.gds");
        gds_convert::convert(
            &gemma_gguf(),
            &out,
            &gds_convert::ConvertOptions::default(),
            &gds_convert::NoProgress,
        )
        .expect("convert Gemma 3");
        (tmp, out)
    })
    .1
}

/// A fixture file or directory under `fixtures/`.
pub fn fixture(rel: &str) -> PathBuf {
    root().join("fixtures").join(rel)
}

/// stdout as a string.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as a string.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// SmolLM2 converted once per test binary (default options) into a temporary directory that
/// lives until the process exits. Every test that needs the real model shares it.
pub fn smollm_converted() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let gguf = smollm_gguf();
        let tmp = tempfile::tempdir().expect("temporary directory");
        let out = tmp.path().join("smollm2.gds");
        gds_convert::convert(
            &gguf,
            &out,
            &gds_convert::ConvertOptions::default(),
            &gds_convert::NoProgress,
        )
        .expect("convert SmolLM2");
        (tmp, out)
    })
    .1
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
