"""The demo's storage steps: a round trip through the file path, and hot blocks in the block store."""

from __future__ import annotations

import hashlib
import os
import time
from typing import TYPE_CHECKING, Any

from sfstore import defaults, errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.paths.base import Range
from sfstore.paths.file import enable_direct

if TYPE_CHECKING:
    from sfstore.router import Router

__all__ = ["file_round_trip", "hot_blocks"]

MiB = 1 << 20


def file_round_trip(router: Router, size: int = 64 * MiB, chunk: int = 4 * MiB) -> dict[str, Any]:
    """Write ``size`` bytes to ``<data_dir>/demo/roundtrip.bin`` and read them back through ``router``'s file path
    for the data directory (requests of ``chunk`` bytes, one buffer each).

    The write goes from registered buffers as ``chunk``-sized ranges of one :meth:`FilePath.submit` batch
    (O_DIRECT where the filesystem allows), is fsynced, its pages are dropped (``posix_fadvise(DONTNEED)``) so
    the read is cold, and the read lands in registered buffers. One extra misaligned read shows the bounce
    path. Returns what happened, with the path's counters for the round trip.
    """
    fp = router.location(defaults.get("data_dir"), chunk_size=chunk)
    before = fp.counters.snapshot()  # the path outlives the step: the step reports what it added
    fp.mkdir("demo", exist_ok=True)
    path = fp.full("demo/roundtrip.bin")
    nchunks = max(1, size // chunk)
    size = nchunks * chunk
    with RegisteredBufferPool(chunk) as pool:
        bufs = [pool.acquire() for _ in range(nchunks)]
        digest_in = hashlib.blake2b()
        seed = os.urandom(chunk)
        for i, b in enumerate(bufs):
            mv = memoryview(b)
            mv[:] = seed
            mv[:8] = i.to_bytes(8, "little")  # every chunk differs, so a misplaced chunk is caught
            digest_in.update(mv)
            mv.release()
        # Opened beneath the data directory (demo/ made there), never by a name resolved ahead.
        fd, _ = fp.open_beneath("demo/roundtrip.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            direct = fp.direct and enable_direct(fd, path, required=defaults.get("direct_io") == "on")
        except BaseException:
            os.close(fd)
            raise
        try:
            t0 = time.perf_counter()
            fp.submit([Range.write(i * chunk, chunk, b, 0, fd) for i, b in enumerate(bufs)]).get()
            os.fsync(fd)
            t_write = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for b in bufs:
                memoryview(b)[:] = bytes(chunk)
            t0 = time.perf_counter()
            got = fp.submit([Range.read(i * chunk, chunk, b, 0, fd) for i, b in enumerate(bufs)]).get()
            t_read = time.perf_counter() - t0
            digest_out = hashlib.blake2b()
            for b in bufs:
                mv = memoryview(b)
                digest_out.update(mv)
                mv.release()
            odd = bytearray(10_000)
            # misaligned in memory and on disk: bounced on O_DIRECT
            (n_odd,) = fp.submit([Range.read(12_345, len(odd) - 3, odd, 3, fd)]).get()
            odd_ok = bytes(odd[3 : 3 + n_odd]) == _expected(seed, chunk, 12_345, n_odd)
        finally:
            os.close(fd)
        fp.file_done()
        for b in bufs:
            b.release()
        pool_stats = pool.stats()
    desc = fp.describe()
    return {
        "path": path,
        "engine": desc["engine"],
        "parallelism": fp.parallelism,
        "chunk_size": fp.chunk_size,
        "o_direct": direct,
        "bytes": size,
        "verified": digest_in.digest() == digest_out.digest() and sum(got) == size and odd_ok,
        "write_gib_s": size / t_write / (1 << 30),
        "read_gib_s": size / t_read / (1 << 30),
        "counters": {k: v - before.get(k, 0) for k, v in desc["counters"].items()},
        "fallbacks": desc["fallbacks"],
        "pool": pool_stats,
    }


def _expected(seed: bytes, chunk: int, offset: int, n: int) -> bytes:
    out = bytearray()
    pos = offset
    while len(out) < n:
        i, within = divmod(pos, chunk)
        block = i.to_bytes(8, "little") + seed[8:]
        take = min(n - len(out), chunk - within)
        out += block[within : within + take]
        pos += take
    return bytes(out)


def hot_blocks(router: Router, blocks: int = 256, block_size: int = 64 << 10) -> dict[str, Any]:
    """Put ``blocks`` hot blocks into the block store on the embedded default (an image file under
    ``<data_dir>/hot/``) in batches, flush, read them back into a registered buffer, reopen the store and read
    them again: the index survives the restart."""
    from sfstore.blocks import BlockStore
    from sfstore.paths.block import BlockPath

    image = router.path("hot")  # the BlockPath the router chose (an image file by default)
    if not isinstance(image, BlockPath):
        raise errors.ConfigError(f"the demo's hot blocks need the block path; the hot class is on the {image.kind} "
                                 "path")
    blobs = {f"block-{i:04d}": hashlib.shake_256(b"%d" % i).digest(block_size) for i in range(blocks)}
    keys = list(blobs)
    with BlockStore(image) as store:
        t0 = time.perf_counter()
        for first in range(0, blocks, 64):
            store.put_many({k: blobs[k] for k in keys[first:first + 64]})
        store.flush()
        t_put = time.perf_counter() - t0
        ok = True
        with RegisteredBufferPool(64 * block_size) as pool:
            buf = pool.acquire()
            try:
                view = memoryview(buf)
                t0 = time.perf_counter()
                for first in range(0, blocks, 64):
                    batch = keys[first:first + 64]
                    dests = [view[j * block_size:(j + 1) * block_size] for j in range(len(batch))]
                    got = store.get_into(batch, dests)
                    ok = ok and all(n == block_size and bytes(d) == blobs[k] for n, d, k in zip(got, dests, batch,
                                                                                                 strict=True))
                    del dests
                t_get = time.perf_counter() - t0
                del view
            finally:
                buf.release()
        desc = store.describe()
    with BlockStore(image) as again:
        recovered = again.recovered
        ok = ok and all(again.get(k) == blobs[k] for k in keys[:: max(1, blocks // 16)])
    mib = blocks * block_size / MiB
    return {"device": desc["device"], "transport": desc["transport"], "lba_size": desc["lba_size"],
            "capacity": desc["capacity"], "classes": desc["store"]["classes"], "fallbacks": desc["fallbacks"],
            "counters": desc["counters"], "put_mib_s": mib / t_put, "get_mib_s": mib / t_get,
            "blocks": blocks, "block_size": block_size, "recovered": recovered, "verified": ok}
