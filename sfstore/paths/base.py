"""The interface every direct path implements: one data seam (:meth:`StoragePath.submit`), counters, capabilities.

A path says what it is through capability properties rather than its class: ``transport`` (``"rdma"``,
``"tcp"`` or ``"local"``), ``supports_direct_io`` (aligned host buffers move with O_DIRECT, no page-cache copy)
and ``supports_device_buffers`` (:meth:`StoragePath.submit` takes GPU buffers); ``fallbacks`` lists each place
where it took a less direct way than the hardware it targets would allow, with the reason. Nothing falls back
silently: :meth:`StoragePath.describe` and the counters report it.

Faces (the fsspec filesystem, checkpoints, the block store, the KV cache) move bytes only through
:meth:`StoragePath.submit`: a batch of :class:`Range` reads or writes, split by the path into requests of its
chunk size, counted by the path (per data class too), answered by one :class:`PathFuture`.
"""

from __future__ import annotations

import errno
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from sfstore import errors
from sfstore.arguments import as_batch, check_timeout
from sfstore.counters import Counters
from sfstore.engine import IOEngine, get_engine
from sfstore.futures import Future, deadline_after, remaining

__all__ = ["PathCounters", "StoragePath", "COUNTER_KEYS", "Range", "PathFuture", "Leg", "split_ranges"]

COUNTER_KEYS = (
    "requests",
    "files",
    "bytes_read",
    "bytes_written",
    "bytes_direct",
    "bytes_bounced",
    "bytes_gpu_direct",
    "bytes_staged",
    "errors",
)


_P = TypeVar("_P", bound="StoragePath")


class PathCounters(Counters):
    """Counters of one path: requests, files, bytes read/written, direct vs bounced, GPU direct vs staged, errors.

    ``bytes_direct`` moved straight between storage and the caller's (or a registered) host buffer with O_DIRECT;
    ``bytes_bounced`` moved through a bounce buffer or the page cache of an O_DIRECT-capable file; bytes on a
    filesystem without O_DIRECT count as neither. On the device path, ``bytes_gpu_direct`` moved between GPU
    memory and storage with no host copy (cuFile), ``bytes_staged`` through host memory (kvikio's compat mode or
    sfstore's pinned staging). :meth:`for_class` holds the same counters per data class (``dataset``,
    ``checkpoint``, ``hot``, ``kvcache``, or what a caller names), for paths that several classes share.
    """

    def __init__(self) -> None:
        super().__init__(COUNTER_KEYS)
        self._classes: dict[str, Counters] = {}
        self._classes_lock = threading.Lock()

    def for_class(self, data_class: str) -> Counters:
        """The counters of one data class on this path (made on first use)."""
        with self._classes_lock:
            c = self._classes.get(data_class)
            if c is None:
                c = self._classes[data_class] = Counters(COUNTER_KEYS)
            return c

    def add_for(self, data_class: str | None, **deltas: int) -> None:
        """Add ``deltas`` to the totals and, when ``data_class`` is given, to that class's counters."""
        self.add(**deltas)
        if data_class:
            self.for_class(data_class).add(**deltas)

    def by_class(self) -> dict[str, dict[str, int]]:
        """A snapshot of every data class's counters."""
        with self._classes_lock:
            items = list(self._classes.items())
        return {name: c.snapshot() for name, c in items}

    def reset(self) -> None:
        super().reset()
        with self._classes_lock:
            self._classes = {}


class HasFd(Protocol):
    """An open file a :class:`Range` may name by its descriptor (:class:`~sfstore.paths.file.OpenFile`)."""

    @property
    def fd(self) -> int: ...


class Range(NamedTuple):
    """One read or write of a :meth:`StoragePath.submit` batch.

    Parameters
    ----------
    op : str
        ``"read"`` (storage to ``buffer``) or ``"write"`` (``buffer`` to storage).
    offset : int
        Byte offset in the target.
    length : int
        Bytes to move (``0`` does nothing).
    buffer : object
        Host memory (buffer protocol, CPU tensor, DLPack) on every path; GPU memory (CUDA torch tensor, cupy,
        ``__cuda_array_interface__``) on paths whose ``supports_device_buffers`` is true.
    buffer_offset : int, optional
        Byte offset in ``buffer`` where the data starts.
    file : int or object with ``fd``, optional
        The open file the range is in, on paths of many files (:class:`~sfstore.paths.file.FilePath`,
        :class:`~sfstore.paths.device.DevicePath`); ``None`` on a path of one target (a
        :class:`~sfstore.paths.block.BlockPath` uses its device).
    """

    op: str
    offset: int
    length: int
    buffer: Any
    buffer_offset: int = 0
    file: int | HasFd | None = None

    @classmethod
    def read(cls, offset: int, length: int, buffer: Any, buffer_offset: int = 0,
             file: int | HasFd | None = None) -> Range:
        """A read of ``length`` bytes at ``offset`` into ``buffer[buffer_offset:]``."""
        return cls("read", offset, length, buffer, buffer_offset, file)

    @classmethod
    def write(cls, offset: int, length: int, buffer: Any, buffer_offset: int = 0,
              file: int | HasFd | None = None) -> Range:
        """A write of ``buffer[buffer_offset:buffer_offset + length]`` at ``offset``."""
        return cls("write", offset, length, buffer, buffer_offset, file)


def descriptor_of(file: object, index: int) -> int:
    """The descriptor a :class:`Range`'s ``file`` names (an int, or an object with an ``fd``)."""
    fd = getattr(file, "fd", file)
    if isinstance(fd, bool) or not isinstance(fd, int):
        raise errors.InvalidRequestError(
            f"range {index}: file must be an open descriptor (int) or an open file, not {type(file).__name__}"
        )
    if fd < 0:
        raise errors.os_error(errno.EBADF, f"range {index}: the file is closed", None, errors.BadFileDescriptorError)
    return fd


def check_range(r: Any, index: int) -> Range:
    """``r`` as a :class:`Range` with a valid op and non-negative integer offset, length and buffer offset."""
    if type(r) is not Range:
        try:
            r = Range(*r)
        except TypeError:
            raise errors.InvalidRequestError(f"range {index}: expected a Range, not {type(r).__name__}") from None
    op, offset, length, _buffer, boff = r[:5]
    # The common case in one test (plain ints, not negative); anything else is looked at closely.
    if type(offset) is int and type(length) is int and type(boff) is int and offset >= 0 and length >= 0 \
            and boff >= 0 and (op == "read" or op == "write"):
        return r  # type: ignore[no-any-return]
    if op not in ("read", "write"):
        raise errors.InvalidRequestError(f"range {index}: op must be 'read' or 'write', not {op!r}")
    for what in ("offset", "length", "buffer_offset"):
        value = getattr(r, what)
        if isinstance(value, bool) or not isinstance(value, int):
            raise errors.InvalidRequestError(f"range {index}: {what} must be an int, not {value!r}")
        if value < 0:
            raise errors.InvalidRequestError(f"range {index} ({op}): {what} is negative ({value})")
    return r  # type: ignore[no-any-return]


def check_batch(
    ranges: Sequence[Any], checksums: Sequence[int | None] | None
) -> tuple[list[Range], list[int | None] | None]:
    """``ranges`` checked one by one (:func:`check_range`) and ``checksums`` as a list of as many, or
    :class:`~sfstore.errors.InvalidRequestError`: what every path's ``submit`` checks before it issues anything."""
    batch = [check_range(r, i) for i, r in enumerate(as_batch(ranges, "ranges"))]
    sums = list(as_batch(checksums, "checksums")) if checksums is not None else None
    if sums is not None and len(sums) != len(batch):
        raise errors.InvalidRequestError(f"checksums: {len(sums)} given for {len(batch)} ranges")
    return batch, sums


def split_ranges(
    ranges: Sequence[Range], chunk: int, checksums: Sequence[int | None] | None = None
) -> tuple[list[Range], list[int], list[int | None] | None]:
    """Split each range into pieces of at most ``chunk`` bytes: ``(pieces, owner, piece checksums)``.

    ``owner[j]`` is the index of the range piece ``j`` came from. A range that carries a checksum is not split
    (the checksum covers all of it); ``chunk <= 0`` splits nothing.
    """
    if chunk <= 0 or all(r.length <= chunk for r in ranges):  # nothing to split: the batch as it is
        return list(ranges), list(range(len(ranges))), (list(checksums) if checksums is not None else None)
    pieces: list[Range] = []
    owner: list[int] = []
    sums: list[int | None] | None = [] if checksums is not None else None
    for i, r in enumerate(ranges):
        want = checksums[i] if checksums is not None else None
        if r.length <= chunk or chunk <= 0 or want is not None:
            pieces.append(r)
            owner.append(i)
            if sums is not None:
                sums.append(want)
            continue
        for pos in range(0, r.length, chunk):
            pieces.append(r._replace(offset=r.offset + pos, length=min(chunk, r.length - pos),
                                     buffer_offset=r.buffer_offset + pos))
            owner.append(i)
            if sums is not None:
                sums.append(None)
    return pieces, owner, sums


_HOST_TYPES = (memoryview, bytearray, bytes)


class Leg(Protocol):
    """What a :class:`PathFuture` waits on: one batch of requests underneath (an engine batch, a kvikio
    transfer, a staged copy), answering per request bytes moved or ``-errno``."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def results(self, timeout: float | None = None) -> list[int]: ...

    def error_for(self, index: int, err: int) -> errors.SfstoreOSError: ...

    def transferred(self) -> tuple[int, int]: ...


class PathFuture(Future[list[int]]):
    """The pending result of :meth:`StoragePath.submit`: per range, the bytes moved.

    :meth:`get` returns them (a read is short only at the end of a file) or raises the typed error of the first
    range that failed (:class:`~sfstore.errors.ChecksumMismatchError` for a read whose checksum did not match);
    :meth:`results` gives per range bytes or ``-errno`` without raising. The path's counters (and its data
    class's) are updated once, when the batch is first seen finished.

    Parameters
    ----------
    path : StoragePath
        The path whose counters count the batch.
    legs : sequence of (Leg, list of int, str)
        The batches underneath: each with the range index of each of its requests, and how its bytes count
        (``"host"``: direct/bounced as the leg reports; ``"gpu_direct"`` or ``"staged"``: the device path's).
    ops : list of str
        Each range's op.
    data_class : str, optional
        The data class to count under too.
    release : callable, optional
        Run once when the batch has finished (descriptors or buffers the batch held).
    """

    def __init__(
        self,
        path: StoragePath,
        legs: Sequence[tuple[Leg, list[int], str]],
        ops: list[str],
        *,
        data_class: str | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._path = path
        self._legs = list(legs)
        self._ops = ops
        self._class = data_class
        self._release = release
        self._lock = threading.Lock()
        self._final: list[int] | None = None
        self._errors: dict[int, tuple[Leg, int, int]] = {}  # range -> (leg, request, errno) of its first failure
        self._moved = (0, 0)

    def __len__(self) -> int:
        return len(self._ops)

    def done(self) -> bool:
        if self._final is not None:
            return True
        if all(leg.done() for leg, _, _ in self._legs):
            self._settle()
            return True
        return False

    def wait(self, timeout: float | None = None) -> bool:
        if self._final is not None:
            return True
        timeout = check_timeout(timeout, "wait")
        deadline = deadline_after(timeout)
        for leg, _, _ in self._legs:
            if not leg.wait(remaining(deadline)):
                return False
        self._settle()
        return True

    def results(self, timeout: float | None = None) -> list[int]:
        """Per range: bytes moved (``>= 0``) or ``-errno``; raises only :class:`~sfstore.errors.IOTimeoutError`."""
        if not self.wait(timeout):
            raise self._timed_out(timeout, f"a batch of {len(self._ops)} ranges on the {self._path.kind} path")
        assert self._final is not None
        return list(self._final)

    def get(self, timeout: float | None = None) -> list[int]:
        results = self.results(timeout)
        for i, value in enumerate(results):
            if value < 0:
                leg, request, err = self._errors[i]
                raise leg.error_for(request, err)
        return results

    def error_for(self, index: int, err: int) -> errors.SfstoreOSError:
        """The typed error of range ``index`` having failed with errno ``err``."""
        found = self._errors.get(index)
        if found is not None:
            leg, request, _ = found
            return leg.error_for(request, err)
        return errors.os_error(err, f"range {index} of {len(self._ops)} on the {self._path.kind} path failed")

    def transferred(self) -> tuple[int, int]:
        """``(direct, bounced)`` host bytes of this batch (final once done), as the engine counts them."""
        return self._moved

    def _settle(self) -> None:
        with self._lock:
            if self._final is not None:
                return
            n = len(self._ops)
            out = [0] * n
            direct = bounced = gpu = staged = 0
            failed = 0
            try:
                for leg, owner, kind in self._legs:
                    got = leg.results(0)
                    if len(self._legs) == 1 and len(got) == n and (not got or min(got) >= 0) \
                            and owner == list(range(n)):
                        out = list(got)  # one leg, nothing split, nothing failed: the results as they are
                    else:
                        failed += self._collect(leg, owner, got, out)
                    moved = sum(v for v in got if v > 0)
                    if kind == "gpu_direct":
                        gpu += moved
                        continue
                    if kind == "staged":  # through host memory: what the engine did there counts as well
                        staged += moved
                    d, b = leg.transferred()
                    direct, bounced = direct + d, bounced + b
            finally:
                ops = self._ops
                read = written = 0
                for v, op in zip(out, ops, strict=True):
                    if v > 0:
                        if op == "read":
                            read += v
                        else:
                            written += v
                self._moved = (direct, bounced)
                self._path.counters.add_for(
                    self._class, requests=sum(len(o) for _, o, _ in self._legs), bytes_read=read,
                    bytes_written=written, bytes_direct=direct, bytes_bounced=bounced, bytes_gpu_direct=gpu,
                    bytes_staged=staged, errors=failed,
                )
                self._final = out
                release, self._release = self._release, None
                if release is not None:
                    release()

    def _collect(self, leg: Leg, owner: list[int], got: list[int], out: list[int]) -> int:
        """Add a leg's per-request results into ``out`` per range (a range's first failure wins); return how
        many ranges failed for a reason other than a checksum mismatch (that one is the data's fault)."""
        failed = 0
        for j, (i, value) in enumerate(zip(owner, got, strict=True)):
            if value < 0:
                if out[i] >= 0:
                    out[i] = value
                    self._errors[i] = (leg, j, -value)
                    failed += value != -errno.EBADMSG
            elif out[i] >= 0:
                out[i] += value
        return failed

    def __del__(self) -> None:
        release = getattr(self, "_release", None)
        if release is not None and self._final is None:
            try:
                if all(leg.done() for leg, _, _ in self._legs):
                    self._settle()
            except Exception:  # a collector must not raise; the batch was never looked at
                return


class StoragePath(ABC):
    """A direct path to storage.

    Subclasses set :attr:`kind` and implement :attr:`transport`, :meth:`describe` and :meth:`_start`.
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
        """Whether :meth:`submit` moves aligned host buffers with O_DIRECT (no page-cache copy)."""
        return False

    _engine: IOEngine | None = None

    def _queue_depth(self) -> int | None:
        """The queue depth this path asks :func:`~sfstore.engine.get_engine` for (``None``: the setting's)."""
        return None

    @property
    def engine(self) -> IOEngine:
        """The I/O engine, shared per process and arguments: made on first use and again once closed, so a forked
        child makes its own (:func:`~sfstore.engine.get_engine` is safe to call from several threads at once)."""
        eng = self._engine
        if eng is None or eng.closed:
            eng = self._engine = get_engine(queue_depth=self._queue_depth())
        return eng

    @property
    def supports_device_buffers(self) -> bool:
        """Whether :meth:`submit` takes GPU buffers (the device path's ``route`` says whether with no host copy)."""
        return False

    def submit(
        self,
        ranges: Sequence[Range],
        *,
        checksums: Sequence[int | None] | None = None,
        data_class: str | None = None,
    ) -> PathFuture:
        """Check the whole batch, then start it (:meth:`_start`): the path splits each range into requests of its
        chunk size, keeps its requests in flight, and counts the batch (under ``data_class`` too) when it has
        finished.

        ``checksums``, optional, holds per range the xxh3-64 a read's bytes must have (or ``None``); a range
        that fails it ends with ``-EBADMSG`` and :meth:`PathFuture.get` raises
        :class:`~sfstore.errors.ChecksumMismatchError`.

        Raises
        ------
        sfstore.errors.InvalidRequestError
            A malformed range, or a GPU buffer on a path whose ``supports_device_buffers`` is false (nothing
            was issued).
        sfstore.errors.SfstoreOSError
            What the engine refuses before any I/O (a closed descriptor, a read-only buffer for a read, a
            misaligned range where bounce buffers are off).
        """
        batch, sums = check_batch(ranges, checksums)
        return self._start(batch, sums, data_class)

    @abstractmethod
    def _start(self, batch: list[Range], checksums: list[int | None] | None, data_class: str | None) -> PathFuture:
        """Start a batch :meth:`submit` has checked: valid ranges, and as many checksums as ranges (or ``None``)."""

    # What a face tells its path about a file it moved through it: the path keeps the counters (their names and
    # classes are its own), so faces count nothing themselves.
    def file_done(self, count: int = 1, data_class: str | None = None) -> None:
        """``count`` files a face read or wrote whole (and checked) through this path: its ``files`` counter."""
        self.counters.add_for(data_class, files=count)

    def file_failed(self, count: int = 1, data_class: str | None = None) -> None:
        """``count`` files a face could not read or write through this path: its ``errors`` counter."""
        self.counters.add_for(data_class, errors=count)

    def refuse_device_buffers(self, ranges: Sequence[Range]) -> None:
        """Raise :class:`~sfstore.errors.InvalidRequestError` for the first range with a GPU buffer (for paths
        whose ``supports_device_buffers`` is false)."""
        from sfstore.buffers import is_device_buffer

        for i, r in enumerate(ranges):
            if type(r.buffer) in _HOST_TYPES:  # the usual buffers, never GPU memory: no closer look
                continue
            if is_device_buffer(r.buffer):
                raise errors.InvalidRequestError(
                    f"range {i}: a GPU buffer ({type(r.buffer).__name__}) on the {self.kind} path, which takes host "
                    "memory only (supports_device_buffers is False); move GPU buffers through the device path"
                )

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What this path is: kind, target, transport, capabilities, fallbacks with reasons, counters."""

    def flush(self) -> None:  # noqa: B027 - a no-op is the right default for paths that buffer nothing
        """Make everything written so far durable."""

    def close(self) -> None:  # noqa: B027 - a no-op is the right default for paths that hold nothing
        """Release what the path holds (descriptors, connections)."""

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
