//! vLLM's `truncate_prompt_tokens` and `truncation_side`: the inputs of the embedding,
//! rerank and score endpoints, and the prompts of chat and completions, cut to a number of
//! tokens instead of refused where longer than the context.

use crate::error::ApiError;
use crate::ServerState;
use serde::Deserialize;
use serde_json::Value;

/// vLLM's `truncate_prompt_tokens` (with its `truncation_side`): how many tokens of each
/// input to keep, and from which end. `k ≥ 1` keeps `k` of them — the last `k` (vLLM's
/// pooling parameters: "k for last k tokens") unless `truncation_side` is `"right"`, which
/// keeps the first —, `-1` the context's length; absent or null, no truncation (an input
/// longer than the context is a 400).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Truncation {
    keep: usize,
    /// Keep the first tokens (`truncation_side: "right"`) instead of the last.
    first: bool,
}

/// vLLM's request fields of [`Truncation`] (`truncate_prompt_tokens`, `truncation_side`),
/// flattened into the bodies that take them.
#[derive(Deserialize, Debug, Default, Clone)]
pub(crate) struct TruncateFields {
    #[serde(default)]
    truncate_prompt_tokens: Option<Value>,
    #[serde(default)]
    truncation_side: Option<String>,
}

impl TruncateFields {
    /// The request's truncation, checked.
    pub(crate) fn parse(&self, st: &ServerState) -> Result<Option<Truncation>, ApiError> {
        let first = match self.truncation_side.as_deref() {
            None | Some("left") => false,
            Some("right") => true,
            Some(s) => {
                return Err(ApiError::bad(format!(
                "truncation_side {s:?}: \"left\" (keep the last tokens) or \"right\" (the first)"
            ))
                .param("truncation_side"))
            }
        };
        let keep = match &self.truncate_prompt_tokens {
            None | Some(Value::Null) => return Ok(None),
            Some(v) => match v.as_i64() {
                Some(-1) => st.ctx,
                Some(n) if n >= 1 => (n as u64).min(st.ctx as u64) as usize,
                _ => {
                    return Err(ApiError::bad(format!(
                        "truncate_prompt_tokens {v}: a count of tokens to keep, 1 or more, or -1 (the context)"
                    ))
                    .param("truncate_prompt_tokens"))
                }
            },
        };
        Ok(Some(Truncation { keep, first }))
    }
}

impl Truncation {
    /// The same, keeping at most `n` tokens (a prompt leaves its reply room).
    pub(crate) fn at_most(self, n: usize) -> Truncation {
        Truncation {
            keep: self.keep.min(n),
            ..self
        }
    }

    /// Cuts each prompt to the tokens it keeps.
    pub(crate) fn apply(t: Option<Truncation>, prompts: &mut [Vec<u32>]) {
        let Some(t) = t else { return };
        for p in prompts {
            t.cut_in_place(p);
        }
    }

    /// `prompt` cut to the tokens it keeps.
    pub(crate) fn cut(self, mut prompt: Vec<u32>) -> Vec<u32> {
        self.cut_in_place(&mut prompt);
        prompt
    }

    fn cut_in_place(self, p: &mut Vec<u32>) {
        if p.len() > self.keep {
            if !self.first {
                p.drain(..p.len() - self.keep);
            }
            p.truncate(self.keep);
        }
    }
}
