//! Weights interleaved sixteen rows at a time in memory (`--io load`): the file order's
//! results bit for bit, on each instruction set of this CPU that has kernels over the
//! layout. One process per instruction set, as the choice is process-wide.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// `gdsrun ARGS` with `GDS_INTERLEAVE` set to `interleave`; stdout on success.
fn gdsrun_with(interleave: &str, args: &[&str]) -> Vec<u8> {
    let o = Command::new(env!("CARGO_BIN_EXE_gdsrun"))
        .args(args)
        .env_remove("GDS_ISA")
        .env("GDS_INTERLEAVE", interleave)
        .output()
        .expect("spawn gdsrun");
    assert!(
        o.status.success(),
        "GDS_INTERLEAVE={interleave} gdsrun {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o.stdout
}

#[test]
fn interleaved_weights_give_the_file_orders_logits_on_each_instruction_set() {
    let tmp = tempfile::tempdir().unwrap();
    let text = gds_tests::fixture("reference/wiki-like.txt");
    let mut ran = Vec::new();
    // the four-row kernels' type, and one each of the 32-element family with a min and with
    // fifth bits (the tiny model's rows are too short for the K-quants: the kernel tests
    // cover those)
    for (quant, isa) in ["q4_0", "q4_1", "q5_0"]
        .into_iter()
        .flat_map(|q| ["avx2", "avx512vnni"].map(|i| (q, i)))
    {
        let dir = tmp.path().join(format!("{quant}.gds"));
        if !dir.exists() {
            gds_convert::convert(
                &gds_tests::fixture("tiny-llama-hf"),
                &dir,
                &gds_convert::ConvertOptions {
                    quant: quant.parse().unwrap(),
                    ..Default::default()
                },
                &gds_convert::NoProgress,
            )
            .unwrap();
        }
        let model = dir.to_str().unwrap();
        let common = ["--isa", isa, "--io", "load", "--threads", "2"];
        let plan = |interleave: &str| -> Value {
            let mut args = vec![model, "--plan"];
            args.extend(common);
            serde_json::from_slice(&gdsrun_with(interleave, &args)).unwrap()
        };
        if plan("1")["isa"] != isa {
            continue; // this CPU lacks it (a cap falls to a narrower set)
        }
        assert_eq!(plan("1")["interleave"], true, "{quant} {isa}");
        assert_eq!(plan("0")["interleave"], false, "{quant} {isa}");
        let score = |interleave: &str, logits: &Path| -> (Value, Vec<u8>) {
            let mut args = vec![
                "perplexity",
                model,
                "--file",
                text.to_str().unwrap(),
                "--ctx",
                "64",
                "--chunks",
                "3",
                "--json",
                "--save-logits",
                logits.to_str().unwrap(),
            ];
            args.extend(common);
            let json = serde_json::from_slice(&gdsrun_with(interleave, &args)).unwrap();
            (json, std::fs::read(logits).unwrap())
        };
        let (a, la) = score("1", &tmp.path().join(format!("{quant}-{isa}-1.logits")));
        let (b, lb) = score("0", &tmp.path().join(format!("{quant}-{isa}-0.logits")));
        assert!(a["ppl"].as_f64().is_some_and(f64::is_finite), "{a}");
        assert_eq!(a["ppl"], b["ppl"], "{quant} {isa}");
        assert!(
            la == lb,
            "{quant} {isa}: the stored log-probabilities differ"
        );
        ran.push(isa);
    }
    // every x86-64 CPU this project runs its tests on has AVX2
    if cfg!(target_arch = "x86_64") {
        assert!(ran.contains(&"avx2"), "{ran:?}");
    }
}
