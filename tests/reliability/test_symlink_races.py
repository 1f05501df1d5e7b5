"""Symlink races against the root: nothing outside it is read, written, moved or deleted.

Guards issue #14, defect 2. A separate process swaps ``<root>/top/d`` — atomically, with
``renameat2(RENAME_EXCHANGE)`` — between a real directory and a symlink to a directory outside the root
(alternately an absolute and a relative one), as fast as it can, while one operation of
:class:`~sfstore.paths.file.FilePath` or :class:`~sfstore.fs.SFFileSystem` runs in a loop on a path through
``top/d``; every other call runs with ``openat2`` switched off, so the component walk that replaces it on
older kernels (and settles what ``openat2`` refuses) races too. After every call the outside directory is
compared with its starting state (names, types, sizes, contents, modification times), and what the call
returned is checked for outside bytes, names or inodes. Every operation must have 0 effects outside the root
and raise nothing but :class:`~sfstore.errors.SfstoreError`; it must also have succeeded (while ``d`` was the
real directory) in both modes, so a path that refuses everything does not pass.

Each operation races for ``race_seconds`` (``SFSTORE_RELIABILITY_SECONDS``: 1 s in CI, 30 s in the flag run).
Run with ``-s`` to see the per-operation figures (calls, escapes, refusals, swaps).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import RaceRoot, Tally, check_race, race, tree_signature

from sfstore import errors, temp_names
from sfstore.fs import SFFileSystem

INSIDE = b"INSIDE-" * 10  # 70 bytes
OUTSIDE = b"OUTSIDE-" * 20  # 160 bytes: another size, so a size or offset leaks too
OUTSIDE_ONLY = ("only-outside.txt", "outside-dir")

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange_supported() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return hasattr(libc, "renameat2")


pytestmark = pytest.mark.skipif(not _exchange_supported(), reason="needs renameat2 (glibc 2.28+)")

def _signature(top: Path) -> dict[str, tuple[Any, ...]]:
    return tree_signature(top)


def _make_outside(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    (out / "sub" / "deep").mkdir(parents=True)
    (out / "empty").mkdir()
    (out / "outside-dir").mkdir()
    (out / "f").write_bytes(OUTSIDE)
    (out / "sub" / "g").write_bytes(OUTSIDE)
    (out / "sub" / "deep" / "h").write_bytes(OUTSIDE)
    (out / "only-outside.txt").write_bytes(OUTSIDE)
    (out / f".x.bin.sfstore-tmp-{temp_names.host()}-999999999-abcdef").write_bytes(OUTSIDE)  # a dead writer's


@dataclass
class Scene(RaceRoot):
    """A root whose ``top/d`` is being swapped for a symlink to ``outside``, and what it started as."""

    local: Path  # a directory for get_file/put_file, outside the root and outside ``outside``
    fs: SFFileSystem
    outside_inodes: set[int] = field(default_factory=set)

    def build_top(self) -> None:
        """(Re)build ``top``: the real directory ``d``, the links ``d-abs`` and ``d-rel``; atomically."""
        new = self.new_top()
        d = new / "d"
        (d / "sub" / "deep").mkdir(parents=True)
        (d / "empty").mkdir()
        (d / "f").write_bytes(INSIDE)
        (d / "sub" / "g").write_bytes(INSIDE)
        (d / "sub" / "deep" / "h").write_bytes(INSIDE)
        (d / f".y.bin.sfstore-tmp-{temp_names.host()}-999999999-abcdef").write_bytes(INSIDE)
        self.replace_top(new)
        for name in ("moved.bin", "copied.bin"):
            (self.root / name).unlink(missing_ok=True)
        (self.root / "plain.bin").write_bytes(INSIDE)

    def outside_changed(self) -> bool:
        """Whether anything outside changed; if so, put it back (so the next change is seen too)."""
        if _signature(self.outside) == self.baseline:
            return False
        _make_outside(self.outside)
        self.baseline = _signature(self.outside)
        self.outside_inodes = {os.lstat(self.outside / n).st_ino for n in self.baseline}
        self.outside_inodes.add(os.lstat(self.outside).st_ino)
        return True

    def leaks(self, value: Any, top: bool = True) -> bool:
        """Whether ``value`` (bytes, info dicts, names, lists/dicts of them) shows anything from outside.

        A ``True`` answer is a leak only as the whole result (``exists`` of a name that is only outside); inside
        an info dict it is a flag such as ``islink``.
        """
        if isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
            return b"OUTSIDE" in bytes(value)
        if isinstance(value, str):
            return any(n in value for n in OUTSIDE_ONLY)
        if isinstance(value, bool):
            return top and value
        if isinstance(value, int):
            return value == len(OUTSIDE)
        if isinstance(value, dict):
            if "ino" in value and value["ino"] in self.outside_inodes:
                return True
            return any(self.leaks(k, False) or self.leaks(v, False) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(self.leaks(v, False) for v in value)
        return False


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    _make_outside(outside)
    local = tmp_path / "local"
    local.mkdir()
    (local / "src.bin").write_bytes(INSIDE)
    s = Scene(root, outside, local, SFFileSystem(root=str(root), skip_instance_cache=True))
    s.build_top()
    s.baseline = _signature(outside)
    s.outside_inodes = {os.lstat(outside / n).st_ino for n in s.baseline} | {os.lstat(outside).st_ino}
    return s


def _read_open(s: Scene) -> bytes:
    with s.fs.open("top/d/f", "rb") as f:
        return bytes(f.read())


def _write_open(s: Scene, mode: str, path: str) -> None:
    with s.fs.open(path, mode) as f:
        f.write(INSIDE)


def _get_file(s: Scene) -> bytes:
    dest = s.local / "got.bin"
    dest.unlink(missing_ok=True)
    s.fs.get_file("top/d/f", str(dest))
    return dest.read_bytes()


def _copied(s: Scene) -> bytes:
    s.fs.cp_file("top/d/f", "copied.bin")
    return (s.root / "copied.bin").read_bytes()


def _moved_in(s: Scene) -> bytes:
    s.fs.mv("top/d/f", "moved.bin")
    return (s.root / "moved.bin").read_bytes()


def _read_into(s: Scene, fs_face: bool) -> bytes:
    buf = bytearray(len(OUTSIDE))
    n = s.fs.read_into("top/d/f", buf) if fs_face else s.fs.file_path.read_into("top/d/f", buf)
    return bytes(buf[:n])


def _ranges_into(s: Scene, fs_face: bool) -> bytes:
    buf = bytearray(len(OUTSIDE))
    if fs_face:
        s.fs.cat_ranges_into(["top/d/f"], [0], [len(OUTSIDE)], [buf])
    else:
        s.fs.file_path.read_ranges_into("top/d/f", [(0, len(OUTSIDE), buf, 0)])
    return bytes(buf)


def _writer(s: Scene) -> None:
    with s.fs.file_path.open_writer("top/d/w.bin") as w:
        w.write(INSIDE)


def _walk(s: Scene) -> list[Any]:
    return list(s.fs.walk("top/d", detail=True))


# name -> (operation on the scene, whether it changes the inside tree: rebuilt after each call)
OPERATIONS: dict[str, tuple[Callable[[Scene], Any], bool]] = {
    # FilePath
    "FilePath.read": (lambda s: s.fs.file_path.read("top/d/f"), False),
    "FilePath.read_into": (lambda s: _read_into(s, False), False),
    "FilePath.read_ranges_into": (lambda s: _ranges_into(s, False), False),
    "FilePath.read_many": (lambda s: s.fs.file_path.read_many(["top/d/f", "top/d/sub/g"], on_error="return"), False),
    "FilePath.size": (lambda s: s.fs.file_path.size("top/d/f"), False),
    "FilePath.write": (lambda s: s.fs.file_path.write("top/d/new.bin", INSIDE), True),
    "FilePath.open_writer": (_writer, True),
    "FilePath.write(overwrite=False)": (lambda s: s.fs.file_path.write("top/d/x.bin", INSIDE, overwrite=False), True),
    "FilePath.clean_stale_temporaries": (lambda s: s.fs.file_path.clean_stale_temporaries("top/d"), True),
    # SFFileSystem reads
    "cat_file": (lambda s: s.fs.cat_file("top/d/f"), False),
    "cat(many)": (lambda s: s.fs.cat(["top/d/f", "top/d/sub/g"], on_error="return"), False),
    "cat(recursive)": (lambda s: s.fs.cat("top/d", recursive=True, on_error="return"), False),
    "cat_ranges": (lambda s: s.fs.cat_ranges(["top/d/f"], [0], [len(OUTSIDE)]), False),
    "cat_ranges_into": (lambda s: _ranges_into(s, True), False),
    "read_into": (lambda s: _read_into(s, True), False),
    "open(rb)": (_read_open, False),
    "get_file": (_get_file, False),
    "info": (lambda s: s.fs.info("top/d/f"), False),
    "ls": (lambda s: s.fs.ls("top/d", detail=True), False),
    "find": (lambda s: s.fs.find("top/d", withdirs=True, detail=True), False),
    "walk": (_walk, False),
    "glob": (lambda s: s.fs.glob("top/d/*"), False),
    "exists": (lambda s: s.fs.exists("top/d/only-outside.txt"), False),
    "lexists": (lambda s: s.fs.lexists("top/d/only-outside.txt"), False),
    "isdir": (lambda s: s.fs.isdir("top/d/outside-dir"), False),
    "isfile": (lambda s: s.fs.isfile("top/d/only-outside.txt"), False),
    "size": (lambda s: s.fs.size("top/d/f"), False),
    # SFFileSystem writes and namespace
    "pipe_file": (lambda s: s.fs.pipe_file("top/d/new.bin", INSIDE), True),
    "open(wb)": (lambda s: _write_open(s, "wb", "top/d/new.bin"), True),
    "open(xb)": (lambda s: _write_open(s, "xb", "top/d/new.bin"), True),
    "open(ab)": (lambda s: _write_open(s, "ab", "top/d/f"), True),
    "touch": (lambda s: s.fs.touch("top/d/new.bin"), True),
    "touch(truncate=False)": (lambda s: s.fs.touch("top/d/f", truncate=False), True),
    "put_file": (lambda s: s.fs.put_file(str(s.local / "src.bin"), "top/d/put.bin"), True),
    "cp_file(from d)": (_copied, True),
    "cp_file(into d)": (lambda s: s.fs.cp_file("plain.bin", "top/d/copy.bin"), True),
    "mv(out of d)": (_moved_in, True),
    "mv(into d)": (lambda s: s.fs.mv("plain.bin", "top/d/moved.bin"), True),
    "mv(within d)": (lambda s: s.fs.mv("top/d/f", "top/d/f2"), True),
    "makedirs": (lambda s: s.fs.makedirs("top/d/nd/x", exist_ok=True), True),
    "mkdir": (lambda s: s.fs.mkdir("top/d/nd2", create_parents=False), True),
    "rm_file": (lambda s: s.fs.rm_file("top/d/f"), True),
    "rmdir": (lambda s: s.fs.rmdir("top/d/empty"), True),
    "rm(recursive)": (lambda s: s.fs.rm("top/d/sub", recursive=True), True),
    "rm(recursive, maxdepth)": (lambda s: s.fs.rm("top/d/sub", recursive=True, maxdepth=1), True),
    "rm(top, recursive)": (lambda s: s.fs.rm("top", recursive=True), True),
    "rm(top, recursive, maxdepth)": (lambda s: s.fs.rm("top", recursive=True, maxdepth=3), True),
}


def _race(scene: Scene, op: Callable[[Scene], Any], mutates: bool, seconds: float) -> Tally:
    beneath = scene.fs.file_path.beneath
    openat2 = beneath._openat2

    def set_walk(walked: bool) -> None:
        beneath._openat2 = None if walked else openat2

    return race(scene, op, mutates, seconds, set_walk=set_walk, leaks=scene.leaks)


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_no_operation_escapes_the_root_while_a_directory_is_swapped_for_a_symlink(
    scene: Scene, race_seconds: float, name: str
) -> None:
    op, mutates = OPERATIONS[name]
    tally = _race(scene, op, mutates, race_seconds)
    check_race(name, tally, race_seconds, scene)


def test_static_escapes_are_still_refused(scene: Scene) -> None:
    """Without a race: a link out (absolute or relative) is refused, a link inside still works."""
    fs = scene.fs
    links = scene.root / "links"
    links.mkdir()
    os.symlink(scene.outside, links / "abs-out")
    os.symlink(os.path.relpath(scene.outside, links), links / "rel-out")
    os.symlink(scene.top / "d", links / "abs-in")
    os.symlink("../top/d", links / "rel-in")
    calls: list[Callable[[str], Any]] = [
        lambda base: fs.cat_file(f"{base}/f"),
        lambda base: fs.pipe_file(f"{base}/new.bin", b"x"),
        lambda base: fs.ls(base),
        lambda base: fs.makedirs(f"{base}/nd", exist_ok=True),
        lambda base: fs.rm(f"{base}/sub", recursive=True),
        lambda base: fs.mv(f"{base}/f", "moved.bin"),
        lambda base: fs.file_path.read_into(f"{base}/f", bytearray(8)),
        lambda base: fs.file_path.clean_stale_temporaries(base),
    ]
    for link in ("abs-out", "rel-out"):
        for call in calls:
            with pytest.raises(errors.PathEscapeError):
                call(f"links/{link}")
    assert _signature(scene.outside) == scene.baseline
    for link in ("abs-in", "rel-in"):
        assert fs.cat_file(f"links/{link}/f") == INSIDE
        assert fs.isdir(f"links/{link}/sub") and fs.exists(f"links/{link}/f")
        fs.pipe_file(f"links/{link}/new-{link}.bin", b"n")
        assert (scene.top / "d" / f"new-{link}.bin").read_bytes() == b"n"
    try:
        fs.rm("links", recursive=True)  # removes the links, never what they point at
    except OSError as exc:  # pragma: no cover - a failure message, not a branch
        raise AssertionError(f"rm of a directory of links failed: {exc}") from None
    assert (scene.top / "d" / "f").read_bytes() == INSIDE and _signature(scene.outside) == scene.baseline
