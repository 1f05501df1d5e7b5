"""Thread-safe, fork-safe named counters (the engine's stats, each path's counters)."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable

__all__ = ["Counters"]

_live: weakref.WeakSet[Counters] = weakref.WeakSet()


class Counters:
    """Integer counters with fixed names; ``add`` and ``snapshot`` are atomic.

    In a forked child the lock is made anew: another thread may have held it at fork time, and the child
    would wait for it forever (data loader workers fork while I/O threads count).
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(keys)
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._keys, 0)
        _live.add(self)

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` (one keyword per counter)."""
        with self._lock:
            for key, value in deltas.items():
                self._values[key] += value

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        """Set every counter to 0."""
        with self._lock:
            self._values = dict.fromkeys(self._keys, 0)


def _after_fork_in_child() -> None:
    for c in list(_live):
        c._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
