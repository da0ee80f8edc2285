#!/usr/bin/env bash
# GPU benchmark (`just bench-gpu [MODEL_DIR] [TOKENS] [CTX]`): layer-load bandwidth into VRAM,
# cuFile (GPUDirect Storage) vs pinned bounce buffers, and greedy decode t/s at several VRAM
# budgets against the bound (read bandwidth / bytes streamed per token).
# Needs an NVIDIA GPU with its driver (and libnvrtc, libcublas; libcufile + nvidia-fs for the
# GDS row). Without one it says so and exits 2. Figures from an H200: README, "What has run on
# hardware".
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && [ ! -e /proc/driver/nvidia/version ]; then
  echo "bench-gpu needs an NVIDIA GPU and its driver (libcuda.so not found, no /proc/driver/nvidia)" >&2
  exit 2
fi
MODEL="${1:-.cache/smollm2.gds}"
if [ ! -f "$MODEL/manifest.gdsm" ]; then
  GGUF=$(./scripts/fetch-model.sh)
  cargo build --release -q -p gdsconv
  target/release/gdsconv convert "$GGUF" "$MODEL" --force >/dev/null
fi
# CUDA's libraries where cudarc looks for them (pip wheels or the toolkit, CUDA 12 or 13).
# shellcheck source=scripts/cuda-libs.sh
. ./scripts/cuda-libs.sh
cargo run --release -q -p gds-cuda --features cuda --example bench_gpu -- "$MODEL" "${2:-64}" "${3:-512}"
