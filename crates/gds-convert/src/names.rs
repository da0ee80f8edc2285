//! Architecture name maps (from `formats/*.json`) and the grouping of tensors into layers.

pub use gds_format::arch::{family, llama, FamilySpec, RequiredTensors};

/// The canonical family of a GGUF or HF architecture name, if `gdsrun` can run it.
pub fn canonical_family(arch: &str) -> Option<&'static str> {
    gds_format::arch::family_of(arch).map(|f| f.family.as_str())
}

/// Matches `name` against a pattern with one `{N}` placeholder, returning N.
pub fn match_pattern(pattern: &str, name: &str) -> Option<Option<u64>> {
    match pattern.split_once("{N}") {
        None => (pattern == name).then_some(None),
        Some((pre, post)) => {
            let mid = name.strip_prefix(pre)?.strip_suffix(post)?;
            if mid.is_empty()
                || !mid.bytes().all(|b| b.is_ascii_digit())
                || (mid.len() > 1 && mid.starts_with('0'))
            {
                return None;
            }
            mid.parse().ok().map(Some)
        }
    }
}

/// `(block, expert)` when `name` is `pattern` with numbers for its `{N}` and `{E}` (in that
/// order, as every per-expert name has them).
pub fn match_expert(pattern: &str, name: &str) -> Option<(Option<u64>, u64)> {
    let (head, tail) = pattern.split_once("{E}")?;
    let number = |s: &str| -> Option<u64> {
        let ok = !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s.len() == 1 || !s.starts_with('0'));
        ok.then(|| s.parse().ok()).flatten()
    };
    let rest = name.strip_suffix(tail)?;
    // the expert number is the digits at the end of what precedes the tail
    let split = rest.len() - rest.bytes().rev().take_while(u8::is_ascii_digit).count();
    let (before, e) = rest.split_at(split);
    let e = number(e)?;
    Some((match_pattern(head, before)?, e))
}

/// Which layer file a tensor goes into. Ordered: embedding, blocks by number, head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    /// Token embedding (and other input embeddings).
    Embed,
    /// Transformer block N.
    Block(u32),
    /// Final norm, output head, and everything else outside the blocks.
    Head,
}

/// Groups a tensor by the first all-digit component of its dotted name (the layer index in
/// every naming scheme we know: `blk.3.`, `model.layers.3.`, `transformer.h.3.`); tensors
/// without one are the embedding if their name says so, else the head.
pub fn group_of(name: &str) -> Group {
    let parts: Vec<&str> = name.split('.').collect();
    for p in &parts[..parts.len().saturating_sub(1)] {
        if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(n) = p.parse() {
                return Group::Block(n);
            }
        }
    }
    let l = name.to_ascii_lowercase();
    if l.starts_with("token_embd")
        || l.contains("embed_tokens")
        || l.contains("wte")
        || l.contains("word_embeddings")
        || l.starts_with("tok_embeddings")
        || l.contains("embedding")
    {
        Group::Embed
    } else {
        Group::Head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_spec_parses_and_maps() {
        let l = llama();
        assert_eq!(l.family, "llama");
        assert_eq!(canonical_family("qwen2"), Some("llama"));
        assert_eq!(canonical_family("LlamaForCausalLM"), Some("llama"));
        assert_eq!(canonical_family("gemma3"), Some("gemma3"));
        assert_eq!(canonical_family("mamba"), None);
        assert_eq!(
            match_pattern(
                "model.layers.{N}.mlp.up_proj.weight",
                "model.layers.12.mlp.up_proj.weight"
            ),
            Some(Some(12))
        );
        assert_eq!(
            match_pattern(
                "model.layers.{N}.mlp.up_proj.weight",
                "model.layers.x.mlp.up_proj.weight"
            ),
            None
        );
        assert_eq!(
            match_pattern("model.norm.weight", "model.norm.weight"),
            Some(None)
        );
    }

    #[test]
    fn grouping() {
        assert_eq!(group_of("token_embd.weight"), Group::Embed);
        assert_eq!(group_of("blk.7.attn_q.weight"), Group::Block(7));
        assert_eq!(
            group_of("model.layers.11.mlp.up_proj.weight"),
            Group::Block(11)
        );
        assert_eq!(group_of("output_norm.weight"), Group::Head);
        assert_eq!(group_of("output.weight"), Group::Head);
        assert!(
            Group::Embed < Group::Block(0)
                && Group::Block(2) < Group::Block(10)
                && Group::Block(99) < Group::Head
        );
    }
}
