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

/// The split fixture (fixtures/make_split_gguf.py: gguf-py's writer, four shards, the first
/// holding only metadata) read from its first shard: the unsplit file's tensors, byte for
/// byte, and its metadata without llama.cpp's `split.*` keys.
#[test]
fn a_split_gguf_reads_as_the_whole_file() {
    let whole = read_gguf(&fixtures().join("tiny-llama.gguf")).unwrap();
    let first = fixtures().join("split/tiny-llama-00001-of-00004.gguf");
    let shards = gds_convert::gguf::gguf_shards(&first).unwrap();
    let names: Vec<_> = shards
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        (1..=4)
            .map(|i| format!("tiny-llama-{i:05}-of-00004.gguf"))
            .collect::<Vec<_>>()
    );
    let split = read_gguf(&first).unwrap();
    assert_eq!((split.arch.as_str(), split.runnable), ("llama", true));
    assert_eq!(split.tensors.len(), whole.tensors.len());
    let files: std::collections::BTreeSet<_> =
        split.tensors.iter().map(|t| t.file.path.clone()).collect();
    assert_eq!(files.len(), 3, "tensors from shards 2-4");
    for t in &whole.tensors {
        let s = split.tensors.iter().find(|s| s.name == t.name).unwrap();
        assert_eq!((s.dtype, &s.shape), (t.dtype, &t.shape), "{}", t.name);
        assert!(s.bytes() == t.bytes(), "{} differs", t.name);
    }
    assert_eq!(split.metadata, whole.metadata);
    assert!(!split.metadata.keys().any(|k| k.contains("split.")));
    // llama.cpp's shard names, read and written by one pair of functions
    use gds_convert::gguf::{shard_file_name, split_name};
    assert_eq!(split_name("big-00002-of-00003.gguf"), Some(("big", 2, 3)));
    assert_eq!(
        split_name("a/Big-00001-OF-00003.GGUF"),
        Some(("a/Big", 1, 3))
    );
    for not in [
        "big.gguf",
        "big-0001-of-00003.gguf",
        "big-00001-of-00003.bin",
        "00001-of-00003.gguf",
    ] {
        assert_eq!(split_name(not), None, "{not}");
    }
    assert_eq!(
        shard_file_name("big", 2, 3, ".gguf"),
        "big-00002-of-00003.gguf"
    );
    // a whole file is its only shard
    let one = gds_convert::gguf::gguf_shards(&fixtures().join("tiny-llama.gguf")).unwrap();
    assert_eq!(one, vec![fixtures().join("tiny-llama.gguf")]);
}

/// What can go wrong with shards, each an error naming the file and what to do: another
/// shard than the first named, a shard missing, a first shard renamed, a shard of another
/// split in the place of one, a tensor count that the shards do not add up to.
#[test]
fn split_gguf_mistakes_are_named() {
    let src = fixtures().join("split");
    let shard = |i: usize| format!("tiny-llama-{i:05}-of-00004.gguf");
    let copy = |dir: &Path, skip: &[usize]| {
        for i in 1..=4 {
            if !skip.contains(&i) {
                std::fs::copy(src.join(shard(i)), dir.join(shard(i))).unwrap();
            }
        }
    };
    let err = |p: &Path| match read_gguf(p) {
        Ok(_) => panic!("{} read without an error", p.display()),
        Err(e) => e.to_string(),
    };

    let e = err(&src.join(shard(2)));
    assert!(
        e.contains(&shard(2)) && e.contains("name the first") && e.contains(&shard(1)),
        "{e}"
    );

    let d = tempfile::tempdir().unwrap();
    copy(d.path(), &[3]);
    let e = err(&d.path().join(shard(1)));
    assert!(
        e.contains("shard 3 of 4 is missing") && e.contains(&shard(3)),
        "{e}"
    );

    let d = tempfile::tempdir().unwrap();
    std::fs::copy(src.join(shard(1)), d.path().join("model.gguf")).unwrap();
    let e = err(&d.path().join("model.gguf"));
    assert!(
        e.contains("model.gguf") && e.contains("-00001-of-00004.gguf"),
        "{e}"
    );

    // shard 3 replaced by shard 4's bytes: its split.no is 3, not 2
    let d = tempfile::tempdir().unwrap();
    copy(d.path(), &[3]);
    std::fs::copy(src.join(shard(4)), d.path().join(shard(3))).unwrap();
    let e = err(&d.path().join(shard(1)));
    assert!(
        e.contains(&shard(3)) && e.contains("split.no Some(3)"),
        "{e}"
    );

    // the first shard's split.tensors.count changed from 21 to 20
    let d = tempfile::tempdir().unwrap();
    copy(d.path(), &[]);
    let mut b = std::fs::read(d.path().join(shard(1))).unwrap();
    let key = b"split.tensors.count";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // the value follows its type (an i32 as gguf-py writes it: 21)
    let ty = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    assert_eq!(ty, 5, "gguf-py writes split.tensors.count as an i32");
    b[at + 4..at + 8].copy_from_slice(&20i32.to_le_bytes());
    std::fs::write(d.path().join(shard(1)), &b).unwrap();
    let e = err(&d.path().join(shard(1)));
    assert!(
        e.contains("split.tensors.count is 20") && e.contains("hold 21 tensors"),
        "{e}"
    );
}
