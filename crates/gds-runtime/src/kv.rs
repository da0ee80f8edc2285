//! The key/value cache: preallocated for the whole context, one slot per (layer, sequence,
//! position). Sequences are independent, so a server can batch several of them through one
//! forward pass.

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
/// Layout of each of K and V: `[n_layers][n_seqs][ctx][kv_dim]`.
pub struct KvCache {
    dtype: KvDtype,
    n_layers: usize,
    n_seqs: usize,
    ctx: usize,
    kv_dim: usize,
    pub(crate) k: KvData,
    pub(crate) v: KvData,
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
            k: KvData::new(dtype, n),
            v: KvData::new(dtype, n),
        }
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

    /// Elements of one layer (all sequences).
    pub(crate) fn layer_len(&self) -> usize {
        self.n_seqs * self.ctx * self.kv_dim
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
        Ok(())
    }
}
