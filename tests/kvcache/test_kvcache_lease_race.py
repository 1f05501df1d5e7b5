"""Pinning by lease: blocks promoted from the shared tier to the block store in the background are read from their
pinned slots while other threads lease, release, evict and reuse the slots of a small pinned tier.

Every block read back (from the pinned tier, the block store or the shared tier, during the race and after it)
must be the one that was put under its key: a slot freed while the promotion still reads it would be reused for
another block, and the block store would hold that block's bytes, checksummed as valid, under the first key.

The window such a lost update needs (a read of a slot's reader count, another thread's change, the write of the
stale count) is a few bytecodes wide: the test widens it with :class:`CountReadOutsideTierWaitsForAChange`, a
test-only slot whose count, when read from outside the pinned tier's module, waits (up to 20 ms, on an event
the count's next change sets) for another thread to change it before the read returns. Inside the tier, where
every change is made under its lock, the wait never starts.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sfstore.blocks import BlockStore
from sfstore.kvcache import KVCacheStore, KVGeometry
from sfstore.kvcache.tiers import PinnedTier, Slot

from .conftest import GEOM

_TIER_MODULE = PinnedTier.__module__
_WINDOW_S = 0.02


class CountReadOutsideTierWaitsForAChange(Slot):
    """Test-only slot: a read of ``readers`` from code outside the pinned tier's module is recorded and returns
    only once another thread has changed the count (or 20 ms passed), with the value read before: it widens the
    window of a read-modify-write of the count made without the tier's lock. Reads from inside the tier (under
    its lock) are untouched."""

    outside: ClassVar[list[str]] = []  # modules that read a slot's reader count from outside the pinned tier
    inside: ClassVar[list[int]] = []  # reads from inside it (one entry each): the hook is in place

    @property  # type: ignore[override]
    def readers(self) -> int:
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        if caller == _TIER_MODULE:
            CountReadOutsideTierWaitsForAChange.inside.append(1)
            return int(self.__dict__["readers"])
        CountReadOutsideTierWaitsForAChange.outside.append(str(caller))
        changed: threading.Event = self.__dict__["changed"]
        changed.clear()
        value = int(self.__dict__["readers"])
        changed.wait(_WINDOW_S)
        return value

    @readers.setter
    def readers(self, value: int) -> None:
        self.__dict__["readers"] = value
        changed = self.__dict__.get("changed")
        if changed is not None:
            changed.set()


class WideWindowPinnedTier(PinnedTier):
    """Test-only pinned tier whose slots are :class:`CountReadOutsideTierWaitsForAChange` (the real tier
    otherwise: the same pool, locks, eviction and reuse)."""

    def _new_slot(self, readers: int = 0) -> Slot:
        slot = super()._new_slot(readers)
        slot.__dict__["changed"] = threading.Event()
        slot.__class__ = CountReadOutsideTierWaitsForAChange
        return slot


def _content(key: bytes, n: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, n, dtype=np.uint8).tobytes()


def _wide_store(geom: KVGeometry, block_store: BlockStore, shared_dir: Path, slots: int) -> KVCacheStore:
    kv = KVCacheStore(geom, model_id="race", pinned_bytes=0, block_store=block_store, shared_dir=shared_dir)
    kv.pinned.close()
    kv.pinned = WideWindowPinnedTier(geom, slots * (geom.block_bytes + 4096))
    return kv


def test_promotion_never_reads_a_slot_reused_while_leased(block_store: BlockStore, shared_dir: Path) -> None:
    geom, n = GEOM, GEOM.block_bytes
    CountReadOutsideTierWaitsForAChange.outside.clear()
    CountReadOutsideTierWaitsForAChange.inside.clear()
    with KVCacheStore(geom, model_id="race", pinned_bytes=0, shared_dir=shared_dir) as writer:
        keys = writer.keys_for(list(range(24 * geom.block_tokens)))
        writer.put(keys, [bytearray(_content(k, n)) for k in keys])  # the shared tier only
    others = [bytes([0xEE]) * 8 + k[8:] for k in keys]  # blocks the putter cycles through the pinned tier
    want = {k: _content(k, n) for k in keys + others}
    kv = _wide_store(geom, block_store, shared_dir, slots=4)
    # this store makes the prompt's keys too, so it finds the blocks in the writer's chunk files
    assert kv.keys_for(list(range(24 * geom.block_tokens))) == keys
    wrong: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)
    stop = threading.Event()

    def check(where: str, key: bytes, got: Any) -> None:
        if bytes(got) != want[key]:
            wrong.append(f"{where}: block {keys.index(key) if key in keys else key.hex()[:8]} differs")

    def fetcher(seed: int) -> None:
        rng = np.random.default_rng(seed)
        start.wait()
        for r in range(150):
            first = int(rng.integers(0, len(keys) - 2))
            ks = keys[first:first + 3]  # the fetchers' windows overlap: they lease the same slots
            if r % 3 == 2:
                with kv.hold(ks) as held:
                    out = bytearray(len(held) * geom.layer_bytes)
                    for layer in range(geom.num_layers):
                        held.copy_layer_into(layer, out)
                        for j, row in enumerate(held.rows):
                            full = want[ks[row]][layer * geom.layer_bytes:(layer + 1) * geom.layer_bytes]
                            if bytes(out[j * geom.layer_bytes:(j + 1) * geom.layer_bytes]) != full:
                                wrong.append(f"held layer {layer} of block {first + row} differs")
            else:
                bufs = [bytearray(n) for _ in ks]
                for k, b, tier in zip(ks, bufs, kv.get_into(ks, bufs), strict=True):
                    if tier is not None:
                        check(f"get_into from {tier}", k, b)
            if stop.is_set():
                return

    def evictor() -> None:
        rng = np.random.default_rng(7)
        start.wait()
        while not stop.is_set():  # the blocks leave the upper tiers: the next fetch promotes them again
            kv.evict([keys[int(i)] for i in rng.integers(0, len(keys), 4)], tiers=("pinned", "block"))
            time.sleep(0.001)

    def putter() -> None:
        start.wait()
        i = 0
        while not stop.is_set():  # other blocks take (and overwrite) the least recently used slots
            k = others[i % len(others)]
            kv.put([k], [bytearray(want[k])])
            i += 1

    def run(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)
            stop.set()

    fetchers = [threading.Thread(target=run, args=(fetcher, s)) for s in range(4)]
    rest = [threading.Thread(target=run, args=(evictor,)), threading.Thread(target=run, args=(putter,))]
    try:
        for t in fetchers + rest:
            t.start()
        for t in fetchers:
            t.join(60)
        stop.set()
        for t in rest:
            t.join(60)
        kv.wait_for_puts()
    except Exception as exc:  # a background write that failed: reported by the test below
        errors.append(exc)
    finally:
        try:
            kv.close()  # waits for the background promotions
        except Exception as exc:
            errors.append(exc)
    promoted = kv.counters.snapshot()["promotions"]
    failures = [f"{type(e).__name__}: {e!r}" for e in errors]
    stored = [k for k in keys + others if block_store.contains(k)]
    for k in stored:
        check("the block store after the race", k, block_store.get(k) or b"")
    assert not wrong and not failures, (
        f"{len(wrong)} blocks read back differ from what was put (e.g. {wrong[:3]}); "
        f"{len(failures)} calls failed (e.g. {failures[:2]})")
    assert promoted > 0 and stored  # the race did promote blocks, and left some in the block store
    assert CountReadOutsideTierWaitsForAChange.inside  # the window-widening slots were the ones in use
    # nothing outside the pinned tier reads (or changes) a slot's reader count: leases do it under its lock
    assert not CountReadOutsideTierWaitsForAChange.outside, sorted(set(CountReadOutsideTierWaitsForAChange.outside))
    assert kv.pinned.leased == 0  # every lease came back exactly once: none is left out once all work is done
