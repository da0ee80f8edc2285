//! Fuzz target `imatrix`: [`gds_fuzz::imatrix`] (an importance matrix file, GGUF or legacy
//! `.dat`). Run with `just fuzz imatrix SECONDS`; the committed seeds are replayed on stable
//! by `cargo test --release -p gds-fuzz`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: gds_fuzz::TemplateAllocator<gds_fuzz::CappedAlloc> =
    gds_fuzz::TemplateAllocator(gds_fuzz::CappedAlloc::new(gds_fuzz::MEMORY_CAP));

fuzz_target!(init: gds_fuzz::init_fuzzing(), |data: &[u8]| {
    gds_fuzz::imatrix(data);
});
