//! K-quant reference quantizers, byte-identical to ggml's `quantize_row_q{2..6}_K_ref`
//! (llama.cpp's ggml/src/ggml-quants.c, the path `ggml_quantize_chunk` takes without an
//! importance matrix): the same f32 operations in the same order (no fused multiply-adds,
//! as ggml-base is built), `nearest_int`'s round-half-to-even trick, C's integer narrowing
//! (`as u8` / `as i8` wrap like the C casts), f16 narrowing with round-to-nearest-even.
//!
//! NaN or infinite inputs give unspecified (but memory-safe, panic-free) blocks, as in ggml.

use crate::blocks::*;
use crate::quant::signed_absmax;

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this is all zero.
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: rounds half to even for `|fval| <= 4194303` (adds 1.5 * 2^23 and
/// reads the mantissa). Outside that range (or for NaN) ggml asserts in debug builds; here,
/// as in its release builds, the result is a garbage value that callers clamp.
#[inline(always)]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12582912.0f32;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `make_qx_quants` with `rmse_type == 1`: weights `qw` (an importance matrix's, as
/// the `quantize_row_*_impl` pass them) or, without, `x[i]^2` (`quantize_row_q6_K_ref`).
/// Writes `L[i]` in `0..2 * nmax` and returns the scale.
pub(crate) fn make_qx_quants_rmse1(
    nmax: i32,
    x: &[f32],
    big_l: &mut [i8],
    qw: Option<&[f32]>,
) -> f32 {
    let weight = |i: usize, v: f32| match qw {
        Some(w) => w[i],
        None => v * v,
    };
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        big_l.fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for (i, (o, &v)) in big_l.iter_mut().zip(x).enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *o = (l + nmax) as i8;
        let w = weight(i, v);
        let lf = l as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for (i, &v) in x.iter().enumerate() {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            let w = weight(i, v);
            let lf = l as f32;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in big_l.iter_mut().zip(x) {
                let l = nearest_int(iscale * v);
                *o = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse == true`. Writes `L[i]` in `0..2 * nmax` (all zero
/// for an all-zero group) and returns the scale.
fn make_q3_quants(nmax: i32, x: &[f32], big_l: &mut [i8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        big_l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for (o, &v) in big_l.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *o = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (o, &v) in big_l.iter_mut().zip(x) {
            let w = v * v;
            let li = *o as f32;
            let mut slx = sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *o as i32 {
                    let nl = new_l as f32;
                    slx += w * v * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *o = new_l as i8;
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
    for o in big_l.iter_mut() {
        *o += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// The smallest and largest of `x`, the sum of `weights` and the weighted sum of `x`, in
/// ggml's order (the opening pass of `make_qkx2_quants` and `make_qkx3_quants`).
pub(crate) fn weighted_range<const N: usize>(
    x: &[f32; N],
    weights: &[f32; N],
) -> (f32, f32, f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..N {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    (min, max, sum_w, sum_x)
}

/// Parameters of one `make_qkx2_quants` search.
struct Qkx2 {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
}

/// ggml's `make_qkx2_quants`: fits `x ≈ scale * L - the_min` with `L` in `0..=nmax`,
/// trying `nstep + 1` scales; returns `(scale, the_min)`. `N` is 16 or 32 (fixed, so that
/// the loops have no bounds checks).
fn make_qkx2_quants<const N: usize>(
    p: &Qkx2,
    x: &[f32; N],
    weights: &[f32; N],
    big_l: &mut [u8; N],
) -> (f32, f32) {
    let nmax = p.nmax;
    let mut laux = [0u8; N];
    let (mut min, max, sum_w, sum_x) = weighted_range(x, weights);
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        big_l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..N {
        let l = nearest_int(iscale * (x[i] - min));
        big_l[i] = l.clamp(0, nmax) as u8;
        let mut diff = scale * big_l[i] as f32 + min - x[i];
        diff = if p.use_mad { diff.abs() } else { diff * diff };
        best_error += weights[i] * diff;
    }
    if p.nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max - min);
        for i in 0..N {
            laux[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        }
        let mut sum_l = 0f32;
        let mut sum_l2 = 0f32;
        let mut sum_xl = 0f32;
        for i in 0..N {
            let w = weights[i];
            let lf = laux[i] as f32;
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
            let mut cur_error = 0f32;
            for i in 0..N {
                let mut diff = this_scale * laux[i] as f32 + this_min - x[i];
                diff = if p.use_mad { diff.abs() } else { diff * diff };
                cur_error += weights[i] * diff;
            }
            if cur_error < best_error {
                *big_l = laux;
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Quantizes 256 values to Q2_K (`quantize_row_q2_K_ref`).
pub fn quantize_block_q2_k(x: &[f32]) -> BlockQ2K {
    let x = &x[..QK_K];
    let mut big_l = [0u8; QK_K];
    let mut weights = [0f32; 16];
    let mut mins = [0f32; QK_K / 16];
    let mut scales = [0f32; QK_K / 16];
    let q4scale = 15.0f32;
    let p = Qkx2 {
        nmax: 3,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
    };
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..QK_K / 16 {
        let xs: &[f32; 16] = x[16 * j..16 * j + 16].try_into().expect("16 values");
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let (s, m) = make_qkx2_quants(
            &p,
            xs,
            &weights,
            (&mut big_l[16 * j..16 * j + 16])
                .try_into()
                .expect("16 quants"),
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let mut b = BlockQ2K {
        scales: [0; QK_K / 16],
        qs: [0; QK_K / 4],
        d: [0; 2],
        dmin: [0; 2],
    };
    if max_scale > 0.0 {
        let iscale = q4scale / max_scale;
        for (o, &s) in b.scales.iter_mut().zip(&scales) {
            *o = nearest_int(iscale * s) as u8;
        }
        b.d = f32_to_f16_bytes(max_scale / q4scale);
    } else {
        b.d = f32_to_f16_bytes(0.0);
    }
    if max_min > 0.0 {
        let iscale = q4scale / max_min;
        for (o, &m) in b.scales.iter_mut().zip(&mins) {
            let l = nearest_int(iscale * m);
            *o |= (l << 4) as u8;
        }
        b.dmin = f32_to_f16_bytes(max_min / q4scale);
    } else {
        b.dmin = f32_to_f16_bytes(0.0);
    }
    let (bd, bdmin) = (f16_bytes_to_f32(b.d), f16_bytes_to_f32(b.dmin));
    for j in 0..QK_K / 16 {
        let d = bd * (b.scales[j] & 0xF) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = bdmin * (b.scales[j] >> 4) as f32;
        for ii in 0..16 {
            let l = nearest_int((x[16 * j + ii] + dm) / d);
            big_l[16 * j + ii] = l.clamp(0, 3) as u8;
        }
    }
    b.qs = pack_2bit(&big_l);
    b
}

/// Packs 256 two-bit quants as Q2_K and Q3_K store them: four 32-apart values per byte.
pub(crate) fn pack_2bit(big_l: &[u8; QK_K]) -> [u8; QK_K / 4] {
    let mut qs = [0u8; QK_K / 4];
    for j in (0..QK_K).step_by(128) {
        for l in 0..32 {
            qs[j / 4 + l] = big_l[j + l]
                | (big_l[j + l + 32] << 2)
                | (big_l[j + l + 64] << 4)
                | (big_l[j + l + 96] << 6);
        }
    }
    qs
}

/// Quantizes 256 values to Q3_K (`quantize_row_q3_K_ref`).
pub fn quantize_block_q3_k(x: &[f32]) -> BlockQ3K {
    let x = &x[..QK_K];
    let mut big_l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    for j in 0..QK_K / 16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut big_l[16 * j..16 * j + 16]);
    }
    let max_scale = signed_absmax(&scales);
    let mut b = BlockQ3K {
        hmask: [0; QK_K / 8],
        qs: [0; QK_K / 4],
        scales: [0; 12],
        d: [0; 2],
    };
    if max_scale != 0.0 {
        let iscale = -32.0f32 / max_scale;
        for (j, &s) in scales.iter().enumerate() {
            let l = nearest_int(iscale * s) as i8;
            let l = (l.clamp(-32, 31) + 32) as u8;
            if j < 8 {
                b.scales[j] = l & 0xF;
            } else {
                b.scales[j - 8] |= (l & 0xF) << 4;
            }
            let l = l >> 4;
            b.scales[j % 4 + 8] |= l << (2 * (j / 4));
        }
        b.d = f32_to_f16_bytes(1.0 / iscale);
    } else {
        b.d = f32_to_f16_bytes(0.0);
    }
    q3_k_finish(x, &mut b, &mut big_l);
    b
}

/// The end of Q3_K once `b.scales` and `b.d` are set: requantizes each sub-block with its
/// packed scale (a zero scale keeps the first-guess quants `big_l`, in `0..8`), then stores
/// the high bits in `hmask` and the low two in `qs`.
pub(crate) fn q3_k_finish(x: &[f32], b: &mut BlockQ3K, big_l: &mut [i8; QK_K]) {
    let bd = f16_bytes_to_f32(b.d);
    let sc = q3k_scales(&b.scales);
    for j in 0..QK_K / 16 {
        let d = bd * sc[j] as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
            big_l[16 * j + ii] = (l + 4) as i8;
        }
    }
    let mut m = 0usize;
    let mut hm = 1u8;
    for l in big_l.iter_mut() {
        if *l > 3 {
            b.hmask[m] |= hm;
            *l -= 4;
        }
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm = hm.wrapping_shl(1);
        }
    }
    b.qs = pack_2bit(&big_l.map(|v| v as u8));
}

/// The sub-block fits of Q4_K and Q5_K: eight groups of 32 with weights
/// `sqrt(mean(x^2)) + |x|`; returns (scales, mins) and leaves the first-guess quants in `big_l`.
fn k_subblocks(x: &[f32], p: &Qkx2, big_l: &mut [u8; QK_K]) -> ([f32; 8], [f32; 8]) {
    let mut xs = [[0f32; 32]; 8];
    let mut weights = [[0f32; 32]; 8];
    for (j, (xj, wj)) in xs.iter_mut().zip(&mut weights).enumerate() {
        xj.copy_from_slice(&x[32 * j..32 * j + 32]);
        let mut sum_x2 = 0f32;
        for &v in xj.iter() {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in wj.iter_mut().zip(xj.iter()) {
            *w = av_x + v.abs();
        }
    }
    make_qkx2_quants_x8(p, &xs, &weights, big_l)
}

/// [`make_qkx2_quants`] of eight sub-blocks of 32 at once (`big_l[32 * s..]`: sub-block `s`),
/// bit for bit: every sum of sub-block `s` is taken in the same order as there, in lane `s`.
/// The single search is latency-bound on its sequential float sums (three chains of 32 adds
/// per tried scale, 21 scales); eight independent lanes overlap them (and vectorize), which
/// reordering one sub-block's sums would not allow without changing the result.
fn make_qkx2_quants_x8(
    p: &Qkx2,
    x: &[[f32; 32]; 8],
    weights: &[[f32; 32]; 8],
    big_l: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]) {
    const N: usize = 32;
    let nmax = p.nmax;
    // lane-major copies: [i][s]
    let mut xt = [[0f32; 8]; N];
    let mut wt = [[0f32; 8]; N];
    for s in 0..8 {
        for i in 0..N {
            xt[i][s] = x[s][i];
            wt[i][s] = weights[s][i];
        }
    }
    let (mut min, mut max, mut sum_w, mut sum_x) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
    for s in 0..8 {
        (min[s], max[s], sum_w[s], sum_x[s]) = weighted_range(&x[s], &weights[s]);
        if min[s] > 0.0 {
            min[s] = 0.0;
        }
    }
    let flat: [bool; 8] = std::array::from_fn(|s| max[s] == min[s]);
    let mut scale = [0f32; 8];
    let mut best_error = [0f32; 8];
    let mut best = [[0u8; 8]; N];
    for s in 0..8 {
        if flat[s] {
            continue;
        }
        let iscale = nmax as f32 / (max[s] - min[s]);
        scale[s] = 1.0 / iscale;
        for i in 0..N {
            let l = nearest_int(iscale * (xt[i][s] - min[s])).clamp(0, nmax) as u8;
            best[i][s] = l;
            let mut diff = scale[s] * l as f32 + min[s] - xt[i][s];
            diff = if p.use_mad { diff.abs() } else { diff * diff };
            best_error[s] += wt[i][s] * diff;
        }
    }
    if p.nstep >= 1 {
        let mut laux = [[0u8; 8]; N];
        for is in 0..=p.nstep {
            let iscale: [f32; 8] = std::array::from_fn(|s| {
                (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max[s] - min[s])
            });
            for i in 0..N {
                for s in 0..8 {
                    laux[i][s] = nearest_int(iscale[s] * (xt[i][s] - min[s])).clamp(0, nmax) as u8;
                }
            }
            let (mut sum_l, mut sum_l2, mut sum_xl) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            for i in 0..N {
                for s in 0..8 {
                    let w = wt[i][s];
                    let lf = laux[i][s] as f32;
                    sum_l[s] += w * lf;
                    sum_l2[s] += w * lf * lf;
                    sum_xl[s] += w * lf * xt[i][s];
                }
            }
            let mut this_scale = [0f32; 8];
            let mut this_min = [0f32; 8];
            let mut fits = [false; 8];
            for s in 0..8 {
                let d = sum_w[s] * sum_l2[s] - sum_l[s] * sum_l[s];
                fits[s] = d > 0.0 && !flat[s];
                this_scale[s] = (sum_w[s] * sum_xl[s] - sum_x[s] * sum_l[s]) / d;
                this_min[s] = (sum_l2[s] * sum_x[s] - sum_l[s] * sum_xl[s]) / d;
                if this_min[s] > 0.0 {
                    this_min[s] = 0.0;
                    this_scale[s] = sum_xl[s] / sum_l2[s];
                }
            }
            let mut cur_error = [0f32; 8];
            for i in 0..N {
                for s in 0..8 {
                    let mut diff = this_scale[s] * laux[i][s] as f32 + this_min[s] - xt[i][s];
                    diff = if p.use_mad { diff.abs() } else { diff * diff };
                    cur_error[s] += wt[i][s] * diff;
                }
            }
            for s in 0..8 {
                if fits[s] && cur_error[s] < best_error[s] {
                    for i in 0..N {
                        best[i][s] = laux[i][s];
                    }
                    best_error[s] = cur_error[s];
                    scale[s] = this_scale[s];
                    min[s] = this_min[s];
                }
            }
        }
    }
    // a flat lane kept its zero scale and quants: its first pass and every update skip it
    for s in 0..8 {
        for i in 0..N {
            big_l[32 * s + i] = best[i][s];
        }
    }
    (scale, min.map(|m| -m))
}

/// Packs the eight 6-bit scales and mins of Q4_K/Q5_K and requantizes each sub-block with
/// the packed (rounded) scales, `L` in `0..=nmax`; returns (d, dmin, scales).
fn k_pack_requant(
    x: &[f32],
    scales: &[f32; 8],
    mins: &[f32; 8],
    nmax: i32,
    big_l: &mut [u8; QK_K],
) -> ([u8; 2], [u8; 2], [u8; 12]) {
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0f32 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 {
        63.0f32 / max_min
    } else {
        0.0
    };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..QK_K / 32 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let q = k_pack_scales(&ls, &lm);
    let d = f32_to_f16_bytes(max_scale / 63.0);
    let dmin = f32_to_f16_bytes(max_min / 63.0);
    k_requant(x, d, dmin, &q, nmax, big_l);
    (d, dmin, q)
}

/// Packs the eight 6-bit scales and mins of Q4_K/Q5_K as ggml does (C's `uint8_t`
/// arithmetic: bits shifted past the byte are lost).
pub(crate) fn k_pack_scales(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..QK_K / 32 {
        let (ls, lm) = (ls[j], lm[j]);
        if j < 4 {
            q[j] = ls;
            q[j + 4] = lm;
        } else {
            q[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            q[j - 4] |= (ls >> 4) << 6;
            q[j] |= (lm >> 4) << 6;
        }
    }
    q
}

/// Requantizes each sub-block of Q4_K/Q5_K with the packed (rounded) scales `q` and the
/// f16 super-block scales, `L` in `0..=nmax` (a sub-block whose scale is zero keeps its
/// first-guess quants).
pub(crate) fn k_requant(
    x: &[f32],
    d: [u8; 2],
    dmin: [u8; 2],
    q: &[u8; 12],
    nmax: i32,
    big_l: &mut [u8; QK_K],
) {
    let (df, dminf) = (f16_bytes_to_f32(d), f16_bytes_to_f32(dmin));
    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, q);
        let d = df * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dminf * m as f32;
        for ii in 0..32 {
            let l = nearest_int((x[32 * j + ii] + dm) / d);
            big_l[32 * j + ii] = l.clamp(0, nmax) as u8;
        }
    }
}

/// Quantizes 256 values to Q4_K (`quantize_row_q4_K_ref`).
pub fn quantize_block_q4_k(x: &[f32]) -> BlockQ4K {
    let x = &x[..QK_K];
    let mut big_l = [0u8; QK_K];
    let p = Qkx2 {
        nmax: 15,
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    let (scales, mins) = k_subblocks(x, &p, &mut big_l);
    let (d, dmin, sc) = k_pack_requant(x, &scales, &mins, 15, &mut big_l);
    q4_k_store(d, dmin, sc, &big_l)
}

/// A Q4_K block of these scales and quants (`L` in `0..16`).
pub(crate) fn q4_k_store(d: [u8; 2], dmin: [u8; 2], sc: [u8; 12], big_l: &[u8; QK_K]) -> BlockQ4K {
    let mut qs = [0u8; QK_K / 2];
    for (n, q) in (0..QK_K).step_by(64).zip(qs.chunks_exact_mut(32)) {
        for l in 0..32 {
            q[l] = big_l[n + l] | (big_l[n + l + 32] << 4);
        }
    }
    BlockQ4K {
        d,
        dmin,
        scales: sc,
        qs,
    }
}

/// Quantizes 256 values to Q5_K (`quantize_row_q5_K_ref`).
pub fn quantize_block_q5_k(x: &[f32]) -> BlockQ5K {
    let x = &x[..QK_K];
    let mut big_l = [0u8; QK_K];
    let p = Qkx2 {
        nmax: 31,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    let (scales, mins) = k_subblocks(x, &p, &mut big_l);
    let (d, dmin, sc) = k_pack_requant(x, &scales, &mins, 31, &mut big_l);
    q5_k_store(d, dmin, sc, &big_l)
}

/// A Q5_K block of these scales and quants (`L` in `0..32`).
pub(crate) fn q5_k_store(d: [u8; 2], dmin: [u8; 2], sc: [u8; 12], big_l: &[u8; QK_K]) -> BlockQ5K {
    let mut qh = [0u8; QK_K / 8];
    let mut qs = [0u8; QK_K / 2];
    let (mut m1, mut m2) = (1u8, 2u8);
    for (n, ql) in (0..QK_K).step_by(64).zip(qs.chunks_exact_mut(32)) {
        for j in 0..32 {
            let mut l1 = big_l[n + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = big_l[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = l1 | (l2 << 4);
        }
        m1 = m1.wrapping_shl(2);
        m2 = m2.wrapping_shl(2);
    }
    BlockQ5K {
        d,
        dmin,
        scales: sc,
        qh,
        qs,
    }
}

/// Quantizes 256 values to Q6_K (`quantize_row_q6_K_ref`).
pub fn quantize_block_q6_k(x: &[f32]) -> BlockQ6K {
    q6_k_block(x, None)
}

/// Q6_K with or without an importance matrix's weights for these 256 values
/// (`quantize_row_q6_K_impl`, which passes them straight to `make_qx_quants`; the
/// unweighted path is `quantize_row_q6_K_ref`'s).
pub(crate) fn q6_k_block(x: &[f32], qw: Option<&[f32]>) -> BlockQ6K {
    let x = &x[..QK_K];
    let mut big_l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for ib in 0..QK_K / 16 {
        let scale = make_qx_quants_rmse1(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut big_l[16 * ib..16 * ib + 16],
            qw.map(|w| &w[16 * ib..16 * ib + 16]),
        );
        scales[ib] = scale;
        let abs_scale = scale.abs();
        if abs_scale > max_abs_scale {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    let mut b = BlockQ6K {
        ql: [0; QK_K / 2],
        qh: [0; QK_K / 4],
        scales: [0; QK_K / 16],
        d: f32_to_f16_bytes(0.0),
    };
    if max_abs_scale < GROUP_MAX_EPS {
        return b;
    }
    let iscale = -128.0f32 / max_scale;
    b.d = f32_to_f16_bytes(1.0 / iscale);
    for (o, &s) in b.scales.iter_mut().zip(&scales) {
        *o = nearest_int(iscale * s).min(127) as i8;
    }
    let bd = f16_bytes_to_f32(b.d);
    for j in 0..QK_K / 16 {
        let d = bd * b.scales[j] as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            big_l[16 * j + ii] = (l + 32) as i8;
        }
    }
    let u = |v: i8| v as u8;
    for (j, (ql, qh)) in (0..QK_K)
        .step_by(128)
        .zip(b.ql.chunks_exact_mut(64).zip(b.qh.chunks_exact_mut(32)))
    {
        for l in 0..32 {
            let q1 = u(big_l[j + l]) & 0xF;
            let q2 = u(big_l[j + l + 32]) & 0xF;
            let q3 = u(big_l[j + l + 64]) & 0xF;
            let q4 = u(big_l[j + l + 96]) & 0xF;
            ql[l] = q1 | (q3 << 4);
            ql[l + 32] = q2 | (q4 << 4);
            qh[l] = (u(big_l[j + l]) >> 4)
                | ((u(big_l[j + l + 32]) >> 4) << 2)
                | ((u(big_l[j + l + 64]) >> 4) << 4)
                | ((u(big_l[j + l + 96]) >> 4) << 6);
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eight-lane search gives each sub-block exactly what the single search gives it
    /// (scale, min and quants, bit for bit), for Q4_K's and Q5_K's parameters, on random
    /// sub-blocks, all-equal ones (the early return), all-positive ones (the min clamped to
    /// 0) and ones with a huge outlier.
    #[test]
    fn eight_lane_search_equals_the_single_search_bit_for_bit() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let params = [
            Qkx2 {
                nmax: 15,
                rmin: -1.0,
                rdelta: 0.1,
                nstep: 20,
                use_mad: false,
            },
            Qkx2 {
                nmax: 31,
                rmin: -0.5,
                rdelta: 0.1,
                nstep: 15,
                use_mad: false,
            },
        ];
        for round in 0..200 {
            let mut xs = [[0f32; 32]; 8];
            let mut ws = [[0f32; 32]; 8];
            for (s, (x, w)) in xs.iter_mut().zip(&mut ws).enumerate() {
                for (v, wv) in x.iter_mut().zip(w.iter_mut()) {
                    *v = next() * 0.05;
                    *wv = next().abs() + 0.01;
                }
                match (round + s) % 11 {
                    0 => *x = [0.25; 32],
                    1 => x.iter_mut().for_each(|v| *v = v.abs() + 0.1),
                    2 => x[5] = 40.0,
                    3 => *x = [0.0; 32],
                    _ => {}
                }
            }
            for p in &params {
                let mut got_l = [0u8; QK_K];
                let (scales, mins) = make_qkx2_quants_x8(p, &xs, &ws, &mut got_l);
                for s in 0..8 {
                    let mut want_l = [0u8; 32];
                    let (sc, m) = make_qkx2_quants(p, &xs[s], &ws[s], &mut want_l);
                    assert_eq!(sc.to_bits(), scales[s].to_bits(), "round {round} lane {s}");
                    assert_eq!(m.to_bits(), mins[s].to_bits(), "round {round} lane {s}");
                    assert_eq!(
                        &got_l[32 * s..32 * s + 32],
                        &want_l,
                        "round {round} lane {s}"
                    );
                }
            }
        }
    }
}
