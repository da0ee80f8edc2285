#!/usr/bin/env bash
# Issue 13's bring-up on a real GPU, as one script whose results land under $OUT:
#   scripts/gpu-bringup.sh BIN_DIR MODEL_DIR TINY_DIR [quick|model|smollm|full|anchor]
# BIN_DIR holds `gdsrun` and `bench_gpu` built here with `--features cuda` (scripts/gpu-pack.sh
# builds and packs them with the models; the GPU machine has no Rust toolchain). MODEL_DIR is
# the converted SmolLM2, TINY_DIR the converted tiny architecture fixtures (one per arch).
#   quick: the machine (doctor, libraries, nvidia-fs, cuFile mode) and the tiny architectures
#          (CUDA vs CPU f32 greedy tokens), compute-sanitizer on a tiny streamed run.
#   model: the machine, then greedy tokens and perplexity of MODEL_DIR alone (as below);
#   anchor: the machine, then llama.cpp's llama-bench with CUDA (prebuilt here: LLAMA_PACK, the
#          tarball of scripts/build-llama-cpp-cuda.sh) on GGUF (env) against gdsrun bench on
#          MODEL_DIR (the same model);
#   smollm: the machine, then SmolLM2 (below); full: quick, then SmolLM2: greedy tokens and perplexity at all-resident, half and minimum
#          --vram-budget for each load path against --backend cpu --activations f32;
#          compute-sanitizer memcheck and racecheck on a short streamed run (--io direct; memcheck also on gds);
#          load bandwidth and decode t/s at five budgets (bench_gpu); gdsrun bench; NVML energy and --max-joules.
# Every step has a timeout and the script goes on after a failure: what failed is in the log.
set -u
BIN=$(realpath "$1") MODEL=$(realpath "$2") TINY=$(realpath "$3") STAGE=${4:-full}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/json"
SUM="$OUT/summary.txt" LOG="$OUT/log.txt"
# shellcheck source=scripts/gpu-results.sh
. "$(dirname "$0")/gpu-results.sh"

sanitize() { # sanitize SECONDS TOOL LABEL DIR IO BUDGET TOKENS: a short streamed run under compute-sanitizer
  run "$1" "sanitizer-$2-$3" "$CS" --tool "$2" --error-exitcode 9 \
    "$G" run "$4" --raw -p "Hello" -n "$7" --temp 0 --backend cuda --io "$5" --vram-budget "$6"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG" | tail -1 | tee -a "$SUM"
}

CUFILE_LOGS=/tmp/cufile-logs
# shellcheck source=scripts/gpu-env.sh
. "$(dirname "$0")/gpu-env.sh"

G="$BIN/gdsrun"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
say "== machine $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv >>"$SUM" 2>&1
run 30 doctor "$G" doctor "$MODEL"
sed -n '/cuda feature/,/gpu path/p' "$LOG" | tail -12 >>"$SUM"
say "nvidia-fs: $(ls /proc/driver/nvidia-fs 2>&1 | tr '\n' ' ')"
say "modules: $(grep -E '^nvidia' /proc/modules 2>/dev/null | cut -d' ' -f1 | tr '\n' ' ')"
for t in /usr/local/cuda/gds/tools/gdscheck /usr/local/cuda*/gds/tools/gdscheck.py; do
  [ -e "$t" ] && run 60 gdscheck "$t" -p && break
done
say "model filesystem: $(df -T "$MODEL" | tail -1)"
for extra in "" "--kv-type f16"; do # --backend auto: the GPU, or the CPU with the reason
  say "[auto ${extra:-default}] $("$G" run "$MODEL" --raw -p x -n 1 --plan $extra 2>&1 |
    python3 -c 'import json,sys; p=json.load(sys.stdin); print(p["backend"], "-", p["backend_reason"])' 2>&1 | tail -1)"
done
if dd if="$MODEL/layers/embed.bin" of=/dev/null bs=8M iflag=direct 2>/tmp/dd.txt; then
  say "O_DIRECT read of embed.bin: $(tail -1 /tmp/dd.txt)"
else
  say "O_DIRECT refused on the model's filesystem: $(tail -1 /tmp/dd.txt)"
fi

# budget LABEL all|half|min: the --vram-budget, in bytes, from the CUDA plan greedy() saved
budget() {
  python3 -c "import json,sys;g=json.load(open(sys.argv[1]))['gpu'];lo,hi=g['min_budget_bytes'],g['all_resident_budget_bytes'];print({'all':hi,'half':(lo+hi)//2,'min':lo}[sys.argv[2]])" \
    "$OUT/json/$1-plan.json" "$2"
}

# greedy TOKENS on MODEL with PROMPT: CPU f32 reference vs CUDA (--activations f32) at budgets x paths
greedy() { # greedy LABEL DIR N PROMPT BUDGETS PATHS
  local label=$1 dir=$2 n=$3 prompt=$4 budgets=$5 paths=$6
  "$G" run "$dir" --raw -p "$prompt" -n "$n" --temp 0 --backend cpu --activations f32 --kv-type "${KV:-f32}" --json \
    >"$OUT/json/$label-cpu.json" 2>>"$LOG" || say "[$label] cpu reference failed"
  "$G" run "$dir" --raw -p x -n 1 --backend cuda --kv-type "${KV:-f32}" --plan >"$OUT/json/$label-plan.json" 2>>"$LOG" ||
    { say "[$label] cuda plan failed: $(tail -2 "$LOG")"; return; }
  for b in $budgets; do
    for io in $paths; do
      local v
      v=$(budget "$label" "$b")
      local f="$OUT/json/$label-cuda-$b-$io.json"
      echo "### $label cuda budget=$b ($v) io=$io" >>"$LOG"
      timeout 120 "$G" run "$dir" --raw -p "$prompt" -n "$n" --temp 0 --backend cuda --vram-budget "$v" \
        --io "$io" --activations f32 --kv-type "${KV:-f32}" --json >"$f" 2>>"$LOG"
      local rc=$?
      python3 - "$OUT/json/$label-cpu.json" "$f" "$label" "$b" "$io" "$rc" <<'EOF' | tee -a "$SUM"
import json, sys
ref, got, label, b, io, rc = sys.argv[1:]
try:
    r = json.load(open(ref))["tokens"]
    d = json.load(open(got))
    t, m = d["tokens"], d["metrics"]
    same = next((i for i, (a, c) in enumerate(zip(r, t)) if a != c), None)
    what = "equal" if same is None and len(r) == len(t) else f"first difference at token {same}"
    print(f"[{label} {b} {io}] {len(t)} tokens {what}; {m['tokens_per_sec']:.1f} t/s, "
          f"ttft {m['time_to_first_token_ms']:.1f} ms, streamed/token {m['bytes_read_per_token']:.0f} B, "
          f"energy {m['energy_joules']} J ({m['energy_source']})")
except Exception as e:
    print(f"[{label} {b} {io}] rc={rc}: no result ({e})")
EOF
    done
  done
}

if [ "$STAGE" = anchor ]; then
  # llama.cpp with CUDA for sm_90, built on the development machine by
  # scripts/build-llama-cpp-cuda.sh (LLAMA_PACK: its llama-cuda-sm90.tar.xz, carried by
  # gpu-pack.sh LLAMA=1), on the GGUF (GGUF) that MODEL_DIR was converted from: the reference for
  # `gdsrun bench --backend cuda` in the same run. It brings its ggml/llama libraries and
  # libcudart; cuBLAS 13 comes from this machine (the folders cuda-libs.sh put on the path).
  say "== anchor: llama.cpp (CUDA, prebuilt) vs gdsrun --backend cuda, same model"
  L=/tmp/llama-cuda
  rm -rf "$L" && mkdir -p "$L"
  if [ -f "${LLAMA_PACK:-}" ] && tar -xJf "$LLAMA_PACK" -C "$L"; then
    head -2 "$L/README" | tee -a "$SUM"
    LLD="$L/lib:$LD_LIBRARY_PATH"
    say "libraries: $(LD_LIBRARY_PATH=$LLD ldd "$L/lib/libggml-cuda.so" "$L/bin/llama-bench" |
      grep -E 'not found|libcu|libggml-cuda' | sort -u | awk '{print $1, $2, $3}' | tr '\n' ';')"
    run 240 llama-bench env LD_LIBRARY_PATH="$LLD" "$L/bin/llama-bench" -m "${GGUF:-}" -p 512 -n 128 -ngl 99 -r 3
    grep -E "^\|" "$LOG" | tail -4 >>"$SUM"
  else
    say "[llama-bench] not run: no llama.cpp pack at LLAMA_PACK=${LLAMA_PACK:-} (scripts/build-llama-cpp-cuda.sh)"
  fi
  run 180 gdsrun-bench "$G" bench "$MODEL" --backend cuda -p 512 -n 128 -r 3
  grep -E "^\|" "$LOG" | tail -2 >>"$SUM"
  run 120 gdsrun-bench-no-graphs "$G" bench "$MODEL" --backend cuda --cuda-graphs off -p 512 -n 128 -r 3
  grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (--cuda-graphs off)/' >>"$SUM"
  run 120 gdsrun-bench-tf32 "$G" bench "$MODEL" --backend cuda --gemm-type tf32 -p 512 -n 0 -r 3
  grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (--gemm-type tf32)/' >>"$SUM"
  exit 0
fi
if [ "$STAGE" = quick ] || [ "$STAGE" = full ]; then
say "== tiny architectures: CUDA vs CPU f32, 16 greedy tokens"
for d in "$TINY"/*/; do
  greedy "tiny-$(basename "$d")" "$d" 16 "Hello world, this is" "all min" "direct"
  # the f16 KV cache (the default on both backends): CUDA's against the CPU's
  KV=f16 greedy "tiny-f16kv-$(basename "$d")" "$d" 16 "Hello world, this is" "min" "direct"
done
say "== compute-sanitizer on a tiny streamed run"
TS=$(ls -d "$TINY"/*/ | head -1)
if [ -n "$CS" ]; then
  for tool in memcheck racecheck; do
    sanitize 60 "$tool" tiny "$TS" direct "$(budget "tiny-$(basename "$TS")" min)" 4
  done
fi
fi
say "== gdsrun serve --backend cuda (batched, paged KV in VRAM) vs --backend cpu f32, concurrent greedy requests"
timeout 300 python3 "$(dirname "$0")/gpu-serve-check.py" "$G" "$MODEL" 2>>"$LOG" | tee -a "$SUM"
timeout 300 python3 "$(dirname "$0")/gpu-serve-check.py" "$G" "$MODEL" --vram-budget streamed \
  2>>"$LOG" | tee -a "$SUM"
[ "$STAGE" = quick ] && exit 0

# greedy tokens and perplexity of one model at three budgets x three load paths
model_checks() { # model_checks LABEL DIR
  local label=$1 dir=$2
  say "== $label: CUDA vs CPU f32, 64 greedy tokens"
  greedy "$label" "$dir" 64 "The history of the printing press" "all half min" "gds direct mmap"
  say "== $label perplexity (fixtures/reference/wiki-like.txt, first 12000 bytes, ctx 512)"
  head -c 12000 "$(dirname "$0")/../fixtures/reference/wiki-like.txt" >/tmp/ppl.txt
  ppl() { # ppl LABEL ARGS...
    local l=$1; shift
    timeout 300 "$G" perplexity "$dir" -f /tmp/ppl.txt -c 512 --json "$@" >"$OUT/json/ppl-$label-$l.json" 2>>"$LOG"
    say "[ppl $label $l] rc=$? $(python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print({k:v for k,v in d.items() if k in ('ppl','ppl_stderr','tokens','chunks')})" "$OUT/json/ppl-$label-$l.json" 2>&1 | tail -1)"
  }
  ppl cpu-f32 --backend cpu --activations f32 --kv-type f32
  for b in all half min; do
    v=$(budget "$label" "$b")
    for io in gds direct mmap; do ppl "cuda-$b-$io" --backend cuda --vram-budget "$v" --io "$io" --kv-type f32; done
  done
}
if [ "$STAGE" = model ]; then
  model_checks "$(basename "$MODEL" .gds)" "$MODEL"
  exit 0
fi
model_checks smollm2 "$MODEL"

say "== speed"
python3 - <<'EOF' 2>&1 | tee -a "$SUM"
import torch, time
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): y.copy_(x)
torch.cuda.synchronize(); s = time.perf_counter() - t
print(f"device-to-device copy: {2 * 10 * x.numel() / s / 1e9:.0f} GB/s (read + write)")
EOF
run 240 bench_gpu "$BIN/bench_gpu" "$MODEL" 64 512
sed -n '/## load bandwidth/,$p' "$LOG" | grep -v "^###" | tail -16 >>"$SUM"
run 180 gdsrun-bench "$G" bench "$MODEL" --backend cuda -p 512 -n 128 -r 3
grep -E "^\|" "$LOG" | tail -4 >>"$SUM"
run 120 gdsrun-bench-no-graphs "$G" bench "$MODEL" --backend cuda --cuda-graphs off -p 512 -n 128 -r 3
grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (--cuda-graphs off)/' >>"$SUM"
run 120 gdsrun-bench-tf32 "$G" bench "$MODEL" --backend cuda --gemm-type tf32 -p 512 -n 0 -r 3
grep -E "^\|" "$LOG" | tail -1 | sed 's/$/ (--gemm-type tf32)/' >>"$SUM"

say "== energy (NVML)"
python3 - "$G" "$MODEL" <<'EOF' 2>&1 | tee -a "$SUM"
import json, subprocess, sys
try:
    import pynvml as n
    n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
    e0 = n.nvmlDeviceGetTotalEnergyConsumption(h)
except Exception as e:
    print("pynvml:", e); n = None
p = subprocess.run([sys.argv[1], "run", sys.argv[2], "--raw", "-p", "Once upon a time", "-n", "256",
                    "--temp", "0", "--backend", "cuda", "--json"], capture_output=True, text=True)
m = json.loads(p.stdout)["metrics"]
print(f"gdsrun: {m['generated_tokens']} tokens, {m['energy_joules']} J, {m['tokens_per_joule']} tokens/J, "
      f"{m['watts_avg']} W, source {m['energy_source']}")
if n:
    print(f"pynvml around the whole process: {(n.nvmlDeviceGetTotalEnergyConsumption(h) - e0) / 1000:.1f} J")
q = subprocess.run([sys.argv[1], "run", sys.argv[2], "--raw", "-p", "Once upon a time", "-n", "4000",
                    "--temp", "0", "--backend", "cuda", "--max-joules", "100", "-c", "4096", "--json"],
                   capture_output=True, text=True)
try:
    d = json.loads(q.stdout)
    print(f"--max-joules 100: stop_reason {d['stop_reason']} after {d['metrics']['generated_tokens']} tokens, "
          f"{d['metrics']['energy_joules']} J")
except Exception as e:
    print("--max-joules run:", e, q.stderr[-300:])
EOF
say "== compute-sanitizer on SmolLM2 streamed at the minimum budget (direct; gds: cuFile's teardown)"
MIN=$(budget smollm2 min)
for tool in memcheck racecheck; do
  sanitize 100 "$tool" smollm2-direct "$MODEL" direct "$MIN" 2
done
# racecheck on gds found 0 hazards last lease and the teardown fix touched no kernel: memcheck only
sanitize 100 memcheck smollm2-gds "$MODEL" gds "$MIN" 2

say "== done $(date -u +%FT%TZ)"
