"""FilePath: a directory on a mount — NFS over RDMA on a cluster, any POSIX filesystem elsewhere.

The mount under the root decides how data moves. ``/proc/self/mountinfo`` says whether it is NFS (v3/v4.x)
with ``proto=rdma`` (the direct path) or ``proto=tcp``, with which ``rsize``/``wsize``/``nconnect``, or a local
filesystem; the chunk size and the number of chunks in flight follow from it (and can be set). Large files
move as parallel aligned chunks through the I/O engine straight into the caller's buffer; many small files
move in one pipelined batch (open, read, close overlap); whole-file writes are published atomically (written to
a temporary name in the same directory, fsynced when asked, renamed into place).

Paths are relative to the root (``"a/b.bin"``); an absolute path is accepted only inside the root. ``..``
that climbs out, absolute paths elsewhere and symlinks that point out are refused with
:class:`~sfstore.errors.PathEscapeError` (a ``PermissionError``). Every operation resolves its name beneath the
root through :class:`~sfstore.paths.beneath.Beneath` (the parent directory opened beneath the root, the last
component acted on relative to it), so a directory swapped for a symlink to elsewhere while an operation runs
makes it fail, never act outside; symlinks that stay inside the root are followed.

Only regular files are read: a FIFO, socket or device is opened without blocking and refused with
:class:`~sfstore.errors.NotARegularFileError`, a directory with :class:`~sfstore.errors.IsADirectoryPathError`.

Alignment and performance: O_DIRECT moves data without a page-cache copy when the caller's buffer is aligned
to the filesystem's O_DIRECT memory alignment (registered buffers always are; ``numpy`` arrays usually are
not); a misaligned buffer still works, through the engine's bounce buffers, at the cost of one copy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sfstore import defaults, errors
from sfstore.buffers import as_buffer, bytes_for_filling, filled_bytes, is_device_buffer
from sfstore.engine import IOEngine, Request, describe_engines, get_engine
from sfstore.environment import validate_environment
from sfstore.futures import DoneFuture, Future, MappedFuture
from sfstore.mounts import MountInfo, mount_for
from sfstore.paths.base import PathFuture, Range, StoragePath, check_batch, descriptor_of, split_ranges
from sfstore.paths.beneath import Beneath, Location, open_at, open_many_at, stat_many_at
from sfstore.temp_names import is_leftover, temp_name
from sfstore.temp_names import parse as parse_temp_name

if TYPE_CHECKING:
    from sfstore.paths.device import DevicePath

__all__ = ["FilePath", "MountFacts", "AtomicWriter", "OpenFile", "ReadFuture", "file_kind"]

MiB = 1 << 20
_TMP_KIND = "tmp"  # the kind of temporary name (sfstore.temp_names) a file path writes under


@dataclass(frozen=True)
class MountFacts:
    """What the mount under a root is, and what follows from it."""

    mountpoint: str
    fstype: str
    source: str
    transport: str  # "rdma" | "tcp" | "local"
    nfs_version: str | None = None
    rsize: int | None = None
    wsize: int | None = None
    nconnect: int | None = None

    @classmethod
    def from_mount(cls, m: MountInfo) -> MountFacts:
        def num(name: str) -> int | None:
            v = m.option(name)
            return int(v) if v and v.isdigit() else None

        if not m.is_nfs:
            return cls(m.mountpoint, m.fstype, m.source, "local")
        version = m.option("vers") or ("4" if m.fstype == "nfs4" else "3")
        return cls(m.mountpoint, m.fstype, m.source, m.transport, version, num("rsize"), num("wsize"), num("nconnect"))

    def default_chunk_size(self) -> int:
        """Bytes per request: a few NFS ``rsize`` (so each request is several RPCs in flight), 8 MiB locally."""
        if self.transport == "local":
            return 8 * MiB
        rsize = self.rsize or MiB
        return max(MiB, min(16 * MiB, 4 * rsize))

    def default_parallelism(self) -> int:
        """Requests in flight: 16 locally; on NFS 16 per connection (``nconnect``), at most 64."""
        if self.transport == "local":
            return 16
        return min(64, 16 * (self.nconnect or 1))


class ReadFuture(MappedFuture[list[int], int]):
    """The pending result of :meth:`FilePath.read_into_async`: ``get()`` returns the bytes read (fewer than asked
    only at end of file) and raises the typed error of a failed chunk; the file it opened is closed once the
    read has finished."""

    def __init__(self, path: FilePath, future: PathFuture, fd: int = -1) -> None:
        # Closures over the counters and a descriptor holder, never over self: a future that referred to itself
        # would keep the batch (and the caller's buffer) alive until a garbage collection.
        counters, held = path.counters, [fd]

        def total(got: list[int]) -> int:
            counters.add(files=1)
            return sum(got)

        def close() -> None:
            if held[0] >= 0:
                os.close(held[0])
                held[0] = -1

        super().__init__(future, total, on_done=close)
        self._held, self._close = held, close

    def __del__(self) -> None:
        if self._held[0] >= 0 and self._inner.done():
            self._close()


class FilePath(StoragePath):
    """A directory on a mount, read and written through the I/O engine.

    Parameters
    ----------
    root : str or os.PathLike
        The directory; created if missing (``create=True``).
    engine : IOEngine, optional
        Default: ``get_engine(queue_depth=parallelism)``.
    direct : {"auto", "on", "off"}, optional
        O_DIRECT use (default: the ``direct_io`` setting). ``auto`` uses it where the filesystem allows it and
        reports a fallback where it does not.
    chunk_size, parallelism : int, optional
        Bytes per request and requests in flight (defaults: the ``file_chunk_size``/``file_parallelism``
        settings, or, where those are 0, what the mount suggests: see :class:`MountFacts`).
    """

    kind = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        engine: IOEngine | None = None,
        direct: str | None = None,
        chunk_size: int | None = None,
        parallelism: int | None = None,
        create: bool = True,
    ) -> None:
        super().__init__()
        # Every face reaches the disk through a path: a bad SFSTORE_* variable fails here, before any I/O, even
        # where no router was opened (a checkpoint saved to an absolute path).
        validate_environment()
        raw = os.path.abspath(os.path.expanduser(os.fspath(root)))
        if create:
            os.makedirs(raw, exist_ok=True)
        elif not os.path.isdir(raw):
            raise errors.os_error(errno.ENOENT, "FilePath root is not a directory", raw)
        self.root = os.path.realpath(raw)
        self.beneath = Beneath(self.root, aliases=(raw,))
        self.mount = MountFacts.from_mount(mount_for(self.root))
        # Arguments obey the settings' ranges (a 1-byte chunk would move a MiB in a million requests).
        if chunk_size is not None:
            chunk_size = defaults.SETTINGS["file_chunk_size"].parse(chunk_size, "FilePath(chunk_size=...)")
        if parallelism is not None:
            parallelism = defaults.SETTINGS["file_parallelism"].parse(parallelism, "FilePath(parallelism=...)")
        self.chunk_size = int(chunk_size or defaults.get("file_chunk_size") or self.mount.default_chunk_size())
        self.parallelism = int(parallelism or defaults.get("file_parallelism") or self.mount.default_parallelism())
        self._engine = engine
        self._small_engine: IOEngine | None = None
        self._device: DevicePath | None = None  # staged mode, for GPU buffers given to the read calls
        self._device_lock = threading.Lock()
        self._direct_mode = defaults.SETTINGS["direct_io"].parse(direct, "FilePath") if direct else None
        self.direct = self._probe_direct()
        if self.mount.transport == "tcp":
            self.fallbacks.append(f"NFS over TCP ({self.mount.source}, proto=tcp): this mount has no RDMA")
        elif self.mount.transport == "local":
            self.fallbacks.append(
                f"local {self.mount.fstype} filesystem at {self.mount.mountpoint}: no NFS over RDMA configured"
            )

    # -- what it is ------------------------------------------------------------------------------------------

    @property
    def transport(self) -> str:
        return self.mount.transport

    @property
    def supports_direct_io(self) -> bool:
        return self.direct

    def _queue_depth(self) -> int | None:
        return self.parallelism

    @property
    def small_file_engine(self) -> IOEngine:
        """The engine for batches of small files (:meth:`read_many`).

        Small files are read through the page cache (they land in unaligned ``bytes``); io_uring hands such
        reads that miss the cache to kernel worker threads one by one, and a native thread pool with many
        requests in flight is faster for them (docs/performance.md, the files suite's small-file
        case). So with the ``engine`` setting on ``auto`` these batches use the ``threads`` engine with
        ``file_small_parallelism`` workers; an explicit engine setting is respected.
        """
        if defaults.get("engine") != "auto":
            return self.engine
        if self._small_engine is None or self._small_engine.closed:
            n = int(defaults.get("file_small_parallelism"))
            try:
                self._small_engine = get_engine("threads", threads=n, queue_depth=n)
            except errors.EngineUnavailableError:
                self._small_engine = self.engine
            except errors.OutOfResourcesError as exc:
                # Memory or a thread limit (ulimit -v, RLIMIT_NPROC) refuses n more threads: the main engine
                # still reads the files, with fewer in flight, and the path says so.
                self._small_engine = self.engine
                note = f"many-file reads on the main engine: {n} reader threads could not start ({exc})"
                if note not in self.fallbacks:
                    self.fallbacks.append(note)
        return self._small_engine

    def describe(self) -> dict[str, Any]:
        engines = describe_engines()
        fallbacks = list(self.fallbacks)
        if engines.get("selected") != "uring":
            fallbacks.append(f"I/O engine {engines.get('selected')}: {engines.get('why')}")
        return {
            "kind": self.kind,
            "root": self.root,
            "transport": self.transport,
            "mount": asdict(self.mount),
            "direct_io": self.direct,
            "chunk_size": self.chunk_size,
            "parallelism": self.parallelism,
            "engine": engines.get("selected"),
            "fallbacks": fallbacks,
            "counters": self.counters.snapshot(),
        }

    def _probe_direct(self) -> bool:
        mode = self._direct_mode or defaults.get("direct_io")
        if mode == "off":
            self.fallbacks.append("O_DIRECT off by setting (direct_io=off): page-cache I/O")
            return False
        name = temp_name("direct-io-probe", _TMP_KIND)
        probe = os.path.join(self.root, name)
        rootfd = self.beneath.root_fd()
        try:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=rootfd)
            except OSError as exc:
                # The probe file's own (temporary) name means nothing to a user: the directory does.
                raise errors.os_error(exc.errno or errno.EIO, f"cannot create a file in {self.root}") from None
            try:
                direct = enable_direct(fd, probe, required=mode == "on")
            finally:
                os.close(fd)
                os.unlink(name, dir_fd=rootfd)
        except errors.SfstoreOSError as exc:
            if mode == "on":
                raise
            self.fallbacks.append(f"cannot probe O_DIRECT: {exc.strerror or exc}")
            return False
        if not direct:
            self.fallbacks.append(f"{self.mount.fstype} at {self.mount.mountpoint} refuses O_DIRECT: page-cache I/O")
        return direct

    # -- names -----------------------------------------------------------------------------------------------

    def resolve(self, path: str | os.PathLike[str]) -> str:
        """The absolute path of ``path`` (relative to the root, or absolute inside it), symlinks resolved.

        Raises :class:`~sfstore.errors.PathEscapeError` when the result would leave the root. The answer is a
        name, true when it was computed: for messages and checks only. Opening, renaming or removing by it
        would race with a directory on the way being swapped for a symlink; every operation here goes through
        :attr:`beneath` instead.
        """
        text = os.fspath(path)
        if "\x00" in text:
            raise errors.PathEscapeError(f"path {text!r} contains a NUL byte")
        candidate = text if os.path.isabs(text) else os.path.join(self.root, text)
        real = os.path.realpath(candidate)
        if real != self.root and not real.startswith(self.root + os.sep):
            raise errors.PathEscapeError(f"path {text!r} resolves to {real}, outside the root {self.root}")
        return real

    def full(self, path: str | os.PathLike[str]) -> str:
        """The host path that ``path`` names below the root, ``.`` and ``..`` folded, symlinks not resolved
        (for messages). Raises :class:`~sfstore.errors.PathEscapeError` where ``path`` climbs out."""
        return self.beneath.full(self.beneath.parts(path))

    def open_beneath(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> tuple[int, str]:
        """Open ``path`` (relative to the root, or absolute inside it) without leaving the root; return the
        descriptor and the absolute path (for messages).

        One ``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` where the kernel has it, with a walk of
        ``O_NOFOLLOW`` directory descriptors for what the kernel refuses (absolute symlinks inside the root)
        or where ``openat2`` is missing (see :class:`~sfstore.paths.beneath.Beneath`). O_DIRECT is not set.
        """
        try:
            full = self.full(path)  # a path that climbs out by its name is refused here, one by a link below
            return self.beneath.open(path, flags, mode), full
        except errors.PathEscapeError:
            self.counters.add(errors=1)
            raise
        except OSError as exc:
            self.counters.add(errors=1)
            raise errors.os_error(exc.errno or errno.EIO, "cannot open", full) from None

    def stat(self, path: str | os.PathLike[str], *, follow: bool = True) -> os.stat_result:
        """``stat`` (``lstat`` with ``follow=False``) of ``path`` beneath the root; opens nothing that blocks."""
        try:
            return self.beneath.stat(path, follow=follow)
        except errors.PathEscapeError:
            self.counters.add(errors=1)
            raise
        except OSError as exc:
            self.counters.add(errors=1)
            raise errors.os_error(exc.errno or errno.EIO, "cannot access", exc.filename or self.full(path)) from None

    def relative(self, full: str) -> str:
        """The root-relative name of an absolute path inside the root (``""`` for the root)."""
        rel = os.path.relpath(full, self.root)
        return "" if rel == "." else rel

    # -- the namespace -----------------------------------------------------------------------------------------
    # Faces name, list, make, move and remove files through these, never around the path: each name is resolved
    # beneath the root (:class:`~sfstore.paths.beneath.Beneath`: openat2 or a walk of directory descriptors, so a
    # directory swapped for a symlink cannot lead out). They keep the ``os`` module's contract, an ``OSError``
    # naming the host path, so each face adds its own context (``sf://`` URLs, a checkpoint's shard);
    # :class:`~sfstore.errors.PathEscapeError` for a name that climbs out. :meth:`stat` and :meth:`open_beneath`
    # are the typed ones.

    def parts(self, path: str | os.PathLike[str]) -> list[str]:
        """The components of ``path`` below the root (``.`` and ``..`` folded, symlinks not resolved);
        :class:`~sfstore.errors.PathEscapeError` where it climbs out."""
        return self.beneath.parts(path)

    def root_fd(self) -> int:
        """The root's ``O_PATH`` descriptor, owned by the path (reopened in a forked child): do not close it."""
        return self.beneath.root_fd()

    def os_stat(self, path: str | os.PathLike[str], *, follow: bool = True) -> os.stat_result:
        """``os.stat`` (``os.lstat`` with ``follow=False``) of ``path``; opens nothing that could block."""
        return self.beneath.stat(path, follow=follow)

    def open_fd(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
        """``os.open`` of ``path`` beneath the root (the caller closes the descriptor); O_DIRECT is not set."""
        return self.beneath.open(path, flags, mode)

    def open_dir(self, path: str | os.PathLike[str]) -> int:
        """A readable descriptor of the directory ``path`` (for ``os.scandir``, ``fsync``; the caller closes it)."""
        return self.beneath.open_dir(path)

    def listdir(self, path: str | os.PathLike[str]) -> list[str]:
        """Names in the directory ``path``."""
        return self.beneath.listdir(path)

    def scandir(self, path: str | os.PathLike[str]) -> list[tuple[str, os.stat_result | None]]:
        """Names in the directory ``path`` with their ``lstat`` (``None`` for one removed while listing)."""
        return self.beneath.scandir(path)

    def mkdir(self, path: str | os.PathLike[str], *, parents: bool = False, exist_ok: bool = False) -> None:
        """Make the directory ``path`` (``parents``: and the missing ones above it)."""
        self.beneath.mkdir(path, parents=parents, exist_ok=exist_ok)

    def rmdir(self, path: str | os.PathLike[str]) -> None:
        """Remove the empty directory ``path``."""
        self.beneath.rmdir(path)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        """Remove the entry ``path`` (a symlink: the link itself); not a directory."""
        self.beneath.unlink(path)

    def rmtree(self, path: str | os.PathLike[str], maxdepth: int | None = None) -> None:
        """Remove ``path`` and what it holds (symlinks removed, never followed); see
        :meth:`~sfstore.paths.beneath.Beneath.rmtree` for ``maxdepth``."""
        self.beneath.rmtree(path, maxdepth)

    def rmtree_at(self, dirfd: int, name: str, full: str) -> None:
        """:meth:`rmtree` of the entry ``name`` of a directory descriptor this path gave out (``full``: its name in
        errors)."""
        self.beneath.rmtree_at(dirfd, name, full)

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """``rename(2)`` of the entry ``src`` to ``dst`` (replaced if there)."""
        self.beneath.rename(src, dst)

    def utime(self, path: str | os.PathLike[str], times: tuple[float, float] | None = None) -> None:
        """Set the access and modification times of ``path`` (now by default)."""
        self.beneath.utime(path, times)

    # Many names beneath one directory descriptor this path gave out (:meth:`open_fd` with ``O_PATH |
    # O_DIRECTORY``), each in one call into the native helper; ``None`` where the helper or the kernel lacks
    # openat2 (the caller opens them one by one with :meth:`open_fd`).

    def open_at(self, dirfd: int, rel: str, flags: int) -> int | None:
        """``rel`` opened beneath ``dirfd``: its descriptor; ``OSError`` for a failed open (``ENOENT``: not there;
        ``EXDEV``/``ELOOP``: a link out of the directory)."""
        return open_at(dirfd, rel, flags)

    def open_many_at(self, dirfd: int, names: list[str], flags: int, size: int,
                     direct: bool) -> list[tuple[int, ...]] | None:
        """Each of ``names`` opened beneath ``dirfd``: per name ``(fd, errno, mode, dev, ino, size, atime_ns,
        mtime_ns)`` (``fd`` < 0 where ``errno`` says why; a regular file of ``size`` bytes switched to O_DIRECT
        with ``direct``)."""
        return open_many_at(dirfd, names, flags, size, direct)

    def stat_many_at(self, dirfd: int, names: list[str], flags: int, leading: bool) -> list[int] | None:
        """The mode of each of ``names`` beneath ``dirfd`` (``-errno`` where nothing is; ``leading``: stop after
        the first miss)."""
        return stat_many_at(dirfd, names, flags, leading)

    # -- reads -----------------------------------------------------------------------------------------------

    def _open_read(
        self, path: str | os.PathLike[str], direct: bool | None = None, follow: bool = True
    ) -> tuple[int, str, int]:
        """Open a regular file for reading beneath the root: ``(fd, full, size)``.

        Opened with ``O_NONBLOCK`` (a FIFO without a writer would block ``open`` forever), checked with
        ``fstat``, then switched to blocking (and O_DIRECT where the path uses it; ``direct`` overrides).
        ``follow=False``: a symlink as the last component is refused (ELOOP).
        """
        fd, full = self._open_nonblocking(path, follow)
        try:
            size = _regular_size(fd, full)
            _set_status(fd, full, self.direct if direct is None else direct)
        except BaseException:
            os.close(fd)
            self.counters.add(errors=1)
            raise
        return fd, full, size

    def _open_nonblocking(self, path: str | os.PathLike[str], follow: bool = True) -> tuple[int, str]:
        """:meth:`open_beneath` read-only with ``O_NONBLOCK`` (a FIFO opens at once); a socket, which
        ``open`` refuses with ENXIO, raises :class:`~sfstore.errors.NotARegularFileError` as a FIFO would."""
        flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
        try:
            return self.open_beneath(path, flags)
        except errors.SfstoreOSError as exc:
            if exc.errno == errno.ENXIO:
                self._refuse_special(path, exc)
            raise

    def _refuse_special(self, path: str | os.PathLike[str], exc: errors.SfstoreOSError) -> None:
        try:
            mode = self.beneath.stat(path).st_mode
        except OSError:
            return
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            full = self.full(path)
            raise errors.os_error(
                errno.EINVAL, f"not a regular file ({file_kind(mode)})", full, errors.NotARegularFileError
            ) from exc

    def open_file(self, path: str | os.PathLike[str], *, follow: bool = True) -> OpenFile:
        """Open the regular file ``path`` for reading: reads of the returned :class:`OpenFile` stay on that file
        whatever is renamed or swapped meanwhile. ``follow=False`` refuses a symlink as the last component
        (:class:`~sfstore.errors.SfstoreOSError` with errno ELOOP); links on the way are still followed."""
        fd, full, _ = self._open_read(path, follow=follow)
        return OpenFile(self, fd, full)

    # -- the data seam ---------------------------------------------------------------------------------------

    def _start(self, batch: list[Range], checksums: list[int | None] | None, data_class: str | None) -> PathFuture:
        """Ranges of open files (``Range.file``: a descriptor from :meth:`open_beneath`, or an :class:`OpenFile`):
        each becomes requests of :attr:`chunk_size` bytes, :attr:`parallelism` in flight, O_DIRECT where the
        descriptor has it (misaligned pieces bounced). Host memory only."""
        return self._run(batch, checksums, data_class, None)

    def _run(
        self,
        batch: list[Range],
        checksums: list[int | None] | None,
        data_class: str | None,
        engine: IOEngine | None,
        release: Callable[[], None] | None = None,
    ) -> PathFuture:
        self.refuse_device_buffers(batch)
        pieces, owner, sums = split_ranges(batch, self.chunk_size, checksums)
        reqs = [Request(p.op, descriptor_of(p.file, owner[j]), p.offset, p.length, p.buffer, p.buffer_offset)
                for j, p in enumerate(pieces)]
        fut = (engine or self.engine).submit(reqs, checksums=sums)
        return PathFuture(self, [(fut, owner, "host")], [r.op for r in batch], data_class=data_class,
                          release=release)

    def size(self, path: str | os.PathLike[str]) -> int:
        """Size in bytes of the file at ``path``."""
        return self.stat(path).st_size

    def read_into_async(
        self, path: str | os.PathLike[str], buffer: Any, offset: int = 0, length: int | None = None
    ) -> Future[int]:
        """Start reading ``path`` from ``offset`` into ``buffer``; :meth:`ReadFuture.get` returns the bytes read.

        ``buffer`` is anything with the buffer protocol or a CPU DLPack/torch tensor (written in place, no
        intermediate ``bytes``); ``length`` defaults to the buffer's size, and the read stops early at end of
        file. The file is read as ``chunk_size`` requests, ``parallelism`` in flight. A GPU buffer (cupy, torch
        CUDA) is filled through pinned bounce buffers (the device path, where there is one, avoids the copy).
        """
        _check_range(offset, length)
        if is_device_buffer(buffer):
            fd, full, _ = self._open_read(path)
            try:
                return self._read_fd_into_device(fd, full, buffer, offset, length)
            finally:
                os.close(fd)
        view, want = _host_view(buffer, length)
        fd, full, size = self._open_read(path)
        return self._start_read(fd, full, size, view, want, offset, owns_fd=True)

    def _start_read(
        self, fd: int, full: str, size: int, view: Any, want: int, offset: int, *, owns_fd: bool
    ) -> ReadFuture:
        """Submit the read of ``want`` bytes at ``offset`` (clipped at ``size``) of ``fd`` into ``view``."""
        try:
            if want > memoryview(view).nbytes:
                raise errors.BufferTooSmallError(
                    f"a buffer of {memoryview(view).nbytes} bytes cannot hold {want} bytes of {full}"
                )
            n = max(0, min(want, size - offset))
            fut = self.submit([Range.read(offset, n, view, 0, fd)])
        except BaseException:
            if owns_fd:
                os.close(fd)
            raise
        return ReadFuture(self, fut, fd if owns_fd else -1)

    def read_into(
        self, path: str | os.PathLike[str], buffer: Any, offset: int = 0, length: int | None = None
    ) -> int:
        """Read ``path`` from ``offset`` into ``buffer``; return the bytes read (see :meth:`read_into_async`)."""
        return self.read_into_async(path, buffer, offset, length).get()

    def read(self, path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> bytes:
        """The bytes of ``path`` from ``offset`` (to the end, or ``length`` bytes), read straight into the
        returned ``bytes`` object."""
        _check_range(offset, length)
        fd, full, size = self._open_read(path)
        try:
            return self._read_fd(fd, full, size, offset, length)
        finally:
            os.close(fd)

    def _read_fd(self, fd: int, full: str, size: int, offset: int, length: int | None) -> bytes:
        n = max(0, size - offset) if length is None else max(0, min(length, size - offset))
        data, view = bytes_for_filling(n)
        try:
            got = self._start_read(fd, full, size, view, n, offset, owns_fd=False).get()
        finally:
            view.release()
        return filled_bytes(data, got)

    def read_ranges_into(
        self, path: str | os.PathLike[str], ranges: Sequence[tuple[int, int, Any, int]]
    ) -> list[int]:
        """Read several ``(offset, length, buffer, buffer_offset)`` ranges of one file in one batch.

        Returns the bytes read per range (short only at end of file).
        """
        fd, _, _ = self._open_read(path)
        try:
            return self._read_ranges_fd(fd, ranges)
        finally:
            os.close(fd)

    def _read_ranges_fd(self, fd: int, ranges: Sequence[tuple[int, int, Any, int]]) -> list[int]:
        got = self.submit([Range.read(off, n, as_buffer(buf), boff, fd) for off, n, buf, boff in ranges]).get()
        self.counters.add(files=1)
        return got

    def read_many(
        self, paths: Iterable[str | os.PathLike[str]], *, on_error: str = "raise", window: int = 256
    ) -> list[bytes | BaseException]:
        """Read many (small) files whole, pipelined: the next ``window`` files open while these are read.

        Returns one ``bytes`` per path, in order. ``on_error="raise"`` raises the first error (typed, e.g.
        :class:`~sfstore.errors.PathNotFoundError`); ``"return"`` puts the exception in that path's place.
        """
        if on_error not in ("raise", "return"):
            raise errors.InvalidRequestError(f"on_error must be 'raise' or 'return', not {on_error!r}")
        names = list(paths)
        out: list[bytes | BaseException] = [b""] * len(names)
        pending: _Group | None = None
        try:
            for start in range(0, len(names), max(1, window)):
                group = self._open_group(names, start, min(len(names), start + window), out, on_error)
                if pending is not None:
                    self._finish_group(pending, out, on_error)
                pending = group
            if pending is not None:
                group, pending = pending, None
                self._finish_group(group, out, on_error)
        finally:
            if pending is not None:
                pending.close()
        return out

    def _open_group(
        self, names: list[str | os.PathLike[str]], start: int, stop: int, out: list[bytes | BaseException],
        on_error: str,
    ) -> _Group:
        group = _Group()
        try:
            ranges: list[Range] = []
            for i in range(start, stop):
                try:
                    fd, full = self._open_nonblocking(names[i])
                except errors.SfstoreError as exc:
                    if on_error == "raise":
                        raise
                    out[i] = exc
                    continue
                group.fds.append(fd)
                try:
                    size = _regular_size(fd, full)
                    # Large files go direct; small ones read through the page cache, since they land in
                    # unaligned ``bytes`` and would be bounced (copied) under O_DIRECT anyway.
                    _set_status(fd, full, self.direct and size >= _DIRECT_MIN)
                except errors.SfstoreError as exc:
                    self.counters.add(errors=1)
                    if on_error == "raise":
                        raise
                    out[i] = exc
                    continue
                data, view = bytes_for_filling(size)
                group.items.append((i, data, view, len(ranges)))
                ranges.append(Range("read", 0, size, view, 0, fd))
            group.future = self._run(check_batch(ranges, None)[0], None, None, self.small_file_engine)
        except BaseException:
            group.close()
            raise
        return group

    def _finish_group(self, group: _Group, out: list[bytes | BaseException], on_error: str) -> None:
        try:
            assert group.future is not None
            results = group.future.results()
            self.counters.add(files=len(group.items))
            for i, data, view, index in group.items:
                view.release()
                n = results[index]
                if n < 0:
                    exc = group.future.error_for(index, -n)
                    if on_error == "raise":
                        raise exc
                    out[i] = exc
                    continue
                out[i] = filled_bytes(data, n)
        finally:
            group.close()

    def _read_fd_into_device(self, fd: int, full: str, buffer: Any, offset: int, length: int | None) -> Future[int]:
        # The file path takes host memory: a GPU buffer given to its read calls goes to a device path in staged
        # mode (pinned staging buffers and this path's engine, counted on this path's counters), from the one
        # descriptor opened beneath the root; the device path itself (sfstore.paths.device) can avoid the copy.
        from sfstore.buffers import device_nbytes

        if "GPU buffers through pinned bounce buffers" not in " ".join(self.fallbacks):
            self.fallbacks.append("GPU buffers through pinned bounce buffers: no GPU-direct path here")
        nbytes = device_nbytes(buffer)
        want = nbytes if length is None else length
        if want > nbytes:
            raise errors.BufferTooSmallError(f"a buffer of {nbytes} bytes cannot hold {want} bytes of {full}")
        n = max(0, min(want, os.fstat(fd).st_size - offset))
        if n:
            # waited for here: the caller closes the descriptor when this returns
            self._staged_device().submit([Range.read(offset, n, buffer, 0, fd)]).get()
        return DoneFuture(n)

    def _staged_device(self) -> DevicePath:
        """The device path in staged mode that moves GPU buffers for this path's reads (made on first use)."""
        with self._device_lock:
            if self._device is None:
                from sfstore.paths.device import DevicePath

                dp = DevicePath(mode="staged", engine=self.engine)
                dp.counters = self.counters  # one path's counts, whichever of its legs moved the bytes
                self._device = dp
            return self._device

    def close(self) -> None:
        """Release the device path made for GPU buffers, if any (the engine is shared: it stays)."""
        with self._device_lock:
            dp, self._device = self._device, None
        if dp is not None:
            dp.close()

    # -- writes ----------------------------------------------------------------------------------------------

    def write(
        self, path: str | os.PathLike[str], data: Any, *, fsync: bool = False, overwrite: bool = True
    ) -> int:
        """Write ``data`` as the whole content of ``path``, atomically; return the bytes written.

        The bytes go to a temporary name in the same directory (O_DIRECT where possible, ``chunk_size``
        requests in parallel), are fsynced when ``fsync`` is true, then renamed over ``path`` (and the
        directory fsynced), so readers see the old content or the new, never a part. ``overwrite=False``
        refuses an existing file with :class:`~sfstore.errors.PathExistsError`.
        """
        with self.open_writer(path, fsync=fsync, overwrite=overwrite) as w:
            w.write(data)
        return w.size

    def open_writer(
        self, path: str | os.PathLike[str], *, fsync: bool = False, overwrite: bool = True
    ) -> AtomicWriter:
        """A writer that publishes ``path`` atomically on :meth:`AtomicWriter.close` (discarded on error).

        Missing parent directories are made. A symlink inside the root at ``path`` is followed: its target is
        written. The writer holds the parent directory's descriptor, so its temporary file and the publishing
        rename happen in the directory located now, whatever is renamed or swapped meanwhile.
        """
        try:
            full = self.full(path)  # a path that climbs out by its name is refused here, one by a link below
            loc = self.beneath.locate(path, follow=True, create_parents=True)
        except errors.PathEscapeError:
            self.counters.add(errors=1)
            raise
        except OSError as exc:  # a parent is a file (ENOTDIR), or no permission
            self.counters.add(errors=1)
            err = errno.ENOTDIR if exc.errno == errno.EEXIST else (exc.errno or errno.EIO)
            raise errors.os_error(err, "cannot create the parent directory", os.path.dirname(full)) from None
        try:
            if loc.name is None:
                raise errors.os_error(errno.EISDIR, "cannot write a file over a directory", loc.full)
            try:
                st: os.stat_result | None = os.stat(loc.name, dir_fd=loc.dirfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError as exc:
                raise errors.os_error(exc.errno or errno.EIO, "cannot access", loc.full) from None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise errors.os_error(errno.EISDIR, "cannot write a file over a directory", loc.full)
            if not overwrite and st is not None:
                raise errors.os_error(errno.EEXIST, "refusing to overwrite", loc.full)
            return AtomicWriter(self, loc, fsync=fsync, overwrite=overwrite)
        except BaseException:
            loc.close()
            self.counters.add(errors=1)
            raise

    def create_at(self, dirfd: int, name: str, full: str, *, size: int | None = None) -> int:
        """Create the new regular file ``name`` in a directory descriptor this path gave out, to be written
        through :meth:`submit`; its descriptor (the caller closes it).

        ``O_EXCL | O_NOFOLLOW``: never an existing file or a link; O_DIRECT where this path moves data directly.
        With ``size`` the file gets its final size first, so the writes land within it instead of each extending
        it (ext4 serialises extending O_DIRECT writes; NFS updates the size once). On any failure nothing is left
        behind. Typed errors, naming ``full``; the caller counts a failure (an atomic writer counts it once).
        """
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dirfd)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot create", full) from None
        try:
            if self.direct:
                enable_direct(fd, full, required=True)
            if size is not None:
                try:
                    os.ftruncate(fd, size)
                except OSError as exc:
                    raise errors.os_error(exc.errno or errno.EIO, "cannot size", full) from None
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dirfd)
            raise
        return fd

    def writer_at(self, dirfd: int, name: str, full: str, *, fsync: bool = False,
                  overwrite: bool = True) -> AtomicWriter:
        """:meth:`open_writer` of the entry ``name`` of a directory descriptor this path gave out (the writer
        does not close it); ``full`` names it in errors."""
        return AtomicWriter(self, Location(dirfd, name, full, owned=False), fsync=fsync, overwrite=overwrite)

    def clean_stale_temporaries(self, directory: str | os.PathLike[str] = "") -> int:
        """Remove temporary files that crashed writers left in ``directory``; return how many."""
        full = self.full(directory)
        try:
            dirfd = self.beneath.open_dir(directory)
        except errors.PathEscapeError:
            raise
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot list", full) from None
        removed = 0
        try:
            with os.scandir(dirfd) as it:
                found = [(de.name, parse_temp_name(de.name)) for de in it if de.is_file(follow_symlinks=False)]
            for name, tn in found:
                if tn is None or tn.kind != _TMP_KIND:
                    continue
                try:
                    if not is_leftover(tn, name, dir_fd=dirfd):
                        continue
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise errors.os_error(exc.errno or errno.EIO, "cannot stat", os.path.join(full, name)) from None
                try:
                    os.unlink(name, dir_fd=dirfd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise errors.os_error(exc.errno or errno.EIO, "cannot remove", os.path.join(full, name)) from None
                removed += 1
        finally:
            os.close(dirfd)
        return removed

    def is_temporary(self, name: str) -> bool:
        """Whether ``name`` is one of sfstore's in-progress temporary files (hidden from listings)."""
        tn = parse_temp_name(name)
        return tn is not None and tn.kind == _TMP_KIND


class AtomicWriter:
    """Streams bytes into a temporary file through the engine and publishes it atomically on close.

    Writes are buffered into ``chunk_size`` pieces and written in the background, up to ``parallelism``
    pieces in flight. :meth:`close` writes the rest, fsyncs when asked and renames into place; :meth:`discard`
    (or an exception inside ``with``) removes the temporary file and leaves any old content in place.
    """

    def __init__(self, fp: FilePath, loc: Location, *, fsync: bool, overwrite: bool) -> None:
        assert loc.name is not None
        self._fp, self.path, self._fsync, self._overwrite = fp, loc.full, fsync, overwrite
        self._name = loc.name
        self._tmp = temp_name(loc.name, _TMP_KIND)
        # the messages name the file being written, never its temporary name
        self._fd = fp.create_at(loc.dirfd, self._tmp, loc.full)
        self._dirfd = loc.detach()  # the directory the file is published in, held until then
        self._pending: list[tuple[PathFuture, bytearray]] = []  # each piece's write and the piece it holds
        self._buf = bytearray()
        self.size = 0  # bytes accepted so far
        self._written = 0  # file offset of the next piece
        self.closed = False

    def write(self, data: Any) -> int:
        """Accept ``data`` (bytes-like, numpy, CPU tensor); return its length."""
        if self.closed:
            raise errors.InvalidRequestError(f"write to a closed writer of {self.path}")
        view = memoryview(as_buffer(data)).cast("B")
        n = view.nbytes
        step = self._fp.chunk_size
        if not self._buf and n and (n >= step or n % 4096 == 0):
            # Large or page-multiple writes go straight from the caller's memory (nothing buffered before
            # them, so the file offset stays aligned); it must stay unchanged until they finish, so wait for
            # them before returning.
            whole = n if n % 4096 == 0 else n - n % step
            self._fp.submit([Range.write(self._written, whole, view, 0, self._fd)]).get()
            self._written += whole
            view = view[whole:]
        if view.nbytes:
            self._buf += view
            while len(self._buf) >= step:
                piece = bytearray(self._buf[:step])
                del self._buf[:step]
                self._submit(piece)
        self.size += n
        return n

    def writev(self, pieces: Sequence[Any]) -> int:
        """Accept several pieces, in order, as :meth:`write` of each would; where nothing is buffered and each
        is a multiple of 4096 bytes, they go straight from the caller's memory as one batch with one wait (a
        small header and its body: one round trip to the device, not two). Returns the bytes accepted."""
        if self.closed:
            raise errors.InvalidRequestError(f"write to a closed writer of {self.path}")
        views = [memoryview(as_buffer(p)).cast("B") for p in pieces]
        if self._buf or any(v.nbytes % 4096 for v in views):
            return sum(self.write(v) for v in views)
        ranges = []
        at = self._written
        for v in views:
            ranges.append(Range.write(at, v.nbytes, v, 0, self._fd))
            at += v.nbytes
        got = self._fp.submit(ranges).get() if ranges else []
        for r, n in zip(ranges, got, strict=True):
            if n != r.length:
                raise errors.os_error(errno.EIO, f"short write ({n} of {r.length} bytes)", self.path,
                                      errors.IOEngineError)
        total = at - self._written
        self._written = at
        self.size += total
        return total

    def write_through(self, path: StoragePath, buffer: Any, length: int, *, data_class: str | None = None) -> int:
        """Write ``length`` bytes of ``buffer`` next in the file through another path's :meth:`submit` (the
        device path, for GPU memory) and wait for them; what :meth:`write` buffered goes first. Returns
        ``length``. The file is still published (or discarded) by this writer."""
        if self.closed:
            raise errors.InvalidRequestError(f"write to a closed writer of {self.path}")
        if self._buf:
            self._submit(self._buf)
            self._buf = bytearray()
        self._drain()
        got = path.submit([Range.write(self._written, length, buffer, 0, self._fd)], data_class=data_class).get()[0]
        if got != length:
            raise errors.os_error(errno.EIO, f"short write ({got} of {length} bytes)", self.path, errors.IOEngineError)
        self._written += length
        self.size += length
        return length

    def _submit(self, piece: bytearray) -> None:
        self._pending.append((self._fp.submit([Range.write(self._written, len(piece), piece, 0, self._fd)]), piece))
        self._written += len(piece)
        while len(self._pending) >= self._fp.parallelism:
            self._pending.pop(0)[0].get()

    def _drain(self) -> None:
        while self._pending:
            self._pending.pop(0)[0].get()

    def close(self) -> None:
        """Write what is buffered, fsync if asked, and publish the file under its name."""
        if self.closed:
            return
        try:
            if self._buf:
                self._submit(self._buf)
                self._buf = bytearray()
            self._drain()
            if self._fsync:
                os.fsync(self._fd)
        except BaseException:
            self.discard()
            raise
        os.close(self._fd)
        self.closed = True
        self._fp.counters.add(files=1)
        try:
            self._publish()
        finally:
            os.close(self._dirfd)

    def _publish(self) -> None:
        d = self._dirfd
        try:
            if self._overwrite:
                os.replace(self._tmp, self._name, src_dir_fd=d, dst_dir_fd=d)
            else:
                # link fails if the name appeared meanwhile: no silent overwrite
                os.link(self._tmp, self._name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                os.unlink(self._tmp, dir_fd=d)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp, dir_fd=d)
            self._fp.counters.add(errors=1)
            context = "cannot publish" if self._overwrite or exc.errno != errno.EEXIST else "refusing to overwrite"
            raise errors.os_error(exc.errno or errno.EIO, context, self.path) from None
        if self._fsync:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=d)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def discard(self) -> None:
        """Drop everything written; the old content of the path (if any) stays."""
        if self.closed:
            return
        self.closed = True
        try:
            for fut, _ in self._pending:
                fut.wait()
            self._pending = []
        finally:
            os.close(self._fd)
            try:
                os.unlink(self._tmp, dir_fd=self._dirfd)
            except FileNotFoundError:
                pass
            finally:
                os.close(self._dirfd)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


class OpenFile:
    """A regular file of a :class:`FilePath` opened for reading (see :meth:`FilePath.open_file`).

    Every read goes to the same descriptor, through the path's engine (O_DIRECT where the path uses it), so a
    rename or a swapped directory after the open changes nothing for it. Close it (or use ``with``).
    """

    def __init__(self, fp: FilePath, fd: int, full: str) -> None:
        self._fp, self.fd, self.path = fp, fd, full

    @property
    def size(self) -> int:
        """The file's size now (``fstat``)."""
        return os.fstat(self.fd).st_size

    def read_into_async(self, buffer: Any, offset: int = 0, length: int | None = None) -> Future[int]:
        """Start reading from ``offset`` into ``buffer`` (see :meth:`FilePath.read_into_async`)."""
        _check_range(offset, length)
        if is_device_buffer(buffer):
            return self._fp._read_fd_into_device(self.fd, self.path, buffer, offset, length)
        view, want = _host_view(buffer, length)
        return self._fp._start_read(self.fd, self.path, self.size, view, want, offset, owns_fd=False)

    def read_into(self, buffer: Any, offset: int = 0, length: int | None = None) -> int:
        """Read from ``offset`` into ``buffer``; return the bytes read (fewer only at end of file)."""
        return self.read_into_async(buffer, offset, length).get()

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        """The bytes from ``offset`` (to the end, or ``length`` bytes)."""
        _check_range(offset, length)
        return self._fp._read_fd(self.fd, self.path, self.size, offset, length)

    def read_ranges_into(self, ranges: Sequence[tuple[int, int, Any, int]]) -> list[int]:
        """Read ``(offset, length, buffer, buffer_offset)`` ranges in one batch (see
        :meth:`FilePath.read_ranges_into`)."""
        return self._fp._read_ranges_fd(self.fd, ranges)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class _Group:
    """Files of one :meth:`FilePath.read_many` window: descriptors, destination bytes, the batch future."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.items: list[tuple[int, bytes | bytearray, memoryview, int]] = []  # (name, data, view, range)
        self.future: PathFuture | None = None

    def close(self) -> None:
        if self.future is not None:
            self.future.wait()
        for _, _, view, _ in self.items:
            view.release()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


_DIRECT_MIN = 1 << 20  # read_many: files at least this large are read with O_DIRECT


def _regular_size(fd: int, full: str) -> int:
    """Size of the open file ``fd``, which must be a regular file: a directory raises
    :class:`~sfstore.errors.IsADirectoryPathError`, a FIFO, socket or device
    :class:`~sfstore.errors.NotARegularFileError` (a FIFO would block its reader, a device has no size)."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if stat.S_ISDIR(st.st_mode):
        raise errors.os_error(errno.EISDIR, "cannot read a directory", full)
    raise errors.os_error(
        errno.EINVAL, f"not a regular file ({file_kind(st.st_mode)})", full, errors.NotARegularFileError
    )


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words (``"a FIFO"``, ``"a directory"``), for messages."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def _set_status(fd: int, full: str, direct: bool) -> None:
    """Make ``fd`` (opened ``O_NONBLOCK``) blocking, with O_DIRECT when ``direct``: one ``F_SETFL``."""
    o_direct = getattr(os, "O_DIRECT", 0)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, o_direct if direct else 0)
    except OSError as exc:
        raise errors.os_error(
            exc.errno or errno.EINVAL, "cannot read with O_DIRECT: the filesystem refuses it", full
        ) from None


def set_blocking(fd: int, *, direct: bool) -> bool:
    """Make ``fd`` (opened ``O_NONBLOCK``, so a FIFO could not make ``open`` wait) blocking, with O_DIRECT when
    ``direct`` and the filesystem takes it for this file; return whether O_DIRECT is set. io_uring answers a
    read of an ``O_NONBLOCK`` file that misses the page cache with EAGAIN, so reads through the engine need it."""
    o_direct = getattr(os, "O_DIRECT", 0) if direct else 0
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, o_direct)
        return bool(o_direct)
    except OSError:
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)
        return False


def enable_direct(fd: int, full: str, *, required: bool) -> bool:
    """Add O_DIRECT to ``fd``; return whether it is set. ``required``: a refusal raises (errno EINVAL)."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        if required:
            raise errors.os_error(errno.EINVAL, f"cannot open {full!r} with O_DIRECT: not supported here", full)
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | o_direct)
    except OSError as exc:
        if required:
            raise errors.os_error(
                exc.errno or errno.EINVAL,
                f"cannot open {full!r} with O_DIRECT (direct_io=on): the filesystem refuses it",
                full,
            ) from None
        return False
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & o_direct)


def _check_range(offset: int, length: int | None) -> None:
    if offset < 0 or (length is not None and length < 0):
        raise errors.InvalidRequestError(f"negative offset or length ({offset}, {length})")


def _host_view(buffer: Any, length: int | None) -> tuple[Any, int]:
    """The caller's host buffer as the engine takes it, and the bytes to read into it."""
    view = as_buffer(buffer)
    nbytes = memoryview(view).nbytes
    want = nbytes if length is None else length
    if want > nbytes:
        raise errors.BufferTooSmallError(f"a buffer of {nbytes} bytes cannot hold {want} bytes")
    return view, want


def fsync_dir(path: str) -> None:
    """fsync a directory, so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
