//! Quantizing mixtures of experts as llama-quantize does: `--quant mxfp4_moe` against its
//! `MXFP4_MOE` (fixtures/tiny-gptoss-mxfp4.gguf, made from tiny-gptoss.gguf by it:
//! fixtures/make_arch_fixtures.py's `gptoss_mxfp4`), and the K mixes' 8-expert rules
//! (`scripts/check-quant-mixes.py --only-moe` compares whole conversions with llama-quantize).

use gds_convert::{ConvertOptions, NoProgress, QuantTarget};
use gds_format::DType;
use gds_tests::{fixture, tensor_bytes};
use std::collections::BTreeMap;
use std::path::Path;

/// `gdsconv convert INPUT OUT --quant QUANT [--quant-override O]...`.
fn convert_with(input: &Path, out: &Path, quant: QuantTarget, overrides: &[&str]) {
    let opts = ConvertOptions {
        quant,
        overrides: overrides.iter().map(|o| o.parse().unwrap()).collect(),
        ..ConvertOptions::default()
    };
    gds_convert::convert(input, out, &opts, &NoProgress).unwrap();
}

fn convert(input: &Path, out: &Path, quant: QuantTarget) {
    convert_with(input, out, quant, &[]);
}

/// From the float GGUF and from the Hugging Face directory it was converted from, every
/// tensor equals llama-quantize's, type and bytes: the stacked experts MXFP4, the other
/// matrices (embedding and head too) Q8_0, the router, norms, sinks and biases F32; and so
/// does `--quant q8_0` with the experts overridden to MXFP4.
#[test]
fn mxfp4_moe_writes_what_llama_quantize_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    convert(
        &fixture("tiny-gptoss-mxfp4.gguf"),
        &reference,
        QuantTarget::Keep,
    );
    let want = tensor_bytes(&reference);
    let n_mxfp4 = want.values().filter(|(d, _)| *d == DType::MXFP4).count();
    let n_q8 = want.values().filter(|(d, _)| *d == DType::Q8_0).count();
    // 4 blocks x gate, up, down experts; the attention's 4 matrices a block, embedding, head
    assert_eq!((n_mxfp4, n_q8), (12, 18));
    // the same as `--quant q8_0 --quant-override _exps=mxfp4`
    let overridden = tmp.path().join("overridden");
    convert_with(
        &fixture("tiny-gptoss.gguf"),
        &overridden,
        QuantTarget::To(DType::Q8_0),
        &["_EXPS=MXFP4"],
    );
    for (input, out) in [
        ("tiny-gptoss.gguf", None),
        ("tiny-gptoss-hf", None),
        (
            "tiny-gptoss.gguf --quant q8_0 --quant-override _exps=mxfp4",
            Some(overridden),
        ),
    ] {
        let out = out.unwrap_or_else(|| {
            let out = tmp.path().join(input);
            convert(&fixture(input), &out, "MXFP4_MOE".parse().unwrap());
            out
        });
        let got = tensor_bytes(&out);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{input}"
        );
        for (name, (dtype, bytes)) in &want {
            let (d, b) = &got[name];
            assert_eq!(d, dtype, "{input}: {name}");
            assert!(
                b == bytes,
                "{input}: {name} ({dtype}) differs from llama-quantize's"
            );
        }
    }
}

/// The name parses in any case and prints back; a dense model gets Q8_0 matrices (no
/// stacked experts to make MXFP4).
#[test]
fn mxfp4_moe_on_a_dense_model_is_q8_0() {
    assert_eq!(
        "mxfp4_moe".parse::<QuantTarget>().unwrap(),
        QuantTarget::Mxfp4Moe
    );
    assert_eq!(QuantTarget::Mxfp4Moe.to_string(), "mxfp4_moe");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    convert(&fixture("tiny-llama3.gguf"), &out, QuantTarget::Mxfp4Moe);
    for (name, (dtype, _)) in tensor_bytes(&out) {
        let want = if name.ends_with("norm.weight") {
            DType::F32
        } else {
            DType::Q8_0
        };
        assert_eq!(dtype, want, "{name}");
    }
}

/// tiny-mixtral-hf with its 4 experts doubled to 8 (experts 4-7 copies of 0-3, the router's
/// rows too): llama.cpp's 8-expert rules under `q4_k_m` — attn_k and attn_v Q8_0,
/// attn_output Q5_K (Q5_1 here: its 64 columns are not whole 256-blocks, llama.cpp's
/// fallback) — where the 4-expert original gets the dense rules (attn_k Q4_K and attn_output
/// Q4_K, falling back to Q5_0; attn_v too, but Q6_K → Q8_0 in the last layer by
/// `use_more_bits`).
#[test]
fn eight_experts_take_llama_cpps_8_expert_rules() {
    use safetensors::tensor::TensorView;
    let src = fixture("tiny-mixtral-hf");
    let buf = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    let mut tensors: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    let mut more = Vec::new();
    for (name, (dtype, shape, bytes)) in &mut tensors {
        if name.ends_with(".block_sparse_moe.gate.weight") {
            // the router: 4 rows more, the same as the first 4
            shape[0] *= 2;
            bytes.extend_from_slice(&bytes.clone());
        } else if let Some((head, tail)) = name.split_once(".experts.") {
            let (e, role) = tail.split_once('.').unwrap();
            let e: usize = e.parse().unwrap();
            let copy = format!("{head}.experts.{}.{role}", e + 4);
            more.push((copy, (*dtype, shape.clone(), bytes.clone())));
        }
    }
    tensors.extend(more);
    let tmp = tempfile::tempdir().unwrap();
    let eight = tmp.path().join("hf8");
    std::fs::create_dir(&eight).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), eight.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["num_local_experts"] = 8.into();
    std::fs::write(eight.join("config.json"), cfg.to_string()).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &eight.join("model.safetensors")).unwrap();
    let q4km: QuantTarget = "q4_k_m".parse().unwrap();
    for (input, n, want) in [
        (eight.as_path(), 8, [DType::Q8_0, DType::Q8_0, DType::Q5_1]),
        (src.as_path(), 4, [DType::Q5_0, DType::Q5_0, DType::Q5_0]),
    ] {
        let out = tmp.path().join(format!("x{n}"));
        convert(input, &out, q4km);
        let got = tensor_bytes(&out);
        for l in 0..2 {
            let mut want = want;
            if n == 4 && l == 1 {
                want[1] = DType::Q8_0; // use_more_bits: the last eighth
            }
            for (role, want) in ["attn_k", "attn_v", "attn_output"].iter().zip(want) {
                let name = format!("blk.{l}.{role}.weight");
                assert_eq!(got[&name].0, want, "{n} experts: {name}");
            }
        }
    }
}
