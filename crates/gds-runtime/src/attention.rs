//! Attention of one layer over the KV cache: store the batch's keys and values, then causal
//! attention for every (token, head) of the batch.
//!
//! Kept apart from the forward pass so the cache's layout (today one contiguous run of
//! positions per sequence) can change without touching the model code: the model hands over
//! the batch's Q/K/V rows in [`RunState`] and gets the attention output back in it.

use crate::config::Config;
use crate::kv::{KvCache, KvData, KvElem};
use crate::model::{Batch, RunState};
use crate::ops;
use rayon::prelude::*;

/// Runs attention of layer `l` for `batch`: writes the batch's K/V rows (`s.k`, `s.v`) into
/// the cache and the attention output into `s.att`. `simd` selects the AVX2 kernels.
pub(crate) fn layer(
    c: &Config,
    simd: bool,
    s: &mut RunState,
    kv: &mut KvCache,
    l: usize,
    batch: &Batch,
) {
    let (layer_len, kv_ctx) = (kv.layer_len(), kv.ctx());
    let range = l * layer_len..(l + 1) * layer_len;
    match (&mut kv.k, &mut kv.v) {
        (KvData::F32(k), KvData::F32(v)) => attend(
            c,
            simd,
            s,
            &mut k[range.clone()],
            &mut v[range],
            batch,
            kv_ctx,
        ),
        (KvData::F16(k), KvData::F16(v)) => attend(
            c,
            simd,
            s,
            &mut k[range.clone()],
            &mut v[range],
            batch,
            kv_ctx,
        ),
        _ => unreachable!("K and V share one dtype"),
    }
}

/// Stores the batch's K/V rows in the cache, then computes causal attention for every
/// (token, head), split over the pool in contiguous runs.
fn attend<T: KvElem>(
    c: &Config,
    simd: bool,
    s: &mut RunState,
    kc: &mut [T],
    vc: &mut [T],
    batch: &Batch,
    ctx: usize,
) {
    let (hd, qd, kvd, nh) = (c.head_dim, c.q_dim(), c.kv_dim(), c.n_heads);
    let group = c.n_heads / c.n_kv_heads;
    let n = batch.len();
    for t in 0..n {
        let at = (batch.seqs[t] * ctx + batch.positions[t]) * kvd;
        for (dst, &src) in kc[at..at + kvd]
            .iter_mut()
            .zip(&s.k[t * kvd..(t + 1) * kvd])
        {
            *dst = T::from_f32(src);
        }
        for (dst, &src) in vc[at..at + kvd]
            .iter_mut()
            .zip(&s.v[t * kvd..(t + 1) * kvd])
        {
            *dst = T::from_f32(src);
        }
    }
    let (kc, vc) = (&*kc, &*vc);
    let scale = 1.0 / (hd as f32).sqrt();
    let units = n * nh;
    let per = units.div_ceil(s.n_tasks);
    let q = &s.q;
    s.att[..n * qd]
        .par_chunks_mut(per * hd)
        .zip(s.scores.par_chunks_mut(ctx))
        .enumerate()
        .for_each(|(ci, (out, scores))| {
            for (k, o) in out.chunks_exact_mut(hd).enumerate() {
                let u = ci * per + k;
                let (t, h) = (u / nh, u % nh);
                let (pos, base) = (
                    batch.positions[t],
                    batch.seqs[t] * ctx * kvd + (h / group) * hd,
                );
                let qh = &q[t * qd + h * hd..t * qd + (h + 1) * hd];
                let head = ops::Head {
                    q: qh,
                    k: kc,
                    v: vc,
                    base,
                    stride: kvd,
                    n_keys: pos + 1,
                    scale,
                };
                ops::attend(simd, &head, scores, o);
            }
        });
}
