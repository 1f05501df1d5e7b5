"""DevicePath on this machine (no GPU): host arrays through the engine, the mode reported, typed errors.

GPU arrays (torch CUDA; kvikio GDS/compat where installed) are tested behind the ``gpu`` marker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sfstore import errors
from sfstore.paths.device import DevicePath, device_mode

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()


def test_mode_is_reported_never_silent(tmp_path: Path) -> None:
    mode, why = device_mode()
    dp = DevicePath(tmp_path)
    assert dp.mode == mode and why
    d = dp.describe()
    assert d["kind"] == "device" and d["mode"] == mode and d["gpu_direct"] == (mode == "gds")
    assert d["supports_device_buffers"] is True  # submit takes GPU buffers on every route
    if mode != "gds":
        assert any(f"device path {mode}" in f for f in d["fallbacks"])
    dp.close()


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_asking_for_gds_without_it_is_not_supported(tmp_path: Path) -> None:
    with pytest.raises(errors.NotSupportedOnHostError, match="not available here"):
        DevicePath(tmp_path, mode="gds")
    with pytest.raises(errors.ConfigError):
        DevicePath(tmp_path, mode="fast")


def test_host_arrays_round_trip_at_offsets(tmp_path: Path) -> None:
    dp = DevicePath(tmp_path)
    try:
        dp.slab("slabs/kv.slab", 8 << 20)
        a = np.random.default_rng(0).integers(0, 255, 2 << 20, dtype=np.uint8)
        t = torch.randn(1 << 18).to(torch.bfloat16)  # 512 KiB
        assert dp.write("slabs/kv.slab", a, offset=4 << 20) == a.nbytes
        assert dp.write_async("slabs/kv.slab", t, offset=0).get() == 1 << 19
        back = np.zeros_like(a)
        tb = torch.zeros_like(t)
        f = dp.read_into_async("slabs/kv.slab", back, offset=4 << 20)
        assert f.get() == a.nbytes and f.done()
        dp.read_into("slabs/kv.slab", tb, offset=0)
        assert np.array_equal(a, back) and torch.equal(t, tb)
        c = dp.counters.snapshot()
        assert c["bytes_written"] == c["bytes_read"] == a.nbytes + (1 << 19)
    finally:
        dp.close()


def test_errors_are_typed(tmp_path: Path) -> None:
    dp = DevicePath(tmp_path / "root")
    try:
        with pytest.raises(errors.PathEscapeError):
            dp.write("../outside.slab", b"x" * 4096)
        with pytest.raises(errors.PathNotFoundError):
            dp.read_into("missing.slab", bytearray(10))
        dp.slab("small.slab", 4096)
        with pytest.raises(errors.SfstoreOSError, match="short read"):
            dp.read_into("small.slab", bytearray(8192))
        with pytest.raises(errors.ReadOnlyBufferError):
            dp.read_into("small.slab", b"x" * 100)
        with pytest.raises(errors.InvalidRequestError):
            dp.write("small.slab", b"x", offset=-1)
    finally:
        dp.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_tensors_round_trip(tmp_path: Path) -> None:
    dp = DevicePath(tmp_path)
    try:
        dp.slab("g.slab", 64 << 20)
        x = torch.randn(8 << 20, device="cuda").to(torch.bfloat16)  # 16 MiB
        dp.register(x)
        dp.write("g.slab", x, offset=1 << 20)
        y = torch.empty_like(x)
        dp.read_into("g.slab", y, offset=1 << 20)
        assert torch.equal(x, y)
        c = dp.counters.snapshot()
        assert c["bytes_written"] == c["bytes_read"] == x.numel() * 2
        # GDS moves bytes with no host copy; kvikio's compat mode and sfstore's staging through host memory
        assert (c["bytes_gpu_direct"] if dp.mode == "gds" else c["bytes_staged"]) == 2 * x.numel() * 2
    finally:
        dp.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
def test_batched_block_checksums_match_the_host_kvsum64(device: str) -> None:
    # The CUDA runtime's sums run on a tensor's own device: on the CPU here every line but the GPU's runs
    from sfstore.checksums import kvsum64
    from sfstore.paths.device_runtime import CudaRuntime

    gen = torch.Generator().manual_seed(7)
    host = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
    buf = host.to(device)
    rt = CudaRuntime()
    offsets = [0, 8, 4096, 60_000, 65_536 - 1024]
    want = [kvsum64(host[o:o + 1024].numpy().tobytes()) for o in offsets]
    assert rt.checksums(buf, offsets, 1024) == want
    assert [rt.checksum(buf, o, 1024) for o in offsets] == want
    assert rt.checksums(buf, [], 1024) == []
    with pytest.raises(errors.InvalidRequestError, match="whole 8-byte words"):
        rt.checksums(buf, [4], 1024)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
def test_strided_row_copies_move_what_a_copy_per_row_moves(device: str) -> None:
    # a block's layers into a layer-major chunk body and back, as one strided copy (on the CPU here every line
    # but the GPU's runs)
    from sfstore.paths.device_runtime import CudaRuntime, DeviceRuntime

    rt = CudaRuntime()
    layers, m, lb = 6, 4, 1024
    gen = torch.Generator().manual_seed(3)
    blocks = [torch.randint(0, 256, (layers * lb,), dtype=torch.uint8, generator=gen).to(device) for _ in range(m)]
    body = torch.zeros(layers * m * lb, dtype=torch.uint8, device=device)
    looped = torch.zeros_like(body)
    for k, b in enumerate(blocks):
        rt.copy_rows(body, k * lb, m * lb, b, 0, lb, lb, layers)
        DeviceRuntime.copy_rows(rt, looped, k * lb, m * lb, b, 0, lb, lb, layers)  # the row-by-row default
    assert torch.equal(body, looped)
    assert torch.equal(body[(2 * m + 1) * lb:(2 * m + 2) * lb], blocks[1][2 * lb:3 * lb])  # layer 2 of block 1
    out = torch.zeros(layers * lb, dtype=torch.uint8, device=device)
    rt.copy_rows(out, 2 * lb, lb, body, (2 * m + 3) * lb, m * lb, lb, 3)  # layers 2..4 of block 3
    assert torch.equal(out[2 * lb:5 * lb], blocks[3][2 * lb:5 * lb]) and not out[:2 * lb].any()
    assert not out[5 * lb:].any()
