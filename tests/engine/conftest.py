"""Fixtures of the engine conformance suite: every engine, and every kind of file descriptor.

``engine`` runs each test once per engine (``uring``, ``threads``, ``python``); an engine that cannot run here is
skipped with the reason :func:`sfstore.engine.describe_engines` gives. ``target`` gives a directory and the way
to open files in it: ``buffered``, ``direct-4k`` (O_DIRECT on a loop ext4 with 4096-byte sectors; root) and
``direct-local`` (O_DIRECT in the test's tmp directory, where that filesystem allows it and is not tmpfs, which
accepts any alignment).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sfstore import defaults
from sfstore.engine import IOEngine, describe_engines, get_engine, open_fd

ENGINES = ("uring", "threads", "python")


@pytest.fixture(autouse=True)
def _clean_settings() -> Iterator[None]:
    """No ``defaults.set`` override leaks from one test into the next."""
    defaults.reset()
    yield
    defaults.reset()


def require_engine(name: str) -> None:
    """Skip the test, with the reason, when engine ``name`` cannot run here."""
    info = describe_engines()["engines"][name]
    if not info["available"]:
        pytest.skip(f"{name} engine unavailable: {info['reason']}")


@pytest.fixture(params=ENGINES)
def engine_name(request: pytest.FixtureRequest) -> str:
    """The name of each engine that can run here."""
    name: str = request.param
    require_engine(name)
    return name


@pytest.fixture
def engine(engine_name: str) -> IOEngine:
    """The shared (cached) engine of each kind; tests compare stats as differences."""
    return get_engine(engine_name)


@dataclass
class Target:
    """Where a test puts its files and how it opens them."""

    kind: str
    dir: Path
    direct: bool
    fds: list[int] = field(default_factory=list)

    def open(self, path: Path, flags: int) -> int:
        """Open ``path`` (O_DIRECT when the target is direct); closed after the test."""
        fd, is_direct = open_fd(path, flags, direct=self.direct)
        assert is_direct == self.direct
        self.fds.append(fd)
        return fd

    def close_all(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def _fs_type(path: Path) -> str:
    try:
        return subprocess.run(
            ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@pytest.fixture(params=["buffered", pytest.param("direct-4k", marks=pytest.mark.root), "direct-local"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """Each kind of descriptor: buffered, O_DIRECT on 4096-byte sectors (root), O_DIRECT where tmp lives."""
    kind: str = request.param
    if kind == "buffered":
        t = Target(kind, tmp_path, False)
    elif kind == "direct-4k":
        t = Target(kind, request.getfixturevalue("dio_dir"), True)
    else:
        fstype = _fs_type(tmp_path)
        if fstype in ("tmpfs", "ramfs"):
            pytest.skip(f"{tmp_path} is on {fstype}, which accepts any O_DIRECT alignment; direct-4k covers O_DIRECT")
        probe = tmp_path / "probe-direct"
        try:
            fd, is_direct = open_fd(probe, os.O_RDWR | os.O_CREAT, direct="auto")
        except OSError as exc:
            pytest.skip(f"cannot open a file in {tmp_path}: {exc}")
        os.close(fd)
        probe.unlink()
        if not is_direct:
            pytest.skip(f"the filesystem of {tmp_path} ({fstype}) refuses O_DIRECT")
        t = Target(kind, tmp_path, True)
    yield t
    t.close_all()
