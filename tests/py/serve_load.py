#!/usr/bin/env python3
"""A bounded loopback load test for OpenAI-compatible servers (gdsrun serve, llama-server).

For each concurrency level, sends --requests-per-level completion requests, at most
`concurrency` in flight, each asking for exactly --max-tokens tokens (ignore_eos) with a
distinct prompt, and reports aggregate decode throughput (completion tokens / wall time)
and latency percentiles. With --response-format, every request carries it (structured
outputs: constrained decoding). Prints one JSON object. Refuses non-loopback URLs.
"""
import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

TOPICS = ["the sea", "a lighthouse", "autumn", "a robot", "bread", "a city at night", "rain",
          "a violin", "mountains", "a library", "the moon", "a garden", "trains", "winter",
          "a market", "a river"]


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def one(url, i, max_tokens, model, deadline, response_format=None):
    body = {"prompt": f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i}).",
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "ignore_eos": True,
            "stream": False}
    if model:
        body["model"] = model
    if response_format:
        body["response_format"] = response_format
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=max(1.0, deadline - time.time())) as r:
            v = json.loads(r.read())
        return {"ok": True, "tokens": v["usage"]["completion_tokens"],
                "latency": time.perf_counter() - t0}
    except urllib.error.HTTPError as e:
        return {"ok": False, "error": f"HTTP {e.code}: {e.read()[:200]!r}",
                "latency": time.perf_counter() - t0}
    except Exception as e:  # a lost request is a result, not a crash of the load test
        return {"ok": False, "error": repr(e), "latency": time.perf_counter() - t0}


def level(url, conc, n, max_tokens, model, deadline, response_format=None):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=conc) as ex:
        res = list(ex.map(lambda i: one(url, i, max_tokens, model, deadline, response_format),
                          range(n)))
    wall = time.perf_counter() - t0
    ok = [r for r in res if r["ok"]]
    lat = [r["latency"] * 1000 for r in ok]
    toks = sum(r["tokens"] for r in ok)
    return {"concurrency": conc, "requests": n, "ok": len(ok), "failed": n - len(ok),
            "errors": [r["error"] for r in res if not r["ok"]][:3],
            "completion_tokens": toks, "wall_s": round(wall, 3),
            "decode_tps": round(toks / wall, 2) if wall > 0 else 0.0,
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90),
                           "p99": percentile(lat, 99)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--time-limit", type=float, default=300, help="seconds for the whole run")
    ap.add_argument("--response-format", type=json.loads, default=None,
                    help="a response_format object (JSON) every request carries")
    a = ap.parse_args()
    host = urlparse(a.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"refusing to load-test {host}: loopback only")
    deadline = time.time() + a.time_limit
    out = {"url": a.url, "max_tokens": a.max_tokens, "levels": []}
    for c in [int(x) for x in a.concurrency.split(",")]:
        if time.time() >= deadline:
            out["time_limit_reached"] = True  # the levels not run are left out
            break
        out["levels"].append(level(a.url.rstrip("/"), c, max(c, a.requests_per_level),
                                   a.max_tokens, a.model, deadline, a.response_format))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
