//! How `gdsrun` fails on ordinary use: a closed stdout is no failure, every error has the
//! exit code of its kind (README, "Exit codes"), an OS error is printed once, and hostile
//! flag values are usage errors, never panics.

use crate::gdsrun;
use std::io::Write;
use std::process::{Command, Output, Stdio};

/// SmolLM2 converted once per test binary.
fn model() -> &'static str {
    gds_tests::smollm_converted()
        .to_str()
        .expect("temporary path is UTF-8")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs gdsrun with stdout (and, with `stderr_too`, stderr) a pipe whose reader has already
/// gone, as after `| head -1` exits: every write to it fails with EPIPE. `stdin` is fed to
/// the chat. Returns the output with stderr captured unless it is the closed pipe.
fn with_closed_stdout(args: &[&str], stdin: Option<&str>, stderr_too: bool) -> Output {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gdsrun"));
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(if stderr_too {
            Stdio::from(writer.try_clone().expect("dup pipe"))
        } else {
            Stdio::piped()
        })
        .stdout(writer);
    let mut child = cmd.spawn().expect("spawn gdsrun");
    if let Some(s) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(s.as_bytes())
            .expect("write stdin");
    }
    // `cmd` still holds the pipe's write end: drop it so the child's is the only one.
    drop(cmd);
    child.wait_with_output().expect("wait for gdsrun")
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn closed_stdout_pipe_ends_every_command_quietly_with_exit_0() {
    let dir = tempfile::tempdir().unwrap();
    let txt = dir.path().join("text.txt");
    std::fs::write(
        &txt,
        "The quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let txt = txt.to_str().unwrap();
    let m = model();
    let run = [m, "--prompt", "hi", "--max-tokens", "4", "--temp", "0"];
    let cases: Vec<(Vec<&str>, Option<&str>)> = vec![
        (vec![m, "--plan"], None),
        (run.to_vec(), None),
        ([&run[..], &["--json"]].concat(), None),
        (
            vec![m, "--max-tokens", "4", "--temp", "0"],
            Some("hi\nhello\n"),
        ),
        (vec!["bench", m, "-p", "8", "-n", "2", "-r", "1"], None),
        (
            vec!["bench", m, "-p", "8", "-n", "2", "-r", "1", "--json"],
            None,
        ),
        (vec!["doctor"], None),
        (vec!["doctor", m, "--json"], None),
        (vec!["perplexity", m, "-f", txt, "--ctx", "32"], None),
        (
            vec!["perplexity", m, "-f", txt, "--ctx", "32", "--json"],
            None,
        ),
    ];
    for (args, stdin) in cases {
        let o = with_closed_stdout(&args, stdin, false);
        let err = text(&o.stderr);
        assert!(!err.contains("panicked"), "gdsrun {args:?}: {err}");
        assert!(!err.contains("error"), "gdsrun {args:?}: {err}");
        assert_eq!(o.status.code(), Some(0), "gdsrun {args:?}: {err}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn closed_stdout_and_stderr_pipe_exits_0_instead_of_panicking() {
    // `gdsrun ... 2>&1 | head -1`: the metrics line on stderr fails too.
    for args in [
        &[
            model(),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--temp",
            "0",
        ][..],
        &["perplexity", model(), "-f", "/nonexistent.txt"],
    ] {
        let o = with_closed_stdout(args, None, true);
        let code = if args[0] == "perplexity" { 2 } else { 0 };
        assert_eq!(o.status.code(), Some(code), "gdsrun {args:?}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn os_error_is_printed_once() {
    let o = gdsrun(&["/nonexistent/model.gds", "--prompt", "hi"]);
    let err = text(&o.stderr);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.contains("/nonexistent/model.gds"), "{err}");
    assert_eq!(o.status.code(), Some(2), "{err}");
    // a directory without a manifest: the model is invalid (1), the OS error once
    let empty = tempfile::tempdir().unwrap();
    let o = gdsrun(&[empty.path().to_str().unwrap(), "--prompt", "hi"]);
    let err = text(&o.stderr);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.contains(gds_format::MANIFEST_FILE), "{err}");
    assert_eq!(o.status.code(), Some(1), "{err}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn cuda_backend_failure_exits_3_not_as_a_usage_error() {
    // Without the `cuda` feature or a usable GPU, --backend cuda cannot run here: that is
    // the backend's failure (3), which `--backend cpu` avoids. Where it can run, it plans.
    let o = gdsrun(&[model(), "--backend", "cuda", "--plan"]);
    let err = text(&o.stderr);
    assert!(
        o.status.success() || (o.status.code() == Some(3) && err.contains("--backend cuda")),
        "{:?}: {err}",
        o.status
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn input_that_does_not_fit_is_a_usage_error() {
    let long = "word ".repeat(100);
    let o = gdsrun(&[model(), "--raw", "--prompt", &long, "--ctx", "32"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let o = gdsrun(&["bench", model(), "-p", "0", "-n", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("nothing to run"));
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn hostile_flag_values_are_usage_errors_not_panics() {
    let m = model();
    let max = u64::MAX.to_string();
    let over = "18446744073709551616";
    let cases: Vec<Vec<&str>> = vec![
        vec![m, "-p", "hi", "--ctx", &max],
        vec![m, "-p", "hi", "--ctx", over],
        vec![m, "-p", "hi", "--ctx", "0"],
        vec![m, "-p", "hi", "--ctx", "-1"],
        vec![m, "-p", "hi", "--threads", "0"],
        vec![m, "-p", "hi", "--threads", &max],
        vec![m, "-p", "hi", "--batch", "0"],
        vec![m, "-p", "hi", "--max-tokens", "0"],
        vec![m, "-p", "hi", "--max-tokens", over],
        vec![m, "-p", "hi", "--mem-budget", "99999999999999999999999"],
        vec![m, "-p", "hi", "--mem-budget", "1e400"],
        vec![m, "-p", "hi", "--mem-budget", "1"],
        vec![m, "-p", "hi", "--mem-budget", "0"],
        vec![m, "-p", "hi", "--vram-budget", &max],
        vec![m, "-p", "hi", "--vram-budget", "0"],
        vec![m, "-p", "hi", "--temp", "nan"],
        vec![m, "-p", "hi", "--temp", "inf"],
        vec![m, "-p", "hi", "--top-p", "0"],
        vec![m, "-p", "hi", "--min-p", "nan"],
        vec![m, "-p", "hi", "--repeat-penalty", "-1"],
        vec![m, "-p", "hi", "--max-joules", "nan"],
        vec![m, "-p", "hi", "--seed", "-1"],
        vec![m, "-p", "hi", "--stop", ""],
        vec![m, "--raw", "-p", ""],
        vec!["bench", m, "-r", "0"],
        vec!["bench", m, "-r", &max],
        vec!["bench", m, "-p", &max],
        vec!["bench", m, "-n", &max, "-p", "0"],
        vec!["bench", m, "-b", "0"],
        vec!["perplexity", m, "-f", "/dev/null", "--ctx", "0"],
        vec!["perplexity", m, "-f", "/dev/null", "--ctx", &max],
        vec!["perplexity", m, "-f", "/dev/null", "--ctx", "4"],
        vec!["doctor", m, "--mem-budget", "99999999999999999999999"],
        vec!["doctor", m, "--vram-budget", "0"],
    ];
    for args in cases {
        let o = gdsrun(&args);
        let err = text(&o.stderr);
        assert!(!err.contains("panicked"), "gdsrun {args:?}: {err}");
        assert_eq!(o.status.code(), Some(2), "gdsrun {args:?}: {err}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn huge_repeat_last_n_is_not_allocated_up_front() {
    // Looking back further than the context is allowed (it means the whole context); it
    // used to preallocate that many entries and abort with "capacity overflow".
    let max = u64::MAX.to_string();
    let o = gdsrun(&[
        model(),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--temp",
        "0",
        "--repeat-last-n",
        &max,
    ]);
    let err = text(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(o.status.code(), Some(0), "{err}");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn frequency_and_presence_penalties_change_the_greedy_reply_and_are_range_checked() {
    let m = model();
    let reply = |extra: &[&str]| {
        let mut args = vec![
            m,
            "--raw",
            "--prompt",
            "My favourite fruits are apples, apples and apples. I eat apples",
            "--max-tokens",
            "24",
            "--temp",
            "0",
        ];
        args.extend_from_slice(extra);
        let o = gdsrun(&args);
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    let plain = reply(&[]);
    assert_eq!(
        reply(&["--frequency-penalty", "0", "--presence-penalty", "0"]),
        plain
    );
    let penalized = reply(&["--frequency-penalty", "2", "--presence-penalty", "-0.5"]);
    assert_ne!(penalized, plain);
    for (flag, v) in [("--frequency-penalty", "3"), ("--presence-penalty", "-2.5")] {
        let o = gdsrun(&[m, "-p", "hi", flag, v]);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("{flag} {v} must be in [-2, 2]")),
            "{err}"
        );
    }
}
