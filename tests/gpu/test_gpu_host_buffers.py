"""Host memory meeting the GPU: registered (cuMemHostRegister) pool buffers copied to the device, and the file
path reading into CUDA tensors through its pinned bounce buffers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sfstore.buffers import RegisteredBufferPool, memory_capabilities
from sfstore.paths.file import FilePath

from .conftest import MiB, gpu_marks

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need a CUDA build of torch")
pytestmark = gpu_marks(torch)

CHUNK = 1 * MiB  # the file path's request size here: the payloads below take several chunks


def _host_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.cpu().numpy())


def test_registered_buffer_is_cuda_registered_and_copies_to_the_gpu(cuda: torch.device) -> None:
    """A pool buffer with cuda_register="on" is registered with CUDA, and a non-blocking host->device copy from a
    DLPack view of it lands every byte."""
    from torch.utils.dlpack import from_dlpack

    caps = memory_capabilities()
    assert caps["cuda_register"]["ok"], f"CUDA registration unavailable: {caps['cuda_register']['reason']}"
    size = 8 * MiB
    with RegisteredBufferPool(size, cuda_register="on") as pool:
        buf = pool.acquire()
        try:
            assert buf.cuda_registered
            assert pool.stats()["cuda_registered"] >= 1, pool.stats()
            host = from_dlpack(buf)
            assert host.device.type == "cpu" and host.numel() == size
            host.copy_(torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8))
            dev = host.to(cuda, non_blocking=True)
            torch.cuda.synchronize()
            want = torch.arange(size, dtype=torch.int64, device=cuda).remainder_(251).to(torch.uint8)
            assert torch.equal(dev, want)
            del host, dev
        finally:
            buf.release()


def test_file_path_reads_into_cuda_tensors_bit_exact(tmp_path: Path, cuda: torch.device) -> None:
    """FilePath.read_into a CUDA tensor: a file of several chunks whole, a range at an unaligned offset, and a file
    shorter than the tensor (the rest left as it was), each bit-exact, with the staged bytes counted; one read
    after another works (each returns its pooled bounce buffer: none stays held by a view)."""
    with FilePath(tmp_path / "files", chunk_size=CHUNK) as fp:
        _read_into_cuda(fp, cuda)


def _read_into_cuda(fp: FilePath, cuda: torch.device) -> None:
    payload = os.urandom(5 * CHUNK + 12345)
    assert fp.chunk_size == CHUNK < len(payload)
    fp.write("x.bin", payload)

    out = torch.empty(len(payload), dtype=torch.uint8, device=cuda)
    assert fp.read_into("x.bin", out) == len(payload)
    assert _host_bytes(out) == payload
    staged = fp.counters.snapshot()["bytes_staged"]
    assert staged == len(payload)

    offset, length = CHUNK + CHUNK // 2 + 7, 2 * CHUNK + 5
    part = torch.full((3 * CHUNK,), 0xAB, dtype=torch.uint8, device=cuda)
    assert fp.read_into("x.bin", part, offset=offset, length=length) == length
    assert _host_bytes(part[:length]) == payload[offset:offset + length]
    assert bool((part[length:] == 0xAB).all()), "bytes past the range were written"

    short = payload[:CHUNK + CHUNK // 2 + 1]
    fp.write("short.bin", short)
    big = torch.full((4 * CHUNK,), 0xCD, dtype=torch.uint8, device=cuda)
    assert fp.read_into("short.bin", big) == len(short)
    assert _host_bytes(big[:len(short)]) == short
    assert bool((big[len(short):] == 0xCD).all()), "bytes past the end of the file were written"

    again = torch.zeros(len(payload), dtype=torch.uint8, device=cuda)
    assert fp.read_into_async("x.bin", again).get() == len(payload)
    assert torch.equal(again, out)
    assert fp.counters.snapshot()["bytes_staged"] - staged == length + len(short) + len(payload)
