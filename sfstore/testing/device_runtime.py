"""A device runtime that emulates a GPU with host memory, for testing the device path on machines without one.

:class:`EmulatedGPUArray` is a numpy array the runtime calls GPU memory; :class:`EmulatedDeviceRuntime` answers
the mode it is told (``gds``, ``compat``, ``staged``), and its kvikio stand-in moves bytes with ``pread`` /
``pwrite`` on a thread pool, as kvikio's POSIX backend does. Everything above the runtime (route choice,
splitting, staging, counting, checksums, the KV cache's tiers) then runs as it would with a GPU; only the last
call differs. Tests that use it say so in their names (``emulated_gpu``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sfstore.paths.device_runtime import DeviceFile, DeviceRuntime, Route

__all__ = ["EmulatedGPUArray", "EmulatedDeviceRuntime", "gpu_array"]


class EmulatedGPUArray(np.ndarray):
    """A numpy array that :class:`EmulatedDeviceRuntime` treats as GPU memory."""


def gpu_array(shape: Any, dtype: Any = np.uint8, fill: Any = None) -> EmulatedGPUArray:
    """A zeroed (or ``fill``-ed) :class:`EmulatedGPUArray`."""
    a = np.zeros(shape, dtype=dtype).view(EmulatedGPUArray)
    if fill is not None:
        a[...] = fill
    return a


def _bytes(buf: Any) -> np.ndarray:
    return np.asarray(buf).reshape(-1).view(np.uint8)


class _Future:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def get(self) -> int:
        return int(self._inner.result())

    def done(self) -> bool:
        return bool(self._inner.done())


class _EmulatedFile(DeviceFile):
    def __init__(self, runtime: EmulatedDeviceRuntime, fd: int) -> None:
        # As kvikio does: its own descriptor of the file, opened by /proc/self/fd/N, without O_DIRECT (buffers
        # here are not aligned; kvikio's POSIX backend bounces what O_DIRECT would refuse).
        self._rt, self._fd = runtime, os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        self.compat = runtime.compat_files

    def _run(self, write: bool, buf: Any, size: int, file_offset: int, buf_offset: int) -> int:
        view = memoryview(_bytes(buf).data)[buf_offset:buf_offset + size]
        done = 0
        while done < size:
            step = (os.pwrite(self._fd, view[done:], file_offset + done) if write
                    else os.preadv(self._fd, [view[done:]], file_offset + done))
            if step == 0:
                break
            done += step
        self._rt.calls.append(("pwrite" if write else "pread", size))
        return done

    def pread(self, buf: Any, size: int, file_offset: int, buf_offset: int) -> Any:
        return _Future(self._rt.pool.submit(self._run, False, buf, size, file_offset, buf_offset))

    def pwrite(self, buf: Any, size: int, file_offset: int, buf_offset: int) -> Any:
        return _Future(self._rt.pool.submit(self._run, True, buf, size, file_offset, buf_offset))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EmulatedDeviceRuntime(DeviceRuntime):
    """A GPU made of host memory (see the module).

    Parameters
    ----------
    mode : {"gds", "compat", "staged"}
        What the runtime says the host has.
    compat_files : bool or None
        What its kvikio stand-in says of each file it opens (``True``: kvikio chose compat mode for it).
    """

    name = "emulated"

    def __init__(self, mode: Route = "gds", *, compat_files: bool | None = False) -> None:
        self._mode: Route = mode
        self.compat_files = compat_files
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="emulated-kvikio")
        self.calls: list[tuple[str, int]] = []
        self.copies_to_host = 0
        self.copies_from_host = 0
        self.registered: list[int] = []

    def mode(self) -> tuple[Route, str]:
        return self._mode, f"emulated GPU runtime in mode {self._mode} (a test double: no GPU on this machine)"

    def is_device(self, buf: Any) -> bool:
        return isinstance(buf, EmulatedGPUArray)

    def nbytes(self, buf: Any) -> int:
        return int(np.asarray(buf).nbytes)

    def open(self, fd: int, full: str) -> DeviceFile:
        return _EmulatedFile(self, fd)

    def to_host(self, buf: Any, offset: int, dst: memoryview) -> None:
        self.copies_to_host += 1
        np.frombuffer(dst, np.uint8)[:] = _bytes(buf)[offset:offset + dst.nbytes]

    def from_host(self, buf: Any, offset: int, src: memoryview) -> None:
        self.copies_from_host += 1
        _bytes(buf)[offset:offset + src.nbytes] = np.frombuffer(src, np.uint8)

    def weighted_sum(self, buf: Any, offset: int, nbytes: int) -> int:
        words = _bytes(buf)[offset:offset + nbytes].view("<u8")
        w = np.arange(1, 2 * words.size, 2, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return int(np.dot(words, w)) if words.size else 0

    def scratch(self, like: Any, nbytes: int) -> Any:
        return gpu_array(nbytes)

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> None:
        _bytes(dst)[dst_offset:dst_offset + nbytes] = _bytes(src)[src_offset:src_offset + nbytes]

    def register(self, buf: Any) -> bool:
        self.registered.append(id(buf))
        return True

    def deregister(self, buf: Any) -> None:
        self.registered.remove(id(buf))
