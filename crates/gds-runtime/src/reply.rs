//! The per-token policy of a reply, one for every front end: the CLI's generation loop
//! ([`crate::engine`]) and the server's token streams (`gds-serve`) both follow it, so the
//! same greedy request gives the same text, the same token count and the same end.
//!
//! - Every sampled token counts as generated, the end-of-generation token included: it was
//!   computed and sampled like the others (llama-server and vLLM count it too). It is never
//!   text.
//! - Text arrives as decoded pieces; stop strings are searched across pieces (the tail that
//!   could hold one), the text is cut before the first found, and the reply ends there, the
//!   token that completed it counted.
//! - Text that may be the start of a stop string is held back until it cannot be.

/// A reply being generated: its text, how much of it was shown, its stop strings, and how
/// many tokens it took.
#[derive(Debug)]
pub struct Reply {
    text: String,
    shown: usize,
    stops: Vec<String>,
    max_stop: usize,
    generated: usize,
    stopped_by: Option<String>,
    /// The stop string stays in the text (vLLM's `include_stop_str_in_output`).
    keep_stop: bool,
    /// Stop strings must end past this byte of the text: what the first `min_tokens`
    /// tokens wrote is not searched (vLLM's `min_tokens`).
    floor: usize,
    min_tokens: usize,
    /// Text from this byte is held back (a limit may still cut it: `n_indent`).
    hold: Option<usize>,
}

impl Reply {
    /// A reply that ends at any of `stops`.
    pub fn new(stops: Vec<String>) -> Reply {
        Reply {
            text: String::new(),
            shown: 0,
            max_stop: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            generated: 0,
            stopped_by: None,
            keep_stop: false,
            floor: 0,
            min_tokens: 0,
            hold: None,
        }
    }

    /// The stop string that ends the reply stays in its text, and text that may start one
    /// is not held back (vLLM's `include_stop_str_in_output`).
    pub fn keeping_stop(mut self, keep: bool) -> Reply {
        self.keep_stop = keep;
        self
    }

    /// No stop string ends the reply inside the text of its first `n` tokens (one may
    /// straddle their end), as vLLM's `min_tokens` holds stop strings back.
    pub fn stops_after(mut self, n: usize) -> Reply {
        self.min_tokens = n;
        self
    }

    /// Counts one sampled token (text or end-of-generation).
    pub fn token(&mut self) {
        self.generated += 1;
    }

    /// Appends a decoded piece; true when a stop string ended the reply (the text is cut
    /// before it). Nothing is appended once a stop string was found.
    pub fn push(&mut self, piece: &str) -> bool {
        if self.stopped_by.is_some() {
            return true;
        }
        self.text.push_str(piece);
        if self.generated <= self.min_tokens && self.min_tokens > 0 {
            // (within min_tokens: searched once a later piece comes)
            self.floor = self.text.len();
            return false;
        }
        // a stop string may straddle pieces: search the tail that could hold one
        let from = self.text.len().saturating_sub(piece.len() + self.max_stop);
        let from = (0..=from)
            .rev()
            .find(|&i| self.text.is_char_boundary(i))
            .unwrap_or(0);
        // (one ending inside the text of the first min_tokens tokens does not count)
        let start = |s: &str| {
            let lo = (self.floor + 1).saturating_sub(s.len()).max(from);
            (lo..=self.text.len())
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(self.text.len())
        };
        if let Some((at, s)) = self
            .stops
            .iter()
            .filter_map(|s| {
                let lo = start(s);
                self.text[lo..].find(s.as_str()).map(|i| (lo + i, s))
            })
            .min_by_key(|&(at, _)| at)
        {
            let end = if self.keep_stop { at + s.len() } else { at };
            self.stopped_by = Some(s.clone());
            self.text.truncate(end);
            return true;
        }
        false
    }

    /// Appends what the decoder held back when the reply ends (an incomplete character,
    /// decoded lossily): the U+FFFD its decoding ends with stands for bytes the model did not
    /// finish, so no stop string matches it (a stop string `"\u{FFFD}"` ended every reply cut
    /// inside a character). True when a stop string ended the reply.
    pub fn push_final(&mut self, piece: &str) -> bool {
        let whole = piece.trim_end_matches('\u{FFFD}');
        if self.push(whole) {
            return true;
        }
        self.text.push_str(&piece[whole.len()..]);
        false
    }

    /// The text not shown yet that can be shown now: all of it with `all` (the reply
    /// ended) or once a stop string was found, else all but what may start a stop string.
    pub fn take_shown(&mut self, all: bool) -> Option<String> {
        let mut safe = if all || self.stopped_by.is_some() || self.keep_stop {
            self.text.len()
        } else {
            self.text.len() - held_back(&self.text, &self.stops)
        };
        if let Some(h) = self.hold.filter(|_| !all && self.stopped_by.is_none()) {
            safe = safe.min(h.max(self.shown));
        }
        (safe > self.shown).then(|| {
            let s = self.text[self.shown..safe].to_string();
            self.shown = safe;
            s
        })
    }

    /// Holds the text from byte `at` back (`None`: nothing) until the reply ends or this
    /// is moved: text a limit may still cut (llama-server's `n_indent`).
    pub fn hold_from(&mut self, at: Option<usize>) {
        self.hold = at;
    }

    /// Cuts the text at byte `at` (a character boundary), keeping what was shown: where a
    /// limit ends the reply inside its last line (llama-server's `n_indent`).
    pub fn cut(&mut self, at: usize) {
        let at = at.max(self.shown).min(self.text.len());
        if self.text.is_char_boundary(at) {
            self.text.truncate(at);
        }
    }

    /// Tokens generated, the end-of-generation token included.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// The stop string that ended the reply, if one did.
    pub fn stop_string(&self) -> Option<&str> {
        self.stopped_by.as_deref()
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The whole text.
    pub fn into_text(self) -> String {
        self.text
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of a stop string: text
/// that must not be shown yet because a stop string may be completing.
pub fn held_back(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .map(|s| partial_tag(text, s))
        .max()
        .unwrap_or(0)
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag that may
/// be completing: thinking tags, harmony's markers).
pub fn partial_tag(text: &str, tag: &str) -> usize {
    tag.char_indices()
        .skip(1)
        .map(|(i, _)| i)
        .filter(|&i| text.ends_with(&tag[..i]))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cut_character_is_not_a_stop_strings_replacement_character() {
        let mut r = Reply::new(vec!["\u{FFFD}".into(), "x".into()]);
        assert!(!r.push("語の"));
        assert!(!r.push_final("\u{FFFD}"));
        assert_eq!(r.stop_string(), None);
        assert_eq!(r.take_shown(true).as_deref(), Some("語の\u{FFFD}"));
        // what comes before the cut character is still searched
        let mut r = Reply::new(vec!["ax".into()]);
        assert!(!r.push("a"));
        assert!(r.push_final("x\u{FFFD}"));
        assert_eq!(r.stop_string(), Some("ax"));
        assert_eq!(r.text(), "");
    }

    use super::*;

    #[test]
    fn holds_back_partial_stop_strings() {
        let stops = vec!["</end>".to_string(), "Q:".to_string()];
        assert_eq!(held_back("hello </e", &stops), 3);
        assert_eq!(held_back("hello Q", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("x", &[]), 0);
    }

    #[test]
    fn stop_strings_across_pieces_cut_the_text_and_end_the_reply() {
        let mut r = Reply::new(vec!["Q:".into(), "END".into()]);
        for piece in ["Hello", " wor", "ld Q"] {
            r.token();
            assert!(!r.push(piece));
        }
        // "Q" may start a stop string: held back
        assert_eq!(r.take_shown(false).as_deref(), Some("Hello world "));
        r.token();
        assert!(r.push(": more"));
        assert_eq!(r.stop_string(), Some("Q:"));
        assert_eq!(r.take_shown(false), None);
        assert_eq!(r.text(), "Hello world ");
        // ended: nothing more is taken in, every token was counted
        assert!(r.push("END"));
        assert_eq!(r.generated(), 4);
        // the earliest of two stop strings in one piece
        let mut r = Reply::new(vec!["b".into(), "a".into()]);
        assert!(r.push("xxab"));
        assert_eq!((r.text(), r.stop_string()), ("xx", Some("a")));
    }

    #[test]
    fn a_kept_stop_string_stays_and_min_tokens_holds_stop_strings_back() {
        // include_stop_str_in_output: the text ends with the stop string, nothing after it,
        // and text that may start one is shown at once
        let mut r = Reply::new(vec!["END".into()]).keeping_stop(true);
        assert!(!r.push("one E"));
        assert_eq!(r.take_shown(false).as_deref(), Some("one E"));
        assert!(r.push("ND two"));
        assert_eq!((r.text(), r.stop_string()), ("one END", Some("END")));
        // min_tokens 2: a stop string in the first two tokens' text is not one
        let mut r = Reply::new(vec!["ab".into()]).stops_after(2);
        for piece in ["ab", "xa"] {
            r.token();
            assert!(!r.push(piece), "{piece}");
        }
        // one straddling the end of the second token's text counts
        r.token();
        assert!(r.push("b!"));
        assert_eq!(r.text(), "abx");
        // ... and one wholly after it
        let mut r = Reply::new(vec!["ab".into()]).stops_after(1);
        r.token();
        assert!(!r.push("ab"));
        r.token();
        assert!(r.push("-ab"));
        assert_eq!(r.text(), "ab-");
    }

    #[test]
    fn the_end_of_generation_token_counts_without_text() {
        let mut r = Reply::new(Vec::new());
        r.token();
        assert!(!r.push("Paris."));
        r.token(); // the end-of-generation token: counted, no piece
        assert_eq!(r.take_shown(true).as_deref(), Some("Paris."));
        assert_eq!((r.generated(), r.stop_string()), (2, None));
    }
}
