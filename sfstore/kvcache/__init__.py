"""KV-cache offload for inference engines: :class:`KVCacheStore` over pinned memory, NVMe and a shared directory.

``sfstore.kvcache.vllm`` adapts it to vLLM's KV-connector interface (imported only when used).
"""

from sfstore.kvcache.geometry import KVGeometry, chained_keys
from sfstore.kvcache.store import TIERS, KVCacheStore

__all__ = ["KVCacheStore", "KVGeometry", "TIERS", "chained_keys"]
