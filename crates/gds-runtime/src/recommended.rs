//! The sampling settings a model's own files recommend, taken as the defaults of every run
//! and request that does not set them, as llama.cpp and vLLM take them:
//!
//! - `generation_config.json` (a Hugging Face checkpoint's, copied by `gdsconv convert`):
//!   `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty` — vLLM's keys, with
//!   `max_new_tokens` as the default most tokens of a reply — and llama.cpp's additions
//!   (`penalty_repeat`, `penalty_last_n`, `xtc_probability`, `xtc_threshold`, `mirostat`,
//!   `mirostat_tau`, `mirostat_eta`, `sequence`), plus transformers' `stop_strings`;
//! - a GGUF's `general.sampling.*` keys (llama.cpp's converter writes them from the same
//!   file; kept by `gdsconv convert` as `gguf.general.sampling.*`).
//!
//! The file's keys win over the GGUF's. `do_sample` is not read (neither llama.cpp nor vLLM
//! reads it: a model that recommends a temperature is sampled at it). The files are
//! untrusted input: a setting of the wrong type or out of its range is left out, and named
//! in the plan with why, never an error; the command line (`--temp`, ...) and a request's
//! own fields win over every recommendation. `--generation-config none` turns them off,
//! `--generation-config FILE` reads another `generation_config.json` in place of the model's.

use crate::error::{Result, RuntimeError};
use crate::sampler::{SamplerConfig, Stage};
use gds_format::Manifest;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `generation_config.json`'s cap (real ones are a few hundred bytes).
pub const MAX_GENERATION_CONFIG_BYTES: u64 = 1 << 20;
/// Most stop strings a model may recommend (a request's own cap).
const MAX_STOP: usize = 16;
/// Longest stop string a model may recommend, bytes.
const MAX_STOP_BYTES: usize = 1024;

/// Where the recommendation comes from (`--generation-config`).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Source {
    /// The model's `generation_config.json`, else its GGUF's `general.sampling.*`.
    #[default]
    Auto,
    /// None: gdsrun's own defaults.
    Off,
    /// This `generation_config.json` (or the one in this directory), in place of the
    /// model's.
    File(PathBuf),
}

impl std::str::FromStr for Source {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Source, String> {
        match s {
            "auto" => Ok(Source::Auto),
            "none" | "off" => Ok(Source::Off),
            "" => Err("expected auto, none or a generation_config.json".into()),
            p => Ok(Source::File(PathBuf::from(p))),
        }
    }
}

/// Which of [`ExtraSamplers`]' recommendable settings the user gave (the model's
/// recommendation fills only the others).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtraGiven {
    /// `--xtc-probability`.
    pub xtc_probability: bool,
    /// `--xtc-threshold`.
    pub xtc_threshold: bool,
    /// `--mirostat`.
    pub mirostat: bool,
    /// `--mirostat-ent` (tau).
    pub mirostat_tau: bool,
    /// `--mirostat-lr` (eta).
    pub mirostat_eta: bool,
    /// `--samplers` / `--sampler-seq`.
    pub order: bool,
}

impl ExtraGiven {
    /// Every one given: nothing of the extras is taken from the model.
    pub const ALL: ExtraGiven = ExtraGiven {
        xtc_probability: true,
        xtc_threshold: true,
        mirostat: true,
        mirostat_tau: true,
        mirostat_eta: true,
        order: true,
    };
}

/// One recommended setting, read and checked.
#[derive(Clone, Debug, PartialEq)]
enum Setting {
    Temp(f32),
    TopK(usize),
    TopP(f32),
    MinP(f32),
    RepeatPenalty(f32),
    /// `None`: the whole context (llama.cpp's -1).
    RepeatLastN(Option<usize>),
    XtcProbability(f32),
    XtcThreshold(f32),
    Mirostat(u8),
    MirostatTau(f32),
    MirostatEta(f32),
    Order(Vec<Stage>),
    MaxTokens(usize),
    Stop(Vec<String>),
}

/// The recommendation of one model, read from its files.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recommended {
    /// Where it was read (`generation_config.json`, `the GGUF's general.sampling.*`, both,
    /// or the file given); empty: nothing recommended.
    pub source: String,
    /// The settings, by the plan's names (`temp`, `top_k`, ...), each once.
    settings: BTreeMap<&'static str, (Setting, Value)>,
    /// Settings left out, each with why.
    pub ignored: Vec<String>,
}

/// What the plan reports of the recommendation.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Where it was read.
    pub source: String,
    /// The settings taken, by the plan's names, as the file gave them.
    pub applied: BTreeMap<String, Value>,
    /// Settings the model recommends that the command line (or the caller) set otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub overridden: Vec<String>,
    /// Settings the model's files give that were left out, each with why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ignored: Vec<String>,
}

impl Report {
    /// One line for a log: `temp 0.6, top_p 0.95 (generation_config.json)`.
    pub fn summary(&self) -> String {
        let list: Vec<String> = self
            .applied
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!("{} ({})", list.join(", "), self.source)
    }
}

/// A setting's plan name, its `generation_config.json` keys and its GGUF keys.
type Row = (
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
);

/// Each setting: the plan's name, the `generation_config.json` keys that give it (a later one
/// over an earlier, as llama.cpp's converter reads them) and its GGUF key
/// (`general.sampling.<key>`; none for vLLM's and transformers' own).
const KEYS: &[Row] = &[
    ("temp", &["temperature"], &["temp"]),
    ("top_k", &["top_k"], &["top_k"]),
    ("top_p", &["top_p"], &["top_p"]),
    ("min_p", &["min_p"], &["min_p"]),
    (
        "repeat_penalty",
        &["repetition_penalty", "penalty_repeat"],
        &["penalty_repeat"],
    ),
    ("repeat_last_n", &["penalty_last_n"], &["penalty_last_n"]),
    (
        "xtc_probability",
        &["xtc_probability"],
        &["xtc_probability"],
    ),
    ("xtc_threshold", &["xtc_threshold"], &["xtc_threshold"]),
    ("mirostat", &["mirostat"], &["mirostat"]),
    ("mirostat_tau", &["mirostat_tau"], &["mirostat_tau"]),
    ("mirostat_eta", &["mirostat_eta"], &["mirostat_eta"]),
    ("samplers", &["sequence"], &["sequence"]),
    ("max_tokens", &["max_new_tokens"], &[]),
    ("stop", &["stop_strings"], &[]),
];

/// Which of [`KEYS`]' columns a source is read by.
#[derive(Clone, Copy)]
enum Keys {
    File,
    Gguf,
}

/// The prefix `gdsconv convert` keeps a GGUF's sampling keys under.
const GGUF_PREFIX: &str = "gguf.general.sampling.";

impl Recommended {
    /// Reads the recommendation of the model in `dir` (manifest `m`) from `source`. Errors
    /// only where the model's `generation_config.json` fails its hash (a damaged model, as
    /// any listed file) or the file `--generation-config` names cannot be read or is not a
    /// JSON object; a setting of the wrong type or range is left out and named.
    pub fn read(dir: &Path, m: &Manifest<'_>, source: &Source) -> Result<Recommended> {
        let mut r = Recommended::default();
        match source {
            Source::Off => {}
            Source::File(p) => {
                let path = if p.is_dir() {
                    p.join("generation_config.json")
                } else {
                    p.clone()
                };
                let bytes = {
                    use std::io::Read;
                    let mut v = Vec::new();
                    gds_io::open_user_file(&path)
                        .and_then(|f| f.take(MAX_GENERATION_CONFIG_BYTES + 1).read_to_end(&mut v))
                        .map_err(|e| RuntimeError::file(&path, e))?;
                    v
                };
                let bad = |why: &str| {
                    RuntimeError::Usage(format!("{} (--generation-config): {why}", path.display()))
                };
                if bytes.len() as u64 > MAX_GENERATION_CONFIG_BYTES {
                    return Err(bad("larger than 1 MiB, not a generation_config.json"));
                }
                match serde_json::from_slice::<Value>(&bytes) {
                    Ok(Value::Object(o)) => r.take_file(&o, &path.display().to_string()),
                    _ => return Err(bad("not a JSON object")),
                }
            }
            Source::Auto => {
                let mut gguf = Map::new();
                for (k, v) in m.kvs() {
                    if let Some(name) = k.strip_prefix(GGUF_PREFIX) {
                        gguf.insert(name.to_string(), meta_json(v));
                    }
                }
                r.take(&gguf, Keys::Gguf, "the GGUF's general.sampling.*");
                let name = "generation_config.json";
                if let Some(f) = gds_io::read_model_file(dir, m, name, MAX_GENERATION_CONFIG_BYTES)?
                {
                    match serde_json::from_slice::<Value>(&f.bytes) {
                        Ok(Value::Object(o)) => r.take_file(&o, name),
                        // a model's file that is not what it should be: left out, named
                        _ => r
                            .ignored
                            .push(format!("{name}: not a JSON object (left out)")),
                    }
                }
            }
        }
        Ok(r)
    }

    fn take_file(&mut self, o: &Map<String, Value>, what: &str) {
        self.take(o, Keys::File, what);
    }

    /// Takes every setting `o` gives under `keys`' names, over what an earlier source gave.
    fn take(&mut self, o: &Map<String, Value>, keys: Keys, what: &str) {
        let mut any = false;
        let named = KEYS.iter().flat_map(|&(name, file, gguf)| {
            let here = match keys {
                Keys::File => file,
                Keys::Gguf => gguf,
            };
            here.iter().map(move |&key| (key, name))
        });
        for (key, name) in named {
            let Some(v) = o.get(key) else { continue };
            if v.is_null() {
                continue;
            }
            match setting(name, v) {
                Ok(s) => {
                    self.settings.insert(name, (s, v.clone()));
                    any = true;
                }
                Err(why) => self.ignored.push(format!("{what}: {key} {v}: {why}")),
            }
        }
        if any {
            if self.source.is_empty() {
                self.source = what.to_string();
            } else {
                self.source = format!("{what} over {}", self.source);
            }
        }
    }

    /// True when the model recommends nothing.
    pub fn is_empty(&self) -> bool {
        self.settings.is_empty() && self.ignored.is_empty()
    }

    /// Fills what the user left unset (`None` in `given`, [`ExtraGiven`]) from the
    /// recommendation: the sampler, the most tokens of a reply and the stop strings; the
    /// context `ctx` stands for llama.cpp's `penalty_last_n = -1`. A setting that would make
    /// the sampler invalid beside the others (checked one at a time) is left out and named.
    pub fn apply(&self, a: Apply<'_>) -> Option<Report> {
        if self.is_empty() {
            return None;
        }
        let mut report = Report {
            source: self.source.clone(),
            ignored: self.ignored.clone(),
            ..Default::default()
        };
        for (&name, (s, raw)) in &self.settings {
            let given = match s {
                Setting::Temp(_) => a.given.temp,
                Setting::TopK(_) => a.given.top_k,
                Setting::TopP(_) => a.given.top_p,
                Setting::MinP(_) => a.given.min_p,
                Setting::RepeatPenalty(_) => a.given.repeat_penalty,
                Setting::RepeatLastN(_) => a.given.repeat_last_n,
                Setting::XtcProbability(_) => a.given.extra.xtc_probability,
                Setting::XtcThreshold(_) => a.given.extra.xtc_threshold,
                Setting::Mirostat(_) => a.given.extra.mirostat,
                Setting::MirostatTau(_) => a.given.extra.mirostat_tau,
                Setting::MirostatEta(_) => a.given.extra.mirostat_eta,
                Setting::Order(_) => a.given.extra.order,
                Setting::MaxTokens(_) => a.given.max_tokens,
                Setting::Stop(_) => a.given.stop,
            };
            if given {
                report.overridden.push(name.to_string());
                continue;
            }
            let before = a.sampler.clone();
            match s {
                Setting::Temp(v) => a.sampler.temp = *v,
                Setting::TopK(v) => a.sampler.top_k = *v,
                Setting::TopP(v) => a.sampler.top_p = *v,
                Setting::MinP(v) => a.sampler.min_p = *v,
                Setting::RepeatPenalty(v) => a.sampler.repeat_penalty = *v,
                Setting::RepeatLastN(v) => a.sampler.repeat_last_n = v.unwrap_or(a.ctx),
                Setting::XtcProbability(v) => a.sampler.extra.xtc_probability = *v,
                Setting::XtcThreshold(v) => a.sampler.extra.xtc_threshold = *v,
                Setting::Mirostat(v) => a.sampler.extra.mirostat = *v,
                Setting::MirostatTau(v) => a.sampler.extra.mirostat_tau = *v,
                Setting::MirostatEta(v) => a.sampler.extra.mirostat_eta = *v,
                Setting::Order(v) => a.sampler.extra.order = v.clone(),
                Setting::MaxTokens(v) => *a.max_tokens = Some(*v),
                Setting::Stop(v) => a.stop.clone_from(v),
            }
            if let Err(e) = a.sampler.check() {
                *a.sampler = before;
                report.ignored.push(format!(
                    "{}: {name} {raw}: with the other settings {} {} must be {}",
                    self.source, e.field, e.value, e.expected
                ));
                continue;
            }
            report.applied.insert(name.to_string(), raw.clone());
        }
        Some(report)
    }
}

/// Which settings the user set (the recommendation fills the others).
#[derive(Clone, Copy, Debug, Default)]
pub struct Given {
    /// `--temp`.
    pub temp: bool,
    /// `--top-k`.
    pub top_k: bool,
    /// `--top-p`.
    pub top_p: bool,
    /// `--min-p`.
    pub min_p: bool,
    /// `--repeat-penalty`.
    pub repeat_penalty: bool,
    /// `--repeat-last-n`.
    pub repeat_last_n: bool,
    /// `--max-tokens`.
    pub max_tokens: bool,
    /// `--stop`.
    pub stop: bool,
    /// llama.cpp's other samplers.
    pub extra: ExtraGiven,
}

/// What [`Recommended::apply`] fills.
pub struct Apply<'a> {
    /// What the user set.
    pub given: Given,
    /// The sampler, the user's settings in it.
    pub sampler: &'a mut SamplerConfig,
    /// Most tokens per reply.
    pub max_tokens: &'a mut Option<usize>,
    /// Stop strings.
    pub stop: &'a mut Vec<String>,
    /// The run's context (llama.cpp's `penalty_last_n = -1`).
    pub ctx: usize,
}

/// A manifest value as JSON.
fn meta_json(v: gds_format::reader::Value<'_>) -> Value {
    use gds_format::reader::Value as M;
    match v {
        M::U64(u) => Value::from(u),
        M::I64(i) => Value::from(i),
        // a GGUF's f32 (0.6 widened is 0.6000000238...) shown as the f32 it was written as
        M::F64(f) => {
            let shown = if f64::from(f as f32) == f {
                format!("{}", f as f32).parse().unwrap_or(f)
            } else {
                f
            };
            serde_json::Number::from_f64(shown).map_or(Value::Null, Value::Number)
        }
        M::Bool(b) => Value::Bool(b),
        M::Str(s) => Value::String(s.to_string()),
    }
}

/// Reads the setting `name` from `v`, checked on its own.
fn setting(name: &str, v: &Value) -> std::result::Result<Setting, String> {
    let float = |lo: f64, hi: f64, what: &str| -> std::result::Result<f32, String> {
        match v.as_f64() {
            Some(f) if f.is_finite() && (lo..=hi).contains(&f) => Ok(f as f32),
            Some(_) => Err(format!("must be {what}")),
            None => Err("must be a number".into()),
        }
    };
    let int = |lo: i64, hi: i64| -> std::result::Result<i64, String> {
        match v.as_i64() {
            Some(i) if (lo..=hi).contains(&i) => Ok(i),
            Some(_) => Err(format!("must be in {lo}..={hi}")),
            // integers written as 40.0 are integers
            None => match v.as_f64() {
                Some(f) if f.fract() == 0.0 && (lo as f64..=hi as f64).contains(&f) => Ok(f as i64),
                _ => Err(format!("must be an integer in {lo}..={hi}")),
            },
        }
    };
    Ok(match name {
        "temp" => Setting::Temp(float(0.0, 100.0, "in [0, 100]")?),
        "top_k" => Setting::TopK(int(0, 1 << 30)? as usize),
        "top_p" => {
            let p = float(0.0, 1.0, "in (0, 1]")?;
            if p <= 0.0 {
                return Err("must be in (0, 1]".into());
            }
            Setting::TopP(p)
        }
        "min_p" => Setting::MinP(float(0.0, 1.0, "in [0, 1]")?),
        "repeat_penalty" => {
            let p = float(0.0, 1e6, "> 0")?;
            if p <= 0.0 {
                return Err("must be > 0".into());
            }
            Setting::RepeatPenalty(p)
        }
        "repeat_last_n" => match int(-1, 1 << 30)? {
            -1 => Setting::RepeatLastN(None),
            n => Setting::RepeatLastN(Some(n as usize)),
        },
        "xtc_probability" => Setting::XtcProbability(float(0.0, 1.0, "in [0, 1]")?),
        "xtc_threshold" => Setting::XtcThreshold(float(0.0, 1.0, "in [0, 1]")?),
        "mirostat" => Setting::Mirostat(int(0, 2)? as u8),
        "mirostat_tau" => Setting::MirostatTau(float(0.0, 1e6, "a number >= 0")?),
        "mirostat_eta" => Setting::MirostatEta(float(0.0, 1e6, "a number >= 0")?),
        "samplers" => match v.as_str() {
            Some(s) if s.len() <= 1024 => Setting::Order(Stage::parse_order(s)?),
            _ => return Err("must be sampler names separated by ';'".into()),
        },
        "max_tokens" => Setting::MaxTokens(int(1, 1 << 30)? as usize),
        "stop" => {
            let list: Vec<&Value> = match v {
                Value::Array(l) => l.iter().collect(),
                one => vec![one],
            };
            if list.len() > MAX_STOP {
                return Err(format!("at most {MAX_STOP} stop strings"));
            }
            let mut out = Vec::new();
            for s in list {
                match s.as_str() {
                    Some(t) if !t.is_empty() && t.len() <= MAX_STOP_BYTES => {
                        out.push(t.to_string())
                    }
                    _ => return Err(format!("must be strings of 1 to {MAX_STOP_BYTES} bytes")),
                }
            }
            Setting::Stop(out)
        }
        other => return Err(format!("{other}: not a setting")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::ExtraSamplers;
    use serde_json::json;

    fn from_file(v: Value) -> Recommended {
        let mut r = Recommended::default();
        r.take_file(v.as_object().unwrap(), "generation_config.json");
        r
    }

    fn applied(
        r: &Recommended,
        given: Given,
    ) -> (SamplerConfig, Option<usize>, Vec<String>, Report) {
        let mut s = SamplerConfig::default();
        let (mut max, mut stop) = (None, Vec::new());
        let rep = r
            .apply(Apply {
                given,
                sampler: &mut s,
                max_tokens: &mut max,
                stop: &mut stop,
                ctx: 4096,
            })
            .unwrap();
        (s, max, stop, rep)
    }

    #[test]
    fn a_checkpoints_recommendation_fills_the_unset_settings() {
        // Qwen3's generation_config.json, with vLLM's max_new_tokens and transformers'
        // stop_strings
        let r = from_file(json!({
            "bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
            "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
            "max_new_tokens": 300, "stop_strings": ["</answer>"],
            "transformers_version": "4.51.0"
        }));
        let (s, max, stop, rep) = applied(&r, Given::default());
        assert_eq!((s.temp, s.top_k, s.top_p), (0.6, 20, 0.95));
        // what it does not give stays gdsrun's (llama.cpp's) default
        assert_eq!(s.min_p, SamplerConfig::default().min_p);
        assert_eq!(max, Some(300));
        assert_eq!(stop, vec!["</answer>".to_string()]);
        assert_eq!(rep.source, "generation_config.json");
        assert_eq!(
            rep.applied.keys().collect::<Vec<_>>(),
            ["max_tokens", "stop", "temp", "top_k", "top_p"]
        );
        // the user's settings win, and are named as such
        let given = Given {
            temp: true,
            max_tokens: true,
            ..Default::default()
        };
        let (s, max, _, rep) = applied(&r, given);
        assert_eq!((s.temp, s.top_k), (SamplerConfig::default().temp, 20));
        assert_eq!(max, None);
        assert_eq!(rep.overridden, ["max_tokens", "temp"]);
    }

    #[test]
    fn llama_cpps_own_keys_and_the_whole_context_window() {
        let r = from_file(json!({
            "penalty_repeat": 1.1, "penalty_last_n": -1, "mirostat": 2, "mirostat_tau": 4.0,
            "xtc_probability": 0.5, "xtc_threshold": 0.1, "sequence": "top_k;temperature"
        }));
        let (s, ..) = applied(&r, Given::default());
        assert_eq!((s.repeat_penalty, s.repeat_last_n), (1.1, 4096));
        assert_eq!((s.extra.mirostat, s.extra.mirostat_tau), (2, 4.0));
        assert_eq!(s.extra.xtc_probability, 0.5);
        assert_eq!(s.extra.order, vec![Stage::TopK, Stage::Temperature]);
        let given = Given {
            extra: ExtraGiven::ALL,
            ..Default::default()
        };
        let (s, ..) = applied(&r, given);
        assert_eq!(s.extra, ExtraSamplers::default());
    }

    #[test]
    fn bad_settings_are_left_out_and_named() {
        let r = from_file(json!({
            "temperature": -1, "top_p": 0, "top_k": "forty", "max_new_tokens": 0,
            "stop_strings": ["", "x"], "mirostat": 3, "sequence": "no_such_sampler",
            "min_p": 0.1, "repetition_penalty": null
        }));
        let (s, max, stop, rep) = applied(&r, Given::default());
        assert_eq!(s.min_p, 0.1);
        assert_eq!((s.temp, s.top_p), (0.8, 0.95));
        assert_eq!((max, stop.len()), (None, 0));
        assert_eq!(rep.applied.keys().collect::<Vec<_>>(), ["min_p"]);
        // null is "not given", as in transformers
        assert_eq!(rep.ignored.len(), 7, "{:?}", rep.ignored);
        assert!(rep
            .ignored
            .iter()
            .any(|i| i.contains("temperature -1") && i.contains("[0, 100]")));
        assert!(rep.ignored.iter().any(|i| i.contains("top_k \"forty\"")));
    }

    #[test]
    fn a_gguf_recommendation_is_overridden_by_the_file() {
        let mut r = Recommended::default();
        let g = json!({"temp": 0.7, "top_k": 64, "top_p": 0.9});
        r.take(
            g.as_object().unwrap(),
            Keys::Gguf,
            "the GGUF's general.sampling.*",
        );
        r.take_file(
            json!({"temperature": 1.0}).as_object().unwrap(),
            "generation_config.json",
        );
        let (s, ..) = applied(&r, Given::default());
        assert_eq!((s.temp, s.top_k, s.top_p), (1.0, 64, 0.9));
        assert_eq!(
            r.source,
            "generation_config.json over the GGUF's general.sampling.*"
        );
    }

    #[test]
    fn nothing_recommended_reports_nothing() {
        let r = from_file(json!({"bos_token_id": 1, "eos_token_id": 2}));
        assert!(r.is_empty());
        let mut s = SamplerConfig::default();
        let (mut max, mut stop) = (None, Vec::new());
        assert!(r
            .apply(Apply {
                given: Given::default(),
                sampler: &mut s,
                max_tokens: &mut max,
                stop: &mut stop,
                ctx: 1,
            })
            .is_none());
        assert_eq!(s, SamplerConfig::default());
        assert_eq!("none".parse::<Source>(), Ok(Source::Off));
        assert_eq!(
            "x/generation_config.json".parse::<Source>(),
            Ok(Source::File("x/generation_config.json".into()))
        );
    }
}
