"""Registered buffers: page-aligned, pinned host memory that storage, RDMA NICs and GPUs can all reach.

A :class:`RegisteredBufferPool` hands out fixed-size buffers and takes them back LIFO (the buffer returned
last is the one still warm in cache and TLB). Each buffer is

* page-aligned (so it satisfies every O_DIRECT memory alignment), backed by 2 MiB huge pages when its size is
  a multiple of 2 MiB and the kernel gives them (hugetlbfs pages, else transparent huge pages are advised);
* ``mlock``-ed where ``RLIMIT_MEMLOCK`` allows (the probe and :meth:`RegisteredBufferPool.stats` say when it
  does not: an unlocked buffer still works, but the kernel may page it out and RDMA/CUDA must pin it again);
* registered with CUDA (``cuMemHostRegister``) where a driver exists, so GPU copies from it run at full speed;
* optionally registered with an RDMA protection domain (:meth:`RegisteredBuffer.register_rdma`).

Buffers export the buffer protocol and DLPack, so ``numpy.frombuffer(buf, np.uint8)``, ``np.from_dlpack(buf)``
and ``torch.from_dlpack(buf)`` are views of the same bytes, with no copy. A buffer goes back to its pool with
:meth:`RegisteredBuffer.release` (or at the end of a ``with`` block, or when it is garbage collected);
releasing it while such views are alive raises :class:`~sfstore.errors.BufferInUseError`.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sfstore import defaults
from sfstore.errors import InvalidRequestError, RegistrationError

__all__ = [
    "RegisteredBufferPool",
    "RegisteredBuffer",
    "RdmaRegistration",
    "as_buffer",
    "bytes_for_filling",
    "filled_bytes",
    "memory_capabilities",
    "free_page_reporting",
    "native_available",
    "gather",
    "scatter",
    "is_device_buffer",
    "device_nbytes",
    "flat_bytes",
    "copy_to_host",
    "copy_from_host",
]

try:
    from sfstore import _native

    _NATIVE_ERROR = ""
except ImportError as exc:  # the helper could not be built here: the pure-Python engine still works
    _native = None  # type: ignore[assignment]
    _NATIVE_ERROR = str(exc)

if TYPE_CHECKING:
    from sfstore._native import Buffer as RegisteredBuffer
elif _native is not None:
    RegisteredBuffer = _native.Buffer
else:
    RegisteredBuffer = None

_MODES = {"off": 0, "auto": 1, "on": 2}


def bytes_for_filling(n: int) -> tuple[bytes | bytearray, memoryview]:
    """A buffer of ``n`` bytes to read into, and a writable view of it.

    Where the native helper is built this is an uninitialised ``bytes`` (handed out without a copy once
    filled: see :func:`filled_bytes`), else a ``bytearray``.
    """
    try:
        from sfstore import _native
    except ImportError:
        buf = bytearray(n)
        return buf, memoryview(buf)
    return _native.bytes_for_filling(n)


def filled_bytes(data: bytes | bytearray, n: int) -> bytes:
    """The first ``n`` bytes of a buffer from :func:`bytes_for_filling` as ``bytes``: the buffer itself when it
    is ``bytes`` filled to its end, else a copy."""
    if isinstance(data, bytes) and len(data) == n:
        return data
    return bytes(memoryview(data)[:n])


def gather(out: Any, sources: Sequence[Any], offset: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``offset`` of each registered buffer in ``sources`` into ``out`` (writable memory of
    ``len(sources) * nbytes`` bytes), one after the other, in one call into the native helper with the GIL
    released (a layer of each of a load's blocks into one contiguous tensor)."""
    _native_module("gather").gather(out, sources, offset, nbytes)


def scatter(out: Any, sources: Sequence[Any], offset: int, out_offsets: Sequence[int], counts: Sequence[int],
            out_strides: Sequence[int], src_strides: Sequence[int], run: int) -> None:
    """Copy rows from each registered buffer in ``sources`` (from ``offset``) into strided places of ``out``: row
    ``j`` to ``out_offsets[j]``, as ``counts``/``out_strides``/``src_strides`` runs of ``run`` bytes, in one call
    into the native helper with the GIL released (a layer of a load's blocks straight into an engine's pages)."""
    _native_module("scatter").scatter(out, sources, offset, out_offsets, counts, out_strides, src_strides, run)


def _native_module(what: str) -> Any:
    if _native is None:
        from sfstore.errors import EngineUnavailableError

        raise EngineUnavailableError(f"{what} of registered buffers needs sfstore._native: {_NATIVE_ERROR}")
    return _native


def native_available() -> tuple[bool, str]:
    """Whether ``sfstore._native`` is importable, and if not, why."""
    return (_native is not None, _NATIVE_ERROR or "sfstore._native loaded")


class RegisteredBufferPool:
    """A pool of fixed-size registered host buffers, reused LIFO.

    Parameters
    ----------
    buffer_size : int, optional
        Bytes per buffer, within the ``buffer_size`` setting's range (4 KiB to 16 GiB); ``None`` (the default):
        ``defaults.get("buffer_size")``. ``0`` or a negative size is refused (it never meant the default).
        Multiples of 2 MiB can use huge pages.
    max_buffers : int, optional
        Most buffers the pool allocates (at least 1); :meth:`acquire` then waits for one to come back.
        ``None``: no limit.
    huge_pages, mlock, cuda_register : {"auto", "on", "off"}, optional
        Override the settings of the same names. ``"on"`` makes a refusal an error instead of a report.

    Notes
    -----
    Buffers are allocated lazily, on first :meth:`acquire`; allocation (``mmap`` + ``mlock`` + CUDA
    registration) costs far more than reuse, so keep a pool alive for the life of a job. Buffers of 128 MiB and
    more are faulted in at allocation by several threads (one per 64 MiB, up to the CPUs, at most 8): where the
    first touch of memory is slow (a VM with free page reporting), one thread would pay it all.
    """

    def __init__(
        self,
        buffer_size: int | None = None,
        *,
        max_buffers: int | None = None,
        huge_pages: str | None = None,
        mlock: str | None = None,
        cuda_register: str | None = None,
    ) -> None:
        if _native is None:
            from sfstore.errors import EngineUnavailableError

            raise EngineUnavailableError(f"registered buffers need sfstore._native: {_NATIVE_ERROR}")
        if buffer_size is None:
            self.buffer_size: int = int(defaults.get("buffer_size"))
        else:
            self.buffer_size = int(
                defaults.SETTINGS["buffer_size"].parse(buffer_size, "RegisteredBufferPool(buffer_size=...)")
            )
        if max_buffers is not None and (
            isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1
        ):
            from sfstore.errors import InvalidRequestError

            raise InvalidRequestError(
                f"RegisteredBufferPool: max_buffers must be an integer of at least 1, or None for no limit, "
                f"not {max_buffers!r}"
            )
        modes = {}
        for name, value in (("huge_pages", huge_pages), ("mlock", mlock), ("cuda_register", cuda_register)):
            setting = defaults.SETTINGS[name]
            modes[name] = _MODES[setting.parse(value, "RegisteredBufferPool") if value else defaults.get(name)]
        self._pool = _native.BufferPool(
            self.buffer_size,
            0 if max_buffers is None else max_buffers,
            huge=modes["huge_pages"],
            mlock=modes["mlock"],
            cuda=modes["cuda_register"],
        )

    def acquire(self, timeout: float | None = None) -> RegisteredBuffer:
        """Take a buffer (the most recently released first), allocating one if none is free.

        ``timeout`` is how long to wait for one when ``max_buffers`` are out: seconds (``0``: do not wait),
        ``None`` or ``inf``: wait forever.

        Raises
        ------
        sfstore.errors.PoolExhaustedError
            ``max_buffers`` are out and none came back within ``timeout`` seconds.
        sfstore.errors.InvalidRequestError
            ``timeout`` is negative, NaN or not a number.
        sfstore.errors.OutOfResourcesError
            The memory for a new buffer could not be had (``errno`` ENOMEM).
        """
        return self._pool.acquire(_acquire_timeout(timeout))

    def stats(self) -> dict[str, Any]:
        """Counters: ``allocated``, ``in_use``, ``free``, ``locked_bytes``, ``mlock_failures`` (with the last
        ``mlock_error``), ``hugetlb_buffers``, ``thp_buffers``, ``cuda_registered`` (with ``cuda_error``)."""
        return dict(self._pool.stats())

    def keep_idle(self, n: int | None) -> int:
        """Keep at most ``n`` idle buffers from now on (``None``: all of them, the default): the oldest idle
        ones beyond ``n`` are freed now, and a buffer released while ``n`` are idle is freed instead of kept.
        Returns the bytes freed now."""
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            from sfstore.errors import InvalidRequestError

            raise InvalidRequestError(f"keep_idle: n must be an integer >= 0 or None, not {n!r}")
        return int(self._pool.keep_idle(n))

    def close(self) -> None:
        """Free the idle buffers now; buffers still out are freed when released."""
        self._pool.close()

    def __enter__(self) -> RegisteredBufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _acquire_timeout(timeout: Any) -> float:
    """The native pool's wait: seconds, or ``-1.0`` for no end (``None``, ``inf``)."""
    if timeout is None:
        return -1.0
    from sfstore.errors import InvalidRequestError

    if isinstance(timeout, (bool, str, bytes)) or not hasattr(timeout, "__float__"):
        raise InvalidRequestError(f"acquire: timeout must be a number of seconds or None, not {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int beyond any float
        seconds = float("inf") if timeout > 0 else float("-inf")
    except (TypeError, ValueError):
        raise InvalidRequestError(f"acquire: timeout must be a number of seconds or None, not {timeout!r}") from None
    if math.isnan(seconds) or seconds < 0:
        raise InvalidRequestError(
            f"acquire: timeout must be >= 0 seconds, or None to wait without end, not {timeout!r}"
        )
    return -1.0 if math.isinf(seconds) else seconds


@dataclass
class RdmaRegistration:
    """A buffer registered as an RDMA memory region (pyverbs ``MR``); keep it while the NIC uses the memory."""

    mr: Any
    access: int
    address: int
    length: int

    @property
    def lkey(self) -> int:
        return int(self.mr.lkey)

    @property
    def rkey(self) -> int:
        return int(self.mr.rkey)

    def deregister(self) -> None:
        """Deregister the memory region (idempotent)."""
        if self.mr is not None:
            self.mr.close()
            self.mr = None

    def __enter__(self) -> RdmaRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.deregister()


def _register_rdma(buffer: RegisteredBuffer, pd: Any, access: int | None = None) -> RdmaRegistration:
    """Register ``buffer`` with the RDMA protection domain ``pd`` (pyverbs ``PD``).

    ``access`` defaults to the least a local data path needs, ``IBV_ACCESS_LOCAL_WRITE`` (the NIC may write
    received data into it); ask for remote read/write explicitly when a peer must reach this memory.
    Called as ``RegisteredBuffer.register_rdma(pd, access=None)``.
    """
    try:
        import pyverbs.enums as e
        from pyverbs.mr import MR
    except ImportError as exc:
        raise RegistrationError(0, f"RDMA registration needs pyverbs (rdma-core's python3-pyverbs): {exc}") from None
    acc = int(e.IBV_ACCESS_LOCAL_WRITE) if access is None else int(access)
    address, length = int(buffer.address), len(buffer)
    try:
        mr = MR(pd, length, acc, address=address)
    except Exception as exc:  # pyverbs raises PyverbsRDMAError / PyverbsError with the errno inside
        err = int(getattr(exc, "error_code", 0) or 0)
        raise RegistrationError(
            err, f"ibv_reg_mr of {length} bytes at {address:#x} with access {acc:#x} failed: {exc}"
        ) from exc
    return RdmaRegistration(mr=mr, access=acc, address=address, length=length)


def as_buffer(obj: Any) -> Any:
    """Return an object exporting the buffer protocol over the same bytes as ``obj`` (no copy).

    Buffer-protocol objects are returned as they are. CPU torch tensors (any dtype, contiguous) and other CPU
    DLPack producers are viewed as bytes through numpy. Anything else raises ``TypeError``.
    """
    try:
        memoryview(obj).release()
        return obj
    except TypeError:
        pass
    mod = type(obj).__module__ or ""
    if mod.startswith("torch"):
        t = obj.detach()
        if t.device.type != "cpu":
            raise TypeError(f"a {t.device.type} tensor has no host buffer; use a GPU path or copy it to the CPU")
        if not t.is_contiguous():
            raise TypeError("a non-contiguous tensor cannot be used as an I/O buffer")
        import torch

        return t.reshape(-1).view(torch.uint8).numpy()
    if hasattr(obj, "__dlpack__"):
        import numpy as np

        return np.from_dlpack(obj)
    raise TypeError(f"{type(obj).__name__} exports neither the buffer protocol nor DLPack")


_DL_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


def is_device_buffer(obj: Any) -> bool:
    """Whether ``obj`` lives in GPU memory (a CUDA torch tensor, a cupy array, any CUDA DLPack producer)."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    if type(obj).__module__.startswith("torch"):
        return bool(getattr(obj, "is_cuda", False))
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in _DL_CUDA_DEVICES
        except Exception:
            return False
    return False


def device_nbytes(obj: Any) -> int:
    """Size in bytes of a GPU buffer (torch CUDA tensor or cupy array)."""
    if type(obj).__module__.startswith("torch"):
        return int(obj.numel() * obj.element_size())
    return int(obj.nbytes)


def flat_bytes(buf: Any) -> Any:
    """``buf`` (a torch tensor or a cupy array, contiguous) as a flat uint8 view of its bytes, where it lives."""
    if type(buf).__module__.startswith("torch"):
        import torch

        return buf.detach().reshape(-1).view(torch.uint8)
    import cupy

    return cupy.asarray(buf).reshape(-1).view(cupy.uint8)


# The one copy between host memory and a tensor or array (GPU or not): the device path's runtime, the file path's
# bounce buffers and the KV cache's pinned slots all move GPU bytes through these two.
def copy_to_host(src: Any, src_offset: int, dst: Any) -> None:
    """Copy ``len(dst)`` bytes of the torch tensor or cupy array ``src`` from byte ``src_offset`` into the host
    buffer ``dst`` (synchronous; from a GPU at full speed when ``dst`` is page-locked). A non-contiguous torch
    tensor is copied whole (``src_offset`` 0)."""
    view = memoryview(dst).cast("B")
    n = view.nbytes
    if type(src).__module__.startswith("torch"):
        import torch

        t = src.detach()
        if not t.is_contiguous():
            if src_offset:
                raise InvalidRequestError("a part of a non-contiguous tensor cannot be copied out")
            t = t.contiguous()
        torch.frombuffer(view, dtype=torch.uint8, count=n).copy_(flat_bytes(t)[src_offset:src_offset + n])
        return
    import numpy as np

    flat_bytes(src)[src_offset:src_offset + n].get(out=np.frombuffer(view, np.uint8))


def copy_from_host(dst: Any, dst_offset: int, src: Any) -> None:
    """Copy the host bytes ``src`` into the torch tensor or cupy array ``dst`` at byte ``dst_offset`` (synchronous;
    to a GPU at full speed when ``src`` is page-locked). A non-contiguous torch tensor is filled whole
    (``dst_offset`` 0, ``src`` its size); a tensor that requires grad is still just memory to fill."""
    view = memoryview(src).cast("B")
    n = view.nbytes
    if type(dst).__module__.startswith("torch"):
        import torch

        if view.readonly:  # torch views only writable memory (it is only read here; the copy is for a bytes object)
            view = memoryview(bytearray(view))
        flat = torch.frombuffer(view, dtype=torch.uint8, count=n) if n else torch.empty(0, dtype=torch.uint8)
        with torch.no_grad():
            if dst.is_contiguous():
                dst.reshape(-1).view(torch.uint8)[dst_offset:dst_offset + n].copy_(flat)
            elif dst_offset == 0 and n == dst.numel() * dst.element_size():
                dst.copy_(flat.view(dst.dtype).view(dst.shape))
            else:
                raise InvalidRequestError("a part of a non-contiguous tensor cannot be filled")
        return
    import numpy as np

    flat_bytes(dst)[dst_offset:dst_offset + n].set(np.frombuffer(view, np.uint8))


def _read_meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_VIRTIO_BALLOON_F_REPORTING = 5


def free_page_reporting(sysfs: str = "/sys/bus/virtio/drivers/virtio_balloon") -> dict[str, Any]:
    """Whether this (virtual) machine hands free memory back to its host (virtio-balloon free page reporting).

    Where it does, blocks of 2 MiB and more that stay free a moment are given back to the host, and the first
    touch of memory allocated from them stalls on the host (the checkpoint suite's load cases show the cost).
    Huge-page buffers draw exactly on such blocks, so large fresh buffers (a checkpoint load's) cost more there
    than memory freed a moment ago. Read from the balloon device's negotiated feature bits.
    """
    try:
        devices = sorted(d for d in os.listdir(sysfs) if d.startswith("virtio"))
    except OSError:
        return {"on": False, "reason": "no virtio-balloon device"}
    for dev in devices:
        try:
            with open(os.path.join(sysfs, dev, "features")) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return {"on": True, "reason": f"virtio-balloon ({dev}) reports free pages to the host: the first touch "
                                          "of fresh memory, huge pages above all, can stall on host faults"}
    return {"on": False, "reason": f"virtio-balloon ({', '.join(devices) or 'no device'}) without free page reporting"}


def memory_capabilities() -> dict[str, Any]:
    """What this host allows for registered buffers: mlock (and ``RLIMIT_MEMLOCK``), huge pages, CUDA, and
    whether a virtual machine's free memory goes back to its host (:func:`free_page_reporting`).

    Tries one real 2 MiB pool buffer, so the answers are what the pool will get, not guesses.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else int(soft)
    out: dict[str, Any] = {"memlock_limit": limit, "free_page_reporting": free_page_reporting()}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unavailable"
    hugetlb_free = _read_meminfo("HugePages_Free") or 0
    if _native is None:
        reason = f"native helper not built: {_NATIVE_ERROR}"
        out["mlock"] = {"ok": False, "reason": reason}
        out["huge_pages"] = {"ok": False, "hugetlb_free": hugetlb_free, "thp": thp, "reason": reason}
        out["cuda_register"] = {"ok": False, "reason": reason}
        return out
    pool = _native.BufferPool(2 << 20, 1, huge=1, mlock=1, cuda=0)
    buf = pool.acquire(-1.0)
    stats = pool.stats()
    locked, huge = buf.locked, buf.huge_pages
    buf.release()
    pool.close()
    limit_text = "unlimited" if limit is None else f"{limit // 1024} KiB"
    out["mlock"] = {
        "ok": locked,
        "reason": f"mlock works (RLIMIT_MEMLOCK {limit_text})"
        if locked
        else f"{stats['mlock_error']}; RLIMIT_MEMLOCK is {limit_text}: buffers work unpinned",
    }
    if stats["hugetlb_buffers"]:
        why = f"hugetlbfs pages ({hugetlb_free} free)"
    elif huge:
        why = f"no hugetlbfs pages reserved; transparent huge pages advised (THP: {thp})"
    else:
        why = f"no huge pages: {stats['hugetlb_error'] or 'not given'} (THP: {thp})"
    out["huge_pages"] = {"ok": bool(huge), "hugetlb_free": hugetlb_free, "thp": thp, "reason": why}
    ok, why = _native.cuda_status()
    out["cuda_register"] = {"ok": ok, "reason": why if ok else f"{why} (registration is a no-op)"}
    return out
