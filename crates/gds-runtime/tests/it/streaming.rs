//! Layer streaming: the `direct` backend at budgets below the model's size gives exactly
//! the logits of the memory-mapped model (same kernels over the same bytes; only where the
//! bytes come from differs), and its plans respect the budget.

use crate::eval_positions;
use gds_io::DirectSupport;
use gds_runtime::ioplan::{plan_io, IoMode, IoPlan};
use gds_runtime::{Batch, KvCache, KvDtype, Model, RunState};
use std::path::Path;

fn smollm2() -> &'static Path {
    gds_tests::smollm_converted()
}

fn io_plan(io: &str, budget: Option<u64>, buffered: bool) -> IoPlan {
    let dir = smollm2();
    let bytes = gds_io::read_manifest(dir).unwrap();
    let m = gds_format::Manifest::parse(&bytes).unwrap();
    plan_io(dir, &m, io, budget, || {
        if buffered {
            DirectSupport::Buffered("forced by the test".into())
        } else {
            gds_io::probe_direct(&dir.join("layers/blk.0000.bin"))
        }
    })
    .unwrap()
}

/// Logits of a prompt (all positions, in batches of `batch`), then of `decode` greedy
/// single-token steps.
fn run(model: &Model, prompt: &[u32], batch: usize, decode: usize) -> Vec<Vec<f32>> {
    let c = &model.config;
    let mut st = RunState::new(c, batch, batch, model.ctx(), model.threads());
    let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, model.ctx(), c.kv_dim());
    let mut rows = vec![Vec::new(); prompt.len()];
    let mut b = Batch::with_capacity(batch);
    eval_positions(
        model,
        &mut st,
        &mut kv,
        &mut b,
        prompt,
        0,
        0..prompt.len(),
        &mut |p, l| rows[p] = l.to_vec(),
    );
    let mut next = argmax(rows.last().unwrap());
    for i in 0..decode {
        b.clear();
        b.push(next, prompt.len() + i, 0, true);
        model.forward(&mut st, &mut kv, &b).unwrap();
        let l = st.logits(0, c.vocab_size).to_vec();
        next = argmax(&l);
        rows.push(l);
    }
    rows
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

const PROMPT: [u32; 12] = [1, 504, 3458, 282, 4649, 314, 253, 1343, 28, 476, 5248, 30];

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn streamed_logits_equal_mapped_logits_at_every_budget() {
    let mapped = Model::load(smollm2(), 64, 2).unwrap();
    let want = run(&mapped, &PROMPT, 5, 6);
    let weights = mapped.weight_bytes();
    let min = io_plan("direct", Some(weights / 4), false).min_budget_bytes;
    for (budget, buffered) in [
        (None, false),
        (Some(weights / 2), false),
        (Some(weights / 4), false),
        (Some(min), false),
        (Some(weights / 4), true),
    ] {
        let io = io_plan("direct", budget, buffered);
        assert!(io.held_bytes <= budget.unwrap_or(u64::MAX), "{io:?}");
        if budget.is_some_and(|b| b < weights) {
            assert!(!io.streamed_layers.is_empty() && io.streamed_bytes_per_token > 0);
        }
        let model = Model::with_io(smollm2(), &io, 64, 2).unwrap();
        let got = run(&model, &PROMPT, 5, 6);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w,
                "budget {budget:?} buffered {buffered}: logits of row {i} differ from mmap"
            );
        }
        let s = model.io_stats();
        if budget.is_some_and(|b| b < weights) {
            // 9 forward passes (3 prompt batches, 6 decode steps), each streaming the blocks
            let per_pass: u64 = io.streamed_layers.len() as u64 * 2_224_128;
            assert!(s.bytes_read >= 9 * per_pass, "{s:?}");
        }
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_minimum_budget_is_two_buffers_and_smaller_budgets_are_refused() {
    let io = io_plan("direct", Some(24 << 20), false);
    assert_eq!(io.slots, 2);
    assert_eq!(io.min_budget_bytes, 2 * io.slot_bytes);
    // the largest block layer of SmolLM2 is 2.2 MB; the 30 MB embedding/head streams in
    // chunks that fit a buffer
    assert!(io.slot_bytes >= 2_224_128 && io.slot_bytes < 2_300_000);
    assert!(
        io.head.chunk_rows > 0 && io.head.chunk_rows as u64 * io.head.row_bytes <= io.slot_bytes
    );
    let dir = smollm2();
    let bytes = gds_io::read_manifest(dir).unwrap();
    let m = gds_format::Manifest::parse(&bytes).unwrap();
    let e = plan_io(dir, &m, "direct", Some(io.min_budget_bytes - 1), || {
        DirectSupport::Direct
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("minimum working set") && e.contains("4.3 MiB"),
        "{e}"
    );
    let e = plan_io(dir, &m, "mmap", Some(50 << 20), || DirectSupport::Direct)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--io mmap maps the whole model"), "{e}");
    let e = plan_io(dir, &m, "load", Some(50 << 20), || DirectSupport::Direct)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--io load reads the whole model"), "{e}");
    let load = plan_io(dir, &m, "load", None, || DirectSupport::Direct).unwrap();
    assert_eq!((load.mode, load.streamed_layers.len()), (IoMode::Load, 0));
    // auto: no budget holds the whole model (read into huge pages where the kernel has
    // them, mapped where not), a small budget streams
    let auto = plan_io(dir, &m, "auto", None, || DirectSupport::Direct).unwrap();
    let want = if gds_io::huge_pages_available() {
        IoMode::Load
    } else {
        IoMode::Mmap
    };
    assert_eq!(auto.mode, want, "{}", auto.reason);
    assert!(auto.streamed_layers.is_empty());
    let auto = plan_io(dir, &m, "auto", Some(30 << 20), || DirectSupport::Direct).unwrap();
    assert_eq!(auto.mode, IoMode::Direct);
    let auto = plan_io(dir, &m, "auto", Some(30 << 20), || {
        DirectSupport::Buffered("tmpfs".into())
    })
    .unwrap();
    assert_eq!(auto.mode, IoMode::Buffered);
    assert!(auto.reason.contains("tmpfs"), "{}", auto.reason);
}

/// After a pass every streaming buffer is free, and the next pass's first spans (one per
/// buffer) are read while the caller samples: a pass of a streamed model leaves the reads
/// of the next pass's first two blocks behind it, not only of its first.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_pass_reads_the_next_passes_first_spans_into_every_free_buffer() {
    // half the weights: the embedding/head (30 MB) stays, most blocks stream, two buffers
    let weights = Model::load(smollm2(), 64, 2).unwrap().weight_bytes();
    let io = io_plan("direct", Some(weights / 2), false);
    assert!(io.is_resident(io.head.layer), "{io:?}");
    assert!(io.streamed_layers.len() > 2 && io.slots == 2, "{io:?}");
    let bytes = gds_io::read_manifest(smollm2()).unwrap();
    let m = gds_format::Manifest::parse(&bytes).unwrap();
    let size = |l: usize| {
        let f = smollm2().join(m.layer(l).unwrap().file);
        std::fs::metadata(f).unwrap().len()
    };
    let pass: u64 = io.streamed_layers.iter().map(|&l| size(l)).sum();
    let first_two: u64 = io.streamed_layers[..2].iter().map(|&l| size(l)).sum();
    let model = Model::with_io(smollm2(), &io, 64, 2).unwrap();
    let c = &model.config;
    let mut st = RunState::new(c, 1, 1, model.ctx(), model.threads());
    let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, model.ctx(), c.kv_dim());
    let mut b = Batch::with_capacity(1);
    b.push(PROMPT[0], 0, 0, true);
    let before = model.io_stats().bytes_read;
    model.forward(&mut st, &mut kv, &b).unwrap();
    // the I/O thread reads them after the pass returned: wait for it (bounded)
    let t0 = std::time::Instant::now();
    let mut read = 0;
    while t0.elapsed() < std::time::Duration::from_secs(20) {
        read = model.io_stats().bytes_read - before;
        if read >= pass + first_two {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // (spans are read in whole 4 KiB blocks: a little slack per span; a third block of
    // the next pass is not read until the next pass frees a buffer)
    let slack = 4096 * (io.streamed_layers.len() as u64 + 2);
    assert!(
        read >= pass + first_two && read <= pass + first_two + slack,
        "{read} bytes read: the pass's {pass} and the next pass's first two blocks' {first_two}"
    );
}

/// A mixture of experts streams its experts apart: below the model's size a streamed block
/// reads its attention, norms and router through the buffers (gdsconv writes a block's
/// expert matrices last, so they are one range), then only the experts its tokens chose,
/// into a cache of the most recently used. Logits equal the mapped model's at every budget
/// (the minimum, whose cache holds one token's experts so a prompt's experts come in rounds;
/// a cache of every expert; the head resident as well; `O_DIRECT` and buffered), for F32 experts (whole 4 KiB
/// blocks) and Q8_0 ones (rows not aligned); a decode step reads the blocks' dense parts and
/// the chosen experts, not whole blocks; the cache's hits are counted.
#[test]
fn a_mixture_of_experts_streams_only_the_chosen_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let moe = gds_tests::fixture("tiny-qwen3moe-hf");
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 320).collect();
    for quant in ["keep", "q8_0"] {
        let dir = tmp.path().join(quant);
        let opts = gds_convert::ConvertOptions {
            quant: quant.parse().unwrap(),
            ..Default::default()
        };
        gds_convert::convert(&moe, &dir, &opts, &gds_convert::NoProgress).unwrap();
        let bytes = gds_io::read_manifest(&dir).unwrap();
        let m = gds_format::Manifest::parse(&bytes).unwrap();
        // every block's expert matrices follow its other tensors
        for l in 0..m.n_layers() {
            let ts: Vec<_> = m.tensors().filter(|t| t.layer == l).collect();
            let experts = ts
                .iter()
                .filter(|t| gds_format::arch::is_routed_expert(t.name));
            let first = experts.map(|t| t.offset).min();
            let others_end = ts
                .iter()
                .filter(|t| !gds_format::arch::is_routed_expert(t.name))
                .map(|t| t.offset + t.nbytes)
                .max();
            if let (Some(first), Some(end)) = (first, others_end) {
                assert!(first >= end, "{quant}: layer {l}");
            }
        }
        let plan = |budget: Option<u64>, buffered: bool| {
            plan_io(&dir, &m, "direct", budget, || {
                if buffered {
                    DirectSupport::Buffered("forced by the test".into())
                } else {
                    gds_io::probe_direct(&dir.join(m.layer(0).unwrap().file))
                }
            })
            .unwrap()
        };
        let mapped = Model::load(&dir, 64, 1).unwrap();
        let want = run(&mapped, &prompt, 6, 5);
        let weights = mapped.weight_bytes();
        let min = plan(None, false).min_budget_bytes;
        let xb = plan(Some(min), false).experts.unwrap().expert_bytes;
        let mut seen_rounds = false;
        for (budget, buffered) in [
            (Some(min), false),
            (Some(min), true),
            (Some(min + 2 * xb), false),
            (Some((min + weights) / 2), false),
        ] {
            if budget >= Some(weights) {
                continue; // (Q8_0's tiny model: a cache of every expert holds it all)
            }
            let io = plan(budget, buffered);
            assert!(io.held_bytes <= budget.unwrap(), "{io:?}");
            let x = io.experts.as_ref().unwrap_or_else(|| panic!("{io:?}"));
            assert_eq!((x.n_expert, x.n_expert_used), (4, 2));
            assert!(x.cache_experts >= 2, "{x:?}");
            seen_rounds |= x.cache_experts < 4;
            assert!(
                io.reason.contains("experts each token is routed to"),
                "{}",
                io.reason
            );
            let model = Model::with_io(&dir, &io, 64, 1).unwrap();
            let got = run(&model, &prompt, 6, 5);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == w,
                    "{quant} {budget:?} {buffered}: row {i} differs from mmap"
                );
            }
            // eight decode steps more: per step, each streamed block's dense span and its
            // token's experts (read unless cached), not whole blocks
            let c = &model.config;
            let mut st = RunState::new(c, 1, 1, model.ctx(), model.threads());
            let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, model.ctx(), c.kv_dim());
            let mut b = Batch::with_capacity(1);
            let steps = 8;
            let mut s0 = model.io_stats();
            for (pos, &tok) in prompt.iter().enumerate().take(steps + 1) {
                if pos == 1 {
                    s0 = model.io_stats();
                }
                b.clear();
                b.push(tok, pos, 0, true);
                model.forward(&mut st, &mut kv, &b).unwrap();
            }
            let s = model.io_stats().since(&s0);
            let size = |l: usize| {
                std::fs::metadata(dir.join(m.layer(l).unwrap().file))
                    .unwrap()
                    .len()
            };
            let streamed = io.streamed_layers.len() as u64;
            assert_eq!(
                s.cache_hits + s.cache_misses,
                steps as u64 * 2 * streamed,
                "{s:?}"
            );
            let dense: u64 = io
                .streamed_layers
                .iter()
                .map(|&l| gds_io::align_up(io.stream_len(l, size(l))))
                .sum();
            let whole: u64 = io.streamed_layers.iter().map(|&l| size(l)).sum();
            assert!(dense < whole, "{dense} {whole}");
            // the head when it streams, the embedding row, and the next pass's first spans
            // read ahead into the two buffers
            let head = if io.is_resident(io.head.layer) {
                0
            } else {
                size(io.head.layer)
            };
            let bound = steps as u64 * (dense + head + 8192)
                + s.cache_misses * x.expert_bytes
                + 2 * io.slot_bytes;
            // (Q8_0's tiny experts, 1 KiB a matrix, are read as whole 4 KiB blocks: apart
            // they cost more than their block here; F32's are whole blocks)
            let apart_is_less = quant == "q8_0" || bound < steps as u64 * (whole + head);
            assert!(
                s.bytes_read <= bound && apart_is_less,
                "{quant} {budget:?}: {} bytes read over {steps} steps; bound {bound} \
                 (dense spans {dense}, {} experts read, head {head}); whole blocks {whole}",
                s.bytes_read,
                s.cache_misses
            );
        }
        assert!(
            seen_rounds,
            "no budget made the cache smaller than the experts"
        );
    }
}

/// Q4_0 (and Q4_K, Q6_K: the same plumbing; the kernels' bits are checked in gds-kernels)
/// matrices held in memory of our own (`--io load`, and `direct`'s resident layers) are
/// interleaved sixteen rows at a time for the AVX-512 kernels (the untied head and a
/// mixture's experts too): the logits stay bit-identical to the mapped model's (rows in file
/// order) for prompt batches and decode steps, streamed layers keep the file's order, and on
/// other instruction sets nothing is rewritten.
#[test]
fn interleaved_weights_give_the_mapped_models_logits() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, quant, dtype) in [
        ("tiny-llama-hf", "q4_0", gds_format::DType::Q4_0),
        ("tiny-qwen3moe-hf", "q4_0", gds_format::DType::Q4_0),
        ("tiny-llama-hf", "q4_1", gds_format::DType::Q4_1),
        ("tiny-qwen3moe-hf", "q5_0", gds_format::DType::Q5_0),
    ] {
        let dir = tmp.path().join(format!("{fixture}-{quant}"));
        let opts = gds_convert::ConvertOptions {
            quant: quant.parse().unwrap(),
            ..Default::default()
        };
        gds_convert::convert(
            &gds_tests::fixture(fixture),
            &dir,
            &opts,
            &gds_convert::NoProgress,
        )
        .unwrap();
        let bytes = gds_io::read_manifest(&dir).unwrap();
        let m = gds_format::Manifest::parse(&bytes).unwrap();
        // the blocks' matrices (a mixture's stacked experts: 32 rows each) and the untied
        // head; the embedding's rows are looked up: never
        let quantized: u64 = m
            .tensors()
            .filter(|t| t.dtype == dtype && t.dims().len() >= 2)
            .filter(|t| t.name.starts_with("blk.") || t.name == "output.weight")
            .map(|t| t.nbytes)
            .sum();
        let experts = m
            .tensors()
            .any(|t| t.name.contains("_exps.") && t.dtype == dtype);
        assert!(
            quantized > 0 && (experts || fixture == "tiny-llama-hf"),
            "{fixture} {quant}"
        );
        let prompt: Vec<u32> = (0..11).map(|i| (i * 53 + 7) % 320).collect();
        let mapped = Model::load(&dir, 64, 2).unwrap();
        assert_eq!(
            mapped.interleaved_bytes(),
            0,
            "a mapping is never rewritten"
        );
        let want = run(&mapped, &prompt, 6, 4);
        let pays = gds_kernels::interleave_pays(dtype);
        let plan = |io: &str, budget: Option<u64>| {
            plan_io(&dir, &m, io, budget, || {
                DirectSupport::Buffered("test".into())
            })
            .unwrap()
        };
        let min = plan("direct", None).min_budget_bytes;
        for io in [plan("load", None), plan("direct", Some(min))] {
            let model = Model::with_io(&dir, &io, 64, 2).unwrap();
            let got = model.interleaved_bytes();
            if !pays {
                assert_eq!(got, 0);
            } else if io.streamed_layers.is_empty() {
                assert_eq!(
                    got, quantized,
                    "{fixture} {quant}: every block matrix and the head"
                );
            } else {
                assert!(
                    got < quantized,
                    "streamed layers keep the file's order: {got}"
                );
            }
            for (i, (g, w)) in run(&model, &prompt, 6, 4).iter().zip(&want).enumerate() {
                assert!(
                    g == w,
                    "{fixture} {quant} {:?}: row {i} differs from mmap",
                    io.mode
                );
            }
        }
    }
}
