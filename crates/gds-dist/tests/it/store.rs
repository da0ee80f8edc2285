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

/// Every path under `dir` (files and directories, links not followed), relative.
fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut v = Vec::new();
    for d in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = d.path();
        v.push(p.strip_prefix(dir).unwrap().display().to_string());
        if d.file_type().unwrap().is_dir() {
            v.extend(
                entries(&p)
                    .into_iter()
                    .map(|e| format!("{}/{e}", d.file_name().to_string_lossy())),
            );
        }
    }
    v.sort();
    v
}

/// Leftovers of a store operation: temporary links, staging and `.old` directories.
fn leftovers(store: &std::path::Path) -> Vec<String> {
    entries(&store.join("models"))
        .into_iter()
        .chain(entries(&store.join("blobs")))
        .filter(|e| {
            e.ends_with(".ingest-tmp")
                || e.contains(".tmp-")
                || e.contains(".old")
                || e.split('/').any(|c| c.starts_with('.'))
        })
        .collect()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn concurrent_first_uses_convert_and_pull_once_and_gc_cleans_up() {
    use gds_dist::registry::{Remote, RemoteOptions};
    use gds_dist::resolve::{resolve_model, ResolveOptions};
    // GDSLLM_HOME is the process's: this is the only test in this binary that sets it.
    let t = tempfile::tempdir().unwrap();
    std::env::set_var("GDSLLM_HOME", t.path());
    let store_dir = t.path().join("store");
    let models = || {
        std::fs::read_dir(store_dir.join("models"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let first_uses = |spec: &str, opts: &ResolveOptions| -> Vec<std::path::PathBuf> {
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..4)
                .map(|_| sc.spawn(|| resolve_model(spec, opts)))
                .collect();
            hs.into_iter()
                .enumerate()
                .map(|(i, h)| {
                    h.join()
                        .unwrap()
                        .unwrap_or_else(|e| panic!("first use {i} of {spec}: {e}"))
                })
                .collect()
        })
    };

    // `gdsrun MODEL.gguf` four times at once: one conversion, every file one blob
    let gguf = gds_tests::smollm_gguf();
    let quiet = ResolveOptions {
        quiet: true,
        ..Default::default()
    };
    let dirs = first_uses(gguf.to_str().unwrap(), &quiet);
    assert!(dirs.iter().all(|d| d == &dirs[0]), "{dirs:?}");
    assert_eq!(models(), 1, "{:?}", entries(&store_dir.join("models")));
    assert_eq!(leftovers(&store_dir), Vec::<String>::new());
    for f in gds_dist::store::walk_files(&dirs[0]) {
        assert!(
            std::fs::metadata(&f).unwrap().nlink() >= 2,
            "{} is not linked to a blob",
            f.display()
        );
    }

    // `gdsrun REF` four times at once: one pull, no `.old` directory left
    let reg = gds_tests::registry::Registry::start();
    let r = reg.reference("smollm2", "latest");
    let plain = RemoteOptions {
        plain_http: true,
        ..Default::default()
    };
    let art = gds_dist::package::package_dir(&dirs[0], &|_| {}).unwrap();
    Remote::new(&r, plain.clone()).unwrap().push(&art).unwrap();
    let opts = ResolveOptions {
        remote: plain,
        quiet: true,
    };
    let pulled = first_uses(&r, &opts);
    assert!(pulled.iter().all(|d| d == &pulled[0]), "{pulled:?}");
    assert_eq!(models(), 2, "{:?}", entries(&store_dir.join("models")));
    assert_eq!(leftovers(&store_dir), Vec::<String>::new());

    // what a killed ingest leaves (a temporary link) goes at the next gc; what is used stays
    let store = Store::open(&store_dir).unwrap();
    let stale = dirs[0].join(".tokenizer.json.999999-0.ingest-tmp");
    std::fs::hard_link(dirs[0].join("tokenizer.json"), &stale).unwrap();
    let s = store.gc().unwrap();
    // (the pulled config blob, which no model file links to, may go)
    assert_eq!(s.removed_models, 0);
    assert!(!stale.exists(), "gc left {}", stale.display());
    assert_eq!(leftovers(&store_dir), Vec::<String>::new());
    assert_eq!(
        entries(&store_dir.join("partial")),
        Vec::<String>::new(),
        "unlocked lock files and partial downloads go at gc"
    );
    assert_eq!(models(), 2);
}

#[test]
fn concurrent_ingests_of_the_same_bytes_all_succeed() {
    // eight models with the same files, ingested at once: every ingest succeeds, each
    // distinct file is one blob, and no temporary link is left
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(&t.path().join("store")).unwrap();
    let dirs: Vec<_> = (0..8)
        .map(|i| {
            let d = store.model_dir(&format!("gguf:m{i}"));
            std::fs::create_dir_all(&d).unwrap();
            for f in 0..20u8 {
                std::fs::write(d.join(format!("f{f}.bin")), vec![f; 3000]).unwrap();
            }
            d
        })
        .collect();
    std::thread::scope(|sc| {
        for d in &dirs {
            let store = &store;
            sc.spawn(move || {
                for f in 0..20 {
                    store
                        .ingest(&d.join(format!("f{f}.bin")))
                        .unwrap_or_else(|e| panic!("ingest f{f}.bin: {e}"));
                }
            });
        }
    });
    assert_eq!(
        std::fs::read_dir(t.path().join("store/blobs/sha256"))
            .unwrap()
            .count(),
        20
    );
    for d in &dirs {
        assert_eq!(entries(d).len(), 20, "{:?}", entries(d));
        for f in 0..20 {
            assert_eq!(
                std::fs::metadata(d.join(format!("f{f}.bin")))
                    .unwrap()
                    .nlink(),
                9,
                "f{f}.bin is not shared"
            );
        }
    }
}

/// A killed pull of another tool's model leaves its assembled files (`partial/*.src-*`,
/// hard links of blobs): `gc` removes them and, in the same run, the blobs only they held.
#[test]
fn gc_removes_a_killed_conversions_files_and_their_blobs() {
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(&t.path().join("store")).unwrap();
    let f = t.path().join("model.gguf");
    std::fs::write(&f, b"GGUF and more").unwrap();
    let digest = store.ingest(&f).unwrap();
    std::fs::remove_file(&f).unwrap();
    let src = t
        .path()
        .join("store/partial")
        .join(format!("abc{}1234", gds_dist::store::FOREIGN_SRC));
    std::fs::create_dir_all(&src).unwrap();
    link_or_copy(&store.blob_path(&digest).unwrap(), &src.join("model.gguf")).unwrap();
    let s = store.gc().unwrap();
    assert!(!src.exists());
    assert_eq!((s.removed_blobs, s.removed_bytes), (1, 13));
    assert!(!store.blob_path(&digest).unwrap().exists());
}
