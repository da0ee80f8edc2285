#!/usr/bin/env python3
"""`gdsrun serve --backend cuda --activations f32` against `--backend cpu --activations f32 --kv-dtype f32` on the
same model: the same concurrent greedy requests to both servers (so the GPU's batched, paged
pass runs several sequences at once), their texts and token counts compared, and the
aggregate decode rate of each; and the embeddings of the same texts (/v1/embeddings, mean
pooling), compared by cosine. Part of scripts/gpu-bringup.sh; prints one line per check.

    scripts/gpu-serve-check.py GDSRUN MODEL_DIR [--vram-budget BYTES] [--requests 6] [--tokens 32] [--ctx 1024]
"""
import argparse
import concurrent.futures as cf
import json
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "The history of the printing press",
    "Once upon a time, in a small village",
    "The capital of France is",
    "In mathematics, a prime number",
    "The quick brown fox",
    "Water boils at",
    "A list of three colors:",
    "The first law of thermodynamics",
]


def start(gdsrun, model, extra, ctx):
    p = subprocess.Popen(
        [gdsrun, "serve", model, "--port", "0", "--ctx", str(ctx), "--max-batch", "8",
         "--kv-budget", "64", "--kv-dtype", "f32"] + extra,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if "listening" not in line and "http://" not in line:
        p.kill()
        err = p.stderr.read()[-600:]
        raise RuntimeError(f"server did not start ({' '.join(extra)}): {line.strip()} {err}")
    addr = line.strip().split()[-1].replace("http://", "")
    return p, addr


def complete(addr, prompt, n):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        v = json.load(r)
    return v["choices"][0]["text"], v["usage"]["completion_tokens"]


def embed(addr, texts):
    body = json.dumps({"input": texts}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/embeddings", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return [d["embedding"] for d in json.load(r)["data"]]


def run_all(addr, prompts, n):
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        out = list(ex.map(lambda p: complete(addr, p, n), prompts))
    dt = time.perf_counter() - t0
    return out, sum(c for _, c in out) / dt


def metric(addr, name):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        for l in r.read().decode().splitlines():
            if l.startswith(name):
                return l
    return f"{name} missing"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gdsrun")
    ap.add_argument("model")
    ap.add_argument("--vram-budget",
                    help="bytes, or `streamed`: the one-sequence plan's minimum plus the 64 MiB KV "
                         "pool and 32 MiB of tables and scratch (blocks stream through the slots)")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024, help="the servers' context (the tiny fixtures have 256)")
    a = ap.parse_args()
    prompts = (PROMPTS * 4)[: a.requests]
    if a.vram_budget == "streamed":
        plan = subprocess.run([a.gdsrun, "run", a.model, "--raw", "-p", "x", "-n", "1", "--backend",
                               "cuda", "--plan"], capture_output=True, text=True)
        try:
            a.vram_budget = str(json.loads(plan.stdout)["gpu"]["min_budget_bytes"] + (96 << 20))
        except Exception as e:  # noqa: BLE001
            print(f"[serve cuda streamed] no plan: {e} {plan.stderr[-300:]}")
            return 0
    # f32 activations on both sides: the same arithmetic, so the replies must be equal (the
    # GPU's default int8 activations round as the CPU's q8 only for 32-value weight types)
    cuda_flags = ["--backend", "cuda", "--activations", "f32"] + (
        ["--vram-budget", a.vram_budget] if a.vram_budget else [])
    results, vectors = {}, {}
    for name, flags in [("cpu", ["--backend", "cpu", "--activations", "f32"]), ("cuda", cuda_flags)]:
        try:
            p, addr = start(a.gdsrun, a.model, flags, a.ctx)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"[serve {name}] {e}")
            continue
        try:
            complete(addr, "warm up", 2)
            out, tps = run_all(addr, prompts, a.tokens)
            results[name] = out
            print(f"[serve {name}] {len(out)} concurrent requests x {a.tokens} tokens: "
                  f"{tps:.1f} tokens/s aggregate; {metric(addr, 'gds_backend_info')}")
            try:
                vectors[name] = embed(addr, prompts)
            except Exception as e:  # noqa: BLE001
                print(f"[serve {name}] embeddings failed: {e}")
        except Exception as e:  # noqa: BLE001
            print(f"[serve {name}] failed: {e}")
        finally:
            p.kill()
            p.wait()
    if "cpu" in results and "cuda" in results:
        same = sum(1 for c, g in zip(results["cpu"], results["cuda"]) if c == g)
        print(f"[serve cuda vs cpu f32] {same}/{len(prompts)} replies identical (text and token count)")
        for (ct, _), (gt, _) in zip(results["cpu"], results["cuda"]):
            if ct != gt:
                print(f"  cpu:  {ct!r}\n  cuda: {gt!r}")
                break
    if "cpu" in vectors and "cuda" in vectors:
        cos = [sum(x * y for x, y in zip(c, g)) for c, g in zip(vectors["cpu"], vectors["cuda"])]
        print(f"[serve cuda vs cpu f32] embeddings of {len(cos)} texts: cosine min {min(cos):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
