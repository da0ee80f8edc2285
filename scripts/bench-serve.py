#!/usr/bin/env python3
"""`just bench-serve`: gdsrun serve vs llama.cpp's llama-server on the same SmolLM2 GGUF,
same threads, same load (tests/py/serve_load.py, loopback only), one server at a time.
Prints aggregate decode t/s and latency percentiles side by side per concurrency, and the
ratio at the highest concurrency (target: >= 1.0x). Then gdsrun again at the highest
concurrency with every request under a JSON schema (structured outputs), against the same
load without one (target: >= 0.9x). The schema asks for more JSON than --max-tokens
allows, so constrained replies are as long as the others.

Usage: scripts/bench-serve.py [-t THREADS] [-c 1,4,16] [-n REQUESTS] [--max-tokens 64]
Needs: scripts/fetch-model.sh, scripts/build-llama-cpp.sh (run automatically)."""
import argparse, json, os, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, run_load, stop, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
ap.add_argument("-c", "--concurrency", default="1,4,16")
ap.add_argument("-n", "--requests", type=int, default=32, help="requests per concurrency level")
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--ctx", type=int, default=512, help="context per request")
ap.add_argument("--time-limit", type=float, default=300, help="seconds per server")
a = ap.parse_args()
max_c = max(int(x) for x in a.concurrency.split(","))

gguf = subprocess.check_output(["./scripts/fetch-model.sh"], text=True).strip()
subprocess.check_call(["./scripts/build-llama-cpp.sh"])
subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "gdsconv", "-p", "gdsrun"])
out = ".cache/smollm2.gds"
if not os.path.exists(os.path.join(out, "manifest.gdsm")):
    subprocess.check_call(["target/release/gdsconv", "convert", gguf, out, "--force"])


def measure(name, cmd, port, concurrency=None, extra=()):
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/bench-serve-{name}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(url, p)
        except RuntimeError as e:
            sys.exit(str(e))
        try:
            return run_load(url, concurrency or a.concurrency, a.requests, a.max_tokens, a.time_limit, extra)
        except RuntimeError as e:
            sys.exit(f"{name}: {e}")
    finally:
        stop(p, 10)


port = free_port()
ours = measure("gdsrun", ["target/release/gdsrun", "serve", out, "--port", str(port),
                          "--threads", str(a.threads), "--ctx", str(a.ctx),
                          "--max-batch", str(max_c)], port)
POEM = {"type": "json_schema", "json_schema": {"name": "poem", "schema": {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "lines": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["title", "lines"], "additionalProperties": False}}}
port = free_port()
constrained = measure("gdsrun-json", ["target/release/gdsrun", "serve", out, "--port", str(port),
                                      "--threads", str(a.threads), "--ctx", str(a.ctx),
                                      "--max-batch", str(max_c)], port, str(max_c),
                      ["--response-format", json.dumps(POEM)])
port = free_port()
theirs = measure("llama", [".cache/llama.cpp/bin/llama-server", "-m", gguf, "--host", "127.0.0.1",
                           "--port", str(port), "-t", str(a.threads), "-np", str(max_c),
                           "-c", str(a.ctx * max_c), "--cont-batching", "--no-webui"], port)

print(f"SmolLM2-135M-Instruct Q4_1, threads={a.threads}, {a.requests} requests per level, "
      f"{a.max_tokens} tokens each (ignore_eos), loopback")
print(f"{'conc':>4} | {'gdsrun t/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'fail':>4} | "
      f"{'llama t/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'fail':>4} | ratio")
fmt = lambda v: f"{v:8.0f}" if v is not None else f"{'-':>8}"
ratio = None
missing = {"decode_tps": 0.0, "failed": "-", "latency_ms": {"p50": None, "p90": None, "p99": None}}
for c in [int(x) for x in a.concurrency.split(",")]:
    o = next((l for l in ours["levels"] if l["concurrency"] == c), missing)
    t = next((l for l in theirs["levels"] if l["concurrency"] == c), missing)
    ratio = o["decode_tps"] / t["decode_tps"] if t["decode_tps"] else float("nan")
    lo, lt = o["latency_ms"], t["latency_ms"]
    print(f"{c:>4} | {o['decode_tps']:>10.1f} {fmt(lo['p50'])} {fmt(lo['p90'])} {fmt(lo['p99'])} {o['failed']:>4} | "
          f"{t['decode_tps']:>10.1f} {fmt(lt['p50'])} {fmt(lt['p90'])} {fmt(lt['p99'])} {t['failed']:>4} | {ratio:.2f}x")
for name, r in (("gdsrun", ours), ("llama-server", theirs)):
    if r.get("time_limit_reached"):
        print(f"{name}: time limit reached, levels without numbers were not run")
ok = ratio is not None and ratio >= 1.0
print(f"aggregate throughput at concurrency {max_c}: {ratio:.2f}x llama-server (target >= 1.0x) "
      f"{'ok' if ok else 'MISSED'}")
plain = next((l for l in ours["levels"] if l["concurrency"] == max_c), missing)
js = next((l for l in constrained["levels"] if l["concurrency"] == max_c), missing)
jr = js["decode_tps"] / plain["decode_tps"] if plain["decode_tps"] else float("nan")
print(f"structured outputs (JSON schema) at concurrency {max_c}: {js['decode_tps']:.1f} t/s, "
      f"{js['failed']} failed, {jr:.2f}x the same load without a schema (target >= 0.9x) "
      f"{'ok' if jr >= 0.9 and js['failed'] == 0 else 'MISSED'}")
