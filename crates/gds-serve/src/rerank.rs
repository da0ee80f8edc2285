//! `POST /rerank` (also `/reranking`, `/v1/rerank`, `/v1/reranking` and Cohere's
//! `/v2/rerank`): a reranker (a model with a classifier head, such as Qwen3-Reranker from
//! llama.cpp's converter) scores each document against the query, as llama-server's
//! `--reranking` answers in Jina's format (vLLM's and Cohere's too) or, when the documents
//! come as `texts`, in Hugging Face TEI's.
//!
//! Each document's prompt is the model's rerank template with the query and the document
//! put in (without one, llama.cpp's: BOS where the vocabulary adds it, the query, the
//! document), prefilled by the engine beside the other requests as an embedding is; the
//! final-normed hidden state of its last token goes through the head
//! ([`gds_runtime::rank::RankHead`]). Results are sorted by score, highest first, and cut to
//! `top_n`.

use crate::api::{encode_text, finish, parse, ApiError};
use crate::embeddings::{embed_all, TruncateFields, Truncation};
use crate::error::random_seed;
use crate::scheduler::Pooling;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Deserialize)]
struct RerankBody {
    #[serde(default)]
    query: Value,
    /// Jina's, Cohere's and vLLM's name for the texts (strings, or objects with a `text`).
    #[serde(default)]
    documents: Option<Value>,
    /// TEI's name: its presence asks for TEI's answer (a bare list, `score`).
    #[serde(default)]
    texts: Option<Value>,
    #[serde(default)]
    top_n: Option<Value>,
    /// Jina, Cohere, vLLM: each result carries its `document` (`{"text"}`).
    #[serde(default)]
    return_documents: Option<bool>,
    /// TEI: each result carries its `text`.
    #[serde(default)]
    return_text: Option<bool>,
    /// Echoed in the answer.
    #[serde(default)]
    model: Option<String>,
    /// vLLM's: keep this many tokens of each document's prompt.
    #[serde(flatten)]
    truncate: TruncateFields,
    /// vLLM's `use_activation`.
    #[serde(flatten)]
    activation: ActivationFields,
}

/// vLLM's `use_activation` (and its older names `activation` and `softmax`): `false` asks
/// for a reranker's scores before their activation ([`RankHead::logit`]).
///
/// [`RankHead::logit`]: gds_runtime::rank::RankHead::logit
#[derive(Deserialize)]
pub(crate) struct ActivationFields {
    #[serde(default)]
    use_activation: Option<bool>,
    #[serde(default)]
    activation: Option<bool>,
    #[serde(default)]
    softmax: Option<bool>,
}

impl ActivationFields {
    /// The score of a last-token hidden state through `head`, with or without its
    /// activation as asked (with, by default).
    pub(crate) fn score(&self, head: &gds_runtime::rank::RankHead, hidden: &[f32]) -> f32 {
        match self.use_activation.or(self.activation).or(self.softmax) {
            Some(false) => head.logit(hidden),
            _ => head.score(hidden),
        }
    }
}

/// `POST /rerank` and its aliases.
pub async fn rerank(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = answer(&st, &body).await;
    finish(&st, r)
}

async fn answer(st: &Arc<ServerState>, body: &Bytes) -> Result<Response, ApiError> {
    // (before the body is read, as llama-server answers a model that cannot rerank)
    let Some(head) = st.rank.clone() else {
        return Err(ApiError::status(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "This server does not support reranking: the model has no classifier head \
             (cls.output.weight); serve a reranker such as Qwen3-Reranker converted from \
             llama.cpp's GGUF",
        ));
    };
    if st.pooling.is_none() {
        return Err(ApiError::status(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "reranking is not available on this backend (it does not give hidden states); serve with --backend cpu",
        ));
    }
    let b: RerankBody = parse(body)?;
    let Value::String(query) = b.query else {
        return Err(ApiError::bad(if b.query.is_null() {
            "\"query\" must be provided"
        } else {
            "\"query\" must be a string"
        })
        .param("query"));
    };
    let tei = b.texts.is_some();
    let (field, list) = match (b.documents, b.texts) {
        (Some(d), _) => ("documents", d),
        (None, Some(t)) => ("texts", t),
        (None, None) => {
            return Err(
                ApiError::bad("\"documents\" must be a non-empty string array").param("documents"),
            )
        }
    };
    let docs = documents(field, list)?;
    let top_n = match b.top_n {
        None | Some(Value::Null) => docs.len(),
        Some(v) => match v.as_u64() {
            Some(n) => (n as usize).min(docs.len()),
            None => {
                return Err(
                    ApiError::bad(format!("top_n {v}: a count of results, 0 or more"))
                        .param("top_n"),
                )
            }
        },
    };
    let truncate = b.truncate.parse(st)?;
    let mut prompts = Vec::with_capacity(docs.len());
    for d in &docs {
        prompts.push(prompt(st, head.template(), &query, d).await?);
    }
    Truncation::apply(truncate, &mut prompts);
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let hidden = embed_all(st, prompts, Pooling::Last, "documents").await?;
    let mut scored: Vec<(usize, f32)> = hidden
        .iter()
        .map(|h| b.activation.score(&head, h))
        .enumerate()
        .collect();
    // highest first; a NaN (a broken head) last, never a panic
    scored.sort_by(|a, b| {
        let key = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
        key(b.1).total_cmp(&key(a.1))
    });
    scored.truncate(top_n);
    let with_text = if tei {
        b.return_text.unwrap_or(false)
    } else {
        b.return_documents.unwrap_or(false)
    };
    let results: Vec<Value> = scored
        .into_iter()
        .map(|(index, score)| {
            let mut r = json!({"index": index});
            r[if tei { "score" } else { "relevance_score" }] = json!(score);
            if with_text {
                if tei {
                    r["text"] = json!(docs[index]);
                } else {
                    r["document"] = json!({"text": docs[index]});
                }
            }
            r
        })
        .collect();
    if tei {
        return Ok(Json(Value::Array(results)).into_response());
    }
    Ok(Json(json!({
        "id": format!("rerank-{:016x}", random_seed()),
        "model": b.model.unwrap_or_else(|| st.model_name().to_string()),
        "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }))
    .into_response())
}

/// The texts of `documents` (or `texts`): strings, or objects with a string `text` (Jina's
/// and Cohere's form); 1 to [`crate::embeddings::MAX_INPUTS`] of them.
fn documents(field: &'static str, list: Value) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param(field);
    let Value::Array(items) = list else {
        return Err(bad(format!("\"{field}\" must be a non-empty string array")));
    };
    if items.is_empty() {
        return Err(bad(format!("\"{field}\" must be a non-empty string array")));
    }
    let most = crate::embeddings::MAX_INPUTS;
    if items.len() > most {
        return Err(bad(format!("{} {field}; at most {most}", items.len())));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, d)| match d {
            Value::String(s) => Ok(s),
            Value::Object(mut o) => match o.remove("text") {
                Some(Value::String(s)) => Ok(s),
                _ => Err(bad(format!(
                    "{field}[{i}] is an object without a string \"text\""
                ))),
            },
            _ => Err(bad(format!(
                "{field}[{i}] must be a string (or an object with a string \"text\")"
            ))),
        })
        .collect()
}

/// One document's prompt as tokens: the template with the texts put in (special-token
/// texts parsed, as llama-server and transformers' tokenizers do), else llama.cpp's form.
pub(crate) async fn prompt(
    st: &ServerState,
    template: Option<&str>,
    query: &str,
    doc: &str,
) -> Result<Vec<u32>, ApiError> {
    if let Some(t) = template {
        let text = gds_runtime::rank::fill(t, query, doc);
        return encode_text(st, text, false, true, "documents").await;
    }
    let mut out: Vec<u32> = st
        .tokenizer
        .add_bos()
        .then(|| st.tokenizer.bos())
        .flatten()
        .into_iter()
        .collect();
    out.extend(encode_text(st, query.to_string(), false, false, "query").await?);
    out.extend(encode_text(st, doc.to_string(), false, false, "documents").await?);
    if out.is_empty() {
        return Err(ApiError::bad("the query and a document have no tokens").param("documents"));
    }
    Ok(out)
}
