#!/usr/bin/env python3
"""`/v1/responses` through `gdsrun serve` with the official `openai` client.

Usage: serve_responses_check.py BASE_URL

The model's chat template must take tools (the Rust test serves SmolLM2 with Qwen2.5-Instruct's
template, Hermes `<tool_call>` syntax).

- text: `responses.create` with `instructions` and a string input; `output_text`, status,
  usage; the same answer as `/v1/chat/completions` for the same conversation at temperature 0;
- `max_output_tokens` reached: status `incomplete`, reason `max_output_tokens`;
- streamed: the client's event stream, its deltas joined equal to the final response's text;
- structured: `responses.parse` with a pydantic model (`text_format`) parses;
- tools: `tool_choice="required"` gives a `function_call` item whose arguments follow the
  schema; the round trip with `function_call` + `function_call_output` input items, then a
  text answer; a named function streamed (`response.function_call_arguments.*` events);
- kept responses: `previous_response_id` continues a conversation (the same prompt tokens and
  text as sending its items, `instructions` not carried over), streamed too; `retrieve`,
  `input_items.list`, `delete`; a response made with `store=False` is not kept;
- refusals: an unknown `previous_response_id`, an image part, a non-function tool (400 naming
  the field).
Prints one JSON object; crates/gds-serve/tests/it/tools.rs asserts on it.
"""
import json
import sys

try:
    import jsonschema
    import openai
    import pydantic
except ImportError as e:
    sys.exit(f"python package `{e.name}` is missing: pip install openai jsonschema (scripts/test.sh does)")

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=300)
model = client.models.list().data[0].id
out = {}

# text, and the same conversation through chat
r = client.responses.create(model=model, instructions="You answer in one short sentence.",
                            input="What is the capital of France?", temperature=0,
                            max_output_tokens=40)
chat = client.chat.completions.create(
    model=model, temperature=0, max_tokens=40,
    messages=[{"role": "system", "content": "You answer in one short sentence."},
              {"role": "user", "content": "What is the capital of France?"}])
out["text"] = {
    "object": r.object, "status": r.status, "id": r.id, "text": r.output_text,
    "items": [o.type for o in r.output], "role": r.output[0].role,
    "usage": r.usage.model_dump(), "chat_text": chat.choices[0].message.content,
    "chat_usage": chat.usage.model_dump(),
}

# the output limit
r = client.responses.create(model=model, input="Write a long story about a dragon.",
                            temperature=0, max_output_tokens=5)
out["limited"] = {"status": r.status, "reason": r.incomplete_details.reason if r.incomplete_details else None,
                  "output_tokens": r.usage.output_tokens}

# streamed
kinds, deltas, final = [], [], None
with client.responses.create(model=model, input=[{"role": "user", "content": "Name three colors."}],
                             temperature=0, max_output_tokens=30, stream=True) as s:
    for ev in s:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
out["streamed"] = {"kinds": kinds, "joined": "".join(deltas), "final_text": final.output_text,
                   "deltas": len(deltas), "status": final.status}


# structured output
class City(pydantic.BaseModel):
    # bounded, so that a small model's reply fits max_output_tokens
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=99999999)


p = client.responses.parse(model=model, input="Describe Paris as JSON.", text_format=City,
                           temperature=0, max_output_tokens=120)
out["parsed"] = {"ok": isinstance(p.output_parsed, City), "text": p.output_text,
                 "value": p.output_parsed.model_dump() if p.output_parsed else None}

# tools
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]
question = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.responses.create(model=model, input=question, tools=TOOLS, tool_choice="required",
                            temperature=0, max_output_tokens=80)
calls = [o for o in r.output if o.type == "function_call"]
valid = bool(calls)
for c in calls:
    try:
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    except Exception:
        valid = False
out["call"] = {"items": [o.type for o in r.output], "valid": valid,
               "names": [c.name for c in calls], "call_ids": [c.call_id for c in calls]}
if calls:
    # every call (parallel calls are on by default) and its result
    follow = list(question)
    follow += [{"type": "function_call", "call_id": c.call_id, "name": c.name,
                "arguments": c.arguments} for c in calls]
    follow += [{"type": "function_call_output", "call_id": c.call_id,
                "output": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})}
               for c in calls]
    a = client.responses.create(model=model, input=follow, tools=TOOLS, tool_choice="none",
                                temperature=0, max_output_tokens=60)
    out["answer"] = {"items": [o.type for o in a.output], "text": a.output_text,
                     "input_tokens": a.usage.input_tokens,
                     "question_tokens": r.usage.input_tokens}

kinds, args_delta, done_item = [], [], None
with client.responses.create(model=model, input=question, tools=TOOLS,
                             tool_choice={"type": "function", "name": "get_weather"},
                             temperature=0, max_output_tokens=80, stream=True) as s:
    for ev in s:
        kinds.append(ev.type)
        if ev.type == "response.function_call_arguments.delta":
            args_delta.append(ev.delta)
        if ev.type == "response.output_item.done" and ev.item.type == "function_call":
            done_item = ev.item
out["streamed_call"] = {"kinds": kinds, "arguments": "".join(args_delta),
                        "item_arguments": done_item.arguments if done_item else None,
                        "name": done_item.name if done_item else None}


def refused(**kw):
    try:
        client.responses.create(model=model, max_output_tokens=4, **kw)
        return {"status": 200}
    except openai.APIStatusError as e:
        body = e.response.json().get("error", {})
        return {"status": e.status_code, "param": body.get("param"), "message": body.get("message")}


# kept responses: a conversation continued by id equals the same conversation sent whole
r1 = client.responses.create(model=model, input="My name is Ada. Say hello.", max_output_tokens=12,
                             temperature=0, instructions="Be brief.")
r2 = client.responses.create(model=model, previous_response_id=r1.id, input="What is my name?",
                             max_output_tokens=12, temperature=0)
whole = client.responses.create(model=model, store=False, max_output_tokens=12, temperature=0, input=[
    {"role": "user", "content": "My name is Ada. Say hello."},
    {"role": "assistant", "content": r1.output_text},
    {"role": "user", "content": "What is my name?"}])
final = None
for ev in client.responses.create(model=model, previous_response_id=r1.id, input="What is my name?",
                                  max_output_tokens=12, temperature=0, stream=True):
    if ev.type in ("response.completed", "response.incomplete"):
        final = ev.response
got = client.responses.retrieve(r2.id)
items = client.responses.input_items.list(r2.id)
client.responses.delete(r1.id)
try:
    client.responses.retrieve(r1.id)
    deleted = None
except openai.NotFoundError as e:
    deleted = e.status_code
out["kept"] = {
    "store": [r1.store, r2.store, whole.store], "previous": r2.previous_response_id, "r1": r1.id,
    "chained": {"text": r2.output_text, "input_tokens": r2.usage.input_tokens},
    "whole": {"text": whole.output_text, "input_tokens": whole.usage.input_tokens},
    "streamed": {"text": final.output_text, "input_tokens": final.usage.input_tokens,
                 "previous": final.previous_response_id},
    "retrieved": {"id": got.id, "text": got.output_text},
    "input_items": [[i.type, getattr(i, "role", None)] for i in items.data],
    # typed access, as the client's models give it: an id, the status, the text of a part
    "input_item_fields": [[bool(i.id), i.status, i.content[0].text] for i in items.data],
    "deleted_status": deleted,
    "not_kept": refused(input="hi", previous_response_id=whole.id),
}

out["refused"] = {
    "previous_response_id": refused(input="hi", previous_response_id="resp_123"),
    "image": refused(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]),
    "web_search": refused(input="hi", tools=[{"type": "web_search"}]),
    "bad_input": refused(input=5),
}
print(json.dumps(out, indent=1))
