#!/usr/bin/env python3
"""Log-probabilities through `gdsrun serve` with the official `openai` client.

Usage: serve_logprobs_check.py BASE_URL PROMPT_TOKEN_IDS_JSON SECOND_PROMPT_IDS_JSON CHAT_MESSAGE

Greedy (temperature 0), 8 tokens each: a completion of the given token ids with
`logprobs=3`, a chat answer with `logprobs=True, top_logprobs=3`, the same chat streamed
(the chunks' logprobs reassembled by concatenation); what evaluation harnesses send: both
prompts as one batch of token-id lists with `echo`, `max_tokens=0`, `logprobs=2` (scores
only), and the first with `echo`, `max_tokens=1`; and requests the server must refuse
(`top_logprobs` 21, `top_logprobs` without `logprobs`, `echo` with `stream`). Prints one JSON object; the Rust test
(crates/gds-serve/tests/it/openai.rs) checks the numbers against the model evaluated directly.
"""
import json
import sys

try:
    import openai
except ImportError:
    sys.exit("python package `openai` is missing: pip install openai (scripts/test.sh does)")

base, ids, ids2, message = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
model = client.models.list().data[0].id
out = {}

r = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, logprobs=3)
lp = r.choices[0].logprobs
out["completion"] = {"text": r.choices[0].text, "tokens": lp.tokens,
                     "token_logprobs": lp.token_logprobs, "top_logprobs": lp.top_logprobs,
                     "text_offset": lp.text_offset}

msgs = [{"role": "user", "content": message}]


def entries(content):
    return [{"token": c.token, "logprob": c.logprob, "bytes": c.bytes,
             "top": [[t.token, t.logprob] for t in c.top_logprobs]} for c in content]


r = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=msgs,
                                   logprobs=True, top_logprobs=3)
out["chat"] = {"text": r.choices[0].message.content,
               "logprobs": entries(r.choices[0].logprobs.content)}

text, streamed = "", []
for chunk in client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                            messages=msgs, stream=True, logprobs=True,
                                            top_logprobs=3):
    if not chunk.choices:
        continue
    c = chunk.choices[0]
    text += c.delta.content or ""
    if c.logprobs and c.logprobs.content:
        streamed += entries(c.logprobs.content)
out["chat_stream"] = {"text": text, "logprobs": streamed}

def scored(r):
    return [{"index": c.index, "text": c.text, "finish": c.finish_reason,
             "tokens": c.logprobs.tokens, "token_logprobs": c.logprobs.token_logprobs,
             "top_logprobs": c.logprobs.top_logprobs} for c in r.choices]


r = client.completions.create(model=model, prompt=[ids, ids2], max_tokens=0, echo=True,
                              logprobs=2, temperature=0)
out["echo"] = scored(r)
out["echo_usage"] = r.usage.model_dump()
r = client.completions.create(model=model, prompt=[ids], max_tokens=1, echo=True, logprobs=2,
                              temperature=0)
out["echo_one"] = scored(r)

refused = {}
for name, kw in [("top_logprobs_21", dict(logprobs=True, top_logprobs=21)),
                 ("no_logprobs_top", dict(top_logprobs=2))]:
    try:
        client.chat.completions.create(model=model, max_tokens=1, messages=msgs, **kw)
        refused[name] = None
    except openai.BadRequestError as e:
        refused[name] = {"status": e.status_code, "param": e.body.get("param") if isinstance(e.body, dict) else None}
out["refused"] = refused
# echo streamed: the prompt's entries come in the first chunk, the same as not streamed
tokens, lps = [], []
for chunk in client.completions.create(model=model, prompt=[ids], max_tokens=1, echo=True,
                                       logprobs=2, temperature=0, stream=True):
    for c in chunk.choices:
        if c.logprobs:
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
out["echo_stream"] = {"tokens": tokens, "token_logprobs": lps}
print(json.dumps(out))
