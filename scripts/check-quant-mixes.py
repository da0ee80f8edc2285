#!/usr/bin/env python3
"""`gdsconv convert --quant q4_k_m` (and the other K mixes) against llama.cpp's `llama-quantize`.

Writes small random f32 llama GGUFs (16 and 32 layers, untied, and 16 layers tied), quantizes
each with `llama-quantize` to Q2_K, Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_M, Q4_K_S, Q5_K_M and Q5_K_S
(and the 16-layer one with `--pure` to each single type gdsconv offers from Q5_0 to Q6_K;
and a 16-layer one with 8 query heads per KV head to Q2_K, whose attn_v rule depends on it), converts each with
`gdsconv convert --quant <name>`, and compares every tensor: the type llama.cpp chose and the
bytes it wrote must equal ours. Then the same with an importance matrix: a random one
for the 16-layer model, written as `llama-imatrix` writes it (GGUF: `<name>.in_sum2` and
`<name>.counts` per matrix, its metadata keys; and the legacy `.dat`), given to both tools
(`llama-quantize --imatrix F`, `gdsconv convert --imatrix F`) for every mix and type above
plus Q4_0 and Q4_1; the bytes must be equal, and differ from those made without it.
An 8-layer model with SmolLM2's 576 columns runs every mix and single K type through
llama.cpp's fallback types (rows that are not whole 256-blocks: Q4_K -> Q5_0 and so on).
Three 80-layer models (256 columns) run the mixes whose attn_v can be Q3_K or Q4_K (Q2_K,
Q3_K_S, Q3_K_M, Q4_K_S, Q4_K_M) for llama.cpp's 70B rule (such attn_v Q5_K): a llama with
8 query heads over 4 KV heads (LLM_TYPE_70B), one with 8 over 8 (LLM_TYPE_65B: no rule), and
a qwen2 with 8 over 8 (LLM_TYPE_70B at 80 layers whatever the heads; its attn_q/attn_k rows
compared through the Q/K permutation gdsconv applies); each run also checks that
llama-quantize applied the rule or not as expected.
With `--quant-override` (llama-quantize's `--tensor-type`): the 16-layer model to Q4_K_M with
overrides that take attn_v of layers 0-1 from the mix (which shifts llama.cpp's count of the
attn_v tensors its mix decides), first-match order, 1-D and float targets, also with the
imatrix, to `--pure` Q5_0 with overrides, and the 576-column model with override types that
fall back.
With `--real MODEL.gguf IMATRIX`, also a real model and an imatrix `llama-imatrix` computed
for it: `--pure --allow-requantize` Q4_0, Q5_0, Q5_1 and Q8_0, and every mix and Q6_K
(`--allow-requantize`), against `gdsconv --requantize`.
Exit 1 on any difference.

    cargo build --profile ci -p gdsconv
    scripts/build-llama-cpp.sh        # .cache/llama.cpp/build/bin/llama-quantize
    python3 scripts/check-quant-mixes.py [--gdsconv target/ci/gdsconv]
        [--llama-quantize .cache/llama.cpp/build/bin/llama-quantize] [--work DIR]
        [--real MODEL.gguf IMATRIX] [--quant-override | --only-override]

Needs numpy and gguf-py (llama.cpp's, importable from .cache/llama.cpp/src/llama.cpp/gguf-py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / ".cache/llama.cpp/src/llama.cpp/gguf-py"))
import gguf  # noqa: E402

# (llama-quantize type, extra flags, gdsconv --quant)
MIXES = [(m, [], m.lower()) for m in ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
                                      "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S"]]
# one type for every matrix: --pure (the mix's base type everywhere); `--quant q2_k` is
# llama-quantize's Q2_K mix, so Q2_K has no pure run
PURE = [("Q3_K_M", "q3_k"), ("Q4_K_M", "q4_k"), ("Q5_K_M", "q5_k"),
        ("Q6_K", "q6_k"), ("Q5_0", "q5_0"), ("Q5_1", "q5_1")]
# with an importance matrix, also the types whose weighted quantizer differs most
PURE_IMATRIX = PURE + [("Q4_0", "q4_0"), ("Q4_1", "q4_1")]
E, F, V = 256, 512, 512


def make_gguf(path: pathlib.Path, n_layer: int, tied: bool, kv_heads: int = 2,
              embd: int | None = None, arch: str = "llama", heads: int | None = None,
              ff: int | None = None, experts: int = 0) -> None:
    """A random llama: 2 query heads over `kv_heads` = 2 KV heads (no GQA), or 8 query heads
    of 32 over fewer KV heads (the Q2_K mix's rule for 4 or more query heads per KV head);
    `heads` KV heads of 32 when given (8 = 8: no GQA, llama.cpp's 65B at 80 layers). `embd`
    (576, SmolLM2's) makes rows that are not whole 256-blocks: llama.cpp's fallback types; its
    FFN is 3 x embd (whole 256-blocks for ffn_down), else `ff` or F. `arch` qwen2 writes the
    same tensors as a qwen2 GGUF (llama.cpp keeps its Q/K rows unpermuted; gdsconv permutes
    them as for a Hugging Face input, see `compare`). `experts` > 0: a Mixtral-like mixture
    (llama with `llama.expert_count`), its FFN a router and stacked experts of `ff` or F, two
    used a token."""
    E = embd or globals()["E"]
    F = 3 * embd if embd else ff or globals()["F"]
    n_head = heads or (2 if kv_heads == 2 else 8)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(128)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(n_head)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(E // n_head)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
    rng = np.random.default_rng(n_layer * 2 + tied + 100 * (kv_heads != 2) + (embd or 0) + 1000 * experts)
    kv = kv_heads * (E // n_head)

    def mat(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32))

    mat("token_embd.weight", V, E)
    if not tied:
        mat("output.weight", V, E)
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(E, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(E, np.float32))
        ffn = [("ffn_gate", F, E), ("ffn_up", F, E), ("ffn_down", E, F)]
        for name, rows, cols in [("attn_q", E, E), ("attn_k", kv, E), ("attn_v", kv, E),
                                 ("attn_output", E, E)] + ([] if experts else ffn):
            mat(f"blk.{i}.{name}.weight", rows, cols)
        if experts:
            mat(f"blk.{i}.ffn_gate_inp.weight", experts, E)
            for name, rows, cols in ffn:
                w.add_tensor(f"blk.{i}.{name}_exps.weight",
                             (rng.standard_normal((experts, rows, cols)) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_imatrix(src: pathlib.Path, out: pathlib.Path, legacy: bool, chunk: int = 512) -> None:
    """A random importance matrix for every block matrix and the output head of `src`, as
    llama-imatrix writes it: per column the sum of squared activations and per matrix the
    count of activations (GGUF), or the legacy .dat's value / count * ncall."""
    rng = np.random.default_rng(34)
    entries = []
    for t in gguf.GGUFReader(str(src)).tensors:
        if len(t.shape) != 2 or not (t.name.startswith("blk.") or t.name == "output.weight"):
            continue
        cols = int(t.shape[0])  # ggml order: ne0 = columns
        count = int(rng.integers(1, 8)) * chunk
        # a few columns see far larger activations than the rest, as in real models
        mean_sq = rng.gamma(0.5, 1.0, cols) * np.where(rng.random(cols) < 0.02, 100.0, 1.0)
        entries.append((t.name, (mean_sq * count).astype(np.float32), count))
    if legacy:
        with open(out, "wb") as f:
            f.write(np.int32(len(entries)).tobytes())
            for name, sum2, count in entries:
                ncall = (count + chunk - 1) // chunk
                f.write(np.int32(len(name)).tobytes() + name.encode())
                f.write(np.int32(ncall).tobytes() + np.int32(sum2.size).tobytes())
                f.write(((sum2 / np.float32(count)) * np.float32(ncall)).astype(np.float32).tobytes())
            f.write(np.int32(8).tobytes())
            f.write(np.int32(9).tobytes() + b"calib.txt")
        return
    w = gguf.GGUFWriter(str(out), "imatrix")
    del w.kv_data[0]["general.architecture"]  # llama-imatrix writes none
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["calib.txt"])
    w.add_uint32("imatrix.chunk_count", 8)
    w.add_uint32("imatrix.chunk_size", chunk)
    for name, sum2, count in entries:
        w.add_tensor(f"{name}.in_sum2", sum2.reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[count]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# (source, llama-quantize type, extra flags, gdsconv --quant, [(REGEX, TYPE)] given to
# llama-quantize --tensor-type and gdsconv --quant-override in this order)
OVERRIDES = [
    ("l16", "Q4_K_M", [], "q4_k_m",
     # attn_v of layers 0-1 leave llama.cpp's attn_v count (use_more_bits shifts); the
     # second ffn_down rule never decides (the first match wins); the norm pattern matches
     # only 1-D tensors; "output" also matches attn_output
     [(r"blk\.[01]\.attn_v", "q8_0"), (r"ffn_down", "q5_0"), (r"blk\.3\.ffn_down", "q8_0"),
      (r"attn_q", "q6_k"), (r"ffn_(gate|up)", "q3_k"), (r"output", "q4_1"),
      (r"attn_norm", "q8_0"), (r"token_embd", "f16")]),
    ("l16", "Q5_0", ["--pure"], "q5_0",
     [(r"attn_[kv]", "q2_k"), (r"blk\.1[0-5]\.ffn", "q5_k"), (r"OUTPUT\.weight", "q6_k")]),
    # rows of 576: the override types fall back as the mixes' do (q6_k -> q8_0, q4_k -> q5_0)
    ("l8-e576", "Q4_K_M", [], "q4_k_m",
     [(r"attn_k", "q6_k"), (r"ffn_down", "q4_k"), (r"blk\.0\.attn_v", "q2_k"),
      (r"token_embd", "q5_1")]),
]


def permute_rows(data: np.ndarray, n_head: int) -> bytes:
    """llama.cpp's converter's Q/K row permutation (`LlamaModel.permute`: Hugging Face's
    rotate-half rows to ggml's interleaved pairs), on rows of any type's bytes."""
    d = data.reshape(data.shape[0], -1)
    rows = d.shape[0]
    return d.reshape(n_head, 2, rows // n_head // 2, d.shape[1]).swapaxes(1, 2).reshape(d.shape).tobytes()


def compare(a, src: pathlib.Path, mix: str, flags: list[str], quant: str, tokenizer: pathlib.Path,
            tag: str, imatrix: pathlib.Path | None,
            overrides: list[tuple[str, str]] = (),
            permuted: tuple[int, int] | None = None) -> tuple[int, dict[str, bytes]]:
    """Quantizes `src` with both tools; returns the differences and llama.cpp's bytes of
    each quantized tensor. `permuted` (query heads, KV heads): a qwen2 GGUF, whose attn_q and
    attn_k rows gdsconv permutes (row by row, so the quantized rows are the same)."""
    imx = ["--imatrix", str(imatrix)] if imatrix else []
    tt = [x for p, t in overrides for x in ("--tensor-type", f"{p}={t}")]
    ov = [x for p, t in overrides for x in ("--quant-override", f"{p}={t}")]
    ref = src.with_name(f"{src.stem}-{quant}{tag}.gguf")
    subprocess.run([a.llama_quantize, *flags, *tt, *imx, str(src), str(ref), mix, "2"], check=True,
                   capture_output=True)
    out = src.with_name(f"{src.stem}-{quant}{tag}.gds")
    subprocess.run([a.gdsconv, "convert", str(src), str(out), "--quant", quant, *(["--requantize"] if "--allow-requantize" in flags else []),
                    "--tokenizer", str(tokenizer), "--force", *imx, *ov], check=True,
                   capture_output=True)
    ins = json.loads(subprocess.run([a.gdsconv, "inspect", str(out), "--json", "--tensors"],
                                    check=True, capture_output=True, text=True).stdout)
    files = {l["name"]: l["file"] for l in ins["layers"]}
    ours = {t["name"]: t for t in ins["tensors"]}
    types: dict[str, int] = {}
    diffs = 0
    theirs = {}
    for rt in gguf.GGUFReader(str(ref)).tensors:
        o = ours[rt.name]
        want = rt.tensor_type.name.lower()
        types[want] = types.get(want, 0) + 1
        data = rt.data.tobytes()
        if want != "f32":
            theirs[rt.name] = data
        if permuted and rt.name.endswith((".attn_q.weight", ".attn_k.weight")):
            data = permute_rows(rt.data, permuted[0] if ".attn_q." in rt.name else permuted[1])
        if o["dtype"] != want:
            print(f"  {rt.name}: ours {o['dtype']}, llama-quantize {want}")
            diffs += 1
            continue
        with open(os.path.join(out, files[o["layer"]]), "rb") as f:
            f.seek(o["offset"])
            if f.read(o["nbytes"]) != data:
                print(f"  {rt.name}: {want} bytes differ")
                diffs += 1
    print(f"{src.stem} {quant}{tag}: {sum(types.values())} tensors {types}, {diffs} differences")
    return diffs, theirs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gdsconv", default=str(ROOT / "target/ci/gdsconv"))
    ap.add_argument("--llama-quantize", default=str(ROOT / ".cache/llama.cpp/build/bin/llama-quantize"))
    ap.add_argument("--work", help="keep the files here (default: a temporary directory)")
    ap.add_argument("--quant-override", action="store_true",
                    help="also the --quant-override runs (llama-quantize --tensor-type)")
    ap.add_argument("--only-override", action="store_true",
                    help="only the --quant-override runs (and the files they need)")
    ap.add_argument("--only-moe", action="store_true",
                    help="only the mixtures of experts' runs")
    ap.add_argument("--real", nargs=2, metavar=("MODEL", "IMATRIX"),
                    help="also a real GGUF model with an imatrix llama-imatrix made for it")
    a = ap.parse_args()
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="quant-mixes-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = ROOT / "fixtures/tiny-llama-hf/tokenizer.json"  # the GGUF's toy vocabulary exports no tokenizer
    bad = 0
    plain: dict[str, dict[str, bytes]] = {}
    n_runs = 0
    # mixtures of experts (Mixtral-like llamas): 8 experts take llama.cpp's 8-expert rules
    # (attn_v and attn_k Q8_0, attn_output Q5_K below the Q5 mixes), 4 do not; every mix, and
    # MXFP4_MOE (experts MXFP4, the other matrices Q8_0)
    for n_exp in [8, 4]:
        src = work / f"l16-x{n_exp}.gguf"
        make_gguf(src, 16, False, experts=n_exp, ff=256)
        for mix, flags, quant in MIXES + [("MXFP4_MOE", [], "mxfp4_moe")]:
            diffs, theirs = compare(a, src, mix, flags, quant, tokenizer, "", None)
            bad += diffs
            n_runs += 1
            if quant == "q4_k_m":
                # llama-quantize itself applied the 8-expert rule (and only with 8)
                kv = [t.tensor_type.name for t in
                      gguf.GGUFReader(str(src.with_name(f"{src.stem}-{quant}.gguf"))).tensors
                      if t.name.endswith((".attn_k.weight", ".attn_v.weight"))]
                if all(t == "Q8_0" for t in kv) != (n_exp == 8):
                    print(f"  llama-quantize's attn_k/attn_v with {n_exp} experts: {sorted(set(kv))}")
                    bad += 1
    if a.only_moe:
        print(f"{n_runs} runs, {bad} differences")
        return 1 if bad else 0
    for n_layer, tied, kv_heads, embd in [(16, False, 2, None), (32, False, 2, None),
                                          (16, True, 2, None), (16, False, 1, None),
                                          (8, False, 2, 576)]:
        src = work / f"l{n_layer}{'t' if tied else ''}{'-gqa' if kv_heads != 2 else ''}{f'-e{embd}' if embd else ''}.gguf"
        if embd:
            # rows of 576: every mix and single K type through llama.cpp's fallback types
            runs = MIXES + [(t, ["--pure"], q) for t, q in PURE]
        elif kv_heads != 2:
            # 8 query heads over 1 KV head: only the mixes that look at n_gqa
            runs = [m for m in MIXES if m[0] == "Q2_K"]
        else:
            runs = MIXES + ([(t, ["--pure"], q) for t, q in PURE] if (n_layer, tied) == (16, False) else [])
        if a.only_override:
            # the runs the override runs compare with
            runs = [r for r in runs if (n_layer, tied, kv_heads, embd) == (16, False, 2, None)
                    and r[2] in [o[3] for o in OVERRIDES]]
        if runs or (n_layer, tied, kv_heads, embd) in [(16, False, 2, None), (8, False, 2, 576)]:
            make_gguf(src, n_layer, tied, kv_heads, embd)
        for mix, flags, quant in runs:
            diffs, theirs = compare(a, src, mix, flags, quant, tokenizer, "", None)
            bad += diffs
            n_runs += 1
            if (n_layer, tied, kv_heads) == (16, False, 2):
                plain[quant] = theirs
    # llama.cpp's 70B rule (attn_v Q3_K/Q4_K -> Q5_K): 80 layers of 256 columns, FFN 256;
    # llama with 8 query heads over 4 KV heads (LLM_TYPE_70B), with 8 over 8 (LLM_TYPE_65B: no
    # rule), and qwen2 with 8 over 8 (LLM_TYPE_70B at any heads), through the mixes whose
    # attn_v can be Q3_K or Q4_K
    for stem, arch, heads, kv_heads, is_70b in [] if a.only_override else [
            ("l80-70b", "llama", 8, 4, True), ("l80-65b", "llama", 8, 8, False),
            ("l80-qwen2", "qwen2", 8, 8, True)]:
        src = work / f"{stem}.gguf"
        make_gguf(src, 80, False, kv_heads, None, arch=arch, heads=heads, ff=256)
        for mix, flags, quant in MIXES:
            if mix not in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"):
                continue
            diffs, _ = compare(a, src, mix, flags, quant, tokenizer, "", None,
                               permuted=(heads, kv_heads) if arch == "qwen2" else None)
            bad += diffs
            n_runs += 1
            # llama-quantize itself took the model for a 70B or not
            v = [t.tensor_type.name for t in
                 gguf.GGUFReader(str(src.with_name(f"{stem}-{quant}.gguf"))).tensors
                 if t.name.endswith("attn_v.weight")]
            low = sum(t in ("Q3_K", "Q4_K") for t in v)
            if (low == 0) != is_70b:
                print(f"  llama-quantize gave {low} of {len(v)} attn_v Q3_K/Q4_K: "
                      f"{'not ' if is_70b else ''}the 70B rule")
                bad += 1
    src = work / "l16.gguf"
    for fmt, ext in [("gguf", "imatrix.gguf"), ("legacy", "imatrix.dat")]:
        imatrix = work / f"l16-{ext}"
        make_imatrix(src, imatrix, legacy=fmt == "legacy")
        for mix, flags, quant in [] if a.only_override else MIXES + [(t, ["--pure"], q) for t, q in PURE_IMATRIX]:
            diffs, theirs = compare(a, src, mix, flags, quant, tokenizer, f"-imatrix-{fmt}", imatrix)
            bad += diffs
            n_runs += 1
            # the importance matrix changed what llama-quantize wrote (so ours was checked
            # against weighted bytes)
            if quant in plain:
                same = sum(theirs[k] == v for k, v in plain[quant].items() if k.startswith("blk."))
                if same:
                    print(f"  {same} quantized block tensors are the same as without the imatrix")
                    bad += 1
    if a.quant_override or a.only_override:
        for i, (stem, mix, flags, quant, overrides) in enumerate(OVERRIDES):
            src = work / f"{stem}.gguf"
            for imatrix in [None, work / "l16-imatrix.gguf"] if stem == "l16" else [None]:
                tag = f"-override{i}" + ("-imatrix" if imatrix else "")
                diffs, theirs = compare(a, src, mix, flags, quant, tokenizer, tag, imatrix, overrides)
                bad += diffs
                n_runs += 1
                # the overrides changed what llama-quantize chose (so ours was checked against them)
                if not imatrix and quant in plain and (
                        {k: len(v) for k, v in theirs.items()} == {k: len(v) for k, v in plain[quant].items()}):
                    print("  the overrides changed no tensor type")
                    bad += 1
    if a.real:
        src = work / "real.gguf"
        src.unlink(missing_ok=True)
        src.symlink_to(pathlib.Path(a.real[0]).resolve())
        for mix, quant in [("Q4_0", "q4_0"), ("Q5_0", "q5_0"), ("Q5_1", "q5_1"), ("Q8_0", "q8_0")]:
            diffs, _ = compare(a, src, mix, ["--pure", "--allow-requantize"], quant, tokenizer,
                               "-imatrix-real", pathlib.Path(a.real[1]))
            bad += diffs
            n_runs += 1
        # the mixes, whose K types fall back where the rows are not whole 256-blocks
        for mix, _, quant in MIXES + [("Q6_K", [], "q6_k")]:
            diffs, _ = compare(a, src, mix, ["--allow-requantize"], quant, tokenizer,
                               "-imatrix-real", pathlib.Path(a.real[1]))
            bad += diffs
            n_runs += 1
    print(f"{n_runs} runs, {bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
