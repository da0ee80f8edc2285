//! The safetensors reader against the generated fixtures (`fixtures/make_fixtures.py`) and
//! against checkpoints built on the fly from them: single file, shards, HF directory, and
//! the ways such inputs break.

use gds_convert::safetensors::{permute_rope_rows, read_safetensors, SafetensorsError};
use gds_convert::source::{MetaValue, Source, SourceTensor, Transform};
use gds_format::DType;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn hf_dir() -> PathBuf {
    fixtures().join("tiny-llama-hf")
}

/// One tensor as stored: dtype, shape, bytes.
#[derive(Clone, Debug, PartialEq)]
struct Stored {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// All tensors of the fixture's shards, read with the safetensors crate alone.
fn fixture_tensors() -> BTreeMap<String, Stored> {
    let mut out = BTreeMap::new();
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        let buf = fs::read(hf_dir().join(shard)).unwrap();
        let st = SafeTensors::deserialize(&buf).unwrap();
        for (name, view) in st.tensors() {
            out.insert(
                name,
                Stored {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: view.data().to_vec(),
                },
            );
        }
    }
    out
}

fn write_st(path: &Path, tensors: &BTreeMap<String, Stored>) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn config() -> serde_json::Map<String, serde_json::Value> {
    serde_json::from_str(&fs::read_to_string(hf_dir().join("config.json")).unwrap()).unwrap()
}

/// A temporary HF directory: `config` as config.json, `tensors` as one model.safetensors.
fn temp_hf(
    config: &serde_json::Map<String, serde_json::Value>,
    tensors: &BTreeMap<String, Stored>,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    write_st(&dir.path().join("model.safetensors"), tensors);
    dir
}

/// A copy of the whole fixture directory.
fn copy_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in fs::read_dir(hf_dir()).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn tensor<'a>(s: &'a Source, name: &str) -> &'a SourceTensor {
    s.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

fn u64_meta(s: &Source, key: &str) -> u64 {
    match s.metadata.get(key) {
        Some(MetaValue::U64(v)) => *v,
        other => panic!("{key}: {other:?}"),
    }
}

fn err_text(r: Result<Source, SafetensorsError>) -> (SafetensorsError, String) {
    let e = r.expect_err("expected an error");
    let text = e.to_string();
    (e, text)
}

const LAYER_TENSORS: [&str; 9] = [
    "attn_k.weight",
    "attn_norm.weight",
    "attn_output.weight",
    "attn_q.weight",
    "attn_v.weight",
    "ffn_down.weight",
    "ffn_gate.weight",
    "ffn_norm.weight",
    "ffn_up.weight",
];

/// Everything the fixture's HF directory must read as.
fn check_tiny_llama(s: &Source) {
    assert_eq!(s.arch, "llama");
    assert!(s.runnable);
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    for (k, v) in [
        ("model.n_layers", 2),
        ("model.n_embd", 64),
        ("model.n_heads", 4),
        ("model.n_kv_heads", 2),
        ("model.n_ff", 256),
        ("model.vocab_size", 320),
        ("model.context_length", 256),
        ("model.head_dim", 16),
        ("tokenizer.bos_token_id", 1),
        ("tokenizer.eos_token_id", 2),
    ] {
        assert_eq!(u64_meta(s, k), v, "{k}");
    }
    assert_eq!(
        s.metadata["model.rms_norm_eps"],
        MetaValue::F64(1e-5),
        "eps"
    );
    assert_eq!(s.metadata["model.rope_theta"], MetaValue::F64(10000.0));
    assert_eq!(s.metadata["model.tie_embeddings"], MetaValue::Bool(false));
    assert_eq!(s.metadata["tokenizer.add_bos"], MetaValue::Bool(false));
    assert_eq!(
        s.metadata["general.architecture"],
        MetaValue::Str("llama".into())
    );
    assert_eq!(
        s.metadata["general.source_architecture"],
        MetaValue::Str("LlamaForCausalLM".into())
    );

    // order: embedding, layer 0, layer 1, then the head, by name within each
    let mut expected = vec!["token_embd.weight".to_owned()];
    for n in 0..2 {
        expected.extend(LAYER_TENSORS.iter().map(|t| format!("blk.{n}.{t}")));
    }
    expected.extend(["output.weight".to_owned(), "output_norm.weight".to_owned()]);
    let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, expected);

    let stored = fixture_tensors();
    for t in &s.tensors {
        let st = &stored[&t.source_name];
        assert_eq!(t.bytes(), &st.bytes[..], "{}", t.name);
        assert_eq!(
            t.shape,
            st.shape.iter().map(|&d| d as u64).collect::<Vec<_>>()
        );
        let want = match st.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            d => panic!("{d}"),
        };
        assert_eq!(t.dtype, want, "{}", t.name);
        let permuted = match t.name.rsplit('.').nth(1) {
            Some("attn_q") => Some(4),
            Some("attn_k") => Some(2),
            _ => None,
        };
        match permuted {
            Some(n_head) => assert_eq!(t.transform, Transform::PermuteRope { n_head }),
            None => assert_eq!(t.transform, Transform::None, "{}", t.name),
        }
    }
    assert_eq!(
        tensor(s, "blk.1.attn_q.weight").source_name,
        "model.layers.1.self_attn.q_proj.weight"
    );
    assert_eq!(tensor(s, "blk.0.attn_q.weight").dtype, DType::BF16);
    assert_eq!(tensor(s, "blk.0.attn_k.weight").dtype, DType::F16);
    assert_eq!(tensor(s, "blk.0.ffn_down.weight").dtype, DType::F32);
    assert_eq!(tensor(s, "output.weight").shape, [320, 64]);

    let tok = &s.tokenizer;
    assert!(tok
        .tokenizer_json
        .as_deref()
        .unwrap()
        .contains("<|im_start|>"));
    assert!(tok
        .tokenizer_config_json
        .as_deref()
        .unwrap()
        .contains("chat_template"));
    assert!(tok.generation_config_json.is_some());
}

#[test]
fn hf_directory() {
    check_tiny_llama(&read_safetensors(&hf_dir()).unwrap());
}

#[test]
fn sharded_through_index_json() {
    let s = read_safetensors(&hf_dir().join("model.safetensors.index.json")).unwrap();
    check_tiny_llama(&s);
    let files: std::collections::BTreeSet<_> =
        s.tensors.iter().map(|t| t.file.path.clone()).collect();
    assert_eq!(files.len(), 2, "both shards mapped");
    assert!(tensor(&s, "token_embd.weight")
        .file
        .path
        .ends_with("model-00001-of-00002.safetensors"));
    assert!(tensor(&s, "output.weight")
        .file
        .path
        .ends_with("model-00002-of-00002.safetensors"));
}

#[test]
fn single_file_with_config_beside_it() {
    let dir = temp_hf(&config(), &fixture_tensors());
    for tok in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        fs::copy(hf_dir().join(tok), dir.path().join(tok)).unwrap();
    }
    check_tiny_llama(&read_safetensors(dir.path()).unwrap());
    check_tiny_llama(&read_safetensors(&dir.path().join("model.safetensors")).unwrap());
}

/// The canonical Q/K layout is what llama.cpp's converter writes: permuting the HF tensor
/// reproduces the GGUF fixture's bytes (same dtype in both: BF16 for blk.0.attn_q, F16 for
/// blk.0.attn_k).
#[test]
fn permuted_qk_match_the_gguf_fixture() {
    let hf = read_safetensors(&hf_dir()).unwrap();
    let gguf = gds_convert::gguf::read_gguf(&fixtures().join("tiny-llama.gguf")).unwrap();
    for name in [
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.1.attn_v.weight",
        "blk.1.attn_output.weight",
        "output.weight",
        "output_norm.weight",
    ] {
        let h = tensor(&hf, name);
        let g = tensor(&gguf, name);
        assert_eq!(h.dtype, g.dtype, "{name}");
        assert_eq!(h.shape, g.shape, "{name}");
        let bytes = match h.transform {
            Transform::PermuteRope { n_head } => {
                let rows = h.shape[0] as usize;
                permute_rope_rows(&h.bytes(), rows, h.nbytes as usize / rows, n_head as usize)
            }
            Transform::None => h.bytes().to_vec(),
            Transform::NormOffset => unreachable!("llama norms carry no offset"),
        };
        assert_eq!(bytes, &g.bytes()[..], "{name}");
        if matches!(h.transform, Transform::PermuteRope { .. }) {
            assert_ne!(h.bytes(), g.bytes(), "{name}: permutation is not a no-op");
        }
    }
}

#[test]
fn missing_shard_is_named() {
    let dir = copy_fixture();
    fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::MissingShard { .. }), "{e:?}");
    assert!(text.contains("model-00002-of-00002.safetensors"), "{text}");
    assert!(text.contains("model.safetensors.index.json"), "{text}");
    assert!(
        text.contains("lm_head.weight"),
        "names a tensor it holds: {text}"
    );
}

#[test]
fn index_naming_the_wrong_shard() {
    let dir = copy_fixture();
    let path = dir.path().join("model.safetensors.index.json");
    let text = fs::read_to_string(&path).unwrap().replacen(
        "\"lm_head.weight\": \"model-00002-of-00002.safetensors\"",
        "\"lm_head.weight\": \"model-00001-of-00002.safetensors\"",
        1,
    );
    fs::write(&path, text).unwrap();
    let (_, text) = err_text(read_safetensors(&path));
    assert!(text.contains("lm_head.weight"), "{text}");
    assert!(text.contains("model-00001-of-00002.safetensors"), "{text}");
}

#[test]
fn index_with_path_in_shard_name() {
    let dir = copy_fixture();
    let path = dir.path().join("model.safetensors.index.json");
    let text = fs::read_to_string(&path).unwrap().replacen(
        "\"lm_head.weight\": \"model-00002-of-00002.safetensors\"",
        "\"lm_head.weight\": \"../model-00002-of-00002.safetensors\"",
        1,
    );
    fs::write(&path, text).unwrap();
    let (e, text) = err_text(read_safetensors(&path));
    assert!(matches!(e, SafetensorsError::Index { .. }), "{e:?}");
    assert!(text.contains("not a plain file name"), "{text}");
}

#[test]
fn truncated_file() {
    let dir = copy_fixture();
    let shard = dir.path().join("model-00001-of-00002.safetensors");
    let bytes = fs::read(&shard).unwrap();
    fs::write(&shard, &bytes[..bytes.len() - 100]).unwrap();
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::Tensor { .. }), "{e:?}");
    assert!(text.contains("model-00001-of-00002.safetensors"), "{text}");
    assert!(text.contains("truncated"), "{text}");
    // the last tensor in the data section is the one cut short
    assert!(
        text.contains("model.layers.0.self_attn.v_proj.weight"),
        "{text}"
    );

    // cut inside the header
    fs::write(&shard, &bytes[..200]).unwrap();
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::Header { .. }), "{e:?}");
    assert!(text.contains("runs past the end"), "{text}");

    // shorter than the header length itself
    fs::write(&shard, &bytes[..5]).unwrap();
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(text.contains("too short"), "{text}");

    // trailing garbage after the data
    let mut long = bytes.clone();
    long.extend_from_slice(&[0; 16]);
    fs::write(&shard, &long).unwrap();
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::Header { .. }), "{e:?}");
    assert!(text.contains("model-00001-of-00002.safetensors"), "{text}");
}

#[test]
fn header_length_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    for (bytes, want) in [
        (
            [u64::MAX.to_le_bytes().to_vec(), b"{}".to_vec()].concat(),
            "exceeds",
        ),
        (
            [1000u64.to_le_bytes().to_vec(), b"{}".to_vec()].concat(),
            "runs past the end",
        ),
        (
            [4u64.to_le_bytes().to_vec(), b"\xff\xfe{}".to_vec()].concat(),
            "not UTF-8",
        ),
        (
            [4u64.to_le_bytes().to_vec(), b"[1,]".to_vec()].concat(),
            "not a JSON object",
        ),
        (Vec::new(), "too short"),
    ] {
        fs::write(&file, &bytes).unwrap();
        let (e, text) = err_text(read_safetensors(&file));
        assert!(matches!(e, SafetensorsError::Header { .. }), "{e:?}");
        assert!(text.contains(want), "{text}");
        assert!(text.contains("model.safetensors"), "{text}");
    }
}

/// Header entries that lie about their tensor: the error names the tensor.
#[test]
fn inconsistent_header_entries() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("x.safetensors");
    for (entry, want) in [
        (
            r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}}"#,
            "needs 192 bits",
        ),
        (
            r#"{"w":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}}"#,
            "unknown dtype",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}}"#,
            "end before they start",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}"#,
            "not a non-negative integer",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}}"#,
            "overflow",
        ),
        (
            r#"{"w":{"shape":[4],"data_offsets":[0,16]}}"#,
            "no \"dtype\"",
        ),
    ] {
        let mut h = entry.as_bytes().to_vec();
        h.resize(h.len().div_ceil(8) * 8, b' ');
        let bytes = [(h.len() as u64).to_le_bytes().to_vec(), h, vec![0; 16]].concat();
        fs::write(&file, &bytes).unwrap();
        let (e, text) = err_text(read_safetensors(&file));
        assert!(matches!(e, SafetensorsError::Tensor { .. }), "{e:?}");
        assert!(text.contains("\"w\"") && text.contains(want), "{text}");
    }
    // overlapping offsets: each entry is fine alone; the crate's validation catches it
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let bytes = [
        (h.len() as u64).to_le_bytes().to_vec(),
        h.as_bytes().to_vec(),
        vec![0; 12],
    ]
    .concat();
    fs::write(&file, &bytes).unwrap();
    let (_, text) = err_text(read_safetensors(&file));
    assert!(text.contains("x.safetensors"), "{text}");
}

#[test]
fn bad_dtype_names_the_tensor_unless_ignored() {
    let mut tensors = fixture_tensors();
    // an inv_freq buffer in F64 is dropped, so its dtype does not matter
    tensors.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Stored {
            dtype: Dtype::F64,
            shape: vec![8],
            bytes: vec![0; 64],
        },
    );
    let dir = temp_hf(&config(), &tensors);
    let s = read_safetensors(dir.path()).unwrap();
    assert!(s
        .tensors
        .iter()
        .all(|t| !t.source_name.contains("inv_freq")));
    assert!(
        s.warnings.iter().any(|w| w.contains("inv_freq")),
        "{:?}",
        s.warnings
    );

    let mut bad = fixture_tensors();
    let down = "model.layers.1.mlp.down_proj.weight";
    let st = bad[down].clone();
    bad.insert(
        down.into(),
        Stored {
            dtype: Dtype::I64,
            shape: st.shape.clone(),
            bytes: vec![0; st.shape.iter().product::<usize>() * 8],
        },
    );
    let dir = temp_hf(&config(), &bad);
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(
        matches!(e, SafetensorsError::UnsupportedDtype { .. }),
        "{e:?}"
    );
    assert!(text.contains(down) && text.contains("I64"), "{text}");
    assert!(text.contains("model.safetensors"), "{text}");
}

#[test]
fn unknown_architecture_keeps_names() {
    let mut cfg = serde_json::Map::new();
    cfg.insert(
        "architectures".into(),
        serde_json::json!(["GPT2LMHeadModel"]),
    );
    cfg.insert("model_type".into(), serde_json::json!("gpt2"));
    let f32s = |n: usize| Stored {
        dtype: Dtype::F32,
        shape: vec![n],
        bytes: vec![0; n * 4],
    };
    let tensors: BTreeMap<String, Stored> = [
        "transformer.h.10.ln_1.weight",
        "transformer.h.2.mlp.c_fc.weight",
        "transformer.h.2.attn.c_attn.weight",
        "transformer.ln_f.weight",
        "transformer.wte.weight",
    ]
    .iter()
    .map(|n| (n.to_string(), f32s(4)))
    .collect();
    let dir = temp_hf(&cfg, &tensors);
    let s = read_safetensors(dir.path()).unwrap();
    assert!(!s.runnable);
    assert_eq!(s.arch, "gpt2");
    assert!(
        s.warnings.iter().any(|w| w.contains(
            "architecture GPT2LMHeadModel is not supported by gdsrun; tensors are grouped by layer index"
        )),
        "{:?}",
        s.warnings
    );
    let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "transformer.h.2.attn.c_attn.weight",
            "transformer.h.2.mlp.c_fc.weight",
            "transformer.h.10.ln_1.weight",
            "transformer.ln_f.weight",
            "transformer.wte.weight",
        ]
    );
    assert!(s
        .tensors
        .iter()
        .all(|t| t.name == t.source_name && t.transform == Transform::None));
    assert_eq!(
        s.metadata["general.source_architecture"],
        MetaValue::Str("GPT2LMHeadModel".into())
    );
}

#[test]
fn bare_file_without_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("weights.safetensors");
    write_st(&file, &fixture_tensors());
    let s = read_safetensors(&file).unwrap();
    assert!(!s.runnable);
    assert_eq!(s.arch, "unknown");
    assert!(
        s.warnings
            .iter()
            .any(|w| w.contains("no config.json") && w.contains("llama-family")),
        "{:?}",
        s.warnings
    );
    assert!(s.tensors.iter().all(|t| t.name == t.source_name));
    assert_eq!(s.tensors.len(), 21);
    assert_eq!(s.tensors[0].name, "model.embed_tokens.weight");
}

#[test]
fn tied_embeddings() {
    // no lm_head.weight: tied even though config.json says false
    let mut tensors = fixture_tensors();
    tensors.remove("lm_head.weight");
    let dir = temp_hf(&config(), &tensors);
    let s = read_safetensors(dir.path()).unwrap();
    assert!(s.runnable);
    assert_eq!(s.metadata["model.tie_embeddings"], MetaValue::Bool(true));
    assert!(s.tensors.iter().all(|t| t.name != "output.weight"));
    assert_eq!(s.tensors.len(), 20);

    // tie_word_embeddings true with a lm_head.weight present: dropped, with a warning
    let mut cfg = config();
    cfg.insert("tie_word_embeddings".into(), serde_json::json!(true));
    let dir = temp_hf(&cfg, &fixture_tensors());
    let s = read_safetensors(dir.path()).unwrap();
    assert_eq!(s.metadata["model.tie_embeddings"], MetaValue::Bool(true));
    assert!(s.tensors.iter().all(|t| t.name != "output.weight"));
    assert!(s
        .warnings
        .iter()
        .any(|w| w.contains("lm_head.weight dropped")));

    // untied
    let s = read_safetensors(&hf_dir()).unwrap();
    assert_eq!(s.metadata["model.tie_embeddings"], MetaValue::Bool(false));
    assert_eq!(tensor(&s, "output.weight").source_name, "lm_head.weight");
}

/// transformers' `generate` stops at generation_config.json's `eos_token_id` (Llama 3
/// Instruct's config.json names `<|end_of_text|>`, its generation config adds `<|eot_id|>`):
/// its others follow config.json's in the EOS list; a generation config's malformed list is
/// not the input's error where config.json names the EOS.
#[test]
fn generation_configs_eos_tokens_join_the_configs() {
    let dir = copy_fixture();
    fs::write(
        dir.path().join("generation_config.json"),
        r#"{"bos_token_id": 1, "eos_token_id": [2, 5, 2], "temperature": 0.6}"#,
    )
    .unwrap();
    let s = read_safetensors(dir.path()).unwrap();
    assert_eq!(u64_meta(&s, "tokenizer.eos_token_id"), 2);
    let tc: serde_json::Value =
        serde_json::from_str(s.tokenizer.tokenizer_config_json.as_deref().unwrap()).unwrap();
    assert_eq!(tc["eos_token_ids"], serde_json::json!([2, 5]));
    fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": "x"}"#,
    )
    .unwrap();
    let s = read_safetensors(dir.path()).unwrap();
    assert_eq!(u64_meta(&s, "tokenizer.eos_token_id"), 2);
}

#[test]
fn config_defaults_eos_list_and_rope_scaling() {
    let dir = copy_fixture();
    let mut cfg = config();
    cfg.remove("num_key_value_heads");
    cfg.remove("head_dim");
    cfg.remove("rope_theta");
    cfg.insert("eos_token_id".into(), serde_json::json!([2, 0]));
    cfg.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    );
    // with 4 KV heads the K and V projections have 64 rows, like Q: reuse Q's data
    let mut tensors = fixture_tensors();
    for n in 0..2 {
        let q = tensors[&format!("model.layers.{n}.self_attn.q_proj.weight")].clone();
        tensors.insert(
            format!("model.layers.{n}.self_attn.k_proj.weight"),
            q.clone(),
        );
        tensors.insert(format!("model.layers.{n}.self_attn.v_proj.weight"), q);
    }
    for f in fs::read_dir(dir.path()).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors")
            || p.ends_with("model.safetensors.index.json")
        {
            fs::remove_file(p).unwrap();
        }
    }
    fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    write_st(&dir.path().join("model.safetensors"), &tensors);

    let s = read_safetensors(dir.path()).unwrap();
    assert!(s.runnable, "{:?}", s.warnings);
    assert_eq!(u64_meta(&s, "model.n_kv_heads"), 4);
    assert_eq!(u64_meta(&s, "model.head_dim"), 16);
    assert_eq!(s.metadata["model.rope_theta"], MetaValue::F64(10000.0));
    assert_eq!(
        tensor(&s, "blk.0.attn_k.weight").transform,
        Transform::PermuteRope { n_head: 4 }
    );
    assert_eq!(u64_meta(&s, "tokenizer.eos_token_id"), 2);
    let tc: serde_json::Value =
        serde_json::from_str(s.tokenizer.tokenizer_config_json.as_deref().unwrap()).unwrap();
    assert_eq!(tc["eos_token_ids"], serde_json::json!([2, 0]));
    assert!(tc["chat_template"].as_str().unwrap().contains("im_start"));
    assert_eq!(
        s.metadata["model.rope_scaling.type"],
        MetaValue::Str("llama3".into())
    );
    assert_eq!(s.metadata["model.rope_scaling.factor"], MetaValue::F64(8.0));
    assert_eq!(
        u64_meta(&s, "model.rope_scaling.original_context_length"),
        128
    );

    // an unsupported scaling type is refused by name: the model could not be run, and the
    // written manifest would not validate (it was an "internal error" after writing)
    cfg.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "dynamic", "factor": 4.0}),
    );
    fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::Config { .. }), "{e:?}");
    assert!(
        text.contains("config.json") && text.contains("\"dynamic\" is not supported"),
        "{text}"
    );
}

#[test]
fn config_that_does_not_fit_the_tensors() {
    let mut cfg = config();
    cfg.insert("num_attention_heads".into(), serde_json::json!(8));
    cfg.insert("head_dim".into(), serde_json::json!(16));
    let dir = temp_hf(&cfg, &fixture_tensors());
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(
        text.contains("model.layers.0.self_attn.q_proj.weight"),
        "{text}"
    );
    assert!(text.contains("num_attention_heads 8"), "{text}");

    let mut cfg = config();
    cfg.insert("num_attention_heads".into(), serde_json::json!(0));
    let dir = temp_hf(&cfg, &fixture_tensors());
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::Config { .. }), "{e:?}");
    assert!(text.contains("config.json"), "{text}");

    let mut cfg = config();
    cfg.insert("hidden_size".into(), serde_json::json!("sixty-four"));
    let dir = temp_hf(&cfg, &fixture_tensors());
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(text.contains("hidden_size"), "{text}");

    let dir = temp_hf(&config(), &fixture_tensors());
    fs::write(dir.path().join("config.json"), "{not json").unwrap();
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(text.contains("config.json"), "{text}");
}

#[test]
fn missing_required_tensor() {
    let mut tensors = fixture_tensors();
    tensors.remove("model.layers.1.mlp.up_proj.weight");
    let dir = temp_hf(&config(), &tensors);
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(matches!(e, SafetensorsError::MissingTensor { .. }), "{e:?}");
    assert!(
        text.contains("blk.1.ffn_up.weight") && text.contains("model.layers.1.mlp.up_proj.weight"),
        "{text}"
    );
}

#[test]
fn duplicate_tensor_across_files() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = fixture_tensors();
    write_st(&dir.path().join("a.safetensors"), &tensors);
    let one: BTreeMap<String, Stored> = tensors
        .into_iter()
        .filter(|(n, _)| n == "model.norm.weight")
        .collect();
    write_st(&dir.path().join("b.safetensors"), &one);
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(
        matches!(e, SafetensorsError::DuplicateTensor { .. }),
        "{e:?}"
    );
    assert!(
        text.contains("model.norm.weight")
            && text.contains("a.safetensors")
            && text.contains("b.safetensors"),
        "{text}"
    );
}

#[test]
fn unsupported_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = err_text(read_safetensors(dir.path()));
    assert!(
        matches!(e, SafetensorsError::UnsupportedInput { .. }),
        "{e:?}"
    );
    let (e, _) = err_text(read_safetensors(&dir.path().join("nothing.safetensors")));
    assert!(matches!(e, SafetensorsError::Io { .. }), "{e:?}");
    let txt = dir.path().join("weights.bin");
    fs::write(&txt, b"0123456789").unwrap();
    let (e, _) = err_text(read_safetensors(&txt));
    assert!(
        matches!(e, SafetensorsError::UnsupportedInput { .. }),
        "{e:?}"
    );
}

/// Regression (issue 15): serde_json keeps the last of two equal keys, so a header naming a
/// tensor twice was read as whichever came last. Every duplicate key is refused, naming the
/// file and the key, at the top level and inside an entry.
#[test]
fn duplicate_header_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dup.safetensors");
    for (h, want) in [
        (
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            "key \"w\" appears twice",
        ),
        (
            r#"{"__metadata__":{},"__metadata__":{},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            "key \"__metadata__\" appears twice",
        ),
        (
            r#"{"w":{"dtype":"F16","dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            "duplicate field `dtype`",
        ),
    ] {
        let mut h = h.as_bytes().to_vec();
        h.resize(h.len().div_ceil(8) * 8, b' ');
        let bytes = [(h.len() as u64).to_le_bytes().to_vec(), h, vec![0; 8]].concat();
        fs::write(&file, &bytes).unwrap();
        let (e, text) = err_text(read_safetensors(&file));
        assert!(matches!(e, SafetensorsError::Header { .. }), "{e:?}");
        assert!(
            text.contains("dup.safetensors") && text.contains(want),
            "{text}"
        );
    }
}

/// Regression (issue 15): a layer count or size in config.json that the tensors contradict
/// was only noticed by the self-check after writing ("internal error: the written model is
/// invalid", no input named). It is an input error, found before anything is written.
#[test]
fn convert_refuses_a_config_the_tensors_contradict_before_writing() {
    let out_parent = tempfile::tempdir().unwrap();
    let out = out_parent.path().join("out");
    for (key, value, want) in [
        (
            "num_hidden_layers",
            1,
            "model.n_layers (num_hidden_layers in ",
        ),
        ("intermediate_size", 128, "does not fit the hyperparameters"),
    ] {
        let mut cfg = config();
        cfg.insert(key.into(), serde_json::json!(value));
        let dir = temp_hf(&cfg, &fixture_tensors());
        let e = gds_convert::convert(
            dir.path(),
            &out,
            &gds_convert::ConvertOptions::default(),
            &gds_convert::NoProgress,
        )
        .unwrap_err();
        let text = e.to_string();
        assert_eq!(e.kind(), gds_convert::ErrorKind::Input, "{text}");
        assert!(text.contains(want), "{text}");
        assert!(
            text.contains(&format!("{key} in ")) && text.contains(&format!("{value}")),
            "{text}"
        );
        assert!(!text.contains("internal error"), "{text}");
        assert_eq!(fs::read_dir(out_parent.path()).unwrap().count(), 0);
    }
}

/// `gds_convert::convert` of a copy of the fixture with `edit` applied to its files; the
/// output's parent stays empty on error.
fn convert_edited(
    edit: impl FnOnce(&Path),
) -> (
    Result<gds_convert::ConvertSummary, gds_convert::ConvertError>,
    tempfile::TempDir,
) {
    let dir = copy_fixture();
    edit(dir.path());
    let out_parent = tempfile::tempdir().unwrap();
    let r = gds_convert::convert(
        dir.path(),
        &out_parent.path().join("out"),
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    );
    (r, out_parent)
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    fs::write(path, v.to_string()).unwrap();
}

/// Regression (issue 33): a chat template that does not compile was written with exit 0 (only
/// `validate` rejected it), and a hostile one (a 20 000-term `+` chain overflowed the stack;
/// a loop that never ends) was written too. Convert fails naming tokenizer_config.json and
/// leaves nothing; `{% break %}`/`{% continue %}` (jinja2's loopcontrols) convert.
#[test]
fn convert_refuses_chat_templates_that_do_not_compile_or_exhaust_the_limits() {
    for (template, want) in [
        ("{% if %}".to_string(), "syntax error"),
        (format!("{{{{ 1{} }}}}", " + 1".repeat(20_000)), "operators"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                .into(),
            "instructions",
        ),
    ] {
        let (r, out_parent) = convert_edited(|d| {
            edit_json(&d.join("tokenizer_config.json"), |v| {
                v["chat_template"] = serde_json::Value::String(template.clone())
            })
        });
        let e = r.expect_err("refused");
        let text = e.to_string();
        assert_eq!(e.kind(), gds_convert::ErrorKind::Input, "{text}");
        assert!(
            text.contains("tokenizer_config.json") && text.contains(want),
            "{text}"
        );
        assert_eq!(fs::read_dir(out_parent.path()).unwrap().count(), 0);
    }
    let (r, _out) = convert_edited(|d| {
        edit_json(&d.join("tokenizer_config.json"), |v| {
            v["chat_template"] = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}".into()
        })
    });
    r.expect("break/continue convert");
}

/// Regression (issue 33): a tokenizer with more token ids than the embedding has rows was
/// converted (exit 0) and `gdsrun` crashed on the first such id. Convert refuses it.
#[test]
fn convert_refuses_a_tokenizer_with_ids_past_the_embedding() {
    let (r, out_parent) = convert_edited(|d| {
        edit_json(&d.join("tokenizer.json"), |v| {
            v["added_tokens"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({
                    "id": 320, "content": "<|extra|>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true
                }))
        })
    });
    let e = r.expect_err("refused");
    let text = e.to_string();
    assert_eq!(e.kind(), gds_convert::ErrorKind::Input, "{text}");
    assert!(
        text.contains("tokenizer.json") && text.contains("320") && text.contains("vocabulary"),
        "{text}"
    );
    assert_eq!(fs::read_dir(out_parent.path()).unwrap().count(), 0);
}

/// A tokenizer is code from the input: a pre-tokenizer pattern whose time grows faster than
/// the text (`\w*\w*\w*!`: every split of three runs of word characters is tried before
/// each "!"), or that backtracks without end (`(\w+\s?)*$`), was converted, and every prompt
/// of the model would have been slow wherever it ran. Convert refuses both, naming
/// tokenizer.json, and leaves nothing; the fixture's own pattern converts (the other tests).
#[test]
fn convert_refuses_a_tokenizer_whose_patterns_backtrack() {
    for (pattern, want) in [
        (
            r"\w*\w*\w*!",
            "backtracks, and a long prompt would take minutes",
        ),
        (r"(\w+\s?)*$", "backtracks without end"),
    ] {
        let (r, out_parent) = convert_edited(|d| {
            edit_json(&d.join("tokenizer.json"), |v| {
                v["pre_tokenizer"] = serde_json::json!({"type": "Split",
                    "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
            })
        });
        let e = r.expect_err("refused");
        let text = e.to_string();
        assert_eq!(e.kind(), gds_convert::ErrorKind::Input, "{text}");
        assert!(
            text.contains("tokenizer.json") && text.contains("refused") && text.contains(want),
            "{pattern}: {text}"
        );
        assert_eq!(fs::read_dir(out_parent.path()).unwrap().count(), 0);
    }
}

/// Regression (issue 33): a config.json hyperparameter of the wrong type or sign was
/// reported as "internal error … the written model is invalid" naming a temporary manifest.
/// It is an input error naming config.json and the key.
#[test]
fn config_values_of_the_wrong_type_name_config_json_and_the_key() {
    for (key, value) in [
        ("num_hidden_layers", serde_json::json!(-3)),
        ("hidden_size", serde_json::json!("abc")),
        ("num_attention_heads", serde_json::json!(2.5)),
        ("rms_norm_eps", serde_json::json!("small")),
        ("sliding_window", serde_json::json!(-3)),
        ("max_position_embeddings", serde_json::json!(0)),
    ] {
        let (r, out_parent) =
            convert_edited(|d| edit_json(&d.join("config.json"), |v| v[key] = value.clone()));
        let e = r.expect_err("refused");
        let text = e.to_string();
        assert_eq!(e.kind(), gds_convert::ErrorKind::Input, "{key}: {text}");
        assert!(
            text.contains("config.json") && text.contains(key) && !text.contains("internal"),
            "{key}: {text}"
        );
        assert_eq!(fs::read_dir(out_parent.path()).unwrap().count(), 0);
    }
}

/// Regression (GPU run of 2026-11-27): an F16 checkpoint converted with the default policy
/// (`keep`) kept its norms F16, and the CUDA backend refused the model ("expected F32"). 1-D
/// tensors are written F32 under every policy, their values exactly the F16 ones widened.
#[test]
fn keep_writes_f16_norms_as_f32() {
    let mut tensors = fixture_tensors();
    let mut made = 0;
    for t in tensors.values_mut().filter(|t| t.shape.len() == 1) {
        // 1 + k/1024 for k = 0, 1, ...: exact in f16 (bits 0x3C00 + k) and in f32
        t.dtype = Dtype::F16;
        t.bytes = (0..t.shape[0])
            .flat_map(|k| (0x3C00u16 + (k % 1024) as u16).to_le_bytes())
            .collect();
        made += 1;
    }
    assert!(made >= 3, "the fixture has norms");
    let dir = temp_hf(&config(), &tensors);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        fs::copy(hf_dir().join(f), dir.path().join(f)).unwrap();
    }
    let out_parent = tempfile::tempdir().unwrap();
    let out = out_parent.path().join("out");
    gds_convert::convert(
        dir.path(),
        &out,
        &gds_convert::ConvertOptions::default(),
        &gds_convert::NoProgress,
    )
    .unwrap();
    let bytes = fs::read(out.join("manifest.gdsm")).unwrap();
    let m = gds_format::Manifest::parse(&bytes).unwrap();
    let mut norms = 0;
    for t in m.tensors().filter(|t| t.n_dims == 1) {
        assert_eq!(t.dtype, DType::F32, "{}", t.name);
        let layer = m.layer_table().get(t.layer).unwrap();
        let file = m.string(&layer.file).unwrap();
        let data = fs::read(out.join(file)).unwrap();
        let at = t.offset as usize;
        for k in 0..t.shape[0] as usize {
            let v = f32::from_le_bytes(data[at + 4 * k..at + 4 * k + 4].try_into().unwrap());
            assert_eq!(v, 1.0 + (k % 1024) as f32 / 1024.0, "{} [{k}]", t.name);
        }
        norms += 1;
    }
    assert_eq!(norms, made);
}

/// The tensors of a single-file fixture directory.
fn dir_tensors(dir: &Path) -> BTreeMap<String, Stored> {
    let buf = fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&buf).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let t = Stored {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            };
            (name, t)
        })
        .collect()
}

/// Qwen 3 MoE's per-expert tensors (`mlp.experts.E.gate_proj.weight`, as transformers saves
/// them) become one stacked `[experts, rows, cols]` tensor per block and role, experts in
/// number order (not the file's name order: 10 sorts before 2); a missing or odd expert,
/// and blocks without experts, are refused naming what is wrong.
#[test]
fn experts_are_stacked_in_number_order() {
    let moe = fixtures().join("tiny-qwen3moe-hf");
    let s = read_safetensors(&moe).unwrap();
    let tensors = dir_tensors(&moe);
    let cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(moe.join("config.json")).unwrap()).unwrap();
    let n = cfg["num_local_experts"].as_u64().unwrap();
    assert_eq!(u64_meta(&s, "model.n_expert"), n);
    assert_eq!(u64_meta(&s, "model.n_expert_used"), 2);
    assert_eq!(u64_meta(&s, "model.n_ff_exp"), 32);
    assert_eq!(
        s.metadata.get("model.expert_weights_norm"),
        Some(&MetaValue::Bool(true))
    );
    for (role, proj) in [
        ("gate", "gate_proj"),
        ("up", "up_proj"),
        ("down", "down_proj"),
    ] {
        for b in 0..2 {
            let t = tensor(&s, &format!("blk.{b}.ffn_{role}_exps.weight"));
            let part = &tensors[&format!("model.layers.{b}.mlp.experts.0.{proj}.weight")];
            let (rows, cols) = (part.shape[0] as u64, part.shape[1] as u64);
            assert_eq!(t.shape, vec![n, rows, cols]);
            let want: Vec<u8> = (0..n)
                .flat_map(|e| {
                    tensors[&format!("model.layers.{b}.mlp.experts.{e}.{proj}.weight")]
                        .bytes
                        .clone()
                })
                .collect();
            assert_eq!(&t.bytes()[..], &want[..], "{}", t.name);
        }
    }
    assert_eq!(tensor(&s, "blk.1.ffn_gate_inp.weight").shape, vec![n, 32]);

    // twelve experts: 10 and 11 sort before 2 by name, not by number
    let mut many = tensors.clone();
    let mut config = serde_json::from_value::<serde_json::Map<_, _>>(cfg.clone()).unwrap();
    for b in 0..2 {
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            for e in n..12 {
                let mut t = many[&format!("model.layers.{b}.mlp.experts.0.{proj}.weight")].clone();
                t.bytes
                    .iter_mut()
                    .for_each(|x| *x = x.wrapping_add(e as u8));
                many.insert(format!("model.layers.{b}.mlp.experts.{e}.{proj}.weight"), t);
            }
        }
        let r = many
            .get_mut(&format!("model.layers.{b}.mlp.gate.weight"))
            .unwrap();
        r.shape[0] = 12;
        r.bytes = r.bytes.repeat(3);
    }
    config.insert("num_local_experts".into(), 12.into());
    let dir = temp_hf(&config, &many);
    let s = read_safetensors(dir.path()).unwrap();
    let t = tensor(&s, "blk.0.ffn_up_exps.weight");
    assert_eq!(t.shape, vec![12, 32, 32]);
    let part = 32 * 32 * 4;
    let e10 = &many["model.layers.0.mlp.experts.10.up_proj.weight"].bytes;
    assert_eq!(&t.bytes()[10 * part..11 * part], &e10[..]);

    // expert 3 of block 1's down projection missing
    let mut missing = tensors.clone();
    missing.remove("model.layers.1.mlp.experts.3.down_proj.weight");
    let dir = temp_hf(&serde_json::from_value(cfg.clone()).unwrap(), &missing);
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(
        text.contains("blk.1.ffn_down_exps.weight") && text.contains("[0, 1, 2]"),
        "{text}"
    );

    // one expert of another shape
    let mut odd = tensors.clone();
    let t = odd
        .get_mut("model.layers.0.mlp.experts.2.up_proj.weight")
        .unwrap();
    t.shape = vec![16, 64];
    let dir = temp_hf(&serde_json::from_value(cfg.clone()).unwrap(), &odd);
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(
        text.contains("model.layers.0.mlp.experts.2.up_proj.weight") && text.contains("[16, 64]"),
        "{text}"
    );

    // dense blocks among the expert ones
    let mut sparse = serde_json::from_value::<serde_json::Map<_, _>>(cfg).unwrap();
    sparse.insert("mlp_only_layers".into(), serde_json::json!([1]));
    let dir = temp_hf(&sparse, &tensors);
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(text.contains("mlp_only_layers"), "{text}");
}

/// SmolLM3's NoPE blocks: `no_rope_layer_interval` becomes `model.no_rope_layer_step`; a
/// `no_rope_layers` list off that pattern, or of another length than the layers, and a
/// sliding window (transformers puts it on the NoPE blocks only) are refused, naming the key.
#[test]
fn smollm3_nope_blocks_are_read_or_refused_by_key() {
    let dir = fixtures().join("tiny-smollm3-hf");
    let s = read_safetensors(&dir).unwrap();
    assert_eq!(u64_meta(&s, "model.no_rope_layer_step"), 4);
    let tensors = dir_tensors(&dir);
    let cfg: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["no_rope_layers"], serde_json::json!([1, 1, 1, 0]));
    for (key, value, needle) in [
        (
            "no_rope_layers",
            serde_json::json!([1, 0, 1, 0]),
            "no_rope_layers[1] is 0",
        ),
        (
            "no_rope_layers",
            serde_json::json!([1, 1, 1]),
            "lists 3 layers",
        ),
        (
            "use_sliding_window",
            serde_json::json!(true),
            "use_sliding_window",
        ),
        (
            "no_rope_layer_interval",
            serde_json::json!(0),
            "no_rope_layer_interval 0",
        ),
    ] {
        let mut c = cfg.clone();
        c.insert(key.into(), value);
        let d = temp_hf(&c, &tensors);
        let e = read_safetensors(d.path()).expect_err("refused").to_string();
        assert!(
            e.contains(needle) && e.contains("config.json"),
            "{key}: {e}"
        );
    }
}

/// gpt-oss from its Hugging Face directory, whose experts are fused per block: as llama.cpp's
/// `convert_hf_to_gguf.py` writes them. The float fixture (`gate_up_proj [E, d, 2ff]`, gate
/// and up in alternate columns, and `down_proj [E, ff, d]`, both `x @ W`) reads as every
/// tensor of tiny-gptoss.gguf (that converter's output for the same directory), byte for
/// byte; the MXFP4 one (tiny-gptoss-mxfp4-hf: `*_blocks` and `*_scales` as the published
/// checkpoints store them, made by fixtures/make_gptoss_mxfp4_hf.py, which checks them with
/// transformers' reader and llama.cpp's converter) as tiny-gptoss-mxfp4.gguf's MXFP4 experts.
#[test]
fn gpt_oss_experts_are_split_and_transposed_as_llama_cpp_writes_them() {
    for (hf, gguf, all) in [
        ("tiny-gptoss-hf", "tiny-gptoss.gguf", true),
        ("tiny-gptoss-mxfp4-hf", "tiny-gptoss-mxfp4.gguf", false),
    ] {
        let ours = read_safetensors(&fixtures().join(hf)).unwrap();
        let theirs = gds_convert::gguf::read_gguf(&fixtures().join(gguf)).unwrap();
        assert_eq!(ours.tensors.len(), theirs.tensors.len(), "{hf}");
        let mut compared = 0;
        for t in &theirs.tensors {
            if !all && !t.name.contains("_exps.weight") {
                continue;
            }
            let o = tensor(&ours, &t.name);
            assert_eq!((o.dtype, &o.shape), (t.dtype, &t.shape), "{hf}: {}", t.name);
            assert!(
                o.bytes() == t.bytes(),
                "{hf}: {} differs from {gguf}'s",
                t.name
            );
            compared += 1;
        }
        // 4 blocks: gate, up and down experts each (and, for the float one, all 79)
        assert_eq!(compared, if all { 79 } else { 12 }, "{hf}");
        if !all {
            assert_eq!(
                tensor(&ours, "blk.3.ffn_up_exps.weight").dtype,
                DType::MXFP4
            );
        }
    }
}

/// A gpt-oss directory whose experts do not fit: MXFP4 blocks without their scales, a fused
/// weight of the wrong shape: errors naming the file, the tensor and what config.json needs.
#[test]
fn gpt_oss_experts_that_do_not_fit_are_named() {
    let src = fixtures().join("tiny-gptoss-mxfp4-hf");
    let stored = dir_tensors(&src);
    let cfg: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let mut no_scales = stored.clone();
    no_scales.remove("model.layers.2.mlp.experts.gate_up_proj_scales");
    let dir = temp_hf(&cfg, &no_scales);
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(
        text.contains("model.layers.2.mlp.experts.gate_up_proj_blocks")
            && text.contains("_blocks and _scales"),
        "{text}"
    );
    let mut no_gate_up = stored.clone();
    no_gate_up.remove("model.layers.0.mlp.experts.gate_up_proj_blocks");
    no_gate_up.remove("model.layers.0.mlp.experts.gate_up_proj_scales");
    let dir = temp_hf(&cfg, &no_gate_up);
    let (e, text) = err_text(read_safetensors(dir.path()));
    assert!(
        matches!(e, SafetensorsError::MissingTensor { .. }) && text.contains("blk.0.ffn_gate_exps"),
        "{text}"
    );
    let mut narrow = stored;
    let blocks = narrow
        .get_mut("model.layers.1.mlp.experts.down_proj_blocks")
        .unwrap();
    blocks.shape[1] /= 2;
    blocks.bytes.truncate(blocks.bytes.len() / 2);
    let dir = temp_hf(&cfg, &narrow);
    let (_, text) = err_text(read_safetensors(dir.path()));
    assert!(
        text.contains("model.layers.1.mlp.experts.down_proj_blocks")
            && text.contains("[4, 16, 1, 16]")
            && text.contains("needs [4, 32, 1, 16] U8"),
        "{text}"
    );
}

/// YaRN from config.json (transformers' `_compute_yarn_parameters`): factor, original
/// context, betas and `truncate` (false in gpt-oss's own configs) become the manifest's
/// `model.rope_scaling.*`; an attention factor other than `1 + 0.1 ln factor` is refused.
#[test]
fn yarn_rope_scaling_is_read_with_truncate() {
    let src = fixtures().join("tiny-gptoss-hf");
    let stored = dir_tensors(&src);
    let mut cfg: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    // transformers 4's form, as gpt-oss-20b's config.json has it
    let params = cfg.remove("rope_parameters").unwrap();
    cfg.insert("rope_theta".into(), params["rope_theta"].clone());
    let mut scaling = params.clone();
    scaling.as_object_mut().unwrap().remove("rope_theta");
    scaling["truncate"] = false.into();
    cfg.insert("rope_scaling".into(), scaling.clone());
    let s = read_safetensors(temp_hf(&cfg, &stored).path()).unwrap();
    let f = |k: &str| s.metadata.get(k).cloned();
    assert_eq!(
        f("model.rope_scaling.type"),
        Some(MetaValue::Str("yarn".into()))
    );
    assert_eq!(f("model.rope_scaling.factor"), Some(MetaValue::F64(4.0)));
    assert_eq!(
        f("model.rope_scaling.original_context_length"),
        Some(MetaValue::U64(64))
    );
    assert_eq!(
        f("model.rope_scaling.yarn_beta_fast"),
        Some(MetaValue::F64(32.0))
    );
    assert_eq!(
        f("model.rope_scaling.yarn_truncate"),
        Some(MetaValue::Bool(false))
    );
    scaling["attention_factor"] = 1.0.into();
    cfg.insert("rope_scaling".into(), scaling);
    let (_, text) = err_text(read_safetensors(temp_hf(&cfg, &stored).path()));
    assert!(
        text.contains("config.json") && text.contains("attention factor 1"),
        "{text}"
    );
}

/// transformers' `save_pretrained` (4.5x on) keeps chat templates beside the config:
/// `chat_template.jinja`, named ones in `additional_chat_templates/NAME.jinja`, and takes
/// them out of `tokenizer_config.json`. They come back into the output's config, taking
/// priority over the config's own of the same name as transformers loads them; a hostile one
/// fails the conversion naming its file.
#[test]
fn chat_template_files_beside_the_config_are_kept() {
    let original: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(hf_dir().join("tokenizer_config.json")).unwrap())
            .unwrap();
    let template = original["chat_template"].as_str().unwrap().to_string();
    let dir = copy_fixture();
    let tc = dir.path().join("tokenizer_config.json");
    let mut cfg = original.clone();
    cfg.as_object_mut().unwrap().remove("chat_template");
    fs::write(&tc, serde_json::to_string(&cfg).unwrap()).unwrap();
    fs::write(dir.path().join("chat_template.jinja"), &template).unwrap();
    let out_cfg = |s: &Source| -> serde_json::Value {
        serde_json::from_str(s.tokenizer.tokenizer_config_json.as_deref().unwrap()).unwrap()
    };
    let s = read_safetensors(dir.path()).unwrap();
    let got = out_cfg(&s);
    assert_eq!(got["chat_template"], serde_json::json!(template));
    // the rest of the config as it was
    for (k, v) in cfg.as_object().unwrap() {
        assert_eq!(&got[k], v, "{k}");
    }

    // a named template beside it, and the config's own default overridden by the file
    cfg["chat_template"] = serde_json::json!("{{ 'old' }}");
    fs::write(&tc, serde_json::to_string(&cfg).unwrap()).unwrap();
    fs::create_dir(dir.path().join("additional_chat_templates")).unwrap();
    fs::write(
        dir.path().join("additional_chat_templates/tool_use.jinja"),
        "{{ 'tools' }}",
    )
    .unwrap();
    let got = out_cfg(&read_safetensors(dir.path()).unwrap());
    assert_eq!(
        got["chat_template"],
        serde_json::json!([
            {"name": "default", "template": template},
            {"name": "tool_use", "template": "{{ 'tools' }}"},
        ])
    );

    // through the whole conversion: the template the output's config holds, and a hostile
    // file refused by its own name
    let out = tempfile::tempdir().unwrap();
    let model = out.path().join("m");
    struct Quiet;
    impl gds_convert::Progress for Quiet {}
    gds_convert::convert(dir.path(), &model, &Default::default(), &Quiet).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(model.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(written["chat_template"], got["chat_template"]);
    fs::write(
        dir.path().join("additional_chat_templates/tool_use.jinja"),
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let e = gds_convert::convert(
        dir.path(),
        &out.path().join("m2"),
        &Default::default(),
        &Quiet,
    )
    .err()
    .map(|e| e.to_string())
    .expect("a hostile template is refused");
    assert!(
        e.contains("additional_chat_templates/tool_use.jinja") && e.contains("\"tool_use\""),
        "{e}"
    );
    assert!(!out.path().join("m2").exists());
}

/// `gdsconv convert --chat-template-file FILE` (and Docker Model Runner's template layer):
/// the file replaces the input's default template — the `chat_template` string, or the
/// `default` entry of a list of named ones, the others kept; a template from a GGUF (no
/// config of its own) likewise; a hostile file refused by its own name, nothing written.
#[test]
fn a_chat_template_file_replaces_the_inputs_default() {
    let dir = copy_fixture();
    fs::create_dir(dir.path().join("additional_chat_templates")).unwrap();
    fs::write(
        dir.path().join("additional_chat_templates/tool_use.jinja"),
        "{{ 'tools' }}",
    )
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let mine = out.path().join("mine.jinja");
    fs::write(&mine, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let opts = gds_convert::ConvertOptions {
        chat_template_file: Some(mine.clone()),
        ..Default::default()
    };
    let written = |model: &Path| -> serde_json::Value {
        serde_json::from_str(&fs::read_to_string(model.join("tokenizer_config.json")).unwrap())
            .unwrap()
    };
    let model = out.path().join("hf");
    gds_convert::convert(dir.path(), &model, &opts, &gds_convert::NoProgress).unwrap();
    let tc = written(&model);
    assert_eq!(
        tc["chat_template"],
        serde_json::json!([
            {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "{{ 'tools' }}"},
        ])
    );
    // the rest of the config kept
    assert!(
        tc.get("bos_token").is_some() || tc.get("eos_token").is_some(),
        "{tc}"
    );
    // a GGUF's
    let model = out.path().join("gguf");
    let gguf = hf_dir().join("../tiny-llama.gguf");
    gds_convert::convert(&gguf, &model, &opts, &gds_convert::NoProgress).unwrap();
    assert_eq!(
        written(&model)["chat_template"],
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    );
    // hostile, or absent: named, nothing left
    fs::write(
        &mine,
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let bad = out.path().join("bad");
    let e = gds_convert::convert(dir.path(), &bad, &opts, &gds_convert::NoProgress)
        .err()
        .map(|e| e.to_string())
        .expect("a hostile template is refused");
    assert!(e.contains("mine.jinja") && e.contains("refused"), "{e}");
    assert!(!bad.exists());
    let absent = gds_convert::ConvertOptions {
        chat_template_file: Some(out.path().join("absent.jinja")),
        ..Default::default()
    };
    let e = gds_convert::convert(dir.path(), &bad, &absent, &gds_convert::NoProgress)
        .err()
        .map(|e| e.to_string())
        .expect("an absent template is an error");
    assert!(e.contains("absent.jinja"), "{e}");
    assert!(!bad.exists());
}
