//! The input of a forward pass: a [`Batch`] of tokens, each at its position in its
//! sequence, with or without a request for its logits (or for its final-normed hidden state:
//! embeddings). Every backend takes it (the CPU
//! model, attention, the CUDA graph, the executors).

/// A batch of tokens to run through the model. Reused between calls: clearing keeps the
/// capacity, so the token loop does not allocate.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub(crate) tokens: Vec<u32>,
    pub(crate) positions: Vec<usize>,
    pub(crate) seqs: Vec<usize>,
    pub(crate) outputs: Vec<bool>,
    /// Tokens whose final-normed hidden state is wanted (embeddings), not their logits.
    pub(crate) hidden: Vec<bool>,
}

impl Batch {
    /// An empty batch with room for `n` tokens.
    pub fn with_capacity(n: usize) -> Batch {
        Batch {
            tokens: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            seqs: Vec::with_capacity(n),
            outputs: Vec::with_capacity(n),
            hidden: Vec::with_capacity(n),
        }
    }

    /// Removes every token.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.seqs.clear();
        self.outputs.clear();
        self.hidden.clear();
    }

    /// Adds `token` at position `pos` of sequence `seq`; `output` asks for its logits.
    pub fn push(&mut self, token: u32, pos: usize, seq: usize, output: bool) {
        self.tokens.push(token);
        self.positions.push(pos);
        self.seqs.push(seq);
        self.outputs.push(output);
        self.hidden.push(false);
    }

    /// Adds `token` at position `pos` of sequence `seq`, asking for its final-normed hidden
    /// state (an embedding row, [`crate::model::RunState::hidden`]) and no logits.
    pub fn push_hidden(&mut self, token: u32, pos: usize, seq: usize) {
        self.tokens.push(token);
        self.positions.push(pos);
        self.seqs.push(seq);
        self.outputs.push(false);
        self.hidden.push(true);
    }

    /// Whether entry `k` asks for its hidden state.
    pub fn wants_hidden(&self, k: usize) -> bool {
        self.hidden.get(k).copied().unwrap_or(false)
    }

    /// Number of tokens whose hidden state is wanted.
    pub fn n_hidden(&self) -> usize {
        self.hidden.iter().filter(|&&h| h).count()
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the batch has no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Entry `k`: token, position, sequence, and whether its logits are wanted.
    pub fn get(&self, k: usize) -> Option<(u32, usize, usize, bool)> {
        Some((
            *self.tokens.get(k)?,
            *self.positions.get(k)?,
            *self.seqs.get(k)?,
            *self.outputs.get(k)?,
        ))
    }

    /// Number of tokens whose logits are wanted.
    pub fn n_outputs(&self) -> usize {
        self.outputs.iter().filter(|&&o| o).count()
    }
}
