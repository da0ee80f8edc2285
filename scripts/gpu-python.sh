#!/usr/bin/env bash
# The Python package's GPU checks, on a GPU machine (no Rust toolchain, PyTorch installed):
#   scripts/gpu-python.sh WHEEL_DIR MODEL_DIR GDSRUN OUT
# WHEEL_DIR: the gdsllm wheel built with CUDA here (`PY=1 scripts/gpu-pack.sh` puts it in
# .gpu/py), plus pytest's wheels if the machine lacks pytest; MODEL_DIR: SmolLM2 converted
# (the pack's smollm2/); GDSRUN: gdsrun (the pack's bin/gdsrun). Installs the wheels into
# /tmp/site, then writes to OUT: test_cuda.py's results (Model.load(device="cuda:0") with
# io=mmap, direct and gds; torch.from_dlpack on cuda:0; the VRAM outliving the model) and
# examples/torch_forward.py on the GPU (weights placed by gdsllm, dequantized by PyTorch on
# the GPU) against gdsrun's log-probabilities, once per io.
set -uo pipefail
WHEELS=$1 MODEL=$2 GDSRUN=$3 OUT=$4
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} GDSLLM_HOME=/tmp/gdsllm-home
nvidia-smi -L >"$OUT/gpu.txt" 2>&1
python3 -c 'import gdsllm, torch; print("gdsllm.CUDA", gdsllm.CUDA, "torch", torch.__version__, torch.cuda.is_available())' \
  | tee "$OUT/versions.txt"
GDSLLM_TEST_SMOLLM2_DIR=$MODEL GDSRUN=$GDSRUN python3 -m pytest -v -p no:cacheprovider \
  tests/py/gdsllm/test_cuda.py >"$OUT/test_cuda.txt" 2>&1
echo "test_cuda.py: exit $?" | tee -a "$OUT/summary.txt"
for io in mmap direct gds; do
  python3 examples/torch_forward.py "$MODEL" --gdsrun "$GDSRUN" --device cuda --io "$io" --tol 0.01 \
    >"$OUT/torch_forward-$io.txt" 2>&1
  echo "torch_forward.py --device cuda --io $io: exit $?" | tee -a "$OUT/summary.txt"
done
