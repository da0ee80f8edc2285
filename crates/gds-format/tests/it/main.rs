//! gds-format: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod builtin_templates;
mod manifest;
mod template_golden;
