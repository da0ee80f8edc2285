//! Shared by the emulation tests: builds tests/emu/launch.cpp (the kernels compiled as C++
//! with kernels/emu.h) into a shared library once per test binary, and looks up its entry
//! points.
#![allow(dead_code)]

use gds_cuda::forward::{Device, GemmType, GluAct, Heads, KvPages, Q8Out, RopeArgs};
use gds_cuda::GpuError;
use libloading::{Library, Symbol};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Builds tests/emu/launch.cpp into a shared library once per test run and loads it.
pub fn lib() -> &'static Library {
    lib_with(&[])
}

/// [`lib`] compiled with the definitions `defines` (e.g. `-DMMQ8_WARPS=8`: the int8
/// kernels at another block shape), once per test run and set of definitions.
///
/// The emulation runs one launch at a time per loaded library (its fibers, `__shared__`
/// arrays and block indices are the library's statics, kernels/emu.h), so the library is
/// loaded once per core, from copies of the file (the loader would hand back the same
/// library for the same file), and each thread uses one of them in turn: the tests' threads
/// emulate side by side instead of queueing for one lock with a core idle (the emulation
/// tests took ~200 s of one core while the other waited). Two threads given the same copy
/// take turns on its lock, as all did before; no state outlives a launch, so the threads of
/// one test may use different copies.
pub fn lib_with(defines: &[&str]) -> &'static Library {
    use std::collections::HashMap;
    use std::sync::Mutex;
    type Copies = &'static OnceLock<Vec<&'static Library>>;
    static LIBS: OnceLock<Mutex<HashMap<String, Copies>>> = OnceLock::new();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    let slot = SLOT.with(|s| *s);
    // the map's lock is not held while a library compiles: only the threads that want the
    // same definitions wait for it
    let copies: Copies = *(LIBS.get_or_init(Default::default).lock().unwrap())
        .entry(defines.join(" "))
        .or_insert_with(|| Box::leak(Box::default()));
    let copies = copies.get_or_init(|| build(defines));
    copies[slot % copies.len()]
}

/// Compiles tests/emu/launch.cpp with `defines` and loads one copy per core ([`lib_with`]).
fn build(defines: &[&str]) -> Vec<&'static Library> {
    static BUILT: AtomicUsize = AtomicUsize::new(0);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gds-cuda-emu");
    std::fs::create_dir_all(&out).unwrap();
    let so = out.join(format!(
        "libkernels-emu-{}-{}.so",
        std::process::id(),
        BUILT.fetch_add(1, Ordering::Relaxed)
    ));
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
        // each copy keeps its own statics: GCC makes a static of a template (attention's
        // `__shared__` scratch) a unique symbol, which the loader shares between copies
        .args(tool.is_like_gnu().then_some("-fno-gnu-unique"))
        .arg("-Wl,-Bsymbolic")
        .args(defines)
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
    let n = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    // every copy is made before any is loaded or removed: a removed file's inode may be
    // reused by the next copy, which the loader would take for the library already loaded
    let files: Vec<PathBuf> = (0..n)
        .map(|i| {
            let f = so.with_extension(format!("{i}.so"));
            std::fs::copy(&so, &f).expect("copying the emulated kernels");
            f
        })
        .collect();
    let copies: Vec<&'static Library> = files
        .iter()
        .map(|f| {
            // SAFETY: the library is ours, built just above; its initialisers only set up
            // the emulation's statics, which are each copy's own.
            let lib = unsafe { Library::new(f) }.expect("loading the emulated kernels");
            &*Box::leak(Box::new(lib))
        })
        .collect();
    // Loaded: the files are no longer needed (runs do not pile up copies).
    for f in files.iter().chain([&so]) {
        let _ = std::fs::remove_file(f);
    }
    copies
}

/// `run_attention` of tests/emu/launch.cpp: q, kc, vc (f32 or f16), att (scratch), out,
/// n_heads, n_kv_heads, head_dim, ntok, pos, seq, tables, max_blocks, block, ring, n_ctx,
/// scale, window, softcap, sinks, f16 (the caches' element type).
pub type AttnFn = unsafe extern "C" fn(
    *const f32,
    *const u8,
    *const u8,
    *mut f32,
    *mut f32,
    i32,
    i32,
    i32,
    i32,
    *const i32,
    *const i32,
    *const i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    i32,
    f32,
    *const f32,
    i32,
);

/// `run_kv_store`: k, v, kc, vc (f32 or f16), kv_dim, ntok, pos, seq, tables, max_blocks,
/// block, ring, f16 (the caches' element type).
pub type KvStoreFn = unsafe extern "C" fn(
    *const f32,
    *const f32,
    *mut u8,
    *mut u8,
    i32,
    i32,
    *const i32,
    *const i32,
    *const i32,
    i32,
    i32,
    i32,
    i32,
);

/// `run_rope`: x, cos, sin, n_heads, head_dim, half, neox, pos, ntok.
pub type RopeFn =
    unsafe extern "C" fn(*mut f32, *const f32, *const f32, i32, i32, i32, i32, *const i32, i32);

/// `run_swiglu`, `run_geglu`, `run_add_inplace`: y, x, n.
pub type PairFn = unsafe extern "C" fn(*mut f32, *const f32, i32);

/// `run_scale_inplace`, `run_softcap_inplace`: x, factor, n.
pub type ScaleFn = unsafe extern "C" fn(*mut f32, f32, i32);

pub fn sym<T>(name: &str) -> Symbol<'static, T> {
    sym_in(lib(), name)
}

/// [`sym`] in a library of [`lib_with`].
pub fn sym_in<T>(lib: &'static Library, name: &str) -> Symbol<'static, T> {
    // SAFETY: every caller names a function of launch.cpp with the matching signature.
    unsafe { lib.get(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// `x` rounded to TF32 (8-bit exponent, 10-bit mantissa; to nearest, ties to even).
pub fn to_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let b = x.to_bits();
    let r = b + 0xFFF + ((b >> 13) & 1);
    f32::from_bits(r & !0x1FFF)
}

/// [`Device`] over host memory, calling the emulated kernels.
#[derive(Default)]
pub struct Emu {
    /// GEMM calls so far.
    pub gemms: usize,
    /// Those of them asked to round to TF32.
    pub tf32_gemms: usize,
    /// Those of them over f16 operands.
    pub f16_gemms: usize,
    /// int8 matvec calls so far.
    pub q8: usize,
    /// Offer the int8 tensor-core products of long passes (`mmq_*`; the CUDA executor's
    /// `GDS_CUDA_MMQ=1`), instead of the dequantized tiles and GEMMs.
    pub mmq: bool,
    /// `mmq_*` calls so far.
    pub mmqs: usize,
    /// Launches so far of the kernels blocks run (matvecs, quantizations, norms, RoPE, KV
    /// stores, attention, gated activations, biases, residual adds; not the embedding's
    /// dequantization, copies or GEMMs).
    pub launches: usize,
}

/// `run_matvec_q8x_*`: xq, cols, ntok, then (w, y, rows) of each of three matrices.
pub type MatvecQ8xFn = unsafe extern "C" fn(
    *const u8,
    i32,
    i32,
    *const u8,
    *mut f32,
    i32,
    *const u8,
    *mut f32,
    i32,
    *const u8,
    *mut f32,
    i32,
);
/// `run_rope_kv`: q, k, v, kc, vc (f32 or f16), cos, sin, n_heads, n_kv_heads, head_dim,
/// half, neox, ntok, pos, seq, tables, max_blocks, block, ring, f16.
pub type RopeKvFn = unsafe extern "C" fn(
    *mut f32,
    *mut f32,
    *const f32,
    *mut u8,
    *mut u8,
    *const f32,
    *const f32,
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    *const i32,
    *const i32,
    *const i32,
    i32,
    i32,
    i32,
    i32,
);
/// `run_matvec_q8_*`: w, xq, y, rows, cols, ntok.
pub type MatvecQ8Fn = unsafe extern "C" fn(*const u8, *const u8, *mut f32, i32, i32, i32);
/// `run_mmq_*`: xq, cols, ntok, w, y, rows.
pub type MmqFn = unsafe extern "C" fn(*const u8, i32, i32, *const u8, *mut f32, i32);
/// `run_quantize_q8`: x, xq, nblocks.
pub type QuantizeQ8Fn = unsafe extern "C" fn(*const f32, *mut u8, i32);

pub fn p<T>(a: u64) -> *mut T {
    a as usize as *mut T
}

/// `run_{kind}_{suffix}` of launch.cpp (`dequant` into f32, `dequant16` into f16; `dst` is
/// passed as bytes, which the C ABI takes as it takes either element pointer).
fn run_dequant(kind: &str, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError> {
    let f = sym::<unsafe extern "C" fn(*const u8, *mut u8, i32)>(&format!("run_{kind}_{suffix}"));
    // SAFETY: addresses are host buffers sized by the forward pass's contract.
    unsafe { f(p(src), p(dst), nblocks) };
    Ok(())
}

#[allow(clippy::too_many_arguments)]
impl Device for Emu {
    fn matvec(
        &mut self,
        suffix: &str,
        w: u64,
        x: u64,
        y: u64,
        rows: i32,
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*const u8, *const f32, *mut f32, i32, i32, i32)>(
            &format!("run_matvec_{suffix}"),
        );
        // SAFETY: addresses are host buffers sized by the forward pass's contract.
        unsafe { f(p(w), p(x), p(y), rows, cols, ntok) };
        self.launches += 1;
        Ok(())
    }
    fn quantize_q8(&mut self, x: u64, xq: u64, nblocks: i32) -> Result<(), GpuError> {
        // SAFETY: as above.
        unsafe { sym::<QuantizeQ8Fn>("run_quantize_q8")(p(x), p(xq), nblocks) };
        self.launches += 1;
        Ok(())
    }
    fn matvec_q8(
        &mut self,
        suffix: &str,
        xq: u64,
        outs: &[Q8Out],
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let [a, b, c] = Q8Out::three(outs).map_err(GpuError::Model)?;
        let f = sym::<MatvecQ8xFn>(&format!("run_matvec_q8x_{suffix}"));
        // SAFETY: addresses are host buffers sized by the forward pass's contract.
        unsafe {
            f(
                p(xq),
                cols,
                ntok,
                p(a.w),
                p(a.y),
                a.rows,
                p(b.w),
                p(b.y),
                b.rows,
                p(c.w),
                p(c.y),
                c.rows,
            )
        };
        self.q8 += 1;
        self.launches += 1;
        Ok(())
    }
    fn offers_mmq(&self) -> bool {
        self.mmq
    }
    fn mmq(
        &mut self,
        suffix: &str,
        xq: u64,
        out: Q8Out,
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        assert!(
            self.mmq,
            "mmq_{suffix} called where the device does not offer it"
        );
        let f = sym::<MmqFn>(&format!("run_mmq_{suffix}"));
        // SAFETY: addresses are host buffers sized by the forward pass's contract.
        unsafe { f(p(xq), cols, ntok, p(out.w), p(out.y), out.rows) };
        self.mmqs += 1;
        self.launches += 1;
        Ok(())
    }
    fn dequant(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError> {
        run_dequant("dequant", suffix, src, dst, nblocks)
    }
    fn dequant16(
        &mut self,
        suffix: &str,
        src: u64,
        dst: u64,
        nblocks: i32,
    ) -> Result<(), GpuError> {
        run_dequant("dequant16", suffix, src, dst, nblocks)
    }
    fn to_f16(&mut self, x: u64, dst: u64, n: i32) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*const f32, *mut u16, i32)>("run_to_f16");
        // SAFETY: as above.
        unsafe { f(p(x), p(dst), n) };
        Ok(())
    }
    fn rmsnorm(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, i32, f32)>(
            "run_rmsnorm",
        );
        // SAFETY: as above.
        unsafe { f(p(x), p(w), p(out), n, ntok, eps) };
        self.launches += 1;
        Ok(())
    }
    fn rope(
        &mut self,
        x: u64,
        cos: u64,
        sin: u64,
        n_heads: i32,
        head_dim: i32,
        half: i32,
        neox: bool,
        pos: u64,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let f = sym::<RopeFn>("run_rope");
        let neox = neox as i32;
        // SAFETY: as above.
        unsafe {
            f(
                p(x),
                p(cos),
                p(sin),
                n_heads,
                head_dim,
                half,
                neox,
                p(pos),
                ntok,
            )
        };
        self.launches += 1;
        Ok(())
    }
    fn rmsnorm_q8(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        xq: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*const f32, *const f32, *mut f32, *mut u8, i32, i32, f32)>(
            "run_rmsnorm_q8",
        );
        // SAFETY: as above.
        unsafe { f(p(x), p(w), p(out), p(xq), n, ntok, eps) };
        self.launches += 1;
        Ok(())
    }
    fn rope_kv(
        &mut self,
        (q, k, v): (u64, u64, u64),
        (kc, vc): (u64, u64),
        rope: RopeArgs,
        heads: Heads,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError> {
        let pg = *pages;
        // SAFETY: as above.
        unsafe {
            sym::<RopeKvFn>("run_rope_kv")(
                p(q),
                p(k),
                p(v),
                p(kc),
                p(vc),
                p(rope.cos),
                p(rope.sin),
                heads.n_heads,
                heads.n_kv_heads,
                heads.head_dim,
                rope.half,
                rope.neox as i32,
                ntok,
                p(pg.pos),
                p(pg.seq),
                p(pg.tables),
                pg.max_blocks,
                pg.block,
                pg.ring,
                pg.f16 as i32,
            )
        };
        self.launches += 1;
        Ok(())
    }
    fn kv_store(
        &mut self,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        kv_dim: i32,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError> {
        let f = sym::<KvStoreFn>("run_kv_store");
        // SAFETY: as above.
        unsafe {
            f(
                p(k),
                p(v),
                p(kc),
                p(vc),
                kv_dim,
                ntok,
                p(pages.pos),
                p(pages.seq),
                p(pages.tables),
                pages.max_blocks,
                pages.block,
                pages.ring,
                pages.f16 as i32,
            )
        };
        self.launches += 1;
        Ok(())
    }
    fn attention(
        &mut self,
        q: u64,
        kc: u64,
        vc: u64,
        att: u64,
        out: u64,
        heads: Heads,
        ntok: i32,
        n_ctx: i32,
        pages: &KvPages,
        window: i32,
        softcap: f32,
        sinks: u64,
    ) -> Result<(), GpuError> {
        let f = sym::<AttnFn>("run_attention");
        // SAFETY: as above.
        unsafe {
            f(
                p(q),
                p(kc),
                p(vc),
                p(att),
                p(out),
                heads.n_heads,
                heads.n_kv_heads,
                heads.head_dim,
                ntok,
                p(pages.pos),
                p(pages.seq),
                p(pages.tables),
                pages.max_blocks,
                pages.block,
                pages.ring,
                n_ctx,
                heads.scale,
                window,
                softcap,
                p(sinks),
                pages.f16 as i32,
            )
        };
        self.launches += 1;
        Ok(())
    }
    fn gather_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, *const i32, i32, i32)>(
            "run_gather_rows",
        );
        // SAFETY: as above.
        unsafe { f(p(dst), p(src), p(rows), n, nrows) };
        Ok(())
    }
    fn glu(&mut self, act: GluAct, gate: u64, up: u64, n: i32) -> Result<(), GpuError> {
        // SAFETY: as above.
        unsafe { sym::<PairFn>(&format!("run_{}", act.kernel(false)))(p(gate), p(up), n) };
        self.launches += 1;
        Ok(())
    }
    fn glu_q8(&mut self, act: GluAct, gate: u64, up: u64, xq: u64, n: i32) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, *mut u8, i32)>(&format!(
            "run_{}",
            act.kernel(true)
        ));
        // SAFETY: as above.
        unsafe { f(p(gate), p(up), p(xq), n) };
        self.launches += 1;
        Ok(())
    }
    fn scatter_add_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, *const i32, i32, i32)>(
            "run_scatter_add_rows",
        );
        // SAFETY: as above.
        unsafe { f(p(dst), p(src), p(rows), n, nrows) };
        Ok(())
    }
    fn add_rows(&mut self, y: u64, b: u64, n: i32, ntok: i32) -> Result<(), GpuError> {
        let f = sym::<unsafe extern "C" fn(*mut f32, *const f32, i32, i32)>("run_add_rows");
        // SAFETY: as above.
        unsafe { f(p(y), p(b), n, ntok) };
        self.launches += 1;
        Ok(())
    }
    fn scale(&mut self, x: u64, s: f32, n: i32) -> Result<(), GpuError> {
        // SAFETY: as above.
        unsafe { sym::<ScaleFn>("run_scale_inplace")(p(x), s, n) };
        Ok(())
    }
    fn softcap(&mut self, x: u64, cap: f32, n: i32) -> Result<(), GpuError> {
        // SAFETY: as above.
        unsafe { sym::<ScaleFn>("run_softcap_inplace")(p(x), cap, n) };
        Ok(())
    }
    fn add(&mut self, y: u64, x: u64, n: i32) -> Result<(), GpuError> {
        // SAFETY: as above.
        unsafe { sym::<PairFn>("run_add_inplace")(p(y), p(x), n) };
        self.launches += 1;
        Ok(())
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: distinct host buffers of at least `bytes` bytes.
        unsafe { std::ptr::copy_nonoverlapping(p::<u8>(src), p::<u8>(dst), bytes) };
        Ok(())
    }
    fn zero(&mut self, dst: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: a host buffer of at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(p::<u8>(dst), 0, bytes) };
        Ok(())
    }
    fn download(&mut self, src: u64, dst: &mut [f32]) -> Result<(), GpuError> {
        // SAFETY: a host buffer of at least `dst.len()` floats, not `dst`.
        unsafe { std::ptr::copy_nonoverlapping(p::<f32>(src), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn upload_words(&mut self, dst: u64, src: &[u32]) -> Result<(), GpuError> {
        // SAFETY: a host buffer with room for `src`, not `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p::<u32>(dst), src.len()) };
        Ok(())
    }
    fn gemm(
        &mut self,
        a: u64,
        b: u64,
        c: u64,
        (m, n, k): (i32, i32, i32),
        ldc: i32,
        inputs: GemmType,
    ) -> Result<bool, GpuError> {
        // cuBLAS column-major semantics: C[i + j*ldc] = sum_l A[l + i*k] * B[l + j*k]; with
        // TF32 each input rounded to TF32 first (to nearest: the tensor cores' own rounding
        // may differ in the last bit, which the callers' tolerances absorb); f16 operands
        // widened to f32 (exact: their products are exact in f32 too), summed in f32.
        let tf32 = inputs == GemmType::Tf32;
        let (m, n, k, ldc) = (m as usize, n as usize, k as usize, ldc as usize);
        assert!(ldc >= m, "ldc {ldc} < m {m}");
        let widen = |at: u64, len: usize| -> Vec<f32> {
            // SAFETY: `len` f16 values at `at` (the forward pass's contract).
            let h = unsafe { std::slice::from_raw_parts(p::<u16>(at), len) };
            h.iter()
                .map(|&v| half::f16::from_bits(v).to_f32())
                .collect()
        };
        let (a16, b16);
        // SAFETY: A holds k*m values, B k*n (f16 or f32 by `inputs`), C n columns of ldc
        // floats (the forward pass's contract; the last column needs only m).
        let (a, b, c) = unsafe {
            let (a, b) = match inputs {
                GemmType::F16 => {
                    (a16, b16) = (widen(a, k * m), widen(b, k * n));
                    (&a16[..], &b16[..])
                }
                GemmType::F32 | GemmType::Tf32 => (
                    std::slice::from_raw_parts(p::<f32>(a), k * m),
                    std::slice::from_raw_parts(p::<f32>(b), k * n),
                ),
            };
            (
                a,
                b,
                std::slice::from_raw_parts_mut(p::<f32>(c), ldc * (n - 1) + m),
            )
        };
        for j in 0..n {
            for i in 0..m {
                c[i + j * ldc] = a[i * k..][..k]
                    .iter()
                    .zip(&b[j * k..][..k])
                    .map(|(&x, &y)| if tf32 { to_tf32(x) * to_tf32(y) } else { x * y })
                    .sum();
            }
        }
        self.gemms += 1;
        self.tf32_gemms += usize::from(tf32);
        self.f16_gemms += usize::from(inputs == GemmType::F16);
        Ok(true)
    }
}

/// One recorded launch: replayed on a device.
pub type Op = Box<dyn Fn(&mut dyn Device) -> Result<(), GpuError> + Send>;

/// A [`Device`] that records what it is given instead of running it, as a CUDA graph
/// captures a stream: the launches with their arguments, fixed at capture. Replaying them
/// ([`Recorder::replay`]) is what a graph launch does; a pass whose launches depended on
/// anything but its device buffers' contents would compute wrong results when replayed
/// at another position. A host copy (`download`, `upload_words`) cannot be captured and is
/// an error, as is a GEMM (the executor never captures a pass long enough for one).
#[derive(Default)]
pub struct Recorder {
    pub ops: Vec<Op>,
}

impl Recorder {
    /// Runs every recorded launch on `dev`, in order.
    pub fn replay(ops: &[Op], dev: &mut dyn Device) -> Result<(), GpuError> {
        ops.iter().try_for_each(|op| op(dev))
    }
}

fn not_capturable(what: &str) -> GpuError {
    GpuError::Model(format!("{what} inside a captured pass"))
}

/// `record!(self, method(args))`: a launch of `method` with `args` (all `Copy`) recorded.
macro_rules! record {
    ($self:ident, $m:ident($($a:expr),*)) => {{
        $self.ops.push(Box::new(move |d: &mut dyn Device| d.$m($($a),*)));
        Ok(())
    }};
}

#[allow(clippy::too_many_arguments)]
impl Device for Recorder {
    fn matvec(
        &mut self,
        suffix: &str,
        w: u64,
        x: u64,
        y: u64,
        rows: i32,
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let s = suffix.to_string();
        self.ops
            .push(Box::new(move |d| d.matvec(&s, w, x, y, rows, cols, ntok)));
        Ok(())
    }
    fn quantize_q8(&mut self, x: u64, xq: u64, nblocks: i32) -> Result<(), GpuError> {
        record!(self, quantize_q8(x, xq, nblocks))
    }
    fn matvec_q8(
        &mut self,
        suffix: &str,
        xq: u64,
        outs: &[Q8Out],
        cols: i32,
        ntok: i32,
    ) -> Result<(), GpuError> {
        let (s, outs) = (suffix.to_string(), outs.to_vec());
        self.ops
            .push(Box::new(move |d| d.matvec_q8(&s, xq, &outs, cols, ntok)));
        Ok(())
    }
    fn dequant(&mut self, suffix: &str, src: u64, dst: u64, nblocks: i32) -> Result<(), GpuError> {
        let s = suffix.to_string();
        self.ops
            .push(Box::new(move |d| d.dequant(&s, src, dst, nblocks)));
        Ok(())
    }
    fn dequant16(
        &mut self,
        suffix: &str,
        src: u64,
        dst: u64,
        nblocks: i32,
    ) -> Result<(), GpuError> {
        let s = suffix.to_string();
        self.ops
            .push(Box::new(move |d| d.dequant16(&s, src, dst, nblocks)));
        Ok(())
    }
    fn to_f16(&mut self, x: u64, dst: u64, n: i32) -> Result<(), GpuError> {
        record!(self, to_f16(x, dst, n))
    }
    fn rmsnorm(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError> {
        record!(self, rmsnorm(x, w, out, n, ntok, eps))
    }
    fn rope(
        &mut self,
        x: u64,
        cos: u64,
        sin: u64,
        n_heads: i32,
        head_dim: i32,
        half: i32,
        neox: bool,
        pos: u64,
        ntok: i32,
    ) -> Result<(), GpuError> {
        record!(
            self,
            rope(x, cos, sin, n_heads, head_dim, half, neox, pos, ntok)
        )
    }
    fn rmsnorm_q8(
        &mut self,
        x: u64,
        w: u64,
        out: u64,
        xq: u64,
        n: i32,
        ntok: i32,
        eps: f32,
    ) -> Result<(), GpuError> {
        record!(self, rmsnorm_q8(x, w, out, xq, n, ntok, eps))
    }
    fn rope_kv(
        &mut self,
        qkv: (u64, u64, u64),
        caches: (u64, u64),
        rope: RopeArgs,
        heads: Heads,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError> {
        let pages = *pages;
        record!(self, rope_kv(qkv, caches, rope, heads, ntok, &pages))
    }
    fn kv_store(
        &mut self,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        kv_dim: i32,
        ntok: i32,
        pages: &KvPages,
    ) -> Result<(), GpuError> {
        let pages = *pages;
        record!(self, kv_store(k, v, kc, vc, kv_dim, ntok, &pages))
    }
    fn attention(
        &mut self,
        q: u64,
        kc: u64,
        vc: u64,
        att: u64,
        out: u64,
        heads: Heads,
        ntok: i32,
        n_ctx: i32,
        pages: &KvPages,
        window: i32,
        softcap: f32,
        sinks: u64,
    ) -> Result<(), GpuError> {
        let pages = *pages;
        record!(
            self,
            attention(q, kc, vc, att, out, heads, ntok, n_ctx, &pages, window, softcap, sinks)
        )
    }
    fn gather_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError> {
        record!(self, gather_rows(dst, src, rows, n, nrows))
    }
    fn glu(&mut self, act: GluAct, gate: u64, up: u64, n: i32) -> Result<(), GpuError> {
        record!(self, glu(act, gate, up, n))
    }
    fn glu_q8(&mut self, act: GluAct, gate: u64, up: u64, xq: u64, n: i32) -> Result<(), GpuError> {
        record!(self, glu_q8(act, gate, up, xq, n))
    }
    fn scatter_add_rows(
        &mut self,
        dst: u64,
        src: u64,
        rows: u64,
        n: i32,
        nrows: i32,
    ) -> Result<(), GpuError> {
        record!(self, scatter_add_rows(dst, src, rows, n, nrows))
    }
    fn add_rows(&mut self, y: u64, b: u64, n: i32, ntok: i32) -> Result<(), GpuError> {
        record!(self, add_rows(y, b, n, ntok))
    }
    fn scale(&mut self, x: u64, s: f32, n: i32) -> Result<(), GpuError> {
        record!(self, scale(x, s, n))
    }
    fn softcap(&mut self, x: u64, cap: f32, n: i32) -> Result<(), GpuError> {
        record!(self, softcap(x, cap, n))
    }
    fn add(&mut self, y: u64, x: u64, n: i32) -> Result<(), GpuError> {
        record!(self, add(y, x, n))
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        record!(self, copy(dst, src, bytes))
    }
    fn zero(&mut self, dst: u64, bytes: usize) -> Result<(), GpuError> {
        record!(self, zero(dst, bytes))
    }
    fn download(&mut self, _src: u64, _dst: &mut [f32]) -> Result<(), GpuError> {
        Err(not_capturable("a device-to-host copy"))
    }
    fn upload_words(&mut self, _dst: u64, _src: &[u32]) -> Result<(), GpuError> {
        Err(not_capturable("a host-to-device copy"))
    }
    fn gemm(
        &mut self,
        _a: u64,
        _b: u64,
        _c: u64,
        _mnk: (i32, i32, i32),
        _ldc: i32,
        _inputs: GemmType,
    ) -> Result<bool, GpuError> {
        Err(not_capturable("a GEMM"))
    }
}
