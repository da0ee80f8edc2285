#!/usr/bin/env python3
"""Pushes a model to a registry in another tool's OCI format, as that tool lays it out, for
the tests of `gdsconv pull` / `gdsrun REF` on other tools' models (tests/tests/it/dist.rs).
The formats follow each tool's published packaging (Docker Model Runner's
pkg/distribution types and builder, Ollama's server/images.go and manifest package, CNCF
ModelPack's spec and modctl's build); none of those tools runs here, so their layouts are
written out by this script, over the distribution API (`/v2/<repo>/blobs/uploads/`,
`/v2/<repo>/manifests/<tag>`).

    foreign_oci.py HOST:PORT REPO TAG KIND FILE...      # prints {"reference", "digest"}

KIND:
  dmr-gguf          Docker Model Runner, config v0.1: the GGUF files (a split model's shards
                    in order) as application/vnd.docker.ai.gguf.v3, each annotated with its
                    file name, and a license layer; FILE... are GGUFs then optional LICENSE
                    and optional *.jinja (a chat template layer, docker model package
                    --chat-template)
  dmr-gguf-bare     the same without any layer annotation (packages made before 2025-11)
  dmr-dir           Docker Model Runner, config v0.2: a Hugging Face directory (FILE is the
                    directory), one layer per file annotated with its path: *.safetensors as
                    application/vnd.docker.ai.safetensors, the rest application/vnd.docker.ai.model.file
  dmr-config-tar    Docker Model Runner's older safetensors packages (config v0.1): the
                    safetensors files as layers without annotations, the other files in one
                    uncompressed tar (application/vnd.docker.ai.vllm.config.tar)
  modelpack         modctl build --raw of a directory (FILE): config files (*.json, tokenizer,
                    merges.txt) as weight.config.v1.raw, weights (*.safetensors, *.gguf) as
                    weight.v1.raw, *.md as doc.v1.raw, sorted by path, with
                    org.cncf.model.filepath and org.cncf.model.file.metadata+json
  ollama            Ollama's registry: a Docker v2 manifest, the GGUF as
                    application/vnd.ollama.image.model, a Go template, parameters and a license
  ollama-adapter    the same with a LoRA adapter layer (refused)
  modelpack-tar     modelpack with the weights in a tar layer (refused)
  dmr-dduf          Docker Model Runner with a DDUF layer (refused)
"""
import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.request

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
FILEPATH = "org.cncf.model.filepath"
FILEMETA = "org.cncf.model.file.metadata+json"
CNCF = "application/vnd.cncf.model."


def request(method, url, data=None, headers=None):
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    with urllib.request.urlopen(req) as r:
        return r.status, dict(r.headers), r.read()


class Pusher:
    def __init__(self, host, repo):
        self.base = f"http://{host}/v2/{repo}"

    def blob(self, data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        _, h, _ = request("POST", self.base + "/blobs/uploads/", b"")
        loc = h["Location"]
        if loc.startswith("/"):
            loc = self.base.split("/v2/")[0] + loc
        sep = "&" if "?" in loc else "?"
        request("PUT", f"{loc}{sep}digest={d}", data,
                {"Content-Type": "application/octet-stream"})
        return d

    def manifest(self, tag, m: dict) -> str:
        data = json.dumps(m, separators=(",", ":")).encode()
        request("PUT", f"{self.base}/manifests/{tag}", data, {"Content-Type": m["mediaType"]})
        return "sha256:" + hashlib.sha256(data).hexdigest()


def layer(p: Pusher, data: bytes, mt: str, annotations=None) -> dict:
    d = {"mediaType": mt, "digest": p.blob(data), "size": len(data)}
    if annotations:
        d["annotations"] = annotations
    return d


def file_meta(name: str, size: int) -> str:
    return json.dumps({"name": name, "mode": 0o644, "uid": 0, "gid": 0, "size": size,
                       "mtime": "2025-01-01T00:00:00Z", "typeflag": 0}, separators=(",", ":"))


def annotated(name: str, data: bytes) -> dict:
    return {FILEPATH: name, FILEMETA: file_meta(name, len(data)),
            "org.cncf.model.file.mediatype.untested": "false"}


def dir_files(d: str) -> list[tuple[str, bytes]]:
    out = []
    for root, dirs, files in os.walk(d):
        dirs.sort()
        for f in sorted(files):
            if f.startswith("."):
                continue
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out.append((os.path.relpath(path, d), fh.read()))
    return sorted(out)


def oci(config_mt: str, config: bytes, p: Pusher, layers: list, artifact=None) -> dict:
    m = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
         "config": {"mediaType": config_mt, "digest": p.blob(config), "size": len(config)},
         "layers": layers}
    if artifact:
        m["artifactType"] = artifact
    return m


def dmr_config(fmt: str, version: str, layers: list) -> tuple[str, bytes]:
    cfg = {"config": {"format": fmt, "quantization": "Q4_0", "parameters": "1M",
                      "architecture": "llama", "size": "1MB"},
           "descriptor": {"created": "2025-01-01T00:00:00Z"},
           "rootfs": {"type": "rootfs", "diff_ids": [l["digest"] for l in layers]}}
    return (f"application/vnd.docker.ai.model.config.{version}+json",
            json.dumps(cfg, separators=(",", ":")).encode())


def main() -> None:
    host, repo, tag, kind, *files = sys.argv[1:]
    p = Pusher(host, repo)
    read = lambda f: open(f, "rb").read()
    if kind in ("dmr-gguf", "dmr-gguf-bare", "dmr-dduf"):
        ggufs = [f for f in files if f.endswith(".gguf")]
        ls = []
        for f in ggufs:
            data = read(f)
            ann = None if kind == "dmr-gguf-bare" else annotated(os.path.basename(f), data)
            ls.append(layer(p, data, "application/vnd.docker.ai.gguf.v3", ann))
        for f in files:
            if f.endswith(".jinja"):
                # docker model package --chat-template: the template its runtime uses
                ls.append(layer(p, read(f), "application/vnd.docker.ai.chat.template.jinja"))
            elif not f.endswith(".gguf"):
                ls.append(layer(p, read(f), "application/vnd.docker.ai.license"))
        if kind == "dmr-dduf":
            ls.append(layer(p, b"PK\x03\x04dduf", "application/vnd.docker.ai.dduf"))
        mt, cfg = dmr_config("gguf", "v0.1", ls)
        m = oci(mt, cfg, p, ls)
    elif kind == "dmr-dir":
        ls = []
        for name, data in dir_files(files[0]):
            mt = ("application/vnd.docker.ai.safetensors" if name.endswith(".safetensors")
                  else "application/vnd.docker.ai.model.file")
            ls.append(layer(p, data, mt, annotated(name, data)))
        mt, cfg = dmr_config("safetensors", "v0.2", ls)
        m = oci(mt, cfg, p, ls)
    elif kind == "dmr-config-tar":
        ls, buf = [], io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            for name, data in dir_files(files[0]):
                if name.endswith(".safetensors"):
                    ls.append(layer(p, data, "application/vnd.docker.ai.safetensors"))
                else:
                    ti = tarfile.TarInfo(os.path.basename(name))
                    ti.size, ti.mtime = len(data), 0
                    t.addfile(ti, io.BytesIO(data))
        ls.append(layer(p, buf.getvalue(), "application/vnd.docker.ai.vllm.config.tar"))
        mt, cfg = dmr_config("safetensors", "v0.1", ls)
        m = oci(mt, cfg, p, ls)
    elif kind in ("modelpack", "modelpack-tar"):
        groups = {"config": [], "model": [], "doc": []}
        for name, data in dir_files(files[0]):
            low = name.lower()
            if low.endswith(".json") or "tokenizer" in low or low.endswith("merges.txt"):
                groups["config"].append((name, data, CNCF + "weight.config.v1.raw"))
            elif low.endswith((".safetensors", ".gguf")):
                mt = CNCF + ("weight.v1.tar" if kind == "modelpack-tar" else "weight.v1.raw")
                if kind == "modelpack-tar":
                    buf = io.BytesIO()
                    with tarfile.open(fileobj=buf, mode="w") as t:
                        ti = tarfile.TarInfo(name)
                        ti.size = len(data)
                        t.addfile(ti, io.BytesIO(data))
                    data = buf.getvalue()
                groups["model"].append((name, data, mt))
            else:
                groups["doc"].append((name, data, CNCF + "doc.v1.raw"))
        ls = [layer(p, d, mt, annotated(n, d))
              for g in ("config", "model", "doc") for n, d, mt in groups[g]]
        cfg = {"descriptor": {"createdAt": "2025-01-01T00:00:00Z", "name": repo},
               "config": {"architecture": "transformer"},
               "modelfs": {"type": "layers", "diffIds": [l["digest"] for l in ls]}}
        m = oci(CNCF + "config.v1+json", json.dumps(cfg).encode(), p, ls,
                CNCF + "manifest.v1+json")
    elif kind in ("ollama", "ollama-adapter"):
        ol = "application/vnd.ollama.image."
        ls = [layer(p, read(files[0]), ol + "model"),
              layer(p, b"{{ .System }}\n{{ .Prompt }}", ol + "template"),
              layer(p, json.dumps({"stop": ["<|im_end|>"], "temperature": 0.7,
                                   "num_predict": 64, "num_ctx": 8192}).encode(),
                    ol + "params"),
              layer(p, b"Apache License 2.0", ol + "license")]
        if kind == "ollama-adapter":
            ls.append(layer(p, b"GGUF lora", ol + "adapter"))
        cfg = json.dumps({"model_format": "gguf", "model_family": "llama",
                          "model_families": ["llama"], "model_type": "135M",
                          "file_type": "Q4_1", "architecture": "amd64", "os": "linux",
                          "rootfs": {"type": "layers",
                                     "diff_ids": [l["digest"] for l in ls]}}).encode()
        m = {"schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
             "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                        "digest": p.blob(cfg), "size": len(cfg)},
             "layers": ls}
    else:
        sys.exit(f"unknown kind {kind}")
    d = p.manifest(tag, m)
    print(json.dumps({"reference": f"{host}/{repo}:{tag}", "digest": d}))


if __name__ == "__main__":
    main()
