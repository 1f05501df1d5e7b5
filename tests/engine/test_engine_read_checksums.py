"""Read checksums (``IOEngine.submit(..., checksums=...)``): every engine checks them the same way.

A read that carries an xxh3-64 and whose bytes differ, or that comes back short, ends with ``-EBADMSG``; the
others are unaffected. Runs on every engine and every kind of descriptor of the conformance suite, plus the
native engine's caller-side fallback (the path a build without ``xxhash.h`` takes).
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from sfstore import errors as E
from sfstore.engine import IOEngine, Request, get_engine

Target = Any  # tests/engine/conftest.py:Target
BLOCK = 4096


def _file(target: Target, name: str, size: int, seed: int) -> tuple[bytes, int]:
    data = random.Random(seed).randbytes(size)
    path = Path(target.dir) / name
    path.write_bytes(data)
    return data, target.open(path, os.O_RDONLY)


def _delta(engine: IOEngine, before: dict[str, int]) -> dict[str, int]:
    after = engine.stats()
    return {k: after[k] - before[k] for k in ("bytes_verified", "verify_failed", "errors", "bytes_read")}


def test_good_and_bad_checksums_in_one_batch(engine: IOEngine, target: Target) -> None:
    data, fd = _file(target, "sums.bin", 64 * BLOCK, 11)
    buf = mmap.mmap(-1, 8 * BLOCK)
    reqs = [Request.read(fd, i * 3 * BLOCK, BLOCK, buf, i * BLOCK) for i in range(6)]
    sums: list[int | None] = [xxhash.xxh3_64_intdigest(data[r.offset:r.offset + BLOCK]) for r in reqs]
    sums[2] ^= 1  # a wrong sum
    sums[4] = None  # not checked
    before = engine.stats()
    fut = engine.submit(reqs, checksums=sums)
    results = fut.results()
    assert results == [BLOCK, BLOCK, -errno.EBADMSG, BLOCK, BLOCK, BLOCK]
    for i, r in enumerate(reqs):  # the failed read's buffer holds what was read
        assert buf[i * BLOCK:(i + 1) * BLOCK] == data[r.offset:r.offset + BLOCK]
    d = _delta(engine, before)
    assert d["verify_failed"] == 1 and d["errors"] == 1
    assert d["bytes_verified"] == 5 * BLOCK
    with pytest.raises(E.ChecksumMismatchError) as info:
        fut.get()
    assert info.value.errno == errno.EBADMSG and "request 2 of 6" in str(info.value)
    assert isinstance(info.value, E.IOEngineError) and isinstance(info.value, OSError)


@pytest.mark.parametrize("waiter", ["wait", "poll"])
def test_large_reads_are_checked_with_or_without_a_waiter(engine: IOEngine, target: Target, waiter: str) -> None:
    """Large reads' checks may be queued for whichever thread is free (the waiter helps): a batch nobody waits
    for must finish its checks too."""
    size = 1 << 20
    data, fd = _file(target, "large.bin", 8 * size, 16)
    buf = mmap.mmap(-1, 8 * size)
    reqs = [Request.read(fd, i * size, size, buf, (7 - i) * size) for i in range(8)]
    sums: list[int | None] = [xxhash.xxh3_64_intdigest(data[i * size:(i + 1) * size]) for i in range(8)]
    sums[5] = (sums[5] or 0) ^ 1 << 63
    fut = engine.submit(reqs, checksums=sums)
    if waiter == "poll":
        deadline = time.monotonic() + 30
        while not fut.done():
            assert time.monotonic() < deadline, "a batch nobody waits for never finished its checks"
            time.sleep(0.001)
    assert fut.results() == [size] * 5 + [-errno.EBADMSG] + [size] * 2
    for i in range(8):
        assert buf[(7 - i) * size:(8 - i) * size] == data[i * size:(i + 1) * size]


def test_misaligned_and_offset_reads_are_checked(engine: IOEngine, target: Target) -> None:
    data, fd = _file(target, "odd.bin", 20 * BLOCK, 12)
    buf = bytearray(40000)
    reqs = [Request.read(fd, 777, 10000, buf, 3), Request.read(fd, 5 * BLOCK + 1, 20000, buf, 10010)]
    sums = [xxhash.xxh3_64_intdigest(data[777:10777]), xxhash.xxh3_64_intdigest(data[5 * BLOCK + 1:5 * BLOCK + 20001])]
    assert engine.submit(reqs, checksums=sums).get() == [10000, 20000]
    assert buf[3:10003] == data[777:10777]


def test_short_read_fails_its_checksum(engine: IOEngine, target: Target) -> None:
    data, fd = _file(target, "short.bin", 2 * BLOCK + 100, 13)
    buf = mmap.mmap(-1, 4 * BLOCK)
    # The sum of the bytes that exist: the read comes back short, which a checked read must not accept.
    fut = engine.submit([Request.read(fd, BLOCK, 2 * BLOCK, buf)], checksums=[xxhash.xxh3_64_intdigest(data[BLOCK:])])
    assert fut.results() == [-errno.EBADMSG]


def test_zero_length_read_checks_the_empty_sum(engine: IOEngine, target: Target) -> None:
    _data, fd = _file(target, "empty.bin", BLOCK, 14)
    empty = xxhash.xxh3_64_intdigest(b"")
    reqs = [Request.read(fd, 0, 0, bytearray(1)), Request.read(fd, 0, 0, bytearray(1))]
    assert engine.submit(reqs, checksums=[empty, empty ^ 1]).results() == [0, -errno.EBADMSG]


@pytest.mark.parametrize("bad", ["count", "write", "type", "bool"])
def test_bad_checksum_arguments_issue_nothing(engine: IOEngine, tmp_path: Path, bad: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\x01" * BLOCK)
    fd = os.open(path, os.O_RDWR)
    try:
        buf = bytearray(BLOCK)
        reqs = [Request.read(fd, 0, BLOCK, buf)]
        sums: list[Any] = [0]
        if bad == "count":
            sums = [0, 0]
        elif bad == "write":
            reqs = [Request.write(fd, 0, BLOCK, b"\x02" * BLOCK)]
        elif bad == "type":
            sums = ["0"]
        else:
            sums = [True]
        with pytest.raises(E.InvalidRequestError):
            engine.submit(reqs, checksums=sums)
        assert path.read_bytes() == b"\x01" * BLOCK and buf == bytearray(BLOCK)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_native_engine_without_native_xxh3_checks_on_caller(backend: str, tmp_path: Path) -> None:
    """The fallback a helper built without xxhash.h takes (forced here on a build that has it)."""
    from sfstore.engine import describe_engines

    if not describe_engines()["engines"][backend]["available"]:
        pytest.skip(f"{backend} engine unavailable here")
    from sfstore.engine.native import NativeEngine

    engine = NativeEngine(backend, 8, 2)
    engine._native_checksums = False
    try:
        data = random.Random(15).randbytes(4 * BLOCK)
        path = tmp_path / "fallback.bin"
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = bytearray(3 * BLOCK)
            reqs = [Request.read(fd, 0, BLOCK, buf, 0), Request.read(fd, BLOCK, BLOCK, buf, BLOCK),
                    Request.read(fd, 3 * BLOCK, 2 * BLOCK, buf, BLOCK)]  # short
            sums = [xxhash.xxh3_64_intdigest(data[:BLOCK]), 5, xxhash.xxh3_64_intdigest(data[3 * BLOCK:])]
            before = engine.stats()
            assert engine.submit(reqs, checksums=sums).results() == [BLOCK, -errno.EBADMSG, -errno.EBADMSG]
            d = _delta(engine, before)
            assert (d["verify_failed"], d["errors"], d["bytes_verified"]) == (2, 2, 3 * BLOCK)
        finally:
            os.close(fd)
    finally:
        engine.close()


def test_shared_engines_report_checksum_counters() -> None:
    stats = get_engine().stats()
    assert {"bytes_verified", "verify_failed"} <= set(stats)


def test_engine_dropped_while_checked_reads_are_in_flight(tmp_path: Path) -> None:
    """The last reference to a native engine may go with a batch still being checked; polling that batch to the
    end and dropping it must neither crash nor hang (run in a child, so an abort shows as its exit status)."""
    from sfstore.engine import describe_engines

    if not describe_engines()["engines"]["uring"]["available"]:
        pytest.skip("uring engine unavailable here")
    path = tmp_path / "drop.bin"
    path.write_bytes(random.Random(17).randbytes(8 << 20))
    code = f"""
import os, xxhash
from sfstore import _native
data = open({str(path)!r}, "rb").read()
fd = os.open({str(path)!r}, os.O_RDONLY)
sums = [xxhash.xxh3_64_intdigest(data[i << 20:(i + 1) << 20]) for i in range(8)]
for _ in range(40):
    engine = _native.IOEngine("uring", 8, 1, 1 << 20, 0)
    buf = bytearray(8 << 20)
    fut = engine.submit([("read", fd, i << 20, 1 << 20, buf, i << 20) for i in range(8)], True, sums)
    del engine
    while not fut.done():
        pass
    assert fut.results() == [1 << 20] * 8
    del fut
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stdout, proc.stderr)


def test_native_xxh3_matches_xxhash_on_any_contiguous_buffer() -> None:
    """The block store's value checksum is the native xxh3 where the helper has it: it must equal python-xxhash
    on every buffer kind and size (the GIL-free path starts at 64 KiB)."""
    from sfstore import _native

    if not _native.xxh3_available():
        pytest.skip("the native helper was built without xxhash.h")
    import numpy as np

    data = random.Random(18).randbytes(300_000)
    arr = np.frombuffer(data, np.uint8).copy()
    for obj in (b"", data[:100], data, memoryview(data)[7:200_007], bytearray(data), arr, arr[:65536]):
        assert _native.xxh3_64(obj) == xxhash.xxh3_64_intdigest(obj)
    with pytest.raises(E.InvalidRequestError):
        _native.xxh3_64(arr[::2])  # not contiguous


def test_checked_reads_from_many_threads(engine: IOEngine, target: Target) -> None:
    """Several threads, each with batches of large checked reads in flight (queued checks shared by every waiter):
    every batch ends, with the right bytes and the right verdicts."""
    import threading

    size = 256 << 10
    data, fd = _file(target, "threads.bin", 32 * size, 19)
    sums = [xxhash.xxh3_64_intdigest(data[i * size:(i + 1) * size]) for i in range(32)]
    failures: list[str] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        buf = mmap.mmap(-1, 8 * size)
        try:
            for _ in range(10):
                picks = [rng.randrange(32) for _ in range(8)]
                bad = rng.randrange(8)
                want = [sums[p] for p in picks]
                want[bad] ^= 1
                futs = [engine.submit([Request.read(fd, p * size, size, buf, j * size)], checksums=[want[j]])
                        for j, p in enumerate(picks)]
                got = [f.results()[0] for f in futs]
                expect = [size] * 8
                expect[bad] = -errno.EBADMSG
                if got != expect:
                    failures.append(f"thread {t}: {got} != {expect}")
                for j, p in enumerate(picks):
                    if buf[j * size:(j + 1) * size] != data[p * size:(p + 1) * size]:
                        failures.append(f"thread {t}: bytes of block {p} differ")
        finally:
            buf.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a batch never ended"
    assert not failures, failures[:3]


def test_wait_with_a_timeout_returns_in_time_while_checks_are_queued(engine: IOEngine, target: Target) -> None:
    """A waiter helps with queued checks, but not past its timeout: wait(0) answers at once."""
    size = 1 << 20
    data, fd = _file(target, "timeout.bin", 12 * size, 20)
    buf = mmap.mmap(-1, 12 * size)
    reqs = [Request.read(fd, i * size, size, buf, i * size) for i in range(12)]
    fut = engine.submit(reqs, checksums=[xxhash.xxh3_64_intdigest(data[i * size:(i + 1) * size]) for i in range(12)])
    t0 = time.monotonic()
    fut.wait(0)
    assert time.monotonic() - t0 < 0.5
    assert fut.get() == [size] * 12
