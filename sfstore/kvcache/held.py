"""HeldBlocks: blocks a :class:`~sfstore.kvcache.store.KVCacheStore` keeps in its pinned tier for one caller, who
copies them out piece by piece (an engine's loads, one layer of every block at a time) until it releases them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sfstore import errors
from sfstore.kvcache.geometry import KVGeometry
from sfstore.kvcache.tiers import PinnedTier, Slot

__all__ = ["HeldBlocks"]


class HeldBlocks:
    """Blocks pinned in a store's pinned tier (not evicted, not reused) until :meth:`release`.

    Made by :meth:`KVCacheStore.hold <sfstore.kvcache.store.KVCacheStore.hold>`. ``tiers`` holds, per key asked
    for, the tier the block was found in, or ``None`` for a miss; the blocks found are the *rows*, in the order
    of their keys (``rows`` gives their indices among the keys).

    Notes
    -----
    :meth:`copy_layer_into` copies one layer of every row with one call into the native helper, which releases
    the GIL for the copies: the cost of a layer no longer grows with a Python-level call per block. Use it as a
    context manager, or call :meth:`release` (idempotent) once done: a held block occupies pinned memory that
    the tier cannot give to another block.
    """

    def __init__(self, pinned: PinnedTier, geometry: KVGeometry, slots: Sequence[Slot | None],
                 tiers: Sequence[str | None]) -> None:
        self.geometry = geometry
        self.tiers: list[str | None] = list(tiers)
        self.rows: list[int] = [i for i, s in enumerate(slots) if s is not None]
        self._pinned: PinnedTier | None = pinned
        self._slots: list[Slot] = [s for s in slots if s is not None]
        self._buffers = [s.buffer for s in self._slots]

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def tiers_of_rows(self) -> list[str | None]:
        """The tier each row was found in, in row order."""
        return [self.tiers[i] for i in self.rows]

    def copy_layer_into(self, layer: int, out: Any) -> None:
        """Copy layer ``layer`` of every row into consecutive rows of ``out``: a writable C-contiguous host buffer
        (a numpy array, a CPU torch tensor, a ``bytearray``) of at least ``len(self) * geometry.layer_bytes``
        bytes, each row laid out as :attr:`KVGeometry.layer_shape`.

        Raises
        ------
        sfstore.errors.InvalidRequestError
            ``layer`` is out of range, the blocks were released, or ``out`` is not a buffer that large.
        """
        g = self.geometry
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < g.num_layers:
            raise errors.InvalidRequestError(f"copy_layer_into: layer {layer!r} is not an int in [0, {g.num_layers})")
        if self._pinned is None:
            raise errors.InvalidRequestError("copy_layer_into: the blocks were released")
        if (type(out).__module__ or "").startswith("torch"):
            if out.device.type != "cpu" or not out.is_contiguous():
                raise errors.InvalidRequestError("copy_layer_into: out must be a contiguous CPU tensor")
            import torch

            out = out.detach().view(-1).view(torch.uint8).numpy()  # the same memory, through the buffer protocol
        from sfstore import _native  # present: the slots are its buffers

        _native.gather(out, self._buffers, layer * g.layer_bytes, g.layer_bytes)

    def release(self) -> None:
        """Unpin every block (idempotent): the pinned tier may evict or reuse them from now on."""
        pinned, self._pinned = self._pinned, None
        if pinned is None:
            return
        slots, self._slots, self._buffers = self._slots, [], []
        for s in slots:
            pinned.unpin(s)

    def __enter__(self) -> HeldBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
