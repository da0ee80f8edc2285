# Sourced by the GPU scripts: puts the CUDA libraries where cudarc looks for them.
# cudarc (built for CUDA 12.8's names) loads libcublas.so, libnvrtc.so and libcufile.so (or
# their .so.12 names); CUDA 13 ships libcublas.so.13 etc. (pip wheels under nvidia/, the
# toolkit under /usr/local/cuda). The newest file of each is linked under the plain name in
# $CUDA_LINKS, which goes first on LD_LIBRARY_PATH with the folders found (NVRTC loads its
# builtins from its own folder). Prints one line per library; safe under `set -euo pipefail`.
CUDA_LINKS=${CUDA_LINKS:-/tmp/gdsllm-culibs}
cuda_dirs=$(python3 - <<'PY' 2>/dev/null
import glob, os
out = set()
try:
    import nvidia
    for p in nvidia.__path__:
        for f in glob.glob(os.path.join(p, "**", "lib*.so*"), recursive=True):
            out.add(os.path.dirname(f))
except Exception:
    pass
print(":".join(sorted(out)))
PY
)
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  if [ -d "$d" ]; then cuda_dirs="$cuda_dirs:$d"; fi
done
mkdir -p "$CUDA_LINKS"
for lib in cublas cublasLt nvrtc cufile; do
  f=$( (for d in ${cuda_dirs//:/ }; do ls "$d"/lib$lib.so* 2>/dev/null; done || true) | sort -V | tail -1)
  if [ -n "$f" ]; then ln -sf "$f" "$CUDA_LINKS/lib$lib.so"; fi
  echo "lib$lib.so -> ${f:-NOT FOUND}"
done
export LD_LIBRARY_PATH="$CUDA_LINKS${cuda_dirs:+:${cuda_dirs#:}}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
