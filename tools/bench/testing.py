"""Helpers for tests of the bench (as :mod:`sfstore.testing` is for sfstore's own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_bench"]

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
