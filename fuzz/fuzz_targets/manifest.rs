//! Fuzz target: the manifest reader and validator must never panic, whatever the bytes.
//! Run with `cargo +nightly fuzz run manifest` from the repository root (see README).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let (Some(m), _) = gds_format::validate::validate_manifest(data) {
        for i in 0..m.n_layers() {
            let _ = m.layer(i);
        }
        for i in 0..m.n_tensors() {
            let _ = m.tensor(i);
        }
        let _ = m.kvs().count();
    }
});
