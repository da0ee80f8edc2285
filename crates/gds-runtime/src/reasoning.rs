//! A thinking model's reasoning, apart from its answer: the text between the template's
//! thinking tags (`<think>`...`</think>` for Qwen 3, QwQ, DeepSeek-R1, GLM 4.5+, SmolLM3;
//! `[THINK]`...`[/THINK]` for Magistral; `<seed:think>` for Seed-OSS; `<|channel>thought`...
//! `<channel|>` for Gemma 4; gpt-oss's harmony channels, [`crate::harmony`]) goes out as the
//! message's `reasoning_content` (llama-server's and vLLM's field; Anthropic's `thinking`
//! block), the rest as its `content`. Whether a template thinks is read from its source;
//! whether a reply starts inside the thinking (DeepSeek-R1's and Qwen 3 Thinking's templates
//! open it in the prompt) from the prompt's end. `reasoning_format` (`--reasoning-format`,
//! per request as llama-server's field, in gds-serve): `auto`/`deepseek` split, `none` leaves the
//! reply whole. The server, `gdsrun run`'s chat and the Python engine split alike.

use crate::constraint::Grammar;

/// A template's source with the tags it builds as `'<tag{}>'.format(NAME)` from a constant
/// (`{%- set NAME = '...' %}`) written out, for telling its tags by their text: Hunyuan 3 builds
/// every special token so (`<think:opensource>`, `<tool_call:opensource>`, ...). Other
/// templates come back as they are.
pub fn template_text(source: &str) -> std::borrow::Cow<'_, str> {
    if !source.contains("}>'.format(") {
        return std::borrow::Cow::Borrowed(source);
    }
    for (i, _) in source.match_indices("set ") {
        let Some((name, rest)) = source[i + 4..].split_once('=') else {
            continue;
        };
        let name = name.trim();
        let word = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        let value = rest
            .trim_start()
            .strip_prefix('\'')
            .and_then(|r| r.split_once('\''))
            .map(|(v, _)| v);
        if let (true, Some(value)) = (word, value) {
            if source.contains(&format!("{{}}>'.format({name})")) {
                return std::borrow::Cow::Owned(source.replace("{}>'", &format!("{value}>'")));
            }
        }
    }
    std::borrow::Cow::Borrowed(source)
}

/// The thinking tags of the templates that have them, told apart by their source.
const TAGS: &[(&str, &str)] = &[
    ("<|channel>thought", "<channel|>"),
    ("<seed:think>", "</seed:think>"),
    ("<think:opensource>", "</think:opensource>"),
    ("<think>", "</think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|inner_prefix|>", "<|inner_suffix|>"),
];

/// How one reply's reasoning is told from its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reasoning {
    kind: Kind,
    /// The prompt ends inside the thinking: the reply starts in it.
    open: bool,
}

/// The two ways templates mark thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Between a start and an end tag, before the answer.
    Tags {
        start: &'static str,
        end: &'static str,
    },
    /// gpt-oss's harmony messages (`<|channel|>analysis<|message|>...<|end|>`; the answer in
    /// the `final` channel, calls to `functions.NAME`): [`crate::harmony`]. `raw`
    /// (`reasoning_format: none`): the analysis stays in the answer with its tags.
    Harmony { raw: bool },
}

impl Reasoning {
    /// For a template (`source`) and the end of a prompt it rendered (`prompt_tail`, special
    /// tokens as text): `None` when the template has no thinking tags.
    pub fn of_template(source: &str, prompt_tail: &str) -> Option<Reasoning> {
        let source = &*template_text(source);
        if crate::harmony::is_harmony(source) {
            return Some(Reasoning {
                kind: Kind::Harmony { raw: false },
                open: false,
            });
        }
        let &(start, end) = TAGS
            .iter()
            .find(|(s, e)| source.contains(s) && source.contains(e))?;
        let open = prompt_tail
            .rfind(start)
            .is_some_and(|at| !prompt_tail[at..].contains(end));
        Some(Reasoning {
            kind: Kind::Tags { start, end },
            open,
        })
    }

    /// For `reasoning_format: none`: `None` (the reply whole) except for harmony templates,
    /// whose messages' headers are never the answer: their analysis stays in it, tags and
    /// all (as llama-server).
    pub fn unsplit(self) -> Option<Reasoning> {
        match self.kind {
            Kind::Harmony { .. } => Some(Reasoning {
                kind: Kind::Harmony { raw: true },
                open: false,
            }),
            Kind::Tags { .. } => None,
        }
    }

    /// The tag that ends the thinking.
    pub fn end_tag(&self) -> &'static str {
        match self.kind {
            Kind::Tags { end, .. } => end,
            Kind::Harmony { .. } => crate::harmony::END,
        }
    }

    /// The texts of the thinking's markers: where a model's vocabulary has them as special
    /// tokens, the reply's text keeps them (its decoding drops other special tokens).
    pub fn markers(&self) -> Vec<&'static str> {
        match self.kind {
            Kind::Tags { start, end } => {
                // Gemma 4's start is a token and a word (`<|channel>` `thought`)
                let token = start.find('>').map_or(start, |i| &start[..=i]);
                vec![token, start, end]
            }
            Kind::Harmony { .. } => crate::harmony::MARKERS.to_vec(),
        }
    }

    /// Whether the grammars the server makes go after free thinking ([`Self::after_thinking`]):
    /// a reply that starts inside the thinking, and every harmony reply (it may think first).
    pub fn wraps_grammars(&self) -> bool {
        self.open || matches!(self.kind, Kind::Harmony { .. })
    }

    /// Whether the reply starts inside the thinking.
    pub fn open(&self) -> bool {
        self.open
    }

    /// For a reply that starts inside the thinking, `g` (a call's grammar, a JSON schema)
    /// after it: free text up to the end tag, then the constrained answer (else the answer
    /// would be forced where the thinking is, and read as reasoning). A regular expression
    /// stays as it is.
    ///
    /// Harmony: any analysis messages first, then `g` in the final channel (`calls`: `g` is
    /// a call's grammar, which writes its own header).
    pub fn after_thinking(&self, g: Grammar, calls: bool) -> Grammar {
        let body = match g {
            Grammar::Lark(src) => format!("%lark {{\n{src}\n}}"),
            Grammar::JsonSchema(mut schema) => {
                if let Some(o) = schema.as_object_mut() {
                    o.entry("x-guidance")
                        .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
                }
                format!("%json {schema}")
            }
            g @ Grammar::Regex(_) => return g,
        };
        if let Kind::Harmony { .. } = self.kind {
            return Grammar::Lark(crate::harmony::after_analysis(&body, calls));
        }
        let end = serde_json::to_string(self.end_tag()).unwrap_or_default();
        Grammar::Lark(format!(
            "start: think /[ \\n]*/ body\nthink[suffix={end}]: /(.|\\n)*/\nbody: {body}\n"
        ))
    }

    /// A whole reply: its reasoning (`None` when it has none, or an empty one) and its answer.
    pub fn split(&self, text: &str) -> (Option<String>, String) {
        let (r, c) = Split::new(self).end(text);
        ((!r.is_empty()).then_some(r), c)
    }
}

/// Where a streamed reply is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing but white space yet: the reply may still open the thinking.
    Before,
    /// In the thinking; `started`: past its leading white space.
    Inside { started: bool },
    /// After the thinking, before the answer's first text (its leading white space dropped).
    After,
    /// The answer.
    Answer,
}

/// A streamed reply, split as it comes: each piece's reasoning and answer text, what could
/// still be the start of a tag held back. As llama-server, the white space after each tag
/// is dropped, the white space before the end tag kept. The same
/// text gives the same split streamed as whole ([`Reasoning::split`] is this).
#[derive(Debug)]
pub struct Split {
    start: &'static str,
    end: &'static str,
    phase: Phase,
    held: String,
    /// A harmony reply's messages (the tags above unused).
    harmony: Option<crate::harmony::Channels>,
}

impl Split {
    pub fn new(r: &Reasoning) -> Split {
        let (start, end, harmony) = match r.kind {
            Kind::Tags { start, end } => (start, end, None),
            Kind::Harmony { raw } => ("", "", Some(crate::harmony::Channels::new(raw))),
        };
        Split {
            start,
            end,
            phase: if r.open {
                Phase::Inside { started: false }
            } else {
                Phase::Before
            },
            held: String::new(),
            harmony,
        }
    }

    /// Whether the reply is inside its thinking (or just past its end tag, before the
    /// answer's first text), so that the tokens of the text pushed last are reasoning.
    pub fn in_reasoning(&self) -> bool {
        match &self.harmony {
            Some(h) => h.in_reasoning(),
            None => matches!(self.phase, Phase::Inside { .. } | Phase::After),
        }
    }

    /// Adds `text`: the reasoning and the answer that can go out now.
    pub fn push(&mut self, text: &str) -> (String, String) {
        if let Some(h) = &mut self.harmony {
            return h.push(text);
        }
        self.held.push_str(text);
        let (mut reasoning, mut answer) = (String::new(), String::new());
        loop {
            match self.phase {
                Phase::Before => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(self.start) {
                        self.held = rest.to_string();
                        self.phase = Phase::Inside { started: false };
                    } else if self.start.starts_with(t) {
                        return (reasoning, answer);
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::Inside { started } => {
                    if !started {
                        let t = self.held.trim_start();
                        if t.is_empty() {
                            self.held.clear();
                            return (reasoning, answer);
                        }
                        self.held = t.to_string();
                        self.phase = Phase::Inside { started: true };
                    }
                    if let Some(at) = self.held.find(self.end) {
                        reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + self.end.len());
                        self.phase = Phase::After;
                        continue;
                    }
                    // out: all but a possible start of the end tag
                    let n = self.held.len() - crate::reply::partial_tag(&self.held, self.end);
                    reasoning.push_str(&self.held[..n]);
                    self.held.drain(..n);
                    return (reasoning, answer);
                }
                Phase::After => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        return (reasoning, answer);
                    }
                    self.held = t.to_string();
                    self.phase = Phase::Answer;
                }
                Phase::Answer => {
                    answer.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, answer);
                }
            }
        }
    }

    /// The reply's last text (`rest`, what the generator held back) and its end: the
    /// reasoning and answer still to go out ([`Split::push`] then [`Split::finish`]).
    pub fn end(&mut self, rest: &str) -> (String, String) {
        let (mut r, mut answer) = self.push(rest);
        let (r2, a2) = self.finish();
        r.push_str(&r2);
        answer.push_str(&a2);
        (r, answer)
    }

    /// The end of the reply: what was held back (an unfinished thinking is reasoning; white
    /// space or a partial tag before anything else is answer).
    pub fn finish(&mut self) -> (String, String) {
        if let Some(h) = &mut self.harmony {
            return h.finish();
        }
        let held = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Before | Phase::Answer => (String::new(), held),
            Phase::Inside { .. } => (held, String::new()),
            Phase::After => (String::new(), String::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3: &str = "{% if x %}<think>\n{{ r }}\n</think>{% endif %}";

    fn think(tail: &str) -> Reasoning {
        Reasoning::of_template(QWEN3, tail).unwrap()
    }

    #[test]
    fn whole_replies_split_at_the_tags() {
        let r = think("<|im_start|>assistant\n");
        assert_eq!(
            r.split("<think>\nLet me see.\n</think>\n\nParis."),
            (Some("Let me see.\n".into()), "Paris.".into())
        );
        assert_eq!(r.split("Paris."), (None, "Paris.".into()));
        assert_eq!(r.split("<think>\n\n</think>\n\nHi"), (None, "Hi".into()));
        // never closed: all reasoning
        assert_eq!(r.split("<think>hmm"), (Some("hmm".into()), String::new()));
        // a tag later in the answer is text
        assert_eq!(r.split("A <think> b"), (None, "A <think> b".into()));
        // opened by the prompt (DeepSeek-R1's template)
        let open = think("<|Assistant|><think>\n");
        assert!(open.open);
        assert_eq!(open.split("x\n</think>y"), (Some("x\n".into()), "y".into()));
        // closed in the prompt (Qwen 3 with enable_thinking false)
        assert!(!think("<think>\n\n</think>\n\n").open);
        assert!(Reasoning::of_template("{{ messages }}", "").is_none());
        // Hunyuan 3 builds its tags with `.format`: read with the constant written in
        let hy = "{%- set HYTK = ':opensource' %}{%- set b = '<think{}>'.format(HYTK) %}{%- set e = '</think{}>'.format(HYTK) %}{{ b }}";
        assert!(template_text(hy).contains("'<think:opensource>'"));
        assert_eq!(
            template_text("{{ '<x{}>'.format(y) }}"),
            "{{ '<x{}>'.format(y) }}"
        );
        let r =
            Reasoning::of_template(hy, "<｜hy_Assistant:opensource｜><think:opensource>").unwrap();
        assert!(r.open());
        assert_eq!(r.end_tag(), "</think:opensource>");
        let m = Reasoning::of_template("[THINK]{{ t }}[/THINK]", "").unwrap();
        assert_eq!(m.split("[THINK]a[/THINK]b"), (Some("a".into()), "b".into()));
        // Gemma 4: a token and a word open it; thinking off closes it in the prompt
        let src = "{{ '<|channel>thought\n' + t + '\n<channel|>' }}";
        let g = Reasoning::of_template(src, "<|turn>model\n").unwrap();
        assert_eq!(
            g.split("<|channel>thought\nHmm.\n<channel|>Yes."),
            (Some("Hmm.\n".into()), "Yes.".into())
        );
        assert_eq!(
            g.markers(),
            ["<|channel>", "<|channel>thought", "<channel|>"]
        );
        assert!(
            !Reasoning::of_template(src, "<|channel>thought\n<channel|>")
                .unwrap()
                .open
        );
    }

    /// Streamed in any pieces, the same split as whole.
    #[test]
    fn streamed_pieces_split_as_the_whole() {
        let texts = [
            "<think>\nLet me see.\n</think>\n\nParis is <b>big</b>.",
            "  <thin",
            "<think>a</thin",
            "Plain <think> text",
            "<think>\n\n</think>\n\n",
            "<think> x </think>",
        ];
        for open in [false, true] {
            let r = Reasoning {
                kind: Kind::Tags {
                    start: "<think>",
                    end: "</think>",
                },
                open,
            };
            for text in texts {
                let whole = r.split(text);
                for step in 1..=4 {
                    let mut s = Split::new(&r);
                    let (mut rs, mut cs) = (String::new(), String::new());
                    let chars: Vec<char> = text.chars().collect();
                    for piece in chars.chunks(step) {
                        let (a, b) = s.push(&piece.iter().collect::<String>());
                        rs.push_str(&a);
                        cs.push_str(&b);
                    }
                    let (a, b) = s.finish();
                    rs.push_str(&a);
                    cs.push_str(&b);
                    let streamed = ((!rs.is_empty()).then_some(rs), cs);
                    assert_eq!(streamed, whole, "{text:?} in pieces of {step}, open {open}");
                }
            }
        }
    }
}
