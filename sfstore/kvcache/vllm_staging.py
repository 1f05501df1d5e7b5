"""The staged copies of sfstore's vLLM connector: CUDA streams and events (``None`` on the CPU, where every copy is
synchronous), the pools of host staging buffers a layer's loads and saves pass through, and the one thread that
puts a step's saved layers into the store once their copies completed."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from sfstore import errors
from sfstore._optional import require

require("torch", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")

import torch  # noqa: E402  (after the check, so that a missing torch is named with the extra that installs it)

__all__ = ["StagingPool", "SaveWorker", "current_stream", "done", "host_wait", "new_stream", "on", "record",
           "wait_event", "wait_stream"]

log = logging.getLogger("sfstore.kvcache.vllm")


def new_stream(device: torch.device) -> Any:
    """A CUDA stream of its own on ``device`` for the connector's copies; ``None`` for a CPU tensor (copies are then
    synchronous and need no ordering)."""
    stream_type: Any = torch.cuda.Stream  # (untyped in torch's stubs)
    return stream_type(device=device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> Any:
    """The stream the engine computes on now (``None`` on the CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def record(stream: Any) -> Any:
    """An event recorded on ``stream`` after the work enqueued there so far; ``None`` without a stream."""
    if stream is None:
        return None
    event_type: Any = torch.cuda.Event  # (untyped in torch's stubs)
    event = event_type(blocking=True)  # a thread that waits for it sleeps instead of spinning (the save worker)
    event.record(stream)
    return event


def wait_event(stream: Any, event: Any) -> None:
    """Make ``stream``'s later work wait for ``event`` on the device (no CPU wait)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def wait_stream(stream: Any, other: Any) -> None:
    """Make ``stream``'s later work wait for what ``other`` has enqueued so far (no CPU wait)."""
    if stream is not None and other is not None:
        stream.wait_stream(other)


def host_wait(event: Any) -> None:
    """Block the calling thread until ``event`` completed (CUDA releases the GIL meanwhile)."""
    if event is not None:
        event.synchronize()


def done(event: Any) -> bool:
    return event is None or bool(event.query())


def on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Enqueue the block's device work on ``stream`` (tensors it allocates belong to it)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


_STAGING_MIN_BYTES = 1 << 20


class StagingPool:
    """Host buffers for staged copies, pinned for a GPU cache, reused rather than allocated (and pinned) per layer.

    A buffer goes back with :meth:`release` and the event of the last copy that reads or writes it; it is handed
    out again only once that event completed (:func:`done`). At most ``limit`` buffers exist: past it,
    :meth:`acquire` waits for the oldest copy (a CPU wait only when the device falls ``limit`` layers behind) or,
    when every buffer is out (with the save worker), for one to come back.

    Parameters
    ----------
    pin : bool
        Pinned (page-locked) memory: needed for asynchronous host-device copies.
    limit : int
        Most buffers this pool holds at once.
    """

    def __init__(self, pin: bool, limit: int) -> None:
        self.pin = pin
        self.limit = max(1, limit)
        self.allocated = 0  # buffers made so far
        self._free: list[torch.Tensor] = []  # by capacity, smallest first
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()  # (event, buffer)
        self._out = 0
        self._cond = threading.Condition()

    def _reclaim(self) -> None:
        for entry in [e for e in self._pending if done(e[0])]:
            self._pending.remove(entry)
            self._add_free(entry[1])

    def _add_free(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
        self._free.sort(key=lambda b: b.numel())

    def reclaim(self) -> None:
        """Put back the buffers whose copies completed (no wait)."""
        with self._cond:
            self._reclaim()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` buffer of at least ``nbytes``, whose last copy completed."""
        while True:
            event = None
            with self._cond:
                self._reclaim()
                for i, buf in enumerate(self._free):
                    if buf.numel() >= nbytes:
                        self._out += 1
                        return self._free.pop(i)
                if len(self._free) + len(self._pending) + self._out < self.limit or self._free:
                    if len(self._free) + len(self._pending) + self._out >= self.limit:
                        self._free.pop(0)  # too small for this copy: make room for one that fits
                    self._out += 1
                    break
                if self._pending:
                    event = self._pending[0][0]
                else:
                    self._cond.wait()
                    continue
            host_wait(event)
        try:
            size = max(_STAGING_MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except BaseException:
            with self._cond:
                self._out -= 1
                self._cond.notify_all()
            raise
        self.allocated += 1
        return buf

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give ``buf`` back; it is reused once ``event`` (the copy that still uses it, if any) completed."""
        with self._cond:
            self._out -= 1
            if event is None:
                self._add_free(buf)
            else:
                self._pending.append((event, buf))
            self._cond.notify_all()

    def synchronize(self) -> None:
        """Wait for every copy still using a buffer of this pool."""
        with self._cond:
            pending = list(self._pending)
        for event, _buf in pending:
            host_wait(event)
        self.reclaim()

    def in_flight(self) -> list[torch.Tensor]:
        """The buffers waiting for their copies (not handed out until those complete)."""
        with self._cond:
            return [buf for _e, buf in self._pending]


class SaveWorker:
    """One thread that runs the connector's save jobs in the order they were handed over.

    A job waits for its device-to-host copy (its event) on this thread and then calls ``store.put_layer``: the
    engine's thread only enqueues the copy. :meth:`wait` returns once every job handed over so far has run.
    """

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self.handed = 0
        self.done = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._closing:
                raise errors.InvalidRequestError("SfstoreConnector: a save handed over after shutdown")
            self._jobs.append(job)
            self.handed += 1
            self._cond.notify_all()

    def wait(self) -> None:
        """Until every job handed over before this call has run."""
        with self._cond:
            target = self.handed
            while self.done < target:
                self._cond.wait()

    def close(self) -> None:
        self.wait()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                job()
            except BaseException:  # a job logs its own errors; this thread must outlive any of them
                log.exception("SfstoreConnector: a save job failed")
            finally:
                with self._cond:
                    self.done += 1
                    self._cond.notify_all()
