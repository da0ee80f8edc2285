//! gpt-oss's harmony format: a reply is messages, each a header and a body,
//! `<|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER`,
//! a call `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{ARGS}`
//! (the recipient may also follow the channel: `<|channel|>commentary to=functions.NAME
//! <|constrain|>json<|message|>`), ended by `<|call|>` (an end-of-generation token).
//!
//! [`Channels`] reads a reply as it streams: the `analysis` channel is reasoning, `final` and
//! `commentary` without a recipient (a preamble) are the answer, a call to `functions.NAME`
//! goes into the answer in one canonical form ([`CALL_OPEN`]`NAME<|message|>ARGS<|call|>`)
//! that gds-serve's `tools::Syntax::Harmony` parses; calls to other recipients (the built-in
//! `browser` and `python` tools, which the server does not run) are dropped, as
//! llama-server's parser consumes them. Text that is not harmony is the answer, whole.

/// The marker that ends a message (not the reply: gpt-oss's vocabulary makes `<|return|>` and
/// `<|call|>` end generation).
pub const END: &str = "<|end|>";

/// The header's markers, which the reply's text must keep (llama-server's preserved tokens
/// for gpt-oss).
pub const MARKERS: &[&str] = &[
    "<|channel|>",
    "<|constrain|>",
    "<|message|>",
    "<|start|>",
    END,
    "<|call|>",
];

const MESSAGE: &str = "<|message|>";

/// A call in the canonical form [`Channels`] writes: this, the function's name,
/// `<|message|>`, its arguments, [`CALL_END`].
pub const CALL_OPEN: &str = "<|channel|>commentary to=functions.";

/// The end of a call in the canonical form.
pub const CALL_END: &str = "<|call|>";

/// A header longer than this is not one: the text is read as plain answer.
const MAX_HEADER: usize = 512;

/// Whether a chat template writes harmony messages (llama.cpp's test: its source has
/// `<|channel|>`).
pub fn is_harmony(source: &str) -> bool {
    source.contains("<|channel|>")
}

/// Where the reply is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum At {
    /// In a message's header (up to `<|message|>`).
    Header,
    /// In a message's body, up to `<|end|>`.
    Body(Body),
    /// Not harmony: the rest is answer.
    Plain,
}

/// What a message's body is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Reasoning,
    Answer,
    Call,
    Dropped,
}

/// A harmony reply read as it streams ([`crate::reasoning::Split`] for harmony templates):
/// each piece's reasoning and answer, what could still be a marker held back. The same text
/// gives the same result streamed in any pieces as whole.
#[derive(Debug)]
pub struct Channels {
    /// `reasoning_format: none`: analysis messages stay in the answer, header and end.
    raw: bool,
    at: At,
    held: String,
}

impl Channels {
    pub fn new(raw: bool) -> Channels {
        Channels {
            raw,
            at: At::Header,
            held: String::new(),
        }
    }

    /// Whether the reply is in an analysis message's body (its reasoning).
    pub fn in_reasoning(&self) -> bool {
        self.at == At::Body(Body::Reasoning)
    }

    /// Adds `text`: the reasoning and the answer that can go out now.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let (mut reasoning, mut answer, mut dropped) =
            (String::new(), String::new(), String::new());
        loop {
            match self.at {
                At::Plain => {
                    answer.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, answer);
                }
                At::Header => {
                    if let Some(at) = self.held.find(MESSAGE) {
                        let header = &self.held[..at];
                        if !may_be_header(header) {
                            self.at = At::Plain;
                            continue;
                        }
                        let body = self.open(header, &mut answer);
                        self.held.drain(..at + MESSAGE.len());
                        self.at = At::Body(body);
                        continue;
                    }
                    if !may_be_header(&self.held) || self.held.len() > MAX_HEADER {
                        self.at = At::Plain;
                        continue;
                    }
                    return (reasoning, answer);
                }
                At::Body(body) => {
                    let (n, ended) = match self.held.find(END) {
                        Some(at) => (at, true),
                        None => (
                            self.held.len() - crate::reply::partial_tag(&self.held, END),
                            false,
                        ),
                    };
                    let out = match body {
                        Body::Reasoning if !self.raw => &mut reasoning,
                        Body::Reasoning | Body::Answer | Body::Call => &mut answer,
                        Body::Dropped => &mut dropped,
                    };
                    out.push_str(&self.held[..n]);
                    if !ended {
                        self.held.drain(..n);
                        return (reasoning, answer);
                    }
                    self.held.drain(..n + END.len());
                    match body {
                        Body::Call => answer.push_str(CALL_END),
                        Body::Reasoning if self.raw => answer.push_str(END),
                        _ => {}
                    }
                    self.at = At::Header;
                }
            }
        }
    }

    /// A message's header read: what its body is, and what of the header goes into the
    /// answer (a call's canonical opening; with `raw`, an analysis message's).
    fn open(&self, header: &str, answer: &mut String) -> Body {
        let field = |key: &str| {
            header.find(key).map(|at| {
                let v = &header[at + key.len()..];
                let end = v
                    .find(|c: char| c.is_whitespace() || c == '<')
                    .unwrap_or(v.len());
                &v[..end]
            })
        };
        let recipient = field("to=");
        let channel = field("<|channel|>");
        match (recipient, channel) {
            (Some(r), _) if r.starts_with("functions.") => {
                answer.push_str(CALL_OPEN);
                answer.push_str(&r["functions.".len()..]);
                answer.push_str(MESSAGE);
                Body::Call
            }
            // a message to the user (gpt-oss sometimes writes ` to=assistant`)
            (Some("assistant"), Some("analysis")) | (None, Some("analysis")) => {
                if self.raw {
                    answer.push_str("<|channel|>analysis");
                    answer.push_str(MESSAGE);
                }
                Body::Reasoning
            }
            (Some(r), _) if r != "assistant" => Body::Dropped,
            _ => Body::Answer,
        }
    }

    /// The end of the reply: what was held back (a header that never got its body is
    /// dropped; text that is not harmony is answer).
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.at {
            At::Header if may_be_header(&held) => (String::new(), String::new()),
            At::Header | At::Plain => (String::new(), held),
            At::Body(Body::Reasoning) if !self.raw => (held, String::new()),
            At::Body(Body::Dropped) => (String::new(), String::new()),
            At::Body(_) => (String::new(), held),
        }
    }
}

/// Whether `text` is (the start of) a header: white space, then `<|...`, ` to=...` (a
/// recipient right after the prompt's `<|start|>assistant`), or a start of either.
fn may_be_header(text: &str) -> bool {
    let t = text.trim_start();
    ["<|", "to="]
        .iter()
        .any(|s| t.starts_with(s) || s.starts_with(t))
}

/// A grammar (`body`, Lark) after free analysis: any analysis messages, then the body —
/// in the final channel, or (`calls`) as the call grammar writes its own header.
pub fn after_analysis(body: &str, calls: bool) -> String {
    let head = if calls {
        String::new()
    } else {
        serde_json::to_string("<|channel|>final<|message|>").unwrap_or_default()
    };
    format!(
        "start: analysis* {head} body\n\
         analysis: \"<|channel|>analysis<|message|>\" think \"<|start|>assistant\"\n\
         think[suffix=\"<|end|>\"]: /(.|\\n)*/\n\
         body: {body}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(raw: bool, text: &str) -> (String, String) {
        let mut c = Channels::new(raw);
        let (mut r, mut a) = c.push(text);
        let (r2, a2) = c.finish();
        r.push_str(&r2);
        a.push_str(&a2);
        (r, a)
    }

    #[test]
    fn channels_split_into_reasoning_answer_and_calls() {
        let reply = "<|channel|>analysis<|message|>User asks. Answer.<|end|><|start|>assistant<|channel|>final<|message|>Paris.";
        assert_eq!(
            whole(false, reply),
            ("User asks. Answer.".into(), "Paris.".into())
        );
        // reasoning_format none: the analysis stays, tags and all; headers still go
        assert_eq!(
            whole(true, reply),
            (
                String::new(),
                "<|channel|>analysis<|message|>User asks. Answer.<|end|>Paris.".into()
            )
        );
        // a call, the recipient in the role header or after the channel
        for call in [
            " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Rome\"}",
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Rome\"}",
        ] {
            let text = format!("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant{call}");
            assert_eq!(
                whole(false, &text),
                (
                    "Need weather.".into(),
                    "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Rome\"}".into()
                ),
                "{call}"
            );
        }
        // a preamble to the user, then a call ended by <|end|> (parallel calls)
        assert_eq!(
            whole(false, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|end|>"),
            (String::new(), "Checking.<|channel|>commentary to=functions.f<|message|>{}<|call|>".into())
        );
        // built-in tools are not ours: dropped
        assert_eq!(
            whole(false, "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|end|><|start|>assistant<|channel|>final<|message|>y"),
            ("x".into(), "y".into())
        );
        // not harmony: the whole text
        assert_eq!(
            whole(false, "Hello <|end|> there"),
            (String::new(), "Hello <|end|> there".into())
        );
        assert_eq!(whole(false, "<|"), (String::new(), String::new()));
        // unfinished thinking is reasoning
        assert_eq!(
            whole(false, "<|channel|>analysis<|message|>hmm <|en"),
            ("hmm <|en".into(), String::new())
        );
        // a header that runs on is not one
        let long = format!("<|channel|>{}", "x".repeat(600));
        assert_eq!(whole(false, &long), (String::new(), long.clone()));
    }

    /// Streamed in any pieces, the same as whole.
    #[test]
    fn streamed_pieces_read_as_the_whole() {
        let texts = [
            "<|channel|>analysis<|message|>User asks. Answer.<|end|><|start|>assistant<|channel|>final<|message|>Paris <|e.",
            " to=functions.get_weather<|channel|>commentary json<|message|>{\"a\": \"<|end\"}",
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|end|>",
            "Plain <|channel|> text",
            "<|channel|>analysis<|message|>unfinished",
        ];
        for raw in [false, true] {
            for text in texts {
                let whole = whole(raw, text);
                for step in 1..=5 {
                    let mut c = Channels::new(raw);
                    let (mut rs, mut cs) = (String::new(), String::new());
                    let chars: Vec<char> = text.chars().collect();
                    for piece in chars.chunks(step) {
                        let (a, b) = c.push(&piece.iter().collect::<String>());
                        rs.push_str(&a);
                        cs.push_str(&b);
                    }
                    let (a, b) = c.finish();
                    rs.push_str(&a);
                    cs.push_str(&b);
                    assert_eq!((rs, cs), whole, "{text:?} in pieces of {step}, raw {raw}");
                }
            }
        }
    }
}
