#!/usr/bin/env python3
"""Structured outputs through `gdsrun serve` with the official `openai` client.

Usage: serve_structured_check.py BASE_URL

- `chat.completions.parse` with a pydantic model (the client sends a strict JSON schema and
  parses the reply into the model; a reply that does not validate raises);
- 24 samples at temperature 1 with different seeds, 8 at a time (sharing batches), with a
  schema of nested objects, enums, arrays and numbers: each reply is checked with the
  `jsonschema` package (an independent validator);
- the same schema streamed, the deltas reassembled by the client;
- `json_object`; the `regex` and `grammar` (Lark) extensions on completions;
- refusals: a schema that does not compile, two grammars at once, an unknown
  response_format type: each a 400 naming the field.

Prints one JSON object; crates/gds-serve/tests/it/openai.rs asserts on it.
"""
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

try:
    import openai
    import pydantic
    import jsonschema
except ImportError as e:
    sys.exit(f"python package `{e.name}` is missing: pip install openai jsonschema (scripts/test.sh does)")

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
model = client.models.list().data[0].id
out = {}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=20)


r = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Describe Alice, 30, who lives in Paris, as JSON."}],
    response_format=Person,
    temperature=0,
    max_tokens=100,
)
parsed = r.choices[0].message.parsed
out["parse"] = {"parsed": parsed.model_dump(), "finish_reason": r.choices[0].finish_reason,
                "content": r.choices[0].message.content}

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "score": {"type": "number"},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "director": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "alive": {"type": "boolean"}},
            "required": ["name", "alive"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "rating", "score", "genre", "tags", "director"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}


def sample(seed):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Review a movie you like, as JSON."}],
        response_format=FORMAT, temperature=1.0, seed=seed, max_tokens=200,
    )
    c = r.choices[0]
    res = {"seed": seed, "finish_reason": c.finish_reason, "content": c.message.content}
    try:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        res["valid"] = True
    except Exception as e:  # not JSON, or not valid against the schema
        res["valid"] = False
        res["error"] = str(e)[:300]
    return res


with ThreadPoolExecutor(8) as pool:
    out["samples"] = list(pool.map(sample, range(24)))

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Review a movie, as JSON."}],
    response_format=FORMAT, temperature=0.7, seed=7, max_tokens=200, stream=True,
)
text, finish = "", None
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
try:
    jsonschema.validate(json.loads(text), SCHEMA)
    valid = True
except Exception:
    valid = False
out["stream"] = {"content": text, "finish_reason": finish, "valid": valid}

r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Give me any JSON object."}],
    response_format={"type": "json_object"}, temperature=0.8, seed=3, max_tokens=200,
)
c = r.choices[0]
try:
    is_object = isinstance(json.loads(c.message.content), dict)
except ValueError:
    is_object = False
out["json_object"] = {"finish_reason": c.finish_reason, "is_object": is_object, "content": c.message.content}

RX = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3} years old\."
r = client.completions.create(model=model, prompt="Tell me about Bob:", max_tokens=40,
                              temperature=1.0, seed=5, extra_body={"regex": RX})
out["regex"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                "matches": re.fullmatch(RX, r.choices[0].text) is not None}
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
r = client.completions.create(model=model, prompt="Is water wet?", max_tokens=20,
                              temperature=1.0, seed=9, extra_body={"grammar": LARK})
out["lark"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason}
# llama-server's GBNF in the same field (as llama.cpp clients send it)
GBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"  # one of three'
r = client.completions.create(model=model, prompt="Is water wet?", max_tokens=20,
                              temperature=1.0, seed=9, extra_body={"grammar": GBNF})
out["gbnf"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason}
# llama-server's json_object with a schema beside the type
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is 6 times 7?"}],
    response_format={"type": "json_object", "schema": {"const": "42"}}, max_tokens=10,
)
out["json_object_schema"] = {"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}

refusals = {}
for name, kw in {
    "bad_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
    "bad_regex": {"extra_body": {"regex": "(unclosed"}},
    "bad_gbnf": {"extra_body": {"grammar": "root ::= \"a\" ( \"b\""}},
    # translated, then refused by the grammar engine: named GBNF, not Lark
    "gbnf_no_text": {"extra_body": {"grammar": "root ::= x\nx ::= x \"a\"\n"}},
    "bad_object_schema": {"response_format": {"type": "json_object", "schema": 123}},
    "two_grammars": {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}},
    "unknown_type": {"response_format": {"type": "xml"}},
    # compiles, then exceeds the grammar engine's limits at the first mask: refused up front
    "regex_bomb": {"extra_body": {"regex": "(x{1000}){1000}"}},
}.items():
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, **kw)
        refusals[name] = {"status": 200}
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        refusals[name] = {"status": e.status_code, "message": err.get("message"), "param": err.get("param")}
out["refusals"] = refusals
print(json.dumps(out))
