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

and, when llama-quantize is there (LLAMA_QUANTIZE, default
.cache/llama.cpp/build/bin/llama-quantize; gguf-py from .cache/llama.cpp/src/llama.cpp), the
converter's fixture under fixtures/imatrix/:

  tiny-llama.imatrix.gguf  a random importance matrix for fixtures/tiny-llama.gguf's block
                           matrices and output head, as llama-imatrix writes it (GGUF)
  tiny-llama.imatrix.dat   the same in the legacy format (counts are 512 * 2^k, so the
                           weights both formats give are the same floats)
  tiny-llama-q4_0-imatrix.gguf  `llama-quantize --pure --allow-requantize --imatrix
                           tiny-llama.imatrix.gguf fixtures/tiny-llama.gguf OUT Q4_0`
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import sys

import numpy as np

from gen_quant_goldens import OUT, QK_K, ROOT, TYPES, load_ggml

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


def imatrix_fixture() -> None:
    llama_quantize = os.environ.get(
        "LLAMA_QUANTIZE", str(ROOT / ".cache/llama.cpp/build/bin/llama-quantize"))
    if not pathlib.Path(llama_quantize).exists():
        print(f"{llama_quantize} missing: fixtures/imatrix not regenerated")
        return
    sys.path.insert(0, str(ROOT / ".cache/llama.cpp/src/llama.cpp/gguf-py"))
    import gguf

    out = ROOT / "fixtures" / "imatrix"
    out.mkdir(exist_ok=True)
    src = ROOT / "fixtures" / "tiny-llama.gguf"
    rng = np.random.default_rng(3403)
    chunk = 512
    entries = []
    for t in gguf.GGUFReader(str(src)).tensors:
        if len(t.shape) != 2 or not (t.name.startswith("blk.") or t.name == "output.weight"):
            continue
        cols = int(t.shape[0])
        count = chunk * 2 ** int(rng.integers(0, 3))
        mean_sq = rng.gamma(0.5, 1.0, cols) * np.where(rng.random(cols) < 0.05, 100.0, 1.0)
        entries.append((t.name, (mean_sq * count).astype(np.float32), count))
    w = gguf.GGUFWriter(str(out / "tiny-llama.imatrix.gguf"), "imatrix")
    del w.kv_data[0]["general.architecture"]  # llama-imatrix writes none
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["calib.txt"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", chunk)
    for name, sum2, count in entries:
        w.add_tensor(f"{name}.in_sum2", sum2.reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[count]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(out / "tiny-llama.imatrix.dat", "wb") as f:
        f.write(np.int32(len(entries)).tobytes())
        for name, sum2, count in entries:
            ncall = count // chunk
            f.write(np.int32(len(name)).tobytes() + name.encode())
            f.write(np.int32(ncall).tobytes() + np.int32(sum2.size).tobytes())
            f.write(((sum2 / np.float32(count)) * np.float32(ncall)).astype(np.float32).tobytes())
        f.write(np.int32(4).tobytes() + np.int32(9).tobytes() + b"calib.txt")
    golden = out / "tiny-llama-q4_0-imatrix.gguf"
    subprocess.run([llama_quantize, "--pure", "--allow-requantize", "--imatrix",
                    str(out / "tiny-llama.imatrix.gguf"), str(src), str(golden), "Q4_0", "1"],
                   check=True, capture_output=True)
    print(f"{len(entries)} imatrix entries, {golden.stat().st_size} bytes of golden in {out}")


if __name__ == "__main__":
    main()
    imatrix_fixture()
