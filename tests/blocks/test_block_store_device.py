"""Values written to the block store GPU-direct (put_many_device) and read back, on the GPU and in host memory.

``EmulatedDeviceRuntime`` stands in for a GPU (no GPU exists on this machine: host memory it calls GPU memory),
so the slots, checksums (kvsum64), index, snapshot and recovery scan are the real ones; the tests say so in
their names (``emulated_gpu``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sfstore.blocks import BlockStore
from sfstore.checksums import SumKind
from sfstore.paths.device import DevicePath
from sfstore.testing.device_runtime import EmulatedDeviceRuntime, gpu_array

V = 64 << 10


def _open(tmp_path: Path) -> BlockStore:
    return BlockStore({"kind": "image", "path": str(tmp_path / "b.img"), "size": 16 << 20}, size_classes=(V,))


def _values(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [gpu_array(V, fill=rng.integers(0, 255, V, dtype=np.uint8)) for _ in range(n)]


def test_emulated_gpu_values_round_trip_and_carry_their_kind(tmp_path: Path) -> None:
    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    bs = _open(tmp_path)
    try:
        vals = _values(5)
        keys = [f"k{i}".encode() for i in range(5)]
        bs.put_many_device(list(zip(keys, vals, strict=True)), dp)
        bs.put(b"host", bytes(V))
        assert [bs.sum_kind(k) for k in keys] == [SumKind.KV64] * 5 and bs.sum_kind(b"host") is SumKind.XXH3
        assert bs.checksum(keys[0]) is None and bs.checksum(b"host") is not None  # checksum() is xxh3 only
        out = [gpu_array(V) for _ in keys]
        assert bs.get_into_device(keys, out, dp) == [V] * 5
        assert all(np.array_equal(a, b) for a, b in zip(vals, out, strict=True))
        assert bs.get_into_device([b"host"], [gpu_array(V)], dp) == [None]  # xxh3: read through host memory
        host = bytearray(V)
        assert bs.get_into([keys[2]], [host]) == [V] and bytes(host) == bytes(np.asarray(vals[2]))
        assert bs.get_many([keys[3]])[0] == bytes(np.asarray(vals[3]))
    finally:
        bs.close()
        dp.close()


def test_emulated_gpu_a_damaged_slot_is_dropped_and_the_destination_kept(tmp_path: Path) -> None:
    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    bs = _open(tmp_path)
    try:
        vals = _values(2, seed=1)
        bs.put_many_device([(b"a", vals[0]), (b"b", vals[1])], dp)
        bs.flush()
        for key in (b"a", b"b"):
            off, _n = bs.locate(key)  # type: ignore[misc]
            with open(tmp_path / "b.img", "r+b") as f:
                f.seek(off + bs._hdr + 100)
                byte = f.read(1)
                f.seek(off + bs._hdr + 100)
                f.write(bytes([byte[0] ^ 0xFF]))
        dst = gpu_array(V, fill=9)
        assert bs.get_into_device([b"a"], [dst], dp) == [None]
        assert (np.asarray(dst) == 9).all() and not bs.contains(b"a")
        assert bs.get_into([b"b"], [bytearray(V)]) == [None] and not bs.contains(b"b")  # host readers check too
        assert bs.counters.snapshot()["corrupt_dropped"] == 2
    finally:
        bs.close()
        dp.close()


def test_emulated_gpu_kind_survives_a_clean_reopen(tmp_path: Path) -> None:
    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    vals = _values(3, seed=2)
    bs = _open(tmp_path)
    bs.put_many_device([(f"k{i}".encode(), v) for i, v in enumerate(vals)], dp)
    bs.close()
    bs = _open(tmp_path)
    try:
        assert bs.recovered == "snapshot"
        out = [gpu_array(V) for _ in vals]
        assert bs.get_into_device([f"k{i}".encode() for i in range(3)], out, dp) == [V] * 3
        assert all(np.array_equal(a, b) for a, b in zip(vals, out, strict=True))
    finally:
        bs.close()
        dp.close()


def test_emulated_gpu_kind_survives_a_crash_and_the_recovery_scan(tmp_path: Path) -> None:
    child = f"""
import os, numpy as np
from sfstore.blocks import BlockStore
from sfstore.paths.device import DevicePath
from sfstore.testing.device_runtime import EmulatedDeviceRuntime, gpu_array
bs = BlockStore({{"kind": "image", "path": {str(tmp_path / "b.img")!r}, "size": 16 << 20}}, size_classes=({V},))
dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
rng = np.random.default_rng(3)
bs.put_many_device([(f"k{{i}}".encode(), gpu_array({V}, fill=rng.integers(0, 255, {V}, dtype=np.uint8)))
                    for i in range(3)], dp, durable=True)
os._exit(0)  # no close: the next open scans the slots
"""
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    rng = np.random.default_rng(3)
    want = [rng.integers(0, 255, V, dtype=np.uint8) for _ in range(3)]
    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    bs = _open(tmp_path)
    try:
        assert bs.recovered == "scan"
        out = [gpu_array(V) for _ in range(3)]
        assert bs.get_into_device([f"k{i}".encode() for i in range(3)], out, dp) == [V] * 3
        assert all(np.array_equal(a, b) for a, b in zip(want, out, strict=True))
    finally:
        bs.close()
        dp.close()


def test_emulated_gpu_a_value_that_is_not_whole_words_is_refused(tmp_path: Path) -> None:
    from sfstore import errors

    dp = DevicePath(runtime=EmulatedDeviceRuntime("gds"))
    bs = _open(tmp_path)
    try:
        with pytest.raises(errors.InvalidRequestError, match="8-byte words"):
            bs.put_many_device([(b"odd", gpu_array(V - 4))], dp)
        assert not bs.contains(b"odd")
    finally:
        bs.close()
        dp.close()
