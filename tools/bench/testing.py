"""Helpers for tests of the bench (as :mod:`sfstore.testing` is for sfstore's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "run_bench", "bench_report"]

#: The repository root: ``python -m tools.bench`` runs from there.
ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m tools.bench ARGS`` from the repository root (on ``PYTHONPATH``), output captured as text.

    Parameters
    ----------
    *args : str
        The command line after ``tools.bench`` (suite, options).
    env : dict, optional
        The environment (default: this process's).
    timeout : float
        Seconds before :class:`subprocess.TimeoutExpired`.
    """
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "tools.bench", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def bench_report(proc: subprocess.CompletedProcess[str], out: Path, bench: str) -> dict[str, Any]:
    """The JSON report ``out`` of the run ``proc`` of the suite ``bench``, checked: the run succeeded without a
    traceback, and the report names the suite, the machine and the date. Where the filesystem refuses O_DIRECT
    the calling test is skipped."""
    import pytest

    if proc.returncode == 2 and "O_DIRECT" in proc.stderr:
        pytest.skip(f"this filesystem refuses O_DIRECT: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["bench"] == bench and isinstance(doc["machine"], dict) and doc["date"], {
        k: doc.get(k) for k in ("bench", "machine", "date")}
    return doc
