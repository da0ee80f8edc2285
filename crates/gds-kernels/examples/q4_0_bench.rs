//! Times the AVX2 Q4_0 row kernels at Llama-3.2-1B shapes, one thread, against the
//! row-at-a-time kernel measured in the same run (the ratio is old time / new time).
//!
//! `cargo run --release -p gds-kernels --example q4_0_bench [-- --tokens N]`
//!
//! Each shape is a whole weight (a few MB, so decode streams it from L3 / DRAM as a real
//! model's layers do); the two kernels alternate five times, and each keeps its best thread
//! CPU time per call (robust to other processes sharing the cores).

mod bench_util;
use bench_util::values;
use gds_format::DType;
use gds_kernels::act::{q8_pairs, quantize_act_q8_scalar, ActQ8};
use gds_kernels::avx2::{rows_q4_0, rows_q4_0_by_row, Avx2};
use gds_kernels::quantize;
use std::time::Duration;

type Kernel = fn(Avx2, &[u8], usize, &[&[ActQ8]], &mut [f32]);

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    bench_util::cpu_time(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Best thread CPU time of one call over `rounds` calls.
fn best(rounds: usize, mut f: impl FnMut()) -> Duration {
    let mut b = Duration::MAX;
    for _ in 0..rounds {
        let t = thread_cpu();
        f();
        b = b.min(thread_cpu() - t);
    }
    b
}

/// `--model`: a Llama-3.2-1B body's worth of Q4_0 weights (16 layers of q, k, v, o, gate,
/// up, down: 546 MB, far past the caches, as decode streams them), one token at a time, each
/// matrix's rows split over two threads; the two kernels alternate token by token.
fn model(t: Avx2) {
    let layer = [
        (2048, 2048),
        (512, 2048),
        (512, 2048),
        (2048, 2048),
        (8192, 2048),
        (8192, 2048),
        (2048, 8192),
    ];
    let mut mats = Vec::new();
    for l in 0..16 {
        for (i, &(rows, cols)) in layer.iter().enumerate() {
            let data = quantize(DType::Q4_0, &values(rows * cols, (l * 7 + i) as u64)).unwrap();
            mats.push((rows, cols, data));
        }
    }
    let bytes: usize = mats.iter().map(|m| m.2.len()).sum();
    let acts = |cols: usize| {
        let per = q8_pairs(cols);
        let mut q = vec![ActQ8::default(); per];
        quantize_act_q8_scalar(&values(cols, cols as u64), &mut q);
        q
    };
    let (a2, a8) = (acts(2048), acts(8192));
    let mut y = vec![0f32; 8192];
    let kernels: [Kernel; 2] = [rows_q4_0_by_row, rows_q4_0];
    let mut best = [Duration::MAX; 2];
    for _ in 0..10 {
        for (k, f) in kernels.iter().enumerate() {
            let start = std::time::Instant::now();
            for (rows, cols, data) in &mats {
                let a: &[ActQ8] = if *cols == 2048 { &a2 } else { &a8 };
                let rb = data.len() / rows;
                let half = rows / 2;
                let (w0, w1) = data.split_at(half * rb);
                let (y0, y1) = y[..*rows].split_at_mut(half);
                rayon::join(|| f(t, w0, rb, &[a], y0), || f(t, w1, rb, &[a], y1));
            }
            best[k] = best[k].min(start.elapsed());
        }
    }
    let ms = best.map(|d| d.as_secs_f64() * 1e3);
    println!(
        "1B body, Q4_0 matmuls of one token, 2 threads, best wall of 10: by-row {:.2} ms ({:.1} GB/s), four-row {:.2} ms ({:.1} GB/s): {:.2}x",
        ms[0],
        bytes as f64 / ms[0] / 1e6,
        ms[1],
        bytes as f64 / ms[1] / 1e6,
        ms[0] / ms[1]
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let t0 = Avx2::detect().expect("AVX2, FMA and F16C");
    if args.iter().any(|a| a == "--model") {
        model(t0);
        return;
    }
    let mut tokens = vec![1usize, 4, 128];
    if let Some(i) = args.iter().position(|a| a == "--tokens") {
        tokens = vec![args[i + 1].parse().expect("--tokens N")];
    }
    let t = Avx2::detect().expect("AVX2, FMA and F16C");
    println!(
        "one thread, best thread CPU time per call; ratio = row-at-a-time / four-row (same run)"
    );
    println!(
        "{:>6} {:>6} {:>4} {:>12} {:>12} {:>7}",
        "rows", "cols", "tok", "by-row us", "4-row us", "ratio"
    );
    let shapes = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)];
    for &n in &tokens {
        let mut total = [0f64; 2];
        for (rows, cols) in shapes {
            let data = quantize(DType::Q4_0, &values(rows * cols, rows as u64)).unwrap();
            let rb = data.len() / rows;
            let x = values(cols * n, 7);
            let per = q8_pairs(cols);
            let mut q = vec![ActQ8::default(); n * per];
            for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
                quantize_act_q8_scalar(xr, qr);
            }
            let acts: Vec<&[ActQ8]> = q.chunks(per).collect();
            let mut y = vec![0f32; rows * n];
            let kernels: [Kernel; 2] = [rows_q4_0_by_row, rows_q4_0];
            let rounds = (2_000_000 / (rows * cols / 1024 * n.max(4))).clamp(3, 200);
            let mut times = [Duration::MAX; 2];
            for _ in 0..5 {
                for (k, f) in kernels.iter().enumerate() {
                    let d = best(rounds, || f(t, &data, rb, &acts, &mut y));
                    times[k] = times[k].min(d);
                }
            }
            let us = times.map(|d| d.as_secs_f64() * 1e6);
            total[0] += us[0];
            total[1] += us[1];
            println!(
                "{rows:>6} {cols:>6} {n:>4} {:>12.1} {:>12.1} {:>6.2}x",
                us[0],
                us[1],
                us[0] / us[1]
            );
        }
        println!(
            "{:>6} {:>6} {n:>4} {:>12.1} {:>12.1} {:>6.2}x  (sum)",
            "",
            "",
            total[0],
            total[1],
            total[0] / total[1]
        );
    }
}
