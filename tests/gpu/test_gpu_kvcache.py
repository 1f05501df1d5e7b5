"""KVCacheStore with CUDA blocks: through the pinned tier to the block store and back, through the device path to
the shared tier's chunk files and back (whole blocks and layer by layer), the pinned tier above the shared tier,
and an engine's per-layer loads on a side CUDA stream. Every byte comes back exact, from the tier expected."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from sfstore.blocks import BlockStore
from sfstore.kvcache import KVCacheStore
from sfstore.kvcache.shared_chunks import CHUNK_SUFFIX
from sfstore.paths.device import ROUTES, DevicePath

from .conftest import MiB, cuda_blocks, gpu_marks, kv_geometry

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need a CUDA build of torch")
pytestmark = gpu_marks(torch)

SLOT_OVERHEAD = 8192  # room per pinned block for its slot's header, as budgets for N blocks are sized


def _pinned_bytes(blocks: int, block_bytes: int) -> int:
    """A pinned budget with room for ``blocks`` blocks and a few more."""
    return (blocks + 8) * (block_bytes + SLOT_OVERHEAD)


def _state(kv: KVCacheStore) -> str:
    """The store's quarantine state and stats, for an assertion's message."""
    stats = kv.stats()
    return f"quarantine {stats['quarantine']}; stats {stats}"


def test_kvcache_block_tier_round_trip(tmp_path: Path, cuda: torch.device) -> None:
    """24 CUDA bfloat16 blocks (more than the block tier's 16 a call) put through the pinned tier into a block
    store image, evicted from the pinned tier, got back from the block store, then again from the pinned tier:
    bit-exact both times, no put dropped, every GPU copy counted as staged."""
    geom = kv_geometry(4)
    n, size = 24, geom.block_bytes
    blocks = cuda_blocks(geom, n, seed=5)
    store = BlockStore({"kind": "image", "path": str(tmp_path / "blocks.img"), "size": n * (size + 8192) + 64 * MiB},
                       size_classes=(size,), format=True)
    try:
        kv = KVCacheStore(geom, model_id="gpu-test", pinned_bytes=_pinned_bytes(n, size), block_store=store)
        try:
            keys = kv.keys_for(list(range(n * geom.block_tokens)))
            assert len(keys) == n
            kv.put(keys, blocks.srcb)
            kv.wait_for_puts()
            store.flush()
            assert kv.evict(keys, tiers=("pinned",)) == n
            assert kv.get_into(keys, blocks.dstb) == ["block"] * n, _state(kv)
            assert blocks.mismatched() == [], "block tier: bytes differ"
            blocks.zero_dst()
            assert kv.get_into(keys, blocks.dstb) == ["pinned"] * n, _state(kv)
            assert blocks.mismatched() == [], "pinned tier: bytes differ"
            stats = kv.stats()
        finally:
            kv.close()
    finally:
        store.close()
    assert stats["puts_dropped"] == 0 and stats["lower_tier_errors"] == 0, stats
    assert stats["hits_block"] == n and stats["hits_pinned"] == n and stats["misses"] == 0, stats
    assert stats["resident"]["block"] == n, stats["resident"]
    assert stats["bytes_device_staged"] == 3 * n * size, stats  # into slots on the put, out of them on each get


def test_kvcache_device_path_to_shared_chunk_files(tmp_path: Path, cuda: torch.device) -> None:
    """Pinned tier off: 32 CUDA blocks (two chunk files of 16) go to the shared tier on the device path and come
    back from it, bit-exact, the device counters adding up to the bytes moved; a get by layer announces every
    layer and answers every key from the shared tier."""
    geom = kv_geometry(4)
    n, size = 32, geom.block_bytes
    blocks = cuda_blocks(geom, n, seed=6)
    dp = DevicePath()
    kv = KVCacheStore(geom, model_id="gpu-test", pinned_bytes=0, shared_dir=tmp_path / "shared", fsync_shared=True,
                      device=dp)
    try:
        per_chunk = kv.chunk_tokens // geom.block_tokens
        assert per_chunk > 1 and n % per_chunk == 0 and n // per_chunk >= 2, kv.chunk_tokens
        keys = kv.keys_for(list(range(n * geom.block_tokens)))
        kv.register_device_buffers([blocks.src, blocks.dst])  # cuFile registration (nothing to do outside gds)
        kv.put(keys, blocks.srcb)
        assert len(list((tmp_path / "shared").rglob(f"*{CHUNK_SUFFIX}"))) == n // per_chunk
        assert kv.get_into(keys, blocks.dstb) == ["shared"] * n, _state(kv)
        assert blocks.mismatched() == [], "shared tier: bytes differ"
        desc = kv.describe()
        stats = kv.stats()
        route = desc["gpu_blocks"]["shared"]
        dev = stats["device"]["shared"]
        assert dev["bytes_gpu_direct"] + dev["bytes_staged"] == 2 * n * size, (dev, route)
        assert route["route"] in ROUTES, route
        if route["route"] == "gds":
            assert dev["bytes_staged"] == 0, (dev, route)
        if dp.mode != "gds":  # a host without cuFile routes every file as its mode says
            assert route["route"] == dp.mode, (route, dp.mode, dp.why)
        assert stats["bytes_device_staged"] == 0, stats  # no pinned tier: no copy into its slots

        blocks.zero_dst()
        announced: dict[int, set[int]] = {}
        lock = threading.Lock()

        def on_layer(indices: list[int], layer: int) -> None:
            with lock:
                announced.setdefault(layer, set()).update(indices)

        again = kv.get_into(keys, blocks.dstb, on_layer=on_layer)
        seen = {layer: sorted(idx) for layer, idx in sorted(announced.items())}
        assert again == ["shared"] * n and sorted(announced) == list(range(geom.num_layers)), (
            f"a get by layer answered {again} and announced layers {sorted(announced)}; {_state(kv)}")
        assert all(idx == list(range(n)) for idx in seen.values()), f"blocks announced per layer: {seen}"
        assert blocks.mismatched() == [], "shared tier, by layer: bytes differ"
    finally:
        kv.close()
        dp.close()


def test_kvcache_pinned_tier_over_shared_tier(tmp_path: Path, cuda: torch.device) -> None:
    """Pinned tier on above the shared tier, the device path given: CUDA blocks are copied into pinned slots and
    written through to the shared tier from there; evicted from the pinned tier, they come back from the shared
    tier bit-exact, each copied once in and once out of a slot (none on the device path), and describe() says
    GPU blocks take the pinned slots."""
    geom = kv_geometry(4)
    n, size = 32, geom.block_bytes
    blocks = cuda_blocks(geom, n, seed=7)
    dp = DevicePath()
    kv = KVCacheStore(geom, model_id="gpu-test", pinned_bytes=_pinned_bytes(n, size), shared_dir=tmp_path / "shared",
                      fsync_shared=True, device=dp)
    try:
        keys = kv.keys_for(list(range(n * geom.block_tokens)))
        before = kv.stats()
        kv.put(keys, blocks.srcb)
        kv.wait_for_puts()
        assert kv.evict(keys, tiers=("pinned",)) == n
        assert kv.get_into(keys, blocks.dstb) == ["shared"] * n, _state(kv)
        assert blocks.mismatched() == [], "shared tier under the pinned tier: bytes differ"
        stats = kv.stats()
        desc = kv.describe()
    finally:
        kv.close()
        dp.close()
    assert stats["bytes_device_staged"] - before["bytes_device_staged"] == 2 * n * size, stats
    assert stats["lower_tier_errors"] == 0 and stats["puts_dropped"] == 0, stats
    assert stats["hits_shared"] - before["hits_shared"] == n, stats
    assert stats["device"]["shared"] == {"bytes_gpu_direct": 0, "bytes_staged": 0}, stats["device"]
    gpu = desc["gpu_blocks"]
    assert set(gpu) == {"pinned", "shared"} and all(v["route"] == "pinned slots" for v in gpu.values()), gpu


@pytest.mark.parametrize("layout", ["blocks", "pages"])
def test_per_layer_loads_on_a_side_stream(cuda: torch.device, layout: str) -> None:
    """Blocks of 32 layers in the pinned tier, prefetched, then loaded layer by layer with get_layer_into on a
    load stream, as an engine does; once the default stream waits on a layer's event, that layer's bytes are in
    every destination. ``blocks``: each block's own contiguous tensor; ``pages``: an engine's per-layer KV pages,
    each block into a slot of them (strided views), the other slots left untouched."""
    geom = kv_geometry(32)
    n, size, layers = 8, geom.block_bytes, geom.num_layers
    num_slots, slots = 2 * n + 3, [2 * b + 1 for b in range(n)]  # the pages' slots the blocks go to
    blocks = cuda_blocks(geom, n, seed=8)
    src = blocks.src.view(torch.bfloat16).view(n, *geom.block_shape)
    if layout == "blocks":
        per_block = blocks.dst.view(torch.bfloat16).view(n, *geom.block_shape)
        dests = [[per_block[b, layer] for b in range(n)] for layer in range(layers)]
        pages: list[Any] = []
    else:
        kv_dim, tokens, heads, dim = geom.layer_shape
        pages = [torch.zeros(kv_dim, num_slots, tokens, heads, dim, dtype=torch.bfloat16, device=cuda)
                 for _ in range(layers)]
        dests = [[pages[layer][:, s] for s in slots] for layer in range(layers)]
        assert not dests[0][0].is_contiguous()
    kv = KVCacheStore(geom, model_id="gpu-test-layers", pinned_bytes=_pinned_bytes(n, size))
    load_stream = torch.cuda.Stream()
    try:
        keys = kv.keys_for(list(range(n * geom.block_tokens)))
        kv.put(keys, blocks.srcb)
        kv.wait_for_puts()
        torch.cuda.synchronize()
        assert kv.prefetch(keys, count=True).get() == ["pinned"] * n
        for layer in range(layers):
            with torch.cuda.stream(load_stream):
                tiers = kv.get_layer_into(keys, layer, dests[layer])
                done = torch.cuda.Event()
                done.record(load_stream)
            assert tiers == ["pinned"] * n, f"layer {layer}: {tiers}"
            torch.cuda.current_stream().wait_event(done)  # as a layer's compute waits for its KV
            got = torch.stack(dests[layer]).view(torch.int16)  # bits compared: random bf16 holds NaNs
            assert torch.equal(got, src[:, layer].view(torch.int16)), f"layer {layer}: bytes differ"
        torch.cuda.synchronize()
        stats = kv.stats()
    finally:
        kv.close()
    if layout == "pages":
        untouched = [s for s in range(num_slots) if s not in slots]
        assert all(not bool(p[:, untouched].any()) for p in pages), "slots no block was loaded into were written"
    assert stats["gets"] == n and stats["hits_pinned"] == n and stats["misses"] == 0, stats
    assert stats["bytes_device_staged"] == n * size * 2, stats  # each block into its slot, then out layer by layer
