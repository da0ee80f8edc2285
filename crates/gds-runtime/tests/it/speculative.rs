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
