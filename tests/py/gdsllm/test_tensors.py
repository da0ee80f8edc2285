"""Tensors of a converted model against gguf-py's reading of the GGUF they came from, and
the zero-copy contract: views of the mapping, read-only, alive as long as anything uses
them."""

import gc
import shutil

import numpy as np
import pytest

import gdsllm
from gguf.quants import dequantize as gguf_dequantize

from conftest import gdsrun_error, gguf_reader


def check_every_tensor(model_dir, gguf_path):
    m = gdsllm.open(str(model_dir))
    reader = gguf_reader(gguf_path)
    assert len(m) == len(reader.tensors)
    for rt in reader.tensors:
        t = m[rt.name]
        # the manifest's shape is row-major: GGUF's (innermost first) reversed
        assert t.shape == [int(d) for d in reversed(rt.shape)], rt.name
        assert t.dtype == rt.tensor_type.name.lower(), rt.name
        assert t.nbytes == rt.n_bytes, rt.name
        start, end = t.byte_range
        assert end - start == rt.n_bytes
        a = t.numpy()
        # raw bytes, tolerance 0: gguf-py's array has the same layout (block types as rows
        # of block bytes)
        assert a.shape == rt.data.shape, rt.name
        assert np.array_equal(a.view(np.uint8), np.ascontiguousarray(rt.data).view(np.uint8)), rt.name
        # dequantized by gds-kernels, bit for bit gguf-py's
        want = gguf_dequantize(rt.data, rt.tensor_type).astype(np.float32)
        got = t.dequantize()
        assert got.dtype == np.float32 and list(got.shape) == t.shape, rt.name
        assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32)), rt.name
    return m


def test_every_smollm2_tensor_equals_gguf_py(smollm2_dir, smollm2_gguf):
    m = check_every_tensor(smollm2_dir, smollm2_gguf)
    assert m.architecture == "llama"
    assert set(m.quantization) == {"f32", "q4_1", "q8_0"}
    assert m.hyperparameters["n_layers"] == 30
    assert m.metadata["general.architecture"] == "llama"
    assert m.verified


def test_every_gemma3_tensor_equals_gguf_py(gemma3_dir, gemma3_gguf):
    # ~20 s on the 2-core VM, most of it gguf-py parsing the 262k-token vocabulary
    m = check_every_tensor(gemma3_dir, gemma3_gguf)
    assert m.architecture == "gemma3"
    assert any(d.endswith("_k") for d in m.quantization)


def test_a_mixture_of_experts_stacked_tensors(tmp_path):
    """Qwen 3 MoE's experts are 3-D tensors ([experts, rows, cols]): every tensor of the tiny
    fixture as gguf-py reads it, then the same model quantized to Q8_0 by gdsconv, whose
    expert blocks dequantize as gguf-py dequantizes the same bytes."""
    import pathlib

    gguf_path = pathlib.Path(__file__).resolve().parents[3] / "fixtures" / "tiny-qwen3moe.gguf"
    out = tmp_path / "moe.gds"
    gdsllm.convert(str(gguf_path), str(out))
    m = check_every_tensor(out, gguf_path)
    assert m.architecture == "qwen3moe"
    assert m["blk.0.ffn_gate_exps.weight"].shape == [4, 32, 32]
    q8 = tmp_path / "moe-q8.gds"
    gdsllm.convert(str(gguf_path), str(q8), quant="q8_0")
    m = gdsllm.open(str(q8))
    from gguf import GGMLQuantizationType

    t = m["blk.1.ffn_down_exps.weight"]
    assert (t.dtype, t.shape) == ("q8_0", [4, 32, 32])
    raw = t.numpy()
    assert raw.shape == (4, 32, 34)  # rows of block bytes: one 34-byte Q8_0 block a row
    want = gguf_dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32)
    got = t.dequantize()
    assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))
    # the router stays F32 under --quant (llama-quantize leaves it)
    assert m["blk.1.ffn_gate_inp.weight"].dtype == "f32"


@pytest.mark.parametrize("kind", ["iq4_xs", "iq4_nl"])
def test_iq4_tensors_equal_gguf_py(kind, tmp_path):
    """llama.cpp's IQ4_XS and IQ4_NL (fixtures/make_iq4_fixtures.py: llama-quantize's files):
    every tensor's bytes and gguf-py's dequantization through the Python API."""
    import pathlib

    gguf_path = pathlib.Path(__file__).resolve().parents[3] / "fixtures" / f"tiny-llama-{kind}.gguf"
    out = tmp_path / f"{kind}.gds"
    gdsllm.convert(str(gguf_path), str(out))
    m = check_every_tensor(out, gguf_path)
    assert kind in m.quantization


def test_grid_iquant_tensors_equal_gguf_py(tmp_path):
    """llama.cpp's grid i-quants, one per kind of matrix (fixtures/make_iq_grid_fixtures.py:
    IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S by llama-quantize): every tensor's
    bytes and gguf-py's dequantization through the Python API."""
    import pathlib

    gguf_path = pathlib.Path(__file__).resolve().parents[3] / "fixtures" / "tiny-llama-iq-grid.gguf"
    out = tmp_path / "iq-grid.gds"
    gdsllm.convert(str(gguf_path), str(out))
    m = check_every_tensor(out, gguf_path)
    kinds = {m[n].dtype for n in m.keys()}
    assert {"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s"} <= kinds, kinds


def test_layers_and_tensor_records(smollm2_dir):
    m = gdsllm.open(str(smollm2_dir))
    layers = m.layers
    names = [n for l in layers for n in l["tensors"]]
    assert sorted(names) == sorted(m.keys())
    for i, l in enumerate(layers):
        for n in l["tensors"]:
            t = m[n]
            assert t.layer == i and t.layer_name == l["name"]
            assert t.file.endswith(l["file"])
            start, end = t.byte_range
            assert 0 <= start < end <= l["size"]
    assert [t.name for t in m.load(layers[1]["name"])] == layers[1]["tensors"]
    with pytest.raises(KeyError):
        m["no.such.tensor"]


def test_numpy_view_shares_the_mapping_and_is_read_only(smollm2_dir):
    m = gdsllm.open(str(smollm2_dir))
    for name in ["blk.0.attn_norm.weight", "blk.0.attn_q.weight", "token_embd.weight"]:
        t = m[name]
        a = t.numpy()
        assert a.ctypes.data == t.data_ptr
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
        with pytest.raises(ValueError):
            a.flags.writeable = True
        b = np.from_dlpack(t)
        assert b.ctypes.data == t.data_ptr and not b.flags.writeable
    # two tensors of one layer: two views of the same mapping, at their offsets
    q, k = m["blk.0.attn_q.weight"], m["blk.0.attn_k.weight"]
    assert q.data_ptr - q.byte_range[0] == k.data_ptr - k.byte_range[0]


def test_a_tensor_outlives_the_model_and_its_variable(smollm2_dir, smollm2_gguf):
    def one_tensor():
        m = gdsllm.open(str(smollm2_dir))
        return m["blk.29.ffn_down.weight"]

    t = one_tensor()
    gc.collect()
    a = t.numpy()
    cap = t.__dlpack__(max_version=(1, 0))
    del t
    gc.collect()
    want = next(r for r in gguf_reader(smollm2_gguf).tensors if r.name == "blk.29.ffn_down.weight")
    assert np.array_equal(a, want.data)
    # an unconsumed capsule frees its tensor when it goes (no leak, no crash)
    del cap
    gc.collect()


def test_dequantize_converts_on_request(smollm2_dir):
    t = gdsllm.open(str(smollm2_dir))["blk.3.attn_v.weight"]
    a = t.dequantize()
    assert a.flags.writeable and a.dtype == np.float32
    h = t.dequantize(np.float16)
    assert h.dtype == np.float16 and np.array_equal(h, a.astype(np.float16))


def test_bad_path_raises_gdsruns_error(tmp_path):
    missing = tmp_path / "no-such-model"
    want = gdsrun_error("run", missing, "-p", "hi")
    with pytest.raises(gdsllm.GdsError) as e:
        gdsllm.open(str(missing))
    assert str(e.value) == want
    not_a_model = tmp_path / "file.txt"
    not_a_model.write_text("x")
    want = gdsrun_error("run", not_a_model, "-p", "hi")
    with pytest.raises(gdsllm.GdsError) as e:
        gdsllm.open(str(not_a_model))
    assert str(e.value) == want


def test_tampered_layer_raises_gdsruns_error(smollm2_dir, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(smollm2_dir, bad)
    layer = bad / gdsllm.open(str(smollm2_dir)).layers[3]["file"]
    data = bytearray(layer.read_bytes())
    data[100] ^= 1
    layer.write_bytes(bytes(data))
    want = gdsrun_error("run", bad, "-p", "hi", "-n", "1")
    assert "content hash does not match" in want
    with pytest.raises(gdsllm.GdsError) as e:
        gdsllm.open(str(bad))
    assert str(e.value) == want
    with pytest.raises(gdsllm.GdsError) as e:
        gdsllm.Engine(str(bad))
    assert str(e.value) == want
    # verify=False trusts the files, and says so
    m = gdsllm.open(str(bad), verify=False)
    assert not m.verified


def test_gguf_path_resolves_as_gdsrun(smollm2_gguf):
    # a .gguf is converted into the store ($GDSLLM_HOME) on first use, as gdsrun does
    m = gdsllm.open(str(smollm2_gguf))
    assert m.architecture == "llama" and len(m) == 272
    assert m.path == gdsllm.resolve(str(smollm2_gguf))


def test_other_programs_caches_resolve_as_gdsrun(smollm2_gguf, tmp_path, monkeypatch):
    # the same GGUF as an Ollama blob (its manifest naming it) and in the Hugging Face cache
    # (a snapshot linking into blobs/): converted into the store as gdsrun does, the same model
    import hashlib
    import json

    data = smollm2_gguf.read_bytes()
    hexd = hashlib.sha256(data).hexdigest()
    ollama = tmp_path / "ollama"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{hexd}").write_bytes(data)
    cfg = b'{"model_format":"gguf"}'
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + hashlib.sha256(cfg).hexdigest(), "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.ollama.image.model",
                    "digest": f"sha256:{hexd}", "size": len(data)}],
    }
    m = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    m.parent.mkdir(parents=True)
    m.write_text(json.dumps(manifest))
    repo = tmp_path / "hf" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
    (repo / "snapshots" / "rev1").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / hexd).symlink_to(smollm2_gguf)
    (repo / "snapshots" / "rev1" / "smollm2-135m-instruct-q4_1.gguf").symlink_to(repo / "blobs" / hexd)
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    whole = gdsllm.open(str(smollm2_gguf))
    for spec in ["ollama:smollm2:135m", "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"]:
        got = gdsllm.open(spec)
        assert got.architecture == "llama" and len(got) == len(whole), spec
        assert got.path == gdsllm.resolve(spec)
    with pytest.raises(gdsllm.GdsError, match="Ollama has no such model"):
        gdsllm.open("ollama:absent")


def test_load_arguments_are_checked_before_anything_is_read(smollm2_dir):
    m = gdsllm.open(str(smollm2_dir))
    for bad in ["gpu", "cuda:x", "cuda:-1", "CUDA:0"]:
        with pytest.raises(ValueError, match="expected \"cpu\", \"cuda\" or \"cuda:N\""):
            m.load(0, device=bad)
    with pytest.raises(ValueError, match="expected \"mmap\", \"direct\" or \"gds\""):
        m.load(0, device="cuda:0", io="nvme")
    # on the CPU the tensors are views of the mappings: no other io
    with pytest.raises(ValueError, match="io=\"mmap\""):
        m.load(0, io="gds")
    with pytest.raises(KeyError, match="no layer named"):
        m.load("blk.999", device="cuda:0")
    ts = m.load("blk.0")
    assert ts and all(t.device == "cpu" and t.load_path is None for t in ts)
    assert all(t.__dlpack_device__() == (1, 0) for t in ts)


@pytest.mark.skipif(gdsllm.CUDA, reason="this build has CUDA: tests/py/gdsllm/test_cuda.py")
def test_no_cuda_in_this_build(smollm2_dir):
    m = gdsllm.open(str(smollm2_dir))
    assert gdsllm.CUDA is False
    for io in ["mmap", "direct", "gds"]:
        # the refusal names the layer file, the io asked for and how to build with CUDA
        with pytest.raises(gdsllm.GdsError, match=f"blk.0.*without CUDA support.*io=\"{io}\".*--features cuda"):
            m.load("blk.0", device="cuda:0", io=io)
