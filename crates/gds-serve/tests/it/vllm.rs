//! vLLM's extra parameters on the OpenAI endpoints (what clients written for `vllm serve`
//! send in `extra_body`): structured outputs (`structured_outputs`, `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar`), `min_tokens`, `stop_token_ids`,
//! `include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids`, `bad_words`,
//! `prompt_logprobs`, `repetition_penalty`, `documents`, beam search (`use_beam_search`,
//! `length_penalty`); and the ones not done refused by name, where they were ignored.

use crate::common::{
    get_ok, http, ids, metric, post_json, serial, sse_events, start, start_model, wait_for_metrics,
    with, Server,
};
use serde_json::{json, Value};

fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_json(&s.addr, path, body)
}

fn ok(s: &Server, path: &str, body: &Value) -> Value {
    let (code, v) = post(s, path, body);
    assert_eq!(code, 200, "{body}: {v}");
    v
}

fn chat(s: &Server, extra: Value) -> Value {
    let body = with(
        &json!({"messages": [{"role": "user", "content": "Is the sky blue? Answer."}],
        "max_tokens": 40, "temperature": 0.9, "seed": 3}),
        &extra,
    );
    ok(s, "/v1/chat/completions", &body)
}

/// The greedy reply to `prompt` through llama-server's `/completion` (which lists its token
/// ids), and its token ids.
fn greedy_ids(s: &Server, prompt: &str, n: usize) -> (Value, Vec<u64>) {
    let native = ok(
        s,
        "/completion",
        &json!({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": true}),
    );
    let ids = ids(&native["tokens"]);
    (native, ids)
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_structured_outputs_hold_the_reply() {
    let _one = serial();
    let s = start(&[]);
    let choices = ["yes", "no", "it depends (mostly)"];
    for seed in 1..=4 {
        // the old and the new form: the same constraint, the same reply
        let old = chat(&s, json!({"guided_choice": choices, "seed": seed}));
        let new = chat(
            &s,
            json!({"structured_outputs": {"choice": choices}, "seed": seed}),
        );
        assert!(choices.contains(&content(&old)), "{old}");
        assert_eq!(content(&old), content(&new), "seed {seed}");
    }
    let digits = chat(&s, json!({"guided_regex": "[0-9]{3}-[a-z]{2}"}));
    let d = content(&digits).as_bytes();
    assert!(
        d.len() == 6 && d[..3].iter().all(u8::is_ascii_digit) && d[3] == b'-',
        "{digits}"
    );
    let schema = json!({"type": "object", "properties": {"answer": {"type": "boolean"},
        "why": {"type": "string", "maxLength": 30}}, "required": ["answer", "why"]});
    for extra in [
        json!({"guided_json": schema}),
        json!({"guided_json": schema.to_string()}),
        json!({"structured_outputs": {"json": schema}}),
    ] {
        let v = chat(&s, extra.clone());
        let parsed: Value =
            serde_json::from_str(content(&v)).unwrap_or_else(|e| panic!("{extra}: {e}: {v}"));
        assert!(
            parsed["answer"].is_boolean() && parsed["why"].is_string(),
            "{parsed}"
        );
    }
    let any = chat(&s, json!({"structured_outputs": {"json_object": true}}));
    assert!(
        serde_json::from_str::<Value>(content(&any))
            .unwrap()
            .is_object(),
        "{any}"
    );
    // GBNF, as vLLM's xgrammar takes it; on /v1/completions too
    let g = "root ::= \"The answer is \" (\"yes\" | \"no\") \".\"";
    let v = ok(
        &s,
        "/v1/completions",
        &json!({"prompt": "Q: Is fire hot?\nA:", "guided_grammar": g, "max_tokens": 12}),
    );
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        ["The answer is yes.", "The answer is no."].contains(&text),
        "{v}"
    );
    // one constraint a request; malformed ones named
    for (body, param) in [
        (
            json!({"guided_choice": ["a"], "regex": "a"}),
            "guided_choice",
        ),
        (
            json!({"structured_outputs": {"choice": ["a"], "regex": "a"}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"xml": "a"}}),
            "structured_outputs",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_choice": [1, 2]}), "guided_choice"),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (json!({"guided_regex": 5}), "guided_regex"),
        (json!({"guided_grammar": "root ::= ("}), "guided_grammar"),
    ] {
        let b = with(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            &body,
        );
        let (code, v) = post(&s, "/v1/chat/completions", &b);
        assert_eq!(code, 400, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_min_tokens_stop_token_ids_and_repetition_penalty() {
    let _one = serial();
    let s = start(&[]);
    let prompt = "The capital of France is";
    let greedy = |extra: Value| {
        let body = with(
            &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
            &extra,
        );
        ok(&s, "/v1/completions", &body)
    };
    // the greedy reply's token ids (llama-server's `/completion` lists them)
    let (native, ids) = greedy_ids(&s, prompt, 24);
    let plain = greedy(json!({}));
    assert_eq!(plain["choices"][0]["text"], native["content"], "{plain}");
    // the 4th token stops it (first seen there): four tokens, finish stop, the text of the
    // three before it (vLLM leaves the stop token's out) ...
    let at = 3;
    let first = ids.iter().position(|&t| t == ids[at]).unwrap();
    let stopped = greedy(json!({"stop_token_ids": [ids[at]]}));
    assert_eq!(
        stopped["usage"]["completion_tokens"],
        first + 1,
        "{stopped}"
    );
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    let detok = |t: &[u64]| post(&s, "/detokenize", &json!({ "tokens": t })).1["content"].clone();
    assert_eq!(
        stopped["choices"][0]["text"],
        detok(&ids[..first]),
        "{stopped}"
    );
    // ... and with include_stop_str_in_output its text too
    let kept = greedy(json!({"stop_token_ids": [ids[at]], "include_stop_str_in_output": true}));
    assert_eq!(kept["choices"][0]["text"], detok(&ids[..=first]), "{kept}");
    assert_eq!(kept["usage"], stopped["usage"]);
    // ... unless min_tokens holds it back
    let held = greedy(json!({"stop_token_ids": [ids[at]], "min_tokens": first + 2}));
    assert!(
        held["usage"]["completion_tokens"].as_u64().unwrap() > first as u64 + 1,
        "{held}"
    );
    // a reply that ends early goes on to min_tokens
    let short = ok(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 64,
                "temperature": 0}),
    );
    let n = short["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    let longer = ok(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 64,
                "temperature": 0, "min_tokens": n + 10}),
    );
    assert!(
        longer["usage"]["completion_tokens"].as_u64().unwrap() >= n + 10,
        "{short} vs {longer}"
    );
    // vLLM's repetition_penalty: llama.cpp's repeat_penalty over the whole context
    let vllm = greedy(json!({"repetition_penalty": 1.5}));
    let llama = greedy(json!({"repeat_penalty": 1.5, "repeat_last_n": -1}));
    assert_eq!(vllm["choices"][0]["text"], llama["choices"][0]["text"]);
    assert_ne!(
        vllm["choices"][0]["text"], plain["choices"][0]["text"],
        "the penalty changes this reply"
    );
    // refusals: both penalties, and what is not done here (a default passes)
    for (body, param) in [
        (
            json!({"repetition_penalty": 1.2, "repeat_penalty": 1.1}),
            "repetition_penalty",
        ),
        (json!({"min_tokens": -1}), "min_tokens"),
        (json!({"stop_token_ids": [99999999]}), "stop_token_ids"),
        (json!({"prompt_embeds": "AAAA"}), "prompt_embeds"),
        (json!({"logits_processors": ["x"]}), "logits_processors"),
        (
            json!({"repetition_detection": {"max_pattern_size": 4}}),
            "repetition_detection",
        ),
    ] {
        let b = with(&json!({"prompt": prompt, "max_tokens": 4}), &body);
        let (code, v) = post(&s, "/v1/completions", &b);
        assert_eq!(code, 400, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
    let defaults = greedy(
        json!({"use_beam_search": false, "skip_special_tokens": true,
        "include_stop_str_in_output": false, "bad_words": [], "prompt_logprobs": null,
        "allowed_token_ids": null, "prompt_embeds": null, "vllm_xargs": {"a": 1},
        "kv_transfer_params": null}),
    );
    assert_eq!(defaults["choices"][0]["text"], plain["choices"][0]["text"]);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_token_masks_stop_strings_special_tokens_and_prompt_logprobs() {
    let _one = serial();
    let s = start(&[]);
    let prompt = "The capital of France is";
    let completion = |extra: Value| {
        let body = with(
            &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
            &extra,
        );
        post(&s, "/v1/completions", &body)
    };
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let tokenize = |t: &str| ids(&post(&s, "/tokenize", &json!({ "content": t })).1["tokens"]);
    let detok = |t: &[u64]| {
        post(&s, "/detokenize", &json!({ "tokens": t })).1["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (_, ids) = greedy_ids(&s, prompt, 16);
    let (_, plain) = completion(json!({}));
    assert_eq!(text(&plain), detok(&ids), "{plain}");

    // bad_words: two tokens of the reply that make a word (tokenized back to themselves):
    // the greedy reply keeps the tokens before the second, then takes another
    let at = (2..ids.len() - 1)
        .find(|&i| {
            let w = detok(&ids[i..i + 2]);
            !w.trim().is_empty() && tokenize(w.trim_start()) == ids[i..i + 2]
        })
        .expect("two tokens that make a word");
    let word = detok(&ids[at..at + 2]);
    let (code, banned) = completion(json!({ "bad_words": [word] }));
    assert_eq!(code, 200, "{banned}");
    let t = text(&banned);
    assert!(
        t.starts_with(&detok(&ids[..at + 1])),
        "{word:?}: {t:?} vs {plain}"
    );
    assert!(!t.starts_with(&detok(&ids[..at + 2])), "{word:?}: {t:?}");
    // a one-token word is never generated, as it is nor after a space (llama-server's API
    // lists the reply's token ids)
    let the = ok(
        &s,
        "/completion",
        &json!({"prompt": "Here is a short story about a cat.", "n_predict": 48,
                "temperature": 0, "return_tokens": true, "bad_words": ["The"]}),
    );
    let free = ok(
        &s,
        "/completion",
        &json!({"prompt": "Here is a short story about a cat.", "n_predict": 48,
                "temperature": 0, "return_tokens": true}),
    );
    let forms = [tokenize("The"), tokenize(" The")];
    assert!(forms.iter().all(|f| f.len() == 1), "{forms:?}");
    let has = |v: &Value| {
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| forms.iter().any(|f| f[0] == t.as_u64().unwrap()))
    };
    assert!(has(&free), "the reply without the ban has the word: {free}");
    assert!(!has(&the), "{the}");

    // allowed_token_ids: only those tokens (and no end of generation: max_tokens reached)
    let allowed = tokenize(" yes no maybe.");
    let (code, v) = completion(json!({"allowed_token_ids": allowed, "temperature": 0.9,
        "seed": 5, "max_tokens": 12, "logprobs": 0}));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let texts: Vec<String> = allowed.iter().map(|&t| detok(&[t])).collect();
    for t in v["choices"][0]["logprobs"]["tokens"].as_array().unwrap() {
        assert!(
            texts.contains(&t.as_str().unwrap().to_string()),
            "{t} of {v}"
        );
    }

    // include_stop_str_in_output: the stop string stays; min_tokens holds stop strings back
    let reply = text(&plain);
    let stop = reply.split_whitespace().nth(1).unwrap().to_string();
    let (_, cut) = completion(json!({ "stop": [stop] }));
    let (_, kept) = completion(json!({"stop": [stop], "include_stop_str_in_output": true}));
    assert!(!text(&cut).contains(&stop), "{cut}");
    assert_eq!(text(&kept), format!("{}{stop}", text(&cut)), "{kept}");
    assert_eq!(kept["choices"][0]["finish_reason"], "stop");
    let (_, held) = completion(json!({"stop": [stop], "min_tokens": 12}));
    assert!(text(&held).contains(&stop), "{held}");

    // skip_special_tokens: false keeps a special token's text; with
    // include_stop_str_in_output the end-of-generation token's too
    let chat = |extra: Value| {
        let body = with(
            &json!({"messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 48, "temperature": 0}),
            &extra,
        );
        ok(&s, "/v1/chat/completions", &body)
    };
    let hi = chat(json!({}));
    assert_eq!(hi["choices"][0]["finish_reason"], "stop", "{hi}");
    let both = chat(json!({"skip_special_tokens": false, "include_stop_str_in_output": true}));
    assert_eq!(
        content(&both),
        format!("{}<|im_end|>", content(&hi)),
        "{both}"
    );
    assert_eq!(
        content(&chat(json!({"include_stop_str_in_output": true}))),
        content(&hi)
    );
    let special = tokenize("<|im_start|>");
    assert_eq!(special.len(), 1, "{special:?}");
    for (skip, want) in [(true, ""), (false, "<|im_start|><|im_start|>")] {
        let (_, v) = completion(json!({"allowed_token_ids": special, "max_tokens": 2,
            "skip_special_tokens": skip}));
        assert_eq!(text(&v), want, "{v}");
    }

    // masks that leave nothing: a 400 naming the request's fault
    let eos = tokenize("<|im_end|>");
    let (code, v) = completion(json!({"allowed_token_ids": eos, "min_tokens": 3}));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("allowed_token_ids"),
        "{v}"
    );

    // prompt_logprobs: vLLM's list, the first null; the same values as echo + logprobs
    let (code, scored) = completion(json!({"prompt_logprobs": 2, "max_tokens": 1}));
    assert_eq!(code, 200, "{scored}");
    let (_, echoed) = completion(json!({"echo": true, "logprobs": 2, "max_tokens": 1}));
    let pl = scored["choices"][0]["prompt_logprobs"].as_array().unwrap();
    let n_prompt = scored["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(pl.len(), n_prompt, "{scored}");
    assert!(pl[0].is_null());
    let prompt_ids = tokenize(prompt);
    let lp = echoed["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    for (i, entry) in pl.iter().enumerate().skip(1) {
        let own = &entry[prompt_ids[i].to_string()];
        let want = lp[i].as_f64().unwrap();
        assert!(
            (own["logprob"].as_f64().unwrap() - want).abs() < 1e-4,
            "{i}: {entry}"
        );
        let rank = own["rank"].as_u64().unwrap();
        assert!(rank >= 1, "{entry}");
        assert_eq!(own["decoded_token"], detok(&[prompt_ids[i]]));
        // the top two (ranks 1 and 2) and the token itself
        let ranks: Vec<u64> = entry
            .as_object()
            .unwrap()
            .values()
            .map(|e| e["rank"].as_u64().unwrap())
            .collect();
        assert!(
            ranks.contains(&1) && (rank <= 2 || ranks.len() == 3),
            "{entry}"
        );
        let best = entry
            .as_object()
            .unwrap()
            .values()
            .map(|e| e["logprob"].as_f64().unwrap());
        assert!(best.fold(f64::MIN, f64::max) >= own["logprob"].as_f64().unwrap());
    }
    assert_eq!(text(&scored), text(&echoed).strip_prefix(prompt).unwrap());
    // on chat, beside the choices
    let c = chat(json!({"prompt_logprobs": 0, "max_tokens": 2}));
    let n = c["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(c["prompt_logprobs"].as_array().unwrap().len(), n, "{c}");
    assert!(c["choices"][0].get("prompt_logprobs").is_none());
    for (body, param) in [
        (
            json!({"prompt_logprobs": 2, "stream": true}),
            "prompt_logprobs",
        ),
        (json!({"prompt_logprobs": 2, "n": 2}), "prompt_logprobs"),
        (
            json!({"prompt_logprobs": 2, "echo": true}),
            "prompt_logprobs",
        ),
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (
            json!({"allowed_token_ids": [99999999]}),
            "allowed_token_ids",
        ),
        (json!({"bad_words": "Paris"}), "bad_words"),
        (json!({"bad_words": [""]}), "bad_words"),
    ] {
        let (code, v) = completion(body.clone());
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (code, v) = post(
        &s,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "prompt_logprobs": 1}),
    );
    // (Anthropic's error names no field: its message does)
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt_logprobs"),
        "{v}"
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_documents_reach_the_template() {
    let _one = serial();
    // Command R7B's template lays documents out in a turn of their own
    let template = gds_tests::fixture("templates/command-r7b.jinja");
    let s = start(&[
        "--chat-template-file",
        template.to_str().unwrap(),
        "--ctx",
        "2048",
    ]);
    let messages = json!([{"role": "user", "content": "What is the secret?"}]);
    let docs = json!([{"title": "notes", "text": "The secret is 4217."}]);
    let render = |extra: Value| {
        let body = with(&json!({"messages": messages}), &extra);
        post(&s, "/apply-template", &body)
    };
    let (_, plain) = render(json!({}));
    let (_, given) = render(json!({"documents": docs}));
    let (_, kwargs) = render(json!({"chat_template_kwargs": {"documents": docs}}));
    let p = |v: &Value| v["prompt"].as_str().unwrap().to_string();
    assert!(!p(&plain).contains("4217"), "{plain}");
    assert!(p(&given).contains("The secret is 4217."), "{given}");
    assert_eq!(p(&given), p(&kwargs));
    // the chat path renders them too: more prompt tokens
    let count = |extra: Value| {
        let body = with(&json!({"messages": messages}), &extra);
        ok(&s, "/v1/chat/completions/input_tokens", &body)["input_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(count(json!({"documents": docs})) > count(json!({})) + 5);
    for (body, param) in [
        (json!({"documents": "The secret"}), "documents"),
        (json!({"documents": [{"text": 5}]}), "documents"),
        (
            json!({"documents": docs, "chat_template_kwargs": {"documents": docs}}),
            "documents",
        ),
        (json!({"chat_template": "{{ messages }}"}), "chat_template"),
    ] {
        let b = with(&json!({"messages": messages, "max_tokens": 2}), &body);
        let (code, v) = post(&s, "/v1/chat/completions", &b);
        assert_eq!(code, 400, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
}

/// The JSON events of a streamed answer (`[DONE]` left out).
fn events(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let (code, text) = http(&s.addr, "POST", path, Some(body.to_string().as_bytes()));
    assert_eq!(code, 200, "{body}: {text}");
    sse_events(&text)
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_token_ids_usage_stats_cache_salt_request_id_and_priority() {
    let _one = serial();
    let s = start(&[]);
    let detok = |t: &[u64]| {
        post(&s, "/detokenize", &json!({ "tokens": t })).1["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let im_end = post(
        &s,
        "/tokenize",
        &json!({"content": "<|im_end|>", "parse_special": true}),
    )
    .1["tokens"][0]
        .as_u64()
        .unwrap();
    // completions: the prompt's ids and the reply's in the choice
    let c = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                   "return_token_ids": true});
    let done = ok(&s, "/v1/completions", &c);
    let ch = &done["choices"][0];
    let reply = ids(&ch["token_ids"]);
    assert_eq!(
        ch["prompt_token_ids"].as_array().unwrap().len() as u64,
        done["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{done}"
    );
    assert_eq!(
        reply.len() as u64,
        done["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(detok(&reply), ch["text"].as_str().unwrap(), "{done}");
    // streamed: the prompt's in the first chunk, each chunk's own adding up to the same
    let mut streamed = c.clone();
    streamed["stream"] = json!(true);
    let ev = events(&s, "/v1/completions", &streamed);
    assert_eq!(
        ev[0]["choices"][0]["prompt_token_ids"],
        ch["prompt_token_ids"]
    );
    assert!(ev[1..]
        .iter()
        .all(|e| e["choices"][0].get("prompt_token_ids").is_none()));
    let joined: Vec<u64> = ev
        .iter()
        .flat_map(|e| ids(&e["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(joined, reply);
    // chat: the prompt's beside the choices, the reply's ending with its end of turn
    let chat = json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 48,
                      "temperature": 0, "return_token_ids": true});
    let done = ok(&s, "/v1/chat/completions", &chat);
    assert_eq!(done["choices"][0]["finish_reason"], "stop", "{done}");
    let reply = ids(&done["choices"][0]["token_ids"]);
    assert_eq!(reply.last(), Some(&im_end), "{done}");
    assert_eq!(detok(&reply[..reply.len() - 1]), content(&done));
    let prompt = ids(&done["prompt_token_ids"]);
    assert_eq!(
        prompt.len() as u64,
        done["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let ev = events(&s, "/v1/chat/completions", &streamed);
    assert_eq!(ids(&ev[0]["prompt_token_ids"]), prompt);
    let with_choice: Vec<&Value> = ev.iter().filter(|e| !e["choices"][0].is_null()).collect();
    let joined: Vec<u64> = with_choice
        .iter()
        .flat_map(|e| ids(&e["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(joined, reply);
    // continuous usage: every chunk's, growing to the final count
    let counts: Vec<u64> = ev
        .iter()
        .map(|e| {
            e["usage"]["completion_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("{e}"))
        })
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert_eq!(counts.last(), Some(&(reply.len() as u64)));
    assert!(ev
        .iter()
        .all(|e| e["usage"]["prompt_tokens"] == done["usage"]["prompt_tokens"]));
    // log-probabilities naming tokens by id
    let mut named = c.clone();
    named["logprobs"] = json!(2);
    named["return_tokens_as_token_ids"] = json!(true);
    let v = ok(&s, "/v1/completions", &named);
    let want: Vec<String> = ids(&v["choices"][0]["token_ids"])
        .iter()
        .map(|t| format!("token_id:{t}"))
        .collect();
    let got: Vec<&str> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(got, want, "{v}");
    for alts in v["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap()
    {
        assert!(
            alts.as_object()
                .unwrap()
                .keys()
                .all(|k| k.starts_with("token_id:")),
            "{alts}"
        );
    }
    let mut named_chat = chat.clone();
    named_chat["logprobs"] = json!(true);
    named_chat["return_tokens_as_token_ids"] = json!(true);
    let v = ok(&s, "/v1/chat/completions", &named_chat);
    let first = &v["choices"][0]["logprobs"]["content"][0];
    assert_eq!(first["token"], format!("token_id:{}", reply[0]), "{v}");
    assert_eq!(
        first["bytes"],
        json!(format!("token_id:{}", reply[0]).into_bytes())
    );
    // cache_salt: cached prompt blocks are shared only under the same salt
    let system = "You answer in one word. ".repeat(12);
    let cached = |salt: Option<&str>| {
        let mut b = json!({"messages": [{"role": "system", "content": system},
            {"role": "user", "content": "Colour of the sky?"}], "max_tokens": 1,
            "temperature": 0});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        let v = ok(&s, "/v1/chat/completions", &b);
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cached(Some("tenant-a")), 0);
    assert!(cached(Some("tenant-a")) > 32, "the same salt shares");
    assert_eq!(cached(Some("tenant-b")), 0, "another salt does not");
    // (a request without one shares the chat template's first tokens with this test's
    // earlier requests, not the salted ones' blocks)
    assert!(cached(None) < 16, "nor a request without one");
    assert!(cached(None) > 32);
    assert!(cached(Some("tenant-b")) > 32);
    // request_id names the answer; priority other than 0 is refused
    let mut named = chat.clone();
    named["request_id"] = json!("job-42");
    assert_eq!(
        ok(&s, "/v1/chat/completions", &named)["id"],
        "chatcmpl-job-42"
    );
    let mut p0 = c.clone();
    p0["priority"] = json!(0);
    ok(&s, "/v1/completions", &p0);
    for (extra, param) in [
        (json!({"priority": 1}), "priority"),
        (json!({"request_id": "a\nb"}), "request_id"),
        (json!({"request_id": ""}), "request_id"),
        (json!({"cache_salt": ""}), "cache_salt"),
        (
            json!({"stream_options": {"include_usage": true, "continuous_usage_stats": 1}}),
            "stream_options",
        ),
    ] {
        let b = with(&c, &extra);
        let (code, v) = post(&s, "/v1/completions", &b);
        assert_eq!(code, 400, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
}

/// vLLM's `truncate_prompt_tokens` (and `truncation_side`) on completions and chat: the
/// prompt cut to its last (or first) tokens, the reply the one the cut prompt gives; `-1`
/// fits a prompt longer than the context, which is otherwise refused.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_truncate_prompt_tokens_cuts_the_prompt() {
    let _one = serial();
    let s = start(&[]);
    let text = "The capital of France is Paris. The capital of Germany is";
    let all = ids(&post(&s, "/tokenize", &json!({ "content": text })).1["tokens"]);
    let complete = |body: Value| {
        ok(
            &s,
            "/v1/completions",
            &with(&json!({"max_tokens": 8, "temperature": 0}), &body),
        )
    };
    for (side, kept) in [("left", &all[all.len() - 4..]), ("right", &all[..4])] {
        let cut = complete(json!({"prompt": text, "truncate_prompt_tokens": 4,
                                  "truncation_side": side}));
        assert_eq!(cut["usage"]["prompt_tokens"], 4, "{cut}");
        let given = complete(json!({ "prompt": kept }));
        assert_eq!(
            cut["choices"][0]["text"], given["choices"][0]["text"],
            "{side}"
        );
    }
    let chat = ok(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2,
                "truncate_prompt_tokens": 6}),
    );
    assert_eq!(chat["usage"]["prompt_tokens"], 6, "{chat}");
    // -1: a prompt longer than the context fits it, a token left for the reply
    let long = "hello ".repeat(1100);
    let (code, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 2}),
    );
    assert_eq!(
        (code, &v["error"]["code"]),
        (400, &json!("context_length_exceeded"))
    );
    let fit = complete(json!({"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": -1}));
    assert_eq!(fit["usage"]["prompt_tokens"], 1023, "{fit}");
    assert_eq!(fit["usage"]["completion_tokens"], 1, "{fit}");
    for (extra, param) in [
        (
            json!({"truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"truncate_prompt_tokens": -2}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"truncate_prompt_tokens": "4"}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"truncate_prompt_tokens": 4, "truncation_side": "middle"}),
            "truncation_side",
        ),
    ] {
        let b = with(&json!({ "prompt": text }), &extra);
        let (code, v) = post(&s, "/v1/completions", &b);
        assert_eq!(code, 400, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
}

/// vLLM's `add_special_tokens: false` on `/v1/completions`: a text prompt tokenized without
/// the BOS the model adds (Gemma 3's), the rest the same tokens; the default adds it.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_add_special_tokens_false_leaves_the_bos_out() {
    let _one = serial();
    let s = start_model(gds_tests::gemma_converted(), &["--ctx", "512"]);
    let prompt = |extra: Value| {
        let body = with(
            &json!({"prompt": "The capital of France is", "max_tokens": 1,
                    "return_token_ids": true}),
            &extra,
        );
        ids(&ok(&s, "/v1/completions", &body)["choices"][0]["prompt_token_ids"])
    };
    let with_bos = prompt(json!({}));
    let bos = ids(&post(&s, "/tokenize", &json!({"content": "<bos>"})).1["tokens"]);
    assert_eq!(with_bos[..1], bos[..], "{with_bos:?}");
    assert_eq!(prompt(json!({ "add_special_tokens": true })), with_bos);
    assert_eq!(prompt(json!({"add_special_tokens": false})), with_bos[1..]);
}

/// A beam: its token ids (an end-of-generation one last where it ended), its cumulative
/// log-probability, and whether an end-of-generation token ended it.
#[derive(Debug, Clone)]
struct RefBeam {
    tokens: Vec<u64>,
    cum: f64,
    ended: bool,
}

/// vLLM's published beam search (`vllm/entrypoints/openai/serving_engine.py`, `beam_search`),
/// written again here from its description and run through the server's plain one-token
/// completions (`logprobs: 2w`): each step every running beam's 2w likeliest next tokens;
/// an end-of-generation one ends a beam, the w likeliest others go on; at the end the
/// ended and running beams ranked by cumulative log-probability over (prompt + text
/// tokens) ^ length_penalty, the best w kept.
fn reference_beams(
    s: &Server,
    prompt: &[u64],
    w: usize,
    max_tokens: usize,
    penalty: f64,
    eog: &[u64],
) -> Vec<RefBeam> {
    let mut running = vec![RefBeam {
        tokens: Vec::new(),
        cum: 0.0,
        ended: false,
    }];
    let mut ended = Vec::new();
    for _ in 0..max_tokens {
        let mut next: Vec<(f64, usize, u64)> = Vec::new();
        for (i, b) in running.iter().enumerate() {
            let full: Vec<u64> = prompt.iter().chain(&b.tokens).copied().collect();
            let v = ok(
                s,
                "/v1/completions",
                &json!({"prompt": full, "max_tokens": 1, "temperature": 0, "ignore_eos": true,
                        "logprobs": 2 * w, "return_tokens_as_token_ids": true}),
            );
            let mut top: Vec<(u64, f64)> = v["choices"][0]["logprobs"]["top_logprobs"][0]
                .as_object()
                .unwrap_or_else(|| panic!("{v}"))
                .iter()
                .map(|(k, lp)| {
                    let id = k.strip_prefix("token_id:").unwrap().parse().unwrap();
                    (id, lp.as_f64().unwrap())
                })
                .collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for &(t, lp) in top.iter().take(2 * w) {
                let mut tokens = b.tokens.clone();
                tokens.push(t);
                if eog.contains(&t) {
                    ended.push(RefBeam {
                        tokens,
                        cum: b.cum + lp,
                        ended: true,
                    });
                } else {
                    next.push((b.cum + lp, i, t));
                }
            }
        }
        next.sort_by(|a, b| b.0.total_cmp(&a.0));
        running = next
            .iter()
            .take(w)
            .map(|&(cum, i, t)| {
                let mut tokens = running[i].tokens.clone();
                tokens.push(t);
                RefBeam {
                    tokens,
                    cum,
                    ended: false,
                }
            })
            .collect();
        if running.is_empty() {
            break;
        }
    }
    ended.extend(running);
    let score = |b: &RefBeam| {
        let len = prompt.len() + b.tokens.len() - usize::from(b.ended);
        b.cum / (len as f64).powf(penalty)
    };
    ended.sort_by(|a, b| score(b).total_cmp(&score(a)));
    ended.truncate(w);
    ended
}

/// The choices' token ids and the sums of their `token_logprobs` (a completions answer
/// with `return_token_ids` and `logprobs`).
fn beams_of(v: &Value) -> Vec<(Vec<u64>, f64)> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let cum = c["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_f64().unwrap())
                .sum();
            (ids(&c["token_ids"]), cum)
        })
        .collect()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_beam_search_ranks_whole_sequences() {
    let _one = serial();
    let s = start(&[]);
    let info = get_ok(&s.addr, "/tokenizer_info");
    let eog = ids(&info["end_of_generation_ids"]);
    // a chat prompt (its special tokens parsed), which the model ends on its own
    let text = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n";
    let prompt = ids(&post(
        &s,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    )
    .1["tokens"]);
    let beam = |w: usize, max: usize, extra: Value| {
        ok(
            &s,
            "/v1/completions",
            &with(
                &json!({"prompt": prompt, "use_beam_search": true, "n": w, "max_tokens": max,
                        "logprobs": 2 * w, "return_token_ids": true}),
                &extra,
            ),
        )
    };
    // the beams and their order are vLLM's algorithm's over the same model's
    // log-probabilities, with and without the end-of-generation tokens ending beams, at
    // the default and another length penalty
    for (w, max, extra, penalty) in [
        (3, 10, json!({}), 1.0),
        (2, 12, json!({"length_penalty": 0.0}), 0.0),
        (
            3,
            6,
            json!({"ignore_eos": true, "length_penalty": 2.0}),
            2.0,
        ),
    ] {
        let ignore = extra["ignore_eos"] == true;
        let requests = || {
            metric(
                &http(&s.addr, "GET", "/metrics", None).1,
                "gds_requests_total",
            )
        };
        let r0 = requests();
        let got = beam(w, max, extra.clone());
        let r1 = requests();
        let want = reference_beams(
            &s,
            &prompt,
            w,
            max,
            penalty,
            if ignore { &[] } else { &eog },
        );
        // each step a request a beam; the search ends early where nothing can change (at
        // no length penalty, once the best ended beams are likelier than every running one)
        let (ours, theirs) = (r1 - r0, requests() - r1);
        assert!(
            ours <= theirs,
            "{ours} steps against the reference's {theirs}"
        );
        if penalty == 0.0 {
            assert!(
                ours < theirs,
                "{ours} steps against the reference's {theirs}"
            );
        }
        let found = beams_of(&got);
        assert_eq!(found.len(), w, "{got}");
        for (i, ((tokens, cum), r)) in found.iter().zip(&want).enumerate() {
            assert_eq!(
                tokens, &r.tokens,
                "beam {i} of {extra}: {got}\nreference {want:?}"
            );
            assert!((cum - r.cum).abs() < 1e-3, "beam {i}: {cum} vs {}", r.cum);
            let c = &got["choices"][i];
            let finish = if r.ended { "stop" } else { "length" };
            assert_eq!(c["finish_reason"], finish, "beam {i}: {c}");
            assert_eq!(c["index"], i);
        }
        // (the ended beams are ranked with the running ones where the model ends its reply)
        assert_eq!(want.iter().any(|b| b.ended), !ignore, "{got}");
        let distinct: std::collections::HashSet<_> = found.iter().map(|b| &b.0).collect();
        assert_eq!(distinct.len(), w, "the beams differ: {got}");
        // usage: the prompt once, every beam's tokens
        let n: usize = found.iter().map(|b| b.0.len()).sum();
        assert_eq!(got["usage"]["completion_tokens"], n);
        assert_eq!(got["usage"]["prompt_tokens"], prompt.len());
    }
    // one beam never ending is greedy decoding
    let one = beam(1, 12, json!({"ignore_eos": true}));
    let greedy = ok(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
                "return_token_ids": true}),
    );
    assert_eq!(
        one["choices"][0]["token_ids"],
        greedy["choices"][0]["token_ids"]
    );
    assert_eq!(one["choices"][0]["text"], greedy["choices"][0]["text"]);
    // streamed: the same choices (each in chunks of its index)
    let plain = beam(2, 8, json!({}));
    let chunks = events(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "use_beam_search": true, "n": 2, "max_tokens": 8,
                "stream": true}),
    );
    for i in 0..2 {
        let streamed: String = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap().iter())
            .filter(|c| c["index"] == i)
            .map(|c| c["text"].as_str().unwrap())
            .collect();
        assert_eq!(
            streamed,
            plain["choices"][i]["text"].as_str().unwrap(),
            "{chunks:?}"
        );
    }
    // chat: n beams as n choices
    let chat = ok(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Name a colour."}],
                "use_beam_search": true, "n": 2, "max_tokens": 16}),
    );
    let choices = chat["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{chat}");
    let reply = |c: &Value| (c["message"]["content"].clone(), c["finish_reason"].clone());
    assert_ne!(reply(&choices[0]), reply(&choices[1]), "{chat}");
    for c in choices {
        assert!(
            ["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()),
            "{c}"
        );
    }
    // refused by name: what beam search would not honour, and bad values
    let base = json!({"prompt": "Hello", "use_beam_search": true, "n": 2, "max_tokens": 4});
    for (extra, param) in [
        (json!({"stop": ["\n"]}), "stop"),
        (json!({"logit_bias": {"11": 5}}), "logit_bias"),
        (json!({"presence_penalty": 0.5}), "presence_penalty"),
        (json!({"echo": true, "n": 1}), "echo"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"min_tokens": 2}), "min_tokens"),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"use_beam_search": "yes"}), "use_beam_search"),
        (json!({"length_penalty": 100}), "length_penalty"),
        (json!({"length_penalty": "long"}), "length_penalty"),
    ] {
        let b = with(&base, &extra);
        let (code, v) = post(&s, "/v1/completions", &b);
        assert_eq!(code, 400, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
    // chat: a grammar is refused by the field that gave it
    let (code, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "use_beam_search": true,
                "guided_json": {"type": "object"}, "max_tokens": 4}),
    );
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "guided_json", "{v}");
    // without use_beam_search, length_penalty is taken and has no effect (as vLLM)
    let (code, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2, "length_penalty": 3.0}),
    );
    assert_eq!(code, 200, "{v}");
}

/// vLLM's per-request `chat_template`, taken with `--trust-request-chat-template` (refused
/// without it: `vllm_documents_reach_the_template`): a Jinja template or a built-in format's
/// name renders the request's prompt (its token count that of the text it renders, its reply
/// that of the same prompt sent as a completion); a template that does not compile or is not
/// a string is a 400 naming the field; the server's own template renders the others.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_request_chat_template_renders_the_prompt_where_trusted() {
    let _one = serial();
    let s = start(&["--trust-request-chat-template"]);
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let tokens = |text: &str| {
        ids(&ok(
            &s,
            "/tokenize",
            &json!({"prompt": text, "add_special_tokens": false}),
        )["tokens"])
    };
    let count = |extra: Value| {
        let body = with(&json!({"messages": messages}), &extra);
        ok(&s, "/v1/chat/completions/input_tokens", &body)["input_tokens"]
            .as_u64()
            .unwrap() as usize
    };
    let jinja = "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}\
                 {% if add_generation_prompt %}### assistant:{% endif %}";
    let rendered = "### user: Name a colour.\n### assistant:";
    assert_eq!(
        count(json!({"chat_template": jinja})),
        tokens(rendered).len()
    );
    // llama.cpp's built-in chatml (SmolLM2's own template adds a system prompt)
    let chatml = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(
        count(json!({"chat_template": "chatml"})),
        tokens(chatml).len()
    );
    assert!(
        count(json!({})) > tokens(chatml).len(),
        "the server's template is another"
    );
    // the reply is the one of that prompt
    let chat = ok(
        &s,
        "/v1/chat/completions",
        &json!({"messages": messages, "chat_template": jinja, "max_tokens": 8, "temperature": 0}),
    );
    let completion = ok(
        &s,
        "/v1/completions",
        &json!({"prompt": tokens(rendered), "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        completion["choices"][0]["text"]
    );
    for template in [
        json!("{% for m in messages %}"),
        json!(5),
        json!("no jinja here"),
    ] {
        let body = json!({"messages": messages, "chat_template": template, "max_tokens": 2});
        let (code, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], "chat_template", "{body}: {v}");
    }
}

/// vLLM's SageMaker endpoints: `/ping` (health), `/version`, and `/invocations`, which answers
/// a body as the endpoint its fields name (chat, completions, embeddings), the same answer.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_invocations_route_by_the_body() {
    let _one = serial();
    let s = start(&[]);
    assert_eq!(http(&s.addr, "GET", "/ping", None).0, 200);
    assert_eq!(http(&s.addr, "POST", "/ping", Some(b"{}")).0, 200);
    let (code, v) = http(&s.addr, "GET", "/version", None);
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(code, 200);
    assert!(v["version"].as_str().is_some_and(|x| !x.is_empty()), "{v}");
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                      "temperature": 0});
    let completion = json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0});
    let embedding = json!({"input": "a cat"});
    for (body, path, object) in [
        (&chat, "/v1/chat/completions", "chat.completion"),
        (&completion, "/v1/completions", "text_completion"),
        (&embedding, "/v1/embeddings", "list"),
    ] {
        let via = ok(&s, "/invocations", body);
        let direct = ok(&s, path, body);
        assert_eq!(via["object"], object, "{via}");
        let content = |v: &Value| {
            let c = &v["choices"][0];
            (
                c["message"]["content"].clone(),
                c["text"].clone(),
                v["data"][0]["embedding"].clone(),
            )
        };
        assert_eq!(content(&via), content(&direct), "{body}");
    }
    let (code, v) = post(&s, "/invocations", &json!({"model": "m"}));
    assert_eq!(code, 400, "{v}");
}

/// vLLM's priority scheduling (`--scheduling-policy priority`), one sequence at a time
/// (`--max-batch 1`): a request of priority 0 sent while one of 5 runs preempts it and ends
/// first; one of 10 sent before it waits for both (it ranks after the running one, so it
/// preempts nothing); the preempted request's text is the one it gives alone (greedy, its
/// sampler state kept). A `priority` that is not an integer is a 400.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vllm_priority_scheduling_admits_lower_values_first() {
    use crate::common::{post_in_thread, Finished};
    let _one = serial();
    let s = start(&[
        "--scheduling-policy",
        "priority",
        "--max-batch",
        "1",
        "--ctx",
        "512",
    ]);
    let long = json!({"prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": true,
                      "temperature": 0, "priority": 5});
    let done = Finished::default();
    let send = |name, body| post_in_thread(&s.addr, "/v1/completions", body, name, &done);
    let a = send("a5", long.clone());
    wait_for_metrics(&s.addr, "a never ran", |m| {
        metric(m, "gds_requests_running") >= 1.0 && metric(m, "gds_generated_tokens_total") >= 8.0
    });
    let b = send(
        "b10",
        json!({"prompt": "Hi", "max_tokens": 4, "ignore_eos": true, "priority": 10}),
    );
    wait_for_metrics(&s.addr, "b never queued", |m| {
        metric(m, "gds_queue_depth") >= 1.0
    });
    let (code, text) = http(
        &s.addr,
        "POST",
        "/v1/completions",
        Some(
            json!({"prompt": "Hi", "max_tokens": 4, "ignore_eos": true, "priority": -3})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(code, 200, "{text}");
    done.lock().unwrap().push("c-3");
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    assert_eq!(a.0, 200, "{}", a.1);
    assert_eq!(b.0, 200, "{}", b.1);
    assert_eq!(*done.lock().unwrap(), ["c-3", "a5", "b10"]);
    let m = http(&s.addr, "GET", "/metrics", None).1;
    assert_eq!(metric(&m, "gds_preemptions_total"), 1.0, "{m}");
    let alone = ok(&s, "/v1/completions", &long);
    assert_eq!(a.1["choices"][0]["text"], alone["choices"][0]["text"]);
    let (code, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "x", "priority": "high"}),
    );
    assert_eq!(code, 400, "{v}");
}
