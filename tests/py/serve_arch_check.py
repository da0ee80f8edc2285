#!/usr/bin/env python3
"""One architecture through `gdsrun serve` with the official `openai` client.

Usage: serve_arch_check.py BASE_URL PROMPT CHAT_MESSAGE

A greedy completion of PROMPT (8 tokens), a greedy chat answer to CHAT_MESSAGE (8 tokens)
and the same chat streamed; prints one JSON object. The Rust test
(crates/gds-serve/tests/it/openai.rs) compares it with `gdsrun` on the command line.
"""
import json
import sys

try:
    import openai
except ImportError:
    sys.exit("python package `openai` is missing: pip install openai (scripts/test.sh does)")

base, prompt, message = sys.argv[1:4]
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
print(json.dumps(out))
