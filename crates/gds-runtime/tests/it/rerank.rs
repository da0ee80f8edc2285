//! Rerankers on the tiny Qwen3-Reranker of `fixtures/make_reranker_fixture.py` (random
//! weights made by transformers; its GGUF made by llama.cpp's converter): both inputs give
//! the same classifier head and rerank prompt, the prompts tokenize as transformers and
//! llama-server tokenized them, and the CPU model's last hidden state through the head gives
//! transformers' scores (fixtures/reference/rerank-tiny-qwen3.json).

use gds_runtime::rank::{fill, RankHead, HEAD_TENSOR};
use gds_runtime::{Batch, Config, KvCache, KvDtype, Model, RunState, TextTokenizer};
use serde_json::Value;
use std::path::Path;

fn golden() -> Value {
    let p = gds_tests::fixture("reference/rerank-tiny-qwen3.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The final-normed hidden state of the last of `tokens` (f32 activations and KV).
fn last_hidden(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let c = &model.config;
    let n = tokens.len();
    let mut st = RunState::new(c, n, n, model.ctx(), model.threads());
    let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, model.ctx(), c.kv_dim());
    let mut batch = Batch::with_capacity(n);
    for (i, &t) in tokens.iter().enumerate() {
        if i + 1 == n {
            batch.push_hidden(t, i, 0);
        } else {
            batch.push(t, i, 0, false);
        }
    }
    model.forward(&mut st, &mut kv, &batch).unwrap();
    st.hidden(0, c.n_embd).to_vec()
}

#[test]
fn a_reranker_from_hf_or_gguf_scores_as_transformers() {
    let g = golden();
    let (_a, hf) = gds_tests::converted_fixture("tiny-qwen3-reranker-hf");
    let (_b, gguf) = gds_tests::converted_fixture("tiny-qwen3-reranker.gguf");
    let (th, tg) = (gds_tests::tensor_bytes(&hf), gds_tests::tensor_bytes(&gguf));
    // the head: the LM head's rows of "yes" and "no", the same bytes from either input;
    // the HF model keeps its LM head, llama.cpp's converter drops it
    assert_eq!(th[HEAD_TENSOR], tg[HEAD_TENSOR]);
    let (yes, no) = (g["yes_id"].as_u64().unwrap(), g["no_id"].as_u64().unwrap());
    let lm = &th["output.weight"].1;
    let row = th[HEAD_TENSOR].1.len() / 2;
    assert_eq!(
        th[HEAD_TENSOR].1,
        [
            &lm[yes as usize * row..][..row],
            &lm[no as usize * row..][..row]
        ]
        .concat()
    );
    assert!(!tg.contains_key("output.weight"));
    for dir in [&hf, &gguf] {
        check(dir, &g);
    }
}

fn check(dir: &Path, g: &Value) {
    let head = RankHead::load(dir, true).unwrap().expect("a rank head");
    // the template: llama.cpp's, whether read from the GGUF or written for the HF input
    assert_eq!(head.template(), g["template"].as_str(), "{}", dir.display());
    let bytes = std::fs::read(dir.join(gds_format::MANIFEST_FILE)).unwrap();
    let m = gds_runtime::plan::parse_manifest(dir, &bytes).unwrap();
    let cfg = Config::from_manifest(&m).unwrap();
    let tok = TextTokenizer::load(dir, &cfg).unwrap();
    let mut model = Model::load(dir, 1024, 1).unwrap();
    model.set_f32_activations(true);
    let mut worst = 0f64;
    for (ci, case) in g["cases"].as_array().unwrap().iter().enumerate() {
        let query = case["query"].as_str().unwrap();
        for (di, doc) in case["documents"].as_array().unwrap().iter().enumerate() {
            let want = &g["transformers"][ci][di];
            let text = fill(head.template().unwrap(), query, doc.as_str().unwrap());
            assert_eq!(text, want["prompt"].as_str().unwrap());
            let tokens = tok.encode(&text, false, true).unwrap();
            assert_eq!(tokens, ids(&want["tokens"]), "case {ci} document {di}");
            assert_eq!(
                tokens,
                ids(&g["llama_server"]["tokenize"][ci][di]),
                "case {ci} document {di}"
            );
            let score = head.score(&last_hidden(&model, &tokens)) as f64;
            worst = worst.max((score - want["score"].as_f64().unwrap()).abs());
        }
    }
    // float32 on both sides; measured 1.7e-6
    assert!(worst < 2e-5, "{}: max |score diff| {worst}", dir.display());
}

#[test]
fn models_without_a_head_have_none() {
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-hf");
    assert!(RankHead::load(&dir, true).unwrap().is_none());
}

#[test]
fn a_head_of_the_wrong_shape_is_an_error_naming_it() {
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-reranker.gguf");
    // the head's record, [2, 32], made [1, 64] (the same bytes), re-sealed as a forger would:
    // a well-formed manifest whose head does not fit the model
    let p = dir.join(gds_format::MANIFEST_FILE);
    let mut b = std::fs::read(&p).unwrap();
    let shape = |dims: [u64; 4]| -> Vec<u8> { dims.iter().flat_map(|d| d.to_le_bytes()).collect() };
    let (from, to) = (shape([2, 32, 0, 0]), shape([1, 64, 0, 0]));
    let at: Vec<usize> = (0..b.len() - from.len())
        .filter(|&i| b[i..i + from.len()] == from[..])
        .collect();
    assert_eq!(at.len(), 1, "one [2, 32] tensor: the head");
    b[at[0]..at[0] + to.len()].copy_from_slice(&to);
    gds_tests::reseal(&mut b);
    std::fs::write(&p, b).unwrap();
    let err = RankHead::load(&dir, true).unwrap_err().to_string();
    assert!(
        err.contains(HEAD_TENSOR) && err.contains("[1, 64]"),
        "{err}"
    );
}
