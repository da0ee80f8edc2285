//! Token sampling: repeat penalty, frequency and presence penalties and logit bias, then
//! top-k, top-p, min-p and temperature, in llama.cpp's default order. Temperature 0 is
//! greedy. A seeded xoshiro256** makes runs reproducible.

use serde::{Deserialize, Serialize};

/// Sampler settings, as recorded in the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Temperature; 0 picks the most likely token (greedy).
    pub temp: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens by this; 1 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the repeat penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the random generator.
    pub seed: u64,
    /// OpenAI's `frequency_penalty`: subtracted from a token's logit once per time it was
    /// generated (prompt tokens do not count); 0 disables.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub frequency_penalty: f32,
    /// OpenAI's `presence_penalty`: subtracted from the logit of every token generated at
    /// least once; 0 disables.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub presence_penalty: f32,
    /// OpenAI's `logit_bias`: added to these tokens' logits before sampling (greedy
    /// included); ids outside the vocabulary are ignored here (the server refuses them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
}

fn is_zero(x: &f32) -> bool {
    *x == 0.0
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temp: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

/// A sampler setting out of its range.
#[derive(Clone, Debug, PartialEq)]
pub struct BadSetting {
    /// The setting, as [`SamplerConfig`] spells it (`top_p`).
    pub field: &'static str,
    /// The value given.
    pub value: f32,
    /// What it must be, e.g. `in (0, 1]`.
    pub expected: &'static str,
}

impl BadSetting {
    /// The command-line flag that sets it (`--top-p`).
    pub fn flag(&self) -> String {
        format!("--{}", self.field.replace('_', "-"))
    }
}

impl std::fmt::Display for BadSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} must be {}",
            self.flag(),
            self.value,
            self.expected
        )
    }
}

impl SamplerConfig {
    /// Checks every value's range; the error names the setting.
    pub fn check(&self) -> Result<(), BadSetting> {
        let bad = |field, value, expected| {
            Err(BadSetting {
                field,
                value,
                expected,
            })
        };
        if !(self.temp.is_finite() && self.temp >= 0.0) {
            return bad("temp", self.temp, "a number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad("repeat_penalty", self.repeat_penalty, "> 0");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "in [-2, 2]");
        }
        if let Some(&(_, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad("logit_bias", b, "in [-100, 100]");
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and the same on every platform.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A candidate token: id, logit, and (after softmax) probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Token id.
    pub id: u32,
    /// Logit (after penalties and temperature).
    pub logit: f32,
    /// Probability among the surviving candidates.
    pub p: f32,
}

/// Samples tokens from logits. Buffers are sized for the vocabulary once.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    cands: Vec<Candidate>,
    recent: Vec<u32>,
    recent_at: usize,
    /// How often each generated token was generated (frequency and presence penalties).
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab` tokens.
    pub fn new(cfg: SamplerConfig, vocab: usize) -> Sampler {
        Sampler {
            rng: Rng::new(cfg.seed),
            // grows with the tokens seen: --repeat-last-n is the user's, not an allocation size
            recent: Vec::new(),
            recent_at: 0,
            counts: std::collections::HashMap::new(),
            cfg,
            cands: Vec::with_capacity(vocab),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Records a token that is now part of the context (prompt or generated), for the
    /// repeat penalty.
    pub fn accept(&mut self, token: u32) {
        let n = self.cfg.repeat_last_n;
        if n == 0 {
            return;
        }
        if self.recent.len() < n {
            self.recent.push(token);
        } else {
            self.recent[self.recent_at] = token;
            self.recent_at = (self.recent_at + 1) % n;
        }
    }

    /// Records a token the model generated: part of the context (as [`Sampler::accept`])
    /// and counted for the frequency and presence penalties.
    pub fn accept_generated(&mut self, token: u32) {
        self.accept(token);
        if self.cfg.frequency_penalty != 0.0 || self.cfg.presence_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Forgets the recent and generated tokens.
    pub fn reset(&mut self) {
        self.recent.clear();
        self.recent_at = 0;
        self.counts.clear();
    }

    /// Applies the repeat penalty (once per distinct recent token), then the frequency and
    /// presence penalties (`logit -= count * frequency + (count > 0) * presence`, over the
    /// generated tokens), then the logit bias. A token at -inf (masked) stays there.
    pub fn apply_penalty(&self, logits: &mut [f32]) {
        let p = self.cfg.repeat_penalty;
        if p != 1.0 {
            for (i, &tok) in self.recent.iter().enumerate() {
                if self.recent[..i].contains(&tok) {
                    continue;
                }
                if let Some(l) = logits.get_mut(tok as usize) {
                    *l = if *l > 0.0 { *l / p } else { *l * p };
                }
            }
        }
        let (fp, pp) = (self.cfg.frequency_penalty, self.cfg.presence_penalty);
        if fp != 0.0 || pp != 0.0 {
            for (&tok, &n) in &self.counts {
                if let Some(l) = logits.get_mut(tok as usize) {
                    *l -= n as f32 * fp + pp;
                }
            }
        }
        for &(tok, b) in &self.cfg.logit_bias {
            if let Some(l) = logits.get_mut(tok as usize) {
                *l += b;
            }
        }
    }

    /// Picks the next token. `logits` is modified (penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.apply_penalty(logits);
        if self.cfg.temp <= 0.0 {
            return crate::ops::argmax(logits) as u32;
        }
        self.filter(logits);
        let r = self.rng.next_f64() as f32;
        let mut acc = 0.0;
        for c in &self.cands {
            acc += c.p;
            if r < acc {
                return c.id;
            }
        }
        self.cands.last().map_or(0, |c| c.id)
    }

    /// The probabilities `tok` was drawn with by the last [`Sampler::sample`], as
    /// log-probabilities: `tok`'s and the `k` most likely candidates' after the whole chain
    /// (penalties, top-k, top-p, min-p, temperature; llama-server's `post_sampling_probs`).
    /// Greedy sampling draws its token with probability 1.
    pub fn drawn(&self, tok: u32, k: usize) -> TokenLogprobs {
        if self.cfg.temp <= 0.0 {
            let top = if k > 0 { vec![(tok, 0.0)] } else { Vec::new() };
            return TokenLogprobs { logprob: 0.0, top };
        }
        let ln = |p: f32| if p > 0.0 { p.ln() } else { f32::NEG_INFINITY };
        TokenLogprobs {
            logprob: self
                .cands
                .iter()
                .find(|c| c.id == tok)
                .map_or(f32::NEG_INFINITY, |c| ln(c.p)),
            // most likely first (the candidates are sorted), none of probability 0
            top: self
                .cands
                .iter()
                .filter(|c| c.p > 0.0)
                .take(k)
                .map(|c| (c.id, ln(c.p)))
                .collect(),
        }
    }

    /// Runs top-k, top-p, min-p and temperature over `logits` (penalties not included) and
    /// returns the surviving candidates, most likely first, with probabilities summing to 1.
    pub fn filter(&mut self, logits: &[f32]) -> &[Candidate] {
        self.cands.clear();
        self.cands
            .extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
                p: 0.0,
            }));
        let desc = |a: &Candidate, b: &Candidate| b.logit.total_cmp(&a.logit);
        let k = self.cfg.top_k;
        if k > 0 && k < self.cands.len() {
            self.cands.select_nth_unstable_by(k - 1, desc);
            self.cands.truncate(k);
        }
        self.cands.sort_unstable_by(desc);
        if self.cfg.top_p < 1.0 {
            softmax(&mut self.cands);
            let mut cum = 0.0;
            let mut keep = self.cands.len();
            for (i, c) in self.cands.iter().enumerate() {
                cum += c.p;
                if cum >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cands.truncate(keep);
        }
        if self.cfg.min_p > 0.0 {
            if let Some(max) = self.cands.first().map(|c| c.logit) {
                let min_logit = max + self.cfg.min_p.ln();
                let keep = self
                    .cands
                    .iter()
                    .take_while(|c| c.logit >= min_logit)
                    .count()
                    .max(1);
                self.cands.truncate(keep);
            }
        }
        let t = self.cfg.temp;
        if t > 0.0 {
            // Shifted by the largest first, so that a tiny temperature sends the others to
            // -inf (probability 0) and the largest to 0: dividing the logits themselves by
            // 1e-38 made them all ±inf, the softmax NaN, and the draw fall through to the
            // least likely candidate.
            let max = self
                .cands
                .iter()
                .map(|c| c.logit)
                .fold(f32::NEG_INFINITY, f32::max);
            if max.is_finite() {
                for c in &mut self.cands {
                    c.logit = (c.logit - max) / t;
                }
            }
        }
        softmax(&mut self.cands);
        &self.cands
    }
}

fn softmax(c: &mut [Candidate]) {
    let max = c.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in c.iter_mut() {
        x.p = (x.logit - max).exp();
        sum += x.p;
    }
    for x in c.iter_mut() {
        x.p /= sum;
    }
}

/// Log-probabilities of one generated token: of the token itself and of the `k` most
/// likely tokens at its position, from the model's logits at temperature 1, before any
/// sampling transform (penalties, top-k/p, masks).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    /// ln p(token).
    pub logprob: f32,
    /// The most likely tokens and their ln p, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Of token `tok` in `logits`, with the `k` most likely.
    pub fn of(logits: &[f32], tok: u32, k: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        if k > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if top.len() == k && l <= top[k - 1].1 {
                    continue;
                }
                let at = top.partition_point(|&(_, x)| x >= l);
                top.insert(at, (i as u32, l));
                top.truncate(k);
            }
        }
        TokenLogprobs {
            logprob: logits
                .get(tok as usize)
                .map_or(f32::NEG_INFINITY, |&l| l - lse),
            top: top.into_iter().map(|(i, l)| (i, l - lse)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temp: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplerConfig {
        SamplerConfig {
            temp,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 42,
            ..SamplerConfig::default()
        }
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn drawn_gives_the_probabilities_after_the_chain() {
        // greedy: the token, with probability 1
        let mut s = Sampler::new(cfg(0.0, 40, 0.95, 0.05), 4);
        let t = s.sample(&mut logits_of(&[0.1, 0.6, 0.2, 0.1]));
        assert_eq!(t, 1);
        let d = s.drawn(t, 3);
        assert_eq!((d.logprob, d.top), (0.0, vec![(1, 0.0)]));
        // top-k 2 at temperature 1: the two survivors renormalized (0.6 and 0.2 -> 3/4, 1/4)
        let mut s = Sampler::new(cfg(1.0, 2, 1.0, 0.0), 4);
        let t = s.sample(&mut logits_of(&[0.1, 0.6, 0.2, 0.1]));
        let d = s.drawn(t, 5);
        let ps: Vec<(u32, f32)> = d.top.iter().map(|&(i, l)| (i, l.exp())).collect();
        assert_eq!(ps.len(), 2, "{ps:?}");
        assert_eq!((ps[0].0, ps[1].0), (1, 2));
        assert!(
            (ps[0].1 - 0.75).abs() < 1e-5 && (ps[1].1 - 0.25).abs() < 1e-5,
            "{ps:?}"
        );
        let p = ps.iter().find(|x| x.0 == t).unwrap().1;
        assert!((d.logprob.exp() - p).abs() < 1e-6);
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(cfg(0.0, 40, 0.95, 0.05), 5);
        for _ in 0..10 {
            assert_eq!(s.sample(&mut [0.1, 3.0, -2.0, 2.9, 0.0]), 1);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(
                SamplerConfig {
                    seed,
                    ..cfg(1.0, 0, 1.0, 0.0)
                },
                100,
            );
            (0..64)
                .map(|_| s.sample(&mut logits.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        assert!(
            run(7).iter().any(|&t| t != run(7)[0]),
            "temperature 1 must not be greedy"
        );
    }

    #[test]
    fn top_k_keeps_k_best() {
        let mut s = Sampler::new(cfg(5.0, 2, 1.0, 0.0), 4);
        let l = logits_of(&[0.1, 0.4, 0.3, 0.2]);
        let ids: Vec<u32> = s.filter(&l).iter().map(|c| c.id).collect();
        assert_eq!(ids, [1, 2]);
        for _ in 0..200 {
            assert!(matches!(s.sample(&mut l.clone()), 1 | 2));
        }
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_p() {
        let mut s = Sampler::new(cfg(1.0, 0, 0.7, 0.0), 4);
        let c = s.filter(&logits_of(&[0.15, 0.5, 0.05, 0.3]));
        let ids: Vec<u32> = c.iter().map(|c| c.id).collect();
        assert_eq!(ids, [1, 3], "0.5 < 0.7 <= 0.5 + 0.3");
        assert!((c[0].p - 0.625).abs() < 1e-6, "renormalized: 0.5 / 0.8");
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(cfg(1.0, 0, 1.0, 0.2), 4);
        // threshold 0.2 * 0.5 = 0.1: 0.05 goes
        let ids: Vec<u32> = s
            .filter(&logits_of(&[0.15, 0.5, 0.05, 0.3]))
            .iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(ids, [1, 3, 0]);
    }

    #[test]
    fn temperature_sharpens() {
        let l = logits_of(&[0.6, 0.4]);
        let mut cold = Sampler::new(cfg(0.5, 0, 1.0, 0.0), 2);
        let p = cold.filter(&l)[0].p;
        assert!((p - 0.36 / 0.52).abs() < 1e-5, "p^2 renormalized, got {p}");
    }

    #[test]
    fn a_tiny_temperature_is_greedy() {
        for t in [1e-38, 1e-45, 1e-20, 1e-6] {
            for (top_k, min_p) in [(0, 0.0), (40, 0.05)] {
                let mut s = Sampler::new(cfg(t, top_k, 1.0, min_p), 5);
                for _ in 0..20 {
                    assert_eq!(s.sample(&mut [0.1, 3.0, -2.0, 2.9, 0.0]), 1, "t {t}");
                    let d = s.drawn(1, 2);
                    assert_eq!(d.logprob, 0.0, "t {t}");
                }
            }
        }
    }

    #[test]
    fn repeat_penalty_applies_once_per_distinct_token() {
        let mut s = Sampler::new(
            SamplerConfig {
                repeat_penalty: 2.0,
                repeat_last_n: 3,
                ..cfg(0.0, 0, 1.0, 0.0)
            },
            4,
        );
        for t in [0, 0, 1, 2] {
            s.accept(t); // window of 3 keeps 0, 1, 2
        }
        let mut l = vec![4.0, -1.0, 3.0, 3.5];
        s.apply_penalty(&mut l);
        assert_eq!(l, [2.0, -2.0, 1.5, 3.5]);
        assert_eq!(s.sample(&mut [4.0, -1.0, 3.0, 3.5]), 3);
    }

    #[test]
    fn frequency_and_presence_penalties_count_generated_tokens_only() {
        let mut s = Sampler::new(
            SamplerConfig {
                frequency_penalty: 0.5,
                presence_penalty: 1.5,
                ..cfg(0.0, 0, 1.0, 0.0)
            },
            4,
        );
        // the prompt does not count
        for t in [0, 0, 0, 3] {
            s.accept(t);
        }
        let mut l = vec![1.0; 4];
        s.apply_penalty(&mut l);
        assert_eq!(l, [1.0; 4]);
        for t in [1, 1, 2] {
            s.accept_generated(t);
        }
        let mut l = vec![1.0; 4];
        s.apply_penalty(&mut l);
        // 1: twice (2 * 0.5 + 1.5), 2: once (0.5 + 1.5)
        assert_eq!(l, [1.0, -1.5, -1.0, 1.0]);
        // greedy sees them: 1 was the best before the penalties
        assert_eq!(s.sample(&mut [0.0, 3.0, 0.5, 0.9]), 3);
        s.reset();
        assert_eq!(s.sample(&mut [0.0, 3.0, 0.5, 0.9]), 1);
    }

    #[test]
    fn logit_bias_moves_greedy_and_keeps_masked_tokens_out() {
        let mut s = Sampler::new(
            SamplerConfig {
                logit_bias: vec![(1, -100.0), (2, 2.5), (9, 50.0)],
                ..cfg(0.0, 0, 1.0, 0.0)
            },
            4,
        );
        // 1 would win, 2 wins once biased; an id outside the logits is skipped
        assert_eq!(s.sample(&mut [0.0, 3.0, 1.0, 0.5]), 2);
        // a masked token stays masked, whatever its bias
        let mut s = Sampler::new(
            SamplerConfig {
                logit_bias: vec![(0, 100.0)],
                ..cfg(0.0, 0, 1.0, 0.0)
            },
            4,
        );
        assert_eq!(s.sample(&mut [f32::NEG_INFINITY, 3.0, 1.0, 0.5]), 1);
        assert_eq!(s.sample(&mut [0.0, 3.0, 1.0, 0.5]), 0);
        // and with temperature: +100 takes all the mass
        let mut s = Sampler::new(
            SamplerConfig {
                logit_bias: vec![(3, 100.0)],
                ..cfg(1.0, 0, 1.0, 0.0)
            },
            4,
        );
        for _ in 0..50 {
            assert_eq!(s.sample(&mut [0.0, 3.0, 1.0, 0.5]), 3);
        }
    }

    #[test]
    fn penalty_and_bias_ranges_are_checked() {
        let with = |f: &dyn Fn(&mut SamplerConfig)| {
            let mut c = cfg(0.8, 40, 0.95, 0.05);
            f(&mut c);
            c.check()
        };
        assert!(with(&|c| c.frequency_penalty = 2.0).is_ok());
        assert!(with(&|c| c.presence_penalty = -2.0).is_ok());
        let e = with(&|c| c.frequency_penalty = 2.5).unwrap_err();
        assert_eq!((e.field, e.value), ("frequency_penalty", 2.5));
        assert_eq!(e.flag(), "--frequency-penalty");
        assert!(with(&|c| c.presence_penalty = -3.0).is_err());
        assert!(with(&|c| c.presence_penalty = f32::NAN).is_err());
        assert!(with(&|c| c.logit_bias = vec![(0, 100.0), (1, -100.0)]).is_ok());
        let e = with(&|c| c.logit_bias = vec![(0, 1.0), (1, -101.0)]).unwrap_err();
        assert_eq!((e.field, e.value), ("logit_bias", -101.0));
    }

    #[test]
    fn plans_without_the_new_settings_still_load() {
        let mut v = serde_json::to_value(SamplerConfig::default()).unwrap();
        assert!(v.get("logit_bias").is_none(), "{v}");
        v.as_object_mut().unwrap().remove("frequency_penalty");
        let c: SamplerConfig = serde_json::from_value(v).unwrap();
        assert_eq!(c, SamplerConfig::default());
    }

    #[test]
    fn bad_values_are_rejected() {
        assert!(cfg(-1.0, 0, 1.0, 0.0).check().is_err());
        let e = cfg(1.0, 0, -1.0, 0.0).check().unwrap_err();
        assert_eq!((e.field, e.value), ("top_p", -1.0));
        assert_eq!(e.to_string(), "--top-p -1 must be in (0, 1]");
        assert!(cfg(1.0, 0, 1.5, 0.0).check().is_err());
        assert!(cfg(1.0, 0, 1.0, 2.0).check().is_err());
        assert!(cfg(0.8, 40, 0.95, 0.05).check().is_ok());
    }
}
