//! Speculative decoding (`--draft ngram`, `--draft layers:N`, `--draft-model DIR`): the
//! output is the one the
//! model gives without it — greedy and seeded sampling, in memory and streamed, with Gemma
//! 3's window ring — while a repetitive task takes fewer passes over the weights, and so
//! reads fewer bytes per generated token when the layers stream.

use serde_json::Value;
use std::path::Path;

/// A task whose answer quotes its prompt: what prompt lookup guesses well.
const REWRITE: &str = "Rewrite the following paragraph, keeping every sentence: The library \
    opens at nine in the morning and closes at six in the evening. Visitors may borrow up to \
    five books at a time. Books are due back after three weeks, and late returns cost ten \
    cents per day.";

fn run_json(model: &Path, extra: &[&str]) -> Value {
    run_json_env(model, extra, &[])
}

fn run_json_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Value {
    let mut args = vec![model.to_str().unwrap(), "--prompt", REWRITE, "--json"];
    args.extend_from_slice(extra);
    let o = std::process::Command::new(gds_tests::bin("gdsrun"))
        .args(&args)
        .envs(env.iter().copied())
        .output()
        .expect("spawn gdsrun");
    assert!(
        o.status.success(),
        "gdsrun {args:?} failed: {}",
        gds_tests::stderr(&o)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

fn tokens(v: &Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// (decode passes, decoded tokens, guesses, accepted guesses) of a run's metrics, checked to
/// add up: every decoded token had its own pass or was an accepted guess.
fn pass_counts(m: &Value, what: &str) -> (u64, u64, u64, u64) {
    let n = |k: &str| m[k].as_u64().unwrap();
    let (passes, decoded) = (n("decode_passes"), n("decode_tokens"));
    let (drafted, accepted) = (n("draft_tokens"), n("draft_accepted"));
    eprintln!("{what}: {decoded} tokens in {passes} passes, {accepted}/{drafted} guesses");
    assert_eq!(passes + accepted, decoded, "{what}");
    assert!(accepted <= drafted, "{what}");
    (passes, decoded, drafted, accepted)
}

/// Runs with and without `--draft ngram` on the same settings; returns both outputs after
/// checking they agree token for token.
/// In memory, whether guessing pays is measured on the wall clock (`draft::Gate`), which a
/// loaded machine (the rest of the test suite) can tip: where passes are counted the gate is
/// off (`GDS_DRAFT_GATE=off`: every pass guesses).
const GATE_OFF: &[(&str, &str)] = &[("GDS_DRAFT_GATE", "off")];

fn same_with_and_without(model: &Path, settings: &[&str], what: &str) -> (Value, Value) {
    same_with_and_without_env(model, settings, what, GATE_OFF)
}

fn same_with_and_without_env(
    model: &Path,
    settings: &[&str],
    what: &str,
    env: &[(&str, &str)],
) -> (Value, Value) {
    let plain = run_json(model, settings);
    let mut spec_args = settings.to_vec();
    spec_args.extend_from_slice(&["--draft", "ngram"]);
    let spec = run_json_env(model, &spec_args, env);
    assert_eq!(tokens(&plain), tokens(&spec), "{what}: tokens differ");
    assert_eq!(plain["text"], spec["text"], "{what}: text differs");
    let (pm, sm) = (&plain["metrics"], &spec["metrics"]);
    assert_eq!(pm["draft_tokens"], 0, "{what}");
    assert_eq!(pm["decode_passes"], pm["decode_tokens"], "{what}");
    assert_eq!(sm["decode_tokens"], pm["decode_tokens"], "{what}");
    (plain, spec)
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn greedy_and_sampled_output_is_unchanged_and_takes_fewer_passes() {
    let model = gds_tests::smollm_converted();
    // the gate measuring: the same text, whatever it decides
    same_with_and_without_env(model, &["--temp", "0", "-n", "64"], "greedy, gated", &[]);
    let (_, spec) = same_with_and_without(model, &["--temp", "0", "-n", "64"], "greedy");
    let m = &spec["metrics"];
    let (passes, decoded, drafted, accepted) = pass_counts(m, "greedy");
    assert!(
        passes * 3 <= decoded * 2,
        "a rewrite should need at most two thirds of the passes: {passes} for {decoded}"
    );
    let tpp = m["tokens_per_pass"].as_f64().unwrap();
    assert!((tpp - decoded as f64 / passes as f64).abs() < 1e-9);
    let acc = m["draft_acceptance"].as_f64().unwrap();
    assert!((acc - accepted as f64 / drafted as f64).abs() < 1e-9);

    // seeded sampling: every token is still drawn from the model's own distribution at its
    // position, with the same random draws; over two seeds some guesses are accepted (a
    // sampled reply may paraphrase instead of copying: seed 7 did once the kernels' last
    // bits changed)
    let mut accepted = 0;
    for seed in ["1", "7"] {
        let (_, spec) = same_with_and_without(
            model,
            &["--temp", "0.8", "--top-k", "40", "--seed", seed, "-n", "48"],
            "sampled",
        );
        accepted += spec["metrics"]["draft_accepted"].as_u64().unwrap();
    }
    assert!(accepted > 0, "no sampled guess accepted over two seeds");

    // the plan records the draft
    let o = gds_tests::run(
        "gdsrun",
        &[
            model.to_str().unwrap(),
            "--draft",
            "ngram",
            "--draft-max",
            "6",
            "--plan",
        ],
    );
    assert!(o.status.success(), "{}", gds_tests::stderr(&o));
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(plan["draft"]["kind"], "ngram");
    assert_eq!(plan["draft"]["max_tokens"], 6);
    assert_eq!(plan["draft"]["gate"], true, "the gate measures by default");
}

/// `--draft-gate` and `--isa` are plan options, recorded in the plan; `GDS_DRAFT_GATE` and
/// `GDS_ISA` remain their aliases, read when the plan is made (a value that is neither is
/// a usage error naming the variable), and the flags win over them.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn the_draft_gate_and_the_isa_are_plan_options_with_environment_aliases() {
    let model = gds_tests::smollm_converted();
    let plan = |args: &[&str], env: &[(&str, &str)]| {
        let mut all = vec![model.to_str().unwrap(), "--draft", "ngram", "--plan"];
        all.extend_from_slice(args);
        let o = std::process::Command::new(gds_tests::bin("gdsrun"))
            .args(&all)
            .env_remove("GDS_DRAFT_GATE")
            .env_remove("GDS_ISA")
            .envs(env.iter().copied())
            .output()
            .expect("spawn gdsrun");
        (o.status.code(), gds_tests::stderr(&o), o.stdout)
    };
    let json = |r: (Option<i32>, String, Vec<u8>)| -> Value {
        assert_eq!(r.0, Some(0), "{}", r.1);
        serde_json::from_slice(&r.2).unwrap()
    };
    let p = json(plan(&["--draft-gate", "off", "--isa", "scalar"], &[]));
    assert_eq!(
        (&p["draft"]["gate"], &p["isa"]),
        (&false.into(), &"scalar".into())
    );
    let best = json(plan(&[], &[]))["isa"].clone();
    assert!(best.is_string(), "{best}");
    // the aliases
    let p = json(plan(
        &[],
        &[("GDS_DRAFT_GATE", "off"), ("GDS_ISA", "scalar")],
    ));
    assert_eq!(
        (&p["draft"]["gate"], &p["isa"]),
        (&false.into(), &"scalar".into())
    );
    // the flags override them
    let p = json(plan(
        &["--draft-gate", "on", "--isa", "avx512vnni"],
        &[("GDS_DRAFT_GATE", "off"), ("GDS_ISA", "scalar")],
    ));
    assert_eq!(p["draft"]["gate"], true);
    // (a cap at the widest set is no cap)
    assert_eq!(p["isa"], best);
    for (var, value) in [("GDS_DRAFT_GATE", "0"), ("GDS_ISA", "sse2")] {
        let (code, err, _) = plan(&[], &[(var, value)]);
        assert_eq!(code, Some(2), "{var}={value}: {err}");
        assert!(err.contains(&format!("{var}=\"{value}\"")), "{err}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn streamed_speculation_reads_fewer_bytes_per_token_for_the_same_text() {
    let model = gds_tests::smollm_converted();
    let (plain, spec) = same_with_and_without(
        model,
        &[
            "--temp",
            "0",
            "-n",
            "48",
            "--io",
            "direct",
            "--mem-budget",
            "25MB",
        ],
        "streamed",
    );
    let metric = |v: &Value, k: &str| v["metrics"][k].as_f64().unwrap();
    let (p, s) = (
        metric(&plain, "bytes_read_per_token"),
        metric(&spec, "bytes_read_per_token"),
    );
    let passes = metric(&spec, "decode_passes") / metric(&plain, "decode_passes");
    eprintln!(
        "streamed: {:.1} MB/token without a draft, {:.1} MB/token with ({:.2} of the passes)",
        p / 1e6,
        s / 1e6,
        passes
    );
    assert!(p > 0.0, "nothing streamed");
    // a copy task: most guesses accepted, so far fewer passes ...
    assert!(
        metric(&spec, "tokens_per_pass") >= 1.5,
        "{} tokens a pass",
        metric(&spec, "tokens_per_pass")
    );
    // ... and the streamed layers read once a pass, whatever its tokens: the bytes per token
    // fall with the passes
    assert!(
        s <= p * passes * 1.05,
        "{s} bytes/token with the draft, {p} without, {passes:.2} of the passes"
    );
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn window_layers_keep_their_keys_through_rejected_guesses() {
    // Gemma 3: 15 of 18 layers keep a ring of their 512-position window plus one pass; a
    // 700-token prompt makes the ring wrap before generation starts, so rejected guesses
    // overwrite slots that older positions used.
    let model = gds_tests::gemma_converted();
    let long = REWRITE.repeat(12);
    let args = [
        "--temp", "0", "-n", "40", "--raw", "--ctx", "1024", "--batch", "64",
    ];
    let run = |draft: &[&str]| {
        let mut a = vec![model.to_str().unwrap(), "--prompt", &long, "--json"];
        a.extend_from_slice(&args);
        a.extend_from_slice(draft);
        let o = gds_tests::run("gdsrun", &a);
        assert!(o.status.success(), "{}", gds_tests::stderr(&o));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()
    };
    let (plain, spec) = (run(&[]), run(&["--draft", "ngram"]));
    assert!(plain["metrics"]["prompt_tokens"].as_u64().unwrap() > 600);
    assert_eq!(tokens(&plain), tokens(&spec));
    let m = &spec["metrics"];
    assert!(m["draft_tokens"].as_u64().unwrap() > m["draft_accepted"].as_u64().unwrap());
    assert!(m["draft_accepted"].as_u64().unwrap() > 0);
    // self-speculation writes the first blocks' keys (window layers among them) at the
    // guessed positions before the checking pass rewrites them
    let spec = run(&["--draft", "layers:12", "--draft-max", "4"]);
    assert_eq!(tokens(&plain), tokens(&spec), "layers:12");
    assert!(spec["metrics"]["draft_tokens"].as_u64().unwrap() > 0);
}

/// Self-speculation (`--draft layers:N`): the model's first N blocks and its output head
/// guess, the whole model checks. Same tokens as without, in memory and streamed at the
/// smallest budget that keeps the draft's layers resident (the plan keeps them; a smaller
/// budget is refused with that minimum). Layers 29 of 30 guess well enough that passes
/// accept some guesses and reject others.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn self_speculation_leaves_the_output_unchanged() {
    let model = gds_tests::smollm_converted();
    let m = model.to_str().unwrap();
    let greedy = ["--temp", "0", "-n", "48", "--raw"];
    let plain = run_json(model, &greedy);
    let mut with = greedy.to_vec();
    with.extend_from_slice(&["--draft", "layers:29", "--draft-max", "3"]);
    let spec = run_json(model, &with);
    assert_eq!(tokens(&plain), tokens(&spec), "in memory: tokens differ");
    let (_, _, drafted, accepted) = pass_counts(&spec["metrics"], "layers:29 in memory");
    assert!(drafted > accepted && accepted > 0, "{accepted}/{drafted}");
    assert_eq!(spec["plan"]["draft"]["kind"], "layers");
    assert_eq!(spec["plan"]["draft"]["layers"], 29);

    // streamed: the smallest budget for the draft, from the refusal of a smaller one
    let o = gds_tests::run(
        "gdsrun",
        &[
            m,
            "--plan",
            "--io",
            "direct",
            "--mem-budget",
            "5MB",
            "--draft",
            "layers:12",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", gds_tests::stderr(&o));
    let err = gds_tests::stderr(&o);
    let min_mib: f64 = err
        .split("smallest budget for this draft is ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no minimum in {err}"));
    let budget = format!("{}KiB", (min_mib * 1024.0).ceil() as u64 + 1);
    let streamed = ["--io", "direct", "--mem-budget", &budget];
    let mut plain_args = greedy.to_vec();
    plain_args.extend_from_slice(&streamed);
    let plain_s = run_json(model, &plain_args);
    let mut spec_args = plain_args.clone();
    spec_args.extend_from_slice(&["--draft", "layers:12"]);
    let spec_s = run_json(model, &spec_args);
    assert_eq!(tokens(&plain), tokens(&plain_s), "streamed: tokens differ");
    assert_eq!(
        tokens(&plain_s),
        tokens(&spec_s),
        "streamed draft: tokens differ"
    );
    let io = &spec_s["plan"]["io_plan"];
    let resident: Vec<u64> = io["resident_layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(io["streamed_bytes_per_token"].as_u64().unwrap() > 0);
    assert!(resident.contains(&io["head"]["layer"].as_u64().unwrap()));
    assert!(resident.len() > 12, "{resident:?}");
    assert!(spec_s["metrics"]["draft_tokens"].as_u64().unwrap() > 0);
    pass_counts(&spec_s["metrics"], "layers:12 streamed");
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn bad_draft_settings_are_usage_errors() {
    let model = gds_tests::smollm_converted();
    let m = model.to_str().unwrap();
    for (args, says) in [
        (
            vec![m, "--draft-max", "4", "--prompt", "x"],
            "--draft-max needs",
        ),
        (
            vec![m, "--draft", "ngram", "--draft-max", "0", "--prompt", "x"],
            "--draft-max 0",
        ),
        (
            vec![
                m,
                "--draft",
                "ngram",
                "--draft-max",
                "64",
                "--batch",
                "16",
                "--prompt",
                "x",
            ],
            "--draft-max 64",
        ),
        (
            vec![m, "--draft", "layers:0", "--prompt", "x"],
            "--draft layers:0: expected a number of blocks from 1 to 29",
        ),
        (
            vec![m, "--draft", "layers:30", "--prompt", "x"],
            "(the model has 30)",
        ),
        (vec![m, "--draft", "layers:x", "--prompt", "x"], "layers:N"),
        (
            vec![m, "--draft-gate", "off", "--prompt", "x"],
            "--draft-gate needs --draft",
        ),
        (vec![m, "--draft-gate", "maybe", "--prompt", "x"], "on, off"),
        (vec![m, "--isa", "sse2", "--prompt", "x"], "expected scalar"),
    ] {
        let o = gds_tests::run("gdsrun", &args);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?}: {}",
            gds_tests::stderr(&o)
        );
        assert!(
            gds_tests::stderr(&o).contains(says),
            "{}",
            gds_tests::stderr(&o)
        );
    }
}

/// A draft model: SmolLM2 Q4_1 (in memory) guesses for SmolLM2 at F16 (the same GGUF
/// dequantized into a Hugging Face directory, 2.7x the bytes per token), streamed at a
/// small budget. The text is the F16 model's own, most guesses are right, and the passes
/// (so the bytes read per token) shrink; a draft with another vocabulary is refused.
#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn a_draft_model_leaves_the_output_unchanged_and_must_share_the_vocabulary() {
    let draft = gds_tests::smollm_converted();
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("f16.gds");
    let o = gds_tests::run(
        "gdsconv",
        &[
            "convert",
            gds_tests::smollm_hf_f16().to_str().unwrap(),
            target.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", gds_tests::stderr(&o));
    let settings = [
        "--temp",
        "0",
        "-n",
        "24",
        "--io",
        "direct",
        "--mem-budget",
        "40MB",
    ];
    let plain = run_json(&target, &settings);
    // one --mem-budget covers both: the draft's weights (held whole) come first, so the
    // model streams within the same 40 MB as without the draft
    let draft_plan: Value = serde_json::from_slice(
        &gds_tests::run(
            "gdsrun",
            &[draft.to_str().unwrap(), "--plan", "--io", "mmap"],
        )
        .stdout,
    )
    .unwrap();
    let draft_held = draft_plan["io_plan"]["held_bytes"].as_u64().unwrap();
    let budget = (40_000_000 + draft_held).to_string();
    let mut with = settings.to_vec();
    *with.last_mut().unwrap() = &budget;
    with.extend_from_slice(&["--draft-model", draft.to_str().unwrap()]);
    let spec = run_json(&target, &with);
    assert_eq!(
        spec["plan"]["io_plan"]["budget_bytes"].as_u64(),
        Some(40_000_000),
        "the model's share"
    );
    assert!(
        spec["metrics"]["weights_held_bytes"].as_u64().unwrap()
            > plain["metrics"]["weights_held_bytes"].as_u64().unwrap() + draft_held / 2,
        "the draft's weights are counted"
    );
    // a budget that cannot hold the draft beside the model's working set: refused, naming
    // the smallest that can (the draft was mapped outside the budget: 312 MiB of RSS under
    // --mem-budget 5MB)
    let o = gds_tests::run(
        "gdsrun",
        &[
            target.to_str().unwrap(),
            "-p",
            "x",
            "--mem-budget",
            "5MB",
            "--draft-model",
            draft.to_str().unwrap(),
        ],
    );
    let err = gds_tests::stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("with --draft-model") && err.contains("the smallest budget for both is"),
        "{err}"
    );
    assert_eq!(
        tokens(&plain),
        tokens(&spec),
        "tokens differ with the draft model"
    );
    assert_eq!(plain["text"], spec["text"]);
    let m = &spec["metrics"];
    let (passes, decoded, drafted, accepted) = pass_counts(m, "draft model");
    assert!(accepted * 2 > drafted, "{accepted}/{drafted} guesses right");
    assert!(
        passes * 2 <= decoded,
        "{passes} passes for {decoded} tokens"
    );
    let per_token = |v: &Value| v["metrics"]["bytes_read_per_token"].as_f64().unwrap();
    assert!(per_token(&spec) * 2.0 < per_token(&plain));
    assert_eq!(spec["plan"]["draft"]["kind"], "model");

    let t = target.to_str().unwrap();
    for (args, says) in [
        (
            vec![
                t,
                "--draft-model",
                gds_tests::gemma_converted().to_str().unwrap(),
                "-p",
                "x",
            ],
            "vocabulary differs",
        ),
        (
            vec![t, "--draft", "model", "-p", "x"],
            "needs --draft-model",
        ),
        (
            vec![t, "--draft-model", "/nonexistent/draft", "-p", "x"],
            "/nonexistent/draft",
        ),
    ] {
        let o = gds_tests::run("gdsrun", &args);
        let err = gds_tests::stderr(&o);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
