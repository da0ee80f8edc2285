"""gdsllm.Engine's tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) against
`gdsrun serve`'s chat API on the same model and template: SmolLM2's weights with
Qwen2.5-Instruct's chat template (Hermes `<tool_call>` syntax), greedy, so the calls must be
the same calls."""

import json
import subprocess
import urllib.request

import pytest

import gdsllm

from conftest import ROOT, gdsrun_path

TEMPLATE = ROOT / "fixtures" / "templates" / "qwen2.5-instruct.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return gdsllm.Engine(
        str(smollm2_dir), threads=2, ctx=1024, chat_template_file=str(TEMPLATE)
    )


@pytest.fixture(scope="module")
def server(smollm2_dir):
    p = subprocess.Popen(
        [str(gdsrun_path()), "serve", str(smollm2_dir), "--port", "0", "--threads", "2",
         "--ctx", "1024", "--chat-template-file", str(TEMPLATE)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = p.stdout.readline()
        assert "http://" in line, line
        yield line.strip().rsplit("http://", 1)[1]
    finally:
        p.terminate()
        p.wait(timeout=30)


def served(addr, body):
    req = urllib.request.Request(
        f"http://{addr}/v1/chat/completions",
        data=json.dumps({"model": "m", "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["message"]


def calls(message):
    """(name, arguments as a dict) of each call: the ids are fresh per reply."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


def test_a_required_call_is_the_servers_call_with_valid_arguments(engine, server):
    got = engine.generate(ASK, tools=[WEATHER], tool_choice="required", max_tokens=64,
                          temperature=0)
    assert got["role"] == "assistant" and got["tool_calls"], got
    for c in got["tool_calls"]:
        assert c["type"] == "function" and c["id"].startswith("call_"), c
    for name, args in calls(got):
        assert name == "get_weather"
        assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    want = served(server, {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                           "max_tokens": 64})
    assert calls(got) == calls(want) and got["content"] == want.get("content")
    # details: the same message beside the raw text, which has the call in the template's syntax
    d = engine.generate(ASK, tools=[WEATHER], tool_choice="required", max_tokens=64,
                        temperature=0, details=True)
    assert "<tool_call>" in d["text"] and calls(d["message"]) == calls(got)


def test_a_named_function_and_the_round_trip_through_a_tool_result(engine, server):
    named = {"type": "function", "function": {"name": "get_time"}}
    got = engine.generate(ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=64,
                          temperature=0)
    assert [n for n, _ in calls(got)] == ["get_time"] * len(calls(got)) and calls(got), got
    want = served(server, {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": named,
                           "max_tokens": 64})
    assert calls(got) == calls(want)
    # the call and its result go back in; the model answers (in text or another call) as the
    # server does for the same conversation
    call = got["tool_calls"][0]
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "12:00"},
    ]
    again = engine.generate(convo, tools=[WEATHER, TIME], max_tokens=24, temperature=0)
    back = served(server, {"messages": convo, "tools": [WEATHER, TIME], "max_tokens": 24})
    assert again.get("content") == back.get("content") and calls(again) == calls(back)
    # a stream gives the raw text and the parsed calls at the end
    s = engine.stream(ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=64,
                      temperature=0)
    text = "".join(s)
    assert "<tool_call>" in text and calls(s.result["message"]) == calls(got)


def test_tools_are_refused_where_they_cannot_work(engine, smollm2_dir):
    # SmolLM2's own template takes no tools
    plain = gdsllm.Engine(str(smollm2_dir), threads=2)
    with pytest.raises(ValueError, match="tools"):
        plain.generate(ASK, tools=[WEATHER])
    with pytest.raises(ValueError, match="tool_choice"):
        engine.generate(ASK, tools=[WEATHER], tool_choice="required", regex="a+")
    with pytest.raises(ValueError, match="tool_choice"):
        engine.generate(ASK, tools=[WEATHER], tool_choice="sometimes")
    with pytest.raises(ValueError, match="tools"):
        engine.generate(ASK, tools={"not": "a list"})
    with pytest.raises(ValueError, match="role"):
        engine.generate([{"role": "robot", "content": "hi"}])
    raw = gdsllm.Engine(str(smollm2_dir), threads=2, raw=True, chat_template_file=str(TEMPLATE))
    with pytest.raises(gdsllm.GdsError, match="raw"):
        raw.generate("Weather?", tools=[WEATHER], max_tokens=4)
    # without tools the reply is still the plain text
    assert isinstance(engine.generate(ASK, max_tokens=4, temperature=0), str)
