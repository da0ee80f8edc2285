#!/usr/bin/env python3
"""Saving and restoring a slot (llama-server's POST /slots/{id}?action=save|restore with
--slot-save-path) against computing the prompt again, on gdsrun serve and on llama.cpp's
llama-server with the same GGUF and threads: the time to the first token of a long prompt
on a fresh server (cold), the save, and on another fresh server the restore and the same
request (warm). What a restarted server, or a second replica, gains from a saved prompt: a
long system prompt, a document a conversation is about, a coding agent's context.

The model is a random-weight checkpoint of Llama-3.2-1B's shape (scripts/synth-model.py
llama-1b, SmolLM2's tokenizer), its GGUF by llama.cpp's converter and llama-quantize (default
Q4_K_M): compute and I/O are the real model's, the text is noise.

Usage: scripts/bench-slots.py [-t THREADS] [--words 1500] [--rounds 2] [--quant Q4_K_M]
                              [--bin target/release/gdsrun]
Needs: scripts/build-llama-cpp.sh, torch + transformers (for the model, made once into
.cache/synth/)."""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import WORDS, free_port, stop, synth_model, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
ap.add_argument("--words", type=int, default=1500, help="words in the prompt")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--quant", default="Q4_K_M")
ap.add_argument("--bin", default="target/release/gdsrun")
a = ap.parse_args()

gguf, gds = synth_model("llama-1b", a.quant, os.path.join(os.path.dirname(a.bin), "gdsconv"))

rng = random.Random(11)
PROMPT = " ".join(rng.choice(WORDS) for _ in range(a.words)).capitalize() + "."
CTX = 4096


def post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.load(r)


def first_token(url):
    """Seconds to the first token of PROMPT (one token generated), and the tokens computed."""
    t0 = time.perf_counter()
    r = post(url, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0,
                                  "id_slot": 0, "cache_prompt": True})
    return time.perf_counter() - t0, r["timings"]["prompt_n"], r["timings"].get("cache_n", 0)


def session(name, cmd, d, action):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/bench-slots-{name}.log", "a")
    p = subprocess.Popen(cmd(port, d), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, p, timeout=300)
        return action(url)
    finally:
        stop(p, 10)


def cold(url):
    secs, computed, _ = first_token(url)
    t0 = time.perf_counter()
    r = post(url, "/slots/0?action=save", {"filename": "bench.bin"})
    return {"cold_s": secs, "computed": computed, "save_s": time.perf_counter() - t0,
            "saved": r["n_saved"], "bytes": r["n_written"]}


def warm(url):
    t0 = time.perf_counter()
    r = post(url, "/slots/0?action=restore", {"filename": "bench.bin"})
    restore = time.perf_counter() - t0
    secs, computed, cached = first_token(url)
    return {"restore_s": restore, "restored": r["n_restored"], "warm_s": secs,
            "warm_computed": computed, "warm_cached": cached}


def ours(port, d):
    return [a.bin, "serve", gds, "--port", str(port), "--threads", str(a.threads), "--ctx",
            str(CTX), "--slot-save-path", d]


def theirs(port, d):
    return [".cache/llama.cpp/bin/llama-server", "-m", gguf, "--host", "127.0.0.1", "--port",
            str(port), "-t", str(a.threads), "-np", "1", "-c", str(CTX), "--no-webui",
            "--slot-save-path", d + "/"]


rows = {}
for i in range(a.rounds):
    for name, cmd in (("gdsrun", ours), ("llama-server", theirs)):
        d = tempfile.mkdtemp(prefix="bench-slots-")
        try:
            r = session(name, cmd, d, cold)
            r.update(session(name, cmd, d, warm))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rows.setdefault(name, []).append(r)
        print(f"round {i} {name:12} cold {r['cold_s']:6.2f} s ({r['computed']} tokens) | save "
              f"{r['save_s'] * 1000:6.1f} ms {r['bytes'] / 2**20:6.1f} MiB | restore "
              f"{r['restore_s'] * 1000:6.1f} ms | warm {r['warm_s']:6.2f} s "
              f"({r['warm_computed']} computed, {r['warm_cached']} cached)", flush=True)


def best(name, key):
    return min(r[key] for r in rows[name])


out = {"model": f"Llama-3.2-1B shape (random weights), {a.quant} GGUF", "threads": a.threads,
       "prompt_tokens": rows["gdsrun"][0]["computed"]}
for name in rows:
    c, s, rs, w = (best(name, k) for k in ("cold_s", "save_s", "restore_s", "warm_s"))
    out[name] = {"cold_s": round(c, 3), "save_ms": round(s * 1000, 1),
                 "restore_ms": round(rs * 1000, 1), "warm_s": round(w, 3),
                 "file_mib": round(rows[name][0]["bytes"] / 2**20, 1),
                 "speedup_restore_plus_warm_vs_cold": round(c / (rs + w), 2)}
out["warm_ratio_llama_over_gdsrun"] = round(
    (best("llama-server", "restore_s") + best("llama-server", "warm_s"))
    / (best("gdsrun", "restore_s") + best("gdsrun", "warm_s")), 2)
print(json.dumps(out))
