//! Q4_0 rows interleaved sixteen at a time, the in-memory layout the AVX-512 kernels read
//! without repacking (llama.cpp repacks its CPU weights the same way, into
//! `block_q4_0x8`/`x16` buffers of their own; here the bytes are rewritten in place, so a
//! model held in memory costs no more memory than its file).
//!
//! A group of sixteen rows takes exactly the bytes of its sixteen rows (`16 * rb`), block
//! after block; block `i` of a group is 288 bytes:
//! - bytes `0..32`: the sixteen rows' f16 scales, row `r` at `2r`;
//! - bytes `32 + 64k..32 + 64(k + 1)` for `k` in `0..4`: bytes `4k..4k + 4` of each row's
//!   sixteen quant bytes, row `r` at `4r`: one 512-bit load holds elements `4k..4k + 4`
//!   (low nibbles) and `16 + 4k..16 + 4k + 4` (high nibbles) of all sixteen rows, a row per
//!   32-bit lane, ready for `vpdpbusd` against four broadcast activation bytes.
//!
//! Only matrices whose row count is a multiple of sixteen are interleaved; rows are never
//! split across groups, so a run of whole groups is a valid interleaved matrix of its own
//! (what a thread's share of the rows is).

use crate::blocks::{BlockQ4_0, QK};
use crate::KernelError;
use rayon::prelude::*;

/// Rows per interleaved group.
pub const GROUP: usize = 16;
/// Bytes of one Q4_0 block.
const BLOCK: usize = std::mem::size_of::<BlockQ4_0>();
/// Bytes of one block of a group.
pub(crate) const GROUP_BLOCK: usize = GROUP * BLOCK;

/// How a weight matrix's bytes are laid out in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Row after row, as in the file.
    #[default]
    Rows,
    /// Q4_0 rows interleaved sixteen at a time ([`interleave_q4_0`]).
    Q4_0x16,
}

fn check(data: &[u8], rows: usize, cols: usize) -> Result<usize, KernelError> {
    if !cols.is_multiple_of(QK) || !rows.is_multiple_of(GROUP) {
        return Err(KernelError::Shape(format!(
            "a {rows}x{cols} Q4_0 matrix cannot be interleaved: rows must be a multiple of \
             {GROUP} and columns of {QK}"
        )));
    }
    let rb = cols / QK * BLOCK;
    if rows.checked_mul(rb) != Some(data.len()) {
        return Err(KernelError::Shape(format!(
            "a {rows}x{cols} Q4_0 matrix takes {} bytes, got {}",
            rows * rb,
            data.len()
        )));
    }
    Ok(rb)
}

/// Rewrites a row-major Q4_0 matrix in place as sixteen-row groups ([`Layout::Q4_0x16`]).
pub fn interleave_q4_0(data: &mut [u8], rows: usize, cols: usize) -> Result<(), KernelError> {
    let rb = check(data, rows, cols)?;
    if rb == 0 {
        return Ok(());
    }
    data.par_chunks_mut(GROUP * rb).for_each(|g| {
        let rows = g.to_vec();
        group_from_rows(&rows, rb, g);
    });
    Ok(())
}

/// The inverse of [`interleave_q4_0`].
pub fn deinterleave_q4_0(data: &mut [u8], rows: usize, cols: usize) -> Result<(), KernelError> {
    let rb = check(data, rows, cols)?;
    if rb == 0 {
        return Ok(());
    }
    data.par_chunks_mut(GROUP * rb).for_each(|g| {
        let group = g.to_vec();
        rows_from_group(&group, rb, g);
    });
    Ok(())
}

/// Where byte `j` of row `r`'s block `i` goes in its group: the scale's two bytes (`j` 0, 1),
/// then the quant bytes.
#[inline]
fn at(i: usize, r: usize, j: usize) -> usize {
    let base = i * GROUP_BLOCK;
    if j < 2 {
        base + 2 * r + j
    } else {
        let q = j - 2;
        base + 2 * GROUP + 64 * (q / 4) + 4 * r + q % 4
    }
}

/// Sixteen rows (`rows`, `rb` bytes each) into one interleaved group `out`.
pub(crate) fn group_from_rows(rows: &[u8], rb: usize, out: &mut [u8]) {
    for (r, row) in rows.chunks_exact(rb).enumerate() {
        for (i, b) in row.chunks_exact(BLOCK).enumerate() {
            out[at(i, r, 0)..at(i, r, 0) + 2].copy_from_slice(&b[..2]);
            for k in 0..4 {
                let o = at(i, r, 2 + 4 * k);
                out[o..o + 4].copy_from_slice(&b[2 + 4 * k..6 + 4 * k]);
            }
        }
    }
}

/// One interleaved group back into sixteen rows.
pub(crate) fn rows_from_group(group: &[u8], rb: usize, out: &mut [u8]) {
    for (r, row) in out.chunks_exact_mut(rb).enumerate() {
        for (i, b) in row.chunks_exact_mut(BLOCK).enumerate() {
            b[..2].copy_from_slice(&group[at(i, r, 0)..at(i, r, 0) + 2]);
            for k in 0..4 {
                let o = at(i, r, 2 + 4 * k);
                b[2 + 4 * k..6 + 4 * k].copy_from_slice(&group[o..o + 4]);
            }
        }
    }
}

/// Whether the best instruction set of this process ([`crate::Isa::best`]) has kernels
/// that read [`Layout::Q4_0x16`] directly (AVX-512 VNNI). Elsewhere an interleaved matrix
/// still multiplies correctly (each group is put back into rows first), only slower, so a
/// caller interleaves when this says so. `GDS_Q4_0_INTERLEAVE=0` in the environment says
/// no (to measure the file-order kernels against these on one machine).
pub fn interleave_q4_0_pays() -> bool {
    crate::Isa::best() == crate::Isa::Avx512Vnni
        && std::env::var_os("GDS_Q4_0_INTERLEAVE").is_none_or(|v| v != "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_is_a_permutation_undone_by_its_inverse() {
        let (rows, cols) = (32, 96);
        let orig: Vec<u8> = (0..rows * cols / QK * BLOCK)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        let mut d = orig.clone();
        interleave_q4_0(&mut d, rows, cols).unwrap();
        assert_ne!(d, orig);
        let (mut a, mut b) = (orig.clone(), d.clone());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "the same bytes, moved");
        // row 17's block 2: its scale and its fourth quant byte, where the layout says
        let rb = cols / QK * BLOCK;
        let (g, r, i) = (1, 1, 2);
        let src = &orig[(16 * g + r) * rb + i * BLOCK..];
        let grp = &d[g * 16 * rb..];
        assert_eq!(grp[i * GROUP_BLOCK + 2 * r..][..2], src[..2]);
        assert_eq!(grp[i * GROUP_BLOCK + 32 + 4 * r + 3], src[2 + 3]);
        assert_eq!(grp[i * GROUP_BLOCK + 32 + 64 * 3 + 4 * r], src[2 + 12]);
        deinterleave_q4_0(&mut d, rows, cols).unwrap();
        assert_eq!(d, orig);
    }

    #[test]
    fn shapes_that_cannot_be_grouped_are_refused() {
        let mut d = vec![0u8; 8 * BLOCK];
        assert!(interleave_q4_0(&mut d, 8, 32).is_err(), "8 rows");
        let mut d = vec![0u8; 16 * BLOCK];
        assert!(interleave_q4_0(&mut d, 16, 33).is_err(), "33 columns");
        assert!(interleave_q4_0(&mut d[1..], 16, 32).is_err(), "short");
        assert!(interleave_q4_0(&mut d, 16, 32).is_ok());
    }
}
