//! Where every weight of the model lives: byte ranges inside the resident layer files,
//! checked once at load so the forward pass can slice without failing.

use crate::config::Config;
use crate::error::{Result, RuntimeError};
use crate::graph::{Block, WeightSource};
use gds_format::{DType, Manifest, TensorInfo};
use gds_io::{LayerBytes, LayerSource};
use gds_kernels::{Layout, WeightView};
use std::collections::HashMap;

/// A weight matrix: a byte range of one layer file, in its on-disk dtype.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef {
    /// Index of the layer in the manifest (and in the resident layer list).
    pub layer: usize,
    /// Byte offset inside the layer file.
    pub offset: usize,
    /// Byte length.
    pub nbytes: usize,
    /// Element type.
    pub dtype: DType,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    /// How the bytes lie in memory: as in the file, or rewritten at load
    /// ([`Weights::interleave_resident`]).
    pub layout: Layout,
}

impl TensorRef {
    /// The matrix as a kernel view over the resident bytes of its layer (`bytes` must hold
    /// this tensor's range of layer `self.layer`).
    #[inline]
    pub fn view<'a>(&self, bytes: &'a LayerBytes) -> Result<WeightView<'a>> {
        self.rows_view(bytes, 0, self.rows)
    }

    /// Rows `r0..r0 + rows` of the matrix as a kernel view; `bytes` must hold them.
    pub fn rows_view<'a>(
        &self,
        bytes: &'a LayerBytes,
        r0: usize,
        rows: usize,
    ) -> Result<WeightView<'a>> {
        let rb = self.row_bytes();
        let data = (bytes.index() == self.layer && r0 + rows <= self.rows)
            .then(|| bytes.slice((self.offset + r0 * rb) as u64, (rows * rb) as u64))
            .flatten()
            .ok_or_else(|| RuntimeError::Tensor {
                name: format!("layer {} @{}", self.layer, self.offset),
                why: format!(
                    "internal: rows {r0}..{} are not in the bytes of layer {} handed to the kernel",
                    r0 + rows,
                    bytes.index()
                ),
            })?;
        Ok(WeightView {
            layout: self.layout,
            dtype: self.dtype,
            data,
            rows,
            cols: self.cols,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.nbytes / self.rows
    }
}

/// Weights of one transformer block: matrices in place in the layer files, vectors (norms,
/// biases) read and dequantized to f32 at load.
pub type BlockWeights = Block<TensorRef, Vec<f32>>;

/// All weights of a model.
pub struct Weights {
    /// `[vocab_size, n_embd]`
    pub token_embd: TensorRef,
    /// The transformer blocks.
    pub blocks: Vec<BlockWeights>,
    /// `[n_embd]`
    pub output_norm: Vec<f32>,
    /// `[vocab_size, n_embd]`; the token embedding when tied.
    pub output: TensorRef,
    /// `[head_dim / 2]` per-pair divisors of the RoPE frequencies (`rope_freqs.weight`, how
    /// llama.cpp's GGUFs carry Llama 3.1 scaling).
    pub rope_freqs: Option<Vec<f32>>,
    /// LongRoPE (Phi-3): `[rope_dims / 2]` divisors for contexts above
    /// `model.rope_scaling.original_context_length` (`rope_factors_long.weight`) and up to
    /// it (`rope_factors_short.weight`).
    pub rope_factors: Option<(Vec<f32>, Vec<f32>)>,
}

struct Finder<'m, 's> {
    by_name: HashMap<&'m str, TensorInfo<'m>>,
    source: &'s dyn LayerSource,
}

impl Finder<'_, '_> {
    fn info(&self, name: &str) -> Result<&TensorInfo<'_>> {
        self.by_name.get(name).ok_or_else(|| RuntimeError::Tensor {
            name: name.into(),
            why: "missing from the manifest".into(),
        })
    }

    fn bytes(&self, t: &TensorInfo<'_>) -> Result<TensorRef> {
        let bad = |why: String| RuntimeError::Tensor {
            name: t.name.into(),
            why,
        };
        if t.layer >= self.source.n_layers() {
            return Err(bad(format!("layer {} does not exist", t.layer)));
        }
        let layer_len = self.source.layer_size(t.layer);
        let want = t
            .dtype
            .tensor_bytes(t.dims())
            .ok_or_else(|| bad(format!("shape {:?} does not fit {}", t.dims(), t.dtype)))?;
        if want != t.nbytes {
            return Err(bad(format!(
                "{} bytes recorded, {want} expected for {:?} {}",
                t.nbytes,
                t.dims(),
                t.dtype
            )));
        }
        let end = t.offset.checked_add(t.nbytes).filter(|&e| e <= layer_len);
        if end.is_none() {
            return Err(bad(format!(
                "bytes {}..+{} lie outside its {}-byte layer file",
                t.offset, t.nbytes, layer_len
            )));
        }
        let (rows, cols) = match t.dims() {
            [n] => (1, *n as usize),
            [r, c] => (*r as usize, *c as usize),
            // stacked experts: one matrix of their rows (dimensions are at most 2^24 and
            // the byte length matched above, so the product fits)
            [e, r, c] => ((*e * *r) as usize, *c as usize),
            d => return Err(bad(format!("expected 1 to 3 dimensions, found {d:?}"))),
        };
        Ok(TensorRef {
            layer: t.layer,
            offset: t.offset as usize,
            nbytes: t.nbytes as usize,
            dtype: t.dtype,
            rows,
            cols,
            layout: Layout::Rows,
        })
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<TensorRef> {
        let t = self.info(name)?;
        if t.dims() != [rows as u64, cols as u64] {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("shape {:?}, expected [{rows}, {cols}]", t.dims()),
            });
        }
        self.bytes(t)
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        self.floats(name, &[n as u64])
    }

    /// The tensor `name`, which must have the shape `dims`, read and dequantized to f32.
    fn floats(&self, name: &str, dims: &[u64]) -> Result<Vec<f32>> {
        let t = self.info(name)?;
        if t.dims() != dims {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("shape {:?}, expected {dims:?}", t.dims()),
            });
        }
        let r = self.bytes(t)?;
        let mut raw = vec![0u8; r.nbytes];
        self.source.read_at(r.layer, r.offset as u64, &mut raw)?;
        let mut out = vec![0.0; dims.iter().product::<u64>() as usize];
        gds_kernels::dequantize(r.dtype, &raw, &mut out)?;
        Ok(out)
    }
}

impl WeightSource<TensorRef, Vec<f32>> for Finder<'_, '_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<TensorRef> {
        Finder::matrix(self, name, rows, cols)
    }

    fn experts(&mut self, name: &str, n: usize, rows: usize, cols: usize) -> Result<TensorRef> {
        let t = self.info(name)?;
        if t.dims() != [n as u64, rows as u64, cols as u64] {
            return Err(RuntimeError::Tensor {
                name: name.into(),
                why: format!("shape {:?}, expected [{n}, {rows}, {cols}]", t.dims()),
            });
        }
        self.bytes(t)
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        if self.by_name.contains_key(name) {
            Finder::vector(self, name, n).map(Some)
        } else {
            Ok(None)
        }
    }

    fn expert_vectors(&mut self, name: &str, n: usize, len: usize) -> Result<Option<Vec<f32>>> {
        if self.by_name.contains_key(name) {
            self.floats(name, &[n as u64, len as u64]).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Weights {
    /// Locates and checks every tensor against the layer files of `source`. Norms and
    /// biases (small vectors) are read and dequantized to f32; matrices stay where they are,
    /// in their on-disk dtype.
    pub fn load(cfg: &Config, m: &Manifest<'_>, source: &dyn LayerSource) -> Result<Weights> {
        let f = Finder {
            by_name: m.tensors().map(|t| (t.name, t)).collect(),
            source,
        };
        if f.by_name.len() != m.n_tensors() {
            return Err(RuntimeError::Manifest {
                dir: String::new(),
                why: "unreadable or duplicate tensor records".into(),
            });
        }
        let d = cfg.n_embd;
        let token_embd = f.matrix("token_embd.weight", cfg.vocab_size, d)?;
        let output = if f.by_name.contains_key("output.weight") {
            f.matrix("output.weight", cfg.vocab_size, d)?
        } else if cfg.tie_embeddings {
            token_embd
        } else {
            return Err(RuntimeError::Tensor {
                name: "output.weight".into(),
                why: "missing and model.tie_embeddings is false".into(),
            });
        };
        let mut f = f;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            blocks.push(Block::load(cfg, l, &mut f)?);
        }
        let pairs = cfg.rope_dims / 2;
        let rope_freqs = WeightSource::vector(&mut f, "rope_freqs.weight", pairs)?;
        let rope_factors = match (
            WeightSource::vector(&mut f, "rope_factors_long.weight", pairs)?,
            WeightSource::vector(&mut f, "rope_factors_short.weight", pairs)?,
        ) {
            (Some(long), Some(short)) => Some((long, short)),
            (None, None) => None,
            _ => {
                return Err(RuntimeError::Tensor {
                    name: "rope_factors_long.weight".into(),
                    why: "LongRoPE needs both rope_factors_long and rope_factors_short".into(),
                })
            }
        };
        Ok(Weights {
            token_embd,
            output_norm: f.vector("output_norm.weight", d)?,
            output,
            blocks,
            rope_freqs,
            rope_factors,
        })
    }

    /// Rewrites the dense block matrices, a mixture's experts (when each expert's rows are
    /// whole groups) and an untied output head, where they are Q4_0,
    /// Q4_K or Q6_K in layers `source` holds in memory of its own
    /// ([`LayerSource::resident_mut`]: `--io load`/`direct`'s resident layers, not a mapping,
    /// not streamed layers), with their rows interleaved sixteen at a time: the layout the
    /// AVX-512 kernels read without repacking, where this process's instruction set has
    /// them ([`gds_kernels::interleave_pays`]). The token embedding (rows looked up, and the
    /// head when tied) keeps the file's order. Call before anything holds those layers'
    /// bytes. Returns the bytes rewritten.
    pub fn interleave_resident(&mut self, source: &mut dyn LayerSource) -> Result<u64> {
        let emb = &self.token_embd;
        let tied = (self.output.layer, self.output.offset) == (emb.layer, emb.offset);
        let head = (!tied).then_some(&mut self.output);
        let mut done = 0u64;
        // each matrix with the number of matrices stacked in it (a mixture's experts), each
        // of which must be whole groups of rows
        let blocks = self
            .blocks
            .iter_mut()
            .flat_map(|b| b.product_matrices_mut());
        for (t, stacked) in blocks.chain(head.map(|t| (t, 1))) {
            let rows = t.rows / stacked.max(1);
            if !gds_kernels::interleave_pays(t.dtype)
                || t.layout != Layout::Rows
                || rows == 0
                || !rows.is_multiple_of(gds_kernels::INTERLEAVED_ROWS)
            {
                continue;
            }
            let Some(bytes) = source.resident_mut(t.layer) else {
                continue;
            };
            let Some(m) = bytes.get_mut(t.offset..t.offset + t.nbytes) else {
                continue;
            };
            gds_kernels::interleave(t.dtype, m, t.rows, t.cols)?;
            t.layout = Layout::Interleaved16;
            done += t.nbytes as u64;
        }
        Ok(done)
    }

    /// Every matrix, for summaries and kernel checks.
    pub fn matrices(&self) -> impl Iterator<Item = (&'static str, &TensorRef)> {
        let blocks = self.blocks.iter().flat_map(|b| b.matrices());
        [("token_embd", &self.token_embd), ("output", &self.output)]
            .into_iter()
            .chain(blocks)
    }
}
