#!/usr/bin/env python3
"""OpenAI's predicted outputs (`prediction`) on `gdsrun serve`: the time of one greedy chat
reply without help, with the prompt-lookup draft (`"draft": "ngram"`), and with a
prediction, rounds interleaved (every variant once per round), the same server.

The task is a code edit, what predicted outputs are for: the prompt holds a Python file and
asks for it back with one change. Predictions:
- `file`: the file as it was (what an editor sends; the reply repeats most of it);
- `reply`: the reply itself (the best a prediction can be);
- `reply-edited`: the reply with one line in eight changed (a prediction that is partly wrong).
Every variant must give the plain reply's text (the script checks it). Printed per variant:
seconds (median of the rounds), tokens/s, speed-up over plain, accepted and rejected guesses.

No other server takes `prediction` (llama-server and vLLM ignore or refuse it), so the
reference here is the same server without it, and with llama-server's way of speculating
without a draft model (prompt lookup, which also finds the file in the prompt).

Usage: scripts/bench-predicted.py MODEL_DIR [-t THREADS] [--max-tokens 256] [--rounds 3]
                                  [--bin target/release/gdsrun]"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, stop, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
ap.add_argument("--max-tokens", type=int, default=256)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--bin", default="target/release/gdsrun")
a = ap.parse_args()

FILE = '''class Account:
    """A bank account."""

    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        """Adds amount to the balance."""
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        """Takes amount from the balance."""
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        return self.balance
'''
PROMPT = ("Here is a Python file:\n```python\n" + FILE + "```\n"
          "Rewrite the whole file, renaming the class Account to BankAccount. "
          "Answer with the code only.")

port = free_port()
url = f"http://127.0.0.1:{port}"
proc = subprocess.Popen([a.bin, "serve", a.model, "--port", str(port), "--threads",
                         str(a.threads), "--ctx", "2048"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    wait_healthy(url, proc)

    def chat(extra):
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": a.max_tokens,
                "temperature": 0, **extra}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        v = json.load(urllib.request.urlopen(req, timeout=3600))
        return v, time.perf_counter() - t0

    plain, _ = chat({})
    reply = plain["choices"][0]["message"]["content"]
    lines = reply.split("\n")
    edited = "\n".join(l if i % 8 != 4 else "    pass  # changed" for i, l in enumerate(lines))
    pred = lambda text: {"prediction": {"type": "content", "content": text}}  # noqa: E731
    variants = {"plain": {}, "ngram": {"draft": "ngram"}, "file": pred(FILE),
                "reply": pred(reply), "reply-edited": pred(edited)}
    times = {k: [] for k in variants}
    info = {}
    for _ in range(a.rounds):
        for k, extra in variants.items():
            v, dt = chat(extra)
            got = v["choices"][0]["message"]["content"]
            if got != reply:
                sys.exit(f"{k}: the reply changed:\n{got!r}\nvs\n{reply!r}")
            times[k].append(dt)
            info[k] = v["usage"]
    n = plain["usage"]["completion_tokens"]
    base = statistics.median(times["plain"])
    print(f"model {a.model}, {a.threads} threads, {n} tokens generated, {a.rounds} rounds")
    print("| variant | seconds (median) | tokens/s | vs plain | accepted | rejected |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in variants:
        t = statistics.median(times[k])
        d = info[k]["completion_tokens_details"]
        print(f"| {k} | {t:.2f} ({', '.join(f'{x:.2f}' for x in times[k])}) | {n / t:.1f} | "
              f"{base / t:.2f}x | {d['accepted_prediction_tokens']} | "
              f"{d['rejected_prediction_tokens']} |")
finally:
    stop(proc)
