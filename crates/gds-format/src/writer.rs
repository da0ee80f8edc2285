//! Building manifests and laying out layer files. Pure computation: the caller writes the
//! bytes (atomically, see `gds-convert`).

use crate::raw::*;
use crate::DType;
use zerocopy::IntoBytes;

/// A tensor to be placed in a layer file.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// Canonical name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Row-major shape, 1 to 4 dimensions.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// Byte length of the tensor, or `None` if the shape does not fit the dtype.
    pub fn nbytes(&self) -> Option<u64> {
        self.dtype.tensor_bytes(&self.shape)
    }
}

/// Rounds `n` up to the next multiple of [`ALIGNMENT`].
pub fn align_up(n: u64) -> Option<u64> {
    n.checked_add(ALIGNMENT - 1)
        .map(|v| v / ALIGNMENT * ALIGNMENT)
}

/// Where each tensor of a layer goes: offsets in table order, each 4 KiB aligned, and the
/// padded file length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// `(offset, nbytes)` of each tensor, in the order given.
    pub placements: Vec<(u64, u64)>,
    /// Length of the file, a multiple of [`ALIGNMENT`].
    pub file_size: u64,
}

/// Lays out `tensors` back to back, each starting on a 4 KiB boundary. Errors name the
/// tensor whose shape does not fit its dtype or whose size overflows.
pub fn layout(tensors: &[TensorSpec]) -> Result<LayerLayout, String> {
    let mut pos = 0u64;
    let mut placements = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.shape.is_empty() || t.shape.len() > MAX_DIMS {
            return Err(format!(
                "tensor {:?}: {} dimensions (1 to 4 allowed)",
                t.name,
                t.shape.len()
            ));
        }
        let n = t.nbytes().ok_or_else(|| {
            format!(
                "tensor {:?}: shape {:?} is not a whole number of {} blocks ({} elements each)",
                t.name,
                t.shape,
                t.dtype,
                t.dtype.block_size()
            )
        })?;
        placements.push((pos, n));
        pos = pos
            .checked_add(n)
            .and_then(align_up)
            .ok_or_else(|| format!("tensor {:?}: layer too large", t.name))?;
    }
    Ok(LayerLayout {
        placements,
        file_size: pos,
    })
}

/// A finished layer, ready to be recorded in the manifest.
#[derive(Clone, Debug)]
pub struct LayerRecord {
    /// Display name (`embed`, `blk.3`, `head`).
    pub name: String,
    /// File path relative to the model directory.
    pub file: String,
    /// One of [`layer_kind`].
    pub kind: u32,
    /// Block number for blocks.
    pub index: u32,
    /// The tensors, in file order.
    pub tensors: Vec<TensorSpec>,
    /// Their layout (from [`layout`]).
    pub layout: LayerLayout,
    /// BLAKE3 of the written file.
    pub content_hash: [u8; 32],
}

/// Accumulates key/values and layers, then serializes the manifest.
#[derive(Default)]
pub struct ManifestBuilder {
    strings: Vec<u8>,
    kv: Vec<KvEntry>,
    layers: Vec<LayerEntry>,
    tensors: Vec<TensorEntry>,
    files: Vec<FileEntry>,
}

impl ManifestBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    fn intern(&mut self, s: &str) -> StrRef {
        // Identical strings share bytes; a linear search is fine for manifests of this size
        // only when hits are rare, so just append: deterministic and simple.
        let r = StrRef {
            offset: (self.strings.len() as u32).into(),
            len: (s.len() as u32).into(),
        };
        self.strings.extend_from_slice(s.as_bytes());
        r
    }

    fn push_kv(&mut self, key: &str, value_type: u32, value: u64) {
        let key = self.intern(key);
        self.kv.push(KvEntry {
            key,
            value_type: value_type.into(),
            reserved: 0.into(),
            value: value.into(),
        });
    }

    /// Adds an unsigned integer.
    pub fn kv_u64(&mut self, key: &str, v: u64) -> &mut Self {
        self.push_kv(key, kv_type::U64, v);
        self
    }

    /// Adds a signed integer.
    pub fn kv_i64(&mut self, key: &str, v: i64) -> &mut Self {
        self.push_kv(key, kv_type::I64, v as u64);
        self
    }

    /// Adds a float.
    pub fn kv_f64(&mut self, key: &str, v: f64) -> &mut Self {
        self.push_kv(key, kv_type::F64, v.to_bits());
        self
    }

    /// Adds a boolean.
    pub fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.push_kv(key, kv_type::BOOL, v as u64);
        self
    }

    /// Adds a string.
    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        let r = self.intern(v);
        self.push_kv(
            key,
            kv_type::STRING,
            r.offset.get() as u64 | (r.len.get() as u64) << 32,
        );
        self
    }

    /// Appends a layer and its tensors.
    pub fn add_layer(&mut self, layer: &LayerRecord) -> &mut Self {
        let layer_index = self.layers.len() as u32;
        let first = self.tensors.len() as u32;
        for (t, &(offset, nbytes)) in layer.tensors.iter().zip(&layer.layout.placements) {
            let mut shape = [0u64.into(); MAX_DIMS];
            for (d, &s) in shape.iter_mut().zip(&t.shape) {
                *d = s.into();
            }
            let name = self.intern(&t.name);
            self.tensors.push(TensorEntry {
                name,
                dtype: t.dtype.id().into(),
                n_dims: (t.shape.len() as u32).into(),
                shape,
                layer: layer_index.into(),
                reserved: 0.into(),
                offset: offset.into(),
                nbytes: nbytes.into(),
            });
        }
        let name = self.intern(&layer.name);
        let file = self.intern(&layer.file);
        self.layers.push(LayerEntry {
            name,
            file,
            kind: layer.kind.into(),
            index: layer.index.into(),
            first_tensor: first.into(),
            tensor_count: (layer.tensors.len() as u32).into(),
            file_size: layer.layout.file_size.into(),
            content_hash: layer.content_hash,
        });
        self
    }

    /// Records a file of the model directory that is not a layer data file (tokenizer,
    /// chat template, documentation), with its length and BLAKE3. Files are written to the
    /// table sorted by path, whatever the order of the calls.
    pub fn add_file(
        &mut self,
        path: &str,
        role: u32,
        size: u64,
        content_hash: [u8; 32],
    ) -> &mut Self {
        let path = self.intern(path);
        self.files.push(FileEntry {
            path,
            role: role.into(),
            reserved: 0.into(),
            size: size.into(),
            content_hash,
        });
        self
    }

    /// Serializes: header, key/values, layers, tensors, strings, each table 8-byte aligned,
    /// then fills in the checksum.
    pub fn finish(&self) -> Vec<u8> {
        fn pad8(v: &mut Vec<u8>) {
            while !v.len().is_multiple_of(8) {
                v.push(0);
            }
        }
        let mut out = vec![0u8; HEADER_SIZE_1_1];
        let put = |out: &mut Vec<u8>, bytes: &[u8], count: usize, entry_size: usize| {
            pad8(out);
            let s = Section {
                offset: (out.len() as u64).into(),
                count: (count as u32).into(),
                entry_size: (entry_size as u32).into(),
            };
            out.extend_from_slice(bytes);
            s
        };
        let kv = put(
            &mut out,
            self.kv.as_bytes(),
            self.kv.len(),
            size_of::<KvEntry>(),
        );
        let layers = put(
            &mut out,
            self.layers.as_bytes(),
            self.layers.len(),
            size_of::<LayerEntry>(),
        );
        let tensors = put(
            &mut out,
            self.tensors.as_bytes(),
            self.tensors.len(),
            size_of::<TensorEntry>(),
        );
        let mut files = self.files.clone();
        let path_of = |f: &FileEntry| {
            let (o, l) = (f.path.offset.get() as usize, f.path.len.get() as usize);
            self.strings[o..o + l].to_vec()
        };
        files.sort_by_key(path_of);
        let file_table = put(
            &mut out,
            files.as_bytes(),
            files.len(),
            size_of::<FileEntry>(),
        );
        let strings = put(&mut out, &self.strings, self.strings.len(), 1);
        pad8(&mut out);
        let header = Header {
            magic: MAGIC,
            version_major: VERSION_MAJOR.into(),
            version_minor: VERSION_MINOR.into(),
            header_size: (HEADER_SIZE_1_1 as u32).into(),
            manifest_size: (out.len() as u64).into(),
            flags: 0.into(),
            checksum: [0; 32],
            kv,
            layers,
            tensors,
            strings,
        };
        out[..size_of::<Header>()].copy_from_slice(header.as_bytes());
        out[size_of::<Header>()..HEADER_SIZE_1_1]
            .copy_from_slice(HeaderExt { files: file_table }.as_bytes());
        let sum = crate::reader::checksum(&out);
        out[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32].copy_from_slice(&sum);
        out
    }
}
