//! 4 KiB-aligned heap buffers: what `O_DIRECT` reads need (buffer address, file offset and
//! length all multiples of the device's logical block size; 4 KiB covers every device).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of direct-I/O buffers, offsets and lengths.
pub const ALIGN: usize = 4096;

/// Rounds `x` down to a multiple of [`ALIGN`].
pub fn align_down(x: u64) -> u64 {
    x & !(ALIGN as u64 - 1)
}

/// Rounds `x` up to a multiple of [`ALIGN`] (saturating).
pub fn align_up(x: u64) -> u64 {
    x.saturating_add(ALIGN as u64 - 1) & !(ALIGN as u64 - 1)
}

/// Buffers of at least this many bytes are mapped on their own, aligned to it, and asked to
/// be backed by transparent huge pages (`MADV_HUGEPAGE`): a model's weights read into
/// memory then take one TLB entry per 2 MiB instead of per 4 KiB.
pub const HUGE: usize = 2 << 20;

/// Whether this kernel backs memory advised with `MADV_HUGEPAGE` by transparent huge pages
/// (`/sys/kernel/mm/transparent_hugepage/enabled` says `[always]` or `[madvise]`).
pub fn huge_pages_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
}

/// A zero-initialized heap buffer whose address and capacity are multiples of [`ALIGN`]
/// ([`HUGE`] for large ones).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    /// The anonymous mapping holding a large buffer (its start and length), `None` for a
    /// heap allocation.
    map: Option<(NonNull<u8>, usize)>,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>); shared access only
// hands out `&[u8]`, mutation needs `&mut self`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: `&AlignedBuf` only allows reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes rounded up to [`ALIGN`] (at least one block). Returns `None`
    /// when the allocator refuses.
    pub fn new(len: usize) -> Option<AlignedBuf> {
        let cap = usize::try_from(align_up(len.max(1) as u64)).ok()?;
        if cap >= HUGE {
            return AlignedBuf::mapped(cap);
        }
        let layout = Layout::from_size_align(cap, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size (cap >= ALIGN).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| AlignedBuf {
            ptr,
            cap,
            map: None,
        })
    }

    /// `cap` bytes at a [`HUGE`]-aligned address inside an anonymous mapping of `cap +
    /// HUGE`, advised to use huge pages before anything touches them (the kernel's zero
    /// pages; where transparent huge pages are off the advice fails and 4 KiB pages serve).
    fn mapped(cap: usize) -> Option<AlignedBuf> {
        let len = cap.checked_add(HUGE)?;
        // SAFETY: a new private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = NonNull::new(base.cast::<u8>())?;
        let skip = (HUGE - base.as_ptr() as usize % HUGE) % HUGE;
        // SAFETY: `skip < HUGE`, so `base + skip .. + cap` lies inside the mapping of `cap +
        // HUGE` bytes.
        let ptr = unsafe { NonNull::new_unchecked(base.as_ptr().add(skip)) };
        // SAFETY: the range is inside the mapping and untouched; the advice only changes how
        // its pages are backed (a failure leaves 4 KiB pages, also zeroed).
        unsafe { libc::madvise(ptr.as_ptr().cast(), cap, libc::MADV_HUGEPAGE) };
        Some(AlignedBuf {
            ptr,
            cap,
            map: Some((base, len)),
        })
    }

    /// Capacity in bytes (a multiple of [`ALIGN`]).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The whole buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of cap initialized (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    /// The whole buffer, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some((base, len)) = self.map {
            // SAFETY: the mapping made in `mapped`, unmapped once; nothing borrows it now.
            unsafe { libc::munmap(base.as_ptr().cast(), len) };
            return;
        }
        // SAFETY: allocated in `new` with exactly this layout (cap, ALIGN), freed once.
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.cap, ALIGN),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_rounded() {
        let mut b = AlignedBuf::new(5000).unwrap();
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[8191] = 7;
        assert_eq!(b.as_slice()[8191], 7);
        assert_eq!(AlignedBuf::new(0).unwrap().capacity(), ALIGN);
        // large buffers: their own mapping, HUGE-aligned, zeroed, writable to the end
        let mut h = AlignedBuf::new(HUGE + 5000).unwrap();
        assert_eq!(h.capacity(), HUGE + 8192);
        assert_eq!(h.as_slice().as_ptr() as usize % HUGE, 0);
        assert!(h.as_slice().iter().all(|&x| x == 0));
        let end = h.capacity() - 1;
        h.as_mut_slice()[end] = 9;
        assert_eq!(h.as_slice()[end], 9);
        assert_eq!(
            (align_down(4097), align_up(4097), align_up(4096)),
            (4096, 8192, 4096)
        );
    }
}
