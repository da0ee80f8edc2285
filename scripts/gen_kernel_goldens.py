#!/usr/bin/env python3
"""Golden files for crates/gds-kernels, produced with llama.cpp's gguf-py.

Regenerate (deterministic, fixed numpy seed) from the repository root with:

    pip install 'gguf>=0.19' numpy
    python3 scripts/gen_kernel_goldens.py

It writes, under fixtures/kernels/ (all little-endian, no headers):

  q_<type>.in.f32    f32 input to quantize (random values plus edge blocks)
  q_<type>.out.bin   gguf.quants.quantize(input, type) bytes
  dq_<type>.in.bin   raw blocks (random quants, sane f16 scales, no NaN/inf)
  dq_<type>.out.f32  gguf.quants.dequantize(blocks, type)  (also IQ4_NL and IQ4_XS, and the
                     grid i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)

gguf-py has no Q8_K at all, and its Q8_1 size (40 bytes) predates ggml's 36-byte block
with f16 d/s, so for those two the dequantize goldens are computed here with numpy as
ggml does (`x = d * q`); they are marked "numpy reference" in the output below.
"""

from __future__ import annotations

import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "kernels"
rng = np.random.default_rng(20240607)


def edge_blocks(block: int) -> np.ndarray:
    """Inputs that stress rounding, zero scales and sign handling, one block each."""
    rows = []
    rows.append(np.zeros(block))  # all zero: d == 0 paths
    rows.append(np.full(block, 3.25))  # constant: max == min for Q4_1/Q5_1
    rows.append(np.full(block, -1e-3))  # constant negative
    r = np.zeros(block)
    r[block // 3] = 1e5  # one large value, the rest zero
    rows.append(r)
    rows.append(-np.abs(rng.standard_normal(block)) * 50.0)  # all negative
    rows.append(rng.standard_normal(block) * 1e-6)  # tiny magnitudes (subnormal f16 scales)
    rows.append(rng.standard_normal(block) * 1e-30)  # below f16 range entirely
    # exact ties: multiples of half steps of a scale of 1 (amax 127 for Q8_0, etc.)
    r = (rng.integers(-254, 255, block) / 2.0)
    r[0] = 127.0
    rows.append(r)
    r = rng.integers(-8, 8, block).astype(np.float64)
    r[0] = -8.0
    rows.append(r)  # Q4_0 with d = 1 exactly
    r = rng.integers(0, 16, block).astype(np.float64) * 0.5 + 0.25
    rows.append(r)
    rows.append(rng.standard_normal(block) * 6e3)  # large but f16-finite scales
    return np.concatenate(rows).astype(np.float32)


def quant_input(block: int, n_random_blocks: int) -> np.ndarray:
    rnd = (rng.standard_normal(n_random_blocks * block) * rng.choice([0.02, 1.0, 30.0], n_random_blocks * block)).astype(np.float32)
    return np.concatenate([edge_blocks(block), rnd]).astype(np.float32)


def write(name: str, arr: np.ndarray) -> None:
    (OUT / name).write_bytes(np.ascontiguousarray(arr).tobytes())


def f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def sane_scales(n: int, spread: float = 0.05) -> np.ndarray:
    """f16 scales: mostly normal magnitudes, some negative, zero and subnormal ones."""
    s = rng.standard_normal(n) * spread
    s[:: 7] = 0.0
    s[3:: 11] = 3e-6  # subnormal in f16
    s[5:: 13] *= 100.0
    return s


def random_blocks(qtype: T, n: int) -> np.ndarray:
    """n random but valid blocks of qtype (uint8, shape (n, type_size))."""
    bs, ts = quants.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    def put(off: int, vals: np.ndarray) -> None:
        b[:, off:off + 2] = f16_bytes(vals)
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):
        put(0, sane_scales(n))
    elif qtype in (T.Q4_1, T.Q5_1):
        put(0, np.abs(sane_scales(n)))
        put(2, sane_scales(n, 1.0))
    elif qtype == T.Q2_K:
        put(ts - 4, sane_scales(n, 0.01))
        put(ts - 2, sane_scales(n, 0.01))
    elif qtype in (T.Q3_K, T.Q6_K):
        put(ts - 2, sane_scales(n, 0.01))
    elif qtype in (T.Q4_K, T.Q5_K):
        put(0, sane_scales(n, 0.01))
        put(2, sane_scales(n, 0.01))
    elif qtype in (T.IQ4_NL, T.IQ4_XS):
        put(0, sane_scales(n))  # random nibbles (and IQ4_XS's random 6-bit sub-block scales)
    elif qtype in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S):
        put(0, sane_scales(n))  # random grid indices, signs and sub-block scales
    elif qtype == T.IQ1_M:
        # the f16 scale is the top nibbles of the four u16 scale words (bytes 48..56)
        bits = f16_bytes(sane_scales(n)).copy().view(np.uint16).reshape(n)
        for i in range(4):
            b[:, 49 + 2 * i] = (b[:, 49 + 2 * i] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    else:
        raise ValueError(qtype)
    return b


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*q_*"):
        old.unlink()

    # ---- quantize goldens ----
    for qtype, block in [(T.F32, 32), (T.F16, 32), (T.BF16, 32), (T.Q4_0, 32), (T.Q4_1, 32),
                         (T.Q5_0, 32), (T.Q5_1, 32), (T.Q8_0, 32)]:
        x = quant_input(block, 24)
        if qtype == T.F16:
            x = np.concatenate([x, np.array([65504, 65520, 7e4, -7e4, 6e-8, 3e-8, 2.9e-8, 1e-45, -0.0, 1.0009765625, 1.00048828125], dtype=np.float32)])
        if qtype == T.BF16:
            x = np.concatenate([x, np.array([3.4e38, -3.4e38, 1e-45, -0.0, 1.00390625, 1.005859375, 1.0029296875], dtype=np.float32)])
        name = qtype.name.lower()
        with np.errstate(over="ignore"):
            q = quants.quantize(x, qtype)
        write(f"q_{name}.in.f32", x)
        write(f"q_{name}.out.bin", q.view(np.uint8))
        print(f"quantize {name}: {x.size} values -> {q.nbytes} bytes")

    # ---- dequantize goldens ----
    # plain floats: random bit patterns, NaN and inf removed
    f32 = rng.standard_normal(300).astype(np.float32) * np.float32(1e3)
    f32 = np.concatenate([f32, np.array([0.0, -0.0, 1e-45, 3.4e38, -1.17549435e-38], dtype=np.float32)])
    write("dq_f32.in.bin", f32.view(np.uint8))
    write("dq_f32.out.f32", quants.dequantize(f32.view(np.uint8), T.F32))
    for qtype, width in [(T.F16, np.uint16), (T.BF16, np.uint16)]:
        bits = rng.integers(0, 1 << 16, 600).astype(np.uint16)
        if qtype == T.F16:
            bits = bits[(bits & 0x7C00) != 0x7C00]
        else:
            bits = bits[(bits & 0x7F80) != 0x7F80]
        name = qtype.name.lower()
        write(f"dq_{name}.in.bin", bits.view(np.uint8))
        write(f"dq_{name}.out.f32", quants.dequantize(bits.view(np.uint8), qtype).astype(np.float32))
        print(f"dequantize {name}: {bits.size} values")
    def dequant_golden(qtype):
        """24 random blocks of `qtype` and gguf-py's dequantization of them."""
        blocks = random_blocks(qtype, 24)
        y = quants.dequantize(blocks, qtype)
        assert np.isfinite(y).all(), qtype
        name = qtype.name.lower()
        write(f"dq_{name}.in.bin", blocks)
        write(f"dq_{name}.out.f32", y.astype(np.float32))
        print(f"dequantize {name}: {blocks.shape[0]} blocks")

    for qtype in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        dequant_golden(qtype)

    # numpy reference (not in gguf-py, see module docstring)
    n = 24
    q81 = rng.integers(0, 256, size=(n, 36), dtype=np.uint8)
    q81[:, 0:2] = f16_bytes(sane_scales(n))
    q81[:, 2:4] = f16_bytes(sane_scales(n))
    d = q81[:, 0:2].copy().view(np.float16).astype(np.float32)
    y = q81[:, 4:].view(np.int8).astype(np.float32) * d
    write("dq_q8_1.in.bin", q81)
    write("dq_q8_1.out.f32", y.astype(np.float32))
    print("dequantize q8_1 (numpy reference)")
    n = 6
    q8k = rng.integers(0, 256, size=(n, 292), dtype=np.uint8)
    q8k[:, 0:4] = (rng.standard_normal(n).astype(np.float32) * np.float32(0.01)).view(np.uint8).reshape(n, 4)
    d = q8k[:, 0:4].copy().view(np.float32)
    y = d * q8k[:, 4:260].view(np.int8).astype(np.float32)
    write("dq_q8_k.in.bin", q8k)
    write("dq_q8_k.out.f32", y.astype(np.float32))
    print("dequantize q8_k (numpy reference)")

    # MXFP4 (gpt-oss), last so that the draws above are unchanged
    x = quant_input(32, 24)
    q = quants.quantize(x, T.MXFP4)
    write("q_mxfp4.in.f32", x)
    write("q_mxfp4.out.bin", q.view(np.uint8))
    print(f"quantize mxfp4: {x.size} values -> {q.nbytes} bytes")
    blocks = rng.integers(0, 256, size=(24, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(100, 140, 24)  # 2^-28 .. 2^11
    blocks[:2, 0] = [0, 1]  # subnormal scales
    write("dq_mxfp4.in.bin", blocks)
    write("dq_mxfp4.out.f32", quants.dequantize(blocks, T.MXFP4).astype(np.float32))
    print("dequantize mxfp4: 24 blocks")

    # IQ4_NL and IQ4_XS (llama.cpp's non-linear 4-bit types), after MXFP4 so that the draws
    # above are unchanged
    for qtype in [T.IQ4_NL, T.IQ4_XS]:
        dequant_golden(qtype)

    # the grid i-quants, last again
    for qtype in [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]:
        dequant_golden(qtype)

    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{total} bytes in {OUT}")
    assert total < 2_000_000


if __name__ == "__main__":
    main()
