//! ggml block layouts as `#[repr(C)]` structs with alignment 1, so that any byte slice of
//! whole blocks can be viewed as a block slice with [`zerocopy`] (no unsafe, no copies).
//!
//! Half-precision fields are stored as little-endian `[u8; 2]` and read with accessor methods;
//! the layouts match `ggml-common.h` field for field.

use half::f16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;
/// Elements in a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q8_1 block.
pub const QK: usize = 32;

/// Reads a little-endian f16 stored as two bytes and widens it to f32.
#[inline(always)]
pub fn f16_bytes_to_f32(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// Narrows an f32 to f16 (round to nearest even, like numpy's `astype(np.float16)` and
/// ggml's `GGML_FP32_TO_FP16`) and returns its little-endian bytes.
#[inline(always)]
pub fn f32_to_f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

macro_rules! half_getters {
    ($($field:ident),*) => {
        $(
            #[doc = concat!("The `", stringify!($field), "` field widened to f32.")]
            #[inline(always)]
            pub fn $field(&self) -> f32 {
                f16_bytes_to_f32(self.$field)
            }
        )*
    };
}

/// Q4_0: `x = d * (q - 8)`, `q` in 0..16; element `j < 16` in the low nibble of `qs[j]`,
/// element `j + 16` in the high nibble.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// Q4_1: `x = d * q + m`, `q` in 0..16, nibble layout as in [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Minimum (f16).
    pub m: [u8; 2],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// Q5_0: `x = d * (q - 16)`, `q` in 0..32; low 4 bits as in [`BlockQ4_0`], bit 4 of
/// element `j` is bit `j` of the little-endian `qh`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Fifth bits, little-endian u32.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; QK / 2],
}

/// Q5_1: `x = d * q + m`, `q` in 0..32, bits as in [`BlockQ5_0`].
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Minimum (f16).
    pub m: [u8; 2],
    /// Fifth bits, little-endian u32.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; QK / 2],
}

/// Q8_0: `x = d * q`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Signed quants.
    pub qs: [i8; QK],
}

/// Q8_1: `x = d * q`, with `s = d * sum(q)` kept for the Q4_1/Q5_1 dot products.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// `d * sum(qs)` (f16).
    pub s: [u8; 2],
    /// Signed quants.
    pub qs: [i8; QK],
}

/// Q2_K: 16 sub-blocks of 16; `x = d * (sc & 15) * q - dmin * (sc >> 4)`, `q` in 0..4.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ2K {
    /// 4-bit scale (low) and 4-bit min (high) per sub-block.
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale for the scales (f16).
    pub d: [u8; 2],
    /// Super-block scale for the mins (f16).
    pub dmin: [u8; 2],
}

/// Q3_K: 16 sub-blocks of 16 with 6-bit signed scales; `q` in -4..4.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ3K {
    /// High bit of each quant (set means no `-4` offset).
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits of each quant.
    pub qs: [u8; QK_K / 4],
    /// 16 packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale (f16).
    pub d: [u8; 2],
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins; `x = d * sc * q - dmin * m`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale for the scales (f16).
    pub d: [u8; 2],
    /// Super-block scale for the mins (f16).
    pub dmin: [u8; 2],
    /// 8 scales and 8 mins, 6 bits each, packed.
    pub scales: [u8; 12],
    /// 4-bit quants.
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: as [`BlockQ4K`] with a fifth bit per quant in `qh`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-block scale for the scales (f16).
    pub d: [u8; 2],
    /// Super-block scale for the mins (f16).
    pub dmin: [u8; 2],
    /// 8 scales and 8 mins, 6 bits each, packed.
    pub scales: [u8; 12],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Low nibbles.
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales; `x = d * sc * (q - 32)`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits of the quants.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the quants.
    pub qh: [u8; QK_K / 4],
    /// Sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale (f16).
    pub d: [u8; 2],
}

/// Q8_K: `x = d * q` with an f32 scale and per-16 sums of the quants.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale (f32, little-endian).
    pub d: [u8; 4],
    /// Signed quants.
    pub qs: [i8; QK_K],
    /// Sums of each 16 quants (i16, little-endian).
    pub bsums: [[u8; 2]; QK_K / 16],
}

/// MXFP4 (OCP microscaling FP4, gpt-oss's experts): `x = 2^(e - 128) * KVALUES_MXFP4[q]`
/// (ggml's `GGML_E8M0_TO_FP32_HALF` of the scale byte times the doubled E2M1 value), nibble
/// layout as in [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockMxfp4 {
    /// E8M0 scale exponent.
    pub e: u8,
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// The E2M1 values of MXFP4's nibbles, doubled to integers (ggml's `kvalues_mxfp4`).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

impl BlockMxfp4 {
    /// Half the E8M0 scale, `2^(e - 128)`, exactly as ggml's `ggml_e8m0_to_fp32_half`
    /// (subnormal for `e` 0 and 1).
    #[inline]
    pub fn d(&self) -> f32 {
        e8m0_half(self.e)
    }
}

/// `2^(e - 128)` as ggml's `ggml_e8m0_to_fp32_half` builds it from bits (a table lookup:
/// no branch in the kernels' inner loops).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    E8M0_HALF[e as usize]
}

/// [`e8m0_half`] of every byte.
static E8M0_HALF: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut e = 0;
    while e < 256 {
        let bits = if e < 2 {
            0x0020_0000u32 << e
        } else {
            (e as u32 - 1) << 23
        };
        t[e] = f32::from_bits(bits);
        e += 1;
    }
    t
};

/// IQ4_NL: `x = d * KVALUES_IQ4NL[q]` (ggml's non-linear 4-bit values), nibble layout as in
/// [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq4Nl {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Nibbles: element `j` in the low half of byte `j`, element `j + 16` in its high half.
    pub qs: [u8; QK / 2],
}

/// The values IQ4_NL's (and IQ4_XS's) nibbles index (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// IQ4_XS: 8 sub-blocks of 32, each an IQ4_NL block whose scale is `d * (ls - 32)` for a
/// 6-bit `ls` (low 4 bits in `scales_l`, high 2 in `scales_h`).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq4Xs {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// Bits 4..6 of sub-block `i`'s scale at bits `2i..2i + 2` (u16).
    pub scales_h: [u8; 2],
    /// Bits 0..4 of sub-block `i`'s scale in the low (even `i`) or high (odd) half of byte
    /// `i / 2`.
    pub scales_l: [u8; QK_K / 64],
    /// Sub-block `i`'s nibbles at `16i..16i + 16`, laid out as [`BlockIq4Nl`]'s.
    pub qs: [u8; QK_K / 2],
}

impl BlockIq4Xs {
    /// Sub-block `i`'s scale multiplier `ls - 32` (-32..=31).
    #[inline(always)]
    pub fn sub_scale(&self, i: usize) -> i32 {
        let h = u16::from_le_bytes(self.scales_h);
        let lo = (self.scales_l[i / 2] >> (4 * (i % 2))) & 0xF;
        let hi = ((h >> (2 * i)) & 3) as u8;
        (lo | (hi << 4)) as i32 - 32
    }
}

/// IQ2_XXS (llama.cpp's 2.06-bit i-quant): eight groups of 32, group `g` in the u16 words
/// `qs[4g..4g + 4]` read as two u32: the first's four bytes index `IQ2XXS_GRID` (eight
/// values each), the second holds four 7-bit sign indices (`KSIGNS_IQ2XS`) and, in its top 4
/// bits, the scale `s`: `x = d * (0.5 + s) / 4 * grid * sign`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq2Xxs {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 32 little-endian u16 words.
    pub qs: [u8; QK_K / 4],
}

/// IQ2_XS (2.31 bits): word `i` of `qs` (u16) is a 9-bit index into `IQ2XS_GRID` and a 7-bit
/// sign index for elements `8i..8i + 8`; byte `g` of `scales` holds the 4-bit scales of
/// elements `32g..32g + 16` (low) and `32g + 16..32g + 32` (high).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq2Xs {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 32 little-endian u16 words.
    pub qs: [u8; QK_K / 4],
    /// Two 4-bit scales per 32 elements.
    pub scales: [u8; QK_K / 32],
}

/// IQ2_S (2.5 bits): `qs[i]` plus bits `2(i % 4)..` of `qh[i / 4]` (as bits 8 and 9) index
/// `IQ2S_GRID` for elements `8i..8i + 8`, whose signs are the bits of `qs[32 + i]`;
/// `scales` as [`BlockIq2Xs`]'s.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq2S {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 32 grid index bytes, then 32 sign bytes.
    pub qs: [u8; QK_K / 4],
    /// Two index high bits per 8 elements.
    pub qh: [u8; QK_K / 32],
    /// Two 4-bit scales per 32 elements.
    pub scales: [u8; QK_K / 32],
}

/// IQ3_XXS (3.06 bits): `qs[0..64]` index `IQ3XXS_GRID` (four values each), `qs[64..96]`
/// eight u32, one per 32 elements: four 7-bit sign indices and a 4-bit scale `s` on top,
/// `x = d * (0.5 + s) / 2 * grid * sign`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq3Xxs {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 64 grid indices, then 8 little-endian u32 of signs and scales.
    pub qs: [u8; 3 * QK_K / 8],
}

/// IQ3_S (3.44 bits): `qs[i]` with bit `i % 8` of `qh[i / 8]` as bit 8 indexes `IQ3S_GRID`
/// (four values) for elements `4i..4i + 4`; the signs are the bits of `signs`; the 4-bit
/// scale `s` of 32 elements (low nibble of `scales[g / 2]` for even `g`, high for odd) gives
/// `x = d * (1 + 2s) * grid * sign`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq3S {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 64 grid index bytes.
    pub qs: [u8; QK_K / 4],
    /// Index bit 8, one bit per 4 elements.
    pub qh: [u8; QK_K / 32],
    /// One sign bit per element.
    pub signs: [u8; QK_K / 8],
    /// Two 4-bit scales per 64 elements.
    pub scales: [u8; QK_K / 64],
}

/// IQ1_S (1.56 bits): `qs[i]` plus three bits of `qh[i / 4]` (bits `3(i % 4)..`) index
/// `IQ1S_GRID` (eight values in -1..=1) for elements `8i..8i + 8`; bits 12..15 of `qh[g]`
/// are the 3-bit scale `s` of 32 elements and bit 15 the sign of their shift:
/// `x = d * (2s + 1) * (grid ± 1/8)`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq1S {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// Grid index low bytes.
    pub qs: [u8; QK_K / 8],
    /// Eight little-endian u16: index high bits, scale and shift sign per 32 elements.
    pub qh: [u8; QK_K / 16],
}

/// IQ1_M (1.75 bits): as [`BlockIq1S`]'s grid, the index high bits (3) and the shift sign
/// (bit 3) of each 8 elements in a nibble of `qh`; 3-bit scales per 16 elements in
/// `scales` (four u16, four scales each in bits 0..12), whose top nibbles together are the
/// f16 super-block scale.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct BlockIq1M {
    /// Grid index low bytes.
    pub qs: [u8; QK_K / 8],
    /// A nibble per 8 elements: index high bits 0..3, shift sign bit 3.
    pub qh: [u8; QK_K / 16],
    /// Four little-endian u16 of 3-bit scales; their top nibbles form the f16 scale.
    pub scales: [u8; QK_K / 32],
}

const _: () = assert!(size_of::<BlockIq2Xxs>() == 66);
const _: () = assert!(size_of::<BlockIq2Xs>() == 74);
const _: () = assert!(size_of::<BlockIq2S>() == 82);
const _: () = assert!(size_of::<BlockIq3Xxs>() == 98);
const _: () = assert!(size_of::<BlockIq3S>() == 110);
const _: () = assert!(size_of::<BlockIq1S>() == 50);
const _: () = assert!(size_of::<BlockIq1M>() == 56);
const _: () = assert!(size_of::<BlockMxfp4>() == 17);
const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(size_of::<BlockQ5_1>() == 24);
const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(size_of::<BlockQ8_1>() == 36);
const _: () = assert!(size_of::<BlockQ2K>() == 84);
const _: () = assert!(size_of::<BlockQ3K>() == 110);
const _: () = assert!(size_of::<BlockQ4K>() == 144);
const _: () = assert!(size_of::<BlockQ5K>() == 176);
const _: () = assert!(size_of::<BlockQ6K>() == 210);
const _: () = assert!(size_of::<BlockQ8K>() == 292);
const _: () = assert!(size_of::<BlockIq4Nl>() == 18);
const _: () = assert!(size_of::<BlockIq4Xs>() == 136);

impl BlockQ4_0 {
    half_getters!(d);
}
impl BlockQ4_1 {
    half_getters!(d, m);
}
impl BlockQ5_0 {
    half_getters!(d);
}
impl BlockQ5_1 {
    half_getters!(d, m);
}
impl BlockQ8_0 {
    half_getters!(d);
}
impl BlockQ8_1 {
    half_getters!(d, s);
}
/// Element `e`'s two low bits in the 2-bit planes `qs` of Q2_K and Q3_K: byte `32 (e / 128) +
/// e % 32`, shifted by `2 ((e / 32) % 4)`.
#[inline(always)]
fn low2_of(qs: &[u8; QK_K / 4], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3
}

impl BlockQ2K {
    half_getters!(d, dmin);

    /// Element `e`'s quant, 0..4.
    #[inline(always)]
    pub fn q(&self, e: usize) -> u8 {
        low2_of(&self.qs, e)
    }
}
impl BlockQ3K {
    half_getters!(d);

    /// Element `e`'s quant, -4..4: the two low bits, minus 4 where the high bit is clear.
    #[inline(always)]
    pub fn q(&self, e: usize) -> i8 {
        let high = (self.hmask[e % 32] >> (e / 32)) & 1;
        low2_of(&self.qs, e) as i8 - (((high ^ 1) << 2) as i8)
    }
}
impl BlockQ4K {
    half_getters!(d, dmin);
}
impl BlockQ5K {
    half_getters!(d, dmin);
}
impl BlockQ6K {
    half_getters!(d);
}
impl BlockIq4Nl {
    half_getters!(d);
}
impl BlockIq4Xs {
    half_getters!(d);
}
impl BlockQ8K {
    /// The scale.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    /// Sum of quants `16 * i .. 16 * i + 16`.
    #[inline(always)]
    pub fn bsum(&self, i: usize) -> i16 {
        i16::from_le_bytes(self.bsums[i])
    }
}

/// Unpacks the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block
/// (ggml's `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All eight 6-bit scales and mins of a Q4_K/Q5_K block at once, as bytes: scales 0..8 in
/// bytes 0..8, mins 0..8 in bytes 8..16 of the little-endian words (ggml's AVX2 `utmp`
/// arrangement: a few word operations instead of eight [`scale_min_k4`] calls; the same
/// values).
#[inline(always)]
pub fn scales_mins_k4(q: &[u8; 12]) -> [u32; 4] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4),
    ]
}

/// Unpacks the sixteen 6-bit signed scales of a Q3_K block (-32..32).
#[inline(always)]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + (j % 4)] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Views `bytes` as a slice of blocks; `None` unless the length is a whole number of blocks.
pub fn cast<B: FromBytes + Immutable + KnownLayout + Unaligned>(bytes: &[u8]) -> Option<&[B]> {
    <[B]>::ref_from_bytes(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_mins_k4_gives_every_scale_min_k4_pair() {
        // every byte value at every position, over a pseudo-random background
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for pos in 0..12 {
            for v in 0..=255u8 {
                let mut q: [u8; 12] = std::array::from_fn(|_| next() as u8);
                q[pos] = v;
                let words = scales_mins_k4(&q);
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                for j in 0..8 {
                    assert_eq!((bytes[j], bytes[8 + j]), scale_min_k4(j, &q), "{q:?} j={j}");
                }
            }
        }
    }
}
