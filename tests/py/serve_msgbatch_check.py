#!/usr/bin/env python3
"""Anthropic's Message Batches API through `gdsrun serve` with the official `anthropic` client.

Usage: serve_msgbatch_check.py BASE_URL API_KEY

The server holds API_KEY (the batch's own requests must pass without it). Checks, each an
assertion:
- `messages.batches.create`: `in_progress` with every request `processing`; `retrieve` until
  `ended`, then `results_url` set and `request_counts` summed (a request without `max_tokens`
  `errored`);
- `results`: each `custom_id` once; every `succeeded` message equal to the same params sent
  to `messages.create` (text, stop reason, usage); the `errored` one carrying Anthropic's
  `invalid_request_error` naming the field;
- a long batch cancelled once it has answered one: `canceling`, then `ended` with `canceled` results for the requests
  not answered; deleting a running batch is refused, an ended one deleted (then a 404);
- `list`: newest first, `limit`, `after_id`, `before_id`;
- refusals at create: a duplicate `custom_id`, one with a space, a streamed request.
Prints one JSON summary.
"""
import json
import sys
import time

import anthropic

client = anthropic.Anthropic(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)


def params(i, **extra):
    p = {"model": "model", "max_tokens": 6, "temperature": 0,
         "messages": [{"role": "user", "content": f"Count to {i}."}]}
    p.update(extra)
    return p


def wait(bid, until=("ended",), timeout=300):
    t0 = time.time()
    while True:
        b = client.messages.batches.retrieve(bid)
        if b.processing_status in until:
            return b
        assert time.time() - t0 < timeout, b
        time.sleep(0.1)


summary = {}
reqs = [{"custom_id": f"r{i}", "params": params(i)} for i in range(3)]
no_max = params(7)
del no_max["max_tokens"]
reqs.append({"custom_id": "bad", "params": no_max})
b = client.messages.batches.create(requests=reqs)
assert b.type == "message_batch" and b.id.startswith("msgbatch_"), b
assert b.processing_status == "in_progress" and b.results_url is None, b
assert b.request_counts.processing == 4, b
b = wait(b.id)
c = b.request_counts
assert (c.processing, c.succeeded, c.errored, c.canceled) == (0, 3, 1, 0), c
assert b.ended_at and b.ended_at >= b.created_at and b.results_url, b
results = list(client.messages.batches.results(b.id))
assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in reqs), results
for r in results:
    if r.custom_id == "bad":
        assert r.result.type == "errored", r
        assert r.result.error.error.type == "invalid_request_error", r
        assert "max_tokens" in r.result.error.error.message, r
        continue
    assert r.result.type == "succeeded", r
    m = r.result.message
    p = params(int(r.custom_id[1:]))
    # (the client has no sampling fields: the API dropped them; the server takes them)
    direct = client.messages.create(**{k: v for k, v in p.items() if k != "temperature"},
                                    extra_body={"temperature": p["temperature"]})
    assert [x.text for x in m.content] == [x.text for x in direct.content], (m, direct)
    assert m.stop_reason == direct.stop_reason, (m, direct)
    assert m.usage.output_tokens == direct.usage.output_tokens, (m, direct)
    # (the prompt: what the prefix cache held and the rest)
    total = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)
    assert total(m.usage) == total(direct.usage), (m, direct)
summary["succeeded"], summary["errored"] = c.succeeded, c.errored

# --- cancel
long = [{"custom_id": f"L{i}", "params": params(100 + i, max_tokens=48)} for i in range(30)]
lb = client.messages.batches.create(requests=long)
try:
    client.messages.batches.delete(lb.id)
    raise AssertionError("a running batch was deleted")
except anthropic.BadRequestError:
    pass
t0 = time.time()
while client.messages.batches.retrieve(lb.id).request_counts.succeeded == 0:
    assert time.time() - t0 < 300
    time.sleep(0.05)
x = client.messages.batches.cancel(lb.id)
assert x.processing_status in ("canceling", "ended") and x.cancel_initiated_at, x
lb = wait(lb.id)
c = lb.request_counts
assert c.canceled > 0 and c.succeeded > 0 and c.processing == 0, c
assert c.succeeded + c.errored + c.canceled == 30, c
lr = list(client.messages.batches.results(lb.id))
assert sorted(r.custom_id for r in lr) == sorted(r["custom_id"] for r in long), lr
assert sum(r.result.type == "canceled" for r in lr) == c.canceled, lr
summary["canceled"] = c.canceled

# --- list: newest first, pages both ways
third = client.messages.batches.create(requests=reqs[:1])
wait(third.id)
ids = [x.id for x in client.messages.batches.list()]
assert ids[:3] == [third.id, lb.id, b.id], ids
page = client.messages.batches.list(limit=1)
assert [x.id for x in page.data] == [third.id] and page.has_more, page
page = client.messages.batches.list(limit=1, after_id=third.id)
assert [x.id for x in page.data] == [lb.id], page
page = client.messages.batches.list(limit=2, before_id=b.id)
assert [x.id for x in page.data] == [third.id, lb.id], page

# --- delete
d = client.messages.batches.delete(lb.id)
assert d.id == lb.id and d.type == "message_batch_deleted", d
try:
    client.messages.batches.retrieve(lb.id)
    raise AssertionError("a deleted batch is still there")
except anthropic.NotFoundError:
    pass

# --- refusals
for bad, words in [
    ([reqs[0], reqs[0]], "requests.1.custom_id"),
    ([{"custom_id": "a b", "params": params(1)}], "requests.0.custom_id"),
    ([{"custom_id": "s", "params": params(1, stream=True)}], "stream"),
]:
    try:
        client.messages.batches.create(requests=bad)
        raise AssertionError(f"accepted {bad}")
    except anthropic.BadRequestError as e:
        assert words in str(e), e
try:
    anthropic.Anthropic(base_url=sys.argv[1], api_key="wrong", max_retries=0).messages.batches.list()
    raise AssertionError("listed without the key")
except anthropic.AuthenticationError:
    pass

print(json.dumps(summary))
