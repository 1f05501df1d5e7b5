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

Older sfstore versions recorded no host; their names may still be on disk, and :func:`parse` reads them too
(``host`` is ``None``: they are taken for this host's, as the cleanups of those versions took them):

- ``.{final}.sfstore-tmp-{pid}-{rand}``: a file path's file being written;
- ``.sfstore-tmp-probe-{pid}-{rand}``: a file path's O_DIRECT probe file (``final`` is ``None``);
- ``.{final}.sfstore-part-{pid}-{rand}``: a local download by the CLI or ``get``.

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
# The names older writers left (see the module docs), read so their leftovers are still cleaned.
_OLDER = (
    re.compile(r"^\.(?P<final>.+)\.sfstore-(?P<kind>tmp|part)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)$"),
    re.compile(r"^\.sfstore-(?P<kind>tmp)-probe-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)$"),
)


@dataclass(frozen=True)
class TempName:
    """What a temporary name says: the name it becomes (``None``: an older probe file's, which had none), the
    kind of writer, its host (``None``: an older writer's, which recorded none) and its process id."""

    final: str | None
    kind: str
    host: str | None
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
    when it is not one; names older writers left are read too (see the module docs)."""
    base = os.path.basename(name)
    m = _CURRENT.match(base)
    if m is not None:
        return TempName(m["final"], m["kind"], m["host"], int(m["pid"]))
    for pattern in _OLDER:
        m = pattern.match(base)
        if m is not None:
            return TempName(m.groupdict().get("final"), m["kind"], None, int(m["pid"]))
    return None


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

    On this host (or for an older writer's name, which recorded no host) the writer is gone when its process
    no longer runs. Another host's processes cannot be asked: its names are leftovers once the entry is
    untouched for :data:`FOREIGN_STALE_SECONDS` (its ``lstat``, taken only then, may raise ``OSError``).
    """
    if tn.host is None or tn.host == host():
        return not pid_alive(tn.pid)
    return time.time() - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime >= FOREIGN_STALE_SECONDS
