//! Speculative decoding keeps the sampled output itself, not only its distribution: every
//! token is drawn from the model's logits at its position with the same random draws, so for
//! each seed the text with `--draft ngram` is the text without it. Checked over 24 seeds of
//! temperature-1 sampling on the real SmolLM2 (a prompt the reply tends to quote, so that
//! guesses are both accepted and rejected), and the draft must have been used.

use gds_runtime::{Engine, Plan, PlanOptions};

fn engine(seed: u64, draft: bool) -> Engine {
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
        draft: draft.then(|| "ngram".to_string()),
        draft_max: draft.then_some(6),
        ..Default::default()
    })
    .unwrap();
    Engine::load(plan).unwrap()
}

#[test]
fn every_seed_samples_the_same_tokens_with_and_without_the_draft() {
    let prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the";
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..24 {
        let plain = engine(seed, false).generate(prompt, &mut |_| {}).unwrap();
        let spec = engine(seed, true).generate(prompt, &mut |_| {}).unwrap();
        assert_eq!(plain.tokens, spec.tokens, "seed {seed}");
        assert_eq!(plain.text, spec.text, "seed {seed}");
        drafted += spec.metrics.draft_tokens;
        accepted += spec.metrics.draft_accepted;
    }
    eprintln!("{accepted}/{drafted} guesses accepted over 24 seeds");
    assert!(accepted > 0, "no guess was ever accepted");
    assert!(accepted < drafted, "no guess was ever rejected");
}
