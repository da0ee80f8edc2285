//! The experts of streamed mixture-of-experts blocks ([`crate::ioplan::ExpertPlan`]): read
//! when the router has chosen them, only their rows of the three expert matrices, several
//! reads side by side, and kept in a cache of the most recently used ones. A token of
//! Qwen3-30B-A3B needs 8 of a block's 128 experts: a streamed block reads 1/16 of its
//! expert bytes, fewer when the cache has them.

use crate::error::Result;
use crate::graph::Experts;
use crate::weights::TensorRef;
use gds_io::{LayerBytes, LayerSource, Span};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// One expert's rows of the gate, up and down matrices, each in bytes of its own.
pub(crate) struct ExpertBytes {
    pub gate: LayerBytes,
    pub up: LayerBytes,
    pub down: LayerBytes,
}

/// The span of expert `x`'s rows of the stacked matrix `t` (`n` experts).
fn expert_span(t: &TensorRef, n: usize, x: usize) -> Span {
    let len = (t.rows / n * t.row_bytes()) as u64;
    Span {
        layer: t.layer,
        offset: t.offset as u64 + x as u64 * len,
        len,
    }
}

/// Readers at once: each expert matrix's rows are one read (itself split into up to four
/// concurrent `pread`s when large), so a token's 8 experts keep a deep disk queue.
const PARALLEL_READS: usize = 12;

/// Counters of the cache: experts found, experts read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    /// Experts found in the cache.
    pub hits: u64,
    /// Experts read from the layer files.
    pub misses: u64,
}

/// The most recently used experts, `capacity` of them at most, keyed by (layer, expert).
pub(crate) struct ExpertCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The cached experts and when each was last used.
    map: HashMap<(usize, usize), (Arc<ExpertBytes>, u64)>,
    /// Use times in order: the first is the least recently used.
    order: BTreeMap<u64, (usize, usize)>,
    clock: u64,
    stats: ExpertStats,
}

impl Inner {
    /// Marks `key` as used now, if present.
    fn touch(&mut self, key: (usize, usize)) -> Option<Arc<ExpertBytes>> {
        let (bytes, used) = self.map.get(&key)?;
        let (bytes, used) = (bytes.clone(), *used);
        self.order.remove(&used);
        self.insert(key, bytes.clone());
        Some(bytes)
    }

    /// Keeps `bytes` under `key`, used now.
    fn insert(&mut self, key: (usize, usize), bytes: Arc<ExpertBytes>) {
        self.clock += 1;
        self.map.insert(key, (bytes, self.clock));
        self.order.insert(self.clock, key);
    }
}

impl ExpertCache {
    /// A cache of `capacity` experts (at least one).
    pub(crate) fn new(capacity: usize) -> ExpertCache {
        ExpertCache {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Experts it holds at most: how many one call of [`Self::get`] may ask for.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn stats(&self) -> ExpertStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // the map and its order change together under the lock: a poisoned lock still
        // holds a usable cache
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes of experts `xs` (at most [`Self::capacity`], no repeats) of the block whose
    /// expert matrices are `e`: from the cache, or read from `source`, the missing ones side
    /// by side. The least recently used experts make room.
    pub(crate) fn get(
        &self,
        source: &dyn LayerSource,
        e: &Experts<TensorRef, Vec<f32>>,
        xs: &[usize],
    ) -> Result<Vec<Arc<ExpertBytes>>> {
        debug_assert!(xs.len() <= self.capacity);
        let layer = e.gate.layer;
        let mut found: Vec<Option<Arc<ExpertBytes>>> = {
            let mut c = self.lock();
            xs.iter().map(|&x| c.touch((layer, x))).collect()
        };
        let missing: Vec<usize> = (0..xs.len()).filter(|&i| found[i].is_none()).collect();
        // one read per (expert, matrix), PARALLEL_READS at a time
        let spans: Vec<Span> = missing
            .iter()
            .flat_map(|&i| {
                [&e.gate, &e.up, &e.down]
                    .into_iter()
                    .map(move |t| expert_span(t, e.n, xs[i]))
            })
            .collect();
        let read: Vec<OnceLock<Result<LayerBytes>>> =
            spans.iter().map(|_| OnceLock::new()).collect();
        if !spans.is_empty() {
            // readers take the next span until none is left
            let next = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..spans.len().min(PARALLEL_READS) {
                    s.spawn(|| loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(span) = spans.get(i) else {
                            break;
                        };
                        let r = source.read_span(*span).map_err(Into::into);
                        let _ = read[i].set(r);
                    });
                }
            });
        }
        let mut read = read
            .into_iter()
            .map(|r| r.into_inner().expect("every span was read"));
        let mut c = self.lock();
        c.stats.hits += (xs.len() - missing.len()) as u64;
        c.stats.misses += missing.len() as u64;
        for &i in &missing {
            let (gate, up, down) = (
                read.next().expect("three per expert")?,
                read.next().expect("three per expert")?,
                read.next().expect("three per expert")?,
            );
            let bytes = Arc::new(ExpertBytes { gate, up, down });
            c.insert((layer, xs[i]), bytes.clone());
            found[i] = Some(bytes);
        }
        // the experts of this call are the most recent: the oldest go, never one of them
        while c.map.len() > self.capacity {
            let Some((_, key)) = c.order.pop_first() else {
                break;
            };
            c.map.remove(&key);
        }
        Ok(found
            .into_iter()
            .map(|b| b.expect("found or read"))
            .collect())
    }
}
