//! Zero-copy reading of a manifest held in memory (usually a memory map).
//!
//! [`Manifest::parse`] checks the header and that every table lies inside the bytes; it
//! allocates nothing. Record accessors cast records in place. Deeper rules (checksum, every
//! tensor's geometry) are checked by [`crate::validate`].

use crate::error::FormatError;
use crate::raw::*;
use crate::DType;
use zerocopy::FromBytes;

/// A table of fixed-stride records inside the manifest.
pub struct Table<'a, T> {
    bytes: &'a [u8],
    stride: usize,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T> Clone for Table<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Table<'_, T> {}

impl<'a, T: FromBytes + zerocopy::KnownLayout + zerocopy::Immutable + 'a> Table<'a, T> {
    /// Number of records.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the table has no record.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Record `i`, or `None` past the end. Records may be longer than `T` (a later minor
    /// version appended fields); the known prefix is returned.
    pub fn get(&self, i: usize) -> Option<&'a T> {
        if i >= self.len {
            return None;
        }
        let start = i * self.stride;
        let rec = self.bytes.get(start..start + self.stride)?;
        T::ref_from_prefix(rec).ok().map(|(r, _)| r)
    }

    /// All records in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a T> + '_ {
        (0..self.len).filter_map(move |i| self.get(i))
    }
}

/// A value from the key/value table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    /// Unsigned integer.
    U64(u64),
    /// Signed integer.
    I64(i64),
    /// Float.
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string borrowed from the manifest.
    Str(&'a str),
}

impl std::fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Str(v) => write!(f, "{v:?}"),
        }
    }
}

/// A parsed view of a manifest.
#[derive(Clone, Copy)]
pub struct Manifest<'a> {
    bytes: &'a [u8],
    header: &'a Header,
    strings: &'a [u8],
    kv: Table<'a, KvEntry>,
    layers: Table<'a, LayerEntry>,
    tensors: Table<'a, TensorEntry>,
    files: Table<'a, FileEntry>,
}

/// A file-table entry (1.1) with its path resolved.
#[derive(Clone, Copy, Debug)]
pub struct FileInfo<'a> {
    /// Index in the file table.
    pub index: usize,
    /// Path relative to the model directory.
    pub path: &'a str,
    /// One of [`file_role`].
    pub role: u32,
    /// Exact file length.
    pub size: u64,
    /// BLAKE3 of the file.
    pub content_hash: [u8; 32],
}

/// A tensor entry with its strings resolved.
#[derive(Clone, Copy, Debug)]
pub struct TensorInfo<'a> {
    /// Index in the tensor table.
    pub index: usize,
    /// Canonical name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Row-major shape.
    pub shape: [u64; MAX_DIMS],
    /// Number of dimensions used in `shape`.
    pub n_dims: usize,
    /// Owning layer index.
    pub layer: usize,
    /// Offset inside the layer file.
    pub offset: u64,
    /// Byte length.
    pub nbytes: u64,
}

impl TensorInfo<'_> {
    /// The shape as a slice.
    pub fn dims(&self) -> &[u64] {
        &self.shape[..self.n_dims]
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims().iter().product()
    }
}

/// A layer entry with its strings resolved.
#[derive(Clone, Debug)]
pub struct LayerInfo<'a> {
    /// Index in the layer table.
    pub index: usize,
    /// Display name.
    pub name: &'a str,
    /// Data file path relative to the model directory.
    pub file: &'a str,
    /// One of [`layer_kind`].
    pub kind: u32,
    /// Block number for blocks.
    pub block: u32,
    /// Range of tensor indices.
    pub tensors: std::ops::Range<usize>,
    /// Data file length.
    pub file_size: u64,
    /// BLAKE3 of the data file.
    pub content_hash: [u8; 32],
}

fn section<'a, T>(
    bytes: &'a [u8],
    s: &Section,
    table: &'static str,
    min_entry: usize,
    header_size: usize,
) -> Result<Table<'a, T>, FormatError> {
    let bad = |why: String| FormatError::BadSection { table, why };
    let offset = s.offset.get();
    let count = s.count.get() as u64;
    let stride = s.entry_size.get() as u64;
    if (stride as usize) < min_entry {
        return Err(bad(format!(
            "entry_size {stride} is smaller than {min_entry}"
        )));
    }
    if !offset.is_multiple_of(8) {
        return Err(bad(format!("offset {offset} is not a multiple of 8")));
    }
    if offset < header_size as u64 && count > 0 {
        return Err(bad(format!("offset {offset} overlaps the header")));
    }
    let len = count
        .checked_mul(stride)
        .ok_or_else(|| bad("size overflows".into()))?;
    let end = offset
        .checked_add(len)
        .ok_or_else(|| bad("end overflows".into()))?;
    if end > bytes.len() as u64 {
        return Err(bad(format!(
            "ends at byte {end}, past the manifest's {} bytes",
            bytes.len()
        )));
    }
    Ok(Table {
        bytes: &bytes[offset as usize..end as usize],
        stride: stride as usize,
        len: count as usize,
        _t: std::marker::PhantomData,
    })
}

impl<'a> Manifest<'a> {
    /// Checks the header and table bounds of `bytes`, allocating nothing. Does not verify the
    /// checksum (see [`Manifest::verify_checksum`]) or per-record rules (see
    /// [`crate::validate::validate_manifest`]).
    pub fn parse(bytes: &'a [u8]) -> Result<Manifest<'a>, FormatError> {
        let (header, _) =
            Header::ref_from_prefix(bytes).map_err(|_| FormatError::TooShort(bytes.len()))?;
        if header.magic != MAGIC {
            return Err(FormatError::BadMagic(header.magic));
        }
        let (major, minor) = (header.version_major.get(), header.version_minor.get());
        if major != VERSION_MAJOR {
            return Err(FormatError::UnsupportedVersion { major, minor });
        }
        let header_size = header.header_size.get();
        let min_header = if minor >= 1 {
            HEADER_SIZE_1_1
        } else {
            size_of::<Header>()
        };
        if (header_size as usize) < min_header {
            return Err(FormatError::HeaderTooSmall {
                size: header_size,
                min: min_header as u32,
                minor,
            });
        }
        let declared = header.manifest_size.get();
        if declared > MAX_MANIFEST_BYTES {
            return Err(FormatError::TooLarge(declared));
        }
        if declared != bytes.len() as u64 {
            return Err(FormatError::SizeMismatch {
                declared,
                actual: bytes.len() as u64,
            });
        }
        if header_size as usize > bytes.len() {
            return Err(FormatError::HeaderPastEnd {
                size: header_size,
                len: bytes.len() as u64,
            });
        }
        let hs = header_size as usize;
        if header.strings.entry_size.get() != 1 {
            return Err(FormatError::BadSection {
                table: "string",
                why: "entry_size must be 1".into(),
            });
        }
        let strings_t: Table<'a, u8> = section(bytes, &header.strings, "string", 1, hs)?;
        let files = if minor >= 1 {
            // header_size >= HEADER_SIZE_1_1 was checked above, and it lies inside `bytes`.
            let (ext, _) = HeaderExt::ref_from_prefix(&bytes[size_of::<Header>()..])
                .map_err(|_| FormatError::TooShort(bytes.len()))?;
            section(bytes, &ext.files, "file", size_of::<FileEntry>(), hs)?
        } else {
            Table {
                bytes: &[],
                stride: size_of::<FileEntry>(),
                len: 0,
                _t: std::marker::PhantomData,
            }
        };
        Ok(Manifest {
            files,
            bytes,
            header,
            strings: strings_t.bytes,
            kv: section(bytes, &header.kv, "key/value", size_of::<KvEntry>(), hs)?,
            layers: section(bytes, &header.layers, "layer", size_of::<LayerEntry>(), hs)?,
            tensors: section(
                bytes,
                &header.tensors,
                "tensor",
                size_of::<TensorEntry>(),
                hs,
            )?,
        })
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The header.
    pub fn header(&self) -> &'a Header {
        self.header
    }

    /// `(major, minor)` version.
    pub fn version(&self) -> (u16, u16) {
        (
            self.header.version_major.get(),
            self.header.version_minor.get(),
        )
    }

    /// True when the stored BLAKE3 checksum matches.
    pub fn verify_checksum(&self) -> bool {
        checksum(self.bytes) == self.header.checksum
    }

    /// The raw key/value table.
    pub fn kv_table(&self) -> Table<'a, KvEntry> {
        self.kv
    }

    /// The raw layer table.
    pub fn layer_table(&self) -> Table<'a, LayerEntry> {
        self.layers
    }

    /// The raw tensor table.
    pub fn tensor_table(&self) -> Table<'a, TensorEntry> {
        self.tensors
    }

    /// The raw file table (empty before 1.1).
    pub fn file_table(&self) -> Table<'a, FileEntry> {
        self.files
    }

    /// True when the manifest has a file table (version 1.1 and later): every file of the
    /// directory a reader uses is hashed.
    pub fn has_file_table(&self) -> bool {
        self.version().1 >= 1
    }

    /// The string table's bytes.
    pub fn string_bytes(&self) -> &'a [u8] {
        self.strings
    }

    /// Number of entries in the file table.
    pub fn n_files(&self) -> usize {
        self.files.len()
    }

    /// File-table entry `i` with its path resolved.
    pub fn file(&self, i: usize) -> Result<FileInfo<'a>, FormatError> {
        let e = self.files.get(i).ok_or(FormatError::BadFile {
            path: format!("#{i}"),
            why: "no such file entry".into(),
        })?;
        let path = self.string_or(&e.path, || format!("path of file entry #{i}"))?;
        Ok(FileInfo {
            index: i,
            path,
            role: e.role.get(),
            size: e.size.get(),
            content_hash: e.content_hash,
        })
    }

    /// All file entries; stops at the first unreadable one (validation reports it).
    pub fn files(&self) -> impl Iterator<Item = FileInfo<'a>> + '_ {
        (0..self.files.len()).map_while(move |i| self.file(i).ok())
    }

    /// The file entry for `path`, if the manifest lists it.
    pub fn find_file(&self, path: &str) -> Option<FileInfo<'a>> {
        self.files().find(|f| f.path == path)
    }

    /// Resolves a string reference.
    pub fn string(&self, r: &StrRef) -> Option<&'a str> {
        let start = r.offset.get() as usize;
        let end = start.checked_add(r.len.get() as usize)?;
        std::str::from_utf8(self.strings.get(start..end)?).ok()
    }

    fn string_or(&self, r: &StrRef, what: impl FnOnce() -> String) -> Result<&'a str, FormatError> {
        self.string(r)
            .ok_or_else(|| FormatError::BadString { what: what() })
    }

    /// Decodes key/value entry `i`.
    pub fn kv(&self, i: usize) -> Result<(&'a str, Value<'a>), FormatError> {
        let e = self.kv.get(i).ok_or(FormatError::BadKv {
            index: i,
            why: "no such entry".into(),
        })?;
        let key = self.string_or(&e.key, || format!("key of key/value entry {i}"))?;
        let raw = e.value.get();
        let v = match e.value_type.get() {
            kv_type::U64 => Value::U64(raw),
            kv_type::I64 => Value::I64(raw as i64),
            kv_type::F64 => Value::F64(f64::from_bits(raw)),
            kv_type::BOOL => match raw {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                _ => {
                    return Err(FormatError::BadKv {
                        index: i,
                        why: format!("bool value {raw} is not 0 or 1"),
                    })
                }
            },
            kv_type::STRING => {
                let r = StrRef {
                    offset: (raw as u32).into(),
                    len: ((raw >> 32) as u32).into(),
                };
                Value::Str(self.string_or(&r, || format!("value of key {key:?}"))?)
            }
            t => {
                return Err(FormatError::BadKv {
                    index: i,
                    why: format!("unknown value type {t} for key {key:?}"),
                })
            }
        };
        Ok((key, v))
    }

    /// Iterates over readable key/value pairs; entries with unknown value types are skipped
    /// (SPEC.md §5: readers ignore what they do not understand there).
    pub fn kvs(&self) -> impl Iterator<Item = (&'a str, Value<'a>)> + '_ {
        (0..self.kv.len()).filter_map(move |i| self.kv(i).ok())
    }

    /// The value of `key`, if present and readable.
    pub fn get(&self, key: &str) -> Option<Value<'a>> {
        self.kvs().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// An unsigned integer value; the error names the key.
    pub fn get_u64(&self, key: &str) -> Result<u64, FormatError> {
        match self.get(key) {
            Some(Value::U64(v)) => Ok(v),
            Some(v) => Err(FormatError::MissingKey {
                key: key.into(),
                why: format!("expected an unsigned integer, found {v}"),
            }),
            None => Err(FormatError::MissingKey {
                key: key.into(),
                why: "absent".into(),
            }),
        }
    }

    /// A float value (integers are widened); the error names the key.
    pub fn get_f64(&self, key: &str) -> Result<f64, FormatError> {
        match self.get(key) {
            Some(Value::F64(v)) => Ok(v),
            Some(Value::U64(v)) => Ok(v as f64),
            Some(Value::I64(v)) => Ok(v as f64),
            Some(v) => Err(FormatError::MissingKey {
                key: key.into(),
                why: format!("expected a number, found {v}"),
            }),
            None => Err(FormatError::MissingKey {
                key: key.into(),
                why: "absent".into(),
            }),
        }
    }

    /// A string value; the error names the key.
    pub fn get_str(&self, key: &str) -> Result<&'a str, FormatError> {
        match self.get(key) {
            Some(Value::Str(v)) => Ok(v),
            Some(v) => Err(FormatError::MissingKey {
                key: key.into(),
                why: format!("expected a string, found {v}"),
            }),
            None => Err(FormatError::MissingKey {
                key: key.into(),
                why: "absent".into(),
            }),
        }
    }

    /// A boolean value; the error names the key.
    pub fn get_bool(&self, key: &str) -> Result<bool, FormatError> {
        match self.get(key) {
            Some(Value::Bool(v)) => Ok(v),
            Some(v) => Err(FormatError::MissingKey {
                key: key.into(),
                why: format!("expected a bool, found {v}"),
            }),
            None => Err(FormatError::MissingKey {
                key: key.into(),
                why: "absent".into(),
            }),
        }
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of tensors.
    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Layer `i` with strings resolved.
    pub fn layer(&self, i: usize) -> Result<LayerInfo<'a>, FormatError> {
        let e = self.layers.get(i).ok_or(FormatError::BadLayer {
            name: format!("#{i}"),
            why: "no such layer".into(),
        })?;
        let name = self.string_or(&e.name, || format!("name of layer #{i}"))?;
        let file = self.string_or(&e.file, || format!("file of layer {name:?}"))?;
        let first = e.first_tensor.get() as usize;
        let count = e.tensor_count.get() as usize;
        Ok(LayerInfo {
            index: i,
            name,
            file,
            kind: e.kind.get(),
            block: e.index.get(),
            tensors: first..first.saturating_add(count),
            file_size: e.file_size.get(),
            content_hash: e.content_hash,
        })
    }

    /// All layers; stops at the first unreadable one (validation reports it).
    pub fn layers(&self) -> impl Iterator<Item = LayerInfo<'a>> + '_ {
        (0..self.layers.len()).map_while(move |i| self.layer(i).ok())
    }

    /// Tensor `i` with strings resolved and dtype decoded.
    pub fn tensor(&self, i: usize) -> Result<TensorInfo<'a>, FormatError> {
        let e = self.tensors.get(i).ok_or(FormatError::BadTensor {
            name: format!("#{i}"),
            why: "no such tensor".into(),
        })?;
        let name = self.string_or(&e.name, || format!("name of tensor #{i}"))?;
        let bad = |why: String| FormatError::BadTensor {
            name: name.to_string(),
            why,
        };
        let dtype = DType::from_id(e.dtype.get())
            .ok_or_else(|| bad(format!("unknown dtype id {}", e.dtype.get())))?;
        let n_dims = e.n_dims.get() as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(bad(format!("n_dims {n_dims} is not in 1..=4")));
        }
        let mut shape = [0u64; MAX_DIMS];
        for (d, s) in shape.iter_mut().zip(e.shape.iter()) {
            *d = s.get();
        }
        Ok(TensorInfo {
            index: i,
            name,
            dtype,
            shape,
            n_dims,
            layer: e.layer.get() as usize,
            offset: e.offset.get(),
            nbytes: e.nbytes.get(),
        })
    }

    /// All tensors; stops at the first unreadable one (validation reports it).
    pub fn tensors(&self) -> impl Iterator<Item = TensorInfo<'a>> + '_ {
        (0..self.tensors.len()).map_while(move |i| self.tensor(i).ok())
    }

    /// Finds a tensor by name (linear scan; the runtime builds its own index once).
    pub fn find_tensor(&self, name: &str) -> Option<TensorInfo<'a>> {
        self.tensors().find(|t| t.name == name)
    }
}

/// BLAKE3 of `bytes` with the header's checksum field read as zeros.
pub fn checksum(bytes: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    let a = CHECKSUM_OFFSET.min(bytes.len());
    let b = (CHECKSUM_OFFSET + 32).min(bytes.len());
    h.update(&bytes[..a]);
    h.update(&[0u8; 32][..b - a]);
    h.update(&bytes[b..]);
    *h.finalize().as_bytes()
}
