//! gdsrun: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod batch;
mod cli;
mod errors;
mod imatrix;
mod interleave;
mod speculative;
mod stream;

use std::process::{Command, Output, Stdio};

/// `gdsrun ARGS`, stdin closed, its output collected.
fn gdsrun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gdsrun"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("spawn gdsrun")
}
