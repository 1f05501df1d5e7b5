"""The device path: GPU memory to and from storage, GPU-direct (cuFile/GDS through kvikio) where the target allows.

A :class:`DevicePath` moves :class:`~sfstore.paths.base.Range` batches between buffers and open files: the KV
cache's shared-tier files (NFS over RDMA on a cluster), slab files under its root, a block store's device. Each
GPU range takes one of three **routes**, chosen per target and reported (:meth:`DevicePath.describe`,
``sfstore probe``, the counters ``bytes_gpu_direct`` / ``bytes_staged``):

``gds``
    cuFile moves the bytes between GPU memory and storage with no host copy. Needs cuFile and a target it
    accepts (:func:`cufile_accepts`): a regular file on ext4/XFS (ordered data) on NVMe or NVMe-oF, on NFS over
    RDMA, or on a GDS-enabled parallel filesystem. cuFile refuses anything that is not a regular file
    (``CU_FILE_IO_NOT_SUPPORTED``), so a raw NVMe or NVMe-oF namespace never goes this way.
``compat``
    kvikio moves them through its own host bounce buffers (kvikio is there, cuFile is not or refuses the target).
``staged``
    sfstore's pinned (registered) staging buffers and I/O engine, with O_DIRECT where the target allows
    (no kvikio, or no CUDA driver).

Host buffers always go through the I/O engine, as on the file path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

from sfstore import errors
from sfstore.buffers import RegisteredBufferPool, as_buffer
from sfstore.engine import IOEngine, Request
from sfstore.futures import Future, MappedFuture
from sfstore.mounts import mount_for
from sfstore.paths.base import Leg, PathFuture, Range, StoragePath, descriptor_of, split_ranges
from sfstore.paths.device_runtime import CudaRuntime, DeviceFile, DeviceRuntime, KvikioLeg, Route, TransferFuture
from sfstore.paths.file import FilePath, enable_direct

__all__ = ["DevicePath", "TargetFacts", "cufile_accepts", "choose_route", "device_mode", "ROUTES"]

ROUTES = ("gds", "compat", "staged")
_MODES = ("auto", "gds", "compat", "staged")
_ROUTE_OF: dict[str, Route] = {"gds": "gds", "compat": "compat", "staged": "staged"}
_STAGE = 8 << 20  # bytes per pinned staging buffer
_GDS_LOCAL_FS = ("ext4", "xfs")
_GDS_PARALLEL_FS = ("lustre", "wekafs", "gpfs", "beegfs", "fuse.wekafs")
# one kind of kvikio transfer in a batch: (futures, (op, fd, offset, length) each, names, range indexes)
_KvikioSide: TypeAlias = tuple[list[TransferFuture | None], list[tuple[str, int, int, int]], list[str], list[int]]


def device_mode() -> tuple[Route, str]:
    """``(mode, why)`` of this host: ``gds`` (cuFile + nvidia-fs), ``compat`` (kvikio through host memory) or
    ``staged`` (sfstore's pinned buffers)."""
    return CudaRuntime().mode()


@dataclass(frozen=True)
class TargetFacts:
    """What a target is, as far as cuFile cares: a regular file on a filesystem, or a block device."""

    kind: str  # "file" | "block"
    name: str
    fstype: str = ""
    source: str = ""
    transport: str = "local"  # NFS: "rdma" | "tcp"
    data_mode: str = ""  # ext4's data= option ("ordered" where not given)

    @classmethod
    def of_fd(cls, fd: int, name: str) -> TargetFacts:
        """The facts of the open descriptor ``fd`` (its mount from the mount table)."""
        st = os.fstat(fd)
        if stat.S_ISBLK(st.st_mode):
            return cls("block", name, source=name)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = name
        try:
            m = mount_for(real)
        except (OSError, errors.SfstoreError):
            return cls("file", name)
        transport = (m.option("proto") or "tcp") if m.is_nfs else "local"
        data = m.option("data") or ("ordered" if m.fstype == "ext4" else "")
        return cls("file", name, m.fstype, m.source, "rdma" if transport.startswith("rdma") else transport, data)


def cufile_accepts(t: TargetFacts) -> tuple[bool, str]:
    """Whether cuFile takes this target GPU-direct, and why (or why not).

    From NVIDIA's GDS documentation: cuFile registers regular files only; it supports ext4 (``data=ordered``)
    and XFS on NVMe / NVMe-oF devices, NFS over RDMA, and parallel filesystems built for it (Lustre, WekaFS,
    GPFS, BeeGFS).
    """
    if t.kind == "block":
        return False, (f"{t.name} is a block device: cuFile takes regular files only (CU_FILE_IO_NOT_SUPPORTED), "
                       "so a raw NVMe or NVMe-oF namespace is not GPU-direct")
    if t.fstype in ("nfs", "nfs4"):
        if t.transport == "rdma":
            return True, f"NFS over RDMA ({t.source}): cuFile reads and writes GPU memory over RDMA"
        return False, f"NFS over {t.transport} ({t.source}): cuFile needs NFS over RDMA"
    if t.fstype in _GDS_LOCAL_FS:
        if t.fstype == "ext4" and t.data_mode not in ("", "ordered"):
            return False, f"ext4 with data={t.data_mode} at {t.source}: cuFile needs data=ordered"
        if os.path.basename(t.source).startswith("nvme"):
            return True, f"{t.fstype} on {t.source}: cuFile DMA between the NVMe device and GPU memory"
        return False, f"{t.fstype} on {t.source or 'an unknown device'}: cuFile needs it on NVMe or NVMe-oF"
    if t.fstype in _GDS_PARALLEL_FS:
        return True, f"{t.fstype}: a GDS-enabled filesystem"
    return False, f"{t.fstype or 'an unknown filesystem'} ({t.source}): not a filesystem cuFile supports"


def choose_route(mode: Route, mode_why: str, target: TargetFacts) -> tuple[Route, str]:
    """The route GPU ranges to ``target`` take on a host in ``mode``, and why: ``gds`` where cuFile is there and
    accepts the target, ``compat`` where kvikio is there, ``staged`` otherwise."""
    if mode == "staged":
        return "staged", mode_why
    if mode == "gds":
        ok, why = cufile_accepts(target)
        if ok:
            return "gds", why
        return "compat", f"{why}; kvikio's compat mode moves it through host memory"
    return "compat", mode_why


def _route_key(st: os.stat_result) -> tuple[int, int]:
    """What a route depends on: the filesystem of a regular file (its device), or the block device itself."""
    return (-1, st.st_rdev) if stat.S_ISBLK(st.st_mode) else (st.st_dev, 0)


def _close_handles(opened: list[tuple[int, DeviceFile]]) -> None:
    for mine, handle in opened:
        try:
            handle.close()
        finally:
            os.close(mine)
    opened.clear()


class _StagedLeg:
    """GPU ranges through pinned staging buffers and the engine, run on the device path's staging thread."""

    def __init__(self, path: DevicePath, pieces: list[Range], fds: list[int]) -> None:
        self._pieces = pieces
        self._described = [(p.op, fd, p.offset, p.length) for p, fd in zip(pieces, fds, strict=True)]
        self._moved = [0, 0]
        self._errors: dict[int, errors.SfstoreOSError] = {}
        self._future = path._stager().submit(self._run, path, fds)

    def _run(self, path: DevicePath, fds: list[int]) -> list[int]:
        rt, engine, pool = path.runtime, path.engine, path._staging_pool()
        out: list[int] = []
        buf = pool.acquire()
        try:
            view = memoryview(buf)
            for j, (p, fd) in enumerate(zip(self._pieces, fds, strict=True)):
                done = 0
                try:
                    while done < p.length:
                        k = min(_STAGE, p.length - done)
                        part = view[:k]
                        if p.op == "write":
                            rt.to_host(p.buffer, p.buffer_offset + done, part)
                            fut = engine.submit([Request.write(fd, p.offset + done, k, buf)])
                        else:
                            fut = engine.submit([Request.read(fd, p.offset + done, k, buf)])
                        got = fut.get()[0]
                        d, b = fut.transferred()
                        self._moved[0] += d
                        self._moved[1] += b
                        if p.op == "read" and got:
                            rt.from_host(p.buffer, p.buffer_offset + done, view[:got])
                        done += got
                        if got < k:
                            break
                    out.append(done)
                except errors.SfstoreOSError as exc:
                    self._errors[j] = exc
                    out.append(-(exc.errno or errno.EIO))
            del part, view
        finally:
            buf.release()
        return out

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return True

    def results(self, timeout: float | None = None) -> list[int]:
        if not self.wait(timeout):
            raise errors.IOTimeoutError(f"staged GPU transfers had not finished after {timeout} s")
        return list(self._future.result())

    def error_for(self, index: int, err: int) -> errors.SfstoreOSError:
        found = self._errors.get(index)
        if found is not None:
            return found
        op, fd, offset, length = self._described[index]
        return errors.os_error(err, f"staged {op} (fd={fd} offset={offset} length={length}) failed", None,
                               errors.IOEngineError)

    def transferred(self) -> tuple[int, int]:
        return (self._moved[0], self._moved[1])


class DevicePath(StoragePath):
    """GPU (and host) buffers to and from open files, GPU-direct where the target allows (see the module).

    Parameters
    ----------
    root : str or os.PathLike, optional
        A directory of slab files (:meth:`slab`, :meth:`write`, :meth:`read_into`; paths confined to it as on
        the file path). Without one, only :meth:`submit` on descriptors the caller opened.
    mode : {"auto", "gds", "compat", "staged"}
        ``auto`` takes what the runtime finds; asking for ``gds`` or ``compat`` where it is not there raises
        :class:`~sfstore.errors.NotSupportedOnHostError`. ``staged`` (also ``host``) always stages.
    runtime : DeviceRuntime, optional
        What moves GPU bytes (default :class:`~sfstore.paths.device_runtime.CudaRuntime`).
    engine : IOEngine, optional
        For host buffers and the staged route (default: ``get_engine()``).

    Notes
    -----
    For full speed, offsets and sizes should be multiples of 4096 and GPU buffers reused for many transfers
    registered once with :meth:`register` (``cuFileBufRegister``). ``supports_device_buffers`` is true on every
    route: :attr:`route_for` says whether a target's GPU bytes go without a host copy.
    """

    kind = "device"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        mode: str = "auto",
        runtime: DeviceRuntime | None = None,
        engine: IOEngine | None = None,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise errors.ConfigError(f"DevicePath mode must be one of {', '.join(_MODES)}, not {mode!r}")
        self.runtime = runtime or CudaRuntime()
        found, why = self.runtime.mode()
        rank: dict[Route, int] = {"staged": 0, "compat": 1, "gds": 2}
        asked: Route = found if mode == "auto" else _ROUTE_OF[mode]
        if rank[asked] > rank[found]:
            raise errors.NotSupportedOnHostError(f"device path mode {mode!r} is not available here: {why}")
        self.mode: Route = asked
        self.why = why if mode in ("auto", found) else f"mode {mode!r} asked for ({found} is there: {why})"
        if self.mode != "gds":
            self.fallbacks.append(f"device path {self.mode}: {self.why}")
        self.fp: FilePath | None = FilePath(root) if root is not None else None
        self._engine = engine
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._files: dict[tuple[int, int], tuple[int, DeviceFile]] = {}  # (dev, ino) -> (our dup, kvikio handle)
        self._routes: dict[tuple[int, int], tuple[Route, str, str]] = {}  # (dev, ino) -> (route, why, name)
        self._stage: RegisteredBufferPool | None = None
        self._stage_pool: ThreadPoolExecutor | None = None
        self._registered: dict[int, Any] = {}

    # -- what it is --------------------------------------------------------------------------------------------
    @property
    def transport(self) -> str:
        return self.fp.transport if self.fp is not None else "local"

    @property
    def supports_direct_io(self) -> bool:
        return self.fp.supports_direct_io if self.fp is not None else True

    @property
    def supports_device_buffers(self) -> bool:
        return True

    def route_for(self, fd: int, name: str = "") -> tuple[Route, str]:
        """``(route, why)`` of GPU ranges to the open file ``fd`` (decided once per file, then remembered)."""
        key = _route_key(os.fstat(fd))
        with self._lock:
            got = self._routes.get(key)
        if got is not None:
            return got[0], got[1]
        facts = TargetFacts.of_fd(fd, name or f"fd {fd}")
        route, why = choose_route(self.mode, self.why, facts)
        with self._lock:
            self._routes.setdefault(key, (route, why, facts.name if facts.kind == "block" else facts.fstype))
        return route, why

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = self.fp.describe() if self.fp is not None else {"transport": "local", "fallbacks": []}
        mine = self.counters.snapshot()
        counters = {k: mine.get(k, 0) + int(d.get("counters", {}).get(k, 0)) for k in mine}
        root_route: dict[str, str] | None = None
        if self.fp is not None:  # the route GPU ranges to files under the root take (the KV shared tier's)
            route, why = self.route_for(self.fp.beneath.root_fd(), self.fp.root)
            root_route = {"route": route, "why": why}
        with self._lock:
            routes = [{"target": name, "route": r, "why": w} for r, w, name in self._routes.values()]
        return {**d, "kind": self.kind, "root_route": root_route, "mode": self.mode, "why": self.why,
                "runtime": self.runtime.name,
                "supports_device_buffers": True, "gpu_direct": self.mode == "gds", "routes": routes,
                "fallbacks": list(self.fallbacks) + list(d.get("fallbacks", [])), "counters": counters,
                "by_class": self.counters.by_class()}

    # -- the data seam -----------------------------------------------------------------------------------------
    def _start(self, batch: list[Range], sums: list[int | None] | None, data_class: str | None) -> PathFuture:
        """Move ranges of open files (``Range.file``: a descriptor) to or from host or GPU buffers, as one batch.

        Host ranges go through the I/O engine (split into 8 MiB requests; ``checksums``: xxh3-64 per host read).
        GPU ranges take their target's route (:meth:`route_for`): kvikio for ``gds`` and ``compat`` (counted in
        ``bytes_gpu_direct`` where cuFile kept them off host memory, else ``bytes_staged``), sfstore's pinned
        staging for ``staged`` (``bytes_staged``). A GPU read is whole or an error: a short one fails with EIO."""
        host: list[int] = []
        by_route: dict[str, list[int]] = {r: [] for r in ROUTES}
        fds: list[int] = []
        for i, r in enumerate(batch):
            fd = descriptor_of(r.file, i)
            fds.append(fd)
            if not self.runtime.is_device(r.buffer):
                host.append(i)
                continue
            if sums is not None and sums[i] is not None:
                raise errors.InvalidRequestError(f"range {i}: xxh3 checksums are checked on host reads only")
            end = r.buffer_offset + r.length
            if end > self.runtime.nbytes(r.buffer):
                raise errors.BufferTooSmallError(
                    f"range {i}: a GPU buffer of {self.runtime.nbytes(r.buffer)} bytes cannot hold {r.length} bytes "
                    f"at buffer_offset {r.buffer_offset}"
                )
            by_route[self.route_for(fd)[0]].append(i)
        legs: list[tuple[Leg, list[int], str]] = []
        if host:
            pieces, owner, piece_sums = split_ranges([batch[i] for i in host], _STAGE,
                                                     [sums[i] for i in host] if sums is not None else None)
            reqs = [Request(p.op, fds[host[owner[j]]], p.offset, p.length, p.buffer, p.buffer_offset)
                    for j, p in enumerate(pieces)]
            legs.append((self.engine.submit(reqs, checksums=piece_sums), [host[o] for o in owner], "host"))
        opened: list[tuple[int, DeviceFile]] = []  # handles made for this batch only, closed once it finished
        for route in ("gds", "compat"):
            if by_route[route]:
                try:
                    legs.extend(self._kvikio_legs([(i, batch[i], fds[i]) for i in by_route[route]], route, opened))
                except BaseException:
                    _close_handles(opened)
                    raise
        if by_route["staged"]:
            idx = by_route["staged"]
            legs.append((_StagedLeg(self, [batch[i] for i in idx], [fds[i] for i in idx]), idx, "staged"))
        release = (lambda: _close_handles(opened)) if opened else None
        return PathFuture(self, legs, [r.op for r in batch], data_class=data_class, release=release)

    def _kvikio_legs(self, items: list[tuple[int, Range, int]], route: str,
                     opened: list[tuple[int, DeviceFile]]) -> list[tuple[Leg, list[int], str]]:
        """kvikio transfers of ``items``: GPU-direct on the ``gds`` route unless kvikio chose compat mode for
        the file; through kvikio's host buffers (counted staged) otherwise."""
        direct: _KvikioSide = ([], [], [], [])
        staged: _KvikioSide = ([], [], [], [])
        for i, r, fd in items:
            handle = self._device_file(fd, opened)
            side = staged if handle.compat or route != "gds" else direct
            start = handle.pwrite if r.op == "write" else handle.pread
            side[0].append(start(r.buffer, r.length, r.offset, r.buffer_offset) if r.length else None)
            side[1].append((r.op, fd, r.offset, r.length))
            side[2].append(f"/proc/self/fd/{fd}")
            side[3].append(i)
        legs: list[tuple[Leg, list[int], str]] = []
        for futures, described, names, owner in (direct, staged):
            if futures:
                kind = "gpu_direct" if futures is direct[0] else "staged"
                legs.append((KvikioLeg(futures, described, names), owner, kind))
        return legs

    def _device_file(self, fd: int, opened: list[tuple[int, DeviceFile]]) -> DeviceFile:
        """The kvikio handle of ``fd``: kept for block devices and this path's slab files (used again and again,
        registered once); for other files (a KV shared-tier block, read or written once) made for this batch and
        added to ``opened``, closed when the batch has finished."""
        st = os.fstat(fd)
        keep = stat.S_ISBLK(st.st_mode) or fd in self._fds.values()
        key = (st.st_dev, st.st_ino) if not stat.S_ISBLK(st.st_mode) else (-1, st.st_rdev)
        if keep:
            with self._lock:
                got = self._files.get(key)
                if got is not None:
                    return got[1]
        # Our own open file description of the inode (through /proc/self/fd/N: a new description, so it shares
        # no file lock with the caller's, e.g. the block store's) keeps the name valid for the handle's life,
        # whatever the caller closes.
        try:
            mine = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, f"cannot reopen fd {fd} for kvikio", None) from None
        try:
            handle = self.runtime.open(mine, f"fd {fd}")
        except BaseException:
            os.close(mine)
            raise
        if handle.compat and self.mode == "gds":
            with self._lock:
                rkey = _route_key(st)
                self._routes[rkey] = ("compat", "kvikio chose its compat mode for this file (cuFile refused it)",
                                      self._routes.get(rkey, ("", "", f"fd {fd}"))[2])
        if not keep:
            opened.append((mine, handle))
            return handle
        with self._lock:
            if key in self._files:  # another thread opened it meanwhile
                handle.close()
                os.close(mine)
                return self._files[key][1]
            self._files[key] = (mine, handle)
        return handle

    def _stager(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._stage_pool is None:
                self._stage_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sfstore-device-stage")
            return self._stage_pool

    def _staging_pool(self) -> RegisteredBufferPool:
        with self._lock:
            if self._stage is None:
                self._stage = RegisteredBufferPool(_STAGE)
            return self._stage

    # -- staging a face does through host memory ------------------------------------------------------------------
    def stage_to_gpu(self, dst: Any, offset: int, src: memoryview, data_class: str | None = None) -> None:
        """Copy host bytes a face has verified (``src``) into GPU ``dst`` at byte ``offset``, counted as
        ``bytes_staged`` (under ``data_class`` too): the one host-to-GPU copy of faces that read into host
        memory first (a block store's slots, files of host-put blocks)."""
        self.runtime.from_host(dst, offset, src)
        self.counters.add_for(data_class, bytes_staged=src.nbytes)

    def stage_to_host(self, src: Any, offset: int, dst: memoryview, data_class: str | None = None) -> None:
        """Copy ``dst.nbytes`` bytes of GPU ``src`` from byte ``offset`` into host ``dst``, counted as
        ``bytes_staged`` (a face that writes GPU blocks from host memory: a deadline must never see it read
        GPU memory the caller has got back)."""
        self.runtime.to_host(src, offset, dst)
        self.counters.add_for(data_class, bytes_staged=dst.nbytes)

    # -- registration ----------------------------------------------------------------------------------------
    def register(self, array: Any) -> bool:
        """Register a GPU array with cuFile for repeated transfers (once; a no-op outside ``gds``); whether it
        is registered now."""
        if self.mode != "gds" or not self.runtime.is_device(array):
            return False
        with self._lock:
            if id(array) in self._registered:
                return True
        if self.runtime.register(array):
            with self._lock:
                self._registered[id(array)] = array
            return True
        return False

    def deregister(self, array: Any) -> None:
        with self._lock:
            found = self._registered.pop(id(array), None)
        if found is not None:
            self.runtime.deregister(found)

    # -- slab files under the root -------------------------------------------------------------------------------
    def _root(self) -> FilePath:
        if self.fp is None:
            raise errors.InvalidRequestError("this device path has no root: slab files need DevicePath(root)")
        return self.fp

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
        fp = self._root()
        full = fp.full(path)
        flags = os.O_RDWR | os.O_NONBLOCK | (os.O_CREAT if create else 0)
        try:
            parents = fp.beneath.parts(path)[:-1]
            if create and parents:
                fp.beneath.mkdir("/".join(parents), parents=True, exist_ok=True)
            fd = fp.beneath.open(path, flags, 0o644)
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
        full = self._root().full(path)
        with self._lock:
            got = self._fds.get(full)
        if got is None:
            fd, _ = self._open(path, create=create)
            enable_direct(fd, full, required=False)
            with self._lock:
                if full in self._fds:
                    os.close(fd)
                else:
                    self._fds[full] = fd
                got = self._fds[full]
        return got, full

    def write_async(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> Future[int]:
        """Write all of ``array`` into the slab file ``path`` at ``offset`` (created if missing)."""
        return self._io(path, array, offset, write=True)

    def write(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> int:
        return self.write_async(path, array, offset).get()

    def read_into_async(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> Future[int]:
        """Fill ``array`` from the slab file ``path`` at ``offset``; a short file raises (nothing is half-filled
        silently)."""
        return self._io(path, array, offset, write=False)

    def read_into(self, path: str | os.PathLike[str], array: Any, offset: int = 0) -> int:
        return self.read_into_async(path, array, offset).get()

    def _io(self, path: str | os.PathLike[str], array: Any, offset: int, write: bool) -> Future[int]:
        if offset < 0:
            raise errors.InvalidRequestError(f"negative offset {offset}")
        if self.runtime.is_device(array):
            buf, n = array, self.runtime.nbytes(array)
        else:
            buf = memoryview(as_buffer(array)).cast("B")
            if not write and buf.readonly:
                raise errors.ReadOnlyBufferError("read_into: the destination array is read-only")
            n = buf.nbytes
        fd, full = self._fd(path, create=write)
        op = "write" if write else "read"
        fut = self.submit([Range(op, offset, n, buf, 0, fd)])

        def whole(got: list[int]) -> int:
            if got[0] != n:
                raise errors.os_error(errno.EIO, f"short {op}: {got[0]} of {n} bytes", full)
            return got[0]

        return MappedFuture(fut, whole)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            files, self._files = list(self._files.values()), {}
            registered, self._registered = list(self._registered.values()), {}
            pool, self._stage_pool = self._stage_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in fds:
            os.close(fd)
        for mine, handle in files:
            handle.close()
            os.close(mine)
        for arr in registered:
            self.runtime.deregister(arr)
        if self._stage is not None:
            self._stage.close()
