#!/usr/bin/env python3
"""lm-evaluation-harness (PyPI lm-eval) against `gdsrun serve`, compared with a reference.

    python3 tests/py/lm_eval_check.py BASE_URL GOLDEN.json [--out DIR] [--save FILE]
        [--model-args K=V,...]

Runs the local tasks of fixtures/lm-eval (gds_mc: 40 multiple-choice questions, 160
loglikelihood requests scored through /v1/completions with echo and logprobs; gds_gen: 16
greedy generations) with lm-eval's `local-completions` model against BASE_URL (e.g.
http://127.0.0.1:8080/v1), batch size 8 (so prompts go out as lists of token-id lists), the
tokenizer taken from the server itself (/tokenizer_info, /tokenize: lm-eval detects them).
Must run from the repository root (the task files name their data relative to it).

Prints one JSON object comparing the run with GOLDEN (written by
scripts/reference/lm_eval_golden.py from lm-eval's `hf` backend on the same weights):
per-choice log-likelihood differences, the items whose chosen answer differs, the
generations that differ, and both sides' accuracies. The caller decides what is close
enough (crates/gds-serve/tests/it/lm_eval.rs).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = "gds_mc,gds_gen"


# lm-eval's CLI (`python -m lm_eval`), with one change: its TaskManager does not index the
# ~15k task configurations lm-eval ships (include_defaults=False; ~20 s of CPU on the 2-core
# VM, for tasks these runs never use). Only the local tasks of --include_path exist then.
CLI = """
import sys
import lm_eval.tasks
_init = lm_eval.tasks.TaskManager.__init__
def _local_tasks_only(self, *a, **k):
    k.setdefault("include_defaults", False)
    _init(self, *a, **k)
lm_eval.tasks.TaskManager.__init__ = _local_tasks_only
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


def run_lm_eval(python, model, model_args, out_dir, extra_env=None, extra_args=(),
                tasks=TASKS, seed="1234"):
    """Runs lm-eval's CLI; returns the directory holding its results and samples. `seed`:
    lm-eval's python,numpy,torch,fewshot seeds (one value for all four)."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra_env or {})
    cmd = [python, "-c", CLI, "--model", model, "--model_args", model_args,
           "--batch_size", "8", "--include_path", os.path.join(ROOT, "fixtures/lm-eval"),
           "--tasks", tasks, "--log_samples", "--output_path", out_dir, "--seed", seed,
           *extra_args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        raise SystemExit(f"lm_eval exited with {p.returncode}: {' '.join(cmd)}")
    return out_dir


def extract(out_dir):
    """The per-item results of a run: log-likelihoods of every choice, generations, and the
    aggregate metrics."""
    def lines(pattern):
        files = sorted(glob.glob(os.path.join(out_dir, "**", pattern), recursive=True))
        if not files:
            return []  # a task that was not run
        with open(files[-1]) as f:
            return [json.loads(line) for line in f]

    mc = [{"doc_id": s["doc_id"], "answer": s["doc"]["answer"],
           "loglik": [float(r[0][0]) for r in s["resps"]]}
          for s in lines("samples_gds_mc_*.jsonl")]
    gen = [{"doc_id": s["doc_id"], "text": s["resps"][0][0], "exact_match": s["exact_match"]}
           for s in lines("samples_gds_gen_*.jsonl")]
    files = sorted(glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True))
    if not files:
        raise SystemExit(f"no results_*.json under {out_dir}")
    with open(files[-1]) as f:
        res = json.load(f)["results"]
    mc.sort(key=lambda x: x["doc_id"])
    gen.sort(key=lambda x: x["doc_id"])
    return {
        "mc": mc,
        "gen": gen,
        "acc": res.get("gds_mc", {}).get("acc,none"),
        "acc_norm": res.get("gds_mc", {}).get("acc_norm,none"),
        "exact_match": res.get("gds_gen", {}).get("exact_match,trimmed"),
    }


def compare(ours, ref):
    """`ours` against `ref` on the items both have."""
    if not ours["mc"]:
        ref = dict(ref, mc=[])
    diffs, choice_differs = [], []
    for a, b in zip(ours["mc"], ref["mc"], strict=True):
        assert a["doc_id"] == b["doc_id"]
        diffs += [abs(x - y) for x, y in zip(a["loglik"], b["loglik"], strict=True)]
        pick = lambda lls: max(range(len(lls)), key=lls.__getitem__)
        if pick(a["loglik"]) != pick(b["loglik"]):
            choice_differs.append(a["doc_id"])
    gen_differs = [a["doc_id"] for a, b in zip(ours["gen"], ref["gen"], strict=True)
                   if a["text"] != b["text"]]
    return {
        "n_mc": len(ours["mc"]),
        "n_loglik": len(diffs),
        "n_gen": len(ours["gen"]),
        "loglik_max_abs_diff": max(diffs, default=None),
        "loglik_mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
        "choice_differs": choice_differs,
        "gen_differs": gen_differs,
        "acc": ours["acc"], "ref_acc": ref["acc"],
        "acc_norm": ours["acc_norm"], "ref_acc_norm": ref["acc_norm"],
        "exact_match": ours["exact_match"], "ref_exact_match": ref["exact_match"],
        "generations": [g["text"] for g in ours["gen"]],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base_url")
    ap.add_argument("golden")
    ap.add_argument("--out", help="keep lm-eval's output here (default: a temporary dir)")
    ap.add_argument("--tasks", default=TASKS, help=f"default {TASKS}")
    ap.add_argument("--save", help="also write this run's per-item results (GOLDEN's format)")
    ap.add_argument("--model-args", default="",
                    help="more local-completions arguments, e.g. for a server without "
                    "/tokenize: tokenizer_backend=huggingface,tokenizer=HF_DIR")
    a = ap.parse_args()
    base = a.base_url.rstrip("/")
    model_args = (f"base_url={base}/completions,model=gds,num_concurrent=1,max_retries=1,"
                  "timeout=120")
    if a.model_args:
        model_args += "," + a.model_args
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or tmp
        # no torch seed: lm-eval would import torch to set it (seconds, for an API model
        # that never uses it), and scripts/test.sh may still be installing torch meanwhile
        run_lm_eval(sys.executable, "local-completions", model_args, out, tasks=a.tasks,
                    seed="1234,1234,None,1234")
        ours = extract(out)
    if a.save:
        with open(a.save, "w") as f:
            json.dump(ours, f, indent=1)
    with open(a.golden) as f:
        ref = json.load(f)
    print(json.dumps(compare(ours, ref), indent=1))


if __name__ == "__main__":
    main()
