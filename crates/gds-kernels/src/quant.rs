//! Reference quantizers, byte-identical to gguf-py's `gguf.quants.quantize` (which mirrors
//! ggml's `quantize_row_*_ref`): same f32 operations in the same order, truncation where
//! they truncate (`np.trunc` / C casts), rounding half away from zero where they use
//! `roundf`, f16 narrowing with round-to-nearest-even.

use crate::blocks::*;
use half::{bf16, f16};

/// The first element with the largest magnitude, its sign kept (0 for an empty or all-zero
/// slice; NaNs are passed over, as ggml's `fabsf(v) > amax` passes them).
#[inline]
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::INFINITY;
    let mut max = f32::NEG_INFINITY;
    for &v in x {
        min = min.min(v);
        max = max.max(v);
    }
    (min, max)
}

#[inline]
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Quantizes 32 values to Q4_0.
pub fn quantize_block_q4_0(x: &[f32]) -> BlockQ4_0 {
    let max = signed_absmax(&x[..QK]);
    let d = max / -8.0;
    let id = inverse(d);
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        let q0 = ((x[j] * id + 8.5).trunc() as u8).min(15);
        let q1 = ((x[j + QK / 2] * id + 8.5).trunc() as u8).min(15);
        *q = q0 | (q1 << 4);
    }
    BlockQ4_0 {
        d: f32_to_f16_bytes(d),
        qs,
    }
}

/// Quantizes 32 values to Q4_1.
pub fn quantize_block_q4_1(x: &[f32]) -> BlockQ4_1 {
    let (min, max) = min_max(&x[..QK]);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        let q0 = (((x[j] - min) * id + 0.5).trunc() as u8).min(15);
        let q1 = (((x[j + QK / 2] - min) * id + 0.5).trunc() as u8).min(15);
        *q = q0 | (q1 << 4);
    }
    BlockQ4_1 {
        d: f32_to_f16_bytes(d),
        m: f32_to_f16_bytes(min),
        qs,
    }
}

/// Packs 32 five-bit quants into (qh, qs).
#[inline]
pub(crate) fn pack5(q: &[u8; QK]) -> ([u8; 4], [u8; QK / 2]) {
    let mut qs = [0u8; QK / 2];
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        qs[j] = (q[j] & 0xF) | (q[j + QK / 2] << 4);
    }
    for (j, &v) in q.iter().enumerate() {
        qh |= ((v >> 4) as u32 & 1) << j;
    }
    (qh.to_le_bytes(), qs)
}

/// Quantizes 32 values to Q5_0.
pub fn quantize_block_q5_0(x: &[f32]) -> BlockQ5_0 {
    let max = signed_absmax(&x[..QK]);
    let d = max / -16.0;
    let id = inverse(d);
    let mut q = [0u8; QK];
    for (o, &v) in q.iter_mut().zip(x) {
        *o = ((v * id + 16.5).trunc() as u8).min(31);
    }
    let (qh, qs) = pack5(&q);
    BlockQ5_0 {
        d: f32_to_f16_bytes(d),
        qh,
        qs,
    }
}

/// Quantizes 32 values to Q5_1.
pub fn quantize_block_q5_1(x: &[f32]) -> BlockQ5_1 {
    let (min, max) = min_max(&x[..QK]);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    let mut q = [0u8; QK];
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (((v - min) * id + 0.5).trunc() as u8).min(31);
    }
    let (qh, qs) = pack5(&q);
    BlockQ5_1 {
        d: f32_to_f16_bytes(d),
        m: f32_to_f16_bytes(min),
        qh,
        qs,
    }
}

/// Quantizes 32 values to Q8_0.
pub fn quantize_block_q8_0(x: &[f32]) -> BlockQ8_0 {
    let amax = x[..QK].iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    let mut qs = [0i8; QK];
    for (o, &v) in qs.iter_mut().zip(x) {
        *o = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: f32_to_f16_bytes(d),
        qs,
    }
}

/// Quantizes 32 values to MXFP4 as ggml's `quantize_row_mxfp4_ref` and gguf-py do: the scale
/// exponent `floor(log2 amax) − 2 + 127` (0 for an all-zero block, and for magnitudes below
/// ~2^-125, where both wrap the byte), each value the nearest `KVALUES_MXFP4[i] · d` (the
/// first among equals).
pub fn quantize_block_mxfp4(x: &[f32]) -> BlockMxfp4 {
    let amax = x[..QK].iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
    } else {
        0
    };
    let d = e8m0_half(e);
    let best = |v: f32| -> u8 {
        let mut best = (0u8, (KVALUES_MXFP4[0] as f32 * d - v).abs());
        for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
            let err = (k as f32 * d - v).abs();
            if err < best.1 {
                best = (i as u8, err);
            }
        }
        best.0
    };
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        *q = best(x[j]) | (best(x[j + QK / 2]) << 4);
    }
    BlockMxfp4 { e, qs }
}

/// Quantizes 32 values to Q8_1 (ggml's `quantize_row_q8_1_ref`; gguf-py has no Q8_1).
pub fn quantize_block_q8_1(x: &[f32]) -> BlockQ8_1 {
    let amax = x[..QK].iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    let mut qs = [0i8; QK];
    let mut sum = 0i32;
    for (o, &v) in qs.iter_mut().zip(x) {
        *o = (v * id).round() as i8;
        sum += *o as i32;
    }
    BlockQ8_1 {
        d: f32_to_f16_bytes(d),
        s: f32_to_f16_bytes(sum as f32 * d),
        qs,
    }
}

/// Quantizes 256 values to Q8_K (ggml's `quantize_row_q8_K_ref`; gguf-py has no Q8_K).
pub fn quantize_block_q8_k(x: &[f32]) -> BlockQ8K {
    let max = signed_absmax(&x[..QK_K]);
    let mut qs = [0i8; QK_K];
    let mut bsums = [[0u8; 2]; QK_K / 16];
    if max == 0.0 {
        return BlockQ8K {
            d: 0f32.to_le_bytes(),
            qs,
            bsums,
        };
    }
    let iscale = -127.0 / max;
    for (o, &v) in qs.iter_mut().zip(x) {
        // ggml's nearest_int rounds half to even; values are within [-127, 128].
        *o = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    for (j, s) in bsums.iter_mut().enumerate() {
        let sum: i32 = qs[j * 16..j * 16 + 16].iter().map(|&q| q as i32).sum();
        *s = (sum as i16).to_le_bytes();
    }
    BlockQ8K {
        d: (1.0 / iscale).to_le_bytes(),
        qs,
        bsums,
    }
}

/// f32 to bf16 as ggml's `ggml_compute_fp32_to_bf16` (NaN forced quiet, round to nearest
/// even) — which is what `half::bf16::from_f32` does.
#[inline]
pub(crate) fn f32_to_bf16_bytes(v: f32) -> [u8; 2] {
    bf16::from_f32(v).to_le_bytes()
}

/// Writes `src` as f16 bytes into `out` (`2 * src.len()` bytes).
pub(crate) fn f16_to_bytes(src: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f16::from_f32(v).to_le_bytes());
    }
}

/// Writes `src` as bf16 bytes into `out`.
pub(crate) fn bf16_to_bytes(src: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f32_to_bf16_bytes(v));
    }
}

/// Writes `src` as little-endian f32 bytes into `out`.
pub(crate) fn f32_to_bytes(src: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(4).zip(src) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}
