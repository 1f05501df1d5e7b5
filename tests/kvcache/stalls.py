"""A stall simulated on the host for the KV tiers' deadline tests: every open beneath a tier's directory first
opens a FIFO for reading that no one writes, so the thread waits in the kernel, in a syscall nothing in the
process can cancel, as one in a hard NFS mount whose server is gone does. Ending the stall opens the FIFO for
writing, which lets every waiting thread through, as the server's return would."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class Stall:
    """A FIFO that threads wait on until :meth:`end`."""

    def __init__(self, where: Path) -> None:
        self.path = where / f"stall-{time.monotonic_ns()}.fifo"
        os.mkfifo(self.path)
        self._writer: int | None = None

    def wait(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)  # blocks in the kernel until a writer opens the FIFO
        os.close(fd)

    def end(self) -> None:
        if self._writer is None:
            self._writer = os.open(self.path, os.O_RDWR)  # never blocks; wakes every waiting reader

    def close(self) -> None:
        """End the stall and close the FIFO's writer (once): opens after this wait again."""
        self.end()
        if self._writer is not None and self._writer >= 0:
            os.close(self._writer)
            self._writer = -1


@contextlib.contextmanager
def simulated_stall(obj: Any, attr: str, where: Path) -> Iterator[Stall]:
    """Every call of ``obj.attr`` first waits on a :class:`Stall` (ended by the caller, or on leaving)."""
    stall = Stall(where)
    real: Callable[..., Any] = getattr(obj, attr)

    def stalled(*args: Any, **kwargs: Any) -> Any:
        stall.wait()
        return real(*args, **kwargs)

    setattr(obj, attr, stalled)
    try:
        yield stall
    finally:
        stall.close()
        setattr(obj, attr, real)
