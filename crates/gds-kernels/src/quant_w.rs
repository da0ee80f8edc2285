//! Quantizers that take an importance matrix: per-column weights (the mean squared
//! activation each column of the matrix meets), byte-identical to ggml's
//! `quantize_row_*_impl` with `quant_weights` (llama.cpp's ggml/src/ggml-quants.c, the path
//! `ggml_quantize_chunk` — and so `llama-quantize --imatrix` — takes when it is given one):
//! the same f32 operations in the same order (no fused multiply-adds), `nearest_int`, C's
//! integer narrowing where ggml narrows (`as u8` wraps like the C store), f16 narrowing with
//! round-to-nearest-even.
//!
//! Each function quantizes one row: Q4_0/Q4_1/Q5_0/Q5_1 weigh by the whole row's mean square
//! (`sigma2`), the K-quants by each super-block's. NaN or infinite inputs or weights give
//! unspecified (but memory-safe, panic-free) blocks, as in ggml.

use crate::blocks::*;
use crate::quant::pack5;
use crate::quant_k::{
    k_pack_scales, k_requant, make_qx_quants_rmse1, nearest_int, pack_2bit, q3_k_finish,
    q4_k_store, q5_k_store, q6_k_block, weighted_range, GROUP_MAX_EPS,
};

/// ggml's `make_qkx3_quants` with weights, `rmin = -0.9`, `rdelta = 0.05`, `nstep = 36` and
/// `use_mad = false` (the only parameters its weighted callers pass): fits
/// `x ≈ scale * L - the_min`, `L` in `0..=nmax`; returns `(scale, the_min)`.
fn make_qkx3_quants<const N: usize>(
    nmax: i32,
    x: &[f32; N],
    weights: &[f32; N],
    big_l: &mut [u8; N],
) -> (f32, f32) {
    const RMIN: f32 = -0.9;
    const RDELTA: f32 = 0.05;
    const NSTEP: i32 = 36;
    let mut laux = [0u8; N];
    let (mut min, max, sum_w, sum_x) = weighted_range(x, weights);
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        big_l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_mad = 0f32;
    for i in 0..N {
        let l = nearest_int(iscale * (x[i] - min));
        big_l[i] = l.clamp(0, nmax) as u8;
        let diff = scale * big_l[i] as f32 + min - x[i];
        best_mad += weights[i] * (diff * diff);
    }
    for is in 0..=NSTEP {
        iscale = (RMIN + RDELTA * is as f32 + nmax as f32) / (max - min);
        let mut sum_l = 0f32;
        let mut sum_l2 = 0f32;
        let mut sum_xl = 0f32;
        for i in 0..N {
            // the best fit so far can put `min` at or near `max`: `v` may be inf, NaN or out
            // of nearest_int's range, hence ggml's clamp before rounding
            let v = iscale * (x[i] - min);
            let l = if v > 0.0 {
                nearest_int(if v < nmax as f32 { v } else { nmax as f32 })
            } else {
                0
            };
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut mad = 0f32;
            for i in 0..N {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                mad += weights[i] * (diff * diff);
            }
            if mad < best_mad {
                *big_l = laux;
                best_mad = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qp_quants`: quantizes the non-negative `x` (sub-block scales or mins) to
/// `L` in `0..=nmax` weighted by `qw`, searching nine scales and then moving single values;
/// returns the scale. `L` holds ggml's `uint8_t` stores (a negative value wraps).
fn make_qp_quants<const N: usize>(
    nmax: i32,
    x: &[f32; N],
    big_l: &mut [u8; N],
    qw: &[f32; N],
) -> f32 {
    let mut max = 0f32;
    for &v in x {
        // MAX(max, x[i]) = max > x[i] ? max : x[i] (a NaN is taken, as ggml takes it)
        max = if max > v { max } else { v };
    }
    if max < GROUP_MAX_EPS {
        big_l.fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for (o, &v) in big_l.iter_mut().zip(x) {
        *o = nearest_int(iscale * v) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..N {
        let diff = x[i] - scale * big_l[i] as f32;
        best_mse += qw[i] * diff * diff;
    }
    for is in -4i32..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1f32 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..N {
            let l = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * l as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for i in 0..N {
        let l = nearest_int(iscale * x[i]).min(nmax);
        big_l[i] = l as u8;
        let w = qw[i];
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..N {
            let w = qw[i];
            let li = big_l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            let mut sl2 = suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != big_l[i] as i32 {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        big_l[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `sum(x^2)` in order, as ggml sums it.
#[inline]
fn sum_sq(x: &[f32]) -> f32 {
    let mut s = 0f32;
    for &v in x {
        s += v * v;
    }
    s
}

/// `qw[i] * sqrt(sigma2 + x[i]^2)`: the weights every `_impl` but Q6_K's gives its fits.
#[inline]
fn impl_weights<const N: usize>(x: &[f32], qw: &[f32], sigma2: f32) -> [f32; N] {
    let mut w = [0f32; N];
    for i in 0..N {
        w[i] = qw[i] * (sigma2 + x[i] * x[i]).sqrt();
    }
    w
}

/// `Q4_0` blocks of one row (`quantize_row_q4_0_impl`).
pub(crate) fn row_q4_0(x: &[f32], qw: &[f32], out: &mut [BlockQ4_0]) {
    let sigma2 = sum_sq(x) / x.len() as f32;
    for ((xb, qb), o) in x.chunks_exact(QK).zip(qw.chunks_exact(QK)).zip(out) {
        let w: [f32; QK] = impl_weights(xb, qb, sigma2);
        let mut big_l = [0i8; QK];
        let d = make_qx_quants_rmse1(8, xb, &mut big_l, Some(&w));
        o.d = f32_to_f16_bytes(d);
        for j in 0..QK / 2 {
            o.qs[j] = big_l[j] as u8 | ((big_l[j + QK / 2] as u8) << 4);
        }
    }
}

/// `Q5_0` blocks of one row (`quantize_row_q5_0_impl`).
pub(crate) fn row_q5_0(x: &[f32], qw: &[f32], out: &mut [BlockQ5_0]) {
    let sigma2 = sum_sq(x) / x.len() as f32;
    for ((xb, qb), o) in x.chunks_exact(QK).zip(qw.chunks_exact(QK)).zip(out) {
        let w: [f32; QK] = impl_weights(xb, qb, sigma2);
        let mut big_l = [0i8; QK];
        let d = make_qx_quants_rmse1(16, xb, &mut big_l, Some(&w));
        o.d = f32_to_f16_bytes(d);
        (o.qh, o.qs) = pack5(&big_l.map(|v| v as u8));
    }
}

/// `Q4_1` blocks of one row (`quantize_row_q4_1_impl`).
pub(crate) fn row_q4_1(x: &[f32], qw: &[f32], out: &mut [BlockQ4_1]) {
    let sigma2 = sum_sq(x) / x.len() as f32;
    for ((xb, qb), o) in x.chunks_exact(QK).zip(qw.chunks_exact(QK)).zip(out) {
        let xb: &[f32; QK] = xb.try_into().expect("32 values");
        let w: [f32; QK] = impl_weights(xb, qb, sigma2);
        let mut big_l = [0u8; QK];
        let (d, min) = make_qkx3_quants(15, xb, &w, &mut big_l);
        o.d = f32_to_f16_bytes(d);
        o.m = f32_to_f16_bytes(-min);
        for j in 0..QK / 2 {
            o.qs[j] = big_l[j] | (big_l[j + QK / 2] << 4);
        }
    }
}

/// `Q5_1` blocks of one row (`quantize_row_q5_1_impl`).
pub(crate) fn row_q5_1(x: &[f32], qw: &[f32], out: &mut [BlockQ5_1]) {
    let sigma2 = sum_sq(x) / x.len() as f32;
    for ((xb, qb), o) in x.chunks_exact(QK).zip(qw.chunks_exact(QK)).zip(out) {
        let xb: &[f32; QK] = xb.try_into().expect("32 values");
        let w: [f32; QK] = impl_weights(xb, qb, sigma2);
        let mut big_l = [0u8; QK];
        let (d, min) = make_qkx3_quants(31, xb, &w, &mut big_l);
        o.d = f32_to_f16_bytes(d);
        o.m = f32_to_f16_bytes(-min);
        (o.qh, o.qs) = pack5(&big_l);
    }
}

/// One Q2_K super-block (`quantize_row_q2_K_impl`).
pub(crate) fn block_q2_k(x: &[f32], qw: &[f32]) -> BlockQ2K {
    let x = &x[..QK_K];
    let sigma2 = sum_sq(x) / QK_K as f32;
    let mut big_l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut mins = [0f32; QK_K / 16];
    let mut sw = [0f32; QK_K / 16];
    for j in 0..QK_K / 16 {
        let xs: &[f32; 16] = x[16 * j..16 * j + 16].try_into().expect("16 values");
        let w: [f32; 16] = impl_weights(xs, &qw[16 * j..], sigma2);
        for &v in &w {
            sw[j] += v;
        }
        let l: &mut [u8; 16] = (&mut big_l[16 * j..16 * j + 16])
            .try_into()
            .expect("16 quants");
        (scales[j], mins[j]) = make_qkx3_quants(3, xs, &w, l);
    }
    let mut ls = [0u8; QK_K / 16];
    let mut lm = [0u8; QK_K / 16];
    let dm = make_qp_quants(15, &scales, &mut ls, &sw);
    let mm = make_qp_quants(15, &mins, &mut lm, &sw);
    let mut b = BlockQ2K {
        scales: [0; QK_K / 16],
        qs: [0; QK_K / 4],
        d: f32_to_f16_bytes(dm),
        dmin: f32_to_f16_bytes(mm),
    };
    let (dm, mm) = (f16_bytes_to_f32(b.d), f16_bytes_to_f32(b.dmin));
    for j in 0..QK_K / 16 {
        b.scales[j] = ls[j] | (lm[j] << 4);
    }
    for j in 0..QK_K / 16 {
        let d = dm * (b.scales[j] & 0xF) as f32;
        if d == 0.0 {
            continue;
        }
        let m = mm * (b.scales[j] >> 4) as f32;
        for ii in 0..16 {
            let l = nearest_int((x[16 * j + ii] + m) / d);
            big_l[16 * j + ii] = l.clamp(0, 3) as u8;
        }
    }
    b.qs = pack_2bit(&big_l);
    b
}

/// One Q3_K super-block (`quantize_row_q3_K_impl` with weights).
pub(crate) fn block_q3_k(x: &[f32], qw: &[f32]) -> BlockQ3K {
    let x = &x[..QK_K];
    let sigma2 = 2.0 * sum_sq(x) / QK_K as f32;
    let mut big_l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut sw = [0f32; QK_K / 16];
    for j in 0..QK_K / 16 {
        let xs = &x[16 * j..16 * j + 16];
        let w: [f32; 16] = impl_weights(xs, &qw[16 * j..], sigma2);
        let mut sumw = 0f32;
        for &v in &w {
            sumw += v;
        }
        sw[j] = sumw;
        scales[j] = make_qx_quants_rmse1(4, xs, &mut big_l[16 * j..16 * j + 16], Some(&w));
    }
    let mut ls = [0i8; QK_K / 16];
    let d_block = make_qx_quants_rmse1(32, &scales, &mut ls, Some(&sw));
    let mut b = BlockQ3K {
        hmask: [0; QK_K / 8],
        qs: [0; QK_K / 4],
        scales: [0; 12],
        d: f32_to_f16_bytes(d_block),
    };
    for (j, &l) in ls.iter().enumerate() {
        let l = l as u8;
        if j < 8 {
            b.scales[j] = l & 0xF;
        } else {
            b.scales[j - 8] |= (l & 0xF) << 4;
        }
        let l = l >> 4;
        b.scales[j % 4 + 8] |= l << (2 * (j / 4));
    }
    q3_k_finish(x, &mut b, &mut big_l);
    b
}

/// The sub-block fits of weighted Q4_K and Q5_K, then their scales packed: returns
/// (d, dmin, scales) and leaves the requantized quants in `big_l`.
fn k_weighted(
    x: &[f32],
    qw: &[f32],
    nmax: i32,
    clamp63: bool,
    big_l: &mut [u8; QK_K],
) -> ([u8; 2], [u8; 2], [u8; 12]) {
    let sigma2 = 2.0 * sum_sq(x) / QK_K as f32;
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut sw = [0f32; 8];
    for j in 0..QK_K / 32 {
        let xs: &[f32; 32] = x[32 * j..32 * j + 32].try_into().expect("32 values");
        let w: [f32; 32] = impl_weights(xs, &qw[32 * j..], sigma2);
        let mut sumw = 0f32;
        for &v in &w {
            sumw += v;
        }
        sw[j] = sumw;
        let l: &mut [u8; 32] = (&mut big_l[32 * j..32 * j + 32])
            .try_into()
            .expect("32 quants");
        (scales[j], mins[j]) = make_qkx3_quants(nmax, xs, &w, l);
    }
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let d_block = make_qp_quants(63, &scales, &mut ls, &sw);
    let m_block = make_qp_quants(63, &mins, &mut lm, &sw);
    if clamp63 {
        // Q5_K clamps what Q4_K packs as is
        ls = ls.map(|v| v.min(63));
        lm = lm.map(|v| v.min(63));
    }
    let sc = k_pack_scales(&ls, &lm);
    let d = f32_to_f16_bytes(d_block);
    let dmin = f32_to_f16_bytes(m_block);
    k_requant(x, d, dmin, &sc, nmax, big_l);
    (d, dmin, sc)
}

/// One Q4_K super-block (`quantize_row_q4_K_impl` with weights).
pub(crate) fn block_q4_k(x: &[f32], qw: &[f32]) -> BlockQ4K {
    let mut big_l = [0u8; QK_K];
    let (d, dmin, sc) = k_weighted(&x[..QK_K], qw, 15, false, &mut big_l);
    q4_k_store(d, dmin, sc, &big_l)
}

/// One Q5_K super-block (`quantize_row_q5_K_impl` with weights).
pub(crate) fn block_q5_k(x: &[f32], qw: &[f32]) -> BlockQ5K {
    let mut big_l = [0u8; QK_K];
    let (d, dmin, sc) = k_weighted(&x[..QK_K], qw, 31, true, &mut big_l);
    q5_k_store(d, dmin, sc, &big_l)
}

/// One Q6_K super-block (`quantize_row_q6_K_impl` with weights: the importance weights
/// themselves, without `sigma2`).
pub(crate) fn block_q6_k(x: &[f32], qw: &[f32]) -> BlockQ6K {
    q6_k_block(x, Some(&qw[..QK_K]))
}
