"""Crash test of the block store: 30 random SIGKILLs of a child putting, overwriting, deleting and flushing.

After each kill, every flushed put is read back bit-exactly (or a newer, whole, unflushed one), and nothing
torn or older is ever returned; see :mod:`sfstore.testing.block_crash`.
"""

from __future__ import annotations

import json
from pathlib import Path

from sfstore.testing.block_crash import run_trials


def test_sigkill_trials_never_lose_a_flushed_put_or_return_a_torn_one(tmp_path: Path) -> None:
    report = run_trials(tmp_path, 30, seed=7)
    print("block store crash trials:", json.dumps(report.as_dict()))
    assert report.failures == []
    assert report.trials == 30
    assert report.flushes >= 30 and report.operations > 100
