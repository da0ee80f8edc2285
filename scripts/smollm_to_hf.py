#!/usr/bin/env python3
"""Turns a llama-family GGUF (by default the test model SmolLM2-135M-Instruct.Q4_1.gguf) back
into a Hugging Face model directory, dequantizing every tensor with gguf-py.

    python3 scripts/smollm_to_hf.py OUT_DIR [--gguf PATH] [--dtype f16|bf16|f32] [--force]

OUT_DIR receives:

  config.json             LlamaForCausalLM with the GGUF's hyperparameters; tied embeddings
                          when the GGUF has no output.weight (SmolLM2: tied, no lm_head)
  model.safetensors       HF tensor names; Q/K rows un-permuted from ggml's RoPE layout back
                          to HF's "rotate half" layout (inverse of convert_hf_to_gguf.py's
                          permute); 1-D tensors (norms) always F32, the rest in --dtype
                          (default f16; f32 holds the dequantized values exactly)
  tokenizer.json          byte-level BPE rebuilt from tokenizer.ggml.tokens/merges with the
                          `tokenizers` library; the pre-tokenizer follows tokenizer.ggml.pre
                          ("smollm": single digits, then the GPT-2 split, as llama.cpp does)
  tokenizer_config.json   chat template, special tokens, add_bos_token from the GGUF
  generation_config.json  bos/eos ids
  .gds-source.json        what it was made from (used to skip work on a re-run)

Why not transformers' GGUF tokenizer conversion: it ignores tokenizer.ggml.pre and would drop
the digit splitting that llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json)
applies, so token ids would differ from llama.cpp's on any text with multi-digit numbers.

Idempotent: a re-run with the same GGUF (path, size, mtime) and dtype does nothing unless
--force. Atomic: everything is written into a sibling temporary directory that is renamed
into place at the end, so OUT_DIR is either the old complete result or the new one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION = 1  # bump when the output changes, so stamps from older runs are ignored


def field(r: gguf.GGUFReader, key: str, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    return f.contents()


def f32_clean(x: float) -> float:
    """A float32 value as the shortest decimal that round-trips (9.99999974738e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's permute:
    permute(w) = w.reshape(n_head, 2, r // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_names(n_layers: int) -> dict[str, str]:
    """Canonical -> HF names, from formats/llama.json."""
    spec = json.loads((ROOT / "formats/llama.json").read_text())
    out = {}
    for hf, canon in spec["tensors"].items():
        if "{N}" in canon:
            for n in range(n_layers):
                out[canon.replace("{N}", str(n))] = hf.replace("{N}", str(n))
        else:
            out[canon] = hf
    return out


def to_bytes(w: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return w.astype("<f4").tobytes()
    if dtype == "F16":
        return w.astype("<f2").tobytes()
    if dtype == "BF16":
        return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), Q.BF16).tobytes()
    raise ValueError(dtype)


def write_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], object]]) -> None:
    """tensors: (name, dtype, shape, thunk returning bytes); written one at a time."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    width = {"F32": 4, "F16": 2, "BF16": 2}
    for name, dtype, shape, _ in tensors:
        n = int(np.prod(shape)) * width[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for name, dtype, shape, thunk in tensors:
            data = thunk()
            assert len(data) == int(np.prod(shape)) * width[dtype], name
            f.write(data)


def build_tokenizer(r: gguf.GGUFReader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = field(r, "tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    tokens = list(field(r, "tokenizer.ggml.tokens"))
    types = list(field(r, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        sys.exit("tokenizer.ggml.tokens has duplicates")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre = field(r, "tokenizer.ggml.pre", "default")
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt-2", "gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        sys.exit(f"tokenizer.ggml.pre {pre!r} is not supported by this script")
    tok.decoder = decoders.ByteLevel()
    # special tokens: CONTROL (3) and USER_DEFINED (4), matched before BPE as llama.cpp does
    specials = [
        AddedToken(t, special=(ty == 3), normalized=False, lstrip=False, rstrip=False, single_word=False)
        for t, ty in zip(tokens, types)
        if ty in (3, 4)
    ]
    tok.add_special_tokens([a for a in specials if a.special])
    tok.add_tokens([a for a in specials if not a.special])
    bos = field(r, "tokenizer.ggml.bos_token_id")
    eos = field(r, "tokenizer.ggml.eos_token_id")
    add_bos = bool(field(r, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(field(r, "tokenizer.ggml.add_eos_token", False))
    procs = [processors.ByteLevel(trim_offsets=False)]
    if add_bos or add_eos:
        b = f"{tokens[bos]}:0 " if add_bos else ""
        e = f" {tokens[eos]}:0" if add_eos else ""
        special = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on]
        procs.append(processors.TemplateProcessing(single=f"{b}$A:0{e}", pair=f"{b}$A:0{e} {b}$B:1{e}", special_tokens=special))
    tok.post_processor = procs[0] if len(procs) == 1 else processors.Sequence(procs)
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    return tok, tokens, types


def convert(gguf_path: Path, out: Path, dtype: str) -> None:
    r = gguf.GGUFReader(str(gguf_path))
    arch = field(r, "general.architecture")
    if arch not in ("llama", "smollm", "mistral"):
        sys.exit(f"{gguf_path}: general.architecture {arch!r} is not llama-family")
    a = lambda k, d=None: field(r, f"{arch}.{k}", d)  # noqa: E731
    n_layers = int(a("block_count"))
    n_embd = int(a("embedding_length"))
    n_head = int(a("attention.head_count"))
    n_kv = int(a("attention.head_count_kv", n_head))
    head_dim = int(a("attention.key_length", n_embd // n_head))
    tensors = {t.name: t for t in r.tensors}
    tied = "output.weight" not in tensors
    vocab_size = int(a("vocab_size", len(field(r, "tokenizer.ggml.tokens"))))

    tok, tokens, types = build_tokenizer(r)
    bos = int(field(r, "tokenizer.ggml.bos_token_id"))
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    pad = field(r, "tokenizer.ggml.padding_token_id")
    unk = field(r, "tokenizer.ggml.unknown_token_id")
    st_dtype = {"f16": "F16", "bf16": "BF16", "f32": "F32"}[dtype]

    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": n_embd,
        "initializer_range": 0.02,
        "intermediate_size": int(a("feed_forward_length")),
        "max_position_embeddings": int(a("context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": n_head,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv,
        "pad_token_id": None if pad is None else int(pad),
        "pretraining_tp": 1,
        "rms_norm_eps": f32_clean(a("attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": f32_clean(a("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "torch_dtype": {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[dtype],
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    scaling = a("rope.scaling.type")
    if scaling not in (None, "none"):
        sys.exit(f"{gguf_path}: rope scaling {scaling!r} is not handled by this script")

    names = hf_names(n_layers)
    plan = []
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            continue
        if name not in names:
            sys.exit(f"{gguf_path}: tensor {name} has no Hugging Face name")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out_dtype = "F32" if len(shape) == 1 else st_dtype

        def thunk(t=t, shape=shape, name=name, out_dtype=out_dtype):
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
                w = unpermute(w, n_head)
            elif name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
                w = unpermute(w, n_kv)
            return to_bytes(w, out_dtype)

        plan.append((names[name], out_dtype, shape, thunk))
    plan.sort(key=lambda p: p[0])

    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": ty == 3}
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (3, 4)
    }
    tcfg = {
        "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field(r, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": tokens[bos],
        "clean_up_tokenization_spaces": False,
        "eos_token": tokens[eos],
        "model_max_length": config["max_position_embeddings"],
        "pad_token": None if pad is None else tokens[int(pad)],
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": None if unk is None else tokens[int(unk)],
        "vocab_size": len(tokens),
    }
    template = field(r, "tokenizer.chat_template")
    if template is not None:
        tcfg["chat_template"] = template
    gen = {"bos_token_id": bos, "eos_token_id": eos}
    if pad is not None:
        gen["pad_token_id"] = int(pad)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
        tok.save(str(tmp / "tokenizer.json"))
        write_safetensors(tmp / "model.safetensors", plan)
        (tmp / ".gds-source.json").write_text(json.dumps(stamp(gguf_path, dtype), indent=2) + "\n")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def stamp(gguf_path: Path, dtype: str) -> dict:
    st = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype, "version": VERSION}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help=f"input GGUF (default {DEFAULT_GGUF})")
    ap.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="f16", help="dtype of the 2-D tensors (default f16)")
    ap.add_argument("--force", action="store_true", help="rewrite even if OUT_DIR is up to date")
    args = ap.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"{args.gguf}: no such file (scripts/fetch-model.sh downloads the default one)")
    out = args.out_dir.resolve()
    stamp_file = out / ".gds-source.json"
    if not args.force and stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp(args.gguf, args.dtype):
                print(out)
                return
        except (OSError, ValueError):
            pass
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(args.gguf, out, args.dtype)
    print(out)


if __name__ == "__main__":
    main()
