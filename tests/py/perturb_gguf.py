#!/usr/bin/env python3
"""Copies a GGUF file with one float tensor scaled: a second model that shares every other
tensor with the first (the distribution tests use it for layer deduplication).

    perturb_gguf.py IN.gguf OUT.gguf [--tensor output_norm.weight] [--scale 1.25]

gguf-py (pip install gguf==0.19.0 numpy) finds the tensor's data; the copy is byte-identical to
IN except for that tensor's bytes, which are rewritten in place with the same dtype and size.
Only F32 and F16 tensors (norms, biases) can be scaled.
"""

import argparse
import shutil

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--tensor", default="output_norm.weight")
    ap.add_argument("--scale", type=float, default=1.25)
    a = ap.parse_args()

    r = GGUFReader(a.src)
    ts = [t for t in r.tensors if t.name == a.tensor]
    if not ts:
        raise SystemExit("%s: no tensor %s" % (a.src, a.tensor))
    t = ts[0]
    dtypes = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    if t.tensor_type not in dtypes:
        raise SystemExit("%s is %s; only F32 and F16 can be scaled" % (a.tensor, t.tensor_type.name))
    data = np.asarray(t.data, dtype=dtypes[t.tensor_type]).copy()
    scaled = (data.astype(np.float32) * a.scale).astype(dtypes[t.tensor_type])
    raw = scaled.tobytes()
    assert len(raw) == t.n_bytes, (len(raw), t.n_bytes)
    del r

    tmp = a.dst + ".tmp"
    shutil.copyfile(a.src, tmp)
    with open(tmp, "r+b") as f:
        f.seek(t.data_offset)
        f.write(raw)
    shutil.move(tmp, a.dst)
    print("%s: %s x %g (%d bytes at offset %d)" % (a.dst, a.tensor, a.scale, len(raw), t.data_offset))


if __name__ == "__main__":
    main()
