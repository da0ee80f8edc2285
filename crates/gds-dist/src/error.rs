//! Errors, each with the kind that decides the exit code.

/// What kind of failure a [`DistError`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The model or package is invalid, hostile or tampered with (exit 1).
    Invalid,
    /// A usage error or a local I/O error (exit 2).
    Usage,
    /// The registry or the network failed: unreachable, authentication refused, an HTTP
    /// error status (exit 3).
    Registry,
}

/// A failure with a message that names the file, blob or registry concerned.
#[derive(Debug, thiserror::Error)]
#[error("{msg}")]
pub struct DistError {
    /// The kind.
    pub kind: Kind,
    /// The message, printed as is.
    pub msg: String,
}

impl DistError {
    /// An invalid package or model.
    pub fn invalid(msg: impl Into<String>) -> DistError {
        DistError {
            kind: Kind::Invalid,
            msg: msg.into(),
        }
    }
    /// A usage or local I/O error.
    pub fn usage(msg: impl Into<String>) -> DistError {
        DistError {
            kind: Kind::Usage,
            msg: msg.into(),
        }
    }
    /// A registry or network error.
    pub fn registry(msg: impl Into<String>) -> DistError {
        DistError {
            kind: Kind::Registry,
            msg: msg.into(),
        }
    }
    /// An I/O error on `path`.
    pub fn io(path: &std::path::Path, e: std::io::Error) -> DistError {
        DistError::usage(format!("{}: {e}", path.display()))
    }
    /// The process exit code: 1 invalid, 2 usage or I/O, 3 registry.
    pub fn exit_code(&self) -> u8 {
        match self.kind {
            Kind::Invalid => 1,
            Kind::Usage => 2,
            Kind::Registry => 3,
        }
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, DistError>;
