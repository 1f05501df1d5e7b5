"""Tests of ``python -m tools.bench files``: case plan, data set reuse, and the whole suite end to end (tiny)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tools.bench.common import BenchSetupError
from tools.bench.suites.files import all_cases, prepare_dataset, quick_names, select_cases
from tools.bench.testing import run_bench

SIZE = 16 << 20
COUNT = 200
SMALL = 16 << 10


_bench = functools.partial(run_bench, timeout=600)


def test_case_plan() -> None:
    cases = all_cases(1 << 30, 10000, 64 << 10)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 9
    assert names[:3] == ["read_into-1g-vs-fio", "read_into-1g-vs-readinto", "read_into-1g-vs-fsspec-local"]
    assert {"read_into-numpy-1g-vs-fio", "cat_file-1g-vs-fsspec-local", "cat-10000x64k-vs-fsspec-local",
            "read_many-10000x64k-vs-fsspec-local"} <= set(names)
    assert quick_names(1 << 30, 10000, 64 << 10) == ["read_into-1g-vs-fio", "read_into-1g-vs-fsspec-local",
                                                     "cat-10000x64k-vs-fsspec-local"]
    by_name = {c.name: c for c in cases}
    assert by_name["cat-10000x64k-vs-fsspec-local"].needs_fs and by_name["cat_file-1g-vs-fsspec-local"].needs_fs
    assert not by_name["read_many-10000x64k-vs-fsspec-local"].needs_fs
    assert by_name["read_into-numpy-1g-vs-readinto"].reference_tool == "open.readinto"
    assert [c.name for c in select_cases(cases, ["*-vs-fio"])] == ["read_into-1g-vs-fio", "read_into-numpy-1g-vs-fio"]
    with pytest.raises(BenchSetupError, match="no files case"):
        select_cases(cases, ["nope-*"])


def test_dataset_is_reused(disk_dir: Path) -> None:
    first = prepare_dataset(str(disk_dir), 1 << 20, 5, 4096)
    assert first.reused == {"big": False, "small": False}
    assert os.path.getsize(first.big_path) == 1 << 20
    assert [os.path.getsize(p) for p in first.small_paths] == [4096] * 5
    again = prepare_dataset(str(disk_dir), 1 << 20, 5, 4096)
    assert again.reused == {"big": True, "small": True} and again.small_names == first.small_names
    os.truncate(first.small_paths[3], 100)  # a damaged set is made again
    assert prepare_dataset(str(disk_dir), 1 << 20, 5, 4096).reused["small"] is False
    assert os.path.getsize(first.small_paths[3]) == 4096


def _check_side(case: dict[str, Any], side: dict[str, Any], total: int, rss: bool = True) -> None:
    for key in ("bytes_per_s", "iops", "cpu_s_per_gib"):
        assert isinstance(side[key], float) and side[key] > 0, (case["name"], key, side[key])
    assert side["bytes"] == total, (case["name"], side["bytes"], total)
    assert all(run["bytes"] == total for run in side["runs"])
    if not rss:  # fio runs in a child whose peak RSS cannot be told from this process's (see peak_rss_note)
        assert side["peak_rss_growth_bytes"] is None and side["peak_rss_note"]
        return
    assert isinstance(side["peak_rss_growth_bytes"], int) and side["peak_rss_growth_bytes"] >= 0
    assert isinstance(side["peak_rss_beyond_data_bytes"], int) and side["peak_rss_beyond_data_bytes"] >= 0


def test_files_suite_end_to_end(disk_dir: Path) -> None:
    if importlib.util.find_spec("numpy") is None or importlib.util.find_spec("fsspec") is None:
        pytest.skip("the files bench needs numpy and fsspec")
    out = disk_dir / "files.json"
    proc = _bench("files", "--dir", str(disk_dir), "--size", "16m", "--small-count", str(COUNT), "--small-size",
                  "16k", "--repeat", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "files" and isinstance(doc["machine"], dict) and doc["date"]
    ran = {c["name"]: c for c in doc["cases"]}
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    expected = [c.name for c in all_cases(SIZE, COUNT, SMALL)]
    assert set(ran) | set(skipped) == set(expected) and not set(ran) & set(skipped)
    # only what cannot run here is skipped, and it says why
    fio_missing = shutil.which("fio") is None
    fs_missing = importlib.util.find_spec("sfstore.fs") is None
    for name, reason in skipped.items():
        if name.endswith("-vs-fio"):
            assert fio_missing and "fio" in reason, (name, reason)
        else:
            assert name.startswith(("cat-", "cat_file-")) and fs_missing and "fs.py" in reason, (name, reason)
    if fio_missing:
        pytest.skip("fio is missing (apt-get install fio): the -vs-fio cases were skipped, the others checked")

    for name, case in ran.items():
        assert {"name", "params", "sfstore", "reference_tool", "reference", "ratio"} <= set(case)
        assert case["reference_tool"] in ("fio", "open.readinto", "fsspec.local")
        assert name.endswith({"fio": "-vs-fio", "open.readinto": "-vs-readinto",
                              "fsspec.local": "-vs-fsspec-local"}[case["reference_tool"]])
        small = case["params"]["shape"] == "small-files"
        total = COUNT * SMALL if small else SIZE
        # both sides moved the same bytes, all of them, and the results held the file's bytes
        assert case["same_bytes"] is True and case["verified"] is True
        assert case["params"]["io_bytes"] == total
        _check_side(case, case["sfstore"], total)
        _check_side(case, case["reference"], total, rss=case["reference_tool"] != "fio")
        assert case["ratio"] == pytest.approx(case["sfstore"]["bytes_per_s"] / case["reference"]["bytes_per_s"])
        if small:
            assert case["sfstore"]["runs"][0]["ops"] == case["reference"]["runs"][0]["ops"] == COUNT
            assert case["files_per_s"]["sfstore"] == case["sfstore"]["iops"]
        else:
            assert case["params"]["file_size"] == SIZE
        if case["params"].get("destination"):
            assert case["params"]["destination"] in ("registered", "numpy")
            assert case["memory_goal"]["limit_bytes"] == 64 << 20
            assert case["sfstore"]["bytes_direct"] + case["sfstore"]["bytes_bounced"] == SIZE
        if case["reference_tool"] == "fio":
            params = case["params"]
            assert f"--bs={min(params['chunk_size'], SIZE)}" in case["reference"]["command"]
            assert f"--iodepth={params['parallelism']}" in case["reference"]["command"]
    assert "read_into-16m-vs-fio" in proc.stdout and "read_many-200x16k-vs-fsspec-local" in proc.stdout
    goals = [a for a in doc["acceptance"] if "target" in a]
    assert len(goals) == 3 and all(a["status"] in ("met", "missed") for a in goals)
    assert all(a["line"] in proc.stdout for a in doc["acceptance"])
    assert any(a["goal"].startswith("memory: read_into (registered") for a in doc["acceptance"])
    # the data set is reused by the next run
    assert (disk_dir / "big-16m.dat").stat().st_size == SIZE
    assert json.loads((disk_dir / "small-200x16k.json").read_text())["complete"] is True
