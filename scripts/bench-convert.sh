#!/usr/bin/env bash
# Benchmark: `gdsconv convert` of SmolLM2 against a plain copy of the same bytes (dd with
# fsync, since gdsconv fsyncs what it writes), measured in the same run, input warm in the
# page cache for both. Prints both throughputs and the ratio. Usage: scripts/bench-convert.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-3}"
GGUF=$(./scripts/fetch-model.sh)
cargo build --release -q -p gdsconv
BIN=target/release/gdsconv
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gds-bench-convert.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
BYTES=$(stat -c %s "$GGUF")
cat "$GGUF" > /dev/null
now() { date +%s.%N; }
best_copy=999; best_conv=999
for i in $(seq "$RUNS"); do
  t0=$(now); dd if="$GGUF" of="$WORK/copy.gguf" bs=8M conv=fsync status=none; t1=$(now)
  rm -f "$WORK/copy.gguf"
  t=$(echo "$t1 - $t0" | bc -l); best_copy=$(echo "if ($t < $best_copy) $t else $best_copy" | bc -l)
  t0=$(now); "$BIN" convert "$GGUF" "$WORK/out.gds" --force > /dev/null; t1=$(now)
  t=$(echo "$t1 - $t0" | bc -l); best_conv=$(echo "if ($t < $best_conv) $t else $best_conv" | bc -l)
done
peak=$( { /usr/bin/time -f "%M" "$BIN" convert "$GGUF" "$WORK/out2.gds" > /dev/null; } 2>&1 | tail -1 )
python3 - "$BYTES" "$best_copy" "$best_conv" "$peak" <<'PY'
import sys
b, cp, cv, peak = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
print(f"input: SmolLM2-135M-Instruct.Q4_1.gguf, {b/1e6:.1f} MB (best of runs)")
print(f"plain copy (dd, fsync): {cp*1000:8.1f} ms  {b/cp/1e9:6.2f} GB/s")
print(f"gdsconv convert       : {cv*1000:8.1f} ms  {b/cv/1e9:6.2f} GB/s")
print(f"ratio convert/copy throughput: {cp/cv:.2f}x")
print(f"gdsconv peak RSS: {peak/1024:.1f} MiB (input mapped read-only; pages dropped per layer)")
PY
