//! A thinking model's reasoning apart from its answer: SmolLM2's weights served with Qwen 3's
//! chat template (`fixtures/templates/qwen3.jinja`, `<think>` tags), the reply held to a
//! thinking shape by a grammar (SmolLM2 does not think by itself): `reasoning_content` in chat
//! (whole and streamed alike), `reasoning_format: none`, Anthropic's `thinking` blocks
//! (whole and streamed), an earlier reply's reasoning rendered by the template, and a template
//! that opens the thinking in its prompt (DeepSeek-R1's style).

use serde_json::{json, Value};

use crate::common::{http, serial, start, Server};

/// A reply that thinks, then answers (GBNF, as llama-server's `grammar` field).
const THINKING: &str =
    r#"root ::= "<think>\nThe user greets. " [a-z ]{1,12} "\n</think>\n\nHello " [a-z]{1,8} ".""#;

fn post(s: &Server, path: &str, body: &Value) -> (u16, String) {
    http(&s.addr, "POST", path, Some(body.to_string().as_bytes()))
}

fn json_of(s: &Server, path: &str, body: &Value) -> Value {
    let (code, text) = post(s, path, body);
    assert_eq!(code, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// The `data:` events of a stream.
fn events(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let (code, text) = post(s, path, body);
    assert_eq!(code, 200, "{path}: {text}");
    crate::common::sse_events(&text)
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn reasoning_comes_apart_from_the_answer() {
    let _one = serial();
    let template = gds_tests::fixture("templates/qwen3.jinja");
    let s = start(&["--chat-template-file", template.to_str().unwrap()]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
        "temperature": 0, "grammar": THINKING});

    let whole = json_of(&s, "/v1/chat/completions", &chat);
    let m = &whole["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().expect("reasoning_content");
    let content = m["content"].as_str().unwrap();
    // the white space after each tag dropped, before the end tag kept (llama-server's split)
    assert!(reasoning.starts_with("The user greets. "), "{m}");
    assert!(
        reasoning.ends_with('\n') && !reasoning.contains("think>"),
        "{m}"
    );
    assert!(
        content.starts_with("Hello ") && content.ends_with('.'),
        "{m}"
    );

    // the thinking's tokens (its tags and the white space after it included): most of the
    // reply, not all of it (`Hello ` and a word or two after)
    let usage = &whole["usage"];
    let thought = usage["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    let all = usage["completion_tokens"].as_u64().unwrap();
    let answer = all - thought.min(all);
    assert!(thought >= 5 && (2..=6).contains(&answer), "{usage}");

    // streamed: the same split, reasoning deltas before the answer's
    let mut body = chat.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (mut r, mut c, mut answer_started) = (String::new(), String::new(), false);
    let mut streamed_usage = Value::Null;
    for e in events(&s, "/v1/chat/completions", &body) {
        if e["usage"].is_object() {
            streamed_usage = e["usage"].clone();
        }
        let Some(d) = e.pointer("/choices/0/delta") else {
            continue;
        };
        if let Some(t) = d["reasoning_content"].as_str() {
            assert!(!answer_started, "reasoning after the answer began: {e}");
            r.push_str(t);
        }
        if let Some(t) = d["content"].as_str().filter(|t| !t.is_empty()) {
            answer_started = true;
            c.push_str(t);
        }
    }
    assert_eq!((r.as_str(), c.as_str()), (reasoning, content));
    // (the same prompt again: all of it but its last token from the prefix cache)
    let mut again = usage.clone();
    again["prompt_tokens_details"]["cached_tokens"] =
        json!(usage["prompt_tokens"].as_u64().unwrap() - 1);
    assert_eq!(streamed_usage, again);

    // reasoning_format none: the reply whole (no reasoning tokens apart)
    let mut body = chat.clone();
    body["reasoning_format"] = json!("none");
    let v = json_of(&s, "/v1/chat/completions", &body);
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        0
    );
    let m = &v["choices"][0]["message"];
    assert!(m.get("reasoning_content").is_none(), "{m}");
    assert_eq!(
        m["content"],
        format!("<think>\n{reasoning}</think>\n\n{content}")
    );
    body["reasoning_format"] = json!("sometimes");
    let (code, text) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("reasoning_format"), "{text}");

    // Anthropic: a thinking block, then the text
    let msg = json!({"model": "m", "max_tokens": 60, "temperature": 0, "grammar": THINKING,
        "messages": [{"role": "user", "content": "hi"}]});
    let a = json_of(&s, "/v1/messages", &msg);
    assert_eq!(a["content"][0]["type"], "thinking", "{a}");
    assert_eq!(a["content"][0]["thinking"], reasoning, "{a}");
    assert_eq!(a["content"][1]["type"], "text", "{a}");
    assert_eq!(a["content"][1]["text"], content, "{a}");
    let mut body = msg.clone();
    body["stream"] = json!(true);
    let (mut blocks, mut thinking, mut text) = (Vec::new(), String::new(), String::new());
    for e in events(&s, "/v1/messages", &body) {
        match e["type"].as_str().unwrap() {
            "content_block_start" => blocks.push(e["content_block"]["type"].clone()),
            "content_block_delta" => match e["delta"]["type"].as_str().unwrap() {
                "thinking_delta" => thinking.push_str(e["delta"]["thinking"].as_str().unwrap()),
                "text_delta" => text.push_str(e["delta"]["text"].as_str().unwrap()),
                _ => {}
            },
            _ => {}
        }
    }
    assert_eq!(blocks, [json!("thinking"), json!("text")]);
    assert_eq!((thinking.as_str(), text.as_str()), (reasoning, content));

    // Responses: a reasoning item, then the message; streamed as reasoning_text deltas
    let resp = json!({"model": "m", "max_output_tokens": 60, "temperature": 0,
        "grammar": THINKING, "input": "hi"});
    let r1 = json_of(&s, "/v1/responses", &resp);
    assert_eq!(
        r1["usage"]["output_tokens_details"]["reasoning_tokens"], thought,
        "{r1}"
    );
    let out = r1["output"].as_array().unwrap();
    assert_eq!(out.len(), 2, "{r1}");
    assert_eq!(out[0]["type"], "reasoning", "{r1}");
    assert_eq!(out[0]["content"][0]["text"], reasoning, "{r1}");
    assert_eq!(out[1]["content"][0]["text"], content, "{r1}");
    let mut body = resp.clone();
    body["stream"] = json!(true);
    let (mut thinking, mut text, mut done) = (String::new(), String::new(), Vec::new());
    for e in events(&s, "/v1/responses", &body) {
        match e["type"].as_str().unwrap() {
            "response.reasoning_text.delta" => thinking.push_str(e["delta"].as_str().unwrap()),
            "response.output_text.delta" => {
                assert_eq!(e["output_index"], 1, "{e}");
                text.push_str(e["delta"].as_str().unwrap())
            }
            "response.output_item.done" => done.push(e["item"]["type"].clone()),
            "response.completed" => {
                let u = &e["response"]["usage"];
                assert_eq!(
                    u["output_tokens_details"]["reasoning_tokens"], thought,
                    "{e}"
                );
            }
            _ => {}
        }
    }
    assert_eq!((thinking.as_str(), text.as_str()), (reasoning, content));
    assert_eq!(done, [json!("reasoning"), json!("message")]);
    // the output given back as input (reasoning item included), and by previous_response_id
    let mut items = vec![json!({"role": "user", "content": "hi"})];
    items.extend(out.iter().cloned());
    items.push(json!({"role": "user", "content": "and?"}));
    let mut next = resp.clone();
    next["input"] = json!(items);
    assert_eq!(json_of(&s, "/v1/responses", &next)["status"], "completed");
    let mut next = resp.clone();
    next["input"] = json!("and?");
    next["previous_response_id"] = r1["id"].clone();
    assert_eq!(json_of(&s, "/v1/responses", &next)["status"], "completed");

    // an earlier reply's reasoning goes to the template (Qwen 3 renders it for the turns
    // after the last user message), from chat's field and from Anthropic's thinking block
    let turns = json!([{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]);
    let p = json_of(&s, "/apply-template", &json!({"messages": turns}));
    assert!(
        p["prompt"]
            .as_str()
            .unwrap()
            .contains("<think>\nCall the tool.\n</think>"),
        "{p}"
    );
    let n = |body: Value| json_of(&s, "/v1/messages/count_tokens", &body)["input_tokens"].clone();
    let with = json!({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call the tool.", "signature": ""},
            {"type": "tool_use", "id": "c1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]});
    let mut without = with.clone();
    without["messages"][1]["content"]
        .as_array_mut()
        .unwrap()
        .remove(0);
    assert!(n(with).as_u64() > n(without).as_u64());
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_prompt_that_opens_the_thinking() {
    let _one = serial();
    // DeepSeek-R1's style: the generation prompt opens `<think>`; the reply only closes it
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";
    let s = start(&["--chat-template", template]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
        "temperature": 0, "grammar": r#"root ::= "I see " [a-z]{1,8} ".\n</think>\n\nYes " [a-z]{1,8} ".""#});
    let m = &json_of(&s, "/v1/chat/completions", &chat)["choices"][0]["message"];
    let r = m["reasoning_content"].as_str().expect("reasoning_content");
    assert!(r.starts_with("I see ") && r.ends_with(".\n"), "{m}");
    assert!(m["content"].as_str().unwrap().starts_with("Yes "), "{m}");
    // cut off while thinking: all of it reasoning
    let mut short = chat.clone();
    short["max_tokens"] = json!(2);
    let m = &json_of(&s, "/v1/chat/completions", &short)["choices"][0]["message"];
    assert!(
        m["reasoning_content"].as_str().unwrap().starts_with("I"),
        "{m}"
    );
    assert_eq!(m["content"], "", "{m}");
    // a JSON schema holds the answer, after the thinking: not forced where the thinking is
    // (the grammar compiles with the thinking before it; SmolLM2 then thinks on)
    let json = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "a",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}});
    let m = &json_of(&s, "/v1/chat/completions", &json)["choices"][0]["message"];
    let r = m["reasoning_content"].as_str().expect("reasoning_content");
    assert!(
        !r.starts_with("{\"a\""),
        "the schema was forced into the thinking: {m}"
    );

    // thinking off (a request's enable_thinking false, or --reasoning off): the prompt's open
    // thinking closed, as llama-server closes it; the reply is all answer
    let hi = json!({"messages": [{"role": "user", "content": "hi"}]});
    let ends = |s: &Server, body: &Value| {
        json_of(s, "/apply-template", body)["prompt"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(ends(&s, &hi).ends_with("<think>\n"));
    let mut off = hi.clone();
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    assert!(
        ends(&s, &off).ends_with("<think>\n</think>"),
        "{}",
        ends(&s, &off)
    );
    let mut body = off.clone();
    body["max_tokens"] = json!(4);
    body["temperature"] = json!(0);
    let m = &json_of(&s, "/v1/chat/completions", &body)["choices"][0]["message"];
    assert!(m.get("reasoning_content").is_none(), "{m}");
    assert!(!m["content"].as_str().unwrap().is_empty(), "{m}");
    let n = |s: &Server, body: &Value| {
        json_of(s, "/v1/chat/completions/input_tokens", body)["input_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(n(&s, &off) > n(&s, &hi), "the closing tag is in the prompt");
    // OpenAI's reasoning_effort none and Anthropic's thinking disabled switch it off too
    let mut none = hi.clone();
    none["reasoning_effort"] = json!("none");
    assert!(ends(&s, &none).ends_with("<think>\n</think>"));
    none["reasoning_effort"] = json!("extreme");
    assert_eq!(post(&s, "/apply-template", &none).0, 400);
    let count = |thinking: Value| {
        let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        if !thinking.is_null() {
            b["thinking"] = thinking;
        }
        json_of(&s, "/v1/messages/count_tokens", &b)["input_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(count(json!({"type": "disabled"})) > count(Value::Null));
    assert_eq!(
        count(json!({"type": "enabled", "budget_tokens": 1024})),
        count(Value::Null)
    );
    drop(s);
    let s = start(&["--chat-template", template, "--reasoning", "off"]);
    assert!(ends(&s, &hi).ends_with("<think>\n</think>"));
    let mut on = hi.clone();
    on["chat_template_kwargs"] = json!({"enable_thinking": true});
    assert!(
        ends(&s, &on).ends_with("<think>\n"),
        "a request's own setting wins"
    );
}

/// A harmony reply (gpt-oss's template, `fixtures/templates/gpt-oss.jinja`): an analysis
/// message, then the final one, held to that shape by a grammar. Its messages' headers never
/// reach the client: the analysis is `reasoning_content` (whole and streamed alike; an
/// Anthropic thinking block), the final message the `content`; `reasoning_format: none`
/// keeps the analysis in the content, tags and all (as llama-server); a JSON schema lets the
/// model think first and puts the JSON in the final channel; an earlier reply's reasoning
/// reaches the template as its `thinking`.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn harmony_messages_come_apart_by_channel() {
    const HARMONY: &str = r#"root ::= "<|channel|>analysis<|message|>The user greets. " [a-z ]{1,12} "<|end|><|start|>assistant<|channel|>final<|message|>Hello " [a-z]{1,8} ".""#;
    let _one = serial();
    let template = gds_tests::fixture("templates/gpt-oss.jinja");
    let s = start(&["--chat-template-file", template.to_str().unwrap()]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
        "temperature": 0, "grammar": HARMONY});
    let whole = json_of(&s, "/v1/chat/completions", &chat);
    let m = &whole["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().expect("reasoning_content");
    let content = m["content"].as_str().unwrap();
    // the analysis body's tokens are the reasoning; the headers and the final message not
    let u = &whole["usage"];
    let thought = u["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    let all = u["completion_tokens"].as_u64().unwrap();
    assert!(thought >= 4 && thought + 4 <= all, "{u}");
    assert!(
        reasoning.starts_with("The user greets. ") && !reasoning.contains("<|"),
        "{m}"
    );
    assert!(
        content.starts_with("Hello ") && content.ends_with('.'),
        "{m}"
    );

    let mut body = chat.clone();
    body["stream"] = json!(true);
    let (mut r, mut c) = (String::new(), String::new());
    for e in events(&s, "/v1/chat/completions", &body) {
        let Some(d) = e.pointer("/choices/0/delta") else {
            continue;
        };
        r.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(d["content"].as_str().unwrap_or(""));
    }
    assert_eq!((r.as_str(), c.as_str()), (reasoning, content));

    let mut body = chat.clone();
    body["reasoning_format"] = json!("none");
    let m = &json_of(&s, "/v1/chat/completions", &body)["choices"][0]["message"];
    assert_eq!(
        m["content"],
        format!("<|channel|>analysis<|message|>{reasoning}<|end|>{content}"),
        "{m}"
    );

    let msg = json!({"model": "m", "max_tokens": 60, "temperature": 0, "grammar": HARMONY,
        "messages": [{"role": "user", "content": "hi"}]});
    let a = json_of(&s, "/v1/messages", &msg);
    assert_eq!(a["content"][0]["thinking"], reasoning, "{a}");
    assert_eq!(a["content"][1]["text"], content, "{a}");

    // a JSON schema: any analysis first, the JSON in the final channel
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"], "additionalProperties": false});
    let body = json!({"messages": [{"role": "user", "content": "Is Paris in France?"}],
        "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}});
    let v = json_of(&s, "/v1/chat/completions", &body);
    let m = &v["choices"][0]["message"];
    let content = m["content"].as_str().unwrap();
    assert!(!content.contains("<|"), "{v}");
    if v["choices"][0]["finish_reason"] == "stop" {
        let j: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {v}"));
        assert!(j["ok"].is_boolean(), "{v}");
    } else {
        // SmolLM2 may think to the end: then all of it is reasoning
        assert!(
            content.is_empty() && m["reasoning_content"].is_string(),
            "{v}"
        );
    }

    // an earlier reply's reasoning is the template's `thinking` (the analysis before its
    // call, kept while no final message follows)
    let turns = json!([{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]);
    let p = json_of(&s, "/apply-template", &json!({"messages": turns}));
    assert!(
        p["prompt"].as_str().unwrap().contains(
            "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant to=functions.w"
        ),
        "{p}"
    );
}
