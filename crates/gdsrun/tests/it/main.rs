//! gdsrun: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod batch;
mod cli;
mod errors;
mod imatrix;
mod speculative;
mod stream;
