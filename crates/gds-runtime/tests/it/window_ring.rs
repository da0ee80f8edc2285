//! Sliding-window layers keep a ring of blocks instead of the whole context (the CPU
//! executor's cache, `KvCache::with_window_ring`): the logits must be those of the full cache
//! at every position, whatever the pass size, on the tiny transformers-made Gemma 3 (window 4
//! on 5 of 6 layers) and Mistral (window 4 on every layer) fixtures; and `--plan` says what
//! the ring saves.

use gds_runtime::exec::{Executor, OneSequence};
use gds_runtime::{Model, Plan, PlanOptions};
use std::path::{Path, PathBuf};

fn converted(arch: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join(format!("{arch}.gds"));
    gds_convert::convert(
        &gds_tests::fixture(&format!("tiny-{arch}-hf")),
        &out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .unwrap();
    (tmp, out)
}

fn plan(dir: &Path, batch: usize) -> Plan {
    Plan::build(&PlanOptions {
        model_dir: dir.to_path_buf(),
        ctx: Some(64),
        threads: Some(1),
        batch: Some(batch),
        backend: Some("cpu".into()),
        activations: Some("f32".into()),
        raw: true,
        ..Default::default()
    })
    .unwrap()
}

/// Logits of every position of `tokens`, evaluated in passes of `batch`.
fn logits(dir: &Path, tokens: &[u32], batch: usize) -> (Vec<Vec<f32>>, OneSequence) {
    let p = plan(dir, batch);
    let mut e = OneSequence::cpu(Model::open(&p).unwrap(), &p, batch, batch);
    let mut rows = vec![Vec::new(); tokens.len()];
    e.eval(tokens, 0, 0..tokens.len(), &mut |pos, l| {
        rows[pos] = l.to_vec()
    })
    .unwrap();
    (rows, e)
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn window_rings_give_the_full_cache_logits_at_every_position() {
    let tokens: Vec<u32> = (0..60).map(|i| (7 * i + 3) % 317 + 3).collect();
    for arch in ["gemma3", "mistral"] {
        let (_tmp, dir) = converted(arch);
        // one pass of 60: a ring would not be smaller than the context of 64
        let p = plan(&dir, 60);
        assert_eq!(p.kv_window_ring_positions, None, "{arch}");
        assert_eq!(p.kv_bytes, p.kv_full_context_bytes);
        let (want, _) = logits(&dir, &tokens, 60);
        for batch in [1, 3, 7] {
            let p = plan(&dir, batch);
            let ring = p.kv_window_ring_positions.expect("a ring");
            assert!(ring < 64 && ring >= 4 + batch - 1, "{arch}: ring {ring}");
            assert!(p.kv_bytes < p.kv_full_context_bytes, "{arch}");
            let (got, e) = logits(&dir, &tokens, batch);
            let mut worst = 0f32;
            for (pos, (a, b)) in got.iter().zip(&want).enumerate() {
                for (x, y) in a.iter().zip(b) {
                    worst = worst.max((x - y).abs());
                }
                assert_eq!(
                    gds_runtime::ops::argmax(a),
                    gds_runtime::ops::argmax(b),
                    "{arch}, passes of {batch}: position {pos}"
                );
            }
            assert!(worst < 1e-4, "{arch}, passes of {batch}: {worst}");
            // a cut far back finds its keys overwritten: the engine starts again from 0
            assert!(e.can_truncate(60, 59));
            assert!(!e.can_truncate(60, 20), "{arch}, passes of {batch}");
        }
    }
}

/// Cutting back within what the ring holds and continuing gives the same logits as never
/// having gone further (what chat turns and a rewound generation do).
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn continuing_after_a_cut_within_the_ring_matches() {
    let (_tmp, dir) = converted("gemma3");
    let tokens: Vec<u32> = (0..40).map(|i| (11 * i + 5) % 317 + 3).collect();
    let (want, _) = logits(&dir, &tokens, 60);
    let (_, mut e) = logits(&dir, &tokens, 3);
    // go on with other tokens past position 40, then cut back to 38 and redo 38..40
    e.eval(&[9, 9, 9], 40, 0..0, &mut |_, _| {}).unwrap();
    assert!(e.can_truncate(43, 38));
    let mut got = Vec::new();
    e.eval(&tokens[38..40], 38, 38..40, &mut |_, l| {
        got.push(l.to_vec())
    })
    .unwrap();
    for (i, row) in got.iter().enumerate() {
        let worst = row
            .iter()
            .zip(&want[38 + i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "position {}: {worst}", 38 + i);
    }
}

/// Speculative decoding's rollback: a pass over a token and wrong guesses writes their keys
/// past the accepted length; continuing from the accepted length must give the logits of a
/// run that never saw the guesses — with the window rings too, where the rejected positions
/// take ring slots (the ring's slack is one pass, and a pass holds the token and at most
/// `batch - 1` guesses). Passes of 4 (token + 3 guesses) at every position, one guess
/// accepted each time, on the tiny Gemma 3 (window 4) and Mistral fixtures and llama.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn rejected_guesses_leave_no_trace_in_the_logits() {
    let tokens: Vec<u32> = (0..40).map(|i| (11 * i + 5) % 311 + 3).collect();
    for arch in ["gemma3", "mistral", "llama3"] {
        let (_tmp, dir) = converted(arch);
        let batch = 4;
        let (want, _) = logits(&dir, &tokens, batch);
        let p = plan(&dir, batch);
        let mut e = OneSequence::cpu(Model::open(&p).unwrap(), &p, batch, batch);
        let mut got: Vec<Vec<f32>> = vec![Vec::new(); tokens.len()];
        e.eval(&tokens[..1], 0, 0..1, &mut |pos, l| got[pos] = l.to_vec())
            .unwrap();
        let mut pos = 1;
        while pos < tokens.len() {
            // the true next token, one right guess, then two wrong ones
            let mut pass = vec![tokens[pos]];
            if pos + 1 < tokens.len() {
                pass.push(tokens[pos + 1]);
            }
            pass.extend([(tokens[pos] + 1) % 300 + 3, 7]);
            let mut rows = Vec::new();
            e.eval(&pass, pos, pos..pos + pass.len(), &mut |_, l| {
                rows.push(l.to_vec())
            })
            .unwrap();
            let accepted = if pos + 1 < tokens.len() { 2 } else { 1 };
            for (i, row) in rows.into_iter().take(accepted).enumerate() {
                got[pos + i] = row;
            }
            pos += accepted;
        }
        let mut worst = 0f32;
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.len(), b.len(), "{arch}: position {i}");
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs());
            }
            assert_eq!(
                gds_runtime::ops::argmax(a),
                gds_runtime::ops::argmax(b),
                "{arch}: position {i}"
            );
        }
        assert!(worst < 1e-4, "{arch}: max |logit diff| {worst}");
    }
}
