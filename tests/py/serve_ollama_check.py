#!/usr/bin/env python3
"""Ollama's API (`/api/*`) through `gdsrun serve` with the official `ollama` Python client,
beside the `openai` client on the same server.

Usage: serve_ollama_check.py TOOLS_URL THINKING_URL

TOOLS_URL serves SmolLM2 with a chat template that takes tools (Qwen 2.5's, Hermes
`<tool_call>` syntax); THINKING_URL serves it with Qwen 3's template (`<think>` tags).

- the listings: `list`, `ps`, `show` (details, `model_info`, capabilities), `/api/version`, `/`;
- `generate` and `chat` at temperature 0: the same text and token counts as
  `/v1/chat/completions` for the same conversation; `raw` as `/v1/completions`; streamed
  pieces joined equal to the whole; `context` holds the prompt and the reply and carries a
  conversation on; `num_predict` (`length`), `stop`; `format` (a JSON schema) followed;
  `logprobs` with `top_logprobs`;
- tools: a call forced by the `tool_choice` extension (raw HTTP, answers read by the client's
  own types), streamed as one piece with the call; the round trip (the call and the tool's
  result, by `tool_name`) renders as the OpenAI endpoint renders the same conversation;
- thinking (`think`): the reasoning apart as `thinking`, whole and streamed; `think` on a
  model whose template does not think: an error;
- `embed` (normalized, as `/v1/embeddings`; `dimensions`), `embeddings` (not normalized);
- loading (empty prompt: `load`, `keep_alive` 0: `unload`), `pull` of the served model,
  and errors in Ollama's shape (`{"error"}`) with their statuses.
Prints one JSON object; crates/gds-serve/tests/it/ollama.rs asserts on it.
"""
import json
import math
import sys
import urllib.error
import urllib.request

try:
    import jsonschema
    import ollama
    import openai
except ImportError as e:
    sys.exit(f"python package `{e.name}` is missing: pip install ollama openai jsonschema (scripts/test.sh does)")

tools_url, thinking_url = sys.argv[1], sys.argv[2]
client = ollama.Client(host=tools_url, timeout=300)
thinker = ollama.Client(host=thinking_url, timeout=300)
oai = openai.OpenAI(base_url=tools_url + "/v1", api_key="none", max_retries=0, timeout=300)
GREEDY = {"temperature": 0}
out = {}


def http(url, path, body=None, method=None):
    """(status, body as text) of a request; `body` sent as JSON."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode(), r.headers.get("Content-Type")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("Content-Type")


def lines(url, path, body):
    """A streamed answer's objects."""
    status, text, kind = http(url, path, body)
    assert status == 200, (status, text)
    return [json.loads(l) for l in text.splitlines() if l.strip()], kind


# the listings
models = client.list().models
show = client.show("smollm2")
ps = client.ps().models
out["list"] = {"names": [m.model for m in models], "size": models[0].size,
               "digest": models[0].digest, "family": models[0].details.family,
               "parameter_size": models[0].details.parameter_size,
               "quantization": models[0].details.quantization_level}
out["show"] = {"capabilities": show.capabilities, "info": dict(show.modelinfo),
               "template_has_tools": "tools" in (show.template or ""),
               "parameters": show.parameters}
out["ps"] = {"names": [m.model for m in ps], "context_length": ps[0].context_length}
out["version"] = json.loads(http(tools_url, "/api/version")[1])
out["root"] = http(tools_url, "/")[1]
out["thinker_capabilities"] = thinker.show("smollm2").capabilities
name = models[0].model

# generate, against chat completions on the same conversation
SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France?"
g = client.generate(model=name, prompt=QUESTION, system=SYSTEM, options={**GREEDY, "num_predict": 40})
chat = oai.chat.completions.create(model=name, temperature=0, max_tokens=40, messages=[
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
pieces = list(client.generate(model=name, prompt=QUESTION, system=SYSTEM, stream=True,
                              options={**GREEDY, "num_predict": 40}))
detok = json.loads(http(tools_url, "/detokenize", {"tokens": g.context[g.prompt_eval_count:]})[1])
out["generate"] = {
    "text": g.response, "chat_text": chat.choices[0].message.content,
    "done": g.done, "done_reason": g.done_reason, "chat_finish": chat.choices[0].finish_reason,
    "eval_count": g.eval_count, "prompt_eval_count": g.prompt_eval_count,
    "chat_usage": chat.usage.model_dump(),
    "durations": [g.total_duration, g.prompt_eval_duration, g.eval_duration],
    "created_at": g.created_at,
    "context_len": len(g.context), "context_reply": detok["content"],
    "streamed": "".join(p.response for p in pieces), "pieces": len(pieces),
    "done_flags": [p.done for p in pieces],
    "last": pieces[-1].model_dump(exclude_none=True),
}
# context carries the conversation on
g2 = client.generate(model=name, prompt="And of Italy?", context=g.context, options={**GREEDY, "num_predict": 20})
out["context"] = {"prompt_eval_count": g2.prompt_eval_count, "first_context": len(g.context),
                  "starts_with_first": g2.context[:len(g.context)] == list(g.context),
                  "text": g2.response}
# the same server under Docker Model Runner's OpenAI base URLs
dmr = {}
for base in ("/engines/v1", "/engines/llama.cpp/v1"):
    d = openai.OpenAI(base_url=tools_url + base, api_key="none", max_retries=0, timeout=300)
    r = d.chat.completions.create(model=name, temperature=0, max_tokens=40, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    dmr[base] = {"models": [m.id for m in d.models.list().data], "text": r.choices[0].message.content}
out["dmr"] = dmr
# raw, against completions
raw = client.generate(model=name, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 12})
comp = oai.completions.create(model=name, prompt="The capital of France is", temperature=0, max_tokens=12)
out["raw"] = {"text": raw.response, "completion_text": comp.choices[0].text,
              "prompt_eval_count": raw.prompt_eval_count, "completion_prompt": comp.usage.prompt_tokens,
              "context": raw.context}

# chat, whole and streamed
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color of the sky."}]
c = client.chat(model=name, messages=MESSAGES, options={**GREEDY, "num_predict": 30})
cc = oai.chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=30)
cs = list(client.chat(model=name, messages=MESSAGES, stream=True, options={**GREEDY, "num_predict": 30}))
out["chat"] = {
    "text": c.message.content, "role": c.message.role, "chat_text": cc.choices[0].message.content,
    "eval_count": c.eval_count, "prompt_eval_count": c.prompt_eval_count,
    "chat_usage": cc.usage.model_dump(), "done_reason": c.done_reason,
    "streamed": "".join(p.message.content or "" for p in cs),
    "done_flags": [p.done for p in cs], "roles": sorted({p.message.role for p in cs}),
}
# a final assistant message is continued
pre = client.chat(model=name, messages=MESSAGES + [{"role": "assistant", "content": "The sky is"}],
                  options={**GREEDY, "num_predict": 10})
pre_chat = oai.chat.completions.create(model=name, temperature=0, max_tokens=10,
                                       messages=MESSAGES + [{"role": "assistant", "content": "The sky is"}],
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
out["prefill"] = {"text": pre.message.content, "chat_text": pre_chat.choices[0].message.content}

# options
lim = client.generate(model=name, prompt="Tell me a long story about a dragon.", options={**GREEDY, "num_predict": 5})
out["limited"] = {"done_reason": lim.done_reason, "eval_count": lim.eval_count}
story = client.generate(model=name, prompt="Tell me a long story about a dragon.", options={**GREEDY, "num_predict": 40})
words = [w for w in story.response.split() if w.isalpha() and len(w) > 3]
word = words[2] if len(words) > 2 else None
if word:
    st = client.generate(model=name, prompt="Tell me a long story about a dragon.",
                         options={**GREEDY, "num_predict": 40, "stop": [word]})
    out["stop"] = {"word": word, "text": st.response, "expected": story.response[:story.response.index(word)],
                   "done_reason": st.done_reason}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
f = client.chat(model=name, messages=[{"role": "user", "content": "A person as JSON."}], format=SCHEMA,
                options={**GREEDY, "num_predict": 60})
try:
    jsonschema.validate(json.loads(f.message.content), SCHEMA)
    out["format"] = {"valid": True}
except Exception as e:  # noqa: BLE001 - reported to the Rust test
    out["format"] = {"valid": False, "text": f.message.content, "error": str(e)}
lp = client.generate(model=name, prompt=QUESTION, logprobs=True, top_logprobs=2, options={**GREEDY, "num_predict": 6})
out["logprobs"] = {"n": len(lp.logprobs or []), "eval_count": lp.eval_count,
                   "tops": [len(x.top_logprobs or []) for x in lp.logprobs or []],
                   "tokens": "".join(x.token for x in lp.logprobs or []), "text": lp.response,
                   "greedy_first": all(x.top_logprobs[0].token == x.token for x in lp.logprobs or [])}

# tools: a call forced (the tool_choice extension), whole and streamed, read by the client's types
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": False,
        "options": {**GREEDY, "num_predict": 60}}
status, text, _ = http(tools_url, "/api/chat", body)
called = ollama.ChatResponse(**json.loads(text))
streamed, kind = lines(tools_url, "/api/chat", {**body, "stream": True})
streamed = [ollama.ChatResponse(**o) for o in streamed]
with_calls = [p for p in streamed if p.message.tool_calls]
calls = called.message.tool_calls or []
out["tools"] = {
    "status": status, "calls": [{"name": t.function.name, "arguments": dict(t.function.arguments)} for t in calls],
    "raw_calls": json.loads(text)["message"].get("tool_calls"),
    "done_reason": called.done_reason, "content_type": kind,
    "streamed_calls": [[{"name": t.function.name, "arguments": dict(t.function.arguments)} for t in p.message.tool_calls]
                       for p in with_calls],
}
# the round trip: the call and its result back, rendered as the OpenAI endpoint renders them
if calls:
    raw_call = json.loads(text)["message"]["tool_calls"][0]
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [raw_call]},
                     {"role": "tool", "tool_name": "get_weather", "content": "sunny, 21 C"}]
    after = client.chat(model=name, messages=history, tools=TOOLS, options={**GREEDY, "num_predict": 30})
    oai_history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": raw_call["id"], "type": "function", "function": {
            "name": raw_call["function"]["name"], "arguments": json.dumps(raw_call["function"]["arguments"])}}]},
        {"role": "tool", "tool_call_id": raw_call["id"], "content": "sunny, 21 C"}]
    after_oai = oai.chat.completions.create(model=name, messages=oai_history, tools=TOOLS, temperature=0, max_tokens=30)
    out["round_trip"] = {"prompt_eval_count": after.prompt_eval_count,
                         "chat_prompt_tokens": after_oai.usage.prompt_tokens,
                         "text": after.message.content, "chat_text": after_oai.choices[0].message.content}

# thinking (Qwen 3's template; SmolLM2 held to a thinking shape by the grammar extension)
THINKING = 'root ::= "<think>\\nI " [a-z]{2,8} " " [a-z]{2,8} ".\\n</think>\\n\\nIt is " [a-z]{2,8} "."'
tbody = {"model": name, "messages": [{"role": "user", "content": "Is the sky blue?"}], "think": True,
         "grammar": THINKING, "stream": False, "options": {**GREEDY, "num_predict": 60}}
status, text, _ = http(thinking_url, "/api/chat", tbody)
t = ollama.ChatResponse(**json.loads(text))
ts, _ = lines(thinking_url, "/api/chat", {**tbody, "stream": True})
ts = [ollama.ChatResponse(**o) for o in ts]
# the reasoning_format extension: "none" leaves the reply whole
whole = json.loads(http(thinking_url, "/api/chat", {**tbody, "reasoning_format": "none"})[1])["message"]
gbody = {"model": name, "prompt": "Is the sky blue?", "think": True, "grammar": THINKING, "stream": False,
         "options": {**GREEDY, "num_predict": 60}}
tg = json.loads(http(thinking_url, "/api/generate", gbody)[1])
try:
    client.chat(model=name, messages=ASK, think=True)
    not_thinking = None
except ollama.ResponseError as e:
    not_thinking = {"status": e.status_code, "error": e.error}
out["thinking"] = {
    "status": status, "thinking": t.message.thinking, "content": t.message.content,
    "streamed_thinking": "".join(p.message.thinking or "" for p in ts),
    "streamed_content": "".join(p.message.content or "" for p in ts),
    "generate_thinking": tg.get("thinking"), "generate_response": tg.get("response"),
    "not_thinking": not_thinking,
    "unsplit_content": whole.get("content"), "unsplit_thinking": whole.get("thinking"),
}

# embeddings
e = client.embed(model=name, input=["The sky is blue.", "Grass is green."])
oe = oai.embeddings.create(model=name, input=["The sky is blue.", "Grass is green."])
e8 = client.embed(model=name, input="The sky is blue.", dimensions=8)
legacy = client.embeddings(model=name, prompt="The sky is blue.").embedding
norm = lambda v: math.sqrt(sum(x * x for x in v))  # noqa: E731
out["embed"] = {
    "n": len(e.embeddings), "dims": [len(v) for v in e.embeddings], "norms": [norm(v) for v in e.embeddings],
    "max_diff_openai": max(abs(a - b) for v, w in zip(e.embeddings, oe.data) for a, b in zip(v, w.embedding)),
    "prompt_eval_count": e.prompt_eval_count, "openai_prompt_tokens": oe.usage.prompt_tokens,
    "dims8": len(e8.embeddings[0]), "norm8": norm(e8.embeddings[0]),
    "legacy_norm": norm(legacy),
    "legacy_direction": max(abs(a / norm(legacy) - b) for a, b in zip(legacy, e.embeddings[0])),
}

# loading, pulling, errors
load = client.generate(model=name, prompt="")
unload = client.generate(model=name, prompt="", keep_alive=0)
chat_load = client.chat(model=name, messages=[])
out["load"] = {"generate": load.done_reason, "unload": unload.done_reason, "chat": chat_load.done_reason,
               "done": load.done}
out["pull"] = client.pull(name).status
errors = {}
for key, path, body in [
    ("no_model", "/api/chat", {"messages": ASK}),
    ("image", "/api/generate", {"model": name, "prompt": "x", "images": ["aGVsbG8="]}),
    ("tfs_z", "/api/generate", {"model": name, "prompt": "x", "options": {"tfs_z": 0.5}}),
    ("template", "/api/generate", {"model": name, "prompt": "x", "template": "{{ .Prompt }}"}),
    ("bad_json", "/api/chat", b"{not json"),
    ("bad_role", "/api/chat", {"model": name, "messages": [{"role": "robot", "content": "x"}]}),
    ("insert", "/api/generate", {"model": name, "prompt": "def f(", "suffix": "return 1"}),
    ("too_long", "/api/generate", {"model": name, "prompt": "word " * 5000, "stream": False,
                                    "truncate": False}),
    ("unknown_path", "/api/nothing", {"model": name}),
    ("pull_other", "/api/pull", {"model": "llama3.2:latest", "stream": False}),
    ("create", "/api/create", {"model": "x", "from": name}),
]:
    status, text, _ = http(tools_url, path, body)
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text
    errors[key] = {"status": status, "body": parsed}
status, text, _ = http(tools_url, "/api/delete", {"model": name}, method="DELETE")
errors["delete"] = {"status": status, "body": json.loads(text)}
try:
    client.chat(model=name, messages=ASK, options={"tfs_z": 0.5})
    errors["client"] = None
except ollama.ResponseError as ex:
    errors["client"] = {"status": ex.status_code, "error": ex.error}
out["errors"] = errors
print(json.dumps(out))
