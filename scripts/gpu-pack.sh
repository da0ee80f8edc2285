#!/usr/bin/env bash
# Packs what scripts/gpu-bringup.sh needs on a GPU machine that has no Rust toolchain, in parts
# that each fit one device transfer (64 MiB with the working tree):
#   .gpu/p1: the binaries built with --features cuda (xz), the tiny architecture fixtures
#            converted, SmolLM2's manifest, tokenizer, embedding and first blocks
#   .gpu/p2: SmolLM2's other layer files
# On the GPU machine p1 is copied into one folder and p2 into its smollm2/layers/.
# FIRST (default 6) is how many blocks go with p1; the rest must fit p2.
# With GEMMA=1 also the converted Gemma 3 270M (.cache/gemma3.gds, scripts/fetch-gemma.sh),
# as one xz tarball cut in 55 MB pieces .gpu/g1/part.01, .gpu/g2/part.02, ... (one per
# transfer); on the GPU machine: cat part.* | xz -dc | tar -x.
# With LLAMA=1 also llama.cpp built with CUDA for sm_90 (the tarball that
# scripts/build-llama-cpp-cuda.sh builds and packs here, hours on 2 cores: it must be there
# already) and SmolLM2's GGUF, for gpu-bringup.sh's anchor stage: .gpu/a1 (the tarball, cut in
# 55 MB pieces if larger: part.01 in .gpu/a1, part.02 in .gpu/a1-02, ...; cat part.* > it), .gpu/a2 and
# .gpu/a3 (the GGUF in two halves); on the GPU machine: cat gguf.1 gguf.2 > smollm2.gguf and
# LLAMA_PACK=llama-cuda-sm90.tar.xz GGUF=smollm2.gguf scripts/gpu-bringup.sh BIN MODEL TINY anchor.
# With REAL=1 only .gpu/r1, for scripts/gpu-real-size.sh (the models are made on the GPU
# machine): bins.tar.xz with gdsconv beside the CUDA binaries, and tok/ (SmolLM2's tokenizer,
# .cache/smollm2-hf-f16, which scripts/test.sh makes). PROFILE picks the cargo profile
# (default release; `ci` reuses the test command's build: no LTO, minutes instead of tens).
# With REAL=1 BASELINE=COMMIT also gdsrun-base: gdsrun of COMMIT, built whole in a git
# worktree (.gpu/base-tree, removed after; its Rust code and kernels go together: swapping
# only the kernels broke once the kernels' signatures changed), for an A/B of any change on
# one machine in one run. Kernel variants need no second binary: GDS_CUDA_FUSE,
# GDS_CUDA_MMQ8 and GDS_CUDA_DEQ_PER_LANE recompile them at open (docs/gpu.md).
# With PY=1 only .gpu/py, for scripts/gpu-python.sh: the gdsllm wheel built with CUDA (abi3)
# and pytest's wheels (the GPU machine has PyTorch; pip cannot fetch there).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${PY:-0}" = 1 ]; then
  rm -rf .gpu/py && mkdir -p .gpu/py
  python3 -m pip wheel -q --no-deps -w .gpu/py . --config-settings=build-args="--features cuda"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/py \
    pytest pluggy iniconfig packaging
  du -sb .gpu/py
  exit 0
fi
T=${CUDA_TARGET_DIR:-target-cuda} P=${PROFILE:-release}
CARGO_TARGET_DIR=$T cargo build --profile "$P" -q -p gdsrun -p gds-cuda \
  --features gdsrun/cuda,gds-cuda/cuda --bins --examples
cargo build --profile "$P" -q -p gdsconv
if [ "${REAL:-0}" = 1 ]; then
  rm -rf .gpu && mkdir -p .gpu/bin .gpu/r1/tok
  for b in "$T/$P/gdsrun" "$T/$P/examples/bench_gpu" "target/$P/gdsconv"; do
    strip --strip-debug -o ".gpu/bin/$(basename "$b")" "$b"
  done
  if [ -n "${BASELINE:-}" ]; then
    B=.gpu/base-tree
    git worktree remove --force "$B" 2>/dev/null || rm -rf "$B"
    git worktree add -q --detach "$B" "$BASELINE"
    trap 'git worktree remove --force "$B"' EXIT
    # the same target folder: the dependencies are shared, the workspace's crates are its own
    TA=$(realpath -m "$T")
    (cd "$B" && CARGO_TARGET_DIR="$TA" cargo build --profile "$P" -q -p gdsrun --features gdsrun/cuda --bins)
    strip --strip-debug -o .gpu/bin/gdsrun-base "$T/$P/gdsrun"
    git worktree remove --force "$B" && trap - EXIT
    git rev-parse --short "$BASELINE" >.gpu/bin/BASELINE
    # the base's build replaced the binary in the shared folder (.gpu/bin has this tree's):
    # this tree's again there
    CARGO_TARGET_DIR=$T cargo build --profile "$P" -q -p gdsrun --features gdsrun/cuda --bins
  fi
  tar -cJf .gpu/r1/bins.tar.xz -C .gpu bin && rm -rf .gpu/bin
  cp .cache/smollm2-hf-f16/{tokenizer.json,tokenizer_config.json,config.json} .gpu/r1/tok/
  du -sb .gpu/r1
  exit 0
fi
SMOL=.cache/smollm2.gds
if [ ! -f "$SMOL/manifest.gdsm" ]; then
  GGUF=$(./scripts/fetch-model.sh)
  target/$P/gdsconv convert "$GGUF" "$SMOL" --force >/dev/null
fi
rm -rf .gpu
mkdir -p .gpu/bin .gpu/p1/tiny .gpu/p1/smollm2/layers .gpu/p2
strip --strip-debug -o .gpu/bin/gdsrun "$T/$P/gdsrun"
strip --strip-debug -o .gpu/bin/bench_gpu "$T/$P/examples/bench_gpu"
tar -cJf .gpu/p1/bins.tar.xz -C .gpu bin
rm -rf .gpu/bin
for f in fixtures/tiny-*.gguf; do
  n=$(basename "$f" .gguf)
  target/$P/gdsconv convert "$f" ".gpu/p1/tiny/${n#tiny-}" --force >/dev/null
done
cp "$SMOL"/manifest.gdsm "$SMOL"/tokenizer*.json .gpu/p1/smollm2/
cp "$SMOL"/layers/embed.bin .gpu/p1/smollm2/layers/
blocks=("$SMOL"/layers/blk.*.bin)
first=${FIRST:-6}
cp "${blocks[@]:0:$first}" .gpu/p1/smollm2/layers/
cp "${blocks[@]:$first}" .gpu/p2/
ls "$SMOL"/layers | grep -v -E '^(embed|blk\.[0-9]+)\.bin$' | while read -r f; do cp "$SMOL/layers/$f" .gpu/p2/; done
du -sb .gpu/p1 .gpu/p2
if [ "${GEMMA:-0}" = 1 ]; then
  [ -f .cache/gemma3.gds/manifest.gdsm ] || { echo "GEMMA=1 needs .cache/gemma3.gds" >&2; exit 2; }
  tar -cf - -C .cache gemma3.gds | xz -T2 -3 | split -b 55000000 -d -a 2 --numeric-suffixes=1 - .gpu/part.
  for f in .gpu/part.*; do n=${f##*.}; mkdir -p ".gpu/g$((10#$n))"; mv "$f" ".gpu/g$((10#$n))/"; done
  du -sb .gpu/g*
fi
if [ "${LLAMA:-0}" = 1 ]; then
  LPACK=.cache/llama.cpp/cuda-pack/llama-cuda-sm90.tar.xz
  [ -f "$LPACK" ] || { echo "LLAMA=1 needs $LPACK: run scripts/build-llama-cpp-cuda.sh first" >&2; exit 2; }
  GGUF=$(./scripts/fetch-model.sh)
  mkdir -p .gpu/a1 .gpu/a2 .gpu/a3
  if [ "$(stat -c %s "$LPACK")" -le 55000000 ]; then
    cp "$LPACK" .gpu/a1/
  else # cat part.* > llama-cuda-sm90.tar.xz
    split -b 55000000 -d -a 2 --numeric-suffixes=1 "$LPACK" .gpu/a1/part.
    for f in .gpu/a1/part.*; do n=${f##*.}; [ "$n" = 01 ] || { mkdir -p ".gpu/a1-$n"; mv "$f" ".gpu/a1-$n/"; }; done
  fi
  half=$(($(stat -c %s "$GGUF") / 2))
  head -c "$half" "$GGUF" >.gpu/a2/gguf.1
  tail -c +$((half + 1)) "$GGUF" >.gpu/a3/gguf.2
  du -sb .gpu/a*
fi
