#!/usr/bin/env python3
"""OpenAI's Files and Batch APIs through `gdsrun serve` with the official `openai` client.

Usage: serve_batch_check.py BASE_URL API_KEY SMALL_BASE_URL

BASE_URL serves with --api-key API_KEY (the batch's own requests must pass without it);
SMALL_BASE_URL serves the same model with a small --file-storage. Checks, each an assertion:
- `files.create` (purpose batch) then `retrieve`, `list(purpose=...)`, `content`: the bytes
  as sent;
- a chat batch: `completed`, `request_counts` (one line the server answers 400 counted
  failed), each `custom_id` once across the output and error files, every 2xx body equal to
  the same request sent directly (temperature 0: text and usage), the batch's `usage` the sum
  of its bodies', `metadata` kept; a completions batch the same way;
- a file with bad lines (not JSON, a duplicate custom_id, another url): the batch `failed`
  with every bad line named in `errors` and nothing run;
- a long batch: a client's own request is answered while it runs; `cancel` gives
  `cancelling` then `cancelled` with fewer than all lines answered;
- `batches.list`: newest first, `limit` and `after`;
- refusals: an unknown file, a file of another purpose, another endpoint or window;
- the small storage: an upload that does not fit is a 413; a batch whose results outgrow it
  ends `failed` (`storage_full`) with the results that fit in its file;
- `files.delete`, then a 404.
Prints one JSON summary.
"""
import io
import json
import sys
import threading
import time

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
small = OpenAI(base_url=sys.argv[3], api_key="none", max_retries=0)
M = "model"


def upload(c, lines, purpose="batch"):
    data = "".join(json.dumps(l) + "\n" for l in lines).encode()
    return c.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose=purpose), data


def wait(c, bid, until=("completed", "failed", "cancelled", "expired"), timeout=300):
    t0 = time.time()
    while True:
        b = c.batches.retrieve(bid)
        if b.status in until:
            return b
        assert time.time() - t0 < timeout, b
        time.sleep(0.1)


def lines_of(c, fid):
    if fid is None:
        return []
    return [json.loads(l) for l in c.files.content(fid).text.splitlines()]


def chat_line(i, **extra):
    body = {"model": M, "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 6, "temperature": 0, **extra}
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


summary = {}

# --- files
reqs = [chat_line(i) for i in range(5)] + [chat_line(9, max_tokens=-1)]
f, data = upload(client, reqs)
assert f.purpose == "batch" and f.bytes == len(data) and f.filename == "requests.jsonl", f
assert client.files.retrieve(f.id).id == f.id
assert client.files.content(f.id).content == data
assert f.id in [x.id for x in client.files.list(purpose="batch")]
assert f.id not in [x.id for x in client.files.list(purpose="vision")]

# --- a chat batch
b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                          completion_window="24h", metadata={"job": "nightly"})
assert b.status in ("validating", "in_progress", "finalizing", "completed"), b
assert b.metadata == {"job": "nightly"} and b.input_file_id == f.id, b
b = wait(client, b.id)
assert b.status == "completed", b
assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (6, 5, 1), b
assert b.completed_at >= b.in_progress_at >= b.created_at, b
out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
ids = sorted(l["custom_id"] for l in out + err)
assert ids == sorted(r["custom_id"] for r in reqs), ids
assert [l["custom_id"] for l in err] == ["chat-9"] and err[0]["response"]["status_code"] == 400, err
assert "max_tokens" in json.dumps(err[0]["response"]["body"]), err
out_tokens = 0
for l in out:
    assert l["response"]["status_code"] == 200 and l["error"] is None and l["id"].startswith("batch_req_"), l
    i = int(l["custom_id"].split("-")[1])
    direct = client.chat.completions.create(**chat_line(i)["body"])
    body = l["response"]["body"]
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content, (body, direct)
    assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens, (body, direct)
    assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens, (body, direct)
    out_tokens += body["usage"]["completion_tokens"]
assert b.usage.output_tokens == out_tokens, (b.usage, out_tokens)
assert b.usage.input_tokens == sum(l["response"]["body"]["usage"]["prompt_tokens"] for l in out), b.usage
out_file = client.files.retrieve(b.output_file_id)
assert out_file.purpose == "batch_output" and out_file.filename == f"batch_{b.id}_output.jsonl", out_file
summary["chat"] = b.request_counts.completed

# --- a completions batch
creqs = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
          "body": {"model": M, "prompt": f"The number {i} is", "max_tokens": 5, "temperature": 0}}
         for i in range(3)]
cf, _ = upload(client, creqs)
cb = wait(client, client.batches.create(input_file_id=cf.id, endpoint="/v1/completions",
                                        completion_window="24h").id)
assert cb.status == "completed" and cb.error_file_id is None, cb
for l in lines_of(client, cb.output_file_id):
    direct = client.completions.create(**next(r["body"] for r in creqs if r["custom_id"] == l["custom_id"]))
    assert l["response"]["body"]["choices"][0]["text"] == direct.choices[0].text, (l, direct)
summary["completions"] = cb.request_counts.completed

# --- a file with bad lines: failed, every bad line named, nothing run
bad_data = (json.dumps(chat_line(1)) + "\n{not json\n" + json.dumps(chat_line(1)) + "\n"
            + json.dumps({**creqs[0], "custom_id": "other"}) + "\n").encode()
bf = client.files.create(file=("bad.jsonl", io.BytesIO(bad_data)), purpose="batch")
bb = wait(client, client.batches.create(input_file_id=bf.id, endpoint="/v1/chat/completions",
                                        completion_window="24h").id)
assert bb.status == "failed" and bb.failed_at, bb
errs = bb.errors.data
assert [(e.line, e.code) for e in errs] == [(2, "invalid_json"), (3, "duplicate_custom_id"), (4, "invalid_request")], errs
assert "endpoint" in errs[2].message, errs
assert bb.request_counts.completed == 0 and bb.output_file_id is None, bb
summary["bad_lines"] = len(errs)

# --- a long batch: a client's request is answered while it runs; then cancelled
long = [chat_line(100 + i, max_tokens=48) for i in range(40)]
lf, _ = upload(client, long)
lb = client.batches.create(input_file_id=lf.id, endpoint="/v1/chat/completions", completion_window="24h")
wait(client, lb.id, until=("in_progress",))
t0 = time.time()
mine = client.chat.completions.create(**chat_line(1)["body"])
mine_s = time.time() - t0
assert mine.choices[0].message.content, mine
during = client.batches.retrieve(lb.id)
assert during.status == "in_progress", during
c = client.batches.cancel(lb.id)
assert c.status in ("cancelling", "cancelled") and c.cancelling_at, c
lb = wait(client, lb.id)
assert lb.status == "cancelled" and lb.cancelled_at, lb
done = lb.request_counts.completed + lb.request_counts.failed
assert done < 40 and lb.request_counts.total == 40, lb
assert len(lines_of(client, lb.output_file_id)) == lb.request_counts.completed, lb
try:
    client.batches.cancel(b.id)
    raise AssertionError("a completed batch was cancelled")
except openai.BadRequestError:
    pass
summary["cancelled_after"] = done
summary["client_request_s"] = round(mine_s, 2)

# --- listing: newest first, pages
listed = [x.id for x in client.batches.list()]
assert listed[:4] == [lb.id, bb.id, cb.id, b.id], listed
page = client.batches.list(limit=2)
assert [x.id for x in page.data] == [lb.id, bb.id] and page.has_more, page
page2 = client.batches.list(limit=2, after=bb.id)
assert [x.id for x in page2.data] == [cb.id, b.id], page2

# --- refusals
for kw, err in [
    (dict(input_file_id="file-nope", endpoint="/v1/chat/completions"), openai.NotFoundError),
    (dict(input_file_id=f.id, endpoint="/v1/moderations"), openai.BadRequestError),
]:
    try:
        client.batches.create(completion_window="24h", **kw)
        raise AssertionError(f"accepted {kw}")
    except err:
        pass
try:
    client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    raise AssertionError("accepted a 1h window")
except openai.BadRequestError as e:
    assert "completion_window" in str(e), e
vf, _ = upload(client, reqs, purpose="vision")
try:
    client.batches.create(input_file_id=vf.id, endpoint="/v1/chat/completions", completion_window="24h")
    raise AssertionError("accepted a vision file")
except openai.BadRequestError as e:
    assert "purpose" in str(e), e
try:
    client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="nonsense")
    raise AssertionError("accepted a purpose")
except openai.BadRequestError:
    pass
try:
    OpenAI(base_url=sys.argv[1], api_key="wrong", max_retries=0).batches.list()
    raise AssertionError("listed without the key")
except openai.AuthenticationError:
    pass

# --- the small storage
try:
    small.files.create(file=("big.jsonl", io.BytesIO(b" " * 9000)), purpose="batch")
    raise AssertionError("a file larger than the storage was kept")
except openai.APIStatusError as e:
    assert e.status_code == 413, e
sf, _ = upload(small, [chat_line(i, max_tokens=16) for i in range(6)])
sb = wait(small, small.batches.create(input_file_id=sf.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id)
assert sb.status == "failed" and sb.errors.data[0].code == "storage_full", sb
kept = lines_of(small, sb.output_file_id)
assert 0 < len(kept) < 6 and len(kept) == sb.request_counts.completed, (sb, len(kept))
summary["small_kept"] = len(kept)

# --- delete
for fid in (f.id, b.output_file_id):
    d = client.files.delete(fid)
    assert d.deleted and d.id == fid, d
    try:
        client.files.retrieve(fid)
        raise AssertionError("a deleted file is still there")
    except openai.NotFoundError:
        pass

print(json.dumps(summary))
