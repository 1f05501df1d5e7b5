"""The KV tier conformance suite: what every tier of the KV cache must do (:class:`~sfstore.kvcache.tier.KVTier`).

Subclass :class:`KVTierTests` and provide the ``tier`` fixture (a tier for :data:`GEOM`, closed afterwards) and,
for a tier that keeps blocks where they can be damaged, :meth:`KVTierTests.damage`. Each test writes and reads
real blocks through the contract only: presence, reads into the caller's host memory and into leased pinned
slots, writes from both, removal, counts, a damaged block (a miss that leaves the destination as it was, then
stored again), and threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sfstore import errors
from sfstore.checksums import xxh3_64
from sfstore.kvcache.geometry import KVGeometry, chained_keys
from sfstore.kvcache.tier import READ_STATUSES, WRITE_STATUSES, KVBatch, KVTier
from sfstore.kvcache.tiers import PinnedTier

__all__ = ["KVTierTests", "GEOM", "block_bytes", "flip_byte"]

GEOM = KVGeometry(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="float16")  # 8 KiB blocks


def block_bytes(i: int, version: int = 0) -> bytes:
    """Reproducible bytes of block ``i`` (``version``: another value under the same key)."""
    return np.random.default_rng(1000 * version + i).integers(0, 256, GEOM.block_bytes, dtype=np.uint8).tobytes()


def flip_byte(path: str | os.PathLike[str], offset: int) -> None:
    """Change one byte of a file or block device in place, durably (an O_DIRECT reader sees it): damage for
    :meth:`KVTierTests.damage`."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def keys(n: int, salt: int = 0) -> list[bytes]:
    """``n`` chained keys of one prompt (``salt``: another prompt)."""
    return chained_keys([(salt * 7919 + t) % 32000 for t in range(n * GEOM.block_tokens)], GEOM.block_tokens,
                        b"conformance")


def host(data: list[bytes]) -> KVBatch:
    return KVBatch("host", [memoryview(bytearray(d)) for d in data])


def empty(n: int, fill: int = 0xA5) -> KVBatch:
    return KVBatch("host", [memoryview(bytearray([fill]) * GEOM.block_bytes) for _ in range(n)])


class KVTierTests:
    """Conformance tests for one kind of :class:`~sfstore.kvcache.tier.KVTier`."""

    #: whether the tier keeps blocks where :meth:`damage` can reach them (memory tiers hold no checksum to fail)
    damageable = True

    @pytest.fixture
    def tier(self) -> Iterator[KVTier]:
        raise NotImplementedError("a subclass provides the tier fixture")

    @pytest.fixture
    def slots(self) -> Iterator[PinnedTier]:
        """Pinned slots to lease for ``slots`` batches."""
        p = PinnedTier(GEOM, 16 * (GEOM.block_bytes + 8192))
        yield p
        p.close()

    def damage(self, tier: KVTier, key: bytes) -> None:
        """Change the stored bytes of ``key``'s block so that its verification fails (override)."""
        raise NotImplementedError

    # -- presence and round trips -------------------------------------------------------------------------------
    def test_write_then_read_back(self, tier: KVTier) -> None:
        ks = keys(4)
        data = [block_bytes(i) for i in range(4)]
        assert tier.write(ks, host(data)) == ["written"] * 4
        assert tier.present(ks) == [True] * 4
        assert tier.leading_present(ks) == 4
        dests = empty(4)
        assert tier.read_into(ks, dests) == ["hit"] * 4
        assert [bytes(d) for d in dests.items] == data
        for c, d in zip(dests.checksums, data, strict=True):  # a checksum a tier reports is the bytes' xxh3-64
            assert c is None or c == xxh3_64(d)
        assert tier.count() == 4

    def test_a_missing_key_is_a_miss_that_leaves_its_destination(self, tier: KVTier) -> None:
        ks = keys(3)
        tier.write(ks[1:2], host([block_bytes(1)]))
        dests = empty(3)
        assert tier.read_into(ks, dests) == ["missing", "hit", "missing"]
        assert bytes(dests.items[0]) == bytes(dests.items[2]) == bytes([0xA5]) * GEOM.block_bytes
        assert bytes(dests.items[1]) == block_bytes(1)
        assert tier.present(ks) == [False, True, False]
        assert tier.leading_present(ks) == 0
        assert tier.read_into([], empty(0)) == [] and tier.write([], host([])) == [] and tier.present([]) == []

    def test_statuses_are_the_contracts(self, tier: KVTier) -> None:
        ks = keys(2)
        assert set(tier.write(ks, host([block_bytes(0), block_bytes(1)]))) <= set(WRITE_STATUSES)
        assert set(tier.read_into(ks + keys(1, salt=9), empty(3))) <= set(READ_STATUSES)

    def test_a_second_write_keeps_one_block(self, tier: KVTier) -> None:
        ks = keys(1)
        tier.write(ks, host([block_bytes(0)]))
        assert tier.write(ks, host([block_bytes(0)])) in (["written"], ["exists"])
        dests = empty(1)
        assert tier.read_into(ks, dests) == ["hit"] and bytes(dests.items[0]) == block_bytes(0)
        assert tier.count() == 1

    def test_remove(self, tier: KVTier) -> None:
        ks = keys(3)
        tier.write(ks, host([block_bytes(i) for i in range(3)]))
        assert tier.remove([ks[0], ks[2], keys(1, salt=5)[0]]) == 2
        assert tier.present(ks) == [False, True, False]
        assert tier.remove([ks[0]]) == 0
        assert tier.read_into(ks[:1], empty(1)) == ["missing"]
        assert tier.count() == 1

    def test_prefix_presence_stops_at_the_first_gap(self, tier: KVTier) -> None:
        ks = keys(5)
        tier.write([ks[i] for i in (0, 1, 3, 4)], host([block_bytes(i) for i in (0, 1, 3, 4)]))
        assert tier.leading_present(ks) == 2
        assert tier.present(ks) == [True, True, False, True, True]

    # -- pinned slots -------------------------------------------------------------------------------------------
    def test_slots_in_and_out(self, tier: KVTier, slots: PinnedTier) -> None:
        ks = keys(3)
        n = GEOM.block_bytes
        src = [slots.take() for _ in ks]
        dst = [slots.take() for _ in ks]
        try:
            for i, lease in enumerate(src):
                lease.slot.data(n)[:] = block_bytes(i, version=3)
            if tier.name == "pinned":
                with pytest.raises(errors.InvalidRequestError, match="lease"):
                    tier.write(ks, KVBatch("slots", src))
                with pytest.raises(errors.InvalidRequestError, match="lease"):
                    tier.read_into(ks, KVBatch("slots", dst))
                return
            assert tier.write(ks, KVBatch("slots", src)) == ["written"] * 3
            out = KVBatch("slots", dst)
            assert tier.read_into(ks, out) == ["hit"] * 3
            assert [bytes(lease.slot.data(n)) for lease in dst] == [block_bytes(i, version=3) for i in range(3)]
            assert out.checksums == [xxh3_64(block_bytes(i, version=3)) for i in range(3)]
        finally:
            for lease in src + dst:
                lease.release()
        assert slots.leased == 0  # the tier gave back every lease it took on the slots

    # -- damage ---------------------------------------------------------------------------------------------------
    def test_a_damaged_block_is_a_miss_then_stored_again(self, tier: KVTier) -> None:
        if not self.damageable:
            pytest.skip(f"the {tier.name} tier keeps blocks in this process's memory: nothing outside can damage them")
        ks = keys(3)
        tier.write(ks, host([block_bytes(i) for i in range(3)]))
        self.damage(tier, ks[1])
        dests = empty(3)
        assert tier.read_into(ks, dests) == ["hit", "corrupt", "hit"]
        assert bytes(dests.items[1]) == bytes([0xA5]) * GEOM.block_bytes  # the failed bytes never reached it
        assert [bytes(dests.items[i]) for i in (0, 2)] == [block_bytes(0), block_bytes(2)]
        assert tier.present(ks) == [True, False, True]  # removed, so a later write stores it again
        assert tier.write(ks[1:2], host([block_bytes(1)])) == ["written"]
        again = empty(1)
        assert tier.read_into(ks[1:2], again) == ["hit"] and bytes(again.items[0]) == block_bytes(1)

    # -- threads --------------------------------------------------------------------------------------------------
    def test_threads(self, tier: KVTier) -> None:
        failures: list[Any] = []

        def work(t: int) -> None:
            try:
                ks = keys(3, salt=100 + t)
                data = [block_bytes(10 * t + i) for i in range(3)]
                for _ in range(5):
                    tier.write(ks, host(data))
                    dests = empty(3)
                    got = tier.read_into(ks, dests)
                    if got != ["hit"] * 3 or [bytes(d) for d in dests.items] != data:
                        failures.append((t, got))
            except Exception as exc:
                failures.append((t, exc))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not failures
        assert tier.count() == 12
