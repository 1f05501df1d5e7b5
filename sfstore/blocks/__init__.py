"""Hot blocks on the block path: :class:`BlockStore` (keys -> values in checksummed slots, LRU eviction)."""

from sfstore.blocks.store import BlockStore, Key

__all__ = ["BlockStore", "Key"]
