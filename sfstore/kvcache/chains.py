"""Where each key stands in its prompt: the chains of keys a store made, so that a tier that stores runs of
consecutive blocks (the shared tier's chunks) can find the run a block belongs to from its key alone.

A key is a chained prefix hash (:func:`~sfstore.kvcache.geometry.chained_keys`): it names a block and everything
before it, but says neither its position nor the keys before it. :meth:`KVCacheStore.keys_for
<sfstore.kvcache.store.KVCacheStore.keys_for>` notes each chain it makes here; a key it did not make (or one noted
so long ago that it was forgotten) has no chain, and such blocks are stored one file per block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KeyChains", "CHAIN_KEYS"]

CHAIN_KEYS = 1 << 17  # keys remembered (about 150 bytes each): 4 M tokens of 32-token blocks


class KeyChains:
    """The chains of keys a store made, least recently noted forgotten first beyond ``limit`` keys.

    A key points to the longest chain noted through it (the same prompt later in its prefill, or a longer prompt
    that starts with it): the runs stored of that prompt hold its block too. Thread-safe.
    """

    def __init__(self, limit: int = CHAIN_KEYS) -> None:
        self.limit = max(1, int(limit))
        self._at: OrderedDict[bytes, tuple[tuple[bytes, ...], int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: Sequence[bytes]) -> None:
        """Note ``keys``, a chain from its prompt's first block."""
        chain = tuple(bytes(k) for k in keys)
        with self._lock:
            for pos, k in enumerate(chain):
                known = self._at.get(k)
                # a key names its whole prefix, so a longer chain through it knows the same blocks and more
                if known is None or len(known[0]) < len(chain):
                    self._at[k] = (chain, pos)
                self._at.move_to_end(k)
            while len(self._at) > self.limit:
                self._at.popitem(last=False)

    def locate(self, key: bytes) -> tuple[tuple[bytes, ...], int] | None:
        """``(chain, position)`` of ``key`` (its chain from the prompt's first block), or ``None``."""
        with self._lock:
            return self._at.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._at)
