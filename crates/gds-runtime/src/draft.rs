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

use serde::Serialize;

/// What the plan says about speculative decoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DraftPlan {
    /// The draft: `ngram` (prompt lookup).
    pub kind: String,
    /// Most tokens guessed per pass (the pass evaluates one more).
    pub max_tokens: usize,
    /// Longest suffix looked up.
    pub ngram_max: usize,
    /// Shortest suffix looked up.
    pub ngram_min: usize,
}

/// Longest n-gram the lookup tries first.
pub const NGRAM_MAX: usize = 4;
/// Shortest n-gram it falls back to.
pub const NGRAM_MIN: usize = 2;

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

#[cfg(test)]
mod tests {
    use super::*;

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
