"""SmolLM2's forward pass in plain PyTorch, with weights from gdsllm: one layer resident at a
time (its tensors dequantized, used, dropped), the next one loading on a background thread
while the current one computes, and its next-token log-probabilities checked against
gdsrun's (`gdsrun run --raw --json --logprobs`).

On the CPU (default) each layer's tensors are views of the mapped layer file, dequantized by
gds-kernels (the GIL released). With `--device cuda` each layer file is placed in GPU memory
by gdsllm (`Model.load(device="cuda:0", io=...)`: `gds` reads it with cuFile straight into
VRAM), handed to PyTorch as CUDA tensors through DLPack (no host copy), and dequantized by
the PyTorch code below on the GPU (`--dequant torch`; on the CPU it runs the same code on the
mapped bytes).

    python3 examples/torch_forward.py MODEL_DIR [--prompt TEXT] [--gdsrun target/ci/gdsrun]
        [--device cpu|cuda] [--io mmap|direct|gds] [--dequant gdsllm|torch]

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


def dequantize_torch(t, raw):
    """`raw` (the tensor's bytes as PyTorch sees them through DLPack, on any device) as
    float32 of `t.shape`: ggml's block formats of SmolLM2's GGUF (Q4_0, Q4_1, Q8_0) and the
    float types, in PyTorch operations (so on the GPU for a CUDA tensor)."""
    if t.dtype in ("f32", "f16", "bf16"):
        return raw.float().reshape(t.shape)
    sizes = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
    if t.dtype not in sizes:
        raise SystemExit(f"{t.name}: --dequant torch has no {t.dtype} (use --dequant gdsllm)")
    b = raw.reshape(-1, sizes[t.dtype])  # one 32-value block a row
    half = lambda c: b[:, c : c + 2].contiguous().view(torch.float16).float()  # noqa: E731
    if t.dtype == "q8_0":
        x = half(0) * b[:, 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[:, 2:] if t.dtype == "q4_0" else b[:, 4:]
        q = torch.cat([qs & 0xF, qs >> 4], 1).float()  # values 0..15 and 16..31 of the block
        x = half(0) * (q - 8) if t.dtype == "q4_0" else half(0) * q + half(2)
    return x.reshape(t.shape)


def weights(model, layer, device="cpu", io="mmap", dequant="gdsllm"):
    """The float32 torch tensors of one layer (dequantized, then dropped by the caller)."""
    key = lambda t: t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name  # noqa: E731
    if dequant == "gdsllm":
        return {key(t): torch.from_numpy(t.dequantize()) for t in model.load(layer)}
    return {key(t): dequantize_torch(t, torch.from_dlpack(t))
            for t in model.load(layer, device=device, io=io)}


class Prefetcher:
    """The layers named, in order, each one's weights read and dequantized on a background
    thread while the caller computes with the one before: the current layer and the next
    are resident, no more. `waited` is the time the caller spent waiting for weights."""

    def __init__(self, model, names, **opts):
        self.model, self.names, self.opts, self.waited = model, list(names), opts, 0.0

    def __iter__(self):
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdsllm-prefetch") as pool:
            nxt = pool.submit(weights, self.model, self.names[0], **self.opts)
            for i, name in enumerate(self.names):
                t0 = time.perf_counter()
                cur = nxt.result()
                self.waited += time.perf_counter() - t0
                if i + 1 < len(self.names):
                    nxt = pool.submit(weights, self.model, self.names[i + 1], **self.opts)
                yield name, cur
                del cur


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta, style):
    """x: [tokens, heads, head_dim]; ggml's NORM mode rotates adjacent pairs (llama's GGUF
    Q/K rows are permuted for it), NEOX the two halves."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = (pos[:, None].double() * inv[None, :]).float()  # [tokens, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    if style == "norm":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def forward(model, tokens, device="cpu", **opts):
    h = model.hyperparameters
    assert h["arch"] == "llama", "this example runs the llama family"
    n, nh, nkv, hd = len(tokens), h["n_heads"], h["n_kv_heads"], h["head_dim"]
    eps, pos = h["rms_norm_eps"], torch.arange(n, device=device)
    # the embedding first, the blocks in order, then the output head's layers (the norm and,
    # untied, the head): each loaded while the one before computes
    tail = [l["name"] for l in model.layers if not l["name"].startswith("blk.") and l["name"] != "embed"]
    layers = Prefetcher(model, ["embed"] + [f"blk.{i}" for i in range(h["n_layers"])] + tail,
                        **({"device": device, **opts} if opts else {}))
    t0 = time.perf_counter()
    it = iter(layers)
    emb = next(it)[1]["token_embd.weight"]  # kept: a tied output head uses it again
    x = emb[torch.tensor(tokens, device=emb.device)]
    mask = torch.full((n, n), float("-inf"), device=emb.device).triu(1)
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
    lp = torch.log_softmax(x @ head.T, -1).cpu()
    print(f"{len(layers.names)} layers in {time.perf_counter() - t0:.2f} s, "
          f"{layers.waited:.2f} s of it waiting for weights (the rest loaded while computing)")
    return lp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--gdsrun", default="target/ci/gdsrun")
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N (a gdsllm built with CUDA)")
    ap.add_argument("--io", default="mmap", choices=["mmap", "direct", "gds"],
                    help="how layers reach the GPU (--device cuda)")
    ap.add_argument("--dequant", choices=["gdsllm", "torch"],
                    help="who dequantizes: gds-kernels on the host, or PyTorch on the tensors' "
                         "device (default: gdsllm on the CPU, torch on a GPU)")
    a = ap.parse_args()
    dequant = a.dequant or ("gdsllm" if a.device == "cpu" else "torch")
    if a.device != "cpu" and dequant != "torch":
        ap.error("--device cuda dequantizes with --dequant torch")
    model = gdsllm.open(a.model)
    tokens = gdsllm.Engine(a.model, raw=True, threads=1).tokenize(a.prompt)
    opts = {} if dequant == "gdsllm" else {"io": a.io if a.device != "cpu" else "mmap", "dequant": dequant}
    with torch.no_grad():
        lp = forward(model, tokens, a.device, **opts)
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
