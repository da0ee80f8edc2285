//! What the page cache holds of a file (`mincore`) and how to drop it
//! (`POSIX_FADV_DONTNEED`): for checking that `O_DIRECT` streaming leaves no weights
//! behind, and for measuring cold reads.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// `(resident pages, total pages)` of `path` in the page cache.
pub fn cached_pages(path: &Path) -> std::io::Result<(usize, usize)> {
    let file = File::open(path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok((0, 0));
    }
    // SAFETY: a read-only private mapping that is never dereferenced here: mincore only
    // asks the kernel which of its pages are resident.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let pages = len.div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: the address and length describe the live mapping `map`, and `vec` has one
    // byte per page of it, as mincore requires.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((vec.iter().filter(|&&b| b & 1 == 1).count(), pages))
}

/// Writes back and drops the page-cache pages of `path` (clean pages go at once; the
/// kernel may keep pages that are mapped by some process).
pub fn evict(path: &Path) -> std::io::Result<()> {
    let file = File::open(path)?;
    file.sync_all()?;
    drop_cached(&file, 0, 0);
    Ok(())
}

/// Drops the page-cache pages of a byte range of `file` (a hint; failures are ignored).
pub(crate) fn drop_cached(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is open for the call.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn written_pages_are_cached_until_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        std::fs::File::create(&p)
            .unwrap()
            .write_all(&vec![7u8; 64 * 1024])
            .unwrap();
        let (_, total) = cached_pages(&p).unwrap();
        assert_eq!(total, 16);
        evict(&p).unwrap();
        let (after, _) = cached_pages(&p).unwrap();
        // tmpfs cannot drop pages (they are the file); a disk filesystem drops them all
        assert!(after == 0 || after == total, "{after} of {total}");
    }
}
