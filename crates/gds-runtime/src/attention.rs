//! Attention of one layer over the KV cache: store the batch's keys and values, then causal
//! attention for every (token, KV head) of the batch: the query heads sharing a KV head
//! (grouped-query attention) are scored in one pass over its keys and summed in one pass
//! over its values, so each cached row is read once per group, not once per query head.
//!
//! Kept apart from the forward pass so the cache's layout can change without touching the
//! model code: the model hands over the batch's Q/K/V rows in [`RunState`] and gets the
//! attention output back in it. The cache is paged (see [`crate::kv`]): attention walks a
//! sequence's block table (one block for a contiguous cache; a ring for window layers).

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
    // one unit per (token, KV head): its `group` query heads in one pass over the keys and
    // one over the values, so each K/V row is read once for the group, not once per head
    let n_kv = c.n_kv_heads;
    let units = n * n_kv;
    let q = &s.q;
    let block = geo.block;
    let scratch = scratch_len(c, geo.ctx);
    let unit = |u: usize, piece: Option<(usize, usize)>| {
        let (t, g) = (u / n_kv, u % n_kv);
        let pos = batch.positions[t];
        let qs = t * qd + g * group * hd;
        // keys first..=pos: all of them, or the window's
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        // a piece of them: the `c`-th of `of`
        let (first, n_keys) = match piece {
            None => (first, pos + 1),
            Some((c, of)) => {
                let len = pos + 1 - first;
                (first + len * c / of, first + len * (c + 1) / of)
            }
        };
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
            first,
            n_keys,
            scale,
            softcap,
        }
    };
    // few units (decode: one token, a few KV heads) and long contexts: each unit's keys are
    // split into pieces on several threads, merged after (flash-decoding)
    let longest = (0..n).map(|t| batch.positions[t] + 1).max().unwrap_or(0);
    let pieces = if units >= s.n_tasks {
        1
    } else {
        s.n_tasks.div_ceil(units).min(longest / MIN_PIECE_KEYS)
    };
    if pieces <= 1 {
        let per = units.div_ceil(s.n_tasks);
        s.att[..n * qd]
            .par_chunks_mut(per * group * hd)
            .zip(s.scores.par_chunks_mut(scratch))
            .enumerate()
            .for_each(|(ci, (out, scratch))| {
                for (k, o) in out.chunks_exact_mut(group * hd).enumerate() {
                    grouped_attend(simd, &unit(ci * per + k, None), scratch, o, None);
                }
            });
        return;
    }
    // each piece: its unnormalized output per head, then (max, sum) per head
    let slot = group * (hd + 2);
    let items = units * pieces;
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
                let h = unit(it / pieces, Some((it % pieces, pieces)));
                let (o, stats) = sl.split_at_mut(group * hd);
                grouped_attend(simd, &h, scratch, o, Some(stats));
            }
        });
    for u in 0..units {
        let (t, g) = (u / n_kv, u % n_kv);
        let parts = &s.part[u * pieces * slot..(u + 1) * pieces * slot];
        for i in 0..group {
            let stat = |c: usize| {
                let at = c * slot + group * hd + 2 * i;
                (parts[at], parts[at + 1])
            };
            let m = (0..pieces)
                .map(|c| stat(c).0)
                .fold(f32::NEG_INFINITY, f32::max);
            let o = &mut s.att[t * qd + (g * group + i) * hd..][..hd];
            o.fill(0.0);
            let mut sum = 0.0;
            for c in 0..pieces {
                let (mc, lc) = stat(c);
                if lc == 0.0 {
                    continue; // an empty piece
                }
                let w = (mc - m).exp();
                sum += w * lc;
                ops::axpy(o, w, &parts[c * slot + i * hd..][..hd]);
            }
            let inv = 1.0 / sum;
            for x in o.iter_mut() {
                *x *= inv;
            }
        }
    }
}

/// Fewest keys per piece when a unit's keys are split across threads.
const MIN_PIECE_KEYS: usize = 128;

/// Scratch one attention task needs: the scores of a KV head's query heads over the whole
/// context, and one K/V row converted to f32.
pub(crate) fn scratch_len(c: &Config, ctx: usize) -> usize {
    (c.n_heads / c.n_kv_heads.max(1)) * ctx + c.head_dim
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

/// Scores of every query head of the group (`scratch` holds `group` rows of `n` keys, then
/// one converted K/V row), softmax per head, then the weighted sum of values per head. With
/// `stats` (a piece of the keys, merged later): the sum is left unnormalized and each
/// head's (max score, sum of exponentials) goes to `stats[2i..2i + 2]`.
#[inline(always)]
fn grouped_generic<T: KvElem>(
    h: &Group<'_, T>,
    scratch: &mut [f32],
    out: &mut [f32],
    stats: Option<&mut [f32]>,
) {
    let hd = h.hd;
    let n = h.n_keys - h.first;
    out.fill(0.0);
    if n == 0 {
        if let Some(st) = stats {
            for ml in st.chunks_exact_mut(2) {
                ml.copy_from_slice(&[f32::NEG_INFINITY, 0.0]);
            }
        }
        return;
    }
    let (sc, rest) = scratch.split_at_mut(h.q.len() / hd * n);
    let tmp = &mut rest[..hd];
    h.for_each_key(|j, at| {
        let kr = T::row(&h.k[at..at + hd], tmp);
        for (i, qi) in h.q.chunks_exact(hd).enumerate() {
            sc[i * n + j] = ops::dot(qi, kr) * h.scale;
        }
    });
    match stats {
        None => {
            for row in sc.chunks_exact_mut(n) {
                if let Some(c) = h.softcap {
                    ops::softcap(row, c);
                }
                ops::softmax(row);
            }
        }
        Some(st) => {
            for (row, ml) in sc.chunks_exact_mut(n).zip(st.chunks_exact_mut(2)) {
                if let Some(c) = h.softcap {
                    ops::softcap(row, c);
                }
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut l = 0.0;
                for x in row.iter_mut() {
                    *x = (*x - m).exp();
                    l += *x;
                }
                ml.copy_from_slice(&[m, l]);
            }
        }
    }
    h.for_each_key(|j, at| {
        let vr = T::row(&h.v[at..at + hd], tmp);
        for (i, o) in out.chunks_exact_mut(hd).enumerate() {
            ops::axpy(o, sc[i * n + j], vr);
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn grouped_avx2<T: KvElem>(
    h: &Group<'_, T>,
    scratch: &mut [f32],
    out: &mut [f32],
    stats: Option<&mut [f32]>,
) {
    grouped_generic(h, scratch, out, stats)
}

/// [`Group`] attention; `simd` (from [`ops::simd_available`]) picks the AVX2 build.
#[inline]
fn grouped_attend<T: KvElem>(
    simd: bool,
    h: &Group<'_, T>,
    scratch: &mut [f32],
    out: &mut [f32],
    stats: Option<&mut [f32]>,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when `simd_available()` found AVX2 and FMA on this CPU.
        unsafe { grouped_avx2(h, scratch, out, stats) };
        return;
    }
    let _ = simd;
    grouped_generic(h, scratch, out, stats)
}
