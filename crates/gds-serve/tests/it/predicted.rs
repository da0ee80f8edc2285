//! OpenAI's predicted outputs (`prediction` on `/v1/chat/completions`) on the real SmolLM2:
//! the reply is the one the model gives without it (greedy and sampled, streamed and not,
//! with the prediction exact, edited or unrelated), the prediction's guesses are used (its
//! tokens accepted), and `usage.completion_tokens_details` counts them.

use crate::common::{http, serial, start};
use serde_json::{json, Value};

fn post(addr: &str, body: &Value) -> (u16, Value) {
    let (code, text) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().as_bytes()),
    );
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (code, v)
}

fn chat(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Write a short Python function that adds two numbers, with a docstring."}],
        "max_tokens": 80,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn text(r: &Value) -> String {
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// (accepted, rejected) prediction tokens of an answer's usage.
fn counts(usage: &Value) -> (u64, u64) {
    let d = &usage["completion_tokens_details"];
    (
        d["accepted_prediction_tokens"].as_u64().unwrap(),
        d["rejected_prediction_tokens"].as_u64().unwrap(),
    )
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_prediction_speeds_the_reply_without_changing_it() {
    let _one = serial();
    let s = start(&["--ctx", "1024"]);
    let (code, plain) = post(&s.addr, &chat(json!({})));
    assert_eq!(code, 200, "{plain}");
    let want = text(&plain);
    let n = plain["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 20, "{plain}");
    assert_eq!(counts(&plain["usage"]), (0, 0));

    // the reply itself predicted: the same text, most of its tokens accepted guesses
    let pred = |content: Value| json!({"prediction": {"type": "content", "content": content}});
    let (_, exact) = post(&s.addr, &chat(pred(json!(want))));
    assert_eq!(text(&exact), want);
    let (a, r) = counts(&exact["usage"]);
    assert!(a * 2 >= n, "accepted {a} of {n} tokens");
    assert!(r <= 16, "rejected {r}");
    // as text parts too
    let half = want.len() / 2;
    let cut = (0..=half)
        .rev()
        .find(|&i| want.is_char_boundary(i))
        .unwrap();
    let parts =
        json!([{"type": "text", "text": &want[..cut]}, {"type": "text", "text": &want[cut..]}]);
    let (_, r2) = post(&s.addr, &chat(pred(parts)));
    assert_eq!(text(&r2), want);
    assert!(counts(&r2["usage"]).0 > 0);

    // an edited prediction (a line replaced, one inserted): still the model's text, guesses
    // accepted before and after the edits, some rejected at them
    let mut lines: Vec<&str> = want.lines().collect();
    assert!(lines.len() >= 3, "{want}");
    let mid = lines.len() / 2;
    lines[mid] = "    x = something_else_entirely(42)";
    lines.insert(1, "# an inserted comment line");
    let edited = lines.join("\n");
    let (_, e) = post(&s.addr, &chat(pred(json!(edited))));
    assert_eq!(text(&e), want);
    let (a, r) = counts(&e["usage"]);
    assert!(a > 0 && r > 0, "accepted {a}, rejected {r}");

    // an unrelated prediction: the same text
    let (_, u) = post(
        &s.addr,
        &chat(pred(json!(
            "Le chat est sur la table. Il fait beau aujourd'hui."
        ))),
    );
    assert_eq!(text(&u), want);

    // sampled: the same draws with and without guesses
    let sampled = |extra: Value| {
        let mut b = chat(json!({"temperature": 0.9, "seed": 7}));
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        text(&post(&s.addr, &b).1)
    };
    let alone = sampled(json!({}));
    assert_eq!(sampled(pred(json!(alone.clone()))), alone);

    // streamed, with the usage chunk
    let mut b = chat(pred(json!(want)));
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let (code, body) = http(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        Some(b.to_string().as_bytes()),
    );
    assert_eq!(code, 200);
    let mut streamed = String::new();
    let mut usage = Value::Null;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    assert_eq!(streamed, want);
    assert!(counts(&usage).0 * 2 >= n, "{usage}");

    // errors name the field
    for bad in [
        json!({"prediction": {"type": "text", "content": "x"}}),
        json!({"prediction": {"content": "x"}}),
        json!({"prediction": {"type": "content", "content": 5}}),
        json!({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}),
        json!({"prediction": "x"}),
    ] {
        let (code, r) = post(&s.addr, &chat(bad.clone()));
        assert_eq!(code, 400, "{bad}: {r}");
        assert_eq!(r["error"]["param"], "prediction", "{bad}: {r}");
    }
    // an empty prediction is none
    let (code, r) = post(&s.addr, &chat(pred(json!(""))));
    assert_eq!(code, 200);
    assert_eq!(text(&r), want);
}
