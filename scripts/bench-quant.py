#!/usr/bin/env python3
"""`just bench-quant`: the quality of `gdsconv convert --quant` against `llama-quantize`, side by
side in one run: KL divergence from the F16 model, perplexity ratio, top-1 agreement and size.

    scripts/bench-quant.py [--model smollm,gemma[,llama-1b]] [--types q4_k_m,q5_k_m,q6_k,q3_k_m]
                           [--ctx 512] [--chunks N] [--text FILE] [--calib FILE]
                           [--profile ci | --bin-dir DIR] [--work DIR] [--json OUT] [--llama-quantize PATH]
                           [--speed HF_DIR [--speed-type q4_k_m]]

For each model (SmolLM2 135M and Gemma 3 270M, the fetched GGUFs dequantized to F16 by
`llama-quantize --allow-requantize ... F16`: the F16 model whose quantization is measured):
1. the F16 model converted as is (`gdsconv convert --quant keep`) is run once by `gdsrun
   perplexity --save-logits` over `--text` (default fixtures/reference/wiki-like.txt, 5.8k
   tokens);
2. an importance matrix is computed on it by `gdsrun imatrix` over `--calib` (default
   docs/conversion.md: other text than the evaluation's);
3. for each type, without and with that imatrix: `llama-quantize [--imatrix] F16.gguf TYPE`
   (run by gdsrun: `gdsconv convert --quant keep`) and `gdsconv convert F16.gguf --quant type
   [--imatrix]`, each scored by `gdsrun perplexity --kl-divergence` against step 1's logits.

Prints per row: bits per weight (tensor bytes x 8 / weights), mean KL (± s.e.), p99 KL,
same top-1 %, PPL/PPL(F16), for ours and llama-quantize's, and the ratio of the mean KLs
(issue 34's bar: ≤ 1.02 at the same size, perplexity within 0.5 %). Both sides are run by the
same runtime, so the table compares the files, not the engines.

`--speed HF_DIR` also times one-step conversion of a Hugging Face F16 checkpoint (e.g.
`.cache/synth/llama-1b`, scripts/synth-model.py) to `--speed-type`: `gdsconv convert HF_DIR
--quant TYPE` against llama.cpp's `convert_hf_to_gguf.py --outtype f16` then `llama-quantize`
(issue 34's bar: ≥ 1.5x faster), each with its peak RSS, interleaved twice, cold page cache
not forced (both read the same warm checkpoint).

Needs: scripts/fetch-model.sh, scripts/fetch-gemma.sh, scripts/build-llama-cpp.sh (its
llama-quantize), the cargo build of gdsconv and gdsrun (--profile, default ci).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = {
    "smollm": ("SmolLM2-135M-Instruct", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma": ("Gemma 3 270M", ".cache/models/gemma-3-270m-q4_k_m.gguf"),
    # the 1B shape's F16 GGUF by llama.cpp's converter (scripts/synth-model.py llama-1b
    # .cache/synth/llama-1b --gguf .cache/synth/llama-1b-Q4_0.gguf): random weights, so its
    # text is noise and only the KL columns mean anything; an F16 model that is no
    # dequantized 4-bit one
    "llama-1b": ("llama-1b (random weights, F16)", ".cache/synth/llama-1b-Q4_0-f16.gguf"),
}
# gdsconv --quant -> llama-quantize type
LLAMA_TYPE = {"q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S", "q5_k_m": "Q5_K_M", "q5_k_s": "Q5_K_S",
              "q6_k": "Q6_K", "q3_k_m": "Q3_K_M", "q3_k_s": "Q3_K_S", "q3_k_l": "Q3_K_L",
              "q2_k": "Q2_K", "q4_0": "Q4_0", "q5_0": "Q5_0", "q8_0": "Q8_0"}


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return r


def bits_per_weight(gdsconv: str, model: pathlib.Path) -> float:
    """Tensor bytes x 8 over the weights of the 2-D tensors (norms excluded)."""
    ins = json.loads(run([gdsconv, "inspect", model, "--json", "--tensors"]).stdout)
    nbytes = weights = 0
    for t in ins["tensors"]:
        if len(t["shape"]) >= 2:
            n = 1
            for d in t["shape"]:
                n *= d
            weights += n
            nbytes += t["nbytes"]
    return nbytes * 8 / weights


def timed(cmd: list) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of `cmd`, by GNU time."""
    t0 = time.time()
    r = run(["/usr/bin/time", "-f", "%M", *cmd])
    return time.time() - t0, int(r.stderr.strip().splitlines()[-1]) / 1024


def speed(a, gdsconv: str, quantize: str, work: pathlib.Path) -> None:
    """One-step HF F16 -> TYPE: gdsconv against convert_hf_to_gguf.py + llama-quantize."""
    hf = pathlib.Path(a.speed)
    conv = ROOT / ".cache/llama.cpp/src/llama.cpp/convert_hf_to_gguf.py"
    q = a.speed_type
    print(f"\n## One step from {hf} (F16 safetensors) to {q}")
    print("| run | gdsconv s | peak MiB | convert_hf_to_gguf s | peak MiB | llama-quantize s | peak MiB | llama.cpp total s | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(2):
        out = work / "speed.gds"
        g, g_rss = timed([gdsconv, "convert", hf, out, "--quant", q, "--force"])
        f16, ref = work / "speed-f16.gguf", work / "speed.gguf"
        c, c_rss = timed([sys.executable, conv, hf, "--outtype", "f16", "--outfile", f16])
        k, k_rss = timed([quantize, f16, ref, LLAMA_TYPE[q], str(os.cpu_count())])
        for f in (f16, ref):
            f.unlink()
        print(f"| {i + 1} | {g:.1f} | {g_rss:.0f} | {c:.1f} | {c_rss:.0f} | {k:.1f} | {k_rss:.0f} | "
              f"{c + k:.1f} | {(c + k) / g:.2f}x |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm,gemma", help="a comma list; empty: only --speed")
    ap.add_argument("--types", default="q4_k_m,q5_k_m,q6_k,q3_k_m")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=0, help="score only the first N chunks")
    ap.add_argument("--text", default=str(ROOT / "fixtures/reference/wiki-like.txt"))
    ap.add_argument("--calib", default=str(ROOT / "docs/conversion.md"))
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--bin-dir", help="gdsconv and gdsrun already built here (no cargo build)")
    ap.add_argument("--work", help="keep the files here (default: a temporary directory)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--speed", help="also time HF F16 -> --speed-type from this checkpoint")
    ap.add_argument("--speed-type", default="q4_k_m")
    ap.add_argument("--llama-quantize", help="this llama-quantize (default: build "
                    "scripts/build-llama-cpp.sh's tools and take theirs)")
    a = ap.parse_args()
    os.chdir(ROOT)
    quantize = a.llama_quantize
    if not quantize:
        run(["./scripts/build-llama-cpp.sh"])
        quantize = ".cache/llama.cpp/bin/llama-quantize"
    if a.bin_dir:
        gdsconv, gdsrun = f"{a.bin_dir}/gdsconv", f"{a.bin_dir}/gdsrun"
    else:
        run(["cargo", "build", "--profile", a.profile, "-q", "-p", "gdsconv", "-p", "gdsrun"])
        gdsconv, gdsrun = f"target/{a.profile}/gdsconv", f"target/{a.profile}/gdsrun"
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="bench-quant-"))
    work.mkdir(parents=True, exist_ok=True)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    commit = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    print(f"# bench-quant: commit {commit}, {cpu}, text {a.text}, calibration {a.calib}, "
          f"ctx {a.ctx}{f', {a.chunks} chunks' if a.chunks else ''}")
    chunks = ["--chunks", str(a.chunks)] if a.chunks else []
    rows = []
    for key in filter(None, a.model.split(",")):
        label, gguf = MODELS[key]
        if not pathlib.Path(gguf).exists():
            if key not in ("smollm", "gemma"):
                sys.exit(f"{gguf}: missing (scripts/synth-model.py makes it)")
            run(["./scripts/fetch-model.sh" if key == "smollm" else "./scripts/fetch-gemma.sh"])
        m = work / key
        m.mkdir(exist_ok=True)
        f16 = m / "f16.gguf"
        if not f16.exists():
            run([quantize, "--allow-requantize", gguf, f16, "F16", "2"])
        base = m / "f16.gds"
        run([gdsconv, "convert", f16, base, "--quant", "keep", "--force"])
        logits = m / "f16.logits"
        t0 = time.time()
        b = json.loads(run([gdsrun, "perplexity", base, "-f", a.text, "--ctx", str(a.ctx),
                            *chunks, "--save-logits", logits, "--json"]).stdout)
        print(f"\n## {label}: F16 PPL {b['ppl']:.4f} over {b['scored']} tokens "
              f"({time.time() - t0:.0f} s), {bits_per_weight(gdsconv, base):.2f} bits/weight")
        imatrix = m / "imatrix.gguf"
        run([gdsrun, "imatrix", base, "--file", a.calib, "-o", imatrix, "--ctx", str(a.ctx)])
        print("| type | imatrix | tool | bits/weight | mean KL | p99 KL | same top-1 % | PPL ratio | KL ours/theirs |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for q in a.types.split(","):
            for imx in [False, True]:
                tag = f"{q}{'-imatrix' if imx else ''}"
                imx_flag = ["--imatrix", imatrix] if imx else []
                ref_gguf = m / f"llama-{tag}.gguf"
                run([quantize, *imx_flag, f16, ref_gguf, LLAMA_TYPE[q], "2"])
                theirs = m / f"llama-{tag}.gds"
                run([gdsconv, "convert", ref_gguf, theirs, "--quant", "keep", "--force"])
                ours = m / f"ours-{tag}.gds"
                run([gdsconv, "convert", f16, ours, "--quant", q, "--force", *imx_flag])
                got = {}
                for tool, model in [("gdsconv", ours), ("llama-quantize", theirs)]:
                    r = json.loads(run([gdsrun, "perplexity", model, "-f", a.text, "--ctx",
                                        str(a.ctx), *chunks, "--kl-divergence", logits,
                                        "--json"]).stdout)
                    k = r["kl"]
                    got[tool] = dict(model=label, type=q, imatrix=imx, tool=tool,
                                     bpw=bits_per_weight(gdsconv, model), kl=k["mean"],
                                     kl_stderr=k["mean_stderr"], kl_p99=k["p99"],
                                     top1=k["top1_percent"], ppl_ratio=k["ppl_ratio"])
                ratio = got["gdsconv"]["kl"] / got["llama-quantize"]["kl"]
                for tool, g in got.items():
                    g["kl_ratio"] = ratio
                    rows.append(g)
                    print(f"| {q} | {'yes' if imx else 'no'} | {tool} | {g['bpw']:.3f} | "
                          f"{g['kl']:.5f} ± {g['kl_stderr']:.5f} | {g['kl_p99']:.4f} | "
                          f"{g['top1']:.2f} | {g['ppl_ratio']:.4f} | "
                          f"{f'{ratio:.3f}' if tool == 'gdsconv' else ''} |", flush=True)
    if a.speed:
        speed(a, gdsconv, quantize, work)
    worst = max((r["kl_ratio"] for r in rows), default=1.0)
    ppl = max((abs(r["ppl_ratio"] / o["ppl_ratio"] - 1) for r in rows for o in rows
               if r["tool"] == "gdsconv" and o["tool"] == "llama-quantize"
               and (r["model"], r["type"], r["imatrix"]) == (o["model"], o["type"], o["imatrix"])),
              default=0.0)
    print(f"\nworst KL ratio ours/llama-quantize {worst:.3f} (bar 1.02); largest perplexity "
          f"difference {100 * ppl:.2f} % (bar 0.5 %)")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
