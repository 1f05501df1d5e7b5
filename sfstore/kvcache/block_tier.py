"""The block-store tier of the KV cache: blocks in the slots of a :class:`~sfstore.blocks.BlockStore` (NVMe, NVMe
over RDMA on a cluster), behind the :class:`~sfstore.kvcache.tier.KVTier` contract.

The block store verifies each value against the checksum it holds (xxh3-64 of host bytes, or kvsum64 for a
block written GPU-direct) and answers presence from its index in memory. Its calls run under the tier's own
deadline (a fabric can stall too), 16 blocks a call: past it those are misses or dropped writes. Memory the
caller gets back must never be touched by a call abandoned past its deadline, so under a deadline the caller's
host memory is copied through registered staging buffers on the caller's thread (only leased pinned slots, kept
from reuse by their leases, are filled and read in place).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from sfstore.blocks import BlockStore
from sfstore.buffers import RegisteredBuffer, RegisteredBufferPool
from sfstore.checksums import SumKind
from sfstore.kvcache.deadline import OK, TIMEOUT, Outcome, QuarantineRecorder, TierGuard
from sfstore.kvcache.geometry import KVGeometry
from sfstore.kvcache.tier import KVBatch, KVTier, ReadStatus, WriteStatus, read_status
from sfstore.kvcache.tiers import Lease, lease_again, release_all

if TYPE_CHECKING:
    from sfstore.paths.device import DevicePath

__all__ = ["BlockKVTier"]

_T = TypeVar("_T")

# Blocks per block-store call: each call runs under its own deadline (a batch of any size is not one call that
# must finish within it, all dropped or all missed past it), and the staging buffers held are bounded.
_WAVE = 16


class BlockKVTier(KVTier):
    """KV blocks in a block store's slots (see the module).

    Parameters
    ----------
    store : BlockStore
        Its largest size class holds a block.
    geometry : KVGeometry
    timeout_s, quarantine_s : float
        The deadline of each call (0: none) and the first back-off of the quarantine past it.
    """

    name = "block"
    guard: TierGuard

    def __init__(self, store: BlockStore, geometry: KVGeometry, *, timeout_s: float = 0.0,
                 quarantine_s: float = 1.0) -> None:
        self.store = store
        self.geometry = geometry
        self.guard = TierGuard("block", timeout_s, quarantine_s, workers=4, max_abandoned=8,
                               recorder=QuarantineRecorder("block", target=str(store.path.device)))
        self._stage = RegisteredBufferPool(-(-geometry.block_bytes // 4096) * 4096)

    @property
    def in_memory(self) -> bool:
        return True  # the block store's index

    @property
    def supports_device_buffers(self) -> bool:
        return True

    # -- presence ---------------------------------------------------------------------------------------------
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.store.contains(k) for k in keys]

    def checksum(self, key: bytes) -> int | None:
        """The xxh3-64 of the block's host bytes the store holds (``None``: not here, or a GPU-direct kvsum64)."""
        if self.store.sum_kind(key) is not SumKind.XXH3:
            return None
        return self.store.checksum(key)

    def __len__(self) -> int:
        return len(self.store)

    def count(self) -> int | None:
        return len(self.store)

    # -- the guard --------------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., _T], *args: object, leases: Sequence[Lease] = (),
            buffers: Sequence[RegisteredBuffer] = (), what: str) -> tuple[Outcome, _T | None]:
        """A block-store call within the tier's deadline: ``(status, result)`` as
        :meth:`TierGuard.run <sfstore.kvcache.deadline.TierGuard.run>`. ``leases`` and ``buffers`` (registered
        staging buffers) are what the call reads or fills: kept from reuse until it is done with them."""
        release_slots = lease_again(leases)

        def release() -> None:
            release_slots()
            release_all(buffers)

        return self.guard.run_holding(release, fn, *args, what=f"a block-store {what}")

    # -- reads ------------------------------------------------------------------------------------------------
    def read_into(self, keys: Sequence[bytes], dests: KVBatch) -> list[ReadStatus]:
        ks = list(keys)
        out: list[ReadStatus] = ["missing"] * len(ks)
        present = [i for i, k in enumerate(ks) if self.store.contains(k)]
        if not present:
            return out
        if dests.kind == "slots":
            self._read_slots(ks, dests, present, out)
        elif dests.kind == "host":
            self._read_host(ks, dests, present, out)
        else:
            self._read_device(ks, dests, present, out)
        for i in present:
            if out[i] == "hit":
                dests.checksums[i] = self.checksum(ks[i])
        return out

    def _judge(self, keys: list[bytes], indices: Iterable[int], lengths: Iterable[int | None],
               out: list[ReadStatus]) -> None:
        """A status per key from the block store's lengths: a block's length is a hit; a key it no longer holds
        was dropped as it failed verification (corrupt); another is a miss (removed meanwhile)."""
        n = self.geometry.block_bytes
        for i, length in zip(indices, lengths, strict=True):
            if length == n:
                out[i] = "hit"
            else:
                out[i] = "missing" if self.store.contains(keys[i]) else "corrupt"

    def _read_slots(self, keys: list[bytes], dests: KVBatch, present: list[int], out: list[ReadStatus]) -> None:
        n = self.geometry.block_bytes
        for wave in _waves(len(present)):
            idx = [present[j] for j in wave]
            leases: list[Lease] = [dests.items[i] for i in idx]
            status, got = self.run(self._get_views, [keys[i] for i in idx], [lease.slot.data(n) for lease in leases],
                                   False, leases=leases, what="get")
            if status != OK:
                for i in idx:
                    out[i] = read_status(status)
                continue
            assert got is not None
            self._judge(keys, idx, got[0], out)

    def _get_views(self, keys: list[bytes], views: list[memoryview], keep: bool) -> tuple[list[int | None], int]:
        return self.store.get_into_counting_drops(keys, views, keep_on_miss=keep)

    def _read_host(self, keys: list[bytes], dests: KVBatch, present: list[int], out: list[ReadStatus]) -> None:
        """Into the caller's memory. Without a deadline the store reads straight into it (``keep``: through its
        own staging, so a miss leaves it as it was); under one, into staging buffers copied over on this thread
        once in time: an abandoned read never writes the caller's memory."""
        n = self.geometry.block_bytes
        if not self.guard.enabled:
            got, _ = self._get_views([keys[i] for i in present], [dests.items[i] for i in present], dests.keep)
            self._judge(keys, present, got, out)
            return

        def copy(i: int, block: memoryview) -> None:
            dests.items[i][:n] = block

        self._read_staged(keys, present, out, copy)

    def _read_staged(self, keys: list[bytes], indices: list[int], out: list[ReadStatus],
                     deliver: Callable[[int, memoryview], None]) -> None:
        """Through :meth:`staged_gets`: ``deliver(i, block)`` puts each verified block where ``keys[i]`` goes."""
        n = self.geometry.block_bytes
        for idx, bufs, lengths, status in self.staged_gets(keys, indices):
            if status != OK:
                for i in idx:
                    out[i] = read_status(status)
                continue
            for i, b, length in zip(idx, bufs, lengths, strict=True):
                if length == n:  # verified by the block store: only then does it reach the caller
                    with memoryview(b) as mv:
                        deliver(i, mv[:n])
            self._judge(keys, idx, lengths, out)

    def staged_gets(
        self, keys: Sequence[bytes], indices: list[int]
    ) -> Iterator[tuple[list[int], list[RegisteredBuffer], list[int | None], str]]:
        """The block store's gets of ``keys[i]`` for ``i`` in ``indices``, wave by wave into registered staging
        buffers under the deadline: per wave ``(its indices, buffers, lengths, status)``, lengths ``None`` for a
        miss. A wave past its deadline yields no buffers (they are the abandoned worker's until it returns); the
        others' are released once the caller moves on."""
        for wave in _waves(len(indices)):
            idx = [indices[j] for j in wave]
            bufs = [self._stage.acquire() for _ in idx]
            try:
                status, got = self.guard.run(self._get_buffers, [keys[i] for i in idx], bufs,
                                             on_late=functools.partial(release_all, bufs),
                                             what="a block-store get")
            except BaseException:
                release_all(bufs)
                raise
            if status == TIMEOUT:
                yield idx, [], [None] * len(idx), status
                continue
            try:
                yield idx, bufs, (got[0] if status == OK and got is not None else [None] * len(idx)), status
            finally:
                release_all(bufs)

    def _get_buffers(self, keys: list[bytes], bufs: list[RegisteredBuffer]) -> tuple[list[int | None], int]:
        n = self.geometry.block_bytes
        views = [memoryview(b)[:n] for b in bufs]
        try:
            return self.store.get_into_counting_drops(keys, views, keep_on_miss=False)
        finally:
            for v in views:
                v.release()

    def _read_device(self, keys: list[bytes], dests: KVBatch, present: list[int], out: list[ReadStatus]) -> None:
        """Into GPU buffers: a block written GPU-direct (kvsum64) is read the same way and verified on the GPU;
        the others through host staging buffers (verified there, then copied up)."""
        dp = cast("DevicePath", dests.device)  # set on every batch of kind "device"
        direct = [i for i in present if self.store.sum_kind(keys[i]) is SumKind.KV64]
        get = functools.partial(self.store.get_into_device, keep_on_miss=dests.keep, data_class="kvcache.block")
        for wave in _waves(len(direct)):
            idx = [direct[j] for j in wave]
            status, got = self.run(get, [keys[i] for i in idx], [dests.items[i] for i in idx], dp, what="get")
            if status != OK:
                for i in idx:
                    out[i] = read_status(status)
            else:
                assert got is not None
                self._judge(keys, idx, got, out)
        done = set(direct)
        staged = [i for i in present if i not in done]
        self._read_staged(keys, staged, out,
                          lambda i, block: dp.stage_to_gpu(dests.items[i], 0, block, "kvcache.block"))

    # -- writes -----------------------------------------------------------------------------------------------
    def write(self, keys: Sequence[bytes], srcs: KVBatch) -> list[WriteStatus]:
        ks = list(keys)
        if not ks:
            return []
        if srcs.kind == "slots":
            out = self._write_slots(ks, srcs)
        elif srcs.kind == "host":
            out = self._write_host(ks, srcs)
        else:
            out = self._write_device(ks, srcs)
        for i, s in enumerate(out):
            if s == "written" and srcs.checksums[i] is None:
                srcs.checksums[i] = self.checksum(ks[i])  # the store hashed it: the tiers below need not
        return out

    def _write_slots(self, keys: list[bytes], srcs: KVBatch) -> list[WriteStatus]:
        n = self.geometry.block_bytes
        out: list[WriteStatus] = []
        for wave in _waves(len(keys)):
            leases: list[Lease] = [srcs.items[i] for i in wave]
            status, _ = self.run(self.store.put_many, [(keys[i], srcs.items[i].slot.data(n)) for i in wave],
                                 leases=leases, what="put")
            out += ["written" if status == OK else "dropped"] * len(wave)
        return out

    def _write_host(self, keys: list[bytes], srcs: KVBatch) -> list[WriteStatus]:
        """From the caller's memory. Under a deadline it is copied into staging buffers first, on this thread: a
        put abandoned past its deadline must not read memory the caller has got back (it would store those
        bytes, checksummed, as the block)."""
        if not self.guard.enabled:
            self.store.put_many(list(zip(keys, srcs.items, strict=True)))
            return ["written"] * len(keys)
        n = self.geometry.block_bytes
        out: list[WriteStatus] = []
        for wave in _waves(len(keys)):
            bufs = [self._stage.acquire() for _ in wave]
            for b, i in zip(bufs, wave, strict=True):
                with memoryview(b) as mv:
                    mv[:n] = srcs.items[i]
            status, _ = self.run(self._put_buffers, [keys[i] for i in wave], bufs, buffers=bufs, what="put")
            out += ["written" if status == OK else "dropped"] * len(wave)
        return out

    def _put_buffers(self, keys: list[bytes], bufs: list[RegisteredBuffer]) -> None:
        n = self.geometry.block_bytes
        views = [memoryview(b)[:n] for b in bufs]
        try:
            self.store.put_many(list(zip(keys, views, strict=True)))
        finally:
            for v in views:
                v.release()

    def gpu_direct(self, device: DevicePath) -> bool:
        """Whether GPU blocks go to the slots GPU-direct: cuFile takes the store's target (an image file on
        ext4/XFS on NVMe); never a raw namespace."""
        return bool(device.route_for(self.store.path.fd, self.store.path.device)[0] == "gds")

    def _write_device(self, keys: list[bytes], srcs: KVBatch) -> list[WriteStatus]:
        """GPU blocks: GPU-direct where cuFile takes the target, else staged through host buffers on this
        thread, so a put abandoned past its deadline never reads GPU memory the caller has got back (a
        GPU-direct one may: sfstore cannot recall a DMA)."""
        n = self.geometry.block_bytes
        dp = cast("DevicePath", srcs.device)  # set on every batch of kind "device"
        out: list[WriteStatus] = []
        if self.gpu_direct(dp):
            put = functools.partial(self.store.put_many_device, data_class="kvcache.block")
            for wave in _waves(len(keys)):
                status, _ = self.run(put, [(keys[i], srcs.items[i]) for i in wave], dp, what="put")
                out += ["written" if status == OK else "dropped"] * len(wave)
            return out
        for wave in _waves(len(keys)):
            bufs = [self._stage.acquire() for _ in wave]
            try:
                for i, b in zip(wave, bufs, strict=True):
                    with memoryview(b) as mv:
                        dp.stage_to_host(srcs.items[i], 0, mv[:n], "kvcache.block")
            except BaseException:
                release_all(bufs)
                raise
            status, _ = self.run(self._put_buffers, [keys[i] for i in wave], bufs, buffers=bufs, what="put")
            out += ["written" if status == OK else "dropped"] * len(wave)
        return out

    # -- housekeeping -----------------------------------------------------------------------------------------
    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for k in keys:
            status, gone = self.run(self.store.delete, k, what="delete")
            removed += status == OK and bool(gone)
        return removed

    def describe_route(self, device: DevicePath) -> dict[str, str]:
        """How GPU blocks move to and from the slots on ``device``'s routes, and why."""
        route, why = device.route_for(self.store.path.fd, self.store.path.device)
        if route == "gds":
            return {"route": "gds", "why": f"{why}: slots written and read GPU-direct (kvsum64 on the GPU)"}
        return {"route": "staged", "why": (
            f"cuFile does not take the block store's target ({why}): GPU blocks are staged through sfstore's "
            "registered host buffers (xxh3-64 checksums, O_DIRECT)")}

    def close(self) -> None:
        """Stop the guard's workers and release the staging buffers (the block store is its owner's to close)."""
        self.guard.close()
        self._stage.close()


def _waves(count: int) -> Iterator[range]:
    return (range(i, min(count, i + _WAVE)) for i in range(0, count, _WAVE))
