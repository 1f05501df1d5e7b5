"""What every suite does with its cases, by the rules of ``BENCHMARKING.md``: choose them (``--cases`` globs,
``--quick``) and run each as interleaved pairs of its two sides, warm-up pairs first, in ABBA order.

A suite's case is its own frozen dataclass (its fields are its shape); what this module needs of one is its
name (its ``name`` attribute, or a ``name`` function for cases named per run). A case runs as::

    ours, theirs = run_pairs(run_ours, run_theirs, repeat=args.repeat, warmup=args.warmup)

where ``run_ours(pair)`` and ``run_theirs(pair)`` make the side's file or cache cold and time one run of it
(both sides the same work); ``ours.runs`` / ``ours.warmup`` are the measured and the warm-up runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, TypeVar

from tools.bench.common import BenchSetupError, match_any, warn
from tools.bench.measure import RunResult

__all__ = ["Case", "SideFailed", "SideRuns", "select_cases", "run_pairs", "warn_if_few_pairs", "warn_short_runs",
           "MIN_PAIRS", "SHORT_RUN_S"]

#: ``BENCHMARKING.md`` rule 4: at least this many pairs before a ratio is worth quoting.
MIN_PAIRS = 3
#: A run shorter than this is noisy (fio times whole milliseconds).
SHORT_RUN_S = 0.1


class Case:
    """The base of a suite's case: a frozen dataclass of the suite's own, whose fields are the case's shape, whose
    ``name`` is what ``--cases`` globs match, and whose ``op`` is what sfstore's side does."""

    op: str

    @property
    def writes(self) -> bool:
        """Whether sfstore's side writes (``put``, ``save``, ``write``, ``randwrite``)."""
        return self.op in ("put", "save") or self.op.endswith("write")


C = TypeVar("C")


def select_cases(suite: str, cases: Sequence[C], patterns: Sequence[str] | None, quick_names: Iterable[str],
                 quick: bool, name: Callable[[C], str] | None = None,
                 quick_key: Callable[[C], str] | None = None) -> list[C]:
    """The cases a suite runs, in the order of ``cases``.

    Parameters
    ----------
    suite : str
        The suite's name (for the message).
    cases : sequence
        Every case of the suite, in run order.
    patterns : sequence of str or None
        ``--cases``: shell globs (an item may hold several, comma-separated); a case runs when its name matches one.
    quick_names : iterable of str
        ``--quick``: the keys of the cases it keeps.
    quick : bool
        Keep only those.
    name : callable or None
        A case's name (default: its ``name`` attribute).
    quick_key : callable or None
        What ``quick_names`` holds of a case (default: its name).

    Returns
    -------
    list
        The selection.

    Raises
    ------
    BenchSetupError
        When nothing is left; the message lists (the first few) case names.
    """
    globs = [g.strip() for item in (patterns or []) for g in item.split(",") if g.strip()]
    name_of: Callable[[C], str] = name if name is not None else attrgetter("name")
    key = quick_key or name_of
    wanted = set(quick_names)
    chosen = [c for c in cases if not quick or key(c) in wanted]
    if globs:
        chosen = [c for c in chosen if match_any(name_of(c), globs)]
    if not chosen:
        shown = ", ".join(name_of(c) for c in cases[:6]) + (", ..." if len(cases) > 6 else "")
        raise BenchSetupError(f"no {suite} case matches {', '.join(globs) or '--quick'} (the cases are {shown})")
    return chosen


class SideFailed(Exception):
    """A side cannot go on in this case (a reference that failed or is missing here, an sfstore part that is not
    built): :func:`run_pairs` keeps the message as the side's status and runs that side no more, while the other
    side goes on. Any other exception ends the case."""


@dataclass
class SideRuns:
    """One side's runs of a case.

    Attributes
    ----------
    runs : list of RunResult
        The measured runs, in pair order.
    warmup : list of RunResult
        The warm-up runs (left out of every figure).
    status : str
        ``ok``, or why the side stopped (:class:`SideFailed`'s message).
    """

    runs: list[RunResult] = field(default_factory=list)
    warmup: list[RunResult] = field(default_factory=list)
    status: str = "ok"

    @property
    def ok(self) -> bool:
        """Whether the side ran every pair."""
        return self.status == "ok"


def run_pairs(ours: Callable[[int], RunResult], theirs: Callable[[int], RunResult], *, repeat: int, warmup: int = 0,
              before_pair: Callable[[int], None] | None = None) -> tuple[SideRuns, SideRuns]:
    """Run ``warmup + repeat`` interleaved pairs of one case in ABBA order: pair ``i`` runs ``ours(i)`` first when
    ``i`` is even, ``theirs(i)`` first when it is odd.

    The host caches the virtual disk, so the side that goes second can find the data warm there; alternating who
    goes first cancels that out of the pairwise ratios. Warm-up pairs run the same way and are kept apart: on a VM
    the first touch of fresh guest memory, and buffers a side keeps for its next run, make a first run unlike the
    ones after it.

    Parameters
    ----------
    ours, theirs : callable
        ``side(pair) -> RunResult``: one cold, timed run of the side (its cache dropped inside). A side raises
        :class:`SideFailed` to stop for the rest of the case.
    repeat : int
        Measured pairs.
    warmup : int
        Pairs run first and kept apart.
    before_pair : callable or None
        ``before_pair(pair)``, called before each pair (e.g. a new seeded order shared by both sides of it).

    Returns
    -------
    tuple of SideRuns
        ``(ours, theirs)``.
    """
    sides = (SideRuns(), SideRuns())
    calls = (ours, theirs)
    for pair in range(max(0, warmup) + repeat):
        if before_pair is not None:
            before_pair(pair)
        for which in ((0, 1) if pair % 2 == 0 else (1, 0)):
            side = sides[which]
            if not side.ok:
                continue
            try:
                result = calls[which](pair)
            except SideFailed as exc:
                side.status = str(exc)
                continue
            (side.warmup if pair < warmup else side.runs).append(result)
    return sides


def warn_short_runs(cases: Iterable[dict[str, Any]], advice: str) -> None:
    """Warn, with ``advice``, naming the case documents with a run of either side under :data:`SHORT_RUN_S`."""
    short = [c["name"] for c in cases
             if any(r["seconds"] < SHORT_RUN_S for r in c["sfstore"].get("runs", []) + c["reference"].get("runs", []))]
    if short:
        warn(f"runs under {SHORT_RUN_S}s in {', '.join(short)}: noisy{advice}")


def warn_if_few_pairs(repeat: int) -> None:
    """Warn that figures from fewer than :data:`MIN_PAIRS` pairs are not to be quoted."""
    if repeat < MIN_PAIRS:
        warn(f"--repeat {repeat}: BENCHMARKING.md asks for at least {MIN_PAIRS} pairs; do not quote these figures")
