"""gdsllm.pull against a real registry: Debian's `docker-registry` (the CNCF reference
registry) started on 127.0.0.1 with its own config, as tests/src/registry.rs starts it for the
Rust distribution tests; the converted SmolLM2 pushed with `gdsconv push`, then pulled."""

import json
import os
import pathlib
import socket
import subprocess
import time
import urllib.request

import pytest

import gdsllm

from conftest import ROOT, gdsrun_error

REGISTRY_BIN = "/usr/bin/docker-registry"


def gdsconv_path():
    p = pathlib.Path(os.environ.get("GDSCONV", ROOT / "target" / "ci" / "gdsconv"))
    if not p.exists():
        pytest.fail(f"{p}: no gdsconv binary (build it: cargo build --profile ci -p gdsconv)")
    return p


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """`127.0.0.1:PORT` of a registry without authentication, killed after the module."""
    if not os.path.exists(REGISTRY_BIN):
        pytest.skip(
            f"{REGISTRY_BIN} missing: `apt-get install docker-registry` (scripts/test.sh does)"
        )
    d = tmp_path_factory.mktemp("registry")
    log = ""
    # a port taken between the probe and the registry's bind makes it exit: another one
    for _ in range(5):
        port = _free_port()
        cfg = d / "config.yml"
        cfg.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {d / 'storage'}\n"
            "  maintenance:\n    uploadpurging:\n      enabled: false\n"
            f"http:\n  addr: 127.0.0.1:{port}\n  secret: gdsllm-tests-not-secret\n"
        )
        with open(d / "registry.log", "wb") as logf:
            p = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        t0 = time.monotonic()
        while p.poll() is None and not _answers(port) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        if p.poll() is None and _answers(port):
            try:
                yield f"127.0.0.1:{port}"
            finally:
                p.kill()
                p.wait()
            return
        if p.poll() is None:
            p.kill()
        p.wait()
        log = (d / "registry.log").read_text()
    pytest.fail(f"docker-registry did not start; its log:\n{log}")


def push(src, reference):
    p = subprocess.run(
        [str(gdsconv_path()), "push", str(src), reference, "--plain-http", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def files(d):
    """{relative path: bytes} of every file under `d`."""
    d = pathlib.Path(d)
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_pull_gives_the_pushed_files(registry, smollm2_dir, tmp_path):
    ref = f"{registry}/smollm2:q4_1"
    pushed = push(smollm2_dir, ref)
    want = files(smollm2_dir)
    assert len(want) > 2
    # into the store, as gdsrun pulls a reference: the reference then names that directory
    d = gdsllm.pull(ref, plain_http=True)
    assert pathlib.Path(d).is_dir() and files(d) == want
    assert gdsllm.resolve(ref) == d
    assert gdsllm.open(ref).architecture == "llama"
    # again: the registry is asked, nothing is downloaded twice, the same directory
    assert gdsllm.pull(ref, plain_http=True) == d
    # by digest, into a directory of our own (gdsconv pull REF OUT_DIR)
    by_digest = f"{registry}/smollm2@{pushed['manifest_digest']}"
    out = tmp_path / "pulled"
    assert gdsllm.pull(by_digest, str(out), plain_http=True) == str(out)
    assert files(out) == want
    with pytest.raises(gdsllm.GdsError, match="exists"):
        gdsllm.pull(by_digest, str(out), plain_http=True)
    assert gdsllm.pull(by_digest, str(out), plain_http=True, force=True) == str(out)


def test_pull_errors_are_gdsruns(registry):
    missing = f"{registry}/nothing-here:v1"
    with pytest.raises(gdsllm.GdsError) as e:
        gdsllm.pull(missing, plain_http=True)
    assert str(e.value) == gdsrun_error("run", missing, "--plain-http", "-p", "hi")
    with pytest.raises(gdsllm.GdsError, match="not a registry reference"):
        gdsllm.pull("no-registry-here", plain_http=True)
    with pytest.raises(ValueError, match="timeout"):
        gdsllm.pull(missing, plain_http=True, timeout=-1)
