"""The checksum kinds' on-disk codes, per format, pinned to the numbers files and slots already carry.

Each format's numbers are written here by hand (this module's own copies of the record layouts, not the
library's): a slot or file written with a code reads back as its kind, and what sfstore writes carries the
code. Changing a number in :mod:`sfstore.checksums` would make existing stores and shared directories misread.

``EmulatedDeviceRuntime`` stands in for a GPU where a value must be written GPU-direct (no GPU on this machine:
host memory it calls GPU memory; the slots, files, checksums and scans are the real ones), as the test names say.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from sfstore.blocks import BlockStore
from sfstore.checksums import BLOCK_SLOT_SUMS, BLOCK_SNAPSHOT_SUMS, SHARED_FILE_SUMS, SumCodes, SumKind, kvsum64
from sfstore.kvcache import KVCacheStore, KVGeometry
from sfstore.paths.device import DevicePath
from sfstore.testing.device_runtime import EmulatedDeviceRuntime, gpu_array

V = 64 << 10
# a block store's slot header and snapshot entry, and a shared KV file's header, as the formats define them
SLOT = struct.Struct("<8s16sQQQQHBB")  # magic, uuid, slot, gen, length, value_sum, key_len, class, flags
SLOT_FLAGS_AT = SLOT.size - 1
SNAP = struct.Struct("<BQQQQH")  # class (checksum kind in the top bit), slot, gen, length, value_sum, key_len
SHARED = struct.Struct("<8sH6x16s32sQQ")  # magic, version (checksum kind), fingerprint, key, length, checksum
GEOM = KVGeometry(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def test_each_format_keeps_its_numbers() -> None:
    assert {k: BLOCK_SLOT_SUMS.code(k) for k in SumKind} == {SumKind.XXH3: 0, SumKind.KV64: 1}
    assert {k: BLOCK_SNAPSHOT_SUMS.code(k) for k in SumKind} == {SumKind.XXH3: 0, SumKind.KV64: 0x80}
    assert {k: SHARED_FILE_SUMS.code(k) for k in SumKind} == {SumKind.XXH3: 1, SumKind.KV64: 2}
    for table in (BLOCK_SLOT_SUMS, BLOCK_SNAPSHOT_SUMS, SHARED_FILE_SUMS):
        assert all(table.kind(table.code(k)) is k for k in SumKind)
    # the same number means different kinds in different formats: only a format's own table reads it
    assert BLOCK_SLOT_SUMS.kind(1) is SumKind.KV64 and SHARED_FILE_SUMS.kind(1) is SumKind.XXH3
    assert BLOCK_SLOT_SUMS.kind(2) is None and SHARED_FILE_SUMS.kind(0) is None and BLOCK_SNAPSHOT_SUMS.kind(1) is None


def test_a_table_refuses_two_kinds_on_one_code_and_a_kind_it_lacks() -> None:
    with pytest.raises(ValueError, match="share a code"):
        SumCodes("a test format", {SumKind.XXH3: 1, SumKind.KV64: 1})
    with pytest.raises(ValueError, match="cannot record a kvsum64"):
        SumCodes("a test format", {SumKind.XXH3: 1}).code(SumKind.KV64)


def _value(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, V, dtype=np.uint8)


def _slot_header(image: Path, offset: int) -> bytearray:
    with open(image, "rb") as f:
        f.seek(offset)
        return bytearray(f.read(512))


def _rewrite_slot_kind(image: Path, offset: int, flags: int, value_sum: int) -> None:
    """Rewrite a slot header's checksum code and value checksum by hand (its own checksum recomputed)."""
    head = _slot_header(image, offset)
    fields = list(SLOT.unpack_from(head))
    fields[5], fields[8] = value_sum, flags
    body = SLOT.pack(*fields) + bytes(head[SLOT.size:SLOT.size + fields[6]])
    with open(image, "r+b") as f:
        f.seek(offset)
        f.write(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


def test_emulated_gpu_block_store_slots_carry_and_read_their_codes(tmp_path: Path) -> None:
    image = tmp_path / "b.img"
    child = f"""
import os, numpy as np
from sfstore.blocks import BlockStore
from sfstore.paths.device import DevicePath
from sfstore.testing.device_runtime import EmulatedDeviceRuntime, gpu_array
bs = BlockStore({{"kind": "image", "path": {str(image)!r}, "size": 16 << 20}}, size_classes=({V},))
dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
value = lambda s: np.random.default_rng(s).integers(0, 256, {V}, dtype=np.uint8)
bs.put(b"host", value(1).tobytes(), durable=True)
bs.put_many_device([(b"gpu", gpu_array({V}, fill=value(2)))], dp, durable=True)
bs.put(b"odd", value(3).tobytes(), durable=True)
print(*bs.locate(b"host"), *bs.locate(b"gpu"), *bs.locate(b"odd"))
os._exit(0)  # no close: the next open scans the slot headers
"""
    out = subprocess.run([sys.executable, "-c", child], check=True, timeout=120, capture_output=True, text=True)
    host_at, _, gpu_at, _, odd_at, _ = map(int, out.stdout.split())
    assert _slot_header(image, host_at)[SLOT_FLAGS_AT] == 0  # written as xxh3-64
    assert _slot_header(image, gpu_at)[SLOT_FLAGS_AT] == 1  # written as kvsum64
    # swap them by hand: the host value's slot says kvsum64 (code 1), the GPU one's xxh3-64 (code 0)
    _rewrite_slot_kind(image, host_at, 1, kvsum64(_value(1)))
    _rewrite_slot_kind(image, gpu_at, 0, xxhash.xxh3_64_intdigest(_value(2).tobytes()))
    _rewrite_slot_kind(image, odd_at, 2, kvsum64(_value(3)))  # a code the format does not define
    bs = BlockStore({"kind": "image", "path": str(image), "size": 16 << 20}, size_classes=(V,))
    try:
        assert bs.recovered == "scan"
        assert bs.sum_kind(b"host") is SumKind.KV64 and bs.sum_kind(b"gpu") is SumKind.XXH3
        assert bs.get(b"host") == _value(1).tobytes() and bs.get(b"gpu") == _value(2).tobytes()  # verified
        assert not bs.contains(b"odd")  # not a slot of this format: ignored
    finally:
        bs.close()


def test_emulated_gpu_block_store_snapshot_carries_and_reads_its_codes(tmp_path: Path) -> None:
    image = tmp_path / "b.img"
    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    bs = BlockStore({"kind": "image", "path": str(image), "size": 16 << 20}, size_classes=(V,))
    try:
        bs.put(b"host", _value(1).tobytes())
        bs.put_many_device([(b"gpu", gpu_array(V, fill=_value(2)))], dp)
        snapshot_at = bs.layout.snapshot_offset
    finally:
        bs.close()  # a clean close: the index goes to the snapshot
    with open(image, "rb") as f:
        f.seek(snapshot_at)
        data = f.read(2 * (SNAP.size + 4))
    classes = {}
    pos = 0
    for _ in range(2):
        c, _slot, _gen, _length, _vsum, klen = SNAP.unpack_from(data, pos)
        classes[data[pos + SNAP.size:pos + SNAP.size + klen]] = c
        pos += SNAP.size + klen
    assert classes == {b"host": 0, b"gpu": 0x80}  # class 0; the top bit is the checksum kind's code
    bs = BlockStore({"kind": "image", "path": str(image), "size": 16 << 20}, size_classes=(V,))
    try:
        assert bs.recovered == "snapshot"
        assert bs.sum_kind(b"host") is SumKind.XXH3 and bs.sum_kind(b"gpu") is SumKind.KV64
        assert bs.get(b"host") == _value(1).tobytes() and bs.get(b"gpu") == _value(2).tobytes()
    finally:
        bs.close()
        dp.close()


def _shared_file(key: bytes, block: bytes, version: int, checksum: int) -> bytes:
    body = SHARED.pack(b"SFKVBLK1", version, GEOM.fingerprint(), key, GEOM.block_bytes, checksum)
    head = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return head + bytes(4096 - len(head)) + block


def _block(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, GEOM.block_bytes, dtype=np.uint8).tobytes()


def test_emulated_gpu_shared_files_carry_and_read_their_codes(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    with KVCacheStore(GEOM, model_id="m", pinned_bytes=0, shared_dir=shared, device=dp, chunk_tokens=0) as kv:
        keys = kv.keys_for(list(range(6 * GEOM.block_tokens)))
        kv.put(keys[:1], [bytearray(_block(0))])  # a host put
        kv.put(keys[1:2], [gpu_array(GEOM.block_bytes, fill=np.frombuffer(_block(1), np.uint8))])  # GPU-direct
        assert kv.shared is not None
        name = kv.shared.file_name
        assert (shared / name(keys[0])).read_bytes()[8:10] == struct.pack("<H", 1)  # xxh3-64
        assert (shared / name(keys[1])).read_bytes()[8:10] == struct.pack("<H", 2)  # kvsum64
        # files written by hand with each code (and one with a code the format does not define)
        for i, (version, checksum) in enumerate(((1, xxhash.xxh3_64_intdigest(_block(2))), (2, kvsum64(_block(3))),
                                                 (3, xxhash.xxh3_64_intdigest(_block(4)))), start=2):
            path = shared / name(keys[i])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_shared_file(keys[i], _block(i), version, checksum))
        bufs = [bytearray(GEOM.block_bytes) for _ in range(5)]
        assert kv.get_into(keys[:5], bufs) == ["shared"] * 4 + [None]
        assert [bytes(b) for b in bufs[:4]] == [_block(i) for i in range(4)]
        assert kv.stats()["corrupt_dropped"] == 1 and not (shared / name(keys[4])).exists()
