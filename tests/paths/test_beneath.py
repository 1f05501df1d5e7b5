"""Beneath: name resolution confined to a root, through openat2 and through the component walk alike.

Each test runs twice: with the kernel's ``openat2(RESOLVE_BENEATH)`` and with it switched off (the walk of
``O_NOFOLLOW`` directory descriptors older kernels get). The races themselves are in
``tests/reliability/test_symlink_races.py``.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from sfstore import errors
from sfstore.paths.beneath import Beneath


@pytest.fixture(params=["openat2", "walk"])
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Beneath, Path, Path]:
    root = tmp_path / "root"
    out = tmp_path / "out"
    (root / "d" / "sub").mkdir(parents=True)
    out.mkdir()
    (root / "d" / "f").write_bytes(b"inside")
    (out / "f").write_bytes(b"outside")
    os.symlink(out, root / "abs-out")
    os.symlink("../out", root / "rel-out")
    os.symlink(root / "d", root / "abs-in")
    os.symlink("d", root / "rel-in")
    os.symlink("../f", root / "d" / "sub" / "up")
    os.symlink(root, root / "d" / "to-root")
    os.symlink("loop-b", root / "loop-a")
    os.symlink("loop-a", root / "loop-b")
    b = Beneath(os.path.realpath(root), aliases=(str(tmp_path / "alias"),))
    if request.param == "walk":
        b._openat2 = None
    return b, root, out


def read(b: Beneath, path: str) -> bytes:
    fd = b.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def test_parts_fold_dots_and_refuse_climbing(tree: tuple[Beneath, Path, Path]) -> None:
    b, root, out = tree
    assert b.parts("a/./b/../c/") == ["a", "c"] and b.parts("") == [] and b.parts(str(root / "d" / "f")) == ["d", "f"]
    for bad in ("../x", "a/../../x", str(out / "f"), "a\x00b"):
        with pytest.raises(errors.PathEscapeError):
            b.parts(bad)


def test_symlinks_inside_are_followed_outside_refused(tree: tuple[Beneath, Path, Path]) -> None:
    b, _, _ = tree
    for good in ("d/f", "abs-in/f", "rel-in/f", "d/sub/up", "d/to-root/d/f", "abs-in/sub/up"):
        assert read(b, good) == b"inside", good
    for bad in ("abs-out/f", "rel-out/f", "abs-in/to-root/abs-out/f"):
        with pytest.raises(errors.PathEscapeError):
            read(b, bad)
        with pytest.raises(errors.PathEscapeError):
            b.locate(bad)
    with pytest.raises(OSError) as info:
        read(b, "loop-a")
    assert info.value.errno == errno.ELOOP
    with pytest.raises(FileNotFoundError):
        read(b, "d/missing")
    with pytest.raises(NotADirectoryError):
        read(b, "d/f/x")


def test_stat_follows_inside_and_lstat_does_not(tree: tuple[Beneath, Path, Path]) -> None:
    b, _, _ = tree
    assert stat.S_ISDIR(b.stat("abs-in").st_mode) and stat.S_ISLNK(b.stat("abs-in", follow=False).st_mode)
    assert stat.S_ISLNK(b.stat("abs-out", follow=False).st_mode)  # the link itself is inside
    with pytest.raises(errors.PathEscapeError):
        b.stat("abs-out")
    assert stat.S_ISDIR(b.stat("").st_mode)
    names = dict(b.scandir("d"))
    assert set(names) == {"f", "sub", "to-root"} and all(st is not None for st in names.values())


def test_namespace_operations_act_on_entries(tree: tuple[Beneath, Path, Path]) -> None:
    b, root, out = tree
    b.mkdir("abs-in/new/deeper", parents=True)
    assert (root / "d" / "new" / "deeper").is_dir()
    b.mkdir("abs-in/new", exist_ok=True)
    with pytest.raises(FileExistsError):
        b.mkdir("abs-in/new")
    b.rename("d/f", "d/new/g")
    assert (root / "d" / "new" / "g").read_bytes() == b"inside" and not (root / "d" / "f").exists()
    b.link("d/new/g", "rel-in/f")
    assert (root / "d" / "f").stat().st_ino == (root / "d" / "new" / "g").stat().st_ino
    b.unlink("rel-in/f")
    b.rmdir("d/new/deeper")
    b.unlink("abs-out")  # a link that points out is removed as a link
    assert not os.path.lexists(root / "abs-out") and (out / "f").read_bytes() == b"outside"
    for call in (lambda: b.unlink(""), lambda: b.rmdir(""), lambda: b.rename("", "x"), lambda: b.rmtree("")):
        with pytest.raises(errors.InvalidRequestError):
            call()
    with pytest.raises(errors.PathEscapeError):
        b.mkdir("rel-out/evil", parents=True)
    with pytest.raises(errors.PathEscapeError):
        b.rename("d/new/g", "rel-out/g")
    assert sorted(os.listdir(out)) == ["f"]


def test_rmtree_removes_links_never_their_targets(tree: tuple[Beneath, Path, Path]) -> None:
    b, root, out = tree
    (root / "t" / "a" / "b").mkdir(parents=True)
    (root / "t" / "a" / "b" / "deep.bin").write_bytes(b"x")
    (root / "t" / "top.bin").write_bytes(b"x")
    os.symlink(out, root / "t" / "a" / "out")
    os.symlink(root / "d", root / "t" / "in")
    b.rmtree("t", maxdepth=2)  # deep.bin is three levels down: it and its directories stay
    assert (root / "t" / "a" / "b" / "deep.bin").exists() and not (root / "t" / "top.bin").exists()
    assert not os.path.lexists(root / "t" / "a" / "out") and not os.path.lexists(root / "t" / "in")
    b.rmtree("t")
    assert not (root / "t").exists()
    assert (out / "f").read_bytes() == b"outside" and (root / "d" / "f").read_bytes() == b"inside"
    b.rmtree("abs-in")  # a symlink to a directory: the link goes
    assert not os.path.lexists(root / "abs-in") and (root / "d" / "f").exists()


def test_utime_and_fsync_dir(tree: tuple[Beneath, Path, Path]) -> None:
    b, root, _ = tree
    b.utime("abs-in/f", (1_000_000, 2_000_000))
    assert os.stat(root / "d" / "f").st_mtime == 2_000_000
    b.fsync_dir("rel-in")
    b.fsync_dir("")


def test_absolute_names_through_an_alias_of_the_root(tree: tuple[Beneath, Path, Path], tmp_path: Path) -> None:
    b, root, _ = tree
    os.symlink(root, tmp_path / "alias")
    os.symlink(tmp_path / "alias" / "d", root / "via-alias")  # an absolute link spelled with the alias
    assert read(b, str(tmp_path / "alias" / "d" / "f")) == b"inside"
    assert read(b, "via-alias/f") == b"inside"


def test_a_forked_child_opens_its_own_root_descriptor(tree: tuple[Beneath, Path, Path]) -> None:
    b, _, _ = tree
    parent_fd = b.root_fd()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        ok = b.root_fd() != parent_fd and read(b, "abs-in/f") == b"inside"
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and b.root_fd() == parent_fd


def test_native_batched_stat_stays_beneath_and_stops_where_asked(tmp_path: Path) -> None:
    """``_native.stat_files_beneath``, the batched lookup of the KV shared tier: each name resolved beneath the
    directory by the kernel (a link out is EXDEV, never the outside file's mode), ``leading`` stopping after the
    first name that is not a regular file, and bad arguments a typed error."""
    native = pytest.importorskip("sfstore._native")
    root, out = tmp_path / "root", tmp_path / "out"
    (root / "d").mkdir(parents=True)
    out.mkdir()
    (root / "d" / "f").write_bytes(b"x")
    (out / "f").write_bytes(b"y")
    os.symlink(out / "f", root / "d" / "abs-out")
    os.symlink("../../out/f", root / "d" / "rel-out")
    os.symlink("f", root / "d" / "in")
    os.mkfifo(root / "d" / "fifo")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = ["d/f", "d/in", "d/abs-out", "d/rel-out", "../out/f", "d/fifo", "d", "d/none"]
        modes = native.stat_files_beneath(fd, names, os.O_PATH)
        if modes[0] == -errno.ENOSYS:
            pytest.skip("a kernel without openat2")
        assert stat.S_ISREG(modes[0]) and stat.S_ISREG(modes[1])  # a link inside is followed
        assert modes[2:5] == [-errno.EXDEV] * 3  # out of the directory: refused by the kernel
        assert stat.S_ISFIFO(modes[5]) and stat.S_ISDIR(modes[6]) and modes[7] == -errno.ENOENT
        assert native.stat_files_beneath(fd, names, os.O_PATH, True) == modes[:3]  # up to the first non-file
        assert native.stat_files_beneath(fd, [], os.O_PATH, True) == []
        with pytest.raises(errors.InvalidRequestError, match="paths must be a list"):
            native.stat_files_beneath(fd, 5, os.O_PATH)
        with pytest.raises(errors.InvalidRequestError, match="path 1 must be"):
            native.stat_files_beneath(fd, ["d/f", "a\0b"], os.O_PATH)
    finally:
        os.close(fd)
