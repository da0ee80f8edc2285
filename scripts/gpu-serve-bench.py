#!/usr/bin/env python3
"""The server on the GPU against llama-server on the same GGUF (issue 31's GPU target):
`gdsrun serve --backend cuda` on a converted model, then llama.cpp's `llama-server` (a CUDA
build) on the GGUF it was converted from, one server at a time, each driven by
tests/py/serve_load.py (loopback; exactly --max-tokens tokens per request, ignore_eos) at each
concurrency level. Prints one line per server (aggregate t/s per level) and the ratios.

    scripts/gpu-serve-bench.py --gdsrun G --model DIR [--vram-budget BYTES] [--kv-budget MIB]
        [--llama-server PATH --gguf FILE [--ngl N] [--llama-lib DIR]]
        [-c 1,4,16,64] [--max-tokens 64] [--label TEXT] [--backend cuda]

Each level sends max(4, 2 x concurrency) requests. With --vram-budget, gdsrun streams the
blocks that do not fit; llama-server's answer to the same VRAM is --ngl (layers on the GPU,
the rest on the CPU). Needs nothing beyond the standard library (and scripts/benchlib.py)."""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, run_load, stop, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(name, cmd, port, levels, max_tokens, time_limit, env=None):
    """t/s per level ({level: t/s or an error string}); the server's log in /tmp."""
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/gpu-serve-bench-{name}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    res = {}
    try:
        try:
            wait_healthy(url, p, timeout=300)
        except RuntimeError as e:
            return {c: f"no server ({e}; log /tmp/gpu-serve-bench-{name}.log)" for c in levels}
        for c in levels:
            try:
                r = run_load(url, str(c), max(4, 2 * c), max_tokens, time_limit)
                if not r["levels"]:
                    res[c] = "time limit reached before the level ran"
                    continue
                lv = r["levels"][0]
                res[c] = lv["decode_tps"]
                if lv["failed"]:
                    res[c] = f"{lv['decode_tps']} ({lv['failed']} failed: {lv['errors'][:1]})"
            except (RuntimeError, KeyError, IndexError) as e:
                res[c] = f"error: {e}"
    finally:
        stop(p, 10)
    return res


def fmt(v):
    return f"{v:.1f}" if isinstance(v, (int, float)) else str(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gdsrun", required=True)
    ap.add_argument("--model", required=True, help="the converted model directory")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--vram-budget", help="bytes; default: all resident")
    ap.add_argument("--kv-budget", type=int, default=8192, help="MiB of KV pool (f32 on the GPU)")
    ap.add_argument("--llama-server")
    ap.add_argument("--gguf", help="the GGUF the model was converted from (llama-server's input)")
    ap.add_argument("--ngl", default="99", help="llama-server's --n-gpu-layers")
    ap.add_argument("--llama-lib", help="directory of llama.cpp's shared libraries")
    ap.add_argument("-c", "--concurrency", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256, help="context per request")
    ap.add_argument("--time-limit", type=float, default=120, help="seconds per level")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    os.chdir(ROOT)  # serve_load.py is found relative to the repository
    levels = [int(x) for x in a.concurrency.split(",")]
    top = max(levels)
    tag = f"serve-bench {a.label}".strip()

    port = free_port()
    cmd = [a.gdsrun, "serve", a.model, "--port", str(port), "--backend", a.backend, "--ctx",
           str(a.ctx), "--max-batch", str(top), "--kv-budget", str(a.kv_budget)]
    if a.vram_budget:
        cmd += ["--vram-budget", str(a.vram_budget)]
    ours = measure("gdsrun", cmd, port, levels, a.max_tokens, a.time_limit)
    where = f"--vram-budget {a.vram_budget}" if a.vram_budget else "all resident"
    print(f"[{tag}] gdsrun serve --backend {a.backend} ({where}): "
          + ", ".join(f"c={c}: {fmt(ours[c])} t/s" for c in levels), flush=True)

    if not (a.llama_server and a.gguf):
        return
    env = dict(os.environ)
    if a.llama_lib:
        env["LD_LIBRARY_PATH"] = a.llama_lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    port = free_port()
    cmd = [a.llama_server, "-m", a.gguf, "--port", str(port), "--host", "127.0.0.1",
           "-ngl", str(a.ngl), "-np", str(top), "-c", str(a.ctx * top), "--cont-batching"]
    theirs = measure("llama-server", cmd, port, levels, a.max_tokens, a.time_limit, env)
    print(f"[{tag}] llama-server -ngl {a.ngl}: "
          + ", ".join(f"c={c}: {fmt(theirs[c])} t/s" for c in levels), flush=True)
    ratios = []
    for c in levels:
        x, y = ours[c], theirs[c]
        ok = isinstance(x, (int, float)) and isinstance(y, (int, float)) and y > 0
        ratios.append(f"c={c}: {x / y:.2f}x" if ok else f"c={c}: -")
    print(f"[{tag}] gdsrun / llama-server: " + ", ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
