"""A second opinion before a store drops a value a GPU read found damaged.

Values written from GPU memory carry kvsum64 checksums, verified where they land: in GPU memory, after a read on
the device path. A mismatch there is either damage on storage or a defect on the way (a driver, kvikio, the
device path's own ranges): dropping the value on a defect of one reader's way would lose it for every reader (a
KV shared tier's file is every node's). The bytes are read again through host memory and summed there; only when
they fail there too is the value damaged. Runs on a failure only.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence

from sfstore.checksums import kvsum64

__all__ = ["damaged_on_storage", "warn_disagreement"]

log = logging.getLogger("sfstore")


_ALIGN = 4096  # what O_DIRECT descriptors (a block store's device) take: whole sectors into aligned memory


def damaged_on_storage(fd: int, spans: Sequence[tuple[int, int, int]]) -> bool:
    """Whether the bytes at ``spans`` (``(file offset, length, kvsum64)`` each) of the open file or device ``fd``
    (O_DIRECT or not), read through host memory, fail their checksums (or are not all there). ``False`` where
    they could not be read: an error is no evidence of damage (the read is a miss all the same)."""
    for offset, length, expected in spans:
        start = offset - offset % _ALIGN
        size = -(-(offset + length - start) // _ALIGN) * _ALIGN
        with mmap.mmap(-1, size) as buf:  # page-aligned
            try:
                got = os.preadv(fd, [buf], start)
            except OSError:
                return False
            at = offset - start
            if got < at + length or kvsum64(memoryview(buf)[at:at + length]) != expected:
                return True
    return False


def warn_disagreement(what: str) -> None:
    """Log that a GPU read's checksums failed on bytes that pass in host memory: the file is kept, the read is a
    miss."""
    log.warning("sfstore: %s failed its checksum in GPU memory but not in host memory: kept, and read as a miss "
                "(a defect between the storage and the GPU: the device path's route, kvikio, the driver)", what)
