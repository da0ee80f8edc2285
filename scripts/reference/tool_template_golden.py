#!/usr/bin/env python3
"""Golden rendering of a tool-calling conversation by Hugging Face transformers.

Usage: tool_template_golden.py TOKENIZER_DIR TEMPLATE OUT_JSON

Renders, with `apply_chat_template(..., tools=..., tokenize=False, add_generation_prompt=True)`
and the template file TEMPLATE (fixtures/templates/qwen2.5-instruct.jinja: Qwen2.5-Instruct's
template as published), a conversation with a system prompt, two function definitions, an
assistant turn with two tool calls, two tool results, and a follow-up question. Writes
{"messages", "tools", "rendered"}; crates/gds-runtime/tests/it/tokenizer.rs renders the same with
gdsrun's template engine and compares byte for byte.
"""
import json
import sys

from transformers import AutoTokenizer

tok_dir, template_path, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(tok_dir)
src = open(template_path).read()
tools = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
messages = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Zürich"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]
rendered = tok.apply_chat_template(messages, tools=tools, chat_template=src, tokenize=False,
                                   add_generation_prompt=True)
with open(out, "w") as f:
    json.dump({"messages": messages, "tools": tools, "rendered": rendered}, f, ensure_ascii=False, indent=1)
    f.write("\n")
