#!/usr/bin/env python3
"""Golden renderings of conversations by Hugging Face transformers' chat-template engine.

Usage: template_golden.py TOKENIZER_DIR OUT_JSON TEMPLATE...

Renders each conversation below with each TEMPLATE through
`tokenizer.apply_chat_template(messages, tools=..., chat_template=SRC, tokenize=False,
add_generation_prompt=..., **variables)` (transformers' Jinja2 sandbox: trim_blocks,
lstrip_blocks, loop controls, its tojson, raise_exception, strftime_now), the tokenizer's
bos/eos tokens in the context. Conversations: a system prompt and a question; several turns;
tools offered; a tool call (string and number arguments) and its result; an earlier reply's
reasoning_content; enable_thinking false. A template that raises is recorded as an error.
Today's date (strftime_now's `%Y-%m-%d`, `%d %b %Y` and `%B %d, %Y`) is written as {TODAY} /
{TODAY_DMY} / {TODAY_BDY}, so the golden holds on other days.

Writes {"bos_token", "eos_token", "cases": [{"template", "conversation", "messages", "tools",
"add_generation_prompt", "variables", "rendered" | "error"}]};
crates/gds-format/tests/it/template_golden.rs renders the same with gdsrun's engine and compares
byte for byte. Made for fixtures/templates/ by:

  scripts/reference/template_golden.py .cache/smollm2-hf-f16 \
      fixtures/reference/template-golden.json fixtures/templates/*.jinja
"""
import datetime
import json
import os
import sys

from transformers import AutoTokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name"},
                                      "days": {"type": "integer", "minimum": 1}},
                       "required": ["city"]}}},
]
CALL = {"id": "abc123XYZ", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}}

CONVERSATIONS = {
    "system_and_question": (
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is the capital of France?"}], None, True, {}),
    "turns": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Bye"}], None, True, {}),
    "turns_closed": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        None, False, {}),
    "tools_offered": (
        [{"role": "user", "content": "Weather in Zürich?"}], TOOLS, True, {}),
    "tool_round_trip": (
        [{"role": "user", "content": "Weather in Zürich?"},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "abc123XYZ", "content": "{\"temp\": 21}"}],
        TOOLS, True, {}),
    "reasoning_history": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
         {"role": "user", "content": "And 3+3?"}], None, True, {}),
    "thinking_off": (
        [{"role": "user", "content": "Hi"}], None, True, {"enable_thinking": False}),
}


def main():
    tok_dir, out, *templates = sys.argv[1:]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    today = datetime.date.today()
    dates = {today.strftime("%Y-%m-%d"): "{TODAY}", today.strftime("%d %b %Y"): "{TODAY_DMY}",
             today.strftime("%B %d, %Y"): "{TODAY_BDY}"}
    cases = []
    for path in templates:
        src = open(path).read()
        for name, (messages, tools, gen, variables) in CONVERSATIONS.items():
            case = {"template": os.path.basename(path), "conversation": name,
                    "messages": messages, "tools": tools, "add_generation_prompt": gen,
                    "variables": variables}
            try:
                text = tok.apply_chat_template(messages, tools=tools, chat_template=src,
                                               tokenize=False, add_generation_prompt=gen,
                                               **variables)
                for d, mark in dates.items():
                    text = text.replace(d, mark)
                case["rendered"] = text
            except Exception as e:  # the template raised: gdsrun must refuse too
                case["error"] = f"{type(e).__name__}: {e}"
            cases.append(case)
    with open(out, "w") as f:
        json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token, "cases": cases},
                  f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
