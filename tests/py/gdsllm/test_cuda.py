"""`Model.load(device="cuda:N")`: layers in GPU memory handed to PyTorch through DLPack with
no host copy (io="gds": cuFile straight into VRAM). Needs the package built with CUDA
(`pip install . --config-settings=build-args="--features cuda"`) and a GPU; elsewhere these
tests are reported as skipped, except the refusal on a CUDA build without a usable GPU."""

import gc

import numpy as np
import pytest

import gdsllm

pytestmark = pytest.mark.skipif(not gdsllm.CUDA, reason="this gdsllm build has no CUDA")


def _torch_cuda():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a partial CUDA install raises ValueError/OSError
        pytest.skip(f"torch does not import: {e}")
    if not torch.cuda.is_available():
        return None
    return torch


def test_without_a_usable_gpu_the_refusal_names_what_is_missing(smollm2_dir):
    torch = _torch_cuda()
    if torch is not None:
        pytest.skip("a GPU is usable here")
    m = gdsllm.open(str(smollm2_dir))
    with pytest.raises(gdsllm.GdsError, match="blk.0.*CUDA backend unavailable"):
        m.load("blk.0", device="cuda:0")


@pytest.mark.parametrize("io", ["mmap", "direct", "gds"])
def test_layer_on_the_gpu_equals_the_file_and_outlives_the_model(smollm2_dir, io):
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("no usable GPU")
    m = gdsllm.open(str(smollm2_dir))
    try:
        ts = m.load("blk.0", device="cuda:0", io=io)
    except gdsllm.GdsError as e:
        if io == "gds" and "cuFile" in str(e):
            pytest.skip(f"cuFile refuses this filesystem: {e}")
        raise
    host = {t.name: t.numpy() for t in m.load("blk.0")}
    assert set(host) == {t.name for t in ts}
    kept = {}
    for t in ts:
        assert t.device == "cuda:0" and t.__dlpack_device__() == (2, 0)
        assert t.load_path == ("gds" if io == "gds" else "bounce")
        x = torch.from_dlpack(t)
        assert x.device.type == "cuda" and x.data_ptr() == t.data_ptr
        assert np.array_equal(x.cpu().numpy(), host[t.name]), t.name
        with pytest.raises(gdsllm.GdsError, match="is on cuda:0"):
            t.numpy()
        kept[t.name] = x
    # the VRAM stays while a torch tensor refers to it
    del m, ts, t
    gc.collect()
    for name, x in kept.items():
        assert np.array_equal(x.cpu().numpy(), host[name]), name
