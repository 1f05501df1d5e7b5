"""What the SIGKILL crash harnesses (:mod:`~sfstore.testing.block_crash`, :mod:`~sfstore.testing.checkpoint_crash`)
share: the report's common part, the forkserver their children start from, and their command line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["TrialReport", "forkserver", "main"]


@dataclass
class TrialReport:
    """What a harness's ``run_trials`` saw: the trials run, how long they took, and every failure found (a
    harness collects them here instead of raising)."""

    trials: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (for JSON)."""
        return asdict(self)


def forkserver(*preload: str) -> Any:
    """A ``multiprocessing`` forkserver context that has ``preload`` imported, so each trial's child starts in
    milliseconds, not in the seconds importing torch and sfstore takes."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def main(run_trials: Callable[[str, int], TrialReport], module: str, argv: list[str] | None = None) -> None:
    """``python -m <harness> DIR [TRIALS]``: run ``TRIALS`` (default 30) trials in ``DIR``, print the report."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description="SIGKILL a writer at random moments, then check what a reopen finds; prints a JSON report.",
    )
    parser.add_argument("dir", help="a directory for the trials' data (made if missing)")
    parser.add_argument("trials", nargs="?", type=int, default=30, help="how many trials (default 30)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.trials < 1:
        parser.error(f"trials must be at least 1, not {args.trials}")
    print(json.dumps(run_trials(args.dir, args.trials).as_dict(), indent=1))
