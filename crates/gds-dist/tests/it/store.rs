//! The content-addressed store: blobs shared by hard links, references, gc.

use gds_dist::store::{link_or_copy, Store};
use std::os::unix::fs::MetadataExt;

#[test]
fn ingest_shares_identical_files_and_gc_keeps_what_is_linked() {
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(&t.path().join("store")).unwrap();
    // two "models" with one identical file and one different
    let a = store.model_dir("gguf:a");
    let b = store.model_dir("gguf:b");
    for (d, other) in [(&a, b"one".as_slice()), (&b, b"two".as_slice())] {
        std::fs::create_dir_all(d.join("layers")).unwrap();
        std::fs::write(d.join("layers/shared.bin"), vec![7u8; 10_000]).unwrap();
        std::fs::write(d.join("own.bin"), other).unwrap();
    }
    let mut digests = Vec::new();
    for d in [&a, &b] {
        for f in ["layers/shared.bin", "own.bin"] {
            digests.push(store.ingest(&d.join(f)).unwrap());
        }
    }
    assert_eq!(digests[0], digests[2], "identical files have one digest");
    let ino = |p: &std::path::Path| std::fs::metadata(p).unwrap().ino();
    assert_eq!(
        ino(&a.join("layers/shared.bin")),
        ino(&b.join("layers/shared.bin"))
    );
    assert_eq!(
        std::fs::read_dir(t.path().join("store/blobs/sha256"))
            .unwrap()
            .count(),
        3
    );

    store.set_ref("a.gguf", "gguf:a", "gguf").unwrap();
    store.set_ref("b.gguf", "gguf:b", "gguf").unwrap();
    assert_eq!(store.list().len(), 2);
    // a directory outside the store hard-linked to b's files keeps them alive
    let outside = t.path().join("pulled");
    link_or_copy(&b.join("own.bin"), &outside.join("own.bin")).unwrap();

    assert!(store.remove_ref("b.gguf").unwrap());
    assert!(!store.remove_ref("b.gguf").unwrap());
    let s = store.gc().unwrap();
    assert_eq!(s.removed_models, 1);
    assert_eq!(
        s.removed_blobs, 0,
        "shared.bin is a's, own.bin of b is linked from outside"
    );
    assert!(store.get_ref("a.gguf").is_some() && store.get_ref("b.gguf").is_none());
    std::fs::remove_dir_all(&outside).unwrap();
    let s = store.gc().unwrap();
    assert_eq!(
        (s.removed_models, s.removed_blobs, s.removed_bytes),
        (0, 1, 3)
    );
    assert_eq!(std::fs::read(a.join("own.bin")).unwrap(), b"one");
}
