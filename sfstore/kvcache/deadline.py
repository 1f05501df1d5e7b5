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

A quarantine is this process's state, so the guard also publishes it, through a :class:`QuarantineRecorder`,
as a small record other processes read (``sfstore probe``, ``sfstore kv du``): host, pid, tier, its directory
or device, since, until (when this process probes the tier again), reason, workers stuck. The record goes to
this host's data directory (:func:`sfstore.quarantine_records.quarantine_dir`) and, for a shared tier, to the tier's own
directory as well (``.sfkv/quarantine/`` of the namespace's root, where other nodes see it), each written by a
thread of its own: the caller never waits for either, and a write stuck in the stalled mount holds that one
thread only, while later states wait (only the newest kept) for it to return. It is rewritten when the
quarantine is extended and removed when it is lifted; a process killed meanwhile leaves a record whose
``until`` passes (and, on this host, whose pid is dead), which readers then ignore and remove.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar

from sfstore import forks, quarantine_records
from sfstore.counters import Counters

if TYPE_CHECKING:
    from sfstore.kvcache.shared_budget import SharedBudget

__all__ = ["TierGuard", "QuarantineRecorder", "late", "OK", "TIMEOUT", "QUARANTINED"]

Outcome = Literal["ok", "timeout", "quarantined"]
"""How a guarded operation ended: it ran (``ok``), it missed its deadline (``timeout``), or it did not run because
the tier is quarantined (``quarantined``)."""
OK: Final[Outcome] = "ok"
TIMEOUT: Final[Outcome] = "timeout"
QUARANTINED: Final[Outcome] = "quarantined"
_T = TypeVar("_T")
_BACKOFF_CAP = 64  # the longest back-off, in units of the first
_COUNTERS = ("calls", "deadline_misses", "quarantine_skips", "probes", "recoveries", "abandoned_total",
             "late_returns", "slow_unjudged")

_current = threading.local()


def late() -> bool:
    """Whether the operation running on this thread was abandoned by its caller (its deadline passed): it must
    not publish a write or copy into the caller's memory. ``False`` outside a guarded operation."""
    task = getattr(_current, "task", None)
    return task is not None and task.state == "abandoned"


def _noop(*_args: object) -> None:
    return None


_Job = tuple[Callable[[str, dict[str, Any]], None], Callable[[str], None], "dict[str, Any] | None"]


class _RecordWriter:
    """Writes records (the newest state given for each name, ``None``: remove it) on one thread of its own, so
    that no caller waits for the I/O, nor for the thread to start (:meth:`start` is called off the hot path); a
    thread stuck in the I/O is the only one: states given meanwhile wait for it."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._cond = threading.Condition()
        self._pending: dict[str, _Job] = {}
        self._busy = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errors = 0
        forks.after_fork(self._in_forked_child)

    def _in_forked_child(self) -> None:
        # the parent's thread does not exist here (nor does its hold on the condition's lock, nor the write it
        # was busy with); what was pending is the parent's records, its own thread writes them
        self._cond = threading.Condition()
        self._pending = {}
        self._busy = False
        self._thread = None
        self._stopping = False

    def start(self) -> None:
        """Start the thread (nothing when it runs: a forked child starts its own)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            # a daemon thread: one stuck in a stalled mount must not hold the interpreter's exit
            self._thread = threading.Thread(target=self._run, name=f"sfstore-kv-{self._what}", daemon=True)
        self._thread.start()

    def put(self, name: str, write: Callable[[str, dict[str, Any]], None], remove: Callable[[str], None],
            record: dict[str, Any] | None) -> None:
        with self._cond:
            self._pending[name] = (write, remove, record)
            running = self._thread is not None
            self._cond.notify()
        if not running:
            self.start()

    def stop(self) -> None:
        """End the thread once what is pending is written."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                name = next(iter(self._pending))
                write, remove, record = self._pending.pop(name)
                self._busy = True
            try:
                if record is None:
                    remove(name)
                else:
                    write(name, record)
            except OSError:
                self.errors += 1  # a record is advice to other processes: the tier goes on without it
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until what is pending is written; whether it was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)


_local_writer = _RecordWriter("records")  # this host's records, of every tier of the process


class QuarantineRecorder:
    """Publishes one tier's quarantine as a record in this host's state directory and, optionally, in a shared
    tier's directory (see the module doc).

    Parameters
    ----------
    tier : str
        The tier (``"shared"``, ``"block"``).
    target : str
        The tier's directory or device (``""``: not said; ``sfstore kv du`` then cannot match the record).
    namespace : str
        The shared tier's cache namespace.
    shared : SharedBudget, optional
        The shared tier's budget: the record is written in its namespace's ``.sfkv/quarantine/`` too.
    state_dir : str, optional
        Where this host's records go (default: :func:`sfstore.quarantine_records.quarantine_dir` at the first record).
    """

    def __init__(self, tier: str, *, target: str = "", namespace: str = "", shared: SharedBudget | None = None,
                 state_dir: str | None = None) -> None:
        self.tier, self.target, self.namespace = tier, target, namespace
        self.state_dir = state_dir
        self._name = ""
        self._lock = threading.Lock()
        self._shared_budget = shared
        self._out = False  # a record was written (its removal is due)
        self._shared = _RecordWriter(f"{tier}-shared-record") if shared is not None else None
        forks.after_fork(self._in_forked_child)

    def _in_forked_child(self) -> None:
        # a forked child's quarantine is its own: a record of its own name (its pid), none written yet
        self._lock = threading.Lock()
        self._name = ""
        self._out = False

    @classmethod
    def for_shared(cls, budget: SharedBudget) -> QuarantineRecorder:
        """The recorder of the shared tier whose namespace's budget is ``budget``."""
        return cls("shared", target=os.path.normpath(budget.root), namespace=budget.namespace, shared=budget)

    @property
    def name(self) -> str:
        """The record's name: host, pid, tier and a token (two tiers of one process never share one)."""
        with self._lock:
            if not self._name:
                self._name = f"{quarantine_records.host_name()}-{os.getpid()}-{self.tier}-{secrets.token_hex(4)}"
            return self._name

    @property
    def errors(self) -> int:
        """Records that could not be written or removed (this host's: of every recorder of the process)."""
        return _local_writer.errors + (self._shared.errors if self._shared is not None else 0)

    def start(self) -> None:
        """Start the threads that write the records (before the first quarantine: not on the caller's path)."""
        self._dir()
        _local_writer.start()
        if self._shared is not None:
            self._shared.start()

    def close(self) -> None:
        """Remove the record (written by its thread: this does not wait), then end this recorder's thread."""
        if self._out:
            self.publish(None)
        if self._shared is not None:
            self._shared.stop()

    def _dir(self) -> str:
        if self.state_dir is None:  # resolved on the caller's thread, with the settings it has
            self.state_dir = quarantine_records.quarantine_dir()
        return self.state_dir

    def _write_local(self, name: str, record: dict[str, Any]) -> None:
        quarantine_records.write_quarantine_record(self._dir(), name, record)

    def _remove_local(self, name: str) -> None:
        quarantine_records.remove_quarantine_record(self._dir(), name)

    def publish(self, state: dict[str, Any] | None) -> None:
        """Record the tier's quarantine (``since``, ``until``: wall clock, ``reason``, ``abandoned``,
        ``deadline_ms``), or its end (``None``). Returns at once: the records are written by their threads."""
        name = self.name
        self._dir()
        self._out = self._out or state is not None
        record = None if state is None else {
            "host": quarantine_records.host_name(), "pid": os.getpid(), "tier": self.tier, "target": self.target,
            "namespace": self.namespace, "written": time.time(), **state}
        _local_writer.put(name, self._write_local, self._remove_local, record)
        if self._shared is not None and self._shared_budget is not None:
            b = self._shared_budget
            self._shared.put(name, b.write_quarantine, b.remove_quarantine, record)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` seconds in all) until the newest records are written; whether they were."""
        end = time.monotonic() + timeout
        done = _local_writer.flush(timeout)
        if self._shared is not None:
            done = self._shared.flush(max(0.0, end - time.monotonic())) and done
        return done


class _Task(Generic[_T]):
    __slots__ = ("args", "done", "error", "fn", "lock", "on_late", "result", "state")

    def __init__(self, fn: Callable[..., _T], args: tuple[object, ...], on_late: Callable[[], None] | None) -> None:
        # may return None: once run, ``fn`` is swapped for a no-op so that the worker keeps nothing it was lent
        self.fn: Callable[..., _T | None] = fn
        self.args, self.on_late = args, on_late
        self.state = "queued"  # -> running -> done | abandoned; queued -> cancelled
        self.result: _T | None = None
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
    recorder : QuarantineRecorder, optional
        Publishes the quarantine for other processes (default: a record in this host's state directory naming
        the tier only; :meth:`record_to` replaces it).
    """

    def __init__(self, name: str, timeout_s: float, quarantine_s: float, *, workers: int = 4,
                 max_abandoned: int = 8, recorder: QuarantineRecorder | None = None) -> None:
        self.name = name
        self.timeout_s = max(0.0, float(timeout_s))
        self.quarantine_s = max(0.0, float(quarantine_s))
        self.workers = max(1, workers)
        self.max_abandoned = max(1, max_abandoned)
        self.counters = Counters(_COUNTERS)
        self._lock = threading.Lock()
        # one queue for every operation, whatever its result type
        self._queue: queue.SimpleQueue[_Task[Any] | None] = queue.SimpleQueue()
        self._live = 0  # workers in the pool (not abandoned)
        self._idle = 0
        self._abandoned = 0  # workers stuck past a deadline, not returned yet
        self._until = 0.0  # monotonic end of the quarantine (0: not quarantined)
        self._backoff = 0.0
        self._probing = False
        self._reason = ""
        self._closed = False
        self._since = 0.0  # wall clock of the first miss in a row (0: not quarantined)
        self._refresh_at = 0.0  # monotonic: an open-ended quarantine's record is renewed past this
        self._recorded = False  # a record of a quarantine is out
        self.recorder: QuarantineRecorder | None = recorder if recorder is not None else QuarantineRecorder(name)
        forks.after_fork(self._in_forked_child)
        if self.enabled and self.recorder is not None:
            self.recorder.start()
        if self.enabled:
            # one worker from the start: a caller waits for a thread to start (which takes the scheduler's
            # time on a busy host) only when it finds none idle, never on the first operation
            with self._lock:
                self._live += 1
            self._start_worker()

    def _in_forked_child(self) -> None:
        # the parent's workers (idle, running, abandoned) and the caller probing the tier do not exist here:
        # the child starts workers of its own as it needs them, and its next operation after the back-off probes
        self._lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self._live = self._idle = self._abandoned = 0
        self._probing = False

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
                   "since": self._since if q and self._since else None,
                   "quarantine_left_ms": max(0, round((self._until - now) * 1000)) if q and not exhausted else 0,
                   "backoff_ms": round(self._backoff * 1000), "probing": self._probing,
                   "abandoned_now": self._abandoned, "max_abandoned": self.max_abandoned}
        out.update(self.counters.snapshot())
        return out

    def _admit(self, judges: bool = True) -> tuple[bool, bool]:
        """``(run it, it is the probe)``; counts a skipped call. A call that does not judge the tier never
        probes it: it waits, as the others do, for one that does."""
        with self._lock:
            now = time.monotonic()
            if (self._abandoned >= self.max_abandoned or now < self._until or self._probing
                    or (not judges and self._until > 0)):
                skip = True
                probe = False
            elif self._until > 0:  # the back-off is over: this call probes the tier, the others wait for it
                self._probing = True
                skip, probe = False, True
            else:
                skip = probe = False
        if skip:
            self.counters.add(quarantine_skips=1)
            if self._refresh_at and now > self._refresh_at:  # open-ended: renew the record before it ends
                self._publish()
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
            if not self._since:
                self._since = time.time()
        self.counters.add(deadline_misses=1)
        self._publish()

    def _answered(self, probe: bool) -> None:
        if not probe:
            return
        with self._lock:
            self._probing = False
            self._until = 0.0
            self._backoff = 0.0
            self._reason = ""
            if self._abandoned < self.max_abandoned:
                self._since = 0.0
        self.counters.add(recoveries=1)
        self._publish()

    # -- the record other processes read -----------------------------------------------------------------------
    def record_to(self, recorder: QuarantineRecorder | None) -> None:
        """Publish this tier's quarantine through ``recorder`` from now on (``None``: not at all); the old
        recorder's record is removed, and a quarantine in force is recorded by the new one."""
        with self._lock:
            old, self.recorder = self.recorder, recorder
            recorded, self._recorded = self._recorded, False
        if old is not None:
            if recorded:
                old.publish(None)
            old.close()
        if recorder is not None and self.enabled:
            recorder.start()
        self._publish()

    def _record_state(self) -> dict[str, Any] | None:
        """The quarantine as a record has it, ``None`` when there is none (called holding the lock)."""
        now, wall = time.monotonic(), time.time()
        self._refresh_at = 0.0
        if self._abandoned >= self.max_abandoned:
            # no end is known (it comes when a stuck worker returns): the record says the longest back-off and
            # is renewed halfway through, so that it ends soon after this process is gone
            horizon = max(self.quarantine_s, 0.001) * _BACKOFF_CAP
            self._refresh_at = now + horizon / 2
            until = wall + horizon
            reason = (f"{self._abandoned} worker threads are stuck in this tier's I/O past their deadline (the "
                      f"bound is {self.max_abandoned})")
        elif now < self._until:
            until = wall + (self._until - now)
            reason = self._reason
        else:
            return None
        return {"since": self._since or wall, "until": until, "reason": reason, "abandoned": self._abandoned,
                "deadline_ms": round(self.timeout_s * 1000)}

    def _publish(self) -> None:
        """Hand the quarantine's state to the recorder (never waits for its I/O; nothing when unchanged off)."""
        with self._lock:
            rec = self.recorder
            if rec is None or self._closed:
                return
            state = self._record_state()
            if state is None and not self._recorded:
                return
            self._recorded = state is not None
        rec.publish(state)

    # -- running -----------------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., _T], *args: object, on_late: Callable[[], None] | None = None,
            what: str = "an operation", judges: bool = True) -> tuple[Outcome, _T | None]:
        """Run ``fn(*args)`` within the deadline: ``("ok", its result)`` (its exception is raised here),
        ``("timeout", None)`` past the deadline (``on_late`` then runs on the worker once ``fn`` returns, if
        it ever does; here, before this returns, where ``fn`` never started: whatever memory ``fn`` was lent is
        free at once), or ``("quarantined", None)`` when the tier is quarantined (``fn`` did not run).

        ``judges=False`` is for an operation whose time says nothing of the tier's health (a listing, which
        grows with the directory): it is bounded by the deadline all the same, but missing it does not
        quarantine the tier (``slow_unjudged`` counts it), and it never probes a quarantined tier."""
        self.counters.add(calls=1)
        if not self.enabled:
            return OK, fn(*args)
        admit, probe = self._admit(judges)
        if not admit:
            return QUARANTINED, None
        end = time.monotonic() + self.timeout_s  # the deadline counts from the call, a thread's start included
        task = _Task(fn, args, on_late)
        self._queue.put(task)
        self._ensure_worker()
        if not task.done.wait(max(0.0, end - time.monotonic())):
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
                if judges:
                    self._missed(probe, what)
                else:
                    self.counters.add(slow_unjudged=1)
                if task.state == "cancelled" and on_late is not None:
                    on_late()  # no worker ever will: without this, what ``fn`` was lent would never come back
                return TIMEOUT, None
        self._answered(probe)
        if task.error is not None:
            raise task.error
        return OK, task.result

    def run_holding(self, release: Callable[[], None] | None, fn: Callable[..., _T], *args: object,
                    what: str = "an operation") -> tuple[Outcome, _T | None]:
        """:meth:`run` of an operation on memory the caller lends it (pinned slots, staging buffers): ``release``
        gives that memory back once, when the operation is done with it: before this returns, or, past the
        deadline, when the abandoned worker returns."""
        try:
            status, out = self.run(fn, *args, on_late=release, what=what)
        except BaseException:
            if release is not None:
                release()
            raise
        if status != TIMEOUT and release is not None:
            release()
        return status, out

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._closed or self._queue.qsize() <= self._idle or self._live >= self.workers:
                return
            self._live += 1
        self._start_worker()

    def _start_worker(self) -> None:
        # daemon threads: one stuck in a stalled mount must not hold the interpreter's exit
        threading.Thread(target=self._work, name=f"sfstore-kv-{self.name}", daemon=True).start()

    def _work(self) -> None:
        task: _Task[Any] | None = None
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
                    renew = self._abandoned == self.max_abandoned - 1  # the bound no longer holds the tier
                    back = not (self._closed or self._live >= self.workers)
                    if back:
                        self._live += 1  # back in the pool
                if renew:
                    self._publish()
                if not back:
                    return

    def close(self) -> None:
        """Stop the idle workers (a stuck one stays abandoned: it ends when its I/O returns), and remove the
        quarantine's record (its thread writes that; this does not wait for it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = self._live
            rec, self._recorded = self.recorder, False
        for _ in range(n):
            self._queue.put(None)
        if rec is not None:
            rec.close()
