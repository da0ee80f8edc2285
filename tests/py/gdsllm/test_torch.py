"""torch.from_dlpack on gdsllm tensors: the same memory, no copy. scripts/test.sh installs
PyPI's torch (with its CUDA libraries) when the disk has room; where torch does not import
(absent, or an install cut short, whose error is not an ImportError) these tests are
reported as skipped."""

import gc

import numpy as np
import pytest

import gdsllm

try:
    import torch
except Exception as e:  # noqa: BLE001 - a partial CUDA install raises ValueError/OSError
    pytest.skip(f"torch does not import: {e}", allow_module_level=True)


def test_torch_from_dlpack_shares_the_mapping(smollm2_dir):
    m = gdsllm.open(str(smollm2_dir))
    for name, dtype in [("blk.0.attn_norm.weight", torch.float32), ("blk.0.attn_q.weight", torch.uint8)]:
        t = m[name]
        x = torch.from_dlpack(t)
        assert x.data_ptr() == t.data_ptr
        assert x.dtype == dtype and list(x.shape) == list(t.numpy().shape)
        assert np.array_equal(x.numpy(), t.numpy())


def test_torch_tensor_outlives_model_and_tensor(smollm2_dir):
    def weights():
        return torch.from_dlpack(gdsllm.open(str(smollm2_dir))["blk.1.ffn_norm.weight"])

    x = weights()
    gc.collect()
    want = gdsllm.open(str(smollm2_dir))["blk.1.ffn_norm.weight"].numpy()
    assert np.array_equal(x.numpy(), want)


def test_dequantized_weights_in_torch(smollm2_dir):
    t = gdsllm.open(str(smollm2_dir))["blk.0.ffn_up.weight"]
    x = torch.from_numpy(t.dequantize())
    assert x.dtype == torch.float32 and list(x.shape) == t.shape


def test_a_write_through_torch_is_not_possible(smollm2_dir, tmp_path):
    # PyTorch has no read-only tensors (it ignores DLPack's read-only flag), but the pages
    # are mapped read-only: a write kills the writing process (SIGSEGV) and changes nothing.
    import signal
    import subprocess
    import sys

    m = gdsllm.open(str(smollm2_dir))
    t = m["blk.0.attn_norm.weight"]
    before = t.numpy().copy()
    code = (
        "import gdsllm, torch, sys\n"
        f"x = torch.from_dlpack(gdsllm.open({str(smollm2_dir)!r})['blk.0.attn_norm.weight'])\n"
        "x.add_(1)\n"
        "sys.exit(0)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGSEGV, p
    assert np.array_equal(gdsllm.open(str(smollm2_dir), verify=True)["blk.0.attn_norm.weight"].numpy(), before)


def test_torch_forward_example_matches_gdsrun(smollm2_dir):
    # examples/torch_forward.py: SmolLM2 in plain PyTorch, one layer at a time, against
    # gdsrun's log-probabilities of the next token (exit 0: same top tokens, within 0.01)
    import subprocess
    import sys

    from conftest import ROOT, gdsrun_path

    p = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "torch_forward.py"), str(smollm2_dir),
         "--gdsrun", str(gdsrun_path()), "--tol", "0.01"],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tokens equal" in p.stdout


def test_torch_forward_example_loads_the_next_layer_while_the_current_computes(monkeypatch):
    # The example's Prefetcher with a stand-in loader that blocks until released: while the
    # caller holds layer i (and has not asked for more), layer i+1 is being loaded on the
    # background thread, and layer i+2 is not (two layers resident at most).
    import importlib.util
    import threading

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("torch_forward", ROOT / "examples" / "torch_forward.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    names = [f"blk.{i}" for i in range(5)]
    started = {n: threading.Event() for n in names}
    release = {n: threading.Event() for n in names}

    def fake_weights(model, name):
        started[name].set()
        assert release[name].wait(30), f"{name} never released"
        return {"w": name}

    monkeypatch.setattr(ex, "weights", fake_weights)
    it = iter(ex.Prefetcher(None, names))
    release[names[0]].set()
    for i, n in enumerate(names):
        got_name, w = next(it)
        assert got_name == n and w == {"w": n}
        if i + 1 < len(names):
            assert started[names[i + 1]].wait(30), f"{names[i + 1]} not loading while {n} computes"
            if i + 2 < len(names):
                assert not started[names[i + 2]].is_set()
            release[names[i + 1]].set()
    assert next(it, None) is None


def test_torch_forward_examples_torch_dequantization_equals_gds_kernels(smollm2_dir):
    # the example's --dequant torch (what it runs on a GPU, on the CUDA tensors) on the
    # mapped bytes: every tensor of SmolLM2 (Q4_1, Q8_0, F32) equal to gds-kernels' values
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("torch_forward", ROOT / "examples" / "torch_forward.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    m = gdsllm.open(str(smollm2_dir))
    seen = set()
    for t in m.load("blk.0") + m.load("embed"):
        got = ex.dequantize_torch(t, torch.from_dlpack(t))
        assert got.dtype == torch.float32 and list(got.shape) == list(t.shape)
        assert np.array_equal(got.numpy(), t.dequantize()), t.name
        seen.add(t.dtype)
    assert seen == {"q4_1", "q8_0", "f32"}, seen
