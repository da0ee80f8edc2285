//! llama-server's own API, beside OpenAI's and Anthropic's, for the tools written against
//! llama.cpp's server: `POST /completion` (its native completion), `POST /infill` (its
//! fill-in-the-middle, for code editors), `GET /props`, `GET /slots`, `POST /apply-template`
//! and `GET /v1/health`.
//!
//! `/completion` takes llama-server's prompt forms: a string, token ids, strings and ids
//! mixed in one prompt (`[12, 34, "text", 56]`), `{"prompt_string": ...}`, or a list of
//! prompts (then the answer is a list, one object per prompt and `n_cmpl` choice). A string
//! is tokenized with special-token texts read as their tokens and BOS added when the model
//! adds one, as llama-server does. Its fields: `n_predict` (`-1`: up to the context; `0`: the
//! prompt is evaluated, nothing generated), `n_cmpl`, `n_probs`, `return_tokens`,
//! `response_fields`, `samplers`, `logit_bias` as `[[token or text, bias or false], ...]` or
//! an object, `repeat_last_n`, and the sampling, stop, grammar and seed fields OpenAI's
//! completions take. The answer: `content`, `tokens`, `stop`, `stop_type`
//! (`eos`/`limit`/`word`), `stopping_word`, `tokens_predicted`, `tokens_evaluated`,
//! `tokens_cached`, `truncated`, `has_new_line`, `prompt`, `generation_settings`, `timings`
//! and, with `n_probs`, `completion_probabilities`. Streamed, each event is one such object
//! with `stop: false`, the new text and its token ids; the last has `stop: true` and the rest,
//! and no `[DONE]` follows (as llama-server streams this endpoint).
//!
//! llama.cpp's samplers (Mirostat, DRY, XTC, locally typical, dynamic temperature,
//! top-n-sigma, adaptive-p, `min_keep`, `samplers` in any order) are read as on every
//! generation endpoint ([`crate::api::LlamaSampling`]). LoRA, indentation and time limits are
//! refused with a 400 naming the field when a request switches them on, rather than ignored;
//! at their defaults they are accepted. `cache_prompt` is accepted (every prompt is looked up in the shared prefix
//! cache whatever slot it names); `id_slot` names the slot whose last tokens the request's
//! become (`crate::slots`).

use crate::api::{
    collect_choices, encode_text, expand, finish, parse, progress_json, progress_timings, refused,
    run_to_end, stream_choices, timings, tokenize, window, ApiError, ChatBody, Common, End, Gen,
    Job, Kind, Next, Piece, Stop, MAX_PROMPTS, MAX_TOP_LOGPROBS,
};
use crate::scheduler::TokenLogprobs;
use crate::tools::Tools;
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use futures_util::{FutureExt, TryFutureExt};
use gds_runtime::{Grammar, SamplerConfig};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::Arc;

/// Most `logit_bias` entries, and tokens they bias, one request may give.
const MAX_BIASES: usize = 4096;

/// Most `response_fields` one request may name.
const MAX_FIELDS: usize = 256;

/// `/completion`'s own fields (the shared ones are read as [`Common`]).
#[derive(Deserialize, Default)]
struct NativeBody {
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    n_predict: Option<i64>,
    #[serde(default)]
    n_cmpl: Option<i64>,
    #[serde(default)]
    n_probs: Option<Value>,
    #[serde(default)]
    post_sampling_probs: Option<bool>,
    #[serde(default)]
    return_tokens: Option<bool>,
    #[serde(default)]
    response_fields: Option<Vec<String>>,
    // switched off by default; refused when switched on
    #[serde(default)]
    lora: Option<Value>,
}

impl NativeBody {
    /// A 400 where `lora` switches on what gdsrun does not do (adapters).
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let on = self
            .lora
            .as_ref()
            .is_some_and(|l| l.as_array().is_none_or(|l| !l.is_empty()));
        if on {
            return Err(ApiError::bad(
                "lora is not supported by this server (no adapters); leave it at its default",
            )
            .param("lora"));
        }
        Ok(())
    }
}

/// One part of a prompt: text (tokenized) or token ids (as given).
pub(crate) enum Part {
    Text(String),
    Ids(Vec<u32>),
}

fn bad_prompt() -> ApiError {
    ApiError::bad(
        "prompt elements must be a string, a list of token ids, a list of strings and token ids, {\"prompt_string\": ...} or {\"content\": [text parts]}",
    )
    .param("prompt")
}

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|t| u32::try_from(t).ok())
}

/// One prompt: a string, token ids, strings and token ids mixed, `{"prompt_string": ...}`,
/// or llama-server's multimodal form with text parts only, `{"content": [{"type": "text",
/// "text": ...}, ...]}` (the texts joined as one).
pub(crate) fn sub_prompt(v: &Value) -> Result<Vec<Part>, ApiError> {
    match v {
        Value::String(s) => Ok(vec![Part::Text(s.clone())]),
        Value::Array(items) => {
            let mut parts = Vec::new();
            for x in items {
                match x {
                    Value::String(s) => parts.push(Part::Text(s.clone())),
                    Value::Number(_) => {
                        let id = token_id(x).ok_or_else(|| {
                            ApiError::bad(format!("token id {x} must be an integer >= 0"))
                                .param("prompt")
                        })?;
                        match parts.last_mut() {
                            Some(Part::Ids(ids)) => ids.push(id),
                            _ => parts.push(Part::Ids(vec![id])),
                        }
                    }
                    _ => return Err(bad_prompt()),
                }
            }
            if !parts.iter().any(|p| matches!(p, Part::Ids(_))) && parts.len() > 1 {
                // a list of strings is a list of prompts, not one
                return Err(bad_prompt());
            }
            Ok(parts)
        }
        Value::Object(o) => {
            if o.get("multimodal_data").is_some_and(|m| !m.is_null()) {
                return Err(
                    ApiError::bad("multimodal_data: this server's models take text only")
                        .param("prompt"),
                );
            }
            match (o.get("prompt_string"), o.get("content")) {
                (Some(p @ (Value::String(_) | Value::Array(_))), _) => sub_prompt(p),
                (None, Some(Value::Array(parts))) => match crate::api::text_parts(parts) {
                    Some(text) => Ok(vec![Part::Text(text)]),
                    None => Err(ApiError::bad(
                        "content parts must be {\"type\": \"text\", \"text\": ...}: this server's models take text only",
                    )
                    .param("prompt")),
                },
                _ => Err(bad_prompt()),
            }
        }
        _ => Err(bad_prompt()),
    }
}

/// The prompts of a request, as llama-server reads `prompt`: a list holding any token id is
/// one prompt; any other list is a list of prompts.
fn prompts(v: &Value) -> Result<Vec<Vec<Part>>, ApiError> {
    let list = match v {
        Value::Array(items) if !items.iter().any(Value::is_number) => items,
        Value::Null => return Err(ApiError::bad("prompt is required").param("prompt")),
        one => return Ok(vec![sub_prompt(one)?]),
    };
    if list.is_empty() {
        return Err(ApiError::bad("prompt must not be empty").param("prompt"));
    }
    if list.len() > MAX_PROMPTS {
        return Err(ApiError::bad(format!(
            "{} prompts in one request; at most {MAX_PROMPTS}",
            list.len()
        ))
        .param("prompt"));
    }
    list.iter().map(sub_prompt).collect()
}

/// A prompt's token ids: texts tokenized with special-token texts parsed, BOS before a
/// first part that is text (when the model adds one).
pub(crate) async fn encode_parts(st: &ServerState, parts: Vec<Part>) -> Result<Vec<u32>, ApiError> {
    let (tok, ctx) = (st.tokenizer.clone(), st.ctx);
    tokenize(
        move || {
            tok.check_fits(text_bytes(&parts), ctx)?;
            part_ids(&tok, &parts, true, true)
        },
        "prompt",
    )
    .await
}

/// A prompt's parts as token ids: texts tokenized (special-token texts parsed when
/// `parse_special`; BOS before a first part that is text when `bos` and the model adds
/// one), ids as given.
fn part_ids(
    tok: &gds_runtime::tokenizer::TextTokenizer,
    parts: &[Part],
    bos: bool,
    parse_special: bool,
) -> gds_runtime::Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        match p {
            Part::Text(t) => ids.extend(tok.encode(t, bos && i == 0, parse_special)?),
            Part::Ids(t) => ids.extend_from_slice(t),
        }
    }
    Ok(ids)
}

/// `logit_bias` in llama-server's forms: `[[token id or text, bias or false], ...]` or
/// `{"token id or text": bias or false}`; a text biases each of its tokens, `false` bans.
async fn logit_bias(st: &ServerState, v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param("logit_bias");
    let pairs: Vec<(Value, &Value)> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(l)) => l
            .iter()
            .map(|p| match p.as_array().map(Vec::as_slice) {
                Some([k, b]) => Ok((k.clone(), b)),
                _ => Err(bad(format!(
                    "logit_bias entry {p} must be [token id or text, bias or false]"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, b)| {
                let key = k.parse::<u64>().map_or(json!(k), |id| json!(id));
                (key, b)
            })
            .collect(),
        Some(other) => {
            return Err(bad(format!(
                "logit_bias {other} must be a list of [token, bias] pairs or an object"
            )))
        }
    };
    if pairs.len() > MAX_BIASES {
        return Err(bad(format!(
            "logit_bias has {} entries; at most {MAX_BIASES}",
            pairs.len()
        )));
    }
    let mut out = Vec::new();
    for (key, b) in pairs {
        let bias = match b {
            Value::Bool(false) => f32::NEG_INFINITY,
            Value::Number(n) => n.as_f64().map_or(f32::NAN, |x| x as f32),
            _ => f32::NAN,
        };
        if !(bias.is_finite() || bias == f32::NEG_INFINITY) {
            return Err(bad(format!(
                "logit_bias for {key}: {b} must be a number or false"
            )));
        }
        let ids = match &key {
            Value::String(text) => {
                encode_text(st, text.clone(), false, false, "logit_bias").await?
            }
            k => match token_id(k).filter(|&id| (id as usize) < st.vocab) {
                Some(id) => vec![id],
                None => {
                    return Err(bad(format!(
                        "logit_bias key {k} is not a token id in this vocabulary (0..{})",
                        st.vocab
                    )))
                }
            },
        };
        out.extend(ids.into_iter().map(|id| (id, bias)));
        if out.len() > MAX_BIASES {
            return Err(bad(format!(
                "logit_bias gives more than {MAX_BIASES} tokens a bias"
            )));
        }
    }
    Ok(out)
}

/// What a native request asks for beyond its jobs.
struct Asked {
    /// `n_predict` as given (-1: up to the context).
    n_predict: i64,
    n_probs: usize,
    return_tokens: bool,
    response_fields: Vec<String>,
    stream: bool,
}

/// The request's jobs (one per prompt; [`expand`] makes the `n_cmpl` choices).
async fn jobs(st: &Arc<ServerState>, body: &Bytes) -> Result<(Vec<Job>, Asked), ApiError> {
    let b: NativeBody = parse(body)?;
    let mut c: Common = parse(body)?;
    b.refuse_unsupported()?;
    if c.prompt_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad(
            "prompt_logprobs is not a field of /completion (vLLM's: /v1/completions and /v1/chat/completions take it)",
        )
        .param("prompt_logprobs"));
    }
    let n_predict = b
        .n_predict
        .or(c.max_tokens)
        .or(c.max_completion_tokens)
        .unwrap_or(-1);
    if n_predict < -1 {
        return Err(ApiError::bad(format!(
            "n_predict {n_predict} must be -1 (up to the context), 0 (the prompt only) or more"
        ))
        .param("n_predict"));
    }
    let n_probs = match b.n_probs.as_ref().or(c.logprobs.as_ref()) {
        None | Some(Value::Null) => 0,
        Some(v) => match v.as_i64() {
            Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => k as usize,
            _ => {
                return Err(ApiError::bad(format!(
                    "n_probs {v} must be an integer in 0..={MAX_TOP_LOGPROBS}"
                ))
                .param("n_probs"))
            }
        },
    };
    // the shared fields as `job` reads them
    c.max_tokens = (n_predict > 0).then_some(n_predict);
    c.max_completion_tokens = None;
    c.n = b.n_cmpl.or(c.n);
    c.logprobs = (n_probs > 0).then(|| json!(n_probs));
    c.echo = None;
    c.stream_options = None;
    // as llama-server: a negative temperature is greedy, a negative top_k no top-k
    c.temperature = c.temperature.map(|t| t.max(0.0));
    c.top_k = c.top_k.map(|k| k.max(0));
    // -1 (and llama.cpp's 0xFFFFFFFF) ask for a random seed
    c.seed = c.seed.filter(|&s| s != -1 && s != u32::MAX as i64);
    c.stop = c.stop.map(|s| match s {
        Stop::One(s) => Stop::Many(vec![s]),
        Stop::Many(v) => Stop::Many(v),
    });
    if let Some(Stop::Many(v)) = &mut c.stop {
        v.retain(|s| !s.is_empty());
    }
    let bias_value = c.logit_bias.take();
    let bias = logit_bias(st, bias_value.as_ref()).await?;
    let stream = c.stream == Some(true);
    let prompt = b.prompt.clone().unwrap_or(Value::Null);
    let mut out = Vec::new();
    for parts in prompts(&prompt)? {
        let ids = encode_parts(st, parts).await?;
        let mut j = crate::api::job(st, c.clone(), ids, usize::MAX, Kind::Completion)?;
        if n_predict == 0 {
            j.max_tokens = 0;
        }
        j.post_sampling = b.post_sampling_probs == Some(true);
        j.sampler.logit_bias.extend_from_slice(&bias);
        out.push(j);
    }
    let response_fields = b.response_fields.unwrap_or_default();
    if response_fields.len() > MAX_FIELDS {
        return Err(ApiError::bad(format!(
            "response_fields names {} fields; at most {MAX_FIELDS}",
            response_fields.len()
        ))
        .param("response_fields"));
    }
    let asked = Asked {
        n_predict,
        n_probs,
        return_tokens: b.return_tokens == Some(true),
        response_fields,
        stream,
    };
    Ok((out, asked))
}

/// The settings a request ran with (`generation_settings`; `/props`' defaults), by
/// llama-server's names.
fn settings(s: &SamplerConfig, n_predict: i64, stop: &[String], extra: Value) -> Value {
    let x = &s.extra;
    let mut v = json!({
        "n_predict": n_predict,
        "max_tokens": n_predict,
        "seed": s.seed,
        "temperature": s.temp,
        "dynatemp_range": x.dynatemp_range,
        "dynatemp_exponent": x.dynatemp_exponent,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "top_n_sigma": x.top_n_sigma,
        "xtc_probability": x.xtc_probability,
        "xtc_threshold": x.xtc_threshold,
        "typical_p": x.typical_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "dry_multiplier": x.dry_multiplier,
        "dry_base": x.dry_base,
        "dry_allowed_length": x.dry_allowed_length,
        "dry_penalty_last_n": x.dry_penalty_last_n,
        "dry_sequence_breakers": x.dry_sequence_breakers,
        "mirostat": x.mirostat,
        "mirostat_tau": x.mirostat_tau,
        "mirostat_eta": x.mirostat_eta,
        "adaptive_target": x.adaptive_target,
        "adaptive_decay": x.adaptive_decay,
        "stop": stop,
        // JSON has no -inf: a banned token's bias is null, as llama-server writes it
        "logit_bias": s.logit_bias.iter().map(|&(t, b)| {
            json!({"bias": if b.is_finite() { json!(b) } else { Value::Null }, "token": t})
        }).collect::<Vec<_>>(),
        "grammar_lazy": false,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "n_discard": 0,
        "timings_per_token": false,
        "backend_sampling": false,
        "lora": [],
        "samplers": x.order,
        "n_keep": 0,
        "min_keep": x.min_keep,
    });
    if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
        m.extend(e);
    }
    v
}

fn job_settings(st: &ServerState, j: &Job, asked: &Asked) -> Value {
    let grammar = j.grammar.as_ref().map(|(g, _)| match g {
        Grammar::Lark(s) | Grammar::Regex(s) => s.clone(),
        Grammar::JsonSchema(v) => v.to_string(),
    });
    let mut v = settings(
        &j.sampler,
        asked.n_predict,
        &j.stop,
        json!({
            "ignore_eos": j.ignore_eos,
            "stream": asked.stream,
            "n_probs": asked.n_probs,
            "post_sampling_probs": j.post_sampling,
            "grammar": grammar.unwrap_or_default(),
        }),
    );
    if j.ignore_eos {
        // as llama-server reports it: the end-of-generation tokens banned
        if let Some(l) = v["logit_bias"].as_array_mut() {
            l.extend(
                st.tokenizer
                    .eog_ids()
                    .iter()
                    .map(|&t| json!({"bias": null, "token": t})),
            );
        }
    }
    v
}

/// llama-server's `completion_probabilities`: per token its id, text, bytes and
/// log-probability, and the `n_probs` most likely at its position; after the sampling chain
/// (`post`) probabilities instead (`prob`, `top_probs`: the candidates it was drawn from).
fn probs_json(st: &ServerState, lps: &[(u32, TokenLogprobs)], post: bool) -> Value {
    let entry = |id: u32, lp: f32| {
        // (the token's own bytes: a piece of a character is not U+FFFD's three)
        let b = st.tokenizer.token_bytes(id);
        let mut e = json!({"id": id, "token": String::from_utf8_lossy(&b), "bytes": b});
        if post {
            e["prob"] = json!(lp.exp());
        } else {
            // JSON has no -inf: the lowest float, as llama-server writes it
            e["logprob"] = json!(if lp.is_finite() { lp } else { f32::MIN });
        }
        e
    };
    let top = if post { "top_probs" } else { "top_logprobs" };
    lps.iter()
        .map(|(id, l)| {
            let mut e = entry(*id, l.logprob);
            e[top] = l.top.iter().map(|&(i, p)| entry(i, p)).collect();
            e
        })
        .collect()
}

/// llama-server's `stop_type` and `stopping_word` of an end.
fn stop_type(end: &End) -> (&'static str, String) {
    match (end.finish, &end.stop) {
        (_, Some(word)) => ("word", word.clone()),
        ("stop", None) => ("eos", String::new()),
        _ => ("limit", String::new()),
    }
}

/// `response_fields`: only the fields named (`a/b` takes `b` from inside `a`, under the
/// name `a/b`); every field when none are.
fn pick(v: Value, fields: &[String]) -> Value {
    if fields.is_empty() {
        return v;
    }
    let mut out = Map::new();
    for f in fields {
        let mut at = Some(&v);
        for part in f.split('/') {
            at = at.and_then(|x| x.get(part));
        }
        if let Some(x) = at {
            out.insert(f.clone(), x.clone());
        }
    }
    Value::Object(out)
}

/// What one choice gave: its text, its tokens and probabilities when asked, and its end.
struct Outcome {
    content: String,
    tokens: Vec<u32>,
    probs: Option<Value>,
    has_new_line: bool,
    end: End,
}

/// The final object of one choice (streamed: `content` and `tokens` empty, they went out
/// before).
fn final_object(st: &ServerState, j: &Job, asked: &Asked, index: usize, o: Outcome) -> Value {
    let (stop_type, word) = stop_type(&o.end);
    let prompt = st
        .tokenizer
        .inner()
        .decode(&j.prompt, false)
        .unwrap_or_default();
    let n = o.end.completion_tokens;
    let mut v = json!({
        "index": index,
        "content": o.content,
        "tokens": o.tokens,
        "id_slot": -1,
        "stop": true,
        "model": j.model,
        "tokens_predicted": n,
        "tokens_evaluated": j.prompt.len(),
        "generation_settings": job_settings(st, j, asked),
        "prompt": prompt,
        "has_new_line": o.has_new_line,
        "truncated": j.prompt.len() + n >= st.ctx,
        "stop_type": stop_type,
        "stopping_word": word,
        "tokens_cached": (j.prompt.len() + n).saturating_sub(1),
        "timings": timings(&o.end, j.prompt.len()),
    });
    if let Some(p) = o.probs {
        v["completion_probabilities"] = p;
    }
    pick(v, &asked.response_fields)
}

/// Runs one choice to its end (not streamed).
async fn run_one(
    st: &Arc<ServerState>,
    j: &Job,
    asked: &Asked,
    index: usize,
) -> Result<Value, ApiError> {
    // (a llama.cpp completion has no reasoning split)
    let (mut gen, _, content, end) = run_to_end(st, j).await?;
    // llama-server's `tokens` end with the end-of-generation token, as its probabilities do
    let mut tokens = gen.take_tokens();
    tokens.extend(gen.take_eog());
    let o = Outcome {
        has_new_line: content.contains('\n'),
        content,
        tokens: if asked.return_tokens {
            tokens
        } else {
            Vec::new()
        },
        probs: (asked.n_probs > 0)
            .then(|| probs_json(st, &gen.take_raw_logprobs(), j.post_sampling)),
        end,
    };
    Ok(final_object(st, j, asked, index, o))
}

/// One streamed choice's events: each piece of text with its token ids (and probabilities),
/// then the final object; an error event ends the whole stream (the flag).
fn choice_events(
    st: Arc<ServerState>,
    j: Job,
    asked: Arc<Asked>,
    index: usize,
    gen: Gen,
) -> impl futures_util::Stream<Item = (Vec<SseEvent>, bool)> + Send {
    let j = Arc::new(j);
    let event = |v: Value| SseEvent::default().data(v.to_string());
    stream::unfold(Some((gen, 0usize, false)), move |g| {
        let (st, j, asked) = (st.clone(), j.clone(), asked.clone());
        async move {
            let (mut gen, mut sent, mut new_line) = g?;
            // a piece of text, the tokens not sent yet (and their probabilities)
            let mut partial = |gen: &mut Gen, text: String, tokens: Vec<u32>| {
                new_line |= text.contains('\n');
                sent += tokens.len();
                let mut v = json!({"index": index, "content": text, "tokens": tokens,
                    "stop": false, "id_slot": -1, "tokens_predicted": sent,
                    "tokens_evaluated": j.prompt.len()});
                if asked.n_probs > 0 {
                    v["completion_probabilities"] =
                        probs_json(&st, &gen.take_raw_logprobs(), j.post_sampling);
                }
                if j.timings_per_token {
                    v["timings"] = gen.timings_so_far(j.prompt.len());
                }
                event(v)
            };
            let piece = match gen.next_or_progress().await {
                Some(Next::Progress(p)) => {
                    // llama-server's: no text, how far the prompt has gone in
                    let mut v = json!({"index": index, "content": "", "tokens": [],
                        "stop": false, "id_slot": -1, "tokens_predicted": 0,
                        "tokens_evaluated": j.prompt.len(),
                        "prompt_progress": progress_json(&p)});
                    if j.timings_per_token {
                        v["timings"] = progress_timings(&p);
                    }
                    return Some(((vec![event(v)], false), Some((gen, sent, new_line))));
                }
                Some(Next::Piece(p)) => Some(p),
                None => None,
            };
            match piece {
                Some(Piece::Text(t)) => {
                    let tokens = gen.take_tokens();
                    let ev = partial(&mut gen, t, tokens);
                    Some(((vec![ev], false), Some((gen, sent, new_line))))
                }
                Some(Piece::End(end)) => {
                    let mut out = Vec::new();
                    let rest = gen.rest();
                    // the end-of-generation token is an event of its own in llama-server's
                    // stream (no text, its id, its probabilities)
                    let mut tokens = gen.take_tokens();
                    tokens.extend(gen.take_eog());
                    if rest.is_some() || !tokens.is_empty() {
                        out.push(partial(&mut gen, rest.unwrap_or_default(), tokens));
                    }
                    let o = Outcome {
                        content: String::new(),
                        tokens: Vec::new(),
                        probs: None,
                        has_new_line: new_line,
                        end,
                    };
                    // `stop` and `index` kept whatever `response_fields` picks: a stream's
                    // reader needs them to know which choice ended
                    let mut v = final_object(&st, &j, &asked, index, o);
                    v["stop"] = json!(true);
                    v["index"] = json!(index);
                    out.push(event(v));
                    Some(((out, false), None))
                }
                Some(Piece::Error(e)) => Some(((vec![event(e.body())], true), None)),
                None => None,
            }
        }
    })
}

/// `POST /completion`.
pub async fn completion(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = completion_of(&st, &body).await;
    finish(&st, r)
}

/// `POST /infill`: llama-server's fill-in-the-middle, what code editors ask for at the cursor
/// (llama.vim, llama.vscode): `input_prefix` (the code before the cursor), `input_suffix`
/// (after it), optional `prompt` (text after the prefix, special-token texts parsed) and
/// `input_extra` (`[{"filename", "text"}]`: other files' chunks for context), and
/// `/completion`'s fields. The prompt is laid out as llama-server lays it out (its
/// repository-level pattern): the repository token and `myproject`, the extra chunks (each
/// after the file separator token and its file name, or after a `--- snippet ---` line
/// where the vocabulary has no separator), then prefix, suffix and middle tokens around the
/// prefix's last tokens (up to 3/4 of `--step-tokens`, llama-server's batch), the prompt
/// and the suffix's first tokens (the rest of that quarter); the extra chunks' last tokens
/// fill what the context has past one batch, leaving the reply its `n_predict` tokens. The
/// answer is `/completion`'s. A model whose
/// vocabulary has no FIM prefix, suffix or middle token answers 501, as llama-server.
pub async fn infill(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let body = infill_body(&st, &body).await?;
        completion_of(&st, &body).await
    }
    .await;
    finish(&st, r)
}

/// An `/infill` request as the `/completion` request of its laid-out prompt (token ids).
async fn infill_body(st: &Arc<ServerState>, body: &Bytes) -> Result<Bytes, ApiError> {
    let [pre, suf, mid, _, rep, sep] = st.tokenizer.fim();
    let missing: Vec<&str> = [("prefix", pre), ("suffix", suf), ("middle", mid)]
        .iter()
        .filter(|(_, id)| id.is_none())
        .map(|(n, _)| *n)
        .collect();
    let (Some(pre), Some(suf), Some(mid)) = (pre, suf, mid) else {
        return Err(ApiError::status(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            format!(
                "infill is not supported by this model: its vocabulary has no fill-in-the-middle {} token",
                missing.join(", ")
            ),
        ));
    };
    let mut v: Value = parse(body)?;
    let o = v
        .as_object_mut()
        .ok_or_else(|| ApiError::bad("the request must be a JSON object"))?;
    let prompt = match o.remove("prompt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(p)) => p,
        Some(_) => return Err(ApiError::bad("\"prompt\" must be a string").param("prompt")),
    };
    let mut input = |name: &'static str| -> Result<Vec<Part>, ApiError> {
        let v = o
            .remove(name)
            .ok_or_else(|| ApiError::bad(format!("\"{name}\" is required")).param(name))?;
        sub_prompt(&v).map_err(|_| {
            ApiError::bad(format!(
                "\"{name}\" must be a string or a list of strings and token ids"
            ))
            .param(name)
        })
    };
    let (prefix, suffix) = (input("input_prefix")?, input("input_suffix")?);
    let bad_extra = |m: &str| ApiError::bad(m.to_string()).param("input_extra");
    let extra = match o.remove("input_extra") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(bad_extra(
                "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}",
            ))
        }
    };
    let mut chunks = Vec::with_capacity(extra.len());
    for c in &extra {
        let text = c.get("text").and_then(Value::as_str).ok_or_else(|| {
            bad_extra("an input_extra chunk must have a \"text\" field with a string value")
        })?;
        let filename = match c.get("filename") {
            None => "tmp",
            Some(Value::String(f)) => f,
            Some(_) => {
                return Err(bad_extra(
                    "an input_extra chunk's \"filename\" field must be a string",
                ))
            }
        };
        chunks.push((filename.to_string(), text.to_string()));
    }
    let (n_batch, n_ctx) = (st.step_tokens, st.ctx);
    // the reply's tokens, kept free of extra chunks (at least one)
    let reserve = o
        .get("n_predict")
        .or_else(|| o.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(1, |n| (n as usize).clamp(1, n_ctx / 2));
    let tok = st.tokenizer.clone();
    // Only the prefix's last tokens, the suffix's first and the extra chunks' last are used:
    // texts longer than twice what those tokens can take (a whole file as the prefix) are cut
    // there first, so their tokenizing is bounded; the cut's tokens are dropped anyway.
    // The bound on a token's bytes decodes every token on its first use (a third of a
    // second for a 262k vocabulary): worked out on the blocking pool, and only when a text
    // is longer than a bound of one byte a token keeps (otherwise nothing is cut either way).
    // (the three limits at one byte a token)
    let (prefix_max, suffix_max, extra_max) =
        (2 * (3 * (n_batch / 4)), 2 * (n_batch / 4), 2 * (n_ctx + 2));
    let extra_bytes: usize = chunks.iter().map(|(f, t)| f.len() + t.len()).sum();
    let per = if text_bytes(&prefix) > prefix_max
        || text_bytes(&suffix) > suffix_max
        || extra_bytes >= extra_max
    {
        let t = tok.clone();
        tokio::task::spawn_blocking(move || t.max_token_bytes())
            .await
            .map_err(|e| ApiError::server(format!("tokenization failed: {e}")))?
            .map_err(|e| ApiError::server(e.to_string()))?
    } else {
        1
    };
    let (mut prefix, mut suffix) = (prefix, suffix);
    cut_parts(&mut prefix, prefix_max * per, true, "input_prefix")?;
    cut_parts(&mut suffix, suffix_max * per, false, "input_suffix")?;
    let mut budget = extra_max * per;
    let mut kept = Vec::new();
    for (filename, mut text) in chunks.into_iter().rev() {
        if budget == 0 {
            break;
        }
        if text.len() > budget {
            text = text[floor_char(&text, text.len() - budget)..].to_string();
        }
        budget = budget.saturating_sub(text.len() + filename.len());
        kept.push((filename, text));
    }
    kept.reverse();
    let chunks = kept;
    let ids = tokenize(
        move || {
            tok.check_fits(prompt.len(), n_ctx)?;
            let plain = |t: &str| tok.encode(t, false, false);
            // llama-server's tokenize_mixed: no BOS, special-token texts as text
            let mixed = |parts: &[Part]| part_ids(&tok, parts, false, false);
            let mut extra = Vec::new();
            if let Some(rep) = rep {
                extra.push(rep);
                extra.extend(plain("myproject\n")?);
            }
            for (filename, text) in &chunks {
                match sep {
                    Some(sep) => {
                        extra.push(sep);
                        extra.extend(plain(&format!("{filename}\n"))?);
                    }
                    None => extra.extend(plain("\n\n--- snippet ---\n\n")?),
                }
                extra.extend(plain(text)?);
            }
            if let Some(sep) = sep {
                extra.push(sep);
                extra.extend(plain("filename\n")?);
            }
            let prompt = tok.encode(&prompt, false, true)?;
            let mut prefix = mixed(&prefix)?;
            let mut suffix = mixed(&suffix)?;
            // llama-server's split of one batch: 3/4 prefix, the rest prompt and suffix
            let prefix_take = prefix.len().min(3 * (n_batch / 4));
            let suffix_take = suffix
                .len()
                .min((n_batch / 4).saturating_sub(2 + prompt.len()));
            // the context past one batch (and llama-server's n_predict of -1) for the extras,
            // never more than leaves the reply its `n_predict` tokens (llama-server may lay
            // out a prompt past the context, then refuse it)
            let rest = 4 + prefix_take + prompt.len() + suffix_take;
            let room = n_ctx.saturating_sub(rest + reserve);
            let extra_take = extra
                .len()
                .min((n_ctx + 2).saturating_sub(n_batch))
                .min(room);
            prefix.drain(..prefix.len() - prefix_take);
            suffix.truncate(suffix_take);
            let mut ids = extra[extra.len() - extra_take..].to_vec();
            if tok.add_bos() {
                ids.extend(tok.bos());
            }
            ids.push(pre);
            ids.extend(prefix);
            ids.extend(prompt);
            ids.push(suf);
            ids.extend(suffix);
            ids.push(mid);
            Ok(ids)
        },
        "input_prefix",
    )
    .await?;
    o.insert("prompt".into(), json!(ids));
    Ok(Bytes::from(v.to_string()))
}

/// Cuts the text of `parts` (one text: a string prompt) to its last (`tail`) or first
/// `max` bytes at a character boundary; prompts with token ids are refused past `max` bytes
/// of text.
fn cut_parts(
    parts: &mut [Part],
    max: usize,
    tail: bool,
    name: &'static str,
) -> Result<(), ApiError> {
    if let [Part::Text(t)] = parts {
        if t.len() > max {
            *t = if tail {
                t[floor_char(t, t.len() - max)..].to_string()
            } else {
                t[..floor_char(t, max)].to_string()
            };
        }
        return Ok(());
    }
    let text = text_bytes(parts);
    if text > max {
        return Err(ApiError::bad(format!(
            "{name}: {text} bytes of text beside token ids; at most {max} (a string is cut to fit instead)"
        ))
        .param(name));
    }
    Ok(())
}

/// The bytes of text in a prompt's parts.
fn text_bytes(parts: &[Part]) -> usize {
    parts
        .iter()
        .map(|p| match p {
            Part::Text(t) => t.len(),
            Part::Ids(_) => 0,
        })
        .sum()
}

/// The largest character boundary of `s` at or before `i` (at most its length).
pub(crate) fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// A `/completion` request's answer.
async fn completion_of(st: &Arc<ServerState>, body: &Bytes) -> Result<Response, ApiError> {
    {
        let st = st.clone();
        let (jobs, asked) = jobs(&st, body).await?;
        let jobs = expand(jobs);
        let window = window(&st, jobs.first().map_or(1, |j| j.n));
        if !asked.stream {
            let runs: Vec<_> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| run_one(&st, j, &asked, i).map_ok(|v| (v, ())).boxed())
                .collect();
            let mut results: Vec<_> = collect_choices(&st, runs, window)
                .await?
                .into_iter()
                .map(|(v, ())| v)
                .collect();
            return Ok(if results.len() == 1 {
                Json(results.remove(0)).into_response()
            } else {
                Json(results).into_response()
            });
        }
        // interleaved, each event with its choice's index
        let asked = Arc::new(asked);
        let st2 = st.clone();
        let body = stream_choices(&st, jobs, move |index, j, g| match g {
            Ok(g) => choice_events(st2.clone(), j, asked.clone(), index, g).boxed(),
            Err(e) => refused(e),
        })
        .await?
        .map(Ok::<_, Infallible>);
        Ok(crate::api::sse(body))
    }
}

/// `GET /props`: the server's settings as llama-server reports them (its web UI and clients
/// read the context size, the chat template and the slots from here).
pub async fn props(State(st): State<Arc<ServerState>>) -> Response {
    let tok = &st.tokenizer;
    let text = |id: Option<u32>| {
        id.and_then(|i| tok.inner().decode(&[i], false).ok())
            .unwrap_or_default()
    };
    let template = tok.chat_template();
    let params = settings(
        &st.default_sampler,
        st.default_max_tokens
            .map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX)),
        &st.default_stop,
        json!({"ignore_eos": false, "stream": false, "n_probs": 0, "post_sampling_probs": false, "grammar": ""}),
    );
    Json(json!({
        "default_generation_settings": {"n_ctx": st.ctx, "params": params},
        "total_slots": st.max_batch,
        "model_alias": st.model_name(),
        "model_path": st.model_dir.display().to_string(),
        "modalities": {"vision": false, "video": false, "audio": false},
        "endpoint_slots": st.slots,
        "endpoint_props": false,
        "endpoint_metrics": true,
        "ui": false,
        "ui_settings": {},
        "cors_proxy_enabled": false,
        "chat_template": template.map(|t| t.source()).unwrap_or_default(),
        "chat_template_caps": {"supports_tools": template.is_some_and(|t| t.takes_tools())},
        "bos_token": text(tok.bos()),
        "eos_token": text(tok.eos()),
        "build_info": format!("gdsllm {}", env!("CARGO_PKG_VERSION")),
        "is_sleeping": false,
    }))
    .into_response()
}

/// `GET /slots` (llama-server's, on unless `--no-slots`): one entry per sequence the engine
/// runs together (`--max-batch`), `{"id", "n_ctx", "speculative", "is_processing"}`; as many
/// are processing as requests are admitted (the engine batches requests, it does not keep
/// them in numbered slots, so a slot's request is not told). `?fail_on_no_slot=1` answers
/// 503 when every slot is processing, as llama-server.
pub async fn slots(
    State(st): State<Arc<ServerState>>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Response {
    if !st.slots {
        return ApiError::status(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "this server's slots endpoint is off (--no-slots)",
        )
        .into_response();
    }
    let running = st
        .metrics
        .running
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    if q.get("fail_on_no_slot").is_some_and(|v| v != "0") && running >= st.max_batch {
        return ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            "no slot available",
        )
        .into_response();
    }
    let list: Vec<Value> = (0..st.max_batch)
        .map(|id| json!({"id": id, "n_ctx": st.ctx, "speculative": false, "is_processing": id < running}))
        .collect();
    Json(list).into_response()
}

/// `POST /props`: changing the server's settings is not supported (llama-server's answer
/// without `--props`).
pub async fn post_props() -> Response {
    ApiError::status(
        StatusCode::NOT_IMPLEMENTED,
        "not_supported_error",
        "this server's properties cannot be changed at run time",
    )
    .into_response()
}

/// `/apply-template`'s `add_generation_prompt` (default true: the assistant's turn opened).
#[derive(Deserialize)]
struct GenerationPrompt {
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

/// `POST /apply-template`: `{"messages": [...], "tools"?, "add_generation_prompt"?}` rendered
/// by the model's chat template into `{"prompt": text}`, nothing generated.
pub async fn apply_template(State(st): State<Arc<ServerState>>, body: Bytes) -> Response {
    let r = async {
        let b: ChatBody = parse(&body)?;
        let g: GenerationPrompt = parse(&body)?;
        let add_generation_prompt = g.add_generation_prompt.unwrap_or(true);
        if b.messages.is_empty() {
            return Err(ApiError::bad("messages must not be empty").param("messages"));
        }
        let mut msgs = crate::api::chat_messages(&b.messages)?;
        if let Some(t) = st.tokenizer.chat_template() {
            crate::tools::mistral_ids(t.source(), &mut msgs);
        }
        let (vars, thinking_off) = crate::api::chat_vars(&st, &b)?;
        let tools = Tools::from_request(
            b.tools.as_ref(),
            b.tool_choice.as_ref(),
            b.parallel_tool_calls,
            st.tokenizer.chat_template(),
        )?;
        let list = tools.map(|t| t.list.clone());
        let (tok, ctx) = (st.tokenizer.clone(), st.ctx);
        let rendered = tokio::task::spawn_blocking(move || {
            let bytes = msgs.iter().map(|m| m.content.len()).sum::<usize>()
                + list.as_ref().map_or(0, |l| l.to_string().len())
                + vars
                    .as_ref()
                    .map_or(0, |v| Value::Object(v.clone()).to_string().len());
            tok.check_fits(bytes, ctx)?;
            let t = tok.chat_template().ok_or_else(|| {
                gds_runtime::RuntimeError::Template("the model has no chat template".into())
            })?;
            t.render_with(&msgs, add_generation_prompt, list.as_ref(), vars.as_ref())
        })
        .await
        .map_err(|e| ApiError::server(format!("rendering failed: {e}")))?
        .map_err(|e| ApiError::bad(format!("chat template: {e}")).param("messages"))?;
        let mut rendered = rendered;
        if thinking_off && add_generation_prompt {
            let mut from = rendered.len().saturating_sub(256);
            while !rendered.is_char_boundary(from) {
                from -= 1;
            }
            let tail = &rendered[from..];
            if let Some(tag) = crate::api::unclosed_thinking(&st, None, tail) {
                rendered.push_str(tag);
            }
        }
        Ok(Json(json!({ "prompt": rendered })).into_response())
    }
    .await;
    finish(&st, r)
}
