#!/usr/bin/env python3
"""Quantize goldens for the K-quants (Q2_K..Q6_K), produced by ggml itself.

gguf-py has no K-quant quantizer, so these come from llama.cpp's ggml-base library through
ctypes: `ggml_quantize_chunk(type, src, dst, 0, nrows, 256, NULL)`, which without an
importance matrix runs ggml's `quantize_row_q{2..6}_K_ref`. (The Q4_0..Q8_0 quantize
goldens come from gguf-py, see scripts/gen_kernel_goldens.py; as a check that the library
is called right, this script also runs ggml's Q4_0/Q5_0/Q5_1/Q8_0 on those inputs and
asserts the bytes equal gguf-py's.)

Regenerate (deterministic, fixed numpy seed) from the repository root with:

    scripts/build-llama-cpp.sh            # or any llama.cpp build with libggml-base.so
    GGML_BASE_LIB=/path/to/libggml-base.so python3 scripts/gen_quant_goldens.py

Copy the library (and its .so.N links) somewhere stable first if its build directory may
be rebuilt while this runs. ggml-base must be built without -march flags (llama.cpp's
default: only the CPU backend gets them), so that the compiler fuses no multiply-adds.

It writes, under fixtures/kernels/ (little-endian, no headers):

  qk.in.f32         f32 input, whole 256-element super-blocks (edge blocks, then random)
  qk_<type>.out.bin ggml_quantize_chunk(input, type) bytes, for q2_k .. q6_k
"""

from __future__ import annotations

import ctypes
import os
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "kernels"
QK_K = 256
# enum ggml_type values (ggml/include/ggml.h) and block sizes in bytes
TYPES = {
    "q4_0": (2, 32, 18),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q8_0": (8, 32, 34),
    "q2_k": (10, QK_K, 84),
    "q3_k": (11, QK_K, 110),
    "q4_k": (12, QK_K, 144),
    "q5_k": (13, QK_K, 176),
    "q6_k": (14, QK_K, 210),
}
rng = np.random.default_rng(20261127)


def load_ggml() -> ctypes.CDLL:
    default = ROOT / ".cache" / "llama.cpp" / "build-cuda" / "bin" / "libggml-base.so"
    lib = ctypes.CDLL(os.environ.get("GGML_BASE_LIB", str(default)))
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def quantize(lib: ctypes.CDLL, name: str, x: np.ndarray) -> bytes:
    ty, block, size = TYPES[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.size % block == 0
    # one row per 256 values: rows are independent in every type here
    n_per_row = QK_K if x.size % QK_K == 0 else block
    nrows = x.size // n_per_row
    dst = ctypes.create_string_buffer(x.size // block * size)
    n = lib.ggml_quantize_chunk(ty, x.ctypes.data, dst, 0, nrows, n_per_row, None)
    assert n == x.size // block * size, (name, n)
    return dst.raw


def edge_superblocks() -> np.ndarray:
    """Super-blocks that stress zero scales, sub-block spread, signs and rounding."""
    b = QK_K
    rows = []
    rows.append(np.zeros(b))  # all zero
    rows.append(np.full(b, 3.25))  # constant: max == min
    rows.append(np.full(b, -1e-3))  # constant negative
    r = np.zeros(b)
    r[77] = 1e5  # one outlier, the rest zero
    rows.append(r)
    r = rng.standard_normal(b) * 0.01
    r[200] = -40.0  # one outlier in noise
    rows.append(r)
    rows.append(-np.abs(rng.standard_normal(b)) * 50.0)  # all negative
    rows.append(np.abs(rng.standard_normal(b)) * 2.0 + 0.5)  # all positive, min > 0
    rows.append(rng.standard_normal(b) * 1e-6)  # tiny (subnormal f16 scales)
    rows.append(rng.standard_normal(b) * 1e-30)  # below f16 range entirely
    # sub-blocks of 16 at very different magnitudes, some of them zero
    r = rng.standard_normal(b)
    for j in range(16):
        r[16 * j:16 * j + 16] *= 10.0 ** (j % 8 - 4) if j % 5 else 0.0
    rows.append(r)
    r = rng.integers(-8, 8, b).astype(np.float64)  # small integers: exact ties
    rows.append(r)
    rows.append(rng.integers(-254, 255, b) / 2.0)  # half steps
    rows.append(rng.standard_normal(b) * 6e3)  # large but f16-finite scales
    return np.concatenate(rows)


def main() -> None:
    lib = load_ggml()

    # the library is called right: ggml's legacy quantizers equal gguf-py's goldens
    for name in ["q4_0", "q5_0", "q5_1", "q8_0"]:
        x = np.fromfile(OUT / f"q_{name}.in.f32", dtype=np.float32)
        want = (OUT / f"q_{name}.out.bin").read_bytes()
        assert quantize(lib, name, x) == want, f"ggml {name} differs from gguf-py's golden"
        print(f"check {name}: ggml == gguf-py on {x.size} values")

    n_random = 6
    scale = rng.choice([0.02, 1.0, 30.0], n_random * QK_K)
    rnd = rng.standard_normal(n_random * QK_K) * scale
    x = np.concatenate([edge_superblocks(), rnd]).astype(np.float32)
    assert np.isfinite(x).all()
    (OUT / "qk.in.f32").write_bytes(x.tobytes())
    for name in ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]:
        q = quantize(lib, name, x)
        (OUT / f"qk_{name}.out.bin").write_bytes(q)
        print(f"quantize {name}: {x.size} values -> {len(q)} bytes")
    total = sum(p.stat().st_size for p in OUT.glob("qk*"))
    print(f"{total} bytes of K-quant goldens in {OUT}")
    assert total < 100_000


if __name__ == "__main__":
    main()
