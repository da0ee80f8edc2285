//! Server counters and gauges, rendered as Prometheus text at `GET /metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// Everything `/metrics` reports. Counters only grow; gauges are set by the engine.
#[derive(Default)]
pub struct ServerMetrics {
    /// HTTP generation requests accepted (completions and chat).
    pub requests: AtomicU64,
    /// Requests refused: bad input (400).
    pub rejected_bad: AtomicU64,
    /// Requests refused: queue full or the client's share of it taken (429).
    pub rejected_busy: AtomicU64,
    /// Of those, for the client's share of the queue.
    pub rejected_client: AtomicU64,
    /// Requests refused: body larger than the limit (413).
    pub rejected_too_large: AtomicU64,
    /// Replies not streamed whose choices passed `--max-reply` (400 `reply_too_large`).
    pub replies_too_large: AtomicU64,
    /// Requests whose body did not arrive in time (408).
    pub body_timeouts: AtomicU64,
    /// Open HTTP connections.
    pub connections_open: AtomicU64,
    /// Connections refused because the connection limit was reached (503).
    pub connections_refused: AtomicU64,
    /// Of those, refused because the client's address held its share of the connections.
    pub connections_refused_client: AtomicU64,
    /// Connections closed because a request head did not arrive in time (header or idle
    /// timeout).
    pub header_timeouts: AtomicU64,
    /// Requests that ended normally.
    pub finished: AtomicU64,
    /// Requests that failed in the engine.
    pub failed: AtomicU64,
    /// Requests dropped because the client went away (or stopped reading at a stop string).
    pub cancelled: AtomicU64,
    /// Preemptions (a running request sent back to the queue for lack of KV blocks).
    pub preemptions: AtomicU64,
    /// Context shifts (a reply that filled the context dropped tokens and went on).
    pub context_shifts: AtomicU64,
    /// Requests waiting for admission.
    pub queue_depth: AtomicI64,
    /// Of those, the Batch APIs' (which never make a client's request find the queue full).
    pub queue_depth_batch: AtomicI64,
    /// Requests admitted (prefilling or decoding).
    pub running: AtomicU64,
    /// Prompt tokens evaluated.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens served from the prefix cache.
    pub prompt_tokens_cached: AtomicU64,
    /// Tokens generated.
    pub generated: AtomicU64,
    /// Tokens the draft guessed (speculative decoding, `draft: "ngram"` requests).
    pub draft_tokens: AtomicU64,
    /// Guesses equal to the token sampled at their position.
    pub draft_accepted: AtomicU64,
    /// Forward passes.
    pub steps: AtomicU64,
    /// Sequences decoded in the last step.
    pub last_batch: AtomicU64,
    /// Sequences running, summed over the steps (llama-server's busy slots per decode).
    pub busy_slots: AtomicU64,
    /// Steps of a sequence that checked draft guesses (speculative verifications).
    pub drafts: AtomicU64,
    /// The longest sequence finished (prompt and generated tokens).
    pub tokens_max: AtomicU64,
    /// The compute backend the engine runs on (`cpu`, `cuda`); where the KV blocks live.
    pub backend: std::sync::OnceLock<&'static str>,
    /// KV blocks in the pool.
    pub kv_blocks_total: AtomicU64,
    /// KV blocks free.
    pub kv_blocks_free: AtomicU64,
    /// KV blocks indexed by the prefix tree.
    pub kv_blocks_prefix: AtomicU64,
    /// Blocks of the sliding-window layers' own pool (0: none).
    pub kv_window_blocks_total: AtomicU64,
    /// Of those, free.
    pub kv_window_blocks_free: AtomicU64,
    /// Grammar masks computed (one per constrained token).
    pub masks: AtomicU64,
    /// Nanoseconds the helper thread spent computing masks (overlapped with forward passes).
    pub mask_ns: AtomicU64,
    /// Nanoseconds steps waited for masks after their forward pass was done (the cost
    /// constrained decoding adds to a step).
    pub mask_wait_ns: AtomicU64,
    /// Grammars compiled, and nanoseconds spent compiling them.
    pub grammars: AtomicU64,
    /// Nanoseconds spent compiling grammars (including building the vocabulary index once).
    pub grammar_ns: AtomicU64,
    /// The weight reads of the engine's layer source (streamed layers; zero when every
    /// layer is resident), as of the last step.
    io: Mutex<gds_io::IoStats>,
    timing: Mutex<Timing>,
}

#[derive(Default)]
struct Timing {
    /// Seconds of steps that evaluated prompt tokens / decoded tokens, apportioned by
    /// token count.
    prompt_s: f64,
    decode_s: f64,
    /// Exponential moving averages of throughput, tokens/s.
    prompt_tps: f64,
    decode_tps: f64,
}

impl ServerMetrics {
    /// Adds `n` requests to the queue depth (`background`: the Batch APIs').
    pub fn queue_depth_add(&self, n: usize, background: bool) {
        self.queue_depth.fetch_add(n as i64, Ordering::Relaxed);
        if background {
            self.queue_depth_batch
                .fetch_add(n as i64, Ordering::Relaxed);
        }
    }

    /// Takes `n` requests from the queue depth (`background`: the Batch APIs').
    pub fn queue_depth_sub(&self, n: usize, background: bool) {
        self.queue_depth.fetch_sub(n as i64, Ordering::Relaxed);
        if background {
            self.queue_depth_batch
                .fetch_sub(n as i64, Ordering::Relaxed);
        }
    }

    /// Records `n` grammar masks computed in `busy`, and the step's `wait` for them after
    /// its forward pass.
    pub fn record_masks(&self, n: usize, busy: std::time::Duration, wait: std::time::Duration) {
        self.masks.fetch_add(n as u64, Ordering::Relaxed);
        self.mask_ns
            .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
        self.mask_wait_ns
            .fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Records one grammar compiled in `took`.
    pub fn record_grammar(&self, took: std::time::Duration) {
        self.grammars.fetch_add(1, Ordering::Relaxed);
        self.grammar_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Records the layer source's counters after a step (they only grow).
    pub fn set_io(&self, io: gds_io::IoStats) {
        *self.io.lock().unwrap_or_else(|e| e.into_inner()) = io;
    }

    /// Records one forward pass of `prompt` prompt tokens and `decode` decode tokens that
    /// took `secs`.
    pub fn record_step(&self, prompt: usize, decode: usize, secs: f64) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.last_batch.store(decode as u64, Ordering::Relaxed);
        let total = (prompt + decode).max(1) as f64;
        let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        let (ps, ds) = (secs * prompt as f64 / total, secs * decode as f64 / total);
        t.prompt_s += ps;
        t.decode_s += ds;
        let ema = |old: f64, new: f64| {
            if old == 0.0 {
                new
            } else {
                0.8 * old + 0.2 * new
            }
        };
        if prompt > 0 && secs > 0.0 {
            t.prompt_tps = ema(t.prompt_tps, prompt as f64 / secs);
        }
        if decode > 0 && secs > 0.0 {
            t.decode_tps = ema(t.decode_tps, decode as f64 / secs);
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        let mut o = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                o,
                "# HELP gds_{name} {help}\n# TYPE gds_{name} {kind}\ngds_{name} {v}"
            );
        };
        put(
            "requests_total",
            "counter",
            "Generation requests accepted.",
            g(&self.requests).to_string(),
        );
        put(
            "requests_rejected_total",
            "counter",
            "Requests refused as invalid (400).",
            g(&self.rejected_bad).to_string(),
        );
        put(
            "requests_busy_total",
            "counter",
            "Requests refused because the queue was full (429).",
            g(&self.rejected_busy).to_string(),
        );
        put(
            "requests_client_busy_total",
            "counter",
            "Of requests_busy_total, those whose client address held its share of the queue.",
            g(&self.rejected_client).to_string(),
        );
        put(
            "requests_too_large_total",
            "counter",
            "Requests refused because the body exceeded the limit (413).",
            g(&self.rejected_too_large).to_string(),
        );
        put(
            "replies_too_large_total",
            "counter",
            "Replies not streamed cut off because their choices passed --max-reply (400 reply_too_large).",
            g(&self.replies_too_large).to_string(),
        );
        put(
            "requests_body_timeout_total",
            "counter",
            "Requests whose body did not arrive in time (408).",
            g(&self.body_timeouts).to_string(),
        );
        put(
            "connections_open",
            "gauge",
            "Open HTTP connections.",
            g(&self.connections_open).to_string(),
        );
        put(
            "connections_refused_total",
            "counter",
            "Connections refused at the connection limit or the per-client limit (503).",
            g(&self.connections_refused).to_string(),
        );
        put(
            "connections_refused_client_total",
            "counter",
            "Connections refused because their address held --max-client-connections (503).",
            g(&self.connections_refused_client).to_string(),
        );
        put(
            "connections_timed_out_total",
            "counter",
            "Connections closed because no complete request head arrived in time.",
            g(&self.header_timeouts).to_string(),
        );
        put(
            "requests_finished_total",
            "counter",
            "Requests that ended normally.",
            g(&self.finished).to_string(),
        );
        put(
            "requests_failed_total",
            "counter",
            "Requests that failed in the engine.",
            g(&self.failed).to_string(),
        );
        put(
            "requests_cancelled_total",
            "counter",
            "Requests dropped because the client went away.",
            g(&self.cancelled).to_string(),
        );
        let secs = |a: &AtomicU64| format!("{:.6}", g(a) as f64 / 1e9);
        put(
            "constrained_tokens_total",
            "counter",
            "Tokens sampled under a grammar (JSON schema, Lark grammar, regex): masks computed.",
            g(&self.masks).to_string(),
        );
        put(
            "constraint_mask_seconds_total",
            "counter",
            "Seconds spent computing grammar masks (overlapped with the forward pass).",
            secs(&self.mask_ns),
        );
        put(
            "constraint_wait_seconds_total",
            "counter",
            "Seconds steps waited for grammar masks after their forward pass (the added cost).",
            secs(&self.mask_wait_ns),
        );
        put(
            "grammars_compiled_total",
            "counter",
            "Grammars compiled for requests.",
            g(&self.grammars).to_string(),
        );
        put(
            "grammar_compile_seconds_total",
            "counter",
            "Seconds spent compiling grammars (the first includes indexing the vocabulary).",
            secs(&self.grammar_ns),
        );
        put(
            "preemptions_total",
            "counter",
            "Running requests requeued for lack of KV blocks (or, a batch job's, for a client's request).",
            g(&self.preemptions).to_string(),
        );
        put(
            "context_shifts_total",
            "counter",
            "Replies that filled the context, dropped tokens after their kept start and went on.",
            g(&self.context_shifts).to_string(),
        );
        put(
            "queue_depth",
            "gauge",
            "Requests waiting for admission.",
            self.queue_depth.load(Ordering::Relaxed).max(0).to_string(),
        );
        put(
            "queue_depth_batch",
            "gauge",
            "Of the requests waiting for admission, the Batch APIs' (they yield to clients').",
            self.queue_depth_batch
                .load(Ordering::Relaxed)
                .max(0)
                .to_string(),
        );
        put(
            "requests_running",
            "gauge",
            "Requests prefilling or decoding.",
            g(&self.running).to_string(),
        );
        put(
            "batch_size",
            "gauge",
            "Sequences decoded in the last step.",
            g(&self.last_batch).to_string(),
        );
        put(
            "steps_total",
            "counter",
            "Batched forward passes.",
            g(&self.steps).to_string(),
        );
        put(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens evaluated.",
            g(&self.prompt_tokens).to_string(),
        );
        put(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            g(&self.prompt_tokens_cached).to_string(),
        );
        put(
            "generated_tokens_total",
            "counter",
            "Tokens generated.",
            g(&self.generated).to_string(),
        );
        put(
            "draft_tokens_total",
            "counter",
            "Tokens guessed by speculative decoding's draft.",
            g(&self.draft_tokens).to_string(),
        );
        put(
            "draft_accepted_total",
            "counter",
            "Guesses equal to the token sampled at their position (decoded without a pass of their own).",
            g(&self.draft_accepted).to_string(),
        );
        put(
            "prompt_seconds_total",
            "counter",
            "Forward time spent on prompt tokens.",
            format!("{:.6}", t.prompt_s),
        );
        put(
            "decode_seconds_total",
            "counter",
            "Forward time spent on decode tokens.",
            format!("{:.6}", t.decode_s),
        );
        put(
            "prompt_tokens_per_second",
            "gauge",
            "Recent prompt throughput.",
            format!("{:.3}", t.prompt_tps),
        );
        put(
            "decode_tokens_per_second",
            "gauge",
            "Recent aggregate decode throughput.",
            format!("{:.3}", t.decode_tps),
        );
        let io = *self.io.lock().unwrap_or_else(|e| e.into_inner());
        put(
            "io_read_bytes_total",
            "counter",
            "Bytes of weights read from the layer files (streamed layers; resident ones once at start).",
            io.bytes_read.to_string(),
        );
        put(
            "io_read_seconds_total",
            "counter",
            "Seconds spent inside weight reads (the I/O thread's and the engine's together).",
            format!("{:.6}", io.read_ns as f64 / 1e9),
        );
        put(
            "io_wait_seconds_total",
            "counter",
            "Seconds forward passes waited for streamed weights (reads that compute did not hide).",
            format!("{:.6}", io.wait_ns as f64 / 1e9),
        );
        put(
            "expert_cache_hits_total",
            "counter",
            "Experts of streamed mixture-of-experts blocks found in the expert cache.",
            io.cache_hits.to_string(),
        );
        put(
            "expert_cache_misses_total",
            "counter",
            "Experts of streamed mixture-of-experts blocks read from the layer files.",
            io.cache_misses.to_string(),
        );
        let (total, free) = (g(&self.kv_blocks_total), g(&self.kv_blocks_free));
        put(
            "kv_blocks_total",
            "gauge",
            "KV blocks in the pool.",
            total.to_string(),
        );
        put(
            "kv_blocks_free",
            "gauge",
            "KV blocks free.",
            free.to_string(),
        );
        put(
            "kv_blocks_used",
            "gauge",
            "KV blocks in use.",
            total.saturating_sub(free).to_string(),
        );
        put(
            "kv_blocks_prefix",
            "gauge",
            "KV blocks indexed by the prefix cache.",
            g(&self.kv_blocks_prefix).to_string(),
        );
        put(
            "kv_window_blocks_total",
            "gauge",
            "KV blocks of the sliding-window layers' own pool (0: the model has none).",
            g(&self.kv_window_blocks_total).to_string(),
        );
        put(
            "kv_window_blocks_free",
            "gauge",
            "Free blocks of the sliding-window layers' pool.",
            g(&self.kv_window_blocks_free).to_string(),
        );
        // llama-server's names for the same counters (its `/metrics`, `llamacpp:` prefix), so
        // dashboards and tools made for it read this server as they read llama-server
        let steps = g(&self.steps);
        let llama: [(&str, &str, &str, String); 15] = [
            (
                "prompt_tokens_total",
                "counter",
                "Number of prompt tokens processed, excluding cached tokens",
                g(&self.prompt_tokens).to_string(),
            ),
            (
                "prompt_tokens_cached_total",
                "counter",
                "Number of prompt tokens reused from the cache",
                g(&self.prompt_tokens_cached).to_string(),
            ),
            (
                "prompt_seconds_total",
                "counter",
                "Total time spent processing prompts",
                format!("{:.6}", t.prompt_s),
            ),
            (
                "tokens_predicted_total",
                "counter",
                "Number of generation tokens processed",
                g(&self.generated).to_string(),
            ),
            (
                "tokens_predicted_seconds_total",
                "counter",
                "Total time spent generating tokens",
                format!("{:.6}", t.decode_s),
            ),
            (
                "n_decode_total",
                "counter",
                "Total number of batched forward passes",
                steps.to_string(),
            ),
            (
                "n_tokens_max",
                "counter",
                "Largest observed sequence length (prompt + generation)",
                g(&self.tokens_max).to_string(),
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "counter",
                "Speculative: Total draft tokens generated",
                g(&self.draft_tokens).to_string(),
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "counter",
                "Speculative: Total draft tokens accepted by the target model",
                g(&self.draft_accepted).to_string(),
            ),
            (
                "spec_decode_num_drafts_total",
                "counter",
                "Speculative: Total speculative decoding verification steps",
                g(&self.drafts).to_string(),
            ),
            (
                "prompt_tokens_seconds",
                "gauge",
                "Average prompt throughput in tokens/s",
                format!("{:.3}", t.prompt_tps),
            ),
            (
                "predicted_tokens_seconds",
                "gauge",
                "Average generation throughput in tokens/s",
                format!("{:.3}", t.decode_tps),
            ),
            (
                "requests_processing",
                "gauge",
                "Number of requests processing",
                g(&self.running).to_string(),
            ),
            (
                "requests_deferred",
                "gauge",
                "Number of requests deferred",
                self.queue_depth.load(Ordering::Relaxed).max(0).to_string(),
            ),
            (
                "n_busy_slots_per_decode",
                "gauge",
                "Average number of busy slots per batched forward pass",
                format!("{:.3}", g(&self.busy_slots) as f64 / steps.max(1) as f64),
            ),
        ];
        for (name, kind, help, v) in llama {
            let _ = writeln!(
                o,
                "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {v}"
            );
        }
        let backend = self.backend.get().copied().unwrap_or("cpu");
        let _ = writeln!(
            o,
            "# HELP gds_backend_info The compute backend (the KV blocks live in its memory: RAM or VRAM).\n# TYPE gds_backend_info gauge\ngds_backend_info{{backend=\"{backend}\"}} 1"
        );
        o
    }
}
