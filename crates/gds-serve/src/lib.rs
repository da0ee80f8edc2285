//! `gdsrun serve`: an OpenAI-compatible HTTP server over the GdsLLM runtime.
//!
//! Scaffold: the subcommand and its flags exist; the server is being built (issue 6).

use clap::Args;
use std::path::PathBuf;

/// `gdsrun serve` flags.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model directory (made by `gdsconv convert`).
    pub model_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
}

/// Runs the server until it is stopped.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "gdsrun serve {}: the server is not implemented yet",
        args.model_dir.display()
    )
}
