"""Helpers of the reliability suite: a child process under resource limits (``from reliability_helpers import
run_child``); a call on a thread that fails the test when it hangs (``run_bounded``); the symlink swapper of the
race tests (``start_swapper``, ``stop_swapper``, ``tree_signature``)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ChildResult", "run_bounded", "run_child", "start_swapper", "stop_swapper", "tree_signature"]


@dataclass(frozen=True)
class ChildResult:
    """How a child process ended: ``returncode`` (negative: killed by that signal), its output."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


def run_child(
    code: str,
    *,
    address_space: int | None = None,
    max_processes: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    cwd: str | Path | None = None,
) -> ChildResult:
    """Run ``code`` (dedented) in a fresh interpreter, optionally under ``RLIMIT_AS`` (bytes) and
    ``RLIMIT_NPROC`` (threads count against it); a hang is a test failure (``TimeoutExpired``)."""
    limits = []
    if address_space is not None:
        limits.append(f"resource.setrlimit(resource.RLIMIT_AS, ({address_space}, {address_space}))")
    if max_processes is not None:
        limits.append(f"resource.setrlimit(resource.RLIMIT_NPROC, ({max_processes}, {max_processes}))")
    prologue = "import resource\n" + "\n".join(limits) + "\n" if limits else ""
    full_env = dict(os.environ)
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
    return ChildResult(done.returncode, done.stdout, done.stderr)


def run_bounded(call: Callable[[], Any], timeout: float, fifos: Iterable[str | Path] = ()) -> Any:
    """``call()`` on a daemon thread: its result, or its exception raised here. Still running after ``timeout``
    seconds, it fails the test (a hang), after opening each of ``fifos`` for writing (a writer end appears, so a
    reader blocked in ``open()`` on it ends) and waiting ``timeout`` seconds more for the thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(timeout)
        pytest.fail(f"{call} did not return within {timeout} s (hung, e.g. blocked on a special file)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# The racer of the symlink-race tests: exchanges <top>/d with <top>/d-abs, twice (d is the link, then the real
# directory again), then with <top>/d-rel, twice, with renameat2(RENAME_EXCHANGE); errors (top being rebuilt)
# are ignored. Prints "ready" after its first exchange and the number of exchanges when terminated.
_SWAPPER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
top = sys.argv[1].encode()
d, a, r = top + b"/d", top + b"/d-abs", top + b"/d-rel"
n = 0
def stop(*_):
    sys.stdout.write(f"{n}\n"); sys.stdout.flush(); os._exit(0)
signal.signal(signal.SIGTERM, stop)
ready = False
while True:
    for other in (a, a, r, r):
        if libc.renameat2(-100, d, -100, other, 2) == 0:
            n += 1
            if not ready:
                sys.stdout.write("ready\n"); sys.stdout.flush(); ready = True
"""


def start_swapper(top: str | Path) -> subprocess.Popen[str]:
    """Start swapping ``<top>/d`` with ``<top>/d-abs`` and ``<top>/d-rel`` in a separate process; returns once
    the first exchange is done."""
    proc = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(top)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def stop_swapper(proc: subprocess.Popen[str]) -> int:
    """Stop a swapper; return how many exchanges it made."""
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return int(out.strip() or 0)


def tree_signature(top: str | Path) -> dict[str, tuple[Any, ...]]:
    """What lies below ``top`` (no symlinks followed): type, size, content hash and mtime of each entry (a
    FIFO, socket or device by its type and mtime only: reading one could block)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, top)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                out[rel] = ("file", st.st_size, digest, st.st_mtime_ns)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p), st.st_mtime_ns)
            else:
                out[rel] = ("special", stat.S_IFMT(st.st_mode), st.st_mtime_ns)
    return out
