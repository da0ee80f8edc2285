#!/usr/bin/env python3
"""Makes the fuzz seed corpora from the real models and the fixtures.

    scripts/fuzz-seeds.py              # fuzz/corpus/<target>/ (git-ignored): every seed
    scripts/fuzz-seeds.py --curated    # fuzz/seeds/<target>/ (committed): the small ones
    scripts/fuzz-seeds.py --curated --only grammar   # one target's seeds (grammar needs no model)

Sources: fixtures/ (tiny GGUFs, fixtures/bad/*.gguf, the tiny-llama-hf safetensors
directory), the real models in .cache/models (SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M,
fetched by scripts/fetch-model.sh and scripts/fetch-gemma.sh; skipped when absent) and
their `gdsconv convert` outputs (manifest.gdsm, tokenizer_config.json with the real chat
templates). Big inputs are cut down to their structure: a real GGUF keeps its whole
metadata with the vocabulary arrays shortened to their first tokens (and the merges among
them), with either every tensor record and no data ("header") or one block's tensors
shrunk to a few rows ("mini", which reads successfully); safetensors seeds keep the
fixture's tensor names, dtypes and config keys with every dimension shrunk. Input formats
are documented in crates/gds-fuzz/src/lib.rs. Needs only Python 3; builds gdsconv with
cargo when it is not built yet.
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
MODELS = ROOT / ".cache" / "models"
SEP = b"\n%%%%\n"  # gds_fuzz::FILE_SEP

# ---------------------------------------------------------------------------------------
# GGUF (v2/v3, little-endian): just enough to read a header and write one back

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
         10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2)}


class Reader:
    def __init__(self, b):
        self.b, self.p = b, 0

    def take(self, n):
        s = self.b[self.p:self.p + n]
        if len(s) != n:
            raise ValueError("truncated")
        self.p += n
        return s

    def u(self, fmt):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def str(self):
        return self.take(self.u("<Q")).decode("utf-8")

    def value(self, t):
        if t == 8:
            return self.str()
        if t == 9:
            et, n = self.u("<I"), self.u("<Q")
            return (et, [self.value(et) for _ in range(n)])
        return self.u(SCALAR[t])


def read_gguf(path):
    r = Reader(path.read_bytes() if isinstance(path, Path) else path)
    assert r.take(4) == b"GGUF"
    version, n_t, n_kv = r.u("<I"), r.u("<Q"), r.u("<Q")
    kvs = []
    for _ in range(n_kv):
        k = r.str()
        t = r.u("<I")
        kvs.append((k, t, r.value(t)))
    tensors = []
    for _ in range(n_t):
        name = r.str()
        nd = r.u("<I")
        dims = [r.u("<Q") for _ in range(nd)]
        tensors.append((name, dims, r.u("<I"), r.u("<Q")))
    return version, kvs, tensors


def enc_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def enc_value(t, v):
    if t == 8:
        return enc_str(v)
    if t == 9:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(enc_value(et, x) for x in items)
    return struct.pack(SCALAR[t], v)


def tensor_bytes(dims, ggml_type):
    blk, size = BLOCK[ggml_type]
    n = 1
    for d in dims:
        n *= d
    return n // blk * size


def write_gguf(kvs, tensors, with_data=True, version=3):
    """tensors: (name, dims, type). Offsets are laid out here, aligned to 32."""
    align = next((v for k, t, v in kvs if k == "general.alignment"), 32)
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for k, t, v in kvs:
        out += enc_str(k) + struct.pack("<I", t) + enc_value(t, v)
    off, offs = 0, []
    for name, dims, ty in tensors:
        offs.append(off)
        off += -(-tensor_bytes(dims, ty) // align) * align
    for (name, dims, ty), o in zip(tensors, offs):
        out += enc_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, o)
    if with_data:
        out += b"\0" * (-len(out) % align)
        for (name, dims, ty), o in zip(tensors, offs):
            data = bytes((i * 37 + 11) % 251 for i in range(tensor_bytes(dims, ty)))
            out += data + b"\0" * (-len(data) % align)
    return bytes(out)


def shrink_vocab(kvs, n):
    """The first n tokens (scores, types) and the merges whose parts and result are among them."""
    vals = {k: v for k, t, v in kvs}
    tokens = vals["tokenizer.ggml.tokens"][1][:n]
    keep = set(tokens)
    out = []
    for k, t, v in kvs:
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            v = (v[0], v[1][:n])
        elif k == "tokenizer.ggml.merges":
            ms = []
            for m in v[1]:
                a, _, b = m.partition(" ")
                if a in keep and b in keep and a + b in keep:
                    ms.append(m)
            v = (v[0], ms)
        elif k.endswith(".vocab_size"):
            v = n
        elif k.startswith("tokenizer.ggml.") and k.endswith("_token_id") and isinstance(v, int) and v >= n:
            v = n - 1
        out.append((k, t, v))
    return out


def set_kv(kvs, key, value):
    return [(k, t, value if k == key else v) for k, t, v in kvs]


def mini_tensors(tensors, keep_block=0):
    """Tensors outside blocks and in block `keep_block`, each shrunk to one or two rows of
    one block (dtype kept)."""
    out = []
    for name, dims, ty, _ in tensors:
        if name.startswith("blk.") and not name.startswith(f"blk.{keep_block}."):
            continue
        blk, _ = BLOCK.get(ty, (1, 4))
        ne0 = max(blk, 32)
        out.append((name, [ne0] if len(dims) == 1 else [ne0, 2], ty if ty in BLOCK else 0))
    return out


def gguf_meta_json(kvs):
    """tokenizer.* keys as gguf-rs decodes them (arrays as JSON arrays)."""
    meta = {}
    for k, t, v in kvs:
        if k.startswith("tokenizer."):
            meta[k] = v[1] if t == 9 else v
    return json.dumps(meta, ensure_ascii=False).encode("utf-8")


# ---------------------------------------------------------------------------------------
# safetensors


def st_read(path):
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n])


def st_write(entries):
    """entries: name -> (dtype, shape); data is a deterministic pattern."""
    width = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}
    header, off, data = {"__metadata__": {"format": "pt"}}, 0, bytearray()
    for name, (dt, shape) in entries.items():
        n = width[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        data += bytes((i * 13 + 7) % 256 for i in range(n))
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(data)


DIM = {64: 8, 256: 16, 320: 16, 32: 4}


def shrunk_shard(path, rename=None):
    entries = {}
    for name, e in st_read(path).items():
        if name == "__metadata__":
            continue
        entries[rename(name) if rename else name] = (e["dtype"], [DIM.get(d, d) for d in e["shape"]])
    return entries


def shrunk_config(cfg):
    cfg = dict(cfg)
    cfg.update(hidden_size=8, intermediate_size=16, vocab_size=16, head_dim=2)
    return cfg


def gptoss_seeds(seeds):
    """safetensors: a one-block gpt-oss directory (2 experts, hidden 32) with its experts fused
    as transformers saves them (float gate_up_proj / down_proj) and as the published
    checkpoints store them (MXFP4 _blocks and _scales), so that fuzzing reaches the gathering of
    the experts."""
    cfg = json.loads((FIX / "tiny-gptoss-hf" / "config.json").read_text())
    cfg.update(hidden_size=32, intermediate_size=32, vocab_size=16, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, num_hidden_layers=1, num_local_experts=2,
               num_experts_per_tok=1, layer_types=["sliding_attention"])
    pre = "model.layers.0."
    common = {"model.embed_tokens.weight": ("BF16", [16, 32]), "lm_head.weight": ("BF16", [16, 32]),
              "model.norm.weight": ("BF16", [32]), pre + "input_layernorm.weight": ("BF16", [32]),
              pre + "post_attention_layernorm.weight": ("BF16", [32]), pre + "self_attn.sinks": ("BF16", [2]),
              pre + "mlp.router.weight": ("BF16", [2, 32]), pre + "mlp.router.bias": ("BF16", [2]),
              pre + "mlp.experts.gate_up_proj_bias": ("BF16", [2, 64]),
              pre + "mlp.experts.down_proj_bias": ("BF16", [2, 32])}
    for p, rows in (("q", 32), ("k", 16), ("v", 16)):
        common[pre + f"self_attn.{p}_proj.weight"] = ("BF16", [rows, 32])
        common[pre + f"self_attn.{p}_proj.bias"] = ("BF16", [rows])
    common[pre + "self_attn.o_proj.weight"] = ("BF16", [32, 32])
    common[pre + "self_attn.o_proj.bias"] = ("BF16", [32])
    fl = {pre + "mlp.experts.gate_up_proj": ("BF16", [2, 32, 64]),
          pre + "mlp.experts.down_proj": ("BF16", [2, 32, 32])}
    mx = {pre + "mlp.experts.gate_up_proj_blocks": ("U8", [2, 64, 1, 16]),
          pre + "mlp.experts.gate_up_proj_scales": ("U8", [2, 64, 1]),
          pre + "mlp.experts.down_proj_blocks": ("U8", [2, 32, 1, 16]),
          pre + "mlp.experts.down_proj_scales": ("U8", [2, 32, 1])}
    c = json.dumps(cfg, indent=1).encode()
    seeds["gptoss-float-experts"] = join(st_write({**common, **fl}), c)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    seeds["gptoss-mxfp4-experts"] = join(st_write({**common, **mx}), json.dumps(cfg, indent=1).encode())


def join(*parts):
    return SEP.join(parts)


# ---------------------------------------------------------------------------------------


def gdsconv():
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "release" / "gdsconv"
    if not exe.exists():
        subprocess.run(["cargo", "build", "--release", "-p", "gdsconv"], cwd=ROOT, check=True)
    return exe


def convert(src, tmp):
    out = Path(tmp) / (src.name + ".gds")
    subprocess.run([str(gdsconv()), "convert", str(src), str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out


LLAMA_GRAMMARS = ROOT / ".cache" / "llama.cpp" / "src" / "llama.cpp" / "grammars"


def grammar_seeds(seeds):
    """grammar: a mode byte (0 the `grammar` field, 1 Lark, 2 regex, 3 JSON schema), the
    source, SEP, the walk (each byte picks an allowed token). llama.cpp's own GBNF grammars
    (its sdist, built by scripts/build-llama-cpp.sh; skipped when absent), schemas and
    expressions of the kinds clients send, and attacks on the bounds."""
    walk = bytes(range(7, 255, 3))
    if LLAMA_GRAMMARS.is_dir():
        for p in sorted(LLAMA_GRAMMARS.glob("*.gbnf")):
            seeds[f"gbnf-{p.stem}"] = b"\x00" + p.read_bytes() + SEP + walk
    else:
        print("note: run scripts/build-llama-cpp.sh for llama.cpp's GBNF grammars as seeds", file=sys.stderr)
    person = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "score": {"type": "number"}, "ok": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["name", "age"], "additionalProperties": False}
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    texts = {
        "lark-json-ish": (1, 'start: obj\nobj: "{" pair ("," pair)* "}"\npair: STR ":" val\n'
                             'val: STR | NUM | obj\nSTR: /"[a-z]{1,8}"/\nNUM: /-?[0-9]+/\n'),
        "lark-lazy": (1, 'start: "say " /[a-z ]+/ "."\n'),
        "gbnf-arith": (0, 'root ::= expr\nexpr ::= term ([-+*/] term)*\n'
                          'term ::= [0-9]+ | "(" expr ")"\n'),
        "gbnf-classes": (0, 'root ::= [^\\x00-\\x1f"]{2,5} "\\u00e9" [a-zA-Z_]? ("x"{3})*\n'),
        "regex-yes-no": (2, "(Yes|No), because [a-z ]{5,60}\\."),
        "regex-date": (2, "[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"),
        "schema-person": (3, json.dumps(person)),
        "schema-tree": (3, json.dumps(tree)),
        "schema-anyof": (3, json.dumps({"anyOf": [{"type": "string", "pattern": "^a+b$"},
                                                  {"type": "array", "items": {"type": "number"}}]})),
        "schema-any": (3, json.dumps({"type": "object"})),
        # attacks: repetitions multiplied, nesting, state blow-up, huge bounds
        "attack-gbnf-nested-repeat": (0, 'root ::= (("a"{1000}){1000}){1000}\n'),
        "attack-gbnf-deep": (0, "root ::= " + "(" * 60 + '"x"' + ")" * 60 + "\n"),
        "attack-lark-left-recursion": (1, 'start: a\na: a "x" | a a | "y"\n'),
        "attack-regex-states": (2, "[ab]*a[ab]{40}"),
        "attack-regex-repeat": (2, "(a{1,1000}){1,1000}"),
        "attack-schema-huge-bounds": (3, json.dumps({"type": "string", "minLength": 10**9})),
        "attack-schema-items": (3, json.dumps({"type": "array", "minItems": 100000, "items": {"type": "integer"}})),
        "attack-schema-self-ref": (3, json.dumps({"$ref": "#"})),
        "attack-schema-pattern": (3, json.dumps({"type": "string", "pattern": "(a+)+$"})),
    }
    for name, (mode, src) in texts.items():
        seeds[name] = bytes([mode]) + src.encode() + SEP + walk


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curated", action="store_true",
                    help="write the small committed set into fuzz/seeds/ instead of fuzz/corpus/")
    ap.add_argument("--only", choices=["grammar"], help="write this target's seeds only")
    args = ap.parse_args()
    out = ROOT / "fuzz" / ("seeds" if args.curated else "corpus")
    limit = 24 << 10 if args.curated else 1 << 20
    seeds = {t: {} for t in ("manifest", "gguf", "safetensors", "tokenizer", "imatrix", "grammar")}
    grammar_seeds(seeds["grammar"])
    if args.only:
        return write(out, {args.only: seeds[args.only]}, args.curated, limit)
    # imatrix: the converter's fixtures (scripts/gen_imatrix_goldens.py), whole and cut
    for p in sorted((FIX / "imatrix").glob("*.imatrix.*")):
        b = p.read_bytes()
        seeds["imatrix"][p.name] = b
        seeds["imatrix"][f"{p.name}-cut"] = b[:len(b) // 2]
    real = [p for p in (MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf", MODELS / "gemma-3-270m-q4_k_m.gguf")
            if p.exists()]
    if len(real) < 2:
        print("note: run scripts/fetch-model.sh and scripts/fetch-gemma.sh for seeds from the real models",
              file=sys.stderr)

    # gguf: the fixtures as they are, the real models' headers (all metadata, vocabulary cut)
    for p in sorted((FIX / "bad").glob("*.gguf")):
        seeds["gguf"][f"bad-{p.stem}"] = p.read_bytes()
    for p in (FIX / "tiny-llama.gguf", FIX / "tiny-llama-tied.gguf"):
        seeds["gguf"][p.stem] = p.read_bytes()
    tok_metas = {}
    for p in real:
        stem = p.name.split("-")[0].lower()
        head = p.open("rb").read(64 << 20)  # the metadata region (vocabulary included)
        version, kvs, tensors = read_gguf(head)
        seeds["gguf"][f"{stem}-prefix-256k"] = head[:256 << 10]
        for n in (64, 512):
            tok_metas[f"{stem}-{n}"] = shrink_vocab(kvs, n)
        # a 64-token vocabulary keeps the tokenizer export (which every successful read runs)
        # cheap; the tokenizer target covers the exporter with bigger ones
        small = tok_metas[f"{stem}-64"]
        seeds["gguf"][f"{stem}-header"] = write_gguf(
            small, [(a, d, t) for a, d, t, _ in tensors], with_data=False, version=version)
        mini = set_kv(small, next(k for k, _, _ in small if k.endswith(".block_count")), 1)
        seeds["gguf"][f"{stem}-mini"] = write_gguf(mini, mini_tensors(tensors), version=version)
    tok_metas["tiny-llama"] = read_gguf(FIX / "tiny-llama.gguf")[1]

    # tokenizer, odd mode: GGUF tokenizer metadata as JSON
    for name, kvs in tok_metas.items():
        seeds["tokenizer"][f"gguf-{name}"] = b"\x01" + gguf_meta_json(kvs)

    # tokenizer, even mode: tokenizer_config.json [+ tokenizer.json]
    hf = FIX / "tiny-llama-hf"
    tc, tj = (hf / "tokenizer_config.json").read_bytes(), (hf / "tokenizer.json").read_bytes()
    seeds["tokenizer"]["hf-config"] = b"\x00" + tc
    seeds["tokenizer"]["hf-config-ids-addbos"] = b"\x06" + tc
    seeds["tokenizer"]["hf-config-and-tokenizer"] = b"\x00" + join(tc, tj)

    # chat templates using what crates/gds-runtime/src/chat.rs adds to minijinja (Python
    # string and dict methods, raise_exception, strftime_now), as real templates do
    templates = {
        "tmpl-methods": "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() | upper }}]"
                        "{{ m.content.lstrip('B').rstrip().lower().title().capitalize() }}"
                        "{{ m.content.replace('i', 'I').split(' ') | join(',') }}"
                        "{{ m.content.startswith('H') }}{{ m.content.endswith('e') }}{{ m.content.find('y') }}"
                        "\n  {% endif %}\n{% endfor %}{{ bos_token }}",
        "tmpl-dict-exception-date": "{% set d = {'a': 1, 'b': 2} %}{% for k, v in d.items() %}{{ k }}={{ v }}"
                                    "{% endfor %}{{ d.keys() | list }}{{ d.values() | list }}{{ d.get('c', 3) }}"
                                    "{{ strftime_now('%d %b %Y %H:%M:%S %A %e %m %y %B %a %%') }}"
                                    "{% if messages | length > 3 %}{{ raise_exception('too many') }}{% endif %}"
                                    "{% for m in messages %}{{ loop.index }}{{ m['role'] }}{{ eos_token }}{% endfor %}"
                                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }
    for name, t in templates.items():
        cfg = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
               "chat_template": [{"name": "default", "template": t}, {"name": "tool_use", "template": "x"}]}
        seeds["tokenizer"][name] = b"\x00" + json.dumps(cfg, indent=1).encode()

    # manifests and real tokenizer configs from gdsconv convert
    with tempfile.TemporaryDirectory(prefix="gds-fuzz-seeds-") as tmp:
        for src in [FIX / "tiny-llama.gguf", FIX / "tiny-llama-tied.gguf", hf] + real:
            d = convert(src, tmp)
            stem = src.name.split("-")[0].lower() if src in real else src.stem
            seeds["manifest"][stem] = (d / "manifest.gdsm").read_bytes()
            if src in real:
                cfg = (d / "tokenizer_config.json").read_bytes()
                seeds["tokenizer"][f"{stem}-config"] = b"\x00" + cfg
                seeds["tokenizer"][f"{stem}-config-ids"] = b"\x02" + cfg
            shutil.rmtree(d)

    # safetensors: the fixture directory with every dimension shrunk
    cfg = json.loads((hf / "config.json").read_text())
    small_cfg = json.dumps(shrunk_config(cfg), indent=2).encode()
    s1 = shrunk_shard(hf / "model-00001-of-00002.safetensors")
    s2 = shrunk_shard(hf / "model-00002-of-00002.safetensors")
    gen = (hf / "generation_config.json").read_bytes()
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    seeds["safetensors"]["single"] = join(st_write({**s1, **s2}), small_cfg, b"", b"", tc, gen)
    seeds["safetensors"]["sharded"] = join(st_write(s1), small_cfg, json.dumps(index, indent=2).encode(),
                                           st_write(s2), tc, gen)
    seeds["safetensors"]["no-config"] = st_write({**s1, **s2})
    seeds["safetensors"]["two-shards-no-index"] = join(st_write(s1), small_cfg, b"", st_write(s2))
    tied = dict(shrunk_config(cfg), tie_word_embeddings=True, eos_token_id=[2, 0],
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    no_head = {k: v for k, v in {**s1, **s2}.items() if k != "lm_head.weight"}
    seeds["safetensors"]["tied-eos-list-llama3"] = join(
        st_write(no_head), json.dumps(tied).encode(), b"", b"", tc,
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}).encode())
    other = dict(shrunk_config(cfg), architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")
    seeds["safetensors"]["other-arch"] = join(st_write(no_head), json.dumps(other).encode())
    gptoss_seeds(seeds["safetensors"])

    write(out, seeds, args.curated, limit)


def write(out, seeds, curated, limit):
    for target, files in seeds.items():
        d = out / target
        if curated and d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        for name, data in sorted(files.items()):
            if len(data) <= limit:
                (d / name).write_bytes(data)
        kept = [n for n, b in files.items() if len(b) <= limit]
        print(f"{target}: {len(kept)} seeds in {d.relative_to(ROOT)} "
              f"({sum(len(files[n]) for n in kept) >> 10} KiB)")


if __name__ == "__main__":
    main()
