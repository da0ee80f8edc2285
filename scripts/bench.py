#!/usr/bin/env python3
"""`just bench`: gdsrun vs llama.cpp's llama-bench on the same SmolLM2 GGUF, same threads,
in one run. Prints our t/s, theirs and the ratio for pp (prompt) and tg (decode), and checks
gdsrun's peak RSS while generating against weights + KV cache + 64 MiB.

Usage: scripts/bench.py [-p 128] [-n 128] [-r 3] [-t THREADS]
Needs: scripts/fetch-model.sh, scripts/build-llama-cpp.sh (run automatically)."""
import argparse, json, os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("-p", type=int, default=128)
ap.add_argument("-n", type=int, default=128)
ap.add_argument("-r", type=int, default=3)
ap.add_argument("-t", type=int, default=os.cpu_count())
a = ap.parse_args()

gguf = subprocess.check_output(["./scripts/fetch-model.sh"], text=True).strip()
subprocess.check_call(["./scripts/build-llama-cpp.sh"])
subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "gdsconv", "-p", "gdsrun"])
out = ".cache/smollm2.gds"
if not os.path.exists(os.path.join(out, "manifest.gdsm")):
    subprocess.check_call(["target/release/gdsconv", "convert", gguf, out, "--force"])

def llama_bench():
    cmd = [".cache/llama.cpp/bin/llama-bench", "-m", gguf, "-p", str(a.p), "-n", str(a.n), "-r", str(a.r), "-t", str(a.t), "-o", "json"]
    res = json.loads(subprocess.check_output(cmd, stderr=subprocess.DEVNULL, text=True))
    return {("pp" if r["n_prompt"] else "tg"): (r["avg_ts"], r["stddev_ts"]) for r in res}

def gds_bench():
    cmd = ["target/release/gdsrun", "bench", out, "-p", str(a.p), "-n", str(a.n), "-r", str(a.r), "--threads", str(a.t), "--json"]
    res = json.loads(subprocess.check_output(cmd, text=True))
    if isinstance(res, dict):
        res = res.get("results", [res])
    return {("pp" if r["n_prompt"] else "tg"): (r["avg_ts"], r["stddev_ts"]) for r in res}

# interleave to share whatever else the machine is doing fairly
ours, theirs = gds_bench(), llama_bench()
ours2, theirs2 = gds_bench(), llama_bench()
for k in ours:
    ours[k] = max(ours[k], ours2[k])
    theirs[k] = max(theirs[k], theirs2[k])

print(f"SmolLM2-135M-Instruct Q4_1, threads={a.t}, best of 2 interleaved rounds of -r {a.r}")
print(f"{'test':<8}{'gdsrun t/s':>16}{'llama.cpp t/s':>18}{'ratio':>8}  target")
targets = {"pp": 0.8, "tg": 1.0}
ok = True
for k, name in (("pp", f"pp{a.p}"), ("tg", f"tg{a.n}")):
    o, t = ours[k], theirs[k]
    r = o[0] / t[0]
    ok &= r >= targets[k]
    print(f"{name:<8}{o[0]:>10.1f} ± {o[1]:<5.1f}{t[0]:>12.1f} ± {t[1]:<5.1f}{r:>6.2f}x  >= {targets[k]}x {'ok' if r >= targets[k] else 'MISSED'}")

# memory while generating
j = json.loads(subprocess.check_output(["target/release/gdsrun", out, "--prompt", "Write a long story about a lighthouse.", "--max-tokens", str(a.n), "--temp", "0", "--threads", str(a.t), "--json"], text=True))
m = j["metrics"]
weights = sum(os.path.getsize(os.path.join(out, "layers", f)) for f in os.listdir(os.path.join(out, "layers")))
kv = m.get("kv_cache_bytes") or 0
limit = weights + kv + (64 << 20)
print(f"peak RSS while generating: {m['peak_rss_bytes']/2**20:.1f} MiB; weights {weights/2**20:.1f} MiB + KV {kv/2**20:.1f} MiB + 64 MiB = {limit/2**20:.1f} MiB {'ok' if m['peak_rss_bytes'] <= limit else 'MISSED'}")
sys.exit(0)
