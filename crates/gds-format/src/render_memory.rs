//! A memory bound for code from a model file (chat templates): work run by [`run_bounded`]
//! may hold at most [`MAX_RENDER_BYTES`] at once.
//!
//! minijinja bounds instructions (fuel) but not the size of the values an instruction
//! builds: `+` and `~` of two strings, or `+` of two lists, double a value per instruction,
//! so a template that doubles a string in a loop reaches gigabytes in a few dozen
//! instructions. No hook in the engine sees those operations, so the bound is kept where
//! every byte passes: the global allocator. [`TemplateAllocator`] (installed by the
//! binaries, `#[global_allocator]`) counts the bytes held by a thread that [`run_bounded`]
//! started; an allocation that would take it past the bound is never made: the thread is
//! parked for good instead (an allocator cannot fail an allocation without aborting the
//! process), the caller gets an error, and the parked thread's memory (under the bound) is
//! abandoned with it. After [`MAX_ABANDONED`] such threads every bounded run is refused, so
//! what a hostile file can take is bounded too.
//!
//! In a program that does not install [`TemplateAllocator`] the work runs unbounded in memory
//! (and [`bounded`] says so).
//!
//! Time is bounded the same way: fuel counts instructions, but one instruction's time grows
//! with the values it reads (`big | length`, `x in big`, `big.find(..)` over a string the
//! template built: fuel's 2 million of them over a 1.6 MB string took over 240 s with
//! `big.find("x")`). A run still going
//! after [`MAX_RUN_SECONDS`] is given up on: the caller gets an error, the thread's priority
//! drops to the lowest (nice 19), and its next allocation parks it for good, as over the
//! memory bound; it counts towards [`MAX_ABANDONED`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Most bytes a bounded run may hold at once (a real chat template's render holds a few
/// times its messages and output; the output is capped at 16 MiB).
pub const MAX_RENDER_BYTES: usize = 64 << 20;
/// Runs that went over the bound (their threads parked, their memory abandoned) or past the
/// time limit before every bounded run is refused.
pub const MAX_ABANDONED: usize = 8;
/// The longest a chat template's compile or render may take, in seconds of wall time, unless
/// `GDS_TEMPLATE_SECONDS` says otherwise ([`run_limit`]; a real chat template renders in
/// milliseconds, a conversation of thousands of messages in well under a second).
pub const MAX_RUN_SECONDS: u64 = 10;

/// The time limit of a chat template's runs: `GDS_TEMPLATE_SECONDS` (seconds, fractions
/// allowed, more than 0) when set and valid, else [`MAX_RUN_SECONDS`].
pub fn run_limit() -> Duration {
    static LIMIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("GDS_TEMPLATE_SECONDS")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e6)
            .map_or(
                Duration::from_secs(MAX_RUN_SECONDS),
                Duration::from_secs_f64,
            )
    })
}

/// The bound in force ([`MAX_RENDER_BYTES`] unless [`set_bound`] changed it).
static BOUND: AtomicUsize = AtomicUsize::new(MAX_RENDER_BYTES);

/// Sets the bytes a bounded run may hold (at least 1 MiB): lower it where the process's
/// memory is capped as a whole (the fuzz targets: [`MAX_ABANDONED`] parked runs must fit
/// under their cap beside the work).
pub fn set_bound(bytes: usize) {
    BOUND.store(bytes.max(1 << 20), Ordering::Relaxed);
}

/// The bytes a bounded run may hold.
pub fn bound() -> usize {
    BOUND.load(Ordering::Relaxed)
}

/// The bytes one bounded thread holds, and whether it went over.
#[derive(Default)]
struct Budget {
    live: AtomicUsize,
    over: AtomicBool,
    /// Past its time: parked at its next allocation.
    late: AtomicBool,
    /// The thread's kernel id (0 until it has started).
    tid: std::sync::atomic::AtomicI32,
}

thread_local! {
    /// The budget of the bounded run on this thread (null: not bounded). Const-initialized
    /// and without a destructor, so the allocator can read it at any time.
    static BUDGET: Cell<*const Budget> = const { Cell::new(std::ptr::null()) };
}

/// Whether [`TemplateAllocator`] has served an allocation (it is installed).
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// Bounded runs that went over and were abandoned.
static ABANDONED: AtomicUsize = AtomicUsize::new(0);

/// The budget of this thread's bounded run, if any.
fn budget() -> Option<&'static Budget> {
    let p = BUDGET.try_with(Cell::get).unwrap_or(std::ptr::null());
    // SAFETY: a non-null pointer was set by `run_bounded`'s thread from an `Arc<Budget>` that
    // thread owns until it clears the pointer (or for ever, once parked), so it is valid for
    // as long as this thread can observe it.
    unsafe { p.as_ref() }
}

/// Counts `n` more bytes held by this thread; parks it for good (after flagging its budget)
/// when that takes a bounded run past its [`bound`].
fn charge(n: usize) {
    let Some(b) = budget() else { return };
    if b.late.load(Ordering::Relaxed) {
        park();
    }
    let live = b.live.fetch_add(n, Ordering::Relaxed).saturating_add(n);
    if live > bound() {
        b.over.store(true, Ordering::Release);
        // (the waiting caller sees `over` and gives up on us)
        park();
    }
}

/// Parks this thread for good (sleeping allocates nothing).
fn park() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn uncharge(n: usize) {
    if let Some(b) = budget() {
        let _ = b
            .live
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
    }
}

/// A global allocator (around `A`, by default [`System`]) that keeps the bound of
/// [`run_bounded`]. Install it in every binary that loads model files:
/// `#[global_allocator] static A: TemplateAllocator = TemplateAllocator(System);`
pub struct TemplateAllocator<A = System>(pub A);

// SAFETY: every call is passed to the inner allocator unchanged; the accounting around it
// reads a const thread-local and atomics and never allocates, and a charge over the bound
// never returns (the thread sleeps), so no layout or pointer is altered.
unsafe impl<A: GlobalAlloc> GlobalAlloc for TemplateAllocator<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
        charge(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        uncharge(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            charge(new_size - layout.size());
        } else {
            uncharge(layout.size() - new_size);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.realloc(ptr, layout, new_size) }
    }
}

/// Whether bounded runs are bounded in this program ([`TemplateAllocator`] is installed).
pub fn bounded() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Why a bounded run gave no result.
#[derive(Debug, PartialEq, Eq)]
pub enum RunError {
    /// It went over [`MAX_RENDER_BYTES`] and was abandoned.
    Memory,
    /// [`MAX_ABANDONED`] runs went over before: no more are started.
    Exhausted,
    /// It ran past [`MAX_RUN_SECONDS`] (the limit it was given) and was abandoned.
    Time(Duration),
    /// Its thread could not be started (the reason).
    Spawn(String),
    /// It panicked.
    Panicked,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Memory => write!(
                f,
                "it held more than {} MiB of values at once (a string or list grown without bound) and was stopped",
                bound() >> 20
            ),
            RunError::Exhausted => write!(
                f,
                "{MAX_ABANDONED} chat template runs went past their memory or time bound in this process; no more are run (restart it)"
            ),
            RunError::Time(limit) => write!(
                f,
                "it ran longer than {} s (a loop over a large value) and was stopped",
                limit.as_secs_f64()
            ),
            RunError::Spawn(e) => write!(f, "cannot start a thread for it: {e}"),
            RunError::Panicked => f.write_str("it panicked"),
        }
    }
}

/// Runs `f` on a thread of its own with a `stack` byte stack, holding at most
/// [`MAX_RENDER_BYTES`] at once and for at most `limit` (see the module docs;
/// [`MAX_RUN_SECONDS`] for chat templates).
pub fn run_bounded<T: Send + 'static>(
    name: &str,
    stack: usize,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    let deadline = std::time::Instant::now() + limit;
    if ABANDONED.load(Ordering::Relaxed) >= MAX_ABANDONED {
        return Err(RunError::Exhausted);
    }
    let budget = Arc::new(Budget::default());
    let mine = budget.clone();
    let (tx, rx) = mpsc::sync_channel(1);
    let handle = std::thread::Builder::new()
        .name(name.into())
        .stack_size(stack)
        .spawn(move || {
            /// Clears the thread's budget before the budget is dropped, also on a panic.
            struct Clear;
            impl Drop for Clear {
                fn drop(&mut self) {
                    let _ = BUDGET.try_with(|b| b.set(std::ptr::null()));
                }
            }
            let (mine, tx, f) = (mine, tx, f);
            // SAFETY: gettid takes no argument and cannot fail.
            mine.tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
            BUDGET.with(|b| b.set(Arc::as_ptr(&mine)));
            // (declared after `mine`, so dropped before it)
            let _clear = Clear;
            let _ = tx.send(f());
        })
        .map_err(|e| RunError::Spawn(e.to_string()))?;
    loop {
        // (a result wakes this at once; the timeout only bounds how late `over` is seen)
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(r) => {
                let _ = handle.join();
                return Ok(r);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(RunError::Panicked),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if budget.over.load(Ordering::Acquire) {
                    ABANDONED.fetch_add(1, Ordering::Relaxed);
                    return Err(RunError::Memory);
                }
                if std::time::Instant::now() >= deadline {
                    budget.late.store(true, Ordering::Relaxed);
                    let tid = budget.tid.load(Ordering::Relaxed);
                    if tid > 0 {
                        // SAFETY: setpriority reads its three integer arguments only; on Linux
                        // PRIO_PROCESS with a thread id sets that thread's nice value (an
                        // error, e.g. the thread already gone, changes nothing).
                        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) };
                    }
                    ABANDONED.fetch_add(1, Ordering::Relaxed);
                    return Err(RunError::Time(limit));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run past its limit is given up on: an error naming the limit, at once; the work
    /// left behind ends by itself here (without the allocator installed nothing parks it).
    #[test]
    fn a_run_past_its_time_is_abandoned_with_an_error() {
        let limit = Duration::from_millis(100);
        let r = run_bounded("slow", 1 << 20, limit, || {
            std::thread::sleep(Duration::from_secs(2));
            7
        });
        let e = r.expect_err("past its time");
        assert_eq!(e, RunError::Time(limit));
        assert!(e.to_string().contains("longer than 0.1 s"), "{e}");
        // a quick run under the same limit gives its result
        assert_eq!(run_bounded("quick", 1 << 20, limit, || 7), Ok(7));
    }
}
