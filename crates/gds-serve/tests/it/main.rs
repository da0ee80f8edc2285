//! gds-serve: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod batches;
mod common;
mod context;
mod embeddings;

mod hardening;
mod lm_eval;
mod native;
mod ollama;
mod openai;
mod paged;
mod predicted;
mod reasoning;
mod recommended;
mod rerank;
mod samplers;
mod score;
mod slots;
mod tools;
mod vllm;
