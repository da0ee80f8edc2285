//! Rerankers: a model whose classifier head (`cls.output.weight`, `[labels, n_embd]`: what
//! llama.cpp's converter writes for Qwen3-Reranker, the rows of the "yes" and "no" tokens)
//! scores how well a document answers a query from the final-normed hidden state of the last
//! token of one prompt, the model's rerank template (`tokenizer.rerank_template`) with the
//! query and the document put in. As llama.cpp's rank pooling: the head's outputs, softmaxed
//! for Qwen 3 (the score is then the probability of "yes"), else the first output itself.

use crate::error::{Result, RuntimeError};
use std::path::Path;

/// The classifier head's tensor (GGUF's `cls.output.weight`).
pub const HEAD_TENSOR: &str = gds_format::arch::CLS_OUTPUT;
/// The manifest key of the rerank prompt (`{query}` and `{document}` replaced).
pub const TEMPLATE_KEY: &str = gds_format::RERANK_TEMPLATE_KEY;
/// Most outputs a head may have (a reranker has one or two; a larger head is not a
/// reranker's, and bounds the memory a hostile shape could ask for).
pub const MAX_LABELS: u64 = 64;

/// A reranker's head and prompt.
#[derive(Clone, Debug)]
pub struct RankHead {
    /// The head's rows, `labels × n_embd`, as f32.
    rows: Vec<f32>,
    n_embd: usize,
    /// Softmax over the outputs (Qwen 3's rerankers, as llama.cpp does for that family).
    softmax: bool,
    /// The rerank template, if the model has one.
    template: Option<String>,
}

impl RankHead {
    /// The head of the model in `dir`, `None` when it has no `cls.output.weight`; an error
    /// naming the tensor when that tensor is not `[labels, n_embd]` (1 ≤ labels ≤
    /// [`MAX_LABELS`]) of a type the kernels read. The layer file holding it is checked
    /// against the manifest unless `verify` is false.
    pub fn load(dir: &Path, verify: bool) -> Result<Option<RankHead>> {
        let bytes = gds_io::read_manifest(dir)?;
        let m = crate::model_dir::parse_manifest(dir, &bytes)?;
        let Some(t) = m.find_tensor(HEAD_TENSOR) else {
            return Ok(None);
        };
        let bad = |why: String| RuntimeError::Tensor {
            name: format!("{} ({HEAD_TENSOR})", dir.display()),
            why,
        };
        let n_embd = m
            .get_u64("model.n_embd")
            .map_err(|e| bad(format!("model.n_embd: {e}")))?;
        let (labels, width) = match t.dims() {
            &[l, w] => (l, w),
            d => return Err(bad(format!("shape {d:?}, expected [labels, {n_embd}]"))),
        };
        if width != n_embd || !(1..=MAX_LABELS).contains(&labels) {
            return Err(bad(format!(
                "shape [{labels}, {width}], expected [1..={MAX_LABELS}, {n_embd}]"
            )));
        }
        let n = (labels * n_embd) as usize;
        if t.dtype.tensor_bytes(&[labels, n_embd]) != Some(t.nbytes) {
            return Err(bad(format!(
                "{} bytes for a {} tensor of shape [{labels}, {n_embd}]",
                t.nbytes, t.dtype
            )));
        }
        let mode = if verify {
            gds_io::VerifyMode::Hash
        } else {
            gds_io::VerifyMode::Off
        };
        let raw = gds_io::read_layer_span(
            dir,
            &m,
            t.layer,
            t.offset,
            t.nbytes,
            &gds_io::Verifier::new(mode),
        )?;
        let mut rows = vec![0f32; n];
        gds_kernels::dequantize(t.dtype, &raw, &mut rows)
            .map_err(|e| bad(format!("{}: {e}", t.dtype)))?;
        let arch = m.get_str("general.architecture").unwrap_or("");
        let template = m.get_str(TEMPLATE_KEY).ok().map(str::to_string);
        Ok(Some(RankHead {
            rows,
            n_embd: n_embd as usize,
            softmax: arch == "qwen3",
            template,
        }))
    }

    /// The score of a final-normed hidden state (`n_embd` values): the head's first output,
    /// after a softmax over the outputs where the family has one.
    pub fn score(&self, hidden: &[f32]) -> f32 {
        let z = self.outputs(hidden);
        if !self.softmax {
            return z[0] as f32;
        }
        let top = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = z.iter().map(|&x| (x - top).exp()).sum();
        ((z[0] - top).exp() / sum) as f32
    }

    /// The score before its activation (vLLM's `use_activation: false`): where the family
    /// softmaxes, the log-odds of the first output (`z₀ − log Σ_{j>0} e^{z_j}`: for two
    /// outputs, "yes" − "no", whose sigmoid is [`RankHead::score`], as vLLM's Qwen3-Reranker
    /// gives), else the first output itself.
    pub fn logit(&self, hidden: &[f32]) -> f32 {
        let z = self.outputs(hidden);
        if !self.softmax || z.len() < 2 {
            return z[0] as f32;
        }
        let rest = &z[1..];
        let top = rest.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = top + rest.iter().map(|&x| (x - top).exp()).sum::<f64>().ln();
        (z[0] - lse) as f32
    }

    /// The head's outputs for a hidden state.
    fn outputs(&self, hidden: &[f32]) -> Vec<f64> {
        self.rows
            .chunks_exact(self.n_embd)
            .map(|row| {
                row.iter()
                    .zip(hidden)
                    .map(|(&w, &h)| w as f64 * h as f64)
                    .sum()
            })
            .collect()
    }

    /// The rerank template, if the model has one.
    pub fn template(&self) -> Option<&str> {
        self.template.as_deref()
    }
}

/// `template` with each `{query}` replaced by `query` and each `{document}` by `document`,
/// in one pass: a placeholder inside the query or the document stays text (llama.cpp
/// replaces the query first, then every `{document}`, the query's included).
pub fn fill(template: &str, query: &str, document: &str) -> String {
    let mut out = String::with_capacity(template.len() + query.len() + document.len());
    let mut rest = template;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("{query}") {
            out.push_str(query);
            rest = t;
        } else if let Some(t) = tail.strip_prefix("{document}") {
            out.push_str(document);
            rest = t;
        } else {
            out.push('{');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_filled_once() {
        assert_eq!(
            fill(
                "<q>{query}</q><d>{document}</d>{x}{",
                "a {document}",
                "b {query}"
            ),
            "<q>a {document}</q><d>b {query}</d>{x}{"
        );
        assert_eq!(fill("{document}{document}", "q", "d"), "dd");
        assert_eq!(fill("", "q", "d"), "");
    }

    #[test]
    fn scores_are_the_first_output_softmaxed_where_the_family_says() {
        let head = |softmax| RankHead {
            rows: vec![1.0, 0.0, 0.0, 1.0],
            n_embd: 2,
            softmax,
            template: None,
        };
        let h = [2.0, 0.5];
        let p = head(true).score(&h);
        let want = 1.0 / (1.0 + (0.5f64 - 2.0).exp());
        assert!((p as f64 - want).abs() < 1e-7, "{p} {want}");
        assert_eq!(head(false).score(&h), 2.0);
        // the log-odds: its sigmoid is the score; without softmax the output itself
        let l = head(true).logit(&h) as f64;
        assert!((l - 1.5).abs() < 1e-6, "{l}");
        assert!((1.0 / (1.0 + (-l).exp()) - want).abs() < 1e-7);
        assert_eq!(head(false).logit(&h), 2.0);
        // no overflow for large outputs
        assert!((head(true).score(&[1000.0, 0.0]) - 1.0).abs() < 1e-7);
    }
}
