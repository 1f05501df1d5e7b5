"""``sfstore demo`` runs end to end on a fresh data directory and checks its own data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_round_trip_verifies(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sfstore.cli", "demo", "--data-dir", str(tmp_path), "--size", "8m"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("verified       yes") == 5  # engine, sf:// dataset, hot blocks, KV cache, checkpoint
    assert "hot blocks (block path)" in out.stdout and "index recovered from the snapshot" in out.stdout
    assert (tmp_path / "hot" / "blocks.img").is_file()
    assert "same prefix again                  256 of 261 tokens found (from: pinned)" in out.stdout
    assert "pinned tier emptied first          256 of 261 tokens found (from: block)" in out.stdout
    assert "another process, shared tier only  256 of 256 tokens found (from: shared)" in out.stdout
    assert "dataset through sf://" in out.stdout and "256 files at" in out.stdout
    assert len(list((tmp_path / "demo-dataset").iterdir())) == 256
    assert (tmp_path / "checkpoints" / "demo" / "step-1" / "sfstore-manifest.json").is_file()
    assert "engine    ok" in out.stdout  # the probe table came first
    assert "routing" in out.stdout and "dataset     file" in out.stdout
    assert (tmp_path / "demo" / "roundtrip.bin").stat().st_size == 8 << 20


def test_demo_rejects_a_bad_size(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sfstore.cli", "demo", "--data-dir", str(tmp_path), "--size", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "--size" in out.stderr and "Traceback" not in out.stderr
