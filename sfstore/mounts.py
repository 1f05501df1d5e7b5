"""The mount table: which filesystem, source and options serve a path.

Reads ``/proc/self/mountinfo`` (see ``proc_pid_mountinfo(5)``). Each line is::

    36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
    (1)(2)(3)   (4)   (5)      (6)      (7)   (8) (9)   (10)         (11)

mount ID, parent ID, major:minor, root of the mount within its filesystem, mount point, per-mount options,
optional fields ended by ``-``, filesystem type, source, and the filesystem's (super block) options. Paths are
escaped as octal (``\\040`` for a space).

>>> m = parse_mountinfo_line("36 35 0:52 / /mnt/nfs rw,relatime shared:1 - nfs4 10.0.0.1:/export "
...                          "rw,vers=4.2,rsize=1048576,wsize=1048576,proto=rdma,port=20049")
>>> m.fstype, m.source, m.nfs_proto, m.option("vers")
('nfs4', '10.0.0.1:/export', 'rdma', '4.2')
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sfstore.errors import NotSupportedOnHostError

__all__ = [
    "MountInfo",
    "MOUNTINFO",
    "NFS_TYPES",
    "parse_options",
    "parse_mountinfo_line",
    "parse_mountinfo",
    "read_mountinfo",
    "mount_for",
    "nfs_mounts",
    "unescape",
]

MOUNTINFO = "/proc/self/mountinfo"
NFS_TYPES = frozenset({"nfs", "nfs4"})

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(text: str) -> str:
    """Undo the kernel's octal escapes of mountinfo fields (``\\040`` space, ``\\011`` tab, ``\\134`` ``\\``)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), text)


def parse_options(text: str) -> dict[str, str | None]:
    """Split a comma-separated option string: ``"rw,vers=4.2"`` gives ``{"rw": None, "vers": "4.2"}``."""
    options: dict[str, str | None] = {}
    for item in text.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        options[unescape(key)] = unescape(value) if sep else None
    return options


@dataclass(frozen=True)
class MountInfo:
    """One line of the mount table.

    Attributes
    ----------
    mount_id, parent_id : int
        The mount's ID and its parent's.
    device : str
        ``major:minor`` of the filesystem's device (``st_dev`` of paths on it).
    root : str
        The directory of the filesystem mounted here (``/`` unless a bind mount of a subdirectory).
    mountpoint : str
        Where it is mounted.
    options : dict
        Per-mount options (``rw``, ``noatime``, ...); flags map to ``None``.
    optional_fields : tuple of str
        Propagation fields such as ``shared:1``.
    fstype : str
        Filesystem type (``ext4``, ``nfs4``, ``tmpfs``; ``fuse.x`` for FUSE).
    source : str
        What is mounted: a device, ``server:/export`` for NFS, or a pseudo name.
    super_options : dict
        The filesystem's own options; for NFS they hold ``vers``, ``proto``, ``rsize``, ``wsize``,
        ``nconnect``, ``port`` and ``addr``.
    """

    mount_id: int
    parent_id: int
    device: str
    root: str
    mountpoint: str
    options: dict[str, str | None] = field(default_factory=dict)
    optional_fields: tuple[str, ...] = ()
    fstype: str = ""
    source: str = ""
    super_options: dict[str, str | None] = field(default_factory=dict)

    def option(self, name: str, default: str | None = None) -> str | None:
        """The value of option ``name``: super options first, then per-mount options, else ``default``.

        A flag that is set (``ro``, ``hard``) returns ``""``.
        """
        for opts in (self.super_options, self.options):
            if name in opts:
                value = opts[name]
                return "" if value is None else value
        return default

    @property
    def read_only(self) -> bool:
        """Whether the mount is read-only."""
        return "ro" in self.options or "ro" in self.super_options

    @property
    def is_nfs(self) -> bool:
        """Whether this is an NFS mount (``nfs`` or ``nfs4``)."""
        return self.fstype in NFS_TYPES

    @property
    def nfs_proto(self) -> str | None:
        """NFS transport (``rdma``, ``tcp``, ``udp``, ``tcp6``...) or ``None`` for other filesystems."""
        if not self.is_nfs:
            return None
        return self.option("proto")

    @property
    def transport(self) -> str:
        """How data reaches the filesystem: ``rdma`` or ``tcp``/``udp`` for NFS, ``local`` otherwise."""
        proto = self.nfs_proto
        if proto is None:
            return "network" if self.fstype.startswith(("cifs", "smb", "ceph", "fuse.")) else "local"
        return "rdma" if proto.startswith("rdma") else proto.rstrip("6") or "tcp"

    def nfs_facts(self) -> dict[str, Any]:
        """The NFS facts the probe reports: server:export, vers, proto, rsize, wsize, nconnect, port."""
        server, _, export = self.source.rpartition(":")

        def num(name: str) -> int | None:
            value = self.option(name)
            return int(value) if value and value.isdigit() else None

        return {
            "mountpoint": self.mountpoint,
            "source": self.source,
            "server": server or None,
            "export": export,
            "fstype": self.fstype,
            "vers": self.option("vers"),
            "proto": self.option("proto"),
            "rsize": num("rsize"),
            "wsize": num("wsize"),
            "nconnect": num("nconnect") or 1,
            "port": num("port"),
            "addr": self.option("addr"),
            "read_only": self.read_only,
        }

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return {
            "mount_id": self.mount_id,
            "parent_id": self.parent_id,
            "device": self.device,
            "root": self.root,
            "mountpoint": self.mountpoint,
            "options": dict(self.options),
            "optional_fields": list(self.optional_fields),
            "fstype": self.fstype,
            "source": self.source,
            "super_options": dict(self.super_options),
        }


def parse_mountinfo_line(line: str) -> MountInfo:
    """Parse one line of ``/proc/<pid>/mountinfo``.

    Raises
    ------
    ValueError
        The line does not have mountinfo's layout.
    """
    fields = line.strip().split(" ")
    try:
        sep = fields.index("-", 6)
    except ValueError:
        raise ValueError(f"not a mountinfo line (no ' - ' separator): {line!r}") from None
    if sep < 6 or len(fields) < sep + 3:
        raise ValueError(f"not a mountinfo line (too few fields): {line!r}")
    try:
        mount_id, parent_id = int(fields[0]), int(fields[1])
    except ValueError:
        raise ValueError(f"not a mountinfo line (mount IDs are not numbers): {line!r}") from None
    return MountInfo(
        mount_id=mount_id,
        parent_id=parent_id,
        device=fields[2],
        root=unescape(fields[3]),
        mountpoint=unescape(fields[4]),
        options=parse_options(fields[5]),
        optional_fields=tuple(fields[6:sep]),
        fstype=unescape(fields[sep + 1]),
        source=unescape(fields[sep + 2]),
        super_options=parse_options(fields[sep + 3]) if len(fields) > sep + 3 else {},
    )


def parse_mountinfo(text: str | Iterable[str]) -> list[MountInfo]:
    """Parse a whole mount table; blank and malformed lines are skipped."""
    lines = text.splitlines() if isinstance(text, str) else text
    mounts = []
    for line in lines:
        if not line.strip():
            continue
        try:
            mounts.append(parse_mountinfo_line(line))
        except ValueError:
            continue
    return mounts


def read_mountinfo(path: str = MOUNTINFO) -> list[MountInfo]:
    """Read and parse the mount table of this process (or the file ``path``).

    Raises
    ------
    NotSupportedOnHostError
        The file cannot be read (no ``/proc``: not Linux, or a sandbox without it).
    """
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())
    except OSError as exc:
        raise NotSupportedOnHostError(f"cannot read the mount table {path}: {exc.strerror or exc}") from None


def _existing(path: str) -> str:
    """``path`` made absolute with symlinks resolved; a missing tail is walked up to its nearest existing parent."""
    full = os.path.realpath(os.path.abspath(os.fspath(path)))
    while not os.path.exists(full):
        parent = os.path.dirname(full)
        if parent == full:
            break
        full = parent
    return full


def _contains(mountpoint: str, path: str) -> bool:
    return path == mountpoint or mountpoint == "/" or path.startswith(mountpoint.rstrip("/") + "/")


def mount_for(path: str | os.PathLike[str], mounts: Sequence[MountInfo] | None = None) -> MountInfo:
    """Return the mount that serves ``path``.

    The path is resolved (symlinks followed; a path that does not exist yet is judged by its nearest existing
    parent, i.e. where it would be created). Of the mounts whose mount point contains it, the deepest wins, and
    of several on the same mount point the last mounted (the one on top).

    Parameters
    ----------
    path : str or path-like
        Any path.
    mounts : sequence of MountInfo, optional
        A mount table to search instead of this process's (tests pass parsed samples); ``path`` is then only
        normalised, not resolved against this machine's filesystem.

    Raises
    ------
    NotSupportedOnHostError
        No mount table, or no mount in it contains the path.
    """
    table = read_mountinfo() if mounts is None else mounts
    target = _existing(os.fspath(path)) if mounts is None else os.path.normpath(os.fspath(path))
    best: MountInfo | None = None
    for mount in table:
        if _contains(mount.mountpoint, target) and (best is None or len(mount.mountpoint) >= len(best.mountpoint)):
            best = mount
    if best is None:
        raise NotSupportedOnHostError(f"no mount in the mount table contains {target}")
    return best


def nfs_mounts(mounts: Sequence[MountInfo] | None = None) -> list[MountInfo]:
    """Every NFS mount (``nfs`` and ``nfs4``) of the mount table."""
    return [m for m in (read_mountinfo() if mounts is None else mounts) if m.is_nfs]
