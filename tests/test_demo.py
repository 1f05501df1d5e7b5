"""``sfstore demo`` end to end in a reduced form, checking its own summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_end_to_end_and_its_summary_holds(tmp_path: Path) -> None:
    """Twice on one data directory, as README's first command run again does: the second run finds what the
    first stored (checkpoints, hot blocks, KV blocks under the same keys) and must hold all the same."""
    for run in (1, 2):
        _check_demo(tmp_path, run)


def _check_demo(tmp_path: Path, run: int) -> None:
    out_json = tmp_path / f"summary-{run}.json"
    out = subprocess.run(
        [sys.executable, "-m", "sfstore.cli", "demo", "--data-dir", str(tmp_path / "data"), "--size", "8m",
         "--shards", "8", "--json", str(out_json)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, f"run {run}: " + out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads(out_json.read_text())
    assert s["ok"] is True
    # every data class routed, with its path and transport
    assert {c: s["classes"][c]["path"] for c in s["classes"]} == {
        "dataset": "file", "checkpoint": "file", "hot": "block", "kvcache": "device"}
    assert all(c["available"] and c["transport"] == "local" for c in s["classes"].values())
    assert s["classes"]["hot"]["fallbacks"] and s["classes"]["dataset"]["fallbacks"]  # reported, not silent
    assert s["classes"]["checkpoint"]["bytes_written"] > 0 and s["classes"]["hot"]["bytes_read"] > 0
    # the crash-resume step recovered the last committed checkpoint
    tr = s["steps"]["training"]
    assert len(tr["committed"]) >= 3 and tr["recovered_last_committed"] is True
    assert tr["committed"][-1] <= tr["recovered_step"] <= tr["killed_during"]
    assert tr["loss_end"] < tr["loss_start"]
    # KV hits after the first request, from every tier
    kv = s["steps"]["kvcache"]
    assert kv["steps"][0]["hit_tokens"] == 0 and all(st["hit_tokens"] > 0 for st in kv["steps"][1:])
    assert [st["tiers"] for st in kv["steps"][1:]] == [["pinned"], ["block"], ["shared"]]
    assert kv["hits_shared"] > 0 and s["classes"]["kvcache"]["bytes_read"] > 0  # the second store's shared hits
    assert s["steps"]["hot"]["verified"] and s["steps"]["round_trip"]["verified"]
    # the round trip's own path counted what it moved: 8 MiB each way, plus the misaligned read of 9997 bytes
    rt = s["steps"]["round_trip"]["counters"]
    assert rt["bytes_written"] == 8 << 20 and rt["bytes_read"] == (8 << 20) + 9997 and rt["files"] == 1
    assert rt["requests"] == 5 and rt["errors"] == 0  # 4 MiB chunks: 2 writes, 2 reads, 1 misaligned read
    text = out.stdout
    assert "engine    ok" in text and "routing" in text and "summary per data class" in text
    assert "the last committed: recovered" in text and "demo verified in" in text
    # one screen: a line per probe section (the full table is sfstore probe's), and where the data went
    assert "sfstore probe prints the full table" in text and "alignment.memory" not in text
    assert f"its data is in {tmp_path / 'data'}" in text and f"rm -rf {tmp_path / 'data'}" in text


def test_demo_rejects_a_bad_size(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sfstore.cli", "demo", "--data-dir", str(tmp_path), "--size", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "--size" in out.stderr and "Traceback" not in out.stderr
