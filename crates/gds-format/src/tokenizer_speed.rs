//! A tokenizer's time on text, checked before it is trusted: like the chat template, a
//! tokenizer is code from the model's files.
//!
//! Its normalizer and pre-tokenizer may carry regular expressions (`Split` and `Replace`
//! patterns) that Oniguruma runs by backtracking. Oniguruma gives up on one match after 10 M
//! backtracking steps (an error, not a hang), but a pattern that stays under that at every
//! position of a text can still take milliseconds a character: one crafted for an audit took
//! 8 s for a 400-character prompt, which would make a long prompt take hours and keep a core
//! busy all that time. The tokenizers of real models take 0.1 to 5 µs a character (SmolLM2's
//! on a Zen 4 core), whatever the text.
//!
//! [`check`] encodes probe texts (every printable ASCII character in turn, runs of letters,
//! digits, spaces, newlines, punctuation, CJK, emoji, and a few mixes) at [`LENGTHS`]
//! characters and refuses the tokenizer when a probe takes more than [`LIMIT_US_PER_CHAR`] a
//! character, or when its time a character grows more than [`GROWTH`]-fold from one length to
//! the next on two steps in a row (a time that grows with the square of the length or faster;
//! [`CONFIRM_LENGTH`] is measured to confirm growth seen at the last step). Times are the
//! thread's CPU time, measured at least twice and up to [`TRIES`] times when over a bound, the
//! least counting, so that a busy machine does not refuse a good tokenizer. (The printable
//! ASCII characters matter most: Oniguruma skips at once a text that lacks a character the
//! pattern requires, so a slow pattern is slow only on texts that have its characters.) Real
//! tokenizers pass in about 0.1 s, once per process and file.
//!
//! What it cannot see: a pattern that is slow only on a text unlike every probe (one that
//! requires a character no probe has). That one still ends (Oniguruma's limit bounds each
//! position), and the server tokenizes on blocking threads, so other requests are still
//! answered (docs/limits.md).

use std::sync::{Mutex, PoisonError};

use crate::quiet_panic;

/// The probe texts: a name (for the error) and the unit repeated to the probe's length,
/// before [`PRINTABLE_ASCII`] and a newline.
pub const PROBES: &[(&str, &str)] = &[
    ("printable ASCII characters", PRINTABLE_ASCII),
    ("letters", "a"),
    ("capital letters", "Z"),
    ("digits", "7"),
    ("spaces", " "),
    ("tabs", "\t"),
    ("newlines", "\n"),
    ("CR LF pairs", "\r\n"),
    ("periods", "."),
    ("apostrophes", "'"),
    ("accented letters", "é"),
    ("CJK characters", "中"),
    ("emoji", "\u{1F600}"),
    ("words", "ab "),
    ("letters and digits", "a1"),
    ("spaces and newlines", " \n"),
    ("text", "Hello, World! It's 42.\n"),
];

/// Every printable ASCII character, in order: a probe of its own, and the end of every
/// probe text (with a newline). Oniguruma skips at once a text that lacks a character the
/// pattern requires (a pattern slow on runs of letters before a "!" is fast on letters
/// alone), so every probe has them all once, after its run.
pub const PRINTABLE_ASCII: &str =
    " !\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~";

/// The probe lengths, in characters: each 4 times the one before, the first short enough
/// that a pattern at Oniguruma's limit on every position is refused within about a second.
pub const LENGTHS: [usize; 4] = [32, 128, 512, 2048];

/// The most time a character a probe may take, in microseconds: about 25 times the slowest
/// probe of SmolLM2's tokenizer (a run of digits, 4 µs a character on a Zen 4 core), a
/// margin for slower and busy machines; a prompt of 32 000 characters at this rate takes 3 s.
pub const LIMIT_US_PER_CHAR: f64 = 100.0;

/// The most a probe's time a character may grow from one length to the next (4 times
/// longer); a time that grows with the square of the length grows 4-fold.
pub const GROWTH: f64 = 3.0;

/// Below this time a character (microseconds), growth is not counted: short, fast probes are
/// mostly the library's fixed cost per call.
pub const GROWTH_FLOOR_US_PER_CHAR: f64 = 1.0;

/// How many times a probe is measured, at most (twice at least, more while over a bound);
/// the least time counts.
pub const TRIES: usize = 5;

/// The length measured after the last of [`LENGTHS`] only when the step to it grew over
/// [`GROWTH`]: growth is refused when seen on two steps in a row, as a time that grows with
/// the square of the length or faster grows at every step, and a busy machine (another
/// thread on the core's sibling, caches emptied) once made one step of a real tokenizer's
/// grow 3.4-fold (0.74 µs a character at 128, 2.51 at 512, on runs of "é"; flat, 0.65 to
/// 0.93 from 32 to 8192, on an idle machine).
pub const CONFIRM_LENGTH: usize = 8192;

/// Refuses a tokenizer whose time on a probe text is over [`LIMIT_US_PER_CHAR`] or grows
/// faster than the text ([`GROWTH`]): the error names the probe and the times. `source` is
/// the `tokenizer.json` it was loaded from: a file that passed in this process is not probed
/// again. A panic of the library on a probe (Oniguruma's limit, which the `onig` crate turns
/// into a panic) is refused the same way.
pub fn check(t: &tokenizers::Tokenizer, source: &[u8]) -> Result<(), String> {
    static PASSED: Mutex<Vec<[u8; 32]>> = Mutex::new(Vec::new());
    let passed = || PASSED.lock().unwrap_or_else(PoisonError::into_inner);
    let key = *blake3::hash(source).as_bytes();
    if passed().contains(&key) {
        return Ok(());
    }
    for (name, unit) in PROBES {
        probe(t, name, unit)?;
    }
    passed().push(key);
    Ok(())
}

/// One probe text at every length of [`LENGTHS`], and at [`CONFIRM_LENGTH`] when the last
/// step grew.
fn probe(t: &tokenizers::Tokenizer, name: &str, unit: &str) -> Result<(), String> {
    let mut before: Option<(usize, f64)> = None;
    // the step before, when it grew over GROWTH: the length and time it grew from
    let mut grew: Option<(usize, f64)> = None;
    for n in LENGTHS.into_iter().chain([CONFIRM_LENGTH]) {
        if n == CONFIRM_LENGTH && grew.is_none() {
            break;
        }
        let text: String = (unit.chars().cycle().take(n))
            .chain(PRINTABLE_ASCII.chars())
            .chain(['\n'])
            .collect();
        let chars = text.chars().count() as f64;
        let grows =
            |us: f64| before.is_some_and(|(_, b)| us > GROWTH_FLOOR_US_PER_CHAR && us > b * GROWTH);
        let over = |us: f64| us > LIMIT_US_PER_CHAR || grows(us);
        let mut least = f64::INFINITY;
        for i in 0..TRIES {
            let start = thread_cpu_us();
            match quiet_panic::catch(|| t.encode_fast(text.as_str(), false)) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("it fails on a run of {n} {name}: {e}")),
                Err(msg) => {
                    return Err(format!(
                        "a regular expression of its normalizer or pre-tokenizer backtracks \
                         without end on a run of {n} {name} ({msg})"
                    ))
                }
            }
            least = least.min((thread_cpu_us() - start) / chars);
            // twice at least: a length's time is the next one's reference for growth
            if i >= 1 && !over(least) {
                break;
            }
        }
        if least > LIMIT_US_PER_CHAR {
            return Err(format!(
                "tokenizing a run of {n} {name} took {:.1} ms, {least:.1} µs a character \
                 (the limit is {LIMIT_US_PER_CHAR} µs; real tokenizers take 0.1 to 5): a \
                 regular expression of its normalizer or pre-tokenizer backtracks, and a long \
                 prompt would take minutes",
                least * chars / 1e3
            ));
        }
        if grows(least) {
            // one step may be a busy machine's; two in a row are the tokenizer's
            if let (Some((l, a)), Some((m, b))) = (grew, before) {
                return Err(format!(
                    "tokenizing a run of {name} took {a:.2} µs a character at {l}, {b:.2} at \
                     {m} and {least:.2} at {n}: its time grows faster than the text (over \
                     {GROWTH}-fold for 4 times the text, twice), so a regular expression of \
                     its normalizer or pre-tokenizer backtracks, and a long prompt would take \
                     minutes"
                ));
            }
            grew = before;
        } else {
            grew = None;
        }
        before = Some((n, least));
    }
    Ok(())
}

/// The CPU time this thread has run, in microseconds: a probe's time without the time the
/// thread waited for a core (a busy machine, the test suites' parallel threads), which wall
/// time counts. (The tokenizers library encodes one text on the calling thread.)
fn thread_cpu_us() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the pointer, which points to a live,
    // writable local; CLOCK_THREAD_CPUTIME_ID is always available on Linux (an error, which
    // leaves it zero, would make every probe take no time: a check that passes, never UB).
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer (every piece unknown but "a") whose pre-tokenizer splits by
    /// `pattern`, and the JSON it was built from.
    fn split_by(pattern: &str) -> (tokenizers::Tokenizer, Vec<u8>) {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "post_processor": null, "decoder": null,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": pattern},
                "behavior": "Isolated", "invert": false},
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1}, "unk_token": "<unk>"}
        })
        .to_string();
        let t = tokenizers::Tokenizer::from_bytes(json.as_bytes()).expect("the tokenizer loads");
        (t, json.into_bytes())
    }

    /// GPT-2's pattern (the shape of every real tokenizer's) passes: its time is flat.
    #[test]
    fn a_real_pre_tokenizer_passes() {
        let (t, json) =
            split_by(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+");
        check(&t, &json).expect("a real pattern passes");
        // and again, from the list of those that passed
        check(&t, &json).unwrap();
    }

    /// A pattern whose time grows faster than the text (three nested runs of word
    /// characters before a "!": every split of each run is tried from every position) is
    /// refused by its growth; one that backtracks without end (Oniguruma gives up), as such.
    #[test]
    fn patterns_that_backtrack_are_refused() {
        let (t, json) = split_by(r"\w*\w*\w*!");
        let e = check(&t, &json).expect_err("superlinear");
        // (or, on a busy machine, over the limit on a run of letters)
        assert!(
            e.contains("grows faster than the text") || e.contains("the limit is"),
            "{e}"
        );
        let (t, json) = split_by(r"(\w+\s?)*$");
        let e = check(&t, &json).expect_err("exponential");
        assert!(
            e.contains("printable ASCII") && e.contains("backtracks without end"),
            "{e}"
        );
        // the list of tokenizers that passed holds neither
        assert!(check(&t, &json).is_err());
    }
}
