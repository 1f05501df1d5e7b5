"""``sfstore cat``: sf:// files to stdout, streamed, for pipes (webdataset's ``pipe:``, ``tar``, ``head``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1 << 20


def sfstore(*args: str, root: Path, **env: str) -> subprocess.CompletedProcess[bytes]:
    root.mkdir(parents=True, exist_ok=True)  # a configured root (SFSTORE_ROOT) must exist
    return subprocess.run([sys.executable, "-m", "sfstore.cli", *args], capture_output=True, timeout=120,
                          env={**os.environ, "SFSTORE_ROOT": str(root), **env}, check=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    top = tmp_path / "cat-root"
    (top / "d").mkdir(parents=True)
    (top / "d" / "a.bin").write_bytes(b"alpha\n")
    (top / "d" / "b.bin").write_bytes(bytes(range(256)) * 1000)
    (top / "empty").write_bytes(b"")
    return top


def test_cat_writes_the_files_in_order(root: Path) -> None:
    out = sfstore("cat", "sf://d/a.bin", "d/b.bin", "/empty", "sf://d/a.bin", root=root)
    assert out.returncode == 0 and out.stderr == b""
    assert out.stdout == b"alpha\n" + bytes(range(256)) * 1000 + b"alpha\n"


def test_cat_root_option(root: Path, tmp_path: Path) -> None:
    out = sfstore("cat", "--root", str(root), "sf://d/a.bin", root=tmp_path / "elsewhere")
    assert out.returncode == 0 and out.stdout == b"alpha\n"


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        (["sf://d/a.bin", "sf://d/missing.bin"], b"No such file or directory"),
        (["sf://d"], b"is a directory"),
        (["sf://../outside"], b"climbs above the sf:// root"),
    ],
)
def test_cat_errors_exit_1_before_writing(root: Path, urls: list[str], message: bytes) -> None:
    out = sfstore("cat", *urls, root=root)
    assert out.returncode == 1 and out.stdout == b""  # a.bin, before the missing name, is not written either
    assert out.stderr.startswith(b"sfstore cat: error:") and message in out.stderr and b"Traceback" not in out.stderr


def test_cat_streams_in_blocks(root: Path) -> None:
    """A 48 MiB file goes out in the filesystem's readahead blocks (4 MiB with 1 MiB chunks): the command's
    peak memory grows by far less than the file (measured against cat of a 6-byte file)."""
    (root / "big.bin").write_bytes(os.urandom(48 * MiB))
    probe = (
        "import resource, subprocess, sys\n"
        "subprocess.run([sys.executable, '-m', 'sfstore.cli', 'cat', sys.argv[1]], stdout=subprocess.DEVNULL,"
        " check=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"  # KiB, of that one child
    )
    env = {**os.environ, "SFSTORE_ROOT": str(root), "SFSTORE_FILE_CHUNK_SIZE": "1m"}

    def peak_kib(url: str) -> int:
        run = subprocess.run([sys.executable, "-c", probe, url], capture_output=True, text=True, env=env,
                             timeout=120, check=True)
        return int(run.stdout)

    growth = (peak_kib("sf://big.bin") - peak_kib("sf://d/a.bin")) * 1024
    assert growth < 20 * MiB, f"cat of 48 MiB grew its peak memory by {growth / MiB:.1f} MiB"


def test_cat_into_a_reader_that_stops_early(root: Path) -> None:
    (root / "big.bin").write_bytes(b"x" * (16 * MiB))
    proc = subprocess.Popen([sys.executable, "-m", "sfstore.cli", "cat", "sf://big.bin"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "SFSTORE_ROOT": str(root)})
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b"x" * 10
    proc.stdout.close()  # as `| head -c 10` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == b""
