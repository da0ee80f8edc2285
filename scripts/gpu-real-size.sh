#!/usr/bin/env bash
# The GPU at real sizes (issue 36) in one run on a lent GPU machine; results under $OUT:
#   scripts/gpu-real-size.sh PACK_DIR [SHAPE[@LAYERS]...]  (default shapes: llama-7b llama-1b;
#   e.g. qwen3-30b-a3b@8: the first 8 blocks of that shape, a mixture of experts' slice)
# PACK_DIR (`REAL=1 scripts/gpu-pack.sh` makes it: .gpu/r1) holds bins.tar.xz (gdsrun and
# bench_gpu built with --features cuda, gdsconv; with BASELINE=COMMIT also gdsrun-base, COMMIT's
# whole build: the resident benchmarks then run this build, the baseline, this build again) and tok/ (SmolLM2's tokenizer files: the
# synthetic models' vocabulary). The GPU machine has PyTorch and transformers, no network and
# no Rust. ANCHOR: llama.cpp's CUDA pack (scripts/build-llama-cpp-cuda.sh; carry it to the
# machine in a call of its own and copy it out of the work tree), run beside gdsrun. QUANT: gdsconv's --quant for the shapes (default q4_0; keep: F16); STREAM=0 skips
# the streamed runs of stage 3 (IO_RUNS: their load paths, default "gds direct mmap"); SWEEP=0 the batched sweeps. TINY=0 skips the tiny fixtures' stages (2, 4, 5). Stages, each under a time limit; the script goes on after a failure:
#  1. the machine: GPU, driver, nvidia-fs, cuFile mode (`gdsrun doctor`);
#  2. the tiny architectures (fixtures/tiny-*.gguf, converted here): CUDA --activations f32 vs CPU
#     f32 greedy tokens, all resident and at the minimum VRAM budget (the one-sequence path of
#     the engine); then CUDA's default int8 activations vs the CPU's default q8, all resident
#     (the prompt kept off the f16 GEMMs: --gemm-min-tokens 1000), and every pass through the
#     int8 tensor-core products (GDS_CUDA_MMQ=1 --gemm-min-tokens 1) vs the CPU's q8;
#  3. per SHAPE: random weights drawn by transformers on the GPU (scripts/synth-model.py
#     --init-device cuda, F16 safetensors in RAM), converted to Q4_0 by gdsconv onto the disk;
#     `gdsrun bench --backend cuda` all resident (pp512, tg128; default int8 activations), and
#     pp512/tg128 again with --activations f32 (the f32-activation kernels and plain f32 SGEMM
#     prefill: the int8 kernels' and TF32 prefill's A/B on one binary) and tg128 with
#     --cuda-graphs off (every decode kernel launched each step: the graphs' A/B), pp512 and
#     tg128 with GDS_CUDA_FUSE=0 (every op launched alone: the fused launches' A/B), tg128 with
#     the int8 kernels at other block shapes (GDS_CUDA_MMQ8; MMQ8_SWEEP), pp512 with the former
#     dequantization (GDS_CUDA_DEQ_PER_LANE=1: the staged stores' A/B), pp512 through the
#     int8 tensor-core kernels (GDS_CUDA_MMQ=1: their A/B against the f16 tiles, and a long
#     prompt's greedy tokens through them vs the int8 matvecs), pp512 with
#     --gemm-type tf32 (f32 tiles on TF32 tensor cores: the f16 GEMM's A/B); the time per kernel of a
#     pp512 and of 32 decode steps (GDS_CUDA_PROFILE=1: json/profile-SHAPE-*.txt in the tarball); then with about a quarter of
#     the blocks in VRAM, decode through `--io gds`, `direct` and `mmap`: t/s, bytes read per
#     token, and the bound (O_DIRECT read bandwidth of the layer files / bytes per token);
#     batched decode through the engine (`gdsrun batch`, B = 1, 4, 16, 64 requests at once;
#     resident also with GDS_GEMM_MIN_TOKENS=128, the matvec/GEMM crossover, and through the
#     tensor-core products from 16 tokens (GDS_CUDA_MMQ=1 GDS_GEMM_MIN_TOKENS=16), B >= 4: one
#     token per pass never reaches the crossover),
#     all resident and at the quarter budget;
#     the server on the GPU against llama-server (scripts/gpu-serve-bench.py, concurrency
#     1..64: resident, and for llama-1b at the quarter budget; SERVE=0 skips it);
#  4. the server on the GPU (scripts/gpu-serve-check.py, tiny llama): concurrent greedy requests,
#     `--backend cuda --activations f32` replies against `--backend cpu --activations f32` (also
#     on llama-1b);
#  5. compute-sanitizer memcheck on a streamed `--io gds` run and over a batched streamed
#     `gdsrun batch` (tiny llama).
set -u
PACK=$(realpath "$1"); shift
SHAPES=${*:-llama-7b llama-1b} QUANT=${QUANT:-q4_0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu-out}
W=${WORK:-/tmp/gdsllm-real}
mkdir -p "$OUT/json" "$W"
SUM="$OUT/summary.txt" LOG="$OUT/log.txt"
# shellcheck source=scripts/gpu-results.sh
. "$(dirname "$0")/gpu-results.sh"

mkdir -p "$W/bin" "$W/tiny"
tar -xJf "$PACK/bins.tar.xz" -C "$W/bin" --strip-components=1
G="$W/bin/gdsrun" C="$W/bin/gdsconv"
MODEL=$W CUFILE_LOGS=/tmp/cufile-logs
# shellcheck source=scripts/gpu-env.sh
. "$ROOT/scripts/gpu-env.sh"
say "== machine $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv >>"$SUM" 2>&1
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc); ram $(free -g | awk '/Mem/{print $2}') GiB"
say "nvidia-fs: $(ls /proc/driver/nvidia-fs 2>&1 | tr '\n' ' ')"
say "python: $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"
for f in "$ROOT"/fixtures/tiny-*.gguf; do
  n=$(basename "$f" .gguf)
  "$C" convert "$f" "$W/tiny/${n#tiny-}" --force >/dev/null 2>>"$LOG" || say "convert $f failed"
done
TL="$W/tiny/llama"
run 30 doctor "$G" doctor "$TL"
sed -n '/cuda feature/,/gpu path/p' "$LOG" | tail -12 >>"$SUM"
say "model filesystem: $(df -T "$W" | tail -1)"

plan() { # plan DIR FILE [ARGS...]: the CUDA plan as JSON
  local d=$1 f=$2; shift 2
  "$G" run "$d" --raw -p x -n 1 --backend cuda --plan "$@" >"$f" 2>>"$LOG"
}
budget() { # budget PLAN_JSON all|min|quarter: a --vram-budget in bytes
  python3 -c "import json,sys;g=json.load(open(sys.argv[1]))['gpu'];lo,hi=g['min_budget_bytes'],g['all_resident_budget_bytes'];print({'all':hi,'min':lo,'quarter':lo+(hi-lo)//4}[sys.argv[2]])" "$1" "$2"
}

# batched decode through the engine: `gdsrun batch` of B requests at once (one wave, max batch B),
# the aggregate t/s it prints, for B in 1 4 16 64; its paged KV cache: KVB MiB (f32, the GPU's type) (the
# budgets below add KVB to the one-sequence plan's)
KVB=4096
sweep() { # sweep LABEL DIR TOKENS [gdsrun batch flags...] (BS: the batch sizes, default 1 4 16 64)
  local label=$1 dir=$2 n=$3; shift 3
  local line="" b
  for b in ${BS:-1 4 16 64}; do
    python3 - "$b" "$n" >"$W/req.jsonl" <<'PY'
import json, sys
b, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(b):
    print(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": f"Request {i}: the history of the printing press", "max_tokens": n,
                               "temperature": 0, "ignore_eos": True}}))
PY
    rm -f "$W/out.jsonl"
    timeout 150 "$G" batch "$dir" -i "$W/req.jsonl" -o "$W/out.jsonl" -q -c 64 --max-batch "$b" \
      --kv-budget "$KVB" --backend cuda "$@" >"$W/batch.txt" 2>&1
    cat "$W/batch.txt" >>"$LOG"
    line="$line B=$b: $(grep -o '[0-9.]* tok/s' "$W/batch.txt" | tail -1 || true)"
    grep -q 'tok/s' "$W/batch.txt" || line="$line failed ($(grep -m1 error "$W/batch.txt" | cut -c1-160))"
  done
  say "[batch $label, $n tokens per request]$line"
}

say "== tiny architectures: CUDA vs CPU f32, 16 greedy tokens (all resident, minimum budget; --io direct); CUDA int8 vs CPU q8, CUDA f16 KV vs CPU f16 KV (all resident)"
T0=$SECONDS
[ "${TINY:-1}" = 1 ] || T0=-1000
for d in "$W"/tiny/*/; do
  a=$(basename "$d") p="Hello world, this is"
  [ "$T0" -ge 0 ] || continue
  [ $((SECONDS - T0)) -lt 120 ] || { say "[tiny $a] skipped: the stage's 120 s are spent"; continue; }
  "$G" run "$d" --raw -p "$p" -n 16 --temp 0 --backend cpu --activations f32 --kv-type f32 --json \
    >"$OUT/json/tiny-$a-cpu.json" 2>>"$LOG"
  plan "$d" "$OUT/json/tiny-$a-plan.json" --kv-type f32 || { say "[tiny $a] cuda plan failed: $(tail -2 "$LOG")"; continue; }
  "$G" run "$d" --raw -p "$p" -n 16 --temp 0 --backend cpu --activations q8 --kv-type f32 --json \
    >"$OUT/json/tiny-$a-cpu-q8.json" 2>>"$LOG"
  "$G" run "$d" --raw -p "$p" -n 16 --temp 0 --backend cpu --activations f32 --kv-type f16 --json \
    >"$OUT/json/tiny-$a-cpu-f16.json" 2>>"$LOG"
  for b in all min q8 f16 mmq; do
    ref=cpu act=f32 vb=$b kv=f32 gm=8 mmq=0
    # the prompt through the int8 kernels too, as the CPU's q8 runs it (a prompt of 8 or more
    # tokens would be prefilled by f16 GEMMs: 2026-12-04's near-tie on tiny gpt-oss MXFP4)
    [ "$b" = q8 ] && ref=cpu-q8 act=q8 vb=all gm=1000
    [ "$b" = f16 ] && ref=cpu-f16 vb=all kv=f16 # the f16 KV cache (the default) vs the CPU's
    # every pass, the prompt and each decode step, through the int8 tensor-core products
    # (GDS_CUDA_MMQ=1, --gemm-min-tokens 1) vs the CPU's q8: their fragments on hardware
    [ "$b" = mmq ] && ref=cpu-q8 act=q8 vb=all gm=1 mmq=1
    timeout 60 env GDS_CUDA_MMQ=$mmq "$G" run "$d" --raw -p "$p" -n 16 --temp 0 --backend cuda --io direct --activations $act \
      --gemm-min-tokens $gm --kv-type $kv --vram-budget "$(budget "$OUT/json/tiny-$a-plan.json" $vb)" --json >"$OUT/json/tiny-$a-$b.json" 2>>"$LOG"
    python3 - "$OUT/json/tiny-$a-$ref.json" "$OUT/json/tiny-$a-$b.json" "tiny $a $b" <<'EOF' | tee -a "$SUM"
import json, sys
try:
    r, d = json.load(open(sys.argv[1]))["tokens"], json.load(open(sys.argv[2]))
    t = d["tokens"]
    same = next((i for i, (x, y) in enumerate(zip(r, t)) if x != y), None)
    what = "equal" if same is None and len(r) == len(t) else f"FIRST DIFFERENCE at token {same}"
    print(f"[{sys.argv[3]}] {len(t)} tokens {what}; {d['metrics']['tokens_per_sec']:.0f} t/s")
except Exception as e:
    print(f"[{sys.argv[3]}] no result ({e})")
EOF
  done
done

# llama.cpp with CUDA (the tarball of scripts/build-llama-cpp-cuda.sh, carried in its own
# transfer) when ANCHOR names it: the same checkpoint converted by its converter, quantized by
# its llama-quantize, and llama-bench beside gdsrun bench
L=""
if [ -n "${ANCHOR:-}" ]; then
  L="$W/llama" && rm -rf "$L" && mkdir -p "$L"
  if tar -xJf "$ANCHOR" -C "$L" && [ -x "$L/bin/llama-bench" ]; then
    LLD="$L/lib:$LD_LIBRARY_PATH"
    say "anchor: $(head -1 "$L/README")"
  else
    say "anchor: cannot unpack $ANCHOR"; L=""
  fi
fi

# the checkpoint goes to RAM when /dev/shm has room for a 7B F16 (14 GB), else to the disk
CK=/dev/shm/gdsllm-ck
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 20 ] 2>/dev/null || CK="$W/ck"
for spec in $SHAPES; do
  shape=${spec%@*} layers=()
  [ "$spec" = "$shape" ] || { layers=(--layers "${spec#*@}"); shape="$shape-${spec#*@}l"; }
  say "== $shape: random weights (transformers on the GPU), converted by gdsconv --quant $QUANT"
  rm -rf "$CK"
  run 240 "synth-$shape" python3 "$ROOT/scripts/synth-model.py" "${spec%@*}" "$CK" --tokenizer "$PACK/tok" \
    --init-device cuda "${layers[@]}" || continue
  grep '"shape"' "$LOG" | tail -1 | cut -c1-300 >>"$SUM"
  M="$W/$shape.gds"
  [ "$QUANT" = q4_0 ] || M="$W/$shape-$QUANT.gds"
  run 300 "convert-$shape" "$C" convert "$CK" "$M" --quant "$QUANT" --force --json || continue
  if [ -n "$L" ]; then
    run 300 "gguf-$shape" python3 "$L/py/convert_hf_to_gguf.py" "$CK" --outfile "$W/$shape-f16.gguf" --outtype f16 &&
      run 180 "quantize-$shape" env LD_LIBRARY_PATH="$LLD" "$L/bin/llama-quantize" "$W/$shape-f16.gguf" "$W/$shape-q4_0.gguf" Q4_0
  fi
  rm -rf "$CK"
  say "model: $(du -sh "$M" | cut -f1), $(ls "$M/layers" | wc -l) layer files"
  # the plan at the context of the streamed runs below (-c 512): the KV cache takes its share of VRAM
  plan "$M" "$OUT/json/$shape-plan.json" -c 512 || { say "[$shape] cuda plan failed: $(tail -3 "$LOG")"; continue; }
  run 240 "bench-$shape-resident" "$G" bench "$M" --backend cuda -p 512 -n 128 -r 2
  grep -E "^\|" "$LOG" | tail -2 >>"$SUM"
  # the prompt's products on the tensor cores straight from the blocks (GDS_CUDA_MMQ=1, the
  # mmq_* kernels) instead of dequantized f16 tiles and cuBLAS: the A/B, and greedy tokens of
  # a 100-token prompt through them vs through the int8 matvecs (--gemm-min-tokens 1000)
  run 120 "bench-$shape-resident-mmq" env GDS_CUDA_MMQ=1 "$G" bench "$M" --backend cuda -p 512 -n 0 -r 2
  grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (GDS_CUDA_MMQ=1)/' >>"$SUM"
  lp=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog'] * 11))")
  for v in mmq vec; do
    mm=1 gm=32; [ $v = vec ] && mm=0 gm=1000
    timeout 120 env GDS_CUDA_MMQ=$mm "$G" run "$M" --raw -p "$lp" -n 16 --temp 0 --backend cuda \
      --gemm-min-tokens $gm --json >"$OUT/json/$shape-long-$v.json" 2>>"$LOG"
  done
  python3 - "$OUT/json/$shape-long-vec.json" "$OUT/json/$shape-long-mmq.json" "$shape long prompt mmq vs int8 matvecs" <<'EOF' | tee -a "$SUM"
import json, sys
try:
    r, t = (json.load(open(f))["tokens"] for f in sys.argv[1:3])
    same = next((i for i, (x, y) in enumerate(zip(r, t)) if x != y), None)
    print(f"[{sys.argv[3]}] {len(t)} tokens " + ("equal" if same is None and len(r) == len(t) else f"FIRST DIFFERENCE at token {same}"))
except Exception as e:
    print(f"[{sys.argv[3]}] no result ({e})")
EOF
  # the same binary with the f32-activation matvec kernels and plain f32 SGEMM prefill (the
  # int8 kernels' and the TF32 tensor-core prefill's A/B)
  run 120 "bench-$shape-resident-f32-act" "$G" bench "$M" --backend cuda --activations f32 -p 512 -n 128 -r 2
  grep -E "^\|" "$LOG" | tail -2 | sed 's/$/ (--activations f32)/' >>"$SUM"
  # decode without CUDA graphs (every kernel launched each step): the graphs' A/B
  run 120 "bench-$shape-resident-no-graphs" "$G" bench "$M" --backend cuda --cuda-graphs off -p 512 -n 128 -r 2
  grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (--cuda-graphs off)/' >>"$SUM"
  # every op launched alone (GDS_CUDA_FUSE=0: no norm or activation quantizing its output,
  # RoPE apart from the KV store, Q/K/V and gate/up in separate launches): the fusions' A/B
  run 120 "bench-$shape-resident-no-fuse" env GDS_CUDA_FUSE=0 "$G" bench "$M" --backend cuda -p 512 -n 128 -r 2
  grep -E "^\|" "$LOG" | tail -2 | sed 's/$/ (GDS_CUDA_FUSE=0)/' >>"$SUM"
  # the int8 matvec kernels at other block shapes (GDS_CUDA_MMQ8=WARPSxROWS recompiles them
  # at open; the default is 4x2): decode only, the kernels' sweep on one binary (MMQ8_SWEEP
  # lists the shapes, empty skips it)
  # shellcheck disable=SC2086 # the list is split into shapes
  for v in ${MMQ8_SWEEP-4x1 8x1 2x2 8x2 2x4}; do
    run 90 "bench-$shape-resident-mmq8-$v" env GDS_CUDA_MMQ8="$v" "$G" bench "$M" --backend cuda -p 0 -n 128 -r 2
    grep -E "^\|" "$LOG" | tail -1 | sed "s/\$/ (GDS_CUDA_MMQ8=$v)/" >>"$SUM"
  done
  # the dequantization kernels each lane writing its own block (GDS_CUDA_DEQ_PER_LANE=1, the
  # way before 2026-12-04's staged stores): the tile's A/B, prefill only
  run 120 "bench-$shape-resident-deq-per-lane" env GDS_CUDA_DEQ_PER_LANE=1 "$G" bench "$M" --backend cuda -p 512 -n 0 -r 2
  grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (GDS_CUDA_DEQ_PER_LANE=1)/' >>"$SUM"
  # prefill with TF32 GEMMs over f32 tiles (the default is f16 tiles and cublasGemmEx): the
  # f16 GEMM's A/B
  run 120 "bench-$shape-resident-tf32" "$G" bench "$M" --backend cuda --gemm-type tf32 -p 512 -n 0 -r 2
  grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (--gemm-type tf32)/' >>"$SUM"
  # where the GPU time goes, kernel by kernel (GDS_CUDA_PROFILE: each call synchronized and
  # timed, graphs off; no nsys on these machines): one 512-token prefill, then 32 decode steps
  for t in "-p 512 -n 0" "-p 0 -n 32"; do
    f="$OUT/json/profile-$shape-$(echo "$t" | tr -d ' -').txt"
    # shellcheck disable=SC2086
    GDS_CUDA_PROFILE=1 timeout 120 "$G" bench "$M" --backend cuda $t -r 1 >/dev/null 2>"$f"
    # the three longest kernels: the rows after the table's two header lines (other stderr
    # lines may come before it)
    say "[profile $shape $t] $(awk '/^GPU time by kernel/ {h = NR} h && NR > h + 1 && NR <= h + 4 {printf "%s %s ms %s; ", $1, $2, $3}' "$f")"
  done
  # Nsight Compute where the machine has it: memory and compute throughput (% of peak) of a
  # few launches of the decode and tile kernels and cuBLAS's GEMM (a 16-token prompt takes
  # the GEMM path, the 4 steps after it the matvec kernels); NCU=0 skips it
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  if [ "${NCU:-1}" = 1 ] && [ -n "$NCU_BIN" ]; then
    f="$OUT/json/ncu-$shape.txt"
    timeout 150 "$NCU_BIN" --clock-control none --section SpeedOfLight \
      -k 'regex:matvec_q8|dequant16|gemm|attention|rmsnorm|quantize_q8' --launch-skip 20 --launch-count 24 \
      "$G" bench "$M" --backend cuda --cuda-graphs off -p 16 -n 4 -r 1 >"$f" 2>&1
    say "[ncu $shape] $(awk '/^  [a-z_0-9]+.*\(/ {k = $1 == "void" ? $2 : $1} /DRAM Throughput/ {m=$NF} /Duration/ {printf "%s %s %s DRAM %s%%; ", substr(k, 1, 40), $NF, $(NF-1), m}' "$f" | head -c 1500)"
  fi
  for g in q4_0 f16; do # llama.cpp on the GGUFs of the same checkpoint
    [ -f "$W/$shape-$g.gguf" ] || continue
    run 240 "llama-bench-$shape-$g" env LD_LIBRARY_PATH="$LLD" "$L/bin/llama-bench" -m "$W/$shape-$g.gguf" \
      -p 512 -n 128 -ngl 99 -r 2
    grep -E "^\|" "$LOG" | tail -2 >>"$SUM"
  done
  rm -f "$W/$shape"-f16.gguf
  if [ -x "$W/bin/gdsrun-base" ]; then # the A/B of kernel changes: baseline, then this build again
    run 240 "bench-$shape-resident-base-$(cat "$W/bin/BASELINE")" "$W/bin/gdsrun-base" bench "$M" \
      --backend cuda -p 512 -n 128 -r 2
    grep -E "^\|" "$LOG" | tail -2 >>"$SUM"
    run 240 "bench-$shape-resident-again" "$G" bench "$M" --backend cuda -p 512 -n 128 -r 2
    grep -E "^\|" "$LOG" | tail -2 >>"$SUM"
  fi
  # the server on the GPU against llama-server (CUDA, -ngl 99) on the GGUF of the same
  # checkpoint, concurrency 1..64, all resident (issue 31's GPU target; SERVE=0 skips it)
  G16="$W/$shape-q4_0.gguf"
  if [ "${SERVE:-1}" = 1 ] && [ "$QUANT" = q4_0 ]; then
    timeout 420 python3 "$ROOT/scripts/gpu-serve-bench.py" --gdsrun "$G" --model "$M" --label "$shape resident" \
      ${L:+--llama-server "$L/bin/llama-server" --gguf "$G16" --llama-lib "$LLD"} 2>>"$LOG" | tee -a "$SUM"
    # 16 clients with the former crossover, 8, which sent their passes to the GEMMs (c=16 was
    # slower than c=4 on 2026-12-04; since 2026-12-05 passes up to 31 tokens stay on the
    # int8 matvec kernels by default): the A/B of that change; SERVE_AB=0 skips it
    [ "${SERVE_AB:-1}" = 1 ] && GDS_GEMM_MIN_TOKENS=8 timeout 200 python3 "$ROOT/scripts/gpu-serve-bench.py" \
      --gdsrun "$G" --model "$M" --label "$shape resident, GDS_GEMM_MIN_TOKENS=8" -c 16 2>>"$LOG" | tee -a "$SUM"
  fi
  [ "${STREAM:-1}" = 1 ] || { rm -f "$G16"; continue; }
  # O_DIRECT read bandwidth of the layer files (the streaming bound's numerator)
  sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
  bw=$(python3 - "$M/layers" <<'EOF'
import os, sys, time, mmap
d = sys.argv[1]; buf = mmap.mmap(-1, 64 << 20); total = 0; t = time.perf_counter()
for f in sorted(os.listdir(d))[:24]:
    fd = os.open(os.path.join(d, f), os.O_RDONLY | os.O_DIRECT)
    while (n := os.readv(fd, [buf])) > 0: total += n
    os.close(fd)
print(f"{total / (time.perf_counter() - t):.0f}")
EOF
)
  say "O_DIRECT read bandwidth (64 MiB reads, one thread): $((${bw:-0} / 1000000)) MB/s"
  Q=$(budget "$OUT/json/$shape-plan.json" quarter)
  plan "$M" "$OUT/json/$shape-plan-quarter.json" -c 512 --vram-budget "$Q"
  say "quarter budget $Q B: $(python3 -c "import json,sys;g=json.load(open(sys.argv[1]))['gpu'];print(len(g['resident_layers']),'layers resident,',len(g['streamed_layers']),'streamed,',g['streamed_bytes_per_token'],'B/token streamed')" "$OUT/json/$shape-plan-quarter.json" 2>&1)"
  if [ "${SWEEP:-1}" = 1 ]; then # SWEEP=0 skips the batched sweeps
    sweep "$shape resident" "$M" 32
    # the GEMM crossover: passes of fewer tokens than this stay on the matvec kernels (default
    # 32 with 8-bit activations, 8 with f32)
    GDS_GEMM_MIN_TOKENS=128 BS="4 16 64" sweep "$shape resident, GDS_GEMM_MIN_TOKENS=128" "$M" 32
    # batched decode of 16 and 64 sequences through the int8 tensor-core products
    # (GDS_CUDA_MMQ=1, from 16 tokens a pass): where the crossover goes with them
    GDS_CUDA_MMQ=1 GDS_GEMM_MIN_TOKENS=16 BS="16 64" sweep "$shape resident, GDS_CUDA_MMQ=1 GDS_GEMM_MIN_TOKENS=16" "$M" 32
    sweep "$shape quarter direct" "$M" 8 --vram-budget "$((Q + KVB * 1048576))" --io direct
  fi
  n=16; [ "$shape" = llama-7b ] && n=8
  for io in ${IO_RUNS:-gds direct mmap}; do
    [ "$io" = mmap ] || { sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; }
    f="$OUT/json/$shape-quarter-$io.json"
    timeout 150 "$G" run "$M" --raw -p "The history of the printing press" -n $n --temp 0 --backend cuda \
      --vram-budget "$Q" --io "$io" -c 512 --json >"$f" 2>>"$LOG"
    python3 - "$f" "$shape quarter $io" "${bw:-0}" "$?" <<'EOF' | tee -a "$SUM"
import json, sys
try:
    m = json.load(open(sys.argv[1]))["metrics"]; bw = float(sys.argv[3])
    b = m["bytes_read_per_token"]; bound = bw / b if b else float("inf")
    print(f"[{sys.argv[2]}] {m['tokens_per_sec']:.2f} t/s decode, {b / 1e6:.0f} MB read/token, "
          f"bound {bound:.2f} t/s (O_DIRECT bandwidth / bytes per token) = {m['tokens_per_sec'] / bound:.2f} of it; "
          f"ttft {m['time_to_first_token_ms']:.0f} ms, energy {m['energy_joules']} J ({m['energy_source']})")
except Exception as e:
    print(f"[{sys.argv[2]}] rc={sys.argv[4]}: no result ({e})")
EOF
  done
  [ "$shape" = llama-1b ] && timeout 150 python3 "$ROOT/scripts/gpu-serve-check.py" "$G" "$M" --requests 8 \
    2>>"$LOG" | sed "s/^/[$shape] /" | tee -a "$SUM"
  # the server streaming a quarter of the blocks (1B only: at 7B one request decodes at ~0.5
  # t/s, too slow for the loan); llama-server with the same number of blocks on the GPU (-ngl)
  # and the rest on the CPU, its way of fitting the same VRAM
  if [ "${SERVE:-1}" = 1 ] && [ "$QUANT" = q4_0 ] && [ "$shape" = llama-1b ]; then
    ngl=$(python3 -c "import json,sys;g=json.load(open(sys.argv[1]))['gpu'];n=len(g['resident_layers'])+len(g['streamed_layers']);print(sum(1 for i in g['resident_layers'] if 0<i<n-1))" "$OUT/json/$shape-plan-quarter.json" 2>/dev/null || echo 0)
    timeout 420 python3 "$ROOT/scripts/gpu-serve-bench.py" --gdsrun "$G" --model "$M" --label "$shape quarter" \
      --vram-budget "$((Q + 1024 * 1048576))" --kv-budget 1024 --max-tokens 16 \
      ${L:+--llama-server "$L/bin/llama-server" --gguf "$G16" --llama-lib "$LLD" --ngl "$ngl"} 2>>"$LOG" | tee -a "$SUM"
  fi
  rm -f "$G16"
done

[ "${TINY:-1}" = 1 ] || { say "== done $(date -u +%FT%TZ) (TINY=0: no tiny stages)"; exit 0; }
say "== the server on the GPU (tiny llama): concurrent greedy requests, cuda vs cpu f32"
timeout 120 python3 "$ROOT/scripts/gpu-serve-check.py" "$G" "$TL" --ctx 256 2>>"$LOG" | tee -a "$SUM"
timeout 120 python3 "$ROOT/scripts/gpu-serve-check.py" "$G" "$TL" --ctx 256 --vram-budget streamed 2>>"$LOG" | tee -a "$SUM"

CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  say "== compute-sanitizer memcheck on a streamed --io gds run (tiny llama)"
  run 90 sanitizer-memcheck-gds "$CS" --tool memcheck --error-exitcode 9 "$G" run "$TL" --raw -p Hello -n 4 \
    --temp 0 --backend cuda --io gds --vram-budget "$(budget "$OUT/json/tiny-llama-plan.json" min)"
  grep -E "ERROR SUMMARY" "$LOG" | tail -1 | tee -a "$SUM"
  say "== compute-sanitizer memcheck over a batched streamed run (gdsrun batch, 6 requests, max batch 3, tiny llama)"
  python3 -c 'import json
for i in range(6): print(json.dumps({"custom_id": f"m{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hello " * (i + 1), "max_tokens": 6, "temperature": 0}}))' >"$W/mreq.jsonl"
  rm -f "$W/mout.jsonl"
  run 120 sanitizer-memcheck-batch "$CS" --tool memcheck --report-api-errors no --error-exitcode 9 "$G" batch "$TL" \
    -i "$W/mreq.jsonl" -o "$W/mout.jsonl" -q --max-batch 3 --backend cuda --io direct --kv-budget 16 \
    --vram-budget "$(($(budget "$OUT/json/tiny-llama-plan.json" min) + 16 * 1048576))"
  grep -E "ERROR SUMMARY" "$LOG" | tail -1 | tee -a "$SUM"
fi
say "== done $(date -u +%FT%TZ)"
