# GdsLLM tasks. Install just with `pip install rust-just` if it is missing.

# the main job on a real model: fetch, convert, validate, inspect, generate
demo prompt="Give me three tips for staying healthy.":
    ./scripts/demo.sh "{{prompt}}"

# the whole test suite (what CI runs)
test:
    ./scripts/test.sh

fmt:
    cargo fmt --all

lint:
    cargo clippy --workspace --all-targets --release -- -D warnings

# conversion throughput next to a plain copy of the same bytes
bench-convert runs="3":
    ./scripts/bench-convert.sh {{runs}}

# fuzz the manifest reader (needs nightly and cargo-fuzz)
fuzz seconds="60":
    cd fuzz && cargo +nightly fuzz run manifest -- -max_total_time={{seconds}}

# gdsrun vs llama.cpp llama-bench on SmolLM2 (pp/tg t/s and ratios, peak RSS)
bench *args:
    ./scripts/bench.py {{args}}
