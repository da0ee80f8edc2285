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
    plan, want = dict(e.plan), json.loads(out)
    if gdsllm.CUDA:
        # this package built with CUDA (scripts/test.sh installs it last), the gdsrun beside
        # it without: each says in its own words why `auto` chose the CPU here
        assert plan.pop("backend_reason").startswith("auto: no usable GPU"), plan
        assert "without the `cuda` feature" in want.pop("backend_reason"), want
    assert plan == want
    # a reply's own settings are recorded in the plan
    e.generate(PROMPT, max_tokens=2, temperature=0)
    assert e.plan["sampler"]["temp"] == 0 and e.plan["limits"]["max_tokens"] == 2


def test_recommended_sampling_equals_gdsruns(smollm2_dir, tmp_path):
    # a generation_config.json in place of the model's (--generation-config FILE): the same
    # plan as gdsrun's, its max_new_tokens the length of a reply that sets none
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.0, "top_k": 9, "max_new_tokens": 3}))
    e = gdsllm.Engine(str(smollm2_dir), threads=2, seed=7, generation_config=gen)
    _, out, _ = run_gdsrun("run", smollm2_dir, "-t", "2", "--seed", "7",
                           "--generation-config", str(gen), "--plan")
    plan, want = dict(e.plan), json.loads(out)
    plan.pop("backend_reason"), want.pop("backend_reason")
    assert plan == want
    assert plan["recommended_sampling"]["applied"] == {"max_tokens": 3, "temp": 0.0, "top_k": 9}
    d = e.generate(PROMPT, details=True)
    assert len(d["tokens"]) <= 3 and (len(d["tokens"]) == 3 or d["stop_reason"] != "max_tokens")
    assert e.generate(PROMPT, max_tokens=5, details=True)["text"].startswith(d["text"])
    off = gdsllm.Engine(str(smollm2_dir), threads=2, generation_config="none")
    assert "recommended_sampling" not in off.plan and off.plan["sampler"]["top_k"] == 40
    with pytest.raises(gdsllm.GdsError, match="not a JSON object"):
        gen.write_text("[]")
        gdsllm.Engine(str(smollm2_dir), generation_config=gen)


def test_a_builtin_chat_template_equals_gdsruns(smollm2_dir):
    # --chat-template NAME: the same plan and the same greedy reply as gdsrun's
    e = gdsllm.Engine(str(smollm2_dir), threads=2, chat_template="zephyr", temperature=0)
    _, out, _ = run_gdsrun("run", smollm2_dir, "-t", "2", "--chat-template", "zephyr", "--plan")
    plan = json.loads(out)
    assert e.plan["chat_template"] == plan["chat_template"] and "zephyr" in plan["chat_template"]
    want = gdsrun_text(smollm2_dir, "-p", PROMPT, "-n", "8", "--chat-template", "zephyr")
    assert e.generate(PROMPT, max_tokens=8) == want["text"]
    with pytest.raises(gdsllm.GdsError, match="not a built-in template"):
        gdsllm.Engine(str(smollm2_dir), chat_template="no-such-format")


def test_bad_sampling_settings_are_refused(engine):
    with pytest.raises(gdsllm.GdsError):
        engine.generate(PROMPT, top_p=2.0)
    with pytest.raises(gdsllm.GdsError):
        engine.generate(PROMPT, max_tokens=0)
    with pytest.raises(TypeError):
        engine.generate(42)


REPEAT = "Repeat after me ten times: red blue, red blue, red blue"
DRY = ["--dry-multiplier", "2", "--dry-allowed-length", "1"]


def test_llama_cpp_samplers_equal_gdsruns(engine, smollm2_dir):
    # `samplers` takes llama-server's names for what gdsrun's flags set: the same replies
    want = gdsrun_text(smollm2_dir, "-p", REPEAT, "-n", "24", *DRY)
    plain = gdsrun_text(smollm2_dir, "-p", REPEAT, "-n", "24")
    assert want["text"] != plain["text"], "DRY changes this greedy reply"
    dry = {"dry_multiplier": 2, "dry_allowed_length": 1}
    assert engine.generate(REPEAT, max_tokens=24, temperature=0, samplers=dry) == want["text"]
    # per call: the next call without it is the plain reply again
    assert engine.generate(REPEAT, max_tokens=24, temperature=0) == plain["text"]
    # Mirostat 2 with a seed
    _, out, _ = run_gdsrun("run", smollm2_dir, "-t", "2", "--json", "-p", REPEAT, "-n", "24",
                           "--mirostat", "2", "--temp", "0.8", "--seed", "5")
    miro = engine.generate(REPEAT, max_tokens=24, temperature=0.8, seed=5,
                           samplers={"mirostat": 2})
    assert miro == json.loads(out)["text"]
    # streamed, the chain's order as letters
    chain = {"samplers": "kt", "typical_p": 0.5}
    pieces = "".join(engine.stream(REPEAT, max_tokens=12, temperature=0, samplers=chain))
    assert pieces == engine.generate(REPEAT, max_tokens=12, temperature=0, samplers=chain)


def test_engine_samplers_are_defaults_and_in_the_plan(smollm2_dir):
    e = gdsllm.Engine(str(smollm2_dir), threads=2, temperature=0, seed=7,
                      samplers={"dry_multiplier": 2, "dry_allowed_length": 1,
                                "samplers": ["penalties", "dry", "top_k", "temperature"]})
    _, out, _ = run_gdsrun("run", smollm2_dir, "-t", "2", "--temp", "0", "--seed", "7", *DRY,
                           "--samplers", "penalties;dry;top_k;temperature", "--plan")
    assert e.plan["sampler"] == json.loads(out)["sampler"]
    assert e.plan["sampler"]["dry_multiplier"] == 2
    want = gdsrun_text(smollm2_dir, "-p", REPEAT, "-n", "24", *DRY)
    assert e.generate(REPEAT, max_tokens=24) == want["text"]


def test_bad_samplers_are_refused(engine):
    with pytest.raises(ValueError, match='unknown setting "tfs_z"'):
        engine.generate(PROMPT, samplers={"tfs_z": 0.5})
    with pytest.raises(ValueError, match="mirostat"):
        engine.generate(PROMPT, samplers={"mirostat": "two"})
    with pytest.raises(ValueError, match="samplers"):
        engine.generate(PROMPT, samplers={"samplers": "kq"})
    with pytest.raises(TypeError):
        engine.generate(PROMPT, samplers=["dry"])
    with pytest.raises(gdsllm.GdsError, match="mirostat 3 must be 0, 1 or 2"):
        engine.generate(PROMPT, samplers={"mirostat": 3})
    with pytest.raises(gdsllm.GdsError, match="xtc_probability"):
        engine.generate(PROMPT, samplers={"xtc_probability": 1.5})
    with pytest.raises(gdsllm.GdsError):
        gdsllm.Engine("/nonexistent", samplers={"xtc_threshold": -1})


def test_convert_reports_what_it_wrote(smollm2_gguf, tmp_path):
    s = gdsllm.convert(str(smollm2_gguf), str(tmp_path / "m"))
    assert s["arch"] == "llama" and s["tensors"] == 272 and s["runnable"]
    assert gdsllm.open(str(tmp_path / "m")).keys()


YES_NO_GBNF = 'root ::= answer\nanswer ::= "yes" | "no"\n'


def test_grammar_holds_the_reply_as_gdsruns(engine, smollm2_dir, tmp_path):
    # GBNF, as gdsrun's --grammar FILE: the same reply, one of the grammar's two
    (tmp_path / "yn.gbnf").write_text(YES_NO_GBNF)
    prompt = "Is Paris in France? Answer yes or no."
    want = gdsrun_text(smollm2_dir, "-p", prompt, "-n", "8", "--grammar", tmp_path / "yn.gbnf")
    got = engine.generate(prompt, max_tokens=8, temperature=0, grammar=YES_NO_GBNF, details=True)
    assert got["text"] in ("yes", "no") and got["stop_reason"] == "grammar"
    assert got["text"] == want["text"] and got["tokens"] == want["tokens"]
    # Lark, sampled: still only what the grammar allows
    lark = 'start: NUM " apples"\nNUM: /[1-9][0-9]?/\n'
    for seed in (1, 2, 3):
        t = engine.generate("How many apples?", max_tokens=12, temperature=1.5, seed=seed, grammar=lark)
        n, rest = t.split(" ", 1)
        assert n.isdigit() and 1 <= int(n) <= 99 and rest == "apples", t
    # a stream follows it too; the next reply without a grammar is free again
    s = engine.stream(prompt, max_tokens=8, temperature=0, grammar=YES_NO_GBNF)
    assert "".join(s) == want["text"] and s.result["stop_reason"] == "grammar"
    free = engine.generate(PROMPT, max_tokens=16, temperature=0, details=True)
    assert free["text"] == gdsrun_text(smollm2_dir, "-p", PROMPT, "-n", "16")["text"]
    assert free["plan"]["grammar"] is None


def test_json_schema_holds_the_reply(engine):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "population": {"type": "integer", "minimum": 0},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    for seed, s in ((1, schema), (2, json.dumps(schema))):
        got = engine.generate(
            "Give me a city as JSON.", max_tokens=48, temperature=1.0, seed=seed, json_schema=s, details=True
        )
        assert got["stop_reason"] == "grammar", got["text"]
        jsonschema.validate(json.loads(got["text"]), schema)


def test_logprobs_equal_gdsruns(engine, smollm2_dir):
    want = gdsrun_text(smollm2_dir, "-p", PROMPT, "-n", "8", "--logprobs", "3")
    got = engine.generate(PROMPT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, details=True)
    assert got["tokens"] == want["tokens"] and len(got["logprobs"]) == len(got["tokens"]) == 8
    for tok, g, w in zip(got["tokens"], got["logprobs"], want["logprobs"]):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]]
        assert [lp for _, lp in g["top"]] == pytest.approx([lp for _, lp in w["top"]], abs=1e-4)
        # greedy: the chosen token is the most likely, ln p <= 0
        assert g["top"][0][0] == tok and g["top"][0][1] == g["logprob"] <= 0
    # logprobs=True alone: no alternatives; not asked for: null, as gdsrun's --json
    lp = engine.generate(PROMPT, max_tokens=2, temperature=0, logprobs=True, details=True)["logprobs"]
    assert [x["top"] for x in lp] == [[], []]
    assert lp[0]["logprob"] == pytest.approx(want["logprobs"][0]["logprob"], abs=1e-4)
    assert engine.generate(PROMPT, max_tokens=2, temperature=0, details=True)["logprobs"] is None


def test_bad_constraints_are_refused(engine):
    with pytest.raises(gdsllm.GdsError):
        engine.generate(PROMPT, grammar="start: (")
    with pytest.raises(gdsllm.GdsError, match="grammar"):
        engine.generate(PROMPT, grammar="root ::= (")
    with pytest.raises(ValueError, match="at most one"):
        engine.generate(PROMPT, grammar=YES_NO_GBNF, regex="a+")
    with pytest.raises(ValueError, match="json_schema"):
        engine.generate(PROMPT, json_schema="{not json")
    with pytest.raises(gdsllm.GdsError, match="logprobs"):
        engine.generate(PROMPT, top_logprobs=21)
    # the engine still answers, unconstrained
    assert engine.generate(PROMPT, max_tokens=4, temperature=0)
