//! `gdsrun --io direct --mem-budget`: streaming runs give the tokens of the mapped model,
//! keep the weights out of the page cache, stay within budget + KV cache + 64 MiB of RSS,
//! and refuse budgets too small to stream with the minimum that would work.

use serde_json::Value;
use std::path::Path;
use std::process::Output;

fn model() -> &'static Path {
    gds_tests::smollm_converted()
}

fn gdsrun(args: &[&str]) -> Output {
    gds_tests::run("gdsrun", args)
}

fn ok_json(args: &[&str]) -> Value {
    let o = gdsrun(args);
    assert!(
        o.status.success(),
        "gdsrun {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

fn layer_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir.join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

fn cached(dir: &Path) -> (usize, usize) {
    layer_files(dir).iter().fold((0, 0), |(r, t), p| {
        let (a, b) = gds_io::pagecache::cached_pages(p).unwrap();
        (r + a, t + b)
    })
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn direct_streaming_and_load_match_mmap_and_direct_leaves_no_weights_in_the_page_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("m.gds");
    gds_tests::copy_dir(model(), &copy);
    for f in layer_files(&copy) {
        gds_io::pagecache::evict(&f).unwrap();
    }
    let (before, total) = cached(&copy);
    let weights: u64 = layer_files(&copy)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    let quarter = (weights / 4).to_string();
    let common = [
        "--prompt",
        "Name three colors.",
        "--temp",
        "0",
        "-n",
        "12",
        "--ctx",
        "256",
        "--json",
    ];
    let mut args = vec![model().to_str().unwrap(), "--io", "mmap"];
    args.extend(common);
    let mapped = ok_json(&args);
    let mut args = vec![
        copy.to_str().unwrap(),
        "--io",
        "direct",
        "--mem-budget",
        &quarter,
    ];
    args.extend(common);
    let streamed = ok_json(&args);

    assert_eq!(streamed["tokens"], mapped["tokens"]);
    assert_eq!(streamed["text"], mapped["text"]);
    let m = &streamed["metrics"];
    let io = &streamed["plan"]["io_plan"];
    // the plan streams: some blocks and the 30 MB tied embedding/head are not resident
    assert_eq!(streamed["plan"]["io"], "direct", "{io}");
    assert!(io["held_bytes"].as_u64().unwrap() <= weights / 4, "{io}");
    assert!(
        !io["streamed_layers"].as_array().unwrap().is_empty(),
        "{io}"
    );
    let per_token = m["bytes_read_per_token"].as_f64().unwrap();
    assert!(per_token > 30e6, "{m}");
    assert!(
        m["read_bandwidth_bytes_per_sec"].as_f64().unwrap() > 0.0,
        "{m}"
    );
    assert!(m["io_overlap"].is_number(), "{m}");
    // RSS within budget + KV cache + 64 MiB
    let rss = m["peak_rss_bytes"].as_u64().unwrap();
    let bound =
        io["held_bytes"].as_u64().unwrap() + m["kv_cache_bytes"].as_u64().unwrap() + (64 << 20);
    assert!(rss <= bound, "peak RSS {rss} > {bound}");
    eprintln!(
        "streamed: peak RSS {:.1} MiB, bound {:.1} MiB, {:.1} MB/token",
        rss as f64 / 1048576.0,
        bound as f64 / 1048576.0,
        per_token / 1e6
    );

    // --io load (auto's choice where the kernel has transparent huge pages): the whole model
    // read into private memory, the same tokens, within weights + KV cache + 64 MiB
    let mut args = vec![model().to_str().unwrap(), "--io", "load"];
    args.extend(common);
    let loaded = ok_json(&args);
    assert_eq!(loaded["tokens"], mapped["tokens"]);
    assert_eq!(loaded["text"], mapped["text"]);
    assert_eq!(loaded["plan"]["io"], "load");
    let lio = &loaded["plan"]["io_plan"];
    assert!(
        lio["streamed_layers"].as_array().unwrap().is_empty(),
        "{lio}"
    );
    let lm = &loaded["metrics"];
    let rss = lm["peak_rss_bytes"].as_u64().unwrap();
    let bound = weights + lm["kv_cache_bytes"].as_u64().unwrap() + (64 << 20);
    assert!(rss <= bound, "--io load: peak RSS {rss} > {bound}");

    // O_DIRECT reads leave nothing in the page cache (checked where eviction works, i.e.
    // the test directory is on a disk filesystem, not tmpfs)
    let (after, _) = cached(&copy);
    if before == 0 {
        assert_eq!(
            after, 0,
            "{after} of {total} layer-file pages cached after a direct run"
        );
    } else {
        eprintln!("note: page cache could not be dropped here ({before} of {total} pages stay); the no-page-cache check is skipped");
        assert_ne!(streamed["plan"]["io"], "direct");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn budgets_that_cannot_work_are_refused_with_the_minimum() {
    let m = model().to_str().unwrap();
    let o = gdsrun(&[m, "--prompt", "hi", "--io", "direct", "--mem-budget", "1MB"]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("minimum working set") && e.contains("4.3 MiB"),
        "{e}"
    );
    let o = gdsrun(&[m, "--prompt", "hi", "--io", "mmap", "--mem-budget", "10MB"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--io direct"));
    let o = gdsrun(&[m, "--prompt", "hi", "--mem-budget", "12 parsecs"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown unit"));
    let o = gdsrun(&[m, "--prompt", "hi", "--io", "gds"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs --backend cuda"));
    // --plan shows the decision without running
    let p = ok_json(&[m, "--plan", "--mem-budget", "30MB"]);
    assert_eq!(p["io"], "direct");
    assert!(p["io_plan"]["reason"]
        .as_str()
        .unwrap()
        .contains("larger than --mem-budget"));
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn doctor_reports_the_disk_and_the_plan() {
    let m = model().to_str().unwrap();
    let d = ok_json(&["doctor", m, "--mem-budget", "24MB", "--json"]);
    assert!(d["cpu"]["physical_cores"].as_u64().unwrap() >= 1, "{d}");
    assert!(d["memory"]["total_bytes"].as_u64().unwrap() > 0, "{d}");
    assert!(
        d["gpu"]["path"].is_string() || d["gpu"]["path"].is_object(),
        "{d}"
    );
    let model = &d["model"];
    assert!(model["filesystem"].is_string(), "{model}");
    let buffered = &model["read_bandwidth_buffered_cold"];
    assert!(buffered["bytes"].as_u64().unwrap() > 90 << 20, "{model}");
    if model["o_direct"] == true {
        assert!(
            model["read_bandwidth_direct"]["bytes_per_sec"]
                .as_f64()
                .unwrap()
                > 0.0
        );
    }
    assert_eq!(
        model["plan"]["io"],
        if model["o_direct"] == true {
            "direct"
        } else {
            "buffered"
        }
    );
    assert!(
        model["plan"]["streamed_layers"].as_u64().unwrap() > 0,
        "{model}"
    );
    // and in words
    let o = gdsrun(&["doctor", m]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in ["CPU", "Memory", "GPU", "O_DIRECT", "Plan", "io mmap"] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
}

#[test]
#[ignore = "tier 2: needs the fetched models (scripts/test.sh)"]
fn vram_budgets_are_previewed_by_doctor_and_refused_on_the_cpu_backend() {
    let m = model().to_str().unwrap();
    // Without a usable GPU, doctor previews what --backend cuda would do on a device of
    // that size: between "runs at all" and "everything resident", blocks are streamed.
    let d = ok_json(&["doctor", m, "--vram-budget", "100GiB", "--json"]);
    let g = &d["model"]["plan"]["gpu"];
    let (min, all) = (
        g["min_budget_bytes"].as_u64().unwrap(),
        g["all_resident_budget_bytes"].as_u64().unwrap(),
    );
    assert!(min < all, "{g}");
    assert_eq!(g["streamed_layers"], 0, "{g}");
    let mid = ((min + all) / 2).to_string();
    let d = ok_json(&["doctor", m, "--vram-budget", &mid, "--json"]);
    let g = &d["model"]["plan"]["gpu"];
    if d["gpu"]["path"] == "none" || d["gpu"]["built_with_cuda"] == false {
        assert_eq!(g["preview"], true, "{g}");
    }
    let (res, str_) = (
        g["resident_layers"].as_u64().unwrap(),
        g["streamed_layers"].as_u64().unwrap(),
    );
    assert!(res > 2 && str_ > 0, "{g}");
    assert!(g["weights_held_bytes"].as_u64().unwrap() < mid.parse::<u64>().unwrap());
    let low = (min - 1).to_string();
    let d = ok_json(&["doctor", m, "--vram-budget", &low, "--json"]);
    let e = d["model"]["plan"]["gpu"]["error"].as_str().unwrap();
    assert!(e.contains("too small"), "{e}");
    // `run` on the CPU backend refuses a VRAM budget instead of ignoring it.
    let o = gdsrun(&[
        "run",
        m,
        "-p",
        "hi",
        "--backend",
        "cpu",
        "--vram-budget",
        "1GiB",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--vram-budget applies to --backend cuda"),
        "{err}"
    );
}
