"""The store's load-or-recompute figures: each tier's load rate measured by its own reads, and the decision they
give with the engine's prefill rate (the engine-level test: tests/vllm_engine/test_vllm_engine_load_or_recompute)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from sfstore.kvcache import KVCacheStore
from sfstore.kvcache.load_or_recompute import LoadOrRecompute
from tests.kvcache.conftest import GEOM


def test_a_stores_reads_measure_each_tiers_rate(tmp_path: Path) -> None:
    with KVCacheStore(GEOM, model_id="lor", pinned_bytes=0, shared_dir=tmp_path / "shared") as writer:
        writer.put(writer.keys_for(list(range(64))), [np.full(GEOM.block_bytes, i, np.uint8) for i in range(4)])
    with KVCacheStore(GEOM, model_id="lor", pinned_bytes=1 << 20, shared_dir=tmp_path / "shared") as kv:
        keys = kv.keys_for(list(range(64)))
        assert kv.lower_tier_bytes(keys) == {"shared": 4 * GEOM.block_bytes}
        assert kv.stats()["load_or_recompute"]["load_bytes_per_s"] == {}
        kv.get_into(keys, [np.zeros(GEOM.block_bytes, np.uint8) for _ in keys])
        assert kv.stats()["load_or_recompute"]["load_bytes_per_s"]["shared"] > 0
        assert kv.lower_tier_bytes(keys) == {}  # pinned now: nothing to weigh


def test_the_decision_follows_the_figures() -> None:
    lor = LoadOrRecompute(probe_s=0.2)
    assert lor.decide({"shared": 1 << 20}, 512).why == "the engine's prefill rate is not measured yet"
    lor.note_prefill(1000, 0.1)  # 10 000 tokens/s: 512 tokens in 51 ms
    assert lor.decide({"shared": 1 << 20}, 512).choice == "load"  # the tier's rate not measured: load, to learn
    lor.note_load("shared", 1 << 20, 1.0)  # 1 MiB/s: 1 MiB in 1 s
    d = lor.decide({"shared": 1 << 20}, 512)
    assert (d.choice, round(d.load_s or 0, 2), round(d.recompute_s or 0, 3)) == ("recompute", 1.0, 0.051)
    assert lor.decide({"shared": 1 << 10}, 512).choice == "load"  # a few bytes: loading is faster
    time.sleep(0.25)
    assert "probed again" in lor.decide({"shared": 1 << 20}, 512).why  # declined a while: loaded once more
    lor.enabled = False
    assert lor.decide({"shared": 1 << 30}, 1).choice == "load"
    assert lor.describe()["decisions"] == {"load": 5, "recompute": 1}
