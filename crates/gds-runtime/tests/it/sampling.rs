//! `Engine::set_sampling` (what the Python package's per-call settings use): an engine loaded
//! with one plan's sampling and switched to another's samples the same tokens as an engine
//! loaded with the other plan, and settings the plan would refuse are refused, changing
//! nothing.

use gds_runtime::{Engine, Plan, PlanOptions};

fn engine(seed: u64, temp: f32, max_tokens: usize) -> Engine {
    let plan = Plan::build(&PlanOptions {
        model_dir: gds_tests::smollm_converted().to_path_buf(),
        ctx: Some(128),
        threads: Some(2),
        temp: Some(temp),
        top_k: Some(0),
        seed: Some(seed),
        max_tokens: Some(max_tokens),
        raw: true,
        ..Default::default()
    })
    .unwrap();
    Engine::load(plan).unwrap()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn switched_sampling_samples_as_a_plan_with_it() {
    let prompt = "Once upon a time";
    let want = engine(11, 1.0, 12).generate(prompt, &mut |_| {}).unwrap();
    let mut e = engine(3, 0.0, 4);
    let greedy = e.generate(prompt, &mut |_| {}).unwrap();
    assert_eq!(greedy.tokens.len(), 4);
    let target = engine(11, 1.0, 12);
    let (sampler, limits) = (target.plan().sampler.clone(), target.plan().limits.clone());
    drop(target);
    e.set_sampling(sampler.clone(), limits.clone()).unwrap();
    let got = e.generate(prompt, &mut |_| {}).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert_ne!(
        got.tokens[..4],
        greedy.tokens[..],
        "temperature 1 sampled the greedy reply"
    );
    // refused: the plan keeps the settings in force
    let mut bad = sampler.clone();
    bad.top_p = 2.0;
    assert!(e.set_sampling(bad, limits.clone()).is_err());
    let mut none = limits.clone();
    none.max_tokens = Some(0);
    assert!(e.set_sampling(sampler.clone(), none).is_err());
    assert_eq!((&e.plan().sampler, &e.plan().limits), (&sampler, &limits));
}
