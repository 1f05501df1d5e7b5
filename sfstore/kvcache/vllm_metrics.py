"""sfstore's vLLM connector in vLLM's own metrics and KV events: the stats class vLLM aggregates
(``get_kv_connector_stats`` / ``build_kv_connector_stats``) and the events holder its KV event publisher drains.
Both are ``None`` with a vLLM that lacks these hooks."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SfstoreConnectorStats", "KVEvents", "BlockStored", "BlockRemoved", "STORE_STATS", "OWN_STATS"]

try:  # vLLM's newer hooks: KV events and connector stats (in 0.32 and 0.33)
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents, KVEventAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats as _Stats
except ImportError:  # pragma: no cover - an older vLLM: the hooks are not there, nothing calls them
    BlockRemoved = BlockStored = KVConnectorKVEvents = KVEventAggregator = _Stats = None

# (stat name, store counter) counted from the store's counters; the others by the connector itself
STORE_STATS = (("hits_pinned", "hits_pinned"), ("hits_block", "hits_block"), ("hits_shared", "hits_shared"),
                ("misses", "misses"), ("bytes_loaded", "bytes_got"), ("bytes_saved", "bytes_put"),
                ("corrupt_dropped", "corrupt_dropped"), ("blocks_declined", "loads_declined"),
               ("layers_loaded_early", "layers_copied_early"))
OWN_STATS = ("load_failures", "blocks_saved", "blocks_prefetched_by_scheduler")

if _Stats is not None:

    @dataclasses.dataclass
    class SfstoreConnectorStats(_Stats):  # type: ignore[misc]
        """sfstore's counts for vLLM's metrics, summed over workers and intervals."""

        def reset(self) -> None:
            self.data = dict[str, Any]()

        def aggregate(self, other: Any) -> SfstoreConnectorStats:
            for k, v in (other.data if other is not None else {}).items():
                self.data[k] = self.data.get(k, 0) + v
            return self

        def reduce(self) -> dict[str, int | float]:
            out: dict[str, int | float] = dict(self.data)
            loads = sum(int(self.data.get(k, 0)) for k in ("hits_pinned", "hits_block", "hits_shared"))
            tried = loads + int(self.data.get("misses", 0))
            if tried:
                out["hit_rate"] = loads / tried
            return out

        def is_empty(self) -> bool:
            return not any(self.data.values())

    class KVEvents(KVConnectorKVEvents):  # type: ignore[misc]
        """KV events of the workers, keeping those every worker reported (one tensor-parallel shard each)."""

        def __init__(self, num_workers: int) -> None:
            self._agg = KVEventAggregator(num_workers)

        def add_events(self, events: list[Any]) -> None:
            self._agg.add_events(events)

        def aggregate(self) -> KVEvents:
            common = self._agg.get_common_events()
            self._agg.clear_events()
            self._agg.add_events(common)
            self._agg.reset_workers()
            return self

        def increment_workers(self, count: int = 1) -> None:
            self._agg.increment_workers(count)

        def get_all_events(self) -> list[Any]:
            return list(self._agg.get_all_events())

        def get_number_of_workers(self) -> int:
            return int(self._agg.get_number_of_workers())

        def clear_events(self) -> None:
            self._agg.clear_events()
            self._agg.reset_workers()
else:  # pragma: no cover
    SfstoreConnectorStats = None  # type: ignore[assignment,misc]
    KVEvents = None  # type: ignore[assignment,misc]
