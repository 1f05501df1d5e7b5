"""GPU blocks through the device path: which route each tier takes, why, what the counters say, and that every byte
comes back exact and verified.

No GPU exists on this machine: ``EmulatedDeviceRuntime`` stands in for one (host memory it calls GPU memory; its
kvikio stand-in does pread/pwrite as kvikio's POSIX backend does), so everything but the last CUDA/kvikio call
runs. The tests say so in their names (``emulated_gpu``). Where a test needs a target cuFile accepts (none here),
it says so and replaces only that fact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import defaults
from sfstore.blocks import BlockStore
from sfstore.checksums import SHARED_CHUNK_SUMS, SumKind
from sfstore.kvcache import KVCacheStore, KVGeometry
from sfstore.kvcache.shared_chunks import CHUNK_SUFFIX, chunk_header_bytes
from sfstore.paths import device as device_mod
from sfstore.paths.device import DevicePath, TargetFacts, cufile_accepts
from sfstore.testing.device_runtime import EmulatedDeviceRuntime, gpu_array

from .conftest import GEOM

N = GEOM.block_bytes


def _blocks(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [gpu_array(N, fill=rng.integers(0, 255, N, dtype=np.uint8)) for _ in range(count)]


def _store(tmp_path: Path, rt: EmulatedDeviceRuntime, *, block: bool = False, pinned: int = 0,
           geom: KVGeometry = GEOM) -> KVCacheStore:
    bs = (BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 16 << 20},
                     size_classes=(geom.block_bytes,)) if block else None)
    return KVCacheStore(geom, model_id="m", pinned_bytes=pinned, block_store=bs, shared_dir=tmp_path / "shared",
                        device=DevicePath(runtime=rt))


def _gds_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rt: EmulatedDeviceRuntime) -> KVCacheStore:
    # Stands in for a shared directory on a filesystem cuFile accepts (NFS over RDMA on a cluster).
    monkeypatch.setattr(device_mod, "cufile_accepts", lambda t: (True, "NFS over RDMA (test stand-in)"))
    return _store(tmp_path, rt)


def _round_trip(kv: KVCacheStore, count: int, seed: int, tier: str) -> tuple[list[bytes], list[np.ndarray]]:
    """Put ``count`` GPU blocks and get them back into fresh GPU buffers: every one a hit in ``tier``, exact.
    Returns their keys and the blocks put."""
    src = _blocks(count, seed)
    keys = kv.keys_for(list(range(count * GEOM.block_tokens)))
    kv.put(keys, src)
    dst = [gpu_array(N) for _ in src]
    assert kv.get_into(keys, dst) == [tier] * count
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    return keys, src


def _chunk_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "shared").rglob(f"*{CHUNK_SUFFIX}"))


def _cufile_accepts_here(tmp_path: Path) -> bool:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        return cufile_accepts(TargetFacts.of_fd(fd, str(tmp_path)))[0]
    finally:
        os.close(fd)


def test_emulated_gpu_gds_put_and_get_touch_no_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = EmulatedDeviceRuntime("gds")
    with _gds_store(tmp_path, monkeypatch, rt) as kv:
        assert kv.describe()["gpu_blocks"]["shared"]["route"] == "gds"
        _round_trip(kv, 4, 0, "shared")
        assert rt.copies_to_host == rt.copies_from_host == 0  # the block bytes never visited host memory
        dev = kv.stats()["device"]["shared"]
        assert dev == {"bytes_gpu_direct": 2 * 4 * N, "bytes_staged": 0}
        st = kv.stats()
        assert st["hits_shared"] == 4 and st["puts"] == 4 and st["pinned_capacity_blocks"] == 0


def test_emulated_gpu_on_this_machines_disk_takes_compat_and_says_why(tmp_path: Path) -> None:
    if _cufile_accepts_here(tmp_path):
        pytest.skip("this machine's filesystem is one cuFile accepts")
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt) as kv:
        d = kv.describe()["gpu_blocks"]["shared"]
        assert d["route"] == "compat" and "compat mode" in d["why"]
        _round_trip(kv, 2, 3, "shared")
        assert kv.stats()["device"]["shared"] == {"bytes_gpu_direct": 0, "bytes_staged": 2 * 2 * N}


def test_emulated_gpu_without_kvikio_is_staged_and_says_why(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("staged")
    with _store(tmp_path, rt) as kv:
        d = kv.describe()["gpu_blocks"]["shared"]
        assert d["route"] == "staged" and "emulated" in d["why"]
        _round_trip(kv, 3, 5, "shared")
        assert kv.stats()["device"]["shared"]["bytes_staged"] == 2 * 3 * N
        assert not rt.calls  # no kvikio


def test_emulated_gpu_block_store_target_cufile_refuses_is_staged(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A raw NVMe-oF namespace is what a cluster's block store sits on: cuFile refuses every block device.
    # Routes are decided per filesystem (or per block device): every target here is made to look like one.
    refused = TargetFacts("block", "/dev/nvme1n1", source="/dev/nvme1n1")
    monkeypatch.setattr(TargetFacts, "of_fd", classmethod(lambda cls, fd, name: refused))
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt, block=True) as kv:
        d = kv.describe()["gpu_blocks"]["block"]
        assert d["route"] == "staged" and "block device" in d["why"] and "registered host buffers" in d["why"]
        _round_trip(kv, 3, 7, "block")  # the block tier answers first
        assert kv.stats()["device"]["block"] == {"bytes_gpu_direct": 0, "bytes_staged": 2 * 3 * N}


def test_emulated_gpu_a_corrupt_shared_block_is_a_miss_that_leaves_the_destination_as_it_was(
    tmp_path: Path,
) -> None:
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt) as kv:
        src = _blocks(1, seed=9)
        keys = kv.keys_for(list(range(GEOM.block_tokens)))
        kv.put(keys, src)
        (name,) = _chunk_files(tmp_path)
        raw = bytearray(name.read_bytes())
        raw[chunk_header_bytes(GEOM, 1) + 1000] ^= 0xFF
        name.write_bytes(bytes(raw))
        dst = gpu_array(N, fill=42)
        assert kv.get_into(keys, [dst]) == [None]
        assert (np.asarray(dst) == 42).all()  # keep_on_miss: verified in GPU scratch first
        assert kv.stats()["corrupt_dropped"] == 1 and not name.exists()  # dropped, so a put writes it again
        kv.put(keys, src)
        assert kv.get_into(keys, [dst]) == ["shared"] and np.array_equal(dst, src[0])


def test_emulated_gpu_blocks_and_host_blocks_read_each_others_files(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt) as kv:
        g_keys = kv.keys_for(list(range(GEOM.block_tokens)))
        h_keys = kv.keys_for(list(range(1000, 1000 + GEOM.block_tokens)))
        g_src = _blocks(1, seed=11)[0]
        h_src = np.random.default_rng(12).integers(0, 255, N, dtype=np.uint8)
        kv.put(g_keys, [g_src])  # kvsum64 header, written from "GPU" memory
        kv.put(h_keys, [h_src])  # xxh3 header, written from host memory
        host_dst = np.zeros(N, np.uint8)
        assert kv.get_into(g_keys, [host_dst]) == ["shared"] and np.array_equal(host_dst, g_src)
        gpu_dst = gpu_array(N)
        before = kv.stats()["device"]["shared"]
        assert kv.get_into(h_keys, [gpu_dst]) == ["shared"] and np.array_equal(gpu_dst, h_src)
        after = kv.stats()["device"]["shared"]  # an xxh3 block is verified in host memory, then copied up
        assert after["bytes_staged"] - before["bytes_staged"] == N
        assert after["bytes_gpu_direct"] == before["bytes_gpu_direct"]


def test_emulated_gpu_with_a_pinned_tier_goes_through_its_slots_and_says_so(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt, pinned=8 * (N + 4096)) as kv:
        d = kv.describe()
        assert d["gpu_blocks"]["shared"]["route"] == "pinned slots" and "kvcache_pinned_bytes=0" in \
            d["gpu_blocks"]["shared"]["why"]


def test_emulated_gpu_put_async_leaves_once_the_bytes_are_on_their_way(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt, block=True) as kv:
        src = _blocks(4, seed=13)
        keys = kv.keys_for(list(range(4 * GEOM.block_tokens)))
        fut = kv.put_async(keys, src)
        assert fut.get(30) is None and fut.done()
        kv.wait_for_puts(30)
        dst = [gpu_array(N) for _ in src]
        assert kv.get_into(keys, dst) == ["block"] * 4
        assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))


def test_emulated_gpu_block_store_on_a_target_cufile_takes_goes_gpu_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stands in for the block store's image file on ext4 over NVMe (no such filesystem here).
    monkeypatch.setattr(device_mod, "cufile_accepts", lambda t: (True, "ext4 on /dev/nvme0n1 (test stand-in)"))
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt, block=True) as kv:
        assert kv.describe()["gpu_blocks"]["block"]["route"] == "gds"
        keys, src = _round_trip(kv, 3, 17, "block")
        assert all(kv.block.sum_kind(k) is SumKind.KV64 for k in keys)  # type: ignore[union-attr]  # GPU-written
        assert kv.stats()["device"]["block"] == {"bytes_gpu_direct": 2 * 3 * N, "bytes_staged": 0}
        assert rt.copies_to_host == rt.copies_from_host == 0
        host = np.zeros(N, np.uint8)  # a host reader of a GPU-written slot verifies its kvsum64 in host memory
        assert kv.get_into(keys[:1], [host]) == ["block"] and np.array_equal(host, src[0])


def test_emulated_gpu_long_lived_buffers_are_registered_once(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("gds")
    with _store(tmp_path, rt) as kv:
        cache = [gpu_array(4 * N), gpu_array(4 * N)]
        assert kv.register_device_buffers(cache) == 2
        assert kv.register_device_buffers(cache) == 2 and len(rt.registered) == 2  # already registered: once
        assert kv.register_device_buffers([np.zeros(N, np.uint8)]) == 0  # host memory: nothing to register
    with _store(tmp_path / "s", EmulatedDeviceRuntime("staged")) as staged:
        assert staged.register_device_buffers([gpu_array(N)]) == 0  # outside gds: nothing to register


def test_emulated_gpu_put_writes_one_chunk_of_kvsum64_slices_and_a_get_moves_one_range_per_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt = EmulatedDeviceRuntime("gds")
    lb, layers, m = GEOM.layer_bytes, GEOM.num_layers, 4
    with _gds_store(tmp_path, monkeypatch, rt) as kv:
        src = _blocks(m, seed=21)
        keys = kv.keys_for(list(range(m * GEOM.block_tokens)))
        kv.put(keys, src)
        (name,) = _chunk_files(tmp_path)  # one file for the run, not a file per block
        head = name.read_bytes()[:chunk_header_bytes(GEOM, m)]
        assert SHARED_CHUNK_SUMS.kind(int.from_bytes(head[8:10], "little")) is SumKind.KV64
        assert rt.calls == [("pwrite", m * N)]  # the body, layer-major, in one GPU-direct write
        rt.calls.clear()
        dst = [gpu_array(N, fill=7) for _ in range(m)]
        seen: list[tuple[list[int], int]] = []

        def on_layer(indices: list[int], layer: int) -> None:
            seen.append((sorted(indices), layer))
            for d, s in zip(dst, src, strict=True):  # this layer and the ones before are in; no later one is
                got, want = np.asarray(d), np.asarray(s)
                assert np.array_equal(got[:(layer + 1) * lb], want[:(layer + 1) * lb])
                assert (got[(layer + 1) * lb:] == 7).all()

        assert kv.get_into(keys, dst, on_layer=on_layer) == ["shared"] * m
        assert seen == [(list(range(m)), layer) for layer in range(layers)]
        assert rt.calls == [("pread", m * lb)] * layers  # the device path moved a range per layer
        assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
        assert kv.stats()["device"]["shared"] == {"bytes_gpu_direct": 2 * m * N, "bytes_staged": 0}
        assert rt.copies_to_host == rt.copies_from_host == 0
        rt.calls.clear()  # without on_layer: all layers in one range
        assert kv.get_into(keys, [gpu_array(N) for _ in range(m)]) == ["shared"] * m
        assert rt.calls == [("pread", m * N)]


def test_emulated_gpu_a_damaged_later_layer_fails_the_chunk_after_its_earlier_layers_were_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt = EmulatedDeviceRuntime("gds")
    lb, m = GEOM.layer_bytes, 3
    with _gds_store(tmp_path, monkeypatch, rt) as kv:
        src = _blocks(m, seed=23)
        keys = kv.keys_for(list(range(m * GEOM.block_tokens)))
        kv.put(keys, src)
        (name,) = _chunk_files(tmp_path)
        raw = bytearray(name.read_bytes())
        raw[chunk_header_bytes(GEOM, m) + (2 * m + 1) * lb + 5] ^= 0x01  # layer 2 of block 1
        name.write_bytes(bytes(raw))
        seen: list[int] = []
        dst = [gpu_array(N) for _ in range(m)]
        assert kv.get_into(keys, dst, on_layer=lambda idx, layer: seen.append(layer)) == [None] * m
        assert seen == [0, 1]  # announced before the damage was found; the blocks' statuses say they missed
        assert kv.stats()["corrupt_dropped"] == m and not name.exists()
        kv.put(keys, src)  # written again, whole
        assert kv.get_into(keys, dst) == ["shared"] * m
        assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))


def test_emulated_gpu_chunks_are_read_across_memories_and_a_host_chunk_comes_up_by_layer(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("staged")
    m = 3
    with _store(tmp_path, rt) as kv:
        g_keys = kv.keys_for(list(range(m * GEOM.block_tokens)))
        h_keys = kv.keys_for(list(range(5000, 5000 + m * GEOM.block_tokens)))
        g_src = _blocks(m, seed=31)
        h_src = [np.random.default_rng(32 + i).integers(0, 255, N, dtype=np.uint8) for i in range(m)]
        kv.put(g_keys, g_src)  # kvsum64 slices, from "GPU" memory on the staged route
        kv.put(h_keys, h_src)  # xxh3 slices, from host memory
        assert len(_chunk_files(tmp_path)) == 2
        host = [np.zeros(N, np.uint8) for _ in range(m)]  # a host reader verifies kvsum64 slices in host memory
        assert kv.get_into(g_keys, host) == ["shared"] * m
        assert all(np.array_equal(a, b) for a, b in zip(g_src, host, strict=True))
        gpu = [gpu_array(N) for _ in range(m)]
        seen: list[int] = []
        assert kv.get_into(h_keys, gpu, on_layer=lambda idx, layer: seen.append(layer)) == ["shared"] * m
        assert seen == list(range(GEOM.num_layers))
        assert all(np.array_equal(a, b) for a, b in zip(h_src, gpu, strict=True))


class _MisreadingRuntime(EmulatedDeviceRuntime):
    """An emulated GPU whose reads on the device path garble one byte (a defect on the way: kvikio, a driver),
    while the bytes on storage are sound: a stand-in, no GPU here."""

    def __init__(self) -> None:
        super().__init__("gds")
        self.garble = False

    def open(self, fd: int, full: str) -> Any:
        f = super().open(fd, full)
        rt = self
        read = f.pread

        def pread(buf: Any, size: int, file_offset: int, buf_offset: int) -> Any:
            fut = read(buf, size, file_offset, buf_offset)
            if rt.garble:
                fut.get()
                np.asarray(buf).reshape(-1).view(np.uint8)[buf_offset] ^= 0xFF
            return fut

        f.pread = pread  # type: ignore[method-assign]
        return f


@pytest.mark.parametrize("chunks", [True, False])
def test_emulated_gpu_a_misread_on_the_way_is_a_miss_that_keeps_the_files_misreading_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    # A GPU read that fails its checksum on bytes that pass in host memory is a defect between storage and this
    # reader, not damage: dropping the file would lose it for every other reader
    rt = _MisreadingRuntime()
    monkeypatch.setattr(device_mod, "cufile_accepts", lambda t: (True, "NFS over RDMA (test stand-in)"))
    with defaults.set(kvcache_chunk_tokens=256 if chunks else 0):
        kv = _store(tmp_path, rt)
    m = 3
    try:
        src = _blocks(m, seed=31)
        keys = kv.keys_for(list(range(m * GEOM.block_tokens)))
        kv.put(keys, src)
        files = sorted(p for p in (tmp_path / "shared").rglob("*") if p.is_file() and not p.is_symlink())
        rt.garble = True
        dst = [gpu_array(N, fill=5) for _ in range(m)]
        with caplog.at_level("WARNING", logger="sfstore"):
            assert kv.get_into(keys, dst) == [None] * m
        assert all((np.asarray(d) == 5).all() for d in dst)  # nothing unverified reached the caller
        stats = kv.stats()
        assert stats["corrupt_dropped"] == 0 and stats["device_verify_disagreed"] >= 1
        assert "not in host memory" in caplog.text
        assert sorted(p for p in (tmp_path / "shared").rglob("*") if p.is_file() and not p.is_symlink()) == files
        rt.garble = False
        assert kv.get_into(keys, dst) == ["shared"] * m  # the files were kept: the next sound read hits
        assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    finally:
        kv.close()


def test_emulated_gpu_a_block_store_value_misread_on_the_way_is_kept_misreading_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The block store's GPU-direct values get the same second opinion: a GPU-side mismatch on bytes that pass in
    # host memory is a miss that keeps the value (read again through host memory, O_DIRECT on its image)
    monkeypatch.setattr(device_mod, "cufile_accepts", lambda t: (True, "ext4 on /dev/nvme0n1 (test stand-in)"))
    rt = _MisreadingRuntime()
    dp = DevicePath(runtime=rt)
    bs = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 16 << 20}, size_classes=(N,))
    try:
        src = _blocks(2, seed=41)
        bs.put_many_device([(b"k0", src[0]), (b"k1", src[1])], dp)
        assert bs.sum_kind(b"k0") is SumKind.KV64
        rt.garble = True
        dst = [gpu_array(N, fill=3) for _ in src]
        assert bs.get_into_device([b"k0", b"k1"], dst, dp) == [None, None]
        c = bs.counters.snapshot()
        assert c["device_verify_disagreed"] == 2 and c["corrupt_dropped"] == 0
        assert bs.contains(b"k0") and bs.contains(b"k1")
        rt.garble = False
        assert bs.get_into_device([b"k0", b"k1"], dst, dp) == [N, N]
        assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    finally:
        bs.close()
        dp.close()
