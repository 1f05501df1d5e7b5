"""The tiers of the KV cache: pinned host memory, the hot block store (NVMe), a shared directory (NFS).

Every tier holds whole blocks. A pinned slot is a registered buffer holding just the block (2 MiB multiples get
huge pages: a 2 MiB request into scattered 4 KiB pages is split by many devices) plus a small registered buffer
for the 4096-byte header that a shared file starts with, so a block moves between a slot and a shared file or
the block store with no copy.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

from sfstore import errors
from sfstore.buffers import RegisteredBuffer, RegisteredBufferPool
from sfstore.checksums import SHARED_FILE_SUMS, SumKind, sum_of, xxh3_64, xxh3_64_many
from sfstore.counters import Counters
from sfstore.device_verdict import damaged_on_storage, warn_disagreement
from sfstore.kvcache.chains import KeyChains
from sfstore.kvcache.deadline import OK, TIMEOUT, QuarantineRecorder, TierGuard, late
from sfstore.kvcache.geometry import KEY_BYTES, KVGeometry
from sfstore.kvcache.shared_budget import SharedBudget, namespace_prefix
from sfstore.kvcache.shared_chunks import CHUNK_SUFFIX, ChunkFiles, Entry, parse_name
from sfstore.kvcache.tier import KVBatch, KVTier, ReadStatus, WriteStatus, read_status
from sfstore.paths.base import PathFuture, Range
from sfstore.paths.file import AtomicWriter, FilePath, set_blocking

if TYPE_CHECKING:
    from sfstore.paths.device import DevicePath

__all__ = ["HEADER", "Slot", "Lease", "release_all", "lease_again", "PinnedTier", "SharedTier"]

HEADER = 4096  # bytes before the block in a slot and in a shared file
_MAGIC = b"SFKVBLK1"
# magic, version (the block's checksum kind: SHARED_FILE_SUMS), geometry fingerprint, key, length, block checksum
_HDR = struct.Struct("<8sH6x16s32sQQ")
_SUM = struct.Struct("<Q")


class _BudgetOptions(TypedDict, total=False):
    """The :class:`~sfstore.kvcache.shared_budget.SharedBudget` timings a shared tier may set."""

    heartbeat_s: float
    refresh_s: float
    rescan_s: float
    stale_s: float
    touch_s: float


@dataclass(eq=False)
class Slot:
    """A block in a registered buffer (``buffer``) and its shared-file header (``header``, ``HEADER`` bytes).

    The block has a buffer of its own, not a slice after its header in one buffer (one read request per shared
    file instead of two): a buffer of exactly a block's size gets transparent huge pages where blocks are a
    multiple of 2 MiB, and the copies out of it run faster.

    ``readers`` counts the :class:`Lease` objects out on the slot; it belongs to the :class:`PinnedTier` that made
    the slot, which reads and changes it only under its lock. Nothing else touches it: hold a lease instead.
    """

    buffer: RegisteredBuffer
    header: RegisteredBuffer
    key: bytes = b""
    readers: int = 0
    checksum: int = 0
    # a torch uint8 tensor over ``buffer``, made on first use by a batched copy and kept for the slot's life
    # (torch is optional: nothing here imports it)
    tensor: Any = None

    def data(self, nbytes: int) -> memoryview:
        return memoryview(self.buffer)[:nbytes]


class Lease:
    """One hold on a pinned slot: while any lease on a slot is out, the tier neither evicts the slot nor gives it
    to another block, so its bytes stay those of its block.

    Made by the tier (:meth:`PinnedTier.take`, :meth:`PinnedTier.lease`) or from another lease (:meth:`another`);
    :meth:`release` gives it back, exactly once however often and from however many threads it is called (also
    as a context manager). The count behind it is only ever changed under the tier's lock.
    """

    __slots__ = ("_out", "_tier", "slot")

    def __init__(self, tier: PinnedTier, slot: Slot) -> None:
        self.slot = slot
        self._tier = tier
        self._out = True  # changed under the tier's lock

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return not self._out

    def another(self) -> Lease:
        """A second lease on the same slot, for work that may outlive this one (a background write reading the
        slot). Raises :class:`~sfstore.errors.InvalidRequestError` once this lease is released (the slot may
        hold another block by then)."""
        return self._tier._another(self)

    def release(self) -> None:
        """Give the lease back (once: later calls do nothing); a slot no lease holds that is not resident is free
        for the next block."""
        self._tier._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Releasable(Protocol):
    """What :func:`release_all` gives back: a :class:`Lease`, a registered buffer."""

    def release(self) -> None: ...


def release_all(held: Iterable[Releasable | None]) -> None:
    """Release each lease or buffer (``None`` entries, a miss's place, are skipped)."""
    for item in held:
        if item is not None:
            item.release()


def lease_again(leases: Iterable[Lease]) -> Callable[[], None]:
    """Another lease on each slot for an operation that reads or fills it; the function returned releases them
    (once, however often it is called): at the operation's end, which for one abandoned past its deadline comes
    when its worker returns."""
    extra = [lease.another() for lease in leases]
    return functools.partial(release_all, extra)


def encode_header(geom: KVGeometry, key: bytes, checksum: int, kind: SumKind = SumKind.XXH3) -> bytes:
    """A shared file's header; ``kind`` says which checksum the block carries."""
    body = _HDR.pack(_MAGIC, SHARED_FILE_SUMS.code(kind), geom.fingerprint(), key, geom.block_bytes, checksum)
    return body + _SUM.pack(xxh3_64(body))


def read_header(view: memoryview, geom: KVGeometry, key: bytes) -> tuple[int, SumKind] | None:
    """``(checksum, kind)`` of the block when the header is intact and names ``key`` and ``geom``."""
    end = _HDR.size
    if view[:8] != _MAGIC or _SUM.unpack_from(view, end)[0] != xxh3_64(view[:end]):
        return None
    _m, version, fp, k, length, checksum = _HDR.unpack_from(view)
    kind = SHARED_FILE_SUMS.kind(version)
    if kind is None or fp != geom.fingerprint() or k != key or length != geom.block_bytes:
        return None
    return int(checksum), kind


def check_header(view: memoryview, geom: KVGeometry, key: bytes) -> int | None:
    """The block's xxh3-64 in a header that is intact, names ``key`` and ``geom``, and was written by a host put
    (a GPU-direct put's kvsum64 is not an xxh3: ``None``, as for any header that does not fit)."""
    found = read_header(view, geom, key)
    return found[0] if found is not None and found[1] is SumKind.XXH3 else None


class PinnedTier(KVTier):
    """Blocks in registered (pinned) host memory, LRU within a byte budget.

    Slots come from a :class:`~sfstore.buffers.RegisteredBufferPool`. Callers hold slots through :class:`Lease`
    objects: a slot with a lease out (a reader, an in-flight write) is never evicted nor reused (the budget may
    be exceeded while many are out). Leases are the only way to hold a slot: the reader counts behind them are
    read and changed only here, under the tier's lock.

    As a :class:`~sfstore.kvcache.tier.KVTier` it reads into and writes from ``host`` batches (a copy of the
    bytes); the store holds its blocks by lease instead (:meth:`lease`, :meth:`take`, :meth:`insert`): a read of
    the pinned tier into its own slots is a lease.
    """

    name = "pinned"

    def __init__(self, geom: KVGeometry, budget_bytes: int) -> None:
        self.geom = geom
        self.slot_bytes = -(-geom.block_bytes // 4096) * 4096
        self.bytes_per_slot = self.slot_bytes + HEADER  # the registered memory one slot takes (block and header)
        self.capacity = max(0, budget_bytes // self.bytes_per_slot)
        self._pool = RegisteredBufferPool(self.slot_bytes)
        self._headers = RegisteredBufferPool(HEADER)
        self._free: list[Slot] = []
        self._made = 0  # slots allocated so far (each lives until close)
        self._every: list[Slot] = []  # those slots
        self.entries: OrderedDict[bytes, Slot] = OrderedDict()
        self._lock = threading.RLock()
        self._removed: list[bytes] | None = None  # keys that left the tier since take_removed (when tracked)

    def take(self) -> Lease:
        """A slot to fill, leased to the caller: a free one, else (the tier full of blocks) the least recently used
        block's, else a new buffer. Make it resident with :meth:`insert`, or release the lease to give it back.
        A full tier so reuses its memory rather than allocating past its budget (which only blocks all leased at
        once make it do)."""
        with self._lock:
            slot = self._free.pop() if self._free else self._evict_for_reuse()
            if slot is not None:
                slot.key, slot.readers, slot.checksum = b"", 1, 0
                return Lease(self, slot)
            self._made += 1
        return Lease(self, self._new_slot(readers=1))

    def lease(self, key: bytes) -> Lease | None:
        """A lease on the resident slot of ``key`` (made most recently used), or ``None`` when it is not here."""
        with self._lock:
            slot = self.entries.get(key)
            if slot is None:
                return None
            slot.readers += 1
            self.entries.move_to_end(key)
            return Lease(self, slot)

    def _another(self, lease: Lease) -> Lease:
        with self._lock:
            if not lease._out:
                raise errors.InvalidRequestError("a released lease on a pinned slot cannot be extended")
            lease.slot.readers += 1
            return Lease(self, lease.slot)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if not lease._out:
                return
            lease._out = False
            slot = lease.slot
            slot.readers -= 1
            if slot.readers == 0 and self.entries.get(slot.key) is not slot:
                self._free.append(slot)
            self._trim()

    @property
    def leased(self) -> int:
        """Slots with a lease out (resident or not)."""
        with self._lock:
            return sum(1 for s in self._every if s.readers > 0)

    def _evict_for_reuse(self) -> Slot | None:
        """Once the tier holds as many blocks as its capacity: the least recently used unleased one leaves, and its
        slot is returned (under the lock). Slots out for reads and writes in flight do not count: while they are
        out, new ones are allocated, as before the tier is full."""
        return self._evict_lru() if len(self.entries) >= self.capacity else None

    def _evict_lru(self) -> Slot | None:
        """Take the least recently used unleased block out of the tier (under the lock): its slot, or ``None``
        when every block is leased."""
        victim = next((s for s in self.entries.values() if s.readers == 0), None)
        if victim is not None:
            del self.entries[victim.key]
            self._note_removed(victim.key)
        return victim

    def _new_slot(self, readers: int = 0) -> Slot:
        try:
            buf = self._pool.acquire()
            try:
                slot = Slot(buf, self._headers.acquire(), readers=readers)
            except BaseException:
                buf.release()
                raise
        except BaseException:
            with self._lock:
                self._made -= 1
            raise
        with self._lock:
            self._every.append(slot)
        return slot

    @property
    def full(self) -> bool:
        """Whether every slot the capacity allows is allocated."""
        with self._lock:
            return self._made >= self.capacity

    @property
    def idle(self) -> int:
        """Slots allocated that hold no block, ready for :meth:`take`."""
        with self._lock:
            return len(self._free)

    def ready(self, idle: int) -> bool:
        """Whether ``idle`` slots hold no block, or the tier's capacity is allocated (:meth:`top_up` has nothing to
        do)."""
        with self._lock:
            return len(self._free) >= idle or self.full

    def top_up(self, idle: int) -> int:
        """Allocate slots until :meth:`ready` (``idle`` hold no block): the blocks that come next fill them without
        allocating. Returns the slots allocated by this call."""
        return self._allocate_until(lambda: self.ready(idle))

    def reserve(self, n: int) -> int:
        """Allocate slots now until ``n`` exist (at most the tier's capacity), so that the first reads into them
        do not pay for allocating registered memory (``mmap`` and ``mlock``: far more than the copy into them)
        on the way to the caller. Returns the slots allocated by this call."""
        return self._allocate_until(lambda: self._made >= min(n, self.capacity))

    def _allocate_until(self, enough: Callable[[], bool]) -> int:
        """Allocate idle slots one at a time (the lock is not held while allocating) until ``enough()`` (asked under
        the lock); returns how many."""
        made = 0
        while True:
            with self._lock:
                if enough():
                    return made
                self._made += 1
            slot = self._new_slot()
            with self._lock:
                self._free.append(slot)
            made += 1

    def insert(self, key: bytes, lease: Lease, checksum: int) -> None:
        """Make the leased slot (filled by the caller, who keeps the lease) the resident copy of ``key``; evict
        beyond budget."""
        with self._lock:
            if not lease._out:
                raise errors.InvalidRequestError("a pinned slot is made resident under a lease, not after it")
            slot = lease.slot
            slot.key, slot.checksum = key, checksum
            old = self.entries.pop(key, None)
            if old is not None and old is not slot:
                self._retire(old)
            self.entries[key] = slot
            self._trim()

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                slot = self.entries.pop(key, None)
                if slot is None:
                    continue
                self._note_removed(key)
                self._retire(slot)
                removed += 1
        return removed

    # -- the tier contract ------------------------------------------------------------------------------------
    @property
    def in_memory(self) -> bool:
        return True

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self.entries for k in keys]

    def count(self) -> int | None:
        return len(self)

    def read_into(self, keys: Sequence[bytes], dests: KVBatch) -> list[ReadStatus]:
        """Copy each resident block into its ``host`` destination (a byte view of a block)."""
        _host_only(dests, "read")
        n = self.geom.block_bytes
        out: list[ReadStatus] = []
        for i, k in enumerate(keys):
            lease = self.lease(k)
            if lease is None:
                out.append("missing")
                continue
            with lease:
                dests.items[i][:n] = lease.slot.data(n)
                dests.checksums[i] = lease.slot.checksum or None
            out.append("hit")
        return out

    def write(self, keys: Sequence[bytes], srcs: KVBatch) -> list[WriteStatus]:
        """Copy each ``host`` source (a byte view of a block) into a slot and make it resident."""
        _host_only(srcs, "write")
        n = self.geom.block_bytes
        for i, k in enumerate(keys):
            with self.take() as lease:
                lease.slot.data(n)[:] = srcs.items[i]
                self.insert(k, lease, srcs.checksums[i] or 0)
        return ["written"] * len(keys)

    def _retire(self, slot: Slot) -> None:
        if slot.readers == 0:
            self._free.append(slot)

    def _trim(self) -> None:
        while len(self.entries) > self.capacity:
            victim = self._evict_lru()
            if victim is None:
                return
            self._free.append(victim)

    def track_removals(self) -> None:
        """From now on, note each key that leaves the tier (evicted or removed) for :meth:`take_removed`."""
        with self._lock:
            if self._removed is None:
                self._removed = []

    def take_removed(self) -> list[bytes]:
        """The keys that left the tier since the last call (in order; none unless :meth:`track_removals`)."""
        with self._lock:
            out = self._removed or []
            if self._removed is not None:
                self._removed = []
            return out

    def _note_removed(self, key: bytes) -> None:
        if self._removed is not None:  # (under the lock)
            self._removed.append(key)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self.entries

    def __len__(self) -> int:
        """Blocks resident."""
        with self._lock:
            return len(self.entries)

    def close(self) -> None:
        """Release the memory of every slot no lease holds (a slot still leased keeps its buffers)."""
        with self._lock:
            slots = [s for s in self._every if s.readers == 0]
            self._every = [s for s in self._every if s.readers != 0]
            self.entries.clear()
            self._free = []
        for s in slots:
            s.tensor = None  # the buffer's last export, before its release
            s.buffer.release()
            s.header.release()
        self._pool.close()
        self._headers.close()


class SharedTier(KVTier):
    """Blocks as files in a shared directory (NFS over RDMA on a cluster), content-addressed by key.

    ``<dir>/<key[0:1] hex>/<key hex>.kvb``: a 4096-byte header (magic, geometry, key, length, xxh3-64) and the
    block. Files are published atomically (temporary name, then rename): a reader in any process or node sees
    a whole block or none, and a killed writer leaves only a temporary file, which listings ignore.

    Reads never leave the directory and never block on what is not a block file: each file is opened beneath
    the directory's descriptor (``openat2`` with ``RESOLVE_BENEATH``: ``..`` and symlinks that lead out are
    refused by the kernel) with ``O_NONBLOCK`` (a FIFO does not wait for a writer), and only a regular file of
    exactly a block's size is read. A read answers ``"hit"``, ``"missing"``, ``"corrupt"`` (a regular file that
    fails verification: wrong size, header or checksum; it is removed, so a later put publishes the block
    again) or ``"unreadable"`` (a directory, FIFO, socket, a symlink out, or a read that failed).
    :meth:`read_many_into` and :meth:`read_many_views` read many blocks as one batch of the file path (every file
    opened and checked first, all their reads in flight at once, each verified after), each answered as alone.

    ``namespace`` (``cache_namespace``): blocks live under ``ns/<namespace>/`` in the directory (the default
    namespace, ``""``, directly in it), and this tier neither reads nor evicts another namespace's.
    ``budget_bytes`` bounds the bytes the namespace holds, kept by every process and node that writes it (see
    :mod:`sfstore.kvcache.shared_budget`; 0: unbounded); ``budget_options`` go to
    :class:`~sfstore.kvcache.shared_budget.SharedBudget`.

    ``timeout_s`` is the deadline of each operation (0: none), run on the tier's own worker threads (see
    :mod:`sfstore.kvcache.deadline`): past it a read answers ``"timeout"`` (a miss), a write ``None`` (dropped),
    and the tier is quarantined (``"quarantined"``, ``None``, at once and without I/O) for a back-off that
    starts at ``quarantine_s``. A read reaches the caller's memory only from the caller's thread, once verified
    and in time; a write that missed its deadline is not published if it has not been yet.
    """

    name = "shared"
    guard: TierGuard

    def __init__(
        self, geom: KVGeometry, directory: str | os.PathLike[str], *, fsync: bool = False, on: FilePath | None = None,
        namespace: str = "", budget_bytes: int = 0, budget_options: _BudgetOptions | None = None,
        timeout_s: float = 0.0, quarantine_s: float = 1.0, chunk_blocks: int = 0, chains: KeyChains | None = None,
    ) -> None:
        self.geom = geom
        ns = namespace_prefix(namespace)
        if on is None:  # the router's path at the directory: its counters are the process's (describe())
            import sfstore

            self.fp = sfstore.open().location(directory, create=True)
            self.prefix = ns
        else:  # a directory under an existing file path (the router's): its counters show this tier's bytes
            self.fp = on
            self.prefix = os.fspath(directory).strip("/") + "/" + ns
            self.fp.full(self.prefix)  # refuses '..' above its root (symlinks are met beneath it, at each use)
        self.namespace = namespace
        self.budget = SharedBudget(self.fp, self.prefix, budget_bytes, namespace=namespace, **(budget_options or {}))
        # the quarantine's record goes to this host's state directory and to the shared directory, where other
        # nodes' probes and `sfstore kv du` see it
        self.guard = TierGuard("shared", timeout_s, quarantine_s, workers=8, max_abandoned=16,
                               recorder=QuarantineRecorder.for_shared(self.budget))
        self.fsync = fsync
        self.slot_bytes = -(-geom.block_bytes // 4096) * 4096
        self._dirfd: int | None = None
        self._dir_lock = threading.Lock()
        self._writers: ThreadPoolExecutor | None = None
        # A shared read lands in a scratch buffer and reaches the caller's memory only once verified (one copy);
        # a write's header is staged in a registered buffer. Both pools allocate on first use and reuse.
        self._scratch = RegisteredBufferPool(HEADER + self.slot_bytes)
        self._headers = RegisteredBufferPool(HEADER)
        # blocks whose chain is known are stored in chunk files of ``chunk_blocks`` (see shared_chunks)
        self.chains = chains
        self.chunks = ChunkFiles(self, chunk_blocks) if chunk_blocks > 0 and chains is not None else None
        # opens: files opened to read blocks (chunk and block files: a hit of n blocks should open about n /
        # chunk); device_verify_disagreed: GPU reads whose checksums failed on bytes that pass in host memory
        # (kept, read as misses: sfstore/device_verdict.py)
        self.counters = Counters(("opens", "device_verify_disagreed"))

    def file_name(self, key: bytes) -> str:
        """The block file's name under the file path's root."""
        return self.prefix + self._rel(key)

    # -- opening beneath the directory ------------------------------------------------------------------------
    def _dir(self) -> int:
        """A descriptor of the tier's directory (opened once, beneath the file path's root)."""
        fd = self._dirfd
        if fd is not None:
            return fd
        with self._dir_lock:
            if self._dirfd is None:  # not there yet (no block written): ENOENT, every read a miss
                self._dirfd, _ = self.fp.open_beneath(self.prefix.rstrip("/") or ".", _O_PATH | os.O_DIRECTORY)
            return self._dirfd

    def _open(self, rel: str, flags: int) -> int:
        """Open ``rel`` beneath the tier's directory; ``OSError`` (``ENOENT``: not there) on failure."""
        fd = self.fp.open_at(self._dir(), rel, flags)
        if fd is not None:
            return fd
        # Without openat2: the file path's walk of descriptors, from its root through the tier's directory (never
        # a name resolved ahead): confined to that root, where the kernel's lookup is confined to the directory.
        return self.fp.open_fd(self.prefix + rel, flags)

    def _entry(self, key: bytes) -> tuple[str, str]:
        h = key.hex()
        return h[:2], f"{h}.kvb"

    def _rel(self, key: bytes) -> str:
        """The block file's name under the tier's directory (``<fan-out>/<key>.kvb``)."""
        return "/".join(self._entry(key))

    # -- reads ------------------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Whether a regular file (not yet verified) is at the key's name inside the directory (``False`` past
        the deadline or while quarantined)."""
        return self.present([key])[0]

    def leading_present(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, have a regular file at their name (not yet verified): one
        operation under the deadline, so 0 past it or while quarantined."""
        if not keys:
            return 0
        status, n = self.guard.run(self._leading_present, list(keys), what="a lookup")
        return int(n) if status == OK and n is not None else 0

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`contains` of each key, in one operation under the deadline (every answer ``False`` past it or
        while quarantined)."""
        if not keys:
            return []
        status, found = self.guard.run(self._present, list(keys), what="a lookup")
        return [bool(f) for f in found] if status == OK and found is not None else [False] * len(keys)

    def _split(self, keys: Sequence[bytes]) -> tuple[list[Entry], list[int]]:
        """The keys whose chain is known, as entries for the chunk files (none without them), and the indices of
        the others (block files)."""
        if self.chunks is None or self.chains is None:
            return [], list(range(len(keys)))
        entries: list[Entry] = []
        plain: list[int] = []
        for i, k in enumerate(keys):
            at = self.chains.locate(k)
            if at is None:
                plain.append(i)
            else:
                entries.append((i, at[0], at[1]))
        return entries, plain

    def _present(self, keys: list[bytes]) -> list[bool]:
        out = [False] * len(keys)
        entries, plain = self._split(keys)
        if entries:
            assert self.chunks is not None
            for (i, _c, _p), found in zip(entries, self.chunks.present(entries), strict=True):
                out[i] = found
        # block files: keys without a chain, and those no chunk holds (files of the per-block format)
        rest = sorted(plain + [i for i, _c, _p in entries if not out[i]])
        for i, found in zip(rest, self._present_files([keys[i] for i in rest]), strict=True):
            out[i] = found
        return out

    def _present_files(self, keys: list[bytes]) -> list[bool]:
        modes = self._stat_many(keys, leading=False)
        if modes is None:
            return [self._contains(k) for k in keys]
        return [m >= 0 and stat.S_ISREG(m) for m in modes]

    def _regular(self, names: list[str]) -> list[bool]:
        """Whether a regular file is at each name (relative to the tier's directory)."""
        if len(names) >= 2:
            try:
                found = self.fp.stat_many_at(self._dir(), names, _O_PATH, False)
            except OSError:  # the directory itself is not there (nothing written yet)
                return [False] * len(names)
            if found is not None:
                return [m >= 0 and stat.S_ISREG(m) for m in found]
        out = []
        for name in names:
            try:
                fd = self._open(name, _O_PATH)
            except OSError:
                out.append(False)
                continue
            try:
                out.append(stat.S_ISREG(os.fstat(fd).st_mode))
            finally:
                os.close(fd)
        return out

    def _leading_present(self, keys: list[bytes]) -> int:
        if self.chunks is not None:  # a chunk's runs are looked up together: the prefix follows from presence
            found = self._present(keys)
            return found.index(False) if False in found else len(found)
        modes = self._stat_many(keys, leading=True)
        if modes is not None:
            return sum(1 for m in modes if m >= 0 and stat.S_ISREG(m))  # (the list stops after the first miss)
        for i, k in enumerate(keys):
            if not self._contains(k):
                return i
        return len(keys)

    def _stat_many(self, keys: list[bytes], leading: bool) -> list[int] | None:
        """The mode of what is at each key's name (``-errno`` where nothing is), in one call into the native
        helper (one release of the GIL for the batch, where a lookup was three system calls per key from Python);
        ``None`` where the helper or the kernel's ``openat2`` is missing: the caller asks key by key."""
        if len(keys) < 2:
            return None
        try:
            dirfd = self._dir()
        except OSError:  # the directory itself is not there (nothing written yet): each key answers alone
            return None
        return self.fp.stat_many_at(dirfd, [self._rel(k) for k in keys], _O_PATH, leading)

    def _contains(self, key: bytes) -> bool:
        sub, base = self._entry(key)
        try:
            fd = self._open(f"{sub}/{base}", _O_PATH)
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def _read(self, key: bytes, views: list[memoryview]) -> tuple[str, int]:
        """Read the block file of ``key`` into ``views`` (header first, ``HEADER + slot_bytes`` in all) and
        verify it: ``("hit", checksum)``, else ``"missing"``, ``"corrupt"`` or ``"unreadable"`` (see the class)
        with 0."""
        return self._read_batch([key], [views])[0]

    def _read_batch(self, keys: Sequence[bytes], views: Sequence[list[memoryview]]) -> list[tuple[str, int]]:
        """Read the block files of ``keys`` into their ``views`` (as :meth:`_read`'s) as one batch of the file
        path: each file is opened and checked first, then every file's reads are submitted at once (in flight
        together, in groups of ``_VERIFY_GROUP`` files), and each group is verified as it lands while the later
        ones are still read. Per key ``("hit", checksum)`` or a miss's status with 0, each as :meth:`_read`
        would answer it alone."""
        out: list[tuple[str, int]] = [("missing", 0)] * len(keys)
        opened: list[tuple[int, int, os.stat_result]] = []  # (key's index, descriptor, status) to read
        drops: list[tuple[int, os.stat_result]] = []  # corrupt files, removed once their descriptors are closed
        pending: list[_FileReads | None] = []
        try:
            for i, (fd, status, st) in enumerate(self._open_blocks(keys)):
                if fd is not None and st is not None:
                    opened.append((i, fd, st))
                    continue
                out[i] = (status, 0)
                if status == "corrupt" and st is not None:
                    drops.append((i, st))
            self.counters.add(opens=len(opened))
            groups = [opened[g:g + _VERIFY_GROUP] for g in range(0, len(opened), _VERIFY_GROUP)]
            pending = [self._start_files([fd for _i, fd, _st in g], [views[i] for i, _fd, _st in g]) for g in groups]
            for n, group in enumerate(groups):
                reads = pending[n]
                pending[n] = None
                if reads is not None:
                    self._verify_files(keys, views, group, self._finish_files(reads), out, drops)
        finally:
            for reads in pending:  # (an error above: no read may still write once the files close)
                if reads is not None:
                    self._finish_files(reads)
            for _i, fd, _st in opened:
                os.close(fd)
        for i, st in drops:  # (after the close: NFS renames a file still open where it is unlinked)
            self._drop(*self._entry(keys[i]), st)
        return out

    def _verify_files(self, keys: Sequence[bytes], views: Sequence[list[memoryview]],
                      opened: list[tuple[int, int, os.stat_result]], results: list[int | None],
                      out: list[tuple[str, int]], drops: list[tuple[int, os.stat_result]]) -> None:
        """Judge each read file of ``opened`` (``results``: the bytes each read, ``None`` where its read failed)
        by its header and checksum into ``out``; the damaged ones go to ``drops``."""
        n = self.geom.block_bytes
        read: list[tuple[int, int, os.stat_result, tuple[int, SumKind] | None, memoryview]] = []
        for (i, fd, st), got in zip(opened, results, strict=True):
            if got is None:  # the read failed (as an OSError of the single read would be)
                self.fp.file_failed()
                out[i] = ("unreadable", 0)
                continue
            found = read_header(views[i][0][:HEADER], self.geom, keys[i]) if got == HEADER + n else None
            read.append((i, fd, st, found, _block_bytes(views[i], n)))
        # every host put's block of the group hashed in one call (one release of the GIL)
        sums = iter(xxh3_64_many([b for _i, _fd, _st, f, b in read if f is not None and f[1] is SumKind.XXH3]))
        for i, fd, st, found, block in read:
            if found is None or (next(sums) if found[1] is SumKind.XXH3 else sum_of(found[1], block)) != found[0]:
                self.fp.file_done()
                out[i] = ("corrupt", 0)
                drops.append((i, st))
                continue
            self.budget.touch(fd, st)  # an access record for the shared LRU, while the file is open
            self.fp.file_done()
            # the tiers above keep xxh3-64 of host bytes
            out[i] = ("hit", found[0] if found[1] is SumKind.XXH3 else xxh3_64(block))

    def _open_blocks(self, keys: Sequence[bytes]) -> list[tuple[int | None, str, os.stat_result | None]]:
        """:meth:`_open_block` of each key; in one call into the native helper where the kernel resolves beneath
        a directory (``openat2``): one release of the GIL for the whole batch, not a few calls per file."""
        if len(keys) < 2:
            return [self._open_block(k) for k in keys]
        names = [self._rel(k) for k in keys]
        try:
            got = self.fp.open_many_at(self._dir(), names, _READ_FLAGS, HEADER + self.geom.block_bytes,
                                       bool(self.fp.direct))
        except OSError:  # the directory itself is not there (nothing written yet): each key answers alone
            got = None
        if got is None:  # (or a kernel without openat2, before 5.6): file by file
            return [self._open_block(k) for k in keys]
        out: list[tuple[int | None, str, os.stat_result | None]] = []
        for fd, err, mode, dev, ino, size, atime_ns, mtime_ns in got:
            if err:  # as a failed open of _open_block (a link out of the directory: EXDEV, ELOOP)
                out.append((None, "missing" if err == errno.ENOENT else "unreadable", None))
                continue
            st = os.stat_result((mode, ino, dev, 1, 0, 0, size, atime_ns // 10**9, mtime_ns // 10**9,
                                 mtime_ns // 10**9, atime_ns / 1e9, mtime_ns / 1e9, mtime_ns / 1e9,
                                 atime_ns, mtime_ns, mtime_ns))
            if fd >= 0:
                out.append((fd, "open", st))
            else:  # not kept: a regular file of another size is corrupt, anything else unreadable
                out.append((None, "corrupt" if stat.S_ISREG(mode) else "unreadable", st))
        return out

    def _open_block(self, key: bytes) -> tuple[int | None, str, os.stat_result | None]:
        """Open the block file of ``key`` for a read: ``(descriptor, "open", status)`` for a regular file of a
        block's size (made blocking, O_DIRECT where the file path uses it), else ``(None, miss, status)`` with
        ``"missing"``, ``"unreadable"``, or ``"corrupt"`` (then the status of the file to remove)."""
        sub, base = self._entry(key)
        try:
            fd = self._open(f"{sub}/{base}", _READ_FLAGS)
        except OSError as exc:
            return None, ("missing" if exc.errno == errno.ENOENT else "unreadable"), None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return None, "unreadable", st
            if st.st_size != HEADER + self.geom.block_bytes:
                os.close(fd)
                return None, "corrupt", st
            set_blocking(fd, direct=self.fp.direct)
        except OSError:
            os.close(fd)
            self.fp.file_failed()
            return None, "unreadable", None
        return fd, "open", st

    def _submit_files(self, fds: list[int], views: list[list[memoryview]]) -> list[int | None]:
        """Read each file (``fds``, opened by :meth:`_open_block`) from its start into its views, every file's
        ranges in one batch of the file path; per file the bytes read, or ``None`` when its read failed."""
        return self._finish_files(self._start_files(fds, views))

    def _start_files(self, fds: list[int], views: list[list[memoryview]]) -> _FileReads:
        """Submit :meth:`_submit_files`' batch; :meth:`_finish_files` waits for it."""
        ranges: list[Range] = []
        owner: list[int] = []
        for j, (fd, vs) in enumerate(zip(fds, views, strict=True)):
            rs = self._file_ranges(fd, vs)
            ranges += rs
            owner += [j] * len(rs)
        if not ranges:
            return _FileReads(None, owner, len(fds))
        try:
            return _FileReads(self.fp.submit(ranges, data_class="kvcache.shared"), owner, len(fds))
        except OSError:
            return _FileReads(None, owner, len(fds), failed=True)

    def _finish_files(self, reads: _FileReads) -> list[int | None]:
        """Per file of a batch :meth:`_start_files` submitted, the bytes read (``None``: its read failed)."""
        if reads.failed:
            return [None] * reads.files
        if reads.future is None:
            return []
        try:
            results = reads.future.results()
        except OSError:
            return [None] * reads.files
        got: list[int | None] = [0] * reads.files
        for j, r in zip(reads.owner, results, strict=True):
            prev = got[j]
            got[j] = None if r < 0 or prev is None else prev + r
        return got

    def _file_ranges(self, fd: int, views: list[memoryview]) -> list[Range]:
        """The reads of a block file into ``views``: one range into a single view, else the header and the block."""
        if len(views) == 1:
            return [Range.read(0, HEADER + self.slot_bytes, views[0], 0, fd)]
        return [Range.read(0, HEADER, views[0], 0, fd), Range.read(HEADER, self.slot_bytes, views[1], 0, fd)]

    def _read_file(self, fd: int, views: list[memoryview]) -> int:
        """Read a block file (opened ``O_NONBLOCK``) from its start into ``views`` through the file path: the
        header and the block, O_DIRECT where the file path uses it (the views are registered, aligned buffers of
        aligned sizes: no page-cache copy). Returns the bytes read; ``OSError`` (typed) when the read fails."""
        set_blocking(fd, direct=self.fp.direct)
        return sum(self.fp.submit(self._file_ranges(fd, views), data_class="kvcache.shared").get())

    def _drop(self, sub: str, base: str, st: os.stat_result) -> None:
        """Remove the corrupt file just read, if the name still holds that very file (a writer may have
        published a good one meanwhile: that one stays)."""
        gone = self._unlink_if(sub, base, lambda now: (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino))
        if gone is not None and stat.S_ISREG(gone.st_mode):
            self.budget.removed_bytes(gone.st_size)

    def _unlink_if(self, sub: str, base: str, remove: Callable[[os.stat_result], bool]) -> os.stat_result | None:
        """Unlink ``base`` in ``sub`` (relative to the directory's descriptor, never following a link) when
        ``remove`` says so of what is there; the status of what was removed, else ``None`` (nothing there, kept,
        or an error: each means there is nothing to remove)."""
        try:
            pfd = self._open(sub, _O_PATH | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
            if not remove(st):
                return None
            os.unlink(base, dir_fd=pfd)
            return st
        except OSError:
            return None
        finally:
            os.close(pfd)

    def read_view(self, key: bytes, data: memoryview) -> str:
        """Read the block of ``key`` into ``data`` (caller's memory) through a scratch buffer: ``data`` is
        written only on a ``"hit"`` (verified, in time, on the caller's thread), and left as it is otherwise
        (``"timeout"`` and ``"quarantined"`` too)."""
        n = self.geom.block_bytes
        buf = self._scratch.acquire()
        try:
            status, got = self.guard.run(self._read_scratch, key, buf, on_late=buf.release, what="a read")
        except BaseException:
            buf.release()
            raise
        if status == TIMEOUT:
            return TIMEOUT  # the scratch buffer is the abandoned worker's until it returns
        try:
            if status == OK and got == "hit":
                with memoryview(buf) as view:
                    data[:n] = view[HEADER:HEADER + n]
        finally:
            buf.release()
        return str(got) if status == OK else status

    def _read_scratch(self, key: bytes, buf: RegisteredBuffer) -> str:
        with memoryview(buf) as view:
            return self._read(key, [view])[0]

    def read_slot(self, key: bytes, slot: Slot, release: Callable[[], None] | None = None) -> str:
        """Read the block into ``slot`` (the tier's own memory); on a ``"hit"`` its checksum is set.
        ``release`` is called once this tier is done with the slot: before this returns, or, past the deadline
        (``"timeout"``), when the abandoned worker returns."""
        status, got = self.guard.run_holding(release, self._read_slot, key, slot, what="a read")
        return str(got) if status == OK else status

    def read_many_into(self, keys: Sequence[bytes], slots: Sequence[Slot],
                       release: Callable[[], None] | None = None) -> list[str]:
        """Read each key's block into its slot (the tier's own memory) as one batch: every file is opened and
        checked as :meth:`read_slot` does, then all their reads are in flight at once, then each is verified.
        A status per key, as :meth:`read_slot` answers it; on a ``"hit"`` the slot's checksum is set.

        One deadline covers the whole batch: past it every key answers ``"timeout"`` (``"quarantined"`` for
        every key while the tier is). ``release`` is called once this tier is done with all the slots: before
        this returns, or, past the deadline, when the abandoned worker returns."""
        if len(keys) != len(slots):
            if release is not None:
                release()
            raise errors.InvalidRequestError(f"read_many_into: {len(keys)} keys but {len(slots)} slots")
        if not keys:
            if release is not None:
                release()
            return []
        status, got = self.guard.run_holding(release, self._read_slots, list(keys), list(slots),
                                        what=f"a read of {len(keys)} blocks")
        return [str(g) for g in got] if status == OK and got is not None else [status] * len(keys)

    def _read_slots(self, keys: list[bytes], slots: list[Slot]) -> list[str]:
        found = self._read_batch(keys, [_slot_views(s, self.slot_bytes) for s in slots])
        if not late():
            for slot, (status, checksum) in zip(slots, found, strict=True):
                if status == "hit":
                    slot.checksum = checksum
        return [status for status, _ in found]

    def read_many_views(self, keys: Sequence[bytes], datas: Sequence[memoryview]) -> list[str]:
        """Read each key's block into its ``datas`` entry (the caller's memory) as one batch, through scratch
        buffers: an entry is written only on a ``"hit"`` (verified, in time, on the caller's thread) and left
        as it is otherwise. A status per key, as :meth:`read_view` answers it; one deadline covers the whole
        batch, as in :meth:`read_many_into`."""
        if len(keys) != len(datas):
            raise errors.InvalidRequestError(f"read_many_views: {len(keys)} keys but {len(datas)} buffers")
        if not keys:
            return []
        n = self.geom.block_bytes
        bufs: list[RegisteredBuffer] = []

        def release() -> None:
            for b in bufs:
                b.release()

        try:
            bufs.extend(self._scratch.acquire() for _ in keys)
            status, got = self.guard.run(self._read_scratches, list(keys), list(bufs), on_late=release,
                                         what=f"a read of {len(keys)} blocks")
        except BaseException:
            release()
            raise
        if status == TIMEOUT:
            return [TIMEOUT] * len(keys)  # the scratch buffers are the abandoned worker's until it returns
        try:
            if status == OK and got is not None:
                for data, buf, g in zip(datas, bufs, got, strict=True):
                    if g == "hit":
                        with memoryview(buf) as view:
                            data[:n] = view[HEADER:HEADER + n]
        finally:
            release()
        return [str(g) for g in got] if status == OK and got is not None else [status] * len(keys)

    def read_many_lent(self, keys: Sequence[bytes], datas: Sequence[memoryview],
                       lend: Callable[[list[int]], Callable[[], None]] | None) -> list[str]:
        """Read each key's block straight into its ``datas`` entry (the caller's memory, ``slot_bytes`` long) as
        one batch, each file's header into a scratch header: verified in place, so a miss may leave the bytes
        that failed there (a read with ``keep`` off). Under the deadline the caller must lend ``datas``
        (:attr:`KVBatch.lend`): a batch past it answers ``"timeout"`` at once and gives them back when its read
        returns. A status per key, as :meth:`read_many_views` answers it."""
        if len(keys) != len(datas):
            raise errors.InvalidRequestError(f"read_many_lent: {len(keys)} keys but {len(datas)} buffers")
        if not keys:
            return []
        heads: list[RegisteredBuffer] = []
        try:
            heads.extend(self._headers.acquire() for _ in keys)
            handoff = _Handoff(functools.partial(release_all, heads))
            status, got = self.guard.run(self._read_lent, list(keys), list(heads), list(datas),
                                         on_late=handoff.ended, what=f"a read of {len(keys)} blocks")
        except BaseException:
            release_all(heads)
            raise
        if status == TIMEOUT:
            handoff.lent(lend(list(range(len(keys)))) if lend is not None else None)
            return [TIMEOUT] * len(keys)
        release_all(heads)
        return [str(g) for g in got] if status == OK and got is not None else [status] * len(keys)

    def _read_lent(self, keys: list[bytes], heads: list[RegisteredBuffer], datas: list[memoryview]) -> list[str]:
        views = [[memoryview(h)[:HEADER], d] for h, d in zip(heads, datas, strict=True)]
        try:
            return [status for status, _ in self._read_batch(keys, views)]
        finally:
            for v in views:
                v[0].release()

    def _read_scratches(self, keys: list[bytes], bufs: list[RegisteredBuffer]) -> list[str]:
        views = [memoryview(b) for b in bufs]
        try:
            return [status for status, _ in self._read_batch(keys, [[v] for v in views])]
        finally:
            for v in views:
                v.release()

    def _read_slot(self, key: bytes, slot: Slot) -> str:
        status, checksum = self._read(key, _slot_views(slot, self.slot_bytes))
        if status == "hit" and not late():
            slot.checksum = checksum
        return status

    # -- writes -------------------------------------------------------------------------------------------------
    def _clear(self, key: bytes) -> None:
        """Remove what is at the key's name when it is not a regular file or directory (a FIFO, a socket, a
        symlink), so the publish that follows renames over nothing foreign."""
        sub, base = self._entry(key)
        self._unlink_if(sub, base, lambda st: not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)))

    def write_slot(self, key: bytes, slot: Slot, release: Callable[[], None] | None = None) -> bool | None:
        """Publish the block in ``slot`` (its header is filled here); ``False`` when it is already there, ``None``
        when dropped (past the deadline, or quarantined). ``release`` is as for :meth:`read_slot`."""
        status, done = self.guard.run_holding(release, self._write, key, slot, what="a write")
        return bool(done) if status == OK else None

    def _write(self, key: bytes, slot: Slot) -> bool:
        if self._contains(key):
            return False
        self._clear(key)
        self._register()
        hview = memoryview(slot.header)
        hdr = encode_header(self.geom, key, slot.checksum)
        hview[:len(hdr)] = hdr
        hview[len(hdr):HEADER] = bytes(HEADER - len(hdr))
        with self.fp.open_writer(self.file_name(key), fsync=self.fsync) as w:  # both parts straight from the slot
            w.write(hview[:HEADER])
            w.write(slot.data(self.geom.block_bytes))
            _not_late()
        self._published()
        return True

    def write_view(self, key: bytes, data: memoryview, checksum: int) -> bool | None:
        """Publish ``data`` (a block in the caller's memory) under ``key``; ``False`` when it is already there,
        ``None`` when dropped (past the deadline or quarantined). A write past its deadline is published only if
        it had read all of ``data`` by then (its bytes were in the file before the caller got its memory back)."""
        status, done = self.guard.run(self._write_view, key, data, checksum, what="a write")
        return bool(done) if status == OK else None

    def _write_view(self, key: bytes, data: memoryview, checksum: int) -> bool:
        if self._contains(key):
            return False
        self._clear(key)
        self._register()
        with self._block_file(key, checksum, body=data):
            pass
        return True

    def _register(self) -> None:
        try:
            self.budget.register()
        except OSError:
            self.budget.errors += 1  # accounting is advisory: the write goes on (gc recounts from the files)

    def _published(self, nbytes: int | None = None) -> None:
        """Count a file just published (a block file, or ``nbytes`` of a chunk file), and keep the namespace
        within its budget (best effort: the file is published whatever the accounting meets; the next scan
        recounts)."""
        try:
            self.budget.added_bytes(HEADER + self.geom.block_bytes if nbytes is None else nbytes)
            self.budget.enforce()
        except OSError:
            self.budget.errors += 1

    # -- GPU blocks through the device path ----------------------------------------------------------------------
    def write_device(self, key: bytes, block: Any, device: DevicePath) -> bool | None:
        """Publish the GPU ``block`` under ``key`` through ``device`` (a :class:`~sfstore.paths.device.DevicePath`):
        its kvsum64 is computed on the GPU, the 4096-byte header is written from host memory, the block's bytes
        take the device path's route for this file (GPU-direct with cuFile). ``False`` when already there,
        ``None`` when dropped (past the deadline or quarantined)."""
        # the checksum is taken here, on the caller's thread: a write that outlives its deadline then reads
        # bytes the caller may have changed, and its file fails verification rather than holding them as valid
        checksum = device.runtime.checksum(block, 0, self.geom.block_bytes)
        status, done = self.guard.run(self._write_device, key, block, device, checksum, what="a write")
        return bool(done) if status == OK else None

    def _write_device(self, key: bytes, block: Any, device: DevicePath, checksum: int) -> bool:
        if self._contains(key):
            return False
        self._clear(key)
        self._register()
        with self._block_file(key, checksum, SumKind.KV64) as w:
            w.write_through(device, block, self.geom.block_bytes, data_class="kvcache.shared")
        return True

    @contextlib.contextmanager
    def _block_file(self, key: bytes, checksum: int, kind: SumKind = SumKind.XXH3, body: memoryview | None = None,
                    ) -> Iterator[AtomicWriter]:
        """The block file of ``key`` being written: its header (checksum of ``kind``) is in, with ``body`` where
        given (both in one batch), else the caller writes the block; it is published (renamed into place) on
        leaving unless this write is past its deadline."""
        hbuf = self._headers.acquire()
        try:
            hview = memoryview(hbuf)
            hdr = encode_header(self.geom, key, checksum, kind)
            hview[:len(hdr)] = hdr
            hview[len(hdr):] = bytes(HEADER - len(hdr))
            with self.fp.open_writer(self.file_name(key), fsync=self.fsync) as w:
                w.writev([hview] if body is None else [hview, body])
                yield w
                _not_late()
            del hview
        finally:
            hbuf.release()
        self._published()

    def read_device(self, key: bytes, dest: Any, device: DevicePath, *, keep: bool = True) -> tuple[str, str]:
        """Read the block of ``key`` into the GPU buffer ``dest`` through ``device``: ``(status, how)``.

        ``status`` is as for :meth:`read_slot`. A block a GPU put wrote (kvsum64) is read on the device path's
        route and verified on the GPU (``how``: the route); with ``keep`` it lands in a GPU scratch buffer first
        and reaches ``dest`` only once verified. A block a host put wrote (xxh3-64, which a GPU does not compute)
        is read and verified in host memory and copied up (``how``: ``"staged"``).

        Past the deadline (``"timeout"``) a read is abandoned: it copies nothing into ``dest`` from then on, but
        with ``keep=False`` a read already under way into ``dest`` (a DMA) may still land there.
        """
        status, got = self.guard.run(self._read_device, key, dest, device, keep, what="a read")
        return got if status == OK and got is not None else (status, "")

    def _read_device(self, key: bytes, dest: Any, device: DevicePath, keep: bool) -> tuple[str, str]:
        n = self.geom.block_bytes
        sub, base = self._entry(key)
        try:
            fd = self._open(f"{sub}/{base}", _READ_FLAGS)
        except OSError as exc:
            return ("missing" if exc.errno == errno.ENOENT else "unreadable"), ""
        self.counters.add(opens=1)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "unreadable", ""
            if st.st_size != HEADER + n:
                self._drop(sub, base, st)
                return "corrupt", ""
            head = bytearray(HEADER)
            if os.preadv(fd, [head], 0) != HEADER:
                self._drop(sub, base, st)
                return "corrupt", ""
            found = read_header(memoryview(head), self.geom, key)
            if found is None:
                self._drop(sub, base, st)
                return "corrupt", ""
            checksum, kind = found
            if kind is SumKind.XXH3:
                return self._read_device_staged(key, dest, device, fd, checksum, sub, base, st)
            set_blocking(fd, direct=False)  # kvikio reopens the file itself
            target = device.runtime.scratch(dest, n) if keep else dest
            route = device.route_for(fd)[0]
            try:
                got = device.submit([Range.read(HEADER, n, target, 0, fd)], data_class="kvcache.shared").get()[0]
            except errors.SfstoreOSError:
                self.fp.file_failed()
                return "unreadable", ""
            if got != n or device.runtime.checksum(target, 0, n) != checksum:
                if got == n and not damaged_on_storage(fd, [(HEADER, n, checksum)]):
                    self.counters.add(device_verify_disagreed=1)
                    warn_disagreement(f"the shared-tier block file {base}")
                    return "unreadable", ""
                self._drop(sub, base, st)
                return "corrupt", ""
            self.budget.touch(fd, st)
            if late():
                return TIMEOUT, ""
            if keep:
                device.runtime.copy(dest, 0, target, 0, n)
            self.fp.file_done()
            return "hit", route
        except OSError:
            self.fp.file_failed()
            return "unreadable", ""
        finally:
            os.close(fd)

    def _read_device_staged(self, key: bytes, dest: Any, device: DevicePath, fd: int, checksum: int, sub: str,
                            base: str, st: os.stat_result) -> tuple[str, str]:
        n = self.geom.block_bytes
        buf = self._scratch.acquire()
        try:
            view = memoryview(buf)
            try:
                got = self._read_file(fd, [view])
            except OSError:
                del view
                self.fp.file_failed()
                return "unreadable", ""
            self.fp.file_done()
            if got != HEADER + n or xxh3_64(view[HEADER:HEADER + n]) != checksum:
                del view
                self._drop(sub, base, st)
                return "corrupt", ""
            self.budget.touch(fd, st)
            if late():
                del view
                return TIMEOUT, ""
            device.stage_to_gpu(dest, 0, view[HEADER:HEADER + n], "kvcache.shared")
            del view
        finally:
            buf.release()
        return "hit", "staged"

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove the keys' files (beneath the directory); how many block files were removed (none past the
        deadline or while quarantined). A directory at a name is left alone."""
        removed = 0
        located = {i: (c, p) for i, c, p in self._split(keys)[0]}
        for i, key in enumerate(keys):
            status, gone = self.guard.run(self._remove, key, what="a removal")
            at = located.get(i)
            if at is not None and self.chunks is not None:
                c_status, c_gone = self.guard.run(self.chunks.remove, at[0], at[1], what="a removal")
                gone = bool(gone) or (c_status == OK and bool(c_gone))
            removed += status == OK and bool(gone)
        return removed

    # -- the tier contract ------------------------------------------------------------------------------------
    @property
    def supports_device_buffers(self) -> bool:
        return True

    @property
    def supports_layer_reads(self) -> bool:
        """Chunk files keep each layer of a run as one range with a checksum per block (block files do not)."""
        return self.chunks is not None

    def read_into(self, keys: Sequence[bytes], dests: KVBatch) -> list[ReadStatus]:
        """Leased slots are filled straight from the files (held by further leases while the read may go on),
        the caller's host memory through scratch buffers, GPU buffers on the device path's route; many files
        are read as one batch (``_SHARED_WAVE`` at a time, each under one deadline)."""
        ks = list(keys)
        entries, _plain = self._split(ks)
        if entries:
            answered = self._read_chunks(entries, dests)
            if answered:  # the blocks no chunk holds are looked for in block files (the per-block format)
                rest = [i for i in range(len(ks)) if i not in answered]
                part = dests.pick(rest)
                got = self._read_files([ks[i] for i in rest], part) if rest else []
                dests.take_checksums(rest, part)
                full: list[ReadStatus] = ["missing"] * len(ks)
                for i, st in answered.items():
                    full[i] = st
                for i, st in zip(rest, got, strict=True):
                    full[i] = st
                return full
        return self._read_files(ks, dests)

    def _read_files(self, ks: list[bytes], dests: KVBatch) -> list[ReadStatus]:
        """Read block files (the per-block format) into host memory, slots, or GPU buffers (on the device path's
        route)."""
        out: list[ReadStatus] = []
        if dests.kind == "device":
            for k, d in zip(ks, dests.items, strict=True):
                out.append(read_status(self.read_device(k, d, cast("DevicePath", dests.device), keep=dests.keep)[0]))
            return out
        for start in range(0, len(ks), _SHARED_WAVE):
            wave = range(start, min(len(ks), start + _SHARED_WAVE))
            wk = [ks[i] for i in wave]
            if dests.kind == "slots":
                leases = [dests.items[i] for i in wave]
                got = self.read_many_into(wk, [lease.slot for lease in leases], release=lease_again(leases))
                for i, lease, status in zip(wave, leases, got, strict=True):
                    if status == "hit":
                        dests.checksums[i] = lease.slot.checksum
            elif self._lent_reads(dests):
                got = self.read_many_lent(wk, [dests.items[i][:self.slot_bytes] for i in wave],
                                          _lend_from(dests.lend, start))
            else:
                got = self.read_many_views(wk, [dests.items[i] for i in wave])
            out += [read_status(g) for g in got]
        return out

    def _lent_reads(self, dests: KVBatch) -> bool:
        """Whether block files are read straight into ``dests`` (host memory): only where a miss may leave bytes
        there (``keep`` off), a late read cannot write there unannounced (no deadline, or the caller lends
        them), and the file's block fills whole 4 KiB pages, as an O_DIRECT read of it does."""
        return (dests.kind == "host" and not dests.keep and self.slot_bytes == self.geom.block_bytes
                and (dests.lend is not None or not self.guard.enabled))

    def _read_chunks(self, entries: list[Entry], dests: KVBatch) -> dict[int, ReadStatus]:
        """Read the blocks of ``entries`` from chunk files into ``dests`` (slots: straight in, held by further
        leases while the read may go on; host memory: through scratch buffers, copied on this thread once
        verified and in time; GPU buffers: on the device path, see :meth:`ChunkFiles.read_device`). The status
        of each key a chunk file answered (hits, and failures of a file); keys no chunk holds are left out."""
        assert self.chunks is not None
        n = self.geom.block_bytes
        out: dict[int, ReadStatus] = {}
        for start in range(0, len(entries), _SHARED_WAVE):
            wave = entries[start:start + _SHARED_WAVE]
            on_layer = None
            if dests.on_layer is not None:  # wave positions -> the batch's indices
                def on_layer(at: list[int], layer: int, wave: list[Entry] = wave) -> None:
                    dests.layers_ready([wave[a][0] for a in at], layer)
            if dests.kind == "device":  # per-layer ranges on the device path, verified before they reach dests
                status, got = self.guard.run(self.chunks.read_device, wave, [dests.items[i] for i, _c, _p in wave],
                                             dests.device, on_layer, what=f"a read of {len(wave)} blocks")
                answers = [str(g) for g in got] if status == OK and got is not None else [status] * len(wave)
            elif dests.kind == "slots":
                leases = [dests.items[i] for i, _c, _p in wave]
                targets = [lease.slot.data(n) for lease in leases]
                status, got = self.guard.run_holding(lease_again(leases), self.chunks.read, wave, targets, on_layer,
                                                what=f"a read of {len(wave)} blocks")
                answers = [str(g) for g in got] if status == OK and got is not None else [status] * len(wave)
            else:
                bufs = [self._scratch.acquire() for _ in wave]
                views = [memoryview(b)[:n] for b in bufs]

                def release(views: list[memoryview] = views, bufs: list[RegisteredBuffer] = bufs) -> None:
                    for v in views:
                        v.release()
                    release_all(bufs)

                try:
                    status, got = self.guard.run(self.chunks.read, wave, views, on_late=release,
                                                 what=f"a read of {len(wave)} blocks")
                except BaseException:
                    release()
                    raise
                answers = [str(g) for g in got] if status == OK and got is not None else [status] * len(wave)
                if status != TIMEOUT:
                    try:
                        for (i, _c, _p), v, a in zip(wave, views, answers, strict=True):
                            if a == "hit":
                                dests.items[i][:n] = v
                    finally:
                        release()
            for (i, _c, _p), a in zip(wave, answers, strict=True):
                if a != "missing":
                    out[i] = read_status(a)
        return out

    def write(self, keys: Sequence[bytes], srcs: KVBatch) -> list[WriteStatus]:
        """Publish each block: runs of blocks whose chain is known as chunk files (see
        :mod:`~sfstore.kvcache.shared_chunks`; from GPU blocks with kvsum64 slices, their body on the device
        path's route), the others as block files (their xxh3-64 taken from ``srcs.checksums`` where known, else
        computed here; GPU blocks' kvsum64, on the device path's route)."""
        n = self.geom.block_bytes
        out: list[WriteStatus] = ["dropped"] * len(keys)
        entries, plain = self._split(keys)
        if entries:
            plain = sorted(plain + self._write_chunks(entries, srcs, out))

        def one(i: int) -> WriteStatus:
            k = keys[i]
            item = srcs.items[i]
            if srcs.kind == "slots":
                slot = item.slot
                slot.checksum = srcs.checksums[i] if srcs.checksums[i] is not None else xxh3_64(slot.data(n))
                done = self.write_slot(k, slot, release=lease_again([item]))
            elif srcs.kind == "host":
                known = srcs.checksums[i]
                done = self.write_view(k, item, known if known is not None else xxh3_64(item))
            else:
                done = self.write_device(k, item, cast("DevicePath", srcs.device))
            return "dropped" if done is None else "written" if done else "exists"

        # Host blocks of distinct keys are written side by side: each file's fsync then shares the journal's
        # commits with the others' instead of waiting for its own (a key twice in a batch is written in order,
        # so the second one finds the first).
        if len(plain) > 1 and srcs.kind != "device" and len({keys[i] for i in plain}) == len(plain):
            for i, status in zip(plain, self._writer_pool().map(one, plain), strict=True):
                out[i] = status
        else:
            for i in plain:
                out[i] = one(i)
        return out

    def _writer_pool(self) -> ThreadPoolExecutor:
        """The threads that hand a batch's block files to the guard's workers (made on first use)."""
        pool = self._writers
        if pool is None:
            with self._dir_lock:
                if self._writers is None:
                    self._writers = ThreadPoolExecutor(max_workers=_WRITE_THREADS,
                                                       thread_name_prefix="sfstore-kv-shared-write")
                pool = self._writers
        return pool

    def _write_chunks(self, entries: list[Entry], srcs: KVBatch, out: list[WriteStatus]) -> list[int]:
        """Publish the runs ``entries`` make (each built in a registered buffer on this thread, so a write past
        its deadline never reads the caller's memory). Returns the indices of the blocks no run takes (their
        chunk's first blocks are not in the batch): the caller stores them as block files."""
        assert self.chunks is not None
        n = self.geom.block_bytes
        runs, skipped = self.chunks.plan(entries)
        for run, js in runs:
            idx = [entries[j][0] for j in js]
            if srcs.kind == "device":
                buf, body = self.chunks.build_device(run, [srcs.items[i] for i in idx], cast("DevicePath", srcs.device))
                status, done = self.guard.run_holding(buf.release, self.chunks.write, run, buf, body, srcs.device,
                                                      what="a write")
            else:
                views = [srcs.items[i].slot.data(n) if srcs.kind == "slots" else srcs.items[i] for i in idx]
                buf = self.chunks.build(run, views)
                status, done = self.guard.run_holding(buf.release, self.chunks.write, run, buf, what="a write")
            for i in idx:
                out[i] = "dropped" if status != OK else "written" if done else "exists"
        return [entries[j][0] for j in skipped]

    def describe_route(self, device: DevicePath) -> dict[str, str]:
        """How GPU blocks move to and from the files on ``device``'s routes, and why."""
        route, why = device.route_for(self.fp.root_fd(), self.fp.root)
        return {"route": route, "why": why}

    def _remove(self, key: bytes) -> bool:
        sub, base = self._entry(key)
        gone = self._unlink_if(sub, base, lambda st: not stat.S_ISDIR(st.st_mode))
        if gone is not None and stat.S_ISREG(gone.st_mode):
            self.budget.removed_bytes(gone.st_size)
            return True
        return False

    def count(self) -> int | None:
        """Block files in the directory (its two-character subdirectories, read through descriptors); ``None``
        past the deadline or while quarantined."""
        status, n = self.guard.run(self._count, what="a listing", judges=False)
        return int(n) if status == OK and n is not None else None

    def _count(self) -> int:
        try:
            top = self.fp.open_dir(self.prefix.rstrip("/") or ".")
        except OSError:
            return 0
        n = 0
        try:
            for sub in os.listdir(top):
                if not _is_sub(sub):  # the accounting directory, other namespaces' roots
                    continue
                try:
                    fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
                except OSError:
                    continue
                try:  # hidden names (temporary files, blocks being evicted) are not blocks
                    for f in os.listdir(fd):
                        if f.startswith("."):
                            continue
                        if f.endswith(".kvb"):
                            n += 1
                        elif f.endswith(CHUNK_SUFFIX):
                            n += parse_name(f) or 0
                finally:
                    os.close(fd)
        finally:
            os.close(top)
        return n

    def close(self) -> None:
        """Publish this process's usage record (evicting to the budget with everyone's latest counts), then
        release the directory descriptor and the scratch buffers."""
        try:
            self.guard.run(self.budget.settle, what="the usage record")
        except OSError:
            pass  # the records are advisory: the next scan recounts from the files
        self.guard.close()
        with self._dir_lock:
            fd, self._dirfd = self._dirfd, None
        if fd is not None:
            os.close(fd)
        with self._dir_lock:
            writers, self._writers = self._writers, None
        if writers is not None:
            writers.shutdown(wait=True)
        self._scratch.close()
        self._headers.close()
        if self.chunks is not None:
            self.chunks.close()


# shared files read as one batch, in flight together under one deadline: bounds the descriptors open at once and
# the bytes one deadline has to cover (a wave that misses it quarantines the tier, so the waves after it answer
# at once)
_SHARED_WAVE = 64
# block files of a batch whose reads are verified together, while the batch's later groups are still read
_VERIFY_GROUP = 16
# block files of one batch written at once (as many as the guard has workers)
_WRITE_THREADS = 8
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY


class _Late(Exception):
    """A write whose caller gave up on it (its deadline passed): discarded, not published."""


def _not_late() -> None:
    """Raise :class:`_Late` in a write that was abandoned, so that its temporary file is discarded."""
    if late():
        raise _Late


def _host_only(batch: KVBatch, op: str) -> None:
    if batch.kind != "host":
        raise errors.InvalidRequestError(
            f"the pinned tier cannot {op} a batch of {batch.kind}: its own slots are held by lease, other memory "
            "is copied in and out by the store"
        )


def _is_sub(name: str) -> bool:
    """Whether ``name`` is one of the tier's 256 subdirectories (two lowercase hex digits)."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _lend_from(lend: Callable[[list[int]], Callable[[], None]] | None, base: int,
               ) -> Callable[[list[int]], Callable[[], None]] | None:
    """``lend`` of a batch for the part of it that starts at ``base``."""
    if lend is None:
        return None
    return lambda at: lend([base + j for j in at])


@dataclass
class _FileReads:
    """A batch of block-file reads in flight (:meth:`SharedTier._start_files`): its future, the file of each
    range, how many files; ``failed``: the submission itself failed."""

    future: PathFuture | None
    owner: list[int]
    files: int
    failed: bool = False


class _Handoff:
    """What a read abandoned at its deadline hands back when it returns: its own ``release`` (scratch headers),
    and whatever the caller's lend asked to be called then (:attr:`KVBatch.lend`), which may arrive before or
    after the read returns; each runs once."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._ended = False
        self._then: Callable[[], None] | None = None

    def ended(self) -> None:
        """The read returned (on its worker), or never started (at the deadline)."""
        self._release()
        with self._lock:
            self._ended, then, self._then = True, self._then, None
        if then is not None:
            then()

    def lent(self, then: Callable[[], None] | None) -> None:
        """The caller's lend answered ``then``: called now if the read has returned, else when it does."""
        with self._lock:
            if not self._ended:
                self._then = then
                return
        if then is not None:
            then()


def _slot_views(slot: Slot, slot_bytes: int) -> list[memoryview]:
    """The views a block file is read into in ``slot``: the header, then the block."""
    return [memoryview(slot.header)[:HEADER], memoryview(slot.buffer)[:slot_bytes]]


def _block_bytes(views: list[memoryview], n: int) -> memoryview:
    """The ``n`` block bytes that follow the header in ``views``."""
    if len(views[0]) >= HEADER + n:
        return views[0][HEADER:HEADER + n]
    return views[1][:n]


__all__ += ["encode_header", "check_header", "read_header", "KEY_BYTES"]
