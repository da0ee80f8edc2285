//! The whole GPU forward pass (`gds_cuda::forward` and the model's graph over it,
//! `gds_runtime::cuda_graph`: the code the CUDA executor launches) run on the CPU: every
//! kernel is the .cu source compiled as C++ with kernels/emu.h, and buffers are host memory.
//! The model is a small synthetic llama (2 blocks, grouped KV heads, q/k/v biases in one
//! block) whose weights mix every GPU dtype (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F16,
//! F32), with a
//! tied Q8_0 embedding. The logits are compared with an f64 reference: the same graph
//! (`gds_runtime::graph::block`) over an f64 implementation of its `Ops`, on weights
//! dequantized by gds-kernels — so the reference shares the graph, not the kernels. A
//! 9-token prefill takes the GEMM path (dequantized tile, cuBLAS's column-major SGEMM
//! semantics emulated here), then one decode step the matvec path. (The real SmolLM2 is too
//! slow for the one-OS-thread-per-CUDA-thread emulation.)

use crate::common::{p, Emu};
use gds_cuda::forward::{BlockGraph, Pass, Scratch, GEMM_MIN_TOKENS};
use gds_cuda::plan::{LayerMeta, Layout, Shape, TensorMeta};
use gds_format::DType;
use gds_runtime::cuda_graph::CudaGraph;
use gds_runtime::graph::{self, Buf, Glu, Ops};
use gds_runtime::Config;
use std::collections::HashMap;

/// A zeroed f32 host buffer and its address.
fn buf(store: &mut Vec<Vec<f32>>, n: usize) -> u64 {
    store.push(vec![0f32; n.max(1)]);
    store.last().unwrap().as_ptr() as u64
}

/// One row per token.
type Rows = Vec<Vec<f64>>;

/// The graph's [`Ops`] in f64, one token at a time, over weights dequantized by
/// gds-kernels: the test reference of every backend's ops.
struct F64Ops<'a> {
    c: &'a Config,
    files: &'a [Vec<u8>],
    /// Rows of each buffer for the tokens of the batch.
    bufs: HashMap<Buf, Vec<Vec<f64>>>,
    /// Positions of the batch.
    pos: Vec<usize>,
    /// Per block: keys and values of every position so far.
    kv: &'a mut [(Rows, Rows)],
}

impl F64Ops<'_> {
    fn deq(&self, t: &TensorMeta) -> Vec<f64> {
        let bytes = &self.files[t.layer][t.offset..t.offset + t.nbytes];
        let mut out = vec![0f32; t.rows * t.cols];
        gds_kernels::dequantize(t.dtype, bytes, &mut out).unwrap();
        out.into_iter().map(f64::from).collect()
    }

    fn rows(&mut self, b: Buf) -> &mut Vec<Vec<f64>> {
        let n = self.pos.len();
        self.bufs.entry(b).or_insert_with(|| vec![Vec::new(); n])
    }

    fn norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter()
            .zip(w.iter().cycle())
            .map(|(a, b)| a * r * b)
            .collect()
    }
}

impl Ops for F64Ops<'_> {
    type Mat = TensorMeta;
    type Vec = TensorMeta;

    fn rms_norm(&mut self, out: Buf, x: Buf, w: &TensorMeta) -> gds_runtime::Result<()> {
        let (w, eps) = (self.deq(w), self.c.rms_norm_eps as f64);
        let ys: Vec<Vec<f64>> = self
            .rows(x)
            .iter()
            .map(|r| Self::norm(r, &w, eps))
            .collect();
        *self.rows(out) = ys;
        Ok(())
    }

    fn head_norm(&mut self, buf: Buf, w: &TensorMeta) -> gds_runtime::Result<()> {
        let (w, eps, hd) = (self.deq(w), self.c.rms_norm_eps as f64, self.c.head_dim);
        for r in self.rows(buf).iter_mut() {
            *r = r.chunks(hd).flat_map(|h| Self::norm(h, &w, eps)).collect();
        }
        Ok(())
    }

    fn matmul(&mut self, x: Buf, outs: &[(Buf, &TensorMeta)]) -> gds_runtime::Result<()> {
        for &(b, t) in outs {
            let w = self.deq(t);
            let ys: Vec<Vec<f64>> = self
                .rows(x)
                .iter()
                .map(|x| {
                    (0..t.rows)
                        .map(|r| {
                            w[r * t.cols..][..t.cols]
                                .iter()
                                .zip(x)
                                .map(|(a, b)| a * b)
                                .sum()
                        })
                        .collect()
                })
                .collect();
            *self.rows(b) = ys;
        }
        Ok(())
    }

    fn add_bias(&mut self, buf: Buf, b: &TensorMeta) -> gds_runtime::Result<()> {
        let b = self.deq(b);
        for r in self.rows(buf).iter_mut() {
            r.iter_mut().zip(&b).for_each(|(x, b)| *x += b);
        }
        Ok(())
    }

    fn rope(&mut self, _layer: usize) -> gds_runtime::Result<()> {
        let (hd, theta) = (self.c.head_dim, self.c.rope_theta);
        let pos = self.pos.clone();
        for b in [Buf::Q, Buf::K] {
            for (r, &p) in self.rows(b).iter_mut().zip(&pos) {
                for head in r.chunks_exact_mut(hd) {
                    for i in 0..hd / 2 {
                        let a = p as f64 * theta.powf(-((2 * i) as f64) / hd as f64);
                        let (c, s) = (a.cos(), a.sin());
                        let (u, v) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = u * c - v * s;
                        head[2 * i + 1] = u * s + v * c;
                    }
                }
            }
        }
        Ok(())
    }

    fn attention(&mut self, layer: usize, sinks: Option<&TensorMeta>) -> gds_runtime::Result<()> {
        assert!(sinks.is_none(), "the synthetic model is a llama");
        let (nh, nkv, hd) = (self.c.n_heads, self.c.n_kv_heads, self.c.head_dim);
        let scale = self.c.attn_scale as f64;
        let (ks, vs) = (self.rows(Buf::K).clone(), self.rows(Buf::V).clone());
        let qs = self.rows(Buf::Q).clone();
        let mut outs = Vec::new();
        for (t, q) in qs.iter().enumerate() {
            let (kc, vc) = &mut self.kv[layer];
            kc.push(ks[t].clone());
            vc.push(vs[t].clone());
            let n_pos = kc.len();
            let mut attn = vec![0f64; nh * hd];
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let qh = &q[h * hd..][..hd];
                let sc: Vec<f64> = (0..n_pos)
                    .map(|p| {
                        qh.iter()
                            .zip(&kc[p][kvh * hd..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    attn[h * hd + d] = (0..n_pos).map(|p| e[p] / sum * vc[p][kvh * hd + d]).sum();
                }
            }
            outs.push(attn);
        }
        *self.rows(Buf::Att) = outs;
        Ok(())
    }

    fn glu(&mut self, act: Glu) -> gds_runtime::Result<()> {
        assert_eq!(act, Glu::Silu, "the synthetic model is a llama");
        let up = self.rows(Buf::Up).clone();
        for (g, u) in self.rows(Buf::Gate).iter_mut().zip(&up) {
            g.iter_mut()
                .zip(u)
                .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
        }
        Ok(())
    }

    fn add(&mut self, y: Buf, x: Buf) -> gds_runtime::Result<()> {
        let xs = self.rows(x).clone();
        for (y, x) in self.rows(y).iter_mut().zip(&xs) {
            y.iter_mut().zip(x).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }
}

/// Logits at every position of `tokens` (one token per pass), from the graph over
/// [`F64Ops`].
fn reference(
    layout: &Layout,
    files: &[Vec<u8>],
    c: &Config,
    g: &CudaGraph,
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    let emb = layout.tensors["token_embd.weight"];
    let row_bytes = emb.nbytes / emb.rows;
    let mut kv = vec![(Vec::new(), Vec::new()); c.n_layers];
    let mut out = Vec::new();
    for (pos, &tok) in tokens.iter().enumerate() {
        let bytes = &files[emb.layer][emb.offset + tok as usize * row_bytes..][..row_bytes];
        let mut x = vec![0f32; emb.cols];
        gds_kernels::dequantize(emb.dtype, bytes, &mut x).unwrap();
        let mut o = F64Ops {
            c,
            files,
            bufs: HashMap::new(),
            pos: vec![pos],
            kv: &mut kv,
        };
        *o.rows(Buf::X) = vec![x.into_iter().map(f64::from).collect()];
        for (l, w) in g.blocks().iter().enumerate() {
            graph::block(g.arch(), &mut o, l, w).unwrap();
        }
        let x = o.rows(Buf::X)[0].clone();
        let xn = F64Ops::norm(
            &x,
            &o.deq(&layout.tensors["output_norm.weight"]),
            c.rms_norm_eps as f64,
        );
        let w = o.deq(&layout.output);
        out.push(
            (0..layout.output.rows)
                .map(|r| {
                    w[r * xn.len()..][..xn.len()]
                        .iter()
                        .zip(&xn)
                        .map(|(a, b)| a * b)
                        .sum::<f64>() as f32
                })
                .collect(),
        );
    }
    out
}

/// The hyperparameters of the synthetic llama, as `Config::from_manifest` would read them.
fn config(sh: &Shape) -> Config {
    Config {
        arch: "llama".into(),
        n_layers: sh.n_layers,
        n_embd: sh.n_embd,
        n_heads: sh.n_heads,
        n_kv_heads: sh.n_kv_heads,
        n_ff: sh.n_ff,
        vocab_size: sh.vocab,
        context_length: 16,
        head_dim: sh.head_dim,
        rope_theta: sh.rope_theta,
        rope_scaling: gds_runtime::RopeScaling::None,
        rope_dims: sh.head_dim,
        rope_attn_factor: None,
        rope_original_context: None,
        rms_norm_eps: sh.eps,
        tie_embeddings: true,
        bos_token_id: None,
        eos_token_id: None,
        add_bos: false,
        rope_style: gds_runtime::config::RopeStyle::Norm,
        sliding_window: None,
        sliding_window_pattern: 0,
        rope_theta_local: None,
        attn_scale: 1.0 / (sh.head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        moe: None,
        no_rope_step: None,
    }
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 2e-3 * scale + 1e-3,
        "{what}: worst logit error {worst} (max |logit| {scale})"
    );
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(got), argmax(want), "{what}: top-1 token differs");
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Layer buffers and the tensor table of a synthetic model.
#[derive(Default)]
struct Model {
    files: Vec<Vec<u8>>,
    tensors: HashMap<String, TensorMeta>,
    seed: u64,
}

impl Model {
    fn layer(&mut self) -> usize {
        self.files.push(Vec::new());
        self.files.len() - 1
    }

    /// A `rows × cols` tensor of `dtype` with values of about `scale` (norms: `1 ± scale`).
    #[allow(clippy::too_many_arguments)]
    fn tensor(
        &mut self,
        layer: usize,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
        scale: f32,
        around_one: bool,
    ) {
        self.seed += 1;
        let vals: Vec<f32> = values(rows * cols, self.seed)
            .iter()
            .map(|v| {
                if around_one {
                    1.0 + v * scale
                } else {
                    v * scale
                }
            })
            .collect();
        let bytes = match gds_kernels::quantize(dtype, &vals) {
            Ok(b) => b,
            Err(_) => {
                // a dtype without a quantizer (none of the GPU dtypes now): random blocks with small scales.
                let size = dtype.type_size();
                let mut b: Vec<u8> =
                    values(rows * cols / dtype.block_size() * size, self.seed + 999)
                        .iter()
                        .map(|v| ((v + 1.0) * 127.9) as u8)
                        .collect();
                let d = half::f16::from_f32(scale / 64.0).to_le_bytes();
                for blk in b.chunks_exact_mut(size) {
                    match dtype {
                        DType::Q4K | DType::Q5K => {
                            blk[0..2].copy_from_slice(&d);
                            blk[2..4].copy_from_slice(&d);
                        }
                        DType::Q6K => blk[208..210]
                            .copy_from_slice(&half::f16::from_f32(scale / 2000.0).to_le_bytes()),
                        other => panic!("no generator for {other}"),
                    }
                }
                b
            }
        };
        let file = &mut self.files[layer];
        let offset = file.len().next_multiple_of(256);
        file.resize(offset, 0);
        file.extend_from_slice(&bytes);
        let meta = TensorMeta {
            layer,
            offset,
            nbytes: bytes.len(),
            dtype,
            rows,
            cols,
        };
        self.tensors.insert(name.to_string(), meta);
    }
}

#[test]
fn gpu_forward_pass_on_emulated_kernels_matches_an_f64_reference() {
    let sh = Shape {
        n_layers: 2,
        n_embd: 256,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        n_ff: 512,
        vocab: 300,
        eps: 1e-5,
        rope_theta: 10000.0,
        rope_dims: 64,
        rope_neox: false,
        rope_scaling: gds_format::arch::RopeScaling::None,
        windows: vec![0; 2],
        moe: None,
    };
    let (q_dim, kv_dim) = (sh.n_heads * sh.head_dim, sh.n_kv_heads * sh.head_dim);
    let mut m = Model::default();
    let embed = m.layer();
    m.tensor(
        embed,
        "token_embd.weight",
        DType::Q8_0,
        sh.vocab,
        sh.n_embd,
        1.0,
        false,
    );
    let mixes = [
        [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::F16,
            DType::Q4K,
            DType::Q6K,
            DType::Q5_0,
        ],
        [
            DType::Q6K,
            DType::Q5K,
            DType::F32,
            DType::Q5_1,
            DType::Q8_0,
            DType::F16,
            DType::BF16,
        ],
    ];
    let mut blocks = Vec::new();
    for (b, mix) in mixes.iter().enumerate() {
        let l = m.layer();
        blocks.push(l);
        let t = |n: &str| format!("blk.{b}.{n}");
        m.tensor(
            l,
            &t("attn_norm.weight"),
            DType::F32,
            1,
            sh.n_embd,
            0.2,
            true,
        );
        m.tensor(
            l,
            &t("attn_q.weight"),
            mix[0],
            q_dim,
            sh.n_embd,
            0.15,
            false,
        );
        m.tensor(
            l,
            &t("attn_k.weight"),
            mix[1],
            kv_dim,
            sh.n_embd,
            0.15,
            false,
        );
        m.tensor(
            l,
            &t("attn_v.weight"),
            mix[2],
            kv_dim,
            sh.n_embd,
            0.15,
            false,
        );
        m.tensor(
            l,
            &t("attn_output.weight"),
            mix[3],
            sh.n_embd,
            q_dim,
            0.1,
            false,
        );
        m.tensor(
            l,
            &t("ffn_norm.weight"),
            DType::F32,
            1,
            sh.n_embd,
            0.2,
            true,
        );
        m.tensor(
            l,
            &t("ffn_gate.weight"),
            mix[4],
            sh.n_ff,
            sh.n_embd,
            0.1,
            false,
        );
        m.tensor(
            l,
            &t("ffn_up.weight"),
            mix[5],
            sh.n_ff,
            sh.n_embd,
            0.1,
            false,
        );
        m.tensor(
            l,
            &t("ffn_down.weight"),
            mix[6],
            sh.n_embd,
            sh.n_ff,
            0.1,
            false,
        );
        if b == 1 {
            m.tensor(l, &t("attn_q.bias"), DType::F32, 1, q_dim, 0.3, false);
            m.tensor(l, &t("attn_k.bias"), DType::F32, 1, kv_dim, 0.3, false);
            m.tensor(l, &t("attn_v.bias"), DType::F32, 1, kv_dim, 0.3, false);
        }
    }
    let head = m.layer();
    m.tensor(
        head,
        "output_norm.weight",
        DType::F32,
        1,
        sh.n_embd,
        0.2,
        true,
    );
    let output = m.tensors["token_embd.weight"]; // tied
    let layout = Layout {
        shape: sh.clone(),
        layers: m
            .files
            .iter()
            .map(|f| LayerMeta {
                path: "synthetic".into(),
                size: f.len(),
            })
            .collect(),
        tensors: m.tensors.clone(),
        embed,
        head,
        blocks,
        output,
    };
    let files = m.files;
    // Layer bytes in 8-byte-aligned memory (the kernels read f32 norms and biases in place).
    let aligned: Vec<Vec<u64>> = files
        .iter()
        .map(|f| {
            let mut v = vec![0u64; f.len().div_ceil(8)];
            // SAFETY: v has at least f.len() bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(f.as_ptr(), v.as_mut_ptr() as *mut u8, f.len())
            };
            v
        })
        .collect();
    let base: Vec<u64> = aligned.iter().map(|v| v.as_ptr() as u64).collect();

    let tokens: Vec<u32> = vec![1, 50, 299, 7, 123, 0, 88, 250, 31, 200];
    let prefill = GEMM_MIN_TOKENS + 1;
    assert_eq!(tokens.len(), prefill + 1);
    let ctx = 16;
    let widest = sh.n_embd.max(sh.n_ff).max(q_dim);
    let mut store = Vec::new();
    let mt = prefill;
    let kv: Vec<(u64, u64)> = (0..sh.n_layers)
        .map(|_| (buf(&mut store, ctx * kv_dim), buf(&mut store, ctx * kv_dim)))
        .collect();
    let s = Scratch {
        x: buf(&mut store, mt * sh.n_embd),
        xb: buf(&mut store, mt * widest),
        proj: buf(&mut store, mt * sh.n_embd),
        q: buf(&mut store, mt * q_dim),
        k: buf(&mut store, mt * kv_dim),
        v: buf(&mut store, mt * kv_dim),
        attn: buf(&mut store, mt * q_dim),
        att: buf(&mut store, mt * sh.n_heads * ctx),
        gate: buf(&mut store, mt * sh.n_ff),
        up: buf(&mut store, mt * sh.n_ff),
        logits: buf(&mut store, 3 * sh.vocab),
        // a tile of 7 rows of the widest weight: every prefill GEMM runs in runs of rows
        // (14 or 7 at a time, with a shorter last run), written in place in its output
        tile: buf(&mut store, 7 * widest),
        tile_elements: 7 * widest,
        // f32 activations: the reference's arithmetic, compared tightly
        xq: 0,
        router: 0,
        moe_rows: 0,
        moe_x: 0,
        moe_y: 0,
        gemm_min: gds_cuda::forward::GEMM_MIN_TOKENS,
        gemm: gds_cuda::forward::GemmType::F32,
        fuse: true,
        xh: 0,
    };
    let (cos, sin) = gds_format::arch::rope_tables(
        sh.head_dim,
        ctx,
        sh.rope_theta,
        gds_format::arch::RopeFreqs::Scaled(gds_format::arch::RopeScaling::None),
        None,
    );
    let ropes = [(cos.as_ptr() as u64, sin.as_ptr() as u64)];
    // the pass's i32 arrays (host memory: written between passes at stable addresses)
    let (mut pos, mut seq, mut outputs) = (vec![0i32; mt], vec![0i32; mt], vec![0i32; 3]);
    let (pos_p, out_p) = (pos.as_mut_ptr(), outputs.as_mut_ptr());
    let table = [0i32];
    let geo = layout.single_sequence_kv(ctx, mt).layers;
    let tables = [table.as_ptr() as u64];
    let pass = Pass {
        layout: &layout,
        layer_base: &base,
        s,
        kv: &kv,
        kv_f16: false,
        geo: &geo,
        pos: pos_p as u64,
        seq: seq.as_mut_ptr() as u64,
        tables: &tables,
        max_blocks: &[1],
        ropes: &ropes,
        ctx,
    };
    let out_addr = out_p as u64;
    // SAFETY: `pos` and `outputs` live to the end of the test and are not moved; the
    // kernels read them only between these writes, which stay within their lengths.
    let set = |v: *mut i32, vals: &[i32]| unsafe {
        std::ptr::copy_nonoverlapping(vals.as_ptr(), v, vals.len())
    };
    let c = config(&sh);
    let g = CudaGraph::new(&c, &layout, 1).unwrap();
    let mut dev = Emu::default();
    let logits = |s: &Scratch, row: usize| {
        // SAFETY: s.logits holds 3 rows of vocab floats, written by the head above.
        let rows = unsafe { std::slice::from_raw_parts(p::<f32>(s.logits), 3 * sh.vocab) };
        rows[row * sh.vocab..(row + 1) * sh.vocab].to_vec()
    };

    let want = reference(&layout, &files, &c, &g, &tokens);

    set(pos_p, &(0..prefill as i32).collect::<Vec<_>>());
    pass.embed(&mut dev, &tokens[..prefill], None).unwrap();
    for b in 0..sh.n_layers {
        g.block(&pass, &mut dev, b, prefill).unwrap();
    }
    set(out_p, &[prefill as i32 - 1]);
    pass.head(&mut dev, prefill, out_addr, 1, None).unwrap();
    // every block matrix through GEMM, in runs of as many rows as the tile holds
    let runs: usize = layout
        .tensors
        .iter()
        .filter(|(n, t)| n.starts_with("blk.") && t.rows > 1)
        .map(|(_, t)| t.rows.div_ceil(s.tile_elements / t.cols))
        .sum();
    assert!(runs > 7 * sh.n_layers, "the tile holds whole matrices");
    assert_eq!(dev.gemms, runs, "prefill must take the GEMM path");
    check(
        "prefill (GEMM path), last position",
        &logits(&s, 0),
        &want[prefill - 1],
    );
    // the head over the last three positions: their logits in order (speculative passes)
    let last3: Vec<i32> = (prefill as i32 - 3..prefill as i32).collect();
    set(out_p, &last3);
    pass.head(&mut dev, prefill, out_addr, 3, None).unwrap();
    for r in 0..3 {
        check(
            &format!("prefill, head row {r} of 3"),
            &logits(&s, r),
            &want[prefill - 3 + r],
        );
    }
    // any rows, in the order asked: the first and the fourth position
    set(out_p, &[3, 0]);
    pass.head(&mut dev, prefill, out_addr, 2, None).unwrap();
    check("prefill, head row of position 3", &logits(&s, 0), &want[3]);
    check("prefill, head row of position 0", &logits(&s, 1), &want[0]);
    assert!(pass
        .head(&mut dev, prefill, out_addr, prefill + 1, None)
        .is_err());

    set(pos_p, &[prefill as i32]);
    pass.embed(&mut dev, &tokens[prefill..], None).unwrap();
    for b in 0..sh.n_layers {
        g.block(&pass, &mut dev, b, 1).unwrap();
    }
    set(out_p, &[0]);
    pass.head(&mut dev, 1, out_addr, 1, None).unwrap();
    assert_eq!(dev.gemms, runs, "decode must use the matvec kernels");
    check("decode (matvec path)", &logits(&s, 0), &want[prefill]);

    // A layer that is not in VRAM is an error, not a read of address 0.
    let mut missing = base.clone();
    missing[layout.blocks[1]] = 0;
    let pass = Pass {
        layer_base: &missing,
        ..pass
    };
    let e = g.block(&pass, &mut dev, 1, 1).unwrap_err().to_string();
    assert!(e.contains("not in VRAM"), "{e}");
}
