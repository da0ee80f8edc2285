#!/usr/bin/env python3
"""`just bench-stream`: layer streaming on SmolLM2 (converted), in one run.

Measures the disk's O_DIRECT read bandwidth the way the best reader would read the layer
files: fio itself (libaio, 4 reads of 2 MiB in flight over the model's layer files; installed
with apt when missing), right before and after each row, and gdsrun doctor's own probe for
comparison. Then for several --mem-budget values (all resident, half, a quarter, the
minimum): the bytes streamed per token, the bound they imply (fio bandwidth / bytes per
token), the decode t/s achieved (gdsrun bench -p 0 -n N --io direct) and its ratio to the
bound (target at a quarter and at the minimum budget: >= 0.9).

For comparison, plain mmap with the same memory: gdsrun --io mmap and llama.cpp's
llama-bench (which memory-maps the GGUF) run inside a memory cgroup limited to the peak RSS
the direct run needed at that budget, so the kernel must evict and re-read weight pages.
Skipped, with the reason, where no memory cgroup can be created.

Usage: scripts/bench-stream.py [-n 32] [-r 2] [-t THREADS] [--model DIR --gguf FILE] [--bin-dir DIR]
       [--budgets all,half,quarter,minimum] [--no-mmap]
--model/--gguf run another converted model (and its GGUF, for llama.cpp's mmap row) than
SmolLM2, e.g. the 1B shape of scripts/synth-model.py (`.cache/synth/llama-1b-Q4_0-gguf.gds`);
--bin-dir runs the gdsrun in DIR instead of building it; --no-mmap skips the cgroup rows."""
import argparse, json, os, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import drop_cache, ensure_fio, fio_bandwidth, in_cgroup, make_cgroup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("-n", type=int, default=32)
ap.add_argument("-r", type=int, default=2)
ap.add_argument("-t", type=int, default=os.cpu_count())
ap.add_argument("--model", help="a converted model directory (default: SmolLM2)")
ap.add_argument("--gguf", help="the GGUF it came from (llama.cpp's mmap row)")
ap.add_argument("--bin-dir", help="run the gdsrun in this folder instead of building it")
ap.add_argument("--budgets", default="all,half,quarter,minimum", help="which rows, a comma list")
ap.add_argument("--no-mmap", action="store_true", help="skip the mmap rows under a memory cgroup")
a = ap.parse_args()

if a.bin_dir:
    BIN = a.bin_dir
else:
    subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "gdsconv", "-p", "gdsrun"])
    BIN = "target/release"
if a.model:
    model, gguf = a.model, a.gguf or ""
else:
    gguf = subprocess.check_output(["./scripts/fetch-model.sh"], text=True).strip()
    model = ".cache/smollm2.gds"
    if not os.path.exists(os.path.join(model, "manifest.gdsm")):
        subprocess.check_call([f"{BIN}/gdsconv", "convert", gguf, model, "--force"])
GDSRUN = f"{BIN}/gdsrun"
MiB = 1 << 20


def run_json(cmd, cgroup=None, timeout=None):
    cmd = in_cgroup(cmd, cgroup)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-12:])}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    return json.loads(p.stdout)


def doctor_bandwidth():
    d = run_json([GDSRUN, "doctor", model, "--json"])
    return d, d["model"]["read_bandwidth_direct"]["bytes_per_sec"]


ensure_fio()
LAYER_FILES = sorted(os.path.join(model, "layers", x) for x in os.listdir(os.path.join(model, "layers")))


def direct_bandwidth():
    return fio_bandwidth(LAYER_FILES)


doctor, doctor_bw = doctor_bandwidth()
bw = direct_bandwidth()
weights = run_json([GDSRUN, model, "--plan", "--io", "direct"])["io_plan"]["weight_bytes"]
# (the plan at any budget it accepts reports the minimum; a model of few large layers, such
# as a slice of a 70B, needs more than a quarter of its weights)
minimum = run_json([GDSRUN, model, "--plan", "--io", "direct", "--mem-budget", str(weights)])["io_plan"]["min_budget_bytes"]

print(f"{model} ({weights / MiB:.1f} MiB of layer files), threads={a.t}, tg{a.n}, best of -r {a.r}")
print(f"disk: {doctor['model']['filesystem']}, O_DIRECT read bandwidth {bw / 1e6:.0f} MB/s (fio: 2 MiB reads, 4 in flight, libaio), {doctor_bw / 1e6:.0f} MB/s (gdsrun doctor's probe)")
print("each row's bound uses the mean of that bandwidth measured right before and right after its run")
print()
hdr = f"{'budget':<14}{'held MiB':>9}{'MB/token':>10}{'disk MB/s':>10}{'bound t/s':>10}{'gdsrun t/s':>11}{'vs bound':>9}{'peak RSS':>10}"
print(hdr)
rows = []
wanted = a.budgets.split(",")
for label, budget in (("all resident", weights), ("half", weights // 2), ("quarter", weights // 4), ("minimum", minimum)):
    if label.split()[0] not in wanted:
        continue
    if budget < minimum:
        print(f"{label}: {budget / MiB:.1f} MiB is below the minimum working set ({minimum / MiB:.1f} MiB: two buffers of the largest layer): no row")
        continue
    plan = run_json([GDSRUN, model, "--plan", "--io", "direct", "--mem-budget", str(budget)])["io_plan"]
    cmd = [GDSRUN, "bench", model, "-p", "0", "-n", str(a.n), "-r", str(a.r), "-t", str(a.t), "--io", "direct", "--mem-budget", str(budget), "--json"]
    # a fresh process per budget (through a python shim that reports its peak RSS)
    bw_before = direct_bandwidth()
    res = subprocess.run(["python3", "-c", "import resource,subprocess,sys;p=subprocess.run(sys.argv[1:],capture_output=True,text=True);sys.stderr.write(p.stderr);print(p.stdout);print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024)"] + cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"{label}: failed: {res.stderr[-300:]}")
        continue
    body, rss = res.stdout.rsplit("\n", 2)[0], int(res.stdout.strip().rsplit("\n", 1)[1])
    r = json.loads(body)[0]
    bw = (bw_before + direct_bandwidth()) / 2
    per_tok = plan["streamed_bytes_per_token"]
    bound = bw / per_tok if per_tok else float("inf")
    ratio = r["avg_ts"] / bound if per_tok else float("nan")
    rows.append(dict(label=label, budget=budget, held=plan["held_bytes"], per_tok=per_tok, bound=bound, ts=r["avg_ts"], ratio=ratio, rss=rss, measured_per_tok=r["bytes_read_per_token"], run_bw=r["read_bandwidth_bytes_per_sec"]))
    print(f"{label:<14}{plan['held_bytes'] / MiB:>9.1f}{per_tok / 1e6:>10.1f}{bw / 1e6:>10.0f}{(bound if per_tok else 0):>10.1f}{r['avg_ts']:>11.1f}{(ratio if per_tok else 0):>9.2f}{rss / MiB:>9.0f}M")

ok = True
print()
for r in rows:
    if r["label"] not in ("quarter", "minimum"):
        continue
    met = r["ratio"] >= 0.9
    ok &= met
    print(f"{r['label']} budget ({r['budget'] / MiB:.1f} MiB): {r['ratio']:.2f} of the fio bound (target >= 0.90): {'met' if met else 'NOT met'}")
    if r["run_bw"]:
        print(f"  (read bandwidth inside the run: {r['run_bw'] / 1e6:.0f} MB/s; measured bytes/token {r['measured_per_tok'] / 1e6:.1f} MB)")

# plain mmap under the same memory, in a memory cgroup
cg, why = (None, "--no-mmap") if a.no_mmap else make_cgroup()
print()
if not cg:
    print(f"mmap under memory pressure: skipped ({why})")
else:
    path, limit_file = cg
    print("mmap under the same memory (cgroup limit = the direct run's peak RSS at that budget):")
    print(f"{'budget':<14}{'limit MiB':>10}{'gdsrun direct':>15}{'gdsrun mmap':>13}{'llama.cpp mmap':>16}")
    llama = ".cache/llama.cpp/bin/llama-bench"
    try:
        for r in rows:
            if r["label"] == "all resident":
                continue
            limit = int(r["rss"])
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit))
            # start cold, so the pages faulted in are charged to the limited cgroup
            drop_cache(([gguf] if gguf else []) + LAYER_FILES)
            def ts(cmd, field="avg_ts"):
                try:
                    # a reader that thrashes the page cache can take hours: give up after 3 min
                    out = run_json(cmd, cgroup=path, timeout=180)
                    out = out if isinstance(out, list) else [out]
                    return f"{[x for x in out if x['n_gen']][0][field]:.1f}"
                except subprocess.TimeoutExpired:
                    return "> 180 s"
                except Exception as e:
                    return "failed" if "exit -9" not in str(e) and "exit 137" not in str(e) else "OOM-killed"
            mm = ts([GDSRUN, "bench", model, "-p", "0", "-n", str(a.n), "-r", str(a.r), "-t", str(a.t), "--io", "mmap", "--json"])
            lc = "no GGUF" if not gguf else ts([llama, "-m", gguf, "-p", "0", "-n", str(a.n), "-r", str(a.r), "-t", str(a.t), "-o", "json"]) if os.path.exists(llama) else "not built"
            print(f"{r['label']:<14}{limit / MiB:>10.0f}{r['ts']:>15.1f}{mm:>13}{lc:>16}")
    finally:
        try:
            os.rmdir(path)
        except OSError:
            pass
sys.exit(0 if ok else 1)
