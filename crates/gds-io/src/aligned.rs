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

/// A zero-initialized heap buffer whose address and capacity are multiples of [`ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
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
        let layout = Layout::from_size_align(cap, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size (cap >= ALIGN).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| AlignedBuf { ptr, cap })
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
        assert_eq!(
            (align_down(4097), align_up(4097), align_up(4096)),
            (4096, 8192, 4096)
        );
    }
}
