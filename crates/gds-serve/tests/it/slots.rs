//! llama-server's slot actions (`POST /slots/{id}?action=save|restore|erase` with
//! `--slot-save-path`) on the real models: a slot saved by one server and restored into
//! another (a fresh process) spares that server computing the saved tokens, and what it
//! generates from them is what the first generated; erase drops them; bad names, damaged
//! files and files from another configuration are refused without harm.

use crate::common::{http, metric, serial, start, start_model};
use serde_json::{json, Value};
use std::path::Path;

const BLOCK: u64 = 16;

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (code, text) = http(addr, "POST", path, Some(body.to_string().as_bytes()));
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text:?}"));
    (code, v)
}

/// A greedy `/completion` of `n` tokens (end-of-generation ignored): (prompt_n, cache_n,
/// tokens_predicted, content).
fn complete(addr: &str, prompt: &str, n: usize, slot: i64) -> (u64, u64, u64, String) {
    let (code, r) = post(
        addr,
        "/completion",
        &json!({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": true,
                "id_slot": slot}),
    );
    assert_eq!(code, 200, "{r}");
    let t = &r["timings"];
    (
        t["prompt_n"].as_u64().unwrap(),
        t["cache_n"].as_u64().unwrap(),
        r["tokens_predicted"].as_u64().unwrap(),
        r["content"].as_str().unwrap().to_string(),
    )
}

fn slot(addr: &str, id: &str, action: &str, file: Option<&str>) -> (u16, Value) {
    let body = file.map_or(json!({}), |f| json!({"filename": f}));
    post(addr, &format!("/slots/{id}?action={action}"), &body)
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_saved_slot_spares_another_server_its_tokens() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let a = start(&["--slot-save-path", d]);
    let b = start(&["--slot-save-path", d]);
    let prompt = "The history of the printing press begins in the fifteenth century, when \
                  Johannes Gutenberg of Mainz combined movable metal type, oil-based ink and a \
                  wooden screw press into a system that could produce books quickly. Before him,";
    let (p, cached, g, text) = complete(&a.addr, prompt, 24, 1);
    assert_eq!(cached, 0);
    // the slot holds what was computed: the prompt and the reply but its last token, all in
    // the prefix cache (the last block partly filled), and so in the file
    let held = p + g - 1;
    let (code, r) = slot(&a.addr, "1", "save", Some("s1.bin"));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["id_slot"], 1);
    assert_eq!(r["filename"], "s1.bin");
    assert_eq!(r["n_saved"], held, "{r}");
    assert_ne!(held % BLOCK, 0, "(the last block partly filled)");
    let size = std::fs::metadata(dir.path().join("s1.bin")).unwrap().len();
    assert_eq!(r["n_written"], size);
    assert!(r["timings"]["save_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(files(dir.path()), ["s1.bin"], "no temporary file left");
    let saved = r["n_saved"].as_u64().unwrap();
    assert!(saved > p, "the reply is saved too");

    // another process restores it into any slot: the prompt is found there, and what it
    // gives from the restored keys and values is what the first server gave
    let (code, r) = slot(&b.addr, "3", "restore", Some("s1.bin"));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["id_slot"], 3);
    assert_eq!(
        (r["n_restored"].as_u64(), r["n_read"].as_u64()),
        (Some(saved), Some(size))
    );
    let (p2, cached, _, again) = complete(&b.addr, prompt, 24, -1);
    assert_eq!((p2, cached), (1, p - 1), "all but the last token");
    assert_eq!(again, text);
    // the reply's blocks came too: the conversation going on finds all of them
    let (_, cached, _, _) = complete(&b.addr, &format!("{prompt}{text} And"), 4, -1);
    assert_eq!(cached, saved);
    // the slot restored into (the requests since ran in the engine's slot 0) saves its
    // tokens again (the same size: the partly filled block's rows after its tokens may now
    // come from the conversation's longer block)
    let (code, r) = slot(&b.addr, "3", "save", Some("s3.bin"));
    assert_eq!((code, r["n_saved"].as_u64()), (200, Some(saved)), "{r}");
    let second = std::fs::read(dir.path().join("s3.bin")).unwrap();
    assert_eq!(second.len() as u64, size);

    // erase: the slot's tokens are forgotten and their blocks dropped
    let (code, r) = slot(&a.addr, "1", "erase", None);
    assert_eq!(code, 200, "{r}");
    assert_eq!(r, json!({"id_slot": 1, "n_erased": held}));
    let (_, cached, _, _) = complete(&a.addr, prompt, 4, -1);
    assert_eq!(cached, 0, "computed again after the erase");
    // a slot that ran nothing saves nothing
    let (code, r) = slot(&a.addr, "5", "save", Some("empty.bin"));
    assert_eq!((code, r["n_saved"].as_u64()), (200, Some(0)), "{r}");
    let (code, r) = slot(&b.addr, "2", "restore", Some("empty.bin"));
    assert_eq!((code, r["n_restored"].as_u64()), (200, Some(0)), "{r}");

    // refused, by name, without harm
    let refused = |addr: &str, id: &str, action: &str, file: Option<&str>, want: &str| {
        let (code, r) = slot(addr, id, action, file);
        assert_eq!(code, 400, "{id} {action} {file:?}: {r}");
        let m = r["error"]["message"].as_str().unwrap();
        assert!(m.contains(want), "{id} {action} {file:?}: {m}");
    };
    refused(&b.addr, "0", "restore", Some("missing.bin"), "missing.bin");
    refused(
        &b.addr,
        "0",
        "restore",
        Some("../s1.bin"),
        "Invalid filename",
    );
    refused(&b.addr, "0", "save", Some("/tmp/x"), "Invalid filename");
    refused(&b.addr, "0", "save", None, "filename");
    refused(&b.addr, "0", "load", Some("s1.bin"), "Invalid action");
    refused(&b.addr, "16", "save", Some("x.bin"), "Invalid slot ID");
    refused(&b.addr, "x", "save", Some("x.bin"), "Invalid slot ID");
    // a damaged file (a byte of its keys flipped), one cut short, one of another format
    let mut bytes = std::fs::read(dir.path().join("s1.bin")).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(dir.path().join("bad.bin"), &bytes).unwrap();
    refused(&b.addr, "0", "restore", Some("bad.bin"), "hash");
    std::fs::write(dir.path().join("cut.bin"), &second[..second.len() / 3]).unwrap();
    refused(&b.addr, "0", "restore", Some("cut.bin"), "cut short");
    std::fs::write(dir.path().join("other.bin"), b"GGUF\x03\0\0\0").unwrap();
    refused(
        &b.addr,
        "0",
        "restore",
        Some("other.bin"),
        "not a gdsrun slot file",
    );
    let (code, r) = post(
        &b.addr,
        "/completion",
        &json!({"prompt": "hi", "n_predict": 1, "id_slot": 16}),
    );
    assert_eq!(
        (code, r["error"]["param"].as_str()),
        (400, Some("id_slot")),
        "{r}"
    );
    // the server goes on as before
    assert_eq!(complete(&b.addr, prompt, 24, -1).3, text);
    // a reply a stop string ends is kept as a finished one: its slot holds its tokens
    let word = text.split_whitespace().nth(5).unwrap();
    let (code, r) = post(
        &b.addr,
        "/completion",
        &json!({"prompt": prompt, "n_predict": 24, "temperature": 0, "id_slot": 7,
                "stop": [word]}),
    );
    assert_eq!((code, r["stop_type"].as_str()), (200, Some("word")), "{r}");
    let (code, r) = slot(&b.addr, "7", "erase", None);
    assert_eq!(code, 200, "{r}");
    assert!(r["n_erased"].as_u64().unwrap() > p, "{r}");

    // a server whose keys and values are of another type refuses the file by its fingerprint
    let f32 = start(&["--slot-save-path", d, "--kv-type", "f32"]);
    refused(
        &f32.addr,
        "0",
        "restore",
        Some("s1.bin"),
        "system_fingerprint",
    );
    // without --slot-save-path, as llama-server: 501
    let plain = start(&[]);
    let (code, r) = slot(&plain.addr, "0", "save", Some("s1.bin"));
    assert_eq!(code, 501, "{r}");
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--slot-save-path"));
}

/// Gemma 3 keeps its sliding-window layers' blocks in a pool of their own, released behind
/// the window: a slot longer than the window saves the window blocks still held with the
/// global layers' blocks, and a restored prompt longer than the window gives the same text.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_slot_of_a_sliding_window_model_round_trips() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // (a budget over what the whole context takes: the window layers get their own pool)
    let args = ["--slot-save-path", d, "--ctx", "4096", "--kv-budget", "256"];
    let gemma = gds_tests::gemma_converted();
    let a = start_model(gemma, &args);
    let prompt: String = (0..61)
        .map(|i| {
            let colour = ["red", "green", "blue", "small", "large"][i % 5];
            format!("Item {i}: the {colour} box holds {} marbles. ", i * 7 % 13)
        })
        .collect();
    let (_, m) = http(&a.addr, "GET", "/metrics", None);
    assert!(
        metric(&m, "gds_kv_window_blocks_total") > 0.0,
        "a window pool: {m}"
    );
    let (p, _, _, text) = complete(&a.addr, &prompt, 16, 2);
    assert!(p > 600, "longer than the 512-position window: {p}");
    assert_ne!(p % BLOCK, 1, "(a prompt that ends inside a block: {p})");
    let (code, r) = slot(&a.addr, "2", "save", Some("g.bin"));
    assert_eq!(code, 200, "{r}");
    drop(a);
    let b = start_model(gemma, &args);
    let (code, r) = slot(&b.addr, "0", "restore", Some("g.bin"));
    assert_eq!(code, 200, "{r}");
    let (p2, cached, _, again) = complete(&b.addr, &prompt, 16, -1);
    // (a model with window layers shares whole blocks only)
    assert_eq!((p2 + cached, cached), (p, (p - 1) / BLOCK * BLOCK));
    assert_eq!(again, text);
    // a SmolLM2 server refuses Gemma's file
    let smol = start(&["--slot-save-path", d]);
    let (code, r) = slot(&smol.addr, "0", "restore", Some("g.bin"));
    assert_eq!(code, 400, "{r}");
}
