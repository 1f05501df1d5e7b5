"""The shared tier's chunk files (``kvcache_chunk_tokens``): a hit opens a file per chunk, not per block; partial
chunks, prompts that share a chunk's first blocks, damaged files, old block files, and hostile names.

Writer and reader are separate stores on one directory (the reader knows nothing but the prompt's tokens, as
another process or node would): every hit below comes from the files."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sfstore import defaults, errors
from sfstore.kvcache import KVCacheStore
from sfstore.kvcache.shared_chunks import chunk_header_bytes
from tests.kvcache.conftest import GEOM

CHUNK = 64  # tokens: 4 blocks of 16
PER = CHUNK // GEOM.block_tokens


def blocks(tokens: list[int]) -> list[np.ndarray]:
    """The blocks of a prompt: each block's bytes follow from its tokens (two prompts that share a block share
    its bytes)."""
    out = []
    for b in range(len(tokens) // GEOM.block_tokens):
        seed = hash(tuple(tokens[:(b + 1) * GEOM.block_tokens])) & 0xFFFFFFFF
        out.append(np.random.default_rng(seed).integers(0, 256, GEOM.block_bytes, dtype=np.uint8))
    return out


pytestmark = pytest.mark.usefixtures("read_whole")  # (conftest: both ways a chunk file is read)


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[object]:
    made: list[KVCacheStore] = []

    def make(**kw: object) -> KVCacheStore:
        kw.setdefault("pinned_bytes", 0)
        kw.setdefault("chunk_tokens", CHUNK)
        kw.setdefault("io_timeout_ms", 0)
        kv = KVCacheStore(GEOM, model_id="chunks", shared_dir=tmp_path / "shared", **kw)  # type: ignore[arg-type]
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.close()


def put(kv: KVCacheStore, tokens: list[int]) -> list[bytes]:
    keys = kv.keys_for(tokens)
    kv.put(keys, blocks(tokens))
    kv.wait_for_puts()
    return keys


def get(kv: KVCacheStore, tokens: list[int]) -> list[str | None]:
    """Read the prompt's blocks; every hit must be the prompt's bytes."""
    keys = kv.keys_for(tokens)
    dests = [np.full(GEOM.block_bytes, 7, np.uint8) for _ in keys]
    tiers = kv.get_into(keys, dests)
    want = blocks(tokens)
    for t, d, w in zip(tiers, dests, want, strict=True):
        assert np.array_equal(d, w) if t is not None else (d == 7).all()
    return tiers


def files(tmp_path: Path, suffix: str = ".kvc") -> list[Path]:
    return sorted(p for p in (tmp_path / "shared").rglob(f"*{suffix}") if not p.name.startswith("."))


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(salt * 100_003 + t * 7919) % 32000 for t in range(n)]


@pytest.mark.parametrize("n", [16 * 4, 16 * 11, 16 * 24])
def test_a_cold_hit_opens_a_file_per_chunk(open_store: object, tmp_path: Path, n: int) -> None:
    writer = open_store()  # type: ignore[operator]
    put(writer, tokens(n))
    assert len(files(tmp_path)) == math.ceil(n / CHUNK) and not files(tmp_path, ".kvb")
    reader = open_store()  # type: ignore[operator]
    assert reader.lookup(tokens(n)) == n
    opens = reader.stats()["shared_opens"]
    assert get(reader, tokens(n)) == ["shared"] * (n // 16)
    assert reader.stats()["shared_opens"] - opens <= math.ceil(n / CHUNK) + 1
    # the same prompt a file per block opens a file per block
    old = KVCacheStore(GEOM, model_id="chunks", pinned_bytes=0, shared_dir=tmp_path / "blocks", chunk_tokens=0)
    try:
        keys = old.keys_for(tokens(n))
        old.put(keys, blocks(tokens(n)))
        got = old.get_into(keys, [np.zeros(GEOM.block_bytes, np.uint8) for _ in keys])
        assert got == ["shared"] * (n // 16) and old.stats()["shared_opens"] == n // 16
    finally:
        old.close()


def test_a_chunk_file_is_layer_major_with_a_checksum_per_block_and_layer(open_store: object, tmp_path: Path) -> None:
    writer = open_store()  # type: ignore[operator]
    keys = put(writer, tokens(64))
    (f,) = files(tmp_path)
    assert f.name == f"{keys[3].hex()}.{PER}.{PER}.kvc"
    raw = f.read_bytes()
    hb = chunk_header_bytes(GEOM, PER)
    assert len(raw) == hb + PER * GEOM.block_bytes
    lb = GEOM.layer_bytes
    bs = blocks(tokens(64))
    for layer in range(GEOM.num_layers):  # layer l of the run: one range, block after block
        for k in range(PER):
            at = hb + (layer * PER + k) * lb
            assert raw[at:at + lb] == bs[k].tobytes()[layer * lb:(layer + 1) * lb]


def test_a_partial_last_chunk_is_a_shorter_run_replaced_when_the_prompt_grows(open_store: object,
                                                                               tmp_path: Path) -> None:
    writer = open_store(pinned_bytes=64 * (GEOM.block_bytes + 4096))  # type: ignore[operator]
    put(writer, tokens(16 * 6))  # a chunk of 4 and a run of 2
    assert sorted(f.name.split(".", 1)[1] for f in files(tmp_path)) == [f"{PER}.2.kvc", f"{PER}.{PER}.kvc"]
    reader = open_store()  # type: ignore[operator]
    assert get(reader, tokens(16 * 6)) == ["shared"] * 6
    # the prompt grows (the engine's next step): the longer run replaces the shorter one
    keys = writer.keys_for(tokens(16 * 7))
    writer.put(keys[6:], blocks(tokens(16 * 7))[6:])  # the chunk's first blocks come from the pinned tier
    writer.wait_for_puts()
    assert sorted(f.name.split(".", 1)[1] for f in files(tmp_path)) == [f"{PER}.3.kvc", f"{PER}.{PER}.kvc"]
    assert not files(tmp_path, ".kvb")
    reader2 = open_store()  # type: ignore[operator]
    assert get(reader2, tokens(16 * 7)) == ["shared"] * 7
    assert reader2.lookup(tokens(16 * 7 + 5)) == 16 * 7


def test_a_prompt_sharing_a_chunks_first_blocks_finds_them(open_store: object, tmp_path: Path) -> None:
    writer = open_store()  # type: ignore[operator]
    long = tokens(16 * 8)
    put(writer, long)
    links = list((tmp_path / "shared").rglob("*.first"))
    assert len(links) == 2 and all(link.resolve() in files(tmp_path) for link in links)  # a valid path too
    # a shorter prompt (its runs are not there: the link of the chunk leads to the longer run)
    reader = open_store()  # type: ignore[operator]
    assert reader.lookup(long[:16 * 6]) == 16 * 6
    assert get(reader, long[:16 * 6]) == ["shared"] * 6
    # a prompt that differs after 6 blocks: the first 6 are found, the rest miss (not stored)
    other = long[:16 * 6 + 3] + [31999] * 13 + tokens(16, salt=5)
    reader2 = open_store()  # type: ignore[operator]
    opens = reader2.stats()["shared_opens"]
    assert reader2.lookup(other) == 16 * 6
    assert get(reader2, other) == ["shared"] * 6 + [None] * 2
    assert reader2.stats()["shared_opens"] - opens <= math.ceil(6 * 16 / CHUNK) + 1 + 1  # lookup's header read
    # once that prompt is stored, it finds its own blocks (the link stays with the first run written)
    put(reader2, other)
    reader3 = open_store()  # type: ignore[operator]
    assert get(reader3, other) == ["shared"] * 8 and get(reader3, long) == ["shared"] * 8


def test_blocks_without_their_chunks_first_blocks_are_block_files(open_store: object, tmp_path: Path) -> None:
    writer = open_store()  # type: ignore[operator]
    t = tokens(16 * 8)
    keys = writer.keys_for(t)
    writer.put(keys[5:], blocks(t)[5:])  # the second chunk's first block is missing: no run can start
    assert not files(tmp_path) and len(files(tmp_path, ".kvb")) == 3
    reader = open_store()  # type: ignore[operator]
    got = get(reader, t)
    assert got == [None] * 5 + ["shared"] * 3 and reader.lookup(t) == 0


def test_block_files_of_the_per_block_format_are_still_read(open_store: object, tmp_path: Path) -> None:
    old = open_store(chunk_tokens=0)  # type: ignore[operator]
    put(old, tokens(16 * 5))
    assert len(files(tmp_path, ".kvb")) == 5 and not files(tmp_path)
    reader = open_store()  # type: ignore[operator]
    assert reader.lookup(tokens(16 * 5)) == 16 * 5
    assert get(reader, tokens(16 * 5)) == ["shared"] * 5


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted", "header"])
def test_a_damaged_chunk_misses_alone_and_is_written_again(open_store: object, tmp_path: Path, damage: str) -> None:
    writer = open_store()  # type: ignore[operator]
    t = tokens(16 * 12)
    keys = put(writer, t)
    victim = next(f for f in files(tmp_path) if f.name.startswith(keys[7].hex()))  # the second chunk
    raw = bytearray(victim.read_bytes())
    if damage == "flipped":
        raw[-100] ^= 1
        victim.write_bytes(bytes(raw))
    elif damage == "truncated":
        victim.write_bytes(bytes(raw[:-4096]))
    elif damage == "header":
        raw[200] ^= 1
        victim.write_bytes(bytes(raw))
    else:
        victim.unlink()
    reader = open_store()  # type: ignore[operator]
    assert get(reader, t) == ["shared"] * 4 + [None] * 4 + ["shared"] * 4
    assert reader.stats()["corrupt_dropped"] == (0 if damage == "deleted" else 4)
    assert not victim.exists()  # a damaged file is removed: the next put writes it again
    put(reader, t)
    assert get(open_store(), t) == ["shared"] * 12  # type: ignore[operator]


def test_what_is_at_a_chunks_name_is_never_followed_out(open_store: object, tmp_path: Path) -> None:
    writer = open_store()  # type: ignore[operator]
    t = tokens(16 * 4)
    keys = put(writer, t)
    (f,) = files(tmp_path)
    outside = tmp_path / "outside.kvc"
    f.rename(outside)
    f.symlink_to(outside)  # a valid copy, outside the directory
    reader = open_store()  # type: ignore[operator]
    assert get(reader, t) == [None] * 4
    assert outside.exists()
    f.unlink()
    os.mkfifo(f)  # a FIFO: never waited on
    assert get(open_store(), t) == [None] * 4  # type: ignore[operator]
    f.unlink()
    # a chunk's link naming something out of the directory is not a name of a run: ignored
    link = f.parent / f"{keys[0].hex()}.{PER}.first"
    if link.is_symlink():
        link.unlink()
    link.symlink_to("../../outside.kvc")
    assert open_store().lookup(t[:32]) == 0  # type: ignore[operator]


def test_eviction_and_the_budget_work_on_chunk_files(open_store: object, tmp_path: Path) -> None:
    file_bytes = chunk_header_bytes(GEOM, PER) + PER * GEOM.block_bytes
    kv = open_store(shared_bytes=3 * file_bytes)  # type: ignore[operator]
    for salt in range(6):
        put(kv, tokens(CHUNK, salt=salt))
    kv.close()
    assert sum(f.stat().st_size for f in files(tmp_path)) <= 3 * file_bytes
    reader = open_store()  # type: ignore[operator]
    assert [reader.lookup(tokens(CHUNK, salt=s)) for s in range(6)][3:] == [CHUNK] * 3  # the newest stay
    keys = reader.keys_for(tokens(CHUNK, salt=5))
    assert reader.evict(keys[1:2], tiers=("shared",)) == 1  # a block's chunk goes with it
    assert reader.lookup(tokens(CHUNK, salt=5)) == 0


def test_chunk_tokens_must_be_whole_blocks(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="multiple of the geometry's block_tokens"):
        KVCacheStore(GEOM, pinned_bytes=0, shared_dir=tmp_path, chunk_tokens=40)
    with pytest.raises(errors.ConfigError):
        KVCacheStore(GEOM, pinned_bytes=0, shared_dir=tmp_path, chunk_tokens=-16)
    with defaults.set(kvcache_chunk_tokens=32):
        with KVCacheStore(GEOM, pinned_bytes=0, shared_dir=tmp_path) as kv:
            assert kv.stats()["chunk_tokens"] == 32
