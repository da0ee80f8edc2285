#![doc = include_str!("../README.md")]

mod dist;

use clap::{Parser, Subcommand};
use gds_convert::{
    convert, inspect::inspect, validate_dir, ConvertError, ConvertOptions, Depth, ErrorKind,
    Progress, QuantOverride, QuantTarget,
};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gdsconv",
    version,
    about = "Package LLM weights in the GdsLLM format (one 4 KiB-aligned file per layer + a zero-copy manifest)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a .gguf file, a .safetensors file, a model.safetensors.index.json or a Hugging Face directory.
    Convert {
        /// The input model: a .gguf (a split one's first shard), a .safetensors, a model.safetensors.index.json, a Hugging Face directory, or one another program fetched: hf:ORG/NAME[:QUANT] (the Hugging Face cache) or ollama:NAME[:TAG] (Ollama's directory).
        input: PathBuf,
        /// The output directory (must not exist, unless --force).
        out_dir: PathBuf,
        /// Output dtype policy: keep, f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q3_k, q4_k, q5_k, q6_k, or a llama.cpp K-quant mix: q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m (per tensor as llama-quantize), or mxfp4_moe (llama-quantize's MXFP4_MOE: a mixture's experts MXFP4, the other matrices q8_0). Matrices whose rows are not whole 256-blocks get llama-quantize's fallback type (q2_k/q3_k -> q4_0, q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0), with a warning; rows that are not whole 32-blocks stay float. Norms and other 1-D float tensors are written f32 under every policy (keep included).
        #[arg(long, default_value = "keep")]
        quant: QuantTarget,
        /// REGEX=TYPE: the matrices whose name the regex matches get TYPE instead (llama-quantize's --tensor-type; repeatable, the first that matches decides). Names are llama.cpp's (blk.3.attn_v.weight, output.weight; `inspect --tensors` lists them); the regex is searched anywhere in the name, letters in either case. TYPE: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4; rows that are not whole blocks of it fall back as with --quant. Norms and other 1-D tensors are never quantized. A bad regex or type: exit 2.
        #[arg(long = "quant-override", value_name = "REGEX=TYPE")]
        quant_override: Vec<QuantOverride>,
        /// Also convert tensors that are already block-quantized (dequantize, then quantize).
        #[arg(long)]
        requantize: bool,
        /// Replace OUT_DIR if it already holds a GdsLLM model.
        #[arg(long)]
        force: bool,
        /// Use this tokenizer.json instead of the input's.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Use this Jinja chat template instead of the input's (for a model whose template is
        /// missing or wrong; checked as a model's template is).
        #[arg(long, value_name = "FILE")]
        chat_template_file: Option<PathBuf>,
        /// Weigh the quantization with this importance matrix (llama.cpp's llama-imatrix output: GGUF or legacy .dat), as llama-quantize --imatrix does: for q4_0, q4_1, q5_0, q5_1 and q2_k .. q6_k (and the mixes), byte-identical to llama-quantize.
        #[arg(long, value_name = "FILE")]
        imatrix: Option<PathBuf>,
        /// Worker threads for quantization, 1 to 1024 (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check a directory against SPEC.md. Exit 0 when valid, 1 when invalid, 2 on usage/I/O errors.
    Validate {
        /// The model directory.
        dir: PathBuf,
        /// Skip content hashing.
        #[arg(long)]
        quick: bool,
        /// Print {"valid", "runnable", "version", "architecture", "errors", "warnings"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show architecture, hyperparameters, per-layer table, totals and the bits per weight (of the model and per dtype, as llama.cpp's BPW).
    Inspect {
        /// The model directory.
        dir: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Also list every tensor.
        #[arg(long)]
        tensors: bool,
    },
    /// Package a model directory as a CNCF ModelPack OCI artifact: an OCI image-layout tar (-o) or directory (--layout).
    Pack(dist::PackArgs),
    /// Upload a model directory, OCI layout directory or layout tar to a registry (skips blobs it has).
    Push(dist::PushArgs),
    /// Download a model from a registry into OUT_DIR (resumable, verified, atomic).
    Pull(dist::PullArgs),
    /// List the models in the local store ($GDSLLM_HOME/store).
    List(dist::ListArgs),
    /// Forget a model reference in the local store (its bytes go at the next gc).
    Rm(dist::RmArgs),
    /// Remove from the local store what no reference uses.
    Gc(dist::ListArgs),
}

/// Most `--threads` (as `gdsrun --threads`).
const MAX_THREADS: usize = 1024;

pub(crate) struct Bar(Option<indicatif::ProgressBar>);

impl Progress for Bar {
    fn start(&self, total: u64) {
        if let Some(b) = &self.0 {
            b.set_length(total);
        }
    }
    fn advance(&self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

pub(crate) fn human(bytes: u64) -> String {
    indicatif::HumanBytes(bytes).to_string()
}

/// Why gdsconv stops early. The message is printed once, as is: every error it comes from
/// already names the file and includes the OS error.
pub(crate) enum Failure {
    /// Exit 1: the input or the model directory is invalid, or the conversion failed.
    Invalid(String),
    /// Exit 2: a usage or I/O error.
    Usage(String),
    /// Exit 3: the registry or the network failed.
    Registry(String),
    /// Exit 0 silently: stdout was closed (e.g. `| head`).
    BrokenPipe,
}

impl From<ConvertError> for Failure {
    fn from(e: ConvertError) -> Self {
        match e.kind() {
            ErrorKind::Input | ErrorKind::Internal => Failure::Invalid(e.to_string()),
            ErrorKind::Usage | ErrorKind::Io => Failure::Usage(e.to_string()),
        }
    }
}

impl From<gds_dist::DistError> for Failure {
    fn from(e: gds_dist::DistError) -> Self {
        match e.kind {
            gds_dist::Kind::Invalid => Failure::Invalid(e.msg),
            gds_dist::Kind::Usage => Failure::Usage(e.msg),
            gds_dist::Kind::Registry => Failure::Registry(e.msg),
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Failure::BrokenPipe
        } else {
            Failure::Usage(format!("writing the output: {e}"))
        }
    }
}

impl From<serde_json::Error> for Failure {
    fn from(e: serde_json::Error) -> Self {
        match e.io_error_kind() {
            Some(k) => std::io::Error::from(k).into(),
            None => Failure::Usage(format!("writing JSON: {e}")),
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, Failure> {
    match cli.cmd {
        Cmd::Convert {
            input,
            out_dir,
            quant,
            quant_override,
            requantize,
            force,
            tokenizer,
            chat_template_file,
            imatrix,
            threads,
            json,
        } => {
            if let Some(n) = threads {
                // gdsrun's rule (gds_runtime::Plan): 1 to 1024
                if n == 0 {
                    return Err(Failure::Usage("--threads must be at least 1".into()));
                }
                if n > MAX_THREADS {
                    return Err(Failure::Usage(format!(
                        "--threads {n} is too many (at most {MAX_THREADS})"
                    )));
                }
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build_global()
                    .map_err(|e| Failure::Usage(format!("--threads {n}: {e}")))?;
            }
            let bar = if std::io::stderr().is_terminal() && !json {
                let b = indicatif::ProgressBar::new(0);
                b.set_style(
                    indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                Bar(Some(b))
            } else {
                Bar(None)
            };
            // a model in the Hugging Face cache or Ollama's directory, unless a path has
            // that name
            let (input, generation_config) = match input.to_str().and_then(|s| {
                (!input.exists())
                    .then(|| gds_dist::resolve::other_programs_model(s))
                    .flatten()
                    .map(|p| (s.to_string(), p))
            }) {
                Some((spec, p)) => {
                    let p = p?;
                    // an Ollama model's parameters: its recommended sampling
                    let g = p.generation_config(&spec, false)?;
                    (p.path, g)
                }
                None => (input, None),
            };
            let opts = ConvertOptions {
                quant,
                requantize,
                force,
                tokenizer,
                imatrix,
                overrides: quant_override,
                generation_config,
                chat_template_file,
            };
            let s = convert(&input, &out_dir, &opts, &bar).inspect_err(|_e| {
                bar.finish();
            })?;
            for w in &s.warnings {
                eprintln!("warning: {w}");
            }
            let gbs = s.tensor_bytes as f64 / s.seconds.max(1e-9) / 1e9;
            if json {
                let j = serde_json::json!({
                    "output": out_dir, "architecture": s.arch, "runnable": s.runnable, "tensors": s.tensors,
                    "layers": s.layers, "tensor_bytes": s.tensor_bytes, "file_bytes": s.file_bytes,
                    "seconds": s.seconds, "gb_per_sec": gbs, "warnings": s.warnings,
                });
                println!("{j}");
            } else {
                println!(
                    "converted {} -> {}: {} tensors in {} layer files, {} in {:.2} s ({:.2} GB/s)",
                    input.display(),
                    out_dir.display(),
                    s.tensors,
                    s.layers,
                    human(s.tensor_bytes),
                    s.seconds,
                    gbs
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Validate { dir, quick, json } => {
            if !dir.is_dir() {
                return Err(Failure::Usage(format!(
                    "{}: not a directory",
                    dir.display()
                )));
            }
            let r = validate_dir(&dir, if quick { Depth::Quick } else { Depth::Full });
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                for w in &r.warnings {
                    println!("warning: {w}");
                }
                for e in &r.errors {
                    println!("error: {e}");
                }
                if r.valid {
                    println!(
                        "{}: valid{}",
                        dir.display(),
                        if quick {
                            " (content hashes not checked: --quick)"
                        } else {
                            ""
                        }
                    );
                } else {
                    println!("{}: INVALID ({} errors)", dir.display(), r.errors.len());
                }
            }
            Ok(if r.valid {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Inspect { dir, json, tensors } => {
            let i = inspect(&dir).map_err(Failure::Usage)?;
            let mut out = std::io::stdout().lock();
            if json {
                let mut v = serde_json::to_value(&i)?;
                if !tensors {
                    if let Some(o) = v.as_object_mut() {
                        o.remove("tensors");
                    }
                }
                writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            writeln!(
                out,
                "{}  (GdsLLM format {})",
                dir.display(),
                i.format_version
            )?;
            writeln!(out, "architecture: {}", i.architecture)?;
            for (k, v) in i.metadata.iter().filter(|(k, _)| !k.starts_with("gguf.")) {
                writeln!(out, "  {k:<40} {v}")?;
            }
            writeln!(
                out,
                "\n{:<10} {:<24} {:>7} {:>12} {:>12}  dtypes",
                "layer", "file", "tensors", "bytes", "file bytes"
            )?;
            for l in &i.layers {
                let d: Vec<String> = l.dtypes.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                writeln!(
                    out,
                    "{:<10} {:<24} {:>7} {:>12} {:>12}  {}",
                    l.name,
                    l.file,
                    l.tensors,
                    l.tensor_bytes,
                    l.file_bytes,
                    d.join(" ")
                )?;
            }
            let d: Vec<String> = i.dtypes.iter().map(|(k, v)| format!("{k}:{v}")).collect();
            writeln!(
                out,
                "\ntotal: {} layers, {} tensors, {} parameters, {} of tensors ({} on disk), dtypes {}",
                i.layers.len(),
                i.total_tensors,
                i.parameters,
                human(i.total_tensor_bytes),
                human(i.total_file_bytes),
                d.join(" ")
            )?;
            // llama.cpp's "BPW": bytes x 8 / weights, of the model and of each dtype
            writeln!(
                out,
                "\n{:<8} {:>7} {:>14} {:>14} {:>7}",
                "dtype", "tensors", "weights", "bytes", "bpw"
            )?;
            for (name, d) in &i.by_dtype {
                writeln!(
                    out,
                    "{:<8} {:>7} {:>14} {:>14} {:>7.4}",
                    name, d.tensors, d.parameters, d.bytes, d.bits_per_weight
                )?;
            }
            writeln!(
                out,
                "{:<8} {:>7} {:>14} {:>14} {:>7.4}",
                "all", i.total_tensors, i.parameters, i.total_tensor_bytes, i.bits_per_weight
            )?;
            writeln!(
                out,
                "bits per weight: {:.2} (tensor bytes x 8 / weights, as llama.cpp's BPW)",
                i.bits_per_weight
            )?;
            if tensors {
                writeln!(out)?;
                for t in &i.tensors {
                    writeln!(
                        out,
                        "{:<40} {:<6} {:<8} {:<20} @{:<10} {}",
                        t.name,
                        t.layer,
                        t.dtype,
                        format!("{:?}", t.shape),
                        t.offset,
                        t.nbytes
                    )?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Pack(a) => dist::pack(a),
        Cmd::Push(a) => dist::push(a),
        Cmd::Pull(a) => dist::pull(a),
        Cmd::List(a) => dist::list(a),
        Cmd::Rm(a) => dist::rm(a),
        Cmd::Gc(a) => dist::gc(a),
    }
}

/// Every allocation passes the chat templates' memory bound (gds_format::render_memory): a
/// template from a model file cannot take more than its share of memory.
#[global_allocator]
static ALLOC: gds_format::render_memory::TemplateAllocator =
    gds_format::render_memory::TemplateAllocator(std::alloc::System);

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(Failure::BrokenPipe) => ExitCode::SUCCESS,
        Err(Failure::Invalid(msg)) => {
            eprintln!("gdsconv: error: {msg}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(msg)) => {
            eprintln!("gdsconv: error: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Registry(msg)) => {
            eprintln!("gdsconv: error: {msg}");
            ExitCode::from(3)
        }
    }
}
