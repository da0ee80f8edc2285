//! `gdsconv` on the committed fixtures (made by gguf-py and safetensors in
//! fixtures/make_fixtures.py) and on SmolLM2 dequantized into a Hugging Face directory
//! (scripts/smollm_to_hf.py).

use gds_format::{DType, Manifest, MANIFEST_FILE};
use gds_tests::*;
use std::path::{Path, PathBuf};

fn convert(input: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["convert", input.to_str().unwrap(), out.to_str().unwrap()];
    args.extend_from_slice(extra);
    run("gdsconv", &args)
}

fn ok(o: &std::process::Output) {
    assert!(
        o.status.success(),
        "exit {:?}\n{}\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
}

fn valid(dir: &Path) {
    let o = run("gdsconv", &["validate", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{} {}", stdout(&o), stderr(&o));
}

/// Every tensor of a converted directory, dequantized to f32, by name.
fn tensors_f32(dir: &Path) -> std::collections::BTreeMap<String, (DType, Vec<u64>, Vec<f32>)> {
    let mb = std::fs::read(dir.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&mb).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for t in m.tensors() {
        let l = m.layer(t.layer).unwrap();
        let data = std::fs::read(dir.join(l.file)).unwrap();
        let bytes = &data[t.offset as usize..(t.offset + t.nbytes) as usize];
        let mut f = vec![0f32; t.n_elements() as usize];
        gds_kernels::dequantize(t.dtype, bytes, &mut f)
            .unwrap_or_else(|e| panic!("{}: {e}", t.name));
        out.insert(t.name.to_string(), (t.dtype, t.dims().to_vec(), f));
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tiny_gguf_and_hf_describe_the_same_model() {
    let tmp = tempfile::tempdir().unwrap();
    let g = tmp.path().join("g.gds");
    let h = tmp.path().join("h.gds");
    ok(&convert(&fixture("tiny-llama.gguf"), &g, &[]));
    ok(&convert(&fixture("tiny-llama-hf"), &h, &[]));
    valid(&g);
    valid(&h);
    let (tg, th) = (tensors_f32(&g), tensors_f32(&h));
    assert_eq!(tg.keys().collect::<Vec<_>>(), th.keys().collect::<Vec<_>>());
    let dtypes: std::collections::BTreeSet<DType> = tg.values().map(|v| v.0).collect();
    for d in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4K,
        DType::Q6K,
    ] {
        assert!(dtypes.contains(&d), "fixture lacks {d}");
    }
    // Tolerance: the GGUF's own quantization error (the HF side holds the unquantized
    // values in HF Q/K order, except for K-quants, whose exact dequantized values it holds).
    // A wrong Q/K permutation gives differences of the order of the weights themselves.
    for (name, (dt, shape, a)) in &tg {
        let (_, hshape, b) = &th[name];
        assert_eq!(shape, hshape, "{name}");
        let tol = match dt {
            DType::Q4_0 | DType::Q4_1 => 0.15,
            DType::Q5_0 | DType::Q5_1 => 0.08,
            DType::Q8_0 => 0.01,
            _ => 0.005,
        };
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let d = max_abs_diff(a, b);
        assert!(
            d <= scale * tol,
            "{name} ({dt}): max diff {d} (scale {scale})"
        );
    }
    // the HF directory kept its tokenizer and chat template
    let cfg = std::fs::read_to_string(h.join("tokenizer_config.json")).unwrap();
    assert!(cfg.contains("chat_template"));
    assert!(h.join("generation_config.json").exists());
    // tied variant: no output.weight, tie flag set
    let t = tmp.path().join("t.gds");
    ok(&convert(&fixture("tiny-llama-tied.gguf"), &t, &[]));
    valid(&t);
    let mb = std::fs::read(t.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&mb).unwrap();
    assert!(m.get_bool("model.tie_embeddings").unwrap());
    assert!(m.find_tensor("output.weight").is_none());
}

#[test]
fn quantization_options() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tensors_f32(&{
        let d = tmp.path().join("f32.gds");
        ok(&convert(&fixture("tiny-llama-hf"), &d, &["--quant", "f32"]));
        valid(&d);
        d
    });
    for (q, dt, tol) in [
        ("f16", DType::F16, 1e-3f32),
        ("bf16", DType::BF16, 1e-2),
        ("q8_0", DType::Q8_0, 1e-2),
        ("q4_1", DType::Q4_1, 0.1),
        ("q4_0", DType::Q4_0, 0.15),
    ] {
        let d = tmp.path().join(format!("{q}.gds"));
        ok(&convert(&fixture("tiny-llama-hf"), &d, &["--quant", q]));
        valid(&d);
        for (name, (dtype, shape, v)) in tensors_f32(&d) {
            let (_, _, b) = &base[&name];
            if shape.len() == 1 {
                assert_eq!(dtype, DType::F32, "{name}: 1-D tensors stay f32");
            } else {
                assert_eq!(dtype, dt, "{name}");
            }
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            assert!(
                max_abs_diff(&v, b) <= scale * tol,
                "{q} {name}: {}",
                max_abs_diff(&v, b) / scale
            );
        }
    }
    // already-quantized GGUF tensors pass through unless --requantize
    let keep = tmp.path().join("keep.gds");
    ok(&convert(
        &fixture("tiny-llama.gguf"),
        &keep,
        &["--quant", "q8_0"],
    ));
    let k = tensors_f32(&keep);
    assert!(k.values().any(|v| v.0 == DType::Q4K), "Q4_K passes through");
    let req = tmp.path().join("req.gds");
    ok(&convert(
        &fixture("tiny-llama.gguf"),
        &req,
        &["--quant", "q8_0", "--requantize"],
    ));
    valid(&req);
    assert!(tensors_f32(&req)
        .values()
        .all(|v| v.0 == DType::Q8_0 || v.1.len() == 1));
}

#[test]
fn k_quant_options_and_mixes() {
    // tiny-llama-hf: hidden 64, so most matrices' rows are not whole 256-value super-blocks
    // and get llama.cpp's fallback type (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0, q3_k ->
    // q4_0, with a warning); ffn_down's rows (ffn 256) are whole blocks.
    let tmp = tempfile::tempdir().unwrap();
    let hf = fixture("tiny-llama-hf");
    let base = tensors_f32(&{
        let d = tmp.path().join("f32.gds");
        ok(&convert(&hf, &d, &["--quant", "f32"]));
        d
    });
    let ffn_down = |n: &str| n.ends_with("ffn_down.weight");
    type Want = fn(&str) -> DType;
    fn k_or(n: &str, k: DType, fallback: DType) -> DType {
        if n.ends_with("ffn_down.weight") {
            k
        } else {
            fallback
        }
    }
    let cases: [(&str, Want, f32); 7] = [
        ("q5_0", |_| DType::Q5_0, 0.08),
        ("q5_1", |_| DType::Q5_1, 0.05),
        ("q4_k", |n| k_or(n, DType::Q4K, DType::Q5_0), 0.15),
        ("q5_k", |n| k_or(n, DType::Q5K, DType::Q5_1), 0.08),
        ("q6_k", |n| k_or(n, DType::Q6K, DType::Q8_0), 0.04),
        ("q3_k", |n| k_or(n, DType::Q3K, DType::Q4_0), 0.35),
        // 2 layers: use_more_bits picks layer 1 (the last eighth): its attn_v's Q6_K falls
        // back to Q8_0; the output head's rows are not whole 256-blocks, so llama.cpp's rule
        // gives it Q8_0; the rest is Q4_K, Q5_0 where the rows are 64 values
        (
            "q4_k_m",
            |n| match n {
                "blk.0.ffn_down.weight" => DType::Q4K,
                "blk.1.ffn_down.weight" => DType::Q6K,
                "output.weight" | "blk.1.attn_v.weight" => DType::Q8_0,
                _ => DType::Q5_0,
            },
            0.15,
        ),
    ];
    for (q, want, tol) in cases {
        let d = tmp.path().join(format!("{q}.gds"));
        let o = convert(&hf, &d, &["--quant", q]);
        ok(&o);
        valid(&d);
        let got = tensors_f32(&d);
        for (name, (dtype, shape, v)) in &got {
            let (_, _, b) = &base[name];
            let expect = if shape.len() == 1 {
                DType::F32
            } else {
                want(name)
            };
            assert_eq!(*dtype, expect, "{q} {name}");
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            assert!(
                max_abs_diff(v, b) <= scale * tol,
                "{q} {name}: {}",
                max_abs_diff(v, b) / scale
            );
        }
        assert!(got.keys().any(|n| ffn_down(n)));
        let err = stderr(&o);
        assert_eq!(
            err.contains("fallback type"),
            q.contains("_k"),
            "{q}: {err}"
        );
        assert!(!err.contains("kept as float"), "{q}: {err}");
        assert_eq!(
            Manifest::parse(&std::fs::read(d.join(MANIFEST_FILE)).unwrap())
                .unwrap()
                .get_str("convert.quant")
                .unwrap(),
            q
        );
    }
    // the mixed model runs
    let o = run(
        "gdsrun",
        &[
            tmp.path().join("q4_k_m.gds").to_str().unwrap(),
            "-p",
            "Hello",
            "--temp",
            "0",
            "--max-tokens",
            "3",
        ],
    );
    ok(&o);
}

/// `--quant-override REGEX=TYPE` after the q4_k_m mix on tiny-llama-hf (2 layers, rows of
/// 64 and 256 values): the first override that matches decides, 256-block types on rows of
/// 64 fall back as the mix's do, norms stay f32, the types are in the manifest, overrides
/// that change nothing are warned about; then `inspect` gives the bits per weight of each
/// dtype and of the model from the block sizes.
#[test]
fn quant_overrides_and_bits_per_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = fixture("tiny-llama-hf");
    let base = tensors_f32(&{
        let d = tmp.path().join("f32.gds");
        ok(&convert(&hf, &d, &["--quant", "f32"]));
        d
    });
    let d = tmp.path().join("ov.gds");
    let overrides = [
        r"blk\.0\.attn_v=q8_0",
        "ffn_down=Q4_0",
        r"blk\.1\.ffn_down=q6_k",
        "attn_k=q6_k",
        "TOKEN_EMBD=f16",
        "norm=q8_0",
    ];
    let mut args = vec!["--quant", "q4_k_m"];
    for o in &overrides {
        args.extend(["--quant-override", o]);
    }
    let o = convert(&hf, &d, &args);
    ok(&o);
    valid(&d);
    let want = |n: &str| match n {
        "token_embd.weight" => DType::F16,
        // the mix's rule for an output head whose rows are not whole 256-blocks
        "output.weight" => DType::Q8_0,
        "blk.0.attn_v.weight" => DType::Q8_0,
        // llama.cpp counts only the attn_v its mix decides: blk.1's is its first (layer 0
        // of 2: no more bits; Q4_K -> Q5_0 on rows of 64), not its last (Q6_K -> Q8_0)
        "blk.1.attn_v.weight" => DType::Q5_0,
        // ffn_down=q4_0 comes first: blk\.1\.ffn_down never decides
        n if n.ends_with("ffn_down.weight") => DType::Q4_0,
        // q6_k on rows of 64: llama.cpp's fallback, Q8_0
        n if n.ends_with("attn_k.weight") => DType::Q8_0,
        // the mix's Q4_K on rows of 64
        _ => DType::Q5_0,
    };
    let got = tensors_f32(&d);
    assert_eq!(got.len(), base.len());
    for (name, (dtype, shape, v)) in &got {
        let expect = if shape.len() == 1 {
            DType::F32
        } else {
            want(name)
        };
        assert_eq!(*dtype, expect, "{name}");
        let b = &base[name].2;
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        assert!(max_abs_diff(v, b) <= scale * 0.15, "{name}");
    }
    let err = stderr(&o);
    assert!(err.contains("fallback type"), "{err}");
    assert!(
        err.contains(r"--quant-override blk\.1\.ffn_down=q6_k changes no tensor")
            && err.contains("earlier --quant-override"),
        "{err}"
    );
    assert!(
        err.contains("--quant-override norm=q8_0 changes no tensor")
            && err.contains("never quantized"),
        "{err}"
    );
    assert_eq!(err.matches("changes no tensor").count(), 2, "{err}");
    let mb = std::fs::read(d.join(MANIFEST_FILE)).unwrap();
    let m = Manifest::parse(&mb).unwrap();
    assert_eq!(m.get_str("convert.quant").unwrap(), "q4_k_m");
    let listed: Vec<String> =
        serde_json::from_str(m.get_str("convert.quant_overrides").unwrap()).unwrap();
    assert_eq!(listed[1], "ffn_down=q4_0");
    assert_eq!(listed[4], "TOKEN_EMBD=f16");
    assert_eq!(listed.len(), overrides.len());

    // inspect: bits per weight, from each type's block (bytes per block of so many weights)
    let block = |d: &str| -> (u64, u64) {
        match d {
            "f32" => (4, 1),
            "f16" => (2, 1),
            "q8_0" => (2 + 32, 32),
            "q4_0" => (2 + 16, 32),
            "q5_0" => (2 + 4 + 16, 32),
            _ => panic!("unexpected dtype {d}"),
        }
    };
    let mut per: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    for t in m.tensors() {
        let e = per.entry(t.dtype.name().to_string()).or_default();
        e.0 += t.n_elements();
        e.1 += t.nbytes;
    }
    assert_eq!(per.len(), 5, "{per:?}");
    let o = run("gdsconv", &["inspect", d.to_str().unwrap(), "--json"]);
    ok(&o);
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let (mut weights, mut bits) = (0u64, 0f64);
    for (name, (n, bytes)) in &per {
        let (bb, bw) = block(name);
        let want = bb as f64 * 8.0 / bw as f64;
        assert_eq!(*bytes * bw, n * bb, "{name}: the blocks' bytes");
        let got = &j["by_dtype"][name];
        assert!(
            (got["bits_per_weight"].as_f64().unwrap() - want).abs() < 1e-9,
            "{name}: {got} want {want}"
        );
        assert_eq!(got["parameters"].as_u64().unwrap(), *n, "{name}");
        assert_eq!(got["bytes"].as_u64().unwrap(), *bytes, "{name}");
        weights += n;
        bits += *n as f64 * want;
    }
    let want = bits / weights as f64;
    let all = j["bits_per_weight"].as_f64().unwrap();
    assert!((all - want).abs() < 1e-9, "{all} want {want}");
    let o = run("gdsconv", &["inspect", d.to_str().unwrap()]);
    ok(&o);
    let text = stdout(&o);
    assert!(
        text.contains(&format!("bits per weight: {want:.2} ")),
        "{text}"
    );
    let q5 = text.lines().find(|l| l.starts_with("q5_0 ")).unwrap();
    assert!(q5.trim_end().ends_with("5.5000"), "{q5}");
}

/// A bad regex or type for `--quant-override`: a usage error (exit 2) naming the value,
/// nothing written.
#[test]
fn bad_quant_overrides_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gds");
    for (value, needle) in [
        ("(attn_v=q8_0", "not a valid regex"),
        ("attn_v=q7_0", "unknown type \"q7_0\""),
        ("attn_v=q4_k_m", "unknown type"),
        ("attn_v", "expected REGEX=TYPE"),
    ] {
        let o = convert(
            &fixture("tiny-llama-hf"),
            &out,
            &["--quant", "q8_0", "--quant-override", value],
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{value}: {err}");
        assert!(
            err.contains(value) && err.contains(needle) && err.contains("--quant-override"),
            "{value}: {err}"
        );
        assert!(!out.exists());
    }
}

#[test]
fn bad_fixture_files_fail_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let expect = [
        ("bad_magic.gguf", "not a GGUF"),
        ("bad_version.gguf", "unsupported GGUF version 99"),
        ("unknown_dtype.gguf", "type id 99"),
        ("removed_dtype.gguf", "type id 4"),
        ("tensor_oob.gguf", "out of bounds"),
        ("misaligned_offset.gguf", "alignment"),
        ("huge_tensor_count.gguf", "exceed the file size"),
        ("huge_string.gguf", "truncated"),
        ("shape_overflow.gguf", "overflows"),
        ("truncated.gguf", "out of bounds"),
        ("truncated_header.gguf", "truncated"),
        ("empty.gguf", "too short"),
    ];
    for (name, needle) in expect {
        let out = tmp.path().join(format!("{name}.gds"));
        let o = convert(&fixture(&format!("bad/{name}")), &out, &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(name) && err.contains(needle),
            "{name}: want {needle:?} in {err}"
        );
        assert!(!err.contains("panicked") && !out.exists(), "{name}");
    }
    // safetensors: a missing shard is named
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ] {
        std::fs::copy(fixture("tiny-llama-hf").join(f), hf.join(f)).unwrap();
    }
    let o = convert(&hf, &tmp.path().join("x.gds"), &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("model-00002-of-00002.safetensors"),
        "{}",
        stderr(&o)
    );
}

fn smollm_hf() -> PathBuf {
    gds_tests::smollm_hf_f16()
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn smollm2_from_safetensors_matches_the_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let h = tmp.path().join("hf.gds");
    ok(&convert(&smollm_hf(), &h, &[]));
    valid(&h);
    let g = tmp.path().join("gguf.gds");
    ok(&convert(&smollm_gguf(), &g, &[]));
    let (tg, th) = (tensors_f32(&g), tensors_f32(&h));
    assert_eq!(tg.len(), th.len());
    for (name, (_, shape, a)) in &tg {
        let (dt, hshape, b) = &th[name];
        assert_eq!(shape, hshape, "{name}");
        assert!(*dt == DType::F16 || *dt == DType::F32, "{name}: {dt}");
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        assert!(
            max_abs_diff(a, b) <= scale * 2e-3,
            "{name}: Q/K permutation or dtype wrong: {}",
            max_abs_diff(a, b) / scale
        );
    }
}
