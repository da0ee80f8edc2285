//! Tool calling: the request's `tools` and `tool_choice` are checked here, rendered by the
//! model's own chat template (its `tools` variable), and the model's tool-call syntax is
//! parsed back into OpenAI `tool_calls`. With `tool_choice` `required` or a named function
//! the reply is constrained (a Lark grammar over the functions' JSON schemas) to be calls
//! in the template's syntax with valid arguments.
//!
//! Syntaxes, told apart by the template's source: Hermes / Qwen (`<tool_call>{"name": ...,
//! "arguments": {...}}</tool_call>`, one block per call), Llama 3.1+ (a JSON object
//! `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, calls separated
//! by `;`), Mistral (`[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`).

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
    /// `{"name": ..., "parameters": {...}}` (Llama 3.1+).
    Llama3,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (Mistral).
    Mistral,
}

impl Syntax {
    /// The syntax a chat template that takes `tools` teaches its model, if one we know.
    pub fn of_template(src: &str) -> Option<Syntax> {
        if src.contains("<tool_call>") {
            Some(Syntax::Hermes)
        } else if src.contains("[TOOL_CALLS]") {
            Some(Syntax::Mistral)
        } else if src.contains("<|python_tag|>") || src.contains("ipython") {
            Some(Syntax::Llama3)
        } else {
            None
        }
    }

    /// The key of a call's arguments object.
    fn args_key(self) -> &'static str {
        match self {
            Syntax::Llama3 => "parameters",
            Syntax::Hermes | Syntax::Mistral => "arguments",
        }
    }
}

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
        let mut functions = Vec::new();
        for t in list.as_array().into_iter().flatten() {
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
            let params = match t.pointer("/function/parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => {
                    return Err(bad(
                        format!("the parameters of {name} must be a JSON schema"),
                        "tools",
                    ))
                }
            };
            if functions.iter().any(|(n, _)| n == name) {
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
                "this model's chat template takes tools, but in a tool-call syntax gdsrun does not parse (it knows Hermes/Qwen <tool_call>, Llama 3 JSON and Mistral [TOOL_CALLS])",
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
        let mut schema = match &calls[..] {
            [one] => one.clone(),
            _ => json!({"anyOf": calls}),
        };
        // compact JSON, as for response_format: free whitespace lets small models ramble
        schema["x-guidance"] =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let many = self.parallel && matches!(self.choice, Choice::Required);
        let start = match (self.syntax, many) {
            (Syntax::Hermes, false) => "start: tc\n",
            (Syntax::Hermes, true) => "start: tc (\"\\n\" tc)*\n",
            (Syntax::Llama3, false) => "start: call\n",
            (Syntax::Llama3, true) => "start: call (\"; \" call)*\n",
            (Syntax::Mistral, _) => {
                return Err(bad(
                    "tool_choice required or a named function is not supported for Mistral's [TOOL_CALLS] syntax; use auto",
                    "tool_choice",
                ))
            }
        };
        let tc = match self.syntax {
            Syntax::Hermes => "tc: \"<tool_call>\\n\" call \"\\n</tool_call>\"\n",
            _ => "",
        };
        Ok(Some(Grammar::Lark(format!(
            "{start}{tc}call: %json {schema}\n"
        ))))
    }

    /// For streaming: of `held` (the reply's text not sent yet), how many bytes are surely
    /// content, and whether a call may start right after them (then the rest of the reply
    /// is held to the end). Hermes: text up to `<tool_call>`, a partial tag at the end held
    /// back; Llama 3 and Mistral, whose calls are the whole reply: held while the reply may
    /// still start a call, all text once it cannot (`plain` remembers that).
    pub fn stream_cut(&self, held: &str, plain: &mut bool) -> (usize, bool) {
        match self.syntax {
            Syntax::Hermes => {
                const TAG: &str = "<tool_call>";
                if let Some(at) = held.find(TAG) {
                    return (at, true);
                }
                let keep = (1..TAG.len())
                    .rev()
                    .find(|&n| {
                        n <= held.len()
                            && held.is_char_boundary(held.len() - n)
                            && TAG.starts_with(&held[held.len() - n..])
                    })
                    .unwrap_or(0);
                (held.len() - keep, false)
            }
            Syntax::Llama3 | Syntax::Mistral => {
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
        }
    }

    /// The calls in a reply, in OpenAI's form, and the text around them (`None` when there
    /// is none). No calls: the whole reply is content.
    pub fn parse(&self, text: &str) -> (Option<String>, Vec<Value>) {
        let mut calls = Vec::new();
        let mut content = String::new();
        match self.syntax {
            Syntax::Hermes => {
                const OPEN: &str = "<tool_call>";
                const CLOSE: &str = "</tool_call>";
                let mut rest = text;
                while let Some(at) = rest.find(OPEN) {
                    content.push_str(&rest[..at]);
                    let body = &rest[at + OPEN.len()..];
                    // the call is one JSON value (its strings may hold `</tool_call>`), then
                    // the closing tag (missing when the reply ended right after the value)
                    let read = json_prefix(body).and_then(|(v, n)| {
                        let tail = body[n..].trim_start();
                        let after = match tail.strip_prefix(CLOSE) {
                            Some(after) => after,
                            None if tail.is_empty() => tail,
                            None => return None,
                        };
                        Some((call_from(&v, "arguments")?, after))
                    });
                    match read {
                        Some((c, after)) => {
                            calls.push(c);
                            rest = after;
                        }
                        None => {
                            let end = body.find(CLOSE).map_or(body.len(), |e| e + CLOSE.len());
                            content.push_str(&rest[at..at + OPEN.len() + end]);
                            rest = &body[end..];
                        }
                    }
                }
                content.push_str(rest);
            }
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
                    let Some(c) = call_from(&v, "parameters") else {
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
                        .map(|c| call_from(c, "arguments"))
                        .collect::<Option<Vec<Value>>>()
                });
                match parsed {
                    Some(c) if !c.is_empty() => calls = c,
                    _ => content.push_str(text),
                }
            }
        }
        let content = content.trim();
        ((!content.is_empty()).then(|| content.to_string()), calls)
    }
}

/// The JSON value at the start of `text` (after white space) and the bytes it took.
fn json_prefix(text: &str) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let v = values.next()?.ok()?;
    Some((v, values.byte_offset()))
}

/// One call, `{"name": ..., key: {...}}`, in OpenAI's form.
fn call_from(v: &Value, key: &str) -> Option<Value> {
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
    Some(json!({
        "id": format!("call_{:016x}", crate::error::random_seed()),
        "type": "function",
        "function": {"name": name, "arguments": args},
    }))
}

/// The reply as OpenAI's assistant message: with `tools` that parse calls and calls in it,
/// those (`tool_calls`) and the text around them as `content`; otherwise the whole text as
/// `content`. The flag says whether it has calls (finish reason `tool_calls`).
pub fn assistant_message(tools: Option<&Tools>, text: &str) -> (Value, bool) {
    match tools.filter(|t| t.parses()).map(|t| t.parse(text)) {
        Some((content, calls)) if !calls.is_empty() => (
            json!({"role": "assistant", "content": content, "tool_calls": calls}),
            true,
        ),
        _ => (json!({"role": "assistant", "content": text}), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
