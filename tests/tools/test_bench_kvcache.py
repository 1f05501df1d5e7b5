"""Tests of ``python -m tools.bench kvcache``: case plan, goals (n/a where a reference is absent), the CPU
connector handed to LMCache, refusals, and the suite end to end (``--quick --json``, one pair per case)."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tools.bench.common import BenchSetupError, Table
from tools.bench.suites.kvcache import (
    GOALS,
    QUICK_CASES,
    REFERENCES,
    Case,
    all_cases,
    evaluate_goals,
    select_cases,
)
from tools.bench.suites.kvcache.lmcache import cpu_connector as _cpu_connector
from tools.bench.testing import bench_report, run_bench

_bench = functools.partial(run_bench, "kvcache")


def test_case_plan() -> None:
    names = [c.name for c in all_cases()]
    assert names == ["put-pinned-vs-memcpy", "get-pinned-vs-memcpy", "put-block-vs-fio", "get-block-vs-fio",
                     "put-block-vs-nixl", "get-block-vs-nixl", "put-block-vs-lmcache", "get-block-vs-lmcache",
                     "put-plugin-vs-lmcache", "get-plugin-vs-lmcache"]
    assert QUICK_CASES == tuple(g.case for g in GOALS) and set(QUICK_CASES) < set(names)
    assert [c.name for c in select_cases(quick=True)] == [n for n in names if n != "put-pinned-vs-memcpy"]
    assert [c.name for c in select_cases(["*-vs-fio"])] == ["put-block-vs-fio", "get-block-vs-fio"]
    assert [c.name for c in select_cases(["*-plugin-*"])] == ["put-plugin-vs-lmcache", "get-plugin-vs-lmcache"]
    assert [c.name for c in select_cases(["get-pinned-*,put-block-vs-nixl"])] == ["get-pinned-vs-memcpy",
                                                                                  "put-block-vs-nixl"]
    assert Case("put", "block", "fio").writes and not Case("get", "pinned", "memcpy").writes
    assert set(REFERENCES) == {c.reference for c in all_cases()}
    with pytest.raises(BenchSetupError, match="no kvcache case"):
        select_cases(["nope-*"])


def _case(name: str, ratio: float | None, lo: float = 0.0, hi: float = 0.0, why: str = "") -> dict[str, Any]:
    return {"name": name, "ratio": ratio, "ratio_min": lo, "ratio_max": hi, "reference": {"status": why}}


def test_goals() -> None:
    cases = [_case("get-block-vs-fio", 0.9, 0.8, 1.0), _case("put-block-vs-fio", 0.5, 0.4, 0.9),
             _case("get-block-vs-nixl", None, why="not installed (No module named 'nixl')"),
             _case("get-pinned-vs-memcpy", 0.81, 0.81, 0.9)]
    goals = evaluate_goals(cases)
    by = {g["case"]: g for g in goals}
    assert [g["goal"] for g in goals] == [g.what for g in GOALS]
    assert by["get-block-vs-fio"]["status"] == "met" and by["get-block-vs-fio"]["met"] is True
    assert "PASS, 0.90x" in by["get-block-vs-fio"]["line"] and "lowest pair (0.80x)" in by["get-block-vs-fio"]["line"]
    assert by["put-block-vs-fio"]["status"] == "missed" and "MISS, 0.50x" in by["put-block-vs-fio"]["line"]
    assert "41% short of 0.85x" in by["put-block-vs-fio"]["line"]
    nixl = by["get-block-vs-nixl"]
    assert nixl["status"] == "n/a" and nixl["met"] is None and "PASS" not in nixl["line"]
    assert "n/a (not installed (No module named 'nixl'))" in nixl["line"]
    assert by["put-block-vs-lmcache"]["status"] == "not run"
    assert by["get-pinned-vs-memcpy"]["status"] == "met"
    assert all("[at" not in g["line"] for g in goals)
    small = evaluate_goals(cases, size=256 << 20)
    assert "[at 256m, batch 64, QD 64" in small[0]["line"]


def test_table_shows_a_side_that_did_not_run_as_na() -> None:
    case = {"name": "get-block-vs-nixl", "params": {"block_size": 2 << 20}, "sfstore": {"status": "not run"},
            "reference": {"status": "not installed"}, "ratio": None}
    row = Table("reference").row(case)
    assert row.split()[:4] == ["get-block-vs-nixl", "n/a", "n/a", "n/a"]


def test_cpu_connector_copies_blocks_both_ways() -> None:
    torch = pytest.importorskip("torch")

    class Base:  # stands in for LMCache's GPUConnectorInterface
        pass

    class MemoryObj:
        def __init__(self) -> None:
            self.tensor = torch.zeros((2, 3, 4, 8), dtype=torch.bfloat16)  # KV_2LTD: 2 x layers x tokens x hidden

    conn = _cpu_connector(Base, torch, 4)((2, 3, 4, 8))
    assert isinstance(conn, Base) and tuple(conn.get_shape(8)) == (2, 3, 8, 8)
    nbytes = 2 * 3 * 4 * 8 * 2
    blocks = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(2)]
    objs = [MemoryObj(), MemoryObj()]
    conn.batched_from_gpu(objs, [0, 4], [4, 8], blocks=blocks)
    for o, b in zip(objs, blocks, strict=True):
        assert torch.equal(o.tensor.view(-1).view(torch.uint8), b)
    out = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
    conn.batched_to_gpu(objs, [0, 4], [4, 8], blocks=out)
    assert all(torch.equal(a, b) for a, b in zip(out, blocks, strict=True))


def test_bad_arguments_are_named() -> None:
    proc = _bench("--batch", "0")
    assert proc.returncode == 2 and "--batch: must be at least 1" in proc.stderr, proc.stderr
    for args, message in ((("--cases", "nope-*"), "no kvcache case matches nope-*"),
                          (("--dir", "/dev/shm/sfstore-bench"), "/dev/shm")):
        proc = _bench(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and message in proc.stderr, (args, proc.stderr)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def test_kvcache_suite_quick_end_to_end(disk_dir: Path) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is missing (apt-get install fio)")
    out = disk_dir / "kvcache.json"
    report = disk_dir / "report"
    start = time.monotonic()
    try:
        proc = _bench("--quick", "--dir", str(disk_dir), "--repeat", "1", "--warmup", "0", "--json", str(out),
                      "--report", str(report))
    finally:
        for image in disk_dir.glob("kvcache-*.img"):  # 273 MiB: not worth keeping in pytest's tmp directories
            image.unlink()
    elapsed = time.monotonic() - start
    doc = bench_report(proc, out, "kvcache")
    assert doc["geometry"]["block_bytes"] == 2 << 20 and doc["blocks"] == 128
    assert [c["name"] for c in doc["cases"]] == [c.name for c in select_cases(quick=True)]
    present = {"memcpy": True, "fio": True, "nixl": _installed("nixl"), "lmcache": _installed("lmcache")}
    for case in doc["cases"]:
        assert {"name", "params", "sfstore", "reference_tool", "reference", "ratio"} <= set(case)
        ref = case["params"]["reference"]
        assert case["reference_tool"] == REFERENCES[ref]
        if not present[ref]:  # the library is absent here: the case says why and has no ratio
            assert case["ratio"] is None and "not installed" in case["reference"]["status"], case
            continue
        assert case["ratio"] > 0, case
        assert case["same_bytes"] is True
        assert case["sfstore"]["bytes"] == case["reference"]["bytes"] == 128 * (2 << 20)
        for side in (case["sfstore"], case["reference"]):
            for key in ("bytes_per_s", "iops", "cpu_s_per_gib"):
                assert isinstance(side[key], float) and side[key] > 0, (case["name"], key, side[key])
            assert side["block_p99_ms"] >= side["block_p50_ms"] > 0, case["name"]
        assert case["sfstore"]["batch_p99_ms"] >= case["sfstore"]["batch_p50_ms"] > 0
        assert case["ratio"] == pytest.approx(case["sfstore"]["bytes_per_s"] / case["reference"]["bytes_per_s"])
        if ref == "fio":
            command = case["params"]["reference_call"].split()
            for arg in ("--bs=2097152", "--iodepth=64", "--direct=1", "--ioengine=io_uring",
                        f"--offset={case['params']['region_offset']}", f"--io_size={128 * (2 << 20)}",
                        "--rw=" + ("randwrite" if case["params"]["op"] == "put" else "randread")):
                assert arg in command, (arg, command)
            assert ("--end_fsync=1" in command) == (case["params"]["op"] == "put")
        if case["params"]["tier"] == "block" and case["params"]["op"] == "put":
            assert case["params"]["fsync_in_timed_region"] is True and case["sfstore"]["flush_s"] >= 0
    goals = {g["case"]: g for g in doc["acceptance"]}
    assert [g["goal"] for g in doc["acceptance"]] == [g.what for g in GOALS]
    for g in goals.values():
        ref = g["case"].rsplit("-vs-", 1)[1]
        if present[ref]:
            assert g["status"] in ("met", "missed") and g["ratio"] > 0, g
            assert ("PASS" if g["status"] == "met" else "MISS") in g["line"]
        else:
            assert g["status"] == "n/a" and g["met"] is None and "n/a (not installed" in g["line"], g
        assert g["line"] in proc.stdout
    assert "goal: NVMe-tier get >= 0.85x fio" in (report / "kvcache.txt").read_text()
    assert elapsed < 60, f"--quick took {elapsed:.0f} s"
