"""The package under threads, fork and hostile arguments: two threads on one stream, the GIL
released while waiting for a busy engine, a dropped stream stopping only its own reply, a
forked child refused instead of hanging, and arguments checked with Python's errors. Code
that used to hang runs in a subprocess with a timeout."""

import math
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import gdsllm

LONG = "Write a long essay about the sea."


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return gdsllm.Engine(str(smollm2_dir), threads=2, temperature=0)


def run_py(code, timeout=180, **env):
    """Runs `code` in a fresh interpreter (M is the model directory); its CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def test_two_threads_iterating_one_stream_do_not_deadlock(smollm2_dir):
    # Stream.__next__ held its lock while waiting with the GIL released; a second thread
    # then blocked on that lock holding the GIL, and neither could go on
    p = run_py(
        f"""
        import gdsllm, threading
        e = gdsllm.Engine({str(smollm2_dir)!r}, threads=2, temperature=0)
        want = e.generate({LONG!r}, max_tokens=40)
        s = e.stream({LONG!r}, max_tokens=40)
        got = [[], []]
        def consume(i):
            for piece in s:
                got[i].append(piece)
        ts = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert s.result["text"] == want, s.result
        assert sum(map(len, got)) >= 2 and len("".join(got[0] + got[1])) == len(want)
        print("ok", s.result["stop_reason"])
        """,
        timeout=120,
    )
    assert p.returncode == 0 and "ok max_tokens" in p.stdout, p.stdout + p.stderr


def test_calls_wait_for_a_busy_engine_without_the_gil(engine):
    # a stream's thread holds the engine; `plan` (and generate, repr) from another thread
    # used to wait for it holding the GIL, so no thread could call interrupt() meanwhile
    s = engine.stream(LONG, max_tokens=400)
    next(s)
    got = {}
    def other():
        got["plan"] = engine.plan
        got["repr"] = repr(engine)
        got["text"] = engine.generate("Hi", max_tokens=1)
    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.3)
    t0 = time.time()
    engine.interrupt()
    waited = time.time() - t0
    rest = list(s)
    t.join()
    assert waited < 1.0
    assert s.result["stop_reason"] == "interrupted" and len(rest) < 350
    assert got["plan"]["arch"] and "gdsllm.Engine" in got["repr"] and got["text"]


def test_dropping_a_finished_stream_does_not_stop_another_reply(engine):
    want = engine.generate(LONG, max_tokens=30, details=True)
    a = engine.stream("Hi", max_tokens=2)
    next(a)  # a's reply runs to its end on its thread; its last pieces are never read
    b = engine.stream(LONG, max_tokens=30)
    first = next(b)  # b holds the engine now: a's reply has finished
    del a  # used to set the engine-wide interrupt flag, stopping b
    text = first + "".join(b)
    assert b.result["stop_reason"] == "max_tokens", b.result["stop_reason"]
    assert text == want["text"]


def test_a_dropped_stream_waiting_for_the_engine_never_runs(engine):
    a = engine.stream(LONG, max_tokens=20)
    next(a)
    b = engine.stream(LONG, max_tokens=20)
    del b  # called off before it got the engine; a goes on
    assert len(list(a)) > 0 and a.result["stop_reason"] == "max_tokens"
    assert engine.generate("Hi", max_tokens=3)


def test_ctrl_c_interrupts_generate_and_a_waiting_stream(smollm2_dir):
    # generate waited with the GIL released and never ran Python's signal handlers: Ctrl-C
    # did nothing until the whole reply was done. Now KeyboardInterrupt comes at once, the
    # reply stops, and the engine serves the next call.
    p = run_py(
        f"""
        import gdsllm, os, signal, threading, time
        # Python's own Ctrl-C handler, also where this process was started with SIGINT
        # ignored (a shell's background job: the test command run with `&`), which Python
        # then leaves ignored, and the kill below would do nothing
        signal.signal(signal.SIGINT, signal.default_int_handler)
        e = gdsllm.Engine({str(smollm2_dir)!r}, threads=2, temperature=0)
        full = e.generate({LONG!r}, max_tokens=8, details=True)
        per_token = full["metrics"]["decode_ms"] / 1000 / 7
        def ctrl_c(after):
            time.sleep(after)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=ctrl_c, args=(0.5,)).start()
        t0 = time.time()
        try:
            e.generate({LONG!r}, max_tokens=4000)
            raise SystemExit("not interrupted")
        except KeyboardInterrupt:
            waited = time.time() - t0
        assert waited < 2.0, waited
        # the engine is free again (its reply stopped)
        t0 = time.time()
        assert e.generate("Hi", max_tokens=2, details=True)["stop_reason"] == "max_tokens"
        assert time.time() - t0 < 100 * per_token + 5
        # a stream waiting for the engine (another thread's stream holds it): Ctrl-C
        # reaches the waiting next(), and the holder's reply goes on
        # (a is long enough to hold the engine past the signal on a fast machine)
        a = e.stream({LONG!r}, max_tokens=400)
        next(a)
        b = e.stream({LONG!r}, max_tokens=20)
        threading.Thread(target=ctrl_c, args=(0.3,)).start()
        try:
            while True:
                next(b)
        except KeyboardInterrupt:
            pass
        del b
        rest = list(a)
        assert a.result["stop_reason"] != "interrupted", a.result["stop_reason"]
        print("ok", round(waited, 2))
        """,
        timeout=300,
    )
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout + p.stderr


def test_a_forked_child_is_refused_instead_of_hanging(smollm2_dir):
    p = run_py(
        f"""
        import gdsllm, os
        M = {str(smollm2_dir)!r}
        e = gdsllm.Engine(M, threads=2, temperature=0)
        want = e.generate("Hi!", max_tokens=4)
        t = gdsllm.open(M)["blk.0.attn_q.weight"]
        t.dequantize()
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(60)
            calls = [
                lambda: e.generate("Hi!", max_tokens=4),
                lambda: list(e.stream("Hi!", max_tokens=4)),
                lambda: e.tokenize("Hi"),
                lambda: e.plan,
                lambda: t.dequantize(),
                lambda: gdsllm.Engine(M, threads=1),
                lambda: gdsllm.open(M),
            ]
            refused = 0
            for c in calls:
                try:
                    c()
                except gdsllm.GdsError as ex:
                    refused += "fork" in str(ex) and '"spawn"' in str(ex)
            print("child refused", refused, "of", len(calls), repr(e), flush=True)
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, st
        assert e.generate("Hi!", max_tokens=4) == want
        print("parent ok")
        """,
        timeout=120,
    )
    assert "child refused 7 of 7" in p.stdout and "parent ok" in p.stdout, p.stdout + p.stderr
    assert "before a fork" in p.stdout


def test_a_child_of_a_process_that_ran_nothing_can_use_gdsllm(smollm2_dir):
    p = run_py(
        f"""
        import gdsllm, os
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(60)
            e = gdsllm.Engine({str(smollm2_dir)!r}, threads=2, temperature=0)
            print("child:", repr(e.generate("Hi!", max_tokens=4)), flush=True)
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        print("status", st)
        """,
        timeout=120,
    )
    assert "child: '" in p.stdout and "status 0" in p.stdout, p.stdout + p.stderr


def test_pull_timeout_out_of_range_is_a_value_error():
    for t in [1e300, float("inf"), math.nan, 0, -1]:
        with pytest.raises(ValueError, match="timeout"):
            gdsllm.pull("127.0.0.1:1/x/y:latest", plain_http=True, timeout=t)


def test_a_fifo_as_chat_template_file_is_refused_at_once(smollm2_dir, tmp_path):
    fifo = tmp_path / "template.fifo"
    os.mkfifo(fifo)
    p = run_py(
        f"""
        import gdsllm
        try:
            gdsllm.Engine({str(smollm2_dir)!r}, chat_template_file={str(fifo)!r})
        except gdsllm.GdsError as e:
            print("refused:", e)
        """,
        timeout=60,
    )
    assert "refused:" in p.stdout and "FIFO" in p.stdout, p.stdout + p.stderr
    # a regular file, and a link to one, are read
    real = tmp_path / "t.jinja"
    real.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    link = tmp_path / "link.jinja"
    link.symlink_to(real)
    e = gdsllm.Engine(str(smollm2_dir), chat_template_file=link, temperature=0)
    assert "t.jinja" in e.plan["chat_template"] or "link.jinja" in e.plan["chat_template"]


def test_a_template_that_makes_the_engine_panic_is_refused_at_load(smollm2_dir):
    # minijinja panics on this format string; it used to load, print the panic and its
    # backtrace, and fail every reply with "it panicked"
    p = run_py(
        f"""
        import gdsllm
        try:
            gdsllm.Engine({str(smollm2_dir)!r},
                          chat_template='{{{{ "%.999999999f"|format(1.0) }}}}')
        except gdsllm.GdsError as e:
            print("refused:", e)
        """,
        timeout=120,
        RUST_BACKTRACE="1",
    )
    assert "refused:" in p.stdout and "panicked" in p.stdout, p.stdout + p.stderr
    assert "panicked at" not in p.stderr and "backtrace" not in p.stderr.lower(), p.stderr


def test_a_grammar_too_large_to_compile_is_refused_at_once(engine):
    g = "root ::= " + " | ".join(f'"w{i}"' for i in range(100_000))
    t = time.time()
    with pytest.raises(gdsllm.GdsError, match="too large to compile"):
        engine.generate("Hi", max_tokens=2, grammar=g)
    lark = "start: " + " | ".join(f'"w{i}"' for i in range(100_000))
    with pytest.raises(gdsllm.GdsError, match="too large to compile"):
        engine.generate("Hi", max_tokens=2, grammar=lark)
    assert time.time() - t < 10


def test_layer_arguments(smollm2_dir):
    m = gdsllm.open(str(smollm2_dir))
    n = len(m.layers)
    for bad in [-1, n, 2**64, -(2**70)]:
        with pytest.raises(IndexError, match=f"{n} layers"):
            m.load(bad)
    for bad in [1.5, True, None.__class__, b"blk.0"]:
        with pytest.raises(TypeError, match="layer"):
            m.load(bad)
    assert [t.name for t in m.load(1)] == m.layers[1]["tensors"]
    assert [t.name for t in m.load(m.layers[1]["name"])] == m.layers[1]["tensors"]


def test_paths_may_be_path_objects(smollm2_dir):
    path = pathlib.Path(smollm2_dir)
    assert gdsllm.open(path).path == str(smollm2_dir)
    assert gdsllm.resolve(path) == str(smollm2_dir)
    e = gdsllm.Engine(path, threads=2, temperature=0)
    assert e.generate("Hi", max_tokens=2)
    with pytest.raises(TypeError, match="os.PathLike"):
        gdsllm.open(42)


def test_errors_name_the_python_arguments(engine, smollm2_dir):
    with pytest.raises(gdsllm.GdsError, match="^temperature inf must be"):
        engine.generate("Hi", temperature=float("inf"))
    with pytest.raises(gdsllm.GdsError, match="^top_p 2 must be"):
        engine.generate("Hi", top_p=2.0)
    with pytest.raises(gdsllm.GdsError, match="^temperature -1 must be"):
        gdsllm.Engine(str(smollm2_dir), temperature=-1)
    e = gdsllm.Engine(str(smollm2_dir), threads=2, ctx=64, raw=True)
    with pytest.raises(gdsllm.GdsError, match=r"ctx=N") as ex:
        e.generate("hello world " * 100, max_tokens=2)
    assert "--ctx" not in str(ex.value)
