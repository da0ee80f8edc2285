//! The GPU executor's logic (`gds_cuda::stream::Streamer`: VRAM layout, residency, the
//! per-token streaming schedule, read-ahead, layer loads through gds-io) run on the CPU over
//! an emulated [`Vram`]: host buffers, the kernels compiled as C++ (kernels/emu.h), layers
//! read through gds-io's `DirectBackend` as the bounce path reads them.
//!
//! The emulated device also enforces the ordering the CUDA events provide: a load into a
//! slot lands only when the compute side waits for it, a slot may be refilled only after
//! the host waited for the block computed from it, and a block computes from a slot only
//! after waiting for its load. Breaking any of these fails the test.
//!
//! The model is a real GdsLLM directory converted from the tiny llama fixture (2 blocks,
//! grouped KV heads), all matrices Q8_0 or Q4_0. Its logits must be identical at every VRAM
//! budget (all resident, some streamed, everything streamed) and agree with the CPU runtime
//! (f32 activations) on the same files.

use crate::common::{Emu, Op, Recorder};
use gds_cuda::forward::{Device, GemmType};
use gds_cuda::plan::MAX_BATCH;
use gds_cuda::stream::{BufKind, GraphKey, StreamOptions, Streamer, Vram};
use gds_cuda::GpuError;
use gds_format::DType;
use gds_io::{DirectBackend, DirectOptions, LayerSource};
use gds_runtime::cuda_graph::CudaGraph;
use std::path::{Path, PathBuf};

/// Where a streaming slot is in the load → compute → refill cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Never used.
    Empty,
    /// A load was enqueued; its bytes land when the compute side waits (`pending`).
    Loading,
    /// The compute side waited: the bytes are there.
    Loaded,
    /// A block was computed from it; the host has not waited yet.
    Computed,
    /// The host waited for that block: the slot may be refilled.
    Free,
}

struct EmuVram {
    dev: Emu,
    /// Storage of every buffer (u64 words: 8-byte aligned), never moved once made.
    bufs: Vec<Vec<u64>>,
    source: DirectBackend,
    slots: [SlotState; 2],
    /// A load waiting for `wait_loaded`: (layer bytes, destination).
    pending: [Option<(Vec<u8>, u64)>; 2],
    /// Loads issued (layer, sync) and read-ahead requests, in order.
    loads: Vec<(usize, bool)>,
    prefetches: Vec<usize>,
    /// A capture under way ([`Vram::capture_begin`]): the launches recorded, not run.
    capture: Option<Recorder>,
    /// The captures kept, by pass shape (a CUDA graph each on the GPU).
    graphs: Vec<(GraphKey, Vec<Op>)>,
}

impl EmuVram {
    fn new(dir: &Path) -> EmuVram {
        let bytes = gds_io::read_manifest(dir).unwrap();
        let m = gds_format::Manifest::parse(&bytes).unwrap();
        let biggest = (0..m.n_layers())
            .map(|l| m.layer(l).unwrap().file_size)
            .max()
            .unwrap();
        let source = DirectBackend::open(
            dir,
            &m,
            &DirectOptions {
                resident: vec![false; m.n_layers()],
                slots: 2,
                slot_size: gds_io::align_up(biggest) as usize + 2 * gds_io::ALIGN,
                force_buffered: false,
                keep_cached: false,
                verifier: None,
            },
        )
        .unwrap();
        EmuVram {
            dev: Emu::default(),
            bufs: Vec::new(),
            source,
            slots: [SlotState::Empty; 2],
            pending: [None, None],
            loads: Vec::new(),
            prefetches: Vec::new(),
            capture: None,
            graphs: Vec::new(),
        }
    }

    fn write(dst: u64, bytes: &[u8]) {
        // SAFETY: `dst` is the start of one of `bufs`, allocated with at least the layer's
        // size (the executor loads whole layers into buffers sized for them).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as usize as *mut u8, bytes.len())
        };
    }
}

impl Vram for EmuVram {
    fn kernels(&mut self) -> &mut dyn Device {
        match &mut self.capture {
            Some(r) => r,
            None => &mut self.dev,
        }
    }
    fn alloc(&mut self, bytes: usize, _kind: BufKind) -> Result<u64, GpuError> {
        self.bufs.push(vec![0u64; bytes.div_ceil(8).max(1)]);
        Ok(self.bufs.last().unwrap().as_ptr() as u64)
    }
    fn upload(&mut self, dst: u64, src: &[f32]) -> Result<(), GpuError> {
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        EmuVram::write(dst, &bytes);
        Ok(())
    }
    fn upload_i32(&mut self, dst: u64, src: &[i32]) -> Result<(), GpuError> {
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        EmuVram::write(dst, &bytes);
        Ok(())
    }
    fn ready(&mut self) -> Result<(), GpuError> {
        Ok(())
    }
    fn load(
        &mut self,
        layer: usize,
        size: usize,
        dst: u64,
        slot: usize,
        sync: bool,
    ) -> Result<(), GpuError> {
        let h = self.source.acquire(layer).expect("reading a layer");
        assert_eq!(h.len(), size, "layer {layer} size");
        self.loads.push((layer, sync));
        if sync {
            EmuVram::write(dst, &h);
            return Ok(());
        }
        assert!(
            matches!(self.slots[slot], SlotState::Empty | SlotState::Free),
            "slot {slot} refilled in state {:?} (its block not waited for)",
            self.slots[slot]
        );
        self.pending[slot] = Some((h.to_vec(), dst));
        self.slots[slot] = SlotState::Loading;
        Ok(())
    }
    fn prefetch(&mut self, layer: usize, size: usize) {
        self.prefetches.push(layer);
        self.source.prefetch(gds_io::Span {
            layer,
            offset: 0,
            len: size as u64,
        });
    }
    fn wait_loaded(&mut self, slot: usize) -> Result<(), GpuError> {
        assert_eq!(self.slots[slot], SlotState::Loading, "slot {slot}");
        let (bytes, dst) = self.pending[slot].take().unwrap();
        EmuVram::write(dst, &bytes);
        self.slots[slot] = SlotState::Loaded;
        Ok(())
    }
    fn mark_computed(&mut self, slot: usize) -> Result<(), GpuError> {
        assert_eq!(
            self.slots[slot],
            SlotState::Loaded,
            "computed before its load"
        );
        self.slots[slot] = SlotState::Computed;
        Ok(())
    }
    fn wait_computed(&mut self, slot: usize) -> Result<(), GpuError> {
        if self.slots[slot] == SlotState::Computed {
            self.slots[slot] = SlotState::Free;
        }
        Ok(())
    }
    fn finish(
        &mut self,
        out: &mut [f32],
        src: u64,
        extra: Option<(&mut [f32], u64)>,
    ) -> Result<(), GpuError> {
        assert!(
            self.pending.iter().all(Option::is_none),
            "a load was never waited for"
        );
        for (out, src) in std::iter::once((out, src)).chain(extra) {
            // SAFETY: `src` is the logits buffer (or the hidden rows), as many floats as `out`.
            let rows = unsafe { std::slice::from_raw_parts(src as usize as *const f32, out.len()) };
            out.copy_from_slice(rows);
        }
        Ok(())
    }
    fn io_stats(&self) -> Option<gds_io::IoStats> {
        Some(self.source.stats())
    }
    fn replay(&mut self, key: GraphKey) -> Result<bool, GpuError> {
        assert!(self.capture.is_none(), "a replay inside a capture");
        match self.graphs.iter().find(|(k, _)| *k == key) {
            Some((_, ops)) => Recorder::replay(ops, &mut self.dev).map(|()| true),
            None => Ok(false),
        }
    }
    fn capture_begin(&mut self) -> Result<bool, GpuError> {
        assert!(self.capture.is_none(), "a capture inside a capture");
        assert!(
            self.pending.iter().all(Option::is_none),
            "a capture while a layer load is pending"
        );
        self.capture = Some(Recorder::default());
        Ok(true)
    }
    fn capture_end(&mut self, key: GraphKey, keep: bool) -> Result<(), GpuError> {
        let r = self.capture.take().expect("a capture to end");
        if keep {
            assert!(
                self.graphs.iter().all(|(k, _)| *k != key),
                "{key:?} captured twice"
            );
            Recorder::replay(&r.ops, &mut self.dev)?;
            self.graphs.push((key, r.ops));
        }
        Ok(())
    }
}

/// A 4-block llama: the tiny llama fixture (Hugging Face directory, 2 blocks) with its
/// blocks repeated, converted with every matrix in `dtype`. (Two blocks cannot stream:
/// two slots cost as much as keeping both.)
fn model(dtype: DType) -> (tempfile::TempDir, PathBuf) {
    use safetensors::SafeTensors;
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama-hf");
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), hf.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = 4.into();
    std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
    let shards: Vec<Vec<u8>> = ["model-00001-of-00002", "model-00002-of-00002"]
        .iter()
        .map(|n| std::fs::read(src.join(format!("{n}.safetensors"))).unwrap())
        .collect();
    let mut tensors = Vec::new();
    for bytes in &shards {
        for (name, view) in SafeTensors::deserialize(bytes).unwrap().tensors() {
            if let Some(rest) = name.strip_prefix("model.layers.") {
                let (i, tail) = rest.split_once('.').unwrap();
                let i: usize = i.parse().unwrap();
                tensors.push((format!("model.layers.{}.{tail}", i + 2), view.clone()));
            }
            tensors.push((name, view));
        }
    }
    safetensors::serialize_to_file(tensors, None, &hf.join("model.safetensors")).unwrap();
    let out = tmp.path().join("deep.gds");
    gds_convert::convert(
        &hf,
        &out,
        &gds_convert::ConvertOptions {
            quant: gds_convert::QuantTarget::To(dtype),
            requantize: true,
            ..Default::default()
        },
        &gds_convert::NoProgress,
    )
    .unwrap();
    (tmp, out)
}

/// The VRAM plan's bounds for the model: (runs at all, everything resident).
fn bounds(dir: &Path) -> (u64, u64) {
    let p = gds_cuda::plan::Layout::read(dir)
        .unwrap()
        .plan(CTX, MAX_BATCH, usize::MAX >> 1)
        .unwrap();
    (p.min_budget as u64, p.all_resident_budget as u64)
}

const CTX: usize = 64;

/// Logits of the last token of each chunk, the chunks evaluated one after another (one
/// forward call each), on the executor.
fn run_streamer(dir: &Path, budget: u64, chunks: &[&[u32]]) -> (Vec<Vec<f32>>, EmuVramReport) {
    run_streamer_ctx(dir, budget, chunks, CTX, MAX_BATCH)
}

/// [`run_streamer`] with a context of `ctx` positions and passes of at most `max_batch`
/// (which sizes the window blocks' rings); the graph and RoPE tables are the runtime's for
/// the model (`gds_runtime::cuda_graph`, as `gdsrun --backend cuda` opens it).
fn run_streamer_ctx(
    dir: &Path,
    budget: u64,
    chunks: &[&[u32]],
    ctx: usize,
    max_batch: usize,
) -> (Vec<Vec<f32>>, EmuVramReport) {
    run_streamer_with(dir, chunks, ctx, |rope| StreamOptions {
        ctx,
        ..options(budget, rope, max_batch)
    })
}

/// [`run_streamer_ctx`] with the options `opts` makes from the model's RoPE tables.
fn run_streamer_with(
    dir: &Path,
    chunks: &[&[u32]],
    ctx: usize,
    opts: impl FnOnce(gds_runtime::cuda_graph::RopeTables) -> StreamOptions,
) -> (Vec<Vec<f32>>, EmuVramReport) {
    let (graph, rope) = CudaGraph::open(dir, ctx).unwrap();
    let opts = opts(rope);
    let mut s = Streamer::with_vram(dir, &opts, EmuVram::new(dir), Box::new(graph)).unwrap();
    let vocab = s.layout().shape.vocab;
    let mut logits = vec![0f32; vocab];
    let mut rows = Vec::new();
    let mut pos = 0;
    for c in chunks {
        s.forward(&mut logits, c, pos).unwrap();
        rows.push(logits.clone());
        pos += c.len();
    }
    let v = s.vram();
    let report = EmuVramReport {
        streamed: s.plan.resident.iter().filter(|r| !**r).count(),
        loads: v.loads.clone(),
        prefetches: v.prefetches.len(),
        bytes_read: s.io_stats().bytes_read,
        launches: v.dev.launches,
    };
    (rows, report)
}

struct EmuVramReport {
    streamed: usize,
    loads: Vec<(usize, bool)>,
    prefetches: usize,
    bytes_read: u64,
    /// The blocks' and head's kernel launches (`Emu::launches`).
    launches: usize,
}

/// The same on the CPU runtime (f32 activations, the mmap backend, an f32 KV cache).
fn run_cpu(dir: &Path, chunks: &[&[u32]]) -> Vec<Vec<f32>> {
    run_cpu_kv(dir, chunks, gds_runtime::KvDtype::F32)
}

/// [`run_cpu`] with a KV cache of `kv_type` elements.
fn run_cpu_kv(dir: &Path, chunks: &[&[u32]], kv_type: gds_runtime::KvDtype) -> Vec<Vec<f32>> {
    use gds_runtime::{Batch, KvCache, Model, RunState};
    let mut m = Model::load(dir, CTX, 1).unwrap();
    m.set_f32_activations(true);
    let c = &m.config;
    let mut st = RunState::new(c, CTX, 1, CTX, 1);
    let mut kv = KvCache::new(kv_type, c.n_layers, 1, CTX, c.kv_dim());
    let mut b = Batch::with_capacity(CTX);
    let (mut rows, mut pos) = (Vec::new(), 0);
    for chunk in chunks {
        b.clear();
        for (i, &t) in chunk.iter().enumerate() {
            b.push(t, pos + i, 0, i + 1 == chunk.len());
        }
        m.forward(&mut st, &mut kv, &b).unwrap();
        rows.push(st.logits(0, c.vocab_size).to_vec());
        pos += chunk.len();
    }
    rows
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Plan options over the whole context of [`CTX`], one sequence, f32 activations, the default
/// GEMM crossover; tests change what they test with struct update syntax.
fn options(vram_budget: u64, rope: Vec<(Vec<f32>, Vec<f32>)>, max_batch: usize) -> StreamOptions {
    StreamOptions {
        vram_budget,
        ctx: CTX,
        rope,
        max_batch,
        kv: None,
        max_outputs: None,
        q8_activations: false,
        gemm_min_tokens: gds_cuda::forward::GEMM_MIN_TOKENS,
        gemm: GemmType::F32,
        graphs: false,
        fuse: true,
    }
}

#[test]
fn the_executor_on_an_emulated_device_streams_layers_and_matches_the_cpu_runtime() {
    // A 9-token prompt, then 8 more tokens. (The emulation runs every CUDA thread as an OS
    // thread, so each call costs seconds: chunks of 8+ tokens take the GEMM path, leaving
    // only the head a matvec; decode steps are tested in forward_emu.rs.) All-resident and
    // middle budgets run the prompt; the minimum runs both chunks, so its slots are reused
    // across calls.
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 180, 7, 250, 3, 64];
    let more: Vec<u32> = vec![5, 77, 123, 200, 9, 310, 44, 2];
    let chunks: [&[u32]; 2] = [&prompt, &more];
    let (_tmp, dir) = model(DType::Q8_0);
    let (min_budget, all_budget) = bounds(&dir);
    assert!(min_budget < all_budget);
    let mid_budget = min_budget + (all_budget - min_budget) / 2;
    let (all, all_r) = run_streamer(&dir, all_budget, &chunks[..1]);
    let (mid, mid_r) = run_streamer(&dir, mid_budget, &chunks[..1]);
    let (min, min_r) = run_streamer(&dir, min_budget, &chunks);
    assert_eq!(all_r.streamed, 0);
    assert_eq!(min_r.streamed, 4, "every block streamed at the minimum");
    assert!(
        mid_r.streamed > 0 && mid_r.streamed < 4,
        "{} streamed at the middle budget",
        mid_r.streamed
    );
    // All resident: every layer loaded once, synchronously, nothing read ahead.
    assert!(all_r.loads.iter().all(|&(_, sync)| sync));
    assert_eq!(all_r.prefetches, 0);
    // Streaming: each streamed block is read once per forward call, each read followed by
    // a read-ahead request, in block order.
    for (r, calls) in [(&mid_r, 1), (&min_r, 2)] {
        let streamed: Vec<usize> = r
            .loads
            .iter()
            .filter(|&&(_, sync)| !sync)
            .map(|&(l, _)| l)
            .collect();
        assert_eq!(streamed.len(), r.streamed * calls);
        assert!(
            streamed
                .windows(2)
                .all(|w| w[0] < w[1] || w[1] == streamed[0]),
            "streamed loads out of order: {streamed:?}"
        );
        assert_eq!(r.prefetches, streamed.len());
        assert!(r.bytes_read > all_r.bytes_read, "streaming reads more");
    }
    // Same kernels over the same bytes: identical logits whatever the budget.
    assert_eq!(all[0], mid[0], "middle budget");
    assert_eq!(all[0], min[0], "minimum budget");

    // The CPU runtime on the same files: same argmax, logits within float noise.
    let cpu = run_cpu(&dir, &chunks);
    assert_eq!(cpu.len(), min.len());
    for (i, (g, c)) in min.iter().zip(&cpu).enumerate() {
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        let diff = g.iter().zip(c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-3 * scale,
            "chunk {i}: max diff {diff} (scale {scale})"
        );
        assert_eq!(argmax(g), argmax(c), "chunk {i}");
    }
}

/// Greedy tokens after `prompt` (one forward call), then one token per call, on the CPU
/// runtime with its default 8-bit activations (`--activations q8`).
fn greedy_cpu_q8(dir: &Path, prompt: &[u32], steps: usize) -> Vec<u32> {
    use gds_runtime::{Batch, KvCache, KvDtype, Model, RunState};
    let mut m = Model::load(dir, CTX, 1).unwrap();
    m.set_f32_activations(false);
    let c = &m.config;
    let mut st = RunState::new(c, CTX, 1, CTX, 1);
    let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, CTX, c.kv_dim());
    let mut b = Batch::with_capacity(CTX);
    let (mut input, mut pos, mut out) = (prompt.to_vec(), 0, Vec::new());
    for _ in 0..steps {
        b.clear();
        for (i, &t) in input.iter().enumerate() {
            b.push(t, pos + i, 0, i + 1 == input.len());
        }
        m.forward(&mut st, &mut kv, &b).unwrap();
        pos += input.len();
        let next = argmax(st.logits(0, c.vocab_size));
        out.push(next);
        input = vec![next];
    }
    out
}

/// Greedy tokens of `prompt` then `steps - 1` single-token steps on the executor at VRAM
/// budget `budget` with 8-bit activations, and the device's GEMM and int8 call counts.
fn greedy_gpu_q8(
    dir: &Path,
    budget: u64,
    prompt: &[u32],
    steps: usize,
) -> (Vec<u32>, usize, usize) {
    let (graph, rope) = CudaGraph::open(dir, CTX).unwrap();
    let opts = StreamOptions {
        q8_activations: true,
        ..options(budget, rope, MAX_BATCH)
    };
    let mut s = Streamer::with_vram(dir, &opts, EmuVram::new(dir), Box::new(graph)).unwrap();
    let mut logits = vec![0f32; s.layout().shape.vocab];
    let (mut input, mut pos, mut out) = (prompt.to_vec(), 0, Vec::new());
    for _ in 0..steps {
        s.forward(&mut logits, &input, pos).unwrap();
        pos += input.len();
        let next = argmax(&logits);
        out.push(next);
        input = vec![next];
    }
    (out, s.vram().dev.gemms, s.vram().dev.q8)
}

#[test]
fn int8_activations_give_the_cpu_q8_greedy_tokens() {
    // The default GPU path (`--activations q8`): a prompt shorter than GEMM_MIN_TOKENS and
    // single-token steps all run the int8 kernels (x quantized as the CPU quantizes it for
    // the 32-value types: 32-value blocks, same rounding), so greedy decoding follows the
    // CPU's default arithmetic token for token. Q4_1 is SmolLM2's type.
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 180];
    let steps = 6;
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
    ] {
        let (_tmp, dir) = model(dtype);
        let (_, all_budget) = bounds(&dir);
        let (gpu, gemms, q8) = greedy_gpu_q8(&dir, all_budget, &prompt, steps);
        // 7 products per block in 4 launches (Q/K/V and gate/up each one) and the head,
        // every call through the int8 kernels
        assert_eq!(gemms, 0, "{dtype}");
        assert_eq!(q8, steps * (4 * 4 + 1), "{dtype}");
        assert_eq!(gpu, greedy_cpu_q8(&dir, &prompt, steps), "{dtype}");
    }
    // llama.cpp's IQ4_XS and IQ4_NL (tiny llamas of hidden size 256 quantized by
    // llama-quantize; their head Q6_K), at the smallest VRAM budget
    for file in ["tiny-llama-iq4_xs.gguf", "tiny-llama-iq4_nl.gguf"] {
        let (_tmp, dir) = gds_tests::converted_fixture(file);
        let (min_budget, _) = bounds(&dir);
        let (gpu, _, q8) = greedy_gpu_q8(&dir, min_budget, &prompt, steps);
        assert_eq!(
            q8,
            steps * (4 * 2 + 1),
            "{file}: every product through the int8 kernels (Q/K/V and gate/up grouped)"
        );
        assert_eq!(gpu, greedy_cpu_q8(&dir, &prompt, steps), "{file}");
    }
    // gpt-oss's MXFP4 experts (matvec_q8_mxfp4, each expert on its tokens' rows) beside its
    // Q8_0 attention, at the smallest VRAM budget (blocks streamed)
    let (_tmp, dir) = gds_tests::converted_fixture("tiny-gptoss-mxfp4.gguf");
    let (min_budget, _) = bounds(&dir);
    let (gpu, _, q8) = greedy_gpu_q8(&dir, min_budget, &prompt, steps);
    assert!(q8 > 0);
    assert_eq!(gpu, greedy_cpu_q8(&dir, &prompt, steps), "gpt-oss MXFP4");
}

/// The long passes' int8 tensor-core products (`mmq_*`, what `GDS_CUDA_MMQ=1` turns on):
/// a prompt of GEMM length with 8-bit activations goes through them instead of the
/// dequantized tiles (no GEMM at all), gives the logits of the same prompt through the int8
/// matvecs (the same 8-bit arithmetic, summed in another order) and the CPU's q8 greedy
/// tokens, resident (and streamed for Q4_0): the llama of three 32-value types, Q4_K and
/// Q6_K, and llama.cpp's IQ4_XS (its head Q6_K, the split half-block products).
#[test]
fn tensor_core_products_of_a_long_prompt_give_the_int8_matvecs_logits() {
    let prompt: Vec<u32> = (0..40u32).map(|i| 1 + (i * 37 + 11) % 300).collect();
    let steps = 3;
    let run = |dir: &Path, budget: u64, mmq: bool, gemm_min: usize| {
        let (graph, rope) = CudaGraph::open(dir, CTX).unwrap();
        let opts = StreamOptions {
            q8_activations: true,
            gemm: GemmType::F16,
            gemm_min_tokens: gemm_min,
            ..options(budget, rope, MAX_BATCH)
        };
        let mut vram = EmuVram::new(dir);
        vram.dev.mmq = mmq;
        let mut s = Streamer::with_vram(dir, &opts, vram, Box::new(graph)).unwrap();
        let mut logits = vec![0f32; s.layout().shape.vocab];
        let (mut input, mut pos, mut out, mut first) = (prompt.clone(), 0, Vec::new(), None);
        for _ in 0..steps {
            s.forward(&mut logits, &input, pos).unwrap();
            first.get_or_insert_with(|| logits.clone());
            pos += input.len();
            let next = argmax(&logits);
            out.push(next);
            input = vec![next];
        }
        let dev = &s.vram().dev;
        (first.unwrap(), out, dev.gemms, dev.mmqs)
    };
    let mut dirs = Vec::new();
    for dtype in [
        DType::Q4_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
    ] {
        let (tmp, dir) = model(dtype);
        dirs.push((format!("llama {dtype}"), dir, tmp));
    }
    let (tmp, dir) = gds_tests::converted_fixture("tiny-llama-iq4_xs.gguf");
    dirs.push(("tiny-llama-iq4_xs.gguf".into(), dir, tmp));
    for (name, dir, _keep) in &dirs {
        let (min, all) = bounds(dir);
        // streamed (the minimum budget) for one model: the emulation takes seconds a run
        let budgets = if name == "llama Q4_0" {
            vec![all, min]
        } else {
            vec![all]
        };
        for budget in budgets {
            let gemm_min = gds_cuda::forward::GEMM_MIN_TOKENS_Q8;
            let (l_mmq, t_mmq, gemms, mmqs) = run(dir, budget, true, gemm_min);
            let (l_vec, t_vec, _, none) = run(dir, budget, false, usize::MAX);
            assert_eq!(gemms, 0, "{name}: a GEMM beside the tensor-core products");
            // 7 products per block of the prompt's pass (its head takes the last token
            // only: an int8 matvec)
            let blocks = gds_cuda::plan::Layout::read(dir).unwrap().shape.n_layers;
            assert_eq!(mmqs, blocks * 7, "{name}");
            assert_eq!(none, 0, "{name}");
            let scale = l_vec.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = l_mmq
                .iter()
                .zip(&l_vec)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            // The same int8 sums in another order: f32 noise, which may move an activation
            // of a later layer across a rounding boundary of its 8-bit quantization (one step,
            // ~1 % of its block's range: the Q8_0 llama's logits then differ by ~1 %, and the
            // CPU's, summed as these kernels sum, agree with the tensor cores' to 1e-6). A
            // wrong fragment or scale is off by the whole product.
            assert!(
                diff <= 0.05 * scale.max(1.0),
                "{name} budget {budget}: max |logit diff| {diff} (scale {scale})"
            );
            assert_eq!(t_mmq, t_vec, "{name} budget {budget}");
            assert_eq!(t_mmq, greedy_cpu_q8(dir, &prompt, steps), "{name}");
        }
    }
}

/// Fused launches (`StreamOptions::fuse`, on by default: a norm into the projections'
/// input and the gated activation quantize their output for the int8 products in the same
/// launch, RoPE runs with the KV store, Q/K/V and gate/up go out in one int8 launch each)
/// give the logits of launching every op alone, bit for bit: every dense architecture and
/// the experts' (the graph's ops between a fused pair: Qwen 3's head norms, Gemma's
/// sandwich norms, SmolLM3's blocks without RoPE, gpt-oss's sinks), int8 and f32
/// activations, a prompt under the GEMM length, decode steps and a GEMM-length chunk,
/// everything resident and streamed. A llama block's int8 pass takes 12 launches instead of
/// 20 (8 fewer), a GEMM pass or an f32-activation one 2 fewer (RoPE with the store).
#[test]
fn fused_launches_give_the_logits_of_unfused_ones_bit_for_bit() {
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 180];
    let long: Vec<u32> = (0..9).map(|i| (i * 29 + 3) % 97).collect();
    let chunks: Vec<&[u32]> = vec![&prompt, &[7], &[64], &[5], &[120], &long];
    let run = |dir: &Path, budget: u64, q8: bool, fuse: bool| {
        run_streamer_with(dir, &chunks, CTX, |rope| StreamOptions {
            q8_activations: q8,
            gemm: if q8 { GemmType::F16 } else { GemmType::F32 },
            fuse,
            ..options(budget, rope, MAX_BATCH)
        })
    };
    let (_tmp, llama) = model(DType::Q4_0);
    let mut dirs = vec![("llama Q4_0".to_string(), llama, None::<tempfile::TempDir>)];
    for f in [
        "tiny-qwen3-hf",
        "tiny-gemma2-hf",
        "tiny-gemma3-hf",
        "tiny-phi3-hf",
        "tiny-smollm3-hf",
        "tiny-llama-iq4_xs.gguf",
        "tiny-gptoss-mxfp4.gguf",
    ] {
        let (tmp, dir) = gds_tests::converted_fixture(f);
        dirs.push((f.to_string(), dir, Some(tmp)));
    }
    for (name, dir, _keep) in &dirs {
        let (min, all) = bounds(dir);
        // every pairing for the llama, whose launch counts are checked; for the others each
        // activation type once and each budget once (fusing changes the launches of a
        // layer, not where its weights are: 34 s of one core for the three pairings)
        let cases = if name == "llama Q4_0" {
            vec![(all, true), (all, false), (min, true)]
        } else {
            vec![(all, true), (min, false)]
        };
        for (budget, q8) in cases {
            let (fused, f) = run(dir, budget, q8, true);
            let (alone, a) = run(dir, budget, q8, false);
            for (i, (x, y)) in fused.iter().zip(&alone).enumerate() {
                assert!(
                    x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{name} q8 {q8} budget {budget}: chunk {i}'s logits differ when fused"
                );
            }
            assert!(
                f.launches < a.launches,
                "{name} q8 {q8}: {} vs {}",
                f.launches,
                a.launches
            );
            if name == "llama Q4_0" {
                // 4 blocks; 5 passes under the GEMM length (8 fewer each with int8
                // activations), 1 of GEMM length (2 fewer)
                let per_block = if q8 { 5 * 8 + 2 } else { 6 * 2 };
                assert_eq!(a.launches - f.launches, 4 * per_block, "q8 {q8}");
            }
        }
    }
}

#[test]
fn prefill_gemms_round_their_inputs_as_the_gemm_type_asks() {
    // A prompt of GEMM_MIN_TOKENS or more runs every product through the device's GEMM,
    // whose inputs the plan's `--gemm-type` rounds: f32 (the reference; `--activations
    // f32`'s default), TF32 (cuBLAS's TF32 math mode, emulated by rounding the inputs), f16
    // (`--activations q8`'s default: the tile dequantized to f16 by `dequant16_*`, the
    // activations converted once per input by `to_f16`, `cublasGemmEx` with f32
    // accumulation). Rounded prefills' logits differ from f32's by their rounding only.
    let prompt: Vec<u32> = (0..gds_cuda::forward::GEMM_MIN_TOKENS as u32 + 3)
        .map(|i| 1 + 13 * i)
        .collect();
    let (_tmp, dir) = model(DType::Q8_0);
    let (_, all_budget) = bounds(&dir);
    let prefill = |gemm: GemmType| {
        let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
        let opts = StreamOptions {
            q8_activations: true,
            gemm,
            ..options(all_budget, rope, MAX_BATCH)
        };
        let mut s = Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap();
        let mut logits = vec![0f32; s.layout().shape.vocab];
        s.forward(&mut logits, &prompt, 0).unwrap();
        let dev = &s.vram().dev;
        (logits, [dev.gemms, dev.tf32_gemms, dev.f16_gemms])
    };
    let (exact, counts) = prefill(GemmType::F32);
    let gemms = counts[0];
    assert!(
        gemms >= 7 * 4,
        "every block's products through GEMM: {gemms}"
    );
    assert_eq!(counts, [gemms, 0, 0], "f32 GEMMs");
    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (gemm, want) in [
        (GemmType::Tf32, [gemms, gemms, 0]),
        (GemmType::F16, [gemms, 0, gemms]),
    ] {
        let (rounded, counts) = prefill(gemm);
        assert_eq!(counts, want, "{gemm:?}: every GEMM of its type");
        let worst = exact
            .iter()
            .zip(&rounded)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst > 0.0, "{gemm:?} rounding changed nothing");
        assert!(worst <= 1e-2 * scale, "{gemm:?} off by {worst} of {scale}");
        assert_eq!(argmax(&rounded), argmax(&exact), "{gemm:?}");
    }
}

#[test]
fn tf32_rounding_keeps_ten_mantissa_bits_to_nearest() {
    use crate::common::to_tf32;
    for &x in &[1.0f32, -3.25, 2f32.powi(-100), 96.0, 1.5 * 2f32.powi(100)] {
        assert_eq!(to_tf32(x), x, "{x} is a TF32 value");
    }
    let ulp = 2f32.powi(-10);
    // above half an ulp: up; below: down; a tie: to the even mantissa
    assert_eq!(to_tf32(1.0 + 0.6 * ulp), 1.0 + ulp);
    assert_eq!(to_tf32(1.0 + 0.4 * ulp), 1.0);
    assert_eq!(to_tf32(1.0 + 0.5 * ulp), 1.0);
    assert_eq!(to_tf32(1.0 + 1.5 * ulp), 1.0 + 2.0 * ulp);
    assert_eq!(to_tf32(-(1.0 + 0.6 * ulp)), -(1.0 + ulp));
    assert!(to_tf32(f32::NAN).is_nan());
    assert_eq!(to_tf32(f32::INFINITY), f32::INFINITY);
}

#[test]
fn a_budget_below_the_minimum_is_refused_before_anything_is_allocated() {
    let (_tmp, dir) = model(DType::Q8_0);
    let (min_budget, _) = bounds(&dir);
    let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
    let opts = options(min_budget - 1, rope, MAX_BATCH);
    let vram = EmuVram::new(&dir);
    let e = Streamer::with_vram(&dir, &opts, vram, Box::new(graph))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("too small"), "{e}");
}

/// Every architecture through the executor on the emulated device, against transformers:
/// the tiny random-weight models of fixtures/tiny-<arch>-hf (made by transformers itself,
/// fixtures/make_arch_fixtures.py) converted from the Hugging Face directory and from the
/// GGUF llama.cpp's converter wrote, F32 weights. The 12-token golden prompt runs as an
/// 8-token prefill (GEMM path) and four decode steps (matvec path) at the smallest VRAM
/// budget (Gemma 3's six blocks streamed through the slots), passes of at most 8 positions,
/// so the window blocks (window 4) keep rings of 11 rows that the last step wraps; the
/// logits after each call must match transformers'
/// float32 logits at that position (golden.json; golden_gguf.json for the GGUFs that drop a
/// field, see crates/gds-runtime/tests/it/architectures.rs) and give the same greedy token.
#[test]
fn every_architecture_runs_on_the_emulated_executor_and_matches_transformers() {
    let cases: &[(&str, &str, &str)] = &[
        ("llama3", "tiny-llama3-hf", "golden.json"),
        ("llama3", "tiny-llama3.gguf", "golden.json"),
        ("llama31", "tiny-llama31-hf", "golden.json"),
        ("llama31", "tiny-llama31.gguf", "golden.json"),
        ("qwen2", "tiny-qwen2-hf", "golden.json"),
        ("qwen2", "tiny-qwen2.gguf", "golden.json"),
        ("mistral", "tiny-mistral-hf", "golden.json"),
        ("mistral", "tiny-mistral.gguf", "golden_gguf.json"),
        ("qwen3", "tiny-qwen3-hf", "golden.json"),
        ("qwen3", "tiny-qwen3.gguf", "golden.json"),
        ("gemma2", "tiny-gemma2-hf", "golden.json"),
        ("gemma2", "tiny-gemma2.gguf", "golden_gguf.json"),
        ("gemma3", "tiny-gemma3-hf", "golden.json"),
        ("gemma3", "tiny-gemma3.gguf", "golden_gguf.json"),
        ("phi3", "tiny-phi3-hf", "golden.json"),
        ("phi3", "tiny-phi3.gguf", "golden.json"),
        ("phi35", "tiny-phi35-hf", "golden.json"),
        ("phi35", "tiny-phi35.gguf", "golden.json"),
        ("smollm3", "tiny-smollm3-hf", "golden.json"),
        ("smollm3", "tiny-smollm3.gguf", "golden.json"),
        // mixtures of experts: routed on the host, experts on their tokens' rows
        ("qwen3moe", "tiny-qwen3moe-hf", "golden.json"),
        ("qwen3moe", "tiny-qwen3moe.gguf", "golden.json"),
        ("mixtral", "tiny-mixtral-hf", "golden.json"),
        ("mixtral", "tiny-mixtral.gguf", "golden.json"),
        ("mixtral", "tiny-mixtral-per-expert.gguf", "golden.json"),
        // attention sinks, biases, clamped SwiGLU, MXFP4 experts
        ("gptoss", "tiny-gptoss-hf", "golden.json"),
        ("gptoss", "tiny-gptoss.gguf", "golden.json"),
        ("gptoss", "tiny-gptoss-mxfp4.gguf", "golden_mxfp4.json"),
        ("gptoss", "tiny-gptoss-mxfp4-hf", "golden_mxfp4.json"),
    ];
    let mut worst_all = 0f64;
    for &(arch, input, golden) in cases {
        let golden = gds_tests::golden(arch, golden);
        let tokens = &golden.tokens;
        assert_eq!(tokens.len(), 12, "{arch}: golden prompt length");
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        // The context the CPU check runs at (LongRoPE picks its factors by it).
        let ctx = 64;
        let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
        let min_budget = layout.plan(ctx, 8, usize::MAX >> 1).unwrap().min_budget as u64;
        let mut chunks: Vec<&[u32]> = vec![&tokens[..8]];
        chunks.extend(tokens[8..].chunks(1));
        let (rows, report) = run_streamer_ctx(&dir, min_budget, &chunks, ctx, 8);
        // (two blocks cost as much as the two slots: they stay resident)
        if layout.blocks.len() > 2 {
            assert!(report.streamed > 0, "{input}: nothing streamed");
        }
        // one row per call: the logits of each call's last position (7, 8, .. 11)
        let worst = golden.max_diff(&rows, 7, input);
        eprintln!("{input}: max |logit diff| vs transformers {worst:.2e}");
        assert!(worst < 5e-4, "{input}: max |logit diff| {worst}");
        worst_all = worst_all.max(worst);
    }
    eprintln!("all architectures: max |logit diff| {worst_all:.2e}");
}

/// A mixture of experts' products on every path the executor has: each expert's tokens
/// through GEMM on a dequantized tile (`gemm_min_tokens` 1: even one token), through the
/// matvec kernels only (`usize::MAX`), and the default crossover, in passes of 8, 1, 3 and
/// 1 tokens (an expert with all of a pass's tokens, with some gathered, with none), at the
/// smallest VRAM budget: the logits after each pass equal the CPU runtime's (f32
/// activations) on the same files. Qwen 3's experts (F32, renormalized softmax) and
/// gpt-oss's (MXFP4, biases, softmax over the top k, sinks).
#[test]
fn experts_match_the_cpu_runtime_on_every_product_path() {
    let tokens: Vec<u32> = (0..13u32).map(|i| (i * 29 + 5) % 97).collect();
    let chunks: Vec<&[u32]> = vec![&tokens[..8], &tokens[8..9], &tokens[9..12], &tokens[12..]];
    for input in ["tiny-qwen3moe-hf", "tiny-gptoss-mxfp4.gguf"] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let cpu = run_cpu(&dir, &chunks);
        let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
        let min_budget = layout.plan(CTX, 8, usize::MAX >> 1).unwrap().min_budget as u64;
        for gemm_min in [1, gds_cuda::forward::GEMM_MIN_TOKENS, usize::MAX] {
            let (rows, _) = run_streamer_with(&dir, &chunks, CTX, |rope| StreamOptions {
                gemm_min_tokens: gemm_min,
                ..options(min_budget, rope, 8)
            });
            for (i, (logits, want)) in rows.iter().zip(&cpu).enumerate() {
                let diff = logits
                    .iter()
                    .zip(want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    diff < 1e-4,
                    "{input} gemm_min {gemm_min} pass {i}: max |logit diff| {diff}"
                );
                assert_eq!(argmax(logits), argmax(want), "{input} pass {i}");
            }
        }
    }
}

/// The runtime's one-sequence GPU path (`gds_runtime::cuda_graph::one_sequence`: what `gdsrun
/// run`, `bench` and `perplexity --backend cuda` open, over the cache `gpuplan` plans): a
/// batch of one through the batched executor. Window blocks keep the CPU's rings (window 4,
/// passes of up to 3: rings of 12 positions), which 24 positions in passes of 1 to 3 wrap
/// twice; the logits after every pass equal the CPU runtime's, which keeps the whole
/// context, at the smallest VRAM budget (Gemma 3's blocks stream). Tiny Gemma 3 and Mistral:
/// five-in-six and all blocks windowed. The rings bound how far the sequence can be cut
/// back, and the plan's KV bytes are the rings'. With an f16 cache (`gdsrun`'s default,
/// `kv_store_f16`/`attention_f16`) the logits are the CPU's over its own f16 cache.
#[test]
fn window_blocks_keep_a_ring_of_their_window_and_match_the_whole_cache() {
    use gds_runtime::{Executor, KvDtype};
    for (input, kv_type) in [
        ("tiny-gemma3-hf", KvDtype::F32),
        ("tiny-mistral-hf", KvDtype::F32),
        ("tiny-gemma3-hf", KvDtype::F16),
    ] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
        let config = gds_runtime::Model::load(&dir, CTX, 1)
            .unwrap()
            .config
            .clone();
        let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
        let mut streamed = 0;
        let mut gpu = gds_runtime::cuda_graph::one_sequence(
            &config,
            kv_type,
            CTX,
            3,
            1,
            |spec, batch, outputs| {
                let overhead = layout.overhead_bytes_with(CTX, batch, outputs, spec);
                let plan = layout.plan_with(overhead, usize::MAX >> 1).unwrap();
                let opts = StreamOptions {
                    kv: Some(spec.clone()),
                    max_outputs: Some(outputs),
                    ..options(plan.min_budget as u64, rope, batch)
                };
                let s =
                    Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap();
                streamed = s.plan.resident.iter().filter(|r| !**r).count();
                Ok(s)
            },
        )
        .unwrap();
        // (tiny Mistral's two blocks fit the smallest budget's two slots: nothing streams)
        if input == "tiny-gemma3-hf" {
            assert!(streamed > 0, "{input}: nothing streamed");
        }
        assert_eq!(gpu.kv().ring_positions(), Some(12), "{input}");
        let tokens: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 97).collect();
        let mut chunks: Vec<&[u32]> = Vec::new();
        let mut rest = &tokens[..];
        for n in [3usize, 1, 2].iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (c, r) = rest.split_at((*n).min(rest.len()));
            chunks.push(c);
            rest = r;
        }
        let cpu = run_cpu_kv(&dir, &chunks, kv_type);
        // the f16 cache's distance from the exact one, which the GPU's must stay well inside
        let exact = match kv_type {
            KvDtype::F16 => Some(run_cpu(&dir, &chunks)),
            KvDtype::F32 => None,
        };
        let dist =
            |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let mut pos = 0;
        for (i, (chunk, c)) in chunks.iter().zip(&cpu).enumerate() {
            let end = pos + chunk.len();
            let mut g = Vec::new();
            gpu.eval(chunk, pos, end - 1..end, &mut |_, l| g = l.to_vec())
                .unwrap();
            let diff = dist(&g, c);
            // Both round the same keys and values to f16, but those differ in their last f32
            // bits between the two (kernel sums), which now and then rounds one element to
            // the neighbouring f16: such a flip moves a logit by ~1e-3, a tenth of f16's own
            // distance from f32 (a GPU cache kept in f32, or rounded another way, sits at
            // that distance, not inside it).
            let bound = match &exact {
                Some(e) => (dist(c, &e[i]) / 4.0).max(1e-4),
                None => 1e-4,
            };
            assert!(
                diff < bound,
                "{input} {kv_type:?} pass {i}: max |logit diff| {diff} (bound {bound})"
            );
            assert_eq!(argmax(&g), argmax(c), "{input} {kv_type:?} pass {i}");
            pos = end;
        }
        // the rings have dropped the keys position 2 sees; the last few are still there
        assert!(!gpu.can_truncate(24, 2), "{input}");
        assert!(gpu.can_truncate(24, 20), "{input}");
        // the plan's KV cache: rings for the window blocks, the whole context elsewhere
        let windowed = layout.shape.windows.iter().filter(|&&w| w > 0).count();
        let windows: Vec<Option<usize>> = (0..config.n_layers).map(|l| config.window(l)).collect();
        let kv = gds_runtime::gpuplan::one_sequence_kv(kv_type, CTX, config.kv_dim(), &windows, 3);
        let (spec, _) = gds_runtime::gpuplan::kv_spec(&kv).unwrap();
        assert_eq!(spec.f16, kv_type == KvDtype::F16);
        let (kv_dim, elem) = (config.kv_dim(), kv_type.size());
        let full = config.n_layers * CTX * kv_dim * 2 * elem;
        assert_eq!(
            spec.bytes(kv_dim),
            full - windowed * (CTX - 12) * kv_dim * 2 * elem,
            "{input}"
        );
    }
}

/// Speculative decoding on the executor: a pass evaluates the sampled token and up to three
/// guesses and returns logits at each of them (the head over the pass's last rows). The
/// guesses are the plain run's next tokens with one made wrong by turns (the first, the
/// second, …, none), so passes accept all, some or none of them; the positions a rejected
/// guess wrote are overwritten by the next pass. The tokens must be the plain greedy run's,
/// every logit row equal to the plain run's at that position, in fewer passes — at the
/// smallest VRAM budget (blocks stream) and passes of at most 8, so Gemma 3's window blocks
/// keep rings of 11 rows that wrap. The rings also bound how far the sequence can be cut
/// back (`can_truncate`).
#[test]
fn speculative_passes_give_the_plain_greedy_tokens_and_logits() {
    // (Qwen 3's blocks are Llama 3's plus head norms, which every_architecture… covers)
    for input in ["tiny-llama3-hf", "tiny-gemma3-hf"] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let max_batch = 8;
        let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
        let budget = layout
            .plan(CTX, max_batch, usize::MAX >> 1)
            .unwrap()
            .min_budget as u64;
        let open = || {
            let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
            let opts = options(budget, rope, max_batch);
            Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap()
        };
        let prompt: Vec<u32> = (0..6u32).map(|i| (i * 37 + 11) % 97).collect();
        let n = 28;

        let mut s = open();
        let vocab = s.layout().shape.vocab;
        let mut l = vec![0f32; vocab];
        s.forward(&mut l, &prompt, 0).unwrap();
        let (mut plain, mut plain_logits) = (Vec::new(), Vec::new());
        let mut pos = prompt.len();
        loop {
            let t = argmax(&l);
            plain.push(t);
            plain_logits.push(l.clone());
            if plain.len() == n {
                break;
            }
            s.forward(&mut l, &[t], pos).unwrap();
            pos += 1;
        }

        let mut s = open();
        assert_eq!(s.logit_rows(), max_batch);
        let k = 3;
        let mut rows = vec![0f32; (k + 1) * vocab];
        s.forward(&mut l, &prompt, 0).unwrap();
        let (mut out, mut passes, mut rejected, mut wrong_at) = (Vec::new(), 0, 0, 0);
        let mut pos = prompt.len();
        loop {
            let t = argmax(&l);
            out.push(t);
            if out.len() == n {
                break;
            }
            let i0 = out.len();
            let mut guesses = plain[i0..(i0 + k).min(n)].to_vec();
            wrong_at = (wrong_at + 1) % (k + 2);
            if let Some(g) = guesses.get_mut(wrong_at) {
                *g = (*g + 1) % vocab as u32;
            }
            let mut toks = vec![t];
            toks.extend_from_slice(&guesses);
            let r = toks.len();
            s.forward(&mut rows[..r * vocab], &toks, pos).unwrap();
            passes += 1;
            let mut j = 0;
            loop {
                let row = &rows[j * vocab..(j + 1) * vocab];
                let want = &plain_logits[(i0 + j).min(n - 1)];
                if i0 + j < n {
                    let diff = row
                        .iter()
                        .zip(want)
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        diff < 1e-4,
                        "{input}: row {j} at {}: |diff| {diff}",
                        pos + j
                    );
                }
                if j < guesses.len() && argmax(row) == guesses[j] {
                    out.push(guesses[j]);
                    j += 1;
                } else {
                    rejected += guesses.len() - j;
                    l.copy_from_slice(row);
                    break;
                }
            }
            pos += j + 1;
            if out.len() == n {
                break;
            }
        }
        assert_eq!(out, plain, "{input}: speculative tokens differ");
        assert!(
            passes < n / 2 && rejected > 0,
            "{input}: {passes} passes, {rejected} rejected"
        );
        // what the window rings still hold
        let windowed = layout.shape.windows.iter().any(|&w| w > 0);
        assert!(s.can_truncate(pos, pos - 3));
        assert_eq!(s.can_truncate(pos, pos - 20), !windowed, "{input}");
        let e = s.forward(&mut rows[..2 * vocab], &[1], pos).unwrap_err();
        assert!(e.to_string().contains("logits buffer"), "{e}");
    }
}

/// Several sequences in one pass over a paged KV cache (`forward_batch`): three sequences
/// of different lengths prefill and decode together — prompts of 5, 9 and 3 tokens, the
/// second sharing the first's leading block (the same 4 tokens: its table points at the
/// first's block and its pass starts at position 4), blocks of 4 positions handed out in a
/// scrambled order — and every logit row equals the single-sequence executor's at that
/// position for the same tokens. On Gemma 3 the window blocks read a table of their own
/// whose entries behind the window are released ([`NO_BLOCK`]: never read); gpt-oss (window
/// blocks too, sinks, MXFP4 experts) and Qwen 3's experts route each pass's tokens of all
/// three sequences together. At the smallest VRAM budget the streamed blocks are read once
/// per pass, not once per sequence.
#[test]
fn several_sequences_in_one_paged_pass_match_each_sequence_alone() {
    use gds_cuda::plan::{KvGeo, KvSpec};
    use gds_cuda::stream::{PassInput, NO_BLOCK};
    const BLOCK: usize = 4;
    let per_seq = CTX / BLOCK;
    // Gemma 3: window and global blocks, two RoPE tables, two block tables (llama's plain
    // cache runs in the_servers_batches_… below); gpt-oss and Qwen 3's experts: the
    // sequences' tokens routed to different experts within one pass
    for input in [
        "tiny-gemma3-hf",
        "tiny-gptoss-mxfp4.gguf",
        "tiny-qwen3moe-hf",
    ] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
        let windows = layout.shape.windows.clone();
        let separate = windows.iter().any(|&w| w > 0);
        let n_blocks = 3 * per_seq;
        let spec = KvSpec {
            layers: windows
                .iter()
                .map(|&w| KvGeo {
                    block: BLOCK,
                    blocks: n_blocks,
                    ring: 0,
                    table: usize::from(w > 0),
                })
                .collect(),
            max_blocks: vec![per_seq; 1 + usize::from(separate)],
            max_seqs: 3,
            f16: false,
        };
        let max_batch = 16;
        // the smallest budget with this cache: blocks stream
        let budget = layout
            .plan_with(
                layout.overhead_bytes_with(CTX, max_batch, 8, &spec),
                usize::MAX >> 1,
            )
            .unwrap()
            .min_budget as u64;
        let open = |kv: Option<KvSpec>| {
            let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
            let opts = StreamOptions {
                kv,
                max_outputs: Some(8),
                ..options(budget, rope, max_batch)
            };
            Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap()
        };
        let mut s = open(Some(spec.clone()));
        assert!(s.plan.streamed_bytes_per_token > 0 || layout.blocks.len() <= 2);
        let vocab = s.layout().shape.vocab;
        let prompt = |n: usize, seed: u32| -> Vec<u32> {
            (0..n as u32).map(|i| (i * 37 + seed) % 97).collect()
        };
        let mut seqs: Vec<Vec<u32>> = vec![prompt(5, 11), prompt(9, 11), prompt(3, 5)];
        assert_eq!(seqs[0][..4], seqs[1][..4], "the shared prefix block");
        // block tables: a scrambled free list; sequence 1 takes sequence 0's first block
        let mut free: Vec<u32> = (0..n_blocks as u32)
            .map(|b| (b * 7 + 3) % n_blocks as u32)
            .collect();
        let mut tables = vec![vec![NO_BLOCK; per_seq]; 3];
        let mut wtables = vec![vec![NO_BLOCK; per_seq]; 3];
        let mut wfree = free.clone();
        let need = |tables: &mut Vec<Vec<u32>>, free: &mut Vec<u32>, s: usize, upto: usize| {
            for e in tables[s].iter_mut().take(upto.div_ceil(BLOCK)) {
                if *e == NO_BLOCK {
                    *e = free.pop().unwrap();
                }
            }
        };
        need(&mut tables, &mut free, 0, 4);
        tables[1][0] = tables[0][0];
        need(&mut wtables, &mut wfree, 0, 4);
        wtables[1][0] = wtables[0][0];
        // what each sequence has evaluated, and the logits each output row got
        let mut done = [0usize, 4, 0];
        // the shared block holds positions 0..4 of sequence 0: written by its first pass
        let mut got: Vec<Vec<(usize, Vec<f32>)>> = vec![Vec::new(); 3];
        let loads_before = s.vram().loads.len();
        let mut passes = 0;
        for step in 0..5 {
            // which sequences run this pass: sequence 1 joins once 0 has written the shared
            // block
            let members: Vec<usize> = if step == 0 { vec![0, 2] } else { vec![0, 1, 2] };
            let (mut tok, mut pos, mut seq, mut outputs) = (vec![], vec![], vec![], vec![]);
            for &m in &members {
                let upto = seqs[m].len();
                need(&mut tables, &mut free, m, upto);
                need(&mut wtables, &mut wfree, m, upto);
                for (p, &t) in seqs[m].iter().enumerate().skip(done[m]) {
                    tok.push(t);
                    pos.push(p as u32);
                    seq.push(m as u32);
                }
                outputs.push(tok.len() as u32 - 1);
            }
            let flat: Vec<u32> = tables.concat();
            let wflat: Vec<u32> = wtables.concat();
            let tabs: Vec<&[u32]> = if separate {
                vec![&flat, &wflat]
            } else {
                vec![&flat]
            };
            let mut logits = vec![0f32; outputs.len() * vocab];
            s.forward_batch(
                &mut logits,
                &PassInput {
                    tokens: &tok,
                    pos: &pos,
                    seq: &seq,
                    outputs: &outputs,
                    tables: &tabs,
                },
            )
            .unwrap();
            passes += 1;
            for (i, &m) in members.iter().enumerate() {
                let row = logits[i * vocab..(i + 1) * vocab].to_vec();
                done[m] = seqs[m].len();
                got[m].push((done[m] - 1, row.clone()));
                seqs[m].push(argmax(&row));
                // the window table's entries no later query reads are released
                if let Some(w) = windows.iter().copied().filter(|&w| w > 0).max() {
                    let keep_from = (done[m] + 1).saturating_sub(w) / BLOCK;
                    for e in wtables[m].iter_mut().take(keep_from) {
                        *e = NO_BLOCK;
                    }
                }
            }
        }
        // streamed layers: read once per pass
        let streamed_loads = s.vram().loads[loads_before..]
            .iter()
            .filter(|(_, sync)| !sync)
            .count();
        assert_eq!(
            streamed_loads,
            passes * s.plan.resident.iter().filter(|r| !**r).count(),
            "{input}: streamed layers must be read once per pass"
        );
        // each sequence alone, fed the same tokens, on a single-sequence cache
        for (m, rows) in got.iter().enumerate() {
            let mut one = open(None);
            let toks = &seqs[m];
            let mut l = vec![0f32; vocab];
            let mut at = std::collections::HashMap::new();
            // the prompt in one pass, then a token at a time
            let first = rows[0].0;
            one.forward(&mut l, &toks[..=first], 0).unwrap();
            at.insert(first, l.clone());
            for p in first + 1..toks.len() - 1 {
                one.forward(&mut l, &toks[p..p + 1], p).unwrap();
                at.insert(p, l.clone());
            }
            for (p, row) in rows {
                let want = &at[p];
                let diff = row
                    .iter()
                    .zip(want)
                    .fold(0f32, |d, (a, b)| d.max((a - b).abs()));
                assert!(
                    diff < 1e-4,
                    "{input}: sequence {m} position {p}: max |diff| {diff}"
                );
                assert_eq!(
                    argmax(row),
                    argmax(want),
                    "{input}: sequence {m} position {p}"
                );
            }
        }
        // a table entry a token would read outside the cache is refused before any launch
        let bad = vec![n_blocks as u32; per_seq * 3];
        let tabs: Vec<&[u32]> = vec![&bad; spec.max_blocks.len()];
        let mut l = vec![0f32; vocab];
        let e = s
            .forward_batch(
                &mut l,
                &PassInput {
                    tokens: &[1],
                    pos: &[0],
                    seq: &[0],
                    outputs: &[0],
                    tables: &tabs,
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("outside its"), "{e}");
    }
}

/// The server's passes alike on the CPU and the (emulated) GPU: one [`KvCache`] paged as
/// `gdsrun serve` pages it (blocks of 4 from a pool, the second sequence sharing the first
/// one's leading block; on a model with window layers they take a pool of their own,
/// released behind the window as the scheduler releases them) drives the CPU's `BatchExecutor` and,
/// through `PassStaging` (what the CUDA `BatchExecutor` runs), the executor on the
/// emulated device at its smallest VRAM budget. Every logit row agrees, with an f32 cache
/// and with the f16 cache `gdsrun serve` holds by default (the CPU's f16 rows and the GPU's
/// `kv_store_f16`/`attention_f16`; Gemma 3's window pool too).
#[test]
fn the_servers_batches_give_the_same_logits_on_the_cpu_and_the_gpu_executor() {
    use gds_runtime::cuda_graph::PassStaging;
    use gds_runtime::exec::{BatchExecutor, CpuBatchExecutor};
    use gds_runtime::{Batch, KvCache, KvDtype, Model};
    const BLOCK: usize = 4;
    // llama 3 here; Gemma 3's window pool runs in the two tests around this one, and here
    // with f16
    for (input, kv_type) in [
        ("tiny-llama3-hf", KvDtype::F32),
        ("tiny-llama3-hf", KvDtype::F16),
        ("tiny-gemma3-hf", KvDtype::F16),
    ] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let cpu_model = || {
            let mut m = Model::load(&dir, CTX, 1).unwrap();
            m.set_f32_activations(true);
            m
        };
        let m = cpu_model();
        let c = m.config.clone();
        let windows: Vec<Option<usize>> = (0..c.n_layers).map(|l| c.window(l)).collect();
        let n_blocks = 3 * CTX / BLOCK;
        let paged = |dtype| {
            KvCache::paged_windowed(
                dtype,
                &windows,
                3,
                CTX,
                c.kv_dim(),
                BLOCK,
                n_blocks,
                n_blocks,
            )
        };
        let mut kv = paged(kv_type);
        let (max_batch, outputs) = (16, 8);
        let mut cpu = CpuBatchExecutor::new(m, max_batch, outputs, CTX);
        // with f16: the CPU over an f32 cache paged alike (the same calls give the same
        // blocks), how far f16 itself moves the logits
        let mut exact = (kv_type == KvDtype::F16).then(|| {
            (
                paged(KvDtype::F32),
                CpuBatchExecutor::new(cpu_model(), max_batch, outputs, CTX),
            )
        });
        let mut staging = PassStaging::new(&kv).unwrap();
        let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
        let budget = layout
            .plan_with(
                layout.overhead_bytes_with(CTX, max_batch, outputs, staging.spec()),
                usize::MAX >> 1,
            )
            .unwrap()
            .min_budget as u64;
        let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
        let opts = StreamOptions {
            kv: Some(staging.spec().clone()),
            max_outputs: Some(outputs),
            ..options(budget, rope, max_batch)
        };
        let mut gpu =
            Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap();
        let vocab = c.vocab_size;
        let prompt = |n: usize, seed: u32| -> Vec<u32> {
            (0..n as u32).map(|i| (i * 37 + seed) % 97).collect()
        };
        let mut seqs: Vec<Vec<u32>> = vec![prompt(6, 11), prompt(9, 11), prompt(3, 5)];
        let windowed = kv.pool_window().is_some();
        // blocks for positions up to `upto` of slot `s` (and their window blocks)
        let grow = |kv: &mut KvCache, s: usize, upto: usize| {
            while kv.table(s).len() * BLOCK < upto {
                let b = kv.alloc().unwrap();
                kv.push_block(s, b);
                if windowed {
                    let w = kv.alloc_window().unwrap();
                    kv.push_window(s, w);
                }
            }
        };
        // slot 1 shares slot 0's first block (the same 4 prompt tokens)
        let share = |kv: &mut KvCache| {
            grow(kv, 0, 4);
            let (b0, w0) = (kv.table(0)[0], kv.window_table(0).first().copied());
            kv.retain(b0);
            kv.push_block(1, b0);
            if let Some(w) = w0 {
                kv.retain_window(w);
                kv.push_window(1, w);
            }
        };
        share(&mut kv);
        if let Some((kv, _)) = exact.as_mut() {
            share(kv);
        }
        let mut done = [0usize, 4, 0];
        let mut batch = Batch::with_capacity(max_batch);
        let mut rows = vec![0f32; outputs * vocab];
        let mut worst = 0f32;
        for step in 0..6 {
            let members: Vec<usize> = if step == 0 { vec![0, 2] } else { vec![0, 1, 2] };
            batch.clear();
            for &s in &members {
                let upto = seqs[s].len();
                grow(&mut kv, s, upto);
                if let Some((kv, _)) = exact.as_mut() {
                    grow(kv, s, upto);
                }
                for (p, &t) in seqs[s].iter().enumerate().skip(done[s]) {
                    batch.push(t, p, s, p + 1 == upto);
                }
            }
            let n = cpu.forward(&mut kv, &batch).unwrap();
            if let Some((kv, cpu)) = exact.as_mut() {
                cpu.forward(kv, &batch).unwrap();
            }
            let g = staging.run(&mut gpu, &kv, &batch, &mut rows).unwrap();
            assert_eq!((n, g), (members.len(), members.len()));
            let dist =
                |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |d, (x, y)| d.max((x - y).abs()));
            for (i, &s) in members.iter().enumerate() {
                let (want, got) = (cpu.logits(i), &rows[i * vocab..(i + 1) * vocab]);
                let diff = dist(got, want);
                worst = worst.max(diff);
                // f16: both caches round to f16, but their keys and values differ in the
                // last f32 bits, which now and then rounds one element to the neighbouring
                // f16 (window_blocks_keep_a_ring… explains the bound)
                let bound = match &exact {
                    Some((_, e)) => (dist(want, e.logits(i)) / 4.0).max(1e-4),
                    None => 1e-4,
                };
                assert!(
                    diff < bound,
                    "{input} {kv_type:?} step {step} slot {s}: max |diff| {diff} (bound {bound})"
                );
                assert_eq!(
                    argmax(got),
                    argmax(want),
                    "{input} {kv_type:?} step {step} slot {s}"
                );
                done[s] = seqs[s].len();
                seqs[s].push(argmax(want));
                kv.drop_window_behind(s, done[s]);
                if let Some((kv, _)) = exact.as_mut() {
                    kv.drop_window_behind(s, done[s]);
                }
            }
        }
        if windowed {
            assert!(
                kv.window_table(0).contains(&gds_runtime::NO_BLOCK),
                "{input}: no window block was released"
            );
        }
        eprintln!("{input} {kv_type:?}: CPU vs GPU executor, max |logit diff| {worst:.2e}");
    }
}

/// The server's scheduler (`gds_serve::scheduler::Engine`: continuous batching, paged KV
/// blocks, prefix sharing) driven in process over the executor on the emulated device
/// (`StreamerBatch`, the type `gdsrun serve --backend cuda` runs with `CudaVram`) and over
/// the CPU: four greedy requests of different lengths admitted together (two with the same
/// prompt), prefill chunks and decode tokens mixed in steps of up to 16 tokens on Gemma 3
/// (window layers in their own pool), give the same tokens and finish reasons on both, the
/// executor at its smallest VRAM budget (blocks streamed once per step); two embedding
/// requests beside them (mean pooling over a prompt longer than a step, last-token pooling)
/// give the same vectors.
#[test]
fn the_servers_scheduler_runs_on_the_emulated_gpu_executor_as_on_the_cpu() {
    use gds_runtime::cuda_graph::{PassStaging, StreamerBatch};
    use gds_runtime::exec::{BatchExecutor, CpuBatchExecutor};
    use gds_runtime::{KvCache, KvDtype, Model};
    use gds_serve::scheduler::{max_outputs, Engine, EngineConfig, Event, Pooling, Request};
    let (_tmp, dir) = gds_tests::converted_fixture("tiny-gemma3-hf");
    let cfg = || EngineConfig {
        max_batch: 4,
        step_tokens: 16,
        ctx: CTX,
    };
    let prompts: Vec<Vec<u32>> = vec![
        (0..7u32).map(|i| (i * 37 + 11) % 97).collect(),
        (0..7u32).map(|i| (i * 37 + 11) % 97).collect(),
        (0..3u32).map(|i| (i * 13 + 5) % 97).collect(),
        (0..12u32).map(|i| (i * 7 + 2) % 97).collect(),
        (0..21u32).map(|i| (i * 11 + 3) % 97).collect(),
        (0..9u32).map(|i| (i * 5 + 1) % 97).collect(),
    ];
    let embed = [
        None,
        None,
        None,
        None,
        Some(Pooling::Mean),
        Some(Pooling::Last),
    ];
    let run = |exec: Box<dyn BatchExecutor>, kv: KvCache| {
        let metrics = std::sync::Arc::new(gds_serve::metrics::ServerMetrics::default());
        let engine = Engine::new(exec, kv, cfg(), Vec::new(), metrics);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut outs = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
            let greedy = gds_runtime::sampler::SamplerConfig {
                temp: 0.0,
                ..Default::default()
            };
            tx.send(Request {
                max_tokens: if embed[i].is_some() { 0 } else { 6 + i },
                ignore_eos: true,
                embed: embed[i],
                ..Request::plain(p.clone(), greedy, etx, Default::default())
            })
            .unwrap();
            outs.push(erx);
        }
        drop(tx);
        engine.run(rx);
        outs.into_iter()
            .map(|mut rx| {
                let mut toks = Vec::new();
                let mut end = None;
                let mut vector = Vec::new();
                while let Ok(e) = rx.try_recv() {
                    match e {
                        Event::Token(t, _) => toks.push(t),
                        Event::Done(d) => end = Some(format!("{:?}", d.finish)),
                        Event::Embedding(v) => vector = v,
                        Event::Prefilled(_) => {}
                        other => panic!("unexpected event {other:?}"),
                    }
                }
                (toks, end, vector)
            })
            .collect::<Vec<_>>()
    };
    let windows_of = |c: &gds_runtime::Config| -> Vec<Option<usize>> {
        (0..c.n_layers).map(|l| c.window(l)).collect()
    };
    let paged = |c: &gds_runtime::Config| {
        KvCache::paged_windowed(KvDtype::F32, &windows_of(c), 4, CTX, c.kv_dim(), 4, 64, 64)
    };
    // the CPU
    let mut m = Model::load(&dir, CTX, 1).unwrap();
    m.set_f32_activations(true);
    let c = m.config.clone();
    let outputs = max_outputs(&cfg());
    let cpu = run(
        Box::new(CpuBatchExecutor::new(m, 16, outputs, CTX)),
        paged(&c),
    );
    // the emulated GPU at its smallest budget for this cache
    let mut kv = paged(&c);
    let staging = PassStaging::new(&kv).unwrap();
    let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
    let budget = layout
        .plan_with(
            layout.overhead_bytes_with(CTX, 16, outputs, staging.spec()),
            usize::MAX >> 1,
        )
        .unwrap()
        .min_budget as u64;
    let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
    let opts = StreamOptions {
        kv: Some(staging.spec().clone()),
        max_outputs: Some(outputs),
        ..options(budget, rope, 16)
    };
    let s = Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap();
    assert!(s.plan.streamed_bytes_per_token > 0, "nothing streamed");
    kv.drop_rows();
    let n_embd = c.n_embd;
    let gpu = run(Box::new(StreamerBatch::new(s, c, staging, outputs)), kv);
    for (i, (g, want)) in gpu.iter().zip(&cpu).enumerate() {
        assert_eq!(g.1, want.1, "request {i}: GPU executor vs CPU");
        if embed[i].is_some() {
            assert!(g.0.is_empty(), "request {i} generated: {g:?}");
            assert_eq!(g.2.len(), n_embd, "request {i}");
            assert!(
                want.2.iter().any(|&x| x != 0.0),
                "request {i}: a zero vector"
            );
            let diff =
                g.2.iter()
                    .zip(&want.2)
                    .fold(0f32, |d, (a, b)| d.max((a - b).abs()));
            assert!(diff < 1e-4, "request {i}: embedding max |diff| {diff}");
            continue;
        }
        assert_eq!(g.0.len(), 6 + i, "request {i}: {g:?}");
        assert_eq!(g.0, want.0, "request {i}: GPU executor vs CPU");
    }
}

/// Every logit row of a run of one sequence through passes of `shape` (tokens, logit rows:
/// the pass's last ones), on the executor at VRAM budget `budget`, with `graphs`
/// (captures and replays) or without; and the graph counters.
fn run_passes(
    dir: &Path,
    budget: u64,
    q8: bool,
    graphs: bool,
    shape: &[(usize, usize)],
) -> (Vec<Vec<f32>>, gds_cuda::stream::GraphStats) {
    let (graph, rope) = CudaGraph::open(dir, CTX).unwrap();
    let opts = StreamOptions {
        q8_activations: q8,
        graphs,
        ..options(budget, rope, 16)
    };
    let mut s = Streamer::with_vram(dir, &opts, EmuVram::new(dir), Box::new(graph)).unwrap();
    let vocab = s.layout().shape.vocab;
    let mut rows = Vec::new();
    let mut pos = 0;
    for (i, &(n, outs)) in shape.iter().enumerate() {
        let toks: Vec<u32> = (pos..pos + n).map(|p| (p as u32 * 37 + 11) % 97).collect();
        let mut l = vec![0f32; outs * vocab];
        s.forward(&mut l, &toks, pos)
            .unwrap_or_else(|e| panic!("pass {i} of {n} at {pos}: {e}"));
        rows.extend(l.chunks(vocab).map(<[f32]>::to_vec));
        pos += n;
    }
    (rows, s.graph_stats)
}

/// CUDA graphs (the executor's captures, `StreamOptions::graphs`): a decode pass's launches,
/// recorded once when its shape (tokens, output rows) comes the second time and replayed
/// for every later pass of that shape, give the logits of launching them each time, bit
/// for bit — at every position, so nothing the launches carry may depend on the position
/// (what a pass reads per step lives in device buffers). Each shape of pass gets its own
/// capture: 1, 2 and 3 tokens with every token's logits (speculative checks) and 2 and 3
/// tokens with the last one's (a prompt's chunks); a prompt of GEMM length is never
/// captured. Every dense architecture (Llama 3 also with int8 activations; Gemma 2's score
/// caps, Gemma 3's window rings and two RoPE tables, Qwen 2's biases, Qwen 3's head norms,
/// Phi-3's fused QKV, SmolLM3's layers without RoPE). Where a layer streams, or the model
/// routes experts on the host (gpt-oss), nothing is captured.
#[test]
fn captured_passes_replay_to_the_logits_of_launching_them() {
    // shapes (tokens, logit rows): (1,1) ×6, (2,2) ×2, (3,3) ×2, (3,1) ×3, (2,1) ×2
    let shape = [
        (9usize, 1usize),
        (1, 1),
        (3, 1),
        (1, 1),
        (2, 2),
        (1, 1),
        (3, 3),
        (2, 1),
        (3, 1),
        (2, 2),
        (1, 1),
        (3, 3),
        (2, 1),
        (1, 1),
        (3, 1),
        (1, 1),
    ];
    for (input, q8) in [
        ("tiny-llama3-hf", false),
        ("tiny-llama3-hf", true),
        ("tiny-llama31-hf", false),
        ("tiny-qwen2-hf", true),
        ("tiny-mistral-hf", false),
        ("tiny-qwen3-hf", false),
        ("tiny-gemma2-hf", true),
        ("tiny-gemma3-hf", false),
        ("tiny-phi3-hf", false),
        ("tiny-phi35-hf", true),
        ("tiny-smollm3-hf", false),
    ] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let (_, all) = bounds(&dir);
        let (plain, none) = run_passes(&dir, all, q8, false, &shape);
        assert_eq!(none, Default::default(), "{input}: graphs off");
        let (replayed, st) = run_passes(&dir, all, q8, true, &shape);
        // every shape captured at its second pass, replayed after
        assert_eq!(st.captures, 5, "{input} q8 {q8}: {st:?}");
        assert_eq!(st.replays, 4 + 1, "{input} q8 {q8}: {st:?}");
        assert_eq!(plain.len(), replayed.len());
        for (i, (a, b)) in plain.iter().zip(&replayed).enumerate() {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{input} q8 {q8}: logit row {i} differs when replayed"
            );
        }
    }
    for input in ["tiny-gemma3-hf", "tiny-gptoss-mxfp4.gguf"] {
        let (_tmp, dir) = gds_tests::converted_fixture(input);
        let (min, all) = bounds(&dir);
        let budget = if input == "tiny-gemma3-hf" { min } else { all };
        let (_, st) = run_passes(&dir, budget, false, true, &shape);
        assert_eq!(st, Default::default(), "{input}: captured");
    }
}

/// The server's decode steps replayed: three sequences of a paged cache (blocks of 4 from
/// a pool in scrambled order, one sharing another's first block) decode together through
/// `PassStaging`, every layer resident, graphs on; the block tables grow between steps
/// (a new block every fourth position), which the replayed launches read from the tables'
/// device buffer. Every logit row equals the same steps' without graphs, bit for bit, and
/// the step shape (3 tokens, 3 outputs) is replayed from the third step on.
#[test]
fn the_servers_decode_steps_replay_with_growing_block_tables() {
    use gds_runtime::cuda_graph::PassStaging;
    use gds_runtime::{Batch, KvCache, KvDtype};
    const BLOCK: usize = 4;
    let (_tmp, dir) = gds_tests::converted_fixture("tiny-llama3-hf");
    let layout = gds_cuda::plan::Layout::read(&dir).unwrap();
    let config = gds_runtime::Model::load(&dir, CTX, 1)
        .unwrap()
        .config
        .clone();
    let run = |graphs: bool| {
        let windows: Vec<Option<usize>> = (0..config.n_layers).map(|l| config.window(l)).collect();
        let n_blocks = 3 * CTX / BLOCK;
        let mut kv = KvCache::paged_windowed(
            KvDtype::F16,
            &windows,
            3,
            CTX,
            config.kv_dim(),
            BLOCK,
            n_blocks,
            n_blocks,
        );
        // a scrambled free list: allocate and release blocks out of order first
        let taken: Vec<u32> = (0..7).map(|_| kv.alloc().unwrap()).collect();
        for &b in taken.iter().rev().step_by(2) {
            kv.release(b);
        }
        let mut staging = PassStaging::new(&kv).unwrap();
        let (max_batch, outputs) = (16, 8);
        let budget = layout
            .plan_with(
                layout.overhead_bytes_with(CTX, max_batch, outputs, staging.spec()),
                usize::MAX >> 1,
            )
            .unwrap()
            .all_resident_budget as u64;
        let (graph, rope) = CudaGraph::open(&dir, CTX).unwrap();
        let opts = StreamOptions {
            kv: Some(staging.spec().clone()),
            max_outputs: Some(outputs),
            graphs,
            ..options(budget, rope, max_batch)
        };
        let mut gpu =
            Streamer::with_vram(&dir, &opts, EmuVram::new(&dir), Box::new(graph)).unwrap();
        let vocab = layout.shape.vocab;
        let mut seqs: Vec<Vec<u32>> = vec![
            (0..5u32).map(|i| (i * 37 + 11) % 97).collect(),
            (0..5u32).map(|i| (i * 37 + 11) % 97).collect(),
            (0..3u32).map(|i| (i * 13 + 5) % 97).collect(),
        ];
        let grow = |kv: &mut KvCache, s: usize, upto: usize| {
            while kv.table(s).len() * BLOCK < upto {
                let b = kv.alloc().unwrap();
                kv.push_block(s, b);
            }
        };
        grow(&mut kv, 0, 4);
        let b0 = kv.table(0)[0];
        kv.retain(b0);
        kv.push_block(1, b0);
        let mut done = [0usize, 4, 0];
        let mut batch = Batch::with_capacity(max_batch);
        let mut rows = vec![0f32; outputs * vocab];
        let mut all = Vec::new();
        // the prompts (sequence 1 from its shared block on), then 12 decode steps
        for step in 0..13 {
            batch.clear();
            for s in 0..3 {
                let upto = seqs[s].len();
                grow(&mut kv, s, upto);
                for (p, &t) in seqs[s].iter().enumerate().skip(done[s]) {
                    batch.push(t, p, s, p + 1 == upto);
                }
            }
            let n = staging.run(&mut gpu, &kv, &batch, &mut rows).unwrap();
            assert_eq!(n, 3, "step {step}");
            for s in 0..3 {
                let row = &rows[s * vocab..(s + 1) * vocab];
                all.push(row.to_vec());
                done[s] = seqs[s].len();
                seqs[s].push(argmax(row));
            }
        }
        (all, gpu.graph_stats)
    };
    let (plain, _) = run(false);
    let (replayed, st) = run(true);
    // step 0 prefills (9 tokens: GEMM); steps 1 and 2 decode (the second one captured);
    // steps 3 to 12 replay
    assert_eq!(
        st,
        gds_cuda::stream::GraphStats {
            replays: 10,
            captures: 1
        }
    );
    for (i, (a, b)) in plain.iter().zip(&replayed).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "row {i} (step {}, sequence {}) differs when replayed",
            i / 3,
            i % 3
        );
    }
}
