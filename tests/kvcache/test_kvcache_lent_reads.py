"""Shared-tier reads straight into the caller's memory (``get_into(keep_on_miss=False)``): without a deadline, or
under one where the caller lends its blocks (``lend``), block files land in the destinations with no scratch
buffer and no copy; a read abandoned at its deadline keeps writing the lent blocks, and the store says which
and when it stops. Real files in a real directory; the stall is an open that waits in the kernel on a FIFO no one
writes (``tests.kvcache.stalls``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sfstore import errors
from sfstore.kvcache import KVCacheStore
from tests.kvcache import shared_workers as w
from tests.kvcache.test_kvcache_deadlines import DEADLINE_MS, SLACK_S, wait_for
from tests.kvcache.test_kvcache_shared_batch import _file, _one_file_stalled, _open, _publish


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data"))


def _scratch_taken(kv: KVCacheStore) -> int:
    """Scratch buffers the shared tier has allocated (a read through them needs one per block of a batch)."""
    assert kv.shared is not None
    return int(kv.shared._scratch.stats()["allocated"])


@pytest.mark.parametrize("deadline_ms", [0, DEADLINE_MS], ids=["no-deadline", "deadline-lent"])
def test_a_read_that_may_leave_a_miss_dirty_lands_straight_in_the_callers_memory(
        tmp_path: Path, deadline_ms: int) -> None:
    shared = tmp_path / "shared"
    keys = _publish(shared, {0: 0, 1: 1, 2: 2, 3: 3})
    with _open(shared, pinned=0, io_timeout_ms=deadline_ms) as kv:
        flipped = _file(kv, shared, keys[2])
        with open(flipped, "r+b") as f:  # a byte of block 2 flipped
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        dests = [np.zeros(w.GEOM.block_bytes, dtype=np.uint8) for _ in keys]
        lent: list[list[int]] = []
        lend = (lambda at: lent.append(at) or (lambda: None)) if deadline_ms else None
        before = _scratch_taken(kv)
        assert kv.get_into(keys, dests, keep_on_miss=False, lend=lend) == ["shared", "shared", None, "shared"]
        for i in (0, 1, 3):
            assert np.array_equal(dests[i], w.block(i)), i
        # the damaged block was read into its destination (no scratch buffer between), and found out there
        want = w.block(2)
        want[100] ^= 0xFF
        assert np.array_equal(dests[2], want)
        assert _scratch_taken(kv) == before == 0 and lent == []
        assert kv.stats()["corrupt_dropped"] == 1 and not flipped.exists()


def test_under_a_deadline_without_lend_the_callers_memory_is_written_only_in_time(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    keys = _publish(shared, {i: i for i in range(4)})
    with _open(shared, pinned=0, io_timeout_ms=DEADLINE_MS, quarantine_ms=1) as kv:
        assert kv.shared is not None
        dests = [np.full(w.GEOM.block_bytes, 7, dtype=np.uint8) for _ in keys]
        with _one_file_stalled(kv, keys[1], tmp_path):
            assert kv.get_into(keys, dests, keep_on_miss=False) == [None] * 4
        wait_for(lambda: kv.shared is not None and kv.shared.guard.describe()["abandoned_now"] == 0)
        time.sleep(0.05)
        assert all((d == 7).all() for d in dests)  # the late read went to scratch buffers


def test_a_lent_batch_past_its_deadline_is_given_back_when_its_read_returns(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    count = 6
    keys = _publish(shared, {i: i for i in range(count)})
    with _open(shared, pinned=0, io_timeout_ms=DEADLINE_MS, quarantine_ms=1) as kv:
        assert kv.shared is not None
        guard = kv.shared.guard
        dests = [np.full(w.GEOM.block_bytes, 7, dtype=np.uint8) for _ in keys]
        lent: list[list[int]] = []
        given_back = threading.Event()
        answered = threading.Event()
        order: list[str] = []

        def lend(at: list[int]) -> Callable[[], None]:
            assert not answered.is_set()  # told before get_into answers
            lent.append(at)

            def back() -> None:
                order.append("back")
                given_back.set()
            return back

        with _one_file_stalled(kv, keys[count // 2], tmp_path):
            wait_for(lambda: not guard.quarantined(), 5.0)
            t0 = time.monotonic()
            assert kv.get_into(keys, dests, keep_on_miss=False, lend=lend) == [None] * count
            took = time.monotonic() - t0
            answered.set()
            assert took <= DEADLINE_MS / 1000 + SLACK_S, took
            assert lent == [list(range(count))]
            time.sleep(0.05)
            assert not given_back.is_set()  # the read is still stuck in the stall: the blocks stay lent
            assert all((d == 7).all() for d in dests)
            order.append("stall ends")
        assert given_back.wait(10)
        assert order == ["stall ends", "back"]
        # the abandoned read did write the lent blocks, after get_into answered: why they had to stay lent
        for i, d in enumerate(dests):
            assert np.array_equal(d, w.block(i)), i
        wait_for(lambda: guard.describe()["abandoned_now"] == 0)


def test_lend_is_refused_where_a_miss_must_leave_the_block_as_it_was(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    keys = _publish(shared, {0: 0})
    with _open(shared, pinned=0) as kv:
        with pytest.raises(errors.InvalidRequestError, match="keep_on_miss=False"):
            kv.get_into(keys, [np.zeros(w.GEOM.block_bytes, dtype=np.uint8)], lend=lambda at: lambda: None)
