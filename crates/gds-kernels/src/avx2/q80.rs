//! Q8_0 and Q5_0 rows eight (or sixteen) at a time, one row per 32-bit vector lane (and the
//! other 32-element types: Q4_1, Q5_1, IQ4_NL; and IQ4_XS, run as its 32-element sub-blocks,
//! IQ4_NL blocks with f32 scales: [`XS_SUB`]).
//!
//! Every path ends a block the same way, per row: the block's exact integer dot product `I`
//! (32 products of the quants and the activation bytes, Q5_0's offset `-16 * sum(x)`
//! included), then `acc = fma(dw * dx, I, acc)`, rows in the lanes of one
//! accumulator per token. So a row's result is the same bits whichever path and whichever
//! instruction set computed it (the integer sums are exact everywhere):
//!
//! - fewer tokens than [`Q80_LANES_MIN`] (decode, small batches): eight rows in their stored
//!   layout side by side; each row's products come out as eight partial lanes (four per block
//!   of a pair) and a tree of `hadd`s turns the eight rows' partials into one vector of totals
//!   per block ([`totals8`]);
//! - more (prompt batches): a chunk of rows is repacked once (each 32-bit lane holds four
//!   consecutive quants of one row, so a broadcast of four activation bytes multiplies every
//!   row of the vector at once, with no horizontal sums) and every tile of up to four tokens
//!   runs against it.
//!
//! Q5_0's quants (0..32) multiply as unsigned bytes everywhere. Q8_0's two signed bytes: with VNNI (`vpdpbusd`, unsigned x signed into i32 with no
//! intermediate saturation) the weights are stored offset by 128 (`w ^ 0x80`) and the block's
//! `128 * sum(x)` is taken back (the activations carry `-sum(x)`); plain AVX2's `maddubs` would
//! saturate on such products, so there `|w|` meets `x` with `w`'s sign (`psignb`), one `madd`
//! per product pair widening to i32 before two could overflow.

use super::q40::{act4, act_block};
use super::q4k::{
    bcast4, bcast4x16, by_tile, chunked, group8, join_ps, lanes16, lanes8, put_halves, put_rows,
    transpose16, transpose8, x16_chunked, x16_shape, x16_tiles,
};
use super::*;
use crate::interleave::GROUP;

/// Prompt batches of at least this many tokens repack Q8_0 rows (plain AVX2, AVX-VNNI,
/// AVX-512); fewer run the rows in their stored layout. The same results either way.
pub(super) const Q80_LANES_MIN: (usize, usize, usize) = (18, 10, 10);

/// [`Q80_LANES_MIN`] for Q5_0 (one 4096 x 4096 matrix, 2 threads, `decode_bw q5_0 N` with
/// the threshold forced to 1 and to 999, ms repacked / stored: AVX2 4 tokens 1.08 / 0.94, 5:
/// 1.18 / 1.43; AVX-VNNI 4: 1.08 / 0.78, 5: 1.18 / 1.22; AVX-512 6: 1.10 / 1.04, 8: 1.15 /
/// 1.19).
pub(super) const Q50_LANES_MIN: (usize, usize, usize) = (5, 5, 8);

/// [`Q80_LANES_MIN`] for IQ4_XS.
pub(super) const XS_LANES_MIN: (usize, usize, usize) = Q80_LANES_MIN;

/// [`Q80_LANES_MIN`] for Q4_1 and Q5_1 (measured on Q4_1, `decode_bw q4_1 N`, ms repacked /
/// stored: AVX2 5 tokens 1.14 / 1.15, 6: 1.21 / 1.29; AVX-VNNI 6: 1.15 / 1.11, 8: 1.26 /
/// 1.27; AVX-512 8: 1.13 / 1.10, 10: 1.24 / 1.49).
pub(super) const Q41_LANES_MIN: (usize, usize, usize) = (6, 8, 9);

/// The 32-element block types of this module: Q8_0 (signed 8-bit quants), Q5_0 (5-bit quants
/// `q`, values `q - 16`), Q4_1 and Q5_1 (4- and 5-bit quants, values `d * q + m`), IQ4_NL
/// (4-bit indices into `KVALUES_IQ4NL`: signed values, as Q8_0's once looked up).
pub(super) trait Q32:
    zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned
{
    /// Signed quants (Q8_0). Otherwise unsigned ones, with a constant offset `-(1 << s)` where
    /// `SHIFT` is `Some(s)`, taken back as `(1 << s) * -sum(x)` from the integer dot product.
    const SIGNED: bool;
    /// See [`Q32::SIGNED`].
    const SHIFT: Option<i32>;
    /// Blocks with a min (Q4_1, Q5_1).
    const MIN: bool = false;
    /// Blocks with fifth bits (Q5_0, Q5_1).
    const QH: bool = false;
    /// Nibbles that index `KVALUES_IQ4NL` (IQ4_NL): the signed values the byte shuffle of
    /// [`elements`] gives, then everything as Q8_0's signed quants (`SIGNED`).
    const LUT: bool = false;
    /// The block's scale (f16 bits).
    fn d(&self) -> [u8; 2];
    /// The block's min `m` (f16 bits; Q4_1, Q5_1), whose term `m * dx * sum(xq)` follows the
    /// scaled integer sum.
    fn m(&self) -> Option<[u8; 2]>;
    /// Q8_0's quants.
    fn q8(&self) -> Option<&[i8; 32]>;
    /// The others' nibbles and fifth bits.
    fn nibbles(&self) -> Option<(&[u8; 16], Option<[u8; 4]>)>;
}

/// Implements [`Q32`] for a type of `d`, `qs` nibbles, and (as `$m` / `$qh` read them) an
/// optional min `m` and fifth bits `qh`.
macro_rules! q32_nibbles {
    ($blk:ty, $shift:expr, $min:literal, $five:literal, |$bm:ident| $m:expr, |$bh:ident| $qh:expr) => {
        impl Q32 for $blk {
            const SIGNED: bool = false;
            const SHIFT: Option<i32> = $shift;
            const MIN: bool = $min;
            const QH: bool = $five;
            fn d(&self) -> [u8; 2] {
                self.d
            }
            fn m(&self) -> Option<[u8; 2]> {
                let $bm = self;
                $m
            }
            fn q8(&self) -> Option<&[i8; 32]> {
                None
            }
            fn nibbles(&self) -> Option<(&[u8; 16], Option<[u8; 4]>)> {
                let $bh = self;
                Some((&self.qs, $qh))
            }
        }
    };
}
q32_nibbles!(BlockQ5_0, Some(4), false, true, |_b| None, |b| Some(b.qh));
q32_nibbles!(BlockQ4_1, None, true, false, |b| Some(b.m), |_b| None);
q32_nibbles!(BlockQ5_1, None, true, true, |b| Some(b.m), |b| Some(b.qh));

impl Q32 for BlockIq4Nl {
    const SIGNED: bool = true;
    const SHIFT: Option<i32> = None;
    const LUT: bool = true;
    fn d(&self) -> [u8; 2] {
        self.d
    }
    fn m(&self) -> Option<[u8; 2]> {
        None
    }
    fn q8(&self) -> Option<&[i8; 32]> {
        None
    }
    fn nibbles(&self) -> Option<(&[u8; 16], Option<[u8; 4]>)> {
        Some((&self.qs, None))
    }
}

/// IQ4_NL's nibbles `q` (bytes 0..16) as their signed values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lookup(q: __m256i) -> __m256i {
    _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(ld_i8x16(&KVALUES_IQ4NL)), q)
}

/// Sub-blocks (of 32 elements) in an IQ4_XS block. The kernels run IQ4_XS rows as their
/// sub-blocks: sub-block `i` of a row is sub-block `i % 8` of its block `i / 8`, an IQ4_NL
/// block (the same nibble layout) whose scale is the f32 `d * (ls - 32)`, so IQ4_NL's
/// arithmetic ([`Q32`] of [`BlockIq4Nl`]) with that scale.
pub(super) const XS_SUB: usize = QK_K / 32;

/// Sub-block `i` of an IQ4_XS row as its 32 signed values in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_elements(row: &[BlockIq4Xs], i: usize) -> __m256i {
    let j = i % XS_SUB;
    let qs = row[i / XS_SUB].qs[16 * j..16 * j + 16].as_chunks::<16>().0[0];
    let v = ld_u8x16(&qs);
    lookup(_mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
        _mm256_set1_epi8(0x0F),
    ))
}

/// Sub-block pair `p` of an IQ4_XS row (sub-blocks `2p`, `2p + 1`: 32 adjacent nibble bytes)
/// as the products want it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_pair(row: &[BlockIq4Xs], p: usize, vnni: bool) -> Pair {
    let q = p % (XS_SUB / 2);
    // the two sub-blocks' nibble bytes are adjacent: one load, each 128-bit half a
    // sub-block, its low nibbles elements 0..16 and its high ones 16..32
    let v = ld_u8x32(&row[p / (XS_SUB / 2)].qs[32 * q..]);
    let m4 = _mm256_set1_epi8(0x0F);
    let lo = lookup(_mm256_and_si256(v, m4));
    let hi = lookup(_mm256_and_si256(_mm256_srli_epi16::<4>(v), m4));
    Pair {
        lo: weight_bytes::<BlockIq4Nl>(lo, vnni),
        hi: weight_bytes::<BlockIq4Nl>(hi, vnni),
        slo: lo,
        shi: hi,
    }
}

/// The eight sub-block scales `d * (ls - 32)` of an IQ4_XS block (lane `j`: sub-block `j`),
/// each the exact product (an f16 times a 6-bit integer) gguf-py computes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_scales(b: &BlockIq4Xs) -> __m256 {
    let l = _mm256_set1_epi32(i32::from_le_bytes(b.scales_l));
    let h = _mm256_set1_epi32(u16::from_le_bytes(b.scales_h) as i32);
    xs_scale_lanes(
        _mm256_srlv_epi32(l, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_srlv_epi32(h, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_ps(b.d()),
    )
}

/// The IQ4_XS scales `d * (ls - 32)` whose 6-bit `ls` is, lane by lane, the low four bits of
/// `l` and above them the low two of `h` (`d` each lane's block scale): the exact product
/// gguf-py computes, whichever layout the bits came from.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_scale_lanes(l: __m256i, h: __m256i, d: __m256) -> __m256 {
    let ls = _mm256_sub_epi32(
        _mm256_or_si256(
            _mm256_and_si256(l, _mm256_set1_epi32(0xF)),
            _mm256_slli_epi32::<4>(_mm256_and_si256(h, _mm256_set1_epi32(3))),
        ),
        _mm256_set1_epi32(32),
    );
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(ls))
}

/// Where an interleaved IQ4_XS group block's quants start (after sixteen rows' `d`,
/// `scales_h` and `scales_l`).
const XS_QS: usize = 128;

/// The eight sub-blocks' scales `d * (ls - 32)` of rows `8h..8h + 8` of an interleaved
/// IQ4_XS group block `b` (`[j]`: sub-block `j`'s, row `r` in lane `r`): [`xs_scales`]'
/// arithmetic with the rows in the lanes, made once a block (AVX2 and AVX-VNNI; see
/// [`xs_scales_x8_at`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_scales_x8(b: &[u8], h: usize) -> [__m256; XS_SUB] {
    let d = _mm256_cvtph_ps(ld_u8x16(&b[16 * h..].as_chunks::<16>().0[0]));
    let mut l = ld_u8x32(&b[64 + 32 * h..]);
    let mut hw = _mm256_cvtepu16_epi32(ld_u8x16(&b[32 + 16 * h..].as_chunks::<16>().0[0]));
    let mut out = [_mm256_setzero_ps(); XS_SUB];
    for o in &mut out {
        *o = xs_scale_lanes(l, hw, d);
        l = _mm256_srli_epi32::<4>(l);
        hw = _mm256_srli_epi32::<2>(hw);
    }
    out
}

/// Sub-block `j`'s scales of rows `8h..8h + 8` of an interleaved IQ4_XS group block `b`
/// ([`xs_scales_x8`]'s `[j]`), made alone: with AVX-512 faster than a block's made once and
/// kept (sixteen rows' 512-bit scales; 26-28 against 34-37 µs a 1024 x 2048 matrix from L2,
/// `decode_bw iq4_xsx16`), with AVX2 and AVX-VNNI much slower (57-59 against 39, 49-52
/// against 32: sixteen registers).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_scales_x8_at(b: &[u8], j: usize, h: usize) -> __m256 {
    let d = _mm256_cvtph_ps(ld_u8x16(&b[16 * h..].as_chunks::<16>().0[0]));
    let l = ld_u8x32(&b[64 + 32 * h..]);
    let hw = _mm256_cvtepu16_epi32(ld_u8x16(&b[32 + 16 * h..].as_chunks::<16>().0[0]));
    xs_scale_lanes(
        _mm256_srlv_epi32(l, _mm256_set1_epi32(4 * j as i32)),
        _mm256_srlv_epi32(hw, _mm256_set1_epi32(2 * j as i32)),
        d,
    )
}

/// Group block `k` of a group of sixteen interleaved IQ4_XS rows.
#[inline(always)]
fn xs_group_block(group: &[u8], k: usize) -> &[u8] {
    let gb = GROUP * std::mem::size_of::<BlockIq4Xs>();
    &group[k * gb..(k + 1) * gb]
}

/// Block `k`'s scales of eight IQ4_XS rows by sub-block: `[j]` holds sub-block `j`'s, row `r`
/// in lane `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_block_scales8(rows: &[&[BlockIq4Xs]; 8], k: usize) -> [__m256; XS_SUB] {
    let mut v = [_mm256_setzero_si256(); 8];
    for r in 0..8 {
        v[r] = _mm256_castps_si256(xs_scales(&rows[r][k]));
    }
    transpose8(v).map(|t| _mm256_castsi256_ps(t))
}

impl Q32 for BlockQ8_0 {
    const SIGNED: bool = true;
    const SHIFT: Option<i32> = None;
    fn d(&self) -> [u8; 2] {
        self.d
    }
    fn m(&self) -> Option<[u8; 2]> {
        None
    }
    fn q8(&self) -> Option<&[i8; 32]> {
        Some(&self.qs)
    }
    fn nibbles(&self) -> Option<(&[u8; 16], Option<[u8; 4]>)> {
        None
    }
}

/// A block's 32 quants as bytes in element order: Q8_0's signed ones, the others' `q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn elements<B: Q32>(b: &B) -> __m256i {
    if let Some(q) = b.q8() {
        return ld_i8x32(q);
    }
    let (qs, qh) = b.nibbles().expect("a Q32 block has Q8_0 quants or nibbles");
    let v = ld_u8x16(qs);
    // elements 0..16 (low nibbles), then 16..32 (high nibbles)
    let q = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
        _mm256_set1_epi8(0x0F),
    );
    let Some(qh) = qh else {
        return if B::LUT { lookup(q) } else { q };
    };
    // element e's fifth bit is bit e of qh: byte e / 8 of qh (the same four bytes in every
    // 32-bit lane) against the mask 1 << (e % 8)
    let both = _mm256_set1_epi32(i32::from_le_bytes(qh));
    let idx = _mm256_setr_epi64x(
        0,
        0x0101010101010101,
        0x0202020202020202,
        0x0303030303030303,
    );
    let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let b = _mm256_and_si256(_mm256_shuffle_epi8(both, idx), bit);
    _mm256_or_si256(
        q,
        _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10)),
    )
}

/// The eight rows' f16 scales and mins of block `i` as f32 (0 past the rows' end; mins 0 for
/// the types without), the types with mins from one 32-bit value a row (`d` and `m` are
/// adjacent in Q4_1 and Q5_1): in the decode path a pair's setup, where sixteen 16-bit
/// inserts cost more than the products.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins8<B: Q32>(rows: &[&[B]; 8], i: usize) -> (__m256, __m256) {
    if !B::MIN {
        // the scales alone (the mins' conversions cost Q8_0's decode ~4 %)
        let d = f16x8(|r: usize| rows[r].get(i).map_or(0, |b| i16::from_le_bytes(b.d())));
        return (d, _mm256_setzero_ps());
    }
    let w = |r: usize| {
        rows[r].get(i).map_or(0, |b| {
            let (d, m) = (b.d(), b.m().unwrap_or([0; 2]));
            i32::from_le_bytes([d[0], d[1], m[0], m[1]])
        })
    };
    let v = _mm256_setr_epi32(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7));
    // per 128-bit lane: the four d to the low 8 bytes, the four m to the high 8
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
        10, 11, 14, 15,
    );
    // qwords [d0-3, d4-7, m0-3, m4-7]
    let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(v, split));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(p)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(p)),
    )
}

/// A block's min term for the rows in the lanes: `acc + m * s`, `s` = the activations'
/// `dx * sum(xq)` of the block (types without mins: `acc` unchanged).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn min_step8<B: Q32>(acc: __m256, m: __m256, s: f32) -> __m256 {
    if B::MIN {
        _mm256_fmadd_ps(m, _mm256_set1_ps(s), acc)
    } else {
        acc
    }
}

/// The quant bytes the products multiply: Q8_0's offset by 128 (`w ^ 0x80`) with VNNI or
/// absolute (`|w|`, the signs going to the activations) without; Q5_0's as they are.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn weight_bytes<B: Q32>(e: __m256i, vnni: bool) -> __m256i {
    match (B::SIGNED, vnni) {
        (true, true) => _mm256_xor_si256(e, _mm256_set1_epi8(i8::MIN)),
        (true, false) => _mm256_abs_epi8(e),
        (false, _) => e,
    }
}

/// Whether the products need the weights' signs (`psignb` on the activations).
const fn signed_products<B: Q32>(vnni: bool) -> bool {
    B::SIGNED && !vnni
}

/// The power of two whose multiple of `-sum(x)` the integer dot products start from (the
/// weights' offset): Q8_0's 128 with VNNI, Q5_0's 16; none for signed products.
const fn offset_shift<B: Q32>(vnni: bool) -> Option<i32> {
    match (B::SIGNED, vnni) {
        (true, true) => Some(7),
        (true, false) => None,
        (false, _) => B::SHIFT,
    }
}

/// Eight rows' partial sums of a block pair (`v[r]`: four lanes of block `2p`, then four of
/// block `2p + 1`) to the pair's totals, row `r` in lane `r`: `(block 2p, block 2p + 1)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn totals8(v: &[__m256i; 8]) -> (__m256i, __m256i) {
    let q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    // q0 = [r0..r3 of block 2p | r0..r3 of 2p + 1], q1 the same for rows 4..8
    (
        _mm256_permute2x128_si256::<0x20>(q0, q1),
        _mm256_permute2x128_si256::<0x31>(q0, q1),
    )
}

/// One block's step of every path: `acc + (dw * dx) * I` for the rows in the lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn step8(acc: __m256, dw: __m256, dx: f32, i: __m256i) -> __m256 {
    _mm256_fmadd_ps(
        _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
        _mm256_cvtepi32_ps(i),
        acc,
    )
}

/// [`step8`] on sixteen rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn step16(acc: __m512, dw: __m512, dx: f32, i: __m512i) -> __m512 {
    _mm512_fmadd_ps(
        _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
        _mm512_cvtepi32_ps(i),
        acc,
    )
}

/// A row's block pair as the products want it: both blocks' elements 0..16 (`lo`) and 16..32
/// (`hi`), as [`weight_bytes`] makes them, with the quants as stored in `slo`/`shi` (the signs,
/// where the products need them).
#[derive(Clone, Copy)]
struct Pair {
    lo: __m256i,
    hi: __m256i,
    slo: __m256i,
    shi: __m256i,
}

/// Block pair `p` of a row (a zero block past its end).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair<B: Q32>(row: &[B], p: usize, vnni: bool) -> Pair {
    let (b0, b1) = (&row[2 * p], row.get(2 * p + 1));
    let (lo, hi) = match (b0.nibbles(), b1.map(|b| b.nibbles())) {
        // 4-bit quants: both blocks' nibbles in one vector, split (the decode path's most
        // frequent work for Q4_1, cheaper than two `elements` and two lane permutes)
        (Some((q0, None)), Some(Some((q1, None)))) => {
            let (lo, hi) = nibble_pair(q0, q1);
            match B::LUT {
                true => (lookup(lo), lookup(hi)),
                false => (lo, hi),
            }
        }
        _ => {
            let e0 = elements(b0);
            let e1 = b1.map_or(_mm256_setzero_si256(), |b| elements(b));
            (
                _mm256_permute2x128_si256::<0x20>(e0, e1),
                _mm256_permute2x128_si256::<0x31>(e0, e1),
            )
        }
    };
    Pair {
        lo: weight_bytes::<B>(lo, vnni),
        hi: weight_bytes::<B>(hi, vnni),
        slo: lo,
        shi: hi,
    }
}

/// The offset's `(1 << shift) * sum(x)` of both blocks of an activation pair, to take back:
/// `nsum << shift` in the lanes of each block (lanes 0..4: block `2p`, 4..8: `2p + 1`),
/// spread so that [`totals8`] adds one copy per block (lane 0 of each half, zeros elsewhere).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn offset_back(x: &ActQ8, shift: Option<i32>) -> __m256i {
    match shift {
        Some(s) => _mm256_sll_epi32(ld_i32x8(&x.nsum), _mm_cvtsi32_si128(s)),
        None => _mm256_setzero_si256(),
    }
}

/// Generates the decode path for one instruction set (`$vnni`: whether it has `vpdpbusd`):
/// `$dot(acc, u, x)` adds the products of a 256-bit vector of unsigned weight bytes `u` (as
/// [`weight_bytes`] makes them) and activation bytes `x` into i32 lanes.
macro_rules! q80_stored {
    ($feat:literal, $vnni:literal, $dot:ident) => {
        /// Products of `u` (as [`weight_bytes`] made them; `s` the quants as stored, whose
        /// signs go to the activations where the products need them) and `x`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn prod<B: Q32>(acc: __m256i, u: __m256i, s: __m256i, x: __m256i) -> __m256i {
            if signed_products::<B>($vnni) {
                $dot(acc, u, _mm256_sign_epi8(x, s))
            } else {
                $dot(acc, u, x)
            }
        }

        /// Eight rows in their stored layout against `N` tokens: each token's results,
        /// row `r` in lane `r`. `pf` (the next rows) is prefetched a few lines a pair.
        #[inline]
        #[target_feature(enable = $feat)]
        fn rows8<B: Q32, const N: usize>(
            rows: &[&[B]; 8],
            a: &[&[ActQ8]; N],
            pf: &[u8],
        ) -> [__m256; N] {
            let nb = rows[0].len();
            assert!(rows.iter().all(|r| r.len() == nb));
            rows8_by::<B, N>(
                nb,
                |r, p| pair(rows[r], p, $vnni),
                |p| (scales_mins8(rows, 2 * p), scales_mins8(rows, 2 * p + 1)),
                a,
                pf,
            )
        }

        /// [`rows8`] on eight IQ4_XS rows seen as their 32-element sub-blocks (IQ4_NL's
        /// arithmetic), each block's sixty-four scales made once for its four pairs.
        #[inline]
        #[target_feature(enable = $feat)]
        fn rows8_xs<const N: usize>(
            rows: &[&[BlockIq4Xs]; 8],
            a: &[&[ActQ8]; N],
            pf: &[u8],
        ) -> [__m256; N] {
            let nb = rows[0].len();
            assert!(rows.iter().all(|r| r.len() == nb));
            let (zero, mut sc) = (_mm256_setzero_ps(), [_mm256_setzero_ps(); XS_SUB]);
            rows8_by::<BlockIq4Nl, N>(
                nb * XS_SUB,
                |r, p| xs_pair(rows[r], p, $vnni),
                |p| {
                    let q = p % (XS_SUB / 2);
                    if q == 0 {
                        sc = xs_block_scales8(rows, p / (XS_SUB / 2));
                    }
                    ((sc[2 * q], zero), (sc[2 * q + 1], zero))
                },
                a,
                pf,
            )
        }

        /// The decode arithmetic over `nb` blocks of eight rows: `pair(r, p)` is pair `p`
        /// of row `r`, `scales(p)` the eight rows' scales and mins of the pair's two
        /// blocks (called once a pair, in order).
        #[inline]
        #[target_feature(enable = $feat)]
        fn rows8_by<B: Q32, const N: usize>(
            nb: usize,
            pair: impl Fn(usize, usize) -> Pair,
            mut scales: impl FnMut(usize) -> ((__m256, __m256), (__m256, __m256)),
            a: &[&[ActQ8]; N],
            pf: &[u8],
        ) -> [__m256; N] {
            let np = nb.div_ceil(2);
            assert!(a.iter().all(|x| x.len() >= np));
            let shift = offset_shift::<B>($vnni);
            let mut acc = [_mm256_setzero_ps(); N];
            for p in 0..np {
                prefetch_l2(pf, p, np);
                let mut w = [pair(0, p); 8];
                for r in 1..8 {
                    w[r] = pair(r, p);
                }
                let ((d0, m0), (d1, m1)) = scales(p);
                for t in 0..N {
                    let x = &a[t][p];
                    let (xl, xh) = (ld_i8x32(&x.lo), ld_i8x32(&x.hi));
                    let mut v = [offset_back(x, shift); 8];
                    for r in 0..8 {
                        let lo = prod::<B>(v[r], w[r].lo, w[r].slo, xl);
                        v[r] = prod::<B>(lo, w[r].hi, w[r].shi, xh);
                    }
                    let (i0, i1) = totals8(&v);
                    acc[t] = min_step8::<B>(step8(acc[t], d0, x.d8[0], i0), m0, x.s4[1]);
                    if 2 * p + 1 < nb {
                        acc[t] = min_step8::<B>(step8(acc[t], d1, x.d8[4], i1), m1, x.s4[3]);
                    }
                }
            }
            acc
        }

        /// Every row against the tile of tokens from `t0`, rows in their stored layout,
        /// eight at a time through `rows8` (blocks of type `S` as stored).
        #[inline]
        #[target_feature(enable = $feat)]
        fn tile_rows<S, const N: usize>(
            w: &[u8],
            rb: usize,
            a: [&[ActQ8]; N],
            (out, nt, t0): (&mut [f32], usize, usize),
            rows8: impl Fn(&[&[S]; 8], &[&[ActQ8]; N], &[u8]) -> [__m256; N],
        ) where
            S: zerocopy::FromBytes
                + zerocopy::Immutable
                + zerocopy::KnownLayout
                + zerocopy::Unaligned,
        {
            let nrows = w.len() / rb;
            for r in (0..nrows).step_by(8) {
                let pf = ahead(w, r * rb, 8 * rb);
                let acc = rows8(&group8::<S>(w, rb, r, nrows), &a, pf);
                put_rows(acc.map(|v| lanes8(v)), r, nrows, out, nt, t0);
            }
        }

        /// Rows in their stored layout against every token, tile by tile.
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn rows_stored<B: Q32>(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let nt = acts.len();
            let mut t0 = 0;
            while t0 < nt {
                by_tile!(&acts[t0..], |xs| tile_rows::<B, _>(
                    w,
                    rb,
                    xs,
                    (&mut *out, nt, t0),
                    |rows, a, pf| rows8::<B, _>(rows, a, pf)
                ));
                t0 += (nt - t0).min(4);
            }
        }

        /// [`rows_stored`] for IQ4_XS rows.
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn rows_stored_xs(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let nt = acts.len();
            let mut t0 = 0;
            while t0 < nt {
                by_tile!(&acts[t0..], |xs| tile_rows::<BlockIq4Xs, _>(
                    w,
                    rb,
                    xs,
                    (&mut *out, nt, t0),
                    |rows, a, pf| rows8_xs(rows, a, pf)
                ));
                t0 += (nt - t0).min(4);
            }
        }
    };
}

/// Generates the prompt path with eight rows a vector for one instruction set (in the module
/// of its [`q80_stored`], whose `prod` it shares).
macro_rules! q80_lanes8 {
    ($feat:literal, $vnni:literal) => {
        /// Eight rows of one block, repacked: quants of elements `4g..4g + 4` of row `r`
        /// in bytes `4r..4r + 4` of `q[g]` (as [`weight_bytes`] makes them), the quants as
        /// stored in `s[g]` (their signs, where the products need them), each row's scale in
        /// `d`.
        #[derive(Clone, Copy)]
        pub(in crate::avx2) struct Packed8 {
            q: [__m256i; 8],
            s: [__m256i; 8],
            d: __m256,
            m: __m256,
        }

        impl Packed8 {
            #[inline]
            #[target_feature(enable = $feat)]
            fn zero() -> Packed8 {
                Packed8 {
                    q: [_mm256_setzero_si256(); 8],
                    s: [_mm256_setzero_si256(); 8],
                    d: _mm256_setzero_ps(),
                    m: _mm256_setzero_ps(),
                }
            }
        }

        /// Repacks block `i` of eight rows into `p`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn repack8<B: Q32>(rows: &[&[B]; 8], i: usize, p: &mut Packed8) {
            let dm = scales_mins8(rows, i);
            if !B::QH && B::q8(&rows[0][i]).is_none() {
                // nibbles alone (Q4_1, IQ4_NL): the packed bytes transposed, then split
                let nib = |r: usize| rows[r][i].nibbles().expect("a nibble block").0;
                let t = nibbles8(quad_rows8(nib));
                return fill8_t::<B>(if B::LUT { t.map(|v| lookup(v)) } else { t }, dm, p);
            }
            let mut v = [_mm256_setzero_si256(); 8];
            for r in 0..8 {
                v[r] = elements(&rows[r][i]);
            }
            fill8_t::<B>(transpose8(v), dm, p)
        }

        /// Repacks sub-block `i` of eight IQ4_XS rows, whose scales are `d`, into `p`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn repack8_xs(rows: &[&[BlockIq4Xs]; 8], i: usize, d: __m256, p: &mut Packed8) {
            let j = i % XS_SUB;
            let t = nibbles8(quad_rows8(|r| {
                &rows[r][i / XS_SUB].qs.as_chunks::<16>().0[j]
            }));
            fill8_t::<BlockIq4Nl>(t.map(|v| lookup(v)), (d, _mm256_setzero_ps()), p)
        }

        /// `p` from eight rows' elements of a block, transposed (`t[g]`: elements
        /// `4g..4g + 4` of row `r` in lane `r`), and their scales and mins.
        #[inline]
        #[target_feature(enable = $feat)]
        fn fill8_t<B: Q32>(t: [__m256i; 8], (d, m): (__m256, __m256), p: &mut Packed8) {
            for g in 0..8 {
                p.q[g] = weight_bytes::<B>(t[g], $vnni);
                if signed_products::<B>($vnni) {
                    p.s[g] = t[g];
                }
            }
            (p.d, p.m) = (d, m);
        }

        /// Block `i` (`u`) of eight repacked rows against one token's activations,
        /// added to `acc`. Two integer sums (even and odd groups of four elements)
        /// shorten the dependency chain; integers, so the same total.
        #[inline]
        #[target_feature(enable = $feat)]
        fn term8<B: Q32>(u: &Packed8, x: &[ActQ8], i: usize, acc: __m256) -> __m256 {
            let (x, h) = act_block(x, i);
            let mut s = [_mm256_setzero_si256(); 2];
            if let Some(shift) = offset_shift::<B>($vnni) {
                s[0] = _mm256_set1_epi32(x.nsum[4 * h] << shift);
            }
            if !B::SIGNED && !$vnni {
                // 4- and 5-bit quants on plain AVX2: four groups' `maddubs` pairs summed in
                // i16 (4 * 2 * 31 * 128 < 2^15) before one `madd` widens them
                for half in 0..2 {
                    let mut w = _mm256_setzero_si256();
                    for g in 4 * half..4 * half + 4 {
                        let a = bcast4(act4(x, h, g));
                        w = _mm256_add_epi16(w, _mm256_maddubs_epi16(u.q[g], a));
                    }
                    s[half] = _mm256_add_epi32(s[half], _mm256_madd_epi16(w, _mm256_set1_epi16(1)));
                }
            } else {
                for g in 0..8 {
                    s[g % 2] = prod::<B>(s[g % 2], u.q[g], u.s[g], bcast4(act4(x, h, g)));
                }
            }
            let acc = step8(acc, u.d, x.d8[4 * h], _mm256_add_epi32(s[0], s[1]));
            min_step8::<B>(acc, u.m, x.s4[2 * h + 1])
        }

        /// Eight repacked rows (block `i` in `p[i]`) against `N` tokens.
        #[inline]
        #[target_feature(enable = $feat)]
        fn gemm8<B: Q32, const N: usize>(p: &[Packed8], xs: [&[ActQ8]; N]) -> [__m256; N] {
            let [acc] = gemm8_by::<B, N, 1>(p.len(), |i, _| p[i], xs, &[]);
            acc
        }

        /// [`gemm8`] on `H` sets of eight rows at once over `nb` blocks, `block(i, h)`
        /// giving block `i` of set `h` (repacked beforehand, or unpacked from the interleaved
        /// layout as the loop goes), prefetching the bytes `pf` into L2 a few lines a block.
        #[inline]
        #[target_feature(enable = $feat)]
        fn gemm8_by<B: Q32, const N: usize, const H: usize>(
            nb: usize,
            mut block: impl FnMut(usize, usize) -> Packed8,
            xs: [&[ActQ8]; N],
            pf: &[u8],
        ) -> [[__m256; N]; H] {
            let mut acc = [[_mm256_setzero_ps(); N]; H];
            for i in 0..nb {
                prefetch_l2(pf, i, nb);
                for (h, acc) in acc.iter_mut().enumerate() {
                    let u = block(i, h);
                    for t in 0..N {
                        acc[t] = term8::<B>(&u, xs[t], i, acc[t]);
                    }
                }
            }
            acc
        }

        /// Block `i` of a group of sixteen interleaved rows, rows `8h..8h + 8`, as
        /// [`Packed8`]: [`unpack_x16`]'s fields from the 32-byte half `h` of each 64-byte
        /// unit (eight rows, a row per 32-bit lane), the fifth bits tested by a compare.
        #[inline]
        #[target_feature(enable = $feat)]
        fn unpack_x8<B: Q32>(group: &[u8], i: usize, h: usize) -> Packed8 {
            let gb = GROUP * std::mem::size_of::<B>();
            let b = &group[i * gb..(i + 1) * gb];
            let (qh_at, qs_at) = x16_fields::<B>();
            let f16s = |at: usize| ld_f16x8(b[at + 16 * h..].as_chunks().0);
            let mut p = Packed8::zero();
            p.d = f16s(0);
            if B::MIN {
                p.m = f16s(32);
            }
            let at = |unit: usize| ld_u8x32(&b[unit + 32 * h..]);
            let t: [__m256i; 8] = if B::SIGNED && !B::LUT {
                std::array::from_fn(|g| at(qs_at + 64 * g))
            } else {
                let mut t = nibbles8(std::array::from_fn(|c| at(qs_at + 64 * c)));
                if B::QH {
                    let hw = at(qh_at);
                    let sixteen = _mm256_set1_epi8(0x10);
                    let lanes = _mm256_set_epi32(
                        0x0C0C_0C0C,
                        0x0808_0808,
                        0x0404_0404,
                        0,
                        0x0C0C_0C0C,
                        0x0808_0808,
                        0x0404_0404,
                        0,
                    );
                    for (g, t) in t.iter_mut().enumerate() {
                        let spread = _mm256_add_epi32(lanes, _mm256_set1_epi8((g / 2) as i8));
                        let bytes = _mm256_shuffle_epi8(hw, spread);
                        let bits = _mm256_set1_epi32(0x0804_0201 << (4 * (g % 2)));
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits);
                        *t = _mm256_or_si256(*t, _mm256_and_si256(set, sixteen));
                    }
                }
                if B::LUT {
                    t = t.map(|q| lookup(q));
                }
                t
            };
            quants8::<B>(t, &mut p);
            p
        }

        /// `p`'s quants from eight groups of four elements of eight rows (`t[g]`: a row
        /// per 32-bit lane, as stored, IQ4_NL's looked up).
        #[inline]
        #[target_feature(enable = $feat)]
        fn quants8<B: Q32>(t: [__m256i; 8], p: &mut Packed8) {
            for g in 0..8 {
                p.q[g] = weight_bytes::<B>(t[g], $vnni);
                if signed_products::<B>($vnni) {
                    p.s[g] = t[g];
                }
            }
        }

        /// Sub-block `i` of a group of sixteen interleaved IQ4_XS rows (sub-block `i % 8`
        /// of block `i / 8`), rows `8h..8h + 8`, as [`Packed8`]: an IQ4_NL block (its
        /// nibbles are units `4j..4j + 4` of the quants) whose scales are `d` (the rows').
        #[inline]
        #[target_feature(enable = $feat)]
        fn unpack_x8_xs(group: &[u8], i: usize, h: usize, d: __m256) -> Packed8 {
            let (b, j) = (xs_group_block(group, i / XS_SUB), i % XS_SUB);
            let mut p = Packed8::zero();
            p.d = d;
            let v = std::array::from_fn(|c| ld_u8x32(&b[XS_QS + 64 * (4 * j + c) + 32 * h..]));
            quants8::<BlockIq4Nl>(nibbles8(v).map(|q| lookup(q)), &mut p);
            p
        }

        /// [`rows_x16`] with eight rows a vector: up to four tokens with both halves of each
        /// group's blocks unpacked as the loop reads them, more through the prompt driver.
        /// Bit for bit the stored-layout kernels' result on the same rows in file order.
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn rows_x16_avx2<B: Q32>(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let size = std::mem::size_of::<B>();
            rows_x16_avx2_by::<B>(w, rb, (size, 1), acts, out, |group, i, h| {
                unpack_x8::<B>(group, i, h)
            })
        }

        /// [`rows_x16_avx2`] for IQ4_XS rows (their sub-blocks as IQ4_NL blocks).
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn rows_x16_avx2_xs(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let size = std::mem::size_of::<BlockIq4Xs>();
            // both drivers unpack a group's sub-blocks in order: a block's scales are made
            // at its first
            let mut sc = [[_mm256_setzero_ps(); XS_SUB]; 2];
            rows_x16_avx2_by::<BlockIq4Nl>(w, rb, (size, XS_SUB), acts, out, |group, i, h| {
                let j = i % XS_SUB;
                if j == 0 {
                    sc[h] = xs_scales_x8(xs_group_block(group, i / XS_SUB), h);
                }
                unpack_x8_xs(group, i, h, sc[h][j])
            })
        }

        /// [`rows_x16_avx2`] over blocks of `size` bytes, `per` units of `B`'s arithmetic each
        /// (IQ4_XS's eight sub-blocks), `unpack(group, i, h)` giving unit `i` of half `h`
        /// (called for each group's units in order, both halves of a unit together).
        ///
        /// Prompts run each chunk's two eight-row halves one after the other, but for plain
        /// AVX2's signed products (Q8_0, IQ4_NL, IQ4_XS: their sign vectors too), which run
        /// both at once. Four 4096 x 4096 matrices x 64 tokens, 2 threads, an Intel Xeon,
        /// `decode_bw TYPEx16 64` of both builds, two rounds, ms both at once / one after
        /// the other: AVX-VNNI Q4_1 6.8-7.1 / 5.9, Q5_0 7.0-7.4 / 6.0-6.3, Q8_0 7.1-7.5 /
        /// 6.3-6.5, IQ4_NL 6.9-7.1 / 5.9-6.0, IQ4_XS 6.5-6.9 / 6.1-6.4; AVX2 Q4_1 9.4-10.4 /
        /// 7.5-7.9, Q5_0 8.1-8.2 / 7.4-7.7, but Q8_0 11.0-11.1 / 14.2-14.4 and IQ4_NL
        /// 9.7-11.1 / 13.3-13.9.
        #[inline]
        #[target_feature(enable = $feat)]
        fn rows_x16_avx2_by<B: Q32>(
            w: &[u8],
            rb: usize,
            (size, per): (usize, usize),
            acts: &[&[ActQ8]],
            out: &mut [f32],
            mut unpack: impl FnMut(&[u8], usize, usize) -> Packed8,
        ) {
            let nt = acts.len();
            let Some((nrows, nb)) = x16_shape(w, rb, size, nt, out) else {
                return;
            };
            let nb = nb * per;
            if nt <= 4 {
                x16_tiles(w, rb, nt, |group, r, pf, _| {
                    by_tile!(acts, |xs| put_halves(
                        gemm8_by::<B, _, 2>(nb, |i, h| unpack(group, i, h), xs, pf),
                        r,
                        nrows,
                        out,
                        (nt, 0)
                    ))
                });
                return;
            }
            x16_chunked(
                w,
                rb,
                (nb, nt),
                [Packed8::zero(); 2],
                |group, i, p| *p = [unpack(group, i, 0), unpack(group, i, 1)],
                |p: &[[Packed8; 2]], r, t0| {
                    if signed_products::<B>($vnni) {
                        // plain AVX2's signed products: both halves at once
                        by_tile!(&acts[t0..], |xs| put_halves(
                            gemm8_by::<B, _, 2>(p.len(), |i, h| p[i][h], xs, &[]),
                            r,
                            nrows,
                            out,
                            (nt, t0)
                        ));
                        return;
                    }
                    // a half at a time
                    for h in 0..2 {
                        by_tile!(&acts[t0..], |xs| put_rows(
                            gemm8_by::<B, _, 1>(p.len(), |i, _| p[i][h], xs, &[])[0]
                                .map(|v| lanes8(v)),
                            r + 8 * h,
                            nrows,
                            out,
                            nt,
                            t0
                        ))
                    }
                },
            );
        }

        /// Prompt batches: groups of eight rows repacked a chunk at a time.
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn gemm_rows8<B: Q32>(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let nb = rb / std::mem::size_of::<B>();
            gemm_rows8_by::<B, B>(w, rb, nb, acts, out, |rows, i, p| repack8(rows, i, p))
        }

        /// [`gemm_rows8`] for IQ4_XS rows (their sub-blocks repacked).
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) fn gemm_rows8_xs(
            w: &[u8],
            rb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
        ) {
            let nb = rb / std::mem::size_of::<BlockIq4Xs>() * XS_SUB;
            // a block's scales made once for its sub-blocks (repacked in order)
            let mut sc = [_mm256_setzero_ps(); XS_SUB];
            gemm_rows8_by::<BlockIq4Nl, BlockIq4Xs>(w, rb, nb, acts, out, |rows, i, p| {
                if i % XS_SUB == 0 {
                    sc = xs_block_scales8(rows, i / XS_SUB);
                }
                repack8_xs(rows, i, sc[i % XS_SUB], p)
            })
        }

        /// The prompt driver over rows stored as blocks of `S`, `nb` blocks of `B`'s
        /// arithmetic a row, repacked by `repack(rows, i, p)`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn gemm_rows8_by<B: Q32, S>(
            w: &[u8],
            rb: usize,
            nb: usize,
            acts: &[&[ActQ8]],
            out: &mut [f32],
            repack: impl FnMut(&[&[S]; 8], usize, &mut Packed8),
        ) where
            S: zerocopy::FromBytes
                + zerocopy::Immutable
                + zerocopy::KnownLayout
                + zerocopy::Unaligned,
        {
            let (nt, nrows) = (acts.len(), w.len() / rb);
            chunked(
                w,
                rb,
                (nb, 8, nt),
                Packed8::zero(),
                |r| group8::<S>(w, rb, r, nrows),
                repack,
                |p: &[Packed8], r, t0| {
                    by_tile!(&acts[t0..], |xs| put_rows(
                        gemm8::<B, _>(p, xs).map(|v| lanes8(v)),
                        r,
                        nrows,
                        out,
                        nt,
                        t0
                    ))
                },
            );
        }
    };
}

/// `maddubs` of unsigned weight bytes (Q8_0's absolute values, Q5_0's quants) and signed
/// activations, widened to i32 (`madd`) before two pair sums (up to 2 * 128 * 127 each) could
/// overflow i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_abs(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)),
    )
}

/// `vpdpbusd` (AVX-VNNI).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dot_avx_vnni(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, u, x)
}

/// `vpdpbusd` in its EVEX encoding on 256-bit vectors (AVX512-VNNI).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn dot_evex_vnni(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, x)
}

/// Plain AVX2.
pub(super) mod plain {
    use super::*;
    q80_stored!("avx2,fma,f16c", false, dot_abs);
    q80_lanes8!("avx2,fma,f16c", false);
}

/// AVX-VNNI.
pub(super) mod vnni {
    use super::*;
    q80_stored!("avx2,fma,f16c,avxvnni", true, dot_avx_vnni);
    q80_lanes8!("avx2,fma,f16c,avxvnni", true);
}

/// AVX-512: the decode path on 256-bit vectors with EVEX `vpdpbusd` (and 32 registers);
/// prompt batches run sixteen rows a vector ([`gemm_rows16`]).
pub(super) mod evex {
    use super::*;
    q80_stored!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
        true,
        dot_evex_vnni
    );
}

/// Sixteen rows of one block for AVX-512 (VNNI): quants as [`weight_bytes`] makes them, rows
/// 8..16 in lanes 8..16.
#[derive(Clone, Copy)]
pub(super) struct Packed16 {
    q: [__m512i; 8],
    d: __m512,
    m: __m512,
}

impl Packed16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn zero() -> Packed16 {
        Packed16 {
            q: [_mm512_setzero_si512(); 8],
            d: _mm512_setzero_ps(),
            m: _mm512_setzero_ps(),
        }
    }
}

/// Repacks block `i` of sixteen rows (`lo`: rows 0..8, `hi`: 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16<B: Q32>(lo: &[&[B]; 8], hi: &[&[B]; 8], i: usize, p: &mut Packed16) {
    let half = |rows: &[&[B]; 8]| {
        let mut v = [_mm256_setzero_si256(); 8];
        for r in 0..8 {
            v[r] = weight_bytes::<B>(elements(&rows[r][i]), true);
        }
        v
    };
    p.q = transpose16(half(lo), half(hi));
    let ((dl, ml), (dh, mh)) = (scales_mins8(lo, i), scales_mins8(hi, i));
    p.d = join_ps(dl, dh);
    p.m = join_ps(ml, mh);
}

/// Repacks sub-block `i` of sixteen IQ4_XS rows (`lo`: rows 0..8, `hi`: 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn repack16_xs(
    (lo, hi): (&[&[BlockIq4Xs]; 8], &[&[BlockIq4Xs]; 8]),
    i: usize,
    d: __m512,
    p: &mut Packed16,
) {
    let half = |rows: &[&[BlockIq4Xs]; 8]| {
        let mut v = [_mm256_setzero_si256(); 8];
        for r in 0..8 {
            v[r] = weight_bytes::<BlockIq4Nl>(xs_elements(rows[r], i), true);
        }
        v
    };
    p.q = transpose16(half(lo), half(hi));
    p.d = d;
    p.m = _mm512_setzero_ps();
}

/// Block `i` of sixteen repacked rows against one token, added to `acc`: [`q80_lanes8`]'
/// `term8` on 512-bit vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn term16<B: Q32>(u: &Packed16, x: &[ActQ8], i: usize, acc: __m512) -> __m512 {
    let (x, h) = act_block(x, i);
    let mut s = [_mm512_setzero_si512(); 2];
    if let Some(shift) = offset_shift::<B>(true) {
        s[0] = _mm512_set1_epi32(x.nsum[4 * h] << shift);
    }
    for g in 0..8 {
        s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], u.q[g], bcast4x16(act4(x, h, g)));
    }
    let acc = step16(acc, u.d, x.d8[4 * h], _mm512_add_epi32(s[0], s[1]));
    if B::MIN {
        _mm512_fmadd_ps(u.m, _mm512_set1_ps(x.s4[2 * h + 1]), acc)
    } else {
        acc
    }
}

/// Sixteen repacked rows (block `i` in `p[i]`) against `N` tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemm16<B: Q32, const N: usize>(p: &[Packed16], xs: [&[ActQ8]; N]) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    for (i, u) in p.iter().enumerate() {
        for t in 0..N {
            acc[t] = term16::<B>(u, xs[t], i, acc[t]);
        }
    }
    acc
}

/// A chunk's sixteen-row groups (`p`, its blocks) from row `r` against the tile of tokens
/// `acts` (the first from `t0`), written to `out[row * nt + t0 + t]`: the run of both prompt
/// drivers (file order and interleaved).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn put16<B: Q32>(
    p: &[Packed16],
    acts: &[&[ActQ8]],
    (r, nrows): (usize, usize),
    out: &mut [f32],
    (nt, t0): (usize, usize),
) {
    by_tile!(acts, |xs| put_rows(
        gemm16::<B, _>(p, xs).map(|v| lanes16(v)),
        r,
        nrows,
        out,
        nt,
        t0
    ))
}

/// Prompt batches on AVX-512: groups of sixteen rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_rows16<B: Q32>(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let nb = rb / std::mem::size_of::<B>();
    gemm_rows16_by::<B, B>(w, rb, nb, acts, out, |(lo, hi), i, p| {
        repack16(lo, hi, i, p)
    })
}

/// [`gemm_rows16`] for IQ4_XS rows (their sub-blocks repacked).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn gemm_rows16_xs(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let nb = rb / std::mem::size_of::<BlockIq4Xs>() * XS_SUB;
    // a block's scales made once for its sub-blocks (repacked in order)
    let mut sc = [_mm512_setzero_ps(); XS_SUB];
    gemm_rows16_by::<BlockIq4Nl, BlockIq4Xs>(w, rb, nb, acts, out, |(lo, hi), i, p| {
        if i % XS_SUB == 0 {
            let k = i / XS_SUB;
            let (l, h) = (xs_block_scales8(lo, k), xs_block_scales8(hi, k));
            sc = std::array::from_fn(|j| join_ps(l[j], h[j]));
        }
        repack16_xs((lo, hi), i, sc[i % XS_SUB], p)
    })
}

/// The AVX-512 prompt driver over rows stored as blocks of `S`, `nb` blocks of `B`'s
/// arithmetic a row, repacked by `repack((rows 0..8, rows 8..16), i, p)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn gemm_rows16_by<B: Q32, S>(
    w: &[u8],
    rb: usize,
    nb: usize,
    acts: &[&[ActQ8]],
    out: &mut [f32],
    repack: impl FnMut(&([&[S]; 8], [&[S]; 8]), usize, &mut Packed16),
) where
    S: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + zerocopy::Unaligned,
{
    let (nt, nrows) = (acts.len(), w.len() / rb);
    chunked(
        w,
        rb,
        (nb, 16, nt),
        Packed16::zero(),
        |r| {
            (
                group8::<S>(w, rb, r, nrows),
                group8::<S>(w, rb, r + 8, nrows),
            )
        },
        repack,
        |p: &[Packed16], r, t0| put16::<B>(p, &acts[t0..], (r, nrows), out, (nt, t0)),
    );
}

/// Where an interleaved block's fields start (`crate::interleave`): the sixteen rows' `d`
/// (f16, two bytes a row) at 0, their mins next (Q4_1, Q5_1), then the fifth bits (one
/// 32-bit word a row: Q5_0, Q5_1), then the quants (four bytes a row a unit: Q8_0's eight
/// units of elements `4c..4c + 4`, the others' four units of nibble bytes `4c..4c + 4`, each
/// holding elements `4c..` low and `16 + 4c..` high). `(fifth bits, quants)`.
#[inline(always)]
fn x16_fields<B: Q32>() -> (usize, usize) {
    let qh = if B::MIN { 64 } else { 32 };
    (qh, if B::QH { qh + 64 } else { qh })
}

/// `pshufb` indices (per 128-bit lane) that copy byte `j` of each 32-bit lane to all four of
/// its bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn spread_byte(j: i8) -> __m512i {
    let lanes = _mm512_set4_epi32(0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0);
    _mm512_add_epi32(lanes, _mm512_set1_epi8(j))
}

/// Block `i` of a group of sixteen interleaved rows as [`Packed16`]: the scales (and mins)
/// converted, the quants as [`weight_bytes`] makes them (Q8_0's offset by 128, the others'
/// nibbles split, their fifth bits added: element `4g + e`'s is bit `4g + e` of the row's
/// word, so byte `g / 2` of each word is spread over the word's four bytes and bit `4(g % 2)
/// + e` of byte `e` tested).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn unpack_x16<B: Q32>(group: &[u8], i: usize, p: &mut Packed16) {
    let gb = GROUP * std::mem::size_of::<B>();
    let b = &group[i * gb..(i + 1) * gb];
    let (qh_at, qs_at) = x16_fields::<B>();
    p.d = _mm512_cvtph_ps(ld_u8x32(&b[..32]));
    if B::MIN {
        p.m = _mm512_cvtph_ps(ld_u8x32(&b[32..64]));
    }
    if B::SIGNED && !B::LUT {
        for g in 0..8 {
            let q = ld_u8x64(&b[qs_at + 64 * g..]);
            p.q[g] = _mm512_xor_si512(q, _mm512_set1_epi8(i8::MIN));
        }
        return;
    }
    nibbles_x16(b, qs_at, B::LUT, p);
    if B::QH {
        let h = ld_u8x64(&b[qh_at..]);
        let sixteen = _mm512_set1_epi8(0x10);
        for g in 0..8 {
            let bytes = _mm512_shuffle_epi8(h, spread_byte((g / 2) as i8));
            let bits = _mm512_set1_epi32(0x0804_0201 << (4 * (g % 2)));
            let set = _mm512_test_epi8_mask(bytes, bits);
            p.q[g] = _mm512_mask_add_epi8(p.q[g], set, p.q[g], sixteen);
        }
    }
}

/// `p`'s quants from four units of nibbles from `qs_at` of an interleaved group block `b`
/// (sixteen rows' elements `4c..4c + 4` low, `16 + 4c..` high): as they are, or (`lut`)
/// IQ4_NL's values looked up, offset by 128 as [`weight_bytes`] makes them with VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn nibbles_x16(b: &[u8], qs_at: usize, lut: bool, p: &mut Packed16) {
    let m4 = _mm512_set1_epi8(0x0F);
    let table = _mm512_broadcast_i32x4(ld_i8x16(&KVALUES_IQ4NL));
    let v: [__m512i; 4] = std::array::from_fn(|c| ld_u8x64(&b[qs_at + 64 * c..]));
    for g in 0..8 {
        let q = if g < 4 {
            _mm512_and_si512(v[g], m4)
        } else {
            _mm512_and_si512(_mm512_srli_epi16::<4>(v[g - 4]), m4)
        };
        p.q[g] = match lut {
            true => _mm512_xor_si512(_mm512_shuffle_epi8(table, q), _mm512_set1_epi8(i8::MIN)),
            false => q,
        };
    }
}

/// Sub-block `i` of a group of sixteen interleaved IQ4_XS rows (sub-block `i % 8` of block
/// `i / 8`) as [`Packed16`]: an IQ4_NL block whose scales are `d` (the rows').
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
fn unpack_x16_xs(group: &[u8], i: usize, d: __m512, p: &mut Packed16) {
    p.d = d;
    nibbles_x16(
        xs_group_block(group, i / XS_SUB),
        XS_QS + 64 * 4 * (i % XS_SUB),
        true,
        p,
    );
}

/// [`gemm16`] on a group of sixteen interleaved rows read as it goes (decode: each block
/// unpacked once for the tile's tokens), `pf` prefetched a few lines a block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn gemv_x16<B: Q32, const N: usize>(
    nb: usize,
    mut unpack: impl FnMut(usize, &mut Packed16),
    xs: [&[ActQ8]; N],
    pf: &[u8],
) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    let mut u = Packed16::zero();
    for i in 0..nb {
        prefetch_l2(pf, i, nb);
        unpack(i, &mut u);
        for t in 0..N {
            acc[t] = term16::<B>(&u, xs[t], i, acc[t]);
        }
    }
    acc
}

/// Q8_0, Q4_1, Q5_0, Q5_1 or IQ4_NL rows interleaved sixteen at a time against any number
/// of tokens (AVX-512 with VNNI): up to four tokens straight from the interleaved bytes, more
/// through the prompt driver with each chunk's groups unpacked once. Bit for bit the
/// stored-layout kernels' result on the same rows in file order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn rows_x16<B: Q32>(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let size = std::mem::size_of::<B>();
    rows_x16_by::<B>(w, rb, (size, 1), acts, out, |group, i, p| {
        unpack_x16::<B>(group, i, p)
    })
}

/// [`rows_x16`] for IQ4_XS rows (their sub-blocks as IQ4_NL blocks).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) fn rows_x16_xs(w: &[u8], rb: usize, acts: &[&[ActQ8]], out: &mut [f32]) {
    let size = std::mem::size_of::<BlockIq4Xs>();
    rows_x16_by::<BlockIq4Nl>(w, rb, (size, XS_SUB), acts, out, |group, i, p| {
        let (b, j) = (xs_group_block(group, i / XS_SUB), i % XS_SUB);
        let d = join_ps(xs_scales_x8_at(b, j, 0), xs_scales_x8_at(b, j, 1));
        unpack_x16_xs(group, i, d, p)
    })
}

/// [`rows_x16`] over blocks of `size` bytes, `per` units of `B`'s arithmetic each (IQ4_XS's
/// eight sub-blocks), `unpack(group, i, into)` giving unit `i` (called for each group's units
/// in order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn rows_x16_by<B: Q32>(
    w: &[u8],
    rb: usize,
    (size, per): (usize, usize),
    acts: &[&[ActQ8]],
    out: &mut [f32],
    mut unpack: impl FnMut(&[u8], usize, &mut Packed16),
) {
    let nt = acts.len();
    let Some((nrows, nb)) = x16_shape(w, rb, size, nt, out) else {
        return;
    };
    let nb = nb * per;
    if nt <= 4 {
        x16_tiles(w, rb, nt, |group, r, pf, _| {
            by_tile!(acts, |xs| put_rows(
                gemv_x16::<B, _>(nb, |i, p| unpack(group, i, p), xs, pf).map(|v| lanes16(v)),
                r,
                nrows,
                out,
                nt,
                0
            ))
        });
        return;
    }
    x16_chunked(
        w,
        rb,
        (nb, nt),
        Packed16::zero(),
        |group, i, p| unpack(group, i, p),
        |p: &[Packed16], r, t0| put16::<B>(p, &acts[t0..], (r, nrows), out, (nt, t0)),
    );
}
