//! End-to-end tests of `gdsconv` on the real SmolLM2 GGUF and on the committed fixtures.

use gds_format::{Manifest, MANIFEST_FILE};
use gds_tests::*;
use sha2::{Digest, Sha256};
use std::path::Path;

fn convert(input: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["convert", input.to_str().unwrap(), out.to_str().unwrap()];
    args.extend_from_slice(extra);
    run("gdsconv", &args)
}

fn assert_ok(o: &std::process::Output) {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
}

fn validate_json(dir: &Path, quick: bool) -> (i32, serde_json::Value) {
    let mut args = vec!["validate", dir.to_str().unwrap(), "--json"];
    if quick {
        args.push("--quick");
    }
    let o = run("gdsconv", &args);
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    (o.status.code().unwrap(), v)
}

/// Names of leftover temporary directories beside `out`.
fn leftovers(parent: &Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-") || n.contains(".old-"))
        .collect()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn smollm2_converts_validates_and_keeps_every_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2.gds");
    let o = convert(&smollm_gguf(), &out, &[]);
    assert_ok(&o);
    assert!(
        stdout(&o).contains("272 tensors in 32 layer files"),
        "{}",
        stdout(&o)
    );

    let (code, v) = validate_json(&out, false);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["valid"], true);
    assert_eq!(v["errors"].as_array().unwrap().len(), 0);

    // every tensor byte for byte, against hashes made by gguf-py (scripts/gen_tensor_hashes.py)
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2/tensors.json")).unwrap())
            .unwrap();
    let golden = golden["tensors"].as_object().unwrap();
    let mbytes = std::fs::read(out.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&mbytes).unwrap();
    assert_eq!(m.n_tensors(), golden.len());
    let mut files = std::collections::HashMap::new();
    for t in m.tensors() {
        let g = &golden[t.name];
        assert_eq!(
            t.dtype.id() as u64,
            g["ggml_type"].as_u64().unwrap(),
            "{}",
            t.name
        );
        let shape: Vec<u64> = g["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims(), shape.as_slice(), "{}", t.name);
        assert_eq!(t.nbytes, g["nbytes"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.offset % 4096, 0);
        let l = m.layer(t.layer).unwrap();
        let data = files
            .entry(l.file)
            .or_insert_with(|| std::fs::read(out.join(l.file)).unwrap());
        assert_eq!(data.len() % 4096, 0);
        let bytes = &data[t.offset as usize..(t.offset + t.nbytes) as usize];
        assert_eq!(
            hex(&Sha256::digest(bytes)),
            g["sha256"].as_str().unwrap(),
            "bytes of {}",
            t.name
        );
    }
    assert_eq!(m.get_u64("model.n_layers").unwrap(), 30);
    assert_eq!(m.get_u64("model.n_kv_heads").unwrap(), 3);
    assert!(m.get_bool("model.tie_embeddings").unwrap());

    // inspect, human and JSON
    let o = run("gdsconv", &["inspect", out.to_str().unwrap(), "--json"]);
    assert_ok(&o);
    let i: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(i["architecture"], "llama");
    assert_eq!(i["layers"].as_array().unwrap().len(), 32);
    assert_eq!(i["total_tensors"], 272);
    assert_eq!(i["metadata"]["model.n_embd"], 576);
    let o = run("gdsconv", &["inspect", out.to_str().unwrap()]);
    assert_ok(&o);
    assert!(
        stdout(&o).contains("blk.29") && stdout(&o).contains("q4_1:7"),
        "{}",
        stdout(&o)
    );

    // a tokenizer that loads, with the chat template
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert!(cfg["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));

    // deterministic: a second conversion is byte-identical
    let out2 = tmp.path().join("again.gds");
    assert_ok(&convert(&smollm_gguf(), &out2, &[]));
    for name in [
        MANIFEST_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
        "layers/embed.bin",
        "layers/blk.0007.bin",
        "layers/head.bin",
    ] {
        assert_eq!(
            std::fs::read(out.join(name)).unwrap(),
            std::fs::read(out2.join(name)).unwrap(),
            "{name} differs between runs"
        );
    }

    // an existing output is refused, then replaced with --force
    let o = convert(&smollm_gguf(), &out2, &[]);
    assert_eq!(o.status.code(), Some(2), "a usage error");
    assert!(
        stderr(&o).contains("already exists") && stderr(&o).contains("--force"),
        "{}",
        stderr(&o)
    );
    assert_ok(&convert(&smollm_gguf(), &out2, &["--force"]));
    assert!(
        leftovers(tmp.path()).is_empty(),
        "{:?}",
        leftovers(tmp.path())
    );
    // --force never replaces something that is not a model directory
    let precious = tmp.path().join("precious");
    std::fs::create_dir(&precious).unwrap();
    std::fs::write(precious.join("notes.txt"), "keep me").unwrap();
    let o = convert(&smollm_gguf(), &precious, &["--force"]);
    assert_eq!(o.status.code(), Some(2), "a usage error");
    assert!(precious.join("notes.txt").exists());
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn validate_catches_corruption() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gds");
    assert_ok(&convert(&smollm_gguf(), &out, &[]));
    // flip one byte inside a layer file: only the content hash can see it
    let f = out.join("layers/blk.0003.bin");
    let mut data = std::fs::read(&f).unwrap();
    data[5000] ^= 0x40;
    std::fs::write(&f, &data).unwrap();
    let (code, v) = validate_json(&out, false);
    assert_eq!(code, 1);
    assert!(
        v["errors"][0].as_str().unwrap().contains("blk.0003.bin")
            && v["errors"][0].as_str().unwrap().contains("content hash"),
        "{v}"
    );
    let (code, _) = validate_json(&out, true);
    assert_eq!(code, 0, "--quick skips hashing");
    // truncate a file
    std::fs::write(&f, &data[..4096]).unwrap();
    let (code, v) = validate_json(&out, true);
    assert_eq!(code, 1);
    assert!(
        v["errors"]
            .to_string()
            .contains("4096 bytes, the manifest says"),
        "{v}"
    );
    // a broken manifest checksum
    let mpath = out.join(MANIFEST_FILE);
    let mut mb = std::fs::read(&mpath).unwrap();
    let n = mb.len();
    mb[n - 3] ^= 1;
    std::fs::write(&mpath, &mb).unwrap();
    let (code, v) = validate_json(&out, true);
    assert_eq!(code, 1);
    assert!(v["errors"].to_string().contains("checksum"), "{v}");
    mb[n - 3] ^= 1;
    std::fs::write(&mpath, &mb).unwrap();
    // a tokenizer that does not load (and no longer matches the manifest's record)
    std::fs::write(out.join("tokenizer.json"), "{}").unwrap();
    let (_, v) = validate_json(&out, true);
    assert!(v["errors"].to_string().contains("tokenizer.json"), "{v}");
    // usage / I/O errors exit 2
    let o = run(
        "gdsconv",
        &["validate", tmp.path().join("nope").to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2));
    let o = run("gdsconv", &["validate"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn bad_gguf_inputs_fail_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = std::fs::read(smollm_gguf()).unwrap();
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "magic.gguf",
            [b"GGUX".as_slice(), &src[4..4096]].concat(),
            "not a GGUF",
        ),
        (
            "version.gguf",
            [b"GGUF".as_slice(), &9u32.to_le_bytes(), &src[8..4096]].concat(),
            "unsupported GGUF version 9",
        ),
        (
            "header-cut.gguf",
            src[..2000].to_vec(),
            "exceed the file size",
        ),
        ("vocab-cut.gguf", src[..500_000].to_vec(), "truncated"),
        (
            "data-cut.gguf",
            src[..src.len() / 2].to_vec(),
            "out of bounds",
        ),
        ("empty.gguf", vec![], "too short"),
    ];
    // a dtype id the format lacks (TQ1_0) in the first tensor info (token_embd.weight, 2 dims)
    let pos = find(&src, b"token_embd.weight").unwrap() + "token_embd.weight".len() + 4 + 16;
    let mut d = src[..src.len()].to_vec();
    d[pos..pos + 4].copy_from_slice(&34u32.to_le_bytes());
    cases.push(("dtype.gguf", d, "ggml type TQ1_0 (id 34) is not supported"));
    // a type it has (IQ1_S) whose 256-element blocks do not divide the rows (576 wide)
    let mut d = src[..src.len()].to_vec();
    d[pos..pos + 4].copy_from_slice(&19u32.to_le_bytes());
    cases.push((
        "dtype-rows.gguf",
        d,
        "shape [49152, 576] is not a whole number of iq1_s blocks",
    ));
    for (name, bytes, needle) in cases {
        let input = tmp.path().join(name);
        std::fs::write(&input, &bytes).unwrap();
        let out = tmp.path().join(format!("{name}.out"));
        let o = convert(&input, &out, &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(name) && err.contains(needle),
            "{name}: expected {needle:?} in {err:?}"
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(!out.exists(), "{name}: left an output directory");
    }
    assert!(
        leftovers(tmp.path()).is_empty(),
        "{:?}",
        leftovers(tmp.path())
    );
    let o = run(
        "gdsconv",
        &[
            "convert",
            "/nonexistent.gguf",
            tmp.path().join("x").to_str().unwrap(),
        ],
    );
    // an I/O error
    assert!(stderr(&o).contains("/nonexistent.gguf") && o.status.code() == Some(2));
    let o = run(
        "gdsconv",
        &[
            "convert",
            smollm_gguf().to_str().unwrap(),
            tmp.path().join("x").to_str().unwrap(),
            "--quant",
            "q9",
        ],
    );
    assert!(stderr(&o).contains("unknown --quant") && !o.status.success());
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn interrupted_conversion_leaves_nothing_that_looks_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("killed.gds");
    // a slow conversion (requantize everything) killed early
    let mut child = std::process::Command::new(bin("gdsconv"))
        .args([
            "convert",
            smollm_gguf().to_str().unwrap(),
            out.to_str().unwrap(),
            "--quant",
            "q8_0",
            "--requantize",
        ])
        .stderr(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _ = child.kill();
    let status = child.wait().unwrap();
    if status.success() {
        // finished before the kill: then it must be complete and valid
        assert_eq!(validate_json(&out, false).0, 0);
    } else {
        assert!(!out.exists(), "a killed conversion left {}", out.display());
    }
}

/// Gemma 3 is a known family (formats/gemma3.json): its hyperparameters, the keys llama.cpp
/// hard-codes for it and its block tensors are checked, and it validates as runnable.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gemma3_converts_to_a_runnable_model() {
    let gemma = gemma_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gemma.gds");
    let o = convert(&gemma, &out, &[]);
    assert_ok(&o);
    assert!(!stderr(&o).contains("not supported"), "{}", stderr(&o));
    let (code, v) = validate_json(&out, false);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["runnable"], true, "{v}");
    let mb = std::fs::read(out.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&mb).unwrap();
    assert_eq!(m.get_str("general.architecture").unwrap(), "gemma3");
    let h = gds_format::arch::hparams(&m, "gemma3").unwrap();
    assert_eq!((h.n_layers, h.n_embd, h.head_dim), (18, 640, 256));
    assert_eq!((h.n_heads, h.n_kv_heads, h.n_ff), (4, 1, 2048));
    assert_eq!(h.sliding_window, Some(512));
    assert_eq!(h.sliding_window_pattern, 6);
    assert_eq!(h.rope_theta_local, Some(10000.0));
    assert_eq!(h.rope_theta, 1_000_000.0);
    assert_eq!(h.query_pre_attn_scalar, Some(256.0));
    assert_eq!(h.rope_style, gds_format::arch::RopeStyle::Neox);
    assert!(h.tie_embeddings && h.add_bos);
    // layers 5, 11, 17 attend globally
    let global: Vec<u64> = (0..18).filter(|&l| !h.is_window_layer(l)).collect();
    assert_eq!(global, [5, 11, 17]);
}

/// An architecture without a description converts, grouped by layer index, with a warning
/// that gdsrun cannot run it; validate agrees (valid, not runnable).
#[test]
fn unknown_architecture_converts_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    // tiny-llama.gguf with its general.architecture value renamed (same length)
    let mut b = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    let key = b"general.architecture";
    let at = b
        .windows(key.len())
        .position(|w| w == key)
        .expect("architecture key")
        + key.len();
    // value type (u32 8 = string), length (u64 5), then the name
    assert_eq!(&b[at + 12..at + 17], b"llama");
    b[at + 12..at + 17].copy_from_slice(b"mamba");
    let input = tmp.path().join("mamba.gguf");
    std::fs::write(&input, &b).unwrap();
    let out = tmp.path().join("mamba.gds");
    let o = convert(&input, &out, &[]);
    assert_ok(&o);
    assert!(
        stderr(&o).contains("\"mamba\" is not supported by gdsrun"),
        "{}",
        stderr(&o)
    );
    let (code, v) = validate_json(&out, true);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["runnable"], false, "{v}");
    assert!(v["warnings"].to_string().contains("mamba"), "{v}");
    let mb = std::fs::read(out.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&mb).unwrap();
    assert_eq!(m.get_str("general.architecture").unwrap(), "mamba");
    let blocks = m
        .layers()
        .filter(|l| l.kind == gds_format::layer_kind::BLOCK)
        .count();
    assert_eq!(blocks as u64, m.get_u64("gguf.llama.block_count").unwrap());
}
