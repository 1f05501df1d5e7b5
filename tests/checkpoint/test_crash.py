"""Crash safety: SIGKILL trials, interrupted replaces, stale staging directories."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from sfstore import checkpoint, temp_names
from sfstore.checkpoint import location
from sfstore.testing.checkpoint_crash import run_trials


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sigkill_at_random_moments_leaves_the_last_commit_loadable(tmp_path: Path) -> None:
    """30 trials with renameat2 (RENAME_NOREPLACE / RENAME_EXCHANGE), 10 with the two-step replace that
    filesystems without renameat2 flags (NFS) get."""
    began = time.monotonic()
    report = run_trials(tmp_path / "exchange", 30, seed=1)
    fallback = run_trials(tmp_path / "two-step", 10, seed=2, exchange=False)
    print("crash trials:", json.dumps(report.as_dict()), json.dumps(fallback.as_dict()))
    assert report.failures == [] and fallback.failures == []
    assert report.trials == 30 and fallback.trials == 10
    assert report.killed_mid_save + fallback.killed_mid_save >= 10  # most kills land inside a save
    assert time.monotonic() - began < 120
    # The next save in each directory removes what the killed savers left.
    for d in ("exchange", "two-step"):
        checkpoint.save({"x": torch.ones(1)}, tmp_path / d / "final", overwrite=True)
        assert not [e for e in os.listdir(tmp_path / d) if ".sfstore-" in e]


def test_an_interrupted_two_step_replace_brings_the_previous_checkpoint_back(tmp_path: Path) -> None:
    checkpoint.save({"v": torch.tensor(1)}, tmp_path / "ck", metadata={"step": 1})
    # A replace killed between its two renames: the old checkpoint moved aside, the new one not yet in place.
    old = tmp_path / f".ck.sfstore-old-{temp_names.host()}-{dead_pid()}-abc123"
    os.rename(tmp_path / "ck", old)
    staging = tmp_path / f".ck.sfstore-staging-{temp_names.host()}-{dead_pid()}-def456"
    staging.mkdir()
    (staging / "shard-00000.safetensors").write_bytes(b"half written")
    assert int(checkpoint.load(tmp_path / "ck")["v"]) == 1  # load finds it back
    assert (tmp_path / "ck").is_dir() and not old.exists()
    os.rename(tmp_path / "ck", old)
    info = checkpoint.latest(tmp_path)  # and so does latest()
    assert info is not None and info.name == "ck" and info.step == 1
    checkpoint.save({"v": torch.tensor(2)}, tmp_path / "other")
    assert sorted(os.listdir(tmp_path)) == ["ck", "other"]  # the save removed the dead staging directory


def test_replace_without_renameat2_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(location, "USE_RENAMEAT2", False)
    checkpoint.save({"v": torch.tensor(1)}, tmp_path / "ck")
    checkpoint.save({"v": torch.tensor(2)}, tmp_path / "ck", overwrite=True)
    assert int(checkpoint.load(tmp_path / "ck")["v"]) == 2
    with pytest.raises(FileExistsError):
        checkpoint.save({"v": torch.tensor(3)}, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_cleanup_spares_live_savers_and_young_foreign_ones(tmp_path: Path) -> None:
    host = temp_names.host()
    live = tmp_path / f".a.sfstore-staging-{host}-{os.getpid()}-aa"
    dead = tmp_path / f".a.sfstore-staging-{host}-{dead_pid()}-bb"
    foreign_young = tmp_path / ".a.sfstore-staging-otherhost-1-cc"
    foreign_old = tmp_path / ".a.sfstore-staging-otherhost-2-dd"
    unrelated = tmp_path / ".a.something-else"
    for d in (live, dead, foreign_young, foreign_old, unrelated):
        d.mkdir()
    long_ago = time.time() - temp_names.FOREIGN_STALE_SECONDS - 60
    os.utime(foreign_old, (long_ago, long_ago))
    checkpoint.save({"x": torch.zeros(1)}, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", live.name, foreign_young.name, unrelated.name])
