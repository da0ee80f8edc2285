//! A reply or a conversation that does not fit the context: llama-server's `--context-shift`
//! (`n_keep`, `n_discard`, `truncated`), Ollama's `shift` and `truncate`, the Responses
//! API's `truncation`. On SmolLM2 with a context of 128 tokens.

use crate::common::{http, ids, metric, post_json, serial, start, Server};
use serde_json::{json, Value};

const CTX: usize = 128;

fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_json(&s.addr, path, body)
}

/// With `--context-shift` a reply goes past the context (the tokens after the kept start
/// halved, the rest computed again), and what follows a shift is exactly what a fresh request
/// with the shortened text gives (greedy, on a server without the flag and so without a
/// cached copy of it). Without the flag the reply ends at the context.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn context_shift_goes_on_past_the_context_as_a_fresh_request_on_the_shortened_text() {
    let _one = serial();
    let ctx = CTX.to_string();
    // (`--keep 3`: the kept start of the requests that name none)
    let shifting = start(&["--ctx", &ctx, "--context-shift", "--keep", "3"]);
    let plain = start(&["--ctx", &ctx]);
    let prompt = "Once upon a time, in a small village by the sea,";
    let body = |n: usize, keep: Option<i64>| {
        let mut b = json!({"prompt": prompt, "n_predict": n, "ignore_eos": true,
                           "temperature": 0, "return_tokens": true});
        if let Some(k) = keep {
            b["n_keep"] = json!(k);
        }
        b
    };
    // the prompt's tokens (no BOS: SmolLM2 adds none)
    let (code, t) = post(&plain, "/tokenize", &json!({"content": prompt}));
    assert_eq!(code, 200, "{t}");
    let p = ids(&t["tokens"]);

    let (code, r) = post(&shifting, "/completion", &body(300, None));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["tokens_predicted"], 300, "{r}");
    assert_eq!(r["truncated"], true, "{r}");
    assert_eq!(r["stop_type"], "limit", "{r}");
    let (_, m) = http(&shifting.addr, "GET", "/metrics", None);
    let shifts = metric(&m, "gds_context_shifts_total");
    assert!(shifts >= 3.0, "{shifts} shifts for 300 tokens in 128");

    // the first shift: when prompt + reply reach the context, the 3 kept tokens stay and
    // half of the 124 cached after them go
    let g = ids(&r["tokens"]);
    let mut all = p.clone();
    all.extend_from_slice(&g);
    let (keep, discard) = (3, (CTX - 1 - 3) / 2);
    let mut shortened = all[..keep].to_vec();
    shortened.extend_from_slice(&all[keep + discard..CTX]);
    let after = &g[CTX - p.len()..CTX - p.len() + discard];
    let (code, fresh) = post(
        &plain,
        "/completion",
        &json!({"prompt": shortened, "n_predict": discard, "ignore_eos": true,
                "temperature": 0, "return_tokens": true}),
    );
    assert_eq!(code, 200, "{fresh}");
    assert_eq!(ids(&fresh["tokens"]), after, "after the first shift");

    // without the flag: the reply ends where prompt + reply fill the context
    let (code, r) = post(&plain, "/completion", &body(300, Some(3)));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["tokens_predicted"], CTX - p.len(), "{r}");
    assert_eq!(r["truncated"], true, "{r}");
    // and the bad values
    for (k, v) in [("n_keep", -2), ("n_discard", -1)] {
        let mut b = body(4, Some(0));
        b[k] = json!(v);
        let (code, e) = post(&shifting, "/completion", &b);
        assert_eq!(code, 400, "{k}: {e}");
        assert!(e.to_string().contains(k), "{k}: {e}");
    }
}

/// A conversation over the context: Ollama's `/api/chat` (`truncate`, on by default) and the
/// Responses API (`truncation: "auto"`) leave out the oldest messages, as few as make it fit,
/// the system prompt kept; the reply is the chat endpoint's to that shortened conversation.
/// `truncate: false` and `truncation: "disabled"` refuse it, as the chat endpoint does.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn conversations_over_the_context_lose_their_oldest_messages_where_asked() {
    let _one = serial();
    let s = start(&["--ctx", &CTX.to_string()]);
    let system = json!({"role": "system", "content": "You are a pirate."});
    let mut turns = Vec::new();
    for i in 0..10 {
        turns.push(json!({"role": "user", "content": format!("Tell me fact {i} about the sea.")}));
        turns.push(
            json!({"role": "assistant", "content": "The sea is deep and wide and full of fish."}),
        );
    }
    turns.push(json!({"role": "user", "content": "What are you?"}));
    let with_system = |from: usize| {
        let mut m = vec![system.clone()];
        m.extend_from_slice(&turns[from..]);
        Value::Array(m)
    };

    // the chat endpoint refuses the whole; the first user message from which it fits:
    let (code, e) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": with_system(0)}),
    );
    assert_eq!(
        (code, &e["error"]["code"]),
        (400, &json!("context_length_exceeded"))
    );
    let (from, want) = (2..turns.len())
        .step_by(2)
        .find_map(|from| {
            let (code, r) = post(
                &s,
                "/v1/chat/completions",
                &json!({"messages": with_system(from), "max_tokens": 8, "temperature": 0}),
            );
            (code == 200).then_some((from, r))
        })
        .expect("the last message fits");
    assert!(from > 2 && from < turns.len() - 1, "from {from}");

    let (code, r) = post(
        &s,
        "/api/chat",
        &json!({"model": "m", "messages": with_system(0), "stream": false,
                "options": {"num_predict": 8, "temperature": 0}}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(
        r["message"]["content"],
        want["choices"][0]["message"]["content"]
    );
    assert_eq!(
        r["prompt_eval_count"], want["usage"]["prompt_tokens"],
        "{r}"
    );
    let (code, e) = post(
        &s,
        "/api/chat",
        &json!({"model": "m", "messages": with_system(0), "stream": false, "truncate": false}),
    );
    assert_eq!(code, 400, "{e}");

    // the Responses API: instructions are the system prompt
    let input = Value::Array(turns.clone());
    let (code, r) = post(
        &s,
        "/v1/responses",
        &json!({"input": input, "instructions": "You are a pirate.", "truncation": "auto",
                "max_output_tokens": 8, "temperature": 0}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["truncation"], "auto");
    assert_eq!(
        r["usage"]["input_tokens"], want["usage"]["prompt_tokens"],
        "{r}"
    );
    let text = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "message")
        .map(|o| o["content"][0]["text"].clone());
    assert_eq!(
        text.as_ref(),
        Some(&want["choices"][0]["message"]["content"]),
        "{r}"
    );
    for t in [json!("disabled"), json!(null), json!("sometimes")] {
        let (code, e) = post(
            &s,
            "/v1/responses",
            &json!({"input": input, "instructions": "You are a pirate.", "truncation": t}),
        );
        assert_eq!(code, 400, "{t}: {e}");
    }
}

/// Ollama's `/api/generate`: a prompt over the context is cut as a shift cuts it (its first
/// `num_keep` tokens, then its latest, half the context after them free) unless
/// `truncate: false`, and a reply past the context shifts unless `shift: false`.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn ollama_generate_truncates_and_shifts_unless_told_not_to() {
    let _one = serial();
    let s = start(&["--ctx", &CTX.to_string()]);
    let gen = |extra: Value| {
        let mut b = json!({"model": "m", "raw": true, "stream": false,
                           "options": {"temperature": 0}});
        // (`options` merged, not replaced: a request's own options keep `temperature: 0`;
        // replacing them sampled the count, which then ended now and then)
        for (k, v) in extra.as_object().unwrap() {
            match (k.as_str(), v.as_object()) {
                ("options", Some(o)) => o.iter().for_each(|(k, v)| b["options"][k] = v.clone()),
                _ => b[k] = v.clone(),
            }
        }
        post(&s, "/api/generate", &b)
    };
    let long = "word ".repeat(300);
    let (code, r) = gen(json!({"prompt": long, "options": {"num_predict": 4, "num_keep": 6}}));
    assert_eq!(code, 200, "{r}");
    // SmolLM2 adds no BOS: 6 kept, then the latest up to 128 - (128 - 6) / 2
    assert_eq!(r["prompt_eval_count"], CTX - (CTX - 6) / 2, "{r}");
    let (code, e) = gen(json!({"prompt": long, "truncate": false}));
    assert_eq!(code, 400, "{e}");

    // (a count goes on: greedy SmolLM2 does not end it)
    let count = "1, 2, 3, 4, 5, 6,";
    let (code, r) = gen(json!({"prompt": count, "options": {"num_predict": 200}}));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["eval_count"], 200, "{r}");
    assert!(
        r["response"]
            .as_str()
            .unwrap()
            .starts_with(" 7, 8, 9, 10, 11, 12,"),
        "{r}"
    );
    let (code, r) = gen(json!({"prompt": count, "shift": false,
                               "options": {"num_predict": 200}}));
    assert_eq!(code, 200, "{r}");
    let n = r["eval_count"].as_u64().unwrap() + r["prompt_eval_count"].as_u64().unwrap();
    assert_eq!(n, CTX as u64, "{r}");
    assert_eq!(r["done_reason"], "length", "{r}");
}
