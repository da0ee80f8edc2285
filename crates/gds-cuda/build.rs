// Passes the target triple to the tests, which compile kernels/*.cu as C++ (through the
// `cc` dev-dependency) and need to tell `cc` what to build for. Normal builds compile no C++.
fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=GDS_CUDA_TARGET={target}");
    println!("cargo:rerun-if-changed=build.rs");
}
