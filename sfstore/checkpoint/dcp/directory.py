"""Where a DCP checkpoint lives and what it holds: its url (the checkpoint's url rules,
:mod:`sfstore.checkpoint.location`), the directory reached beneath its root, the names of its files, and what the
writer and the reader share of it.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Any

from sfstore import errors, forks
from sfstore.checkpoint import location
from sfstore.paths.file import FilePath

__all__ = [
    "METADATA_NAME",
    "DATA_SUFFIX",
    "TORCH_METADATA_NAME",
    "DATA_NAME",
    "RANK_METADATA",
    "TORCH_DATA_NAME",
    "TORCH_RANK_METADATA",
    "metadata_name",
    "torch_metadata_name",
    "split_url",
    "checkpoint_url",
    "resolve_checkpoint_dir",
    "CheckpointDir",
    "stat_in",
    "open_checkpoint_dir",
    "CheckpointStorage",
]

METADATA_NAME = "sfstore-dcp-metadata.json"
"""The metadata file of a checkpoint saved with rank coordination."""
DATA_SUFFIX = ".sfdcp"
"""Suffix of the per-rank data files."""
TORCH_METADATA_NAME = ".metadata"
"""The (pickled) metadata file of DCP's own format (``FileSystemWriter``, ``FsspecWriter``)."""
DATA_NAME = re.compile(r"^__(\d+)_([0-9a-f]+)\.sfdcp$")
"""A data file of this storage: ``__<rank>_<token>.sfdcp``."""
RANK_METADATA = re.compile(r"^__(\d+)\." + re.escape(METADATA_NAME) + "$")
"""One rank's metadata of a save without rank coordination: ``__<rank>.sfstore-dcp-metadata.json``."""
TORCH_DATA_NAME = re.compile(r"^__(\d+)_\d+\.distcp$")
"""A data file of DCP's own format: ``__<rank>_<n>.distcp``."""
TORCH_RANK_METADATA = re.compile(r"^__(\d+)\.metadata(\.tmp)?$")
"""One rank's metadata of DCP's own format (and its temporary name)."""

_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)


def metadata_name(rank: int | None) -> str:
    """The metadata file of a coordinated save (``rank`` None) or of one rank's save without coordination."""
    return METADATA_NAME if rank is None else f"__{rank}.{METADATA_NAME}"


def torch_metadata_name(rank: int | None) -> str:
    """:func:`metadata_name` of DCP's own format."""
    return TORCH_METADATA_NAME if rank is None else f"__{rank}{TORCH_METADATA_NAME}"


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``(kind, path)`` of a checkpoint url as :func:`sfstore.checkpoint.location.split_url` has them, refusing a
    relative url that names no directory below its root; no I/O."""
    kind, where = location.split_url(url)
    if kind != location.ABSOLUTE and where in ("", ".", ".."):
        raise errors.InvalidRequestError(f"checkpoint url {os.fspath(url)!r} names no checkpoint directory")
    return kind, where


def checkpoint_url(url: str | os.PathLike[str]) -> str:
    """The text of ``url`` once :func:`split_url` accepts it."""
    split_url(url)
    return location.url_text(url)


def resolve_checkpoint_dir(url: str | os.PathLike[str]) -> str:
    """The absolute checkpoint directory that ``url`` names (not created): a name, true when computed, for
    messages and checks; the writer and reader never act on it (they resolve beneath the root at each use).

    Parameters
    ----------
    url : str or os.PathLike
        ``"sf://a/b"`` (``<root>/a/b``, below the ``sf://`` root), ``"a/b"`` (below the checkpoint class root),
        or an absolute path / ``file://`` url.

    Returns
    -------
    str
        The directory.

    Raises
    ------
    sfstore.errors.PathEscapeError
        A relative name that climbs out of its root (or names the root itself), or a NUL byte.
    sfstore.errors.InvalidRequestError
        Another url scheme, or an empty name.
    """
    kind, where = split_url(url)
    if kind == location.ABSOLUTE:
        return where
    root = location.root_for(kind)
    full = root.resolve(where)
    if full == root.root:
        raise errors.PathEscapeError(f"checkpoint url {url!r} resolves to the root {root.root} itself")
    return full


class CheckpointDir:
    """A DCP checkpoint directory: the file path whose root it is under and its name below that root
    (``prefix``, ``""`` when it is the root itself).

    A reader names each file below the root, resolved beneath it at each use; a writer works in
    :meth:`dirfd`, the directory opened beneath the root once, so every file of one save lands in the same
    directory whatever is swapped meanwhile. Either way a directory on the way swapped for a symlink to
    elsewhere is refused, never followed out of the root.
    """

    def __init__(self, fp: FilePath, prefix: str) -> None:
        self.fp, self.prefix = fp, prefix
        self._fd = -1
        forks.after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # The child opens the directory again on first use; the inherited descriptor is left open, as the
        # file path's root is (sfstore.paths.beneath).
        self._fd = -1

    def name(self, file: str) -> str:
        """``file`` of the directory, named below the root."""
        return f"{self.prefix}/{file}" if self.prefix else file

    def full(self, file: str = "") -> str:
        """The absolute name of ``file`` (of the directory itself by default), for messages."""
        return self.fp.full(self.name(file) if file else self.prefix)

    def dirfd(self) -> int:
        """The directory's ``O_PATH`` descriptor, opened beneath the root on first use (again after a fork)."""
        if self._fd < 0:
            try:
                self._fd = self.fp.open_fd(self.prefix or ".", _O_PATH | os.O_DIRECTORY)
            except errors.SfstoreError:
                raise
            except OSError as exc:
                raise errors.os_error(exc.errno or errno.EIO, "cannot open the checkpoint directory",
                                      self.full()) from None
        return self._fd

    def open_readable(self) -> int:
        """A readable descriptor of the directory (for listing and fsync); the caller closes it."""
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dirfd())
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot open the checkpoint directory", self.full()) from None

    def close(self) -> None:
        """Close :meth:`dirfd` (a descriptor inherited over a fork is the parent's: left alone)."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def __del__(self) -> None:
        self.close()


def stat_in(ck: CheckpointDir, name: str, *, by_name: bool = False) -> os.stat_result | None:
    """``lstat`` of ``name`` in the checkpoint directory, None when it is missing: in the writer's
    :meth:`CheckpointDir.dirfd`, or (``by_name``, as a reader names its files) resolved beneath the root now."""
    try:
        if by_name:
            return ck.fp.os_stat(ck.name(name), follow=False)
        return os.stat(name, dir_fd=ck.dirfd(), follow_symlinks=False)
    except FileNotFoundError:
        return None
    except errors.SfstoreError:
        raise
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "stat", ck.full(name)) from None


def _router() -> Any:
    import sfstore

    return sfstore.open()


def open_checkpoint_dir(url: str, *, create: bool, direct: str | None, chunk_size: int | None,
                        parallelism: int | None) -> CheckpointDir:
    """The checkpoint directory ``url`` names, on a file path with these options; ``create`` makes it (and its
    parents below the root) if missing, else a missing one is :class:`~sfstore.errors.PathNotFoundError`."""
    kind, where = split_url(url)
    options: dict[str, Any] = {"direct": direct, "chunk_size": chunk_size, "parallelism": parallelism}
    if kind == location.ABSOLUTE:
        if not create and not os.path.isdir(where):
            raise errors.os_error(errno.ENOENT, f"no checkpoint at {url!r} (directory missing)", where)
        return CheckpointDir(_router().location(where, create=create, **options), "")
    root = location.root_for(kind, write=create)
    parts = root.parts(where)  # '..' above the root refused; symlinks are met beneath it, at each use
    if not parts:
        raise errors.PathEscapeError(f"checkpoint url {url!r} resolves to the root {root.root} itself")
    prefix = "/".join(parts)
    fp = _router().location(root.root, create=False, **options)
    try:
        if create:
            fp.mkdir(prefix, parents=True, exist_ok=True)
        elif not stat.S_ISDIR(fp.stat(prefix).st_mode):
            raise errors.os_error(errno.ENOTDIR, f"no checkpoint at {url!r} (not a directory)", fp.full(prefix))
    except errors.PathNotFoundError:
        raise errors.os_error(errno.ENOENT, f"no checkpoint at {url!r} (directory missing)", fp.full(prefix)) from None
    except errors.SfstoreError:
        raise
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, f"cannot create checkpoint {url!r}", fp.full(prefix)) from None
    return CheckpointDir(fp, prefix)


class CheckpointStorage:
    """What :class:`~sfstore.checkpoint.dcp.StorageWriter` and :class:`~sfstore.checkpoint.dcp.StorageReader`
    share: the checkpoint url, the file path options, the directory opened on first use (created for a writer:
    ``creates``), and the rank DCP set them up on.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint directory (see :class:`~sfstore.checkpoint.dcp.StorageWriter`).
    direct, chunk_size, parallelism : optional
        Passed to :class:`~sfstore.paths.file.FilePath`.
    """

    creates = False
    """Whether the directory is made when missing (a writer's) or must exist (a reader's)."""

    def __init__(self, url: str | os.PathLike[str], *, direct: str | None, chunk_size: int | None,
                 parallelism: int | None) -> None:
        super().__init__()
        self.url = checkpoint_url(url)
        self._fp_options: dict[str, Any] = {"direct": direct, "chunk_size": chunk_size, "parallelism": parallelism}
        self._fp: CheckpointDir | None = None
        self.rank: int | None = None
        self.use_collectives = True

    def _switch_to(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Use ``checkpoint_id`` from now on (None or empty: keep the current url), as a ``reset`` is given it."""
        if checkpoint_id:
            text = checkpoint_url(checkpoint_id)
            if text != self.url:
                self.url, self._fp = text, None

    def _set_up_rank(self, kwargs: dict[str, Any]) -> None:
        """Take ``rank`` and ``use_collectives`` from the keyword arguments DCP's set-up passes."""
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else None
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def _path(self) -> CheckpointDir:
        if self._fp is None:
            self._fp = open_checkpoint_dir(self.url, create=self.creates, **self._fp_options)
        return self._fp

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint url this storage saves to or loads from."""
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a url this storage understands (``sf://``, ``file://``, a path or name).

        Parameters
        ----------
        checkpoint_id : str or os.PathLike
            The id.

        Returns
        -------
        bool
            True for those forms; False for other schemes (``s3://``...) or malformed ids. No I/O.
        """
        try:
            split_url(checkpoint_id)
        except (errors.SfstoreError, TypeError):
            return False
        return True
