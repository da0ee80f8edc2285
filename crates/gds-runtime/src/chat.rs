//! Chat templates: the Jinja template shipped in `tokenizer_config.json`, rendered with
//! minijinja the way Hugging Face's `apply_chat_template` renders it (`trim_blocks`,
//! `lstrip_blocks`, `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
//! `raise_exception`, `strftime_now`, and the common Python string/dict methods).

use crate::error::{Result, RuntimeError};
use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant's tool calls, in OpenAI's form (`[{"id", "type": "function",
    /// "function": {"name", "arguments"}}]`), which tool-aware templates render.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` message: the id of the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings the template sees.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // No debug info on errors: minijinja 2.24's renderer of it (`{e:#}`) subtracts span
        // columns unchecked and panics on spans a template can produce (fuzz regression
        // `fuzz/regressions/tokenizer/crash-91be…`). `{e}` still names the kind, the detail
        // and the template line.
        env.set_debug(false);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, Error> {
                Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("template raised: {msg}"),
                ))
            },
        );
        env.add_function("strftime_now", |fmt: String| strftime(&fmt, now_unix()));
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(pycompat);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// Whether the template renders a `tools` variable (function definitions), as the
    /// tool-calling templates of Qwen, Llama 3.1+, Mistral and Hermes do.
    pub fn takes_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Renders a conversation, with `tools` (OpenAI's list of
    /// `{"type": "function", "function": {...}}`) in the template's `tools` variable.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            tools => tools,
        })
        .map_err(|e| RuntimeError::Template(e.to_string()))
    }
}

/// `tojson` as Hugging Face defines it for chat templates (Python's `json.dumps` with
/// `ensure_ascii=False`): `", "` and `": "` between items (`",\n"` and indentation with
/// `indent`), keys in their order (`sort_keys` sorts), text as it is. minijinja's own
/// filter writes compact, HTML-escaped JSON, which is not what the models were trained on
/// (function definitions in tool-calling prompts are rendered with it).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let bad = |e: serde_json::Error| Error::new(ErrorKind::InvalidOperation, e.to_string());
    let mut v = serde_json::to_value(&value).map_err(bad)?;
    if sort_keys == Some(true) {
        v.sort_all_objects();
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut out,
        PyJson {
            indent: indent.map(|n| vec![b' '; n]),
            level: 0,
            filled: Vec::new(),
        },
    );
    serde::Serialize::serialize(&v, &mut ser).map_err(bad)?;
    Ok(Value::from_safe_string(String::from_utf8(out).map_err(
        |e| Error::new(ErrorKind::InvalidOperation, e.to_string()),
    )?))
}

/// Python's `json.dumps` layout: `", "` / `": "`, or with an indent one item per line.
struct PyJson {
    indent: Option<Vec<u8>>,
    level: usize,
    /// Per open container: whether it has an item yet (an empty one closes on its line).
    filled: Vec<bool>,
}

impl PyJson {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(unit) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(unit)?;
            }
        }
        Ok(())
    }

    fn separator<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if let Some(f) = self.filled.last_mut() {
            *f = true;
        }
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }

    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.filled.push(false);
        w.write_all(b)
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.filled.pop() == Some(true) {
            self.newline(w)?;
        }
        w.write_all(b)
    }
}

impl serde_json::ser::Formatter for PyJson {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.separator(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.separator(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// The Python methods HF templates call most, on strings and dicts.
fn pycompat(
    _state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    let arg_str = |i: usize| args.get(i).and_then(|v| v.as_str().map(str::to_string));
    if let Some(s) = value.as_str() {
        let chars = arg_str(0);
        let pat = |c: char| {
            chars
                .as_deref()
                .map_or(c.is_whitespace(), |cs| cs.contains(c))
        };
        return Ok(match method {
            "strip" => Value::from(s.trim_matches(pat)),
            "lstrip" => Value::from(s.trim_start_matches(pat)),
            "rstrip" => Value::from(s.trim_end_matches(pat)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" | "capitalize" => {
                let mut c = s.chars();
                Value::from(
                    c.next()
                        .map(|f| {
                            f.to_uppercase()
                                .chain(c.flat_map(|x| x.to_lowercase()))
                                .collect::<String>()
                        })
                        .unwrap_or_default(),
                )
            }
            "startswith" => Value::from(arg_str(0).is_some_and(|p| s.starts_with(&p))),
            "endswith" => Value::from(arg_str(0).is_some_and(|p| s.ends_with(&p))),
            "replace" => match (arg_str(0), arg_str(1)) {
                (Some(a), Some(b)) => Value::from(s.replace(&a, &b)),
                _ => return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)")),
            },
            "split" => match arg_str(0) {
                Some(sep) => {
                    Value::from(s.split(sep.as_str()).map(Value::from).collect::<Vec<_>>())
                }
                None => Value::from(s.split_whitespace().map(Value::from).collect::<Vec<_>>()),
            },
            "find" => Value::from(arg_str(0).and_then(|p| s.find(&p)).map_or(-1, |i| i as i64)),
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => Ok(Value::from(
                value
                    .try_iter()?
                    .map(|k| Ok(Value::from(vec![k.clone(), value.get_item(&k)?])))
                    .collect::<std::result::Result<Vec<_>, Error>>()?,
            )),
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => Ok(Value::from(
                value
                    .try_iter()?
                    .map(|k| value.get_item(&k))
                    .collect::<std::result::Result<Vec<_>, Error>>()?,
            )),
            "get" => {
                let key = args.first().cloned().unwrap_or_default();
                let v = value.get_item(&key)?;
                Ok(if v.is_undefined() {
                    args.get(1).cloned().unwrap_or_default()
                } else {
                    v
                })
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A small `strftime` (UTC) for the formats chat templates use (`%d %b %Y` and friends).
pub fn strftime(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix.div_euclid(86400);
    let secs = unix.rem_euclid(86400);
    // civil-from-days (Howard Hinnant's algorithm)
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (month, wday) = (MONTHS[(m - 1) as usize], DAYS[days.rem_euclid(7) as usize]);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(wday),
            Some('a') => out.push_str(&wday[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, verbatim from its tokenizer_config.json.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_renders_like_transformers() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let out = t.render(&[Message::new("user", "Hi there")], true).unwrap();
        assert_eq!(out, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n");
        let out = t
            .render(
                &[
                    Message::new("system", "Be brief."),
                    Message::new("user", "Hi"),
                    Message::new("assistant", "Hello!"),
                    Message::new("user", "Bye"),
                ],
                false,
            )
            .unwrap();
        assert_eq!(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n");
    }

    /// Fuzz regression (`fuzz/regressions/tokenizer/template-error-debug-info-panics-minijinja`):
    /// `for` with no loop variable compiles, fails at render with a span whose end column is
    /// before its start, and minijinja's debug-info renderer subtracted them (a panic with
    /// overflow checks, a wrapped length without). The error must come back as a message.
    #[test]
    fn render_error_with_a_backwards_span_is_a_message() {
        let t =
            ChatTemplate::new("{% for in messages %}{{ 1 }}{% endfor %}", "<s>", "</s>").unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.render(&[Message::new("user", "hi")], false)
        }));
        let msg = r
            .expect("rendering must not panic")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("chat:1"), "{msg}");
        assert!(
            !msg.contains("Referenced variables"),
            "debug info rendered: {msg}"
        );
    }

    #[test]
    fn trim_blocks_helpers_and_exceptions() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() | upper }}]\n  {% endif %}\n{% endfor %}{{ bos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "  hi ")], false).unwrap(),
            "[HI]\n<s>"
        );
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], true).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
        assert!(ChatTemplate::new("{% if %}", "", "").is_err());
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-07-23 12:34:56 UTC was a Tuesday
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A", 1721738096),
            "23 Jul 2024 12:34:56 Tuesday"
        );
        assert_eq!(strftime("%Y-%m-%d %%", 0), "1970-01-01 %");
    }
}
