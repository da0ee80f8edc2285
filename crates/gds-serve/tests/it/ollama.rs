//! Ollama's API (`/api/*`) end to end: the official `ollama` Python client against SmolLM2
//! served with Qwen 2.5's template (tools) and Qwen 3's (thinking), compared with the OpenAI
//! endpoints of the same server (tests/py/serve_ollama_check.py); and `/api/generate`'s
//! `suffix` laid out for fill-in-the-middle.

use serde_json::{json, Value};

use crate::common::{http, python, serial, start, start_model};

fn template(name: &str) -> String {
    gds_tests::fixture(&format!("templates/{name}"))
        .display()
        .to_string()
}

/// Everything serve_ollama_check.py reports: the listings; generate and chat equal to the
/// OpenAI endpoints' answers for the same conversation (text, token counts, finish), whole
/// and streamed; `context`, `raw`, a prefill, `num_predict`, `stop`, `format`, `logprobs`;
/// a forced call read by the client's types and its round trip; thinking apart; embeddings
/// equal to `/v1/embeddings`'; loading, pulling and errors in Ollama's shape.
#[test]
#[ignore = "tier 2: needs the fetched models and the ollama package (scripts/test.sh)"]
fn ollama_api_through_the_ollama_client() {
    // no lock: much of its time is the Python client's start (see common::SERIAL)
    let tools = start(&["--chat-template-file", &template("qwen2.5-instruct.jinja")]);
    let thinking = start(&["--chat-template-file", &template("qwen3.jinja")]);
    let r = python(
        "serve_ollama_check.py",
        &[
            &format!("http://{}", tools.addr),
            &format!("http://{}", thinking.addr),
        ],
    );
    eprintln!("{r:#}");
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"));

    // the listings
    let l = &r["list"];
    let names = l["names"].as_array().unwrap();
    assert_eq!(names.len(), 1, "{l}");
    let name = names[0].as_str().unwrap();
    assert!(name.ends_with(":latest"), "{l}");
    assert!(n(&l["size"]) > 50 << 20, "{l}");
    let digest = l["digest"].as_str().unwrap();
    assert!(
        digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
        "{l}"
    );
    assert_eq!(
        (&l["family"], &l["quantization"]),
        (&json!("llama"), &json!("Q4_1")),
        "{l}"
    );
    assert!(l["parameter_size"].as_str().unwrap().ends_with('M'), "{l}");
    let s = &r["show"];
    assert_eq!(
        s["capabilities"],
        json!(["completion", "tools", "embedding"]),
        "{s}"
    );
    assert!(r["thinker_capabilities"]
        .as_array()
        .unwrap()
        .contains(&json!("thinking")));
    let info = &s["info"];
    assert_eq!(info["general.architecture"], "llama", "{s}");
    assert_eq!(info["llama.context_length"], 8192, "{s}");
    assert_eq!(info["llama.embedding_length"], 576, "{s}");
    assert_eq!(info["llama.block_count"], 30, "{s}");
    assert!(n(&info["general.parameter_count"]) > 100_000_000, "{s}");
    assert_eq!(s["template_has_tools"], true, "{s}");
    assert!(
        s["parameters"].as_str().unwrap().contains("num_ctx 1024"),
        "{s}"
    );
    assert_eq!(r["ps"]["names"], json!([name]), "{}", r["ps"]);
    assert_eq!(r["ps"]["context_length"], 1024, "{}", r["ps"]);
    assert!(r["version"]["version"].as_str().unwrap().starts_with("0."));
    assert_eq!(r["root"], "Ollama is running");

    // generate: the chat endpoint's answer to the same conversation
    let g = &r["generate"];
    assert!(!g["text"].as_str().unwrap().is_empty(), "{g}");
    assert_eq!(g["text"], g["chat_text"], "{g}");
    assert_eq!(g["done"], true, "{g}");
    let want = if g["chat_finish"] == "length" {
        "length"
    } else {
        "stop"
    };
    assert_eq!(g["done_reason"], want, "{g}");
    assert_eq!(g["eval_count"], g["chat_usage"]["completion_tokens"], "{g}");
    assert_eq!(
        g["prompt_eval_count"], g["chat_usage"]["prompt_tokens"],
        "{g}"
    );
    for d in g["durations"].as_array().unwrap() {
        assert!(n(d) > 0, "{g}");
    }
    assert!(g["created_at"].as_str().unwrap().ends_with('Z'), "{g}");
    // context: the prompt's tokens, then the reply's
    assert_eq!(g["context_reply"], g["text"], "{g}");
    assert!(n(&g["context_len"]) > n(&g["prompt_eval_count"]), "{g}");
    assert_eq!(g["streamed"], g["text"], "{g}");
    let flags = g["done_flags"].as_array().unwrap();
    assert!(n(&g["pieces"]) > 2, "{g}");
    assert_eq!(flags.last(), Some(&json!(true)), "{g}");
    assert!(flags[..flags.len() - 1].iter().all(|f| f == false), "{g}");
    let last = &g["last"];
    assert_eq!(last["response"], "", "{g}");
    assert_eq!(last["eval_count"], g["eval_count"], "{g}");
    assert_eq!(
        last["context"].as_array().unwrap().len() as u64,
        n(&g["context_len"]),
        "{g}"
    );
    let c = &r["context"];
    assert_eq!(c["starts_with_first"], true, "{c}");
    assert!(n(&c["prompt_eval_count"]) > n(&c["first_context"]), "{c}");
    assert!(!c["text"].as_str().unwrap().is_empty(), "{c}");
    // Docker Model Runner's base URLs: the OpenAI endpoints
    for base in ["/engines/v1", "/engines/llama.cpp/v1"] {
        let d = &r["dmr"][base];
        assert_eq!(d["models"].as_array().unwrap().len(), 1, "{base}: {d}");
        assert_eq!(d["text"], g["chat_text"], "{base}: {d}");
    }
    let raw = &r["raw"];
    assert_eq!(raw["text"], raw["completion_text"], "{raw}");
    assert_eq!(raw["prompt_eval_count"], raw["completion_prompt"], "{raw}");
    assert!(
        raw["context"].is_null(),
        "raw answers carry no context: {raw}"
    );

    // chat
    let ch = &r["chat"];
    assert!(!ch["text"].as_str().unwrap().is_empty(), "{ch}");
    assert_eq!(ch["text"], ch["chat_text"], "{ch}");
    assert_eq!(ch["role"], "assistant", "{ch}");
    assert_eq!(
        ch["eval_count"], ch["chat_usage"]["completion_tokens"],
        "{ch}"
    );
    assert_eq!(
        ch["prompt_eval_count"], ch["chat_usage"]["prompt_tokens"],
        "{ch}"
    );
    assert_eq!(ch["streamed"], ch["text"], "{ch}");
    assert_eq!(ch["roles"], json!(["assistant"]), "{ch}");
    let flags = ch["done_flags"].as_array().unwrap();
    assert_eq!(flags.iter().filter(|f| **f == true).count(), 1, "{ch}");
    let p = &r["prefill"];
    assert!(!p["text"].as_str().unwrap().is_empty(), "{p}");
    assert_eq!(p["text"], p["chat_text"], "{p}");

    // options, format, logprobs
    assert_eq!(
        r["limited"],
        json!({"done_reason": "length", "eval_count": 5})
    );
    let st = &r["stop"];
    assert!(
        st["word"].is_string(),
        "the story has a word to stop at: {r}"
    );
    assert_eq!(st["text"], st["expected"], "{st}");
    assert_eq!(st["done_reason"], "stop", "{st}");
    assert_eq!(r["format"]["valid"], true, "{}", r["format"]);
    let lp = &r["logprobs"];
    assert_eq!(lp["n"], lp["eval_count"], "{lp}");
    assert!(
        lp["tops"].as_array().unwrap().iter().all(|t| t == 2),
        "{lp}"
    );
    assert_eq!(lp["tokens"], lp["text"], "{lp}");
    assert_eq!(lp["greedy_first"], true, "{lp}");

    // tools: the forced call, whole and streamed, in Ollama's form
    let t = &r["tools"];
    assert_eq!(t["status"], 200, "{t}");
    // (parallel calls are allowed, and a 135M model may repeat the forced call until
    // num_predict: a call whose JSON is whole counts even where the limit cut its closing tag)
    let calls = t["calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{t}");
    for (i, (c, rc)) in calls
        .iter()
        .zip(t["raw_calls"].as_array().unwrap())
        .enumerate()
    {
        assert_eq!(c["name"], "get_weather", "{t}");
        assert!(c["arguments"]["city"].is_string(), "{t}");
        assert!(rc["id"].as_str().unwrap().starts_with("call_"), "{t}");
        assert_eq!(rc["function"]["index"], i, "{t}");
        assert!(
            rc["function"]["arguments"].is_object(),
            "arguments as an object: {t}"
        );
    }
    assert!(t["content_type"]
        .as_str()
        .unwrap()
        .starts_with("application/x-ndjson"));
    assert_eq!(t["streamed_calls"], json!([t["calls"]]), "{t}");
    let rt = &r["round_trip"];
    assert_eq!(rt["prompt_eval_count"], rt["chat_prompt_tokens"], "{rt}");
    assert_eq!(rt["text"], rt["chat_text"], "{rt}");

    // thinking apart, whole and streamed, on both endpoints
    let th = &r["thinking"];
    assert_eq!(th["status"], 200, "{th}");
    assert!(th["thinking"].as_str().unwrap().starts_with("I "), "{th}");
    assert!(
        th["content"].as_str().unwrap().starts_with("It is "),
        "{th}"
    );
    assert_eq!(th["streamed_thinking"], th["thinking"], "{th}");
    assert_eq!(th["streamed_content"], th["content"], "{th}");
    assert_eq!(th["generate_thinking"], th["thinking"], "{th}");
    assert_eq!(th["generate_response"], th["content"], "{th}");
    // `reasoning_format: none` (an extension): the reply whole, tags and all
    assert!(th["unsplit_thinking"].is_null(), "{th}");
    assert!(th["unsplit_content"]
        .as_str()
        .unwrap()
        .starts_with("<think>"));
    assert_eq!(th["not_thinking"]["status"], 400, "{th}");
    assert!(th["not_thinking"]["error"]
        .as_str()
        .unwrap()
        .contains("does not support thinking"));

    // embeddings
    let e = &r["embed"];
    assert_eq!(e["n"], 2, "{e}");
    assert_eq!(e["dims"], json!([576, 576]), "{e}");
    for v in e["norms"].as_array().unwrap() {
        assert!((v.as_f64().unwrap() - 1.0).abs() < 1e-4, "{e}");
    }
    assert!(e["max_diff_openai"].as_f64().unwrap() < 1e-5, "{e}");
    assert_eq!(e["prompt_eval_count"], e["openai_prompt_tokens"], "{e}");
    assert_eq!(e["dims8"], 8, "{e}");
    assert!((e["norm8"].as_f64().unwrap() - 1.0).abs() < 1e-4, "{e}");
    assert!(
        (e["legacy_norm"].as_f64().unwrap() - 1.0).abs() > 1e-2,
        "not normalized: {e}"
    );
    assert!(e["legacy_direction"].as_f64().unwrap() < 1e-4, "{e}");

    // loading, pulling, errors
    assert_eq!(
        r["load"],
        json!({"generate": "load", "unload": "unload", "chat": "load", "done": true})
    );
    assert_eq!(r["pull"], "success");
    let errors = r["errors"].as_object().unwrap();
    for (key, status) in [
        ("no_model", 400),
        ("image", 400),
        ("tfs_z", 400),
        ("template", 400),
        ("bad_json", 400),
        ("bad_role", 400),
        ("insert", 400),
        ("too_long", 400),
        ("unknown_path", 404),
        ("pull_other", 501),
        ("create", 501),
        ("delete", 501),
    ] {
        let e = &errors[key];
        assert_eq!(e["status"], status, "{key}: {e}");
        let body = e["body"].as_object().unwrap();
        assert_eq!(body.len(), 1, "{key}: Ollama's shape: {e}");
        assert!(!body["error"].as_str().unwrap().is_empty(), "{key}: {e}");
    }
    assert!(errors["tfs_z"]["body"]["error"]
        .as_str()
        .unwrap()
        .contains("tfs_z"));
    assert!(errors["insert"]["body"]["error"]
        .as_str()
        .unwrap()
        .contains("does not support insert"));
    assert_eq!(errors["client"]["status"], 400, "{}", errors["client"]);
}

/// `/api/generate` with a `suffix`, on SmolLM2 given fill-in-the-middle tokens: the prompt is
/// the prefix token, the prompt, the suffix token, the suffix and the middle token, so the
/// reply is `/v1/completions`' on those token ids (greedy); OpenAI's `suffix` on
/// `/v1/completions` lays it out the same (text prompts, token prompts, a batch of both).
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn ollama_suffix_fills_in_the_middle() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("fim.gds");
    gds_tests::copy_dir(gds_tests::smollm_converted(), &model);
    let path = model.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["fim_tokens"] =
        json!({"prefix": "<gh_stars>", "suffix": "<issue_start>", "middle": "<issue_comment>"});
    gds_tests::forge_file(&model, "tokenizer_config.json", cfg.to_string().as_bytes());
    let s = start_model(&model, &[]);
    let post = |path: &str, body: Value| -> Value {
        let (code, text) = http(&s.addr, "POST", path, Some(body.to_string().as_bytes()));
        assert_eq!(code, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap()
    };
    let ids = |text: &str| -> Vec<Value> {
        post("/tokenize", json!({"content": text}))["tokens"]
            .as_array()
            .unwrap()
            .clone()
    };
    let special = |text: &str| -> Value {
        let t =
            post("/tokenize", json!({"content": text, "parse_special": true}))["tokens"].clone();
        assert_eq!(t.as_array().unwrap().len(), 1, "{text} is one token: {t}");
        t[0].clone()
    };
    let (prefix, suffix) = ("def add(a, b):\n    ", "\n    return c\n");
    let mut layout = vec![special("<gh_stars>")];
    layout.extend(ids(prefix));
    layout.push(special("<issue_start>"));
    layout.extend(ids(suffix));
    layout.push(special("<issue_comment>"));
    let o = post(
        "/api/generate",
        json!({"model": "m", "prompt": prefix, "suffix": suffix, "stream": false,
               "options": {"temperature": 0, "num_predict": 12}}),
    );
    let c = post(
        "/v1/completions",
        json!({"prompt": layout, "temperature": 0, "max_tokens": 12}),
    );
    assert_eq!(o["prompt_eval_count"], json!(layout.len()), "{o}");
    assert_eq!(o["response"], c["choices"][0]["text"], "{o} vs {c}");
    assert_eq!(o["eval_count"], c["usage"]["completion_tokens"], "{o}");
    assert!(o.get("context").is_none(), "{o}");
    // OpenAI's suffix: the same layout, the same reply; a token-id prompt is the prefix's
    // tokens as given, a batch lays out each prompt
    let f = post(
        "/v1/completions",
        json!({"prompt": prefix, "suffix": suffix, "temperature": 0, "max_tokens": 12}),
    );
    assert_eq!(f["choices"][0]["text"], c["choices"][0]["text"], "{f}");
    assert_eq!(f["usage"]["prompt_tokens"], json!(layout.len()), "{f}");
    let other = "def mul(a, b):\n    ";
    let batch = post(
        "/v1/completions",
        json!({"prompt": [ids(prefix), other], "suffix": suffix, "temperature": 0,
               "max_tokens": 12}),
    );
    let mut other_layout = vec![special("<gh_stars>")];
    other_layout.extend(ids(other));
    other_layout.extend(
        layout[layout.len() - ids(suffix).len() - 2..]
            .iter()
            .cloned(),
    );
    let alone = post(
        "/v1/completions",
        json!({"prompt": other_layout, "temperature": 0, "max_tokens": 12}),
    );
    let texts: Vec<&Value> = batch["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["text"])
        .collect();
    assert_eq!(
        texts,
        [&c["choices"][0]["text"], &alone["choices"][0]["text"]],
        "{batch}"
    );
    // echo has no place in the layout; a suffix that is not text is refused
    for (body, param) in [
        (
            json!({"prompt": prefix, "suffix": suffix, "echo": true}),
            "echo",
        ),
        (json!({"prompt": prefix, "suffix": 5}), "suffix"),
    ] {
        let (code, text) = http(
            &s.addr,
            "POST",
            "/v1/completions",
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(code, 400, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}
