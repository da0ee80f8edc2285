//! `gdsllm.Engine`: gds-runtime's engine as `gdsrun run` drives it (a plan from the same
//! options, `Engine::load`, `generate`), the GIL released while it works; and
//! `gdsllm.convert` (gds-convert).

use crate::model::{json_to_py, resolve_model};
use crate::{err, fork_guard, path_arg};
use gds_runtime::chat::Message;
use gds_runtime::engine::GenerateOutput;
use gds_runtime::plan::{Limits, Mode};
use gds_runtime::sampler::{ExtraSamplers, Stage};
use gds_runtime::{Grammar, KvDtype, Plan, PlanOptions, SamplerConfig};
use gds_serve::tools::{assistant_message, Tools};
use pyo3::exceptions::{PyStopIteration, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A byte size: an int, or a string as gdsrun's flags take it ("200MB", "1.5GiB").
fn size_arg(v: Option<Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u64>> {
    let Some(v) = v else { return Ok(None) };
    if let Ok(n) = v.extract::<u64>() {
        return Ok(Some(n));
    }
    let s: String = v
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("{what}: an int or a size string")))?;
    gds_runtime::ioplan::parse_size(&s)
        .map(Some)
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

/// The Python argument that sets a sampler field (`temp` is `temperature`).
fn sampler_arg(field: &str) -> &str {
    match field {
        "temp" => "temperature",
        f => f,
    }
}

/// Checks each sampling value's range; the error names the Python argument (gds-runtime's
/// names gdsrun's flag).
fn check_sampler(s: &SamplerConfig) -> PyResult<()> {
    s.check().map_err(|b| {
        err(format!(
            "{} {} must be {}",
            sampler_arg(b.field),
            b.value,
            b.expected
        ))
    })
}

/// The message of a reply's error, naming the Python argument where gds-runtime's names
/// gdsrun's flag.
fn reply_message(e: impl std::fmt::Display) -> String {
    e.to_string().replace("use --ctx", "use Engine(..., ctx=N)")
}

/// An error of a reply ([`reply_message`]).
fn reply_err(e: impl std::fmt::Display) -> PyErr {
    err(reply_message(e))
}

/// What one reply asks for.
struct Job {
    /// A prompt, or chat messages.
    prompt: Result<String, Vec<Message>>,
    sampler: SamplerConfig,
    limits: Limits,
    /// The grammar the reply follows, and the log-probabilities it reports.
    grammar: Option<Grammar>,
    logprobs: Option<usize>,
    /// Functions the model may call (OpenAI's `tools`), checked against its chat template.
    tools: Option<Tools>,
}

/// A JSON value from Python: a dict/list (through `json.dumps`) or JSON text.
fn json_arg(v: &Bound<'_, PyAny>, what: &str) -> PyResult<serde_json::Value> {
    let text: String = if v.is_instance_of::<PyString>() {
        v.extract()?
    } else {
        let json = v.py().import("json")?;
        json.call_method1("dumps", (v,))
            .map_err(|e| PyTypeError::new_err(format!("{what}: not JSON-serializable ({e})")))?
            .extract()?
    };
    serde_json::from_str(&text).map_err(|e| PyValueError::new_err(format!("{what}: not JSON: {e}")))
}

/// llama.cpp's samplers a `samplers` dict may set (llama-server's request fields).
const EXTRA_SAMPLERS: [&str; 18] = [
    "typical_p",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "dynatemp_range",
    "dynatemp_exponent",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "adaptive_target",
    "adaptive_decay",
    "min_keep",
    "samplers",
];

/// `base` with a `samplers` dict's settings over it: llama-server's field names
/// ([`EXTRA_SAMPLERS`]), `samplers` the chain's order (a list of stage names, or a string of
/// their letters as `--sampler-seq`). An unknown key or a value of the wrong type is a
/// ValueError naming it; ranges are checked with the rest of the sampling.
fn extra_samplers(base: &ExtraSamplers, d: Option<&Bound<'_, PyAny>>) -> PyResult<ExtraSamplers> {
    let Some(d) = d else {
        return Ok(base.clone());
    };
    let serde_json::Value::Object(map) = json_arg(d, "samplers")? else {
        return Err(PyTypeError::new_err(
            "samplers must be a dict of llama.cpp's sampler settings",
        ));
    };
    // the settings over `base`'s (its serialized form leaves defaults out, which read back
    // as defaults): one deserialization of the whole
    let mut merged = serde_json::to_value(base).map_err(err)?;
    let mut order = None;
    for (k, v) in map {
        if !EXTRA_SAMPLERS.contains(&k.as_str()) {
            return Err(PyValueError::new_err(format!(
                "samplers: unknown setting {k:?} (known: {})",
                EXTRA_SAMPLERS.join(", ")
            )));
        }
        if k == "samplers" {
            order = Stage::from_json(&v).map_err(PyValueError::new_err)?;
            continue;
        }
        // each key read alone first: a value of the wrong type is named
        serde_json::from_value::<ExtraSamplers>(serde_json::json!({ &k: &v }))
            .map_err(|e| PyValueError::new_err(format!("samplers[{k:?}]: {e}")))?;
        merged[&k] = v;
    }
    let mut out: ExtraSamplers = serde_json::from_value(merged).map_err(err)?;
    if let Some(order) = order {
        out.order = order;
    }
    Ok(out)
}

/// Runs `job` on `e`: a string prompt as `gdsrun run --prompt` runs it (one chat turn with
/// the plan's system prompt, or a raw completion), messages through the chat template.
/// Each reply stands alone (no conversation is kept between calls).
fn run_job(
    e: &mut gds_runtime::Engine,
    job: Job,
    on_text: &mut dyn FnMut(&str),
) -> gds_runtime::Result<GenerateOutput> {
    if e.plan().sampler != job.sampler || e.plan().limits != job.limits {
        e.set_sampling(job.sampler, job.limits)?;
    }
    if e.plan().grammar != job.grammar || e.plan().logprobs != job.logprobs {
        e.set_constraints(job.grammar, job.logprobs)?;
    }
    let t0 = Instant::now();
    let messages = match job.prompt {
        Ok(_) if e.plan().mode == Mode::Raw && job.tools.is_some() => {
            return Err(gds_runtime::RuntimeError::Usage(
                "tools: a raw completion (raw=True) renders no chat template to put them in".into(),
            ))
        }
        Ok(p) if e.plan().mode == Mode::Raw => return e.generate(&p, on_text),
        Ok(p) => {
            let mut m = Vec::new();
            if let Some(s) = &e.plan().system {
                m.push(Message::new("system", s));
            }
            m.push(Message::new("user", &p));
            m
        }
        Err(m) => m,
    };
    let list = job.tools.as_ref().map(|t| &t.list);
    let tokens = e
        .tokenizer()
        .encode_chat_with_tools(&messages, list, e.plan().ctx)?;
    // a thinking model's reasoning apart (the details' `reasoning`), as the server's
    e.generate_chat_tokens(&tokens, t0, &mut |_| {}, on_text)
}

/// What a reply is held to and reports beyond its text: the keyword arguments `grammar`,
/// `json_schema`, `regex`, `logprobs` and `top_logprobs` of `generate` and `stream`.
struct Constraints<'py> {
    grammar: Option<String>,
    json_schema: Option<Bound<'py, PyAny>>,
    regex: Option<String>,
    logprobs: bool,
    top_logprobs: Option<usize>,
}

impl Constraints<'_> {
    /// The grammar, as gdsrun's `--grammar` (Lark, or GBNF told apart by its `::=`),
    /// `--json-schema` (a dict, or a JSON string) and `--regex` take it; at most one.
    fn grammar(&self) -> PyResult<Option<Grammar>> {
        let given = [
            self.grammar.is_some(),
            self.json_schema.is_some(),
            self.regex.is_some(),
        ];
        if given.iter().filter(|&&g| g).count() > 1 {
            return Err(PyValueError::new_err(
                "grammar, json_schema and regex: give at most one",
            ));
        }
        if let Some(text) = &self.grammar {
            let g = Grammar::from_text(text).map_err(|e| err(format!("grammar: {e}")))?;
            return Ok(Some(g));
        }
        if let Some(schema) = &self.json_schema {
            return Ok(Some(Grammar::JsonSchema(json_arg(schema, "json_schema")?)));
        }
        Ok(self.regex.clone().map(Grammar::Regex))
    }

    /// The alternatives per token to report (`logprobs=True`, `top_logprobs=N` implying
    /// it), or None.
    fn logprobs(&self) -> Option<usize> {
        (self.logprobs || self.top_logprobs.is_some()).then(|| self.top_logprobs.unwrap_or(0))
    }
}

/// The keyword arguments `tools`, `tool_choice` and `parallel_tool_calls` of `generate`, as
/// OpenAI's chat API takes them.
struct ToolArgs<'py> {
    tools: Option<Bound<'py, PyAny>>,
    tool_choice: Option<Bound<'py, PyAny>>,
    parallel_tool_calls: Option<bool>,
}

impl ToolArgs<'_> {
    /// The functions, checked against the model's chat template (which must take `tools`),
    /// as `gdsrun serve` checks a request's.
    fn tools(
        &self,
        py: Python<'_>,
        engine: &Mutex<gds_runtime::Engine>,
    ) -> PyResult<Option<Tools>> {
        let tools = self
            .tools
            .as_ref()
            .map(|v| json_arg(v, "tools"))
            .transpose()?;
        let choice = self
            .tool_choice
            .as_ref()
            .map(|v| {
                // "auto", "required", "none" as plain strings, not JSON text
                if v.is_instance_of::<PyString>() {
                    v.extract::<String>().map(serde_json::Value::String)
                } else {
                    json_arg(v, "tool_choice")
                }
            })
            .transpose()?;
        if tools.is_none() && choice.is_none() && self.parallel_tool_calls.is_none() {
            return Ok(None);
        }
        let parallel = self.parallel_tool_calls;
        // (the engine may be busy with another reply: wait for it without the GIL)
        py.detach(|| {
            let e = lock(engine);
            Tools::from_request(
                tools.as_ref(),
                choice.as_ref(),
                parallel,
                e.tokenizer().chat_template(),
            )
            .map_err(|e| e.text())
        })
        .map_err(PyValueError::new_err)
    }
}

/// A prompt string, or chat messages: a list of dicts in OpenAI's form (`role`, `content` as
/// text or text parts, an assistant's `tool_calls`, a tool result's `tool_call_id`), checked
/// as `gdsrun serve` checks them.
fn prompt_arg(p: &Bound<'_, PyAny>) -> PyResult<Result<String, Vec<Message>>> {
    if p.is_instance_of::<PyString>() {
        return Ok(Ok(p.extract::<String>()?));
    }
    if !p.is_instance_of::<PyList>() {
        return Err(PyTypeError::new_err(
            "prompt: a string, or a list of {\"role\", \"content\"} dicts",
        ));
    }
    let v = json_arg(p, "prompt")?;
    gds_serve::openai_messages(&v)
        .map(Err)
        .map_err(|e| PyValueError::new_err(e.text()))
}

/// A loaded model that generates: `Engine(model, **plan_options)` takes gdsrun's options
/// (`threads`, `ctx`, `batch`, `kv_type`, `backend`, `io`, `mem_budget`, `activations`,
/// `verify`, `isa`, `raw`, `system`, `draft`, `chat_template_file`, `chat_template`, ... and the sampling
/// defaults `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`, `seed`,
/// `max_tokens`, `stop`, and `samplers`: llama.cpp's samplers by llama-server's names).
#[pyclass(module = "gdsllm._gdsllm", frozen)]
pub struct Engine {
    engine: Arc<Mutex<gds_runtime::Engine>>,
    /// The sampling and limits the engine was made with; each reply starts from them.
    sampler: SamplerConfig,
    limits: Limits,
    interrupt: Arc<AtomicBool>,
    /// The process that loaded it: its worker threads do not exist in a forked child.
    pid: u32,
}

/// Locks the engine. Only ever called with the GIL released (inside `py.detach`): a thread
/// waiting here for another thread's reply must not keep every other Python thread (one
/// that would call `interrupt`, say) waiting.
fn lock(e: &Mutex<gds_runtime::Engine>) -> std::sync::MutexGuard<'_, gds_runtime::Engine> {
    // a panic while generating is reported as an error by the generating call; the engine's
    // state is then still consistent enough to be reused or dropped
    e.lock().unwrap_or_else(|p| p.into_inner())
}

impl Engine {
    /// Refuses `what` in a process forked from the one that loaded the engine (its threads
    /// are gone there, and its lock may be held for ever by one of them).
    fn check_process(&self, what: &str) -> PyResult<()> {
        if std::process::id() != self.pid {
            return Err(err(crate::forked_message(what)));
        }
        fork_guard(what)
    }

    #[allow(clippy::too_many_arguments)]
    fn job(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        max_tokens: Option<usize>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        repeat_penalty: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<String>>,
        samplers: Option<&Bound<'_, PyAny>>,
        c: Constraints<'_>,
        t: ToolArgs<'_>,
    ) -> PyResult<Job> {
        let mut s = self.sampler.clone();
        s.extra = extra_samplers(&s.extra, samplers)?;
        s.temp = temperature.unwrap_or(s.temp);
        s.top_k = top_k.unwrap_or(s.top_k);
        s.top_p = top_p.unwrap_or(s.top_p);
        s.min_p = min_p.unwrap_or(s.min_p);
        s.repeat_penalty = repeat_penalty.unwrap_or(s.repeat_penalty);
        s.seed = seed.unwrap_or(s.seed);
        let mut limits = self.limits.clone();
        if max_tokens.is_some() {
            limits.max_tokens = max_tokens;
        }
        if let Some(st) = stop {
            limits.stop = st;
        }
        check_sampler(&s)?;
        let tools = t.tools(py, &self.engine)?;
        let mut grammar = c.grammar()?;
        let other = grammar.is_some().then_some("grammar, json_schema or regex");
        let call_grammar = tools
            .as_ref()
            .map(|t| t.call_grammar_beside(other))
            .transpose()
            .map_err(|e| PyValueError::new_err(e.text()))?
            .flatten();
        if call_grammar.is_some() {
            grammar = call_grammar;
        }
        Ok(Job {
            prompt: prompt_arg(prompt)?,
            sampler: s,
            limits,
            grammar,
            logprobs: c.logprobs(),
            tools,
        })
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model, *, threads=None, batch=None, ctx=None, kv_type=None,
        backend=None, io=None, mem_budget=None, vram_budget=None, activations=None,
        verify=true, isa=None, raw=false, parse_special=false, system=None, draft=None,
        draft_max=None, temperature=None, top_k=None, top_p=None, min_p=None,
        repeat_penalty=None, repeat_last_n=None, frequency_penalty=None,
        presence_penalty=None, seed=None, max_tokens=None, stop=None, chat_template_file=None,
        chat_template=None, samplers=None, generation_config=None, plain_http=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: &Bound<'_, PyAny>,
        threads: Option<usize>,
        batch: Option<usize>,
        ctx: Option<usize>,
        kv_type: Option<String>,
        backend: Option<String>,
        io: Option<String>,
        mem_budget: Option<Bound<'_, PyAny>>,
        vram_budget: Option<Bound<'_, PyAny>>,
        activations: Option<String>,
        verify: bool,
        isa: Option<String>,
        raw: bool,
        parse_special: bool,
        system: Option<String>,
        draft: Option<Bound<'_, PyAny>>,
        draft_max: Option<usize>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        repeat_penalty: Option<f32>,
        repeat_last_n: Option<usize>,
        frequency_penalty: Option<f32>,
        presence_penalty: Option<f32>,
        seed: Option<u64>,
        max_tokens: Option<usize>,
        stop: Option<Vec<String>>,
        chat_template_file: Option<std::path::PathBuf>,
        chat_template: Option<String>,
        samplers: Option<Bound<'_, PyAny>>,
        generation_config: Option<Bound<'_, PyAny>>,
        plain_http: bool,
    ) -> PyResult<Engine> {
        fork_guard("Engine")?;
        let model = path_arg(model, "model")?;
        // "auto" (the model's recommended sampling), "none", or a generation_config.json
        let generation_config = match generation_config {
            None => gds_runtime::recommended::Source::Auto,
            Some(g) => path_arg(&g, "generation_config")?
                .parse()
                .map_err(|e: String| PyValueError::new_err(format!("generation_config: {e}")))?,
        };
        let draft = draft.map(|d| path_arg(&d, "draft")).transpose()?;
        {
            // the sampling defaults' ranges, named as the Python arguments
            let d = SamplerConfig::default();
            check_sampler(&SamplerConfig {
                extra: extra_samplers(&d.extra, samplers.as_ref())?,
                temp: temperature.unwrap_or(d.temp),
                top_p: top_p.unwrap_or(d.top_p),
                min_p: min_p.unwrap_or(d.min_p),
                repeat_penalty: repeat_penalty.unwrap_or(d.repeat_penalty),
                frequency_penalty: frequency_penalty.unwrap_or(d.frequency_penalty),
                presence_penalty: presence_penalty.unwrap_or(d.presence_penalty),
                ..d
            })?;
        }
        if let Some(p) = &chat_template_file {
            // a FIFO or device would block the read for ever: a regular file only (a link
            // to one is followed)
            let real = std::fs::canonicalize(p)
                .map_err(|e| err(format!("chat_template_file {}: {e}", p.display())))?;
            gds_io::open_regular(&real, 0).map_err(|e| err(format!("chat_template_file: {e}")))?;
        }
        let kv_dtype = match kv_type.as_deref() {
            None => None,
            Some(k) => Some(KvDtype::parse(k).ok_or_else(|| {
                PyValueError::new_err(format!("kv_type {k:?}: expected f32 or f16"))
            })?),
        };
        let isa = match isa.as_deref() {
            None => None,
            Some(s) => Some(
                gds_runtime::plan::parse_isa(s)
                    .map_err(|e| PyValueError::new_err(format!("isa: {e}")))?,
            ),
        };
        let dir = resolve_model(py, &model, plain_http)?;
        let opts = PlanOptions {
            model_dir: dir.clone(),
            threads,
            batch,
            ctx,
            kv_dtype,
            backend,
            io,
            mem_budget: size_arg(mem_budget, "mem_budget")?,
            vram_budget: size_arg(vram_budget, "vram_budget")?,
            activations,
            no_verify: !verify,
            isa,
            raw,
            parse_special,
            system,
            draft,
            draft_max,
            temp: temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n,
            frequency_penalty,
            presence_penalty,
            seed,
            max_tokens,
            stop: stop.unwrap_or_default(),
            chat_template_file,
            chat_template,
            extra_given: gds_runtime::recommended::ExtraGiven {
                order: samplers.is_some(),
                ..Default::default()
            },
            extra_sampling: extra_samplers(&Default::default(), samplers.as_ref())?,
            generation_config,
            ..Default::default()
        };
        let engine = py
            .detach(|| {
                let plan = Plan::build(&opts).map_err(|e| e.to_string())?;
                gds_runtime::Engine::load(plan)
                    .map_err(|e| format!("loading {}: {e}", dir.display()))
            })
            .map_err(err)?;
        Ok(Engine {
            sampler: engine.plan().sampler.clone(),
            limits: engine.plan().limits.clone(),
            interrupt: engine.interrupt_flag(),
            engine: Arc::new(Mutex::new(engine)),
            pid: std::process::id(),
        })
    }

    /// The run plan, as `gdsrun run --plan` prints it (a dict).
    #[getter]
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.check_process("Engine.plan")?;
        let engine = &self.engine;
        let v = py
            .detach(|| serde_json::to_value(lock(engine).plan()))
            .map_err(err)?;
        json_to_py(py, &v)
    }

    /// Generates a reply to `prompt` (a string, or chat messages: a list of {"role",
    /// "content"} dicts) and returns its text; `details=True` returns the dict `gdsrun run
    /// --json` prints (text, tokens, stop_reason, logprobs, plan, metrics). A string is a
    /// chat turn with the plan's system prompt (a raw completion with `raw=True`), as
    /// `gdsrun run --prompt`. `grammar` (Lark or GBNF text), `json_schema` (a dict or JSON
    /// text) or `regex` holds the reply to it, as gdsrun's `--grammar`, `--json-schema`,
    /// `--regex`; `logprobs=True` (with `top_logprobs=N` alternatives, 0..=20) reports each
    /// token's log-probability in the details, as `--logprobs N`. `tools` (OpenAI's list of
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`),
    /// `tool_choice` ("auto", "none", "required" or `{"type": "function", "function":
    /// {"name": ...}}`) and `parallel_tool_calls` work as in `gdsrun serve`'s chat API: the
    /// model's chat template renders the functions (a template that takes none is refused),
    /// "required" or a named function holds the reply to calls with valid arguments, and the
    /// calls are parsed out of the reply: with `tools` the result is the assistant message
    /// (`{"role": "assistant", "content", "tool_calls": [{"id", "type", "function": {"name",
    /// "arguments"}}]}`); messages may carry an assistant's `tool_calls` and `role: "tool"`
    /// results (`tool_call_id`). The details always hold that `message`. `samplers`: a dict
    /// of llama.cpp's samplers by llama-server's names (`dry_multiplier`, `mirostat`,
    /// `typical_p`, `xtc_probability`, ..., `samplers` the chain's order), over the engine's.
    /// The GIL is released while the engine works.
    #[pyo3(signature = (prompt, *, max_tokens=None, temperature=None, top_k=None, top_p=None,
        min_p=None, repeat_penalty=None, seed=None, stop=None, grammar=None, json_schema=None,
        regex=None, logprobs=false, top_logprobs=None, tools=None, tool_choice=None,
        parallel_tool_calls=None, samplers=None, details=false))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        prompt: &Bound<'py, PyAny>,
        max_tokens: Option<usize>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        repeat_penalty: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<String>>,
        grammar: Option<String>,
        json_schema: Option<Bound<'py, PyAny>>,
        regex: Option<String>,
        logprobs: bool,
        top_logprobs: Option<usize>,
        tools: Option<Bound<'py, PyAny>>,
        tool_choice: Option<Bound<'py, PyAny>>,
        parallel_tool_calls: Option<bool>,
        samplers: Option<Bound<'py, PyAny>>,
        details: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_process("Engine.generate")?;
        let job = self.job(
            py,
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            seed,
            stop,
            samplers.as_ref(),
            Constraints {
                grammar,
                json_schema,
                regex,
                logprobs,
                top_logprobs,
            },
            ToolArgs {
                tools,
                tool_choice,
                parallel_tool_calls,
            },
        )?;
        let with_tools = job.tools.is_some();
        // On a thread of its own, waited for with the GIL released and Python's signals
        // checked between waits: Ctrl-C raises KeyboardInterrupt at once, and dropping the
        // job's stream then stops this reply (or calls it off while it waits its turn).
        let job = self.start(job, false)?;
        let j = loop {
            match job.next_piece(py)? {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(err(e)),
                None => match job.result.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    Some(j) => break j,
                    None => return Err(err("the generating thread ended without a result")),
                },
            }
        };
        if details {
            json_to_py(py, &j)
        } else if with_tools {
            json_to_py(py, &j["message"])
        } else {
            Ok(PyString::new(py, j["text"].as_str().unwrap_or_default()).into_any())
        }
    }

    /// Like `generate` (the same keyword arguments but `details`), but an iterator of the text as it is generated (pieces of the
    /// reply); after the last piece its `result` holds the dict `generate(details=True)`
    /// returns (with `tools`, the pieces are the raw reply, calls in the template's syntax
    /// included, and `result["message"]` has them parsed). Dropping the iterator early stops
    /// the generation.
    #[pyo3(signature = (prompt, *, max_tokens=None, temperature=None, top_k=None, top_p=None,
        min_p=None, repeat_penalty=None, seed=None, stop=None, grammar=None, json_schema=None,
        regex=None, logprobs=false, top_logprobs=None, tools=None, tool_choice=None,
        parallel_tool_calls=None, samplers=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream<'py>(
        &self,
        py: Python<'py>,
        prompt: &Bound<'py, PyAny>,
        max_tokens: Option<usize>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        repeat_penalty: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<String>>,
        grammar: Option<String>,
        json_schema: Option<Bound<'py, PyAny>>,
        regex: Option<String>,
        logprobs: bool,
        top_logprobs: Option<usize>,
        tools: Option<Bound<'py, PyAny>>,
        tool_choice: Option<Bound<'py, PyAny>>,
        parallel_tool_calls: Option<bool>,
        samplers: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Stream> {
        self.check_process("Engine.stream")?;
        let job = self.job(
            py,
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            seed,
            stop,
            samplers.as_ref(),
            Constraints {
                grammar,
                json_schema,
                regex,
                logprobs,
                top_logprobs,
            },
            ToolArgs {
                tools,
                tool_choice,
                parallel_tool_calls,
            },
        )?;
        self.start(job, true)
    }

    /// The token ids of `text` as a raw-mode prompt is tokenized (BOS as the model wants
    /// it; `special=True`: special-token texts become their tokens).
    #[pyo3(signature = (text, *, special=false))]
    fn tokenize(&self, py: Python<'_>, text: &str, special: bool) -> PyResult<Vec<u32>> {
        self.check_process("Engine.tokenize")?;
        let engine = self.engine.clone();
        py.detach(move || {
            let e = lock(&engine);
            e.tokenizer().encode_prompt(text, special, e.plan().ctx)
        })
        .map_err(reply_err)
    }

    /// Stops the reply being generated at the moment of the call, whichever thread's call
    /// (`generate` or a `stream`) it is; it ends with stop_reason "interrupted". Replies that
    /// start later (one waiting for the engine) are not stopped. To stop one stream of
    /// several, drop (or stop iterating and delete) that stream.
    fn interrupt(&self) {
        self.interrupt.store(true, Ordering::Relaxed);
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        if std::process::id() != self.pid {
            return "<gdsllm.Engine loaded before a fork: unusable here>".into();
        }
        let engine = &self.engine;
        py.detach(|| {
            let e = lock(engine);
            format!(
                "<gdsllm.Engine {} ({}, {})>",
                e.plan().model_dir.display(),
                e.plan().arch,
                e.backend()
            )
        })
    }
}

/// What `generate` and `stream` share.
impl Engine {
    /// Starts `job` on a thread of its own, which waits for the engine; its pieces of text
    /// are sent when `pieces` (a `stream`), else only its end.
    fn start(&self, job: Job, pieces: bool) -> PyResult<Stream> {
        let tools = job.tools.clone();
        let (tx, rx) = mpsc::channel();
        let engine = self.engine.clone();
        let interrupt = self.interrupt.clone();
        let state = Arc::new(Mutex::new(JobState::Waiting));
        let mine = state.clone();
        std::thread::Builder::new()
            .name("gdsllm-generate".into())
            .spawn(move || {
                let mut e = lock(&engine);
                {
                    let mut st = job_state(&mine);
                    if *st == JobState::Dropped {
                        // the iterator went before the engine was free: nothing to do
                        return;
                    }
                    *st = JobState::Running;
                }
                let out = run_job(&mut e, job, &mut |s| {
                    // the iterator is gone: stop (the engine is ours: its flag stops only
                    // this reply)
                    if pieces && tx.send(Piece::Text(s.to_string())).is_err() {
                        interrupt.store(true, Ordering::Relaxed);
                    }
                });
                let done = out
                    .map(|o| {
                        let mut j = o.json_with_plan(e.plan());
                        let finish = o.stop_reason.finish();
                        j["message"] = assistant_message(tools.as_ref(), &o.text, finish).0;
                        j
                    })
                    .map_err(reply_message);
                // finished before the engine is let go: from now on dropping the iterator
                // must not touch the engine's interrupt flag (another reply's)
                *job_state(&mine) = JobState::Finished;
                drop(e);
                let _ = tx.send(Piece::Done(done));
            })
            .map_err(err)?;
        Ok(Stream {
            rx: Mutex::new(Some(rx)),
            interrupt: self.interrupt.clone(),
            state,
            result: Mutex::new(None),
            pid: std::process::id(),
        })
    }
}

enum Piece {
    Text(String),
    Done(Result<serde_json::Value, String>),
}

/// Where a stream's reply stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JobState {
    /// Its thread waits for the engine (another reply holds it).
    Waiting,
    /// It holds the engine and generates.
    Running,
    /// It let the engine go (or is about to).
    Finished,
    /// The iterator was dropped while it waited: it never runs.
    Dropped,
}

fn job_state(s: &Mutex<JobState>) -> std::sync::MutexGuard<'_, JobState> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// The iterator `Engine.stream` returns. Several threads may iterate one stream: each piece
/// goes to one of them.
#[pyclass(module = "gdsllm._gdsllm", frozen)]
pub struct Stream {
    /// The pieces; None once the last came. Locked only with the GIL released (a thread
    /// waiting for a piece holds it).
    rx: Mutex<Option<mpsc::Receiver<Piece>>>,
    /// The engine's interrupt flag: set on drop only while this stream's reply runs.
    interrupt: Arc<AtomicBool>,
    state: Arc<Mutex<JobState>>,
    result: Mutex<Option<serde_json::Value>>,
    /// The process that started it (its thread is not in a forked child).
    pid: u32,
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        match self.next_piece(py)? {
            Some(Ok(s)) => Ok(s),
            Some(Err(e)) => Err(err(e)),
            None => Err(PyStopIteration::new_err(())),
        }
    }

    /// After the last piece: the dict `generate(details=True)` returns; None before.
    #[getter]
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        // (held only for a moment by the thread that stores it)
        let v = self
            .result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match v {
            Some(v) => json_to_py(py, &v).map(Some),
            None => Ok(None),
        }
    }
}

/// How often a thread waiting for a piece takes the GIL back to run Python's signal
/// handlers (Ctrl-C's KeyboardInterrupt).
const SIGNAL_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// One wait of [`Stream::next_piece`].
enum Step {
    Piece(Result<String, String>),
    End,
    Wait,
}

impl Stream {
    /// The next piece of text, an error of the reply, or None after the last (its result
    /// then stored). Waits with the GIL released, taking it back every [`SIGNAL_POLL`] to
    /// run Python's signal handlers: their exception (KeyboardInterrupt) is returned, the
    /// reply left running (dropping the stream stops it).
    fn next_piece(&self, py: Python<'_>) -> PyResult<Option<Result<String, String>>> {
        if std::process::id() != self.pid {
            return Err(err(crate::forked_message("Stream")));
        }
        let (rx, result) = (&self.rx, &self.result);
        loop {
            // the lock is taken with the GIL released: a second thread iterating waits
            // here for the first one's piece without holding the GIL the first one needs
            let step = py.detach(|| {
                let mut guard = rx.lock().unwrap_or_else(|p| p.into_inner());
                let Some(r) = guard.as_ref() else {
                    return Step::End;
                };
                match r.recv_timeout(SIGNAL_POLL) {
                    Ok(Piece::Text(s)) => Step::Piece(Ok(s)),
                    Ok(Piece::Done(Ok(v))) => {
                        *result.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
                        *guard = None;
                        Step::End
                    }
                    Ok(Piece::Done(Err(e))) => {
                        *guard = None;
                        Step::Piece(Err(e))
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => Step::Wait,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        *guard = None;
                        Step::Piece(Err("the generating thread ended without a result".into()))
                    }
                }
            });
            match step {
                Step::Piece(p) => return Ok(Some(p)),
                Step::End => return Ok(None),
                Step::Wait => py.check_signals()?,
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // stops this stream's own reply only: while it waits for the engine it is called
        // off, while it runs the engine (its own then) is interrupted, and once it finished
        // the flag, which may be another reply's by now, is left alone
        if std::process::id() != self.pid {
            return;
        }
        let mut st = job_state(&self.state);
        match *st {
            JobState::Waiting => *st = JobState::Dropped,
            JobState::Running => self.interrupt.store(true, Ordering::Relaxed),
            JobState::Finished | JobState::Dropped => {}
        }
    }
}

/// Converts a GGUF file, a safetensors file or a Hugging Face directory into a GdsLLM
/// model directory at `dst`, as `gdsconv convert` does; `quant` is its `--quant` policy
/// (None keeps every tensor as stored). Returns a summary dict.
#[pyfunction]
#[pyo3(signature = (src, dst, quant=None, *, force=false))]
pub fn convert<'py>(
    py: Python<'py>,
    src: std::path::PathBuf,
    dst: std::path::PathBuf,
    quant: Option<String>,
    force: bool,
) -> PyResult<Bound<'py, PyDict>> {
    fork_guard("convert")?;
    let quant = match quant {
        None => gds_convert::QuantTarget::Keep,
        Some(q) => q
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("quant: {e}")))?,
    };
    let opts = gds_convert::ConvertOptions {
        quant,
        force,
        ..Default::default()
    };
    let s = py
        .detach(|| gds_convert::convert(&src, &dst, &opts, &gds_convert::NoProgress))
        .map_err(err)?;
    let d = PyDict::new(py);
    d.set_item("arch", &s.arch)?;
    d.set_item("runnable", s.runnable)?;
    d.set_item("tensors", s.tensors)?;
    d.set_item("layers", s.layers)?;
    d.set_item("tensor_bytes", s.tensor_bytes)?;
    d.set_item("file_bytes", s.file_bytes)?;
    d.set_item("seconds", s.seconds)?;
    d.set_item("warnings", &s.warnings)?;
    Ok(d)
}
