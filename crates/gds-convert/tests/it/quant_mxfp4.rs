//! `--quant mxfp4_moe` against llama-quantize's `MXFP4_MOE` (fixtures/tiny-gptoss-mxfp4.gguf,
//! made from tiny-gptoss.gguf by it: fixtures/make_arch_fixtures.py's `gptoss_mxfp4`).

use gds_convert::{ConvertOptions, NoProgress, QuantTarget};
use gds_format::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Every tensor of a converted model: its dtype and bytes.
fn tensors(dir: &Path) -> BTreeMap<String, (DType, Vec<u8>)> {
    let bytes = std::fs::read(dir.join(gds_format::MANIFEST_FILE)).unwrap();
    let m = gds_format::Manifest::parse(&bytes).unwrap();
    let mut out = BTreeMap::new();
    for t in m.tensors() {
        let data = std::fs::read(dir.join(m.layer(t.layer).unwrap().file)).unwrap();
        let (at, n) = (t.offset as usize, t.nbytes as usize);
        out.insert(t.name.to_string(), (t.dtype, data[at..at + n].to_vec()));
    }
    out
}

fn convert(input: &Path, out: &Path, quant: QuantTarget) {
    let opts = ConvertOptions {
        quant,
        ..ConvertOptions::default()
    };
    gds_convert::convert(input, out, &opts, &NoProgress).unwrap();
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
        &fixtures().join("tiny-gptoss-mxfp4.gguf"),
        &reference,
        QuantTarget::Keep,
    );
    let want = tensors(&reference);
    let n_mxfp4 = want.values().filter(|(d, _)| *d == DType::MXFP4).count();
    let n_q8 = want.values().filter(|(d, _)| *d == DType::Q8_0).count();
    // 4 blocks x gate, up, down experts; the attention's 4 matrices a block, embedding, head
    assert_eq!((n_mxfp4, n_q8), (12, 18));
    // the same as `--quant q8_0 --quant-override _exps=mxfp4`
    let overridden = tmp.path().join("overridden");
    let opts = ConvertOptions {
        quant: QuantTarget::To(DType::Q8_0),
        overrides: vec!["_EXPS=MXFP4".parse().unwrap()],
        ..ConvertOptions::default()
    };
    gds_convert::convert(
        &fixtures().join("tiny-gptoss.gguf"),
        &overridden,
        &opts,
        &NoProgress,
    )
    .unwrap();
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
            convert(&fixtures().join(input), &out, "MXFP4_MOE".parse().unwrap());
            out
        });
        let got = tensors(&out);
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
    convert(
        &fixtures().join("tiny-llama3.gguf"),
        &out,
        QuantTarget::Mxfp4Moe,
    );
    for (name, (dtype, _)) in tensors(&out) {
        let want = if name.ends_with("norm.weight") {
            DType::F32
        } else {
            DType::Q8_0
        };
        assert_eq!(dtype, want, "{name}");
    }
}
