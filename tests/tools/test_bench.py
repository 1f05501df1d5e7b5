"""Tests of ``python -m tools.bench``: case plan, statistics, refusals, and the engine suite end to end (tiny)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tools.bench import cli, registry
from tools.bench.common import BenchSetupError, check_bench_dir, format_size, mount_of
from tools.bench.measure import RunResult, summarize_pairs
from tools.bench.options import parse_size
from tools.bench.registry import Suite
from tools.bench.suites.engine import QUICK_CASES, Case, all_cases, plan_offsets, select_cases
from tools.bench.testing import run_bench


def test_case_names_cover_every_shape() -> None:
    names = [c.name for c in all_cases()]
    assert len(names) == len(set(names)) == 4 * 4 * 3
    assert {"read-1m-qd32", "write-1m-qd32", "randread-4k-qd32", "randwrite-16m-qd1", "read-64k-qd8"} <= set(names)
    assert Case("randread", 4096, 32).name == "randread-4k-qd32"


def test_case_selection() -> None:
    assert [c.name for c in select_cases(quick=True)] == [n for n in (c.name for c in all_cases()) if n in QUICK_CASES]
    assert [c.name for c in select_cases(["read-*-qd32"])] == ["read-4k-qd32", "read-64k-qd32", "read-1m-qd32",
                                                               "read-16m-qd32"]
    assert {c.name for c in select_cases(["randread-4k-qd1,write-1m-qd8"])} == {"randread-4k-qd1", "write-1m-qd8"}
    with pytest.raises(BenchSetupError, match="no engine case"):
        select_cases(["nope-*"])


def test_plan_offsets() -> None:
    size = 1 << 20
    seq = plan_offsets(Case("read", 65536, 8), size, 4, seed=1)
    assert seq == [0, 65536, 131072, 196608]
    rnd = plan_offsets(Case("randread", 4096, 8), size, 100, seed=7)
    assert len(rnd) == len(set(rnd)) == 100
    assert all(o % 4096 == 0 and 0 <= o < size for o in rnd)
    assert rnd == plan_offsets(Case("randwrite", 4096, 1), size, 100, seed=7)
    assert sorted(plan_offsets(Case("randread", 4096, 8), size, 10**9, seed=7)) == list(range(0, size, 4096))


def test_sizes() -> None:
    assert parse_size("16m") == 16 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")
    assert [format_size(n) for n in (4096, 65536, 1 << 20, 16 << 20, 1 << 30, 1000)] == ["4k", "64k", "1m", "16m",
                                                                                      "1g", "1000"]


def test_pair_statistics() -> None:
    ours = [RunResult(1000, 1, 1.0, 0.1), RunResult(1000, 1, 0.5, 0.1), RunResult(1000, 1, 2.0, 0.1)]
    ref = [RunResult(1000, 1, 1.0, 0.1), RunResult(1000, 1, 1.0, 0.1), RunResult(1000, 1, 1.0, 0.1)]
    stats = summarize_pairs(ours, ref)
    assert stats["ratios"] == [1.0, 2.0, 0.5]
    assert (stats["ratio"], stats["ratio_min"], stats["ratio_max"]) == (1.0, 0.5, 2.0)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_refuses_memory_filesystems() -> None:
    with pytest.raises(BenchSetupError, match="/dev/shm"):
        check_bench_dir("/dev/shm/sfstore-bench")
    proc = run_bench("engine", "--dir", "/dev/shm/sfstore-bench", "--size", "16m", "--cases", "read-64k-qd8")
    assert proc.returncode == 2, proc.stderr
    assert "/dev/shm" in proc.stderr and "Traceback" not in proc.stderr


def test_proc_mount_is_refused() -> None:
    mount = mount_of("/proc")
    assert mount is not None and mount.fstype == "proc"
    with pytest.raises(BenchSetupError, match="proc"):
        check_bench_dir("/proc/sfstore-bench-does-not-exist")


def test_missing_fio_is_named(disk_dir: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = str(disk_dir / "empty-path")
    proc = run_bench("engine", "--dir", str(disk_dir), "--size", "16m", "--cases", "read-64k-qd8", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "apt-get install fio" in proc.stderr and "Traceback" not in proc.stderr


def test_all_runs_every_suite_and_writes_json_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def run(args: Any) -> dict[str, Any]:
        seen.append(args)
        case = {"name": "noop-4k-qd1", "params": {"block_size": 4096},
                "sfstore": {"bytes_per_s": 2.0, "iops": 1.0, "cpu_s_per_gib": 0.5}, "reference_tool": "nothing",
                "reference": {"bytes_per_s": 1.0, "iops": 1.0, "cpu_s_per_gib": 0.25}, "ratio": 2.0}
        return {"bench": "dummy", "machine": {}, "date": "now", "cases": [case]}

    def add_arguments(p: Any) -> None:
        p.add_argument("--knob", type=int, default=1)

    registry.load_suites()
    monkeypatch.setattr(registry, "_SUITES", {"dummy": Suite("dummy", "a test suite", add_arguments, run)})
    out = tmp_path / "all.json"
    rc = cli.main(["all", "--repeat", "4", "--knob", "7", "--json", str(out), "--report", str(tmp_path / "r")])
    assert rc == 0
    assert seen[0].repeat == 4 and seen[0].knob == 7
    doc = json.loads(out.read_text())
    assert doc["bench"] == "all" and doc["suites"][0]["bench"] == "dummy"
    assert (tmp_path / "r" / "dummy.json").exists() and "noop-4k-qd1" in (tmp_path / "r" / "dummy.txt").read_text()
    with pytest.raises(SystemExit):
        cli.main(["all", "--no-such-option"])


def _engine_ready() -> str | None:
    if shutil.which("fio") is None:
        return "fio is missing (apt-get install fio)"
    try:
        engine = importlib.import_module("sfstore.engine")
    except ImportError as exc:
        return f"sfstore.engine cannot be imported: {exc}"
    if not hasattr(engine, "get_engine"):
        return "sfstore.engine has no get_engine yet"
    return None


def test_engine_suite_end_to_end(disk_dir: Path) -> None:
    reason = _engine_ready()
    if reason:
        pytest.skip(reason)
    out = disk_dir / "engine.json"
    proc = run_bench("engine", "--engine", "python", "--dir", str(disk_dir), "--size", "16m",
                  "--cases", "read-64k-qd8,randwrite-4k-qd8", "--repeat", "1", "--json", str(out))
    if proc.returncode == 2 and "O_DIRECT" in proc.stderr:
        pytest.skip(f"this filesystem refuses O_DIRECT: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "read-64k-qd8" in proc.stdout and "randwrite-4k-qd8" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["bench"] == "engine" and isinstance(doc["machine"], dict) and doc["date"]
    assert [c["name"] for c in doc["cases"]] == ["read-64k-qd8", "randwrite-4k-qd8"]
    for case in doc["cases"]:
        assert {"name", "params", "sfstore", "reference_tool", "reference", "ratio"} <= set(case)
        assert case["reference_tool"] == "fio"
        for side in (case["sfstore"], case["reference"]):
            for key in ("bytes_per_s", "iops", "cpu_s_per_gib"):
                assert isinstance(side[key], float) and side[key] > 0, (case["name"], key, side[key])
        params = case["params"]
        assert params["engine"] == "python" and params["queue_depth"] == 8 and params["direct"] is True
        # both sides moved the same bytes: the planned byte count, in every run
        assert case["same_bytes"] is True
        assert case["sfstore"]["bytes"] == case["reference"]["bytes"] == params["io_bytes"] == 16 << 20
        assert case["ratio"] == pytest.approx(case["sfstore"]["bytes_per_s"] / case["reference"]["bytes_per_s"])
    # the file is reused by the next run
    assert (disk_dir / "engine-16m.dat").stat().st_size == 16 << 20
