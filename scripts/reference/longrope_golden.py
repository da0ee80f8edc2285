#!/usr/bin/env python3
"""Golden logits of fixtures/tiny-phi35-hf (LongRoPE) on a sequence longer than its
original_max_position_embeddings (64), where transformers switches to the long factors:
writes fixtures/tiny-phi35-hf/golden_long.json in golden.json's format.

    nice /root/ref-venv/bin/python scripts/reference/longrope_golden.py

transformers float32, eager attention, one forward pass over 80 tokens: the 12 golden tokens,
then ids (7 * i) % 317 + 3 for i = 0..67 (deterministic, every id < 320). A runtime that picks
LongRoPE's factors by its context (llama.cpp: long when n_ctx > original) must run this with a
context above 64 to match; margins let a test skip positions whose top two logits tie.
"""
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
DIR = REPO / "fixtures/tiny-phi35-hf"

golden = json.loads((DIR / "golden.json").read_text())
tokens = golden["tokens"] + [(7 * i) % 317 + 3 for i in range(68)]
model = AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32, attn_implementation="eager").eval()
assert model.config.rope_parameters["rope_type"] == "longrope"
with torch.no_grad():
    logits = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy().astype(np.float64)
top2 = np.sort(logits, axis=-1)[:, -2:]
margins = top2[:, 1] - top2[:, 0]
out = {
    "tokens": tokens,
    "text": "12 golden tokens + (7 i) % 317 + 3 for i < 68: 80 tokens > original_max_position_embeddings 64",
    "argmax": [int(a) for a in logits.argmax(-1)],
    "margins": [float(f"{m:.6g}") for m in margins],
    "min_margin": float(f"{margins.min():.6g}"),
    "transformers": transformers.__version__,
    "attn_implementation": "eager",
    "dtype": "float32",
    "logits": [[float(f"{v:.6g}") for v in row] for row in logits],
}
(DIR / "golden_long.json").write_text(json.dumps(out) + "\n")
print(f"wrote {DIR / 'golden_long.json'}: {len(tokens)} tokens, min margin {margins.min():.3g}")
