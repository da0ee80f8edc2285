//! The run loop: prompt in, tokens out, following a [`Plan`]. Owns the model, tokenizer,
//! preallocated state, KV cache (kept between chat turns: only the new suffix of a
//! conversation is evaluated) and sampler.

use crate::chat::Message;
use crate::config::Config;
use crate::constraint::{Constraint, GrammarCompiler};
use crate::error::{Result, RuntimeError};
use crate::exec::{eval_last, reusable_prefix, Executor};
use crate::metrics::{EnergyMeter, Metrics};
use crate::plan::{Limits, Mode, Plan};
use crate::reasoning::{Reasoning, Split};
use crate::reply::Reply;
use crate::sampler::{Sampler, SamplerConfig, TokenLogprobs};
use crate::tokenizer::TextTokenizer;
use serde::Serialize;

/// (The stop-string hold-back lives with the rest of the per-token policy.)
pub use crate::reply::held_back;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Gives `cfg` what its stages read of the vocabulary: DRY's breakers as the tokenizer's
/// tokens (for its breakers: the tokenizer keeps the last lists'), where DRY is on, and the
/// infill stage's tables, where it is listed.
pub fn attach_vocab_tables(cfg: &mut SamplerConfig, tok: &TextTokenizer) {
    if cfg.extra.dry_on() {
        cfg.extra.dry_table = Some(tok.dry_breakers(&cfg.extra.dry_sequence_breakers));
    }
    if cfg.extra.order.contains(&crate::sampler::Stage::Infill) {
        cfg.extra.infill_table = Some(tok.infill_vocab());
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    Eos,
    /// `max_tokens` were generated.
    MaxTokens,
    /// A stop string appeared.
    StopString,
    /// The context window is full.
    ContextFull,
    /// The energy budget is spent.
    EnergyLimit,
    /// The user interrupted (Ctrl-C).
    Interrupted,
    /// The output is a complete sentence of the plan's grammar and nothing may follow.
    Grammar,
}

impl StopReason {
    /// The snake_case name used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopString => "stop_string",
            StopReason::ContextFull => "context_full",
            StopReason::EnergyLimit => "energy_limit",
            StopReason::Interrupted => "interrupted",
            StopReason::Grammar => "grammar",
        }
    }

    /// OpenAI's `finish_reason` for it: `stop` where the reply ended on its own (an
    /// end-of-generation token, a stop string, a finished grammar), `length` where a limit
    /// cut it (tokens, context, energy, an interrupt).
    pub fn finish(self) -> &'static str {
        match self {
            StopReason::Eos | StopReason::StopString | StopReason::Grammar => "stop",
            StopReason::MaxTokens
            | StopReason::ContextFull
            | StopReason::EnergyLimit
            | StopReason::Interrupted => "length",
        }
    }
}

/// The result of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    /// Generated text (stop string excluded); a thinking model's chat turn: its answer.
    pub text: String,
    /// A thinking model's chat turn: its reasoning, apart from the answer
    /// ([`crate::reasoning`]), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Generated token ids (end-of-generation token excluded).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// With the plan's `logprobs`: per generated token, its log-probability and the most
    /// likely alternatives (the model's log-softmax at temperature 1, before sampling).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// Timings and counters.
    pub metrics: Metrics,
}

impl GenerateOutput {
    /// The JSON object `gdsrun run --json` prints for this reply (and the Python package's
    /// `generate(details=True)` returns): its fields, `logprobs` null when not asked for, and
    /// the plan.
    pub fn json_with_plan(&self, plan: &Plan) -> serde_json::Value {
        serde_json::json!({
            "text": self.text,
            "reasoning": self.reasoning,
            "tokens": self.tokens,
            "stop_reason": self.stop_reason,
            "logprobs": self.logprobs,
            "plan": plan,
            "metrics": self.metrics,
        })
    }
}

/// A loaded model ready to generate.
pub struct Engine {
    plan: Plan,
    exec: Box<dyn Executor>,
    tokenizer: TextTokenizer,
    sampler: Sampler,
    /// Tokens whose K/V are in the cache, in order (sequence 0).
    cached: Vec<u32>,
    /// Positions the cache has been written up to: past `cached` when a speculative pass
    /// wrote guesses that were not accepted (what a window ring may have overwritten).
    written: usize,
    messages: Vec<Message>,
    energy: EnergyMeter,
    load_ms: f64,
    interrupt: Arc<AtomicBool>,
    /// With a grammar in the plan: its compiler (each reply starts a fresh constraint).
    grammar: Option<GrammarCompiler>,
    /// The draft model of `--draft-model`, with its own cache.
    draft_model: Option<crate::draft::ModelDraft>,
    /// Special tokens the reply's text keeps (a chat turn's thinking markers).
    keep: Vec<u32>,
    /// Chat turns that do not fit leave out the oldest messages ([`Self::set_drop_oldest`]).
    drop_oldest: bool,
    /// Messages left out so far.
    dropped: usize,
}

/// Loads the tokenizer of `plan`'s model for the plan's configuration (the manifest's, as
/// every executor's) on a thread of its own while `open` runs on this one, and gives both
/// results, for the caller to report their errors in its order. A large vocabulary takes
/// most of a second of one core (Gemma 3's 262k tokens and 515k merges), which opening the
/// executor (reading the resident weights) now hides. Without a thread to be had, in turn.
pub fn load_tokenizer_beside<T>(
    plan: &Plan,
    open: impl FnOnce() -> T,
) -> (Result<TextTokenizer>, T) {
    let load = || TextTokenizer::load_for_model(&plan.model_dir, &plan.model);
    std::thread::scope(|s| {
        let thread = std::thread::Builder::new()
            .name("gds-tokenizer-load".into())
            .spawn_scoped(s, load);
        let opened = open();
        let tokenizer = match thread {
            Ok(t) => t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            Err(_) => load(),
        };
        (tokenizer, opened)
    })
}

impl Engine {
    /// Why the energy used cannot be measured (no RAPL counter readable, and no GPU's), or
    /// `None` when it can: a `--max-joules` limit is then not enforced.
    pub fn energy_unavailable(&self) -> Option<&str> {
        (!self.energy.available()).then(|| self.energy.source())
    }

    /// Loads the model on the plan's backend and the tokenizer, and allocates all run
    /// buffers.
    pub fn load(plan: Plan) -> Result<Engine> {
        let t0 = Instant::now();
        // a speculative pass wants logits at the sampled token and at every guess
        let outputs = plan
            .draft
            .as_ref()
            .map_or(0, |d| d.max_tokens)
            .saturating_add(1);
        // The tokenizer loads beside the executor; an executor that fails is reported
        // first, as when the two ran in turn.
        let (tokenizer, exec) =
            load_tokenizer_beside(&plan, || crate::exec::open(&plan, plan.batch, outputs));
        let exec = exec?;
        let mut tokenizer = tokenizer?;
        let draft_model = match plan.draft.as_ref().and_then(|d| d.model_plan.as_deref()) {
            Some(sub) => {
                let ex = crate::exec::open(sub, sub.batch, 1)?;
                Some(crate::draft::ModelDraft::new(ex, plan.ctx))
            }
            None => None,
        };
        if let Some(src) = &plan.chat_template_override {
            tokenizer.set_chat_template(src)?;
        }
        let mut cfg = plan.sampler.clone();
        attach_vocab_tables(&mut cfg, &tokenizer);
        let sampler = Sampler::new(cfg, exec.config().vocab_size);
        let grammar = match &plan.grammar {
            Some(g) => {
                let c =
                    GrammarCompiler::load(&plan.model_dir, &tokenizer, exec.config().vocab_size)?;
                // a grammar that does not compile fails here, before any prompt
                c.compile(g)?;
                Some(c)
            }
            None => None,
        };
        let mut messages = Vec::new();
        if let Some(s) = &plan.system {
            messages.push(Message::new("system", s));
        }
        let mut energy = EnergyMeter::open();
        if plan.gpu.is_some() {
            // The GPU's own counter (NVML) joins the CPU packages' when the CUDA backend runs.
            match gds_cuda::nvml::GpuEnergy::open(0) {
                Ok(mut g) => energy.add_counter(&g.source(), Box::new(move || g.millijoules())),
                Err(e) => energy.note_missing(&format!("GPU energy unavailable: {e}")),
            }
        }
        Ok(Engine {
            cached: Vec::with_capacity(plan.ctx),
            written: 0,
            energy,
            load_ms: t0.elapsed().as_secs_f64() * 1000.0,
            interrupt: Arc::new(AtomicBool::new(false)),
            plan,
            exec,
            tokenizer,
            sampler,
            messages,
            draft_model,
            grammar,
            keep: Vec::new(),
            drop_oldest: false,
            dropped: 0,
        })
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> &Config {
        self.exec.config()
    }

    /// The backend running the forward passes (`cpu`, `cuda`).
    pub fn backend(&self) -> &'static str {
        self.exec.backend()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// Time the load took, ms.
    pub fn load_ms(&self) -> f64 {
        self.load_ms
    }

    /// A flag that, once set, makes the current generation stop with
    /// [`StopReason::Interrupted`] (set it from a signal handler). Cleared at the start of
    /// each generation.
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        self.interrupt.clone()
    }

    /// Generates from `prompt` per the plan's mode: a chat turn (the conversation so far is
    /// kept) or a raw completion. `on_text` receives text as it is generated (a thinking
    /// model's answer: its reasoning is the output's `reasoning`).
    pub fn generate(
        &mut self,
        prompt: &str,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        self.generate_parts(prompt, &mut |_| {}, on_text)
    }

    /// [`Self::generate`], a thinking model's reasoning streamed to `on_reasoning`.
    pub fn generate_parts(
        &mut self,
        prompt: &str,
        on_reasoning: &mut dyn FnMut(&str),
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        match self.plan.mode {
            Mode::Chat => self.chat_turn_parts(prompt, on_reasoning, on_text),
            Mode::Raw => {
                let t0 = Instant::now();
                let tokens =
                    self.tokenizer
                        .encode_prompt(prompt, self.plan.parse_special, self.plan.ctx)?;
                self.generate_tokens(&tokens, t0, on_text)
            }
        }
    }

    /// One chat turn: appends the user message, renders the whole conversation, evaluates
    /// what the cache does not hold yet, generates, and records the reply.
    pub fn chat_turn(
        &mut self,
        user: &str,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        self.chat_turn_parts(user, &mut |_| {}, on_text)
    }

    /// [`Self::chat_turn`], a thinking model's reasoning apart: streamed to `on_reasoning`,
    /// the output's `reasoning`, and the recorded reply's `reasoning_content` (its template
    /// renders it, or not, as the server's requests do); the answer streamed to `on_text`, the
    /// output's `text` and the recorded reply's content.
    pub fn chat_turn_parts(
        &mut self,
        user: &str,
        on_reasoning: &mut dyn FnMut(&str),
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        let t0 = Instant::now();
        self.messages.push(Message::new("user", user));
        let ctx = self.plan.ctx;
        let tokens = if self.drop_oldest {
            // room for the reply: a quarter of the context, or max_tokens where smaller
            let reply = (ctx / 4).min(self.plan.limits.max_tokens.unwrap_or(usize::MAX));
            let fit = ctx - reply.clamp(1, (ctx / 2).max(1));
            let end = crate::tokenizer::ChatEnd::Reply;
            match self
                .tokenizer
                .encode_chat_fitting(&self.messages, None, None, fit, end, None)
            {
                Ok((t, _)) if t.len() >= ctx => Ok(t), // refused below, nothing forgotten
                Ok((t, from)) => {
                    let before = self.messages.len();
                    self.messages = crate::chat::without_oldest(&self.messages, from);
                    self.dropped += before - self.messages.len();
                    Ok(t)
                }
                Err(e) => Err(e),
            }
        } else {
            self.tokenizer.encode_chat(&self.messages, ctx)
        };
        let out = tokens.and_then(|t| self.generate_chat_tokens(&t, t0, on_reasoning, on_text));
        match &out {
            Ok(o) => {
                let mut reply = Message::new("assistant", &o.text);
                reply.reasoning_content = o.reasoning.clone();
                self.messages.push(reply);
            }
            Err(_) => {
                self.messages.pop();
            }
        }
        out
    }

    /// Generates a chat reply after `prompt` (a conversation the chat template rendered),
    /// split into reasoning and answer where the template thinks ([`Reasoning`]): its
    /// thinking markers kept in the text when they are special tokens, each piece split as
    /// it comes (the reasoning to `on_reasoning`, the answer to `on_text`); the output's
    /// `text` is the answer, its `reasoning` the rest.
    pub fn generate_chat_tokens(
        &mut self,
        prompt: &[u32],
        t0: Instant,
        on_reasoning: &mut dyn FnMut(&str),
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        let reasoning = self.tokenizer.chat_template().and_then(|tmpl| {
            Reasoning::of_template(tmpl.source(), &self.tokenizer.prompt_tail(prompt))
        });
        let Some(r) = reasoning else {
            return self.generate_tokens_as(prompt, t0, on_text, true);
        };
        self.keep = self.tokenizer.special_ids(r.markers());
        let mut split = Split::new(&r);
        let mut parts = |piece: &str, split: &mut Split| {
            let (thought, answer) = split.push(piece);
            if !thought.is_empty() {
                on_reasoning(&thought);
            }
            if !answer.is_empty() {
                on_text(&answer);
            }
        };
        let out = self.generate_tokens_as(prompt, t0, &mut |piece| parts(piece, &mut split), true);
        self.keep.clear();
        let (thought, answer) = split.finish();
        if !thought.is_empty() {
            on_reasoning(&thought);
        }
        if !answer.is_empty() {
            on_text(&answer);
        }
        let mut out = out?;
        let (thought, answer) = r.split(&out.text);
        out.text = answer;
        out.reasoning = thought;
        Ok(out)
    }

    /// Replaces the sampling settings and the stop conditions of the replies that follow,
    /// the model staying loaded (the plan records them): for callers that sample each request
    /// their own way (the Python package). Settings [`SamplerConfig::check`] refuses are a
    /// usage error, and nothing changes.
    pub fn set_sampling(&mut self, sampler: SamplerConfig, limits: Limits) -> Result<()> {
        sampler
            .check()
            .map_err(|e| RuntimeError::Usage(e.to_string()))?;
        if limits.max_tokens == Some(0) {
            return Err(RuntimeError::Usage("max_tokens must be at least 1".into()));
        }
        if limits.stop.iter().any(String::is_empty) {
            return Err(RuntimeError::Usage("stop strings must not be empty".into()));
        }
        let mut cfg = sampler.clone();
        attach_vocab_tables(&mut cfg, &self.tokenizer);
        self.sampler = Sampler::new(cfg, self.exec.config().vocab_size);
        self.plan.sampler = sampler;
        self.plan.limits = limits;
        Ok(())
    }

    /// Replaces the grammar the replies that follow are held to and the log-probabilities
    /// they report (the plan's `grammar` and `logprobs`, which record them), the model
    /// staying loaded: for callers that constrain each request their own way (the Python
    /// package). A grammar that does not compile is an error, and nothing changes; more than
    /// 20 alternatives per token is a usage error (gdsrun's `--logprobs` range).
    pub fn set_constraints(
        &mut self,
        grammar: Option<crate::constraint::Grammar>,
        logprobs: Option<usize>,
    ) -> Result<()> {
        if logprobs.is_some_and(|k| k > 20) {
            return Err(RuntimeError::Usage(
                "logprobs: at most 20 alternatives per token".into(),
            ));
        }
        if let Some(g) = &grammar {
            let compiler = match self.grammar.take() {
                Some(c) => c,
                None => GrammarCompiler::load(
                    &self.plan.model_dir,
                    &self.tokenizer,
                    self.exec.config().vocab_size,
                )?,
            };
            let compiled = compiler.compile(g);
            // the compiler is kept for later grammars, whether this one compiled or not
            self.grammar = Some(compiler);
            compiled?;
        }
        self.plan.grammar = grammar;
        self.plan.logprobs = logprobs;
        Ok(())
    }

    /// Whether a chat turn whose conversation does not fit the context forgets its oldest
    /// messages (the system prompt stays; what is kept starts at a user message), as few as
    /// leave a quarter of the context (at most half, at least `max_tokens` where set and
    /// smaller) for the reply, instead of failing with [`RuntimeError::PromptTooLong`]: the
    /// interactive chat's way (Ollama's `truncate`). Off by default.
    pub fn set_drop_oldest(&mut self, on: bool) {
        self.drop_oldest = on;
    }

    /// Messages the chat has forgotten so far to fit the context ([`Self::set_drop_oldest`]).
    pub fn dropped_messages(&self) -> usize {
        self.dropped
    }

    /// Forgets the conversation (the system prompt stays).
    pub fn reset_chat(&mut self) {
        self.messages
            .truncate(usize::from(self.plan.system.is_some()));
        self.cached.clear();
        self.written = 0;
    }

    fn check_interrupt(&self) -> bool {
        self.interrupt.load(Ordering::Relaxed)
    }

    /// Generates after `prompt` (already tokenized), a completion: its log-probabilities end
    /// with the end-of-generation token's where that ended it (as the server's completions
    /// list it: evaluators score it). Reuses the longest prefix the KV cache already holds.
    pub fn generate_tokens(
        &mut self,
        prompt: &[u32],
        t0: Instant,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        self.generate_tokens_as(prompt, t0, on_text, false)
    }

    /// [`Self::generate_tokens`]; `chat`: a chat reply, whose log-probabilities list only
    /// what its content holds (not the end-of-generation token), as the server's chat replies.
    fn generate_tokens_as(
        &mut self,
        prompt: &[u32],
        t0: Instant,
        on_text: &mut dyn FnMut(&str),
        chat: bool,
    ) -> Result<GenerateOutput> {
        let ctx = self.plan.ctx;
        if prompt.is_empty() {
            return Err(RuntimeError::Usage("the prompt is empty".into()));
        }
        if prompt.len() >= ctx {
            return Err(RuntimeError::PromptTooLong {
                prompt: prompt.len(),
                ctx,
                model_ctx: self.plan.model_ctx,
            });
        }
        self.interrupt.store(false, Ordering::Relaxed);
        let mut m = Metrics {
            load_ms: self.load_ms,
            prompt_tokens: prompt.len(),
            energy_source: self.energy.source().to_string(),
            ..Default::default()
        };
        let energy0 = self.energy.joules();

        // prompt: evaluate what the cache does not hold (at least the last token, for logits)
        let written = self.written.max(self.cached.len());
        let common = reusable_prefix(&*self.exec, &self.cached, written, prompt);
        self.cached.truncate(common);
        if common == 0 {
            self.written = 0;
        }
        self.sampler.reset();
        for &t in prompt {
            self.sampler.accept(t);
        }
        let t_prompt = Instant::now();
        let mut interrupted = false;
        for chunk in prompt[common..].chunks(self.plan.batch) {
            if self.check_interrupt() {
                interrupted = true;
                break;
            }
            // Logits are wanted for the prompt's last token only.
            let last = prompt.len() - 1;
            self.exec
                .eval(chunk, self.cached.len(), last..last + 1, &mut |_, _| {})?;
            self.cached.extend_from_slice(chunk);
        }
        m.prompt_tokens_evaluated = self.cached.len() - common;
        m.prompt_ms = t_prompt.elapsed().as_secs_f64() * 1000.0;

        let limits = self.plan.limits.clone();
        // the per-token policy the server follows too (crate::reply)
        let mut reply = Reply::new(limits.stop.clone());
        let mut generated = Vec::new();
        let mut stream = self.tokenizer.stream_keeping(&self.keep);
        let mut decode_ms = 0.0;
        let mut decode_steps = 0usize;
        let io0 = self.exec.io_stats();
        let mut stop = if interrupted {
            Some(StopReason::Interrupted)
        } else {
            None
        };
        let mut logprobs: Option<Vec<TokenLogprobs>> = self.plan.logprobs.map(|_| Vec::new());
        let mut constraint: Option<Constraint> = match (&self.grammar, &self.plan.grammar) {
            (Some(c), Some(g)) => Some(c.compile(g)?),
            _ => None,
        };
        // Speculative decoding (crate::draft): the guesses of the last pass not checked yet,
        // each with the logits after it, and what the draft looks the next guesses up in.
        let draft = self.plan.draft.clone();
        let mut pending: VecDeque<(u32, Vec<f32>)> = VecDeque::new();
        let mut history: Vec<u32> = match &draft {
            Some(_) => prompt.to_vec(),
            None => Vec::new(),
        };
        // prompt lookup follows the prompt where the reply quotes it (as the server's does)
        let n_prompt = history.len();
        let mut quoted = crate::draft::Prediction::quoted();
        // With every weight in memory a guess costs compute (its row of every matrix and of
        // the output head), so the guesses per pass adapt to how the last ones fared (none
        // right: half as many; all right: twice as many, up to the plan's maximum; else one
        // more than were right). When layers stream, the pass is paid in reads whatever
        // it holds: always guess, the maximum — unless the guesses themselves cost compute
        // of the model's own (self-speculation runs its first blocks per guess).
        let adapt = self.plan.io_plan.streamed_bytes_per_token == 0
            || draft.as_ref().is_some_and(|d| d.layers.is_some());
        // ... and whether to guess at all is measured (crate::draft::Gate)
        let mut gate = crate::draft::Gate::for_plan(draft.as_ref());
        // Where guesses cost compute they start few and double while all are right:
        // self-speculation from one (each costs N blocks and the output head, and an early
        // exit of a model not trained for it is rarely right), other drafts from four.
        let mut draft_len = draft.as_ref().map_or(0, |d| match (d.layers, adapt) {
            (Some(_), _) => 1,
            (None, true) => d.max_tokens.min(4),
            (None, false) => d.max_tokens,
        });
        let (mut last_guessed, mut last_right) = (0usize, 0usize);
        while stop.is_none() {
            let logits = self.exec.last_logits_mut();
            let raw = self.plan.logprobs.map(|k| (k, logits.to_vec()));
            if let Some(c) = constraint.as_mut() {
                c.mask(logits)?;
            }
            let tok = self.sampler.sample(logits);
            if reply.generated() == 0 {
                m.time_to_first_token_ms = t0.elapsed().as_secs_f64() * 1000.0;
            }
            reply.token();
            if self.tokenizer.is_eog(tok) {
                if let (Some(lps), Some((k, raw)), false) = (logprobs.as_mut(), &raw, chat) {
                    lps.push(TokenLogprobs::of(raw, tok, *k));
                }
                stop = Some(StopReason::Eos);
                break;
            }
            if let Some(c) = constraint.as_mut() {
                c.accept(tok)?;
            }
            if let (Some(lps), Some((k, raw))) = (logprobs.as_mut(), raw) {
                lps.push(TokenLogprobs::of(&raw, tok, k));
            }
            generated.push(tok);
            if draft.is_some() {
                history.push(tok);
            }
            self.sampler.accept_generated(tok);
            if let Some(piece) = stream.push(tok)? {
                if reply.push(&piece) {
                    stop = Some(StopReason::StopString);
                }
                if let Some(shown) = reply.take_shown(false) {
                    on_text(&shown);
                }
                if stop.is_some() {
                    break;
                }
            }
            if constraint.as_ref().is_some_and(Constraint::is_finished) {
                stop = Some(StopReason::Grammar);
            } else if limits.max_tokens.is_some_and(|n| reply.generated() >= n) {
                stop = Some(StopReason::MaxTokens);
            } else if self.cached.len() + 1 >= ctx {
                // the prompt and the reply fill the context (the token just sampled is the
                // last one it holds, as the server and llama-server count: prompt +
                // generated ≤ ctx)
                stop = Some(StopReason::ContextFull);
            } else if limits.max_joules.is_some_and(|max| {
                self.energy
                    .joules()
                    .zip(energy0)
                    .is_some_and(|(j, j0)| j - j0 >= max)
            }) {
                stop = Some(StopReason::EnergyLimit);
            } else if self.check_interrupt() {
                stop = Some(StopReason::Interrupted);
            } else {
                let t = Instant::now();
                let pos = self.cached.len();
                match pending.pop_front() {
                    Some((guess, logits)) if guess == tok => {
                        // the pass that checked the guess computed the logits after it
                        self.exec.last_logits_mut().copy_from_slice(&logits);
                        m.draft_accepted += 1;
                        last_right += 1;
                    }
                    _ => {
                        // a wrong guess: its positions (and the ones after) are overwritten
                        // by this pass before anything attends to them
                        pending.clear();
                        if last_guessed > 0 {
                            gate.settled(last_right);
                        }
                        if let (Some(d), true) = (&draft, adapt && last_guessed > 0) {
                            draft_len = if last_right == 0 {
                                (draft_len / 2).max(1)
                            } else if last_right == last_guessed {
                                (draft_len * 2).min(d.max_tokens)
                            } else {
                                last_right + 1
                            };
                        }
                        let room = draft_len.min(ctx.saturating_sub(pos + 1));
                        let guessing = draft.is_some() && (!adapt || gate.guess());
                        if draft.is_some() && !guessing {
                            m.draft_off_passes += 1;
                        }
                        let guesses = match (&draft, self.draft_model.as_mut()) {
                            _ if !guessing => Vec::new(),
                            (Some(_), Some(dm)) => {
                                // the target's sequence: its cache, then the sampled token
                                self.cached.push(tok);
                                let g = dm.propose(&self.cached, room);
                                self.cached.pop();
                                g?
                            }
                            (Some(d), None) => match d.layers {
                                Some(blocks) => crate::draft::self_draft(
                                    &mut *self.exec,
                                    tok,
                                    pos,
                                    room,
                                    blocks,
                                    ctx,
                                )?,
                                None => {
                                    let (prompt, reply) = history.split_at(n_prompt);
                                    let g = quoted.propose(prompt, reply, room);
                                    if g.is_empty() {
                                        crate::draft::ngram(
                                            &history,
                                            d.ngram_max,
                                            d.ngram_min,
                                            room,
                                        )
                                    } else {
                                        g
                                    }
                                }
                            },
                            (None, _) => Vec::new(),
                        };
                        (last_guessed, last_right) = (guesses.len(), 0);
                        if guesses.is_empty() {
                            eval_last(&mut *self.exec, &[tok], pos)?;
                        } else {
                            let mut toks = Vec::with_capacity(1 + guesses.len());
                            toks.push(tok);
                            toks.extend_from_slice(&guesses);
                            let mut rows = Vec::with_capacity(toks.len());
                            self.exec
                                .eval(&toks, pos, pos..pos + toks.len(), &mut |_, l| {
                                    rows.push(l.to_vec())
                                })?;
                            self.written = self.written.max(pos + toks.len());
                            let mut rows = rows.into_iter();
                            let first = rows.next().ok_or_else(|| {
                                RuntimeError::Internal("a pass returned no logits".into())
                            })?;
                            self.exec.last_logits_mut().copy_from_slice(&first);
                            m.draft_tokens += guesses.len();
                            pending = guesses.into_iter().zip(rows).collect();
                        }
                        m.decode_passes += 1;
                        if draft.is_some() {
                            gate.passed(last_guessed > 0, t.elapsed().as_secs_f64() * 1000.0);
                        }
                    }
                }
                self.cached.push(tok);
                decode_ms += t.elapsed().as_secs_f64() * 1000.0;
                decode_steps += 1;
            }
        }
        if stop != Some(StopReason::StopString) && reply.push_final(&stream.flush()?) {
            stop = Some(StopReason::StopString);
        }
        if let Some(shown) = reply.take_shown(true) {
            on_text(&shown);
        }
        m.generated_tokens = reply.generated();
        m.decode_ms = decode_ms;
        m.decode_tokens = decode_steps;
        m.energy_joules = self.energy.joules().zip(energy0).map(|(j, j0)| j - j0);
        let io = self.exec.io_stats();
        m.bytes_read = io.bytes_read;
        m.set_decode_io(&io.since(&io0), decode_steps);
        m.io_mode = self.plan.io.clone();
        m.set_verify(self.plan.io_plan.verify, &self.exec.verify_stats());
        m.weights_held_bytes = self.plan.weights_held_bytes();
        m.kv_cache_bytes = self.plan.kv_bytes;
        m.finish();
        Ok(GenerateOutput {
            reasoning: None,
            text: reply.into_text(),
            tokens: generated,
            stop_reason: stop.unwrap_or(StopReason::Eos),
            logprobs,
            metrics: m,
        })
    }
}
