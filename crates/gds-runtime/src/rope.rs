//! Rotary position embeddings in ggml's two pairings: "normal" mode (rope type 0, what
//! llama.cpp uses for the llama architecture) rotates adjacent pairs `(x[2i], x[2i+1])`, and
//! GGUF Q/K weights of llama are stored permuted for exactly this layout; NEOX mode (Gemma,
//! Qwen, Phi) rotates the halves `(x[i], x[i + head_dim/2])`, HF's `rotate_half`.
//!
//! All angles are computed once, at load, for every position of the context, by the one
//! RoPE builder [`gds_format::arch::rope_tables`] (shared with the CUDA backend).

use gds_format::arch::{RopeFreqs, RopeScaling};

/// Precomputed `cos`/`sin` of every (position, pair) angle.
pub struct RopeTable {
    /// Pairs rotated per head: `rope_dims / 2`.
    half: usize,
    /// Width of one head: dimensions from `2 · half` to `stride` pass unrotated (partial
    /// rotary, Phi-3).
    stride: usize,
    neox: bool,
    /// `[ctx, head_dim / 2]`
    cos: Vec<f32>,
    /// `[ctx, head_dim / 2]`
    sin: Vec<f32>,
}

impl RopeTable {
    /// Angles for positions `0..ctx` of heads `head_dim` wide (all rotated; see
    /// [`RopeTable::partial`]).
    pub fn new(head_dim: usize, ctx: usize, theta: f64, scaling: RopeScaling) -> RopeTable {
        Self::build(head_dim, ctx, theta, RopeFreqs::Scaled(scaling), None)
    }

    /// The tables of [`gds_format::arch::rope_tables`] (the one RoPE builder, shared with
    /// the CUDA backend) for heads rotating `rope_dims` dimensions.
    pub fn build(
        rope_dims: usize,
        ctx: usize,
        theta: f64,
        freqs: RopeFreqs<'_>,
        attn_factor: Option<f32>,
    ) -> RopeTable {
        let (cos, sin) = gds_format::arch::rope_tables(rope_dims, ctx, theta, freqs, attn_factor);
        let half = rope_dims / 2;
        RopeTable {
            half,
            stride: 2 * half,
            neox: false,
            cos,
            sin,
        }
    }

    /// The same table for heads `head_dim` wide of which only the first dimensions the table
    /// was built for are rotated (partial rotary: build with `rope_dims`, then this).
    pub fn partial(mut self, head_dim: usize) -> RopeTable {
        debug_assert!(head_dim >= 2 * self.half);
        self.stride = head_dim;
        self
    }

    /// The same table, rotating heads in NEOX halves instead of adjacent pairs.
    pub fn neox(mut self, on: bool) -> RopeTable {
        self.neox = on;
        self
    }

    /// The `cos` and `sin` tables, `[ctx][head_dim / 2]` each (what the GPU kernels read).
    pub fn into_tables(self) -> (Vec<f32>, Vec<f32>) {
        (self.cos, self.sin)
    }

    /// Number of positions covered.
    pub fn ctx(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates every head of `x` (`n_heads` heads of `head_dim`, back to back) to position
    /// `pos`. `pos` must be below [`RopeTable::ctx`].
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let base = pos * self.half;
        let cos = &self.cos[base..base + self.half];
        let sin = &self.sin[base..base + self.half];
        let rot = 2 * self.half;
        if self.neox {
            for head in x.chunks_exact_mut(self.stride) {
                let (lo, hi) = head[..rot].split_at_mut(self.half);
                for (((a, b), c), s) in lo.iter_mut().zip(hi).zip(cos).zip(sin) {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x0 * s + x1 * c;
                }
            }
            return;
        }
        for head in x.chunks_exact_mut(self.stride) {
            for ((pair, c), s) in head[..rot].chunks_exact_mut(2).zip(cos).zip(sin) {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * c - x1 * s;
                pair[1] = x0 * s + x1 * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook formula: pair `i` of each head, viewed as the complex number
    /// `x[2i] + j x[2i+1]`, is multiplied by `exp(j * pos * theta^(-2i/d) / scale)`.
    fn naive(x: &[f32], head_dim: usize, pos: usize, theta: f64, scale: f64) -> Vec<f32> {
        let mut out = x.to_vec();
        for h in 0..x.len() / head_dim {
            for i in 0..head_dim / 2 {
                let angle = pos as f64 / scale / theta.powf(2.0 * i as f64 / head_dim as f64);
                let (re, im) = (
                    x[h * head_dim + 2 * i] as f64,
                    x[h * head_dim + 2 * i + 1] as f64,
                );
                out[h * head_dim + 2 * i] = (re * angle.cos() - im * angle.sin()) as f32;
                out[h * head_dim + 2 * i + 1] = (re * angle.sin() + im * angle.cos()) as f32;
            }
        }
        out
    }

    fn input(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 19) as f32 - 9.0) / 7.0).collect()
    }

    #[test]
    fn matches_naive_formula() {
        let (hd, heads, ctx) = (64, 3, 300);
        let t = RopeTable::new(hd, ctx, 100000.0, RopeScaling::None);
        for pos in [0, 1, 7, 299] {
            let mut x = input(hd * heads);
            let want = naive(&x, hd, pos, 100000.0, 1.0);
            t.apply(&mut x, pos);
            for (a, b) in x.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "pos {pos}: {a} vs {b}");
            }
        }
    }

    /// NEOX rotates (x[i], x[i + d/2]); the same vector with its halves interleaved into
    /// adjacent pairs, rotated in normal mode, gives the same values (HF's `rotate_half` vs
    /// the GGUF-permuted layout of llama).
    #[test]
    fn neox_is_normal_mode_on_interleaved_halves() {
        let (hd, heads, pos) = (16, 3, 7);
        let norm = RopeTable::new(hd, 16, 10000.0, RopeScaling::None);
        let neox = RopeTable::new(hd, 16, 10000.0, RopeScaling::None).neox(true);
        let x = input(hd * heads);
        let interleave = |v: &[f32]| -> Vec<f32> {
            v.chunks(hd)
                .flat_map(|h| (0..hd / 2).flat_map(move |i| [h[i], h[i + hd / 2]]))
                .collect()
        };
        let mut a = x.clone();
        neox.apply(&mut a, pos);
        let mut b = interleave(&x);
        norm.apply(&mut b, pos);
        let a = interleave(&a);
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() < 1e-6, "{u} vs {v}");
        }
        assert_ne!(a, interleave(&x), "it rotated");
    }

    #[test]
    fn position_zero_is_identity_and_norm_is_kept() {
        let t = RopeTable::new(8, 10, 10000.0, RopeScaling::None);
        let x0 = input(16);
        let mut x = x0.clone();
        t.apply(&mut x, 0);
        assert_eq!(x, x0);
        t.apply(&mut x, 9);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&x0)).abs() < 1e-4);
    }

    #[test]
    fn linear_scaling_divides_positions() {
        let t = RopeTable::new(16, 50, 10000.0, RopeScaling::Linear { factor: 4.0 });
        let mut x = input(16);
        let want = naive(&x, 16, 40, 10000.0, 4.0);
        t.apply(&mut x, 40);
        for (a, b) in x.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn llama3_factors_follow_the_reference_rule() {
        // Llama 3.1 8B: theta 500000, factor 8, low 1, high 4, original context 8192.
        let f = gds_format::arch::llama3_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0, "highest frequency kept");
        assert_eq!(f[63], 8.0, "lowest frequency fully stretched");
        // wavelength of pair i is 2*pi*theta^(2i/d); pairs between 2048 and 8192 are smoothed
        for (i, &v) in f.iter().enumerate() {
            let wl = 2.0 * std::f64::consts::PI * 500000f64.powf(2.0 * i as f64 / 128.0);
            if wl < 2048.0 {
                assert_eq!(v, 1.0);
            } else if wl > 8192.0 {
                assert_eq!(v, 8.0);
            } else {
                assert!(v > 1.0 && v < 8.0, "pair {i}: {v}");
            }
        }
        let t = RopeTable::new(
            128,
            4,
            500000.0,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context_length: 8192.0,
            },
        );
        let mut x = input(128);
        let x0 = x.clone();
        t.apply(&mut x, 3);
        // lowest pair: angle 3 * theta^(-126/128) / 8
        let a = 3.0 * 500000f64.powf(-126.0 / 128.0) / 8.0;
        let want = x0[126] as f64 * a.cos() - x0[127] as f64 * a.sin();
        assert!((x[126] as f64 - want).abs() < 1e-6);
    }
}
