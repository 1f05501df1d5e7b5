"""The interface every direct path implements, and the counters every path keeps.

A path says what it is through capability properties rather than its class: ``transport`` (``"rdma"``,
``"tcp"`` or ``"local"``), ``supports_direct_io`` and ``supports_device_buffers``; ``fallbacks`` lists each
place where it took a less direct way than the hardware it targets would allow, with the reason. Nothing
falls back silently: :meth:`StoragePath.describe` and the counters report it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from sfstore.counters import Counters

__all__ = ["PathCounters", "StoragePath", "COUNTER_KEYS"]

COUNTER_KEYS = (
    "requests",
    "files",
    "bytes_read",
    "bytes_written",
    "bytes_direct",
    "bytes_bounced",
    "errors",
)


class PathCounters(Counters):
    """Counters of one path: requests, files, bytes read/written, direct vs bounced, errors.

    ``bytes_direct`` moved straight between storage and the caller's (or a registered) buffer with O_DIRECT;
    ``bytes_bounced`` moved through a bounce buffer or the page cache of an O_DIRECT-capable file; bytes on a
    filesystem without O_DIRECT count as neither.
    """

    def __init__(self) -> None:
        super().__init__(COUNTER_KEYS)


class StoragePath(ABC):
    """A direct path to storage.

    Subclasses set :attr:`kind` and implement :attr:`transport`, :meth:`describe` and :meth:`flush`.
    """

    kind: str = ""

    def __init__(self) -> None:
        self.counters = PathCounters()
        self.fallbacks: list[str] = []

    @property
    @abstractmethod
    def transport(self) -> str:
        """``"rdma"``, ``"tcp"`` or ``"local"``."""

    @property
    def supports_direct_io(self) -> bool:
        """Whether data moves with O_DIRECT (no page-cache copy) on this path."""
        return False

    @property
    def supports_device_buffers(self) -> bool:
        """Whether GPU buffers are read and written without a host bounce."""
        return False

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What this path is: kind, target, transport, capabilities, fallbacks with reasons, counters."""

    def flush(self) -> None:  # noqa: B027 - a no-op is the right default for paths that buffer nothing
        """Make everything written so far durable."""

    def close(self) -> None:  # noqa: B027 - a no-op is the right default for paths that hold nothing
        """Release what the path holds (descriptors, connections)."""

    def __enter__(self) -> StoragePath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
