#!/usr/bin/env python3
"""How much a streamed server's reads cost its compute: the in-memory server at one concurrency,
alone and beside a rate-limited fio reader doing what streaming does (sequential O_DIRECT reads,
of another file: reading the served model's own files with O_DIRECT drops their cached pages), alternated A, B, A, B in one run. On a machine with few cores the
reads' CPU time (syscalls, the virtual disk's emulation) comes out of the forward pass; the ratio
B/A says how much (issue 31: the streamed server at a quarter of the weights reached 0.71x the
in-memory one at 16 concurrent on the 2-vCPU VM, with reads and compute overlapping only in part).

    scripts/bench-io-contention.py [--model DIR] [--rate 900] [-c 16] [--rounds 2]
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import ensure_fio, free_port, run_load, stop, wait_healthy  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--model", default=".cache/synth/llama-1b-Q4_0-gguf.gds")
ap.add_argument("--binary", default="target/ci/gdsrun")
ap.add_argument("--read", nargs="+", default=[".cache/synth/llama-1b-Q4_0-f16.gguf"],
                help="the files the reader reads: NOT the served model's (O_DIRECT reads of a file drop "
                     "its cached pages, and the in-memory server would fault its weights back in)")
ap.add_argument("--rate", type=int, default=900, help="the reader's MB/s (the streamed server's read rate)")
ap.add_argument("-c", "--concurrency", default="16")
ap.add_argument("--requests", type=int, default=32)
ap.add_argument("--max-tokens", type=int, default=16)
ap.add_argument("--rounds", type=int, default=2)
a = ap.parse_args()
if not os.path.exists(os.path.join(a.model, "manifest.gdsm")):
    sys.exit(f"{a.model}: not a converted model (bench/runs/2026-11-27-real-size-1b.md makes the 1B)")
ensure_fio()
files = a.read
port = free_port()
url = f"http://127.0.0.1:{port}"
server = subprocess.Popen([a.binary, "serve", a.model, "--port", str(port), "--ctx", "1024",
                           "--max-batch", a.concurrency], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(f"{a.model}, c={a.concurrency}, reader {a.rate} MB/s, load average {os.getloadavg()[0]:.1f}, "
      f"{time.strftime('%Y-%m-%d %H:%M')}")
try:
    wait_healthy(url, server, timeout=300)
    run_load(url, a.concurrency, a.concurrency, 4, 120)  # warm up
    res = {"alone": [], "beside the reader": []}
    for _ in range(a.rounds):
        for label in res:
            reader = None
            if label != "alone":
                reader = subprocess.Popen(["fio", "--name=stream", "--filename=" + ":".join(files), "--rw=read",
                                           "--bs=2M", "--direct=1", "--ioengine=libaio", "--iodepth=2",
                                           "--time_based", "--runtime=600", f"--rate={a.rate}m"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)
            try:
                lv = run_load(url, a.concurrency, a.requests, a.max_tokens, 300)["levels"][0]
            finally:
                if reader:
                    stop(reader, grace=5)
            res[label].append(lv["decode_tps"])
            print(f"  {label}: {lv['decode_tps']:.1f} t/s")
    alone, beside = (sum(v) / len(v) for v in res.values())
    print(f"beside the reader / alone: {beside / alone:.2f}x ({beside:.1f} vs {alone:.1f} t/s)")
finally:
    stop(server)
