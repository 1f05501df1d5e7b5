"""Foundations every I/O engine shares: requests, futures, the engine interface, batch checks and O_DIRECT planning.

Nothing here issues I/O. :func:`validate_batch` turns a batch of :class:`Request` into :class:`CheckedRequest`
objects (typed errors for the first bad request, before any I/O), and :func:`plan_direct` splits a request on an
``O_DIRECT`` descriptor into direct, bounce and buffered segments. The pure-Python engine uses both; a native
engine may use them too or do the same in C++.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib
import math
import os
import stat
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

from sfstore import defaults, errors, forks
from sfstore.buffers import as_buffer
from sfstore.checksums import xxh3_64
from sfstore.counters import Counters
from sfstore.futures import Future

__all__ = [
    "Request",
    "IOFuture",
    "IOEngine",
    "EngineStats",
    "STATS_KEYS",
    "CheckedRequest",
    "Segment",
    "validate_batch",
    "plan_direct",
    "byte_view",
    "buffer_address",
    "fd_path",
    "read_checksum_ok",
    "direct_io_alignment",
    "wait_seconds",
]

STATS_KEYS: tuple[str, ...] = (
    "batches",
    "requests",
    "bytes_read",
    "bytes_written",
    "bytes_direct",
    "bytes_bounced",
    "errors",
    "bytes_verified",
    "verify_failed",
)
"""Keys of :meth:`IOEngine.stats`, in their documented order."""

_OPS = ("read", "write")


class Request(NamedTuple):
    """One I/O request: move ``length`` bytes between file offset ``offset`` of ``fd`` and ``buffer``.

    Parameters
    ----------
    op : str
        ``"read"`` (file to buffer) or ``"write"`` (buffer to file).
    fd : int
        An open file descriptor; ``O_DIRECT`` is a property of the descriptor.
    offset : int
        File offset in bytes.
    length : int
        Number of bytes; ``0`` is allowed and does nothing.
    buffer : object
        A buffer-protocol object (``bytearray``, ``memoryview``, numpy array, ``mmap``, registered buffer), a CPU
        torch tensor or another CPU DLPack producer; ``length`` counts bytes whatever the element type.
    buffer_offset : int, optional
        Byte offset in ``buffer`` where the data starts (default 0).
    """

    op: str
    fd: int
    offset: int
    length: int
    buffer: Any
    buffer_offset: int = 0

    @classmethod
    def read(cls, fd: int, offset: int, length: int, buffer: Any, buffer_offset: int = 0) -> Request:
        """A request that reads ``length`` bytes at ``offset`` of ``fd`` into ``buffer[buffer_offset:]``."""
        return cls("read", fd, offset, length, buffer, buffer_offset)

    @classmethod
    def write(cls, fd: int, offset: int, length: int, buffer: Any, buffer_offset: int = 0) -> Request:
        """A request that writes ``buffer[buffer_offset:buffer_offset + length]`` at ``offset`` of ``fd``."""
        return cls("write", fd, offset, length, buffer, buffer_offset)


def fd_path(fd: int) -> str | None:
    """The path ``fd`` refers to (``readlink /proc/self/fd/N``), or ``None`` when it cannot be read."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except (OSError, ValueError, OverflowError):
        return None


class EngineStats(Counters):
    """Thread-safe counters behind :meth:`IOEngine.stats` (keys: :data:`STATS_KEYS`)."""

    def __init__(self) -> None:
        super().__init__(STATS_KEYS)


# ---------------------------------------------------------------------------------------------------------------
# Futures


def wait_seconds(timeout: Any, what: str = "timeout") -> float | None:
    """A future's wait, in seconds: ``None`` or ``inf`` wait without end (``None``), ``0`` only looks. The rule of
    every wait in sfstore (:func:`sfstore.arguments.check_timeout` says it for the others).

    Raises
    ------
    sfstore.errors.InvalidRequestError
        ``timeout`` is negative, NaN, a bool, or not a real number (named ``what`` in the message).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        try:
            value = float(timeout.__float__()) if not isinstance(timeout, bool) else None
        except (AttributeError, TypeError, ValueError, OverflowError):
            value = None
        if value is None:
            raise errors.InvalidRequestError(
                f"{what} must be a number of seconds or None, not {type(timeout).__name__}"
            ) from None
    else:
        try:
            value = float(timeout)
        except OverflowError:  # an int beyond any float: as good as forever, or far below zero
            value = math.inf if timeout > 0 else -math.inf
    if math.isnan(value) or value < 0:
        raise errors.InvalidRequestError(f"{what} must be seconds >= 0 or None, not {timeout!r}")
    return None if math.isinf(value) else value


class IOFuture(Future[list[int]]):
    """The pending result of one submitted batch (an :class:`sfstore.futures.Future`).

    Subclasses implement :meth:`done`, :meth:`wait` and :meth:`results`; :meth:`get` turns the first failed
    request into its typed error.

    Parameters
    ----------
    requests : sequence of Request
        The batch, in submission order; only ``op``, ``fd``, ``offset`` and ``length`` are kept (for messages).
    """

    def __init__(self, requests: Sequence[Request]) -> None:
        self._described: list[tuple[str, int, int, int]] = [
            (str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in requests
        ]

    def __len__(self) -> int:
        return len(self._described)

    @abstractmethod
    def done(self) -> bool:
        """Whether every request of the batch has finished (successfully or not)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the batch has finished or ``timeout`` seconds passed; return whether it finished.

        ``None`` (or ``inf``) waits without end, a negative ``timeout`` only looks; NaN raises
        :class:`~sfstore.errors.InvalidRequestError` (see :func:`wait_seconds`)."""

    @abstractmethod
    def results(self, timeout: float | None = None) -> list[int]:
        """Per request: bytes done (``>= 0``) or ``-errno`` (``< 0``).

        Never raises for I/O errors. Raises :class:`~sfstore.errors.IOTimeoutError` when the batch has not
        finished within ``timeout`` seconds (the I/O goes on).
        """

    def transferred(self) -> tuple[int, int]:
        """Bytes this batch moved ``(direct, bounced)`` on O_DIRECT descriptors so far (final once done).

        ``direct`` went straight between storage and the caller's memory; ``bounced`` went through bounce
        buffers or a buffered descriptor. Bytes on buffered descriptors count as neither.
        """
        return (0, 0)

    def get(self, timeout: float | None = None) -> list[int]:
        """Bytes done per request; raise the typed error of the first failed request.

        Raises
        ------
        sfstore.errors.IOTimeoutError
            The batch did not finish within ``timeout`` seconds (the I/O goes on).
        sfstore.errors.SfstoreOSError
            :class:`~sfstore.errors.NoSpaceError` for ENOSPC/EDQUOT,
            :class:`~sfstore.errors.BadFileDescriptorError` for EBADF, else
            :class:`~sfstore.errors.IOEngineError`; the message names the request.
        """
        if not self.wait(timeout):
            raise self.timeout_error(timeout)
        results = self.results()
        for index, value in enumerate(results):
            if value < 0:
                raise self.error_for(index, -value)
        return results

    def timeout_error(self, timeout: float | None) -> errors.IOTimeoutError:
        """The error :meth:`get` and :meth:`results` raise when ``timeout`` expired."""
        return errors.IOTimeoutError(
            f"a batch of {len(self._described)} I/O requests had not finished after {timeout} s "
            "(the I/O goes on; wait again or keep the buffers alive until it finishes)"
        )

    def error_for(self, index: int, err: int) -> errors.SfstoreOSError:
        """The typed error for request ``index`` having failed with errno ``err``."""
        op, fd, offset, length = self._described[index]
        context = (
            f"request {index} of {len(self._described)} ({op} fd={fd} offset={offset} length={length}) failed"
        )
        return errors.os_error(err, context, fd_path(fd), errors.IOEngineError)


def read_checksum_ok(data: Any, nbytes: int, length: int, checksum: int) -> bool:
    """Whether a read of ``length`` bytes that moved ``nbytes`` of them to the start of ``data`` has ``checksum``
    (xxh3-64): a short read never passes. What ``submit(..., checksums=...)`` checks where Python checks it."""
    return nbytes == length and xxh3_64(data[:nbytes]) == checksum


# ---------------------------------------------------------------------------------------------------------------
# Engines


class IOEngine(ABC):
    """An I/O engine: runs batches of :class:`Request` with at most ``queue_depth`` requests in flight.

    Subclasses implement :meth:`submit` and may override :meth:`_shutdown` (called once by :meth:`close`) and
    :meth:`_after_fork_in_child`. The base class keeps the counters of :meth:`stats` in ``self._counters``.

    Parameters
    ----------
    name : str
        ``"uring"``, ``"threads"`` or ``"python"``.
    queue_depth : int
        Requests in flight at most (at least 1).
    supports_direct_io : bool
        Whether requests on ``O_DIRECT`` descriptors are handled (aligned ones directly, others per the
        ``bounce`` setting).
    """

    name: str
    queue_depth: int
    supports_direct_io: bool

    def __init__(self, name: str, queue_depth: int, supports_direct_io: bool) -> None:
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
            raise errors.ConfigError(f"queue_depth must be an integer of at least 1, not {queue_depth!r}")
        self.name = name
        self.queue_depth = queue_depth
        self.supports_direct_io = supports_direct_io
        self._closed = False
        self._counters = EngineStats()
        forks.after_fork(self._after_fork_in_child)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @abstractmethod
    def submit(self, requests: Sequence[Request], *, checksums: Sequence[int | None] | None = None) -> IOFuture:
        """Check the whole batch, then start it; return its future.

        ``checksums``, optional, holds per request the xxh3-64 (seed 0) its bytes must have, or ``None``; only
        reads may carry one. A read whose bytes differ (or that came back short) ends with ``-EBADMSG``
        (:meth:`IOFuture.get` raises :class:`~sfstore.errors.ChecksumMismatchError`); its buffer holds what
        was read. The check runs where the read completes (the native engine's service thread, the Python
        engine's workers), off the caller's thread, and is counted in ``bytes_verified``/``verify_failed``.

        Raises
        ------
        sfstore.errors.InvalidRequestError, sfstore.errors.BufferTooSmallError, sfstore.errors.AlignmentError
            A malformed request (nothing was issued).
        sfstore.errors.ReadOnlyBufferError
            A read into a read-only buffer (nothing was issued).
        sfstore.errors.BadFileDescriptorError
            A closed descriptor, or one not open for the operation (nothing was issued).
        sfstore.errors.EngineUnavailableError
            The engine is closed.
        """

    @staticmethod
    def _as_batch(requests: Any) -> list[Request] | tuple[Request, ...]:
        """``requests`` as a list (a list or tuple as it is); anything that is not an iterable of requests, a
        string among them, is an :class:`~sfstore.errors.InvalidRequestError`."""
        if isinstance(requests, (list, tuple)):
            return requests
        if isinstance(requests, (str, bytes, bytearray, memoryview, dict)):
            raise errors.InvalidRequestError(
                f"requests must be a sequence of Request tuples, not {type(requests).__name__}"
            )
        try:
            return list(requests)
        except TypeError:
            raise errors.InvalidRequestError(
                f"requests must be a sequence of Request tuples, not {type(requests).__name__}"
            ) from None

    @staticmethod
    def _check_checksums(requests: Sequence[Request], checksums: Sequence[int | None] | None) -> None:
        if checksums is None:
            return
        if isinstance(checksums, (str, bytes)) or not isinstance(checksums, Sequence):
            raise errors.InvalidRequestError(
                f"checksums must be a sequence of int or None, one per request, not {type(checksums).__name__}"
            )
        if len(checksums) != len(requests):
            raise errors.InvalidRequestError(f"checksums: {len(checksums)} given for {len(requests)} requests")
        for i, (r, c) in enumerate(zip(requests, checksums, strict=True)):
            if c is None:
                continue
            if isinstance(c, bool) or not isinstance(c, int):
                raise errors.InvalidRequestError(f"request {i}: a checksum must be an int or None, not {c!r}")
            # A malformed request is validate_batch's to name; here only a checksum on a write is refused.
            if isinstance(r, tuple) and r and r[0] != "read":
                raise errors.InvalidRequestError(f"request {i}: checksums are checked on reads only")

    def run(self, requests: Iterable[Request]) -> list[int]:
        """Submit ``requests`` and wait: ``submit(requests).get()``."""
        return self.submit(list(requests)).get()

    def pread(self, fd: int, buffer: Any, offset: int) -> int:
        """Read ``nbytes(buffer)`` bytes at ``offset`` of ``fd`` into ``buffer``; return the bytes read."""
        return self.run([Request.read(fd, offset, _nbytes(buffer), buffer)])[0]

    def pwrite(self, fd: int, buffer: Any, offset: int) -> int:
        """Write all of ``buffer`` at ``offset`` of ``fd``; return the bytes written."""
        return self.run([Request.write(fd, offset, _nbytes(buffer), buffer)])[0]

    def stats(self) -> dict[str, int]:
        """Counters since the engine was made: batches, requests, bytes_read, bytes_written, bytes_direct,
        bytes_bounced, errors (requests that finished with an error, checksum mismatches included),
        bytes_verified (bytes of reads checked against a checksum), verify_failed (mismatches)."""
        return self._counters.snapshot()

    def close(self) -> None:
        """Finish the requests in flight and release the engine's threads and buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:  # noqa: B027 - an optional hook
        """Release resources; called once by :meth:`close`."""

    def _check_open(self) -> None:
        if self._closed:
            raise errors.EngineUnavailableError(f"the {self.name} I/O engine is closed; get another with get_engine()")

    def _after_fork_in_child(self) -> None:  # noqa: B027 - an optional hook
        """Reset thread pools and locks in a forked child (the parent's threads do not exist there)."""

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.name} queue_depth={self.queue_depth} {state}>"


# ---------------------------------------------------------------------------------------------------------------
# Buffers


def byte_view(obj: Any) -> memoryview:
    """A 1-D unsigned-byte memoryview over the same memory as ``obj`` (no copy).

    Raises
    ------
    sfstore.errors.InvalidRequestError
        ``obj`` has no host buffer, or it is not C-contiguous.
    """
    try:
        target = as_buffer(obj)
        whole = memoryview(target)
    except (TypeError, ValueError) as exc:
        raise errors.InvalidRequestError(f"not a usable I/O buffer: {exc}") from None
    try:
        return whole.cast("B")
    except TypeError as exc:
        raise errors.InvalidRequestError(f"{type(obj).__name__} is not a contiguous buffer: {exc}") from None
    finally:
        whole.release()


def _nbytes(buffer: Any) -> int:
    with byte_view(buffer) as view:
        return view.nbytes


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of a contiguous buffer (read-only ones too)."""
    info = _PyBuffer()
    _get_buffer(view, ctypes.byref(info), 0)  # PyBUF_SIMPLE; a failure raises the Python error
    try:
        return int(info.buf or 0)
    finally:
        _release_buffer(ctypes.byref(info))


# ---------------------------------------------------------------------------------------------------------------
# O_DIRECT alignment

_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256
_BLKSSZGET = 0x1268  # _IO(0x12, 104)

_libc: ctypes.CDLL | None = None


def _statx_dioalign(fd: int | None, path: str | None) -> tuple[int, int] | None:
    """``(stx_dio_mem_align, stx_dio_offset_align)`` from statx(2), or ``None`` where not reported."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        statx = _libc.statx
    except (OSError, AttributeError):
        return None
    statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
    statx.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fd is not None:
        rc = statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf)
    else:
        rc = statx(_AT_FDCWD, os.fsencode(path or "."), 0, _STATX_DIOALIGN, buf)
    if rc != 0:
        return None
    (mask,) = struct.unpack_from("I", buf.raw, 0)
    mem_align, offset_align = struct.unpack_from("II", buf.raw, 152)
    if not mask & _STATX_DIOALIGN or offset_align == 0:
        return None
    return (mem_align or offset_align, offset_align)


def _sysfs_block_size(dev: int) -> int | None:
    """Logical block size of the block device ``dev`` (a partition looks at its disk's queue)."""
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):
        try:
            with open(f"{queue}/logical_block_size") as fh:
                size = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if size > 0:
            return size
    return None


def _native_dio_alignment(fd: int) -> tuple[int, int] | None:
    try:
        native = importlib.import_module("sfstore._native")
    except ImportError:
        return None
    func = getattr(native, "dio_alignment", None)
    if func is None:
        return None
    try:
        mem_align, offset_align = func(fd)
    except (OSError, ValueError, RuntimeError):
        return None
    if int(mem_align) > 0 and int(offset_align) > 0:
        return (int(mem_align), int(offset_align))
    return None


def _alignment_of_fd(fd: int) -> tuple[int, int]:
    found = _native_dio_alignment(fd) or _statx_dioalign(fd, None)
    if found is not None:
        return found
    st = os.fstat(fd)
    if stat.S_ISBLK(st.st_mode):
        try:
            raw = fcntl.ioctl(fd, _BLKSSZGET, b"\0\0\0\0")
            (size,) = struct.unpack("i", raw)
            if size > 0:
                return (size, size)
        except OSError:
            pass
    size = _sysfs_block_size(st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev)
    if size is not None:
        return (size, size)
    return (4096, 4096)


def direct_io_alignment(fd_or_path: int | str | os.PathLike[str]) -> tuple[int, int]:
    """``(memory alignment, file offset/length alignment)`` that ``O_DIRECT`` needs for a descriptor or path.

    Uses the native helper where it is built, else ``statx(STATX_DIOALIGN)`` where the kernel and filesystem
    report it, else the logical block size of the block device (the device itself, or the one holding the
    filesystem), else ``(4096, 4096)``. A path that does not exist yet is answered for its nearest existing
    parent directory.

    Raises
    ------
    sfstore.errors.BadFileDescriptorError
        ``fd_or_path`` is a closed descriptor.
    """
    if isinstance(fd_or_path, int) and not isinstance(fd_or_path, bool):
        try:
            return _alignment_of_fd(fd_or_path)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EBADF, f"direct_io_alignment({fd_or_path})") from None
    if isinstance(fd_or_path, bool):
        raise errors.InvalidRequestError(f"direct_io_alignment needs a descriptor or a path, not {fd_or_path!r}")
    path = os.path.abspath(os.fspath(fd_or_path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        found = _statx_dioalign(None, path)
        if found is not None:
            return found
        try:
            size = _sysfs_block_size(os.stat(path).st_dev)
        except OSError:
            size = None
        return (size, size) if size is not None else (4096, 4096)
    try:
        return _alignment_of_fd(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# Batch validation


@dataclass(eq=False)
class CheckedRequest:
    """A request that passed :func:`validate_batch`.

    ``view`` is a byte memoryview of exactly ``length`` bytes (the request's slice of its buffer); call
    :meth:`release` when the request has finished so that the buffer can be resized or released again.
    ``direct`` tells whether ``fd`` is ``O_DIRECT``; then ``mem_align``/``offset_align`` hold its alignment
    and ``aligned`` whether the request can go direct as it is.
    """

    index: int
    op: str
    fd: int
    offset: int
    length: int
    view: memoryview
    direct: bool = False
    mem_align: int = 1
    offset_align: int = 1
    aligned: bool = True
    address: int = 0

    def release(self) -> None:
        """Release the buffer view (idempotent)."""
        self.view.release()


def _as_index(value: Any, what: str, index: int) -> int:
    if isinstance(value, bool):
        raise errors.InvalidRequestError(f"request {index}: {what} must be an integer, not {value!r}")
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise errors.InvalidRequestError(
            f"request {index}: {what} must be an integer, not {type(value).__name__}"
        ) from None


def _fd_flags(fd: int, index: int, cache: dict[int, int]) -> int:
    flags = cache.get(fd)
    if flags is None:
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except (OSError, ValueError, OverflowError):
            raise errors.os_error(
                errno.EBADF, f"request {index}: fd {fd} is not an open file descriptor", None,
                errors.BadFileDescriptorError,
            ) from None
        cache[fd] = flags
    return flags


def _check_one(
    index: int,
    raw: Any,
    bounce: bool,
    flag_cache: dict[int, int],
    align_cache: dict[int, tuple[int, int]],
) -> CheckedRequest:
    if isinstance(raw, Request):
        req = raw
    else:
        try:
            req = Request(*raw)
        except TypeError:
            raise errors.InvalidRequestError(
                f"request {index}: expected a Request, not {type(raw).__name__}"
            ) from None
    if req.op not in _OPS:
        raise errors.InvalidRequestError(f"request {index}: op must be 'read' or 'write', not {req.op!r}")
    op: str = req.op
    fd = _as_index(req.fd, "fd", index)
    offset = _as_index(req.offset, "offset", index)
    length = _as_index(req.length, "length", index)
    buffer_offset = _as_index(req.buffer_offset, "buffer_offset", index)
    for what, value in (("offset", offset), ("length", length), ("buffer_offset", buffer_offset)):
        if value < 0:
            raise errors.InvalidRequestError(f"request {index} ({op} fd={fd}): {what} is negative ({value})")
    if fd < 0:
        raise errors.os_error(
            errno.EBADF, f"request {index}: fd {fd} is negative", None, errors.BadFileDescriptorError
        )
    try:
        whole = byte_view(req.buffer)
    except errors.InvalidRequestError as exc:
        raise errors.InvalidRequestError(f"request {index} ({op} fd={fd}): {exc}") from None
    try:
        if buffer_offset + length > whole.nbytes:
            raise errors.BufferTooSmallError(
                f"request {index} ({op} fd={fd} offset={offset} length={length}): a buffer of {whole.nbytes} "
                f"bytes cannot hold {length} bytes at buffer_offset {buffer_offset}"
            )
        if op == "read" and whole.readonly:
            raise errors.ReadOnlyBufferError(
                f"request {index} (read fd={fd} offset={offset} length={length}): the buffer "
                f"({type(req.buffer).__name__}) is read-only"
            )
        flags = _fd_flags(fd, index, flag_cache)
        access = flags & os.O_ACCMODE
        o_path = getattr(os, "O_PATH", 0)
        if (o_path and flags & o_path) or (op == "read" and access == os.O_WRONLY) or (
            op == "write" and access == os.O_RDONLY
        ):
            mode = "O_PATH" if o_path and flags & o_path else ("write-only" if op == "read" else "read-only")
            raise errors.os_error(
                errno.EBADF, f"request {index}: cannot {op} fd {fd}, it is open {mode}", fd_path(fd),
                errors.BadFileDescriptorError,
            )
        view = whole[buffer_offset:buffer_offset + length]
    finally:
        whole.release()
    checked = CheckedRequest(index, op, fd, offset, length, view)
    direct = bool(flags & getattr(os, "O_DIRECT", 0))
    if direct and length > 0:
        try:
            alignment = align_cache.get(fd)
            if alignment is None:
                alignment = align_cache[fd] = direct_io_alignment(fd)
            mem_align, offset_align = alignment
            address = buffer_address(view)
            aligned = offset % offset_align == 0 and length % offset_align == 0 and address % mem_align == 0
            if not aligned and not bounce:
                path = fd_path(fd)
                raise errors.AlignmentError(
                    f"request {index} ({op} fd={fd} offset={offset} length={length} buffer address {address:#x}) "
                    f"on an O_DIRECT descriptor{f' of {path}' if path else ''} is misaligned: offsets and lengths "
                    f"must be multiples of {offset_align} and buffer addresses multiples of {mem_align}, and "
                    "bounce buffers are off (bounce setting, SFSTORE_BOUNCE)"
                )
        except BaseException:
            view.release()
            raise
        checked.direct = True
        checked.mem_align = mem_align
        checked.offset_align = offset_align
        checked.aligned = aligned
        checked.address = address
    return checked


def validate_batch(requests: Sequence[Any], *, bounce: bool | None = None) -> list[CheckedRequest]:
    """Check every request of a batch before any I/O; raise the typed error of the first bad one.

    Parameters
    ----------
    requests : sequence of Request
        The batch (plain tuples in :class:`Request` field order are accepted too).
    bounce : bool, optional
        Whether misaligned requests on ``O_DIRECT`` descriptors may use bounce buffers; ``None`` reads the
        ``bounce`` setting.

    Returns
    -------
    list of CheckedRequest
        One per request, in order; the caller must :meth:`~CheckedRequest.release` each when done.
    """
    if bounce is None:
        bounce = bool(defaults.get("bounce"))
    checked: list[CheckedRequest] = []
    flag_cache: dict[int, int] = {}
    align_cache: dict[int, tuple[int, int]] = {}
    try:
        for index, raw in enumerate(requests):
            checked.append(_check_one(index, raw, bounce, flag_cache, align_cache))
    except BaseException:
        for item in checked:
            item.release()
        raise
    return checked


# ---------------------------------------------------------------------------------------------------------------
# O_DIRECT planning


class Segment(NamedTuple):
    """One piece of a request on an ``O_DIRECT`` descriptor.

    ``kind`` is ``"direct"`` (file range and memory aligned: direct I/O on the request's own buffer),
    ``"bounce"`` (through an aligned bounce buffer: a read covers the enclosing aligned blocks and copies the
    bytes asked for; a write covers an aligned file range whose memory is misaligned) or ``"buffered"`` (a write
    through a buffered descriptor of the same file). ``offset``/``length`` are the file bytes of the piece and
    ``buffer_pos`` its position within the request's view.
    """

    kind: str
    offset: int
    length: int
    buffer_pos: int


def _down(value: int, align: int) -> int:
    return value - value % align


def _up(value: int, align: int) -> int:
    return -(-value // align) * align


def plan_direct(
    op: str, offset: int, length: int, address: int, mem_align: int, offset_align: int, bounce_size: int
) -> list[Segment]:
    """Split a request on an ``O_DIRECT`` descriptor into segments (see :class:`Segment`).

    A read's misaligned head and tail become bounce segments (whole aligned blocks read into a bounce buffer);
    a write's become buffered segments. The aligned middle goes direct when its memory is aligned; otherwise it
    moves through bounce buffers in pieces whose aligned span is at most ``bounce_size`` bytes (a read then
    moves all of the request that way). ``bounce_size`` must be a multiple of ``offset_align``.

    Parameters
    ----------
    op : str
        ``"read"`` or ``"write"``.
    offset, length : int
        The file range.
    address : int
        Memory address of the request's first byte.
    mem_align, offset_align : int
        From :func:`direct_io_alignment`.
    bounce_size : int
        Bytes per bounce buffer.
    """
    if length <= 0:
        return []
    end = offset + length
    mid_start = _up(offset, offset_align)
    mid_end = _down(end, offset_align)
    segments: list[Segment] = []

    def bounce(start: int, stop: int) -> None:
        pos = start
        while pos < stop:
            piece_end = min(stop, _down(pos, offset_align) + bounce_size)
            segments.append(Segment("bounce", pos, piece_end - pos, pos - offset))
            pos = piece_end

    edge_kind = "bounce" if op == "read" else "buffered"
    if mid_start >= mid_end:  # no whole aligned block inside the request
        if op == "read":
            bounce(offset, end)
        else:
            segments.append(Segment("buffered", offset, length, 0))
        return segments
    mid_aligned = (address + (mid_start - offset)) % mem_align == 0
    if op == "read" and not mid_aligned:
        bounce(offset, end)
        return segments
    if mid_start > offset:
        if edge_kind == "bounce":
            bounce(offset, mid_start)
        else:
            segments.append(Segment("buffered", offset, mid_start - offset, 0))
    if mid_aligned:
        segments.append(Segment("direct", mid_start, mid_end - mid_start, mid_start - offset))
    else:
        bounce(mid_start, mid_end)
    if end > mid_end:
        if edge_kind == "bounce":
            bounce(mid_end, end)
        else:
            segments.append(Segment("buffered", mid_end, end - mid_end, mid_end - offset))
    return segments
