"""One fork-safety mechanism: a real os.fork() child gets fresh state in every object that registered with
sfstore.forks, and the parent keeps its own."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

from sfstore import defaults, forks
from sfstore.buffers import native_available
from sfstore.checkpoint.dcp.directory import CheckpointDir
from sfstore.checkpoint.host_buffers import HostBuffer, LoadBuffers
from sfstore.checkpoint.save import ring_buffers
from sfstore.counters import Counters
from sfstore.engine import Request
from sfstore.engine.python import PythonEngine
from sfstore.paths.beneath import Beneath
from sfstore.paths.file import FilePath
from tests.forked_child import in_forked_child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_a_lock_held_at_fork_is_free_in_the_child() -> None:
    c = Counters(["n"])
    c.add(n=2)
    with c._lock:  # held by the parent at fork, as an I/O thread may hold it
        out = in_forked_child(lambda: (c.add(n=1), {"n": c.snapshot()["n"]})[1])
    assert out == {"n": 3}  # the counts are carried over, the lock is not held
    assert c.snapshot() == {"n": 2}


def test_an_engine_and_its_cache_are_fresh_in_the_child(tmp_path: Path) -> None:
    from sfstore.engine import get_engine

    (tmp_path / "f").write_bytes(b"abcd")
    e = PythonEngine(2, 2)
    e.submit([Request.read(os.open(tmp_path / "f", os.O_RDONLY), 0, 4, bytearray(4))]).get()
    cached = get_engine("python")

    def check() -> dict[str, Any]:
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        buf = bytearray(4)
        e.submit([Request.read(fd, 0, 4, buf)]).get()  # workers of its own: the parent's do not exist here
        return {"read": bytes(buf).decode(), "new_cache_entry": get_engine("python") is not cached}

    assert in_forked_child(check) == {"read": "abcd", "new_cache_entry": True}
    assert get_engine("python") is cached
    e.close()


def test_a_batch_running_at_fork_is_refused_in_the_child() -> None:
    e = PythonEngine(1, 1)
    fd = os.open("/dev/zero", os.O_RDONLY)
    buf = bytearray(1 << 20)
    running = e.submit([Request.read(fd, 0, 1 << 20, buf) for _ in range(2048)])  # through one worker: long

    def check() -> dict[str, Any]:
        try:
            running.wait(0)
        except Exception as exc:
            return {"error": type(exc).__name__}
        return {"error": None, "done": running.done()}

    out = in_forked_child(check)
    assert len(running.get()) == 2048  # the parent's batch finishes in the parent
    # (a batch done before the fork is done in the child too; the one machine that fast would show done)
    assert out == {"error": "EngineUnavailableError"} or out == {"error": None, "done": True}
    os.close(fd)
    e.close()


def test_a_root_descriptor_is_opened_again_in_the_child(tmp_path: Path) -> None:
    b = Beneath(str(tmp_path))
    parent_fd = b.root_fd()

    def check() -> dict[str, Any]:
        fd = b.root_fd()
        return {"new": fd != parent_fd, "same_dir": os.path.samestat(os.fstat(fd), os.stat(tmp_path))}

    assert in_forked_child(check) == {"new": True, "same_dir": True}
    assert b.root_fd() == parent_fd


def test_a_checkpoint_directory_descriptor_is_opened_again_in_the_child(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    ck = CheckpointDir(FilePath(tmp_path), "ck")
    parent_fd = ck.dirfd()

    def check() -> dict[str, Any]:
        fd = ck.dirfd()
        return {"new": fd != parent_fd, "same_dir": os.path.samestat(os.fstat(fd), os.stat(tmp_path / "ck"))}

    assert in_forked_child(check) == {"new": True, "same_dir": True}
    assert ck.dirfd() == parent_fd
    ck.close()


def test_load_buffers_are_the_parents_only() -> None:
    lb = LoadBuffers()
    with lb.session():
        hb = lb.take(1 << 20)  # a session running, a buffer out, at fork
        with lb._lock:  # held at fork, as a load in another thread may hold it
            out = in_forked_child(lambda: {**lb.stats(), "locked": lb._lock.locked()})
        parent = lb.stats()
        hb.release()
    assert out["pools"] == 0 and out["idle_bytes"] == 0 and out["in_use_bytes"] == 0 and out["locked"] is False
    assert parent["pools"] == (1 if native_available()[0] and defaults.get("checkpoint_reuse_buffers") else 0)
    lb.free()


def test_idle_save_buffers_are_the_parents_only() -> None:
    ring_buffers.give_back([HostBuffer(1 << 20)], ok=True)
    kept = ring_buffers.idle_bytes()
    with ring_buffers.lock:  # held at fork, as a save in another thread may hold it
        out = in_forked_child(lambda: {"idle": ring_buffers.idle_bytes(), "locked": ring_buffers.lock.locked()})
    assert out == {"idle": 0, "locked": False}
    assert ring_buffers.idle_bytes() == kept
    assert kept > 0 or not defaults.get("checkpoint_reuse_buffers")
    ring_buffers.free()


def test_a_callback_runs_in_the_child_only_while_its_object_lives() -> None:
    class Thing:
        def __init__(self) -> None:
            self.forked = False
            forks.after_fork(self.reset)

        def reset(self) -> None:
            self.forked = True

    keep, drop = Thing(), Thing()
    seen: list[str] = []
    forks.after_fork(lambda: seen.append("function"))
    count = len(forks._callbacks)
    del drop
    gc.collect()
    assert len(forks._callbacks) <= count - 1  # a dead object's entry leaves
    assert in_forked_child(lambda: {"keep": keep.forked, "seen": seen}) == {"keep": True, "seen": ["function"]}
    assert keep.forked is False and seen == []
