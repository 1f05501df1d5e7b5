"""The native engines: ``uring`` (io_uring) and ``threads`` (a C++ thread pool), from ``sfstore._native``.

Both take a whole batch in one call: the native side validates every request, plans O_DIRECT requests into
direct and bounced operations, and runs them with the GIL released. Python only wraps the handle.
Importing this module fails with ``ImportError`` where the helper was not built; :mod:`sfstore.engine`
then offers the pure-Python engine and says why.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

from sfstore import _native, defaults, errors
from sfstore.counters import Counters
from sfstore.engine.base import IOEngine, IOFuture, Request, byte_view, read_checksum_ok, wait_seconds

__all__ = ["NativeEngine", "NativeIOFuture", "checksums_where", "native_status"]


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
        seconds = wait_seconds(timeout)
        return self._handle.wait(-1.0 if seconds is None else seconds)

    def transferred(self) -> tuple[int, int]:
        return self._handle.transferred()

    def results(self, timeout: float | None = None) -> list[int]:
        if not self.wait(timeout):
            raise self.timeout_error(timeout)
        return self._handle.results()


class _CheckedAfterFuture(NativeIOFuture):
    """A batch whose read checksums are checked on the caller's thread once it is done: the native helper
    was built without xxhash.h (see :func:`checksums_where`)."""

    def __init__(self, engine: NativeEngine, handle: _native.Future, requests: Sequence[Request],
                 checksums: Sequence[int | None]) -> None:
        super().__init__(handle, requests)
        self._engine = engine
        self._checksums = checksums
        self._checked: list[int] | None = None

    def results(self, timeout: float | None = None) -> list[int]:
        if self._checked is None:
            raw = super().results(timeout)
            verified = failed = 0
            for i, want in enumerate(self._checksums):
                if want is None or raw[i] < 0:
                    continue
                r = self._requests[i]
                verified += raw[i]
                start = r[5] if len(r) > 5 else 0
                with byte_view(r[4]) as view:
                    good = read_checksum_ok(view[start:], raw[i], r[3], want)
                if not good:
                    raw[i] = -errno.EBADMSG
                    failed += 1
            self._engine._fallback_counters.add(bytes_verified=verified, verify_failed=failed, errors=failed)
            self._checked = raw
        return list(self._checked)


def checksums_where() -> str:
    """Where the native engine checks read checksums: ``"engine"`` (its service thread) or ``"caller"``
    (the helper was built without xxhash.h: the caller's thread checks them after the batch)."""
    return "engine" if _native.xxh3_available() else "caller"


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
        if backend not in ("uring", "threads"):
            raise errors.InvalidRequestError(f"NativeEngine: backend must be 'uring' or 'threads', not {backend!r}")
        # Out-of-range values are the caller's mistake, named as such (not a nanobind TypeError, nor a reason
        # for engine=auto to pick another engine).
        queue_depth = int(defaults.SETTINGS["queue_depth"].parse(queue_depth, "NativeEngine(queue_depth=...)"))
        threads = int(defaults.SETTINGS["io_threads"].parse(threads, "NativeEngine(threads=...)"))
        ok, why = native_status().get(backend, (False, f"unknown native backend {backend!r}"))
        if not ok:
            raise errors.EngineUnavailableError(f"the {backend} engine cannot run here: {why}")
        depth = queue_depth if backend == "uring" else threads
        super().__init__(backend, depth, supports_direct_io=True)
        self._handle = _native.IOEngine(
            backend, queue_depth, threads, defaults.get("bounce_buffer_size"), defaults.get("uring_spin_us")
        )
        self._native_checksums = checksums_where() == "engine"
        self._fallback_counters = Counters(("bytes_verified", "verify_failed", "errors"))

    def submit(self, requests: Sequence[Request], *, checksums: Sequence[int | None] | None = None) -> IOFuture:
        self._check_open()
        reqs = self._as_batch(requests)
        bounce = bool(defaults.get("bounce"))
        if checksums is None:
            return NativeIOFuture(self._handle.submit(reqs, bounce), reqs)
        if self._native_checksums:
            return NativeIOFuture(self._handle.submit(reqs, bounce, checksums), reqs)
        self._check_checksums(reqs, checksums)
        return _CheckedAfterFuture(self, self._handle.submit(reqs, bounce), reqs, list(checksums))

    def stats(self) -> dict[str, int]:
        out = {k: int(v) for k, v in self._handle.stats().items()}
        for k, v in self._fallback_counters.snapshot().items():
            out[k] = out.get(k, 0) + v
        return out

    def _shutdown(self) -> None:
        self._handle.close()

    def _after_fork_in_child(self) -> None:
        # The parent's service threads do not exist here; the native side skips joining them in a child.
        self._closed = True
