/// Errors from loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The model directory could not be opened or read.
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
    /// The model's architecture is not one this runtime can run.
    #[error("unsupported architecture {arch:?} (gdsrun runs the llama family: llama, mistral, qwen2, smollm)")]
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
    /// A kernel refused its input.
    #[error("kernel: {0}")]
    Kernel(#[from] gds_kernels::KernelError),
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// A run setting is invalid (bad flag value).
    #[error("{0}")]
    Plan(String),
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
}

/// Result alias.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
