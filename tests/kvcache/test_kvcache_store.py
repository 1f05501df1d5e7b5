"""KVCacheStore on host tensors (torch CPU and numpy) across all tiers: keys, lookup, put/get, per-layer
transfers, eviction and promotion, two processes sharing the shared tier, crash safety, bad input."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from sfstore import errors
from sfstore.blocks import BlockStore
from sfstore.kvcache import KVCacheStore, KVGeometry
from sfstore.kvcache.shared_chunks import chunk_header_bytes
from sfstore.kvcache.tiers import SharedTier

torch = pytest.importorskip("torch")


def blocks_for(geom: KVGeometry, n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(geom.block_shape, generator=g).to(torch.bfloat16) for _ in range(n)]


def empty(geom: KVGeometry, n: int) -> list:
    return [torch.zeros(geom.block_shape, dtype=torch.bfloat16) for _ in range(n)]


# -- keys and lookup ------------------------------------------------------------------------------------------------
def test_keys_are_chained_prefix_hashes(kv: KVCacheStore, geom: KVGeometry) -> None:
    tokens = list(range(100))  # 6 full blocks of 16, 4 tokens left over
    keys = kv.keys_for(tokens)
    assert len(keys) == 6 and all(len(k) == 32 for k in keys) and len(set(keys)) == 6
    assert kv.keys_for(tokens[:64]) == keys[:4]  # a prefix has the same keys
    changed = tokens.copy()
    changed[20] = 9999  # in block 1: blocks 1.. change, block 0 does not
    k2 = kv.keys_for(changed)
    assert k2[0] == keys[0] and all(a != b for a, b in zip(k2[1:], keys[1:], strict=True))
    assert kv.keys_for(tokens, extra=("lora-a",))[0] != keys[0]
    other = KVCacheStore(geom, model_id="other-model", pinned_bytes=0)
    try:
        assert other.keys_for(tokens)[0] != keys[0]
    finally:
        other.close()
    assert kv.keys_for(np.array(tokens)) == keys and kv.keys_for(torch.tensor(tokens)) == keys


def test_lookup_counts_the_leading_blocks_present(kv: KVCacheStore, geom: KVGeometry) -> None:
    tokens = list(range(16 * 5 + 3))
    keys = kv.keys_for(tokens)
    assert kv.lookup(tokens) == 0
    kv.put(keys[:3], blocks_for(geom, 3))
    assert kv.lookup(tokens) == 48
    kv.put([keys[4]], blocks_for(geom, 1))  # a hole at block 3: lookup stops there
    assert kv.lookup(tokens) == 48
    assert kv.lookup(tokens[:40]) == 32
    assert kv.lookup(tokens, extra=("other",)) == 0


# -- put / get across tiers -----------------------------------------------------------------------------------------
def test_put_get_round_trip_and_tiers(kv: KVCacheStore, geom: KVGeometry) -> None:
    keys = kv.keys_for(range(16 * 4))
    src = blocks_for(geom, 4)
    kv.put(keys, src)
    dst = empty(geom, 4)
    assert kv.get_into(keys, dst) == ["pinned"] * 4
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    st = kv.stats()
    assert st["resident"] == {"pinned": 4, "block": 4, "shared": 4}
    assert st["hits_pinned"] == 4 and st["put_p50_s"] is not None and st["get_p99_s"] is not None
    missing = kv.keys_for(range(1000, 1016))
    out = empty(geom, 1)
    assert kv.get_into(missing, out) == [None] and not out[0].any()


def test_get_promotes_from_block_and_shared_tiers(kv: KVCacheStore, geom: KVGeometry) -> None:
    keys = kv.keys_for(range(16 * 3))
    src = blocks_for(geom, 3, seed=1)
    kv.put(keys, src)
    kv.evict(keys[:2], tiers=("pinned",))
    kv.evict(keys[1:2], tiers=("block",))  # block 1 only in the shared tier now
    dst = empty(geom, 3)
    assert kv.get_into(keys, dst) == ["block", "shared", "pinned"]
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    kv.wait_for_puts()
    time.sleep(0.2)  # the promotion of block 1 into the block tier runs in the background
    assert kv.get_into(keys, dst) == ["pinned"] * 3
    kv.evict(keys, tiers=("pinned",))
    deadline = time.time() + 10
    while not kv.block.contains(keys[1]) and time.time() < deadline:  # type: ignore[union-attr]
        time.sleep(0.05)
    assert kv.get_into(keys[1:2], dst[1:2]) == ["block"]
    st = kv.stats()
    assert st["hits_block"] == 2 and st["hits_shared"] == 1 and st["promotions"] == 1


def test_pinned_tier_is_lru_within_its_budget(block_store: BlockStore, geom: KVGeometry) -> None:
    kv = KVCacheStore(geom, model_id="lru", pinned_bytes=3 * (geom.block_bytes + 4096), block_store=block_store)
    try:
        keys = kv.keys_for(range(16 * 5))
        kv.put(keys[:3], blocks_for(geom, 3))
        kv.get_into(keys[:1], empty(geom, 1))  # block 0 most recently used
        kv.put(keys[3:5], blocks_for(geom, 2))
        kv.wait_for_puts()
        assert kv.stats()["resident"]["pinned"] == 3
        got = kv.get_into(keys, empty(geom, 5))
        assert got[0] == "pinned" and got[1] == "block" and got[2] == "block"
    finally:
        kv.close()


def test_numpy_blocks_and_async_put(block_store: BlockStore, geom: KVGeometry) -> None:
    kv = KVCacheStore(geom, model_id="np", pinned_bytes=1 << 20, block_store=block_store)
    try:
        keys = kv.keys_for(range(32))
        src = [np.random.default_rng(i).integers(0, 2**16, geom.block_bytes // 2, dtype=np.uint16) for i in range(2)]
        fut = kv.put_async(keys, src)
        src[0][:] = 0  # the caller may reuse its memory as soon as put_async returned
        assert fut.get(timeout=30) is None and fut.done()
        kv.evict(keys, tiers=("pinned",))
        dst = [np.zeros(geom.block_bytes // 2, np.uint16) for _ in range(2)]
        assert kv.get_into(keys, dst) == ["block", "block"]
        assert np.array_equal(dst[1], src[1])
        expected0 = np.random.default_rng(0).integers(0, 2**16, geom.block_bytes // 2, dtype=np.uint16)
        assert np.array_equal(dst[0], expected0)  # copied before put_async returned: the zeros never got stored
    finally:
        kv.close()


# -- per layer ------------------------------------------------------------------------------------------------------
def test_per_layer_store_and_load_into_strided_paged_tensors(kv: KVCacheStore, geom: KVGeometry) -> None:
    # A paged cache per layer as engines keep it: (2, num_blocks, block_tokens, heads, dim); a block's layer
    # slice [:, b] is not contiguous.
    pages = [torch.randn(2, 8, geom.block_tokens, geom.num_kv_heads, geom.head_dim).to(torch.bfloat16)
             for _ in range(geom.num_layers)]
    keys = kv.keys_for(range(16 * 2))
    src_ids = [3, 5]
    for layer in range(geom.num_layers):
        kv.put_layer(keys, layer, [pages[layer][:, b] for b in src_ids])
        if layer < geom.num_layers - 1:
            assert not kv.contains(keys[0])  # committed only once every layer is in
    kv.wait_for_puts()
    assert kv.stats()["resident"]["block"] == 2
    kv.evict(keys, tiers=("pinned",))
    fresh = [torch.zeros_like(p) for p in pages]
    assert kv.prefetch(keys).get(timeout=30) == ["block", "block"]
    for layer in range(geom.num_layers):
        assert kv.get_layer_into(keys, layer, [fresh[layer][:, b] for b in (0, 6)]) == ["pinned", "pinned"]
    for layer in range(geom.num_layers):
        assert torch.equal(fresh[layer][:, 0], pages[layer][:, 3])
        assert torch.equal(fresh[layer][:, 6], pages[layer][:, 5])
        assert not fresh[layer][:, 1].any()
    whole = empty(geom, 1)
    kv.get_into(keys[:1], whole)
    half = kv.keys_for(range(5000, 5016))
    kv.put_layer(half, 0, [pages[0][:, 1]])  # a step that ended after layer 0
    assert kv.discard_partial(half) == 1 and kv.discard_partial() == 0 and not kv.contains(half[0])
    assert torch.equal(whole[0][2], pages[2][:, 3])  # the block layout is [layer][kv][token][head][dim]


# -- sharing and crash safety of the shared tier ----------------------------------------------------------------------
def _writer(shared: str, tokens: list[int], seed: int) -> None:
    from tests.kvcache.conftest import GEOM

    kv = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=1 << 20, shared_dir=shared)
    kv.put(kv.keys_for(tokens), blocks_for(GEOM, len(tokens) // 16, seed=seed))
    kv.close()


def test_two_processes_share_the_shared_tier(shared_dir: Path, geom: KVGeometry) -> None:
    tokens = list(range(16 * 3))
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_writer, args=(str(shared_dir), tokens, 7))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    reader = KVCacheStore(geom, model_id="tiny", pinned_bytes=1 << 20, shared_dir=shared_dir)
    try:
        assert reader.lookup(tokens) == 48
        dst = empty(geom, 3)
        assert reader.get_into(reader.keys_for(tokens), dst) == ["shared"] * 3
        assert all(torch.equal(a, b) for a, b in zip(dst, blocks_for(geom, 3, seed=7), strict=True))
    finally:
        reader.close()


def _endless_writer(shared: str, chunk_tokens: int) -> None:
    from tests.kvcache.conftest import GEOM

    kv = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=1 << 20, shared_dir=shared, chunk_tokens=chunk_tokens)
    i = 0
    while True:
        tokens = list(range(i * 16, i * 16 + 64))
        kv.put(kv.keys_for(tokens), blocks_for(GEOM, 4, seed=i))
        i += 1


@pytest.mark.parametrize("chunk_tokens", [0, 64], ids=["block-files", "chunk-files"])
def test_killed_writer_leaves_no_visible_partial_block(shared_dir: Path, geom: KVGeometry, chunk_tokens: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    for trial in range(5):
        p = ctx.Process(target=_endless_writer, args=(str(shared_dir), chunk_tokens))
        p.start()
        deadline = time.time() + 60
        while time.time() < deadline and not any(shared_dir.rglob("*.kv[bc]")):
            time.sleep(0.01)
        time.sleep(0.05 * trial)
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    tier = SharedTier(geom, shared_dir)
    files = [f for f in shared_dir.rglob("*.kv[bc]") if not tier.fp.is_temporary(f.name)]
    assert files
    reader = KVCacheStore(geom, model_id="tiny", pinned_bytes=1 << 20, shared_dir=shared_dir,
                          chunk_tokens=chunk_tokens)
    try:
        if chunk_tokens == 0:
            for f in files:
                assert f.stat().st_size == 4096 + geom.block_bytes
            keys = [bytes.fromhex(f.stem) for f in files]
            assert None not in reader.get_into(keys, empty(geom, len(keys)))  # every visible block verifies
        else:  # a chunk file holds one prompt's 4 blocks: every prompt is whole or absent, and verifies
            assert all(f.stat().st_size == chunk_header_bytes(geom, 4) + 4 * geom.block_bytes for f in files)
            found = 0
            for i in range(5 * 400):
                keys = reader.keys_for(list(range(i * 16, i * 16 + 64)))
                dst = empty(geom, 4)
                got = reader.get_into(keys, dst)
                assert got in (["shared"] * 4, [None] * 4), got
                if got[0] is not None:
                    found += 1
                    assert all(torch.equal(a, b) for a, b in zip(dst, blocks_for(geom, 4, seed=i), strict=True))
            assert found == len(files)
    finally:
        reader.close()


def test_corrupt_shared_file_is_a_miss_never_returned(kv: KVCacheStore, geom: KVGeometry, shared_dir: Path) -> None:
    keys = kv.keys_for(range(16))
    kv.put(keys, blocks_for(geom, 1))
    kv.wait_for_puts()
    kv.evict(keys, tiers=("pinned", "block"))
    f = next(shared_dir.rglob("*.kv[bc]"))  # a block file, or a chunk file of one block: byte 5000 is its block's
    data = bytearray(f.read_bytes())
    data[5000] ^= 1
    f.write_bytes(bytes(data))
    out = empty(geom, 1)
    assert kv.get_into(keys, out) == [None] and not out[0].any()


# -- bad input ---------------------------------------------------------------------------------------------------
def test_bad_input_is_typed(kv: KVCacheStore, geom: KVGeometry) -> None:
    keys = kv.keys_for(range(16))
    with pytest.raises(errors.InvalidKeyError):
        kv.put([b"short"], blocks_for(geom, 1))
    with pytest.raises(errors.InvalidKeyError):
        kv.get_into(["not bytes" * 4], empty(geom, 1))  # type: ignore[list-item]
    with pytest.raises(errors.InvalidRequestError, match="dtype"):
        kv.put(keys, [torch.zeros(geom.block_shape, dtype=torch.float32)])
    with pytest.raises(errors.InvalidRequestError, match="bytes"):
        kv.put(keys, [torch.zeros((1, 2, 3), dtype=torch.bfloat16)])
    with pytest.raises(errors.InvalidRequestError, match="keys but"):
        kv.put(keys, [])
    with pytest.raises(errors.InvalidRequestError, match="layer"):
        kv.put_layer(keys, geom.num_layers, [torch.zeros(geom.layer_shape, dtype=torch.bfloat16)])
    with pytest.raises(errors.InvalidRequestError, match="layer of a block"):
        kv.put_layer(keys, 0, [torch.zeros((2, 2), dtype=torch.bfloat16)])
    with pytest.raises(errors.InvalidRequestError, match="unknown tier"):
        kv.evict(keys, tiers=("disk",))
    with pytest.raises(errors.InvalidRequestError):
        KVGeometry(num_layers=0, block_tokens=16, num_kv_heads=1, head_dim=8)
    with pytest.raises(errors.InvalidRequestError, match="dtype"):
        KVGeometry(num_layers=1, block_tokens=16, num_kv_heads=1, head_dim=8, dtype="float64")
    assert kv.stats()["puts"] == 0


def test_block_store_too_small_for_a_block_is_a_config_error(tmp_path: Path, geom: KVGeometry) -> None:
    with BlockStore({"kind": "image", "path": str(tmp_path / "s.img"), "size": 8 << 20},
                    size_classes=(4096,)) as small, pytest.raises(errors.ConfigError, match="size_classes"):
        KVCacheStore(geom, block_store=small)


def test_without_a_pinned_tier_blocks_move_straight_from_and_to_the_callers_memory(
    block_store: BlockStore, shared_dir: Path, geom: KVGeometry
) -> None:
    kv = KVCacheStore(geom, model_id="direct", pinned_bytes=0, block_store=block_store, shared_dir=shared_dir,
                      chunk_tokens=0)  # (it damages the block file of one key)
    try:
        keys = kv.keys_for(range(16 * 3))
        src = blocks_for(geom, 3, seed=5)
        kv.put(keys, src)
        assert kv.stats()["resident"] == {"pinned": 0, "block": 3, "shared": 3}
        kv.evict(keys[2:], tiers=("block",))
        dst = empty(geom, 3)
        assert kv.get_into(keys, dst) == ["block", "block", "shared"]
        assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
        assert kv.get_into(keys[2:], dst[2:]) == ["block"]  # promoted by the previous get
        f = next(p for p in shared_dir.rglob("*.kvb") if p.stem == keys[0].hex())
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
        kv.evict(keys[:1], tiers=("block",))
        assert kv.get_into(keys[:1], dst[:1]) == [None]  # a corrupt shared file is a miss
        st = kv.stats()
        assert st["hits_block"] == 3 and st["hits_shared"] == 1 and st["misses"] == 1
        assert st["bytes_direct"] >= 3 * geom.block_bytes and st["bytes_bounced"] >= 0
        bd = block_store.path.counters.snapshot()
        assert bd["bytes_direct"] >= 3 * geom.block_bytes  # the blocks went with O_DIRECT, not through a slot
    finally:
        kv.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_blocks_round_trip_through_every_tier(kv: KVCacheStore, geom: KVGeometry) -> None:
    keys = kv.keys_for(range(16 * 4))
    src = [b.cuda() for b in blocks_for(geom, 4, seed=9)]
    kv.put(keys, src)
    kv.wait_for_puts()
    kv.evict(keys[:2], tiers=("pinned",))
    kv.evict(keys[1:2], tiers=("block",))
    dst = [torch.zeros(geom.block_shape, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    assert kv.get_into(keys, dst) == ["block", "shared", "pinned", "pinned"]
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    pages = torch.zeros(2, 4, geom.block_tokens, geom.num_kv_heads, geom.head_dim, dtype=torch.bfloat16,
                        device="cuda")
    kv.get_layer_into(keys[:1], 1, [pages[:, 2]])
    assert torch.equal(pages[:, 2], src[0][1])
    assert kv.stats()["bytes_device_staged"] >= 8 * geom.block_bytes
