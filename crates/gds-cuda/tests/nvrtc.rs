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

/// The whole library's PTX at the default block shape for `arch` (compute_70 or
/// compute_90), compiled once for the tests that read it: a compile takes ~8 s of one core,
/// and three tests read each.
fn default_library(arch: &str) -> &'static str {
    static LIBS: [std::sync::OnceLock<String>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    let slot = match arch {
        nvrtc::DEFAULT_ARCH => &LIBS[0],
        "compute_90" => &LIBS[1],
        _ => panic!("no cached library for {arch}"),
    };
    slot.get_or_init(|| {
        nvrtc::compile_library(arch, kernels::Mmq8Shape::default(), &[])
            .unwrap_or_else(|e| panic!("{arch}: {e}"))
            .to_src()
    })
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
        let src = default_library(arch);
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

/// The whole library's PTX for an H100/H200 (compute_90) assembles into sm_90 machine code
/// with ptxas, as the driver assembles it when the executor loads the module: NVRTC copies
/// inline assembly (the tensor cores' `mma.sync` of the `mmq_*` kernels) into the PTX
/// unchecked, so only the assembler sees a wrong instruction, operand count or register
/// kind. CI installs ptxas from PyPI (`nvidia-cuda-nvcc-cu12`) and names it in GDS_PTXAS
/// (scripts/test.sh); without it this fails unless GDS_SKIP_NVRTC=1.
#[test]
fn the_library_assembles_for_sm_90_with_its_tensor_core_instructions() {
    if !nvrtc_here() {
        return;
    }
    let ptxas = match std::env::var("GDS_PTXAS") {
        Ok(p) if !p.is_empty() => p,
        _ if std::env::var("GDS_SKIP_NVRTC").as_deref() == Ok("1") => {
            eprintln!("skipped (GDS_SKIP_NVRTC=1): GDS_PTXAS names no ptxas");
            return;
        }
        _ => panic!("GDS_PTXAS names no ptxas (set GDS_SKIP_NVRTC=1 to skip the NVRTC tests)"),
    };
    let src = default_library("compute_90");
    assert!(
        src.contains("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32")
            && src.contains("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32"),
        "the int8 mma instructions are missing from the compute_90 PTX"
    );
    let dir = tempfile::tempdir().unwrap();
    let (ptx, cubin) = (dir.path().join("k.ptx"), dir.path().join("k.cubin"));
    std::fs::write(&ptx, src).unwrap();
    let out = std::process::Command::new(&ptxas)
        .args(["-arch=sm_90", "-v", "-o"])
        .arg(&cubin)
        .arg(&ptx)
        .output()
        .unwrap_or_else(|e| panic!("running {ptxas}: {e}"));
    assert!(
        out.status.success(),
        "ptxas rejected the library:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::metadata(&cubin).unwrap().len() > 0);
    // the tensor-core kernels' registers and spills, for the record (`--nocapture`)
    let info = String::from_utf8_lossy(&out.stderr);
    let mut lines = info.lines().peekable();
    while let Some(l) = lines.next() {
        if l.contains("Compiling entry function 'mmq_") {
            let usage: Vec<&str> =
                std::iter::from_fn(|| lines.next_if(|n| !n.contains("Compiling"))).collect();
            eprintln!("{l}: {}", usage.join(" | "));
        }
    }
    // and the compute_70 library has no such instruction (Volta has none; the executor
    // never launches mmq_* there)
    assert!(!default_library(nvrtc::DEFAULT_ARCH).contains("mma.sync"));
}

/// The int8 kernels compile at the block shapes `GDS_CUDA_MMQ8` may ask for (a sweep on the
/// GPU machine recompiles them there), the shape reaching the code: its shared memory is
/// `warps × rows × 8 × 32` floats.
#[test]
fn the_int8_kernels_compile_at_other_block_shapes() {
    if !nvrtc_here() {
        return;
    }
    for v in ["8x1", "2x4", "16x3", "1x1"] {
        let shape = kernels::Mmq8Shape::parse(v).unwrap();
        let src = nvrtc::compile_library("compute_90", shape, &[])
            .unwrap_or_else(|e| panic!("{v}: {e}"))
            .to_src();
        // the partial sums, `part[warps][rows × 8][32]` floats
        let bytes = shape.warps * shape.rows * 8 * 32 * 4;
        assert!(
            src.contains(&format!("_ZZ14matvec_q8_q4_0E4part[{bytes}];")),
            "{v}: no shared array of {bytes} bytes in matvec_q8_q4_0's PTX"
        );
    }
}

/// The former dequantization (each lane writing its own block: `GDS_CUDA_DEQ_PER_LANE`)
/// compiles, and the staged one's shared array is gone from it.
#[test]
fn the_per_lane_dequantization_compiles() {
    if !nvrtc_here() {
        return;
    }
    let extra = kernels::variant_defines(Some("1"));
    let per_lane = nvrtc::compile_library("compute_90", kernels::Mmq8Shape::default(), &extra)
        .unwrap_or_else(|e| panic!("{extra:?}: {e}"))
        .to_src();
    assert!(per_lane.contains(".entry dequant16_q4_0("));
    // the staged stores' shared array, `stage[8][32][33]` floats
    let stage = "_ZZ14dequant16_q4_0E5stage[33792];";
    assert!(default_library("compute_90").contains(stage));
    assert!(!per_lane.contains(stage));
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

/// `device_bytes::load`: on a machine with a GPU the bytes come back from VRAM equal (a
/// host copy, and cuFile where libcufile is present); without a driver or device (CI) the
/// refusal is `Unavailable` and names what is missing, never a panic from cudarc.
#[test]
fn bytes_placed_on_a_gpu_come_back_equal_or_the_refusal_names_what_is_missing() {
    use gds_cuda::device_bytes::{load, Source};
    use gds_cuda::GpuPath;
    let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let report = gds_cuda::probe();
    let usable = report.driver.present && !report.devices.is_empty();
    match load(0, Source::Host(&data)) {
        Ok(d) => {
            assert!(usable, "loaded without a usable device? {report:?}");
            assert_eq!(
                (d.len(), d.device(), d.path()),
                (data.len(), 0, GpuPath::Bounce)
            );
            assert_ne!(d.ptr(), 0);
            assert_eq!(d.to_host().unwrap(), data);
        }
        Err(GpuError::Unavailable(why)) => {
            assert!(!usable, "refused with a usable device: {why}");
            assert!(
                why.contains("no CUDA driver") || why.contains("device"),
                "{why}"
            );
        }
        Err(e) => panic!("{e}"),
    }
    // an ordinal past the devices the driver reports
    match load(999, Source::Host(&data)) {
        Err(GpuError::Unavailable(why)) => {
            assert!(
                why.contains("cuda:999") || why.contains("no CUDA driver"),
                "{why}"
            )
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("loaded onto cuda:999"),
    }
    // a session holding cuFile's driver open across loads (the Python package's model):
    // refused, naming what is missing, where there is no device or no libcufile
    let gds_here = usable && report.cufile.present;
    match gds_cuda::device_bytes::CufileSession::open(0, std::path::Path::new(".")) {
        Ok(_) => assert!(gds_here, "a cuFile session without a device or libcufile"),
        Err(GpuError::Unavailable(why)) => {
            assert!(!gds_here, "refused with a device and libcufile: {why}");
            assert!(
                why.contains("no CUDA driver")
                    || why.contains("device(s)")
                    || why.contains("libcufile"),
                "{why}"
            );
        }
        Err(e) => assert!(gds_here, "{e}"), // the driver's own refusal (cuFileDriverOpen)
    }
    // cuFile from a file, where the machine has libcufile
    if usable && report.cufile.present {
        let dir = tempfile::tempdir().unwrap();
        let mut padded = data.clone();
        padded.resize(data.len().next_multiple_of(4096), 0);
        std::fs::write(dir.path().join("blk.bin"), &padded).unwrap();
        match load(
            0,
            Source::Gds {
                dir: dir.path(),
                file: "blk.bin",
                size: padded.len(),
            },
        ) {
            Ok(d) => {
                assert_eq!(d.path(), GpuPath::Gds);
                assert_eq!(d.to_host().unwrap(), padded);
            }
            // tmpfs and some VMs refuse cuFile; the message must say which file
            Err(e) => assert!(e.to_string().contains("blk.bin"), "{e}"),
        }
    }
}
