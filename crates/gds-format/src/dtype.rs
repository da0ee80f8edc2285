//! The element types a tensor may have, numbered as ggml numbers them so that GGUF tensors
//! pass through unchanged, with the block geometry each one has on disk.

use std::fmt;

/// A tensor element type. The discriminant is the ggml type id, which is also the value
/// stored in [`crate::raw::TensorEntry::dtype`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum DType {
    /// IEEE-754 binary32.
    F32 = 0,
    /// IEEE-754 binary16.
    F16 = 1,
    /// 32 weights: f16 scale, 16 bytes of 4-bit quants.
    Q4_0 = 2,
    /// 32 weights: f16 scale, f16 min, 16 bytes of 4-bit quants.
    Q4_1 = 3,
    /// 32 weights: f16 scale, 4 bytes of high bits, 16 bytes of low nibbles.
    Q5_0 = 6,
    /// 32 weights: f16 scale, f16 min, 4 bytes of high bits, 16 bytes of low nibbles.
    Q5_1 = 7,
    /// 32 weights: f16 scale, 32 signed bytes.
    Q8_0 = 8,
    /// 32 weights: f16 scale, f16 sum, 32 signed bytes.
    Q8_1 = 9,
    /// 256-weight super-block, 2-bit quants.
    Q2K = 10,
    /// 256-weight super-block, 3-bit quants.
    Q3K = 11,
    /// 256-weight super-block, 4-bit quants.
    Q4K = 12,
    /// 256-weight super-block, 5-bit quants.
    Q5K = 13,
    /// 256-weight super-block, 6-bit quants.
    Q6K = 14,
    /// 256-weight super-block, f32 scale, 8-bit quants and block sums.
    Q8K = 15,
    /// 256-weight super-block (llama.cpp's i-quants, 2.06 bits a weight): f16 scale, 32
    /// u16 words; each 32 weights four 8-bit indices into a grid of 256 eight-value rows
    /// (`iq2xxs_grid`), four 7-bit sign indices and a 4-bit scale.
    Iq2Xxs = 16,
    /// 256-weight super-block (2.31 bits): f16 scale, 32 u16 words (a 9-bit index into the
    /// 512-row `iq2xs_grid`, a 7-bit sign index), eight bytes of two 4-bit scales.
    Iq2Xs = 17,
    /// 256-weight super-block (3.06 bits): f16 scale, 64 8-bit indices into the 256-row
    /// four-value `iq3xxs_grid`, eight u32 of four 7-bit sign indices and a 4-bit scale.
    Iq3Xxs = 18,
    /// 256-weight super-block (1.56 bits): f16 scale, 32 index bytes, eight u16 of index
    /// high bits, a 3-bit scale and a shift sign; values from the 2048-row `iq1s_grid`.
    Iq1S = 19,
    /// 32 weights: f16 scale, 16 bytes of 4-bit indices into a non-linear table of 16 int8
    /// values (ggml's `kvalues_iq4nl`).
    Iq4Nl = 20,
    /// 256-weight super-block (3.44 bits): f16 scale, 64 index bytes, 8 bytes of index high
    /// bits (512-row four-value `iq3s_grid`), 32 sign bytes, four bytes of two 4-bit scales.
    Iq3S = 21,
    /// 256-weight super-block (2.5 bits): f16 scale, 32 index bytes, 32 sign bytes, 8 bytes of
    /// index high bits (1024-row `iq2s_grid`), eight bytes of two 4-bit scales.
    Iq2S = 22,
    /// 256-weight super-block: f16 scale, eight 6-bit sub-block scales stored plus 32 (their
    /// 2 high bits in a u16, their 4 low bits in 4 bytes), 128 bytes of IQ4_NL indices.
    Iq4Xs = 23,
    /// Signed 8-bit integer.
    I8 = 24,
    /// Signed 16-bit integer.
    I16 = 25,
    /// Signed 32-bit integer.
    I32 = 26,
    /// Signed 64-bit integer.
    I64 = 27,
    /// IEEE-754 binary64.
    F64 = 28,
    /// 256-weight super-block (1.75 bits): 32 index bytes, 16 bytes of index high bits and
    /// shift signs, eight bytes of 3-bit scales whose top nibbles hold the f16 scale.
    Iq1M = 29,
    /// bfloat16.
    BF16 = 30,
    /// 32 weights: an E8M0 power-of-two scale byte, 16 bytes of 4-bit E2M1 values (OCP
    /// microscaling FP4; gpt-oss's experts).
    MXFP4 = 39,
}

/// All dtypes this version of the format defines, in id order.
pub const ALL_DTYPES: [DType; 30] = [
    DType::F32,
    DType::F16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q8_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q8K,
    DType::Iq2Xxs,
    DType::Iq2Xs,
    DType::Iq3Xxs,
    DType::Iq1S,
    DType::Iq4Nl,
    DType::Iq3S,
    DType::Iq2S,
    DType::Iq4Xs,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::F64,
    DType::Iq1M,
    DType::BF16,
    DType::MXFP4,
];

/// llama.cpp's grid i-quants (IQ1_S … IQ3_S): 256-element blocks whose values index grid
/// tables (SPEC.md §4).
pub const IQ_GRID_DTYPES: [DType; 7] = [
    DType::Iq2Xxs,
    DType::Iq2Xs,
    DType::Iq2S,
    DType::Iq3Xxs,
    DType::Iq3S,
    DType::Iq1S,
    DType::Iq1M,
];

impl DType {
    /// The dtype with ggml id `id`, if the format defines it.
    pub fn from_id(id: u32) -> Option<DType> {
        ALL_DTYPES.iter().copied().find(|d| *d as u32 == id)
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block (1 for scalar types).
    pub fn block_size(self) -> usize {
        use DType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | MXFP4 | Iq4Nl => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq4Xs | Iq2Xxs | Iq2Xs | Iq2S | Iq3Xxs | Iq3S
            | Iq1S | Iq1M => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use DType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            MXFP4 => 17,
            Iq4Nl => 18,
            Iq4Xs => 136,
            Iq2Xxs => 66,
            Iq2Xs => 74,
            Iq2S => 82,
            Iq3Xxs => 98,
            Iq3S => 110,
            Iq1S => 50,
            Iq1M => 56,
        }
    }

    /// True for the block-quantized types.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// True for F32, F16, BF16 and F64.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// The name used in SPEC.md, GGUF tools and the CLIs (`q4_k`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        use DType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2K => "q2_k",
            Q3K => "q3_k",
            Q4K => "q4_k",
            Q5K => "q5_k",
            Q6K => "q6_k",
            Q8K => "q8_k",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            BF16 => "bf16",
            MXFP4 => "mxfp4",
            Iq4Nl => "iq4_nl",
            Iq4Xs => "iq4_xs",
            Iq2Xxs => "iq2_xxs",
            Iq2Xs => "iq2_xs",
            Iq2S => "iq2_s",
            Iq3Xxs => "iq3_xxs",
            Iq3S => "iq3_s",
            Iq1S => "iq1_s",
            Iq1M => "iq1_m",
        }
    }

    /// Parses a name as printed by [`DType::name`] (case-insensitive).
    pub fn from_name(name: &str) -> Option<DType> {
        let lower = name.to_ascii_lowercase();
        ALL_DTYPES.iter().copied().find(|d| d.name() == lower)
    }

    /// Bytes taken by one row of `n` elements, or `None` when `n` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }

    /// Bytes taken by a tensor of this dtype and `shape` (row-major, last dimension
    /// contiguous), or `None` when the last dimension is not a whole number of blocks or the
    /// size overflows.
    pub fn tensor_bytes(self, shape: &[u64]) -> Option<u64> {
        let (&last, outer) = match shape.split_last() {
            Some(s) => s,
            None => return Some(self.type_size() as u64).filter(|_| self.block_size() == 1),
        };
        let rows = outer.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
        self.row_bytes(last)?.checked_mul(rows)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for d in ALL_DTYPES {
            assert_eq!(DType::from_id(d.id()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::from_id(4), None, "4 was Q4_2, removed from ggml");
        assert_eq!(DType::from_id(31), None);
    }

    #[test]
    fn sizes_match_ggml_table() {
        // bytes per 256 weights, from ggml's type_traits table
        assert_eq!(DType::Q4_0.tensor_bytes(&[256]), Some(8 * 18));
        assert_eq!(DType::Q6K.tensor_bytes(&[2, 256]), Some(2 * 210));
        assert_eq!(DType::BF16.tensor_bytes(&[3, 5]), Some(30));
        assert_eq!(DType::MXFP4.tensor_bytes(&[2, 64]), Some(4 * 17));
        assert_eq!(DType::Iq4Nl.tensor_bytes(&[2, 64]), Some(4 * 18));
        assert_eq!(DType::Iq4Xs.tensor_bytes(&[3, 512]), Some(6 * 136));
        assert_eq!(
            DType::Iq4Xs.tensor_bytes(&[64]),
            None,
            "not a whole super-block"
        );
        assert_eq!(DType::Q4K.tensor_bytes(&[100]), None, "not whole blocks");
        assert_eq!(DType::F32.tensor_bytes(&[u64::MAX, 2]), None, "overflow");
    }
}
