#!/usr/bin/env python3
"""Writes a hostile OCI image layout for the distribution tests (tests/tests/dist.rs).

    hostile_oci.py SRC_LAYOUT OUT_DIR CASE [--tag TAG] [--target PATH]

SRC_LAYOUT is a genuine layout (`gdsconv pack DIR --layout SRC_LAYOUT`). OUT_DIR receives a
copy (blobs hard-linked where possible) whose image manifest is edited as an attacker would,
with every changed blob's sha256 digest and size recomputed, so that the package is
well-formed OCI that a registry accepts (`skopeo copy oci:OUT_DIR:TAG docker://...`) and only
a careful client refuses. The chosen layer's path and digest are printed as JSON on stdout
({"case", "filepath", "digest", "manifest_digest"}) so the test can look for them in errors.

Cases:
  abs-path        a weight layer's org.cncf.model.filepath is absolute (--target, default /etc/x)
  dotdot          a weight layer's path climbs out: layers/../../gds-escape-dotdot
  dup-path        an extra layer (another blob) repeats a weight layer's path
  case-dup        an extra layer (another blob) whose path differs from a weight layer's
                  only in case
  tar-layer       a weight layer's mediaType is ...weight.v1.tar (an archive, not a raw file)
  symlink         a weight layer's org.cncf.model.file.metadata+json says typeflag '2'
                  (symlink), pointing at --target
  big-manifest    the image manifest is padded past 2 MiB with an annotation
  big-config      the model config blob is padded past 1 MiB
  size-lie        a weight layer declares 1 TB while its blob is the genuine few MB
  size-over       a weight layer declares twice its real size (under any size cap)
  size-under      a weight layer declares 4096 bytes less than its real size
  blake3-lie      a weight layer's io.gdsllm.blake3 annotation is another file's hash
                  (its sha256 digest is genuine)
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

MANIFEST_MT = "application/vnd.oci.image.manifest.v1+json"
WEIGHT_MT = "application/vnd.cncf.model.weight.v1.raw"
FILEPATH = "org.cncf.model.filepath"
FILEMETA = "org.cncf.model.file.metadata+json"
REF_NAME = "org.opencontainers.image.ref.name"
CASES = [
    "abs-path",
    "dotdot",
    "dup-path",
    "case-dup",
    "tar-layer",
    "symlink",
    "big-manifest",
    "big-config",
    "size-lie",
    "size-over",
    "size-under",
    "blake3-lie",
]


def blob_path(layout, digest):
    algo, hexd = digest.split(":", 1)
    return os.path.join(layout, "blobs", algo, hexd)


def put_blob(layout, data):
    d = "sha256:" + hashlib.sha256(data).hexdigest()
    p = blob_path(layout, d)
    with open(p, "wb") as f:
        f.write(data)
    return d


def copy_layout(src, out):
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "blobs", "sha256"))
    for name in ("oci-layout",):
        shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    sdir = os.path.join(src, "blobs", "sha256")
    for b in os.listdir(sdir):
        s, d = os.path.join(sdir, b), os.path.join(out, "blobs", "sha256", b)
        try:
            os.link(s, d)
        except OSError:
            shutil.copyfile(s, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--tag", default="latest")
    ap.add_argument("--target", default="/etc/x")
    a = ap.parse_args()

    with open(os.path.join(a.src, "index.json")) as f:
        index = json.load(f)
    descs = [d for d in index["manifests"] if d.get("mediaType") == MANIFEST_MT]
    if not descs:
        sys.exit("no image manifest in %s/index.json" % a.src)
    with open(blob_path(a.src, descs[0]["digest"]), "rb") as f:
        manifest = json.load(f)

    copy_layout(a.src, a.out)
    # The genuine manifest blob goes: only the edited one is in the output layout.
    os.unlink(blob_path(a.out, descs[0]["digest"]))

    layers = manifest["layers"]
    weights = [i for i, l in enumerate(layers) if l.get("mediaType") == WEIGHT_MT]
    if len(weights) < 2:
        sys.exit("need at least two weight layers, found %d" % len(weights))
    w0, w1 = layers[weights[0]], layers[weights[1]]
    p0 = w0["annotations"][FILEPATH]
    chosen = w0

    if a.case == "abs-path":
        w0["annotations"][FILEPATH] = a.target
    elif a.case == "dotdot":
        w0["annotations"][FILEPATH] = "layers/../../gds-escape-dotdot"
    elif a.case in ("dup-path", "case-dup"):
        extra = json.loads(json.dumps(w1))
        extra["annotations"][FILEPATH] = p0 if a.case == "dup-path" else p0.upper()
        if extra["annotations"][FILEPATH] == p0 and a.case == "case-dup":
            sys.exit("path %r has no letters to change the case of" % p0)
        layers.append(extra)
        chosen = extra
    elif a.case == "tar-layer":
        w0["mediaType"] = "application/vnd.cncf.model.weight.v1.tar"
    elif a.case == "symlink":
        w0["annotations"][FILEMETA] = json.dumps(
            {
                "name": a.target,
                "mode": 0o777,
                "uid": 0,
                "gid": 0,
                "size": 0,
                "mtime": "2025-01-01T00:00:00Z",
                "typeflag": ord("2"),
            },
            separators=(",", ":"),
        )
    elif a.case == "big-manifest":
        manifest.setdefault("annotations", {})["io.gdsllm.test.padding"] = "x" * (2 * 1024 * 1024 + 4096)
    elif a.case == "big-config":
        cd = manifest["config"]
        with open(blob_path(a.src, cd["digest"]), "rb") as f:
            cfg = json.load(f)
        cfg["io.gdsllm.test.padding"] = "x" * (1024 * 1024 + 4096)
        data = json.dumps(cfg, separators=(",", ":")).encode()
        os.unlink(blob_path(a.out, cd["digest"]))
        cd["digest"] = put_blob(a.out, data)
        cd["size"] = len(data)
    elif a.case == "size-lie":
        w0["size"] = 10**12
    elif a.case == "size-over":
        w0["size"] = 2 * w0["size"]
    elif a.case == "size-under":
        w0["size"] = w0["size"] - 4096
    elif a.case == "blake3-lie":
        w0["annotations"]["io.gdsllm.blake3"] = w1["annotations"]["io.gdsllm.blake3"]

    data = json.dumps(manifest, separators=(",", ":")).encode()
    md = put_blob(a.out, data)
    index["manifests"] = [
        {"mediaType": MANIFEST_MT, "digest": md, "size": len(data), "annotations": {REF_NAME: a.tag}}
    ]
    if "artifactType" in descs[0]:
        index["manifests"][0]["artifactType"] = descs[0]["artifactType"]
    with open(os.path.join(a.out, "index.json"), "w") as f:
        json.dump(index, f, separators=(",", ":"))
    print(
        json.dumps(
            {
                "case": a.case,
                "filepath": chosen["annotations"][FILEPATH],
                "original_filepath": p0,
                "digest": chosen["digest"],
                "manifest_digest": md,
                "config_digest": manifest["config"]["digest"],
            }
        )
    )


if __name__ == "__main__":
    main()
