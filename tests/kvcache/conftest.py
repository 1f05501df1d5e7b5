"""Fixtures of the KV-cache tests: a small geometry, a block store on an image file, a shared directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sfstore.blocks import BlockStore
from sfstore.kvcache import KVCacheStore, KVGeometry

GEOM = KVGeometry(num_layers=4, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")  # 32 KiB blocks


@pytest.fixture
def geom() -> KVGeometry:
    return GEOM


@pytest.fixture
def block_store(tmp_path: Path) -> Iterator[BlockStore]:
    s = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 16 << 20},
                   size_classes=(GEOM.block_bytes,))
    yield s
    if not s._closed:
        s.close()


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    return tmp_path / "shared"


@pytest.fixture
def kv(block_store: BlockStore, shared_dir: Path) -> Iterator[KVCacheStore]:
    s = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=8 * (GEOM.block_bytes + 4096), block_store=block_store,
                     shared_dir=shared_dir)
    yield s
    s.close()


@pytest.fixture(params=["slices-in-place", "whole-files"])
def read_whole(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a chunk file is read: its wanted slices straight into the destinations (local filesystems), or
    the whole file in one read, then copied out (NFS: one READ per rsize). For modules of chunk tests:
    ``pytestmark = pytest.mark.usefixtures("read_whole")``."""
    from sfstore.kvcache.shared_chunks import ChunkFiles

    whole = request.param == "whole-files"
    real = ChunkFiles.__init__

    def init(self: ChunkFiles, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        self.read_whole = whole

    monkeypatch.setattr(ChunkFiles, "__init__", init)
    return whole
