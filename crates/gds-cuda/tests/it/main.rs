//! gds-cuda: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod common;

mod emu;
mod executor_emu;
mod forward_emu;
