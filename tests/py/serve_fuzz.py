#!/usr/bin/env python3
"""Request-body fuzzing of a running `gdsrun serve` (or any OpenAI/Anthropic-compatible server).

Seeded and reproducible: starts from valid bodies of every POST endpoint (chat, completions,
responses, messages, count_tokens, tokenize, detokenize, ..., llama-server's slot actions:
with --slot-save-path their files are saved and restored while the rest runs) and sends
mutations of them: fields
deleted, set to hostile values (wrong types, huge and negative numbers, long or odd strings,
deep nesting), optional fields added with random values, message lists reshaped, and raw-byte
damage (truncated JSON, invalid UTF-8, duplicate keys). Several clients fuzz at once while a
sentinel client repeats one plain greedy request.

It fails (exit 1, listing each case with its body) when:
- any answer is a 5xx, or not JSON (a stream: not SSE of JSON events ending as its API ends
  a stream), or an error without the API's error shape (OpenAI: {"error": {"message",
  "type"}}; Anthropic: {"type": "error", "error": {"type", "message"}});
- a request takes longer than --request-timeout or the connection breaks;
- a sentinel request fails or its text differs from its first answer (one client's request
  must never fail or change another's);
- a batch the fuzzing started (OpenAI's or Anthropic's) does not end, or one of its requests
  is answered 5xx;
- the server is not alive and healthy at the end.

Prints one JSON summary (requests by status, by endpoint). Refuses non-loopback URLs.

With --batch-input FILE it writes N lines of a `gdsrun batch` job (OpenAI Batch API lines
around the same mutated bodies, the line's own fields damaged too: method, custom_id,
duplicate ids, body, raw bytes) instead, and sends nothing.
"""
import argparse
import http.client
import json
import random
import sys
import threading
import time
from urllib.parse import urlparse

ANTHROPIC = {"/v1/messages", "/v1/messages/count_tokens", "/v1/messages/batches"}
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
             "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize",
             "/completion", "/apply-template", "/v1/responses/input_tokens",
             "/v1/chat/completions/input_tokens", "/infill",
             "/api/chat", "/api/generate", "/api/embed", "/api/show", "/score", "/embedding",
             "/slots", "/v1/conversations", "/v1/files", "/v1/batches", "/v1/messages/batches"]
# files uploaded at the start (a clean batch input, a damaged one), for /v1/batches bodies
FILE_IDS = []
# a reranker's (--endpoints): a model without a head answers them 501 (/score answers any
# model: a reranker's pair scores, else the cosine of embeddings)
RERANK = ["/v1/rerank", "/rerank", "/v2/rerank", "/v1/score"]
SCORE = {"/score", "/v1/score"}
OLLAMA = {"/api/chat", "/api/generate", "/api/embed", "/api/show"}


def vllm_extras(b, rng):
    """vLLM's extra parameters, sensible and extreme (`extra_body` of vLLM's clients)."""
    r = rng.random()
    if r < 0.05:
        b["guided_choice"] = rng.choice([["yes", "no"], [], ["a" * 300] * 3, [1], "yes"])
    elif r < 0.08:
        b["structured_outputs"] = rng.choice([{"regex": "[a-z]{1,5}"}, {"json_object": True},
                                              {"choice": ["x"], "json": {}}, {"grammar": "root ::= ("},
                                              {"json": "{\"type\": \"object\"}"}, []])
    elif r < 0.11:
        b["min_tokens"] = rng.choice([0, 4, 10 ** 9, -3, "x"])
        b["stop_token_ids"] = rng.choice([[2], [], [10 ** 10], list(range(300)), None])
    elif r < 0.13:
        b["repetition_penalty"] = rng.choice([1.1, 0.0, -1, 1e30, None])
    elif r < 0.16:
        b["allowed_token_ids"] = rng.choice([[2], [], [10 ** 10], list(range(3000)), [0, 0, 0],
                                             "1", None])
        b["bad_words"] = rng.choice([["a"], [""], [" "], ["x" * 5000], [5], "word",
                                     ["word"] * 500, None])
    elif r < 0.19:
        b["prompt_logprobs"] = rng.choice([0, 5, 20, 21, -1, 1.5, "2", None])
        b["include_stop_str_in_output"] = rng.choice([True, False, 1, None])
        b["skip_special_tokens"] = rng.choice([True, False, "no", None])
        b["stop"] = rng.choice([["."], [" "], None])
    elif r < 0.23:
        b["return_token_ids"] = rng.choice([True, False, "yes", None])
        b["return_tokens_as_token_ids"] = rng.choice([True, None, 3])
        b["logprobs"] = rng.choice([True, 2, None])
        b["stream"] = rng.choice([True, False])
        b["stream_options"] = rng.choice([{"include_usage": True, "continuous_usage_stats": True},
                                          {"continuous_usage_stats": "x"}, None])
    elif r < 0.26:
        b["cache_salt"] = rng.choice(["a", "", "x" * 2000, 5, None, "\u00e9\ud83e\udd17"])
        b["request_id"] = rng.choice(["r1", "", "a\nb", "x" * 300, 7, None])
        b["priority"] = rng.choice([0, 1, -5, "high", None])
    elif r < 0.29:
        b["truncate_prompt_tokens"] = rng.choice([1, 3, -1, 0, -7, 10 ** 12, "2", None])
        b["truncation_side"] = rng.choice(["left", "right", "up", None])
        b["add_special_tokens"] = rng.choice([True, False, "no", None])
    elif r < 0.33:
        # beam search (a few steps of n one-token requests; what it would not honour refused)
        b["use_beam_search"] = rng.choice([True, True, False, "yes", 1, None])
        b["n"] = rng.choice([1, 2, 4, 16, 17, 0, None])
        b["length_penalty"] = rng.choice([1.0, 0.0, -2.5, 10, 11, 1e308, "x", None])
        if rng.random() < 0.5:
            b["ignore_eos"] = rng.choice([True, False])
            b["logprobs"] = rng.choice([True, 3, 20, None])
            b["stream"] = rng.choice([True, False])
    return b


def base_body(path, rng):
    return vllm_extras(plain_body(path, rng), rng) if path in (
        "/v1/chat/completions", "/v1/completions") else plain_body(path, rng)


def plain_body(path, rng):
    words = rng.choice(["Hi", "What is 2+2?", "Name a colour.", "Tell me about the sea."])
    if path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
        b = {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": words}],
             "max_tokens": 8, "temperature": 0}
        if rng.random() < 0.05:
            # a request's own template (the test's server trusts them): built-in names, Jinja,
            # broken and hostile ones (unbounded loops, growth, recursion: bounded, a 400)
            b["chat_template"] = rng.choice([
                "chatml", "llama3", "nope", 5, None, "{% for m in messages %}",
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                "{% for i in range(1000000000) %}x{% endfor %}",
                "{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                "{{ raise_exception('no') }}"])
        if rng.random() < 0.1:
            # stored completions (kept, streamed or not; metadata over its limits refused)
            b["store"] = rng.choice([True, True, False, "yes", None])
            b["metadata"] = rng.choice([{"k": "v"}, {}, {"k": 5}, {str(i): "v" for i in range(17)},
                                        "x", None])
            b["stream"] = rng.choice([True, False])
        if rng.random() < 0.2:
            # OpenAI's predicted outputs
            b["prediction"] = {"type": "content", "content": rng.choice(
                [words, "The answer is four.", [{"type": "text", "text": words}], ""])}
        return b
    if path == "/v1/completions":
        b = {"prompt": words, "max_tokens": 8, "temperature": 0}
        if rng.random() < 0.1:
            # fill in the middle (a model without the tokens: a 400)
            b["suffix"] = rng.choice([words, "", None, 5, [words]])
        if rng.random() < 0.1:
            # OpenAI's best_of (with n, stream and echo: some refused)
            b["best_of"] = rng.choice([1, 3, 16, 17, 0, -1, "2", None, 2.5])
            b["n"] = rng.choice([1, 2, 4, None])
            b["temperature"] = rng.choice([0, 1.0])
        return b
    if path in ("/v1/responses", "/v1/responses/input_tokens"):
        b = {"input": words, "max_output_tokens": 8, "temperature": 0}
        if rng.random() < 0.2:
            # run in the background (answered queued; streamed, followed as it runs)
            b["background"] = rng.choice([True, True, False, None, "yes"])
        if rng.random() < 0.1:
            # a conversation (none kept by that id: a 400), or a malformed one
            b["conversation"] = rng.choice(["conv_0", {"id": "conv_0"}, {"id": 5}, 7, None])
        if rng.random() < 0.2:
            b["include"] = rng.choice([["message.output_text.logprobs"], [], "all", [7]])
            b["top_logprobs"] = rng.choice([0, 3, 20, 21, -1, 2.5, None])
        return b
    if path == "/v1/batches":
        # OpenAI's Batch API: the uploaded inputs (clean and damaged) and ids that are not
        return {"input_file_id": rng.choice(FILE_IDS + ["file-nope"]),
                "endpoint": rng.choice(["/v1/chat/completions"] * 3 + ["/v1/completions", "/v1/moderations"]),
                "completion_window": "24h", "metadata": {"fuzz": "1"}}
    if path == "/v1/messages/batches":
        return {"requests": [{"custom_id": f"q{i}", "params": plain_body("/v1/messages", rng)}
                             for i in range(rng.randint(1, 3))]}
    if path == "/v1/files":
        # (sent as a multipart form: see multipart())
        return {"purpose": rng.choice(["batch", "batch", "vision", "nope", ""]),
                "filename": rng.choice(["in.jsonl", "", "a\u0000b", "x" * 300]),
                "content": rng.choice(["", "{}\n", "x" * 5000])}
    if path == "/v1/conversations":
        return {"items": [{"role": "user", "content": words},
                          {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": words}]}],
                "metadata": {"k": words[:64]}}
    if path == "/v1/messages":
        return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": words}]}
    if path == "/v1/messages/count_tokens":
        return {"model": "m", "messages": [{"role": "user", "content": words}]}
    if path == "/v1/embeddings":
        return {"input": rng.choice([words, [words, "second"], [1, 2, 3]])}
    if path == "/embedding":
        return {"content": rng.choice([words, [words, "second"], [1, 2, words]])}
    if path == "/tokenize":
        return {"content": words}
    if path == "/detokenize":
        return {"tokens": [1, 2, 3]}
    if path == "/completion":
        prompt = rng.choice([words, [words, "Then"], [1, 2, words, 3], {"prompt_string": words}])
        return {"prompt": prompt, "n_predict": 8, "temperature": 0}
    if path == "/infill":
        return {"input_prefix": rng.choice(["def f(x):\n", ["int ", 5, "x"], ""]),
                "input_suffix": rng.choice(["\n    return y\n", "}", ""]),
                "prompt": rng.choice(["    y = ", "", "<|im_end|>"]),
                "input_extra": rng.choice([[], [{"filename": "a.py", "text": "import os\n"}],
                                           [{"text": words}] * 3]),
                "n_predict": 8, "temperature": 0}
    if path == "/api/chat":
        return {"model": "m", "messages": [{"role": "user", "content": words}],
                "stream": rng.random() < 0.5, "options": {"num_predict": 8, "temperature": 0}}
    if path == "/api/generate":
        return {"model": "m", "prompt": words, "stream": rng.random() < 0.5,
                "options": {"num_predict": 8, "temperature": 0}}
    if path == "/api/embed":
        return {"model": "m", "input": rng.choice([words, [words, "second"]])}
    if path == "/api/show":
        return {"model": "m"}
    if path in SCORE:
        one, two = rng.choice([("text_1", "text_2"), ("queries", "documents"),
                               ("queries", "items"), ("data_1", "data_2")])
        return {one: rng.choice([words, [words], [words, "Paris"]]),
                two: rng.choice([["Paris is in France.", words], words, [words, "b"]]),
                rng.choice(["truncate_prompt_tokens", "use_activation", "model"]):
                    rng.choice([4, -1, False, "m"])}
    if path in RERANK:
        docs = rng.choice([["Paris is in France.", words], [words] * 3,
                           [{"text": words}, "second"]])
        key = "texts" if path == "/rerank" and rng.random() < 0.3 else "documents"
        return {"query": words, key: docs, "top_n": rng.choice([1, 2, 5])}
    if path == "/slots":
        # llama-server's slot actions (the id and action go in the URL, see slot_path)
        return {"filename": rng.choice(["a.bin", "b.bin", "a.bin", "../a.bin", "", ".a", "a/b",
                                        "x" * 300, "missing.bin"])}
    if path == "/apply-template":
        return {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": words}]}
    raise ValueError(path)


# Fields the endpoints know (OpenAI, Anthropic, llama-server extensions gdsrun takes)
OPTIONAL = ["model", "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature",
            "top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty",
            "logit_bias", "stop", "stop_sequences", "seed", "stream", "stream_options", "n",
            "encoding_format", "dimensions", "embd_normalize",
            "ignore_eos", "draft", "draft_max", "logprobs", "top_logprobs", "echo",
            "response_format", "json_schema", "grammar", "regex", "tools", "tool_choice",
            "parallel_tool_calls", "continue_final_message", "parse_special", "suffix", "user",
            "system", "metadata", "thinking", "instructions", "text", "previous_response_id",
            "add_special", "with_pieces", "tokens", "content", "prompt", "messages", "input",
            "reasoning", "store", "truncation", "best_of", "chat_template_kwargs", "prediction",
            # llama-server's /completion
            "n_predict", "n_probs", "n_cmpl", "return_tokens", "response_fields", "samplers",
            "post_sampling_probs", "mirostat", "typical_p", "repeat_last_n", "cache_prompt",
            "id_slot", "n_keep", "lora", "dry_multiplier", "xtc_probability", "t_max_predict_ms",
            "xtc_threshold", "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "mirostat_tau",
            "mirostat_eta", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
            "dry_sequence_breakers", "adaptive_target", "adaptive_decay", "min_keep",
            "add_generation_prompt", "timings_per_token", "reasoning_format", "reasoning_effort",
            # llama-server's /infill
            "input_prefix", "input_suffix", "input_extra",
            # rerankers'
            "query", "documents", "texts", "top_n", "return_documents", "return_text",
            "return_progress", "truncate_prompt_tokens", "truncation_side", "use_activation",
            # vLLM's /score
            "text_1", "text_2", "queries", "items", "data_1", "data_2",
            # Ollama's
            "options", "format", "think", "raw", "context", "keep_alive", "images", "template",
            "truncate", "tool_name", "tool_calls"]


def deep(n, leaf):
    v = leaf
    for _ in range(n):
        v = [v]
    return v


def hostile(rng, depth=0):
    """A value of any JSON type, chosen to break parsers, bounds and assumptions."""
    pool = [
        None, True, False, 0, -1, 1, 2, 7, 2**31, 2**32 + 1, 2**53 + 1, 2**63, -(2**63), 10**30,
        -(10**30), 0.5, -0.0, 1e-300, 1e308, -1e308, 3.7, 255, 100000, 49152,
        "", " ", "x", "0", "-1", "1e9", "null", "true", "auto", "none", "required", "user",
        "assistant", "system", "tool", "function", "json_object", "json_schema", "text",
        "\u0000", "\ud800", "\ufeff", "\u202e", "\ud7ff\ue000", "😀" * 50, "a" * 5000, "<|im_start|>",
        "<|endoftext|>", "{{ raise }}", "{% for x in y %}", "[\"a\"]", "{\"type\": \"object\"}",
        "root ::= \"a\"", "root ::= root", "(a|aa)*b", "[", "\\", "%s%n",
        [], {}, [None], [[]], [{}], [1, 2, 3], [-1], [2**40], ["a", "b"], ["x"] * 300,
        {"type": "object"}, {"type": "json_schema"}, {"type": "json_object", "schema": []},
        {"type": "function", "function": {"name": "f"}}, {"role": "user"}, {"": ""},
        {"include_usage": True}, {"1": 100}, {"-5": 1e9}, {"999999999": -100},
        deep(200, 1), deep(60, {"a": 1}),
    ]
    v = rng.choice(pool)
    if depth < 2 and rng.random() < 0.15:
        if rng.random() < 0.5:
            return [hostile(rng, depth + 1) for _ in range(rng.randint(1, 4))]
        return {rng.choice(OPTIONAL + ["type", "role", "content", "name", "text"]):
                hostile(rng, depth + 1) for _ in range(rng.randint(1, 3))}
    return v


def content_part(rng):
    kinds = [
        {"type": "text", "text": "hello"},
        {"type": "text"},
        {"type": "text", "text": hostile(rng)},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
        {"type": "tool_use", "id": "t1", "name": "f", "input": hostile(rng)},
        {"type": "tool_result", "tool_use_id": "t1", "content": hostile(rng)},
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "input_text", "text": "hi"},
        {"type": hostile(rng)},
        hostile(rng),
    ]
    return rng.choice(kinds)


def message(rng):
    m = {"role": rng.choice(["user", "assistant", "system", "tool", "developer", "function",
                             "", "USER", hostile(rng)])}
    r = rng.random()
    if r < 0.4:
        m["content"] = rng.choice(["hi", "", "ok " * 200, hostile(rng)])
    elif r < 0.8:
        m["content"] = [content_part(rng) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.2:
        m["tool_calls"] = rng.choice([
            [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}],
            [{"type": "function"}], hostile(rng)])
    if rng.random() < 0.1:
        m["tool_call_id"] = hostile(rng)
    if rng.random() < 0.1:
        m["reasoning_content"] = rng.choice(["I think.", "", "<think>x</think>", hostile(rng)])
    if rng.random() < 0.05 and isinstance(m.get("content"), list):
        # Anthropic thinking blocks, Responses reasoning items
        m["content"].append(rng.choice([
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "thinking", "thinking": hostile(rng)}, {"type": "redacted_thinking", "data": "x"}]))
    if rng.random() < 0.1:
        m[rng.choice(["name", "refusal", "extra"])] = hostile(rng)
    return m


SENSIBLE = [
    ("stream", True), ("stream", True), ("n", 3), ("n", 2), ("logprobs", True), ("logprobs", 3),
    ("top_logprobs", 5), ("echo", True), ("seed", 42), ("temperature", 1.5), ("top_k", 1),
    ("top_p", 0.01), ("min_p", 0.9), ("repeat_penalty", 1.3), ("presence_penalty", 2.0),
    ("stop", ["\n", "."]), ("stop", "e"), ("max_tokens", 1), ("max_tokens", 0), ("max_tokens", 40),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]),
    ("tools", [{"name": "f", "input_schema": {"type": "object"}}]),
    ("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("tool_choice", {"type": "any"}), ("grammar", 'root ::= "yes" | "no"'),
    ("regex", "[0-9]{1,3}"), ("logit_bias", {"15": -100}), ("logit_bias", {"0": 100}),
    ("ignore_eos", True), ("draft", "ngram"), ("draft_max", 4),
    ("stream_options", {"include_usage": True}),
    ("thinking", {"type": "enabled", "budget_tokens": 1024}), ("stop_sequences", ["x"]),
    ("system", [{"type": "text", "text": "s"}]), ("continue_final_message", True),
    ("parse_special", True), ("suffix", " end"), ("instructions", "Answer in French."),
    ("with_pieces", True), ("add_special", True), ("parallel_tool_calls", False),
    ("encoding_format", "base64"), ("dimensions", 8), ("embd_normalize", 1),
    ("input", ["a", "b", "c"]), ("input", [[1, 2], [3, 4, 5]]),
    ("n_probs", 3), ("n_cmpl", 2), ("return_tokens", True), ("response_fields", ["content", "a/b"]),
    ("samplers", ["top_k", "temperature"]), ("samplers", "kt"), ("repeat_last_n", -1),
    # llama.vim's and llama.vscode's: the infill stage (over a whole vocabulary without
    # top-k too), line limits
    ("samplers", ["top_k", "top_p", "infill"]), ("samplers", ["infill", "temperature"]),
    ("samplers", "ikt"), ("n_indent", 4), ("n_indent", -3), ("n_indent", 10 ** 12),
    ("t_max_predict_ms", 1), ("t_max_predict_ms", -1), ("t_max_prompt_ms", 500),
    # llama.cpp's samplers, sensible and extreme (each a setting the server must survive)
    ("mirostat", 2), ("mirostat", 1), ("mirostat_tau", 0.01), ("mirostat_eta", 1e30),
    ("typical_p", 0.3), ("typical_p", -5), ("top_n_sigma", 0.5), ("top_n_sigma", 1e30),
    ("xtc_probability", 1.0), ("xtc_threshold", 0.0), ("dynatemp_range", 3.0),
    ("dynatemp_exponent", -4.0), ("dry_multiplier", 0.8), ("dry_multiplier", -1e30),
    ("dry_base", 1e30), ("dry_allowed_length", 0), ("dry_penalty_last_n", -1),
    ("dry_penalty_last_n", 2147483647), ("dry_sequence_breakers", ["\n", "<|im_end|>", "x" * 500]),
    ("dry_sequence_breakers", ["\u00e9", "\ud83e\udd17", " the"]), ("min_keep", 1000000),
    ("samplers", ["adaptive_p", "dry", "xtc", "typ_p", "top_n_sigma"]), ("adaptive_target", 0.2),
    ("adaptive_decay", 0.99), ("samplers", "edskypmxta"),
    ("options", {"num_predict": 6, "mirostat": 2, "mirostat_tau": 1.0, "typical_p": 0.5}),
    ("logit_bias", [[" the", False], [15, -1]]), ("prompt", {"prompt_string": "x"}),
    ("prompt", [1, "x", 2]), ("n_predict", 0), ("n_predict", -1), ("cache_prompt", False),
    ("chat_template_kwargs", {"enable_thinking": False}), ("chat_template_kwargs", {"x": "<|im_end|>"}),
    ("options", {"num_predict": 8, "stop": ["."], "seed": 3, "num_ctx": 99999}),
    ("options", {"num_predict": 4, "repeat_last_n": -1, "top_k": 2.5}), ("format", "json"),
    ("format", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    ("think", True), ("think", "high"), ("raw", True), ("context", [1, 2, 3]), ("keep_alive", 0),
    ("images", ["aGk="]), ("suffix", "return 1"), ("truncate", False),
    ("messages", [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": "y"}}}]},
        {"role": "tool", "tool_name": "f", "content": "42"}]),
    ("add_generation_prompt", False),
    ("reasoning_format", "none"), ("reasoning_format", "deepseek"), ("reasoning_format", "x"),
    ("reasoning_effort", "none"), ("reasoning_effort", "high"), ("thinking", {"type": "disabled"}),
    ("reasoning", {"effort": "low"}),
    ("grammar", 'root ::= "<think>\\n" [a-z ]{0,9} "\\n</think>\\n\\n" [a-z]{1,5}'),
    ("input", [{"role": "user", "content": "a"}, {"type": "reasoning", "id": "rs_1", "summary": [],
        "content": [{"type": "reasoning_text", "text": "t"}]}, {"role": "assistant", "content": "b"}]),
    ("prompt", ["a", "b"]), ("prompt", [1, 2, 3]), ("prompt", [[1, 2], [3]]),
    ("messages", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]),
    ("messages", [{"role": "user", "content": "call f"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]),
]


def mutate(body, rng):
    b = json.loads(json.dumps(body))
    if rng.random() < 0.4:
        for _ in range(rng.randint(1, 4)):
            k, v = rng.choice(SENSIBLE)
            b[k] = json.loads(json.dumps(v))
        # streaming has its own paths: often, and then often with the usage chunk
        if rng.random() < 0.4:
            b["stream"] = True
            if rng.random() < 0.5:
                b["stream_options"] = {"include_usage": True}
        return b
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        keys = list(b.keys())
        if op < 0.2 and keys:
            del b[rng.choice(keys)]
        elif op < 0.5 and keys:
            b[rng.choice(keys)] = hostile(rng)
        elif op < 0.75:
            b[rng.choice(OPTIONAL)] = hostile(rng)
        elif op < 0.9:
            key = "messages" if "messages" in b or rng.random() < 0.5 else "input"
            b[key] = [message(rng) for _ in range(rng.randint(0, 5))]
        else:
            # small, sensible values of the sampling and structure fields, in odd combinations
            k, v = rng.choice([
                ("stream", True), ("n", 3), ("logprobs", True), ("top_logprobs", 5),
                ("echo", True), ("seed", 42), ("temperature", 1.5), ("stop", ["\n", "."]),
                ("response_format", {"type": "json_object"}),
                ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                 "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"]}}}),
                ("tools", [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"x": {"type": "string"}}}}}]),
                ("tool_choice", "required"), ("grammar", 'root ::= "yes" | "no"'),
                ("regex", "[0-9]{1,3}"), ("logit_bias", {"15": -100}), ("ignore_eos", True),
                ("draft", "ngram"), ("stream_options", {"include_usage": True}),
                ("thinking", {"type": "enabled", "budget_tokens": 1024}),
                ("stop_sequences", ["x"]), ("system", [{"type": "text", "text": "s"}]),
            ])
            b[k] = v
    # keep the generation short unless the fuzz asked for something odd
    if "n_predict" not in b and rng.random() < 0.9:
        b["n_predict"] = 16  # /completion's default is the whole context
    for k in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        if isinstance(b.get(k), int) and b[k] > 32 and rng.random() < 0.9:
            b[k] = 16
    return b


def raw_damage(data, rng):
    r = rng.random()
    if r < 0.25:
        return data[: rng.randint(0, max(0, len(data) - 1))]
    if r < 0.45:
        i = rng.randint(0, len(data))
        return data[:i] + bytes([rng.choice([0x80, 0xc3, 0xff, 0xed, 0xa0])]) + data[i:]
    if r < 0.6:
        return data[:-1] + b', "max_tokens": 1, "max_tokens": "x"}'
    if r < 0.7:
        return b"[" * 100000 + b"]" * 100000
    if r < 0.8:
        return b'{"messages": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    if r < 0.9:
        return data.decode("utf-8").encode("utf-16")
    return b"\xef\xbb\xbf" + data


class Failure(Exception):
    pass


def request(host, port, path, data, timeout, api_key=None, content_type="application/json",
            hang_up=False):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": content_type}
        if path in ANTHROPIC:
            headers["anthropic-version"] = "2023-06-01"
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        c.request("POST", path, body=data, headers=headers)
        r = c.getresponse()
        if hang_up:
            r.read(64)  # a client that reads a little and goes away
            return r.status, "", b"{}" if r.status < 400 else b""
        return r.status, r.getheader("content-type") or "", r.read()
    finally:
        c.close()


def multipart(fields, rng):
    """A multipart/form-data body of `fields` (an upload's: `file` from `content`, the rest as
    text fields, mutated values as their JSON text): (content type, bytes)."""
    boundary = "fuzz%016x" % rng.getrandbits(64)
    out = b""
    for k, v in fields.items():
        text = v if isinstance(v, str) else json.dumps(v)
        if k == "content":
            name = fields.get("filename")
            name = name if isinstance(name, str) else "f"
            out += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                    f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n').encode()
        elif k == "filename":
            continue
        else:
            out += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'.encode()
        out += text.encode("utf-8", "replace") + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}", out


def upload(host, port, data, api_key):
    """Uploads `data` as a batch input file: its id."""
    ctype, body = multipart({"purpose": "batch", "filename": "in.jsonl",
                             "content": data.decode("utf-8", "replace")}, random.Random(0))
    status, _, raw = request(host, port, "/v1/files", body, 60, api_key, ctype)
    if status != 200:
        raise Failure(f"uploading a batch input: HTTP {status}: {raw[:300]!r}")
    return json.loads(raw)["id"]


def get(host, port, path, api_key):
    c = http.client.HTTPConnection(host, port, timeout=60)
    try:
        c.request("GET", path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def check_batches(host, port, api_key, record, timeout=300):
    """Waits for the batches the fuzzing made to end; fails where one did not, where a
    request of one was answered 5xx, or an Anthropic batch's request errored as the server's
    fault (`api_error`). The number of result lines read."""
    t0 = time.time()
    n = 0
    while True:
        _, raw = get(host, port, "/v1/batches?limit=100", api_key)
        openai_batches = json.loads(raw)["data"]
        _, raw = get(host, port, "/v1/messages/batches?limit=1000", api_key)
        msg_batches = json.loads(raw)["data"]
        running = ([b["id"] for b in openai_batches
                    if b["status"] not in ("completed", "failed", "cancelled")]
                   + [b["id"] for b in msg_batches if b["processing_status"] != "ended"])
        if not running:
            break
        if time.time() - t0 > timeout:
            record({"path": "batches"}, f"still running after {timeout} s: {running}")
            return n
        time.sleep(0.5)
    for b in openai_batches:
        errors = (b.get("errors") or {}).get("data") or []
        if any(e.get("code") == "server_error" for e in errors):
            record({"path": "/v1/batches", "batch": b["id"]}, f"failed: {errors}")
        for fid in (b.get("output_file_id"), b.get("error_file_id")):
            if not fid:
                continue
            status, raw = get(host, port, f"/v1/files/{fid}/content", api_key)
            for line in raw.decode("utf-8", "replace").splitlines():
                n += 1
                r = json.loads(line)
                code = (r.get("response") or {}).get("status_code", 0)
                if code >= 500:
                    record({"path": "/v1/batches", "batch": b["id"], "line": line[:2000]},
                           f"a batch request answered {code}")
    for b in msg_batches:
        status, raw = get(host, port, f"/v1/messages/batches/{b['id']}/results", api_key)
        for line in raw.decode("utf-8", "replace").splitlines():
            n += 1
            r = json.loads(line)["result"]
            if r["type"] == "errored" and r["error"]["error"]["type"] == "api_error":
                record({"path": "/v1/messages/batches", "batch": b["id"], "line": line[:2000]},
                       "a batch request failed as the server's fault")
    return n


def check_error_shape(path, v):
    if path in OLLAMA:
        ok = isinstance(v, dict) and isinstance(v.get("error"), str)
    elif path in ANTHROPIC:
        ok = (isinstance(v, dict) and v.get("type") == "error" and isinstance(v.get("error"), dict)
              and isinstance(v["error"].get("type"), str)
              and isinstance(v["error"].get("message"), str))
    else:
        ok = (isinstance(v, dict) and isinstance(v.get("error"), dict)
              and isinstance(v["error"].get("message"), str)
              and isinstance(v["error"].get("type"), str))
    if not ok:
        raise Failure(f"error body without the API's error shape: {json.dumps(v)[:300]}")


def slot_path(rng):
    """A `/slots/{id}?action=...` URL: ids in and out of range, actions known and not."""
    sid = rng.choice([0, 0, 1, 3, 7, 0, 1, -1, 8, "x", 10 ** 20])
    action = rng.choice(["save", "restore", "erase", "save", "restore", "save", "restore",
                         "load", ""])
    return f"/slots/{sid}?action={action}"


def check_answer(path, status, ctype, raw):
    if path in ["/infill", "/slots"] + RERANK and status == 501 and b"not_supported_error" in raw:
        return  # a model without fill-in-the-middle tokens or a rerank head, as llama-server answers
    if status >= 500:
        raise Failure(f"HTTP {status}: {raw[:300]!r}")
    if "application/x-ndjson" in ctype:
        # Ollama's stream: JSON lines, the last done (or an error line)
        if status != 200:
            raise Failure(f"a stream with HTTP {status}")
        objs = [json.loads(l) for l in raw.decode("utf-8").splitlines() if l.strip()]
        if not objs:
            raise Failure("an empty stream")
        last = objs[-1]
        if not (isinstance(last, dict) and (last.get("done") is True or isinstance(last.get("error"), str))):
            raise Failure(f"an Ollama stream ending with {str(last)[:200]}")
        if any(o.get("done") is True for o in objs[:-1]):
            raise Failure("an Ollama stream with done before its end")
        return
    if "text/event-stream" in ctype:
        if status != 200:
            raise Failure(f"a stream with HTTP {status}")
        events = []
        for line in raw.decode("utf-8").splitlines():
            if line.startswith("data: "):
                d = line[6:]
                if d == "[DONE]":
                    events.append("[DONE]")
                    continue
                events.append(json.loads(d))
        if not events:
            raise Failure("an empty stream")
        last = events[-1]
        if path in ANTHROPIC:
            if not (isinstance(last, dict) and last.get("type") in ("message_stop", "error")):
                raise Failure(f"an Anthropic stream ending with {str(last)[:200]}")
        elif path in ("/completion", "/infill"):
            # llama-server's native stream: no [DONE]; the last event has stop: true
            if "[DONE]" in events:
                raise Failure("a /completion stream with [DONE]")
            if not (isinstance(last, dict) and (last.get("stop") is True or "error" in last)):
                raise Failure(f"a /completion stream ending with {str(last)[:200]}")
        elif path == "/v1/responses":
            if not (isinstance(last, dict) and last.get("type") in
                    ("response.completed", "response.incomplete", "response.failed", "error")):
                raise Failure(f"a Responses stream ending with {str(last)[:200]}")
        elif last != "[DONE]":
            raise Failure(f"an OpenAI stream ending with {str(last)[:200]}, not [DONE]")
        for e in events:
            if isinstance(e, dict) and "error" in e and e.get("type") != "error":
                check_error_shape("/v1/chat/completions", e)
        return
    try:
        v = json.loads(raw)
    except Exception:
        raise Failure(f"HTTP {status}, a body that is not JSON: {raw[:300]!r}")
    if status >= 400:
        check_error_shape(path, v)


def batch_lines(n, rng):
    """`n` lines of a batch job: mostly valid Batch API lines around mutated bodies."""
    lines = []
    for i in range(n):
        path = rng.choice(["/v1/chat/completions", "/v1/completions"] * 2
                          + ["/v1/responses", "/v1/embeddings", "/v1/score", "/v1/moderations"])
        body = mutate(base_body("/v1/completions" if path == "/v1/moderations" else path, rng), rng)
        line = {"custom_id": f"r{i}", "method": "POST", "url": path, "body": body}
        r = rng.random()
        if r < 0.05:
            line["method"] = rng.choice(["GET", 1, None])
        elif r < 0.08:
            del line["custom_id"]
        elif r < 0.11:
            line["custom_id"] = hostile(rng)
        elif r < 0.13:
            line["custom_id"] = "r0"
        elif r < 0.16:
            line["body"] = hostile(rng)
        data = json.dumps(line).encode()
        if rng.random() < 0.08:
            data = raw_damage(data, rng).replace(b"\n", b" ")
        lines.append(data)
    return b"\n".join(lines) + b"\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url")
    ap.add_argument("--batch-input", help="write a batch job's lines to this file instead")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300, help="fuzzed requests in all")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=60)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--endpoints", help="comma-separated paths to fuzz (default: every POST "
                    "endpoint but the reranker's; `rerank`: those)")
    a = ap.parse_args()
    endpoints = ENDPOINTS
    if a.endpoints == "rerank":
        endpoints = RERANK
    elif a.endpoints:
        endpoints = a.endpoints.split(",")
        unknown = [p for p in endpoints if p not in ENDPOINTS + RERANK]
        if unknown:
            sys.exit(f"unknown endpoints {unknown}")
    if a.batch_input:
        with open(a.batch_input, "wb") as f:
            f.write(batch_lines(a.requests, random.Random(a.seed)))
        return
    if not a.url:
        sys.exit("give --url (or --batch-input)")
    u = urlparse(a.url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("refusing a non-loopback URL")
    host, port = u.hostname, u.port or 80

    failures, lock = [], threading.Lock()
    counts, by_path = {}, {}
    done = threading.Event()
    if "/v1/batches" in endpoints:
        rng = random.Random(a.seed)
        clean = b"\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                        "url": "/v1/chat/completions",
                                        "body": plain_body("/v1/chat/completions", rng)}).encode()
                           for i in range(4))
        FILE_IDS.extend([upload(host, port, clean, a.api_key),
                         upload(host, port, batch_lines(20, rng), a.api_key)])

    def record(case, err):
        with lock:
            failures.append({"case": case, "error": str(err)})

    def client(ci):
        rng = random.Random(a.seed * 1000 + ci)
        i = ci
        while i < a.requests:
            path = endpoints[rng.randrange(len(endpoints))]
            # (a slot action's body is one field: mutated less, so that files are written)
            # (and a batch's, so that batches run beside the rest)
            damage = 0.5 if path in ("/slots", "/v1/batches", "/v1/messages/batches", "/v1/files") else 0.95
            body = mutate(base_body(path, rng), rng) if rng.random() < damage else base_body(path, rng)
            if path in OLLAMA and isinstance(body.get("options"), dict) and rng.random() < 0.9:
                body["options"].setdefault("num_predict", 16)
            data = json.dumps(body).encode()
            url = slot_path(rng) if path == "/slots" else path
            ctype = "application/json"
            if path == "/v1/files" and isinstance(body, dict):
                ctype, data = multipart(body, rng)
            if rng.random() < 0.12:
                data = raw_damage(data, rng)
            if rng.random() < 0.03:
                ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
            hang_up = rng.random() < 0.05
            case = {"path": url, "body": data[:2000].decode("utf-8", "replace"),
                    "content_type": ctype, "index": i, "hang_up": hang_up}
            t0 = time.time()
            try:
                status, rtype, raw = request(host, port, url, data, a.request_timeout,
                                             a.api_key, ctype, hang_up)
                if hang_up:
                    # (a hang-up reads the status line only: /infill's 501 on a model without
                    # fill-in-the-middle tokens is an answer, as check_answer says)
                    if status >= 500 and not (path in ["/infill", "/slots"] + RERANK
                                              and status == 501):
                        raise Failure(f"HTTP {status}")
                else:
                    check_answer(path, status, rtype, raw)
                with lock:
                    counts[status] = counts.get(status, 0) + 1
                    by_path.setdefault(path, {}).setdefault(status, 0)
                    by_path[path][status] += 1
            except Failure as e:
                record(case, e)
            except (OSError, http.client.HTTPException, ValueError) as e:
                # timeouts, broken connections, bodies that do not parse
                record(case, f"{type(e).__name__}: {e} after {time.time() - t0:.1f} s")
            i += a.clients

    sentinel = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12, "temperature": 0}
    sentinel_texts, sentinel_n = set(), [0]

    def watch():
        while not done.is_set():
            try:
                status, _, raw = request(host, port, "/v1/chat/completions",
                                         json.dumps(sentinel).encode(), a.request_timeout,
                                         a.api_key)
                if status != 200:
                    raise Failure(f"HTTP {status}: {raw[:300]!r}")
                sentinel_texts.add(json.loads(raw)["choices"][0]["message"]["content"])
                sentinel_n[0] += 1
                if len(sentinel_texts) > 1:
                    raise Failure(f"the sentinel's text changed: {sorted(sentinel_texts)}")
            except Exception as e:
                record({"path": "sentinel", "body": json.dumps(sentinel)}, e)
                return
            time.sleep(0.2)

    t0 = time.time()
    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=client, args=(ci,)) for ci in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    w.join()
    batch_results = 0
    if "/v1/batches" in endpoints or "/v1/messages/batches" in endpoints:
        batch_results = check_batches(host, port, a.api_key, record)
    try:
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        if r.status != 200:
            record({"path": "/health"}, f"HTTP {r.status} at the end")
    except Exception as e:
        record({"path": "/health"}, f"the server is gone at the end: {e}")
    summary = {"requests": a.requests, "seed": a.seed, "seconds": round(time.time() - t0, 1),
               "by_status": {str(k): v for k, v in sorted(counts.items())},
               "by_path": {p: {str(k): v for k, v in sorted(s.items())}
                           for p, s in sorted(by_path.items())},
               "sentinel_requests": sentinel_n[0], "batch_results_checked": batch_results,
               "failures": len(failures)}
    print(json.dumps(summary))
    for f in failures[:20]:
        print(json.dumps(f)[:3000], file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
