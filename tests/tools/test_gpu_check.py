"""Tests of ``tools/gpu_check.py`` on a CPU machine: every GPU check SKIPs with its reason (exit 0), the routes run
end to end with CPU tensors (``--device cpu``), the budget and the watchdog stop it in time, a failing check never
stops the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
CHECK_NAMES = [
    "probe", "cuda_registration", "read_into_cuda",
    "torch_baseline", "torch_devicepath_gds", "torch_devicepath_compat", "torch_devicepath_host",
    "kvcache_torch", "kvcache_torch_device", "checkpoint_cuda",
    "cupy_baseline", "cupy_devicepath_gds", "cupy_devicepath_compat", "cupy_devicepath_host",
]
CPU_ROUTES = {"torch_baseline", "torch_devicepath_host", "kvcache_torch", "checkpoint_cuda"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_help() -> None:
    p = _run("--help", timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--blocks", "--block-mib", "--budget", "--dir", "--json", "--device"):
        assert opt in p.stdout
    assert "Exit status" in p.stdout


@pytest.mark.parametrize("args", [("--blocks", "0"), ("--block-mib", "0.001"), ("--budget", "0")])
def test_bad_arguments_are_refused(args: tuple[str, str]) -> None:
    p = _run(*args, timeout=60)
    assert p.returncode == 2 and "error" in p.stderr


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA GPU: the checks run for real")
def test_without_a_gpu_every_check_skips_with_a_reason(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    p = _run("--blocks", "4", "--block-mib", "1", "--json", str(out), "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    assert [c["check"] for c in doc["checks"]] == CHECK_NAMES
    for c in doc["checks"]:
        assert c["status"] == "SKIP", c
        assert len(c["detail"]) > 10, c
    assert doc["summary"] == {"PASS": 0, "FAIL": 0, "SKIP": len(CHECK_NAMES)}
    assert doc["table"] == [] and doc["bytes_per_route"] == 4 << 20
    for name in CHECK_NAMES:
        assert f"SKIP  {name}: " in p.stdout
    try:
        import cupy  # noqa: F401
    except ImportError:
        cupy_skip = next(c for c in doc["checks"] if c["check"] == "cupy_baseline")
        assert "pip install cupy" in cupy_skip["detail"]
    assert sorted(os.listdir(tmp_path)) == ["gpu.json"]  # the scratch directory is gone


def test_with_a_gpu_nothing_fails(tmp_path: Path) -> None:
    if not _has_cuda():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "gpu.json"
    p = _run("--blocks", "4", "--block-mib", "1", "--json", str(out), "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    assert [c["check"] for c in doc["checks"]] == CHECK_NAMES
    assert all(c["status"] in ("PASS", "SKIP") for c in doc["checks"])
    assert all(r["bit_exact"] for r in doc["table"])


def test_routes_run_end_to_end_with_cpu_tensors(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    out = tmp_path / "cpu.json"
    p = _run("--device", "cpu", "--blocks", "4", "--block-mib", "1", "--json", str(out), "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    status = {c["check"]: c["status"] for c in doc["checks"]}
    assert list(status) == CHECK_NAMES
    assert {n for n, s in status.items() if s == "PASS"} == CPU_ROUTES, p.stdout
    assert {n for n, s in status.items() if s == "FAIL"} == set()
    routes = {r["route"]: r for r in doc["table"]}
    assert set(routes) == {"torch baseline", "torch DevicePath staged", "KVCacheStore put + get (block tier)",
                           "KVCacheStore get (pinned tier)", "checkpoint save/load(device='cpu')"}
    assert all(r["bit_exact"] for r in routes.values())
    base = routes["torch baseline"]
    assert base["put_gib_s"] > 0 and base["get_gib_s"] > 0
    assert base["put_vs_baseline"] == base["get_vs_baseline"] == 1.0
    host = routes["torch DevicePath staged"]
    assert host["put_vs_baseline"] is not None and host["get_vs_baseline"] is not None
    assert host["bytes"] == 4 << 20 and host["cold_get"] is True
    assert routes["KVCacheStore get (pinned tier)"]["put_gib_s"] is None
    kv = next(c for c in doc["checks"] if c["check"] == "kvcache_torch")
    assert kv["metrics"]["stats"]["lower_tier_errors"] == 0
    assert "route" in p.stdout and "bit-exact" in p.stdout  # the table
    assert sorted(os.listdir(tmp_path)) == ["cpu.json"]


def test_block_size_the_kv_cache_cannot_take_skips_only_that_route(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "o.json"
    p = _run("--device", "cpu", "--blocks", "2", "--block-mib", "0.5078125", "--json", str(out),  # 520 KiB
             "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {c["check"]: c for c in _load(out)["checks"]}
    assert checks["kvcache_torch"]["status"] == "SKIP" and "64 KiB" in checks["kvcache_torch"]["detail"]
    assert checks["torch_devicepath_host"]["status"] == "PASS"


def test_a_spent_budget_skips_the_routes_saying_so(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "o.json"
    p = _run("--device", "cpu", "--blocks", "4", "--block-mib", "1", "--budget", "0.001", "--json", str(out),
             "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {c["check"]: c for c in _load(out)["checks"]}
    for name in CPU_ROUTES:
        assert checks[name]["status"] == "SKIP" and "time budget" in checks[name]["detail"]


def _run_with_checks(tmp_path: Path, checks_src: str, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run gpu_check's main() with its CHECKS replaced by the ones defined in ``checks_src``."""
    out = tmp_path / "o.json"
    code = ("import sys, time\nimport tools.gpu_check as g\nfrom tools.gpu_check import Outcome, Skip\n"
            + textwrap.dedent(checks_src) + "\nsys.exit(g.main(sys.argv[1:]))\n")
    p = subprocess.run([sys.executable, "-c", code, "--json", str(out), "--dir", str(tmp_path), *args], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    return p, out


def test_a_failing_check_never_stops_the_others(tmp_path: Path) -> None:
    p, out = _run_with_checks(tmp_path, """
        def boom(run):
            raise RuntimeError("broken route")
        def missing(run):
            import cupy_not_there_at_all  # noqa
        def skip(run):
            raise Skip("not here")
        def ok(run):
            return Outcome("fine")
        g.CHECKS[:] = [("boom", True, boom), ("missing", True, missing), ("skip", False, skip), ("ok", False, ok)]
    """)
    assert p.returncode == 1, p.stdout + p.stderr
    checks = {c["check"]: c for c in _load(out)["checks"]}
    assert [checks[n]["status"] for n in ("boom", "missing", "skip", "ok")] == ["FAIL", "SKIP", "SKIP", "PASS"]
    assert "broken route" in checks["boom"]["detail"] and "RuntimeError" in checks["boom"]["trace"]
    assert "pip install cupy_not_there_at_all" in checks["missing"]["detail"]
    assert "FAIL  boom: RuntimeError: broken route" in p.stdout


def test_the_watchdog_stops_a_hung_check_and_still_writes_the_json(tmp_path: Path) -> None:
    p, out = _run_with_checks(tmp_path, """
        def hang(run):
            time.sleep(60)
        def later(run):
            return Outcome("never reached")
        g.CHECKS[:] = [("hang", True, hang), ("later", True, later)]
    """, "--budget", "5", "--grace", "0.5")
    assert p.returncode == 1, p.stdout + p.stderr
    doc = _load(out)
    assert doc["stopped"] == "stopped by the watchdog"
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["hang"]["status"] == "FAIL" and "still running" in checks["hang"]["detail"]
    assert checks["later"]["status"] == "SKIP"
    assert sorted(os.listdir(tmp_path)) == ["o.json"]
