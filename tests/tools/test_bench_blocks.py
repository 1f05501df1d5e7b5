"""Tests of ``python -m tools.bench blocks``: case plan, working set, goals, refusals, and the suite end to end
(a 32 MiB image, one pair per case)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest

from tools.bench.common import BenchSetupError
from tools.bench.fio import FioJob, fio_command
from tools.bench.suites.blocks import (
    GOALS,
    QUICK_CASES,
    SIZE_CLASSES,
    Case,
    all_cases,
    evaluate_goals,
    select_cases,
    working_set,
)
from tools.bench.testing import bench_report, run_bench

SIZE = 32 << 20


_bench = functools.partial(run_bench, "blocks")


def test_case_plan() -> None:
    names = [c.name for c in all_cases()]
    # put before get: the get finds the store full
    assert names == ["put-256k", "get-256k", "put-4k", "get-4k", "get-4k-sync"]
    assert QUICK_CASES == ("get-256k", "put-256k", "get-4k", "get-4k-sync")
    assert tuple(g.case for g in GOALS) == ("get-256k", "put-256k", "get-4k")  # the sync case is shown, not a goal
    assert [c.name for c in select_cases(quick=True)] == ["put-256k", "get-256k", "get-4k", "get-4k-sync"]
    assert [c.name for c in select_cases(["get-*"])] == ["get-256k", "get-4k", "get-4k-sync"]
    assert Case("get", 4096, sync=True).fio_rw == "randread"
    assert [c.name for c in select_cases(["put-4k,get-256k"])] == ["get-256k", "put-4k"]
    assert Case("put", 4096).fio_rw == "randwrite" and Case("get", 262144).fio_rw == "randread"
    assert SIZE_CLASSES == (4096, 262144)
    with pytest.raises(BenchSetupError, match="no blocks case"):
        select_cases(["nope-*"])


def test_working_set() -> None:
    # fill x the slots of the class on a store of --size bytes (each class gets half of it)
    assert working_set(2028, 262656, 1 << 30, 0.75, None) == int(0.75 * 2028)
    # a device far bigger than --size: the slots a --size store would have
    assert working_set(10**6, 262656, 1 << 30, 0.5, None) == int(0.5 * ((1 << 29) // 262656))
    assert working_set(100, 4608, 1 << 30, 0.001, None) == 1
    assert working_set(100, 4608, 1 << 30, 0.75, 40) == 40
    with pytest.raises(BenchSetupError, match="--keys 101"):
        working_set(100, 4608, 1 << 30, 0.75, 101)


def test_fio_job_region() -> None:
    job = FioJob(name="get-4k", filename="/x/a:b.img", size=4608 * 10, io_size=4096 * 10, rw="randread", bs=4096,
                 iodepth=64, offset=8 << 20)
    cmd = fio_command("fio", job)
    assert "--offset=8388608" in cmd and "--size=46080" in cmd and "--io_size=40960" in cmd
    assert "--filename=/x/a\\:b.img" in cmd and "--end_fsync=1" not in cmd
    plain = fio_command("fio", FioJob("w", "f", 4096, 4096, "randwrite", 4096, 1))
    assert not any(a.startswith("--offset") for a in plain) and "--end_fsync=1" in plain


def _case(name: str, ratio: float | None, lo: float = 0.0, hi: float = 0.0) -> dict[str, Any]:
    return {"name": name, "ratio": ratio, "ratio_min": lo, "ratio_max": hi}


def test_goals() -> None:
    goals = evaluate_goals([_case("get-256k", 0.9, 0.8, 1.0), _case("put-256k", 0.5, 0.4, 0.9)])
    by = {g["case"]: g for g in goals}
    assert [g["goal"] for g in goals] == [g.what for g in GOALS]
    assert by["get-256k"]["status"] == "met" and by["get-256k"]["met"] is True
    assert "PASS, 0.90x" in by["get-256k"]["line"] and "lowest pair (0.80x) is below it" in by["get-256k"]["line"]
    assert by["put-256k"]["status"] == "missed" and "MISS, 0.50x" in by["put-256k"]["line"]
    assert "41% short of 0.85x" in by["put-256k"]["line"] and "best pair (0.90x) reaches it" in by["put-256k"]["line"]
    assert by["get-4k"]["status"] == "not run" and by["get-4k"]["met"] is None
    assert all("[at" not in g["line"] for g in goals)
    small = evaluate_goals([_case("get-4k", 0.7, 0.7, 0.7)], size=SIZE, batch=16, qd=32)
    assert "PASS" in small[2]["line"] and "[at 32m, batch 16, QD 32" in small[2]["line"]


def test_bad_arguments_are_named(disk_dir: Path) -> None:
    proc = _bench("--fill", "0")
    assert proc.returncode == 2 and "--fill: must be in (0, 1]" in proc.stderr, proc.stderr
    proc = _bench("--batch", "0")
    assert proc.returncode == 2 and "--batch: must be at least 1" in proc.stderr, proc.stderr
    proc = _bench("--buffers", "gpu")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr, proc.stderr
    checks = [
        (("--cases", "nope-*"), "no blocks case matches nope-*"),
        (("--size", "1m"), "--size 1048576: must be a multiple of 4k and at least 16m"),
        (("--device", str(disk_dir / "missing")), "No such file"),
        (("--device", str(Path(__file__))), "not a block device"),
        (("--dir", "/dev/shm/sfstore-bench"), "/dev/shm"),
    ]
    if shutil.which("fio") is not None:  # the checks after fio's
        checks.append((("--dir", str(disk_dir), "--size", "16m", "--keys", "100000", "--cases", "put-256k"),
                       "--keys 100000: the class has"))
    for args, message in checks:
        proc = _bench(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and message in proc.stderr, (args, proc.stderr)


def test_blocks_suite_end_to_end(disk_dir: Path) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is missing (apt-get install fio)")
    out = disk_dir / "blocks.json"
    report = disk_dir / "report"
    proc = _bench("--quick", "--dir", str(disk_dir), "--size", "32m", "--repeat", "1", "--warmup", "0",
                  "--json", str(out), "--report", str(report))
    doc = bench_report(proc, out, "blocks")
    assert doc["store"]["size_classes"] == [4096, 262144] and len(doc["store"]["classes"]) == 2
    assert [c["name"] for c in doc["cases"]] == ["put-256k", "get-256k", "get-4k", "get-4k-sync"]
    for case in doc["cases"]:
        assert {"name", "params", "sfstore", "reference_tool", "reference", "ratio"} <= set(case)
        assert case["reference_tool"] == "fio"
        params = case["params"]
        total = params["keys"] * params["block_size"]
        assert params["keys"] > 0 and params["io_bytes"] == total and params["batch"] == 64
        # as deep a queue as fio's by default; the -sync case one synchronous call at a time
        sync = case["name"].endswith("-sync")
        assert params["outstanding_batches"] == (1 if sync else 2)
        assert ("_async" in params["sfstore_call"]) != sync
        assert params["queue_depth"] == 64 and params["image_size"] == SIZE
        assert params["sfstore_io_bytes_per_op"] > params["fio_io_bytes_per_op"] == params["block_size"]
        region = doc["store"]["classes"][SIZE_CLASSES.index(params["block_size"])]
        assert params["region_offset"] == region["offset"] and params["slot_stride"] == region["stride"]
        # both sides moved the same bytes, over the same region, at the same block size and queue depth
        assert case["same_bytes"] is True
        assert case["sfstore"]["bytes"] == case["reference"]["bytes"] == total
        command = case["reference"]["command"]
        for arg in (f"--offset={region['offset']}", f"--size={params['keys'] * region['stride']}",
                    f"--io_size={total}", f"--bs={params['block_size']}", "--iodepth=64", "--direct=1",
                    "--ioengine=io_uring", "--rw=" + ("randwrite" if params["op"] == "put" else "randread")):
            assert arg in command.split(), (arg, command)
        assert ("--end_fsync=1" in command) == (params["op"] == "put") == params["fsync_in_timed_region"]
        for side in (case["sfstore"], case["reference"]):
            for key in ("bytes_per_s", "iops"):
                assert isinstance(side[key], float) and side[key] > 0, (case["name"], key, side[key])
            # CPU time comes in clock ticks: a short zero-copy run on a tiny image may measure none
            assert isinstance(side["cpu_s_per_gib"], float) and side["cpu_s_per_gib"] >= 0
        assert case["sfstore"]["batch_p99_ms"] >= case["sfstore"]["batch_p50_ms"] > 0
        assert case["ratio"] > 0
        assert case["ratio"] == pytest.approx(case["sfstore"]["bytes_per_s"] / case["reference"]["bytes_per_s"])
    assert doc["cases"][0]["sfstore"]["flush_s"] >= 0
    goals = doc["acceptance"]
    assert [g["goal"] for g in goals] == [g.what for g in GOALS]
    for g in goals:
        assert g["status"] in ("met", "missed") and g["ratio"] > 0
        assert ("PASS" if g["status"] == "met" else "MISS") in g["line"] and g["line"] in proc.stdout
    assert "get-4k" in proc.stdout and "IOPS" in proc.stdout
    assert "goal: 256k get >= 0.85x fio" in (report / "blocks.txt").read_text()
    # the image is reused by the next run
    assert (disk_dir / "blocks-32m.img").stat().st_size == SIZE
