#!/usr/bin/env bash
# One lent GPU machine, one call: the Python package's GPU checks (issue 35), then the real-size
# run (issue 36, with issue 31's server benchmark), results under $OUT:
#   scripts/gpu-loan.sh [SHAPE...]            (default shapes: llama-7b llama-1b)
# Needs `REAL=1 scripts/gpu-pack.sh` (.gpu/r1) and `PY=1 scripts/gpu-pack.sh` (.gpu/py) made
# here and carried (the run's carry: .gpu). SmolLM2's converted files (94 MB) do not fit a
# transfer beside the binaries, so the Python checks run on its random-weight twin of the
# same shape (scripts/synth-model.py smollm2-135m, drawn on the GPU, converted to Q4_0 there):
# $OUT/py (scripts/gpu-python.sh). Then scripts/gpu-real-size.sh with the environment given
# (SWEEP, STREAM, IO_RUNS, SERVE, TINY, QUANT; REAL_LIMIT seconds, default 450): $OUT/real.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
W=${WORK:-/tmp/gdsllm-real}
mkdir -p "$OUT/py" "$OUT/real" "$W/bin"
tar -xJf .gpu/r1/bins.tar.xz -C "$W/bin" --strip-components=1
T0=$SECONDS
{
  SUM=$OUT/py/summary.txt MODEL=$W
  # shellcheck source=scripts/gpu-env.sh
  . scripts/gpu-env.sh
  rm -rf /tmp/smol-ck
  timeout 90 python3 scripts/synth-model.py smollm2-135m /tmp/smol-ck --tokenizer .gpu/r1/tok \
    --init-device cuda &&
    timeout 30 "$W/bin/gdsconv" convert /tmp/smol-ck "$W/smol.gds" --quant q4_0 --force &&
    timeout 150 scripts/gpu-python.sh .gpu/py "$W/smol.gds" "$W/bin/gdsrun" "$OUT/py"
  echo "python stage: exit $? in $((SECONDS - T0)) s" >>"$OUT/py/summary.txt"
} >"$OUT/py/log.txt" 2>&1
# few files come back from a lent machine: the summary, and the rest in one tarball
(cd "$OUT/py" && tar -czf details.tar.gz --exclude summary.txt --exclude details.tar.gz . &&
  find . -type f ! -name summary.txt ! -name details.tar.gz -delete)
OUT=$OUT/real timeout "${REAL_LIMIT:-450}" scripts/gpu-real-size.sh .gpu/r1 "${@:-llama-7b llama-1b}" \
  >"$OUT/real/stdout.txt" 2>&1
echo "real-size: exit $? after $((SECONDS - T0)) s" >>"$OUT/real/summary.txt"
