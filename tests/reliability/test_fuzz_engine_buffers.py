"""Fuzzing the I/O engines' and the registered buffer pool's public arguments (issue 14, defects 3 and 8).

Random batches go to every engine (``uring``, ``threads``, ``python``): huge, negative and odd-typed offsets,
lengths and buffer offsets, closed descriptors and descriptors of FIFOs, directories, sockets and ``/dev/null``,
``O_DIRECT`` descriptors with misaligned requests (bounce buffers on and off), read-only and released buffers,
zero-length and huge batches, ops that are not ``"read"``/``"write"`` (a lone surrogate among them), checksum
lists of the wrong length or type, and waits with negative, NaN and infinite timeouts. Random pools get odd
sizes, counts and modes and are acquired from, sliced, viewed and released (twice, with views alive). The
loop runs in a child interpreter (a crash is a signal there, a hang its timeout) under ``RLIMIT_AS``, so that
valid but enormous allocations fail instead of taking the machine's memory.

Expected: 0 crashes, 0 hangs (every wait is bounded), every error an :class:`~sfstore.errors.SfstoreError`,
and every read that succeeds on the reference file returns its bytes. The seed is printed with any failure;
``SFSTORE_FUZZ_SEED`` replays one. Iterations at scale 1: 1,000 batches per engine (3,000 in all, about
750,000 requests with the occasional 20,000-request batch) and 2,000 pool operations.
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import threading
from pathlib import Path

import pytest
from reliability_helpers import run_child

from sfstore import _native, defaults, errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.engine import IOEngine, Request, get_engine
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine

_CHILD = r'''
import errno, json, math, mmap, os, random, socket, sys, time, traceback
import numpy as np

from sfstore import _native, defaults, errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.engine import Request
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine

SEED, SCALE, TMP, DEADLINE = @ARGS@
rng = random.Random(SEED)
failures = []
counts = {"batches": 0, "requests": 0, "ok": 0, "typed_errors": 0, "verified_reads": 0, "pool_ops": 0,
          "engines_made": 0, "engines_refused": 0}
START = time.monotonic()

def finish(hung=False):
    print(json.dumps({"seed": SEED, "seconds": round(time.monotonic() - START, 1), "counts": counts,
                      "failures": failures[:25], "n_failures": len(failures)}), flush=True)
    if hung:  # the hung batch's future would wait for it at exit
        os._exit(0)

import faulthandler
faulthandler.dump_traceback_later(DEADLINE, exit=True)  # a hang anywhere else: the stacks, then exit

def fail(what, exc=None):
    entry = {"what": what[:500]}
    if exc is not None:
        entry["exc"] = repr(exc)[:500]
        entry["trace"] = "".join(traceback.format_exception(exc))[-1500:]
    failures.append(entry)

def call(what, fn):
    """(True, value) or (False, typed error); anything else is recorded as a failure."""
    try:
        return True, fn()
    except errors.SfstoreError as exc:
        counts["typed_errors"] += 1
        return False, exc
    except Exception as exc:
        fail(what, exc)
        return False, exc

# -- descriptors ------------------------------------------------------------------------------------------------
ref_path = os.path.join(TMP, "ref.bin")
REF = os.urandom(3 * 65536 + 123)
with open(ref_path, "wb") as f:
    f.write(REF)
scratch_path = os.path.join(TMP, "scratch.bin")
open(scratch_path, "wb").close()
fifo_path = os.path.join(TMP, "fifo")
os.mkfifo(fifo_path)
s1, s2 = socket.socketpair()
fds = {
    "ref_ro": os.open(ref_path, os.O_RDONLY),
    "ref_direct": os.open(ref_path, os.O_RDONLY | os.O_DIRECT),
    "scratch_rw": os.open(scratch_path, os.O_RDWR),
    "scratch_direct": os.open(scratch_path, os.O_RDWR | os.O_DIRECT),
    "scratch_wo": os.open(scratch_path, os.O_WRONLY),
    "fifo": os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK),
    "dir": os.open(TMP, os.O_RDONLY | os.O_DIRECTORY),
    "socket": s1.fileno(),
    "devnull": os.open("/dev/null", os.O_RDWR),
}
closed = os.open(ref_path, os.O_RDONLY)
os.close(closed)
FD_CHOICES = list(fds.values()) + [closed, -1, 2**31, 2**63, 10**30, 1.0, "3", None, True]
REF_FDS = {fds["ref_ro"], fds["ref_direct"]}

# -- buffers ----------------------------------------------------------------------------------------------------
pool = RegisteredBufferPool(1 << 20, mlock="off", cuda_register="off")
released = pool.acquire(timeout=0)
released.release()
def a_buffer():
    kind = rng.randrange(14)
    n = rng.choice([0, 1, 511, 4096, 5000, 65536, 200000])
    if kind == 0: return bytearray(n)
    if kind == 1: return bytes(n)                                  # read-only
    if kind == 2: return memoryview(bytes(n))                      # read-only view
    if kind == 3: return np.zeros(n, np.uint8)
    if kind == 4: return np.zeros(max(n, 2), np.uint8)[::2]        # not contiguous
    if kind == 5: return np.zeros((max(n // 8, 1), 2), np.float32)
    if kind == 6: return mmap.mmap(-1, max(n, 1))
    if kind == 7: return pool.acquire(timeout=1)
    if kind == 8: return released
    if kind == 9: return rng.choice(["text", None, 5, [1, 2], object(), b"abc"])
    if kind == 10: return memoryview(bytearray(n + 64))[rng.randrange(64):]   # misaligned
    if kind == 11: return memoryview(mmap.mmap(-1, 1 << 20))[: rng.choice([4096, 65536, 1 << 20])]
    if kind == 12: return bytearray(1 << 20)
    return np.zeros(n, np.uint8)[: n // 2]

BIG = [2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
def an_int(small):
    r = rng.random()
    if r < 0.7: return rng.choice(small)
    if r < 0.85: return rng.choice(BIG + [-1, -4096, -2**63, -2**64])
    return rng.choice([1.5, "0", None, True, b"1", np.int64(512), float("nan")])

def a_request():
    op = rng.choice(["read"] * 6 + ["write"] * 4 + ["READ", "", "\udcff", "re\udcffad", None, 1, b"read", "write\x00"])
    buf = a_buffer()
    fd = rng.choice(FD_CHOICES)
    offset = an_int([0, 1, 511, 512, 4096, 65536, 3 * 65536, len(REF), len(REF) + 1, 10**9])
    length = an_int([0, 1, 511, 512, 4096, 5000, 65536, 200000, 1 << 20])
    shape = rng.random()
    if shape < 0.5:
        return (op, fd, offset, length, buf)
    if shape < 0.9:
        return (op, fd, offset, length, buf, an_int([0, 1, 100, 511, 4096, 65536, 1 << 20]))
    return rng.choice([(op, fd, offset), (op, fd, offset, length, buf, 0, 0), [op, fd, offset, length, buf],
                       "read", None, 7, {"op": op}])

def valid_read():
    """A request that must succeed: a read of the reference file into a fresh buffer."""
    fd = rng.choice(sorted(REF_FDS))
    offset = rng.randrange(0, len(REF) + 10)
    length = rng.randrange(0, 70000)
    pad = rng.randrange(0, 600)
    return ("read", fd, offset, length, bytearray(length + pad), pad)

def a_checksum_list(n):
    r = rng.random()
    if r < 0.6: return None
    if r < 0.75: return [rng.choice([None, 0, 1, 2**64 - 1]) for _ in range(n)]
    return rng.choice([[None] * (n + 1), [], "x" * n, 5, [1.5] * n, [-1] * n, [2**70] * n, [True] * n,
                       [None] * max(n - 1, 0), (None for _ in range(n))])

TIMEOUTS = [None, 0, 0.001, 5, -5, float("nan"), float("inf"), -float("inf"), "1", True, 1e300, 2**80]

def make_engine(name):
    qd = rng.choice([1, 2, 4, 32] * 4 + [0, -1, 2**32, 16385, 1.5, "4", None])
    th = rng.choice([1, 2, 4] * 4 + [0, -1, 2**32, 1025, 2.0, None])
    ok, e = call(f"make {name} qd={qd!r} th={th!r}",
                 lambda: PythonEngine(qd, th) if name == "python" else NativeEngine(name, qd, th))
    counts["engines_made" if ok else "engines_refused"] += 1
    return e if ok else None

def run_batch(engine, name, it):
    n = rng.choice([0, 1, 1, 2, 3, 5, 8])
    p_valid = rng.choice([0.3, 1.0])  # half the batches are all valid reads: they must succeed, bytes checked
    reqs = [valid_read() if rng.random() < p_valid else a_request() for _ in range(n)]
    if rng.random() < 0.02:  # a huge batch of valid reads
        reqs = [("read", fds["ref_ro"], i % len(REF), 1, bytearray(1)) for i in range(rng.choice([5000, 20000]))]
        p_valid = 1.0
    if rng.random() < 0.03:  # not a sequence of requests at all
        odd = rng.choice([None, "read", b"x", 5, {"a": 1}, (r for r in [valid_read()]), valid_read()])
        call(f"submit odd batch {type(odd).__name__}", lambda: engine.submit(odd))
        return
    sums = a_checksum_list(len(reqs))
    shown = [r if not isinstance(r, tuple) else tuple(type(x).__name__ if i == 4 else x for i, x in enumerate(r))
             for r in reqs[:8]]
    desc = f"{name} it={it} reqs={shown!r} sums={sums if not isinstance(sums, list) else sums[:8]!r}"
    counts["batches"] += 1
    counts["requests"] += len(reqs)
    bounce = rng.random() < 0.85
    with defaults.set(bounce=bounce):
        ok, fut = call("submit " + desc, lambda: engine.submit(reqs, checksums=sums) if sums is not None
                       else engine.submit(reqs))
    must = p_valid == 1.0 and sums is None and bounce  # nothing wrong in it: it must succeed
    if not ok:
        if must:
            fail(f"a valid batch was refused: {fut!r} " + desc)
        return
    timeout = rng.choice(TIMEOUTS)
    call(f"wait({timeout!r}) " + desc, lambda: fut.wait(timeout) if timeout is None or (
        isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 <= timeout < 10) else fut.wait(0.001))
    if not fut.wait(30):
        fail("hang: batch not done after 30 s " + desc)
        finish(hung=True)
    ok, res = call("results " + desc, lambda: fut.results(0))
    call("get " + desc, lambda: fut.get(0))
    if not ok:
        return
    if must and any(r < 0 for r in res):
        fail(f"a valid batch failed: {[r for r in res if r < 0][:5]} " + desc)
    counts["ok"] += 1
    bufs = [r[4] for r in reqs]
    distinct = len({id(b) for b in bufs}) == len(bufs)
    for r, got in zip(reqs, res):
        if got >= 0 and r[0] == "read" and r[1] in REF_FDS and distinct and isinstance(r[4], bytearray):
            boff = r[5] if len(r) > 5 else 0
            want = REF[r[2]: r[2] + r[3]]
            if (sums is None or got == r[3]) and bytes(r[4][boff: boff + got]) != want[:got]:
                fail(f"wrong bytes: request {r[:4]} boff={boff} got {got} " + desc)
            counts["verified_reads"] += 1
    for b in bufs:
        if isinstance(b, _native.Buffer) and b is not released and not b.released and b.exports == 0:
            b.release()

# -- engines ----------------------------------------------------------------------------------------------------
names = ["python", "threads"] + (["uring"] if _native.uring_status()[0] else [])
per_engine = 1000 * SCALE
for name in names:
    engine = None
    for it in range(per_engine):
        if engine is None or rng.random() < 0.01:
            if engine is not None:
                call("close", engine.close)
                ok, exc = call("submit after close", lambda: engine.submit([valid_read()]))
                if ok or not isinstance(exc, errors.EngineUnavailableError):
                    fail(f"{name}: submit on a closed engine gave {exc!r}")
            engine = None
            while engine is None:
                engine = make_engine(name)
        run_batch(engine, name, it)
    if engine is not None:
        engine.close()

# -- pools ------------------------------------------------------------------------------------------------------
SIZES = [None, 4096, 65536, 1 << 20, 2 << 20, 16 << 30, 0, -1, 1, 4095, 2**40, 2**64, 1.5, "4096", "64k", True]
COUNTS = [None, 1, 2, 3, 0, -1, 2**64, 1.5, "2", True]
MODES = [None, "auto", "off", "on", "maybe", 1]
pools = []
for it in range(2000 * SCALE):
    counts["pool_ops"] += 1
    if not pools or rng.random() < 0.08:
        size, most = rng.choice(SIZES), rng.choice(COUNTS)
        huge, lock, cuda = rng.choice(MODES), rng.choice(MODES), rng.choice(MODES)
        ok, p = call(f"pool({size!r}, max_buffers={most!r}, {huge!r}, {lock!r}, {cuda!r})",
                     lambda: RegisteredBufferPool(size, max_buffers=most, huge_pages=huge, mlock=lock,
                                                  cuda_register=cuda))
        if ok:
            pools.append({"pool": p, "max": most if isinstance(most, int) and not isinstance(most, bool) else None,
                          "out": [], "views": []})
        continue
    entry = rng.choice(pools)
    p, out = entry["pool"], entry["out"]
    op = rng.random()
    if op < 0.4:
        full = entry["max"] is not None and len(out) >= entry["max"]
        # waits without end (or of 2**80 s) only where a buffer is free: otherwise waiting is what was asked for
        choices = [0, 0.001, -5, float("nan"), "1", True] + ([] if full else [None, float("inf"), 1e300, 2**80, 1])
        timeout = rng.choice(choices)
        t0 = time.monotonic()
        ok, b = call(f"acquire({timeout!r}) full={full}", lambda: p.acquire(timeout=timeout))
        if time.monotonic() - t0 > 10:
            fail(f"acquire({timeout!r}) took {time.monotonic() - t0:.1f} s")
        if ok:
            out.append(b)
            if len(b) != p.buffer_size:
                fail(f"buffer of {len(b)} bytes from a pool of {p.buffer_size}")
    elif op < 0.6 and out:
        b = rng.choice(out)
        call("release", b.release)
        call("double release", b.release)
        if b.released:
            out.remove(b)
    elif op < 0.7 and out:
        b = rng.choice(out)
        ok, v = call("view", lambda: memoryview(b))
        if ok:
            entry["views"].append(v)
            ok2, exc = call("release with a view", b.release)
            if ok2 and not b.released:
                fail("release with a live view neither refused nor released")
    elif op < 0.8 and out:
        b = rng.choice(out)
        start, stop = rng.choice([0, 1, -1, 10**20, None]), rng.choice([0, 5, 4096, -3, 10**20, None])
        step = rng.choice([None, None, 1, 2, -1])
        ok, s = call(f"slice [{start!r}:{stop!r}:{step!r}]", lambda: b[start:stop:step])
        if ok:
            entry["views"].append(s)
    elif op < 0.88:
        for v in entry["views"]:
            call("drop view", v.release)
        entry["views"].clear()
    elif op < 0.95:
        n = rng.choice([None, 0, 1, 5, -1, 1.5, 2**64, "2"])
        call(f"keep_idle({n!r})", lambda: p.keep_idle(n))
    else:
        call("stats", p.stats)
        if rng.random() < 0.3:
            call("close", p.close)
            ok, exc = call("acquire after close", lambda: p.acquire(timeout=0))
            if ok:
                fail("acquire on a closed pool succeeded")
            for v in entry["views"]:
                call("drop view", v.release)
            for b in out:
                call("release after close", b.release)
            pools.remove(entry)

finish()
'''


def test_fuzz_engines_and_buffer_pools(tmp_path: Path, scale: int) -> None:
    seed = int(os.environ.get("SFSTORE_FUZZ_SEED") or random.randrange(1 << 30))
    work = tmp_path / "fuzz"
    work.mkdir()
    (tmp_path / "root").mkdir()  # a configured root must exist
    timeout = 180 + 120 * scale
    result = run_child(
        _CHILD.replace("@ARGS@", f"{seed}, {scale}, {str(work)!r}, {timeout - 30}"),
        address_space=6 << 30,
        env={"SFSTORE_ROOT": str(tmp_path / "root"), "SFSTORE_DATA_DIR": str(tmp_path / "data"),
             "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "SFSTORE_CONFIG": "", "PYTHONFAULTHANDLER": "1"},
        timeout=timeout,
    )
    assert result.signal is None, f"seed {seed}: the fuzz child died of signal {result.signal}: {result.stderr[-3000:]}"
    assert result.returncode == 0, f"seed {seed}: {result.stderr[-3000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"fuzz seed {seed}: {report['counts']} in {report['seconds']} s")
    assert report["n_failures"] == 0, (
        f"seed {seed} (replay: SFSTORE_FUZZ_SEED={seed}): {report['n_failures']} failures, first: "
        + json.dumps(report["failures"], indent=1)
    )
    assert report["counts"]["ok"] > 0 and report["counts"]["typed_errors"] > 0


# -- the cases the adversarial run named, one by one ------------------------------------------------------------

ENGINES = ["python", "threads"] + (["uring"] if _native.uring_status()[0] else [])


def _engine(name: str) -> IOEngine:
    return PythonEngine(4, 2) if name == "python" else NativeEngine(name, 4, 2)


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("op", ["\udcff", "re\udcffad", "read\x00", b"read", None])
def test_an_op_that_is_not_read_or_write_is_a_typed_error(tmp_path: Path, name: str, op: object) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        with _engine(name) as engine, pytest.raises(errors.InvalidRequestError, match="op must be"):
            engine.submit([(op, fd, 0, 4, bytearray(4))])  # native code left a pending exception: SystemError
    finally:
        os.close(fd)


@pytest.mark.parametrize("timeout", [-5, -0.001, float("nan"), "1", True])
def test_acquire_with_a_bad_timeout_is_refused_not_a_wait_forever(timeout: object) -> None:
    pool = RegisteredBufferPool(4096, max_buffers=1, mlock="off", cuda_register="off")
    held = pool.acquire()
    outcome: list[BaseException | None] = []

    def take() -> None:
        try:
            pool.acquire(timeout=timeout)  # type: ignore[arg-type]
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    worker.join(5)
    assert outcome, f"acquire(timeout={timeout!r}) still waiting after 5 s"
    assert isinstance(outcome[0], errors.InvalidRequestError) and "timeout" in str(outcome[0])
    held.release()
    pool.close()


@pytest.mark.parametrize("size", [0, -1, 1, 4095, 2**40, 2**64, 1.5])
def test_pool_buffer_size_out_of_range_is_refused_naming_it(size: object) -> None:
    with pytest.raises(errors.ConfigError, match="buffer_size"):
        RegisteredBufferPool(size)  # type: ignore[arg-type]  # 0 silently meant 8 MiB


def test_pool_buffer_size_none_is_the_setting() -> None:
    with RegisteredBufferPool(None, mlock="off", cuda_register="off") as pool:
        assert pool.buffer_size == defaults.get("buffer_size")


@pytest.mark.parametrize("count", [0, -1, 1.5, "2", True])
def test_pool_max_buffers_out_of_range_is_refused_naming_it(count: object) -> None:
    with pytest.raises(errors.InvalidRequestError, match="max_buffers"):
        RegisteredBufferPool(4096, max_buffers=count)  # type: ignore[arg-type]


@pytest.mark.parametrize(("argument", "args"), [
    ("queue_depth", ("threads", 2**32, 1, 4096, 0)),
    ("queue_depth", ("uring", 0, 1, 4096, 0)),
    ("threads", ("threads", 1, 2**32, 4096, 0)),
    ("threads", ("threads", 1, -1, 4096, 0)),
    ("bounce_buffer_size", ("threads", 1, 1, 2**64, 0)),
    ("spin_us", ("uring", 1, 1, 4096, 2**32)),
    ("spin_us", ("uring", 1, 1, 4096, -1)),
    ("backend", ("\udcff", 1, 1, 4096, 0)),
])
def test_native_engine_arguments_out_of_range_are_refused_naming_them(argument: str, args: tuple) -> None:
    with pytest.raises(errors.InvalidRequestError, match=argument):
        _native.IOEngine(*args)  # was a nanobind TypeError naming nothing


@pytest.mark.parametrize(("queue_depth", "threads", "argument"), [
    (2**32, 2, "queue_depth"), (4, 2**32, "io_threads"), (0, 2, "queue_depth"), (4, 1.5, "io_threads"),
])
@pytest.mark.parametrize("name", ["threads", "uring", "python"])
def test_engine_constructors_refuse_out_of_range_values_naming_them(
    name: str, queue_depth: object, threads: object, argument: str
) -> None:
    with pytest.raises(errors.ConfigError, match=argument):
        if name == "python":
            PythonEngine(queue_depth, threads)  # type: ignore[arg-type]
        else:
            NativeEngine(name, queue_depth, threads)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match=argument):
        get_engine(name, queue_depth=queue_depth, threads=threads)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ENGINES)
def test_requests_on_streams_end_with_espipe_in_every_engine(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r, w = os.pipe()
    s1, s2 = socket.socketpair()
    fds = [os.open(fifo, os.O_RDWR), os.open(fifo, os.O_RDWR | os.O_NONBLOCK), r, s1.fileno(),
           os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)]
    try:
        with _engine(name) as engine:
            for fd in fds:
                future = engine.submit([Request.read(fd, 0, 16, bytearray(16))])
                assert future.wait(5), f"{name}: a read of fd {fd} ({os.readlink(f'/proc/self/fd/{fd}')}) hangs"
                with pytest.raises(errors.IOEngineError) as info:
                    future.get(0)
                assert info.value.errno == errno.ESPIPE
            future = engine.submit([Request.write(w, 0, 3, b"abc")])
            assert future.wait(5)
            assert future.results(0) == [-errno.ESPIPE]
    finally:
        for fd in [*fds[:2], fds[4], fds[5], r, w]:
            os.close(fd)
        s1.close()
        s2.close()


@pytest.mark.parametrize("name", ENGINES)
def test_a_closed_engine_says_so(tmp_path: Path, name: str) -> None:
    engine = _engine(name)
    engine.close()
    with pytest.raises(errors.EngineUnavailableError):
        engine.submit([])


def test_native_open_beneath_takes_undecodable_names_and_refuses_nul(tmp_path: Path) -> None:
    raw = os.fsencode("caf\udce9")  # the byte 0xe9: not UTF-8, as os.listdir hands it back
    (tmp_path / os.fsdecode(raw)).write_bytes(b"x")
    dirfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in (os.fsdecode(raw), raw):  # str with a surrogate escape (was a nanobind TypeError), bytes
            fd = _native.open_beneath(dirfd, name, os.O_RDONLY)
            assert os.read(fd, 4) == b"x"
            os.close(fd)
        with pytest.raises(FileNotFoundError):
            _native.open_beneath(dirfd, "missing\udcff", os.O_RDONLY)
        with pytest.raises(errors.InvalidRequestError, match="path"):
            _native.open_beneath(dirfd, "a\x00b", os.O_RDONLY)
    finally:
        os.close(dirfd)
