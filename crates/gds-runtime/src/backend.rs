//! Choosing the compute backend: `--backend auto|cpu|cuda`.
//!
//! `auto` takes the CPU unless a usable GPU backend is compiled in and present; `cuda` is
//! refused at planning time, with the reason, when it cannot run.

use crate::error::{Result, RuntimeError};

/// The decision: the backend's name and why it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// `cpu` or `cuda`.
    pub name: &'static str,
    /// One line: why this backend (and not another).
    pub reason: String,
}

/// Resolves the user's `--backend` value (`None` = `auto`).
pub fn choose(requested: Option<&str>) -> Result<BackendChoice> {
    match requested.unwrap_or("auto") {
        "cpu" => Ok(BackendChoice {
            name: "cpu",
            reason: "requested with --backend cpu".into(),
        }),
        "auto" => Ok(BackendChoice {
            name: "cpu",
            reason: "auto: this build has no GPU backend (built without the `cuda` feature)".into(),
        }),
        "cuda" => Err(RuntimeError::Plan(
            "--backend cuda: this gdsrun was built without CUDA support \
             (rebuild with `cargo build --release --features cuda`)"
                .into(),
        )),
        other => Err(RuntimeError::Plan(format!(
            "--backend {other}: expected auto, cpu or cuda"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_and_cpu_pick_the_cpu_and_unknown_names_are_refused() {
        assert_eq!(choose(None).unwrap().name, "cpu");
        assert_eq!(choose(Some("cpu")).unwrap().name, "cpu");
        let e = choose(Some("tpu")).unwrap_err().to_string();
        assert!(e.contains("--backend tpu"), "{e}");
    }
}
