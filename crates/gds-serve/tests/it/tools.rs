//! Tool calling end to end: SmolLM2's weights served with Qwen2.5-Instruct's chat template
//! (`fixtures/templates/qwen2.5-instruct.jinja`, Hermes `<tool_call>` syntax), driven by the
//! official `openai` client (tests/py/serve_tools_check.py): a required call whose arguments
//! follow the function's schema, the round trip through a `role: tool` result, a named
//! function streamed and reassembled by the client, `auto`, parallel calls, a call cut off by
//! `max_tokens`; and a model whose template takes no tools refusing them by name (unless
//! `tool_choice` is `none`).

use serde_json::Value;

use crate::common::{http, python, serial, start, start_model};

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
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let tmp = tempfile::tempdir().unwrap();
    let model = smollm_with_qwen_template(tmp.path());
    let s = start_model(&model, &[]);
    let r = python("serve_tools_check.py", &[&format!("http://{}/v1", s.addr)]);
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

    // A call cut off by max_tokens (the required call's grammar makes the reply a call; 6
    // tokens end it inside): finish "length", and no call syntax in the content, whole or
    // streamed, in OpenAI's and Anthropic's forms.
    // (2 tokens cut the opening tag itself, `<tool`: no text either)
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;
    for (stream, max) in [(false, 6), (true, 6), (false, 2), (true, 2)] {
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "Weather in Paris?"}}], "max_tokens": {max}, "temperature": 0, "tool_choice": "required", "stream": {stream}, "tools": {tools}}}"#
        );
        let (status, text) = http(
            &s.addr,
            "POST",
            "/v1/chat/completions",
            Some(body.as_bytes()),
        );
        assert_eq!(status, 200, "{text}");
        assert!(
            !text.contains("tool_call>") && !text.contains("<tool"),
            "stream {stream}: call syntax in {text}"
        );
        assert!(
            !text.contains("tool_calls\""),
            "stream {stream}: a finish of tool_calls in {text}"
        );
        assert!(text.contains("\"length\""), "stream {stream}: {text}");
        let body = format!(
            r#"{{"model": "m", "max_tokens": {max}, "messages": [{{"role": "user", "content": "Weather in Paris?"}}], "tool_choice": {{"type": "any"}}, "stream": {stream}, "tools": [{{"name": "get_weather", "input_schema": {{"type": "object", "properties": {{"city": {{"type": "string"}}}}}}}}]}}"#
        );
        let (status, text) = http(&s.addr, "POST", "/v1/messages", Some(body.as_bytes()));
        assert_eq!(status, 200, "{text}");
        assert!(
            !text.contains("tool_call>") && !text.contains("<tool"),
            "stream {stream}: call syntax in {text}"
        );
        assert!(text.contains("\"max_tokens\""), "stream {stream}: {text}");
        assert!(!text.contains("\"tool_use\""), "stream {stream}: {text}");
    }
    // a schema that does not compile is the function's fault, named; parameters that are
    // not an object are refused, in both APIs
    for (path, body) in [
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "foo"}}}}}]}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "string"}}}]}"#,
        ),
        (
            "/v1/messages",
            r#"{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "get_weather", "input_schema": {"type": "array"}}]}"#,
        ),
    ] {
        let (status, text) = http(&s.addr, "POST", path, Some(body.as_bytes()));
        assert_eq!(status, 400, "{body}: {text}");
        assert!(
            text.contains("function get_weather") && !text.contains("start:"),
            "{body}: {text}"
        );
        if path == "/v1/chat/completions" {
            let e: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(e["error"]["param"], "tools", "{text}");
        }
    }
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
    // unless no call is asked for: then the tools are left out
    let body = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]}"#;
    let (status, text) = http(&s.addr, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(status, 200, "{text}");
}

/// `/v1/responses` through the official client (tests/py/serve_responses_check.py): text
/// equal to the chat endpoint's for the same conversation, the output limit, the streamed
/// event sequence, `responses.parse` with a pydantic model, function calls and their
/// round trip as input items, a named call streamed, background responses (polled, cancelled,
/// a stream left and followed again), the output text's log-probabilities, conversations
/// (OpenAI's Conversations API, and responses through them), and refusals naming the field.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn responses_api_through_the_openai_client() {
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let tmp = tempfile::tempdir().unwrap();
    let model = smollm_with_qwen_template(tmp.path());
    let s = start_model(&model, &[]);
    let r = python(
        "serve_responses_check.py",
        &[&format!("http://{}/v1", s.addr)],
    );
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
    // kept responses: continued by id = the same conversation sent whole (instructions not
    // carried over), streamed too; retrieved, listed, deleted; store=false not kept
    let k = &r["kept"];
    assert_eq!(k["store"], serde_json::json!([true, true, false]), "{k}");
    assert_eq!(k["previous"], k["r1"], "{k}");
    assert_eq!(k["chained"], k["whole"], "{k}");
    assert_eq!(k["streamed"]["text"], k["whole"]["text"], "{k}");
    assert_eq!(
        k["streamed"]["input_tokens"], k["whole"]["input_tokens"],
        "{k}"
    );
    assert_eq!(k["streamed"]["previous"], k["r1"], "{k}");
    assert_eq!(k["retrieved"]["text"], k["chained"]["text"], "{k}");
    assert_eq!(
        k["input_items"],
        serde_json::json!([["message", "user"]]),
        "{k}"
    );
    assert_eq!(
        k["input_item_fields"],
        serde_json::json!([[true, "completed", "What is my name?"]]),
        "{k}"
    );
    assert_eq!(k["deleted_status"], 404, "{k}");
    assert_eq!(k["not_kept"]["status"], 400, "{k}");
    assert_eq!(k["not_kept"]["param"], "previous_response_id", "{k}");
    // background: queued at once, then the foreground's text; a cancel stops the engine's
    // request; a client that leaves a streamed one follows it again from where it left
    let b = &r["background"];
    assert_eq!(b["created"], "queued", "{b}");
    assert_eq!(b["background"], true, "{b}");
    assert_eq!(b["done"], "completed", "{b}");
    assert_eq!(b["text"], b["fg_text"], "{b}");
    assert_eq!(b["usage"], b["fg_usage"], "{b}");
    assert_eq!(b["cancelled"], "cancelled", "{b}");
    assert_eq!(b["after_cancel"], "cancelled", "{b}");
    assert_eq!(
        b["drained"], true,
        "the cancelled request left the engine: {b}"
    );
    assert_eq!(
        b["cancel_again"],
        serde_json::json!({"status": 200, "value": "cancelled"}),
        "{b}"
    );
    assert_eq!(b["cancel_done"]["status"], 400, "{b}");
    assert_eq!(b["cancel_foreground"]["status"], 400, "{b}");
    assert_eq!(b["no_store"]["status"], 400, "{b}");
    assert_eq!(b["no_store"]["param"], "background", "{b}");
    assert_eq!(b["continue_cancelled"]["status"], 400, "{b}");
    assert_eq!(
        b["continue_cancelled"]["param"], "previous_response_id",
        "{b}"
    );
    assert_eq!(b["continue_done"], "incomplete", "{b}");
    let first: Vec<&str> = b["stream_first"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(first[..2], ["response.created", "response.queued"], "{b}");
    assert!(first.contains(&"response.in_progress"), "{b}");
    let last = b["last_seq"].as_u64().unwrap();
    let seqs: Vec<u64> = b["stream_seqs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    assert_eq!(seqs.first(), Some(&(last + 1)), "{b}");
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{b}");
    assert_eq!(
        b["stream_rest"].as_array().unwrap().last(),
        Some(&Value::from("response.completed")),
        "{b}"
    );
    assert_eq!(b["stream_text"], b["stream_final"], "{b}");
    assert_eq!(b["stream_final"], b["fg_text"], "{b}");
    let all: Vec<u64> = (0..=*seqs.last().unwrap()).collect();
    assert_eq!(b["stream_all"], serde_json::json!(all), "{b}");
    // the output text's log-probabilities: the chat endpoint's, a token each (not the end of
    // generation), top_logprobs alternatives each, the same streamed; none unless asked
    let l = &r["logprobs"];
    assert_eq!(l["tokens"], l["chat_tokens"], "{l}");
    let close = |a: &Value, b: &Value| {
        let (a, b) = (a.as_array().unwrap(), b.as_array().unwrap());
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-4)
    };
    assert!(close(&l["lp"], &l["chat_lp"]), "{l}");
    let n = l["tokens"].as_array().unwrap().len();
    assert!(n > 0, "{l}");
    assert!(
        n as u64 + 1 >= l["output_tokens"].as_u64().unwrap(),
        "a token each: {l}"
    );
    assert!(l["top"].as_array().unwrap().iter().all(|k| k == 3), "{l}");
    let streamed: Vec<Value> = l["streamed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].clone())
        .collect();
    assert!(close(&Value::from(streamed), &l["lp"]), "{l}");
    assert_eq!(l["top_logprobs"], 3, "{l}");
    assert_eq!(l["plain"], serde_json::json!([[]]), "{l}");
    assert_eq!(l["bad_top"]["status"], 400, "{l}");
    assert_eq!(l["bad_top"]["param"], "top_logprobs", "{l}");
    // llama-server's telemetry: prompt progress on in_progress events, timings on every
    // delta and on the last event
    let t = &r["telemetry"];
    let progress = t["progress"].as_array().unwrap();
    assert!(!progress.is_empty(), "{t}");
    for p in progress {
        assert_eq!(p[0], "response.in_progress", "{t}");
        assert!(p[1].as_u64().unwrap() > 0 && p[3] == true, "{t}");
    }
    assert!(t["deltas"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["delta_timings"], t["deltas"], "{t}");
    assert_eq!(t["last"][1], true, "{t}");
    // conversations: responses through one equal the same conversation sent whole; its
    // items in order (the first item, then each response's input and output), paged; added,
    // read, deleted; metadata; deleted; refusals naming the field
    let c = &r["conversations"];
    assert_eq!(c["object"], "conversation", "{c}");
    assert!(c["id"].as_str().unwrap().starts_with("conv_"), "{c}");
    assert_eq!(c["metadata"], serde_json::json!({"topic": "names"}), "{c}");
    assert_eq!(c["c2"]["text"], c["whole"]["text"], "{c}");
    assert_eq!(c["c2"]["input_tokens"], c["whole"]["input_tokens"], "{c}");
    assert_eq!(c["c2"]["conversation"], c["id"], "{c}");
    let roles: Vec<&Value> = c["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| &i[1])
        .collect();
    assert_eq!(
        roles,
        ["user", "user", "assistant", "user", "assistant"],
        "{c}"
    );
    assert_eq!(c["items"][3][2], "What is my name?", "{c}");
    assert_eq!(c["items"][4][2], c["c2"]["text"], "{c}");
    let ids: Vec<Value> = c["ids"].as_array().unwrap().to_vec();
    assert_eq!(
        c["page1"],
        serde_json::json!([ids[4], ids[3]]),
        "newest first: {c}"
    );
    assert_eq!(c["page1_more"], true, "{c}");
    assert_eq!(c["page2"], serde_json::json!([ids[2], ids[1]]), "{c}");
    assert_eq!(
        c["after_stream"], 7,
        "a streamed response adds its two: {c}"
    );
    assert_eq!(c["added"], serde_json::json!(["list", 1, true]), "{c}");
    assert_eq!(c["got_item"], "An aside.", "{c}");
    assert_eq!(c["after_delete"], 7, "{c}");
    assert_eq!(
        c["updated"],
        serde_json::json!({"topic": "greetings"}),
        "{c}"
    );
    assert_eq!(c["retrieved"], c["updated"], "{c}");
    assert_eq!(
        c["deleted"],
        serde_json::json!(["conversation.deleted", true]),
        "{c}"
    );
    assert_eq!(c["gone"], 404, "{c}");
    for (name, param) in [
        ("both", "conversation"),
        ("respond_gone", "conversation"),
        ("image", "items"),
        ("too_many", "items"),
    ] {
        assert_eq!(c[name]["status"], 400, "{name}: {c}");
        assert_eq!(c[name]["param"], param, "{name}: {c}");
    }
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

/// Anthropic's Messages API through the official `anthropic` client
/// (tests/py/serve_anthropic_check.py), the server holding an API key (`x-api-key`): text and
/// token counts equal to the chat endpoint's for the same conversation, `count_tokens`, the
/// stop reasons (`max_tokens`, `stop_sequence` with the sequence, `tool_use`), the streamed
/// event sequence, structured output, a prefill continued, tool use and its round trip, a named tool streamed,
/// and errors in Anthropic's shape.
#[test]
#[ignore = "tier 2: needs the fetched models and the anthropic package (scripts/test.sh)"]
fn messages_api_through_the_anthropic_client() {
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let tmp = tempfile::tempdir().unwrap();
    let model = smollm_with_qwen_template(tmp.path());
    let s = start_model(&model, &["--api-key", "sekrit"]);
    let r = python(
        "serve_anthropic_check.py",
        &[&format!("http://{}", s.addr), "sekrit"],
    );
    eprintln!("{r:#}");
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"));
    // the Models API in Anthropic's shape: the served model listed and retrieved, another a
    // 404 in Anthropic's error shape
    let m = &r["models"];
    assert_eq!(m["ids"], serde_json::json!([m["id"]]), "{m}");
    assert_eq!(m["type"], "model", "{m}");
    assert!(m["created_at"].as_str().unwrap().starts_with("20"), "{m}");
    assert_eq!(m["missing"]["status"], 404, "{m}");
    assert_eq!(
        m["missing"]["body"]["error"]["type"], "not_found_error",
        "{m}"
    );
    // the same job as chat: the same text and token counts
    let t = &r["text"];
    assert!(t["id"].as_str().unwrap().starts_with("msg_"), "{t}");
    assert_eq!(
        (&t["type"], &t["role"]),
        (&"message".into(), &"assistant".into())
    );
    assert_eq!(t["blocks"], serde_json::json!(["text"]), "{t}");
    assert!(!t["text"].as_str().unwrap().is_empty(), "{t}");
    assert_eq!(t["text"], t["chat_text"], "{t}");
    let u = &t["usage"];
    let input = n(&u["input_tokens"]) + n(&u["cache_read_input_tokens"]);
    assert_eq!(input, n(&t["chat_usage"]["prompt_tokens"]), "{t}");
    assert_eq!(input, n(&t["count_tokens"]), "{t}");
    assert_eq!(
        u["output_tokens"], t["chat_usage"]["completion_tokens"],
        "{t}"
    );
    let want = if t["chat_finish"] == "length" {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(t["stop_reason"], want, "{t}");
    assert_eq!(
        r["limited"]["stop_reason"], "max_tokens",
        "{}",
        r["limited"]
    );
    assert_eq!(r["limited"]["output_tokens"], 5, "{}", r["limited"]);
    // a stop sequence: named, the text cut before it
    let st = &r["stop"];
    assert!(
        st["word"].is_string(),
        "the story has a word to stop at: {st}"
    );
    assert_eq!(st["stop_reason"], "stop_sequence", "{st}");
    assert_eq!(st["stop_sequence"], st["word"], "{st}");
    assert_eq!(st["text"], st["expected"], "{st}");
    // streamed: Anthropic's event order, deltas adding up to the final and unstreamed text
    let sm = &r["streamed"];
    let kinds: Vec<&str> = sm["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // (the client also yields its own `text` events beside the raw ones)
    let raw: Vec<&str> = kinds
        .iter()
        .copied()
        .filter(|k| k.starts_with("message_") || k.starts_with("content_block_"))
        .collect();
    assert_eq!(raw.first(), Some(&"message_start"), "{sm}");
    assert_eq!(raw[1], "content_block_start", "{sm}");
    assert_eq!(
        raw[raw.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"],
        "{sm}"
    );
    assert!(n(&sm["deltas"]) > 1, "{sm}");
    assert_eq!(sm["joined"], sm["final_text"], "{sm}");
    assert_eq!(sm["joined"], sm["unstreamed"], "{sm}");
    assert!(n(&sm["output_tokens"]) > 0, "{sm}");
    assert_eq!(r["structured"]["valid"], true, "{}", r["structured"]);
    // prefill: continued, as chat's continue_final_message; the assistant's start is prompt
    let p = &r["prefill"];
    assert!(!p["text"].as_str().unwrap().is_empty(), "{p}");
    assert_eq!(p["text"], p["chat_text"], "{p}");
    assert!(n(&p["tokens"]) > n(&p["without"]), "{p}");
    // tool use: input following the schema, the round trip ends in text
    let c = &r["call"];
    assert_eq!(c["valid"], true, "{c}");
    assert_eq!(c["stop_reason"], "tool_use", "{c}");
    for (name, id) in c["names"]
        .as_array()
        .unwrap()
        .iter()
        .zip(c["ids"].as_array().unwrap())
    {
        assert_eq!(name, "get_weather");
        assert!(id.as_str().unwrap().starts_with("toolu_"), "{c}");
    }
    let a = &r["answer"];
    assert_eq!(a["blocks"], serde_json::json!(["text"]), "{a}");
    assert!(!a["text"].as_str().unwrap().is_empty(), "{a}");
    assert!(n(&a["input_tokens"]) > n(&a["question_tokens"]), "{a}");
    let sc = &r["streamed_call"];
    assert_eq!(sc["name"], "get_weather", "{sc}");
    assert_eq!(sc["stop_reason"], "tool_use", "{sc}");
    let partial: Value = serde_json::from_str(sc["partial"].as_str().unwrap()).unwrap();
    assert_eq!(partial, sc["input"], "{sc}");
    assert!(sc["input"]["city"].is_string(), "{sc}");
    // errors in Anthropic's shape
    let e = &r["refused"];
    assert_eq!(e["wrong_key"]["status"], 401, "{e}");
    assert_eq!(e["wrong_key"]["error_type"], "authentication_error", "{e}");
    for name in ["image", "server_tool"] {
        assert_eq!(e[name]["status"], 400, "{name}: {e}");
        assert_eq!(e[name]["type"], "error", "{name}: {e}");
        assert_eq!(
            e[name]["error_type"], "invalid_request_error",
            "{name}: {e}"
        );
    }
    let m = &e["no_max_tokens"];
    assert_eq!(m["status"], 400, "{m}");
    assert_eq!(m["body"]["error"]["type"], "invalid_request_error", "{m}");
    assert!(
        m["body"]["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("max_tokens"),
        "{m}"
    );
    assert_eq!(e["unknown_path"]["status"], 404, "{e}");
    assert_eq!(
        e["unknown_path"]["body"]["error"]["type"], "not_found_error",
        "{e}"
    );
}

/// `tool_choice: required` in each tagged syntax: SmolLM2's weights served with Qwen3-Coder's,
/// GLM 4.6's, MiniMax M2's and Mistral Small 3.2's templates (`fixtures/templates/`), the reply
/// held to the template's call syntax by the grammar gdsrun builds for it, read back as a call
/// whose arguments have the schema's types (a string, an integer); streamed alike; and the
/// call and its result sent back (Mistral's template takes only its own id form).
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn required_calls_in_each_tagged_syntax() {
    let _one = serial();
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather of a city over some days",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
            "days": {"type": "integer", "minimum": 1, "maximum": 16}}, "required": ["city", "days"]}}}]);
    for file in [
        "qwen3-coder.jinja",
        "glm-4.6.jinja",
        "hunyuan-3.jinja",
        "apriel-1.5.jinja",
        "minimax-m2.jinja",
        "mistral-small-3.2.jinja",
        "gpt-oss.jinja",
        "gemma-4.jinja",
        "command-r7b.jinja",
        "nemotron-nano-v2.jinja",
        "apertus-8b.jinja",
        "granite-3.3.jinja",
        "lfm2.5.jinja",
        "kimi-k2.jinja",
        "deepseek-v3.2.jinja",
    ] {
        let template = gds_tests::fixture(&format!("templates/{file}"));
        // Command R7B's prompt is long (1.4 K tokens): a context to hold it (and Hunyuan 3's
        // tags are many tokens each in SmolLM2's vocabulary: room for its call), and a KV
        // pool that keeps the prompt's blocks, so the streamed request and the round trip
        // take the shared prefix from the cache (Command R7B's prompt: 9 s each on two cores)
        let s = start(&[
            "--chat-template-file",
            template.to_str().unwrap(),
            "--ctx",
            "2048",
            "--kv-budget",
            "256",
        ]);
        let mut body = serde_json::json!({"messages": [
            {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}],
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": false,
            "max_tokens": if file == "hunyuan-3.jinja" { 160 } else { 96 }, "temperature": 0,
            // MiniMax's prompt opens a thinking that SmolLM2 never closes: the reply whole,
            // so the call's grammar starts it
            "reasoning_format": "none"});
        let post = |b: &Value| {
            let (code, text) = http(
                &s.addr,
                "POST",
                "/v1/chat/completions",
                Some(b.to_string().as_bytes()),
            );
            assert_eq!(code, 200, "{file}: {text}");
            text
        };
        let v: Value = serde_json::from_str(&post(&body)).unwrap();
        let choice = &v["choices"][0];
        // a reply the limit ended says so, calls or not (llama-server's finish)
        let cut = v["usage"]["completion_tokens"] == body["max_tokens"];
        let finish = if cut { "length" } else { "tool_calls" };
        assert_eq!(choice["finish_reason"], finish, "{file}: {v}");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "get_weather", "{file}: {v}");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(
            args["city"].is_string() && args["days"].is_i64(),
            "{file}: {args}"
        );
        // streamed: the same call, whole in one delta
        body["stream"] = serde_json::json!(true);
        let text = post(&body);
        let streamed: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).unwrap())
            .filter_map(|e| e.pointer("/choices/0/delta/tool_calls/0").cloned())
            .collect();
        assert_eq!(streamed.len(), 1, "{file}: {text}");
        assert_eq!(
            streamed[0]["function"]["arguments"], call["function"]["arguments"],
            "{file}"
        );
        // the round trip: the call and its result in the next request (a few tokens of
        // reply: what is checked is that the template takes the call and its result)
        body["stream"] = serde_json::json!(false);
        body["tool_choice"] = serde_json::json!("none");
        body["max_tokens"] = serde_json::json!(8);
        let msgs = body["messages"].as_array_mut().unwrap();
        msgs.push(choice["message"].clone());
        msgs.push(serde_json::json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}));
        let v: Value = serde_json::from_str(&post(&body)).unwrap();
        assert!(
            v["choices"][0]["message"]["content"].is_string(),
            "{file}: {v}"
        );
    }
}

/// A model whose vocabulary has its tool-call tags as special tokens (SmolLM2's with two of
/// its special tokens renamed `<tool_call>` and `</tool_call>`, as Hermes-style models have
/// them): decoding drops special tokens, but a chat reply whose calls are parsed keeps the
/// syntax's tags (llama-server's preserved tokens); without tools, with `tool_choice: none`
/// and in raw completions they are dropped as before. The tag is forced by `logit_bias`.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_syntax_s_special_tokens_stay_in_the_reply() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gds");
    gds_tests::copy_dir(gds_tests::smollm_converted(), &model);
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap())
            .unwrap();
    let mut renamed = Vec::new();
    for (old, new) in [
        ("<gh_stars>", "<tool_call>"),
        ("<issue_start>", "</tool_call>"),
    ] {
        let id = tok["model"]["vocab"][old].as_u64().unwrap();
        let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
        vocab.remove(old);
        vocab.insert(new.into(), id.into());
        for a in tok["added_tokens"].as_array_mut().unwrap() {
            if a["content"] == old {
                assert_eq!(a["special"], true);
                a["content"] = new.into();
            }
        }
        renamed.push(id);
    }
    gds_tests::forge_file(&model, "tokenizer.json", tok.to_string().as_bytes());
    let template = gds_tests::fixture("templates/qwen2.5-instruct.jinja");
    let s = start_model(
        &model,
        &["--chat-template-file", template.to_str().unwrap()],
    );
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let open = renamed[0];
    let post = |path: &str, extra: Value| -> Value {
        let mut b = serde_json::json!({"max_tokens": 2, "temperature": 0,
            "logit_bias": {open.to_string(): 100}});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (code, text) = http(&s.addr, "POST", path, Some(b.to_string().as_bytes()));
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    };
    let msgs = serde_json::json!([{"role": "user", "content": "Weather in Rome?"}]);
    let content = |v: &Value| v["choices"][0]["message"]["content"].clone();
    // parsed: the tags are text (two opening tags, no call in them); the reply ends at
    // max_tokens, so the second tag reads as a call cut off by the limit and is dropped
    let v = post(
        "/v1/chat/completions",
        serde_json::json!({"messages": msgs, "tools": tools}),
    );
    assert_eq!(content(&v), "<tool_call>", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    // streamed alike
    let (code, text) = http(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        Some(
            serde_json::json!({"messages": msgs, "tools": tools, "stream": true, "max_tokens": 2,
                "temperature": 0, "logit_bias": {open.to_string(): 100}})
            .to_string()
            .as_bytes(),
        ),
    );
    assert_eq!(code, 200);
    let streamed: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|e| {
            e.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
                .map(String::from)
        })
        .collect();
    assert_eq!(streamed, "<tool_call>", "{text}");
    // not parsed: special tokens are dropped, as every other
    for extra in [
        serde_json::json!({"messages": msgs}),
        serde_json::json!({"messages": msgs, "tools": tools, "tool_choice": "none"}),
    ] {
        let v = post("/v1/chat/completions", extra);
        assert_eq!(content(&v), "", "{v}");
    }
    let v = post("/v1/completions", serde_json::json!({"prompt": "Weather"}));
    assert_eq!(v["choices"][0]["text"], "", "{v}");
}

/// OpenAI's stored chat completions through the official client
/// (tests/py/serve_stored_chat_check.py): `store` and `metadata`, a streamed completion and a
/// streamed tool call kept as their chunks add up, `list` with its filters and pages, `update`,
/// `messages.list`, `delete`, refusals.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn stored_chat_completions_through_the_openai_client() {
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let template = gds_tests::fixture("templates/qwen2.5-instruct.jinja");
    let s = start(&["--chat-template-file", template.to_str().unwrap()]);
    let r = python(
        "serve_stored_chat_check.py",
        &[&format!("http://{}/v1", s.addr)],
    );
    eprintln!("{r}");
    assert_eq!(r["kept"], 3, "{r}");
}
