//! Block dequantization, written to round exactly as gguf-py's `gguf.quants.dequantize`
//! (same f32 operations in the same order, no fused multiply-add), so results are
//! bit-identical to it.

use crate::blocks::*;
use half::{bf16, f16};

/// Dequantizes whole blocks of one dtype. `out.len()` is `blocks.len() * block_size`.
pub(crate) trait Dequant: Sized {
    /// Elements per block.
    const N: usize;
    /// Writes the `Self::N` values of `self` into `out`.
    fn dequant(&self, out: &mut [f32]);
}

impl Dequant for BlockQ4_0 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        for (j, &b) in self.qs.iter().enumerate() {
            out[j] = d * ((b & 0xF) as i32 - 8) as f32;
            out[j + QK / 2] = d * ((b >> 4) as i32 - 8) as f32;
        }
    }
}

/// 32 values of a table type (MXFP4, IQ4_NL, an IQ4_XS sub-block): `d * table[n]` of the
/// nibbles `qs` (element `j` low, `j + 16` high) into `out`.
#[inline]
fn dequant_table(d: f32, qs: &[u8], table: &[i8; 16], out: &mut [f32]) {
    for (j, &b) in qs.iter().enumerate() {
        out[j] = d * table[(b & 0xF) as usize] as f32;
        out[j + QK / 2] = d * table[(b >> 4) as usize] as f32;
    }
}

impl Dequant for BlockMxfp4 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        dequant_table(self.d(), &self.qs, &KVALUES_MXFP4, out);
    }
}

impl Dequant for BlockIq4Nl {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        dequant_table(self.d(), &self.qs, &KVALUES_IQ4NL, out);
    }
}

impl Dequant for BlockIq4Xs {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        for (i, o) in out[..QK_K].chunks_exact_mut(QK).enumerate() {
            // gguf-py: dl = d * scale (f32), then dl * value
            let dl = d * self.sub_scale(i) as f32;
            dequant_table(dl, &self.qs[16 * i..16 * i + 16], &KVALUES_IQ4NL, o);
        }
    }
}

/// The grid i-quants (`iquant.rs`).
macro_rules! iq_dequant {
    ($($blk:ty),*) => {$(
        impl Dequant for $blk {
            const N: usize = QK_K;
            #[inline]
            fn dequant(&self, out: &mut [f32]) {
                crate::iquant::dequant_block(self, out)
            }
        }
    )*};
}
iq_dequant!(
    BlockIq2Xxs,
    BlockIq2Xs,
    BlockIq2S,
    BlockIq3Xxs,
    BlockIq3S,
    BlockIq1S,
    BlockIq1M
);

impl Dequant for BlockQ4_1 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let (d, m) = (self.d(), self.m());
        for (j, &b) in self.qs.iter().enumerate() {
            out[j] = d * (b & 0xF) as f32 + m;
            out[j + QK / 2] = d * (b >> 4) as f32 + m;
        }
    }
}

impl Dequant for BlockQ5_0 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        let qh = u32::from_le_bytes(self.qh);
        for (j, &b) in self.qs.iter().enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            out[j] = d * (((b & 0xF) as u32 | h0) as i32 - 16) as f32;
            out[j + QK / 2] = d * (((b >> 4) as u32 | h1) as i32 - 16) as f32;
        }
    }
}

impl Dequant for BlockQ5_1 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let (d, m) = (self.d(), self.m());
        let qh = u32::from_le_bytes(self.qh);
        for (j, &b) in self.qs.iter().enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            out[j] = d * ((b & 0xF) as u32 | h0) as f32 + m;
            out[j + QK / 2] = d * ((b >> 4) as u32 | h1) as f32 + m;
        }
    }
}

impl Dequant for BlockQ8_0 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

impl Dequant for BlockQ8_1 {
    const N: usize = QK;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

impl Dequant for BlockQ2K {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d(), self.dmin());
        for (e, o) in out[..QK_K].iter_mut().enumerate() {
            let q = self.q(e);
            let sc = self.scales[e / 16];
            let dl = d * (sc & 0xF) as f32;
            let ml = dmin * (sc >> 4) as f32;
            *o = dl * q as f32 - ml;
        }
    }
}

impl Dequant for BlockQ3K {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        let scales = q3k_scales(&self.scales);
        for (e, o) in out[..QK_K].iter_mut().enumerate() {
            let q = self.q(e);
            let dl = d * scales[e / 16] as f32;
            *o = dl * q as f32;
        }
    }
}

impl Dequant for BlockQ4K {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d(), self.dmin());
        for sub in 0..8 {
            let (sc, m) = scale_min_k4(sub, &self.scales);
            let dl = d * sc as f32;
            let ml = dmin * m as f32;
            let (chunk, shift) = (sub / 2, 4 * (sub % 2));
            for l in 0..32 {
                let q = (self.qs[chunk * 32 + l] >> shift) & 0xF;
                out[sub * 32 + l] = dl * q as f32 - ml;
            }
        }
    }
}

impl Dequant for BlockQ5K {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d(), self.dmin());
        for sub in 0..8 {
            let (sc, m) = scale_min_k4(sub, &self.scales);
            let dl = d * sc as f32;
            let ml = dmin * m as f32;
            let (chunk, shift) = (sub / 2, 4 * (sub % 2));
            for l in 0..32 {
                let low = (self.qs[chunk * 32 + l] >> shift) & 0xF;
                let high = (self.qh[l] >> sub) & 1;
                out[sub * 32 + l] = dl * (low | (high << 4)) as f32 - ml;
            }
        }
    }
}

impl Dequant for BlockQ6K {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        for (e, o) in out[..QK_K].iter_mut().enumerate() {
            let half = e / 128;
            let r = e % 128;
            let low = (self.ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
            let high = (self.qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            let dl = d * self.scales[e / 16] as f32;
            *o = dl * q as f32;
        }
    }
}

impl Dequant for BlockQ8K {
    const N: usize = QK_K;
    #[inline]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * q as f32;
        }
    }
}

/// Dequantizes a block slice into `out` (exactly `blocks.len() * B::N` long).
pub(crate) fn dequant_blocks<B: Dequant>(blocks: &[B], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(B::N)) {
        b.dequant(o);
    }
}

/// Little-endian f32 bytes to f32.
pub(crate) fn f32_from_bytes(src: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Little-endian f16 bytes to f32.
pub(crate) fn f16_from_bytes(src: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

/// Little-endian bf16 bytes to f32.
pub(crate) fn bf16_from_bytes(src: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}
