//! Attention of one layer over the KV cache: store the batch's keys and values, then causal
//! attention for every (token, KV head) of the batch: the query heads sharing a KV head
//! (grouped-query attention) are scored in one pass over its keys and summed in one pass
//! over its values, so each cached row is read once per group, not once per query head.
//!
//! Kept apart from the forward pass so the cache's layout can change without touching the
//! model code: the model hands over the batch's Q/K/V rows in [`Buffers`] (rows of its
//! `RunState`) and gets the attention output back in them. The cache is paged (see
//! [`crate::kv`]): attention walks a sequence's block table (one block for a contiguous
//! cache; a ring for window layers).

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod kernels;

use crate::batch::Batch;
use crate::config::Config;
use crate::kv::{KvCache, KvData};
use crate::ops;
use kernels::Lanes;
use rayon::prelude::*;

/// What differs between the attention of two layers: the query scale, the sliding window
/// (a query at position p sees keys at positions above p − window), the score cap and the
/// sinks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams<'a> {
    /// Query scale.
    pub scale: f32,
    /// Sliding window, in positions.
    pub window: Option<usize>,
    /// Score cap `c·tanh(s/c)`.
    pub softcap: Option<f32>,
    /// A logit per query head taking part in each softmax's denominator with no value
    /// (gpt-oss's attention sinks), `[n_heads]`.
    pub sinks: Option<&'a [f32]>,
}

/// The rows of a pass that attention reads and writes, borrowed from the model's
/// [`RunState`](crate::model::RunState) (attention knows nothing else of it).
pub(crate) struct Buffers<'a> {
    /// queries `[batch, n_heads * head_dim]`
    pub q: &'a [f32],
    /// keys of the batch `[batch, kv_dim]`
    pub k: &'a [f32],
    /// values of the batch `[batch, kv_dim]`
    pub v: &'a [f32],
    /// attention output `[batch, n_heads * head_dim]`
    pub att: &'a mut [f32],
    /// scratch per parallel task `[n_tasks, scratch_len]` ([`scratch_len`])
    pub scores: &'a mut [f32],
    /// partial outputs of key pieces split across threads (grown on demand)
    pub part: &'a mut Vec<f32>,
    /// parallel tasks
    pub n_tasks: usize,
}

/// Runs attention of layer `l` for `batch`: writes the batch's K/V rows (`s.k`, `s.v`) into
/// the cache and the attention output into `s.att`. `simd` (from
/// [`crate::ops::simd_available`]) selects the AVX2 kernels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer(
    c: &Config,
    simd: bool,
    s: &mut Buffers<'_>,
    kv: &mut KvCache,
    l: usize,
    batch: &Batch,
    p: &AttnParams<'_>,
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
fn attend<T: Lanes>(
    c: &Config,
    simd: bool,
    s: &mut Buffers<'_>,
    kc: &mut [T],
    vc: &mut [T],
    batch: &Batch,
    geo: &Geometry<'_>,
    p: &AttnParams<'_>,
) {
    let (hd, qd, kvd) = (c.head_dim, c.q_dim(), c.kv_dim());
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
    // the sinks of KV head g's query heads
    let sinks_of = |g: usize| p.sinks.map(|s| &s[g * group..(g + 1) * group]);
    // One unit per (token, KV head): its `group` query heads in one pass over the keys and
    // one over the values, so each K/V row is read once for the group, not once per head.
    // A unit's keys are cut into pieces of PIECE keys, each piece's (max, sum, unnormalized
    // output) merged in order: the same arithmetic whether the pieces run one after the
    // other (many units) or on several threads (a decode step: few units, long context),
    // so a position's result never depends on what else is in the batch.
    let n_kv = c.n_kv_heads;
    let units = n * n_kv;
    let q = &s.q;
    let block = geo.block;
    let scratch = scratch_len(c, geo.ctx);
    let slot = group * (hd + 2);
    // keys first..=pos of token t: all of them, or the window's
    let keys = |t: usize| {
        let pos = batch.positions[t];
        (window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos + 1)
    };
    let pieces_of = |t: usize| {
        let (first, end) = keys(t);
        (end - first).div_ceil(PIECE)
    };
    let piece = |u: usize, c: usize| {
        let (t, g) = (u / n_kv, u % n_kv);
        let qs = t * qd + g * group * hd;
        let (first, end) = keys(t);
        let from = (first + c * PIECE).min(end);
        Group {
            q: &q[qs..qs + group * hd],
            hd,
            k: kc,
            v: vc,
            table: &geo.tables[batch.seqs[t]],
            block,
            layer_base: geo.layer_base,
            head_off: g * hd,
            stride: kvd,
            first: from,
            n_keys: (from + PIECE).min(end),
            scale,
            softcap,
        }
    };
    let most = (0..n).map(pieces_of).max().unwrap_or(0);
    if units >= s.n_tasks || most <= 1 {
        // each unit on one thread, its pieces one after the other
        let per = units.div_ceil(s.n_tasks);
        s.att[..n * qd]
            .par_chunks_mut(per * group * hd)
            .zip(s.scores.par_chunks_mut(scratch))
            .enumerate()
            .for_each(|(ci, (out, scratch))| {
                let (scratch, parts) = scratch.split_at_mut(scratch.len() - most * slot);
                for (k, o) in out.chunks_exact_mut(group * hd).enumerate() {
                    let u = ci * per + k;
                    let np = pieces_of(u / n_kv);
                    for (c, sl) in parts.chunks_exact_mut(slot).take(np).enumerate() {
                        let (po, stats) = sl.split_at_mut(group * hd);
                        grouped_attend(simd, &piece(u, c), scratch, po, stats);
                    }
                    let g = u % n_kv;
                    merge(&parts[..np * slot], group, hd, sinks_of(g), o);
                }
            });
        return;
    }
    // few units, long contexts: every (unit, piece) on its own, merged after
    // (flash-decoding); pieces past a shorter unit's end are empty
    let items = units * most;
    let per = items.div_ceil(s.n_tasks);
    if s.part.len() < items * slot {
        s.part.resize(items * slot, 0.0);
    }
    s.part[..items * slot]
        .par_chunks_mut(per * slot)
        .zip(s.scores.par_chunks_mut(scratch))
        .enumerate()
        .for_each(|(ci, (part, scratch))| {
            for (k, sl) in part.chunks_exact_mut(slot).enumerate() {
                let it = ci * per + k;
                let (po, stats) = sl.split_at_mut(group * hd);
                grouped_attend(simd, &piece(it / most, it % most), scratch, po, stats);
            }
        });
    for u in 0..units {
        let (t, g) = (u / n_kv, u % n_kv);
        let np = pieces_of(t);
        let parts = &s.part[u * most * slot..][..np * slot];
        merge(
            parts,
            group,
            hd,
            sinks_of(g),
            &mut s.att[t * qd + g * group * hd..][..group * hd],
        );
    }
}

/// Keys per piece of a unit's keys (see [`attend`]).
const PIECE: usize = 256;

/// Merges the pieces of one unit, in order: each `slot` holds the unnormalized output of
/// every query head of the group, then each head's (max score, sum of exponentials). A
/// head's sink (`sinks[i]`) is a piece of its own: one score, no value.
fn merge(parts: &[f32], group: usize, hd: usize, sinks: Option<&[f32]>, out: &mut [f32]) {
    let slot = group * (hd + 2);
    for (i, o) in out.chunks_exact_mut(hd).enumerate() {
        o.fill(0.0);
        let (mut m, mut l) = match sinks {
            Some(s) => (s[i], 1.0f32),
            None => (f32::NEG_INFINITY, 0.0f32),
        };
        for sl in parts.chunks_exact(slot) {
            let (mc, lc) = (sl[group * hd + 2 * i], sl[group * hd + 2 * i + 1]);
            if lc == 0.0 {
                continue; // an empty piece
            }
            let mn = m.max(mc);
            let (a, b) = ((m - mn).exp(), (mc - mn).exp());
            for x in o.iter_mut() {
                *x *= a;
            }
            ops::axpy(o, b, &sl[i * hd..(i + 1) * hd]);
            l = l * a + lc * b;
            m = mn;
        }
        let inv = 1.0 / l;
        for x in o.iter_mut() {
            *x *= inv;
        }
    }
}

/// Scratch one attention task needs: the scores of a KV head's query heads over the whole
/// context, and the pieces of one unit.
pub(crate) fn scratch_len(c: &Config, ctx: usize) -> usize {
    let group = c.n_heads / c.n_kv_heads.max(1);
    group * ctx + ctx.div_ceil(PIECE) * group * (c.head_dim + 2)
}

/// The query heads sharing one KV head (`q.len() / hd` of them), of one query token, over a
/// sequence spread across blocks (one block: the contiguous cache).
struct Group<'a, T> {
    q: &'a [f32],
    hd: usize,
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

impl<T> Group<'_, T> {
    /// Calls `f(j, at)` for every key `j - first` in order, `at` being the element index
    /// of its row in this KV head: one block at a time, so no division per key.
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

/// One piece of keys (at most [`PIECE`]) for every query head of the group (`scratch`
/// holds `group` rows of `n` keys): scores, their exponentials against the piece's max, and
/// the unnormalized weighted sum of values into `out`; each head's (max score, sum of
/// exponentials) goes to `stats[2i..2i + 2]` for [`merge`]. The arithmetic is
/// [`kernels`]'s, the same on every path (`simd` picks their AVX2 build).
fn grouped_attend<T: Lanes>(
    simd: bool,
    h: &Group<'_, T>,
    scratch: &mut [f32],
    out: &mut [f32],
    stats: &mut [f32],
) {
    let hd = h.hd;
    let n = h.n_keys - h.first;
    out.fill(0.0);
    if n == 0 {
        for ml in stats.chunks_exact_mut(2) {
            ml.copy_from_slice(&[f32::NEG_INFINITY, 0.0]);
        }
        return;
    }
    let mut rows = [0usize; PIECE];
    h.for_each_key(|j, at| rows[j] = at);
    let keys = kernels::Keys::new(&rows[..n], hd);
    let sc = &mut scratch[..h.q.len() / hd * n];
    kernels::scores(simd, h.q, hd, h.k, &keys, h.scale, sc);
    for (row, ml) in sc.chunks_exact_mut(n).zip(stats.chunks_exact_mut(2)) {
        if let Some(c) = h.softcap {
            ops::softcap(row, c);
        }
        let m = kernels::max(simd, row);
        let l = kernels::exp_sum(simd, row, m);
        ml.copy_from_slice(&[m, l]);
    }
    kernels::weighted_sum(simd, sc, h.v, &keys, hd, out);
}
