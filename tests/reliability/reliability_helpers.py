"""Helpers of the reliability suite: a child process under resource limits (``from reliability_helpers import
run_child``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ChildResult", "run_child"]


@dataclass(frozen=True)
class ChildResult:
    """How a child process ended: ``returncode`` (negative: killed by that signal), its output."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


def run_child(
    code: str,
    *,
    address_space: int | None = None,
    max_processes: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    cwd: str | Path | None = None,
) -> ChildResult:
    """Run ``code`` (dedented) in a fresh interpreter, optionally under ``RLIMIT_AS`` (bytes) and
    ``RLIMIT_NPROC`` (threads count against it); a hang is a test failure (``TimeoutExpired``)."""
    limits = []
    if address_space is not None:
        limits.append(f"resource.setrlimit(resource.RLIMIT_AS, ({address_space}, {address_space}))")
    if max_processes is not None:
        limits.append(f"resource.setrlimit(resource.RLIMIT_NPROC, ({max_processes}, {max_processes}))")
    prologue = "import resource\n" + "\n".join(limits) + "\n" if limits else ""
    full_env = dict(os.environ)
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
    return ChildResult(done.returncode, done.stdout, done.stderr)
