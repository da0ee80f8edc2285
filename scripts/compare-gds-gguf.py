#!/usr/bin/env python3
"""Compares every tensor of a converted model directory with the same-named tensor of a GGUF
(e.g. the one llama.cpp's convert_hf_to_gguf.py wrote from the same checkpoint): dtype, shape
and bytes. Prints {"same", "differ", "first_differ", "only_in_gguf"}.

    python3 scripts/compare-gds-gguf.py MODEL.gds REF.gguf

Needs gguf (gguf-py) and target/ci/gdsconv (GDSCONV=path to use another)."""
import json, os, subprocess, sys
import gguf
d, g = sys.argv[1], sys.argv[2]
info = json.loads(subprocess.run([os.environ.get("GDSCONV", "target/ci/gdsconv"), "inspect", "--json", "--tensors", d],
                                 capture_output=True, text=True, check=True).stdout)
files = {l["name"]: l["file"] for l in info["layers"]}
ref = {t.name: t for t in gguf.GGUFReader(g).tensors}
same, diff = 0, []
for t in info["tensors"]:
    r = ref.pop(t["name"])
    with open(f"{d}/{files[t['layer']]}", "rb") as f:
        f.seek(t["offset"]); ours = f.read(t["nbytes"])
    ok = r.tensor_type.name.lower() == t["dtype"] and [int(x) for x in reversed(r.shape)] == t["shape"] \
        and bytes(r.data) == ours
    if ok: same += 1
    else: diff.append((t["name"], t["dtype"], r.tensor_type.name))
print(json.dumps({"same": same, "differ": len(diff), "first_differ": diff[:6], "only_in_gguf": sorted(ref)[:6]}))
