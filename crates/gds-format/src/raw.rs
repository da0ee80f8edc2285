//! The raw on-disk records of the manifest, exactly as SPEC.md §3 lays them out.
//!
//! Every field is a little-endian byte-array wrapper, so every struct has alignment 1 and can
//! be cast from any offset of a memory-mapped file. All casting is done by `zerocopy`; there
//! is no `unsafe` in this crate.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// The 8 bytes every manifest starts with.
pub const MAGIC: [u8; 8] = *b"GDSLLM\x00\x01";
/// The major version this crate reads and writes. A reader rejects any other major.
pub const VERSION_MAJOR: u16 = 1;
/// The minor version this crate writes. Readers accept any minor of their major.
/// 1.1 added the file table ([`HeaderExt::files`], [`FileEntry`]): every file of the model
/// directory hashed, not only the layer files.
pub const VERSION_MINOR: u16 = 1;
/// File name of the manifest inside a model directory.
pub const MANIFEST_FILE: &str = "manifest.gdsm";

/// The metadata key of a reranker's prompt: `{query}` and `{document}` are replaced by the
/// texts (llama.cpp's `tokenizer.chat_template.rerank`).
pub const RERANK_TEMPLATE_KEY: &str = "tokenizer.rerank_template";
/// Alignment of every tensor offset and of every data file length.
pub const ALIGNMENT: u64 = 4096;
/// Largest manifest a reader accepts (64 MiB): a cap checked before anything is sized by it.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;

/// A reference to a UTF-8 string in the string table. 8 bytes.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct StrRef {
    /// Byte offset from the start of the string table.
    pub offset: U32,
    /// Length in bytes (no terminator).
    pub len: U32,
}

/// Where a table lives in the manifest. 16 bytes.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Section {
    /// Byte offset from the start of the manifest; a multiple of 8.
    pub offset: U64,
    /// Number of records (for the string table: number of bytes).
    pub count: U32,
    /// Bytes per record; at least the size this version defines (1 for the string table).
    pub entry_size: U32,
}

/// The manifest header, at offset 0. 128 bytes.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: [u8; 8],
    /// [`VERSION_MAJOR`] of the writer.
    pub version_major: U16,
    /// [`VERSION_MINOR`] of the writer.
    pub version_minor: U16,
    /// Size of this header in bytes (128 in 1.0).
    pub header_size: U32,
    /// Total length of the manifest file in bytes.
    pub manifest_size: U64,
    /// Reserved flag bits; writers of 1.0 set 0, readers ignore bits they do not know.
    pub flags: U64,
    /// BLAKE3 of the whole manifest with these 32 bytes set to zero.
    pub checksum: [u8; 32],
    /// The key/value table ([`KvEntry`]).
    pub kv: Section,
    /// The layer table ([`LayerEntry`]).
    pub layers: Section,
    /// The tensor table ([`TensorEntry`]).
    pub tensors: Section,
    /// The string table (raw UTF-8 bytes).
    pub strings: Section,
}

/// Header fields added in 1.1, right after the 1.0 header (offset 128). 16 bytes.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct HeaderExt {
    /// The file table ([`FileEntry`]).
    pub files: Section,
}

/// Size of the header a 1.1 writer writes: the 1.0 header and [`HeaderExt`].
pub const HEADER_SIZE_1_1: usize = size_of::<Header>() + size_of::<HeaderExt>();

/// Roles of [`FileEntry::role`].
pub mod file_role {
    /// `tokenizer.json`.
    pub const TOKENIZER: u32 = 1;
    /// `tokenizer_config.json` (special tokens and the chat template).
    pub const TOKENIZER_CONFIG: u32 = 2;
    /// `generation_config.json`.
    pub const GENERATION_CONFIG: u32 = 3;
    /// Documentation (README, LICENSE, model card): never read by a runtime.
    pub const DOC: u32 = 4;
    /// Any other file the model ships.
    pub const OTHER: u32 = 5;
}

/// One file of the model directory that is not a layer data file (1.1). 56 bytes.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct FileEntry {
    /// Path relative to the model directory, under the same rules as layer files.
    pub path: StrRef,
    /// One of [`file_role`].
    pub role: U32,
    /// Zero.
    pub reserved: U32,
    /// Exact length of the file.
    pub size: U64,
    /// BLAKE3 of the whole file.
    pub content_hash: [u8; 32],
}

/// Offset of [`Header::checksum`] inside the header.
pub const CHECKSUM_OFFSET: usize = 32;

/// Value type codes of [`KvEntry::value_type`].
pub mod kv_type {
    /// `value` holds a u64.
    pub const U64: u32 = 1;
    /// `value` holds an i64 (two's complement).
    pub const I64: u32 = 2;
    /// `value` holds the bits of an f64.
    pub const F64: u32 = 3;
    /// `value` is 0 or 1.
    pub const BOOL: u32 = 4;
    /// `value` holds a [`super::StrRef`] (offset in the low 32 bits, length in the high 32).
    pub const STRING: u32 = 5;
}

/// One typed key/value pair. 24 bytes.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct KvEntry {
    /// The key, e.g. `model.n_layers`.
    pub key: StrRef,
    /// One of [`kv_type`].
    pub value_type: U32,
    /// Zero.
    pub reserved: U32,
    /// The value, interpreted per `value_type`.
    pub value: U64,
}

/// Layer kinds of [`LayerEntry::kind`].
pub mod layer_kind {
    /// Token embedding (and anything else read before the first block).
    pub const EMBED: u32 = 0;
    /// One transformer block; `LayerEntry::index` is its number.
    pub const BLOCK: u32 = 1;
    /// Final norm, output head, and any other tensor outside the blocks.
    pub const HEAD: u32 = 2;
}

/// One layer: one data file. 72 bytes.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct LayerEntry {
    /// Display name (`embed`, `blk.0`, `head`).
    pub name: StrRef,
    /// Path of the data file, relative to the model directory, `/`-separated.
    pub file: StrRef,
    /// One of [`layer_kind`].
    pub kind: U32,
    /// Block number for [`layer_kind::BLOCK`], else 0.
    pub index: U32,
    /// Index of the layer's first tensor in the tensor table.
    pub first_tensor: U32,
    /// Number of consecutive tensors that belong to this layer.
    pub tensor_count: U32,
    /// Exact length of the data file; a multiple of [`ALIGNMENT`].
    pub file_size: U64,
    /// BLAKE3 of the whole data file.
    pub content_hash: [u8; 32],
}

/// One tensor. 72 bytes.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct TensorEntry {
    /// Canonical tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: StrRef,
    /// ggml type id, see [`crate::DType`].
    pub dtype: U32,
    /// Number of dimensions, 1..=4.
    pub n_dims: U32,
    /// Shape, row-major (outermost first, last dimension contiguous); unused entries are 0.
    pub shape: [U64; MAX_DIMS],
    /// Index of the owning layer in the layer table.
    pub layer: U32,
    /// Zero.
    pub reserved: U32,
    /// Byte offset inside the layer's data file; a multiple of [`ALIGNMENT`].
    pub offset: U64,
    /// Byte length; equals the dtype's size for `shape`.
    pub nbytes: U64,
}

const _: () = assert!(size_of::<StrRef>() == 8);
const _: () = assert!(size_of::<Section>() == 16);
const _: () = assert!(size_of::<Header>() == 128);
const _: () = assert!(size_of::<KvEntry>() == 24);
const _: () = assert!(size_of::<LayerEntry>() == 72);
const _: () = assert!(size_of::<TensorEntry>() == 72);
const _: () = assert!(size_of::<HeaderExt>() == 16);
const _: () = assert!(size_of::<FileEntry>() == 56);
