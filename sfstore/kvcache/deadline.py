"""Deadlines for a KV tier's I/O, and quarantine of a tier that misses them.

A thread blocked in a hard NFS mount (or on an NVMe-oF controller that is gone) cannot be cancelled: the kernel
holds it until the server answers. So a tier's operations run on a small pool of worker threads of its own, and
the caller waits for one no longer than the deadline. Past it the caller gets a miss (a get) or drops the write
(a put), and the worker is abandoned: it is no longer counted in the pool, a fresh one takes its place, and
whatever the operation holds (a pinned slot, a scratch buffer) is given back by the abandoned worker itself, by
the ``on_late`` callback, if it ever returns. A tier operation that would publish or copy into the caller's
memory checks :func:`late` first and gives up instead.

A miss quarantines the tier: for a back-off period (``kvcache_quarantine_ms``, doubling with each miss in a
row, at most 64 times that) every operation answers at once without I/O. Then one operation probes the tier;
its success lifts the quarantine. At most ``max_abandoned`` workers are abandoned at a time: at that bound the
tier stays quarantined, and says so, until some of them return.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from sfstore.counters import Counters

__all__ = ["TierGuard", "late", "OK", "TIMEOUT", "QUARANTINED"]

OK, TIMEOUT, QUARANTINED = "ok", "timeout", "quarantined"
_BACKOFF_CAP = 64  # the longest back-off, in units of the first
_COUNTERS = ("calls", "deadline_misses", "quarantine_skips", "probes", "recoveries", "abandoned_total",
             "late_returns")

_current = threading.local()


def late() -> bool:
    """Whether the operation running on this thread was abandoned by its caller (its deadline passed): it must
    not publish a write or copy into the caller's memory. ``False`` outside a guarded operation."""
    task = getattr(_current, "task", None)
    return task is not None and task.state == "abandoned"


def _noop(*_args: Any) -> None:
    return None


class _Task:
    __slots__ = ("args", "done", "error", "fn", "lock", "on_late", "result", "state")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], on_late: Callable[[], None] | None) -> None:
        self.fn, self.args, self.on_late = fn, args, on_late
        self.state = "queued"  # -> running -> done | abandoned; queued -> cancelled
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()


class TierGuard:
    """Runs one tier's operations within a deadline on a bounded pool of worker threads.

    Parameters
    ----------
    name : str
        The tier (for :meth:`describe`).
    timeout_s : float
        The deadline of each operation (0: none; operations then run on the caller's thread).
    quarantine_s : float
        The first back-off after a missed deadline.
    workers : int
        Worker threads that run operations at once (more callers queue, within their deadline).
    max_abandoned : int
        Workers that may be abandoned (stuck past a deadline) at once; at the bound the tier stays quarantined.
    """

    def __init__(self, name: str, timeout_s: float, quarantine_s: float, *, workers: int = 4,
                 max_abandoned: int = 8) -> None:
        self.name = name
        self.timeout_s = max(0.0, float(timeout_s))
        self.quarantine_s = max(0.0, float(quarantine_s))
        self.workers = max(1, workers)
        self.max_abandoned = max(1, max_abandoned)
        self.counters = Counters(_COUNTERS)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._live = 0  # workers in the pool (not abandoned)
        self._idle = 0
        self._abandoned = 0  # workers stuck past a deadline, not returned yet
        self._until = 0.0  # monotonic end of the quarantine (0: not quarantined)
        self._backoff = 0.0
        self._probing = False
        self._reason = ""
        self._closed = False

    # -- the state ---------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def quarantined(self) -> bool:
        """Whether an operation now would be answered without I/O."""
        with self._lock:
            return self._abandoned >= self.max_abandoned or time.monotonic() < self._until or self._probing

    def describe(self) -> dict[str, Any]:
        """The deadline, whether the tier is quarantined now (and why, and for how much longer), the workers
        stuck past a deadline, and the counters."""
        with self._lock:
            now = time.monotonic()
            exhausted = self._abandoned >= self.max_abandoned
            q = exhausted or now < self._until or self._probing
            if exhausted:
                why = (f"{self._abandoned} worker threads are stuck in this tier's I/O past their deadline (the "
                       f"bound is {self.max_abandoned}): no more are risked until some return")
            else:
                why = self._reason if q else ""
            out = {"timeout_ms": round(self.timeout_s * 1000), "quarantined": q, "reason": why,
                   "quarantine_left_ms": max(0, round((self._until - now) * 1000)) if q and not exhausted else 0,
                   "backoff_ms": round(self._backoff * 1000), "probing": self._probing,
                   "abandoned_now": self._abandoned, "max_abandoned": self.max_abandoned}
        out.update(self.counters.snapshot())
        return out

    def _admit(self) -> tuple[bool, bool]:
        """``(run it, it is the probe)``; counts a skipped call."""
        with self._lock:
            now = time.monotonic()
            if self._abandoned >= self.max_abandoned or now < self._until or self._probing:
                skip = True
                probe = False
            elif self._until > 0:  # the back-off is over: this call probes the tier, the others wait for it
                self._probing = True
                skip, probe = False, True
            else:
                skip = probe = False
        if skip:
            self.counters.add(quarantine_skips=1)
        elif probe:
            self.counters.add(probes=1)
        return not skip, probe

    def _missed(self, probe: bool, what: str) -> None:
        with self._lock:
            self._backoff = (min(self._backoff * 2, self.quarantine_s * _BACKOFF_CAP) if self._backoff
                             else self.quarantine_s)
            self._until = max(time.monotonic() + self._backoff, 1e-9)
            self._reason = (f"{what} missed its deadline of {self.timeout_s * 1000:.0f} ms: quarantined for "
                            f"{self._backoff * 1000:.0f} ms, then probed")
            if probe:
                self._probing = False
        self.counters.add(deadline_misses=1)

    def _answered(self, probe: bool) -> None:
        if not probe:
            return
        with self._lock:
            self._probing = False
            self._until = 0.0
            self._backoff = 0.0
            self._reason = ""
        self.counters.add(recoveries=1)

    # -- running -----------------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, on_late: Callable[[], None] | None = None,
            what: str = "an operation") -> tuple[str, Any]:
        """Run ``fn(*args)`` within the deadline: ``("ok", its result)`` (its exception is raised here),
        ``("timeout", None)`` past the deadline (``on_late`` then runs on the worker once ``fn`` returns, if
        it ever does), or ``("quarantined", None)`` when the tier is quarantined (``fn`` did not run)."""
        self.counters.add(calls=1)
        if not self.enabled:
            return OK, fn(*args)
        admit, probe = self._admit()
        if not admit:
            return QUARANTINED, None
        task = _Task(fn, args, on_late)
        self._queue.put(task)
        self._ensure_worker()
        if not task.done.wait(self.timeout_s):
            with task.lock:
                if task.state == "queued":
                    task.state = "cancelled"  # never started: nothing to abandon
                elif task.state == "running":
                    task.state = "abandoned"
            if task.state == "abandoned":
                with self._lock:
                    self._abandoned += 1
                    self._live -= 1
                self.counters.add(abandoned_total=1)
                self._ensure_worker()
            if task.state != "done":
                self._missed(probe, what)
                return TIMEOUT, None
        self._answered(probe)
        if task.error is not None:
            raise task.error
        return OK, task.result

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._closed or self._queue.qsize() <= self._idle or self._live >= self.workers:
                return
            self._live += 1
        # daemon threads: one stuck in a stalled mount must not hold the interpreter's exit
        threading.Thread(target=self._work, name=f"sfstore-kv-{self.name}", daemon=True).start()

    def _work(self) -> None:
        task: _Task | None = None
        while True:
            task = None  # nothing of the last operation stays referenced while this thread waits
            with self._lock:
                self._idle += 1
            task = self._queue.get()
            with self._lock:
                self._idle -= 1
            if task is None:
                with self._lock:
                    self._live -= 1
                return
            with task.lock:
                if task.state == "cancelled":
                    continue
                task.state = "running"
            _current.task = task
            try:
                task.result = task.fn(*task.args)
            except BaseException as exc:  # raised in the caller's thread
                task.error = exc
            finally:
                _current.task = None
                # what the operation was given may be views of the caller's or the tier's buffers: this thread
                # must not keep them alive while it waits for the next operation (they could not be released)
                task.fn, task.args = _noop, ()
            with task.lock:
                abandoned = task.state == "abandoned"
                if not abandoned:
                    task.state = "done"
            task.done.set()
            if abandoned:
                self.counters.add(late_returns=1)
                if task.on_late is not None:
                    try:
                        task.on_late()
                    except Exception:  # what it gives back is the tier's own memory; nothing to report to
                        pass
                task.result = task.error = None
                task.on_late = None
                with self._lock:
                    self._abandoned -= 1
                    if self._closed or self._live >= self.workers:
                        return
                    self._live += 1  # back in the pool

    def close(self) -> None:
        """Stop the idle workers (a stuck one stays abandoned: it ends when its I/O returns)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = self._live
        for _ in range(n):
            self._queue.put(None)
