//! Speculative decoding keeps the sampled output itself, not only its distribution: every
//! token is drawn from the model's logits at its position with the same random draws, so for
//! each seed the text with `--draft ngram` (or `layers:N`) is the text without it. Checked
//! over 24 seeds of temperature-1 sampling on the real SmolLM2 (a prompt the reply tends to
//! quote, so that guesses are both accepted and rejected), 8 of them with self-speculation
//! too, and the draft must have been used.

use gds_runtime::{Engine, Plan, PlanOptions, SamplerConfig};

fn engine(seed: u64, draft: Option<&str>) -> Engine {
    let plan = Plan::build(&PlanOptions {
        model_dir: gds_tests::smollm_converted().to_path_buf(),
        ctx: Some(256),
        threads: Some(2),
        temp: Some(1.0),
        top_k: Some(0),
        top_p: Some(1.0),
        min_p: Some(0.0),
        seed: Some(seed),
        max_tokens: Some(24),
        raw: true,
        draft: draft.map(str::to_string),
        draft_max: draft.map(|_| 6),
        ..Default::default()
    })
    .unwrap();
    Engine::load(plan).unwrap()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn every_seed_samples_the_same_tokens_with_and_without_the_draft() {
    let prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the";
    for (draft, seeds) in [("ngram", 24), ("layers:29", 8)] {
        let (mut drafted, mut accepted) = (0, 0);
        // one engine of each kind, reseeded before each reply (set_sampling, as the Python
        // package does per request): the prompt's cache is reused from the second reply on,
        // after the previous reply's rejected guesses
        let (mut plain_engine, mut spec_engine) = (engine(0, None), engine(0, Some(draft)));
        for seed in 0..seeds {
            for e in [&mut plain_engine, &mut spec_engine] {
                let sampler = SamplerConfig {
                    seed,
                    ..e.plan().sampler.clone()
                };
                let limits = e.plan().limits.clone();
                e.set_sampling(sampler, limits).unwrap();
            }
            let plain = plain_engine.generate(prompt, &mut |_| {}).unwrap();
            let spec = spec_engine.generate(prompt, &mut |_| {}).unwrap();
            assert_eq!(plain.tokens, spec.tokens, "{draft}, seed {seed}");
            assert_eq!(plain.text, spec.text, "{draft}, seed {seed}");
            drafted += spec.metrics.draft_tokens;
            accepted += spec.metrics.draft_accepted;
        }
        eprintln!("{draft}: {accepted}/{drafted} guesses accepted over {seeds} seeds");
        assert!(accepted > 0, "{draft}: no guess was ever accepted");
        assert!(accepted < drafted, "{draft}: no guess was ever rejected");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_plan_records_the_draft_gate_and_the_kernels_isa() {
    let opts = |draft: Option<&str>, gate: Option<bool>| PlanOptions {
        model_dir: gds_tests::smollm_converted().to_path_buf(),
        ctx: Some(256),
        raw: true,
        draft: draft.map(str::to_string),
        draft_gate: gate,
        // the best this CPU has (a narrower cap would change the kernels under the other
        // tests of this binary: it is process-wide)
        isa: Some(gds_kernels::Isa::best_up_to(None)),
        ..Default::default()
    };
    let off = Plan::build(&opts(Some("ngram"), Some(false))).unwrap();
    assert!(!off.draft.as_ref().unwrap().gate);
    let json: serde_json::Value = serde_json::from_str(&off.to_json()).unwrap();
    assert_eq!(json["draft"]["gate"], false, "{json}");
    assert_eq!(
        json["isa"],
        gds_kernels::Isa::best_up_to(None).name(),
        "{json}"
    );
    assert_eq!(off.isa, gds_kernels::Isa::best());
    let on = Plan::build(&opts(Some("ngram"), Some(true))).unwrap();
    assert!(on.draft.as_ref().unwrap().gate);
    let e = Plan::build(&opts(None, Some(false)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--draft-gate needs --draft"), "{e}");
}

/// `--draft-max` past the batch is refused, however large (2^64 - 1 wrapped past the check
/// `max + 1 > batch` and ran); and `--mem-budget` counts a `--draft-model`'s weights: one
/// budget for both, refused below the smallest that holds the draft beside the model's
/// working set, naming it (the draft was mapped whole outside the budget: 312 MiB of RSS
/// under `--mem-budget 5MB`).
#[test]
fn draft_limits_are_checked_without_overflow_and_the_budget_counts_the_draft_model() {
    let (_tmp, dir) = gds_tests::converted_fixture("tiny-llama.gguf");
    let opts = |draft_max: Option<usize>, budget: Option<u64>| PlanOptions {
        model_dir: dir.clone(),
        ctx: Some(64),
        threads: Some(1),
        raw: true,
        draft_model: Some(dir.clone()),
        draft_max,
        mem_budget: budget,
        no_verify: true,
        ..Default::default()
    };
    for max in [usize::MAX, usize::MAX - 1, 64, 0] {
        let e = Plan::build(&opts(Some(max), None)).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "--draft-max {max} must be between 1 and --batch - 1"
            )),
            "{e}"
        );
    }
    let free = Plan::build(&opts(Some(4), None)).unwrap();
    let draft = free.draft.as_ref().unwrap().model_plan.as_ref().unwrap();
    let held = draft.io_plan.held_bytes;
    assert!(held > 0);
    assert_eq!(free.weights_held_bytes(), free.io_plan.held_bytes + held);
    let smallest = held + free.io_plan.min_budget_bytes;
    for short in [1, held, smallest - 1] {
        let e = Plan::build(&opts(Some(4), Some(short)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("with --draft-model")
                && e.contains(&format!("the smallest budget for both is {smallest} bytes")),
            "{short}: {e}"
        );
    }
    let p = Plan::build(&opts(Some(4), Some(smallest))).unwrap();
    assert!(p.weights_held_bytes() <= smallest, "{:?}", p.io_plan);
    assert_eq!(p.io_plan.budget_bytes, Some(smallest - held));
}
