//! PLACEHOLDER until the tokenizer export lands (owned by the tokenizer helper; overwrite freely).
use std::collections::BTreeMap;
/// Export result.
pub struct TokenizerExport {
    /// tokenizer.json
    pub tokenizer_json: String,
    /// tokenizer_config.json
    pub tokenizer_config_json: String,
}
/// Error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenizerError(String);
/// Builds tokenizer.json from GGUF metadata.
pub fn tokenizer_from_gguf(_meta: &BTreeMap<String, serde_json::Value>) -> Result<TokenizerExport, TokenizerError> {
    Err(TokenizerError("not yet implemented".into()))
}
