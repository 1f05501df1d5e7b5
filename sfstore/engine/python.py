"""The pure-Python I/O engine: ``os.preadv``/``os.pwritev`` into memoryview slices on a thread pool.

It has the semantics of every engine (see :mod:`sfstore.engine`) and needs nothing but the standard library,
so it is always there when the native helper is not built. On ``O_DIRECT`` descriptors it goes direct where a
request is aligned and, with the ``bounce`` setting on, moves misaligned parts through page-aligned bounce
buffers (``mmap``) or, for misaligned write heads and tails, through a buffered descriptor of the same file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as _futures_thread

from sfstore import defaults, errors, forks
from sfstore.engine.base import (
    CheckedRequest,
    IOEngine,
    IOFuture,
    Request,
    Segment,
    plan_direct,
    read_checksum_ok,
    validate_batch,
    wait_seconds,
)

__all__ = ["PythonEngine"]


class _PythonFuture(IOFuture):
    """Future of a batch run by :class:`PythonEngine`."""

    def __init__(self, requests: Sequence[Request]) -> None:
        super().__init__(requests)
        self._results = [0] * len(requests)
        self._event = threading.Event()
        self._causes: dict[int, BaseException] = {}
        self._moved = [0, 0]  # direct, bounced; updated under the batch lock
        self._forked = False
        forks.after_fork(self._after_fork_in_child)

    def transferred(self) -> tuple[int, int]:
        return (self._moved[0], self._moved[1])

    def done(self) -> bool:
        return self._event.is_set()

    def _after_fork_in_child(self) -> None:
        self._forked = True

    def _check_process(self) -> None:
        # In a forked child the workers running this batch stayed in the parent: it never finishes here.
        if self._forked and not self._event.is_set():
            raise errors.EngineUnavailableError(
                "this batch was still running in the parent process at fork(); its results stay there"
            )

    def wait(self, timeout: float | None = None) -> bool:
        self._check_process()
        return self._event.wait(wait_seconds(timeout))

    def results(self, timeout: float | None = None) -> list[int]:
        self._check_process()
        if not self._event.wait(wait_seconds(timeout)):
            raise self.timeout_error(timeout)
        return list(self._results)

    def error_for(self, index: int, err: int) -> errors.SfstoreOSError:
        exc = super().error_for(index, err)
        cause = self._causes.get(index)
        if cause is not None:
            exc.__cause__ = cause
        return exc


class _BouncePool:
    """Page-aligned bounce buffers (anonymous ``mmap``), reused across requests."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}

    @contextlib.contextmanager
    def buffer(self, size: int) -> Iterator[memoryview]:
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
        if buf is None:
            buf = mmap.mmap(-1, size)  # anonymous mappings are page-aligned
        view = memoryview(buf)
        try:
            yield view
        finally:
            view.release()
            with self._lock:
                free = self._free.setdefault(size, [])
                if len(free) < self._keep:
                    free.append(buf)
                    buf = None
            if buf is not None:
                buf.close()

    def close(self) -> None:
        with self._lock:
            pools, self._free = self._free, {}
        for free in pools.values():
            for buf in free:
                buf.close()

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._free = {}


class _Batch:
    """One submitted batch: its future, the buffered descriptors it opened and the requests left."""

    def __init__(self, engine: PythonEngine, future: _PythonFuture, count: int) -> None:
        self.engine = engine
        self.future = future
        self.left = count
        self.lock = threading.Lock()
        self.buffered: dict[int, int] = {}

    def buffered_fd(self, fd: int) -> int:
        """A buffered (non-O_DIRECT) descriptor of the file behind ``fd``, opened once per batch."""
        with self.lock:
            other = self.buffered.get(fd)
            if other is None:
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                keep = os.O_ACCMODE | getattr(os, "O_SYNC", 0) | getattr(os, "O_DSYNC", 0)
                other = os.open(f"/proc/self/fd/{fd}", (flags & keep) | os.O_CLOEXEC)
                self.buffered[fd] = other
            return other

    def finish(self, index: int, result: int, cause: BaseException | None) -> None:
        fut = self.future
        fut._results[index] = result
        if cause is not None:
            fut._causes[index] = cause
        with self.lock:
            self.left -= 1
            last = self.left == 0
            opened, self.buffered = (self.buffered, {}) if last else ({}, self.buffered)
        if last:
            for other in opened.values():
                with contextlib.suppress(OSError):
                    os.close(other)
            fut._event.set()


def _read_full(fd: int, view: memoryview, offset: int, offset_align: int = 0) -> int:
    """Read into all of ``view``, looping on short reads; stop early at EOF. On an O_DIRECT descriptor
    (``offset_align``: its alignment) a short count that is not a multiple of it means EOF too."""
    done = 0
    total = view.nbytes
    while done < total:
        with view[done:] as rest:
            got = os.preadv(fd, [rest], offset + done)
        if got == 0:
            break
        done += got
        if offset_align and got % offset_align:
            break
    return done


def _write_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    total = view.nbytes
    while done < total:
        with view[done:] as rest:
            put = os.pwritev(fd, [rest], offset + done)
        if put <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += put
    return done


class PythonEngine(IOEngine):
    """Pure-Python engine: a pool of ``threads`` workers, at most ``queue_depth`` requests in flight.

    Parameters
    ----------
    queue_depth : int, optional
        Requests in flight at most; default: the ``queue_depth`` setting.
    threads : int, optional
        Worker threads; default: the ``io_threads`` setting. ``min(threads, queue_depth)`` are used.
    """

    def __init__(self, queue_depth: int | None = None, threads: int | None = None) -> None:
        qd = defaults.SETTINGS["queue_depth"].parse(
            queue_depth if queue_depth is not None else defaults.get("queue_depth"), "PythonEngine(queue_depth=...)"
        )
        th = defaults.SETTINGS["io_threads"].parse(
            threads if threads is not None else defaults.get("io_threads"), "PythonEngine(threads=...)"
        )
        super().__init__("python", int(qd), True)
        self.threads = int(th)
        self._workers = min(self.threads, self.queue_depth)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._bounce = _BouncePool(self._workers)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._bounce.close()

    def _after_fork_in_child(self) -> None:
        # The parent's worker threads do not exist here; the child starts its own on first use.
        self._lock = threading.Lock()
        self._executor = None
        self._bounce.reset_after_fork()

    # -- submission ------------------------------------------------------------------------------------------

    def submit(self, requests: Sequence[Request], *, checksums: Sequence[int | None] | None = None) -> IOFuture:
        self._check_open()
        batch_requests = list(self._as_batch(requests))
        self._check_checksums(batch_requests, checksums)
        bounce = bool(defaults.get("bounce"))
        bounce_size = int(defaults.get("bounce_buffer_size"))
        checked = validate_batch(batch_requests, bounce=bounce)
        future = _PythonFuture(batch_requests)
        batch = _Batch(self, future, len(checked))
        if not checked:
            self._counters.add(batches=1)
            future._event.set()
            return future
        work: list[tuple[CheckedRequest, list[Segment] | None]] = []
        for item in checked:
            plan: list[Segment] | None = None
            if item.direct and not item.aligned:
                size = max(_round_up(bounce_size, item.offset_align), item.offset_align)
                plan = plan_direct(
                    item.op, item.offset, item.length, item.address, item.mem_align, item.offset_align, size
                )
            elif item.direct:
                plan = [Segment("direct", item.offset, item.length, 0)]
            work.append((item, plan))
        started = 0
        try:
            with self._lock:
                self._check_open()
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="sfstore-python-io")
                executor = self._executor
                self._counters.add(batches=1, requests=len(checked))
                for item, plan in work:
                    if item.length == 0:
                        item.release()
                        want = None if checksums is None else checksums[item.index]
                        empty_ok = want is None or read_checksum_ok(b"", 0, 0, want)
                        batch.finish(item.index, 0 if empty_ok else -errno.EBADMSG, None)
                    else:
                        self._queue(executor, batch, item, plan, None if checksums is None else checksums[item.index])
                    started += 1
        except errors.OutOfResourcesError:
            # No worker could start: nothing of the batch ran or will run (its queue was dropped).
            for item, _ in work:
                item.release()
            raise
        except BaseException:
            for item, _ in work[started:]:
                item.release()
                batch.finish(item.index, -errno.ECANCELED, None)
            raise
        return future

    def _queue(self, executor: ThreadPoolExecutor, batch: _Batch, item: CheckedRequest, plan: list[Segment] | None,
               checksum: int | None) -> None:
        """Hand one request to the workers; a worker thread that cannot start is a typed error, not a bare
        ``RuntimeError``. Called with ``self._lock`` held."""
        try:
            executor.submit(self._run_one, batch, item, plan, checksum)
        except RuntimeError as exc:
            if executor._shutdown or _futures_thread._shutdown:
                item.release()
                raise errors.EngineUnavailableError(
                    f"the python engine's workers are shut down (the interpreter is exiting): {exc}"
                ) from None
            # A worker thread failed to start; the item was queued before that: with a worker alive it runs in
            # its turn. With none, nothing would ever run it: drop the executor and its queue.
            if getattr(executor, "_threads", None):
                return
            self._executor = None
            executor.shutdown(wait=False, cancel_futures=True)
            item.release()
            raise errors.OutOfResourcesError(
                errno.EAGAIN, f"the python engine cannot start a worker thread ({exc}; thread or memory limits: "
                "ulimit -u / -v)"
            ) from None

    # -- execution (worker threads) ------------------------------------------------------------------------

    def _run_one(self, batch: _Batch, item: CheckedRequest, plan: list[Segment] | None, checksum: int | None) -> None:
        result = 0
        direct = bounced = 0
        cause: BaseException | None = None
        try:
            if plan is None:
                if item.op == "read":
                    result = _read_full(item.fd, item.view, item.offset)
                else:
                    result = _write_full(item.fd, item.view, item.offset)
            else:
                result, direct, bounced = self._run_direct(batch, item, plan)
            if checksum is not None:
                self._counters.add(bytes_verified=result)
                if not read_checksum_ok(item.view, result, item.length, checksum):
                    self._counters.add(verify_failed=1)
                    result = -errno.EBADMSG
        except OSError as exc:
            result = -(exc.errno or errno.EIO)
            cause = exc
        except Exception as exc:  # a bug must not leave the batch hanging; get() chains it
            result = -errno.EIO
            cause = exc
        finally:
            item.release()
        if result < 0:
            self._counters.add(errors=1)
        elif item.op == "read":
            self._counters.add(bytes_read=result, bytes_direct=direct, bytes_bounced=bounced)
        else:
            self._counters.add(bytes_written=result, bytes_direct=direct, bytes_bounced=bounced)
        if direct or bounced:
            with batch.lock:
                batch.future._moved[0] += direct
                batch.future._moved[1] += bounced
        batch.finish(item.index, result, cause)

    def _run_direct(self, batch: _Batch, item: CheckedRequest, plan: list[Segment]) -> tuple[int, int, int]:
        """Run the segments of a request on an O_DIRECT descriptor in order; return (bytes, direct, bounced)."""
        total = direct = bounced = 0
        align = item.offset_align
        for seg in plan:
            with item.view[seg.buffer_pos:seg.buffer_pos + seg.length] as part:
                if seg.kind == "direct":
                    if item.op == "read":
                        moved = _read_full(item.fd, part, seg.offset, align)
                    else:
                        moved = self._write_direct(batch, item.fd, part, seg.offset, align)
                    direct += moved
                elif seg.kind == "bounce":
                    if item.op == "read":
                        moved = self._read_bounce(item.fd, part, seg.offset, align)
                    else:
                        moved = self._write_bounce(item.fd, part, seg.offset, align)
                    bounced += moved
                else:
                    moved = _write_full(batch.buffered_fd(item.fd), part, seg.offset)
                    bounced += moved
            total += moved
            if moved < seg.length:  # EOF (reads only: writes raise instead)
                break
        return total, direct, bounced

    def _bounce_size(self, align: int) -> int:
        size = int(defaults.get("bounce_buffer_size"))
        return max(_round_up(size, align), align)

    def _read_bounce(self, fd: int, part: memoryview, offset: int, align: int) -> int:
        """Read the aligned blocks around ``[offset, offset + len(part))`` into a bounce buffer; copy out."""
        start = offset - offset % align
        stop = _round_up(offset + part.nbytes, align)
        with self._bounce.buffer(max(self._bounce_size(align), stop - start)) as bounce:
            with bounce[:stop - start] as window:
                got = _read_full(fd, window, start, align)
            skip = offset - start
            avail = max(0, min(part.nbytes, got - skip))
            part[:avail] = bounce[skip:skip + avail]
        return avail

    def _write_bounce(self, fd: int, part: memoryview, offset: int, align: int) -> int:
        """Write an aligned file range whose memory is misaligned: copy into bounce buffers, write direct."""
        size = self._bounce_size(align)
        done = 0
        with self._bounce.buffer(size) as bounce:
            while done < part.nbytes:
                step = min(size, part.nbytes - done)
                bounce[:step] = part[done:done + step]
                with bounce[:step] as window:
                    put = _write_full(fd, window, offset + done)
                done += put
        return done

    def _write_direct(self, batch: _Batch, fd: int, part: memoryview, offset: int, align: int) -> int:
        done = 0
        total = part.nbytes
        while done < total:
            with part[done:] as rest:
                if done % align:  # a short direct write left a misaligned remainder: finish it buffered
                    return done + _write_full(batch.buffered_fd(fd), rest, offset + done)
                put = os.pwritev(fd, [rest], offset + done)
            if put <= 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            done += put
        return done


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align
