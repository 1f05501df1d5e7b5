"""One engine step's loads on a vLLM worker: the blocks each request loads, held in the store's pinned tier while
their reads go on (:meth:`KVCacheStore.hold_async <sfstore.kvcache.store.KVCacheStore.hold_async>`), copied into
vLLM's pages layer by layer as each layer arrives, then settled: which blocks missed (vLLM recomputes them).

:class:`~sfstore.kvcache.vllm.SfstoreConnector` makes one :class:`StepLoads` per step (or per part of a step whose
loads do not fit in the pinned tier beside each other) and copies layer ``i`` out of it in
``wait_for_layer_load(i)``: with chunk files in the shared tier, that call waits for layer ``i`` of the step's
blocks only, not for the whole read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sfstore.kvcache.held import HeldBlocks
    from sfstore.kvcache.store import KVCacheStore

__all__ = ["HeldLoad", "StepLoads"]


@dataclasses.dataclass
class HeldLoad:
    """The blocks of one request to load this step: store keys, the vLLM block ids they go to, and the store's
    hold on them (``None``: the hold failed, every block of it is a load error)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    held: HeldBlocks | None
    settled: bool = False


class StepLoads:
    """The loads of one step (see the module): ``parts`` in the step's order, each a request's blocks."""

    def __init__(self, store: KVCacheStore, parts: Sequence[HeldLoad]) -> None:
        self.store = store
        self.parts = list(parts)

    @property
    def loading(self) -> list[HeldLoad]:
        """The parts whose blocks are held (a failed hold copies nothing)."""
        return [p for p in self.parts if p.held is not None]

    @property
    def block_ids(self) -> list[int]:
        """The vLLM block ids the held blocks go to, in the order :meth:`copy_layer_into` lays them out."""
        return [b for p in self.loading for b in p.block_ids]

    def __len__(self) -> int:
        return sum(len(p.block_ids) for p in self.loading)

    def layer_in(self, layer: int) -> bool:
        """Whether layer ``layer`` of every held block is in its slot now (or its read has ended); no waiting."""
        return all(p.held is None or p.held.wait_layer(layer, timeout=0) for p in self.parts)

    def copy_layer_into_pages(self, layer: int, pages: Any) -> None:
        """Layer ``layer`` of every held block into ``pages`` (a CPU cache viewed as the store's layers,
        ``pages[block_id]``): one native copy per request, each waiting for that layer of its blocks."""
        for p in self.loading:
            assert p.held is not None
            p.held.copy_layer_into(layer, pages, rows_at=p.block_ids)

    def copy_layer_into(self, layer: int, buf: Any, row_bytes: int) -> None:
        """Layer ``layer`` of every held block into ``buf`` (contiguous, ``row_bytes`` per block), in
        :attr:`block_ids`' order."""
        at = 0
        for p in self.loading:
            assert p.held is not None
            n = len(p.block_ids)
            p.held.copy_layer_into(layer, buf[at * row_bytes:(at + n) * row_bytes])
            at += n

    def wait(self) -> None:
        """Wait until every held block's read has ended."""
        for p in self.loading:
            assert p.held is not None and p.held.load is not None
            p.held.load.wait()

    def settle(self) -> list[tuple[HeldLoad, list[int]]]:
        """Once per part: wait for its reads, count them (``gets``, ``hits_*``, ``misses``), and return, per part
        settled now, the indices of its blocks that missed (every block of a failed hold)."""
        out: list[tuple[HeldLoad, list[int]]] = []
        for p in self.parts:
            if p.settled:
                continue
            p.settled = True
            if p.held is None:
                out.append((p, list(range(len(p.keys)))))
                continue
            tiers = p.held.tiers
            self.store.count_loads(tiers)
            out.append((p, [i for i, t in enumerate(tiers) if t is None]))
        return out

    def release(self) -> None:
        """Give every held block back to the pinned tier (idempotent; reads still going on end on their own)."""
        for p in self.parts:
            if p.held is not None:
                p.held.release()
