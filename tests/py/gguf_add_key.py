#!/usr/bin/env python3
"""Copies a GGUF file with one more scalar key/value (or one replaced), everything else as it
was: the tests use it to give a model metadata its source lacked (an embedding model's
`<arch>.pooling_type`).

    gguf_add_key.py IN.gguf OUT.gguf KEY uint32|int32|float32|bool|string VALUE

gguf-py (pip install gguf==0.19.0 numpy) reads every key/value and tensor and writes them
again with its GGUFWriter (as gguf-py's own gguf_new_metadata.py does).
"""

import argparse

from gguf import GGUFReader, GGUFValueType, GGUFWriter

TYPES = {"uint32": (GGUFValueType.UINT32, int), "int32": (GGUFValueType.INT32, int),
         "float32": (GGUFValueType.FLOAT32, float),
         "bool": (GGUFValueType.BOOL, lambda s: s.lower() in ("1", "true")),
         "string": (GGUFValueType.STRING, str)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("key")
    ap.add_argument("type", choices=sorted(TYPES))
    ap.add_argument("value")
    a = ap.parse_args()
    vtype, conv = TYPES[a.type]
    rewrite(a.src, a.dst, {a.key: (conv(a.value), vtype)})


def rewrite(src, dst, extra=None, **writer_args):
    """Writes the GGUF `src` again as `dst` with gguf-py's GGUFWriter: every key/value but
    those `extra` ({key: (value, GGUFValueType)}) sets, then `extra`'s, and every tensor as
    it was. `writer_args` go to GGUFWriter (split_max_tensors=, small_first_shard=: the
    shards of a split GGUF). Returns the writer (closed)."""
    extra = extra or {}
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch=arch, **writer_args)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in extra:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in extra.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return w


if __name__ == "__main__":
    main()
