"""Fixtures of the gdsllm package's tests (scripts/test.sh runs them after `pip install .`):
the real models fetched by scripts/fetch-model.sh / fetch-gemma.sh, converted once per
session with gdsllm.convert, and the gdsrun binary of the test build, to compare with."""

import functools
import os
import pathlib
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODELS = ROOT / ".cache" / "models"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = MODELS / "gemma-3-270m-q4_k_m.gguf"


def gdsrun_path():
    p = pathlib.Path(os.environ.get("GDSRUN", ROOT / "target" / "ci" / "gdsrun"))
    if not p.exists():
        pytest.fail(f"{p}: no gdsrun binary (build it: cargo build --profile ci -p gdsrun)")
    return p


@pytest.fixture(scope="session", autouse=True)
def gdsllm_home(tmp_path_factory):
    """A per-session GDSLLM_HOME: the store and the verification cache of both gdsrun and
    gdsllm live there, not in the user's."""
    home = tmp_path_factory.mktemp("gdsllm-home")
    os.environ["GDSLLM_HOME"] = str(home)
    return home


class _NumpyPlainMaps:
    """numpy, except that `memmap` gives a plain ndarray over the mapping (the memmap kept
    alive as its base): what gguf-py's reader sees while it parses, see `gguf_reader`."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode="r", **kw):
        return np.memmap(path, mode=mode, **kw).view(np.ndarray)


@functools.lru_cache(maxsize=None)
def gguf_reader(path):
    """gguf-py's `GGUFReader` of `path`, once per session. The parsing is gguf-py's; only its
    mapping is a plain ndarray instead of an `np.memmap`: the reader slices the mapping once
    per part of every field (~1 M slices for Gemma 3's 262k-token vocabulary) and each slice of
    a memmap pays for the subclass's bookkeeping (`__array_finalize__`): Gemma 3's reader took
    ~28 s of CPU, ~14 s with the plain array (2-core VM, 2026-12-06,
    bench/runs/2026-12-06-ci-time.md)."""
    from gguf import gguf_reader as module

    plain = module.np
    module.np = _NumpyPlainMaps()
    try:
        return module.GGUFReader(str(path))
    finally:
        module.np = plain


def _gguf(path):
    if not path.exists():
        pytest.fail(f"{path}: missing (scripts/fetch-model.sh and scripts/fetch-gemma.sh fetch it)")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf():
    return _gguf(SMOLLM2)


@pytest.fixture(scope="session")
def gemma3_gguf():
    return _gguf(GEMMA3)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2 converted; GDSLLM_TEST_SMOLLM2_DIR names one converted already (a GPU machine
    that has the packed model but not the GGUF: scripts/gpu-python.sh)."""
    import gdsllm

    if os.environ.get("GDSLLM_TEST_SMOLLM2_DIR"):
        return pathlib.Path(os.environ["GDSLLM_TEST_SMOLLM2_DIR"])
    smollm2_gguf = _gguf(SMOLLM2)
    out = tmp_path_factory.mktemp("models") / "smollm2.gds"
    gdsllm.convert(str(smollm2_gguf), str(out))
    return out


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory, gemma3_gguf):
    import gdsllm

    out = tmp_path_factory.mktemp("models") / "gemma3.gds"
    gdsllm.convert(str(gemma3_gguf), str(out))
    return out


def run_gdsrun(*args, check=True):
    """gdsrun's (returncode, stdout, stderr)."""
    p = subprocess.run(
        [str(gdsrun_path()), *map(str, args)], capture_output=True, text=True, timeout=300
    )
    if check and p.returncode != 0:
        raise AssertionError(f"gdsrun {args} failed ({p.returncode}): {p.stderr}")
    return p.returncode, p.stdout, p.stderr


def gdsrun_error(*args):
    """The message gdsrun prints for a failing command, without `gdsrun: error: `."""
    rc, _, err = run_gdsrun(*args, check=False)
    assert rc != 0, f"gdsrun {args} did not fail"
    lines = [l for l in err.splitlines() if l.startswith("gdsrun: error: ")]
    assert lines, err
    return lines[-1][len("gdsrun: error: ") :]
