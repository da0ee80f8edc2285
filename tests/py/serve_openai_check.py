#!/usr/bin/env python3
"""End-to-end check of `gdsrun serve` with the official `openai` client.

Usage: serve_openai_check.py BASE_URL   (e.g. http://127.0.0.1:8080/v1)

Runs completions, chat, streaming (both, with and without stream_options.include_usage), a
stop string (counted as finished, not cancelled), the same seed twice, a stream cancelled
after a few chunks, and a non-streamed request whose client hangs up; prints one JSON object with what it saw. The Rust test
(crates/gds-serve/tests/it/openai.rs) asserts on it.
"""
import json
import socket
import sys
import time
import urllib.request

try:
    import openai
except ImportError:
    sys.exit("python package `openai` is missing: pip install openai (scripts/test.sh does)")

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
out = {}

models = client.models.list()
out["models"] = [m.id for m in models.data]
model = out["models"][0]

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
out["completion"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                     "usage": r.usage.model_dump()}

r = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                   messages=[{"role": "system", "content": "You are terse."},
                                             {"role": "user", "content": "Say hello."}])
out["chat"] = {"text": r.choices[0].message.content, "role": r.choices[0].message.role,
               "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}

# streaming chat: chunks concatenate to the non-streamed answer (greedy); without
# stream_options no chunk has `usage`
pieces, finish, with_usage = [], None, 0
for ch in client.chat.completions.create(model=model, max_tokens=12, temperature=0, stream=True,
                                         messages=[{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": "Say hello."}]):
    with_usage += "usage" in ch.model_fields_set
    if ch.choices:
        if ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
out["chat_stream"] = {"text": "".join(pieces), "chunks": len(pieces), "finish": finish,
                      "chunks_with_usage": with_usage}

pieces, with_usage = [], 0
for ch in client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                    temperature=0, stream=True):
    with_usage += "usage" in ch.model_fields_set
    pieces.append(ch.choices[0].text)
out["completion_stream"] = {"text": "".join(pieces), "chunks": len(pieces),
                            "chunks_with_usage": with_usage}

# stream_options.include_usage (as OpenAI): every chunk has `usage: null` but one more, the
# last, with no choices and the usage
def usage_stream(chunks):
    chunks = list(chunks)
    last = chunks[-1]
    return {"text": "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta")
                            else c.choices[0].text for c in chunks if c.choices),
            "last_choices": len(last.choices),
            "usage": last.usage.model_dump() if last.usage else None,
            "others_usage_null": all("usage" in c.model_fields_set and c.usage is None
                                     for c in chunks[:-1]),
            "chunks_with_usage": sum(c.usage is not None for c in chunks)}
out["chat_stream_usage"] = usage_stream(client.chat.completions.create(
    model=model, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    messages=[{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "Say hello."}]))
out["completion_stream_usage"] = usage_stream(client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True,
    stream_options={"include_usage": True}))

def metric(name):
    text = urllib.request.urlopen(base.rsplit("/v1", 1)[0] + "/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None

def wait_until(cond, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline and not cond():
        time.sleep(0.1)

CANCELLED, FINISHED, RUNNING = ("gds_requests_cancelled_total", "gds_requests_finished_total",
                                "gds_requests_running")

# a stop string: take the greedy text and stop at a word from its middle. The engine learns
# of the end when the front end closes the request: finished, not cancelled.
full = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
wait_until(lambda: metric(RUNNING) == 0)
c0, f0 = metric(CANCELLED), metric(FINISHED)
r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
wait_until(lambda: metric(RUNNING) == 0 and metric(FINISHED) > f0)
out["stop"] = {"full": full.choices[0].text, "text": r.choices[0].text, "finish": r.choices[0].finish_reason,
               "cancelled_delta": metric(CANCELLED) - c0, "finished_delta": metric(FINISHED) - f0}

# the same seed twice (sampling, not greedy), and another seed
def sample(seed):
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=24,
                                     temperature=1.0, top_p=0.95, seed=seed).choices[0].text
out["seed"] = {"a": sample(1234), "b": sample(1234), "c": sample(99)}

# a cancelled stream: read a few chunks, close it, and watch the server's counters
before = metric("gds_requests_cancelled_total")
s = client.completions.create(model=model, prompt="Write a long story about a dragon.", max_tokens=2000,
                              temperature=0.7, stream=True, extra_body={"ignore_eos": True})
def read_and_close(s, n):
    """Reads `n` chunks of the stream `s`, then closes it (the client goes away)."""
    got = 0
    for _ in s:
        got += 1
        if got >= n:
            break
    s.close()
    return got


got = read_and_close(s, 3)
deadline = time.time() + 30
while time.time() < deadline:
    if metric("gds_requests_running") == 0 and metric("gds_requests_cancelled_total") > before:
        break
    time.sleep(0.2)
out["cancel"] = {"chunks": got, "cancelled_before": before,
                 "cancelled_after": metric("gds_requests_cancelled_total"),
                 "running": metric("gds_requests_running"),
                 "kv_used": metric("gds_kv_blocks_used"),
                 "kv_prefix": metric("gds_kv_blocks_prefix"),
                 "generated_total": metric("gds_generated_tokens_total")}

# a non-streamed request whose client hangs up while it runs: the engine drops it
host, port = base.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
before = metric(CANCELLED)
body = json.dumps({"model": model, "prompt": "Write a long story about a castle.", "max_tokens": 2000,
                   "temperature": 0.7, "ignore_eos": True}).encode()
sock = socket.create_connection((host, int(port)))
sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
wait_until(lambda: metric(RUNNING) == 1, 10)
running_before_hangup = metric(RUNNING)
generated_at_hangup = metric("gds_generated_tokens_total")
sock.close()
wait_until(lambda: metric(RUNNING) == 0 and metric(CANCELLED) > before)
out["hangup"] = {"running_before": running_before_hangup,
                 "cancelled_delta": metric(CANCELLED) - before,
                 "running": metric(RUNNING),
                 "generated_after_hangup": metric("gds_generated_tokens_total") - generated_at_hangup}

# several choices streamed (n > 1; several prompts): chunks carry their choice's index and
# concatenate, per index, to the answer not streamed; one usage chunk for all of them
def by_index(chunks, field):
    texts, finish, usage = {}, {}, []
    for ev in chunks:
        if ev.usage:
            usage.append(ev.usage.model_dump())
        for ch in ev.choices:
            piece = (ch.delta.content if field == "delta" else ch.text) or ""
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return {"texts": [texts[i] for i in sorted(texts)], "finish": [finish.get(i) for i in sorted(texts)],
            "usage": usage}
kw = dict(model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=10,
          temperature=0.9, seed=5, n=3)
whole = client.chat.completions.create(**kw)
streamed = by_index(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw), "delta")
out["chat_stream_n"] = {"whole": [c.message.content for c in whole.choices],
                        "whole_usage": whole.usage.model_dump(), **streamed}
kw = dict(model=model, prompt=["The sky is", "One, two,"], max_tokens=8, temperature=0.7, seed=3, n=2)
whole = client.completions.create(**kw)
streamed = by_index(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw), "text")
out["completion_stream_prompts"] = {"whole": [c.text for c in whole.choices],
                                    "whole_usage": whole.usage.model_dump(), **streamed}
# echo streamed: the prompt first, with its tokens' log-probabilities
kw = dict(model=model, prompt="Hello there", max_tokens=4, temperature=0, echo=True, logprobs=1)
whole = client.completions.create(**kw)
text, tokens = "", []
for ev in client.completions.create(stream=True, **kw):
    for ch in ev.choices:
        text += ch.text
        tokens += ch.logprobs.tokens if ch.logprobs else []
out["echo_stream"] = {"whole": whole.choices[0].text, "whole_tokens": whole.choices[0].logprobs.tokens,
                      "text": text, "tokens": tokens}
# a stream of three choices closed after a few chunks: all three are dropped
before = metric(CANCELLED)
s = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a long story."}],
                                   max_tokens=2000, temperature=0.7, n=3, stream=True,
                                   extra_body={"ignore_eos": True})
read_and_close(s, 6)
wait_until(lambda: metric(RUNNING) == 0 and metric(CANCELLED) >= before + 3)
out["cancel_n"] = {"cancelled_delta": metric(CANCELLED) - before, "running": metric(RUNNING)}

# embeddings through the client (it asks for base64 and decodes it): one vector per input,
# unit length, the same text the same vector
e = client.embeddings.create(model=model, input=["The sky is blue.", "Hello", "The sky is blue."])
vecs = [d.embedding for d in e.data]
out["embeddings"] = {"n": len(vecs), "dims": [len(v) for v in vecs],
                     "norms": [sum(x * x for x in v) for v in vecs],
                     "same": sum(a * b for a, b in zip(vecs[0], vecs[2])),
                     "other": sum(a * b for a, b in zip(vecs[0], vecs[1])),
                     "usage": e.usage.model_dump()}

# predicted outputs: the client's typed `prediction`; the same text, the guesses counted in
# usage.completion_tokens_details
kw = dict(model=model, max_tokens=24, temperature=0,
          messages=[{"role": "user", "content": "Count from one to ten in words."}])
plain = client.chat.completions.create(**kw)
predicted = client.chat.completions.create(
    prediction={"type": "content", "content": plain.choices[0].message.content}, **kw)
d = predicted.usage.completion_tokens_details
out["prediction"] = {"same": predicted.choices[0].message.content == plain.choices[0].message.content,
                     "accepted": d.accepted_prediction_tokens,
                     "rejected": d.rejected_prediction_tokens,
                     "completion_tokens": predicted.usage.completion_tokens}

# the Models API: the served model retrieved, another a 404 with OpenAI's code
got = client.models.retrieve(model)
try:
    client.models.retrieve("no-such-model")
    missing = None
except openai.NotFoundError as e:
    missing = {"status": e.status_code, "body": e.body}
out["model_retrieve"] = {"id": got.id, "object": got.object, "missing": missing}

# errors come back in OpenAI's format
try:
    client.completions.create(model=model, prompt="x", max_tokens=-3)
    out["bad_request"] = None
except openai.BadRequestError as e:
    out["bad_request"] = {"status": e.status_code, "body": e.body}

print(json.dumps(out))
