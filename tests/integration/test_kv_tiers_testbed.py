"""The KV tier conformance suite (:class:`sfstore.testing.kv_tier.KVTierTests`) on the testbed's media: the shared
tier on the NFS-over-RDMA mount, the block store's tier on the NVMe-oF namespace (a raw block device: O_DIRECT,
no page cache between the tier and the fabric)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sfstore.blocks import BlockStore
from sfstore.kvcache.block_tier import BlockKVTier
from sfstore.kvcache.tier import KVTier
from sfstore.kvcache.tiers import SharedTier
from sfstore.testing.kv_tier import GEOM, KVTierTests, flip_byte

from .endpoints import env


class TestSharedTierOnNfsRdma(KVTierTests):
    @pytest.fixture
    def tier(self) -> Iterator[KVTier]:
        root = Path(env("SFSTORE_TEST_NFS_MOUNT")) / f"kvtier-{uuid.uuid4().hex[:8]}"
        t = SharedTier(GEOM, root, timeout_s=30.0)
        assert t.fp.transport == "rdma", t.fp.describe()
        yield t
        t.close()

    def damage(self, tier: KVTier, key: bytes) -> None:
        assert isinstance(tier, SharedTier)
        flip_byte(os.path.join(tier.fp.root, tier.file_name(key)), 4096 + GEOM.block_bytes - 100)


class TestBlockTierOnNvmeofNamespace(KVTierTests):
    @pytest.fixture
    def tier(self, nvmeof_namespace: Any) -> Iterator[KVTier]:
        store = BlockStore(nvmeof_namespace.device, size_classes=(GEOM.block_bytes,), capacity=8 << 20, format=True)
        try:
            t = BlockKVTier(store, GEOM, timeout_s=30.0)
            yield t
            t.close()
        finally:
            store.close()

    def damage(self, tier: KVTier, key: bytes) -> None:
        assert isinstance(tier, BlockKVTier)
        where = tier.store.locate(key)
        assert where is not None
        flip_byte(tier.store.path.device, where[0] + where[1] - 100)
