"""The benchmark report (``--report DIR``, ``all --readme``): charts, markdown tables and README's block, fed with
small synthetic suite documents (no benchmark runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.bench import cli, registry, report
from tools.bench.common import GIB, BenchSetupError
from tools.bench.registry import Suite

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DASH = "\N{EN DASH}"

MACHINE = {"hostname": "benchhost", "kernel": "6.1.0-test", "os": "Debian GNU/Linux 12", "cpu_model": "Test CPU 9000",
           "cpus": 8, "usable_cpus": 4, "mem_total_bytes": 32 * GIB, "load_avg": [0.5, 0.4, 0.3],
           "git_commit": "0123456789abcdef", "git_dirty": False,
           "filesystem": {"type": "ext4", "source": "/dev/vda", "device": "vda", "rotational": "0"}}


def _side(gib_s: float, iops: float = 1000.0) -> dict[str, Any]:
    return {"bytes_per_s": gib_s * GIB, "iops": iops, "cpu_s_per_gib": 0.5}


def _case(name: str, ratio: float | None, tool: str = "fio", lo: float | None = None, hi: float | None = None,
          **params: Any) -> dict[str, Any]:
    return {"name": name, "params": dict(params), "sfstore": _side(ratio or 1.0), "reference_tool": tool,
            "reference": _side(1.0), "ratio": ratio, "ratio_min": lo, "ratio_max": hi}


def engine_doc() -> dict[str, Any]:
    """No acceptance at all; one IOPS case."""
    return {"bench": "engine", "machine": MACHINE, "date": "2026-12-01T10:00:00+00:00",
            "cases": [_case("read-1m-qd32", 1.10, lo=0.87, hi=1.24, block_size=1 << 20),
                      _case("randread-4k-qd32", 0.97, lo=0.94, hi=1.00, block_size=4096)]}


def blocks_doc() -> dict[str, Any]:
    """Goals that name their case (blocks, files, kvcache): one PASS, one MISS, one not run."""
    return {"bench": "blocks", "machine": MACHINE, "date": "2026-12-01T10:05:00+00:00",
            "cases": [_case("get-256k", 1.15, lo=0.56, hi=1.17, block_size=256 << 10),
                      _case("put-256k", 0.65, lo=0.64, hi=0.70, block_size=256 << 10)],
            "acceptance": [
                {"goal": "256k get >= 0.85x fio", "case": "get-256k", "target": 0.85, "ratio": 1.15,
                 "status": "met", "met": True, "line": "goal: 256k get >= 0.85x fio: PASS, 1.15x"},
                {"goal": "256k put >= 0.85x fio", "case": "put-256k", "target": 0.85, "ratio": 0.65,
                 "status": "missed", "met": False, "line": "goal: 256k put >= 0.85x fio: MISS, 0.65x"},
                {"goal": "4k get IOPS >= 0.7x fio", "case": "get-4k", "target": 0.7, "status": "not run",
                 "met": None, "line": "goal: 4k get IOPS >= 0.7x fio: not run (not selected: --cases / --quick)"},
            ]}


def checkpoint_doc() -> dict[str, Any]:
    """Goals that name no case (checkpoint): matched by value; a memory goal stays apart."""
    return {"bench": "checkpoint", "machine": MACHINE, "date": "2026-12-01T10:09:00+00:00",
            "cases": [_case("save-2g-vs-torch.save", 2.46, tool="torch.save", lo=2.1, hi=3.0),
                      _case("save_async-blocking-2g", 6.71, tool="sfstore.checkpoint.save", lo=1.69, hi=23.99),
                      _case("load-2g-vs-torch.load", 1.33, tool="torch.load", lo=0.4, hi=1.9)],
            "acceptance": [
                {"goal": "save >= 2x torch.save", "value": 2.46, "target": 2.0, "met": True,
                 "line": "save >= 2x torch.save: met (2.46x)"},
                {"goal": "load >= 2x torch.load", "value": 1.33, "target": 2.0, "met": False,
                 "line": "load >= 2x torch.load: missed by 0.67x (1.33x)"},
                {"goal": "load peak RSS growth <= 1.15x tensor bytes (2355 MiB)", "value": 2.0e9,
                 "target": 2.47e9, "met": True, "line": "load peak RSS growth <= 1.15x tensor bytes: met (1996 MiB)"},
            ]}


def kvcache_doc() -> dict[str, Any]:
    """A reference that did not run: no ratio, sides n/a, the goal n/a."""
    case = _case("nvme-get-vs-nixl", None, tool="nixl")
    case["reference"] = {"status": "nixl not installed (No module named 'nixl'); create .venv-kvbench with ..."}
    return {"bench": "kvcache", "machine": MACHINE, "date": "2026-12-01T10:12:00+00:00", "cases": [case],
            "acceptance": [{"goal": "NVMe-tier get >= 1x NIXL", "case": "nvme-get-vs-nixl", "target": 1.0,
                            "status": "n/a", "met": None, "reason": "nixl not installed",
                            "line": "goal: NVMe-tier get >= 1x NIXL: n/a (nixl not installed)"}]}


def all_docs() -> list[dict[str, Any]]:
    return [engine_doc(), blocks_doc(), checkpoint_doc(), kvcache_doc()]


def test_case_goals_per_case_and_other() -> None:
    per_case, other = report.case_goals(blocks_doc())
    assert [g.verdict for g in per_case["get-256k"]] == ["PASS"]
    assert [g.verdict for g in per_case["put-256k"]] == ["MISS"] and per_case["put-256k"][0].target == 0.85
    assert [g.verdict for g in other] == ["not run"]
    per_case, other = report.case_goals(checkpoint_doc())
    assert per_case["save-2g-vs-torch.save"][0].target == 2.0
    assert per_case["load-2g-vs-torch.load"][0].verdict == "MISS"
    assert [g.text.startswith("load peak RSS") for g in other] == [True]
    assert report.case_goals(engine_doc()) == ({}, [])


def test_a_ratio_just_under_its_goal_gets_a_third_decimal() -> None:
    goal = report.Goal("save >= 1.3x safetensors", "MISS", "", 1.3)
    assert report._fmt_ratio(1.2997, [goal]) == "1.2997" and report._fmt_ratio(1.297, [goal]) == "1.297"
    assert report._fmt_ratio(1.2997) == "1.30" and report._fmt_ratio(1.3, [goal]) == "1.30"


def test_report_writes_charts_and_tables(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r"
    written = report.write_report(str(out), all_docs(), command="python -m tools.bench all --quick")
    for name in ("engine", "blocks", "checkpoint", "kvcache"):
        png = out / f"{name}.png"
        assert str(png) in written and png.read_bytes()[:8] == PNG_MAGIC, name
        assert json.loads((out / f"{name}.json").read_text())["bench"] == name
        assert (out / f"{name}.txt").exists()
    index = (out / "index.md").read_text()
    assert f"2026-12-01 10:00{DASH}10:12 UTC" in index
    assert "benchhost: Test CPU 9000, 8 CPUs (4 usable), 32.0 GiB RAM, Linux 6.1.0-test" in index
    assert "`0123456`" in index and "`python -m tools.bench all --quick`" in index
    assert "![blocks: sfstore / reference per case](blocks.png)" in index
    assert f"| `get-256k` | 1.150 GiB/s | fio: 1.000 GiB/s | 1.15 (0.56{DASH}1.17) | ≥ 0.85x PASS |" in index
    assert "| `put-256k` |" in index and "≥ 0.85x **MISS**" in index
    assert "| `randread-4k-qd32` | 1.0k IOPS |" in index
    assert "| `save-2g-vs-torch.save` |" in index and "≥ 2x PASS" in index
    assert "PASS — load peak RSS growth" in index
    assert "not run (case not selected): 4k get IOPS >= 0.7x fio" in index
    assert "| `nvme-get-vs-nixl` | 1.000 GiB/s | nixl: n/a (nixl not installed) | n/a | ≥ 1x n/a |" in index
    assert "Charts skipped" not in index


def test_report_without_matplotlib_skips_charts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "r"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{report.README_START}\nold\n{report.README_END}\n")
    report.write_report(str(out), all_docs(), readme=str(readme))
    assert not list(out.glob("*.png"))
    assert "Charts skipped: matplotlib is not installed" in (out / "index.md").read_text()
    assert "No charts: matplotlib is not installed" in readme.read_text()


def test_a_failing_chart_does_not_cost_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("no fonts")

    monkeypatch.setattr(report, "_matplotlib_missing", lambda: None)
    monkeypatch.setattr(report, "_chart", broken)
    report.write_report(str(tmp_path), [engine_doc()])
    assert "chart failed for engine: RuntimeError: no fonts" in (tmp_path / "index.md").read_text()


def test_doc_without_machine_or_acceptance_renders(tmp_path: Path) -> None:
    doc = {"bench": "bare", "date": "not a date", "cases": [_case("x", 1.5)]}
    report.write_report(str(tmp_path), [doc, {"bench": "broken", "date": "now", "error": "fio is missing",
                                              "cases": []}])
    index = (tmp_path / "index.md").read_text()
    assert "| `x` | 1.500 GiB/s | fio: 1.000 GiB/s | 1.50 | — |" in index
    assert "**Machine:** " in index and "Did not run: fio is missing" in index


def test_readme_block_is_the_only_thing_rewritten(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    before = "# Project\n\n## Performance\n\nProse that stays.\n\n"
    after = "\nMore prose.\n\n## Development\n\nText.\n"
    readme.write_text(f"{before}{report.README_START}\nstale table\n{report.README_END}\n{after}")
    out = tmp_path / "docs" / "bench"
    report.write_report(str(out), all_docs(), command="python -m tools.bench all", readme=str(readme))
    text = readme.read_text()
    assert text.startswith(before + report.README_START + "\n") and text.endswith(report.README_END + "\n" + after)
    block = text[len(before):-len(after)]
    assert "stale table" not in block
    assert f"| suite | case | sfstore | reference | ratio (min{DASH}max) | goal |" in block
    assert "| blocks | `put-256k` |" in block and "**MISS**" in block and "PASS" in block
    assert f"2026-12-01 10:00{DASH}10:12 UTC" in block and "benchhost" in block
    assert "`python -m tools.bench all`" in block and "docs/bench/index.md" in block
    if report._matplotlib_missing() is None:
        assert "[blocks](docs/bench/blocks.png)" in block
    report.write_report(str(out), all_docs(), command="python -m tools.bench all", readme=str(readme))
    assert readme.read_text() == text  # the same run gives the same README


@pytest.mark.parametrize("body", ["no markers here\n", f"{report.README_END}\n{report.README_START}\n",
                                  f"{report.README_START}\n{report.README_START}\n{report.README_END}\n"])
def test_readme_without_a_proper_block_is_left_alone(tmp_path: Path, body: str) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(body)
    with pytest.raises(ValueError, match="bench-report"):
        report.update_readme(str(readme), "table")
    assert readme.read_text() == body


def _dummy_suites(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []

    def run_ok(args: Any) -> dict[str, Any]:
        seen.append(args)
        doc = blocks_doc()
        doc["bench"] = "good"
        return doc

    def run_fails(args: Any) -> dict[str, Any]:
        raise BenchSetupError("fio is missing (apt-get install fio)")

    registry.load_suites()
    monkeypatch.setattr(registry, "_SUITES", {"good": Suite("good", "ok", lambda p: None, run_ok),
                                              "bad": Suite("bad", "fails", lambda p: None, run_fails)})
    return seen


def test_all_report_readme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _dummy_suites(monkeypatch)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\n{report.README_END}\nend\n")
    out = tmp_path / "docs" / "bench"
    rc = cli.main(["all", "--quick", "--report", str(out), "--readme", str(readme)])
    assert rc == 0 and seen and seen[0].quick
    text = readme.read_text()
    assert "| good | `get-256k` |" in text and "- bad: did not run (fio is missing (apt-get install fio))" in text
    assert f"python -m tools.bench all --quick --report {out} --readme {readme}" in text
    assert "Did not run: fio is missing" in (out / "index.md").read_text()


def test_all_readme_needs_report(monkeypatch: pytest.MonkeyPatch) -> None:
    _dummy_suites(monkeypatch)
    with pytest.raises(SystemExit):
        cli.main(["all", "--readme", "README.md"])


def test_all_fails_when_no_suite_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    registry.load_suites()

    def run_fails(args: Any) -> dict[str, Any]:
        raise BenchSetupError("nothing here")

    monkeypatch.setattr(registry, "_SUITES", {"bad": Suite("bad", "fails", lambda p: None, run_fails)})
    assert cli.main(["all", "--report", str(tmp_path)]) == 2
    assert "no suite could run here" in capsys.readouterr().err


def test_all_goes_on_after_a_crashing_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _dummy_suites(monkeypatch)

    def run_crashes(args: Any) -> dict[str, Any]:
        raise AttributeError("'BlockStore' object has no attribute 'checksum'")

    suites = dict(registry._SUITES)
    suites["aaa"] = Suite("aaa", "crashes", lambda p: None, run_crashes)  # runs first
    monkeypatch.setattr(registry, "_SUITES", suites)
    assert cli.main(["all", "--report", str(tmp_path)]) == 1
    assert seen  # the suite after it ran
    index = (tmp_path / "index.md").read_text()
    assert "Did not run: crashed: AttributeError" in index and "| `get-256k` |" in index

