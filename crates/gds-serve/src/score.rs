//! `POST /score` (also `/v1/score`): vLLM's Score API, a score for each pair of texts.
//!
//! The pairs: `queries` with `documents` (or `items`), `data_1` with `data_2`, or `text_1`
//! with `text_2` (vLLM's four request forms); each side a string or a list of strings, paired
//! 1:1, 1:N (the one first text with each second text) or N:N. The answer is vLLM's:
//! `{"object": "list", "data": [{"index", "object": "score", "score"}], "usage"}`, in the
//! order of the pairs.
//!
//! How a pair is scored depends on the model, as in vLLM: a reranker (a classifier head, see
//! [`crate::rerank`]) scores the pair's prompt as `/rerank` scores a document (the same
//! number; `use_activation: false` gives its log-odds, whose sigmoid it is), and any other
//! model gives the cosine similarity of the two texts' embeddings (pooled as
//! `/v1/embeddings` pools them).

use crate::api::{finish, parse, ApiError};
use crate::embeddings::{
    embed_all, encode_input, one_vector, TruncateFields, Truncation, MAX_INPUTS,
};
use crate::error::random_seed;
use crate::rerank::{prompt, ActivationFields};
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
struct ScoreBody {
    #[serde(default)]
    queries: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    items: Option<Value>,
    #[serde(default)]
    data_1: Option<Value>,
    #[serde(default)]
    data_2: Option<Value>,
    #[serde(default)]
    text_1: Option<Value>,
    #[serde(default)]
    text_2: Option<Value>,
    /// Keep this many tokens of each prompt.
    #[serde(flatten)]
    truncate: TruncateFields,
    /// `use_activation: false`: a reranker's scores before their activation.
    #[serde(flatten)]
    activation: ActivationFields,
    /// Echoed in the answer.
    #[serde(default)]
    model: Option<String>,
}

/// `POST /score` and `/v1/score`.
pub async fn score(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = answer(&st, &body).await;
    finish(&st, r)
}

async fn answer(st: &Arc<ServerState>, body: &Bytes) -> Result<Response, ApiError> {
    if st.pooling.is_none() {
        return Err(ApiError::status(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "scoring is not available on this backend (it does not give hidden states); serve with --backend cpu",
        ));
    }
    let b: ScoreBody = parse(body)?;
    let ((n1, first), (n2, second)) = sides(&b)?;
    let first = texts(n1, first.clone())?;
    let second = texts(n2, second.clone())?;
    if first.len() > 1 && first.len() != second.len() {
        return Err(ApiError::bad(format!(
            "{} {n1} and {} {n2}: the lengths must be 1:1, 1:N or N:N",
            first.len(),
            second.len()
        ))
        .param(n1));
    }
    let truncate = b.truncate.parse(st)?;
    let pair = |i: usize| (&first[if first.len() == 1 { 0 } else { i }], &second[i]);
    let (scores, tokens) = if let Some(head) = st.rank.clone() {
        // a reranker: each pair's prompt through the head
        let mut prompts = Vec::with_capacity(second.len());
        for i in 0..second.len() {
            let (q, d) = pair(i);
            prompts.push(prompt(st, head.template(), q, d).await?);
        }
        Truncation::apply(truncate, &mut prompts);
        let tokens: usize = prompts.iter().map(Vec::len).sum();
        let hidden = embed_all(st, prompts, Pooling::Last, n2).await?;
        let scores: Vec<f32> = hidden
            .iter()
            .map(|h| b.activation.score(&head, h))
            .collect();
        (scores, tokens)
    } else {
        // any other model: the cosine similarity of the two embeddings
        let pooling = one_vector(st)?;
        let mut ones = Vec::with_capacity(first.len());
        for t in &first {
            ones.push(encode_input(st, t.clone(), n1).await?);
        }
        let mut twos = Vec::with_capacity(second.len());
        for t in &second {
            twos.push(encode_input(st, t.clone(), n2).await?);
        }
        Truncation::apply(truncate, &mut ones);
        Truncation::apply(truncate, &mut twos);
        let tokens: usize = ones.iter().chain(&twos).map(Vec::len).sum();
        let a = embed_all(st, ones, pooling, n1).await?;
        let b = embed_all(st, twos, pooling, n2).await?;
        let scores = (0..b.len())
            .map(|i| cosine(&a[if a.len() == 1 { 0 } else { i }], &b[i]))
            .collect();
        (scores, tokens)
    };
    let data: Vec<Value> = scores
        .into_iter()
        .enumerate()
        .map(|(index, score)| json!({"index": index, "object": "score", "score": score}))
        .collect();
    Ok(Json(json!({
        "id": format!("score-{:016x}", random_seed()),
        "object": "list",
        "created": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        "model": b.model.unwrap_or_else(|| st.model_name().to_string()),
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }))
    .into_response())
}

type Side<'a> = (&'static str, &'a Value);

/// The request's two sides, named: the first of vLLM's forms present.
fn sides(b: &ScoreBody) -> Result<(Side<'_>, Side<'_>), ApiError> {
    let forms: [(&'static str, &Option<Value>, &'static str, &Option<Value>); 4] = [
        ("queries", &b.queries, "documents", &b.documents),
        ("queries", &b.queries, "items", &b.items),
        ("data_1", &b.data_1, "data_2", &b.data_2),
        ("text_1", &b.text_1, "text_2", &b.text_2),
    ];
    for (n1, v1, n2, v2) in forms {
        if let (Some(a), Some(b)) = (v1, v2) {
            return Ok(((n1, a), (n2, b)));
        }
    }
    // the form that was begun names what is missing
    let missing = forms
        .iter()
        .find_map(|&(n1, v1, n2, v2)| match (v1.is_some(), v2.is_some()) {
            (true, false) => Some(n2),
            (false, true) => Some(n1),
            _ => None,
        })
        .unwrap_or("text_1");
    Err(ApiError::bad(format!(
        "\"{missing}\" must be provided: the pairs are queries with documents (or items), \
         data_1 with data_2, or text_1 with text_2"
    ))
    .param(missing))
}

/// A side's texts: a string, or a non-empty list of at most [`MAX_INPUTS`] strings.
fn texts(field: &'static str, v: Value) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| Err(ApiError::bad(m).param(field));
    match v {
        Value::String(s) => Ok(vec![s]),
        Value::Array(a) if a.is_empty() => bad(format!("\"{field}\" is an empty list")),
        Value::Array(a) if a.len() > MAX_INPUTS => {
            bad(format!("{} {field}; at most {MAX_INPUTS}", a.len()))
        }
        Value::Array(a) => a
            .into_iter()
            .enumerate()
            .map(|(i, x)| match x {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::bad(format!(
                    "{field}[{i}] must be a string (this server scores text only)"
                ))
                .param(field)),
            })
            .collect(),
        _ => bad(format!(
            "\"{field}\" must be a string or a list of strings (this server scores text only)"
        )),
    }
}

/// The cosine similarity of two vectors (0 where one is all zeros).
fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    let norm = (aa * bb).sqrt();
    if norm > 0.0 {
        (ab / norm) as f32
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> ScoreBody {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_forms_pair_their_sides_and_name_what_is_missing() {
        let b = body(json!({"text_1": "q", "text_2": ["a", "b"]}));
        let ((n1, _), (n2, v2)) = sides(&b).unwrap();
        assert_eq!((n1, n2), ("text_1", "text_2"));
        assert_eq!(texts(n2, v2.clone()).unwrap(), ["a", "b"]);
        let b = body(json!({"queries": "q", "items": ["a"]}));
        assert_eq!(sides(&b).unwrap().1 .0, "items");
        let b = body(json!({"data_1": "q"}));
        let e = sides(&b).unwrap_err();
        assert!(
            e.text().contains("\"data_2\" must be provided"),
            "{}",
            e.text()
        );
        assert!(texts("text_2", json!([])).is_err());
        assert!(texts("text_2", json!([1])).is_err());
        assert!(texts("text_2", json!({"content": []})).is_err());
    }

    #[test]
    fn cosine_is_the_angle_and_zero_for_a_zero_vector() {
        assert!((cosine(&[1.0, 0.0], &[2.0, 0.0]) - 1.0).abs() < 1e-7);
        assert!(cosine(&[1.0, 0.0], &[0.0, 3.0]).abs() < 1e-7);
        assert!((cosine(&[1.0, 1.0], &[-1.0, -1.0]) + 1.0).abs() < 1e-7);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
    }
}
