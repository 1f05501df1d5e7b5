"""Registered buffer pool: alignment, zero-copy views, LIFO reuse, release rules, DLPack."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest

from sfstore import defaults, errors
from sfstore.buffers import RegisteredBufferPool, as_buffer, memory_capabilities, native_available

pytestmark = pytest.mark.skipif(not native_available()[0], reason=f"native helper: {native_available()[1]}")

MiB = 1 << 20


@pytest.fixture
def pool() -> RegisteredBufferPool:
    with RegisteredBufferPool(MiB) as p:
        yield p


def test_buffers_are_page_aligned_writable_and_sized(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    assert buf.address % 4096 == 0
    assert len(buf) == buf.nbytes == MiB
    mv = memoryview(buf)
    assert not mv.readonly and mv.nbytes == MiB and mv.format == "B"
    mv[:4] = b"abcd"
    assert bytes(buf[0:4]) == b"abcd"
    mv.release()
    buf.release()


def test_numpy_views_share_the_buffer_address(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    a = np.frombuffer(buf, dtype=np.uint8)
    b = np.from_dlpack(buf)
    assert a.ctypes.data == buf.address
    assert b.ctypes.data == buf.address
    a[123] = 45
    assert b[123] == 45  # same bytes, not a copy
    del a, b
    buf.release()


def test_torch_from_dlpack_shares_the_buffer_address(pool: RegisteredBufferPool) -> None:
    torch = pytest.importorskip("torch")
    buf = pool.acquire()
    t = torch.from_dlpack(buf)
    assert t.data_ptr() == buf.address
    assert t.dtype == torch.uint8 and t.shape == (MiB,) and t.device.type == "cpu"
    t[7] = 99
    assert memoryview(buf)[7] == 99
    # a typed view of the same memory, as a checkpoint loader would make it
    f = t.view(torch.bfloat16)
    assert f.data_ptr() == buf.address
    del t, f
    gc.collect()
    buf.release()


def test_release_with_live_views_is_refused_then_allowed(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    view = np.frombuffer(buf, dtype=np.uint8)
    with pytest.raises(errors.BufferInUseError) as info:
        buf.release()
    assert isinstance(info.value, BufferError)
    assert pool.stats()["in_use"] == 1
    del view
    buf.release()
    assert buf.released and pool.stats()["in_use"] == 0
    with pytest.raises(ValueError):
        memoryview(buf)  # a released buffer exports nothing


def test_dlpack_capsule_holds_the_buffer_until_the_consumer_frees_it(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    base = sys.getrefcount(buf)
    arr = np.from_dlpack(buf)
    assert buf.exports == 1 and sys.getrefcount(buf) == base + 1
    del arr
    assert buf.exports == 0 and sys.getrefcount(buf) == base
    cap = buf.__dlpack__()  # never consumed: its destructor must give the export back
    assert buf.exports == 1
    del cap
    assert buf.exports == 0
    buf.release()


def test_slices_are_views_of_the_same_memory(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    s = buf[4096:8192]
    assert s.address == buf.address + 4096 and len(s) == 4096 and s.is_view
    inner = s[10:20]
    assert inner.address == buf.address + 4106
    np.frombuffer(inner, np.uint8)[:] = 7
    assert bytes(buf[4106:4116]) == b"\x07" * 10
    with pytest.raises(errors.BufferInUseError):
        buf.release()  # slices keep it
    del inner, s
    buf.release()
    with pytest.raises(ValueError):
        buf[0:10]


def test_slices_with_a_step_are_refused(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    with pytest.raises(ValueError):
        buf[::2]
    with pytest.raises(TypeError):
        buf[3]  # type: ignore[index]
    buf.release()


def test_reuse_is_lifo(pool: RegisteredBufferPool) -> None:
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    addresses = [a.address, b.address, c.address]
    assert len(set(addresses)) == 3
    for x in (a, b, c):
        x.release()
    assert pool.stats()["free"] == 3
    # c went back last, so it comes out first; then b, then a
    got = [pool.acquire() for _ in range(3)]
    assert [g.address for g in got] == addresses[::-1]
    assert pool.stats()["allocated"] == 3  # reused, not allocated again
    for g in got:
        g.release()


def test_garbage_collected_buffer_returns_to_the_pool(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    address = buf.address
    del buf
    gc.collect()
    assert pool.stats()["in_use"] == 0
    again = pool.acquire()
    assert again.address == address
    again.release()


def test_context_manager_releases(pool: RegisteredBufferPool) -> None:
    with pool.acquire() as buf:
        memoryview(buf)[0] = 1
    assert buf.released and pool.stats()["in_use"] == 0


def test_max_buffers_and_timeout() -> None:
    with RegisteredBufferPool(64 << 10, max_buffers=2) as p:
        a, b = p.acquire(), p.acquire()
        with pytest.raises(errors.PoolExhaustedError) as info:
            p.acquire(timeout=0.05)
        assert isinstance(info.value, MemoryError)
        a_address = a.address
        a.release()
        c = p.acquire(timeout=0.05)
        assert c.address == a_address  # the one just returned
        b.release()
        c.release()


def test_close_frees_idle_buffers_and_later_returns(pool: RegisteredBufferPool) -> None:
    out = pool.acquire()
    idle = pool.acquire()
    idle.release()
    pool.close()
    assert pool.stats()["allocated"] == 1 and pool.stats()["free"] == 0
    out.release()
    assert pool.stats()["allocated"] == 0
    with pytest.raises(errors.InvalidRequestError):
        pool.acquire()


def test_keep_idle_frees_the_oldest_now_and_bounds_later_returns(pool: RegisteredBufferPool) -> None:
    bufs = [pool.acquire() for _ in range(4)]
    newest = bufs[-1].address
    for b in bufs:
        b.release()
    assert pool.keep_idle(1) == 3 * pool.buffer_size  # (rounded to the page: buffer_size is a page multiple)
    assert (pool.stats()["allocated"], pool.stats()["free"]) == (1, 1)
    again = [pool.acquire() for _ in range(3)]
    assert again[0].address == newest  # the most recently released one was kept
    for b in again:
        b.release()
    assert (pool.stats()["allocated"], pool.stats()["free"]) == (1, 1)  # two freed as they came back
    assert pool.keep_idle(None) == 0
    more = [pool.acquire() for _ in range(3)]
    for b in more:
        b.release()
    assert pool.stats()["free"] == 3
    assert pool.keep_idle(0) == 3 * pool.buffer_size and pool.stats()["allocated"] == 0
    with pytest.raises(errors.InvalidRequestError):
        pool.keep_idle(-1)


def _resident_pages(address: int, nbytes: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // 4096)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec)


def test_large_buffers_are_faulted_in_when_allocated_even_unlocked() -> None:
    # Large buffers are populated by several threads at allocation (first touch can be slow on a VM), so they
    # are resident before any I/O touches them, with mlock off too.
    size = 256 * MiB
    with RegisteredBufferPool(size, mlock="off", huge_pages="off", cuda_register="off") as p:
        buf = p.acquire()
        try:
            assert _resident_pages(buf.address, size) == size // 4096
        finally:
            buf.release()
    with RegisteredBufferPool(MiB, mlock="off", huge_pages="off", cuda_register="off") as p:
        small = p.acquire()  # small buffers are left to fault in on first use
        try:
            assert _resident_pages(small.address, MiB) == 0
        finally:
            small.release()


def test_mlock_is_attempted_and_reported(pool: RegisteredBufferPool) -> None:
    buf = pool.acquire()
    stats = pool.stats()
    if buf.locked:
        assert stats["locked_bytes"] >= MiB
    else:
        assert stats["mlock_failures"] >= 1 and "mlock" in stats["mlock_error"]
    buf.release()
    with RegisteredBufferPool(MiB, mlock="off") as p:
        b = p.acquire()
        assert not b.locked and p.stats()["locked_bytes"] == 0
        b.release()


def test_huge_page_sized_buffers_report_their_backing() -> None:
    with RegisteredBufferPool(4 * MiB, huge_pages="auto") as p:
        b = p.acquire()
        s = p.stats()
        assert b.address % 4096 == 0
        # either real hugetlbfs pages, or THP advised, or a recorded reason
        assert s["hugetlb_buffers"] + s["thp_buffers"] == 1 or s["hugetlb_error"]
        b.release()


def test_cuda_registration_is_a_reported_noop_without_a_driver(pool: RegisteredBufferPool) -> None:
    caps = memory_capabilities()
    buf = pool.acquire()
    if caps["cuda_register"]["ok"]:
        assert buf.cuda_registered
    else:
        assert not buf.cuda_registered
        assert "cuda" in caps["cuda_register"]["reason"].lower()
        assert pool.stats()["cuda_error"]
    buf.release()


def test_cuda_register_on_fails_without_a_driver() -> None:
    if memory_capabilities()["cuda_register"]["ok"]:
        pytest.skip("a CUDA driver is present here")
    with RegisteredBufferPool(MiB, cuda_register="on") as p, pytest.raises(errors.RegistrationError):
        p.acquire()


def test_pool_settings_come_from_defaults() -> None:
    with defaults.set(buffer_size="128k"):
        with RegisteredBufferPool() as p:
            assert p.buffer_size == 128 << 10
    with pytest.raises(errors.ConfigError):
        RegisteredBufferPool(MiB, mlock="sometimes")


def test_as_buffer_views_tensors_without_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(16, dtype=torch.bfloat16)
    view = as_buffer(t)
    assert view.ctypes.data == t.data_ptr() and view.nbytes == 32
    ba = bytearray(8)
    assert as_buffer(ba) is ba
    with pytest.raises(TypeError):
        as_buffer("text")
    with pytest.raises(TypeError):
        as_buffer(torch.arange(10)[::2])


def test_free_page_reporting_reads_the_balloon_feature_bits(tmp_path: Path) -> None:
    """Read from the balloon device's negotiated features (a string of 0/1, bit 0 first); here against files laid
    out as sysfs lays them out, then against this machine's own sysfs."""
    from sfstore.buffers import free_page_reporting

    assert free_page_reporting(str(tmp_path / "none"))["on"] is False
    dev = tmp_path / "virtio0"
    dev.mkdir()
    (dev / "features").write_text("0110010100000000000000000000000010000000\n")  # bit 5: REPORTING
    got = free_page_reporting(str(tmp_path))
    assert got["on"] is True and "virtio0" in got["reason"]
    (dev / "features").write_text("0110000100000000000000000000000010000000\n")
    assert free_page_reporting(str(tmp_path))["on"] is False
    real = free_page_reporting()
    assert isinstance(real["on"], bool) and real["reason"]
    caps = memory_capabilities()
    assert caps["free_page_reporting"] == real


def test_the_one_host_copy_moves_tensor_bytes_both_ways_at_offsets() -> None:
    # the copy every GPU path uses (the device path's runtime, the file path's bounce buffers, the KV cache's
    # pinned slots); CPU tensors here, the same calls on CUDA ones (tests/gpu)
    torch = pytest.importorskip("torch")
    from sfstore.buffers import copy_from_host, copy_to_host

    src = torch.arange(256, dtype=torch.int32)  # 1024 bytes
    out = bytearray(100)
    copy_to_host(src, 40, out)
    assert bytes(out) == src.numpy().tobytes()[40:140]
    strided = torch.arange(64, dtype=torch.int16).view(8, 8).t()
    whole = bytearray(128)
    copy_to_host(strided, 0, whole)  # a non-contiguous tensor is copied whole, in its logical order
    assert bytes(whole) == strided.contiguous().numpy().tobytes()
    with pytest.raises(errors.InvalidRequestError, match="non-contiguous"):
        copy_to_host(strided, 2, bytearray(8))

    dst = torch.zeros(256, dtype=torch.int32, requires_grad=False)
    copy_from_host(dst, 40, bytes(range(100)))
    raw = dst.numpy().tobytes()
    assert raw[40:140] == bytes(range(100)) and not any(raw[:40]) and not any(raw[140:])
    grad = torch.zeros(4, dtype=torch.float32, requires_grad=True)
    copy_from_host(grad, 0, torch.ones(4).numpy().tobytes())  # still just memory to fill
    assert grad.detach().tolist() == [1.0] * 4
    target = torch.zeros(8, 8, dtype=torch.int16).t()
    copy_from_host(target, 0, strided.contiguous().numpy().tobytes())
    assert torch.equal(target, strided)
    with pytest.raises(errors.InvalidRequestError, match="non-contiguous"):
        copy_from_host(target, 2, b"\0" * 8)
