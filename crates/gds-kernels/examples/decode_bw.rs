//! Decode (one token) weight bandwidth of the row kernels at Llama-3.2-1B widths: the same
//! matrix type timed with its rows in L2 (1024 x 2048: the arithmetic's speed) and with 64
//! matrices of 8192 x 2048 far past the caches (as decode streams a model), so the two show
//! whether a kernel waits for memory or for arithmetic. Compare with a plain read loop's
//! bandwidth on the same machine.
//!
//! `RAYON_NUM_THREADS=2 cargo run --profile ci -p gds-kernels --example decode_bw [-- q4_k|q5_k|q6_k|q4_0|q5_0|q4_1|q8_0, each also with x16, or iq4_nl|iq4_xs|q2_k|q3_k|f16|bf16|f32 [TOKENS]]`
//! (`all` for every type as a table, each against Q4_0: `fn all_types`;
//! TOKENS > 1: four 4096 x 4096 matrices, a 7B projection, against a prompt batch;
//! `DECODE_BW_SHAPE=ROWSxCOLSxCOPIES` times another shape, e.g. a mixture of experts'
//! `768x2048x512`, and `DECODE_BW_REPS` the passes over the copies per round)
//!
//! 2026-12-03, the AMD EPYC AVX-512 VM, 2 threads, Q4_K, inside the pool: 8192 x 2048
//! 20.6-25 GB/s, an expert's 768 x 2048 19.5-19.8 GB/s, 2048 x 768 19.4-19.8 GB/s (called from
//! outside the pool: 13.7 and 16.3; bench/runs/2026-12-03-qwen3moe-cpu.md).
//!
//! 2026-12-02, the Sapphire Rapids VM, 2 threads (each call then made from outside the pool): Q4_K 26-29 GB/s from L2, 16.3-17.3 GB/s
//! streaming (a read loop: 24-32 GB/s that hour); with half the quant arithmetic skipped
//! (an experiment) 35 / 18.3-19.0: decode is bound by memory-level parallelism more than by
//! the arithmetic.

// (its CPU-time clocks are for the other benchmarks: decode is timed by the wall clock)
#[allow(dead_code)]
mod bench_util;
use bench_util::values;
use gds_format::DType;
use gds_kernels::{matmul_with, quantize, Isa, WeightView};
use std::time::Instant;

fn main() {
    // inside the pool, as gdsrun's forward pass runs (a call from outside hands its tasks to
    // the pool's threads and sleeps: a cost per call that gdsrun does not pay)
    let pool = rayon::ThreadPoolBuilder::new()
        .build()
        .expect("thread pool");
    pool.install(run);
}

fn run() {
    let args: Vec<String> = std::env::args().collect();
    // `TYPEx16` (`q4_0x16`, `q4_kx16`, ...): rows interleaved sixteen at a time, as gdsrun
    // holds them in memory
    let arg = args.get(1).map_or("q4_k", String::as_str);
    let (name, layout) = match arg.strip_suffix("x16") {
        Some(t) => (t, gds_kernels::Layout::Interleaved16),
        None => (arg, gds_kernels::Layout::Rows),
    };
    if name == "all" {
        return all_types(args.get(2).map_or(1, |s| s.parse().expect("tokens")));
    }
    let dtype = dtype_of(name).unwrap_or_else(|| panic!("unknown type {name}"));
    // `-- TYPE N`: N tokens a call (a prompt batch) instead of one, at the 7B width
    let n: usize = args.get(2).map_or(1, |s| s.parse().expect("tokens"));
    let isa = isa();
    // `DECODE_BW_SHAPE=ROWSxCOLSxCOPIES`: another shape (a mixture of experts' 2048x768
    // down projections: `2048x768x512`)
    let custom: Option<(usize, usize, usize)> = std::env::var("DECODE_BW_SHAPE").ok().map(|s| {
        let v: Vec<usize> = s
            .split('x')
            .map(|p| p.parse().expect("DECODE_BW_SHAPE"))
            .collect();
        (v[0], v[1], v[2])
    });
    let cols = custom.map_or(if n == 1 { 2048 } else { 4096 }, |c| c.1);
    let custom_shape = custom.map(|(r, _, k)| [(r, k)]);
    let shapes: &[(usize, usize)] = match &custom_shape {
        Some(s) => s,
        None if n == 1 => &[(1024, 1), (8192, 64)],
        None => &[(4096, 4)],
    };
    for &(rows, copies) in shapes {
        let (bytes, best) = time(dtype, layout, isa, n, (rows, cols), copies);
        println!(
            "{} {n} token(s), {} rows x {cols} ({:.2} MB, {} matrices): {:.1} us, {:.2} GB/s, {:.1} GFLOP/s",
            dtype.name(),
            rows,
            bytes as f64 / 1e6,
            copies,
            best * 1e6,
            bytes as f64 / best / 1e9,
            2.0 * (rows * cols * n) as f64 / best / 1e9
        );
    }
}

/// The types by their names (as `TYPE` takes them).
const TYPES: &[(&str, DType)] = &[
    ("q4_0", DType::Q4_0),
    ("q4_1", DType::Q4_1),
    ("q5_0", DType::Q5_0),
    ("q8_0", DType::Q8_0),
    ("q2_k", DType::Q2K),
    ("q3_k", DType::Q3K),
    ("q4_k", DType::Q4K),
    ("q5_k", DType::Q5K),
    ("q6_k", DType::Q6K),
    ("iq4_nl", DType::Iq4Nl),
    ("iq4_xs", DType::Iq4Xs),
    ("iq3_s", DType::Iq3S),
    ("iq3_xxs", DType::Iq3Xxs),
    ("iq2_s", DType::Iq2S),
    ("iq2_xs", DType::Iq2Xs),
    ("iq2_xxs", DType::Iq2Xxs),
    ("iq1_m", DType::Iq1M),
    ("iq1_s", DType::Iq1S),
    ("mxfp4", DType::MXFP4),
    ("f16", DType::F16),
    ("bf16", DType::BF16),
    ("f32", DType::F32),
];

fn dtype_of(name: &str) -> Option<DType> {
    TYPES.iter().find(|(n, _)| *n == name).map(|&(_, t)| t)
}

/// GDS_ISA=avx2|avxvnni|... times that build of the kernels (as gdsrun's alias does).
fn isa() -> Isa {
    std::env::var("GDS_ISA")
        .ok()
        .map(|n| {
            Isa::from_name(&n)
                .filter(|i| i.available())
                .expect("GDS_ISA")
        })
        .unwrap_or_else(Isa::best)
}

/// `decode_bw all [TOKENS]`: every type at one shape, in the layout gdsrun holds it in, as a
/// table with each type's time against Q4_0's of the same run (the ratios carry from machine
/// to machine better than the times; after a kernel change, compare them with the table of
/// the last run in `bench/runs/`): one token (eight 2048 x 2048 matrices, in L2 together
/// on a 2 MB-L2 core: the arithmetic), or TOKENS (a 4096 x 4096 matrix, a 7B projection).
fn all_types(n: usize) {
    let isa = isa();
    let ((rows, cols), copies) = if n == 1 {
        ((2048, 2048), 8)
    } else {
        ((4096, 4096), 1)
    };
    println!(
        "{} token(s), {rows} x {cols} x {copies}, {} threads, {isa:?}",
        n,
        rayon::current_num_threads()
    );
    println!("| type | layout | bits/weight | us | GB/s | time / Q4_0's |");
    println!("|---|---|---:|---:|---:|---:|");
    let mut q4_0 = None;
    for &(name, dtype) in TYPES {
        let layout = if gds_kernels::interleave_pays(dtype) {
            gds_kernels::Layout::Interleaved16
        } else {
            gds_kernels::Layout::Rows
        };
        let (bytes, best) = time(dtype, layout, isa, n, (rows, cols), copies);
        let base = *q4_0.get_or_insert(best);
        println!(
            "| {name} | {} | {:.2} | {:.1} | {:.2} | {:.2} |",
            if layout == gds_kernels::Layout::Rows {
                "rows"
            } else {
                "x16"
            },
            8.0 * bytes as f64 / (rows * cols) as f64,
            best * 1e6,
            bytes as f64 / best / 1e9,
            best / base
        );
    }
}

/// The best of five rounds' time of one product (`n` tokens, `copies` matrices of
/// `rows x cols` taken in turn), and a matrix's bytes.
fn time(
    dtype: DType,
    layout: gds_kernels::Layout,
    isa: Isa,
    n: usize,
    (rows, cols): (usize, usize),
    copies: usize,
) -> (usize, f64) {
    let x = values(cols * n, 7);
    let mats: Vec<Vec<u8>> = (0..copies)
        .map(|c| {
            let mut m = match dtype {
                // random blocks (IQ1_M's scale, in its scale words' top nibbles, random too)
                DType::Iq4Nl
                | DType::Iq4Xs
                | DType::Iq2Xxs
                | DType::Iq2Xs
                | DType::Iq2S
                | DType::Iq3Xxs
                | DType::Iq3S
                | DType::Iq1S
                | DType::Iq1M => table_blocks(dtype, rows * cols, c as u64 + 1),
                _ => quantize(dtype, &values(rows * cols, c as u64 + 1)).unwrap(),
            };
            if layout == gds_kernels::Layout::Interleaved16 {
                gds_kernels::interleave(dtype, &mut m, rows, cols).unwrap();
            }
            m
        })
        .collect();
    let bytes = mats[0].len();
    let mut y = vec![0f32; rows * n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let reps = if n > 1 {
            10
        } else if copies == 1 {
            2000
        } else {
            std::env::var("DECODE_BW_REPS")
                .ok()
                .and_then(|r| r.parse().ok())
                .unwrap_or((128 / copies).max(2))
        };
        let t = Instant::now();
        for _ in 0..reps {
            for m in &mats {
                let w = WeightView {
                    layout,
                    dtype,
                    data: m,
                    rows,
                    cols,
                };
                matmul_with(isa, &w, &x, n, &mut y).unwrap();
            }
        }
        best = best.min(t.elapsed().as_secs_f64() / (reps * copies) as f64);
    }
    (bytes, best)
}

/// `n` values of a table type (IQ4_NL, IQ4_XS), which gds-kernels does not quantize to: random
/// nibbles (and IQ4_XS sub-block scales) under a scale of 0.01.
fn table_blocks(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let ts = dtype.type_size();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut data: Vec<u8> = (0..n / dtype.block_size() * ts)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let d = half::f16::from_f32(0.01).to_le_bytes();
    for b in data.chunks_exact_mut(ts) {
        b[..2].copy_from_slice(&d);
    }
    data
}
