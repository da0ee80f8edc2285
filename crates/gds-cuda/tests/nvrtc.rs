//! Every kernel compiles through NVRTC to PTX, and a broken kernel is rejected with its log.
//! NVRTC needs no GPU: CI installs the PyPI package `nvidia-cuda-nvrtc-cu12` and puts its
//! lib/ directory on LD_LIBRARY_PATH (scripts/test.sh). Without libnvrtc these tests fail,
//! unless GDS_SKIP_NVRTC=1 says to skip them (never set in CI).
#![cfg(feature = "cuda")]

use gds_cuda::{kernels, nvrtc, GpuError};

/// `false` when libnvrtc is absent and skipping was asked for; panics when it is absent
/// and skipping was not asked for.
fn nvrtc_here() -> bool {
    match nvrtc::available() {
        Ok(()) => true,
        Err(e) if std::env::var("GDS_SKIP_NVRTC").as_deref() == Ok("1") => {
            eprintln!("skipped (GDS_SKIP_NVRTC=1): {e}");
            false
        }
        Err(e) => panic!("{e} (set GDS_SKIP_NVRTC=1 to skip the NVRTC tests)"),
    }
}

#[test]
fn every_kernel_file_compiles_to_ptx_defining_its_entry_points() {
    if !nvrtc_here() {
        return;
    }
    for arch in [nvrtc::DEFAULT_ARCH, "compute_90"] {
        for (name, body) in kernels::FILES {
            let ptx = nvrtc::compile(name, &kernels::file_program(body), arch)
                .unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert!(
                ptx.to_src().contains(".entry"),
                "{name}: no kernel in the PTX"
            );
        }
        let ptx = nvrtc::compile_library(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let src = ptx.to_src();
        let target = arch.replace("compute_", "sm_");
        assert!(src.contains(&format!(".target {target}")), "{arch}");
        for k in kernels::KERNEL_NAMES {
            assert!(
                src.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX"
            );
        }
    }
}

#[test]
fn a_broken_kernel_is_rejected_with_the_compiler_log() {
    if !nvrtc_here() {
        return;
    }
    let broken = kernels::file_program(
        "extern \"C\" __global__ void broken(float* y) { y[threadIdx.x] = undefined_name; }",
    );
    match nvrtc::compile("broken.cu", &broken, nvrtc::DEFAULT_ARCH) {
        Err(GpuError::Compile { program, log }) => {
            assert_eq!(program, "broken.cu");
            assert!(log.contains("undefined_name"), "log: {log}");
        }
        Err(e) => panic!("expected a compile error, got {e}"),
        Ok(_) => panic!("NVRTC accepted a kernel using an undefined name"),
    }
}

/// The probe of a `--features cuda` build on a machine without a GPU (CI): no panic, the
/// build says it has CUDA, and an unusable path names what is missing. (This file is the
/// only test target scripts/test.sh builds with the feature: the lib's own probe test runs
/// in the default build.)
#[test]
fn the_probe_of_a_cuda_build_reports_what_is_missing_without_panicking() {
    let r = gds_cuda::probe();
    assert!(r.built_with_cuda);
    assert_eq!(
        r.unusable_reason().is_some(),
        r.path == gds_cuda::GpuPath::None
    );
    let text = r.to_string();
    assert!(text.contains("gpu path: "), "{text}");
    if r.path == gds_cuda::GpuPath::None {
        assert!(!r.reason.is_empty());
        assert!(
            !r.reason.contains("without the `cuda` feature"),
            "{}",
            r.reason
        );
    }
}
