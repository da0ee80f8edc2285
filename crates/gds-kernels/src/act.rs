//! Quantized activation rows: the input vector of a matmul is quantized once to 8 bits so
//! that the dot products with quantized weights run in integers.
//!
//! These are in-memory formats only (never written to disk), so they keep the scale as f32
//! and precompute what the dot products need: the sum of each 32-block for the offset terms
//! of Q4_0/Q4_1/Q5_0/Q5_1 (scaled, and as an integer), the per-16 sums for the K-quants.

use crate::blocks::{QK, QK_K};

/// Two consecutive 32-blocks of activations (blocks `2p` and `2p + 1` of a row), each as
/// `d * q`, stored interleaved by half-block so that one 256-bit register pairs with the
/// nibbles of two Q4/Q5 weight blocks: `lo` holds elements 0..16 of both blocks, `hi`
/// elements 16..32. A row with an odd number of blocks ends with a zero second block.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct ActQ8 {
    /// Elements 0..16 of block `2p`, then elements 0..16 of block `2p + 1`.
    pub lo: [i8; QK],
    /// Elements 16..32 of block `2p`, then elements 16..32 of block `2p + 1`.
    pub hi: [i8; QK],
    /// `[d0; 4]` then `[d1; 4]`: each block's scale `max |x| / 127`, spread to lie under the
    /// i32 lanes of a paired dot product.
    pub d8: [f32; 8],
    /// `[0, s0, 0, s1]`: each block's `d * sum(q)`, in the lanes of the weight offsets.
    pub s4: [f32; 4],
    /// `[-sum0, 0, 0, 0, -sum1, 0, 0, 0]`: each block's negated `sum(q)` under the first
    /// i32 lane of its half, where a constant weight offset (Q4_0's -8, Q5_0's -16) joins
    /// the integer dot product.
    pub nsum: [i32; 8],
}

impl Default for ActQ8 {
    fn default() -> Self {
        ActQ8 {
            lo: [0; QK],
            hi: [0; QK],
            d8: [0.0; 8],
            s4: [0.0; 4],
            nsum: [0; 8],
        }
    }
}

impl ActQ8 {
    /// Block `h` (0 or 1) of the pair: its 32 quants in element order, `d` and `s`.
    pub fn block(&self, h: usize) -> ([i8; QK], f32, f32) {
        let mut q = [0i8; QK];
        q[..16].copy_from_slice(&self.lo[16 * h..16 * h + 16]);
        q[16..].copy_from_slice(&self.hi[16 * h..16 * h + 16]);
        (q, self.d8[4 * h], self.s4[2 * h + 1])
    }
}

/// Pairs needed for a row of `cols` elements.
pub fn q8_pairs(cols: usize) -> usize {
    (cols / QK).div_ceil(2)
}

/// 256 activations as `d * qs`, with the sums of each 16 quants.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct ActQ8K {
    /// Quants, `round_ties_even(x / d)`, in -127..=127.
    pub qs: [i8; QK_K],
    /// `sum(qs[16 * i .. 16 * i + 16])`.
    pub bsums: [i16; QK_K / 16],
    /// Scale, `max |x| / 127`.
    pub d: f32,
}

impl Default for ActQ8K {
    fn default() -> Self {
        ActQ8K {
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
            d: 0.0,
        }
    }
}

/// `1 / d`, or 0 for a zero scale (an all-zero block).
#[inline(always)]
pub(crate) fn inv_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d == 0.0 { 0.0 } else { 1.0 / d })
}

/// Reference activation quantizer for 32-blocks: one row `x` (a whole number of blocks)
/// into `out` (`q8_pairs(x.len())` pairs).
pub fn quantize_act_q8_scalar(x: &[f32], out: &mut [ActQ8]) {
    assert_eq!(out.len(), q8_pairs(x.len()));
    out.fill(ActQ8::default());
    for (i, xb) in x.chunks_exact(QK).enumerate() {
        let (o, h) = (&mut out[i / 2], i % 2);
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = inv_scale(amax);
        let mut sum = 0i32;
        for (j, &v) in xb.iter().enumerate() {
            let q = (v * id).round_ties_even() as i8;
            sum += q as i32;
            if j < 16 {
                o.lo[16 * h + j] = q;
            } else {
                o.hi[16 * h + j - 16] = q;
            }
        }
        o.d8[4 * h..4 * h + 4].fill(d);
        o.s4[2 * h + 1] = d * sum as f32;
        o.nsum[4 * h] = -sum;
    }
}

/// Reference activation quantizer for 256-blocks. `x.len() == 256 * out.len()`; rows
/// may be concatenated.
pub fn quantize_act_q8k_scalar(x: &[f32], out: &mut [ActQ8K]) {
    for (xb, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = inv_scale(amax);
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
        }
        for (s, qs) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| q as i16).sum();
        }
        o.d = d;
    }
}
