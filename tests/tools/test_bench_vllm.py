"""The ``vllm`` bench suite's document and its report: the pair cases and goals it derives from each side's time to
first token, and ``write_report`` (text table, index, chart, README block) fed with a synthetic document of the
suite's shape and with one of the shape it had before (per-length cases with ``sides`` only). No engine runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench import report
from tools.bench.common import GIB, render_ttft_table
from tools.bench.suites import vllm as suite

DASH = "\N{EN DASH}"
MACHINE = {"hostname": "benchhost", "kernel": "6.1.0-test", "cpu_model": "Test CPU", "cpus": 2,
           "mem_total_bytes": 8 * GIB, "git_commit": "0123456789abcdef", "git_dirty": False}


def _side(*ms: float) -> dict[str, Any]:
    samples = [m / 1e3 for m in ms]
    ordered = sorted(samples)
    return {"median_s": ordered[len(ordered) // 2], "min_s": ordered[0], "max_s": ordered[-1], "samples_s": samples,
            "cached_tokens": [1504] * len(ms)}


def ttft_entries() -> list[dict[str, Any]]:
    """Two prompt lengths; at 1536 tokens one goal met, one missed, and the peer failed at 512."""
    return [
        {"name": "ttft-512", "params": {"prompt_tokens": 512},
         "sides": {"none": _side(20, 21, 22), "sfstore-pinned": _side(6, 6, 7),
                   "sfstore-shared-cold": _side(9, 10, 11), "example-cold": {"error": "engine process exited 1"},
                   "sfstore-miss": _side(22, 23, 24)}},
        {"name": "ttft-1536", "params": {"prompt_tokens": 1536},
         "sides": {"none": _side(46, 48, 50), "sfstore-pinned": _side(12, 12.5, 13),
                   "sfstore-shared-cold": _side(20, 22, 24), "example-cold": _side(14, 15, 16),
                   "example-warm": _side(19, 20, 21), "sfstore-miss": _side(50, 51, 52),
                   "floor": _side(9, 10, 11)}},
    ]


def vllm_doc() -> dict[str, Any]:
    ttft = ttft_entries()
    cases, acceptance = suite.pair_cases(ttft)
    return {"bench": "vllm", "machine": MACHINE, "date": "2026-12-01T10:30:00+00:00", "ttft": ttft, "cases": cases,
            "acceptance": acceptance,
            "params": {"lengths": [512, 1536], "repeat": 3, "eager": False,
                       "files": {"sfstore-shared": {"files": 141, "bytes": 19_054_592,
                                                    "resident_bytes_after_evict": 0},
                                 "example": {"files": 12, "bytes": 18_450_000, "resident_bytes_after_evict": 0}}}}


def test_pair_cases_ratios_and_goals() -> None:
    cases, acceptance = suite.pair_cases(ttft_entries())
    by_name = {c["name"]: c for c in cases}
    shared = by_name["ttft-1536-shared-cold-vs-none"]
    # the other side's TTFT over ours, prompt by prompt: 46/20, 48/22, 50/24
    assert shared["ratio"] == pytest.approx(48 / 22)
    assert (shared["ratio_min"], shared["ratio_max"]) == (pytest.approx(50 / 24), pytest.approx(46 / 20))
    assert shared["ttft_ratio"] == pytest.approx(22 / 48)
    assert shared["reference_tool"] == "vLLM, no connector"
    assert by_name["ttft-1536-shared-cold-vs-example"]["reference_tool"] == "vLLM ExampleConnector"
    assert by_name["ttft-512-shared-cold-vs-example"]["ratio"] is None  # the peer did not run at 512
    assert "ttft-1536-miss-vs-none" in by_name
    goals = {a["case"]: a for a in acceptance}
    assert set(goals) == {"ttft-1536-shared-cold-vs-none", "ttft-1536-pinned-vs-none",
                          "ttft-1536-shared-cold-vs-example", "ttft-1536-pinned-vs-example-warm"}  # at 1536 only
    warm = goals["ttft-1536-pinned-vs-example-warm"]  # the peer's hit in the process that saved: 20 / 12.5 = 1.6
    assert warm["status"] == "met" and warm["ratio"] == pytest.approx(20 / 12.5)
    assert by_name["ttft-1536-pinned-vs-example-warm"]["reference_tool"] == "vLLM ExampleConnector"
    assert "ttft-512-pinned-vs-example-warm" not in by_name  # no such side at 512
    # the floor (vLLM's own time for a hit) bounds every goal: the other side's TTFT over it
    assert warm["bound"] == pytest.approx(20 / 10) and goals["ttft-1536-pinned-vs-none"]["bound"] == pytest.approx(4.8)
    assert warm["line"].endswith("; a connector with free loads: 2.00x")
    assert not any(c["params"]["side"] == "floor" or c["params"]["versus"] == "floor" for c in cases)
    assert goals["ttft-1536-shared-cold-vs-none"]["target"] == 2.0
    assert goals["ttft-1536-shared-cold-vs-none"]["status"] == "met"
    assert goals["ttft-1536-pinned-vs-none"]["target"] == 5.0
    assert goals["ttft-1536-pinned-vs-none"]["status"] == "missed"  # 48 / 12.5 = 3.84
    assert goals["ttft-1536-shared-cold-vs-example"]["status"] == "missed"
    assert goals["ttft-1536-shared-cold-vs-example"]["line"].startswith(
        "goal: 1536-token TTFT, sfstore-shared-cold >= 1.5x faster than example-cold: MISS")
    # a cold hit is bounded by the pinned hit too (the same hit, nothing read from disk): 15 / 12.5
    cold = goals["ttft-1536-shared-cold-vs-example"]
    assert cold["bound_no_disk"] == pytest.approx(15 / 12.5)
    assert cold["line"].endswith("; a connector with free loads: 1.50x; a cold read costing no more than a pinned "
                                 "hit: 1.20x")
    assert "bound_no_disk" not in goals["ttft-1536-shared-cold-vs-none"] and "bound_no_disk" not in warm


def test_pair_cases_goal_na_when_a_side_failed() -> None:
    ttft = ttft_entries()
    ttft[1]["sides"]["example-cold"] = {"error": "ExampleConnector: no such connector"}
    _, acceptance = suite.pair_cases(ttft)
    peer = next(a for a in acceptance if a["case"] == "ttft-1536-shared-cold-vs-example")
    assert peer["status"] == "n/a" and "no such connector" in peer["reason"]


def test_ttft_table_has_a_column_per_side() -> None:
    text = render_ttft_table(ttft_entries())
    head, *rows = text.splitlines()
    # the sides in the order they first appear (example-warm only at 1536)
    assert head.split() == ["TTFT", "(ms)", "none", "sfstore-pinned", "sfstore-shared-cold", "example-cold",
                            "sfstore-miss", "example-warm", "floor"]
    assert rows[1].startswith("ttft-1536") and "48.0 ms (46.0-50.0)" in rows[1]
    assert "n/a (engine process exited 1)" in rows[0]


def test_write_report_renders_the_vllm_suite(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# project\n\n{report.README_START}\nold\n{report.README_END}\n", encoding="utf-8")
    out = tmp_path / "bench"
    written = report.write_report(str(out), [vllm_doc()], command="python -m tools.bench vllm --quick",
                                  readme=str(readme))
    assert str(out / "vllm.json") in written and str(out / "index.md") in written
    assert json.loads((out / "vllm.json").read_text())["bench"] == "vllm"
    text = (out / "vllm.txt").read_text()
    assert text.startswith("TTFT (ms)")
    assert "ttft-1536-shared-cold-vs-example" in text  # the case column is as wide as the longest name
    assert "22.0 ms" in text and "48.0 ms" in text
    assert "goal: 1536-token TTFT, sfstore-pinned <= 0.2x none: MISS" in text
    index = (out / "index.md").read_text()
    assert "| `ttft-1536-shared-cold-vs-none` | 22.0 ms TTFT | vLLM, no connector: 48.0 ms TTFT |" in index
    assert "≥ 2x PASS" in index and "≥ 5x **MISS**" in index
    assert f"| `ttft-1536` | 48.0 ms (46.0{DASH}50.0) | 12.5 ms (12.0{DASH}13.0) |" in index
    assert "sfstore-shared: 141 files, 18.2 MiB, 0 bytes resident after the eviction" in index
    block = readme.read_text()
    assert "\nold\n" not in block
    assert "| vllm | `ttft-1536-pinned-vs-none` | 12.5 ms TTFT | vLLM, no connector: 48.0 ms TTFT |" in block
    assert "| vllm | `ttft-512-shared-cold-vs-example` | 10.0 ms TTFT | vLLM ExampleConnector: n/a (engine" in block
    if (out / "vllm.png").exists():
        assert (out / "vllm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_report_renders_a_document_of_the_older_shape(tmp_path: Path) -> None:
    """Per-length cases holding only ``sides`` (the suite's shape before its pair cases) crashed the report with
    ``KeyError: 'sfstore'``; they render as the TTFT table."""
    doc = {"bench": "vllm", "machine": MACHINE, "date": "2026-12-01T10:30:00+00:00", "cases": ttft_entries()}
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.README_START}\n{report.README_END}\n", encoding="utf-8")
    report.write_report(str(tmp_path / "bench"), [doc], readme=str(readme))
    assert (tmp_path / "bench" / "vllm.txt").read_text().startswith("TTFT (ms)")
    assert f"| `ttft-512` | 21.0 ms (20.0{DASH}22.0) |" in (tmp_path / "bench" / "index.md").read_text()


FAKE_ENGINE = '''
import json, sys
spec = json.load(open(sys.argv[2]))
print("INFO vLLM says hello")  # an engine's own output on stdout, ignored by the suite
if spec.get("fail"):
    print("@@error " + json.dumps({"error": "ValueError: no such connector"}), flush=True)
    sys.exit(0)
print("@@ready {}", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("quit"):
        break
    n = int(cmd.get("repeat", 1))
    print("some log line", flush=True)
    print("@@reply " + json.dumps({"ttft_s": [len(cmd["prompt"]) / 1e3] * n, "cached": [7] * n}), flush=True)
'''


def _fake_python(tmp_path: Path) -> str:
    """An "engine venv's python" that runs the fake engine above instead of vllm_ttft.py (its first argument)."""
    import sys

    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake_engine.py'} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_engine_process_protocol(tmp_path: Path) -> None:
    """The suite keeps each side's engine process alive and asks it one prompt at a time over stdin/stdout, skipping
    the engine's own output; a process that cannot start makes every answer its error."""
    python = _fake_python(tmp_path)
    engine = suite._Engine(python, tmp_path, "side", {"model": "m", "connector": "none"})
    try:
        assert engine.error is None
        assert engine.ask([1, 2, 3], repeat=2) == {"ttft_s": [0.003, 0.003], "cached": [7, 7]}
        assert engine.ask([1] * 10) == {"ttft_s": [0.01], "cached": [7]}
    finally:
        engine.close()
    assert "INFO vLLM says hello" in (tmp_path / "side.log").read_text()
    broken = suite._Engine(python, tmp_path, "broken", {"model": "m", "connector": "none", "fail": True})
    assert broken.error == "ValueError: no such connector"
    assert broken.ask([1]) == {"error": "ValueError: no such connector"}
