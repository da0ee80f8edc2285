#![doc = include_str!("../README.md")]

mod attention;
pub mod backend;
pub mod batch;
pub mod error;

pub mod chat;
pub mod config;
pub mod constraint;
pub mod draft;
pub mod engine;
pub mod exec;
mod experts;
pub mod gbnf;
pub mod gpuplan;
pub mod graph;
pub mod harmony;
pub mod imatrix;
pub mod ioplan;
pub mod kld;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod model_dir;
pub mod ops;
pub mod perplexity;
pub mod plan;
pub mod rank;
pub mod reasoning;
pub mod recommended;
pub mod reply;
pub mod rope;
pub mod sampler;
pub mod tokenizer;
pub mod weights;

pub use config::{Config, RopeScaling};
pub use constraint::{Constraint, Grammar, GrammarCompiler, Mask};
pub use engine::{Engine, GenerateOutput, StopReason};
pub use error::{Result, RuntimeError};
// the GPU executors also by their paths before they moved under exec/ (front ends, tests)
pub use batch::Batch;
pub use exec::cuda_graph;
#[cfg(feature = "cuda")]
pub use exec::gpu;
pub use exec::{BatchExecutor, Executor, OneSequence};
pub use gds_cuda::forward::GemmType;
pub use gds_kernels::Isa;
pub use kv::{KvCache, KvDtype, NO_BLOCK};
pub use metrics::{EnergyMeter, Metrics};
pub use model::{Model, RunState};
pub use plan::{Plan, PlanOptions};
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::{ChatEnd, TextTokenizer};
