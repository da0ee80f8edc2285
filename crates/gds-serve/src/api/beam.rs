//! vLLM's beam search on `/v1/completions` and `/v1/chat/completions` (`use_beam_search:
//! true`, `n` beams, `length_penalty`), as vLLM's server runs it: a step at a time, each
//! beam asked for its next token's `2n` likeliest continuations by a one-token request to
//! the engine (the prefix cache holds what the beams share, so a step computes only each
//! beam's last, partly filled block); a continuation that is an end-of-generation token
//! ends a beam (unless `ignore_eos`), the others are ranked by their cumulative
//! log-probability and the `n` likeliest go on. After `max_tokens` steps the ended and the
//! running beams are ranked by `cumulative log-probability / length ^ length_penalty`
//! (the length counts the prompt, not an end-of-generation token, as vLLM's
//! `get_beam_search_score`) and the best `n` are the choices, best first.
//!
//! One difference, which does not change the answer: the search ends before `max_tokens`
//! once no running beam can reach the `n` best ended ones (a beam's log-probability only
//! falls as it grows, so its score is bounded by its log-probability so far over the
//! largest length factor it can reach).
//!
//! The choices go through the same path as sampled ones ([`crate::api::Gen`]): each beam
//! is replayed as the engine's events, so text, `logprobs` (the beam's tokens with their
//! alternatives), token ids, usage, streaming and the chat parsers are the same code.

use super::{enqueue, window, ApiError, Common, Job, Submitted};
use crate::scheduler::{Done, Event, Finish, Prefill, Request};
use crate::ServerState;
use gds_runtime::sampler::{SamplerConfig, TokenLogprobs};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, OnceCell};

/// The largest `length_penalty` either way: lengths to the power of more would leave
/// f64's range (a score of 0 or infinity for every beam), and nothing ranks by that.
const MAX_LENGTH_PENALTY: f64 = 10.0;

/// The request fields of beam search.
#[derive(Deserialize, Default)]
struct Fields {
    #[serde(default)]
    use_beam_search: Option<Value>,
    #[serde(default)]
    length_penalty: Option<Value>,
}

/// A beam search as a request asks for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    /// Beams kept each step, and choices answered (`n`).
    width: usize,
    /// The ranking's exponent of the length (vLLM's default 1).
    length_penalty: f64,
}

/// `use_beam_search` (a boolean; `true` asks for beam search) and `length_penalty` (a
/// number in -10..=10; read only with beam search, as vLLM takes and ignores it otherwise)
/// of a chat or completions body; `None` without beam search.
pub(crate) fn request(body: &[u8]) -> Result<Option<f64>, ApiError> {
    let f: Fields = super::parse(body)?;
    match f.use_beam_search {
        None | Some(Value::Null) | Some(Value::Bool(false)) => return Ok(None),
        Some(Value::Bool(true)) => {}
        Some(v) => {
            return Err(
                ApiError::bad(format!("use_beam_search {v} must be a boolean"))
                    .param("use_beam_search"),
            )
        }
    }
    match f.length_penalty {
        None | Some(Value::Null) => Ok(Some(1.0)),
        Some(v) => match v.as_f64() {
            Some(p) if (-MAX_LENGTH_PENALTY..=MAX_LENGTH_PENALTY).contains(&p) => Ok(Some(p)),
            _ => Err(ApiError::bad(format!(
                "length_penalty {v} must be a number in -{MAX_LENGTH_PENALTY}..={MAX_LENGTH_PENALTY}"
            ))
            .param("length_penalty")),
        },
    }
}

/// Makes `job` (one prompt, before its `n` choices are made of it) a beam search of `n`
/// beams, or refuses with a 400 a field that beam search would not honour: vLLM's beam
/// search ignores them (stop strings, penalties, grammars...), which would answer another
/// request than the one sent. The sampling settings (temperature, top-p, seed, ...) pick
/// nothing in a search that ranks by the model's log-probabilities and are taken as they
/// are, as vLLM takes them.
pub(crate) fn make(c: &Common, job: &mut Job, length_penalty: f64) -> Result<(), ApiError> {
    let off = |v: &Option<f64>, neutral: f64| v.is_some_and(|x| x != neutral);
    let value_set = |v: &Option<Value>, neutral: &Value| {
        v.as_ref().is_some_and(|v| !v.is_null() && v != neutral)
    };
    let refused = [
        ("stop", !job.stop.is_empty()),
        ("stop_token_ids", !job.stop_ids.is_empty()),
        ("min_tokens", job.min_tokens > 0),
        (
            "allowed_token_ids",
            c.allowed_token_ids.as_ref().is_some_and(|v| !v.is_null()),
        ),
        ("bad_words", !job.masks.banned.is_empty()),
        ("logit_bias", !job.sampler.logit_bias.is_empty()),
        ("repeat_penalty", off(&c.repeat_penalty, 1.0)),
        ("repetition_penalty", off(&c.repetition_penalty, 1.0)),
        ("presence_penalty", off(&c.presence_penalty, 0.0)),
        ("frequency_penalty", off(&c.frequency_penalty, 0.0)),
        (
            "dry_multiplier",
            value_set(&c.llama.dry_multiplier, &json!(0)),
        ),
        ("echo", job.echo),
        ("prompt_logprobs", job.prompt_logprobs.is_some()),
        ("n_indent", job.n_indent > 0),
        ("t_max_predict_ms", job.t_max_predict.is_some()),
        ("best_of", job.best_of > job.n),
    ];
    if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
        return Err(ApiError::bad(format!(
            "{field} cannot be used with use_beam_search (beam search ranks whole sequences by the model's log-probabilities)"
        ))
        .param(field));
    }
    if let Some((_, param)) = &job.grammar {
        return Err(ApiError::bad(format!(
            "{param} cannot be used with use_beam_search (beam search does not follow a grammar)"
        ))
        .param(param));
    }
    job.beam = Some(Arc::new(BeamSearch {
        params: Params {
            width: job.n,
            length_penalty,
        },
        found: OnceCell::new(),
    }));
    Ok(())
}

/// One prompt's beam search, shared by its `n` choices: the first to start runs it, each
/// replays its beam.
pub(crate) struct BeamSearch {
    params: Params,
    found: OnceCell<Result<Arc<Found>, ApiError>>,
}

/// What a search found.
struct Found {
    /// The best beams, best first (`n` of them but where the vocabulary left fewer).
    beams: Vec<Beam>,
    /// What the prompt cost (the first step's).
    prefill: Prefill,
    /// When the first step ended (the choices' decode time is counted from there).
    first: Instant,
}

/// A beam: its tokens (an end-of-generation token last where one ended it), each with its
/// log-probability and alternatives (as many as the request lists), and their sum.
#[derive(Clone, Default)]
struct Beam {
    tokens: Vec<u32>,
    lps: Vec<TokenLogprobs>,
    cum: f64,
    ended: bool,
}

impl Beam {
    /// vLLM's score: the log-probability over the length (prompt and text, not an
    /// end-of-generation token) to the power `penalty`.
    fn score(&self, prompt: usize, penalty: f64) -> f64 {
        let len = prompt + self.tokens.len() - usize::from(self.ended);
        self.cum / (len.max(1) as f64).powf(penalty)
    }

    /// The best score this running beam may reach in at most `max_len` tokens: its
    /// log-probability (which only falls) over the largest length factor it can reach.
    fn bound(&self, prompt: usize, max_len: usize, penalty: f64) -> f64 {
        let now = (prompt + self.tokens.len()).max(1) as f64;
        let factor = now.powf(penalty).max((max_len.max(1) as f64).powf(penalty));
        self.cum / factor
    }
}

impl BeamSearch {
    /// The events of `job`'s beam (its `copy`), as the engine would send them for a
    /// request that generated those tokens; the search runs the first time a choice of the
    /// prompt asks.
    pub(crate) async fn start(
        &self,
        st: &Arc<ServerState>,
        job: &Job,
    ) -> Result<Submitted, ApiError> {
        let found = self
            .found
            .get_or_init(|| search(st, job, self.params))
            .await
            .clone()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let beam = found.beams.get(job.copy);
        let _ = tx.send(Event::Prefilled(found.prefill));
        let want = job.logprobs.is_some();
        for (&t, lp) in beam.iter().flat_map(|b| b.tokens.iter().zip(&b.lps)) {
            let _ = tx.send(Event::Token(t, want.then(|| lp.clone())));
        }
        let p = found.prefill;
        let _ = tx.send(Event::Done(Done {
            finish: if beam.is_some_and(|b| b.ended) {
                Finish::Eos
            } else {
                Finish::Length
            },
            prompt_tokens: job.prompt.len(),
            cached_tokens: p.cached_tokens,
            generated: beam.map_or(0, |b| b.tokens.len()),
            prompt_ms: p.prompt_ms,
            decode_ms: found.first.elapsed().as_secs_f64() * 1000.0,
            queue_ms: p.queue_ms,
            predicted_accepted: 0,
            predicted_rejected: 0,
        }));
        Ok((rx, Arc::new(AtomicBool::new(false))))
    }
}

/// Keeps `b` among `kept`, the best `n` ended beams by score (the earlier first among
/// equals).
fn keep_ended(kept: &mut Vec<(f64, Beam)>, b: Beam, score: f64, n: usize) {
    let at = kept.partition_point(|(s, _)| *s >= score);
    if at < n {
        kept.insert(at, (score, b));
        kept.truncate(n);
    }
}

/// vLLM's beam search of `job`'s prompt (see the module's note).
async fn search(st: &Arc<ServerState>, job: &Job, p: Params) -> Result<Arc<Found>, ApiError> {
    let (w, penalty) = (p.width.max(1), p.length_penalty);
    let show = job.logprobs.unwrap_or(0);
    // each step asks for the 2n likeliest continuations (and as many as are listed)
    let per_beam = (2 * w).min(st.vocab);
    let k = per_beam.max(show).min(st.vocab);
    let prompt = job.prompt.len();
    // (a request that may shift past the context stops at it)
    let steps = job.max_tokens.min(st.ctx.saturating_sub(prompt));
    let max_len = prompt + steps;
    let wave = window(st, 1);
    let mut alive = vec![Beam::default()];
    let mut ended: Vec<(f64, Beam)> = Vec::new();
    let mut first: Option<(Prefill, Instant)> = None;
    for _ in 0..steps {
        let mut tops = Vec::with_capacity(alive.len());
        for chunk in alive.chunks(wave) {
            let steps = chunk.iter().map(|b| step(st, job, b, k));
            tops.extend(futures_util::future::try_join_all(steps).await?);
        }
        // (beam, rank in its list, cumulative log-probability) of every continuation
        // that goes on
        let mut next: Vec<(usize, usize, f64)> = Vec::new();
        for (i, (top, prefill)) in tops.iter().enumerate() {
            first.get_or_insert((*prefill, Instant::now()));
            for (r, &(t, lp)) in top.iter().take(per_beam).enumerate() {
                if !lp.is_finite() {
                    continue;
                }
                let cum = alive[i].cum + f64::from(lp);
                if !job.ignore_eos && st.tokenizer.is_eog(t) {
                    let b = grown(&alive[i], t, lp, top, show, cum, true);
                    let score = b.score(prompt, penalty);
                    keep_ended(&mut ended, b, score, w);
                } else {
                    next.push((i, r, cum));
                }
            }
        }
        // the n likeliest go on (a stable sort: the earlier beam and rank first among
        // equals)
        next.sort_by(|a, b| b.2.total_cmp(&a.2));
        alive = next
            .iter()
            .take(w)
            .map(|&(i, r, cum)| {
                let (t, lp) = tops[i].0[r];
                grown(&alive[i], t, lp, &tops[i].0, show, cum, false)
            })
            .collect();
        // no running beam can reach the n best ended ones: the answer is known
        let worst_kept = (ended.len() == w).then(|| ended[w - 1].0);
        let hopeless = worst_kept.is_some_and(|worst| {
            alive
                .iter()
                .all(|b| b.bound(prompt, max_len, penalty) <= worst)
        });
        if alive.is_empty() || hopeless {
            break;
        }
    }
    // the ended ones first among equals, as vLLM ranks them
    let mut all: Vec<(f64, Beam)> = ended;
    all.extend(alive.into_iter().map(|b| (b.score(prompt, penalty), b)));
    all.sort_by(|a, b| b.0.total_cmp(&a.0));
    let (prefill, first) = first.unwrap_or((Prefill::default(), Instant::now()));
    Ok(Arc::new(Found {
        beams: all.into_iter().take(w).map(|(_, b)| b).collect(),
        prefill,
        first,
    }))
}

/// `b` with the token `t` of log-probability `lp` (and `show` of the step's alternatives
/// `top`) added.
fn grown(
    b: &Beam,
    t: u32,
    lp: f32,
    top: &[(u32, f32)],
    show: usize,
    cum: f64,
    ended: bool,
) -> Beam {
    let mut n = b.clone();
    n.tokens.push(t);
    n.lps.push(TokenLogprobs {
        logprob: lp,
        top: top[..show.min(top.len())].to_vec(),
    });
    n.cum = cum;
    n.ended = ended;
    n
}

/// One step of one beam: its next token's `k` likeliest continuations (most likely first)
/// by a one-token request with the prompt and the beam's tokens, and what its prompt cost.
async fn step(
    st: &Arc<ServerState>,
    job: &Job,
    b: &Beam,
    k: usize,
) -> Result<(Vec<(u32, f32)>, Prefill), ApiError> {
    let mut prompt = Vec::with_capacity(job.prompt.len() + b.tokens.len());
    prompt.extend_from_slice(&job.prompt);
    prompt.extend_from_slice(&b.tokens);
    // (the model's log-probabilities: no penalty, bias or mask changes them)
    let greedy = SamplerConfig {
        temp: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        logit_bias: Vec::new(),
        ..SamplerConfig::default()
    };
    let (mut rx, _ended): Submitted = enqueue(st, |tx, ended| Request {
        max_tokens: 1,
        ignore_eos: true,
        logprobs: Some(k),
        salt: job.salt,
        priority: job.priority,
        tier: job.tier,
        ..Request::plain(prompt, greedy, tx, ended)
    })?;
    let (mut prefill, mut top) = (Prefill::default(), None);
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Prefilled(p) => prefill = p,
            Event::Token(_, lp) => top = lp.map(|l| l.top),
            Event::Done(_) => break,
            Event::Error(e) => return Err(ApiError::server(e)),
            Event::RequestFault(e, code) => return Err(ApiError::bad(e).code(code)),
            Event::PromptLogprobs(..) | Event::Embedding(_) | Event::Progress(_) => {}
        }
    }
    match top {
        Some(t) => Ok((t, prefill)),
        None => Err(ApiError::server(
            "the engine ended a beam's step without its token",
        )),
    }
}
