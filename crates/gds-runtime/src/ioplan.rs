//! The I/O part of the run plan: which backend reads the weights, which layers stay
//! resident, which stream every token, and in what buffers — all decided before the run.
//!
//! `--mem-budget` bounds the bytes of weights held in memory, streaming buffers included.
//! With `--io auto` a model that fits (or no budget) is memory-mapped; otherwise the
//! `direct` backend streams. Streaming keeps two buffers (double buffering: the I/O thread
//! fills one while the compute uses the other), each as large as the largest block layer;
//! what the budget leaves after them holds layers resident, chosen to keep the most bytes
//! off the per-token stream. The output head, when it is not resident, streams in row
//! chunks that fit a buffer; the embedding table is never streamed, only the rows of the
//! batch's tokens are read.
//!
//! A mixture of experts streams its experts apart ([`ExpertPlan`]): a streamed block reads
//! its attention, norms and router through the buffers, then only the experts its tokens
//! were routed to, into a cache of the most recently used ones that the budget sizes.

use crate::error::{Result, RuntimeError};
use gds_format::Manifest;
use gds_io::{align_up, DirectSupport};
use serde::Serialize;
use std::path::Path;

/// Extra bytes per streaming buffer so an unaligned span still fits once its ends are
/// rounded out to 4 KiB.
const SLOT_SLACK: u64 = 2 * gds_io::ALIGN as u64;
/// Streaming buffers: one being computed on, one being filled.
pub const STREAM_SLOTS: usize = 2;

/// The output head's matrix and how it is read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HeadPlan {
    /// Layer file holding it.
    pub layer: usize,
    /// Byte offset of the matrix in that file.
    pub offset: u64,
    /// Rows (vocabulary size).
    pub rows: usize,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Streamed in chunks of this many rows (0 when resident).
    pub chunk_rows: usize,
}

/// How layer files are read. (Serialized as `mmap` / `direct` / `buffered`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// The whole model memory-mapped.
    Mmap,
    /// The whole model read at open into private memory backed by transparent huge pages
    /// (through the page cache, whose pages stay cached for the next run).
    Load,
    /// Layers read with `O_DIRECT` into aligned buffers.
    Direct,
    /// Direct was chosen but `O_DIRECT` does not work on the model's filesystem: reads go
    /// through the page cache, whose pages are dropped after each read.
    Buffered,
}

impl IoMode {
    /// The lower-case name (`mmap`, `direct`, `buffered`), as the plan's JSON writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            IoMode::Mmap => "mmap",
            IoMode::Load => "load",
            IoMode::Direct => "direct",
            IoMode::Buffered => "buffered",
        }
    }
}

impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the weights get into memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IoPlan {
    /// How the layer files are read.
    pub mode: IoMode,
    /// Why this mode.
    pub reason: String,
    /// The memory budget for weights, bytes (`None`: unbounded).
    pub budget_bytes: Option<u64>,
    /// Bytes of all layer files.
    pub weight_bytes: u64,
    /// Layers read once and kept (all of them for `mmap`).
    pub resident_layers: Vec<usize>,
    /// Block layers read again for every forward pass.
    pub streamed_layers: Vec<usize>,
    /// The output head.
    pub head: HeadPlan,
    /// Layer holding the token embeddings (rows read on demand when not resident).
    pub embd_layer: usize,
    /// Streaming buffers.
    pub slots: usize,
    /// Bytes of each streaming buffer.
    pub slot_bytes: u64,
    /// Resident bytes plus streaming buffers: what the budget bounds.
    pub held_bytes: u64,
    /// Bytes read from disk per decoded token (0 when everything is resident).
    pub streamed_bytes_per_token: u64,
    /// The smallest budget that can stream this model.
    pub min_budget_bytes: u64,
    /// Layer files are hashed (BLAKE3) before first use, unless a per-user cache records
    /// the very same file as verified; `false` with `--no-verify`.
    pub verify: bool,
    /// A mixture of experts' streamed blocks read their experts apart (`None`: streamed
    /// blocks are read whole).
    pub experts: Option<ExpertPlan>,
}

/// How the experts of streamed mixture-of-experts blocks are read: after the router has
/// chosen, only the chosen experts' rows of the three expert matrices, several reads side by
/// side, into a cache that keeps the most recently used experts (RAM as a cache over the
/// layer files, as the resident layers are).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertPlan {
    /// Experts per block.
    pub n_expert: usize,
    /// Experts a token is routed to.
    pub n_expert_used: usize,
    /// Memory one expert takes in the cache: its rows of the gate, up and down matrices,
    /// each read as whole 4 KiB blocks (the largest over the blocks).
    pub expert_bytes: u64,
    /// Experts the cache holds: `n_expert_used` at least (one token's), plus what the
    /// budget leaves after the resident layers.
    pub cache_experts: usize,
    /// Per layer, the bytes a streamed block reads through the streaming buffers: its
    /// tensors before the first expert matrix (0: not a block with experts).
    #[serde(skip)]
    pub dense_bytes: Vec<u64>,
}

impl IoPlan {
    /// True when `layer` stays resident.
    pub fn is_resident(&self, layer: usize) -> bool {
        self.resident_layers.contains(&layer)
    }

    /// Bytes of layer `layer` (of `size` bytes) that a forward pass streams: its tensors
    /// before the experts when they stream apart, else the whole file.
    pub fn stream_len(&self, layer: usize, size: u64) -> u64 {
        dense_or_whole(
            self.experts.as_ref().map(|x| &x.dense_bytes[..]),
            layer,
            size,
        )
    }
}

/// The bytes of layer `layer` (of `size`) a pass streams: `dense[layer]`, its tensors before
/// the experts, when the experts stream apart (`dense` given) and the layer has some, else
/// the whole file.
fn dense_or_whole(dense: Option<&[u64]>, layer: usize, size: u64) -> u64 {
    match dense.and_then(|d| d.get(layer)) {
        Some(&d) if d > 0 => d,
        _ => size,
    }
}

/// Parses a size such as `200MB`, `1.5GiB`, `512k` or `1048576` (bytes). Decimal units
/// (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB; or K, M, G, T)
/// powers of 1024.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("{s:?} is not a size (examples: 200MB, 1.5GiB, 4096)");
    let x: f64 = num.parse().map_err(|_| not_a_size())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        u => {
            return Err(format!(
                "{s:?}: unknown unit {u:?} (use B, kB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let too_large = || format!("{s:?} is too large a size (at most {} bytes)", u64::MAX);
    // a whole number is taken exactly (a float has 53 bits: 2^64 would round to u64::MAX);
    // a fraction through f64, refused from 2^64 up (`as u64` would saturate)
    let v = if num.bytes().all(|b| b.is_ascii_digit()) {
        num.parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .ok_or_else(too_large)?
    } else {
        let v = x * mult as f64;
        if !v.is_finite() || v >= u64::MAX as f64 {
            return Err(too_large());
        }
        v as u64
    };
    if v < 1 {
        return Err(format!("{s:?} is not a usable size (at least 1 byte)"));
    }
    Ok(v)
}

/// A size for messages: bytes under 1 MiB (a budget of 1 byte is not "0.0 MiB"), MiB above.
pub(crate) fn mib(b: u64) -> String {
    if b == 1 {
        "1 byte".into()
    } else if b < 1 << 20 {
        format!("{b} bytes")
    } else {
        format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
    }
}

struct Layers {
    sizes: Vec<u64>,
    names: Vec<String>,
    blocks: Vec<usize>,
    head: HeadPlan,
    head_bytes: u64,
    embd_layer: usize,
    embd_row_bytes: u64,
    experts: Option<ExpertLayout>,
}

/// Where a mixture of experts' expert matrices lie in the block files.
struct ExpertLayout {
    n_expert: usize,
    n_expert_used: usize,
    /// See [`ExpertPlan::expert_bytes`].
    expert_bytes: u64,
    /// Per layer: the end of its tensors before the first expert matrix, when every expert
    /// matrix follows all the other tensors (0: no experts in the layer).
    dense_bytes: Vec<u64>,
    /// Blocks whose expert matrices lie among the other tensors (an older conversion).
    interleaved: usize,
}

/// The expert matrices of the manifest's blocks, or `None` for a model without experts (or
/// whose expert matrices do not agree on the experts: a manifest validation refuses).
fn experts_of(m: &Manifest<'_>, n_layers: usize) -> Option<ExpertLayout> {
    let used = match m.get("model.n_expert_used") {
        Some(gds_format::Value::U64(k)) if k >= 1 => k,
        _ => return None,
    };
    // an expert matrix: offset, bytes, experts
    type Matrix = (u64, u64, u64);
    // per layer: its expert matrices, the end of its other tensors
    let mut per: Vec<(Vec<Matrix>, u64)> = vec![(Vec::new(), 0); n_layers];
    for t in m.tensors() {
        let Some((mats, other_end)) = per.get_mut(t.layer) else {
            continue;
        };
        if gds_format::arch::is_routed_expert(t.name) {
            mats.push((
                t.offset,
                t.nbytes,
                t.dims().first().copied().unwrap_or(1).max(1),
            ));
        } else {
            *other_end = (*other_end).max(t.offset.saturating_add(t.nbytes));
        }
    }
    let mut n_expert = 0;
    let mut expert_bytes = 0;
    let mut interleaved = 0;
    let mut dense_bytes = vec![0; n_layers];
    for (l, (mats, other_end)) in per.iter().enumerate() {
        let Some(first) = mats.iter().map(|x| x.0).min() else {
            continue;
        };
        if first < *other_end {
            interleaved += 1;
            continue;
        }
        dense_bytes[l] = *other_end;
        let n = mats[0].2;
        let agree = |&(_, nbytes, k): &Matrix| k == n && nbytes % n == 0;
        if n > gds_format::arch::MAX_EXPERTS || used > n || !mats.iter().all(agree) {
            return None;
        }
        n_expert = n_expert.max(n as usize);
        // the largest memory any expert of this block takes: each matrix's rows of it read
        // as whole 4 KiB blocks
        let of = |x: u64| -> u64 {
            mats.iter()
                .map(|&(offset, nbytes, n)| {
                    let len = nbytes / n;
                    let at = offset.saturating_add(x * len);
                    align_up(at.saturating_add(len)).saturating_sub(gds_io::align_down(at))
                })
                .sum()
        };
        expert_bytes = (0..n).map(of).fold(expert_bytes, u64::max);
    }
    (n_expert > 0 || interleaved > 0).then_some(ExpertLayout {
        n_expert,
        n_expert_used: used as usize,
        expert_bytes,
        dense_bytes,
        interleaved,
    })
}

fn layers_of(m: &Manifest<'_>) -> Result<Layers> {
    let bad = |why: String| RuntimeError::Model(format!("cannot plan I/O: {why}"));
    let mut sizes = Vec::new();
    let mut names = Vec::new();
    for i in 0..m.n_layers() {
        let l = m.layer(i).map_err(|e| bad(e.to_string()))?;
        sizes.push(l.file_size);
        names.push(l.file.to_string());
    }
    let mut blocks: Vec<usize> = m
        .tensors()
        .filter(|t| t.name.starts_with("blk."))
        .map(|t| t.layer)
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    let embd = m
        .find_tensor("token_embd.weight")
        .ok_or_else(|| bad("token_embd.weight is missing".into()))?;
    let out = m.find_tensor("output.weight").unwrap_or(embd);
    let (rows, cols) = match out.dims() {
        [r, c] => (*r as usize, *c),
        d => return Err(bad(format!("{} has shape {d:?}", out.name))),
    };
    let row_bytes = out
        .dtype
        .tensor_bytes(&[1, cols])
        .ok_or_else(|| bad(format!("{} rows do not fit {}", out.name, out.dtype)))?;
    let embd_row_bytes = match embd.dims() {
        [_, c] => embd.dtype.tensor_bytes(&[1, *c]).unwrap_or(0),
        _ => 0,
    };
    Ok(Layers {
        sizes,
        names,
        blocks,
        head: HeadPlan {
            layer: out.layer,
            offset: out.offset,
            rows,
            row_bytes,
            chunk_rows: 0,
        },
        head_bytes: out.nbytes,
        embd_layer: embd.layer,
        embd_row_bytes,
        experts: experts_of(m, m.n_layers()),
    })
}

/// Decides the I/O plan. `io` is `auto`, `mmap` or `direct`; `budget` bounds resident
/// weight bytes; `direct` says whether the model's filesystem supports `O_DIRECT`.
pub fn plan_io(
    dir: &Path,
    m: &Manifest<'_>,
    io: &str,
    budget: Option<u64>,
    direct: impl FnOnce() -> DirectSupport,
) -> Result<IoPlan> {
    plan_io_keeping(dir, m, io, budget, 0, direct)
}

/// [`plan_io`], with the output head and the first `keep_blocks` blocks resident whatever
/// else streams (self-speculation drafts with them: `--draft layers:N`); a budget that
/// cannot hold them beside the streaming buffers is refused with the one that can.
pub fn plan_io_keeping(
    dir: &Path,
    m: &Manifest<'_>,
    io: &str,
    budget: Option<u64>,
    keep_blocks: usize,
    direct: impl FnOnce() -> DirectSupport,
) -> Result<IoPlan> {
    let plan_err = |s: String| Err(RuntimeError::Usage(s));
    let l = layers_of(m)?;
    let weight_bytes: u64 = l.sizes.iter().sum();
    let all: Vec<usize> = (0..l.sizes.len()).collect();
    // experts stream apart when every block with experts has them after its other tensors
    let experts = l.experts.as_ref().filter(|x| x.interleaved == 0);
    // what a streamed block reads through the buffers: the whole file, or the part before
    // its experts
    let stream_len = |b: usize| dense_or_whole(experts.map(|x| &x.dense_bytes[..]), b, l.sizes[b]);
    // streaming buffers: the largest streamed block span (or one head row, if larger)
    let (largest_name, largest) = match l.blocks.iter().max_by_key(|&&b| stream_len(b)) {
        Some(&b) if stream_len(b) >= l.head.row_bytes => {
            let what = if stream_len(b) < l.sizes[b] {
                format!("the tensors before the experts of {}", l.names[b])
            } else {
                l.names[b].clone()
            };
            (what, stream_len(b))
        }
        _ => (
            "one row of the output head".into(),
            align_up(l.head.row_bytes),
        ),
    };
    let slot_bytes = largest + SLOT_SLACK;
    // a mixture of experts also holds one token's experts at least
    let min_cache = experts.map_or(0, |x| x.n_expert_used as u64 * x.expert_bytes);
    let min_budget = STREAM_SLOTS as u64 * slot_bytes + min_cache;
    let mut p = IoPlan {
        mode: IoMode::Mmap,
        reason: String::new(),
        budget_bytes: budget,
        weight_bytes,
        resident_layers: all.clone(),
        streamed_layers: vec![],
        head: l.head.clone(),
        embd_layer: l.embd_layer,
        slots: 0,
        slot_bytes: 0,
        held_bytes: weight_bytes,
        streamed_bytes_per_token: 0,
        min_budget_bytes: min_budget,
        verify: true,
        experts: None,
    };
    let fits = budget.is_none_or(|b| b >= weight_bytes);
    let within = || match budget {
        None => "no --mem-budget".to_string(),
        Some(b) => format!("it fits --mem-budget {}", mib(b)),
    };
    match io {
        "load" | "mmap" => {
            let (verb, mode, reason) = if io == "load" {
                (
                    "reads the whole model into memory",
                    IoMode::Load,
                    "requested with --io load: the whole model read into memory backed by huge pages",
                )
            } else {
                (
                    "maps the whole model",
                    IoMode::Mmap,
                    "requested with --io mmap",
                )
            };
            if !fits {
                return plan_err(format!(
                    "--io {io} {verb} ({}), more than --mem-budget {}; use --io direct (or auto) to stream layers",
                    mib(weight_bytes),
                    mib(budget.unwrap_or(0))
                ));
            }
            p.mode = mode;
            p.reason = reason.into();
            return Ok(p);
        }
        "auto" if fits && gds_io::huge_pages_available() => {
            p.mode = IoMode::Load;
            p.reason = format!(
                "auto: the model ({}) is held whole ({}): read into memory backed by transparent huge pages, \
                 one TLB entry per 2 MiB of weights (faster decode than mapping the files: docs/streaming.md); \
                 --io mmap maps the files instead",
                mib(weight_bytes),
                within()
            );
            return Ok(p);
        }
        "auto" if fits => {
            p.reason = format!(
                "auto: the model ({}) is held whole ({}) and this kernel has no transparent huge pages, so it is mapped",
                mib(weight_bytes),
                within()
            );
            return Ok(p);
        }
        "auto" | "direct" => {}
        other => return plan_err(format!("--io {other}: expected auto, mmap, load or direct")),
    }
    // direct (requested, or auto with a budget smaller than the model)
    p.mode = IoMode::Direct;
    p.reason = if io == "auto" {
        format!(
            "auto: the model ({}) is larger than --mem-budget {}, layers stream with O_DIRECT",
            mib(weight_bytes),
            mib(budget.unwrap_or(0))
        )
    } else {
        "requested with --io direct".into()
    };
    if let DirectSupport::Buffered(why) = direct() {
        p.mode = IoMode::Buffered;
        p.reason += &format!(
            "; {}: {why}, so reads go through the page cache and their pages are dropped after each read",
            dir.display()
        );
    }
    if fits {
        // every layer read once, nothing streams
        return Ok(p);
    }
    let b = budget.unwrap_or(weight_bytes);
    if b < min_budget {
        let experts = match experts {
            Some(x) => format!(
                " and {} for one token's {} experts",
                mib(min_cache),
                x.n_expert_used
            ),
            None => String::new(),
        };
        return plan_err(format!(
            "--mem-budget {} is below the minimum working set for streaming: {} = {} streaming buffers of {} (the largest layer, {largest_name}, plus alignment slack){experts}. The KV cache and activations are not part of the budget.",
            mib(b),
            mib(min_budget),
            STREAM_SLOTS,
            mib(slot_bytes)
        ));
    }
    let room = b - min_budget;
    // what must stay: the head layer and the first `keep_blocks` blocks
    let mut kept_first: Vec<usize> = Vec::new();
    if keep_blocks > 0 {
        kept_first.push(l.head.layer);
        for &blk in l.blocks.iter().take(keep_blocks) {
            if !kept_first.contains(&blk) {
                kept_first.push(blk);
            }
        }
    }
    let must: u64 = kept_first.iter().map(|&x| l.sizes[x]).sum();
    if must > room {
        return plan_err(format!(
            "--mem-budget {}: the draft's {keep_blocks} blocks and the output head stay in memory ({}) beside {} streaming buffers of {}; the smallest budget for this draft is {}",
            mib(b),
            mib(must),
            STREAM_SLOTS,
            mib(slot_bytes),
            mib(min_budget + must)
        ));
    }
    // a streamed block with experts reads one token's experts besides its span (fewer
    // when the cache has them)
    let token_experts = |b: usize| match experts {
        Some(x) if stream_len(b) < l.sizes[b] => x.n_expert_used as u64 * x.expert_bytes,
        _ => 0,
    };
    // what keeping a block resident saves a pass: its streamed bytes (with its experts
    // apart, far less than its size)
    let saves = |b: usize| stream_len(b) + token_experts(b);
    // Fill the room with resident layers, most bytes kept off the stream: blocks in order,
    // with or without the head layer (whichever saves more). Returns the layers, the
    // bytes they hold and the bytes they keep off each pass.
    let pack = |with_head: bool| -> (Vec<usize>, u64, u64) {
        let mut left = room - must;
        let mut res = kept_first.clone();
        let mut saved: u64 = res.iter().map(|&x| l.sizes[x]).sum();
        if with_head && !res.contains(&l.head.layer) {
            if l.sizes[l.head.layer] > left {
                return (vec![], 0, 0);
            }
            left -= l.sizes[l.head.layer];
            saved += l.sizes[l.head.layer];
            res.push(l.head.layer);
        }
        for &blk in &l.blocks {
            if l.sizes[blk] <= left && !res.contains(&blk) {
                left -= l.sizes[blk];
                saved += saves(blk);
                res.push(blk);
            }
        }
        (res, room - left, saved)
    };
    let (a, b_) = (pack(true), pack(false));
    // (with blocks to keep, the head is among them and both packs are the same)
    let (mut resident, kept, _) = if a.2 > b_.2 { a } else { b_ };
    resident.sort_unstable();
    p.streamed_layers = l
        .blocks
        .iter()
        .copied()
        .filter(|x| !resident.contains(x))
        .collect();
    let head_resident = resident.contains(&l.head.layer);
    if !head_resident {
        p.head.chunk_rows = ((largest / l.head.row_bytes) as usize).clamp(1, l.head.rows);
    }
    let embd_resident = resident.contains(&l.embd_layer);
    p.streamed_bytes_per_token = p
        .streamed_layers
        .iter()
        .map(|&x| stream_len(x) + token_experts(x))
        .sum::<u64>()
        + if head_resident { 0 } else { l.head_bytes }
        + if embd_resident {
            0
        } else {
            align_up(l.embd_row_bytes)
        };
    p.held_bytes = kept + min_budget;
    match (experts, &l.experts) {
        (Some(x), _) if p.streamed_layers.iter().any(|&b| token_experts(b) > 0) => {
            // what the resident layers leave of the room caches more experts
            let more = ((room - kept) / x.expert_bytes) as usize;
            let cache_experts = x.n_expert_used + more;
            p.held_bytes += more as u64 * x.expert_bytes;
            p.reason += &format!(
                "; streamed blocks read their attention and router, then only the {} of {} experts each token is routed to ({} an expert), into a cache of the {cache_experts} most recently used",
                x.n_expert_used,
                x.n_expert,
                mib(x.expert_bytes)
            );
            p.experts = Some(ExpertPlan {
                n_expert: x.n_expert,
                n_expert_used: x.n_expert_used,
                expert_bytes: x.expert_bytes,
                cache_experts,
                dense_bytes: x.dense_bytes.clone(),
            });
        }
        (None, Some(x)) => {
            p.reason += &format!(
                "; {} blocks of this conversion have their experts among their other tensors, so a streamed block is read whole, every expert (converted again by this gdsconv, a block's experts come last and stream apart: only those a token is routed to are read)",
                x.interleaved
            );
        }
        _ => {}
    }
    p.resident_layers = resident;
    p.slots = STREAM_SLOTS;
    p.slot_bytes = slot_bytes;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_decimal_and_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("200MB"), Ok(200_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("64m"), Ok(64 << 20));
        assert_eq!(parse_size(" 2 KiB "), Ok(2048));
        for bad in ["", "MB", "-5MB", "1.2.3GB", "10 parsecs", "0", "0.4"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_past_u64_max_are_refused_not_saturated() {
        // the largest size exactly; past it refused (2^64 was taken as 2^64 - 1)
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        for over in [
            "18446744073709551616",
            "99999999999999999999999",
            "18446744073709551616.0",
            "16777216TiB",
            "16777216.5TiB",
        ] {
            let e = parse_size(over).unwrap_err();
            assert!(e.contains("too large"), "{over}: {e}");
        }
    }

    #[test]
    fn sizes_under_a_mib_are_said_in_bytes() {
        // `--mem-budget 1` and `1.5` were reported as "--mem-budget 0.0 MiB"
        assert_eq!(parse_size("1.5"), Ok(1));
        assert_eq!(mib(1), "1 byte");
        assert_eq!(mib(1536), "1536 bytes");
        assert_eq!(mib(3 << 20), "3.0 MiB");
    }

    /// A manifest of a 2-block mixture of experts (8 experts of 4096-byte F32 matrices,
    /// 2 per token): each block a 4096-byte attention matrix, a router, and the three expert
    /// matrices, `experts_last` or between the attention and the router; no files behind it.
    fn moe_manifest(experts_last: bool, used: u64) -> Vec<u8> {
        use gds_format::{layer_kind, DType, LayerRecord, ManifestBuilder, TensorSpec};
        let spec = |name: String, shape: Vec<u64>| TensorSpec {
            name,
            dtype: DType::F32,
            shape,
        };
        let mut b = ManifestBuilder::new();
        b.kv_str("general.architecture", "qwen3moe");
        b.kv_u64("model.n_expert", 8)
            .kv_u64("model.n_expert_used", used);
        let mut add = |name: &str, kind: u32, index: u32, tensors: Vec<TensorSpec>| {
            let layout = gds_format::layout(&tensors).unwrap();
            b.add_layer(&LayerRecord {
                name: name.into(),
                file: format!("{name}.bin"),
                kind,
                index,
                tensors,
                layout,
                content_hash: [0; 32],
            });
        };
        add(
            "embd",
            layer_kind::EMBED,
            0,
            vec![spec("token_embd.weight".into(), vec![64, 64])],
        );
        for blk in 0..2u32 {
            let mut ts = vec![spec(format!("blk.{blk}.attn_q.weight"), vec![16, 64])];
            let experts = ["down", "gate", "up"]
                .map(|r| spec(format!("blk.{blk}.ffn_{r}_exps.weight"), vec![8, 16, 64]));
            let router = spec(format!("blk.{blk}.ffn_gate_inp.weight"), vec![8, 64]);
            if experts_last {
                ts.push(router);
                ts.extend(experts);
            } else {
                ts.extend(experts);
                ts.push(router);
            }
            add(&format!("blk{blk}"), layer_kind::BLOCK, blk, ts);
        }
        add(
            "head",
            layer_kind::HEAD,
            0,
            vec![spec("output.weight".into(), vec![128, 64])],
        );
        b.finish()
    }

    /// Experts after the other tensors: a streamed block's span is its attention and router
    /// (two 4 KiB-aligned tensors), the buffers are that size, the minimum budget holds one
    /// token's experts (three 4 KiB matrices' rows each) besides them, and what the resident
    /// layers leave caches more. Experts among the other tensors: whole blocks stream,
    /// saying why.
    #[test]
    fn a_mixture_of_experts_streams_its_experts_apart_when_they_come_last() {
        // the plan of a manifest at a budget (no files behind it: nothing is opened)
        let plan_of = |bytes: &[u8], budget: u64| {
            let m = Manifest::parse(bytes).unwrap();
            plan_io(
                Path::new("/nonexistent"),
                &m,
                "direct",
                Some(budget),
                || DirectSupport::Direct,
            )
        };
        let bytes = moe_manifest(true, 2);
        let plan = |budget: u64| plan_of(&bytes, budget);
        let dense = 4096 + 2048;
        let expert = 3 * 4096;
        let min = 2 * (dense + SLOT_SLACK) + 2 * expert;
        let p = plan(min).unwrap();
        assert_eq!(
            (p.slot_bytes, p.min_budget_bytes),
            (dense + SLOT_SLACK, min)
        );
        assert_eq!(p.streamed_layers, vec![1, 2]);
        let x = p.experts.as_ref().unwrap();
        assert_eq!((x.n_expert, x.n_expert_used), (8, 2));
        assert_eq!((x.expert_bytes, x.cache_experts), (expert, 2));
        assert_eq!(p.stream_len(1, 1 << 20), dense);
        assert_eq!(p.stream_len(0, 1 << 20), 1 << 20);
        assert_eq!(
            p.streamed_bytes_per_token,
            2 * (dense + 2 * expert) + 32768 + 4096
        );
        let e = plan(min - 1).unwrap_err().to_string();
        assert!(e.contains("one token's 2 experts"), "{e}");
        // the room: the head (32 KiB) stays, the rest caches one expert more
        let p = plan(min + 32768 + expert + 100).unwrap();
        assert!(p.is_resident(3), "{p:?}");
        assert_eq!(p.experts.as_ref().unwrap().cache_experts, 3);
        assert_eq!(p.held_bytes, min + 32768 + expert);
        assert!(p
            .reason
            .contains("into a cache of the 3 most recently used"));
        // room for a whole block (104 KiB), which would keep more bytes than the head, but
        // streamed it costs a pass only its dense span and two experts (30 KiB): the head
        // (32 KiB a pass) stays, and the rest caches experts
        let block = 8192 + 3 * 8 * 4096;
        let p = plan(min + block + 100).unwrap();
        assert_eq!(p.resident_layers, vec![3], "{p:?}");
        assert_eq!(p.experts.as_ref().unwrap().cache_experts, 2 + 6);

        // more experts used than there are (a manifest that validation refuses): planned
        // without expert streaming, no panic
        let p = plan_of(&moe_manifest(true, 9), 240_000).unwrap();
        assert!(p.experts.is_none() && !p.reason.contains("expert"), "{p:?}");

        let p = plan_of(&moe_manifest(false, 2), 240_000).unwrap();
        assert!(p.experts.is_none());
        assert_eq!(p.slot_bytes, 8 * 4096 * 3 + 8192 + SLOT_SLACK);
        assert!(
            p.reason.contains("2 blocks of this conversion"),
            "{}",
            p.reason
        );
    }

    #[test]
    fn io_modes_serialize_as_their_names() {
        // the plan's JSON (`gdsrun --plan`) and the metrics' io_mode keep the strings
        // they had before the mode was an enum
        for (m, name) in [
            (IoMode::Mmap, "mmap"),
            (IoMode::Load, "load"),
            (IoMode::Direct, "direct"),
            (IoMode::Buffered, "buffered"),
        ] {
            assert_eq!(m.as_str(), name);
            assert_eq!(m.to_string(), name);
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{name}\""));
        }
    }
}
