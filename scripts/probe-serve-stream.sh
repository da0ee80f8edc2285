#!/bin/bash
# One server run for the streamed-server A/Bs of bench/runs/2026-11-28-serve-stream-readahead.md:
# `gdsrun serve` on the 1B-shaped synthetic model (scripts/synth-model.py; --max-batch 16,
# 2 threads) with EXTRA flags, a warm-up of 16 requests, then 32 requests of 16 tokens at
# concurrency 16 (tests/py/serve_load.py, loopback); prints t/s, the server's user/sys CPU
# ticks over the measured part, and its I/O and step counters from /metrics.
# usage: [MODEL=DIR] scripts/probe-serve-stream.sh BINARY [EXTRA...]   e.g. target/ci/gdsrun --io direct --mem-budget 150MiB
set -euo pipefail
B=$1; shift
PORT=18555
$B serve "${MODEL:-.cache/synth/llama-1b-Q4_0-gguf.gds}" --port $PORT --threads 2 --ctx 256 --max-batch 16 "$@" > /tmp/probe-serve.log 2>&1 &
PID=$!
for i in $(seq 1 120); do curl -s localhost:$PORT/health >/dev/null && break; sleep 1; done
python3 tests/py/serve_load.py --url http://127.0.0.1:$PORT --concurrency 16 --requests-per-level 16 --max-tokens 16 --time-limit 300 > /dev/null
read -r u0 s0 < <(awk '{print $14, $15}' /proc/$PID/stat)
t0=$(date +%s.%N)
python3 tests/py/serve_load.py --url http://127.0.0.1:$PORT --concurrency 16 --requests-per-level 32 --max-tokens 16 --time-limit 300 | python3 -c "import sys,json;l=json.load(sys.stdin)['levels'][0];print('tps',round(l['decode_tps'],1))"
t1=$(date +%s.%N)
read -r u1 s1 < <(awk '{print $14, $15}' /proc/$PID/stat)
echo "wall $(echo "$t1-$t0"|bc) user $(( (u1-u0) )) sys $(( (s1-s0) )) (ticks of 1/100 s)"
curl -s localhost:$PORT/metrics | grep -E "^gds_(io_|decode_seconds|prompt_seconds|steps_total)"
kill $PID; wait $PID 2>/dev/null || true
