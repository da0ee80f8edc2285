//! What a run reports: timings, throughput, memory, bytes of weights touched, and energy
//! from Linux RAPL counters when the machine exposes them (and NVML's for the GPU).

use serde::Serialize;
use std::path::{Path, PathBuf};

/// Metrics of one generation (one prompt, or one chat turn).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Metrics {
    /// Time to load the model (open, map, locate weights, build tokenizer), ms.
    pub load_ms: f64,
    /// Tokens in the prompt (the whole rendered conversation for chat turns).
    pub prompt_tokens: usize,
    /// Tokens actually run through the model for the prompt (fewer than `prompt_tokens` when
    /// the KV cache already held a prefix, as in later chat turns).
    pub prompt_tokens_evaluated: usize,
    /// Time spent evaluating the prompt, ms.
    pub prompt_ms: f64,
    /// `prompt_tokens_evaluated / prompt_ms`, per second.
    pub prompt_tokens_per_sec: f64,
    /// Tokens generated (not counting the end-of-generation token).
    pub generated_tokens: usize,
    /// Time spent in single-token decode steps, ms.
    pub decode_ms: f64,
    /// Decode steps per second (each step runs one generated token through the model).
    pub tokens_per_sec: f64,
    /// From the start of the request (tokenizing included) to the first sampled token, ms.
    pub time_to_first_token_ms: f64,
    /// Peak resident set size of the process (VmHWM), when /proc is readable.
    pub peak_rss_bytes: Option<u64>,
    /// Bytes of weights touched (for `mmap`: the layer files made resident).
    pub bytes_read: u64,
    /// Bytes allocated for the KV cache (pages are only resident once written).
    pub kv_cache_bytes: usize,
    /// I/O backend of the run (`mmap`, `direct`, `buffered`).
    pub io_mode: String,
    /// Weight bytes the plan keeps in memory (resident layers plus streaming buffers).
    pub weights_held_bytes: u64,
    /// Bytes read from disk per decode step (0 when nothing streams).
    pub bytes_read_per_token: f64,
    /// Time the compute waited for weights during decode, ms.
    pub io_wait_ms: f64,
    /// Share of the decode-time disk reads hidden behind compute: `1 - io_wait / read time`
    /// (`None` when nothing was read).
    pub io_overlap: Option<f64>,
    /// Bytes read during decode over the time spent reading them, bytes/s.
    pub read_bandwidth_bytes_per_sec: Option<f64>,
    /// Share of the experts used during decode that the expert cache held (a mixture of
    /// experts whose experts stream apart; `None` otherwise).
    pub expert_cache_hit_rate: Option<f64>,
    /// Energy used during prompt evaluation and generation, joules (package RAPL domains, plus
    /// the GPU's NVML counter with the CUDA backend).
    pub energy_joules: Option<f64>,
    /// `energy_joules` over the prompt + decode time.
    pub watts_avg: Option<f64>,
    /// `generated_tokens / energy_joules`.
    pub tokens_per_joule: Option<f64>,
    /// Where the energy numbers come from, or why there are none.
    pub energy_source: String,
    /// `blake3` when layer files were checked against the manifest's hashes before use,
    /// `off` with `--no-verify`.
    pub verify: String,
    /// Bytes of layer files hashed by this process so far (0 when the per-user cache
    /// vouched for every file).
    pub verified_bytes: u64,
    /// Time spent hashing them, ms (part of `load_ms` for files hashed at open).
    pub verify_ms: f64,
    /// Layer files the cache vouched for (unchanged since they were last verified).
    pub verify_cached_files: u64,
    /// Forward passes during decode (one per token without a draft).
    pub decode_passes: usize,
    /// Tokens decoded (their keys and values added to the cache) during decode.
    pub decode_tokens: usize,
    /// Tokens a draft guessed (speculative decoding).
    pub draft_tokens: usize,
    /// Decode passes the draft sat out because guessing did not pay (in memory, measured).
    pub draft_off_passes: usize,
    /// Guesses equal to the token sampled at their position: tokens decoded without a pass
    /// of their own.
    pub draft_accepted: usize,
    /// `draft_accepted / draft_tokens` (`None` without guesses).
    pub draft_acceptance: Option<f64>,
    /// `decode_tokens / decode_passes`: tokens per read of the weights (1 without a draft).
    pub tokens_per_pass: Option<f64>,
}

impl Metrics {
    /// Fills the streaming metrics from the I/O counters of the decode phase (`steps`
    /// tokens decoded).
    pub fn set_decode_io(&mut self, io: &gds_io::IoStats, steps: usize) {
        if steps > 0 {
            self.bytes_read_per_token = io.bytes_read as f64 / steps as f64;
        }
        self.io_wait_ms = io.wait_ns as f64 / 1e6;
        if io.read_ns > 0 {
            self.io_overlap = Some((1.0 - io.wait_ns as f64 / io.read_ns as f64).clamp(0.0, 1.0));
            self.read_bandwidth_bytes_per_sec =
                Some(io.bytes_read as f64 * 1e9 / io.read_ns as f64);
        }
        self.expert_cache_hit_rate = io.cache_hit_rate();
    }

    /// Fills the verification fields from the verifier's counters.
    pub fn set_verify(&mut self, on: bool, v: &gds_io::VerifyStats) {
        self.verify = if on { "blake3" } else { "off" }.into();
        self.verified_bytes = v.bytes_hashed;
        self.verify_ms = v.hash_ns as f64 / 1e6;
        self.verify_cached_files = v.files_cached;
    }

    /// Fills the derived rates from the raw counts and times.
    pub fn finish(&mut self) {
        let rate = |n: usize, ms: f64| {
            if ms > 0.0 {
                n as f64 * 1000.0 / ms
            } else {
                0.0
            }
        };
        self.prompt_tokens_per_sec = rate(self.prompt_tokens_evaluated, self.prompt_ms);
        self.tokens_per_sec = rate(self.generated_tokens.saturating_sub(1), self.decode_ms);
        let secs = (self.prompt_ms + self.decode_ms) / 1000.0;
        self.watts_avg = self.energy_joules.filter(|_| secs > 0.0).map(|j| j / secs);
        self.tokens_per_joule = self
            .energy_joules
            .filter(|&j| j > 0.0)
            .map(|j| self.generated_tokens as f64 / j);
        self.peak_rss_bytes = peak_rss_bytes();
        self.draft_acceptance =
            (self.draft_tokens > 0).then(|| self.draft_accepted as f64 / self.draft_tokens as f64);
        self.tokens_per_pass =
            (self.decode_passes > 0).then(|| self.decode_tokens as f64 / self.decode_passes as f64);
    }

    /// One line for humans (stderr).
    pub fn summary(&self) -> String {
        let mut s = format!(
            "load {:.0} ms | prompt {} tok ({} evaluated) {:.0} ms, {:.1} tok/s | gen {} tok, {:.1} tok/s | ttft {:.0} ms",
            self.load_ms, self.prompt_tokens, self.prompt_tokens_evaluated, self.prompt_ms, self.prompt_tokens_per_sec, self.generated_tokens, self.tokens_per_sec, self.time_to_first_token_ms
        );
        if let Some(rss) = self.peak_rss_bytes {
            s += &format!(" | rss {:.0} MiB", rss as f64 / (1 << 20) as f64);
        }
        if self.draft_tokens > 0 {
            s += &format!(
                " | draft {}/{} accepted, {:.2} tok/pass",
                self.draft_accepted,
                self.draft_tokens,
                self.tokens_per_pass.unwrap_or(1.0)
            );
        }
        if self.bytes_read_per_token > 0.0 {
            s += &format!(
                " | io {} {:.1} MiB/tok, {:.0} MB/s, wait {:.0} ms",
                self.io_mode,
                self.bytes_read_per_token / (1 << 20) as f64,
                self.read_bandwidth_bytes_per_sec.unwrap_or(0.0) / 1e6,
                self.io_wait_ms
            );
        }
        if let Some(h) = self.expert_cache_hit_rate {
            s += &format!(" | experts cached {:.0}%", h * 100.0);
        }
        match self.energy_joules {
            Some(j) => {
                s += &format!(
                    " | {:.1} J, {:.1} W, {:.2} tok/J",
                    j,
                    self.watts_avg.unwrap_or(0.0),
                    self.tokens_per_joule.unwrap_or(0.0)
                )
            }
            None => s += " | energy n/a",
        }
        s
    }
}

/// Peak resident set size (`VmHWM` of /proc/self/status), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

struct Domain {
    energy: PathBuf,
    max_range_uj: u64,
    last_uj: u64,
    total_uj: u128,
}

/// Cumulative energy of the CPU packages from `/sys/class/powercap/intel-rapl:N` (also
/// present on AMD), handling counter wraparound. Sample it at least once per wrap period
/// (minutes at full load) to stay exact.
pub struct EnergyMeter {
    domains: Vec<Domain>,
    counters: Vec<Counter>,
    source: String,
}

/// A cumulative counter outside sysfs (NVML's, for the GPU the CUDA backend runs on).
struct Counter {
    read: Box<dyn FnMut() -> Option<u64> + Send>,
    first_mj: u64,
    last_mj: u64,
}

impl EnergyMeter {
    /// Finds readable package domains under `/sys/class/powercap`.
    pub fn open() -> EnergyMeter {
        Self::open_at(Path::new("/sys/class/powercap"))
    }

    /// Like [`EnergyMeter::open`] with another sysfs root (for tests).
    pub fn open_at(root: &Path) -> EnergyMeter {
        let entries = match std::fs::read_dir(root) {
            Ok(e) => e,
            Err(e) => {
                return EnergyMeter {
                    domains: Vec::new(),
                    counters: Vec::new(),
                    source: format!("unavailable: {}: {e}", root.display()),
                }
            }
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| {
                n.strip_prefix("intel-rapl:")
                    .is_some_and(|rest| !rest.contains(':'))
            })
            .collect();
        names.sort();
        let mut domains = Vec::new();
        let mut why = String::new();
        for n in &names {
            let dir = root.join(n);
            let energy = dir.join("energy_uj");
            match read_u64(&energy) {
                Ok(v) => domains.push(Domain {
                    max_range_uj: read_u64(&dir.join("max_energy_range_uj")).unwrap_or(u64::MAX),
                    energy,
                    last_uj: v,
                    total_uj: 0,
                }),
                Err(e) => why = format!("unavailable: {}: {e}", energy.display()),
            }
        }
        let source = if !domains.is_empty() {
            format!(
                "rapl:{}",
                names
                    .iter()
                    .filter(|n| domains.iter().any(|d| d.energy.starts_with(root.join(n))))
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(",")
            )
        } else if !why.is_empty() {
            why
        } else {
            format!(
                "unavailable: no intel-rapl package domain under {}",
                root.display()
            )
        };
        EnergyMeter {
            domains,
            counters: Vec::new(),
            source,
        }
    }

    /// Adds a device's cumulative millijoule counter (the GPU's, from NVML, when the CUDA
    /// backend runs): its energy from now on joins the CPU packages', and `source` names it
    /// (`rapl:…+nvml:gpu0`, or `nvml:gpu0` alone where RAPL is unreadable).
    pub fn add_counter(&mut self, source: &str, mut read: Box<dyn FnMut() -> Option<u64> + Send>) {
        let Some(first_mj) = read() else {
            return;
        };
        self.source = if self.domains.is_empty() && self.counters.is_empty() {
            source.to_string()
        } else {
            format!("{}+{source}", self.source)
        };
        self.counters.push(Counter {
            read,
            first_mj,
            last_mj: first_mj,
        });
    }

    /// Adds why a counter that should be there is not (the metrics' source says it).
    pub fn note_missing(&mut self, why: &str) {
        self.source = format!("{}; {why}", self.source);
    }

    /// True when at least one domain or counter is readable.
    pub fn available(&self) -> bool {
        !self.domains.is_empty() || !self.counters.is_empty()
    }

    /// Where the numbers come from, or why there are none.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Joules used since [`EnergyMeter::open`], or `None` when unavailable.
    pub fn joules(&mut self) -> Option<f64> {
        if !self.available() {
            return None;
        }
        for c in &mut self.counters {
            if let Some(v) = (c.read)() {
                c.last_mj = c.last_mj.max(v);
            }
        }
        let counted_mj: u64 = self.counters.iter().map(|c| c.last_mj - c.first_mj).sum();
        for d in &mut self.domains {
            if let Ok(v) = read_u64(&d.energy) {
                let delta = if v >= d.last_uj {
                    v - d.last_uj
                } else {
                    d.max_range_uj.saturating_sub(d.last_uj) + v
                };
                d.total_uj += delta as u128;
                d.last_uj = v;
            }
        }
        Some(
            self.domains.iter().map(|d| d.total_uj as f64).sum::<f64>() / 1e6
                + counted_mj as f64 / 1e3,
        )
    }
}

fn read_u64(p: &Path) -> std::io::Result<u64> {
    std::fs::read_to_string(p)?
        .trim()
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rapl_counters_accumulate_across_wraparound() {
        let root = tempfile::tempdir().unwrap();
        let pkg = root.path().join("intel-rapl:0");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::create_dir_all(root.path().join("intel-rapl:0:0")).unwrap(); // subzone: ignored
        std::fs::write(pkg.join("max_energy_range_uj"), "1000000\n").unwrap();
        std::fs::write(pkg.join("energy_uj"), "900000\n").unwrap();
        let mut m = EnergyMeter::open_at(root.path());
        assert!(m.available());
        assert_eq!(m.source(), "rapl:intel-rapl:0");
        assert_eq!(m.joules(), Some(0.0));
        std::fs::write(pkg.join("energy_uj"), "950000\n").unwrap();
        assert!((m.joules().unwrap() - 0.05).abs() < 1e-9);
        std::fs::write(pkg.join("energy_uj"), "100000\n").unwrap(); // wrapped
        assert!((m.joules().unwrap() - 0.2).abs() < 1e-9);
    }

    #[test]
    fn missing_rapl_says_why() {
        let root = tempfile::tempdir().unwrap();
        let mut m = EnergyMeter::open_at(&root.path().join("nope"));
        assert!(!m.available());
        assert!(m.source().starts_with("unavailable"), "{}", m.source());
        assert_eq!(m.joules(), None);
    }

    #[test]
    fn a_gpu_counter_joins_the_meter_and_names_itself() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let root = tempfile::tempdir().unwrap();
        let mut m = EnergyMeter::open_at(&root.path().join("nope"));
        let mj = Arc::new(AtomicU64::new(1_000_000));
        let c = mj.clone();
        m.add_counter(
            "nvml:gpu0",
            Box::new(move || Some(c.load(Ordering::SeqCst))),
        );
        assert!(m.available());
        assert_eq!(m.source(), "nvml:gpu0");
        assert_eq!(m.joules(), Some(0.0));
        mj.store(1_002_500, Ordering::SeqCst);
        assert_eq!(m.joules(), Some(2.5));
        // a counter that cannot be read at all is not added
        m.add_counter("nvml:gpu1", Box::new(|| None));
        assert_eq!(m.source(), "nvml:gpu0");
        // with RAPL present the sources are joined
        let pkg = root.path().join("intel-rapl:0");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(pkg.join("energy_uj"), "5000000\n").unwrap();
        let mut both = EnergyMeter::open_at(root.path());
        both.add_counter("nvml:gpu0", Box::new(|| Some(7)));
        assert_eq!(both.source(), "rapl:intel-rapl:0+nvml:gpu0");
        std::fs::write(pkg.join("energy_uj"), "6000000\n").unwrap();
        assert_eq!(both.joules(), Some(1.0));
    }

    #[test]
    fn derived_rates() {
        let mut m = Metrics {
            prompt_tokens_evaluated: 10,
            prompt_ms: 100.0,
            generated_tokens: 11,
            decode_ms: 500.0,
            energy_joules: Some(6.0),
            ..Default::default()
        };
        m.finish();
        assert_eq!(m.prompt_tokens_per_sec, 100.0);
        assert_eq!(m.tokens_per_sec, 20.0);
        assert_eq!(m.watts_avg, Some(10.0));
        assert!((m.tokens_per_joule.unwrap() - 11.0 / 6.0).abs() < 1e-12);
        assert!(m.peak_rss_bytes.unwrap() > 0);
    }
}
