"""Pinning by lease inside a real vLLM engine: blocks loaded from the shared tier are promoted to the block store
from their pinned slots in the background, while the engine's next loads evict and reuse the slots of a small
pinned tier. Every block the block store ends up holding must be the block stored under its key: a slot reused
while a promotion still read it would put another block's bytes there, checksummed as valid.

A first engine saves eight prompts to a shared directory only. A second, configured with a block store (an image
file: the ``hot`` class) over the same directory and a pinned tier of a few steps' blocks, loads all eight, one
request each. Then this process reads each key from both lower tiers and compares the bytes; the tokens are the
ones a run without the connector gives. (The race itself is widened and proven fixed in
``tests/kvcache/test_kvcache_lease_race.py``; this is the engine path that relies on it.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.vllm_engine.test_vllm_engine import run_engine, tokens

pytestmark = pytest.mark.vllm_engine

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(8192) for _ in range(481)] for _ in range(8)]  # 15 loadable blocks each
KV = {"chunk_tokens": 0, "io_timeout_ms": 0}  # block files: this process reads them by key, knowing no chain


@pytest.fixture(scope="module")
def config(work: Path) -> Path:
    root = work / "root"
    (root / "kvcache" / "shared").mkdir(parents=True)
    cfg = work / "sfstore.toml"
    cfg.write_text(f'root = "{root}"\n\n[classes.hot.target]\nkind = "image"\npath = "{work / "hot.img"}"\n'
                   f'size = "64m"\n\n[classes.kvcache]\npath = "file"\n')
    return cfg


@pytest.fixture(scope="module")
def runs(work: Path, model: Path, config: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    shared = work / "root" / "kvcache" / "shared"
    baseline = run_engine(work, "baseline", {"model": str(model), "kv": None, "rounds": [[p] for p in PROMPTS],
                                             "max_tokens": 4})
    saved = run_engine(work, "save", {"model": str(model), "kv": {**KV, "shared_dir": str(shared)},
                                      "rounds": [[p] for p in PROMPTS], "max_tokens": 4})
    small = 3 * 15 * 2 * saved["geometry"]["num_layers"] * 32 * saved["geometry"]["num_kv_heads"] * \
        saved["geometry"]["head_dim"] * 4  # about three requests' blocks (at most 4 bytes an element)
    loaded = run_engine(work, "load", {"model": str(model), "kv": {**KV, "sfstore_config": str(config),
                                                                   "pinned_bytes": small},
                                       "rounds": [[p] for p in PROMPTS], "max_tokens": 4})
    return baseline, saved, loaded


def test_blocks_promoted_while_the_pinned_tier_turns_over_are_the_blocks_of_their_keys(
        runs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]], config: Path) -> None:
    import sfstore
    from sfstore.kvcache import KVCacheStore, KVGeometry
    from sfstore.kvcache.tier import KVBatch

    baseline, saved, loaded = runs
    want = [tokens(r)[0] for r in baseline["rounds"]]
    assert [tokens(r)[0] for r in loaded["rounds"]] == want
    assert [r[0]["cached"] for r in loaded["rounds"]] == [480] * len(PROMPTS)
    s = loaded["stats"]
    assert s["hits_shared"] == 15 * len(PROMPTS) and s["corrupt_dropped"] == 0
    # every block loaded went through the pinned tier, which holds fewer: its slots were reused as the loads went on
    assert 0 < s["pinned_capacity_blocks"] < 15 * len(PROMPTS) // 2, s["pinned_capacity_blocks"]
    geom = KVGeometry(**saved["geometry"])
    keys = [bytes.fromhex(k) for prompt_keys in saved["keys"] for k in prompt_keys[:15]]
    router = sfstore.open(str(config))
    try:
        with KVCacheStore.from_router(geom, router, model_id="check", pinned_bytes=0, chunk_tokens=0,
                                      io_timeout_ms=0) as store:
            assert store.block is not None
            block_tier, shared_tier = store.lower
            n = geom.block_bytes
            from_block = KVBatch("host", [memoryview(bytearray(n)) for _ in keys])
            from_shared = KVBatch("host", [memoryview(bytearray(n)) for _ in keys])
            got_block = block_tier.read_into(keys, from_block)
            assert shared_tier.read_into(keys, from_shared) == ["hit"] * len(keys)
            promoted = [i for i, st in enumerate(got_block) if st == "hit"]
            assert len(promoted) >= len(keys) // 2, got_block  # the promotions reached the block store
            for i in promoted:
                assert np.array_equal(np.frombuffer(from_block.items[i], np.uint8),
                                      np.frombuffer(from_shared.items[i], np.uint8)), f"block {i} holds another's"
    finally:
        router.close()
