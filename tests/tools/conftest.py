"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.bench.common import BenchSetupError, check_bench_dir


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a disk filesystem (tmp_path, unless /tmp is tmpfs here, then one in the data directory)."""
    try:
        check_bench_dir(tmp_path)
        yield tmp_path
        return
    except BenchSetupError:
        pass
    from sfstore import defaults

    base = str(defaults.get("data_dir"))
    os.makedirs(base, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="test-bench-", dir=base))
    try:
        check_bench_dir(path)
    except BenchSetupError as exc:
        shutil.rmtree(path, ignore_errors=True)
        pytest.skip(f"no disk filesystem for benchmark files here: {exc}")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
