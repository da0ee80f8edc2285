//! llama-server's slot actions: `POST /slots/{id}?action=save|restore|erase` with
//! `--slot-save-path DIR`.
//!
//! A slot here is a name for the last tokens of the requests that ran in it (or named it
//! with `id_slot`), not a KV cache of its own: every request shares one prefix cache of KV
//! blocks. Saving writes the blocks the prefix cache still holds of a slot's tokens (its
//! last block partly filled) to a file; restoring puts them back into the prefix cache, so any later request
//! that starts with those tokens skips computing them, on this server or another one
//! running the same model with the same backend, activations, KV type and block size (the
//! file names them by the server's `system_fingerprint`). Erasing forgets the slot's tokens
//! and drops their blocks where no other prefix or request uses them.
//!
//! The file (`docs/serving.md`, "Saving and restoring slots"): `GDSSLOT\0`, a u32 version
//! (1) and a u32 header length, a JSON header, the tokens (u32 each), the blocks' images
//! ([`gds_runtime::KvCache::export_block`]), and a BLAKE3 hash of everything before it;
//! integers little-endian. A file is untrusted input: its size is bounded by what the
//! context can hold before it is read, and its header, lengths, tokens and hash are checked
//! before anything reaches the cache. Files are written to a temporary name and renamed,
//! so a crash never leaves a half-written slot file under the name asked for.

use crate::api::ApiError;
use crate::scheduler::{Msg, SlotAction, SlotDone, SlotImage, SlotOp};
use crate::ServerState;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

const MAGIC: &[u8; 8] = b"GDSSLOT\0";
const VERSION: u32 = 1;
/// Most bytes of a file's JSON header.
const MAX_HEADER: usize = 64 << 10;
const HASH: usize = 32;

/// What a slot file says of the KV it holds.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Header {
    /// The saving server's `system_fingerprint` (model, build, backend, activations, KV type).
    fingerprint: String,
    /// The model's name as served (for people; not checked).
    model: String,
    /// `f16` or `f32`.
    dtype: String,
    /// Positions per block.
    block: usize,
    /// Tokens saved (the last block may be partly filled).
    tokens: usize,
    /// Whether each block holds its window layers' rows too.
    windows: Vec<bool>,
}

/// `POST /slots/{id}?action=...`.
pub async fn action(
    State(st): State<Arc<ServerState>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    match run(&st, &id, q.get("action").map(String::as_str), &body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn run(
    st: &Arc<ServerState>,
    id: &str,
    action: Option<&str>,
    body: &[u8],
) -> Result<Value, ApiError> {
    let Some(dir) = st.slot_save_path.clone() else {
        return Err(ApiError::status(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "This server does not support slots action. Start it with `--slot-save-path`",
        ));
    };
    let id: usize = id
        .parse()
        .ok()
        .filter(|&i| i < st.max_batch)
        .ok_or_else(|| {
            ApiError::bad(format!(
                "Invalid slot ID {id:?}: this server's slots are 0..={}",
                st.max_batch.saturating_sub(1)
            ))
            .param("id_slot")
        })?;
    let t0 = Instant::now();
    match action {
        Some("save") => {
            let name = filename(body)?;
            let img = match engine(st, id, SlotAction::Save).await? {
                SlotDone::Saved(img) => img,
                other => return Err(unexpected(other)),
            };
            let n = img.tokens.len();
            let header = Header {
                fingerprint: st.fingerprint.clone(),
                model: st.model_name().to_string(),
                dtype: st.kv_dtype.name().to_string(),
                block: st.kv_block,
                tokens: n,
                windows: img.windows.clone(),
            };
            let path = dir.join(&name);
            let written = tokio::task::spawn_blocking(move || write(&path, &header, &img))
                .await
                .map_err(|e| ApiError::server(format!("saving the slot: {e}")))?
                .map_err(|e| ApiError::server(format!("Unable to save slot to {name}: {e}")))?;
            Ok(json!({
                "id_slot": id, "filename": name, "n_saved": n, "n_written": written,
                "timings": {"save_ms": ms(t0)},
            }))
        }
        Some("restore") => {
            let name = filename(body)?;
            let path = dir.join(&name);
            let limits = Limits {
                fingerprint: st.fingerprint.clone(),
                dtype: st.kv_dtype.name().to_string(),
                block: st.kv_block,
                ctx: st.ctx,
                vocab: st.vocab,
                block_image: st.block_image,
            };
            let (img, read) = tokio::task::spawn_blocking(move || read(&path, &limits))
                .await
                .map_err(|e| ApiError::server(format!("reading the slot file: {e}")))?
                .map_err(|e| {
                    ApiError::bad(format!("Unable to restore slot: {name}: {e}")).param("filename")
                })?;
            let n = match engine(st, id, SlotAction::Restore(img)).await? {
                SlotDone::Restored(n) => n,
                other => return Err(unexpected(other)),
            };
            Ok(json!({
                "id_slot": id, "filename": name, "n_restored": n, "n_read": read,
                "timings": {"restore_ms": ms(t0)},
            }))
        }
        Some("erase") => match engine(st, id, SlotAction::Erase).await? {
            SlotDone::Erased(n) => Ok(json!({"id_slot": id, "n_erased": n})),
            other => Err(unexpected(other)),
        },
        _ => Err(ApiError::bad(format!(
            "Invalid action {:?}: save, restore or erase",
            action.unwrap_or("")
        ))
        .param("action")),
    }
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

fn unexpected(d: SlotDone) -> ApiError {
    ApiError::server(format!("the engine answered {d:?}"))
}

/// Hands the action to the engine and waits for its answer.
async fn engine(st: &ServerState, id: usize, action: SlotAction) -> Result<SlotDone, ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    st.engine
        .send(Msg::Slot(SlotOp {
            id,
            action,
            reply: tx,
        }))
        .map_err(|_| ApiError::engine_stopped())?;
    rx.await
        .map_err(|_| ApiError::engine_stopped())?
        .map_err(|e| ApiError::bad(format!("slot {id}: {e}")))
}

/// The request's `filename`: a plain file name in the save directory (no path, not
/// hidden, no control characters), as llama-server's check.
fn filename(body: &[u8]) -> Result<String, ApiError> {
    #[derive(Deserialize)]
    struct Body {
        filename: Option<Value>,
    }
    let b: Body = crate::api::parse(body)?;
    let Some(Value::String(name)) = b.filename else {
        return Err(ApiError::bad("filename (a string) is required").param("filename"));
    };
    let ok = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name.trim() == name
        && !name
            .chars()
            .any(|c| c.is_control() || matches!(c, '/' | '\\' | ':'));
    if !ok {
        return Err(ApiError::bad(format!(
            "Invalid filename {name:?}: a plain file name (no directories, not starting with a dot)"
        ))
        .param("filename"));
    }
    Ok(name)
}

/// Writes `img` to `path` under a temporary name first, then renames it: bytes written.
fn write(path: &std::path::Path, header: &Header, img: &SlotImage) -> std::io::Result<u64> {
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    let mut b = tempfile::Builder::new();
    b.prefix(".slot-").suffix(".tmp");
    // (a file as any other the server's user makes: the umask decides, not tempfile's 0600)
    #[cfg(unix)]
    b.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let mut tmp = b.tempfile_in(dir)?;
    let head = serde_json::to_vec(header)?;
    let mut h = blake3::Hasher::new();
    let mut n = 0u64;
    {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, tmp.as_file_mut());
        let mut put = |b: &[u8]| -> std::io::Result<()> {
            h.update(b);
            n += b.len() as u64;
            out.write_all(b)
        };
        put(MAGIC)?;
        put(&VERSION.to_le_bytes())?;
        put(&(head.len() as u32).to_le_bytes())?;
        put(&head)?;
        let tokens: Vec<u8> = img.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        put(&tokens)?;
        put(&img.data)?;
        out.write_all(h.finalize().as_bytes())?;
        out.flush()?;
    }
    // (no fsync: a file a crash cut short fails its length or hash check on restore, and
    // saving stays a page-cache write, as llama-server's)
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(n + HASH as u64)
}

/// What a slot file must agree with to be restored here.
struct Limits {
    fingerprint: String,
    dtype: String,
    block: usize,
    ctx: usize,
    vocab: usize,
    /// Bytes of one block's image without and with its window layers' rows.
    block_image: [usize; 2],
}

/// Reads and checks a slot file: the image and the bytes read. The header is read first and
/// decides how long the file must be (a file of another length is refused before its blocks
/// are read); the hash, over everything, is checked before the image is handed on.
fn read(path: &std::path::Path, lim: &Limits) -> Result<(SlotImage, u64), String> {
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let short = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "cut short".to_string(),
        _ => e.to_string(),
    };
    let mut h = blake3::Hasher::new();
    let mut head = [0u8; 16];
    f.read_exact(&mut head)
        .map_err(|_| "not a gdsrun slot file".to_string())?;
    if &head[..8] != MAGIC {
        return Err("not a gdsrun slot file".into());
    }
    h.update(&head);
    let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(format!("version {version}; this server reads {VERSION}"));
    }
    let hlen = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if hlen > MAX_HEADER || (16 + hlen) as u64 > len {
        return Err(format!("a header of {hlen} bytes in a file of {len}"));
    }
    let mut hbytes = vec![0u8; hlen];
    f.read_exact(&mut hbytes).map_err(short)?;
    h.update(&hbytes);
    let header: Header = serde_json::from_slice(&hbytes).map_err(|e| format!("its header: {e}"))?;
    if header.fingerprint != lim.fingerprint {
        return Err(format!(
            "saved by a server with system_fingerprint {} (model {:?}); this one is {}: the \
             model, the build, the backend, the activations or the KV type differ",
            header.fingerprint, header.model, lim.fingerprint
        ));
    }
    if header.dtype != lim.dtype || header.block != lim.block {
        return Err(format!(
            "KV blocks of {} positions in {}; this server's are {} in {}",
            header.block, header.dtype, lim.block, lim.dtype
        ));
    }
    let n_tokens = header.tokens;
    let blocks = header.windows.len();
    if n_tokens > blocks * lim.block || n_tokens + lim.block <= blocks * lim.block {
        return Err(format!(
            "{n_tokens} tokens in {blocks} blocks of {} positions",
            lim.block
        ));
    }
    if n_tokens > lim.ctx {
        return Err(format!(
            "{n_tokens} tokens, more than the context ({})",
            lim.ctx
        ));
    }
    let data_len: usize = header
        .windows
        .iter()
        .map(|&w| lim.block_image[usize::from(w)])
        .sum();
    let want = (16 + hlen + n_tokens * 4 + data_len + HASH) as u64;
    if len != want {
        return Err(format!(
            "{len} bytes where its header makes {want} (damaged or cut short)"
        ));
    }
    let mut toks = vec![0u8; n_tokens * 4];
    f.read_exact(&mut toks).map_err(short)?;
    h.update(&toks);
    let mut data = Vec::new();
    data.try_reserve_exact(data_len)
        .map_err(|e| format!("{data_len} bytes: {e}"))?;
    (&mut f)
        .take(data_len as u64)
        .read_to_end(&mut data)
        .map_err(|e| e.to_string())?;
    if data.len() != data_len {
        return Err("cut short".into());
    }
    h.update(&data);
    let mut hash = [0u8; HASH];
    f.read_exact(&mut hash).map_err(short)?;
    if h.finalize().as_bytes() != &hash {
        return Err("its hash does not match its contents (damaged)".into());
    }
    let tokens: Vec<u32> = toks
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= lim.vocab) {
        return Err(format!(
            "token {t} is outside the vocabulary ({})",
            lim.vocab
        ));
    }
    Ok((
        SlotImage {
            tokens,
            windows: header.windows,
            data,
        },
        len,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            fingerprint: "fp_x".into(),
            dtype: "f16".into(),
            block: 4,
            ctx: 64,
            vocab: 100,
            block_image: [8, 12],
        }
    }

    fn image(blocks: usize) -> SlotImage {
        SlotImage {
            tokens: (0..blocks as u32 * 4).collect(),
            windows: vec![false; blocks],
            data: (0..blocks * 8).map(|i| i as u8).collect(),
        }
    }

    fn header(windows: Vec<bool>) -> Header {
        Header {
            fingerprint: "fp_x".into(),
            model: "m".into(),
            dtype: "f16".into(),
            block: 4,
            tokens: windows.len() * 4,
            windows,
        }
    }

    #[test]
    fn a_written_file_reads_back_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        let img = image(3);
        let n = write(&path, &header(img.windows.clone()), &img).unwrap();
        assert_eq!(n, std::fs::metadata(&path).unwrap().len());
        // no temporary file left beside it
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let (back, read_n) = read(&path, &limits()).unwrap();
        assert_eq!(read_n, n);
        assert_eq!(
            (back.tokens, back.windows, back.data),
            (img.tokens, img.windows, img.data)
        );

        let good = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8], lim: &Limits| {
            std::fs::write(&path, bytes).unwrap();
            read(&path, lim).unwrap_err()
        };
        // a flipped byte, a cut, another format, an empty file
        let mut flipped = good.clone();
        let at = good.len() - 40;
        flipped[at] ^= 1;
        assert!(refused(&flipped, &limits()).contains("hash"));
        assert!(refused(&good[..good.len() - 1], &limits()).contains("cut short"));
        let mut longer = good.clone();
        longer.push(0);
        assert!(refused(&longer, &limits()).contains("header makes"));
        assert!(refused(
            b"GGUF and more bytes than sixteen, then a hash of 32 bytes",
            &limits()
        )
        .contains("not a gdsrun slot file"));
        assert!(refused(b"", &limits()).contains("not a gdsrun slot file"));
        // another server's
        let other = Limits {
            fingerprint: "fp_y".into(),
            ..limits()
        };
        assert!(refused(&good, &other).contains("system_fingerprint"));
        let blocks = Limits {
            block: 8,
            ..limits()
        };
        assert!(refused(&good, &blocks).contains("positions"));
        // a context that cannot hold it: refused by its size before it is read
        let small = Limits { ctx: 4, ..limits() };
        assert!(refused(&good, &small).contains("more than"));
        // tokens outside the vocabulary
        let words = Limits {
            vocab: 5,
            ..limits()
        };
        assert!(refused(&good, &words).contains("vocabulary"));
    }

    #[test]
    fn a_consistent_hash_over_lying_lengths_is_still_refused() {
        // a file whose hash is right but whose header claims more blocks than it carries
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.bin");
        let img = SlotImage {
            tokens: (0..4).collect(),
            windows: vec![false; 1],
            data: vec![0; 8],
        };
        write(&path, &header(vec![false; 9]), &img).unwrap();
        assert!(read(&path, &limits()).unwrap_err().contains("header makes"));
        // a header length past the file
        let mut body = MAGIC.to_vec();
        body.extend(VERSION.to_le_bytes());
        body.extend(u32::MAX.to_le_bytes());
        body.extend(blake3::hash(&body).as_bytes());
        std::fs::write(&path, &body).unwrap();
        assert!(read(&path, &limits()).unwrap_err().contains("header"));
    }

    #[test]
    fn file_names_are_plain() {
        let f = |name: &str| filename(json!({"filename": name}).to_string().as_bytes());
        assert_eq!(f("slot1.bin").unwrap(), "slot1.bin");
        for bad in [
            "", "../x", "a/b", "..", ".", ".hidden", "a\\b", "c:x", " x", "a\nb",
        ] {
            assert!(f(bad).is_err(), "{bad:?}");
        }
        assert!(filename(b"{}").is_err());
        assert!(filename(br#"{"filename": 3}"#).is_err());
        assert!(f(&"x".repeat(256)).is_err());
    }
}
