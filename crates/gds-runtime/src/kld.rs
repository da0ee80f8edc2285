//! Logits files: `gdsrun perplexity --save-logits FILE` stores a base model's log-probabilities
//! at every scored position, `--kl-divergence FILE` compares another model (a quantization of
//! the same one) with them, as llama.cpp's `llama-perplexity --kl-divergence-base` /
//! `--kl-divergence` do. The format is our own (docs/running.md, "KL divergence"); all
//! numbers little-endian:
//!
//! ```text
//! header   magic "GDSLOGP\0" (8 bytes), version u32 (1), n_vocab u32, ctx u32,
//!          n_chunks u32, first u32 (first scored position, ctx/2),
//!          scored_per_chunk u32 (ctx - first - 1), n_tokens u64, tokens u32 × n_tokens
//! rows     n_chunks × scored_per_chunk of them, chunk by chunk, position by position:
//!          min f32, scale f32, top1 u32, target_logprob f32, q u16 × n_vocab
//! ```
//!
//! A row is the position's log-softmax quantized as llama.cpp stores it: the log-probability
//! of entry `i` is `min + scale * q[i]`, `scale = (max - min) / 65535` over the row's own
//! range, so an entry is off by at most half a step (`(max - min) / 131070`, about 2.5e-4
//! for a 33-nat range). `top1` is the row's argmax and `target_logprob` the exact
//! log-probability of the token the position predicts, so the base model's top-1 and
//! perplexity are exact. Files are written and read as streams: one row in memory.

use crate::error::{Result, RuntimeError};
use crate::perplexity::{log_sum_exp, ChunkPlan};
use serde::Serialize;
use std::io::{Read, Write};

/// The file's first bytes.
pub const MAGIC: [u8; 8] = *b"GDSLOGP\0";
/// Format version.
pub const VERSION: u32 = 1;
/// Bytes of a row before its `u16` entries (min, scale, top1, target_logprob).
pub const ROW_HEADER: usize = 16;
/// Bytes of the header before the token list.
const FIXED_HEADER: usize = 8 + 4 * 6 + 8;

/// What a logits file was made from: checked against the comparing run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogitsHeader {
    /// Vocabulary size (entries per row).
    pub n_vocab: usize,
    /// Chunk geometry of the run that wrote it.
    pub chunks: ChunkPlan,
    /// The tokenized text.
    pub tokens: Vec<u32>,
}

impl LogitsHeader {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        ROW_HEADER as u64 + 2 * self.n_vocab as u64
    }

    /// Bytes of the whole header.
    pub fn header_bytes(&self) -> u64 {
        FIXED_HEADER as u64 + 4 * self.tokens.len() as u64
    }

    /// Bytes of the whole file, `None` on overflow.
    fn file_bytes(&self) -> Option<u64> {
        (self.chunks.scored() as u64)
            .checked_mul(self.row_bytes())?
            .checked_add(self.header_bytes())
    }

    fn write(&self, w: &mut dyn Write) -> std::io::Result<()> {
        let c = &self.chunks;
        let mut b = Vec::with_capacity(self.header_bytes() as usize);
        b.extend_from_slice(&MAGIC);
        for v in [
            VERSION as usize,
            self.n_vocab,
            c.ctx,
            c.n_chunks,
            c.first,
            c.scored_per_chunk,
        ] {
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        b.extend_from_slice(&(self.tokens.len() as u64).to_le_bytes());
        for t in &self.tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        w.write_all(&b)
    }

    /// Reads and checks a header from a file of `file_len` bytes; `name` is the file's name
    /// for messages. Nothing is allocated beyond what the file's length can hold.
    fn read(r: &mut dyn Read, file_len: u64, name: &str) -> Result<LogitsHeader> {
        let bad = |m: String| RuntimeError::Perplexity(format!("{name}: {m}"));
        let mut fixed = [0u8; FIXED_HEADER];
        if file_len < FIXED_HEADER as u64 {
            return Err(bad(format!(
                "not a logits file of gdsrun perplexity --save-logits ({file_len} bytes, truncated or another format)"
            )));
        }
        read_exact(r, &mut fixed, name)?;
        if fixed[..8] != MAGIC {
            return Err(bad(
                "not a logits file of gdsrun perplexity --save-logits (wrong magic)".into(),
            ));
        }
        let u = |i: usize| u32::from_le_bytes(fixed[8 + 4 * i..12 + 4 * i].try_into().unwrap());
        let version = u(0);
        if version != VERSION {
            return Err(bad(format!(
                "logits file version {version}; this gdsrun reads version {VERSION}"
            )));
        }
        let (n_vocab, ctx, n_chunks, first, per_chunk) = (
            u(1) as usize,
            u(2) as usize,
            u(3) as usize,
            u(4) as usize,
            u(5) as usize,
        );
        let n_tokens = u64::from_le_bytes(fixed[32..40].try_into().unwrap());
        if n_tokens > (file_len - FIXED_HEADER as u64) / 4 {
            return Err(bad(format!(
                "truncated: the header lists {n_tokens} tokens but the file has {file_len} bytes"
            )));
        }
        let n_tokens = n_tokens as usize;
        // the geometry must be what ChunkPlan makes of (n_tokens, ctx), or its first
        // n_chunks (a run with --chunks)
        let chunks = ChunkPlan::new(n_tokens, ctx)
            .ok()
            .filter(|c| {
                n_vocab > 0
                    && (1..=c.n_chunks).contains(&n_chunks)
                    && c.first == first
                    && c.scored_per_chunk == per_chunk
            })
            .map(|c| c.limited(Some(n_chunks)));
        let Some(chunks) = chunks else {
            return Err(bad(format!(
                "corrupt header (vocabulary {n_vocab}, ctx {ctx}, {n_chunks} chunks, scored positions {first}+{per_chunk}, {n_tokens} tokens do not agree)"
            )));
        };
        let mut raw = vec![0u8; 4 * n_tokens];
        read_exact(r, &mut raw, name)?;
        let tokens = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let h = LogitsHeader {
            n_vocab,
            chunks,
            tokens,
        };
        match h.file_bytes() {
            Some(n) if n == file_len => Ok(h),
            Some(n) if n > file_len => Err(bad(format!(
                "truncated: {file_len} bytes, the header promises {n} ({} chunks of {} rows of {} bytes)",
                h.chunks.n_chunks,
                h.chunks.scored_per_chunk,
                h.row_bytes()
            ))),
            Some(n) => Err(bad(format!(
                "{file_len} bytes, the header promises {n}: trailing data, not a file --save-logits wrote"
            ))),
            None => Err(bad("corrupt header (sizes overflow)".into())),
        }
    }

    /// Checks that a run with this vocabulary, chunk geometry and tokens scores what the
    /// file holds; the error names `name` and the difference.
    pub fn check(
        &self,
        n_vocab: usize,
        chunks: &ChunkPlan,
        tokens: &[u32],
        name: &str,
    ) -> Result<()> {
        let bad = |m: String| Err(RuntimeError::Perplexity(format!("{name}: {m}")));
        if self.n_vocab != n_vocab {
            return bad(format!(
                "saved with a vocabulary of {} entries, this model has {n_vocab} (KL divergence needs the same tokenizer)",
                self.n_vocab
            ));
        }
        if self.chunks.ctx != chunks.ctx {
            return bad(format!(
                "saved with --ctx {}, this run uses --ctx {} (use the same --ctx)",
                self.chunks.ctx, chunks.ctx
            ));
        }
        if self.tokens != tokens {
            let at = self
                .tokens
                .iter()
                .zip(tokens)
                .position(|(a, b)| a != b)
                .unwrap_or(self.tokens.len().min(tokens.len()));
            return bad(format!(
                "saved from another text: {} tokens there, {} here, first difference at token {at} (score the same --file with the same tokenizer)",
                self.tokens.len(),
                tokens.len()
            ));
        }
        if self.chunks != *chunks {
            return bad(format!(
                "saved with {} chunks, this run has {}",
                self.chunks.n_chunks, chunks.n_chunks
            ));
        }
        Ok(())
    }
}

fn read_exact(r: &mut dyn Read, buf: &mut [u8], name: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            RuntimeError::Perplexity(format!("{name}: truncated (ends inside its data)"))
        } else {
            RuntimeError::file(name, e)
        }
    })
}

/// Index of the largest logit (the first of equals).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// Appends the row of `logits` (predicting `target`) to `out`: see the module's format.
/// Errors on non-finite logits.
pub fn encode_row(
    logits: &[f32],
    target: usize,
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !(lo.is_finite() && hi.is_finite()) || logits.iter().any(|v| v.is_nan()) {
        return Err("non-finite logits".into());
    }
    let lse = log_sum_exp(logits);
    let (lo, hi) = (lo as f64, hi as f64);
    let range = hi - lo;
    let scale = range / 65535.0;
    out.extend_from_slice(&((lo - lse) as f32).to_le_bytes());
    out.extend_from_slice(&(scale as f32).to_le_bytes());
    out.extend_from_slice(&(argmax(logits) as u32).to_le_bytes());
    out.extend_from_slice(&((logits[target] as f64 - lse) as f32).to_le_bytes());
    let k = if range > 0.0 { 65535.0 / range } else { 0.0 };
    for &v in logits {
        let q = ((v as f64 - lo) * k).round().clamp(0.0, 65535.0) as u16;
        out.extend_from_slice(&q.to_le_bytes());
    }
    Ok(())
}

/// What a row says besides its log-probabilities.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowInfo {
    /// The base model's argmax.
    pub top1: u32,
    /// The base model's log-probability of the target token.
    pub target_logprob: f64,
}

/// Decodes a row into `lp` (its log-probabilities, renormalized so that they sum to
/// probability 1 exactly in f64).
pub fn decode_row(row: &[u8], lp: &mut [f64]) -> std::result::Result<RowInfo, String> {
    let f = |i: usize| f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap());
    let (min, scale) = (f(0), f(1));
    let top1 = u32::from_le_bytes(row[8..12].try_into().unwrap());
    let target_logprob = f(3) as f64;
    if !(min.is_finite() && scale.is_finite() && scale >= 0.0 && min <= 0.0) {
        return Err(format!("row minimum {min} / scale {scale} out of range"));
    }
    if top1 as usize >= lp.len() {
        return Err(format!(
            "top-1 token {top1} past the vocabulary of {}",
            lp.len()
        ));
    }
    if !(target_logprob.is_finite() && target_logprob <= 1e-3) {
        return Err(format!(
            "target log-probability {target_logprob} out of range"
        ));
    }
    let (min, scale) = (min as f64, scale as f64);
    for (d, q) in lp.iter_mut().zip(row[ROW_HEADER..].chunks_exact(2)) {
        *d = min + scale * u16::from_le_bytes([q[0], q[1]]) as f64;
    }
    let max = lp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + lp.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
    for d in lp.iter_mut() {
        *d -= lse;
    }
    Ok(RowInfo {
        top1,
        target_logprob,
    })
}

/// KL(base ‖ this) of one position: `Σ p_base (log p_base − log p_this)`, with `base` the
/// base model's log-probabilities and `logits` this model's logits.
pub fn kl_row(base: &[f64], logits: &[f32]) -> f64 {
    let lse = log_sum_exp(logits);
    base.iter()
        .zip(logits)
        .map(|(&b, &l)| {
            let p = b.exp();
            if p == 0.0 {
                0.0
            } else {
                p * (b - (l as f64 - lse))
            }
        })
        .sum()
}

/// Streams rows out to `w` (a temporary file, renamed by the caller when all went well).
pub struct LogitsWriter<W: Write> {
    w: W,
    name: String,
    header: LogitsHeader,
    row: Vec<u8>,
    rows: usize,
}

impl<W: Write> LogitsWriter<W> {
    /// Writes the header; `name` is the file's name for messages.
    pub fn new(mut w: W, header: LogitsHeader, name: &str) -> Result<Self> {
        header
            .write(&mut w)
            .map_err(|e| RuntimeError::file(name, e))?;
        let row = Vec::with_capacity(header.row_bytes() as usize);
        Ok(LogitsWriter {
            w,
            name: name.to_string(),
            header,
            row,
            rows: 0,
        })
    }

    /// Writes the next scored position's row.
    pub fn push(&mut self, logits: &[f32], target: u32) -> Result<()> {
        if logits.len() != self.header.n_vocab || self.rows >= self.header.chunks.scored() {
            return Err(RuntimeError::Internal(format!(
                "logits row {} of {} entries, the file holds {} rows of {}",
                self.rows,
                logits.len(),
                self.header.chunks.scored(),
                self.header.n_vocab
            )));
        }
        self.row.clear();
        encode_row(logits, target as usize, &mut self.row)
            .map_err(|m| RuntimeError::Model(format!("{m} at scored position {}", self.rows)))?;
        self.w
            .write_all(&self.row)
            .map_err(|e| RuntimeError::file(&self.name, e))?;
        self.rows += 1;
        Ok(())
    }

    /// Checks that every row was written, flushes, and returns the writer.
    pub fn finish(mut self) -> Result<W> {
        if self.rows != self.header.chunks.scored() {
            return Err(RuntimeError::Internal(format!(
                "{} logits rows written of {}",
                self.rows,
                self.header.chunks.scored()
            )));
        }
        self.w
            .flush()
            .map_err(|e| RuntimeError::file(&self.name, e))?;
        Ok(self.w)
    }
}

/// Streams rows in from a logits file and accumulates the comparison.
pub struct LogitsReader<R: Read> {
    r: R,
    name: String,
    header: LogitsHeader,
    raw: Vec<u8>,
    lp: Vec<f64>,
    rows: usize,
    kl: Vec<f64>,
    top1_same: usize,
    base_nll: f64,
}

impl<R: Read> LogitsReader<R> {
    /// Reads and checks the header of a file of `file_len` bytes named `name`.
    pub fn new(mut r: R, file_len: u64, name: &str) -> Result<Self> {
        let header = LogitsHeader::read(&mut r, file_len, name)?;
        Ok(LogitsReader {
            r,
            name: name.to_string(),
            header,
            raw: Vec::new(),
            lp: Vec::new(),
            rows: 0,
            kl: Vec::new(),
            top1_same: 0,
            base_nll: 0.0,
        })
    }

    /// The file's header.
    pub fn header(&self) -> &LogitsHeader {
        &self.header
    }

    /// Compares this model's logits at the next scored position with the file's row.
    pub fn push(&mut self, logits: &[f32]) -> Result<()> {
        let n = self.header.n_vocab;
        if logits.len() != n || self.rows >= self.header.chunks.scored() {
            return Err(RuntimeError::Internal(format!(
                "logits row {} of {} entries, the file holds {} rows of {n}",
                self.rows,
                logits.len(),
                self.header.chunks.scored()
            )));
        }
        if self.raw.is_empty() {
            self.raw = vec![0u8; self.header.row_bytes() as usize];
            self.lp = vec![0.0; n];
            self.kl.reserve_exact(self.header.chunks.scored());
        }
        read_exact(&mut self.r, &mut self.raw, &self.name)?;
        let info = decode_row(&self.raw, &mut self.lp).map_err(|m| {
            RuntimeError::Perplexity(format!("{}: corrupt row {}: {m}", self.name, self.rows))
        })?;
        self.kl.push(kl_row(&self.lp, logits));
        self.top1_same += usize::from(argmax(logits) == info.top1 as usize);
        self.base_nll -= info.target_logprob;
        self.rows += 1;
        Ok(())
    }

    /// The statistics over every row; `ppl` is this model's perplexity.
    pub fn finish(mut self, ppl: f64) -> Result<KlSummary> {
        let n = self.rows;
        if n != self.header.chunks.scored() || n == 0 {
            return Err(RuntimeError::Internal(format!(
                "{n} logits rows compared of {}",
                self.header.chunks.scored()
            )));
        }
        let mean = self.kl.iter().sum::<f64>() / n as f64;
        let var = self.kl.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let mean_stderr = if n > 1 {
            (var / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        self.kl.sort_by(f64::total_cmp);
        let base_ppl = (self.base_nll / n as f64).exp();
        let agree = self.top1_same as f64 / n as f64;
        Ok(KlSummary {
            positions: n,
            mean,
            mean_stderr,
            median: quantile(&self.kl, 0.5),
            p99: quantile(&self.kl, 0.99),
            max: self.kl[n - 1],
            top1_percent: 100.0 * agree,
            top1_percent_stderr: 100.0 * (agree * (1.0 - agree) / n as f64).sqrt(),
            base_ppl,
            ppl_ratio: ppl / base_ppl,
        })
    }
}

/// The `q`-quantile of sorted values, interpolated linearly between ranks.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let x = q * (sorted.len() - 1) as f64;
    let (i, f) = (x.floor() as usize, x - x.floor());
    if i + 1 < sorted.len() {
        sorted[i] + f * (sorted[i + 1] - sorted[i])
    } else {
        sorted[i]
    }
}

/// The comparison of a model with the base model's logits file.
#[derive(Clone, Debug, Serialize)]
pub struct KlSummary {
    /// Positions compared.
    pub positions: usize,
    /// Mean KL(base ‖ this), nats.
    pub mean: f64,
    /// Its standard error.
    pub mean_stderr: f64,
    /// Median KL.
    pub median: f64,
    /// 99th percentile of KL.
    pub p99: f64,
    /// Largest KL.
    pub max: f64,
    /// Positions whose argmax is the base model's, percent.
    pub top1_percent: f64,
    /// Its standard error (binomial), percent.
    pub top1_percent_stderr: f64,
    /// The base model's perplexity over the same positions (from the file).
    pub base_ppl: f64,
    /// This model's perplexity over the base's.
    pub ppl_ratio: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsm(logits: &[f32]) -> Vec<f64> {
        let lse = log_sum_exp(logits);
        logits.iter().map(|&v| v as f64 - lse).collect()
    }

    /// A pseudo-random logits row spanning about `span` nats.
    fn row(n: usize, seed: u64, span: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * span
            })
            .collect()
    }

    #[test]
    fn row_round_trip_is_within_half_a_step() {
        for (n, span, seed) in [(49152, 40.0, 1), (100, 8.0, 2), (7, 300.0, 3), (3, 0.0, 4)] {
            let logits = row(n, seed, span);
            let mut out = Vec::new();
            encode_row(&logits, 2, &mut out).unwrap();
            assert_eq!(out.len(), ROW_HEADER + 2 * n);
            let mut lp = vec![0.0; n];
            let info = decode_row(&out, &mut lp).unwrap();
            let exact = lsm(&logits);
            assert_eq!(info.top1 as usize, argmax(&logits));
            assert!((info.target_logprob - exact[2]).abs() <= exact[2].abs() * 1e-7 + 1e-7);
            // half a quantization step, plus f32 rounding of min and scale, plus the
            // renormalization's shift (itself within the same bound)
            let range = exact.iter().copied().fold(f64::MIN, f64::max)
                - exact.iter().copied().fold(f64::MAX, f64::min);
            let min = exact.iter().copied().fold(f64::MAX, f64::min);
            let bound = 2.0 * (range / 131070.0 + (range + min.abs()) * 1.2e-7) + 1e-12;
            let err = exact
                .iter()
                .zip(&lp)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(err <= bound, "n {n} span {span}: error {err} > {bound}");
            // and so KL(decoded ‖ exact) <= (2 err)^2 / 8, far under 1e-6
            let kl = kl_row(&lp, &logits);
            assert!(kl.abs() <= err * err / 2.0 + 1e-12, "kl {kl} err {err}");
        }
    }

    #[test]
    fn kl_of_a_shifted_distribution_is_positive_and_exact() {
        // base (1/2, 1/2), this (1/4, 3/4): KL = 1/2 ln(2) + 1/2 ln(2/3)
        let base = [0.5f64.ln(), 0.5f64.ln()];
        let this = [0.0f32, 3f32.ln()];
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_row(&base, &this) - want).abs() < 1e-7);
    }

    #[test]
    fn encode_refuses_non_finite_logits() {
        assert!(encode_row(&[0.0, f32::NAN], 0, &mut Vec::new()).is_err());
        assert!(encode_row(&[0.0, f32::INFINITY], 0, &mut Vec::new()).is_err());
    }

    #[test]
    fn quantiles_interpolate() {
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 2.0);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!((quantile(&v, 0.99) - 3.96).abs() < 1e-12);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }

    fn sample_file(ctx: usize, n_tokens: usize, n_vocab: usize) -> (LogitsHeader, Vec<u8>) {
        let tokens: Vec<u32> = (0..n_tokens as u32).map(|t| t % n_vocab as u32).collect();
        let chunks = ChunkPlan::new(n_tokens, ctx).unwrap();
        let header = LogitsHeader {
            n_vocab,
            chunks,
            tokens,
        };
        let mut w = LogitsWriter::new(Vec::new(), header.clone(), "base.logits").unwrap();
        for i in 0..chunks.scored() {
            w.push(&row(n_vocab, i as u64, 10.0), (i % n_vocab) as u32)
                .unwrap();
        }
        (header, w.finish().unwrap())
    }

    #[test]
    fn file_round_trip_compares_the_same_logits_as_identical() {
        let (header, bytes) = sample_file(8, 20, 11);
        assert_eq!(bytes.len() as u64, header.file_bytes().unwrap());
        let mut r = LogitsReader::new(&bytes[..], bytes.len() as u64, "base.logits").unwrap();
        assert_eq!(r.header(), &header);
        let mut nll = 0.0;
        for i in 0..header.chunks.scored() {
            let logits = row(11, i as u64, 10.0);
            nll -= lsm(&logits)[i % 11];
            r.push(&logits).unwrap();
        }
        let ppl = (nll / header.chunks.scored() as f64).exp();
        let s = r.finish(ppl).unwrap();
        assert_eq!(s.positions, 6);
        // a 10-nat range: half a step is 7.6e-5, KL at most (2 * 2 * 7.6e-5)^2 / 8
        assert!(s.mean.abs() < 1e-7 && s.max.abs() < 1e-7, "{s:?}");
        assert_eq!(s.top1_percent, 100.0);
        assert!((s.ppl_ratio - 1.0).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn damaged_files_are_refused_with_the_file_named() {
        let (_, bytes) = sample_file(8, 20, 11);
        let err = |b: &[u8]| match LogitsReader::new(b, b.len() as u64, "base.logits") {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        };
        for cut in [0, 10, 45, bytes.len() - 1] {
            let e = err(&bytes[..cut]);
            assert!(e.starts_with("base.logits: "), "{e}");
            assert!(
                e.contains("truncated") || e.contains("not a logits file"),
                "{e}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(err(&long).contains("trailing data"));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(err(&magic).contains("wrong magic"));
        let mut version = bytes.clone();
        version[8] = 9;
        assert!(err(&version).contains("version 9"));
        let mut ctx = bytes.clone();
        ctx[16] = 9; // ctx 9 disagrees with first and the chunk count
        assert!(err(&ctx).contains("corrupt header"));
        // a huge token count is refused before anything is allocated
        let mut huge = bytes.clone();
        huge[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("truncated"));
        // a row whose top-1 is past the vocabulary
        let mut row0 = bytes.clone();
        let at = FIXED_HEADER + 4 * 20 + 8;
        row0[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
        let mut r = LogitsReader::new(&row0[..], row0.len() as u64, "base.logits").unwrap();
        let e = r.push(&row(11, 0, 10.0)).unwrap_err().to_string();
        assert!(e.contains("base.logits: corrupt row 0"), "{e}");
    }

    #[test]
    fn another_ctx_vocabulary_or_text_is_named() {
        let (header, _) = sample_file(8, 20, 11);
        let c = header.chunks;
        let t = &header.tokens;
        assert!(header.check(11, &c, t, "f").is_ok());
        let e = header.check(12, &c, t, "f").unwrap_err().to_string();
        assert!(
            e.contains("f: saved with a vocabulary of 11 entries, this model has 12"),
            "{e}"
        );
        let c10 = ChunkPlan::new(20, 10).unwrap();
        let e = header.check(11, &c10, t, "f").unwrap_err().to_string();
        assert!(e.contains("--ctx 8, this run uses --ctx 10"), "{e}");
        let mut t2 = t.clone();
        t2[5] += 1;
        let e = header.check(11, &c, &t2, "f").unwrap_err().to_string();
        assert!(e.contains("first difference at token 5"), "{e}");
    }
}
