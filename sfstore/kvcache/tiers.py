"""The tiers of the KV cache: pinned host memory, the hot block store (NVMe), a shared directory (NFS).

Every tier holds whole blocks. A pinned slot is a registered buffer holding just the block (2 MiB multiples get
huge pages: a 2 MiB request into scattered 4 KiB pages is split by many devices) plus a small registered buffer
for the 4096-byte header that a shared file starts with, so a block moves between a slot and a shared file or
the block store with no copy.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sfstore import errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.checksums import xxh3_64
from sfstore.kvcache.geometry import KEY_BYTES, KVGeometry
from sfstore.paths.file import FilePath

__all__ = ["HEADER", "Slot", "PinnedTier", "SharedTier"]

HEADER = 4096  # bytes before the block in a slot and in a shared file
_MAGIC = b"SFKVBLK1"
_HDR = struct.Struct("<8sH6x16s32sQQ")  # magic, version, geometry fingerprint, key, length, xxh3-64 of the block
_SUM = struct.Struct("<Q")


@dataclass(eq=False)
class Slot:
    """A block in a registered buffer (``data``) and its shared-file header (``header``, ``HEADER`` bytes);
    ``readers`` pin it against eviction."""

    buffer: Any
    header: Any
    key: bytes = b""
    readers: int = 0
    checksum: int = 0

    def data(self, nbytes: int) -> memoryview:
        return memoryview(self.buffer)[:nbytes]


def encode_header(geom: KVGeometry, key: bytes, checksum: int) -> bytes:
    body = _HDR.pack(_MAGIC, 1, geom.fingerprint(), key, geom.block_bytes, checksum)
    return body + _SUM.pack(xxh3_64(body))


def check_header(view: memoryview, geom: KVGeometry, key: bytes) -> int | None:
    """The block checksum in a slot's header when the header is intact and names ``key`` and ``geom``."""
    end = _HDR.size
    if view[:8] != _MAGIC or _SUM.unpack_from(view, end)[0] != xxh3_64(view[:end]):
        return None
    _m, version, fp, k, length, checksum = _HDR.unpack_from(view)
    if version != 1 or fp != geom.fingerprint() or k != key or length != geom.block_bytes:
        return None
    return int(checksum)


class PinnedTier:
    """Blocks in registered (pinned) host memory, LRU within a byte budget.

    Slots come from a :class:`~sfstore.buffers.RegisteredBufferPool`; a slot pinned by a reader or an
    in-flight write is never evicted (the budget may be exceeded while many are in flight).
    """

    def __init__(self, geom: KVGeometry, budget_bytes: int) -> None:
        self.geom = geom
        self.slot_bytes = -(-geom.block_bytes // 4096) * 4096
        self.capacity = max(0, budget_bytes // (self.slot_bytes + HEADER))
        self._pool = RegisteredBufferPool(self.slot_bytes)
        self._headers = RegisteredBufferPool(HEADER)
        self._free: list[Slot] = []
        self.entries: OrderedDict[bytes, Slot] = OrderedDict()
        self.lock = threading.RLock()

    def take(self) -> Slot:
        """A slot to fill (a free one, else a new buffer); give it back with :meth:`insert` or :meth:`drop`."""
        with self.lock:
            if self._free:
                slot = self._free.pop()
                slot.key, slot.readers, slot.checksum = b"", 1, 0
                return slot
        return Slot(self._pool.acquire(), self._headers.acquire(), readers=1)

    def insert(self, key: bytes, slot: Slot, checksum: int) -> None:
        """Make ``slot`` (filled, still pinned by the caller) the resident copy of ``key``; evict beyond budget."""
        with self.lock:
            slot.key, slot.checksum = key, checksum
            old = self.entries.pop(key, None)
            if old is not None and old is not slot:
                self._retire(old)
            self.entries[key] = slot
            self._trim()

    def drop(self, slot: Slot) -> None:
        """Give back a slot taken with :meth:`take` that was not inserted."""
        with self.lock:
            slot.readers = max(0, slot.readers - 1)
            if slot.readers == 0 and self.entries.get(slot.key) is not slot:
                self._free.append(slot)

    def get(self, key: bytes) -> Slot | None:
        """The resident slot of ``key``, pinned (call :meth:`unpin`), and made most recently used."""
        with self.lock:
            slot = self.entries.get(key)
            if slot is not None:
                slot.readers += 1
                self.entries.move_to_end(key)
            return slot

    def unpin(self, slot: Slot) -> None:
        with self.lock:
            slot.readers -= 1
            if slot.readers == 0 and self.entries.get(slot.key) is not slot:
                self._free.append(slot)
            self._trim()

    def remove(self, key: bytes) -> bool:
        with self.lock:
            slot = self.entries.pop(key, None)
            if slot is None:
                return False
            self._retire(slot)
            return True

    def _retire(self, slot: Slot) -> None:
        if slot.readers == 0:
            self._free.append(slot)

    def _trim(self) -> None:
        while len(self.entries) > self.capacity:
            victim = next((s for s in self.entries.values() if s.readers == 0), None)
            if victim is None:
                return
            del self.entries[victim.key]
            self._free.append(victim)

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            return key in self.entries

    def close(self) -> None:
        with self.lock:
            slots = list(self.entries.values()) + self._free
            self.entries.clear()
            self._free = []
        for s in slots:
            if s.readers == 0:
                s.buffer.release()
                s.header.release()
        self._pool.close()
        self._headers.close()


class SharedTier:
    """Blocks as files in a shared directory (NFS over RDMA on a cluster), content-addressed by key.

    ``<dir>/<key[0:1] hex>/<key hex>.kvb``: a 4096-byte header (magic, geometry, key, length, xxh3-64) and the
    block. Files are published atomically (temporary name, then rename): a reader in any process or node sees
    a whole block or none, and a killed writer leaves only a temporary file, which listings ignore.
    """

    def __init__(
        self, geom: KVGeometry, directory: str | os.PathLike[str], *, fsync: bool = False, on: FilePath | None = None
    ) -> None:
        self.geom = geom
        if on is None:
            self.fp = FilePath(directory)
            self.prefix = ""
        else:  # a directory under an existing file path (the router's): its counters show this tier's bytes
            self.fp = on
            self.prefix = os.fspath(directory).strip("/") + "/"
            self.fp.resolve(self.prefix)  # refuses a directory outside it
        self.fsync = fsync

    def name(self, key: bytes) -> str:
        h = key.hex()
        return f"{self.prefix}{h[:2]}/{h}.kvb"

    def contains(self, key: bytes) -> bool:
        return os.path.isfile(self.fp.resolve(self.name(key)))

    def write(self, key: bytes, slot: Slot) -> bool:
        """Publish the block in ``slot`` (its header is filled here); ``False`` when it is already there."""
        if self.contains(key):
            return False
        hview = memoryview(slot.header)
        hdr = encode_header(self.geom, key, slot.checksum)
        hview[:len(hdr)] = hdr
        hview[len(hdr):HEADER] = bytes(HEADER - len(hdr))
        with self.fp.open_writer(self.name(key), fsync=self.fsync) as w:  # both parts straight from the slot
            w.write(hview[:HEADER])
            w.write(slot.data(self.geom.block_bytes))
        return True

    def write_view(self, key: bytes, data: memoryview, checksum: int) -> bool:
        """Publish ``data`` (a block in the caller's memory) under ``key``; ``False`` when it is already there."""
        if self.contains(key):
            return False
        with RegisteredBufferPool(HEADER) as pool:
            hbuf = pool.acquire()
            try:
                hview = memoryview(hbuf)
                hdr = encode_header(self.geom, key, checksum)
                hview[:len(hdr)] = hdr
                hview[len(hdr):] = bytes(HEADER - len(hdr))
                with self.fp.open_writer(self.name(key), fsync=self.fsync) as w:
                    w.write(hview)
                    w.write(data)
                del hview
            finally:
                hbuf.release()
        return True

    def read_view(self, key: bytes, data: memoryview) -> bool:
        """Read the block of ``key`` into ``data`` (caller's memory), verified; ``False`` for a missing, foreign
        or corrupt file (``data`` may then hold garbage)."""
        n = self.geom.block_bytes
        with RegisteredBufferPool(HEADER) as pool:
            hbuf = pool.acquire()
            try:
                try:
                    got = self.fp.read_ranges_into(self.name(key), [(0, HEADER, hbuf, 0), (HEADER, n, data, 0)])
                except errors.PathNotFoundError:
                    return False
                checksum = check_header(memoryview(hbuf), self.geom, key)
            finally:
                hbuf.release()
        return got == [HEADER, n] and checksum is not None and xxh3_64(data[:n]) == checksum

    def read_into(self, key: bytes, slot: Slot) -> bool:
        """Read the block into ``slot``; ``False`` for a missing, foreign or corrupt file (never returned)."""
        n = self.geom.block_bytes
        try:
            got = self.fp.read_ranges_into(self.name(key), [(0, HEADER, slot.header, 0), (HEADER, n, slot.buffer, 0)])
        except errors.PathNotFoundError:
            return False
        checksum = check_header(memoryview(slot.header), self.geom, key)
        if got != [HEADER, n] or checksum is None or xxh3_64(slot.data(n)) != checksum:
            return False
        slot.checksum = checksum
        return True

    def remove(self, key: bytes) -> bool:
        try:
            os.unlink(self.fp.resolve(self.name(key)))
            return True
        except FileNotFoundError:
            return False

    def count(self) -> int:
        root = self.fp.resolve(self.prefix)
        n = 0
        for _dirpath, _dirs, files in os.walk(root):
            n += sum(1 for f in files if f.endswith(".kvb") and not self.fp.is_temporary(f))
        return n


__all__ += ["encode_header", "check_header", "KEY_BYTES"]
