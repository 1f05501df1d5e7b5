"""The native engines: ``uring`` (io_uring) and ``threads`` (a C++ thread pool), from ``sfstore._native``.

Both take a whole batch in one call: the native side validates every request, plans O_DIRECT requests into
direct and bounced operations, and runs them with the GIL released. Python only wraps the handle.
Importing this module fails with ``ImportError`` where the helper was not built; :mod:`sfstore.engine`
then offers the pure-Python engine and says why.
"""

from __future__ import annotations

from collections.abc import Sequence

from sfstore import _native, defaults, errors
from sfstore.engine.base import IOEngine, IOFuture, Request

__all__ = ["NativeEngine", "NativeIOFuture", "native_status"]


def native_status() -> dict[str, tuple[bool, str]]:
    """Whether each native backend can run here: ``{"uring": (ok, reason), "threads": (ok, reason)}``."""
    uring_ok, uring_why = _native.uring_status()
    return {"uring": (bool(uring_ok), str(uring_why)), "threads": (True, "native thread pool")}


class NativeIOFuture(IOFuture):
    """The future of a batch running in the native engine."""

    def __init__(self, handle: _native.Future, requests: Sequence[Request]) -> None:
        # Deliberately not IOFuture.__init__: describing every request up front costs a microsecond each
        # on the hot path, and the descriptions are only needed for an error message.
        self._requests = requests
        self._handle = handle

    @property
    def _described(self) -> list[tuple[str, int, int, int]]:  # type: ignore[override]
        return [(str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in self._requests]

    def __len__(self) -> int:
        return len(self._requests)

    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> bool:
        return self._handle.wait(-1.0 if timeout is None else max(0.0, float(timeout)))

    def transferred(self) -> tuple[int, int]:
        return self._handle.transferred()

    def results(self, timeout: float | None = None) -> list[int]:
        if not self.wait(timeout):
            raise self.timeout_error(timeout)
        return self._handle.results()


class NativeEngine(IOEngine):
    """An engine backed by ``sfstore._native.IOEngine``.

    Parameters
    ----------
    backend : {"uring", "threads"}
        io_uring with ``queue_depth`` entries in flight, or a pool of ``threads`` workers.
    queue_depth : int
        Operations in flight at most (io_uring). For ``threads`` the depth is the number of workers.
    threads : int
        Workers of the ``threads`` backend.

    Notes
    -----
    Requests larger than 64 MiB are cut into 64 MiB operations, so one request can use several queue slots.
    """

    def __init__(self, backend: str, queue_depth: int, threads: int) -> None:
        ok, why = native_status().get(backend, (False, f"unknown native backend {backend!r}"))
        if not ok:
            raise errors.EngineUnavailableError(f"the {backend} engine cannot run here: {why}")
        depth = queue_depth if backend == "uring" else threads
        super().__init__(backend, depth, supports_direct_io=True)
        self._handle = _native.IOEngine(
            backend, queue_depth, threads, defaults.get("bounce_buffer_size"), defaults.get("uring_spin_us")
        )

    def submit(self, requests: Sequence[Request]) -> IOFuture:
        self._check_open()
        reqs = requests if isinstance(requests, (list, tuple)) else list(requests)
        return NativeIOFuture(self._handle.submit(reqs, bool(defaults.get("bounce"))), reqs)

    def stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in self._handle.stats().items()}

    def _shutdown(self) -> None:
        self._handle.close()

    def _after_fork_in_child(self) -> None:
        # The parent's service threads do not exist here; the native side skips joining them in a child.
        self._closed = True
