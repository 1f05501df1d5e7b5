"""The demo's inference step: requests sharing a prompt prefix through the KV-cache store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sfstore.router import Router

__all__ = ["kv_cache_reuse"]


def kv_cache_reuse(router: Router, prompt_tokens: int = 256) -> dict[str, Any]:
    """Serve three "requests" that share a prompt prefix through a :class:`~sfstore.kvcache.KVCacheStore` on the
    routed tiers: the first misses and offloads its KV blocks; the second finds them in pinned memory; after
    the pinned tier is emptied the third loads them from the block store (NVMe tier); a second store (another
    process or node) loads them from the shared directory. Every block read back is compared bit for bit."""
    import numpy as np

    from sfstore.kvcache import KVCacheStore, KVGeometry

    geom = KVGeometry(num_layers=8, block_tokens=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")  # 128 KiB
    prefix = list(range(1000, 1000 + prompt_tokens))
    rng = np.random.default_rng(0)
    steps: list[dict[str, Any]] = []
    ok = True
    kv = KVCacheStore.from_router(geom, router, model_id="demo-model")
    with kv:
        # A cold start: the data directory keeps what an earlier demo stored under the same keys in its tiers.
        kv.evict(kv.keys_for(prefix))
        for i, action in enumerate(("first request", "same prefix again", "pinned tier emptied first")):
            tokens = prefix + [7 + i] * 5  # a shared prefix and a question of its own
            if action == "pinned tier emptied first":
                kv.evict(kv.keys_for(prefix), tiers=("pinned",))
            hit = kv.lookup(tokens)
            keys = kv.keys_for(tokens)
            out = [np.zeros(geom.block_bytes // 2, np.uint16) for _ in keys]
            tiers = kv.get_into(keys[: hit // geom.block_tokens], out[: hit // geom.block_tokens]) if hit else []
            if hit < len(keys) * geom.block_tokens:  # "compute" the missing blocks, then offload them
                fresh = [rng.integers(0, 2**16, geom.block_bytes // 2, dtype=np.uint16)
                         for _ in keys[hit // geom.block_tokens:]]
                kv.put(keys[hit // geom.block_tokens:], fresh)
                expected = fresh
            steps.append({"request": action, "prompt_tokens": len(tokens), "hit_tokens": hit,
                          "tiers": sorted(set(t for t in tiers if t))})
        ok = ok and all(np.array_equal(a, b) for a, b in zip(out, expected, strict=False))
        stats = kv.stats()
    # As another process would: a store of its own on the same directory, through the router's file path for
    # that directory (not the data class's, so what it reads is counted apart from the first store's).
    other_fp = router.location(kv.shared.fp.root) if kv.shared else None
    read_before = other_fp.counters.snapshot()["bytes_read"] if other_fp is not None else 0
    other = KVCacheStore(geom, model_id="demo-model", shared_dir=kv.shared.prefix if kv.shared else None,
                         shared_on=other_fp)
    with other:
        hit = other.lookup(prefix)
        out = [np.zeros(geom.block_bytes // 2, np.uint16) for _ in range(hit // geom.block_tokens)]
        tiers = other.get_into(other.keys_for(prefix)[: len(out)], out)
        ok = ok and all(np.array_equal(a, b) for a, b in zip(out, expected, strict=False))
        steps.append({"request": "another process, shared tier only", "prompt_tokens": len(prefix),
                      "hit_tokens": hit, "tiers": sorted(set(t for t in tiers if t))})
        theirs = other.stats()
        # The second store's hits and bytes are part of what the step did (its own path's counters hold them).
        stats = {**stats, "hits_shared": stats["hits_shared"] + theirs["hits_shared"],
                 "gets": stats["gets"] + theirs["gets"], "bytes_got": stats["bytes_got"] + theirs["bytes_got"]}
        other_read = other_fp.counters.snapshot()["bytes_read"] - read_before if other_fp is not None else 0
    ok = ok and steps[0]["hit_tokens"] == 0 and all(st["hit_tokens"] == prompt_tokens for st in steps[1:])
    return {"block_bytes": geom.block_bytes, "steps": steps, "stats": stats, "verified": ok,
            "other_store_bytes_read": other_read}
