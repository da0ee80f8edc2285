#!/usr/bin/env python3
"""`/v1/messages` (Anthropic's Messages API) through `gdsrun serve` with the official
`anthropic` client, beside the `openai` client on the chat endpoint.

Usage: serve_anthropic_check.py BASE_URL API_KEY

BASE_URL is the server's root (`http://127.0.0.1:PORT`); the server runs with `--api-key
API_KEY`. The model's chat template must take tools (the Rust test serves SmolLM2 with
Qwen2.5-Instruct's template, Hermes `<tool_call>` syntax).

- text: `messages.create` with `system` and a user turn at temperature 0: the same text and
  token counts as `/v1/chat/completions` for the same conversation; `count_tokens` equal to
  the input tokens;
- `max_tokens` reached: `stop_reason` `max_tokens`; a stop sequence taken from the text:
  `stop_reason` `stop_sequence`, the sequence named, the text cut before it;
- streamed: the client's `messages.stream`, its text deltas joined equal to the final message
  and to the unstreamed text; the event sequence;
- structured output: `output_config.format` with a JSON schema gives JSON that follows it;
- prefill: a final assistant turn is continued (the same text as chat's
  `continue_final_message`), and counts more input tokens than without it;
- tools: `tool_choice: any` gives a `tool_use` block whose input follows the schema; the
  round trip with the `tool_result`, then text; a named tool streamed (`input_json_delta`);
- errors in Anthropic's shape: a wrong key (401 `authentication_error`), no `max_tokens`, an
  image block, a server tool (400 `invalid_request_error`), an unknown path under
  `/v1/messages` (404 `not_found_error`).
Prints one JSON object; crates/gds-serve/tests/it/tools.rs asserts on it.
"""
import json
import sys
import urllib.error
import urllib.request

try:
    import anthropic
    import jsonschema
    import openai
except ImportError as e:
    sys.exit(f"python package `{e.name}` is missing: pip install anthropic openai jsonschema (scripts/test.sh does)")

base, key = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=300)
oai = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
model = oai.models.list().data[0].id
out = {}
# the Messages API client has no sampling fields (the API dropped them); the server takes
# temperature, top_p and top_k like the chat endpoint
GREEDY = {"temperature": 0}

SYSTEM = "You answer in one short sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# text, and the same conversation through chat
m = client.messages.create(model=model, system=SYSTEM, messages=QUESTION, max_tokens=40,
                           extra_body=GREEDY)
chat = oai.chat.completions.create(model=model, temperature=0, max_tokens=40,
                                   messages=[{"role": "system", "content": SYSTEM}] + QUESTION)
count = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION)
out["text"] = {
    "id": m.id, "type": m.type, "role": m.role, "blocks": [b.type for b in m.content],
    "text": "".join(b.text for b in m.content if b.type == "text"),
    "stop_reason": m.stop_reason, "usage": m.usage.model_dump(),
    "chat_text": chat.choices[0].message.content, "chat_usage": chat.usage.model_dump(),
    "chat_finish": chat.choices[0].finish_reason, "count_tokens": count.input_tokens,
}

# the output limit
m = client.messages.create(model=model, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                           max_tokens=5, extra_body=GREEDY)
out["limited"] = {"stop_reason": m.stop_reason, "output_tokens": m.usage.output_tokens}

# a stop sequence: a word from the middle of the unstopped text
story = [{"role": "user", "content": "Write a short story about a cat."}]
full = client.messages.create(model=model, messages=story, max_tokens=60, extra_body=GREEDY)
full_text = full.content[0].text
word = next((w for w in full_text.split()[3:] if len(w) >= 3 and w.isalpha()), None)
stopped = client.messages.create(model=model, messages=story, max_tokens=60, extra_body=GREEDY,
                                 stop_sequences=[word]) if word else None
out["stop"] = {
    "full_text": full_text, "word": word,
    "expected": full_text[:full_text.index(word)] if word else None,
    "text": "".join(b.text for b in stopped.content) if stopped else None,
    "stop_reason": stopped.stop_reason if stopped else None,
    "stop_sequence": stopped.stop_sequence if stopped else None,
}

# streamed
kinds, deltas = [], []
with client.messages.stream(model=model, messages=[{"role": "user", "content": "Name three colors."}],
                            max_tokens=30, extra_body=GREEDY) as s:
    for ev in s:
        kinds.append(ev.type)
        if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
            deltas.append(ev.delta.text)
    final = s.get_final_message()
same = client.messages.create(model=model, messages=[{"role": "user", "content": "Name three colors."}],
                              max_tokens=30, extra_body=GREEDY)
out["streamed"] = {"kinds": kinds, "joined": "".join(deltas), "deltas": len(deltas),
                   "final_text": "".join(b.text for b in final.content if b.type == "text"),
                   "unstreamed": same.content[0].text if same.content else "",
                   "stop_reason": final.stop_reason, "output_tokens": final.usage.output_tokens}

# structured output: output_config.format
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["name", "country"], "additionalProperties": False}
j = client.messages.create(model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                           max_tokens=80, extra_body=GREEDY,
                           output_config={"format": {"type": "json_schema", "schema": CITY}})
try:
    jsonschema.validate(json.loads(j.content[0].text), CITY)
    out["structured"] = {"valid": True, "text": j.content[0].text}
except Exception as e:
    out["structured"] = {"valid": False, "text": j.content[0].text if j.content else None, "error": str(e)}

# prefill: the reply continues the final assistant turn
conv = [{"role": "user", "content": "List three colors, numbered."}, {"role": "assistant", "content": "1. Red"}]
p = client.messages.create(model=model, messages=conv, max_tokens=20, extra_body=GREEDY)
c = oai.chat.completions.create(model=model, messages=conv, max_tokens=20, temperature=0,
                                extra_body={"continue_final_message": True})
out["prefill"] = {
    "text": "".join(b.text for b in p.content), "chat_text": c.choices[0].message.content,
    "tokens": client.messages.count_tokens(model=model, messages=conv).input_tokens,
    "without": client.messages.count_tokens(model=model, messages=conv[:1]).input_tokens,
}

# tools
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.messages.create(model=model, messages=ask, tools=TOOLS, tool_choice={"type": "any"},
                           max_tokens=80, extra_body=GREEDY)
uses = [b for b in r.content if b.type == "tool_use"]
valid = bool(uses)
for u in uses:
    try:
        jsonschema.validate(u.input, WEATHER)
    except Exception:
        valid = False
out["call"] = {"blocks": [b.type for b in r.content], "valid": valid, "stop_reason": r.stop_reason,
               "names": [u.name for u in uses], "ids": [u.id for u in uses]}
if uses:
    follow = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id,
             "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})}
            for u in uses]},
    ]
    a = client.messages.create(model=model, messages=follow, tools=TOOLS, tool_choice={"type": "none"},
                               max_tokens=60, extra_body=GREEDY)
    out["answer"] = {"blocks": [b.type for b in a.content],
                     "text": "".join(b.text for b in a.content if b.type == "text"),
                     "stop_reason": a.stop_reason, "input_tokens": a.usage.input_tokens
                     + a.usage.cache_read_input_tokens, "question_tokens": r.usage.input_tokens
                     + r.usage.cache_read_input_tokens}

kinds, partial = [], []
with client.messages.stream(model=model, messages=ask, tools=TOOLS,
                            tool_choice={"type": "tool", "name": "get_weather"},
                            max_tokens=80, extra_body=GREEDY) as s:
    for ev in s:
        kinds.append(ev.type)
        if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
            partial.append(ev.delta.partial_json)
    final = s.get_final_message()
tool_blocks = [b for b in final.content if b.type == "tool_use"]
out["streamed_call"] = {"kinds": kinds, "partial": "".join(partial),
                        "input": tool_blocks[0].input if tool_blocks else None,
                        "name": tool_blocks[0].name if tool_blocks else None,
                        "stop_reason": final.stop_reason}


def refused(c=client, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    try:
        c.messages.create(model=model, **kw)
        return {"status": 200}
    except anthropic.APIStatusError as e:
        body = e.response.json()
        return {"status": e.status_code, "type": body.get("type"),
                "error_type": body.get("error", {}).get("type"),
                "message": body.get("error", {}).get("message")}


def raw(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "x-api-key": key})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "body": json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": json.loads(e.read())}


wrong = anthropic.Anthropic(base_url=base, api_key="not-the-key", max_retries=0, timeout=60)
out["refused"] = {
    "wrong_key": refused(c=wrong),
    "no_max_tokens": raw("/v1/messages", {"model": model, "messages": [{"role": "user", "content": "hi"}]}),
    "image": refused(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}]),
    "server_tool": refused(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
    "unknown_path": raw("/v1/messages/nope", {}),
}
# the Models API in Anthropic's shape (the client sends anthropic-version)
listed = client.models.list()
got = client.models.retrieve(listed.data[0].id)
try:
    client.models.retrieve("no-such-model")
    missing = None
except anthropic.NotFoundError as e:
    missing = {"status": e.status_code, "body": e.body}
out["models"] = {"ids": [m.id for m in listed.data], "type": got.type, "id": got.id,
                 "created_at": got.created_at.isoformat(), "missing": missing}
print(json.dumps(out, indent=1))
