"""SmolLM2's forward pass in plain PyTorch, on the CPU, with weights from gdsllm: one layer
resident at a time (its tensors dequantized by gds-kernels, used, dropped), the next one
loading on a background thread while the current one computes (its pages read from the
mapped layer file and dequantized, the GIL released), and its next-token log-probabilities
checked against gdsrun's (`gdsrun run --raw --json --logprobs`).

    python3 examples/torch_forward.py MODEL_DIR [--prompt TEXT] [--gdsrun target/ci/gdsrun]

MODEL_DIR: a converted llama-family model (gdsllm.convert or gdsconv convert), e.g. of
.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf. Exits 1 when the top tokens differ or a
log-probability is further than --tol from gdsrun's.
"""

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import gdsllm


def weights(model, layer):
    """The float32 torch tensors of one layer (dequantized, then dropped by the caller)."""
    return {t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name:
            torch.from_numpy(t.dequantize()) for t in model.load(layer)}


class Prefetcher:
    """The layers named, in order, each one's weights read and dequantized on a background
    thread while the caller computes with the one before: the current layer and the next
    are resident, no more. `waited` is the time the caller spent waiting for weights."""

    def __init__(self, model, names):
        self.model, self.names, self.waited = model, list(names), 0.0

    def __iter__(self):
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdsllm-prefetch") as pool:
            nxt = pool.submit(weights, self.model, self.names[0])
            for i, name in enumerate(self.names):
                t0 = time.perf_counter()
                cur = nxt.result()
                self.waited += time.perf_counter() - t0
                if i + 1 < len(self.names):
                    nxt = pool.submit(weights, self.model, self.names[i + 1])
                yield name, cur
                del cur


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta, style):
    """x: [tokens, heads, head_dim]; ggml's NORM mode rotates adjacent pairs (llama's GGUF
    Q/K rows are permuted for it), NEOX the two halves."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos[:, None].double() * inv[None, :]).float()  # [tokens, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    if style == "norm":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def forward(model, tokens):
    h = model.hyperparameters
    assert h["arch"] == "llama", "this example runs the llama family"
    n, nh, nkv, hd = len(tokens), h["n_heads"], h["n_kv_heads"], h["head_dim"]
    eps, pos = h["rms_norm_eps"], torch.arange(n)
    # the embedding first, the blocks in order, then the output head's layers (the norm and,
    # untied, the head): each loaded while the one before computes
    tail = [l["name"] for l in model.layers if not l["name"].startswith("blk.") and l["name"] != "embed"]
    layers = Prefetcher(model, ["embed"] + [f"blk.{i}" for i in range(h["n_layers"])] + tail)
    t0 = time.perf_counter()
    it = iter(layers)
    emb = next(it)[1]["token_embd.weight"]  # kept: a tied output head uses it again
    x = emb[torch.tensor(tokens)]
    mask = torch.full((n, n), float("-inf")).triu(1)
    for i in range(h["n_layers"]):
        name, w = next(it)  # this layer only (and the next one, loading)
        assert name == f"blk.{i}"
        a = rms_norm(x, w["attn_norm.weight"], eps)
        q = rope((a @ w["attn_q.weight"].T).view(n, nh, hd), pos, h["rope_theta"], h["rope_style"])
        k = rope((a @ w["attn_k.weight"].T).view(n, nkv, hd), pos, h["rope_theta"], h["rope_style"])
        v = (a @ w["attn_v.weight"].T).view(n, nkv, hd)
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q, k) * h["attn_scale"] + mask
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, nh * hd)
        x = x + o @ w["attn_output.weight"].T
        f = rms_norm(x, w["ffn_norm.weight"], eps)
        g = torch.nn.functional.silu(f @ w["ffn_gate.weight"].T) * (f @ w["ffn_up.weight"].T)
        x = x + g @ w["ffn_down.weight"].T
        del w
    out = {n: t for _, w in it for n, t in w.items()}
    head = emb if h["tie_embeddings"] else out["output.weight"]
    x = rms_norm(x[-1], out["output_norm.weight"], eps)
    lp = torch.log_softmax(x @ head.T, -1)
    print(f"{len(layers.names)} layers in {time.perf_counter() - t0:.2f} s, "
          f"{layers.waited:.2f} s of it waiting for weights (the rest loaded while computing)")
    return lp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--gdsrun", default="target/ci/gdsrun")
    ap.add_argument("--tol", type=float, default=0.05)
    a = ap.parse_args()
    model = gdsllm.open(a.model)
    tokens = gdsllm.Engine(a.model, raw=True, threads=1).tokenize(a.prompt)
    with torch.no_grad():
        lp = forward(model, tokens)
    ref = json.loads(subprocess.run(
        [a.gdsrun, "run", a.model, "--raw", "-p", a.prompt, "-n", "1", "--temp", "0",
         "--activations", "f32", "--json", "--logprobs", "5"],
        check=True, capture_output=True, text=True).stdout)["logprobs"][0]
    ours = torch.topk(lp, len(ref["top"]))
    worst = 0.0
    for (tok, want), got_tok, got in zip(ref["top"], ours.indices.tolist(), ours.values.tolist()):
        print(f"token {tok:6d}: gdsrun {want:9.5f}  torch {lp[tok].item():9.5f}   (torch's #{got_tok} {got:9.5f})")
        worst = max(worst, abs(lp[tok].item() - want))
    same = [t for t, _ in ref["top"]] == ours.indices.tolist()
    print(f"top-{len(ref['top'])} tokens {'equal' if same else 'DIFFER'}; largest log-probability difference {worst:.2e} (tolerance {a.tol})")
    return 0 if same and worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
