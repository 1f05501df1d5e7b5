"""The crash harnesses' command lines (``python -m sfstore.testing.block_crash DIR [TRIALS]``) take no option for
a directory, and refuse counts that mean nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HARNESSES = ["sfstore.testing.block_crash", "sfstore.testing.checkpoint_crash"]


@pytest.mark.parametrize("module", HARNESSES)
def test_help_prints_usage_and_makes_no_directory(module: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and f"python -m {module}" in p.stdout, p.stderr
    assert list(tmp_path.iterdir()) == []  # not a directory named --help full of trials


@pytest.mark.parametrize("module", HARNESSES)
@pytest.mark.parametrize("count", ["0", "-3", "many"])
def test_a_count_that_means_nothing_is_refused(module: str, count: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", module, str(tmp_path / "d"), count], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "trials" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "d").exists()
