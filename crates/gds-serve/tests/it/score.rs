//! vLLM's Score API (`/score`, `/v1/score`) and `truncate_prompt_tokens`, and llama-server's
//! `--pooling none`:
//! - on the tiny Qwen3-Reranker (`fixtures/make_reranker_fixture.py`): every request form
//!   scores each pair as transformers does (fixtures/reference/rerank-tiny-qwen3.json: the
//!   probability of "yes", and with `use_activation: false` the "yes" − "no" logit), as
//!   `/rerank` does, 1:N and N:N; truncation; the errors;
//! - on SmolLM2 (no head): the cosine similarity of the texts' `/v1/embeddings` vectors;
//! - `--pooling none`: `/embedding` gives every token's state, whose mean, last and first
//!   are llama-server's mean, last and cls embeddings (fixtures/reference/
//!   embeddings-smollm2.json); the one-vector endpoints refuse it.

use crate::common::{serial, start, start_model};
use serde_json::{json, Value};

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (code, text) = crate::common::http(addr, "POST", path, Some(body.to_string().as_bytes()));
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (code, v)
}

fn golden(name: &str) -> Value {
    let path = gds_tests::fixture(&format!("reference/{name}"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The scores of a `/score` answer, checked in order of `index`.
fn scores(r: &Value) -> Vec<f64> {
    assert_eq!(r["object"], "list", "{r}");
    r["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i, "{r}");
            assert_eq!(d["object"], "score", "{r}");
            d["score"].as_f64().unwrap()
        })
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
#[ignore = "tier 2: starts gdsrun serve (scripts/test.sh)"]
fn a_reranker_scores_pairs_as_transformers_and_rerank() {
    let _one = serial();
    let g = golden("rerank-tiny-qwen3.json");
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-reranker.gguf");
    let s = start_model(
        &dir,
        &["--ctx", "2048", "--activations", "f32", "--kv-type", "f32"],
    );
    let case = &g["cases"][0];
    let (q, docs) = (&case["query"], &case["documents"]);
    let n = docs.as_array().unwrap().len();
    let want: Vec<f64> = (0..n)
        .map(|i| g["transformers"][0][i]["score"].as_f64().unwrap())
        .collect();
    let (_, rr) = post(&s.addr, "/rerank", case);
    let mut by_rerank = vec![0.0; n];
    for x in rr["results"].as_array().unwrap() {
        by_rerank[x["index"].as_u64().unwrap() as usize] = x["relevance_score"].as_f64().unwrap();
    }
    // vLLM's four request forms, on both paths
    for (path, body) in [
        ("/score", json!({"text_1": q, "text_2": docs})),
        ("/v1/score", json!({"text_1": q, "text_2": docs})),
        ("/score", json!({"queries": q, "documents": docs})),
        ("/score", json!({"queries": q, "items": docs})),
        (
            "/score",
            json!({"data_1": [q], "data_2": docs, "model": "m"}),
        ),
    ] {
        let (code, r) = post(&s.addr, path, &body);
        assert_eq!(code, 200, "{path} {body}: {r}");
        let got = scores(&r);
        assert_eq!(got.len(), n);
        for i in 0..n {
            assert!(
                (got[i] - want[i]).abs() < 1e-5,
                "{path} pair {i}: {} vs {}",
                got[i],
                want[i]
            );
            assert_eq!(got[i], by_rerank[i], "{path} pair {i}: /rerank's score");
        }
        assert_eq!(
            r["usage"]["prompt_tokens"], rr["usage"]["prompt_tokens"],
            "{r}"
        );
        assert_eq!(r["usage"]["completion_tokens"], 0);
        assert!(r["id"].as_str().unwrap().starts_with("score-"));
        let model = if body.get("model").is_some() { "m" } else { "" };
        if !model.is_empty() {
            assert_eq!(r["model"], model);
        }
    }
    // N:N pairs, in the order given; one pair of strings
    let d = docs.as_array().unwrap();
    let (_, r) = post(
        &s.addr,
        "/score",
        &json!({"text_1": [q, q], "text_2": [d[2], d[0]]}),
    );
    assert_eq!(scores(&r), [by_rerank[2], by_rerank[0]]);
    let (_, r) = post(&s.addr, "/score", &json!({"text_1": q, "text_2": d[1]}));
    assert_eq!(scores(&r), [by_rerank[1]]);
    // before the activation: transformers' "yes" − "no" logit, whose sigmoid is the score
    // (also from /rerank)
    for (path, body) in [
        (
            "/score",
            json!({"text_1": q, "text_2": docs, "use_activation": false}),
        ),
        (
            "/rerank",
            json!({"query": q, "documents": docs, "use_activation": false}),
        ),
        (
            "/score",
            json!({"text_1": q, "text_2": docs, "softmax": false}),
        ),
    ] {
        let (code, r) = post(&s.addr, path, &body);
        assert_eq!(code, 200, "{r}");
        let got: Vec<f64> = if path == "/rerank" {
            let mut v = vec![0.0; n];
            for x in r["results"].as_array().unwrap() {
                v[x["index"].as_u64().unwrap() as usize] = x["relevance_score"].as_f64().unwrap();
            }
            v
        } else {
            scores(&r)
        };
        for i in 0..n {
            let t = &g["transformers"][0][i];
            let logit = t["logit_yes"].as_f64().unwrap() - t["logit_no"].as_f64().unwrap();
            assert!(
                (got[i] - logit).abs() < 1e-5,
                "{path} {i}: {} vs {logit}",
                got[i]
            );
            let p = 1.0 / (1.0 + (-got[i]).exp());
            assert!((p - by_rerank[i]).abs() < 1e-6, "{path} {i}");
        }
    }
    // truncate_prompt_tokens: each prompt cut to k tokens (the last k, or the first with
    // truncation_side "right"); -1 is the context, which cuts nothing here
    let body = |k: Value, side: Value| json!({"text_1": q, "text_2": docs, "truncate_prompt_tokens": k, "truncation_side": side});
    let (_, r) = post(&s.addr, "/score", &body(json!(-1), Value::Null));
    assert_eq!(scores(&r), by_rerank);
    let (_, last) = post(&s.addr, "/score", &body(json!(40), Value::Null));
    let (_, first) = post(&s.addr, "/score", &body(json!(40), json!("right")));
    for r in [&last, &first] {
        assert_eq!(r["usage"]["prompt_tokens"], 40 * n, "{r}");
    }
    // the prompts differ only in the middle: their last 40 tokens (the document's end and
    // the template's tail) differ, their first 40 (the template's head) do not
    let (l, f) = (scores(&last), scores(&first));
    assert!(l.windows(2).any(|w| w[0] != w[1]), "{l:?}");
    assert!(f.windows(2).all(|w| w[0] == w[1]), "{f:?}");
    assert!(l.iter().zip(&by_rerank).all(|(a, b)| a != b), "{l:?}");
    let (_, r) = post(
        &s.addr,
        "/rerank",
        &json!({"query": q, "documents": docs, "truncate_prompt_tokens": 40}),
    );
    assert_eq!(r["usage"]["prompt_tokens"], 40 * n, "{r}");

    // errors: 400s naming the field
    for (body, param) in [
        (
            json!({"text_1": [q, q], "text_2": [d[0], d[1], d[2]]}),
            "text_1",
        ),
        (json!({"text_1": q}), "text_2"),
        (json!({"documents": docs}), "queries"),
        (json!({}), "text_1"),
        (json!({"text_1": q, "text_2": []}), "text_2"),
        (json!({"text_1": q, "text_2": [1]}), "text_2"),
        (json!({"text_1": {"content": []}, "text_2": "a"}), "text_1"),
        (
            json!({"text_1": q, "text_2": "a", "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"text_1": q, "text_2": "a", "truncate_prompt_tokens": "5"}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"text_1": q, "text_2": "a", "truncate_prompt_tokens": 5, "truncation_side": "middle"}),
            "truncation_side",
        ),
    ] {
        let (code, r) = post(&s.addr, "/score", &body);
        assert_eq!(code, 400, "{body}: {r}");
        assert_eq!(r["error"]["param"], param, "{body}: {r}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn without_a_head_the_score_is_the_cosine_of_the_embeddings() {
    let _one = serial();
    let s = start(&["--ctx", "512"]);
    let texts = [
        "The sky is blue.",
        "The sky is azure.",
        "def add(a, b): return a + b",
    ];
    let (code, e) = post(&s.addr, "/v1/embeddings", &json!({"input": texts}));
    assert_eq!(code, 200, "{e}");
    let v: Vec<Vec<f64>> = (0..3).map(|i| floats(&e["data"][i]["embedding"])).collect();
    let (code, r) = post(
        &s.addr,
        "/score",
        &json!({"text_1": texts[0], "text_2": [texts[1], texts[2]]}),
    );
    assert_eq!(code, 200, "{r}");
    let got = scores(&r);
    for (k, j) in [(0, 1), (1, 2)] {
        let want = cosine(&v[0], &v[j]);
        assert!(
            (got[k] - want).abs() < 1e-5,
            "pair {k}: {} vs {want}",
            got[k]
        );
    }
    // the similar sentences are closer than the code
    assert!(got[0] > got[1], "{got:?}");
    let tokens = e["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(r["usage"]["prompt_tokens"], tokens, "{r}");
    // N:N
    let (_, r) = post(
        &s.addr,
        "/v1/score",
        &json!({"queries": [texts[2], texts[1]], "documents": [texts[0], texts[0]]}),
    );
    let got = scores(&r);
    assert!((got[0] - cosine(&v[2], &v[0])).abs() < 1e-5, "{got:?}");
    assert!((got[1] - cosine(&v[1], &v[0])).abs() < 1e-5, "{got:?}");
    // truncated embeddings: the last token alone is that token's embedding
    let (_, one) = post(
        &s.addr,
        "/v1/embeddings",
        &json!({"input": texts[0], "truncate_prompt_tokens": 1}),
    );
    assert_eq!(one["usage"]["prompt_tokens"], 1, "{one}");
    let (_, ids) = post(&s.addr, "/tokenize", &json!({"prompt": texts[0]}));
    let last = ids["tokens"].as_array().unwrap().last().unwrap().clone();
    let (_, alone) = post(&s.addr, "/v1/embeddings", &json!({"input": [last]}));
    assert_eq!(one["data"][0]["embedding"], alone["data"][0]["embedding"]);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn pooling_none_gives_every_token_state() {
    let _one = serial();
    let g = golden("embeddings-smollm2.json");
    let texts: Vec<Value> = g["texts"].as_array().unwrap().clone();
    let s = start(&["--pooling", "none", "--ctx", "512"]);
    let mut tokens = 0;
    for (i, t) in texts.iter().enumerate() {
        let (code, r) = post(&s.addr, "/embedding", &json!({"content": t}));
        assert_eq!(code, 200, "{r}");
        let rows: Vec<Vec<f64>> = r[0]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(floats)
            .collect();
        let (_, ids) = post(&s.addr, "/tokenize", &json!({"prompt": t}));
        assert_eq!(
            rows.len(),
            ids["tokens"].as_array().unwrap().len(),
            "text {i}"
        );
        tokens += rows.len();
        // not normalized (llama-server's test_embedding_pooling_none)
        for row in &rows {
            assert_eq!(row.len(), 576);
            let n: f64 = row.iter().map(|x| x * x).sum();
            assert!((n - 1.0).abs() > 1e-3, "text {i}: a normalized row");
        }
        let mean: Vec<f64> = (0..576)
            .map(|k| rows.iter().map(|r| r[k]).sum::<f64>() / rows.len() as f64)
            .collect();
        // llama.cpp's own kernels and ours differ in the last bits (as in embeddings.rs)
        for (pooling, v) in [
            ("mean", &mean),
            ("last", rows.last().unwrap()),
            ("cls", &rows[0]),
        ] {
            let want = floats(&g["pooling"][pooling]["embeddings"][i]);
            let c = cosine(v, &want);
            assert!(
                c > 0.999,
                "text {i}, {pooling}: cosine {c} to llama-server's"
            );
        }
    }
    assert_eq!(
        tokens as u64,
        g["pooling"]["mean"]["prompt_tokens"].as_u64().unwrap()
    );
    // llama-server's `/embeddings` is its `/embedding` (here OpenAI's, except with none)
    let one = json!({"content": texts[1]});
    assert_eq!(
        post(&s.addr, "/embeddings", &one),
        post(&s.addr, "/embedding", &one)
    );
    // the endpoints of one vector an input refuse it (llama-server's
    // test_embedding_pooling_none_oai), and the server still answers
    for (path, body) in [
        ("/v1/embeddings", json!({"input": "hello"})),
        ("/api/embed", json!({"model": "m", "input": "hello"})),
        ("/score", json!({"text_1": "a", "text_2": "b"})),
    ] {
        let (code, r) = post(&s.addr, path, &body);
        assert_eq!(code, 400, "{path}: {r}");
        assert!(r.to_string().contains("--pooling none"), "{path}: {r}");
    }
    // an answer bounded: 2048 inputs of 16 tokens × 576 values is past 8 M values
    let many = vec![json!("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"); 2048];
    let (code, r) = post(&s.addr, "/embedding", &json!({"content": many}));
    assert_eq!(code, 400, "{r}");
    assert_eq!(r["error"]["param"], "input", "{r}");
    let (code, _) = post(&s.addr, "/embedding", &json!({"content": "hello"}));
    assert_eq!(code, 200);
}
