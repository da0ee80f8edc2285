//! gds-dist: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod manifest_rules;
mod store;
