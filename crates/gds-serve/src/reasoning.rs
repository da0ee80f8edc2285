//! `reasoning_format` (llama-server's field, `--reasoning-format`): whether a thinking model's
//! reply comes back split into reasoning and answer ([`gds_runtime::reasoning`] splits it).

use crate::error::ApiError;
pub use gds_runtime::reasoning::{Reasoning, Split};

/// A reply's [`Split`] that counts its reasoning tokens as it goes (OpenAI's
/// `completion_tokens_details.reasoning_tokens`, the Responses API's
/// `output_tokens_details.reasoning_tokens`): the tokens generated up to a piece count when
/// the piece gave reasoning text or left the split inside the thinking (its tags included).
/// Pieces are a few tokens at most, so the count is exact but where one piece holds both the
/// end of the thinking and the start of the answer.
#[derive(Debug)]
pub struct CountedSplit {
    split: Split,
    tokens: usize,
    seen: usize,
}

impl CountedSplit {
    pub fn new(r: &Reasoning) -> CountedSplit {
        CountedSplit {
            split: Split::new(r),
            tokens: 0,
            seen: 0,
        }
    }

    /// [`Split::push`], `generated` tokens generated so far.
    pub fn push(&mut self, text: &str, generated: usize) -> (String, String) {
        let (r, answer) = self.split.push(text);
        self.count(generated, !r.is_empty());
        (r, answer)
    }

    /// [`Split::end`], `generated` tokens in all.
    pub fn end(&mut self, rest: &str, generated: usize) -> (String, String) {
        let (r, answer) = self.split.end(rest);
        self.count(generated, !r.is_empty());
        (r, answer)
    }

    /// The reasoning's tokens so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn count(&mut self, generated: usize, gave_reasoning: bool) {
        if gave_reasoning || self.split.in_reasoning() {
            self.tokens += generated.saturating_sub(self.seen);
        }
        self.seen = self.seen.max(generated);
    }
}

/// `reasoning_format`: whether replies are split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Split (`auto`, `deepseek`, `deepseek-legacy`).
    Split,
    /// The reply whole, thinking tags included, in `content`.
    None,
}

impl Format {
    /// llama-server's names.
    pub fn parse(s: &str) -> Result<Format, String> {
        match s {
            "auto" | "deepseek" | "deepseek-legacy" => Ok(Format::Split),
            "none" => Ok(Format::None),
            other => Err(format!(
                "reasoning_format {other:?} is not one of auto, deepseek, deepseek-legacy, none"
            )),
        }
    }

    /// A request's `reasoning_format`, else the server's.
    pub fn of_request(field: Option<&str>, default: Format) -> Result<Format, ApiError> {
        field.map_or(Ok(default), |f| {
            Format::parse(f).map_err(|e| ApiError::bad(e).param("reasoning_format"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_by_name() {
        assert_eq!(Format::parse("deepseek"), Ok(Format::Split));
        assert_eq!(Format::parse("none"), Ok(Format::None));
        assert!(Format::parse("bogus").is_err());
    }

    /// Reasoning tokens: the pieces of the thinking (its tags and the white space after its
    /// end included), not the answer's; none without thinking; all of an unfinished one.
    #[test]
    fn reasoning_tokens_are_the_thinking_pieces() {
        let qwen3 = "{% if x %}<think>\n{{ r }}\n</think>{% endif %}";
        let r = Reasoning::of_template(qwen3, "<|im_start|>assistant\n").unwrap();
        let run = |pieces: &[&str]| {
            let mut c = CountedSplit::new(&r);
            let (mut reasoning, mut answer) = (String::new(), String::new());
            for (i, p) in pieces.iter().enumerate() {
                let (a, b) = c.push(p, i + 1);
                reasoning.push_str(&a);
                answer.push_str(&b);
            }
            let (a, b) = c.end("", pieces.len());
            (reasoning + &a, answer + &b, c.tokens())
        };
        let thinking = [
            "<think>", "\nLet", " me", " see.\n", "</think>", "\n\n", "Paris", ".",
        ];
        assert_eq!(run(&thinking), ("Let me see.\n".into(), "Paris.".into(), 6));
        assert_eq!(run(&["Paris", "."]), (String::new(), "Paris.".into(), 0));
        assert_eq!(
            run(&["<think>", "hmm", " so"]),
            ("hmm so".into(), String::new(), 3)
        );
    }
}
