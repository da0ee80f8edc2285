//! Compiling the kernel sources to PTX with NVRTC (loaded at run time; no GPU needed).

use crate::{kernels, GpuError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

/// The oldest architecture the kernels target when no device says otherwise (Volta: the
/// `*_sync` warp intrinsics and independent thread scheduling).
pub const DEFAULT_ARCH: &str = "compute_70";

/// Whether libnvrtc can be loaded, with the error to show when it cannot.
pub fn available() -> Result<(), GpuError> {
    // SAFETY: only tries to dlopen the library; no symbol is called.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::Unavailable(
            "libnvrtc.so not found: install the CUDA toolkit or `pip install \
             nvidia-cuda-nvrtc-cu12` and put its lib/ directory on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Compiles one program to PTX for `arch` (e.g. `compute_90`). A rejected program gives
/// [`GpuError::Compile`] with NVRTC's log.
pub fn compile(program: &str, src: &str, arch: &str) -> Result<Ptx, GpuError> {
    compile_with(program, src, arch, &[])
}

/// [`compile`] with more compiler options (`-D` definitions).
pub fn compile_with(
    program: &str,
    src: &str,
    arch: &str,
    extra: &[String],
) -> Result<Ptx, GpuError> {
    available()?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++14".into(),
        "-lineinfo".into(),
    ];
    options.extend_from_slice(extra);
    let opts = CompileOptions {
        name: Some(program.to_string()),
        options,
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| GpuError::Compile {
        program: program.to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

/// The whole kernel library ([`kernels::program`]) as one PTX module, its int8 matvec
/// kernels for the block shape `mmq8`, with the definitions `extra` (e.g.
/// [`kernels::variant_defines`]).
pub fn compile_library(
    arch: &str,
    mmq8: kernels::Mmq8Shape,
    extra: &[String],
) -> Result<Ptx, GpuError> {
    let mut defines = mmq8.defines().to_vec();
    defines.extend_from_slice(extra);
    compile_with("gdsllm_kernels.cu", &kernels::program(), arch, &defines)
}
