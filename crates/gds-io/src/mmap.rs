//! The `mmap` backend: every layer file mapped whole, read-only. Acquiring a layer hands out
//! the mapping itself (zero-copy); the kernel pages the bytes in on first touch.

use crate::verify::{open_in_dir, Verifier, VerifyMode};
use crate::{IoError, IoStats, LayerBytes, LayerSource, Resident, Span};
use gds_format::Manifest;
use memmap2::{Advice, Mmap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// One mapped layer file. Empty files (a layer with no tensors) have no mapping.
struct Mapped(Option<Mmap>);

impl Resident for Mapped {
    fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}

/// Memory-maps every layer file of a model directory.
pub struct MmapBackend {
    layers: Vec<Arc<Mapped>>,
    touched: Vec<AtomicBool>,
    bytes_read: AtomicU64,
    acquires: AtomicU64,
}

impl MmapBackend {
    /// Maps every layer file named by `manifest`, relative to `dir`, and checks each one's
    /// content hash (unless the per-user cache says that very file was checked). Fails,
    /// naming the file, when a file is missing, unreadable, a link, of another length than
    /// the manifest records, or its bytes hash differently.
    pub fn open(dir: &Path, manifest: &Manifest<'_>) -> Result<MmapBackend, IoError> {
        MmapBackend::open_with(dir, manifest, &Verifier::new(VerifyMode::Hash))
    }

    /// [`MmapBackend::open`] with the caller's verifier (`--no-verify`, metrics).
    pub fn open_with(
        dir: &Path,
        manifest: &Manifest<'_>,
        verifier: &Verifier,
    ) -> Result<MmapBackend, IoError> {
        let mut layers = Vec::with_capacity(manifest.n_layers());
        for lf in layer_files(dir, manifest, 0)? {
            let LayerFile {
                path,
                file,
                size,
                hash,
            } = lf;
            let map = if size == 0 {
                None
            } else {
                // SAFETY: the mapping is read-only and private to this process. Like every
                // mmap-based loader we rely on nobody truncating or rewriting the model files
                // while they are mapped; the length was just checked against the manifest.
                let map = unsafe { Mmap::map(&file) }.map_err(|error| IoError::File {
                    path: path.clone(),
                    error,
                })?;
                Some(map)
            };
            if !verifier.is_verified(&file, &hash) {
                verifier.check_bytes(&path, map.as_deref().unwrap_or(&[]), &hash)?;
                verifier.record(&file, &hash);
            }
            layers.push(Arc::new(Mapped(map)));
        }
        Ok(MmapBackend {
            touched: layers.iter().map(|_| AtomicBool::new(false)).collect(),
            layers,
            bytes_read: AtomicU64::new(0),
            acquires: AtomicU64::new(0),
        })
    }
}

/// A layer file of the model directory, opened.
pub(crate) struct LayerFile {
    /// Its path, for messages.
    pub path: PathBuf,
    /// The open file.
    pub file: File,
    /// Its length (equal to the manifest's record).
    pub size: u64,
    /// Its BLAKE3 according to the manifest.
    pub hash: [u8; 32],
}

/// Opens every layer file named by `manifest` inside `dir` (never following a link, see
/// [`open_in_dir`]) with `flags` added to the open. Fails, naming the file, when a path is
/// unsafe, a file is missing or unreadable, or its length differs from the manifest's
/// record.
pub(crate) fn layer_files(
    dir: &Path,
    manifest: &Manifest<'_>,
    flags: i32,
) -> Result<Vec<LayerFile>, IoError> {
    (0..manifest.n_layers())
        .map(|i| layer_file(dir, manifest, i, flags))
        .collect()
}

/// Opens layer `i`'s file (see [`layer_files`]).
fn layer_file(
    dir: &Path,
    manifest: &Manifest<'_>,
    i: usize,
    flags: i32,
) -> Result<LayerFile, IoError> {
    let info = manifest.layer(i).map_err(|error| IoError::Manifest {
        path: dir.join(gds_format::MANIFEST_FILE),
        error,
    })?;
    if !gds_format::validate::is_safe_relative_path(info.file) {
        return Err(IoError::BadPath {
            layer: i,
            file: info.file.to_string(),
        });
    }
    let path = dir.join(info.file);
    let file = open_in_dir(dir, info.file, flags)?;
    let actual = file
        .metadata()
        .map_err(|error| IoError::File {
            path: path.clone(),
            error,
        })?
        .len();
    if actual != info.file_size {
        return Err(IoError::LengthMismatch {
            path,
            expected: info.file_size,
            actual,
        });
    }
    Ok(LayerFile {
        path,
        file,
        size: actual,
        hash: info.content_hash,
    })
}

impl LayerSource for MmapBackend {
    fn name(&self) -> &'static str {
        "mmap"
    }

    fn n_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer_size(&self, layer: usize) -> u64 {
        self.layers.get(layer).map_or(0, |l| l.bytes().len() as u64)
    }

    fn acquire_span(&self, span: Span) -> Result<LayerBytes, IoError> {
        let buf = self.layers.get(span.layer).ok_or(IoError::NoSuchLayer {
            layer: span.layer,
            n_layers: self.layers.len(),
        })?;
        let size = buf.bytes().len() as u64;
        if span.offset.checked_add(span.len).is_none_or(|e| e > size) {
            return Err(IoError::OutOfRange {
                path: PathBuf::from(format!("layer {}", span.layer)),
                offset: span.offset,
                len: span.len,
                size,
            });
        }
        self.acquires.fetch_add(1, Ordering::Relaxed);
        if !self.touched[span.layer].swap(true, Ordering::Relaxed) {
            self.bytes_read.fetch_add(size, Ordering::Relaxed);
        }
        let (a, b) = (span.offset as usize, (span.offset + span.len) as usize);
        Ok(LayerBytes::new_span(
            span.layer,
            span.offset,
            a..b,
            buf.clone(),
        ))
    }

    fn prefetch(&self, span: Span) {
        if let Some(Mapped(Some(map))) = self.layers.get(span.layer).map(|a| &**a) {
            // A hint only: failure changes nothing but speed.
            let _ = map.advise_range(Advice::WillNeed, span.offset as usize, span.len as usize);
        }
    }

    fn stats(&self) -> IoStats {
        IoStats {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            acquires: self.acquires.load(Ordering::Relaxed),
            ..IoStats::default()
        }
    }
}

/// Reads `manifest.gdsm` of a model directory into memory (it is small; the layer files are
/// what gets mapped).
///
/// The file is opened without following a link, and its size is checked against the
/// format's 64 MiB cap before anything is read.
pub fn read_manifest(dir: &Path) -> Result<Vec<u8>, IoError> {
    use std::io::Read;
    let path: PathBuf = dir.join(gds_format::MANIFEST_FILE);
    let file = open_in_dir(dir, gds_format::MANIFEST_FILE, 0)?;
    let cap = gds_format::raw::MAX_MANIFEST_BYTES;
    let len = file
        .metadata()
        .map_err(|error| IoError::File {
            path: path.clone(),
            error,
        })?
        .len();
    if len > cap {
        return Err(IoError::Manifest {
            path,
            error: gds_format::FormatError::TooLarge(len),
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    (&file)
        .take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| IoError::File { path, error })?;
    Ok(bytes)
}

/// Checks every layer file of `m` that `verifier` does not already vouch for, reading each
/// through a bounded buffer: for load paths that never put the bytes in host memory
/// (GPUDirect Storage), so nothing unverified reaches the device.
pub fn verify_layer_files(
    dir: &Path,
    m: &Manifest<'_>,
    verifier: &Verifier,
) -> Result<(), IoError> {
    for l in layer_files(dir, m, 0)? {
        if !verifier.is_verified(&l.file, &l.hash) {
            verifier.check_file(&l.path, &l.file, &l.hash)?;
            crate::pagecache::drop_cached(&l.file, 0, l.size);
        }
    }
    Ok(())
}

/// Reads `len` bytes at `offset` of layer `layer`'s file, after checking the whole file
/// against the manifest's hash unless `verifier` vouches for it (a file the executor already
/// checked costs nothing): for the few small tensors a front end reads apart from the
/// executor (a reranker's classifier head). Fails, naming the file, as
/// [`MmapBackend::open`] does, and when the range is not inside the file.
pub fn read_layer_span(
    dir: &Path,
    manifest: &Manifest<'_>,
    layer: usize,
    offset: u64,
    len: u64,
    verifier: &Verifier,
) -> Result<Vec<u8>, IoError> {
    let l = layer_file(dir, manifest, layer, 0)?;
    match offset.checked_add(len) {
        Some(end) if end <= l.size && usize::try_from(len).is_ok() => {}
        _ => {
            return Err(IoError::OutOfRange {
                path: l.path,
                offset,
                len,
                size: l.size,
            })
        }
    }
    if !verifier.is_verified(&l.file, &l.hash) {
        verifier.check_file(&l.path, &l.file, &l.hash)?;
    }
    let mut buf = vec![0u8; len as usize];
    std::os::unix::fs::FileExt::read_exact_at(&l.file, &mut buf, offset).map_err(|error| {
        IoError::File {
            path: l.path,
            error,
        }
    })?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gds_format::{DType, LayerRecord, ManifestBuilder, TensorSpec};

    /// Writes a one-layer model directory whose layer file holds `data`.
    fn model_dir(data: &[u8], declared_len: u64) -> (tempfile::TempDir, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("embed.bin"), data).unwrap();
        let spec = TensorSpec {
            name: "token_embd.weight".into(),
            dtype: DType::F32,
            shape: vec![4, 256],
        };
        let mut layout = gds_format::layout(std::slice::from_ref(&spec)).unwrap();
        layout.file_size = declared_len;
        let mut b = ManifestBuilder::new();
        b.kv_str("general.architecture", "llama");
        b.add_layer(&LayerRecord {
            name: "embed".into(),
            file: "embed.bin".into(),
            kind: gds_format::layer_kind::EMBED,
            index: 0,
            tensors: vec![spec],
            layout,
            content_hash: *blake3::hash(data).as_bytes(),
        });
        (dir, b.finish())
    }

    #[test]
    fn maps_layers_and_counts_bytes_once() {
        let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let (dir, bytes) = model_dir(&data, 4096);
        let m = Manifest::parse(&bytes).unwrap();
        let b = MmapBackend::open(dir.path(), &m).unwrap();
        assert_eq!(b.n_layers(), 1);
        let l = b.acquire(0).unwrap();
        assert_eq!(&l[..], &data[..]);
        assert_eq!(l.index(), 0);
        let again = b.acquire(0).unwrap();
        b.prefetch(Span {
            layer: 0,
            offset: 0,
            len: 4096,
        });
        assert_eq!(again.len(), 4096);
        assert_eq!(
            b.stats(),
            IoStats {
                bytes_read: 4096,
                acquires: 2,
                ..IoStats::default()
            }
        );
        assert!(matches!(
            b.acquire(1),
            Err(IoError::NoSuchLayer {
                layer: 1,
                n_layers: 1
            })
        ));
    }

    #[test]
    fn length_mismatch_names_the_file() {
        let (dir, bytes) = model_dir(&[0u8; 4096], 8192);
        let m = Manifest::parse(&bytes).unwrap();
        let err = MmapBackend::open(dir.path(), &m).err().expect("must fail");
        assert!(matches!(
            err,
            IoError::LengthMismatch {
                expected: 8192,
                actual: 4096,
                ..
            }
        ));
        assert!(err.to_string().contains("embed.bin"), "{err}");
    }

    #[test]
    fn missing_file_names_the_file() {
        let (dir, bytes) = model_dir(&[0u8; 4096], 4096);
        std::fs::remove_file(dir.path().join("embed.bin")).unwrap();
        let m = Manifest::parse(&bytes).unwrap();
        let err = MmapBackend::open(dir.path(), &m).err().expect("must fail");
        assert!(err.to_string().contains("embed.bin"), "{err}");
    }

    #[test]
    fn a_span_is_read_after_its_file_is_checked() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let (dir, bytes) = model_dir(&data, 4096);
        let m = Manifest::parse(&bytes).unwrap();
        let v = Verifier::with_cache(VerifyMode::Hash, None);
        let got = read_layer_span(dir.path(), &m, 0, 100, 28, &v).unwrap();
        assert_eq!(got, &data[100..128]);
        assert_eq!(v.stats().files_hashed, 1);
        // out of the file, or of the layer table: errors, not panics
        for (layer, off, len) in [(0, 4090, 7), (0, u64::MAX, 2), (1, 0, 1)] {
            assert!(read_layer_span(dir.path(), &m, layer, off, len, &v).is_err());
        }
        // a changed byte anywhere in the file (not only in the span) fails the read
        let mut bad = data.clone();
        bad[4000] ^= 1;
        std::fs::write(dir.path().join("embed.bin"), &bad).unwrap();
        let err = read_layer_span(dir.path(), &m, 0, 100, 28, &v).unwrap_err();
        assert!(err.to_string().contains("embed.bin"), "{err}");
        // unless verification is off
        let off = Verifier::with_cache(VerifyMode::Off, None);
        assert!(read_layer_span(dir.path(), &m, 0, 100, 28, &off).is_ok());
    }
}
