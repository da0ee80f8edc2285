//! The architecture's rules, checked on what a reader produced before anything is written:
//! a runnable (llama-family) model must have as many blocks as its layer count says, every
//! required tensor, and tensor shapes that fit its hyperparameters. A violation is the
//! input's fault and is reported naming the input file; the writer's own self-check after
//! writing then only catches converter bugs.
//!
//! Every loop here is bounded by the tensors the input holds, never by a count the input
//! states (a layer count of 2^32 - 1 is refused before anything is built from it).

use crate::error::ConvertError;
use crate::names::{group_of, Group};
use crate::source::{MetaValue, Source, SourceTensor};
use gds_format::arch::{family, shape_symbol};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Checks `source` (read from `input`) against its architecture's rules. Architectures
/// `gdsrun` cannot run have no rules beyond what the readers check.
pub fn check_source(source: &Source, input: &Path) -> Result<(), ConvertError> {
    if !source.runnable {
        return Ok(());
    }
    let bad = |msg: String| ConvertError::BadInput {
        path: input.to_path_buf(),
        msg,
    };
    let named = |key: &str| match source.hparam_origin.get(key) {
        Some(o) => format!("{key} ({o})"),
        None => key.to_string(),
    };
    let u = |key: &str| {
        crate::source::meta_u64(&source.metadata, key).ok_or_else(|| {
            bad(format!(
                "hyperparameter {key} is missing or not an unsigned integer"
            ))
        })
    };

    // Blocks: exactly 0..n_layers.
    let n_layers = u("model.n_layers")?;
    let blocks: BTreeSet<u32> = source
        .tensors
        .iter()
        .filter_map(|t| match group_of(&t.name) {
            Group::Block(n) => Some(n),
            _ => None,
        })
        .collect();
    let contiguous = blocks
        .last()
        .is_none_or(|&l| l as usize + 1 == blocks.len());
    if blocks.len() as u64 != n_layers || !contiguous {
        let found = match (blocks.first(), blocks.last()) {
            (Some(a), Some(b)) if contiguous => format!("{} blocks (blk.{a} to blk.{b})", b + 1),
            (Some(_), Some(_)) => format!(
                "{} blocks numbered {}",
                blocks.len(),
                list(blocks.iter().map(|b| format!("blk.{b}")))
            ),
            _ => "no blocks".to_string(),
        };
        return Err(bad(format!(
            "{} is {n_layers}, but the tensors form {found}",
            named("model.n_layers")
        )));
    }

    let by_name: HashMap<&str, &SourceTensor> = source
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let spec = family(&source.arch).ok_or_else(|| {
        bad(format!(
            "internal: architecture {} has no description in formats/",
            source.arch
        ))
    })?;
    let tied = matches!(
        source.metadata.get("model.tie_embeddings"),
        Some(MetaValue::Bool(true))
    );
    let fill = |p: &str, n: u64| p.replace("{N}", &n.to_string());
    let required = spec
        .required_tensors
        .global
        .iter()
        .cloned()
        .chain((!tied).then(|| "output.weight".to_string()))
        .chain(
            (0..n_layers).flat_map(|n| spec.required_tensors.block.iter().map(move |p| fill(p, n))),
        );
    for name in required {
        if !by_name.contains_key(name.as_str()) {
            return Err(bad(format!(
                "tensor {name:?}, required by the {} architecture, is missing",
                spec.family
            )));
        }
    }

    // Shapes the runtime relies on (the description's table). A product that overflows
    // fits no tensor.
    let embd = u("model.n_embd")?;
    let heads = u("model.n_heads")?;
    let kv = u("model.n_kv_heads")?;
    let hd = u("model.head_dim")?;
    let ff = u("model.n_ff")?;
    let vocab = u("model.vocab_size")?;
    let sym = |s: &str| shape_symbol(s, |key| u(key).ok());
    let mut expect: Vec<(String, Vec<Option<u64>>)> = Vec::new();
    for (pattern, dims) in &spec.shapes {
        let dims: Vec<Option<u64>> = dims.iter().map(|d| sym(d)).collect();
        if pattern.contains("{N}") {
            for n in 0..n_layers {
                expect.push((fill(pattern, n), dims.clone()));
            }
        } else {
            expect.push((pattern.clone(), dims));
        }
    }
    for (name, want) in expect {
        let Some(t) = by_name.get(name.as_str()) else {
            continue;
        };
        if t.shape.iter().copied().map(Some).eq(want.iter().copied()) {
            continue;
        }
        let want: Vec<String> = want
            .iter()
            .map(|w| w.map_or_else(|| "(overflow)".into(), |w| w.to_string()))
            .collect();
        let hparams: Vec<String> = [
            ("model.vocab_size", vocab),
            ("model.n_embd", embd),
            ("model.n_heads", heads),
            ("model.n_kv_heads", kv),
            ("model.head_dim", hd),
            ("model.n_ff", ff),
        ]
        .iter()
        .map(|(key, v)| format!("{} = {v}", named(key)))
        .collect();
        return Err(ConvertError::BadTensor {
            path: t.file.path.clone(),
            tensor: t.source_name.clone(),
            msg: format!(
                "shape {:?} does not fit the hyperparameters: expected [{}] from {}",
                t.shape,
                want.join(", "),
                hparams.join(", ")
            ),
        });
    }
    Ok(())
}

/// At most 8 items, then a count of the rest.
pub(crate) fn list(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    let shown = items.len().min(8);
    let mut s = items[..shown].join(", ");
    if items.len() > shown {
        s.push_str(&format!(" and {} more", items.len() - shown));
    }
    s
}
