"""Memory and threads running out, and interpreter exit: typed errors, never a signal (issue 14, defect 3).

The native engine used to abort the process (SIGABRT, "terminate called ...") when a thread could not start
(64 worker threads of the many-file ``cat`` under ``ulimit -v 500000``) or a bounce buffer could not be mapped
on an engine thread, and an interpreter whose daemon threads came back from a native wait while it finalized
aborted the same way. Each case runs in a child interpreter under ``RLIMIT_AS`` (or ``RLIMIT_NPROC``, as the
unprivileged user ``nobody``): the child must end with status 0 and report a typed
:class:`~sfstore.errors.SfstoreError` carrying ``errno`` (ENOMEM or EAGAIN) where a resource ran out, and the
engine or pool must still work afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reliability_helpers import ChildResult, run_child

from sfstore import _native

AS_LIMIT = 500_000 * 1024  # ulimit -v 500000, as the defect was found

ENGINES = ["threads", "python"] + (["uring"] if _native.uring_status()[0] else [])

# Prepended to every child: reports its outcome as one JSON line.
_PRELUDE = r"""
import errno, json, os, sys
def report(**kw):
    print(json.dumps(kw), flush=True)
def error_fields(exc):
    from sfstore.errors import SfstoreError
    return {"type": type(exc).__name__, "typed": isinstance(exc, SfstoreError),
            "mro": [c.__name__ for c in type(exc).__mro__], "errno": getattr(exc, "errno", None), "msg": str(exc)}
"""


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "root").mkdir(exist_ok=True)  # a configured root must exist
    return {"SFSTORE_ROOT": str(tmp_path / "root"), "SFSTORE_DATA_DIR": str(tmp_path / "data"),
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "SFSTORE_CONFIG": ""}


def _reports(result: ChildResult) -> list[dict]:
    assert result.signal is None, f"killed by signal {result.signal}: {result.stderr[-2000:]}"
    assert result.returncode == 0, result.stderr[-2000:]
    assert "terminate called" not in result.stderr, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _assert_out_of_resources(err: dict, errnos: tuple[int, ...]) -> None:
    assert err["typed"], err
    assert "OutOfResourcesError" in err["mro"] and "MemoryError" in err["mro"], err
    assert err["errno"] in errnos, err


def test_many_file_cat_under_ulimit_v_raises_instead_of_aborting(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    code = _PRELUDE + r"""
import fsspec
fs = fsspec.filesystem("sf", skip_instance_cache=True)
for i in range(20):
    fs.pipe_file(f"d/f{i}", bytes([i]) * 1000)
for attempt in range(3):
    try:
        got = fs.cat([f"d/f{i}" for i in range(20)])
        report(ok=True, n=len(got))
    except Exception as exc:
        report(ok=False, error=error_fields(exc))
# still usable for what fits: one file at a time
report(single=len(fs.cat_file("d/f3")), fallbacks=fs.file_path.fallbacks)
"""
    reports = _reports(run_child(code, address_space=AS_LIMIT, env=_env(tmp_path)))
    outcomes, last = reports[:-1], reports[-1]
    assert len(outcomes) == 3
    for outcome in outcomes:
        # The 64 small-file reader threads do not fit: the main engine reads the files instead, and says so.
        assert outcome == {"ok": True, "n": 20}, outcome
    assert last["single"] == 1000
    assert any("reader threads could not start" in f for f in last["fallbacks"]), last


def test_engine_with_more_threads_than_memory_allows_raises_and_a_smaller_one_works(tmp_path: Path) -> None:
    backend = "threads"
    code = _PRELUDE + rf"""
from sfstore.engine import Request
from sfstore.engine.native import NativeEngine
path = {str(tmp_path / "f.bin")!r}
with open(path, "wb") as f:
    f.write(os.urandom(65536))
# Each thread reserves an 8 MiB stack and (threads backend) a malloc arena: 1024 of them cannot fit in 500 MB.
for attempt in range(3):
    try:
        e = NativeEngine("threads", 4, 1024)
        report(ok=True)
        e.close()
    except Exception as exc:
        report(ok=False, error=error_fields(exc))
e = NativeEngine({backend!r}, 4, 2)
fd = os.open(path, os.O_RDONLY)
buf = bytearray(65536)
n = e.submit([Request.read(fd, 0, 65536, buf)]).get()
with open(path, "rb") as f:
    report(after=n, same=bytes(buf) == f.read())
e.close()
"""
    reports = _reports(run_child(code, address_space=AS_LIMIT, env=_env(tmp_path)))
    for outcome in reports[:3]:
        assert not outcome["ok"], outcome
        _assert_out_of_resources(outcome["error"], (11, 12))
    assert reports[-1] == {"after": [65536], "same": True}


@pytest.mark.parametrize("backend", ENGINES)
def test_bounce_buffer_that_cannot_be_mapped_fails_the_request_not_the_process(tmp_path: Path, backend: str) -> None:
    code = _PRELUDE + rf"""
from sfstore import defaults
from sfstore.engine import Request
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine
path = {str(tmp_path / "d.bin")!r}
data = os.urandom(1 << 20)
with open(path, "wb") as f:
    f.write(data)
fd = os.open(path, os.O_RDWR | os.O_DIRECT)
make = (lambda: PythonEngine(4, 2)) if {backend!r} == "python" else (lambda: NativeEngine({backend!r}, 4, 2))
# A 1 GiB bounce buffer cannot be mapped under a 500 MB address space: the misaligned read needs one.
with defaults.set(bounce_buffer_size=1 << 30):
    e = make()
    buf = bytearray(5000)
    for attempt in range(3):
        try:
            got = e.submit([Request.read(fd, 1, 5000, buf)]).get()
            report(ok=True, got=got)
        except Exception as exc:
            report(ok=False, error=error_fields(exc))
    # Aligned requests need no bounce buffer: the same engine still works.
    import mmap
    aligned = mmap.mmap(-1, 1 << 16)
    got = e.submit([Request.read(fd, 0, 1 << 16, aligned)]).get()
    report(after=got, same=aligned[:] == data[: 1 << 16])
    e.close()
"""
    reports = _reports(run_child(code, address_space=AS_LIMIT, env=_env(tmp_path)))
    for outcome in reports[:3]:
        assert not outcome["ok"], outcome
        _assert_out_of_resources(outcome["error"], (12,))
    assert reports[-1] == {"after": [1 << 16], "same": True}


def test_registered_buffers_beyond_the_address_space_raise_and_the_pool_recovers(tmp_path: Path) -> None:
    code = _PRELUDE + r"""
from sfstore.buffers import RegisteredBufferPool
pool = RegisteredBufferPool(128 << 20, mlock="off", huge_pages="off", cuda_register="off")
held, errors_seen = [], []
for i in range(12):  # 1.5 GiB asked for under 500 MB
    try:
        held.append(pool.acquire(timeout=0))
    except Exception as exc:
        errors_seen.append(error_fields(exc))
report(held=len(held), errors=errors_seen)
for b in held:
    b.release()
pool.keep_idle(0)
b = pool.acquire(timeout=0)
b[0:4096]  # a working buffer again
report(after=len(b))
b.release()
pool.close()
"""
    reports = _reports(run_child(code, address_space=AS_LIMIT, env=_env(tmp_path)))
    first, last = reports
    assert first["held"] < 12 and len(first["errors"]) == 12 - first["held"]
    for err in first["errors"]:
        _assert_out_of_resources(err, (12,))
    assert last == {"after": 128 << 20}


def test_thread_limit_as_an_unprivileged_user_raises_eagain(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to the user nobody (root ignores RLIMIT_NPROC)")
    code = _PRELUDE + rf"""
import threading
from sfstore.engine import Request
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine
path = {str(tmp_path / "n.bin")!r}
with open(path, "wb") as f:
    f.write(b"z" * 8192)
fd = os.open(path, os.O_RDONLY)
probe_ok = NativeEngine.__module__ and __import__("sfstore")._native.uring_status()[0]
os.setgid(65534)
os.setuid(65534)  # RLIMIT_NPROC (set by run_child) now binds: a few threads at most
engines = [("threads", lambda: NativeEngine("threads", 4, 64)), ("python", lambda: PythonEngine(64, 64))]
if probe_ok:
    engines.append(("uring", lambda: NativeEngine("uring", 4, 1)))
for name, make in engines:
    outcomes = []
    for attempt in range(2):
        try:
            e = make()
            bufs = [bytearray(4096) for _ in range(64)]
            e.submit([Request.read(fd, 0, 4096, b) for b in bufs]).get()
            e.close()
            outcomes.append({{"ok": True}})
        except Exception as exc:
            outcomes.append({{"ok": False, "error": error_fields(exc)}})
    report(engine=name, outcomes=outcomes)
# hold the limit's threads, so that even one more cannot start
stop = threading.Event()
holders = []
while True:
    try:
        t = threading.Thread(target=stop.wait)
        t.start()
        holders.append(t)
    except RuntimeError:
        break
try:
    NativeEngine("uring" if probe_ok else "threads", 4, 1)
    report(last={{"ok": True}})
except Exception as exc:
    report(last={{"ok": False, "error": error_fields(exc)}})
stop.set()
for t in holders:
    t.join()
"""
    reports = _reports(run_child(code, max_processes=6, env=_env(tmp_path)))
    by_engine = {r["engine"]: r["outcomes"] for r in reports if "engine" in r}
    assert by_engine["threads"] and by_engine["python"]
    for outcome in by_engine["threads"]:
        assert not outcome["ok"]
        _assert_out_of_resources(outcome["error"], (11,))
    for outcome in by_engine["python"]:
        # The python engine starts its workers as work arrives: with some started it runs on fewer.
        assert outcome["ok"] or outcome["error"]["typed"], outcome
    last = reports[-1]["last"]
    assert not last["ok"]
    _assert_out_of_resources(last["error"], (11,))


_EXIT_CHILD = _PRELUDE + r"""
import sys, threading, time, types
from sfstore import _native
from sfstore.buffers import RegisteredBufferPool
from sfstore.engine import Request, get_engine
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine

path = sys.argv[1] if len(sys.argv) > 1 else PATH
with open(path, "wb") as f:
    f.write(os.urandom(1 << 20))
fd = os.open(path, os.O_RDWR)
live = [get_engine(), PythonEngine(4, 2), NativeEngine("threads", 4, 4)]
if _native.uring_status()[0]:
    live.append(NativeEngine("uring", 8, 1))
futures = [e.submit([Request.read(fd, 0, 1 << 20, bytearray(1 << 20))]) for e in live]  # left in flight
pool = RegisteredBufferPool(1 << 20, max_buffers=1, mlock="off", cuda_register="off")
held = [pool.acquire()]
views = [memoryview(held[0])]

# Daemon threads come back from native waits while the interpreter finalizes (the GIL is then refused).
def waiter():
    b = pool.acquire(timeout=30)
    b.release()
def engine_waiter(e):
    from sfstore.errors import SfstoreError
    while True:
        buf = bytearray(1 << 20)
        try:
            e.submit([Request.read(fd, 0, 1 << 20, buf)]).results()
        except SfstoreError:  # e.g. the python engine's workers are shut down at exit: typed, and the end
            return
for _ in range(2):
    threading.Thread(target=waiter, daemon=True).start()
for e in live:
    threading.Thread(target=engine_waiter, args=(e,), daemon=True).start()

class LateRelease:  # dropped during interpreter teardown, after the interpreter stopped handing out the GIL
    def __del__(self, held=held, views=views, time=time):
        views.pop().release()
        held.pop().release()
        time.sleep(0.3)
mod = types.ModuleType("zz_late_release")
mod.obj = LateRelease()
sys.modules["zz_late_release"] = mod

if FORK:
    pid = os.fork()
    if pid == 0:
        # The child inherits engines whose threads do not exist here; it gets a fresh one and exits normally.
        e = get_engine()
        buf = bytearray(4096)
        e.submit([Request.read(fd, 0, 4096, buf)]).get()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    report(child_status=status)
time.sleep(0.05)
report(done=True)
"""


@pytest.mark.parametrize("fork", [False, True], ids=["plain", "after-fork"])
def test_interpreter_exit_with_live_engines_pools_and_native_waits_is_clean(
    tmp_path: Path, scale: int, fork: bool
) -> None:
    code = _EXIT_CHILD.replace("PATH", repr(str(tmp_path / "exit.bin"))).replace("FORK", str(fork))
    for trial in range(3 * scale):
        result = run_child(code, env=_env(tmp_path), timeout=60)
        reports = _reports(result)
        assert result.stderr == "", f"trial {trial}: {result.stderr[-2000:]}"
        assert reports[-1] == {"done": True}
        if fork:
            assert reports[0] == {"child_status": 0}


@pytest.mark.parametrize("backend", ENGINES)
def test_a_batch_running_at_fork_is_refused_in_the_child_which_exits_cleanly(tmp_path: Path, backend: str) -> None:
    code = _PRELUDE + rf"""
import sys
from sfstore.engine import Request
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine
e = PythonEngine(1, 1) if {backend!r} == "python" else NativeEngine({backend!r}, 1, 1)
fd = os.open("/dev/zero", os.O_RDONLY)
buf = bytearray(32 << 20)
done_before = e.submit([Request.read(fd, 0, 4096, buf)])
done_before.get()
# 64 reads of 32 MiB through one queue slot: still running when the child starts
running = e.submit([Request.read(fd, 0, 32 << 20, buf) for _ in range(64)])
pid = os.fork()
if pid == 0:
    out = {{}}
    try:
        running.wait(0)
        out["running"] = "no error"
    except Exception as exc:
        out["running"] = error_fields(exc)
    out["done_before"] = done_before.get(0)
    report(**out)
    sys.exit(0)  # a normal exit: the running batch's future is dropped here, and must not wait for it
_, status = os.waitpid(pid, 0)
report(child_status=status, parent=len(running.get()))
"""
    reports = _reports(run_child(code, env=_env(tmp_path), timeout=60))
    child, parent = reports
    assert parent == {"child_status": 0, "parent": 64}
    assert child["done_before"] == [4096]
    if child["running"] != "no error":  # the batch may have finished before fork on a fast machine
        assert child["running"]["type"] == "EngineUnavailableError", child
