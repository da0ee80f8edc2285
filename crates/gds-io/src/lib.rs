#![doc = include_str!("../README.md")]

mod aligned;
mod direct;
mod error;
mod mmap;
pub mod pagecache;
pub mod verify;

pub use aligned::{align_down, align_up, huge_pages_available, AlignedBuf, ALIGN, HUGE};
pub use direct::{
    filesystem_name, measure_read, probe_direct, DirectBackend, DirectOptions, DirectSupport,
    ReadBench,
};
pub use error::IoError;
pub use mmap::{read_layer_span, read_manifest, verify_layer_files, MmapBackend};
pub use verify::{
    open_in_dir, open_regular, open_user_file, read_model_file, Verifier, VerifyMode, VerifyStats,
};

use std::ops::{Deref, Range};
use std::sync::Arc;

/// A byte range of one layer file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    /// Index of the layer in the manifest's layer table.
    pub layer: usize,
    /// First byte, inside the layer file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The bytes of one resident layer (or of a span of it), owned by a backend. They stay
/// resident while any clone of the handle is alive; dropping the last one releases them.
#[derive(Clone)]
pub struct LayerBytes {
    index: usize,
    file_offset: u64,
    range: Range<usize>,
    buf: Arc<dyn Resident>,
}

impl LayerBytes {
    /// The bytes to rewrite, when this is the only handle on a buffer of the backend's own
    /// ([`Resident::bytes_mut`]). For backend implementations.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        let range = self.range.clone();
        Arc::get_mut(&mut self.buf)?.bytes_mut()?.get_mut(range)
    }

    /// Wraps a backend buffer holding a whole layer file. For backend implementations.
    pub fn new(index: usize, buf: Arc<dyn Resident>) -> LayerBytes {
        let len = buf.bytes().len();
        LayerBytes {
            index,
            file_offset: 0,
            range: 0..len,
            buf,
        }
    }

    /// Wraps a backend buffer of which `range` holds the layer file's bytes starting at
    /// `file_offset`. For backend implementations; panics if `range` is outside the buffer.
    pub fn new_span(
        index: usize,
        file_offset: u64,
        range: Range<usize>,
        buf: Arc<dyn Resident>,
    ) -> LayerBytes {
        assert!(range.start <= range.end && range.end <= buf.bytes().len());
        LayerBytes {
            index,
            file_offset,
            range,
            buf,
        }
    }

    /// Index of the layer in the manifest's layer table.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Offset in the layer file of the first byte of this handle (0 for a whole layer).
    pub fn file_offset(&self) -> u64 {
        self.file_offset
    }

    /// The bytes of `span`'s file range if this handle holds all of them.
    pub fn slice(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let start = usize::try_from(offset.checked_sub(self.file_offset)?).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        self.get(start..end)
    }

    /// The backend buffer behind this handle.
    pub(crate) fn buf(&self) -> Arc<dyn Resident> {
        self.buf.clone()
    }

    /// True when this handle holds all of `span` (same layer, range covered).
    pub fn covers(&self, span: &Span) -> bool {
        span.layer == self.index && self.slice(span.offset, span.len).is_some()
    }
}

impl Deref for LayerBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf.bytes()[self.range.clone()]
    }
}

impl std::fmt::Debug for LayerBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerBytes")
            .field("index", &self.index)
            .field("file_offset", &self.file_offset)
            .field("len", &self.len())
            .finish()
    }
}

/// A buffer holding layer bytes. Implemented by each backend's buffer type; its `Drop` is
/// the release.
pub trait Resident: Send + Sync {
    /// The buffer's bytes.
    fn bytes(&self) -> &[u8];

    /// The buffer's bytes to rewrite, where they are memory of the backend's own (not a
    /// file mapping).
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

/// Counters a backend keeps, for the run's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Bytes of layer data made resident (for `mmap`: the sizes of the layer files acquired
    /// at least once, i.e. the weight bytes the run touched; for `direct`: bytes read).
    pub bytes_read: u64,
    /// Number of `acquire` calls.
    pub acquires: u64,
    /// Number of reads issued to the disk.
    pub reads: u64,
    /// Nanoseconds spent inside reads (I/O thread and callers together).
    pub read_ns: u64,
    /// Nanoseconds callers spent blocked in `acquire`/`read_at` waiting for bytes.
    pub wait_ns: u64,
    /// Spans a cache over the backend found in memory (a mixture of experts' experts).
    pub cache_hits: u64,
    /// Spans that cache had to read.
    pub cache_misses: u64,
}

impl IoStats {
    /// Share of the cache's lookups it found (`None` without lookups).
    pub fn cache_hit_rate(&self) -> Option<f64> {
        let n = self.cache_hits + self.cache_misses;
        (n > 0).then(|| self.cache_hits as f64 / n as f64)
    }

    /// Counter differences `self - earlier` (for per-phase metrics).
    pub fn since(&self, earlier: &IoStats) -> IoStats {
        IoStats {
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            acquires: self.acquires.saturating_sub(earlier.acquires),
            reads: self.reads.saturating_sub(earlier.reads),
            read_ns: self.read_ns.saturating_sub(earlier.read_ns),
            wait_ns: self.wait_ns.saturating_sub(earlier.wait_ns),
            cache_hits: self.cache_hits.saturating_sub(earlier.cache_hits),
            cache_misses: self.cache_misses.saturating_sub(earlier.cache_misses),
        }
    }
}

/// A source of resident layers.
pub trait LayerSource: Send + Sync {
    /// Short name of the backend (`mmap`, `direct`, `buffered`), as recorded in the plan.
    fn name(&self) -> &'static str;

    /// Number of layers in the model.
    fn n_layers(&self) -> usize;

    /// Size of each layer file.
    fn layer_size(&self, layer: usize) -> u64;

    /// Makes layer `layer` resident and returns a handle to its bytes; blocks until they are
    /// available. The bytes are released when the last handle is dropped.
    fn acquire(&self, layer: usize) -> Result<LayerBytes, IoError> {
        let len = self.layer_size(layer);
        self.acquire_span(Span {
            layer,
            offset: 0,
            len,
        })
    }

    /// Makes the bytes of `span` resident; the handle's bytes are exactly the span's.
    fn acquire_span(&self, span: Span) -> Result<LayerBytes, IoError>;

    /// Makes the bytes of `span` resident in memory of their own, not in one of the
    /// streaming buffers, and returns them; they are freed when the last handle is dropped.
    /// Several calls may run at once (a mixture of experts' experts are read so, side by
    /// side, outside the layer stream). The default hands out [`Self::acquire_span`]'s
    /// bytes, right for backends that hold every layer (a mapping: no copy).
    fn read_span(&self, span: Span) -> Result<LayerBytes, IoError> {
        self.acquire_span(span)
    }

    /// Hints that `span` will be acquired soon. Never fails; backends may ignore it.
    fn prefetch(&self, span: Span) {
        let _ = span;
    }

    /// Copies the bytes at `offset` of layer `layer` into `out` (small reads, such as the
    /// rows of an embedding table, without making the whole layer resident).
    fn read_at(&self, layer: usize, offset: u64, out: &mut [u8]) -> Result<(), IoError> {
        let h = self.acquire_span(Span {
            layer,
            offset,
            len: out.len() as u64,
        })?;
        out.copy_from_slice(&h);
        Ok(())
    }

    /// Counters so far.
    fn stats(&self) -> IoStats;

    /// Warnings about how the backend had to run (e.g. `O_DIRECT` unsupported).
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }

    /// A resident layer's bytes to rewrite in place (a caller's in-memory layout of its
    /// weights), where the backend holds them in memory of its own and nothing has acquired
    /// them yet; `None` otherwise (a mapping, a streamed layer, bytes already handed out).
    /// Reads of the layer afterwards see the rewritten bytes.
    fn resident_mut(&mut self, layer: usize) -> Option<&mut [u8]> {
        let _ = layer;
        None
    }
}
