//! GdsLLM CPU inference runtime.
//!
//! The flow: a [`Plan`] is built once from user settings and the model's manifest (every
//! decision made there, the GPU plan included), an [`Executor`] is opened by it — the CPU
//! [`Model`] (layers made resident through a `gds-io` backend, weights located zero-copy)
//! with a preallocated [`RunState`] and [`KvCache`], or the CUDA executor under the `cuda`
//! feature — and an [`Engine`] runs prompts through it with a [`Sampler`] and [`Metrics`].

mod attention;
pub mod backend;
pub mod error;

pub mod chat;
pub mod config;
pub mod constraint;
pub mod cuda_graph;
pub mod draft;
pub mod engine;
pub mod exec;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod gpuplan;
pub mod graph;
pub mod ioplan;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod perplexity;
pub mod plan;
pub mod reply;
pub mod rope;
pub mod sampler;
pub mod tokenizer;
pub mod weights;

pub use config::{Config, RopeScaling};
pub use constraint::{Constraint, Grammar, GrammarCompiler, Mask};
pub use engine::{Engine, GenerateOutput, StopReason};
pub use error::{Result, RuntimeError};
pub use exec::{CpuExecutor, Executor};
pub use gds_kernels::Isa;
pub use kv::{KvCache, KvDtype, NO_BLOCK};
pub use metrics::{EnergyMeter, Metrics};
pub use model::{Batch, Model, RunState};
pub use plan::{Plan, PlanOptions};
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::TextTokenizer;
