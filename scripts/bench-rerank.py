#!/usr/bin/env python3
"""gdsrun serve vs llama.cpp's llama-server --rerank on the same Qwen3-Reranker GGUF, same
threads: documents reranked per second for one request of N documents (what a retrieval
pipeline sends after its vector search), one server at a time, rounds interleaved (A, B, A,
B, ...). Also prints how far the two servers' scores are apart and whether they rank alike.

The model is a random-weight checkpoint of Qwen3-Reranker-0.6B's shape made by transformers
(scripts/synth-model.py qwen3-reranker-0.6b, with SmolLM2's tokenizer), its GGUF by llama.cpp's
converter, quantized by llama-quantize (default Q8_0, as the reranker GGUFs people run):
compute and I/O are the real model's; the scores are noise, but both servers compute the same
noise.

Usage: scripts/bench-rerank.py [-t THREADS] [--docs 32] [--words 100] [--rounds 3]
                               [--quant Q8_0] [--bin target/release/gdsrun]
Needs: scripts/build-llama-cpp.sh, torch + transformers (for the model, made once into
.cache/synth/)."""
import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import WORDS, free_port, stop, synth_model, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
ap.add_argument("--docs", type=int, default=32, help="documents in the request")
ap.add_argument("--words", type=int, default=100, help="words per document")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--quant", default="Q8_0")
ap.add_argument("--bin", default="target/release/gdsrun")
a = ap.parse_args()

gguf, gds = synth_model("qwen3-reranker-0.6b", a.quant, os.path.join(os.path.dirname(a.bin), "gdsconv"))

rng = random.Random(7)
docs = [" ".join(rng.choice(WORDS) for _ in range(a.words)).capitalize() + "." for _ in range(a.docs)]


def post(url, query):
    # the query comes before the document in the prompt: a query of its own per request
    # keeps both servers' prompt caches from answering a repeated request
    body = json.dumps({"query": query, "documents": docs}).encode()
    req = urllib.request.Request(url + "/rerank", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.load(r)


def measure(name, cmd, port):
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/bench-rerank-{name}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, p, timeout=300)
        post(url, "Warm up: which documents mention a cache?")  # weights paged in, buffers grown
        t0 = time.perf_counter()
        r = post(url, "How does a server stream model layers from disk?")
        return time.perf_counter() - t0, r
    finally:
        stop(p, 10)


def ours(port):
    return [a.bin, "serve", gds, "--port", str(port), "--threads", str(a.threads), "--ctx", "2048"]


def theirs(port):
    # four slots of 2048 positions; a batch as large as a whole prompt (a rank needs it in one)
    return [".cache/llama.cpp/bin/llama-server", "-m", gguf, "--rerank", "--host", "127.0.0.1",
            "--port", str(port), "-t", str(a.threads), "-np", "4", "-c", "8192", "-b", "2048",
            "-ub", "2048", "--no-webui"]


rows = []
for i in range(a.rounds):
    for name, cmd in (("gdsrun", ours), ("llama-server", theirs)):
        port = free_port()
        secs, r = measure(name, cmd(port), port)
        rows.append((name, i, secs, r))
        print(f"round {i} {name:12} {secs:7.2f} s  {a.docs / secs:6.2f} docs/s  "
              f"{r['usage']['prompt_tokens']} prompt tokens", flush=True)


def best(name):
    return min(s for n, _, s, _ in rows if n == name)


g, l = best("gdsrun"), best("llama-server")
rg = {x["index"]: x["relevance_score"] for x in next(r for n, _, _, r in rows if n == "gdsrun")["results"]}
rl = {x["index"]: x["relevance_score"] for x in next(r for n, _, _, r in rows if n == "llama-server")["results"]}
order = lambda d: sorted(d, key=lambda k: -d[k])
top = min(5, a.docs)
print(json.dumps({
    "model": f"Qwen3-Reranker-0.6B shape (random weights), {a.quant} GGUF",
    "threads": a.threads, "documents": a.docs, "words": a.words,
    "prompt_tokens": rows[0][3]["usage"]["prompt_tokens"],
    "gdsrun_s": round(g, 3), "llama_server_s": round(l, 3),
    "gdsrun_docs_per_s": round(a.docs / g, 2), "llama_server_docs_per_s": round(a.docs / l, 2),
    "ratio": round(l / g, 3),
    "max_abs_score_diff": max(abs(rg[k] - rl[k]) for k in rg),
    "same_top": order(rg)[:top] == order(rl)[:top],
}))
