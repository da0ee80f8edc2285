//! Matrix products: activation quantization, run-time kernel choice, threading and tiling.

use crate::act::{q8_pairs, quantize_act_q8_scalar, quantize_act_q8k_scalar, ActQ8, ActQ8K};
#[cfg(target_arch = "x86_64")]
use crate::avx2::{self, Avx2};
use crate::blocks::QK_K;
use crate::interleave::{Map, GROUP};
use crate::{dequantize, scalar, KernelError, Layout, WeightView};
use gds_format::DType;
use rayon::prelude::*;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use zerocopy::IntoBytes;

/// An instruction set the kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar reference kernels.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64).
    Avx2,
    /// AVX2 + FMA + F16C with AVX-VNNI dot products for Q4_0..Q8_0 (x86-64).
    AvxVnni,
    /// AVX2 + FMA + F16C with AVX-512 (F, VL, BW, VNNI) for Q4_0..Q8_0: EVEX dot products
    /// and two weight rows per activation load (x86-64).
    Avx512Vnni,
}

impl Isa {
    /// Every instruction set, widest first.
    pub const ALL: [Isa; 4] = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Scalar];

    /// The instruction set the plain functions ([`crate::matmul`]) run on: the best this
    /// CPU has at or below the process's cap ([`set_isa_cap`]; none: the best). The CPU's
    /// features are detected once and cached; this is an atomic load and a table lookup.
    pub fn best() -> Isa {
        Isa::best_up_to(isa_cap())
    }

    /// The best instruction set this CPU has at or below `cap` (`None`: the best of all).
    /// A cap this CPU cannot run falls to the next narrower one it can.
    pub fn best_up_to(cap: Option<Isa>) -> Isa {
        static BEST: OnceLock<[Isa; Isa::ALL.len()]> = OnceLock::new();
        // BEST[i]: the best available at or below ALL[i]
        let table = BEST.get_or_init(|| {
            let mut t = [Isa::Scalar; Isa::ALL.len()];
            for (i, slot) in t.iter_mut().enumerate() {
                *slot = Isa::ALL[i..]
                    .iter()
                    .copied()
                    .find(|i| i.available())
                    .unwrap_or(Isa::Scalar);
            }
            t
        });
        table[cap.map_or(0, Isa::index)]
    }

    fn index(self) -> usize {
        Isa::ALL.iter().position(|&i| i == self).unwrap_or(0)
    }

    /// The instruction set of a lower-case name (`scalar`, `avx2`, `avxvnni`,
    /// `avx512vnni`), as [`Isa::name`] writes it.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.iter().copied().find(|i| i.name() == name)
    }

    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        Backend::new(self).is_some()
    }

    /// Lower-case name (`scalar`, `avx2`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }
}

/// The process's cap on [`Isa::best`]: 0 none, else 1 + the index in [`Isa::ALL`].
static ISA_CAP: AtomicU8 = AtomicU8::new(0);

/// Caps the instruction set of the plain matrix functions for the whole process (`None`:
/// the best this CPU has), to compare kernels on one machine; a cap this CPU cannot run
/// falls to the next narrower one it can. `gds_runtime`'s plan sets it from `--isa` (or
/// the `GDS_ISA` environment variable, its alias) and records the result.
pub fn set_isa_cap(cap: Option<Isa>) {
    ISA_CAP.store(cap.map_or(0, |i| 1 + i.index() as u8), Ordering::Relaxed);
}

/// The cap [`set_isa_cap`] set, if any.
pub fn isa_cap() -> Option<Isa> {
    match ISA_CAP.load(Ordering::Relaxed) {
        0 => None,
        n => Isa::ALL.get(n as usize - 1).copied(),
    }
}

/// A checked [`Isa`]: holds the proof that the CPU has its features.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Backend {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
}

impl Backend {
    pub(crate) fn new(isa: Isa) -> Option<Backend> {
        match isa {
            Isa::Scalar => Some(Backend::Scalar),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Avx2::detect().map(Backend::Avx2),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Avx2::detect_vnni().map(Backend::Avx2),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => Avx2::detect_avx512().map(Backend::Avx2),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Vnni => None,
        }
    }
}

/// What a weight dtype wants its activations as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ActKind {
    /// Plain f32 (float weights, and the dequantize-then-dot fallback).
    F32,
    /// 32-blocks ([`ActQ8`]).
    Q8,
    /// 256-blocks ([`ActQ8K`]).
    Q8K,
}

fn act_kind(dtype: DType) -> Result<ActKind, KernelError> {
    use DType::*;
    Ok(match dtype {
        F32 | F16 | BF16 | Q8_1 | Q8K => ActKind::F32,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | MXFP4 | Iq4Nl | Iq4Xs => ActKind::Q8,
        Q2K | Q3K | Q4K | Q5K | Q6K | Iq2Xxs | Iq2Xs | Iq2S | Iq3Xxs | Iq3S | Iq1S | Iq1M => {
            ActKind::Q8K
        }
        _ => {
            return Err(KernelError::Unsupported {
                op: "matmul",
                dtype,
            })
        }
    })
}

/// Quantizes `x` (rows of `cols`) for 32-blocks, `q8_pairs(cols)` pairs per row; parallel
/// over rows when there are many.
fn quantize_q8(be: Backend, x: &[f32], cols: usize) -> Vec<ActQ8> {
    let per_row = q8_pairs(cols);
    let mut out = vec![ActQ8::default(); x.len() / cols * per_row];
    let run = |x: &[f32], o: &mut [ActQ8]| match be {
        Backend::Scalar => quantize_act_q8_scalar(x, o),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2(t) => avx2::quantize_act_q8(t, x, o),
    };
    if x.len() >= 1 << 16 {
        x.par_chunks(cols)
            .zip(out.par_chunks_mut(per_row))
            .for_each(|(x, o)| run(x, o));
    } else {
        x.chunks(cols)
            .zip(out.chunks_mut(per_row))
            .for_each(|(x, o)| run(x, o));
    }
    out
}

/// Quantizes `x` for 256-blocks.
fn quantize_q8k(be: Backend, x: &[f32], cols: usize) -> Vec<ActQ8K> {
    let mut out = vec![ActQ8K::default(); x.len() / QK_K];
    let per_row = cols / QK_K;
    let run = |x: &[f32], o: &mut [ActQ8K]| match be {
        Backend::Scalar => quantize_act_q8k_scalar(x, o),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2(t) => avx2::quantize_act_q8k(t, x, o),
    };
    if x.len() >= 1 << 16 {
        x.par_chunks(cols)
            .zip(out.par_chunks_mut(per_row))
            .for_each(|(x, o)| run(x, o));
    } else {
        run(x, &mut out);
    }
    out
}

/// Per-token activation rows in the format a kernel wants.
enum ActRows<'a> {
    F32(Vec<&'a [f32]>),
    Q8(Vec<&'a [ActQ8]>),
    Q8K(Vec<&'a [ActQ8K]>),
}

/// The activations of one matmul input, quantized at most once per format.
struct Acts<'x> {
    x: &'x [f32],
    cols: usize,
    q8: Option<Vec<ActQ8>>,
    q8k: Option<Vec<ActQ8K>>,
}

impl<'x> Acts<'x> {
    fn new(be: Backend, x: &'x [f32], cols: usize, kinds: &[ActKind]) -> Self {
        let q8 = kinds
            .contains(&ActKind::Q8)
            .then(|| quantize_q8(be, x, cols));
        let q8k = kinds
            .contains(&ActKind::Q8K)
            .then(|| quantize_q8k(be, x, cols));
        Acts { x, cols, q8, q8k }
    }

    fn rows(&self, kind: ActKind) -> ActRows<'_> {
        match kind {
            ActKind::F32 => ActRows::F32(self.x.chunks_exact(self.cols).collect()),
            ActKind::Q8 => {
                let q = self.q8.as_deref().expect("quantized for Q8");
                ActRows::Q8(q.chunks_exact(q8_pairs(self.cols)).collect())
            }
            ActKind::Q8K => {
                let q = self.q8k.as_deref().expect("quantized for Q8K");
                ActRows::Q8K(q.chunks_exact(self.cols / QK_K).collect())
            }
        }
    }
}

/// Computes `out[r * nt + t]` for the consecutive weight rows in `w` (`rb` bytes each, laid
/// out as `layout` says: for [`Layout::Interleaved16`], whole groups of sixteen rows).
fn run_laid_out(
    be: Backend,
    (dtype, layout): (DType, Layout),
    w: &[u8],
    rb: usize,
    acts: &ActRows<'_>,
    out: &mut [f32],
) {
    if layout == Layout::Rows {
        return run_rows(be, dtype, w, rb, acts, out);
    }
    #[cfg(target_arch = "x86_64")]
    if let Backend::Avx2(t) = be {
        match (dtype, acts) {
            (DType::Q4_0, ActRows::Q8(a)) => return avx2::rows_q4_0x16(t, w, rb, a, out),
            (DType::Q4_1, ActRows::Q8(a)) => return avx2::rows_q4_1x16(t, w, rb, a, out),
            (DType::Q5_0, ActRows::Q8(a)) => return avx2::rows_q5_0x16(t, w, rb, a, out),
            (DType::Q5_1, ActRows::Q8(a)) => return avx2::rows_q5_1x16(t, w, rb, a, out),
            (DType::Q8_0, ActRows::Q8(a)) => return avx2::rows_q8_0x16(t, w, rb, a, out),
            (DType::Q4K, ActRows::Q8K(a)) => return avx2::rows_q4_kx16(t, w, rb, a, out),
            (DType::Q5K, ActRows::Q8K(a)) => return avx2::rows_q5_kx16(t, w, rb, a, out),
            (DType::Q6K, ActRows::Q8K(a)) => return avx2::rows_q6_kx16(t, w, rb, a, out),
            (DType::MXFP4, ActRows::Q8(a)) => return avx2::rows_mxfp4x16(t, w, rb, a, out),
            (DType::Iq4Nl, ActRows::Q8(a)) => return avx2::rows_iq4_nlx16(t, w, rb, a, out),
            (DType::Iq4Xs, ActRows::Q8(a)) => return avx2::rows_iq4_xsx16(t, w, rb, a, out),
            _ => {}
        }
    }
    // No kernel over the interleaved layout here (the scalar kernels): each group back into
    // rows, then the row kernel (the same arithmetic, so the same bits).
    let nt = out.len() / (w.len() / rb).max(1);
    let map = Map::of(dtype);
    let mut rows = vec![0u8; GROUP * rb];
    for (g, o) in w
        .chunks_exact(GROUP * rb)
        .zip(out.chunks_exact_mut(GROUP * nt))
    {
        map.rows_from_group(g, rb, &mut rows);
        run_rows(be, dtype, &rows, rb, acts, o);
    }
}

/// Computes `out[r * nt + t]` for the consecutive weight rows in `w` (`rb` bytes each).
fn run_rows(be: Backend, dtype: DType, w: &[u8], rb: usize, acts: &ActRows<'_>, out: &mut [f32]) {
    macro_rules! go {
        ($f:ident, $a:expr) => {
            match be {
                Backend::Scalar => scalar::$f(w, rb, $a, out),
                #[cfg(target_arch = "x86_64")]
                Backend::Avx2(t) => avx2::$f(t, w, rb, $a, out),
            }
        };
    }
    use DType::*;
    match (dtype, acts) {
        (Q4_0, ActRows::Q8(a)) => go!(rows_q4_0, a),
        (Q4_1, ActRows::Q8(a)) => go!(rows_q4_1, a),
        (Q5_0, ActRows::Q8(a)) => go!(rows_q5_0, a),
        (Q5_1, ActRows::Q8(a)) => go!(rows_q5_1, a),
        (Q8_0, ActRows::Q8(a)) => go!(rows_q8_0, a),
        (MXFP4, ActRows::Q8(a)) => go!(rows_mxfp4, a),
        (Iq4Nl, ActRows::Q8(a)) => go!(rows_iq4_nl, a),
        (Iq4Xs, ActRows::Q8(a)) => go!(rows_iq4_xs, a),
        (Q2K, ActRows::Q8K(a)) => go!(rows_q2_k, a),
        (Q3K, ActRows::Q8K(a)) => go!(rows_q3_k, a),
        (Q4K, ActRows::Q8K(a)) => go!(rows_q4_k, a),
        (Q5K, ActRows::Q8K(a)) => go!(rows_q5_k, a),
        (Q6K, ActRows::Q8K(a)) => go!(rows_q6_k, a),
        (Iq2Xxs, ActRows::Q8K(a)) => go!(rows_iq2_xxs, a),
        (Iq2Xs, ActRows::Q8K(a)) => go!(rows_iq2_xs, a),
        (Iq2S, ActRows::Q8K(a)) => go!(rows_iq2_s, a),
        (Iq3Xxs, ActRows::Q8K(a)) => go!(rows_iq3_xxs, a),
        (Iq3S, ActRows::Q8K(a)) => go!(rows_iq3_s, a),
        (Iq1S, ActRows::Q8K(a)) => go!(rows_iq1_s, a),
        (Iq1M, ActRows::Q8K(a)) => go!(rows_iq1_m, a),
        (F32, ActRows::F32(a)) => go!(rows_f32, a),
        (F16, ActRows::F32(a)) => go!(rows_f16, a),
        (BF16, ActRows::F32(a)) => go!(rows_bf16, a),
        (_, ActRows::F32(a)) => {
            // Types without a dedicated kernel: dequantize some rows, then the f32 kernel
            // over them (several rows at once: its tiles take several rows per token).
            const ROWS: usize = 16;
            let nt = a.len();
            let cols = a.first().map_or(0, |x| x.len());
            let frb = cols * size_of::<f32>();
            let mut rows = vec![0f32; ROWS * cols];
            for (wr, o) in w.chunks(ROWS * rb).zip(out.chunks_mut(ROWS * nt)) {
                let f = &mut rows[..wr.len() / rb * cols];
                dequantize(dtype, wr, f).expect("validated rows");
                let bytes = f.as_bytes();
                match be {
                    Backend::Scalar => scalar::rows_f32(bytes, frb, a, o),
                    #[cfg(target_arch = "x86_64")]
                    Backend::Avx2(t) => avx2::rows_f32(t, bytes, frb, a, o),
                }
            }
        }
        _ => unreachable!("activation kind chosen by act_kind"),
    }
}

/// Rows per rayon task: enough tasks to balance the pool, each big enough to be worth it.
/// `local[r * n_tokens + t]` (what a kernel writes: row-major, a row's tokens together) into
/// `dst[t][r]`, in 16 × 16 blocks: read row by row down one token, the stride of
/// `n_tokens` floats (often a power of two) falls into a few cache sets, and a task's few
/// hundred rows evicted each other before the next token came to use them again.
fn scatter(local: &[f32], n_tokens: usize, dst: &mut [&mut [f32]]) {
    const B: usize = 16;
    let nrows = dst.first().map_or(0, |d| d.len());
    for t0 in (0..n_tokens).step_by(B) {
        let t1 = (t0 + B).min(n_tokens);
        for r0 in (0..nrows).step_by(B) {
            let r1 = (r0 + B).min(nrows);
            for (t, d) in dst[t0..t1].iter_mut().enumerate() {
                let col = local[r0 * n_tokens + t0 + t..].iter().step_by(n_tokens);
                for (v, &x) in d[r0..r1].iter_mut().zip(col) {
                    *v = x;
                }
            }
        }
    }
}

/// A multiple of `granule` (rows a kernel takes together; an interleaved layout's group).
fn rows_per_task(rows: usize, cols: usize, n_tokens: usize, granule: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let min_rows = (1 << 16) / (cols * n_tokens).max(1);
    let balanced = rows.div_ceil(threads * 3);
    min_rows
        .max(balanced)
        .clamp(1, rows.max(1))
        .next_multiple_of(granule)
}

fn check(
    w: &WeightView<'_>,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    y: &[f32],
) -> Result<(), KernelError> {
    w.validate()?;
    if w.cols != cols {
        return Err(KernelError::Shape(format!(
            "weights of one matmul_many call must share their column count ({} vs {cols})",
            w.cols
        )));
    }
    if x.len() != n_tokens * w.cols || y.len() != n_tokens * w.rows {
        return Err(KernelError::Shape(format!(
            "matmul {}x{} with {n_tokens} tokens: x has {} (want {}), y has {} (want {})",
            w.rows,
            w.cols,
            x.len(),
            n_tokens * w.cols,
            y.len(),
            n_tokens * w.rows
        )));
    }
    Ok(())
}

/// [`crate::matmul_many`] on a chosen instruction set.
pub fn matmul_many_with(
    isa: Isa,
    ws: &[WeightView<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    matmul_many_impl(isa, false, ws, x, n_tokens, ys)
}

/// [`crate::matmul_many`] with f32 activations for every weight type: quantized weights
/// are dequantized row by row and multiplied in f32, as a float reference implementation
/// does. Slower; no 8-bit rounding of the activations.
pub fn matmul_many_f32_act(
    isa: Isa,
    ws: &[WeightView<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    matmul_many_impl(isa, true, ws, x, n_tokens, ys)
}

fn matmul_many_impl(
    isa: Isa,
    f32_act: bool,
    ws: &[WeightView<'_>],
    x: &[f32],
    n_tokens: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    let be = Backend::new(isa).ok_or_else(|| {
        KernelError::Shape(format!("{} is not available on this CPU", isa.name()))
    })?;
    if ws.len() != ys.len() {
        return Err(KernelError::Shape(format!(
            "{} weights but {} outputs",
            ws.len(),
            ys.len()
        )));
    }
    let Some(first) = ws.first() else {
        return Ok(());
    };
    let cols = first.cols;
    let mut kinds = Vec::with_capacity(ws.len());
    for (w, y) in ws.iter().zip(ys.iter()) {
        check(w, cols, x, n_tokens, y)?;
        let kind = act_kind(w.dtype)?;
        kinds.push(if f32_act { ActKind::F32 } else { kind });
    }
    if n_tokens == 0 || cols == 0 {
        ys.iter_mut().for_each(|y| y.fill(0.0));
        return Ok(());
    }
    let acts = Acts::new(be, x, cols, &kinds);
    let rows: Vec<ActRows<'_>> = kinds.iter().map(|&k| acts.rows(k)).collect();

    // A task owns rows r0..r0 + nrows of one weight: the matching piece of every token's
    // output row. Kernels write `[row][token]`; with one token that is the output itself,
    // otherwise a task-local buffer is scattered to the token rows afterwards.
    struct Task<'y> {
        wi: usize,
        r0: usize,
        nrows: usize,
        dst: Vec<&'y mut [f32]>,
    }
    let mut tasks: Vec<Task<'_>> = Vec::new();
    for (wi, y) in ys.iter_mut().enumerate() {
        let w = &ws[wi];
        if w.rows == 0 {
            continue;
        }
        let granule = match w.layout {
            Layout::Rows => 4,
            Layout::Interleaved16 => GROUP,
        };
        let rpt = rows_per_task(w.rows, cols, n_tokens, granule);
        let first = tasks.len();
        for c in 0..w.rows.div_ceil(rpt) {
            let nrows = rpt.min(w.rows - c * rpt);
            tasks.push(Task {
                wi,
                r0: c * rpt,
                nrows,
                dst: Vec::with_capacity(n_tokens),
            });
        }
        for token_row in y.chunks_mut(w.rows) {
            for (c, piece) in token_row.chunks_mut(rpt).enumerate() {
                tasks[first + c].dst.push(piece);
            }
        }
    }
    let run = |task: Task<'_>| {
        let w = &ws[task.wi];
        let rb = w.row_bytes();
        let wrows = &w.data[task.r0 * rb..(task.r0 + task.nrows) * rb];
        let mut dst = task.dst;
        let kind = (w.dtype, w.layout);
        if let [only] = dst.as_mut_slice() {
            run_laid_out(be, kind, wrows, rb, &rows[task.wi], only);
        } else {
            let mut local = vec![0f32; task.nrows * n_tokens];
            run_laid_out(be, kind, wrows, rb, &rows[task.wi], &mut local);
            scatter(&local, n_tokens, &mut dst);
        }
    };
    if tasks.len() == 1 {
        tasks.into_iter().for_each(run);
    } else {
        tasks.into_par_iter().for_each(run);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_bounds_the_instruction_set() {
        let best = Isa::best_up_to(None);
        assert!(best.available());
        assert_eq!(Isa::best_up_to(Some(Isa::Scalar)), Isa::Scalar);
        for cap in Isa::ALL {
            let got = Isa::best_up_to(Some(cap));
            // available, no wider than the cap, and the cap itself where the CPU has it
            assert!(got.available(), "{cap:?} -> {got:?}");
            assert!(got.index() >= cap.index(), "{cap:?} -> {got:?}");
            if cap.available() {
                assert_eq!(got, cap);
            }
            assert_eq!(Isa::from_name(cap.name()), Some(cap));
        }
        assert_eq!(Isa::from_name("sse9"), None);
        // the process-wide cap (set to what the CPU has anyway: other tests run alongside)
        set_isa_cap(Some(best));
        assert_eq!((isa_cap(), Isa::best()), (Some(best), best));
        set_isa_cap(None);
        assert_eq!((isa_cap(), Isa::best()), (None, best));
    }
}
