//! Where a pass's GPU time goes, kernel by kernel, without nsys (which the lent GPU machines
//! lack): with `GDS_CUDA_PROFILE=1` the executor synchronizes the compute stream around every
//! kernel launch and cuBLAS call, adds the host-measured time to the kernel's name, and prints
//! the table to stderr when the model is dropped. The synchronization serializes what would
//! overlap and adds a few microseconds a call, and CUDA graphs are off meanwhile: the totals
//! rank the kernels and give each one's time per call; they are not the pass's speed.

use std::collections::BTreeMap;
use std::time::Duration;

/// The environment variable that turns the profile on (`1`, `true`, `on` or `yes`).
pub const ENV: &str = "GDS_CUDA_PROFILE";

/// Whether `value` (the variable's value, if set) asks for the profile.
pub fn wanted(value: Option<&str>) -> bool {
    crate::env_flag(value) == Some(true)
}

/// Calls and time per kernel name.
#[derive(Debug, Default, Clone)]
pub struct KernelProfile {
    by_name: BTreeMap<String, (u64, Duration)>,
}

impl KernelProfile {
    /// One call of `name` that took `took`.
    pub fn record(&mut self, name: &str, took: Duration) {
        let e = self.by_name.entry(name.to_string()).or_default();
        e.0 += 1;
        e.1 += took;
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// `(name, calls, total)`, the longest total first (ties by name).
    pub fn rows(&self) -> Vec<(&str, u64, Duration)> {
        let mut v: Vec<_> = self
            .by_name
            .iter()
            .map(|(n, &(c, t))| (n.as_str(), c, t))
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(b.0)));
        v
    }

    /// The table: one line per kernel (total ms, share of the profiled time, calls, µs a
    /// call), then the total.
    pub fn report(&self) -> String {
        let total: Duration = self.by_name.values().map(|&(_, t)| t).sum();
        let width = self
            .by_name
            .keys()
            .map(|n| n.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let mut s = format!(
            "GPU time by kernel ({ENV}: each call synchronized; CUDA graphs off)\n\
             {:<width$} {:>10} {:>7} {:>8} {:>10}\n",
            "kernel", "total ms", "share", "calls", "us/call"
        );
        for (name, calls, t) in self.rows() {
            let share = if total.is_zero() {
                0.0
            } else {
                100.0 * t.as_secs_f64() / total.as_secs_f64()
            };
            s += &format!(
                "{name:<width$} {:>10.3} {:>6.1}% {calls:>8} {:>10.1}\n",
                t.as_secs_f64() * 1e3,
                share,
                t.as_secs_f64() * 1e6 / calls as f64
            );
        }
        s += &format!("{:<width$} {:>10.3}\n", "total", total.as_secs_f64() * 1e3);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_turns_it_on_only_when_asked() {
        for v in ["1", "true", "ON", " yes "] {
            assert!(wanted(Some(v)), "{v}");
        }
        for v in [
            None,
            Some(""),
            Some("0"),
            Some("off"),
            Some("no"),
            Some("2"),
        ] {
            assert!(!wanted(v), "{v:?}");
        }
    }

    #[test]
    fn calls_add_up_per_name_and_the_longest_total_comes_first() {
        let mut p = KernelProfile::default();
        assert!(p.is_empty());
        let ms = Duration::from_millis;
        p.record("matvec_q8_q4_0", ms(2));
        p.record("dequant16_q4_0", ms(5));
        p.record("matvec_q8_q4_0", ms(4));
        p.record("rmsnorm", ms(1));
        let rows = p.rows();
        assert_eq!(
            rows,
            vec![
                ("matvec_q8_q4_0", 2, ms(6)),
                ("dequant16_q4_0", 1, ms(5)),
                ("rmsnorm", 1, ms(1)),
            ]
        );
        let r = p.report();
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines.len(), 2 + 3 + 1, "{r}");
        // matvec: 6 of 12 ms, 2 calls of 3000 us
        let m: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            m,
            ["matvec_q8_q4_0", "6.000", "50.0%", "2", "3000.0"],
            "{r}"
        );
        assert!(
            lines[5].starts_with("total") && lines[5].ends_with("12.000"),
            "{r}"
        );
    }
}
