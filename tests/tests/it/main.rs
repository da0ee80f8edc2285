//! gds-tests (end-to-end): the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod convert_fixtures;
mod dist;
mod gdsconv;
mod imatrix;
mod integrity;
mod quant_moe;
