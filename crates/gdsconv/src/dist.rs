//! `gdsconv pack | push | pull | list | rm | gc`: distribution through OCI registries
//! (`gds-dist`).

use crate::{human, Failure};
use clap::Args;
use gds_dist::layout::{read_layout, write_layout_dir, write_tar};
use gds_dist::package::{package_dir, package_gguf};
use gds_dist::registry::{Remote, RemoteOptions};
use gds_dist::store::Store;
use gds_dist::Artifact;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// `gdsconv pack`.
#[derive(Args)]
pub struct PackArgs {
    /// The model directory (must validate), or a GGUF file (a split one's first shard), packed as itself.
    dir: PathBuf,
    /// Write an OCI image-layout tar (`skopeo copy oci-archive:FILE:TAG …` reads it).
    #[arg(
        short = 'o',
        long,
        conflicts_with = "layout",
        required_unless_present = "layout"
    )]
    output: Option<PathBuf>,
    /// Write an OCI image-layout directory instead (must not exist).
    #[arg(long)]
    layout: Option<PathBuf>,
    /// The tag recorded in index.json (org.opencontainers.image.ref.name): an OCI tag,
    /// `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
    #[arg(long, default_value = "latest", value_parser = parse_tag)]
    tag: String,
    /// Print a JSON summary.
    #[arg(long)]
    json: bool,
}

/// Registry flags shared by push and pull.
#[derive(Args)]
pub struct RegistryFlags {
    /// Talk plain HTTP to the registry (a local registry without TLS).
    #[arg(long)]
    plain_http: bool,
    /// Cap the transfer rate, in bytes per second.
    #[arg(long)]
    limit_rate: Option<u64>,
    /// Give up (exit 3) when a request moves fewer than this many bytes per second,
    /// averaged over --min-rate-window: a registry that stalls or trickles. 0: no minimum.
    #[arg(long, value_name = "BYTES_PER_S", default_value_t = gds_dist::registry::DEFAULT_MIN_RATE)]
    min_rate: u64,
    /// The window --min-rate is averaged over (e.g. 30, 30s, 2m).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    min_rate_window: std::time::Duration,
    /// Give up (exit 3) when the whole push or pull has not finished after this long
    /// (e.g. 90s, 30m, 12h); 0: no deadline. A pull run again resumes its partial downloads.
    #[arg(long, value_name = "DURATION", default_value = "12h", value_parser = parse_duration)]
    timeout: std::time::Duration,
    /// Print a JSON summary.
    #[arg(long)]
    json: bool,
}

/// `gdsconv push`.
#[derive(Args)]
pub struct PushArgs {
    /// A model directory, an OCI image-layout directory, an OCI image-layout tar, or a GGUF file (a split one's first shard) published as itself.
    src: PathBuf,
    /// Where to: REGISTRY/REPOSITORY:TAG.
    reference: String,
    /// Mount blobs the registry holds in this repository (same registry, repeatable)
    /// instead of uploading them: a fine-tune pushed beside its base model uploads only what differs.
    #[arg(long, value_name = "REPOSITORY")]
    mount_from: Vec<String>,
    #[command(flatten)]
    flags: RegistryFlags,
}

/// `gdsconv pull`.
#[derive(Args)]
pub struct PullArgs {
    /// What: REGISTRY/REPOSITORY:TAG or REGISTRY/REPOSITORY@sha256:DIGEST.
    reference: String,
    /// The model directory to create (appears atomically, only once verified).
    out_dir: PathBuf,
    /// Replace OUT_DIR if it exists.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    flags: RegistryFlags,
}

/// `gdsconv list` and `gdsconv gc`.
#[derive(Args)]
pub struct ListArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `gdsconv rm`.
#[derive(Args)]
pub struct RmArgs {
    /// The reference to forget, as `gdsconv list` shows it.
    reference: String,
}

fn bar(total: u64, quiet: bool) -> Option<indicatif::ProgressBar> {
    if quiet || !std::io::stderr().is_terminal() {
        return None;
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(b)
}

fn progress_fn(b: &Option<indicatif::ProgressBar>) -> Arc<dyn Fn(u64) + Send + Sync> {
    let b = b.clone();
    Arc::new(move |n| {
        if let Some(b) = &b {
            b.inc(n);
        }
    })
}

fn dir_size(dir: &Path) -> u64 {
    gds_dist::store::dir_bytes(dir)
}

/// An OCI distribution-spec tag: `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
fn parse_tag(s: &str) -> Result<String, String> {
    let ok = s.len() <= 128
        && s.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_alphanumeric() || b == b'_' || (i > 0 && (b == b'.' || b == b'-'))
        })
        && !s.is_empty();
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not an OCI tag: 1 to 128 of A-Z a-z 0-9 _ . -, not starting with . or -"
        ))
    }
}

/// The model directory named on the command line: a missing path or one that is not a
/// directory is a usage error (exit 2), as for `validate`, `inspect` and `convert`.
fn model_dir_arg(dir: &Path) -> Result<(), Failure> {
    match std::fs::metadata(dir) {
        Err(e) => Err(Failure::Usage(format!("{}: {e}", dir.display()))),
        Ok(m) if !m.is_dir() => Err(Failure::Usage(format!(
            "{}: not a directory",
            dir.display()
        ))),
        Ok(_) => Ok(()),
    }
}

pub fn pack(a: PackArgs) -> Result<ExitCode, Failure> {
    let gguf = gds_convert::gguf::is_gguf_file(&a.dir);
    if !gguf {
        model_dir_arg(&a.dir)?;
    }
    let t0 = Instant::now();
    let size = if gguf {
        std::fs::metadata(&a.dir).map_or(0, |m| m.len())
    } else {
        dir_size(&a.dir)
    };
    let b = bar(size * 2, a.json);
    let p = progress_fn(&b);
    let art = if gguf {
        package_gguf(&a.dir, &|n| p(n))?
    } else {
        package_dir(&a.dir, &|n| p(n))?
    };
    let (out, n) = match (&a.output, &a.layout) {
        (Some(o), _) => (o.clone(), write_tar(&art, o, &a.tag, &|n| p(n))?),
        (None, Some(l)) => (l.clone(), write_layout_dir(&art, l, &a.tag, &|n| p(n))?),
        (None, None) => {
            return Err(Failure::Usage(
                "pack needs -o FILE.tar or --layout DIR".into(),
            ))
        }
    };
    if let Some(b) = b {
        b.finish_and_clear();
    }
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "manifest_digest": art.manifest_digest, "blobs": art.layers.len() + 1,
                "bytes": n, "output": out, "tag": a.tag, "seconds": secs,
            })
        );
    } else {
        println!(
            "packed {} -> {} ({}, {} blobs, {} in {:.2} s): {}",
            a.dir.display(),
            out.display(),
            a.tag,
            art.layers.len() + 1,
            human(n),
            secs,
            art.manifest_digest
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `90`, `90s`, `500ms`, `30m`, `12h`: a duration (plain numbers are seconds).
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 30, 30s, 500ms, 5m, 12h)"))?;
    let scale = match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("{s:?}: the unit must be ms, s, m or h")),
    };
    std::time::Duration::try_from_secs_f64(n * scale).map_err(|e| format!("{s:?}: {e}"))
}

fn remote(
    reference: &str,
    f: &RegistryFlags,
    b: &Option<indicatif::ProgressBar>,
    mount_from: &[String],
) -> Result<Remote, Failure> {
    Ok(Remote::new(
        reference,
        RemoteOptions {
            limits: gds_dist::registry::Limits {
                min_rate: f.min_rate,
                window: f.min_rate_window,
                timeout: (!f.timeout.is_zero()).then_some(f.timeout),
            },
            plain_http: f.plain_http,
            limit_rate: f.limit_rate,
            progress: Some(progress_fn(b)),
            mount_from: mount_from.to_vec(),
            on_total: b
                .clone()
                .map(|b| -> Arc<dyn Fn(u64) + Send + Sync> { Arc::new(move |n| b.set_length(n)) }),
        },
    )?)
}

/// The artifact in `src`: a model directory (packaged in memory), a GGUF (packaged as itself),
/// a layout directory or a tar.
fn source(src: &Path, tag: Option<&str>) -> Result<Artifact, Failure> {
    if src.join(gds_format::MANIFEST_FILE).exists() {
        return Ok(package_dir(src, &|_| {})?);
    }
    if gds_convert::gguf::is_gguf_file(src) {
        return Ok(package_gguf(src, &|_| {})?);
    }
    match std::fs::metadata(src) {
        Err(_) => {
            return Err(Failure::Usage(format!(
                "{}: no such file or directory",
                src.display()
            )))
        }
        // a FIFO, socket or device: refused before gds-dist opens it (an open that blocks)
        Ok(m) if !m.is_file() && !m.is_dir() => {
            return Err(Failure::Usage(format!(
                "{}: not a regular file or directory",
                src.display()
            )))
        }
        Ok(_) => {}
    }
    // a layout: the tag named by the reference, else the only manifest
    match read_layout(src, tag) {
        Ok(a) => Ok(a),
        Err(e) if tag.is_some() && e.kind == gds_dist::Kind::Usage => Ok(read_layout(src, None)?),
        Err(e) => Err(e.into()),
    }
}

pub fn push(a: PushArgs) -> Result<ExitCode, Failure> {
    let t0 = Instant::now();
    let b = bar(0, a.flags.json);
    let r = remote(&a.reference, &a.flags, &b, &a.mount_from)?;
    let art = source(&a.src, r.tag())?;
    if let Some(b) = &b {
        b.set_length(art.total_bytes());
    }
    let s = r.push(&art);
    if let Some(b) = b {
        b.finish_and_clear();
    }
    let s = s?;
    let secs = t0.elapsed().as_secs_f64();
    if a.flags.json {
        print_json(serde_json::to_value(&s)?, secs)?;
    } else {
        println!(
            "pushed {} -> {}: {} blobs ({} uploaded, {} already there, {} mounted), {} in {:.2} s; pull {}@{}",
            a.src.display(),
            s.reference,
            s.blobs,
            s.uploaded_blobs,
            s.skipped_blobs,
            s.mounted_blobs,
            human(s.uploaded_bytes),
            secs,
            r.repository(),
            s.manifest_digest
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A summary as one JSON line, with the elapsed seconds.
fn print_json(mut v: serde_json::Value, secs: f64) -> Result<(), Failure> {
    v["seconds"] = secs.into();
    println!("{v}");
    Ok(())
}

pub fn pull(a: PullArgs) -> Result<ExitCode, Failure> {
    let t0 = Instant::now();
    let store = Store::open_default()?;
    let b = bar(0, a.flags.json);
    let r = remote(&a.reference, &a.flags, &b, &[])?;
    let s = r.pull(&store, &a.out_dir, a.force);
    if let Some(b) = b {
        b.finish_and_clear();
    }
    let s = s?;
    let secs = t0.elapsed().as_secs_f64();
    if a.flags.json {
        print_json(serde_json::to_value(&s)?, secs)?;
    } else {
        println!(
            "pulled {} -> {}: {} blobs ({} downloaded, {} from the store), {} in {:.2} s; {}",
            s.reference,
            a.out_dir.display(),
            s.blobs,
            s.downloaded_blobs,
            s.reused_blobs,
            human(s.downloaded_bytes),
            secs,
            s.manifest_digest
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn list(a: ListArgs) -> Result<ExitCode, Failure> {
    let store = Store::open_default()?;
    let l = store.list();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&l)?);
    } else if l.is_empty() {
        println!("no models in {}", store.root().display());
    } else {
        for m in &l {
            println!("{:<50} {:>10}  {}", m.reference, human(m.bytes), m.digest);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn rm(a: RmArgs) -> Result<ExitCode, Failure> {
    if a.reference.trim().is_empty() {
        return Err(Failure::Usage(
            "rm needs a reference, as `gdsconv list` shows it (an empty one names none)".into(),
        ));
    }
    let store = Store::open_default()?;
    if store.remove_ref(&a.reference)? {
        println!(
            "removed {} (run `gdsconv gc` to free its space)",
            a.reference
        );
        Ok(ExitCode::SUCCESS)
    } else {
        Err(Failure::Usage(format!(
            "{}: no such reference in {} (see `gdsconv list`)",
            a.reference,
            store.root().display()
        )))
    }
}

pub fn gc(a: ListArgs) -> Result<ExitCode, Failure> {
    let store = Store::open_default()?;
    let s = store.gc()?;
    if a.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!(
            "removed {} models and {} blobs ({})",
            s.removed_models,
            s.removed_blobs,
            human(s.removed_bytes)
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_follow_the_oci_grammar() {
        let long = "a".repeat(128);
        for ok in ["latest", "v1.0", "_x", "Q4_K_M-2025.12", "0", long.as_str()] {
            assert_eq!(parse_tag(ok).as_deref(), Ok(ok));
        }
        let too_long = "a".repeat(129);
        for bad in [
            "",
            "bad tag!",
            ".v1",
            "-v1",
            "a:b",
            "a/b",
            "é",
            too_long.as_str(),
        ] {
            assert!(parse_tag(bad).is_err(), "{bad:?}");
        }
    }
}
