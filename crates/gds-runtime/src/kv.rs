//! The key/value cache: one preallocated pool of fixed-size blocks of positions, and per
//! sequence a block table mapping its positions to blocks. Sequences are independent, so a
//! server can batch several of them through one forward pass.
//!
//! Two ways to make one:
//! - [`KvCache::new`]: every sequence owns one block as long as the context (the classic
//!   contiguous layout `[n_layers][n_seqs][ctx][kv_dim]`), nothing to manage.
//! - [`KvCache::paged`]: a pool of `n_blocks` blocks of `block` positions; the caller
//!   allocates blocks ([`KvCache::alloc`], O(1) from a free list), appends them to a
//!   sequence's table ([`KvCache::push_block`]) and releases them. Blocks are reference
//!   counted so sequences sharing a prompt prefix can share its blocks.
//! - [`KvCache::with_window_ring`]: the contiguous cache, except that sliding-window layers
//!   keep a ring of blocks per sequence, holding the window plus one pass of positions
//!   instead of the whole context (Gemma 3: 5 layers of 6 at window 512).
//! - [`KvCache::paged_windowed`]: the paged cache, except that sliding-window layers draw
//!   their blocks from a second, smaller pool with its own table per sequence; the blocks a
//!   sequence's next queries can no longer see are released as it advances
//!   ([`KvCache::drop_window_behind`]), so a window layer holds about the window per
//!   sequence, not its whole context.

use half::f16;
use serde::{Deserialize, Serialize};

/// Element type of the KV cache (the plan picks F16 on the CPU, F32 on the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 4 bytes per element, exact.
    F32,
    /// 2 bytes per element: half the memory, rounding like llama.cpp's default f16 cache.
    F16,
}

impl KvDtype {
    /// Parses `f32` or `f16`.
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    /// `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }
}

/// An element type the cache can hold.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Converts from f32 (rounding as needed).
    fn from_f32(x: f32) -> Self;
    /// Converts to f32.
    fn to_f32(self) -> f32;
    /// `src` as f32: itself, or converted into `tmp` (at least as long).
    fn row<'a>(src: &'a [Self], tmp: &'a mut [f32]) -> &'a [f32];
}

impl KvElem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn row<'a>(src: &'a [Self], _tmp: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn row<'a>(src: &'a [Self], tmp: &'a mut [f32]) -> &'a [f32] {
        let t = &mut tmp[..src.len()];
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, t);
        t
    }
}

/// Storage of one of the two caches (K or V).
pub(crate) enum KvData {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl KvData {
    fn new(dtype: KvDtype, n: usize) -> KvData {
        match dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::F16 => KvData::F16(vec![f16::ZERO; n]),
        }
    }

    /// [`KvData::new`], failing instead of aborting where the memory cannot be had (a
    /// process limit such as `ulimit -v`): zeroed as `vec![0; n]` is, so the pages are
    /// taken as they are first written.
    fn try_new(dtype: KvDtype, n: usize) -> Result<KvData, KvAllocError> {
        use bytemuck::allocation::try_zeroed_vec;
        let fail = |_| KvAllocError {
            bytes: (n as u64).saturating_mul(dtype.size() as u64),
        };
        Ok(match dtype {
            KvDtype::F32 => KvData::F32(try_zeroed_vec(n).map_err(fail)?),
            KvDtype::F16 => KvData::F16(try_zeroed_vec(n).map_err(fail)?),
        })
    }
}

/// The memory for a KV cache's keys or values could not be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvAllocError {
    /// The allocation that failed (the keys' or the values'), bytes.
    pub bytes: u64,
}

impl std::fmt::Display for KvAllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot allocate {} MiB for the KV cache (a process memory limit such as `ulimit -v`?)",
            self.bytes.div_ceil(1 << 20)
        )
    }
}

impl std::error::Error for KvAllocError {}

/// KV cache for `n_seqs` sequences of up to `ctx` positions each.
///
/// Layout of each of K and V: `[n_layers][n_blocks][block · kv_dim]`; position `p` of
/// sequence `s` lives in block `tables[s][p / block]` at row `p % block`. Within a block,
/// attention lays the rows out head by head, `[kv_head][block][head_dim]` (so that a KV
/// head's keys are contiguous; see `attention::Group`).
pub struct KvCache {
    dtype: KvDtype,
    n_layers: usize,
    n_seqs: usize,
    ctx: usize,
    kv_dim: usize,
    /// Positions per block.
    block: usize,
    n_blocks: usize,
    pub(crate) k: KvData,
    pub(crate) v: KvData,
    /// The blocks of the layers without a window (all layers when there is no window pool).
    pool: Pool,
    /// Where each layer's rows are.
    layers: Vec<LayerGeo>,
    /// The window layers' rings, when the cache has them.
    ring: Option<Ring>,
    /// The window layers' own pool (paged caches with window layers).
    window: Option<WindowPool>,
    /// Whether `k` and `v` hold the rows ([`KvCache::drop_rows`]).
    rows: bool,
}

/// Which block tables a layer's rows are found through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tables {
    /// The main pool's (layers without a window, or every layer).
    Main,
    /// The window layers' own pool's ([`KvCache::paged_windowed`]).
    Window,
    /// The window layers' per-sequence rings ([`KvCache::with_window_ring`]).
    Ring,
}

/// How one layer's rows are paged: position p of a sequence is row `p % block` of block
/// `table[p / block]` of its table of kind `tables`, or with `ring > 0` of block
/// `table[(p / block) % ring]`; the layer's rows are `blocks × block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Paging {
    /// Positions per block.
    pub block: usize,
    /// Blocks of the layer's rows.
    pub blocks: usize,
    /// Ring length in table entries (0: none).
    pub ring: usize,
    /// Which tables.
    pub tables: Tables,
}

/// Table entry of a window-pool block that was released (no query will read it again).
pub const NO_BLOCK: u32 = u32::MAX;

/// Blocks with reference counts, and a block table per sequence.
#[derive(Clone, Debug)]
struct Pool {
    /// Block table of every sequence.
    tables: Vec<Vec<u32>>,
    /// Reference count of every block (0: free).
    refs: Vec<u32>,
    /// Free blocks (a stack: O(1) allocation and release).
    free: Vec<u32>,
}

impl Pool {
    /// `n_blocks` free blocks, `n_seqs` empty tables.
    fn empty(n_seqs: usize, n_blocks: usize) -> Pool {
        Pool {
            tables: vec![Vec::new(); n_seqs],
            refs: vec![0; n_blocks],
            free: (0..n_blocks as u32).rev().collect(),
        }
    }

    fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    fn retain(&mut self, b: u32) {
        if let Some(r) = self.refs.get_mut(b as usize) {
            debug_assert!(*r > 0, "retain of free block {b}");
            *r += 1;
        }
    }

    fn release(&mut self, b: u32) {
        if let Some(r) = self.refs.get_mut(b as usize) {
            debug_assert!(*r > 0, "release of free block {b}");
            if *r > 0 {
                *r -= 1;
                if *r == 0 {
                    self.free.push(b);
                }
            }
        }
    }

    fn refcount(&self, b: u32) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    fn table(&self, seq: usize) -> &[u32] {
        self.tables.get(seq).map_or(&[], Vec::as_slice)
    }

    fn push(&mut self, seq: usize, b: u32) {
        if let Some(t) = self.tables.get_mut(seq) {
            t.push(b);
        }
    }

    fn release_seq(&mut self, seq: usize) {
        if let Some(t) = self.tables.get_mut(seq) {
            for b in std::mem::take(t) {
                if b != NO_BLOCK {
                    self.release(b);
                }
            }
        }
    }
}

/// The window layers' pool of a paged cache: same block size as the main pool, entries
/// [`NO_BLOCK`] where a block was released behind the window.
#[derive(Clone, Debug)]
struct WindowPool {
    pool: Pool,
    /// Longest window of a window layer.
    window: usize,
}

/// Where one layer's rows live: from element `base`, in blocks of `block` positions, through
/// the shared tables or (window layers) the ring tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LayerGeo {
    base: usize,
    block: usize,
    ring: bool,
}

/// The rings of the window layers: sequence `s` owns ring blocks `s·len .. (s+1)·len`, and
/// its position `p` lives in ring block `(p / block) % len` at row `p % block`. A ring holds
/// `window + slack − 1` positions plus a block, so a pass of up to `slack` new positions never
/// overwrites a key that one of its queries still sees.
#[derive(Clone, Debug)]
struct Ring {
    /// Positions per ring block.
    block: usize,
    /// Ring blocks per sequence.
    len: usize,
    /// Longest window of a ring layer.
    window: usize,
    /// Most positions one pass adds to one sequence.
    slack: usize,
    /// `tables[s]`: the ring blocks of sequence `s`.
    tables: Vec<Vec<u32>>,
}

/// The ring geometry `(block, blocks per sequence)` for windows of up to `window` positions
/// and passes of up to `slack` positions in a context of `ctx`, or `None` when a ring would
/// not be smaller than the context.
fn ring_geometry(ctx: usize, window: usize, slack: usize) -> Option<(usize, usize)> {
    let block = RING_BLOCK.min(window.next_power_of_two()).min(ctx.max(1));
    let len = (window + slack.max(1) - 1).div_ceil(block) + 1;
    (len * block < ctx).then_some((block, len))
}

/// The ring geometry for layers with `windows` (the largest window decides), or `None` when
/// no layer has a window or a ring would not be smaller than the context.
fn windows_ring(ctx: usize, windows: &[Option<usize>], slack: usize) -> Option<(usize, usize)> {
    let window = windows.iter().flatten().copied().max().unwrap_or(0);
    (window > 0)
        .then(|| ring_geometry(ctx, window, slack))
        .flatten()
}

/// Most positions per ring block (fewer for a window below it): small enough that a ring
/// wastes little past the window, large enough that attention walks few blocks.
const RING_BLOCK: usize = 64;

impl KvCache {
    /// Allocates (zeroed) room for every position of every sequence.
    pub fn new(
        dtype: KvDtype,
        n_layers: usize,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
    ) -> KvCache {
        Self::whole_context(dtype, n_layers, n_seqs, ctx, kv_dim, true)
    }

    /// [`KvCache::new`]'s geometry, with its rows when `rows`.
    fn whole_context(
        dtype: KvDtype,
        n_layers: usize,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        rows: bool,
    ) -> KvCache {
        let layer_len = n_seqs * ctx * kv_dim;
        let layers = uniform(n_layers, layer_len, ctx.max(1));
        Self::contiguous(
            dtype,
            n_seqs,
            ctx,
            kv_dim,
            layers,
            n_layers * layer_len,
            None,
            rows,
        )
    }

    /// One block of the whole context per sequence, the layers laid out as `layers` say in
    /// `n` elements of K (and of V), with the window rings `ring` if any; the rows
    /// allocated only when `rows` (see [`KvCache::drop_rows`]).
    #[allow(clippy::too_many_arguments)]
    fn contiguous(
        dtype: KvDtype,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        layers: Vec<LayerGeo>,
        n: usize,
        ring: Option<Ring>,
        rows: bool,
    ) -> KvCache {
        let n = if rows { n } else { 0 };
        KvCache {
            dtype,
            n_layers: layers.len(),
            n_seqs,
            ctx,
            kv_dim,
            block: ctx.max(1),
            n_blocks: n_seqs,
            k: KvData::new(dtype, n),
            v: KvData::new(dtype, n),
            pool: Pool {
                tables: (0..n_seqs as u32).map(|s| vec![s]).collect(),
                refs: vec![1; n_seqs],
                free: Vec::new(),
            },
            layers,
            ring,
            window: None,
            rows,
        }
    }

    /// A contiguous cache whose window layers (`windows[l]` = `Some(window)`) keep a ring per
    /// sequence instead of the whole context, for passes of up to `slack` positions per
    /// sequence. Falls back to [`KvCache::new`] when no layer has a window or a ring would
    /// not be smaller.
    pub fn with_window_ring(
        dtype: KvDtype,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        windows: &[Option<usize>],
        slack: usize,
    ) -> KvCache {
        Self::window_ring_cache(dtype, n_seqs, ctx, kv_dim, windows, slack, true)
    }

    /// [`KvCache::with_window_ring`]'s block tables and geometry without its rows: for a
    /// backend that holds the rows itself (the GPU's one-sequence executor, and its plan).
    pub fn window_ring_tables(
        dtype: KvDtype,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        windows: &[Option<usize>],
        slack: usize,
    ) -> KvCache {
        Self::window_ring_cache(dtype, n_seqs, ctx, kv_dim, windows, slack, false)
    }

    fn window_ring_cache(
        dtype: KvDtype,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        windows: &[Option<usize>],
        slack: usize,
        rows: bool,
    ) -> KvCache {
        let n_layers = windows.len();
        let window = windows.iter().flatten().copied().max().unwrap_or(0);
        let Some((rb, len)) = windows_ring(ctx, windows, slack) else {
            return KvCache::whole_context(dtype, n_layers, n_seqs, ctx, kv_dim, rows);
        };
        let (full_len, ring_len) = (n_seqs * ctx * kv_dim, n_seqs * len * rb * kv_dim);
        let mut base = 0;
        let layers: Vec<LayerGeo> = windows
            .iter()
            .map(|w| {
                let g = match w {
                    Some(_) => LayerGeo {
                        base,
                        block: rb,
                        ring: true,
                    },
                    None => LayerGeo {
                        base,
                        block: ctx.max(1),
                        ring: false,
                    },
                };
                base += if g.ring { ring_len } else { full_len };
                g
            })
            .collect();
        let ring = Ring {
            block: rb,
            len,
            window,
            slack,
            tables: (0..n_seqs)
                .map(|s| (s * len..(s + 1) * len).map(|b| b as u32).collect())
                .collect(),
        };
        Self::contiguous(dtype, n_seqs, ctx, kv_dim, layers, base, Some(ring), rows)
    }

    /// Bytes of [`KvCache::with_window_ring`] for one sequence (what `--plan` reports).
    pub fn window_ring_bytes(
        dtype: KvDtype,
        ctx: usize,
        kv_dim: usize,
        windows: &[Option<usize>],
        slack: usize,
    ) -> usize {
        let ring = windows_ring(ctx, windows, slack);
        let rows: usize = windows
            .iter()
            .map(|w| match (w, ring) {
                (Some(_), Some((rb, len))) => rb * len,
                _ => ctx,
            })
            .sum();
        2 * rows * kv_dim * dtype.size()
    }

    /// Positions each window layer of [`KvCache::with_window_ring`] keeps (`None`: no ring).
    pub fn window_ring_positions(
        ctx: usize,
        windows: &[Option<usize>],
        slack: usize,
    ) -> Option<usize> {
        windows_ring(ctx, windows, slack).map(|(rb, len)| rb * len)
    }

    /// With window rings: the most positions one pass may add to a sequence.
    pub fn ring_slack(&self) -> Option<usize> {
        self.ring.as_ref().map(|r| r.slack)
    }

    /// Elements of K (or V) in all layers.
    #[cfg(test)]
    fn k_len(&self) -> usize {
        match &self.k {
            KvData::F32(k) => k.len(),
            KvData::F16(k) => k.len(),
        }
    }

    /// Positions each window layer keeps per sequence (`None`: no ring).
    pub fn ring_positions(&self) -> Option<usize> {
        self.ring.as_ref().map(|r| r.block * r.len)
    }

    /// Whether a sequence holding `len` positions can be cut back to its first `keep` and
    /// continued: always, except when the window layers' ring has already overwritten keys
    /// that position `keep` sees (the caller then evaluates the sequence again from 0).
    pub fn can_truncate(&self, len: usize, keep: usize) -> bool {
        let Some(r) = &self.ring else {
            return true;
        };
        if keep >= len || len == 0 {
            return true;
        }
        let oldest = (keep + 1).saturating_sub(r.window);
        (len - 1) / r.block < oldest / r.block + r.len
    }

    /// A paged cache: a pool of `n_blocks` blocks of `block` positions shared by `n_seqs`
    /// sequences of up to `ctx` positions each. Every block starts free and every table
    /// empty.
    pub fn paged(
        dtype: KvDtype,
        n_layers: usize,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        block: usize,
        n_blocks: usize,
    ) -> KvCache {
        Self::try_paged(dtype, n_layers, n_seqs, ctx, kv_dim, block, n_blocks)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`KvCache::paged`], failing where the memory cannot be allocated.
    pub fn try_paged(
        dtype: KvDtype,
        n_layers: usize,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        block: usize,
        n_blocks: usize,
    ) -> Result<KvCache, KvAllocError> {
        let block = block.max(1);
        let n = n_layers * n_blocks * block * kv_dim;
        Ok(KvCache {
            dtype,
            n_layers,
            n_seqs,
            ctx,
            kv_dim,
            block,
            n_blocks,
            k: KvData::try_new(dtype, n)?,
            v: KvData::try_new(dtype, n)?,
            pool: Pool::empty(n_seqs, n_blocks),
            layers: uniform(n_layers, n_blocks * block * kv_dim, block),
            ring: None,
            window: None,
            rows: true,
        })
    }

    /// A paged cache whose window layers (`windows[l]` = `Some(window)`) take their blocks
    /// from a pool of their own of `n_window_blocks` blocks, and the other layers from the
    /// main pool of `n_blocks`. Both pools have blocks of `block` positions; a sequence's
    /// window table has an entry per main-table entry ([`KvCache::push_window`]), released
    /// behind the window by [`KvCache::drop_window_behind`]. Without window layers, the
    /// plain [`KvCache::paged`].
    #[allow(clippy::too_many_arguments)]
    pub fn paged_windowed(
        dtype: KvDtype,
        windows: &[Option<usize>],
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        block: usize,
        n_blocks: usize,
        n_window_blocks: usize,
    ) -> KvCache {
        Self::try_paged_windowed(
            dtype,
            windows,
            n_seqs,
            ctx,
            kv_dim,
            block,
            n_blocks,
            n_window_blocks,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`KvCache::paged_windowed`], failing where the memory cannot be allocated.
    #[allow(clippy::too_many_arguments)]
    pub fn try_paged_windowed(
        dtype: KvDtype,
        windows: &[Option<usize>],
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
        block: usize,
        n_blocks: usize,
        n_window_blocks: usize,
    ) -> Result<KvCache, KvAllocError> {
        let n_layers = windows.len();
        let Some(window) = windows.iter().flatten().copied().max() else {
            return KvCache::try_paged(dtype, n_layers, n_seqs, ctx, kv_dim, block, n_blocks);
        };
        let block = block.max(1);
        let (full_len, win_len) = (n_blocks * block * kv_dim, n_window_blocks * block * kv_dim);
        let mut base = 0;
        let layers: Vec<LayerGeo> = windows
            .iter()
            .map(|w| {
                let g = LayerGeo {
                    base,
                    block,
                    ring: w.is_some(),
                };
                base += if g.ring { win_len } else { full_len };
                g
            })
            .collect();
        Ok(KvCache {
            dtype,
            n_layers,
            n_seqs,
            ctx,
            kv_dim,
            block,
            n_blocks,
            k: KvData::try_new(dtype, base)?,
            v: KvData::try_new(dtype, base)?,
            pool: Pool::empty(n_seqs, n_blocks),
            layers,
            ring: None,
            window: Some(WindowPool {
                pool: Pool::empty(n_seqs, n_window_blocks),
                window,
            }),
            rows: true,
        })
    }

    /// Window-pool blocks one sequence of [`KvCache::paged_windowed`] holds at most, with
    /// passes of up to `step` positions, or `None` when no layer has a window or that is not
    /// fewer blocks than the context `ctx` takes: the window behind the first new position,
    /// the pass, a block of rounding each side, and one more because a sequence keeps its
    /// window behind a block boundary (where a follower can share its prefix, see
    /// [`KvCache::drop_window_behind`]).
    pub fn window_blocks_per_seq(
        ctx: usize,
        windows: &[Option<usize>],
        block: usize,
        step: usize,
    ) -> Option<usize> {
        let window = windows.iter().flatten().copied().max()?;
        let block = block.max(1);
        let n = (window - 1 + step.max(1)).div_ceil(block) + 3;
        (n < ctx.div_ceil(block)).then_some(n)
    }

    /// The longest window of the window pool's layers (`None`: no window pool).
    pub fn pool_window(&self) -> Option<usize> {
        self.window.as_ref().map(|w| w.window)
    }

    /// Blocks in the window pool (0 without one).
    pub fn window_n_blocks(&self) -> usize {
        self.window.as_ref().map_or(0, |w| w.pool.refs.len())
    }

    /// Free blocks of the window pool (0 without one).
    pub fn window_free_blocks(&self) -> usize {
        self.window.as_ref().map_or(0, |w| w.pool.free.len())
    }

    /// Takes a free window-pool block, or `None` when that pool is exhausted or absent.
    pub fn alloc_window(&mut self) -> Option<u32> {
        self.window.as_mut()?.pool.alloc()
    }

    /// Adds a reference to window-pool block `b`.
    pub fn retain_window(&mut self, b: u32) {
        if let Some(w) = &mut self.window {
            w.pool.retain(b);
        }
    }

    /// Drops a reference to window-pool block `b`.
    pub fn release_window(&mut self, b: u32) {
        if let Some(w) = &mut self.window {
            w.pool.release(b);
        }
    }

    /// References held on window-pool block `b`.
    pub fn window_refcount(&self, b: u32) -> u32 {
        self.window.as_ref().map_or(0, |w| w.pool.refcount(b))
    }

    /// Window table of `seq`: one entry per main-table entry, [`NO_BLOCK`] where released
    /// (empty without a window pool).
    pub fn window_table(&self, seq: usize) -> &[u32] {
        self.window.as_ref().map_or(&[], |w| w.pool.table(seq))
    }

    /// Appends window-pool block `b` (or [`NO_BLOCK`], for a block behind the window) to the
    /// window table of `seq`, handing it the caller's reference.
    pub fn push_window(&mut self, seq: usize, b: u32) {
        if let Some(w) = &mut self.window {
            w.pool.push(seq, b);
        }
    }

    /// The first block index a query at position `pos` or later still reads in the window
    /// layers (0 without a window pool).
    pub fn window_first_block(&self, pos: usize) -> usize {
        self.window
            .as_ref()
            .map_or(0, |w| (pos + 1).saturating_sub(w.window) / self.block)
    }

    /// Releases the window-pool blocks of `seq` that no query at position `next` or later
    /// sees. Returns how many were released.
    pub fn drop_window_behind(&mut self, seq: usize, next: usize) -> usize {
        let first = self.window_first_block(next);
        let Some(t) = self
            .window
            .as_mut()
            .and_then(|w| w.pool.tables.get_mut(seq))
        else {
            return 0;
        };
        let mut dropped = Vec::new();
        // released from the newest down: everything below the first entry found released
        // was released before
        let end = first.min(t.len());
        for e in t[..end].iter_mut().rev() {
            if *e == NO_BLOCK {
                break;
            }
            dropped.push(std::mem::replace(e, NO_BLOCK));
        }
        let w = self.window.as_mut().expect("checked above");
        for &b in &dropped {
            w.pool.release(b);
        }
        dropped.len()
    }

    /// Bytes taken by K and V of a paged cache of `n_blocks` blocks of `block` positions.
    pub fn paged_bytes(
        dtype: KvDtype,
        n_layers: usize,
        kv_dim: usize,
        block: usize,
        n_blocks: usize,
    ) -> usize {
        2 * n_layers * n_blocks * block * kv_dim * dtype.size()
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block
    }

    /// Blocks in the pool.
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// Blocks not referenced by anything.
    pub fn free_blocks(&self) -> usize {
        self.pool.free.len()
    }

    /// Takes a free block (reference count 1), or `None` when the pool is exhausted. O(1).
    pub fn alloc(&mut self) -> Option<u32> {
        self.pool.alloc()
    }

    /// Adds a reference to block `b` (another sequence or an index shares it).
    pub fn retain(&mut self, b: u32) {
        self.pool.retain(b)
    }

    /// Drops a reference to block `b`; the last one returns it to the pool. O(1).
    pub fn release(&mut self, b: u32) {
        self.pool.release(b)
    }

    /// References held on block `b`.
    pub fn refcount(&self, b: u32) -> u32 {
        self.pool.refcount(b)
    }

    /// Block table of sequence `seq` (empty for an unknown sequence).
    pub fn table(&self, seq: usize) -> &[u32] {
        self.pool.table(seq)
    }

    /// Appends block `b` to the table of `seq`, handing it the caller's reference.
    pub fn push_block(&mut self, seq: usize, b: u32) {
        self.pool.push(seq, b)
    }

    /// Releases every block of `seq` (in both pools) and empties its tables.
    pub fn release_seq(&mut self, seq: usize) {
        self.pool.release_seq(seq);
        if let Some(w) = &mut self.window {
            w.pool.release_seq(seq);
        }
    }

    /// Slot of position `pos` of sequence `seq` within one layer without a window (its
    /// block × block size + its row), times `kv_dim` (the slot must have passed
    /// [`KvCache::check_slot`]). Where its elements are inside the block is attention's
    /// layout (head by head).
    #[inline]
    pub fn offset(&self, seq: usize, pos: usize) -> usize {
        (self.pool.tables[seq][pos / self.block] as usize * self.block + pos % self.block)
            * self.kv_dim
    }

    /// Bytes taken by K and V together.
    pub fn bytes(
        dtype: KvDtype,
        n_layers: usize,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
    ) -> usize {
        2 * n_layers * n_seqs * ctx * kv_dim * dtype.size()
    }

    /// Element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Positions per sequence.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Number of sequences.
    pub fn n_seqs(&self) -> usize {
        self.n_seqs
    }

    /// Layer `l`'s rows: its first element, positions per block, the block tables (shared,
    /// or the ring's for a window layer, indexed modulo their length), and K and V to write.
    #[allow(clippy::type_complexity)]
    pub(crate) fn layer_mut(
        &mut self,
        l: usize,
    ) -> (usize, usize, &[Vec<u32>], &mut KvData, &mut KvData) {
        let g = self.layers[l];
        let tables = match (&self.ring, &self.window, g.ring) {
            (Some(r), _, true) => &r.tables,
            (_, Some(w), true) => &w.pool.tables,
            _ => &self.pool.tables,
        };
        (g.base, g.block, tables, &mut self.k, &mut self.v)
    }

    /// Drops the cache's rows, keeping its block tables and pools: for a backend that
    /// holds the rows itself (the GPU, in VRAM) while the scheduler manages the blocks
    /// here. The CPU forward pass refuses a cache without rows.
    pub fn drop_rows(&mut self) {
        self.k = KvData::new(self.dtype, 0);
        self.v = KvData::new(self.dtype, 0);
        self.rows = false;
    }

    /// Whether the cache holds its rows (see [`KvCache::drop_rows`]).
    pub fn has_rows(&self) -> bool {
        self.rows
    }

    /// How layer `l`'s rows are paged, as a backend that holds them lays them out.
    pub fn paging(&self, l: usize) -> Option<Paging> {
        let g = *self.layers.get(l)?;
        Some(match (&self.ring, &self.window, g.ring) {
            (Some(r), _, true) => Paging {
                block: r.block,
                blocks: self.n_seqs * r.len,
                ring: r.len,
                tables: Tables::Ring,
            },
            (_, Some(w), true) => Paging {
                block: g.block,
                blocks: w.pool.refs.len(),
                ring: 0,
                tables: Tables::Window,
            },
            _ => Paging {
                block: g.block,
                blocks: self.n_blocks,
                ring: 0,
                tables: Tables::Main,
            },
        })
    }

    /// Sequence `seq`'s block table of kind `t` (empty where the cache has none).
    pub fn tables_of(&self, t: Tables, seq: usize) -> &[u32] {
        let tables = match (t, &self.ring, &self.window) {
            (Tables::Main, _, _) => &self.pool.tables,
            (Tables::Ring, Some(r), _) => &r.tables,
            (Tables::Window, _, Some(w)) => &w.pool.tables,
            _ => return &[],
        };
        tables.get(seq).map_or(&[], Vec::as_slice)
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Checks that position `pos` of sequence `seq` has room in the cache; the error says why
    /// not. The forward pass calls it for every token of a batch before touching the cache.
    pub fn check_slot(&self, seq: usize, pos: usize) -> std::result::Result<(), String> {
        if pos >= self.ctx {
            return Err(format!(
                "position {pos} is outside the context ({})",
                self.ctx
            ));
        }
        if seq >= self.n_seqs {
            return Err(format!(
                "sequence {seq} does not exist ({} in the cache)",
                self.n_seqs
            ));
        }
        let bi = pos / self.block;
        if bi >= self.pool.tables[seq].len() {
            return Err(format!(
                "position {pos} of sequence {seq} has no block ({} allocated of {} positions)",
                self.pool.tables[seq].len(),
                self.block
            ));
        }
        if let Some(w) = &self.window {
            // the window layers read blocks first..=bi: each must be held
            let t = &w.pool.tables[seq];
            let first = self.window_first_block(pos);
            if t.len() <= bi || t[first..=bi].contains(&NO_BLOCK) {
                return Err(format!(
                    "position {pos} of sequence {seq} lacks window blocks {first}..={bi} ({} entries)",
                    t.len()
                ));
            }
        }
        Ok(())
    }
}

impl KvData {
    /// Elements `range` as bytes (the element type's, in the machine's order).
    fn bytes_of(&self, range: std::ops::Range<usize>) -> &[u8] {
        match self {
            KvData::F32(v) => bytemuck::cast_slice(&v[range]),
            KvData::F16(v) => bytemuck::cast_slice(&v[range]),
        }
    }

    /// Elements `range` as bytes to write.
    fn bytes_of_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        match self {
            KvData::F32(v) => bytemuck::cast_slice_mut(&mut v[range]),
            KvData::F16(v) => bytemuck::cast_slice_mut(&mut v[range]),
        }
    }
}

/// Copying whole blocks in and out, for saving a prefix to a file and reading it back
/// (the server's slot save and restore).
impl KvCache {
    /// Whether layer `l` keeps its rows in the window pool.
    fn in_window_pool(&self, l: usize) -> bool {
        self.window.is_some() && self.layers[l].ring
    }

    /// The element ranges of block `main` (main-pool layers) and `window` (window-pool
    /// layers, skipped where [`NO_BLOCK`]), layer by layer; an error where a block is
    /// outside its pool or the cache cannot copy blocks (no rows, or window rings).
    fn block_ranges(&self, main: u32, window: u32) -> Result<Vec<std::ops::Range<usize>>, String> {
        if !self.rows {
            return Err("the KV cache's rows are held by the backend, not here".into());
        }
        if self.ring.is_some() {
            return Err("a KV cache with window rings has no whole blocks to copy".into());
        }
        let mut out = Vec::with_capacity(self.n_layers);
        for l in 0..self.n_layers {
            let g = self.layers[l];
            let (b, n) = if self.in_window_pool(l) {
                if window == NO_BLOCK {
                    continue;
                }
                (window, self.window_n_blocks())
            } else {
                (main, self.n_blocks)
            };
            if b as usize >= n {
                return Err(format!("block {b} is outside its pool ({n} blocks)"));
            }
            let len = g.block * self.kv_dim;
            let start = g.base + b as usize * len;
            out.push(start..start + len);
        }
        Ok(out)
    }

    /// Bytes one block's image takes ([`KvCache::export_block`]): the keys and values of the
    /// main pool's layers and, with `window`, of the window pool's.
    pub fn block_image_len(&self, window: bool) -> usize {
        let layers = (0..self.n_layers)
            .filter(|&l| window || !self.in_window_pool(l))
            .count();
        2 * layers * self.block * self.kv_dim * self.dtype.size()
    }

    /// Appends the image of the positions that block `main` (and, unless [`NO_BLOCK`],
    /// window-pool block `window`) hold to `out`: for each layer in order, its keys, then its
    /// values, as the cache stores them ([`KvCache::dtype`], the machine's byte order).
    pub fn export_block(&self, main: u32, window: u32, out: &mut Vec<u8>) -> Result<(), String> {
        for r in self.block_ranges(main, window)? {
            out.extend_from_slice(self.k.bytes_of(r.clone()));
            out.extend_from_slice(self.v.bytes_of(r));
        }
        Ok(())
    }

    /// Copies every main-pool layer's rows of block `src` into block `dst` (a follower
    /// taking the cached start of a partly filled block, then writing its own rows after
    /// them). Window-pool layers are not copied: a cache with a window pool does not share
    /// partial blocks.
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        let from = self.block_ranges(src, NO_BLOCK)?;
        let to = self.block_ranges(dst, NO_BLOCK)?;
        for (f, t) in from.into_iter().zip(to) {
            match (&mut self.k, &mut self.v) {
                (KvData::F32(k), KvData::F32(v)) => {
                    k.copy_within(f.clone(), t.start);
                    v.copy_within(f, t.start);
                }
                (KvData::F16(k), KvData::F16(v)) => {
                    k.copy_within(f.clone(), t.start);
                    v.copy_within(f, t.start);
                }
                _ => unreachable!("K and V share one element type"),
            }
        }
        Ok(())
    }

    /// Writes an image [`KvCache::export_block`] made into block `main` (and `window`):
    /// `data` must be exactly [`KvCache::block_image_len`] long.
    pub fn import_block(&mut self, main: u32, window: u32, data: &[u8]) -> Result<(), String> {
        let want = self.block_image_len(window != NO_BLOCK);
        if data.len() != want {
            return Err(format!(
                "a block image of {} bytes where this cache's takes {want}",
                data.len()
            ));
        }
        let mut at = 0;
        for r in self.block_ranges(main, window)? {
            let n = self.k.bytes_of(r.clone()).len();
            self.k
                .bytes_of_mut(r.clone())
                .copy_from_slice(&data[at..at + n]);
            self.v
                .bytes_of_mut(r)
                .copy_from_slice(&data[at + n..at + 2 * n]);
            at += 2 * n;
        }
        Ok(())
    }
}

/// `n_layers` layers of `layer_len` elements each, in blocks of `block` positions.
fn uniform(n_layers: usize, layer_len: usize, block: usize) -> Vec<LayerGeo> {
    (0..n_layers)
        .map(|l| LayerGeo {
            base: l * layer_len,
            block,
            ring: false,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_image_goes_into_another_cache_and_block_unchanged() {
        // layer 0 windowed, layers 1 and 2 global; blocks of 4 positions, kv_dim 6
        let windows = [Some(8), None, None];
        let make = || KvCache::paged_windowed(KvDtype::F16, &windows, 2, 64, 6, 4, 5, 5);
        let mut a = make();
        let fill = |d: &mut KvData, salt: f32| {
            if let KvData::F16(v) = d {
                for (i, x) in v.iter_mut().enumerate() {
                    *x = f16::from_f32(i as f32 * 0.25 + salt);
                }
            }
        };
        fill(&mut a.k, 0.0);
        fill(&mut a.v, 1000.0);
        let (mut with, mut without) = (Vec::new(), Vec::new());
        a.export_block(3, 1, &mut with).unwrap();
        a.export_block(3, NO_BLOCK, &mut without).unwrap();
        assert_eq!(with.len(), a.block_image_len(true));
        assert_eq!(with.len(), 2 * 3 * 4 * 6 * 2);
        assert_eq!(without.len(), a.block_image_len(false));
        assert_eq!(without.len(), 2 * 2 * 4 * 6 * 2);

        let mut b = make();
        b.import_block(0, 4, &with).unwrap();
        // every layer's rows of the block, keys and values, equal the source's
        for l in 0..3 {
            let (src, dst) = if l == 0 { (1, 4) } else { (3, 0) };
            let g = a.layers[l];
            let n = g.block * a.kv_dim;
            let (sa, sb) = (g.base + src * n, g.base + dst * n);
            assert_eq!(
                a.k.bytes_of(sa..sa + n),
                b.k.bytes_of(sb..sb + n),
                "K of layer {l}"
            );
            assert_eq!(
                a.v.bytes_of(sa..sa + n),
                b.v.bytes_of(sb..sb + n),
                "V of layer {l}"
            );
        }
        let mut again = Vec::new();
        b.export_block(0, 4, &mut again).unwrap();
        assert_eq!(again, with);

        // wrong sizes, blocks outside the pools, a cache without rows: errors, not panics
        assert!(b
            .import_block(0, NO_BLOCK, &with)
            .unwrap_err()
            .contains("bytes"));
        assert!(b
            .export_block(5, NO_BLOCK, &mut Vec::new())
            .unwrap_err()
            .contains("outside"));
        assert!(b
            .export_block(0, 9, &mut Vec::new())
            .unwrap_err()
            .contains("outside"));
        b.drop_rows();
        assert!(b.export_block(0, NO_BLOCK, &mut Vec::new()).is_err());
        // a block copied within a cache: every layer's rows, keys and values
        let mut c = KvCache::paged(KvDtype::F32, 2, 1, 64, 6, 4, 5);
        if let (KvData::F32(k), KvData::F32(v)) = (&mut c.k, &mut c.v) {
            for (i, (a, b)) in k.iter_mut().zip(v.iter_mut()).enumerate() {
                (*a, *b) = (i as f32, -(i as f32));
            }
        }
        c.copy_block(1, 3).unwrap();
        let (mut one, mut three) = (Vec::new(), Vec::new());
        c.export_block(1, NO_BLOCK, &mut one).unwrap();
        c.export_block(3, NO_BLOCK, &mut three).unwrap();
        assert_eq!(one, three);
        let mut zero = Vec::new();
        c.export_block(0, NO_BLOCK, &mut zero).unwrap();
        assert_ne!(zero, one, "the others untouched");
        assert!(c.copy_block(1, 5).is_err());
        let ring = KvCache::with_window_ring(KvDtype::F32, 1, 256, 6, &windows, 4);
        assert!(ring.ring.is_some());
        assert!(ring.export_block(0, NO_BLOCK, &mut Vec::new()).is_err());
    }

    #[test]
    fn contiguous_cache_maps_like_the_old_layout() {
        let kv = KvCache::new(KvDtype::F32, 2, 3, 10, 4);
        assert_eq!(kv.offset(0, 0), 0);
        assert_eq!(kv.offset(1, 0), 10 * 4);
        assert_eq!(kv.offset(2, 7), (2 * 10 + 7) * 4);
        let mut kv = kv;
        assert_eq!(kv.layer_mut(1).0, 3 * 10 * 4);
        assert!(kv.check_slot(2, 9).is_ok());
        assert!(kv.check_slot(2, 10).is_err());
        assert!(kv.check_slot(3, 0).is_err());
    }

    #[test]
    fn window_layers_keep_a_ring_of_the_window_plus_one_pass() {
        // layers 0, 1 windowed (4 positions), layer 2 global; passes of up to 3 positions
        let windows = [Some(4), Some(4), None];
        let kv = KvCache::with_window_ring(KvDtype::F32, 2, 64, 8, &windows, 3);
        // blocks of 4 positions, (4 + 3 - 1) / 4 rounded up + 1 = 3 blocks: 12 positions
        assert_eq!(kv.ring_positions(), Some(12));
        assert_eq!(
            KvCache::window_ring_positions(64, &windows, 3),
            Some(12),
            "the plan's figure is the cache's"
        );
        let bytes = 2 * (12 + 12 + 64) * 2 * 8 * 4; // K and V, 2 sequences
        assert_eq!(kv.k_len() * 4 * 2, bytes);
        assert_eq!(
            KvCache::window_ring_bytes(KvDtype::F32, 64, 8, &windows, 3) * 2,
            bytes
        );
        // cutting back: position `keep` sees keep-3..=keep; the ring holds the last 3 blocks
        assert!(kv.can_truncate(40, 39));
        assert!(
            kv.can_truncate(40, 37),
            "keys 34..36 are in blocks 8 and 9 of 8..=9"
        );
        assert!(
            !kv.can_truncate(40, 30),
            "block 6 was overwritten by block 9"
        );
        assert!(kv.can_truncate(40, 40) && kv.can_truncate(0, 0));
        // a ring would not be smaller than the context: the plain cache
        let plain = KvCache::with_window_ring(KvDtype::F32, 1, 16, 8, &windows, 16);
        assert_eq!(plain.ring_positions(), None);
        assert!(plain.can_truncate(16, 0));
        assert_eq!(
            KvCache::window_ring_bytes(KvDtype::F32, 16, 8, &windows, 16),
            KvCache::bytes(KvDtype::F32, 3, 1, 16, 8)
        );
    }

    #[test]
    fn paged_blocks_allocate_share_and_free() {
        let mut kv = KvCache::paged(KvDtype::F16, 1, 2, 64, 8, 16, 3);
        assert_eq!(kv.free_blocks(), 3);
        assert!(kv.check_slot(0, 0).is_err(), "no block yet");
        let a = kv.alloc().unwrap();
        let b = kv.alloc().unwrap();
        kv.push_block(0, a);
        kv.push_block(0, b);
        assert!(kv.check_slot(0, 31).is_ok());
        assert!(kv.check_slot(0, 32).is_err());
        assert_eq!(kv.offset(0, 17), (b as usize * 16 + 1) * 8);
        // sequence 1 shares block `a`
        kv.retain(a);
        kv.push_block(1, a);
        assert_eq!(kv.refcount(a), 2);
        let c = kv.alloc().unwrap();
        kv.push_block(1, c);
        assert_eq!(kv.alloc(), None, "pool exhausted");
        kv.release_seq(0);
        assert_eq!(kv.free_blocks(), 1, "only b is free: a is still shared");
        assert_eq!(kv.refcount(a), 1);
        kv.release_seq(1);
        assert_eq!(kv.free_blocks(), 3);
        assert!(kv.table(1).is_empty());
    }

    #[test]
    fn window_layers_draw_from_their_own_pool_and_release_behind_the_window() {
        // layers 0 and 2 windowed (6 positions), layer 1 global; blocks of 4
        let windows = [Some(6), None, Some(6)];
        // passes of up to 4: (6 - 1 + 4) / 4 rounded up + 3 = 6 blocks per sequence
        assert_eq!(KvCache::window_blocks_per_seq(64, &windows, 4, 4), Some(6));
        assert_eq!(
            KvCache::window_blocks_per_seq(16, &windows, 4, 4),
            None,
            "not fewer blocks than the context's"
        );
        assert_eq!(
            KvCache::window_blocks_per_seq(64, &[None, None], 4, 4),
            None
        );
        let mut kv = KvCache::paged_windowed(KvDtype::F32, &windows, 2, 64, 8, 4, 16, 5);
        assert_eq!(
            kv.k_len(),
            (16 + 2 * 5) * 4 * 8,
            "one global layer, two windowed"
        );
        assert_eq!((kv.window_n_blocks(), kv.pool_window()), (5, Some(6)));
        for _ in 0..3 {
            let (b, w) = (kv.alloc().unwrap(), kv.alloc_window().unwrap());
            kv.push_block(0, b);
            kv.push_window(0, w);
        }
        assert!(kv.check_slot(0, 11).is_ok());
        assert!(kv.check_slot(0, 12).is_err(), "no block 3");
        // next position 11 sees 6..=11: blocks 1 and 2; block 0 goes
        let w0 = kv.window_table(0)[0];
        assert_eq!(kv.drop_window_behind(0, 11), 1);
        assert_eq!(kv.window_table(0)[0], NO_BLOCK);
        assert_eq!(kv.window_refcount(w0), 0);
        assert_eq!(kv.window_free_blocks(), 3);
        assert_eq!(kv.drop_window_behind(0, 11), 0, "nothing more to release");
        assert!(kv.check_slot(0, 11).is_ok());
        assert!(
            kv.check_slot(0, 4).is_err(),
            "position 4 would read the released block 0"
        );
        // the main pool keeps every block
        assert_eq!(kv.table(0).len(), 3);
        assert_eq!(kv.free_blocks(), 13);
        // sequence 1 shares the main blocks and the window blocks still held
        let (main, win) = (kv.table(0).to_vec(), kv.window_table(0).to_vec());
        for (&b, &w) in main.iter().zip(&win) {
            kv.retain(b);
            kv.push_block(1, b);
            if w != NO_BLOCK {
                kv.retain_window(w);
            }
            kv.push_window(1, w);
        }
        assert_eq!(kv.window_refcount(win[2]), 2);
        kv.release_seq(0);
        assert_eq!(kv.window_refcount(win[2]), 1);
        kv.release_seq(1);
        assert_eq!((kv.free_blocks(), kv.window_free_blocks()), (16, 5));
        // without window layers: the plain paged cache
        let plain = KvCache::paged_windowed(KvDtype::F32, &[None, None], 1, 64, 8, 4, 16, 5);
        assert_eq!((plain.pool_window(), plain.window_n_blocks()), (None, 0));
        assert_eq!(plain.k_len(), 2 * 16 * 4 * 8);
    }
}
