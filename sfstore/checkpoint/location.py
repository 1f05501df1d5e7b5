"""Where checkpoints live, and how they are published: staging directories, renameat2, cleanup, recovery.

A checkpoint ``<parent>/<name>`` is written into ``<parent>/.<name>.sfstore-staging-<host>-<pid>-<rand>`` (a
:mod:`sfstore.temp_names` name) and published by a rename: ``renameat2(RENAME_NOREPLACE)`` for a new name,
``renameat2(RENAME_EXCHANGE)`` to replace an existing one (the old one then sits at the staging name and is
removed). Filesystems without renameat2 flags (NFS refuses them with EINVAL) get a two-step replace: the old
checkpoint is renamed to ``.<name>.sfstore-old-<host>-<pid>-<rand>``, the new one into place. A crash between
the two steps leaves no ``<name>``; :func:`cleanup` (run by every save, list and load in that parent) renames
such an old checkpoint back, so the previous checkpoint is what readers find. Staging and old directories of
dead processes of this host are removed by the next save in the parent; other hosts' are left alone for
:data:`FOREIGN_STALE_SECONDS`.

Names are never acted on by their full path: the parent directory is opened beneath the file path's root
(:class:`~sfstore.paths.beneath.Beneath`), and the staging directory, its shards, the publishing renames and
every removal act relative to that descriptor, so a directory on the way swapped for a symlink to elsewhere
makes a save, list or load fail (or act on the directory opened), never act outside the root.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import posixpath
import stat
from dataclasses import dataclass

from sfstore import errors
from sfstore.paths.base import Range
from sfstore.paths.file import FilePath, file_kind
from sfstore.temp_names import FOREIGN_STALE_SECONDS as FOREIGN_STALE_SECONDS
from sfstore.temp_names import is_leftover, temp_name
from sfstore.temp_names import parse as parse_temp_name

__all__ = [
    "DATA_CLASS",
    "Location",
    "locate",
    "locate_dir",
    "split_url",
    "url_text",
    "root_for",
    "file_path",
    "url_of",
    "staging_path",
    "publish",
    "exists_error",
    "cleanup",
    "remove",
    "is_checkpoint_dir",
    "read_regular",
    "check_regular",
    "FOREIGN_STALE_SECONDS",
]

DATA_CLASS = "checkpoint"
"""The data class every byte a checkpoint moves is counted under on its file path (``counters.for_class``)."""

_STAGING_KINDS = ("staging", "old")  # the kinds of temporary name (sfstore.temp_names) checkpoints are written under

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347, "riscv64": 276}

@dataclass(frozen=True)
class Location:
    """A checkpoint directory: the file path it lives on, its parent directory (absolute, for messages and
    names handed to ``fp``), its name, and the parent below ``fp``'s root (``rel``, ``""``: the root)."""

    fp: FilePath
    parent: str
    name: str
    url: str
    rel: str = ""

    @property
    def path(self) -> str:
        return os.path.join(self.parent, self.name)

    def open_parent(self) -> int:
        """A readable descriptor of the parent directory, opened beneath ``fp``'s root (the caller closes it)."""
        return open_dir(self.fp, self.rel, self.parent)


def open_dir(fp: FilePath, rel: str, full: str) -> int:
    """A readable descriptor of the directory ``rel`` (below ``fp``'s root), typed errors naming ``full``."""
    try:
        return fp.open_dir(rel)
    except errors.PathEscapeError:
        raise
    except OSError as exc:
        raise _os_err(exc, "cannot open the directory", full) from None


def file_path(root: str, create: bool) -> FilePath:
    """The file path rooted at the host directory ``root`` (``create``: made if missing): the router's
    (:meth:`~sfstore.router.Router.location`), so its counters are the process's."""
    import sfstore

    return sfstore.open().location(root, create=create)


def _class_root(data_class: str, write: bool) -> FilePath:
    """The router's file path of ``data_class``; ``write``: one this process may write (a read-only root is a
    :class:`~sfstore.errors.ReadOnlyRootError` naming the setting that points the class elsewhere)."""
    import sfstore

    router = sfstore.open()
    if write:
        router.require_writable(data_class)
    return router.file_path(data_class)


ABSOLUTE, SF, CLASS = "abs", "sf", "class"
"""The kinds of checkpoint url :func:`split_url` tells apart: a host path, an ``sf://`` url, a bare name."""


def url_text(url: str | os.PathLike[str]) -> str:
    """The text of a checkpoint url: :class:`~sfstore.errors.InvalidRequestError` for bytes,
    :class:`~sfstore.errors.PathEscapeError` for a NUL byte; no I/O."""
    try:
        text = os.fspath(url)
    except TypeError:
        raise errors.InvalidRequestError(
            f"a checkpoint url must be a str or os.PathLike (or a CheckpointInfo), not {type(url).__name__}"
        ) from None
    if not isinstance(text, str):
        raise errors.InvalidRequestError(f"a checkpoint url must be text, not {type(text).__name__}")
    if "\x00" in text:
        raise errors.PathEscapeError(f"checkpoint url {text!r} contains a NUL byte")
    return text


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``(kind, path)`` of a checkpoint url; no I/O.

    ``file:///x`` and ``/x``: :data:`ABSOLUTE`, the host path ``/x``. ``sf://a/b`` (``sf:///a/b`` too):
    :data:`SF`, ``a/b`` below the ``sf://`` root, the directory ``fsspec.filesystem("sf")`` names ``sf://a/b``.
    A bare name ``a/b``: :data:`CLASS`, ``a/b`` below the checkpoint class's root.
    """
    text = url_text(url)
    if text.startswith("file://"):
        text = text[len("file://") :]
        if not text.startswith("/"):
            raise errors.InvalidRequestError(f"file:// urls must be absolute: {os.fspath(url)!r}")
        return ABSOLUTE, posixpath.normpath(text)
    if text.startswith("sf://"):
        # As the sf:// filesystem has it: a leading '/' means its root, never the host's.
        rel = text[len("sf://") :].lstrip("/")
        return SF, posixpath.normpath(rel) if rel else ""
    if "://" in text:
        raise errors.InvalidRequestError(
            f"checkpoint url {text!r}: checkpoints are sf://name, file:///path, a path or a name"
        )
    if os.path.isabs(text):
        return ABSOLUTE, posixpath.normpath(text)
    return CLASS, posixpath.normpath(text) if text else ""


def root_for(kind: str, write: bool = False) -> FilePath:
    """The file path a relative checkpoint url of ``kind`` (:data:`SF` or :data:`CLASS`) names a path below:
    the router's ``dataset`` class (what ``sf://`` names) or its ``checkpoint`` class; ``write``: to save there."""
    return _class_root("dataset" if kind == SF else "checkpoint", write)


def locate(url: str | os.PathLike[str], *, create: bool) -> Location:
    """Where the checkpoint ``url`` lives (see :func:`sfstore.checkpoint.save` for the url forms).

    ``create`` makes the root directory if missing (saves); loads raise
    :class:`~sfstore.errors.PathNotFoundError` instead.
    """
    kind, text = split_url(url)
    rel = ""
    if kind == ABSOLUTE:
        parent_abs, base = os.path.split(text.rstrip("/") or "/")
        if not base:
            raise errors.InvalidRequestError(f"checkpoint url {os.fspath(url)!r} names no directory")
        fp = file_path(parent_abs, create)
        parent = fp.root
    else:
        if text in ("", "."):
            raise errors.InvalidRequestError(f"checkpoint url {os.fspath(url)!r} names no directory")
        fp = root_for(kind, write=create)
        head, base = posixpath.split(text)
        parent = fp.full(head or "")  # refuses '..' above the root; symlinks are met beneath it, at each use
        rel = parent[len(fp.root):].lstrip("/")
    if base in ("", ".", "..") or base.startswith("."):
        raise errors.InvalidRequestError(
            f"checkpoint name {base!r} (from {os.fspath(url)!r}) must not be empty or start with '.'"
        )
    if create and rel:
        try:
            fp.mkdir(rel, parents=True, exist_ok=True)
        except errors.PathEscapeError:
            raise
        except OSError as exc:
            raise _os_err(exc, "cannot create the checkpoint directory's parent", parent) from None
    return Location(fp, parent, base, os.fspath(url), rel)


def locate_dir(prefix: str | os.PathLike[str]) -> tuple[str, FilePath, str]:
    """The url kind, file path and absolute directory of a ``list``/``latest`` prefix (a directory of
    checkpoints); the name is computed, not resolved: open it with :func:`open_dir` (beneath the root)."""
    kind, text = split_url(prefix)
    if kind == ABSOLUTE:
        fp = file_path(text, False)
        return kind, fp, fp.root
    fp = root_for(kind)
    return kind, fp, fp.full(text if text not in ("", ".") else "")


def url_of(kind: str, fp: FilePath, path: str) -> str:
    """The url of the checkpoint directory ``path`` (absolute, inside ``fp``) in the form of ``kind``: the host
    path, ``sf://<below the sf:// root>``, or the bare name below the checkpoint root."""
    if kind == ABSOLUTE:
        return path
    rel = fp.relative(path)
    return "sf://" + rel if kind == SF else rel


# -- reading small files -------------------------------------------------------------------------------------


def check_regular(st: os.stat_result, path: str, what: str, *, shard: str | None = None) -> None:
    """A :class:`~sfstore.errors.CorruptCheckpointError` unless ``st`` is a regular file's: a FIFO, socket,
    device or directory where a checkpoint has a file would block a read forever or never match its sums."""
    if not stat.S_ISREG(st.st_mode):
        raise errors.CorruptCheckpointError(
            f"{what} {path} is {file_kind(st.st_mode)}, not a regular file", shard=shard
        )


def read_regular(fp: FilePath, path: str, *, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (absolute, inside ``fp``'s root) of at most ``limit`` bytes.

    It is opened beneath the root with ``O_NONBLOCK`` and checked with ``fstat`` before a byte is read, so a
    FIFO (or socket, device, directory) in its place is a :class:`~sfstore.errors.CorruptCheckpointError`, never
    a hang; a larger file is one too, checked before it is read and again while reading (it may grow).
    Missing files raise :class:`~sfstore.errors.PathNotFoundError`.
    """
    try:
        fd, full = fp.open_beneath(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except errors.SfstoreOSError as exc:
        if exc.errno == errno.ENXIO:  # what open(2) says of a Unix socket (or a device without its driver)
            raise errors.CorruptCheckpointError(
                f"{what} {exc.filename or path} is a socket or device, not a regular file"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        check_regular(st, full, what)
        if st.st_size > limit:
            raise errors.CorruptCheckpointError(f"{what} {full} has {st.st_size} bytes, more than the {limit} allowed")
        try:
            # Blocking from here: io_uring answers a read of an O_NONBLOCK file that misses the page cache with
            # EAGAIN instead of waiting for it.
            os.set_blocking(fd, True)
        except OSError as exc:
            raise _os_err(exc, f"cannot read {what}", full) from None
        # One byte more than the size: a read that fills it all says the file grew; then read on, up to a byte
        # past the limit.
        cap = limit + 1
        pieces: list[tuple[bytearray, int]] = []
        total = 0
        want = min(st.st_size + 1, cap)
        while True:
            buf = bytearray(want)
            n = fp.submit([Range.read(total, want, buf, 0, fd)], data_class=DATA_CLASS).get()[0]
            pieces.append((buf, n))
            total += n
            if total > limit:
                raise errors.CorruptCheckpointError(f"{what} {full} grew past the {limit} bytes allowed")
            if n < want:
                break
            want = min(total, cap - total)
    finally:
        os.close(fd)
    fp.file_done(data_class=DATA_CLASS)
    return b"".join(memoryview(buf)[:n] for buf, n in pieces)


# -- staging and publishing ------------------------------------------------------------------------------------


def staging_name(loc: Location, kind: str = "staging") -> str:
    """A fresh staging (or old) directory name next to ``loc`` (a name in its parent directory)."""
    return temp_name(loc.name, kind)


def staging_path(loc: Location, kind: str = "staging") -> str:
    """A fresh staging (or old) directory's full name next to ``loc`` (for messages)."""
    return os.path.join(loc.parent, staging_name(loc, kind))


USE_RENAMEAT2 = True
"""Publish with renameat2 flags where the filesystem takes them; ``False`` forces the two-step replace."""

_libc: ctypes.CDLL | None = None
# renameat2 flags unsupported by the kernel (ENOSYS) or the filesystem (EINVAL: NFS, older FUSE, ...).
_FLAGS_REFUSED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _renameat2(src: str, dst: str, flags: int, dirfd: int = _AT_FDCWD) -> int:
    """renameat2(2) of ``src`` to ``dst``, both relative to ``dirfd``; returns 0 or the errno. ENOSYS when
    neither glibc nor the syscall table has it."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    s, d = os.fsencode(src), os.fsencode(dst)
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        rc = fn(dirfd, s, dirfd, d, flags)
    else:
        nr = _SYS_RENAMEAT2.get(platform.machine())
        if nr is None:
            return errno.ENOSYS
        rc = _libc.syscall(
            ctypes.c_long(nr), ctypes.c_int(dirfd), s, ctypes.c_int(dirfd), d, ctypes.c_uint(flags)
        )
    return 0 if rc == 0 else ctypes.get_errno()


def is_checkpoint_dir(path: str | int, name: str | None = None) -> bool:
    """Whether ``path`` (or the entry ``name`` of the directory descriptor ``path``) is a directory holding a
    manifest (or an empty directory); a symlink is not."""
    from sfstore.checkpoint.manifest import MANIFEST_NAME

    try:
        if isinstance(path, int):
            fd = os.open(name or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=path)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        names = os.listdir(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return not names or MANIFEST_NAME in names


def exists_at(dirfd: int, name: str) -> bool:
    """Whether the entry ``name`` exists in the directory ``dirfd`` (a dangling symlink does)."""
    try:
        os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def rmtree_at(fp: FilePath, dirfd: int, name: str, full: str) -> None:
    """Remove the entry ``name`` of ``dirfd`` and what it holds, walking descriptors (links removed, never
    followed); best effort."""
    try:
        fp.rmtree_at(dirfd, name, full)
    except OSError:
        pass


def _fsync(fd: int, full: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _os_err(exc, "cannot fsync the directory", full) from None


def _os_err(exc: OSError, what: str, path: str) -> errors.SfstoreOSError:
    return errors.os_error(exc.errno or errno.EIO, what, path)


def exists_error(loc: Location) -> errors.PathExistsError:
    """The error of a save (``overwrite=False``) to a checkpoint that exists, saying how to replace it."""
    exc = errors.os_error(
        errno.EEXIST,
        f"checkpoint {loc.url!r} exists: pass overwrite=True to save() or save_async() to replace it atomically "
        "(the old checkpoint stays whole until the new one is committed)",
        loc.path,
    )
    assert isinstance(exc, errors.PathExistsError)
    return exc


def publish(staging: str, loc: Location, *, overwrite: bool, exchange: bool | None = None,
            dirfd: int | None = None) -> None:
    """Move the (fsynced) staging directory named ``staging`` (in ``loc``'s parent) to ``loc`` atomically and
    fsync the parent.

    ``overwrite=False``: an existing ``loc`` raises :class:`~sfstore.errors.PathExistsError`. ``overwrite=True``
    replaces it (RENAME_EXCHANGE, else the two-step fallback) and removes the old one; a ``loc`` that is not
    an sfstore checkpoint directory is never replaced. ``exchange=False`` forces the fallback (default:
    :data:`USE_RENAMEAT2`). ``dirfd``: the parent's descriptor (the one the staging directory was made in;
    default: opened beneath the root now). Every rename and removal is relative to it.
    """
    staging = os.path.basename(staging)
    if dirfd is None:
        pfd = loc.open_parent()
        try:
            publish(staging, loc, overwrite=overwrite, exchange=exchange, dirfd=pfd)
        finally:
            os.close(pfd)
        return
    final, name = loc.path, loc.name
    staging_full = os.path.join(loc.parent, staging)
    flags_ok = USE_RENAMEAT2 if exchange is None else exchange
    if flags_ok:
        err = _renameat2(staging, name, RENAME_NOREPLACE, dirfd)
        if err == 0:
            _fsync(dirfd, loc.parent)
            return
        if err in _FLAGS_REFUSED:
            flags_ok = False
        elif err not in (errno.EEXIST, errno.ENOTEMPTY):
            raise errors.os_error(err, "cannot commit the checkpoint", final)
    if not flags_ok and not exists_at(dirfd, name):
        try:
            # without NOREPLACE an empty directory made meanwhile is replaced
            os.rename(staging, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise _os_err(exc, "cannot commit the checkpoint", final) from None
        else:
            _fsync(dirfd, loc.parent)
            return
    # `final` exists.
    if not overwrite:
        raise exists_error(loc)
    if not is_checkpoint_dir(dirfd, name):  # a symlink, a file, or a directory that is no checkpoint
        raise errors.os_error(
            errno.EEXIST, "refusing to replace something that is not an sfstore checkpoint directory", final
        )
    if flags_ok:
        err = _renameat2(staging, name, RENAME_EXCHANGE, dirfd)
        if err == 0:
            _fsync(dirfd, loc.parent)
            rmtree_at(loc.fp, dirfd, staging, staging_full)  # now the old checkpoint
            return
        if err not in _FLAGS_REFUSED:
            raise errors.os_error(err, "cannot replace the checkpoint", final)
    old = staging_name(loc, "old")
    try:
        os.rename(name, old, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except OSError as exc:
        raise _os_err(exc, "cannot move the old checkpoint aside", final) from None
    try:
        os.rename(staging, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except OSError as exc:
        os.rename(old, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)  # put the previous one back
        raise _os_err(exc, "cannot replace the checkpoint", final) from None
    _fsync(dirfd, loc.parent)
    rmtree_at(loc.fp, dirfd, old, os.path.join(loc.parent, old))


def remove(loc: Location) -> bool:
    """Remove the checkpoint at ``loc``, atomically for readers; ``False`` when nothing is there.

    An sfstore checkpoint directory is first renamed to a fresh staging name (so ``list``/``latest``/``load``
    never see it half removed, and a crash midway leaves only a staging directory that the next save in the
    parent removes), the parent fsynced, then removed by descriptors. A regular file or a symlink at ``loc``
    (a ``torch.save`` checkpoint file, a link to one) is unlinked, the link never followed. A directory that
    is not an sfstore checkpoint raises :class:`~sfstore.errors.InvalidRequestError` and stays.
    """
    pfd = loc.open_parent()
    try:
        try:
            st = os.stat(loc.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_err(exc, "cannot remove the checkpoint", loc.path) from None
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(loc.name, dir_fd=pfd)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise _os_err(exc, "cannot remove the checkpoint", loc.path) from None
            _fsync(pfd, loc.parent)
            return True
        if not is_checkpoint_dir(pfd, loc.name):
            raise errors.InvalidRequestError(
                f"refusing to remove {loc.path}: a directory that is not an sfstore checkpoint"
            )
        doomed = staging_name(loc)
        try:
            os.rename(loc.name, doomed, src_dir_fd=pfd, dst_dir_fd=pfd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_err(exc, "cannot remove the checkpoint", loc.path) from None
        _fsync(pfd, loc.parent)
        rmtree_at(loc.fp, pfd, doomed, os.path.join(loc.parent, doomed))
        return True
    finally:
        os.close(pfd)


# -- cleanup and recovery --------------------------------------------------------------------------------------


def cleanup(parent: int, *, fp: FilePath, full: str, remove: bool = True) -> int:
    """Recover interrupted replaces and (``remove=True``) remove stale staging/old directories in ``parent``.

    ``parent`` is a readable directory descriptor opened beneath ``fp``'s root (see
    :meth:`Location.open_parent`); ``full`` names it. Every rename and removal is relative to it. An ``old``
    directory of a dead process whose checkpoint name is missing is renamed back to that name (the replace
    never completed: the previous checkpoint is restored). Returns the number of entries handled. Errors
    (permissions, races with other cleaners) are ignored: cleanup is best effort.
    """
    handled = 0
    try:
        with os.scandir(parent) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    except OSError:
        return 0
    for name, is_dir in sorted(entries):
        tn = parse_temp_name(name)
        if tn is None or tn.kind not in _STAGING_KINDS or not is_dir:
            continue
        try:
            if not is_leftover(tn, name, dir_fd=parent):
                continue
            if tn.kind == "old" and not exists_at(parent, tn.final):
                os.rename(name, tn.final, src_dir_fd=parent, dst_dir_fd=parent)
                os.fsync(parent)
                handled += 1
            elif remove:
                rmtree_at(fp, parent, name, os.path.join(full, name))
                handled += 1
        except OSError:
            continue
    return handled
