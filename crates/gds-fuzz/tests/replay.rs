//! Corpus replay on stable: every file in `fuzz/seeds/<target>/` and
//! `fuzz/regressions/<target>/` goes through the same entry point as the fuzz target
//! (`gds_fuzz::<target>`), under a global allocator that refuses to hold more than
//! [`CAP`] bytes at once, so a reader that allocates by a hostile length aborts this test
//! (naming the input) instead of exhausting the machine.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Most bytes the whole test process may hold at once. The inputs are a few KiB; the
/// readers' fixed buffers (gguf's 1 MiB read buffer) fit many times over.
const CAP: usize = 256 << 20;

static LIVE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The input this thread is replaying, for the refusal message.
    static CURRENT: Cell<&'static str> = const { Cell::new("") };
}

/// [`System`], refusing any allocation that would take the live total past [`CAP`].
struct Capped;

impl Capped {
    fn reserve(&self, n: usize) -> bool {
        let mut live = LIVE.load(Ordering::Relaxed);
        loop {
            let Some(next) = live.checked_add(n).filter(|&t| t <= CAP) else {
                let input = CURRENT.try_with(Cell::get).unwrap_or("");
                if !input.is_empty() {
                    // Straight to stderr (not captured by the test harness, and without
                    // allocating): the process aborts right after.
                    let _ = writeln!(
                        std::io::stderr(),
                        "replay: refused an allocation of {n} bytes ({live} live, cap {CAP}) \
                         while replaying {input}"
                    );
                }
                return false;
            };
            match LIVE.compare_exchange_weak(live, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => live = now,
            }
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's layout and pointer unchanged;
// the counter only decides whether to forward (returning null, which callers must handle, when
// it does not).
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !self.reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout (non-zero size, per GlobalAlloc's contract).
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (we forward every allocation).
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !self.reserve(new_size - old) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` was allocated by `System` with `layout`; `new_size` is the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            if new_size > old {
                LIVE.fetch_sub(new_size - old, Ordering::Relaxed);
            }
        } else if new_size < old {
            LIVE.fetch_sub(old - new_size, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.expect("directory entry").path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

/// Feeds every seed and regression input of `target` to its entry point; fails listing every
/// input that panicked, and when the target has no seeds at all.
fn replay(target: &str) {
    let seeds = files_in(&fuzz_dir().join("seeds").join(target));
    assert!(
        !seeds.is_empty(),
        "fuzz/seeds/{target}/ is empty or missing (scripts/fuzz-seeds.sh --curated makes it)"
    );
    let regressions = files_in(&fuzz_dir().join("regressions").join(target));
    let mut failed = Vec::new();
    for path in seeds.iter().chain(&regressions) {
        let bytes = std::fs::read(path).expect("read input");
        let name: &'static str = Box::leak(path.display().to_string().into_boxed_str());
        CURRENT.with(|c| c.set(name));
        let ok = catch_unwind(AssertUnwindSafe(|| {
            assert!(gds_fuzz::run(target, &bytes), "no target {target}")
        }))
        .is_ok();
        CURRENT.with(|c| c.set(""));
        if !ok {
            failed.push(name);
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} {target} inputs panicked: {failed:#?}",
        failed.len(),
        seeds.len() + regressions.len()
    );
}

#[test]
fn replay_manifest() {
    replay("manifest");
}

#[test]
fn replay_gguf() {
    replay("gguf");
}

#[test]
fn replay_safetensors() {
    replay("safetensors");
}

#[test]
fn replay_tokenizer() {
    replay("tokenizer");
}

/// The cap is real: a request past it fails (without the capped allocator this succeeds on
/// any machine with overcommit), and a small one still succeeds.
#[test]
fn allocation_past_the_cap_is_refused() {
    let mut big: Vec<u8> = Vec::new();
    assert!(big.try_reserve_exact(CAP + 1).is_err());
    let mut small: Vec<u8> = Vec::new();
    assert!(small.try_reserve_exact(1 << 20).is_ok());
}
