//! Output that never panics. `println!` panics when stdout's reader has gone
//! (`gdsrun ... | head -1`), `eprintln!` when stderr's has. Here a closed stdout becomes
//! [`Closed`], which travels up like an error and ends the command quietly with exit 0 (as
//! in gdsconv, ripgrep and Python's `BrokenPipeError` idiom); any other write error names
//! stdout (exit 2). Messages to stderr are best effort: if stderr is gone, there is no one
//! to tell.

use gds_runtime::RuntimeError;
use std::io::Write;

/// The reader of stdout went away: stop, quietly, with exit 0.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct Closed;

/// The error for a failed write to stdout.
pub fn stdout_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Closed.into()
    } else {
        RuntimeError::file("stdout", e).into()
    }
}

/// Writes to stdout and flushes (so that a closed pipe is seen now, not at exit).
pub fn write(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(stdout_error)
}

/// Writes to stderr, ignoring failure.
pub fn note(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.flush());
}

/// `println!` that returns `Err(Closed)` instead of panicking: use with `?`.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that cannot panic.
macro_rules! errln {
    () => {
        $crate::out::note(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::note(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprint!` that cannot panic.
macro_rules! err {
    ($($arg:tt)*) => {
        $crate::out::note(format_args!($($arg)*))
    };
}

pub(crate) use {err, errln, outln};
