"""Pipe writes after sfstore I/O: sfstore leaves no trace on the caller's threads (issue 14, defect 1).

A thread that sets up, submits to or tears down an io_uring is on that ring's task list; the kernel's deferred
teardown of the ring then queues work to it with ``TWA_SIGNAL``, which interrupts the thread's next blocking
system call once. A blocking ``write`` of a large payload to a slow pipe reader came back short with no error
(65,536 of 624,640 bytes): a ``pipe:`` producer lost data. Here, in a fresh interpreter, every kind of sfstore
I/O (``sf://`` writes, reads and many-file reads, the io_uring probe, every engine created, used and closed) is
followed at once by a large blocking write to a slow reader, which must complete in full every time: 100
rounds in one child, and the first probe or engine of 20 fresh children (37/100 and 20/20 short before the fix).
"""

from __future__ import annotations

import json
from pathlib import Path

from reliability_helpers import run_child

PAYLOAD = 624_640  # the size the defect was found with (bytes)

# Child code of both tests: a blocking write of ``size`` bytes to a pipe whose reader (a thread) takes ``chunk``
# bytes every ``pause`` s, so the writer fills the 64 KiB pipe and blocks many times before the payload is
# through; returns (bytes written, bytes received).
_PIPE_WRITE = r"""
import os, threading, time

def pipe_write(size, pause, chunk):
    r, w = os.pipe()
    got = [0]
    def reader():
        while True:
            time.sleep(pause)
            d = os.read(r, chunk)
            if not d:
                break
            got[0] += len(d)
    t = threading.Thread(target=reader)
    t.start()
    try:
        n = os.write(w, b"y" * size)
    finally:
        os.close(w)
        t.join()
        os.close(r)
    return n, got[0]
"""

_CHILD = _PIPE_WRITE + r"""
import json, os, sys, threading, time

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
PAYLOAD = PAYLOAD_SIZE

import fsspec
from sfstore import _native
from sfstore.engine import Request, get_engine
from sfstore.engine.native import NativeEngine
from sfstore.engine.python import PythonEngine

fs = fsspec.filesystem("sf", skip_instance_cache=True)
scratch = os.path.join(os.environ["SFSTORE_ROOT"], "scratch.bin")

def sf_write(i):
    fs.pipe_file(f"w/{i % 7}.bin", os.urandom(100_000 + i))

def sf_read(i):
    fs.pipe_file("r/one.bin", b"x" * 200_000)
    assert len(fs.cat_file("r/one.bin")) == 200_000

def sf_many(i):
    for k in range(12):
        fs.pipe_file(f"m/{k}.bin", bytes([k]) * (5_000 + k))
    got = fs.cat([f"m/{k}.bin" for k in range(12)])
    assert len(got) == 12

def probe(i):
    ok, why = _native.uring_status()

def engine(name):
    def run(i):
        if name == "python":
            e = PythonEngine(4, 2)
        else:
            e = NativeEngine(name, 4, 2)
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            buf = bytearray(os.urandom(8192))
            e.submit([Request.write(fd, 0, 8192, buf)]).get()
            out = bytearray(8192)
            e.submit([Request.read(fd, 0, 8192, out)]).get()
            assert out == buf
        finally:
            e.close()
            os.close(fd)
    return run

def shared_engine(i):
    e = get_engine()
    fd = os.open(scratch, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        e.submit([Request.write(fd, 0, 4096, bytearray(4096))]).get()
    finally:
        os.close(fd)

ops = [("sf_write", sf_write), ("sf_read", sf_read), ("sf_many", sf_many), ("probe", probe),
       ("uring", engine("uring")), ("threads", engine("threads")), ("python", engine("python")),
       ("shared_engine", shared_engine)]
if not _native.uring_status()[0]:
    ops = [op for op in ops if op[0] != "uring"]

short = []
for i in range(rounds):
    name, op = ops[i % len(ops)]
    op(i)
    n, got = pipe_write(PAYLOAD, 0.0005, 16384)
    if n != PAYLOAD or got != PAYLOAD:
        short.append({"round": i, "after": name, "written": n, "received": got})
print(json.dumps({"rounds": rounds, "ops": [o[0] for o in ops], "short": short}))
"""


def test_large_pipe_writes_complete_after_every_kind_of_sfstore_io(tmp_path: Path, scale: int) -> None:
    rounds = 100 * scale
    root = tmp_path / "root"
    root.mkdir()
    code = _CHILD.replace("ROUNDS", str(rounds)).replace("PAYLOAD_SIZE", str(PAYLOAD))
    env = {"SFSTORE_ROOT": str(root), "SFSTORE_DATA_DIR": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "SFSTORE_CONFIG": ""}
    result = run_child(code, env=env, timeout=120 + 2 * rounds)
    assert result.signal is None, result.stderr
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rounds"] == rounds
    assert report["short"] == [], f"{len(report['short'])}/{rounds} pipe writes came back short: {report['short']}"


_FIRST_IO = _PIPE_WRITE + r"""
import json, os, sys, threading, time
what = sys.argv[1] if len(sys.argv) > 1 else WHAT
if what == "probe":
    from sfstore import _native
    _native.uring_status()  # the first probe of the process: io_uring set up and torn down
else:
    from sfstore.engine import Request, get_engine
    e = get_engine()
    fd = os.open(SCRATCH, os.O_RDWR | os.O_CREAT, 0o644)
    e.submit([Request.write(fd, 0, 4096, bytearray(4096))]).get()
    e.close()
    os.close(fd)
# slower: the write spans a fraction of a second, as a pipe: consumer's does
n, got = pipe_write(PAYLOAD_SIZE, 0.001, 4096)
print(json.dumps({"written": n, "received": got}))
"""


def test_the_first_probe_or_engine_of_a_process_leaves_its_next_pipe_write_whole(tmp_path: Path, scale: int) -> None:
    # Each child is fresh: its first io_uring probe and its first engine are what the defect's reports did.
    short = []
    for trial in range(10 * scale):
        for what in ("probe", "engine"):
            code = (_FIRST_IO.replace("WHAT", repr(what)).replace("SCRATCH", repr(str(tmp_path / "s.bin")))
                    .replace("PAYLOAD_SIZE", str(PAYLOAD)))
            result = run_child(code, env={"SFSTORE_DATA_DIR": str(tmp_path / "data"), "SFSTORE_CONFIG": ""})
            assert result.returncode == 0, result.stderr
            out = json.loads(result.stdout.strip().splitlines()[-1])
            if out != {"written": PAYLOAD, "received": PAYLOAD}:
                short.append((trial, what, out))
    assert short == [], f"{len(short)}/{20 * scale} first writes came back short: {short}"
