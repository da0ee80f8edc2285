//! Fuzz target `grammar`: [`gds_fuzz::grammar`] (a client's grammar, regular expression or JSON
//! schema, compiled and walked token by token). Run with `just fuzz grammar SECONDS`; the
//! committed seeds are replayed on stable by `cargo test --release -p gds-fuzz`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: gds_fuzz::TemplateAllocator<gds_fuzz::CappedAlloc> =
    gds_fuzz::TemplateAllocator(gds_fuzz::CappedAlloc::new(gds_fuzz::MEMORY_CAP));

fuzz_target!(init: gds_fuzz::init_fuzzing(), |data: &[u8]| {
    gds_fuzz::grammar(data);
});
