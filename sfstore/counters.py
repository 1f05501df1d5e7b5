"""Thread-safe, fork-safe named counters (the engine's stats, each path's counters)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from sfstore import forks

__all__ = ["Counters"]


class Counters:
    """Integer counters with fixed names; ``add`` and ``snapshot`` are atomic.

    In a forked child the lock is made anew: another thread may have held it at fork time, and the child
    would wait for it forever (data loader workers fork while I/O threads count).
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(keys)
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._keys, 0)
        forks.after_fork(self._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

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
