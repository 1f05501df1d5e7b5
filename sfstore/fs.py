"""The fsspec filesystem ``sf://``: datasets on sfstore's file path, for data loaders.

Installed with sfstore, the ``fsspec.specs`` entry point registers the protocol, so ``fsspec.filesystem("sf")``,
``fsspec.open("sf://train/0001.tar")``, ``pandas.read_parquet("sf://tables/t.parquet")`` and
``UPath("sf://train")`` work without importing sfstore. Every byte moves through :class:`~sfstore.paths.file.
FilePath` (NFS over RDMA on a cluster, any directory elsewhere): whole files are read straight into the returned
``bytes``, many small files in one pipelined batch (:meth:`SFFileSystem.cat`), byte ranges coalesced and read in
one batch per file (:meth:`SFFileSystem.cat_ranges`), and every write is published atomically. Importing this
module also gives webdataset's ``gopen`` its ``sf`` handler (:mod:`sfstore.integrations.webdataset_gopen`).

>>> import fsspec
>>> fs = fsspec.filesystem("sf", root="/tmp/sf-doc")   # doctest: +SKIP
>>> fs.pipe_file("sf://a/b.bin", b"hello")             # doctest: +SKIP
>>> fs.cat_file("a/b.bin")                             # doctest: +SKIP
b'hello'
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import hashlib
import mmap
import os
import posixpath
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from glob import has_magic
from typing import Any, TypeVar

from sfstore import errors, records
from sfstore._optional import require
from sfstore.buffers import bytes_for_filling, filled_bytes
from sfstore.futures import Future, MappedFuture
from sfstore.integrations import webdataset_gopen
from sfstore.paths.base import PathCounters, Range
from sfstore.paths.beneath import fold_parts
from sfstore.paths.file import AtomicWriter, FilePath, OpenFile

require("fsspec", "data", "sf:// (sfstore.fs)")

from fsspec.caching import BaseCache  # noqa: E402  (after the check that says which extra installs fsspec)
from fsspec.callbacks import DEFAULT_CALLBACK  # noqa: E402
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem  # noqa: E402
from fsspec.utils import isfilelike, stringify_path  # noqa: E402

__all__ = ["SFFileSystem", "SFFile", "local_path", "other_scheme", "refuse_other_schemes"]

MiB = 1 << 20

_ENV_KEYS = ("SFSTORE_ROOT", "SFSTORE_CONFIG", "SFSTORE_DATA_DIR", "XDG_DATA_HOME", "XDG_CONFIG_HOME")


def _file_path(root: str | None, config: str | None) -> FilePath:
    """The FilePath ``sf://`` uses: the router's path at ``root`` when one is given (made if missing), else its
    ``dataset`` path, whose root is ``SFSTORE_ROOT``, else the config file's ``root`` (``[classes.dataset]`` may
    override it), else the embedded data directory (``SFSTORE_DATA_DIR``); see :mod:`sfstore.router`."""
    from sfstore import router

    opened = router.open(config)
    return opened.location(root, create=True) if root is not None else opened.file_path("dataset")


class _ConfigToken:
    """Class attribute whose value is what a root-less instance reads its configuration from.

    fsspec caches instances by their arguments (and the class attributes named in
    ``_extra_tokenize_attributes``); this makes a change of ``SFSTORE_ROOT`` (or the config file that applies)
    give a new instance instead of the cached one.
    """

    def __get__(self, obj: object, owner: type | None = None) -> tuple[str | None, ...]:
        try:
            cwd: str | None = os.getcwd()
        except OSError:
            cwd = None
        return (*(os.environ.get(k) for k in _ENV_KEYS), cwd)


def _normalize(text: str) -> str:
    """The root-relative name of ``text`` (``""`` for the root): leading slashes mean the root, repeated
    slashes count once, ``.`` and ``..`` are folded lexically.

    Raises :class:`~sfstore.errors.PathEscapeError` where ``..`` would climb above the root.
    """
    if "\x00" in text:
        raise errors.PathEscapeError(f"path {text!r} contains a NUL byte")
    return "/".join(fold_parts(text, "the sf:// root"))


def _url(name: str) -> str:
    return "sf://" + name


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def other_scheme(text: str) -> str | None:
    """The scheme of ``text`` when it is a URL of a scheme other than ``sf`` (``"s3"`` for ``s3://b/x``), else
    ``None`` (``sf://`` URLs, ``sf::`` and plain paths)."""
    found = _SCHEME.match(text)
    if found is None or text.startswith("sf://"):
        return None
    return found.group(0)[:-3]


def refuse_other_schemes(text: str) -> None:
    """An :class:`~sfstore.errors.InvalidRequestError` for a URL of another scheme (``s3://b/x``,
    ``file:///x``, ``https://...``): ``sf://`` names only files beneath its root, and a foreign URL taken for a
    name would read ``<root>/s3:/b/x``. ``sf://`` URLs, ``sf::`` and plain paths pass."""
    scheme = other_scheme(text)
    if scheme is not None:
        raise errors.InvalidRequestError(
            f"{text!r}: {scheme}:// URLs are not sf:// paths; the sf filesystem takes sf:// URLs and paths beneath "
            f"its root (a leading '/' is the root). Read {scheme}:// with its own filesystem "
            f"(fsspec.filesystem({scheme!r}))"
        )


F = TypeVar("F", bound=Callable[..., Any])


def _sf_terms(exc: BaseException, root: str) -> BaseException:
    """``exc`` naming the ``sf://`` URL instead of the host path, where it is a typed OS error about a path
    beneath ``root`` (what the caller asked for is an ``sf://`` name); anything else as it is."""
    if not isinstance(exc, errors.SfstoreOSError) or isinstance(exc, errors.NvmeError):
        return exc
    name = exc.filename
    if not isinstance(name, str) or not (name == root or name.startswith(root.rstrip("/") + "/")):
        return exc
    url = _url(os.path.relpath(name, root) if name != root else "")
    return type(exc)(exc.errno, exc.strerror, url)


def _in_sf_terms(method: F) -> F:
    """Errors of ``method`` name ``sf://`` URLs, never the host paths beneath the root (see :func:`_sf_terms`)."""

    @functools.wraps(method)
    def run(self: SFFileSystem, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except errors.SfstoreOSError as exc:
            mapped = _sf_terms(exc, self.root)
            if mapped is exc:
                raise
            raise mapped from None

    return run  # type: ignore[return-value]


def _typed(exc: OSError, context: str, name: str) -> errors.SfstoreError:
    """``exc`` as sfstore's typed error naming the ``sf://`` URL (already-typed errors pass through)."""
    if isinstance(exc, errors.SfstoreError):
        return exc
    return errors.os_error(exc.errno or errno.EIO, context, _url(name))


# A name that is not there for exists/isdir/isfile, as os.path has it: missing, a file on the way, a name too
# long for the filesystem, a symlink loop. Escapes still raise PathEscapeError.
_ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP})


def _absent(exc: OSError) -> bool:
    return not isinstance(exc, errors.PathEscapeError) and exc.errno in _ABSENT_ERRNOS


def local_path(url: str | os.PathLike[str], *, root: str | None = None, config: str | None = None) -> str:
    """The host path the ``sf://`` url ``url`` names: for tools that take plain paths.

    ``local_path("sf://runs/exp1")`` is ``<root>/runs/exp1`` (symlinks resolved), what
    :class:`SFFileSystem` reads and writes as ``sf://runs/exp1``, so a tool that writes plain files -- Hugging
    Face ``Trainer(output_dir=local_path("sf://runs/exp1"))``, ``accelerator.save_state(local_path(...))``,
    ``torch.save`` -- writes where ``sf://`` (and ``sfstore.checkpoint``) find it.

    Parameters
    ----------
    url : str or os.PathLike
        An ``sf://`` url, or a root-relative name in any spelling :class:`SFFileSystem` takes (``a/b``,
        ``/a/b``: a leading ``/`` is the root). The name need not exist.
    root, config : str, optional
        As for :class:`SFFileSystem` (default: the router's ``dataset`` path, which ``sf://`` uses).

    Returns
    -------
    str
        The absolute host path, beneath the root (the root itself for ``sf://``).

    Raises
    ------
    sfstore.errors.PathEscapeError
        ``..`` above the root, a NUL byte, or a symlink on the way that resolves outside the root.
    sfstore.errors.InvalidRequestError
        A url of another scheme (``s3://...``).

    Notes
    -----
    The answer is a name, true when computed. What a tool then does with it goes through the host's
    filesystem, not through sfstore: none of ``sf://``'s guarantees (atomic publication, names resolved
    beneath the root at each use) cover those writes.
    """
    text = stringify_path(url)
    if not isinstance(text, str):
        raise errors.InvalidRequestError(f"an sf:// url must be text, not {type(text).__name__}")
    if "://" in text and not text.startswith("sf://"):
        raise errors.InvalidRequestError(f"local_path takes sf:// urls (or root-relative names), not {text!r}")
    name = SFFileSystem._strip_protocol(text)
    return _file_path(root, config).resolve(name)


def writes_in_place(lpath: str) -> bool:
    """Whether the local destination ``lpath`` is written in place rather than published by rename.

    Publishing (a temporary name, then ``rename``) replaces the directory entry: right for a regular file or
    a new name, wrong for an existing FIFO, device or socket (it would become a regular file) and for a
    symlink, which is written through so the link stays and its target gets the bytes, as ``cp`` does. That
    covers ``/dev/stdout`` and ``/dev/fd/N`` (symlinks to ``/proc/self/fd``) and ``/dev/null``; a regular file
    in ``/dev/shm`` is still published atomically.
    """
    try:
        st = os.lstat(lpath)
    except OSError:
        return False  # a new name (or an error the publishing path reports)
    return stat.S_ISLNK(st.st_mode) or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


def open_in_place(lpath: str) -> int:
    """Open the local ``lpath`` for writing in place (following symlinks, no rename); a regular target is
    truncated first."""
    try:
        fd = os.open(lpath, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "cannot write", lpath) from None
    return fd


def write_all(fd: int, data: Any, name: str) -> None:
    """``write(2)`` all of ``data`` to ``fd`` in order (a pipe, a FIFO, a terminal take it in pieces)."""
    view = memoryview(data).cast("B")
    try:
        while view.nbytes:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "cannot write", name) from None


def _aligned_buffer(n: int) -> mmap.mmap:
    """``n`` bytes of page-aligned private anonymous memory, so O_DIRECT moves data without a bounce buffer.

    Private: a forked child gets a copy-on-write view, not memory shared with its parent. Never closed
    explicitly: the mapping goes when the last view of it does.
    """
    return mmap.mmap(-1, max(1, n), flags=mmap.MAP_PRIVATE)


def _bounds(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    """Python-slice bounds (``None``, negative from the end) clamped to ``[0, size]``."""
    s = 0 if start is None else (start + size if start < 0 else start)
    e = size if end is None else (end + size if end < 0 else end)
    s = min(max(s, 0), size)
    e = min(max(e, s), size)
    return s, e


@dataclass
class _Span:
    """One read of ``cat_ranges``: the bytes ``[start, end)`` of a file, covering the ranges ``members``
    (indices into the caller's lists) that lie in it."""

    start: int
    end: int
    members: list[int]


def _open_local(path: str, flags: int) -> int:
    """``os.open`` of a local file outside the root (``O_CLOEXEC`` added, no O_DIRECT: a copy's local side
    goes through the page cache); a failure is the typed error naming ``path``."""
    try:
        return os.open(path, flags | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "cannot open", path) from None


class SFFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """fsspec filesystem over sfstore's file path: ``sf://`` names files under one root directory.

    Parameters
    ----------
    root : str, optional
        The directory ``sf://`` names. Default: the router's ``dataset`` path — ``SFSTORE_ROOT``, else the
        config file's ``root``, else the embedded data directory ``SFSTORE_DATA_DIR``.
    config : str, optional
        sfstore config file for the router (default: ``SFSTORE_CONFIG``, ``./sfstore.toml``, the user's).
    **storage_options
        fsspec options (``skip_instance_cache``, ``use_listings_cache``, ...).

    Notes
    -----
    **Paths.** Every name is relative to the root, and every form names the same file::

        sf://train/0001.tar   sf:///train/0001.tar   /train/0001.tar   train/0001.tar   ->  <root>/train/0001.tar

    A leading ``/`` means the root, never the host's ``/``: ``sf:///etc/passwd`` is ``<root>/etc/passwd``, so
    an absolute path cannot name anything outside the root. Names this filesystem returns (``ls``, ``glob``,
    ``walk``, ``info``) are root-relative without a leading slash, ``train/0001.tar``, and the root itself is
    ``""`` (as an object store names ``bucket/key``); :meth:`unstrip_protocol` gives ``sf://train/0001.tar``,
    and so does ``str(UPath(...))``. :meth:`find` alone names what it finds in the spelling of the path it was
    given (``find("sf://train")`` -> ``sf://train/0001.tar``), which is what pyarrow's dataset discovery
    needs to take any of the three forms (``ds.dataset("sf://train", filesystem=fs)``). ``.`` and ``..`` are
    folded before use; ``..`` above the root (``sf://../x``, ``a/../../x``), and symlinks that resolve outside
    the root, raise :class:`~sfstore.errors.PathEscapeError` (a ``PermissionError``). Symlinks that stay inside
    the root are followed for content; ``rm`` and ``mv`` act on the link itself. ``ls`` hides sfstore's
    in-progress temporary files, and lists a symlink that points out of the root (or nowhere) as type
    ``"other"``. Every operation resolves its name beneath the root without a check-then-use window
    (:mod:`sfstore.paths.beneath`): a directory swapped for a symlink to elsewhere while it runs makes it fail,
    never read, write, move or delete outside. ``exists``, ``isdir`` and ``isfile`` say ``False`` for a missing
    name, a name too long or a symlink loop (as ``os.path`` does).

    **Special files.** Only regular files are read: a FIFO, socket or device in the tree raises
    :class:`~sfstore.errors.NotARegularFileError` at once (it is opened without blocking), a directory
    :class:`~sfstore.errors.IsADirectoryPathError`; ``info`` and ``ls`` report them as type ``"other"``.
    ``get_file`` writes an existing local FIFO, device or symlink (and ``/dev/stdout``) in place.

    **Reads.** :meth:`cat_file` reads straight into the returned ``bytes``; :meth:`read_into` into a caller's
    buffer (numpy, torch, registered buffers; GPU arrays through pinned bounce buffers) and
    :meth:`cat_ranges_into` into host buffers; :meth:`cat` of many paths is one pipelined batch
    (:meth:`FilePath.read_many`); :meth:`cat_ranges` merges ranges at most ``max_gap`` apart and reads each
    file's ranges in one batch of the file path. :meth:`open` in ``rb`` returns an
    :class:`SFFile` whose default cache reads ahead through the engine while the caller consumes data.

    **Writes.** ``pipe_file``, ``put_file``, ``cp_file`` and files opened ``wb``/``xb`` write to a temporary
    name and rename it into place on close, so readers see the old content or the new, never a part; a write
    that fails (or a ``with`` block that raises) leaves the old content. ``ab`` is atomic too: the existing
    bytes are copied into the new version first (so it costs a copy of the file, and of two concurrent
    appenders the last to close wins).

    **Processes.** Instances are cached per arguments (and per the configuration a root-less instance reads);
    they pickle by arguments and work in forked ``DataLoader`` workers (a forked child gets its own I/O engine).
    """

    protocol = "sf"
    root_marker = ""
    cachable = True
    _extra_tokenize_attributes = ("_config_token",)
    _config_token = _ConfigToken()

    def __init__(self, root: str | None = None, config: str | None = None, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self.file_path: FilePath = _file_path(root, config)
        self.root: str = self.file_path.root
        chunk = self.file_path.chunk_size
        self.blocksize = min(32 * MiB, 4 * chunk)  # readahead window of open() files, block of copies

    # -- names -----------------------------------------------------------------------------------------------

    @classmethod
    def name_of(cls, url: str | os.PathLike[str]) -> str:
        """The name beneath the root that ``url`` means: ``sf://a/b``, ``sf:///a/b``, ``/a/b`` and ``a/b`` are
        all ``a/b``."""
        return str(cls._strip_protocol(url))

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        """``sf://a/b``, ``sf:///a/b``, ``/a/b`` and ``a/b`` -> ``a/b`` (see the class notes); lists element-wise."""
        if isinstance(path, (list, tuple)):
            return [cls._strip_protocol(p) for p in path]
        text = stringify_path(path)
        if isinstance(text, str):
            refuse_other_schemes(text)
        for prefix in ("sf://", "sf::"):
            if text.startswith(prefix):
                text = text[len(prefix):]
                break
        return _normalize(text)

    def expand_path(self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> list[str]:
        """fsspec's expansion of globs, lists and (``recursive``) directories; nothing found raises the typed
        :class:`~sfstore.errors.PathNotFoundError` (fsspec raises a bare ``FileNotFoundError``)."""
        try:
            return list(super().expand_path(path, recursive=recursive, maxdepth=maxdepth, **kwargs))
        except FileNotFoundError as exc:
            if isinstance(exc, errors.SfstoreError):
                raise
            raise errors.os_error(errno.ENOENT, "no such path", _url(str(self._strip_protocol(path)))) from None

    def unstrip_protocol(self, name: str) -> str:
        """The URL of a name: ``a/b`` -> ``sf://a/b``."""
        return "sf://" + str(self._strip_protocol(name))

    @property
    def fsid(self) -> str:
        """Identifies the filesystem across sessions: the protocol and the root."""
        return f"sf:{self.root}"

    @property
    def counters(self) -> PathCounters:
        """The file path's counters (requests, files, bytes read/written, direct vs bounced, errors)."""
        return self.file_path.counters

    def _host(self, path: Any) -> str:
        """The host path that ``path`` names (symlinks not resolved): for messages only; every operation
        resolves names beneath the root through the file path's namespace methods."""
        return self.file_path.full(self._strip_protocol(path))

    def _stat(self, name: str, context: str = "cannot access", follow: bool = True) -> os.stat_result:
        """``stat`` (or ``lstat``) of the root-relative ``name``, resolved beneath the root."""
        try:
            return self.file_path.os_stat(name, follow=follow)
        except OSError as exc:
            raise _typed(exc, context, name) from None

    def _open_file(self, name: str) -> OpenFile:
        """The regular file ``name`` opened for reading (a directory, FIFO or device: a typed error)."""
        return self.file_path.open_file(name)

    # -- metadata --------------------------------------------------------------------------------------------

    @staticmethod
    def _make_info(name: str, st: os.stat_result, islink: bool, kind: str | None = None) -> dict[str, Any]:
        if kind is None:
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
        return {
            "name": name,
            "size": 0 if kind == "directory" else st.st_size,
            "type": kind,
            "created": getattr(st, "st_birthtime", st.st_ctime),
            "mtime": st.st_mtime,
            "islink": islink,
            "mode": st.st_mode,
            "uid": st.st_uid,
            "gid": st.st_gid,
            "ino": st.st_ino,
            "nlink": st.st_nlink,
        }

    @_in_sf_terms
    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        """Details of ``path``: name, size, type (file/directory/other), created, mtime, islink, mode, ...

        A symlink inside the root reports its target; one that points out raises :class:`PathEscapeError`.
        """
        name = self._strip_protocol(path)
        lst = self._stat(name, "cannot access", follow=False)
        if not stat.S_ISLNK(lst.st_mode):
            return self._make_info(name, lst, False)
        return self._make_info(name, self._stat(name, "cannot access"), True)

    def _dirent_info(self, name: str, lst: os.stat_result) -> dict[str, Any]:
        if not stat.S_ISLNK(lst.st_mode):
            return self._make_info(name, lst, False)
        try:
            return self._make_info(name, self.file_path.os_stat(name), True)
        except OSError:  # dangling, or pointing out of the root (PathEscapeError)
            return self._make_info(name, lst, True, kind="other")

    @_in_sf_terms
    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        """Entries of a directory (sorted by name, sfstore's temporary files hidden), or ``[info]`` of a file."""
        name = self._strip_protocol(path)
        try:
            st = self.file_path.os_stat(name)
            if not stat.S_ISDIR(st.st_mode):
                info = self.info(name)
                return [info] if detail else [name]
            out: list[dict[str, Any]] = []
            if not detail:
                for entry in self.file_path.listdir(name):
                    if not self.file_path.is_temporary(entry):
                        out.append({"name": posixpath.join(name, entry)})
            else:
                for entry, lst in self.file_path.scandir(name):
                    if lst is None or self.file_path.is_temporary(entry):  # removed while listing, or a writer's
                        continue
                    out.append(self._dirent_info(posixpath.join(name, entry), lst))
        except OSError as exc:
            raise _typed(exc, "cannot list", name) from None
        out.sort(key=lambda d: str(d["name"]))
        return out if detail else [d["name"] for d in out]

    def find(
        self, path: Any, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any
    ) -> Any:
        """Everything below ``path`` (fsspec's ``find``), named in the spelling ``path`` was given in.

        ``find("ds")`` names ``ds/a/x.parquet``; ``find("sf://ds")`` names ``sf://ds/a/x.parquet`` and
        ``find("/ds")`` ``/ds/a/x.parquet``: each name is the given path followed by the rest. pyarrow needs
        this: its ``FSSpecHandler`` passes the caller's path to ``find`` unchanged (its ``normalize_path`` is
        the identity), and dataset discovery refuses every name found that does not start with that path
        ("GetFileInfo() yielded path ... outside base dir"). fsspec's own methods strip the protocol before
        they call ``find``, so they see root-relative names as before; ``ls``, ``glob``, ``walk`` and ``info``
        always name root-relative paths.
        """
        base = self._strip_protocol(path)
        found: dict[str, dict[str, Any]] = super().find(
            base, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs
        )
        text = str(stringify_path(path))
        if base == "":
            head = text if text == "" or text.endswith("/") else text + "/"
        else:
            head = text.rstrip("/")
        if head == base:
            return found if detail else list(found)

        def spelled(name: str) -> str:
            if base == "":
                return head + name  # names below the root have no leading slash
            if name == base or name.startswith(base + "/"):
                return head + name[len(base):]
            return name

        out: dict[str, dict[str, Any]] = {}
        for name, info in found.items():
            key = spelled(name)
            out[key] = {**info, "name": key} if info else info
        return out if detail else list(out)

    def exists(self, path: Any, **kwargs: Any) -> bool:
        """Whether ``path`` exists; a path that escapes the root raises :class:`PathEscapeError`."""
        try:
            self.info(path)
        except OSError as exc:
            if _absent(exc):
                return False
            raise
        return True

    def _mode(self, path: Any, follow: bool = True) -> int | None:
        """The ``st_mode`` of ``path``, or ``None`` where it is absent (see :func:`_absent`)."""
        name = self._strip_protocol(path)
        try:
            return self.file_path.os_stat(name, follow=follow).st_mode
        except OSError as exc:
            if _absent(exc):
                return None
            raise _typed(exc, "cannot access", name) from None

    def lexists(self, path: Any, **kwargs: Any) -> bool:
        """Whether the entry exists (a broken symlink counts)."""
        return self._mode(path, follow=False) is not None

    def isdir(self, path: Any) -> bool:
        """Whether ``path`` is a directory (a missing or too long name is not; an escape raises)."""
        mode = self._mode(path)
        return mode is not None and stat.S_ISDIR(mode)

    def isfile(self, path: Any) -> bool:
        """Whether ``path`` is a regular file (a missing or too long name is not; an escape raises)."""
        mode = self._mode(path)
        return mode is not None and stat.S_ISREG(mode)

    def islink(self, path: Any) -> bool:
        mode = self._mode(path, follow=False)
        return mode is not None and stat.S_ISLNK(mode)

    def size(self, path: Any) -> int:
        return int(self.info(path)["size"])

    def created(self, path: Any) -> datetime.datetime:
        """Creation time (birth time where the filesystem records it, else the inode change time), UTC."""
        return datetime.datetime.fromtimestamp(self.info(path)["created"], tz=datetime.timezone.utc)

    def modified(self, path: Any) -> datetime.datetime:
        """Last modification time, UTC."""
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)

    @_in_sf_terms
    def ukey(self, path: Any) -> str:
        """Changes whenever the file's content may have: hash of inode, size and modification/change times."""
        st = self._stat(self._strip_protocol(path))
        key = f"{self.root}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        return hashlib.sha256(key.encode()).hexdigest()

    # -- reads -----------------------------------------------------------------------------------------------

    @_in_sf_terms
    def cat_file(self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (slice semantics), read through the engine straight into the
        returned ``bytes`` (parallel chunks for large files). Only regular files are read: a FIFO, socket or
        device raises :class:`~sfstore.errors.NotARegularFileError` (without waiting on it)."""
        with self._open_file(self._strip_protocol(path)) as f:
            s, e = _bounds(start, end, f.size)
            return f.read(s, e - s)

    @_in_sf_terms
    def read_into(self, path: Any, buffer: Any, offset: int = 0, length: int | None = None) -> int:
        """Read ``path`` from ``offset`` into ``buffer`` (numpy, torch, registered buffer, GPU array, ...).

        ``length`` defaults to the buffer's size; returns the bytes read (fewer only at end of file). No
        intermediate ``bytes`` object: the engine writes into ``buffer`` (see :meth:`FilePath.read_into`).
        """
        return self.file_path.read_into(self._strip_protocol(path), buffer, offset, length)

    @_in_sf_terms
    def cat(
        self, path: Any, recursive: bool = False, on_error: str = "raise", **kwargs: Any
    ) -> bytes | dict[str, bytes | BaseException]:
        """Contents of one path (``bytes``), or of many (``{name: bytes}``) read in one pipelined batch.

        ``path`` may be a list, a glob or (``recursive=True``) a directory; directories themselves are skipped.
        ``on_error``: ``"raise"`` the first error, ``"omit"`` failed paths, or ``"return"`` the exception in
        their place.
        """
        if on_error not in ("raise", "omit", "return"):
            raise errors.InvalidRequestError(f"on_error must be 'raise', 'omit' or 'return', not {on_error!r}")
        names: list[str] = self.expand_path(path, recursive=recursive)
        if len(names) == 1 and not isinstance(path, (list, tuple)) and names[0] == self._strip_protocol(path):
            return self.cat_file(names[0])
        explicit = not recursive and not any(has_magic(str(p)) for p in (path if isinstance(path, list) else [path]))
        got = self.file_path.read_many(names, on_error="return")
        out: dict[str, bytes | BaseException] = {}
        for name, value in zip(names, got, strict=True):
            if isinstance(value, BaseException):
                value = _sf_terms(value, self.root)
                if isinstance(value, IsADirectoryError) and not explicit:
                    continue  # a directory found by the expansion: nothing to read
                if on_error == "raise":
                    raise value
                if on_error == "omit":
                    continue
            out[name] = value
        return out

    @_in_sf_terms
    def cat_ranges(
        self,
        paths: list[Any],
        starts: int | list[int | None] | None,
        ends: int | list[int | None] | None,
        max_gap: int | None = None,
        on_error: str = "return",
        max_block: int = 64 * MiB,
        **kwargs: Any,
    ) -> list[bytes | BaseException]:
        """Byte ranges ``[starts[i], ends[i])`` of ``paths[i]`` (slice semantics), coalesced and batched.

        Per file, ranges at most ``max_gap`` bytes apart (default 64 KiB) are merged into one read of at most
        ``max_block`` bytes, and all of a file's reads go to the file path as one batch. ``on_error="return"``
        puts a file's exception in place of each of its ranges; ``"raise"`` raises it.
        """
        n = len(paths)
        starts_l = starts if isinstance(starts, list) else [starts] * n
        ends_l = ends if isinstance(ends, list) else [ends] * n
        if len(starts_l) != n or len(ends_l) != n:
            raise errors.InvalidRequestError("cat_ranges: paths, starts and ends differ in length")
        gap = 64 * 1024 if max_gap is None else max_gap
        out: list[bytes | BaseException] = [b""] * n
        for name, members in self._group_by_file(paths).items():
            try:
                with self._open_file(name) as f:
                    self._read_coalesced(f, members, starts_l, ends_l, gap, max_block, out)
            except Exception as exc:
                if on_error != "return":
                    raise
                for i in members:
                    out[i] = _sf_terms(exc, self.root)
        return out

    def _group_by_file(self, paths: Sequence[Any]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(paths):
            groups.setdefault(self._strip_protocol(p), []).append(i)
        return groups

    @staticmethod
    def _read_coalesced(
        f: OpenFile,
        members: list[int],
        starts: list[int | None],
        ends: list[int | None],
        gap: int,
        max_block: int,
        out: list[bytes | BaseException],
    ) -> None:
        size = f.size
        spans = {i: _bounds(starts[i], ends[i], size) for i in members}
        merged: list[_Span] = []
        for i in sorted(members, key=lambda j: spans[j]):
            s, e = spans[i]
            if merged and s <= merged[-1].end + gap and max(e, merged[-1].end) - merged[-1].start <= max_block:
                merged[-1].end = max(merged[-1].end, e)
                merged[-1].members.append(i)
            else:
                merged.append(_Span(s, e, [i]))
        reads = [m for m in merged if m.end > m.start]
        if not reads:
            return
        bufs = [bytes_for_filling(m.end - m.start) for m in reads]
        try:
            got = f.read_ranges_into([(m.start, m.end - m.start, v, 0) for m, (_, v) in zip(reads, bufs, strict=True)])
        finally:
            for _, view in bufs:
                view.release()
        for m, (data, _), n in zip(reads, bufs, got, strict=True):
            whole = len(m.members) == 1 and spans[m.members[0]] == (m.start, m.end)
            for i in m.members:
                s, e = spans[i]
                e = min(e, m.start + n)
                out[i] = filled_bytes(data, n) if whole else bytes(memoryview(data)[s - m.start: max(s, e) - m.start])

    @_in_sf_terms
    def cat_ranges_into(
        self,
        paths: list[Any],
        starts: int | list[int],
        ends: int | list[int],
        buffers: Sequence[Any],
    ) -> list[int]:
        """Read ranges ``[starts[i], ends[i])`` of ``paths[i]`` into ``buffers[i]``; return bytes read per range.

        Ranges are absolute, non-negative offsets; each buffer must hold its range. Each file's ranges go to the
        file path as one batch, straight into the buffers (no intermediate ``bytes``). Raises the first error.
        """
        n = len(paths)
        starts_l = starts if isinstance(starts, list) else [starts] * n
        ends_l = ends if isinstance(ends, list) else [ends] * n
        if len(starts_l) != n or len(ends_l) != n or len(buffers) != n:
            raise errors.InvalidRequestError("cat_ranges_into: paths, starts, ends and buffers differ in length")
        out = [0] * n
        for name, members in self._group_by_file(paths).items():
            for i in members:
                if starts_l[i] < 0 or ends_l[i] < starts_l[i]:
                    raise errors.InvalidRequestError(f"bad range [{starts_l[i]}, {ends_l[i]}) for {name}")
            got = self.file_path.read_ranges_into(
                name, [(starts_l[i], ends_l[i] - starts_l[i], buffers[i], 0) for i in members]
            )
            for i, k in zip(members, got, strict=True):
                out[i] = k
        return out

    # -- streaming copies ------------------------------------------------------------------------------------

    def _pump(
        self,
        start: Callable[[int, memoryview], Future[int]],
        size: int,
        sink: Callable[[memoryview], Any],
        callback: Any = DEFAULT_CALLBACK,
    ) -> int:
        """Move ``size`` bytes from a source to a sink in blocks, reading the next block while writing this one.

        ``start(pos, view)`` begins reading into ``view`` and returns something with ``get()`` (bytes read);
        ``sink(view)`` consumes a block.
        """
        if size <= 0:
            return 0
        block = min(self.blocksize, size)
        views = [memoryview(_aligned_buffer(block)) for _ in range(1 if size <= block else 2)]
        pos, i, total = 0, 0, 0
        pending: Future[int] | None = start(0, views[0][:block])
        try:
            while pending is not None:
                want = min(block, size - pos)
                got = int(pending.get())
                pending = None
                if got == want and pos + got < size:
                    j = (i + 1) % len(views)
                    pending = start(pos + got, views[j][: min(block, size - pos - got)])
                sink(views[i][:got])
                callback.relative_update(got)
                total += got
                pos += got
                i = (i + 1) % len(views)
        finally:
            if pending is not None:  # an error while a read is in flight: let it finish before freeing its buffer
                with contextlib.suppress(Exception):
                    pending.get()
        return total

    @staticmethod
    def _sf_source(f: OpenFile) -> Callable[[int, memoryview], Future[int]]:
        return lambda pos, view: f.read_into_async(view, pos, view.nbytes)

    def _local_source(self, fd: int) -> Callable[[int, memoryview], Future[int]]:
        """Reads of the local file ``fd`` through the file path (which splits and counts them)."""
        fp = self.file_path

        def start(pos: int, view: memoryview) -> Future[int]:
            return MappedFuture(fp.submit([Range.read(pos, view.nbytes, view, 0, fd)]), sum)

        return start

    def _local_sink(self, fd: int) -> Callable[[memoryview], None]:
        """Writes to the local file ``fd``, in order from offset 0, through the file path."""
        fp = self.file_path
        offset = [0]

        def sink(view: memoryview) -> None:
            fp.submit([Range.write(offset[0], view.nbytes, view, 0, fd)]).get()
            offset[0] += view.nbytes

        return sink

    @_in_sf_terms
    def pipe_file(self, path: Any, value: Any, mode: str = "overwrite", **kwargs: Any) -> None:
        """Write ``value`` (bytes-like, numpy, CPU tensor) as the whole of ``path``, atomically.

        ``mode="create"`` refuses an existing file (``FileExistsError``); ``fsync=True`` makes it durable.
        """
        self.file_path.write(
            self._strip_protocol(path), value, overwrite=mode != "create", fsync=bool(kwargs.get("fsync", False))
        )

    @_in_sf_terms
    def put_file(
        self, lpath: Any, rpath: Any, callback: Any = DEFAULT_CALLBACK, mode: str = "overwrite", **kwargs: Any
    ) -> None:
        """Copy the local file ``lpath`` to ``rpath``: read through the file path, published atomically.

        A local FIFO or character device (``/dev/stdin``) is read as a stream to its end.
        """
        lpath = os.fspath(lpath)
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        fd = _open_local(lpath, os.O_RDONLY)
        try:
            self.put_fd(fd, rpath, name=lpath, mode=mode, callback=callback)
        finally:
            os.close(fd)

    @_in_sf_terms
    def put_fd(self, fd: int, rpath: str, *, name: str | None = None, mode: str = "overwrite",
               callback: Any = DEFAULT_CALLBACK) -> int:
        """Write what the open descriptor ``fd`` holds or yields to ``rpath``, committed atomically.

        Parameters
        ----------
        fd : int
            A regular file (all of it, read in parallel) or a pipe, FIFO or terminal (read until
            its end). The caller keeps and closes it.
        rpath : str
            The file to write (``sf://`` URL or name beneath the root).
        name : str, optional
            What error messages call the source (default ``fd <n>``).
        mode : {"overwrite", "create"}
            ``create`` refuses an existing file.
        callback : fsspec.callbacks.Callback, optional
            Told the size (regular files) and each chunk written.

        Returns
        -------
        int
            Bytes written.
        """
        label = name if name is not None else f"fd {fd}"
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EBADF, "cannot stat", label) from None
        with self.file_path.open_writer(self._strip_protocol(rpath), overwrite=mode != "create") as w:
            if stat.S_ISREG(st.st_mode):
                callback.set_size(st.st_size)
                self._pump(self._local_source(fd), st.st_size, w.write, callback)
                return int(st.st_size)
            return self._stream_into(fd, label, w, callback)

    def _stream_into(self, fd: int, name: str, writer: AtomicWriter, callback: Any = DEFAULT_CALLBACK) -> int:
        """Copy what ``fd`` (a pipe, FIFO, terminal) yields until its end into ``writer``."""
        total = 0
        while True:
            try:
                data = os.read(fd, self.blocksize)
            except OSError as exc:
                raise errors.os_error(exc.errno or errno.EIO, "cannot read", name) from None
            if not data:
                return total
            writer.write(data)
            callback.relative_update(len(data))
            total += len(data)

    @_in_sf_terms
    def get_file(
        self,
        rpath: Any,
        lpath: Any,
        callback: Any = DEFAULT_CALLBACK,
        outfile: Any = None,
        **kwargs: Any,
    ) -> None:
        """Copy ``rpath`` to the local file ``lpath`` or to ``outfile``.

        A regular file or a new name is written to a temporary name and renamed into place; an existing FIFO,
        device or socket, and a symlink (``/dev/stdout`` is one) are written in place (see
        :func:`writes_in_place`).
        """
        if outfile is None and isfilelike(lpath):
            outfile = lpath
        name = self._strip_protocol(rpath)
        if outfile is None and self.isdir(name):
            os.makedirs(lpath, exist_ok=True)
            return
        with self._open_file(name) as f:
            size = f.size
            callback.set_size(size)
            if outfile is not None:
                self._pump(self._sf_source(f), size, outfile.write, callback)
                return
            lpath = os.path.abspath(os.fspath(lpath))
            if writes_in_place(lpath):
                fd = open_in_place(lpath)
                try:
                    self._pump(self._sf_source(f), size, lambda view: write_all(fd, view, lpath), callback)
                finally:
                    os.close(fd)
                return
            os.makedirs(os.path.dirname(lpath), exist_ok=True)
            head, tail = os.path.split(lpath)
            try:
                dirfd = os.open(head, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:  # named as the file asked for
                raise errors.os_error(exc.errno or errno.EIO, "cannot write", lpath) from None
            try:
                with contextlib.ExitStack() as stack:
                    try:
                        fd = stack.enter_context(records.atomic_file(dirfd, tail, kind="part"))
                    except OSError as exc:  # named as the file asked for, not its temporary name
                        raise errors.os_error(exc.errno or errno.EIO, "cannot write", lpath) from None
                    self._pump(self._sf_source(f), size, self._local_sink(fd), callback)
            finally:
                os.close(dirfd)

    @_in_sf_terms
    def cp_file(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        """Copy a file within the root through the engine, published atomically (a directory: made)."""
        src = self._strip_protocol(path1)
        if stat.S_ISDIR(self._stat(src).st_mode):
            self.makedirs(path2, exist_ok=True)
            return
        with self._open_file(src) as f, self.file_path.open_writer(self._strip_protocol(path2)) as w:
            self._pump(self._sf_source(f), f.size, w.write, kwargs.get("callback", DEFAULT_CALLBACK))

    # -- namespace -------------------------------------------------------------------------------------------

    @_in_sf_terms
    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        name = self._strip_protocol(path)
        try:
            if name == "" or self.lexists(name):
                raise FileExistsError(errno.EEXIST, "exists", self._host(name))
            self.file_path.mkdir(name, parents=create_parents)
        except OSError as exc:
            raise _typed(exc, "cannot create the directory", name) from None

    @_in_sf_terms
    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        name = self._strip_protocol(path)
        try:
            if name == "":
                if not exist_ok:
                    raise FileExistsError(errno.EEXIST, "exists", self.root)
                return
            self.file_path.mkdir(name, parents=True, exist_ok=exist_ok)
        except OSError as exc:
            raise _typed(exc, "cannot create the directory", name) from None

    @_in_sf_terms
    def rmdir(self, path: Any) -> None:
        """Remove an empty directory (never the root)."""
        name = self._strip_protocol(path)
        if name == "":
            raise errors.InvalidRequestError("refusing to remove the sf:// root")
        try:
            self.file_path.rmdir(name)
        except OSError as exc:
            raise _typed(exc, "cannot remove the directory", name) from None

    @_in_sf_terms
    def rm_file(self, path: Any) -> None:
        """Remove a file (a symlink: the link itself)."""
        name = self._strip_protocol(path)
        if name == "":
            raise errors.InvalidRequestError("refusing to remove the sf:// root")
        try:
            self.file_path.unlink(name)
        except OSError as exc:
            raise _typed(exc, "cannot remove", name) from None

    def _rm(self, path: Any) -> None:
        self.rm_file(path)

    @_in_sf_terms
    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Remove files, and with ``recursive=True`` directories with what they hold (globs expand).

        Symlinks are removed, never followed (directories are walked by descriptor, so one swapped for a
        symlink meanwhile is removed as a link). With ``maxdepth``, entries deeper than ``maxdepth`` levels
        below a directory stay, and so do the directories holding them. The root itself is never removed.
        """
        names: list[str] = []
        for p in path if isinstance(path, (list, tuple)) else [path]:
            name = self._strip_protocol(p)
            if has_magic(name):
                found = self.glob(name)
                if not found:
                    raise errors.os_error(errno.ENOENT, "nothing matches the pattern", _url(name))
                names.extend(found)
            else:
                names.append(name)
        fp = self.file_path
        for name in sorted(set(names), reverse=True):  # children before their parents
            if name == "":
                raise errors.InvalidRequestError("refusing to remove the sf:// root")
            try:
                lst = fp.os_stat(name, follow=False)
                if not stat.S_ISDIR(lst.st_mode):
                    fp.unlink(name)
                elif not recursive:
                    raise errors.os_error(errno.EISDIR, "cannot remove a directory without recursive=True",
                                          _url(name))
                else:
                    fp.rmtree(name, maxdepth)
            except OSError as exc:
                raise _typed(exc, "cannot remove", name) from None

    @_in_sf_terms
    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        """Move a file or directory: one ``rename`` within the root (copy and remove across mounts).

        As ``mv`` does, a move onto an existing directory (or onto ``"dir/"``, made if missing) moves into it.
        Lists and globs move one by one through copy and remove.
        """
        if isinstance(path1, (list, tuple)) or isinstance(path2, (list, tuple)) or has_magic(str(path1)):
            super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
            return
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if src == "":
            raise errors.InvalidRequestError("refusing to move the sf:// root")
        if src == dst:
            return
        self._stat(src, "cannot move", follow=False)  # a missing source is an error before anything is made
        if isinstance(path2, str) and path2.endswith("/") and not self.isdir(dst):
            self.makedirs(dst, exist_ok=True)  # "dir/" names a directory, made if missing (as fsspec's copy does)
        if self.isdir(dst):
            dst = posixpath.join(dst, posixpath.basename(src))
        try:
            self.file_path.rename(src, dst)
        except OSError as exc:
            if exc.errno != errno.EXDEV or isinstance(exc, errors.SfstoreError):
                raise _typed(exc, f"cannot move it to {_url(dst)}", src) from None
            self.copy(src, dst, recursive=True, on_error="raise")
            self.rm(src, recursive=True)

    @_in_sf_terms
    def replace(self, path1: Any, path2: Any) -> None:
        """Rename ``path1`` to ``path2`` with one ``rename(2)`` beneath the root, as ``os.replace`` does.

        An existing file at ``path2`` (or an empty directory, when ``path1`` is a directory) is replaced
        atomically: a reader sees the old entry or the new one. Unlike :meth:`mv`, a directory at ``path2`` is
        never moved into, and nothing is copied: across mounts it fails (``EXDEV``), as do a file onto a
        directory (``EISDIR``) and a directory onto a non-empty one (``ENOTEMPTY``), each as sfstore's typed
        error.
        """
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if src == "" or dst == "":
            raise errors.InvalidRequestError("refusing to replace the sf:// root or to replace onto it")
        try:
            self.file_path.rename(src, dst)
        except OSError as exc:
            raise _typed(exc, f"cannot rename it onto {_url(dst)}", src) from None

    @_in_sf_terms
    def touch(self, path: Any, truncate: bool = True, **kwargs: Any) -> None:
        """Create an empty file (atomically), or with ``truncate=False`` update an existing file's times."""
        if truncate or not self.exists(path):
            self.pipe_file(path, b"")
            return
        name = self._strip_protocol(path)
        try:
            self.file_path.utime(name)
        except OSError as exc:
            raise _typed(exc, "cannot update the times of", name) from None

    # -- files -----------------------------------------------------------------------------------------------

    @_in_sf_terms
    def _open(
        self,
        path: Any,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> SFFile:
        return SFFile(
            self, self._strip_protocol(path), mode, block_size, autocommit, cache_options=cache_options, **kwargs
        )


class _EngineReadahead(BaseCache):  # type: ignore[misc]
    """Sequential readahead through the engine: the block being read, and the next one already in flight.

    A miss reads ``[start, start + blocksize)`` (at least up to the end asked for). When the reader goes on
    from the end of the block it had — sequential reading — the following block is started at once with an
    asynchronous engine read, so the next miss finds it done or nearly so. Random access starts no readahead.
    The two blocks are page-aligned buffers reused for the life of the file, so O_DIRECT reads land in them
    without a bounce copy; ``read()`` copies out of them once, as any cache does.
    """

    name = "sfreadahead"

    def __init__(self, blocksize: int, fetcher: Any, size: int, file: OpenFile) -> None:
        super().__init__(blocksize, fetcher, size)
        self._file = file
        self._blocks: list[mmap.mmap | None] = [None, None]
        self._cur = 0  # the block holding the cached bytes; the other one takes the read ahead
        self._cache: memoryview | None = None
        self.start = 0
        self.end = 0
        self._ahead: tuple[int, memoryview, Any] | None = None

    def _view(self, index: int, n: int) -> memoryview:
        block = self._blocks[index]
        if block is None or len(block) < n:
            block = self._blocks[index] = _aligned_buffer(max(n, self.blocksize))
        return memoryview(block)[:n]

    def _set_cache(self, view: memoryview | None, start: int, got: int) -> None:
        if self._cache is not None:
            self._cache.release()
        self._cache, self.start, self.end = view, start, start + got

    def _start_ahead(self, pos: int) -> None:
        n = min(self.blocksize, self.size - pos)
        if n > 0:
            view = self._view(1 - self._cur, n)
            self._ahead = (pos, view, self._file.read_into_async(view, pos, n))

    def _take_ahead(self, start: int, end: int) -> bool:
        """Make the block in flight current if it covers ``[start, end)``; drop it otherwise."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return False
        pos, view, fut = ahead
        try:
            got = int(fut.get())
        except Exception:  # the synchronous read that follows reports the error, if it persists
            view.release()
            return False
        if pos != start or pos + got < end:
            view.release()
            return False
        self._set_cache(view, pos, got)
        self._cur = 1 - self._cur
        return True

    def _slice(self, start: int, end: int) -> bytes:
        assert self._cache is not None
        return bytes(self._cache[start - self.start: end - self.start])

    def _fetch(self, start: int | None, end: int | None) -> bytes:
        start = 0 if start is None else start
        end = self.size if end is None else min(end, self.size)
        if start >= end:
            return b""
        if self.start <= start and end <= self.end:
            self.hit_count += 1
            return self._slice(start, end)
        self.miss_count += 1
        part = b""
        if self.start <= start < self.end:  # the head is cached: keep it, go on after it
            part = self._slice(start, self.end)
            start = self.end
        sequential = start == self.end  # the reader goes on from where the current block ends
        if not self._take_ahead(start, end):
            stop = min(self.size, max(end, start + self.blocksize))
            self.total_requested_bytes += stop - start
            self._set_cache(None, 0, 0)
            view = self._view(self._cur, stop - start)
            got = self._file.read_into(view, start, stop - start)
            self._set_cache(view, start, got)
        if sequential and self.end < self.size:
            self._start_ahead(self.end)
        return part + self._slice(start, min(end, self.end))

    def close(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with contextlib.suppress(Exception):
                ahead[2].get()
            ahead[1].release()
        self._set_cache(None, 0, 0)
        self._blocks = [None, None]


class SFFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file of :class:`SFFileSystem`: buffered reads with engine readahead, or an atomic streaming write.

    Modes: ``rb`` (reads through the engine; the default cache ``"sfreadahead"`` reads the next block while
    the caller consumes this one; any fsspec ``cache_type`` works too), ``wb`` and ``xb`` (stream into an
    :class:`~sfstore.paths.file.AtomicWriter`, published on :meth:`close`, discarded when a ``with`` block
    raises, when the file is garbage-collected unclosed, or by :meth:`discard`; ``xb`` refuses an existing file
    when opened and when published), ``ab`` (the same, after copying the existing bytes: atomic, at the cost of
    a copy). In a transaction (``autocommit=False``) the file is published by :meth:`commit`. Text mode (``w``)
    wraps the binary file in ``io.TextIOWrapper``, which closes — and so publishes — it even when a ``with``
    block raises; use a binary mode where a failed write must leave the old content.
    """

    closed: bool  # a property of AbstractBufferedFile

    def __init__(
        self,
        fs: SFFileSystem,
        path: str,
        mode: str = "rb",
        block_size: int | str | None = None,
        autocommit: bool = True,
        cache_type: str = "sfreadahead",
        cache_options: dict[str, Any] | None = None,
        size: int | None = None,
        fsync: bool = False,
        **kwargs: Any,
    ) -> None:
        self._writer: AtomicWriter | None = None
        self._file: OpenFile | None = None
        self._full = fs._host(path)
        bs = fs.blocksize if block_size in (None, "default") else block_size
        if mode == "rb":
            # Opened once, beneath the root: every later read is of this file, whatever is renamed meanwhile.
            self._file = fs._open_file(path)
            try:
                if size is None:
                    size = self._file.size
                ours = cache_type == _EngineReadahead.name
                super().__init__(
                    fs, path, mode, bs, autocommit, cache_type="none" if ours else cache_type,
                    cache_options=cache_options, size=size, **kwargs,
                )
                if ours:
                    self.cache = _EngineReadahead(self.blocksize, self._fetch_range, self.size, self._file)
            except BaseException:
                self._file.close()
                raise
            return
        if mode not in ("wb", "xb", "ab"):
            raise NotImplementedError(f"sf:// files support modes rb, wb, xb and ab, not {mode!r}")
        super().__init__(fs, path, mode, bs, autocommit, cache_options=cache_options, **kwargs)
        writer = fs.file_path.open_writer(path, overwrite=mode != "xb", fsync=fsync)
        if mode == "ab":
            try:
                try:
                    old: OpenFile | None = fs._open_file(path)
                except FileNotFoundError:
                    old = None
                if old is not None:
                    with old:
                        size = old.size
                        fs._pump(fs._sf_source(old), size, writer.write)
                    self.loc = size
            except BaseException:
                writer.discard()
                raise
        self._writer = writer

    # -- reading ---------------------------------------------------------------------------------------------

    def _fetch_range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` through the engine (parallel chunks), straight into the returned ``bytes``."""
        assert self._file is not None
        return self._file.read(start, max(0, end - start))

    def readinto(self, b: Any) -> int:
        """Read into ``b``; a read of a block or more goes from storage straight into ``b``."""
        if self.mode != "rb":
            raise ValueError("File not in read mode")
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        out = memoryview(b).cast("B")
        n = min(out.nbytes, max(0, self.size - self.loc))
        if n < self.blocksize:
            return int(super().readinto(out))
        assert self._file is not None
        got = self._file.read_into(out[:n], self.loc, n)
        self.loc += got
        return got

    # -- writing ---------------------------------------------------------------------------------------------

    def write(self, data: Any) -> int:
        """Accept ``data`` (bytes-like, numpy, CPU tensor); large writes go to storage without a copy."""
        if not self.writable():
            raise ValueError("File not in write mode")
        assert self._writer is not None
        n = self._writer.write(data)
        self.loc += n
        return n

    def flush(self, force: bool = False) -> None:
        """Nothing to do: data reaches storage as it is written, and the file is published on close."""
        if self.closed:
            raise ValueError("Flush on closed file")

    def commit(self) -> None:
        """Publish the file under its name (atomically)."""
        if self._writer is not None and not self._writer.closed:
            self._writer.close()

    def discard(self) -> None:
        """Drop what was written; any old content of the path stays."""
        if self._writer is not None:
            self._writer.discard()

    def close(self) -> None:
        """Publish the file (write modes, unless in a transaction) and release it."""
        if self.closed:
            return
        if self.mode == "rb":
            try:
                super().close()
            finally:
                if self._file is not None:
                    self._file.close()
            return
        try:
            if self.autocommit:
                self.commit()
        finally:
            self.closed = True

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None and self._writer is not None and not self.closed:
            self.discard()
            self.closed = True
            return
        self.close()

    def __del__(self) -> None:
        if self.closed:
            return
        if self._writer is not None:
            self.discard()  # never closed: nothing is published
            self.closed = True
        else:
            self.close()


# webdataset opens shard URLs through its own scheme table, not fsspec's: give it "sf" whenever sf:// is in use
# (now if webdataset is imported, else when it is; sfstore never imports it).
webdataset_gopen.install()
