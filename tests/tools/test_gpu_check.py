"""Tests of ``tools/gpu_check.py`` on a CPU machine: every GPU check SKIPs with its reason (exit 0), the routes run
end to end with CPU tensors (``--device cpu``), the budget and the watchdog stop it in time, a failing check never
stops the others."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tools import gpu_check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
CHECK_NAMES = [
    "probe", "cuda_registration", "read_into_cuda", "fio_odirect",
    "torch_baseline", "torch_devicepath_gds", "torch_devicepath_compat", "torch_devicepath_host",
    "kvcache_torch", "kvcache_torch_device", "kvcache_torch_device_pinned", "per_layer_overlap", "vllm_offload_spec",
    "checkpoint_cuda",
    "cupy_baseline", "cupy_devicepath_gds", "cupy_devicepath_compat", "cupy_devicepath_host",
    "bench_checkpoint_save_async", "bench_kvcache_nixl",
]
BENCH_CHECKS = {"bench_checkpoint_save_async", "bench_kvcache_nixl"}
HAS_FIO = shutil.which("fio") is not None
CPU_ROUTES = {"torch_baseline", "torch_devicepath_host", "kvcache_torch", "kvcache_torch_device_pinned",
              "per_layer_overlap", "checkpoint_cuda"} | ({"fio_odirect"} if HAS_FIO else set())


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
    p = _run("--blocks", "4", "--block-mib", "1", "--json", str(out), "--dir", str(tmp_path), "--skip-bench")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    assert [c["check"] for c in doc["checks"]] == CHECK_NAMES
    for c in doc["checks"]:
        assert c["status"] == "SKIP", c
        assert len(c["detail"]) > 10, c
    fio = next(c for c in doc["checks"] if c["check"] == "fio_odirect")
    assert ("fio is the reference of the GPU routes, and none can run here" if HAS_FIO else "apt-get install fio") \
        in fio["detail"]
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
    p = _run("--blocks", "4", "--block-mib", "1", "--json", str(out), "--dir", str(tmp_path), "--skip-bench")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    assert [c["check"] for c in doc["checks"]] == CHECK_NAMES
    assert all(c["status"] in ("PASS", "SKIP") for c in doc["checks"])
    assert all(r["bit_exact"] for r in doc["table"] if r["lib"] != "fio")
    overlap = next(c for c in doc["checks"] if c["check"] == "per_layer_overlap")
    assert overlap["metrics"]["streams"] is True and overlap["metrics"]["goal_met"] is True


def test_routes_run_end_to_end_with_cpu_tensors(disk_dir: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    tmp_path = disk_dir  # fio's O_DIRECT needs a disk filesystem (an older kernel's tmpfs refuses it)
    out = tmp_path / "cpu.json"
    p = _run("--device", "cpu", "--blocks", "4", "--block-mib", "1", "--json", str(out), "--dir", str(tmp_path),
             "--skip-bench")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    status = {c["check"]: c["status"] for c in doc["checks"]}
    checks = {c["check"]: c for c in doc["checks"]}
    assert list(status) == CHECK_NAMES
    assert {n for n, s in status.items() if s == "PASS"} == CPU_ROUTES, p.stdout
    assert {n for n, s in status.items() if s == "FAIL"} == set()
    routes = {r["route"]: r for r in doc["table"]}
    expected = {"torch baseline", "torch DevicePath staged", "KVCacheStore put + get (block tier)",
                "KVCacheStore get (pinned tier)", "KVCacheStore pinned on, shared tier",
                "KVCacheStore get_layer_into x32 (pinned tier)", "checkpoint save/load(device='cpu')"}
    fio_rows = [r for r in doc["table"] if r["lib"] == "fio"]
    assert len(fio_rows) == (1 if HAS_FIO else 0)
    assert set(routes) == expected | {r["route"] for r in fio_rows}
    assert all(r["bit_exact"] is True for r in routes.values() if r["lib"] != "fio")
    base = routes["torch baseline"]
    assert base["put_gib_s"] > 0 and base["get_gib_s"] > 0
    assert base["put_vs_baseline"] == base["get_vs_baseline"] == 1.0
    host = routes["torch DevicePath staged"]
    assert host["put_vs_baseline"] is not None and host["get_vs_baseline"] is not None
    assert host["bytes"] == 4 << 20 and host["cold_get"] is True
    assert routes["KVCacheStore get (pinned tier)"]["put_gib_s"] is None
    kv = checks["kvcache_torch"]
    assert kv["metrics"]["stats"]["lower_tier_errors"] == 0
    # every row's ratio to fio, computed once every row is in (None throughout without fio)
    for r in routes.values():
        for op in ("put", "get"):
            assert (r[f"{op}_vs_fio"] is None) == (r[f"{op}_gib_s"] is None or not HAS_FIO), r
    if HAS_FIO:
        fio_row = fio_rows[0]
        assert fio_row["bit_exact"] is None and fio_row["put_vs_fio"] == fio_row["get_vs_fio"] == 1.0
        assert fio_row["route"].startswith("fio O_DIRECT ") and fio_row["route"].endswith(", QD 32")
        assert fio_row["bytes"] == 4 << 20 and fio_row["put_gib_s"] > 0 and fio_row["get_gib_s"] > 0
        assert abs(base["get_vs_fio"] - round(base["get_gib_s"] / fio_row["get_gib_s"], 2)) <= 0.01
        fm = checks["fio_odirect"]["metrics"]
        assert fm["iodepth"] == 32 and fm["bs"] == 1 << 20 and fm["engine"] in ("io_uring", "libaio")
        assert fm["write"]["bytes"] == fm["read"]["bytes"] == 4 << 20
        assert "--direct=1" in fm["write"]["command"] and "--end_fsync=1" in fm["write"]["command"]
        assert "--rw=read" in fm["read"]["command"] and "--bs=1048576" in fm["read"]["command"]
        assert "put/fio" in p.stdout
    else:
        assert "apt-get install fio" in checks["fio_odirect"]["detail"]
    pinned = checks["kvcache_torch_device_pinned"]["metrics"]
    assert pinned["hits_shared"] == 4 and pinned["bytes_device_staged"] == 0  # CPU blocks: nothing staged
    assert {t: r["route"] for t, r in pinned["gpu_blocks"].items()} == {"pinned": "pinned slots",
                                                                         "shared": "pinned slots"}
    assert routes["KVCacheStore pinned on, shared tier"]["cold_get"] is True
    overlap = checks["per_layer_overlap"]["metrics"]
    assert overlap["layers"] == 32 and overlap["blocks"] == 4 and overlap["streams"] is False
    assert overlap["goal"] is None and overlap["goal_met"] is None
    assert "num_layers=32" in overlap["geometry"] and overlap["hits_pinned"] == 8  # two prefetches of 4 blocks
    for k in ("t_load_s", "t_compute_s", "t_interleaved_s"):
        assert overlap[k] > 0, overlap
    assert overlap["exposed_load_s"] == pytest.approx(overlap["t_interleaved_s"] - overlap["t_compute_s"], abs=2e-6)
    assert overlap["hidden_fraction"] == pytest.approx(1 - overlap["exposed_load_s"] / overlap["t_load_s"],
                                                       abs=1e-3)
    assert "no goal" in checks["per_layer_overlap"]["detail"]
    for name in BENCH_CHECKS:
        assert status[name] == "SKIP" and "--skip-bench" in checks[name]["detail"], checks[name]
    assert "'save_async*'" in checks["bench_checkpoint_save_async"]["detail"]
    assert "'*nixl*'" in checks["bench_kvcache_nixl"]["detail"]
    assert "route" in p.stdout and "bit-exact" in p.stdout  # the table
    assert sorted(os.listdir(tmp_path)) == ["cpu.json"]


def test_block_size_the_kv_cache_cannot_take_skips_only_that_route(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "o.json"
    p = _run("--device", "cpu", "--blocks", "2", "--block-mib", "0.5078125", "--json", str(out),  # 520 KiB
             "--dir", str(tmp_path), "--skip-bench")
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {c["check"]: c for c in _load(out)["checks"]}
    for name in ("kvcache_torch", "kvcache_torch_device_pinned"):
        assert checks[name]["status"] == "SKIP" and "64 KiB" in checks[name]["detail"]
    assert checks["torch_devicepath_host"]["status"] == "PASS"
    # the 32-layer geometry shrinks its heads and head_dim to the block instead: 520 KiB = 32 x 2 x 16 x 65 x 4 x 2
    overlap = checks["per_layer_overlap"]
    assert overlap["status"] == "PASS", overlap
    assert "num_kv_heads=65" in overlap["metrics"]["geometry"] and "head_dim=4" in overlap["metrics"]["geometry"]


def test_a_spent_budget_skips_the_routes_saying_so(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "o.json"
    p = _run("--device", "cpu", "--blocks", "4", "--block-mib", "1", "--budget", "0.001", "--json", str(out),
             "--dir", str(tmp_path))  # no --skip-bench: the spent budget stops the benches before they start
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {c["check"]: c for c in _load(out)["checks"]}
    for name in CPU_ROUTES | BENCH_CHECKS:
        assert checks[name]["status"] == "SKIP" and "time budget" in checks[name]["detail"], checks[name]


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


# -- the benches' JSON, read as the bench checks read it (documents of the shape the suites write) -------------------


def _kv_goal(case: str, status: str, **extra: Any) -> dict[str, Any]:
    line = {"met": f"goal: {case}: PASS, 1.20x", "missed": f"goal: {case}: MISS, 0.50x is 50% short of 1.0x",
            "n/a": f"goal: {case}: n/a ({extra.get('reason')})",
            "not run": f"goal: {case}: not run (not selected: --cases / --quick)"}[status]
    met = {"met": True, "missed": False}.get(status)
    return {"goal": case, "case": case, "target": 1.0, "status": status, "met": met, "line": line, **extra}


def test_a_bench_with_nixl_unavailable_is_a_skip_with_its_reason() -> None:
    doc = {"cases": [{"name": "put-block-vs-nixl", "ratio": None}, {"name": "get-block-vs-nixl", "ratio": None}],
           "acceptance": [_kv_goal("get-block-vs-fio", "not run"),
                          _kv_goal("get-block-vs-nixl", "n/a", reason="not installed: No module named 'nixl'"),
                          _kv_goal("put-block-vs-nixl", "n/a", reason="not installed: No module named 'nixl'")]}
    with pytest.raises(gpu_check.Skip, match="NIXL cannot run here: not installed: No module named 'nixl'"):
        gpu_check.summarize_bench("kvcache", doc)


def test_a_bench_reports_its_goal_lines_and_ratios() -> None:
    doc = {"cases": [{"name": "get-block-vs-nixl", "ratio": 1.2, "ratio_min": 1.1, "ratio_max": 1.3},
                     {"name": "put-block-vs-nixl", "ratio": 0.5, "ratio_min": 0.4, "ratio_max": 0.6}],
           "acceptance": [_kv_goal("get-block-vs-nixl", "met"), _kv_goal("put-block-vs-nixl", "missed"),
                          _kv_goal("get-pinned-vs-memcpy", "not run")]}
    out = gpu_check.summarize_bench("kvcache", doc)
    assert out.ok  # a missed goal is reported, not a failure of the check
    assert out.metrics["goals"] == ["get-block-vs-nixl: PASS, 1.20x",
                                    "put-block-vs-nixl: MISS, 0.50x is 50% short of 1.0x"]
    assert "get-block-vs-nixl 1.20x" in out.detail and "put-block-vs-nixl 0.50x" in out.detail
    assert "MISS" in out.detail and "memcpy" not in out.detail
    assert out.metrics["cases"][0] == {"name": "get-block-vs-nixl", "ratio": 1.2, "ratio_min": 1.1, "ratio_max": 1.3}

    ckpt = {"cases": [{"name": "save_async-blocking-1g", "ratio": 9.5, "blocking_fraction": 0.08,
                       "sfstore": {"status": "ok"}}],
            "acceptance": [{"goal": "save >= 2x torch.save", "value": None, "target": 2.0, "met": None,
                            "line": "save >= 2x torch.save: not run (case not selected)"},
                           {"goal": "save_async blocks <= 15% of a sync save", "value": 0.08, "target": 0.15,
                            "met": True, "line": "save_async blocks <= 15% of a sync save: met (8.0%)"}]}
    out = gpu_check.summarize_bench("checkpoint", ckpt)
    assert out.ok and out.metrics["goals"] == ["save_async blocks <= 15% of a sync save: met (8.0%)"]
    assert out.metrics["cases"] == [{"name": "save_async-blocking-1g", "ratio": 9.5, "blocking_fraction": 0.08}]
    assert out.detail == "save_async blocks <= 15% of a sync save: met (8.0%) [save_async-blocking-1g 9.50x]"


def test_a_bench_goal_it_could_not_measure_fails() -> None:
    doc = {"cases": [{"name": "save_async-blocking-1g", "sfstore": {"status": "failed"}}],
           "acceptance": [{"goal": "save_async blocks <= 15% of a sync save", "value": None, "target": 0.15,
                           "met": None, "line": "save_async blocks <= 15% of a sync save: not measured (failed)"}]}
    out = gpu_check.summarize_bench("checkpoint", doc)
    assert not out.ok and "not measured (failed)" in out.detail
    assert not gpu_check.summarize_bench("checkpoint", {"cases": [], "acceptance": []}).ok  # no goal line at all
