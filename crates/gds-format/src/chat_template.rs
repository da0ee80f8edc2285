//! Chat templates: the Jinja template shipped in `tokenizer_config.json` (or GGUF's
//! `tokenizer.chat_template`), rendered with minijinja the way Hugging Face's
//! `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`,
//! `{% break %}`/`{% continue %}` as with jinja2's `loopcontrols`, and the common Python
//! string/dict methods).
//!
//! A chat template is code that comes with the model file, so this module is the one place
//! that compiles and renders one, for the converter, `gdsconv validate`/`pull` and the
//! runtime alike, under one policy:
//!
//! * before minijinja's parser sees it, the source is at most [`MAX_SOURCE_BYTES`] and a
//!   cheap scan bounds what the parser and code generator would recurse on (minijinja's
//!   parser guards only some of its recursion: a chain of 20 000 `+` or `|filter`, `- - -`
//!   or `elif` chains overflow the stack): at most [`MAX_TAG_OPERATORS`] operators in one
//!   tag, brackets nested at most [`MAX_NESTING`] deep, at most [`MAX_ELIFS`] `elif`s;
//! * compiling and rendering run on their own thread with a [`STACK_BYTES`] stack (whatever
//!   recursion is left, e.g. printing a deeply nested value a template built, has room);
//! * a render gets [`RENDER_FUEL`] instructions plus [`RENDER_FUEL_PER_MESSAGE`] per message
//!   (minijinja's `fuel`), and at most [`MAX_OUTPUT_BYTES`] of output;
//! * [`check`] compiles a template and renders a sample conversation under those limits, so
//!   that one that exhausts them whatever it is given is refused when a model is converted,
//!   validated, pulled or loaded.
//!
//! * a compile or render holds at most [`crate::render_memory::MAX_RENDER_BYTES`] at once (a
//!   template that doubles a string or list in a loop grows it faster than fuel runs out):
//!   kept by the binaries' global allocator, see [`crate::render_memory`];
//! * a compile or render takes at most [`crate::render_memory::run_limit`] (10 s unless
//!   `GDS_TEMPLATE_SECONDS` says otherwise): an instruction's time grows with the values it
//!   reads, which fuel does not see.

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;

/// Largest template source compiled (the largest real templates are a few tens of KiB).
pub const MAX_SOURCE_BYTES: usize = 1 << 20;
/// Most operators (`+ - * / % ~ | . < > = !`, `not and or is in if else`, opening brackets)
/// in one `{{ ... }}` or `{% ... %}` tag: each may add a level to the expression tree, which
/// minijinja's code generator walks recursively.
pub const MAX_TAG_OPERATORS: usize = 1000;
/// Deepest nesting of brackets in one tag.
pub const MAX_NESTING: usize = 64;
/// Most `elif`s in a template (minijinja parses each as nested in the one before).
pub const MAX_ELIFS: usize = 1000;
/// Stack of the thread that compiles or renders a template (reserved, touched only as used).
pub const STACK_BYTES: usize = 256 << 20;
/// Instructions one render may execute, besides [`RENDER_FUEL_PER_MESSAGE`] per message (a
/// real template takes tens to a few hundred per message).
pub const RENDER_FUEL: u64 = 2_000_000;
/// Instructions one render may execute per message.
pub const RENDER_FUEL_PER_MESSAGE: u64 = 5_000;
/// Largest rendered prompt.
pub const MAX_OUTPUT_BYTES: usize = 16 << 20;
/// Largest string the filters and methods this module defines (or replaces: `indent`,
/// `replace`, `tojson`) build; a width or count from the template cannot make one allocate
/// more.
pub const MAX_VALUE_BYTES: usize = 16 << 20;

/// Why a template was refused, or failed to render.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateError {
    message: String,
    /// The template ran into a limit of this module (fuel, output size, memory), or made the
    /// template engine panic, rather than failing on its own terms (a syntax error,
    /// `raise_exception`, an undefined method): [`check`] refuses it.
    pub limit: bool,
}

impl TemplateError {
    fn new(message: impl Into<String>) -> TemplateError {
        TemplateError {
            message: message.into(),
            limit: false,
        }
    }

    fn limit(message: impl Into<String>) -> TemplateError {
        TemplateError {
            message: message.into(),
            limit: true,
        }
    }
}

impl std::fmt::Display for TemplateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for TemplateError {}

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
    /// An assistant's reasoning, apart from its `content` (llama-server's and vLLM's
    /// `reasoning_content`), which thinking models' templates render (Qwen 3's, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }
}

/// A namespace's defaults with each list made a [`PyList`].
fn py_lists(defaults: Value) -> Value {
    let Some(pairs) = defaults
        .try_iter()
        .ok()
        .filter(|_| defaults.kind() == minijinja::value::ValueKind::Map)
    else {
        return defaults;
    };
    let map: std::collections::BTreeMap<String, Value> = pairs
        .filter_map(|k| {
            let v = defaults.get_item(&k).ok()?;
            let v = if v.kind() == minijinja::value::ValueKind::Seq && v.as_str().is_none() {
                let items: Vec<Value> = v.try_iter().ok()?.collect();
                Value::from_object(PyList(std::sync::Mutex::new(items)))
            } else {
                v
            };
            Some((k.as_str()?.to_string(), v))
        })
        .collect();
    Value::from(map)
}

/// A list that Python's mutating methods change in place (`append`, `pop`, `extend`,
/// `insert`, `clear`): Jinja2's lists are Python's, minijinja's immutable. Its growth is
/// held to the render's memory bound as every allocation is.
#[derive(Debug)]
struct PyList(std::sync::Mutex<Vec<Value>>);

impl PyList {
    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl minijinja::value::Object for PyList {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Seq
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.items();
        let i = i64::try_from(key.clone()).ok()?;
        let i = if i < 0 { i + items.len() as i64 } else { i };
        items.get(usize::try_from(i).ok()?).cloned()
    }

    // by index: a length or a truth test costs nothing, an iteration one item a step (a copy
    // of the list per test would make a loop of them quadratic)
    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        minijinja::value::Enumerator::Seq(self.items().len())
    }

    fn enumerator_len(self: &std::sync::Arc<Self>) -> Option<usize> {
        Some(self.items().len())
    }

    fn call_method(
        self: &std::sync::Arc<Self>,
        _state: &State,
        method: &str,
        args: &[Value],
    ) -> std::result::Result<Value, Error> {
        let bad = |m: String| Error::new(ErrorKind::InvalidOperation, m);
        let index = |v: &Value, len: usize, end: bool| -> std::result::Result<usize, Error> {
            let i = i64::try_from(v.clone())?;
            let i = if i < 0 { i + len as i64 } else { i };
            let max = if end { len } else { len.saturating_sub(1) };
            usize::try_from(i.max(0))
                .ok()
                .filter(|&i| i <= max && (end || len > 0))
                .ok_or_else(|| bad(format!("list index {v} out of range")))
        };
        let mut items = self.items();
        match (method, args) {
            ("append", [x]) => items.push(x.clone()),
            ("extend", [xs]) => items.extend(xs.try_iter()?),
            ("insert", [i, x]) => {
                let len = items.len();
                let i = index(i, len, true).unwrap_or(if i64::try_from(i.clone())? < 0 {
                    0
                } else {
                    len
                });
                items.insert(i, x.clone());
            }
            ("pop", []) => return items.pop().ok_or_else(|| bad("pop from empty list".into())),
            ("pop", [i]) => {
                let i = index(i, items.len(), false)?;
                return Ok(items.remove(i));
            }
            ("clear", []) => items.clear(),
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        }
        Ok(Value::from(()))
    }
}

/// gpt-oss's template reads an assistant's reasoning from `thinking`, and refuses a call
/// with both a thinking and a content: as llama-server, `reasoning_content` is copied to
/// `thinking`, and a call's content dropped where it has one.
fn harmony_thinking(messages: &mut serde_json::Value) {
    for m in messages.as_array_mut().into_iter().flatten() {
        let Some(m) = m.as_object_mut() else { continue };
        let Some(r) = m
            .get("reasoning_content")
            .filter(|r| r.is_string())
            .cloned()
        else {
            continue;
        };
        m.insert("thinking".into(), r);
        if m.get("tool_calls")
            .and_then(|c| c.as_array())
            .is_some_and(|c| !c.is_empty())
        {
            m.remove("content");
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

/// Runs `f` on a thread of its own with a [`STACK_BYTES`] stack and at most
/// [`crate::render_memory::MAX_RENDER_BYTES`] held at once; a panic in it (minijinja's, on
/// something a template can do) and going over the memory bound are limits, reported without
/// printing the panic.
fn on_big_stack<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> Result<T, TemplateError> + Send + 'static,
) -> Result<T, TemplateError> {
    use crate::render_memory::{run_bounded, RunError};
    let doing = what.to_string();
    let caught = move || {
        crate::quiet_panic::catch(f).unwrap_or_else(|p| {
            Err(TemplateError::limit(format!(
                "the template ({doing}): the template engine panicked: {p}"
            )))
        })
    };
    match run_bounded(
        "chat-template",
        STACK_BYTES,
        crate::render_memory::run_limit(),
        caught,
    ) {
        Ok(r) => r,
        Err(e @ (RunError::Memory | RunError::Exhausted | RunError::Time(_))) => {
            Err(TemplateError::limit(format!("the template ({what}): {e}")))
        }
        Err(e) => Err(TemplateError::new(format!("the template ({what}): {e}"))),
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings the template sees.
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TemplateError> {
        prescan(source)?;
        let owned = generation_blocks(source);
        let env = on_big_stack("compiling it", move || {
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
            // a namespace's lists take Python's `append`/`pop`/... (Kimi K2's templates keep a
            // queue of call ids so)
            env.add_function("namespace", |defaults: Option<Value>| {
                minijinja::functions::namespace(defaults.map(py_lists))
            });
            // Jinja2's `iterable`: `none` is not (minijinja's says it is, and Qwen3-Coder's
            // `tools is iterable and tools | length > 0` then failed on a request without
            // tools); an undefined value is, as in Jinja2
            env.add_test("iterable", |v: Value| !v.is_none() && v.try_iter().is_ok());
            env.add_filter("tojson", tojson);
            // a dict or list printed, or made a string, reads as Python's str() of it (Apriel's
            // template lists its tools with `tool|string`)
            env.add_filter("string", |v: Value| -> std::result::Result<Value, Error> {
                if v.as_str().is_some() {
                    return Ok(v);
                }
                Ok(Value::from(py_str(&v)?))
            });
            env.set_formatter(|out, state, v| {
                if matches!(
                    v.kind(),
                    minijinja::value::ValueKind::Map | minijinja::value::ValueKind::Seq
                ) && v.as_object().is_some()
                {
                    out.write_str(&py_str(v)?).map_err(Error::from)
                } else {
                    minijinja::escape_formatter(out, state, v)
                }
            });
            env.add_filter("indent", indent);
            env.add_filter("replace", |s: String, from: String, to: String| {
                capped_replace(&s, &from, &to).map(Value::from)
            });
            env.set_unknown_method_callback(pycompat);
            env.add_template_owned("chat", owned)
                .map_err(|e| TemplateError::new(e.to_string()))?;
            Ok(env)
        })?;
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
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// Whether the template renders a `tools` variable (function definitions), as the
    /// tool-calling templates of Qwen, Llama 3.1+, Mistral and Hermes do.
    pub fn takes_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Renders a conversation, with `tools` (OpenAI's list of
    /// `{"type": "function", "function": {...}}`) in the template's `tools` variable, under
    /// the limits of this module (fuel, output size, its own stack).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, add_generation_prompt, tools, None)
    }

    /// [`ChatTemplate::render_with_tools`] with more variables in the template's context (a
    /// request's `chat_template_kwargs`, such as Qwen 3's `enable_thinking`); `messages`,
    /// `add_generation_prompt`, `bos_token`, `eos_token` and `tools` take precedence over
    /// variables of the same names.
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        vars: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TemplateError> {
        let vars = jinja_value(&serde_json::Value::Object(
            vars.cloned().unwrap_or_default(),
        ));
        let fuel = RENDER_FUEL
            .saturating_add(RENDER_FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64));
        let mut env = self.env.clone();
        let mut messages = serde_json::to_value(messages)
            .map_err(|e| TemplateError::new(format!("the messages: {e}")))?;
        if self.source.contains("<|channel|>") {
            harmony_thinking(&mut messages);
        }
        let (messages, tools) = (jinja_value(&messages), tools.map(jinja_value));
        let (bos_token, eos_token) = (self.bos_token.clone(), self.eos_token.clone());
        on_big_stack("rendering it", move || {
            env.set_fuel(Some(fuel));
            let tmpl = env
                .get_template("chat")
                .map_err(|e| TemplateError::new(e.to_string()))?;
            let mut out = CappedOutput {
                buf: Vec::new(),
                over: false,
            };
            let r = tmpl.render_captured_to(
                minijinja::context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => bos_token,
                    eos_token => eos_token,
                    tools => tools,
                    ..vars
                },
                &mut out,
            );
            if out.over {
                return Err(TemplateError::limit(format!(
                    "the template's output exceeds {MAX_OUTPUT_BYTES} bytes"
                )));
            }
            match r {
                Ok(_) => String::from_utf8(out.buf)
                    .map_err(|e| TemplateError::new(format!("output is not UTF-8: {e}"))),
                Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TemplateError::limit(format!(
                    "the template ran more than {fuel} instructions ({e})"
                ))),
                Err(e) => Err(TemplateError::new(e.to_string())),
            }
        })
    }
}

/// Output that refuses to grow past [`MAX_OUTPUT_BYTES`].
struct CappedOutput {
    buf: Vec<u8>,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > MAX_OUTPUT_BYTES {
            self.over = true;
            return Err(std::io::Error::other("output too large"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// llama.cpp's built-in chat templates by name (`--chat-template NAME`, as llama-server takes
/// them), written in Jinja after `llm_chat_apply_template` (formats/chat-templates/): for a
/// model whose files carry no template, or a wrong one.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "chatml",
        include_str!("../../../formats/chat-templates/chatml.jinja"),
    ),
    (
        "llama2",
        include_str!("../../../formats/chat-templates/llama2.jinja"),
    ),
    (
        "llama2-sys",
        include_str!("../../../formats/chat-templates/llama2-sys.jinja"),
    ),
    (
        "llama3",
        include_str!("../../../formats/chat-templates/llama3.jinja"),
    ),
    (
        "mistral-v7",
        include_str!("../../../formats/chat-templates/mistral-v7.jinja"),
    ),
    (
        "phi3",
        include_str!("../../../formats/chat-templates/phi3.jinja"),
    ),
    (
        "phi4",
        include_str!("../../../formats/chat-templates/phi4.jinja"),
    ),
    (
        "zephyr",
        include_str!("../../../formats/chat-templates/zephyr.jinja"),
    ),
    (
        "gemma",
        include_str!("../../../formats/chat-templates/gemma.jinja"),
    ),
    (
        "vicuna",
        include_str!("../../../formats/chat-templates/vicuna.jinja"),
    ),
    (
        "deepseek",
        include_str!("../../../formats/chat-templates/deepseek.jinja"),
    ),
    (
        "command-r",
        include_str!("../../../formats/chat-templates/command-r.jinja"),
    ),
];

/// The built-in template called `name` ([`BUILTIN`]).
pub fn builtin(name: &str) -> Option<&'static str> {
    BUILTIN
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, src)| *src)
}

/// Compiles `source` and renders a sample conversation with it: refused when it does not
/// compile, breaks a bound of [`prescan`], or runs into a render limit (fuel, output size,
/// memory, a panic of the template engine) on a four-message conversation. Other render errors are not refusals (a template may
/// `raise_exception` on roles it does not take).
pub fn check(source: &str) -> Result<(), TemplateError> {
    let t = ChatTemplate::new(source, "<s>", "</s>")?;
    let msgs = [
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", "Hello!"),
        Message::new("assistant", "Hi, how can I help?"),
        Message::new("user", "What is 2 + 2?"),
    ];
    match t.render(&msgs, true) {
        Err(e) if e.limit => Err(TemplateError::limit(format!(
            "rendering a four-message conversation: {e}"
        ))),
        _ => Ok(()),
    }
}

/// A JSON value as the template's: numbers as numbers. (Not `Value::from_serialize`: with
/// serde_json's `arbitrary_precision`, which a dependency of the build turns on, a number
/// serializes as a map `{"$serde_json::private::Number": "3"}`, and templates printed that
/// for every number in tools' schemas and calls' arguments.)
fn jinja_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => n
            .as_i64()
            .map(Value::from)
            .or_else(|| n.as_u64().map(Value::from))
            .or_else(|| n.as_f64().map(Value::from))
            .unwrap_or_else(|| Value::from(n.to_string())),
        J::String(s) => Value::from(s.as_str()),
        J::Array(a) => Value::from(a.iter().map(jinja_value).collect::<Vec<_>>()),
        J::Object(m) => m
            .iter()
            .map(|(k, v)| (k.as_str(), jinja_value(v)))
            .collect(),
    }
}

/// Hugging Face's `{% generation %}...{% endgeneration %}` (transformers' extension marking
/// the assistant's tokens for `return_assistant_tokens_mask`; LFM2.5's and Laguna's templates
/// use it) renders its body unchanged: rewritten to `{% if true %}...{% endif %}`, whitespace
/// control kept, before minijinja, which does not know the tag. `{# comments #}` and
/// `{% raw %}` bodies are left alone.
fn generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut raw = false;
    // the next `{%` or `{#`, in one pass over what is left (a `find` of each, when one of
    // them never comes, scanned the whole rest at every tag: 15 s for 40 000 tags)
    let next = |s: &str| {
        (s.as_bytes().windows(2)).position(|w| w[0] == b'{' && matches!(w[1], b'%' | b'#'))
    };
    while let Some(at) = next(rest) {
        if rest[at..].starts_with("{#") {
            let end = rest[at..].find("#}").map_or(rest.len(), |e| at + e + 2);
            out.push_str(&rest[..end]);
            rest = &rest[end..];
            continue;
        }
        let Some(len) = rest[at + 2..].find("%}") else {
            break;
        };
        let inner = &rest[at + 2..at + 2 + len];
        let open = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let body = &inner[open.len()..];
        let close = body
            .strip_suffix(['-', '+'])
            .map_or("", |_| &body[body.len() - 1..]);
        let word = body[..body.len() - close.len()].trim();
        out.push_str(&rest[..at]);
        match word {
            "raw" => raw = true,
            "endraw" => raw = false,
            _ => {}
        }
        let new = match word {
            "generation" if !raw => Some("if true"),
            "endgeneration" if !raw => Some("endif"),
            _ => None,
        };
        match new {
            Some(w) => out.push_str(&format!("{{%{open} {w} {close}%}}")),
            None => out.push_str(&rest[at..at + 4 + len]),
        }
        rest = &rest[at + 4 + len..];
    }
    out.push_str(rest);
    out
}

/// The cheap scan run before minijinja's parser: the source size, and per tag the operator
/// count and bracket nesting (see the module docs). Strings and `{# comments #}` are
/// skipped, as is the body of `{% raw %}`.
pub fn prescan(source: &str) -> Result<(), TemplateError> {
    if source.len() > MAX_SOURCE_BYTES {
        return Err(TemplateError::new(format!(
            "the template has {} bytes, more than the {MAX_SOURCE_BYTES} allowed",
            source.len()
        )));
    }
    let b = source.as_bytes();
    let line = |at: usize| b[..at.min(b.len())].iter().filter(|&&c| c == b'\n').count() + 1;
    let find = |from: usize, pat: &[u8]| {
        b.get(from..)
            .and_then(|rest| rest.windows(pat.len()).position(|w| w == pat))
            .map(|p| from + p)
    };
    let mut elifs = 0usize;
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] != b'{' {
            i += 1;
            continue;
        }
        match b[i + 1] {
            b'#' => i = find(i + 2, b"#}").map_or(b.len(), |j| j + 2),
            kind @ (b'{' | b'%') => {
                let start = i;
                let tag = scan_tag(b, i + 2, kind).map_err(|what| {
                    TemplateError::new(format!(
                        "the tag at line {} has {what}: refused before compiling",
                        line(start)
                    ))
                })?;
                i = tag.end;
                match tag.first_word {
                    Some(b"elif") => {
                        elifs += 1;
                        if elifs > MAX_ELIFS {
                            return Err(TemplateError::new(format!(
                                "more than {MAX_ELIFS} `elif`s (line {}): refused before compiling",
                                line(start)
                            )));
                        }
                    }
                    // the body of `{% raw %}` is text up to `endraw`
                    Some(b"raw") => i = find(i, b"endraw").map_or(b.len(), |j| j + 6),
                    _ => {}
                }
            }
            _ => i += 1,
        }
    }
    Ok(())
}

struct Tag<'a> {
    end: usize,
    first_word: Option<&'a [u8]>,
}

/// Scans one tag from just after its opening `{{`/`{%` to just after its close.
fn scan_tag(b: &[u8], mut i: usize, kind: u8) -> Result<Tag<'_>, String> {
    let (mut ops, mut depth) = (0usize, 0usize);
    let mut first_word = None;
    let mut quote: Option<u8> = None;
    while i < b.len() {
        let c = b[i];
        if let Some(q) = quote {
            if c == b'\\' {
                i += 2;
                continue;
            }
            if c == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        match c {
            b'\'' | b'"' => quote = Some(c),
            b'(' | b'[' | b'{' => {
                depth += 1;
                ops += 1;
                if depth > MAX_NESTING {
                    return Err(format!("brackets nested more than {MAX_NESTING} deep"));
                }
            }
            b')' | b']' => depth = depth.saturating_sub(1),
            b'}' if kind == b'{' && depth == 0 && b.get(i + 1) == Some(&b'}') => {
                return Ok(Tag {
                    end: i + 2,
                    first_word,
                })
            }
            b'}' => depth = depth.saturating_sub(1),
            b'%' if kind == b'%' && b.get(i + 1) == Some(&b'}') => {
                return Ok(Tag {
                    end: i + 2,
                    first_word,
                })
            }
            b'+' | b'-' | b'*' | b'/' | b'%' | b'~' | b'|' | b'.' | b'<' | b'>' | b'=' | b'!' => {
                ops += 1
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                let word = &b[start..i];
                if first_word.is_none() {
                    first_word = Some(word);
                }
                if matches!(
                    word,
                    b"not" | b"and" | b"or" | b"is" | b"in" | b"if" | b"else"
                ) {
                    ops += 1;
                }
                if ops > MAX_TAG_OPERATORS {
                    return Err(format!("more than {MAX_TAG_OPERATORS} operators"));
                }
                continue;
            }
            _ => {}
        }
        if ops > MAX_TAG_OPERATORS {
            return Err(format!("more than {MAX_TAG_OPERATORS} operators"));
        }
        i += 1;
    }
    Ok(Tag {
        end: b.len(),
        first_word,
    })
}

/// `tojson` as Hugging Face defines it for chat templates (Python's `json.dumps` with
/// `ensure_ascii=False`): `", "` and `": "` between items (`",\n"` and indentation with
/// `indent`), keys in their order (`sort_keys` sorts), text as it is. minijinja's own
/// filter writes compact, HTML-escaped JSON, which is not what the models were trained on
/// (function definitions in tool-calling prompts are rendered with it).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    if let Some(n) = indent {
        // one indent per nesting level per line: a width from the template is bounded
        value_cap(n.saturating_mul(1024), "tojson's indent")?;
    }
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
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
    let mut text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if ascii == Some(true) {
        // Python's ensure_ascii: every character past ASCII as \uXXXX (UTF-16 units); in
        // JSON they only occur inside strings
        let mut a = String::with_capacity(text.len());
        for c in text.chars() {
            if c.is_ascii() {
                a.push(c);
            } else {
                for unit in c.encode_utf16(&mut [0; 2]) {
                    a.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
        text = a;
    }
    Ok(Value::from_safe_string(text))
}

/// Python's `str()` of a value: a dict or list as its repr (`{'a': [1, True, None]}`),
/// other values as minijinja writes them (which already spells True/False/None as Python).
fn py_str(v: &Value) -> std::result::Result<String, Error> {
    fn repr(v: &Value, out: &mut String, depth: usize) -> std::result::Result<(), Error> {
        if depth > 64 || out.len() > MAX_VALUE_BYTES {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "a value too deep or too large to print",
            ));
        }
        use minijinja::value::ValueKind as K;
        match v.kind() {
            K::String => {
                let s = v.as_str().unwrap_or_default();
                let q = if s.contains('\'') && !s.contains('"') {
                    '"'
                } else {
                    '\''
                };
                out.push(q);
                for c in s.chars() {
                    match c {
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        '\r' => out.push_str("\\r"),
                        '\t' => out.push_str("\\t"),
                        c if c == q => {
                            out.push('\\');
                            out.push(c);
                        }
                        c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                            out.push_str(&format!("\\x{:02x}", c as u32))
                        }
                        c => out.push(c),
                    }
                }
                out.push(q);
            }
            K::Seq | K::Iterable => {
                out.push('[');
                for (i, item) in v.try_iter()?.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr(&item, out, depth + 1)?;
                }
                out.push(']');
            }
            K::Map => {
                out.push('{');
                for (i, key) in v.try_iter()?.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr(&key, out, depth + 1)?;
                    out.push_str(": ");
                    repr(&v.get_item(&key)?, out, depth + 1)?;
                }
                out.push('}');
            }
            K::Undefined | K::None => out.push_str("None"),
            _ => out.push_str(&v.to_string()),
        }
        Ok(())
    }
    let mut out = String::new();
    repr(v, &mut out, 0)?;
    Ok(out)
}

/// Python's `str.format` for the fields templates use: `{}`, `{0}`, `{name}` (from keyword
/// arguments), `{{`/`}}`; a format spec after `:` is ignored. The result is bounded as other
/// strings are.
fn py_format(s: &str, args: &[Value]) -> std::result::Result<String, Error> {
    let bad = |m: String| Error::new(ErrorKind::InvalidOperation, m);
    let kwargs = args
        .last()
        .filter(|v| v.kind() == minijinja::value::ValueKind::Map);
    let mut out = String::new();
    let mut next = 0;
    let mut rest = s;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if tail.starts_with('}') {
            return Err(bad("str.format: single '}' in the format string".into()));
        }
        let end = tail
            .find('}')
            .ok_or_else(|| bad("str.format: unclosed '{' in the format string".into()))?;
        let field = tail[1..end].split([':', '!']).next().unwrap_or("");
        let v = if field.is_empty() {
            next += 1;
            args.get(next - 1).cloned()
        } else if let Ok(n) = field.parse::<usize>() {
            args.get(n).cloned()
        } else {
            kwargs
                .and_then(|k| k.get_attr(field).ok())
                .filter(|v| !v.is_undefined())
        }
        .ok_or_else(|| bad(format!("str.format: no argument for {{{field}}}")))?
        .to_string();
        out.push_str(&v);
        value_cap(out.len(), "str.format")?;
        rest = &tail[end + 1..];
    }
    out.push_str(rest);
    value_cap(out.len(), "str.format")?;
    Ok(out)
}

/// Refuses a string of `len` bytes past [`MAX_VALUE_BYTES`].
fn value_cap(len: usize, what: &str) -> std::result::Result<(), Error> {
    if len > MAX_VALUE_BYTES {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("{what} would make a string of {len} bytes, more than {MAX_VALUE_BYTES}"),
        ));
    }
    Ok(())
}

/// `str.replace` / the `replace` filter, refusing a result past [`MAX_VALUE_BYTES`] before
/// building it (each match of a long `from` can be replaced by a longer `to`).
fn capped_replace(s: &str, from: &str, to: &str) -> std::result::Result<String, Error> {
    let n = if from.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(from).count()
    };
    let len = n
        .saturating_mul(to.len())
        .saturating_add(s.len().saturating_sub(n.saturating_mul(from.len())));
    value_cap(len, "replace")?;
    Ok(s.replace(from, to))
}

/// minijinja's `indent` (Jinja's: `width` spaces, `first`, `blank`), refusing a result past
/// [`MAX_VALUE_BYTES`] before building it (minijinja's builds `width` spaces, whatever
/// `width` is).
fn indent(
    value: String,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, Error> {
    let width = match width {
        Some(w) => w,
        None => kwargs.get::<Option<usize>>("width")?.unwrap_or(4),
    };
    let first = match first {
        Some(f) => f,
        None => kwargs.get::<Option<bool>>("first")?.unwrap_or(false),
    };
    let blank = match blank {
        Some(b) => b,
        None => kwargs.get::<Option<bool>>("blank")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    fn strip_newline(s: &str) -> &str {
        let s = s.strip_suffix('\n').unwrap_or(s);
        s.strip_suffix('\r').unwrap_or(s)
    }
    let input = strip_newline(&value);
    let lines = input.split('\n').count();
    value_cap(
        lines
            .saturating_mul(width.saturating_add(1))
            .saturating_add(input.len()),
        "indent",
    )?;
    let pad = " ".repeat(width);
    let mut out = String::new();
    let mut it = input.split('\n');
    if !first {
        out.push_str(it.next().unwrap_or_default());
        out.push('\n');
    }
    for line in it {
        if !line.is_empty() || blank {
            out.push_str(&pad);
        }
        out.push_str(line);
        out.push('\n');
    }
    out.truncate(strip_newline(&out).len());
    Ok(Value::from(out))
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
            "format" => Value::from(py_format(s, args)?),
            "startswith" => Value::from(arg_str(0).is_some_and(|p| s.starts_with(&p))),
            "endswith" => Value::from(arg_str(0).is_some_and(|p| s.ends_with(&p))),
            "replace" => match (arg_str(0), arg_str(1)) {
                (Some(a), Some(b)) => Value::from(capped_replace(s, &a, &b)?),
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
                // Python's dict.get: None when the key is missing and no default is given
                Ok(if v.is_undefined() {
                    args.get(1).cloned().unwrap_or(Value::from(()))
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

    /// Numbers in tools, calls' arguments and template variables render as numbers. With
    /// serde_json's `arbitrary_precision` (turned on by gguf-rs where the workspace builds
    /// together) serializing them printed `{"$serde_json::private::Number": "3"}`.
    #[test]
    fn numbers_render_as_numbers() {
        let t = ChatTemplate::new(
            "{{ tools[0].minimum }} {{ tools | tojson }} {{ messages[0].tool_calls[0].function.arguments.days + 1 }} {{ n * 2 }}",
            "",
            "",
        )
        .unwrap();
        let mut m = Message::new("assistant", "");
        m.tool_calls =
            Some(serde_json::json!([{"function": {"name": "f", "arguments": {"days": 3}}}]));
        let vars = serde_json::json!({"n": 1.5});
        let out = t
            .render_with(
                &[m],
                false,
                Some(&serde_json::json!([{"minimum": 1, "big": 18446744073709551615u64}])),
                vars.as_object(),
            )
            .unwrap();
        assert_eq!(
            out,
            "1 [{\"minimum\": 1, \"big\": 18446744073709551615}] 4 3.0"
        );
    }

    /// Jinja2's `iterable` test: `none` is not iterable (Qwen3-Coder's template guards
    /// `tools | length` with it, and a request without tools passes `tools` as none).
    #[test]
    fn none_is_not_iterable() {
        let t = ChatTemplate::new(
            "{% if tools is iterable and tools | length > 0 %}T{% endif %}{{ messages is iterable }}{{ 'ab' is iterable }}{{ nothing is iterable }}",
            "",
            "",
        )
        .unwrap();
        let out = t.render_with(&[], false, None, None).unwrap();
        assert_eq!(out, "TrueTrueTrue");
        let tools = serde_json::json!([{"type": "function"}]);
        assert!(t
            .render_with(&[], false, Some(&tools), None)
            .unwrap()
            .starts_with('T'));
    }

    /// Python's `str.format` (Hunyuan 3's template builds its special tokens with it) and
    /// `tojson(ensure_ascii=True)` (Reka's) as Python gives them.
    #[test]
    fn str_format_and_ascii_json() {
        let t = ChatTemplate::new(
            "{{ '<|a{}|>{0}{{x}}'.format('B') }}|{{ 'x={x}'.format(x=2) }}|{{ {'c': 'Zürich 日'} | tojson(ensure_ascii=True) }}|{{ 'é' | tojson }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[], false).unwrap(),
            "<|aB|>B{x}|x=2|{\"c\": \"Z\\u00fcrich \\u65e5\"}|\"é\""
        );
        let t = ChatTemplate::new("{{ '{}'.format() }}", "", "").unwrap();
        assert!(t.render(&[], false).is_err());
    }

    /// A dict or list printed or passed through `string` reads as Python's `str()` of it
    /// (Apriel's template), and `dict.get` of a missing key is None (Kimi K3's).
    #[test]
    fn python_str_of_values() {
        let t = ChatTemplate::new(
            "{{ tools[0] }}|{{ tools | string }}|{{ tools[0].get('nope') is none }}|{{ 'x' | string }}",
            "",
            "",
        )
        .unwrap();
        let tools =
            serde_json::json!([{"name": "f", "ok": true, "n": null, "q": "it's", "l": [1, 2.5]}]);
        assert_eq!(
            t.render_with(&[], false, Some(&tools), None).unwrap(),
            "{'name': 'f', 'ok': True, 'n': None, 'q': \"it's\", 'l': [1, 2.5]}|[{'name': 'f', 'ok': True, 'n': None, 'q': \"it's\", 'l': [1, 2.5]}]|True|x"
        );
    }

    /// transformers' `{% generation %}` blocks render their body (LFM2.5's template style):
    /// the same text as the template without them, whitespace control kept; `raw` bodies and
    /// comments untouched.
    #[test]
    fn generation_blocks_render_their_body() {
        let with = "{%- for m in messages -%}<{{ m.role }}>\n{%- if m.role == 'assistant' -%}\n  {%- generation -%}\n  {{ m.content }}\n  {%- endgeneration -%}\n{%- else -%}{{ m.content }}{%- endif -%}\n{%- endfor -%}";
        let without = with
            .replace("{%- generation -%}", "")
            .replace("{%- endgeneration -%}", "");
        let msgs = [
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello"),
        ];
        let a = ChatTemplate::new(with, "", "")
            .unwrap()
            .render(&msgs, false)
            .unwrap();
        let b = ChatTemplate::new(&without, "", "")
            .unwrap()
            .render(&msgs, false)
            .unwrap();
        assert_eq!(a, "<user>Hi<assistant>Hello");
        assert_eq!(a, b);
        let t = ChatTemplate::new(
            "{% raw %}{% generation %}{% endraw %}{# {% generation %} #}{%+ generation +%}x{% endgeneration %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "{% generation %}x");
        assert!(ChatTemplate::new("{% generation %}x", "", "").is_err());
    }

    /// A namespace's lists change in place as Python's (Kimi K2's templates queue call ids
    /// so); a loop that grows one without end runs out of fuel, not memory.
    #[test]
    fn namespace_lists_take_python_s_mutating_methods() {
        let t = ChatTemplate::new(
            "{% set q = namespace(ids=[], n=1) %}{% set _ = q.ids.append('a') %}{% set _ = q.ids.append('b') %}{% set _ = q.ids.insert(0, 'z') %}{{ q.ids|length }}{{ q.ids.pop(0) }}{{ q.ids.pop() }}{{ q.ids|tojson }}{% for x in q.ids %}[{{ x }}]{% endfor %}{{ q.ids[-1] }}{% if q.ids %}T{% endif %}{{ q.n }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "3zb[\"a\"][a]aT1");
        let t = ChatTemplate::new(
            "{% set q = namespace(ids=[]) %}{{ q.ids.pop() }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert!(t
            .render(&[], false)
            .unwrap_err()
            .to_string()
            .contains("empty"));
        let t = ChatTemplate::new(
            "{% set q = namespace(l=[]) %}{% for i in range(100000000) %}{% set _ = q.l.append('x' * 1000) %}{% endfor %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert!(t.render(&[], false).is_err());
        // a big list's length, tested in a loop, costs no copy of it
        let t = ChatTemplate::new(
            "{% set q = namespace(l=[]) %}{% for i in range(60000) %}{% set _ = q.l.append(i) %}{% endfor %}{% set n = namespace(s=0) %}{% for i in range(60000) %}{% if q.l %}{% set n.s = n.s + q.l|length %}{% endif %}{% endfor %}{{ n.s }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let t0 = std::time::Instant::now();
        let r = t.render(&[], false);
        assert_eq!(r.unwrap(), "3600000000");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    }

    /// A template that makes minijinja panic on every render (`format` with a precision
    /// Rust's formatter refuses) is refused by `check`, as a limit, like a template that runs
    /// out of fuel (it used to load, print the panic, and fail every request); a render of it
    /// is an error, not a panic.
    #[test]
    fn a_template_that_makes_minijinja_panic_is_refused() {
        let src = r#"{{ bos_token }}{{ "%.999999999f"|format(1.0) }}"#;
        let e = check(src).unwrap_err();
        assert!(e.limit && e.to_string().contains("panicked"), "{e}");
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.render(&[Message::new("user", "hi")], true)
        }));
        let e = r.expect("rendering must not panic").unwrap_err();
        assert!(e.limit && e.to_string().contains("rendering it"), "{e}");
        // the other templates are unaffected
        check(builtin("chatml").unwrap()).unwrap();
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

    /// transformers renders with jinja2's `loopcontrols` (Cohere command-r7b's and Kimi's
    /// templates use `{% break %}`/`{% continue %}`); without minijinja's `loop_controls`
    /// these did not compile.
    #[test]
    fn break_and_continue_render_like_jinja() {
        let src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let msgs = [
            Message::new("system", "s"),
            Message::new("user", "a"),
            Message::new("assistant", "b"),
            Message::new("user", "c"),
        ];
        // jinja2 with loopcontrols: index 1 skipped, 2 and 3 printed, 4 breaks
        assert_eq!(t.render(&msgs, false).unwrap(), "[a][b]");
        assert!(check(src).is_ok());
    }

    fn refused(src: &str, what: &str) {
        let e = ChatTemplate::new(src, "", "")
            .err()
            .unwrap_or_else(|| panic!("compiled: {}", &src[..src.len().min(60)]));
        assert!(e.to_string().contains(what), "{e}");
        assert!(check(src).is_err());
    }

    /// Each of these overflowed the stack (an abort) in minijinja's parser, code generator
    /// or AST drop: refused by the scan before the parser sees them.
    #[test]
    fn deep_expressions_are_refused_before_the_parser() {
        refused(
            &format!("{{{{ 1{} }}}}", " + 1".repeat(20_000)),
            "operators",
        );
        refused(
            &format!("{{{{ 'a'{} }}}}", "|upper".repeat(20_000)),
            "operators",
        );
        refused(&format!("{{{{ x{} }}}}", ".y".repeat(20_000)), "operators");
        refused(&format!("{{{{ {}1 }}}}", "- ".repeat(20_000)), "operators");
        refused(
            &format!("{{{{ {}1 }}}}", "not ".repeat(20_000)),
            "operators",
        );
        refused(
            &format!("{{{{ {}1{} }}}}", "(".repeat(10_000), ")".repeat(10_000)),
            "nested",
        );
        refused(
            &format!("{{{{ {}1{} }}}}", "[".repeat(10_000), "]".repeat(10_000)),
            "nested",
        );
        refused(
            &format!(
                "{{% if x %}}{}{{% endif %}}",
                "{% elif x %}a".repeat(20_000)
            ),
            "elif",
        );
        refused(&" ".repeat(MAX_SOURCE_BYTES + 1), "bytes");
    }

    /// Deeply nested blocks run into the parser's own recursion guard: an error, no abort.
    #[test]
    fn deeply_nested_blocks_are_an_error() {
        let src = format!(
            "{}x{}",
            "{% if true %}".repeat(20_000),
            "{% endif %}".repeat(20_000)
        );
        assert!(ChatTemplate::new(&src, "", "").is_err());
        let src = format!(
            "{}x{}",
            "{% for a in b %}".repeat(20_000),
            "{% endfor %}".repeat(20_000)
        );
        assert!(check(&src).is_err());
    }

    /// Strings, comments and `raw` bodies are not counted: a long prompt text in a string
    /// literal, or operators in text, are not refused.
    #[test]
    fn the_scan_skips_strings_comments_and_raw() {
        let long = "a + b | c . ".repeat(5_000);
        let src = format!(
            "{{{{ '{long}' }}}}{{# {long} #}}{{% raw %}}{{{{ {long} }}}}{{% endraw %}}{long}{{{{ \"{{{{\" ~ 'x' }}}}"
        );
        let t = ChatTemplate::new(&src, "", "").unwrap();
        assert!(t.render(&[], false).unwrap().starts_with("a + b"));
    }

    /// A render that would never end runs out of fuel: an error naming the limit.
    #[test]
    fn endless_loops_run_out_of_fuel() {
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let e = t.render(&[Message::new("user", "hi")], true).unwrap_err();
        assert!(e.limit && e.to_string().contains("instructions"), "{e}");
        let e = check(src).unwrap_err();
        assert!(e.limit, "{e}");
    }

    /// Regression (issue 33, item 10b): a template that doubles a string (`~`, `+`) or a
    /// list in a loop took 7 GB on one chat request. The render is stopped at the memory
    /// bound (an error naming it, a limit: `check` refuses the template), and templates
    /// render as before afterwards.
    #[test]
    fn doubling_values_stop_at_the_memory_bound() {
        assert!(
            crate::render_memory::bounded(),
            "the test binary installs the allocator"
        );
        for src in [
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
            "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
        ] {
            let t = ChatTemplate::new(src, "", "").unwrap();
            let e = t.render(&[Message::new("user", "hi")], true).unwrap_err();
            assert!(e.limit && e.to_string().contains("MiB"), "{src}: {e}");
        }
        // (the check refuses it: a limit on the sample conversation)
        let src = "{% set ns = namespace(s='ab') %}{% for m in messages %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endfor %}";
        assert!(check(src).unwrap_err().limit);
        // growing to just under the bound is fine (2^22 bytes)
        let t = ChatTemplate::new(
            "{% set ns = namespace(s='x') %}{% for i in range(22) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[], true).unwrap(), "4194304");
    }

    /// Output past the cap stops the render (it grew without bound before).
    #[test]
    fn output_is_capped() {
        let src = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let e = t.render(&[], true).unwrap_err();
        assert!(e.limit && e.to_string().contains("output"), "{e}");
        assert!(check(src).is_err());
    }

    /// A width or count from the template cannot make one filter or method allocate without
    /// bound (minijinja's `indent` built `width` spaces: `indent(10**12)` aborted).
    #[test]
    fn filter_widths_and_replacements_are_capped() {
        for src in [
            "{{ 'a\nb' | indent(1000000000000) }}",
            "{{ 'a\nb' | indent(width=1000000000000) }}",
            "{{ messages | tojson(indent=1000000000000) }}",
            "{{ ('a' * 100000) | replace('a', 'b' * 100000) }}",
            "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
        ] {
            let t = ChatTemplate::new(src, "", "").unwrap();
            let e = t.render(&[Message::new("user", "hi")], true).unwrap_err();
            assert!(e.to_string().contains("more than"), "{src}: {e}");
        }
        // and they still work like Jinja's
        let t = ChatTemplate::new(
            "{{ 'a\n\nb\n' | indent(2) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a\n\nb' | indent(width=1, blank=true) }}|{{ 'abca' | replace('a', 'xy') }}|{{ 'abca'.replace('a', '') }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[], false).unwrap(),
            "a\n\n  b|  a\n  b|a\n \n b|xybcxy|bc"
        );
    }

    /// A template built value nested as deep as fuel allows prints and drops on the render
    /// thread's own stack, without overflowing it.
    #[test]
    fn deeply_nested_values_do_not_overflow_the_stack() {
        let src = "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|length }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "1");
    }

    /// Real templates pass the check (and a template raising on the sample's roles is not
    /// refused for it).
    #[test]
    fn real_templates_pass_the_check() {
        check(SMOLLM2).unwrap();
        check("{{ raise_exception('System role not supported') }}").unwrap();
        for family in ["gemma2", "gemma3", "llama", "phi3", "qwen3"] {
            if let Some(src) = crate::arch::family(family).and_then(|f| f.chat_template.clone()) {
                check(&src).unwrap_or_else(|e| panic!("{family}: {e}"));
            }
        }
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
