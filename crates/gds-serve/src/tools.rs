//! Tool calling: the request's `tools` and `tool_choice` are checked here, rendered by the
//! model's own chat template (its `tools` variable), and the model's tool-call syntax is
//! parsed back into OpenAI `tool_calls`. With `tool_choice` `required` or a named function
//! the reply is constrained (a Lark grammar over the functions' JSON schemas) to be calls
//! in the template's syntax with valid arguments.
//!
//! Syntaxes, told apart by the template's source: Hermes / Qwen (`<tool_call>{"name": ...,
//! "arguments": {...}}</tool_call>`, one block per call), Qwen3-Coder's XML
//! (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`:
//! Qwen3-Coder, Qwen 3.5, Nemotron 3, StepFun 3.5; Seed-OSS inside `<seed:tool_call>`), GLM
//! 4.5+ (`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>`;
//! Hunyuan 3 the same with its own tags, [`HUNYUAN`]),
//! MiniMax M2 (`<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n</invoke>\n</minimax:tool_call>`),
//! Llama 3.1+ (a JSON object `{"name": ..., "parameters": {...}}`, optionally after
//! `<|python_tag|>`, calls separated by `;`), Mistral (`[TOOL_CALLS]` then a JSON array of
//! `{"name", "arguments"}`) and Mistral's later form (`[TOOL_CALLS]NAME[ARGS]{...}` per call:
//! Mistral Small 3.2, Devstral, Ministral 3, Magistral). In the XML forms a value is text
//! where the parameter's schema says string, JSON otherwise (as the templates render them).

use crate::error::bad;
use crate::error::ApiError;
use gds_runtime::chat::ChatTemplate;
use gds_runtime::Grammar;
use serde_json::{json, Value};

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syntax {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes).
    Hermes,
    /// Qwen3-Coder's XML inside `open`...`close` (`<tool_call>`, Seed-OSS's
    /// `<seed:tool_call>`).
    Xml {
        open: &'static str,
        close: &'static str,
    },
    /// `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>` (GLM),
    /// and the same form with other tags ([`KvTags`]: Hunyuan 3's).
    Glm(&'static KvTags),
    /// `<minimax:tool_call>` around `<invoke name="NAME">` blocks (MiniMax M2).
    MiniMax,
    /// DeepSeek V3.2's and V4's DSML: MiniMax's blocks with `｜DSML｜` in every tag and a
    /// `string="true|false"` attribute on each parameter, inside `open`...`close`
    /// (`<｜DSML｜function_calls>`, V4's `<｜DSML｜tool_calls>`).
    Dsml {
        open: &'static str,
        close: &'static str,
    },
    /// `{"name": ..., "parameters": {...}}` (Llama 3.1+).
    Llama3,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (Mistral).
    Mistral,
    /// `[TOOL_CALLS]NAME[ARGS]{...}` per call (Mistral's tokenizer v11 and later).
    MistralArgs,
    /// gpt-oss's harmony messages to `functions.NAME`, as [`crate::harmony::Channels`]
    /// writes them into the answer.
    Harmony,
    /// `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>` per call (Gemma 4), its values in
    /// Gemma's notation: strings between `<|"|>` marks, keys bare.
    Gemma4,
    /// A JSON list of calls after `open` and up to `close` (`""`: the reply's end), each an
    /// object with the function's name under `name` and its arguments under `args` (`name`
    /// `""`: `{NAME: ARGS}`): Granite 3.3 (`<|tool_call|>[{"name", "arguments"}]`), Nemotron
    /// Nano v2 (`<TOOLCALL>`...`</TOOLCALL>`), Command R7B (`<|START_ACTION|>[{"tool_call_id",
    /// "tool_name", "parameters"}]<|END_ACTION|>`), Apertus (`<|tools_prefix|>[{NAME:
    /// ARGS}]<|tools_suffix|>`), Apriel 1.5/1.6 (`<tool_calls>[...]</tool_calls>`), FireFunction
    /// v2 (`functools[...]`).
    JsonList {
        open: &'static str,
        close: &'static str,
        name: &'static str,
        args: &'static str,
    },
    /// `<|tool_call_start|>[NAME(key="value", n=1), ...]<|tool_call_end|>`: Python calls with
    /// keyword arguments (LFM2, LFM2.5), Python's literals or JSON's.
    Python,
    /// `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:N
    /// <|tool_call_argument_begin|>{...}<|tool_call_end|>` (Kimi K2; the call's id is
    /// `functions.NAME:N`, which its template renders back).
    Kimi,
}

impl Syntax {
    /// The syntax a chat template that takes `tools` teaches its model, if one we know.
    pub fn of_template(src: &str) -> Option<Syntax> {
        let src = &*gds_runtime::reasoning::template_text(src);
        let has = |s: &str| src.contains(s);
        Some(if crate::harmony::is_harmony(src) {
            Syntax::Harmony
        } else if has(DSML) && has("function_calls") {
            Syntax::Dsml {
                open: "<｜DSML｜function_calls>",
                close: "</｜DSML｜function_calls>",
            }
        } else if has(DSML) {
            Syntax::Dsml {
                open: "<｜DSML｜tool_calls>",
                close: "</｜DSML｜tool_calls>",
            }
        } else if has("<|tool_call>call:") {
            Syntax::Gemma4
        } else if has("<minimax:tool_call>") {
            Syntax::MiniMax
        } else if has("<seed:tool_call>") && has("<function=") {
            Syntax::Xml {
                open: "<seed:tool_call>",
                close: "</seed:tool_call>",
            }
        } else if has(KIMI_OPEN) {
            Syntax::Kimi
        } else if has("<|tool_list_start|>") || has("List of tools: [") {
            Syntax::Python
        } else if has("<|START_ACTION|>") {
            Syntax::JsonList {
                open: "<|START_ACTION|>",
                close: "<|END_ACTION|>",
                name: "tool_name",
                args: "parameters",
            }
        } else if has("<TOOLCALL>") {
            Syntax::JsonList {
                open: "<TOOLCALL>",
                close: "</TOOLCALL>",
                name: "name",
                args: "arguments",
            }
        } else if has("<|tools_prefix|>") {
            Syntax::JsonList {
                open: "<|tools_prefix|>",
                close: "<|tools_suffix|>",
                name: "",
                args: "",
            }
        } else if has("<tool_calls>[") {
            // Apriel 1.5 and 1.6
            Syntax::JsonList {
                open: "<tool_calls>",
                close: "</tool_calls>",
                name: "name",
                args: "arguments",
            }
        } else if has("functools[") {
            // FireFunction v2: ` functools[{...}, ...]` to the reply's end
            Syntax::JsonList {
                open: "functools",
                close: "",
                name: "name",
                args: "arguments",
            }
        } else if has("<|tool_call|>") && !has("<|/tool_call|>") {
            Syntax::JsonList {
                open: "<|tool_call|>",
                close: "",
                name: "name",
                args: "arguments",
            }
        } else if has(HUNYUAN.sep) && has(HUNYUAN.key_open) && has(HUNYUAN.calls_open) {
            Syntax::Glm(&HUNYUAN)
        } else if has("<tool_call>") && has("<function=") {
            Syntax::Xml {
                open: "<tool_call>",
                close: "</tool_call>",
            }
        } else if has("<tool_call>") && has("<arg_key>") {
            Syntax::Glm(&GLM)
        } else if has("<tool_call>") {
            Syntax::Hermes
        } else if has("[TOOL_CALLS]") && has("[ARGS]") {
            Syntax::MistralArgs
        } else if has("[TOOL_CALLS]") {
            Syntax::Mistral
        } else if has("<|python_tag|>") || has("ipython") {
            Syntax::Llama3
        } else {
            return None;
        })
    }

    /// The key of a call's arguments object.
    fn args_key(self) -> &'static str {
        match self {
            Syntax::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// The tag a call starts with, where text may come before it (`None`: the calls are the
    /// whole reply).
    fn open_tag(self) -> Option<&'static str> {
        match self {
            Syntax::Hermes => Some("<tool_call>"),
            Syntax::Glm(t) => Some(t.open()),
            Syntax::Xml { open, .. } => Some(open),
            Syntax::MiniMax => Some("<minimax:tool_call>"),
            Syntax::Dsml { open, .. } => Some(open),
            Syntax::MistralArgs => Some("[TOOL_CALLS]"),
            Syntax::Harmony => Some(crate::harmony::CALL_OPEN),
            Syntax::Gemma4 => Some(GEMMA_OPEN),
            Syntax::JsonList { open, .. } => Some(open),
            Syntax::Python => Some(PY_OPEN),
            Syntax::Kimi => Some(KIMI_OPEN),
            Syntax::Llama3 | Syntax::Mistral => None,
        }
    }

    /// The texts of the syntax's markers: where a model's vocabulary has them as special
    /// tokens, the reply's text keeps them (its decoding drops other special tokens).
    pub fn markers(self) -> Vec<&'static str> {
        match self {
            Syntax::Hermes => vec!["<tool_call>", "</tool_call>"],
            Syntax::Xml { open, close } => vec![open, close],
            Syntax::Glm(t) => [
                t.calls_open,
                t.calls_close,
                t.call_open,
                t.call_close,
                t.sep,
                t.key_open,
                t.key_close,
                t.value_open,
                t.value_close,
            ]
            .into_iter()
            .filter(|m| !m.is_empty())
            .collect(),
            Syntax::MiniMax => vec!["<minimax:tool_call>", "</minimax:tool_call>"],
            Syntax::Dsml { open, close } => vec![DSML, open, close],
            Syntax::Llama3 => vec!["<|python_tag|>"],
            Syntax::Mistral => vec!["[TOOL_CALLS]"],
            Syntax::MistralArgs => vec!["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            Syntax::Harmony => crate::harmony::MARKERS.to_vec(),
            Syntax::Gemma4 => vec!["<|tool_call>", GEMMA_CLOSE, GEMMA_QUOTE],
            Syntax::JsonList { open, close, .. } => vec![open, close],
            Syntax::Python => vec![PY_OPEN, PY_CLOSE],
            Syntax::Kimi => vec![KIMI_OPEN, KIMI_CLOSE, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END],
        }
    }
}

/// The tags of GLM's call form: per call the opening tag, the function's name, a separator,
/// then per argument a key and a value between their tags, and the closing tag; the calls of
/// one reply inside a wrapper where `calls_open` is not empty.
#[derive(Debug, PartialEq, Eq)]
pub struct KvTags {
    pub calls_open: &'static str,
    pub calls_close: &'static str,
    pub call_open: &'static str,
    pub call_close: &'static str,
    pub sep: &'static str,
    pub key_open: &'static str,
    pub key_close: &'static str,
    pub value_open: &'static str,
    pub value_close: &'static str,
}

impl KvTags {
    /// The tag a reply's calls start with.
    fn open(&self) -> &'static str {
        if self.calls_open.is_empty() {
            self.call_open
        } else {
            self.calls_open
        }
    }
}

/// GLM 4.5+: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>`.
pub const GLM: KvTags = KvTags {
    calls_open: "",
    calls_close: "",
    call_open: "<tool_call>",
    call_close: "</tool_call>",
    sep: "",
    key_open: "<arg_key>",
    key_close: "</arg_key>",
    value_open: "<arg_value>",
    value_close: "</arg_value>",
};

/// Hunyuan 3 (Hy3): GLM's form with `:opensource` in every tag, a `<tool_sep…>` after the
/// name, the calls inside `<tool_calls…>`.
pub const HUNYUAN: KvTags = KvTags {
    calls_open: "<tool_calls:opensource>",
    calls_close: "</tool_calls:opensource>",
    call_open: "<tool_call:opensource>",
    call_close: "</tool_call:opensource>",
    sep: "<tool_sep:opensource>",
    key_open: "<arg_key:opensource>",
    key_close: "</arg_key:opensource>",
    value_open: "<arg_value:opensource>",
    value_close: "</arg_value:opensource>",
};

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The model does not call tools (nothing is parsed).
    None,
    /// The model decides; calls in its reply are parsed.
    Auto,
    /// The reply is one or more calls (constrained).
    Required,
    /// The reply is a call of this function (constrained).
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug)]
pub struct Tools {
    /// The list as the client sent it, for the template's `tools` variable, each function
    /// with a `description` (`""` when the client left it out, as llama-server: templates
    /// such as Hermes 2 Pro's and Functionary's concatenate it into their prompt).
    pub list: Value,
    /// Function names and their parameter schemas.
    functions: Vec<(String, Value)>,
    /// The template's syntax.
    pub syntax: Syntax,
    /// `tool_choice`.
    pub choice: Choice,
    /// `parallel_tool_calls` (default true): more than one call per reply.
    parallel: bool,
}

/// Most functions a request may offer (OpenAI's documented limit): the list is rendered into
/// every prompt and compiled into the grammar of calls, whose cost grows with it.
pub const MAX_TOOLS: usize = 128;

impl Tools {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls` against the model's chat
    /// template. `None` when the request has no tools.
    pub fn from_request(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel: Option<bool>,
        template: Option<&ChatTemplate>,
    ) -> Result<Option<Tools>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(v @ Value::Array(_)) => Some(v.clone()),
            Some(_) => return Err(bad("tools must be a list of functions", "tools")),
        };
        let choice = match tool_choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(bad(
                        format!("tool_choice {other:?} is not none, auto, required or a function"),
                        "tool_choice",
                    ))
                }
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    Choice::Named(name.to_string())
                }
                _ => {
                    return Err(bad(
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice",
                    ))
                }
            },
        };
        let Some(list) = list else {
            return match choice {
                Choice::None | Choice::Auto => Ok(None),
                _ => Err(bad(
                    "tool_choice asks for a call but there are no tools",
                    "tool_choice",
                )),
            };
        };
        let all = list.as_array().map_or(&[][..], Vec::as_slice);
        if all.len() > MAX_TOOLS {
            return Err(bad(
                format!(
                    "{} tools: at most {MAX_TOOLS} are supported (OpenAI's limit)",
                    all.len()
                ),
                "tools",
            ));
        }
        let mut functions = Vec::new();
        let mut names = std::collections::HashSet::new();
        for t in all {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    "each tool must be {\"type\": \"function\", \"function\": {...}}",
                    "tools",
                ));
            }
            let name = t
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|n| {
                    !n.is_empty()
                        && n.len() <= 64
                        && n.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                })
                .ok_or_else(|| {
                    bad(
                        "each function needs a name of 1 to 64 letters, digits, _ or -",
                        "tools",
                    )
                })?;
            let mut params = match t.pointer("/function/parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => {
                    return Err(bad(
                        format!("the parameters of {name} must be a JSON schema"),
                        "tools",
                    ))
                }
            };
            // arguments are an object (OpenAI's and Anthropic's rule): a call of another
            // type would reach the client as arguments that are not an object's JSON
            match params.get("type") {
                None => {}
                Some(Value::String(t)) if t == "object" => {}
                Some(other) => {
                    return Err(bad(
                        format!(
                            "invalid schema for function {name}: its parameters must be an object schema (\"type\": \"object\"), not \"type\": {other}"
                        ),
                        "tools",
                    ))
                }
            }
            // an object with `properties` takes no other keys unless it says so, as in
            // `response_format` (a small model held only to "at least these keys" invents
            // more: OpenAI's strict mode and llama.cpp's converter close them too)
            gds_runtime::constraint::close_objects(&mut params);
            if !names.insert(name) {
                return Err(bad(format!("function {name} is defined twice"), "tools"));
            }
            functions.push((name.to_string(), params));
        }
        if let Choice::Named(n) = &choice {
            if !functions.iter().any(|(f, _)| f == n) {
                return Err(bad(
                    format!("tool_choice names {n}, which is not in tools"),
                    "tool_choice",
                ));
            }
        }
        // `tool_choice: "none"` asks for no call: where the template cannot show the tools
        // (or gdsrun cannot parse its calls), the tools are left out instead of refused
        // (clients that always send their tools, with calls off, still work)
        let usable =
            template.is_some_and(|t| t.takes_tools() && Syntax::of_template(t.source()).is_some());
        if choice == Choice::None && !usable {
            return Ok(None);
        }
        let template = template.ok_or_else(|| {
            bad(
                "this model has no chat template, so it cannot be given tools",
                "tools",
            )
        })?;
        if !template.takes_tools() {
            return Err(bad(
                "this model's chat template does not take tools (it never renders a `tools` variable)",
                "tools",
            ));
        }
        let syntax = Syntax::of_template(template.source()).ok_or_else(|| {
            bad(
                "this model's chat template takes tools, but in a tool-call syntax gdsrun does not parse (docs/serving.md lists the syntaxes it parses)",
                "tools",
            )
        })?;
        let mut list = list;
        for t in list.as_array_mut().into_iter().flatten() {
            if let Some(Value::Object(f)) = t.get_mut("function") {
                if f.get("description").is_none_or(Value::is_null) {
                    // after the name, where llama-server puts it
                    let old = std::mem::take(f);
                    for (k, v) in old {
                        let name = k == "name";
                        if k != "description" {
                            f.insert(k, v);
                        }
                        if name {
                            f.insert("description".into(), json!(""));
                        }
                    }
                }
            }
        }
        Ok(Some(Tools {
            list,
            functions,
            syntax,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Function names and their parameter schemas (closed as the call grammar uses them).
    pub fn functions(&self) -> &[(String, Value)] {
        &self.functions
    }

    /// Whether replies are parsed for calls.
    pub fn parses(&self) -> bool {
        self.choice != Choice::None
    }

    /// The grammar a reply follows: the call grammar when `tool_choice` asks for a call
    /// ([`Tools::grammar`]), which cannot be combined with another constraint (`other`: the
    /// name of the one the request also has, if any); otherwise `None` (the other one, if
    /// any, stays).
    pub fn call_grammar_beside(&self, other: Option<&str>) -> Result<Option<Grammar>, ApiError> {
        let g = self.grammar()?;
        if let (Some(_), Some(other)) = (&g, other) {
            return Err(bad(
                format!("tool_choice asks for a call; it cannot be combined with {other}"),
                "tool_choice",
            ));
        }
        Ok(g)
    }

    /// With `required` or a named function: the grammar the reply must follow.
    pub fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        let names: Vec<&(String, Value)> = match &self.choice {
            Choice::None | Choice::Auto => return Ok(None),
            Choice::Required => self.functions.iter().collect(),
            Choice::Named(n) => self.functions.iter().filter(|(f, _)| f == n).collect(),
        };
        let many = self.parallel && matches!(self.choice, Choice::Required);
        let (sep, call) = match self.syntax {
            Syntax::Mistral => {
                return Err(bad(
                    "tool_choice required or a named function is not supported for Mistral's [TOOL_CALLS] syntax; use auto",
                    "tool_choice",
                ))
            }
            Syntax::Xml { .. } | Syntax::Glm(_) | Syntax::MiniMax | Syntax::Dsml { .. } => {
                return Ok(Some(Grammar::Lark(self.tagged_grammar(&names, many))))
            }
            Syntax::Gemma4 => {
                return Ok(Some(Grammar::Lark(kv_grammar(
                    &names,
                    many,
                    &KvNotation::gemma(),
                ))))
            }
            Syntax::Kimi => {
                let calls = json_calls(
                    &names,
                    |name| {
                        format!(
                            "{} /[0-9]{{1,3}}/ {}",
                            lark_str(&format!("{KIMI_CALL}functions.{name}:")),
                            lark_str(KIMI_ARGS)
                        )
                    },
                    &lark_str(KIMI_CALL_END),
                );
                let many = if many { "tc+" } else { "tc" };
                return Ok(Some(Grammar::Lark(format!(
                    "start: {} {many} {}\n{calls}",
                    lark_str(KIMI_OPEN),
                    lark_str(KIMI_CLOSE)
                ))));
            }
            Syntax::Python => {
                return Ok(Some(Grammar::Lark(kv_grammar(
                    &names,
                    many,
                    &KvNotation::python(),
                ))))
            }
            Syntax::JsonList {
                open,
                close,
                name,
                args,
            } => {
                let calls: Vec<Value> = names
                    .iter()
                    .map(|(f, params)| {
                        let mut props = serde_json::Map::new();
                        if name.is_empty() {
                            props.insert(f.clone(), params.clone());
                        } else {
                            if name == "tool_name" {
                                // Command R7B numbers its calls
                                props.insert(
                                    "tool_call_id".into(),
                                    json!({"type": "string", "pattern": "^[0-9]{1,4}$"}),
                                );
                            }
                            props.insert(name.into(), json!({"const": f}));
                            props.insert(args.into(), params.clone());
                        }
                        let required: Vec<&String> = props.keys().collect();
                        json!({"type": "object", "properties": props, "required": required,
                            "additionalProperties": false})
                    })
                    .collect();
                let schema = any_call(calls);
                let list = if many {
                    "\"[\" call (\", \" call)* \"]\""
                } else {
                    "\"[\" call \"]\""
                };
                return Ok(Some(Grammar::Lark(format!(
                    "start: {} {list} {}\ncall: %json {schema}\n",
                    lark_str(open),
                    if close.is_empty() {
                        String::new()
                    } else {
                        lark_str(close)
                    }
                ))));
            }
            Syntax::Harmony => {
                // one call a reply (`<|call|>` ends generation), after any analysis
                // (`Reasoning::after_thinking`)
                let calls = json_calls(
                    &names,
                    |name| {
                        lark_str(&format!(
                            "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                        ))
                    },
                    "",
                );
                return Ok(Some(Grammar::Lark(format!("start: tc\n{calls}"))));
            }
            Syntax::Hermes => ("\"\\n\"", "\"<tool_call>\\n\" call \"\\n</tool_call>\""),
            Syntax::Llama3 => ("\"; \"", "call"),
            Syntax::MistralArgs => ("\"\"", "call"),
        };
        let key = self.syntax.args_key();
        let calls: Vec<Value> = names
            .iter()
            .map(|(name, params)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, key: params},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let start = if many {
            format!("start: tc ({sep} tc)*\n")
        } else {
            "start: tc\n".to_string()
        };
        if self.syntax == Syntax::MistralArgs {
            // NAME[ARGS]{...}: one alternative per function, its arguments' schema
            let calls = json_calls(
                &names,
                |name| lark_str(&format!("[TOOL_CALLS]{name}[ARGS]")),
                "",
            );
            return Ok(Some(Grammar::Lark(format!("{start}{calls}"))));
        }
        let schema = any_call(calls);
        Ok(Some(Grammar::Lark(format!(
            "{start}tc: {call}\ncall: %json {schema}\n"
        ))))
    }

    /// The grammar of calls in the tagged forms (Qwen3-Coder's XML, GLM's, MiniMax's): per
    /// function its tags and name, then its parameters in the schema's order (the required
    /// ones always, the others optional), each a text up to the closing tag where the schema
    /// says string, a JSON value of the parameter's schema otherwise.
    fn tagged_grammar(&self, names: &[&(String, Value)], many: bool) -> String {
        type Tag<'a> = Box<dyn Fn(&str) -> String + 'a>;
        type Param<'a> = Box<dyn Fn(&str, bool) -> String + 'a>;
        // the opening tag (`open_tag`) is written in before each call, except where the calls
        // are inside a wrapper (Hunyuan 3's `<tool_calls…>`: `wrap`)
        let mut open = self.syntax.open_tag().unwrap_or_default();
        let mut wrap = None;
        let (call_open, call_close, p_open, p_close): (Tag, String, Param, String) = match self
            .syntax
        {
            Syntax::Xml { close, .. } => (
                Box::new(|n| format!("\n<function={n}>\n")),
                format!("</function>\n{close}"),
                Box::new(|k, _| format!("<parameter={k}>\n")),
                "\n</parameter>\n".into(),
            ),
            Syntax::Glm(t) => {
                let call = if t.calls_open.is_empty() {
                    ""
                } else {
                    open = "";
                    wrap = Some((format!("{}\n", t.calls_open), t.calls_close));
                    t.call_open
                };
                (
                    Box::new(move |n| format!("{call}{n}{}\n", t.sep)),
                    format!(
                        "{}{}",
                        t.call_close,
                        if call.is_empty() { "" } else { "\n" }
                    ),
                    Box::new(|k, _| format!("{}{k}{}\n{}", t.key_open, t.key_close, t.value_open)),
                    format!("{}\n", t.value_close),
                )
            }
            Syntax::Dsml { close, .. } => (
                Box::new(|n| format!("\n<｜DSML｜invoke name=\"{n}\">\n")),
                format!("</｜DSML｜invoke>\n{close}"),
                Box::new(|k, s| format!("<｜DSML｜parameter name=\"{k}\" string=\"{s}\">")),
                "</｜DSML｜parameter>\n".into(),
            ),
            _ => (
                Box::new(|n| format!("\n<invoke name=\"{n}\">\n")),
                "</invoke>\n</minimax:tool_call>".into(),
                Box::new(|k, _| format!("<parameter name=\"{k}\">")),
                "</parameter>\n".into(),
            ),
        };
        let p_close = p_close.as_str();
        let alts: Vec<String> = (0..names.len()).map(|i| format!("f{i}")).collect();
        let mut g = match (&wrap, many) {
            (Some((head, tail)), many) => format!(
                "start: {} tc{} {}\n",
                lark_str(head),
                if many { "+" } else { "" },
                lark_str(tail)
            ),
            (None, true) => "start: tc (\"\\n\" tc)*\n".to_string(),
            (None, false) => "start: tc\n".to_string(),
        };
        g.push_str(&format!("tc: {}\n", alts.join(" | ")));
        for (i, (name, params)) in names.iter().enumerate() {
            let (props, required) = params_of(params);
            let mut body = vec![lark_str(&format!("{open}{}", call_open(name)))];
            for (j, (key, schema)) in props.into_iter().enumerate() {
                let rule = format!("f{i}p{j}");
                let head = lark_str(&p_open(key, is_string(Some(schema))));
                if is_string(Some(schema)) {
                    // text, up to the first closing tag (which ends it)
                    g.push_str(&format!("{rule}: {head} {rule}v\n"));
                    g.push_str(&string_rule(&format!("{rule}v"), schema, "", p_close));
                } else {
                    g.push_str(&format!(
                        "{rule}: {head} %json {} {}\n",
                        compact(schema),
                        lark_str(p_close)
                    ));
                }
                let opt = if required.contains(&key.as_str()) {
                    ""
                } else {
                    "?"
                };
                body.push(format!("{rule}{opt}"));
            }
            body.push(lark_str(&call_close));
            g.push_str(&format!("f{i}: {}\n", body.join(" ")));
        }
        g
    }

    /// The schema of `function`'s parameter `key`, if it declares one.
    fn param_schema(&self, function: &str, key: &str) -> Option<&Value> {
        self.functions
            .iter()
            .find(|(f, _)| f == function)?
            .1
            .pointer(&format!(
                "/properties/{}",
                key.replace('~', "~0").replace('/', "~1")
            ))
    }

    /// For streaming: of `held` (the reply's text not sent yet), how many bytes are surely
    /// content, and whether a call may start right after them (then the rest of the reply
    /// is held to the end). Tagged forms: text up to the call's opening tag, a partial tag at
    /// the end held back; Llama 3 and Mistral, whose calls are the whole reply: held while
    /// the reply may still start a call, all text once it cannot (`plain` remembers that).
    pub fn stream_cut(&self, held: &str, plain: &mut bool) -> (usize, bool) {
        if let Some(tag) = self.syntax.open_tag() {
            if let Some(at) = held.find(tag) {
                return (at, true);
            }
            return (held.len() - partial_tag(held, tag), false);
        }
        if *plain {
            return (held.len(), false);
        }
        let starts: &[&str] = match self.syntax {
            Syntax::Llama3 => &["{", "<|python_tag|>"],
            _ => &["[TOOL_CALLS]", "["],
        };
        let t = held.trim_start();
        if t.is_empty() || starts.iter().any(|s| s.starts_with(t)) {
            (0, false)
        } else if starts.iter().any(|s| t.starts_with(s)) {
            (0, true)
        } else {
            *plain = true;
            (held.len(), false)
        }
    }

    /// The calls in a reply, in OpenAI's form, and the text around them (`None` when there
    /// is none). No calls: the whole reply is content.
    pub fn parse(&self, text: &str) -> (Option<String>, Vec<Value>) {
        let mut calls = Vec::new();
        let mut content = String::new();
        match self.syntax {
            Syntax::Llama3 => {
                let t = text.trim();
                let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim_start();
                // calls are JSON objects separated by `;` (their strings may hold `; `)
                let mut rest = t;
                let mut parsed = Vec::new();
                let whole = loop {
                    let Some((v, n)) = json_prefix(rest) else {
                        break false;
                    };
                    let Some(c) = call_from(&v, "parameters", self.syntax) else {
                        break false;
                    };
                    parsed.push(c);
                    rest = rest[n..].trim_start();
                    match rest.strip_prefix(';') {
                        Some(r) => rest = r,
                        None => break rest.is_empty(),
                    }
                };
                if whole && t.starts_with('{') {
                    calls = parsed;
                } else {
                    content.push_str(text);
                }
            }
            Syntax::Mistral => {
                let t = text.trim();
                let t = t.strip_prefix("[TOOL_CALLS]").unwrap_or(t).trim();
                let parsed = serde_json::from_str::<Vec<Value>>(t).ok().and_then(|list| {
                    list.iter()
                        .map(|c| call_from(c, "arguments", self.syntax))
                        .collect::<Option<Vec<Value>>>()
                });
                match parsed {
                    Some(c) if !c.is_empty() => calls = c,
                    _ => content.push_str(text),
                }
            }
            _ => {
                // tagged forms: text, then calls each starting at the opening tag; what does
                // not read as a call stays text
                let tag = self.syntax.open_tag().unwrap_or_default();
                let mut rest = text;
                while let Some(at) = rest.find(tag) {
                    content.push_str(&rest[..at]);
                    let body = &rest[at + tag.len()..];
                    match self.read_block(body) {
                        Some((mut c, after)) => {
                            calls.append(&mut c);
                            rest = after;
                        }
                        None => {
                            let end = self.block_end(body);
                            content.push_str(&rest[at..at + tag.len() + end]);
                            rest = &body[end..];
                        }
                    }
                }
                content.push_str(rest);
            }
        }
        let content = content.trim();
        ((!content.is_empty()).then(|| content.to_string()), calls)
    }

    /// [`Tools::parse`] of a whole reply that ended as `finish` says (`"length"`: cut by
    /// `max_tokens` or the context): there, a call the limit cut off — the last call marker
    /// with no complete call after it — is dropped, not shown as text (OpenAI's content
    /// never holds call syntax; the finish reason says the reply was cut), and so is a
    /// marker the limit cut in two (`<tool` at the end).
    pub fn parse_end(&self, text: &str, finish: &str) -> (Option<String>, Vec<Value>) {
        if finish == "length" {
            if let Some(m) = self.marker() {
                let text = &text[..text.len() - partial_tag(text, m)];
                if let Some(at) = text.rfind(m) {
                    if self.parse(&text[at..]).1.is_empty() {
                        return self.parse(&text[..at]);
                    }
                }
                return self.parse(text);
            }
        }
        self.parse(text)
    }

    /// The text a call starts with: the opening tag, or Llama 3's and Mistral's prefix.
    fn marker(&self) -> Option<&'static str> {
        match self.syntax {
            Syntax::Llama3 => Some("<|python_tag|>"),
            Syntax::Mistral => Some("[TOOL_CALLS]"),
            s => s.open_tag(),
        }
    }

    /// What a stream shows of the text it held back at the end, when no call started in
    /// it: the text, less an opening tag the limit cut in two (`finish` `"length"`).
    pub fn held_text(&self, mut held: String, finish: &str) -> String {
        if let (Some(m), "length") = (self.marker(), finish) {
            held.truncate(held.len() - partial_tag(&held, m));
        }
        held
    }

    /// What a front end shows of a whole reply that ended as `finish` says: with calls,
    /// them and the text around them ([`Tools::parse`]); without, the text as it is, less a
    /// call the limit cut off ([`Tools::parse_end`]).
    pub fn reply(&self, text: &str, finish: &str) -> (Option<String>, Vec<Value>) {
        let (content, calls) = self.parse_end(text, finish);
        if calls.is_empty() && finish != "length" {
            return (Some(text.to_string()), calls);
        }
        (content, calls)
    }

    /// Where a block that is not a call ends (after its closing tag, else the text's end).
    fn block_end(&self, body: &str) -> usize {
        let close = match self.syntax {
            Syntax::Xml { close, .. } => close,
            Syntax::MiniMax => "</minimax:tool_call>",
            Syntax::Dsml { close, .. } => close,
            Syntax::MistralArgs => return body.len(),
            Syntax::Harmony => crate::harmony::CALL_END,
            Syntax::Gemma4 => GEMMA_CLOSE,
            Syntax::Python => PY_CLOSE,
            Syntax::Kimi => KIMI_CLOSE,
            Syntax::JsonList { close: "", .. } => return body.len(),
            Syntax::JsonList { close, .. } => close,
            Syntax::Glm(t) if !t.calls_close.is_empty() => t.calls_close,
            Syntax::Glm(t) => t.call_close,
            _ => "</tool_call>",
        };
        body.find(close).map_or(body.len(), |e| e + close.len())
    }

    /// The calls of one block (the text after its opening tag) and the text after it; `None`
    /// when it is not calls. A block may end without its closing tag where the reply ended.
    fn read_block<'a>(&self, body: &'a str) -> Option<(Vec<Value>, &'a str)> {
        match self.syntax {
            Syntax::Hermes => {
                // one JSON value (its strings may hold `</tool_call>`), then the closing tag
                let (v, n) = json_prefix(body)?;
                let after = closing(&body[n..], "</tool_call>")?;
                Some((vec![call_from(&v, "arguments", self.syntax)?], after))
            }
            Syntax::MistralArgs => {
                // NAME[ARGS]{...} (a [CALL_ID] before [ARGS] skipped)
                let (name, rest) = body.split_once("[ARGS]")?;
                let name = name.split("[CALL_ID]").next()?.trim();
                let (v, n) = json_prefix(rest)?;
                let call = call_from(
                    &json!({"name": name, "arguments": v}),
                    "arguments",
                    self.syntax,
                )?;
                Some((vec![call], &rest[n..]))
            }
            Syntax::JsonList {
                close, name, args, ..
            } => {
                let (v, n) = json_prefix(body)?;
                let mut calls = Vec::new();
                for c in v.as_array()? {
                    let c = c.as_object()?;
                    let (f, a) = if name.is_empty() {
                        match c.iter().next() {
                            Some((f, a)) if c.len() == 1 => (f.as_str(), a),
                            _ => return None,
                        }
                    } else {
                        (c.get(name)?.as_str()?, c.get(args)?)
                    };
                    let a = match a {
                        Value::String(s) => serde_json::from_str(s).ok()?,
                        a => a.clone(),
                    };
                    let Value::Object(a) = a else {
                        return None;
                    };
                    calls.push(self.call(f, a)?);
                }
                if calls.is_empty() {
                    return None;
                }
                let after = if close.is_empty() {
                    &body[n..]
                } else {
                    closing(&body[n..], close)?
                };
                Some((calls, after))
            }
            Syntax::Kimi => {
                // (<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}
                // <|tool_call_end|>)* <|tool_calls_section_end|>
                let mut calls = Vec::new();
                let mut t = body;
                while let Some(rest) = t.trim_start().strip_prefix(KIMI_CALL) {
                    let (id, rest) = rest.split_once(KIMI_ARGS)?;
                    let id = id.trim();
                    let name = id.strip_prefix("functions.").unwrap_or(id);
                    let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
                    let (v, n) = json_prefix(rest)?;
                    let Value::Object(args) = v else {
                        return None;
                    };
                    let mut call = self.call(name, args)?;
                    call["id"] = json!(id);
                    calls.push(call);
                    let after = rest[n..].trim_start();
                    t = after.strip_prefix(KIMI_CALL_END).unwrap_or(after);
                }
                if calls.is_empty() {
                    return None;
                }
                Some((calls, closing(t, KIMI_CLOSE)?))
            }
            Syntax::Python => {
                // [NAME(key=VALUE, ...), ...]<|tool_call_end|>
                let t = body.trim_start();
                let mut rest = t.strip_prefix('[')?;
                let mut calls = Vec::new();
                loop {
                    rest = rest.trim_start();
                    let paren = rest.find('(')?;
                    let name = rest[..paren].trim();
                    let (args, n) = py_kwargs(&rest[paren + 1..])?;
                    calls.push(self.call(name, args)?);
                    rest = rest[paren + 1 + n..].trim_start();
                    if let Some(r) = rest.strip_prefix(',') {
                        rest = r;
                    } else {
                        rest = rest.strip_prefix(']')?;
                        break;
                    }
                }
                Some((calls, closing(rest, PY_CLOSE)?))
            }
            Syntax::Gemma4 => {
                // NAME{key:VALUE,...}<tool_call|>
                let open = body.find('{')?;
                let (v, n) = gemma_value(&body[open..], 0)?;
                let Value::Object(args) = v else {
                    return None;
                };
                let after = closing(&body[open + n..], GEMMA_CLOSE)?;
                Some((vec![self.call(body[..open].trim(), args)?], after))
            }
            Syntax::Harmony => {
                // NAME<|message|>{...}<|call|>
                let (name, rest) = body.split_once("<|message|>")?;
                let (v, n) = json_prefix(rest)?;
                let args = match v {
                    Value::Object(m) => m,
                    _ => return None,
                };
                let after = closing(&rest[n..], crate::harmony::CALL_END)?;
                Some((vec![self.call(name.trim(), args)?], after))
            }
            Syntax::Xml { close, .. } => {
                let t = body.trim_start().strip_prefix("<function=")?;
                let (name, mut t) = t.split_once('>')?;
                let mut args = serde_json::Map::new();
                loop {
                    t = t.trim_start();
                    if let Some(after) = t.strip_prefix("</function>") {
                        t = after;
                        break;
                    }
                    if t.is_empty() {
                        break; // ended inside the call
                    }
                    let (key, rest) = t.strip_prefix("<parameter=")?.split_once('>')?;
                    let (raw, after) = rest.split_once("</parameter>").unwrap_or((rest, ""));
                    let raw = raw.strip_prefix('\n').unwrap_or(raw);
                    let raw = raw.strip_suffix('\n').unwrap_or(raw);
                    args.insert(key.into(), self.typed(name, key, raw));
                    t = after;
                }
                let after = closing(t, close)?;
                Some((vec![self.call(name, args)?], after))
            }
            Syntax::Glm(tags) if !tags.calls_open.is_empty() => {
                // the calls inside the wrapper, each from its opening tag
                let mut calls = Vec::new();
                let mut t = body;
                while let Some(rest) = t.trim_start().strip_prefix(tags.call_open) {
                    let (call, after) = self.read_kv_call(rest, tags)?;
                    calls.push(call);
                    t = after;
                }
                if calls.is_empty() {
                    return None;
                }
                Some((calls, closing(t, tags.calls_close)?))
            }
            Syntax::Glm(tags) => {
                let (call, after) = self.read_kv_call(body, tags)?;
                Some((vec![call], after))
            }
            Syntax::MiniMax => self.read_invokes(body, "", "</minimax:tool_call>"),
            Syntax::Dsml { close, .. } => self.read_invokes(body, DSML, close),
            Syntax::Llama3 | Syntax::Mistral => None,
        }
    }

    /// One call in GLM's form (after its opening tag): the name (up to the separator or the
    /// first key), then key and value tags, up to the closing tag.
    fn read_kv_call<'a>(&self, body: &'a str, tags: &KvTags) -> Option<(Value, &'a str)> {
        let (name, mut t) = match body.find(tags.key_open) {
            Some(i) => (&body[..i], &body[i..]),
            None => {
                let e = body.find(tags.call_close).unwrap_or(body.len());
                (&body[..e], &body[e..])
            }
        };
        let name = name.trim();
        let name = name.strip_suffix(tags.sep).unwrap_or(name).trim();
        let mut args = serde_json::Map::new();
        while let Some(rest) = t.trim_start().strip_prefix(tags.key_open) {
            let (key, rest) = rest.split_once(tags.key_close)?;
            let rest = rest.trim_start().strip_prefix(tags.value_open)?;
            let (raw, after) = rest.split_once(tags.value_close).unwrap_or((rest, ""));
            args.insert(key.trim().into(), self.typed(name, key.trim(), raw));
            t = after;
        }
        let after = closing(t, tags.call_close)?;
        Some((self.call(name, args)?, after))
    }

    /// MiniMax's `<invoke name="NAME">` blocks (DSML's with `prefix` `｜DSML｜` in each tag),
    /// each `<parameter name="K" ...>V</parameter>` (DSML's `string` attribute aside: the
    /// schema says how a value reads), up to the block's `close`.
    fn read_invokes<'a>(
        &self,
        body: &'a str,
        prefix: &str,
        close: &str,
    ) -> Option<(Vec<Value>, &'a str)> {
        let (invoke, invoke_end) = (
            format!("<{prefix}invoke name="),
            format!("</{prefix}invoke>"),
        );
        let (param, param_end) = (
            format!("<{prefix}parameter name="),
            format!("</{prefix}parameter>"),
        );
        // the first attribute's value (`"K" string="true"` gives K)
        let first = |attrs: &str| -> String {
            let a = attrs.trim();
            match a.strip_prefix('"') {
                Some(q) => q.split('"').next().unwrap_or("").to_string(),
                None => a.split_whitespace().next().unwrap_or("").to_string(),
            }
        };
        let mut calls = Vec::new();
        let mut t = body;
        while let Some(rest) = t.trim_start().strip_prefix(invoke.as_str()) {
            let (name, mut rest) = rest.split_once('>')?;
            let name = first(name);
            let mut args = serde_json::Map::new();
            loop {
                rest = rest.trim_start();
                if let Some(after) = rest.strip_prefix(invoke_end.as_str()) {
                    rest = after;
                    break;
                }
                if rest.is_empty() {
                    break;
                }
                let (key, r) = rest.strip_prefix(param.as_str())?.split_once('>')?;
                let key = first(key);
                let (raw, after) = r.split_once(param_end.as_str()).unwrap_or((r, ""));
                args.insert(key.clone(), self.typed(&name, &key, raw.trim()));
                rest = after;
            }
            calls.push(self.call(&name, args)?);
            t = rest;
        }
        if calls.is_empty() {
            return None;
        }
        Some((calls, closing(t, close)?))
    }

    /// A parameter's value as the templates write it: the text itself where the function's
    /// schema says string, else the JSON it reads as (text when it does not).
    fn typed(&self, function: &str, key: &str, raw: &str) -> Value {
        if is_string(self.param_schema(function, key)) {
            return Value::String(raw.to_string());
        }
        serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
    }

    /// A call of a function the request has (a name the model made up is not a call).
    fn call(&self, name: &str, args: serde_json::Map<String, Value>) -> Option<Value> {
        if !self.functions.iter().any(|(f, _)| f == name) {
            return None;
        }
        call_from(
            &json!({"name": name, "arguments": args}),
            "arguments",
            self.syntax,
        )
    }
}

/// Gemma 4's call opening (the function's name follows), its end, and its string quote.
const GEMMA_OPEN: &str = "<|tool_call>call:";
const GEMMA_CLOSE: &str = "<tool_call|>";
const GEMMA_QUOTE: &str = "<|\"|>";

/// `text` after optional white space and `tag`; an empty text counts (the reply ended
/// there), and so does the start of the tag (the reply ended in it).
fn closing<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    let t = text.trim_start();
    t.strip_prefix(tag)
        .or((tag.starts_with(t)).then_some(&t[t.len()..]))
}

/// How many bytes at the end of `text` are the start of `tag` (a tag cut in two: held back
/// while streaming, dropped at a cut end), at most `tag.len() - 1`.
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| {
            n <= text.len()
                && text.is_char_boundary(text.len() - n)
                && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// DeepSeek V3.2's and V4's mark in every tool-call tag (a token of their vocabularies).
const DSML: &str = "｜DSML｜";

/// Kimi K2's call section and call markers.
const KIMI_OPEN: &str = "<|tool_calls_section_begin|>";
const KIMI_CLOSE: &str = "<|tool_calls_section_end|>";
const KIMI_CALL: &str = "<|tool_call_begin|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";

/// LFM2's call list opening and end.
const PY_OPEN: &str = "<|tool_call_start|>";
const PY_CLOSE: &str = "<|tool_call_end|>";

/// A Python call's keyword arguments, `key=value, ...)` (after the opening parenthesis): the
/// arguments and the bytes up to and with the closing parenthesis. Positional arguments are
/// not read (the calls name their parameters).
fn py_kwargs(text: &str) -> Option<(serde_json::Map<String, Value>, usize)> {
    let mut args = serde_json::Map::new();
    let mut at = 0;
    let ws = |t: &str, at: usize| at + t[at..].len() - t[at..].trim_start().len();
    loop {
        at = ws(text, at);
        if let Some(r) = text[at..].strip_prefix(')') {
            return Some((args, text.len() - r.len()));
        }
        let eq = text[at..].find('=')?;
        let key = text[at..at + eq].trim();
        if key.is_empty() || !key.chars().all(|c| c.is_alphanumeric() || c == '_') {
            return None;
        }
        at += eq + 1;
        let (v, n) = py_value(&text[at..], 0)?;
        args.insert(key.to_string(), v);
        at = ws(text, at + n);
        match text.as_bytes().get(at)? {
            b',' => at += 1,
            b')' => return Some((args, at + 1)),
            _ => return None,
        }
    }
}

/// The Python literal at the start of `text` (after white space) as JSON, and the bytes it
/// took: strings (either quote, Python's escapes), numbers, `True`/`False`/`None` (and
/// JSON's `true`/`false`/`null`, which LFM2 also writes), lists, tuples, dicts.
fn py_value(text: &str, depth: usize) -> Option<(Value, usize)> {
    if depth > GEMMA_DEPTH {
        return None;
    }
    let start = text.len() - text.trim_start().len();
    let t = &text[start..];
    let first = *t.as_bytes().first()?;
    if first == b'"' || first == b'\'' {
        let mut out = String::new();
        let mut chars = t[1..].char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                c if c as u32 == first as u32 => {
                    return Some((Value::String(out), start + 1 + i + 1));
                }
                '\\' => {
                    let (_, e) = chars.next()?;
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        '\\' | '\'' | '"' => out.push(e),
                        'u' | 'x' => {
                            let n = if e == 'u' { 4 } else { 2 };
                            let hex: String = (0..n)
                                .filter_map(|_| chars.next().map(|(_, h)| h))
                                .collect();
                            let code = u32::from_str_radix(&hex, 16).ok()?;
                            out.push(char::from_u32(code)?);
                        }
                        other => {
                            out.push('\\');
                            out.push(other);
                        }
                    }
                }
                c => out.push(c),
            }
        }
        return None;
    }
    let close = match first {
        b'[' => b']',
        b'(' => b')',
        b'{' => b'}',
        _ => {
            let word_end = t
                .find(|c: char| !(c.is_alphanumeric() || matches!(c, '.' | '-' | '+' | '_')))
                .unwrap_or(t.len());
            let word = &t[..word_end];
            let v = match word {
                "True" | "true" => Value::Bool(true),
                "False" | "false" => Value::Bool(false),
                "None" | "null" => Value::Null,
                w => {
                    let (v, n) = json_prefix(w)?;
                    if n != w.len() || !v.is_number() {
                        return None;
                    }
                    v
                }
            };
            return Some((v, start + word_end));
        }
    };
    let key = |rest: &str| -> Option<(String, usize)> {
        // a string (or number) key, then `:`
        let (k, n) = py_value(rest, depth + 1)?;
        let k = match k {
            Value::String(k) => k,
            Value::Number(n) => n.to_string(),
            _ => return None,
        };
        let after = &rest[n..];
        let colon = after.len() - after.trim_start().len();
        after[colon..]
            .starts_with(':')
            .then_some((k, n + colon + 1))
    };
    let (v, n) = container(t, close, &key, &|t| py_value(t, depth + 1))?;
    Some((v, start + n))
}

/// A dict (`close` `}`) or list (`]`, `)`) whose opening starts `t`: its items, each a value
/// (`value`) after a key and its separator (`key`, for a dict), separated by commas (one
/// after the last allowed); the value and the bytes up to and with the closing.
fn container(
    t: &str,
    close: u8,
    key: &dyn Fn(&str) -> Option<(String, usize)>,
    value: &dyn Fn(&str) -> Option<(Value, usize)>,
) -> Option<(Value, usize)> {
    let ws = |at: usize| at + t[at..].len() - t[at..].trim_start().len();
    let (mut list, mut map) = (Vec::new(), serde_json::Map::new());
    let mut at = 1;
    loop {
        at = ws(at);
        if t.as_bytes().get(at) == Some(&close) {
            at += 1;
            break;
        }
        let k = if close == b'}' {
            let (k, n) = key(&t[at..])?;
            at += n;
            Some(k)
        } else {
            None
        };
        let (v, n) = value(&t[at..])?;
        at += n;
        match k {
            Some(k) => {
                map.insert(k, v);
            }
            None => list.push(v),
        }
        at = ws(at);
        match t.as_bytes().get(at)? {
            b',' => at += 1,
            &c if c == close => {
                at += 1;
                break;
            }
            _ => return None,
        }
    }
    let v = if close == b'}' {
        Value::Object(map)
    } else {
        Value::Array(list)
    };
    Some((v, at))
}

/// Deepest nesting of a Gemma 4 value read (deeper is not a call).
const GEMMA_DEPTH: usize = 64;

/// The Gemma 4 value at the start of `text` (after white space) and the bytes it took:
/// `<|"|>text<|"|>`, `{key:value,...}` (keys bare or quoted), `[value,...]`, numbers,
/// `true`, `false`, `null` (Gemma 4's template's `format_argument`).
fn gemma_value(text: &str, depth: usize) -> Option<(Value, usize)> {
    if depth > GEMMA_DEPTH {
        return None;
    }
    let start = text.len() - text.trim_start().len();
    let t = &text[start..];
    if let Some(rest) = t.strip_prefix(GEMMA_QUOTE) {
        let end = rest.find(GEMMA_QUOTE)?;
        return Some((
            Value::String(rest[..end].to_string()),
            start + GEMMA_QUOTE.len() * 2 + end,
        ));
    }
    let close = match t.as_bytes().first()? {
        b'{' => b'}',
        b'[' => b']',
        _ => {
            // a scalar: as JSON (numbers, true, false, null)
            let (v, n) = json_prefix(t)?;
            return (!v.is_object() && !v.is_array() && !v.is_string()).then_some((v, start + n));
        }
    };
    let key = |rest: &str| -> Option<(String, usize)> {
        // `key:` bare, or `<|"|>key<|"|>:`
        match rest.strip_prefix(GEMMA_QUOTE) {
            Some(r) => {
                let e = r.find(GEMMA_QUOTE)?;
                let after = &r[e + GEMMA_QUOTE.len()..];
                let colon = after.find(':')?;
                if !after[..colon].trim().is_empty() {
                    return None;
                }
                Some((r[..e].to_string(), GEMMA_QUOTE.len() * 2 + e + colon + 1))
            }
            None => {
                let colon = rest.find([':', '}', ','])?;
                (rest.as_bytes()[colon] == b':')
                    .then(|| (rest[..colon].trim().to_string(), colon + 1))
            }
        }
    };
    let (v, n) = container(t, close, &key, &|t| gemma_value(t, depth + 1))?;
    Some((v, start + n))
}

/// How a `NAME(key=value, ...)`-like notation writes calls (Gemma 4's, LFM2's Python): for
/// [`kv_grammar`].
struct KvNotation {
    /// Before and after the calls, and between two of them.
    open: &'static str,
    close: &'static str,
    call_sep: &'static str,
    /// A call's opening (given its name) and closing.
    head: fn(&str) -> String,
    tail: &'static str,
    /// Between a key and its value, and between two parameters.
    key_sep: &'static str,
    sep: &'static str,
    /// The rules of any value (its rule `gv`, strings `gs`).
    any: &'static str,
    /// A boolean.
    boolean: &'static str,
    /// A string parameter's rule `name` for its schema.
    string: fn(&str, &Value) -> String,
}

impl KvNotation {
    fn gemma() -> KvNotation {
        KvNotation {
            open: "",
            close: "",
            call_sep: "",
            head: |n| format!("{GEMMA_OPEN}{n}{{"),
            tail: "}<tool_call|>",
            key_sep: ":",
            sep: ",",
            any: "gv: gs | gd | ga | GNUM | \"true\" | \"false\" | \"null\"\n\
                  gs: \"<|\\\"|>\" gsv\n\
                  gsv[suffix=\"<|\\\"|>\"]: /(.|\\n)*/\n\
                  gd: \"{\" (gkv (\",\" gkv)*)? \"}\"\n\
                  gkv: /[A-Za-z0-9_.-]+/ \":\" gv\n\
                  ga: \"[\" (gv (\",\" gv)*)? \"]\"\n\
                  GNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n",
            boolean: "(\"true\" | \"false\")",
            string: |name, schema| string_rule(name, schema, GEMMA_QUOTE, GEMMA_QUOTE),
        }
    }

    fn python() -> KvNotation {
        KvNotation {
            open: "<|tool_call_start|>[",
            close: "]<|tool_call_end|>",
            call_sep: ", ",
            head: |n| format!("{n}("),
            tail: ")",
            key_sep: "=",
            sep: ", ",
            any: "gv: gs | gd | ga | GNUM | \"True\" | \"False\" | \"None\"\n\
                  gs: /\"([^\"\\\\\\n]|\\\\.)*\"/\n\
                  gd: \"{\" (gkv (\", \" gkv)*)? \"}\"\n\
                  gkv: gs \": \" gv\n\
                  ga: \"[\" (gv (\", \" gv)*)? \"]\"\n\
                  GNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n",
            boolean: "(\"True\" | \"False\")",
            string: |name, schema| {
                // a double-quoted Python string (JSON's escapes are Python's), or an enum value
                let choices: Vec<String> = schema
                    .get("enum")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter(|v| v.is_string())
                    .map(|v| lark_str(&v.to_string()))
                    .collect();
                if choices.is_empty() {
                    format!("{name}: gs\n")
                } else {
                    format!("{name}: {}\n", choices.join(" | "))
                }
            },
        }
    }
}

/// The grammar of calls in a key=value notation: per function its head, its required
/// parameters (in the schema's order), then any of the optional ones, its tail; a value is
/// the notation's string where the schema says string, JSON where it says number or integer
/// (the same in these notations), the notation's boolean, any of its values otherwise.
fn kv_grammar(names: &[&(String, Value)], many: bool, n: &KvNotation) -> String {
    let (open, close, call_sep) = (lark_str(n.open), lark_str(n.close), lark_str(n.call_sep));
    let mut g = if many {
        format!("start: {open} tc ({call_sep} tc)* {close}\n")
    } else {
        format!("start: {open} tc {close}\n")
    };
    let alts: Vec<String> = (0..names.len()).map(|i| format!("f{i}")).collect();
    g.push_str(&format!("tc: {}\n", alts.join(" | ")));
    g.push_str(n.any);
    let sep = lark_str(n.sep);
    for (i, (name, params)) in names.iter().enumerate() {
        let (props, required) = params_of(params);
        let mut req = Vec::new();
        let mut opt = Vec::new();
        for (j, (key, schema)) in props.iter().enumerate() {
            let rule = format!("f{i}p{j}");
            let head = lark_str(&format!("{key}{}", n.key_sep));
            let value = match schema.get("type").and_then(Value::as_str) {
                _ if is_string(Some(schema)) => {
                    g.push_str(&(n.string)(&format!("{rule}v"), schema));
                    format!("{rule}v")
                }
                Some("number" | "integer") => format!("%json {}", compact(schema)),
                Some("boolean") => n.boolean.to_string(),
                _ => "gv".to_string(),
            };
            g.push_str(&format!("{rule}: {head} {value}\n"));
            if required.contains(&key.as_str()) {
                req.push(rule);
            } else {
                opt.push(rule);
            }
        }
        // the optional ones, any of them in order: o{k}: p{k} (sep o{k+1})? | o{k+1}
        for (k, rule) in opt.iter().enumerate() {
            let (tail, next) = if k + 1 < opt.len() {
                (
                    format!(" ({sep} f{i}o{})?", k + 1),
                    format!(" | f{i}o{}", k + 1),
                )
            } else {
                (String::new(), String::new())
            };
            g.push_str(&format!("f{i}o{k}: {rule}{tail}{next}\n"));
        }
        let mut body = req.join(&format!(" {sep} "));
        if !opt.is_empty() {
            body = if body.is_empty() {
                format!("f{i}o0?")
            } else {
                format!("{body} ({sep} f{i}o0)?")
            };
        }
        let head = lark_str(&(n.head)(name));
        g.push_str(&format!("f{i}: {head} {body} {}\n", lark_str(n.tail)));
    }
    g
}

/// The largest `minLength`/`maxLength` of a string parameter the grammars keep.
const MAX_STRING_BOUND: u64 = 1024;

/// A Lark rule `name` for a string parameter written as text between `open` and `close`
/// (`close` ends it: the first one in the text is the end): one of its `enum` values where
/// the schema lists them, else any text of its `minLength`..`maxLength` characters.
fn string_rule(name: &str, schema: &Value, open: &str, close: &str) -> String {
    let choices: Vec<String> = schema
        .get("enum")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|v| !v.contains(close) || close.is_empty())
        .map(|v| lark_str(&format!("{open}{v}{close}")))
        .collect();
    if !choices.is_empty() {
        return format!("{name}: {}\n", choices.join(" | "));
    }
    let len = |k: &str| schema.get(k).and_then(Value::as_u64);
    // bounds past MAX_STRING_BOUND are left out (a looser constraint, not a huge automaton)
    let len = |k: &str| len(k).filter(|&n| n <= MAX_STRING_BOUND);
    let reps = match (len("minLength"), len("maxLength")) {
        (None, None) => "*".to_string(),
        (min, max) => format!(
            "{{{},{}}}",
            min.unwrap_or(0),
            max.map_or(String::new(), |m| m.to_string())
        ),
    };
    let open = if open.is_empty() {
        String::new()
    } else {
        format!("{} ", lark_str(open))
    };
    format!(
        "{name}: {open}{name}t\n{name}t[suffix={}]: /(.|\\n){reps}/\n",
        lark_str(close)
    )
}

/// A function's parameters (their names and schemas, in the schema's order) and the names
/// its schema requires.
fn params_of(params: &Value) -> (Vec<(&String, &Value)>, Vec<&str>) {
    let props = params
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .collect();
    let required = params
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    (props, required)
}

/// The schema of one call among `calls` (each a call's object schema), compact.
fn any_call(calls: Vec<Value>) -> Value {
    compact(&match <[Value; 1]>::try_from(calls) {
        Ok([one]) => one,
        Err(calls) => json!({"anyOf": calls}),
    })
}

/// The rule `tc` of a call of one of the functions `names` (`f0 | f1 | ...`), each its
/// `head` (Lark, given the function's name), its arguments as JSON of its parameters'
/// schema, and `tail` (Lark).
fn json_calls(names: &[&(String, Value)], head: impl Fn(&str) -> String, tail: &str) -> String {
    let alts: Vec<String> = (0..names.len()).map(|i| format!("f{i}")).collect();
    let mut g = format!("tc: {}\n", alts.join(" | "));
    for (i, (name, params)) in names.iter().enumerate() {
        g.push_str(&format!(
            "f{i}: {} %json {} {tail}\n",
            head(name),
            compact(params)
        ));
    }
    g
}

/// Whether a parameter's schema says string (`"type": "string"` or a list with it).
fn is_string(schema: Option<&Value>) -> bool {
    match schema.and_then(|s| s.get("type")) {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
        _ => false,
    }
}

/// A schema as compact JSON for `%json` (free whitespace lets small models ramble).
fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(m) = &mut s {
        m.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    s
}

/// `s` as a Lark string literal.
fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Nine letters and digits from `n` (Mistral's tool-call ids).
fn base62_9(mut n: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..9)
        .map(|_| {
            let c = DIGITS[(n % 62) as usize] as char;
            n /= 62;
            c
        })
        .collect()
}

/// Whether a tool-call id is one Mistral's templates take (9 letters and digits).
fn is_mistral_id(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// For a template in Mistral's syntaxes, which refuse tool-call ids other than 9 letters and
/// digits: the conversation's ids that are not, each mapped to one that is (the same id to
/// the same, so calls and their results still pair up). Other templates: untouched.
pub fn mistral_ids(template_source: &str, messages: &mut [gds_runtime::chat::Message]) {
    if !matches!(
        Syntax::of_template(template_source),
        Some(Syntax::Mistral | Syntax::MistralArgs)
    ) {
        return;
    }
    let map = |id: &str| {
        if is_mistral_id(id) {
            return id.to_string();
        }
        // FNV-1a: stable across requests
        let h = id.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
        });
        base62_9(h)
    };
    for m in messages {
        if let Some(id) = &m.tool_call_id {
            m.tool_call_id = Some(map(id));
        }
        for c in m
            .tool_calls
            .iter_mut()
            .flat_map(|v| v.as_array_mut())
            .flatten()
        {
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                c["id"] = json!(map(id));
            }
        }
    }
}

/// The JSON value at the start of `text` (after white space) and the bytes it took.
fn json_prefix(text: &str) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let v = values.next()?.ok()?;
    Some((v, values.byte_offset()))
}

/// One call, `{"name": ..., key: {...}}`, in OpenAI's form (a fresh id: `call_` and 16 hex
/// digits; for Mistral's templates, which refuse any other, 9 letters and digits).
fn call_from(v: &Value, key: &str, syntax: Syntax) -> Option<Value> {
    let name = v.get("name")?.as_str()?;
    let args = v
        .get(key)
        .or_else(|| v.get("arguments"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let args = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    let seed = crate::error::random_seed();
    let id = match syntax {
        Syntax::Mistral | Syntax::MistralArgs => base62_9(seed),
        _ => format!("call_{seed:016x}"),
    };
    Some(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": args},
    }))
}

/// The reply as OpenAI's assistant message: with `tools` that parse calls and calls in it,
/// those (`tool_calls`) and the text around them as `content`; otherwise the whole text as
/// `content`. The flag says whether it has calls. `finish` is how the reply ended
/// ([`Tools::parse_end`]).
pub fn assistant_message(tools: Option<&Tools>, text: &str, finish: &str) -> (Value, bool) {
    match tools.filter(|t| t.parses()).map(|t| t.reply(text, finish)) {
        Some((content, calls)) if !calls.is_empty() => (
            json!({"role": "assistant", "content": content, "tool_calls": calls}),
            true,
        ),
        Some((content, _)) => (
            json!({"role": "assistant", "content": content.unwrap_or_default()}),
            false,
        ),
        None => (json!({"role": "assistant", "content": text}), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gds_runtime::chat::Message;

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, "", "").unwrap()
    }

    fn tools(src: &str, choice: Value) -> Tools {
        let list = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
        Tools::from_request(Some(&list), Some(&choice), None, Some(&template(src)))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn a_call_cut_off_by_the_limit_is_dropped_not_shown() {
        let h = tools("{{ tools }} <tool_call>", json!("auto"));
        let whole = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let cut = format!("Sure.\n{whole}\n<tool_call>\n{{\"name\":");
        // ended by the limit: the complete call kept, the cut one gone from the content
        let (content, calls) = h.parse_end(&cut, "length");
        assert_eq!((content.as_deref(), calls.len()), (Some("Sure."), 1));
        // one call, cut: nothing of it shown
        let (content, calls) = h.parse_end("<tool_call>\n{\"name\": \"get_wea", "length");
        assert_eq!((content, calls.len()), (None, 0));
        // ended on its own, the same text is the model's: kept as it is
        let (content, calls) = h.parse_end(&cut, "stop");
        assert_eq!(calls.len(), 1);
        assert!(content.unwrap().ends_with("<tool_call>\n{\"name\":"));
        // cut after the last call's end: nothing dropped
        let (content, calls) = h.parse_end(&format!("{whole} and"), "length");
        assert_eq!((content.as_deref(), calls.len()), (Some("and"), 1));
        // the limit cut a tag in two: an opening one is no text; a closing one ends a call
        // whose JSON is whole, as the reply's end does
        for n in 1..=10 {
            let (content, calls) = h.parse_end(&"<tool_call>"[..n], "length");
            assert_eq!((content, calls.len()), (None, 0), "{n}");
            let (content, calls) =
                h.parse_end(&format!("Sure. {whole}\n{}", &"<tool_call>"[..n]), "length");
            assert_eq!((content.as_deref(), calls.len()), (Some("Sure."), 1), "{n}");
        }
        let call = &whole[..whole.len() - "</tool_call>".len()];
        for n in 0..12 {
            let cut = format!("{call}{}", &"</tool_call>"[..n]);
            let (content, calls) = h.parse_end(&cut, "length");
            assert_eq!((content, calls.len()), (None, 1), "{cut}");
        }
        // Llama 3's and Mistral's prefixes
        for (src, cut) in [
            (
                "{{ tools }} <|python_tag|>",
                "<|python_tag|>{\"name\": \"get_w",
            ),
            (
                "{{ tools }} [TOOL_CALLS]",
                "[TOOL_CALLS][{\"name\": \"get_w",
            ),
        ] {
            let t = tools(src, json!("auto"));
            assert!(
                matches!(t.syntax, Syntax::Llama3 | Syntax::Mistral),
                "{src}"
            );
            assert_eq!(t.parse_end(cut, "length"), (None, vec![]), "{src}");
            assert_eq!(t.parse_end(cut, "stop").0.as_deref(), Some(cut), "{src}");
        }
        // what a front end shows: a reply with no call, as it is (spaces kept); with calls,
        // the text around them; a cut call, nothing of it
        let h = tools("{{ tools }} <tool_call>", json!("auto"));
        assert_eq!(
            h.reply(" <tool_call>x ", "stop"),
            (Some(" <tool_call>x ".into()), vec![])
        );
        assert_eq!(h.reply(" <tool_call>x ", "length"), (None, vec![]));
        assert_eq!(h.reply(&cut, "stop").0, h.parse(&cut).0);
        assert_eq!(crate::api::finish_reason("length", true), "length");
        assert_eq!(crate::api::finish_reason("stop", true), "tool_calls");
        assert_eq!(crate::api::finish_reason("stop", false), "stop");
    }

    #[test]
    fn each_syntax_parses_back_into_openai_calls() {
        let h = tools("{{ tools }} <tool_call>", json!("auto"));
        let (content, calls) = h.parse(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        );
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        // not a call: content, untouched
        let (content, calls) = h.parse("<tool_call>not json</tool_call> hi");
        assert!(calls.is_empty());
        assert_eq!(
            content.as_deref(),
            Some("<tool_call>not json</tool_call> hi")
        );

        let l = tools("{{ tools }} <|python_tag|> ipython", json!("auto"));
        let (content, calls) =
            l.parse("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}");
        assert_eq!((content, calls.len()), (None, 1));
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Rome\"}");
        let (content, calls) = l.parse("The weather is fine.");
        assert_eq!(
            (content.as_deref(), calls.len()),
            (Some("The weather is fine."), 0)
        );

        // a string argument holding the closing tag or the separator is read as JSON
        let (content, calls) = h.parse(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a}</tool_call> b\"}}\n</tool_call> done",
        );
        assert_eq!(calls.len(), 1, "{content:?}");
        assert_eq!(
            calls[0]["function"]["arguments"],
            "{\"city\":\"a}</tool_call> b\"}"
        );
        assert_eq!(content.as_deref(), Some("done"));
        // the reply ended after the value, before the closing tag
        let (_, calls) = h.parse("<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}");
        assert_eq!(calls.len(), 1);
        // a value followed by something other than the closing tag is not a call
        let (content, calls) = h.parse("<tool_call>{\"name\": \"f\"} oops</tool_call> x");
        assert!(calls.is_empty());
        assert_eq!(
            content.as_deref(),
            Some("<tool_call>{\"name\": \"f\"} oops</tool_call> x")
        );
        let (_, calls) = l.parse(
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"x; y\"}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"z\"}}",
        );
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"x; y\"}");
        let (content, calls) = l.parse("{\"name\": \"get_weather\"} and more");
        assert_eq!(
            (content.as_deref(), calls.len()),
            (Some("{\"name\": \"get_weather\"} and more"), 0)
        );

        let m = tools("{{ tools }} [TOOL_CALLS]", json!("auto"));
        let (_, calls) = m.parse(
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bergen\"}}]",
        );
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1]["function"]["arguments"], "{\"city\":\"Bergen\"}");
    }

    /// A template of `fixtures/templates/` (its source, compiled) and `list` checked against
    /// it with `tool_choice: auto`.
    fn fixture_tools(file: &str, list: &Value) -> (String, ChatTemplate, Tools) {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/templates/");
        let src = std::fs::read_to_string(format!("{path}{file}")).unwrap();
        let t = ChatTemplate::new(&src, "<s>", "</s>").unwrap();
        let tools = Tools::from_request(Some(list), Some(&json!("auto")), None, Some(&t))
            .unwrap()
            .unwrap();
        (src, t, tools)
    }

    /// Each tagged syntax reads back the calls its own template writes: a conversation whose
    /// assistant turn has a call is rendered by the model's template (llama.cpp's copies of
    /// the published templates, `fixtures/templates/`), and the assistant's part of it
    /// parses into the same call (a string argument with `, ` and `</`, an integer).
    #[test]
    fn each_template_s_own_calls_parse_back() {
        let list = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]);
        let args = json!({"city": "Paris, FR </b>", "days": 3});
        for (file, syntax) in [
            ("qwen2.5-instruct.jinja", "Hermes"),
            ("qwen3-coder.jinja", "Xml"),
            ("glm-4.6.jinja", "Glm"),
            ("hunyuan-3.jinja", "Glm"),
            ("apriel-1.5.jinja", "JsonList"),
            ("minimax-m2.jinja", "MiniMax"),
            ("mistral-small-3.2.jinja", "MistralArgs"),
            ("gpt-oss.jinja", "Harmony"),
            ("gemma-4.jinja", "Gemma4"),
            ("command-r7b.jinja", "JsonList"),
            ("nemotron-nano-v2.jinja", "JsonList"),
            ("apertus-8b.jinja", "JsonList"),
            ("kimi-k2.jinja", "Kimi"),
            ("kimi-k2-thinking.jinja", "Kimi"),
            ("deepseek-v3.2.jinja", "Dsml"),
        ] {
            let (_, t, tools) = fixture_tools(file, &list);
            assert!(format!("{:?}", tools.syntax).starts_with(syntax), "{file}");
            let user = Message::new("user", "Weather?");
            let mut reply = Message::new("assistant", "");
            reply.tool_calls = Some(json!([{"id": "abc123XYZ", "type": "function",
                "function": {"name": "get_weather", "arguments": args}}]));
            let head = t
                .render_with_tools(std::slice::from_ref(&user), true, Some(&tools.list))
                .unwrap();
            let whole = t
                .render_with_tools(&[user, reply], false, Some(&tools.list))
                .unwrap();
            // the reply: past what the prompt and the whole conversation share (MiniMax's
            // prompt opens a `<think>` its history does not have)
            let shared = head
                .char_indices()
                .zip(whole.chars())
                .find(|((_, a), b)| a != b)
                .map_or(head.len(), |((i, _), _)| i);
            // not inside a tag both have the start of (Gemma 4's `<|channel>` / `<|tool_call>`)
            let shared = match whole[..shared].rfind('<') {
                Some(i) if !whole[i..shared].contains('>') => i,
                _ => shared,
            };
            let said = &whole[shared..];
            // harmony: the reply's messages read first (as the server does)
            let said = if tools.syntax == Syntax::Harmony {
                let mut c = crate::harmony::Channels::new(false);
                let (_, mut a) = c.push(said);
                a.push_str(&c.finish().1);
                a
            } else {
                said.to_string()
            };
            let said = said.as_str();
            let (_, calls) = tools.parse(said);
            assert_eq!(calls.len(), 1, "{file}: {said:?}");
            assert_eq!(calls[0]["function"]["name"], "get_weather", "{file}");
            let got: Value =
                serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(got, args, "{file}: {said:?}");
        }
        // Mistral's template refuses ids other than 9 letters and digits: ours are such for
        // it, a client's other ids mapped (the same id the same way)
        let (src, t, m) = fixture_tools("mistral-small-3.2.jinja", &list);
        let (_, calls) = m.parse("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}");
        assert!(is_mistral_id(calls[0]["id"].as_str().unwrap()), "{calls:?}");
        let mut reply = Message::new("assistant", "");
        reply.tool_calls = Some(json!([{"id": "call_0123456789abcdef", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]));
        let mut result = Message::new("tool", "sunny");
        result.tool_call_id = Some("call_0123456789abcdef".into());
        let mut msgs = vec![Message::new("user", "Weather?"), reply, result];
        assert!(t.render(&msgs, true).is_err(), "the template takes any id?");
        mistral_ids(&src, &mut msgs);
        let id = msgs[1].tool_calls.as_ref().unwrap()[0]["id"]
            .as_str()
            .unwrap();
        assert!(is_mistral_id(id));
        assert_eq!(msgs[2].tool_call_id.as_deref(), Some(id));
        t.render(&msgs, true).unwrap();

        // a function the request does not have is not a call (tagged forms)
        let (_, _, x) = fixture_tools("qwen3-coder.jinja", &list);
        let (content, calls) = x.parse("<tool_call>\n<function=rm>\n</function>\n</tool_call>");
        assert!(calls.is_empty());
        assert!(content.unwrap().contains("<function=rm>"));
        let (_, calls) = x.parse(
            "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo",
        );
        assert_eq!(calls.len(), 2, "the second cut off by the end of the reply");
    }

    /// Gemma 4's notation: strings between `<|"|>` marks (which may hold `,` `}` `:`), bare
    /// or quoted keys, nesting, JSON scalars; what is not a value is not a call.
    #[test]
    fn gemma_values_read_as_json() {
        let q = |s: &str| s.replace('\'', "<|\"|>");
        let (v, n) = gemma_value(
            &q("{city:'Paris, FR}:',days:3,opts:{'deep key':[1,-2.5,true,null,'x']},e:[]} rest"),
            0,
        )
        .unwrap();
        assert_eq!(
            v,
            json!({"city": "Paris, FR}:", "days": 3, "opts": {"deep key": [1, -2.5, true, null, "x"]}, "e": []})
        );
        assert!(
            q("{city:'Paris, FR}:',days:3,opts:{'deep key':[1,-2.5,true,null,'x']},e:[]}").len()
                == n
        );
        for bad in ["{city:'open", "{city}", "{a:1 b:2}", "[1,", "{a:nope}", ""] {
            assert!(gemma_value(&q(bad), 0).is_none(), "{bad}");
        }
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(gemma_value(&deep, 0).is_none(), "nesting is bounded");
        let list = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let (_, _, g) = fixture_tools("gemma-4.jinja", &list);
        let (content, calls) = g.parse(&q(
            "Sure.<|tool_call>call:get_weather{city:'Rome'}<tool_call|><|tool_call>call:get_weather{city:'Oslo'}<tool_call|>",
        ));
        assert_eq!(content.as_deref(), Some("Sure."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        // a function the request lacks, or a body that is not a value: text
        let text = q("<|tool_call>call:rm{path:'/'}<tool_call|>");
        assert_eq!(g.parse(&text), (Some(text.clone()), vec![]));
    }

    /// Granite 3.3's template never renders a call (its history drops them): its syntax, as
    /// its system prompt describes it, read here; a list whose element is not a call of ours
    /// is text.
    #[test]
    fn json_list_calls_read_back() {
        let list = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let (_, _, g) = fixture_tools("granite-3.3.jinja", &list);
        assert_eq!(
            g.syntax,
            Syntax::JsonList {
                open: "<|tool_call|>",
                close: "",
                name: "name",
                args: "arguments"
            }
        );
        let (content, calls) = g.parse(
            "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}, {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}]",
        );
        assert_eq!(content, None);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        for text in [
            "<|tool_call|>[{\"name\": \"rm\", \"arguments\": {}}]",
            "<|tool_call|>[]",
            "<|tool_call|>{\"name\": \"get_weather\"}",
        ] {
            assert_eq!(g.parse(text), (Some(text.to_string()), vec![]), "{text}");
        }
        // FireFunction v2 (its template's tool part, shortened): ` functools[...]` to the end
        let src = "{% for t in tools %}{{ t.function.name }}{% endfor %} Prefix calls with functools marker: functools[{...}]{% for m in messages %}{{ m.content }}{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let ff = Tools::from_request(Some(&list), Some(&json!("required")), None, Some(&t))
            .unwrap()
            .unwrap();
        assert_eq!(ff.syntax.open_tag(), Some("functools"));
        let (content, calls) = ff.parse(
            "Sure. functools[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
        );
        assert_eq!(content.as_deref(), Some("Sure."));
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert!(matches!(ff.grammar(), Ok(Some(Grammar::Lark(g))) if g.contains("functools")));
        // LFM2.5: Python calls, keyword arguments in Python's literals or JSON's
        let (_, _, py) = fixture_tools("lfm2.5.jinja", &list);
        assert_eq!(py.syntax, Syntax::Python);
        let (content, calls) = py.parse(
            "Let me look.<|tool_call_start|>[get_weather(city='Rome, \\'IT\\'\\u00e9'), get_weather(city=\"Oslo\", days=3, opts={'a': [1, 2.5, True, None, (false,)]})]<|tool_call_end|>",
        );
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(
            calls[0]["function"]["arguments"],
            json!({"city": "Rome, 'IT'é"}).to_string()
        );
        let args: Value =
            serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(
            args,
            json!({"city": "Oslo", "days": 3, "opts": {"a": [1, 2.5, true, null, [false]]}})
        );
        for text in [
            "<|tool_call_start|>[get_weather('Rome')]<|tool_call_end|>",
            "<|tool_call_start|>[rm(path='/')]<|tool_call_end|>",
            "<|tool_call_start|>[get_weather(city='open",
            "<|tool_call_start|>get_weather(city='x')<|tool_call_end|>",
        ] {
            assert_eq!(py.parse(text), (Some(text.to_string()), vec![]), "{text}");
        }
        let deep = format!(
            "<|tool_call_start|>[get_weather(city={}",
            "[".repeat(100_000)
        );
        assert!(py.parse(&deep).1.is_empty());
        // Kimi K2: the call's id is the one its template renders back
        let (_, _, k) = fixture_tools("kimi-k2.jinja", &list);
        let (content, calls) = k.parse("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|><|tool_calls_section_end|>");
        assert_eq!(content.as_deref(), Some("Checking."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1]["id"], "functions.get_weather:1");
        let (_, _, a) = fixture_tools("apertus-8b.jinja", &list);
        let (_, calls) =
            a.parse("<|tools_prefix|>[{\"get_weather\": {\"city\": \"Rome\"}}]<|tools_suffix|>");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
    }

    #[test]
    fn streams_text_until_a_call_may_start() {
        let h = tools("{{ tools }} <tool_call>", json!("auto"));
        let mut plain = false;
        assert_eq!(h.stream_cut("Let me see", &mut plain), (10, false));
        assert_eq!(h.stream_cut("ok <tool", &mut plain), (3, false));
        assert_eq!(h.stream_cut("ok <tool_call>\n{", &mut plain), (3, true));
        assert_eq!(h.stream_cut("a < b", &mut plain), (5, false));
        let l = tools("{{ tools }} ipython", json!("auto"));
        let mut plain = false;
        assert_eq!(l.stream_cut("  ", &mut plain), (0, false));
        assert_eq!(l.stream_cut(" {\"na", &mut plain), (0, true));
        assert_eq!(l.stream_cut("<|pyth", &mut plain), (0, false));
        assert_eq!(l.stream_cut("Hello", &mut plain), (5, false));
        assert!(plain);
        assert_eq!(l.stream_cut("{ later", &mut plain), (7, false));
    }

    #[test]
    fn requests_are_checked_against_the_template() {
        let list = json!([{"type": "function", "function": {"name": "f"}}]);
        let err = |t: Option<&str>, choice: Value| {
            Tools::from_request(Some(&list), Some(&choice), None, t.map(template).as_ref())
                .err()
                .map(|e| format!("{e:?}"))
                .unwrap_or_default()
        };
        assert!(err(Some("{{ messages }}"), json!("auto")).contains("does not take tools"));
        // no call asked for: the tools are left out where the template cannot show them
        for t in [Some("{{ messages }}"), Some("{{ tools }}"), None] {
            let r = Tools::from_request(
                Some(&list),
                Some(&json!("none")),
                None,
                t.map(template).as_ref(),
            );
            assert!(matches!(r, Ok(None)), "{t:?}");
        }
        assert!(err(Some("{{ tools }}"), json!("auto")).contains("syntax"));
        assert!(err(None, json!("auto")).contains("no chat template"));
        assert!(err(
            Some("{{ tools }}<tool_call>"),
            json!({"type": "function", "function": {"name": "g"}})
        )
        .contains("not in tools"));
        assert!(err(Some("{{ tools }}<tool_call>"), json!("sometimes")).contains("tool_choice"));
        // no tools: nothing to do, unless a call is demanded
        assert!(Tools::from_request(None, Some(&json!("auto")), None, None)
            .unwrap()
            .is_none());
        assert!(Tools::from_request(None, Some(&json!("required")), None, None).is_err());
    }

    /// Arguments are an object: parameters of another type are refused, naming the
    /// function; an object with `properties` takes no other keys unless it says so.
    #[test]
    fn parameters_are_an_object_that_takes_only_its_keys() {
        let t = template("{{ tools }}<tool_call>");
        for ty in [json!("string"), json!("array"), json!(["object", "null"])] {
            let list = json!([{"type": "function", "function": {"name": "f",
                "parameters": {"type": ty}}}]);
            let e = Tools::from_request(Some(&list), Some(&json!("auto")), None, Some(&t))
                .err()
                .map(|e| format!("{e:?}"))
                .unwrap_or_default();
            assert!(
                e.contains("function f") && e.contains("object schema"),
                "{ty}: {e}"
            );
        }
        let h = tools("{{ tools }} <tool_call>", json!("required"));
        let Some(Grammar::Lark(g)) = h.grammar().unwrap() else {
            panic!("a grammar")
        };
        // the call's own object and its arguments' are closed
        assert_eq!(
            g.matches("\"additionalProperties\":false").count(),
            2,
            "{g}"
        );
        let open = json!([{"type": "function", "function": {"name": "f", "parameters":
            {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": true}}}]);
        let h = Tools::from_request(Some(&open), Some(&json!("required")), None, Some(&t))
            .unwrap()
            .unwrap();
        let Some(Grammar::Lark(g)) = h.grammar().unwrap() else {
            panic!("a grammar")
        };
        assert!(g.contains("\"additionalProperties\":true"), "{g}");
    }

    #[test]
    fn long_tool_lists_are_refused_at_once() {
        // 75k functions (a 4 MB body) took a minute of an async worker when names were
        // compared pairwise
        let many = |n: usize, dup: bool| {
            let mut v: Vec<Value> = (0..n)
                .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
                .collect();
            if dup {
                v.push(v[0].clone());
            }
            Value::Array(v)
        };
        let t = template("{{ tools }}<tool_call>");
        let long = many(75_000, false);
        let start = std::time::Instant::now();
        let err = Tools::from_request(Some(&long), None, None, Some(&t))
            .err()
            .map(|e| format!("{e:?}"))
            .unwrap_or_default();
        assert!(err.contains("at most 128"), "{err}");
        // (a guard against the minute, not a speed target: under a loaded test run this
        // took over the 1 s it once asserted)
        assert!(start.elapsed() < std::time::Duration::from_secs(30));
        assert!(Tools::from_request(Some(&many(MAX_TOOLS, false)), None, None, Some(&t)).is_ok());
        let err = Tools::from_request(Some(&many(MAX_TOOLS - 1, true)), None, None, Some(&t))
            .err()
            .map(|e| format!("{e:?}"))
            .unwrap_or_default();
        assert!(err.contains("f0 is defined twice"), "{err}");
    }

    /// Any reply, in any syntax: parsing never panics, and text outside calls is kept; a
    /// reply streamed through `stream_cut` in any pieces never cuts inside a character.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        const BITS: &[&str] = &[
            "<tool_call>",
            "</tool_call>",
            "<function=get_weather>",
            "</function>",
            "<parameter=city>",
            "</parameter>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<minimax:tool_call>",
            "</minimax:tool_call>",
            "<invoke name=\"get_weather\">",
            "</invoke>",
            "<parameter name=\"city\">",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[CALL_ID]",
            "get_weather",
            "{\"city\": \"é\"}",
            "{\"name\": \"get_weather\", \"arguments\": {}}",
            "{",
            "}",
            "\"",
            "\n",
            " ",
            ";",
            "é",
            "日本",
            "<|python_tag|>",
            "<seed:tool_call>",
            "<|channel|>",
            "<|message|>",
            "<|start|>assistant",
            "<|end|>",
            "<|call|>",
            " to=functions.get_weather",
            "commentary",
            "analysis",
            "final",
            "<|tool_call>call:get_weather",
            "<tool_call|>",
            "<|\"|>",
            "city:",
            "[",
            "]",
            ",",
            "3",
            "<|START_ACTION|>",
            "<|END_ACTION|>",
            "<TOOLCALL>",
            "</TOOLCALL>",
            "<|tools_prefix|>",
            "<|tools_suffix|>",
            "<|tool_call|>",
            "{\"get_weather\": {\"city\": \"x\"}}",
            "{\"tool_name\": \"get_weather\", \"parameters\": {}}",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "get_weather(",
            "city='x'",
            ")",
            "(",
            "'",
            "\\",
            "=",
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>functions.get_weather:0",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
            "<｜DSML｜function_calls>",
            "</｜DSML｜function_calls>",
            "<｜DSML｜invoke name=\"get_weather\">",
            "</｜DSML｜invoke>",
            "<｜DSML｜parameter name=\"city\" string=\"true\">",
            "</｜DSML｜parameter>",
        ];

        fn reply() -> impl Strategy<Value = String> {
            proptest::collection::vec(0..BITS.len(), 0..24)
                .prop_map(|ix| ix.into_iter().map(|i| BITS[i]).collect())
        }

        proptest! {
            #[test]
            fn parsing_any_reply_never_panics(text in reply(), cut in 1usize..7) {
                for src in [
                    "{{ tools }} <tool_call>",
                    "{{ tools }} <tool_call> <function=",
                    "{{ tools }} <seed:tool_call> <function=",
                    "{{ tools }} <tool_call> <arg_key>",
                    "{{ tools }} <minimax:tool_call>",
                    "{{ tools }} [TOOL_CALLS] [ARGS]",
                    "{{ tools }} [TOOL_CALLS]",
                    "{{ tools }} <|python_tag|>",
                    "{{ tools }} <|channel|>",
                    "{{ tools }} <|tool_call>call:",
                    "{{ tools }} <|START_ACTION|>",
                    "{{ tools }} <TOOLCALL>",
                    "{{ tools }} <|tools_prefix|>",
                    "{{ tools }} <|tool_call|>",
                    "{{ tools }} <|tool_list_start|>",
                    "{{ tools }} <|tool_calls_section_begin|>",
                    "{{ tools }} ｜DSML｜ function_calls",
                ] {
                    let t = tools(src, json!("auto"));
                    let (content, calls) = t.parse(&text);
                    if calls.is_empty() {
                        prop_assert_eq!(content.unwrap_or_default(), text.trim());
                    }
                    let mut plain = false;
                    let mut held = String::new();
                    for piece in text.chars().collect::<Vec<_>>().chunks(cut) {
                        held.extend(piece);
                        let (n, starts) = t.stream_cut(&held, &mut plain);
                        prop_assert!(held.is_char_boundary(n));
                        held.drain(..n);
                        if starts {
                            break;
                        }
                    }
                }
            }

            /// A harmony reply streamed in pieces reads as whole, and never panics.
            #[test]
            fn harmony_channels_stream_as_whole(text in reply(), cut in 1usize..7, raw: bool) {
                use crate::harmony::Channels;
                let mut c = Channels::new(raw);
                let (mut r, mut a) = c.push(&text);
                let (r2, a2) = c.finish();
                r.push_str(&r2);
                a.push_str(&a2);
                let mut c = Channels::new(raw);
                let (mut rs, mut as_) = (String::new(), String::new());
                for piece in text.chars().collect::<Vec<_>>().chunks(cut) {
                    let (x, y) = c.push(&piece.iter().collect::<String>());
                    rs.push_str(&x);
                    as_.push_str(&y);
                }
                let (x, y) = c.finish();
                rs.push_str(&x);
                as_.push_str(&y);
                prop_assert_eq!((rs, as_), (r, a));
            }
        }
    }
}
