"""Local files written whole or not at all (records kept beside the data, the CLI's and ``get``'s downloads, the
Trainer's commit record), and small records read without ever waiting on a FIFO, following a symlink or reading
more than a bound.

Everything acts relative to a directory descriptor, so a directory swapped for a symlink meanwhile is never acted
on by name (the callers open it beneath their root, or open the local directory they were given).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

from sfstore import temp_names

__all__ = ["atomic_file", "write_atomically", "fsync_dir_fd", "read_small"]


@contextlib.contextmanager
def atomic_file(dirfd: int, name: str, *, kind: str = "tmp", fsync: bool = False) -> Iterator[int]:
    """A descriptor to write the file ``name`` of the directory ``dirfd`` through: a temporary name
    (:func:`sfstore.temp_names.temp_name` of ``kind``, created exclusively, never through a symlink), renamed over
    ``name`` when the block ends, so a reader sees the old file or the new one whole. With ``fsync`` the file is
    fsynced before the rename and the directory after it (durable once this returns). The temporary is removed
    when anything fails; the descriptor is closed either way."""
    tmp = temp_names.temp_name(name, kind)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dirfd)
    try:
        try:
            yield fd
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirfd)
        raise
    if fsync:
        fsync_dir_fd(dirfd)


def write_atomically(dirfd: int, name: str, data: bytes, *, kind: str = "tmp", fsync: bool = False) -> None:
    """Write ``data`` as the file ``name`` in the directory ``dirfd`` with :func:`atomic_file`. Without ``fsync``
    (the default) for records that are rewritten often and rebuilt when lost."""
    with atomic_file(dirfd, name, kind=kind, fsync=fsync) as fd:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def fsync_dir_fd(dirfd: int) -> None:
    """``fsync`` a directory: a rename or a new file in it is durable once this returns."""
    os.fsync(dirfd)


def read_small(dirfd: int, name: str, limit: int) -> tuple[bytes | None, os.stat_result | None]:
    """``(bytes, stat)`` of the regular file ``name`` in ``dirfd`` when it holds at most ``limit`` bytes; the
    bytes are ``None`` for anything else (a FIFO is opened without waiting, a symlink refused) and both are
    ``None`` when it cannot be opened or read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None, st
        return os.pread(fd, limit, 0), st
    except OSError:
        return None, None
    finally:
        os.close(fd)
