//! What the kernel benchmarks share: deterministic test values and CPU-time clocks.

use std::time::Duration;

/// `n` deterministic values in [-0.1, 0.1) from `seed` (a 64-bit LCG).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

/// The CPU time of `clock` (`libc::CLOCK_THREAD_CPUTIME_ID`: the calling thread's, which
/// does not count the time slices other processes take on a shared machine;
/// `libc::CLOCK_PROCESS_CPUTIME_ID`: every thread of this process).
pub fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
