"""The runner every bench suite shares (``tools.bench.pairs``): ABBA order, warm-up pairs kept apart, a side that
stops while the other goes on, and the selection of cases by ``--cases`` globs and ``--quick``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tools.bench.common import BenchSetupError
from tools.bench.measure import RunResult
from tools.bench.pairs import Case, SideFailed, run_pairs, select_cases, warn_short_runs


def _recorder(log: list[str], side: str, fail_at: int | None = None) -> Callable[[int], RunResult]:
    def run(pair: int) -> RunResult:
        if pair == fail_at:
            raise SideFailed(f"{side} broke at pair {pair}")
        log.append(f"{side}{pair}")
        return RunResult(bytes=pair, ops=1, seconds=1.0, cpu_s=0.0)

    return run


def test_pairs_run_in_abba_order_with_warmup_apart() -> None:
    log: list[str] = []
    before: list[int] = []
    ours, theirs = run_pairs(_recorder(log, "A"), _recorder(log, "B"), repeat=3, warmup=1,
                             before_pair=before.append)
    assert log == ["A0", "B0", "B1", "A1", "A2", "B2", "B3", "A3"]
    assert before == [0, 1, 2, 3]
    assert [r.bytes for r in ours.warmup] == [0] and [r.bytes for r in ours.runs] == [1, 2, 3]
    assert [r.bytes for r in theirs.warmup] == [0] and [r.bytes for r in theirs.runs] == [1, 2, 3]
    assert ours.ok and theirs.ok


def test_a_failed_side_stops_and_the_other_goes_on() -> None:
    log: list[str] = []
    ours, theirs = run_pairs(_recorder(log, "A"), _recorder(log, "B", fail_at=2), repeat=4)
    assert log == ["A0", "B0", "B1", "A1", "A2", "A3"]
    assert not theirs.ok and theirs.status == "B broke at pair 2"
    assert [r.bytes for r in theirs.runs] == [0, 1] and len(ours.runs) == 4


def test_other_errors_end_the_case() -> None:
    def broken(pair: int) -> RunResult:
        raise BenchSetupError("the store lost data")

    with pytest.raises(BenchSetupError, match="lost data"):
        run_pairs(broken, broken, repeat=1)


@dataclass(frozen=True)
class _Case:
    name: str


def test_select_by_globs_and_quick() -> None:
    cases = [_Case(n) for n in ("read-4k", "read-1m", "write-1m")]
    assert [c.name for c in select_cases("t", cases, ["read-*"], (), False)] == ["read-4k", "read-1m"]
    assert [c.name for c in select_cases("t", cases, ["write-*, read-4k"], (), False)] == ["read-4k", "write-1m"]
    assert [c.name for c in select_cases("t", cases, None, ("read-1m",), True)] == ["read-1m"]
    assert [c.name for c in select_cases("t", cases, ["read-*"], ("write-1m", "read-1m"), True)] == ["read-1m"]
    named = select_cases("t", cases, ["1m"], ("m",), True, name=lambda c: c.name[-2:], quick_key=lambda c: c.name[-1])
    assert [c.name for c in named] == ["read-1m", "write-1m"]
    with pytest.raises(BenchSetupError, match=r"no t case matches nope \(the cases are read-4k, read-1m, write-1m\)"):
        select_cases("t", cases, ["nope"], (), False)


@dataclass(frozen=True)
class _OpCase(Case):
    op: str


def test_case_writes_for_every_writing_op() -> None:
    assert [_OpCase(op).writes for op in ("put", "save", "write", "randwrite")] == [True] * 4
    assert [_OpCase(op).writes for op in ("get", "load", "read", "randread")] == [False] * 4


def test_short_runs_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    def case(name: str, *seconds: float) -> dict[str, object]:
        return {"name": name, "sfstore": {"runs": [{"seconds": s} for s in seconds]}, "reference": {"status": "n/a"}}

    warn_short_runs([case("fast", 0.5, 0.05), case("slow", 0.5, 0.2)], "; use a bigger --size")
    assert capsys.readouterr().err == "warning: runs under 0.1s in fast: noisy; use a bigger --size\n"
    warn_short_runs([case("slow", 0.5)], "")
    assert capsys.readouterr().err == ""
