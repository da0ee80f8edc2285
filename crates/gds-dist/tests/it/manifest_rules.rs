//! Every rule `parse_manifest` enforces on an image manifest from a registry or a layout,
//! each broken once on an otherwise valid manifest.

use gds_dist::package::parse_manifest;
use gds_dist::*;
use serde_json::{json, Value};

const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";
const D3: &str = "sha256:3333333333333333333333333333333333333333333333333333333333333333";
const B3: &str = "abababababababababababababababababababababababababababababababab";

fn layer(digest: &str, path: &str) -> Value {
    json!({
        "mediaType": WEIGHT_MEDIA_TYPE, "digest": digest, "size": 4096,
        "annotations": { FILEPATH_ANNOTATION: path, BLAKE3_ANNOTATION: B3 },
    })
}

fn good() -> Value {
    json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": { "mediaType": CONFIG_MEDIA_TYPE, "digest": D1, "size": 300 },
        "layers": [layer(D2, "manifest.gdsm"), layer(D3, "layers/blk.0000.bin")],
    })
}

fn err(v: &Value) -> String {
    match parse_manifest(&serde_json::to_vec(v).unwrap(), "test") {
        Ok(_) => panic!("accepted: {v}"),
        Err(e) => {
            assert_eq!(e.kind, Kind::Invalid, "{e}");
            e.msg
        }
    }
}

#[test]
fn a_valid_manifest_parses() {
    let p = parse_manifest(&serde_json::to_vec(&good()).unwrap(), "test").unwrap();
    assert_eq!(p.layers.len(), 2);
    assert_eq!(p.layers[1].path, "layers/blk.0000.bin");
    assert_eq!(p.config_digest, D1);
}

#[test]
fn hostile_paths_are_refused() {
    for (path, why) in [
        ("/etc/passwd", "absolute"),
        ("../../x", "'.'"),
        ("layers/../../x", "'.'"),
        ("a\\b", "character"),
        ("", "empty"),
    ] {
        let mut v = good();
        v["layers"][1]["annotations"][FILEPATH_ANNOTATION] = json!(path);
        let e = err(&v);
        assert!(e.contains(why) && e.contains(D3), "{path}: {e}");
    }
}

#[test]
fn repeated_case_folded_and_nested_paths_are_refused() {
    for other in ["manifest.gdsm", "MANIFEST.gdsm", "manifest.gdsm/x"] {
        let mut v = good();
        v["layers"][1]["annotations"][FILEPATH_ANNOTATION] = json!(other);
        let e = err(&v);
        assert!(
            e.contains("manifest.gdsm") || e.contains("MANIFEST"),
            "{other}: {e}"
        );
    }
}

#[test]
fn archives_links_and_foreign_types_are_refused() {
    let mut v = good();
    v["layers"][1]["mediaType"] = json!("application/vnd.cncf.model.weight.v1.tar");
    assert!(err(&v).contains("archives are not accepted"));
    let mut v = good();
    v["layers"][1]["annotations"][FILE_METADATA_ANNOTATION] =
        json!(r#"{"name":"x","typeflag":"2","mode":511}"#);
    assert!(err(&v).contains("not a regular file"));
    let mut v = good();
    v["config"]["mediaType"] = json!("application/vnd.oci.image.config.v1+json");
    assert!(err(&v).contains("not a ModelPack model"));
    let mut v = good();
    v["mediaType"] = json!("application/vnd.docker.distribution.manifest.v2+json");
    assert!(err(&v).contains("mediaType"));
}

#[test]
fn sizes_counts_and_digests_are_bounded() {
    let mut v = good();
    v["layers"][1]["size"] = json!(1u64 << 40);
    assert!(err(&v).contains("over the"));
    let mut v = good();
    v["config"]["size"] = json!(MAX_CONFIG_BYTES + 1);
    assert!(err(&v).contains("config blob"));
    let mut v = good();
    let many: Vec<Value> = (0..=MAX_LAYERS)
        .map(|i| layer(D2, &format!("f{i}")))
        .collect();
    v["layers"] = json!(many);
    assert!(err(&v).contains("layers, over the limit"));
    let mut v = good();
    v["layers"][1]["digest"] = json!("sha256:XYZ");
    assert!(err(&v).contains("digest"));
    let mut v = good();
    v["annotations"] = json!({ "pad": "x".repeat(MAX_MANIFEST_BYTES) });
    assert!(err(&v).contains("limit"));
    let mut v = good();
    v["layers"][1]["annotations"][BLAKE3_ANNOTATION] = json!("zz");
    assert!(err(&v).contains(BLAKE3_ANNOTATION));
}

#[test]
fn a_package_without_the_model_manifest_is_not_a_model() {
    let mut v = good();
    v["layers"] = json!([layer(D3, "layers/blk.0000.bin")]);
    assert!(err(&v).contains("not a GdsLLM model"));
}
