"""Small record files kept beside the data (usage and quarantine records): written whole or not at all, and read
without ever waiting on a FIFO, following a symlink or reading more than a bound.

Both act relative to a directory descriptor, so a directory swapped for a symlink meanwhile is never acted on by
name (the callers open it beneath their root).
"""

from __future__ import annotations

import os
import stat

from sfstore import temp_names

__all__ = ["write_atomically", "read_small"]


def write_atomically(dirfd: int, name: str, data: bytes) -> None:
    """Write ``data`` as the file ``name`` in the directory ``dirfd``: into a temporary name
    (:func:`sfstore.temp_names.temp_name`, created exclusively, never through a symlink), then renamed over
    ``name``, so a reader sees the old file or the new one whole. Not fsynced: for records that are rewritten
    often and rebuilt when lost. The temporary is removed when anything fails."""
    tmp = temp_names.temp_name(name, "tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dirfd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dirfd)
        except OSError:
            pass
        raise


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
