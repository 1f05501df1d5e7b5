"""What moves GPU bytes for the device path: CUDA copies, kvikio's ``CuFile``, checksums computed on the GPU.

:class:`~sfstore.paths.device.DevicePath` decides *how* a GPU buffer reaches storage (its route) and keeps the
counters; a :class:`DeviceRuntime` does the last call of each route: a kvikio read or write (``gds`` with
cuFile, ``compat`` through kvikio's host buffers), a copy between GPU memory and a pinned host buffer (sfstore's
``staged`` route), a checksum of GPU memory. :class:`CudaRuntime` is the real one (torch CUDA tensors, cupy
arrays; kvikio where installed). Everything above the runtime runs, and is tested, on a machine without a GPU
(:mod:`sfstore.testing.device_runtime` emulates one with host memory).
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from sfstore import errors
from sfstore.buffers import copy_from_host, copy_to_host, device_nbytes, flat_bytes, is_device_buffer
from sfstore.checksums import KVSUM_WORD, kvsum64_finish
from sfstore.futures import deadline_after, remaining

__all__ = ["DeviceRuntime", "DeviceFile", "CudaRuntime", "KvikioLeg", "Route", "TransferFuture"]

_MASK = (1 << 64) - 1


class TransferFuture(Protocol):
    """A started kvikio transfer (kvikio's ``IOFuture``): ``get()`` waits and gives the bytes moved."""

    def get(self) -> int: ...

    def done(self) -> bool: ...


class DeviceFile(ABC):
    """An open file (or block device) as kvikio sees it: reads and writes between it and GPU memory."""

    #: Whether kvikio moves this file's bytes through host memory (its compat mode): ``True``, ``False``
    #: (cuFile, GPU-direct), or ``None`` when it cannot say.
    compat: bool | None = None

    @abstractmethod
    def pread(self, buf: Any, size: int, file_offset: int, buf_offset: int) -> TransferFuture:
        """Start reading ``size`` bytes at ``file_offset`` into ``buf`` at byte ``buf_offset``; a future with
        ``get()`` (bytes) and ``done()``."""

    @abstractmethod
    def pwrite(self, buf: Any, size: int, file_offset: int, buf_offset: int) -> TransferFuture:
        """Start writing ``size`` bytes of ``buf`` from byte ``buf_offset`` at ``file_offset``."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release the handle (cuFile deregisters it)."""


Route = Literal["gds", "compat", "staged"]
"""How GPU memory meets storage: ``gds`` (cuFile, no host copy), ``compat`` (kvikio through host memory) or
``staged`` (sfstore's pinned buffers, then a CUDA copy)."""


class DeviceRuntime(ABC):
    """The GPU side of the device path (see the module)."""

    name: str = ""

    @abstractmethod
    def mode(self) -> tuple[Route, str]:
        """``(mode, why)``: ``"gds"`` (cuFile is there), ``"compat"`` (kvikio without cuFile) or ``"staged"``
        (no kvikio: sfstore's pinned staging)."""

    @abstractmethod
    def is_device(self, buf: Any) -> bool:
        """Whether ``buf`` is GPU memory this runtime moves."""

    @abstractmethod
    def nbytes(self, buf: Any) -> int:
        """Size in bytes of the GPU buffer ``buf``."""

    @abstractmethod
    def open(self, fd: int, full: str) -> DeviceFile:
        """A kvikio handle of the open descriptor ``fd`` (``full`` names it in errors)."""

    @abstractmethod
    def to_host(self, buf: Any, offset: int, dst: memoryview) -> None:
        """Copy ``dst.nbytes`` bytes of GPU ``buf`` from byte ``offset`` into host ``dst`` (synchronous)."""

    @abstractmethod
    def from_host(self, buf: Any, offset: int, src: memoryview) -> None:
        """Copy host ``src`` into GPU ``buf`` at byte ``offset`` (synchronous)."""

    @abstractmethod
    def weighted_sum(self, buf: Any, offset: int, nbytes: int) -> int:
        """``sum(word[i] * (2*i + 1)) mod 2**64`` over the 64-bit words of ``buf[offset:offset + nbytes]``,
        computed where ``buf`` lives (see :func:`sfstore.checksums.kvsum64`)."""

    @abstractmethod
    def scratch(self, like: Any, nbytes: int) -> Any:
        """A GPU buffer of ``nbytes`` on the device of ``like`` (to read into before a block is verified)."""

    @abstractmethod
    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> None:
        """Copy GPU bytes to GPU bytes (synchronous)."""

    def copy_rows(self, dst: Any, dst_offset: int, dst_stride: int, src: Any, src_offset: int, src_stride: int,
                  row_bytes: int, rows: int) -> None:
        """Copy ``rows`` rows of ``row_bytes``: row ``r`` from ``src`` at ``src_offset + r * src_stride`` to
        ``dst`` at ``dst_offset + r * dst_stride`` (a block's layers into or out of a layer-major chunk body).
        Runtimes move them in one strided copy."""
        for r in range(rows):
            self.copy(dst, dst_offset + r * dst_stride, src, src_offset + r * src_stride, row_bytes)

    def register(self, buf: Any) -> bool:
        """Register ``buf`` with cuFile for repeated transfers; whether it was registered."""
        return False

    def deregister(self, buf: Any) -> None:  # noqa: B027 - nothing registered by default
        """Undo :meth:`register`."""

    def weighted_sums(self, buf: Any, offsets: Sequence[int], nbytes: int) -> list[int]:
        """:meth:`weighted_sum` of ``nbytes`` bytes at each of ``offsets`` (runtimes answer them in one call)."""
        return [self.weighted_sum(buf, o, nbytes) for o in offsets]

    def checksum(self, buf: Any, offset: int, nbytes: int) -> int:
        """:func:`sfstore.checksums.kvsum64` of ``nbytes`` bytes of GPU ``buf`` from ``offset``."""
        return self.checksums(buf, [offset], nbytes)[0]

    def checksums(self, buf: Any, offsets: Sequence[int], nbytes: int) -> list[int]:
        """:func:`sfstore.checksums.kvsum64` of ``nbytes`` bytes of GPU ``buf`` at each of ``offsets``: one
        answer from the GPU for all of them (a chunk's slices are checked layer by layer, hundreds at a time)."""
        if nbytes % KVSUM_WORD or any(o % KVSUM_WORD for o in offsets):
            raise errors.InvalidRequestError(
                f"a GPU-direct block checksum sums whole {KVSUM_WORD}-byte words: offsets {list(offsets)[:4]}, "
                f"{nbytes} bytes"
            )
        if not offsets:
            return []
        return [kvsum64_finish(s & _MASK, nbytes) for s in self.weighted_sums(buf, offsets, nbytes)]


class KvikioLeg:
    """kvikio transfers of one :meth:`DevicePath.submit` batch, as a :class:`~sfstore.paths.base.Leg`.

    kvikio's futures have ``get()`` and ``done()`` but no timed wait: :meth:`wait` looks at ``done()`` until
    the deadline (1 ms apart at most), and :meth:`results` collects each ``get()`` once.
    """

    def __init__(self, futures: list[TransferFuture | None], descriptions: list[tuple[str, int, int, int]],
                 names: list[str]) -> None:
        self._futures = futures
        self._described = descriptions
        self._names = names
        self._results: list[int] | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._results is not None or all(f is None or f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = deadline_after(timeout)
        pause = 0.00005
        while not self.done():
            left = remaining(deadline)
            if left == 0.0:
                return False
            time.sleep(pause if left is None else min(pause, left))
            pause = min(0.001, pause * 2)
        return True

    def results(self, timeout: float | None = None) -> list[int]:
        if not self.wait(timeout):
            raise errors.IOTimeoutError(f"kvikio transfers had not finished after {timeout} s")
        with self._lock:
            if self._results is None:
                out = []
                for f, (_, _, _, length) in zip(self._futures, self._described, strict=True):
                    if f is None:
                        out.append(0)
                        continue
                    try:
                        got = int(f.get())
                    except Exception as exc:  # kvikio raises RuntimeError with cuFile's or the OS's message
                        out.append(-_errno_of(exc))
                        continue
                    out.append(got if got == length else -errno.EIO)  # a short GPU transfer is an error
                self._results = out
            return list(self._results)

    def error_for(self, index: int, err: int) -> errors.SfstoreOSError:
        op, fd, offset, length = self._described[index]
        return errors.os_error(
            err, f"kvikio {op} (fd={fd} offset={offset} length={length}) failed", self._names[index],
            errors.IOEngineError,
        )

    def transferred(self) -> tuple[int, int]:
        return (0, 0)


def _errno_of(exc: BaseException) -> int:
    err = getattr(exc, "errno", None)
    return int(err) if isinstance(err, int) and err > 0 else errno.EIO


def _span(buf: Any, offset: int, size: int) -> Any:
    """Bytes ``[offset, offset + size)`` of the GPU array ``buf`` as a flat uint8 view (``buf`` itself when that is
    all of it)."""
    flat = flat_bytes(buf)
    if offset == 0 and size == flat.shape[0]:
        return buf
    return flat[offset:offset + size]


class _KvikioFile(DeviceFile):
    def __init__(self, kvikio: Any, fd: int, full: str) -> None:
        # kvikio opens by name only: /proc/self/fd/N reopens the very inode this path's descriptor holds
        # (found beneath the root), never the caller's name again.
        try:
            self._f = kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
        except Exception as exc:  # kvikio raises RuntimeError for what open(2) or cuFile refuses
            raise errors.os_error(_errno_of(exc), f"kvikio cannot open the file ({exc})", full) from None
        preferred = getattr(self._f, "is_compat_mode_preferred", None)
        try:
            self.compat = bool(preferred()) if callable(preferred) else None
        except Exception:  # an older kvikio: it cannot say
            self.compat = None

    # kvikio's pread/pwrite take (buf, size, file_offset, task_size): no offset into the buffer, so a range at
    # an offset of it is passed as a view of those bytes (kvikio finds the allocation a view lies in itself)
    def pread(self, buf: Any, size: int, file_offset: int, buf_offset: int) -> TransferFuture:
        fut: TransferFuture = self._f.pread(_span(buf, buf_offset, size), size, file_offset)
        return fut

    def pwrite(self, buf: Any, size: int, file_offset: int, buf_offset: int) -> TransferFuture:
        fut: TransferFuture = self._f.pwrite(_span(buf, buf_offset, size), size, file_offset)
        return fut

    def close(self) -> None:
        self._f.close()


class CudaRuntime(DeviceRuntime):
    """torch CUDA tensors and cupy arrays; kvikio (cuFile) where installed."""

    name = "cuda"

    def __init__(self) -> None:
        self._mode: tuple[Route, str] | None = None
        self._kvikio: Any = None
        self._weights: dict[tuple[Any, int], Any] = {}

    def mode(self) -> tuple[Route, str]:
        if self._mode is None:
            self._mode = self._find_mode()
        return self._mode

    def _find_mode(self) -> tuple[Route, str]:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "staged", "no CUDA driver (libcuda.so.1): GPU arrays are staged through sfstore's pinned buffers"
        try:
            self._kvikio = importlib.import_module("kvikio")
        except Exception as exc:  # ImportError, or kvikio failing to load its libraries
            return "staged", (f"kvikio is not usable ({type(exc).__name__}: {exc}; pip install 'sfstore[gpu]'): "
                              "GPU arrays are staged through sfstore's pinned buffers")
        from sfstore.probe import probe_gds

        gds = probe_gds()
        compat = str(gds.get("kvikio", {}).get("compat_mode") or "").upper()
        if gds.get("status") == "ok" and compat not in ("ON", "TRUE"):
            return "gds", "cuFile and the nvidia-fs driver are there: GPU memory <-> storage with no host copy"
        return "compat", ("kvikio compat mode: " + str(gds.get("reason") or "cuFile is not available")
                          + " (kvikio bounces through host memory)")

    def is_device(self, buf: Any) -> bool:
        return is_device_buffer(buf)

    def nbytes(self, buf: Any) -> int:
        return device_nbytes(buf)

    def open(self, fd: int, full: str) -> DeviceFile:
        self.mode()
        if self._kvikio is None:
            raise errors.NotSupportedOnHostError("kvikio is not usable here: the device path stages GPU arrays")
        return _KvikioFile(self._kvikio, fd, full)

    def to_host(self, buf: Any, offset: int, dst: memoryview) -> None:
        copy_to_host(buf, offset, dst)

    def from_host(self, buf: Any, offset: int, src: memoryview) -> None:
        copy_from_host(buf, offset, src)

    def weighted_sum(self, buf: Any, offset: int, nbytes: int) -> int:
        return self.weighted_sums(buf, [offset], nbytes)[0]

    def weighted_sums(self, buf: Any, offsets: Sequence[int], nbytes: int) -> list[int]:
        # The slices stacked into one array (a copy in GPU memory, at its bandwidth) and summed by rows: one
        # kernel and one transfer of the answers, where a sum per slice waits on the GPU once per slice.
        flat = flat_bytes(buf)
        rows = [flat[o:o + nbytes] for o in offsets]
        if type(flat).__module__.startswith("torch"):
            import torch

            words = torch.stack(rows).view(torch.int64)  # two's complement: products and sums wrap as uint64's
            w = self._weight_row(words.device, words.shape[1])
            return [int(x) & _MASK for x in (words * w).sum(dim=1).tolist()]
        import cupy

        words = cupy.stack(rows).view(cupy.uint64)
        w = self._weight_row(words.device.id, words.shape[1])
        return [int(x) & _MASK for x in (words * w).sum(axis=1).tolist()]

    def _weight_row(self, device: Any, count: int) -> Any:
        """The weights ``1, 3, 5, ...`` of ``count`` words on ``device`` (kept: the same few sizes recur)."""
        key = (device, count)
        w = self._weights.get(key)
        if w is None:
            if isinstance(device, int):
                import cupy

                with cupy.cuda.Device(device):
                    w = cupy.arange(1, 2 * count, 2, dtype=cupy.uint64)
            else:
                import torch

                w = torch.arange(1, 2 * count, 2, dtype=torch.int64, device=device)
            self._weights[key] = w
        return w

    def scratch(self, like: Any, nbytes: int) -> Any:
        if type(like).__module__.startswith("torch"):
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        import cupy

        with cupy.cuda.Device(cupy.asarray(like).device.id):
            return cupy.empty(nbytes, dtype=cupy.uint8)

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> None:
        d, s = flat_bytes(dst), flat_bytes(src)
        d[dst_offset:dst_offset + nbytes] = s[src_offset:src_offset + nbytes]

    def copy_rows(self, dst: Any, dst_offset: int, dst_stride: int, src: Any, src_offset: int, src_stride: int,
                  row_bytes: int, rows: int) -> None:
        # one strided copy (one kernel) where a copy per row launches one each: a chunk of 16 blocks of 32
        # layers is 512 rows
        if rows <= 0:
            return
        d, s = flat_bytes(dst), flat_bytes(src)
        if type(d).__module__.startswith("torch"):
            dv = d[dst_offset:].as_strided((rows, row_bytes), (dst_stride, 1))
            sv = s[src_offset:].as_strided((rows, row_bytes), (src_stride, 1))
            dv.copy_(sv)
            return
        from cupy.lib.stride_tricks import as_strided

        dv = as_strided(d[dst_offset:], shape=(rows, row_bytes), strides=(dst_stride, 1))
        sv = as_strided(s[src_offset:], shape=(rows, row_bytes), strides=(src_stride, 1))
        dv[...] = sv

    def register(self, buf: Any) -> bool:
        self.mode()
        if self._kvikio is None or not self.is_device(buf):
            return False
        self._kvikio.memory_register(buf)
        return True

    def deregister(self, buf: Any) -> None:
        if self._kvikio is not None:
            self._kvikio.memory_deregister(buf)
