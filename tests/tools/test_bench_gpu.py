"""Tests of ``python -m tools.bench gpu`` on a CPU machine: the case plan, the suite end to end with CPU torch
tensors (``--device cpu``: every line but the GPU's runs), cases a machine cannot run skipped with their reason,
and a wrong answer stopping the suite (a corrupted file, blocks gone from every tier)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from tools.bench.common import BenchSetupError
from tools.bench.suites.gpu import QUICK_CASES, all_cases, select_cases
from tools.bench.suites.gpu.arrays import TorchLib
from tools.bench.suites.gpu.sides import Blocks, DevicePathSide, KvSharedSide, WrongResult
from tools.bench.testing import run_bench

torch = pytest.importorskip("torch")
_bench = functools.partial(run_bench, "gpu")
MiB = 1 << 20


def test_case_plan() -> None:
    names = [c.name for c in all_cases()]
    assert names[:6] == ["put-torch-staged", "get-torch-staged", "put-torch-compat", "get-torch-compat",
                         "put-torch-gds", "get-torch-gds"]
    assert names[-1] == "layers-overlap" and len(names) == 19  # 9 routes x put/get + the overlap
    assert [c.name for c in select_cases(quick=True)] == list(QUICK_CASES)
    assert [c.name for c in select_cases(["get-kv-*"])] == ["get-kv-block", "get-kv-shared", "get-kv-shared-pinned"]
    with pytest.raises(BenchSetupError, match="no gpu case"):
        select_cases(["nope"])


def test_the_suite_runs_its_cpu_routes_end_to_end(disk_dir: Path) -> None:
    out = disk_dir / "gpu.json"
    p = _bench("--device", "cpu", "--blocks", "4", "--block-size", "2m", "--repeat", "1", "--warmup", "0",
               "--dir", str(disk_dir / "b"), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    assert set(cases) == {"put-torch-staged", "get-torch-staged", "put-kv-block", "get-kv-block",
                          "put-kv-shared-pinned", "get-kv-shared-pinned", "layers-overlap"}
    for c in cases.values():
        assert c["ratio"] > 0 and c["sfstore"]["bytes"] == c["reference"]["bytes"] == 4 * 2 * MiB
    kv = cases["get-kv-block"]["params"]["side"]
    assert kv["stats"]["hits_block"] >= 4 and kv["stats"]["puts_dropped"] == 0
    assert cases["get-torch-staged"]["params"]["side"]["ran_in_mode"] == "staged"
    overlap = cases["layers-overlap"]
    assert overlap["t_load_s"] > 0 and overlap["t_compute_s"] > 0 and overlap["goal_met"] is None
    skipped = {s["case"]: s["reason"] for s in doc["skipped"]}
    assert set(skipped) == {f"{op}-{r}" for op in ("put", "get") for r in (
        "torch-compat", "torch-gds", "kv-shared", "cupy-staged", "cupy-compat", "cupy-gds")}
    assert "moves GPU memory" in skipped["get-torch-gds"]
    [goal] = doc["acceptance"]
    assert goal["status"] == "n/a" and "no streams" in goal["line"]
    assert "goal: per-layer loads hide >= 70%" in p.stdout


def test_a_block_size_the_kv_cache_cannot_take_skips_only_those_cases(disk_dir: Path) -> None:
    out = disk_dir / "gpu.json"
    p = _bench("--device", "cpu", "--blocks", "2", "--block-size", "1056768", "--repeat", "1", "--warmup", "0",
               "--cases", "get-torch-staged,get-kv-block,layers-overlap", "--dir", str(disk_dir / "b"),
               "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert [c["name"] for c in doc["cases"]] == ["get-torch-staged", "layers-overlap"]  # 32 layers of 33 KiB
    skipped = {s["case"]: s["reason"] for s in doc["skipped"]}
    assert list(skipped) == ["get-kv-block"] and "whole number of 64 KiB layers" in skipped["get-kv-block"]


def test_bad_sizes_are_refused(disk_dir: Path) -> None:
    p = _bench("--device", "cpu", "--block-size", "1000", "--dir", str(disk_dir))
    assert p.returncode == 2 and "multiple of 4k" in p.stderr


def test_a_corrupted_slab_is_a_wrong_result_not_a_speed(disk_dir: Path) -> None:
    blocks = Blocks(TorchLib("cpu"), 4, 64 * 1024)
    side = DevicePathSide(blocks, str(disk_dir / "dp"), "staged")
    try:
        side.put()
        with open(side.slab, "r+b") as f:  # another writer damages block 2 on disk
            f.seek(2 * 64 * 1024 + 100)
            f.write(b"\xff" * 8)
            os.fsync(f.fileno())
        with pytest.raises(WrongResult, match="first in block 2"):
            side.get()
    finally:
        side.close()
        blocks.release()


def test_blocks_gone_from_the_tier_stop_the_case_saying_where_they_came_from(disk_dir: Path) -> None:
    blocks = Blocks(TorchLib("cpu"), 4, 2 * MiB)
    side = KvSharedSide(blocks, str(disk_dir / "kv"), pinned=True)
    try:
        side.put()
        side.kv.evict(side.keys)  # from every tier
        with pytest.raises(WrongResult, match=r"tiers \['None'\], not the shared tier"):
            side.get()
    finally:
        side.close()
        blocks.release()
