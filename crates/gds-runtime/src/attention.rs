//! Attention of one layer over the KV cache: store the batch's keys and values, then causal
//! attention for every (token, head) of the batch.
//!
//! Kept apart from the forward pass so the cache's layout can change without touching the
//! model code: the model hands over the batch's Q/K/V rows in [`RunState`] and gets the
//! attention output back in it. The cache is paged (see [`crate::kv`]): a sequence whose
//! keys all sit in one block (always the case for a contiguous cache) takes the contiguous
//! kernel; a longer paged sequence walks its block table.

use crate::config::Config;
use crate::kv::{KvCache, KvData, KvElem};
use crate::model::{Batch, RunState};
use crate::ops;
use rayon::prelude::*;

/// What differs between the attention of two layers: the query scale, the sliding window
/// (a query at position p sees keys at positions above p − window) and the score cap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Query scale.
    pub scale: f32,
    /// Sliding window, in positions.
    pub window: Option<usize>,
    /// Score cap `c·tanh(s/c)`.
    pub softcap: Option<f32>,
}

/// Runs attention of layer `l` for `batch`: writes the batch's K/V rows (`s.k`, `s.v`) into
/// the cache and the attention output into `s.att`. `simd` selects the AVX2 kernels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer(
    c: &Config,
    simd: bool,
    s: &mut RunState,
    kv: &mut KvCache,
    l: usize,
    batch: &Batch,
    p: &AttnParams,
) {
    let ctx = kv.ctx();
    let (layer_base, block, tables, k, v) = kv.layer_mut(l);
    let geo = Geometry {
        tables,
        block,
        layer_base,
        ctx,
    };
    match (k, v) {
        (KvData::F32(k), KvData::F32(v)) => attend(c, simd, s, k, v, batch, &geo, p),
        (KvData::F16(k), KvData::F16(v)) => attend(c, simd, s, k, v, batch, &geo, p),
        _ => unreachable!("K and V share one dtype"),
    }
}

/// Where a sequence's positions live.
struct Geometry<'a> {
    tables: &'a [Vec<u32>],
    block: usize,
    /// First element of this layer.
    layer_base: usize,
    /// Most positions per sequence.
    ctx: usize,
}

impl Geometry<'_> {
    /// The block holding block-index `bi` of sequence `seq` (tables shorter than the
    /// sequence are rings, indexed modulo their length).
    #[inline]
    fn slot(&self, seq: usize, bi: usize) -> u32 {
        let t = &self.tables[seq];
        t[bi % t.len()]
    }
}

/// Stores the batch's K/V rows in the cache, then computes causal attention for every
/// (token, head), split over the pool in contiguous runs.
#[allow(clippy::too_many_arguments)]
fn attend<T: KvElem>(
    c: &Config,
    simd: bool,
    s: &mut RunState,
    kc: &mut [T],
    vc: &mut [T],
    batch: &Batch,
    geo: &Geometry<'_>,
    p: &AttnParams,
) {
    let (hd, qd, kvd, nh) = (c.head_dim, c.q_dim(), c.kv_dim(), c.n_heads);
    let group = c.n_heads / c.n_kv_heads;
    let n = batch.len();
    for t in 0..n {
        let (seq, pos) = (batch.seqs[t], batch.positions[t]);
        let at = geo.layer_base
            + (geo.slot(seq, pos / geo.block) as usize * geo.block + pos % geo.block) * kvd;
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
    let (scale, softcap, window) = (p.scale, p.softcap, p.window);
    let units = n * nh;
    let per = units.div_ceil(s.n_tasks);
    let q = &s.q;
    let block = geo.block;
    let ctx = geo.ctx;
    s.att[..n * qd]
        .par_chunks_mut(per * hd)
        .zip(s.scores.par_chunks_mut(ctx))
        .enumerate()
        .for_each(|(ci, (out, scores))| {
            for (k, o) in out.chunks_exact_mut(hd).enumerate() {
                let u = ci * per + k;
                let (t, h) = (u / nh, u % nh);
                let pos = batch.positions[t];
                let table = &geo.tables[batch.seqs[t]];
                let head_off = (h / group) * hd;
                let qh = &q[t * qd + h * hd..t * qd + (h + 1) * hd];
                // keys first..=pos: all of them, or the window's
                let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                if pos < block {
                    // every key in the first block: the contiguous kernel
                    let head = ops::Head {
                        q: qh,
                        k: kc,
                        v: vc,
                        base: geo.layer_base
                            + table[0] as usize * block * kvd
                            + first * kvd
                            + head_off,
                        stride: kvd,
                        n_keys: pos + 1 - first,
                        scale,
                        softcap,
                    };
                    ops::attend(simd, &head, scores, o);
                } else {
                    let head = Paged {
                        q: qh,
                        k: kc,
                        v: vc,
                        table,
                        block,
                        layer_base: geo.layer_base,
                        head_off,
                        stride: kvd,
                        first,
                        n_keys: pos + 1,
                        scale,
                        softcap,
                    };
                    paged_attend(simd, &head, scores, o);
                }
            }
        });
}

/// One attention head of one query token over a sequence spread across blocks.
struct Paged<'a, T> {
    q: &'a [f32],
    k: &'a [T],
    v: &'a [T],
    table: &'a [u32],
    block: usize,
    layer_base: usize,
    head_off: usize,
    stride: usize,
    /// Keys attended: positions `first..n_keys`.
    first: usize,
    n_keys: usize,
    scale: f32,
    softcap: Option<f32>,
}

impl<T> Paged<'_, T> {
    /// Calls `f(j, at)` for every key `j - first` in order, `at` being the element index
    /// of its row in this head: one block at a time, so no division per key.
    #[inline(always)]
    fn for_each_key(&self, mut f: impl FnMut(usize, usize)) {
        let row = self.block * self.stride;
        // a table shorter than the sequence is a window ring: block index bi is in
        // table[bi % len] (the keys before `first` it overwrote are never read)
        let len = self.table.len();
        for bi in self.first / self.block..self.n_keys.div_ceil(self.block) {
            let start = bi * self.block;
            let b = self.table[bi % len];
            let base = self.layer_base + b as usize * row + self.head_off;
            let from = start.max(self.first);
            for j in from..self.n_keys.min(start + self.block) {
                f(j - self.first, base + (j - start) * self.stride);
            }
        }
    }
}

#[inline(always)]
fn paged_generic<T: KvElem>(h: &Paged<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    let hd = h.q.len();
    let sc = &mut scores[..h.n_keys - h.first];
    h.for_each_key(|j, at| sc[j] = ops::dot(h.q, &h.k[at..at + hd]) * h.scale);
    if let Some(c) = h.softcap {
        ops::softcap(sc, c);
    }
    ops::softmax(sc);
    out.fill(0.0);
    h.for_each_key(|j, at| ops::axpy(out, sc[j], &h.v[at..at + hd]));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn paged_avx2<T: KvElem>(h: &Paged<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    paged_generic(h, scores, out)
}

/// [`Paged`] attention; `simd` (from [`ops::simd_available`]) picks the AVX2 build.
#[inline]
fn paged_attend<T: KvElem>(simd: bool, h: &Paged<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when `simd_available()` found AVX2 and FMA on this CPU.
        unsafe { paged_avx2(h, scores, out) };
        return;
    }
    let _ = simd;
    paged_generic(h, scores, out)
}
