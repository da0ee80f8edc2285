#!/usr/bin/env python3
"""Quantize goldens with an importance matrix, produced by ggml itself.

`ggml_quantize_chunk(type, src, dst, 0, nrows, 256, imatrix)` with a non-NULL importance
matrix runs ggml's `quantize_row_*_impl` with `quant_weights` (the path `llama-quantize
--imatrix` takes), for Q4_0, Q4_1, Q5_0, Q5_1 and Q2_K..Q6_K. The input is the K-quant
goldens' `qk.in.f32` (see scripts/gen_quant_goldens.py) read as rows of 256 values; the
weights are one row of 256 per-column values (what llama-quantize makes of an imatrix entry:
the sum of squared activations over the count), random over six decades with some zeros.

Regenerate (deterministic, fixed numpy seed) from the repository root with:

    GGML_BASE_LIB=/path/to/libggml-base.so python3 scripts/gen_imatrix_goldens.py

(default: .cache/llama.cpp/build-cuda/bin/libggml-base.so; see gen_quant_goldens.py for why
ggml-base must be built without -march flags). It writes, under fixtures/kernels/:

  qw.weights.f32      the 256 per-column weights (f32, little-endian)
  qw_<type>.out.bin   ggml_quantize_chunk(qk.in.f32 as rows of 256, type, weights) bytes
"""

from __future__ import annotations

import ctypes
import pathlib

import numpy as np

from gen_quant_goldens import OUT, QK_K, TYPES, load_ggml

NAMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
TYPES = dict(TYPES, q4_1=(3, 32, 20))


def weights() -> np.ndarray:
    rng = np.random.default_rng(20261128)
    w = 10.0 ** rng.uniform(-4, 2, QK_K)
    w[rng.choice(QK_K, 12, replace=False)] = 0.0  # columns never seen
    w[32:48] = 0.0  # a whole Q2_K/Q3_K/Q6_K sub-block of them
    w[100] = 1e6  # one dominant column
    return w.astype(np.float32)


def quantize(lib: ctypes.CDLL, name: str, x: np.ndarray, w: np.ndarray) -> bytes:
    ty, block, size = TYPES[name]
    nrows = x.size // QK_K
    dst = ctypes.create_string_buffer(x.size // block * size)
    n = lib.ggml_quantize_chunk(ty, x.ctypes.data, dst, 0, nrows, QK_K, w.ctypes.data)
    assert n == x.size // block * size, (name, n)
    return dst.raw


def main() -> None:
    lib = load_ggml()
    x = np.fromfile(OUT / "qk.in.f32", dtype=np.float32)
    assert x.size % QK_K == 0
    w = weights()
    (OUT / "qw.weights.f32").write_bytes(w.tobytes())
    for name in NAMES:
        q = quantize(lib, name, x, w)
        # the weights matter: the bytes differ from the unweighted quantizer's
        unweighted = ctypes.create_string_buffer(len(q))
        lib.ggml_quantize_chunk(TYPES[name][0], x.ctypes.data, unweighted, 0, x.size // QK_K,
                                QK_K, None)
        assert q != unweighted.raw, name
        (OUT / f"qw_{name}.out.bin").write_bytes(q)
        print(f"quantize {name} with weights: {x.size} values -> {len(q)} bytes")
    total = sum(p.stat().st_size for p in OUT.glob("qw*"))
    print(f"{total} bytes of imatrix goldens in {OUT}")
    assert total < 100_000


if __name__ == "__main__":
    main()
