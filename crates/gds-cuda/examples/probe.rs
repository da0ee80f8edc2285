//! Prints what `gds_cuda::probe()` finds (what `gdsrun doctor` shows for the GPU side);
//! `--json` for the serialized report.
fn main() {
    let report = gds_cuda::probe();
    if std::env::args().any(|a| a == "--json") {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serializable")
        );
    } else {
        print!("{report}");
    }
}
