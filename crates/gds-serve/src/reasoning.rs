//! `reasoning_format` (llama-server's field, `--reasoning-format`): whether a thinking model's
//! reply comes back split into reasoning and answer ([`gds_runtime::reasoning`] splits it).

use crate::error::ApiError;
pub use gds_runtime::reasoning::{Reasoning, Split};

/// `reasoning_format`: whether replies are split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Split (`auto`, `deepseek`, `deepseek-legacy`).
    Split,
    /// The reply whole, thinking tags included, in `content`.
    None,
}

impl Format {
    /// llama-server's names.
    pub fn parse(s: &str) -> Result<Format, String> {
        match s {
            "auto" | "deepseek" | "deepseek-legacy" => Ok(Format::Split),
            "none" => Ok(Format::None),
            other => Err(format!(
                "reasoning_format {other:?} is not one of auto, deepseek, deepseek-legacy, none"
            )),
        }
    }

    /// A request's `reasoning_format`, else the server's.
    pub fn of_request(field: Option<&str>, default: Format) -> Result<Format, ApiError> {
        field.map_or(Ok(default), |f| {
            Format::parse(f).map_err(|e| ApiError::bad(e).param("reasoning_format"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_by_name() {
        assert_eq!(Format::parse("deepseek"), Ok(Format::Split));
        assert_eq!(Format::parse("none"), Ok(Format::None));
        assert!(Format::parse("bogus").is_err());
    }
}
