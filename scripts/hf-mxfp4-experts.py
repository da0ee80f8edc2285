#!/usr/bin/env python3
"""Rewrites a gpt-oss Hugging Face checkpoint's experts as OpenAI's published gpt-oss
checkpoints store them: MXFP4.

    scripts/hf-mxfp4-experts.py SRC_DIR OUT_DIR

SRC_DIR is a gpt-oss checkpoint with float experts (`mlp.experts.gate_up_proj` [E, d, 2ff] and
`down_proj` [E, ff, d], both `x @ W`), e.g. `scripts/synth-model.py gpt-oss-20b` (random weights
of the real shape). OUT_DIR gets the same checkpoint with each expert matrix quantized to MXFP4
by gguf-py's reference quantizer (`gguf.quants.quantize`, the same arithmetic as ggml's
`quantize_row_mxfp4_ref`) and stored in the published layout: `*_blocks` [E, rows, cols/32, 16]
(two 4-bit values a byte, low nibble first; rows are outputs, so gate_up's gate and up rows
alternate) and `*_scales` [E, rows, cols/32] (E8M0), config.json with `quantization_config:
{"quant_method": "mxfp4"}`; every other tensor and file as it was. One shard out per shard in,
with its index. Memory: one expert matrix in float32 at a time.

Needs numpy, safetensors, torch (to read bf16) and gguf (0.19.0).
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np


def to_hf_blocks(raw: np.ndarray, cols: int):
    """GGUF MXFP4 rows of `cols` values, uint8 [..., rows, cols/32 * 17] (per group a scale
    byte, then value j in byte j's low nibble and j + 16 in its high one) -> Hugging Face
    blocks [..., rows, cols/32, 16] (value 2i in byte i's low nibble, 2i + 1 in its high one)
    and scales [..., rows, cols/32]. fixtures/make_gptoss_mxfp4_hf.py uses it too."""
    g = raw.reshape(*raw.shape[:-1], cols // 32, 17)
    qs = g[..., 1:]
    vals = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # the 32 values in order
    return (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8), g[..., 0].copy()


def mxfp4(w_t, rows: int, cols: int):
    """The [rows, cols] float matrix `w_t` (outputs x inputs) as HF blocks and scales."""
    import gguf
    q = gguf.quants.quantize(np.ascontiguousarray(w_t, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    return to_hf_blocks(np.asarray(q).reshape(rows, -1), cols)


def main():
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    index_path = src / "model.safetensors.index.json"
    shards = sorted({v for v in json.loads(index_path.read_text())["weight_map"].values()}) \
        if index_path.exists() else ["model.safetensors"]
    weight_map = {}
    for shard in shards:
        tensors = load_file(src / shard)
        new = {}
        for name, t in tensors.items():
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                E, cols, rows = t.shape  # x @ W: [E, in, out]
                blocks = np.empty((E, rows, cols // 32, 16), np.uint8)
                scales = np.empty((E, rows, cols // 32), np.uint8)
                for e in range(E):
                    w_t = t[e].to(torch.float32).T.contiguous().numpy()  # [out, in]
                    blocks[e], scales[e] = mxfp4(w_t, rows, cols)
                new[name + "_blocks"] = torch.from_numpy(blocks)
                new[name + "_scales"] = torch.from_numpy(scales)
                print(f"{name}: {E} x {rows} x {cols} -> MXFP4", flush=True)
            else:
                new[name] = t
        del tensors
        save_file(new, out / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in new})
        del new
    if index_path.exists():
        idx = json.loads(index_path.read_text())
        idx["weight_map"] = dict(sorted(weight_map.items()))
        idx.get("metadata", {}).pop("total_size", None)
        (out / index_path.name).write_text(json.dumps(idx, indent=2) + "\n")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", index_path.name):
            shutil.copy(f, out / f.name)
    print(json.dumps({"out": str(out), "shards": len(shards),
                      "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}))


if __name__ == "__main__":
    main()
