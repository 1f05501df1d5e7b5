"""``BlockStore``: a key -> value store for hot blocks on a :class:`~sfstore.paths.block.BlockPath`.

Values live in fixed slots of a few size classes; each slot starts with a header (key, length, xxh3-64 of
the value, generation, checksum), so a put is one aligned O_DIRECT write and a get one aligned read, both
batched through the I/O engine. The index lives in memory; on a clean close it is written as a snapshot, and
after a crash it is rebuilt from the slot headers.

Durability rules
----------------
* A put is durable once :meth:`BlockStore.flush` returns after it (or with ``durable=True``).
* An overwrite never writes over the previous value: it goes to a free slot, and the old slot is wiped and
  reused only after the next flush made the new value durable. So a crash returns, for every key, the last
  flushed value or a newer one that was written whole, never a torn or an older one.
* A torn slot (a crash in the middle of its write) fails its checksum: it is dropped, never returned.
* Deletes and evictions are durable after the next flush too; before it, a crash may bring a deleted key
  back with its last flushed value.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sfstore import defaults, errors
from sfstore.arguments import as_batch, check_timeout
from sfstore.blocks.layout import (
    Layout,
    SlotHeader,
    SnapshotEntry,
    State,
    plan_layout,
    round_up,
    value_sum,
)
from sfstore.buffers import RegisteredBuffer, RegisteredBufferPool, as_buffer
from sfstore.checksums import SumKind, sum_of
from sfstore.counters import Counters
from sfstore.device_verdict import damaged_on_storage, warn_disagreement
from sfstore.futures import ExecutorFuture
from sfstore.paths.base import PathFuture, Range
from sfstore.paths.block import BlockPath

if TYPE_CHECKING:
    from sfstore.paths.device import DevicePath
    from sfstore.router import Router

__all__ = ["BlockStore", "Key"]

Key = bytes | str
#: what the puts take: key-value pairs (values: anything with the buffer protocol, CPU tensors)
_Items = Mapping[bytes, Any] | Mapping[str, Any] | Mapping[Key, Any] | Iterable[tuple[Key, Any]]
T = TypeVar("T")

_COUNTERS = ("puts", "gets", "hits", "misses", "deletes", "evictions", "corrupt_dropped", "flushes",
             "bytes_put", "bytes_got", "evict_hook_errors", "device_verify_disagreed")
_META_IO = 1 << 20  # metadata I/O chunk (registered buffer size)
_WAIT_SECONDS = 60.0  # how long a put waits for a slot held by other threads' reads and writes
_ZERO_COPY_MIN = 64 << 10  # values this large (and LBA-multiple) move between storage and the caller's memory
_WAVE = 16  # values per engine batch: verifying/copying one wave overlaps the I/O of the next
_WAVE_BYTES = 32 << 20  # ... and fewer when they are large, so the first I/O starts (and the last check ends) soon
_WAVES_IN_FLIGHT = 3  # waves read ahead of the one being verified: bounds the staging buffers a batch holds



def _copy(dest: memoryview, src: memoryview, n: int) -> None:
    """``dest[:n] = src[:n]``; large copies through numpy, which lets other threads run meanwhile."""
    if n >= _ZERO_COPY_MIN:
        import numpy as np

        np.copyto(np.frombuffer(dest, np.uint8, n), np.frombuffer(src, np.uint8, n))
    else:
        dest[:n] = src[:n]



def _waves(sizes: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of consecutive values: at most ``_WAVE`` values or ``_WAVE_BYTES`` each."""
    out = []
    start = total = 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= _WAVE or total + n > _WAVE_BYTES):
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


@dataclass(eq=False)
class _Entry:
    key: bytes
    cls: int
    slot: int
    gen: int
    length: int
    vsum: int
    header: bytes = b""  # the slot header's exact bytes (made on first read): a read compares them whole
    readers: int = 0
    dead: bool = False
    kind: SumKind = SumKind.XXH3  # which checksum vsum is (KV64: the value was written GPU-direct)


@dataclass
class _DeviceValue:
    """A GPU value on its way to a slot: the array and its size (what a host value's memoryview gives)."""

    array: Any
    nbytes: int


_Value = memoryview | _DeviceValue  # a value on its way to a slot: host bytes or a GPU array
_V = TypeVar("_V", bound=_Value)


@dataclass(slots=True)
class _ReservedSlot(Generic[_V]):
    """A value's reserved slot between :meth:`BlockStore._reserve` and :meth:`BlockStore._publish`: the class, slot
    and generation taken for it, and the value's checksum once its write computes it. One batch's values are all
    host bytes (``put_many``) or all GPU arrays (``put_many_device``)."""

    key: bytes
    value: _V
    cls: int
    slot: int
    gen: int
    vsum: int = 0


if TYPE_CHECKING:
    # a read of a wave: the entry's index, its staging buffer (None: straight into the caller's) and whether the
    # engine checks it (only an alias for annotations: RegisteredBuffer is None where the native helper is absent)
    _ReadItem = tuple[int, RegisteredBuffer | None, bool]


class _Class:
    """Runtime state of one size class: free slots, LRU of entries, registered staging buffers."""

    def __init__(self, index: int, size: int, offset: int, stride: int, count: int, io_max: int) -> None:
        self.index = index
        self.size = size
        self.offset = offset
        self.stride = stride
        self.count = count
        self.io_max = io_max
        self.free: list[int] = []
        self.lru: OrderedDict[bytes, _Entry] = OrderedDict()
        self.pool = RegisteredBufferPool(round_up(io_max, 4096))  # buffers are allocated on first use

    def slot_offset(self, slot: int) -> int:
        return self.offset + slot * self.stride

    def close(self) -> None:
        self.pool.close()


class BlockStore:
    """Keys (``bytes`` or ``str``) -> values up to the largest size class, on a block path.

    Parameters
    ----------
    path : BlockPath, str, os.PathLike or Mapping, optional
        Where the store lives: a :class:`BlockPath`, or what :class:`BlockPath` takes (an image file, a block
        device, an NVMe-oF target). Default: the embedded image file ``<data_dir>/hot/blocks.img``.
    size_classes : sequence of int, optional
        Value size classes for a new store (default: the ``block_size_classes`` setting). An existing store
        keeps the classes it was formatted with; asking for others raises :class:`~sfstore.errors.ConfigError`.
    format : bool
        Format the device even when it holds data that is not a block store (or a store with other classes).
        Without it only an empty device (first 4 KiB zero) or a new image file is formatted.
    capacity : int, optional
        For a new store: use only the first ``capacity`` bytes of the device (default: all of it).
    lock_timeout : float
        Seconds to wait for the exclusive lock (and, on a block device, the ``O_EXCL`` open) when another opener
        holds it (default: fail at once); finite and >= 0. A process killed with I/O in flight holds both a
        little after it died, until the kernel has reaped its io_uring.
    on_evict : callable, optional
        ``on_evict(key, value)`` is called with the key and value (``bytes``) of each entry evicted to make
        room, before its slot is reused: the hook to spill to a lower tier. Its errors are counted and
        warned about, and the put goes on.

    Notes
    -----
    Opening takes an exclusive lock (``flock``, plus ``O_EXCL`` on a block device): a second store on the
    same device, in this or another process, raises :class:`~sfstore.errors.StoreInUseError`. Values are
    staged in registered (page-aligned, pinned) buffers: each I/O is one header block plus the value rounded
    up to the LBA size. The store is safe to use from several threads; batches (``put_many``, ``get_many``,
    ``get_into``) are much faster than single calls.
    """

    def __init__(
        self,
        path: BlockPath | str | os.PathLike[str] | Mapping[str, Any] | None = None,
        *,
        size_classes: Sequence[int] | None = None,
        format: bool = False,
        capacity: int | None = None,
        lock_timeout: float = 0.0,
        on_evict: Callable[[bytes, bytes], None] | None = None,
    ) -> None:
        check_timeout(lock_timeout, "BlockStore lock_timeout", finite=True)
        if on_evict is not None and not callable(on_evict):
            raise errors.InvalidRequestError(f"BlockStore on_evict must be callable, not {type(on_evict).__name__}")
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0):
            raise errors.InvalidRequestError(f"BlockStore capacity must be a positive int of bytes, not {capacity!r}")
        if path is None:
            path = os.path.join(defaults.get("data_dir"), "hot", "blocks.img")
        self._owns_path = not isinstance(path, BlockPath)
        self.path: BlockPath = path if isinstance(path, BlockPath) else self._open_path(path, lock_timeout)
        self.on_evict = on_evict
        self._capacity_limit = capacity
        self.counters = Counters(_COUNTERS)
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._closed = False
        self._executor: ThreadPoolExecutor | None = None
        self._index: dict[bytes, _Entry] = {}
        self._pending: list[tuple[int, int]] = []  # (class, slot) to wipe and free after the next flush
        self._inflight: set[int] = set()  # generations being written
        self._state = State(0, False, 0, 1)
        self._next_gen = 1
        self.recovered = ""  # how the index was loaded: "new", "snapshot", "scan"
        self._classes: list[_Class] = []
        self._meta_pool = RegisteredBufferPool(_META_IO)
        self._hdr_pool = RegisteredBufferPool(_WAVE * 4096)  # a wave's slot headers, for zero-copy values
        try:
            self._lock_device(lock_timeout)
            self.layout = self._open_layout(size_classes, format)
            hdr = self.layout.header_bytes
            self._hdr = hdr
            self.max_key_bytes = min(int(defaults.get("block_max_key_bytes")), self.layout.max_key_bytes)
            self._classes = [
                _Class(i, c.size, c.offset, c.stride, c.count, c.stride) for i, c in enumerate(self.layout.classes)
            ]
            if self.recovered != "new":
                self._load_index()
            else:
                for c in self._classes:
                    c.free = list(range(c.count - 1, -1, -1))
            self._write_state(clean=False)
            self.path.flush()
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_router(cls, router: Router | None = None, data_class: str = "hot", **kwargs: Any) -> BlockStore:
        """The store on the block path serving ``data_class`` (``sfstore.open()``'s router by default): one per
        router, made with ``kwargs`` the first time and closed by ``router.close()``."""
        if router is None:
            import sfstore

            router = sfstore.open()
        path = router.path(data_class)
        if not isinstance(path, BlockPath):
            raise errors.ConfigError(f"data class {data_class!r} is served by the {path.kind} path, not the block path")
        store: BlockStore = router.attach(f"blocks:{data_class}", lambda: cls(path, **kwargs))
        return store

    # -- open ------------------------------------------------------------------------------------------------
    @staticmethod
    def _open_path(target: str | os.PathLike[str] | Mapping[str, Any], timeout: float) -> BlockPath:
        """Open the block path, retrying for ``timeout`` seconds while a block device is busy (``O_EXCL``: a killed
        opener's references linger until the kernel has reaped its io_uring)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return BlockPath(target)
            except errors.StoreInUseError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _lock_device(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.path.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    dev = self.path.device
                    raise errors.os_error(exc.errno or errno.EIO, "cannot lock the block store", dev) from None
            if time.monotonic() >= deadline:
                raise errors.StoreInUseError(
                    errno.EBUSY, f"block store {self.path.device} is open in another process or BlockStore",
                    self.path.device,
                )
            time.sleep(0.01)

    def _read_meta(self, offset: int, length: int) -> bytes:
        """Read LBA-aligned metadata (any length, in 1 MiB pieces)."""
        out = bytearray()
        buf = self._meta_pool.acquire()
        try:
            for pos in range(0, length, _META_IO):
                n = min(_META_IO, length - pos)
                self.path.read_into(offset + pos, buf, n)
                out += memoryview(buf)[:n]
        finally:
            buf.release()
        return bytes(out)

    def _write_meta(self, offset: int, data: bytes) -> None:
        """Write LBA-aligned metadata (any length, in 1 MiB pieces); not durable until a flush."""
        buf = self._meta_pool.acquire()
        try:
            for pos in range(0, len(data), _META_IO):
                piece = data[pos:pos + _META_IO]
                memoryview(buf)[: len(piece)] = piece
                self.path.write(offset + pos, buf, len(piece))
        finally:
            buf.release()

    def _open_layout(self, size_classes: Sequence[int] | None, force: bool) -> Layout:
        p = self.path
        meta = max(p.lba_size, 4096)
        where = f"block store {p.device}"
        sizes = None
        if size_classes is not None:
            listed = as_batch(size_classes, "BlockStore size_classes")
            sizes = defaults.SETTINGS["block_size_classes"].parse(listed, "BlockStore size_classes")
        head = self._read_meta(0, meta)
        layout = None if force else Layout.decode(head, where)
        if layout is not None:
            if layout.lba != p.lba_size or layout.capacity > p.capacity:
                raise errors.CorruptStoreError(
                    f"{where}: formatted for LBA {layout.lba} and {layout.capacity} bytes, but the device has LBA "
                    f"{p.lba_size} and {p.capacity} bytes"
                )
            have = tuple(c.size for c in layout.classes)
            if sizes is not None and tuple(sizes) != have:
                raise errors.ConfigError(
                    f"{where} was formatted with size classes {list(have)}, not {list(sizes)}; open it without "
                    "size_classes, or pass format=True to erase it"
                )
            self.recovered = "pending"
            return layout
        if not force and any(head):
            raise errors.CorruptStoreError(
                f"{where} holds data that is not an sfstore block store; pass format=True to erase it"
            )
        capacity = p.capacity
        if self._capacity_limit is not None:
            if self._capacity_limit <= 0:
                raise errors.InvalidRequestError(f"BlockStore capacity must be positive, not {self._capacity_limit}")
            capacity = min(capacity, self._capacity_limit - self._capacity_limit % p.lba_size)
        layout = plan_layout(capacity, p.lba_size, tuple(sizes or defaults.get("block_size_classes")))
        zero = bytes(layout.meta)
        self._write_meta(layout.state_offset(0), zero)
        self._write_meta(layout.state_offset(1), zero)
        p.flush()
        self._write_meta(0, layout.encode())
        p.flush()
        self.recovered = "new"
        return layout

    def _load_index(self) -> None:
        lay = self.layout
        states = [State.decode(self._read_meta(lay.state_offset(i), lay.meta), lay.uuid) for i in (0, 1)]
        valid = [s for s in states if s is not None]
        state = max(valid, key=lambda s: s.seq) if valid else State(0, False, 0, 1)
        self._state = state
        entries: list[SnapshotEntry] | None = None
        if state.clean and 0 < state.snapshot_len <= lay.snapshot_bytes:
            data = self._read_meta(lay.snapshot_offset, round_up(state.snapshot_len, lay.lba))[: state.snapshot_len]
            if value_sum(data) == state.snapshot_sum:
                try:
                    entries = SnapshotEntry.decode_all(data, state.snapshot_entries)
                except Exception:
                    entries = None
            if entries is not None and not all(
                e.cls < len(self._classes) and e.slot < self._classes[e.cls].count for e in entries
            ):
                entries = None
        elif state.clean and state.snapshot_len == 0 and state.snapshot_entries == 0:
            entries = []
        if entries is not None:
            self.recovered = "snapshot"
            self._next_gen = max([state.next_gen] + [e.gen + 1 for e in entries])
            self._install(entries, [])
        else:
            self.recovered = "scan"
            self._scan(state)

    def _install(self, entries: Iterable[SnapshotEntry], stale: list[tuple[int, int]]) -> None:
        used: set[tuple[int, int]] = set(stale)
        for e in sorted(entries, key=lambda x: x.gen):
            entry = _Entry(e.key, e.cls, e.slot, e.gen, e.length, e.value_sum, kind=e.sum_kind)
            self._index[e.key] = entry
            self._classes[e.cls].lru[e.key] = entry
            used.add((e.cls, e.slot))
        self._pending = list(stale)
        for c in self._classes:
            c.free = [s for s in range(c.count - 1, -1, -1) if (c.index, s) not in used]

    def _scan(self, state: State) -> None:
        """Rebuild the index from every slot header; verify the values written after the last flush."""
        hdr = self._hdr
        per = max(1, (1 << 20) // hdr)
        candidates: dict[bytes, list[SlotHeader]] = {}
        max_gen = state.next_gen - 1
        buf = self._meta_pool.acquire()
        try:
            view = memoryview(buf)
            for c in self._classes:
                for first in range(0, c.count, per):
                    n = min(per, c.count - first)
                    reqs = [("read", c.slot_offset(first + j), hdr, buf, j * hdr) for j in range(n)]
                    self.path.submit(reqs).get()
                    for j in range(n):
                        h = SlotHeader.unpack(view[j * hdr:(j + 1) * hdr], self.layout.uuid, hdr)
                        if h is None or h.slot != first + j or h.cls != c.index or h.length > c.size:
                            continue
                        candidates.setdefault(h.key, []).append(h)
                        max_gen = max(max_gen, h.gen)
            del view
        finally:
            buf.release()
        self._next_gen = max_gen + 1
        chosen: list[SnapshotEntry] = []
        stale: list[tuple[int, int]] = []
        torn = 0
        for _key, hs in candidates.items():
            hs.sort(key=lambda h: h.gen, reverse=True)
            pick = None
            for h in hs:
                if pick is None and (h.gen <= state.flushed_gen or self._verify_slot(h)):
                    pick = h
                    continue
                if pick is None:
                    torn += 1
                stale.append((h.cls, h.slot))
            if pick is not None:
                chosen.append(SnapshotEntry(pick.cls, pick.slot, pick.gen, pick.length, pick.value_sum, pick.key,
                                            pick.sum_kind))
        self.counters.add(corrupt_dropped=torn)
        self._install(chosen, stale)

    def _verify_slot(self, h: SlotHeader) -> bool:
        c = self._classes[h.cls]
        n = self._hdr + round_up(h.length, self.layout.lba)
        buf = c.pool.acquire()
        try:
            self.path.submit([("read", c.slot_offset(h.slot), n, buf, 0)]).get()
            view = memoryview(buf)
            ok = sum_of(h.sum_kind, view[self._hdr:self._hdr + h.length]) == h.value_sum
            del view
            return ok
        finally:
            buf.release()

    def _write_state(self, clean: bool, snapshot: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Write the next state record (the other copy), not yet durable."""
        with self._lock:
            flushed = (min(self._inflight) - 1) if self._inflight else self._next_gen - 1
            nxt = self._next_gen
        seq = self._state.seq + 1
        st = State(seq, clean, flushed, nxt, *snapshot)
        self._write_meta(self.layout.state_offset(seq % 2), st.encode(self.layout.uuid, self.layout.meta))
        self._state = st

    # -- keys and values -----------------------------------------------------------------------------------------
    def _key(self, key: object) -> bytes:
        if isinstance(key, str):
            try:
                k = key.encode()
            except UnicodeEncodeError as exc:  # a lone surrogate has no UTF-8 form
                raise errors.InvalidKeyError(f"a block store key must be valid unicode: {exc}") from None
        elif isinstance(key, (bytes, bytearray, memoryview)):
            k = bytes(key)
        else:
            raise errors.InvalidKeyError(f"a block store key must be bytes or str, not {type(key).__name__}")
        if not k:
            raise errors.InvalidKeyError("a block store key must not be empty")
        if len(k) > self.max_key_bytes:
            raise errors.InvalidKeyError(f"a block store key is at most {self.max_key_bytes} bytes, not {len(k)}")
        return k

    @staticmethod
    def _view(obj: Any, writable: bool, what: str, key: bytes) -> memoryview:
        """A flat byte view of ``obj``; errors name ``what`` and ``key`` (formatted only on error: hot path)."""
        try:
            mv = memoryview(obj)
        except TypeError:
            try:
                mv = memoryview(as_buffer(obj))
            except TypeError as exc:
                raise errors.InvalidRequestError(f"{what} {key!r}: {exc}") from None
        if not mv.c_contiguous:
            raise errors.InvalidRequestError(f"{what} {key!r}: the buffer is not contiguous")
        if writable and mv.readonly:
            raise errors.ReadOnlyBufferError(f"{what} {key!r}: the buffer is read-only")
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidRequestError("the block store is closed")

    @property
    def max_value_bytes(self) -> int:
        """The largest value the store holds (its largest size class)."""
        return self._classes[-1].size

    # -- put -------------------------------------------------------------------------------------------------------
    def put(self, key: Key, value: Any, *, durable: bool = False) -> None:
        """Store one value; see :meth:`put_many`."""
        self.put_many([(key, value)], durable=durable)

    def put_many(self, items: _Items, *, durable: bool = False) -> None:
        """Store values (anything with the buffer protocol, or CPU torch tensors), replacing existing keys.

        The values are copied (into registered staging buffers) before this returns. With ``durable`` the
        puts are flushed before returning; otherwise they are durable after the next :meth:`flush`. When a
        size class is full, its least recently used entries are evicted (``on_evict`` sees them first).

        Raises
        ------
        sfstore.errors.InvalidKeyError, sfstore.errors.ValueTooLargeError
            A key is empty or too long, a value does not fit the largest class; raised before any write.
        sfstore.errors.NoSpaceError
            Every slot of every class that fits is being read or written right now.
        """
        self._check_open()
        pairs = items.items() if isinstance(items, Mapping) else as_batch(items, "put_many: items")
        batch: dict[bytes, memoryview] = {}
        for pair in pairs:
            try:
                key, value = pair
            except (TypeError, ValueError):
                raise errors.InvalidRequestError(
                    f"put_many: items are (key, value) pairs or a mapping, not {type(pair).__name__}"
                ) from None
            k = self._key(key)
            mv = self._view(value, False, "value of key", k)
            if mv.nbytes > self.max_value_bytes:
                raise errors.ValueTooLargeError(
                    f"value of key {k!r} is {mv.nbytes} bytes; the largest size class holds {self.max_value_bytes}"
                )
            batch[k] = mv
        if not batch:
            return
        self._put_reserved(list(batch.items()), self._write_slots, SumKind.XXH3)
        if durable:
            self.flush()

    def _put_reserved(self, remaining: list[tuple[bytes, _V]], write: Callable[[list[_ReservedSlot[_V]]], None],
                      kind: SumKind) -> None:
        """Reserve slots for the values, ``write`` them (and their headers), publish them with checksums of
        ``kind``; as many at a time as there are slots free."""
        deadline = time.monotonic() + _WAIT_SECONDS
        while remaining:
            reserved, remaining = self._reserve(remaining)
            if not reserved:
                # Every slot that fits is being written or read by other threads: wait for one of them.
                if time.monotonic() > deadline:
                    raise errors.NoSpaceError(
                        errno.ENOSPC, f"block store {self.path.device}: no slot for a {remaining[0][1].nbytes}-"
                        f"byte value came free within {_WAIT_SECONDS} s (all are being read or written)",
                    )
                with self._slot_freed:
                    self._slot_freed.wait(0.05)  # short: a release between _reserve and here is not missed long
                continue
            try:
                write(reserved)
            except BaseException:
                with self._lock:
                    for r in reserved:
                        self._inflight.discard(r.gen)
                        self._pending.append((r.cls, r.slot))
                    self._slot_freed.notify_all()
                raise
            self._publish(reserved, kind)

    def put_many_device(self, items: Sequence[tuple[Key, Any]], device: DevicePath, *, durable: bool = False,
                        data_class: str = "hot") -> None:
        """Store GPU values through ``device`` (a :class:`~sfstore.paths.device.DevicePath`): each value's
        kvsum64 is computed on the GPU and the value moves from GPU memory to its slot on the device path's route
        for this store's device (GPU-direct where cuFile takes it); its header follows from host memory.

        Values must be multiples of 8 bytes (kvsum64 sums words) and stay unchanged until this returns. Reads
        verify them on the GPU (:meth:`get_into_device`) or in host memory (every other read).
        """
        self._check_open()
        batch: dict[bytes, _DeviceValue] = {}
        for key, value in as_batch(items, "put_many_device: items"):
            k = self._key(key)
            n = int(device.runtime.nbytes(value))
            if n > self.max_value_bytes:
                raise errors.ValueTooLargeError(
                    f"value of key {k!r} is {n} bytes; the largest size class holds {self.max_value_bytes}"
                )
            batch[k] = _DeviceValue(value, n)
        if batch:
            self._put_reserved(list(batch.items()),
                               lambda reserved: self._write_device_slots(reserved, device, data_class), SumKind.KV64)
        if durable:
            self.flush()

    def _write_device_slots(self, reserved: list[_ReservedSlot[_DeviceValue]], device: DevicePath,
                            data_class: str) -> None:
        hdr, uid = self._hdr, self.layout.uuid
        fd = self.path.fd
        for first, last in _waves([item.value.nbytes for item in reserved]):
            wave = reserved[first:last]
            for item in wave:
                item.vsum = device.runtime.checksum(item.value.array, 0, item.value.nbytes)
            values = [Range.write(self._classes[r.cls].slot_offset(r.slot) + hdr, r.value.nbytes, r.value.array,
                                  0, fd) for r in wave]
            device.submit(values, data_class=data_class).get()  # the values first: a header without one fails it
            hbuf = self._hdr_pool.acquire()
            try:
                reqs = []
                for j, r in enumerate(wave):
                    hview = memoryview(hbuf)[j * hdr:(j + 1) * hdr]
                    SlotHeader(r.slot, r.gen, r.value.nbytes, r.vsum, r.cls, r.key, SumKind.KV64).pack_into(hview, uid)
                    del hview
                    reqs.append(("write", self._classes[r.cls].slot_offset(r.slot), hdr, hbuf, j * hdr))
                self.path.submit(reqs, check=False).get()
            finally:
                hbuf.release()
        self.counters.add(puts=len(reserved), bytes_put=sum(item.value.nbytes for item in reserved))

    def get_into_device(self, keys: Sequence[Key], dests: Sequence[Any], device: DevicePath, *,
                        keep_on_miss: bool = True, data_class: str = "hot") -> list[int | None]:
        """Read GPU-written values (:meth:`put_many_device`) into GPU buffers through ``device``; each value's
        length, ``None`` for a miss.

        A value is read on the device path's route and verified on the GPU; with ``keep_on_miss`` it lands in
        a GPU scratch buffer first and reaches ``dests[i]`` only once verified. A value written from host memory
        (xxh3-64, which a GPU does not compute) is a ``None`` here: read it with :meth:`get_into` through host
        memory. A value that fails verification is dropped (``corrupt_dropped``), unless its bytes pass when read
        again through host memory: a fault on the way to the GPU, counted ``device_verify_disagreed``, a miss, the
        value kept.
        """
        self._check_open()
        ks = [self._key(k) for k in as_batch(keys, "get_into_device: keys")]
        outs = as_batch(dests, "get_into_device: dests")
        if len(ks) != len(outs):
            raise errors.InvalidRequestError(f"get_into_device: {len(ks)} keys but {len(outs)} buffers")
        entries = self._acquire(ks)
        result: list[int | None] = [None] * len(ks)
        hits = nbytes = 0
        try:
            live = [i for i, e in enumerate(entries) if e is not None and e.kind is SumKind.KV64]
            for first, last in _waves([e.length for e in entries if e is not None and e.kind is SumKind.KV64]):
                wave = live[first:last]
                targets = []
                ranges = []
                for i in wave:
                    e = entries[i]
                    assert e is not None
                    if int(device.runtime.nbytes(outs[i])) < e.length:
                        raise errors.BufferTooSmallError(
                            f"get_into_device: buffer {i} holds {device.runtime.nbytes(outs[i])} bytes, the value "
                            f"of key {e.key!r} is {e.length}")
                    t = device.runtime.scratch(outs[i], e.length) if keep_on_miss else outs[i]
                    targets.append(t)
                    c = self._classes[e.cls]
                    ranges.append(Range.read(c.slot_offset(e.slot) + self._hdr, e.length, t, 0, self.path.fd))
                got = device.submit(ranges, data_class=data_class).results()
                for i, t, n in zip(wave, targets, got, strict=True):
                    e = entries[i]
                    assert e is not None
                    if n != e.length or device.runtime.checksum(t, 0, e.length) != e.vsum:
                        at = self._classes[e.cls].slot_offset(e.slot) + self._hdr
                        if n == e.length and not damaged_on_storage(self.path.fd, [(at, e.length, e.vsum)]):
                            self.counters.add(device_verify_disagreed=1)  # the slot's bytes pass: kept, a miss
                            warn_disagreement(f"the block store's value of {e.key!r}")
                            continue
                        self._drop_corrupt(e)
                        continue
                    if keep_on_miss:
                        device.runtime.copy(outs[i], 0, t, 0, e.length)
                    result[i] = e.length
                    hits += 1
                    nbytes += e.length
        finally:
            self._unpin(entries)
        self.counters.add(gets=len(ks), hits=hits, misses=len(ks) - hits, bytes_got=nbytes)
        return result

    def sum_kind(self, key: Key) -> SumKind | None:
        """Which checksum ``key``'s value carries (:attr:`~sfstore.checksums.SumKind.XXH3` for a host put,
        :attr:`~sfstore.checksums.SumKind.KV64` for a GPU-direct one), or ``None`` without a value."""
        k = self._key(key)
        with self._lock:
            e = self._index.get(k)
            return None if e is None else e.kind

    def put_many_async(
        self, items: _Items, *, durable: bool = False
    ) -> ExecutorFuture[None]:
        """:meth:`put_many` in a background thread. The values must stay unchanged until the future is done."""
        self._check_open()
        listed = list(items.items()) if isinstance(items, Mapping) else as_batch(items, "put_many_async: items")
        return ExecutorFuture(self._pool_executor().submit(self.put_many, listed, durable=durable), "put_many_async")

    def _reserve(
        self, items: list[tuple[bytes, _V]]
    ) -> tuple[list[_ReservedSlot[_V]], list[tuple[bytes, _V]]]:
        """Take a slot and a generation for as many values as possible, in order (evicting where a class is
        full); return them and the values left for which no slot is free right now.

        Stopping early lets the caller write and publish what it has, which makes those slots evictable: so
        threads whose batches together need more slots than exist never wait on each other forever.
        """
        reserved: list[_ReservedSlot[_V]] = []
        victims: list[tuple[_Entry, int]] = []
        done = 0
        try:
            for k, mv in items:
                while True:
                    with self._lock:
                        got = self._allocate(mv.nbytes)
                        if isinstance(got, tuple):
                            cls, slot, victim = got
                            gen = self._next_gen
                            self._next_gen += 1
                            self._inflight.add(gen)
                            reserved.append(_ReservedSlot(k, mv, cls, slot, gen))
                            if victim is not None:
                                victims.append((victim, cls))
                            break
                    if got == "blocked":
                        break
                    self.flush()  # only slots waiting for a flush are left: recycle them
                if got == "blocked":
                    break
                done += 1
            if victims and self.on_evict is not None:
                self._spill(victims)
        except BaseException:
            with self._lock:
                for r in reserved:
                    self._inflight.discard(r.gen)
                    self._classes[r.cls].free.append(r.slot)
                self._slot_freed.notify_all()
            raise
        return reserved, items[done:]

    def _allocate(self, size: int) -> tuple[int, int, _Entry | None] | str:
        """A slot for ``size`` bytes: a free one, else (``"flush"``) one a flush would recycle, else the least
        recently used entry's; ``"blocked"`` when every fitting slot is being read or written."""
        fits = [c for c in self._classes if c.size >= size]
        for c in fits:
            if c.free:
                return c.index, c.free.pop(), None
        indexes = {c.index for c in fits}
        if any(cls in indexes for cls, _slot in self._pending):
            return "flush"
        for c in fits:
            for entry in c.lru.values():
                if entry.readers == 0:
                    del c.lru[entry.key]
                    del self._index[entry.key]
                    self.counters.add(evictions=1)
                    return c.index, entry.slot, entry
        return "blocked"

    def _spill(self, victims: list[tuple[_Entry, int]]) -> None:
        hook = self.on_evict
        assert hook is not None
        values = self._read_entries([v for v, _ in victims], None, pinned=False)
        for (victim, _cls), value in zip(victims, values, strict=True):
            if value is None:
                continue
            try:
                hook(victim.key, value if isinstance(value, bytes) else b"")
            except Exception as exc:
                self.counters.add(evict_hook_errors=1)
                warnings.warn(f"sfstore BlockStore on_evict failed for key {victim.key!r}: {exc!r}", stacklevel=3)

    def _write_slots(self, reserved: list[_ReservedSlot[memoryview]]) -> None:
        hdr = self._hdr
        lba = self.layout.lba
        uid = self.layout.uuid
        pending: list[tuple[PathFuture, list[RegisteredBuffer]]] = []
        try:
            for first, last in _waves([item.value.nbytes for item in reserved]):
                wave = reserved[first:last]
                bufs: list[RegisteredBuffer] = []
                reqs = []
                try:
                    # Values of zero-copy items go first, straight from the caller's memory, so the device is busy
                    # while their checksums are computed; their headers follow in a second batch (a header
                    # without its whole value fails the value checksum, like a torn slot).
                    direct = [j for j, item in enumerate(wave) if item.value.nbytes >= _ZERO_COPY_MIN
                              and item.value.nbytes % lba == 0]
                    if direct:
                        vreqs = [("write", self._classes[wave[j].cls].slot_offset(wave[j].slot) + hdr,
                                  wave[j].value.nbytes, wave[j].value, 0) for j in direct]
                        pending.append((self.path.submit(vreqs, check=False), []))
                        hbuf = self._hdr_pool.acquire()
                        bufs.append(hbuf)
                        for j in direct:
                            r = wave[j]
                            hview = memoryview(hbuf)[j * hdr:(j + 1) * hdr]
                            r.vsum = value_sum(r.value)
                            SlotHeader(r.slot, r.gen, r.value.nbytes, r.vsum, r.cls, r.key).pack_into(hview, uid)
                            del hview
                            reqs.append(("write", self._classes[r.cls].slot_offset(r.slot), hdr, hbuf, j * hdr))
                    for j, item in enumerate(wave):
                        if j in direct:
                            continue
                        c = self._classes[item.cls]
                        n = item.value.nbytes
                        buf = c.pool.acquire()
                        bufs.append(buf)
                        view = memoryview(buf)
                        view[hdr:hdr + n] = item.value
                        io = hdr + round_up(n, lba)
                        if io > hdr + n:
                            view[hdr + n:io] = bytes(io - hdr - n)
                        item.vsum = value_sum(view[hdr:hdr + n])
                        SlotHeader(item.slot, item.gen, n, item.vsum, item.cls, item.key).pack_into(view, uid)
                        del view
                        reqs.append(("write", c.slot_offset(item.slot), io, buf, 0))
                    pending.append((self.path.submit(reqs, check=False), bufs))
                except BaseException:
                    for b in bufs:
                        b.release()
                    raise
            for fut, _bufs in pending:
                fut.get()
        finally:
            for fut, bufs in pending:
                fut.wait()
                for b in bufs:
                    b.release()
        self.counters.add(puts=len(reserved), bytes_put=sum(item.value.nbytes for item in reserved))

    def _publish(self, reserved: list[_ReservedSlot[_V]], kind: SumKind = SumKind.XXH3) -> None:
        with self._lock:
            for r in reserved:
                k, cls, slot, gen = r.key, r.cls, r.slot, r.gen
                self._inflight.discard(gen)
                old = self._index.get(k)
                if old is not None and old.gen > gen:  # a concurrent put of the same key won
                    self._pending.append((cls, slot))
                    continue
                if old is not None:
                    self._classes[old.cls].lru.pop(k, None)
                    self._retire(old)
                entry = _Entry(k, cls, slot, gen, r.value.nbytes, r.vsum, kind=kind)
                self._index[k] = entry
                self._classes[cls].lru[k] = entry
            self._slot_freed.notify_all()

    def _retire(self, entry: _Entry) -> None:
        """The entry left the index: wipe and free its slot after the next flush (once no reader holds it)."""
        entry.dead = True
        if entry.readers == 0:
            self._pending.append((entry.cls, entry.slot))

    # -- get -------------------------------------------------------------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        """The value of ``key`` (a copy), or ``None``."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[Key]) -> list[bytes | None]:
        """The values of ``keys`` (copies; ``None`` for a missing key), read in one batch."""
        self._check_open()
        ks = [self._key(k) for k in as_batch(keys, "get_many: keys")]
        entries = self._acquire(ks)
        out = self._read_entries(entries, None, pinned=True)
        return [v if isinstance(v, bytes) else None for v in out]

    def get_into(
        self, keys: Sequence[Key], buffers: Sequence[Any], *, keep_on_miss: bool = False
    ) -> list[int | None]:
        """Read the values of ``keys`` into ``buffers`` (registered buffers, numpy arrays, CPU torch tensors,
        anything writable with the buffer protocol); return each value's length, ``None`` for a miss.

        A value that fails verification (a torn or damaged slot) is dropped and is a miss. Large values read
        straight into the caller's buffer (no copy) are verified there, so by default a miss may leave that
        buffer overwritten. With ``keep_on_miss`` every value is read into a registered staging buffer and
        copied into its buffer only once verified: a miss leaves its buffer exactly as it was, at the cost of
        one copy per value.

        Raises
        ------
        sfstore.errors.BufferTooSmallError
            A buffer is smaller than its value (checked before any I/O; nothing is read).
        sfstore.errors.InvalidRequestError
            ``keys`` and ``buffers`` differ in length, or a buffer is not contiguous.
        """
        return self.get_into_counting_drops(keys, buffers, keep_on_miss=keep_on_miss)[0]

    def get_into_counting_drops(
        self, keys: Sequence[Key], buffers: Sequence[Any], *, keep_on_miss: bool = False
    ) -> tuple[list[int | None], int]:
        """:meth:`get_into`, and how many of the values were dropped as corrupt: a caller that keeps its own
        counters (the KV cache's ``corrupt_dropped``) learns what this call found, not what others' did."""
        self._check_open()
        keys = as_batch(keys, "get_into: keys")
        buffers = as_batch(buffers, "get_into: buffers")
        if len(keys) != len(buffers):
            raise errors.InvalidRequestError(f"get_into: {len(keys)} keys but {len(buffers)} buffers")
        ks = [self._key(k) for k in keys]
        views = [self._view(b, True, "buffer for key", k) for k, b in zip(ks, buffers, strict=True)]
        entries = self._acquire(ks)
        for e, v, k in zip(entries, views, ks, strict=True):
            if e is not None and e.length > v.nbytes:
                self._unpin(entries)
                raise errors.BufferTooSmallError(
                    f"get_into: the value of key {k!r} is {e.length} bytes; its buffer holds {v.nbytes}"
                )
        corrupt = [0]
        got = self._read_entries(entries, views, pinned=True, direct=not keep_on_miss, corrupt=corrupt)
        return [v if isinstance(v, int) else None for v in got], corrupt[0]

    def get_into_async(
        self, keys: Sequence[Key], buffers: Sequence[Any], *, keep_on_miss: bool = False
    ) -> ExecutorFuture[list[int | None]]:
        """:meth:`get_into` in a background thread; the buffers are filled when the future is done."""
        self._check_open()
        ks = as_batch(keys, "get_into_async: keys")
        bufs = as_batch(buffers, "get_into_async: buffers")
        return ExecutorFuture(self._pool_executor().submit(self.get_into, ks, bufs, keep_on_miss=keep_on_miss),
                              "get_into_async")

    def _acquire(self, keys: list[bytes]) -> list[_Entry | None]:
        with self._lock:
            out: list[_Entry | None] = []
            for k in keys:
                e = self._index.get(k)
                if e is not None:
                    e.readers += 1
                    self._classes[e.cls].lru.move_to_end(k)
                out.append(e)
            return out

    def _unpin(self, entries: Iterable[_Entry | None]) -> None:
        with self._lock:
            for e in entries:
                if e is None:
                    continue
                e.readers -= 1
                if e.dead and e.readers == 0:
                    self._pending.append((e.cls, e.slot))
            self._slot_freed.notify_all()

    def _read_entries(
        self, entries: list[_Entry | None], dests: list[memoryview] | None, pinned: bool, *, direct: bool = True,
        corrupt: list[int] | None = None,
    ) -> list[bytes | int | None]:
        """Read, verify and deliver each entry (to ``dests`` or as bytes); drop the ones that fail their checks.

        Looked-up entries are ``pinned`` (``readers``) by the caller and unpinned here; evicted victims are not
        in the index and their slots are reserved, so they need no pin. ``direct``: large values may read
        straight into ``dests`` (else every value goes through a staging buffer and lands only verified).
        ``corrupt[0]`` is increased by the number of values dropped as corrupt.
        """
        hdr = self._hdr
        lba = self.layout.lba
        out: list[bytes | int | None] = [None] * len(entries)
        live = [i for i, e in enumerate(entries) if e is not None]
        # per wave: its future, per request (entry index, staging buffer or None when direct, engine-checked),
        # and its staging buffers (released once the wave is delivered: at most _WAVES_IN_FLIGHT waves of them)
        waves: deque[tuple[PathFuture, list[_ReadItem], list[RegisteredBuffer]]] = deque()
        hits = misses = nbytes = 0

        def deliver(fut: PathFuture, items: list[_ReadItem]) -> None:
            nonlocal hits, misses, nbytes
            results = fut.results()
            for j, (i, buf, engine_checked) in enumerate(items):
                e = entries[i]
                assert e is not None
                got = results[j]
                if got < 0 and got != -errno.EBADMSG:
                    raise fut.error_for(j, -got)
                if buf is None:
                    assert dests is not None  # read straight into the caller's buffer: only get_into does
                    good = got >= 0 if engine_checked else sum_of(e.kind, dests[i][: e.length]) == e.vsum
                elif engine_checked:  # the value alone in a staging buffer, checked by the engine: land it
                    assert dests is not None  # staged and engine-checked only for a caller's buffer (keep_on_miss)
                    good = got >= 0
                    if good:
                        _copy(dests[i], memoryview(buf), e.length)
                else:
                    view = memoryview(buf)
                    want = e.header or self._header_bytes(e)
                    value = view[hdr:hdr + e.length]
                    good = got >= 0 and view[: len(want)] == want and sum_of(e.kind, value) == e.vsum
                    if good:
                        if dests is None:
                            out[i] = bytes(value)
                        else:
                            dests[i][: e.length] = value
                    del value, view
                if not good:
                    self._drop_corrupt(e)
                    if corrupt is not None:
                        corrupt[0] += 1
                    misses += 1
                    continue
                if dests is not None:
                    out[i] = e.length
                hits += 1
                nbytes += e.length

        def finish_oldest() -> None:
            """Deliver the oldest wave in flight, then release its buffers (also when delivering fails)."""
            fut0, items0, held0 = waves.popleft()
            try:
                deliver(fut0, items0)
            finally:
                fut0.wait()
                for b in held0:
                    b.release()

        try:
            sizes = [e.length for e in entries if e is not None]  # in the order of ``live``
            classes = self._classes
            for first, last in _waves(sizes):
                items: list[_ReadItem] = []
                reqs: list[tuple[str, int, int, Any, int]] = []
                sums: list[int | None] = []
                held: list[RegisteredBuffer] = []
                try:
                    for i in live[first:last]:
                        e = entries[i]
                        assert e is not None
                        c = classes[e.cls]
                        off = c.offset + e.slot * c.stride
                        n = -(-e.length // lba) * lba
                        if direct and dests is not None and dests[i].nbytes >= n:
                            # The value straight into the caller's buffer (any size that fits it rounded to the
                            # LBA), verified against the checksum the index holds (64 bits: a slot with any other
                            # content fails it), so the header needs no read: it is what a recovery scan reads.
                            # The engine checks it where the read completes when the read is exactly the value;
                            # a value that fails leaves the caller's buffer overwritten.
                            engine_checked = n == e.length and e.kind is SumKind.XXH3  # the engine checks xxh3
                            items.append((i, None, engine_checked))
                            reqs.append(("read", off + hdr, n, dests[i], 0))
                            sums.append(e.vsum if engine_checked else None)
                            continue
                        buf = c.pool.acquire()
                        held.append(buf)
                        if dests is not None and n == e.length and n >= _ZERO_COPY_MIN and e.kind is SumKind.XXH3:
                            # Staged only to land verified (keep_on_miss): the value alone, checked by the
                            # engine where it completes, as a direct read is; the caller's thread only copies.
                            items.append((i, buf, True))
                            reqs.append(("read", off + hdr, n, buf, 0))
                            sums.append(e.vsum)
                            continue
                        items.append((i, buf, False))
                        reqs.append(("read", off, hdr + n, buf, 0))
                        sums.append(None)
                    fut = self.path.submit(reqs, check=False, checksums=sums)
                except BaseException:
                    for b in held:
                        b.release()
                    raise
                waves.append((fut, items, held))
                if len(waves) > _WAVES_IN_FLIGHT:
                    finish_oldest()
            while waves:
                finish_oldest()
        finally:
            for fut0, _items, held0 in waves:
                fut0.wait()
                for b in held0:
                    b.release()
            if pinned:
                self._unpin(entries)
        misses += len(entries) - len(live)
        self.counters.add(gets=len(entries), hits=hits, misses=misses, bytes_got=nbytes)
        return out

    def _header_bytes(self, e: _Entry) -> bytes:
        e.header = SlotHeader(e.slot, e.gen, e.length, e.vsum, e.cls, e.key, e.kind).encode(self.layout.uuid)
        return e.header

    def _drop_corrupt(self, e: _Entry) -> None:
        with self._lock:
            if self._index.get(e.key) is e:
                del self._index[e.key]
                self._classes[e.cls].lru.pop(e.key, None)
                e.dead = True  # the slot is freed (wiped at the next flush) when its last reader is done
        self.counters.add(corrupt_dropped=1)

    # -- other operations --------------------------------------------------------------------------------------------
    def contains(self, key: Key) -> bool:
        """Whether ``key`` has a value (no I/O; a torn value written before a crash was dropped at open)."""
        k = self._key(key)
        with self._lock:
            return k in self._index

    __contains__ = contains

    def delete(self, key: Key) -> bool:
        """Remove ``key``; return whether it was there. Durable after the next :meth:`flush`."""
        self._check_open()
        k = self._key(key)
        with self._lock:
            e = self._index.pop(k, None)
            if e is None:
                return False
            self._classes[e.cls].lru.pop(k, None)
            self._retire(e)
        self.counters.add(deletes=1)
        return True

    def checksum(self, key: Key) -> int | None:
        """The xxh3-64 of ``key``'s value as the index has it (no I/O; every read verifies it), or ``None`` (no
        value, or one written GPU-direct: its checksum is a kvsum64, see :meth:`sum_kind`)."""
        k = self._key(key)
        with self._lock:
            e = self._index.get(k)
            return None if e is None or e.kind is not SumKind.XXH3 else e.vsum

    def locate(self, key: Key) -> tuple[int, int] | None:
        """Where ``key``'s slot is on the device: ``(offset, bytes)`` of its header and value (for tools)."""
        k = self._key(key)
        with self._lock:
            e = self._index.get(k)
            if e is None:
                return None
            return self._classes[e.cls].slot_offset(e.slot), self._hdr + round_up(e.length, self.layout.lba)

    def keys(self) -> list[bytes]:
        """Every key, least recently used first."""
        with self._lock:
            return [k for c in self._classes for k in c.lru]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def flush(self) -> None:
        """Make every put that returned so far durable, and recycle the slots that overwrites and deletes freed.

        One ``fdatasync``; when overwrites or deletes freed slots, their headers are then wiped and a second
        ``fdatasync`` makes the wipes durable before the slots are reused.
        """
        self._check_open()
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, []
            self.path.flush()
            # The state record's watermark (every generation up to it is durable) needs no flush of its own:
            # a stale or torn record only makes the next scan verify more values.
            self._write_state(clean=False)
            if pending:
                self._wipe(pending)
                self.path.flush()  # the wipes are durable before a slot is reused
            with self._lock:
                for cls, slot in pending:
                    self._classes[cls].free.append(slot)
                self._slot_freed.notify_all()
        self.counters.add(flushes=1)

    def _wipe(self, slots: list[tuple[int, int]]) -> None:
        hdr = self._hdr
        buf = self._meta_pool.acquire()
        try:
            memoryview(buf)[:hdr] = bytes(hdr)
            for first in range(0, len(slots), 256):
                reqs = [("write", self._classes[c].slot_offset(s), hdr, buf, 0) for c, s in slots[first:first + 256]]
                self.path.submit(reqs).get()
        finally:
            buf.release()

    def stats(self) -> dict[str, Any]:
        """Counters (puts, gets, hits, misses, evictions, corrupt_dropped, bytes, ...) and occupancy per class."""
        with self._lock:
            classes = [
                {"size": c.size, "slots": c.count, "used": len(c.lru), "free": len(c.free)} for c in self._classes
            ]
            entries = len(self._index)
            pending = len(self._pending)
        return {
            **self.counters.snapshot(),
            "entries": entries,
            "awaiting_flush": pending,
            "classes": classes,
            "recovered": self.recovered,
            "device": self.path.device,
            "transport": self.path.transport,
        }

    def describe(self) -> dict[str, Any]:
        """The block path's description plus this store's layout and stats."""
        return {**self.path.describe(), "store": self.stats()}

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sfstore-blocks")
            return self._executor

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a closed store refuses every operation)."""
        return self._closed

    def close(self) -> None:
        """Flush, write the index snapshot, mark the store clean, unlock and close."""
        if self._closed:
            return
        try:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self.flush()
            self._write_snapshot()
            self.path.flush()
        finally:
            self._closed = True
            self._release()

    def _write_snapshot(self) -> None:
        lay = self.layout
        with self._lock:
            entries = [SnapshotEntry(e.cls, e.slot, e.gen, e.length, e.vsum, e.key, e.kind)
                       for e in self._index.values()]
        data = b"".join(e.encode() for e in entries)
        if len(data) > lay.snapshot_bytes:
            self._write_state(clean=False)  # too many long keys for the snapshot area: the next open scans
            return
        start = time.monotonic()
        padded = data + bytes(round_up(len(data), lay.lba) - len(data))
        step = 1 << 20
        for pos in range(0, len(padded), step):
            self._write_meta(lay.snapshot_offset + pos, padded[pos:pos + step])
        self.path.flush()
        self._write_state(clean=True, snapshot=(len(data), value_sum(data), len(entries)))
        self._snapshot_seconds = time.monotonic() - start

    def _release(self) -> None:
        for c in getattr(self, "_classes", []):
            c.close()
        hp = getattr(self, "_hdr_pool", None)
        if hp is not None:
            hp.close()
        pool = getattr(self, "_meta_pool", None)
        if pool is not None:
            pool.close()
        if self._owns_path:
            self.path.close()
        else:
            try:
                fcntl.flock(self.path.fd, fcntl.LOCK_UN)
            except OSError:
                pass

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BlockStore({self.path.device!r}, entries={len(self)}, classes={[c.size for c in self._classes]})"
