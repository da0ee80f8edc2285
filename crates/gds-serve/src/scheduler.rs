//! The engine thread: owns the model, run state and paged KV cache, and advances every
//! admitted request together, one batched forward pass per step (continuous batching).
//!
//! A request moves through explicit states: queued (in `waiting`), prefilling (its prompt
//! is being evaluated, in chunks sharing the step's token budget), decoding (one token per
//! step), then finished, failed or cancelled. New requests join between steps, fairly
//! between client addresses: the next admitted is the oldest request of the client with the
//! fewest running, ties going to the client admitted least recently (round robin), so one
//! client's many requests do not hold another's behind them; a client's own requests go first
//! in, first out, and nothing starves (a request that does not fit the KV pool yet holds the
//! others behind it until it does). When the KV pool runs dry, blocks only the prefix tree holds are evicted first,
//! then the newest running request is preempted: its blocks are released and it goes back
//! to the front of the queue to be recomputed later (its sampler state kept), rather than
//! failing. Requests rank by [`Request::rank`] (OpenAI's service tier — the Batch APIs'
//! requests are `flex` — then vLLM's `priority`): the running ones are kept in that order (admission order among equals), so
//! the step serves the first ranks first and a dry pool preempts the last; a waiting request
//! is admitted before any of a later rank, and a full batch preempts one of a later rank
//! for it.

use crate::metrics::ServerMetrics;
use crate::prefix::PrefixCache;
use gds_runtime::exec::BatchExecutor;
use gds_runtime::{Batch, Constraint, KvCache, Mask, Sampler, SamplerConfig, NO_BLOCK};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub use gds_runtime::sampler::TokenLogprobs;

/// What the engine tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// The prompt is in the cache and the first token is sampled: what the prompt cost
    /// (sent once, just before the first [`Event::Token`]; for per-token timings).
    Prefilled(Prefill),
    /// A generated token (the end-of-generation one too: counted and scored, never text),
    /// with its log-probabilities when the request asked for them.
    Token(u32, Option<TokenLogprobs>),
    /// With [`Request::echo`]: the log-probabilities of the next prompt token (from the
    /// second on, in order), computed from the logits of the position before it, and its
    /// rank among them (1: the most likely; 0 where [`Request::prompt_top`] is not set).
    PromptLogprobs(TokenLogprobs, usize),
    /// Generation ended.
    Done(Done),
    /// With [`Request::embed`]: the prompt's pooled final-normed hidden state (not
    /// normalized), sent just before [`Event::Done`].
    Embedding(Vec<f32>),
    /// With [`Request::progress`]: how far the prompt has gone in (at admission, then after
    /// every pass that fed prompt tokens).
    Progress(Progress),
    /// Generation failed.
    Error(String),
    /// The request failed mid-generation by its own fault, not the server's: its grammar
    /// went past the grammar engine's limits (code `grammar_error`), or its token masks
    /// left no token to generate (`invalid_request_error`). The message, and that code.
    RequestFault(String, &'static str),
}

/// Most guesses a step from a request's prediction ([`Request::prediction`]) when it did
/// not ask for more (`draft_max`).
pub const PREDICTED_MAX: usize = 16;

/// How an embedding request's token states become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over every prompt token.
    Mean,
    /// The last prompt token's (decoder embedding models: e5-mistral, gte-Qwen2, Qwen3-Embedding).
    Last,
    /// The first prompt token's.
    Cls,
    /// None: every prompt token's state, in order (llama-server's `--pooling none`;
    /// [`Event::Embedding`] then holds `n_prompt × n_embd` values).
    None,
}

impl Pooling {
    /// Whether the state of prompt position `p` of `n` takes part.
    fn wants(self, p: usize, n: usize) -> bool {
        match self {
            Pooling::Mean | Pooling::None => true,
            Pooling::Last => p + 1 == n,
            Pooling::Cls => p == 0,
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            "cls" => Ok(Pooling::Cls),
            "none" => Ok(Pooling::None),
            _ => Err(format!("unknown pooling {s:?}: mean, last, cls or none")),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token.
    Eos,
    /// `max_tokens` or the context reached.
    Length,
}

/// Counters of a finished request.
#[derive(Clone, Debug)]
pub struct Done {
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Admission to first token, ms.
    pub prompt_ms: f64,
    /// First token to the end, ms.
    pub decode_ms: f64,
    /// Time spent queued, ms.
    pub queue_ms: f64,
    /// Guesses of its prediction that were right (each one a token the pass after it did
    /// not have to compute).
    pub predicted_accepted: usize,
    /// Guesses of its prediction that were wrong (computed and thrown away).
    pub predicted_rejected: usize,
}

/// What a request's prompt cost, known at its first token.
#[derive(Clone, Copy, Debug, Default)]
pub struct Prefill {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Admission to first token, ms.
    pub prompt_ms: f64,
    /// Time spent queued, ms.
    pub queue_ms: f64,
}

/// How far a prompt has gone into the cache (llama-server's `prompt_progress`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// The prompt's tokens.
    pub total: usize,
    /// Of them, those the prefix cache gave.
    pub cache: usize,
    /// Of them, those in the cache now (the cached ones included).
    pub processed: usize,
    /// Since admission, ms.
    pub time_ms: f64,
}

/// A request handed to the engine.
pub struct Request {
    /// Prompt tokens (not empty, shorter than the context).
    pub prompt: Vec<u32>,
    /// Sampler settings (seed included).
    pub sampler: SamplerConfig,
    /// Most tokens to generate (0 only with `echo`: score the prompt, generate nothing).
    pub max_tokens: usize,
    /// Never stop at end-of-generation tokens.
    pub ignore_eos: bool,
    /// End-of-generation tokens (and `stop_ids`) are masked until this many tokens were
    /// generated (vLLM's `min_tokens`; not with a `constraint`, which decides where the
    /// output may end).
    pub min_tokens: usize,
    /// Generating one of these ends the reply (vLLM's `stop_token_ids`): the token is part
    /// of it, and the request ends as at an end-of-generation token.
    pub stop_ids: Vec<u32>,
    /// Tokens the request may or may not generate (vLLM's `allowed_token_ids`,
    /// `bad_words`), applied after the other masks.
    pub masks: TokenMasks,
    /// Speculative decoding: most tokens the prompt-lookup draft (`gds_runtime::draft`)
    /// guesses per step, checked in the same forward pass; 0 = off. The output is unchanged
    /// (every token is sampled from the logits at its position).
    pub draft_max: usize,
    /// Predicted outputs (OpenAI's `prediction`): the guesses come from this text the reply
    /// is expected to repeat, up to `draft_max` or [`PREDICTED_MAX`] a step (the
    /// prompt-lookup draft's where it gives none and `draft_max` asked for it).
    pub prediction: Option<Arc<[u32]>>,
    /// Report each token's log-probability and this many top alternatives (`None`: none).
    pub logprobs: Option<usize>,
    /// The log-probabilities reported are after the sampling chain (llama-server's
    /// `post_sampling_probs`): each token's share among the candidates it was drawn from
    /// (penalties, masks, top-k/p, min-p and temperature applied), not the model's.
    pub post_sampling: bool,
    /// Score the prompt too: every prompt token from the second gets a
    /// [`Event::PromptLogprobs`] (with `prompt_top`, else `logprobs`, alternatives). Such a
    /// prompt is computed in full (no prefix sharing), a few dozen positions per step.
    pub echo: bool,
    /// With `echo`: the alternatives listed for each prompt token, where they differ from
    /// the generated tokens' (vLLM's `prompt_logprobs`).
    pub prompt_top: Option<usize>,
    /// The grammar the output must follow (compiled, nothing accepted yet). Its mask is
    /// computed while the step's forward pass runs; generation ends when the grammar is
    /// complete, and end-of-generation tokens are allowed only where it may end
    /// (`ignore_eos` does not apply).
    pub constraint: Option<Constraint>,
    /// An embedding: the prompt is prefilled, its final-normed hidden states pooled this way
    /// and sent as [`Event::Embedding`]; nothing is generated (`max_tokens` is 0). Mean and
    /// first-token pooling compute the whole prompt (no prefix sharing).
    pub embed: Option<Pooling>,
    /// Context shift (llama-server's `--context-shift`, Ollama's `shift`): when the reply
    /// fills the context before `max_tokens`, tokens after the kept start are dropped and
    /// generation goes on (`None`: it ends there, `Finish::Length`).
    pub shift: Option<Shift>,
    /// The choices of one prompt (`n` > 1) share a group: while one of them prefills the
    /// prompt, the others wait in the queue, then start from its cached blocks instead of
    /// computing the same prompt again.
    pub group: Option<u64>,
    /// Send [`Event::Progress`] as the prompt goes in (llama-server's `return_progress`).
    pub progress: bool,
    /// The slot it names (llama-server's `id_slot`): its tokens become that slot's for
    /// [`SlotAction`]s (`None`: the engine slot it ran in).
    pub slot: Option<usize>,
    /// vLLM's `cache_salt`, hashed: the request shares cached prompt blocks only with
    /// requests of the same salt ([`salted`]); `None`: with the unsalted ones.
    pub salt: Option<u64>,
    /// Where events go; dropping the receiver cancels the request.
    pub tx: mpsc::UnboundedSender<Event>,
    /// Set by the front end when it ends the request itself (a stop string matched) before
    /// dropping the receiver: counted as finished, not cancelled.
    pub ended_by_front: Arc<AtomicBool>,
    /// When the server received it.
    pub received: Instant,
    /// Its client's place in the engine (dropped with the request), where it came from a
    /// connection.
    pub client: Option<crate::client::ClientSlot>,
    /// A request of the Batch APIs: it runs in the `flex` tier whatever [`Request::tier`]
    /// says — admitted after the other tiers' requests and, where the batch is full,
    /// preempted for them (recomputed later from the prefix cache, as a request preempted
    /// for KV blocks) — and, waiting, never counts toward a client's queue limit.
    pub background: bool,
    /// vLLM's `priority` (`--scheduling-policy priority`; else always 0): among requests
    /// of a tier, lower values are admitted first, and where the batch is full a running
    /// request of a higher value is preempted for one of a lower.
    pub priority: i64,
    /// OpenAI's `service_tier`: `priority` before `default`, `flex` after (with the Batch
    /// APIs' requests, whatever this says).
    pub tier: Tier,
}

/// The service tiers, in the order they are served ([`Request::tier`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// OpenAI's `priority` (and `fast`).
    Priority,
    #[default]
    Default,
    /// OpenAI's `flex`; the Batch APIs' requests.
    Flex,
}

/// A request's own token masks (vLLM's `allowed_token_ids` and `bad_words`).
#[derive(Clone, Debug, Default)]
pub struct TokenMasks {
    /// Only these tokens (sorted, no repeats) may be generated; `None`: any.
    pub allowed: Option<Arc<[u32]>>,
    /// Token sequences the reply may not contain: the last token of one is masked where
    /// the reply's last tokens are the others (a one-token sequence always).
    pub banned: Arc<[Vec<u32>]>,
}

impl TokenMasks {
    /// Whether either mask is set.
    pub fn any(&self) -> bool {
        self.allowed.is_some() || !self.banned.is_empty()
    }

    /// Masks `logits` for a reply whose generated tokens so far are `out`; false when no
    /// token is left.
    fn apply(&self, logits: &mut [f32], out: &[u32]) -> bool {
        if let Some(a) = &self.allowed {
            let kept: Vec<(usize, f32)> = a
                .iter()
                .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
                .collect();
            logits.fill(f32::NEG_INFINITY);
            for (t, l) in kept {
                logits[t] = l;
            }
        }
        for seq in self.banned.iter() {
            let Some((&last, prefix)) = seq.split_last() else {
                continue;
            };
            if out.ends_with(prefix) {
                if let Some(l) = logits.get_mut(last as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        logits.iter().any(|&l| l > f32::NEG_INFINITY)
    }
}

/// The prefix cache's keys of `tokens` for a request salted with `salt` (vLLM's
/// `cache_salt`): each token id XORed with 31 bits drawn from the salt and its position, the
/// top bit set. Under one salt the map is one to one (a prompt never takes another's
/// blocks); keys of different salts, or of unsalted requests (token ids under 2^31), do not
/// meet, and a request without the salt cannot tell which of its prompts a salted one has
/// cached.
pub fn salted(tokens: &[u32], salt: Option<u64>) -> std::borrow::Cow<'_, [u32]> {
    let Some(salt) = salt else {
        return std::borrow::Cow::Borrowed(tokens);
    };
    let mix = |i: usize| {
        // splitmix64 of the salt and the position
        let mut z = salt ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) as u32) & 0x7fff_ffff
    };
    std::borrow::Cow::Owned(
        tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| (t ^ mix(i)) | 0x8000_0000)
            .collect(),
    )
}

/// What the engine takes: a request to run, or an action on a slot's cached prefix.
pub enum Msg {
    Run(Box<Request>),
    Slot(SlotOp),
}

impl From<Request> for Msg {
    fn from(r: Request) -> Msg {
        Msg::Run(Box::new(r))
    }
}

/// llama-server's slot actions, on the slots' last tokens (the prompt and reply of the last
/// request each ran, or restored into it) and what the prefix cache holds of them.
pub struct SlotOp {
    /// The slot, below `max_batch`.
    pub id: usize,
    pub action: SlotAction,
    pub reply: tokio::sync::oneshot::Sender<Result<SlotDone, String>>,
}

/// What to do with a slot.
pub enum SlotAction {
    /// Copy out the blocks the prefix cache holds of its tokens.
    Save,
    /// Put a saved prefix into the prefix cache (as far as the pool allows) and make it the
    /// slot's tokens.
    Restore(SlotImage),
    /// Forget its tokens and drop their blocks from the prefix cache where nothing else
    /// uses them.
    Erase,
}

/// A prefix in KV blocks: its tokens (the last block may be partly filled), whether each
/// block holds its window layers' rows too (models with sliding-window layers), and the
/// blocks' images one after another ([`KvCache::export_block`]).
#[derive(Debug, Default)]
pub struct SlotImage {
    pub tokens: Vec<u32>,
    pub windows: Vec<bool>,
    pub data: Vec<u8>,
}

/// What a slot action did.
#[derive(Debug)]
pub enum SlotDone {
    Saved(SlotImage),
    /// Tokens restored (fewer than the image's when the pool ran short).
    Restored(usize),
    /// Tokens the slot held.
    Erased(usize),
}

/// How a reply that fills the context goes on: the first `keep` tokens stay, the next
/// `discard` (0: half of those after `keep`) are dropped, and the rest is computed again
/// from there, its positions closed up. Computing again (instead of moving the cached keys
/// to their new positions, as llama.cpp does) costs about one prompt token per token
/// generated past the context, and gives exactly the state the shortened text has: what
/// follows is what a fresh request with that text would give, and the prefix cache stays
/// true.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shift {
    /// Tokens at the start that always stay (the prompt's start: a system prompt, the BOS).
    pub keep: usize,
    /// Tokens dropped after them at each shift (0: half of what follows `keep`).
    pub discard: usize,
}

impl Shift {
    /// The span `keep..keep + discard` to drop from a sequence of `len` tokens (the last one
    /// not yet cached) in a context of `ctx`, as llama-server computes it: `keep` at most
    /// `ctx - 4`, `discard` at most what leaves the tokens after `keep` one; `None` where
    /// nothing can be dropped.
    pub fn span(self, len: usize, ctx: usize) -> Option<(usize, usize)> {
        let keep = self.keep.min(ctx.saturating_sub(4));
        let left = len.saturating_sub(1).saturating_sub(keep);
        let discard = match self.discard {
            0 => left / 2,
            d => d,
        }
        .min(left.saturating_sub(1));
        (discard > 0).then_some((keep, discard))
    }
}

impl Request {
    /// A request of `prompt` that asks for nothing yet: no token generated (`max_tokens`
    /// 0), no log-probabilities, mask, grammar, draft, shift or group; the fields a caller
    /// needs are set over it.
    pub fn plain(
        prompt: Vec<u32>,
        sampler: SamplerConfig,
        tx: mpsc::UnboundedSender<Event>,
        ended_by_front: Arc<AtomicBool>,
    ) -> Request {
        Request {
            prompt,
            sampler,
            max_tokens: 0,
            ignore_eos: false,
            min_tokens: 0,
            stop_ids: Vec::new(),
            masks: TokenMasks::default(),
            draft_max: 0,
            prediction: None,
            logprobs: None,
            post_sampling: false,
            echo: false,
            prompt_top: None,
            constraint: None,
            embed: None,
            shift: None,
            group: None,
            progress: false,
            slot: None,
            salt: None,
            tx,
            ended_by_front,
            received: Instant::now(),
            client: None,
            background: false,
            priority: 0,
            tier: Tier::Default,
        }
    }

    /// The order of admission (lower first): by service tier (the Batch APIs' requests are
    /// `flex`), then by `priority`.
    fn rank(&self) -> (Tier, i64) {
        let tier = if self.background {
            Tier::Flex
        } else {
            self.tier
        };
        (tier, self.priority)
    }

    /// The client address it came from (`None`: from no connection, e.g. `gdsrun batch`).
    fn client_ip(&self) -> Option<IpAddr> {
        self.client.as_ref().map(|c| c.ip())
    }
}

/// Engine settings.
pub struct EngineConfig {
    /// Most sequences decoding together.
    pub max_batch: usize,
    /// Most tokens per forward pass (prompt chunks + decode tokens).
    pub step_tokens: usize,
    /// Positions per sequence.
    pub ctx: usize,
}

/// Output rows of a step: one per decoding sequence, and for scored (echo) prompts one per
/// position, so at least 64.
pub fn max_outputs(cfg: &EngineConfig) -> usize {
    cfg.max_batch.max(64).min(cfg.step_tokens.max(1))
}

/// How a running sequence leaves the running set at the end of a step.
enum Exit {
    /// It ended.
    Done(Finish),
    /// It failed.
    Fault(Fault),
    /// Its context is full and it shifts ([`Shift::span`]: the tokens to drop): back to the
    /// queue's front, to compute what it keeps again.
    Shift(usize, usize),
}

/// Why a request failed in a step.
enum Fault {
    /// Its grammar went past the grammar engine's limits.
    Grammar(String),
    /// Its token masks left no token to generate.
    Masked(String),
    /// The forward pass of its own tokens failed.
    Engine(String),
}

/// A request admitted or waiting.
struct Seq {
    req: Request,
    /// Prompt, then generated tokens (the last one not yet in the cache while decoding).
    tokens: Vec<u32>,
    n_prompt: usize,
    /// Tokens whose K/V are in the cache.
    n_cached: usize,
    generated: usize,
    sampler: Sampler,
    /// Slot in the KV cache while running.
    slot: usize,
    cached_tokens: usize,
    /// Whether its prompt blocks were offered to the prefix tree.
    indexed: bool,
    /// With echo: prompt tokens whose log-probabilities were sent (the first has none).
    scored: usize,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    queue_ms: f64,
    /// This step's guesses (fed after its last token, with logits at each).
    guesses: Vec<u32>,
    /// Where the reply is in the request's prediction.
    following: gds_runtime::draft::Prediction,
    /// With the prompt-lookup draft: where the reply is in the prompt, followed as a text
    /// the reply may quote.
    quoted: gds_runtime::draft::Prediction,
    /// Whether this step's guesses come from the request's prediction.
    predicted: bool,
    /// The prediction's guesses so far, and those that were right.
    predicted_guesses: usize,
    predicted_accepted: usize,
    /// With embed: the pooled hidden states so far (a sum for mean pooling, every
    /// position's in order for none).
    pooled: Vec<f32>,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.n_cached + 1 == self.tokens.len() && self.generated > 0
    }

    /// How far its prompt has gone in, at `now`.
    fn progress(&self, now: Instant) -> Progress {
        Progress {
            total: self.n_prompt,
            cache: self.cached_tokens,
            processed: self.n_cached.min(self.n_prompt),
            time_ms: self.admitted.map_or(0.0, |a| {
                now.saturating_duration_since(a).as_secs_f64() * 1000.0
            }),
        }
    }

    /// With echo: the prompt token whose log-probability the logits at position `p`
    /// give, if not sent yet.
    fn scores(&self, p: usize) -> Option<usize> {
        (self.req.echo && p + 1 < self.n_prompt && p + 1 >= self.scored).then_some(p + 1)
    }

    /// Whether position `p`, fed while prefilling, takes an output row: the last one (to
    /// sample from) or a scored one.
    fn out_row(&self, p: usize) -> bool {
        self.req.embed.is_none() && (p + 1 == self.tokens.len() || self.scores(p).is_some())
    }

    /// With embed: whether position `p`'s hidden state is pooled.
    fn hidden_row(&self, p: usize) -> bool {
        self.req.embed.is_some_and(|e| e.wants(p, self.n_prompt))
    }
}

/// The engine: the model and everything a step needs.
pub struct Engine {
    /// The batched forward pass, on the CPU or the GPU.
    exec: Box<dyn BatchExecutor>,
    kv: KvCache,
    batch: Batch,
    prefix: PrefixCache,
    cfg: EngineConfig,
    eog: Vec<u32>,
    metrics: Arc<ServerMetrics>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    free_slots: Vec<usize>,
    /// For each output row of the step: index into `running`, and the prompt token the
    /// row scores (echo) or `None` for a row to sample from.
    out_rows: Vec<(usize, Option<usize>)>,
    /// Tokens each running sequence feeds this step (by index into `running`).
    fed: Vec<usize>,
    /// For each hidden-state row of the step (embeddings): index into `running`.
    hidden_rows: Vec<usize>,
    /// Admissions so far (the clock of `turns`).
    admissions: u64,
    /// When each client address (`None`: requests from no connection) last had a request
    /// admitted, by `admissions`: the fewer recent turns, the sooner its next.
    turns: HashMap<Option<IpAddr>, u64>,
    /// Each slot's last tokens (see [`SlotOp`]).
    slot_tokens: Vec<Vec<u32>>,
    /// Slot actions waiting for their slot's request to end.
    slot_ops: Vec<SlotOp>,
}

impl Engine {
    /// An engine over `exec` and `kv` (a paged cache with `cfg.max_batch` sequences, whose
    /// rows `exec` holds: the cache's own on the CPU, VRAM on the GPU); `exec` takes passes
    /// of up to `cfg.step_tokens` tokens with up to [`max_outputs`] logit rows.
    pub fn new(
        exec: Box<dyn BatchExecutor>,
        kv: KvCache,
        cfg: EngineConfig,
        eog: Vec<u32>,
        metrics: Arc<ServerMetrics>,
    ) -> Engine {
        let max_batch = cfg.max_batch;
        let engine = Engine {
            exec,
            batch: Batch::with_capacity(cfg.step_tokens),
            prefix: PrefixCache::new(kv.block_size()),
            free_slots: (0..max_batch).rev().collect(),
            kv,
            cfg,
            eog,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            out_rows: Vec::new(),
            fed: Vec::new(),
            hidden_rows: Vec::new(),
            admissions: 0,
            turns: HashMap::new(),
            slot_tokens: vec![Vec::new(); max_batch],
            slot_ops: Vec::new(),
        };
        engine.publish();
        engine
    }

    /// Runs until every sender of `rx` is gone and no work is left.
    pub fn run<M: Into<Msg>>(mut self, mut rx: mpsc::UnboundedReceiver<M>) {
        let mut open = true;
        loop {
            self.slot_actions();
            // take new requests; block only when there is nothing to do
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.blocking_recv() {
                    Some(m) => self.take(m.into()),
                    None => return,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(m) => self.take(m.into()),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            self.slot_actions();
            if !open && self.running.is_empty() && self.waiting.is_empty() {
                return;
            }
            self.step();
        }
    }

    /// Runs the slot actions whose slot no request in the engine is using (as llama-server
    /// defers them while their slot is processing), after dropping the requests whose
    /// client left (so an action right after a reply a stop string ended sees its tokens).
    fn slot_actions(&mut self) {
        if self.slot_ops.is_empty() {
            return;
        }
        self.reap_cancelled();
        let busy: Vec<usize> = self
            .running
            .iter()
            .map(|s| s.req.slot.unwrap_or(s.slot))
            .chain(self.waiting.iter().filter_map(|s| s.req.slot))
            .collect();
        let (now, later): (Vec<SlotOp>, Vec<SlotOp>) = std::mem::take(&mut self.slot_ops)
            .into_iter()
            .partition(|op| !busy.contains(&op.id));
        self.slot_ops = later;
        for op in now {
            self.slot_action(op);
        }
    }

    fn take(&mut self, m: Msg) {
        match m {
            Msg::Run(r) => self.enqueue(*r),
            Msg::Slot(op) => self.slot_ops.push(op),
        }
    }

    /// Runs one slot action and answers it.
    fn slot_action(&mut self, op: SlotOp) {
        let done = if op.id >= self.slot_tokens.len() {
            Err(format!(
                "invalid slot id {} (0..{})",
                op.id,
                self.slot_tokens.len()
            ))
        } else {
            match op.action {
                SlotAction::Save => self.save_slot(op.id).map(SlotDone::Saved),
                SlotAction::Restore(img) => self.restore_slot(op.id, img).map(SlotDone::Restored),
                SlotAction::Erase => {
                    let tokens = std::mem::take(&mut self.slot_tokens[op.id]);
                    self.prefix.erase(&tokens, &mut self.kv);
                    Ok(SlotDone::Erased(tokens.len()))
                }
            }
        };
        self.publish();
        let _ = op.reply.send(done);
    }

    /// The blocks the prefix cache holds of slot `id`'s tokens, copied out (the last one
    /// partly filled, where the cache has it).
    fn save_slot(&mut self, id: usize) -> Result<SlotImage, String> {
        let tokens = &self.slot_tokens[id];
        let block = self.kv.block_size();
        let mut found = self.prefix.lookup(tokens, tokens.len() / block);
        let mut n = found.len() * block;
        if found.len() == tokens.len() / block && self.kv.pool_window().is_none() {
            if let Some((b, common)) = self.prefix.partial(tokens, found.len()) {
                found.push((b, NO_BLOCK));
                n += common.min(tokens.len() - n);
            }
        }
        let mut img = SlotImage {
            tokens: tokens[..n].to_vec(),
            windows: found.iter().map(|&(_, w)| w != NO_BLOCK).collect(),
            data: Vec::new(),
        };
        let len: usize = img
            .windows
            .iter()
            .map(|&w| self.kv.block_image_len(w))
            .sum();
        img.data
            .try_reserve_exact(len)
            .map_err(|e| format!("{len} bytes: {e}"))?;
        for (b, w) in found {
            self.kv.export_block(b, w, &mut img.data)?;
        }
        Ok(img)
    }

    /// Puts the blocks of `img` into the prefix cache, after those of its prefix already
    /// there, while the pool has blocks (free or only the tree's; never a running
    /// sequence's), and makes its tokens slot `id`'s. Returns the tokens now cached.
    fn restore_slot(&mut self, id: usize, img: SlotImage) -> Result<usize, String> {
        let block = self.kv.block_size();
        let n = img.windows.len();
        if img.tokens.len() > n * block || img.tokens.len() + block <= n * block {
            return Err(format!(
                "{} tokens in {n} blocks of {block} positions",
                img.tokens.len()
            ));
        }
        if img.tokens.len() < n * block && self.kv.pool_window().is_some() {
            return Err("a partly filled block for a model with window layers".into());
        }
        if img.tokens.len() > self.cfg.ctx {
            return Err(format!(
                "{} tokens do not fit the context ({})",
                img.tokens.len(),
                self.cfg.ctx
            ));
        }
        if img.windows.iter().any(|&w| w) && self.kv.pool_window().is_none() {
            return Err("window-layer rows for a model without window layers".into());
        }
        let lens: Vec<usize> = img
            .windows
            .iter()
            .map(|&w| self.kv.block_image_len(w))
            .collect();
        if img.data.len() != lens.iter().sum::<usize>() {
            return Err(format!(
                "{} bytes of blocks where {n} blocks of this cache take {}",
                img.data.len(),
                lens.iter().sum::<usize>()
            ));
        }
        // the blocks already cached, held while the pool is searched for the rest
        let mut have = self.prefix.lookup(&img.tokens, n);
        for &(b, w) in &have {
            self.kv.retain(b);
            if w != NO_BLOCK {
                self.kv.retain_window(w);
            }
        }
        let mut at: usize = lens[..have.len()].iter().sum();
        let mut failed = None;
        for (&window, &len) in img.windows.iter().zip(&lens).skip(have.len()) {
            let Some((b, w)) = self.alloc_pair(window) else {
                break;
            };
            have.push((b, w));
            if let Err(e) = self.kv.import_block(b, w, &img.data[at..at + len]) {
                failed = Some(e);
                break;
            }
            at += len;
        }
        let m = if failed.is_some() { 0 } else { have.len() };
        let upto = (m * block).min(img.tokens.len());
        let (blocks, windows): (Vec<u32>, Vec<u32>) = have.iter().copied().unzip();
        self.prefix
            .insert(&img.tokens[..upto], &blocks, &windows, &mut self.kv);
        for (b, w) in have {
            self.kv.release(b);
            if w != NO_BLOCK {
                self.kv.release_window(w);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        self.slot_tokens[id] = img.tokens[..upto].to_vec();
        Ok(upto)
    }

    fn enqueue(&mut self, req: Request) {
        if req.embed.is_some() && !self.exec.gives_hidden() {
            // the HTTP front end refuses these first; a caller in process gets the reason
            let why = format!(
                "embeddings: the {} backend gives no hidden states",
                self.exec.backend()
            );
            let _ = req.tx.send(Event::Error(why));
            self.metrics.failed.fetch_add(1, Ordering::Relaxed);
            self.metrics.queue_depth_sub(1, req.background);
            return;
        }
        let vocab = self.exec.config().vocab_size;
        let mut sampler = Sampler::new(req.sampler.clone(), vocab);
        for &t in &req.prompt {
            sampler.accept(t);
        }
        self.waiting.push_back(Seq {
            tokens: req.prompt.clone(),
            n_prompt: req.prompt.len(),
            n_cached: 0,
            generated: 0,
            sampler,
            slot: usize::MAX,
            cached_tokens: 0,
            indexed: false,
            scored: 1,
            admitted: None,
            first_token: None,
            queue_ms: 0.0,
            guesses: Vec::new(),
            following: gds_runtime::draft::Prediction::new(),
            quoted: gds_runtime::draft::Prediction::quoted(),
            predicted: false,
            predicted_guesses: 0,
            predicted_accepted: 0,
            pooled: Vec::new(),
            req,
        });
    }

    /// Blocks a sequence needs to hold positions `0..n`.
    fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.kv.block_size())
    }

    /// Takes a free block, evicting from the prefix tree when the pool is dry; with a
    /// window pool, also a window-pool block (the pair, or nothing).
    fn alloc(&mut self) -> Option<(u32, u32)> {
        self.alloc_pair(self.kv.pool_window().is_some())
    }

    /// [`Engine::alloc`]'s main block, and a window-pool block only `with_window`.
    fn alloc_pair(&mut self, with_window: bool) -> Option<(u32, u32)> {
        let b = match self.kv.alloc() {
            Some(b) => b,
            None if self.prefix.evict(&mut self.kv, 1) > 0 => self.kv.alloc()?,
            None => return None,
        };
        if !with_window {
            return Some((b, NO_BLOCK));
        }
        let w = match self.kv.alloc_window() {
            Some(w) => Some(w),
            None if self.prefix.evict_window(&mut self.kv, 1) > 0 => self.kv.alloc_window(),
            None => None,
        };
        match w {
            Some(w) => Some((b, w)),
            None => {
                self.kv.release(b);
                None
            }
        }
    }

    /// Releases everything `seq` holds in the cache and its slot.
    fn release(&mut self, seq: &mut Seq) {
        self.kv.release_seq(seq.slot);
        if seq.slot != usize::MAX {
            self.free_slots.push(seq.slot);
        }
        seq.slot = usize::MAX;
        seq.n_cached = 0;
        // an embedding computed again from the start pools again
        seq.pooled.clear();
    }

    /// Sends `ev`; false when the client is gone.
    fn send(seq: &Seq, ev: Event) -> bool {
        seq.req.tx.send(ev).is_ok()
    }

    /// Keeps what `seq` computed: its cached tokens go to the prefix tree and become its
    /// slot's last tokens.
    fn keep_cached(&mut self, seq: &Seq) {
        self.index(seq, seq.n_cached);
        if seq.slot == usize::MAX || seq.req.embed.is_some() {
            return;
        }
        let id = seq.req.slot.unwrap_or(seq.slot);
        if let Some(t) = self.slot_tokens.get_mut(id) {
            t.clear();
            t.extend_from_slice(&seq.tokens[..seq.n_cached.min(seq.tokens.len())]);
        }
    }

    fn finish(&mut self, mut seq: Seq, finish: Finish) {
        self.keep_cached(&seq);
        let now = Instant::now();
        let first = seq.first_token.unwrap_or(now);
        let done = Done {
            finish,
            prompt_tokens: seq.n_prompt,
            cached_tokens: seq.cached_tokens,
            generated: seq.generated,
            prompt_ms: seq
                .admitted
                .map_or(0.0, |a| (first - a).as_secs_f64() * 1000.0),
            decode_ms: (now - first).as_secs_f64() * 1000.0,
            queue_ms: seq.queue_ms,
            predicted_accepted: seq.predicted_accepted,
            predicted_rejected: seq.predicted_guesses - seq.predicted_accepted,
        };
        let len = (done.prompt_tokens + done.generated) as u64;
        let _ = Self::send(&seq, Event::Done(done));
        self.release(&mut seq);
        self.metrics.finished.fetch_add(1, Ordering::Relaxed);
        self.metrics.tokens_max.fetch_max(len, Ordering::Relaxed);
    }

    /// Shifts `seq`'s full context ([`Shift`]): what its cache holds goes to the prefix tree
    /// (the kept start is found there again), its blocks and slot are released, the span is
    /// dropped from its tokens, and it goes to the queue's front, admitted again before any
    /// new request, to compute the rest as a prompt and sample on from its last token.
    fn shift(&mut self, mut seq: Seq, keep: usize, discard: usize) {
        self.index(&seq, seq.n_cached);
        self.release(&mut seq);
        seq.tokens.drain(keep..keep + discard);
        self.metrics.context_shifts.fetch_add(1, Ordering::Relaxed);
        self.metrics.queue_depth_add(1, seq.req.background);
        self.waiting.push_front(seq);
    }

    /// Offers the full blocks of `seq`'s first `n` tokens to the prefix tree.
    fn index(&mut self, seq: &Seq, n: usize) {
        if seq.slot == usize::MAX {
            return;
        }
        let n = n.min(seq.n_cached);
        let table = self.kv.table(seq.slot).to_vec();
        let windows = self.kv.window_table(seq.slot).to_vec();
        let keys = salted(&seq.tokens[..n], seq.req.salt);
        self.prefix.insert(&keys, &table, &windows, &mut self.kv);
    }

    /// Drops requests whose receiver is gone, wherever they are: cancelled when the client
    /// went away, finished when the front end ended them (stop string).
    fn reap_cancelled(&mut self) {
        let (mut cancelled, mut ended) = (0u64, 0u64);
        let mut count = |s: &Seq| {
            if s.req.ended_by_front.load(Ordering::Relaxed) {
                ended += 1;
            } else {
                cancelled += 1;
            }
        };
        let (mut gone, mut gone_batch) = (0, 0);
        self.waiting.retain(|s| {
            let closed = s.req.tx.is_closed();
            if closed {
                count(s);
                gone += 1;
                gone_batch += usize::from(s.req.background);
            }
            !closed
        });
        self.metrics.queue_depth_sub(gone - gone_batch, false);
        self.metrics.queue_depth_sub(gone_batch, true);
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].req.tx.is_closed() {
                let mut s = self.running.remove(i);
                count(&s);
                // (a reply a stop string ended stays in the prefix cache, as a finished one)
                self.keep_cached(&s);
                self.release(&mut s);
            } else {
                i += 1;
            }
        }
        self.metrics
            .cancelled
            .fetch_add(cancelled, Ordering::Relaxed);
        self.metrics.finished.fetch_add(ended, Ordering::Relaxed);
    }

    /// Admits waiting requests, in [`Engine::next_waiting`]'s order, while a slot and enough
    /// blocks for the whole prompt are there.
    fn admit(&mut self) {
        let block = self.kv.block_size();
        let mut running: HashMap<Option<IpAddr>, usize> = HashMap::new();
        for s in &self.running {
            *running.entry(s.req.client_ip()).or_default() += 1;
        }
        while let Some(next) = self.next_waiting(&running) {
            if self.running.len() >= self.cfg.max_batch {
                // a full batch makes room by preempting a request that ranks after this one
                // (a batch job's for a client's; a higher priority value for a lower)
                let rank = self.waiting[next].req.rank();
                if !self.preempt_for(rank, &mut running) {
                    break;
                }
                continue;
            }
            let front = &self.waiting[next];
            let len = front.tokens.len();
            let max_shared = (len - 1) / block;
            // a scored prompt needs the logits of every position, a mean or first-token
            // embedding the states of every position: nothing shared
            let whole = front.req.echo || front.req.embed.is_some_and(|e| e != Pooling::Last);
            let keys = salted(&front.tokens, front.req.salt);
            let mut shared = if whole {
                Vec::new()
            } else {
                self.prefix.lookup(&keys, max_shared)
            };
            // with a window pool, only a prefix whose window blocks are all held
            while !shared.is_empty() {
                let first = self.kv.window_first_block(shared.len() * block);
                let held = self.kv.pool_window().is_none()
                    || shared[first..].iter().all(|&(_, w)| w != NO_BLOCK);
                if held {
                    break;
                }
                shared.pop();
            }
            // then a block the prompt goes on into part of the way: its start is copied
            // (not where the rows are the backend's, or a window pool's)
            let room = len - 1 - shared.len() * block;
            let partial =
                if whole || room == 0 || !self.kv.has_rows() || self.kv.pool_window().is_some() {
                    None
                } else {
                    self.prefix
                        .partial(&keys, shared.len())
                        .map(|(b, n)| (b, n.min(room)))
                };
            let need = self.blocks_for(len + 1) - shared.len();
            let available = self.kv.free_blocks() + self.prefix.evictable(&self.kv);
            // the window pool: a sequence holds about its window there, never more
            let fits_window = self.kv.pool_window().is_none_or(|w| {
                let hold = (w - 1).div_ceil(block) + 3 + self.cfg.step_tokens.div_ceil(block);
                need.min(hold)
                    <= self.kv.window_free_blocks() + self.prefix.evictable_window(&self.kv)
            });
            // a request alone in the engine always gets in (it may be preempted later)
            if (need > available || !fits_window) && !self.running.is_empty() {
                break;
            }
            let Some(slot) = self.free_slots.pop() else {
                break;
            };
            let mut seq = self.waiting.remove(next).expect("next exists");
            seq.slot = slot;
            let from = seq.req.client_ip();
            self.admissions += 1;
            self.turns.insert(from, self.admissions);
            *running.entry(from).or_default() += 1;
            let first = self.kv.window_first_block(shared.len() * block);
            for (i, &(b, w)) in shared.iter().enumerate() {
                self.kv.retain(b);
                self.kv.push_block(slot, b);
                if self.kv.pool_window().is_some() {
                    // blocks behind the window are not needed (nor, maybe, held)
                    let w = if i < first { NO_BLOCK } else { w };
                    if w != NO_BLOCK {
                        self.kv.retain_window(w);
                    }
                    self.kv.push_window(slot, w);
                }
            }
            seq.n_cached = shared.len() * block;
            if let Some((src, n)) = partial {
                // (held while a block is found, which may evict)
                self.kv.retain(src);
                if let Some((dst, _)) = self.alloc() {
                    if self.kv.copy_block(src, dst).is_ok() {
                        self.kv.push_block(slot, dst);
                        seq.n_cached += n;
                    } else {
                        self.kv.release(dst);
                    }
                }
                self.kv.release(src);
            }
            if seq.admitted.is_none() {
                let now = Instant::now();
                seq.admitted = Some(now);
                seq.queue_ms = (now - seq.req.received).as_secs_f64() * 1000.0;
                seq.cached_tokens = seq.n_cached.min(seq.n_prompt);
                self.metrics
                    .prompt_tokens_cached
                    .fetch_add(seq.cached_tokens as u64, Ordering::Relaxed);
                if seq.req.progress {
                    Self::send(&seq, Event::Progress(seq.progress(now)));
                }
            }
            self.metrics.queue_depth_sub(1, seq.req.background);
            // `running` stays in rank order, admission order among equals: the step serves
            // it from the front, and a dry KV pool preempts from the back
            let rank = seq.req.rank();
            let at = self
                .running
                .iter()
                .rposition(|s| s.req.rank() <= rank)
                .map_or(0, |p| p + 1);
            self.running.insert(at, seq);
        }
        // the turns of clients with nothing waiting are forgotten now and then (one that
        // comes back starts afresh, as a new client would)
        if self.turns.len() > 4 * self.waiting.len() + 64 {
            let waiting: HashSet<_> = self.waiting.iter().map(|s| s.req.client_ip()).collect();
            self.turns.retain(|k, _| waiting.contains(k));
        }
    }

    /// Preempts the running request that ranks last ([`Request::rank`]; `running` is kept
    /// in rank order, so the last one), where it ranks after `rank`, for a request of that
    /// rank to take its place: what it computed goes to the prefix tree first, so it is
    /// recomputed from there when it is admitted again. False where none ranks after it.
    fn preempt_for(
        &mut self,
        rank: (Tier, i64),
        running: &mut HashMap<Option<IpAddr>, usize>,
    ) -> bool {
        if self.running.last().is_none_or(|s| s.req.rank() <= rank) {
            return false;
        }
        let s = self.running.pop().expect("a last one ranks after rank");
        self.index(&s, s.n_cached);
        if let Some(n) = running.get_mut(&s.req.client_ip()) {
            *n = n.saturating_sub(1);
        }
        self.requeue(s);
        true
    }

    /// The waiting request to admit next (its index in `waiting`): the first in
    /// [`Request::rank`] (clients' before batch jobs', then by priority); among those, a
    /// preempted one first (it was running); else the oldest request of the client address
    /// with the fewest requests in `running` (counts by address), ties going to the client
    /// whose last admission is the oldest. A choice whose sibling (`group`) is still
    /// prefilling their shared prompt waits for it, to start from its cached blocks.
    fn next_waiting(&self, running: &HashMap<Option<IpAddr>, usize>) -> Option<usize> {
        let mut ranks: Vec<(Tier, i64)> = self.waiting.iter().map(|s| s.req.rank()).collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks.into_iter().find_map(|r| self.next_of(running, r))
    }

    /// [`Engine::next_waiting`] among the requests of rank `rank`.
    fn next_of(
        &self,
        running: &HashMap<Option<IpAddr>, usize>,
        rank: (Tier, i64),
    ) -> Option<usize> {
        if let Some(i) = self
            .waiting
            .iter()
            .position(|s| s.admitted.is_some() && s.req.rank() == rank)
        {
            return Some(i);
        }
        let prefilling: HashSet<u64> = self
            .running
            .iter()
            .filter(|s| !s.indexed)
            .filter_map(|s| s.req.group)
            .collect();
        let mut seen = HashSet::new();
        let mut best: Option<((usize, u64), usize)> = None;
        for (i, s) in self.waiting.iter().enumerate() {
            if s.req.rank() != rank || s.req.group.is_some_and(|g| prefilling.contains(&g)) {
                continue;
            }
            let from = s.req.client_ip();
            if !seen.insert(from) {
                continue;
            }
            let turn = (
                running.get(&from).copied().unwrap_or(0),
                self.turns.get(&from).copied().unwrap_or(0),
            );
            if best.is_none_or(|(r, _)| turn < r) {
                best = Some((turn, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Preempts the newest running sequence of the last rank (`running` is kept in rank order):
    /// back to the front of the queue.
    fn preempt_newest(&mut self) -> bool {
        let Some(s) = self.running.pop() else {
            return false;
        };
        self.requeue(s);
        true
    }

    /// A preempted sequence back to the front of the queue, its blocks released.
    fn requeue(&mut self, mut s: Seq) {
        self.release(&mut s);
        self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
        self.metrics.queue_depth_add(1, s.req.background);
        self.waiting.push_front(s);
    }

    /// Makes sure sequence `i` has blocks for positions `0..n`; false when the pool is dry.
    fn reserve(&mut self, i: usize, n: usize) -> bool {
        let need = self.blocks_for(n);
        let slot = self.running[i].slot;
        while self.kv.table(slot).len() < need {
            match self.alloc() {
                Some((b, w)) => {
                    self.kv.push_block(slot, b);
                    if w != NO_BLOCK {
                        self.kv.push_window(slot, w);
                    }
                }
                None => return false,
            }
        }
        true
    }

    /// One step: reap, admit, build the batch, forward, sample.
    fn step(&mut self) {
        self.reap_cancelled();
        self.admit();
        if self.running.is_empty() {
            self.publish();
            return;
        }
        self.batch.clear();
        self.out_rows.clear();
        self.hidden_rows.clear();
        self.fed.clear();
        self.fed.resize(self.running.len(), 0);
        let mut budget = self.cfg.step_tokens;
        let max_out = max_outputs(&self.cfg);

        // decoding sequences first, oldest first: one token each
        let mut i = 0;
        while i < self.running.len() && budget > 0 && self.out_rows.len() < max_out {
            if !self.running[i].decoding() {
                i += 1;
                continue;
            }
            let pos = self.running[i].n_cached;
            let mut ok = self.reserve(i, pos + 1);
            while !ok {
                // preempt from the newest end; if that is this sequence, it is gone
                let last = self.running.len() - 1;
                self.preempt_newest();
                if last == i {
                    break;
                }
                ok = self.reserve(i, pos + 1);
            }
            if !ok {
                break;
            }
            // speculative decoding: guesses ride along in the same pass, each with logits,
            // where budget, output rows, context and KV blocks allow (never at another
            // sequence's expense)
            let rows_left = max_out.saturating_sub(self.out_rows.len() + self.running.len() - i);
            let s = &mut self.running[i];
            // (a prediction guesses without asking for the prompt-lookup draft)
            let most = match s.req.prediction {
                Some(_) => s.req.draft_max.max(PREDICTED_MAX),
                None => s.req.draft_max,
            };
            let k = most
                .min(budget - 1)
                .min(rows_left)
                .min(self.cfg.ctx.saturating_sub(pos + 1))
                .min(s.req.max_tokens.saturating_sub(s.generated + 1));
            let mut guesses = Vec::new();
            s.predicted = false;
            if k > 0 && s.req.constraint.is_none() {
                let (prompt, reply) = s.tokens.split_at(s.n_prompt.min(s.tokens.len()));
                if let Some(p) = &s.req.prediction {
                    guesses = s.following.propose(p, reply, k);
                    s.predicted = !guesses.is_empty();
                }
                if guesses.is_empty() && s.req.draft_max > 0 {
                    // prompt lookup: where the reply quotes the prompt, the prompt followed
                    // from there; else the latest earlier occurrence of the last tokens
                    guesses = s.quoted.propose(prompt, reply, k);
                    if guesses.is_empty() {
                        guesses = gds_runtime::draft::ngram(
                            &s.tokens,
                            gds_runtime::draft::NGRAM_MAX,
                            gds_runtime::draft::NGRAM_MIN,
                            k,
                        );
                    }
                }
            }
            if !guesses.is_empty() && !self.reserve(i, pos + 1 + guesses.len()) {
                guesses.clear();
            }
            let s = &self.running[i];
            self.batch.push(s.tokens[pos], pos, s.slot, true);
            self.out_rows.push((i, None));
            for (j, &g) in guesses.iter().enumerate() {
                self.batch.push(g, pos + 1 + j, s.slot, true);
                self.out_rows.push((i, None));
            }
            self.fed[i] += 1 + guesses.len();
            budget -= 1 + guesses.len();
            self.metrics
                .draft_tokens
                .fetch_add(guesses.len() as u64, Ordering::Relaxed);
            if !guesses.is_empty() {
                self.metrics.drafts.fetch_add(1, Ordering::Relaxed);
            }
            let s = &mut self.running[i];
            if s.predicted {
                s.predicted_guesses += guesses.len();
            }
            s.guesses = guesses;
            i += 1;
        }
        let n_decode = self.batch.len();

        // then prompt chunks, oldest first, in what is left of the budget
        for i in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            if self.running[i].decoding() {
                continue;
            }
            let (from, len) = (self.running[i].n_cached, self.running[i].tokens.len());
            // the chunk ends before the first position that would need an output row when
            // none is left: a scored (echo) position, or the last one (whose logits give
            // the first token), whoever came before took the step's rows
            let mut rows_left = max_out.saturating_sub(self.out_rows.len());
            let mut take = 0;
            while take < (len - from).min(budget) {
                if self.running[i].out_row(from + take) {
                    if rows_left == 0 {
                        break;
                    }
                    rows_left -= 1;
                }
                take += 1;
            }
            if take == 0 {
                continue;
            }
            if !self.reserve(i, from + take) {
                // the pool is dry: use what was reserved
                let have = self.kv.table(self.running[i].slot).len() * self.kv.block_size();
                take = have.saturating_sub(from).min(take);
                if take == 0 {
                    if self.batch.is_empty() && i + 1 < self.running.len() {
                        // nothing can move: free room by preempting the newest
                        self.preempt_newest();
                    }
                    break;
                }
            }
            let s = &self.running[i];
            for p in from..from + take {
                if s.hidden_row(p) {
                    self.batch.push_hidden(s.tokens[p], p, s.slot);
                    self.hidden_rows.push(i);
                    continue;
                }
                let out = s.out_row(p);
                self.batch.push(s.tokens[p], p, s.slot, out);
                if out {
                    self.out_rows.push((i, s.scores(p)));
                }
            }
            self.fed[i] += take;
            budget -= take;
        }
        let n_prompt = self.batch.len() - n_decode;
        if self.batch.is_empty() {
            self.publish();
            return;
        }

        // grammar masks of the rows that sample: they depend only on the tokens accepted so
        // far, so a helper thread computes them while the forward pass runs
        let constrained: Vec<usize> = self
            .out_rows
            .iter()
            .filter(|&&(i, score)| {
                let r = &self.running[i].req;
                score.is_none() && r.constraint.is_some() && r.max_tokens > 0
            })
            .map(|&(i, _)| i)
            .collect();
        // by index into `running`; left empty in steps without constrained rows
        let mut masks: Vec<Option<gds_runtime::Result<Mask>>> = Vec::new();
        let t0 = Instant::now();
        let result = if constrained.is_empty() {
            self.exec.forward(&mut self.kv, &self.batch)
        } else {
            let running = &mut self.running;
            let (exec, kv, batch) = (&mut self.exec, &mut self.kv, &self.batch);
            let metrics = &self.metrics;
            masks.resize_with(running.len(), || None);
            std::thread::scope(|scope| {
                let helper = scope.spawn(|| {
                    let t = Instant::now();
                    let m: Vec<_> = constrained
                        .iter()
                        .map(|&i| {
                            let c = running[i].req.constraint.as_mut();
                            (i, c.map(Constraint::compute_mask))
                        })
                        .collect();
                    (m, t.elapsed())
                });
                let r = exec.forward(kv, batch);
                let waited = Instant::now();
                match helper.join() {
                    Ok((m, busy)) => {
                        metrics.record_masks(m.len(), busy, waited.elapsed());
                        for (i, mask) in m {
                            masks[i] = mask;
                        }
                    }
                    Err(_) => {
                        for &i in &constrained {
                            masks[i] = Some(Err(gds_runtime::RuntimeError::Internal(
                                "the grammar mask computation panicked".into(),
                            )));
                        }
                    }
                }
                r
            })
        };
        let dt = t0.elapsed().as_secs_f64();
        self.metrics.record_step(n_prompt, n_decode, dt);
        self.metrics
            .busy_slots
            .fetch_add(self.running.len() as u64, Ordering::Relaxed);
        // when the pass failed, each sequence's part runs alone: only those whose own part
        // fails are failed (a request never fails for another's fault), and the logits of
        // the others' rows are kept here
        let mut solo: Option<Vec<f32>> = None;
        let mut broken = vec![false; self.running.len()];
        let mut failed: Vec<(usize, Fault)> = Vec::new();
        let d = self.exec.config().n_embd;
        let mut solo_hidden: Option<Vec<f32>> = None;
        if result.is_err() {
            let (logits, hidden, bad) = self.forward_each();
            for (i, e) in bad {
                broken[i] = true;
                self.fed[i] = 0;
                self.running[i].guesses.clear();
                failed.push((i, Fault::Engine(e)));
            }
            solo = Some(logits);
            solo_hidden = Some(hidden);
        }
        // embeddings: pool the hidden states of this step's rows
        for (h, &i) in self.hidden_rows.iter().enumerate() {
            if broken[i] {
                continue;
            }
            let row = match &solo_hidden {
                Some(all) => &all[h * d..(h + 1) * d],
                None => self.exec.hidden(h),
            };
            let s = &mut self.running[i];
            if s.req.embed == Some(Pooling::None) {
                // (a sequence's rows come in the order of its positions)
                s.pooled.extend_from_slice(row);
                continue;
            }
            if s.pooled.is_empty() {
                s.pooled = vec![0.0; d];
            }
            for (a, &x) in s.pooled.iter_mut().zip(row) {
                *a += x;
            }
        }
        // the K/V of every token of the batch are now in the cache
        // (a sequence's guesses count once the token sampled before each equals it)
        let now = Instant::now();
        for (s, &n) in self.running.iter_mut().zip(&self.fed) {
            let before = s.n_cached;
            s.n_cached += n - s.guesses.len();
            // (the prompt going in the first time: not a preempted or shifted reply's
            // text computed again)
            if s.req.progress && n > 0 && before < s.n_prompt && s.first_token.is_none() {
                Self::send(s, Event::Progress(s.progress(now)));
            }
        }

        // sample every sequence that got logits
        let vocab = self.exec.config().vocab_size;
        let now = Instant::now();
        let mut done: Vec<(usize, Finish)> = Vec::new();
        let mut shifts: Vec<(usize, (usize, usize))> = Vec::new();
        // embeddings whose prompt is all in: the pooled vector, and the end
        for (i, s) in self.running.iter_mut().enumerate() {
            let Some(pooling) = s.req.embed else {
                continue;
            };
            if broken[i] || s.n_cached < s.n_prompt {
                continue;
            }
            let mut v = std::mem::take(&mut s.pooled);
            if pooling == Pooling::Mean {
                let n = s.n_prompt as f32;
                v.iter_mut().for_each(|x| *x /= n);
            }
            s.first_token = Some(now);
            let _ = Self::send(s, Event::Embedding(v));
            done.push((i, Finish::Length));
        }
        // with guesses, a sequence has a row per fed token: row r samples the token after
        // it, and row r + 1 counts only if that token was guess r
        let mut row_no = vec![0usize; self.running.len()];
        let mut chain_ended = vec![false; self.running.len()];
        for (row, &(i, score)) in self.out_rows.iter().enumerate() {
            if broken[i] {
                continue;
            }
            let s = &mut self.running[i];
            let r = row_no[i];
            row_no[i] += 1;
            let spec = score.is_none() && !s.guesses.is_empty();
            if spec {
                if chain_ended[i] {
                    continue;
                }
                // ended unless the sampled token turns out to be the guess
                chain_ended[i] = true;
            }
            let logits = match solo.as_mut() {
                Some(l) => &mut l[row * vocab..(row + 1) * vocab],
                None => self.exec.logits_mut(row),
            };
            if let Some(j) = score {
                let k = s.req.prompt_top.or(s.req.logprobs).unwrap_or(0);
                let tok = s.tokens[j];
                let lp = TokenLogprobs::of(logits, tok, k);
                // (a pass over the vocabulary: only where vLLM's prompt_logprobs lists it)
                let rank = s
                    .req
                    .prompt_top
                    .map_or(0, |_| gds_runtime::sampler::rank(logits, tok));
                s.scored = j + 1;
                let _ = Self::send(s, Event::PromptLogprobs(lp, rank));
                continue;
            }
            if s.req.max_tokens == 0 {
                // scoring only (echo with max_tokens 0): nothing to generate
                if s.first_token.is_none() {
                    s.first_token = Some(now);
                }
                done.push((i, Finish::Length));
                continue;
            }
            // log-probabilities come from the logits as the model gave them (or, after the
            // sampling chain, from the sampler's candidates: below)
            let raw = s
                .req
                .logprobs
                .filter(|_| !s.req.post_sampling)
                .map(|k| (k, logits.to_vec()));
            if s.req.constraint.is_some() {
                let applied = match masks.get_mut(i).and_then(Option::take) {
                    Some(m) => m.and_then(|m| m.apply(logits)),
                    None => Err(gds_runtime::RuntimeError::Internal(
                        "no grammar mask was computed".into(),
                    )),
                };
                if let Err(e) = applied {
                    failed.push((i, Fault::Grammar(e.to_string())));
                    continue;
                }
            } else if s.req.ignore_eos || s.generated < s.req.min_tokens {
                let early = s.generated < s.req.min_tokens;
                let stops = s.req.stop_ids.iter().filter(|_| early);
                for &e in self.eog.iter().chain(stops) {
                    if let Some(l) = logits.get_mut(e as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            if s.req.masks.any() {
                // (the reply's tokens so far: vLLM's bad words look at the output only)
                let out = &s.tokens[s.tokens.len() - s.generated.min(s.tokens.len())..];
                if !s.req.masks.apply(logits, out) {
                    let why = "allowed_token_ids and bad_words (with the reply's other limits: \
                               min_tokens, its grammar) leave no token to generate here";
                    failed.push((i, Fault::Masked(why.into())));
                    continue;
                }
            }
            let tok = s.sampler.sample(logits);
            if s.first_token.is_none() {
                s.first_token = Some(now);
                let prefill = Prefill {
                    cached_tokens: s.cached_tokens,
                    prompt_ms: s.admitted.map_or(0.0, |a| (now - a).as_secs_f64() * 1000.0),
                    queue_ms: s.queue_ms,
                };
                let _ = Self::send(s, Event::Prefilled(prefill));
            }
            if self.eog.contains(&tok) {
                // the end-of-generation token is part of the completion, as in OpenAI's API:
                // counted, and listed with its log-probability (evaluators read the entry
                // after the prompt's as the generated one); it adds no text
                s.generated += 1;
                self.metrics.generated.fetch_add(1, Ordering::Relaxed);
                let lp = match (raw, s.req.logprobs) {
                    (Some((k, l)), _) => Some(TokenLogprobs::of(&l, tok, k)),
                    (None, Some(k)) => Some(s.sampler.drawn(tok, k)),
                    (None, None) => None,
                };
                let _ = Self::send(s, Event::Token(tok, lp));
                done.push((i, Finish::Eos));
                continue;
            }
            if let Some(c) = s.req.constraint.as_mut() {
                if let Err(e) = c.accept(tok) {
                    failed.push((i, Fault::Grammar(e.to_string())));
                    continue;
                }
            }
            s.sampler.accept_generated(tok);
            s.tokens.push(tok);
            s.generated += 1;
            self.metrics.generated.fetch_add(1, Ordering::Relaxed);
            let lp = match (raw, s.req.logprobs) {
                (Some((k, l)), _) => Some(TokenLogprobs::of(&l, tok, k)),
                (None, Some(k)) => Some(s.sampler.drawn(tok, k)),
                (None, None) => None,
            };
            if !Self::send(s, Event::Token(tok, lp)) {
                continue; // reaped next step
            }
            if s.req.stop_ids.contains(&tok) {
                // a stop token (vLLM's `stop_token_ids`): the reply ends with it
                done.push((i, Finish::Eos));
            } else if s
                .req
                .constraint
                .as_ref()
                .is_some_and(Constraint::is_finished)
            {
                // the grammar is complete: nothing may follow
                done.push((i, Finish::Eos));
            } else if s.generated >= s.req.max_tokens {
                done.push((i, Finish::Length));
            } else if s.tokens.len() >= self.cfg.ctx {
                // the context is full: shift where the request asked for it (never an echo's,
                // whose scores go by prompt position), else the end
                let span = s.req.shift.filter(|_| !s.req.echo);
                match span.and_then(|sh| sh.span(s.tokens.len(), self.cfg.ctx)) {
                    Some(span) => shifts.push((i, span)),
                    None => done.push((i, Finish::Length)),
                }
            } else if spec && s.guesses.get(r) == Some(&tok) {
                // the guess was right: its K/V are in the cache, and the next row holds
                // the logits after it
                s.n_cached += 1;
                chain_ended[i] = false;
                if s.predicted {
                    s.predicted_accepted += 1;
                }
                self.metrics.draft_accepted.fetch_add(1, Ordering::Relaxed);
            }
        }
        let block = self.kv.block_size();
        for s in &mut self.running {
            s.guesses.clear();
            // window layers: release the blocks no later query sees, keeping the window
            // behind the last block boundary (and, until the prompt is indexed, behind the
            // boundary a follower with the same prompt shares up to), so the prefix tree
            // gets the window blocks a match needs
            let mut keep = s.n_cached / block * block;
            if !s.indexed {
                keep = keep.min(s.n_prompt.saturating_sub(1) / block * block);
            }
            self.kv.drop_window_behind(s.slot, keep);
        }
        // index prompts that just finished prefilling, so followers can share them
        for k in 0..self.running.len() {
            let s = &self.running[k];
            if !s.indexed && s.n_cached >= s.n_prompt {
                let (n, slot) = (s.n_prompt, s.slot);
                let table = self.kv.table(slot).to_vec();
                let windows = self.kv.window_table(slot).to_vec();
                let toks = salted(&s.tokens[..n], s.req.salt).into_owned();
                self.prefix.insert(&toks, &table, &windows, &mut self.kv);
                self.running[k].indexed = true;
            }
        }
        // remove finished ones, highest index first so indices stay valid
        let mut ended: Vec<(usize, Exit)> = done
            .into_iter()
            .map(|(i, f)| (i, Exit::Done(f)))
            .chain(failed.into_iter().map(|(i, e)| (i, Exit::Fault(e))))
            .chain(shifts.into_iter().map(|(i, (k, d))| (i, Exit::Shift(k, d))))
            .collect();
        ended.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, f) in ended {
            let mut s = self.running.remove(i);
            match f {
                Exit::Done(f) => self.finish(s, f),
                Exit::Shift(keep, discard) => self.shift(s, keep, discard),
                Exit::Fault(e) => {
                    let ev = match e {
                        Fault::Grammar(e) => Event::RequestFault(e, "grammar_error"),
                        Fault::Masked(e) => Event::RequestFault(e, "invalid_request_error"),
                        Fault::Engine(e) => Event::Error(e),
                    };
                    let _ = Self::send(&s, ev);
                    self.release(&mut s);
                    self.metrics.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.publish();
    }

    /// After a failed forward pass: runs each sequence's part of the step's batch alone.
    /// Returns the logits of every output row, in `out_rows` order, the hidden states of
    /// every hidden row, in `hidden_rows` order (zero for the rows of a sequence whose part
    /// failed), and the sequences whose part failed, with the error.
    #[allow(clippy::type_complexity)]
    fn forward_each(&mut self) -> (Vec<f32>, Vec<f32>, Vec<(usize, String)>) {
        let vocab = self.exec.config().vocab_size;
        let d = self.exec.config().n_embd;
        let mut logits = vec![0.0f32; self.out_rows.len() * vocab];
        let mut hidden = vec![0.0f32; self.hidden_rows.len() * d];
        let mut failed = Vec::new();
        let mut part = Batch::with_capacity(self.batch.len());
        for i in 0..self.running.len() {
            if self.fed[i] == 0 {
                continue;
            }
            let slot = self.running[i].slot;
            part.clear();
            for k in 0..self.batch.len() {
                match self.batch.get(k) {
                    Some((t, p, s, _)) if s == slot && self.batch.wants_hidden(k) => {
                        part.push_hidden(t, p, s)
                    }
                    Some((t, p, s, out)) if s == slot => part.push(t, p, s, out),
                    _ => {}
                }
            }
            match self.exec.forward(&mut self.kv, &part) {
                Ok(_) => {
                    let rows = self.out_rows.iter().enumerate();
                    let mine = rows.filter(|&(_, &(j, _))| j == i).map(|(r, _)| r);
                    for (n, r) in mine.enumerate() {
                        logits[r * vocab..(r + 1) * vocab].copy_from_slice(self.exec.logits(n));
                    }
                    let rows = self.hidden_rows.iter().enumerate();
                    let mine = rows.filter(|&(_, &j)| j == i).map(|(r, _)| r);
                    for (n, r) in mine.enumerate() {
                        hidden[r * d..(r + 1) * d].copy_from_slice(self.exec.hidden(n));
                    }
                }
                Err(e) => failed.push((i, format!("forward pass failed: {e}"))),
            }
        }
        (logits, hidden, failed)
    }

    /// Updates the gauges.
    fn publish(&self) {
        let m = &self.metrics;
        m.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        m.kv_blocks_free
            .store(self.kv.free_blocks() as u64, Ordering::Relaxed);
        m.kv_blocks_total
            .store(self.kv.n_blocks() as u64, Ordering::Relaxed);
        m.kv_blocks_prefix
            .store(self.prefix.len() as u64, Ordering::Relaxed);
        m.kv_window_blocks_total
            .store(self.kv.window_n_blocks() as u64, Ordering::Relaxed);
        m.kv_window_blocks_free
            .store(self.kv.window_free_blocks() as u64, Ordering::Relaxed);
        m.set_io(self.exec.io_stats());
    }
}

#[cfg(test)]
mod tests {
    use super::Shift;

    #[test]
    fn a_shift_drops_half_of_what_follows_the_kept_start_as_llama_server() {
        // 128 positions full (the last token not cached yet): 127 cached, 3 kept, 62 dropped
        let s = Shift {
            keep: 3,
            discard: 0,
        };
        assert_eq!(s.span(128, 128), Some((3, 62)));
        // a given discard, at most what leaves one token after the kept ones
        let d = |discard| Shift { keep: 3, discard }.span(128, 128);
        assert_eq!(d(10), Some((3, 10)));
        assert_eq!(d(1000), Some((3, 123)));
        // the kept start is at most ctx - 4, so a shift always frees room
        let all = Shift {
            keep: 500,
            discard: 0,
        };
        assert_eq!(all.span(128, 128), Some((124, 1)));
        // nothing cached after the kept start: nothing to drop
        assert_eq!(all.span(125, 128), None);
        assert_eq!(all.span(126, 128), None);
    }
}
