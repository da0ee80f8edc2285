#!/usr/bin/env bash
# Where decode time goes on the GPU: nsys's per-kernel summary of a greedy run of each model
# that scripts/gpu-real-size.sh left under WORK (run it first on the same machine), and
# compute-sanitizer memcheck on a streamed `--io gds` run without the CUDA API errors that
# libcufile's own cuFileDriverOpen reports (memory errors only). Results under $OUT.
#   scripts/gpu-profile.sh [MODEL...]      (default: llama-7b llama-1b)
set -u
W=${WORK:-/tmp/gdsllm-real} OUT=${OUT:-/tmp/gpu-out}
G="$W/bin/gdsrun" SUM="$OUT/summary.txt" MODEL=$W
mkdir -p "$OUT"
# shellcheck source=scripts/gpu-env.sh
. "$(dirname "$0")/gpu-env.sh" >/dev/null
NS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NS:-none}" | tee -a "$SUM"
for m in ${*:-llama-7b llama-1b}; do
  [ -d "$W/$m.gds" ] || { echo "$m: not under $W" | tee -a "$SUM"; continue; }
  [ -n "$NS" ] || break
  timeout 150 "$NS" profile -o "/tmp/prof-$m" --force-overwrite true -t cuda \
    "$G" run "$W/$m.gds" --raw -p "The history of the printing press" -n 64 --temp 0 --backend cuda -c 512 \
    >"$OUT/$m-run.txt" 2>&1
  echo "$m: rc=$? $(grep -E '^\[' "$OUT/$m-run.txt" | tail -1)" | tee -a "$SUM"
  timeout 90 "$NS" stats -q -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o "$OUT/$m" "/tmp/prof-$m.nsys-rep" >>"$OUT/$m-run.txt" 2>&1
  head -12 "$OUT/${m}_cuda_gpu_kern_sum.csv" 2>/dev/null | cut -c1-220 | tee -a "$SUM"
done
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ] && [ -d "$W/tiny/llama" ]; then
  B=$("$G" run "$W/tiny/llama" --raw -p x -n 1 --backend cuda --plan | python3 -c 'import json,sys;print(json.load(sys.stdin)["gpu"]["min_budget_bytes"])')
  timeout 90 "$CS" --tool memcheck --report-api-errors no --error-exitcode 9 "$G" run "$W/tiny/llama" --raw \
    -p Hello -n 4 --temp 0 --backend cuda --io gds --vram-budget "$B" >"$OUT/memcheck-gds.txt" 2>&1
  echo "memcheck --io gds (API errors not reported): rc=$? $(grep 'ERROR SUMMARY' "$OUT/memcheck-gds.txt")" | tee -a "$SUM"
fi
