//! gds-kernels: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod goldens;
mod kernels;
