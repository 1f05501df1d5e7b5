"""HeldBlocks (``KVCacheStore.hold``), the pinned tier's up-front slots, and the native gather behind both: an
engine's per-layer loads as one copy per layer instead of one per block."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sfstore import _native, errors
from sfstore.kvcache import KVCacheStore, KVGeometry

from .conftest import GEOM


def blocks_for(geom: KVGeometry, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(geom.block_shape, generator=g).to(torch.bfloat16) for _ in range(n)]


def test_copy_layer_into_gathers_one_layer_of_every_held_block_in_key_order(kv: KVCacheStore) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 3))
    blocks = blocks_for(GEOM, 3, seed=1)
    kv.put(keys, blocks)
    with kv.hold(keys) as held:
        assert held.tiers == ["pinned"] * 3 and held.rows == [0, 1, 2] and len(held) == 3
        for layer in range(GEOM.num_layers):
            out = torch.zeros((3, *GEOM.layer_shape), dtype=torch.bfloat16)
            held.copy_layer_into(layer, out)
            for i in range(3):
                assert torch.equal(out[i], blocks[i][layer])
            raw = bytearray(3 * GEOM.layer_bytes)  # any writable buffer
            held.copy_layer_into(layer, raw)
            assert bytes(raw) == out.view(torch.uint8).numpy().tobytes()


def test_a_miss_is_no_row_and_a_held_block_outlives_its_eviction(kv: KVCacheStore) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 3))
    blocks = blocks_for(GEOM, 3, seed=2)
    kv.put(keys[:1] + keys[2:], [blocks[0], blocks[2]])
    kv.wait_for_puts()
    held = kv.hold(keys)
    assert held.tiers == ["pinned", None, "pinned"] and held.rows == [0, 2]
    assert held.tiers_of_rows == ["pinned", "pinned"]
    kv.evict(keys[:1], tiers=("pinned",))
    # more blocks than the tier's budget: the held ones are not evicted for them
    others = kv.keys_for(range(10_000, 10_000 + GEOM.block_tokens * 10))
    kv.put(others, blocks_for(GEOM, 10, seed=3))
    out = np.zeros(2 * GEOM.layer_bytes, dtype=np.uint8)
    held.copy_layer_into(3, out)
    assert out[:GEOM.layer_bytes].tobytes() == blocks[0][3].contiguous().view(torch.uint8).numpy().tobytes()
    assert out[GEOM.layer_bytes:].tobytes() == blocks[2][3].contiguous().view(torch.uint8).numpy().tobytes()
    idle = kv.pinned.idle
    held.release()  # the evicted block's slot was still the holder's: it is free only now
    held.release()  # idempotent
    assert kv.pinned.idle >= idle + 1
    with pytest.raises(errors.InvalidRequestError, match="released"):
        held.copy_layer_into(0, out)


def test_hold_counts_only_when_asked(kv: KVCacheStore) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 2))
    kv.put(keys, blocks_for(GEOM, 2))
    before = kv.counters.snapshot()["gets"]
    kv.hold(keys).release()
    assert kv.counters.snapshot()["gets"] == before
    kv.hold(keys, count=True).release()
    assert kv.counters.snapshot()["gets"] == before + 2


@pytest.mark.parametrize("bad", ["layer", "small", "readonly", "gpu-like"])
def test_copy_layer_into_refuses_bad_arguments(kv: KVCacheStore, bad: str) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 2))
    kv.put(keys, blocks_for(GEOM, 2))
    with kv.hold(keys) as held:
        layer, out = 0, np.zeros(2 * GEOM.layer_bytes, dtype=np.uint8)
        if bad == "layer":
            layer = GEOM.num_layers
        elif bad == "small":
            out = np.zeros(2 * GEOM.layer_bytes - 1, dtype=np.uint8)
        elif bad == "readonly":
            out = bytes(2 * GEOM.layer_bytes)
        else:  # not contiguous: a tensor of strided rows
            out = torch.zeros((4, GEOM.layer_bytes), dtype=torch.uint8)[::2]
        with pytest.raises(errors.InvalidRequestError):
            held.copy_layer_into(layer, out)


def test_native_gather_copies_rows_and_refuses_what_does_not_fit() -> None:
    srcs = [bytes([i]) * 64 for i in range(4)]
    out = bytearray(4 * 8)
    _native.gather(out, srcs, 10, 8)
    assert bytes(out) == b"".join(bytes([i]) * 8 for i in range(4))
    _native.gather(out, [], 0, 8)  # nothing to copy
    for args in [(bytearray(31), srcs, 0, 8), (out, srcs, 60, 8), (out, srcs, -1, 8), (out, srcs, 0, -8),
                 (out, [b"x" * 64, 5], 0, 8), (out, 7, 0, 8), (bytes(32), srcs, 0, 8)]:
        with pytest.raises(errors.InvalidRequestError):
            _native.gather(*args)


def _paged_cache(pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU paged cache ``[P, heads, kv, tokens, dim]`` (per head, the K rows then the V rows) and its view in the
    store's layer shape ``[P, kv, tokens, heads, dim]``: strided, contiguous only in its last dimension."""
    kv, n, h, d = GEOM.layer_shape
    cache = torch.zeros((pages, h, kv, n, d), dtype=torch.bfloat16)
    return cache, cache.permute(0, 2, 3, 1, 4)


def test_copy_layer_into_rows_at_lands_each_layer_in_its_strided_page_and_nothing_else(kv: KVCacheStore) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 3))
    blocks = blocks_for(GEOM, 3, seed=4)
    kv.put(keys, blocks)
    cache, view = _paged_cache(8)
    pages = [6, 1, 4]
    with kv.hold(keys) as held:
        for layer in range(GEOM.num_layers):
            cache.fill_(7)
            held.copy_layer_into(layer, view, rows_at=pages)
            for j, p in enumerate(pages):
                assert torch.equal(view[p], blocks[j][layer]), (layer, p)
            untouched = [p for p in range(8) if p not in pages]
            assert bool((cache[untouched] == 7).all())  # no byte outside the rows' pages
        as_numpy = view.view(torch.int16).numpy()  # a numpy array over the same strided memory
        cache.zero_()
        held.copy_layer_into(2, as_numpy, rows_at=pages)
        assert torch.equal(view[1], blocks[1][2])


@pytest.mark.parametrize("bad", ["shape", "itemsize", "count", "index", "negative", "bool", "last-dim", "reversed"])
def test_copy_layer_into_rows_at_refuses_what_does_not_fit(kv: KVCacheStore, bad: str) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 2))
    kv.put(keys, blocks_for(GEOM, 2))
    cache, view = _paged_cache(4)
    out: object = view
    rows: list[object] = [0, 3]
    if bad == "shape":
        out = cache  # the pages as they are, not viewed as the store's layers
    elif bad == "itemsize":
        out = view.float()
    elif bad == "count":
        rows = [0]
    elif bad == "index":
        rows = [0, 4]
    elif bad == "negative":
        rows = [-1, 0]
    elif bad == "bool":
        rows = [True, 0]
    elif bad == "last-dim":
        out = torch.zeros((4, *GEOM.layer_shape[:-1], 2 * GEOM.layer_shape[-1]), dtype=torch.bfloat16)[..., ::2]
    else:  # a numpy array with a negative stride: torch cannot view it
        out = np.zeros((4, *GEOM.layer_shape), dtype=np.int16)[::-1]
    with kv.hold(keys) as held, pytest.raises(errors.InvalidRequestError):
        held.copy_layer_into(0, out, rows_at=rows)  # type: ignore[arg-type]
    assert bool((cache == 0).all())


def test_native_scatter_copies_a_grid_of_runs_and_refuses_extents_past_either_side() -> None:
    # two sources of 2 x 3 runs of 4 bytes, contiguous; out holds them transposed at offsets 0 and 40
    srcs = [bytes(range(i * 24, i * 24 + 24)) for i in range(2)]
    out = bytearray(64)
    _native.scatter(out, srcs, 0, [0, 40], [1, 2, 3], [0, 4, 8], [0, 12, 4], 4)
    for i, base in enumerate((0, 40)):
        for b in range(2):
            for c in range(3):
                at = base + b * 4 + c * 8
                assert out[at:at + 4] == srcs[i][b * 12 + c * 4:b * 12 + c * 4 + 4]
    _native.scatter(out, [], 0, [], [1, 1, 1], [0, 0, 0], [0, 0, 0], 4)  # nothing to copy
    ok = dict(out=out, sources=srcs, offset=0, out_offsets=[0, 40], counts=[1, 2, 3], out_strides=[0, 4, 8],
              src_strides=[0, 12, 4], run=4)
    for change in [dict(out_offsets=[0, 41]), dict(out_offsets=[-1, 0]), dict(out_offsets=[0]), dict(offset=1),
                   dict(offset=-1), dict(run=-4), dict(counts=[1, 2]), dict(out_strides=[0, -4, 8]),
                   dict(counts=[1 << 50, 1, 1]), dict(out=bytes(64)), dict(sources=[srcs[0], 5]), dict(sources=7),
                   dict(src_strides=[0, 12, 5])]:
        before = bytes(out)
        with pytest.raises(errors.InvalidRequestError):
            _native.scatter(**{**ok, **change})  # type: ignore[arg-type]
        assert bytes(out) == before  # checked before any byte moved


def test_contains_many_asks_the_shared_tier_once_for_what_memory_lacks(tmp_path: Path) -> None:
    with KVCacheStore(GEOM, model_id="m", pinned_bytes=1 << 20, shared_dir=tmp_path / "shared") as s:
        keys = s.keys_for(range(GEOM.block_tokens * 4))
        s.put(keys[:3], blocks_for(GEOM, 3))
        s.wait_for_puts()
        s.evict(keys[:2], tiers=("pinned",))  # 0 and 1 only in the shared directory, 2 in both, 3 nowhere
        calls = s.shared.guard.counters.snapshot()["calls"]
        assert s.contains_many(keys) == [True, True, True, False]
        assert s.shared.guard.counters.snapshot()["calls"] == calls + 1
        assert s.contains_many(keys[2:3]) == [True]  # memory answers: the shared tier is not asked
        assert s.shared.guard.counters.snapshot()["calls"] == calls + 1
        assert s.contains_many([]) == []
        with pytest.raises(errors.InvalidRequestError):
            s.contains_many([b"short"])


def test_get_layer_into_contiguous_tensors_in_one_batch_is_bit_exact(kv: KVCacheStore) -> None:
    keys = kv.keys_for(range(GEOM.block_tokens * 3))
    blocks = blocks_for(GEOM, 3, seed=4)
    kv.put(keys, blocks)
    staging = torch.zeros((3, *GEOM.layer_shape), dtype=torch.bfloat16)
    for layer in range(GEOM.num_layers):
        assert kv.get_layer_into(keys, layer, list(staging.unbind(0))) == ["pinned"] * 3
        for i in range(3):
            assert torch.equal(staging[i], blocks[i][layer])


def test_reserve_allocates_slots_up_front_within_the_capacity(tmp_path: Path) -> None:
    kv = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=6 * (GEOM.block_bytes + 4096))
    try:
        cap = kv.pinned.capacity
        assert kv.pinned.reserve(4) == 4 and kv.pinned.idle == 4
        assert kv.pinned.reserve(4) == 0  # already there
        assert kv.pinned.reserve(100) == cap - 4 and kv.pinned.idle == cap  # never past the capacity
        keys = kv.keys_for(range(GEOM.block_tokens * 2))
        kv.put(keys, blocks_for(GEOM, 2))
        assert kv.pinned.idle == cap - 2  # the puts took reserved slots: nothing allocated on the way
    finally:
        kv.close()


def test_allocate_pinned_allocates_the_whole_tier_once(tmp_path: Path) -> None:
    kv = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=5 * (GEOM.block_bytes + 4096))
    try:
        cap = kv.pinned.capacity
        assert cap == 5 and kv.pinned.idle == 0
        assert kv.allocate_pinned() == cap and kv.pinned.full and kv.pinned.idle == cap
        assert kv.allocate_pinned() == 0  # all there already
        keys = kv.keys_for(range(GEOM.block_tokens * 7))
        for k, b in zip(keys, blocks_for(GEOM, 7), strict=True):  # more blocks than slots, one at a time:
            kv.put([k], [b])  # the oldest leave, and their slots take the next ones (nothing more is allocated)
        assert kv.pinned.full and kv.pinned.idle == 0 and kv.pinned._made == cap
        assert kv.get_into(keys[-5:], [np.empty(GEOM.block_bytes, np.uint8) for _ in range(5)]) == ["pinned"] * 5
    finally:
        kv.close()
    with pytest.raises(errors.InvalidRequestError, match="closed"):
        kv.allocate_pinned()


def test_prepare_pinned_allocates_idle_slots_in_the_background(tmp_path: Path) -> None:
    kv = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=8 * (GEOM.block_bytes + 4096))
    try:
        keys = kv.keys_for(range(GEOM.block_tokens * 3))
        kv.put(keys, blocks_for(GEOM, 3))  # three slots hold blocks, none idle
        assert kv.pinned.idle == 0
        assert kv.prepare_pinned(4)
        kv.wait_for_puts()
        deadline = time.monotonic() + 10
        while kv.pinned.idle < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kv.pinned.idle == 4
        assert not kv.prepare_pinned(4)  # nothing missing
        assert kv.prepare_pinned(100) or kv.pinned.full  # never past the capacity
        for _ in range(1000):
            if kv.pinned.full:
                break
            time.sleep(0.01)
        assert kv.pinned.full and kv.pinned.idle == kv.pinned.capacity - 3
        assert not kv.prepare_pinned(100)
    finally:
        kv.close()
    assert not kv.prepare_pinned(1)  # closed: nothing started


def test_a_prefetch_of_pinned_blocks_is_done_on_return_and_counted_once(tmp_path: Path) -> None:
    from sfstore.futures import DoneFuture

    with KVCacheStore(GEOM, model_id="m", pinned_bytes=1 << 20, shared_dir=tmp_path / "shared") as s:
        keys = s.keys_for(range(GEOM.block_tokens * 3))
        s.put(keys, blocks_for(GEOM, 3))
        s.wait_for_puts()
        before = s.counters.snapshot()
        fut = s.prefetch(keys, count=True)
        assert isinstance(fut, DoneFuture) and fut.done()  # no background work for blocks already pinned
        assert fut.get() == ["pinned"] * 3
        now = s.counters.snapshot()
        assert (now["gets"] - before["gets"], now["hits_pinned"] - before["hits_pinned"]) == (3, 3)
        s.evict(keys[1:2], tiers=("pinned",))
        mixed = s.prefetch(keys)  # one block to read: in the background, as before
        assert not isinstance(mixed, DoneFuture)
        assert mixed.get(30) == ["pinned", "shared", "pinned"]
        assert s.counters.snapshot()["gets"] == now["gets"]  # count=False


def test_a_slot_of_a_2_mib_block_gets_huge_pages_where_a_plain_buffer_does() -> None:
    """A block's slot is a registered buffer of the block's size alone (its header is another): where the kernel
    gives a 2 MiB buffer transparent huge pages, a 2 MiB block's slot has them too (copies out of it then take
    far fewer TLB misses), which a slot of header and block together (2 MiB + 4 KiB) would not."""
    from sfstore.buffers import RegisteredBufferPool

    big = KVGeometry(num_layers=32, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert big.block_bytes == 2 << 20
    probe = RegisteredBufferPool(big.block_bytes)
    try:
        with probe.acquire():
            huge = probe.stats()["thp_buffers"] + probe.stats()["hugetlb_buffers"]
    finally:
        probe.close()
    if not huge:
        pytest.skip("this kernel gives a 2 MiB registered buffer no huge pages")
    kv = KVCacheStore(big, model_id="huge", pinned_bytes=4 * (big.block_bytes + 4096))
    try:
        assert kv.allocate_pinned() == 4
        got = kv.pinned._pool.stats()
        assert got["thp_buffers"] + got["hugetlb_buffers"] == 4, got
    finally:
        kv.close()


def test_the_pinned_tier_notes_the_keys_that_leave_it_only_when_asked() -> None:
    kv = KVCacheStore(GEOM, model_id="tiny", pinned_bytes=2 * (GEOM.block_bytes + 4096))
    try:
        keys = kv.keys_for(range(GEOM.block_tokens * 4))
        blocks = blocks_for(GEOM, 4)
        kv.put(keys[:3], blocks[:3])  # one more than fits: the oldest left, unnoted (nothing asked for it)
        assert kv.pinned.take_removed() == []
        kv.pinned.track_removals()
        kv.put(keys[3:], blocks[3:])  # evicts the least recently used of the two
        kv.evict([keys[3]])
        kv.evict([keys[0]])  # not in the tier: nothing left it
        assert kv.pinned.take_removed() == [keys[1], keys[3]]
        assert kv.pinned.take_removed() == []  # each once
    finally:
        kv.close()
