#![doc = include_str!("../README.md")]

mod cuda;
mod dlpack;
mod engine;
mod model;

use pyo3::prelude::*;

pyo3::create_exception!(
    _gdsllm,
    GdsError,
    pyo3::exceptions::PyException,
    "An error of GdsLLM: its message is the one gdsrun prints after `gdsrun: error: `."
);

/// A `GdsError` with `msg`.
pub(crate) fn err(msg: impl std::fmt::Display) -> PyErr {
    GdsError::new_err(msg.to_string())
}

/// The process that first ran gdsllm's work (0: none yet). Worker threads (rayon's global
/// pool, an engine's pool, a stream's thread) do not survive `fork()`: a forked child of a
/// process that already ran some waits for them for ever.
static STARTED_IN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The message of work refused in a forked child.
pub(crate) fn forked_message(what: &str) -> String {
    format!(
        "{what}: this process was forked from one that already ran gdsllm, whose worker \
         threads do not exist after fork(), so gdsllm cannot be used here (it would wait for \
         them for ever): start worker processes with multiprocessing's \"spawn\" or \
         \"forkserver\" start method, or fork before using gdsllm"
    )
}

/// Refuses work (`what`) in a process forked from one that already ran gdsllm's work, and
/// records this process as one that does: called before anything that may start or wait
/// for worker threads.
pub(crate) fn fork_guard(what: &str) -> PyResult<()> {
    use std::sync::atomic::Ordering;
    let me = std::process::id();
    match STARTED_IN.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Ok(()),
        Err(p) if p == me => Ok(()),
        Err(_) => Err(err(forked_message(what))),
    }
}

/// A path argument: a str or an `os.PathLike` (`pathlib.Path`), as a string.
pub(crate) fn path_arg(v: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    if let Ok(s) = v.extract::<String>() {
        return Ok(s);
    }
    let p = v
        .py()
        .import("os")?
        .call_method1("fspath", (v,))
        .map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "{what}: a str or an os.PathLike, not {}",
                v.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "this".into())
            ))
        })?;
    if let Ok(s) = p.extract::<String>() {
        return Ok(s);
    }
    let b: Vec<u8> = p.extract()?;
    String::from_utf8(b)
        .map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("{what}: not UTF-8")))
}

/// Every allocation passes the chat templates' memory bound (gds_format::render_memory), as
/// in gdsrun: a template from a model file cannot take more than its share of memory.
#[global_allocator]
static ALLOC: gds_format::render_memory::TemplateAllocator =
    gds_format::render_memory::TemplateAllocator(std::alloc::System);

/// The extension module `gdsllm._gdsllm`; `gdsllm/__init__.py` re-exports it.
#[pymodule]
fn _gdsllm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GdsError", m.py().get_type::<GdsError>())?;
    m.add("CUDA", cuda::BUILT_WITH_CUDA)?;
    m.add_class::<model::Model>()?;
    m.add_class::<model::Tensor>()?;
    m.add_class::<dlpack::Export>()?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Stream>()?;
    m.add_function(wrap_pyfunction!(model::open, m)?)?;
    m.add_function(wrap_pyfunction!(model::resolve, m)?)?;
    m.add_function(wrap_pyfunction!(model::pull, m)?)?;
    m.add_function(wrap_pyfunction!(engine::convert, m)?)?;
    Ok(())
}
