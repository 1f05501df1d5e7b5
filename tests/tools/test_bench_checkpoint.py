"""Tests of ``python -m tools.bench checkpoint``: the state-dict layout, case selection, acceptance lines, and a tiny
end-to-end run whose JSON has the common shape (sfstore sides measured, or "not built yet" before the core lands)."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from tools.bench.common import BenchSetupError
from tools.bench.suites.checkpoint import QUICK_CASES, all_cases, evaluate_goals, llm_layout, select_cases
from tools.bench.testing import run_bench

MIB = 1 << 20


_bench = functools.partial(run_bench, timeout=600)


@pytest.mark.parametrize("size", [32 * MIB, 2 << 30])
def test_layout_is_llm_like_and_near_the_size(size: int) -> None:
    layout = llm_layout(size)
    nbytes = [2 * math.prod(shape) for _, shape in layout]
    total = sum(nbytes)
    assert 0.85 * size <= total <= size
    assert len({name for name, _ in layout}) == len(layout)
    big = sorted(nbytes, reverse=True)
    assert big[0] >= 0.05 * total  # a few huge tensors (embedding, LM head)
    assert sum(1 for n in nbytes if n <= 64 << 10) >= 40  # many small ones (norms, biases)
    if size == 2 << 30:
        assert layout[0] == ("model.embed_tokens.weight", (32768, 2048))


def test_case_names_and_selection() -> None:
    names = [c.name("2g") for c in all_cases()]
    assert {"save-2g-vs-torch.save", "load-2g-vs-safetensors", "save_async-blocking-2g", "save-2g-vs-fio",
            "load-2g-vs-fio", "save-2g-vs-dcp", "load-2g-vs-torch.load", "dcp-save-2g-vs-dcp",
            "dcp-load-2g-vs-dcp"} <= set(names)
    assert [c.stem for c in select_cases("2g", quick=True)] == [c.stem for c in all_cases() if c.stem in QUICK_CASES]
    assert [c.name("2g") for c in select_cases("2g", ["load-*-vs-fio,save_async*"])] == [
        "save_async-blocking-2g", "load-2g-vs-fio"]
    with pytest.raises(BenchSetupError, match="no checkpoint case"):
        select_cases("2g", ["nope"])


def _case(name: str, side: str, ratio: float | None, rss: int | None = None, status: str = "ok",
          **extra: Any) -> dict[str, Any]:
    return {"name": name, "params": {"sfstore_side": side},
            "sfstore": {"status": status, "peak_rss_growth_bytes": rss}, "reference": {"status": "ok"},
            "ratio": ratio, **extra}


def test_goal_lines() -> None:
    cases = [
        _case("save-2g-vs-torch.save", "sfstore.checkpoint.save", 2.5, rss=100 * MIB),
        _case("save-2g-vs-safetensors", "sfstore.checkpoint.save", 1.1, rss=200 * MIB),
        _case("load-2g-vs-torch.load", "sfstore.checkpoint.load", None, status="not built yet: x"),
        _case("save_async-blocking-2g", "sfstore.checkpoint.save_async", 8.0, blocking_fraction=0.2),
        _case("load-2g-vs-safetensors", "sfstore.checkpoint.load", 1.5, rss=3 << 30),
    ]
    goals = {g["goal"].split(" (")[0]: g for g in evaluate_goals(cases, "2g", 2 << 30, 1 << 30)}
    assert goals["save >= 2x torch.save"]["met"] is True
    assert "met (2.50x)" in goals["save >= 2x torch.save"]["line"]
    assert goals["save >= 1.3x safetensors"]["met"] is False
    assert "missed by 0.20x" in goals["save >= 1.3x safetensors"]["line"]
    assert goals["load >= 2x torch.load"]["met"] is None and "not built yet" in goals["load >= 2x torch.load"]["line"]
    assert goals["save >= 0.8x fio write"]["met"] is None and "not run" in goals["save >= 0.8x fio write"]["line"]
    assert goals["save_async blocks <= 15% of a sync save"]["met"] is False
    load_rss = next(g for k, g in goals.items() if k.startswith("load peak RSS"))
    assert load_rss["met"] is False and load_rss["value"] == 3 << 30
    save_rss = next(g for k, g in goals.items() if k.startswith("sync save peak RSS"))
    assert save_rss["met"] is True and save_rss["value"] == 200 * MIB


def test_without_the_core_the_references_still_run(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tools.bench import cli
    from tools.bench.suites import checkpoint

    monkeypatch.setattr(checkpoint, "_import_core", lambda: (None, "sfstore.checkpoint has no save"))
    args = cli.build_parser().parse_args(["checkpoint", "--size", "4m", "--repeat", "1", "--dir", str(disk_dir),
                                          "--cases", "save-*-vs-torch.save,load-*-vs-safetensors,save_async*"])
    doc = checkpoint.run(args)
    by_name = {c["name"]: c for c in doc["cases"]}
    assert set(by_name) == {"save-4m-vs-torch.save", "load-4m-vs-safetensors", "save_async-blocking-4m"}
    for name in ("save-4m-vs-torch.save", "load-4m-vs-safetensors"):
        case = by_name[name]
        assert case["sfstore"]["status"].startswith("not built yet") and case["ratio"] is None
        assert case["reference"]["status"] == "ok" and case["reference"]["bytes_per_s"] > 0
    goal = next(g for g in doc["acceptance"] if g["goal"] == "save >= 2x torch.save")
    assert goal["met"] is None and "not built yet" in goal["line"]


def test_tiny_run_json_shape(disk_dir: Path) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = disk_dir / "checkpoint.json"
    proc = _bench("checkpoint", "--size", "32m", "--repeat", "1", "--dir", str(disk_dir / "bench"),
                  "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "checkpoint" and doc["date"] and isinstance(doc["machine"], dict)
    assert doc["state_dict"]["tensors"] > 40 and doc["state_dict"]["tensor_bytes"] <= 32 * MIB
    names = [c["name"] for c in doc["cases"]]
    assert names == [c.name("32m") for c in all_cases()]
    for case in doc["cases"]:
        assert {"name", "params", "sfstore", "reference_tool", "reference", "ratio"} <= set(case)
        for side in ("sfstore", "reference"):
            s = case[side]
            assert {"bytes_per_s", "cpu_s_per_gib", "peak_rss_growth_bytes", "runs", "status"} <= set(s)
            assert s["status"] == "ok" or s["status"].startswith("not built yet"), (case["name"], side, s["status"])
            if s["status"] == "ok":
                assert s["bytes_per_s"] > 0 and len(s["runs"]) == 1 and s["cpu_s_per_gib"] is not None
        if case["sfstore"]["status"] == "ok" and case["reference"]["status"] == "ok":
            assert case["ratio"] is not None and case["ratio"] > 0
        if case["params"]["op"] == "save":
            assert case["params"]["fsync_in_timed_region"] is True
        if case["reference_tool"] not in ("sfstore.checkpoint.save",):
            assert case["reference"]["status"] == "ok"  # every reference runs, core or not
    assert len(doc["acceptance"]) == 9 and all("line" in g for g in doc["acceptance"])
    assert "goal: save >= 2x torch.save" in proc.stdout
    # the checkpoints written are removed at the end (only fio's reusable file stays)
    work = disk_dir / "bench" / "checkpoint-32m"
    assert sorted(p.name for p in work.iterdir()) == ["engine-32m.dat"]


def test_reliability_mode_reports_sigkill_trials(disk_dir: Path) -> None:
    out = disk_dir / "rel.json"
    proc = _bench("checkpoint", "--size", "32m", "--repeat", "1", "--warmup", "0", "--dir", str(disk_dir / "bench"),
                  "--cases", "save-*-vs-torch.save", "--reliability", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = json.loads(out.read_text())["reliability"]
    assert rel["trials"] == 3 and rel["failures"] == []
    assert "reliability: 3 trials" in proc.stdout
