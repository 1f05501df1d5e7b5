"""The block path: a namespace (NVMe over RDMA on a cluster), a block device, or an image file.

A :class:`BlockPath` is a flat range of bytes addressed by offset, read and written through the I/O engine
with ``O_DIRECT`` at the target's logical block (LBA) size. It knows three kinds of target:

* ``nvmeof``: an NVMe-oF subsystem (``transport`` rdma | tcp | loop, ``traddr``, ``trsvcid``,
  ``subsysnqn``, ...), connected idempotently through libnvme (:func:`sfstore.nvme.connect`); the path then
  uses the controller's namespace block device;
* ``device``: a block device path (``/dev/nvme0n1``, a loop device);
* ``image``: a preallocated file (the embedded default, ``<data_dir>/hot/blocks.img``), so everything runs
  without NVMe.

Offsets and lengths of every request are multiples of :attr:`BlockPath.lba_size`; buffers are best
page-aligned (registered buffers are), else the engine bounces them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sfstore import defaults, errors
from sfstore.engine import IOEngine, Request, describe_engines, open_fd
from sfstore.paths.base import PathFuture, Range, StoragePath, check_batch, split_ranges
from sfstore.temp_names import temp_name

if TYPE_CHECKING:
    from sfstore.nvme import Controller, NvmeofTarget

__all__ = ["BlockPath"]

_BLKSSZGET = 0x1268  # logical sector size (int)
_BLKGETSIZE64 = 0x80081272  # size in bytes (u64)
_TARGET_KINDS = ("image", "device", "nvmeof")
_IMAGE_KEYS = {"kind", "path", "size"}
_DEVICE_KEYS = {"kind", "device"}


def _ioctl_int(fd: int, request: int, fmt: str) -> int:
    buf = bytearray(struct.calcsize(fmt))
    fcntl.ioctl(fd, request, buf)
    return int(struct.unpack(fmt, bytes(buf))[0])


class BlockPath(StoragePath):
    """A flat, LBA-addressed range of bytes on a namespace, a block device or an image file.

    Parameters
    ----------
    target : str, os.PathLike, Mapping or sfstore.nvme.NvmeofTarget
        A path (a block device, else an image file), a mapping with ``kind`` = ``"image"`` (``path``,
        ``size``), ``"device"`` (``device``) or ``"nvmeof"`` (the :class:`~sfstore.nvme.NvmeofTarget` keys),
        or an ``NvmeofTarget``.
    size : int, optional
        For an image file that does not exist yet: its size (default: the ``block_image_size`` setting).
        The file is preallocated, so writes never allocate and never hit ENOSPC.
    engine : IOEngine, optional
        Default: ``get_engine()`` (made on first use).
    direct : {"auto", "on", "off"}, optional
        ``O_DIRECT`` use (default: the ``direct_io`` setting). Block devices and NVMe namespaces support it;
        an image file on a filesystem without it falls back to the page cache, reported in ``fallbacks``.

    Notes
    -----
    Every request's offset and length must be multiples of :attr:`lba_size` and lie within
    :attr:`capacity` (:class:`~sfstore.errors.AlignmentError`, :class:`~sfstore.errors.InvalidRequestError`
    otherwise): O_DIRECT on a block device refuses anything else, and an image file is held to the same rule
    so that code tested on it runs unchanged on NVMe.
    """

    kind = "block"

    def __init__(
        self,
        target: str | os.PathLike[str] | Mapping[str, Any] | NvmeofTarget,
        *,
        size: int | None = None,
        engine: IOEngine | None = None,
        direct: str | bool | None = None,
    ) -> None:
        super().__init__()
        self._engine = engine
        self._lock = threading.Lock()
        self.controller: Controller | None = None  # for an NVMe-oF target
        self.target_kind, self.device, spec = self._resolve_target(target, size)
        self.target: dict[str, Any] = spec
        flags = os.O_RDWR
        if self.target_kind == "image" and not os.path.exists(self.device):
            self._create_image(self.device, spec["size"])
        self.is_block_device = stat.S_ISBLK(os.stat(self.device).st_mode)
        if self.is_block_device:
            flags |= os.O_EXCL  # EBUSY where the device is mounted or claimed exclusively elsewhere
        try:
            self.fd, self.direct = open_fd(self.device, flags, direct=direct)
        except errors.SfstoreOSError as exc:
            if exc.errno == errno.EBUSY:
                raise errors.StoreInUseError(
                    errno.EBUSY, f"{self.device} is in use (mounted, or opened exclusively elsewhere)", self.device
                ) from None
            raise
        try:
            self.lba_size, self.capacity = self._geometry()
        except BaseException:
            os.close(self.fd)
            raise
        # Bytes per request: a multiple of the LBA size (a split never leaves a misaligned piece).
        self.chunk_size = max(self.lba_size, (8 << 20) // self.lba_size * self.lba_size)
        if not self.direct:
            self.fallbacks.append(f"{self.device}: O_DIRECT refused or turned off; I/O goes through the page cache")

    # -- targets -----------------------------------------------------------------------------------------
    def _resolve_target(
        self, target: str | os.PathLike[str] | Mapping[str, Any] | NvmeofTarget, size: int | None
    ) -> tuple[str, str, dict[str, Any]]:
        if isinstance(target, Mapping):
            kind = target.get("kind")
            if kind == "nvmeof":
                from sfstore import nvme

                rest = {k: v for k, v in target.items() if k != "kind"}
                return self._connect(nvme.NvmeofTarget.from_mapping(rest, "block target"))
            if kind == "device":
                self._check_keys(target, _DEVICE_KEYS)
                dev = target.get("device")
                if not isinstance(dev, str) or not dev:
                    raise errors.ConfigError("block target: kind 'device' needs 'device' (a block device path)")
                return self._device(dev)
            if kind == "image":
                self._check_keys(target, _IMAGE_KEYS)
                path = target.get("path")
                if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                    raise errors.ConfigError("block target: kind 'image' needs 'path' (the image file)")
                return self._image(os.fspath(path), target.get("size", size))
            raise errors.ConfigError(
                f"block target: 'kind' must be one of {', '.join(_TARGET_KINDS)}, not {kind!r}"
            )
        if isinstance(target, (str, os.PathLike)):
            name = os.fspath(target)
            try:
                if stat.S_ISBLK(os.stat(name).st_mode):
                    return self._device(name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise errors.os_error(exc.errno or errno.EIO, f"cannot stat {name!r}", name) from None
            return self._image(name, size)
        if hasattr(target, "subsysnqn"):  # an sfstore.nvme.NvmeofTarget (imported only when one is used)
            return self._connect(target)
        raise errors.ConfigError(f"block target must be a path, a mapping or an NvmeofTarget, not {target!r}")

    @staticmethod
    def _check_keys(m: Mapping[str, Any], allowed: set[str]) -> None:
        unknown = set(m) - allowed
        if unknown:
            raise errors.ConfigError(
                f"block target: unknown key(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(allowed))}"
            )

    def _connect(self, target: NvmeofTarget) -> tuple[str, str, dict[str, Any]]:
        from sfstore import nvme

        ctrl = nvme.connect(target)
        if not ctrl.namespaces:
            raise errors.NotSupportedOnHostError(
                f"NVMe-oF controller {ctrl.name} ({target.subsysnqn}) has no namespace block device"
            )
        self.controller = ctrl
        ns = ctrl.namespaces[0]
        spec = {"kind": "nvmeof", "transport": target.transport, "traddr": target.traddr,
                "trsvcid": target.trsvcid, "subsysnqn": target.subsysnqn, "controller": ctrl.name,
                "namespace": ns.name}
        return "nvmeof", ns.device, spec

    @staticmethod
    def _device(dev: str) -> tuple[str, str, dict[str, Any]]:
        try:
            mode = os.stat(dev).st_mode
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.ENOENT, f"block device {dev!r}", dev) from None
        if not stat.S_ISBLK(mode):
            raise errors.ConfigError(f"block target: {dev!r} is not a block device (use kind 'image' for a file)")
        return "device", dev, {"kind": "device", "device": dev}

    @staticmethod
    def _image(path: str, size: object) -> tuple[str, str, dict[str, Any]]:
        if size is None:
            size = defaults.get("block_image_size")
        size = defaults.SETTINGS["block_image_size"].parse(size, "block image size")
        return "image", os.path.abspath(path), {"kind": "image", "path": os.path.abspath(path), "size": size}

    @staticmethod
    def _create_image(path: str, size: int) -> None:
        """Create the image file preallocated (``posix_fallocate``), atomically under its name."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path), "image"))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise errors.os_error(exc.errno or errno.EIO, f"cannot preallocate {size} bytes", path) from None
                os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, allocated on write
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _geometry(self) -> tuple[int, int]:
        if self.is_block_device:
            lba = _ioctl_int(self.fd, _BLKSSZGET, "i")
            capacity = _ioctl_int(self.fd, _BLKGETSIZE64, "Q")
        else:
            lba = 512
            if self.direct:
                from sfstore import _native

                lba = max(lba, int(_native.dio_alignment(self.fd)[1]))
            capacity = os.fstat(self.fd).st_size
        capacity -= capacity % lba
        return lba, capacity

    # -- capabilities --------------------------------------------------------------------------------------
    @property
    def transport(self) -> str:
        """``"rdma"`` or ``"tcp"`` for an NVMe-oF namespace, else ``"local"``."""
        t = self.target.get("transport")
        return t if t in ("rdma", "tcp") else "local"

    @property
    def supports_direct_io(self) -> bool:
        return self.direct

    def describe(self) -> dict[str, Any]:
        engines = describe_engines()
        fallbacks = list(self.fallbacks)
        if self.target_kind == "image":
            fallbacks.append("block target is an image file (no NVMe namespace configured)")
        if engines.get("selected") != "uring":
            fallbacks.append(f"I/O engine {engines.get('selected')}: {engines.get('why')}")
        return {
            "kind": self.kind,
            "target": dict(self.target),
            "device": self.device,
            "transport": self.transport,
            "lba_size": self.lba_size,
            "capacity": self.capacity,
            "direct_io": self.direct,
            "engine": engines.get("selected"),
            "fallbacks": fallbacks,
            "counters": self.counters.snapshot(),
        }

    # -- I/O ---------------------------------------------------------------------------------------------
    def check(self, offset: int, length: int) -> None:
        """Raise unless ``[offset, offset + length)`` is LBA-aligned and within the capacity."""
        lba = self.lba_size
        if offset < 0 or length < 0:
            raise errors.InvalidRequestError(f"{self.device}: negative offset {offset} or length {length}")
        if offset % lba or length % lba:
            raise errors.AlignmentError(
                f"{self.device}: offset {offset} and length {length} must be multiples of the LBA size {lba}"
            )
        if offset + length > self.capacity:
            raise errors.InvalidRequestError(
                f"{self.device}: [{offset}, {offset + length}) is beyond the capacity {self.capacity}"
            )

    def submit(
        self,
        ranges: Sequence[Range | tuple[str, int, int, Any, int]],
        *,
        checksums: Sequence[int | None] | None = None,
        data_class: str | None = None,
        check: bool = True,
    ) -> PathFuture:
        """Read or write ranges of the target (:class:`~sfstore.paths.base.Range`, or ``(op, offset, length,
        buffer, buffer_offset)`` tuples; ``file`` is unused: the target is this path's device) as one batch.

        Ranges longer than :attr:`chunk_size` are split into LBA-aligned requests. ``check=False`` skips the
        alignment and range checks and the splitting (for callers that computed the ranges from this path's
        geometry; one request per range).
        ``checksums``: per read, the xxh3-64 its bytes must have (or ``None``), checked where the read completes;
        a mismatch ends that range with ``-EBADMSG``. Host memory only. See :meth:`StoragePath.submit`.
        """
        if not check:
            # Ranges this path's own callers computed from its geometry (the block store's): the engine still
            # validates every request; only the path's checks are skipped.
            fd = self.fd
            reqs = [Request(r[0], fd, r[1], r[2], r[3], r[4]) for r in ranges]
            fut = self.engine.submit(reqs, checksums=checksums)
            return PathFuture(self, [(fut, list(range(len(reqs))), "host")], [r[0] for r in ranges],
                              data_class=data_class)
        batch, sums = check_batch(ranges, checksums)
        return self._start(batch, sums, data_class)

    def _start(self, batch: list[Range], checksums: list[int | None] | None, data_class: str | None) -> PathFuture:
        for r in batch:
            self.check(r.offset, r.length)
        self.refuse_device_buffers(batch)
        pieces, owner, sums = split_ranges(batch, self.chunk_size, checksums)
        reqs = [Request(p.op, self.fd, p.offset, p.length, p.buffer, p.buffer_offset) for p in pieces]
        fut = self.engine.submit(reqs, checksums=sums)
        return PathFuture(self, [(fut, owner, "host")], [r.op for r in batch], data_class=data_class)

    def read_into_async(self, offset: int, buffer: Any, length: int | None = None) -> PathFuture:
        """Read ``length`` bytes (default: the buffer's size) at ``offset`` into ``buffer``."""
        n = memoryview(buffer).nbytes if length is None else length
        return self.submit([("read", offset, n, buffer, 0)])

    def read_into(self, offset: int, buffer: Any, length: int | None = None) -> int:
        """Synchronous :meth:`read_into_async`; returns the bytes read."""
        return self.read_into_async(offset, buffer, length).get()[0]

    def write_async(self, offset: int, buffer: Any, length: int | None = None) -> PathFuture:
        """Write ``length`` bytes (default: the buffer's size) of ``buffer`` at ``offset``."""
        n = memoryview(buffer).nbytes if length is None else length
        return self.submit([("write", offset, n, buffer, 0)])

    def write(self, offset: int, buffer: Any, length: int | None = None) -> int:
        """Synchronous :meth:`write_async`; returns the bytes written (not durable until :meth:`flush`)."""
        return self.write_async(offset, buffer, length).get()[0]

    def flush(self) -> None:
        """Make every completed write durable (``fdatasync``: a FLUSH to the device's volatile cache)."""
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            self.counters.add(errors=1)
            raise errors.os_error(exc.errno or errno.EIO, "fdatasync failed", self.device) from None

    def close(self) -> None:
        """Close the descriptor (an NVMe-oF controller stays connected: others may use it)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # os.close is bound at definition: at interpreter exit the module's globals may already be None.
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            try:
                _close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return (f"BlockPath({self.device!r}, transport={self.transport!r}, lba={self.lba_size}, "
                f"capacity={self.capacity})")
