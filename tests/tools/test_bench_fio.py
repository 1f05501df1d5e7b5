"""fio's cold whole-file reads (``tools.bench.fio.read_files_cold``), the disk's side of the ``vllm`` suite's physical
bound: the jobs it makes for files of several sizes, and a real fio run on real files (when fio is installed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tools.bench.common import BenchSetupError, resident_bytes
from tools.bench.fio import FIO_MAX_VALUE, FioJob, fio_command, read_files_cold, request_size, whole_file_jobs

KIB, MIB = 1 << 10, 1 << 20


def test_request_size_reads_a_file_whole() -> None:
    assert request_size(132 * KIB) == 132 * KIB  # a sfstore block file of the tiny model: one request
    assert request_size(MIB + 4 * KIB) == MIB + 4 * KIB  # the wide model's
    assert request_size(16 * MIB) == 16 * MIB
    # bigger than the cap: the largest 4 KiB multiple that divides it and fits
    assert request_size(32 * MIB + 16 * KIB) == (32 * MIB + 16 * KIB) // 3  # 8196 pages = 3 x 2732
    assert request_size(32 * MIB + 8 * KIB) == 482 * 4 * KIB  # 8194 pages = 2 x 17 x 241: 17 requests
    size = 4 * KIB * 5003  # 5003 pages, a prime: no divisor between 1 page and all of them
    assert request_size(size, cap=MIB) == 4 * KIB
    assert request_size(MIB + 100) == MIB  # O_DIRECT cannot read the unaligned tail
    assert request_size(3000) == 0


def test_whole_file_jobs_one_job_per_size() -> None:
    files = [("a", MIB + 4 * KIB), ("b:1", 132 * KIB), ("c", MIB + 4 * KIB), ("tiny", 100), ("d", 132 * KIB + 7)]
    jobs = whole_file_jobs("hit", files, iodepth=8)
    assert [(j.name, j.filename, j.more_files, j.size, j.io_size, j.bs, j.iodepth, j.rw) for j in jobs] == [
        ("hit-135168", "b:1", ("d",), 2 * 132 * KIB, 2 * 132 * KIB, 132 * KIB, 8, "read"),
        ("hit-1052672", "a", ("c",), 2 * (MIB + 4 * KIB), 2 * (MIB + 4 * KIB), MIB + 4 * KIB, 8, "read"),
    ]  # one job per size O_DIRECT can read (d's unaligned tail is left); the file under 4 KiB has none


def test_whole_file_jobs_split_names_too_long_for_one_option() -> None:
    names = [f"{i:03d}" + "x" * 96 for i in range(100)]  # 100 names of 99 characters, 100 with fio's separator
    jobs = whole_file_jobs("hit", [(n, 8192) for n in names], directory="/links")
    assert [1 + len(j.more_files) for j in jobs] == [40, 40, 20]
    assert [j.name for j in jobs] == ["hit-8192", "hit-8192-1", "hit-8192-2"]
    assert [j.size for j in jobs] == [40 * 8192, 40 * 8192, 20 * 8192] and {j.directory for j in jobs} == {"/links"}
    assert [n for j in jobs for n in (j.filename, *j.more_files)] == names  # each file once, in order
    for job in jobs:
        assert len(next(a for a in fio_command("fio", job) if a.startswith("--filename=")).split("=", 1)[1]) \
            <= FIO_MAX_VALUE
    with pytest.raises(ValueError, match="too long for fio"):
        whole_file_jobs("hit", [("y" * FIO_MAX_VALUE, 8192)])


def test_fio_command_names_every_file() -> None:
    job = FioJob("r", "/d/a:b", 2 * MIB, 2 * MIB, "read", MIB, 32, more_files=("/d/c",), directory="/x:y")
    cmd = fio_command("fio", job)
    assert "--filename=/d/a\\:b:/d/c" in cmd and "--direct=1" in cmd and "--end_fsync=1" not in cmd
    assert "--directory=/x\\:y" in cmd


def test_read_files_cold_reads_every_byte_cold(disk_dir: Path) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is missing (apt-get install fio)")
    sizes = [MIB + 4 * KIB, MIB + 4 * KIB, 132 * KIB, 132 * KIB + 100]
    paths = []
    for i, size in enumerate(sizes):
        path = disk_dir / f"f{i}"
        path.write_bytes(os.urandom(size))  # in the page cache now
        paths.append(str(path))
    res = read_files_cold(shutil.which("fio") or "fio", paths, "cold")
    aligned = sum(s - s % 4096 for s in sizes)
    assert res.bytes == aligned and res.extra["unread_bytes"] == 100
    assert res.extra["files"] == 4 and res.extra["file_bytes"] == sum(sizes)
    assert [(r["files"], r["bs"]) for r in res.extra["runs"]] == [(2, 132 * KIB), (2, MIB + 4 * KIB)]
    assert res.ops == 4 and res.seconds > 0
    resident = [resident_bytes(p) for p in paths]
    if None not in resident:  # fincore present: nothing of them is cached after a cold O_DIRECT read
        assert resident == [0, 0, 0, 0]
    with pytest.raises(BenchSetupError, match="no files"):
        read_files_cold("fio", [], "none")


def test_read_files_cold_reads_hundreds_of_files_with_long_paths(disk_dir: Path) -> None:
    """A prompt's shared-tier files: 300 paths of over 100 characters, far beyond what one fio option takes
    (4096 characters: fio refused the list, "value exceeds max length")."""
    if shutil.which("fio") is None:
        pytest.skip("fio is missing (apt-get install fio)")
    deep = disk_dir / ("d" * 60)
    deep.mkdir()
    paths = []
    for i in range(300):
        path = deep / f"{i:064x}.kvb"
        path.write_bytes(os.urandom(8192))
        paths.append(str(path))
    assert len(":".join(paths)) > 10 * FIO_MAX_VALUE
    res = read_files_cold(shutil.which("fio") or "fio", paths, "many")
    assert res.bytes == 300 * 8192 and res.ops == 300 and res.extra["unread_bytes"] == 0
