"""The shared tier's batches: every file of a get in flight at once, each answered as a read of it alone would
be, under one deadline for the batch; the block files of a put written side by side.

Files are made hit, missing, corrupt (a flipped byte), truncated, of another cache namespace, and not a block at
all (a FIFO) on a real directory; a stalled file is an open that waits in the kernel on a FIFO no one writes
(the technique of ``test_kvcache_deadlines``). The stores here keep a file per block (``chunk_tokens=0``): the
format blocks whose chain the store does not know are kept in (chunk files: ``test_kvcache_chunks``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore.kvcache import KVCacheStore
from sfstore.kvcache.tiers import HEADER, release_all
from tests.kvcache import shared_workers as w
from tests.kvcache.stalls import Stall
from tests.kvcache.test_kvcache_deadlines import DEADLINE_MS, SLACK_S, wait_for

MODEL = "batch-test"
PINNED = 16 * (w.GEOM.block_bytes + HEADER)


def _open(shared: Path, *, pinned: int, namespace: str = "", **kwargs: Any) -> KVCacheStore:
    kwargs.setdefault("chunk_tokens", 0)
    return KVCacheStore(w.GEOM, model_id=MODEL, pinned_bytes=pinned, shared_dir=shared, cache_namespace=namespace,
                        **kwargs)


def _publish(shared: Path, blocks: dict[int, int], namespace: str = "") -> list[bytes]:
    """Put block ``v`` under key ``k`` for each item (a writer with no pinned tier writes straight through)."""
    with _open(shared, pinned=0, namespace=namespace) as kv:
        keys = [w.key(kv, i) for i in range(max(blocks) + 1)]
        for k, v in blocks.items():
            kv.put([keys[k]], [w.block(v)])
        return keys


def _file(kv: KVCacheStore, shared: Path, key: bytes) -> Path:
    assert kv.shared is not None
    return shared / kv.shared.file_name(key)


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's own data directory: the quarantine records of its stalled tiers go there, not the host's."""
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture
def submits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The ranges of each ``FilePath.submit`` batch (the real method runs; only its calls are noted)."""
    from sfstore.paths.file import FilePath

    seen: list[int] = []
    real = FilePath.submit

    def noted(self: FilePath, ranges: Any, **kw: Any) -> Any:
        seen.append(len(ranges))
        return real(self, ranges, **kw)

    monkeypatch.setattr(FilePath, "submit", noted)
    yield seen


@pytest.mark.parametrize("pinned", [PINNED, 0], ids=["pinned-tier", "no-pinned-tier"])
def test_a_batch_answers_each_file_as_it_is(tmp_path: Path, pinned: int, submits: list[int]) -> None:
    shared = tmp_path / "shared"
    # 0, 1, 7 hits; 2 never written; 3 corrupt; 4 truncated; 5 only in another namespace; 6 a FIFO
    keys = _publish(shared, {0: 0, 1: 1, 3: 3, 4: 4, 7: 7})
    _publish(shared, {5: 5}, namespace="other")
    with _open(shared, pinned=pinned) as kv:
        corrupt, truncated, fifo = _file(kv, shared, keys[3]), _file(kv, shared, keys[4]), _file(kv, shared, keys[6])
        with open(corrupt, "r+b") as f:
            f.seek(HEADER + 1000)
            byte = f.read(1)
            f.seek(HEADER + 1000)
            f.write(bytes([byte[0] ^ 0x40]))
        os.truncate(truncated, HEADER + w.GEOM.block_bytes // 2)
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo)
        other = next(shared.glob("ns/other/*/*.kvb"))
        dests = [np.full(w.GEOM.block_bytes, 0xA5, dtype=np.uint8) for _ in keys]
        submits.clear()
        t0 = time.monotonic()
        got = kv.get_into(keys, dests)
        assert time.monotonic() - t0 < 5  # the FIFO was not waited on
        assert got == ["shared", "shared", None, None, None, None, None, "shared"]
        # one batch: the ranges of the four files of a block's size (the three hits and the flipped byte), a
        # slot's header and block each, or one scratch buffer each
        assert submits == ([2 * 4] if pinned else [4])
        for i in (0, 1, 7):
            assert np.array_equal(dests[i], w.block(i)), i  # bit-exact
        for i in (2, 3, 4, 5, 6):
            assert (dests[i] == 0xA5).all(), i  # a miss leaves its destination as it was
        assert not corrupt.exists() and not truncated.exists()  # removed, so a later put publishes them again
        assert fifo.exists() and other.exists()  # not a block, and another namespace's: left alone
        s = kv.stats()
        assert (s["gets"], s["misses"], s["hits_shared"]) == (8, 5, 3)
        assert s["bytes_got"] == 3 * w.GEOM.block_bytes
        assert (s["corrupt_dropped"], s["unreadable"]) == (2, 1)
        if pinned:  # promoted: the next get is served from the pinned tier
            assert kv.get_into(keys[:2], dests[:2]) == ["pinned", "pinned"]
        kv.put(keys[3:5], [w.block(3), w.block(4)])
        kv.wait_for_puts()
        assert corrupt.exists() and truncated.exists()


@pytest.mark.parametrize("link", ["absolute", "dotdot", "directory"])
def test_a_link_out_of_the_directory_in_a_batch_is_refused_and_left_alone(tmp_path: Path, link: str) -> None:
    """The batch's files are opened in one native call (openat2 beneath the tier's directory): a block file, or
    the directory above it, that is a symlink to a good block elsewhere is never read through."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    keys = _publish(shared, {0: 0, 1: 1, 2: 2})
    _publish(elsewhere, {0: 0, 1: 1, 2: 2})
    with _open(shared, pinned=PINNED) as kv:
        target, victim = _file(kv, elsewhere, keys[1]), _file(kv, shared, keys[1])
        if link == "directory":  # the key's fan-out directory swapped for a link to the other tree's
            other = [k for k in (keys[0], keys[2]) if _file(kv, shared, k).parent == victim.parent]
            for k in other:
                _file(kv, shared, k).unlink()
            os.rename(victim.parent, tmp_path / "moved")
            os.symlink(target.parent, victim.parent)
        else:
            victim.unlink()
            os.symlink(target if link == "absolute" else os.path.relpath(target, victim.parent), victim)
        dests = [np.zeros(w.GEOM.block_bytes, dtype=np.uint8) for _ in keys]
        got = kv.get_into(keys, dests)
        assert got[1] is None and not dests[1].any()
        if link != "directory":  # the batch's other files are read as usual
            assert got[0] == got[2] == "shared"
            assert np.array_equal(dests[0], w.block(0)) and np.array_equal(dests[2], w.block(2))
        assert target.exists() and os.path.islink(victim if link != "directory" else victim.parent)


def test_the_tier_answers_a_status_per_key(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    _publish(shared, {0: 0, 2: 2, 3: 3})
    keys = _publish(shared, {4: 4}, namespace="other")
    with _open(shared, pinned=PINNED) as kv:
        assert kv.shared is not None
        os.truncate(_file(kv, shared, keys[2]), 100)
        (shared / kv.shared.file_name(keys[1])).parent.mkdir(parents=True, exist_ok=True)
        (shared / kv.shared.file_name(keys[1])).mkdir()  # a directory at the name
        leases = [kv.pinned.take() for _ in keys]
        slots = [lease.slot for lease in leases]
        released: list[int] = []
        try:
            got = kv.shared.read_many_into(keys, slots, release=lambda: released.append(1))
            assert got == ["hit", "unreadable", "corrupt", "hit", "missing"]
            assert released == [1]
            assert bytes(slots[0].data(w.GEOM.block_bytes)) == w.block(0).tobytes()
            assert bytes(slots[3].data(w.GEOM.block_bytes)) == w.block(3).tobytes()
            assert slots[0].checksum and slots[3].checksum
        finally:
            release_all(leases)
        again = [kv.pinned.take(), kv.pinned.take()]
        try:  # the truncated one is gone
            assert kv.shared.read_many_into(keys[2:4], [lease.slot for lease in again]) == ["missing", "hit"]
        finally:
            release_all(again)
        assert kv.shared.read_many_into([], []) == []
        assert kv.shared.read_many_views(keys[:1], [memoryview(bytearray(w.GEOM.block_bytes))]) == ["hit"]


def test_a_renamed_file_of_another_key_is_corrupt_and_dropped(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    keys = _publish(shared, {0: 0, 1: 1})
    with _open(shared, pinned=0) as kv:
        target = _file(kv, shared, keys[1])
        os.replace(_file(kv, shared, keys[0]), target)  # key 1's name, key 0's header and block
        dests = [np.zeros(w.GEOM.block_bytes, dtype=np.uint8) for _ in range(2)]
        assert kv.get_into(keys, dests) == [None, None]
        assert not target.exists() and kv.stats()["corrupt_dropped"] == 1


@contextlib.contextmanager
def _one_file_stalled(kv: KVCacheStore, key: bytes, where: Path) -> Iterator[None]:
    """Within it, the open of ``key``'s file waits on a :class:`Stall` made in ``where``: alone (the other files of
    a batch open at once), or within the batch's one native call that opens every file (where a stalled mount
    would hold the call). Leaving ends the stall."""
    assert kv.shared is not None
    tier = kv.shared
    real, real_many = tier._open, tier._open_blocks
    name = "/".join(tier._entry(key))
    stall = Stall(where)

    def stalled(rel: str, flags: int) -> int:
        if rel == name:
            stall.wait()
        return real(rel, flags)

    def stalled_many(keys: Any) -> Any:
        if key in keys and len(keys) > 1:
            stall.wait()
        return real_many(keys)

    tier._open = stalled  # type: ignore[method-assign]
    tier._open_blocks = stalled_many  # type: ignore[method-assign]
    try:
        yield
    finally:
        stall.close()
        tier._open, tier._open_blocks = real, real_many  # type: ignore[method-assign]


@pytest.mark.parametrize("pinned", [PINNED, 0], ids=["pinned-tier", "no-pinned-tier"])
def test_a_stalled_file_makes_the_whole_batch_a_miss_within_the_deadline(tmp_path: Path, pinned: int) -> None:
    shared = tmp_path / "shared"
    count = 12
    keys = _publish(shared, {i: i for i in range(count)})
    with _open(shared, pinned=pinned, io_timeout_ms=DEADLINE_MS, quarantine_ms=1) as kv:
        assert kv.shared is not None
        guard = kv.shared.guard
        dests = [np.full(w.GEOM.block_bytes, 7, dtype=np.uint8) for _ in keys]
        took = []
        for trial in range(5):
            with _one_file_stalled(kv, keys[count // 2], tmp_path):
                wait_for(lambda: not guard.quarantined(), 5.0)
                t0 = time.monotonic()
                got = kv.get_into(keys, dests)
                took.append(time.monotonic() - t0)
                assert got == [None] * count, trial
                assert all((d == 7).all() for d in dests)
                assert guard.describe()["deadline_misses"] == trial + 1  # one per batch, not per file
            wait_for(lambda: guard.describe()["abandoned_now"] == 0)
            time.sleep(0.05)
            assert all((d == 7).all() for d in dests)  # the late reads never reached the caller's memory
        assert max(took) <= DEADLINE_MS / 1000 + SLACK_S, took
        assert kv.stats()["quarantine"]["shared"]["deadline_misses"] == 5  # one per batch, not per file
        wait_for(lambda: not guard.quarantined(), 5.0)
        assert kv.get_into(keys, dests) == ["shared"] * count
        for i, d in enumerate(dests):
            assert np.array_equal(d, w.block(i)), i
        s = kv.stats()
        assert s["hits_shared"] == count and s["misses"] == 5 * count


def test_a_stalled_batch_never_lands_in_a_reused_slot(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    count = 6
    keys = _publish(shared, {i: i for i in range(count)})
    with _open(shared, pinned=4 * (w.GEOM.block_bytes + HEADER), io_timeout_ms=DEADLINE_MS, quarantine_ms=1) as kv:
        extra = [kv.keys_for(range(1000 + i * 16, 1000 + (i + 1) * 16))[0] for i in range(30)]
        assert kv.shared is not None
        guard = kv.shared.guard
        dest = np.zeros(w.GEOM.block_bytes, dtype=np.uint8)
        with _one_file_stalled(kv, keys[-1], tmp_path):  # once it ends, the late batch reads into every slot
            assert kv.get_into(keys, [np.zeros_like(dest) for _ in keys]) == [None] * count
            for i, k in enumerate(extra):  # churn the pinned tier: every free slot is reused
                kv.put([k], [w.block(100 + i)])
        wait_for(lambda: guard.describe()["abandoned_now"] == 0)
        kv.wait_for_puts()
        resident = list(kv.pinned.entries)
        assert len(resident) == kv.pinned.capacity and not set(resident) & set(keys)
        for k in resident:  # each resident block is its own bytes, never a late read's
            assert kv.get_into([k], [dest]) == ["pinned"]
            assert np.array_equal(dest, w.block(100 + extra.index(k)))


def test_a_large_get_reads_in_waves_each_waves_files_in_flight_together(
        tmp_path: Path, submits: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from sfstore.paths.base import PathFuture

    shared = tmp_path / "shared"
    count = 64 + 5  # more files than one wave holds
    keys = _publish(shared, {i: i % 7 for i in range(count)})
    kv = _open(shared, pinned=0)
    real = PathFuture.results

    def awaited(self: PathFuture, *args: Any, **kw: Any) -> Any:
        submits.append(0)  # (a wait for a batch's results, among the batches' sizes)
        return real(self, *args, **kw)

    monkeypatch.setattr(PathFuture, "results", awaited)
    try:
        dests = [np.zeros(w.GEOM.block_bytes, dtype=np.uint8) for _ in keys]
        submits.clear()
        assert kv.get_into(keys, dests) == ["shared"] * count
        # a wave of 64 files submitted in groups of 16, all in flight before the first group is waited for
        # (each group is verified while the later ones are still read); then the last 5 files
        assert submits == [16, 16, 16, 16, 0, 0, 0, 0, 5, 0]
        assert all(np.array_equal(d, w.block(i % 7)) for i, d in enumerate(dests))
        assert kv.stats()["hits_shared"] == count
    finally:
        kv.close()


@pytest.mark.parametrize("batched", [True, False], ids=["one-native-call", "key-by-key"])
def test_a_lookup_answers_each_name_as_it_is(tmp_path: Path, batched: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup of many keys asks for them in one native call (``stat_files_beneath``, beneath the directory) or,
    without it, key by key: both answer the same. Only a regular file counts; a link out of the directory, a FIFO
    and a directory at a block's name are not blocks, and nothing is opened for reading (the FIFO waits for none)."""
    import sfstore.paths.beneath as beneath

    calls: list[int] = []
    if not batched:
        monkeypatch.setattr(beneath, "_stat_many", None)
    elif beneath._stat_many is None:
        pytest.skip("no native helper with stat_files_beneath here")
    else:
        real = beneath._stat_many

        def noted(dirfd: int, paths: list[str], flags: int, leading: bool) -> list[int]:
            calls.append(len(paths))
            return real(dirfd, paths, flags, leading)

        monkeypatch.setattr(beneath, "_stat_many", noted)
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    keys = _publish(shared, {0: 0, 1: 1, 6: 6})
    _publish(elsewhere, {2: 2})
    with _open(shared, pinned=PINNED) as kv:
        assert kv.shared is not None
        link = _file(kv, shared, keys[2])
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(_file(kv, elsewhere, keys[2]), link)  # a good block, but outside the directory
        fifo, folder = _file(kv, shared, keys[3]), _file(kv, shared, keys[4])
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo)
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir()
        # 0, 1 and 6 are blocks; 2 a link out; 3 a FIFO; 4 a directory; 5 nothing
        t0 = time.monotonic()
        assert kv.shared.present(keys[:7]) == [True, True, False, False, False, False, True]
        assert kv.shared.leading_present(keys[:7]) == 2
        assert kv.shared.leading_present([keys[0], keys[1], keys[6]]) == 3
        assert kv.shared.leading_present([keys[5], keys[0]]) == 0
        assert time.monotonic() - t0 < 5  # the FIFO was not waited on
        assert calls == ([7, 7, 3, 2] if batched else [])  # one call a lookup


def test_a_batch_of_block_files_is_written_side_by_side_and_reads_back(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Several files of one put are being written at once (their fsyncs then share the journal's commits); a key
    twice in the batch is written once, in order."""
    import threading

    from sfstore.kvcache.tier import KVBatch
    from sfstore.kvcache.tiers import SharedTier

    lock, now, most = threading.Lock(), [0], [0]
    real = SharedTier._write_view

    def noted(self: SharedTier, *args: Any) -> bool:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.01)  # long enough for the batch's other writes to start meanwhile
            return real(self, *args)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(SharedTier, "_write_view", noted)
    shared = tmp_path / "shared"
    with _open(shared, pinned=0, fsync_shared=True) as kv:
        assert kv.shared is not None
        keys = [w.key(kv, i) for i in range(12)]
        values = [w.block(i) for i in range(12)]
        assert kv.shared.write(keys, KVBatch("host", [memoryview(v) for v in values])) == ["written"] * 12
        assert most[0] > 1
        twice = [w.key(kv, 20), w.key(kv, 21), w.key(kv, 20)]
        got = kv.shared.write(twice, KVBatch("host", [memoryview(w.block(20)), memoryview(w.block(21)),
                                                      memoryview(w.block(20))]))
        assert got == ["written", "written", "exists"]
    with _open(shared, pinned=0) as kv:
        dests = [np.zeros(w.GEOM.block_bytes, dtype=np.uint8) for _ in keys]
        assert kv.get_into(keys, dests) == ["shared"] * 12
        assert all(np.array_equal(d, v) for d, v in zip(dests, values, strict=True))
