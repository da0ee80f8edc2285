//! Chat templates: the Jinja template shipped in `tokenizer_config.json`, compiled and
//! rendered by [`gds_format::chat_template`] (the one policy for template code from a model
//! file: bounded source, parser recursion, instructions and output), with this crate's
//! error type.

use crate::error::{Result, RuntimeError};
pub use gds_format::chat_template::{strftime, Message};

/// The conversation `messages` from `from` on, the system (and developer) messages before
/// `from` kept in front: what is left when the oldest messages are left out to fit a context
/// ([`crate::TextTokenizer::encode_chat_fitting`]).
pub fn without_oldest(messages: &[Message], from: usize) -> Vec<Message> {
    let system = |m: &&Message| matches!(m.role.as_str(), "system" | "developer");
    messages[..from]
        .iter()
        .filter(system)
        .chain(&messages[from..])
        .cloned()
        .collect()
}

/// A compiled chat template.
pub struct ChatTemplate(gds_format::chat_template::ChatTemplate);

fn template_error(e: gds_format::chat_template::TemplateError) -> RuntimeError {
    RuntimeError::Template(e.to_string())
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings the template sees.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        gds_format::chat_template::ChatTemplate::new(source, bos_token, eos_token)
            .map(ChatTemplate)
            .map_err(template_error)
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        self.0.source()
    }

    /// Renders a conversation.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.0
            .render(messages, add_generation_prompt)
            .map_err(template_error)
    }

    /// Whether the template renders a `tools` variable (function definitions), as the
    /// tool-calling templates of Qwen, Llama 3.1+, Mistral and Hermes do.
    pub fn takes_tools(&self) -> bool {
        self.0.takes_tools()
    }

    /// Renders a conversation, with `tools` (OpenAI's list of
    /// `{"type": "function", "function": {...}}`) in the template's `tools` variable.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        self.render_with(messages, add_generation_prompt, tools, None)
    }

    /// [`ChatTemplate::render_with_tools`] with more template variables (`chat_template_kwargs`).
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        vars: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String> {
        self.0
            .render_with(messages, add_generation_prompt, tools, vars)
            .map_err(template_error)
    }
}
