"""``tools/gpu_check.py``, the driver of the GPU machine's checks, on a CPU machine: its steps run as
subprocesses (``pytest -m gpu``, the gpu bench suite with ``--device cpu``), a failing test FAILs its step, a step
past the budget is stopped and the rest SKIP, and the JSON says what each did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tools import gpu_check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
STEPS = ["tests", "bench_gpu", "bench_checkpoint_save_async", "bench_kvcache_nixl"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _steps(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["step"]: s for s in doc["steps"]}


def test_help() -> None:
    p = _run("--help", timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--blocks", "--block-size", "--budget", "--json", "--device", "--tests", "--skip-bench"):
        assert opt in p.stdout
    assert "Exit status" in p.stdout


@pytest.mark.parametrize("args", [("--blocks", "0"), ("--block-size", "1000"), ("--budget", "0"),
                                  ("--repeat", "0")])
def test_bad_arguments_are_refused(args: tuple[str, str]) -> None:
    p = _run(*args, timeout=60)
    assert p.returncode == 2 and "error" in p.stderr


def test_the_gpu_test_files_are_tests_gpu_and_every_file_marking_a_test_gpu() -> None:
    files = gpu_check.gpu_test_files()
    assert "tests/gpu" in files
    assert "tests/paths/test_device_path.py" in files
    assert not any(f.startswith("tests/gpu/") for f in files)  # the directory, not its files again
    assert "tests/paths/test_beneath.py" not in files


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA GPU: the tests run for real")
def test_without_a_gpu_the_tests_skip_and_the_suite_runs_its_cpu_routes(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    p = _run("--device", "cpu", "--blocks", "4", "--block-size", "2m", "--repeat", "1", "--warmup", "0",
             "--skip-bench", "--dir", str(tmp_path), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = _load(out)
    steps = _steps(doc)
    assert list(steps) == STEPS
    tests = steps["tests"]
    assert tests["status"] == "SKIP" and "needs a CUDA GPU" in tests["detail"]
    assert doc["tests"] and all(t["status"] == "SKIP" and t["message"] for t in doc["tests"])
    assert steps["bench_gpu"]["status"] == "PASS"
    names = {c["name"] for c in doc["bench_gpu"]["cases"]}
    assert {"put-torch-staged", "get-torch-staged", "get-kv-block", "get-kv-shared-pinned", "layers-overlap"} <= names
    skipped = {s["case"]: s["reason"] for s in doc["bench_gpu"]["skipped"]}
    assert "cupy arrays live on a GPU" in skipped["get-cupy-staged"]
    assert "device path carries GPU blocks" in skipped["get-kv-shared"]
    assert steps["bench_checkpoint_save_async"]["status"] == "SKIP" and "--skip-bench" in \
        steps["bench_checkpoint_save_async"]["detail"]
    assert os.listdir(tmp_path) == ["gpu.json"]  # the scratch directory is gone


def _test_file(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "test_gpu_driver_case.py"
    f.write_text("import pytest\n\n" + textwrap.dedent(body))
    return f


def test_a_failing_gpu_test_fails_the_step_and_never_stops_the_others(tmp_path: Path) -> None:
    f = _test_file(tmp_path, """
        @pytest.mark.gpu
        def test_fine():
            pass

        @pytest.mark.gpu
        def test_broken():
            assert 1 + 1 == 3, "arithmetic is off"

        def test_not_marked():
            raise AssertionError("never collected: not marked gpu")
        """)
    out = tmp_path / "gpu.json"
    p = _run("--tests", str(f), "--device", "cpu", "--blocks", "2", "--block-size", "2m", "--repeat", "1",
             "--warmup", "0", "--gpu-cases", "get-torch-staged", "--skip-bench", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    doc = _load(out)
    steps = _steps(doc)
    assert steps["tests"]["status"] == "FAIL" and "test_broken" in steps["tests"]["detail"]
    assert "1 passed, 1 failed" in steps["tests"]["detail"]
    by = {t["test"].rsplit("::", 1)[1]: t for t in doc["tests"]}
    assert set(by) == {"test_fine", "test_broken"}
    assert by["test_broken"]["status"] == "FAIL" and "arithmetic is off" in by["test_broken"]["message"]
    assert steps["bench_gpu"]["status"] == "PASS"  # the next step ran all the same
    assert "FAILED" in p.stdout and "test_broken" in p.stdout


def test_a_step_past_the_budget_is_stopped_and_the_rest_skip(tmp_path: Path) -> None:
    f = _test_file(tmp_path, """
        import time

        @pytest.mark.gpu
        def test_hangs():
            time.sleep(600)
        """)
    out = tmp_path / "gpu.json"
    p = _run("--tests", str(f), "--budget", "8", "--device", "cpu", "--json", str(out), timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    steps = _steps(_load(out))
    assert steps["tests"]["status"] == "FAIL" and "past the time budget" in steps["tests"]["detail"]
    assert steps["tests"]["seconds"] < 60
    for later in STEPS[1:]:
        assert steps[later]["status"] == "SKIP" and "budget" in steps[later]["detail"]


def _goal(case: str, status: str, **extra: Any) -> dict[str, Any]:
    line = {"met": f"goal: {case}: PASS, 1.20x", "missed": f"goal: {case}: MISS, 0.50x is 50% short of 1.0x",
            "n/a": f"goal: {case}: n/a ({extra.get('reason')})",
            "not run": f"goal: {case}: not run (not selected: --cases / --quick)"}[status]
    met = {"met": True, "missed": False}.get(status)
    return {"goal": case, "case": case, "target": 1.0, "status": status, "met": met, "line": line, **extra}


def test_a_bench_with_nixl_unavailable_is_a_skip_with_its_reason() -> None:
    doc = {"cases": [{"name": "put-block-vs-nixl", "ratio": None}, {"name": "get-block-vs-nixl", "ratio": None}],
           "acceptance": [_goal("get-block-vs-fio", "not run"),
                          _goal("get-block-vs-nixl", "n/a", reason="not installed: No module named 'nixl'"),
                          _goal("put-block-vs-nixl", "n/a", reason="not installed: No module named 'nixl'")]}
    with pytest.raises(gpu_check.Skip, match="NIXL cannot run here: not installed: No module named 'nixl'"):
        gpu_check.summarize_bench("kvcache", doc)


def test_a_bench_reports_its_goal_lines_ratios_and_skipped_cases() -> None:
    doc = {"cases": [{"name": "get-block-vs-nixl", "ratio": 1.2, "ratio_min": 1.1, "ratio_max": 1.3},
                     {"name": "put-block-vs-nixl", "ratio": 0.5, "ratio_min": 0.4, "ratio_max": 0.6}],
           "acceptance": [_goal("get-block-vs-nixl", "met"), _goal("put-block-vs-nixl", "missed"),
                          _goal("get-pinned-vs-memcpy", "not run")]}
    out = gpu_check.summarize_bench("kvcache", doc)
    assert out.ok  # a missed goal is reported, not a failure of the step
    assert out.metrics["goals"] == ["get-block-vs-nixl: PASS, 1.20x",
                                    "put-block-vs-nixl: MISS, 0.50x is 50% short of 1.0x"]
    assert "get-block-vs-nixl 1.20x" in out.detail and "put-block-vs-nixl 0.50x" in out.detail
    assert "memcpy" not in out.detail

    gpu = {"cases": [{"name": "layers-overlap", "ratio": 1.9, "hidden_fraction": 0.9}],
           "skipped": [{"case": "get-torch-gds", "reason": "no GPU-direct storage here"}],
           "acceptance": [_goal("layers-overlap", "n/a", reason="--device cpu: no streams")]}
    out = gpu_check.summarize_bench("gpu", gpu)
    assert out.ok  # an n/a goal with its reason is not a goal left unmeasured
    assert "get-torch-gds (no GPU-direct storage here)" in out.detail
    assert out.metrics["cases"] == [{"name": "layers-overlap", "ratio": 1.9, "hidden_fraction": 0.9}]


def test_a_bench_goal_it_could_not_measure_fails() -> None:
    doc = {"cases": [{"name": "save_async-blocking-1g", "sfstore": {"status": "failed"}}],
           "acceptance": [{"goal": "save_async blocks <= 15% of a sync save", "value": None, "target": 0.15,
                           "met": None, "line": "save_async blocks <= 15% of a sync save: not measured (failed)"}]}
    out = gpu_check.summarize_bench("checkpoint", doc)
    assert not out.ok and "not measured (failed)" in out.detail
    assert not gpu_check.summarize_bench("checkpoint", {"cases": [], "acceptance": []}).ok  # no goal line at all


def test_junit_reports_are_read_per_test(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(textwrap.dedent("""\
        <testsuites><testsuite>
          <testcase classname="tests.gpu.test_a" name="test_ok"/>
          <testcase classname="tests.gpu.test_a" name="test_bad"><failure message="boom">trace</failure></testcase>
          <testcase classname="tests.gpu.test_a" name="test_err"><error message="setup broke"/></testcase>
          <testcase classname="tests.gpu.test_a" name="test_skip"><skipped message="needs a CUDA GPU"/></testcase>
        </testsuite></testsuites>"""))
    assert gpu_check.read_junit(str(xml)) == [
        {"test": "tests.gpu.test_a::test_ok", "status": "PASS", "message": ""},
        {"test": "tests.gpu.test_a::test_bad", "status": "FAIL", "message": "boom"},
        {"test": "tests.gpu.test_a::test_err", "status": "FAIL", "message": "setup broke"},
        {"test": "tests.gpu.test_a::test_skip", "status": "SKIP", "message": "needs a CUDA GPU"},
    ]
