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

use half::f16;
use serde::{Deserialize, Serialize};

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 4 bytes per element, exact.
    #[default]
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
}

/// An element type the cache can hold.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Converts from f32 (rounding as needed).
    fn from_f32(x: f32) -> Self;
    /// Converts to f32.
    fn to_f32(self) -> f32;
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
}

/// KV cache for `n_seqs` sequences of up to `ctx` positions each.
///
/// Layout of each of K and V: `[n_layers][n_blocks][block][kv_dim]`; position `p` of
/// sequence `s` lives in block `tables[s][p / block]` at row `p % block`.
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
    /// Block table of every sequence.
    pub(crate) tables: Vec<Vec<u32>>,
    /// Reference count of every block (0: free).
    refs: Vec<u32>,
    /// Free blocks (a stack: O(1) allocation and release).
    free: Vec<u32>,
}

impl KvCache {
    /// Allocates (zeroed) room for every position of every sequence.
    pub fn new(
        dtype: KvDtype,
        n_layers: usize,
        n_seqs: usize,
        ctx: usize,
        kv_dim: usize,
    ) -> KvCache {
        let n = n_layers * n_seqs * ctx * kv_dim;
        KvCache {
            dtype,
            n_layers,
            n_seqs,
            ctx,
            kv_dim,
            block: ctx.max(1),
            n_blocks: n_seqs,
            k: KvData::new(dtype, n),
            v: KvData::new(dtype, n),
            tables: (0..n_seqs as u32).map(|s| vec![s]).collect(),
            refs: vec![1; n_seqs],
            free: Vec::new(),
        }
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
        let block = block.max(1);
        let n = n_layers * n_blocks * block * kv_dim;
        KvCache {
            dtype,
            n_layers,
            n_seqs,
            ctx,
            kv_dim,
            block,
            n_blocks,
            k: KvData::new(dtype, n),
            v: KvData::new(dtype, n),
            tables: vec![Vec::new(); n_seqs],
            refs: vec![0; n_blocks],
            free: (0..n_blocks as u32).rev().collect(),
        }
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
        self.free.len()
    }

    /// Takes a free block (reference count 1), or `None` when the pool is exhausted. O(1).
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference to block `b` (another sequence or an index shares it).
    pub fn retain(&mut self, b: u32) {
        if let Some(r) = self.refs.get_mut(b as usize) {
            debug_assert!(*r > 0, "retain of free block {b}");
            *r += 1;
        }
    }

    /// Drops a reference to block `b`; the last one returns it to the pool. O(1).
    pub fn release(&mut self, b: u32) {
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

    /// References held on block `b`.
    pub fn refcount(&self, b: u32) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    /// Block table of sequence `seq` (empty for an unknown sequence).
    pub fn table(&self, seq: usize) -> &[u32] {
        self.tables.get(seq).map_or(&[], Vec::as_slice)
    }

    /// Appends block `b` to the table of `seq`, handing it the caller's reference.
    pub fn push_block(&mut self, seq: usize, b: u32) {
        if let Some(t) = self.tables.get_mut(seq) {
            t.push(b);
        }
    }

    /// Releases every block of `seq` and empties its table.
    pub fn release_seq(&mut self, seq: usize) {
        if let Some(t) = self.tables.get_mut(seq) {
            let blocks = std::mem::take(t);
            for b in blocks {
                self.release(b);
            }
        }
    }

    /// Offset of position `pos` of sequence `seq` within one layer, in elements (the slot
    /// must have passed [`KvCache::check_slot`]).
    #[inline]
    pub fn offset(&self, seq: usize, pos: usize) -> usize {
        (self.tables[seq][pos / self.block] as usize * self.block + pos % self.block) * self.kv_dim
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

    /// Elements of one layer (all blocks).
    pub(crate) fn layer_len(&self) -> usize {
        self.n_blocks * self.block * self.kv_dim
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
        if pos / self.block >= self.tables[seq].len() {
            return Err(format!(
                "position {pos} of sequence {seq} has no block ({} allocated of {} positions)",
                self.tables[seq].len(),
                self.block
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_cache_maps_like_the_old_layout() {
        let kv = KvCache::new(KvDtype::F32, 2, 3, 10, 4);
        assert_eq!(kv.offset(0, 0), 0);
        assert_eq!(kv.offset(1, 0), 10 * 4);
        assert_eq!(kv.offset(2, 7), (2 * 10 + 7) * 4);
        assert_eq!(kv.layer_len(), 3 * 10 * 4);
        assert!(kv.check_slot(2, 9).is_ok());
        assert!(kv.check_slot(2, 10).is_err());
        assert!(kv.check_slot(3, 0).is_err());
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
}
