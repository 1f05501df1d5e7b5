"""Conformance suite: every I/O engine (``uring``, ``threads``, ``python``) must pass all of it.

Engines that cannot run here are skipped with the reason. Tests marked ``root`` make loop-device filesystems
(4096-byte sectors, so O_DIRECT refuses misaligned I/O there, unlike tmpfs); they skip where that is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import mmap
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import defaults
from sfstore import errors as E
from sfstore.engine import (
    IOEngine,
    IOFuture,
    Request,
    describe_engines,
    direct_io_alignment,
    get_engine,
    open_fd,
)

root = pytest.mark.root
ENGINES = ("uring", "threads", "python")
Target = Any  # tests/engine/conftest.py:Target (conftest modules are not importable)
KEYS = ("batches", "requests", "bytes_read", "bytes_written", "bytes_direct", "bytes_bounced", "errors")
KiB = 1 << 10
MiB = 1 << 20
BLOCK = 4096


def stats_delta(engine: IOEngine, before: dict[str, int]) -> dict[str, int]:
    after = engine.stats()
    return {k: after[k] - before[k] for k in KEYS}


def run_counted(engine: IOEngine, reqs: list[Request]) -> tuple[list[int], dict[str, int]]:
    """One batch's results, with what the engine's counters say it did (:func:`stats_delta`)."""
    before = engine.stats()
    results = engine.run(reqs)
    return results, stats_delta(engine, before)


def page_buffer(size: int, rng: random.Random | None = None) -> mmap.mmap:
    """A page-aligned writable buffer (anonymous mmap), optionally filled with random bytes."""
    buf = mmap.mmap(-1, size)
    if rng is not None:
        buf[:] = rng.randbytes(size)
    return buf


def write_reference(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def read_reference(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@contextlib.contextmanager
def direct_file(path: Path, data: bytes) -> Iterator[tuple[int, bool]]:
    """``path`` holding ``data``, open read-write with ``direct="on"``: ``(fd, is_direct)``, closed on the way out."""
    write_reference(path, data)
    fd, is_direct = open_fd(path, os.O_RDWR, direct="on")
    try:
        yield fd, is_direct
    finally:
        os.close(fd)


def up(value: int, align: int) -> int:
    return -(-value // align) * align


def assert_direct_where_aligned(d: dict[str, int], target: Target, pattern: str, total: int) -> None:
    """How a batch's ``total`` bytes moved (``d``: its :func:`stats_delta`): through the page cache on a buffered
    descriptor, all direct when aligned, partly through bounce buffers when not."""
    if not target.direct:
        assert d["bytes_direct"] == d["bytes_bounced"] == 0
    elif pattern == "aligned":
        assert (d["bytes_direct"], d["bytes_bounced"]) == (total, 0)
    else:
        assert d["bytes_bounced"] > 0
        assert d["bytes_direct"] + d["bytes_bounced"] == total


# ---------------------------------------------------------------------------------------------------------------
# Round trips against plain Python file I/O


@pytest.mark.parametrize("pattern", ["aligned", "misaligned"])
def test_random_reads_match_reference(engine: IOEngine, target: Target, pattern: str) -> None:
    rng = random.Random(f"reads-{pattern}-{target.kind}")
    size = MiB + 1234  # EOF in the middle of a block
    data = rng.randbytes(size)
    path = target.dir / "ref.bin"
    write_reference(path, data)
    fd = target.open(path, os.O_RDONLY)
    buf = page_buffer(4 * MiB)
    reqs: list[Request] = []
    pos = 0
    for _ in range(40):
        if pattern == "aligned":
            offset = rng.randrange(0, size // BLOCK + 2) * BLOCK  # some start at or past EOF
            length = rng.randrange(1, 17) * BLOCK
            boff = up(pos, BLOCK)
        else:
            offset = rng.randrange(0, size + 3000)
            length = rng.randrange(0, 40000)
            boff = pos + rng.randrange(1, BLOCK)
        reqs.append(Request.read(fd, offset, length, buf, boff))
        pos = boff + length
    assert pos <= len(buf)
    results, d = run_counted(engine, reqs)
    for i, (req, got) in enumerate(zip(reqs, results, strict=True)):
        expected = data[req.offset:req.offset + req.length]
        assert got == len(expected), f"request {i}: {req.offset}+{req.length} of a {size}-byte file"
        assert buf[req.buffer_offset:req.buffer_offset + got] == expected, f"request {i}"
    total = sum(results)
    assert (d["batches"], d["requests"], d["bytes_read"], d["bytes_written"], d["errors"]) == (1, 40, total, 0, 0)
    assert_direct_where_aligned(d, target, pattern, total)


@pytest.mark.parametrize("pattern", ["aligned", "misaligned"])
def test_random_writes_match_reference(engine: IOEngine, target: Target, pattern: str) -> None:
    rng = random.Random(f"writes-{pattern}-{target.kind}")
    size = 512 * KiB + 77
    initial = rng.randbytes(size)
    path = target.dir / "ref.bin"
    write_reference(path, initial)
    fd = target.open(path, os.O_RDWR)
    ranges: list[tuple[int, int]] = []
    while len(ranges) < 24:
        if pattern == "aligned":
            offset = rng.randrange(0, (size + 64 * KiB) // BLOCK) * BLOCK
            length = rng.randrange(1, 9) * BLOCK
        else:
            offset = rng.randrange(0, size + 20000)
            length = rng.randrange(1, 30000)
        if all(offset + length <= o or o + n <= offset for o, n in ranges):
            ranges.append((offset, length))
    src = page_buffer(2 * MiB, rng)
    reqs: list[Request] = []
    pos = 0
    for offset, length in ranges:
        boff = up(pos, BLOCK) if pattern == "aligned" else pos + rng.randrange(1, BLOCK)
        reqs.append(Request.write(fd, offset, length, src, boff))
        pos = boff + length
    assert pos <= len(src)
    results, d = run_counted(engine, reqs)
    assert results == [n for _, n in ranges]
    end = max(size, *(o + n for o, n in ranges))
    model = bytearray(initial) + bytearray(end - size)
    for req in reqs:
        model[req.offset:req.offset + req.length] = src[req.buffer_offset:req.buffer_offset + req.length]
    assert read_reference(path) == bytes(model)
    total = sum(results)
    assert (d["batches"], d["requests"], d["bytes_written"], d["bytes_read"], d["errors"]) == (1, 24, total, 0, 0)
    assert_direct_where_aligned(d, target, pattern, total)
    # What was written (partly through a buffered descriptor on O_DIRECT files) reads back through the engine.
    back = bytearray(len(model) + 3)
    assert engine.run([Request.read(fd, 0, len(model), back, 3)]) == [len(model)]
    assert back[3:] == model


def test_batches_from_many_threads(engine: IOEngine, target: Target) -> None:
    nthreads, region, chunk = 4, 256 * KiB, 16 * KiB
    path = target.dir / "shared.bin"
    write_reference(path, b"")
    fd = target.open(path, os.O_RDWR)
    payloads = [random.Random(t).randbytes(region) for t in range(nthreads)]
    start = threading.Barrier(nthreads)
    failures: list[str] = []

    def worker(t: int) -> None:
        try:
            base = t * region
            src = payloads[t]
            start.wait(timeout=30)
            futures = [
                engine.submit([Request.write(fd, base + o, chunk, src, o) for o in range(b, b + 4 * chunk, chunk)])
                for b in range(0, region, 4 * chunk)
            ]
            for f in futures:
                assert f.get(timeout=60) == [chunk] * 4
            back = bytearray(region)
            reads = [engine.submit([Request.read(fd, base + off, chunk, back, off)]) for off in range(0, region, chunk)]
            for f in reads:
                assert f.get(timeout=60) == [chunk]
            if bytes(back) != src:
                failures.append(f"thread {t}: data read back differs")
        except BaseException as exc:  # reported below; a thread cannot fail the test itself
            failures.append(f"thread {t}: {exc!r}\n{traceback.format_exc()}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a submitting thread hung"
    assert not failures, "\n".join(failures)
    assert read_reference(path) == b"".join(payloads)


def test_zero_length_requests(engine: IOEngine, target: Target) -> None:
    data = random.Random(5).randbytes(10000)
    path = target.dir / "z.bin"
    write_reference(path, data)
    fd = target.open(path, os.O_RDWR)
    buf = bytearray(b"\xee" * 16)
    reqs = [
        Request.read(fd, 0, 0, bytearray()),
        Request.read(fd, 10**9, 0, buf),
        Request.read(fd, 3, 0, buf, 16),  # buffer_offset at the very end is fine for 0 bytes
        Request.write(fd, 5, 0, b""),
        Request.write(fd, 10**9, 0, b"x"),  # must not extend the file
    ]
    assert engine.run(reqs) == [0] * 5
    assert buf == b"\xee" * 16
    assert read_reference(path) == data
    assert engine.run([]) == []


def test_reads_stop_at_eof(engine: IOEngine, target: Target) -> None:
    size = 3 * BLOCK + 100
    data = random.Random(7).randbytes(size)
    path = target.dir / "eof.bin"
    write_reference(path, data)
    fd = target.open(path, os.O_RDONLY)
    buf = page_buffer(32 * BLOCK)
    reqs = [
        Request.read(fd, 2 * BLOCK, 2 * BLOCK, buf, 0),  # crosses EOF: short count
        Request.read(fd, 0, 16 * BLOCK, buf, 4 * BLOCK),  # whole file and far beyond
        Request.read(fd, size - 10, 64, buf, 22 * BLOCK - 64),  # misaligned, crosses EOF
        Request.read(fd, 4 * BLOCK, BLOCK, buf, 23 * BLOCK),  # starts past EOF (block-aligned)
        Request.read(fd, size + 12345, 100, buf, 25 * BLOCK),  # starts past EOF
    ]
    before = engine.stats()
    results = engine.run(reqs)
    assert results == [BLOCK + 100, size, 10, 0, 0]
    assert buf[0:BLOCK + 100] == data[2 * BLOCK:]
    assert buf[4 * BLOCK:4 * BLOCK + size] == data
    assert buf[22 * BLOCK - 64:22 * BLOCK - 54] == data[-10:]
    d = stats_delta(engine, before)
    assert d["errors"] == 0 and d["bytes_read"] == sum(results)


def test_short_reads_are_retried(engine: IOEngine) -> None:
    """/proc/kallsyms answers each read(2) with about a page, long before EOF: the engine must loop."""
    want = 64 * KiB
    try:
        fd = os.open("/proc/kallsyms", os.O_RDONLY)
    except OSError as exc:
        pytest.skip(f"cannot open /proc/kallsyms: {exc}")
    try:
        if len(os.pread(fd, want, 0)) >= want:
            pytest.skip("/proc/kallsyms does not return short reads here")
        reference = b""
        while len(reference) < want:
            piece = os.pread(fd, want - len(reference), len(reference))
            if not piece:
                pytest.skip("/proc/kallsyms is smaller than 64 KiB here")
            reference += piece
        buf = bytearray(want)
        assert engine.run([Request.read(fd, 0, want, buf)]) == [want]
        assert buf == reference
    finally:
        os.close(fd)


def test_many_requests_with_queue_depth_one(engine_name: str, tmp_path: Path) -> None:
    eng = get_engine(engine_name, queue_depth=1, threads=1)
    assert 1 <= eng.queue_depth <= 1 or engine_name == "threads"
    data = random.Random(11).randbytes(64 * KiB)
    path = tmp_path / "qd1.bin"
    write_reference(path, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(len(data))
        reqs = [Request.read(fd, i * 1000, 1000, buf, i * 1000) for i in range(60)]
        assert eng.run(reqs) == [1000] * 60
        assert buf[:60000] == data[:60000]
    finally:
        os.close(fd)


def test_waiting_on_a_full_queue_costs_no_cpu(engine_name: str, tmp_path: Path) -> None:
    """More requests than the queue depth: those waiting for room cost no CPU while the device works. An engine
    thread that went back to ``io_uring_enter`` whenever a full ring had another batch queued behind it would
    spin a core for as long as the device took (a caller that keeps two batches submitted): its CPU would match
    the wall time of the reads. The file is read with O_DIRECT (dropped from the page cache too), so the time
    goes to the disk, not to copies."""
    if engine_name == "python":
        pytest.skip("the python engine copies through Python threads: its CPU is the reads' own")
    eng = get_engine(engine_name, queue_depth=2, threads=2)
    size, n = MiB, 64
    path = tmp_path / "full-queue.bin"
    write_reference(path, random.Random(5).randbytes(size))
    fd, direct = open_fd(path, os.O_RDONLY, direct="auto")
    buf = page_buffer(size)
    try:
        if not direct:
            pytest.skip(f"no O_DIRECT on {tmp_path}: the reads would be copies, CPU by nature")
        reqs = [Request.read(fd, 0, size, buf, 0) for _ in range(n)]
        eng.run(reqs[:4])  # threads, ring and registrations exist before the measurement
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        # batches of 4, two always submitted (as a reader that streams does): the next waits in the engine's
        # inbox while the one before it fills the queue
        batches, got = [reqs[i:i + 4] for i in range(0, n, 4)], []
        inflight = [eng.submit(batches[0]), eng.submit(batches[1])]
        for b in [*batches[2:], None, None]:
            got += inflight.pop(0).get(60)
            if b is not None:
                inflight.append(eng.submit(b))
        assert got == [size] * n
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        buf.close()
        os.close(fd)
    assert cpu < 0.35 * wall, f"{cpu * 1e3:.1f} ms of CPU over {wall * 1e3:.1f} ms of reads"


# ---------------------------------------------------------------------------------------------------------------
# O_DIRECT on a filesystem with 4096-byte sectors


@root
def test_direct_io_alignment_on_4k_sectors(dio_fs: Any, dio_dir: Path) -> None:
    path = dio_dir / "align.bin"
    with direct_file(path, bytes(2 * BLOCK)) as (fd, is_direct):
        assert is_direct and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        mem, off = direct_io_alignment(fd)
        assert off == 4096
        assert mem >= 1 and 4096 % mem == 0
        assert direct_io_alignment(path)[1] == 4096
        assert direct_io_alignment(dio_dir / "not-created-yet")[1] == 4096
        assert direct_io_alignment(dio_fs.device)[1] == 4096
        # The fixture really refuses 512-byte direct I/O (tmpfs or a 512-byte-sector disk would accept it).
        buf = page_buffer(2 * BLOCK)
        with memoryview(buf) as view, pytest.raises(OSError) as info:
            os.pwrite(fd, view[:512], 0)
        assert info.value.errno == errno.EINVAL


MISALIGNED = {
    "offset": (512, BLOCK, 0),
    "length": (0, BLOCK + 512, 0),
    "memory": (0, 2 * BLOCK, 1),
    "all": (1000, 3 * BLOCK + 77, 3),
}


@root
@pytest.mark.parametrize("case", list(MISALIGNED))
def test_misaligned_direct_needs_bounce(engine: IOEngine, dio_dir: Path, case: str) -> None:
    rng = random.Random(case)
    data = rng.randbytes(64 * KiB)
    path = dio_dir / "mis.bin"
    with direct_file(path, data) as (fd, is_direct):
        assert is_direct
        offset, length, boff = MISALIGNED[case]
        src = page_buffer(64 * KiB, rng)
        back = page_buffer(64 * KiB)
        good = Request.write(fd, 32 * KiB, BLOCK, src, 0)  # aligned: would go direct
        with defaults.set(bounce=False):
            before = engine.stats()
            with pytest.raises(E.AlignmentError) as info:
                engine.submit([good, Request.write(fd, offset, length, src, boff)])
            assert isinstance(info.value, ValueError) and "request 1" in str(info.value)
            with pytest.raises(E.AlignmentError):
                engine.submit([Request.read(fd, offset, length, back, boff)])
            d = stats_delta(engine, before)
            assert d == dict.fromkeys(KEYS, 0), "a batch that failed validation must issue nothing"
            assert read_reference(path) == data
            # Aligned requests still go direct without bounce buffers.
            results, d = run_counted(engine, [good])
            assert results == [BLOCK]
            assert (d["bytes_direct"], d["bytes_bounced"]) == (BLOCK, 0)
        model = bytearray(data)
        model[32 * KiB:32 * KiB + BLOCK] = src[:BLOCK]
        before = engine.stats()
        assert engine.run([Request.write(fd, offset, length, src, boff)]) == [length]
        model[offset:offset + length] = src[boff:boff + length]
        assert engine.run([Request.read(fd, offset, length, back, boff)]) == [length]
        assert back[boff:boff + length] == src[boff:boff + length]
        d = stats_delta(engine, before)
        assert d["bytes_bounced"] > 0
        assert d["bytes_direct"] + d["bytes_bounced"] == 2 * length
        assert read_reference(path) == bytes(model)


@root
def test_small_bounce_buffers_move_in_pieces(engine_name: str, dio_dir: Path) -> None:
    with defaults.set(bounce_buffer_size=8192):
        eng = get_engine(engine_name, queue_depth=5, threads=3)
        try:
            rng = random.Random(99)
            path = dio_dir / "pieces.bin"
            initial = rng.randbytes(256 * KiB)
            with direct_file(path, initial) as (fd, _):
                src = page_buffer(256 * KiB, rng)
                model = bytearray(initial)
                # misaligned memory with aligned offsets (bounce copies), then everything misaligned
                reqs = [
                    Request.write(fd, 0, 96 * KiB, src, 5),
                    Request.write(fd, 100 * KiB + 3, 70 * KiB + 9, src, 100 * KiB),
                ]
                assert eng.run(reqs) == [96 * KiB, 70 * KiB + 9]
                for r in reqs:
                    model[r.offset:r.offset + r.length] = src[r.buffer_offset:r.buffer_offset + r.length]
                assert read_reference(path) == bytes(model)
                back = page_buffer(256 * KiB)
                assert eng.run([Request.read(fd, 7, 200 * KiB, back, 9)]) == [200 * KiB]
                assert back[9:9 + 200 * KiB] == model[7:7 + 200 * KiB]
        finally:
            eng.close()


@root
def test_direct_writes_keep_neighbouring_bytes(engine: IOEngine, dio_dir: Path) -> None:
    data = random.Random(3).randbytes(8 * BLOCK)
    path = dio_dir / "rmw.bin"
    with direct_file(path, data) as (fd, _):
        model = bytearray(data)
        edits = [(0, b"A"), (BLOCK - 5, b"B" * 10), (2 * BLOCK + 100, b"C" * (2 * BLOCK)), (8 * BLOCK - 1, b"DE")]
        results = engine.run([Request.write(fd, off, len(b), b) for off, b in edits])
        assert results == [len(b) for _, b in edits]
        for off, b in edits:
            model[off:off + len(b)] = b
        assert read_reference(path) == bytes(model)
        back = bytearray(len(model))
        assert engine.pread(fd, back, 0) == len(model)
        assert back == model


@root
def test_bounce_descriptors_do_not_leak(engine: IOEngine, dio_dir: Path) -> None:
    path = dio_dir / "leak.bin"
    with direct_file(path, bytes(64 * KiB)) as (fd, _):
        engine.run([Request.write(fd, 1, 10, b"0123456789")])  # warm up (threads, rings, buffers)
        open_before = len(os.listdir("/proc/self/fd"))
        for i in range(5):
            engine.run([Request.write(fd, 100 + i, 5000, b"x" * 5000), Request.read(fd, 3, 7000, bytearray(7000))])
        assert len(os.listdir("/proc/self/fd")) == open_before


# ---------------------------------------------------------------------------------------------------------------
# Validation: typed errors, and nothing issued


def test_closed_or_unknown_fd(engine: IOEngine, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "c.bin", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    for bad in (fd, 1 << 20):
        with pytest.raises(E.BadFileDescriptorError) as info:
            engine.submit([Request.read(bad, 0, 10, bytearray(10))])
        assert info.value.errno == errno.EBADF
        assert isinstance(info.value, OSError)


def test_wrong_access_mode(engine: IOEngine, tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    write_reference(path, b"0123456789")
    wfd = os.open(path, os.O_WRONLY)
    rfd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(E.BadFileDescriptorError) as info:
            engine.submit([Request.read(wfd, 0, 10, bytearray(10))])
        assert info.value.errno == errno.EBADF
        with pytest.raises(E.BadFileDescriptorError) as info:
            engine.submit([Request.write(rfd, 0, 3, b"abc")])
        assert info.value.errno == errno.EBADF
        assert read_reference(path) == b"0123456789"
    finally:
        os.close(wfd)
        os.close(rfd)


@pytest.mark.parametrize("field", ["offset", "length", "buffer_offset"])
def test_negative_numbers(engine: IOEngine, tmp_path: Path, field: str) -> None:
    fd = os.open(tmp_path / "n.bin", os.O_RDWR | os.O_CREAT)
    try:
        values = {"offset": 0, "length": 4, "buffer_offset": 0, field: -1}
        for op in ("read", "write"):
            with pytest.raises(E.InvalidRequestError):
                req = Request(op, fd, values["offset"], values["length"], bytearray(8), values["buffer_offset"])
                engine.submit([req])
    finally:
        os.close(fd)


@pytest.mark.parametrize("timeout", [-1, -0.001, -math.inf, float("nan"), -(10 ** 400), True, "1"])
def test_a_wait_takes_seconds_at_least_zero_as_every_wait_in_sfstore(engine: IOEngine, tmp_path: Path,
                                                                     timeout: Any) -> None:
    """One timeout rule for every future (the engine's, a path's, the checkpoint's): ``None`` or seconds >= 0,
    ``inf`` without end, ``0`` only looks; anything else (a negative wait among it) is refused, never a poll."""
    fd = os.open(tmp_path / "w.bin", os.O_RDWR | os.O_CREAT)
    try:
        fut = engine.submit([Request.write(fd, 0, 4, b"abcd")])
        assert fut.wait(None) and fut.wait(0) and fut.wait(math.inf) and fut.wait(10 ** 400)
        for call in (fut.wait, fut.get):
            with pytest.raises(E.InvalidRequestError, match="seconds"):
                call(timeout)
        from sfstore.paths.file import FilePath

        pf = FilePath(tmp_path).submit([])  # a path's future says the same
        with pytest.raises(E.InvalidRequestError, match="seconds"):
            pf.wait(timeout)
    finally:
        os.close(fd)


def test_bad_op(engine: IOEngine, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "o.bin", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(E.InvalidRequestError):
            engine.submit([Request("append", fd, 0, 1, bytearray(1))])
    finally:
        os.close(fd)


def test_buffer_too_small(engine: IOEngine, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "s.bin", os.O_RDWR | os.O_CREAT)
    try:
        for req in (
            Request.read(fd, 0, 11, bytearray(10)),
            Request.read(fd, 0, 6, bytearray(10), 5),
            Request.write(fd, 0, 11, b"0123456789"),
            Request.read(fd, 0, 4 * 4 + 1, np.zeros(4, dtype=np.float32)),  # lengths count bytes
        ):
            with pytest.raises(E.BufferTooSmallError) as info:
                engine.submit([req])
            assert isinstance(info.value, ValueError)
    finally:
        os.close(fd)


def test_read_only_buffers(engine: IOEngine, tmp_path: Path) -> None:
    path = tmp_path / "r.bin"
    write_reference(path, b"0123456789")
    fd = os.open(path, os.O_RDWR)
    frozen = np.zeros(10, dtype=np.uint8)
    frozen.flags.writeable = False
    try:
        for buf in (b"x" * 10, memoryview(bytearray(10)).toreadonly(), frozen):
            with pytest.raises(E.ReadOnlyBufferError) as info:
                engine.submit([Request.read(fd, 0, 10, buf)])
            assert isinstance(info.value, TypeError)
        # read-only buffers are fine to write from
        assert engine.run([Request.write(fd, 0, 3, b"abc"), Request.write(fd, 3, 3, frozen)]) == [3, 3]
        assert read_reference(path) == b"abc\0\0\x006789"
    finally:
        os.close(fd)


def test_not_a_buffer(engine: IOEngine, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    fd = os.open(tmp_path / "b.bin", os.O_RDWR | os.O_CREAT)
    try:
        strided = np.zeros((8, 8), dtype=np.uint8)[:, ::2]
        for buf in (12345, "text", strided, torch.zeros(8, 8)[:, ::2]):
            with pytest.raises(E.InvalidRequestError):
                engine.submit([Request.read(fd, 0, 4, buf)])
    finally:
        os.close(fd)


def _bad_requests(fd: int, rfd: int, closed: int) -> dict[str, tuple[Request, type[Exception]]]:
    return {
        "op": (Request("trim", fd, 0, 4, bytearray(4)), E.InvalidRequestError),
        "negative_offset": (Request.write(fd, -4, 4, b"zzzz"), E.InvalidRequestError),
        "negative_length": (Request.read(fd, 0, -1, bytearray(4)), E.InvalidRequestError),
        "too_small": (Request.write(fd, 0, 5, b"zzzz"), E.BufferTooSmallError),
        "read_only": (Request.read(fd, 0, 4, b"zzzz"), E.ReadOnlyBufferError),
        "closed_fd": (Request.write(closed, 0, 4, b"zzzz"), E.BadFileDescriptorError),
        "read_only_fd": (Request.write(rfd, 0, 4, b"zzzz"), E.BadFileDescriptorError),
    }


@pytest.mark.parametrize("bad", ["op", "negative_offset", "negative_length", "too_small", "read_only", "closed_fd",
                                 "read_only_fd"])
def test_bad_request_in_batch_issues_nothing(engine: IOEngine, tmp_path: Path, bad: str) -> None:
    path = tmp_path / "g.bin"
    data = b"A" * 4096
    write_reference(path, data)
    fd = os.open(path, os.O_RDWR)
    rfd = os.open(path, os.O_RDONLY)
    closed = os.open(path, os.O_RDWR)
    os.close(closed)
    try:
        request, error = _bad_requests(fd, rfd, closed)[bad]
        landing = bytearray(b"\xee" * 100)
        batch = [Request.write(fd, 0, 100, b"B" * 100), Request.read(fd, 1000, 100, landing), request]
        before = engine.stats()
        with pytest.raises(error):
            engine.submit(batch)
        assert read_reference(path) == data
        assert landing == b"\xee" * 100
        assert stats_delta(engine, before) == dict.fromkeys(KEYS, 0)
    finally:
        os.close(fd)
        os.close(rfd)


# ---------------------------------------------------------------------------------------------------------------
# I/O errors, futures, stats


def test_io_error_is_typed_and_names_the_request(engine: IOEngine, tmp_path: Path) -> None:
    path = tmp_path / "ok.bin"
    write_reference(path, b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = engine.stats()
        fut = engine.submit([Request.read(fd, 0, 10, bytearray(10)), Request.read(dfd, 7, 10, bytearray(10))])
        assert fut.results(timeout=30) == [10, -errno.EISDIR]  # results() never raises for I/O errors
        with pytest.raises(E.IOEngineError) as info:
            fut.get()
        exc = info.value
        assert isinstance(exc, OSError) and isinstance(exc, E.SfstoreError)
        assert exc.errno == errno.EISDIR
        text = str(exc)
        for part in ("request 1", "read", f"fd={dfd}", "offset=7", "length=10", str(tmp_path)):
            assert part in text, f"{part!r} missing from {text!r}"
        d = stats_delta(engine, before)
        assert d["errors"] == 1 and d["bytes_read"] == 10
    finally:
        os.close(fd)
        os.close(dfd)


@root
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_no_space_left(engine: IOEngine, tiny_fs: Any, direct: bool) -> None:
    path = tiny_fs.path / "fill.bin"
    fd, is_direct = open_fd(path, os.O_WRONLY | os.O_CREAT, direct=direct)
    try:
        assert is_direct == direct
        buf = page_buffer(MiB, random.Random(1))
        before = engine.stats()
        fut = engine.submit([Request.write(fd, i * MiB, MiB, buf) for i in range(8)])  # 8 MiB into 4 MiB
        results = fut.results(timeout=60)
        assert -errno.ENOSPC in results
        assert all(r in (MiB, -errno.ENOSPC) for r in results), results
        with pytest.raises(E.NoSpaceError) as info:
            fut.get()
        assert info.value.errno == errno.ENOSPC
        assert isinstance(info.value, OSError)
        assert str(path) in str(info.value)
        d = stats_delta(engine, before)
        assert d["errors"] == results.count(-errno.ENOSPC)
        assert d["bytes_written"] == MiB * results.count(MiB)
    finally:
        os.close(fd)


def test_future_interface(engine: IOEngine, tmp_path: Path) -> None:
    data = random.Random(2).randbytes(20000)
    path = tmp_path / "f.bin"
    write_reference(path, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        a, b = bytearray(5000), bytearray(5000)
        fut = engine.submit([Request.read(fd, 0, 5000, a), Request.read(fd, 18000, 5000, b)])
        assert isinstance(fut, IOFuture)
        assert fut.wait(30) is True
        assert fut.done() is True
        assert fut.results() == fut.results(timeout=0) == fut.get() == fut.get(timeout=0) == [5000, 2000]
        assert a == data[:5000] and b[:2000] == data[18000:]
        empty = engine.submit([])
        assert empty.wait(5) and empty.done() and empty.get() == [] and empty.results() == []
    finally:
        os.close(fd)


@root
def test_future_timeout_while_filesystem_frozen(engine: IOEngine, tiny_fs: Any) -> None:
    path = tiny_fs.path / "frozen.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        freeze = subprocess.run(["fsfreeze", "-f", str(tiny_fs.path)], capture_output=True, text=True)
        if freeze.returncode != 0:
            pytest.skip(f"fsfreeze refused: {freeze.stderr.strip()}")
        try:
            fut = engine.submit([Request.write(fd, 0, BLOCK, b"z" * BLOCK)])
            assert fut.wait(0.3) is False
            assert fut.done() is False
            with pytest.raises(E.IOTimeoutError) as info:
                fut.get(timeout=0.2)
            assert isinstance(info.value, TimeoutError)
            with pytest.raises(TimeoutError):
                fut.results(timeout=0.05)
            with pytest.raises(TimeoutError):
                fut.get(timeout=0)
        finally:
            subprocess.run(["fsfreeze", "-u", str(tiny_fs.path)], capture_output=True)
        assert fut.wait(30) is True
        assert fut.done() is True
        assert fut.get(timeout=0) == [BLOCK]
    finally:
        os.close(fd)
    assert read_reference(path) == b"z" * BLOCK


def test_stats_counters(engine_name: str, tmp_path: Path) -> None:
    eng = get_engine(engine_name, queue_depth=6, threads=2)
    stats = eng.stats()
    assert set(KEYS) <= set(stats) and all(isinstance(stats[k], int) and stats[k] >= 0 for k in KEYS)
    path = tmp_path / "st.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = eng.stats()
        eng.run([Request.write(fd, 0, 1000, b"a" * 1000), Request.write(fd, 1000, 2000, b"b" * 2000),
                 Request.write(fd, 0, 0, b"")])
        assert eng.run([Request.read(fd, 0, 500, bytearray(500)), Request.read(fd, 2900, 500, bytearray(500))]) == [
            500, 100]
        assert stats_delta(eng, before) == {"batches": 2, "requests": 5, "bytes_read": 600, "bytes_written": 3000,
                                            "bytes_direct": 0, "bytes_bounced": 0, "errors": 0}
        before = eng.stats()
        assert eng.submit([Request.read(dfd, 0, 10, bytearray(10))]).results(timeout=30) == [-errno.EISDIR]
        d = stats_delta(eng, before)
        assert (d["batches"], d["requests"], d["errors"], d["bytes_read"]) == (1, 1, 1, 0)
    finally:
        os.close(fd)
        os.close(dfd)


# ---------------------------------------------------------------------------------------------------------------
# numpy arrays and torch tensors as buffers


def test_numpy_buffers(engine: IOEngine, target: Target) -> None:
    arr = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    path = target.dir / "np.bin"
    write_reference(path, b"")
    fd = target.open(path, os.O_RDWR)
    assert engine.run([Request.write(fd, 0, arr.nbytes, arr)]) == [arr.nbytes]
    assert read_reference(path) == arr.tobytes()
    out = np.empty_like(arr)
    assert engine.run([Request.read(fd, 0, out.nbytes, out)]) == [arr.nbytes]
    assert np.array_equal(out, arr)
    wide = np.zeros(arr.size + 1024, dtype=np.float32)  # buffer_offset counts bytes, not elements
    assert engine.run([Request.read(fd, 0, arr.nbytes, wide, 4096)]) == [arr.nbytes]
    assert np.array_equal(wide[1024:], arr.ravel()) and not wide[:1024].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_cpu_tensors(engine: IOEngine, target: Target, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(4)
    t = torch.randn(128, 96, generator=gen).to(dt)
    nbytes = t.numel() * t.element_size()
    path = target.dir / f"t-{dtype}.bin"
    write_reference(path, b"")
    fd = target.open(path, os.O_RDWR)
    assert engine.pwrite(fd, t, 0) == nbytes
    raw = read_reference(path)
    assert raw == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    out = torch.empty_like(t)
    assert engine.pread(fd, out, 0) == nbytes
    assert torch.equal(out, t)
    big = torch.zeros(2 * t.numel(), dtype=dt)
    assert engine.run([Request.read(fd, 0, nbytes, big[t.numel():])]) == [nbytes]  # a view with a storage offset
    assert torch.equal(big[t.numel():].reshape(t.shape), t)
    assert not big[:t.numel()].any()


# ---------------------------------------------------------------------------------------------------------------
# Engine selection, lifecycle, fork


def test_describe_engines() -> None:
    info = describe_engines()
    assert {"setting", "selected", "why", "engines"} <= set(info)
    assert set(info["engines"]) == set(ENGINES)
    for name, entry in info["engines"].items():
        assert isinstance(entry["available"], bool), name
        assert isinstance(entry["reason"], str) and entry["reason"], name
    assert info["engines"]["python"]["available"] is True
    assert info["setting"] == defaults.get("engine")
    if info["setting"] == "auto":
        assert info["selected"] == next(n for n in ENGINES if info["engines"][n]["available"])
    assert isinstance(info["why"], str) and info["why"]


def test_engine_setting_selects_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFSTORE_ENGINE", "python")
    assert get_engine().name == "python"
    info = describe_engines()
    assert info["selected"] == "python" and "SFSTORE_ENGINE" in info["why"]
    with defaults.set(engine="auto"):
        assert get_engine().name == describe_engines()["selected"]


def test_bad_engine_arguments() -> None:
    with pytest.raises(E.ConfigError):
        get_engine("bogus")
    with pytest.raises(E.ConfigError):
        get_engine("python", queue_depth=0)
    with pytest.raises(E.ConfigError):
        get_engine("python", threads=0)


def test_unavailable_engine_says_why() -> None:
    engines = describe_engines()["engines"]
    missing = [n for n in ENGINES if not engines[n]["available"]]
    if not missing:
        pytest.skip("every engine can run here")
    for name in missing:
        with pytest.raises(E.EngineUnavailableError) as info:
            get_engine(name)
        assert engines[name]["reason"] in str(info.value)


def test_engine_cache_and_lifecycle(engine_name: str, tmp_path: Path) -> None:
    eng = get_engine(engine_name, queue_depth=5, threads=3)
    assert get_engine(engine_name, queue_depth=5, threads=3) is eng
    assert eng.name == engine_name and 1 <= eng.queue_depth <= 5 and eng.supports_direct_io is True
    path = tmp_path / "life.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        with eng:
            assert eng.pwrite(fd, b"hello", 0) == 5
            got = bytearray(5)
            assert eng.pread(fd, got, 0) == 5 and got == b"hello"
        assert eng.closed
        with pytest.raises(E.EngineUnavailableError):
            eng.submit([Request.read(fd, 0, 5, bytearray(5))])
        eng.close()  # idempotent
        again = get_engine(engine_name, queue_depth=5, threads=3)
        assert again is not eng and not again.closed
        assert again.run([Request.read(fd, 0, 5, got)]) == [5]
        again.close()
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_gets_its_own_engine(engine_name: str, tmp_path: Path) -> None:
    parent = get_engine(engine_name, queue_depth=4, threads=2)
    data = random.Random(8).randbytes(100 * KiB)
    path = tmp_path / "fork.bin"
    write_reference(path, data)
    fd = os.open(path, os.O_RDWR)
    try:
        assert parent.run([Request.read(fd, 0, len(data), bytearray(len(data)))]) == [len(data)]  # threads running
        pid = os.fork()
        if pid == 0:  # child: must leave through os._exit whatever happens
            code = 1
            try:
                child = get_engine(engine_name, queue_depth=4, threads=2)
                back = bytearray(len(data))
                ok = child is not parent and child.run([Request.read(fd, 0, len(data), back)]) == [len(data)]
                ok = ok and bytes(back) == data and child.run([Request.write(fd, 0, 5, b"child")]) == [5]
                code = 0 if ok else 2
            except BaseException:
                traceback.print_exc()
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        status = _wait_child(pid, 60)
        assert os.waitstatus_to_exitcode(status) == 0
        assert read_reference(path)[:5] == b"child"
        assert parent.run([Request.read(fd, 5, 10, bytearray(10))]) == [10]  # the parent's engine still works
    finally:
        os.close(fd)


def _wait_child(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish in {timeout} s")


# ---------------------------------------------------------------------------------------------------------------
# open_fd


def test_open_fd_modes(tmp_path: Path) -> None:
    path = tmp_path / "o.bin"
    fd, is_direct = open_fd(path, os.O_RDWR | os.O_CREAT, direct="off")
    try:
        assert is_direct is False and path.exists()
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)
    fd, is_direct = open_fd(path, os.O_RDWR | os.O_DIRECT, direct=False)
    try:
        assert is_direct is False and not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)
    for mode in ("auto", None):
        fd, is_direct = open_fd(path, os.O_RDONLY, direct=mode)
        try:
            assert is_direct == bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        finally:
            os.close(fd)
    with defaults.set(direct_io="off"):
        fd, is_direct = open_fd(path, os.O_RDONLY)
        os.close(fd)
        assert is_direct is False
    with pytest.raises(E.PathNotFoundError) as info:
        open_fd(tmp_path / "missing", os.O_RDONLY, direct="off")
    assert isinstance(info.value, FileNotFoundError) and info.value.errno == errno.ENOENT
    with pytest.raises(ValueError):
        open_fd(path, os.O_RDONLY, direct="sometimes")


@root
def test_open_fd_direct_on_4k_filesystem(dio_dir: Path) -> None:
    for direct in (True, "on", "auto", None):
        fd, is_direct = open_fd(dio_dir / "d.bin", os.O_RDWR | os.O_CREAT, direct=direct)
        try:
            assert is_direct is True and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        finally:
            os.close(fd)


def test_request_constructors() -> None:
    buf = bytearray(8)
    assert Request.read(3, 10, 8, buf) == ("read", 3, 10, 8, buf, 0)
    assert Request.write(4, 0, 2, buf, 6) == Request("write", 4, 0, 2, buf, 6)
    assert Request.read(3, 0, 1, buf).buffer is buf
