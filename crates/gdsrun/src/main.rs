#![doc = include_str!("../README.md")]

mod bench;
mod cli;
mod doctor;
mod imatrix;
mod out;
mod perplexity;
mod run;
mod staged;

use clap::Parser;
use cli::{Cli, Command};
use gds_runtime::error::exit;
use gds_runtime::RuntimeError;
use out::errln;

/// Subcommand names; anything else in first position means `run`.
const SUBCOMMANDS: &[&str] = &[
    "run",
    "chat",
    "perplexity",
    "imatrix",
    "bench",
    "serve",
    "batch",
    "doctor",
    "help",
];

/// Inserts `run` when the first argument is not a subcommand or a top-level flag, so that
/// `gdsrun MODEL_DIR ...` means `gdsrun run MODEL_DIR ...`.
fn with_default_subcommand(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let first = args.get(1).and_then(|a| a.to_str()).map(str::to_string);
    match first.as_deref() {
        Some(a)
            if SUBCOMMANDS.contains(&a) || matches!(a, "-h" | "--help" | "-V" | "--version") => {}
        None => {}
        Some(_) => args.insert(1, "run".into()),
    }
    args
}

/// [`resolve`], and a model that resolved into the store (a reference, a `.gguf`, `hf:`,
/// `ollama:`, a checkpoint directory: any path but its own) is served under a name from what
/// was written, not the store directory's, unless `--alias` names it.
fn resolve_named(p: &mut std::path::PathBuf, alias: &mut Option<String>, plain_http: bool) {
    let spec = p.clone();
    resolve(p, plain_http);
    if let (None, Some(s)) = (&alias, spec.to_str()) {
        if *p != spec {
            *alias = Some(gds_dist::resolve::display_name(s));
        }
    }
}

/// Exit code for a registry or network failure while pulling MODEL.
const EXIT_REGISTRY: i32 = 5;

/// Replaces a registry reference or a `.gguf` path by the store directory it resolves to.
fn resolve(p: &mut std::path::PathBuf, plain_http: bool) {
    let Some(spec) = p.to_str().map(str::to_string) else {
        return;
    };
    let opts = gds_dist::resolve::ResolveOptions {
        remote: gds_dist::registry::RemoteOptions {
            plain_http,
            ..Default::default()
        },
        quiet: false,
    };
    match gds_dist::resolve::resolve_model(&spec, &opts) {
        Ok(dir) => *p = dir,
        Err(e) => {
            errln!("gdsrun: error: {e}");
            std::process::exit(match e.kind {
                gds_dist::Kind::Invalid => exit::MODEL,
                gds_dist::Kind::Usage => exit::USAGE,
                gds_dist::Kind::Registry => EXIT_REGISTRY,
            });
        }
    }
}

/// Every allocation passes the chat templates' memory bound (gds_format::render_memory): a
/// template from a model file cannot take more than its share of memory.
#[global_allocator]
static ALLOC: gds_format::render_memory::TemplateAllocator =
    gds_format::render_memory::TemplateAllocator(std::alloc::System);

fn main() {
    let mut cli = Cli::parse_from(with_default_subcommand(std::env::args_os().collect()));
    let ph = cli.plain_http;
    match &mut cli.command {
        Command::Run(a) => resolve(&mut a.common.model_dir, ph),
        Command::Perplexity(a) => resolve(&mut a.common.model_dir, ph),
        Command::Imatrix(a) => resolve(&mut a.common.model_dir, ph),
        Command::Bench(a) => resolve(&mut a.common.model_dir, ph),
        Command::Serve(a) => resolve_named(&mut a.model_dir, &mut a.engine.alias, ph),
        Command::Batch(a) => resolve_named(&mut a.model_dir, &mut a.engine.alias, ph),
        Command::Doctor(a) => {
            if let Some(d) = a.model_dir.as_mut() {
                resolve(d, ph)
            }
        }
    }
    let engine = match &cli.command {
        Command::Serve(a) => Some(&a.engine),
        Command::Batch(a) => Some(&a.engine),
        _ => None,
    };
    if let Some(e) = engine {
        if let Err(e) = check_engine(e) {
            std::process::exit(report(&e.into()));
        }
    }
    let result = match cli.command {
        Command::Run(a) => run::run(*a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Imatrix(a) => imatrix::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => gds_serve::run(a),
        Command::Batch(a) => gds_serve::batch::run(a),
        Command::Doctor(a) => doctor::run(a),
    };
    if let Err(e) = result {
        std::process::exit(report(&e));
    }
}

/// The checks of `serve`'s and `batch`'s engine flags made before anything starts: a
/// `--step-tokens 0` is refused (it was raised to --max-batch without a word), and flags of
/// the CUDA backend given to the CPU backend are warned about.
fn check_engine(e: &gds_serve::EngineArgs) -> Result<(), RuntimeError> {
    if e.step_tokens == 0 {
        return Err(RuntimeError::Usage(
            "--step-tokens must be at least 1".into(),
        ));
    }
    let cpu = e.backend == "cpu" || (e.backend == "auto" && !cfg!(feature = "cuda"));
    if cpu {
        if let Some(w) = run::cuda_only_warning(&[
            (e.gemm_type.is_some(), "--gemm-type"),
            (e.cuda_graphs.is_some(), "--cuda-graphs"),
            (e.gemm_min_tokens.is_some(), "--gemm-min-tokens"),
        ]) {
            errln!("gdsrun: warning: {w}");
        }
    }
    Ok(())
}

/// Prints `e` (unless it is a closed stdout, which is no failure) and returns the exit code:
/// that of the first [`RuntimeError`] in its chain, else 2 for an OS error, else 1.
fn report(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.is::<out::Closed>()) {
        return exit::OK;
    }
    errln!("gdsrun: error: {e:#}");
    if let Some(r) = e.chain().find_map(|c| c.downcast_ref::<RuntimeError>()) {
        r.exit_code()
    } else if e.chain().any(|c| c.is::<std::io::Error>()) {
        exit::USAGE
    } else {
        exit::MODEL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        // clap's own checks (no two flags with one name or letter, ...): compiled into
        // debug builds only, so `cargo test` (tier 1) runs them; release builds skip them
        // at parse time too
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    fn args(v: &[&str]) -> Vec<String> {
        with_default_subcommand(v.iter().map(Into::into).collect())
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    #[test]
    fn model_dir_first_means_run() {
        assert_eq!(
            args(&["gdsrun", "m.gds", "--prompt", "hi"]),
            ["gdsrun", "run", "m.gds", "--prompt", "hi"]
        );
        assert_eq!(
            args(&["gdsrun", "run", "m.gds"]),
            ["gdsrun", "run", "m.gds"]
        );
        assert_eq!(
            args(&["gdsrun", "bench", "m.gds"]),
            ["gdsrun", "bench", "m.gds"]
        );
        assert_eq!(args(&["gdsrun", "--help"]), ["gdsrun", "--help"]);
        assert_eq!(args(&["gdsrun"]), ["gdsrun"]);
        // `chat` is run's other name (the docs' `gdsrun chat MODEL`; a model directory
        // named `chat` needs `./chat`)
        let cli = Cli::try_parse_from(args(&["gdsrun", "chat", "m.gds", "--temp", "0"])).unwrap();
        let Command::Run(r) = cli.command else {
            panic!("chat is run")
        };
        assert_eq!(r.common.model_dir, std::path::Path::new("m.gds"));
    }

    #[test]
    fn cli_parses_run_flags() {
        let cli = Cli::try_parse_from(args(&[
            "gdsrun", "m", "--prompt", "p", "--stop", "a", "--stop", "b", "--temp", "0", "--json",
        ]))
        .unwrap();
        let Command::Run(r) = cli.command else {
            panic!("expected run")
        };
        assert_eq!(r.stop, ["a", "b"]);
        assert_eq!(r.sampling.temp, Some(0.0));
        assert!(r.json);
        assert_eq!((r.common.isa, r.draft_gate.as_deref()), (None, None));
    }

    #[test]
    fn cli_parses_the_isa_and_the_draft_gate() {
        let cli = Cli::try_parse_from(args(&[
            "gdsrun",
            "m",
            "--isa",
            "avx2",
            "--draft",
            "ngram",
            "--draft-gate",
            "off",
        ]))
        .unwrap();
        let Command::Run(r) = cli.command else {
            panic!("expected run")
        };
        assert_eq!(r.common.isa, Some(gds_runtime::Isa::Avx2));
        assert_eq!(r.draft_gate.as_deref(), Some("off"));
        for bad in [["--isa", "sse2"], ["--draft-gate", "maybe"]] {
            let mut v = vec!["gdsrun", "m"];
            v.extend(bad);
            assert!(Cli::try_parse_from(args(&v)).is_err(), "{bad:?}");
        }
        // bench and perplexity share --isa
        let cli = Cli::try_parse_from(args(&["gdsrun", "bench", "m", "--isa", "scalar"])).unwrap();
        let Command::Bench(b) = cli.command else {
            panic!("expected bench")
        };
        assert_eq!(b.common.isa, Some(gds_runtime::Isa::Scalar));
    }
}
