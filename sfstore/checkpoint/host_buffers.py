"""Page-aligned host buffers for checkpoints, and the checks the checkpoint face makes of its writes.

A :class:`HostBuffer` is a registered buffer (:class:`~sfstore.buffers.RegisteredBufferPool`: page-aligned,
huge pages from 2 MiB up, mlocked and CUDA-registered where allowed) of one size, from a pool that is closed
at once, so the memory goes back to the system when the buffer is released or, for buffers whose tensor views
were handed out, when the last view dies. Without the native helper it is an anonymous ``mmap`` (page-aligned
too). :meth:`HostBuffer.tensor` is a zero-copy ``uint8`` torch view.

:data:`load_buffers` keeps loads' buffers for the next load (``checkpoint_reuse_buffers``): a buffer whose last
view dies goes back to an open pool of its size instead of to the system, so a process that loads again (an
evaluation sweep, a reinforcement-learning loop taking fresh weights) reads into memory that is already mapped,
faulted in, locked and registered. Fresh memory is what a load pays for most where the host reclaims freed
guest pages (``memory.free_page_reporting`` in the probe): touching it costs more than reading the shard.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sfstore import defaults, errors, forks
from sfstore.buffers import RegisteredBufferPool, native_available
from sfstore.checkpoint.location import DATA_CLASS
from sfstore.paths.base import Range
from sfstore.paths.file import FilePath

if TYPE_CHECKING:
    import torch

__all__ = ["HostBuffer", "LoadBuffers", "load_buffers", "round_size", "check_written", "write_small", "HUGE"]

PAGE = mmap.PAGESIZE
HUGE = 2 << 20


def round_size(nbytes: int) -> int:
    """Bytes to allocate for ``nbytes``: whole 2 MiB huge pages from 2 MiB up, whole pages below."""
    n = max(int(nbytes), 1)
    step = HUGE if n >= HUGE else PAGE
    return -(-n // step) * step


class HostBuffer:
    """One page-aligned host buffer of at least ``nbytes`` bytes (see the module docs)."""

    def __init__(self, nbytes: int, pool: RegisteredBufferPool | None = None) -> None:
        self.nbytes = int(nbytes)
        self.capacity = size = round_size(nbytes)
        self.registered = native_available()[0]
        self.buf: Any
        if pool is not None:  # a buffer of an open pool: it goes back there when released
            self.buf = pool.acquire()
        elif self.registered:
            pool = RegisteredBufferPool(size, max_buffers=1)
            try:
                self.buf = pool.acquire()
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


class LoadBuffers:
    """Host buffers for checkpoint loads, kept for the next load (see the module docs).

    One open :class:`~sfstore.buffers.RegisteredBufferPool` per rounded size. Loads take buffers inside a
    :meth:`session`; when the last session running ends, each size keeps at most as many idle buffers as the
    sessions since the previous end took of it, and the sizes they did not take are freed. So the memory kept
    idle is at most what the most recent loads used, and none of it while their tensors are alive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[int, RegisteredBufferPool] = {}
        self._taken: dict[int, int] = {}
        self._active = 0
        forks.after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # The parent's pools are not the child's to hand out, nor are its sessions running here.
        self._lock = threading.Lock()
        self._pools, self._taken, self._active = {}, {}, 0

    @contextmanager
    def session(self) -> Iterator[LoadBuffers]:
        """Take buffers with :meth:`take` inside; the kept buffers are trimmed when the last session ends."""
        with self._lock:
            self._active += 1
        try:
            yield self
        finally:
            self._end()

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes`` bytes: an idle one of the same rounded size, else a new one. Without
        ``checkpoint_reuse_buffers`` or the native helper, a buffer of its own (freed when released)."""
        if not defaults.get("checkpoint_reuse_buffers") or not native_available()[0]:
            return HostBuffer(nbytes)
        size = round_size(nbytes)
        with self._lock:
            pool = self._pools.get(size)
            if pool is None:
                pool = self._pools[size] = RegisteredBufferPool(size)
            self._taken[size] = self._taken.get(size, 0) + 1
            # Acquired under the lock: a session ending in another thread must not close this pool in between.
            # Only the first load of a size allocates here; later ones take an idle buffer.
            return HostBuffer(nbytes, pool)

    def _end(self) -> None:
        close: list[RegisteredBufferPool] = []
        with self._lock:
            self._active -= 1
            if self._active > 0:
                return
            keep = bool(defaults.get("checkpoint_reuse_buffers"))
            for size, pool in list(self._pools.items()):
                taken = self._taken.get(size, 0) if keep else 0
                if taken:
                    pool.keep_idle(taken)
                else:
                    close.append(self._pools.pop(size))
            self._taken = {}
        for pool in close:
            pool.close()  # buffers still out are freed when their views die

    def stats(self) -> dict[str, int]:
        """``idle_bytes`` (kept for the next load), ``in_use_bytes`` (held by loads' tensors) and ``pools``."""
        idle = in_use = 0
        with self._lock:
            pools = list(self._pools.items())
        for size, pool in pools:
            st = pool.stats()
            idle += size * int(st["free"])
            in_use += size * int(st["in_use"])
        return {"idle_bytes": idle, "in_use_bytes": in_use, "pools": len(pools)}

    def free(self) -> int:
        """Free every idle buffer now (buffers still held by tensors are freed when those die); returns the
        bytes freed."""
        with self._lock:
            pools, self._pools, self._taken = self._pools, {}, {}
        freed = 0
        for size, pool in pools.items():
            freed += size * int(pool.stats()["free"])
            pool.close()
        return freed


load_buffers = LoadBuffers()
"""The process's :class:`LoadBuffers`, shared by every checkpoint load."""


def check_written(got: int, length: int, path: str, fp: FilePath) -> None:
    """A write that moved fewer bytes than asked is an error (counted on ``fp``): raise
    :class:`~sfstore.errors.IOEngineError` (EIO). The path counts failed requests; a short one is the face's to
    judge."""
    if got != length:
        fp.file_failed(data_class=DATA_CLASS)
        raise errors.os_error(errno.EIO, f"short write ({got} of {length} bytes)", path, errors.IOEngineError)


def write_small(fp: FilePath, path: str, data: bytes, *, dirfd: int | None = None) -> None:
    """Create ``path`` (which must not exist) with ``data`` through ``fp`` (counted as checkpoint I/O), and
    fsync it. With ``dirfd`` the file is created as ``basename(path)`` in that directory descriptor (``path``
    names it in errors), a symlink refused."""
    try:
        if dirfd is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        else:
            fd = os.open(os.path.basename(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dirfd)
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "cannot create", path) from None
    try:
        if data:
            got = fp.submit([Range.write(0, len(data), data, 0, fd)], data_class=DATA_CLASS).get()[0]
            check_written(got, len(data), path, fp)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot write", path) from None
    finally:
        os.close(fd)
