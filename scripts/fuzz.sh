#!/usr/bin/env bash
# Fuzzes one target with cargo-fuzz (needs the nightly toolchain and `cargo install cargo-fuzz`).
#
#   scripts/fuzz.sh TARGET [SECONDS] [libFuzzer flags...]
#
# TARGET is manifest, gguf, safetensors, tokenizer, chat_template, imatrix or grammar (crates/gds-fuzz documents each input).
# SECONDS (default 60; 0 = no time limit) bounds the run; further flags go to libFuzzer, e.g.
# `-runs=10000000`. New inputs go to fuzz/corpus/TARGET (git-ignored; scripts/fuzz-seeds.py
# fills it from the real models); fuzz/seeds/TARGET and fuzz/regressions/TARGET are read too.
# Crashes land in fuzz/artifacts/TARGET. Every run bounds memory: the targets' allocator
# (gds_fuzz::CappedAlloc) refuses to hold more than 256 MiB, -rss_limit_mb catches the rest,
# and an input running longer than -timeout seconds is a crash too.
#
# FUZZ_SANITIZER (default none: about twice the executions per second; the code under test is
# safe Rust plus C the sanitizer does not instrument) can be `address`.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
t=${1:?usage: scripts/fuzz.sh TARGET [SECONDS] [libFuzzer flags...]}
secs=${2:-60}
shift $(( $# < 2 ? $# : 2 ))
case "$t" in
  manifest) max_len=65536 ;;
  gguf) max_len=32768 ;;
  safetensors | tokenizer) max_len=16384 ;;
  chat_template) max_len=16384 ;;
  imatrix) max_len=16384 ;;
  grammar) max_len=4096 ;;
  *) echo "scripts/fuzz.sh: unknown target $t (manifest, gguf, safetensors, tokenizer, chat_template, imatrix, grammar)" >&2; exit 2 ;;
esac
san=${FUZZ_SANITIZER:-none}
# each sanitizer keeps its own build (switching would rebuild every dependency)
tdir=target/$san
[ "$san" = none ] && tdir=target/nosan
mkdir -p "corpus/$t" "artifacts/$t"
dirs=("corpus/$t" "seeds/$t")
[ -d "regressions/$t" ] && dirs+=("regressions/$t")
dict=()
[ -f "dict/$t.dict" ] && dict=(-dict="dict/$t.dict")
exec cargo +nightly fuzz run -s "$san" --target-dir "$tdir" "$t" "${dirs[@]}" -- \
  -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 \
  -max_len="$max_len" "${dict[@]}" -artifact_prefix="artifacts/$t/" \
  -print_final_stats=1 "$@"
