//! GdsLLM I/O backends.
//!
//! One interface for every way of getting weights off the disk: "make layer L resident in a
//! buffer the backend owns; tell me when; release". The model code only ever sees the bytes
//! of a [`LayerBytes`] handle; it never knows whether they came from a memory map, an
//! `O_DIRECT` read into an aligned pool or (later) a GPUDirect transfer.
//!
//! Today there is one backend, [`MmapBackend`]: every layer file is mapped whole, so
//! acquiring a layer is free and zero-copy. Backends that own a limited pool of buffers
//! (`direct`, `gds`) will implement the same [`LayerSource`] trait: `acquire` blocks until
//! the layer is resident, dropping the handle releases the buffer back to the pool, and
//! `prefetch` lets the runtime start a read early.

mod error;
mod mmap;

pub use error::IoError;
pub use mmap::{read_manifest, MmapBackend};

use std::ops::Deref;
use std::sync::Arc;

/// The bytes of one resident layer, owned by a backend. The layer stays resident while any
/// clone of the handle is alive; dropping the last one releases it.
#[derive(Clone)]
pub struct LayerBytes {
    index: usize,
    buf: Arc<dyn Resident>,
}

impl LayerBytes {
    /// Wraps a backend buffer. For backend implementations.
    pub fn new(index: usize, buf: Arc<dyn Resident>) -> LayerBytes {
        LayerBytes { index, buf }
    }

    /// Index of the layer in the manifest's layer table.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Deref for LayerBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.buf.bytes()
    }
}

impl std::fmt::Debug for LayerBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerBytes")
            .field("index", &self.index)
            .field("len", &self.len())
            .finish()
    }
}

/// A buffer holding one layer's file contents. Implemented by each backend's buffer type;
/// its `Drop` is the release.
pub trait Resident: Send + Sync {
    /// The layer file's bytes (exactly the manifest's `file_size`).
    fn bytes(&self) -> &[u8];
}

/// Counters a backend keeps, for the run's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Bytes of layer data made resident (for `mmap`: the sizes of the layer files acquired at
    /// least once, i.e. the weight bytes the run touched).
    pub bytes_read: u64,
    /// Number of `acquire` calls.
    pub acquires: u64,
}

/// A source of resident layers.
pub trait LayerSource: Send + Sync {
    /// Short name of the backend (`mmap`), as recorded in the run plan.
    fn name(&self) -> &'static str;

    /// Number of layers in the model.
    fn n_layers(&self) -> usize;

    /// Makes layer `layer` resident and returns a handle to its bytes; blocks until they are
    /// available. The bytes are released when the last handle is dropped.
    fn acquire(&self, layer: usize) -> Result<LayerBytes, IoError>;

    /// Hints that `layer` will be acquired soon. Never fails; backends may ignore it.
    fn prefetch(&self, layer: usize) {
        let _ = layer;
    }

    /// Counters so far.
    fn stats(&self) -> IoStats;
}
