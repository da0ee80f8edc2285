//! gds-convert: the integration tests, one test binary (each file a module; one link
//! instead of one per file).

mod gguf_source;
mod safetensors_source;
mod tokenizer_golden;
