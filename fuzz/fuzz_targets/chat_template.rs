//! Fuzz target `chat_template`: [`gds_fuzz::chat_template`] (a chat template's source). Run
//! with `just fuzz chat_template SECONDS`; the committed seeds are replayed on stable by
//! `cargo test --release -p gds-fuzz`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: gds_fuzz::TemplateAllocator<gds_fuzz::CappedAlloc> =
    gds_fuzz::TemplateAllocator(gds_fuzz::CappedAlloc::new(gds_fuzz::MEMORY_CAP));

fuzz_target!(init: gds_fuzz::init_fuzzing(), |data: &[u8]| {
    gds_fuzz::chat_template(data);
});
