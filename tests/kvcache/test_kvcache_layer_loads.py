"""Layer-by-layer loads (``KVCacheStore.hold_async``): a layer of held blocks can be copied out as soon as it is
read and verified, while the later layers of a cold shared-tier hit are still being read.

Writer and reader are separate stores on one directory: every read below comes from the chunk files (both ways
they are read: slices in place and whole files). To show that layer 0 is announced *before* the read ends, a gate
holds the batches of the later layers until the test opens it: what the test asserts is the order, not a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import errors
from sfstore.kvcache import KVCacheStore
from sfstore.kvcache.shared_chunks import chunk_header_bytes
from tests.kvcache.conftest import GEOM
from tests.kvcache.layer_gate import LayerGate
from tests.kvcache.test_kvcache_chunks import CHUNK, blocks, files, tokens

LB = GEOM.layer_bytes
N = 16 * 8  # tokens: 8 blocks, two chunk files


pytestmark = pytest.mark.usefixtures("read_whole")  # (conftest: both ways a chunk file is read)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[KVCacheStore, KVCacheStore]]:
    kw: dict[str, Any] = {"model_id": "layers", "shared_dir": tmp_path / "shared", "chunk_tokens": CHUNK,
                          "io_timeout_ms": 0}
    writer = KVCacheStore(GEOM, pinned_bytes=0, **kw)
    reader = KVCacheStore(GEOM, pinned_bytes=64 * GEOM.block_bytes, **kw)
    try:
        yield writer, reader
    finally:
        reader.close()
        writer.close()


def stored(writer: KVCacheStore, n: int = N) -> list[np.ndarray]:
    keys = writer.keys_for(tokens(n))
    want = blocks(tokens(n))
    writer.put(keys, want)
    writer.wait_for_puts()
    return want


def layer_out(held: Any, layer: int) -> np.ndarray:
    out = np.zeros((len(held), LB), np.uint8)
    held.copy_layer_into(layer, out)
    return out


def test_a_cold_shared_hit_announces_layer_0_before_its_later_layers_are_read(
        stores: tuple[KVCacheStore, KVCacheStore], monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = stores
    want = stored(writer)
    gate = LayerGate(monkeypatch)
    held = reader.hold_async(reader.keys_for(tokens(N)))
    try:
        assert held.rows == list(range(N // 16)) and held.load is not None
        assert held.wait_layer(0, timeout=30), "layer 0 never came"
        assert gate.held_back.wait(30)
        assert not held.load.done() and not held.wait_layer(1, timeout=0.05)  # layer 1 is still being read
        got = layer_out(held, 0)  # copied out now, while the read goes on
        for row, w in enumerate(want):
            assert np.array_equal(got[row], w[:LB])
        assert reader.stats()["layers_copied_early"] == 1
        gate.open()
        assert held.tiers == ["shared"] * len(want)
        for layer in range(GEOM.num_layers):
            got = layer_out(held, layer)
            for row, w in enumerate(want):
                assert np.array_equal(got[row], w[layer * LB:(layer + 1) * LB])
    finally:
        gate.open()
        held.release()
    # the hits joined the pinned tier: the next hold reads nothing
    again = reader.hold_async(reader.keys_for(tokens(N)))
    with again:
        assert again.load is not None and again.load.done() and again.tiers == ["pinned"] * len(want)
    assert reader.pinned.leased == 0


def test_a_later_layer_that_fails_verification_misses_its_chunk_only(
        stores: tuple[KVCacheStore, KVCacheStore], tmp_path: Path) -> None:
    writer, reader = stores
    want = stored(writer)
    first, second = files(tmp_path)  # (sorted by name: which chunk is which does not matter)
    hb = chunk_header_bytes(GEOM, CHUNK // 16)
    with open(second, "r+b") as f:  # a byte of layer 2 of the file's first block
        f.seek(hb + 2 * (CHUNK // 16) * LB + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    keys = reader.keys_for(tokens(N))
    with reader.hold_async(keys, parts=2) as held:
        for layer in range(GEOM.num_layers):  # every layer of every row is announced or ended
            assert held.wait_layer(layer, timeout=30)
        tiers = held.tiers
    assert sorted(tiers, key=str) == [None] * 4 + ["shared"] * 4  # one chunk's four blocks
    assert reader.stats()["corrupt_dropped"] == 4 and not second.exists() and first.exists()
    assert reader.pinned.leased == 0
    # the missed blocks are stored again by the next put, then hit
    writer.put(keys, want)
    writer.wait_for_puts()
    other = KVCacheStore(GEOM, model_id="layers", shared_dir=tmp_path / "shared", chunk_tokens=CHUNK,
                         pinned_bytes=64 * GEOM.block_bytes, io_timeout_ms=0)
    with other, other.hold_async(other.keys_for(tokens(N))) as held:
        assert held.tiers == ["shared"] * 8
        got = layer_out(held, 3)
        assert all(np.array_equal(got[r], w[3 * LB:]) for r, w in enumerate(want))


def test_pinned_shared_and_absent_blocks_in_one_hold(stores: tuple[KVCacheStore, KVCacheStore]) -> None:
    writer, reader = stores
    want = stored(writer, 16 * 4)
    keys = reader.keys_for(tokens(16 * 4))
    reader.get_into(keys[:1], [np.zeros(GEOM.block_bytes, np.uint8)])  # block 0 now in the pinned tier
    absent = reader.keys_for(tokens(16 * 2, salt=9))
    with reader.hold_async([*keys, *absent], count=True) as held:
        assert held.tiers == ["pinned", "shared", "shared", "shared", None, None]
        got = layer_out(held, 1)
        for row in range(4):
            assert np.array_equal(got[row], want[row][LB:2 * LB])
    s = reader.stats()
    assert s["hits_shared"] == 3 + 1 and s["misses"] == 2  # (the get above counted its own hit)
    assert s["hits_pinned"] == 1 and s["gets"] == 1 + 6


def test_releasing_before_the_reads_end_leaks_no_slot(stores: tuple[KVCacheStore, KVCacheStore],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = stores
    stored(writer)
    gate = LayerGate(monkeypatch)
    held = reader.hold_async(reader.keys_for(tokens(N)))
    assert gate.held_back.wait(30)
    held.release()  # the reads still hold their own leases on the slots
    with pytest.raises(errors.InvalidRequestError):
        layer_out(held, 0)
    gate.open()
    assert held.load is not None and held.load.wait(30)
    reader.wait_for_puts()
    assert reader.pinned.leased == 0 and reader.pinned_count(reader.keys_for(tokens(N))) == N // 16


@pytest.mark.parametrize("parts", [0, -1, 1.5, True, "2"])
def test_hold_async_refuses_a_bad_number_of_parts(stores: tuple[KVCacheStore, KVCacheStore], parts: Any) -> None:
    _writer, reader = stores
    with pytest.raises(errors.InvalidRequestError):
        reader.hold_async([], parts=parts)


def test_wait_layer_refuses_a_negative_timeout(stores: tuple[KVCacheStore, KVCacheStore]) -> None:
    writer, reader = stores
    stored(writer, 16)
    with reader.hold_async(reader.keys_for(tokens(16))) as held, pytest.raises(errors.InvalidRequestError):
        held.wait_layer(0, timeout=-1)


def test_a_read_stalled_after_its_first_layer_ends_at_the_deadline_as_misses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled mount mid-read: layer 0 came, the rest never does. Past the tier's deadline every row is a miss
    (the caller recomputes), nothing waits on the stalled read, and its slots come back once it returns."""
    kw: dict[str, Any] = {"model_id": "stall", "shared_dir": tmp_path / "shared", "chunk_tokens": CHUNK}
    with KVCacheStore(GEOM, pinned_bytes=0, io_timeout_ms=0, **kw) as writer:
        stored(writer)
    with KVCacheStore(GEOM, pinned_bytes=64 * GEOM.block_bytes, io_timeout_ms=300, **kw) as reader:
        gate = LayerGate(monkeypatch)
        try:
            held = reader.hold_async(reader.keys_for(tokens(N)))
            assert held.wait_layer(0, timeout=30)
            assert held.load is not None and held.load.wait(30), "the read was not abandoned at its deadline"
            assert held.tiers == [None] * (N // 16)
            assert held.wait_layer(GEOM.num_layers - 1, timeout=0)  # every row has ended: no wait
            layer_out(held, 1)  # copies what the slots hold, without waiting (the caller recomputes these)
            held.release()
            assert reader.stats()["deadline_misses"] >= 1 and reader.pinned_count(reader.keys_for(tokens(N))) == 0
        finally:
            gate.open()
        deadline = time.monotonic() + 30
        while reader.pinned.leased and time.monotonic() < deadline:  # the abandoned read returns, then lets go
            time.sleep(0.05)
        assert reader.pinned.leased == 0
