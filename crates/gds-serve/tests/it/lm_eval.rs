//! lm-evaluation-harness as an evaluator: its `local-completions` model runs the local tasks
//! of `fixtures/lm-eval` (40 multiple-choice questions scored by log-likelihood through
//! `/v1/completions` with `echo` and `logprobs`, batched as lists of token-id lists; 16
//! greedy generations) against `gdsrun serve`, and the results are compared with lm-eval's
//! `hf` backend (transformers, float32) on the same weights
//! (`fixtures/lm-eval/hf-smollm2-f32.json`, by `scripts/reference/lm_eval_golden.py`).
//! The harness tokenizes with the server's own tokenizer (`/tokenizer_info`, `/tokenize`),
//! which these tests also check directly.

use serde_json::Value;

use crate::common;
use crate::common::{http, python, serial, start_model};

/// SmolLM2 from the F16 Hugging Face directory the reference ran on, converted into `dir`.
fn smollm_f16(dir: &std::path::Path) -> std::path::PathBuf {
    let out = dir.join("smollm2-f16.gds");
    gds_convert::convert(
        &gds_tests::smollm_hf_f16(),
        &out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .expect("convert");
    out
}

fn post(addr: &str, path: &str, body: Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some(body.to_string().as_bytes()));
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn lm_eval_scores_like_the_transformers_backend() {
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let tmp = tempfile::tempdir().unwrap();
    let model = smollm_f16(tmp.path());
    // float activations: the reference's arithmetic (F16 weights are multiplied in f32
    // either way; named so that the comparison does not hang on that default)
    let s = start_model(&model, &["--activations", "f32"]);
    let r = python(
        "lm_eval_check.py",
        &[
            &format!("http://{}/v1", s.addr),
            &gds_tests::fixture("lm-eval/hf-smollm2-f32.json").to_string_lossy(),
        ],
    );
    eprintln!("{r:#}");
    assert_eq!(r["n_mc"], 40);
    assert_eq!(r["n_loglik"], 160);
    assert_eq!(r["n_gen"], 16);
    // The same F16 weights in float32 on both sides; only the order of the sums differs
    // (blocked SIMD dot products here, BLAS there): measured 4e-4 at most over 160
    // log-likelihoods of 1-4 tokens each. 0.01 leaves room for other CPUs' code paths and
    // is still far below the gaps that decide an item (a tenth or more).
    let max = r["loglik_max_abs_diff"].as_f64().unwrap();
    assert!(max < 0.01, "per-item log-likelihoods differ by up to {max}");
    // hence the same answers, and accuracy within a question (2.5 points)
    let differs = r["choice_differs"].as_array().unwrap();
    assert!(differs.len() <= 1, "chosen answers differ: {differs:?}");
    for (ours, theirs) in [
        ("acc", "ref_acc"),
        ("acc_norm", "ref_acc_norm"),
        ("exact_match", "ref_exact_match"),
    ] {
        let (a, b) = (r[ours].as_f64().unwrap(), r[theirs].as_f64().unwrap());
        assert!((a - b).abs() <= 0.026, "{ours} {a} vs {b}");
    }
    // greedy generations: the same text, at most one near-tie apart
    let gen = r["gen_differs"].as_array().unwrap();
    assert!(gen.len() <= 1, "generations differ: {gen:?}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_tokenizer_is_served() {
    let _one = serial();
    let s = common::start(&[]);
    let tok =
        tokenizers::Tokenizer::from_file(gds_tests::smollm_converted().join("tokenizer.json"))
            .unwrap();
    let (st, info) = http(&s.addr, "GET", "/tokenizer_info", None);
    assert_eq!(st, 200, "{info}");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["eos_token"], "<|im_end|>");
    assert_eq!(info["eos_token_id"], 2);
    assert_eq!(info["model_max_length"], 1024);
    assert!(info["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));

    // text: the tokenizer's ids; special-token texts parsed unless asked not to
    let text = "Hello <|im_end|> world 12345";
    let (st, r) = post(
        &s.addr,
        "/tokenize",
        serde_json::json!({"prompt": text, "return_token_strs": true}),
    );
    assert_eq!(st, 200, "{r}");
    let want: Vec<u32> = tok.encode(text, false).unwrap().get_ids().to_vec();
    let ids: Vec<u32> = serde_json::from_value(r["tokens"].clone()).unwrap();
    assert_eq!(ids, want);
    assert!(ids.contains(&2));
    assert_eq!(r["count"], want.len());
    assert_eq!(r["token_strs"][0], "Hello");
    let (_, lit) = post(
        &s.addr,
        "/tokenize",
        serde_json::json!({"content": text, "parse_special": false}),
    );
    let lit: Vec<u32> = serde_json::from_value(lit["tokens"].clone()).unwrap();
    assert!(!lit.contains(&2) && lit.len() > ids.len(), "{lit:?}");

    // back to text, special tokens kept
    let (st, d) = post(&s.addr, "/detokenize", serde_json::json!({ "tokens": ids }));
    assert_eq!(st, 200);
    assert_eq!(d["prompt"], tok.decode(&ids, false).unwrap().as_str());
    assert!(d["prompt"].as_str().unwrap().contains("<|im_end|>"));

    // a chat: the same ids the chat endpoint would run
    let (st, c) = post(
        &s.addr,
        "/tokenize",
        serde_json::json!({"messages": [{"role": "user", "content": "hi <|im_end|>"}]}),
    );
    assert_eq!(st, 200, "{c}");
    let chat: Vec<u32> = serde_json::from_value(c["tokens"].clone()).unwrap();
    assert_eq!(chat.first(), Some(&1), "<|im_start|> opens the chat");
    // the message's special-token text stays text: two <|im_end|> (system and user turns)
    assert_eq!(chat.iter().filter(|&&t| t == 2).count(), 2, "{chat:?}");
    // vLLM's chat fields, as the chat endpoint takes them: the same tokens it counts
    let messages = serde_json::json!([{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "Hello, I"}]);
    for extra in [
        serde_json::json!({}),
        serde_json::json!({"add_generation_prompt": false}),
        serde_json::json!({"continue_final_message": true}),
        serde_json::json!({"chat_template_kwargs": {"enable_thinking": false}}),
    ] {
        let mut body = extra.clone();
        body["messages"] = messages.clone();
        let (st, t) = post(&s.addr, "/tokenize", body.clone());
        assert_eq!(st, 200, "{t}");
        let (_, n) = post(&s.addr, "/v1/chat/completions/input_tokens", body);
        assert_eq!(t["count"], n["input_tokens"], "{extra}");
    }
    let count = |extra: serde_json::Value| {
        let mut body = extra;
        body["messages"] = messages.clone();
        post(&s.addr, "/tokenize", body).1["count"]
            .as_u64()
            .unwrap()
    };
    let closed = count(serde_json::json!({"add_generation_prompt": false}));
    let opened = count(serde_json::json!({}));
    let continued = count(serde_json::json!({"continue_final_message": true}));
    assert!(
        closed < opened && continued < closed,
        "{closed} {opened} {continued}"
    );

    // bad input: 400 naming the field
    for (path, body, param) in [
        (
            "/detokenize",
            serde_json::json!({"tokens": [49152]}),
            "tokens",
        ),
        ("/detokenize", serde_json::json!({"tokens": [-1]}), "tokens"),
        ("/tokenize", serde_json::json!({}), "prompt"),
        (
            "/tokenize",
            serde_json::json!({"prompt": "a", "messages": []}),
            "messages",
        ),
    ] {
        let (st, e) = post(&s.addr, path, body.clone());
        assert_eq!(st, 400, "{path} {body}: {e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
}
