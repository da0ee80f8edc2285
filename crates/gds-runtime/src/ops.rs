//! Small element-wise helpers of the forward pass. Output buffer first, as in llama2.c.

use crate::kv::KvElem;

/// `out = x / sqrt(mean(x^2) + eps) * w`, one row (`w.len()` wide).
pub fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32;
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// [`rmsnorm`] for each row of `x`.
pub fn rmsnorm_rows(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    for (o, xr) in out.chunks_exact_mut(w.len()).zip(x.chunks_exact(w.len())) {
        rmsnorm(o, xr, w, eps);
    }
}

/// [`rmsnorm`] in place, for each row of `x` (`w.len()` wide): per-head norms and
/// post-norms of a sub-layer's output.
pub fn rmsnorm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let scale = (1.0 / (ss / row.len() as f64 + eps as f64).sqrt()) as f32;
        for (v, &wi) in row.iter_mut().zip(w) {
            *v = *v * scale * wi;
        }
    }
}

/// `x *= a` element-wise.
pub fn scale(x: &mut [f32], a: f32) {
    for v in x {
        *v *= a;
    }
}

/// Soft cap `c·tanh(v/c)` of every value (Gemma 2's attention and logit caps).
pub fn softcap(x: &mut [f32], c: f32) {
    let inv = 1.0 / c;
    for v in x {
        *v = c * (*v * inv).tanh();
    }
}

/// The tanh approximation of GELU, as ggml's `gelu` and PyTorch's `gelu(approximate="tanh")`:
/// `0.5·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`, computed as the equal
/// `x / (1 + e^(−2u))` with [`exp_fast`] (no call, no branch: the loops below vectorize).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x);
    x / (1.0 + exp_fast(-2.0 * u))
}

/// `x / (1 + e^(−x))` with [`exp_fast`].
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_fast(-x))
}

/// GeGLU: `gate = gelu_tanh(gate) * up`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    gated(gate, up, |g, u| gelu_tanh(g) * u)
}

/// gpt-oss's clamped SwiGLU (llama.cpp's `swiglu_oai`, alpha 1.702, limit 7):
/// `gate = g · σ(1.702 g) · (u + 1)` with `g = min(gate, 7)`, `u = clamp(up, −7, 7)`.
pub fn swiglu_oai(gate: &mut [f32], up: &[f32]) {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    gated(gate, up, |g, u| {
        let g = g.min(LIMIT);
        g / (1.0 + exp_fast(-ALPHA * g)) * (u.clamp(-LIMIT, LIMIT) + 1.0)
    })
}

/// `gate[i] = f(gate[i], up[i])`, in the AVX2 build of the same loop where the CPU has it
/// (the same numbers, eight at a time: `f` has no calls or branches).
#[inline(always)]
fn gated<F: Fn(f32, f32) -> f32>(gate: &mut [f32], up: &[f32], f: F) {
    #[inline(always)]
    fn body<F: Fn(f32, f32) -> f32>(gate: &mut [f32], up: &[f32], f: &F) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = f(*g, u);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        #[target_feature(enable = "avx2")]
        fn vectorized<F: Fn(f32, f32) -> f32>(gate: &mut [f32], up: &[f32], f: &F) {
            body(gate, up, f)
        }
        // SAFETY: simd_available() found AVX2 on this CPU.
        return unsafe { vectorized(gate, up, &f) };
    }
    body(gate, up, &f)
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `e^x` to within 2 ulp for `x` in [−87, 88] (clamped there: below, the result is
/// ~1.6e−38 rather than a smaller number or 0). Cephes' `expf` polynomial, written
/// without calls and branches so that a loop over it vectorizes, and without fused
/// multiply-adds, so the scalar build and the AVX2 build of the same loop agree bit for bit.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    // round(x·log2 e) by adding 1.5·2^23: the integer lands in the low mantissa bits
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let k = x * std::f32::consts::LOG2_E + MAGIC;
    let n = k - MAGIC;
    let r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    let mut y = EXP_POLY[0];
    for &p in &EXP_POLY[1..] {
        y = y * r + p;
    }
    let y = y * (r * r) + r + 1.0;
    // 2^n: n + 127 in the exponent field (n is in the low bits of k's representation)
    y * f32::from_bits(k.to_bits().wrapping_add(127) << 23)
}

/// ln 2 in two parts for [`exp_fast`]'s reduction, so that `x − n·ln 2` keeps its low bits.
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
/// See [`EXP_LN2_HI`].
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// [`exp_fast`]'s polynomial (Cephes `expf`), highest degree first.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `acc += x` element-wise.
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Adds `bias` to each row of `x`.
pub fn add_bias_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// SwiGLU: `gate = silu(gate) * up`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    gated(gate, up, |g, u| silu(g) * u)
}

/// Dot product of an f32 vector with a cache row, 8 lanes so the compiler vectorizes it.
#[inline]
pub fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len().min(b.len()));
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y.to_f32();
    }
    s
}

/// `out += a * v`.
#[inline]
pub fn axpy<T: KvElem>(out: &mut [f32], a: f32, v: &[T]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += a * x.to_f32();
    }
}

/// One attention head of one query token over a KV cache region.
pub struct Head<'a, T> {
    /// The query head `[head_dim]`.
    pub q: &'a [f32],
    /// Key cache (one layer, all sequences).
    pub k: &'a [T],
    /// Value cache (one layer, all sequences).
    pub v: &'a [T],
    /// Index of this head's first element at position 0.
    pub base: usize,
    /// Elements between consecutive positions.
    pub stride: usize,
    /// Keys attended: positions `0..n_keys`.
    pub n_keys: usize,
    /// Query scale (`1 / sqrt(head_dim)` unless the architecture says otherwise).
    pub scale: f32,
    /// Score cap `c·tanh(s/c)` (Gemma 2), applied after scaling.
    pub softcap: Option<f32>,
}

/// Scores, softmax, weighted sum of values: `out = softmax(q·K^T * scale) V`.
/// `scores` needs room for `n_keys` values.
#[inline(always)]
fn attend_generic<T: KvElem>(h: &Head<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    let hd = h.q.len();
    let sc = &mut scores[..h.n_keys];
    for (j, sj) in sc.iter_mut().enumerate() {
        let at = h.base + j * h.stride;
        *sj = dot(h.q, &h.k[at..at + hd]) * h.scale;
    }
    if let Some(c) = h.softcap {
        softcap(sc, c);
    }
    softmax(sc);
    out.fill(0.0);
    for (j, &p) in sc.iter().enumerate() {
        let at = h.base + j * h.stride;
        axpy(out, p, &h.v[at..at + hd]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2<T: KvElem>(h: &Head<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    attend_generic(h, scores, out)
}

/// True when the CPU can run the AVX2 builds (AVX2, FMA, F16C): these helpers' and the
/// attention kernels' (`attention::kernels`).
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`Head`] attention; `simd` (from [`simd_available`]) picks the AVX2 build of the same code.
#[inline]
pub fn attend<T: KvElem>(simd: bool, h: &Head<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when `simd_available()` found AVX2 and FMA on this CPU.
        unsafe { attend_avx2(h, scores, out) };
        return;
    }
    let _ = simd;
    attend_generic(h, scores, out)
}

/// Index of the largest value (the first one on ties); 0 for an empty slice.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_normalizes() {
        let mut out = [0.0; 4];
        rmsnorm(
            &mut out,
            &[1.0, -1.0, 1.0, -1.0],
            &[1.0, 2.0, 3.0, 4.0],
            0.0,
        );
        assert_eq!(out, [1.0, -2.0, 3.0, -4.0]);
    }

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = [1.0, 2.0, 3.0, 10.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] > 0.99 && x[0] < x[1] && x[1] < x[2]);
        let mut big = [1000.0f32, 1000.0];
        softmax(&mut big);
        assert_eq!(big, [0.5, 0.5], "no overflow");
    }

    #[test]
    fn exp_fast_is_within_two_ulp_of_exp() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_fast(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp_fast(0.0), 1.0);
        assert!(exp_fast(-1e30) > 0.0 && exp_fast(-1e30) < 2e-38);
        assert!(exp_fast(f32::NEG_INFINITY) < 2e-38);
    }

    #[test]
    fn dot_handles_tails() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let want: f32 = a.iter().map(|x| x * x).sum();
        assert_eq!(dot(&a, &a), want);
    }

    #[test]
    fn gated_activations_match_their_formulas_in_every_build() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.023).collect();
        let up: Vec<f32> = (0..1003).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
        let (mut g, mut s) = (x.clone(), x.clone());
        geglu(&mut g, &up);
        swiglu(&mut s, &up);
        for i in 0..x.len() {
            let (v, u) = (x[i] as f64, up[i] as f64);
            let t = (0.797_884_560_802_865_4 * (v + 0.044715 * v * v * v)).tanh();
            let gw = 0.5 * v * (1.0 + t) * u;
            let sw = v / (1.0 + (-v).exp()) * u;
            assert!(
                (g[i] as f64 - gw).abs() < 2e-6 * gw.abs().max(1.0),
                "gelu {v}"
            );
            assert!(
                (s[i] as f64 - sw).abs() < 2e-6 * sw.abs().max(1.0),
                "silu {v}"
            );
            // the scalar definitions, element by element: the same bits
            assert_eq!(g[i], gelu_tanh(x[i]) * up[i]);
            assert_eq!(s[i], silu(x[i]) * up[i]);
        }
        // far tails: no NaN or overflow (e^(−2u) is capped at e^88: −x·1e−38 for x ≪ 0)
        let mut t = [-1e4f32, -100.0, 100.0, 1e4];
        geglu(&mut t, &[1.0; 4]);
        assert!(t[0].abs() < 1e-30 && t[1].abs() < 1e-30, "{t:?}");
        assert_eq!(t[2..], [100.0, 1e4]);
    }

    #[test]
    fn swiglu_matches_formula() {
        let mut g = [0.0, 1.0, -2.0];
        swiglu(&mut g, &[3.0, 2.0, 1.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((g[2] - (-2.0 / (1.0 + 2.0f32.exp()))).abs() < 1e-6);
    }
}
