//! Every architecture family against transformers on tiny random-weight models that
//! transformers itself made (fixtures/tiny-<arch>-hf, fixtures/make_arch_fixtures.py; see
//! fixtures/ARCH_FIXTURES.md), converted from the Hugging Face directory and from the GGUF
//! that llama.cpp's own `convert_hf_to_gguf.py` wrote. Weights are F32 and activations f32,
//! so the arithmetic is transformers' float32 eager pass: logits must agree to ~1e-4, and
//! every greedy token must be the same (golden margins are at least 0.19). Measured: at most 7.7e-5.

use crate::eval_positions;
use gds_runtime::{Batch, KvCache, KvDtype, Model, RunState};
use std::path::Path;

fn fixture(rel: &str) -> std::path::PathBuf {
    gds_tests::fixture(rel)
}

fn convert(input: &Path, out: &Path) {
    gds_convert::convert(
        input,
        out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .unwrap_or_else(|e| panic!("convert {}: {e}", input.display()));
}

/// Logits of every position of `tokens`, one batch, with a context of 64 (the fixtures'
/// max_position_embeddings) or the next power of two that holds them.
fn logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    logits_with(dir, tokens, true)
}

/// [`logits`] with f32 activations or (`false`) the default 8-bit ones.
fn logits_with(dir: &Path, tokens: &[u32], f32_activations: bool) -> Vec<Vec<f32>> {
    let ctx = tokens.len().next_power_of_two().max(64);
    let mut model = Model::load(dir, ctx, 1).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    model.set_f32_activations(f32_activations);
    let c = &model.config;
    let n = tokens.len();
    let mut st = RunState::new(c, n, n, model.ctx(), model.threads());
    let mut kv = KvCache::new(KvDtype::F32, c.n_layers, 1, model.ctx(), c.kv_dim());
    let mut rows = vec![Vec::new(); n];
    eval_positions(
        &model,
        &mut st,
        &mut kv,
        &mut Batch::with_capacity(n),
        tokens,
        0,
        0..n,
        &mut |p, l| rows[p] = l.to_vec(),
    );
    rows
}

/// Converts `input` and compares its logits with `tiny-<arch>-hf/golden.json`.
fn check(arch: &str, input: &Path) {
    check_with(arch, input, "golden.json")
}

/// Converts `input` and compares its logits with `tiny-<arch>-hf/<golden>`.
fn check_with(arch: &str, input: &Path, golden: &str) {
    let golden = gds_tests::golden(arch, golden);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gds");
    convert(input, &out);
    let rows = logits(&out, &golden.tokens);
    let what = format!("{arch} from {}", input.display());
    let worst = golden.max_diff(&rows, 0, &what);
    eprintln!("{what}: max |logit diff| {worst:.2e}");
    // golden logits are rounded to 6 significant digits (|logit| < 100)
    assert!(worst < 5e-4, "{arch}: max |logit diff| {worst}");
}

macro_rules! hf_and_gguf {
    ($($name:ident: $arch:literal, gguf: $gguf:literal;)*) => {$(
        #[test]
        fn $name() {
            check($arch, &fixture(concat!("tiny-", $arch, "-hf")));
            if $gguf {
                check($arch, &fixture(concat!("tiny-", $arch, ".gguf")));
            }
        }
    )*};
}

hf_and_gguf! {
    llama3_matches_transformers: "llama3", gguf: true;
    llama31_rope_scaling_matches_transformers: "llama31", gguf: true;
    qwen2_biases_match_transformers: "qwen2", gguf: true;
    gemma3_matches_transformers: "gemma3", gguf: false;
    mistral_sliding_window_matches_transformers: "mistral", gguf: false;
    qwen3_matches_transformers: "qwen3", gguf: true;
    gemma2_softcaps_match_transformers: "gemma2", gguf: false;
    phi3_fused_partial_rotary_matches_transformers: "phi3", gguf: true;
    phi35_longrope_matches_transformers: "phi35", gguf: true;
    smollm3_nope_layers_match_transformers: "smollm3", gguf: true;
}

/// llama.cpp's IQ4_XS and IQ4_NL (its non-linear 4-bit types; fixtures/make_iq4_fixtures.py:
/// a tiny llama of hidden size 256, so IQ4_XS's 256-value super-blocks fit every matrix,
/// quantized by `llama-quantize`; fixtures/reference/iq4-llamacpp.json). With f32 activations
/// the logits are transformers' float32 pass over gguf-py's dequantization of the same file;
/// with the default 8-bit activations every greedy token is transformers' and llama.cpp's
/// (llama-server on the same file), the logits within the activations' rounding. llama.cpp's
/// own log-probabilities are printed beside: it quantizes the activations too (IQ4_NL's as
/// Q8_0, IQ4_XS's and Q6_K's as Q8_K), and on this sharp random model transformers and
/// llama.cpp differ by up to 1.2 in the head of the distribution (gdsrun's q8 run: 0.7 for
/// IQ4_NL, whose activation blocks are llama.cpp's, 1.5 for IQ4_XS).
#[test]
fn iq4_types_match_transformers_and_llama_cpp() {
    let golden = golden_json("reference/iq4-llamacpp.json");
    for (file, dtype) in [
        ("tiny-llama-iq4_xs.gguf", "iq4_xs"),
        ("tiny-llama-iq4_nl.gguf", "iq4_nl"),
    ] {
        let g = &golden["files"][file];
        let n = quantized_reference_check(&golden, g, file, |d| d == dtype, 0.05);
        assert!(n >= 7 * 2, "{file}: {n} {dtype} tensors");
    }
}

/// llama.cpp's grid i-quants, one per kind of matrix (fixtures/make_iq_grid_fixtures.py:
/// `llama-quantize` with `llama-imatrix`'s importance matrix; attn_q IQ2_XXS, attn_k IQ2_XS,
/// attn_v IQ2_S, attn_output IQ3_XXS, ffn_gate IQ3_S, ffn_up IQ1_S, ffn_down IQ1_M, the
/// embedding IQ3_S, looked up row by row; the head Q6_K): with f32
/// activations the logits are transformers' over gguf-py's dequantization of the same file;
/// with the default 8-bit activations (Q8_K blocks, as llama.cpp's) every greedy token is
/// transformers' and llama.cpp's, the logits within the activations' rounding.
#[test]
fn iq_grid_types_match_transformers_and_llama_cpp() {
    let golden = golden_json("reference/iq-grid-llamacpp.json");
    let file = "tiny-llama-iq-grid.gguf";
    let grid = [
        "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
    ];
    let n = quantized_reference_check(&golden, &golden, file, |d| grid.contains(&d), 0.05);
    // every layer's seven matrices, and the embedding (llama-quantize's base type, IQ3_S)
    let in_file = golden["tensor_types"]
        .as_object()
        .unwrap()
        .values()
        .filter(|t| grid.contains(&t.as_str().unwrap().to_lowercase().as_str()))
        .count();
    assert_eq!(
        (n, in_file),
        (7 * 2 + 1, 7 * 2 + 1),
        "{file}: grid i-quant tensors"
    );
}

fn golden_json(rel: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(rel)).unwrap()).unwrap()
}

/// Converts fixture `file`, checks that it holds tensors of the dtypes `wanted` picks, and
/// compares its logits with `g`'s `transformers_logits` (exact with f32 activations: 5e-4;
/// with 8-bit activations within `q8_share` of the logits' range) and greedy tokens with
/// those and with llama.cpp's `logprobs`. Returns the number of `wanted` tensors.
fn quantized_reference_check(
    golden: &serde_json::Value,
    g: &serde_json::Value,
    file: &str,
    wanted: impl Fn(&str) -> bool,
    q8_share: f64,
) -> usize {
    let tokens: Vec<u32> = golden["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let floats = |v: &serde_json::Value| -> Vec<Vec<f64>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect()
    };
    let argmax = |r: &[f64]| {
        r.iter()
            .enumerate()
            .fold((0, f64::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
            .0
    };
    let llama_cpp = floats(&g["logprobs"]);
    let exact = floats(&g["transformers_logits"]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gds");
    convert(&fixture(file), &out);
    let bytes = gds_io::read_manifest(&out).unwrap();
    let n = gds_format::Manifest::parse(&bytes)
        .unwrap()
        .tensors()
        .filter(|t| wanted(t.dtype.name()))
        .count();
    for f32_act in [true, false] {
        let rows: Vec<Vec<f64>> = logits_with(&out, &tokens, f32_act)
            .iter()
            .map(|r| r.iter().map(|&v| v as f64).collect())
            .collect();
        let (mut vs_exact, mut vs_llama_cpp) = (0f64, 0f64);
        for (p, row) in rows.iter().enumerate() {
            assert_eq!(argmax(row), argmax(&exact[p]), "{file} position {p}");
            assert_eq!(argmax(row), argmax(&llama_cpp[p]), "{file} position {p}");
            let max = row.iter().fold(f64::MIN, |a, &v| a.max(v));
            let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
            for ((v, e), l) in row.iter().zip(&exact[p]).zip(&llama_cpp[p]) {
                vs_exact = vs_exact.max((v - e).abs());
                if *l > -10.0 {
                    vs_llama_cpp = vs_llama_cpp.max((v - lse - l).abs());
                }
            }
        }
        let scale = exact.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
        eprintln!(
            "{file} (f32 activations: {f32_act}): max |logit diff| vs transformers \
             {vs_exact:.2e}; max |logprob diff| vs llama.cpp (its log-probs > -10) \
             {vs_llama_cpp:.2e}; logits up to {scale:.1}"
        );
        let bound = if f32_act { 5e-4 } else { q8_share * scale };
        assert!(
            vs_exact < bound,
            "{file} (f32 activations {f32_act}): {vs_exact} (logits up to {scale})"
        );
    }
    n
}

/// Qwen 3's mixture of experts (4 experts, 2 per token, probabilities renormalized): the
/// router's choice and the weighted sum of the experts' outputs, from the Hugging Face
/// directory (per-expert tensors, stacked at conversion) and from llama.cpp's GGUF (stacked
/// there). Choosing one expert, or not renormalizing, moves these logits by 15 and 3.3
/// (ARCH_FIXTURES.md's sensitivity column).
#[test]
fn qwen3moe_experts_match_transformers() {
    check("qwen3moe", &fixture("tiny-qwen3moe-hf"));
    check("qwen3moe", &fixture("tiny-qwen3moe.gguf"));
}

/// Mixtral (4 experts, 2 a token, renormalized; llama's attention): from the Hugging Face
/// directory (per-expert w1/w3/w2, stacked at conversion), from llama.cpp's GGUF, whose
/// architecture is `llama` with `llama.expert_count` (read as the mixtral family), and from
/// the same GGUF with one tensor per expert, as llama.cpp's converter wrote Mixtral before
/// early 2024. Choosing one expert moves these logits by 7.3 (ARCH_FIXTURES.md).
#[test]
fn mixtral_experts_match_transformers() {
    for input in [
        "tiny-mixtral-hf",
        "tiny-mixtral.gguf",
        "tiny-mixtral-per-expert.gguf",
    ] {
        check("mixtral", &fixture(input));
    }
}

/// gpt-oss (4 layers alternating a 4-position window and full attention, 4 experts, 2 a
/// token): attention sinks, q/k/v/o biases, YaRN RoPE, the biased router whose top-2 logits
/// are softmaxed among themselves, clamped-SwiGLU experts with biases; from the Hugging Face
/// directory (fused `gate_up_proj` experts, split at conversion) and from llama.cpp's GGUF.
/// Ignoring the sinks, YaRN, the window or the clamp moves these logits by 24, 29, 46 and 22
/// (ARCH_FIXTURES.md).
#[test]
fn gpt_oss_matches_transformers() {
    check("gptoss", &fixture("tiny-gptoss-hf"));
    check("gptoss", &fixture("tiny-gptoss.gguf"));
}

/// YaRN as gpt-oss's own configs ask for it, `truncate: false` (the correction range left
/// unrounded; llama.cpp always rounds it, and a GGUF cannot say otherwise): the Hugging Face
/// directory with that config against transformers' logits for it
/// (golden_truncate_false.json, fixtures/make_gptoss_truncate_golden.py), which are up to 17.9
/// from the rounded ones.
#[test]
fn gpt_oss_yarn_without_truncation_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("tiny-gptoss-hf");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    let cfg = tmp.path().join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["rope_parameters"]["truncate"] = false.into();
    std::fs::write(&cfg, c.to_string()).unwrap();
    check_with("gptoss", tmp.path(), "golden_truncate_false.json");
}

/// The same model with MXFP4 experts, against transformers on the weights as gguf-py
/// dequantizes llama-quantize's MXFP4_MOE of it (golden_mxfp4.json): that GGUF (experts
/// MXFP4, the other matrices Q8_0), and the Hugging Face directory storing the same experts
/// as the published gpt-oss checkpoints do (`*_blocks` and `*_scales`,
/// fixtures/make_gptoss_mxfp4_hf.py; the other matrices as their float32 dequantization).
#[test]
fn gpt_oss_mxfp4_experts_match_gguf_py() {
    for input in ["tiny-gptoss-mxfp4.gguf", "tiny-gptoss-mxfp4-hf"] {
        check_with("gptoss", &fixture(input), "golden_mxfp4.json");
    }
}

/// LongRoPE beyond the original context: transformers switches to the long factors for a
/// sequence longer than original_max_position_embeddings (64), gdsrun (as llama.cpp) when its
/// context exceeds it. 80 tokens at context 128 must match transformers' long-factor logits
/// (golden_long.json, scripts/reference/longrope_golden.py; min margin 0.024), from both
/// sources.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn phi35_longrope_long_factors_match_transformers() {
    for input in ["tiny-phi35-hf", "tiny-phi35.gguf"] {
        check_with("phi35", &fixture(input), "golden_long.json");
    }
}

/// Three GGUFs mean something else than their Hugging Face source, because llama.cpp's
/// converter drops a field: Mistral's `sliding_window` (llama.cpp runs it as plain llama)
/// and Gemma 2 and 3's `query_pre_attn_scalar` (llama.cpp derives it from the model size;
/// the fixtures' 24 differs from their head_dim 16 on purpose). They convert, validate as
/// runnable, keep what the GGUF does say (Gemma 3's window and both RoPE bases), and
/// compute what llama.cpp computes from them.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn ggufs_that_drop_a_hf_field_run_as_llama_cpp_reads_them() {
    for arch in ["mistral", "gemma3", "gemma2"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("m.gds");
        convert(&fixture(&format!("tiny-{arch}.gguf")), &out);
        let bytes = std::fs::read(out.join(gds_format::MANIFEST_FILE)).unwrap();
        let m = gds_format::Manifest::parse(&bytes).unwrap();
        let check = gds_format::arch::check_model(&m);
        assert!(check.known && check.errors.is_empty(), "{:?}", check.errors);
        let h = check.hparams.unwrap();
        if arch == "gemma3" {
            assert_eq!(h.sliding_window, Some(4));
            assert_eq!(
                (h.rope_theta, h.rope_theta_local),
                (100000.0, Some(10000.0))
            );
            assert_eq!(h.query_pre_attn_scalar, Some(16.0));
        } else if arch == "gemma2" {
            assert_eq!((h.sliding_window, h.sliding_window_pattern), (Some(4), 2));
            assert_eq!((h.attn_softcap, h.final_softcap), (Some(3.0), Some(30.0)));
            assert_eq!(h.query_pre_attn_scalar, Some(16.0));
        } else {
            assert_eq!(h.sliding_window, None);
        }
        // transformers on the same weights with only that field changed
        // (golden_gguf.json, fixtures/ARCH_FIXTURES.md)
        check_with(
            arch,
            &fixture(&format!("tiny-{arch}.gguf")),
            "golden_gguf.json",
        );
    }
}

/// An architecture without a description (Phi-2: the Phi-3 fixture renamed, key prefix
/// included) is converted, and `gdsrun` says it cannot run it rather than guessing.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn architectures_without_a_graph_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture("tiny-phi3.gguf")).unwrap();
    let (from, to) = (b"phi3", b"phi2");
    let mut renamed = bytes.clone();
    for i in 0..bytes.len() - from.len() {
        if &bytes[i..i + from.len()] == from {
            renamed[i..i + to.len()].copy_from_slice(to);
        }
    }
    let input = tmp.path().join("tiny-phi2.gguf");
    std::fs::write(&input, renamed).unwrap();
    let out = tmp.path().join("m.gds");
    convert(&input, &out);
    let err = Model::load(&out, 64, 1).err().expect("refused");
    assert!(
        err.to_string()
            .contains("unsupported architecture \"phi2\""),
        "{err}"
    );
}

/// Mixtures of experts run on the CUDA executor (crates/gds-cuda/tests/it/executor_emu.rs
/// runs them there on the emulated kernels): on a (described) usable GPU, `auto` picks it
/// for Qwen 3's experts and for gpt-oss's MXFP4 ones, and `--backend cuda` plans them; the
/// VRAM plan counts the experts' scratch (router logits, token rows) and sizes the GEMM tile
/// by one expert, not by the stacked tensor.
#[test]
fn mixtures_of_experts_plan_on_the_gpu() {
    use gds_runtime::backend::{Backend, BackendChoice};
    use gds_runtime::{Plan, PlanOptions};
    let tmp = tempfile::tempdir().unwrap();
    let gpu = || BackendChoice {
        name: Backend::Cuda,
        reason: "auto: usable GPU found (Test GPU)".into(),
        gpu: Some(gds_runtime::gpuplan::GpuOffer {
            device: "Test GPU".into(),
            vram_bytes: 8 << 30,
            gds: Err("libcufile not found".into()),
            cufile_compat: false,
        }),
    };
    for input in ["tiny-qwen3moe.gguf", "tiny-gptoss-mxfp4.gguf"] {
        let out = tmp.path().join(format!("{input}.gds"));
        convert(&fixture(input), &out);
        let opts = |backend: &str| PlanOptions {
            model_dir: out.clone(),
            backend: Some(backend.into()),
            ..Default::default()
        };
        let p = Plan::build_for(&opts("auto"), gpu()).unwrap();
        assert_eq!(p.backend, Backend::Cuda, "{input}: {}", p.backend_reason);
        let p = Plan::build_for(&opts("cuda"), gpu()).unwrap();
        assert_eq!(p.backend, Backend::Cuda, "{input}");
        let layout = gds_cuda::plan::Layout::read(&out).unwrap();
        let moe = layout.shape.moe.expect("a mixture of experts");
        // the tile: the largest of the plain tensors and of one expert's matrices
        let want = layout
            .tensors
            .iter()
            .map(|(name, t)| match name.contains("_exps.") {
                true => t.rows / moe.n_expert * t.cols,
                false => t.rows * t.cols,
            })
            .max()
            .unwrap();
        assert_eq!(layout.max_weight_elements(), want, "{input}");
    }
}

/// The experts' keys are range-checked where every key is (SPEC.md §3.4): a manifest re-sealed
/// with an expert count that contradicts the tensors, more experts used than there are, none
/// used, or more experts than the format allows is refused by validation and by the runtime,
/// naming the key, and never panics.
#[test]
fn expert_keys_out_of_range_are_refused_by_name() {
    use gds_format::raw::KvEntry;
    use gds_format::{Manifest, MANIFEST_FILE};
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("m.gds");
    convert(&fixture("tiny-qwen3moe.gguf"), &base);
    for (key, value, needle) in [
        ("model.n_expert_used", 5, "model.n_expert_used"),
        ("model.n_expert_used", 0, "model.n_expert_used"),
        ("model.n_expert", 5000, "model.n_expert"),
        ("model.n_expert", 3, "ffn_gate_inp.weight"),
        ("model.n_ff_exp", 0, "model.n_ff_exp"),
        ("model.n_ff_exp", 16, "ffn_gate_exps.weight"),
    ] {
        let dir = tmp.path().join(format!("{key}-{value}"));
        gds_tests::copy_dir(&base, &dir);
        let p = dir.join(MANIFEST_FILE);
        let mut b = std::fs::read(&p).unwrap();
        let m = Manifest::parse(&b).unwrap();
        let i = (0..m.kv_table().len())
            .find(|&i| m.kv(i).unwrap().0 == key)
            .unwrap();
        let at = m.header().kv.offset.get() as usize + i * size_of::<KvEntry>() + 16;
        b[at..at + 8].copy_from_slice(&(value as u64).to_le_bytes());
        gds_tests::reseal(&mut b);
        std::fs::write(&p, &b).unwrap();
        let m = Manifest::parse(&b).unwrap();
        let check = gds_format::arch::check_model(&m);
        let errs: Vec<String> = check.errors.iter().map(|e| e.to_string()).collect();
        assert!(
            errs.iter().any(|e| e.contains(needle)),
            "{key} = {value}: {errs:?}"
        );
        let e = Model::load(&dir, 64, 1).err().expect("refused").to_string();
        assert!(e.contains(needle), "{key} = {value}: {e}");
    }
}
