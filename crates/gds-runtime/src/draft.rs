//! Drafts for speculative decoding: cheap guesses of the next tokens, which the model then
//! checks all at once — one forward pass (one read of every streamed layer) over the last
//! sampled token and the guesses, with logits at each position.
//!
//! The engine samples every token from the model's own logits at its position, exactly as
//! without a draft (same sampler, same random draws, same grammar masks); a guess only
//! saves the pass that would have computed those logits when the sampled token equals it.
//! So the output is the one the model gives without speculation, for greedy decoding and
//! for sampling alike: for a draft that proposes one token per position, sampling from the
//! target and accepting on equality is the standard rejection rule (accept with probability
//! p(d), else draw from p without d). After a mismatch the cache holds positions past the
//! accepted ones; they are overwritten by the next pass and never attended to before that.
//!
//! [`ngram`]: prompt-lookup decoding — the continuation of the latest earlier occurrence of
//! the last few tokens (strong where the reply quotes its context: rewriting, summarising,
//! code edits, RAG answers).
//!
//! [`self_draft`]: self-speculation — the model's own first blocks and output head guess
//! (an early exit); in a streamed plan those stay resident, so guessing reads nothing.
//!
//! [`ModelDraft`]: a second, smaller or more quantized model with the same vocabulary,
//! held in memory, guesses greedily; the target model (streamed, say) checks its guesses.
//!
//! What the plan decides about them ([`DraftKind`], [`DraftPlan`], the draft model's
//! vocabulary check) lives in [`crate::plan`]; this module runs them.

use crate::error::Result;
use crate::exec::{eval_last, reusable_prefix, Executor};

/// The plan's side of speculative decoding, here too by their earlier path.
pub use crate::plan::{DraftKind, DraftPlan, NGRAM_MAX, NGRAM_MIN};

/// Prompt-lookup draft: for n from `n_max` down to `n_min`, the latest earlier occurrence of
/// the last n tokens of `history` and up to `max` tokens that followed it (stopping at the
/// end of the history). Empty when no suffix recurs.
pub fn ngram(history: &[u32], n_max: usize, n_min: usize, max: usize) -> Vec<u32> {
    let len = history.len();
    for n in (n_min.max(1)..=n_max).rev() {
        if n >= len {
            continue;
        }
        let suffix = &history[len - n..];
        // latest start i < len - n with history[i..i + n] == suffix
        if let Some(i) = (0..len - n).rev().find(|&i| &history[i..i + n] == suffix) {
            let from = i + n;
            let to = (from + max).min(len);
            if from < to {
                return history[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

/// Predicted outputs (OpenAI's `prediction`): a text the reply is expected to mostly repeat
/// (a file being edited), whose tokens are the guesses. The reply is followed through the
/// prediction: while it keeps to it, the guesses are the prediction's next tokens; where it
/// departs (an edit), the last [`Prediction::ALIGN_MAX`]…[`Prediction::ALIGN_MIN`] tokens
/// of the reply are looked up in the prediction again, the first occurrence at or after
/// where the reply was expected winning over an earlier one (text repeats: a closing brace,
/// a `return`), and the guesses go on from there. Nothing is guessed while the reply's end
/// is nowhere in the prediction. Guesses never change the reply (each is checked against
/// the token sampled at its place); a good prediction makes it take fewer passes.
///
/// How many it guesses adapts as the speculative passes of the CLI do: all of the last
/// guesses right (the reply still on the prediction), twice as many next time; the reply
/// departed from them, half as many (at least [`Prediction::ALIGN_MIN`]), so that a
/// prediction wrong in many places does not cost a pass of wasted guesses at each.
///
/// This is the following's state; the text is the caller's, given at each
/// [`Prediction::propose`] (the same text each time).
#[derive(Clone, Debug)]
pub struct Prediction {
    /// The prediction's index of the token after the reply's end, as of `at`.
    cursor: Option<usize>,
    /// The reply's length when `cursor` was set.
    at: usize,
    /// How many to guess next (before the caller's maximum).
    run: usize,
    /// The reply starts where the text does (a prediction), or only somewhere in it (a
    /// prompt the reply may quote: nothing is guessed before the reply has tokens to find).
    starts_reply: bool,
}

impl Default for Prediction {
    fn default() -> Prediction {
        Prediction::new()
    }
}

impl Prediction {
    /// Most reply tokens looked up to find the reply in the prediction again.
    pub const ALIGN_MAX: usize = 8;
    /// Fewest (a single token recurs too often to place the reply).
    pub const ALIGN_MIN: usize = 2;

    /// A prediction: the reply is expected to start where it does.
    pub fn new() -> Prediction {
        Prediction {
            cursor: None,
            at: 0,
            run: usize::MAX,
            starts_reply: true,
        }
    }

    /// A text the reply may quote (a prompt holding the file to edit, the passage to cite):
    /// followed as a prediction is once the reply's last tokens are found in it.
    pub fn quoted() -> Prediction {
        Prediction {
            starts_reply: false,
            ..Prediction::new()
        }
    }

    /// Up to `max` guesses, from the text `p`, of the tokens after `reply` (the tokens
    /// generated so far).
    pub fn propose(&mut self, p: &[u32], reply: &[u32], max: usize) -> Vec<u32> {
        let n = reply.len();
        let from = if n == 0 {
            // the reply begins where the prediction does
            self.starts_reply.then_some(0)
        } else {
            // where the reply's end should be if it kept to the prediction since
            // (a context shift can shorten the reply: then it is looked up afresh)
            let expected = self
                .cursor
                .filter(|_| n >= self.at)
                .map(|c| c + (n - self.at));
            // kept to it: what came since is the prediction's tokens from the cursor
            let kept = expected.filter(|&e| {
                let c = e - (n - self.at);
                e <= p.len() && p[c..e] == reply[self.at..]
            });
            match kept {
                // every guess right: guess more
                Some(e) => {
                    if n > self.at {
                        self.run = self.run.saturating_mul(2);
                    }
                    Some(e)
                }
                None => {
                    if self.cursor.is_some() {
                        // the reply left the prediction where it was expected: guess less
                        self.run = (self.run.min(max) / 2).max(Self::ALIGN_MIN);
                    }
                    Self::find(p, reply, expected.unwrap_or(0))
                }
            }
        };
        let Some(from) = from else {
            self.cursor = None;
            return Vec::new();
        };
        self.cursor = Some(from);
        self.at = n;
        let k = max.min(self.run);
        p[from.min(p.len())..(from + k).min(p.len())].to_vec()
    }

    /// The index in `p` just past an occurrence of the reply's last tokens (the longest
    /// suffix found, from [`Self::ALIGN_MAX`] down): the first at or after `near`, else the
    /// last before it.
    fn find(p: &[u32], reply: &[u32], near: usize) -> Option<usize> {
        for m in (Self::ALIGN_MIN..=Self::ALIGN_MAX.min(reply.len())).rev() {
            let tail = &reply[reply.len() - m..];
            if m > p.len() {
                continue;
            }
            let ends = (m..=p.len()).filter(|&e| &p[e - m..e] == tail);
            let mut before = None;
            for e in ends {
                if e >= near {
                    return Some(e);
                }
                before = Some(e);
            }
            if before.is_some() {
                return before;
            }
        }
        None
    }
}

/// Whether guessing pays, measured as the run goes: with every weight in memory a guess
/// costs compute (its row of every matrix and of the output head, and a draft model's own
/// pass), so guessing pays only if the tokens a guessing pass yields per millisecond beat a
/// plain pass's one token per its milliseconds. Both are kept as moving averages; while
/// guessing does not pay, one pass in [`Gate::PROBE_EVERY`] guesses anyway (and while it
/// does, one is plain) so that both stay measured as the text changes.
///
/// The plan's `--draft-gate off` ([`DraftPlan::gate`]; `GDS_DRAFT_GATE=off` in the
/// environment is its alias, read when the plan is made) turns the measurement off: every
/// pass guesses, as when layers stream. The wall clock decides otherwise, so a loaded
/// machine changes how many passes a text takes (never the text); tests and benchmarks that
/// count passes turn it off.
#[derive(Debug, Default)]
pub struct Gate {
    /// Always guess (`--draft-gate off`).
    off: bool,
    plain_ms: Option<f64>,
    /// Tokens per millisecond of guessing passes.
    spec_rate: Option<f64>,
    /// Duration of the last guessing pass, until its guesses are settled.
    unsettled: Option<f64>,
    /// Guessing passes seen (the first, which also warms a draft model up, is not counted).
    guessed: usize,
    /// Plain passes measured.
    plain: usize,
    passes: usize,
}

impl Gate {
    /// One pass in this many goes against the current decision, to keep measuring.
    pub const PROBE_EVERY: usize = 32;
    /// Guessing must beat plain passes by this factor: a tie costs the guesses' overheads
    /// (a draft model catching up, logits copied per guess).
    pub const MARGIN: f64 = 1.15;
    const ALPHA: f64 = 0.3;

    fn ema(v: &mut Option<f64>, x: f64) {
        *v = Some(v.map_or(x, |v| v + Self::ALPHA * (x - v)));
    }

    /// A gate that measures (`measure`), or one that always guesses.
    pub fn new(measure: bool) -> Gate {
        Gate {
            off: !measure,
            ..Gate::default()
        }
    }

    /// The gate the plan asks for ([`DraftPlan::gate`]); measuring without a draft.
    pub fn for_plan(draft: Option<&DraftPlan>) -> Gate {
        Gate::new(draft.is_none_or(|d| d.gate))
    }

    /// Whether the next pass should carry guesses.
    pub fn guess(&mut self) -> bool {
        if self.off {
            return true;
        }
        self.passes += 1;
        let probe = self.passes.is_multiple_of(Self::PROBE_EVERY);
        match (self.plain_ms, self.spec_rate) {
            // decided on a few of each, not on one slow pass
            (Some(p), Some(r)) if self.plain >= 2 && self.guessed >= 4 => {
                (r * p > Self::MARGIN) != probe
            }
            // two plain passes early on, to have both measures
            _ => self.plain >= 2 || !matches!(self.passes, 2 | 3),
        }
    }

    /// A pass took `ms`; `guessed`: it carried guesses.
    pub fn passed(&mut self, guessed: bool, ms: f64) {
        if guessed {
            self.unsettled = Some(ms);
        } else {
            self.plain += 1;
            Self::ema(&mut self.plain_ms, ms);
        }
    }

    /// The guesses of the last guessing pass are settled: `right` of them were taken.
    pub fn settled(&mut self, right: usize) {
        if let Some(ms) = self.unsettled.take() {
            self.guessed += 1;
            if self.guessed > 1 {
                Self::ema(&mut self.spec_rate, (1 + right) as f64 / ms.max(1e-6));
            }
        }
    }
}

/// A draft model: its own executor (CPU, in memory) and KV cache, kept in step with the
/// target's sequence lazily — each [`propose`](ModelDraft::propose) evaluates what the
/// sequence gained since the last one (the accepted tokens) and then guesses one token at
/// a time. Positions it guessed past what was accepted are overwritten by the next
/// evaluation, as in the target's cache.
pub struct ModelDraft {
    exec: Box<dyn Executor>,
    /// Tokens at positions `0..` of the draft's cache.
    done: Vec<u32>,
    ctx: usize,
}

impl ModelDraft {
    /// Wraps the draft model's executor (context `ctx`).
    pub fn new(exec: Box<dyn Executor>, ctx: usize) -> ModelDraft {
        ModelDraft {
            exec,
            done: Vec::new(),
            ctx,
        }
    }

    /// Up to `k` greedy guesses of the tokens after `seq` (the target's whole sequence so
    /// far, its last token sampled but not yet evaluated by the target).
    pub fn propose(&mut self, seq: &[u32], k: usize) -> Result<Vec<u32>> {
        if seq.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        // (the last token is evaluated again when nothing is new: its logits are wanted)
        let common = reusable_prefix(&*self.exec, &self.done, self.done.len(), seq);
        self.done.truncate(common);
        eval_last(&mut *self.exec, &seq[common..], common)?;
        self.done.extend_from_slice(&seq[common..]);
        let mut out = Vec::with_capacity(k);
        loop {
            let t = crate::ops::argmax(self.exec.last_logits_mut()) as u32;
            out.push(t);
            if out.len() == k || self.done.len() + 1 >= self.ctx {
                return Ok(out);
            }
            eval_last(&mut *self.exec, &[t], self.done.len())?;
            self.done.push(t);
        }
    }
}

/// Self-speculation (`--draft layers:N`): up to `k` greedy guesses after `token` (sampled,
/// at `pos`, not yet evaluated) from the model's first `blocks` blocks and its output head
/// — no second model and no cache of its own: the early exit writes those blocks' K/V at
/// `pos..pos + k` in the model's cache, where the checking pass (which evaluates the token
/// and the guesses through every block) overwrites them. `ctx` bounds the positions.
pub fn self_draft(
    exec: &mut dyn Executor,
    token: u32,
    pos: usize,
    k: usize,
    blocks: usize,
    ctx: usize,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(k);
    let mut t = token;
    while out.len() < k && pos + out.len() + 1 < ctx {
        exec.eval_exit(t, pos + out.len(), blocks)?;
        t = crate::ops::argmax(exec.last_logits_mut()) as u32;
        out.push(t);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prediction_is_followed_through_edits() {
        // the prediction: 0..40; the reply keeps to it, then replaces 10..13 with 100, 101
        let pred: Vec<u32> = (0..40).collect();
        let mut p = Prediction::new();
        assert_eq!(p.propose(&pred, &[], 4), [0, 1, 2, 3]);
        let mut reply: Vec<u32> = (0..4).collect();
        assert_eq!(p.propose(&pred, &reply, 4), [4, 5, 6, 7]);
        reply.extend(4..10);
        assert_eq!(p.propose(&pred, &reply, 3), [10, 11, 12]);
        // the edit: nothing matches its tokens
        reply.push(100);
        assert!(p.propose(&pred, &reply, 3).is_empty());
        reply.push(101);
        assert!(p.propose(&pred, &reply, 3).is_empty());
        // back on the prediction after the edit: found by its last two tokens (two guesses,
        // half of the three before the miss, then more as they come right)
        reply.extend([13, 14]);
        assert_eq!(p.propose(&pred, &reply, 3), [15, 16]);
        reply.extend([15, 16, 17]);
        assert_eq!(p.propose(&pred, &reply, 3), [18, 19, 20]);
        reply.extend(18..21);
        assert_eq!(p.propose(&pred, &reply, 3), [21, 22, 23]);
        // the end of the prediction: what is left, then nothing
        reply.extend(21..38);
        assert_eq!(p.propose(&pred, &reply, 5), [38, 39]);
        reply.extend([38, 39]);
        assert!(p.propose(&pred, &reply, 5).is_empty());
    }

    #[test]
    fn a_quoted_text_is_followed_once_the_reply_is_found_in_it() {
        let pred: Vec<u32> = (0..20).collect();
        let mut p = Prediction::quoted();
        assert!(p.propose(&pred, &[], 4).is_empty());
        assert!(p.propose(&pred, &[50], 4).is_empty());
        assert_eq!(p.propose(&pred, &[50, 7, 8], 4), [9, 10, 11, 12]);
    }

    #[test]
    fn a_prediction_guesses_fewer_after_a_miss_and_more_after_a_hit() {
        let pred: Vec<u32> = (0..100).collect();
        let mut p = Prediction::new();
        assert_eq!(p.propose(&pred, &[], 8).len(), 8);
        // a miss after 3 of the 8: the reply departs (token 500), then comes back
        let mut reply: Vec<u32> = vec![0, 1, 2, 500];
        assert!(p.propose(&pred, &reply, 8).is_empty());
        reply.extend([4, 5]);
        assert_eq!(p.propose(&pred, &reply, 8), [6, 7, 8, 9]);
        // all four right (and the sampled token): eight next
        reply.extend([6, 7, 8, 9, 10]);
        assert_eq!(p.propose(&pred, &reply, 8).len(), 8);
        // never under ALIGN_MIN
        for bad in 0..5 {
            reply.extend([600 + bad, 11 + 2 * bad, 12 + 2 * bad]);
            let _ = p.propose(&pred, &reply[..reply.len() - 2], 8);
            assert!(p.propose(&pred, &reply, 8).len() >= Prediction::ALIGN_MIN);
        }
    }

    #[test]
    fn a_repeated_line_is_placed_after_where_the_reply_was() {
        // "a b } c d } e f": the reply departs, then writes "x }" — the brace after where
        // it was expected wins over the first one
        let (a, b, br, c, d, e, f, x) = (1, 2, 9, 3, 4, 5, 6, 7);
        let pred = [a, b, br, c, d, br, e, f];
        let mut p = Prediction::new();
        assert_eq!(p.propose(&pred, &[a, b, br, c], 2), [d, br]);
        // departs at d; "c x" is nowhere
        assert!(p.propose(&pred, &[a, b, br, c, x], 2).is_empty());
        // "x }" is nowhere either: the one-token "}" is too short to place it
        assert!(p.propose(&pred, &[a, b, br, c, x, br], 2).is_empty());
        // "} e" places it after the second brace
        assert_eq!(p.propose(&pred, &[a, b, br, c, x, br, e], 2), [f]);
        // a suffix found only before the expected place is still used
        let pred = [a, b, c, d, e, f];
        let mut p = Prediction::new();
        assert_eq!(p.propose(&pred, &[a, b, c, d, e], 1), [f]);
        assert_eq!(p.propose(&pred, &[a, b, c, d, e, a, b], 2), [c, d]);
    }

    #[test]
    fn a_gate_turned_off_by_the_plan_always_guesses() {
        let plan = |gate| DraftPlan {
            kind: DraftKind::Ngram,
            model_dir: None,
            model_plan: None,
            layers: None,
            max_tokens: 4,
            gate,
            ngram_max: NGRAM_MAX,
            ngram_min: NGRAM_MIN,
        };
        // guessing passes 12 ms yielding 1 token, plain ones 10 ms: a measuring gate stops
        // guessing, one turned off never does
        let run = |mut g: Gate| {
            (0..64)
                .filter(|_| {
                    let guessed = g.guess();
                    g.passed(guessed, if guessed { 12.0 } else { 10.0 });
                    if guessed {
                        g.settled(0);
                    }
                    guessed
                })
                .count()
        };
        assert_eq!(run(Gate::for_plan(Some(&plan(false)))), 64);
        assert!(run(Gate::for_plan(Some(&plan(true)))) < 16);
        assert!(run(Gate::for_plan(None)) < 16);
    }

    #[test]
    fn the_gate_guesses_while_it_pays_and_probes_while_it_does_not() {
        // plain passes 10 ms; guessing passes 12 ms yielding 3 tokens: pays
        let mut g = Gate::default();
        let mut plain = 0;
        for _ in 0..64 {
            if g.guess() {
                g.passed(true, 12.0);
                g.settled(2);
            } else {
                plain += 1;
                g.passed(false, 10.0);
            }
        }
        assert!((1..=4).contains(&plain), "{plain} plain passes of 64");
        // guessing passes 12 ms yielding 1 token: does not pay
        let mut g = Gate::default();
        let mut guessing = 0;
        for _ in 0..64 {
            if g.guess() {
                guessing += 1;
                g.passed(true, 12.0);
                g.settled(0);
            } else {
                g.passed(false, 10.0);
            }
        }
        // four to measure, then the probes
        assert!(
            (2..=7).contains(&guessing),
            "{guessing} guessing passes of 64"
        );
    }

    #[test]
    fn the_latest_match_of_the_longest_suffix_is_continued() {
        // "1 2 3 4 | 1 2 3 5 | 1 2 3" → the latest "1 2 3" is followed by 5, 1, 2, 3
        let h = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3];
        assert_eq!(ngram(&h, 4, 2, 3), vec![5, 1, 2]);
        assert_eq!(ngram(&h, 4, 2, 10), vec![5, 1, 2, 3]);
        // a longer suffix wins over a later short match: "9 2 3" occurs once before
        let h = [9, 2, 3, 7, 8, 2, 3, 6, 9, 2, 3];
        assert_eq!(ngram(&h, 3, 2, 2), vec![7, 8]);
    }

    #[test]
    fn no_recurring_suffix_means_no_draft() {
        assert!(ngram(&[1, 2, 3, 4, 5], 4, 2, 8).is_empty());
        assert!(ngram(&[], 4, 2, 8).is_empty());
        assert!(ngram(&[7], 4, 1, 8).is_empty());
        // a suffix of one token is not looked up when the minimum is 2
        assert!(ngram(&[5, 6, 5], 4, 2, 8).is_empty());
        assert_eq!(ngram(&[5, 6, 5], 4, 1, 8), vec![6, 5]);
        assert!(ngram(&[1, 2, 1, 2], 4, 2, 0).is_empty());
    }
}
