"""Helpers of the reliability suite: a child process under resource limits (``from reliability_helpers import
run_child``); a call on a thread that fails the test when it hangs (``run_bounded``); the symlink swapper of the
race tests (``start_swapper``, ``stop_swapper``, ``tree_signature``), the root they race in (``RaceRoot``), their
race loop and its checks (``race``, ``check_race``, ``Tally``, ``Miss``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sfstore import errors

__all__ = [
    "ChildResult", "Miss", "RaceRoot", "Tally", "check_race", "race", "run_bounded", "run_child", "start_swapper",
    "stop_swapper", "tree_signature",
]


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


@dataclass
class RaceRoot:
    """A root whose ``top/d`` is being swapped for a symlink to ``outside`` (``baseline``: what ``outside``
    holds). A race test's scene extends it with :meth:`build_top` (a new top made in :meth:`new_top` and put in
    place by :meth:`replace_top`) and :meth:`outside_changed`."""

    root: Path
    outside: Path
    baseline: dict[str, tuple[Any, ...]] = field(default_factory=dict, kw_only=True)
    generation: int = field(default=0, kw_only=True)

    @property
    def top(self) -> Path:
        return self.root / "top"

    def new_top(self) -> Path:
        """The name of the next ``top``, to build ``d`` in before :meth:`replace_top`."""
        self.generation += 1
        return self.root / f".top-new-{self.generation}"

    def replace_top(self, new: Path) -> None:
        """Give ``new`` the links ``d-abs`` and ``d-rel`` to ``outside``, and put it in place of ``top``
        atomically (the old one is removed)."""
        os.symlink(self.outside, new / "d-abs")
        os.symlink(os.path.relpath(self.outside, self.top), new / "d-rel")
        if self.top.exists():
            trash = self.root / f".top-old-{self.generation}"
            os.rename(self.top, trash)
            # fd-based on Linux: never follows the links being swapped. An exchange that resolved ``top`` before
            # the rename may still land in ``trash`` just after it, so retry what that disturbs.
            for _ in range(100):
                try:
                    shutil.rmtree(trash)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    continue
        os.rename(new, self.top)

    def build_top(self) -> None:
        """(Re)build ``top``: the real directory ``d``, the links ``d-abs`` and ``d-rel``; atomically."""
        raise NotImplementedError

    def outside_changed(self) -> bool:
        """Whether anything outside changed; if so, put it back (so the next change is seen too)."""
        raise NotImplementedError


class Miss(Exception):
    """Raised by a raced operation that did not reach the inside data (a swap made it miss): not a success."""


@dataclass
class Tally:
    """What a race counted."""

    calls: int = 0
    ok: int = 0
    ok_walked: int = 0  # of ``ok``: calls made with openat2 switched off
    escapes: int = 0
    refused: int = 0
    missed: int = 0
    untyped: list[str] = field(default_factory=list)
    swaps: int = 0


def race(
    scene: RaceRoot,
    op: Callable[[Any], Any],
    mutates: bool,
    seconds: float,
    *,
    set_walk: Callable[[bool], None],
    leaks: Callable[[Any], bool],
) -> Tally:
    """Call ``op(scene)`` for ``seconds`` while the swapper runs, every other call with ``set_walk(True)``
    (openat2 switched off: the component walk); a result that ``leaks`` outside data, or a change outside, is an
    escape; ``top`` is rebuilt after each call of an op that ``mutates``. A call succeeds only when no swap
    lands during its resolutions, which on a loaded machine can take more than ``seconds``, so past the
    deadline the race goes on (for at most 10 times as long, and for 4 calls at least) until it has succeeded
    in both modes."""
    tally = Tally()
    swapper = start_swapper(scene.top)
    try:
        deadline = time.monotonic() + seconds
        overtime = deadline + 10 * seconds

        def more() -> bool:
            now = time.monotonic()
            succeeded = tally.ok > tally.ok_walked > 0
            return now < deadline or tally.calls < 4 or (not succeeded and now < overtime)

        while more():
            tally.calls += 1
            walked = tally.calls % 2 == 0
            set_walk(walked)
            escaped = False
            try:
                value = op(scene)
            except Miss:
                tally.missed += 1
            except errors.SfstoreError:
                tally.refused += 1
            except Exception as exc:  # any other type is a failure of the typed-error promise
                tally.untyped.append(f"{type(exc).__name__}: {exc}")
            else:
                escaped = leaks(value)
                if not escaped:
                    tally.ok += 1
                    tally.ok_walked += walked
            if scene.outside_changed():
                escaped = True
            if escaped:
                tally.escapes += 1
            if mutates:
                scene.build_top()
    finally:
        set_walk(False)
        tally.swaps = stop_swapper(swapper)
    return tally


def check_race(name: str, tally: Tally, seconds: float, scene: RaceRoot) -> None:
    """Print a race's figures and assert what it promises: the racer ran, 0 escapes, only typed errors, a
    success in both modes, the outside as it was."""
    print(
        f"\n{name}: {tally.calls} calls, {tally.escapes} escapes, {tally.ok} ok ({tally.ok_walked} walked), "
        f"{tally.refused} refused (typed), {tally.missed} missed, {len(tally.untyped)} untyped, "
        f"{tally.swaps} swaps in {seconds:g} s"
    )
    assert tally.swaps > 100, "the racer hardly ran: the race proves nothing"
    assert tally.escapes == 0, f"{name} reached outside the root {tally.escapes} times in {tally.calls} calls"
    assert not tally.untyped, f"{name} raised untyped errors: {sorted(set(tally.untyped))[:5]}"
    assert tally.ok > tally.ok_walked > 0, f"{name} never succeeded (in both modes): refusing everything is no fix"
    assert tree_signature(scene.outside) == scene.baseline
