"""Every KV tier runs the conformance suite (:class:`sfstore.testing.kv_tier.KVTierTests`): the pinned tier, the
block store's tier on an image file, and the shared tier on a local directory (the testbed runs it on NFS over
RDMA and on an NVMe-oF namespace)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sfstore.blocks import BlockStore
from sfstore.kvcache.block_tier import BlockKVTier
from sfstore.kvcache.tier import KVTier
from sfstore.kvcache.tiers import PinnedTier, SharedTier
from sfstore.testing.kv_tier import GEOM, KVTierTests, flip_byte


class TestPinnedTier(KVTierTests):
    damageable = False

    @pytest.fixture
    def tier(self) -> Iterator[KVTier]:
        t = PinnedTier(GEOM, 32 * (GEOM.block_bytes + 8192))
        yield t
        t.close()


class TestBlockTierOnImageFile(KVTierTests):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[KVTier]:
        store = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 8 << 20},
                           size_classes=(GEOM.block_bytes,))
        t = BlockKVTier(store, GEOM, timeout_s=5.0)
        yield t
        t.close()
        store.close()

    def damage(self, tier: KVTier, key: bytes) -> None:
        assert isinstance(tier, BlockKVTier)
        where = tier.store.locate(key)
        assert where is not None
        offset, length = where
        flip_byte(tier.store.path.device, offset + length - 100)


class TestSharedTierOnLocalDirectory(KVTierTests):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[KVTier]:
        t = SharedTier(GEOM, tmp_path / "shared", timeout_s=5.0)
        yield t
        t.close()

    def damage(self, tier: KVTier, key: bytes) -> None:
        assert isinstance(tier, SharedTier)
        flip_byte(os.path.join(tier.fp.root, tier.file_name(key)), 4096 + GEOM.block_bytes - 100)
