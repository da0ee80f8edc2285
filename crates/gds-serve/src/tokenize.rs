//! The tokenizer over HTTP: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.
//!
//! Evaluation harnesses tokenize on the client to split a request into context and
//! continuation; with these endpoints they use the served model's own tokenizer instead of
//! downloading one (lm-evaluation-harness's `local-completions` finds them by itself and
//! switches to its "remote" tokenizer). Field names are vLLM's, with llama-server's accepted
//! too (`content`, `add_special`, `with_pieces`).
//!
//! Unlike a raw completion prompt, `/tokenize` parses special-token texts by default (as both
//! vLLM and llama-server do, and as Hugging Face tokenizers do): it is a tool for seeing token
//! ids, and what a client then sends as ids is scored exactly as given.

use crate::api::{chat_prompt, encode_text, finish, parse, ApiError, ChatBody, ChatMessage};
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Deserialize, Debug)]
struct TokenizeBody {
    /// The text (vLLM's name).
    #[serde(default)]
    prompt: Option<String>,
    /// The text (llama-server's name).
    #[serde(default)]
    content: Option<String>,
    /// A chat instead of text: the body read as a chat request's and rendered as
    /// `/v1/chat/completions` renders it (vLLM's fields: `add_generation_prompt`,
    /// `continue_final_message`, `tools`, `chat_template_kwargs`, `documents`,
    /// `chat_template`), the tokens it would prefill.
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    /// Prepend BOS when the model adds one (default true with `prompt`, false with
    /// `content`, as vLLM and llama-server each default).
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_special: Option<bool>,
    /// Special-token texts become their tokens (default true).
    #[serde(default)]
    parse_special: Option<bool>,
    /// Also return each token's text.
    #[serde(default)]
    return_token_strs: Option<bool>,
    #[serde(default)]
    with_pieces: Option<bool>,
}

#[derive(Deserialize, Debug)]
struct DetokenizeBody {
    tokens: Vec<Value>,
}

/// `POST /tokenize`: `{"tokens": [...], "count", "max_model_len"}`, with `token_strs` when
/// asked.
pub async fn tokenize_handler(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let b: TokenizeBody = parse(&body)?;
        // BOS by default as vLLM adds it for `prompt`; not for llama-server's `content`
        // (its `add_special` defaults to false)
        let add_bos = b
            .add_special_tokens
            .or(b.add_special)
            .unwrap_or(b.content.is_none());
        let special = b.parse_special.unwrap_or(true);
        let ids = match (b.prompt.or(b.content), b.messages) {
            (Some(text), None) => encode_text(&st, text, add_bos, special, "prompt").await?,
            (None, Some(_)) => {
                let chat: ChatBody = parse(&body)?;
                chat_prompt(&st, &chat).await?.0
            }
            (Some(_), Some(_)) => {
                return Err(ApiError::bad("give prompt or messages, not both").param("messages"))
            }
            (None, None) => {
                return Err(ApiError::bad("give the text to tokenize as prompt").param("prompt"))
            }
        };
        let mut out = json!({"tokens": ids, "count": ids.len(), "max_model_len": st.ctx});
        if b.with_pieces == Some(true) {
            // llama-server's form: each token an object with its text, or its bytes when
            // they are not text on their own (part of a character)
            let pieces: Vec<Value> = ids
                .iter()
                .map(|&id| json!({"id": id, "piece": piece(&st, id)}))
                .collect();
            out["tokens"] = Value::Array(pieces);
        } else if b.return_token_strs == Some(true) {
            let inner = st.tokenizer.inner();
            let strs: Vec<Value> = ids
                .iter()
                .map(|&i| inner.id_to_token(i).map_or(Value::Null, Value::String))
                .collect();
            out["token_strs"] = Value::Array(strs);
        }
        Ok(Json(out).into_response())
    }
    .await;
    finish(&st, r)
}

/// A token's text, or its bytes (a list of numbers) when they are not valid UTF-8 alone
/// (byte-level BPE pieces of a character, SentencePiece's byte tokens `<0xAB>`:
/// [`TextTokenizer::token_bytes`](gds_runtime::tokenizer::TextTokenizer::token_bytes)).
fn piece(st: &ServerState, id: u32) -> Value {
    match String::from_utf8(st.tokenizer.token_bytes(id)) {
        Ok(t) => Value::String(t),
        Err(e) => json!(e.into_bytes()),
    }
}

/// `POST /detokenize`: the text of `tokens` (special tokens kept), as `prompt` (vLLM) and
/// `content` (llama-server).
pub async fn detokenize_handler(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let b: DetokenizeBody = parse(&body)?;
        // no sequence outgrows the context; more tokens would only make the reply large
        // (a 4 MiB body of long tokens decodes to ~90 MB)
        if b.tokens.len() > st.ctx {
            return Err(ApiError::bad(format!(
                "{} tokens: at most {} (the context) are decoded at once",
                b.tokens.len(),
                st.ctx
            ))
            .param("tokens"));
        }
        let ids = b
            .tokens
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .filter(|&t| (t as usize) < st.vocab)
            })
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "tokens must be token ids in the vocabulary (0..{})",
                    st.vocab
                ))
                .param("tokens")
            })?;
        // on the blocking pool, as tokenizing is
        let tok = st.tokenizer.clone();
        let text = tokio::task::spawn_blocking(move || tok.inner().decode(&ids, false))
            .await
            .map_err(|e| ApiError::server(format!("decoding failed: {e}")))?
            .map_err(|e| ApiError::bad(format!("decoding failed: {e}")).param("tokens"))?;
        Ok(Json(json!({"prompt": text, "content": text})).into_response())
    }
    .await;
    finish(&st, r)
}

/// `GET /tokenizer_info`: the special tokens, the chat template and the context length.
pub async fn tokenizer_info(State(st): State<Arc<ServerState>>) -> Response {
    let r = async {
        let t = &st.tokenizer;
        let text = |id: Option<u32>| id.and_then(|i| t.inner().id_to_token(i));
        Ok(Json(json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(t.bos()),
            "bos_token_id": t.bos(),
            "eos_token": text(t.eos()),
            "eos_token_id": t.eos(),
            "pad_token": null,
            "add_bos_token": t.add_bos(),
            "end_of_generation_ids": t.eog_ids(),
            "chat_template": t.chat_template().map(|c| c.source()),
            "model_max_length": st.ctx,
            "vocab_size": st.vocab,
        }))
        .into_response())
    }
    .await;
    finish(&st, r)
}
