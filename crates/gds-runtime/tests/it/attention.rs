//! Attention at depth: a decode step (one token, few KV heads) runs each KV head's pieces of
//! keys on several threads and merges them (flash-decoding), while a prompt pass runs each
//! (token, KV head) unit's pieces one after the other. The arithmetic is the same, so the
//! logits must be bit-equal (batch invariance: speculative verification and server batches
//! give a position what a lone decode step gives it): the last position of a long sequence
//! is computed once inside one prompt pass and once as a decode step over the keys that pass
//! stored, on the real SmolLM2 (9 query heads on 3 KV heads: grouped) and the real Gemma 3
//! 270M (one KV head, window 512 on 15 layers: the pieces cover the window only), with f32
//! and f16 caches.

use gds_runtime::{Batch, KvCache, KvDtype, Model, Plan, PlanOptions, RunState};
use std::path::Path;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits of the last of `tokens`: (one pass over all of them, a decode step of the last
/// one after it). The decode step reads the keys and values the pass stored for the others
/// (and stores its own again over the pass's), so the two differ only in how attention ran.
/// (It used to run a second prompt pass of all but the last token before the step: twice
/// the work, and it also compared that shorter pass's keys with the long one's.)
fn both_ways(m: &Model, ctx: usize, tokens: &[u32], dtype: KvDtype) -> (Vec<f32>, Vec<f32>) {
    let c = &m.config;
    let n = tokens.len();
    let vocab = c.vocab_size;
    let mut kv = KvCache::new(dtype, c.n_layers, 1, ctx, c.kv_dim());
    let mut st = RunState::new(c, n, 1, ctx, 2);
    let mut b = Batch::with_capacity(n);
    for (i, &t) in tokens.iter().enumerate() {
        b.push(t, i, 0, i + 1 == n);
    }
    m.forward(&mut st, &mut kv, &b).unwrap();
    let one = st.logits(0, vocab).to_vec();
    b.clear();
    b.push(tokens[n - 1], n - 1, 0, true);
    m.forward(&mut st, &mut kv, &b).unwrap();
    (one, st.logits(0, vocab).to_vec())
}

fn check(dir: &Path, n: usize) {
    let plan = Plan::build(&PlanOptions {
        model_dir: dir.to_path_buf(),
        ctx: Some(2048),
        threads: Some(2),
        activations: Some("f32".into()),
        raw: true,
        ..Default::default()
    })
    .unwrap();
    let m = Model::open(&plan).unwrap();
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 5000 + 100).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        // (600 and 700 keys: 3 pieces of 256, the last one short; the window layers'
        // ring of 512 keys, wrapped past position 512: 2)
        let (one, split) = both_ways(&m, plan.ctx, &tokens, dtype);
        let d = max_diff(&one, &split);
        assert_eq!(d, 0.0, "{dir:?} {dtype:?}: max |logit diff| {d}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_split_decode_step_matches_the_prompt_pass_smollm2() {
    check(gds_tests::smollm_converted(), 600);
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_split_decode_step_matches_the_prompt_pass_gemma3_window() {
    check(gds_tests::gemma_converted(), 700);
}
