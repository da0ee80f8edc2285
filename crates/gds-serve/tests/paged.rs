//! The paged KV cache gives the same logits as the contiguous one, on the real SmolLM2:
//! prompts spread over scattered blocks, several sequences in one batch, a shared prefix.

use gds_runtime::{Batch, KvCache, KvDtype, Model, Plan, PlanOptions, RunState};

fn model() -> (Plan, Model) {
    let plan = Plan::build(&PlanOptions {
        model_dir: gds_tests::smollm_converted().to_path_buf(),
        ctx: Some(128),
        threads: Some(2),
        ..Default::default()
    })
    .expect("plan");
    let m = Model::open(&plan).expect("model");
    (plan, m)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn paged_attention_matches_contiguous() {
    let (plan, m) = model();
    let c = &m.config;
    let vocab = c.vocab_size;
    let prompts: [Vec<u32>; 2] = [
        (0..45).map(|i| 100 + i * 7).collect(),
        (0..45)
            .map(|i| if i < 32 { 100 + i * 7 } else { 900 + i })
            .collect(),
    ];

    // reference: one contiguous sequence at a time
    let mut want = Vec::new();
    for p in &prompts {
        let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, plan.ctx, c.kv_dim());
        let mut st = RunState::new(c, 64, 1, plan.ctx, 2);
        let mut b = Batch::with_capacity(64);
        for (i, &t) in p.iter().enumerate() {
            b.push(t, i, 0, i + 1 == p.len());
        }
        m.forward(&mut st, &mut kv, &b).unwrap();
        want.push(st.logits(0, vocab).to_vec());
    }

    // paged: blocks of 16, handed out in a scattered order, both sequences in one batch,
    // the second one sharing the first one's first two blocks (its first 32 tokens)
    let mut kv = KvCache::paged(KvDtype::F32, c.n_layers, 2, plan.ctx, c.kv_dim(), 16, 12);
    let mut spare = Vec::new();
    for _ in 0..5 {
        spare.push(kv.alloc().unwrap()); // blocks 0..5 taken out of order below
    }
    for &b in &[spare[4], spare[1], spare[3]] {
        kv.push_block(0, b);
    }
    // sequence 0 first computes its prompt alone
    let mut st = RunState::new(c, 128, 2, plan.ctx, 2);
    let mut b = Batch::with_capacity(128);
    for (i, &t) in prompts[0].iter().enumerate() {
        b.push(t, i, 0, i + 1 == prompts[0].len());
    }
    m.forward(&mut st, &mut kv, &b).unwrap();
    let got0 = st.logits(0, vocab).to_vec();
    assert!(
        max_diff(&got0, &want[0]) < 1e-3,
        "{}",
        max_diff(&got0, &want[0])
    );

    // sequence 1 shares the two full blocks and computes the rest; sequence 0 decodes one
    // more token in the same batch
    let shared = kv.table(0)[..2].to_vec();
    for &blk in &shared {
        kv.retain(blk);
        kv.push_block(1, blk);
    }
    kv.push_block(1, spare[0]);
    b.clear();
    b.push(5, prompts[0].len(), 0, true);
    for (i, &t) in prompts[1].iter().enumerate().skip(32) {
        b.push(t, i, 1, i + 1 == prompts[1].len());
    }
    m.forward(&mut st, &mut kv, &b).unwrap();
    let got1 = st.logits(1, vocab).to_vec();
    assert!(
        max_diff(&got1, &want[1]) < 1e-3,
        "{}",
        max_diff(&got1, &want[1])
    );

    // and sequence 0's extra token matches a contiguous run of prompt + that token
    let mut kvc = KvCache::new(KvDtype::F32, c.n_layers, 1, plan.ctx, c.kv_dim());
    let mut stc = RunState::new(c, 64, 1, plan.ctx, 2);
    let mut bc = Batch::with_capacity(64);
    for (i, &t) in prompts[0].iter().chain(&[5]).enumerate() {
        bc.push(t, i, 0, i == prompts[0].len());
    }
    m.forward(&mut stc, &mut kvc, &bc).unwrap();
    let d = max_diff(st.logits(0, vocab), stc.logits(0, vocab));
    assert!(d < 1e-3, "{d}");

    // a position without a block is refused, not written out of bounds
    b.clear();
    b.push(5, 80, 1, true);
    assert!(m.forward(&mut st, &mut kv, &b).is_err());
}
