//! Tool calling end to end: SmolLM2's weights served with Qwen2.5-Instruct's chat template
//! (`fixtures/templates/qwen2.5-instruct.jinja`, Hermes `<tool_call>` syntax), driven by the
//! official `openai` client (tests/py/serve_tools_check.py): a required call whose arguments
//! follow the function's schema, the round trip through a `role: tool` result, a named
//! function streamed and reassembled by the client, `auto`, parallel calls; and a model whose
//! template takes no tools refusing them by name.

use serde_json::Value;
use std::process::Command;

use crate::common::{http, serial, start, start_model};

/// SmolLM2 (F16 safetensors) with Qwen2.5-Instruct's template, converted into `dir`.
fn smollm_with_qwen_template(dir: &std::path::Path) -> std::path::PathBuf {
    let hf = dir.join("hf");
    gds_tests::copy_dir(&gds_tests::smollm_hf_f16(), &hf);
    let cfg_path = hf.join("tokenizer_config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = Value::String(
        std::fs::read_to_string(gds_tests::fixture("templates/qwen2.5-instruct.jinja")).unwrap(),
    );
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let out = dir.join("smollm2-qwen-template.gds");
    gds_convert::convert(
        &hf,
        &out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .expect("convert");
    out
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn tool_calls_round_trip_through_the_openai_client() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = smollm_with_qwen_template(tmp.path());
    let s = start_model(&model, &[]);
    let out = Command::new("python3")
        .arg(gds_tests::root().join("tests/py/serve_tools_check.py"))
        .arg(format!("http://{}/v1", s.addr))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "serve_tools_check.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    eprintln!("{r:#}");
    let valid_calls = |v: &Value, names: &[&str]| {
        let calls = v["calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "no calls: {v}");
        for c in calls {
            assert_eq!(c["valid"], true, "{c}");
            assert!(names.contains(&c["name"].as_str().unwrap()), "{c}");
            assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
        }
        calls.len()
    };
    let req = &r["required"];
    assert_eq!(req["finish_reason"], "tool_calls", "{req}");
    assert_eq!(valid_calls(req, &["get_weather", "get_time"]), 1, "{req}");
    assert!(req["content"].is_null(), "{req}");
    // after the tool's result, with tool_choice none: text, no calls
    let a = &r["answer"];
    assert!(a["calls"].as_array().unwrap().is_empty(), "{a}");
    assert!(!a["content"].as_str().unwrap().is_empty(), "{a}");
    assert_ne!(a["finish_reason"], "tool_calls");
    let st = &r["streamed"];
    assert_eq!(st["finish_reason"], "tool_calls", "{st}");
    assert_eq!(valid_calls(st, &["get_time"]), 1);
    let auto = &r["auto"];
    if auto["calls"].as_array().unwrap().is_empty() {
        assert!(auto["content"].is_string(), "{auto}");
    } else {
        valid_calls(auto, &["get_weather", "get_time"]);
    }
    if auto["calls"].as_array().unwrap().is_empty() {
        let st = &r["auto_streamed"];
        assert_eq!(st["content"], auto["content"], "{st}");
        assert!(
            st["pieces"].as_u64().unwrap() > 3,
            "text streams with tools too: {st}"
        );
    }
    valid_calls(&r["parallel"], &["get_weather", "get_time"]);
    assert_eq!(r["unknown_function"]["status"], 400);
    assert_eq!(r["unknown_function"]["param"], "tool_choice");
    drop(s);

    // SmolLM2's own template takes no tools: refused, naming the field and why
    let s = start(&[]);
    let body = br#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#;
    let (status, text) = http(&s.addr, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(status, 400, "{text}");
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["param"], "tools", "{text}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not take tools"),
        "{text}"
    );
}

/// `/v1/responses` through the official client (tests/py/serve_responses_check.py): text
/// equal to the chat endpoint's for the same conversation, the output limit, the streamed
/// event sequence, `responses.parse` with a pydantic model, function calls and their
/// round trip as input items, a named call streamed, and refusals naming the field.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn responses_api_through_the_openai_client() {
    let _one = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = smollm_with_qwen_template(tmp.path());
    let s = start_model(&model, &[]);
    let out = Command::new("python3")
        .arg(gds_tests::root().join("tests/py/serve_responses_check.py"))
        .arg(format!("http://{}/v1", s.addr))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "serve_responses_check.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    eprintln!("{r:#}");
    // the same job as chat: the same text and token counts
    let t = &r["text"];
    assert_eq!(t["object"], "response");
    assert_eq!(t["status"], "completed");
    assert!(t["id"].as_str().unwrap().starts_with("resp_"), "{t}");
    assert_eq!(t["items"], serde_json::json!(["message"]));
    assert_eq!(t["role"], "assistant");
    assert!(!t["text"].as_str().unwrap().is_empty(), "{t}");
    assert_eq!(t["text"], t["chat_text"], "{t}");
    assert_eq!(t["usage"]["input_tokens"], t["chat_usage"]["prompt_tokens"]);
    assert_eq!(
        t["usage"]["output_tokens"],
        t["chat_usage"]["completion_tokens"]
    );
    assert_eq!(
        t["usage"]["total_tokens"].as_u64(),
        Some(
            t["usage"]["input_tokens"].as_u64().unwrap()
                + t["usage"]["output_tokens"].as_u64().unwrap()
        )
    );
    let l = &r["limited"];
    assert_eq!(l["status"], "incomplete", "{l}");
    assert_eq!(l["reason"], "max_output_tokens");
    assert_eq!(l["output_tokens"], 5);
    // streamed: the event sequence, deltas adding up to the final text
    let st = &r["streamed"];
    let kinds: Vec<&str> = st["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(
        kinds[..2],
        ["response.created", "response.in_progress"],
        "{st}"
    );
    assert_eq!(kinds.last(), Some(&"response.completed"), "{st}");
    for k in [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.output_item.done",
    ] {
        assert!(kinds.contains(&k), "{k} missing: {st}");
    }
    assert!(st["deltas"].as_u64().unwrap() > 1, "{st}");
    assert_eq!(st["joined"], st["final_text"], "{st}");
    assert_eq!(r["parsed"]["ok"], true, "{}", r["parsed"]);
    // calls: arguments follow the schema; the round trip ends in a text answer
    let c = &r["call"];
    assert_eq!(c["valid"], true, "{c}");
    let items = c["items"].as_array().unwrap();
    assert!(
        !items.is_empty() && items.iter().all(|i| i == "function_call"),
        "{c}"
    );
    for (name, id) in c["names"]
        .as_array()
        .unwrap()
        .iter()
        .zip(c["call_ids"].as_array().unwrap())
    {
        assert_eq!(name, "get_weather");
        assert!(id.as_str().unwrap().starts_with("call_"), "{c}");
    }
    let a = &r["answer"];
    assert_eq!(a["items"], serde_json::json!(["message"]), "{a}");
    assert!(!a["text"].as_str().unwrap().is_empty(), "{a}");
    assert!(
        a["input_tokens"].as_u64() > a["question_tokens"].as_u64(),
        "the calls and results are part of the prompt: {a}"
    );
    let sc = &r["streamed_call"];
    assert_eq!(sc["name"], "get_weather", "{sc}");
    assert_eq!(sc["arguments"], sc["item_arguments"], "{sc}");
    let args: Value = serde_json::from_str(sc["arguments"].as_str().unwrap()).unwrap();
    assert!(
        args["city"].is_string() && args["unit"].is_string(),
        "{args}"
    );
    assert!(sc["kinds"]
        .as_array()
        .unwrap()
        .contains(&Value::from("response.function_call_arguments.done")));
    for (name, param) in [
        ("previous_response_id", "previous_response_id"),
        ("image", "input"),
        ("web_search", "tools"),
        ("bad_input", "input"),
    ] {
        let e = &r["refused"][name];
        assert_eq!(e["status"], 400, "{name}: {e}");
        assert_eq!(e["param"], param, "{name}: {e}");
    }
}
