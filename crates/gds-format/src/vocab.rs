//! Vocabulary facts the converter and the runtime share (one value each).

/// Largest `tokenizer.json` read, bounded before reading (the largest real vocabularies take
/// about 35 MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Token texts llama.cpp treats as ending a turn (`llama_vocab::impl::load`, "auto-detect
/// special tokens by text"): a subset of [`END_OF_GENERATION_TEXTS`].
pub const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Token texts llama.cpp treats as ending generation when the vocabulary has them: the
/// converter marks them CONTROL and end-of-generation, the runtime stops at them (when the
/// vocabulary marks them special).
pub const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle padding, repository and file-separator token texts, which llama.cpp
/// also stops at (`llama_vocab::impl::load`: its FIM pad, repo and separator tokens join the
/// end-of-generation set): a model that writes one has left the reply for another document.
pub const FIM_END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// Fill-in-the-middle token texts llama.cpp finds by text when the metadata names none
/// (`llama_vocab::impl::load`), per slot: prefix, suffix, middle, pad, repository, file
/// separator ([`FIM_SLOTS`]). Of a slot's texts present in a vocabulary, llama.cpp takes the
/// first in byte order.
pub const FIM_TEXTS: [&[&str]; 6] = [
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ],
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ],
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ],
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// The names of [`FIM_TEXTS`]'s slots in `tokenizer_config.json`'s [`FIM_CONFIG_KEY`] object
/// (gdsconv writes the tokens a GGUF names or has, as texts).
pub const FIM_SLOTS: [&str; 6] = ["prefix", "suffix", "middle", "pad", "repo", "separator"];

/// The `tokenizer_config.json` key of a model's fill-in-the-middle tokens (gdsconv's own).
pub const FIM_CONFIG_KEY: &str = "fim_tokens";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_end_of_turn_text_ends_generation() {
        for t in END_OF_TURN_TEXTS {
            assert!(END_OF_GENERATION_TEXTS.contains(t), "{t}");
        }
    }
}
