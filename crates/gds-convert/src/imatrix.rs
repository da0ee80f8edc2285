//! Importance matrices (`--imatrix`): the per-column activation statistics llama.cpp's
//! `llama-imatrix` writes, read in both of its formats and turned into per-column
//! quantization weights exactly as `llama-quantize` does (tools/quantize/quantize.cpp
//! `load_imatrix`, common/imatrix-loader.cpp):
//!
//! - GGUF (current `llama-imatrix`): per matrix `<name>.in_sum2` (F32, `[n_per_row, n_mat]`,
//!   the sums of squared activations per column, `n_mat` experts or 1) and `<name>.counts`
//!   (F32, `[1, n_mat]`, the activations summed); the weight of column `i` of expert `j` is
//!   `in_sum2[j][i] / round(counts[j])`, or 1 where the count is 0. Other tensors
//!   (`.in_sum`, `.stats`) and the metadata are not needed.
//! - legacy `.dat` (`llama-imatrix --output-format dat`, older versions): `i32` entry count,
//!   then per entry `i32` name length, the name, `i32` ncall, `i32` value count and the f32
//!   values (already divided by the count, times ncall); the weight is `value / ncall`
//!   (the value itself when ncall ≤ 0). A trailing chunk count and dataset name are optional.
//!
//! Entry names are llama.cpp's GGUF tensor names (`blk.3.attn_q.weight`), which are the
//! converter's canonical names for every input format. The file is untrusted: every length is
//! checked against the file before anything is allocated, and a value that is NaN, infinite
//! or negative is an error naming the file and the entry.

use crate::error::{io, ConvertError};
use crate::staging::StagedFile;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Which of llama.cpp's formats a file was in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImatrixFormat {
    /// GGUF with `.in_sum2` / `.counts` tensors.
    Gguf,
    /// The legacy binary `.dat`.
    Legacy,
}

/// One matrix's weights: `n_mat` rows (experts) of `weights.len() / n_mat` columns.
#[derive(Clone, Debug, PartialEq)]
pub struct ImatrixEntry {
    /// Per-column weights, expert after expert.
    pub weights: Vec<f32>,
    /// Experts (1 for a dense matrix; the legacy format does not record it).
    pub n_mat: usize,
}

/// An importance matrix, ready to weigh quantization.
#[derive(Clone, Debug)]
pub struct Imatrix {
    /// The file it was read from.
    pub path: PathBuf,
    /// Its format.
    pub format: ImatrixFormat,
    /// Entries by tensor name.
    pub entries: BTreeMap<String, ImatrixEntry>,
}

/// GGUF value type ids.
const GGUF_STRING: u32 = 8;
const GGUF_ARRAY: u32 = 9;
/// Nesting of GGUF arrays we follow (llama.cpp writes none nested).
const MAX_ARRAY_DEPTH: u32 = 2;

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], String> {
        let left = (self.b.len() - self.pos) as u64;
        if n > left {
            return Err(format!(
                "truncated: {} needs {n} bytes at offset {}, {left} left",
                what(),
                self.pos
            ));
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, String> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn i32(&mut self, what: &dyn Fn() -> String) -> Result<i32, String> {
        Ok(self.u32(what)? as i32)
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, String> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }
    fn gguf_string(&mut self, what: &dyn Fn() -> String) -> Result<&'a str, String> {
        let n = self.u64(what)?;
        let s = self.take(n, what)?;
        std::str::from_utf8(s).map_err(|_| format!("{} is not UTF-8", what()))
    }
    /// Skips one GGUF value of type `t`.
    fn skip_value(&mut self, t: u32, depth: u32, what: &dyn Fn() -> String) -> Result<(), String> {
        let fixed = match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            GGUF_STRING => {
                let n = self.u64(what)?;
                self.take(n, what)?;
                return Ok(());
            }
            GGUF_ARRAY if depth < MAX_ARRAY_DEPTH => {
                let et = self.u32(what)?;
                let n = self.u64(what)?;
                // each element takes at least a byte: a count past the file is refused before
                // looping over it
                if n > (self.b.len() - self.pos) as u64 {
                    return Err(format!(
                        "{}: array of {n} elements past the end of the file",
                        what()
                    ));
                }
                for _ in 0..n {
                    self.skip_value(et, depth + 1, what)?;
                }
                return Ok(());
            }
            _ => {
                return Err(format!(
                    "{}: unknown or too deeply nested value type {t}",
                    what()
                ))
            }
        };
        self.take(fixed, what)?;
        Ok(())
    }
}

/// A tensor of the GGUF file: name, dims (ggml order), type, data offset.
struct GgufTensor<'a> {
    name: &'a str,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

/// Reads an importance matrix from `path` (GGUF when it starts with `GGUF`, else legacy).
pub fn read_imatrix(path: &Path) -> Result<Imatrix, ConvertError> {
    // a FIFO is refused instead of blocking the open, a directory or device (`/dev/null`)
    // named as such instead of failing to map
    let file = gds_io::open_user_file(path).map_err(io(path))?;
    // SAFETY: the file is opened read-only and the mapping is only read; a concurrent writer
    // truncating it could fault, the same contract as the model inputs (see gguf.rs).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
    let bad = |msg: String| ConvertError::BadInput {
        path: path.to_path_buf(),
        msg: format!("importance matrix: {msg}"),
    };
    let (format, entries) = if map.starts_with(b"GGUF") {
        (ImatrixFormat::Gguf, parse_gguf(&map).map_err(bad)?)
    } else {
        (ImatrixFormat::Legacy, parse_legacy(&map).map_err(bad)?)
    };
    if entries.is_empty() {
        return Err(bad("it holds no entries".into()));
    }
    Ok(Imatrix {
        path: path.to_path_buf(),
        format,
        entries,
    })
}

/// A weight must be a finite non-negative number.
fn check_values(name: &str, v: &[f32], what: &str) -> Result<(), String> {
    match v.iter().position(|x| !x.is_finite() || *x < 0.0) {
        None => Ok(()),
        Some(i) => Err(format!(
            "entry {name:?}: {what} {i} is {} (must be finite and not negative)",
            v[i]
        )),
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn parse_gguf(b: &[u8]) -> Result<BTreeMap<String, ImatrixEntry>, String> {
    let mut c = Cursor { b, pos: 4 };
    let version = c.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (2 or 3)"));
    }
    let n_tensors = c.u64(&|| "the tensor count".into())?;
    let n_kv = c.u64(&|| "the key count".into())?;
    // a key takes at least 12 bytes, a tensor 24: counts past the file are refused at once
    if n_kv > b.len() as u64 / 12 || n_tensors > b.len() as u64 / 24 {
        return Err(format!(
            "truncated: {n_kv} keys and {n_tensors} tensors cannot fit in {} bytes",
            b.len()
        ));
    }
    let mut alignment = 32u64;
    for i in 0..n_kv {
        let key = c.gguf_string(&|| format!("key {i}"))?.to_string();
        let what = || format!("key {key:?}");
        let t = c.u32(&what)?;
        if key == "general.alignment" && t == 4 {
            alignment = c.u32(&what)? as u64;
            if alignment == 0 || !alignment.is_power_of_two() {
                return Err(format!(
                    "general.alignment {alignment} is not a power of two"
                ));
            }
        } else {
            c.skip_value(t, 0, &what)?;
        }
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.gguf_string(&|| format!("tensor {i}'s name"))?;
        let what = || format!("tensor {name:?}");
        let n_dims = c.u32(&what)?;
        if n_dims > 4 {
            return Err(format!(
                "tensor {name:?} has {n_dims} dimensions (at most 4)"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let ty = c.u32(&what)?;
        let offset = c.u64(&what)?;
        tensors.push(GgufTensor {
            name,
            dims,
            ty,
            offset,
        });
    }
    let data = (c.pos as u64).div_ceil(alignment) * alignment;
    // the F32 data of a tensor, bounds-checked
    let data_of = |t: &GgufTensor| -> Result<Vec<f32>, String> {
        if t.ty != 0 {
            return Err(format!(
                "tensor {:?} has ggml type {}, not F32",
                t.name, t.ty
            ));
        }
        let n = t
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("tensor {:?} has shape {:?}", t.name, t.dims))?;
        let start = data.checked_add(t.offset);
        let end = n.checked_mul(4).and_then(|nb| start?.checked_add(nb));
        match (start, end) {
            (Some(s), Some(e)) if e <= b.len() as u64 => Ok(f32s(&b[s as usize..e as usize])),
            _ => Err(format!(
                "truncated: tensor {:?} ({n} values at data offset {}) is past the end of the file ({} bytes)",
                t.name,
                t.offset,
                b.len()
            )),
        }
    };
    let mut sums: BTreeMap<&str, &GgufTensor> = BTreeMap::new();
    let mut counts: BTreeMap<&str, &GgufTensor> = BTreeMap::new();
    for t in &tensors {
        let slot = if let Some(n) = t.name.strip_suffix(".in_sum2") {
            sums.insert(n, t)
        } else if let Some(n) = t.name.strip_suffix(".counts") {
            counts.insert(n, t)
        } else {
            continue; // .in_sum, .stats: not needed
        };
        if slot.is_some() {
            return Err(format!("tensor {:?} appears twice", t.name));
        }
    }
    if let Some(n) = counts.keys().find(|n| !sums.contains_key(*n)) {
        return Err(format!("entry {n:?} has counts but no in_sum2"));
    }
    let mut out = BTreeMap::new();
    for (name, s) in sums {
        let cnt = counts
            .get(name)
            .ok_or_else(|| format!("entry {name:?} has in_sum2 but no counts"))?;
        let sum2 = data_of(s)?;
        let cnt = data_of(cnt)?;
        check_values(name, &sum2, "in_sum2 value")?;
        check_values(name, &cnt, "count")?;
        let n_mat = cnt.len();
        if !sum2.len().is_multiple_of(n_mat) {
            return Err(format!(
                "entry {name:?}: {} in_sum2 values are not a whole number of rows for its {n_mat} counts",
                sum2.len()
            ));
        }
        let ne0 = sum2.len() / n_mat;
        let mut w = vec![0f32; sum2.len()];
        for (j, &c) in cnt.iter().enumerate() {
            // llama.cpp stores counts as int64 (`std::lround`) and divides by them as float
            let count = c.round() as i64 as f32;
            for i in j * ne0..(j + 1) * ne0 {
                w[i] = if count > 0.0 { sum2[i] / count } else { 1.0 };
            }
        }
        check_values(name, &w, "weight")?;
        out.insert(name.to_string(), ImatrixEntry { weights: w, n_mat });
    }
    Ok(out)
}

fn parse_legacy(b: &[u8]) -> Result<BTreeMap<String, ImatrixEntry>, String> {
    let mut c = Cursor { b, pos: 0 };
    let n =
        c.i32(&|| "the entry count (not a GGUF file: read as the legacy .dat format)".into())?;
    // an entry takes at least 16 bytes
    if n < 1 || n as u64 > b.len() as u64 / 16 {
        return Err(format!(
            "not an importance matrix: neither GGUF nor the legacy .dat format (entry count {n} for {} bytes)",
            b.len()
        ));
    }
    let mut out = BTreeMap::new();
    for i in 0..n {
        let what = || format!("entry {i}");
        let len = c.i32(&what)?;
        if len < 0 {
            return Err(format!("entry {i}: name length {len}"));
        }
        let name = std::str::from_utf8(c.take(len as u64, &what)?)
            .map_err(|_| format!("entry {i}: the name is not UTF-8"))?
            .to_string();
        let what = || format!("entry {name:?}");
        let ncall = c.i32(&what)?;
        let nval = c.i32(&what)?;
        if nval < 1 {
            return Err(format!("entry {name:?}: {nval} values"));
        }
        let sums = f32s(c.take(nval as u64 * 4, &what)?);
        check_values(&name, &sums, "value")?;
        // llama-quantize: sums / ncall (int64 converted to float), the sums when ncall <= 0
        let w: Vec<f32> = if ncall > 0 {
            sums.iter().map(|&s| s / ncall as i64 as f32).collect()
        } else {
            sums
        };
        if out
            .insert(
                name.clone(),
                ImatrixEntry {
                    weights: w,
                    n_mat: 1,
                },
            )
            .is_some()
        {
            return Err(format!("entry {name:?} appears twice"));
        }
    }
    // the optional trailer (chunk count, dataset name) is not needed
    Ok(out)
}

/// One matrix of an importance matrix to write: per column the sum of squared activations,
/// and the number of activation rows summed (a dense matrix: one expert).
#[derive(Clone, Debug, PartialEq)]
pub struct ImatrixSums {
    /// Per column, Σ x², expert after expert (`counts.len()` of them; one for a dense matrix).
    pub in_sum2: Vec<f32>,
    /// Activation rows (tokens) summed, per expert.
    pub counts: Vec<u64>,
}

/// What [`write_gguf`] records besides the sums (llama-imatrix's metadata keys).
#[derive(Clone, Debug, Default)]
pub struct ImatrixMeta {
    /// `imatrix.datasets`: the calibration files' names.
    pub datasets: Vec<String>,
    /// `imatrix.chunk_count`: chunks evaluated.
    pub chunk_count: u32,
    /// `imatrix.chunk_size`: tokens per chunk.
    pub chunk_size: u32,
}

/// The bytes of a GGUF importance matrix as `llama-imatrix` writes it: GGUF v3, keys
/// `general.type` = `imatrix`, `imatrix.datasets`, `imatrix.chunk_count`,
/// `imatrix.chunk_size`; per matrix, in name order, `<name>.in_sum2` (F32, ggml dims
/// `[n_cols, 1]`) and `<name>.counts` (F32, `[1, 1]`), data aligned to 32 bytes.
pub fn gguf_bytes(entries: &BTreeMap<String, ImatrixSums>, meta: &ImatrixMeta) -> Vec<u8> {
    const ALIGN: u64 = 32;
    let s = |b: &mut Vec<u8>, v: &str| {
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(v.as_bytes());
    };
    // llama-imatrix's shapes (ggml order): in_sum2 [cols, n_mat], counts [1, n_mat]
    let counts: Vec<Vec<f32>> = entries
        .values()
        .map(|e| e.counts.iter().map(|&c| c as f32).collect())
        .collect();
    let mut tensors: Vec<(String, [u64; 2], &[f32])> = Vec::with_capacity(entries.len() * 2);
    for ((name, e), count) in entries.iter().zip(&counts) {
        let n_mat = count.len().max(1) as u64;
        tensors.push((
            format!("{name}.in_sum2"),
            [e.in_sum2.len() as u64 / n_mat, n_mat],
            &e.in_sum2,
        ));
        tensors.push((format!("{name}.counts"), [1, n_mat], count));
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend(4u64.to_le_bytes());
    s(&mut b, "general.type");
    b.extend(GGUF_STRING.to_le_bytes());
    s(&mut b, "imatrix");
    s(&mut b, "imatrix.datasets");
    b.extend(GGUF_ARRAY.to_le_bytes());
    b.extend(GGUF_STRING.to_le_bytes());
    b.extend((meta.datasets.len() as u64).to_le_bytes());
    for d in &meta.datasets {
        s(&mut b, d);
    }
    for (k, v) in [
        ("imatrix.chunk_count", meta.chunk_count),
        ("imatrix.chunk_size", meta.chunk_size),
    ] {
        s(&mut b, k);
        b.extend(4u32.to_le_bytes()); // GGUF_TYPE_UINT32
        b.extend(v.to_le_bytes());
    }
    let mut off = 0u64;
    for (name, dims, vals) in &tensors {
        s(&mut b, name);
        b.extend(2u32.to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(off.to_le_bytes());
        off += (vals.len() as u64 * 4).div_ceil(ALIGN) * ALIGN;
    }
    b.resize(
        (b.len() as u64).div_ceil(ALIGN) as usize * ALIGN as usize,
        0,
    );
    for (_, _, vals) in &tensors {
        let start = b.len();
        for v in vals.iter() {
            b.extend(v.to_le_bytes());
        }
        let len = (b.len() - start) as u64;
        b.resize(start + (len.div_ceil(ALIGN) * ALIGN) as usize, 0);
    }
    b
}

/// Writes [`gguf_bytes`] to `file`, the output [`StagedFile::create`] started (before the
/// minutes of computing what it holds), and puts it at its path (synced, then renamed over
/// it); on an error nothing changes at the path or beside it. Errors name the path, not the
/// temporary file.
pub fn write_gguf_to(
    out: StagedFile,
    mut file: std::fs::File,
    entries: &BTreeMap<String, ImatrixSums>,
    meta: &ImatrixMeta,
) -> Result<(), ConvertError> {
    use std::io::Write;
    file.write_all(&gguf_bytes(entries, meta))
        .map_err(io(out.target()))?;
    out.commit(file)
}

impl Imatrix {
    /// The weights of each expert of `name` (a matrix of `cols` columns and `n_mat` experts),
    /// or `None` when the file has no entry for it; an entry of another size is an error
    /// (llama-quantize's too), except for the token embedding, which llama-quantize then
    /// quantizes without weights.
    pub fn weights_for(
        &self,
        name: &str,
        cols: u64,
        n_mat: u64,
    ) -> Result<Option<&[f32]>, ConvertError> {
        let Some(e) = self.entries.get(name) else {
            return Ok(None);
        };
        if e.weights.len() as u64 == cols.saturating_mul(n_mat) {
            return Ok(Some(&e.weights));
        }
        if name == "token_embd.weight" {
            return Ok(None);
        }
        Err(ConvertError::BadInput {
            path: self.path.clone(),
            msg: format!(
                "importance matrix: entry {name:?} has {} values but the tensor has {cols} columns{}",
                e.weights.len(),
                if n_mat > 1 {
                    format!(" in each of {n_mat} experts")
                } else {
                    String::new()
                }
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The output `gdsrun imatrix -o` starts ([`StagedFile::create`]).
    fn create_output(path: &Path) -> Result<(StagedFile, std::fs::File), ConvertError> {
        StagedFile::create(path, "the importance matrix")
    }

    /// [`create_output`] and [`write_gguf_to`] at once.
    fn write_gguf(
        path: &Path,
        entries: &BTreeMap<String, ImatrixSums>,
        meta: &ImatrixMeta,
    ) -> Result<(), ConvertError> {
        let (out, file) = create_output(path)?;
        write_gguf_to(out, file, entries, meta)
    }

    fn legacy(entries: &[(&str, i32, &[f32])]) -> Vec<u8> {
        let mut b = (entries.len() as i32).to_le_bytes().to_vec();
        for (name, ncall, vals) in entries {
            b.extend((name.len() as i32).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(ncall.to_le_bytes());
            b.extend((vals.len() as i32).to_le_bytes());
            for v in *vals {
                b.extend(v.to_le_bytes());
            }
        }
        b
    }

    /// A GGUF v3 file of these tensors (name, ggml dims, ggml type, f32 values), with one
    /// string key, as llama-imatrix writes them.
    fn gguf(tensors: &[(&str, &[u64], u32, &[f32])]) -> Vec<u8> {
        let s = |b: &mut Vec<u8>, v: &str| {
            b.extend((v.len() as u64).to_le_bytes());
            b.extend(v.as_bytes());
        };
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend(1u64.to_le_bytes());
        s(&mut b, "general.type");
        b.extend(GGUF_STRING.to_le_bytes());
        s(&mut b, "imatrix");
        let mut off = 0u64;
        for (name, dims, ty, vals) in tensors {
            s(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(off.to_le_bytes());
            off += (vals.len() as u64 * 4).div_ceil(32) * 32;
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        for (_, _, _, vals) in tensors {
            let start = b.len();
            for v in *vals {
                b.extend(v.to_le_bytes());
            }
            b.resize(start + (b.len() - start).div_ceil(32) * 32, 0);
        }
        b
    }

    #[test]
    fn read_imatrix_refuses_what_is_not_a_regular_file() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path, not retained.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // a FIFO without a writer (a blocking open never returns), a directory, a device
        for p in [fifo.as_path(), d.path(), Path::new("/dev/null")] {
            // on a thread: a blocking open fails the test instead of hanging it
            let (tx, rx) = std::sync::mpsc::channel();
            let q = p.to_path_buf();
            std::thread::spawn(move || tx.send(read_imatrix(&q).err()));
            let e = rx
                .recv_timeout(std::time::Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("{}: the open blocked", p.display()))
                .unwrap();
            assert_eq!(e.kind(), crate::ErrorKind::Io, "{e}");
            assert_eq!(
                e.to_string(),
                format!("{}: not a regular file", p.display())
            );
        }
    }

    #[test]
    fn gguf_divides_each_expert_by_its_count() {
        let m = parse_gguf(&gguf(&[
            ("e.in_sum2", &[2, 3], 0, &[4.0, 8.0, 1.0, 2.0, 9.0, 3.0]),
            ("e.counts", &[1, 3], 0, &[4.0, 0.0, 2.6]),
            ("e.stats", &[12], 0, &[0.0; 12]),
            ("d.counts", &[1, 1], 0, &[2.0]),
            ("d.in_sum2", &[4], 0, &[2.0, 4.0, 6.0, 0.0]),
        ]))
        .unwrap();
        // expert 1 has no count: weights 1; 2.6 activations round to 3
        assert_eq!(m["e"].weights, vec![1.0, 2.0, 1.0, 1.0, 3.0, 1.0]);
        assert_eq!(m["e"].n_mat, 3);
        assert_eq!(m["d"].weights, vec![1.0, 2.0, 3.0, 0.0]);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn gguf_refuses_bad_entries() {
        let ok = gguf(&[
            ("x.in_sum2", &[4], 0, &[1.0; 4]),
            ("x.counts", &[1], 0, &[1.0]),
        ]);
        assert!(parse_gguf(&ok).is_ok());
        for (bytes, want) in [
            (
                gguf(&[("x.in_sum2", &[4], 0, &[1.0; 4])]),
                "\"x\" has in_sum2 but no counts",
            ),
            (
                gguf(&[("x.counts", &[1], 0, &[1.0])]),
                "\"x\" has counts but no in_sum2",
            ),
            (
                gguf(&[
                    ("x.in_sum2", &[4], 1, &[1.0; 2]),
                    ("x.counts", &[1], 0, &[1.0]),
                ]),
                "\"x.in_sum2\" has ggml type 1, not F32",
            ),
            (
                gguf(&[
                    ("x.in_sum2", &[3], 0, &[1.0; 3]),
                    ("x.counts", &[1, 2], 0, &[1.0; 2]),
                ]),
                "3 in_sum2 values are not a whole number of rows for its 2 counts",
            ),
            (
                gguf(&[
                    ("x.in_sum2", &[2], 0, &[1.0, f32::INFINITY]),
                    ("x.counts", &[1], 0, &[1.0]),
                ]),
                "in_sum2 value 1 is inf",
            ),
            (
                gguf(&[
                    ("x.in_sum2", &[2], 0, &[1.0; 2]),
                    ("x.counts", &[1], 0, &[-3.0]),
                ]),
                "count 0 is -3",
            ),
            (
                gguf(&[
                    ("x.in_sum2", &[2], 0, &[1.0; 2]),
                    ("x.in_sum2", &[2], 0, &[1.0; 2]),
                ]),
                "appears twice",
            ),
            (
                gguf(&[
                    ("x.in_sum2", &[1 << 40], 0, &[1.0; 2]),
                    ("x.counts", &[1], 0, &[1.0]),
                ]),
                "past the end of the file",
            ),
        ] {
            let e = parse_gguf(&bytes).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        // every cut of a good file is an error, never a panic (but the last tensor's
        // padding: its 4 bytes of data end 28 bytes before the end)
        for cut in 4..ok.len() - 28 {
            assert!(parse_gguf(&ok[..cut]).is_err(), "{cut}");
        }
        let mut v = ok.clone();
        v[4] = 9;
        assert!(parse_gguf(&v).unwrap_err().contains("version 9"));
    }

    #[test]
    fn legacy_divides_by_ncall_and_refuses_bad_entries() {
        let m = parse_legacy(&legacy(&[("a.weight", 4, &[8.0, 2.0]), ("b", 0, &[3.0])])).unwrap();
        assert_eq!(m["a.weight"].weights, vec![2.0, 0.5]);
        assert_eq!(m["b"].weights, vec![3.0]);
        for (bytes, want) in [
            (legacy(&[("x", 1, &[f32::NAN])]), "\"x\": value 0 is NaN"),
            (legacy(&[("x", 1, &[1.0, -1.0])]), "\"x\": value 1 is -1"),
            (
                legacy(&[("x", 1, &[1.0]), ("x", 1, &[1.0])]),
                "appears twice",
            ),
            (legacy(&[]), "not an importance matrix"),
        ] {
            let e = parse_legacy(&bytes).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let full = legacy(&[("blk.0.attn_q.weight", 1, &[1.0; 8])]);
        for cut in [3, 9, 30, full.len() - 1] {
            let e = parse_legacy(&full[..cut]).unwrap_err();
            assert!(
                e.contains("truncated") || e.contains("not an importance"),
                "{cut}: {e}"
            );
        }
    }
    #[test]
    fn written_gguf_reads_back_as_llama_imatrix_writes_it() {
        let mut entries = BTreeMap::new();
        entries.insert(
            "blk.0.attn_q.weight".to_string(),
            ImatrixSums {
                in_sum2: vec![8.0, 0.0, 2.0],
                counts: vec![4],
            },
        );
        entries.insert(
            "blk.0.ffn_down.weight".to_string(),
            ImatrixSums {
                in_sum2: vec![5.0; 9],
                counts: vec![0],
            },
        );
        let meta = ImatrixMeta {
            datasets: vec!["calib.txt".into()],
            chunk_count: 2,
            chunk_size: 2,
        };
        let b = gguf_bytes(&entries, &meta);
        let m = parse_gguf(&b).unwrap();
        assert_eq!(m["blk.0.attn_q.weight"].weights, vec![2.0, 0.0, 0.5]);
        // a matrix no token reached: weights 1 (llama-quantize's rule for count 0)
        assert_eq!(m["blk.0.ffn_down.weight"].weights, vec![1.0; 9]);
        assert_eq!(m.len(), 2);
        // the same bytes as the reader's test writer makes for the same tensors (the data
        // layout llama-imatrix's gguf_write_to_file gives), past the metadata
        let want = gguf(&[
            ("blk.0.attn_q.weight.in_sum2", &[3, 1], 0, &[8.0, 0.0, 2.0]),
            ("blk.0.attn_q.weight.counts", &[1, 1], 0, &[4.0]),
            ("blk.0.ffn_down.weight.in_sum2", &[9, 1], 0, &[5.0; 9]),
            ("blk.0.ffn_down.weight.counts", &[1, 1], 0, &[0.0]),
        ]);
        let tail = 4 * 32 + 32; // the data: 3 + 1 + 9 + 1 values, each padded to 32 bytes
        assert_eq!(b[b.len() - tail..], want[want.len() - tail..]);
        // atomic write: the file appears whole, no temporary is left
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.imatrix.gguf");
        write_gguf(&p, &entries, &meta).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b);
        let r = read_imatrix(&p).unwrap();
        assert_eq!(r.format, ImatrixFormat::Gguf);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // a directory that does not exist: an error naming the output (not the hidden
        // temporary), the OS error once, nothing written
        let bad = dir.path().join("no/such/dir/x.gguf");
        let e = write_gguf(&bad, &entries, &meta).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: ", bad.display())), "{e}");
        assert!(!e.contains(".x.gguf.tmp"), "{e}");
        assert_eq!(e.matches("os error 2").count(), 1, "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn an_unwritable_output_is_found_before_computing() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("im.gguf");
        // started, then abandoned (an error while computing): nothing is left behind
        drop(create_output(&ok).unwrap());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        for (bad, why) in [
            (dir.path().join("nonexistent-dir/im.gguf"), "os error 2"),
            (dir.path().to_path_buf(), "is a directory"),
        ] {
            let e = create_output(&bad).err().unwrap();
            assert_eq!(e.kind(), crate::ErrorKind::Usage, "{e}");
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("{}: ", bad.display())), "{msg}");
            assert!(!msg.contains(".im.gguf.tmp"), "{msg}");
            assert_eq!(msg.matches(why).count(), 1, "{msg}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
