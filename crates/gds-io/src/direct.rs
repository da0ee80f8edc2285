//! The `direct` backend: layer files read with `O_DIRECT` into 4 KiB-aligned buffers, so the
//! weights never pass through (or stay in) the page cache.
//!
//! Layers the plan keeps resident are read once at open into buffers of their own. The rest
//! stream through a fixed pool of equal buffers: the runtime calls [`LayerSource::prefetch`]
//! for the spans it will need next, a background I/O thread reads them into free buffers,
//! and [`LayerSource::acquire_span`] hands out the filled buffer (or reads on the caller's
//! thread when nothing was prefetched). Dropping the handle returns the buffer to the pool.
//!
//! On filesystems without `O_DIRECT` (tmpfs, some FUSE and network filesystems) the backend
//! reads through the page cache and drops the pages it read right away
//! (`POSIX_FADV_DONTNEED`), so the memory budget still holds; it says so in a warning.

use crate::aligned::{align_down, align_up, AlignedBuf, ALIGN};
use crate::pagecache::drop_cached;
use crate::verify::{Verifier, VerifyMode};
use crate::{IoError, IoStats, LayerBytes, LayerSource, Resident, Span};
use gds_format::Manifest;
use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// How the `direct` backend is laid out; decided by the run plan.
#[derive(Clone, Debug, Default)]
pub struct DirectOptions {
    /// Per layer: read once at open and keep (`true`) or stream through the pool (`false`).
    /// Missing entries mean "stream".
    pub resident: Vec<bool>,
    /// Number of streaming buffers (0 when every layer is resident).
    pub slots: usize,
    /// Bytes of each streaming buffer (rounded up to 4 KiB); the largest span that can be
    /// acquired from a streamed layer.
    pub slot_size: usize,
    /// Read through the page cache (dropping pages after each read) even where `O_DIRECT`
    /// works. For tests and comparisons.
    pub force_buffered: bool,
    /// Buffered reads leave the pages in the page cache instead of dropping them: for the
    /// GPU's `--io mmap`, where host RAM is the tier between VRAM and storage and a layer
    /// streamed every token should come from memory after its first read.
    pub keep_cached: bool,
    /// Checks each layer file's content hash the first time it is read (`None`: a
    /// [`Verifier`] hashing with the per-user cache; pass one with [`VerifyMode::Off`] to
    /// trust the files).
    pub verifier: Option<Arc<Verifier>>,
}

/// Whether a file can be read with `O_DIRECT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirectSupport {
    /// `O_DIRECT` open and aligned read work.
    Direct,
    /// It does not; the reason (e.g. the filesystem refuses `O_DIRECT`).
    Buffered(String),
}

/// Opens `path` with `O_DIRECT` and reads its first block, to learn whether the filesystem
/// supports direct I/O.
pub fn probe_direct(path: &Path) -> DirectSupport {
    // a FIFO in place of the file must not block the probe (the open that follows names it)
    let file = match crate::verify::open_regular(path, libc::O_DIRECT) {
        Ok(f) => f,
        Err(e) => return DirectSupport::Buffered(format!("open with O_DIRECT failed: {e}")),
    };
    let Some(mut buf) = AlignedBuf::new(ALIGN) else {
        return DirectSupport::Buffered("could not allocate an aligned buffer".into());
    };
    match file.read_at(buf.as_mut_slice(), 0) {
        Ok(_) => DirectSupport::Direct,
        Err(e) => DirectSupport::Buffered(format!("O_DIRECT read failed: {e}")),
    }
}

/// Reads of one extent run as up to this many concurrent `pread`s: a deeper queue than one
/// request at a time, which NVMe and virtual disks need to reach their bandwidth.
const READ_PARTS: usize = 4;
/// Smallest piece worth its own concurrent read.
const MIN_PART: usize = 256 << 10;

/// Fills `dst` from `file` at `offset` (both 4 KiB-aligned for `O_DIRECT`), splitting large
/// reads into concurrent aligned pieces. At least `need` bytes must be read (the file may
/// end inside the last 4 KiB block); returns the bytes read.
fn read_extent(file: &File, dst: &mut [u8], offset: u64, need: usize) -> std::io::Result<usize> {
    let parts = (dst.len() / MIN_PART).clamp(1, READ_PARTS);
    let piece = align_up(dst.len().div_ceil(parts) as u64) as usize;
    if parts == 1 || piece >= dst.len() {
        return read_piece(file, dst, offset, need);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = dst
            .chunks_mut(piece)
            .enumerate()
            .map(|(i, chunk)| {
                let at = i * piece;
                let required = need.saturating_sub(at).min(chunk.len());
                s.spawn(move || read_piece(file, chunk, offset + at as u64, required))
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h
                .join()
                .map_err(|_| std::io::Error::other("reader thread panicked"))??;
        }
        Ok(total)
    })
}

/// One `pread` loop: fills `dst` or stops at end of file; fewer than `need` bytes is an
/// error.
fn read_piece(file: &File, dst: &mut [u8], offset: u64, need: usize) -> std::io::Result<usize> {
    let mut got = 0;
    while got < dst.len() {
        match file.read_at(&mut dst[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if got < need {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "file ends at byte {}, {} expected",
                offset + got as u64,
                offset + need as u64
            ),
        ));
    }
    Ok(got)
}

struct LayerFile {
    path: PathBuf,
    file: File,
    size: u64,
    /// BLAKE3 of the file according to the manifest.
    hash: [u8; 32],
    /// Set once the file's bytes were hashed (or the cache vouched for them): until then
    /// no read of it is handed out unverified.
    verified: AtomicBool,
}

#[derive(Default)]
struct Counters {
    bytes_read: AtomicU64,
    acquires: AtomicU64,
    reads: AtomicU64,
    read_ns: AtomicU64,
    wait_ns: AtomicU64,
}

struct Loaded {
    buf: AlignedBuf,
    range: Range<usize>,
}

#[derive(Default)]
struct State {
    /// Streaming buffers nobody uses.
    free: Vec<AlignedBuf>,
    /// Prefetch requests not started yet, in order.
    queue: VecDeque<Span>,
    /// The span the I/O thread is reading.
    loading: Option<Span>,
    /// Prefetched spans nobody has acquired yet (or their read error).
    ready: VecDeque<(Span, Result<Loaded, IoError>)>,
    shutdown: bool,
}

struct Shared {
    files: Vec<LayerFile>,
    buffered: bool,
    /// Buffered reads drop the pages they read (`buffered` and not `keep_cached`).
    drop_pages: bool,
    verifier: Arc<Verifier>,
    counters: Counters,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave State inconsistent in a way that
        // matters more than stopping; keep going with the inner value.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the 4 KiB-aligned extent around `span` into `buf`; returns where the span's
    /// bytes lie in it.
    fn read_span(&self, span: Span, buf: &mut AlignedBuf) -> Result<Range<usize>, IoError> {
        let f = &self.files[span.layer];
        let start = align_down(span.offset);
        let end = align_up(span.offset + span.len).min(align_up(f.size));
        let need = (span.offset + span.len - start) as usize;
        let want = (end - start) as usize;
        if want > buf.capacity() {
            return Err(IoError::SpanTooLarge {
                path: f.path.clone(),
                len: span.len,
                buffer: buf.capacity(),
            });
        }
        let t0 = Instant::now();
        let got = read_extent(&f.file, &mut buf.as_mut_slice()[..want], start, need).map_err(
            |error| IoError::File {
                path: f.path.clone(),
                error,
            },
        )?;
        if self.drop_pages {
            drop_cached(&f.file, start, got as u64);
        }
        let c = &self.counters;
        c.read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.bytes_read.fetch_add(got as u64, Ordering::Relaxed);
        c.reads.fetch_add(1, Ordering::Relaxed);
        let off = (span.offset - start) as usize;
        let range = off..off + span.len as usize;
        if !f.verified.load(Ordering::Acquire) {
            if span.offset == 0 && span.len == f.size {
                // The first whole read of the file: hash the bytes just read.
                self.verifier
                    .check_bytes(&f.path, &buf.as_slice()[range.clone()], &f.hash)?;
                self.verifier.record(&f.file, &f.hash);
                f.verified.store(true, Ordering::Release);
            } else {
                self.verify_whole(f)?;
            }
        }
        Ok(range)
    }

    /// Hashes a whole layer file through a bounded aligned buffer (for files first used in
    /// pieces: embedding rows, head chunks) and marks it verified.
    fn verify_whole(&self, f: &LayerFile) -> Result<(), IoError> {
        const CHUNK: usize = 4 << 20;
        let t0 = Instant::now();
        let io = |error| IoError::File {
            path: f.path.clone(),
            error,
        };
        let mut buf = AlignedBuf::new(CHUNK).ok_or(IoError::OutOfMemory {
            bytes: CHUNK as u64,
        })?;
        let mut h = blake3::Hasher::new();
        let mut off = 0u64;
        while off < f.size {
            let need = (f.size - off).min(CHUNK as u64) as usize;
            let want = align_up(need as u64) as usize;
            let got =
                read_extent(&f.file, &mut buf.as_mut_slice()[..want], off, need).map_err(io)?;
            if self.drop_pages {
                drop_cached(&f.file, off, got as u64);
            }
            h.update(&buf.as_slice()[..need]);
            off += need as u64;
        }
        self.verifier.count_hashed(f.size, t0);
        if *h.finalize().as_bytes() != f.hash {
            return Err(crate::verify::mismatch(&f.path));
        }
        self.verifier.record(&f.file, &f.hash);
        f.verified.store(true, Ordering::Release);
        Ok(())
    }

    fn io_thread(self: Arc<Shared>) {
        let mut st = self.lock();
        loop {
            if st.shutdown {
                return;
            }
            if st.queue.is_empty() || st.free.is_empty() {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let (Some(span), Some(mut buf)) = (st.queue.pop_front(), st.free.pop()) else {
                continue;
            };
            st.loading = Some(span);
            drop(st);
            let r = self.read_span(span, &mut buf);
            st = self.lock();
            st.loading = None;
            match r {
                Ok(range) => st.ready.push_back((span, Ok(Loaded { buf, range }))),
                Err(e) => {
                    st.free.push(buf);
                    st.ready.push_back((span, Err(e)));
                }
            }
            self.cv.notify_all();
        }
    }
}

/// A streaming buffer lent to the runtime; dropping it gives it back to the pool.
struct PoolBuf {
    buf: Option<AlignedBuf>,
    shared: Arc<Shared>,
}

impl Resident for PoolBuf {
    fn bytes(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], AlignedBuf::as_slice)
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.shared.lock().free.push(buf);
            self.shared.cv.notify_all();
        }
    }
}

/// A layer read once and kept.
struct Owned(AlignedBuf, usize);

impl Resident for Owned {
    fn bytes(&self) -> &[u8] {
        &self.0.as_slice()[..self.1]
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(&mut self.0.as_mut_slice()[..self.1])
    }
}

/// Reads layer files with `O_DIRECT`: resident layers once, streamed layers through a pool.
pub struct DirectBackend {
    shared: Arc<Shared>,
    resident: Vec<Option<LayerBytes>>,
    slots: usize,
    slot_size: usize,
    /// Where the streaming buffers are (address, bytes): fixed for the backend's life.
    pool: Vec<(usize, usize)>,
    thread: Option<JoinHandle<()>>,
    warnings: Vec<String>,
    /// Buffer of `read_at`, reused between calls.
    scratch: Mutex<Option<AlignedBuf>>,
}

impl DirectBackend {
    /// Opens every layer file named by `manifest` (checking lengths, naming the file on
    /// failure), reads the resident layers and allocates the streaming pool.
    pub fn open(
        dir: &Path,
        manifest: &Manifest<'_>,
        opts: &DirectOptions,
    ) -> Result<DirectBackend, IoError> {
        let mut warnings = Vec::new();
        let first = manifest.layer(0).ok().map(|l| dir.join(l.file));
        let buffered = if opts.force_buffered {
            true
        } else {
            match first.as_deref().map(probe_direct) {
                Some(DirectSupport::Buffered(why)) => {
                    warnings.push(format!(
                        "{}: {why}; reading through the page cache and dropping the pages after each read",
                        dir.display()
                    ));
                    true
                }
                _ => false,
            }
        };
        let verifier = opts
            .verifier
            .clone()
            .unwrap_or_else(|| Arc::new(Verifier::new(VerifyMode::Hash)));
        let flags = if buffered { 0 } else { libc::O_DIRECT };
        let files: Vec<LayerFile> = crate::mmap::layer_files(dir, manifest, flags)?
            .into_iter()
            .map(|l| LayerFile {
                verified: AtomicBool::new(verifier.is_verified(&l.file, &l.hash)),
                path: l.path,
                file: l.file,
                size: l.size,
                hash: l.hash,
            })
            .collect();
        let slot_size = usize::try_from(align_up(opts.slot_size as u64)).unwrap_or(usize::MAX);
        let mut state = State::default();
        let mut pool = Vec::with_capacity(opts.slots);
        for _ in 0..opts.slots {
            let buf = AlignedBuf::new(slot_size).ok_or(IoError::OutOfMemory {
                bytes: slot_size as u64,
            })?;
            // the memory stays where it is when the buffer moves between lists and handles
            pool.push((buf.as_slice().as_ptr() as usize, buf.capacity()));
            state.free.push(buf);
        }
        let shared = Arc::new(Shared {
            files,
            buffered,
            drop_pages: buffered && !opts.keep_cached,
            verifier,
            counters: Counters::default(),
            state: Mutex::new(state),
            cv: Condvar::new(),
        });
        let mut resident = Vec::with_capacity(shared.files.len());
        for (i, f) in shared.files.iter().enumerate() {
            if !opts.resident.get(i).copied().unwrap_or(false) {
                resident.push(None);
                continue;
            }
            let len =
                usize::try_from(f.size).map_err(|_| IoError::OutOfMemory { bytes: f.size })?;
            let mut buf = AlignedBuf::new(len).ok_or(IoError::OutOfMemory { bytes: f.size })?;
            let span = Span {
                layer: i,
                offset: 0,
                len: f.size,
            };
            shared.read_span(span, &mut buf)?;
            resident.push(Some(LayerBytes::new(i, Arc::new(Owned(buf, len)))));
        }
        let thread = if opts.slots > 0 {
            let s = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("gds-io".into())
                    .spawn(move || s.io_thread())
                    .map_err(|error| IoError::File {
                        path: dir.to_path_buf(),
                        error,
                    })?,
            )
        } else {
            None
        };
        Ok(DirectBackend {
            shared,
            resident,
            slots: opts.slots,
            slot_size,
            pool,
            thread,
            warnings,
            scratch: Mutex::new(None),
        })
    }

    /// The streaming buffers (start address and bytes of each), where every span of a
    /// streamed layer is read and whose bytes [`LayerSource::acquire`] hands out: fixed for
    /// the backend's life, so a caller may page-lock them (CUDA's `cuMemHostRegister`) and
    /// copy acquired bytes to a device straight from them, holding the handle until the copy
    /// is done (the buffer takes no other read while a handle holds it).
    pub fn pool_buffers(&self) -> &[(usize, usize)] {
        &self.pool
    }

    /// True when reads go through the page cache (no `O_DIRECT`).
    pub fn is_buffered(&self) -> bool {
        self.shared.buffered
    }

    /// True when layer `layer` was read at open and stays resident.
    pub fn is_resident(&self, layer: usize) -> bool {
        self.resident.get(layer).is_some_and(Option::is_some)
    }

    fn check(&self, span: &Span) -> Result<(), IoError> {
        let f = self
            .shared
            .files
            .get(span.layer)
            .ok_or(IoError::NoSuchLayer {
                layer: span.layer,
                n_layers: self.shared.files.len(),
            })?;
        if span.offset.checked_add(span.len).is_none_or(|e| e > f.size) {
            return Err(IoError::OutOfRange {
                path: f.path.clone(),
                offset: span.offset,
                len: span.len,
                size: f.size,
            });
        }
        Ok(())
    }

    fn handle(&self, span: Span, l: Loaded) -> LayerBytes {
        LayerBytes::new_span(
            span.layer,
            span.offset,
            l.range,
            Arc::new(PoolBuf {
                buf: Some(l.buf),
                shared: self.shared.clone(),
            }),
        )
    }

    fn acquire_streamed(&self, span: Span) -> Result<LayerBytes, IoError> {
        let sh = &self.shared;
        let t0 = Instant::now();
        let waited = |r| {
            sh.counters
                .wait_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            r
        };
        let mut st = sh.lock();
        let mut blocked = false;
        loop {
            if let Some(i) = st.ready.iter().position(|(s, _)| *s == span) {
                let (_, r) = st.ready.remove(i).expect("index from position");
                drop(st);
                let r = r.map(|l| self.handle(span, l));
                return if blocked { waited(r) } else { r };
            }
            if st.loading == Some(span) {
                blocked = true;
                st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            st.queue.retain(|s| *s != span);
            if let Some(mut buf) = st.free.pop() {
                drop(st);
                let r = sh.read_span(span, &mut buf);
                let r = match r {
                    Ok(range) => Ok(self.handle(span, Loaded { buf, range })),
                    Err(e) => {
                        sh.lock().free.push(buf);
                        sh.cv.notify_all();
                        Err(e)
                    }
                };
                return waited(r);
            }
            // Every buffer is taken: recycle a prefetched span nobody asked for (oldest
            // first), or wait for the I/O thread, or fail if the caller holds them all.
            if let Some((_, stale)) = st.ready.pop_front() {
                if let Ok(l) = stale {
                    st.free.push(l.buf);
                }
                continue;
            }
            if st.loading.is_some() {
                blocked = true;
                st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            return Err(IoError::PoolExhausted {
                slots: self.slots,
                slot_size: self.slot_size,
            });
        }
    }
}

impl Drop for DirectBackend {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl LayerSource for DirectBackend {
    fn resident_mut(&mut self, layer: usize) -> Option<&mut [u8]> {
        self.resident.get_mut(layer)?.as_mut()?.bytes_mut()
    }

    fn name(&self) -> &'static str {
        if self.shared.buffered {
            "buffered"
        } else {
            "direct"
        }
    }

    fn n_layers(&self) -> usize {
        self.shared.files.len()
    }

    fn layer_size(&self, layer: usize) -> u64 {
        self.shared.files.get(layer).map_or(0, |f| f.size)
    }

    fn acquire_span(&self, span: Span) -> Result<LayerBytes, IoError> {
        self.check(&span)?;
        self.shared
            .counters
            .acquires
            .fetch_add(1, Ordering::Relaxed);
        if let Some(Some(r)) = self.resident.get(span.layer) {
            let (a, b) = (span.offset as usize, (span.offset + span.len) as usize);
            return Ok(LayerBytes::new_span(span.layer, span.offset, a..b, r.buf()));
        }
        self.acquire_streamed(span)
    }

    fn read_span(&self, span: Span) -> Result<LayerBytes, IoError> {
        if self.is_resident(span.layer) {
            return self.acquire_span(span);
        }
        self.check(&span)?;
        let sh = &self.shared;
        sh.counters.acquires.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let extent = align_up(span.offset + span.len) - align_down(span.offset);
        let mut buf =
            AlignedBuf::new(extent as usize).ok_or(IoError::OutOfMemory { bytes: extent })?;
        let range = sh.read_span(span, &mut buf)?;
        sh.counters
            .wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let len = range.end;
        Ok(LayerBytes::new_span(
            span.layer,
            span.offset,
            range,
            Arc::new(Owned(buf, len)),
        ))
    }

    fn prefetch(&self, span: Span) {
        if self.check(&span).is_err() || self.is_resident(span.layer) || self.slots == 0 {
            return;
        }
        let mut st = self.shared.lock();
        let known = st.loading == Some(span)
            || st.queue.contains(&span)
            || st.ready.iter().any(|(s, _)| *s == span);
        if known || st.queue.len() >= self.slots {
            return;
        }
        st.queue.push_back(span);
        drop(st);
        self.shared.cv.notify_all();
    }

    fn read_at(&self, layer: usize, offset: u64, out: &mut [u8]) -> Result<(), IoError> {
        let span = Span {
            layer,
            offset,
            len: out.len() as u64,
        };
        self.check(&span)?;
        if let Some(Some(r)) = self.resident.get(layer) {
            out.copy_from_slice(&r[offset as usize..offset as usize + out.len()]);
            return Ok(());
        }
        let t0 = Instant::now();
        let extent = align_up(offset + span.len) - align_down(offset) + ALIGN as u64;
        // one small buffer kept for these reads (embedding rows, every token), grown on need
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch
            .as_ref()
            .is_none_or(|b| (b.capacity() as u64) < extent)
        {
            *scratch = Some(
                AlignedBuf::new(extent as usize).ok_or(IoError::OutOfMemory { bytes: extent })?,
            );
        }
        let buf = scratch.as_mut().expect("allocated above");
        let range = self.shared.read_span(span, buf)?;
        out.copy_from_slice(&buf.as_slice()[range]);
        self.shared
            .counters
            .wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn stats(&self) -> IoStats {
        let c = &self.shared.counters;
        IoStats {
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            acquires: c.acquires.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            read_ns: c.read_ns.load(Ordering::Relaxed),
            wait_ns: c.wait_ns.load(Ordering::Relaxed),
            ..IoStats::default()
        }
    }

    fn warnings(&self) -> Vec<String> {
        self.warnings.clone()
    }
}

/// The filesystem type holding `path` (from `statfs`), e.g. `ext4/ext3/ext2`, `tmpfs`,
/// `xfs`; `None` when it cannot be asked; the hex magic number when unknown.
pub fn filesystem_name(path: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs is plain old data; all-zero is a valid value to be overwritten.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statfs for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libc targets
    let magic = st.f_type as u64;
    Some(
        match magic {
            0xEF53 => "ext4/ext3/ext2",
            0x5846_5342 => "xfs",
            0x9123_683E => "btrfs",
            0x0102_1994 => "tmpfs",
            0x794C_7630 => "overlayfs",
            0x6969 => "nfs",
            0x6573_5546 => "fuse",
            0x2FC1_2FC1 => "zfs",
            0xF2F5_2010 => "f2fs",
            0x0000_9fa0 => "proc",
            _ => return Some(format!("unknown (0x{magic:x})")),
        }
        .to_string(),
    )
}

/// A measured sequential read.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct ReadBench {
    /// Bytes read.
    pub bytes: u64,
    /// Seconds it took.
    pub secs: f64,
}

impl ReadBench {
    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        if self.secs > 0.0 {
            self.bytes as f64 / self.secs
        } else {
            0.0
        }
    }
}

/// Reads `files` front to back in `block`-byte reads, again and again (at most 16 passes)
/// until `max_bytes`, with `O_DIRECT` or, when `direct` is false, through the page cache
/// from cold (pages are dropped before and after). What a cold model load sees, sustained
/// long enough that a disk's short burst does not dominate.
pub fn measure_read(
    files: &[PathBuf],
    direct: bool,
    block: usize,
    max_bytes: u64,
) -> Result<ReadBench, IoError> {
    let file_err = |path: &Path| {
        let path = path.to_path_buf();
        move |error| IoError::File { path, error }
    };
    let mut buf = AlignedBuf::new(block).ok_or(IoError::OutOfMemory {
        bytes: block as u64,
    })?;
    let mut total = 0u64;
    let mut secs = 0.0;
    let passes = files.iter().cycle().take(files.len() * 16);
    for path in passes {
        if total >= max_bytes {
            break;
        }
        let f = crate::verify::open_regular(path, if direct { libc::O_DIRECT } else { 0 })?;
        if !direct {
            drop_cached(&f, 0, 0);
        }
        let size = f.metadata().map_err(file_err(path))?.len();
        let t0 = Instant::now();
        let mut off = 0u64;
        while off < size && total < max_bytes {
            let n = (align_up(size - off) as usize).min(buf.capacity());
            let need = ((size - off) as usize).min(n);
            let got =
                read_extent(&f, &mut buf.as_mut_slice()[..n], off, need).map_err(file_err(path))?;
            if got == 0 {
                break;
            }
            off += got as u64;
            total += got as u64;
        }
        secs += t0.elapsed().as_secs_f64();
        if !direct {
            drop_cached(&f, 0, 0);
        }
    }
    Ok(ReadBench { bytes: total, secs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gds_format::{DType, LayerRecord, ManifestBuilder, TensorSpec};

    /// A model directory with `n` layer files of `blocks` 4 KiB blocks each; byte `i` of
    /// layer `l` is `(i * 7 + l * 13) % 251`.
    fn model_dir(n: usize, blocks: usize) -> (tempfile::TempDir, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let mut b = ManifestBuilder::new();
        b.kv_str("general.architecture", "llama");
        for l in 0..n {
            let file = format!("l{l}.bin");
            let data: Vec<u8> = (0..blocks * ALIGN)
                .map(|i| ((i * 7 + l * 13) % 251) as u8)
                .collect();
            std::fs::write(dir.path().join(&file), &data).unwrap();
            let spec = TensorSpec {
                name: format!("t{l}"),
                dtype: DType::F32,
                shape: vec![(blocks * ALIGN / 4) as u64],
            };
            let layout = gds_format::layout(std::slice::from_ref(&spec)).unwrap();
            b.add_layer(&LayerRecord {
                name: format!("l{l}"),
                file,
                kind: gds_format::layer_kind::BLOCK,
                index: l as u32,
                tensors: vec![spec],
                layout,
                content_hash: *blake3::hash(&data).as_bytes(),
            });
        }
        (dir, b.finish())
    }

    fn expect(l: usize, range: Range<usize>) -> Vec<u8> {
        range.map(|i| ((i * 7 + l * 13) % 251) as u8).collect()
    }

    fn span(layer: usize, offset: u64, len: u64) -> Span {
        Span { layer, offset, len }
    }

    /// Options without a verifier (each test's files are new) that drop the pages they read.
    fn options(
        resident: Vec<bool>,
        slots: usize,
        slot_size: usize,
        force_buffered: bool,
    ) -> DirectOptions {
        DirectOptions {
            resident,
            slots,
            slot_size,
            force_buffered,
            keep_cached: false,
            verifier: None,
        }
    }

    fn open(dir: &Path, m: &[u8], opts: DirectOptions) -> DirectBackend {
        DirectBackend::open(dir, &Manifest::parse(m).unwrap(), &opts).unwrap()
    }

    #[test]
    fn resident_and_streamed_layers_read_the_file_bytes() {
        let (dir, m) = model_dir(3, 3);
        for force_buffered in [false, true] {
            let b = open(
                dir.path(),
                &m,
                options(vec![true, false, false], 2, 3 * ALIGN, force_buffered),
            );
            assert!(b.is_resident(0) && !b.is_resident(1));
            let after_open = b.stats().bytes_read;
            assert_eq!(after_open, 3 * ALIGN as u64, "layer 0 read once at open");
            for l in 0..3 {
                let h = b.acquire(l).unwrap();
                assert_eq!(&h[..], &expect(l, 0..3 * ALIGN)[..], "layer {l}");
            }
            // an unaligned span of a streamed layer: exactly its bytes
            let h = b.acquire_span(span(2, 5000, 3000)).unwrap();
            assert_eq!(h.file_offset(), 5000);
            assert_eq!(&h[..], &expect(2, 5000..8000)[..]);
            assert_eq!(h.slice(6000, 10).unwrap(), &expect(2, 6000..6010)[..]);
            assert!(h.slice(4000, 10).is_none());
            let mut row = [0u8; 100];
            b.read_at(1, 12000, &mut row).unwrap();
            assert_eq!(&row[..], &expect(1, 12000..12100)[..]);
            assert!(b.stats().reads >= 4);
        }
    }

    /// `read_span` reads into memory of its own: spans larger than a streaming buffer,
    /// unaligned ones, several threads at once while a buffer is held; a resident layer's
    /// bytes are handed out without a read.
    #[test]
    fn spans_read_apart_from_the_stream_are_exactly_the_file_bytes() {
        let (dir, m) = model_dir(3, 8);
        for force_buffered in [false, true] {
            let b = open(
                dir.path(),
                &m,
                options(vec![true, false, false], 1, ALIGN, force_buffered),
            );
            // the only streaming buffer is taken: read_span does not need it
            let held = b.acquire_span(span(1, 0, ALIGN as u64)).unwrap();
            let spans = [
                (1, 0, 8 * ALIGN),
                (2, 4097, 20000),
                (2, 123, 5),
                (1, 8191, 1),
            ];
            let before = b.stats().bytes_read;
            std::thread::scope(|s| {
                for &(l, off, len) in &spans {
                    let b = &b;
                    s.spawn(move || {
                        let h = b.read_span(span(l, off as u64, len as u64)).unwrap();
                        assert_eq!(h.index(), l);
                        assert_eq!(h.file_offset(), off as u64);
                        assert_eq!(&h[..], &expect(l, off..off + len)[..], "{l} {off} {len}");
                    });
                }
            });
            assert!(b.stats().bytes_read >= before + 8 * ALIGN as u64 + 20000);
            let before = b.stats().bytes_read;
            let h = b.read_span(span(0, 100, 300)).unwrap();
            assert_eq!(&h[..], &expect(0, 100..400)[..]);
            assert_eq!(b.stats().bytes_read, before, "resident: no read");
            assert!(b.read_span(span(2, 8 * ALIGN as u64 - 1, 2)).is_err());
            drop(held);
        }
    }

    #[test]
    fn prefetched_spans_are_read_once_by_the_io_thread() {
        let (dir, m) = model_dir(4, 2);
        let b = open(dir.path(), &m, options(vec![], 3, 2 * ALIGN, false));
        for round in 0..3 {
            for l in 0..4 {
                // prefetch the next two, then take this one: the pattern of the runtime
                b.prefetch(span((l + 1) % 4, 0, 2 * ALIGN as u64));
                b.prefetch(span((l + 2) % 4, 0, 2 * ALIGN as u64));
                let h = b.acquire(l).unwrap();
                assert_eq!(
                    &h[..],
                    &expect(l, 0..2 * ALIGN)[..],
                    "round {round} layer {l}"
                );
            }
        }
        let s = b.stats();
        assert_eq!(s.acquires, 12);
        // every acquire was served by one read (prefetched or not), plus at most the
        // two still-pending prefetches at the end
        assert!((12..=14).contains(&s.reads), "{s:?}");
        assert_eq!(s.bytes_read, s.reads * 2 * ALIGN as u64);
    }

    #[test]
    fn large_reads_split_into_concurrent_pieces_read_the_same_bytes() {
        // 300 blocks = 1.2 MB: four concurrent pieces per read
        let (dir, m) = model_dir(2, 300);
        for force_buffered in [false, true] {
            let b = open(
                dir.path(),
                &m,
                options(vec![true, false], 2, 300 * ALIGN, force_buffered),
            );
            for l in 0..2 {
                assert_eq!(&b.acquire(l).unwrap()[..], &expect(l, 0..300 * ALIGN)[..]);
            }
            let h = b.acquire_span(span(1, 123_457, 777_777)).unwrap();
            assert_eq!(&h[..], &expect(1, 123_457..123_457 + 777_777)[..]);
        }
        let files: Vec<PathBuf> = (0..2)
            .map(|l| dir.path().join(format!("l{l}.bin")))
            .collect();
        let r = measure_read(&files, true, 1 << 20, 3 * 300 * ALIGN as u64).unwrap();
        assert_eq!(
            r.bytes,
            3 * 300 * ALIGN as u64,
            "a second pass when one is not enough"
        );
    }

    #[test]
    fn buffered_reads_drop_their_pages_unless_asked_to_keep_them() {
        // The GPU's `--io mmap` keeps streamed layers in the page cache (the RAM tier); the
        // CPU's buffered fallback drops them so the memory budget holds.
        let (dir, m) = model_dir(2, 64);
        let file = dir.path().join("l1.bin");
        for keep_cached in [false, true] {
            crate::pagecache::evict(&file).unwrap();
            let b = open(
                dir.path(),
                &m,
                DirectOptions {
                    resident: vec![true, false],
                    slots: 2,
                    slot_size: 64 * ALIGN,
                    force_buffered: true,
                    keep_cached,
                    verifier: None,
                },
            );
            assert_eq!(&b.acquire(1).unwrap()[..], &expect(1, 0..64 * ALIGN)[..]);
            let (cached, total) = crate::pagecache::cached_pages(&file).unwrap();
            if keep_cached {
                assert_eq!(cached, total, "keep_cached leaves every page read cached");
            } else {
                assert_eq!(cached, 0, "buffered reads drop their pages");
            }
        }
    }

    #[test]
    fn streamed_bytes_are_handed_out_from_the_pool_buffers() {
        // what the GPU's bounce path page-locks: every streamed layer's bytes lie in one of
        // the pool's buffers, a held one is not read into again
        let (dir, m) = model_dir(3, 64);
        for force_buffered in [false, true] {
            let b = open(
                dir.path(),
                &m,
                options(vec![], 2, 64 * ALIGN, force_buffered),
            );
            let pool = b.pool_buffers().to_vec();
            assert_eq!(pool.len(), 2);
            assert!(pool.iter().all(|&(a, n)| n >= 64 * ALIGN && a % ALIGN == 0));
            assert!(pool[0].0 + pool[0].1 <= pool[1].0 || pool[1].0 + pool[1].1 <= pool[0].0);
            let inside = |h: &crate::LayerBytes| {
                let (p, n) = (h.as_ptr() as usize, h.len());
                pool.iter().position(|&(a, len)| p >= a && p + n <= a + len)
            };
            // each layer acquired while the previous one's handle is still held (as a copy
            // to the device still reading it), the next one read ahead meanwhile
            let mut held: Option<(usize, crate::LayerBytes)> = None;
            let order = [0, 1, 2, 0, 1, 2];
            for (k, &l) in order.iter().enumerate().take(5) {
                let h = b.acquire(l).unwrap();
                assert_eq!(&h[..], &expect(l, 0..64 * ALIGN)[..]);
                let i = inside(&h).expect("bytes outside the pool");
                if let Some((prev, _)) = held {
                    assert_ne!(i, prev, "a held buffer was read into");
                }
                held = Some((i, h));
                b.prefetch(span(order[k + 1], 0, 64 * ALIGN as u64));
            }
        }
    }

    #[test]
    fn holding_every_buffer_is_an_error_not_a_hang() {
        let (dir, m) = model_dir(3, 1);
        let b = open(dir.path(), &m, options(vec![], 2, ALIGN, false));
        let _a = b.acquire(0).unwrap();
        let _b = b.acquire(1).unwrap();
        assert!(matches!(
            b.acquire(2),
            Err(IoError::PoolExhausted { slots: 2, .. })
        ));
        drop(_a);
        assert_eq!(&b.acquire(2).unwrap()[..], &expect(2, 0..ALIGN)[..]);
    }

    #[test]
    fn bad_spans_name_the_file() {
        let (dir, m) = model_dir(1, 1);
        let b = open(dir.path(), &m, options(vec![], 1, ALIGN, false));
        let e = b.acquire_span(span(0, 4000, 200)).unwrap_err();
        assert!(e.to_string().contains("l0.bin"), "{e}");
        // a span that is inside the file but does not fit a buffer once aligned
        let (dir2, m2) = model_dir(1, 3);
        let b2 = open(dir2.path(), &m2, options(vec![], 1, ALIGN, false));
        assert!(matches!(b2.acquire(0), Err(IoError::SpanTooLarge { .. })));
        assert!(matches!(b.acquire(3), Err(IoError::NoSuchLayer { .. })));
    }
}
