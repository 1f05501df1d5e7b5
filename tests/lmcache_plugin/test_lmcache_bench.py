"""The kvcache bench's plugin cases (``tools.bench kvcache --cases '*-plugin-*'``) run end to end here, where
LMCache is installed: both sides are LMCache's engine, one with sfstore's plugin, one with its local disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lmcache.v1.cache_engine",
                    reason="LMCache is not installed here (tools/kvbench-env.sh makes .venv-kvbench)")

from tools.bench.common import BenchSetupError, check_bench_dir
from tools.bench.testing import run_bench


def test_the_plugin_cases_run_both_sides_on_the_same_chunks(tmp_path: Path) -> None:
    try:
        check_bench_dir(tmp_path)
    except BenchSetupError as exc:
        pytest.skip(f"no disk filesystem for benchmark files here: {exc}")
    out = tmp_path / "kvcache.json"
    proc = run_bench("kvcache", "--cases", "*-plugin-*", "--size", "16m", "--repeat", "1", "--warmup", "0",
                     "--dir", str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    assert list(cases) == ["put-plugin-vs-lmcache", "get-plugin-vs-lmcache"]
    for case in cases.values():
        assert case["same_bytes"] is True and case["ratio"] > 0, case
        assert case["sfstore"]["bytes"] == case["reference"]["bytes"] == 16 << 20
        assert "storage_plugins [sfstore]" in case["params"]["sfstore_call"]
        assert "local disk" in case["params"]["reference_call"]
    assert cases["put-plugin-vs-lmcache"]["params"]["fsync_in_timed_region"] is True
    goals = {g["case"]: g for g in doc["acceptance"]}
    assert goals["get-plugin-vs-lmcache"]["status"] in ("met", "missed")
    assert goals["put-plugin-vs-lmcache"]["status"] in ("met", "missed")
