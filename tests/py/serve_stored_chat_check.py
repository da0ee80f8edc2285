#!/usr/bin/env python3
"""OpenAI's stored chat completions through `gdsrun serve` with the official `openai` client.

Usage: serve_stored_chat_check.py BASE_URL

The server's chat template must take tools (the Rust test serves SmolLM2 with Qwen2.5-Instruct's
template). Checks, each an assertion here:
- `store=True` with `metadata`: `chat.completions.retrieve` gives the completion as answered
  (text, usage) with its metadata; `store=False` (the default) keeps nothing (404);
- streamed with `store=True` (and the usage chunk): the kept completion is what the chunks add
  up to (text, usage), a streamed tool call too (name, arguments whole and parseable);
- `chat.completions.list`: creation order, `metadata` filters, `order`, `limit` pages with
  `has_more` and `after`, `model`;
- `update` replaces the metadata (a filter then sees it); `messages.list` lists the request's
  messages with ids; `delete`, then a 404;
- refusals: metadata over OpenAI's limits, `store` not a boolean (400 naming the field).
Prints one JSON summary.
"""
import json
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0)
M = "model"
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
kw = dict(model=M, messages=msgs, max_tokens=12, temperature=0)

a = client.chat.completions.create(store=True, metadata={"topic": "colour", "run": "1"}, **kw)
got = client.chat.completions.retrieve(a.id)
assert got.id == a.id and got.choices[0].message.content == a.choices[0].message.content, got
assert got.usage.total_tokens == a.usage.total_tokens, got
assert got.metadata == {"topic": "colour", "run": "1"}, got.metadata

plain = client.chat.completions.create(**kw)
try:
    client.chat.completions.retrieve(plain.id)
    raise AssertionError("a completion without store was kept")
except openai.NotFoundError:
    pass

# streamed: the chunks added up
text, sid, usage = "", None, None
for ch in client.chat.completions.create(store=True, stream=True, metadata={"topic": "colour"},
                                         stream_options={"include_usage": True}, **kw):
    sid = ch.id
    if ch.usage:
        usage = ch.usage
    for c in ch.choices:
        text += c.delta.content or ""
s = client.chat.completions.retrieve(sid)
assert s.object == "chat.completion", s
assert s.choices[0].message.content == text == a.choices[0].message.content, (s, text)
assert s.usage.completion_tokens == usage.completion_tokens, (s.usage, usage)
assert s.choices[0].finish_reason in ("stop", "length"), s

# a streamed tool call, kept whole
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
args, tid, finish = "", None, None
for ch in client.chat.completions.create(model=M, store=True, stream=True, tools=tools,
                                         tool_choice="required", max_tokens=40, temperature=0,
                                         messages=[{"role": "user", "content": "Weather in Paris?"}]):
    tid = ch.id
    for c in ch.choices:
        finish = c.finish_reason or finish
        for call in c.delta.tool_calls or []:
            args += call.function.arguments or ""
t = client.chat.completions.retrieve(tid)
call = t.choices[0].message.tool_calls[0]
assert call.function.name == "get_weather" and call.function.arguments == args, (t, args)
assert "city" in json.loads(call.function.arguments), call
assert t.choices[0].finish_reason == finish, (t, finish)

# listing
ids = [c.id for c in client.chat.completions.list()]
assert ids == [a.id, sid, tid], ids
colour = [c.id for c in client.chat.completions.list(metadata={"topic": "colour"})]
assert colour == [a.id, sid], colour
assert [c.id for c in client.chat.completions.list(order="desc")] == [tid, sid, a.id]
page = client.chat.completions.list(limit=2)
assert [c.id for c in page.data] == [a.id, sid] and page.has_more, page
rest = client.chat.completions.list(limit=2, after=sid)
assert [c.id for c in rest.data] == [tid] and not rest.has_more, rest
assert [c.id for c in client.chat.completions.list(model="other")] == []

# update, messages, delete
u = client.chat.completions.update(a.id, metadata={"topic": "changed"})
assert u.metadata == {"topic": "changed"}, u
assert [c.id for c in client.chat.completions.list(metadata={"topic": "colour"})] == [sid]
ms = client.chat.completions.messages.list(a.id)
assert [m.id for m in ms.data] == [f"{a.id}-0", f"{a.id}-1"], ms
assert ms.data[1].content == "Name a colour." and ms.data[1].role == "user", ms
d = client.chat.completions.delete(a.id)
assert d.deleted and d.id == a.id, d
try:
    client.chat.completions.retrieve(a.id)
    raise AssertionError("a deleted completion was kept")
except openai.NotFoundError:
    pass

# refusals
refused = {}
for name, extra in [("metadata", dict(store=True, metadata={f"k{i}": "v" for i in range(17)})),
                    ("store", dict(extra_body={"store": "yes"}))]:
    try:
        client.chat.completions.create(**kw, **extra)
        raise AssertionError(f"{name} was taken")
    except openai.BadRequestError as e:
        refused[name] = e.body.get("param") if isinstance(e.body, dict) else None
assert refused == {"metadata": "metadata", "store": "store"}, refused

print(json.dumps({"kept": len(ids), "text": text, "arguments": args, "refused": refused}))
