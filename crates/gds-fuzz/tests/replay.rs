//! Corpus replay on stable: every file in `fuzz/seeds/<target>/` and
//! `fuzz/regressions/<target>/` goes through the same entry point as the fuzz target
//! (`gds_fuzz::<target>`), under the global allocator the fuzz targets use too
//! ([`CappedAlloc`]: at most [`MEMORY_CAP`] bytes held at once), so a reader that allocates by
//! a hostile length aborts this test (naming the input) instead of exhausting the machine.

use gds_fuzz::{CappedAlloc, MEMORY_CAP};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

#[global_allocator]
static ALLOC: gds_fuzz::TemplateAllocator<CappedAlloc> =
    gds_fuzz::TemplateAllocator(CappedAlloc::new(MEMORY_CAP));

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.expect("directory entry").path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

/// Feeds every seed and regression input of `target` to its entry point; fails listing every
/// input that panicked, when the target has no seeds, and when no seed is accepted (the
/// entry point no longer reaches past the first check, e.g. after a format change).
fn replay(target: &str) {
    // as the fuzz targets (gds_fuzz::init_fuzzing): parked template renders fit under the cap
    gds_format::render_memory::set_bound(gds_fuzz::MEMORY_CAP / 16);
    let seeds = files_in(&fuzz_dir().join("seeds").join(target));
    assert!(
        !seeds.is_empty(),
        "fuzz/seeds/{target}/ is empty or missing (scripts/fuzz-seeds.py --curated makes it)"
    );
    let regressions = files_in(&fuzz_dir().join("regressions").join(target));
    let (mut failed, mut accepted) = (Vec::new(), 0);
    for (i, path) in seeds.iter().chain(&regressions).enumerate() {
        let bytes = std::fs::read(path).expect("read input");
        let name: &'static str = Box::leak(path.display().to_string().into_boxed_str());
        gds_fuzz::set_current_input(name);
        match catch_unwind(AssertUnwindSafe(|| gds_fuzz::run(target, &bytes))) {
            Ok(Some(ok)) => accepted += usize::from(ok && i < seeds.len()),
            Ok(None) => panic!("no target {target}"),
            Err(_) => failed.push(name),
        }
        gds_fuzz::set_current_input("");
    }
    assert!(
        failed.is_empty(),
        "{} of {} {target} inputs panicked: {failed:#?}",
        failed.len(),
        seeds.len() + regressions.len()
    );
    assert!(
        accepted > 0,
        "none of the {} seeds in fuzz/seeds/{target}/ is accepted: regenerate them with \
         scripts/fuzz-seeds.py --curated",
        seeds.len()
    );
}

#[test]
fn replay_manifest() {
    replay("manifest");
}

#[test]
fn replay_gguf() {
    replay("gguf");
}

#[test]
fn replay_safetensors() {
    replay("safetensors");
}

#[test]
fn replay_tokenizer() {
    replay("tokenizer");
}

#[test]
fn replay_chat_template() {
    replay("chat_template");
}

#[test]
fn replay_imatrix() {
    replay("imatrix");
}

#[test]
fn replay_grammar() {
    replay("grammar");
}

/// The cap is real: a request past it fails (without the capped allocator this succeeds on
/// any machine with overcommit), and a small one still succeeds.
#[test]
fn allocation_past_the_cap_is_refused() {
    let mut big: Vec<u8> = Vec::new();
    assert!(big.try_reserve_exact(MEMORY_CAP + 1).is_err());
    let mut small: Vec<u8> = Vec::new();
    assert!(small.try_reserve_exact(1 << 20).is_ok());
}
