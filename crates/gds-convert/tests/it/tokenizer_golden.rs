//! The tokenizer.json exported from a real GGUF must tokenize exactly like llama.cpp.
//!
//! Goldens: fixtures/tokenizer/<model>.ids.json, produced by scripts/gen_tokenizer_goldens.py
//! with llama.cpp's `llama-tokenize` over fixtures/tokenizer/corpus.json. The models live in
//! the git-ignored .cache/models/ (scripts/fetch-model.sh, scripts/fetch-gemma.sh); a missing
//! model is a test failure, not a skip.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use gds_convert::tokenizer::tokenizer_from_gguf;
use serde_json::Value;
use tokenizers::Tokenizer;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn id_lists(golden: &Value, key: &str) -> Vec<Vec<u32>> {
    let lists = golden[key]
        .as_array()
        .unwrap_or_else(|| panic!("golden lacks {key}"));
    lists
        .iter()
        .map(|l| {
            l.as_array()
                .expect("id list")
                .iter()
                .map(|v| u32::try_from(v.as_u64().expect("id")).expect("u32 id"))
                .collect()
        })
        .collect()
}

fn check_model(name: &str) {
    let root = root();
    let golden = read_json(&root.join(format!("fixtures/tokenizer/{name}.ids.json")));
    let corpus: Vec<String> =
        serde_json::from_value(read_json(&root.join("fixtures/tokenizer/corpus.json")))
            .expect("corpus is a list of strings");
    let file = golden["model_file"].as_str().expect("model_file");
    let fetch = golden["fetch_script"].as_str().expect("fetch_script");
    let gguf = root.join(".cache/models").join(file);
    assert!(
        gguf.exists(),
        "{} is missing: run {fetch} (and scripts/fetch-model.sh) before the tests",
        gguf.display()
    );

    let mut container = gguf_rs::get_gguf_container_array_size(gguf.to_str().unwrap(), u64::MAX)
        .expect("open GGUF");
    let model = container.decode().expect("decode GGUF");
    let meta: BTreeMap<String, Value> = model.metadata().clone();
    let export = tokenizer_from_gguf(&meta).expect("export tokenizer");
    let tok = Tokenizer::from_str(&export.tokenizer_json).expect("tokenizer.json loads");
    // The exporter writes the BPE model and the added tokens itself (building the library's
    // maps first took most of a 262k-token export): what it writes is exactly what the
    // library writes for the tokenizer it reads from it.
    let ours: Value = serde_json::from_str(&export.tokenizer_json).unwrap();
    let again: Value = serde_json::from_str(&tok.to_string(false).unwrap()).unwrap();
    assert!(
        ours == again,
        "{name}: tokenizer.json differs from the library's serialization"
    );
    // The converter reads the vocabulary arrays in place (hidden from gguf-rs, which would
    // decode them into JSON values): it must export exactly what the decoded metadata gives.
    let mut source = gds_convert::gguf::read_gguf(&gguf).expect("read GGUF for conversion");
    let (files, warnings) = source
        .pending_tokenizer
        .take()
        .expect("the GGUF has a tokenizer")
        .run();
    assert!(warnings.is_empty(), "{name}: {warnings:?}");
    assert!(
        files.tokenizer_json.as_deref() == Some(export.tokenizer_json.as_str()),
        "{name}: the converter's tokenizer.json (arrays read in place) differs from the export of the decoded metadata"
    );
    assert_eq!(
        files.tokenizer_config_json.as_deref(),
        Some(export.tokenizer_config_json.as_str()),
        "{name}: tokenizer_config.json"
    );

    let mut tok_plain = tok.clone();
    tok_plain.set_encode_special_tokens(true);

    let expected = id_lists(&golden, "parse_special");
    let expected_plain = id_lists(&golden, "no_parse_special");
    assert_eq!(
        expected.len(),
        corpus.len(),
        "golden and corpus differ in length: regenerate"
    );
    assert_eq!(expected_plain.len(), corpus.len());

    let mut mismatches = Vec::new();
    for (i, text) in corpus.iter().enumerate() {
        for (mode, t, want) in [
            ("parse_special", &tok, &expected[i]),
            ("no_parse_special", &tok_plain, &expected_plain[i]),
        ] {
            let got = t
                .encode(text.as_str(), true)
                .expect("encode")
                .get_ids()
                .to_vec();
            if &got != want {
                mismatches.push(format!(
                    "#{i} {text:?} [{mode}]\n    llama.cpp: {want:?}\n    exported:  {got:?}"
                ));
            }
        }
        // Decoding the ids (without BOS/EOS) gives the text back; SentencePiece vocabularies
        // cannot tell a literal '▁' from an escaped space.
        let ids = tok
            .encode(text.as_str(), false)
            .expect("encode")
            .get_ids()
            .to_vec();
        let back = tok.decode(&ids, false).expect("decode");
        let spm = meta["tokenizer.ggml.model"] == "llama";
        let want_back = if spm {
            text.replace('\u{2581}', " ")
        } else {
            text.clone()
        };
        if back != want_back {
            mismatches.push(format!("#{i} {text:?} [decode round trip] gave {back:?}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{name}: {} mismatches with llama.cpp:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );

    // tokenizer_config.json names the same special tokens llama.cpp uses.
    let config: Value = serde_json::from_str(&export.tokenizer_config_json).expect("config JSON");
    let tokens = meta["tokenizer.ggml.tokens"].as_array().expect("tokens");
    for (field, key) in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")] {
        let id = meta[&format!("tokenizer.ggml.{key}")].as_u64().expect("id") as usize;
        assert_eq!(config[field], tokens[id], "{field}");
    }
    assert_eq!(
        config["add_bos_token"],
        meta["tokenizer.ggml.add_bos_token"]
    );
    if let Some(t) = meta.get("tokenizer.chat_template") {
        assert_eq!(&config["chat_template"], t);
    }
}

/// SmolLM2-135M: byte-level BPE, `tokenizer.ggml.pre = "smollm"`.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn smollm2_matches_llama_cpp() {
    check_model("smollm2-135m");
}

/// Gemma 3 270M: SentencePiece ("llama") vocabulary with scores, byte fallback and
/// user-defined whitespace/HTML tokens.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gemma3_matches_llama_cpp() {
    check_model("gemma3-270m");
}
