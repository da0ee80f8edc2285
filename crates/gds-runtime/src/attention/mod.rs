//! Attention of one layer over the KV cache: store the batch's keys and values, then causal
//! attention for every (token, KV head) of the batch: the query heads sharing a KV head
//! (grouped-query attention) are scored in one pass over its keys and summed in one pass
//! over its values, so each cached row is read once per group, not once per query head.
//! The tokens of a prompt go further: a tile of consecutive positions of one sequence reads
//! each key and value row once for all its tokens' heads ([`tile_attend`]), with the same
//! arithmetic, so a position's result is the same whichever way it was computed.
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

impl<'g> Geometry<'g> {
    /// The block holding block-index `bi` of sequence `seq` (tables shorter than the
    /// sequence are rings, indexed modulo their length).
    #[inline]
    fn slot(&self, seq: usize, bi: usize) -> u32 {
        let t = &self.tables[seq];
        t[bi % t.len()]
    }

    /// Piece `c` of the keys `first..end` of sequence `seq` in KV head `g` (the cache
    /// `k`, `v`), for the query heads `q` of that head.
    #[allow(clippy::too_many_arguments)]
    fn group<'a, T>(
        &'a self,
        c: &Config,
        q: &'a [f32],
        (k, v): (&'a [T], &'a [T]),
        seq: usize,
        g: usize,
        (first, end): (usize, usize),
        piece: usize,
        p: &AttnParams<'_>,
    ) -> Group<'a, T> {
        let from = (first + piece * PIECE).min(end);
        Group {
            q,
            hd: c.head_dim,
            k,
            v,
            table: &self.tables[seq],
            block: self.block,
            kv_dim: c.kv_dim(),
            layer_base: self.layer_base,
            head_off: g * self.block * c.head_dim,
            first: from,
            n_keys: (from + PIECE).min(end),
            scale: p.scale,
            softcap: p.softcap,
        }
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
    // a block is laid out head by head, `[kv_head][block][head_dim]` (see `Group`)
    for t in 0..n {
        let (seq, pos) = (batch.seqs[t], batch.positions[t]);
        let block_at = geo.layer_base + geo.slot(seq, pos / geo.block) as usize * geo.block * kvd;
        for g in 0..c.n_kv_heads {
            let at = block_at + (g * geo.block + pos % geo.block) * hd;
            let from = t * kvd + g * hd;
            for (dst, &src) in kc[at..at + hd].iter_mut().zip(&s.k[from..from + hd]) {
                *dst = T::from_f32(src);
            }
            for (dst, &src) in vc[at..at + hd].iter_mut().zip(&s.v[from..from + hd]) {
                *dst = T::from_f32(src);
            }
        }
    }
    let (kc, vc) = (&*kc, &*vc);
    // a window no position of the batch reaches is no window: every key from 0 is seen
    let unbounded = p
        .window
        .is_none_or(|w| batch.positions.iter().all(|&pos| pos < w));
    if unbounded && tiles_on() {
        let tq = tile_tokens(group);
        if tq > 1 {
            let tiles = tiles(batch, tq);
            if tiles.len() < n && tiles.len() >= s.n_tasks {
                attend_tiles(c, simd, s, kc, vc, batch, geo, p, &tiles);
                return;
            }
        }
    }
    let window = p.window;
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
    let piece = |u: usize, piece: usize| {
        let (t, g) = (u / n_kv, u % n_kv);
        let qs = t * qd + g * group * hd;
        let q = &q[qs..qs + group * hd];
        geo.group(c, q, (kc, vc), batch.seqs[t], g, keys(t), piece, p)
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
                for (k, o) in out.chunks_exact_mut(group * hd).enumerate() {
                    let u = ci * per + k;
                    let np = pieces_of(u / n_kv);
                    let sinks = sinks_of(u % n_kv);
                    unit_attend(simd, (np, hd), |c| piece(u, c), sinks, scratch, o);
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
        let mut ml = merge_start(o, sinks.map(|s| s[i]));
        for sl in parts.chunks_exact(slot) {
            let (mc, lc) = (sl[group * hd + 2 * i], sl[group * hd + 2 * i + 1]);
            fold(o, &mut ml, &sl[i * hd..(i + 1) * hd], mc, lc);
        }
        merge_end(o, ml);
    }
}

/// One unit (the query heads of one KV head, one token) piece after piece: `piece(c)` for
/// each of its `np` pieces ([`grouped_attend`]) into the end of `scratch`, then merged into
/// `out` ([`merge`]); the heads are `hd` wide.
fn unit_attend<'a, T: Lanes>(
    simd: bool,
    (np, hd): (usize, usize),
    piece: impl Fn(usize) -> Group<'a, T>,
    sinks: Option<&[f32]>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let group = out.len() / hd;
    let slot = group * (hd + 2);
    let (scratch, parts) = scratch.split_at_mut(scratch.len() - np * slot);
    for (c, sl) in parts.chunks_exact_mut(slot).enumerate() {
        let (po, stats) = sl.split_at_mut(group * hd);
        grouped_attend(simd, &piece(c), scratch, po, stats);
    }
    merge(parts, group, hd, sinks, out);
}

/// The start of one head's merge: no output, and the (max, sum) of no piece, or of its sink.
#[inline]
fn merge_start(o: &mut [f32], sink: Option<f32>) -> (f32, f32) {
    o.fill(0.0);
    match sink {
        Some(s) => (s, 1.0),
        None => (f32::NEG_INFINITY, 0.0),
    }
}

/// One step of a merge: a piece's unnormalized output `po` and its (max, sum) `(mc, lc)`
/// folded into the running output `o` and its (max, sum) `ml`; an empty piece (`lc == 0`)
/// changes nothing.
#[inline]
fn fold(o: &mut [f32], ml: &mut (f32, f32), po: &[f32], mc: f32, lc: f32) {
    if lc == 0.0 {
        return;
    }
    let (m, l) = *ml;
    let mn = m.max(mc);
    let (a, b) = ((m - mn).exp(), (mc - mn).exp());
    for x in o.iter_mut() {
        *x *= a;
    }
    ops::axpy(o, b, po);
    *ml = (mn, l * a + lc * b);
}

/// The end of a merge: the output divided by the sum.
#[inline]
fn merge_end(o: &mut [f32], (_, l): (f32, f32)) {
    let inv = 1.0 / l;
    for x in o.iter_mut() {
        *x *= inv;
    }
}

/// Query rows (a tile's tokens × the query heads of a KV head) the tiled path attends
/// together: enough that a piece's keys and values, read and converted once, serve many
/// rows; few enough that their scores (`TILE_ROWS × PIECE`) stay in L2.
const TILE_ROWS: usize = 16;

/// Whether prompts take the tiled path: `GDS_ATTN_TILES=0` turns it off, to compare the
/// two (the numbers are the same; only the time differs).
fn tiles_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GDS_ATTN_TILES").map_or(true, |v| v.trim() != "0"))
}

/// Tokens per tile for `group` query heads per KV head (1: no tiling).
fn tile_tokens(group: usize) -> usize {
    (TILE_ROWS / group.max(1)).max(1)
}

/// Keys per kernel call in the tiled path: 8 KiB of converted rows, which stay in L1 while
/// every query row of the tile passes over them (a multiple of the kernels' four keys).
fn key_chunk(hd: usize) -> usize {
    ((2048 / hd.max(1)).clamp(4, PIECE)) / 4 * 4
}

/// The batch cut into tiles: runs of tokens of one sequence at consecutive positions, at
/// most `most` long, as `(first token, tokens)`.
fn tiles(batch: &Batch, most: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = Vec::new();
    for t in 0..batch.len() {
        match v.last_mut() {
            Some((_, len))
                if *len < most
                    && batch.seqs[t] == batch.seqs[t - 1]
                    && batch.positions[t] == batch.positions[t - 1] + 1 =>
            {
                *len += 1
            }
            _ => v.push((t, 1)),
        }
    }
    v
}

/// Attention of a batch cut into `tiles` (a layer without a window, or one no position
/// reaches): the tiles split over
/// the pool in contiguous runs of about equal work (query rows × keys), each run writing
/// its tokens' rows of the output, and keeping each row's running (max, sum) in `s.part`.
#[allow(clippy::too_many_arguments)]
fn attend_tiles<T: Lanes>(
    c: &Config,
    simd: bool,
    s: &mut Buffers<'_>,
    kc: &[T],
    vc: &[T],
    batch: &Batch,
    geo: &Geometry<'_>,
    p: &AttnParams<'_>,
    tiles: &[(usize, usize)],
) {
    let (qd, n) = (c.q_dim(), batch.len());
    // a row's running (max, sum): two floats per (token, query head)
    let mld = 2 * c.n_heads;
    if s.part.len() < n * mld {
        s.part.resize(n * mld, 0.0);
    }
    let work = |&(t0, len): &(usize, usize)| len * (batch.positions[t0 + len - 1] + 1);
    let total: usize = tiles.iter().map(work).sum();
    let mut runs = Vec::with_capacity(s.n_tasks);
    let (mut att, mut ml) = (&mut s.att[..n * qd], &mut s.part[..n * mld]);
    let (mut from, mut done) = (0, 0);
    for (i, tile) in tiles.iter().enumerate() {
        done += work(tile);
        if i + 1 == tiles.len() || done * s.n_tasks >= total * (runs.len() + 1) {
            let tokens = tile.0 + tile.1 - tiles[from].0;
            let (a, rest_a) = std::mem::take(&mut att).split_at_mut(tokens * qd);
            let (m, rest_m) = std::mem::take(&mut ml).split_at_mut(tokens * mld);
            runs.push((&tiles[from..=i], a, m));
            (att, ml) = (rest_a, rest_m);
            from = i + 1;
        }
    }
    let q = s.q;
    runs.into_par_iter()
        .zip(s.scores.par_chunks_mut(scratch_len(c, geo.ctx)))
        .for_each(|((tiles, att, ml), scratch)| {
            let first = tiles[0].0;
            // the tiles of one sequence share every key and value row they read
            for seg in tiles.chunk_by(|a, b| batch.seqs[a.0] == batch.seqs[b.0]) {
                for g in 0..c.n_kv_heads {
                    let run = Run {
                        c,
                        q,
                        batch,
                        geo,
                        tiles: seg,
                        first,
                        g,
                    };
                    if let [(_, 1)] = seg {
                        // a sequence's one token (a decode step beside prompts): nothing
                        // to share its rows with, so none are converted
                        alone_attend(simd, &run, kc, vc, p, scratch, att);
                    } else {
                        run_attend(simd, &run, kc, vc, p, scratch, att, ml);
                    }
                }
            }
        });
}

/// Tiles of one sequence, for KV head `g`; their tokens' rows of the output (and of the
/// running sums) start at token `first`.
struct Run<'a> {
    c: &'a Config,
    q: &'a [f32],
    batch: &'a Batch,
    geo: &'a Geometry<'a>,
    tiles: &'a [(usize, usize)],
    first: usize,
    g: usize,
}

/// A run of one token of one tile ([`Run`]): the per-token path's pieces
/// ([`unit_attend`], straight from the cache).
fn alone_attend<T: Lanes>(
    simd: bool,
    r: &Run<'_>,
    kc: &[T],
    vc: &[T],
    p: &AttnParams<'_>,
    scratch: &mut [f32],
    att: &mut [f32],
) {
    let c = r.c;
    let (hd, qd) = (c.head_dim, c.q_dim());
    let group = c.n_heads / c.n_kv_heads;
    let (g, t) = (r.g, r.tiles[0].0);
    let end = r.batch.positions[t] + 1;
    let q = &r.q[t * qd + g * group * hd..][..group * hd];
    let seq = r.batch.seqs[t];
    let piece = |i| r.geo.group(c, q, (kc, vc), seq, g, (0, end), i, p);
    let sinks = p.sinks.map(|s| &s[g * group..(g + 1) * group]);
    let o = &mut att[(t - r.first) * qd + g * group * hd..][..group * hd];
    unit_attend(simd, (end.div_ceil(PIECE), hd), piece, sinks, scratch, o);
}

/// The tiles of one sequence (each at consecutive positions; no window reached) for one KV head,
/// into their rows of `att` (`ml`: each row's running (max, sum)): the pieces, kernels and
/// merge of [`grouped_attend`] and [`merge`], so every number is the per-token path's bit
/// for bit. But each piece's keys and values are read from the cache and converted to f32
/// once for all the tiles (they stay in L2 while every tile passes over them), the scores
/// and sums of a tile's `len × group` query rows take one chunk of keys at a time (every
/// row over a chunk while it is in L1), and each row's pieces are merged as they come.
#[allow(clippy::too_many_arguments)]
fn run_attend<T: Lanes>(
    simd: bool,
    r: &Run<'_>,
    kc: &[T],
    vc: &[T],
    p: &AttnParams<'_>,
    scratch: &mut [f32],
    att: &mut [f32],
    ml: &mut [f32],
) {
    let c = r.c;
    let (hd, qd, nh) = (c.head_dim, c.q_dim(), c.n_heads);
    let group = nh / c.n_kv_heads;
    let (g, geo, batch) = (r.g, r.geo, r.batch);
    let (qt, rest) = scratch.split_at_mut(TILE_ROWS * hd);
    let (kf, rest) = rest.split_at_mut(PIECE * hd);
    let (vf, rest) = rest.split_at_mut(PIECE * hd);
    let (sc, rest) = rest.split_at_mut(TILE_ROWS * PIECE);
    let po = &mut rest[..TILE_ROWS * hd];
    // query head i of token t: its output row and running (max, sum)
    let out_at = |t: usize, i: usize| (t - r.first) * qd + (g * group + i) * hd;
    let ml_at = |t: usize, i: usize| 2 * ((t - r.first) * nh + g * group + i);
    let end_of = |t: usize| batch.positions[t] + 1;
    let mut end = 0;
    for &(t0, len) in r.tiles {
        end = end.max(end_of(t0 + len - 1));
        for t in t0..t0 + len {
            for i in 0..group {
                let (m, l) = merge_start(
                    &mut att[out_at(t, i)..out_at(t, i) + hd],
                    p.sinks.map(|s| s[g * group + i]),
                );
                ml[ml_at(t, i)..ml_at(t, i) + 2].copy_from_slice(&[m, l]);
            }
        }
    }
    let offs: [usize; PIECE] = std::array::from_fn(|j| j * hd);
    let mut at_key = [0usize; PIECE];
    let seq = batch.seqs[r.tiles[0].0];
    let chunk = key_chunk(hd);
    for a in (0..end).step_by(PIECE) {
        let most = (end - a).min(PIECE);
        // the piece's rows, as the per-token path walks them
        geo.group(c, &[], (kc, vc), seq, g, (0, end), a / PIECE, p)
            .for_each_key(|j, at| at_key[j] = at);
        let keys = kernels::Keys::new(&at_key[..most], hd);
        kernels::pack(simd, kc, &keys, hd, kf);
        kernels::pack(simd, vc, &keys, hd, vf);
        for &(t0, len) in r.tiles {
            // keys of token t in this piece (the positions ascend through a tile)
            let n_of = |t: usize| end_of(t).saturating_sub(a).min(PIECE);
            let most = n_of(t0 + len - 1);
            if most == 0 {
                continue; // the tile's tokens all come before this piece
            }
            let rows = len * group;
            for k in 0..len {
                qt[k * group * hd..(k + 1) * group * hd]
                    .copy_from_slice(&r.q[(t0 + k) * qd + g * group * hd..][..group * hd]);
            }
            for ch in (0..most).step_by(chunk) {
                let keys = kernels::Keys::new(&offs[ch..(ch + chunk).min(most)], hd);
                let q = &qt[..rows * hd];
                kernels::scores(simd, q, hd, kf, &keys, p.scale, &mut sc[ch..], PIECE);
            }
            let mut stats = [(f32::NEG_INFINITY, 0f32); TILE_ROWS];
            for (row, st) in stats.iter_mut().enumerate().take(rows) {
                let n = n_of(t0 + row / group);
                if n == 0 {
                    continue;
                }
                let x = &mut sc[row * PIECE..row * PIECE + n];
                if let Some(cap) = p.softcap {
                    ops::softcap(x, cap);
                }
                let m = kernels::max(simd, x);
                *st = (m, kernels::exp_sum(simd, x, m));
            }
            // the values: every row over the keys all of them see, then each token its
            // own last ones
            let po = &mut po[..rows * hd];
            po.fill(0.0);
            let all = n_of(t0);
            for ch in (0..most).step_by(chunk) {
                let hi = (ch + chunk).min(most);
                if hi <= all {
                    let keys = kernels::Keys::new(&offs[ch..hi], hd);
                    kernels::weighted_sum(simd, &sc[ch..], PIECE, vf, &keys, hd, po);
                    continue;
                }
                for k in 0..len {
                    let hk = hi.min(n_of(t0 + k));
                    if hk > ch {
                        let keys = kernels::Keys::new(&offs[ch..hk], hd);
                        let (r0, r1) = (k * group, (k + 1) * group);
                        kernels::weighted_sum(
                            simd,
                            &sc[r0 * PIECE + ch..],
                            PIECE,
                            vf,
                            &keys,
                            hd,
                            &mut po[r0 * hd..r1 * hd],
                        );
                    }
                }
            }
            for (row, &(mc, lc)) in stats.iter().enumerate().take(rows) {
                let (t, i) = (t0 + row / group, row % group);
                let (o, m) = (out_at(t, i), ml_at(t, i));
                let mut st = (ml[m], ml[m + 1]);
                fold(
                    &mut att[o..o + hd],
                    &mut st,
                    &po[row * hd..(row + 1) * hd],
                    mc,
                    lc,
                );
                ml[m..m + 2].copy_from_slice(&[st.0, st.1]);
            }
        }
    }
    for &(t0, len) in r.tiles {
        for t in t0..t0 + len {
            for i in 0..group {
                let m = ml_at(t, i);
                merge_end(
                    &mut att[out_at(t, i)..out_at(t, i) + hd],
                    (ml[m], ml[m + 1]),
                );
            }
        }
    }
}

/// Scratch one attention task needs: the per-token path's scores of a KV head's query heads
/// over the whole context and the pieces of one unit, or the tiled path's query rows,
/// converted keys and values of a piece, scores and piece outputs, whichever is more.
pub(crate) fn scratch_len(c: &Config, ctx: usize) -> usize {
    let group = c.n_heads / c.n_kv_heads.max(1);
    let hd = c.head_dim;
    let per_token = group * ctx + ctx.div_ceil(PIECE) * group * (hd + 2);
    per_token.max(2 * TILE_ROWS * hd + 2 * PIECE * hd + TILE_ROWS * PIECE)
}

/// The query heads sharing one KV head (`q.len() / hd` of them), of one query token, over a
/// sequence spread across blocks (one block: the contiguous cache). A block of the cache is
/// laid out head by head, `[kv_head][block][head_dim]`: a KV head's keys in a block are
/// one contiguous run, which a decode step reads from memory as a stream (position by
/// position, `[block][kv_dim]`, each key was 128 bytes every `kv_dim` elements).
struct Group<'a, T> {
    q: &'a [f32],
    hd: usize,
    k: &'a [T],
    v: &'a [T],
    table: &'a [u32],
    block: usize,
    /// Elements of a position (all KV heads): a block holds `block · kv_dim`.
    kv_dim: usize,
    layer_base: usize,
    /// This KV head's run in a block: `g · block · hd`.
    head_off: usize,
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
        let row = self.block * self.kv_dim;
        // a table shorter than the sequence is a window ring: block index bi is in
        // table[bi % len] (the keys before `first` it overwrote are never read)
        let len = self.table.len();
        for bi in self.first / self.block..self.n_keys.div_ceil(self.block) {
            let start = bi * self.block;
            let b = self.table[bi % len];
            let base = self.layer_base + b as usize * row + self.head_off;
            let from = start.max(self.first);
            for j in from..self.n_keys.min(start + self.block) {
                f(j - self.first, base + (j - start) * self.hd);
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
    kernels::scores(simd, h.q, hd, h.k, &keys, h.scale, sc, n);
    for (row, ml) in sc.chunks_exact_mut(n).zip(stats.chunks_exact_mut(2)) {
        if let Some(c) = h.softcap {
            ops::softcap(row, c);
        }
        let m = kernels::max(simd, row);
        let l = kernels::exp_sum(simd, row, m);
        ml.copy_from_slice(&[m, l]);
    }
    kernels::weighted_sum(simd, sc, n, h.v, &keys, hd, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;

    /// `n` values in [-1, 1) of the token at (`seq`, `pos`), the same in every run.
    fn values(n: usize, seq: usize, pos: usize, what: u64) -> Vec<f32> {
        kernels::tests::values(n, (seq as u64 * 1_000_003 + pos as u64) * 7 + what)
    }

    /// Runs `batches` of (sequence, position) through one layer's attention over a paged
    /// cache (blocks of 16 handed out to the two sequences in turn), giving each token's
    /// output.
    fn run(
        c: &Config,
        dtype: KvDtype,
        simd: bool,
        p: &AttnParams<'_>,
        batches: &[Vec<(usize, usize)>],
    ) -> Vec<((usize, usize), Vec<f32>)> {
        let (ctx, block) = (640, 16);
        let mut kv = KvCache::paged(dtype, 1, 2, ctx, c.kv_dim(), block, 2 * ctx / block);
        for _ in 0..ctx / block {
            for seq in 0..2 {
                let b = kv.alloc().unwrap();
                kv.push_block(seq, b);
            }
        }
        let (qd, kvd, n_tasks) = (c.q_dim(), c.kv_dim(), 2);
        let mut scores = vec![0f32; n_tasks * scratch_len(c, ctx)];
        let mut part = Vec::new();
        let mut out = Vec::new();
        for toks in batches {
            let mut batch = Batch::with_capacity(toks.len());
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            for &(seq, pos) in toks {
                batch.push(0, pos, seq, true);
                q.extend(values(qd, seq, pos, 1));
                k.extend(values(kvd, seq, pos, 2));
                v.extend(values(kvd, seq, pos, 3));
            }
            let mut att = vec![f32::NAN; toks.len() * qd];
            let mut s = Buffers {
                q: &q,
                k: &k,
                v: &v,
                att: &mut att,
                scores: &mut scores,
                part: &mut part,
                n_tasks,
            };
            layer(c, simd, &mut s, &mut kv, 0, &batch, p);
            for (t, &sp) in toks.iter().enumerate() {
                out.push((sp, att[t * qd..(t + 1) * qd].to_vec()));
            }
        }
        out
    }

    /// A prompt's tiles give every position the numbers the per-token path gives it alone,
    /// bit for bit: across a piece boundary, beside another sequence's prompt and decode
    /// token, with a softcap and sinks, for group sizes that fill a tile evenly or not,
    /// head widths the AVX2 kernels take or not, and both cache types.
    #[test]
    fn tiles_of_a_prompt_equal_each_position_alone() {
        let mut batches: Vec<Vec<(usize, usize)>> = vec![(0..300)
            .map(|p| (0, p))
            .chain((0..37).map(|p| (1, p)))
            .collect()];
        batches.push(
            (37..38)
                .map(|p| (1, p))
                .chain((300..333).map(|p| (0, p)))
                .collect(),
        );
        let alone: Vec<Vec<(usize, usize)>> =
            batches.iter().flatten().map(|&sp| vec![sp]).collect();
        for (n_heads, n_kv, hd) in [(8, 2, 64), (4, 4, 16), (6, 2, 32), (4, 1, 12)] {
            let c = Config::for_tests(n_heads, n_kv, hd);
            let group = n_heads / n_kv;
            let tq = tile_tokens(group);
            for b in &batches[..1] {
                let mut batch = Batch::with_capacity(b.len());
                for &(seq, pos) in b {
                    batch.push(0, pos, seq, true);
                }
                let t = tiles(&batch, tq);
                assert!(t.len() < b.len() && t.len() >= 2, "the tiled path is taken");
            }
            let sinks = values(n_heads, 9, 9, 4);
            // (a window past every position tiles; one the prompt passes does not)
            for (softcap, sinks, window) in [
                (None, None, None),
                (Some(0.5), Some(&sinks[..]), None),
                (None, None, Some(400)),
                (None, None, Some(100)),
            ] {
                let p = AttnParams {
                    scale: 0.7,
                    window,
                    softcap,
                    sinks,
                };
                for dtype in [KvDtype::F16, KvDtype::F32] {
                    for simd in [false, crate::ops::simd_available()] {
                        let tiled = run(&c, dtype, simd, &p, &batches);
                        let mut single = run(&c, dtype, simd, &p, &alone);
                        single.sort_by_key(|(sp, _)| *sp);
                        let mut tiled_sorted = tiled.clone();
                        tiled_sorted.sort_by_key(|(sp, _)| *sp);
                        for ((sp, a), (_, b)) in tiled_sorted.iter().zip(&single) {
                            assert!(a.iter().all(|x| x.is_finite()), "{sp:?}");
                            assert_eq!(
                                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                "heads {n_heads}/{n_kv} hd {hd} {dtype:?} simd {simd} \
                                 softcap {softcap:?} window {window:?} at {sp:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
