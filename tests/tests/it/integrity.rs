//! Integrity end to end (issue "Hardening", defects 1, 3 and 4): hostile sizes cannot make
//! the tools allocate without bound, `gdsrun` never computes with bytes it has not verified,
//! every file of a model directory is covered by the manifest, and `gdsconv validate` and
//! `gdsrun` agree on what is a usable model. Each case edits a copy of the converted
//! SmolLM2 and re-seals the manifest's checksum where the edit is to the manifest, as an
//! attacker would.

use gds_format::raw::KvEntry;
use gds_format::{Manifest, MANIFEST_FILE};
use gds_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A private copy of the converted model.
fn copy_model() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(smollm_converted(), &dir);
    (tmp, dir)
}

/// Sets the raw 8-byte value of key `key` in the manifest of `dir` and re-seals it.
fn set_kv(dir: &Path, key: &str, raw: u64) {
    let p = dir.join(MANIFEST_FILE);
    let mut b = std::fs::read(&p).unwrap();
    let m = Manifest::parse(&b).unwrap();
    let i = (0..m.kv_table().len())
        .find(|&i| m.kv(i).unwrap().0 == key)
        .unwrap_or_else(|| panic!("no key {key}"));
    let at = m.header().kv.offset.get() as usize + i * size_of::<KvEntry>() + 16;
    b[at..at + 8].copy_from_slice(&raw.to_le_bytes());
    reseal(&mut b);
    std::fs::write(&p, b).unwrap();
}

fn flip(path: &Path, at: usize) {
    let mut d = std::fs::read(path).unwrap();
    d[at] ^= 0x20;
    std::fs::write(path, d).unwrap();
}

/// Runs a built binary under an address-space limit of 2 GiB, so "allocates without limit"
/// is an allocation failure (abort, exit 134) rather than the machine's OOM killer.
fn run_limited(name: &str, args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("ulimit -v 2097152 && exec \"$0\" \"$@\"")
        .arg(bin(name))
        .args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// `gdsrun` on `dir`: one greedy token, verification cache in `home`.
fn gdsrun(dir: &Path, home: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "run",
        dir.to_str().unwrap(),
        "-p",
        "Hi",
        "--max-tokens",
        "2",
        "--temp",
        "0",
        "--json",
    ];
    args.extend_from_slice(extra);
    run_limited("gdsrun", &args, &[("GDSLLM_HOME", home)])
}

fn validate(dir: &Path, quick: bool) -> (i32, serde_json::Value) {
    let mut args = vec!["validate", dir.to_str().unwrap(), "--json"];
    if quick {
        args.push("--quick");
    }
    let o = run_limited("gdsconv", &args, &[]);
    let v = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {} {}", stdout(&o), stderr(&o)));
    (o.status.code().unwrap_or(-1), v)
}

fn assert_refused(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(
        !o.status.success() && o.status.code().is_some_and(|c| c != 134 && c != 101),
        "expected a clean refusal, got {:?}\n{err}",
        o.status.code()
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in: {err}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn huge_n_layers_is_refused_without_allocating() {
    let (_t, dir) = copy_model();
    set_kv(&dir, "model.n_layers", 1 << 40);
    for quick in [false, true] {
        let (code, v) = validate(&dir, quick);
        assert_eq!(code, 1, "{v}");
        assert!(v["errors"].to_string().contains("model.n_layers"), "{v}");
    }
    let home = tempfile::tempdir().unwrap();
    assert_refused(&gdsrun(&dir, home.path(), &[]), &["model.n_layers"]);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn truncated_layer_count_is_refused_by_validate_and_gdsrun() {
    for n in [1u64, 29] {
        let (_t, dir) = copy_model();
        set_kv(&dir, "model.n_layers", n);
        let (code, v) = validate(&dir, true);
        assert_eq!(code, 1, "{v}");
        assert!(v["errors"].to_string().contains("30 blocks"), "{v}");
        let home = tempfile::tempdir().unwrap();
        assert_refused(
            &gdsrun(&dir, home.path(), &[]),
            &["model.n_layers", "30 blocks"],
        );
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gdsrun_never_computes_with_a_flipped_byte() {
    let (_t, dir) = copy_model();
    let home = tempfile::tempdir().unwrap();
    let clean = gdsrun(&dir, home.path(), &[]);
    assert!(clean.status.success(), "{}", stderr(&clean));
    let j: serde_json::Value = serde_json::from_slice(&clean.stdout).unwrap();
    assert_eq!(j["metrics"]["verify"], "blake3", "{j}");
    assert!(
        j["metrics"]["verified_bytes"].as_u64().unwrap() > 90 << 20,
        "{j}"
    );
    // The same files again: the per-user cache vouches for all 32, nothing is hashed.
    let again = gdsrun(&dir, home.path(), &[]);
    let j2: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(j2["metrics"]["verified_bytes"], 0, "{j2}");
    assert_eq!(j2["metrics"]["verify_cached_files"], 32, "{j2}");
    assert_eq!(j["text"], j2["text"]);
    // One flipped byte in a block, in the embedding (read row by row when streamed), and
    // in the head: refused by every I/O mode, cached or not.
    for (file, at) in [
        ("layers/blk.0007.bin", 70_000),
        ("layers/embed.bin", 1_000_000),
        ("layers/head.bin", 100),
    ] {
        let (_t, dir) = copy_model();
        flip(&dir.join(file), at);
        for io in [
            &["--io", "mmap"][..],
            &["--io", "direct"],
            &["--io", "direct", "--mem-budget", "16MiB"],
        ] {
            let home = tempfile::tempdir().unwrap();
            assert_refused(&gdsrun(&dir, home.path(), io), &[file, "content hash"]);
        }
        let o = gdsrun(&dir, home.path(), &["--no-verify"]);
        assert!(
            o.status.success(),
            "--no-verify trusts the files: {}",
            stderr(&o)
        );
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["metrics"]["verify"], "off");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn every_file_of_the_directory_is_covered() {
    let (_t, dir) = copy_model();
    let m = std::fs::read(dir.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&m).unwrap();
    let listed: Vec<&str> = m.files().map(|f| f.path).collect();
    assert_eq!(listed, ["tokenizer.json", "tokenizer_config.json"]);
    // Single-byte flips in the chat template's file: all caught, by validate and gdsrun.
    let cfg = dir.join("tokenizer_config.json");
    let len = std::fs::metadata(&cfg).unwrap().len() as usize;
    for k in 0..20 {
        let (_t, dir) = copy_model();
        let at = k * (len - 1) / 19;
        flip(&dir.join("tokenizer_config.json"), at);
        let (code, v) = validate(&dir, true);
        assert_eq!(code, 1, "flip at {at}: {v}");
        assert!(
            v["errors"].to_string().contains("tokenizer_config.json"),
            "{v}"
        );
        if k % 5 == 0 {
            let home = tempfile::tempdir().unwrap();
            assert_refused(&gdsrun(&dir, home.path(), &[]), &["tokenizer_config.json"]);
        }
    }
    // A forged (re-sealed) invalid UTF-8 tokenizer_config.json is an error naming the file,
    // never a silent switch to raw prompts.
    let (_t, dir) = copy_model();
    let mut bytes = std::fs::read(&cfg).unwrap();
    bytes.insert(1, 0xff);
    forge_file(&dir, "tokenizer_config.json", &bytes);
    let (code, v) = validate(&dir, true);
    assert_eq!(code, 1, "{v}");
    assert!(v["errors"].to_string().contains("not valid UTF-8"), "{v}");
    let home = tempfile::tempdir().unwrap();
    assert_refused(
        &gdsrun(&dir, home.path(), &[]),
        &["tokenizer_config.json", "UTF-8"],
    );
    // A forged template that does not compile is caught by validate before gdsrun runs it.
    let (_t, dir) = copy_model();
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v["chat_template"] = "{% for m in messages %}{{ m.content }".into();
    forge_file(&dir, "tokenizer_config.json", v.to_string().as_bytes());
    let (code, r) = validate(&dir, true);
    assert_eq!(code, 1, "{r}");
    let errors = r["errors"].to_string();
    assert!(
        errors.contains("chat template") && errors.contains("syntax error"),
        "{r}"
    );
    assert_refused(&gdsrun(&dir, home.path(), &[]), &["chat template"]);
    // A forged tokenizer.json whose pre-tokenizer backtracks on common text (runs of word
    // characters before a "!": over the time limit at 128 letters, its time growing faster
    // than the text on printable ASCII) is refused by validate and by gdsrun, as convert
    // refuses it.
    let (_t, dir) = copy_model();
    let tok = dir.join("tokenizer.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&tok).unwrap()).unwrap();
    v["pre_tokenizer"] = serde_json::json!({"type": "Split",
        "pattern": {"Regex": r"\w*\w*\w*!"}, "behavior": "Isolated", "invert": false});
    forge_file(&dir, "tokenizer.json", v.to_string().as_bytes());
    let (code, r) = validate(&dir, true);
    assert_eq!(code, 1, "{r}");
    let errors = r["errors"].to_string();
    assert!(
        errors.contains("tokenizer.json") && errors.contains("backtracks"),
        "{r}"
    );
    let o = gdsrun(&dir, home.path(), &[]);
    assert_refused(&o, &["tokenizer.json", "refused", "backtracks"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    // A tokenizer_config.json the manifest does not list is not part of the model.
    let (_t, dir) = copy_model();
    std::fs::write(dir.join("generation_config.json"), "not json").unwrap();
    assert_eq!(validate(&dir, false).0, 0);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn links_inside_the_model_directory_are_refused() {
    let (t, dir) = copy_model();
    let outside = t.path().join("elsewhere.bin");
    std::fs::rename(dir.join("layers/head.bin"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("layers/head.bin")).unwrap();
    let (code, v) = validate(&dir, false);
    assert_eq!(code, 1, "{v}");
    assert!(v["errors"].to_string().contains("symbolic link"), "{v}");
    let home = tempfile::tempdir().unwrap();
    assert_refused(
        &gdsrun(&dir, home.path(), &[]),
        &["head.bin", "symbolic link"],
    );
}

/// `gdsconv validate` says "runnable" exactly for the models `gdsrun` opens.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn validate_and_gdsrun_agree_on_what_is_usable() {
    type Edit = fn(&Path);
    let cases: Vec<(&str, Edit)> = vec![
        ("intact", |_| {}),
        ("rms_norm_eps NaN", |d| {
            set_kv(d, "model.rms_norm_eps", f64::NAN.to_bits())
        }),
        ("rope_theta -1", |d| {
            set_kv(d, "model.rope_theta", (-1f64).to_bits())
        }),
        ("context_length 0", |d| set_kv(d, "model.context_length", 0)),
        ("bos id 10^9", |d| {
            set_kv(d, "tokenizer.bos_token_id", 1_000_000_000)
        }),
        ("n_kv_heads 7", |d| set_kv(d, "model.n_kv_heads", 7)),
        ("truncated layer", |d| {
            let f = d.join("layers/blk.0002.bin");
            let b = std::fs::read(&f).unwrap();
            std::fs::write(&f, &b[..4096]).unwrap();
        }),
        ("missing tokenizer", |d| {
            std::fs::remove_file(d.join("tokenizer.json")).unwrap()
        }),
        ("architecture renamed", |d| {
            let p = d.join(MANIFEST_FILE);
            let mut b = std::fs::read(&p).unwrap();
            let m = Manifest::parse(&b).unwrap();
            let s = m.header().strings.offset.get() as usize;
            let at = s + b[s..].windows(5).position(|w| w == b"llama").unwrap();
            b[at + 4] = b'b';
            reseal(&mut b);
            std::fs::write(&p, b).unwrap();
        }),
    ];
    for (name, edit) in cases {
        let (_t, dir) = copy_model();
        edit(&dir);
        let (_, v) = validate(&dir, false);
        let runnable = v["runnable"].as_bool().unwrap();
        let home = tempfile::tempdir().unwrap();
        let o = gdsrun(&dir, home.path(), &[]);
        assert_eq!(
            runnable,
            o.status.success(),
            "{name}: validate says runnable={runnable} ({v}), gdsrun exit {:?}: {}",
            o.status.code(),
            stderr(&o)
        );
        assert!(!stderr(&o).contains("panicked"), "{name}: {}", stderr(&o));
        if name == "intact" {
            assert!(runnable, "{v}");
        }
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_fifo_in_place_of_a_model_file_is_refused_at_once() {
    let limit = std::time::Duration::from_secs(60);
    let first_layer = {
        let b = std::fs::read(smollm_converted().join(MANIFEST_FILE)).unwrap();
        let m = Manifest::parse(&b).unwrap();
        m.layer(0).unwrap().file.to_string()
    };
    for rel in [
        first_layer.as_str(),
        MANIFEST_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let (_t, dir) = copy_model();
        let p = dir.join(rel);
        std::fs::remove_file(&p).unwrap();
        let o = Command::new("mkfifo").arg(&p).output().unwrap();
        assert!(o.status.success(), "mkfifo {}: {}", p.display(), stderr(&o));
        let mut c = Command::new(bin("gdsconv"));
        c.args(["validate", dir.to_str().unwrap(), "--json"]);
        let o = output_within(c, limit, &format!("gdsconv validate with a FIFO {rel}"));
        let all = format!("{}{}", stdout(&o), stderr(&o));
        assert_eq!(o.status.code(), Some(1), "validate, FIFO {rel}: {all}");
        assert!(
            all.contains(rel) && all.contains("FIFO"),
            "validate, FIFO {rel}: {all}"
        );
        let home = tempfile::tempdir().unwrap();
        let mut c = Command::new(bin("gdsrun"));
        c.args([
            "run",
            dir.to_str().unwrap(),
            "-p",
            "Hi",
            "--max-tokens",
            "1",
        ])
        .env("GDSLLM_HOME", home.path());
        let o = output_within(c, limit, &format!("gdsrun with a FIFO {rel}"));
        assert_refused(&o, &[rel, "FIFO"]);
    }
}
