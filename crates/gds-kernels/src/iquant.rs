//! llama.cpp's grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): every
//! 32-weight group of a 256-weight block as small integers, the one form that the scalar and
//! SIMD dot products and the dequantization all read.
//!
//! A group's weight `j` is `unit * ls[j / 16] * v[j]`, where `v[j] = mag[j] * sign(sgn[j])`
//! is an integer (a grid value, or for IQ1 `8 * grid ± 1`, the shift folded in), `ls` the
//! odd sub-block multiplier `2s + 1` and `unit` the block's scale times the type's constant
//! ([`IqBlock::K`]: 1/8 for the IQ2 and IQ1 types, 1/4 for IQ3_XXS, 1 for IQ3_S). The
//! magnitudes are at most 62 and the multipliers at most 31, so a dot product against 8-bit
//! activations is an exact `i32` per block, in any order, and every kernel gives the same
//! bits: `acc += (d * d_act) * isum` per block, `K * acc` at the end.
//!
//! The grids and the sign table are ggml's (`iq_grids.rs`, generated). Sign bytes are `0x01`
//! (positive) or `0xFF` (negative), so that `_mm256_sign_epi8(act, sgn)` applies them; IQ1's
//! `sgn` is `v` itself (never zero).

use crate::blocks::*;
use crate::iq_grids::*;
use zerocopy::{FromBytes, Immutable, KnownLayout, Unaligned};

/// `SIGN_BYTES[b]`: byte `j` is `0xFF` when bit `j` of `b` is set, else `0x01`.
static SIGN_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut v = 0u64;
        let mut j = 0;
        while j < 8 {
            let byte = if (b >> j) & 1 == 1 { 0xFFu64 } else { 0x01 };
            v |= byte << (8 * j);
            j += 1;
        }
        t[b] = v;
        b += 1;
    }
    t
};

/// `SIGNS7[i]`: the sign bytes of the 7-bit sign index `i` (`KSIGNS_IQ2XS`: the 8th sign is
/// the parity), one lookup.
static SIGNS7: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = SIGN_BYTES[KSIGNS_IQ2XS[i] as usize];
        i += 1;
    }
    t
};

/// The sign bytes of a 7-bit sign index (the low 7 bits of `i`).
#[inline(always)]
pub(crate) fn signs7(i: u32) -> u64 {
    SIGNS7[(i & 127) as usize]
}

/// The sign bytes of 8 stored sign bits.
#[inline(always)]
pub(crate) fn signs8(b: u8) -> u64 {
    SIGN_BYTES[b as usize]
}

/// `IQ1_VALUES[i]`: IQ1's eight values `8 * grid + shift` (bytes, `i8`) of grid row
/// `i & 2047`, the shift 1, or -1 where bit 11 of `i` is set: the stored index and the
/// shift's sign bit make one 12-bit index, and a row of values is one lookup (the shift
/// made apart and added cost IQ1_M's decode kernel about a quarter of its time).
static IQ1_VALUES: [u64; 4096] = {
    let mut t = [0u64; 4096];
    let mut i = 0;
    while i < 4096 {
        let (row, shift) = (IQ1S_GRID[i & 2047], if i & 2048 != 0 { -1i8 } else { 1 });
        let mut v = 0u64;
        let mut j = 0;
        while j < 8 {
            let x = 8 * ((row >> (8 * j)) as u8 as i8) + shift;
            v |= (x as u8 as u64) << (8 * j);
            j += 1;
        }
        t[i] = v;
        i += 1;
    }
    t
};

/// An IQ1 row of values by its 12-bit index (see [`IQ1_VALUES`]).
#[inline(always)]
fn iq1_values(i: usize) -> u64 {
    IQ1_VALUES[i & 4095]
}

/// The absolute values of eight signed bytes in `-127..=127` (SWAR: a negative byte's
/// complement plus one, which carries into no other byte).
#[inline(always)]
fn abs_bytes(v: u64) -> u64 {
    let neg = (v >> 7) & 0x0101_0101_0101_0101;
    (v ^ neg.wrapping_mul(0xFF)) + neg
}

/// One 32-weight group: magnitudes and sign carriers, 8 bytes per word (element `8l + j` in
/// byte `j` of word `l`), and the multipliers of elements 0..16 and 16..32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Group {
    pub mag: [u64; 4],
    pub sgn: [u64; 4],
    pub ls: [i32; 2],
}

impl Group {
    /// Element `e`'s integer value `v`.
    #[inline(always)]
    pub fn v(&self, e: usize) -> i32 {
        let m = (self.mag[e / 8] >> (8 * (e % 8))) as u8 as i32;
        let s = (self.sgn[e / 8] >> (8 * (e % 8))) as u8 as i8;
        m * (s.signum() as i32)
    }
}

/// The little-endian u16 at byte `i` (one load: a slice of two, not two byte loads).
#[inline(always)]
fn u16_at(b: &[u8], i: usize) -> u32 {
    u16::from_le_bytes(b[i..i + 2].try_into().expect("two bytes")) as u32
}

/// The little-endian u32 at byte `i`.
#[inline(always)]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("four bytes"))
}

/// A grid i-quant block. (Table indices are masked to the table's size though they cannot
/// exceed it: the compiler then drops the bounds checks, and with them lookups a SIMD kernel
/// does not use.)
pub(crate) trait IqBlock: FromBytes + Immutable + KnownLayout + Unaligned + Sync {
    /// The dot product's constant factor (see the module's comment).
    const K: f32;
    /// The super-block scale's f16 bytes.
    fn d_bits(&self) -> [u8; 2];
    /// The super-block scale.
    #[inline(always)]
    fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d_bits())
    }
    /// Group `g` (elements `32g..32g + 32`), `g < 8`; for IQ1 ([`Self::EIGHTHS`]) `sgn` is
    /// the values `v` themselves (as [`IQ1_VALUES`] holds them; a SIMD kernel takes their
    /// absolute values itself, and the compiler drops `mag`'s).
    fn raw(&self, g: usize) -> Group;
    /// Group `g`'s 4-bit (IQ1: 3-bit) stored scales of elements 0..16 and 16..32.
    fn raw_scales(&self, g: usize) -> [u32; 2];
    /// The float factor of a weight of sub-block scale `s` as gguf-py and ggml compute it
    /// from the super-block scale `d` (the weight is this times `v`, or `v / 8` for IQ1).
    fn dequant_scale(d: f32, s: u32) -> f32;
    /// True for IQ1_S/IQ1_M, whose `v` is eight times the weight's grid value plus shift.
    const EIGHTHS: bool = false;
    /// Keep the SIMD decode kernel's loop over a block's eight groups rolled (IQ1_M: LLVM
    /// unrolls it and spills registers, 1.43x slower; the other types run 3-10 % faster
    /// unrolled).
    const ROLLED: bool = false;
    /// Decode two rows at a time (one token): IQ1_S's kernel 11 % faster so, IQ2_XS's 8 %,
    /// IQ2_XXS's 3 %; IQ2_S's 23 % slower (its registers spill), IQ1_M's no faster.
    const PAIRS: bool = true;
    /// The IQ3 types: group `g`'s magnitudes as their eight four-value grid rows (what
    /// [`Self::raw`]'s `mag` packs two to a word), for a SIMD kernel to insert one by one
    /// (IQ3_XXS's kernel 22 % faster so).
    #[inline(always)]
    fn grid4(&self, _g: usize) -> Option<[u32; 8]> {
        None
    }
    /// IQ2_S, IQ3_S: group `g`'s 32 sign bits as stored (bit `j` set: element `j` negative),
    /// which a SIMD kernel spreads to bytes itself rather than by four table lookups.
    #[inline(always)]
    fn sign_bits(&self, _g: usize) -> Option<u32> {
        None
    }
    /// IQ2_XS, IQ2_S: the block's eight scale bytes (two 4-bit scales each, sub-block `2g`
    /// in the low nibble of byte `g`), which a SIMD kernel spreads to multipliers once a
    /// block rather than once a group.
    #[inline(always)]
    fn nibble_scales(&self) -> Option<u64> {
        None
    }
    /// IQ1_S: group `g`'s four grid rows (bytes -1, 0, 1) and whether its one shift is
    /// negative, from which a SIMD kernel makes the values itself: one shift a group costs
    /// less than lookups in [`IQ1_VALUES`], twice the grid's size (IQ1_S's kernel 6 % slower
    /// with them; IQ1_M's, a shift every eight elements, 13 % faster).
    #[inline(always)]
    fn grid_rows(&self, _g: usize) -> Option<([u64; 4], bool)> {
        None
    }
    /// IQ1_S: the block's eight `qh` words (group `g`'s scale in bits 12..14, its
    /// shift's sign in bit 15), from which a decode kernel takes the shifts' part of a dot
    /// product from the activations' sums, `ls * shift * sum(x)` a group, once a block.
    #[inline(always)]
    fn qh_words(&self) -> Option<&[u8; 16]> {
        None
    }
    /// IQ1_M: the block's four scale words as one (group `g`'s 3-bit scales at bits
    /// `16 * (g / 2) + 6 * (g % 2)` and 3 above), which a SIMD kernel spreads to multipliers
    /// once a block rather than once a group.
    #[inline(always)]
    fn scale_words(&self) -> Option<u64> {
        None
    }
}

impl IqBlock for BlockIq2Xxs {
    const K: f32 = 0.125;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        let (a0, a1) = (u32_at(&self.qs, 8 * g), u32_at(&self.qs, 8 * g + 4));
        let ls = 2 * (a1 >> 28) as i32 + 1;
        Group {
            mag: std::array::from_fn(|l| IQ2XXS_GRID[((a0 >> (8 * l)) & 0xFF) as usize]),
            sgn: std::array::from_fn(|l| signs7(a1 >> (7 * l))),
            ls: [ls, ls],
        }
    }
    fn raw_scales(&self, g: usize) -> [u32; 2] {
        let s = u32_at(&self.qs, 8 * g + 4) >> 28;
        [s, s]
    }
    fn dequant_scale(d: f32, s: u32) -> f32 {
        d * (0.5 + s as f32) * 0.25
    }
}

/// The two 4-bit scales of IQ2_XS/IQ2_S group `g`.
#[inline(always)]
fn nibble_scales(scales: &[u8; QK_K / 32], g: usize) -> [u32; 2] {
    [(scales[g] & 0xF) as u32, (scales[g] >> 4) as u32]
}

/// What IQ2_XS and IQ2_S share: an f16 `d`, the IQ2 factor 1/8, two 4-bit scales a byte of
/// `scales` (sub-block `2g` low), `x = d * (0.5 + s) / 4 * v`.
macro_rules! iq2_nibble_scaled {
    () => {
        const K: f32 = 0.125;
        #[inline(always)]
        fn d_bits(&self) -> [u8; 2] {
            self.d
        }
        fn raw_scales(&self, g: usize) -> [u32; 2] {
            nibble_scales(&self.scales, g)
        }
        #[inline(always)]
        fn nibble_scales(&self) -> Option<u64> {
            Some(u64::from_le_bytes(self.scales))
        }
        fn dequant_scale(d: f32, s: u32) -> f32 {
            d * (0.5 + s as f32) * 0.25
        }
    };
}

impl IqBlock for BlockIq2Xs {
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        let w = |l: usize| u16_at(&self.qs, 8 * g + 2 * l);
        let s = nibble_scales(&self.scales, g);
        Group {
            mag: std::array::from_fn(|l| IQ2XS_GRID[(w(l) & 511) as usize]),
            sgn: std::array::from_fn(|l| signs7(w(l) >> 9)),
            ls: s.map(|s| 2 * s as i32 + 1),
        }
    }
    iq2_nibble_scaled!();
}

impl IqBlock for BlockIq2S {
    const PAIRS: bool = false;
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        let qh = self.qh[g] as usize;
        let s = nibble_scales(&self.scales, g);
        Group {
            mag: std::array::from_fn(|l| {
                IQ2S_GRID[(self.qs[4 * g + l] as usize | ((qh << (8 - 2 * l)) & 0x300)) & 1023]
            }),
            sgn: std::array::from_fn(|l| signs8(self.qs[QK_K / 8 + 4 * g + l])),
            ls: s.map(|s| 2 * s as i32 + 1),
        }
    }
    #[inline(always)]
    fn sign_bits(&self, g: usize) -> Option<u32> {
        Some(u32_at(&self.qs, QK_K / 8 + 4 * g))
    }
    iq2_nibble_scaled!();
}

impl IqBlock for BlockIq3Xxs {
    const K: f32 = 0.25;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        let q = &self.qs[8 * g..8 * g + 8];
        let aux = u32_at(&self.qs, QK_K / 4 + 4 * g);
        let ls = 2 * (aux >> 28) as i32 + 1;
        Group {
            mag: std::array::from_fn(|l| {
                IQ3XXS_GRID[q[2 * l] as usize] as u64
                    | (IQ3XXS_GRID[q[2 * l + 1] as usize] as u64) << 32
            }),
            sgn: std::array::from_fn(|l| signs7(aux >> (7 * l))),
            ls: [ls, ls],
        }
    }
    fn raw_scales(&self, g: usize) -> [u32; 2] {
        let s = u32_at(&self.qs, QK_K / 4 + 4 * g) >> 28;
        [s, s]
    }
    fn dequant_scale(d: f32, s: u32) -> f32 {
        d * (0.5 + s as f32) * 0.5
    }
    #[inline(always)]
    fn grid4(&self, g: usize) -> Option<[u32; 8]> {
        Some(std::array::from_fn(|k| {
            IQ3XXS_GRID[self.qs[8 * g + k] as usize]
        }))
    }
}

impl IqBlock for BlockIq3S {
    const K: f32 = 1.0;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        let q = &self.qs[8 * g..8 * g + 8];
        let qh = self.qh[g] as usize;
        let s = self.raw_scales(g)[0];
        let ls = 2 * s as i32 + 1;
        Group {
            mag: std::array::from_fn(|l| {
                let i1 = (q[2 * l] as usize | ((qh << (8 - 2 * l)) & 256)) & 511;
                let i2 = (q[2 * l + 1] as usize | ((qh << (7 - 2 * l)) & 256)) & 511;
                IQ3S_GRID[i1] as u64 | (IQ3S_GRID[i2] as u64) << 32
            }),
            sgn: std::array::from_fn(|l| signs8(self.signs[4 * g + l])),
            ls: [ls, ls],
        }
    }
    #[inline(always)]
    fn sign_bits(&self, g: usize) -> Option<u32> {
        Some(u32_at(&self.signs, 4 * g))
    }
    #[inline(always)]
    fn grid4(&self, g: usize) -> Option<[u32; 8]> {
        // (an array literal: constant shifts; built by a closure over `k` it ran 1.8x slower)
        let (q, qh) = (&self.qs[8 * g..8 * g + 8], self.qh[g] as usize);
        let row = |k: usize| IQ3S_GRID[(q[k] as usize | ((qh << (8 - k)) & 256)) & 511];
        Some([
            row(0),
            row(1),
            row(2),
            row(3),
            row(4),
            row(5),
            row(6),
            row(7),
        ])
    }
    fn raw_scales(&self, g: usize) -> [u32; 2] {
        let s = ((self.scales[g / 2] >> (4 * (g % 2))) & 0xF) as u32;
        [s, s]
    }
    fn dequant_scale(d: f32, s: u32) -> f32 {
        d * (1 + 2 * s) as f32
    }
}

/// An IQ1 group of its four rows of values.
#[inline(always)]
fn iq1_group(v: [u64; 4], ls: [i32; 2]) -> Group {
    Group {
        mag: v.map(abs_bytes),
        sgn: v,
        ls,
    }
}

impl IqBlock for BlockIq1S {
    const K: f32 = 0.125;
    const EIGHTHS: bool = true;
    const ROLLED: bool = true;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        let qh = u16_at(&self.qh, 2 * g) as usize;
        let ls = 2 * ((qh >> 12) & 7) as i32 + 1;
        // index bits 8..11 of row `l`: bits 3l..3l + 3 of `qh`; the shift's sign: bit 15
        let shift = (qh >> 15) << 11;
        let v = std::array::from_fn(|l| {
            iq1_values(self.qs[4 * g + l] as usize | (((qh >> (3 * l)) & 7) << 8) | shift)
        });
        iq1_group(v, [ls, ls])
    }
    #[inline(always)]
    fn grid_rows(&self, g: usize) -> Option<([u64; 4], bool)> {
        let qh = u16_at(&self.qh, 2 * g) as usize;
        let rows = std::array::from_fn(|l| {
            IQ1S_GRID[(self.qs[4 * g + l] as usize | (((qh >> (3 * l)) & 7) << 8)) & 2047]
        });
        Some((rows, qh >> 15 != 0))
    }
    #[inline(always)]
    fn qh_words(&self) -> Option<&[u8; 16]> {
        Some(&self.qh)
    }
    fn raw_scales(&self, g: usize) -> [u32; 2] {
        let s = (u16_at(&self.qh, 2 * g) >> 12) & 7;
        [s, s]
    }
    fn dequant_scale(d: f32, s: u32) -> f32 {
        d * (2 * s + 1) as f32
    }
}

impl BlockIq1M {
    /// The four u16 scale words.
    #[inline(always)]
    fn sc(&self, i: usize) -> u32 {
        u16_at(&self.scales, 2 * i)
    }
}

impl IqBlock for BlockIq1M {
    const K: f32 = 0.125;
    const EIGHTHS: bool = true;
    const ROLLED: bool = true;
    const PAIRS: bool = false;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        let bits = (self.sc(0) >> 12)
            | ((self.sc(1) >> 8) & 0x00F0)
            | ((self.sc(2) >> 4) & 0x0F00)
            | (self.sc(3) & 0xF000);
        (bits as u16).to_le_bytes()
    }
    #[inline(always)]
    fn raw(&self, g: usize) -> Group {
        // nibble `l` of the group's two `qh` bytes: index bits 8..11 and the shift's sign,
        // as `IQ1_VALUES` takes them
        let h = u16_at(&self.qh, 2 * g) as usize;
        // (`from_fn`, not `[0, 1, 2, 3].map`: with `map` the words went through the stack
        // and the SIMD kernel loaded them back as one vector, a failed store forwarding that
        // made the IQ1_M decode kernel 3.2x slower)
        let v = std::array::from_fn(|l| {
            iq1_values(self.qs[4 * g + l] as usize | (((h >> (4 * l)) & 0xF) << 8))
        });
        iq1_group(v, self.raw_scales(g).map(|s| 2 * s as i32 + 1))
    }
    #[inline(always)]
    fn scale_words(&self) -> Option<u64> {
        Some(u64::from_le_bytes(self.scales))
    }
    fn raw_scales(&self, g: usize) -> [u32; 2] {
        let w = self.sc(g / 2) >> (6 * (g % 2));
        [w & 7, (w >> 3) & 7]
    }
    fn dequant_scale(d: f32, s: u32) -> f32 {
        d * (2 * s + 1) as f32
    }
}

/// Dequantizes one block (256 weights) as gguf-py does (and ggml: the same float
/// expressions): `dequant_scale(d, s) * v`, or `* (v / 8)` for IQ1.
#[inline]
pub(crate) fn dequant_block<B: IqBlock>(b: &B, out: &mut [f32]) {
    let d = b.d();
    for (g, o) in out[..QK_K].chunks_exact_mut(QK).enumerate() {
        let grp = b.raw(g);
        let s = b.raw_scales(g).map(|s| B::dequant_scale(d, s));
        for (j, y) in o.iter_mut().enumerate() {
            let v = grp.v(j) as f32;
            *y = s[j / 16] * if B::EIGHTHS { v * 0.125 } else { v };
        }
    }
}

/// The block's exact integer sum `sum_j ls[j / 16] * v[j] * a[j]` against 8-bit activations.
#[inline(always)]
pub(crate) fn block_isum<B: IqBlock>(b: &B, a: &[i8; QK_K]) -> i32 {
    let mut isum = 0i32;
    for g in 0..QK_K / QK {
        let grp = b.raw(g);
        for h in 0..2 {
            let s: i32 = (16 * h..16 * h + 16)
                .map(|j| grp.v(j) * a[QK * g + j] as i32)
                .sum();
            isum += grp.ls[h] * s;
        }
    }
    isum
}
