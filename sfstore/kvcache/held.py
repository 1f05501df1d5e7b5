"""HeldBlocks: blocks a :class:`~sfstore.kvcache.store.KVCacheStore` keeps in its pinned tier for one caller, who
copies them out piece by piece (an engine's loads, one layer of every block at a time) until it releases them;
and :class:`LayerLoad`, the background reads that fill held blocks layer by layer."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from sfstore import buffers, errors
from sfstore.arguments import check_timeout
from sfstore.counters import Counters
from sfstore.futures import Future
from sfstore.kvcache.geometry import KVGeometry
from sfstore.kvcache.tier import TierName
from sfstore.kvcache.tiers import Lease, release_all

__all__ = ["HeldBlocks", "LayerLoad"]


class LayerLoad(Future[list[TierName | None]]):
    """Reads from the lower tiers that fill some rows of a :class:`HeldBlocks` in the background.

    A tier that reads layer by layer (chunk files in the shared tier) announces each layer of a row once it is
    in and verified; a tier that reads whole blocks announces them whole. :meth:`wait_layer` waits until one
    layer of every row is in (or its row's read has ended), :meth:`get` until every read has ended and gives the
    tier each row came from (``None``: a miss, whose slot holds no block; an earlier layer of it may have been
    announced before a later one failed verification).

    Made by :meth:`KVCacheStore.hold_async <sfstore.kvcache.store.KVCacheStore.hold_async>`; every read ends,
    within its tier's deadline, as a hit or a miss.
    """

    def __init__(self, layers: int, tiers: list[TierName | None], pending: Sequence[int],
                 counters: Counters | None = None) -> None:
        self.layers = layers
        #: where :meth:`HeldBlocks.copy_layer_into` counts ``layers_copied_early``: layers copied out while
        #: reads of the same blocks were still going on
        self.counters = counters
        self._tiers = tiers
        self._pending = set(pending)
        self._in = [0 if i in self._pending else layers for i in range(len(tiers))]
        self._cond = threading.Condition()

    def layer_in(self, rows: Sequence[int], layer: int) -> None:
        """Layers ``0..layer`` of ``rows`` are in their slots (called by the reads)."""
        with self._cond:
            for r in rows:
                if r in self._pending and self._in[r] <= layer:
                    self._in[r] = layer + 1
            self._cond.notify_all()

    def finish(self, rows: Sequence[int], tiers: Sequence[TierName | None]) -> None:
        """The reads of ``rows`` have ended: each row's tier (``None``: a miss)."""
        with self._cond:
            for r, t in zip(rows, tiers, strict=True):
                if r in self._pending:
                    self._pending.discard(r)
                    self._tiers[r] = t
                    self._in[r] = self.layers
            self._cond.notify_all()

    def _layer_ready(self, layer: int) -> bool:
        return all(self._in[r] > layer for r in self._pending)

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until layer ``layer`` of every row is in, or its read has ended; return whether it is so."""
        check_timeout(timeout, "wait_layer")
        with self._cond:
            return self._cond.wait_for(lambda: self._layer_ready(layer), timeout)

    def done(self) -> bool:
        with self._cond:
            return not self._pending

    def wait(self, timeout: float | None = None) -> bool:
        check_timeout(timeout, "wait")
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def get(self, timeout: float | None = None) -> list[TierName | None]:
        if not self.wait(timeout):
            raise self._timed_out(timeout, "loading held blocks")
        return list(self._tiers)


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

    def __init__(self, geometry: KVGeometry, leases: Sequence[Lease | None], tiers: Sequence[TierName | None],
                 load: LayerLoad | None = None) -> None:
        self.geometry = geometry
        self._tiers: list[TierName | None] = list(tiers)
        self.rows: list[int] = [i for i, lease in enumerate(leases) if lease is not None]
        self._leases: list[Lease] | None = [lease for lease in leases if lease is not None]
        self._buffers = [lease.slot.buffer for lease in self._leases]
        #: the reads still filling rows (:meth:`KVCacheStore.hold_async
        #: <sfstore.kvcache.store.KVCacheStore.hold_async>`); ``None``: every row was in when held
        self.load = load

    def __len__(self) -> int:
        return len(self._leases or ())

    @property
    def tiers(self) -> list[TierName | None]:
        """Per key asked for, the tier its block came from (``None``: a miss); waits for :attr:`load`."""
        return self.load.get() if self.load is not None else list(self._tiers)

    @property
    def tiers_of_rows(self) -> list[TierName | None]:
        """The tier each row was found in, in row order (waits for :attr:`load`)."""
        tiers = self.tiers
        return [tiers[i] for i in self.rows]

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until layer ``layer`` of every row is in its slot (see :class:`LayerLoad`); whether it is."""
        return True if self.load is None else self.load.wait_layer(layer, timeout)

    def copy_layer_into(self, layer: int, out: Any, rows_at: Sequence[int] | None = None) -> None:
        """Copy layer ``layer`` of every row into ``out``.

        Parameters
        ----------
        layer : int
            The layer, in ``[0, geometry.num_layers)``.
        out : buffer or tensor
            Without ``rows_at``: a writable C-contiguous host buffer (a numpy array, a CPU torch tensor, a
            ``bytearray``) of at least ``len(self) * geometry.layer_bytes`` bytes; row ``j`` goes to its ``j``-th
            ``layer_bytes``, laid out as :attr:`KVGeometry.layer_shape`. With ``rows_at``: a CPU torch tensor or
            numpy array of shape ``(P, *geometry.layer_shape)`` whose elements are the geometry's size (the bytes
            move as they are), with any non-negative strides but a contiguous last dimension (a strided view of
            an engine's paged cache, such as :func:`~sfstore.kvcache.vllm_layout.pages_as_layers`); row ``j`` goes
            to ``out[rows_at[j]]``.
        rows_at : sequence of int, optional
            Where each row goes in ``out`` (``len(self)`` indices in ``[0, P)``).

        Raises
        ------
        sfstore.errors.InvalidRequestError
            ``layer`` is out of range, the blocks were released, or ``out`` / ``rows_at`` do not fit.

        Notes
        -----
        Either form is one call into the native helper with the GIL released. With ``rows_at`` the bytes move once,
        straight into the strided destination, where a contiguous copy followed by a permuting copy into the pages
        moves them twice; its cost grows with the number of contiguous runs (``kv * tokens * heads`` per row).
        """
        g = self.geometry
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < g.num_layers:
            raise errors.InvalidRequestError(f"copy_layer_into: layer {layer!r} is not an int in [0, {g.num_layers})")
        if self._leases is None:
            raise errors.InvalidRequestError("copy_layer_into: the blocks were released")
        self.wait_layer(layer)  # bounded: each read ends within its tier's deadline
        if self.load is not None and self.load.counters is not None and not self.load.done():
            self.load.counters.add(layers_copied_early=1)
        if rows_at is not None:
            base, offsets, counts, out_strides, src_strides, run = self._scatter_plan(out, rows_at)
            buffers.scatter(base, self._buffers, layer * g.layer_bytes, offsets, counts, out_strides, src_strides, run)
            return
        if (type(out).__module__ or "").startswith("torch"):
            if out.device.type != "cpu" or not out.is_contiguous():
                raise errors.InvalidRequestError("copy_layer_into: out must be a contiguous CPU tensor")
            import torch

            out = out.detach().view(-1).view(torch.uint8).numpy()  # the same memory, through the buffer protocol
        buffers.gather(out, self._buffers, layer * g.layer_bytes, g.layer_bytes)

    def _scatter_plan(self, out: Any, rows_at: Sequence[int]) -> tuple[Any, list[int], list[int], list[int],
                                                                        list[int], int]:
        """The native scatter's arguments for rows going to ``out[rows_at[j]]``: a byte view of the memory ``out``
        spans, each row's byte offset in it, and the counts and byte strides of the runs (the last dimension) on
        both sides."""
        import numpy as np

        g = self.geometry
        arr = _as_strided_array(out, g.itemsize)
        if arr.ndim != 1 + len(g.layer_shape) or tuple(arr.shape[1:]) != g.layer_shape:
            raise errors.InvalidRequestError(f"copy_layer_into: out must be of shape (P, "
                                             f"{', '.join(map(str, g.layer_shape))}), not {tuple(arr.shape)}")
        if any(st < 0 for st in arr.strides) or arr.strides[-1] != g.itemsize:
            raise errors.InvalidRequestError("copy_layer_into: out's last dimension must be contiguous, its strides "
                                             "non-negative")
        if not arr.flags.writeable:
            raise errors.InvalidRequestError("copy_layer_into: out is read-only")
        rows = list(rows_at)
        if len(rows) != len(self):
            raise errors.InvalidRequestError(f"copy_layer_into: {len(rows)} rows_at for {len(self)} rows")
        pages = int(arr.shape[0])
        for r in rows:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < pages:
                raise errors.InvalidRequestError(f"copy_layer_into: rows_at holds {r!r}, not an index in [0, {pages})")
        span = g.itemsize + sum((n - 1) * st for n, st in zip(arr.shape, arr.strides, strict=True)) if pages else 0
        # one contiguous byte view from out's first byte over every byte it spans (the strides are non-negative)
        base = np.lib.stride_tricks.as_strided(arr.view(np.uint8), shape=(span,), strides=(1,))
        src = [st * g.itemsize for st in _contiguous_strides(g.layer_shape)[:-1]]
        return (base, [r * int(arr.strides[0]) for r in rows], list(g.layer_shape[:-1]),
                [int(st) for st in arr.strides[1:-1]], src, g.layer_shape[-1] * g.itemsize)

    def release(self) -> None:
        """Release every block's lease (idempotent): the pinned tier may evict or reuse them from now on."""
        leases, self._leases, self._buffers = self._leases, None, []
        if leases is not None:
            release_all(leases)

    def __enter__(self) -> HeldBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    """The strides of a C-contiguous array of ``shape`` in elements: ``[prod(shape[1:]), ..., 1]``."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * int(shape[i + 1])
    return out


_SAME_SIZE_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_strided_array(out: Any, itemsize: int) -> Any:
    """``out`` (a CPU torch tensor or a numpy array) as a numpy array over the same memory and strides, its elements
    reinterpreted as integers of ``itemsize`` bytes (numpy has no bfloat16); ``InvalidRequestError`` otherwise."""
    import numpy as np

    kind = _SAME_SIZE_INTS.get(itemsize)
    if (type(out).__module__ or "").startswith("torch"):
        import torch

        if out.device.type != "cpu":
            raise errors.InvalidRequestError("copy_layer_into: with rows_at, out must be on the CPU")
        if out.element_size() != itemsize or kind is None:
            raise errors.InvalidRequestError(f"copy_layer_into: out's elements are {out.element_size()} bytes, the "
                                             f"blocks' {itemsize}")
        try:
            return out.detach().view(getattr(torch, kind)).numpy()
        except RuntimeError as exc:  # a view torch cannot reinterpret (its last dimension is not contiguous)
            raise errors.InvalidRequestError(f"copy_layer_into: out cannot be viewed as bytes: {exc}") from None
    if not isinstance(out, np.ndarray):
        raise errors.InvalidRequestError("copy_layer_into: with rows_at, out must be a CPU torch tensor or a numpy "
                                         f"array, not {type(out).__name__}")
    if out.itemsize != itemsize or kind is None:
        raise errors.InvalidRequestError(f"copy_layer_into: out's elements are {out.itemsize} bytes, the blocks' "
                                         f"{itemsize}")
    try:
        return out.view(kind)
    except ValueError as exc:
        raise errors.InvalidRequestError(f"copy_layer_into: out cannot be viewed as bytes: {exc}") from None
