#!/usr/bin/env bash
# Benchmark: `gdsconv convert` of SmolLM2 and Gemma 3 270M against a plain copy of the same
# bytes (dd with fsync, since gdsconv fsyncs what it writes), measured in the same run and
# interleaved, input warm in the page cache for both. Prints both throughputs (best of RUNS),
# the ratio (target: >= 0.7x) and gdsconv's peak RSS against the model's size.
# Usage: scripts/bench-convert.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-3}"
SMOL=$(./scripts/fetch-model.sh)
GEMMA=$(./scripts/fetch-gemma.sh)
cargo build --release -q -p gdsconv
BIN=target/release/gdsconv
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gds-bench-convert.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
now() { date +%s.%N; }
ok=0
for GGUF in "$SMOL" "$GEMMA"; do
  BYTES=$(stat -c %s "$GGUF")
  cat "$GGUF" > /dev/null
  best_copy=999; best_conv=999
  for i in $(seq "$RUNS"); do
    t0=$(now); dd if="$GGUF" of="$WORK/copy.gguf" bs=8M conv=fsync status=none; t1=$(now)
    rm -f "$WORK/copy.gguf"
    t=$(echo "$t1 - $t0" | bc -l); best_copy=$(echo "if ($t < $best_copy) $t else $best_copy" | bc -l)
    # a new output directory, as dd writes a new file (the previous one removed outside
    # the timing for both: replacing with --force adds the removal of the old model)
    rm -rf "$WORK/out.gds"
    t0=$(now); "$BIN" convert "$GGUF" "$WORK/out.gds" > /dev/null; t1=$(now)
    t=$(echo "$t1 - $t0" | bc -l); best_conv=$(echo "if ($t < $best_conv) $t else $best_conv" | bc -l)
  done
  rm -rf "$WORK/out2.gds"
  peak=$( { /usr/bin/time -f "%M" "$BIN" convert "$GGUF" "$WORK/out2.gds" > /dev/null; } 2>&1 | tail -1 )
  python3 - "$(basename "$GGUF")" "$BYTES" "$best_copy" "$best_conv" "$peak" <<'PY' || ok=1
import sys
name, b, cp, cv, peak = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
r = cp / cv
print(f"{name}, {b/1e6:.1f} MB (best of runs)")
print(f"  plain copy (dd, fsync): {cp*1000:8.1f} ms  {b/cp/1e9:6.2f} GB/s")
print(f"  gdsconv convert       : {cv*1000:8.1f} ms  {b/cv/1e9:6.2f} GB/s")
print(f"  ratio convert/copy throughput: {r:.2f}x (target >= 0.7x) {'ok' if r >= 0.7 else 'MISSED'}")
print(f"  gdsconv peak RSS: {peak/1024:.1f} MiB for a {b/2**20:.1f} MiB model {'ok' if peak * 1024 < b else 'MISSED'}")
sys.exit(0 if r >= 0.7 and peak * 1024 < b else 1)
PY
done
exit $ok
