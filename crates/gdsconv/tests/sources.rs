//! `gdsconv convert` of models other programs fetched: `hf:ORG/NAME[:QUANT]` from the Hugging
//! Face cache and `ollama:NAME[:TAG]` from Ollama's directory (laid out by
//! `gds_tests::caches` as those programs write them) give the model converting the same
//! files gives; a path of that name comes first.

use gds_tests::caches;
use std::path::{Path, PathBuf};
use std::process::Command;

const GDSCONV: &str = env!("CARGO_BIN_EXE_gdsconv");

/// Every file of a converted model but its manifest (which records the input's name).
fn content(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().unwrap() != "manifest.gdsm" {
                v.push((
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                ));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn hf_and_ollama_models_convert_from_their_caches() {
    let t = tempfile::tempdir().unwrap();
    let cache = t.path().join("hf");
    caches::hf_repo(
        &cache,
        "org/tiny",
        "0123",
        true,
        &caches::dir_entries(&gds_tests::fixture("tiny-llama-hf")),
    );
    let ollama = caches::Ollama::new(&t.path().join("ollama"));
    let gguf = gds_tests::fixture("tiny-llama.gguf");
    ollama.model("library/tiny/latest", &std::fs::read(&gguf).unwrap(), &[]);
    let convert = |input: &str, out: &Path| {
        let o = Command::new(GDSCONV)
            .current_dir(t.path())
            .args(["convert", input])
            .arg(out)
            .env("GDSLLM_HOME", t.path().join("home"))
            .env("HF_HUB_CACHE", &cache)
            .env("OLLAMA_MODELS", &ollama.dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "gdsconv convert {input}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let out = |n: &str| t.path().join(n);
    convert(
        gds_tests::fixture("tiny-llama-hf").to_str().unwrap(),
        &out("a"),
    );
    convert("hf:org/tiny", &out("b"));
    assert!(
        content(&out("a")) == content(&out("b")),
        "hf: not the directory's model"
    );
    convert(gguf.to_str().unwrap(), &out("c"));
    convert("ollama:tiny", &out("d"));
    assert!(
        content(&out("c")) == content(&out("d")),
        "ollama: not the GGUF's model"
    );
    // Ollama's parameters: the model's recommended sampling, in its generation_config.json
    let params = ollama.params(br#"{"temperature": 0.5, "num_ctx": 2048}"#);
    let gguf_bytes = std::fs::read(&gguf).unwrap();
    ollama.model("library/tiny/params", &gguf_bytes, &[params]);
    convert("ollama:tiny:params", &out("p"));
    let g: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out("p").join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(g, serde_json::json!({"temperature": 0.5}));
    // a directory named like it (relative to the working directory) is what is converted
    std::fs::create_dir(t.path().join("hf:org")).unwrap();
    std::os::unix::fs::symlink(
        gds_tests::fixture("tiny-llama.gguf"),
        t.path().join("hf:org/tiny"),
    )
    .unwrap();
    convert("hf:org/tiny", &out("e"));
    assert!(
        content(&out("c")) == content(&out("e")),
        "the path, not the cache"
    );
}
