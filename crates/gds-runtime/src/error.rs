//! Errors of the runtime, each with the exit code `gdsrun` reports for it.
//!
//! Every message carries its cause in its own text and no variant also returns that cause
//! from `source()`, so a report that prints the whole chain (`{:#}`) says each thing once.

use std::path::PathBuf;

/// Exit codes of `gdsrun` (README, "Exit codes").
pub mod exit {
    /// Success; also when the reader of stdout went away (`gdsrun ... | head -1`).
    pub const OK: i32 = 0;
    /// The model directory is invalid, incomplete or unreadable, or cannot run here.
    pub const MODEL: i32 = 1;
    /// Usage: a flag value is invalid, a path given on the command line cannot be read, or
    /// the input does not fit (prompt longer than the context, text too short).
    pub const USAGE: i32 = 2;
    /// The CUDA backend cannot run or a CUDA call failed (`--backend cpu` avoids it).
    pub const BACKEND: i32 = 3;
    /// An internal error: a bug in gdsrun.
    pub const INTERNAL: i32 = 4;
}

/// Errors from loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A file of the model directory could not be opened, read or mapped, or does not match
    /// the manifest.
    #[error(transparent)]
    Io(#[from] gds_io::IoError),
    /// The manifest is malformed or lacks a required key.
    #[error("{dir}: invalid manifest: {why}")]
    Manifest {
        /// The model directory.
        dir: String,
        /// What is wrong.
        why: String,
    },
    /// The model directory's content fails an integrity check (hash or size mismatch).
    #[error("{0}")]
    Integrity(String),
    /// The model directory cannot be used (not a directory, or a model this backend cannot
    /// run).
    #[error("{0}")]
    Model(String),
    /// The model's architecture is not one this runtime can run.
    #[error("unsupported architecture {arch:?} (gdsrun runs: llama, mistral, qwen2, smollm, mixtral, qwen3, qwen3moe, gemma2, gemma3, phi3, smollm3, gpt-oss)")]
    UnsupportedArch {
        /// `general.architecture` from the manifest.
        arch: String,
    },
    /// A tensor is missing or has the wrong shape or dtype.
    #[error("tensor {name}: {why}")]
    Tensor {
        /// Canonical tensor name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A kernel refused its input (the kernel's message is included, not chained).
    #[error("kernel: {0}")]
    Kernel(gds_kernels::KernelError),
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// A grammar, JSON schema or regular expression for constrained decoding does not
    /// compile, or the model's vocabulary cannot be used for it.
    #[error("constrained decoding: {0}")]
    Grammar(String),
    /// A run setting is invalid (a bad flag value, or one this model or machine refuses).
    #[error("{0}")]
    Usage(String),
    /// A file named on the command line (or stdin, stdout) could not be read or written.
    #[error("{name}: {error}")]
    File {
        /// The path, or `stdin` / `stdout`.
        name: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// The prompt does not fit in the context window.
    #[error("prompt is {prompt} tokens but the context holds {ctx} (use --ctx to raise it, up to the model's {model_ctx})")]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt: usize,
        /// Context length of the plan.
        ctx: usize,
        /// Context length the model was trained for.
        model_ctx: usize,
    },
    /// The prompt's text is longer than any prompt the context can hold, so it was not
    /// tokenized.
    #[error("prompt is {bytes} bytes of text but the context holds {ctx} tokens of at most {per_token} bytes each ({limit} bytes; use --ctx to raise it)")]
    TextTooLong {
        /// Bytes of text (the rendered chat for chat prompts).
        bytes: usize,
        /// Most bytes a prompt of the context's length can cover.
        limit: usize,
        /// Context length in tokens.
        ctx: usize,
        /// Most bytes one token covers in this vocabulary.
        per_token: usize,
    },
    /// Input for perplexity is too short.
    #[error("{0}")]
    Perplexity(String),
    /// Could not create the thread pool.
    #[error("thread pool: {0}")]
    Threads(String),
    /// The GPU backend is unavailable or a CUDA, cuBLAS or cuFile call failed.
    #[error("{0}")]
    Backend(String),
    /// A broken internal invariant (a bug).
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<gds_kernels::KernelError> for RuntimeError {
    fn from(e: gds_kernels::KernelError) -> Self {
        RuntimeError::Kernel(e)
    }
}

impl RuntimeError {
    /// An error reading or writing a file named on the command line.
    pub fn file(path: impl Into<PathBuf>, error: std::io::Error) -> RuntimeError {
        RuntimeError::File {
            name: path.into().display().to_string(),
            error,
        }
    }

    /// The process exit code for this error (see [`exit`]).
    pub fn exit_code(&self) -> i32 {
        use gds_io::IoError as Io;
        use RuntimeError as E;
        match self {
            E::Io(Io::SpanTooLarge { .. } | Io::PoolExhausted { .. }) => exit::INTERNAL,
            E::Io(Io::OutOfMemory { .. }) => exit::USAGE,
            E::Io(_)
            | E::Manifest { .. }
            | E::Integrity(_)
            | E::Model(_)
            | E::UnsupportedArch { .. }
            | E::Tensor { .. }
            | E::Tokenizer(_)
            | E::Template(_) => exit::MODEL,
            E::Kernel(gds_kernels::KernelError::Unsupported { .. }) => exit::MODEL,
            E::Kernel(_) => exit::INTERNAL,
            E::Usage(_)
            | E::Grammar(_)
            | E::File { .. }
            | E::PromptTooLong { .. }
            | E::TextTooLong { .. }
            | E::Perplexity(_)
            | E::Threads(_) => exit::USAGE,
            E::Backend(_) => exit::BACKEND,
            E::Internal(_) => exit::INTERNAL,
        }
    }
}

/// Result alias.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn os_error_is_in_the_message_once_and_not_chained_again() {
        let os = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let errs = [
            RuntimeError::from(gds_io::IoError::File {
                path: "m/manifest.gdsm".into(),
                error: os(),
            }),
            RuntimeError::file("text.txt", os()),
        ];
        for e in errs {
            // a report prints the message, then each source's (as anyhow's `{:#}` does)
            let mut report = e.to_string();
            let mut cause = e.source();
            while let Some(c) = cause {
                report += &format!(": {c}");
                cause = c.source();
            }
            assert_eq!(report.matches(&os().to_string()).count(), 1, "{report}");
        }
    }

    #[test]
    fn exit_codes_follow_the_documented_table() {
        let cases = [
            (
                RuntimeError::Integrity("layers/blk.0000.bin: hash".into()),
                1,
            ),
            (RuntimeError::Model("not runnable".into()), 1),
            (RuntimeError::Usage("--ctx".into()), 2),
            (RuntimeError::file("x", std::io::Error::other("denied")), 2),
            (RuntimeError::Backend("CUDA".into()), 3),
            (RuntimeError::Internal("bug".into()), 4),
        ];
        for (e, code) in cases {
            assert_eq!(e.exit_code(), code, "{e}");
        }
    }
}
