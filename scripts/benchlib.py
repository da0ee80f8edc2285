"""Shared pieces of the benchmark scripts (scripts/bench-*.py): fio, ports, servers, cgroups."""
import json, os, shutil, socket, subprocess, sys, time, urllib.request


def ensure_fio():
    """Installs fio with apt when it is missing."""
    if shutil.which("fio"):
        return
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "fio"], env=env, capture_output=True).returncode:
        subprocess.run(sudo + ["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.check_call(sudo + ["apt-get", "install", "-y", "-qq", "fio"], env=env, stdout=subprocess.DEVNULL)


def fio_bandwidth(files):
    """fio: sequential O_DIRECT reads of 2 MiB, 4 in flight (libaio), over `files`, 3 s; bytes/s."""
    out = subprocess.check_output(["fio", "--name=layers", "--filename=" + ":".join(files), "--rw=read",
                                   "--bs=2M", "--direct=1", "--ioengine=libaio", "--iodepth=4", "--time_based",
                                   "--runtime=3", "--output-format=json"], text=True)
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"]


# words of made-up prompts and documents (random-weight models: the text is noise anyway)
WORDS = ("model memory layer stream disk cache token query answer search index vector "
         "document rank score server engine batch prompt weight tensor quantize block read "
         "write page file network registry package install machine learning data").split()


def synth_model(shape, quant, gdsconv):
    """A random-weight model of a real shape (scripts/synth-model.py SHAPE: its Hugging Face
    directory in .cache/synth/SHAPE, a GGUF by llama.cpp's converter and llama-quantize) and
    the GGUF converted by `gdsconv` for gdsrun, each made once: (gguf path, gds directory)."""
    hf = f".cache/synth/{shape}"
    gguf = f".cache/synth/{shape}-{quant}.gguf"
    gds = f".cache/synth/{shape}-{quant}-gguf.gds"
    if not os.path.exists(gguf):
        args = ["--reuse"] if os.path.exists(os.path.join(hf, "config.json")) else []
        subprocess.check_call([sys.executable, "scripts/synth-model.py", shape, hf,
                               "--gguf", gguf, "--quant", quant, *args])
    if not os.path.exists(os.path.join(gds, "manifest.gdsm")):
        subprocess.check_call([gdsconv, "convert", gguf, gds, "--force"])
    return gguf, gds


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, timeout=120):
    """Waits for `url`/health; raises RuntimeError when `proc` exits or the time runs out."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} never became healthy")


def make_cgroup(prefix="gdsbench"):
    """A fresh memory cgroup (v1 or v2) under this process's: ((path, limit file), None), or
    (None, why not)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError as e:
        return None, str(e)
    for l in lines:
        _, ctrl, path = l.split(":", 2)
        if "memory" in ctrl.split(","):
            base, limit_file = f"/sys/fs/cgroup/memory{path}", "memory.limit_in_bytes"
            break
    else:
        base = "/sys/fs/cgroup" + next((l.split(":", 2)[2] for l in lines if l.startswith("0::")), "/")
        limit_file = "memory.max"
    cg = os.path.join(base, f"{prefix}-{os.getpid()}")
    try:
        os.mkdir(cg)
        return (cg, limit_file), None
    except OSError as e:
        return None, f"cannot create a memory cgroup under {base}: {e}"


def in_cgroup(cmd, cgroup):
    """`cmd` run inside the cgroup directory `cgroup` (None: as is)."""
    if not cgroup:
        return cmd
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] + cmd


def drop_cache(paths):
    """Evicts `paths` from the page cache, so a run starts cold."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            pass


def run_load(url, concurrency, requests, max_tokens, time_limit, extra=()):
    """tests/py/serve_load.py against `url`: its JSON (per level: t/s, latency, failures);
    RuntimeError with its stderr's end when it fails."""
    res = subprocess.run([sys.executable, "tests/py/serve_load.py", "--url", url, "--concurrency", concurrency,
                          "--requests-per-level", str(requests), "--max-tokens", str(max_tokens),
                          "--time-limit", str(time_limit), *extra], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"serve_load.py: exit {res.returncode}: {res.stderr[-300:]}")
    return json.loads(res.stdout)


def stop(proc, grace=20):
    """Terminates `proc`, killing it after `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
