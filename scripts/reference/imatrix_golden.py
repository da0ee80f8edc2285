#!/usr/bin/env python3
"""Golden of llama.cpp's `llama-imatrix` on SmolLM2, for `gdsrun imatrix`'s tier-2 test
(crates/gdsrun/tests/it/cli.rs::imatrix_matches_llama_imatrix).

Runs llama-imatrix on the SmolLM2 Q4_1 GGUF over fixtures/reference/wiki-like.txt (4 chunks
of 128 tokens, one chunk a batch, 2 threads, --no-repack: the AMX extra buffer type
segfaults on this CPU) and stores a reduced golden (the full file is 1.3 MB with the
`.in_sum` and `.stats` tensors): per matrix the token count, the sum of `in_sum2` over its
columns, and `in_sum2` of every 16th column.

    scripts/build-llama-cpp.sh     # or: nice -n 19 ninja -C .cache/llama.cpp/build llama-imatrix
    python3 scripts/reference/imatrix_golden.py [--llama-imatrix BIN] [--keep FILE]

writes fixtures/reference/imatrix.json. Needs numpy and gguf-py (llama.cpp's, from
.cache/llama.cpp/src/llama.cpp/gguf-py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / ".cache/llama.cpp/src/llama.cpp/gguf-py"))
import gguf  # noqa: E402

MODEL = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "fixtures/reference/wiki-like.txt"
CTX, CHUNKS, STRIDE = 128, 4, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-imatrix", default=str(ROOT / ".cache/llama.cpp/build/bin/llama-imatrix"))
    ap.add_argument("--keep", help="keep llama-imatrix's whole output here")
    a = ap.parse_args()
    out = pathlib.Path(a.keep or tempfile.mkdtemp(prefix="imatrix-") + "/llama.imatrix.gguf")
    cmd = [a.llama_imatrix, "-m", MODEL, "-f", TEXT, "-o", str(out), "-c", str(CTX),
           "-b", str(CTX), "--chunks", str(CHUNKS), "-t", "2", "--no-repack"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    r = gguf.GGUFReader(str(out))
    tensors = {t.name: t.data.ravel().astype("float64") for t in r.tensors}
    entries = {}
    for name in sorted(tensors):
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        s2 = tensors[name]
        entries[base] = {
            "count": int(tensors[base + ".counts"][0]),
            "cols": len(s2),
            "sum": float(s2.sum()),
            "every16": [float(f"{v:.7g}") for v in s2[::STRIDE]],
        }
    golden = {
        "what": "llama-imatrix on SmolLM2: per matrix the token count, the sum of in_sum2 over its columns, in_sum2 of columns 0, 16, 32, ...",
        "generator": "scripts/reference/imatrix_golden.py",
        "command": " ".join(["llama-imatrix"] + cmd[1:]),
        "model": MODEL,
        "text": TEXT,
        "ctx": CTX,
        "chunks": CHUNKS,
        "stride": STRIDE,
        "chunk_count": int(r.fields["imatrix.chunk_count"].contents()),
        "entries": entries,
    }
    dest = ROOT / "fixtures/reference/imatrix.json"
    dest.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{dest}: {len(entries)} matrices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
