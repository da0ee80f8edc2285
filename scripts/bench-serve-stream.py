#!/usr/bin/env python3
"""`just bench-serve-stream`: the server streaming a model bigger than its memory budget.

One run, one machine, one model: `gdsrun serve` (continuous batching) at concurrency 1, 4,
16 and 64 with the model (a) in memory, (b) at a quarter of its weights (`--io direct
--mem-budget W/4`: the rest streamed from disk once per step for the whole batch) and (c) at
the minimum budget. For each streamed row the bound it can reach:

    bound(B) = min(in-memory aggregate t/s at B, B x disk bandwidth / bytes read per step)

with the disk's O_DIRECT bandwidth measured by fio right before and after the row. Then
llama-server on the same GGUF, same threads and parallel slots, inside a memory cgroup
limited to the peak RSS gdsrun's server had at that budget (so its mmap'd weights must be
evicted and re-read as ours are streamed); skipped with the reason where no cgroup can be
made. Targets (issue 31, CPU): at a quarter of the weights and 16 concurrent requests,
>= 0.9x the in-memory server's aggregate t/s and >= 8x one request.

Usage: scripts/bench-serve-stream.py [--model 1b|smollm2|DIR] [--gguf FILE] [-c 1,4,16,64]
       [-n 8] [--max-tokens 32] [-t THREADS] [--no-llama]
Needs: the model converted (1b: scripts/synth-model.py llama-1b, then llama.cpp's
convert/quantize and `gdsconv convert`, as bench/runs/2026-11-27-real-size-1b.md says;
smollm2: scripts/fetch-model.sh), fio (installed with apt when missing), llama.cpp built
(scripts/build-llama-cpp.sh) for the llama-server rows."""
import argparse, json, os, subprocess, sys, time, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import drop_cache, ensure_fio, fio_bandwidth, free_port, in_cgroup, make_cgroup, run_load, stop, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("--model", default="1b", help="1b, smollm2, or a converted model directory")
ap.add_argument("--gguf", default=None, help="the GGUF llama-server loads (default: the model's)")
ap.add_argument("-c", "--concurrency", default="1,4,16,64")
ap.add_argument("-n", "--requests", type=int, default=8, help="requests per level (at least the concurrency)")
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--ctx", type=int, default=256, help="context per request")
ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
ap.add_argument("--time-limit", type=float, default=600, help="seconds per server")
ap.add_argument("--no-llama", action="store_true", help="skip llama-server")
ap.add_argument("--binary", default="target/release/gdsrun")
a = ap.parse_args()
levels = [int(x) for x in a.concurrency.split(",")]
max_c = max(levels)
MiB = 1 << 20

if a.model == "1b":
    model, gguf = ".cache/synth/llama-1b-Q4_0-gguf.gds", ".cache/synth/llama-1b-Q4_0.gguf"
    name = "Llama-3.2-1B-shaped random weights, Q4_0 (llama-quantize)"
elif a.model == "smollm2":
    gguf = subprocess.check_output(["./scripts/fetch-model.sh"], text=True).strip()
    model, name = ".cache/smollm2.gds", "SmolLM2-135M-Instruct Q4_1"
    if not os.path.exists(os.path.join(model, "manifest.gdsm")):
        subprocess.check_call(["target/release/gdsconv", "convert", gguf, model, "--force"])
else:
    model, gguf, name = a.model, None, os.path.basename(a.model.rstrip("/"))
gguf = a.gguf or gguf
if not os.path.exists(os.path.join(model, "manifest.gdsm")):
    sys.exit(f"{model}: not a converted model (see this script's usage)")
GDSRUN = a.binary


def run_json(cmd):
    return json.loads(subprocess.check_output(cmd, text=True))


ensure_fio()
LAYER_FILES = sorted(os.path.join(model, "layers", x) for x in os.listdir(os.path.join(model, "layers")))


def disk_bandwidth():
    return fio_bandwidth(LAYER_FILES)


def peak_rss(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def serve(label, cmd, cgroup=None):
    """Starts the server, runs the load at every level, returns (levels, peak RSS)."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    cmd = in_cgroup(cmd, cgroup)
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/bench-serve-stream-{label}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, p, timeout=300)
        out = []
        for c in levels:
            m0 = scrape(url)
            lv = run_load(url, str(c), a.requests, a.max_tokens, a.time_limit)["levels"]
            m1 = scrape(url)
            # gdsrun's /metrics (llama-server has none of these): of the forward passes'
            # time, how much waited for streamed weights that compute did not hide
            step_s = sum(m1.get(k, 0) - m0.get(k, 0) for k in ("gds_prompt_seconds_total", "gds_decode_seconds_total"))
            wait_s = m1.get("gds_io_wait_seconds_total", 0) - m0.get("gds_io_wait_seconds_total", 0)
            for l in lv:
                l["io_wait_share"] = wait_s / step_s if step_s > 0 else None
            out += lv
        return out, peak_rss(p.pid)
    finally:
        stop(p)


def scrape(url):
    """The numeric series of `url`/metrics (empty for a server without gdsrun's)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


plan = run_json([GDSRUN, model, "--plan", "--io", "direct"])["io_plan"]
weights = plan["weight_bytes"]
minimum = run_json([GDSRUN, model, "--plan", "--io", "direct", "--mem-budget", str(weights // 4)])["io_plan"]["min_budget_bytes"]
base = [GDSRUN, "serve", model, "--port", "{port}", "--threads", str(a.threads), "--ctx", str(a.ctx),
        "--max-batch", str(max_c)]
budgets = [("in memory", None), ("quarter", weights // 4), ("minimum", minimum)]
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
flags = open("/proc/cpuinfo").read()
isa = "avx512_vnni" if "avx512_vnni" in flags else "avx_vnni" if "avx_vnni" in flags else "avx2" if "avx2" in flags else "none"
print(f"{name}: {weights / MiB:.0f} MiB of layer files; {cpu} ({isa}), threads={a.threads}, "
      f"{a.max_tokens} tokens per request (ignore_eos), at least {a.requests} requests per level, loopback")
print(f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}, binary {GDSRUN}")

rows = {}
for label, budget in budgets:
    extra = [] if budget is None else ["--io", "direct", "--mem-budget", str(budget)]
    per_step = 0
    if budget is not None:
        per_step = run_json([GDSRUN, model, "--plan", "--io", "direct", "--mem-budget", str(budget)])["io_plan"]["streamed_bytes_per_token"]
    bw0 = disk_bandwidth()
    try:
        lv, rss = serve(label.replace(" ", "-"), base + extra)
    except Exception as e:
        print(f"{label}: failed: {e}")
        continue
    bw = (bw0 + disk_bandwidth()) / 2
    rows[label] = dict(levels={l["concurrency"]: l for l in lv}, rss=rss, per_step=per_step, bw=bw, budget=budget)

mem = rows.get("in memory")
print()
print(f"{'budget':<10}{'MB/step':>8}{'disk MB/s':>10}{'RSS MiB':>8} | " + " | ".join(f"c={c:<3}{'t/s':>6}{'bound':>7}{'ratio':>6}" for c in levels))
for label, r in rows.items():
    cells = []
    for c in levels:
        l = r["levels"].get(c)
        if not l:
            cells.append(f"{'-':>19}")
            continue
        tps = l["decode_tps"]
        if r["per_step"] and mem and c in mem["levels"]:
            bound = min(mem["levels"][c]["decode_tps"], c * r["bw"] / r["per_step"])
            cells.append(f"    {tps:>6.1f}{bound:>7.1f}{tps / bound:>6.2f}")
        else:
            cells.append(f"    {tps:>6.1f}{'':>7}{'':>6}")
    print(f"{label:<10}{r['per_step'] / 1e6:>8.0f}{r['bw'] / 1e6:>10.0f}{r['rss'] / MiB:>8.0f} | " + " | ".join(cells))
    waits = [f"c={c}: {l['io_wait_share']:.0%}" for c, l in r["levels"].items() if r["per_step"] and l.get("io_wait_share") is not None]
    if waits:
        print(f"  forward time waiting for weight reads: {', '.join(waits)}")
    failed = sum(l["failed"] for l in r["levels"].values())
    if failed:
        print(f"  {failed} requests failed: {[e for l in r['levels'].values() for e in l['errors']][:2]}")

q = rows.get("quarter")
if mem and q and 16 in q["levels"] and 16 in mem["levels"] and 1 in q["levels"]:
    vs_mem = q["levels"][16]["decode_tps"] / mem["levels"][16]["decode_tps"]
    vs_one = q["levels"][16]["decode_tps"] / q["levels"][1]["decode_tps"]
    print(f"quarter of the weights, 16 concurrent: {vs_mem:.2f}x the in-memory server (target >= 0.9x) "
          f"{'met' if vs_mem >= 0.9 else 'NOT met'}; {vs_one:.1f}x one request (target >= 8x) "
          f"{'met' if vs_one >= 8 else 'NOT met'}")


# llama-server under the same memory
llama = ".cache/llama.cpp/bin/llama-server"
print()
if a.no_llama or not gguf:
    sys.exit(0)
if not os.path.exists(llama):
    print(f"llama-server: skipped ({llama} not built: scripts/build-llama-cpp.sh)")
    sys.exit(0)
cg, why = make_cgroup("gdsbench-serve")
lcmd = [llama, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", str(a.threads), "-np", str(max_c),
        "-c", str(a.ctx * max_c), "--cont-batching", "--no-webui"]
print(f"llama-server (same GGUF, -np {max_c}), aggregate t/s; streamed rows in a memory cgroup limited to gdsrun's peak RSS there:")
for label, r in rows.items():
    cgroup = None
    if r["budget"] is not None:
        if not cg:
            print(f"{label}: skipped ({why})")
            continue
        path, limit_file = cg
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(int(r["rss"])))
        cgroup = path
        drop_cache([gguf] + LAYER_FILES)
    try:
        lv, _ = serve("llama-" + label.replace(" ", "-"), lcmd, cgroup)
    except Exception as e:
        print(f"{label}: llama-server failed: {e}")
        continue
    cells = []
    for c in levels:
        l = next((x for x in lv if x["concurrency"] == c), None)
        ours = r["levels"].get(c)
        if l and ours and l["decode_tps"]:
            cells.append(f"c={c}: {l['decode_tps']:.1f} t/s (gdsrun {ours['decode_tps'] / l['decode_tps']:.2f}x)")
        elif l:
            cells.append(f"c={c}: {l['decode_tps']:.1f} t/s, {l['failed']} failed")
    print(f"{label:<10}" + "; ".join(cells))
if cg:
    try:
        os.rmdir(cg[0])
    except OSError:
        pass
