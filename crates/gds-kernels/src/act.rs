//! Quantized activation rows: the input vector of a matmul is quantized once to 8 bits so
//! that the dot products with quantized weights run in integers.
//!
//! These are in-memory formats only (never written to disk), so they keep the scale as f32
//! and precompute what the dot products need: the scaled sum of each 32-block for the
//! offset terms of Q4_0/Q4_1/Q5_0/Q5_1, the per-16 sums for the K-quants.

use crate::blocks::{QK, QK_K};

/// 32 activations as `d * qs`, with `s = d * sum(qs)`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct ActQ8 {
    /// Quants, `round_ties_even(x / d)`, in -127..=127.
    pub qs: [i8; QK],
    /// Scale, `max |x| / 127`.
    pub d: f32,
    /// `d * sum(qs)`.
    pub s: f32,
}

impl Default for ActQ8 {
    fn default() -> Self {
        ActQ8 {
            qs: [0; QK],
            d: 0.0,
            s: 0.0,
        }
    }
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

/// Reference activation quantizer for 32-blocks. `x.len() == 32 * out.len()`.
pub fn quantize_act_q8_scalar(x: &[f32], out: &mut [ActQ8]) {
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = inv_scale(amax);
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        o.d = d;
        o.s = d * sum as f32;
    }
}

/// Reference activation quantizer for 256-blocks. `x.len() == 256 * out.len()`.
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
