#!/usr/bin/env python3
"""Beam search against n sampled choices on one running `gdsrun serve` (port 18123): the same
prompt, width and length, interleaved, two rounds. Prints the seconds of each and their ratio."""
import json, time, urllib.request, sys
url = "http://127.0.0.1:18123/v1/completions"
def post(b):
    r = urllib.request.Request(url, data=json.dumps(b).encode(), headers={"Content-Type": "application/json"})
    t = time.time(); v = json.load(urllib.request.urlopen(r)); return time.time() - t, v
prompt = "The history of the printing press begins"
for rnd in range(2):
    for w in (1, 4):
        for max_t in (32, 128):
            tb, vb = post({"prompt": prompt, "use_beam_search": True, "n": w, "max_tokens": max_t, "ignore_eos": True})
            ts, vs = post({"prompt": prompt, "n": w, "max_tokens": max_t, "ignore_eos": True, "temperature": 1.0, "seed": 1})
            print(f"round {rnd} width {w} max_tokens {max_t}: beam {tb:.2f} s, {w} sampled choices {ts:.2f} s, ratio {tb/ts:.1f}x")
