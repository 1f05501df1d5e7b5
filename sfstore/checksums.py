"""xxh3-64 (seed 0): the checksum every stored block, slot header and value carries, one function for all layers;
:func:`kvsum64`, the checksum of KV blocks that move GPU-direct (computed where the block is, GPU or host); and the
one table of checksum kinds (:class:`SumKind`) with each on-disk format's codes for them (:class:`SumCodes`).

In memory a value's checksum kind is always a :class:`SumKind`; a number appears only where a format stores it,
through that format's table (:data:`BLOCK_SLOT_SUMS`, :data:`BLOCK_SNAPSHOT_SUMS`, :data:`SHARED_FILE_SUMS`,
:data:`SHARED_CHUNK_SUMS`), so no
format's number can be read as another's.

The native helper's build releases the GIL from 64 KiB (threads hashing large values run in parallel, and other
Python threads meanwhile); where the helper was built without ``xxhash.h`` or is missing, python-xxhash (which
holds it) computes the same sums.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash

__all__ = ["xxh3_64", "xxh3_64_many", "xxh3_64_hex", "kvsum64", "kvsum64_finish", "KVSUM_WORD", "SumKind", "sum_of",
           "SumCodes", "BLOCK_SLOT_SUMS", "BLOCK_SNAPSHOT_SUMS", "SHARED_FILE_SUMS",
           "SHARED_CHUNK_SUMS"]


def _pick() -> Callable[[Any], int]:
    try:
        from sfstore import _native

        if _native.xxh3_available():
            return _native.xxh3_64
    except ImportError:
        pass
    return xxhash.xxh3_64_intdigest


#: ``xxh3_64(buffer) -> int`` of any contiguous buffer (bytes, memoryview, numpy array): a C function, called
#: directly, as it runs once per block on the hot paths.
xxh3_64: Callable[[Any], int] = _pick()


def _pick_many() -> Callable[[Sequence[Any]], list[int]]:
    try:
        from sfstore import _native

        if _native.xxh3_available() and hasattr(_native, "xxh3_64_many"):
            return _native.xxh3_64_many
    except ImportError:
        pass
    return lambda buffers: [xxh3_64(b) for b in buffers]


#: ``xxh3_64_many(buffers) -> list[int]``: :data:`xxh3_64` of each buffer, in one call into the native helper
#: that releases the GIL once for all of them (a batch of blocks read together is verified with one hand-over of
#: the interpreter, not one per block).
xxh3_64_many: Callable[[Sequence[Any]], list[int]] = _pick_many()


def xxh3_64_hex(data: Any) -> str:
    """:data:`xxh3_64` as 16 lowercase hex digits (how checkpoint manifests record it)."""
    return f"{xxh3_64(data):016x}"


KVSUM_WORD = 8
"""Bytes per word of :func:`kvsum64`: blocks it sums are a multiple of this."""

_MASK = (1 << 64) - 1
_weights: dict[int, Any] = {}


def kvsum64_finish(weighted_sum: int, nbytes: int) -> int:
    """The last step of :func:`kvsum64`: mix the weighted word sum (mod 2**64) with the length (splitmix64)."""
    z = (weighted_sum ^ (nbytes * 0x9E3779B97F4A7C15)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def kvsum64(data: Any) -> int:
    """The checksum of a KV block moved GPU-direct: ``sum(word[i] * (2*i + 1)) mod 2**64`` over its little-endian
    64-bit words, mixed with the length (:func:`kvsum64_finish`).

    Unlike xxh3-64 it is a sum, so a GPU computes it with one multiply and one reduction (order does not change a
    sum mod 2**64) and the block never has to visit host memory to be checked; the odd weights make any change
    of one word, and any swap of two, change the sum. Weaker than xxh3 against crafted changes: it guards
    against torn and misdirected I/O, not an adversary. ``data`` is host memory of a multiple of
    :data:`KVSUM_WORD` bytes.
    """
    import numpy as np

    view = memoryview(data).cast("B")
    n = view.nbytes
    if n % KVSUM_WORD:
        raise ValueError(f"kvsum64 sums whole {KVSUM_WORD}-byte words, not {n} bytes")
    words = np.frombuffer(view, dtype="<u8")
    w = _weights.get(words.size)
    if w is None:
        w = _weights[words.size] = np.arange(1, 2 * words.size, 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        total = int(np.dot(words, w)) if words.size else 0  # uint64 arithmetic wraps mod 2**64
    return kvsum64_finish(total & _MASK, n)


class SumKind(enum.Enum):
    """Which checksum a stored value carries."""

    XXH3 = "xxh3-64"
    """:data:`xxh3_64`: a value put from host memory."""
    KV64 = "kvsum64"
    """:func:`kvsum64`: a KV block put GPU-direct (its checksum computed on the GPU)."""


def sum_of(kind: SumKind, data: Any) -> int:
    """The checksum of kind ``kind`` of host bytes ``data``."""
    return kvsum64(data) if kind is SumKind.KV64 else xxh3_64(data)


class SumCodes:
    """One on-disk format's numbers for the checksum kinds it stores: :meth:`code` to write one, :meth:`kind` to
    read one back (``None`` for a number the format does not define: the record is not one of this format's).

    The numbers are part of the format: files and slots written with them must still read, so they never change.
    """

    def __init__(self, where: str, codes: Mapping[SumKind, int]) -> None:
        self.where = where
        self._codes = dict(codes)
        self._kinds = {code: kind for kind, code in self._codes.items()}
        if len(self._kinds) != len(self._codes):
            raise ValueError(f"{where}: two checksum kinds share a code")

    def code(self, kind: SumKind) -> int:
        """The number this format stores for ``kind``."""
        try:
            return self._codes[kind]
        except KeyError:
            raise ValueError(f"{self.where} cannot record a {kind.value} checksum") from None

    def kind(self, code: int) -> SumKind | None:
        """The kind stored as ``code``, or ``None`` when this format defines no such code."""
        return self._kinds.get(code)

    def __repr__(self) -> str:
        return f"SumCodes({self.where!r}, {{{', '.join(f'{k.name}: {c}' for k, c in self._codes.items())}}})"


#: A block store's slot header: its ``flags`` byte (:class:`sfstore.blocks.layout.SlotHeader`).
BLOCK_SLOT_SUMS = SumCodes("a block store's slot header", {SumKind.XXH3: 0, SumKind.KV64: 1})
#: A block store's index snapshot entry: the top bit of its class byte (:class:`sfstore.blocks.layout.SnapshotEntry`).
BLOCK_SNAPSHOT_SUMS = SumCodes("a block store's index snapshot", {SumKind.XXH3: 0, SumKind.KV64: 0x80})
#: A KV cache's shared-tier block file: its header's version field (:func:`sfstore.kvcache.tiers.encode_header`).
SHARED_FILE_SUMS = SumCodes("a shared KV block file's header", {SumKind.XXH3: 1, SumKind.KV64: 2})
#: A KV cache's shared-tier chunk file: its header's checksum-kind field
#: (:func:`sfstore.kvcache.shared_chunks.encode_header`), the kind of every slice's checksum in it.
SHARED_CHUNK_SUMS = SumCodes("a shared KV chunk file's header", {SumKind.XXH3: 1, SumKind.KV64: 2})
