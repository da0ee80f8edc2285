//! The files `imatrix -o` and `perplexity --save-logits` write: staged beside the output and
//! renamed over it when complete ([`StagedFile`]), never inside the model directory read.

use crate::out::errln;
use anyhow::Result;
use gds_convert::staging::{parent_of, StagedFile};
use gds_convert::ConvertError;
use gds_runtime::RuntimeError;
use std::fs::File;
use std::path::Path;

/// Starts the output `dest` of `flag` (`what` it holds, for messages), refusing a path
/// inside `model_dir`, the model being read (`imatrix -o M/manifest.gdsm` replaced the
/// manifest). Ctrl-C removes the staging directory before the process exits (130); what
/// another signal leaves, the next writer into that directory removes, with a warning.
pub(crate) fn create(
    dest: &Path,
    flag: &str,
    what: &str,
    model_dir: &Path,
) -> Result<(StagedFile, File)> {
    if let (Ok(parent), Ok(model)) = (
        std::fs::canonicalize(parent_of(dest)),
        std::fs::canonicalize(model_dir),
    ) {
        if parent.starts_with(&model) {
            return Err(RuntimeError::Usage(format!(
                "{flag} {}: inside the model directory {}; write it elsewhere",
                dest.display(),
                model_dir.display()
            ))
            .into());
        }
    }
    let (out, f) = StagedFile::create(dest, what).map_err(|e| error(flag, e))?;
    for d in out.removed() {
        errln!(
            "warning: removed {}, left behind by a run that was killed",
            d.display()
        );
    }
    // Ctrl-C ends the process without unwinding: remove the staging directory first
    let staging = out.staging_dir().to_path_buf();
    let _ = ctrlc::set_handler(move || {
        let _ = std::fs::remove_dir_all(&staging);
        std::process::exit(130);
    });
    Ok((out, f))
}

/// The output's errors: an unusable path is a usage error (exit 2), a failed write an I/O
/// error naming the output.
pub(crate) fn error(flag: &str, e: ConvertError) -> RuntimeError {
    match e {
        ConvertError::Io { path, error } => RuntimeError::file(&path, error),
        e => RuntimeError::Usage(format!("{flag} {e}")),
    }
}
