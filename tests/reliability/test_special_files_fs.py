"""Special files on the ``sf://`` face and ``sfstore cp``: FIFOs, sockets, devices, directories, stdin/stdout.

Guards issue #14, defect 5 (file part: a FIFO in a dataset directory hung ``cat_file`` and ``cat``; nothing that
opens a file may wait on one: it is refused with :class:`~sfstore.errors.NotARegularFileError`), defect 4
(``get_file`` and ``sfstore cp sf://x DEST`` replaced a FIFO, ``/dev/null`` or ``/dev/stdout`` at DEST with a
regular file, and ``sfstore cp sf://x -`` made a file named ``-``: special files are written in place, ``-`` is
stdout and stdin), and defect 8's ``isdir``/``isfile``/``exists`` leaking ENAMETOOLONG.

Every operation that could hang runs on a thread joined with a timeout (a regression fails, and the FIFO is
then opened for writing so the stuck reader ends). Tests that write to ``/dev/null`` or ``/dev/stdout`` put them
back if a regression replaced them (as root the old code could).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import run_bounded

from sfstore import errors
from sfstore.fs import SFFileSystem

TIMEOUT = 10.0
PAYLOAD = bytes(range(256)) * 40  # 10 KiB: the CLI's batched small-file path
BIG = os.urandom(3 << 20)  # 3 MiB: get_file's streamed path


def _bounded(call: Callable[[], Any], unblock: Path | None = None) -> Any:
    """Run ``call`` on a thread; fail if it is still running after ``TIMEOUT`` s (then open ``unblock``, a FIFO,
    for writing so a reader stuck on it ends). Returns the call's result or raises its exception."""
    return run_bounded(call, TIMEOUT, [] if unblock is None else [unblock])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (a unix socket's path is limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="sf-sp-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def dataset(short_tmp: Path) -> tuple[SFFileSystem, Path]:
    root = short_tmp / "root"
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.bin").write_bytes(PAYLOAD)
    (root / "data" / "big.bin").write_bytes(BIG)
    os.mkfifo(root / "data" / "pipe.bin")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(root / "data" / "sock"))
    sock.close()
    return SFFileSystem(root=str(root), skip_instance_cache=True), root


def _reads(fs: SFFileSystem, name: str) -> dict[str, Callable[[], Any]]:
    fp = fs.file_path

    def open_rb() -> bytes:
        with fs.open(name, "rb") as f:
            return bytes(f.read())

    return {
        "cat_file": lambda: fs.cat_file(name),
        "cat": lambda: fs.cat(name),
        "cat(many)": lambda: fs.cat([name, "data/a.bin"]),
        "cat_ranges": lambda: fs.cat_ranges([name], [0], [10], on_error="raise"),
        "open(rb)": open_rb,
        "read_into": lambda: fs.read_into(name, bytearray(16)),
        "get_file": lambda: fs.get_file(name, os.path.join(fs.root, "..", "got.bin")),
        "cp_file": lambda: fs.cp_file(name, "data/copy.bin"),
        "open(ab)": lambda: fs.open(name, "ab").close(),
        "FilePath.read": lambda: fp.read(name),
        "FilePath.read_into": lambda: fp.read_into(name, bytearray(16)),
        "FilePath.read_many": lambda: fp.read_many([name, "data/a.bin"]),
        "FilePath.read_ranges_into": lambda: fp.read_ranges_into(name, [(0, 4, bytearray(4), 0)]),
        "FilePath.open_file": lambda: fp.open_file(name).close(),
    }


@pytest.mark.parametrize("special", ["pipe.bin", "sock"])
def test_reads_of_a_fifo_or_socket_are_refused_at_once(dataset: tuple[SFFileSystem, Path], special: str) -> None:
    fs, root = dataset
    name = f"data/{special}"
    for what, call in _reads(fs, name).items():
        with pytest.raises(errors.NotARegularFileError) as info:
            _bounded(call, unblock=root / "data" / "pipe.bin")
        assert isinstance(info.value, OSError) and info.value.errno == errno.EINVAL, what
        assert "not a regular file" in str(info.value) and special in str(info.value), what
    assert stat.S_ISFIFO(os.lstat(root / "data" / "pipe.bin").st_mode)  # nothing replaced it


def test_metadata_of_special_files_does_not_wait(dataset: tuple[SFFileSystem, Path]) -> None:
    fs, root = dataset
    for name in ("data/pipe.bin", "data/sock"):
        info = _bounded(lambda n=name: fs.info(n), unblock=root / "data" / "pipe.bin")
        assert info["type"] == "other" and info["size"] == 0
        assert _bounded(lambda n=name: fs.size(n)) == 0
        assert _bounded(lambda n=name: fs.exists(n)) and not fs.isfile(name) and not fs.isdir(name)
    listed = _bounded(lambda: fs.ls("data", detail=True))
    assert {d["name"]: d["type"] for d in listed}["data/pipe.bin"] == "other"
    found = _bounded(lambda: fs.find("data", detail=True))
    assert found["data/pipe.bin"]["type"] == "other"


def test_a_fifo_in_a_dataset_directory_does_not_hang_cat(dataset: tuple[SFFileSystem, Path]) -> None:
    fs, root = dataset
    got = _bounded(lambda: fs.cat("data", recursive=True, on_error="return"), unblock=root / "data" / "pipe.bin")
    assert got["data/a.bin"] == PAYLOAD and got["data/big.bin"] == BIG
    assert isinstance(got["data/pipe.bin"], errors.NotARegularFileError)
    assert isinstance(got["data/sock"], errors.NotARegularFileError)
    omitted = _bounded(lambda: fs.cat("data/*", on_error="omit"), unblock=root / "data" / "pipe.bin")
    assert set(omitted) == {"data/a.bin", "data/big.bin"}
    with pytest.raises(errors.NotARegularFileError):
        _bounded(lambda: fs.cat("data", recursive=True), unblock=root / "data" / "pipe.bin")


def test_a_fifo_with_a_writer_is_refused_too(dataset: tuple[SFFileSystem, Path]) -> None:
    """A FIFO is refused for what it is, not because nobody writes to it."""
    fs, root = dataset
    fifo = root / "data" / "pipe.bin"
    reader_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer_end = os.open(fifo, os.O_WRONLY)
    try:
        os.write(writer_end, b"streamed bytes")
        with pytest.raises(errors.NotARegularFileError):
            _bounded(lambda: fs.cat_file("data/pipe.bin"))
    finally:
        os.close(writer_end)
        os.close(reader_end)


def test_a_directory_is_refused_as_one(dataset: tuple[SFFileSystem, Path]) -> None:
    fs, _ = dataset
    for what, call in _reads(fs, "data/sub").items():
        if what in ("cp_file", "get_file", "open(ab)", "cat"):
            continue  # a directory there means: copy the directory / list it
        with pytest.raises(errors.IsADirectoryPathError):
            _bounded(call)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_a_device_node_in_the_root_is_refused(dataset: tuple[SFFileSystem, Path]) -> None:
    fs, root = dataset
    os.mknod(root / "data" / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))  # what /dev/zero is
    for call in (lambda: fs.cat_file("data/zero"), lambda: fs.file_path.read_many(["data/zero"])):
        with pytest.raises(errors.NotARegularFileError) as info:
            _bounded(call)
        assert "character device" in str(info.value)


# -- names too long (defect 8) ---------------------------------------------------------------------------------


def test_a_name_too_long_is_absent_for_isdir_isfile_exists(dataset: tuple[SFFileSystem, Path]) -> None:
    fs, _ = dataset
    for long in ("x" * 300, "data/" + "y" * 300, "/".join(["z" * 200] * 30)):
        assert fs.isdir(long) is False and fs.isfile(long) is False and fs.exists(long) is False
        assert fs.lexists(long) is False and fs.islink(long) is False
        for call in (lambda n=long: fs.info(n), lambda n=long: fs.cat_file(n), lambda n=long: fs.open(n, "rb")):
            with pytest.raises(errors.SfstoreOSError) as info:
                call()
            assert info.value.errno == errno.ENAMETOOLONG
        with pytest.raises(errors.SfstoreOSError):
            fs.pipe_file(long, b"x")


# -- destinations that are special files (defect 4) ------------------------------------------------------------


def _write_through_fifo(fifo: Path, write: Callable[[], Any]) -> tuple[Any, bytes | None]:
    """Make the FIFO ``fifo`` and read it on a thread while ``write()`` runs: what ``write`` returned and what
    the reader got (``None``: it did not finish within ``TIMEOUT`` s of the write)."""
    os.mkfifo(fifo)
    got: dict[str, bytes] = {}

    def read() -> None:
        with open(fifo, "rb") as f:
            got["data"] = f.read()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    value = write()
    reader.join(TIMEOUT)
    return value, None if reader.is_alive() else got.get("data")


@pytest.mark.parametrize("name", ["data/a.bin", "data/big.bin"])
def test_get_file_writes_through_a_fifo(dataset: tuple[SFFileSystem, Path], short_tmp: Path, name: str) -> None:
    fs, root = dataset
    fifo = short_tmp / "out.fifo"
    _, data = _write_through_fifo(fifo, lambda: _bounded(lambda: fs.get_file(name, str(fifo)), unblock=None))
    assert data == (root / name).read_bytes()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(short_tmp)) == ["out.fifo", "root"]  # no temporary left beside it


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_get_file_writes_through_a_character_device(dataset: tuple[SFFileSystem, Path], short_tmp: Path) -> None:
    fs, _ = dataset
    null = short_tmp / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a private /dev/null
    fs.get_file("data/big.bin", str(null))
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)


def test_get_file_to_dev_null(dataset: tuple[SFFileSystem, Path]) -> None:
    fs, _ = dataset
    with _restoring_dev_null():
        fs.get_file("data/big.bin", "/dev/null")
        fs.get_file("data/a.bin", "/dev/null")


class _restoring_dev_null:
    """Fail if ``/dev/null`` stopped being the null device, and make it one again (a regression as root)."""

    def __enter__(self) -> None:
        st = os.lstat("/dev/null")
        assert stat.S_ISCHR(st.st_mode)
        self.rdev = st.st_rdev

    def __exit__(self, *exc: object) -> None:
        st = os.lstat("/dev/null")
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == self.rdev:
            return
        os.unlink("/dev/null")
        os.mknod("/dev/null", stat.S_IFCHR | 0o666, self.rdev)
        os.chmod("/dev/null", 0o666)
        pytest.fail("/dev/null was replaced by a regular file (put back)")


def test_get_file_through_a_symlink_keeps_the_link(dataset: tuple[SFFileSystem, Path], short_tmp: Path) -> None:
    fs, _ = dataset
    target = short_tmp / "target.bin"
    target.write_bytes(b"old content, longer than the new one" * 1000)
    link = short_tmp / "link.bin"
    link.symlink_to(target)
    fs.get_file("data/a.bin", str(link))
    assert link.is_symlink() and target.read_bytes() == PAYLOAD


def test_get_file_onto_a_regular_file_still_publishes_atomically(
    dataset: tuple[SFFileSystem, Path], short_tmp: Path
) -> None:
    fs, _ = dataset
    dest = short_tmp / "dest.bin"
    dest.write_bytes(b"old")
    before = os.stat(dest).st_ino
    fs.get_file("data/big.bin", str(dest))
    assert dest.read_bytes() == BIG and os.stat(dest).st_ino != before  # a new inode renamed over the old


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no /dev/shm")
def test_get_file_into_dev_shm_still_publishes_atomically(dataset: tuple[SFFileSystem, Path]) -> None:
    """A regular file under /dev (tmpfs staging) is no special file: published by rename like any other."""
    fs, _ = dataset
    with tempfile.TemporaryDirectory(prefix="sf-sp-", dir="/dev/shm") as d:
        dest = Path(d) / "staged.bin"
        fs.get_file("data/a.bin", str(dest))
        first = os.stat(dest).st_ino
        fs.get_file("data/big.bin", str(dest))
        assert dest.read_bytes() == BIG and os.stat(dest).st_ino != first


def sfstore(*args: str, root: Path, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    root.mkdir(parents=True, exist_ok=True)  # a configured root (SFSTORE_ROOT) must exist
    env = {**os.environ, "SFSTORE_ROOT": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "sfstore.cli", *args],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("name", ["data/a.bin", "data/big.bin"])
def test_cli_cp_to_dash_writes_stdout(dataset: tuple[SFFileSystem, Path], short_tmp: Path, name: str) -> None:
    _, root = dataset
    done = sfstore("cp", f"sf://{name}", "-", root=root, cwd=short_tmp)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (root / name).read_bytes()
    assert not (short_tmp / "-").exists()


def test_cli_cp_from_dash_reads_stdin(dataset: tuple[SFFileSystem, Path], short_tmp: Path) -> None:
    _, root = dataset
    done = sfstore("cp", "-", "sf://data/from-stdin.bin", root=root, cwd=short_tmp, stdin=BIG)
    assert done.returncode == 0, done.stderr
    assert (root / "data" / "from-stdin.bin").read_bytes() == BIG and not (short_tmp / "-").exists()
    refused = sfstore("cp", "-r", "-", "sf://data/x", root=root, cwd=short_tmp, stdin=b"")
    assert refused.returncode == 1 and b"one file" in refused.stderr


def test_cli_cp_to_dev_stdout(dataset: tuple[SFFileSystem, Path], short_tmp: Path) -> None:
    _, root = dataset
    before = os.readlink("/dev/stdout")
    try:
        done = sfstore("cp", "sf://data/big.bin", "/dev/stdout", root=root, cwd=short_tmp)
    finally:
        if not os.path.islink("/dev/stdout") or os.readlink("/dev/stdout") != before:  # a regression as root
            if os.path.lexists("/dev/stdout"):
                os.unlink("/dev/stdout")
            os.symlink(before, "/dev/stdout")
            pytest.fail("/dev/stdout was replaced (put back)")
    assert done.returncode == 0, done.stderr
    assert done.stdout == BIG


@pytest.mark.parametrize("name", ["data/a.bin", "data/big.bin"])
def test_cli_cp_to_a_fifo(dataset: tuple[SFFileSystem, Path], short_tmp: Path, name: str) -> None:
    _, root = dataset
    fifo = short_tmp / "cli.fifo"
    done, data = _write_through_fifo(fifo, lambda: sfstore("cp", f"sf://{name}", str(fifo), root=root, cwd=short_tmp))
    assert done.returncode == 0, done.stderr
    assert data == (root / name).read_bytes() and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_cli_cp_to_dev_null(dataset: tuple[SFFileSystem, Path], short_tmp: Path) -> None:
    _, root = dataset
    with _restoring_dev_null():
        for name in ("data/a.bin", "data/big.bin"):
            done = sfstore("cp", f"sf://{name}", "/dev/null", root=root, cwd=short_tmp)
            assert done.returncode == 0, done.stderr
