//! gds-runtime: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod architectures;
mod attention;
mod constraint;
mod executor;
mod reference;
mod rerank;
mod sampling;
mod speculative;
mod streaming;
mod tokenizer;
mod window_ring;

use gds_runtime::{Batch, KvCache, Model, RunState};

/// Evaluates `tokens` at positions `pos0..` of sequence 0 of `kv` through `model`'s forward
/// pass, teacher-forced, in passes of `state.max_batch()` tokens, calling `f(position,
/// logits)` for every position in `want` (at most `state`'s logit rows a pass).
#[allow(clippy::too_many_arguments)]
pub fn eval_positions(
    model: &Model,
    state: &mut RunState,
    kv: &mut KvCache,
    batch: &mut Batch,
    tokens: &[u32],
    pos0: usize,
    want: std::ops::Range<usize>,
    f: &mut dyn FnMut(usize, &[f32]),
) {
    let vocab = model.config.vocab_size;
    let step = state.max_batch().max(1);
    for (ci, chunk) in tokens.chunks(step).enumerate() {
        batch.clear();
        let start = pos0 + ci * step;
        for (i, &t) in chunk.iter().enumerate() {
            batch.push(t, start + i, 0, want.contains(&(start + i)));
        }
        model.forward(state, kv, batch).unwrap();
        let wanted = (start..start + chunk.len()).filter(|p| want.contains(p));
        for (j, p) in wanted.enumerate() {
            f(p, state.logits(j, vocab));
        }
    }
}
