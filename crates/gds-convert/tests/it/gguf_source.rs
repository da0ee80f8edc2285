//! The GGUF reader on Mixtral's two layouts: llama.cpp's converter writes Mixtral as
//! architecture `llama` with `llama.expert_count`, its experts stacked (`ffn_gate_exps`), and
//! before early 2024 wrote one tensor per expert (`blk.N.ffn_gate.E.weight`).

use gds_convert::gguf::read_gguf;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Read as the mixtral family; the per-expert file (fixtures/make_mixtral_per_expert_gguf.py)
/// as the stacked one, tensor for tensor and byte for byte.
#[test]
fn mixtral_per_expert_tensors_read_as_the_stacked_ones() {
    let stacked = read_gguf(&fixtures().join("tiny-mixtral.gguf")).unwrap();
    let split = read_gguf(&fixtures().join("tiny-mixtral-per-expert.gguf")).unwrap();
    assert_eq!(
        (stacked.arch.as_str(), split.arch.as_str()),
        ("mixtral", "mixtral")
    );
    assert!(stacked.runnable && split.runnable);
    assert_eq!(stacked.tensors.len(), split.tensors.len());
    let mut experts = 0;
    for t in &stacked.tensors {
        let s = split
            .tensors
            .iter()
            .find(|s| s.name == t.name)
            .unwrap_or_else(|| panic!("{} missing from the per-expert file", t.name));
        assert_eq!((s.dtype, &s.shape), (t.dtype, &t.shape), "{}", t.name);
        assert!(s.bytes() == t.bytes(), "{} differs", t.name);
        experts += usize::from(t.name.ends_with("_exps.weight"));
    }
    assert_eq!(experts, 6, "2 blocks x gate, up, down");
}

/// An expert missing from the per-expert layout (expert 2's gate renamed 7): an error naming
/// the tensor and the experts found, not a model with a hole.
#[test]
fn a_missing_expert_is_named() {
    let mut bytes = std::fs::read(fixtures().join("tiny-mixtral-per-expert.gguf")).unwrap();
    let from = b"blk.1.ffn_gate.2.weight";
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("the tensor's name");
    bytes[at..at + from.len()].copy_from_slice(b"blk.1.ffn_gate.7.weight");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = read_gguf(&path).expect_err("a missing expert").to_string();
    assert!(
        e.contains("m.gguf")
            && e.contains("blk.1.ffn_gate_exps.weight")
            && e.contains("[0, 1, 3, 7]"),
        "{e}"
    );
}
