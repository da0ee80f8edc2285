//! Shared by the emulation tests: builds tests/emu/launch.cpp (the kernels compiled as C++
//! with kernels/emu.h) into a shared library once per test binary, and looks up its entry
//! points.
#![allow(dead_code)]

use libloading::{Library, Symbol};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Builds tests/emu/launch.cpp into a shared library once per test run and loads it.
pub fn lib() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gds-cuda-emu");
        std::fs::create_dir_all(&out).unwrap();
        let so = out.join(format!("libkernels-emu-{}.so", std::process::id()));
        let target = env!("GDS_CUDA_TARGET");
        let tool = cc::Build::new()
            .cpp(true)
            .opt_level(2)
            .target(target)
            .host(target)
            .cargo_metadata(false)
            .cargo_warnings(false)
            .get_compiler();
        let mut cmd: Command = tool.to_command();
        cmd.arg("-std=c++14")
            .arg("-shared")
            .arg("-fPIC")
            .arg("-pthread")
            .arg("-Wall")
            .arg("-Wno-unused-function")
            .arg("-I")
            .arg(root.join("kernels"))
            .arg(root.join("tests/emu/launch.cpp"))
            .arg("-o")
            .arg(&so);
        let res = cmd.output().expect("running the C++ compiler");
        assert!(
            res.status.success(),
            "compiling the kernels as C++ failed:\n{}",
            String::from_utf8_lossy(&res.stderr)
        );
        // SAFETY: the library is ours, built just above; its initialisers only set up the
        // emulation's statics.
        let lib = unsafe { Library::new(&so) }.expect("loading the emulated kernels");
        // Loaded: the file is no longer needed (runs do not pile up copies).
        let _ = std::fs::remove_file(&so);
        lib
    })
}

pub fn sym<T>(name: &str) -> Symbol<'static, T> {
    // SAFETY: every caller names a function of launch.cpp with the matching signature.
    unsafe { lib().get(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"))
}
