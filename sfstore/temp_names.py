"""Temporary names: what sfstore writes under before a rename publishes it, and how cleanups read them back.

Everything sfstore publishes atomically (a file path's files, a checkpoint directory, a block image, a file the
CLI or ``get`` writes locally) is first written under a hidden name in the same directory, made by
:func:`temp_name`::

    .{final}.sfstore-{kind}-{host}-{pid}-{rand}

``final`` is the name it will be published as, ``kind`` says which writer made it (``tmp``: a file path's
file; ``staging``/``old``: a checkpoint directory being written or the one it replaces; ``part``: a local
download; ``image``: a block image being allocated), ``host`` and ``pid`` say which process, ``rand`` keeps two
writers of one process apart. :func:`parse` reads such a name back, and :func:`is_leftover` tells whether the
process that made it is gone, so a cleanup removes a crashed writer's leftovers and never a live writer's work.

This module imports nothing of sfstore's, so every layer may use it.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from dataclasses import dataclass

__all__ = ["TempName", "temp_name", "parse", "is_leftover", "host", "pid_alive", "FOREIGN_STALE_SECONDS"]

FOREIGN_STALE_SECONDS = 24 * 3600
"""Another host's temporary names are taken for leftovers only when untouched this long: its processes cannot be
asked whether they still run."""

_KIND = re.compile(r"[a-z]+")
_CURRENT = re.compile(
    r"^\.(?P<final>.+)\.sfstore-(?P<kind>[a-z]+)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)$"
)


@dataclass(frozen=True)
class TempName:
    """What a temporary name says: the name it becomes, the kind of writer, its host and its process id."""

    final: str
    kind: str
    host: str
    pid: int


def host() -> str:
    """This host's name as temporary names carry it: letters, digits and ``_`` (anything else becomes ``_``),
    64 at most."""
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:64] or "host"


def temp_name(final: str, kind: str) -> str:
    """A fresh hidden temporary name for ``final`` (a name in the same directory) written by a ``kind`` writer
    (lower-case letters) of this process: ``.{final}.sfstore-{kind}-{host}-{pid}-{rand}``."""
    if not _KIND.fullmatch(kind):
        raise ValueError(f"a temporary name's kind is lower-case letters, not {kind!r}")
    return f".{final}.sfstore-{kind}-{host()}-{os.getpid()}-{secrets.token_hex(6)}"


def parse(name: str) -> TempName | None:
    """What the temporary name ``name`` (a base name, or a path whose last component is read) says, ``None``
    when it is not one."""
    m = _CURRENT.match(os.path.basename(name))
    return None if m is None else TempName(m["final"], m["kind"], m["host"], int(m["pid"]))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (ours included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_leftover(tn: TempName, name: str, *, dir_fd: int | None = None) -> bool:
    """Whether the writer that made ``tn`` (read from the entry ``name``, of the directory ``dir_fd`` when
    given) is gone, so what it left may be removed.

    On this host the writer is gone when its process no longer runs. Another host's processes cannot be asked:
    its names are leftovers once the entry is untouched for :data:`FOREIGN_STALE_SECONDS` (its ``lstat``, taken
    only then, may raise ``OSError``).
    """
    if tn.host == host():
        return not pid_alive(tn.pid)
    return time.time() - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime >= FOREIGN_STALE_SECONDS
