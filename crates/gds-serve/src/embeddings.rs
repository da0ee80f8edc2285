//! `POST /v1/embeddings` (OpenAI's Embeddings API): each input's prompt is prefilled by the
//! engine beside the other requests, its final-normed hidden states pooled (`--pooling`:
//! mean, last token or first token) and normalized, as llama-server's `--embeddings` and
//! vLLM's embedding models answer.
//!
//! Input: `input` a string, a list of strings, a list of token ids, or a list of token-id
//! lists (at most [`MAX_INPUTS`], a window of them in the engine at a time, as a request's
//! choices); `encoding_format` `float` (default) or `base64` (the
//! little-endian f32 bytes, what the `openai` Python client asks for); `dimensions` (keep the
//! first N, then normalize: Matryoshka-trained models); llama-server's `embd_normalize` (-1
//! none, 0 max-abs scaled to int16, 1 taxicab, 2 Euclidean: the default, >2 p-norm).

use crate::api::{encode_text, enqueue, finish, in_vocabulary, parse, token_ids, window, ApiError};
use crate::scheduler::{Event, Pooling, Request};
pub(crate) use crate::truncation::{TruncateFields, Truncation};
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use futures_util::FutureExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Most inputs in one request (OpenAI's limit).
pub(crate) const MAX_INPUTS: usize = 2048;

/// Most values in one answer of per-token embeddings (`--pooling none`): 32 MiB of f32,
/// some 100 MB of JSON (2048 tokens of a 4096-wide model).
pub(crate) const MAX_TOKEN_VALUES: usize = 8 << 20;

/// One input's answer of per-token embeddings.
#[derive(serde::Serialize)]
struct TokenRows<'a> {
    index: usize,
    embedding: Vec<&'a [f32]>,
}

#[derive(Deserialize)]
struct EmbeddingsBody {
    input: Value,
    /// Echoed in the answer, as the chat and completions endpoints echo it.
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
    #[serde(default)]
    embd_normalize: Option<i64>,
    /// vLLM's: keep this many tokens of each input.
    #[serde(flatten)]
    truncate: TruncateFields,
}

/// `POST /v1/embeddings`.
pub async fn embeddings(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = answer(&st, &body).await;
    finish(&st, r)
}

/// `POST /embeddings` (no `/v1`): OpenAI's answer, for clients whose base URL lacks `/v1`
/// (as vLLM serves it), but llama-server's (its `/embedding`) with `--pooling none`, where
/// llama-server's own `/embeddings` gives every token's vector and OpenAI's form cannot.
pub async fn embeddings_bare(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    if st.pooling == Some(Pooling::None) {
        return embedding_native(State(st), body).await;
    }
    embeddings(State(st), body).await
}

async fn answer(st: &Arc<ServerState>, body: &Bytes) -> Result<Response, ApiError> {
    let b: EmbeddingsBody = parse(body)?;
    let pooling = one_vector(st)?;
    let base64 = match b.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => {
            return Err(ApiError::bad(format!(
                "encoding_format {f:?}: expected \"float\" or \"base64\""
            ))
            .param("encoding_format"))
        }
    };
    let keep = dimensions(st, b.dimensions.map(Value::from).as_ref())?;
    let norm = embd_normalize(b.embd_normalize)?;
    let truncate = b.truncate.parse(st)?;
    let model = b.model.unwrap_or_else(|| st.model_name().to_string());
    let mut prompts = inputs(st, b.input).await?;
    Truncation::apply(truncate, &mut prompts);
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let vectors = embed_all(st, prompts, pooling, "input").await?;
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, mut v)| {
            v.truncate(keep);
            normalize(&mut v, norm);
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

/// llama-server's `embd_normalize` (2, Euclidean, when absent), checked.
fn embd_normalize(asked: Option<i64>) -> Result<i64, ApiError> {
    let norm = asked.unwrap_or(2);
    if norm < -1 {
        return Err(ApiError::bad(format!(
            "embd_normalize {norm}: -1 (none), 0 (max-abs), 1 (taxicab), 2 (Euclidean) or a larger p"
        ))
        .param("embd_normalize"));
    }
    Ok(norm)
}

#[derive(Deserialize)]
struct NativeBody {
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    embd_normalize: Option<i64>,
}

/// `POST /embedding`: llama-server's own (legacy) embeddings endpoint. `content` (or
/// `input`) in the shapes `/v1/embeddings` takes; the answer is llama-server's list, one
/// `{"index", "embedding": [vector]}` per input (its pooled vector inside a list; with
/// `--pooling none` one vector per token, not normalized, as llama-server gives them).
pub async fn embedding_native(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = native_answer(&st, &body).await;
    finish(&st, r)
}

async fn native_answer(st: &Arc<ServerState>, body: &Bytes) -> Result<Response, ApiError> {
    let b: NativeBody = parse(body)?;
    let pooling = pooling(st)?;
    let norm = embd_normalize(b.embd_normalize)?;
    let input = b.input.or(b.content).ok_or_else(|| {
        ApiError::bad("\"input\" or \"content\" must be provided").param("content")
    })?;
    let prompts = inputs(st, input).await?;
    if pooling == Pooling::None {
        // a vector per token: bounded by what the answer may hold
        let values = prompts.iter().map(Vec::len).sum::<usize>() * st.n_embd;
        if values > MAX_TOKEN_VALUES {
            return Err(ApiError::bad(format!(
                "{} tokens of {} values each ({values}) is more than one answer of per-token \
                 embeddings holds ({MAX_TOKEN_VALUES}); send fewer or shorter inputs",
                values / st.n_embd,
                st.n_embd
            ))
            .param("input"));
        }
    }
    let mut vectors = embed_all(st, prompts, pooling, "input").await?;
    if pooling == Pooling::None {
        // every token's state, as llama-server gives it: not normalized (serialized
        // straight from the floats, no JSON tree of millions of values)
        let out: Vec<TokenRows> = vectors
            .iter()
            .enumerate()
            .map(|(index, v)| TokenRows {
                index,
                embedding: v.chunks_exact(st.n_embd).collect(),
            })
            .collect();
        return Ok(Json(out).into_response());
    }
    for v in &mut vectors {
        normalize(v, norm);
    }
    let out: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| json!({"index": index, "embedding": [v]}))
        .collect();
    Ok(Json(Value::Array(out)).into_response())
}

/// How many of an embedding's first dimensions `dimensions` keeps (Matryoshka-trained
/// models): all when absent, else 1 up to the hidden width.
pub(crate) fn dimensions(st: &ServerState, asked: Option<&Value>) -> Result<usize, ApiError> {
    let d = st.n_embd;
    match asked {
        None | Some(Value::Null) => Ok(d),
        Some(v) => match v.as_u64() {
            Some(n) if (1..=d as u64).contains(&n) => Ok(n as usize),
            _ => Err(ApiError::bad(format!(
                "dimensions {v}: this model's embeddings have {d}; ask for 1..={d}"
            ))
            .param("dimensions")),
        },
    }
}

/// How this server pools hidden states into one vector an input, or the error saying it
/// gives none: with `--pooling none` (a vector per token) only llama-server's `/embedding`
/// answers, as llama-server refuses its OpenAI endpoint then.
pub(crate) fn one_vector(st: &ServerState) -> Result<Pooling, ApiError> {
    match pooling(st)? {
        Pooling::None => Err(ApiError::bad(
            "this server pools nothing (--pooling none: a vector per token), which is not \
             OpenAI-compatible; use /embedding, or serve with another --pooling",
        )
        .code("unsupported")),
        p => Ok(p),
    }
}

/// How this server pools hidden states, or the error saying it gives none.
pub(crate) fn pooling(st: &ServerState) -> Result<Pooling, ApiError> {
    st.pooling.ok_or_else(|| {
        ApiError::bad(format!(
            "embeddings are not available on the {} backend (it does not give hidden states); serve with --backend cpu",
            st.metrics.backend.get().copied().unwrap_or("current")
        ))
        .code("unsupported")
    })
}

/// The hidden states of `prompts` pooled by `pooling` (not normalized), each checked
/// against the context and the vocabulary (errors name `param`); a window of them in the
/// engine at a time, as a request's choices (batched with whatever runs; a list of thousands
/// neither fills the queue nor holds others back).
pub(crate) async fn embed_all(
    st: &ServerState,
    prompts: Vec<Vec<u32>>,
    pooling: Pooling,
    param: &'static str,
) -> Result<Vec<Vec<f32>>, ApiError> {
    for p in &prompts {
        // (nothing is generated: an input may fill the context)
        if p.len() > st.ctx {
            return Err(ApiError::bad(format!(
                "an input of {} tokens is too large for this server's context of {}",
                p.len(),
                st.ctx
            ))
            .param(param)
            .code("context_length_exceeded"));
        }
        in_vocabulary(st, p, param)?;
    }
    let runs: Vec<_> = prompts
        .into_iter()
        .map(|p| embed_one(st, p, pooling).boxed())
        .collect();
    stream::iter(runs)
        .buffered(window(st, 1))
        .try_collect()
        .await
}

/// One input through the engine: its pooled (not yet normalized) hidden state.
async fn embed_one(
    st: &ServerState,
    prompt: Vec<u32>,
    pooling: Pooling,
) -> Result<Vec<f32>, ApiError> {
    let (mut rx, _ended) = enqueue(st, |tx, ended| Request {
        embed: Some(pooling),
        ..Request::plain(prompt, st.default_sampler.clone(), tx, ended)
    })?;
    loop {
        match rx.recv().await {
            Some(Event::Embedding(v)) => return Ok(v),
            Some(Event::Error(e)) => return Err(ApiError::server(e)),
            Some(_) => {}
            None => return Err(ApiError::server("the engine dropped the request")),
        }
    }
}

/// One text input as tokens, as `/v1/embeddings` makes them: BOS where the model adds one,
/// special-token texts parsed (as llama-server and transformers' tokenizers do); an empty
/// text is an error naming `param`.
pub(crate) async fn encode_input(
    st: &ServerState,
    s: String,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    if s.is_empty() {
        return Err(ApiError::bad(format!("an {param} is an empty string")).param(param));
    }
    encode_text(st, s, true, true, param).await
}

/// The inputs as token lists: a string, a list of strings, a list of token ids (one input),
/// or a list of token-id lists; and llama-server's forms: texts and token ids mixed in one
/// list (a list holding a token id is one input), `{"prompt_string": ...}` and
/// `{"content": [{"type": "text", "text": ...}]}` objects.
async fn inputs(st: &ServerState, input: Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let shape = "input must be a string, a list of strings, a list of token ids or a list of token-id lists";
    let bad = |m: String| Err(ApiError::bad(m).param("input"));
    let ids = |v: &[Value]| token_ids(v, "input");
    let text = |s: String| encode_input(st, s, "input");
    // llama-server's: texts and ids in one list, or an object (its `/completion` prompts)
    let mixed = |v: Value| async move {
        let parts = crate::native::sub_prompt(&v).map_err(|e| e.param("input"))?;
        crate::native::encode_parts(st, parts)
            .await
            .map_err(|e| e.param("input"))
    };
    let mut out = Vec::new();
    match input {
        Value::String(s) => out.push(text(s).await?),
        Value::Array(v) if v.is_empty() => return bad("input is an empty list".into()),
        // one input of token ids (the context bounds it, not the count of inputs)
        Value::Array(v) if v.iter().all(Value::is_number) => out.push(ids(&v)?),
        Value::Array(v) if v.iter().any(Value::is_number) => {
            out.push(mixed(Value::Array(v)).await?)
        }
        Value::Array(v) if v.len() > MAX_INPUTS => {
            return bad(format!("{} inputs; at most {MAX_INPUTS}", v.len()))
        }
        Value::Array(v) => {
            for (i, x) in v.into_iter().enumerate() {
                match x {
                    Value::String(s) => out.push(text(s).await?),
                    Value::Array(t) if t.is_empty() => {
                        return bad(format!("input[{i}] is an empty list"))
                    }
                    Value::Array(t) if t.iter().all(Value::is_number) => out.push(ids(&t)?),
                    Value::Array(_) | Value::Object(_) => out.push(mixed(x).await?),
                    _ => return bad(format!("input[{i}]: {shape}")),
                }
            }
        }
        Value::Object(_) => out.push(mixed(input).await?),
        _ => return bad(shape.into()),
    }
    if out.iter().any(Vec::is_empty) {
        return bad("an input has no tokens".into());
    }
    Ok(out)
}

/// Normalizes `v` as llama.cpp's `common_embd_normalize`: -1 none, 0 max-abs scaled to
/// int16's range, 1 taxicab, 2 Euclidean, p > 2 the p-norm. A zero vector stays zero.
pub(crate) fn normalize(v: &mut [f32], norm: i64) {
    let sum = match norm {
        -1 => return,
        0 => v.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64)) / 32760.0,
        1 => v.iter().map(|&x| x.abs() as f64).sum(),
        2 => v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt(),
        p => {
            // scaled by the largest value first: the p-th powers of large p would overflow
            // (the norm tends to that largest value)
            let top = v.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
            if top == 0.0 {
                0.0
            } else {
                top * v
                    .iter()
                    .map(|&x| (x.abs() as f64 / top).powf(p as f64))
                    .sum::<f64>()
                    .powf(1.0 / p as f64)
            }
        }
    };
    let scale = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for x in v {
        *x = (*x as f64 * scale) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn normalizations_follow_llama_cpp() {
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, 2);
        assert_eq!(v, [0.6, -0.8]);
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, 1);
        assert!((v[0] - 3.0 / 7.0).abs() < 1e-7 && (v[1] + 4.0 / 7.0).abs() < 1e-7);
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, 0);
        assert!((v[1] + 32760.0).abs() < 1e-2, "{v:?}");
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, -1);
        assert_eq!(v, [3.0, -4.0]);
        let mut v = vec![0.0, 0.0];
        normalize(&mut v, 2);
        assert_eq!(v, [0.0, 0.0]);
        // large p: the p-norm, no overflow to zero (it tends to the largest value)
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, 3);
        let n3 = (27.0f64 + 64.0).powf(1.0 / 3.0);
        assert!((v[1] as f64 + 4.0 / n3).abs() < 1e-6, "{v:?}");
        let mut v = vec![30.0, -40.0];
        normalize(&mut v, 250);
        assert!(
            (v[1] + 1.0).abs() < 1e-6 && (v[0] - 0.75).abs() < 1e-6,
            "{v:?}"
        );
    }
}
