"""Quarantine records: what a process whose KV tier missed its I/O deadline publishes, for other processes.

A KV tier that misses its deadline is quarantined by the process that uses it (:mod:`sfstore.kvcache.deadline`):
per-process state, which that process also publishes as a small record, so that ``sfstore probe`` and ``sfstore kv
du`` (other processes) can see it, and so that a process killed while quarantined leaves a record that says when it
ends. This host's records are in the data directory (:func:`quarantine_dir`); a shared tier's also in its own
directory. The format is here, below both the KV cache that writes it and the probe that reads it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Sequence
from typing import Any

from sfstore import defaults, records, temp_names

__all__ = ["QUARANTINE_VERSION", "QUARANTINE_SUBDIR", "host_name", "quarantine_dir", "encode_quarantine",
           "parse_quarantine", "quarantine_in_force", "write_quarantine_record", "remove_quarantine_record",
           "read_quarantine_records", "quarantine_rows"]

QUARANTINE_VERSION = 1
QUARANTINE_SUBDIR = os.path.join(".kvcache-state", "quarantine")  # under the data directory
_QUARANTINE_MAX = 16 << 10  # a record longer than this is not one of ours
_QUARANTINE_LEFTOVER_S = 60.0  # a torn record or a temporary file this old is a dead writer's
_QUARANTINE_FIELDS: dict[str, type] = {"host": str, "pid": int, "tier": str, "target": str, "namespace": str,
                                       "since": float, "until": float, "reason": str, "abandoned": int,
                                       "deadline_ms": int, "written": float}


def host_name() -> str:
    """This host's name as quarantine and usage records carry it (a file-name-safe form)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname() or "host")[:64]


def quarantine_dir(data_dir: str | None = None) -> str:
    """The directory of this host's quarantine records: ``.kvcache-state/quarantine`` in the data directory
    (``data_dir``, default the ``data_dir`` setting)."""
    base = os.path.abspath(os.path.expanduser(data_dir)) if data_dir else str(defaults.get("data_dir"))
    return os.path.join(base, QUARANTINE_SUBDIR)


def encode_quarantine(record: dict[str, Any]) -> bytes:
    """A quarantine record's bytes: JSON with every field of :func:`parse_quarantine` (and the version)."""
    return json.dumps({"v": QUARANTINE_VERSION, **{k: record[k] for k in _QUARANTINE_FIELDS}}).encode()


def parse_quarantine(data: bytes) -> dict[str, Any] | None:
    """The record in ``data`` (``host``, ``pid``, ``tier``, ``target``: the tier's directory or device, ``""``
    when its process did not say, ``namespace``, ``since`` and ``until``: wall-clock seconds when the
    quarantine began and when it ends (its process probes the tier then), ``reason``, ``abandoned``: worker
    threads stuck in the tier's I/O, ``deadline_ms``, ``written``), or ``None`` for anything torn or foreign."""
    try:
        d = json.loads(data)
        if not isinstance(d, dict) or d.get("v") != QUARANTINE_VERSION:
            return None
        out = {k: kind(d[k]) for k, kind in _QUARANTINE_FIELDS.items()}
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
    return out


def _pid_alive(pid: int) -> bool:
    try:
        return temp_names.pid_alive(pid)
    except OverflowError:  # a record's pid beyond any process id: a foreign writer's, not judged here
        return pid > 0


def quarantine_in_force(record: dict[str, Any], now: float | None = None) -> bool:
    """Whether a record's quarantine holds at ``now`` (wall clock): it has not ended, and, when its process ran
    on this host, that process is alive (one on another host is trusted until its ``until``)."""
    if record["until"] <= (time.time() if now is None else now):
        return False
    return record["host"] != host_name() or _pid_alive(record["pid"])


def _temporary_gone(dirfd: int, name: str) -> bool:
    """Whether the record's temporary file ``name`` was left by a writer that is gone."""
    tn = temp_names.parse(name)
    if tn is None:
        return False
    try:
        return temp_names.is_leftover(tn, name, dir_fd=dirfd)
    except OSError:
        return False  # gone meanwhile, or not statable: the minute's rule decides


def write_quarantine_record(directory: str, name: str, record: dict[str, Any]) -> None:
    """Write ``record`` as ``<name>.json`` in ``directory`` (made when missing), atomically: a reader sees the
    previous record or this one, whole."""
    os.makedirs(directory, exist_ok=True)
    dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        records.write_atomically(dirfd, f"{name}.json", encode_quarantine(record))
    finally:
        os.close(dirfd)


def remove_quarantine_record(directory: str, name: str) -> None:
    """Remove the record ``<name>.json`` from ``directory`` (nothing when it is not there)."""
    try:
        os.unlink(os.path.join(directory, f"{name}.json"))
    except FileNotFoundError:
        pass


def read_quarantine_records(directory: str, *, clean: bool = False) -> list[dict[str, Any]]:
    """The quarantines still in force that ``directory``'s records describe (each record with its ``name``),
    oldest first. ``clean``: remove the records that no longer hold (ended, or of a dead process of this host),
    and torn records and temporary files a minute old or whose writer is gone (one killed mid-write)."""
    try:
        dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    out: list[dict[str, Any]] = []
    now = time.time()
    try:
        for name in os.listdir(dirfd):
            data, st = records.read_small(dirfd, name, _QUARANTINE_MAX)
            temporary = name.startswith(".")
            rec = parse_quarantine(data) if data is not None and not temporary and name.endswith(".json") else None
            if rec is not None and quarantine_in_force(rec, now):
                out.append({"name": name[:-len(".json")], **rec})
                continue
            old = st is not None and now - st.st_mtime > _QUARANTINE_LEFTOVER_S
            if clean and (rec is not None or old or (temporary and _temporary_gone(dirfd, name))):
                try:
                    os.unlink(name, dir_fd=dirfd)
                except OSError:
                    pass  # another reader removed it, or it is not ours to remove
    finally:
        os.close(dirfd)
    return sorted(out, key=lambda r: (r["since"], r["name"]))


def quarantine_rows(records: Sequence[dict[str, Any]], now: float | None = None) -> list[list[Any]]:
    """Table rows of quarantine records: host, pid, tier, target, since (UTC), seconds left, stuck workers,
    reason."""
    t = time.time() if now is None else now
    return [[r["host"], r["pid"], r["tier"] + (f" ({r['namespace']})" if r["namespace"] else ""),
             r["target"] or "-", time.strftime("%H:%M:%S", time.gmtime(r["since"])),
             f"{max(0.0, r['until'] - t):.1f} s", r["abandoned"], r["reason"]] for r in records]
