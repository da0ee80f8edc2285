//! Regression tests for the converter defects of issue 15 ("Hardening"), each named after
//! its defect: hostile sizes in GGUF and safetensors inputs (run under a memory cap, so an
//! allocation sized by a hostile field fails the test instead of exhausting the machine),
//! staging directories of killed conversions, `--force`, exit codes and messages.

use gds_tests::{fixture, smollm_gguf};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const GDSCONV: &str = env!("CARGO_BIN_EXE_gdsconv");

/// Address-space cap for converter runs on hostile input: ample for a real conversion of
/// SmolLM2 (which needs under 300 MiB), far below what any hostile count asks for.
const CAP_KIB: u64 = 1 << 20;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn gdsconv(args: &[&OsStr]) -> Output {
    Command::new(GDSCONV)
        .args(args)
        .output()
        .expect("run gdsconv")
}

/// `gdsconv convert INPUT OUT --threads 1 EXTRA...` with the address space capped at
/// [`CAP_KIB`] (one worker and two malloc arenas, so the cap does not depend on the
/// machine's core count).
fn convert_capped(input: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {CAP_KIB} && exec \"$0\" \"$@\""))
        .arg(GDSCONV)
        .arg("convert")
        .arg(input)
        .arg(out)
        .args(["--threads", "1"])
        .args(extra)
        .env("MALLOC_ARENA_MAX", "2")
        .output()
        .expect("run gdsconv under sh")
}

fn convert(input: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(GDSCONV)
        .arg("convert")
        .arg(input)
        .arg(out)
        .args(extra)
        .output()
        .expect("run gdsconv")
}

/// Exit 1, a message naming `file` and containing `needle`, no panic, no abort, no output.
fn assert_input_error(o: &Output, file: &Path, needle: &str, out: &Path) {
    let err = stderr(o);
    let name = file.file_name().unwrap().to_string_lossy();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{name}: exit {:?}: {err}",
        o.status
    );
    assert!(
        err.contains(name.as_ref()) && err.contains(needle),
        "{name}: want {needle:?} in {err:?}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("memory allocation"),
        "{err}"
    );
    assert!(!out.exists(), "{name}: left {}", out.display());
}

/// Entries of `dir` whose names start with '.' (staging directories are hidden).
fn hidden_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    v.sort();
    v
}

// ------------------------------------------------------------------------------------------
// Hand-made GGUF files

fn gguf_header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A key holding a string value.
fn kv_str(b: &mut Vec<u8>, k: &str, v: &str) {
    put_str(b, k);
    b.extend(8u32.to_le_bytes());
    put_str(b, v);
}

/// A key holding an array header (element type, length) with no elements after it.
fn kv_array_head(b: &mut Vec<u8>, k: &str, elem_type: u32, len: u64) {
    put_str(b, k);
    b.extend(9u32.to_le_bytes());
    b.extend(elem_type.to_le_bytes());
    b.extend(len.to_le_bytes());
}

/// The real model with `llama.block_count` (a u32) set to `n`.
fn smollm_with_block_count(n: u32) -> Vec<u8> {
    let mut b = std::fs::read(smollm_gguf()).unwrap();
    let key = b"llama.block_count";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(b[at..at + 4], 4u32.to_le_bytes(), "block_count is a u32");
    b[at + 4..at + 8].copy_from_slice(&n.to_le_bytes());
    b
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gguf_block_count_of_2_pow_32_minus_1_is_refused_without_unbounded_allocation() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("blocks.gguf");
    std::fs::write(&input, smollm_with_block_count(u32::MAX)).unwrap();
    let out = tmp.path().join("out");
    let o = convert_capped(&input, &out, &[]);
    assert_input_error(&o, &input, "llama.block_count", &out);
    assert!(stderr(&o).contains("4294967295"), "{}", stderr(&o));
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gguf_block_count_mismatch_is_an_input_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("31-blocks.gguf");
    std::fs::write(&input, smollm_with_block_count(31)).unwrap();
    let out = tmp.path().join("out");
    let o = convert(&input, &out, &[]);
    assert_input_error(&o, &input, "is 31, but the tensors form 30 blocks", &out);
    assert!(!stderr(&o).contains("internal error"), "{}", stderr(&o));
}

#[test]
fn gguf_hostile_counts_and_lengths_are_refused_under_a_memory_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    cases.push((
        "tensor-count.gguf",
        [gguf_header(1 << 40, 0), vec![0; 64]].concat(),
        "exceed the file size",
    ));
    cases.push((
        "kv-count.gguf",
        [gguf_header(0, u64::MAX), vec![0; 64]].concat(),
        "exceed the file size",
    ));
    let mut b = gguf_header(0, 1);
    b.extend((1u64 << 60).to_le_bytes()); // key length
    b.extend(b"general.architecture");
    cases.push(("key-length.gguf", b, "truncated"));
    let mut b = gguf_header(0, 1);
    put_str(&mut b, "general.name");
    b.extend(8u32.to_le_bytes());
    b.extend((u64::MAX - 3).to_le_bytes()); // string value length
    cases.push(("string-length.gguf", b, "truncated"));
    let mut b = gguf_header(0, 2);
    kv_str(&mut b, "general.architecture", "llama");
    kv_array_head(&mut b, "tokenizer.ggml.tokens", 8, 1 << 62);
    cases.push(("token-array.gguf", b, "exceeds the file"));
    let mut b = gguf_header(0, 1);
    kv_array_head(&mut b, "tokenizer.ggml.scores", 6, 1 << 40);
    cases.push(("score-array.gguf", b, "truncated"));
    let mut b = gguf_header(0, 1);
    kv_array_head(&mut b, "tokenizer.ggml.token_type", 5, u64::MAX / 2);
    cases.push(("type-array.gguf", b, "overflows"));
    let mut b = gguf_header(0, 1);
    kv_array_head(&mut b, "x.nested", 9, 1 << 40);
    cases.push(("nested-array.gguf", b, "exceeds the file"));
    // 17 Mi one-byte elements: small on disk, 32 bytes each once decoded
    let n = (1u64 << 24) + 1;
    let mut b = gguf_header(0, 1);
    kv_array_head(&mut b, "x.bytes", 0, n);
    b.resize(b.len() + n as usize, 0);
    cases.push(("many-elements.gguf", b, "elements GdsLLM accepts"));
    let mut b = gguf_header(0, 2);
    kv_str(&mut b, "general.architecture", "llama");
    kv_str(&mut b, "general.architecture", "gemma3");
    cases.push((
        "duplicate-key.gguf",
        b,
        "\"general.architecture\" appears twice",
    ));
    for (name, bytes, needle) in cases {
        let input = tmp.path().join(name);
        std::fs::write(&input, &bytes).unwrap();
        let out = tmp.path().join(format!("{name}.gds"));
        assert_input_error(&convert_capped(&input, &out, &[]), &input, needle, &out);
    }
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
}

// ------------------------------------------------------------------------------------------
// Hostile safetensors

fn safetensors_bytes(header: &str, data: usize) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    [(h.len() as u64).to_le_bytes().to_vec(), h, vec![0; data]].concat()
}

#[test]
fn safetensors_duplicate_header_key_is_rejected_naming_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("dup.safetensors");
    let h = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    std::fs::write(&input, safetensors_bytes(h, 16)).unwrap();
    let out = tmp.path().join("out");
    assert_input_error(
        &convert(&input, &out, &[]),
        &input,
        "key \"w\" appears twice",
        &out,
    );
}

#[test]
fn safetensors_hostile_lengths_are_refused_under_a_memory_cap() {
    let tmp = tempfile::tempdir().unwrap();
    // header length 2^60
    let input = tmp.path().join("header.safetensors");
    let mut b = (1u64 << 60).to_le_bytes().to_vec();
    b.extend(b"{}      ");
    std::fs::write(&input, b).unwrap();
    let out = tmp.path().join("out");
    assert_input_error(&convert_capped(&input, &out, &[]), &input, "exceeds", &out);

    // side files of 4 GiB (sparse): refused by size, never read
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in std::fs::read_dir(fixture("tiny-llama-hf")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), hf.join(f.file_name())).unwrap();
    }
    for name in [
        "model.safetensors.index.json",
        "config.json",
        "tokenizer.json",
    ] {
        let file = hf.join(name);
        let keep = std::fs::read(&file).unwrap();
        std::fs::File::create(&file)
            .unwrap()
            .set_len(4 << 30)
            .unwrap();
        let o = convert_capped(&hf, &out, &[]);
        assert_input_error(&o, &file, "more than the", &out);
        std::fs::write(&file, keep).unwrap();
    }
    // the same directory converts once the files are back
    let o = convert_capped(&hf, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

// ------------------------------------------------------------------------------------------
// Exit codes and messages

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn quant_q9_is_a_usage_error_with_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = convert(&smollm_gguf(), &out, &["--quant", "q9"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("\"q9\""), "{}", stderr(&o));
    assert!(!out.exists());
}

#[test]
fn os_errors_are_printed_once() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing.gguf");
    let o = convert(&missing, &tmp.path().join("out"), &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "an I/O error: {err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.contains("missing.gguf"), "{err}");
}

// ------------------------------------------------------------------------------------------
// Staging directories of killed conversions

/// Polls `parent` until the staging directory of the conversion `child` writes to `name`
/// holds at least one layer file, and returns it. Panics if the child exits first.
fn staging_dir_mid_way(parent: &Path, name: &str, child: &mut Child) -> PathBuf {
    let prefix = format!(".{name}.tmp-");
    for _ in 0..60_000 {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the conversion to {name} ended ({status}) before it could be interrupted");
        }
        let found = std::fs::read_dir(parent).unwrap().flatten().find(|e| {
            e.file_name().to_string_lossy().starts_with(&prefix)
                && ["model/layers", "layers"].iter().any(|l| {
                    std::fs::read_dir(e.path().join(l)).is_ok_and(|mut d| d.next().is_some())
                })
        });
        if let Some(e) = found {
            return e.path();
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("no staging directory for {name} appeared");
}

fn spawn_convert(out: &Path) -> Child {
    Command::new(GDSCONV)
        .arg("convert")
        .arg(smollm_gguf())
        .arg(out)
        // slow enough to be caught mid-way: every tensor is dequantized and requantized
        .args(["--quant", "q8_0", "--requantize", "--threads", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill {sig}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn killed_conversions_staging_dirs_are_removed_by_the_next_convert_but_live_ones_are_not() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path();

    // a live converter, stopped while it writes (it keeps holding its lock)
    let live_out = parent.join("live.gds");
    let mut live = spawn_convert(&live_out);
    let live_dir = staging_dir_mid_way(parent, "live.gds", &mut live);
    signal(&live, "-STOP");

    // a converter SIGKILLed mid-way
    let mut killed = spawn_convert(&parent.join("killed.gds"));
    let killed_dir = staging_dir_mid_way(parent, "killed.gds", &mut killed);
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(killed_dir.exists());

    // the next conversion into the same parent removes the dead one's directory only
    let next = convert(&smollm_gguf(), &parent.join("next.gds"), &[]);
    assert!(next.status.success(), "{}", stderr(&next));
    assert!(
        !killed_dir.exists(),
        "{} was left behind",
        killed_dir.display()
    );
    assert!(
        stderr(&next).contains("left behind by a conversion that was killed"),
        "{}",
        stderr(&next)
    );
    assert!(
        live_dir.exists(),
        "the live converter's directory was removed"
    );

    signal(&live, "-CONT");
    assert!(live.wait().unwrap().success());
    let o = gdsconv(&[OsStr::new("validate"), live_out.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    assert_eq!(hidden_entries(parent), Vec::<String>::new());
}

// ------------------------------------------------------------------------------------------
// --force

/// A converted SmolLM2 directory at `dir`.
fn model_dir(dir: &Path) {
    let o = convert(&smollm_gguf(), dir, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type().unwrap().is_dir() {
            v.extend(
                listing(&e.path())
                    .into_iter()
                    .map(|n| format!("{name}/{n}")),
            );
        }
        v.push(name);
    }
    v.sort();
    v
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn force_refuses_when_input_is_inside_out_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let x = tmp.path().join("x");
    model_dir(&x);
    let input = x.join("my.gguf");
    std::fs::copy(smollm_gguf(), &input).unwrap();
    std::fs::write(x.join("notes.txt"), "mine").unwrap();
    let before = listing(&x);
    // also through a symlink to the input and a path with `..` in it
    let link = tmp.path().join("link.gguf");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    let dotted = x.join("layers/../my.gguf");
    for given in [&input, &link, &dotted] {
        let o = convert(given, &x, &["--force"]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("refusing to replace") && err.contains("is inside it"),
            "{err}"
        );
        assert_eq!(listing(&x), before, "something in OUT_DIR changed");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn force_refuses_and_lists_files_that_are_not_part_of_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let x = tmp.path().join("x");
    model_dir(&x);
    std::fs::write(x.join("notes.txt"), "mine").unwrap();
    std::fs::write(x.join("layers/extra.bin"), "mine").unwrap();
    std::fs::create_dir(x.join("data")).unwrap();
    let before = listing(&x);
    let o = convert(&smollm_gguf(), &x, &["--force"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("not part of a GdsLLM model: data/, layers/extra.bin, notes.txt"),
        "{err}"
    );
    assert_eq!(listing(&x), before);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn force_still_replaces_a_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let x = tmp.path().join("x");
    // a model of another quantization, with its tokenizer files
    let o = convert(&smollm_gguf(), &x, &["--quant", "q8_0", "--requantize"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = convert(&smollm_gguf(), &x, &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let fresh = tmp.path().join("fresh");
    model_dir(&fresh);
    assert_eq!(listing(&x), listing(&fresh));
    for f in ["manifest.gdsm", "layers/blk.0000.bin"] {
        assert_eq!(
            std::fs::read(x.join(f)).unwrap(),
            std::fs::read(fresh.join(f)).unwrap(),
            "{f}"
        );
    }
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
}

// ------------------------------------------------------------------------------------------
// chat templates: code from the model file (issue 33)

/// A model directory (an architecture gdsrun does not run, so no layers are needed) whose
/// `tokenizer_config.json` is `config`, listed and hashed in the manifest as convert writes it.
fn dir_with_tokenizer_config(dir: &Path, config: &str) {
    use gds_format::file_role;
    let tokenizer = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}"#;
    std::fs::create_dir_all(dir).unwrap();
    let mut b = gds_format::ManifestBuilder::new();
    b.kv_str("general.architecture", "mamba");
    for (name, role, bytes) in [
        ("tokenizer.json", file_role::TOKENIZER, tokenizer),
        ("tokenizer_config.json", file_role::TOKENIZER_CONFIG, config),
    ] {
        std::fs::write(dir.join(name), bytes).unwrap();
        b.add_file(
            name,
            role,
            bytes.len() as u64,
            *blake3::hash(bytes.as_bytes()).as_bytes(),
        );
    }
    std::fs::write(dir.join(gds_format::MANIFEST_FILE), b.finish()).unwrap();
}

/// `gdsconv validate` on hostile chat templates: a 20 000-term `+` chain (a stack overflow,
/// exit 134, before), a loop that never ends (ran for ever), and `chat_template`s of the
/// wrong type (valid and runnable before, though gdsrun refuses them): exit 1 naming
/// tokenizer_config.json and the reason.
#[test]
fn validate_refuses_hostile_or_mistyped_chat_templates_naming_tokenizer_config_json() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            serde_json::json!({ "chat_template": format!("{{{{ 1{} }}}}", " + 1".repeat(20_000)) }),
            "operators",
        ),
        (
            serde_json::json!({ "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" }),
            "instructions",
        ),
        (serde_json::json!({ "chat_template": 7 }), "not a string"),
        (
            serde_json::json!({ "chat_template": [{ "name": "default" }] }),
            "chat_template[0]",
        ),
    ];
    for (i, (config, needle)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("m{i}"));
        dir_with_tokenizer_config(&dir, &config.to_string());
        let o = gdsconv(&[
            OsStr::new("validate"),
            OsStr::new("--quick"),
            dir.as_os_str(),
        ]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(1), "{needle}: {out}{}", stderr(&o));
        assert!(
            out.contains("tokenizer_config.json") && out.contains(needle),
            "{needle}: {out}"
        );
    }
    // the same directory with a plain template is valid
    let dir = tmp.path().join("ok");
    dir_with_tokenizer_config(&dir, r#"{"chat_template": "{{ messages[0].content }}"}"#);
    let o = gdsconv(&[OsStr::new("validate"), dir.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
}

// ------------------------------------------------------------------------------------------
// Edge values of the command line (2026-12-05 audit): each refused at once, exit 2, the path
// or flag named

fn mkfifo(p: &Path) {
    assert!(Command::new("mkfifo").arg(p).status().unwrap().success());
}

/// `gdsconv ARGS` (with its own empty `GDSLLM_HOME`), which must end within a minute (a FIFO
/// opened without O_NONBLOCK blocks for ever): exit 2, `needle` in the message (ignoring
/// case), no panic.
fn usage_error<S: AsRef<OsStr>>(args: &[S], needle: &str) {
    let home = tempfile::tempdir().unwrap();
    let mut c = Command::new(GDSCONV);
    c.args(args).env("GDSLLM_HOME", home.path());
    let shown: Vec<_> = args.iter().map(|a| a.as_ref().to_owned()).collect();
    let o = gds_tests::output_within(c, std::time::Duration::from_secs(60), &format!("{shown:?}"));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "gdsconv {shown:?}: {err}");
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "gdsconv {shown:?}: {needle:?} not in: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn fifos_devices_and_directories_in_place_of_input_files_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo");
    mkfifo(&fifo);
    let out = tmp.path().join("out");
    let tiny = fixture("tiny-llama3-hf");
    // the side files of a Hugging Face directory
    for name in ["config.json", "tokenizer_config.json"] {
        let hf = tmp.path().join(format!("hf-{name}"));
        gds_tests::copy_dir(&tiny, &hf);
        std::fs::remove_file(hf.join(name)).unwrap();
        mkfifo(&hf.join(name));
        usage_error(
            &[OsStr::new("convert"), hf.as_os_str(), out.as_os_str()],
            &format!("{}: not a regular file", hf.join(name).display()),
        );
    }
    // files named by flags: a FIFO, a directory, a device, a missing path
    for (flag, p, want) in [
        ("--tokenizer", fifo.clone(), "not a regular file"),
        (
            "--tokenizer",
            tmp.path().to_path_buf(),
            "not a regular file",
        ),
        (
            "--tokenizer",
            tmp.path().join("none.json"),
            "No such file or directory (os error 2)",
        ),
        ("--imatrix", fifo.clone(), "not a regular file"),
        ("--imatrix", tmp.path().to_path_buf(), "not a regular file"),
        (
            "--imatrix",
            PathBuf::from("/dev/null"),
            "not a regular file",
        ),
    ] {
        usage_error(
            &[
                OsStr::new("convert"),
                tiny.as_os_str(),
                out.as_os_str(),
                OsStr::new(flag),
                p.as_os_str(),
            ],
            &format!("{}: {want}", p.display()),
        );
    }
    assert!(!out.exists());
    // a FIFO as the input of convert and push
    usage_error(
        &[OsStr::new("convert"), fifo.as_os_str(), out.as_os_str()],
        &format!("{}: not a regular file", fifo.display()),
    );
    usage_error(
        &[
            OsStr::new("push"),
            fifo.as_os_str(),
            OsStr::new("127.0.0.1:9/x:y"),
        ],
        &format!("{}: not a regular file or directory", fifo.display()),
    );
    // a FIFO named as the model directory
    let tar = tmp.path().join("m.tar");
    for args in [
        vec![OsStr::new("inspect"), fifo.as_os_str()],
        vec![OsStr::new("validate"), fifo.as_os_str()],
        vec![
            OsStr::new("pack"),
            fifo.as_os_str(),
            OsStr::new("-o"),
            tar.as_os_str(),
        ],
    ] {
        usage_error(&args, &format!("{}: not a directory", fifo.display()));
    }
}

#[test]
fn edge_values_of_flags_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = fixture("tiny-llama3-hf");
    let out = tmp.path().join("out");
    let tar = tmp.path().join("m.tar");
    let missing = tmp.path().join("missing");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        // gdsrun's --threads rule: 1 to 1024
        (
            vec![
                "convert".into(),
                s(&tiny),
                s(&out),
                "--threads".into(),
                "0".into(),
            ],
            "--threads must be at least 1",
        ),
        (
            vec![
                "convert".into(),
                s(&tiny),
                s(&out),
                "--threads".into(),
                "100000".into(),
            ],
            "--threads 100000 is too many",
        ),
        // a missing input of pack, as of validate, inspect and convert
        (
            vec!["pack".into(), s(&missing), "-o".into(), s(&tar)],
            "missing: No such file or directory",
        ),
        // OCI tags
        (
            vec![
                "pack".into(),
                s(&tiny),
                "-o".into(),
                s(&tar),
                "--tag".into(),
                "".into(),
            ],
            "not an OCI tag",
        ),
        (
            vec![
                "pack".into(),
                s(&tiny),
                "-o".into(),
                s(&tar),
                "--tag".into(),
                "bad tag!".into(),
            ],
            "not an OCI tag",
        ),
        // an empty reference names nothing (was "refs/: Is a directory")
        (vec!["rm".into(), "".into()], "rm needs a reference"),
    ];
    for (args, want) in cases {
        usage_error(&args, want);
    }
    assert!(!out.exists() && !tar.exists());
}
