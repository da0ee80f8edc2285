//! `gdsconv convert --imatrix`: a committed importance matrix (both of llama.cpp's formats)
//! weighs the conversion of the tiny llama fixture exactly as `llama-quantize --imatrix`
//! did (its output is the golden, scripts/gen_imatrix_goldens.py), and bad imatrix files
//! fail with exit 1 and a message naming the file and the entry.

use gds_format::{Manifest, MANIFEST_FILE};
use gds_tests::*;
use std::path::Path;

/// Converts the tiny llama to Q4_0 (requantizing its quantized tensors), with `extra` flags.
fn convert_q4_0(out: &Path, extra: &[&str]) -> std::process::Output {
    let src = fixture("tiny-llama.gguf");
    let mut args = vec![
        "convert",
        src.to_str().unwrap(),
        out.to_str().unwrap(),
        "--quant",
        "q4_0",
        "--requantize",
    ];
    args.extend_from_slice(extra);
    run("gdsconv", &args)
}

#[test]
fn imatrix_conversion_matches_llama_quantize() {
    let golden =
        gds_convert::gguf::read_gguf(&fixture("imatrix/tiny-llama-q4_0-imatrix.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let plain = tmp.path().join("plain");
    let o = convert_q4_0(&plain, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let plain = tensor_bytes(&plain);
    for file in ["tiny-llama.imatrix.gguf", "tiny-llama.imatrix.dat"] {
        let out = tmp.path().join(file);
        let imx = fixture(&format!("imatrix/{file}"));
        let o = convert_q4_0(&out, &["--imatrix", imx.to_str().unwrap()]);
        assert!(o.status.success(), "{file}: {}", stderr(&o));
        let ours = tensor_bytes(&out);
        assert_eq!(ours.len(), golden.tensors.len(), "{file}");
        let mut weighted = 0;
        for g in &golden.tensors {
            let (dtype, bytes) = &ours[&g.name];
            assert_eq!(*dtype, g.dtype, "{file}: {}", g.name);
            assert!(
                bytes[..] == g.bytes()[..],
                "{file}: {} differs from llama-quantize's",
                g.name
            );
            // the imatrix changed every matrix it has an entry for and that was quantized
            // (not the embedding, which has none, nor the two Q4_0 inputs passed through)
            if plain[&g.name].1 != *bytes {
                weighted += 1;
            }
        }
        assert_eq!(weighted, 13, "{file}");
        let mbytes = std::fs::read(out.join(MANIFEST_FILE)).unwrap();
        let m = Manifest::parse(&mbytes).unwrap();
        assert_eq!(m.get_str("convert.imatrix").unwrap(), file);
    }
}

/// A legacy `.dat` imatrix of these entries.
fn legacy(entries: &[(&str, i32, Vec<f32>)]) -> Vec<u8> {
    let mut b = (entries.len() as i32).to_le_bytes().to_vec();
    for (name, ncall, vals) in entries {
        b.extend((name.len() as i32).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend(ncall.to_le_bytes());
        b.extend((vals.len() as i32).to_le_bytes());
        for v in vals {
            b.extend(v.to_le_bytes());
        }
    }
    b
}

#[test]
fn bad_imatrix_files_fail_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let good = std::fs::read(fixture("imatrix/tiny-llama.imatrix.gguf")).unwrap();
    let q = "blk.0.attn_q.weight";
    let mut nan = vec![1.0f32; 64];
    nan[5] = f32::NAN;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("cut-header.gguf", good[..40].to_vec(), "truncated"),
        (
            "cut-data.gguf",
            good[..good.len() - 100].to_vec(),
            "past the end of the file",
        ),
        (
            "columns.dat",
            legacy(&[(q, 1, vec![1.0; 32])]),
            "entry \"blk.0.attn_q.weight\" has 32 values but the tensor has 64 columns",
        ),
        ("nan.dat", legacy(&[(q, 1, nan)]), "value 5 is NaN"),
        (
            "negative.dat",
            legacy(&[(q, 1, vec![-2.0; 64])]),
            "value 0 is -2",
        ),
        (
            "cut.dat",
            legacy(&[(q, 1, vec![1.0; 64])])[..100].to_vec(),
            "truncated",
        ),
        (
            "text.dat",
            b"not an imatrix at all".to_vec(),
            "not an importance matrix",
        ),
        ("empty.dat", vec![], "truncated"),
    ];
    for (name, bytes, needle) in cases {
        let imx = tmp.path().join(name);
        std::fs::write(&imx, &bytes).unwrap();
        let out = tmp.path().join(format!("{name}.out"));
        let o = convert_q4_0(&out, &["--imatrix", imx.to_str().unwrap()]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(name) && err.contains(needle),
            "{name}: expected {needle:?} in {err:?}"
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(!out.exists(), "{name}: left an output directory");
    }
    // a missing file is an I/O error (exit 2)
    let out = tmp.path().join("missing.out");
    let o = convert_q4_0(&out, &["--imatrix", "/nonexistent.imatrix"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("/nonexistent.imatrix"));
    // an imatrix of another model: converted, with a warning naming the unknown entries
    let other = tmp.path().join("other.dat");
    std::fs::write(&other, legacy(&[("blk.9.ffn_up.weight", 1, vec![1.0; 64])])).unwrap();
    let o = convert_q4_0(
        &tmp.path().join("other.out"),
        &["--imatrix", other.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("1 of its 1 entries name no tensor of this model: blk.9.ffn_up.weight"),
        "{}",
        stderr(&o)
    );
}

/// `gdsrun imatrix -o` into a directory that does not exist fails before computing anything
/// (exit 2), naming the `-o` path (not its hidden temporary file) and the OS error once.
#[test]
fn an_unwritable_imatrix_output_fails_before_computing() {
    let tmp = tempfile::tempdir().unwrap();
    let text = root().join("fixtures/reference/wiki-like.txt");
    let out = tmp.path().join("nonexistent-dir/im.gguf");
    let o = run(
        "gdsrun",
        &[
            "imatrix",
            tiny_converted().to_str().unwrap(),
            "-f",
            text.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--ctx",
            "32",
        ],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("{}: ", out.display())), "{err}");
    assert!(
        !err.contains(".im.gguf.tmp"),
        "names the temporary file: {err}"
    );
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    // nothing was computed: the progress header comes after the check
    assert!(!err.contains("tokens,"), "computed first: {err}");
    // `-o` naming a directory is refused the same way
    let o = run(
        "gdsrun",
        &[
            "imatrix",
            tiny_converted().to_str().unwrap(),
            "-f",
            text.to_str().unwrap(),
            "-o",
            tmp.path().to_str().unwrap(),
            "--ctx",
            "32",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("is a directory"), "{}", stderr(&o));
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}
