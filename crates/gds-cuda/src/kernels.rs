//! The CUDA kernel sources, embedded in the binary and compiled at run time by NVRTC.
//!
//! Each file of `kernels/` is a program body; [`PRELUDE`] (`kernels/common.cuh`) is
//! prepended to it. The same text compiles as C++ against `kernels/emu.h` in the tests, so
//! the arithmetic the GPU runs is checked on the CPU against `gds-kernels`.

use gds_format::DType;

/// Types, f16 decoding, warp/block reductions shared by every kernel file.
pub const PRELUDE: &str = include_str!("../kernels/common.cuh");

/// `(file name, body)` of every kernel file, in the order they are concatenated.
pub const FILES: &[(&str, &str)] = &[
    ("quant.cu", include_str!("../kernels/quant.cu")),
    ("ops.cu", include_str!("../kernels/ops.cu")),
];

/// Rows per block of the `matvec_*` kernels (blockDim = 32 × this); `MATVEC_ROWS` in
/// common.cuh.
pub const MATVEC_ROWS: u32 = 4;
/// Threads per block of the row-wise kernels; `BLOCK_THREADS` in common.cuh.
pub const BLOCK_THREADS: u32 = 256;
/// Warps per block of the int8 `matvec_q8_*` kernels (blockDim = 32 × this); `MMQ8_WARPS`
/// in common.cuh (the default of [`Mmq8Shape`]).
pub const MMQ8_WARPS: u32 = 4;
/// Rows per block of the `matvec_q8_*` kernels; `MMQ8_ROWS` in common.cuh.
pub const MMQ8_ROWS: u32 = 2;

/// The environment variable that compiles the int8 matvec kernels for another block shape
/// (`WARPSxROWS`, e.g. `8x1`; [`Mmq8Shape::parse`]): the sweep of that shape on one binary.
pub const MMQ8_ENV: &str = "GDS_CUDA_MMQ8";

/// The environment variable that compiles the dequantization kernels the former way, each
/// lane writing its own block (`1`, `true`, `on`, `yes`; `-DDEQ_PER_LANE`): the A/B of the
/// staged stores on one binary.
pub const DEQ_PER_LANE_ENV: &str = "GDS_CUDA_DEQ_PER_LANE";

/// The compiler definitions the environment asks for besides the int8 block shape
/// (`deq_per_lane`: the value of [`DEQ_PER_LANE_ENV`]).
pub fn variant_defines(deq_per_lane: Option<&str>) -> Vec<String> {
    if crate::env_flag(deq_per_lane) == Some(true) {
        vec!["-DDEQ_PER_LANE".into()]
    } else {
        Vec::new()
    }
}

/// The block shape of the `matvec_q8_*` kernels: `warps` warps share `rows` rows of the
/// matrix (the macros `MMQ8_WARPS`, `MMQ8_ROWS` the kernels are compiled with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mmq8Shape {
    /// Warps per block (blockDim = 32 × this).
    pub warps: u32,
    /// Rows per block.
    pub rows: u32,
}

impl Default for Mmq8Shape {
    fn default() -> Mmq8Shape {
        Mmq8Shape {
            warps: MMQ8_WARPS,
            rows: MMQ8_ROWS,
        }
    }
}

impl Mmq8Shape {
    /// `WARPSxROWS` (e.g. `8x1`): warps 1, 2, 4, 8 or 16, rows 1 to 8; the partial sums
    /// (`warps × rows × 8 tokens × 32` floats) must fit 48 KiB of shared memory.
    pub fn parse(v: &str) -> Result<Mmq8Shape, String> {
        let bad = || format!("{MMQ8_ENV}={v:?}: expected WARPSxROWS, e.g. 8x1");
        let (w, r) = v.trim().split_once(['x', 'X']).ok_or_else(bad)?;
        let (warps, rows) = (
            w.trim().parse::<u32>().map_err(|_| bad())?,
            r.trim().parse::<u32>().map_err(|_| bad())?,
        );
        if ![1, 2, 4, 8, 16].contains(&warps) || !(1..=8).contains(&rows) {
            return Err(format!(
                "{MMQ8_ENV}={v:?}: warps must be 1, 2, 4, 8 or 16 and rows 1 to 8"
            ));
        }
        if warps * rows * 8 * 32 * 4 > 48 * 1024 {
            return Err(format!(
                "{MMQ8_ENV}={v:?}: {warps} warps of {rows} rows need more than 48 KiB of shared memory"
            ));
        }
        Ok(Mmq8Shape { warps, rows })
    }

    /// The shape the variable asks for (`None`, empty: the default).
    pub fn from_env_value(v: Option<&str>) -> Result<Mmq8Shape, String> {
        match v.map(str::trim) {
            None | Some("") => Ok(Mmq8Shape::default()),
            Some(v) => Mmq8Shape::parse(v),
        }
    }

    /// The compiler's definitions of the shape (`-DMMQ8_WARPS=4`, `-DMMQ8_ROWS=2`).
    pub fn defines(self) -> [String; 2] {
        [
            format!("-DMMQ8_WARPS={}", self.warps),
            format!("-DMMQ8_ROWS={}", self.rows),
        ]
    }
}
/// Warps per block of the int8 tensor-core kernels `mmq_*` (blockDim = 32 × this, one
/// dimension); `MMQ_WARPS` in common.cuh.
pub const MMQ_WARPS: u32 = 4;
/// Rows of the matrix per block of the `mmq_*` kernels (16 a warp); `MMQ_ROWS` in common.cuh.
pub const MMQ_ROWS: u32 = 16 * MMQ_WARPS;
/// Tokens per block of the `mmq_*` kernels (the grid's second dimension is
/// ceil(tokens / this)); `MMQ_TOKENS` in common.cuh.
pub const MMQ_TOKENS: u32 = 64;
/// The oldest GPU with the `mma.sync` int8 shapes the `mmq_*` kernels use (Ampere, 8.0).
pub const MMQ_MIN_CAPABILITY: (i32, i32) = (8, 0);
/// The environment variable that sends the long passes' products of the int8 types through
/// the `mmq_*` kernels (`1`, `true`, `on`, `yes`) instead of a dequantized tile and cuBLAS:
/// off by default until measured on hardware (the emulation checks their arithmetic).
pub const MMQ_ENV: &str = "GDS_CUDA_MMQ";

/// Matrices one `matvec_q8_*` launch multiplies with the same activations (Q, K, V).
pub const MMQ8_MATRICES: usize = 3;
/// Values per block of quantized activations (`quantize_q8`).
pub const Q8A_VALUES: usize = 32;
/// Bytes per block of quantized activations: f32 scale, f32 scale × sum, 32 × i8;
/// `Q8A_BYTES` in common.cuh.
pub const Q8A_BYTES: usize = 40;

/// Every kernel entry point the executor loads.
pub const KERNEL_NAMES: &[&str] = &[
    "matvec_q4_0",
    "matvec_q4_1",
    "matvec_q5_0",
    "matvec_q5_1",
    "matvec_q8_0",
    "matvec_q4_k",
    "matvec_q5_k",
    "matvec_q6_k",
    "matvec_mxfp4",
    "matvec_iq4_nl",
    "matvec_iq4_xs",
    "matvec_f16",
    "matvec_bf16",
    "matvec_f32",
    "matvec_q8_q4_0",
    "matvec_q8_q4_1",
    "matvec_q8_q5_0",
    "matvec_q8_q5_1",
    "matvec_q8_q8_0",
    "matvec_q8_q4_k",
    "matvec_q8_q5_k",
    "matvec_q8_q6_k",
    "matvec_q8_mxfp4",
    "matvec_q8_iq4_nl",
    "matvec_q8_iq4_xs",
    "mmq_q4_0",
    "mmq_q4_1",
    "mmq_q5_0",
    "mmq_q5_1",
    "mmq_q8_0",
    "mmq_q4_k",
    "mmq_q5_k",
    "mmq_q6_k",
    "mmq_mxfp4",
    "mmq_iq4_nl",
    "mmq_iq4_xs",
    "quantize_q8",
    "dequant_q4_0",
    "dequant_q4_1",
    "dequant_q5_0",
    "dequant_q5_1",
    "dequant_q8_0",
    "dequant_q4_k",
    "dequant_q5_k",
    "dequant_q6_k",
    "dequant_mxfp4",
    "dequant_iq4_nl",
    "dequant_iq4_xs",
    "dequant_f16",
    "dequant_bf16",
    "dequant_f32",
    "dequant16_q4_0",
    "dequant16_q4_1",
    "dequant16_q5_0",
    "dequant16_q5_1",
    "dequant16_q8_0",
    "dequant16_q4_k",
    "dequant16_q5_k",
    "dequant16_q6_k",
    "dequant16_mxfp4",
    "dequant16_iq4_nl",
    "dequant16_iq4_xs",
    "dequant16_f16",
    "dequant16_bf16",
    "dequant16_f32",
    "to_f16",
    "rmsnorm",
    "rmsnorm_q8",
    "rope",
    "rope_kv",
    "rope_kv_f16",
    "kv_store",
    "kv_store_f16",
    "attention",
    "attention_f16",
    "gather_rows",
    "swiglu",
    "swiglu_q8",
    "swiglu_oai",
    "swiglu_oai_q8",
    "geglu",
    "geglu_q8",
    "scatter_add_rows",
    "add_rows",
    "scale_inplace",
    "softcap_inplace",
    "add_inplace",
];

/// The entry point `{kind}_{suffix}` (e.g. `matvec` + `q4_0`), found without allocating.
pub fn kernel_name(kind: &str, suffix: &str) -> Option<&'static str> {
    KERNEL_NAMES.iter().copied().find(|n| {
        n.strip_prefix(kind)
            .and_then(|r| r.strip_prefix('_'))
            .is_some_and(|r| r == suffix)
    })
}

/// One file as a complete program: prelude + body.
pub fn file_program(body: &str) -> String {
    format!("{PRELUDE}\n{body}")
}

/// The whole kernel library as one program (one NVRTC compile, one module load).
pub fn program() -> String {
    let mut s = String::from(PRELUDE);
    for (name, body) in FILES {
        s.push_str(&format!("\n// ---- {name} ----\n"));
        s.push_str(body);
    }
    s
}

/// Weight dtypes with a GPU matvec/dequant kernel, and the kernels' name suffix.
pub fn kernel_suffix(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Q4_0 => "q4_0",
        DType::Q4_1 => "q4_1",
        DType::Q5_0 => "q5_0",
        DType::Q5_1 => "q5_1",
        DType::Q8_0 => "q8_0",
        DType::Q4K => "q4_k",
        DType::Q5K => "q5_k",
        DType::Q6K => "q6_k",
        DType::MXFP4 => "mxfp4",
        DType::Iq4Nl => "iq4_nl",
        DType::Iq4Xs => "iq4_xs",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        _ => return None,
    })
}

/// Weight dtypes with an int8 kernel (`matvec_q8_{suffix}`, over activations quantized by
/// `quantize_q8`), and the suffix.
pub fn q8_kernel_suffix(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Q4_0 => "q4_0",
        DType::Q4_1 => "q4_1",
        DType::Q5_0 => "q5_0",
        DType::Q5_1 => "q5_1",
        DType::Q8_0 => "q8_0",
        DType::Q4K => "q4_k",
        DType::Q5K => "q5_k",
        DType::Q6K => "q6_k",
        DType::MXFP4 => "mxfp4",
        DType::Iq4Nl => "iq4_nl",
        DType::Iq4Xs => "iq4_xs",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_kernel_is_defined_once_in_the_program() {
        let p = program();
        for name in KERNEL_NAMES {
            let direct = p.matches(&format!("void {name}(")).count();
            // matvec_/dequant_ kernels come from the BLOCK_KERNELS/FLOAT_KERNELS macros,
            // matvec_q8_ kernels from Q8_KERNEL.
            // (matvec_q8_0 is Q8_0's f32-activation kernel, not an int8 one)
            let int8 = name
                .strip_prefix("matvec_q8_")
                .is_some_and(|t| p.contains(&format!("Q8_KERNEL({t},")))
                || name
                    .strip_prefix("mmq_")
                    .is_some_and(|t| p.contains(&format!("MMQ_KERNEL({t},")));
            // rope_kv(_f16) from ROPE_KV_KERNEL, the gated activations (and their _q8
            // forms) from GLU_KERNELS
            let rope_kv = p.contains(&format!("ROPE_KV_KERNEL({name},"));
            let glu = p.contains(&format!("GLU_KERNELS({}, ", name.trim_end_matches("_q8")));
            let via_macro = int8
                || rope_kv
                || glu
                || name
                    .split_once('_')
                    .map(|(kind, t)| {
                        ["matvec", "dequant", "dequant16"].contains(&kind)
                            && (p.contains(&format!("BLOCK_KERNELS({t},"))
                                || p.contains(&format!("FLOAT_KERNELS({t},")))
                    })
                    .unwrap_or(false);
            assert!(
                direct == 1 || (direct == 0 && via_macro),
                "{name}: {direct} definitions"
            );
        }
        assert!(p.contains(&format!("#define MATVEC_ROWS {MATVEC_ROWS} ")));
        assert!(p.contains(&format!("#define BLOCK_THREADS {BLOCK_THREADS} ")));
        assert!(p.contains(&format!("#define MMQ8_WARPS {MMQ8_WARPS}\n")));
        assert!(p.contains(&format!("#define MMQ8_ROWS {MMQ8_ROWS}\n")));
        assert!(p.contains("#ifndef MMQ8_WARPS\n") && p.contains("#ifndef MMQ8_ROWS\n"));
        assert!(p.contains(&format!("#define Q8A_BYTES {Q8A_BYTES}\n")));
        assert!(p.contains(&format!("#define MMQ_WARPS {MMQ_WARPS}\n")));
        assert!(p.contains("#define MMQ_ROWS (16 * MMQ_WARPS)\n"));
        assert!(p.contains("#define MMQ_TOKENS (8 * MMQ_NT)\n"));
        assert!(p.contains(&format!("#define MMQ_NT {}\n", MMQ_TOKENS / 8)));
        assert_eq!(Q8A_BYTES, 8 + Q8A_VALUES);
    }

    #[test]
    fn the_int8_block_shape_is_parsed_and_bounded() {
        let s = |w, r| Mmq8Shape { warps: w, rows: r };
        assert_eq!(Mmq8Shape::from_env_value(None), Ok(Mmq8Shape::default()));
        assert_eq!(Mmq8Shape::from_env_value(Some(" ")), Ok(s(4, 2)));
        assert_eq!(Mmq8Shape::from_env_value(Some("8x1")), Ok(s(8, 1)));
        assert_eq!(Mmq8Shape::parse(" 2X4 "), Ok(s(2, 4)));
        assert_eq!(Mmq8Shape::parse("16x3"), Ok(s(16, 3)));
        for bad in [
            "8", "x", "3x2", "4x0", "4x9", "32x1", "-4x2", "4x2x1", "16x4",
        ] {
            let e = Mmq8Shape::parse(bad).unwrap_err();
            assert!(e.contains(MMQ8_ENV) && e.contains(bad), "{bad}: {e}");
        }
        assert_eq!(s(8, 1).defines(), ["-DMMQ8_WARPS=8", "-DMMQ8_ROWS=1"]);
        assert_eq!(variant_defines(Some(" 1")), ["-DDEQ_PER_LANE"]);
        assert!(variant_defines(None).is_empty() && variant_defines(Some("0")).is_empty());
    }

    #[test]
    fn kernel_names_are_found_by_kind_and_suffix() {
        assert_eq!(kernel_name("matvec", "q4_k"), Some("matvec_q4_k"));
        assert_eq!(kernel_name("dequant", "f16"), Some("dequant_f16"));
        assert_eq!(kernel_name("dequant16", "q4_k"), Some("dequant16_q4_k"));
        assert_eq!(kernel_name("dequant16", "bf16"), Some("dequant16_bf16"));
        assert_eq!(kernel_name("matvec", "q3_k"), None);
    }

    #[test]
    fn every_kernel_dtype_has_its_kernels() {
        for d in gds_format::ALL_DTYPES {
            if let Some(s) = kernel_suffix(d) {
                assert!(KERNEL_NAMES.contains(&format!("matvec_{s}").as_str()));
                assert!(KERNEL_NAMES.contains(&format!("dequant_{s}").as_str()));
            }
            if let Some(s) = q8_kernel_suffix(d) {
                assert!(kernel_name("matvec_q8", s).is_some(), "{d}");
                // every int8 type has its tensor-core kernel for long passes
                assert!(kernel_name("mmq", s).is_some(), "{d}");
                // an int8 kernel only where the f32 one exists (the fallback for long passes)
                assert!(kernel_suffix(d).is_some());
            }
        }
    }
}
