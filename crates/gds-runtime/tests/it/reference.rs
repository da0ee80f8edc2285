//! Correctness against fixtures/reference: teacher-forced logits of transformers (float32,
//! dequantized GGUF weights) over the SmolLM2 GGUF, converted here into a temporary
//! GdsLLM directory.
//!
//! Thresholds. The matmul kernels quantize activations to 8 bits for integer dot products,
//! as llama.cpp does; llama.cpp itself agrees with this reference on top-1 for 96.9% of
//! positions with mean KL 0.014 (fixtures/reference/llamacpp_vs_transformers.json, the
//! longer wiki-like text). Every disagreement we see is a near tie (the reference ranks our
//! pick within 0.203 nats of its own: bench/runs/2026-12-05-correctness-figures.md), so
//! which side of the tie wins moves with kernel details. We require: top-1 >= 95%, >= 99%
//! when a pick within 0.25 nats of the
//! reference's top-1 counts as agreeing, and mean KL < 0.01 (measured: 96-97%, 100%, 0.002
//! over 304 positions); perplexity within 1% of
//! transformers', and for the first 8 rows in full: same top-1, KL < 0.02 and no
//! log-probability of a token with p > 1e-4 off by more than 0.75 (llama.cpp's worst on the
//! true token: 0.75). Measured values are printed so drift shows.

use crate::eval_positions;
use gds_runtime::perplexity::log_sum_exp;
use gds_runtime::{Batch, KvCache, KvDtype, Model, RunState};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    gds_tests::root()
}

fn smollm2() -> &'static Path {
    gds_tests::smollm_converted()
}

fn json(rel: &str) -> serde_json::Value {
    let p = root().join("fixtures/reference").join(rel);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// All logits rows of a teacher-forced pass over `tokens`.
fn logits(model: &Model, tokens: &[u32], batch: usize) -> Vec<Vec<f32>> {
    logits_kv(model, tokens, batch, KvDtype::F32)
}

fn logits_kv(model: &Model, tokens: &[u32], batch: usize, kv_dtype: KvDtype) -> Vec<Vec<f32>> {
    let c = &model.config;
    let mut st = RunState::new(c, batch, batch, model.ctx(), model.threads());
    let mut kv = KvCache::new(kv_dtype, c.n_layers, 1, model.ctx(), c.kv_dim());
    let mut rows = vec![Vec::new(); tokens.len()];
    eval_positions(
        model,
        &mut st,
        &mut kv,
        &mut Batch::with_capacity(batch),
        tokens,
        0,
        0..tokens.len(),
        &mut |p, l| rows[p] = l.to_vec(),
    );
    rows
}

struct Agreement {
    top1: f64,
    top1_tie: f64,
    kl_mean: f64,
    ppl: f64,
    ref_ppl: f64,
}

/// Teacher-forced logits of `model` against the transformers reference for SmolLM2.
fn agreement(model: &Model) -> Agreement {
    let tokens = ids(&json("tokens.json")["ids"]);
    agreement_with(model, &tokens, &json("ref_logits_top20.json"))
}

/// Teacher-forced logits of `model` over `tokens` against a reference's top-k rows
/// (`top_ids`, `top_logits`, `lse`, `ppl`).
fn agreement_with(model: &Model, tokens: &[u32], refs: &serde_json::Value) -> Agreement {
    let rows = logits(model, tokens, 128);
    let (top_ids, top_logits, ref_lse) = (
        refs["top_ids"].as_array().unwrap(),
        refs["top_logits"].as_array().unwrap(),
        floats(&refs["lse"]),
    );
    const TIE: f64 = 0.25;
    let (mut agree, mut agree_or_tie, mut kl_sum, mut kl_max, mut nll) =
        (0usize, 0usize, 0.0f64, 0.0f64, 0.0f64);
    for (i, row) in rows.iter().enumerate() {
        let (rid, rlog) = (ids(&top_ids[i]), floats(&top_logits[i]));
        let lse = log_sum_exp(row);
        let ours = gds_runtime::ops::argmax(row) as u32;
        agree += usize::from(ours == rid[0]);
        // a disagreement where the reference itself ranks our pick within `TIE` nats of its
        // own top-1 is a near tie that 8-bit activation noise may flip either way
        let gap = rid
            .iter()
            .position(|&id| id == ours)
            .map_or(f64::INFINITY, |k| rlog[0] - rlog[k]);
        if ours != rid[0] {
            eprintln!(
                "position {i}: ours {ours}, reference {} (reference logit gap {gap:.3})",
                rid[0]
            );
        }
        agree_or_tie += usize::from(gap <= TIE);
        // KL(ref || ours) over the top-20 support plus one bucket for the rest
        let (mut kl, mut p_in, mut q_in) = (0.0, 0.0, 0.0);
        for (&id, &l) in rid.iter().zip(&rlog) {
            let p = (l - ref_lse[i]).exp();
            let q = (row[id as usize] as f64 - lse).exp();
            kl += p * (p / q).ln();
            p_in += p;
            q_in += q;
        }
        let (p_out, q_out) = ((1.0 - p_in).max(1e-12), (1.0 - q_in).max(1e-12));
        kl += p_out * (p_out / q_out).ln();
        kl_sum += kl;
        kl_max = kl_max.max(kl);
        if i + 1 < tokens.len() {
            nll += lse - row[tokens[i + 1] as usize] as f64;
        }
    }
    let n = rows.len() as f64;
    let (top1, kl_mean) = (agree as f64 / n, kl_sum / n);
    let ppl = (nll / (n - 1.0)).exp();
    let ref_ppl = refs["ppl"].as_f64().unwrap();
    assert_eq!(rows.len(), top_ids.len(), "one reference row per position");
    let top1_tie = agree_or_tie as f64 / n;
    eprintln!("top-1 agreement {top1:.4} ({agree}/{n}), counting near ties {top1_tie:.4}, mean KL {kl_mean:.5}, max KL {kl_max:.4}, ppl {ppl:.4} vs transformers {ref_ppl:.4}");
    Agreement {
        top1,
        top1_tie,
        kl_mean,
        ppl,
        ref_ppl,
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn teacher_forced_logits_match_transformers() {
    let model = Model::load(smollm2(), 512, 2).unwrap();
    let Agreement {
        top1,
        top1_tie,
        kl_mean,
        ppl,
        ref_ppl,
    } = agreement(&model);
    assert!(top1 >= 0.95, "top-1 agreement {top1}");
    assert!(
        top1_tie >= 0.99,
        "top-1 agreement counting near ties {top1_tie}"
    );
    assert!(kl_mean < 0.01, "mean KL {kl_mean}");
    assert!((ppl / ref_ppl - 1.0).abs() < 0.01, "ppl {ppl} vs {ref_ppl}");
}

/// With f32 activations (`--activations f32`) the arithmetic is the reference's own
/// (dequantized weights times float activations), so the near ties no longer flip.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn f32_activations_agree_with_transformers_on_top1_for_99_percent() {
    let mut model = Model::load(smollm2(), 512, 2).unwrap();
    model.set_f32_activations(true);
    let a = agreement(&model);
    assert!(a.top1 >= 0.99, "top-1 agreement {}", a.top1);
    assert!(a.kl_mean < 1e-4, "mean KL {}", a.kl_mean);
    assert!(
        (a.ppl / a.ref_ppl - 1.0).abs() < 1e-4,
        "ppl {} vs {}",
        a.ppl,
        a.ref_ppl
    );
}

/// The safetensors path: SmolLM2 dequantized to an F16 Hugging Face directory, converted,
/// run with f32 activations, agrees with transformers (whose float32 weights are the same
/// dequantized values, before the F16 rounding).
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn safetensors_f16_conversion_agrees_with_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf.gds");
    gds_convert::convert(
        &gds_tests::smollm_hf_f16(),
        &out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .expect("convert the HF directory");
    let mut model = Model::load(&out, 512, 2).unwrap();
    model.set_f32_activations(true);
    let a = agreement(&model);
    assert!(a.top1 >= 0.99, "top-1 agreement {}", a.top1);
    assert!(a.kl_mean < 1e-3, "mean KL {}", a.kl_mean);
    assert!(
        (a.ppl / a.ref_ppl - 1.0).abs() < 0.002,
        "ppl {} vs {}",
        a.ppl,
        a.ref_ppl
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn first_rows_match_transformers_in_full() {
    let tokens = ids(&json("tokens.json")["ids"]);
    let bytes = std::fs::read(root().join("fixtures/reference/ref_logits_first8.f32.bin")).unwrap();
    let vocab = 49152;
    let reference: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(reference.len(), 8 * vocab);
    let model = Model::load(smollm2(), 64, 2).unwrap();
    let rows = logits(&model, &tokens[..8], 8);
    let (mut worst, mut worst_kl, mut top1) = (0.0f64, 0.0f64, 0usize);
    for (i, row) in rows.iter().enumerate() {
        let r = &reference[i * vocab..(i + 1) * vocab];
        let (lse, rlse) = (log_sum_exp(row), log_sum_exp(r));
        // compare log-probabilities of every token the reference gives p > 1e-4
        let mut max_diff = 0.0f64;
        for (a, b) in row.iter().zip(r) {
            let (la, lb) = (*a as f64 - lse, *b as f64 - rlse);
            if lb > -9.2 {
                max_diff = max_diff.max((la - lb).abs());
            }
        }
        let mean_abs: f64 = row
            .iter()
            .zip(r)
            .map(|(a, b)| ((*a as f64 - lse) - (*b as f64 - rlse)).abs())
            .sum::<f64>()
            / vocab as f64;
        let (am, rm) = (gds_runtime::ops::argmax(row), gds_runtime::ops::argmax(r));
        let kl: f64 = row
            .iter()
            .zip(r)
            .map(|(a, b)| {
                let (la, lb) = (*a as f64 - lse, *b as f64 - rlse);
                lb.exp() * (lb - la)
            })
            .sum();
        eprintln!("row {i}: KL {kl:.5}, max |dlogprob| (p>1e-4) {max_diff:.4}, mean |dlogprob| {mean_abs:.4}, top-1 {am} vs {rm}");
        worst = worst.max(max_diff);
        worst_kl = worst_kl.max(kl);
        top1 += usize::from(am == rm);
    }
    assert_eq!(top1, 8, "top-1 must agree on every one of the first rows");
    assert!(worst_kl < 0.02, "worst row KL {worst_kl}");
    assert!(worst < 0.75, "max |dlogprob| {worst}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn batched_prefill_equals_token_by_token_decode() {
    let tokens = ids(&json("tokens.json")["ids"]);
    let model = Model::load(smollm2(), 64, 2).unwrap();
    let batched = logits(&model, &tokens[..24], 24);
    let single = logits(&model, &tokens[..24], 1);
    for (i, (a, b)) in batched.iter().zip(&single).enumerate() {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            d < 1e-2,
            "position {i}: batched and single-token logits differ by {d}"
        );
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn f16_kv_cache_stays_close_to_f32() {
    let tokens = ids(&json("tokens.json")["ids"]);
    let model = Model::load(smollm2(), 512, 2).unwrap();
    let a = logits_kv(&model, &tokens, 128, KvDtype::F32);
    let b = logits_kv(&model, &tokens, 128, KvDtype::F16);
    let (mut agree, mut kl_sum) = (0usize, 0.0f64);
    for (x, y) in a.iter().zip(&b) {
        agree += usize::from(gds_runtime::ops::argmax(x) == gds_runtime::ops::argmax(y));
        let (lx, ly) = (log_sum_exp(x), log_sum_exp(y));
        kl_sum += x
            .iter()
            .zip(y)
            .map(|(&p, &q)| {
                let (lp, lq) = (p as f64 - lx, q as f64 - ly);
                lp.exp() * (lp - lq)
            })
            .sum::<f64>();
    }
    let (top1, kl) = (agree as f64 / a.len() as f64, kl_sum / a.len() as f64);
    eprintln!("f16 vs f32 KV cache: top-1 agreement {top1:.4}, mean KL {kl:.6}");
    // measured: 97.4% and 0.003, the same order as the 8-bit activation error against
    // transformers; f16 is llama.cpp's default cache type
    assert!(top1 >= 0.95 && kl < 0.01, "top-1 {top1}, KL {kl}");
}

// ------------------------------------------------------------------------------------------
// Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 weights) against transformers
// (fixtures/reference/gemma3/, made by scripts/reference/ref_logits_gemma3.py)

fn gemma3() -> &'static Path {
    gds_tests::gemma_converted()
}

/// f32 activations: the reference's own arithmetic on the same dequantized weights.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gemma3_f32_activations_agree_with_transformers() {
    let mut model = Model::load(gemma3(), 512, 2).unwrap();
    model.set_f32_activations(true);
    let tokens = ids(&json("gemma3/tokens.json")["ids"]);
    assert_eq!(tokens[0], 2, "the reference starts with Gemma's BOS");
    let a = agreement_with(&model, &tokens, &json("gemma3/ref_logits_top20.json"));
    assert!(a.top1 >= 0.99, "top-1 agreement {}", a.top1);
    assert!(a.kl_mean < 1e-4, "mean KL {}", a.kl_mean);
    assert!(
        (a.ppl / a.ref_ppl - 1.0).abs() < 0.002,
        "ppl {} vs {}",
        a.ppl,
        a.ref_ppl
    );
}

/// The default 8-bit activations (llama.cpp's arithmetic) stay close to the reference.
/// Perplexity over these 296 tokens moves with the float order of attention under q8, which
/// re-rounds every layer's input (measured: 21.1715 on 2026-12-05,
/// bench/runs/2026-12-05-correctness-figures.md; 21.152 and 21.298 for two other orders of
/// the same sums; transformers 20.932), while against llama.cpp's own q8 arithmetic every
/// order stays within 0.35 % (`gdsrun` tests): the bound here is 2 %; f32 activations are
/// held to 0.2 % above.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gemma3_q8_activations_stay_close_to_transformers() {
    let model = Model::load(gemma3(), 512, 2).unwrap();
    let tokens = ids(&json("gemma3/tokens.json")["ids"]);
    let a = agreement_with(&model, &tokens, &json("gemma3/ref_logits_top20.json"));
    assert!(a.top1 >= 0.95, "top-1 agreement {}", a.top1);
    assert!(a.top1_tie >= 0.99, "counting near ties {}", a.top1_tie);
    assert!(a.kl_mean < 0.01, "mean KL {}", a.kl_mean);
    assert!(
        (a.ppl / a.ref_ppl - 1.0).abs() < 0.02,
        "ppl {} vs {}",
        a.ppl,
        a.ref_ppl
    );
}

/// 1 100 positions: past position 512 the 15 window layers drop keys (window 512), which
/// changes the logits by up to 50 (fixtures/reference/gemma3/ref_long_swa.json); agreeing
/// there means the window, its RoPE base and the global layers are right.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn gemma3_sliding_window_matches_transformers_past_the_window() {
    let mut model = Model::load(gemma3(), 1152, 2).unwrap();
    model.set_f32_activations(true);
    let refs = json("gemma3/ref_long_swa.json");
    let wiki = ids(&json("gemma3/wiki_tokens.json"));
    let n = refs["n_positions"].as_u64().unwrap() as usize;
    let tokens: Vec<u32> = std::iter::once(2)
        .chain(wiki[..n - 1].iter().copied())
        .collect();
    let a = agreement_with(&model, &tokens, &refs);
    assert!(a.top1 >= 0.99, "top-1 agreement {}", a.top1);
    assert!(
        (a.ppl / a.ref_ppl - 1.0).abs() < 0.002,
        "ppl {} vs {}",
        a.ppl,
        a.ref_ppl
    );
}
