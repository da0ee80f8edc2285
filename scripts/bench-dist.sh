#!/usr/bin/env bash
# Benchmark of distribution (issue 11), in one run against a local registry (Debian's
# docker-registry on 127.0.0.1, filesystem storage in a temporary directory):
#   pack: `gdsconv pack DIR -o FILE.tar` next to `cp -r DIR` of the same model (goal: ratio of
#         throughputs pack/cp >= 0.7)
#   pull: `gdsconv pull REF OUT` into a fresh GDSLLM_HOME next to
#         `skopeo copy docker://REF oci:DIR` of the same artifact (goal: pull/skopeo >= 1.0)
# Each step RUNS times (default 5), interleaved, `sync` before each (untimed); the median is
# reported. Warm cache: the model's files and the registry's blobs stay in the page cache
# (dropping it needs root and would measure the disk, not the tools).
# Usage: scripts/bench-dist.sh [RUNS] [MODEL_DIR]   (needs docker-registry and skopeo: apt-get install -y docker-registry skopeo)
# MODEL_DIR: another converted model than SmolLM2 (e.g. the 7B shape's .cache/synth/llama-7b-Q4_0-gguf.gds);
# GDSCONV=PATH runs that gdsconv instead of building one. Each step's peak RSS is printed too.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-5}"
MODEL_DIR="${2:-}"
for t in docker-registry skopeo; do
  command -v "$t" >/dev/null || { echo "needs $t: apt-get install -y docker-registry skopeo" >&2; exit 2; }
done
if [ -n "${GDSCONV:-}" ]; then
  BIN=$(realpath "$GDSCONV")
else
  cargo build --release -q -p gdsconv
  BIN=$PWD/target/release/gdsconv
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gds-bench-dist.XXXXXX")
. scripts/local-registry.sh
cleanup() {
  stop_registry
  rm -rf "$WORK"
}
trap cleanup EXIT

# The model: SmolLM2 converted once, kept in .cache/ while it validates (or MODEL_DIR).
MODEL=${MODEL_DIR:-.cache/bench-dist/smollm2.gds}
LABEL=$([ -n "$MODEL_DIR" ] && basename "$MODEL_DIR" || echo "SmolLM2-135M-Instruct Q4_1")
if [ -z "$MODEL_DIR" ] && ! "$BIN" validate "$MODEL" --quick >/dev/null 2>&1; then
  GGUF=$(./scripts/fetch-model.sh)
  mkdir -p "$(dirname "$MODEL")"
  "$BIN" convert "$GGUF" "$MODEL" --force >/dev/null
fi
BYTES=$(du -sb --apparent-size "$MODEL" | cut -f1)
FILES=$(find "$MODEL" -type f | wc -l)

# A throwaway registry on a free port (scripts/local-registry.sh).
start_registry "$WORK"
REF=$REG_ADDR/smollm2:bench
rss() { /usr/bin/time -f "%M" -o "$WORK/rss.$1" "${@:2}"; echo "$1 $(cat "$WORK/rss.$1")" >> "$WORK/rss"; }
: > "$WORK/rss"
sync; t0=$(date +%s.%N); rss push "$BIN" push "$MODEL" "$REF" --plain-http >/dev/null; t1=$(date +%s.%N)
echo "first push: $(echo "$t1 - $t0" | bc -l) s"

now() { date +%s.%N; }
: > "$WORK/times"
cat "$MODEL"/* "$MODEL"/*/* >/dev/null 2>&1 || true
for i in $(seq "$RUNS"); do
  rm -rf "$WORK/cp" "$WORK/p.tar" "$WORK/home" "$WORK/pulled" "$WORK/sk"
  sync; t0=$(now); cp -r "$MODEL" "$WORK/cp"; t1=$(now)
  echo "cp $(echo "$t1 - $t0" | bc -l)" >> "$WORK/times"
  sync; t0=$(now); rss pack "$BIN" pack "$MODEL" -o "$WORK/p.tar" >/dev/null; t1=$(now)
  echo "pack $(echo "$t1 - $t0" | bc -l)" >> "$WORK/times"
  TAR_BYTES=$(stat -c %s "$WORK/p.tar")
  sync; t0=$(now); rss pull env GDSLLM_HOME="$WORK/home" "$BIN" pull "$REF" "$WORK/pulled" --plain-http >/dev/null; t1=$(now)
  echo "pull $(echo "$t1 - $t0" | bc -l)" >> "$WORK/times"
  sync; t0=$(now); rss skopeo skopeo --insecure-policy copy -q --src-tls-verify=false "docker://$REF" "oci:$WORK/sk:bench" >/dev/null; t1=$(now)
  echo "skopeo $(echo "$t1 - $t0" | bc -l)" >> "$WORK/times"
  cmp -s "$MODEL/manifest.gdsm" "$WORK/pulled/manifest.gdsm" || { echo "pulled model differs" >&2; exit 1; }
done

python3 - "$WORK/times" "$BYTES" "$FILES" "$TAR_BYTES" "$RUNS" "$LABEL" "$WORK/rss" <<'PY'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    k, v = line.split()
    times.setdefault(k, []).append(float(v))
b, files, tar, runs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
med = {k: statistics.median(v) for k, v in times.items()}
label = sys.argv[6]
rss = {}
for line in open(sys.argv[7]):
    k, v = line.split()
    rss[k] = max(rss.get(k, 0), int(v))
print(f"model: {label} converted, {files} files, {b/1e6:.1f} MB (tar {tar/1e6:.1f} MB); "
      f"median of {runs} runs, warm page cache, local registry on 127.0.0.1")
print(f"{'step':<44} {'median':>10} {'min':>10} {'max':>10} {'MB/s':>9} {'peak RSS':>12}")
if "push" in rss:
    print(f"(the first push, untimed in the table: peak RSS {rss['push'] / 1024:.0f} MiB)")
rows = [("cp", "cp -r DIR"), ("pack", "gdsconv pack DIR -o FILE.tar"),
        ("pull", "gdsconv pull REF OUT (fresh store)"), ("skopeo", "skopeo copy docker://REF oci:DIR")]
for k, name in rows:
    v = times[k]
    peak = f"{rss[k] / 1024:8.0f} MiB" if k in rss else ""
    print(f"{name:<44} {med[k]*1000:8.1f}ms {min(v)*1000:8.1f}ms {max(v)*1000:8.1f}ms {b/med[k]/1e6:9.1f} {peak}")
rp = med["cp"] / med["pack"]
rl = med["skopeo"] / med["pull"]
print(f"pack / cp   throughput ratio: {rp:.2f}  (goal >= 0.7: {'met' if rp >= 0.7 else 'NOT met'})")
print(f"pull / skopeo throughput ratio: {rl:.2f}  (goal >= 1.0: {'met' if rl >= 1.0 else 'NOT met'})")
PY
