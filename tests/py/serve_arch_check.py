#!/usr/bin/env python3
"""Architectures through `gdsrun serve` with the official `openai` client.

Usage: serve_arch_check.py PROMPT CHAT_MESSAGE BASE_URL [BASE_URL ...]

For each server (one Python start for all of them: importing the client takes seconds): a
greedy completion of PROMPT (8 tokens), a greedy chat answer to CHAT_MESSAGE (8 tokens) and
the same chat streamed; prints one JSON list, one object per BASE_URL in order. The Rust test
(crates/gds-serve/tests/it/openai.rs) compares each with `gdsrun` on the command line.
"""
import json
import sys

try:
    import openai
except ImportError:
    sys.exit("python package `openai` is missing: pip install openai (scripts/test.sh does)")


def check(base, prompt, message):
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = {"model": model}
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    out["completion"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                         "usage": r.usage.model_dump()}
    msgs = [{"role": "user", "content": message}]
    r = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=msgs)
    out["chat"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                   "usage": r.usage.model_dump()}
    text = ""
    for chunk in client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                                messages=msgs, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    out["chat_stream"] = text
    return out


if len(sys.argv) < 4:
    sys.exit(__doc__)
prompt, message, bases = sys.argv[1], sys.argv[2], sys.argv[3:]
print(json.dumps([check(b, prompt, message) for b in bases]))
