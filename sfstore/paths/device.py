"""The device path: GPU arrays to and from slab files, GPU-direct (cuFile/GDS through kvikio) where possible.

A :class:`DevicePath` is a directory of slab files read and written at given offsets. GPU arrays (cupy, torch
CUDA, anything with DLPack or ``__cuda_array_interface__``) move through kvikio's ``CuFile``: straight between
GPU memory and storage where cuFile and the nvidia-fs driver are there (``gds``), through kvikio's own host
bounce buffers otherwise (``compat``). Without kvikio or a CUDA driver the path is ``host``: GPU arrays are
staged through sfstore's registered (pinned) buffers. Host arrays always go through sfstore's I/O engine
(O_DIRECT where the filesystem allows). Which mode is live, and why, is in :meth:`DevicePath.describe`, in
``sfstore probe`` (``gds``) and in the router's routing of the ``kvcache`` class.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

from sfstore import errors
from sfstore.buffers import RegisteredBufferPool, as_buffer, device_nbytes, is_device_buffer
from sfstore.engine import IOFuture, Request, get_engine
from sfstore.paths.base import StoragePath
from sfstore.paths.file import FilePath, enable_direct

__all__ = ["DevicePath", "DeviceFuture", "device_mode"]

_MODES = ("auto", "gds", "compat", "host")
_STAGE = 8 << 20  # bytes per pinned staging buffer in host mode


def device_mode() -> tuple[str, str]:
    """``(mode, why)``: ``gds`` (cuFile + nvidia-fs), ``compat`` (kvikio through host memory) or ``host``."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "host", "no CUDA driver (libcuda.so.1): GPU arrays are staged through sfstore's pinned buffers"
    try:
        importlib.import_module("kvikio")
    except Exception as exc:  # ImportError, or kvikio failing to load its libraries
        return "host", (f"kvikio is not usable ({type(exc).__name__}: {exc}; pip install 'sfstore[gpu]'): GPU "
                        "arrays are staged through sfstore's pinned buffers")
    from sfstore.probe import probe_gds

    gds = probe_gds()
    compat = str(gds.get("kvikio", {}).get("compat_mode") or "").upper()
    if gds.get("status") == "ok" and compat not in ("ON", "TRUE"):
        return "gds", "cuFile and the nvidia-fs driver are there: GPU memory <-> storage with no host copy"
    return "compat", "kvikio compat mode: " + str(gds.get("reason") or "cuFile is not available") + \
        " (kvikio bounces through host memory)"


class DeviceFuture:
    """The result of an ``*_async`` call: ``done()``, ``wait()``, ``get()`` (bytes moved)."""

    def __init__(self, wait: Callable[[], int], done: Callable[[], bool] | None = None) -> None:
        self._wait = wait
        self._done_fn = done
        self._result: int | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        if self._result is not None or self._error is not None:
            return True
        return self._done_fn() if self._done_fn is not None else False

    def get(self, timeout: float | None = None) -> int:
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                self._result = self._wait()
            except BaseException as exc:
                self._error = exc
                raise
        return self._result

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.get(timeout)
        except Exception:
            pass
        return True


class DevicePath(StoragePath):
    """Slab files under ``root``, read and written at offsets from GPU or host arrays.

    Parameters
    ----------
    root : str or os.PathLike
        The directory of the slab files (paths are confined to it, as on the file path).
    mode : {"auto", "gds", "compat", "host"}
        ``auto`` takes what :func:`device_mode` finds; asking for ``gds`` or ``compat`` where it is not there
        raises :class:`~sfstore.errors.NotSupportedOnHostError`.

    Notes
    -----
    For full speed, offsets and sizes should be multiples of 4096 and GPU arrays registered once with
    :meth:`register` (``cuFileBufRegister``) when they are reused for many transfers.
    """

    kind = "device"

    def __init__(self, root: str | os.PathLike[str], *, mode: str = "auto") -> None:
        super().__init__()
        if mode not in _MODES:
            raise errors.ConfigError(f"DevicePath mode must be one of {', '.join(_MODES)}, not {mode!r}")
        found, why = device_mode()
        if mode != "auto" and mode != found and not (mode == "host" or (mode == "compat" and found == "gds")):
            raise errors.NotSupportedOnHostError(f"device path mode {mode!r} is not available here: {why}")
        self.mode = found if mode == "auto" else mode
        self.why = why if mode in ("auto", found) else f"mode {mode!r} asked for"
        if self.mode != "gds":
            self.fallbacks.append(f"device path {self.mode}: {self.why}")
        os.makedirs(os.fspath(root), exist_ok=True)
        self.fp = FilePath(root)
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[int, bool]] = {}
        self._cufiles: dict[str, Any] = {}
        self._stage: RegisteredBufferPool | None = None
        self._registered: dict[int, Any] = {}

    @property
    def transport(self) -> str:
        return self.fp.transport

    @property
    def supports_direct_io(self) -> bool:
        return self.fp.supports_direct_io

    @property
    def supports_device_buffers(self) -> bool:
        """True where GPU memory moves to storage with no host copy (``gds``)."""
        return self.mode == "gds"

    def describe(self) -> dict[str, Any]:
        d = self.fp.describe()
        mine = self.counters.snapshot()  # slab I/O here; whole files (the KV cache's shared tier) on self.fp
        counters = {k: mine.get(k, 0) + int(v) for k, v in d.get("counters", {}).items()}
        return {**d, "kind": self.kind, "mode": self.mode, "why": self.why,
                "supports_device_buffers": self.supports_device_buffers,
                "fallbacks": list(self.fallbacks) + list(d.get("fallbacks", [])), "counters": counters}

    # -- files -----------------------------------------------------------------------------------------------
    def slab(self, path: str | os.PathLike[str], size: int) -> str:
        """Create (preallocated) or grow the slab file ``path`` to ``size`` bytes; return its full path."""
        fd, full = self._open(path, create=True)
        try:
            if os.fstat(fd).st_size < size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return full

    def _open(self, path: str | os.PathLike[str], *, create: bool) -> tuple[int, str]:
        """Open ``path`` read-write beneath the root (``create``: with missing parents, as a new file if
        missing); a FIFO or device is refused without blocking. Returns the descriptor and the full name."""
        full = self.fp.full(path)
        flags = os.O_RDWR | os.O_NONBLOCK | (os.O_CREAT if create else 0)
        try:
            parents = self.fp.beneath.parts(path)[:-1]
            if create and parents:
                self.fp.beneath.mkdir("/".join(parents), parents=True, exist_ok=True)
            fd = self.fp.beneath.open(path, flags, 0o644)
        except errors.PathEscapeError:
            raise
        except FileNotFoundError:
            raise errors.os_error(errno.ENOENT, "no such slab file", full) from None
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot open", full) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise errors.os_error(errno.EINVAL, "not a regular file", full, errors.NotARegularFileError)
            fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # blocking again (O_NONBLOCK only kept a FIFO from waiting)
        except BaseException:
            os.close(fd)
            raise
        return fd, full

    def _fd(self, path: str | os.PathLike[str], *, create: bool) -> tuple[int, str]:
        """The cached descriptor of ``path`` (opened once beneath the root, O_DIRECT where allowed)."""
        full = self.fp.full(path)
        with self._lock:
            got = self._fds.get(full)
            if got is None:
                fd, _ = self._open(path, create=create)
                got = (fd, enable_direct(fd, full, required=False))
                self._fds[full] = got
            return got[0], full

    def _cufile(self, path: str | os.PathLike[str], create: bool) -> Any:
        fd, full = self._fd(path, create=create)
        with self._lock:
            f = self._cufiles.get(full)
            if f is None:
                kvikio = importlib.import_module("kvikio")
                # The file this path's descriptor holds (opened beneath the root), never the name again:
                # kvikio takes a path only, and reopening /proc/self/fd/N opens that very inode.
                try:
                    f = kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
                except Exception as exc:  # kvikio raises RuntimeError for what open(2) refuses
                    raise errors.os_error(errno.EIO, f"kvikio cannot open the file ({exc})", full) from None
                self._cufiles[full] = f
            return f

    # -- registration ----------------------------------------------------------------------------------------
    def register(self, array: Any) -> None:
        """Register a GPU array with cuFile for repeated transfers (a no-op, counted, outside ``gds``)."""
        if self.mode == "host" or not is_device_buffer(array):
            return
        kvikio = importlib.import_module("kvikio")
        kvikio.memory_register(array)
        self._registered[id(array)] = array

    def deregister(self, array: Any) -> None:
        if self._registered.pop(id(array), None) is not None:
            importlib.import_module("kvikio").memory_deregister(array)

    # -- I/O -------------------------------------------------------------------------------------------------
    def write_async(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> DeviceFuture:
        """Write all of ``array`` into the file ``path`` at ``offset`` (created if missing)."""
        return self._io(path, array, offset, write=True)

    def write(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> int:
        return self.write_async(path, array, offset).get()

    def read_into_async(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> DeviceFuture:
        """Fill ``array`` from the file ``path`` at ``offset``; a short file raises (nothing is half-filled
        silently)."""
        return self._io(path, array, offset, write=False)

    def read_into(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> int:
        return self.read_into_async(path, array, offset).get()

    def _io(self, path: str | os.PathLike[str], array: Any, offset: int, write: bool) -> DeviceFuture:
        if offset < 0:
            raise errors.InvalidRequestError(f"negative offset {offset}")
        if is_device_buffer(array):
            n = device_nbytes(array)
            if self.mode in ("gds", "compat"):
                return self._kvikio(path, array, n, offset, write)
            return self._staged(path, array, n, offset, write)
        view = memoryview(as_buffer(array)).cast("B")
        if not write and view.readonly:
            raise errors.ReadOnlyBufferError("read_into: the destination array is read-only")
        n = view.nbytes
        fd, full = self._fd(path, create=write)
        req = (Request.write if write else Request.read)(fd, offset, n, view)
        fut = get_engine().submit([req])
        return DeviceFuture(lambda: self._finish(fut, n, write, full), fut.done)

    def _finish(self, fut: IOFuture, n: int, write: bool, full: str) -> int:
        got = fut.get()[0]
        direct, bounced = fut.transferred()
        self.counters.add(requests=1, bytes_direct=direct, bytes_bounced=bounced,
                          **{"bytes_written" if write else "bytes_read": got})
        if got != n:
            raise errors.os_error(errno.EIO, f"short {'write' if write else 'read'}: {got} of {n} bytes", full)
        return got

    def _kvikio(self, path: str | os.PathLike[str], array: Any, n: int, offset: int, write: bool) -> DeviceFuture:
        f = self._cufile(path, create=write)
        full = self.fp.full(path)
        kfut = f.pwrite(array, n, offset) if write else f.pread(array, n, offset)

        def wait() -> int:
            got = int(kfut.get())
            key = "bytes_direct" if self.mode == "gds" else "bytes_bounced"
            self.counters.add(requests=1, **{key: got, "bytes_written" if write else "bytes_read": got})
            if got != n:
                raise errors.os_error(errno.EIO, f"short {'write' if write else 'read'}: {got} of {n}", full)
            return got

        return DeviceFuture(wait, kfut.done)

    def _staged(self, path: str | os.PathLike[str], array: Any, n: int, offset: int, write: bool) -> DeviceFuture:
        """GPU array through pinned staging buffers and the engine (synchronous; host mode)."""
        from sfstore.buffers import copy_host_to_device

        with self._lock:
            if self._stage is None:
                self._stage = RegisteredBufferPool(_STAGE)
            pool = self._stage
        fd, full = self._fd(path, create=write)
        engine = get_engine()
        flat = _flat_device_bytes(array)
        done = 0
        buf = pool.acquire()
        try:
            view = memoryview(buf)
            while done < n:
                k = min(_STAGE, n - done)
                if write:
                    _device_to_host(flat, done, view[:k])
                    fut = engine.submit([Request.write(fd, offset + done, k, buf)])
                else:
                    fut = engine.submit([Request.read(fd, offset + done, k, buf)])
                got = self._finish(fut, k, write, full)
                if not write:
                    copy_host_to_device(array, done, view[:got])
                done += got
            del view
        finally:
            buf.release()
        result = done
        return DeviceFuture(lambda: result, lambda: True)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            cufiles, self._cufiles = list(self._cufiles.values()), {}
        for fd, _direct in fds:
            os.close(fd)
        for f in cufiles:
            f.close()
        for arr in list(self._registered.values()):
            self.deregister(arr)
        if self._stage is not None:
            self._stage.close()


def _flat_device_bytes(array: Any) -> Any:
    if type(array).__module__.startswith("torch"):
        import torch

        return array.detach().reshape(-1).view(torch.uint8)
    import cupy

    return cupy.asarray(array).reshape(-1).view(cupy.uint8)


def _device_to_host(flat: Any, start: int, dst: memoryview) -> None:
    n = dst.nbytes
    if type(flat).__module__.startswith("torch"):
        import torch

        torch.frombuffer(dst, dtype=torch.uint8, count=n).copy_(flat[start:start + n])
        return
    import numpy as np

    flat[start:start + n].get(out=np.frombuffer(dst, np.uint8))
