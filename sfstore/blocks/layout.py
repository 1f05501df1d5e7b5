"""The on-device layout of a block store: superblock, state records, index snapshot, slot headers.

::

    offset 0            superblock (one metadata block): magic, uuid, LBA size, size classes and regions
    1 x meta            state record A  } written alternately (seq), each with its own checksum: clean flag,
    2 x meta            state record B  } flushed-generation watermark, index snapshot length and checksum
    3 x meta            index snapshot (written on a clean close; ignored otherwise)
    data_start (1 MiB)  class 0 slots | class 1 slots | ...   each slot: header block + value (LBA-rounded)

A slot header holds the store's uuid (so headers left by an earlier format never come back), the slot
number, the key, the value's length and checksum, a generation (a store-wide counter: the newest wins) and a
checksum over all of it. A value's checksum is xxh3-64, or kvsum64 (:func:`sfstore.checksums.kvsum64`) for a
value written GPU-direct (computed on the GPU): the header's flags say which
(:data:`~sfstore.checksums.BLOCK_SLOT_SUMS`), and in a snapshot entry the top bit of the class byte does
(:data:`~sfstore.checksums.BLOCK_SNAPSHOT_SUMS`). ``meta`` is ``max(LBA, 4096)``; a slot header takes
``max(LBA, 512)`` bytes.
"""

from __future__ import annotations

import struct
import uuid as _uuid
from dataclasses import dataclass

from sfstore import errors
from sfstore.checksums import BLOCK_SLOT_SUMS, BLOCK_SNAPSHOT_SUMS, SumKind, xxh3_64

__all__ = ["ClassRegion", "Layout", "SlotHeader", "State", "SnapshotEntry", "plan_layout", "round_up"]

SUPER_MAGIC = b"SFBLKSB1"
STATE_MAGIC = b"SFBLKST1"
SLOT_MAGIC = b"SFBLKSL1"
VERSION = 1
DATA_ALIGN = 1 << 20
SNAPSHOT_BYTES_PER_SLOT = 64  # room reserved per slot for the index snapshot (keys up to ~20 bytes)

_SUPER = struct.Struct("<8sHHI16sQQQQQ")  # magic, version, n_classes, lba, uuid, capacity, meta, snap_off,
#                                            snap_bytes, data_start
_CLASS = struct.Struct("<QQQQ")  # size, offset, stride, count
_STATE = struct.Struct("<8s16sQBQQQQQ")  # magic, uuid, seq, clean, flushed_gen, next_gen, snap_len, snap_sum,
#                                          snap_entries
_SLOT = struct.Struct("<8s16sQQQQHBB")  # magic, uuid, slot, gen, length, value_sum, key_len, class, flags
_SNAP = struct.Struct("<BQQQQH")  # class, slot, gen, length, value_sum, key_len
_SUM = struct.Struct("<Q")
SLOT_FIXED = _SLOT.size + _SUM.size
_SNAP_SUM_BITS = 0x80  # a snapshot entry's class byte: the checksum kind's code (BLOCK_SNAPSHOT_SUMS) in its top bit


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


@dataclass(frozen=True)
class ClassRegion:
    """One size class: values up to ``size`` bytes in ``count`` slots of ``stride`` bytes from ``offset``."""

    size: int
    offset: int
    stride: int
    count: int

    def slot_offset(self, slot: int) -> int:
        return self.offset + slot * self.stride


@dataclass(frozen=True)
class Layout:
    """Where everything lives on a formatted device."""

    uuid: bytes
    lba: int
    capacity: int
    meta: int
    snapshot_offset: int
    snapshot_bytes: int
    data_start: int
    classes: tuple[ClassRegion, ...]

    @property
    def header_bytes(self) -> int:
        """Bytes of a slot header (the value follows it)."""
        return max(self.lba, 512)

    @property
    def max_key_bytes(self) -> int:
        return self.header_bytes - SLOT_FIXED

    def state_offset(self, copy: int) -> int:
        return (1 + copy) * self.meta

    def encode(self) -> bytes:
        body = _SUPER.pack(SUPER_MAGIC, VERSION, len(self.classes), self.lba, self.uuid, self.capacity, self.meta,
                           self.snapshot_offset, self.snapshot_bytes, self.data_start)
        body += b"".join(_CLASS.pack(c.size, c.offset, c.stride, c.count) for c in self.classes)
        body += _SUM.pack(xxh3_64(body))
        return body + bytes(self.meta - len(body))

    @classmethod
    def decode(cls, data: bytes, where: str) -> Layout | None:
        """The layout in ``data`` (a superblock); ``None`` when it holds no superblock at all."""
        if data[:8] != SUPER_MAGIC:
            return None
        _magic, version, n, lba, uid, capacity, meta, snap_off, snap_bytes, data_start = _SUPER.unpack_from(data)
        if version != VERSION:
            raise errors.CorruptStoreError(f"{where}: block store version {version} is not supported (expected 1)")
        end = _SUPER.size + n * _CLASS.size
        if n < 1 or end + _SUM.size > len(data) or _SUM.unpack_from(data, end)[0] != xxh3_64(data[:end]):
            raise errors.CorruptStoreError(f"{where}: the block store's superblock is damaged (checksum mismatch)")
        regions = tuple(ClassRegion(*_CLASS.unpack_from(data, _SUPER.size + i * _CLASS.size)) for i in range(n))
        return cls(uid, lba, capacity, meta, snap_off, snap_bytes, data_start, regions)


def plan_layout(capacity: int, lba: int, sizes: tuple[int, ...]) -> Layout:
    """Lay out a store over ``capacity`` bytes: each size class gets an equal share of the data area.

    Raises :class:`~sfstore.errors.InvalidRequestError` when the device is too small for one slot of every
    class.
    """
    if len(sizes) > 127:  # a snapshot entry keeps the class in 7 bits (the top one says which checksum)
        raise errors.InvalidRequestError(f"a block store has at most 127 size classes, not {len(sizes)}")
    meta = max(lba, 4096)
    header = max(lba, 512)
    strides = [header + round_up(s, lba) for s in sizes]
    estimate = sum((capacity // len(sizes)) // st for st in strides)
    snap_bytes = round_up(estimate * SNAPSHOT_BYTES_PER_SLOT + meta, meta)
    snap_off = 3 * meta
    data_start = round_up(snap_off + snap_bytes, DATA_ALIGN)
    share = (capacity - data_start) // len(sizes)
    share -= share % lba
    regions = []
    for i, (size, stride) in enumerate(zip(sizes, strides, strict=True)):
        count = max(0, share // stride)
        if count == 0:
            raise errors.InvalidRequestError(
                f"a block store of {capacity} bytes has no room for one {size}-byte slot of every size class "
                f"{list(sizes)}"
            )
        regions.append(ClassRegion(size, data_start + i * share, stride, count))
    return Layout(_uuid.uuid4().bytes, lba, capacity, meta, snap_off, snap_bytes, data_start, tuple(regions))


@dataclass(frozen=True)
class State:
    """A state record: which copy is newest (``seq``), whether the store was closed cleanly (then the index
    snapshot is valid), and the generation up to which every put was flushed."""

    seq: int
    clean: bool
    flushed_gen: int
    next_gen: int
    snapshot_len: int = 0
    snapshot_sum: int = 0
    snapshot_entries: int = 0

    def encode(self, uid: bytes, size: int) -> bytes:
        body = _STATE.pack(STATE_MAGIC, uid, self.seq, int(self.clean), self.flushed_gen, self.next_gen,
                           self.snapshot_len, self.snapshot_sum, self.snapshot_entries)
        body += _SUM.pack(xxh3_64(body))
        return body + bytes(size - len(body))

    @classmethod
    def decode(cls, data: bytes | memoryview, uid: bytes) -> State | None:
        """The record in ``data``, or ``None`` when it is absent, torn or of another format."""
        if bytes(data[:8]) != STATE_MAGIC or _SUM.unpack_from(data, _STATE.size)[0] != xxh3_64(data[:_STATE.size]):
            return None
        _, u, seq, clean, flushed, nxt, slen, ssum, sent = _STATE.unpack_from(data)
        if u != uid:
            return None
        return cls(seq, bool(clean), flushed, nxt, slen, ssum, sent)


@dataclass(frozen=True)
class SlotHeader:
    """The header at the start of every used slot."""

    slot: int
    gen: int
    length: int
    value_sum: int
    cls: int
    key: bytes
    sum_kind: SumKind = SumKind.XXH3

    def pack_into(self, buf: memoryview, uid: bytes) -> None:
        """Write the header at the start of ``buf`` (a ``"B"`` memoryview)."""
        _SLOT.pack_into(buf, 0, SLOT_MAGIC, uid, self.slot, self.gen, self.length, self.value_sum, len(self.key),
                        self.cls, BLOCK_SLOT_SUMS.code(self.sum_kind))
        end = _SLOT.size + len(self.key)
        buf[_SLOT.size:end] = self.key
        _SUM.pack_into(buf, end, xxh3_64(buf[:end]))

    def encode(self, uid: bytes) -> bytes:
        """The header's bytes (what :meth:`pack_into` writes): compared whole on every read of the slot."""
        buf = bytearray(_SLOT.size + len(self.key) + _SUM.size)
        self.pack_into(memoryview(buf), uid)
        return bytes(buf)

    @classmethod
    def unpack(cls, buf: memoryview, uid: bytes, limit: int) -> SlotHeader | None:
        """The header at the start of ``buf``, or ``None`` when the slot holds none (free, wiped, torn, or left
        by another format)."""
        if buf[:8] != SLOT_MAGIC:
            return None
        _magic, u, slot, gen, length, vsum, klen, c, flags = _SLOT.unpack_from(buf)
        end = _SLOT.size + klen
        if u != uid or end + _SUM.size > limit or _SUM.unpack_from(buf, end)[0] != xxh3_64(buf[:end]):
            return None
        kind = BLOCK_SLOT_SUMS.kind(flags)
        if kind is None:
            return None
        return cls(slot, gen, length, vsum, c, bytes(buf[_SLOT.size:end]), kind)


@dataclass(frozen=True)
class SnapshotEntry:
    """One index entry in the snapshot written at a clean close."""

    cls: int
    slot: int
    gen: int
    length: int
    value_sum: int
    key: bytes
    sum_kind: SumKind = SumKind.XXH3

    def encode(self) -> bytes:
        c = self.cls | BLOCK_SNAPSHOT_SUMS.code(self.sum_kind)
        return _SNAP.pack(c, self.slot, self.gen, self.length, self.value_sum, len(self.key)) + self.key

    @staticmethod
    def decode_all(data: bytes | memoryview, count: int) -> list[SnapshotEntry]:
        """``count`` entries from ``data``; raises ``ValueError`` when they do not fit it."""
        out = []
        pos = 0
        for _ in range(count):
            c, slot, gen, length, vsum, klen = _SNAP.unpack_from(data, pos)
            pos += _SNAP.size
            if pos + klen > len(data):
                raise ValueError("snapshot entry runs past the end")
            kind = BLOCK_SNAPSHOT_SUMS.kind(c & _SNAP_SUM_BITS)
            if kind is None:  # (every value of the bit is a kind today)
                raise ValueError(f"snapshot entry with an unknown checksum kind {c & _SNAP_SUM_BITS:#x}")
            out.append(SnapshotEntry(c & ~_SNAP_SUM_BITS, slot, gen, length, vsum, bytes(data[pos:pos + klen]), kind))
            pos += klen
        return out


#: The checksum of a value written from host memory (xxh3-64).
value_sum = xxh3_64

