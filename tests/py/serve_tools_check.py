#!/usr/bin/env python3
"""Tool calling through `gdsrun serve` with the official `openai` client.

Usage: serve_tools_check.py BASE_URL

The model's chat template must take tools in the Hermes/Qwen syntax (the Rust test serves
SmolLM2 with Qwen2.5-Instruct's template). A 135M model does not decide to call tools
reliably, so the calls are asked for: `tool_choice="required"` and a named function make the
reply a call whose arguments follow the function's schema (constrained decoding).

- required: a call of one of two tools, arguments valid against its schema (`jsonschema`);
- the round trip: that call, a `role: tool` result, then `tool_choice="none"`: a text answer;
- a named function, streamed: the client reassembles `delta.tool_calls`;
- `auto`: a valid reply either way (text, or calls that parse); streamed, text still comes
  chunk by chunk and equals the whole reply;
- refusals: a tool_choice naming an unknown function.
Prints one JSON object; crates/gds-serve/tests/it/tools.rs asserts on it.
"""
import json
import sys

try:
    import openai
    import jsonschema
except ImportError as e:
    sys.exit(f"python package `{e.name}` is missing: pip install openai jsonschema (scripts/test.sh does)")

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=300)
model = client.models.list().data[0].id
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
out = {}


def checked(calls):
    res = []
    for c in calls or []:
        entry = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        try:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
            entry["valid"] = True
        except Exception as e:
            entry["valid"] = False
            entry["error"] = str(e)[:200]
        res.append(entry)
    return res


messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_tokens=120)
m = r.choices[0].message
out["required"] = {"finish_reason": r.choices[0].finish_reason, "content": m.content,
                   "calls": checked(m.tool_calls)}

# the round trip: the call and its result go back, and the model answers in text
messages.append(m.model_dump(exclude_none=True))
for c in m.tool_calls or []:
    messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21, "sky": "clear"})})
r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                   tool_choice="none", temperature=0, max_tokens=30)
out["answer"] = {"finish_reason": r.choices[0].finish_reason, "content": r.choices[0].message.content,
                 "calls": checked(r.choices[0].message.tool_calls),
                 "prompt_tokens": r.usage.prompt_tokens}

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
    tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0.7, seed=3,
    max_tokens=120, stream=True)
calls, finish = {}, None
for chunk in stream:
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        e = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
        e["id"] = tc.id or e["id"]
        if tc.function:
            e["name"] += tc.function.name or ""
            e["arguments"] += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
streamed = []
for e in calls.values():
    try:
        jsonschema.validate(json.loads(e["arguments"]), SCHEMAS[e["name"]])
        e["valid"] = True
    except Exception as ex:
        e["valid"] = False
        e["error"] = str(ex)[:200]
    streamed.append(e)
out["streamed"] = {"finish_reason": finish, "calls": streamed}

r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello! Who are you?"}],
                                   tools=TOOLS, temperature=0, max_tokens=40)
m = r.choices[0].message
out["auto"] = {"finish_reason": r.choices[0].finish_reason, "content": m.content, "calls": checked(m.tool_calls)}

# the same, streamed: plain text streams chunk by chunk even with tools, and is the same text
stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello! Who are you?"}],
                                        tools=TOOLS, temperature=0, max_tokens=40, stream=True)
text, pieces, finish = "", 0, None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
        pieces += 1
    if chunk.choices:
        finish = chunk.choices[0].finish_reason or finish
out["auto_streamed"] = {"content": text, "pieces": pieces, "finish_reason": finish}

# parallel calls allowed (the default): every call that came back whole is valid
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather and time in Oslo?"}],
                                   tools=TOOLS, tool_choice="required", temperature=0.8, seed=11, max_tokens=160)
out["parallel"] = {"finish_reason": r.choices[0].finish_reason, "calls": checked(r.choices[0].message.tool_calls)}

try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "launch"}}, max_tokens=5)
    out["unknown_function"] = {"status": 200}
except openai.BadRequestError as e:
    err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
    out["unknown_function"] = {"status": e.status_code, "message": err.get("message"), "param": err.get("param")}
print(json.dumps(out))
