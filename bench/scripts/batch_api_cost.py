#!/usr/bin/env python3
"""The server's Batch API against the same requests sent by clients and run by `gdsrun batch`,
and what a running batch costs a client's request.

Usage: batch_api_cost.py GDSRUN MODEL_DIR [--requests 64] [--max-tokens 64] [--rounds 2]

Starts `GDSRUN serve MODEL_DIR` (2 threads, --max-batch 16) on a free port and, each round,
interleaved:
- batch: the requests uploaded and run as one OpenAI batch (`/v1/files` + `/v1/batches`),
  seconds from create to `completed`;
- clients: the same bodies posted directly by 32 concurrent clients (the batch's default
  concurrency, twice --max-batch), seconds for all;
- cli: the same lines through `GDSRUN batch` (its own summary's seconds: after the model is
  loaded);
- a client beside a batch: 8 short streamed chat requests one after another, time to the first
  token and to the end, on an idle server and while a batch runs (median of each).
Prints one line per measurement and the ratios (batch / clients, cli / clients).
Standard library only; greedy requests with `ignore_eos`, so every request makes
--max-tokens tokens.
"""
import argparse
import concurrent.futures
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

ap = argparse.ArgumentParser()
ap.add_argument("gdsrun")
ap.add_argument("model")
ap.add_argument("--requests", type=int, default=64)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--rounds", type=int, default=2)
a = ap.parse_args()

srv = subprocess.Popen([a.gdsrun, "serve", a.model, "--port", "0", "--threads", "2", "--ctx", "1024",
                        "--max-batch", "16"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
base = srv.stdout.readline().strip().rsplit("http://", 1)[1]
base = f"http://{base}"


def call(method, path, body=None, ctype="application/json"):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    r = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": ctype})
    with urllib.request.urlopen(r, timeout=600) as resp:
        raw = resp.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw


def body(i):
    return {"messages": [{"role": "user", "content": f"Write about the number {i}."}],
            "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}


lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)}
         for i in range(a.requests)]
jsonl = "".join(json.dumps(l) + "\n" for l in lines).encode()


def run_batch():
    b = "b" + uuid.uuid4().hex
    form = (f"--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n").encode() \
        + jsonl + f"\r\n--{b}--\r\n".encode()
    f = call("POST", "/v1/files", form, f"multipart/form-data; boundary={b}")
    t0 = time.time()
    bt = call("POST", "/v1/batches", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                      "completion_window": "24h"})
    return t0, bt["id"]


def wait_batch(bid):
    while True:
        bt = call("GET", f"/v1/batches/{bid}")
        if bt["status"] in ("completed", "failed", "cancelled"):
            assert bt["status"] == "completed" and bt["request_counts"]["failed"] == 0, bt
            return bt
        time.sleep(0.05)


def clients():
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        list(ex.map(lambda i: call("POST", "/v1/chat/completions", body(i)), range(a.requests)))
    return time.time() - t0


def cli():
    with tempfile.TemporaryDirectory() as d:
        inp, out = f"{d}/in.jsonl", f"{d}/out.jsonl"
        open(inp, "wb").write(jsonl)
        r = subprocess.run([a.gdsrun, "batch", a.model, "-i", inp, "-o", out, "--threads", "2",
                            "--ctx", "1024", "--max-batch", "16", "--quiet"],
                           capture_output=True, text=True, check=True)
        return float(re.search(r"tokens in ([0-9.]+) s", r.stderr).group(1))


def probe():
    """8 short streamed chats one after another: (median first-token s, median total s)."""
    firsts, totals = [], []
    for i in range(8):
        b = {"messages": [{"role": "user", "content": f"Say hi {i}."}], "max_tokens": 8,
             "temperature": 0, "stream": True}
        r = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(b).encode(),
                                   headers={"Content-Type": "application/json"})
        t0, first = time.time(), None
        with urllib.request.urlopen(r, timeout=600) as resp:
            for line in resp:
                if first is None and line.startswith(b"data: {"):
                    ch = json.loads(line[6:])["choices"]
                    if ch and ch[0]["delta"].get("content"):
                        first = time.time() - t0
        firsts.append(first if first is not None else time.time() - t0)
        totals.append(time.time() - t0)
    return statistics.median(firsts), statistics.median(totals)


tokens = a.requests * a.max_tokens
try:
    call("POST", "/v1/chat/completions", body(0))  # warm-up
    for rnd in range(a.rounds):
        t0, bid = run_batch()
        wait_batch(bid)
        tb = time.time() - t0
        tc = clients()
        tl = cli()
        print(f"round {rnd}: {a.requests} requests x {a.max_tokens} tokens | batch API {tb:.1f} s "
              f"({tokens / tb:.1f} tok/s) | clients {tc:.1f} s ({tokens / tc:.1f} tok/s) | "
              f"gdsrun batch {tl:.1f} s ({tokens / tl:.1f} tok/s) | batch/clients {tc / tb:.2f}x, "
              f"cli/clients {tc / tl:.2f}x (throughput)")
        idle = probe()
        _, bid = run_batch()
        while call("GET", f"/v1/batches/{bid}")["status"] != "in_progress":
            time.sleep(0.02)
        busy = probe()
        done = call("GET", f"/v1/batches/{bid}")
        still = done["status"] == "in_progress"
        call("POST", f"/v1/batches/{bid}/cancel")
        print(f"round {rnd}: a client's 8-token streamed chat, median of 8: idle first token "
              f"{idle[0] * 1000:.0f} ms, whole {idle[1] * 1000:.0f} ms | beside a batch "
              f"first token {busy[0] * 1000:.0f} ms, whole {busy[1] * 1000:.0f} ms"
              f"{'' if still else ' (the batch ended before the probe did)'}")
finally:
    srv.kill()
