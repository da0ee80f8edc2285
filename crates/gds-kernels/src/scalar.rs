//! Portable reference kernels: one weight row against one activation row, plainly written.
//! The SIMD kernels in other modules must agree with these (see the tests in
//! `tests/it/kernels.rs`).
//!
//! Each `rows_*` function takes `nrows` consecutive weight rows of `rb` bytes in `w`, the
//! activation rows of the tokens in `acts`, and writes `out[r * acts.len() + t]`.

use crate::act::{ActQ8, ActQ8K};
use crate::blocks::*;
use half::{bf16, f16};
use zerocopy::{FromBytes, Immutable, KnownLayout, Unaligned};

/// Runs `dot` over every (row, token) pair.
#[inline(always)]
fn rows<B, A>(w: &[u8], rb: usize, acts: &[&[A]], out: &mut [f32], dot: impl Fn(&[B], &[A]) -> f32)
where
    B: FromBytes + Immutable + KnownLayout + Unaligned,
{
    let nt = acts.len();
    for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(nt)) {
        let blocks = cast::<B>(row).expect("weight rows are whole blocks");
        for (y, a) in o.iter_mut().zip(acts) {
            *y = dot(blocks, a);
        }
    }
}

/// Sum of `u[i] * a[i]` over 32 unsigned weight quants and 32 activation quants.
#[inline(always)]
fn idot32(u: &[u8; QK], a: &[i8; QK]) -> i32 {
    u.iter().zip(a).map(|(&w, &x)| w as i32 * x as i32).sum()
}

/// The 32 nibbles of a Q4 block, element order.
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [u8; QK] {
    let mut u = [0u8; QK];
    for j in 0..16 {
        u[j] = qs[j] & 0xF;
        u[j + 16] = qs[j] >> 4;
    }
    u
}

/// The 32 five-bit quants of a Q5 block, element order.
#[inline(always)]
fn fives(qs: &[u8; 16], qh: [u8; 4]) -> [u8; QK] {
    let h = u32::from_le_bytes(qh);
    let mut u = nibbles(qs);
    for (j, v) in u.iter_mut().enumerate() {
        *v |= (((h >> j) & 1) << 4) as u8;
    }
    u
}

/// Pairs every weight block with its activation block: (block, quants, d, s).
#[inline(always)]
fn act_blocks<'a, B>(
    w: &'a [B],
    a: &'a [ActQ8],
) -> impl Iterator<Item = (&'a B, [i8; QK], f32, f32)> {
    w.iter().enumerate().map(move |(i, b)| {
        let (q, d, s) = a[i / 2].block(i % 2);
        (b, q, d, s)
    })
}

fn dot_q4_0(w: &[BlockQ4_0], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, s) in act_blocks(w, a) {
        let i = idot32(&nibbles(&b.qs), &q);
        acc += b.d() * (d * i as f32 - 8.0 * s);
    }
    acc
}

fn dot_q4_1(w: &[BlockQ4_1], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, s) in act_blocks(w, a) {
        let i = idot32(&nibbles(&b.qs), &q);
        acc += b.d() * d * i as f32 + b.m() * s;
    }
    acc
}

fn dot_q5_0(w: &[BlockQ5_0], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, s) in act_blocks(w, a) {
        let i = idot32(&fives(&b.qs, b.qh), &q);
        acc += b.d() * (d * i as f32 - 16.0 * s);
    }
    acc
}

fn dot_q5_1(w: &[BlockQ5_1], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, s) in act_blocks(w, a) {
        let i = idot32(&fives(&b.qs, b.qh), &q);
        acc += b.d() * d * i as f32 + b.m() * s;
    }
    acc
}

fn dot_q8_0(w: &[BlockQ8_0], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, _) in act_blocks(w, a) {
        let i: i32 =
            b.qs.iter()
                .zip(&q)
                .map(|(&p, &q)| p as i32 * q as i32)
                .sum();
        acc += b.d() * d * i as f32;
    }
    acc
}

fn dot_mxfp4(w: &[BlockMxfp4], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, _) in act_blocks(w, a) {
        acc += b.d() * d * idot_table(&b.qs, &q, &KVALUES_MXFP4) as f32;
    }
    acc
}

/// `sum(table[n] * q)` over 16 nibble bytes (element `j` low, `j + 16` high): the integer
/// dot product of the table types (MXFP4, IQ4_NL, IQ4_XS's sub-blocks).
fn idot_table(qs: &[u8], q: &[i8; QK], table: &[i8; 16]) -> i32 {
    let mut i = 0i32;
    for (j, &n) in qs.iter().enumerate() {
        i += table[(n & 0xF) as usize] as i32 * q[j] as i32;
        i += table[(n >> 4) as usize] as i32 * q[j + 16] as i32;
    }
    i
}

fn dot_iq4_nl(w: &[BlockIq4Nl], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q, d, _) in act_blocks(w, a) {
        acc += b.d() * d * idot_table(&b.qs, &q, &KVALUES_IQ4NL) as f32;
    }
    acc
}

fn dot_iq4_xs(w: &[BlockIq4Xs], a: &[ActQ8]) -> f32 {
    let mut acc = 0.0f32;
    for (k, b) in w.iter().enumerate() {
        for s in 0..QK_K / QK {
            let at = k * (QK_K / QK) + s;
            let (q, d, _) = a[at / 2].block(at % 2);
            let dl = b.d() * b.sub_scale(s) as f32;
            acc += dl * d * idot_table(&b.qs[16 * s..16 * s + 16], &q, &KVALUES_IQ4NL) as f32;
        }
    }
    acc
}

/// Q2_K: `x = d * sc * q - dmin * m` per 16 elements, `q` in 0..4. As ggml's
/// `vec_dot_q2_K_q8_K`: the integer sums of `sc * q * a` and of `m * bsum`, each scaled once.
fn dot_q2_k(w: &[BlockQ2K], a: &[ActQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in w.iter().zip(a) {
        let (mut isum, mut msum) = (0i32, 0i32);
        for sub in 0..16 {
            let sc = b.scales[sub];
            let s: i32 = (sub * 16..sub * 16 + 16)
                .map(|e| b.q(e) as i32 * x.qs[e] as i32)
                .sum();
            isum += (sc & 0xF) as i32 * s;
            msum += (sc >> 4) as i32 * x.bsums[sub] as i32;
        }
        acc += b.d() * x.d * isum as f32 - b.dmin() * x.d * msum as f32;
    }
    acc
}

/// Q3_K: `x = d * sc * q` per 16 elements, `q` in -4..4 (two low bits, minus 4 where the
/// high bit is clear), `sc` 6-bit signed. The integer sum of `sc * q * a`, scaled once.
fn dot_q3_k(w: &[BlockQ3K], a: &[ActQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in w.iter().zip(a) {
        let scales = q3k_scales(&b.scales);
        let mut isum = 0i32;
        for (sub, &sc) in scales.iter().enumerate() {
            let s: i32 = (sub * 16..sub * 16 + 16)
                .map(|e| b.q(e) as i32 * x.qs[e] as i32)
                .sum();
            isum += sc as i32 * s;
        }
        acc += b.d() * x.d * isum as f32;
    }
    acc
}

fn dot_q4_k(w: &[BlockQ4K], a: &[ActQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in w.iter().zip(a) {
        let (mut isum, mut msum) = (0i32, 0i32);
        for sub in 0..8 {
            let (sc, m) = scale_min_k4(sub, &b.scales);
            let (chunk, shift) = (sub / 2, 4 * (sub % 2));
            let s: i32 = (0..32)
                .map(|l| ((b.qs[chunk * 32 + l] >> shift) & 0xF) as i32 * x.qs[sub * 32 + l] as i32)
                .sum();
            isum += sc as i32 * s;
            msum += m as i32 * (x.bsums[2 * sub] as i32 + x.bsums[2 * sub + 1] as i32);
        }
        acc += b.d() * x.d * isum as f32 - b.dmin() * x.d * msum as f32;
    }
    acc
}

fn dot_q5_k(w: &[BlockQ5K], a: &[ActQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in w.iter().zip(a) {
        let (mut isum, mut msum) = (0i32, 0i32);
        for sub in 0..8 {
            let (sc, m) = scale_min_k4(sub, &b.scales);
            let (chunk, shift) = (sub / 2, 4 * (sub % 2));
            let s: i32 = (0..32)
                .map(|l| {
                    let q = ((b.qs[chunk * 32 + l] >> shift) & 0xF) | (((b.qh[l] >> sub) & 1) << 4);
                    q as i32 * x.qs[sub * 32 + l] as i32
                })
                .sum();
            isum += sc as i32 * s;
            msum += m as i32 * (x.bsums[2 * sub] as i32 + x.bsums[2 * sub + 1] as i32);
        }
        acc += b.d() * x.d * isum as f32 - b.dmin() * x.d * msum as f32;
    }
    acc
}

fn dot_q6_k(w: &[BlockQ6K], a: &[ActQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in w.iter().zip(a) {
        let mut isum = 0i32;
        for sub in 0..16 {
            let mut s = 0i32;
            for e in sub * 16..sub * 16 + 16 {
                let (half, r) = (e / 128, e % 128);
                let low = (b.ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
                let high = (b.qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
                s += ((low | (high << 4)) as i32 - 32) * x.qs[e] as i32;
            }
            isum += b.scales[sub] as i32 * s;
        }
        acc += b.d() * x.d * isum as f32;
    }
    acc
}

fn dot_f32(w: &[[u8; 4]], x: &[f32]) -> f32 {
    w.iter()
        .zip(x)
        .map(|(b, &v)| f32::from_le_bytes(*b) * v)
        .sum()
}

fn dot_f16(w: &[[u8; 2]], x: &[f32]) -> f32 {
    w.iter()
        .zip(x)
        .map(|(b, &v)| f16::from_le_bytes(*b).to_f32() * v)
        .sum()
}

fn dot_bf16(w: &[[u8; 2]], x: &[f32]) -> f32 {
    w.iter()
        .zip(x)
        .map(|(b, &v)| bf16::from_le_bytes(*b).to_f32() * v)
        .sum()
}

/// Q4_0 rows.
pub fn rows_q4_0(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q4_0)
}
/// Q4_1 rows.
pub fn rows_q4_1(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q4_1)
}
/// Q5_0 rows.
pub fn rows_q5_0(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q5_0)
}
/// Q5_1 rows.
pub fn rows_q5_1(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q5_1)
}
/// Q8_0 rows.
pub fn rows_q8_0(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q8_0)
}
/// MXFP4 rows.
pub fn rows_mxfp4(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_mxfp4)
}
/// IQ4_NL rows.
pub fn rows_iq4_nl(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_iq4_nl)
}
/// IQ4_XS rows.
pub fn rows_iq4_xs(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_iq4_xs)
}
/// Q2_K rows.
pub fn rows_q2_k(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q2_k)
}
/// Q3_K rows.
pub fn rows_q3_k(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q3_k)
}
/// A grid i-quant row (`iquant.rs`): each block's exact integer sum, scaled once.
fn dot_iq<B: crate::iquant::IqBlock>(w: &[B], a: &[ActQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in w.iter().zip(a) {
        acc += b.d() * x.d * crate::iquant::block_isum(b, &x.qs) as f32;
    }
    B::K * acc
}

macro_rules! iq_rows {
    ($($name:ident: $blk:ty, $what:literal;)*) => {$(
        #[doc = concat!($what, " rows.")]
        pub fn $name(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
            rows(w, rb, acts, out, dot_iq::<$blk>)
        }
    )*};
}
iq_rows! {
    rows_iq2_xxs: BlockIq2Xxs, "IQ2_XXS";
    rows_iq2_xs: BlockIq2Xs, "IQ2_XS";
    rows_iq2_s: BlockIq2S, "IQ2_S";
    rows_iq3_xxs: BlockIq3Xxs, "IQ3_XXS";
    rows_iq3_s: BlockIq3S, "IQ3_S";
    rows_iq1_s: BlockIq1S, "IQ1_S";
    rows_iq1_m: BlockIq1M, "IQ1_M";
}

/// Q4_K rows.
pub fn rows_q4_k(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q4_k)
}
/// Q5_K rows.
pub fn rows_q5_k(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q5_k)
}
/// Q6_K rows.
pub fn rows_q6_k(w: &[u8], rb: usize, acts: &[&[ActQ8K]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_q6_k)
}
/// F32 rows.
pub fn rows_f32(w: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_f32)
}
/// F16 rows.
pub fn rows_f16(w: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_f16)
}
/// BF16 rows.
pub fn rows_bf16(w: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
    rows(w, rb, acts, out, dot_bf16)
}
