//! Times matmul at SmolLM2-135M shapes (Q4_1 projections, Q8_0 tied output head).
//!
//! `cargo run --release -p gds-kernels --example matmul_bench [-- --isa scalar|avx2|avxvnni] [--tokens N]`
//!
//! Prints, per shape, the time of one call, GFLOP/s (2 * rows * cols * tokens / time) and
//! the weight bytes streamed per second, then the matmul-only decode estimate for the whole
//! model (30 layers of q, k, v, o, gate, up, down plus the output head). Uses the global rayon
//! pool (RAYON_NUM_THREADS sets its size).
//!
//! `--model` instead allocates a whole SmolLM2-135M worth of random weights (96 MB, so
//! caches behave as in real decode) and times the per-token matmul sequence, calling from
//! inside the rayon pool as a runtime would.

mod bench_util;
use bench_util::values;
use gds_format::DType;
use gds_kernels::{matmul_many_with, matmul_with, quantize, Isa, WeightView};
use std::time::{Duration, Instant};

/// CPU time used by all threads of this process.
fn process_cpu() -> Duration {
    bench_util::cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// Best wall time per call over repeated runs for about `budget`, and the process CPU time
/// per call of that best round (idle-spinning rayon workers included).
fn time(budget: Duration, mut f: impl FnMut()) -> (Duration, Duration) {
    f();
    let mut best = (Duration::MAX, Duration::MAX);
    let start = Instant::now();
    let mut iters = 0;
    while start.elapsed() < budget || iters < 5 {
        let (t, c) = (Instant::now(), process_cpu());
        for _ in 0..4 {
            f();
        }
        let wall = t.elapsed() / 4;
        if wall < best.0 {
            best = (wall, (process_cpu() - c) / 4);
        }
        iters += 1;
    }
    best
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut isa = Isa::best();
    let mut tokens = vec![1usize, 64];
    let mut run_model = false;
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--isa" => {
                isa = match args.get(i + 1).map(String::as_str) {
                    Some("scalar") => Isa::Scalar,
                    Some("avx2") => Isa::Avx2,
                    Some("avxvnni") => Isa::AvxVnni,
                    Some("avx512vnni") => Isa::Avx512Vnni,
                    other => panic!("unknown isa {other:?}"),
                };
                i += 1;
            }
            "--tokens" => {
                tokens = vec![args[i + 1].parse().expect("--tokens N")];
                i += 1;
            }
            "--model" => run_model = true,
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
        i += 1;
    }
    assert!(isa.available(), "{} not available", isa.name());
    if run_model {
        model(isa);
        return;
    }
    println!(
        "isa {}  threads {}",
        isa.name(),
        rayon::current_num_threads()
    );
    println!(
        "{:<6} {:>6} {:>6} {:>4} {:>10} {:>9} {:>8} {:>8}",
        "dtype", "rows", "cols", "tok", "us/call", "GFLOP/s", "GB/s", "cpu us"
    );
    let shapes = [
        (DType::Q4_1, 576, 576, "q/o proj"),
        (DType::Q4_1, 192, 576, "k/v proj"),
        (DType::Q4_1, 1536, 576, "gate/up"),
        (DType::Q4_1, 576, 1536, "down"),
        (DType::Q8_0, 576, 576, ""),
        (DType::Q8_0, 1536, 576, ""),
        (DType::Q8_0, 576, 1536, ""),
        (DType::Q5_0, 640, 640, "gemma q/o"),
        (DType::Q5_0, 2048, 640, "gemma gate/up"),
        (DType::Q8_0, 49152, 576, "output head"),
        (DType::Q4_1, 49152, 576, ""),
    ];
    let budget = Duration::from_millis(300);
    let mut decode_us = std::collections::HashMap::new();
    for &n in &tokens {
        for (dtype, rows, cols, note) in shapes {
            let data = quantize(dtype, &values(rows * cols, rows as u64)).unwrap();
            let w = WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype,
                data: &data,
                rows,
                cols,
            };
            let x = values(cols * n, 7);
            let mut y = vec![0f32; rows * n];
            let (t, cpu) = time(budget, || matmul_with(isa, &w, &x, n, &mut y).unwrap());
            let s = t.as_secs_f64();
            println!(
                "{:<6} {:>6} {:>6} {:>4} {:>10.1} {:>9.1} {:>8.1} {:>8.1}  {note}",
                dtype.name(),
                rows,
                cols,
                n,
                s * 1e6,
                2.0 * (rows * cols * n) as f64 / s / 1e9,
                data.len() as f64 / s / 1e9,
                cpu.as_secs_f64() * 1e6
            );
            decode_us.insert((dtype, rows, cols, n), s * 1e6);
        }
    }
    // Fused calls the runtime can make with matmul_many.
    for &n in &tokens {
        let q = quantize(DType::Q4_1, &values(576 * 576, 1)).unwrap();
        let kv = quantize(DType::Q4_1, &values(192 * 576, 2)).unwrap();
        let g = quantize(DType::Q4_1, &values(1536 * 576, 3)).unwrap();
        let ws_qkv = [
            WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::Q4_1,
                data: &q,
                rows: 576,
                cols: 576,
            },
            WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::Q4_1,
                data: &kv,
                rows: 192,
                cols: 576,
            },
            WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::Q4_1,
                data: &kv,
                rows: 192,
                cols: 576,
            },
        ];
        let ws_gu = [
            WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::Q4_1,
                data: &g,
                rows: 1536,
                cols: 576,
            },
            WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::Q4_1,
                data: &g,
                rows: 1536,
                cols: 576,
            },
        ];
        let x = values(576 * n, 9);
        let (mut a, mut b, mut c) = (
            vec![0f32; 576 * n],
            vec![0f32; 192 * n],
            vec![0f32; 192 * n],
        );
        let (t_qkv, _) = time(budget, || {
            matmul_many_with(isa, &ws_qkv, &x, n, &mut [&mut a, &mut b, &mut c]).unwrap()
        });
        let (mut d, mut e) = (vec![0f32; 1536 * n], vec![0f32; 1536 * n]);
        let (t_gu, _) = time(budget, || {
            matmul_many_with(isa, &ws_gu, &x, n, &mut [&mut d, &mut e]).unwrap()
        });
        let layer_sep = 2.0 * decode_us[&(DType::Q4_1, 576, 576, n)]
            + 2.0 * decode_us[&(DType::Q4_1, 192, 576, n)]
            + 2.0 * decode_us[&(DType::Q4_1, 1536, 576, n)]
            + decode_us[&(DType::Q4_1, 576, 1536, n)];
        let layer_fused = t_qkv.as_secs_f64() * 1e6
            + decode_us[&(DType::Q4_1, 576, 576, n)]
            + t_gu.as_secs_f64() * 1e6
            + decode_us[&(DType::Q4_1, 576, 1536, n)];
        let head = decode_us[&(DType::Q8_0, 49152, 576, n)];
        println!(
            "tokens {n}: fused qkv {:.1} us, fused gate+up {:.1} us",
            t_qkv.as_secs_f64() * 1e6,
            t_gu.as_secs_f64() * 1e6
        );
        let per_tok = |layer: f64, head_calls: f64| (30.0 * layer + head * head_calls) / n as f64;
        println!(
            "  SmolLM2-135M matmuls per token: separate {:.0} us ({:.0} tok/s), fused {:.0} us ({:.0} tok/s){}",
            per_tok(layer_sep, 1.0),
            1e6 / per_tok(layer_sep, 1.0),
            per_tok(layer_fused, 1.0),
            1e6 / per_tok(layer_fused, 1.0),
            if n > 1 { " (head for every token)" } else { "" }
        );
    }
}

/// Random but valid blocks: random quant bytes, small finite f16 scales.
fn random_weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let ts = dtype.type_size();
    let n = rows * cols / dtype.block_size();
    let mut s = seed | 1;
    let mut data: Vec<u8> = (0..n * ts)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let scale = half::f16::from_f32(0.01).to_le_bytes();
    let min = half::f16::from_f32(-0.05).to_le_bytes();
    for b in data.chunks_exact_mut(ts) {
        b[0..2].copy_from_slice(&scale);
        if dtype == DType::Q4_1 {
            b[2..4].copy_from_slice(&min);
        }
    }
    data
}

fn v(data: &[u8], rows: usize, cols: usize) -> WeightView<'_> {
    WeightView {
        layout: gds_kernels::Layout::Rows,
        dtype: DType::Q4_1,
        data,
        rows,
        cols,
    }
}

/// Per-token matmul sequence of SmolLM2-135M decode on separately allocated weights.
fn model(isa: Isa) {
    const LAYERS: usize = 30;
    let (h, kv, ff, vocab) = (576, 192, 1536, 49152);
    let q4 = DType::Q4_1;
    let layers: Vec<[Vec<u8>; 7]> = (0..LAYERS as u64)
        .map(|l| {
            [
                random_weight(q4, h, h, 7 * l + 1),
                random_weight(q4, kv, h, 7 * l + 2),
                random_weight(q4, kv, h, 7 * l + 3),
                random_weight(q4, h, h, 7 * l + 4),
                random_weight(q4, ff, h, 7 * l + 5),
                random_weight(q4, ff, h, 7 * l + 6),
                random_weight(q4, h, ff, 7 * l + 7),
            ]
        })
        .collect();
    let head = random_weight(DType::Q8_0, vocab, h, 999);
    let bytes: usize = layers.iter().flatten().map(Vec::len).sum::<usize>() + head.len();
    println!(
        "isa {}  threads {}  weights {:.1} MB",
        isa.name(),
        rayon::current_num_threads(),
        bytes as f64 / 1e6
    );
    let x = values(h, 3);
    let mut y = vec![0f32; ff * 2 + h * 2 + kv * 2];
    let mut logits = vec![0f32; vocab];
    let mut step = |with_head: bool| {
        for l in &layers {
            let (q, rest) = y.split_at_mut(h);
            let (k, rest) = rest.split_at_mut(kv);
            let (vv, rest) = rest.split_at_mut(kv);
            let ws = [v(&l[0], h, h), v(&l[1], kv, h), v(&l[2], kv, h)];
            matmul_many_with(isa, &ws, &x, 1, &mut [q, k, vv]).unwrap();
            let (o, rest) = rest.split_at_mut(h);
            matmul_with(isa, &v(&l[3], h, h), &x, 1, o).unwrap();
            let (g, rest) = rest.split_at_mut(ff);
            let (u, _) = rest.split_at_mut(ff);
            let ws = [v(&l[4], ff, h), v(&l[5], ff, h)];
            matmul_many_with(isa, &ws, &x, 1, &mut [g, u]).unwrap();
            let mut d = vec![0f32; h];
            matmul_with(isa, &v(&l[6], h, ff), &y[..ff], 1, &mut d).unwrap();
        }
        if with_head {
            let w = WeightView {
                layout: gds_kernels::Layout::Rows,
                dtype: DType::Q8_0,
                data: &head,
                rows: vocab,
                cols: h,
            };
            matmul_with(isa, &w, &x, 1, &mut logits).unwrap();
        }
    };
    rayon::scope(|_| {
        for with_head in [false, true] {
            let (t, cpu) = time(Duration::from_secs(2), || step(with_head));
            println!(
                "decode matmuls{}: {:.0} us/token wall ({:.0} tok/s), {:.0} us CPU",
                if with_head {
                    " + head"
                } else {
                    " (layers only)"
                },
                t.as_secs_f64() * 1e6,
                1.0 / t.as_secs_f64(),
                cpu.as_secs_f64() * 1e6
            );
        }
    });
}
