//! `Engine::set_sampling` (what the Python package's per-call settings use): an engine loaded
//! with one plan's sampling and switched to another's samples the same tokens as an engine
//! loaded with the other plan, and settings the plan would refuse are refused, changing
//! nothing; `Engine::set_constraints` likewise for grammars and logprobs.

use gds_runtime::{Engine, Grammar, Plan, PlanOptions};

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

fn engine_with(grammar: Option<Grammar>, logprobs: Option<usize>) -> Engine {
    let plan = Plan::build(&PlanOptions {
        model_dir: gds_tests::smollm_converted().to_path_buf(),
        ctx: Some(128),
        threads: Some(2),
        temp: Some(0.0),
        max_tokens: Some(10),
        raw: true,
        grammar,
        logprobs,
        ..Default::default()
    })
    .unwrap();
    Engine::load(plan).unwrap()
}

/// `Engine::set_constraints` (the Python package's per-call `grammar=`, `logprobs=`): an engine
/// loaded without a grammar and switched to one replies as an engine loaded with it, logprobs
/// included; switched back it is free again; refused settings change nothing.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn switched_constraints_reply_as_a_plan_with_them() {
    let prompt = "My favourite number is";
    let grammar = Grammar::Regex("(one|two|three) apples".into());
    let want = engine_with(Some(grammar.clone()), Some(2))
        .generate(prompt, &mut |_| {})
        .unwrap();
    assert!(want.logprobs.is_some());
    let mut e = engine_with(None, None);
    let free = e.generate(prompt, &mut |_| {}).unwrap();
    e.set_constraints(Some(grammar.clone()), Some(2)).unwrap();
    let got = e.generate(prompt, &mut |_| {}).unwrap();
    assert_eq!(got.text, want.text);
    assert!(
        ["one apples", "two apples", "three apples"].contains(&got.text.as_str()),
        "{}",
        got.text
    );
    let (g, w) = (got.logprobs.unwrap(), want.logprobs.unwrap());
    assert_eq!(g.len(), w.len());
    for (g, w) in g.iter().zip(&w) {
        assert!((g.logprob - w.logprob).abs() < 1e-4, "{g:?} vs {w:?}");
        assert_eq!(g.top.len(), 2);
    }
    // refused: a grammar that does not compile, too many alternatives
    assert!(e
        .set_constraints(Some(Grammar::Lark("start: (".into())), None)
        .is_err());
    assert!(e.set_constraints(None, Some(21)).is_err());
    assert_eq!(e.plan().grammar.as_ref(), Some(&grammar));
    assert_eq!(e.plan().logprobs, Some(2));
    // and back: the free reply again, no logprobs
    e.set_constraints(None, None).unwrap();
    let again = e.generate(prompt, &mut |_| {}).unwrap();
    assert_eq!(
        (again.tokens, again.logprobs.is_none()),
        (free.tokens, true)
    );
}
