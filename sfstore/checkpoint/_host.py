"""Page-aligned host buffers for checkpoints, and the engine calls that move them.

A :class:`HostBuffer` is a registered buffer (:class:`~sfstore.buffers.RegisteredBufferPool`: page-aligned,
huge pages from 2 MiB up, mlocked and CUDA-registered where allowed) of one size, from a pool that is closed
at once, so the memory goes back to the system when the buffer is released or, for buffers whose tensor views
were handed out, when the last view dies. Without the native helper it is an anonymous ``mmap`` (page-aligned
too). :meth:`HostBuffer.tensor` is a zero-copy ``uint8`` torch view.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any

from sfstore import errors
from sfstore.buffers import RegisteredBufferPool, native_available
from sfstore.engine import IOFuture, Request
from sfstore.paths.file import FilePath

if TYPE_CHECKING:
    import torch

__all__ = ["HostBuffer", "round_size", "submit", "finish", "HUGE"]

PAGE = mmap.PAGESIZE
HUGE = 2 << 20


def round_size(nbytes: int) -> int:
    """Bytes to allocate for ``nbytes``: whole 2 MiB huge pages from 2 MiB up, whole pages below."""
    n = max(int(nbytes), 1)
    step = HUGE if n >= HUGE else PAGE
    return -(-n // step) * step


class HostBuffer:
    """One page-aligned host buffer of at least ``nbytes`` bytes (see the module docs)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.capacity = size = round_size(nbytes)
        self.registered = native_available()[0]
        if self.registered:
            pool = RegisteredBufferPool(size, max_buffers=1)
            try:
                self.buf: Any = pool.acquire()
            finally:
                pool.close()  # the buffer is freed when released, not kept for reuse
        else:
            self.buf = mmap.mmap(-1, size)

    def tensor(self) -> torch.Tensor:
        """A ``uint8`` tensor over the whole buffer (no copy); it keeps the memory alive."""
        import torch

        if self.registered:
            view: torch.Tensor = torch.utils.dlpack.from_dlpack(self.buf)
            return view
        return torch.frombuffer(self.buf, dtype=torch.uint8)

    def release(self) -> None:
        """Give the memory back now if no view of it is alive (else when the last one dies)."""
        if self.registered and self.buf is not None:
            try:
                self.buf.release()
            except errors.BufferInUseError:
                pass
        self.buf = None


def submit(fp: FilePath, fd: int, offset: int, length: int, buf: Any, buf_offset: int, *, write: bool) -> IOFuture:
    """Submit ``length`` bytes at file ``offset`` as ``fp.chunk_size`` requests; returns the batch future."""
    make = Request.write if write else Request.read
    step = fp.chunk_size
    reqs = [make(fd, offset + p, min(step, length - p), buf, buf_offset + p) for p in range(0, length, step)]
    return fp.engine.submit(reqs)


def finish(fp: FilePath, fut: IOFuture, length: int, *, write: bool, path: str) -> int:
    """Wait for a batch from :func:`submit`, count it on ``fp``, and return the bytes moved.

    A short write raises :class:`~sfstore.errors.IOEngineError` (EIO); short reads are the caller's to judge.
    """
    try:
        got = sum(fut.get())
    except errors.SfstoreOSError:
        fp.counters.add(errors=1, requests=len(fut))
        raise
    direct, bounced = fut.transferred()
    fp.counters.add(requests=len(fut), bytes_direct=direct, bytes_bounced=bounced)
    if write:
        fp.counters.add(bytes_written=got)
        if got != length:
            fp.counters.add(errors=1)
            raise errors.os_error(5, f"short write ({got} of {length} bytes)", path, errors.IOEngineError)
    else:
        fp.counters.add(bytes_read=got)
    return got


def write_small(path: str, data: bytes) -> None:
    """Create ``path`` (which must not exist) with ``data``, and fsync it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise errors.os_error(exc.errno or 5, "cannot create", path) from None
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except OSError as exc:
        raise errors.os_error(exc.errno or 5, "cannot write", path) from None
    finally:
        os.close(fd)
