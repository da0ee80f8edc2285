#![doc = include_str!("../README.md")]

pub mod error;
pub mod foreign;
pub mod json;
pub mod layout;
pub mod package;
pub mod registry;
pub mod resolve;
pub mod store;

pub use error::{DistError, Kind};
pub use package::{Artifact, BlobRef, BlobSource};

/// The OCI image manifest media type (set explicitly in every manifest we write).
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// The OCI image index media type (`index.json` of a layout).
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// ModelPack's artifact type.
pub const ARTIFACT_TYPE: &str = "application/vnd.cncf.model.manifest.v1+json";
/// ModelPack's config media type.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.cncf.model.config.v1+json";
/// Layer data files.
pub const WEIGHT_MEDIA_TYPE: &str = "application/vnd.cncf.model.weight.v1.raw";
/// The binary manifest, tokenizer, chat template and other configuration files.
pub const WEIGHT_CONFIG_MEDIA_TYPE: &str = "application/vnd.cncf.model.weight.config.v1.raw";
/// README, LICENSE and other documents.
pub const DOC_MEDIA_TYPE: &str = "application/vnd.cncf.model.doc.v1.raw";
/// The path of a layer's file inside the model directory.
pub const FILEPATH_ANNOTATION: &str = "org.cncf.model.filepath";
/// The file name ORAS (`oras pull`) and CRI-O's OCI artifact volumes give a layer; we set it
/// to the same path (pull reads only `org.cncf.model.filepath`).
pub const TITLE_ANNOTATION: &str = "org.opencontainers.image.title";
/// ModelPack's per-file metadata (we never write it; on pull only regular files are accepted).
pub const FILE_METADATA_ANNOTATION: &str = "org.cncf.model.file.metadata+json";
/// The file's BLAKE3 as our manifest records it (hex), the second check after sha256.
pub const BLAKE3_ANNOTATION: &str = "io.gdsllm.blake3";
/// The tag of an OCI layout entry.
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";
/// GHCR's and Harbor's per-blob limit: a larger file is refused (splitting is not supported).
pub const MAX_BLOB_BYTES: u64 = 10_000_000_000;
/// Largest image manifest accepted on pull (a 4096-file model needs about 1.5 MB).
pub const MAX_MANIFEST_BYTES: usize = 2 << 20;
/// Largest config blob accepted on pull.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Most layers accepted in one artifact.
pub const MAX_LAYERS: usize = 4096;
