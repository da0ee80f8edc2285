//! Block-quantized rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS) interleaved sixteen
//! at a time: the in-memory layout the AVX-512 kernels (sixteen rows a vector) and the AVX2
//! ones (each 32-byte half of a unit, eight rows) read without repacking (llama.cpp repacks its CPU weights the same way, into
//! buffers of their own; here the bytes are rewritten in place, so a model held in memory
//! costs no more memory than its file).
//!
//! A group of sixteen rows takes exactly the bytes of its sixteen rows (`16 * rb`), block
//! after block, and each block of the group is its sixteen rows' blocks with every field
//! interleaved by units: the f16 fields (`d`, then the min `m` or `dmin` where the type has one)
//! two bytes a row, everything else four bytes a row (Q4_K's three words of packed scales,
//! then the quants; Q6_K's low quant bits, high bits and sixteen scales). So a unit `u` of
//! a field is sixteen rows' units side by side: a 512-bit load holds four quant bytes of
//! each row, a row per 32-bit lane (elements `4k..4k + 4` in the
//! low nibbles and their partners in the high ones), ready for `vpdpbusd`/`maddubs` against
//! four broadcast activation bytes; a 256-bit load holds the sixteen rows' scales.
//!
//! - Q4_0 (288 bytes a group block): `d` at `2r`; quant bytes `4k..4k + 4` at
//!   `32 + 64k + 4r`. The other 32-element types the same way: `d` at `2r`, Q4_1's and
//!   Q5_1's `m` at `32 + 2r`, then Q5_0's and Q5_1's fifth-bit word of each row (`4r`), then
//!   the quant bytes (Q8_0's eight units, the others' four). IQ4_NL is laid out as Q4_0.
//! - IQ4_XS (2176 bytes): `d` at `2r`, `scales_h` at `32 + 2r`, `scales_l` at `64 + 4r`;
//!   quant bytes `4k..4k + 4` at `128 + 64k + 4r`, so sub-block `j`'s (bytes `16j..16j + 16`
//!   of a row, an IQ4_NL block's nibbles) are units `4j..4j + 4`.
//! - Q4_K (2304 bytes): `d` at `2r`, `dmin` at `32 + 2r`; scale word `k` at `64 + 64k + 4r`;
//!   quant bytes `4c..4c + 4` at `256 + 64c + 4r`.
//! - Q5_K (2816 bytes): Q4_K's `d`, `dmin` and scale words, then the fifth-bit bytes
//!   `4c..4c + 4` at `256 + 64c + 4r`, the quant bytes `4c..4c + 4` at `768 + 64c + 4r`.
//! - MXFP4 (272 bytes): the scale byte `e` at `r`; quant bytes `4k..4k + 4` at `16 + 64k + 4r`.
//! - Q6_K (3360 bytes): `ql` bytes `4c..4c + 4` at `64c + 4r`, `qh` bytes `4c..` at
//!   `2048 + 64c + 4r`, scale word `k` at `3072 + 64k + 4r`, `d` at `3328 + 2r`.
//!
//! Only matrices whose row count is a multiple of sixteen are interleaved; rows are never
//! split across groups, so a run of whole groups is a valid interleaved matrix of its own
//! (what a thread's share of the rows is).

use crate::KernelError;
use gds_format::DType;
use rayon::prelude::*;

/// Rows per interleaved group: a matrix (or each matrix stacked in it, as a mixture's
/// experts are) must have a multiple of it to be interleaved.
pub const GROUP: usize = 16;

/// How a weight matrix's bytes are laid out in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Row after row, as in the file.
    #[default]
    Rows,
    /// Rows interleaved sixteen at a time ([`interleave`]; the types [`interleavable`] names).
    Interleaved16,
}

/// The bytes of a block that hold its narrow fields, and their width a row when interleaved
/// (the f16 fields two bytes, MXFP4's scale byte one; the rest goes four bytes a row), for
/// the types that can be interleaved.
fn narrow_fields(dtype: DType) -> Option<(std::ops::Range<usize>, usize)> {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::Iq4Nl => Some((0..2, 2)),
        DType::Iq4Xs => Some((0..4, 2)),
        DType::Q4_1 | DType::Q5_1 => Some((0..4, 2)),
        DType::Q4K | DType::Q5K => Some((0..4, 2)),
        DType::Q6K => Some((208..210, 2)),
        DType::MXFP4 => Some((0..1, 1)),
        _ => None,
    }
}

/// Whether `dtype` has an interleaved layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
/// MXFP4, IQ4_NL, IQ4_XS).
pub fn interleavable(dtype: DType) -> bool {
    narrow_fields(dtype).is_some()
}

fn check(dtype: DType, data: &[u8], rows: usize, cols: usize) -> Result<usize, KernelError> {
    let bs = dtype.block_size();
    if !interleavable(dtype) || !cols.is_multiple_of(bs) || !rows.is_multiple_of(GROUP) {
        return Err(KernelError::Shape(format!(
            "a {rows}x{cols} {dtype} matrix cannot be interleaved: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL and IQ4_XS only, \
             rows a multiple of {GROUP}, whole blocks"
        )));
    }
    let rb = cols / bs * dtype.type_size();
    if rows.checked_mul(rb) != Some(data.len()) {
        return Err(KernelError::Shape(format!(
            "a {rows}x{cols} {dtype} matrix takes {} bytes, got {}",
            rows * rb,
            data.len()
        )));
    }
    Ok(rb)
}

/// Rewrites a row-major matrix of an [`interleavable`] type in place as sixteen-row groups
/// ([`Layout::Interleaved16`]).
pub fn interleave(
    dtype: DType,
    data: &mut [u8],
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    regroup(dtype, data, (rows, cols), false)
}

/// The inverse of [`interleave`].
pub fn deinterleave(
    dtype: DType,
    data: &mut [u8],
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    regroup(dtype, data, (rows, cols), true)
}

/// Each group of sixteen rows into the interleaved layout, or `back` from it, in parallel.
fn regroup(
    dtype: DType,
    data: &mut [u8],
    (rows, cols): (usize, usize),
    back: bool,
) -> Result<(), KernelError> {
    let rb = check(dtype, data, rows, cols)?;
    if rb > 0 {
        let map = Map::of(dtype);
        data.par_chunks_mut(GROUP * rb).for_each(|g| {
            let src = g.to_vec();
            if back {
                map.rows_from_group(&src, rb, g);
            } else {
                map.group_from_rows(&src, rb, g);
            }
        });
    }
    Ok(())
}

/// Where each byte of a row's block goes in its group.
pub(crate) struct Map {
    /// Bytes of one block of one row.
    block: usize,
    /// Each unit of a row's block: `(offset in the group block of row 0's copy, bytes,
    /// offset in the row's block)`; row `r`'s copy is `r * bytes` further.
    units: Vec<(usize, usize, usize)>,
}

impl Map {
    /// The map of an interleavable type (panics on another: callers checked).
    pub(crate) fn of(dtype: DType) -> Map {
        let (narrow, width) = narrow_fields(dtype).expect("an interleavable type");
        let block = dtype.type_size();
        let mut units = Vec::new();
        let mut j = 0;
        while j < block {
            let u = if narrow.contains(&j) { width } else { 4 };
            units.push((GROUP * j, u, j));
            j += u;
        }
        Map { block, units }
    }

    /// Sixteen rows (`rows`, `rb` bytes each) into one interleaved group `out`.
    pub(crate) fn group_from_rows(&self, rows: &[u8], rb: usize, out: &mut [u8]) {
        let (bs, gb) = (self.block, GROUP * self.block);
        for (i, dst) in out.chunks_exact_mut(gb).enumerate() {
            let src: [&[u8]; GROUP] = std::array::from_fn(|r| &rows[r * rb + i * bs..][..bs]);
            for &(o, u, j) in &self.units {
                let d = &mut dst[o..o + GROUP * u];
                // fixed-size copies (a variable length would be a call to memcpy each)
                match u {
                    4 => {
                        for (d, s) in d.chunks_exact_mut(4).zip(&src) {
                            d.copy_from_slice(&s[j..j + 4]);
                        }
                    }
                    2 => {
                        for (d, s) in d.chunks_exact_mut(2).zip(&src) {
                            d.copy_from_slice(&s[j..j + 2]);
                        }
                    }
                    _ => {
                        for (d, s) in d.iter_mut().zip(&src) {
                            *d = s[j];
                        }
                    }
                }
            }
        }
    }

    /// One interleaved group back into sixteen rows.
    pub(crate) fn rows_from_group(&self, group: &[u8], rb: usize, out: &mut [u8]) {
        let (bs, gb) = (self.block, GROUP * self.block);
        for (i, src) in group.chunks_exact(gb).enumerate() {
            for &(o, u, j) in &self.units {
                let s = &src[o..o + GROUP * u];
                for (r, s) in s.chunks_exact(u).enumerate() {
                    let at = r * rb + i * bs + j;
                    match u {
                        4 => out[at..at + 4].copy_from_slice(&s[..4]),
                        2 => out[at..at + 2].copy_from_slice(&s[..2]),
                        _ => out[at] = s[0],
                    }
                }
            }
        }
    }
}

/// Whether the best instruction set of this process ([`crate::Isa::best`]) has kernels
/// that read `dtype`'s [`Layout::Interleaved16`] directly (AVX-512 VNNI sixteen rows a
/// vector, AVX2 and AVX-VNNI two halves of eight; the scalar kernels none) and interleaving
/// pays for it. Elsewhere an interleaved matrix still multiplies correctly (each group is
/// put back into rows first), only slower, so a caller interleaves when this says so.
///
/// Q8_0 is left in file order but on plain AVX2: with AVX-512 its file-order decode kernel
/// already reads memory at the memory's rate, and a model's decode measured 7 % slower
/// interleaved (SmolLM3-3B's shape on Zen 4, `GDS_INTERLEAVE={all,0} gdsrun bench -p 0 -n
/// 64`, four interleaved rounds: 7.6-8.1 against 8.0-8.8 t/s), though the kernel is faster
/// from L2 (71-78 against 40-57 GB/s); capped at AVX2 (`GDS_ISA=avx2`, `-n 32`, three rounds)
/// interleaved was the faster each round (8.3-9.2 against 7.5-8.4 t/s). AVX-VNNI, unmeasured,
/// keeps the file order.
///
/// IQ4_NL and IQ4_XS are interleaved on every instruction set: their decode kernels over the
/// layout need no sums across lanes (`decode_bw iq4_xs[x16]`, a 1024 x 2048 matrix from L2,
/// 2 threads, an Intel Xeon with AVX-512 VNNI: AVX-512 26-28 against 37 µs, AVX-VNNI 32
/// against 41, AVX2 39 against 44; streamed 64 x 8192 x 2048 equal or faster), prompts as
/// fast (AVX2) or faster (AVX-512) but with AVX-VNNI 10-25 % slower (64 tokens). End to end
/// with AVX-VNNI (Llama-3.2-1B's shape in IQ4_XS) decode gained more (tg32 1.09-1.13x) than
/// prompts lost (pp128 0.94-0.98x), so it is interleaved there too
/// (bench/runs/2026-12-04-iq4-interleaved.md). `GDS_INTERLEAVE=0` in the environment says no for every type (to
/// measure the file-order kernels against these on one machine), `GDS_INTERLEAVE=all` yes
/// for Q8_0 too.
pub fn interleave_pays(dtype: DType) -> bool {
    let env = std::env::var("GDS_INTERLEAVE").ok();
    // every ISA but the scalar one has kernels over the layout
    let isa = crate::Isa::best();
    if env.as_deref() == Some("0") || !interleavable(dtype) || isa == crate::Isa::Scalar {
        return false;
    }
    match dtype {
        DType::Q8_0 => env.as_deref() == Some("all") || isa == crate::Isa::Avx2,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_is_a_permutation_undone_by_its_inverse() {
        for (dtype, cols) in [
            (DType::Q4_0, 96),
            (DType::Q4K, 512),
            (DType::Q5K, 512),
            (DType::Q6K, 512),
            (DType::Iq4Nl, 96),
            (DType::Iq4Xs, 512),
        ] {
            let rows = 32;
            let rb = cols / dtype.block_size() * dtype.type_size();
            let orig: Vec<u8> = (0..rows * rb).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut d = orig.clone();
            interleave(dtype, &mut d, rows, cols).unwrap();
            assert_ne!(d, orig);
            let (mut a, mut b) = (orig.clone(), d.clone());
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "{dtype}: the same bytes, moved");
            // row 17's block 1: where the layout (module docs) says its fields go
            let (g, r, i) = (1, 1, 1);
            let ts = dtype.type_size();
            let src = &orig[(16 * g + r) * rb + i * ts..][..ts];
            let grp = &d[g * 16 * rb + i * 16 * ts..][..16 * ts];
            if dtype == DType::Q6K {
                assert_eq!(grp[64 * 5 + 4 * r..][..4], src[20..24], "ql");
                assert_eq!(grp[2048 + 64 * 15 + 4 * r..][..4], src[188..192], "qh");
                assert_eq!(grp[3072 + 64 * 3 + 4 * r..][..4], src[204..208], "scales");
                assert_eq!(grp[3328 + 2 * r..][..2], src[208..], "d");
            } else if dtype == DType::Q5K {
                assert_eq!(grp[32 + 2 * r..][..2], src[2..4], "dmin");
                assert_eq!(grp[64 + 64 * 2 + 4 * r..][..4], src[12..16], "scales");
                assert_eq!(grp[256 + 64 * 7 + 4 * r..][..4], src[44..48], "qh");
                assert_eq!(grp[768 + 64 * 31 + 4 * r..][..4], src[172..], "quants");
            } else if dtype == DType::Iq4Xs {
                assert_eq!(grp[2 * r..][..2], src[..2], "{dtype} d");
                assert_eq!(grp[32 + 2 * r..][..2], src[2..4], "scales_h");
                assert_eq!(grp[64 + 4 * r..][..4], src[4..8], "scales_l");
                // sub-block 5's nibble bytes 4..8 (quant unit 4 * 5 + 1)
                assert_eq!(
                    grp[128 + 64 * 21 + 4 * r..][..4],
                    src[8 + 84..8 + 88],
                    "quants"
                );
            } else if matches!(dtype, DType::Q4_0 | DType::Iq4Nl) {
                assert_eq!(grp[2 * r..][..2], src[..2], "{dtype} d");
                assert_eq!(grp[32 + 4 * r + 3], src[2 + 3]);
                assert_eq!(grp[32 + 64 * 3 + 4 * r], src[2 + 12]);
            } else {
                assert_eq!(grp[2 * r..][..2], src[..2], "{dtype} d");
                assert_eq!(grp[32 + 2 * r..][..2], src[2..4], "dmin");
                assert_eq!(
                    grp[64 + 64 * 2 + 4 * r..][..4],
                    src[4 + 8..4 + 12],
                    "scales"
                );
                assert_eq!(grp[256 + 64 * 31 + 4 * r..][..4], src[16 + 124..], "quants");
            }
            deinterleave(dtype, &mut d, rows, cols).unwrap();
            assert_eq!(d, orig, "{dtype}");
        }
    }

    #[test]
    fn shapes_that_cannot_be_grouped_are_refused() {
        let mut d = vec![0u8; 8 * 18];
        assert!(interleave(DType::Q4_0, &mut d, 8, 32).is_err(), "8 rows");
        let mut d = vec![0u8; 16 * 18];
        assert!(
            interleave(DType::Q4_0, &mut d, 16, 33).is_err(),
            "33 columns"
        );
        assert!(
            interleave(DType::Q4_0, &mut d[1..], 16, 32).is_err(),
            "short"
        );
        let mut k = vec![0u8; 16 * 110];
        assert!(interleave(DType::Q3K, &mut k, 16, 256).is_err(), "Q3_K");
        assert!(interleave(DType::Q4_0, &mut d, 16, 32).is_ok());
    }
}
