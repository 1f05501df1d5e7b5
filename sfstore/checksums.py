"""xxh3-64 (seed 0): the checksum every stored block, slot header and value carries, one function for all layers.

The native helper's build releases the GIL from 64 KiB (threads hashing large values run in parallel, and other
Python threads meanwhile); where the helper was built without ``xxhash.h`` or is missing, python-xxhash (which
holds it) computes the same sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

__all__ = ["xxh3_64", "xxh3_64_hex"]


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


def xxh3_64_hex(data: Any) -> str:
    """:data:`xxh3_64` as 16 lowercase hex digits (how checkpoint manifests record it)."""
    return f"{xxh3_64(data):016x}"
