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
    cargo clippy --workspace --all-targets --profile ci -- -D warnings

# clippy over every target built with the CUDA features (scripts/test.sh lints gdsrun's CUDA
# build, the GPU bench example and the NVRTC tests as it builds them; this covers the rest)
lint-cuda:
    cargo clippy --workspace --all-targets --profile ci --features gdsrun/cuda,gds-cuda/cuda,gdsllm-py/cuda -- -D warnings

# conversion throughput (SmolLM2, Gemma 3) next to a plain copy of the same bytes, and peak RSS
bench-convert runs="3":
    ./scripts/bench-convert.sh {{runs}}

# distribution: `gdsconv pack` vs `cp -r`, `gdsconv pull` vs `skopeo copy` from a local
# registry (needs docker-registry and skopeo), median of RUNS
bench-dist runs="5":
    ./scripts/bench-dist.sh {{runs}}

# fuzz one target for SECONDS: manifest, gguf, safetensors, tokenizer, chat_template or imatrix (needs nightly and
# cargo-fuzz; extra arguments go to libFuzzer, e.g. -runs=10000000)
fuzz target="manifest" seconds="60" *args:
    ./scripts/fuzz.sh {{target}} {{seconds}} {{args}}

# regenerate the fuzz corpora from the real models (fuzz/corpus/; --curated: fuzz/seeds/)
fuzz-seeds *args:
    ./scripts/fuzz-seeds.py {{args}}

# replay the committed fuzz seeds and regression inputs on stable, under the memory cap
fuzz-replay:
    cargo test --release -p gds-fuzz --test replay

# gdsrun vs llama.cpp llama-bench on SmolLM2 and Gemma 3 (pp/tg t/s and ratios at depths 0, 2048, 8192, peak RSS);
# real sizes: `just bench --synth llama-1b|llama-7b --quant Q4_0,Q4_K_M,Q8_0 --model llama -d 0`
bench *args:
    ./scripts/bench.py {{args}}

# quantization quality: gdsconv --quant vs llama-quantize of the same F16 GGUF (SmolLM2, Gemma 3),
# without and with an importance matrix: KL divergence, p99, top-1, PPL ratio, bits per weight
bench-quant *args:
    ./scripts/bench-quant.py {{args}}

# the CPU kernels of every weight type on one thread, each against Q4_0's time in the same run
# (one token, then a 16-token prompt batch): run after a kernel change and compare the ratios
# with the last table in bench/runs/ (GDS_ISA=avx2 for the AVX2 kernels)
bench-kernels tokens="16":
    cargo build --release -p gds-kernels --example decode_bw
    RAYON_NUM_THREADS=1 target/release/examples/decode_bw all 1
    RAYON_NUM_THREADS=1 target/release/examples/decode_bw all {{tokens}}

# layer streaming: O_DIRECT bandwidth (fio), bytes/token, decode t/s vs the bandwidth bound at
# several --mem-budget values, and mmap (ours and llama.cpp's) under the same memory cgroup
bench-stream *args:
    ./scripts/bench-stream.py {{args}}

# speculative decoding (--draft ngram, --draft-model) with/without, in memory and streamed at the
# minimum budget, on SmolLM2 Q4_1, SmolLM2 F16 (drafted by Q4_1) and Gemma 3
bench-spec *args:
    ./scripts/bench-spec.py {{args}}

# gdsrun serve vs llama-server: aggregate t/s and latency percentiles at concurrency 1, 4, 16
bench-serve *args:
    ./scripts/bench-serve.py {{args}}

# the server streaming a model bigger than its budget: aggregate t/s at concurrency 1..64 in memory,
# at a quarter of the weights and at the minimum, against the disk-bandwidth bound, and
# llama-server under the same memory cgroup (default: the 1B-shaped model; --model smollm2)
bench-serve-stream *args:
    ./scripts/bench-serve-stream.py {{args}}

# GPU: GDS vs bounce-buffer load bandwidth, decode t/s at several VRAM budgets against the
# read-bandwidth bound (needs an NVIDIA GPU; exits non-zero without one)
bench-gpu *args:
    ./scripts/bench-gpu.sh {{args}}

# GPU bring-up: build with --features cuda here and pack binaries and models for a GPU machine
# without Rust (GEMMA=1, LLAMA=1 add Gemma 3 and the llama.cpp anchor, which
# scripts/build-llama-cpp-cuda.sh builds here first); there, run scripts/gpu-bringup.sh
# (README, "What has run on hardware")
gpu-pack:
    ./scripts/gpu-pack.sh
