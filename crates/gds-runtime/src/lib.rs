#![doc = include_str!("../README.md")]

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
pub use exec::{BatchExecutor, Executor, OneSequence};
pub use gds_kernels::Isa;
pub use kv::{KvCache, KvDtype, NO_BLOCK};
pub use metrics::{EnergyMeter, Metrics};
pub use model::{Batch, Model, RunState};
pub use plan::{Plan, PlanOptions};
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::TextTokenizer;
