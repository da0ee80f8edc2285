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
