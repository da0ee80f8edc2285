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
- background: `background=True` answers `queued` at once, `retrieve` polls it to `completed`
  with the foreground text; `cancel` stops one that is generating (`cancelled`, the engine's
  running requests back to 0, cancelling again answers it as it is, a completed or foreground
  response is a 400); streamed, the client leaves after a few events and follows again with
  `retrieve(stream=True, starting_after=N)`: the events go on from N + 1, the deltas add up to
  the final text; `store=False` with it is a 400;
- log-probabilities: `include=["message.output_text.logprobs"]` with `top_logprobs`: one
  entry per output token, equal to the chat endpoint's for the same conversation, streamed in
  the deltas too;
- conversations (OpenAI's Conversations API): a conversation made with an item and metadata,
  two responses through it (the second's text and prompt tokens equal to the same
  conversation sent whole), one streamed, its items listed in order and by page, an item added,
  read and deleted, its metadata changed, the conversation deleted (then a 404, and a 400 for
  a response naming it); refusals (with `previous_response_id`, an image item, 21 items);
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

# background responses
import time
import urllib.request

ROOT = sys.argv[1].rsplit("/v1", 1)[0]


def running():
    text = urllib.request.urlopen(ROOT + "/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("gds_requests_running ", "gds_queue_depth ")))


def wait_end(rid, limit=120):
    end = time.time() + limit
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.time() > end:
            return r
        time.sleep(0.1)


fg = client.responses.create(model=model, input="Name three colors.", temperature=0,
                             max_output_tokens=24)
b = client.responses.create(model=model, input="Name three colors.", temperature=0,
                            max_output_tokens=24, background=True)
done = wait_end(b.id)
long_kw = dict(model=model, input="Write a very long story about a dragon.", temperature=0,
               max_output_tokens=2000, extra_body={"ignore_eos": True})
lb = client.responses.create(background=True, **long_kw)
seen = []
while len(seen) < 50 and lb.status in ("queued", "in_progress"):
    lb = client.responses.retrieve(lb.id)
    seen.append(lb.status)
    if lb.status == "in_progress":
        break
    time.sleep(0.05)
time.sleep(0.3)
cancelled = client.responses.cancel(lb.id)
drained = None
for _ in range(100):
    if running() == 0:
        drained = True
        break
    time.sleep(0.1)


def status_of(call):
    try:
        return {"status": 200, "value": call().status}
    except openai.APIStatusError as e:
        return {"status": e.status_code, "message": e.response.json().get("error", {}).get("message")}


# streamed: leave after a few events, follow again from the last one seen
first, last_seq, bid = [], None, None
s = client.responses.create(model=model, input="Name three colors.", temperature=0,
                            max_output_tokens=24, background=True, stream=True)
for ev in s:
    first.append(ev.type)
    last_seq = ev.sequence_number
    bid = bid or ev.response.id
    if ev.type == "response.output_text.delta":
        break
s.close()
rest, seqs, final = [], [], None
# (the delta seen before leaving: the text's start)
deltas = [ev.delta] if first[-1] == "response.output_text.delta" else []
for ev in client.responses.retrieve(bid, stream=True, starting_after=last_seq):
    rest.append(ev.type)
    seqs.append(ev.sequence_number)
    if ev.type == "response.output_text.delta":
        deltas.append(ev.delta)
    if ev.type in ("response.completed", "response.incomplete"):
        final = ev.response
again = [ev.sequence_number for ev in client.responses.retrieve(bid, stream=True)]
out["background"] = {
    "created": b.status, "background": b.background, "done": done.status,
    "text": done.output_text, "fg_text": fg.output_text,
    "usage": done.usage.output_tokens, "fg_usage": fg.usage.output_tokens,
    "long_seen": seen, "cancelled": cancelled.status,
    "after_cancel": client.responses.retrieve(lb.id).status, "drained": drained,
    "cancel_again": status_of(lambda: client.responses.cancel(lb.id)),
    "cancel_done": status_of(lambda: client.responses.cancel(b.id)),
    "cancel_foreground": status_of(lambda: client.responses.cancel(fg.id)),
    "no_store": refused(input="hi", background=True, store=False),
    "continue_cancelled": refused(input="hi", previous_response_id=lb.id),
    "continue_done": client.responses.create(
        model=model, input="And one more?", previous_response_id=b.id, temperature=0,
        max_output_tokens=4).status,
    "stream_first": first, "last_seq": last_seq, "stream_rest": rest, "stream_seqs": seqs,
    "stream_text": "".join(deltas), "stream_final": final.output_text if final else None,
    "stream_all": again,
}

# log-probabilities of the output text
lr = client.responses.create(model=model, input="Name three colors.", temperature=0,
                             max_output_tokens=12, include=["message.output_text.logprobs"],
                             top_logprobs=3)
lc = client.chat.completions.create(model=model, temperature=0, max_tokens=12, logprobs=True,
                                    top_logprobs=3,
                                    messages=[{"role": "user", "content": "Name three colors."}])
part = lr.output[0].content[0]
slp = []
with client.responses.create(model=model, input="Name three colors.", temperature=0,
                             max_output_tokens=12, include=["message.output_text.logprobs"],
                             top_logprobs=3, stream=True) as s:
    for ev in s:
        if ev.type == "response.output_text.delta":
            slp += [[x.token, x.logprob] for x in ev.logprobs]
out["logprobs"] = {
    "tokens": [x.token for x in part.logprobs], "lp": [x.logprob for x in part.logprobs],
    "top": [len(x.top_logprobs) for x in part.logprobs],
    "chat_tokens": [x.token for x in lc.choices[0].logprobs.content],
    "chat_lp": [x.logprob for x in lc.choices[0].logprobs.content],
    "output_tokens": lr.usage.output_tokens, "streamed": slp,
    "top_logprobs": lr.top_logprobs,
    "plain": [c.logprobs for c in fg.output[0].content],
    "bad_top": refused(input="hi", top_logprobs=21, include=["message.output_text.logprobs"]),
}

# llama-server's telemetry on the Responses stream: prompt progress on response.in_progress
# events, timings on each text delta and on the last event
req = urllib.request.Request(
    sys.argv[1] + "/responses", method="POST", headers={"Content-Type": "application/json"},
    data=json.dumps({"input": "This is a test " * 20, "max_output_tokens": 8, "stream": True,
                     "timings_per_token": True, "return_progress": True}).encode())
tele = {"progress": [], "delta_timings": 0, "deltas": 0, "last": None}
with urllib.request.urlopen(req, timeout=120) as f:
    for line in f.read().decode().splitlines():
        if not line.startswith("data: "):
            continue
        d = json.loads(line[6:])
        if "prompt_progress" in d:
            tele["progress"].append([d["type"], d["prompt_progress"]["total"],
                                     d["prompt_progress"]["processed"], "timings" in d])
        if d["type"] == "response.output_text.delta":
            tele["deltas"] += 1
            tele["delta_timings"] += "predicted_per_second" in d.get("timings", {})
        tele["last"] = [d["type"], "timings" in d]
out["telemetry"] = tele

# conversations
conv = client.conversations.create(items=[{"type": "message", "role": "user",
                                           "content": "My name is Ada."}],
                                   metadata={"topic": "names"})
c1 = client.responses.create(model=model, conversation=conv.id, input="Say hello.",
                             max_output_tokens=12, temperature=0)
c2 = client.responses.create(model=model, conversation={"id": conv.id}, input="What is my name?",
                             max_output_tokens=12, temperature=0)
cwhole = client.responses.create(model=model, store=False, max_output_tokens=12, temperature=0,
                                 input=[{"role": "user", "content": "My name is Ada."},
                                        {"role": "user", "content": "Say hello."},
                                        {"role": "assistant", "content": c1.output_text},
                                        {"role": "user", "content": "What is my name?"}])
asc = client.conversations.items.list(conv.id, order="asc")
page1 = client.conversations.items.list(conv.id, limit=2)
page2 = client.conversations.items.list(conv.id, limit=2, after=page1.last_id)
cstream = None
for ev in client.responses.create(model=model, conversation=conv.id, input="Thanks.",
                                  max_output_tokens=6, temperature=0, stream=True):
    if ev.type in ("response.completed", "response.incomplete"):
        cstream = ev.response
after_stream = client.conversations.items.list(conv.id, order="asc", limit=100)
added = client.conversations.items.create(conv.id, items=[
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "An aside."}]}])
got_item = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
after_delete = client.conversations.items.list(conv.id, limit=100)
updated = client.conversations.update(conv.id, metadata={"topic": "greetings"})
retrieved = client.conversations.retrieve(conv.id)
other = client.conversations.create()
both = refused(input="hi", conversation=other.id, previous_response_id=c1.id)
deleted = client.conversations.delete(conv.id)
try:
    client.conversations.retrieve(conv.id)
    gone = None
except openai.NotFoundError as e:
    gone = e.status_code


def conv_refused(**kw):
    try:
        client.conversations.create(**kw)
        return {"status": 200}
    except openai.APIStatusError as e:
        body = e.response.json().get("error", {})
        return {"status": e.status_code, "param": body.get("param")}


out["conversations"] = {
    "object": conv.object, "id": conv.id, "metadata": conv.metadata,
    "c2": {"text": c2.output_text, "input_tokens": c2.usage.input_tokens,
           "conversation": c2.conversation.id if c2.conversation else None},
    "whole": {"text": cwhole.output_text, "input_tokens": cwhole.usage.input_tokens},
    "items": [[i.type, getattr(i, "role", None), i.content[0].text if getattr(i, "content", None) else None]
              for i in asc.data],
    "ids": [i.id for i in asc.data],
    "page1": [i.id for i in page1.data], "page1_more": page1.has_more,
    "page2": [i.id for i in page2.data],
    "stream_status": cstream.status if cstream else None,
    "after_stream": len(after_stream.data),
    "added": [added.object, len(added.data), bool(added.data[0].id)],
    "got_item": got_item.content[0].text, "after_delete": len(after_delete.data),
    "updated": updated.metadata, "retrieved": retrieved.metadata,
    "both": both, "deleted": [deleted.object, deleted.deleted], "gone": gone,
    "respond_gone": refused(input="hi", conversation=conv.id),
    "image": conv_refused(items=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]),
    "too_many": conv_refused(items=[{"role": "user", "content": "x"}] * 21),
}

out["refused"] = {
    "previous_response_id": refused(input="hi", previous_response_id="resp_123"),
    "image": refused(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]),
    "web_search": refused(input="hi", tools=[{"type": "web_search"}]),
    "bad_input": refused(input=5),
}
print(json.dumps(out, indent=1))
