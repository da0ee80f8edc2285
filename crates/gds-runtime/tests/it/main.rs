//! gds-runtime: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod architectures;
mod attention;
mod constraint;
mod executor;
mod reference;
mod speculative;
mod streaming;
mod tokenizer;
mod window_ring;
