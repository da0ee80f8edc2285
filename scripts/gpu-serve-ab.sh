#!/usr/bin/env bash
# A second call on a lent machine still warm after scripts/gpu-real-size.sh (run with SERVE=0):
# the server on the GPU on the models that run left in $WORK, with the A/Bs of the matvec/GEMM
# crossover, results under $OUT:
#   scripts/gpu-serve-ab.sh [SHAPE...]   (default: llama-7b llama-1b)
# Per shape, all resident: concurrency 1, 4 and 16 at the default crossover (passes under 32
# tokens on the int8 matvec kernels); 16 with the former crossover (GDS_GEMM_MIN_TOKENS=8:
# c=16's passes through dequantized f16 tiles, slower than c=4 on 2026-12-04); 16 and 64
# through the int8 tensor-core products from 16 tokens (GDS_CUDA_MMQ=1
# GDS_GEMM_MIN_TOKENS=16); then compute-sanitizer memcheck on tiny llama (the fused launches and
# the tensor-core products). A shape whose model is not there (the machine went back between
# the calls and /tmp is empty) is said and skipped: nothing is made again here.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
W=${WORK:-/tmp/gdsllm-real}
mkdir -p "$OUT"
SUM=$OUT/summary.txt LOG=$OUT/log.txt MODEL=$W
# shellcheck source=scripts/gpu-env.sh
. scripts/gpu-env.sh
G=$W/bin/gdsrun
for shape in ${*:-llama-7b llama-1b}; do
  M=$W/$shape.gds
  [ -x "$G" ] && [ -f "$M/manifest.gdsm" ] || { echo "[$shape] no model or binary in $W: skipped" | tee -a "$SUM"; continue; }
  b() { # b LIMIT LEVELS LABEL [ENV...]
    local t=$1 c=$2 l=$3; shift 3
    timeout "$t" env "$@" python3 scripts/gpu-serve-bench.py --gdsrun "$G" --model "$M" \
      --label "$shape resident$l" -c "$c" --time-limit 60 2>>"$LOG" | tee -a "$SUM"
  }
  b 150 1,4,16 ""
  b 90 16 ", GDS_GEMM_MIN_TOKENS=8" GDS_GEMM_MIN_TOKENS=8
  b 120 16,64 ", GDS_CUDA_MMQ=1 GDS_GEMM_MIN_TOKENS=16" GDS_CUDA_MMQ=1 GDS_GEMM_MIN_TOKENS=16
done
# compute-sanitizer memcheck over the kernels no GPU had run before 2026-12-05 (the fused
# launches, the default; the int8 tensor-core products on every pass: GDS_CUDA_MMQ=1
# --gemm-min-tokens 1), tiny llama at its minimum VRAM budget (streamed, --io direct)
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
TL=$W/tiny/llama
if [ -n "$CS" ] && [ -f "$TL/manifest.gdsm" ]; then
  min=$("$G" run "$TL" --raw -p x -n 1 --backend cuda --plan 2>>"$LOG" |
    python3 -c "import json,sys;print(json.load(sys.stdin)['gpu']['min_budget_bytes'])")
  for v in fused mmq; do
    mm=0 gm=32; [ $v = mmq ] && mm=1 gm=1
    echo "### memcheck $v" >>"$LOG"
    timeout 90 env GDS_CUDA_MMQ=$mm "$CS" --tool memcheck --error-exitcode 9 "$G" run "$TL" --raw \
      -p "Hello world, this is a test of" -n 8 --temp 0 --backend cuda --io direct --gemm-min-tokens $gm \
      --vram-budget "$min" >>"$LOG" 2>&1
    echo "[memcheck tiny llama, $v, min budget] rc=$? $(grep -E 'ERROR SUMMARY' "$LOG" | tail -1)" | tee -a "$SUM"
  done
fi
echo "== serve A/B done $(date -u +%FT%TZ)" | tee -a "$SUM"
