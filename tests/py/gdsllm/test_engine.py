"""gdsllm.Engine against gdsrun: the same text for greedy decoding, the same plan."""

import json

import pytest

import gdsllm

from conftest import run_gdsrun

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return gdsllm.Engine(str(smollm2_dir), threads=2, seed=7)


def gdsrun_text(model_dir, *args):
    _, out, _ = run_gdsrun("run", model_dir, "-t", "2", "--temp", "0", "--json", *args)
    return json.loads(out)


def test_greedy_chat_turn_equals_gdsrun(engine, smollm2_dir):
    want = gdsrun_text(smollm2_dir, "-p", PROMPT, "-n", "16")
    got = engine.generate(PROMPT, max_tokens=16, temperature=0, details=True)
    assert got["text"] == want["text"] and got["tokens"] == want["tokens"]
    assert got["stop_reason"] == want["stop_reason"]
    # the same again (each call stands alone), and as a string
    assert engine.generate(PROMPT, max_tokens=16, temperature=0) == want["text"]
    # chat messages: the same conversation, given explicitly
    msgs = [{"role": "user", "content": PROMPT}]
    assert engine.generate(msgs, max_tokens=16, temperature=0) == want["text"]


def test_greedy_raw_completion_equals_gdsrun(smollm2_dir):
    want = gdsrun_text(smollm2_dir, "-p", PROMPT, "-n", "12", "--raw")
    e = gdsllm.Engine(str(smollm2_dir), threads=2, raw=True, temperature=0)
    assert e.generate(PROMPT, max_tokens=12) == want["text"]


def test_stream_yields_the_same_text(engine, smollm2_dir):
    want = engine.generate(PROMPT, max_tokens=12, temperature=0)
    s = engine.stream(PROMPT, max_tokens=12, temperature=0)
    pieces = list(s)
    assert len(pieces) > 1 and "".join(pieces) == want
    assert s.result["text"] == want and s.result["stop_reason"] == "max_tokens"
    # a stream dropped early stops its generation; the engine goes on serving
    s = engine.stream(PROMPT, max_tokens=200, temperature=0)
    next(s)
    del s
    assert engine.generate(PROMPT, max_tokens=12, temperature=0) == want


def test_plan_equals_gdsruns(smollm2_dir):
    e = gdsllm.Engine(str(smollm2_dir), threads=2, seed=7, top_k=20)
    _, out, _ = run_gdsrun("run", smollm2_dir, "-t", "2", "--seed", "7", "--top-k", "20", "--plan")
    assert e.plan == json.loads(out)
    # a reply's own settings are recorded in the plan
    e.generate(PROMPT, max_tokens=2, temperature=0)
    assert e.plan["sampler"]["temp"] == 0 and e.plan["limits"]["max_tokens"] == 2


def test_bad_sampling_settings_are_refused(engine):
    with pytest.raises(gdsllm.GdsError):
        engine.generate(PROMPT, top_p=2.0)
    with pytest.raises(gdsllm.GdsError):
        engine.generate(PROMPT, max_tokens=0)
    with pytest.raises(TypeError):
        engine.generate(42)


def test_convert_reports_what_it_wrote(smollm2_gguf, tmp_path):
    s = gdsllm.convert(str(smollm2_gguf), str(tmp_path / "m"))
    assert s["arch"] == "llama" and s["tensors"] == 272 and s["runnable"]
    assert gdsllm.open(str(tmp_path / "m")).keys()
