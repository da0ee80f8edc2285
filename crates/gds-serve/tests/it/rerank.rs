//! `/rerank` on the tiny Qwen3-Reranker of `fixtures/make_reranker_fixture.py` (its GGUF made
//! by llama.cpp's converter): the scores of transformers and of llama-server on the same
//! file (fixtures/reference/rerank-tiny-qwen3.json) and llama-server's token counts, under
//! every path; Jina's and TEI's answers, `top_n`, the documents returned; the errors; a
//! model without a head; `gdsrun batch` lines (`/v1/rerank`, `/v1/score`).

use crate::common::{http, serial, start_model};
use serde_json::{json, Value};

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (code, text) = http(addr, "POST", path, Some(body.to_string().as_bytes()));
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (code, v)
}

fn golden() -> Value {
    let path = gds_tests::fixture("reference/rerank-tiny-qwen3.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// (index, score) of Jina's `results` or TEI's list, checked sorted highest first.
fn ranked(results: &Value, score: &str) -> Vec<(usize, f64)> {
    let r: Vec<(usize, f64)> = results
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["index"].as_u64().unwrap() as usize,
                x[score].as_f64().unwrap(),
            )
        })
        .collect();
    assert!(r.windows(2).all(|w| w[0].1 >= w[1].1), "not sorted: {r:?}");
    r
}

#[test]
#[ignore = "tier 2: starts gdsrun serve (scripts/test.sh)"]
fn rerank_scores_as_transformers_and_llama_server() {
    let _one = serial();
    let g = golden();
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-reranker.gguf");
    // f32 activations and KV: the references' arithmetic
    let s = start_model(
        &dir,
        &["--ctx", "2048", "--activations", "f32", "--kv-type", "f32"],
    );
    for (ci, case) in g["cases"].as_array().unwrap().iter().enumerate() {
        let llama = &g["llama_server"]["rerank"][ci];
        let mut first: Option<Vec<(usize, f64)>> = None;
        for path in [
            "/rerank",
            "/reranking",
            "/v1/rerank",
            "/v1/reranking",
            "/v2/rerank",
        ] {
            let (code, r) = post(&s.addr, path, case);
            assert_eq!(code, 200, "{path}: {r}");
            assert_eq!(r["object"], "list");
            assert_eq!(
                r["usage"], llama["usage"],
                "{path}: llama-server's token counts"
            );
            let got = ranked(&r["results"], "relevance_score");
            let n = case["documents"].as_array().unwrap().len();
            assert_eq!(got.len(), n);
            for &(i, score) in &got {
                let t = g["transformers"][ci][i]["score"].as_f64().unwrap();
                assert!((score - t).abs() < 1e-5, "{path} doc {i}: {score} vs {t}");
            }
            // llama-server's order and scores
            let theirs = ranked(&llama["results"], "relevance_score");
            for (&(i, a), &(j, b)) in got.iter().zip(&theirs) {
                assert_eq!(i, j, "{path}: order");
                assert!((a - b).abs() < 1e-5, "{path} doc {i}: {a} vs {b}");
            }
            // every path answers alike
            match &first {
                None => first = Some(got),
                Some(f) => assert_eq!(&got, f, "{path}"),
            }
        }
    }

    let case = &g["cases"][0];
    let docs = case["documents"].clone();
    let full = ranked(
        &post(&s.addr, "/rerank", case).1["results"],
        "relevance_score",
    );
    // top_n, in both formats (llama.cpp's test_rerank_top_n, test_rerank_tei_top_n)
    for (top_n, want) in [
        (json!(null), 4),
        (json!(2), 2),
        (json!(4), 4),
        (json!(99), 4),
        (json!(0), 0),
    ] {
        let (code, r) = post(
            &s.addr,
            "/rerank",
            &json!({"query": case["query"], "documents": docs, "top_n": top_n}),
        );
        assert_eq!(code, 200, "{r}");
        assert_eq!(ranked(&r["results"], "relevance_score"), full[..want]);
        let (code, r) = post(
            &s.addr,
            "/rerank",
            &json!({"query": case["query"], "texts": docs, "top_n": top_n}),
        );
        assert_eq!(code, 200, "{r}");
        assert_eq!(ranked(&r, "score"), full[..want], "TEI");
    }
    // the texts returned where asked: TEI's return_text, Jina's and Cohere's
    // return_documents (documents given as strings or as {"text"} objects)
    let (_, r) = post(
        &s.addr,
        "/rerank",
        &json!({"query": case["query"], "texts": docs, "return_text": true}),
    );
    for x in r.as_array().unwrap() {
        assert_eq!(x["text"], docs[x["index"].as_u64().unwrap() as usize]);
    }
    let objects: Vec<Value> = docs
        .as_array()
        .unwrap()
        .iter()
        .map(|d| json!({"text": d}))
        .collect();
    let (code, r) = post(
        &s.addr,
        "/v1/rerank",
        &json!({"model": "my-reranker", "query": case["query"], "documents": objects, "return_documents": true}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["model"], "my-reranker");
    assert_eq!(ranked(&r["results"], "relevance_score"), full);
    for x in r["results"].as_array().unwrap() {
        assert_eq!(
            x["document"]["text"],
            docs[x["index"].as_u64().unwrap() as usize]
        );
    }
    let (_, r) = post(&s.addr, "/rerank", case);
    assert!(r["results"][0].get("document").is_none());

    // errors: 400s naming the field (llama.cpp's test_invalid_rerank_req and more)
    let long = "word ".repeat(1000);
    for (body, param) in [
        (json!({"query": "q", "documents": []}), "documents"),
        (json!({"query": "q", "documents": null}), "documents"),
        (json!({"query": "q", "documents": 123}), "documents"),
        (json!({"query": "q", "documents": [1, 2, 3]}), "documents"),
        (
            json!({"query": "q", "documents": [{"txt": "a"}]}),
            "documents",
        ),
        (json!({"query": "q"}), "documents"),
        (json!({"query": "q", "texts": "a"}), "texts"),
        (json!({"documents": ["a"]}), "query"),
        (json!({"query": 5, "documents": ["a"]}), "query"),
        (
            json!({"query": "q", "documents": ["a"], "top_n": -1}),
            "top_n",
        ),
        (
            json!({"query": "q", "documents": ["a"], "top_n": "2"}),
            "top_n",
        ),
        (json!({"query": "q", "documents": ["a", long]}), "documents"),
    ] {
        let (code, r) = post(&s.addr, "/rerank", &body);
        assert_eq!(code, 400, "{body}: {r}");
        assert_eq!(r["error"]["param"], param, "{body}: {r}");
    }
    let (_, r) = post(
        &s.addr,
        "/rerank",
        &json!({"query": "q", "documents": ["a", long]}),
    );
    assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
    // the server still answers
    let (code, _) = post(&s.addr, "/rerank", case);
    assert_eq!(code, 200);
}

#[test]
#[ignore = "tier 2: starts gdsrun serve (scripts/test.sh)"]
fn rerank_with_the_default_arithmetic_keeps_the_order() {
    let _one = serial();
    let g = golden();
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-reranker-hf");
    // 8-bit activations and an f16 KV cache (the defaults), on the Hugging Face input
    let s = start_model(&dir, &["--ctx", "2048"]);
    for (ci, case) in g["cases"].as_array().unwrap().iter().enumerate() {
        let (code, r) = post(&s.addr, "/rerank", case);
        assert_eq!(code, 200, "{r}");
        let got = ranked(&r["results"], "relevance_score");
        let want = ranked(
            &g["llama_server"]["rerank"][ci]["results"],
            "relevance_score",
        );
        for (&(i, a), &(j, b)) in got.iter().zip(&want) {
            assert_eq!(i, j, "order");
            // measured 6.4e-4
            assert!((a - b).abs() < 3e-3, "doc {i}: {a} vs {b}");
        }
    }
}

#[test]
#[ignore = "tier 2: starts gdsrun serve (scripts/test.sh)"]
fn a_model_without_a_head_does_not_rerank() {
    let _one = serial();
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-hf");
    // asked for, reranking is refused at the start (a usage error naming the model)
    for flag in [&["--reranking"][..], &["--pooling", "rank"]] {
        let out = std::process::Command::new(gds_tests::bin("gdsrun"))
            .arg("serve")
            .arg(&dir)
            .args(["--port", "0"])
            .args(flag)
            .output()
            .unwrap();
        let err = gds_tests::stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("not a reranker") && err.contains(&*dir.to_string_lossy()),
            "{err}"
        );
    }
    let s = start_model(&dir, &["--ctx", "64"]);
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let (code, r) = post(&s.addr, path, &json!({"query": "q", "documents": ["a"]}));
        assert_eq!(code, 501, "{path}: {r}");
        assert_eq!(r["error"]["type"], "not_supported_error", "{r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("cls.output.weight"),
            "{r}"
        );
    }
}

#[test]
#[ignore = "tier 2: runs gdsrun batch (scripts/test.sh)"]
fn a_batch_line_reranks_as_the_server_does() {
    let _one = serial();
    let g = golden();
    let (tmp, dir) = gds_tests::converted_fixture("tiny-qwen3-reranker.gguf");
    let input = tmp.path().join("in.jsonl");
    let output = tmp.path().join("out.jsonl");
    let case = &g["cases"][1];
    let lines = [
        json!({"custom_id": "r", "method": "POST", "url": "/v1/rerank", "body": case}),
        json!({"custom_id": "bad", "method": "POST", "url": "/v1/rerank", "body": {"query": "q", "documents": []}}),
        json!({"custom_id": "s", "method": "POST", "url": "/v1/score", "body": {"text_1": case["query"], "text_2": case["documents"]}}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&input, text).unwrap();
    let flags = ["--ctx", "2048", "--activations", "f32", "--kv-type", "f32"];
    let out = std::process::Command::new(gds_tests::bin("gdsrun"))
        .arg("batch")
        .arg(&dir)
        .args(["--quiet", "--threads", "2", "-i"])
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .args(flags)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", gds_tests::stderr(&out));
    let rows: Vec<Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = |id: &str| rows.iter().find(|r| r["custom_id"] == id).unwrap().clone();
    let ok = row("r");
    assert_eq!(ok["response"]["status_code"], 200, "{ok}");
    let s = start_model(&dir, &flags);
    let (_, served) = post(&s.addr, "/v1/rerank", case);
    let body = &ok["response"]["body"];
    assert_eq!(body["results"], served["results"]);
    assert_eq!(body["usage"], served["usage"]);
    let bad = row("bad");
    assert_eq!(bad["response"]["status_code"], 400, "{bad}");
    // vLLM's batch runner takes /v1/score too
    let scored = row("s");
    assert_eq!(scored["response"]["status_code"], 200, "{scored}");
    let (_, served) = post(
        &s.addr,
        "/v1/score",
        &json!({"text_1": case["query"], "text_2": case["documents"]}),
    );
    assert_eq!(scored["response"]["body"]["data"], served["data"]);
}

/// Request-body fuzzing of the rerank paths (tests/py/serve_fuzz.py `--endpoints rerank`:
/// valid bodies mutated, hostile values, raw-byte damage, clients hanging up) from three
/// clients while a fourth repeats one greedy chat request: every answer a 2xx or a 4xx in
/// OpenAI's error shape, the chat's text unchanged, the server healthy at the end.
#[test]
#[ignore = "tier 2: starts gdsrun serve (scripts/test.sh)"]
fn rerank_fuzzing_never_fails_the_server_or_another_client() {
    let _one = serial();
    let (_t, dir) = gds_tests::converted_fixture("tiny-qwen3-reranker.gguf");
    let s = start_model(&dir, &["--ctx", "2048", "--max-batch", "8"]);
    let out = std::process::Command::new("python3")
        .arg(gds_tests::root().join("tests/py/serve_fuzz.py"))
        .args(["--url", &format!("http://{}", s.addr)])
        .args(["--endpoints", "rerank", "--requests", "2000", "--seed", "1"])
        .output()
        .expect("python3 runs");
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "rerank fuzzing found failures: {summary}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(summary.trim()).expect("one JSON summary");
    assert!(v["by_status"]["200"].as_u64().unwrap() > 500, "{v}");
    assert!(v["by_status"]["400"].as_u64().unwrap() > 300, "{v}");
    assert!(v["sentinel_requests"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(http(&s.addr, "GET", "/health", None).0, 200);
}
