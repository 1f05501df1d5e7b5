"""The KV cache's get contract with real damaged tiers: a block that fails verification or cannot be read is a miss
for that key alone, counted, and the caller's destination for it is left byte for byte as it was.

Guards issue #14 defect 7 (a corrupt shared file overwrote the caller's buffer before it was found bad; a
directory, FIFO or escaping symlink at one block's path failed, or hung, the whole batch) and the KV/block-store
part of defect 8 (blocks of the wrong dtype, shape or size accepted; bad arguments answered with untyped errors).
Every damage is made on the real files and the real block store image: flipped bits, a truncated file, another
key's file, a directory, a FIFO, a symlink to a (valid) copy outside the shared directory, a flipped bit in the
block store's slot.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import run_bounded

from sfstore import errors
from sfstore.blocks import BlockStore
from sfstore.buffers import RegisteredBufferPool
from sfstore.kvcache import KVCacheStore, KVGeometry

torch = pytest.importorskip("torch")

GEOM = KVGeometry(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")  # 16 KiB blocks
SECONDS = 20.0  # a get that takes longer than this hangs


def blocks(n: int, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(GEOM.block_shape, generator=g).to(torch.bfloat16) for _ in range(n)]


def sentinel(n: int) -> list[Any]:
    """Destinations holding a recognisable pattern (not zeros: a zeroed buffer must not pass for untouched)."""
    return [torch.full(GEOM.block_shape, 1.5 + i, dtype=torch.bfloat16) for i in range(n)]


def raw(t: Any) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def bounded(fn: Callable[[], Any], fifo: Path | None = None) -> Any:
    """``fn()`` in a thread; a hang past ``SECONDS`` fails the test (after opening ``fifo`` released it)."""
    return run_bounded(fn, SECONDS, [] if fifo is None else [fifo])


def shared_file(shared: Path, key: bytes) -> Path:
    h = key.hex()
    return shared / h[:2] / f"{h}.kvb"


# -- the damage -------------------------------------------------------------------------------------------------
def flip_body(path: Path, _other: Path, _outside: Path) -> None:
    data = bytearray(path.read_bytes())
    data[4096 + 777] ^= 0x10
    path.write_bytes(bytes(data))


def flip_header(path: Path, _other: Path, _outside: Path) -> None:
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01  # inside the key field
    path.write_bytes(bytes(data))


def truncate(path: Path, _other: Path, _outside: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(4096 + GEOM.block_bytes - 100)


def empty_file(path: Path, _other: Path, _outside: Path) -> None:
    path.write_bytes(b"")


def too_long(path: Path, _other: Path, _outside: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)


def other_keys_file(path: Path, other: Path, _outside: Path) -> None:
    shutil.copyfile(other, path)  # a whole, valid block file, but of another key


def directory(path: Path, _other: Path, _outside: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "x").write_bytes(b"y")


def fifo(path: Path, _other: Path, _outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def symlink_out(path: Path, _other: Path, outside: Path) -> None:
    # A symlink to a byte-identical, valid copy of this very block outside the shared directory: the content
    # would verify, so only refusing to leave the directory makes it a miss.
    copy = outside / path.name
    shutil.copyfile(path, copy)
    path.unlink()
    path.symlink_to(copy)


DAMAGE: dict[str, tuple[Callable[[Path, Path, Path], None], str]] = {
    # name: (how, the counter that must count it)
    "flipped-body-bit": (flip_body, "corrupt_dropped"),
    "flipped-header-bit": (flip_header, "corrupt_dropped"),
    "truncated": (truncate, "corrupt_dropped"),
    "empty": (empty_file, "corrupt_dropped"),
    "too-long": (too_long, "corrupt_dropped"),
    "another-keys-file": (other_keys_file, "corrupt_dropped"),
    "directory": (directory, "unreadable"),
    "fifo": (fifo, "unreadable"),
    "symlink-out-of-the-root": (symlink_out, "unreadable"),
}

# (pinned tier, block store) of each configuration; the shared tier is always there
CONFIGS = {
    "no-pinned-shared-only": (False, False),
    "no-pinned-block-and-shared": (False, True),
    "pinned-shared-only": (True, False),
    "pinned-block-and-shared": (True, True),
}


@pytest.fixture(params=["openat2", "walk"])
def make_store(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[bool, bool], KVCacheStore]]:
    """Stores over real tiers; ``walk``: as on a kernel without openat2 (before 5.6), where the shared tier
    resolves names with a walk of directory descriptors."""
    if request.param == "walk":
        import sfstore.paths.beneath as beneath

        for name in ("_open_at", "_open_many", "_stat_many"):  # a tier's lookups beneath its directory
            monkeypatch.setattr(beneath, name, None)
        monkeypatch.setattr(beneath, "_native_openat2", lambda: None)
    # No deadlines: on a loaded machine (a full CI run's disk traffic) a 500 ms deadline can be missed, the tier
    # quarantined and a put dropped, which is not what these tests are about (tests/kvcache/test_kvcache_deadlines.py
    # is); a hang still fails the test through bounded().
    monkeypatch.setenv("SFSTORE_KVCACHE_IO_TIMEOUT_MS", "0")
    made: list[Any] = []

    def make(pinned: bool, block: bool) -> KVCacheStore:
        bs = None
        if block:
            bs = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 8 << 20},
                            size_classes=(GEOM.block_bytes,))
            made.append(bs)
        # a file per block: the damage is made at one block's file (chunk files: tests/kvcache/test_kvcache_chunks)
        kv = KVCacheStore(GEOM, model_id="contract", pinned_bytes=(16 * (GEOM.block_bytes + 4096)) if pinned else 0,
                          block_store=bs, shared_dir=tmp_path / "shared", chunk_tokens=0)
        made.insert(0, kv)
        return kv

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_bad_shared_block_misses_alone_and_leaves_its_destination_as_it_was(
    make_store: Callable[[bool, bool], KVCacheStore], tmp_path: Path, config: str, damage: str
) -> None:
    pinned, block = CONFIGS[config]
    kv = make_store(pinned, block)
    keys = kv.keys_for(range(16 * 4))
    src = blocks(4, seed=3)
    kv.put(keys, src)
    kv.wait_for_puts()
    bad = 1
    shared = tmp_path / "shared"
    outside = tmp_path / "outside"
    outside.mkdir()
    kv.evict(keys, tiers=("pinned",))
    if block:
        kv.evict([keys[bad]], tiers=("block",))  # the others come from the block tier, the bad one from shared
    how, counter = DAMAGE[damage]
    path = shared_file(shared, keys[bad])
    how(path, shared_file(shared, keys[0]), outside)
    dst = sentinel(4)
    before = [raw(d) for d in dst]
    before_stats = kv.stats()

    tiers = bounded(lambda: kv.get_into(keys, dst), path)

    good_tier = "block" if block else "shared"
    assert tiers == [good_tier, None, good_tier, good_tier]
    assert raw(dst[bad]) == before[bad], "the destination of a missed key was overwritten"
    for i in (0, 2, 3):
        assert torch.equal(dst[i], src[i]) and raw(dst[i]) == raw(src[i])
    st = kv.stats()
    assert st["misses"] - before_stats["misses"] == 1
    assert st[counter] - before_stats[counter] == 1
    other = "unreadable" if counter == "corrupt_dropped" else "corrupt_dropped"
    assert st[other] == before_stats[other]
    # nothing outside the shared directory was touched
    assert sorted(p.name for p in outside.iterdir()) == ([path.name] if damage == "symlink-out-of-the-root" else [])
    if damage == "symlink-out-of-the-root":
        assert (outside / path.name).read_bytes()[:8] == b"SFKVBLK1"
    # the key stays a miss (never a wrong hit), and a put of the block publishes it again where it can
    assert bounded(lambda: kv.get_into([keys[bad]], dst[bad:bad + 1]), path) == [None]
    assert raw(dst[bad]) == before[bad]
    if damage != "directory":  # a directory at a key's path is not the tier's to remove
        kv.evict([keys[bad]], tiers=("block",))
        kv.put([keys[bad]], [src[bad]])
        kv.wait_for_puts()
        kv.evict([keys[bad]], tiers=("pinned", "block"))
        again = sentinel(1)
        assert bounded(lambda: kv.get_into([keys[bad]], again), path) == ["shared"]
        assert torch.equal(again[0], src[bad])


def corrupt_block_slot(store: BlockStore, key: bytes) -> None:
    loc = store.locate(key)
    assert loc is not None
    with RegisteredBufferPool(4096) as pool:
        buf = pool.acquire()
        try:
            at = loc[0] + store.layout.header_bytes + 4096  # a sector inside the value
            store.path.read_into(at, buf, 4096)
            memoryview(buf)[7:8] = bytes([memoryview(buf)[7] ^ 0x04])
            store.path.write(at, buf, 4096)
        finally:
            buf.release()


@pytest.mark.parametrize("pinned", [False, True], ids=["no-pinned", "pinned"])
def test_a_corrupt_block_store_slot_misses_alone_and_leaves_its_destination_as_it_was(
    make_store: Callable[[bool, bool], KVCacheStore], pinned: bool
) -> None:
    kv = make_store(pinned, True)
    assert kv.block is not None
    keys = kv.keys_for(range(16 * 3))
    src = blocks(3, seed=4)
    kv.put(keys, src)
    kv.wait_for_puts()
    kv.evict(keys, tiers=("pinned",))
    kv.evict([keys[1]], tiers=("shared",))  # only the (corrupt) block tier has it
    corrupt_block_slot(kv.block, keys[1])
    dst = sentinel(3)
    before = [raw(d) for d in dst]
    assert bounded(lambda: kv.get_into(keys, dst)) == ["block", None, "block"]
    assert raw(dst[1]) == before[1], "the destination of a corrupt block-store value was overwritten"
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])
    st = kv.stats()
    assert st["misses"] == 1 and st["corrupt_dropped"] == 1
    assert kv.block.stats()["corrupt_dropped"] == 1 and not kv.block.contains(keys[1])


def two_blocks_stored(
    make_store: Callable[[bool, bool], KVCacheStore], seed: int
) -> tuple[KVCacheStore, list[bytes], list[Any]]:
    """A store of a block tier and the shared tier (no pinned tier) holding ``blocks(2, seed)`` in both: the
    store, the keys, the blocks."""
    kv = make_store(False, True)
    assert kv.block is not None
    keys = kv.keys_for(range(16 * 2))
    src = blocks(2, seed=seed)
    kv.put(keys, src)
    return kv, keys, src


def test_a_corrupt_block_slot_falls_through_to_a_good_shared_copy(
    make_store: Callable[[bool, bool], KVCacheStore]
) -> None:
    kv, keys, src = two_blocks_stored(make_store, seed=5)
    corrupt_block_slot(kv.block, keys[0])
    dst = sentinel(2)
    assert kv.get_into(keys, dst) == ["shared", "block"]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])


@pytest.mark.parametrize("kwargs", [
    {"size_classes": 5}, {"size_classes": "4096"}, {"lock_timeout": math.nan}, {"lock_timeout": -1},
    {"lock_timeout": math.inf}, {"lock_timeout": "1"}, {"capacity": -1}, {"capacity": "8M"}, {"on_evict": 3},
], ids=lambda kw: repr(kw))
def test_block_store_bad_constructor_arguments_are_typed(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(errors.SfstoreError):
        BlockStore({"kind": "image", "path": str(tmp_path / "c.img"), "size": 8 << 20}, format=True, **kwargs)


def test_block_store_get_into_keep_on_miss_leaves_a_corrupt_values_buffer(tmp_path: Path) -> None:
    with BlockStore({"kind": "image", "path": str(tmp_path / "b.img"), "size": 8 << 20},
                    size_classes=(64 << 10,)) as store:
        value = os.urandom(64 << 10)
        store.put_many({"a": value, "b": value[::-1]})
        corrupt_block_slot(store, b"a")
        dests = [np.full(64 << 10, 7, np.uint8), np.zeros(64 << 10, np.uint8)]
        assert store.get_into(["a", "b"], dests, keep_on_miss=True) == [None, 64 << 10]
        assert (dests[0] == 7).all() and dests[1].tobytes() == value[::-1]


# -- what a block must be ------------------------------------------------------------------------------------------
BAD_BLOCKS: dict[str, Callable[[], Any]] = {
    "numpy int16 for bfloat16": lambda: np.zeros(GEOM.block_bytes // 2, np.int16),
    "numpy float16 for bfloat16": lambda: np.zeros(GEOM.block_bytes // 2, np.float16),
    "torch int16 for bfloat16": lambda: torch.zeros(GEOM.block_shape, dtype=torch.int16),
    "torch float16 for bfloat16": lambda: torch.zeros(GEOM.block_shape, dtype=torch.float16),
    "torch uint8 of block_bytes": lambda: torch.zeros(GEOM.block_bytes, dtype=torch.uint8),
    "torch transposed shape": lambda: torch.zeros(tuple(reversed(GEOM.block_shape)), dtype=torch.bfloat16),
    "torch 2-D of the right count": lambda: torch.zeros((2, GEOM.block_bytes // 4), dtype=torch.bfloat16),
    "torch one element short": lambda: torch.zeros(GEOM.block_bytes // 2 - 1, dtype=torch.bfloat16),
    "torch one element over": lambda: torch.zeros(GEOM.block_bytes // 2 + 1, dtype=torch.bfloat16),
    "torch meta device": lambda: torch.zeros(GEOM.block_shape, dtype=torch.bfloat16, device="meta"),
    "torch sparse": lambda: torch.zeros(GEOM.block_shape, dtype=torch.bfloat16).to_sparse(),
    "numpy one element short": lambda: np.zeros(GEOM.block_bytes // 2 - 1, np.uint16),
    "numpy 2-D uint16": lambda: np.zeros((2, GEOM.block_bytes // 4), np.uint16),
    "numpy non-contiguous": lambda: np.zeros(GEOM.block_bytes, np.uint16)[::2],
    "bytearray one byte short": lambda: bytearray(GEOM.block_bytes - 1),
    "bytearray one byte over": lambda: bytearray(GEOM.block_bytes + 1),
    "not a buffer": lambda: object(),
    "a str": lambda: "x" * GEOM.block_bytes,
    "None": lambda: None,
}


@pytest.mark.parametrize("pinned", [False, True], ids=["no-pinned", "pinned"])
@pytest.mark.parametrize("what", list(BAD_BLOCKS))
def test_a_block_that_does_not_match_the_geometry_is_refused_naming_it(
    make_store: Callable[[bool, bool], KVCacheStore], pinned: bool, what: str
) -> None:
    kv = make_store(pinned, True)
    keys = kv.keys_for(range(16 * 3))
    good = blocks(3, seed=6)
    kv.put(keys[:2], good[:2])
    bad = BAD_BLOCKS[what]()
    with pytest.raises(errors.InvalidRequestError, match=r"block 1\b") as info:
        kv.put(keys, [good[0], bad, good[2]])
    assert any(w in str(info.value) for w in ("bfloat16", "bytes", "device", "contiguous"))  # says what is expected
    if what != "torch meta device":
        with pytest.raises((errors.InvalidRequestError, errors.ReadOnlyBufferError), match=r"block 1\b"):
            kv.get_into(keys, [torch.zeros(GEOM.block_shape, dtype=torch.bfloat16), bad, good[2].clone()])
    assert not kv.contains(keys[2])  # nothing of the refused put was stored
    assert kv.stats()["puts"] == 2


def test_error_names_the_expected_and_the_given_dtype_shape_and_bytes(
    make_store: Callable[[bool, bool], KVCacheStore]
) -> None:
    kv = make_store(False, False)
    keys = kv.keys_for(range(16))
    with pytest.raises(errors.InvalidRequestError) as info:
        kv.put(keys, [np.zeros(GEOM.block_bytes // 2, np.int16)])
    msg = str(info.value)
    assert "block 0" in msg and "int16" in msg and "bfloat16" in msg and "uint16" in msg
    with pytest.raises(errors.InvalidRequestError) as info:
        kv.put(keys, [torch.zeros((2, 2), dtype=torch.bfloat16)])
    msg = str(info.value)
    assert "(2, 2)" in msg and str(GEOM.block_shape) in msg and str(GEOM.block_bytes) in msg and "8 bytes" in msg


def test_accepted_block_forms_round_trip(make_store: Callable[[bool, bool], KVCacheStore]) -> None:
    """What stays accepted: torch of the geometry's dtype (block shape or flat, any strides for torch), numpy
    uint16 carrying bfloat16 bits (numpy has no bfloat16), numpy uint8 and byte buffers of block_bytes."""
    kv = make_store(False, True)
    keys = kv.keys_for(range(16 * 5))
    src = blocks(1, seed=7)[0]
    raw_src = raw(src)
    forms: list[Any] = [
        src.clone(),
        src.clone().reshape(-1),
        np.frombuffer(raw_src, np.uint16).copy(),
        np.frombuffer(raw_src, np.uint8).copy(),
        bytearray(raw_src),
    ]
    kv.put(keys, forms)
    outs: list[Any] = [torch.zeros(GEOM.block_shape, dtype=torch.bfloat16),
                       torch.zeros(GEOM.block_bytes // 2, dtype=torch.bfloat16),
                       np.zeros(GEOM.block_bytes // 2, np.uint16), np.zeros(GEOM.block_bytes, np.uint8),
                       bytearray(GEOM.block_bytes)]
    assert kv.get_into(keys, outs) == ["block"] * 5
    for o in outs:
        data = raw(o) if isinstance(o, torch.Tensor) else bytes(memoryview(o).cast("B"))
        assert data == raw_src
    # a torch view of the block's shape with other strides (a slice of a larger cache) moves too
    wide = torch.zeros((*GEOM.block_shape[:-1], 2 * GEOM.head_dim), dtype=torch.bfloat16)
    strided = wide[..., ::2]
    assert strided.shape == GEOM.block_shape and not strided.is_contiguous()
    assert kv.get_into(keys[:1], [strided]) == ["block"] and torch.equal(strided, src)


# -- the other arguments ---------------------------------------------------------------------------------------------
def test_bad_arguments_are_typed(make_store: Callable[[bool, bool], KVCacheStore], tmp_path: Path) -> None:
    kv = make_store(True, True)
    keys = kv.keys_for(range(32))
    two = blocks(2, seed=8)
    cases: list[tuple[str, Callable[[], Any], type[BaseException]]] = [
        ("keys not a sequence", lambda: kv.put(42, two), errors.InvalidRequestError),  # type: ignore[arg-type]
        ("blocks not a sequence", lambda: kv.put(keys, 42), errors.InvalidRequestError),  # type: ignore[arg-type]
        ("a key of 31 bytes", lambda: kv.get_into([keys[0][:31], keys[1]], two), errors.InvalidKeyError),
        ("a str key", lambda: kv.contains("k" * 32), errors.InvalidKeyError),  # type: ignore[arg-type]
        ("None key", lambda: kv.evict([None]), errors.InvalidKeyError),  # type: ignore[list-item]
        ("more keys than blocks", lambda: kv.get_into(keys, two[:1]), errors.InvalidRequestError),
        ("read-only destination", lambda: kv.get_into(keys[:1], [bytes(GEOM.block_bytes)]), errors.ReadOnlyBufferError),
        ("read-only numpy", lambda: kv.get_into(keys[:1], [_readonly()]), errors.ReadOnlyBufferError),
        ("negative timeout", lambda: kv.wait_for_puts(-1), errors.InvalidRequestError),
        ("NaN timeout", lambda: kv.wait_for_puts(math.nan), errors.InvalidRequestError),
        ("a tier name as a str", lambda: kv.evict(keys, tiers="pinned"), errors.InvalidRequestError),
        ("tiers not iterable", lambda: kv.evict(keys, tiers=3), errors.InvalidRequestError),  # type: ignore[arg-type]
        ("a layer that is not an int", lambda: kv.put_layer(keys[:1], 0.5, [two[0][0]]),  # type: ignore[arg-type]
         errors.InvalidRequestError),
        ("negative pinned_bytes", lambda: KVCacheStore(GEOM, pinned_bytes=-1), errors.InvalidRequestError),
        ("pinned_bytes a str", lambda: KVCacheStore(GEOM, pinned_bytes="8M"),  # type: ignore[arg-type]
         errors.InvalidRequestError),
        ("model_id not a str", lambda: KVCacheStore(GEOM, model_id=7, pinned_bytes=0),  # type: ignore[arg-type]
         errors.InvalidRequestError),
        ("geometry not a KVGeometry", lambda: KVCacheStore("llama", pinned_bytes=0),  # type: ignore[arg-type]
         errors.InvalidRequestError),
        ("a huge geometry", lambda: KVGeometry(num_layers=1 << 40, block_tokens=1 << 20, num_kv_heads=1,
                                               head_dim=128), errors.InvalidRequestError),
        ("token ids of floats", lambda: kv.keys_for([0.5] * 16), errors.InvalidRequestError),
        ("token ids a str", lambda: kv.keys_for("hello"), errors.InvalidRequestError),
        ("prefetch of a bad key", lambda: kv.prefetch([b"x"]), errors.InvalidKeyError),
        ("extra not iterable", lambda: kv.keys_for(range(16), extra=5), errors.InvalidRequestError),  # type: ignore[arg-type]
        ("a sparse layer", lambda: kv.put_layer(keys[:1], 0, [two[0][0].to_sparse()]), errors.InvalidRequestError),
    ]
    failed = []
    for name, call, exc in cases:
        try:
            call()
        except exc:
            continue
        except BaseException as other:
            failed.append(f"{name}: {type(other).__name__}: {other}")
            continue
        failed.append(f"{name}: no error")
    assert not failed, "\n".join(failed)
    # empty batches are a valid no-op
    assert kv.get_into([], []) == [] and kv.put([], []) is None and kv.evict([]) == 0
    assert kv.prefetch([]).get(timeout=10) == []
    assert kv.stats()["puts"] == 0


def _readonly() -> Any:
    a = np.zeros(GEOM.block_bytes // 2, np.uint16)
    a.flags.writeable = False
    return a


def test_a_closed_store_refuses_every_call_with_a_typed_error(make_store: Callable[[bool, bool], KVCacheStore]) -> None:
    kv = make_store(True, False)
    keys = kv.keys_for(range(16))
    kv.close()
    for call in (lambda: kv.put(keys, blocks(1, 0)), lambda: kv.get_into(keys, sentinel(1)),
                 lambda: kv.contains(keys[0]), lambda: kv.lookup(range(16)), lambda: kv.evict(keys),
                 lambda: kv.prefetch(keys), lambda: kv.put_async(keys, blocks(1, 0))):
        with pytest.raises(errors.InvalidRequestError, match="closed"):
            call()


def test_keep_on_miss_false_reads_straight_into_the_destination(
    make_store: Callable[[bool, bool], KVCacheStore]
) -> None:
    """The opt-out for callers that recompute misses: no staging copy, hits still verified bit for bit."""
    kv, keys, src = two_blocks_stored(make_store, seed=9)
    kv.evict([keys[1]], tiers=("shared",))
    corrupt_block_slot(kv.block, keys[1])
    dst = sentinel(2)
    assert kv.get_into(keys, dst, keep_on_miss=False) == ["block", None]
    assert torch.equal(dst[0], src[0])
    assert kv.stats()["corrupt_dropped"] == 1
