//! A model's recommended sampling — its `generation_config.json`, a GGUF's
//! `general.sampling.*` — is the default of every request that leaves a setting unset, as
//! llama-server and vLLM take it; a request's own setting wins, and `--generation-config
//! none` gives gdsrun's own defaults.

use crate::common::{get_ok, post_json, serial, start_model};
use serde_json::{json, Value};

fn chat(addr: &str, extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Tell me a story."}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let (code, r) = post_json(addr, "/v1/chat/completions", &body);
    assert_eq!(code, 200, "{r}");
    r
}

fn text(r: &Value) -> String {
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
#[ignore = "tier 2: starts a server (scripts/test.sh)"]
fn a_checkpoints_recommended_sampling_is_the_servers_default() {
    let _one = serial();
    // greedy, at most 6 tokens a reply: what a request that sets neither gets
    let gen = json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": true,
                     "temperature": 0.0, "top_k": 7, "max_new_tokens": 6});
    let (_tmp, model) = gds_tests::converted_fixture_with(
        "tiny-llama-hf",
        &[("generation_config.json", &gen.to_string())],
    );
    let s = start_model(&model, &["--ctx", "256"]);
    let props = get_ok(&s.addr, "/props");
    let p = &props["default_generation_settings"]["params"];
    assert_eq!(
        (
            p["temperature"].as_f64(),
            p["top_k"].as_u64(),
            p["n_predict"].as_i64()
        ),
        (Some(0.0), Some(7), Some(6)),
        "{props}"
    );
    // two seeds, the same greedy reply of at most six tokens
    let a = chat(&s.addr, json!({"seed": 1}));
    let b = chat(&s.addr, json!({"seed": 2}));
    assert_eq!(text(&a), text(&b));
    let n = a["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n <= 6, "{a}");
    if n == 6 {
        assert_eq!(a["choices"][0]["finish_reason"], "length", "{a}");
    }
    // the request's own settings win: a longer greedy reply, then sampled ones
    let long = chat(&s.addr, json!({"max_tokens": 12}));
    assert!(text(&long).starts_with(&text(&a)), "{long} vs {a}");
    if n == 6 {
        assert!(
            long["usage"]["completion_tokens"].as_u64().unwrap() > 6,
            "{long}"
        );
    }
    let x = chat(
        &s.addr,
        json!({"max_tokens": 12, "temperature": 1.0, "seed": 1}),
    );
    let y = chat(
        &s.addr,
        json!({"max_tokens": 12, "temperature": 1.0, "seed": 2}),
    );
    assert_ne!(text(&x), text(&y), "temperature 1 with two seeds");
    drop(s);

    // --generation-config none: gdsrun's own defaults (llama.cpp's), sampled
    let s = start_model(&model, &["--ctx", "256", "--generation-config", "none"]);
    let props = get_ok(&s.addr, "/props");
    let p = &props["default_generation_settings"]["params"];
    assert_eq!(
        (p["top_k"].as_u64(), p["n_predict"].as_i64()),
        (Some(40), Some(-1)),
        "{props}"
    );
    assert!(p["temperature"].as_f64().unwrap() > 0.5, "{props}");
    drop(s);

    // the server's flags win over the model's (llama-server's -n: -1 for no limit)
    let s = start_model(&model, &["--ctx", "256", "--top-k", "3", "-n", "3"]);
    let p = get_ok(&s.addr, "/props")["default_generation_settings"]["params"].clone();
    assert_eq!(
        (
            p["top_k"].as_u64(),
            p["temperature"].as_f64(),
            p["n_predict"].as_i64()
        ),
        (Some(3), Some(0.0), Some(3))
    );
    let r = chat(&s.addr, json!({}));
    assert!(
        r["usage"]["completion_tokens"].as_u64().unwrap() <= 3,
        "{r}"
    );
    drop(s);
    let s = start_model(&model, &["--ctx", "256", "--n-predict", "-1"]);
    let p = get_ok(&s.addr, "/props")["default_generation_settings"]["params"].clone();
    assert_eq!(p["n_predict"].as_i64(), Some(-1));
    drop(s);
    let o = std::process::Command::new(gds_tests::bin("gdsrun"))
        .arg("serve")
        .arg(&model)
        .args(["-n", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--n-predict 0 must be"));
}

#[test]
#[ignore = "tier 2: needs the gguf Python package (scripts/test.sh)"]
fn a_ggufs_general_sampling_keys_are_the_servers_default() {
    let _one = serial();
    let (_tmp, dir) = gds_tests::converted_gguf_with_key(
        "tiny-llama.gguf",
        "general.sampling.top_k",
        "int32",
        "5",
    );
    let s = start_model(&dir, &["--ctx", "64"]);
    let id = get_ok(&s.addr, "/v1/models")["data"][0]["id"].clone();
    let (code, show) = post_json(&s.addr, "/api/show", &json!({"model": id}));
    assert_eq!(code, 200, "{show}");
    let p = get_ok(&s.addr, "/props")["default_generation_settings"]["params"].clone();
    assert_eq!(p["top_k"].as_u64(), Some(5), "{p}");
    // Ollama's /api/show lists it among the model's parameters
    assert!(
        show["parameters"].as_str().unwrap().contains("top_k 5"),
        "{show}"
    );
}
