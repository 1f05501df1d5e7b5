"""The contract every tier of the KV cache keeps: :class:`KVTier`.

A tier holds whole blocks under 32-byte keys. It answers which keys it has (:meth:`KVTier.present`), reads blocks
into destinations (:meth:`KVTier.read_into`), writes them from sources (:meth:`KVTier.write`), removes them and
counts them, and says how each of its operations ended with one of a few statuses. A tier whose I/O can stall
runs it under a :class:`~sfstore.kvcache.deadline.TierGuard` (its ``guard``): past the deadline a read answers
``"timeout"`` and a write ``"dropped"``, and a quarantined tier answers at once without I/O.

The memory a batch moves between is a :class:`KVBatch` of one kind: leased pinned slots (``"slots"``: the
tier may fill them straight from its I/O, the leases keep them from reuse), the caller's host memory
(``"host"``: written only once verified and in time, so a miss leaves it as it was), or GPU buffers
(``"device"``: on the device path's route). :class:`~sfstore.kvcache.store.KVCacheStore` runs its tiers as one
loop over this contract: the first tier that has a block answers, hits are promoted to the tiers above,
puts are written through to every tier below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from sfstore.kvcache.deadline import TierGuard

if TYPE_CHECKING:
    from sfstore.paths.device import DevicePath

__all__ = ["KVTier", "KVBatch", "ReadStatus", "WriteStatus", "BatchKind", "read_status", "READ_STATUSES",
           "WRITE_STATUSES", "TierName"]

ReadStatus = Literal["hit", "missing", "corrupt", "unreadable", "timeout", "quarantined"]
"""How a read of one block ended: ``hit`` (verified and delivered), ``missing`` (not there), ``corrupt`` (there
but failed verification: removed from the tier, so a later put stores it again), ``unreadable`` (something at its
place that is not a block, or a read that failed), ``timeout`` (past the tier's deadline), ``quarantined``
(answered without I/O while the tier is quarantined)."""

WriteStatus = Literal["written", "exists", "dropped"]
"""How a write of one block ended: ``written``, ``exists`` (the tier had the block: not written again),
``dropped`` (past the deadline, or the tier quarantined)."""

READ_STATUSES: tuple[ReadStatus, ...] = ("hit", "missing", "corrupt", "unreadable", "timeout", "quarantined")
WRITE_STATUSES: tuple[WriteStatus, ...] = ("written", "exists", "dropped")

BatchKind = Literal["slots", "host", "device"]

TierName = Literal["pinned", "block", "shared"]
"""A tier of the KV cache, from the top: the pinned memory tier, the block store (NVMe), the shared directory."""


def read_status(status: str) -> ReadStatus:
    """A read's status from a guard's or an older reader's string (``ValueError`` for any other)."""
    if status not in READ_STATUSES:
        raise ValueError(f"not a read status: {status!r}")
    return status


@dataclass
class KVBatch:
    """The memory a batch of blocks is read into or written from, all of one ``kind``.

    ``items``: :class:`~sfstore.kvcache.tiers.Lease` objects (``"slots"``), byte ``memoryview`` objects of a block
    each (``"host"``), or GPU buffers (``"device"``, moved through ``device``, a
    :class:`~sfstore.paths.device.DevicePath`). ``keep`` (reads into ``host`` and ``device`` memory): a missed
    destination is left exactly as it was (``False``: it may hold the bytes that failed, for a caller that
    recomputes a miss anyway). ``checksums``: the xxh3-64 of each block's host bytes where known (a read fills
    them for its hits, a write uses them instead of hashing again).

    ``on_layer(indices, layer)`` (reads into ``slots`` or GPU buffers): a tier that reads layer by layer
    (:attr:`KVTier.supports_layer_reads`) calls it once layers ``0..layer`` of the items at ``indices`` are in
    their slots (GPU buffers) and verified, while later layers are still being read, so a caller holding the
    slots can copy those layers out early (or compute on them). A block's status still comes with the read's
    answer: a later layer can fail it, and its earlier layers then hold bytes of a block that is not a hit (a
    caller of this kind recomputes it). Tiers that read whole blocks never call it.

    ``lend(indices)`` (reads into ``host`` memory with ``keep`` off): the caller lends its destinations to reads
    under a deadline too, so a tier whose reads can stall may read straight into them instead of through scratch
    buffers (one copy fewer). A read abandoned at its deadline may then go on writing the items at ``indices``
    after the tier has answered (their status is ``"timeout"``): the tier calls ``lend(indices)`` before it
    answers, and calls what that returns, once, on whatever thread ends the read, when it no longer can. Without
    ``lend``, a read under a deadline writes the caller's memory only from this thread, once in time.
    """

    kind: BatchKind
    items: list[Any]
    device: DevicePath | None = None
    keep: bool = True
    checksums: list[int | None] = field(default_factory=list)
    on_layer: Callable[[list[int], int], None] | None = None
    lend: Callable[[list[int]], Callable[[], None]] | None = None

    def __post_init__(self) -> None:
        if not self.checksums:
            self.checksums = [None] * len(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def pick(self, indices: Sequence[int]) -> KVBatch:
        """The batch of ``items[i]`` for ``i`` in ``indices`` (same kind, device and ``keep``); its checksums are
        its own list: copy them back with :meth:`take_checksums`."""
        picked = list(indices)
        parent, lender = self.on_layer, self.lend
        on_layer = lend = None
        if parent is not None:
            def on_layer(at: list[int], layer: int) -> None:
                parent([picked[j] for j in at], layer)
        if lender is not None:
            def lend(at: list[int]) -> Callable[[], None]:
                return lender([picked[j] for j in at])
        return KVBatch(self.kind, [self.items[i] for i in picked], self.device, self.keep,
                       [self.checksums[i] for i in picked], on_layer, lend)

    def layers_ready(self, indices: Sequence[int], layer: int) -> None:
        """Tell the caller (``on_layer``, when set) that layers ``0..layer`` of the items at ``indices`` are in."""
        if self.on_layer is not None and indices:
            self.on_layer(list(indices), layer)

    def take_checksums(self, indices: Sequence[int], part: KVBatch) -> None:
        """Copy the checksums a tier filled in ``part`` (made by :meth:`pick` of ``indices``) back here."""
        for i, c in zip(indices, part.checksums, strict=True):
            if c is not None:
                self.checksums[i] = c


class KVTier(ABC):
    """One tier of the KV cache (see the module). Batches are answered key by key, each as if alone."""

    #: the tier's name in statistics and results (``"pinned"``, ``"block"``, ``"shared"``)
    name: TierName
    #: the deadline and quarantine of the tier's I/O (``None``: it does none that can stall)
    guard: TierGuard | None = None

    @property
    def in_memory(self) -> bool:
        """Whether :meth:`present` answers from this process's memory (no I/O): such tiers are asked first."""
        return False

    @property
    def supports_device_buffers(self) -> bool:
        """Whether GPU buffers move on a route of the tier's own (``device`` batches without a host copy
        where the route allows); otherwise they are staged through host memory."""
        return False

    @property
    def supports_layer_reads(self) -> bool:
        """Whether reads into slots or GPU buffers can deliver a batch layer by layer (``KVBatch.on_layer``): the
        tier's storage unit keeps each layer as its own range with its own checksum."""
        return False

    @abstractmethod
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the tier has each key (not yet verified); ``False`` past the deadline or while quarantined."""

    def leading_present(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the tier has."""
        for i, found in enumerate(self.present(keys)):
            if not found:
                return i
        return len(keys)

    @abstractmethod
    def read_into(self, keys: Sequence[bytes], dests: KVBatch) -> list[ReadStatus]:
        """Read each key's block into its destination; a destination is written only on a ``"hit"`` (unless
        ``dests.keep`` is off). Fills ``dests.checksums`` of the hits."""

    @abstractmethod
    def write(self, keys: Sequence[bytes], srcs: KVBatch) -> list[WriteStatus]:
        """Store each source's block under its key (the sources' memory is read before this returns, except
        GPU-direct writes that outlive their deadline). Fills ``srcs.checksums`` where it computes them."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove the keys' blocks; how many were there."""

    @abstractmethod
    def count(self) -> int | None:
        """Blocks the tier holds (``None`` when it cannot tell now: past the deadline, quarantined)."""

    def close(self) -> None:  # noqa: B027 (tiers with nothing to release keep the default)
        """Release what the tier holds (after the store's background work is done)."""
