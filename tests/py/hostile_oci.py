#!/usr/bin/env python3
"""Writes a hostile OCI image layout, or serves a hostile registry, for the distribution
tests (tests/tests/it/dist.rs).

    hostile_oci.py SRC_LAYOUT OUT_DIR CASE [--tag TAG] [--target PATH]
    hostile_oci.py serve MODE [--size BYTES] [--interval SECONDS] [--at STEP]

`serve` listens on 127.0.0.1 (a free port), prints {"port": N} on stdout and answers every
GET /v2/ with 200 (no authentication; huge-token aside) and every other request as MODE
says, until killed:
  huge-error     404 with a chunked text body of --size bytes (default 3 GiB), sent as fast
                 as the client reads, full of terminal escapes and control characters
  huge-manifest  200 with a manifest body of --size bytes (default 3 GiB) and no length
                 (chunked)
  trickle        200 with Content-Length 4096, then one byte every --interval seconds
                 (default 1)
  stall          reads the request and never answers
  stall-body     200 with Content-Length 4096 and 16 bytes of it, then nothing
  huge-token     a bearer-token registry: GET /v2/ (and every other request) answers 401 with
                 a challenge whose realm is GET /token here, which answers 200 with a JSON
                 body of --size bytes (chunked)
  push-error     a push target that fails one step (--at) with a 403 whose chunked text body
                 has --size bytes (like huge-error's): every blob is missing (HEAD 404) unless
                 --at manifest (then every blob is there); `start` fails the POST that opens
                 an upload (or mounts), `upload` reads the PUT of a blob's bytes and fails it,
                 `manifest` reads the manifest's PUT and fails it; the other steps succeed

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


SERVE_MODES = [
    "huge-error",
    "huge-manifest",
    "trickle",
    "stall",
    "stall-body",
    "huge-token",
    "push-error",
]
PUSH_STEPS = ["start", "upload", "manifest"]


def serve(argv):
    import http.server
    import socketserver
    import time

    ap = argparse.ArgumentParser(prog="hostile_oci.py serve")
    ap.add_argument("mode", choices=SERVE_MODES)
    ap.add_argument("--size", type=int, default=3 << 30)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--at", choices=PUSH_STEPS, default="start")
    a = ap.parse_args(argv)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def chunked(self, piece, total):
            sent = 0
            while sent < total:
                n = min(len(piece), total - sent)
                self.wfile.write(b"%x\r\n" % n + piece[:n] + b"\r\n")
                sent += n
            self.wfile.write(b"0\r\n\r\n")

        def huge_error(self, status):
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            line = b"\x1b[31mNOT FOUND\x1b[0m \x07\x08\r" + b"E" * 100 + b"\n"
            self.chunked(line * ((1 << 20) // len(line)), a.size)

        def empty(self, status, location=None):
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def drain(self):
            left = int(self.headers.get("Content-Length") or 0)
            while left > 0:
                n = len(self.rfile.read(min(left, 1 << 20)))
                if n == 0:
                    break
                left -= n

        def push(self):
            """The push-error mode: (method, path) → the answer."""
            m, path = self.command, self.path.split("?")[0]
            if m == "GET" and path.rstrip("/") == "/v2":
                self.empty(200)
            elif m == "HEAD" and "/blobs/" in path:
                self.empty(200 if a.at == "manifest" else 404)
            elif m == "POST" and path.endswith("/blobs/uploads/"):
                if a.at == "start":
                    self.huge_error(403)
                else:
                    self.empty(202, path + "upload-1")
            elif m == "PUT" and "/blobs/uploads/" in path:
                self.drain()
                if a.at == "upload":
                    self.huge_error(403)
                else:
                    self.empty(201, path)
            elif m == "PUT" and "/manifests/" in path:
                self.drain()
                self.huge_error(403)
            else:
                self.empty(405)

        def do_HEAD(self):
            self.do_GET()

        def do_POST(self):
            self.do_GET()

        def do_PUT(self):
            self.do_GET()

        def do_PATCH(self):
            self.do_GET()

        def token(self):
            if self.command == "GET" and self.path.startswith("/token"):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                head = b'{"token":"'
                self.wfile.write(b"%x\r\n" % len(head) + head + b"\r\n")
                self.chunked(b"t" * (1 << 20), a.size)
                return
            realm = "http://127.0.0.1:%d/token" % self.server.server_address[1]
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Bearer realm="%s",service="hostile"' % realm)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            try:
                if a.mode == "push-error":
                    self.push()
                elif a.mode == "huge-token":
                    self.token()
                else:
                    self.answer()
            except (BrokenPipeError, ConnectionResetError):
                pass

        def answer(self):
            if self.path.rstrip("/") == "/v2":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            if a.mode == "stall":
                time.sleep(3600)
                return
            if a.mode == "huge-error":
                self.huge_error(404)
                return
            if a.mode == "huge-manifest":
                self.send_response(200)
                self.send_header("Content-Type", MANIFEST_MT)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                head = b'{"schemaVersion":2, '
                self.wfile.write(b"%x\r\n" % len(head) + head + b"\r\n")
                self.chunked(b" " * (1 << 20), a.size)
                return
            self.send_response(200)
            self.send_header("Content-Type", MANIFEST_MT)
            self.send_header("Content-Length", "4096")
            self.end_headers()
            if a.mode == "stall-body":
                self.wfile.write(b'{"schemaVersion"')
                self.wfile.flush()
                time.sleep(3600)
                return
            for _ in range(4096):  # trickle
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(a.interval)

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            pass  # a client that hangs up mid-body is what these modes expect

    srv = Server(("127.0.0.1", 0), Handler)
    print(json.dumps({"port": srv.server_address[1]}), flush=True)
    srv.serve_forever()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
        return
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
